"""``jax_effects.progress``: the same bar with and without tqdm, its options,
and the terminal it shares with ``print`` and ``log``.

Contract: ``jax_effects/_runtime/bars.py`` (its standard-library renderer too)
(README "Progress bars for compiled loops"; ``docs/reference.md``
``progress``). Oracles: tqdm itself where it is installed (the
standard-library renderer's text is ``tqdm.format_meter``'s, and a program's
drawings are tqdm's), and a terminal emulator (``\\r`` returns to the start
of the line, ``\\n`` starts the next): on the screen every printed or logged
line stands whole on a line of its own, never inside a bar's line.
"""
import io
import logging
import random
import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_effects as je
from jax_effects._runtime import bars as _bars
from jax_effects._runtime import output as _output
from jax_effects._runtime import bars as _plain_bars

RENDERERS = ["plain", "tqdm"]


@pytest.fixture
def renderer(request, monkeypatch):
  """``"plain"``: tqdm cannot be imported; ``"tqdm"``: it draws."""
  if request.param == "plain":
    for name in ("tqdm", "tqdm.auto", "tqdm.std"):
      monkeypatch.setitem(sys.modules, name, None)
  else:
    pytest.importorskip("tqdm")
  return request.param


class Terminal:
  """A text stream that is a terminal (``isatty``), keeping what it got."""

  def __init__(self, tty=True):
    self.tty = tty
    self.chunks = []
    self.lock = threading.Lock()

  def write(self, text):
    with self.lock:
      self.chunks.append(text)
    return len(text)

  def flush(self):
    pass

  def isatty(self):
    return self.tty

  def text(self):
    return "".join(self.chunks)


def screen(text):
  """The lines a terminal shows for ``text`` (trailing blanks removed)."""
  lines, col = [[]], 0
  for ch in text:
    if ch == "\r":
      col = 0
    elif ch == "\n":
      lines.append([])
      col = 0
    else:
      line = lines[-1]
      if col < len(line):
        line[col] = ch
      else:
        line.append(ch)
      col += 1
  return ["".join(line).rstrip() for line in lines]


_BAR = re.compile(r"^(?P<desc>[^:|]*): +\d+%\|.{10}\| (?P<n>\d+)/(?P<total>\d+)"
                  r" \[[^\]]*\]$")


def _bar_or_line(line):
  m = _BAR.match(line)
  return ("bar", m["desc"], f"{m['n']}/{m['total']}") if m else line


def _program(steps, logger, **options):
  @je.jit
  def f(x):
    with je.progress(steps, desc="t", mininterval=0, **options) as bar:
      def step(c, _):
        je.print("step {}", c)
        je.log("logged {}", c, logger=logger)
        bar.update()
        return c + 1, None
      return jax.lax.scan(step, x, None, length=steps)[0]
  return f


@pytest.fixture
def on_terminal(monkeypatch):
  """Returns ``start()``, which puts stdout, stderr and a logger's handler
  on one Terminal and returns ``(terminal, logger)``. (Called in the test:
  pytest's own capture sets ``sys.stdout`` again when the test starts.)"""
  logger = logging.getLogger("test_progress_rendering")
  handlers = []

  def start():
    term = Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(sys, "stderr", term)
    handler = logging.StreamHandler(term)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    handlers.append(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return term, logger

  yield start
  for handler in handlers:
    logger.removeHandler(handler)
  logger.setLevel(logging.NOTSET)
  logger.propagate = True


@pytest.mark.parametrize("renderer", RENDERERS, indirect=True)
def test_prints_and_logs_never_break_the_bar_line(renderer, on_terminal):
  """Issue 29: a line printed or logged while a bar is drawn in place goes
  through the bar's writer (tqdm.write's clear, write, redraw)."""
  term, logger = on_terminal()
  options = {"miniters": 1} if renderer == "tqdm" else {}
  f = _program(3, logger, ascii=True, **options)
  assert f(0) == 3
  je.effects_barrier()
  shown = [_bar_or_line(line) for line in screen(term.text()) if line]
  assert shown == ["step 0", "INFO logged 0", "step 1", "INFO logged 1",
                   "step 2", "INFO logged 2", ("bar", "t", "3/3")], (
                       term.text())
  assert _output._around is None   # (no bar is drawn any more)


@pytest.mark.parametrize("renderer", RENDERERS, indirect=True)
def test_leave_false_erases_the_bar(renderer, on_terminal):
  term, logger = on_terminal()
  options = {"miniters": 1} if renderer == "tqdm" else {}
  _program(2, logger, leave=False, **options)(0)
  je.effects_barrier()
  assert [line for line in screen(term.text()) if line] == [
      "step 0", "INFO logged 0", "step 1", "INFO logged 1"]


@pytest.mark.parametrize("renderer", RENDERERS, indirect=True)
@pytest.mark.parametrize("disable", [True, None])
def test_disable(renderer, disable, on_terminal):
  """``disable=True`` draws nothing; ``None`` draws on a terminal only."""
  term, logger = on_terminal()
  _program(2, logger, disable=disable, miniters=1)(0)
  je.effects_barrier()
  bars = [x for x in map(_bar_or_line, screen(term.text())) if x and
          isinstance(x, tuple)]
  assert bars == ([] if disable else [("bar", "t", "2/2")])
  not_a_terminal = Terminal(tty=False)

  @je.jit
  def g(x):
    with je.progress(2, file=not_a_terminal, disable=disable) as bar:
      bar.update()
    return x

  g(0)
  je.effects_barrier()
  assert not_a_terminal.text() == ""


# --- the same drawings with and without tqdm --------------------------------------

def _drawings(renderer_name, monkeypatch, options, steps=5):
  """The ``n/total`` of every drawing of a 5-step bar on a stream that is
  not a terminal (tqdm writes ``\\r`` + text, the plain renderer a line)."""
  with monkeypatch.context() as m:
    if renderer_name == "plain":
      for name in ("tqdm", "tqdm.auto", "tqdm.std"):
        m.setitem(sys.modules, name, None)
    stream = Terminal(tty=False)

    @je.jit
    def f(x):
      with je.progress(steps, desc="d", file=stream, **options) as bar:
        def step(c, _):
          bar.update()
          return c + 1, None
        return jax.lax.scan(step, x, None, length=steps)[0]

    f(0)
    je.effects_barrier()
  drawn = []
  for piece in re.split(r"[\r\n]", stream.text()):
    m = re.search(r"(\d+)/(\d+) \[", piece)
    if m and piece.strip():
      drawn.append(f"{m[1]}/{m[2]}")
  # (tqdm redraws an unchanged count when it closes)
  return [d for i, d in enumerate(drawn) if i == 0 or d != drawn[i - 1]]


@pytest.mark.parametrize("options", [
    {"mininterval": 0, "miniters": 1},
    {"mininterval": 0, "miniters": 2},
    {"mininterval": 0, "miniters": 1, "initial": 3},
    {"mininterval": 0, "miniters": 1, "leave": False},
    {"mininterval": 3600, "miniters": 1},
    {"mininterval": 0, "miniters": 1, "delay": 3600},
    {"disable": True},
], ids=str)
def test_plain_draws_when_tqdm_draws(options, monkeypatch):
  pytest.importorskip("tqdm")
  theirs = _drawings("tqdm", monkeypatch, options)
  ours = _drawings("plain", monkeypatch, options)
  assert ours == theirs


def _meter_cases(count, seed=0):
  rng = random.Random(seed)
  for _ in range(count):
    total = rng.choice([10, 7, None, 0, 1000])
    n = rng.choice([0, 3, 7, 10, 12, 999, 1000])
    yield dict(
        n=n, total=total, elapsed=rng.choice([0, 0.5, 1.5, 61, 3725.2]),
        ncols=rng.choice([None, None, 0, 30, 60, 80]),
        prefix=rng.choice(["", "train", "x: "]),
        ascii=rng.choice([True, False, " .oO0", " #"]),
        unit=rng.choice(["it", "B", "img"]),
        unit_scale=rng.choice([False, True, 2, 0.5]),
        bar_format=rng.choice([
            None, None, "{l_bar}{bar}| {n_fmt}/{total_fmt}",
            "{desc}: {percentage:.1f}% {bar:12a}| {rate_fmt}{postfix}",
            "{n}/{total} {elapsed} {remaining} {rate_noinv_fmt} "
            "{rate_inv_fmt}", "{l_bar}{bar:-4u}{r_bar}"]),
        postfix=rng.choice([None, "p=1", {"loss": 0.123456, "acc": 1,
                                          "name": " x "}]),
        unit_divisor=rng.choice([1000, 1024]),
        initial=rng.choice([0, 2]))


def test_plain_text_is_tqdms_format_meter():
  tqdm = pytest.importorskip("tqdm").tqdm
  for case in _meter_cases(600):
    postfix = case.pop("postfix")
    ours_postfix = _plain_bars.format_postfix(postfix)
    with tqdm(total=1, postfix=postfix, file=io.StringIO()) as t:
      theirs_postfix = t.postfix
    assert ours_postfix == theirs_postfix, postfix
    ours = _plain_bars.format_meter(postfix=ours_postfix, **case)
    theirs = tqdm.format_meter(postfix=theirs_postfix, **case)
    assert ours == theirs, (case, postfix)


# --- options refused at the call, as tqdm refuses them ----------------------------

@pytest.mark.parametrize("renderer", RENDERERS, indirect=True)
@pytest.mark.parametrize("where", ["eager", "jit"])
def test_an_unknown_option_is_refused_at_the_call(renderer, where):
  def f(x):
    with je.progress(3, desc="d", dissable=True) as bar:
      bar.update()
    return x

  with pytest.raises(TypeError) as info:
    (je.jit(f) if where == "jit" else f)(0)
  msg = str(info.value)
  assert "jax_effects.progress(desc='d')" in msg, msg
  assert "'dissable' (did you mean 'disable'?)" in msg, msg
  assert _bars.open_bars() == 0
  if renderer == "tqdm":   # tqdm refuses it too (when the bar is made)
    from tqdm import TqdmKeyError
    from tqdm.auto import tqdm
    with pytest.raises(TqdmKeyError, match="Unknown argument"):
      tqdm(total=3, dissable=True)


@pytest.mark.parametrize("renderer", RENDERERS, indirect=True)
@pytest.mark.parametrize("option, value", [
    ("ncols", "wide"), ("ncols", -1), ("leave", "yes"), ("mininterval", -1),
    ("unit", 3), ("unit_scale", -2), ("ascii", "#"), ("postfix", 3),
    ("bar_format", "{l_bar}{nope}"), ("initial", "0"), ("miniters", True)])
def test_a_value_the_renderer_cannot_draw_is_refused_at_the_call(
    renderer, option, value):
  with pytest.raises(TypeError, match=rf"jax_effects\.progress\(\): option "
                                      rf"{option}="):
    je.progress(3, **{option: value})


@pytest.mark.parametrize("renderer", RENDERERS, indirect=True)
def test_every_tqdm_option_is_accepted(renderer):
  options = dict(leave=True, ncols=40, mininterval=0.5, maxinterval=5.0,
                 miniters=2, ascii=True, disable=False, unit="img",
                 unit_scale=True, dynamic_ncols=False, smoothing=0.1,
                 bar_format="{l_bar}{bar}| {n_fmt}{unit}", initial=1,
                 position=0,
                 postfix={"a": 1}, unit_divisor=1024, write_bytes=False,
                 lock_args=None, nrows=None, colour="green", delay=0.0)
  assert sorted(options) == sorted(
      _plain_bars.OPTIONS - {"iterable", "gui"})
  stream = Terminal(tty=False)
  with je.progress(3, file=stream, **options) as bar:
    bar.update(2)
  je.effects_barrier()
  text = re.sub(r"\x1b\[[0-9;]*m", "", stream.text())   # (tqdm's colour)
  assert text.endswith("| 3.00img\n")   # (initial=1, unit_scale)


# --- numeric arguments (issue 31, point 11) ---------------------------------------

@pytest.mark.parametrize("every", [2**31, 2**40, 0, -1])
def test_every_out_of_range_is_refused_at_the_call(every):
  for error in (TypeError, ValueError):
    with pytest.raises(error) as info:
      je.progress(3, every=every)
    msg = str(info.value)
    assert "jax_effects.progress()" in msg and f"every={every}" in msg, msg
    assert "at most 2**31 - 1" in msg and "int >= 1" in msg, msg


@pytest.mark.parametrize("every", [1.5, True, "2", None, np.float32(2)])
def test_every_of_another_type_is_refused_at_the_call(every):
  with pytest.raises(TypeError, match=r"jax_effects\.progress\(\): every must "
                                      r"be an int >= 1"):
    je.progress(3, every=every)


@pytest.mark.parametrize("total, error", [
    (-1, ValueError), (2.5, TypeError), (True, TypeError), ("3", TypeError),
    (np.arange(3), TypeError)])
def test_a_bad_total_is_refused_at_the_call(total, error):
  with pytest.raises(error, match=r"jax_effects\.progress\(\): total must"):
    je.progress(total)


def test_numpy_ints_and_the_largest_every_are_accepted():
  stream = Terminal(tty=False)

  @je.jit
  def f(x):
    with je.progress(np.int64(2**33), file=stream, every=np.int32(2**31 - 1),
                     mininterval=0) as bar:
      bar.update(np.int16(3))
      bar.update(2**31 - 1 - 3)
    return x

  f(0)
  je.effects_barrier()
  assert stream.text().splitlines()[-1].split("|")[2].split()[0] == (
      f"{2**31 - 1}/{2**33}")


@pytest.mark.parametrize("n", [2**31, -2**31 - 1])
def test_update_out_of_range_is_refused_naming_update(n):
  @je.jit
  def f(x):
    with je.progress(3) as bar:
      bar.update(n)
    return x

  with pytest.raises(ValueError, match=rf"progress\(\)\.update\(n\): n={n} "
                                       r"is out of range"):
    f(0)

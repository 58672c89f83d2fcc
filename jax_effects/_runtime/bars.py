"""Progress bars on the host: drawing them, and the bars that are open.

The host side of ``jax_effects.progress`` (``design/transformations.md``):
a :class:`BarSpec`'s methods are the host functions of a bar's three
effects; ``open`` returns the bar's id (an ``int32`` the device passes
back), so bars of different executions, threads, devices or ``vmap``
elements never mix. Drawn (``output.deliver``) by ``tqdm`` when installed,
otherwise by the standard-library renderer; ``output`` writes around drawn
bars.

The standard-library renderer, :class:`PlainBar`, draws what tqdm draws:
:func:`format_meter` is tqdm 4.x's ``tqdm.format_meter`` written again,
field for field, for the options drawn here (:data:`DRAWN`); the other
tqdm options (:data:`OPTIONS`) are accepted and change nothing (the rate is
the average since the bar opened, as ``smoothing=0``; bars stack in the
order they draw). Drawing follows tqdm (``delay``, ``miniters``,
``mininterval``, ``leave``, ``disable``): in place (``\\r``) on a terminal,
a line per drawing elsewhere. A bar's line on a terminal is *live* until it
ends; :func:`around_write` writes around the live lines, as ``tqdm.write``
does.

No part of the token calling convention: these run inside host callbacks,
which the convention has already put in order.
"""
from __future__ import annotations

from collections.abc import Mapping
import datetime
import difflib
import functools
import inspect
import itertools
import numbers
import sys
import threading
import time
from typing import Any, Callable, TextIO

import numpy as np

from jax_effects._core import effects as _effects
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import output as _output
from jax_effects._runtime import placement as _placement


# --- the standard-library renderer -----------------------------------------

#: tqdm's keyword arguments (tqdm 4.x) besides ``total``, ``desc`` and
#: ``file`` (``progress``'s own): the options a bar takes, whichever renderer
#: draws it.
OPTIONS = frozenset({
    "iterable", "leave", "ncols", "mininterval", "maxinterval", "miniters",
    "ascii", "disable", "unit", "unit_scale", "dynamic_ncols", "smoothing",
    "bar_format", "initial", "position", "postfix", "unit_divisor",
    "write_bytes", "lock_args", "nrows", "colour", "delay", "gui"})

#: The options the standard-library renderer draws as tqdm does.
DRAWN = ("leave", "disable", "mininterval", "miniters", "delay", "unit",
         "unit_scale", "unit_divisor", "ncols", "ascii", "initial", "postfix",
         "bar_format")

_ASCII = " 123456789#"
_UTF = " " + "".join(map(chr, range(0x258F, 0x2587, -1)))
_PLAIN = " #"


def _interval(seconds: float) -> str:
  """``mm:ss`` or ``h:mm:ss`` (``tqdm.format_interval``)."""
  sign = "-" if seconds < 0 else ""
  minutes, s = divmod(abs(int(seconds)), 60)
  h, m = divmod(minutes, 60)
  return f"{sign}{h:d}:{m:02d}:{s:02d}" if h else f"{sign}{m:02d}:{s:02d}"


def _sizeof(num: float, divisor: float = 1000) -> str:
  """``tqdm.format_sizeof``: 3 significant digits and an SI prefix."""
  for unit in ("", "k", "M", "G", "T", "P", "E", "Z"):
    if abs(num) < 999.5:
      if abs(num) < 99.95:
        if abs(num) < 9.995:
          return f"{num:1.2f}{unit}"
        return f"{num:2.1f}{unit}"
      return f"{num:3.0f}{unit}"
    num /= divisor
  return f"{num:3.1f}Y"


def _format_num(n) -> str:
  """A value of a ``postfix`` mapping as ``set_postfix`` writes it: a
  number as ``tqdm.format_num``, anything else as ``str``."""
  if not isinstance(n, numbers.Number):
    return str(n)
  f = f"{n:.3g}".replace("e+0", "e+").replace("e-0", "e-")
  n = str(n)
  return f if len(f) < len(n) else n


def format_postfix(postfix) -> str | None:
  """The text of a ``postfix=`` option as tqdm makes it (``set_postfix``
  for a mapping: keys sorted, numbers shortened; else as given)."""
  if not isinstance(postfix, Mapping) or not postfix:
    return postfix
  return ", ".join(f"{key}={_format_num(postfix[key]).strip()}"
                   for key in sorted(postfix))


class _Probe:
  """The ``{bar}`` field while the rest is measured (tqdm's
  ``FormatReplace``): empty, whatever its spec."""
  called = False

  def __format__(self, spec: str) -> str:
    self.called = True
    return ""


class _Bar:
  """The ``{bar}`` field (tqdm's ``Bar``): ``frac`` of ``length`` cells."""

  def __init__(self, frac: float, length: int, charset: str):
    self.frac = frac if frac <= 1 else 1
    self.length = length
    self.charset = charset

  def __format__(self, spec: str) -> str:
    charset, length = self.charset, self.length
    if spec:
      kind = spec[-1].lower()
      if kind in "aub":
        charset = {"a": _ASCII, "u": _UTF, "b": "  "}[kind]
        spec = spec[:-1]
      if spec:
        length = int(spec) + (self.length if int(spec) < 0 else 0)
    steps = len(charset) - 1
    full, part = divmod(int(self.frac * length * steps), steps)
    text = charset[-1] * full
    if full < length:
      text += charset[part] + charset[0] * (length - full - 1)
    return text


def format_meter(n: float, total: float | None, elapsed: float, *,
                 ncols: int | None = None, prefix: str = "",
                 ascii: bool | str | None = None, unit: str = "it",
                 unit_scale: bool | float = False, bar_format: str | None = None,
                 postfix: str | None = None, unit_divisor: float = 1000,
                 initial: float = 0) -> str:
  """The text of a bar, as ``tqdm.format_meter`` writes it (``ascii=None``
  draws ``" #"``)."""
  if total and n >= total + 0.5:
    total = None
  if unit_scale and unit_scale not in (True, 1):
    if total:
      total *= unit_scale
    n *= unit_scale
    unit_scale = False
  elapsed_str = _interval(elapsed)
  rate = (n - initial) / elapsed if elapsed else None
  inv_rate = 1 / rate if rate else None
  rate_noinv_fmt = ((_sizeof(rate) if unit_scale else f"{rate:5.2f}")
                    if rate else "?") + unit + "/s"
  rate_inv_fmt = ((_sizeof(inv_rate) if unit_scale else f"{inv_rate:5.2f}")
                  if inv_rate else "?") + "s/" + unit
  rate_fmt = rate_inv_fmt if inv_rate and inv_rate > 1 else rate_noinv_fmt
  n_fmt = _sizeof(n, unit_divisor) if unit_scale else str(n)
  total_fmt = ("?" if total is None else _sizeof(total, unit_divisor)
               if unit_scale else str(total))
  postfix = ", " + postfix if postfix else ""
  remaining = (total - n) / rate if rate and total else 0
  remaining_str = _interval(remaining) if rate else "?"
  try:
    eta = (datetime.datetime.now() + datetime.timedelta(seconds=remaining)
           if rate and total
           else datetime.datetime.fromtimestamp(0, datetime.timezone.utc))
  except OverflowError:
    eta = datetime.datetime.max
  l_bar = (prefix if prefix[-2:] == ": " else prefix + ": ") if prefix else ""
  r_bar = (f"| {n_fmt}/{total_fmt} [{elapsed_str}<{remaining_str}, "
           f"{rate_fmt}{postfix}]")
  fields = {
      "n": n, "n_fmt": n_fmt, "total": total, "total_fmt": total_fmt,
      "elapsed": elapsed_str, "elapsed_s": elapsed, "ncols": ncols,
      "desc": prefix or "", "unit": unit,
      "rate": inv_rate if inv_rate and inv_rate > 1 else rate,
      "rate_fmt": rate_fmt, "rate_noinv": rate,
      "rate_noinv_fmt": rate_noinv_fmt, "rate_inv": inv_rate,
      "rate_inv_fmt": rate_inv_fmt, "postfix": postfix,
      "unit_divisor": unit_divisor, "colour": None,
      "remaining": remaining_str, "remaining_s": remaining,
      "l_bar": l_bar, "r_bar": r_bar, "eta": eta, "nrows": None}
  charset = (_PLAIN if ascii is None else _ASCII if ascii is True
             else _UTF if ascii is False else ascii)
  if total:
    frac = n / total
    percentage = frac * 100
    l_bar += f"{percentage:3.0f}%|"
    if ncols == 0:
      return l_bar[:-1] + r_bar[1:]
    fields["l_bar"] = l_bar
    if bar_format:
      fields["percentage"] = percentage
      if not prefix:
        bar_format = bar_format.replace("{desc}: ", "")
    else:
      bar_format = "{l_bar}{bar}{r_bar}"
  elif bar_format:
    l_bar += "|"
    fields.update(l_bar=l_bar, percentage=0)
    frac, charset = 0, "  "
  else:
    text = (f"{(prefix + ': ') if prefix else ''}{n_fmt}{unit} "
            f"[{elapsed_str}, {rate_fmt}{postfix}]")
    return text[:ncols] if ncols else text
  probe = _Probe()
  text = bar_format.format(bar=probe, **fields)
  if probe.called:   # (the bar fills what the rest leaves of ncols)
    bar = _Bar(frac, max(1, ncols - len(text)) if ncols else 10, charset)
    text = bar_format.format(bar=bar, **fields)
  return text[:ncols] if ncols else text


# --- drawing ---------------------------------------------------------------

#: Serializes drawing and the writes around live lines (reentrant: a log
#: handler run inside :func:`around_write` may print).
lock = threading.RLock()
# id(stream) -> the PlainBar whose line is live on that terminal.
_live: dict[int, "PlainBar"] = {}
_open = 0   # plain bars open (for leave=None)


def _same_terminal(a, b) -> bool:
  """Whether writes to ``a`` and ``b`` land on one screen: the same stream,
  or the process's stdout and stderr (``None``: either of them)."""
  std = (sys.stdout, sys.stderr, None)
  return a is b or (a in std and b in std)


def around_write(stream: TextIO | None, write: Callable[[], Any]) -> None:
  """Runs ``write()`` (to ``stream``; None: stdout or stderr) with the live
  bar lines on that terminal cleared before and redrawn after."""
  with lock:
    cleared = [b for b in _live.values() if _same_terminal(b.stream, stream)]
    for b in cleared:
      b.clear()
    try:
      write()
    finally:
      for b in cleared:
        b.redraw()


class PlainBar:
  """A bar drawn with the standard library. When the first line goes live
  and the last ends, ``output``'s writes are routed again (:func:`_route`,
  under :data:`lock`)."""

  def __init__(self, total: int | None, desc: str | None,
               file: TextIO | None, options: dict):
    o = options
    self.total = total
    self.file = file
    self.leave = o.get("leave", True)
    self.disable = o.get("disable", False)
    self.mininterval = float(o.get("mininterval", 0.1))
    self.miniters = o.get("miniters") or 0
    self.delay = float(o.get("delay", 0))
    self.n = self.initial = o.get("initial", 0)
    self.meter = dict(
        ncols=o.get("ncols"), ascii=o.get("ascii"), unit=o.get("unit", "it"),
        unit_scale=o.get("unit_scale", False), bar_format=o.get("bar_format"),
        prefix=desc or "", postfix=format_postfix(o.get("postfix")),
        unit_divisor=o.get("unit_divisor", 1000), initial=self.initial)
    self.stream: TextIO | None = None
    self.tty = False
    self.drawn_n = None      # the count last drawn (None: never drawn)
    self.width = 0           # the length of the live line's text
    self.start = self.last = 0.0

  def open(self) -> None:
    global _open
    stream = self.stream = self.file if self.file is not None else sys.stderr
    try:
      self.tty = bool(stream.isatty())
    except (AttributeError, ValueError):
      self.tty = False
    if self.disable is None:
      self.disable = not self.tty
    with lock:
      if self.leave is None:
        self.leave = _open == 0
      _open += 1
    self.start = self.last = time.monotonic()
    if self.delay <= 0:
      self._draw(self.start, end=False)

  def advance(self, n: int) -> None:
    self.n += n
    if self.n - (self.drawn_n or 0) < self.miniters:
      return
    now = time.monotonic()
    if now - self.last >= self.mininterval and now >= self.start + self.delay:
      self.last = now
      self._draw(now, end=False)

  def close(self, n: int) -> None:
    global _open
    self.n += n
    with lock:
      _open -= 1
      if self.drawn_n is None:   # never drawn (delay): nothing to leave
        return
      if self.leave:
        self._draw(time.monotonic(), end=True)
      elif _live.get(id(self.stream)) is self:
        self.clear()
        self._end_live()

  def _write(self, text: str) -> None:
    self.stream.write(text)
    self.stream.flush()

  def _end_live(self) -> None:
    _live.pop(id(self.stream), None)
    if not _live:
      _route()

  def clear(self) -> None:
    """Erases the live line (tqdm's ``clear``)."""
    self._write("\r" + " " * self.width + "\r")

  def redraw(self) -> None:
    """Draws the live line again, with the current count."""
    self._draw(time.monotonic(), end=False)

  def _draw(self, now: float, end: bool) -> None:
    if self.disable or self.stream is None:
      return
    with lock:
      shown = self.drawn_n == self.n   # (the last drawing shows the count)
      if end and shown and not self.tty:
        return
      self.drawn_n = self.n
      text = format_meter(self.n, self.total, now - self.start, **self.meter)
      if not self.tty:
        self._write(text + "\n")
        return
      last = _live.get(id(self.stream))
      if end:
        if last is self:
          self._end_live()
          if shown:   # the line is current: end it
            self._write("\n")
            return
      else:
        _live[id(self.stream)] = self
        if last is None and len(_live) == 1:
          _route()
      # (after another bar's line, this one starts a line of its own)
      lead = "\r" if last is self or last is None else "\n"
      pad = " " * (self.width - len(text)) if last is self else ""
      self.width = 0 if end else len(text)
      self._write(lead + text + pad + ("\n" if end else ""))


# --- tqdm ------------------------------------------------------------------

class _TqdmBar:
  """A bar drawn by tqdm."""

  def __init__(self, tqdm_class, total: int | None, desc: str | None,
               file: TextIO | None, options: dict):
    self.make = lambda: tqdm_class(total=total, desc=desc, file=file, **options)
    self.bar = None

  def open(self) -> None:
    self.bar = self.make()   # tqdm draws 0/total at once
    _route(+1)

  def advance(self, n: int) -> None:
    self.bar.update(n)

  def close(self, n: int) -> None:
    try:
      if n:
        self.bar.update(n)
      self.bar.close()
    finally:
      _route(-1)


def _tqdm_class(file: TextIO | None):
  """tqdm's class for ``file``, or None when tqdm is not installed."""
  try:
    if file is None:
      from tqdm.auto import tqdm   # a widget in notebooks
    else:
      from tqdm.std import tqdm
  except ImportError:
    return None
  return tqdm


# --- options ---------------------------------------------------------------

@functools.cache
def _tqdm_options(tqdm_class) -> frozenset:
  """The keyword arguments ``tqdm_class`` takes but ``progress``'s own."""
  names = set()
  for klass in tqdm_class.__mro__:
    init = vars(klass).get("__init__")
    if init is None:
      continue
    init = getattr(init, "func", init)   # (a functools.partialmethod)
    try:
      params = inspect.signature(init).parameters.values()
    except (TypeError, ValueError):
      continue
    names.update(p.name for p in params
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if klass.__module__ == "tqdm.notebook":
      names.add("display")
  return frozenset(names - {"self", "total", "desc", "file"})


def _real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _value_problem(name: str, value) -> str | None:
  """What is wrong with ``name=value`` for a bar (None: nothing)."""
  if name in ("leave", "disable", "dynamic_ncols", "write_bytes", "gui"):
    if value is not None and not isinstance(value, (bool, np.bool_)):
      return "must be True, False or None"
  elif name in ("mininterval", "maxinterval", "delay", "smoothing", "initial"):
    if not _real(value) or value < 0:
      return "must be a number >= 0"
  elif name == "miniters":
    if value is not None and (not _real(value) or value < 0):
      return "must be a number >= 0 or None"
  elif name in ("unit", "colour"):
    if not isinstance(value, str) and (name == "unit" or value is not None):
      return "must be a str"
  elif name == "unit_scale":
    if not isinstance(value, bool) and (not _real(value) or value <= 0):
      return "must be True, False or a number > 0"
  elif name == "unit_divisor":
    if not _real(value) or value <= 0:
      return "must be a number > 0"
  elif name in ("ncols", "nrows", "position"):
    if value is not None and (isinstance(value, bool)
                              or not isinstance(value, numbers.Integral)
                              or value < 0):
      return "must be an int >= 0 or None"
  elif name == "ascii":
    if not (value is None or isinstance(value, bool)
            or isinstance(value, str) and len(value) >= 2):
      return "must be True, False, None or a str of at least 2 characters"
  elif name == "postfix":
    if value is not None and not isinstance(value, (str, Mapping)):
      return "must be a str or a dict"
  elif name == "bar_format" and value is not None:
    if not isinstance(value, str):
      return "must be a str or None"
    try:
      format_meter(1, 10, 1.0, prefix="d", bar_format=value)
      format_meter(1, None, 1.0, prefix="d", bar_format=value)
    except (KeyError, IndexError, AttributeError, ValueError, TypeError) as err:
      return (f"is not a format of tqdm's fields ({err!r}; the fields are "
              f"{{l_bar}}, {{bar}}, {{r_bar}}, {{n_fmt}}, {{total_fmt}}, "
              f"{{percentage}}, {{elapsed}}, {{remaining}}, {{rate_fmt}}, "
              f"{{desc}}, {{postfix}}, ...)")
  return None


def check_options(what: str, file: TextIO | None, options: dict) -> None:
  """Refuses, at the call (tqdm would refuse it inside the computation), an
  option the bar's renderer does not know or a value it cannot draw."""
  tqdm_class = _tqdm_class(file)
  known = OPTIONS if tqdm_class is None else _tqdm_options(tqdm_class)
  unknown = [k for k in options if k not in known]
  if unknown:
    hints = []
    for k in unknown:
      close = difflib.get_close_matches(k, sorted(known), n=1)
      hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close
                               else ""))
    renderer = ("tqdm" if tqdm_class is not None else
                "the standard-library renderer (tqdm is not installed)")
    raise TypeError(
        f"{what}: unknown option(s) {', '.join(hints)}: a bar's options are "
        f"tqdm's keyword arguments, drawn by {renderer}; known: "
        f"{', '.join(sorted(known))}")
  for name, value in options.items():
    problem = _value_problem(name, value)
    if problem is not None:
      raise TypeError(f"{what}: option {name}={value!r} {problem}")


# --- writes while a bar is drawn -------------------------------------------

_around_lock = threading.Lock()
_tqdm_open = 0   # open tqdm bars


def _around(stream: TextIO | None, write) -> None:
  """``output``'s writes while bars are drawn: tqdm's cleared and redrawn
  by ``tqdm.external_write_mode``, plain ones by ``around_write``."""
  if _tqdm_open:
    from tqdm.std import tqdm
    with tqdm.external_write_mode(
        file=stream if stream is not None else sys.stderr):
      around_write(stream, write)
  else:
    around_write(stream, write)


def _route(tqdm_opened: int = 0) -> None:
  """Routes ``output``'s writes through :func:`_around` while tqdm bars are
  open (``tqdm_opened``: how many opened, -1 closed) or plain lines live."""
  global _tqdm_open
  with _around_lock:
    _tqdm_open += tqdm_opened
    _output.write_around(_around if _tqdm_open or _live else None)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  global lock, _open, _around_lock, _tqdm_open
  lock, _around_lock = threading.RLock(), threading.Lock()
  _live.clear()
  _open = _tqdm_open = 0
  _output.write_around(None)


_bars: dict[int, Any] = {}   # open bars by id (each knows its opened_by)
_bars_lock = threading.Lock()
_ids = itertools.count(1)


class BarSpec:
  """What a ``progress(...)`` call fixed when it was traced."""

  def __init__(self, total: int | None, desc: str | None, file, options,
               per_element: bool):
    self.total = total
    self.desc = desc
    self.file = file
    self.options = options
    self.per_element = per_element

  def open(self, *operands) -> tuple:
    """``operands``: the element's index (``per_element``), then the total
    if it is computed in the program."""
    p = _placement.current()
    label = p.prefix() if p is not None and p.per_device else ""
    if self.per_element:
      element, *operands = operands
      label += f"[element {int(element)}] "
    total = int(operands[0]) if operands else self.total
    desc = (label + self.desc) if self.desc else (label.rstrip() or None)
    tqdm = _tqdm_class(self.file)
    if tqdm is None:
      bar = PlainBar(total, desc, self.file, self.options)
    else:
      bar = _TqdmBar(tqdm, total, desc, self.file, self.options)
    slot = _placement.carrier_slot()
    with _bars_lock:
      bar_id = next(_ids) & 0x7FFFFFFF
      _bars[bar_id] = bar
      bar.opened_by = slot   # (the slot whose execution opened it: close_for)
    _output.deliver(bar.open, True)
    return (np.asarray(bar_id, np.int32),)

  def advance(self, bar_id, n) -> tuple:
    bar = _bars.get(int(bar_id))
    if bar is not None:
      _output.deliver(functools.partial(bar.advance, int(n)), True)
    return ()

  def advance_counted(self, id_and_count) -> tuple:
    """:meth:`advance` with the bar's id and the count in one ``int32[2]``
    operand: a counted flush (``every=k``) is then a host call of the
    common form (the carrier and one operand), the cheapest to run."""
    return self.advance(*id_and_count.tolist())

  def close(self, bar_id, n) -> tuple:
    """Closes the bar (a *cleanup* effect: it runs also after an earlier
    effect of its chain failed)."""
    with _bars_lock:
      bar = _bars.pop(int(bar_id), None)
    if bar is not None:
      _output.deliver(functools.partial(bar.close, int(n)), True)
    return ()


def close_for(slot: int, chains: tuple = ()) -> None:
  """Closes the bars an execution of ``slot`` opened: it failed on
  ``chains`` (only ``DEFAULT``'s or ``GLOBAL``'s holds bars), or the slot is
  freed (``chains`` empty)."""
  if chains and not any(c is _effects.DEFAULT or c is _effects.GLOBAL
                        for c in chains):
    return
  with _bars_lock:
    ids = [bar_id for bar_id, bar in _bars.items() if bar.opened_by == slot]
    bars = [_bars.pop(bar_id) for bar_id in ids]
  for bar in bars:
    _output.deliver(functools.partial(bar.close, 0), True)


def open_bars() -> int:
  """How many bars are open (drawn, not closed yet) in this process."""
  return len(_bars)

"""``jax_effects.progress``: progress bars for compiled loops.

``with progress(total) as bar:`` inside traced code binds three kinds of
ordered effects on :data:`~jax_effects.DEFAULT` (so they keep program order
with ``print``, ``log``, ``callback`` and adopted ``jax.debug`` callbacks):

* entering: *open*, a host callback that creates the bar, draws it at
  ``0/total`` and returns the bar's id (an ``int32`` the other two take as an
  operand, so one execution's bar is never confused with another's: calls
  from several threads, a bar opened again in each iteration of an outer
  loop, one bar per device in ``shard_map``);
* ``bar.update(n)``: *advance* by the count of updates since the last
  advance. With ``every=1`` each update is one host call. With ``every=k``
  the updates are counted on the device, in a :class:`~jax_effects._primitives.counter.Counter`
  (a count the token-threading pass carries through the loops, like an
  effect chain's carrier), and a ``lax.cond`` makes the host call only when
  ``k`` of them are pending;
* leaving: *close*, which advances by what is still pending and closes the
  bar, so it ends at its final count.

Part in the token calling convention: that of every effect (the pass adds
the token and carrier to each host call), plus the counter's chain, which
has no runtime token.

Where it runs: per device inside ``shard_map``/``pmap`` (each device opens its
own bar, labelled with ``print``'s device prefix, ``_runtime.placement``), once
otherwise. Under ``vmap`` the host calls run once for the whole batch
(``HostCallback.batch_once``): one bar for the batch. Under ``grad`` they are
part of the forward computation only (as every effect, see
``design/transformations.md``). Drawing is an output action
(``_runtime.output.deliver``): held and sorted in the deterministic view like
printed lines.

Drawing: ``tqdm`` when it is installed (``tqdm.auto`` when ``file`` is None,
which is a notebook widget in Jupyter, else ``tqdm.std``; ``**options`` are
tqdm's), otherwise :class:`_PlainBar`, a standard-library renderer on
``sys.stderr`` (or ``file``) that writes what tqdm writes for
``n/total``, percentage, elapsed time and rate, at most every
``mininterval`` seconds (0.1 by default, as tqdm) plus when it opens and
closes.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
import types
from typing import Any, Callable, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_effects._core import effects as _effects
from jax_effects._pass import token_pass as _token_pass  # noqa: F401  (counter rule)
from jax_effects._primitives import counter as _counters
from jax_effects._primitives import effect as _primitives
from jax_effects._runtime import output as _output
from jax_effects._runtime import placement as _placement

__all__ = ["progress", "Progress"]

_ID_AVAL = jax.core.ShapedArray((), np.int32)


# --- drawing (host side) ------------------------------------------------------

def _interval(seconds: float) -> str:
  """``mm:ss`` or ``h:mm:ss``, as tqdm writes intervals."""
  minutes, s = divmod(int(seconds), 60)
  h, m = divmod(minutes, 60)
  return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


_write_lock = threading.Lock()
# id(file) -> the _PlainBar that wrote last to it (a TTY line is shared).
_last_writer: dict[int, "_PlainBar"] = {}


class _PlainBar:
  """A bar drawn with the standard library: ``desc:  40%|####      | 4/10
  [00:01<00:01,  3.96it/s]``.

  On a terminal the line is redrawn in place (``\\r``) and ends with a
  newline when the bar closes; elsewhere (a file, a CI log) every drawing is
  a line of its own. Options: ``mininterval`` (seconds between two drawings
  of an update, default 0.1) and ``unit`` (default ``"it"``); other tqdm
  options are ignored.
  """

  def __init__(self, total: int | None, desc: str | None,
               file: TextIO | None, options: dict):
    self.total = total
    self.desc = desc
    self.file = file
    self.mininterval = float(options.get("mininterval", 0.1))
    self.unit = str(options.get("unit", "it"))
    self.n = 0
    self.drawn = -1    # the count last drawn
    self.start = self.last = 0.0

  def open(self) -> None:
    self.start = self.last = time.monotonic()
    self._draw(self.start, end=False)

  def advance(self, n: int) -> None:
    self.n += n
    now = time.monotonic()
    if now - self.last >= self.mininterval:
      self.last = now
      self._draw(now, end=False)

  def close(self, n: int) -> None:
    self.n += n
    self._draw(time.monotonic(), end=True)

  def text(self, now: float) -> str:
    elapsed = now - self.start
    rate = self.n / elapsed if elapsed > 0 and self.n else None
    rate_s = (f"{rate:5.2f}{self.unit}/s" if rate is not None
              else f"?{self.unit}/s")
    head = f"{self.desc}: " if self.desc else ""
    if self.total is None:
      return f"{head}{self.n}{self.unit} [{_interval(elapsed)}, {rate_s}]"
    frac = min(max(self.n / self.total, 0.0), 1.0) if self.total else 1.0
    filled = int(frac * 10)
    left = ("?" if rate is None
            else _interval(max(self.total - self.n, 0) / rate))
    return (f"{head}{frac * 100:3.0f}%|{'#' * filled}{' ' * (10 - filled)}| "
            f"{self.n}/{self.total} [{_interval(elapsed)}<{left}, {rate_s}]")

  def _draw(self, now: float, end: bool) -> None:
    file = self.file if self.file is not None else sys.stderr
    if file is None:
      return
    try:
      tty = file.isatty()
    except (AttributeError, ValueError):
      tty = False
    if end and not tty and self.drawn == self.n:
      return   # (its line already shows the final count)
    self.drawn = self.n
    text = self.text(now)
    with _write_lock:
      if tty:
        last = _last_writer.get(id(file))
        lead = "\r" if last is self or last is None else "\n"
        _last_writer[id(file)] = self
        file.write(lead + text + ("\n" if end else ""))
        if end:
          _last_writer.pop(id(file), None)
      else:
        file.write(text + "\n")
      file.flush()


class _TqdmBar:
  """A bar drawn by tqdm (``tqdm.auto`` to ``sys.stderr``, ``tqdm.std``
  to ``file``)."""

  def __init__(self, tqdm_class, total: int | None, desc: str | None,
               file: TextIO | None, options: dict):
    self.make = lambda: tqdm_class(total=total, desc=desc, file=file,
                                   **options)
    self.bar = None

  def open(self) -> None:
    self.bar = self.make()   # tqdm draws 0/total at once

  def advance(self, n: int) -> None:
    self.bar.update(n)

  def close(self, n: int) -> None:
    if n:
      self.bar.update(n)
    self.bar.close()


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


# Open bars: id -> bar. An id is an int32 the device passes back.
_bars: dict[int, Any] = {}
_bars_lock = threading.Lock()
_ids = itertools.count(1)


def _new_bar(spec: "_Spec", total: int | None):
  p = _placement.current()
  label = p.prefix() if p is not None and p.per_device else ""
  desc = (label + spec.desc) if spec.desc else (label.rstrip() or None)
  tqdm = _tqdm_class(spec.file)
  if tqdm is None:
    return _PlainBar(total, desc, spec.file, spec.options)
  return _TqdmBar(tqdm, total, desc, spec.file, spec.options)


class _Spec:
  """What a ``progress(...)`` call fixed when it was traced; its methods
  are the host sides of the bar's three effects."""

  def __init__(self, total: int | None, desc: str | None, file, options):
    self.total = total
    self.desc = desc
    self.file = file
    self.options = options

  def open(self, *total) -> tuple:
    bar = _new_bar(self, int(total[0]) if total else self.total)
    with _bars_lock:
      bar_id = next(_ids) & 0x7FFFFFFF
      _bars[bar_id] = bar
    _output.deliver(bar.open, True)
    return (np.asarray(bar_id, np.int32),)

  def advance(self, bar_id, n) -> tuple:
    bar = _bars.get(int(bar_id))
    if bar is not None:
      n = int(n)
      _output.deliver(lambda: bar.advance(n), True)
    return ()

  def close(self, bar_id, n) -> tuple:
    with _bars_lock:
      bar = _bars.pop(int(bar_id), None)
    if bar is not None:
      n = int(n)
      _output.deliver(lambda: bar.close(n), True)
    return ()


def open_bars() -> int:
  """How many bars are open (drawn, not closed yet) in this process."""
  return len(_bars)


# --- trace side ---------------------------------------------------------------

def _manual_axes() -> frozenset:
  """The manual (``shard_map``/``pmap``) mesh axes the code being traced is
  inside of (empty outside any)."""
  return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def _is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


class Progress:
  """A progress bar of a compiled loop (see :func:`progress`).

  ``with progress(total) as bar:`` opens it; ``bar.update(n)`` advances
  it; leaving the block closes it.
  """

  def __init__(self, total: int | jax.Array | None, *, desc: str | None,
               every: int, file: TextIO | None, options: dict[str, Any]):
    self._what = (f"jax_effects.progress(desc={desc!r})" if desc is not None
                  else "jax_effects.progress()")
    if total is not None and not _is_traced(total):
      if (isinstance(total, (bool, np.bool_))
          or not np.issubdtype(np.asarray(total).dtype, np.integer)
          or np.ndim(total) or int(total) < 0):
        raise TypeError(
            f"{self._what}: total must be a non-negative int (or an int32 "
            f"array, or None for no total), got {total!r}")
      total = int(total)
    elif total is not None and (
        jnp.shape(total) or not jnp.issubdtype(total.dtype, jnp.integer)):
      raise TypeError(
          f"{self._what}: a traced total must be an integer scalar, got "
          f"{jax.typeof(total).str_short()}")
    if desc is not None and not isinstance(desc, str):
      raise TypeError(f"{self._what}: desc must be a str or None, got {desc!r}")
    if (isinstance(every, (bool, np.bool_))
        or not isinstance(every, (int, np.integer)) or every < 1):
      raise TypeError(
          f"{self._what}: every must be an int >= 1 (one host call per that "
          f"many updates), got {every!r}")
    if file is not None and not callable(getattr(file, "write", None)):
      raise TypeError(
          f"{self._what}: file must have a write method (a text stream), "
          f"got {file!r}")
    self._total = total
    self._every = int(every)
    self._spec = _Spec(None if _is_traced(total) else total, desc, file,
                       dict(options))
    self._state = "new"
    self._id: Any = None
    self._counter: _counters.Counter | None = None
    self._manual: frozenset = frozenset()

  def __repr__(self):
    return f"<{self._what} ({self._state})>"

  def _bind(self, fn: Callable, what: str, operands: list,
            result_avals: tuple = ()) -> list:
    return _primitives.bind_effect(
        fn, what, operands, effect=_effects.DEFAULT, ordered=True,
        result_avals=result_avals, reads_placement=True, batch_once=True)

  def __enter__(self) -> "Progress":
    if self._state != "new":
      raise RuntimeError(
          f"{self._what} was already entered: a progress bar is used in one "
          f"with-block; call jax_effects.progress(...) again for another bar")
    operands = [self._total] if _is_traced(self._total) else []
    (self._id,) = self._bind(self._spec.open, self._what, operands,
                             (_ID_AVAL,))
    self._manual = _manual_axes()
    if self._every > 1:
      self._counter = _counters.Counter(self._what)
      _counters.set_count(self._counter, 0)
    self._state = "open"
    return self

  def update(self, n: int | jax.Array = 1) -> None:
    """Advances the bar by ``n`` (default 1) when the computation gets here,
    in program order; with ``every=k`` the host hears of it once ``k``
    updates are pending (and at the end)."""
    what = f"{self._what}.update"
    if self._state != "open":
      raise RuntimeError(
          f"{what}() was called "
          f"{'before entering' if self._state == 'new' else 'after leaving'} "
          f"its with-block: use it inside `with jax_effects.progress(...) as "
          f"bar:`")
    inner = _manual_axes() - self._manual
    if inner:
      raise NotImplementedError(
          f"{what}() is inside a shard_map (or pmap) over the axes "
          f"{sorted(inner)} that the bar was not opened in, where every "
          f"device would count its own updates of the one bar. Open the bar "
          f"inside the shard_map's function: each device then draws its own "
          f"bar, labelled with its device.")
    if isinstance(n, (bool, np.bool_)) or not jnp.issubdtype(
        jnp.result_type(n), jnp.integer) or jnp.ndim(n):
      raise TypeError(f"{what}(n): n must be an integer scalar, got {n!r}")
    if self._counter is None:
      self._bind(self._spec.advance, what, [self._id, jnp.asarray(n, np.int32)])
      return
    counter, every, bar_id = self._counter, self._every, self._id
    pending = _counters.add_count(counter, n)

    def flush(pending):
      self._bind(self._spec.advance, what, [bar_id, pending])
      _counters.set_count(counter, 0)

    if _is_traced(pending):
      lax.cond(pending >= every, flush, lambda pending: None, pending)
    elif int(pending) >= every:   # eager
      flush(pending)

  def __exit__(self, exc_type: type[BaseException] | None,
               exc: BaseException | None,
               tb: types.TracebackType | None) -> None:
    if self._state != "open":
      return
    self._state = "closed"
    if exc_type is not None:
      if not _is_traced(self._id):   # eager: the bar was drawn; close it
        self._spec.close(self._id, 0)
      return
    if self._counter is not None:
      pending = _counters.add_count(self._counter, 0)
    else:
      pending = jnp.zeros((), np.int32)
    self._bind(self._spec.close, f"{self._what} closing", [self._id, pending])


def progress(total: int | jax.Array | None, *, desc: str | None = None,
             every: int = 1, file: TextIO | None = None,
             **options: Any) -> Progress:
  """A progress bar for a loop in compiled code: a context manager.

  ::

      with jax_effects.progress(total=steps, desc="train") as bar:
        def step(state, batch):
          bar.update()          # one step done, in program order
          return update(state, batch), None
        state, _ = jax.lax.scan(step, state, batches)

  Entering the block draws the bar at ``0/total``, ``bar.update(n=1)``
  advances it and leaving the block closes it at its final count, each when
  the computation gets there, in program order with ``print``, ``log`` and
  ``callback`` (ordered effects of :data:`~jax_effects.DEFAULT`): one bar
  per execution of the block. Works in ``jax_effects.jit`` code (across
  ``scan``, ``fori_loop``, ``while_loop``, ``cond``, nested bars), eagerly,
  and, with ``every=1``, under plain ``jax.jit``.

  ``total``: the number of updates expected (an int, an integer scalar
  computed in the program, or None). ``desc``: the bar's label.
  ``every=k``: updates are counted on the device and the host is called
  once per ``k`` of them (and when the bar closes), so a long loop pays
  almost nothing (needs ``jax_effects.jit``). The drawing itself is
  throttled by time (``mininterval``, 0.1 s, as tqdm). ``file``: where to
  draw (default ``sys.stderr``). ``**options`` go to ``tqdm`` when it is
  installed (``pip install jax_effects[progress]``; ``tqdm.auto``, a widget
  in notebooks, when ``file`` is None); without it a plain renderer draws
  ``desc:  40%|####      | 4/10 [00:01<00:01, 3.96it/s]`` and takes
  ``mininterval`` and ``unit``.

  Inside ``shard_map``/``pmap`` every device draws its own bar, labelled
  with ``print``'s device prefix (open the bar inside the mapped function).
  Under ``vmap`` one bar counts the batch (the count must be the same for
  every element); under ``grad`` updates happen in the forward computation
  only.
  """
  return Progress(total, desc=desc, every=every, file=file, options=options)


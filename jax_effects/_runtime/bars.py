"""Progress bars on the host: drawing them, and the bars that are open.

The host side of ``jax_effects.progress`` (``_frontends/progress.py``): a
:class:`BarSpec` holds what a ``progress(...)`` call fixed when it was
traced, and its ``open``/``advance``/``close`` methods are the host
functions of the bar's three effects. ``open`` creates a bar and returns its
id (an ``int32`` the device passes back to the other two), so bars of
different executions, threads, devices or ``vmap`` elements never mix.
Every drawing is an output action (``output.deliver``: held and sorted in
the deterministic view like printed lines); per-device bars are labelled
with their placement's prefix (``placement``).

Drawing: ``tqdm`` when it is installed (``tqdm.auto`` when ``file`` is
None, which is a notebook widget in Jupyter, else ``tqdm.std``; the bar's
options are tqdm's), otherwise :class:`_PlainBar`, a standard-library
renderer on ``sys.stderr`` (or ``file``) that writes what tqdm writes for
``n/total``, percentage, elapsed time and rate, at most every
``mininterval`` seconds (0.1 by default, as tqdm) plus when it opens and
closes.

No part of the token calling convention: these functions run inside host
callbacks, which the convention has already put in order.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import Any, TextIO

import numpy as np

from jax_effects._core import effects as _effects
from jax_effects._runtime import output as _output
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import token_value as _token_value

__all__ = ["BarSpec", "open_bars"]


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
    shown = self.drawn == self.n   # (its last line shows the count)
    if end and shown and not tty:
      return
    self.drawn = self.n
    text = self.text(now)
    with _write_lock:
      if tty:
        last = _last_writer.get(id(file))
        if end:
          _last_writer.pop(id(file), None)
          if last is self and shown:   # the line is current: end it
            file.write("\n")
            file.flush()
            return
        else:
          _last_writer[id(file)] = self
        # (after another bar's line, this one starts a line of its own)
        lead = "\r" if last is self or last is None else "\n"
        file.write(lead + text + ("\n" if end else ""))
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
# Open bars by the slot of the thread whose execution opened them
# (``token_value``): closed when that execution fails (close_for).
_by_slot: dict[int, set] = {}
_bars_lock = threading.Lock()
_ids = itertools.count(1)


def _new_bar(spec: "BarSpec", total: int | None, element: int | None):
  p = _placement.current()
  label = p.prefix() if p is not None and p.per_device else ""
  if element is not None:
    label += f"[element {element}] "
  desc = (label + spec.desc) if spec.desc else (label.rstrip() or None)
  tqdm = _tqdm_class(spec.file)
  if tqdm is None:
    return _PlainBar(total, desc, spec.file, spec.options)
  return _TqdmBar(tqdm, total, desc, spec.file, spec.options)


class BarSpec:
  """What a ``progress(...)`` call fixed when it was traced; its methods
  are the host sides of the bar's three effects."""

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
    element = None
    if self.per_element:
      element, *operands = operands
      element = int(element)
    total = int(operands[0]) if operands else self.total
    bar = _new_bar(self, total, element)
    slot = _running_slot()
    with _bars_lock:
      bar_id = next(_ids) & 0x7FFFFFFF
      _bars[bar_id] = bar
      bar.slot = slot
      _by_slot.setdefault(slot, set()).add(bar_id)
    _output.deliver(bar.open, True)
    return (np.asarray(bar_id, np.int32),)

  def advance(self, bar_id, n) -> tuple:
    bar = _bars.get(int(bar_id))
    if bar is not None:
      n = int(n)
      _output.deliver(lambda: bar.advance(n), True)
    return ()

  def close(self, bar_id, n) -> tuple:
    """Closes the bar (a *cleanup* effect: it runs also after an earlier
    effect of its chain failed, as ``with tqdm(...)`` closes on an
    exception)."""
    bar = _pop(int(bar_id))
    if bar is not None:
      n = int(n)
      _output.deliver(lambda: bar.close(n), True)
    return ()


def _pop(bar_id: int):
  with _bars_lock:
    bar = _bars.pop(bar_id, None)
    if bar is not None:
      ids = _by_slot.get(bar.slot)
      if ids is not None:
        ids.discard(bar_id)
        if not ids:
          del _by_slot[bar.slot]
  return bar


def _running_slot() -> int:
  """The slot of the thread that dispatched the running execution (its
  carrier's, ``token_value``; 0 outside one)."""
  carrier = _placement.host_local("carrier")
  if carrier is None:
    return 0
  return _token_value.slot_of(int(np.max(carrier)))


def close_for(slot: int, chains: tuple = ()) -> None:
  """Closes the bars that an execution of ``slot`` opened and that are
  still open: it failed or was interrupted (``executions.failed``), or the
  slot is freed (``chains`` empty). Bars live on the chain of
  :data:`~jax_effects.DEFAULT` (``GLOBAL`` in global mode): only a failure
  on it closes them."""
  if chains and not any(c is _effects.DEFAULT or c is _effects.GLOBAL
                        for c in chains):
    return
  with _bars_lock:
    ids = list(_by_slot.get(slot, ()))
  for bar_id in ids:
    bar = _pop(bar_id)
    if bar is not None:
      _output.deliver(lambda bar=bar: bar.close(0), True)


def open_bars() -> int:
  """How many bars are open (drawn, not closed yet) in this process."""
  return len(_bars)

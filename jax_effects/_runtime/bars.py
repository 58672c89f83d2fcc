"""Progress bars on the host: drawing them, and the bars that are open.

The host side of ``jax_effects.progress`` (``design/transformations.md``):
a :class:`BarSpec`'s methods are the host functions of a bar's three
effects; ``open`` returns the bar's id (an ``int32`` the device passes
back), so bars of different executions, threads, devices or ``vmap``
elements never mix. Drawn (``output.deliver``) by ``tqdm`` when installed,
otherwise by ``plain_bars.PlainBar``; ``output`` writes around drawn bars.

No part of the token calling convention: these run inside host callbacks,
which the convention has already put in order.
"""
from __future__ import annotations

from collections.abc import Mapping
import difflib
import functools
import inspect
import itertools
import numbers
import sys
import threading
from typing import Any, TextIO

import numpy as np

from jax_effects._core import effects as _effects
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import output as _output
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import plain_bars as _plain_bars


class _TqdmBar:
  """A bar drawn by tqdm."""

  def __init__(self, tqdm_class, total: int | None, desc: str | None,
               file: TextIO | None, options: dict):
    self.make = lambda: tqdm_class(total=total, desc=desc, file=file, **options)
    self.bar = None

  def open(self) -> None:
    self.bar = self.make()   # tqdm draws 0/total at once
    _writes_around_bars(+1)

  def advance(self, n: int) -> None:
    self.bar.update(n)

  def close(self, n: int) -> None:
    try:
      if n:
        self.bar.update(n)
      self.bar.close()
    finally:
      _writes_around_bars(-1)


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
      _plain_bars.format_meter(1, 10, 1.0, prefix="d", bar_format=value)
      _plain_bars.format_meter(1, None, 1.0, prefix="d", bar_format=value)
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
  known = _plain_bars.OPTIONS if tqdm_class is None else _tqdm_options(tqdm_class)
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
_plain_live = False


def _around(stream: TextIO | None, write) -> None:
  """``output``'s writes while bars are drawn: tqdm's cleared and redrawn
  by ``tqdm.external_write_mode``, plain ones by ``around_write``."""
  if _tqdm_open:
    from tqdm.std import tqdm
    with tqdm.external_write_mode(
        file=stream if stream is not None else sys.stderr):
      _plain_bars.around_write(stream, write)
  else:
    _plain_bars.around_write(stream, write)


def _route() -> None:
  _output.write_around(_around if _tqdm_open or _plain_live else None)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  global _around_lock, _tqdm_open, _plain_live
  _around_lock = threading.Lock()
  _tqdm_open, _plain_live = 0, False
  _output.write_around(None)


def _writes_around_bars(delta: int) -> None:
  global _tqdm_open
  with _around_lock:
    _tqdm_open += delta
    _route()


def _plain_live_changed(live: bool) -> None:
  global _plain_live
  with _around_lock:
    _plain_live = live
    _route()


_bars: dict[int, Any] = {}   # open bars by id
# Open bars' ids by the slot whose execution opened them (close_for).
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
    return _plain_bars.PlainBar(total, desc, spec.file, spec.options,
                                _plain_live_changed)
  return _TqdmBar(tqdm, total, desc, spec.file, spec.options)


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
    element = None
    if self.per_element:
      element, *operands = operands
      element = int(element)
    total = int(operands[0]) if operands else self.total
    bar = _new_bar(self, total, element)
    slot = _placement.carrier_slot()
    with _bars_lock:
      bar_id = next(_ids) & 0x7FFFFFFF
      _bars[bar_id] = bar
      bar.opened_by = slot
      _by_slot.setdefault(slot, set()).add(bar_id)
    _output.deliver(bar.open, True)
    return (np.asarray(bar_id, np.int32),)

  def advance(self, bar_id, n) -> tuple:
    bar = _bars.get(int(bar_id))
    if bar is not None:
      n = int(n)
      _output.deliver(lambda: bar.advance(n), True)
    return ()

  def advance_counted(self, id_and_count) -> tuple:
    """:meth:`advance` with the bar's id and the count in one ``int32[2]``
    operand: a counted flush (``every=k``) is then a host call of the
    common form (the carrier and one operand), the cheapest to run."""
    return self.advance(*id_and_count.tolist())

  def close(self, bar_id, n) -> tuple:
    """Closes the bar (a *cleanup* effect: it runs also after an earlier
    effect of its chain failed)."""
    bar = _pop(int(bar_id))
    if bar is not None:
      n = int(n)
      _output.deliver(lambda: bar.close(n), True)
    return ()


def _pop(bar_id: int):
  with _bars_lock:
    bar = _bars.pop(bar_id, None)
    if bar is not None:
      ids = _by_slot.get(bar.opened_by)
      if ids is not None:
        ids.discard(bar_id)
        if not ids:
          del _by_slot[bar.opened_by]
  return bar


def close_for(slot: int, chains: tuple = ()) -> None:
  """Closes the bars an execution of ``slot`` opened: it failed on
  ``chains`` (only ``DEFAULT``'s or ``GLOBAL``'s holds bars), or the slot is
  freed (``chains`` empty)."""
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

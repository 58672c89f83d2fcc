"""Where effect output goes, and when: sinks, listeners, the deterministic view.

Every line written by :func:`jax_effects.print` and every record emitted by
:func:`jax_effects.log` is handed over here by its host callback
(:func:`deliver_line` / :func:`deliver_record`) on whichever thread runs the
callback. A line of a per-device callback gets its placement prefix
(``[device D shard S process P] ``, see ``_runtime.placement``).

Sinks: lines go to ``sys.stdout`` (one lock keeps each line whole), records
to their logger. Listeners (the pytest plugin's ``effects_capture``) observe
both in delivery order; they must be cheap and thread-safe. Nothing here
touches tokens: the token calling convention has put the effect in order by
the time its host callback delivers.

Record listeners come in two kinds: plain ones see the records the logger
handles (its level enabled); *all-levels* ones (``all_levels=True``) see
every record ``log`` builds, with a flag saying whether the logger enabled
it. While an all-levels listener is registered, ``log`` builds records of
every level (:func:`capturing_all_records`); the logger still handles only
the enabled ones.

**The deterministic view** (``jax_effects.deterministic``, which calls
:func:`start_holding`/:func:`stop_holding`). Per-device effects are ordered
on each device, but devices run concurrently, so the interleaving of their
output changes from run to run. While holding, the ordered output of
per-device callbacks of token-threaded code is *held*, and released sorted by
(position in its device's sequence, device id) when the dispatch's
per-device token is combined into the next runtime token
(``_per_device.combine``: a host callback that runs after
every device's effects), or just before an ordered effect that runs once
(which follows them by data dependency), or when the view ends.
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable

from jax_effects._runtime import placement as _placement

# --- listeners ---------------------------------------------------------------------

_lock = threading.Lock()
_line_listeners: tuple[Callable[[str], None], ...] = ()
_record_listeners: tuple[Callable[[logging.LogRecord], None], ...] = ()
_all_record_listeners: tuple[Callable[..., None], ...] = ()


def add_line_listener(fn: Callable[[str], None]) -> None:
  global _line_listeners
  with _lock:
    _line_listeners = (*_line_listeners, fn)


def remove_line_listener(fn: Callable[[str], None]) -> None:
  global _line_listeners
  with _lock:
    # (==: a bound method is a new object on every attribute access)
    _line_listeners = tuple(f for f in _line_listeners if f != fn)


def add_record_listener(fn: Callable, all_levels: bool = False) -> None:
  """Adds ``fn(record)``, or ``fn(record, logger, enabled)`` if ``all_levels``."""
  global _record_listeners, _all_record_listeners
  with _lock:
    if all_levels:
      _all_record_listeners = (*_all_record_listeners, fn)
    else:
      _record_listeners = (*_record_listeners, fn)


def remove_record_listener(fn: Callable) -> None:
  global _record_listeners, _all_record_listeners
  with _lock:
    _record_listeners = tuple(f for f in _record_listeners if f != fn)
    _all_record_listeners = tuple(
        f for f in _all_record_listeners if f != fn)


def capturing_all_records() -> bool:
  """Whether records of levels the logger does not enable are wanted."""
  return bool(_all_record_listeners)


# --- sinks ---------------------------------------------------------------------------

_write_lock = threading.Lock()


def _write_line(line: str) -> None:
  """Writes one line (without its newline) to ``sys.stdout``, and listeners.

  Host callbacks of several devices and threads run at the same time, and
  ``sys.stdout`` (a ``TextIOWrapper``) is not thread-safe: one lock keeps
  every line whole. As for the builtin ``print``, a ``sys.stdout`` of None
  writes nothing and a closed one raises ``ValueError`` (which reaches the
  caller as the callback's error).
  """
  out = sys.stdout
  if out is not None:
    with _write_lock:
      out.write(line + "\n")
  for fn in _line_listeners:
    fn(line)


def _handle_record(logger: logging.Logger, record: logging.LogRecord) -> None:
  """Hands one record to ``logger`` and listeners, if its level is enabled.

  All-levels listeners get it whether enabled or not.
  """
  enabled = logger.isEnabledFor(record.levelno)
  if enabled:
    logger.handle(record)
    for fn in _record_listeners:
      fn(record)
  for fn in _all_record_listeners:
    fn(record, logger, enabled)


# --- delivery ------------------------------------------------------------------------

def deliver_line(text: str, ordered: bool) -> None:
  """Delivers a printed line; per-device lines get their placement prefix."""
  p = _placement.current()
  if p is not None and p.per_device:
    text = p.prefix() + text
  _hold_or_run(ordered, lambda: _write_line(text))


def deliver_record(logger: logging.Logger, record: logging.LogRecord,
                   ordered: bool) -> None:
  """Delivers a log record (held in the deterministic view like lines)."""
  _hold_or_run(ordered, lambda: _handle_record(logger, record))


def deliver(thunk: Callable[[], None], ordered: bool) -> None:
  """Runs an output action of a host callback (``progress`` drawing its
  bar), held in the deterministic view like lines."""
  _hold_or_run(ordered, thunk)


# --- the deterministic view ------------------------------------------------------------

_hold_lock = threading.Lock()
_hold_depth = 0
# device sort key -> [deliver thunk, ...] in that device's order
_held: dict[Any, list] = {}


def holding() -> bool:
  """Whether a deterministic view is active (in any thread)."""
  return _hold_depth > 0


def start_holding() -> None:
  global _hold_depth
  with _hold_lock:
    _hold_depth += 1


def stop_holding() -> None:
  """Ends one deterministic view; releases what is held when none is left."""
  global _hold_depth
  with _hold_lock:
    _hold_depth -= 1
  release_held()   # everything still held: the effects have all run


def _run(thunk: Callable[[], None]) -> None:
  """Runs a delivery (sinks, handlers: user code) with ``_runtime.placement.site``
  cleared: a ``placement()`` there finds the innermost host function on the
  stack (this callback's, or that of jitted code a handler runs inline)."""
  site = _placement.site
  saved = site.running
  if saved[0] is None:
    thunk()
    return
  site.running = (None, False)
  try:
    thunk()
  finally:
    site.running = saved


def _hold_or_run(ordered: bool, thunk: Callable[[], None]) -> None:
  if _hold_depth and _placement.threaded():
    p = _placement.current()
    if ordered and p is not None and p.per_device:
      key = (p.device_id if p.device_id is not None else -1, p.shard_index)
      with _hold_lock:
        if _hold_depth:
          _held.setdefault(key, []).append(thunk)
          return
    elif ordered and _held:
      # Runs once, after the per-device effects before it (data dependency):
      # they come first.
      release_held()
  _run(thunk)


def release_held() -> None:
  """Delivers the held output, ordered by (position on its device, device)."""
  if not _held:
    return
  with _hold_lock:
    release = dict(_held)
    _held.clear()
  keys = sorted(release, key=lambda k: k[0])
  depth = max((len(v) for v in release.values()), default=0)
  for i in range(depth):
    for key in keys:
      entries = release[key]
      if i < len(entries):
        _run(entries[i])

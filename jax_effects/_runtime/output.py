"""Where effect output goes, and when: sinks, listeners, the deterministic view.

Every line written by :func:`jax_effects.print` and every record emitted by
:func:`jax_effects.log` is handed over here by its host callback
(:func:`deliver_line` / :func:`deliver_record`) on whichever thread runs the
callback. A line of a per-device callback gets its placement prefix
(``[device D shard S process P] ``, see ``_runtime.placement``). JAX's own
``jax.debug.print``/``log`` adopted inside ``jax_effects.jit`` deliver here
too (:func:`deliver_jax_line` / :func:`deliver_jax_record`: JAX's text, no
prefix, the record handled as JAX hands it over), as ordered effects.

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
(``device_tokens.combine``: a host callback that runs after
every device's effects), or just before an ordered effect that runs once
(which follows them by data dependency), or when the view ends. An adopted
``jax.debug.callback``/``io_callback`` releases what is held before it runs
(``_frontends.adopted_host``): user code cannot be held, so the output
before it on its device comes out first.

A release delivers every held line and record, also when a delivery raises
(a sink's ``write``, a handler): what they raise is returned
(:func:`release_held`) and reported to the thread whose dispatch the
release belongs to, like a callback's error (``design/errors.md``), never
raised inside a host callback, where it would fail the computation or stop
that callback's own effect."""
from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable

import numpy as np

from jax_effects._runtime import errors as _errors
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import token_value as _token_value

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

# None, or ``around(stream, write)``: runs ``write()``, which writes to
# ``stream`` (None: a record's handlers, which write where they write), with
# the progress bars drawn in place on that terminal cleared before and
# redrawn after, as ``tqdm.write`` does. Set by ``_runtime.bars`` while a
# bar is drawn in place (:func:`write_around`).
_around: Callable[[Any, Callable[[], None]], None] | None = None


def write_around(around: Callable[[Any, Callable[[], None]], None] | None
                 ) -> None:
  """Routes the lines and records written from now on through ``around``
  (None: written directly); see ``_runtime.bars``."""
  global _around
  _around = around


def _write_line(line: str) -> None:
  """Writes one line (without its newline) to ``sys.stdout``, and listeners.

  Host callbacks of several devices and threads run at the same time, and
  ``sys.stdout`` (a ``TextIOWrapper``) is not thread-safe: one lock keeps
  every line whole. As for the builtin ``print``, a ``sys.stdout`` of None
  writes nothing and a closed one raises ``ValueError`` (which reaches the
  caller as the callback's error). While a progress bar is drawn in place,
  the line is written around it (:func:`write_around`).
  """
  out = sys.stdout
  if out is not None:
    around = _around
    if around is None:
      with _write_lock:
        out.write(line + "\n")
    else:
      def write():
        with _write_lock:
          out.write(line + "\n")
      around(out, write)
  for fn in _line_listeners:
    fn(line)


def _handle(logger: logging.Logger, record: logging.LogRecord) -> None:
  """``logger.handle(record)``, around the bars drawn in place."""
  around = _around
  if around is None:
    logger.handle(record)
  else:
    around(None, lambda: logger.handle(record))


def _handle_record(logger: logging.Logger, record: logging.LogRecord) -> None:
  """Hands one record to ``logger`` and listeners, if its level is enabled.

  All-levels listeners get it whether enabled or not.
  """
  enabled = logger.isEnabledFor(record.levelno)
  if enabled:
    _handle(logger, record)
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


def deliver_jax_line(text: str) -> None:
  """Delivers a line of JAX's ``jax.debug.print`` adopted by the pass
  (``_frontends.adopted_host``): as JAX writes it (no placement prefix), to
  ``sys.stdout`` and listeners, held in the deterministic view like an
  ordered line (adopted callbacks join an ordered chain)."""
  _hold_or_run(True, lambda: _write_line(text))


def deliver_jax_record(logger: logging.Logger,
                       record: logging.LogRecord) -> None:
  """Delivers a record of JAX's ``jax.debug.log`` adopted by the pass: as
  JAX hands it over (``logger.handle``, whatever the logger's level), and to
  listeners as a record the logger handled; held like an ordered record."""
  def handle():
    _handle(logger, record)
    for fn in _record_listeners:
      fn(record)
    for fn in _all_record_listeners:
      fn(record, logger, True)
  _hold_or_run(True, handle)


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


def stop_holding() -> list[BaseException]:
  """Ends one deterministic view and releases what is still held (the
  effects have all run); returns what the deliveries raised
  (:func:`release_held`)."""
  global _hold_depth
  with _hold_lock:
    _hold_depth = max(0, _hold_depth - 1)   # (a view entered before a fork)
  return release_held()


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
      release_in_callback()
  _run(thunk)


# Releases are serialized, and one that finds nothing held waits for one in
# progress: when release_held() returns, everything held before the call has
# been delivered (an adopted callback relies on it: the device threads of a
# computation release at the same time, and one must not write before the
# lines another thread took out of _held are written). Reentrant: a handler
# run by a release may itself release.
_release_lock = threading.RLock()
_releasing = 0   # releases between taking entries and delivering the last


def release_held() -> list[BaseException]:
  """Delivers the held output, ordered by (position on its device, device);
  returns once everything held when it was called is delivered.

  Every held delivery runs, also after one raised; returns what they raised,
  in delivery order (the caller reports them: see the module docstring).
  """
  global _releasing
  if not _held and not _releasing:
    return []
  failures = []
  with _release_lock:
    with _hold_lock:
      release = dict(_held)
      _held.clear()
      _releasing += 1
    try:
      keys = sorted(release, key=lambda k: k[0])
      depth = max((len(v) for v in release.values()), default=0)
      for i in range(depth):
        for key in keys:
          entries = release[key]
          if i < len(entries):
            try:
              _run(entries[i])
            except BaseException as exc:  # noqa: BLE001 - reported by the caller
              failures.append(exc)
    finally:
      with _hold_lock:
        _releasing -= 1
  return failures


def release_in_callback() -> None:
  """:func:`release_held` from a host callback: what the deliveries raise is
  the error of the dispatch the held output belongs to, not of this
  callback, so it is deferred for the thread that dispatched the running
  computation (the slot its carrier holds, see ``errors``; unknown: 0)."""
  if not _held and not _releasing:
    return
  failures = release_held()
  if failures:
    carrier = _placement.host_local("carrier")
    slot = (0 if carrier is None
            else _token_value.slot_of(int(np.max(carrier))))
    for exc in failures:
      _errors.defer(exc, slot)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """A forked child holds none of the parent's output (its devices' lines
  would be delivered twice) and no lock a parent's thread held (``fork``)."""
  global _lock, _write_lock, _hold_lock, _hold_depth, _release_lock, _releasing
  _lock = threading.Lock()
  _write_lock = threading.Lock()
  _hold_lock = threading.Lock()
  _release_lock = threading.RLock()
  _releasing = 0
  _hold_depth = 0
  _held.clear()

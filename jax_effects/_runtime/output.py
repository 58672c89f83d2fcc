"""Where effect output goes, and when: sinks, listeners, deterministic view.

Host callbacks hand every line of :func:`jax_effects.print` and record of
:func:`jax_effects.log` (and of JAX's own adopted ``jax.debug.print``/
``log``: :func:`deliver_line` not ``placed``, :func:`deliver_jax_record`)
over here, on whichever thread runs them; a per-device line gets its
placement prefix.
Lines go to ``sys.stdout`` (each whole: one write, under one lock unless
the stream is one of Python's own that keeps it whole), records to their
logger; listeners (``effects_capture``) see both in delivery order, and
*all-levels* record listeners every record ``log`` builds
(:func:`capturing_all_records`). ``design/formatting.md``, "Output".

**The deterministic view** (:func:`start_holding`/:func:`stop_holding`):
the ordered output of per-device callbacks of token-threaded code is
*held*, and released sorted by (position on its device, device) when the
per-device token is combined (``token_store.combine``), before an
ordered effect that runs once, or when the view ends (``design/placement.md``).
What a release's deliveries raise is returned (:func:`release_held`) and
reported to the dispatching thread, never raised in a host callback.

Nothing here touches tokens: the token calling convention has put the
effect in order by the time its host callback delivers.
"""
from __future__ import annotations

import io
import logging
import sys
import threading
from typing import Any, Callable

from jax_effects._runtime import errors as _errors
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import placement as _placement

# --- listeners -------------------------------------------------------------

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
  """Adds ``fn(record)`` (``fn(record, logger, enabled)``: ``all_levels``)."""
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
    _all_record_listeners = tuple(f for f in _all_record_listeners if f != fn)


def capturing_all_records() -> bool:
  """Whether records of levels the logger does not enable are wanted."""
  return bool(_all_record_listeners)


# --- sinks -----------------------------------------------------------------

_write_lock = threading.Lock()

# The streams last found to keep a line whole by itself and not to
# (:func:`_whole_lines`).
_keeps_lines_whole: Any = None
_needs_lock: Any = None


# CPython's ``TextIOWrapper.write`` is safe against another thread's write
# from 3.12.4 and 3.13.0b2 (gh-119506): before, a write that lands while
# another thread's flush has released the GIL in the raw write is lost, and
# the wrapper's byte count then makes a later flush write uninitialized
# memory (seen in CI on 3.11.7 and 3.12.1; tests/runtime/test_output_lock.py).
_TEXTIO_THREAD_SAFE = (sys.version_info >= (3, 13, 0, "beta", 2)
                       or (3, 12, 4) <= sys.version_info < (3, 13))


def _whole_lines(out) -> bool:
  """Whether ``out.write(line)`` keeps the line whole against other
  threads' writes without the lock: Python's own C streams, an
  ``io.StringIO`` or (on a CPython with gh-119506's fix) an
  ``io.TextIOWrapper`` over a ``BufferedWriter`` (or ``BufferedRandom``)
  over a ``FileIO``, append a whole written text to their buffer holding
  the GIL (a critical section without one), and the buffered writer writes
  what it flushes under its own lock. The lock costs a line in a compiled
  loop about a quarter of Python's own ``print`` (issue 48); any other
  stream (a Python-level one: pytest's, IPython's, a user's) is written
  under it. Remembers ``out`` when it is one, or that it is not."""
  global _keeps_lines_whole, _needs_lock
  kind = type(out)
  whole = kind is io.StringIO
  if kind is io.TextIOWrapper and _TEXTIO_THREAD_SAFE:
    try:
      buffer = out.buffer
      whole = (type(buffer) in (io.BufferedWriter, io.BufferedRandom)
               and type(buffer.raw) is io.FileIO)
    except (AttributeError, ValueError):   # (detached: its write raises)
      return False
  if whole:
    _keeps_lines_whole = out
  else:
    _needs_lock = out
  return whole


# None, or ``around(stream, write)`` (:func:`write_around`).
_around: Callable[[Any, Callable[[], None]], None] | None = None


def write_around(around: Callable[[Any, Callable[[], None]], None] | None) -> None:
  """Routes the lines and records written from now on through
  ``around(stream, write)``, which runs ``write()`` with the bars drawn in
  place on ``stream`` (None: a record's handlers) cleared and redrawn;
  None: written directly (``_runtime.bars``)."""
  global _around
  _around = around


def _write_line(line: str) -> None:
  """Writes one line (without its newline) to ``sys.stdout`` (under a
  lock: a stream need not be thread-safe, but not for the streams of
  :func:`_whole_lines`, which keep a written line whole; None writes
  nothing, as ``print``), and to listeners."""
  out = sys.stdout
  if out is not None:
    around = _around
    if around is None:
      if out is _keeps_lines_whole or (out is not _needs_lock and _whole_lines(out)):
        out.write(line + "\n")
      else:
        with _write_lock:
          out.write(line + "\n")
    else:
      def write():
        with _write_lock:
          out.write(line + "\n")
      around(out, write)
  for fn in _line_listeners:
    fn(line)


def _handle_record(logger: logging.Logger, record: logging.LogRecord,
                   enabled: bool | None = None) -> None:
  """Hands one record to ``logger`` and listeners if ``enabled`` (by
  default: its level is); all-levels listeners get it either way."""
  if enabled is None:
    enabled = logger.isEnabledFor(record.levelno)
  if enabled:
    around = _around
    if around is None:
      logger.handle(record)
    else:
      around(None, lambda: logger.handle(record))
    for fn in _record_listeners:
      fn(record)
  for fn in _all_record_listeners:
    fn(record, logger, enabled)


# --- delivery --------------------------------------------------------------

# (the one value of ``placement.site.running`` while a delivery runs: :func:`_run`)
_CLEARED = (None, False)


def deliver_line(text: str, ordered: bool, placed: bool = True) -> None:
  """Delivers a printed line; per-device lines get their placement prefix
  (``placed``; an adopted ``jax.debug.print``'s line, as JAX writes it, is
  not ``placed``).

  The common case (no deterministic view) is :func:`deliver` and
  :func:`_run` in this frame, then :func:`_write_line`: a line in a
  compiled loop pays for every Python frame (issue 48)."""
  site = _placement.site
  running = site.running
  if placed:
    p = running[0]
    if p is None:
      p = _placement.current()
    if p is not None and p.shard_index is not None:   # (p.per_device)
      text = p.prefix() + text
  if _hold_depth:
    deliver(lambda: _write_line(text), ordered)
    return
  if running[0] is None:
    _write_line(text)
    return
  site.running = _CLEARED
  try:
    _write_line(text)
  finally:
    site.running = running


def _prefix_at(running: tuple) -> str:
  """The prefix of the lines of a host function that runs at ``running``
  (``placement.running``): its per-device placement's, or none."""
  p = running[0]
  return p.prefix() if p is not None and p.shard_index is not None else ""


def line_at(ordered: bool, running: tuple) -> Callable[[str], None]:
  """``deliver_text(text)``: :func:`deliver_line` from a host function
  that runs at ``running`` (``placement.running``) and has not set
  ``placement.site``: an outer host function's site is cleared around the
  write, as :func:`_run` clears it; the prefix of a per-device placement is
  made once. The common case (no deterministic view, no outer site) goes
  straight to :func:`_write_line` (a line in a compiled loop pays for every
  frame, issue 48)."""
  prefix = _prefix_at(running)
  site = _placement.site

  def deliver_text(text: str) -> None:
    if prefix:
      text = prefix + text
    outer = site.running
    if _hold_depth:
      site.running = running
      try:
        deliver(lambda: _write_line(text), ordered)
      finally:
        site.running = outer
      return
    if outer[0] is not None or outer[1]:
      site.running = _CLEARED
      try:
        _write_line(text)
      finally:
        site.running = outer
      return
    _write_line(text)
  return deliver_text


def lines_at(ordered: bool, running: tuple) -> Callable[[list], None]:
  """``deliver_all(texts)``: each of ``texts`` delivered as
  :func:`line_at`'s ``deliver_text`` delivers it, in order (a batched
  loop's flush, ``_primitives/batching``). The common case (no deterministic
  view, no bars drawn, no listener, a stream of :func:`_whole_lines`, no
  outer site) writes them in one write: the same text, each line whole."""
  deliver = line_at(ordered, running)
  prefix = _prefix_at(running)
  site = _placement.site

  def deliver_all(texts: list) -> None:
    out = sys.stdout
    outer = site.running
    if (_hold_depth or _around is not None or _line_listeners or out is None
        or outer[0] is not None or outer[1]
        or not (out is _keeps_lines_whole
                or (out is not _needs_lock and _whole_lines(out)))):
      for text in texts:
        deliver(text)
      return
    if texts:
      if prefix:
        out.write("".join([prefix + t + "\n" for t in texts]))
      else:
        out.write("\n".join(texts) + "\n")
  return deliver_all


def deliver_record(logger: logging.Logger, record: logging.LogRecord,
                   ordered: bool) -> None:
  """Delivers a log record (held in the deterministic view like lines);
  the common case in this frame, as :func:`deliver_line`'s."""
  if _hold_depth:
    deliver(lambda: _handle_record(logger, record), ordered)
    return
  site = _placement.site
  running = site.running
  if running[0] is None:
    _handle_record(logger, record)
    return
  site.running = _CLEARED
  try:
    _handle_record(logger, record)
  finally:
    site.running = running


def deliver_jax_record(logger: logging.Logger, record: logging.LogRecord) -> None:
  """Delivers a record of an adopted ``jax.debug.log`` as JAX hands it over
  (handled whatever the logger's level), as an ordered record."""
  deliver(lambda: _handle_record(logger, record, True), True)


# --- the deterministic view ------------------------------------------------

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
  """Ends one deterministic view and releases what is still held; returns
  what the deliveries raised."""
  global _hold_depth
  with _hold_lock:
    _hold_depth = max(0, _hold_depth - 1)   # (a view entered before a fork)
  return release_held()


def _run(thunk: Callable[[], None]) -> None:
  """Runs a delivery (user code: sinks, handlers) with ``placement.site``
  cleared (a ``placement()`` there finds the innermost host function)."""
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


def deliver(thunk: Callable[[], None], ordered: bool) -> None:
  """Runs an output action of a host callback (a line, a record, a
  ``progress`` bar's drawing), held in the deterministic view (per-device,
  ``ordered``), else run now (:func:`_run`)."""
  if _hold_depth:
    p = _placement.current()
    # (site.running[1]: the running host function went through the pass)
    if ordered and p is not None and p.per_device and _placement.site.running[1]:
      key = (p.device_id if p.device_id is not None else -1, p.shard_index)
      with _hold_lock:
        if _hold_depth:
          _held.setdefault(key, []).append(thunk)
          return
    elif ordered and _held:
      # (runs once, after the per-device effects before it: they come first)
      release_in_callback()
  _run(thunk)


# Releases are serialized, and one that finds nothing held waits for one in
# progress (an adopted callback relies on it: another device's thread may
# still write what it took out of _held). Reentrant: a handler run by a
# release may itself release.
_release_lock = threading.RLock()
_releasing = 0   # releases between taking entries and delivering the last


def release_held() -> list[BaseException]:
  """Delivers the held output, ordered by (position on its device, device),
  once everything held when called is; returns what the deliveries raised
  (every one runs), for the caller to report."""
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
            except BaseException as exc:  # noqa: BLE001 - the caller reports
              failures.append(exc)
    finally:
      with _hold_lock:
        _releasing -= 1
  return failures


def before_user_code() -> None:
  """What a user's callback does first: where it runs once (not per
  device), the per-device output held before it comes out (its own writes
  go where it likes, which cannot be held: design/placement.md)."""
  if _held and _hold_depth:
    p = _placement.current()
    if p is None or not p.per_device:
      release_in_callback()


def release_in_callback() -> None:
  """:func:`release_held` from a host callback: what the deliveries raise
  is deferred for the running computation's dispatching thread."""
  if not _held and not _releasing:
    return
  failures = release_held()
  if failures:
    slot = _placement.carrier_slot()   # (a walk of the stack: once)
    for exc in failures:
      _errors.defer(exc, slot)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  global _lock, _write_lock, _hold_lock, _hold_depth, _release_lock, _releasing
  _lock = threading.Lock()
  _write_lock = threading.Lock()
  _hold_lock = threading.Lock()
  _release_lock = threading.RLock()
  _releasing = 0
  _hold_depth = 0
  _held.clear()

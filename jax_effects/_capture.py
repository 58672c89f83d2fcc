"""Where effect output goes: stdout for printed lines, ``logging`` for records.

Every line written by :func:`jax_effects.print` and every record emitted by
:func:`jax_effects.log` passes through :func:`deliver_line` /
:func:`deliver_record` (on the host, after the token calling convention has
put the effect in order; nothing here touches tokens). Listeners (the pytest
plugin's ``effects_capture`` fixture) observe them in delivery order.
Delivery happens on whichever thread runs the host callback, so listener
lists are guarded by a lock and listeners must be cheap and thread-safe.

Record listeners come in two kinds: plain ones see the records the logger
handles (its level enabled); *all-levels* ones (``all_levels=True``) see
every record ``log`` builds, with a flag saying whether the logger enabled
it. While an all-levels listener is registered, ``log`` builds records of
every level (:func:`capturing_all_records`); the logger still handles only
the enabled ones.
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import Callable

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


_write_lock = threading.Lock()


def deliver_line(line: str) -> None:
  """Writes one printed line (without its newline) to ``sys.stdout``.

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


def deliver_record(logger: logging.Logger, record: logging.LogRecord) -> None:
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

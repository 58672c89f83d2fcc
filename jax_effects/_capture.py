"""Where effect output goes: stdout for printed lines, ``logging`` for records.

Every line written by :func:`jax_effects.print` and every record emitted by
:func:`jax_effects.log` passes through :func:`deliver_line` /
:func:`deliver_record`. Listeners (the pytest plugin's ``effects_capture``
fixture) observe them in delivery order. Delivery happens on whichever thread
runs the host callback, so listener lists are guarded by a lock and listeners
must be cheap and thread-safe.
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import Callable

_lock = threading.Lock()
_line_listeners: tuple[Callable[[str], None], ...] = ()
_record_listeners: tuple[Callable[[logging.LogRecord], None], ...] = ()


def add_line_listener(fn: Callable[[str], None]) -> None:
  global _line_listeners
  with _lock:
    _line_listeners = (*_line_listeners, fn)


def remove_line_listener(fn: Callable[[str], None]) -> None:
  global _line_listeners
  with _lock:
    _line_listeners = tuple(f for f in _line_listeners if f is not fn)


def add_record_listener(fn: Callable[[logging.LogRecord], None]) -> None:
  global _record_listeners
  with _lock:
    _record_listeners = (*_record_listeners, fn)


def remove_record_listener(fn: Callable[[logging.LogRecord], None]) -> None:
  global _record_listeners
  with _lock:
    _record_listeners = tuple(f for f in _record_listeners if f is not fn)


_write_lock = threading.Lock()


def deliver_line(line: str) -> None:
  """Writes one printed line (without its newline) to ``sys.stdout``.

  Host callbacks of several devices and threads run at the same time, and
  ``sys.stdout`` (a ``TextIOWrapper``) is not thread-safe: one lock keeps
  every line whole.
  """
  with _write_lock:
    sys.stdout.write(line + "\n")
  for fn in _line_listeners:
    fn(line)


def deliver_record(logger: logging.Logger, record: logging.LogRecord) -> None:
  """Hands one record to ``logger`` and listeners, if its level is enabled."""
  if not logger.isEnabledFor(record.levelno):
    return
  logger.handle(record)
  for fn in _record_listeners:
    fn(record)

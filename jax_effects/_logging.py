"""``jax_effects.log``: standard ``logging`` records from compiled code.

The format string is checked when the call is traced (as for ``print``), the
logger is resolved then too, and the source location of the ``log`` call is
captured from the Python stack, so records point at the user's line, not at
the host callback. At run time the host callback formats the NumPy values,
builds a :class:`logging.LogRecord` with ``logger.makeRecord`` (so the
logger's record factory and filters apply) and hands it to
:func:`jax_effects._output.deliver_record` (which holds it in the
deterministic view). Every record carries:

* ``device_id``: the device whose computation ran the callback (None when run
  eagerly, outside a compiled computation);
* ``shard_index``: the device's position along the mesh axes in per-device
  code (``shard_map``/``pmap``; an ``int`` for a one-axis mesh, a tuple of ints
  otherwise), None where the value is not per-device;
* ``process_index``: the JAX process index of that device (of this process
  when run eagerly).

``record.getMessage()`` is the formatted text (``record.msg`` holds it and
``record.args`` is empty), so ``%``-style handler formatting never re-applies.
"""
from __future__ import annotations

import logging
import os
import sys

import jax

from jax_effects import _arguments
from jax_effects import _effects
from jax_effects import _output
from jax_effects import _placement
from jax_effects import _primitives
from jax_effects._printing import check_format

#: The logger of :func:`log` when ``logger=None``.
LOGGER_NAME = "jax_effects"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep


def _resolve_logger(what: str, logger) -> logging.Logger:
  if logger is None:
    return logging.getLogger(LOGGER_NAME)
  if isinstance(logger, str):
    return logging.getLogger(logger)
  if isinstance(logger, (logging.Logger, logging.LoggerAdapter)):
    return logger.logger if isinstance(logger, logging.LoggerAdapter) else logger
  raise TypeError(
      f"{what}: logger= must be None, a logger name (str) or a logging.Logger, "
      f"got {type(logger).__name__}")


def _resolve_level(what: str, level) -> int:
  if isinstance(level, bool):
    raise TypeError(f"{what}: level= must be an int or a level name, got {level!r}")
  if isinstance(level, int):
    return level
  if isinstance(level, str):
    levels = logging.getLevelNamesMapping()
    if level.upper() in levels:
      return levels[level.upper()]
    raise ValueError(
        f"{what}: unknown level name {level!r}; expected one of "
        f"{sorted(levels)} or an int")
  raise TypeError(f"{what}: level= must be an int or a level name, got {level!r}")


def _caller():
  """(pathname, lineno, funcName) of the first frame outside jax_effects/jax."""
  frame = sys._getframe(2)
  while frame is not None:
    path = frame.f_code.co_filename
    if not path.startswith((_PACKAGE_DIR, _JAX_DIR)):
      return path, frame.f_lineno, frame.f_code.co_name
    frame = frame.f_back
  return "(unknown file)", 0, "(unknown function)"


def log(fmt: str, *args, level=logging.INFO, logger=None,
        ordered: bool | None = None, effect=None, **kwargs) -> None:
  """Emits a ``logging`` record with ``fmt.format(*args, **kwargs)``.

  Works inside and outside ``jax_effects.jit`` like :func:`jax_effects.print`:
  the record is emitted when the computation runs, in program order with the
  other ordered effects of ``effect`` (default :data:`jax_effects.DEFAULT`).
  ``ordered=None`` (the default) takes the effect's default, True unless the
  :class:`~jax_effects.Effect` was created with ``ordered=False``, as for
  ``print``.
  ``logger`` is None (the ``"jax_effects"`` logger), a logger name, or a
  :class:`logging.Logger`; ``level`` an int or a level name. Whether the level
  is enabled is decided when the record would be emitted.

  Records carry ``device_id``, ``shard_index`` and ``process_index`` (see
  :mod:`jax_effects._logging`); in per-device code (``shard_map``, ``pmap``)
  each device emits its own record.
  """
  what = f"jax_effects.log({fmt!r})"
  effect, ordered = _effects.resolve(what, effect, ordered)
  check_format(what, fmt, args, kwargs)
  lg = _resolve_logger(what, logger)
  levelno = _resolve_level(what, level)
  pathname, lineno, func = _caller()
  operands, rebuild = _arguments.split(what, args, kwargs, allow_str=True)

  def emit(*np_operands):
    if not lg.isEnabledFor(levelno):
      return ()
    a, k = rebuild(np_operands)
    place = _placement.current()
    if place is None:
      extra = {"device_id": None, "shard_index": None,
               "process_index": jax.process_index()}
    else:
      extra = {"device_id": place.device_id, "shard_index": place.shard_index,
               "process_index": place.process_index}
    record = lg.makeRecord(lg.name, levelno, pathname, lineno,
                           fmt.format(*a, **k), (), None, func, extra)
    _output.deliver_record(lg, record, ordered)
    return ()

  _primitives.bind_effect(emit, what, operands, effect=effect, ordered=ordered)

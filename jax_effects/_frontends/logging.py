"""``jax_effects.log``: standard ``logging`` records from compiled code.

What ``logging.Logger.log`` decides at the call is decided when ``log`` is
traced; at run time the message is formatted as ``print`` formats its line
and the record made with ``logger.makeRecord`` and handed to
``_runtime.output.deliver_record`` (``design/formatting.md``, "Logging").
Part in the token calling convention: that of every effect (one
``effect_p``: the message's array arguments, then ``extra``'s).
"""
from __future__ import annotations

from collections.abc import Mapping
import io
import logging
import os
import sys
import traceback
from typing import Any

import jax
import numpy as np

from jax_effects._core import effects as _effects
from jax_effects._core.effects import Effect
from jax_effects._frontends import arguments as _arguments
from jax_effects._frontends import printing as _printing
from jax_effects._primitives import effect as _effect
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_specs as _host_specs
from jax_effects._runtime import output as _output
from jax_effects._runtime import placement as _placement

#: The logger of :func:`log` when ``logger=None``.
LOGGER_NAME = "jax_effects"

#: Attributes jax_effects sets on every record (``extra`` may not set them).
PLACEMENT_KEYS = ("device_id", "shard_index", "process_index")

# The package's root folder (this module is in one of its layer folders).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep
_RECORD_KEYS = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
        "message", "asctime"}


def _resolve_logger(what: str, logger):
  """Returns ``(logger, adapters)``, adapters outermost first."""
  if logger is None:
    return logging.getLogger(LOGGER_NAME), ()
  if isinstance(logger, str):
    return logging.getLogger(logger), ()
  adapters = []
  while isinstance(logger, logging.LoggerAdapter):
    adapters.append(logger)
    logger = logger.logger
  if isinstance(logger, logging.Logger):
    return logger, tuple(adapters)
  raise TypeError(
      f"{what}: logger= must be None, a logger name (str), a logging.Logger "
      f"or a logging.LoggerAdapter, got {type(logger).__name__}")


def _resolve_level(what: str, level) -> int:
  if isinstance(level, int) and not isinstance(level, bool):
    return level
  if isinstance(level, str):
    levels = logging.getLevelNamesMapping()
    if level.upper() in levels:
      return levels[level.upper()]
    raise ValueError(
        f"{what}: unknown level name {level!r}; expected one of "
        f"{sorted(levels)} or an int")
  raise TypeError(
      f"{what}: level= must be an int or a level name, got {level!r}")


def _internal(frame) -> bool:
  return frame.f_code.co_filename.startswith((_PACKAGE_DIR, _JAX_DIR))


def _caller(what: str, stacklevel, stack_info: bool):
  """(pathname, lineno, funcName, sinfo) as ``Logger.findCaller`` finds
  them, jax's and jax_effects' frames not counting as levels."""
  if isinstance(stacklevel, bool) or not isinstance(stacklevel, int):
    raise TypeError(f"{what}: stacklevel= must be an int, got {stacklevel!r}")
  f = sys._getframe(1)
  while f is not None and _internal(f):
    f = f.f_back
  if f is None:
    return "(unknown file)", 0, "(unknown function)", None
  level = stacklevel - 1
  while level > 0:
    up = f.f_back
    if up is None:
      break
    f = up
    if not _internal(f):
      level -= 1
  sinfo = None
  if stack_info:
    with io.StringIO() as sio:
      sio.write("Stack (most recent call last):\n")
      traceback.print_stack(f, file=sio)
      sinfo = sio.getvalue().rstrip("\n")
  return f.f_code.co_filename, f.f_lineno, f.f_code.co_name, sinfo


def _resolve_exc_info(exc_info):
  """``exc_info`` as ``Logger._log`` resolves it, at trace time."""
  if not exc_info:
    return None
  if isinstance(exc_info, BaseException):
    return (type(exc_info), exc_info, exc_info.__traceback__)
  if not isinstance(exc_info, tuple):
    return sys.exc_info()
  return exc_info


def _split_extra(what: str, extra):
  """``(operands, values, spec)``: ``values(np_values)`` gives the dict;
  ``spec``: its structure as data, or why it is not (a str)."""
  if extra is None:
    return [], lambda values: None, None
  if not isinstance(extra, Mapping):
    raise TypeError(
        f"{what}: extra= must be a mapping (dict) of record attributes, got "
        f"{type(extra).__name__}")
  for key in extra:
    if not isinstance(key, str):
      raise TypeError(f"{what}: extra= keys must be str, got {key!r}")
    if key in PLACEMENT_KEYS:
      raise ValueError(
          f"{what}: extra= sets {key!r}, which jax_effects sets on every "
          f"record (one of {list(PLACEMENT_KEYS)}); use another name")
    if key in _RECORD_KEYS:
      raise ValueError(
          f"{what}: extra= sets {key!r}, an attribute of every LogRecord "
          "(logging would raise KeyError: \"Attempt to overwrite\"); use "
          "another name")
  fa = _arguments.split_for_format(f"{what} extra=", (), dict(extra),
                                   arrays_only=True)
  try:
    spec = _host_specs.encode_tree(((), dict(extra)), set(fa.positions))
  except _host_specs.NotData as err:
    spec = f"its extra= has {err}"
  return fa.operands, _extra_values(fa.rebuild), spec


def _extra_values(rebuild):
  """``values(np_values)``: the ``extra`` dict (0-d arrays as scalars)."""
  def values(np_values):
    vals = [np.asarray(x) for x in np_values]
    return rebuild([x[()] if x.ndim == 0 else x for x in vals])[1]
  return values


def _logger_name(lg: logging.Logger) -> str | None:
  """The name ``logging.getLogger`` finds ``lg`` by (None: not by name)."""
  if lg is logging.getLogger():
    return ""
  if lg.name and logging.getLogger(lg.name) is lg:
    return lg.name
  return None


class _Record:
  """What ``log`` decided when traced, for building its records."""
  __slots__ = ("lg", "adapters", "levelno", "pathname", "lineno", "func",
               "sinfo", "exc", "stack_info", "stacklevel", "extra_values",
               "ordered", "process_index")

  def __init__(self, **fields):
    for name in self.__slots__:
      setattr(self, name, fields[name])

  def emit(self, message, np_extra):
    """Builds and delivers the record (its level checked by the caller)."""
    lg, levelno = self.lg, self.levelno
    extra = self.extra_values(np_extra)
    if self.adapters:
      kw = {"extra": extra, "exc_info": self.exc,
            "stack_info": self.stack_info, "stacklevel": self.stacklevel}
      for adapter in self.adapters:
        message, kw = adapter.process(message, kw)
      extra = kw.get("extra")
    extra = dict(extra) if extra else {}
    place = _placement.current()
    if place is None:
      extra.update(device_id=None, shard_index=None,
                   process_index=self.process_index)
    else:
      extra.update(device_id=place.device_id, shard_index=place.shard_index,
                   process_index=place.process_index)
    record = lg.makeRecord(lg.name, levelno, self.pathname, self.lineno,
                           message, (), self.exc, self.func, extra,
                           self.sinfo)
    _output.deliver_record(lg, record, self.ordered)

  def jit_side(self, jit, n: int):
    """The host function of the compiled computation's values (``jit``,
    formatting the first ``n``), or of the values outside any trace
    (``formatter``'s ``eager``)."""
    lg, levelno, emit = self.lg, self.levelno, self.emit

    def emit_jit(*np_operands):
      if not lg.isEnabledFor(levelno) and not _output.capturing_all_records():
        return ()
      emit(jit(*np_operands[:n]), np_operands[n:])
      return ()
    return emit_jit


def _log_host(spec: dict) -> _host_callback.HostCallback:
  """The host side of a ``log`` spec, in any process."""
  name = spec["logger"]
  extra = spec["extra"]
  if extra is not None:
    _host_specs.check_tree(extra, f"{spec['what']}: its extra=")
  if name is not None and type(name) is not str:
    raise _host_specs.NotData(f"{spec['what']}: a logger name that is not "
                              f"a str")
  record = _Record(
      lg=logging.getLogger(name) if name else logging.getLogger(),
      adapters=(), levelno=spec["level"], pathname=spec["pathname"],
      lineno=spec["lineno"], func=spec["func"], sinfo=spec["sinfo"],
      exc=None, stack_info=spec["stack_info"],
      stacklevel=spec["stacklevel"],
      extra_values=(_extra_values(_host_specs.tree_decoder(extra))
                    if extra is not None else (lambda values: None)),
      ordered=spec["ordered"], process_index=jax.process_index())
  text = spec["text"]
  n = len(text["edges"])
  edges = (*_printing.spec_edges(text), *(None,) * spec["n_extra"])
  return _host_callback.HostCallback(
      record.jit_side(_printing.text_from_spec(text, spec["what"]), n),
      spec["what"],
      reads_placement=True, edges=edges, spec=spec)


_host_specs.register_kind("log", _log_host)


def _log_spec(what, record: _Record, text, extra_spec, n_extra: int):
  """The ``log`` as data, or why it is not (a str)."""
  if not isinstance(text, dict):
    return text
  if isinstance(extra_spec, str):
    return extra_spec
  if record.adapters:
    return "its logger is a LoggerAdapter (an object of this process)"
  if record.exc is not None:
    return "it has exc_info (an exception of this process)"
  name = _logger_name(record.lg)
  if name is None:
    return (f"its logger {record.lg.name!r} is not the one "
            f"logging.getLogger({record.lg.name!r}) returns")
  return {"kind": "log", "what": what, "text": text, "extra": extra_spec,
          "n_extra": n_extra, "logger": name, "level": record.levelno,
          "pathname": record.pathname, "lineno": record.lineno,
          "func": record.func, "sinfo": record.sinfo,
          "stack_info": bool(record.stack_info),
          "stacklevel": record.stacklevel, "ordered": record.ordered}


def log(fmt: str, *args: Any, level: int | str = logging.INFO,
        logger: str | logging.Logger | logging.LoggerAdapter[Any] | None = None,
        ordered: bool | None = None, effect: Effect | None = None,
        extra: Mapping[str, Any] | None = None, stacklevel: int = 1,
        stack_info: bool = False, exc_info: Any = None,
        **kwargs: Any) -> None:
  """Emits a ``logging`` record with ``fmt.format(*args, **kwargs)``.

  Works as :func:`jax_effects.print` (and formats the message as it does,
  with ``ordered`` and ``effect`` as for it): the record is emitted when
  the computation runs, in program order.

  ``logger`` is None (the ``"jax_effects"`` logger), a logger name, a
  :class:`logging.Logger` or a :class:`logging.LoggerAdapter` (its
  ``process()`` applies to the formatted message, as ``LoggerAdapter.log``
  does); ``level`` an int or a level name. ``extra``, ``stacklevel``,
  ``stack_info`` and ``exc_info`` mean what they mean for
  :meth:`logging.Logger.log`, resolved when the call is traced (``extra``
  values are kept as given, ``7`` an ``int``, ``0.1`` a ``float``, as
  ``Logger.log`` keeps them; a ``jax.Array`` or traced value there becomes
  its NumPy value, a 0-d one a NumPy scalar).
  Whether the level is enabled is decided when the record would be emitted.

  Records carry ``device_id`` (None when run eagerly), ``shard_index`` (in
  per-device code, ``shard_map``/``pmap``, the device's position along the
  mesh axes, else None) and ``process_index``; in per-device code each
  device emits its own record. ``record.getMessage()`` is the formatted
  text (``record.args`` is empty).
  """
  what = f"jax_effects.log({fmt!r})"
  effect, ordered = _effects.resolve(what, effect, ordered)
  lg, adapters = _resolve_logger(what, logger)
  levelno = _resolve_level(what, level)
  pathname, lineno, func, sinfo = _caller(what, stacklevel, stack_info)
  exc = _resolve_exc_info(exc_info)
  operands, eager, jit, edges, text = _printing.formatter(what, fmt, args, kwargs)
  extra_operands, extra_values, extra_spec = _split_extra(what, extra)
  n = len(operands)
  record = _Record(lg=lg, adapters=adapters, levelno=levelno,
                   pathname=pathname, lineno=lineno, func=func, sinfo=sinfo,
                   exc=exc, stack_info=stack_info, stacklevel=stacklevel,
                   extra_values=extra_values, ordered=ordered,
                   process_index=jax.process_index())
  spec = _log_spec(what, record, text, extra_spec, len(extra_operands))
  host = _log_host(spec).fn if isinstance(spec, dict) else record.jit_side(jit, n)
  # (run eagerly: extra='s operands are jax.Arrays, made NumPy's there)
  _effect.bind_effect(host, what, [*operands, *extra_operands],
                      effect=effect, ordered=ordered,
                      eager=record.jit_side(eager, n),
                      reads_placement=True,
                      edges=(*edges, *(None,) * len(extra_operands)),
                      spec=spec, batchable=True)

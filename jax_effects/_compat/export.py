"""``jax.export``: the call of an exported function, and the screen every
called module passes first (``_primitives.host_target.screen_module``).

Part in the token calling convention: none of its own;
``_pass.control_flow_rules`` threads an exported function's call on
DEFAULT's chain with these.
"""
from __future__ import annotations

import collections
import importlib
import threading

from jax_effects._compat.versions import JAX_VERSION, optional

#: The feature that needs these internals (``versions.MISSING``).
EXPORTED_CALLS = "calling a jax.export function with effects"


def _load():
  # ``Exported.call`` binds ``call_exported_p``: no public handle on it or
  # its lowering (which the pass reuses, and which is wrapped to screen
  # every called module: ``screen_exported_calls``). JAX 0.8-0.12.
  export = importlib.import_module("jax._src.export._export")
  return export.call_exported_p, export._call_exported_lowering


call_exported_p, _jax_call_exported_lowering = (
    optional(EXPORTED_CALLS, _load) or (None, None))

#: ``screen(module) -> bool`` functions run on the MLIR module of every
#: exported function this process calls (:func:`screen_exported_calls`).
_screens: list = []


def screen_exported_calls(screen) -> bool:
  """Runs ``screen(module)`` on the MLIR module of every exported function
  called in this process (``Exported.call``, plain or inside a ``jax.jit``,
  and the pass's ``exp.call``), before JAX's lowering of the call inlines
  it; ``screen`` edits the module in place and says whether it changed it
  (then the call lowers the edited module). False where JAX's lowering of
  the call cannot be wrapped (:data:`EXPORTED_CALLS` missing)."""
  if call_exported_p is None:
    return False
  _screens.append(screen)
  return True


#: A module's bytes -> its screened bytes (None: unchanged), the most
#: recently screened last: a module is parsed and walked once, not at each
#: lowering of a call of it (about 0.15 s for 12,000 operations).
_screened_bytes: "collections.OrderedDict[bytes, bytes | None]" = (
    collections.OrderedDict())
_SCREENED_KEPT = 64
_screen_lock = threading.Lock()


def _screened(exported):
  """``exported``, or a copy whose module the screens edited."""
  if not _screens:
    return exported
  import dataclasses
  import inspect
  from jax.interpreters import mlir
  data = bytes(exported.mlir_module_serialized)   # (a key: hashable)
  with _screen_lock:
    found = data in _screened_bytes
    blob = _screened_bytes.get(data)
    if found:
      _screened_bytes.move_to_end(data)
  if not found:
    with mlir.make_ir_context():
      # Exported.mlir_module(serialized=False) where it takes that parameter
      # (JAX 0.10, 0.12), else its text parsed (JAX 0.8: the text only)
      if "serialized" in inspect.signature(exported.mlir_module).parameters:
        module = exported.mlir_module(serialized=False)
      else:
        module = mlir.ir.Module.parse(exported.mlir_module())
      changed = any([screen(module) for screen in _screens])   # (each runs)
      blob = export_module_bytes(module) if changed else None
    with _screen_lock:
      _screened_bytes[data] = blob
      while len(_screened_bytes) > _SCREENED_KEPT:
        _screened_bytes.popitem(last=False)
  if blob is None:
    return exported
  return dataclasses.replace(exported, mlir_module_serialized=blob)


def call_exported_lowering(ctx, *args, exported):
  """JAX's lowering of ``call_exported_p``, of the screened module."""
  return _jax_call_exported_lowering(ctx, *args, exported=_screened(exported))


if call_exported_p is not None:
  # Every call of an exported function lowers through this rule, JAX's
  # own (registered by JAX for every platform) wrapped.
  from jax.interpreters import mlir as _mlir
  _mlir.register_lowering(call_exported_p, call_exported_lowering)


def export_allowed_custom_calls() -> frozenset | None:
  """The custom-call targets the running ``jax.export.export(...)(...)``
  allows (its ``disabled_checks``, a closure variable of ``do_export`` read
  from its frame: JAX 0.8-0.12), or None when no such frame is found.
  ``"ALL"`` stands for every target from JAX 0.10."""
  import sys
  frame = sys._getframe(1)
  while frame is not None:
    if (frame.f_code.co_name == "do_export" and frame.f_globals.get(
        "__name__") == "jax._src.export._export"):
      checks = frame.f_locals.get("disabled_checks")
      if checks is None:
        return None
      targets = {t for t in (c.is_custom_call() for c in checks) if t is not None}
      if JAX_VERSION < (0, 10):   # (JAX 0.8, 0.9 take "ALL" as a name)
        targets.discard("ALL")
      return frozenset(targets)
    frame = frame.f_back
  return None


def export_module_bytes(module) -> bytes:
  """The bytes ``jax.export`` stores for an MLIR ``module`` (JAX 0.8-0.12:
  no public serializer; JAX 0.8 refuses plain MLIR bytecode): a screened
  module's (:func:`_screened`), and tests' forged ones."""
  return importlib.import_module("jax._src.export._export")._module_to_bytecode(module)

"""``jax.export``: the call of an exported function.

Part in the token calling convention: an exported jax_effects function's
call is threaded on the chain of DEFAULT (``_pass.exported_rule``), its
compiler token the exported module's (``jax_effects._compat``).
"""
from __future__ import annotations

import importlib

from jax_effects._compat.versions import JAX_VERSION, optional

#: The feature that needs these internals (``versions.MISSING``).
EXPORTED_CALLS = "calling a jax.export function with effects"


def _load():
  # ``jax.export``: ``Exported.call`` binds ``call_exported_p`` (no public
  # handle on the primitive or its lowering). The token-threading pass
  # threads an exported jax_effects function's call on the chain of DEFAULT
  # (``_pass.exported_rule``), lowering it with JAX's own rule given the
  # chain's compiler token as the exported module's. JAX 0.8-0.12.
  export = importlib.import_module("jax._src.export._export")
  return export.call_exported_p, export._call_exported_lowering


call_exported_p, call_exported_lowering = (
    optional(EXPORTED_CALLS, _load) or (None, None))


def export_allowed_custom_calls() -> frozenset | None:
  """The custom-call targets the running ``jax.export.export(...)(...)``
  call allows (its ``disabled_checks``), read from its frame (``do_export``
  in ``jax._src.export._export``, whose ``disabled_checks`` is a closure
  variable: JAX 0.8-0.12); None when no such frame is found (another
  caller, another JAX). ``"ALL"`` stands for every target (from JAX
  0.10; before, it is no target's name)."""
  import sys
  frame = sys._getframe(1)
  while frame is not None:
    if (frame.f_code.co_name == "do_export" and frame.f_globals.get(
        "__name__") == "jax._src.export._export"):
      checks = frame.f_locals.get("disabled_checks")
      if checks is None:
        return None
      targets = {t for t in (c.is_custom_call() for c in checks)
                 if t is not None}
      if JAX_VERSION < (0, 10):   # (JAX 0.8, 0.9 take "ALL" as a name)
        targets.discard("ALL")
      return frozenset(targets)
    frame = frame.f_back
  return None


def export_module_bytes(module) -> bytes:
  """The bytes ``jax.export`` stores for an MLIR ``module``
  (``Exported.mlir_module_serialized``: a portable StableHLO artifact where
  the line writes one, JAX 0.8-0.12). Used by the tests that forge a
  module from elsewhere (``tests/primitives/test_host_keys.py``): plain MLIR
  bytecode is refused by JAX 0.8's deserializer."""
  export = importlib.import_module("jax._src.export._export")
  return export._module_to_bytecode(module)

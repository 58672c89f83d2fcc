"""``jax.export``: the call of an exported function.

Part in the token calling convention: none of its own; ``_pass.exported_rule``
threads an exported function's call on DEFAULT's chain with these.
"""
from __future__ import annotations

import importlib

from jax_effects._compat.versions import JAX_VERSION, optional

#: The feature that needs these internals (``versions.MISSING``).
EXPORTED_CALLS = "calling a jax.export function with effects"


def _load():
  # ``Exported.call`` binds ``call_exported_p``: no public handle on it or
  # its lowering (which the pass reuses). JAX 0.8-0.12.
  export = importlib.import_module("jax._src.export._export")
  return export.call_exported_p, export._call_exported_lowering


call_exported_p, call_exported_lowering = (
    optional(EXPORTED_CALLS, _load) or (None, None))


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
      targets = {t for t in (c.is_custom_call() for c in checks)
                 if t is not None}
      if JAX_VERSION < (0, 10):   # (JAX 0.8, 0.9 take "ALL" as a name)
        targets.discard("ALL")
      return frozenset(targets)
    frame = frame.f_back
  return None


def export_module_bytes(module) -> bytes:
  """The bytes ``jax.export`` stores for an MLIR ``module`` (JAX 0.8-0.12;
  for tests forging a module: JAX 0.8 refuses plain MLIR bytecode)."""
  export = importlib.import_module("jax._src.export._export")
  return export._module_to_bytecode(module)

"""``jax.export``: the call of an exported function.

Part in the token calling convention: an exported jax_effects function's
call is threaded on the chain of DEFAULT (``_pass.exported_rule``), its
compiler token the exported module's (``jax_effects._compat``).
"""
from __future__ import annotations

import importlib

from jax_effects._compat.versions import optional

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

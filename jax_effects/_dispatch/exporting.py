"""``jax.export`` of a ``jax_effects.jit`` function with effects.

``jax.export.export(jax_effects.jit(f))(*specs)`` traces ``f`` as a call
does and lowers, for export, not the threaded ``g`` but its exported form
(its part of the token calling convention: ``design/tokens.md``, "An
exported function"; ``_primitives.exported``)::

    h(*args) -> outputs:
      c = exported_entry()                 # JAX's ordered EXPORTED_ORDER
      outputs, token = g(c, ..., c, *args)
      exported_exit(token)                 # JAX's ordered EXPORTED_ORDER

with the user's ``jax.jit`` options. Refused here, naming the reason, before
lowering: where the host target is unavailable, for platforms other than
CPU, and unless ``jax.export`` is told the target (:data:`TARGET`) is
allowed (``design/host_target.md``: what an exported module promises).
"""
from __future__ import annotations

import functools

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._primitives import exported as _exported
from jax_effects._primitives import host_target as _host_target

#: The custom-call target an exported module's effects call.
TARGET = _host_target.TARGET


def lower(traced, lowering_platforms, private_parameters):
  """JAX's ``Lowered`` of ``h`` (the module docstring) for ``traced`` (a
  ``stages.Traced`` of the threaded computation, lowered for export)."""
  why = _host_target.unavailable()
  if why is not None:
    raise ValueError(
        f"jax.export cannot export the jax_effects.jit function "
        f"{traced.fun_name!r} with effects in this process: {why}")
  platforms = tuple(lowering_platforms or ())
  if platforms != ("cpu",):
    raise ValueError(
        f"jax.export cannot export the jax_effects.jit function "
        f"{traced.fun_name!r} with effects for platforms {platforms}: "
        f"jax_effects' host target, which exported effects call, exists "
        f"for CPU only. Export for platforms=['cpu'], or export the "
        f"function without its effects")
  allowed = _compat.export_allowed_custom_calls()
  if allowed is not None and TARGET not in allowed and "ALL" not in allowed:
    raise ValueError(
        f"jax.export of the jax_effects.jit function {traced.fun_name!r} "
        f"with effects needs its host target ({TARGET!r}) allowed: "
        f"jax.export.export(f, disabled_checks=[jax.export."
        f"DisabledSafetyCheck.custom_call(jax_effects.HOST_TARGET)])")
  core = traced._function._core
  keys, jitted = core.keys_and_jit(traced._mode, traced._args)

  @functools.wraps(traced._function._fun)
  def exported(*a, **kw):
    carrier = _exported.entry()
    out, token = jitted(*([carrier] * len(keys)), *a, **kw)
    _exported.exit(token)
    return out

  inner = _jax_api.jit(exported, **core.jit_kwargs).trace(*traced._args, **traced._kwargs)
  traced._export_traced = inner
  return inner.lower(lowering_platforms=lowering_platforms,
                     _private_parameters=private_parameters)


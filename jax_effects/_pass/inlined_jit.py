"""What a ``jit`` keeps when jax_effects inlines it: its sharding constraints.

The token-threading pass evaluates a nested ``jit`` holding effects inline,
in the caller's trace (a ``jit`` equation, ``_pass.control_flow_rules``'
inline rule; a ``jax_effects.jit`` function called inside another binds
one, as ``jax.jit``'s call does). JAX's nested
``jit`` lays its arguments out as its ``in_shardings`` say and its results as
its ``out_shardings`` say (sharding annotations on the callee's parameters
and results); inlined, the same constraints are applied with
``jax.lax.with_sharding_constraint``, so values are laid out as under
``jax.jit`` (a result of an inner ``jit(f, out_shardings=s)`` stays sharded
by ``s``). Memory layouts, donation and compiler options of the inner jit
do not apply inside an enclosing computation under ``jax.jit`` either.

Part in the token calling convention: none (it constrains array values, not
tokens).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import PartitionSpec, Sharding


def _constrain(value, sharding):
  if isinstance(sharding, (Sharding, PartitionSpec)):
    return jax.lax.with_sharding_constraint(value, sharding)
  return value   # None / unspecified: left as it comes


def constrain_flat(values: Sequence[Any], shardings: Sequence[Any]) -> list:
  """``values`` (a jit equation's operands or results) constrained to
  ``shardings`` (its ``in_shardings``/``out_shardings`` param: a
  ``Sharding`` or JAX's unspecified marker per value)."""
  return [_constrain(v, s) for v, s in zip(values, shardings)]

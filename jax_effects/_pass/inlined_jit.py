"""What a ``jit`` keeps when jax_effects inlines it: its sharding constraints.

Two places evaluate a nested ``jit`` holding effects inline, in the caller's
trace: the token-threading pass (a ``jit`` equation,
``_pass.control_flow_rules``' inline rule) and a ``jax_effects.jit``
function with effects called under an enclosing trace, which runs its
function directly (``_dispatch.function``). JAX's nested
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


def constrain_tree(tree, shardings):
  """``tree`` constrained to ``shardings``, a pytree prefix of it (as
  ``jax.jit``'s ``out_shardings`` or one argument's ``in_shardings``;
  ``None`` leaves a subtree as it comes)."""
  if shardings is None:
    return tree
  return jax.tree_util.tree_map(
      lambda s, sub: _constrain_all(sub, s), shardings, tree,
      is_leaf=lambda s: s is None or isinstance(s, (Sharding, PartitionSpec)))


def _constrain_all(subtree, sharding):
  if not isinstance(sharding, (Sharding, PartitionSpec)):
    return subtree
  return jax.tree_util.tree_map(lambda v: _constrain(v, sharding), subtree)


def constrain_arguments(args: tuple, in_shardings, static_argnums: tuple
                        ) -> tuple:
  """``args`` of a call with ``jax.jit``'s ``in_shardings`` (one sharding for
  every dynamic positional argument, or one prefix per dynamic argument;
  static arguments are skipped) applied."""
  if in_shardings is None:
    return args
  n = len(args)
  static = {i % n for i in static_argnums if -n <= i < n}
  dynamic = [i for i in range(n) if i not in static]
  if isinstance(in_shardings, (tuple, list)):
    per_arg = list(in_shardings)
  else:
    per_arg = [in_shardings] * len(dynamic)
  out = list(args)
  for i, s in zip(dynamic, per_arg):
    out[i] = constrain_tree(args[i], s)
  return tuple(out)

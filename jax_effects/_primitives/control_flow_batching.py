"""vmap of ``cond``/``while`` whose predicate is batched, with our effects inside.

JAX's vmap rules of these primitives are wrapped and run unchanged unless
the predicate is batched and a branch (or the loop) holds a
``jax_effects`` effect (``design/transformations.md``, "vmap of control
flow"): a ``cond`` branch's effects get ``index == i`` as a mask operand
(:func:`_cond_batcher`), and a ``while``'s effects are batched per element
(:func:`_while_batcher`).

Part of the token calling convention: none; the effects they produce are
ordinary ``effect_p`` equations, which the pass threads like any other.
"""
from __future__ import annotations

import jax
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_prims
from jax.interpreters import batching
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._core import effects as _effects
from jax_effects._core import jaxpr_eval as _jaxpr_eval
from jax_effects._primitives import effect as _effect
from jax_effects._primitives import host_callback as _host_callback

effect_p = _effect.effect_p


def _has_marker(jaxprs) -> bool:
  """Whether any of ``jaxprs`` (or equations) carries an effect of ours."""
  return any(_effects.has_own_marker(j.effects) for j in jaxprs)


_jax_while_batcher = batching.fancy_primitive_batchers[jex_prims.while_p]


def _while_batcher(axis_data, args, dims, **params):
  """JAX's vmap rule; effects made per element if the predicate is batched."""
  cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
  cond_nconsts, body_nconsts = params["cond_nconsts"], params["body_nconsts"]
  if (_effect.control_dependence.depth or all(d is None for d in dims)
      or not _has_marker([cond_jaxpr, body_jaxpr])):
    return _jax_while_batcher(axis_data, args, dims, **params)
  batched = [d is not None for d in dims]
  cconst = batched[:cond_nconsts]
  bconst = batched[cond_nconsts:cond_nconsts + body_nconsts]
  carry = batched[cond_nconsts + body_nconsts:]
  # (instantiate=False, unlike JAX's rule: JAX caches batched jaxprs by their
  # in/out axes, and a probe traced outside ``_control_dependent`` must never
  # be the entry JAX's final batching of the body (all outputs at axis 0)
  # finds. OR-ing with ``carry`` gives the same fixpoint.)
  for _ in range(1 + len(carry)):
    _, out = _compat.batch_jaxpr(body_jaxpr, axis_data, bconst + carry, False)
    new = [a or b for a, b in zip(carry, out)]
    if new == carry:
      break
    carry = new
  _, (pred,) = _compat.batch_jaxpr(cond_jaxpr, axis_data, cconst + carry, False)
  if not pred:
    return _jax_while_batcher(axis_data, args, dims, **params)
  with _effect.control_dependent():
    return _jax_while_batcher(axis_data, args, dims, **params)


batching.fancy_primitive_batchers[jex_prims.while_p] = _while_batcher


def _eval_masked(jaxpr, consts, mask, args):
  """Evaluates ``jaxpr`` with ``mask`` (this element took the branch) as
  the first operand of every effect in it, at any depth."""
  def handle(eqn, invals):
    if eqn.primitive is effect_p:
      hc = eqn.params["host_callback"]
      masked = _host_callback.in_branch(hc, _host_callback.wrapped_spec(hc.spec, "masked"))
      return effect_p.bind(mask, *invals, **{**eqn.params, "host_callback": masked})
    if _effect.holds_effect(eqn):
      return _masked_higher_order(eqn, mask, invals)
    return _jaxpr_eval.rebind(eqn, invals)
  return _jaxpr_eval.eval_jaxpr(jaxpr, consts, args, handle)


def _closed_fn(closed, mask, leading=()):
  """``closed`` as a function evaluated by :func:`_eval_masked`."""
  jaxpr, consts = _jaxpr_eval.split(closed)
  return lambda *args: _eval_masked(jaxpr, consts, mask, [*leading, *args])


def _masked_cond(p, mask, invals):
  index, *ops = invals
  return jax.lax.switch(index, [_closed_fn(b, mask) for b in p["branches"]], *ops)


def _masked_while(p, mask, invals):
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cond = _closed_fn(p["cond_jaxpr"], mask, invals[:cn])
  body = _closed_fn(p["body_jaxpr"], mask, invals[cn:cn + bn])
  return jax.lax.while_loop(lambda c: cond(*c)[0], lambda c: body(*c),
                            list(invals[cn + bn:]))


def _masked_scan(p, mask, invals):
  nc, ncarry = _compat.scan_counts(p)
  body = _closed_fn(p["jaxpr"], mask, invals[:nc])

  def step(carry, xs):
    outs = body(*carry, *xs)
    return outs[:ncarry], outs[ncarry:]
  carry, ys = jax.lax.scan(step, list(invals[nc:nc + ncarry]),
                           list(invals[nc + ncarry:]), length=p["length"],
                           reverse=p["reverse"], unroll=p["unroll"])
  return [*carry, *ys]


#: Primitive -> ``rule(params, mask, invals) -> outputs``: the primitive
#: re-expressed with ``lax`` around masked sub-computations.
MASK_RULES = {jex_prims.cond_p: _masked_cond, jex_prims.while_p: _masked_while,
              jex_prims.scan_p: _masked_scan}


def _masked_higher_order(eqn, mask, invals):
  rule = MASK_RULES.get(eqn.primitive)
  if rule is not None:
    return rule(eqn.params, mask, invals)
  if eqn.primitive in _jaxpr_eval.CALLEES:
    callee = eqn.params[_jaxpr_eval.CALLEES[eqn.primitive]]
    return _closed_fn(callee, mask)(*invals)
  name = eqn.primitive.name
  raise NotImplementedError(
      f"{_effect.first_effect(eqn)} is inside JAX's higher-order primitive "
      f"'{name}' inside a branch of jax.lax.cond/switch whose predicate "
      f"jax.vmap batched; jax_effects cannot run it only for the elements "
      f"that took the branch. Use jax.lax.map instead of jax.vmap, keep the "
      f"predicate unbatched, or move the effect out of the '{name}'.")


_jax_cond_batcher = batching.fancy_primitive_batchers[jex_prims.cond_p]


def _cond_batcher(axis_data, args, dims, *, branches, **params):
  """JAX's vmap rule, or each branch's effects masked by ``index == i``."""
  if (dims[0] is None or "branches_platforms" in params
      or not _has_marker(branches)
      or any(_compat.refused_by_jax_in_batched_cond(e)
             for b in branches for e in b.effects)):
    return _jax_cond_batcher(axis_data, args, dims, branches=branches, **params)
  size = axis_data.size
  mesh_axis = getattr(axis_data, "explicit_mesh_axis", None)
  index, *ops = (batching.bdim_at_front(x, d, size, mesh_axis=mesh_axis)
                 for x, d in zip(args, dims))
  n_outs = len(branches[0].out_avals)
  branch_outs = []
  for i, branch in enumerate(branches):
    traced = _jax_api.make_jaxpr(
        lambda m, *xs, b=branch: _eval_masked(b.jaxpr, b.consts, m, xs))(
            jax.ShapeDtypeStruct((), np.bool_),
            *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in branch.in_avals))
    batched, _ = _compat.batch_jaxpr(traced, axis_data,
                                     [True] * (1 + len(ops)), [True] * n_outs)
    taken = jax.lax.eq(index, jax.lax.full_like(index, i))
    ops_ = [_bcast_select_n(taken, jax.lax.stop_gradient(x), x) for x in ops]
    branch_outs.append(jex_core.jaxpr_as_fun(batched)(taken, *ops_))
  outs = [_bcast_select_n(index, *o) for o in zip(*branch_outs)]
  return outs, [0] * len(outs)


def _bcast_select_n(which, *cases):
  if jnp.ndim(which) != jnp.ndim(cases[0]):
    which = jax.lax.broadcast_in_dim(which, jnp.shape(cases[0]),
                                     tuple(range(jnp.ndim(which))))
  return jax.lax.select_n(which, *cases)


batching.fancy_primitive_batchers[jex_prims.cond_p] = _cond_batcher

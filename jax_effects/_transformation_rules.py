"""JAX transformation rules of ``effect_p``: vmap, jvp (and so grad), liveness.

These rules act when a user's function is *traced* (before the
token-threading pass), so they apply inside ``jax_effects.jit``, under plain
``jax.jit`` and eagerly alike. See ``design/transformations.md``.

* **vmap**: with no batched operand the effect runs once, unbatched (as
  ``jax.debug.print``; so ``jacfwd``/``hessian``, vmaps over tangents, run an
  effect on primal values once). With a batched operand (or inside a
  ``while_loop`` whose predicate vmap batched, see :func:`_while_batcher`) the
  equation is re-bound with a :class:`BatchedHost` callback that runs the
  user's host function once per batch element, in batch (row-major) order,
  and stacks the results. Nested vmaps flatten into one ``BatchedHost`` with a
  multi-dimensional ``batch_shape`` (outermost vmap first); an operand that is
  not batched at some level is not broadcast, just reused for every element.
* **jvp**: the effect runs once, on the primal values; tangents of its
  results are symbolic zeros (host results are not differentiable). There is
  no linear part, so linearize/vjp/grad never stage an effect into the
  tangent or cotangent computation, and rematerialization (``jax.checkpoint``)
  never re-runs it: the equation carries a marker JAX keeps in the primal
  ("known") computation (``partial_eval_kept_effects``).
* **transpose**: an effect on tangents (a ``custom_jvp`` rule printing its
  tangent, ``linear_transpose``) is dropped by reverse mode, as
  ``jax.debug.print`` is; one whose results are used there is an error.
* **liveness** (used by the pass, ``_thread_tokens``): under
  ``vmap``-of-``while_loop`` with a batched predicate, JAX runs the batched
  body while *any* element is live and discards the finished elements'
  results. :func:`masked` turns a batched effect into one that skips the
  elements whose predicate mask is False, so effects run only for the live
  iterations of each element.
* **vmap of cond/switch with a batched predicate**: JAX's rule converts it
  to a ``select`` that evaluates every branch. :func:`_cond_batcher` calls
  JAX's rule unchanged unless a branch holds an effect of ours; then each
  branch's effects get ``index == i`` as an extra batched operand
  (:class:`MaskedHost`), so they run only for the elements that took the
  branch. An effect that still reappears outside any branch (recorded at bind
  time, :func:`traced_in_branch`) is reported by the pass and the eager impl
  instead of running for elements that did not take its branch.
* **vmap of while_loop with a batched predicate** (:func:`_while_batcher`):
  JAX's rule, unchanged; effects in the loop are batched per element so the
  pass can mask them (:func:`masked`).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_prims

from jax_effects import _compat
from jax_effects import _effects
from jax_effects import _primitives

effect_p = _primitives.effect_p


# --- vmap ----------------------------------------------------------------------

class BatchedHost:
  """Host function of a vmapped effect: the element callback per element.

  ``levels[i][j]`` says whether operand ``i`` has the batch axis of vmap level
  ``j`` (levels outermost first); its leading axes are the levels it has, in
  order. ``live`` (optional, a bool array of ``batch_shape``) skips elements:
  their results are zeros (JAX discards them).
  """
  __slots__ = ("element", "batch_shape", "levels", "element_avals")

  def __init__(self, element: _primitives.HostCallback, batch_shape: tuple,
               levels: tuple, element_avals: tuple):
    self.element = element
    self.batch_shape = batch_shape
    self.levels = levels
    self.element_avals = element_avals

  def __call__(self, *args, live=None):
    shape = self.batch_shape
    outs = [np.zeros(shape + a.shape, a.dtype) for a in self.element_avals]
    for idx in np.ndindex(*shape):
      if live is not None and not live[idx]:
        continue
      el_args = []
      for x, lv in zip(args, self.levels):
        sub = tuple(i for i, has in zip(idx, lv) if has)
        el_args.append(np.asarray(x[sub]) if sub else x)
      results = self.element(*el_args)
      for out, r in zip(outs, results):
        out[idx] = r
    return tuple(outs)


def _effect_batcher(axis_data, args, dims, *, host_callback, effect, ordered,
                    result_avals):
  if all(d is None for d in dims) and not _batched_control.depth:
    # No operand depends on the batch index (e.g. the primal values under
    # jacfwd/hessian, whose tangents vmap batches): one run, as
    # jax.debug.print does; its results are the same for every element.
    outs = effect_p.bind(*args, host_callback=host_callback, effect=effect,
                         ordered=ordered, result_avals=result_avals)
    return outs, [None] * len(outs)
  size = axis_data.size
  fn = host_callback.fn
  if isinstance(fn, BatchedHost):
    element, shape, levels = fn.element, fn.batch_shape, fn.levels
    element_avals = fn.element_avals
  else:
    element, shape, levels = host_callback, (), tuple(() for _ in args)
    element_avals = tuple(result_avals)
  new_args, new_levels = [], []
  for x, d, lv in zip(args, dims, levels):
    if d is None:
      new_args.append(x)
      new_levels.append((False, *lv))
    else:
      new_args.append(jnp.moveaxis(x, d, 0))
      new_levels.append((True, *lv))
  new_shape = (size, *shape)
  new_avals = tuple(jax.core.ShapedArray(new_shape + a.shape, a.dtype)
                    for a in element_avals)
  batched = _primitives.HostCallback(
      BatchedHost(element, new_shape, tuple(new_levels), element_avals),
      element.description, new_avals)
  batched.traced_in_branch = host_callback.traced_in_branch
  batched.traced_in_while_cond = host_callback.traced_in_while_cond
  outs = effect_p.bind(*new_args, host_callback=batched, effect=effect,
                       ordered=ordered, result_avals=new_avals)
  return outs, [0] * len(outs)


batching.fancy_primitive_batchers[effect_p] = _effect_batcher


# --- vmap of control flow with a batched predicate -----------------------------

class _BatchedControl(threading.local):
  """Depth of the vmap rules of control flow whose predicate is batched.

  While JAX's rule of such a ``while_loop`` batches the body and ``cond_fun``,
  an effect there depends on the batch index through the predicate (it runs
  for an element only while that element iterates) even if none of its
  operands does: it is batched per element, so the pass can skip the
  finished elements (:func:`masked`).
  """
  depth = 0


_batched_control = _BatchedControl()


@contextlib.contextmanager
def _control_dependent():
  _batched_control.depth += 1
  try:
    yield
  finally:
    _batched_control.depth -= 1


def _has_marker(jaxprs) -> bool:
  """Whether any of ``jaxprs`` (or equations) carries an effect of ours."""
  return any(isinstance(e, _effects.TraceEffect)
             for j in jaxprs for e in j.effects)


_jax_while_batcher = batching.fancy_primitive_batchers[jex_prims.while_p]


def _while_batcher(axis_data, args, dims, *, cond_nconsts, cond_jaxpr,
                   body_nconsts, body_jaxpr, **params):
  """JAX's vmap rule of ``while``, unchanged; effects made per element
  when the predicate is batched (found as JAX's rule finds it)."""
  kw = dict(cond_nconsts=cond_nconsts, cond_jaxpr=cond_jaxpr,
            body_nconsts=body_nconsts, body_jaxpr=body_jaxpr, **params)
  if (_batched_control.depth or all(d is None for d in dims)
      or not _has_marker([cond_jaxpr, body_jaxpr])):
    return _jax_while_batcher(axis_data, args, dims, **kw)
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
    return _jax_while_batcher(axis_data, args, dims, **kw)
  with _control_dependent():
    return _jax_while_batcher(axis_data, args, dims, **kw)


batching.fancy_primitive_batchers[jex_prims.while_p] = _while_batcher


class MaskedHost:
  """Host function of an effect in a ``cond`` branch that vmap batched the
  predicate of: its first operand says whether this element took the branch.
  Elements that did not take it run nothing; their results are zeros (the
  ``select`` after the branches discards them)."""
  __slots__ = ("inner", "result_avals")

  def __init__(self, inner, result_avals: tuple):
    self.inner = inner
    self.result_avals = result_avals

  def __call__(self, taken, *args):
    if np.asarray(taken):
      return self.inner(*args)
    return tuple(np.zeros(a.shape, a.dtype) for a in self.result_avals)


def _masked_effect(eqn, mask, invals):
  hc = eqn.params["host_callback"]
  masked = _primitives.HostCallback(
      MaskedHost(hc.fn, tuple(hc.result_avals)), hc.description,
      hc.result_avals)
  masked.traced_in_while_cond = hc.traced_in_while_cond
  return effect_p.bind(mask, *invals, **{**eqn.params, "host_callback": masked})


def _eval_masked(jaxpr, consts, mask, args):
  """Evaluates ``jaxpr`` into the current trace with ``mask`` (a bool scalar:
  this element took the branch) as the first operand of every effect in it,
  at any depth. Control flow with effects inside is re-expressed with
  ``lax`` (closing over ``mask``); call-like primitives are inlined."""
  env = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    if eqn.primitive is effect_p:
      outs = _masked_effect(eqn, mask, invals)
    elif _has_marker([eqn]) or (eqn.primitive.name in _HIDES_EFFECTS
                                and _has_marker(_compat.jaxprs_in_params(eqn.params))):
      outs = _masked_higher_order(eqn, mask, invals)
    else:
      outs = eqn.primitive.bind(*invals,
                                **eqn.primitive.get_bind_params(eqn.params))
    if not eqn.primitive.multiple_results:
      outs = [outs]
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, jex_core.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _closed_fn(closed, mask, leading=()):
  """``closed`` as a function evaluated by :func:`_eval_masked`; ``leading``
  are its first arguments (consts of the enclosing trace)."""
  if isinstance(closed, jex_core.ClosedJaxpr):
    jaxpr, consts = closed.jaxpr, closed.consts
  else:
    jaxpr, consts = closed, ()
  return lambda *args: _eval_masked(jaxpr, consts, mask,
                                    [*leading, *args])


#: Call-like primitives (by name) -> the parameter holding the callee.
_INLINED = {"jit": "jaxpr", "remat2": "jaxpr", "closed_call": "call_jaxpr",
            "call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
            "custom_vjp_call": "call_jaxpr", "custom_vmap_call": "call",
            "composite": "jaxpr", "linear_call": "callee"}
_HIDES_EFFECTS = ("composite", "linear_call")


def _masked_higher_order(eqn, mask, invals):
  p, name = eqn.params, eqn.primitive.name
  if name == "cond":
    index, *ops = invals
    return jax.lax.switch(index, [_closed_fn(b, mask) for b in p["branches"]],
                          *ops)
  if name == "while":
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond = _closed_fn(p["cond_jaxpr"], mask, invals[:cn])
    body = _closed_fn(p["body_jaxpr"], mask, invals[cn:cn + bn])
    return jax.lax.while_loop(lambda c: cond(*c)[0], lambda c: body(*c),
                              list(invals[cn + bn:]))
  if name == "scan":
    nc, ncarry = p["num_consts"], p["num_carry"]
    body = _closed_fn(p["jaxpr"], mask, invals[:nc])

    def step(carry, xs):
      outs = body(*carry, *xs)
      return outs[:ncarry], outs[ncarry:]
    carry, ys = jax.lax.scan(step, list(invals[nc:nc + ncarry]),
                             list(invals[nc + ncarry:]), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]
  if name in _INLINED:
    return _closed_fn(p[_INLINED[name]], mask)(*invals)
  raise NotImplementedError(
      f"{_first_effect(eqn)} is inside JAX's higher-order primitive "
      f"'{name}' inside a branch of jax.lax.cond/switch whose predicate "
      f"jax.vmap batched; jax_effects cannot run it only for the elements "
      f"that took the branch. Use jax.lax.map instead of jax.vmap, keep the "
      f"predicate unbatched, or move the effect out of the '{name}'.")


def _first_effect(eqn) -> str:
  for sub in _compat.jaxprs_in_params(eqn.params):
    for e in sub.eqns:
      if e.primitive is effect_p:
        return e.params["host_callback"].description
      found = _first_effect(e)
      if found != "a jax_effects side effect":
        return found
  return "a jax_effects side effect"


_jax_cond_batcher = batching.fancy_primitive_batchers[jex_prims.cond_p]


def _jax_refuses(effect) -> bool:
  """Effects JAX's rule refuses in a vmapped cond (io_callback, Refs): the
  cond is left to JAX's rule and its error."""
  return any(c.__name__ in ("IOEffect", "OrderedIOEffect", "RefEffect")
             for c in type(effect).__mro__)


def _cond_batcher(axis_data, args, dims, *, branches, **params):
  """JAX's vmap rule of ``cond``, unchanged, unless the predicate is batched
  and a branch holds an effect of ours.

  JAX's rule then evaluates every branch for every element and selects. Here
  too, but each branch's effects get ``index == i`` as an extra (batched)
  operand (:class:`MaskedHost`), so an element runs only the effects of the
  branch it took, in batch order, branch after branch.
  """
  if (dims[0] is None or "branches_platforms" in params
      or not _has_marker(branches)
      or any(_jax_refuses(e) for b in branches for e in b.effects)):
    return _jax_cond_batcher(axis_data, args, dims, branches=branches, **params)
  size = axis_data.size
  mesh_axis = getattr(axis_data, "explicit_mesh_axis", None)
  index, *ops = (batching.bdim_at_front(x, d, size, mesh_axis=mesh_axis)
                 for x, d in zip(args, dims))
  n_outs = len(branches[0].out_avals)
  branch_outs = []
  for i, branch in enumerate(branches):
    traced = jax.make_jaxpr(
        lambda m, *xs, b=branch: _eval_masked(b.jaxpr, b.consts, m, xs))(
            jax.ShapeDtypeStruct((), np.bool_),
            *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in branch.in_avals))
    batched, _ = _compat.batch_jaxpr(traced, axis_data,
                                     [True] * (1 + len(ops)), [True] * n_outs)
    taken = jax.lax.eq(index, jax.lax.full_like(index, i))
    ops_ = [_bcast_select(taken, x, jax.lax.stop_gradient(x)) for x in ops]
    branch_outs.append(jex_core.jaxpr_as_fun(batched)(taken, *ops_))
  outs = [_bcast_select_n(index, *o) for o in zip(*branch_outs)]
  return outs, [0] * len(outs)


def _bcast_select(pred, on_true, on_false):
  if jnp.ndim(pred) != jnp.ndim(on_true):
    pred = jax.lax.broadcast_in_dim(pred, jnp.shape(on_true),
                                    tuple(range(jnp.ndim(pred))))
  return jax.lax.select(pred, on_true, on_false)


def _bcast_select_n(which, *cases):
  if jnp.ndim(which) != jnp.ndim(cases[0]):
    which = jax.lax.broadcast_in_dim(which, jnp.shape(cases[0]),
                                     tuple(range(jnp.ndim(which))))
  return jax.lax.select_n(which, *cases)


batching.fancy_primitive_batchers[jex_prims.cond_p] = _cond_batcher


# --- jvp -------------------------------------------------------------------------

def _effect_jvp(primals, tangents, **params):
  del tangents  # the host function sees primal values only
  outs = effect_p.bind(*primals, **params)
  return outs, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]


ad.primitive_jvps[effect_p] = _effect_jvp


def _effect_transpose(cts, *args, host_callback, effect, ordered,
                      result_avals):
  """An effect whose operands are linear values (tangents), transposed.

  Only code that passes tangents to an effect explicitly puts one in the
  linear part of a derivative: a ``custom_jvp`` rule printing its tangent, or
  a function given to ``linear_transpose``. The reverse pass computes
  cotangents, never those tangents, so, as ``jax.debug.print`` does there,
  the effect is dropped (forward mode, ``jvp``/``linearize``, runs it with
  the tangents). A callback whose results the linear computation uses has no
  transpose: that is an error naming it.
  """
  del effect, ordered, result_avals
  if any(type(ct) is not ad.Zero for ct in cts):
    raise NotImplementedError(
        f"{host_callback.description} takes tangents (it is in the linear "
        f"part of a derivative, e.g. in a jax.custom_jvp rule) and its "
        f"results are used there, so reverse-mode differentiation (grad, "
        f"vjp, linear_transpose) would have to transpose the host function. "
        f"Compute the callback from primal values, or give the function a "
        f"jax.custom_vjp rule.")
  return [None] * len(args)


ad.primitive_transposes[effect_p] = _effect_transpose


# --- liveness under vmap-of-while ------------------------------------------------

def _alignments(mask_shape: tuple, batch_shape: tuple) -> list[tuple]:
  """Increasing positions p with batch_shape[p[i]] == mask_shape[i]."""
  return [p for p in itertools.combinations(range(len(batch_shape)),
                                            len(mask_shape))
          if all(batch_shape[j] == n for j, n in zip(p, mask_shape))]


def masked(host_callback: _primitives.HostCallback, masks: Sequence):
  """``(host_callback', extra_operands)``: skip elements where a mask is False.

  ``masks`` are bool arrays (traced values), each the batched predicate of an
  enclosing vmapped ``while_loop``: its axes are some of the effect's vmap
  levels, in order (outermost first).
  """
  fn = host_callback.fn
  what = host_callback.description
  k = len(masks)
  if not isinstance(fn, BatchedHost):   # see _while_batcher
    raise AssertionError(
        f"{what}: inside a vmapped while_loop but not batched")
  shape = fn.batch_shape
  reshapes = []
  for m in masks:
    mshape = tuple(jnp.shape(m))
    found = _alignments(mshape, shape)
    if len(found) != 1:
      raise NotImplementedError(
          f"{what} is inside a jax.lax.while_loop whose predicate jax.vmap "
          f"batched over axes of sizes {mshape}, but the effect is batched "
          f"over vmap axes of sizes {shape}, so which element is still "
          f"iterating is ambiguous. Give the vmapped axes different sizes, or "
          f"move the effect out of the loop.")
    (pos,) = found
    reshapes.append(tuple(shape[j] if j in pos else 1 for j in range(len(shape))))

  def run(*args):
    live = np.ones(shape, dtype=bool)
    for m, rs in zip(args[:k], reshapes):
      live &= np.reshape(np.asarray(m, dtype=bool), rs)
    return fn(*args[k:], live=live)

  out = _primitives.HostCallback(run, what, host_callback.result_avals)
  return out, [jnp.asarray(m, dtype=bool) for m in masks]


# --- vmap of cond with a batched predicate ---------------------------------------

def traced_in_branch() -> bool:
  """True when an effect bound now is traced directly in a cond/switch branch."""
  return _compat.enclosing_staging() in ("cond", "switch")


def branch_vmapped_error(host_callback) -> NotImplementedError:
  return NotImplementedError(
      f"{host_callback.description} is inside a branch of jax.lax.cond/switch "
      f"whose predicate jax.vmap batched: JAX then evaluates every branch for "
      f"every element (a select), so this effect would also run for the "
      f"elements that did not take its branch. Use jax.lax.map instead of "
      f"jax.vmap for this function, keep the predicate unbatched, or move the "
      f"effect out of the branch (e.g. a while_loop runs effects only for the "
      f"live iterations of each element).")

"""The token-threading pass: a jaxpr interpreter with a rule per primitive.

Input: the closed jaxpr of a user function, traced with ``effect_p``
equations (each marked with a ``TraceEffect``). Output: the same computation,
re-traced into the current trace, in which every ``effect_p`` became a
``threaded_effect_p`` linked to its chain, and nothing carries a JAX effect.

State of the interpreter (:class:`Chains`): for each chain key (an ``Effect``
in per-effect mode, ``GLOBAL`` in global mode, ``UNORDERED`` for unordered
effects) the current *compiler token* and the current *carrier*.

* In straight-line code, each side effect consumes the chain's token and
  carrier and produces new ones (``token' , carrier' = effect(token, carrier)``)
  so the lowered StableHLO shows ``!stablehlo.token`` values chained through
  the callbacks. A chain's first compiler token is created inside the
  computation (``stablehlo.create_token``), independent of the runtime token.
* JAX's ``cond``/``scan`` abstract evaluation and ``while`` lowering do not
  accept token values, so at a higher-order primitive only the *carriers* of
  the chains used inside cross the boundary (as extra operands and results);
  inside, a fresh compiler token starts the chain again. Each carrier is an
  output of the previous host callback, so order holds across the boundary.
* At the top level, the carriers of ordered chains start as the runtime-token
  arguments; at the end all carriers are combined into the one token array the
  executable returns (new runtime token and output token).

Higher-order primitives are handled by :data:`RULES` (primitive -> rule).
A rule gets the equation, its input values and the chains, and returns the
equation's outputs. A higher-order primitive with a marked effect inside and
no rule is an error naming the primitive. Equations with no marker are bound
unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.extend import source_info_util
from jax.extend.core import primitives as jex_prims

from jax_effects import _effects
from jax_effects import _primitives
from jax_effects import _runtime_tokens
from jax_effects import _transformation_rules


class Chains:
  """Current compiler token and carrier of each chain, during the pass."""
  __slots__ = ("tokens", "carriers")

  def __init__(self, carriers: dict):
    self.tokens: dict = {}
    self.carriers: dict = dict(carriers)

  def carrier(self, key):
    c = self.carriers.get(key)
    if c is None:  # an unordered chain starting here
      c = self.carriers[key] = jnp.zeros((), _runtime_tokens.TOKEN_DTYPE)
    return c

  def take(self, keys) -> tuple:
    return tuple(self.carrier(k) for k in keys)

  def put(self, keys, carriers) -> None:
    for k, c in zip(keys, carriers):
      self.carriers[k] = c


class _Context(threading.local):
  """Where the pass is, for the effects it meets (dynamically scoped).

  ``kind``: "top", "branch" (directly in a cond branch) or "loop".
  ``masks``: batched predicates of the enclosing vmapped ``while_loop`` s, in
  whose bodies an element's effects run only while it is live.
  """

  def __init__(self):
    self.kind = "top"
    self.masks: tuple = ()


_context = _Context()


@contextlib.contextmanager
def _in_region(kind: str | None = None, mask=None):
  saved = _context.kind, _context.masks
  if kind is not None:
    _context.kind = kind
  if mask is not None:
    _context.masks = (*_context.masks, mask)
  try:
    yield
  finally:
    _context.kind, _context.masks = saved


def chain_keys(effects, mode: str) -> tuple:
  """Chain keys of the markers in a set of JAX effects, in a stable order."""
  keys = {_effects.chain_key(e, mode) for e in effects
          if isinstance(e, _effects.TraceEffect)}
  return tuple(sorted(keys, key=_sort_key))


def _sort_key(key):
  return (1, "") if key is _effects.UNORDERED else (0, key.name)


def has_marker(effects) -> bool:
  return any(isinstance(e, _effects.TraceEffect) for e in effects)


# --- the interpreter -----------------------------------------------------------

def thread_jaxpr(jaxpr: jex_core.Jaxpr, consts: Sequence[Any],
                 args: Sequence[Any], chains: Chains, mode: str) -> list:
  """Evaluates ``jaxpr`` in the current trace, threading ``chains``."""
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=eqn.source_info.name_stack), \
        eqn.ctx.manager:
      if eqn.primitive is _primitives.effect_p:
        outs = _thread_effect(eqn, invals, chains, mode)
      elif has_marker(eqn.effects):
        rule = RULES.get(eqn.primitive)
        if rule is None:
          raise NotImplementedError(
              f"jax_effects cannot thread side effects through the "
              f"higher-order primitive '{eqn.primitive.name}': it has no rule "
              f"in jax_effects._thread_tokens.RULES. Move the effect out of "
              f"it, or add a rule.")
        outs = rule(eqn, invals, chains, mode)
      else:
        outs = eqn.primitive.bind(*invals,
                                  **eqn.primitive.get_bind_params(eqn.params))
    if not eqn.primitive.multiple_results:
      outs = [outs]
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, jex_core.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _thread_effect(eqn, invals, chains: Chains, mode: str):
  (marker,) = [e for e in eqn.effects if isinstance(e, _effects.TraceEffect)]
  key = _effects.chain_key(marker, mode)
  host_callback = eqn.params["host_callback"]
  if host_callback.traced_in_branch and _context.kind != "branch":
    raise _transformation_rules.branch_vmapped_error(host_callback)
  if _context.masks:
    host_callback, masks = _transformation_rules.masked(host_callback,
                                                         _context.masks)
    invals = [*masks, *invals]
  token = chains.tokens.get(key)
  if token is None:
    token = lax.create_token()
  carrier = chains.carrier(key)
  token, carrier, *results = _primitives.threaded_effect_p.bind(
      token, carrier, *invals, host_callback=host_callback,
      result_avals=eqn.params["result_avals"])
  chains.tokens[key] = token
  chains.carriers[key] = carrier
  return results


def region(closed: jex_core.ClosedJaxpr | jex_core.Jaxpr, keys: tuple,
           mode: str, consts: Sequence[Any] = (),
           kind: str | None = None) -> Callable:
  """``fn(carriers, *args) -> (carriers, outs)`` running a sub-jaxpr threaded.

  ``consts`` are values of the enclosing trace prepended to the arguments
  (closed over, so JAX's control-flow APIs hoist them as their own consts).
  ``kind`` ("branch", "loop"; None: as the caller) is what the region is.
  """
  if isinstance(closed, jex_core.ClosedJaxpr):
    jaxpr, jaxpr_consts = closed.jaxpr, closed.consts
  else:
    jaxpr, jaxpr_consts = closed, ()

  def fn(carriers, *args):
    chains = Chains(dict(zip(keys, carriers)))
    with _in_region(kind):
      outs = thread_jaxpr(jaxpr, jaxpr_consts, [*consts, *args], chains, mode)
    return chains.take(keys), outs
  return fn


# --- rules for higher-order primitives -----------------------------------------

def _cond_rule(eqn, invals, chains: Chains, mode: str):
  keys = chain_keys(eqn.effects, mode)
  index, *ops = invals
  branches = [region(b, keys, mode, kind="branch")
              for b in eqn.params["branches"]]
  carriers, outs = lax.switch(index, branches, chains.take(keys), *ops)
  chains.put(keys, carriers)
  return outs


def _while_rule(eqn, invals, chains: Chains, mode: str):
  p = eqn.params
  cond_n, body_n = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts = invals[:cond_n], invals[cond_n:cond_n + body_n]
  init = invals[cond_n + body_n:]
  keys = chain_keys(eqn.effects, mode)
  cond_effectful = has_marker(p["cond_jaxpr"].effects)
  cond_fn = region(p["cond_jaxpr"], keys if cond_effectful else (), mode,
                   cond_consts, kind="loop")
  body_fn = region(p["body_jaxpr"], keys, mode, body_consts, kind="loop")

  if p["cond_jaxpr"].out_avals[0].shape:
    carriers, outs = _batched_while(cond_fn, body_fn, cond_effectful,
                                    chains.take(keys), init)
  elif not cond_effectful:
    def loop_cond(state):
      return cond_fn((), *state[1])[1][0]

    def loop_body(state):
      return body_fn(state[0], *state[1])

    carriers, outs = lax.while_loop(loop_cond, loop_body,
                                    (chains.take(keys), list(init)))
  else:
    # Effects in cond_fun: run the predicate once before the loop and again at
    # the end of every iteration, carrying it (as JAX does for its own
    # ordered effects), so every evaluation of cond_fun happens in order.
    carriers, (pred,) = cond_fn(chains.take(keys), *init)

    def loop_body(state):
      carriers, _, vals = state
      carriers, vals = body_fn(carriers, *vals)
      carriers, (pred,) = cond_fn(carriers, *vals)
      return carriers, pred, vals

    carriers, _, outs = lax.while_loop(lambda s: s[1], loop_body,
                                       (carriers, pred, list(init)))
  chains.put(keys, carriers)
  return outs


def _batched_while(cond_fn, body_fn, cond_effectful, carriers, init):
  """A while_loop that ``vmap`` gave a batched predicate (a bool array).

  As JAX's own lowering does, the body runs while any element is live and a
  finished element keeps its carry (a select); in addition, the effects of
  the body and of ``cond_fun`` get the live mask, so they run only for the
  elements still iterating (``_transformation_rules.masked``).
  """
  def cond(carriers, vals):
    c, (pred,) = cond_fn(carriers if cond_effectful else (), *vals)
    return (c if cond_effectful else carriers), pred

  carriers, pred = cond(carriers, init)

  def loop_body(state):
    carriers, live, vals = state
    with _in_region(mask=live):
      carriers, new = body_fn(carriers, *vals)
      vals = [lax.select(lax.broadcast_in_dim(live, jnp.shape(n),
                                              tuple(range(live.ndim))), n, v)
              for n, v in zip(new, vals)]
      carriers, pred = cond(carriers, vals)
    return carriers, jnp.logical_and(pred, live), vals

  carriers, _, outs = lax.while_loop(lambda s: jnp.any(s[1]), loop_body,
                                     (carriers, pred, list(init)))
  return carriers, outs


def _scan_rule(eqn, invals, chains: Chains, mode: str):
  p = eqn.params
  n_consts, n_carry = p["num_consts"], p["num_carry"]
  consts = invals[:n_consts]
  init = invals[n_consts:n_consts + n_carry]
  xs = invals[n_consts + n_carry:]
  keys = chain_keys(eqn.effects, mode)
  body_fn = region(p["jaxpr"], keys, mode, consts)

  def body(carry, x):
    carriers, c = carry
    carriers, outs = body_fn(carriers, *c, *x)
    return (carriers, outs[:n_carry]), outs[n_carry:]

  (carriers, carry), ys = lax.scan(
      body, (chains.take(keys), list(init)), list(xs), length=p["length"],
      reverse=p["reverse"], unroll=p["unroll"])
  chains.put(keys, carriers)
  return [*carry, *ys]


def _inline_rule(param: str, eqn, invals, chains: Chains, mode: str):
  """Call-like primitives (jit, checkpoint, custom_jvp/vjp, closed_call).

  Inlined: the callee is evaluated in the caller's trace with the caller's
  chains. Differentiation has already happened when the pass runs, so the
  custom rules and remat policy of these primitives have done their work.
  """
  callee = eqn.params[param]
  if isinstance(callee, jex_core.ClosedJaxpr):
    return thread_jaxpr(callee.jaxpr, callee.consts, invals, chains, mode)
  return thread_jaxpr(callee, (), invals, chains, mode)


#: Primitive -> rule(eqn, invals, chains, mode) -> outputs.
RULES: dict[jex_core.Primitive, Callable] = {
    jex_prims.cond_p: _cond_rule,
    jex_prims.while_p: _while_rule,
    jex_prims.scan_p: _scan_rule,
    jex_prims.jit_p: functools.partial(_inline_rule, "jaxpr"),
    jex_prims.remat_p: functools.partial(_inline_rule, "jaxpr"),
    jex_prims.closed_call_p: functools.partial(_inline_rule, "call_jaxpr"),
    jex_prims.call_p: functools.partial(_inline_rule, "call_jaxpr"),
    jex_prims.custom_jvp_call_p: functools.partial(_inline_rule, "call_jaxpr"),
    jex_prims.custom_vjp_call_p: functools.partial(_inline_rule, "call_jaxpr"),
}


# --- top level -----------------------------------------------------------------

def thread_tokens(closed: jex_core.ClosedJaxpr, args: Sequence[Any],
                  runtime_tokens: dict, mode: str):
  """Threads a whole program; returns ``(outs, token)``.

  ``runtime_tokens`` maps each ordered chain key to its runtime-token argument
  (the initial carrier). ``token`` combines every chain's final carrier (and
  every runtime-token argument): it is ready only once every side effect of
  this computation has run. It is None when there is nothing to combine.
  """
  chains = Chains(runtime_tokens)
  outs = thread_jaxpr(closed.jaxpr, closed.consts, args, chains, mode)
  finals = list(chains.carriers.values())
  # (A chain that went through shard_map ends as a per-device vector, see
  # _shard_map_rules: the token is then that vector, no collective needed.)
  token = functools.reduce(jnp.maximum, finals) if finals else None
  if token is not None:
    # A chain whose effect failed carries the FAILED bit (its later effects
    # were skipped); the next computation starts clean (the error itself is
    # reported by the dispatching thread, design/errors.md).
    token = jnp.bitwise_and(token, _runtime_tokens.SLOT_MASK)
  return outs, token

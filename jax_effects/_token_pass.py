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

Higher-order primitives are handled by rules, registered with
:func:`register_rule` under each rule's definition (here, and in
``_shard_map_rule``). A rule gets the equation, its input values, the chains
and the ordering mode, and returns the equation's outputs. A higher-order
primitive with a marked effect inside and no rule is an error naming the
effect, the primitive and why (:data:`REFUSED`, or a generic reason);
primitives that hide their sub-computations' effects from their equation are
looked into (:data:`HIDES_EFFECTS`). Equations with no marker are bound
unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Sequence

import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_prims

from jax_effects import _adopted
from jax_effects import _compat
from jax_effects import _effects
from jax_effects import _errors
from jax_effects import _host
from jax_effects import _jaxpr_eval
from jax_effects import _primitives
from jax_effects import _runtime_tokens

#: A rule: ``rule(eqn, invals, chains, mode) -> outputs`` (see the docstring).
Rule = Callable[..., Sequence[Any]]
#: Primitive -> rule; add to it only through :func:`register_rule`.
RULES: dict[jex_core.Primitive, Rule] = {}


def register_rule(primitive: jex_core.Primitive, rule: Rule) -> None:
  """Makes the pass thread chains through ``primitive`` with ``rule``.

  ``rule(eqn, invals, chains, mode)`` must bind the equation's computation
  into the current trace with every effect inside linked to its chain
  (``chains.take``/``chains.put`` the carriers of the chain keys it uses,
  :func:`chain_keys` of ``eqn.effects``; :func:`region` runs a sub-jaxpr
  threaded) and return the equation's outputs.
  """
  RULES[primitive] = rule


class Chains:
  """Current compiler token and carrier of each chain, during the pass.

  ``entries``: the chains whose carrier is still the runtime-token argument
  (top level only). Its value may carry the ``FAILED`` bit of an earlier
  execution (a failed effect leaves it in the returned token): the chain's
  first effect clears it, when that effect runs once, at the top level
  (``entry=True``, on the host, free unless the bit is set); any other first
  use takes the carrier with the bit masked off (one ``and``).
  """
  __slots__ = ("tokens", "carriers", "entries")

  def __init__(self, carriers: dict, entries=()):
    self.tokens: dict = {}
    self.carriers: dict = dict(carriers)
    self.entries: set = set(entries)

  def carrier(self, key):
    c = self.carriers.get(key)
    if c is None:  # an unordered chain starting here
      c = self.carriers[key] = jnp.zeros((), _runtime_tokens.TOKEN_DTYPE)
    elif key in self.entries:   # a runtime token: an earlier FAILED is stale
      self.entries.discard(key)
      c = self.carriers[key] = jnp.bitwise_and(c, _errors.SLOT_MASK)
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
    # The chain keys with per-device (shard_map) effects in the program being
    # threaded (None: not known, taken as every key); see _bind_threaded.
    self.per_device: set | None = None


_context = _Context()


def region_kind() -> str:
  """Where the pass is: "top", "branch" (directly in a cond branch), "loop"."""
  return _context.kind


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
  """Chain keys of the markers in a set of JAX effects, in a stable order.

  JAX's own callback effects the pass adopts (``_adopted``) count too.
  """
  keys = {_effects.chain_key(e, mode) for e in effects
          if isinstance(e, _effects.TraceEffect)}
  keys.update(_adopted.chain_key(e, mode) for e in effects
              if _adopted.is_adoptable_effect(e))
  return tuple(sorted(keys, key=_sort_key))


def _sort_key(key):
  return (1, "") if key is _effects.UNORDERED else (0, key.name)


def has_marker(effects) -> bool:
  """Whether the pass has work in an equation with these effects (a marker,
  or a JAX callback effect it adopts)."""
  return any(isinstance(e, _effects.TraceEffect)
             or _adopted.is_adoptable_effect(e) for e in effects)


def _has_own_marker(effects) -> bool:
  return any(isinstance(e, _effects.TraceEffect) for e in effects)


# --- the interpreter -----------------------------------------------------------

def thread_jaxpr(jaxpr: jex_core.Jaxpr, consts: Sequence[Any],
                 args: Sequence[Any], chains: Chains, mode: str) -> list:
  """Evaluates ``jaxpr`` in the current trace, threading ``chains``."""
  def handle(eqn, invals):
    if eqn.primitive is _primitives.effect_p:
      return _thread_effect(eqn, invals, chains, mode)
    if eqn.primitive in _adopted.PRIMITIVES:
      adopted = _adopted.adopt(eqn)
      if adopted is not None:   # JAX's own callback: threaded like ours
        host_callback, effect = adopted
        return _bind_threaded(_adopted.chain_key(effect, mode),
                              host_callback, invals, chains)
    if (has_marker(eqn.effects) and (eqn.primitive in RULES or
                                     _has_own_marker(eqn.effects))) or (
        eqn.primitive.name in HIDES_EFFECTS and _marker_inside(eqn)):
      rule = RULES.get(eqn.primitive)
      if rule is None:
        raise refusal(eqn)
      return rule(eqn, invals, chains, mode)
    return _jaxpr_eval.rebind(eqn, invals)
  return _jaxpr_eval.eval_jaxpr(jaxpr, consts, args, handle)


def _thread_effect(eqn, invals, chains: Chains, mode: str):
  (marker,) = [e for e in eqn.effects if isinstance(e, _effects.TraceEffect)]
  key = _effects.chain_key(marker, mode)
  host_callback = eqn.params["host_callback"]
  if host_callback.traced_in_branch and _context.kind != "branch":
    raise _primitives.branch_vmapped_error(host_callback)
  if _context.masks:
    host_callback, masks = _host.masked(host_callback, _context.masks)
    invals = [*masks, *invals]
  return _bind_threaded(key, host_callback, invals, chains)


def _bind_threaded(key, host_callback, invals, chains: Chains):
  """One ``threaded_effect_p`` on chain ``key``; returns its results."""
  token = chains.tokens.get(key)
  if token is None:
    token = lax.create_token()
  # The chain's first effect at the top level runs once per execution: it
  # clears a stale FAILED bit of its runtime token itself (see Chains).
  entry = key in chains.entries and _context.kind == "top"
  if entry:
    chains.entries.discard(key)
    carrier = chains.carriers[key]
  else:
    carrier = chains.carrier(key)
  shape = jnp.shape(carrier)
  if shape:
    # The per-device carriers of a shard_map (one per device) meet an effect
    # that runs once, on one device: it follows every device's effects. The
    # callback takes their max, a scalar, so XLA need not move the sharded
    # vector whole to the callback's device and back ("[SPMD] Involuntary
    # full rematerialization", a warning JAX's program does not get).
    carrier = jnp.max(carrier)
  token, carrier, *results = _primitives.threaded_effect_p.bind(
      token, carrier, *invals, host_callback=host_callback, entry=entry,
      ordered=key is not _effects.UNORDERED)
  if shape:
    # The chain stays per device (a loop's carry must keep its type; at the
    # top level the token stays one element per device, so the deterministic
    # view releases at its combination): every element is the effect's
    # carrier, from the device that ran it (the others' copies are stale, see
    # _primitives._on_first_device), so each device's later effects, in this
    # execution or the next, follow this one. Only here, where an effect that
    # runs once meets per-device ones, do the devices wait for a callback.
    # A chain with no per-device effect in the program keeps device 0's copy
    # in device 0's element (the others are stale, never read: its next once
    # effect takes the max of the elements), with no collective in which
    # every device would wait for this callback.
    if _context.per_device is None or key in _context.per_device:
      carrier = _primitives.from_first_device_p.bind(carrier)
    carrier = jnp.broadcast_to(carrier, shape)
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


register_rule(jex_prims.cond_p, _cond_rule)


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


register_rule(jex_prims.while_p, _while_rule)


def _batched_while(cond_fn, body_fn, cond_effectful, carriers, init):
  """A while_loop that ``vmap`` gave a batched predicate (a bool array).

  As JAX's own lowering does, the body runs while any element is live and a
  finished element keeps its carry (a select); in addition, the effects of
  the body and of ``cond_fun`` get the live mask, so they run only for the
  elements still iterating (``_host.masked``).
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
  body_fn = region(p["jaxpr"], keys, mode, consts, kind="loop")

  def body(carry, x):
    carriers, c = carry
    carriers, outs = body_fn(carriers, *c, *x)
    return (carriers, outs[:n_carry]), outs[n_carry:]

  (carriers, carry), ys = lax.scan(
      body, (chains.take(keys), list(init)), list(xs), length=p["length"],
      reverse=p["reverse"], unroll=p["unroll"])
  chains.put(keys, carriers)
  return [*carry, *ys]


register_rule(jex_prims.scan_p, _scan_rule)


def _inline_rule(param: str, eqn, invals, chains: Chains, mode: str):
  """Call-like primitives (``_jaxpr_eval.CALLEES``: jit, checkpoint,
  custom_jvp/vjp/vmap, closed_call, composite, linear_call).

  Inlined: the callee is evaluated in the caller's trace with the caller's
  chains. Differentiation has already happened when the pass runs, so the
  custom rules and remat policy of these primitives have done their work.
  """
  jaxpr, consts = _jaxpr_eval.split(eqn.params[param])
  return thread_jaxpr(jaxpr, consts, invals, chains, mode)


for _prim, _param in _jaxpr_eval.CALLEES.items():
  register_rule(_prim, functools.partial(_inline_rule, _param))


def _linear_solve_rule(eqn, invals, chains: Chains, mode: str):
  """``custom_linear_solve`` (e.g. ``jax.scipy.sparse.linalg.cg``): as its
  impl, the ``solve`` jaxpr on its consts and the right-hand side.

  The other jaxprs (``matvec``, ``vecmat``, ``transpose_solve``) are only for
  differentiation, which has already happened: their effects are in the
  equations JAX's jvp/transpose rules produced. So a print in the matvec of
  ``cg`` runs where ``cg``'s solver loop calls the matvec, in order.
  """
  p = eqn.params
  jaxprs, lengths = p["jaxprs"], p["const_lengths"]
  consts, start = {}, 0
  for name, n in zip(jaxprs._fields, lengths):
    consts[name] = invals[start:start + n]
    start += n
  solve = jaxprs.solve
  return thread_jaxpr(solve.jaxpr, solve.consts,
                      [*consts["solve"], *invals[start:]], chains, mode)


register_rule(jex_prims.linear_solve_p, _linear_solve_rule)



#: Names of higher-order primitives whose equation does not report the
#: effects of its sub-computations (their abstract evaluation drops them): the
#: pass looks inside. Without this, an effect in them would reach XLA unthreaded.
HIDES_EFFECTS = frozenset({
    "composite", "linear_call", "reduce", "reduce_window", "pallas_call"})

_REDUCTION = (
    "its sub-computation is the combiner of a reduction, which XLA calls as "
    "often and in whatever order it likes, so the effect has no place in "
    "program order")

#: Primitive name -> why an effect inside it cannot be threaded (shown to the
#: user). Keyed by name: ``pallas_call`` lives in a module jax_effects does
#: not import. Any other higher-order primitive without a rule gets a generic
#: reason (``refusal``).
REFUSED: dict[str, str] = {
    "reduce": _REDUCTION,
    "reduce_window": _REDUCTION,
    "pallas_call": "a Pallas kernel runs on the accelerator's cores and "
                   "cannot call host functions",
}


def _effects_inside(eqn) -> list:
  """The descriptions of the effects inside ``eqn``'s sub-computations."""
  found = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive is _primitives.effect_p:
        found.append(e.params["host_callback"].description)
      for sub in _compat.jaxprs_in_params(e.params):
        walk(sub)
  for sub in _compat.jaxprs_in_params(eqn.params):
    walk(sub)
  return found


def _marker_inside(eqn) -> bool:
  return bool(_effects_inside(eqn))


def refusal(eqn) -> NotImplementedError:
  """The error for an effect inside a higher-order primitive with no rule."""
  name = eqn.primitive.name
  inside = _effects_inside(eqn)
  what = inside[0] if inside else "a jax_effects side effect"
  reason = REFUSED.get(
      name, "jax_effects does not know in which order this primitive runs "
            "its sub-computations")
  return NotImplementedError(
      f"{what} is inside JAX's higher-order primitive '{name}', where "
      f"jax_effects cannot order it: {reason}. Move the effect out of it "
      f"(compute the values there and print, log or call back after it).")


# --- top level -----------------------------------------------------------------

def _per_device_keys(jaxpr, mode: str) -> set:
  """The chain keys with an effect inside a ``shard_map`` (per device)
  anywhere in ``jaxpr``."""
  keys = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive is _compat.shard_map_p:
      keys.update(chain_keys(eqn.effects, mode))
    elif has_marker(eqn.effects) or eqn.primitive.name in HIDES_EFFECTS:
      for sub in _compat.jaxprs_in_params(eqn.params):
        keys |= _per_device_keys(sub, mode)
  return keys


def thread_program(closed: jex_core.ClosedJaxpr, args: Sequence[Any],
                  runtime_tokens: dict, mode: str):
  """Threads a whole program; returns ``(outs, token)``.

  ``runtime_tokens`` maps each ordered chain key to its runtime-token argument
  (the initial carrier). ``token`` combines every chain's final carrier (and
  every runtime-token argument): it is ready only once every side effect of
  this computation has run. It is None when there is nothing to combine.
  """
  per_device = _per_device_keys(closed.jaxpr, mode)
  # A chain with no per-device effect here whose runtime token comes per
  # device (another chain's shard_map made it so) takes it as one scalar
  # first: one all-reduce as the execution starts, before any of its
  # callbacks, instead of a vector carried through its loops (reduced around
  # every once effect there: an all-reduce per iteration in which every
  # device waits for the callback before it).
  runtime_tokens = {k: t if jnp.ndim(t) == 0 or k in per_device
                    else jnp.max(t) for k, t in runtime_tokens.items()}
  chains = Chains(runtime_tokens, entries=runtime_tokens)
  saved, _context.per_device = _context.per_device, per_device
  try:
    outs = thread_jaxpr(closed.jaxpr, closed.consts, args, chains, mode)
  finally:
    _context.per_device = saved
  finals = list(chains.carriers.values())
  # (A chain that went through shard_map ends as a per-device vector, see
  # _shard_map_rule: the token is then that vector, no collective needed.)
  # A chain whose effect failed ends with the FAILED bit (its later effects
  # were skipped) and so may the token: the next computation's entries clear
  # it (Chains); the error itself is reported by the dispatching thread
  # (design/errors.md).
  if any(jnp.shape(c) for c in finals):
    # A per-device token: a chain whose last effect ran once contributes the
    # carrier of the device that ran it to every device's element (the
    # others' copies are stale, see _primitives._on_first_device; a runtime
    # token no effect took is the same everywhere), so that the next call's
    # per-device effects of that chain follow it. A chain with no per-device
    # effect in this program keeps its scalar: device 0's element holds its
    # real carrier, which is what its next once effect (the max of the
    # elements) and the combination for any other computation read; a
    # broadcast would make every device wait for that chain's callbacks at
    # the end of the execution, for no effect of theirs.
    finals = [c if jnp.shape(c) or k in chains.entries or k not in per_device
              else _primitives.from_first_device_p.bind(c)
              for k, c in chains.carriers.items()]
  token = functools.reduce(jnp.maximum, finals) if finals else None
  return outs, token

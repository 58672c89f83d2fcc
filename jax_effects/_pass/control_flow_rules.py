"""The pass's rules for control flow, call-like and other higher-order primitives.

Each rule (registered with ``token_pass.register_rule`` right under it)
re-expresses its primitive with ``lax``, the carriers of the chains used
inside crossing the boundary as extra operands and results: ``cond`` as
``lax.switch``, ``while`` as ``lax.while_loop`` (effects in ``cond_fun`` run
before the loop and after each iteration), ``scan`` as ``lax.scan``;
call-like primitives are inlined, ``custom_linear_solve`` runs its
``solve``. A loop carries the staging buffers of its batched effects
(``staging.Loop``). See ``design/tokens.md`` and
``design/transformations.md``.

A nested ``jit`` holding effects is evaluated inline, in the caller's
trace (a ``jit`` equation; a ``jax_effects.jit`` function called inside
another binds one, as ``jax.jit``'s call does). JAX's nested ``jit`` lays
its arguments out as its ``in_shardings`` say and its results as its
``out_shardings`` say (sharding annotations on the callee's parameters and
results); inlined, the same constraints are applied with
``jax.lax.with_sharding_constraint`` (:func:`_constrain_flat`), so values
are laid out as under ``jax.jit`` (a result of an inner
``jit(f, out_shardings=s)`` stays sharded by ``s``). Memory layouts,
donation and compiler options of the inner jit do not apply inside an
enclosing computation under ``jax.jit`` either.

``shard_map`` (and so ``pmap``): per-device effects. Its part of the token
calling convention (``design/placement.md``, "Tokens across devices"): the
carriers of the chains used inside become extra operands and results::

    carrier_vecs, outs = shard_map(body', in_specs=(P() or P(axes), ...,
                                                    *in_specs),
                                   out_specs=(P(axes), ..., *out_specs))(
                                       carriers, *args)

A scalar carrier enters replicated and is cast to varying inside; each
device's final carrier leaves as its element of a ``(n_devices,)`` vector,
which stays the chain's carrier (reduced with ``max`` where a scalar is
needed). No collective is added. ``jax.pmap`` is staged as
``jit(shard_map)``, so the rule covers it.

``exp.call`` of an exported ``jax_effects.jit`` function: its part of the
token calling convention (``design/tokens.md``, "An exported function"):
an exported jax_effects function (``_dispatch.function``) carries JAX's
ordered effect ``EXPORTED_ORDER``; inside ``jax_effects.jit`` its call is
threaded on the chain of :data:`~jax_effects.DEFAULT`
(:data:`~jax_effects.GLOBAL` in global mode), as JAX's adopted callbacks
are, and no JAX effect is left. A ``call_exported`` of a function exported
without effects of ours is bound unchanged.

Regions of ours under plain ``jax.jit``: lowered through these rules
(:func:`through_the_pass`, wrapped around JAX's lowering of every primitive
with a rule once all are registered, at the end of this module). Under
plain ``jax.jit`` (a library's jit, ``nnx.jit``, ``eqx.filter_jit``, or
JAX's eager ``while_loop``/``cond``/``scan``, which jit the primitive) no
pass of ours runs before JAX lowers the program. An effect directly at the
top of the program is lowered by ``effect.fallback_lowering`` on JAX's
token of ``PLAIN_JIT_ORDER``; a higher-order primitive holding effects of
ours (``while``, ``cond``, ``scan``, ``shard_map``, a nested ``jit``, ...:
every primitive the pass has a rule for) is lowered here, through the
pass's own rule, so it runs exactly as it runs inside ``jax_effects.jit``:
a ``cond_fun``'s effects run before the loop and after each iteration (XLA
skips a ``while``'s condition computation when it knows the trip count), a
vmapped loop's effects run for its live elements only, and per-device
effects come before the effects after the ``shard_map`` on every device.

Its part of the token calling convention: the region is bracketed by the
exported convention's entry and exit (``_primitives.exported``, with
``order=PLAIN_JIT_ORDER``): every chain of the region starts from one
carrier made, by a host call, from JAX's token of ``PLAIN_JIT_ORDER``
(joined with every ordered chain, ``host_target.join``), and the region's
final carriers, combined as ``thread_program`` combines them, make that
token again by another host call. So the region is one step in JAX's order
of the program and of the thread's calls. A region with unordered effects
only starts its carriers from zero and returns no token. See
``design/errors.md``, "Plain ``jax.jit``".
"""
from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.interpreters import mlir
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.sharding import Sharding

from jax_effects import _compat
from jax_effects._compat import core as jcore
from jax_effects._compat.core import primitives as jprims
from jax_effects import _jax_api
from jax_effects._core import effects as _effects
from jax_effects._core import jaxpr_eval as _jaxpr_eval
from jax_effects._pass import staging as _staging
from jax_effects._pass import token_pass as _token_pass
from jax_effects._primitives import exported as _exported
from jax_effects._primitives import threaded as _threaded
from jax_effects._runtime import token_value as _token_value


def _cond_rule(eqn, invals, chains: _token_pass.Chains, mode: str):
  keys = _effects.chain_keys(eqn.effects, mode)
  index, *ops = invals
  branches = [_token_pass.region(b, keys, mode, kind="branch")
              for b in eqn.params["branches"]]
  carriers, outs = lax.switch(index, branches, chains.take(keys), *ops)
  chains.put(keys, carriers)
  return outs


_token_pass.register_rule(jprims.cond_p, _cond_rule)


def _while_rule(eqn, invals, chains: _token_pass.Chains, mode: str):
  p = eqn.params
  cond_n, body_n = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts = invals[:cond_n], invals[cond_n:cond_n + body_n]
  init = invals[cond_n + body_n:]
  keys = _effects.chain_keys(eqn.effects, mode)
  cond_effectful = _effects.has_chain(p["cond_jaxpr"].effects)
  cond_fn = _token_pass.region(p["cond_jaxpr"], keys if cond_effectful else (), mode,
                   cond_consts, kind="loop")
  body_fn = _token_pass.region(p["body_jaxpr"], keys, mode, body_consts, kind="loop")

  if p["cond_jaxpr"].out_avals[0].shape:
    # (its effects run for live elements only: not staged)
    _staging.flush_for(keys, chains)
    with _staging.hidden():
      carriers, outs = _batched_while(cond_fn, body_fn, cond_effectful,
                                      chains.take(keys), init)
    chains.put(keys, carriers)
    return outs
  loop = _staging.Loop(p["body_jaxpr"].jaxpr, keys, mode,
                       _token_pass.live_masked(), _token_pass.flush_on_chain)
  try:
    steps = None if cond_effectful else loop.strip_steps()
    if not cond_effectful:
      def loop_cond(state):
        return cond_fn((), *state[-1])[1][0]

      def step(state):
        carriers, states, vals = state
        (carriers, vals), states = loop.run(states, body_fn, carriers, *vals)
        return carriers, states, vals

      loop_body = step
      if steps is not None:   # (strip-mined: staging.Loop.strip_steps)
        def strip_cond(state):
          return jnp.logical_and(state[0] < steps, loop_cond(state))

        def strip_body(state):
          return (state[0] + 1, *step(state[1:]))

        def strip(state):
          _, carriers, states, vals = _while_loop(
              strip_cond, strip_body, (jnp.int32(0), *state))
          strip_chains = _token_pass.Chains(dict(zip(keys, carriers)))
          states = loop.flush(states, strip_chains)
          return strip_chains.take(keys), states, vals
        loop_body = strip

      carriers, states, outs = _while_loop(
          loop_cond, loop_body, (chains.take(keys), loop.states(), list(init)))
    else:
      # Effects in cond_fun: run the predicate once before the loop and
      # again at the end of every iteration, carrying it (as JAX does for
      # its own ordered effects), so every evaluation of cond_fun happens in
      # order.
      (carriers, (pred,)), states = loop.run(loop.states(), cond_fn,
                                             chains.take(keys), *init)

      def step(carriers, *vals):
        carriers, vals = body_fn(carriers, *vals)
        carriers, (pred,) = cond_fn(carriers, *vals)
        return carriers, pred, vals

      def loop_body(state):
        carriers, states, _, vals = state
        (carriers, pred, vals), states = loop.run(states, step, carriers, *vals)
        return carriers, states, pred, vals

      carriers, states, _, outs = _while_loop(
          lambda s: s[2], loop_body, (carriers, states, pred, list(init)))
    chains.put(keys, carriers)
    loop.exit(states, chains)
  finally:
    loop.close()
  return outs


_token_pass.register_rule(jprims.while_p, _while_rule, keeps_stages=True)


def _while_loop(cond_fun, body_fun, init):
  """``lax.while_loop`` of a condition and body the pass made, each with its
  DebugInfo and signature set (``_compat.traced_as_region``)."""
  return lax.while_loop(_compat.traced_as_region(cond_fun),
                        _compat.traced_as_region(body_fun), init)


def _batched_while(cond_fn, body_fn, cond_effectful, carriers, init):
  """A while_loop with a batched predicate: as JAX's lowering, the body
  runs while any element is live and a finished one keeps its carry; the
  effects get the live mask, so they run for live elements only."""
  def cond(carriers, vals):
    c, (pred,) = cond_fn(carriers if cond_effectful else (), *vals)
    return (c if cond_effectful else carriers), pred

  carriers, pred = cond(carriers, init)

  def loop_body(state):
    carriers, live, vals = state
    with _token_pass.in_region(mask=live):
      carriers, new = body_fn(carriers, *vals)
      vals = [lax.select(lax.broadcast_in_dim(live, jnp.shape(n),
                                              tuple(range(live.ndim))), n, v)
              for n, v in zip(new, vals)]
      carriers, pred = cond(carriers, vals)
    return carriers, jnp.logical_and(pred, live), vals

  carriers, _, outs = _while_loop(lambda s: jnp.any(s[1]), loop_body,
                                 (carriers, pred, list(init)))
  return carriers, outs


def _scan_rule(eqn, invals, chains: _token_pass.Chains, mode: str):
  p = eqn.params
  n_consts, n_carry = _compat.scan_counts(p)
  consts = invals[:n_consts]
  init = invals[n_consts:n_consts + n_carry]
  xs = invals[n_consts + n_carry:]
  keys = _effects.chain_keys(eqn.effects, mode)
  body_fn = _token_pass.region(p["jaxpr"], keys, mode, consts, kind="loop")
  loop = _staging.Loop(p["jaxpr"].jaxpr, keys, mode,
                       _token_pass.live_masked(), _token_pass.flush_on_chain)
  try:
    def body(carry, x):
      carriers, states, c = carry
      (carriers, outs), states = loop.run(states, body_fn, carriers, *c, *x)
      return (carriers, states, outs[:n_carry]), outs[n_carry:]

    def scan(carry, xs, length):
      return lax.scan(_compat.traced_as_region(body), carry, xs, length=length,
                      reverse=p["reverse"], unroll=p["unroll"])

    carry = (chains.take(keys), loop.states(), list(init))
    steps = loop.strip_steps(p["length"])
    if steps is None:
      (carriers, states, carry), ys = scan(carry, list(xs), p["length"])
    else:
      (carriers, states, carry), ys = _strip_mined(
          scan, loop, keys, carry, list(xs), p["length"], steps,
          p["reverse"])
    chains.put(keys, carriers)
    loop.exit(states, chains)
  finally:
    loop.close()
  return [*carry, *ys]


def _strip_mined(scan, loop, keys, carry, xs, length, steps, reverse):
  """``scan(carry, xs, length)`` as an outer scan of strips of ``steps``
  steps, the loop's stages flushed after each, then the remaining steps
  (``staging.Loop.strip_steps``)."""
  n, rest = divmod(length, steps)
  cut = rest if reverse else n * steps   # (the rest runs last)
  ys_parts = []
  if n:
    def strip(carry, x):
      (carriers, states, c), ys = scan(carry, x, steps)
      chains = _token_pass.Chains(dict(zip(keys, carriers)))
      states = loop.flush(states, chains)
      return (chains.take(keys), states, c), ys

    main = [x[rest:] if reverse else x[:cut] for x in xs]
    carry, ys = lax.scan(
        _compat.traced_as_region(strip), carry,
        [x.reshape(n, steps, *x.shape[1:]) for x in main],
        length=n, reverse=reverse)
    ys_parts.append([y.reshape(n * steps, *y.shape[2:]) for y in ys])
  if rest:
    carry, ys = scan(carry, [x[:cut] if reverse else x[cut:] for x in xs], rest)
    ys_parts.append(ys)
  if reverse:
    ys_parts.reverse()
  if len(ys_parts) == 1:
    return carry, ys_parts[0]
  return carry, [jnp.concatenate(parts) for parts in zip(*ys_parts)]


_token_pass.register_rule(jprims.scan_p, _scan_rule, keeps_stages=True)


def _constrain(value, sharding):
  if isinstance(sharding, (Sharding, P)):
    return jax.lax.with_sharding_constraint(value, sharding)
  return value   # None / unspecified: left as it comes


def _constrain_flat(values, shardings) -> list:
  """``values`` (a jit equation's operands or results) constrained to
  ``shardings`` (its ``in_shardings``/``out_shardings`` param: a
  ``Sharding`` or JAX's unspecified marker per value; module docstring)."""
  return [_constrain(v, s) for v, s in zip(values, shardings)]


def _inline_rule(param: str, eqn, invals, chains: _token_pass.Chains, mode: str):
  """Call-like primitives (``_core.jaxpr_eval.CALLEES``), inlined with the
  caller's chains; a ``jit``'s shardings kept (:func:`_constrain_flat`)."""
  jaxpr, consts = _jaxpr_eval.split(eqn.params[param])
  if eqn.primitive is not jprims.jit_p:
    return _token_pass.thread_jaxpr(jaxpr, consts, invals, chains, mode)
  invals = _constrain_flat(invals, eqn.params["in_shardings"])
  outs = _token_pass.thread_jaxpr(jaxpr, consts, invals, chains, mode)
  return _constrain_flat(outs, eqn.params["out_shardings"])


for _prim, _param in _jaxpr_eval.CALLEES.items():
  _token_pass.register_rule(_prim, functools.partial(_inline_rule, _param),
                            keeps_stages=True)


def _hi_primitive_rule(eqn, invals, chains: _token_pass.Chains, mode: str):
  """A high-level primitive (``call_hi_primitive``, JAX 0.11+): its
  expansion, threaded with the caller's chains (what lowering runs)."""
  closed = _compat.hi_primitive_expansion(eqn)
  return _token_pass.thread_jaxpr(closed.jaxpr, closed.consts, invals, chains, mode)


if _compat.call_hi_primitive_p is not None:
  _token_pass.register_rule(_compat.call_hi_primitive_p, _hi_primitive_rule,
                            keeps_stages=True)


def _linear_solve_rule(eqn, invals, chains: _token_pass.Chains, mode: str):
  """``custom_linear_solve``: as its impl, the ``solve`` jaxpr (the other
  jaxprs' effects are in what differentiation made of them)."""
  solve, lengths = eqn.params["jaxprs"].solve, eqn.params["const_lengths"]
  start = lengths.matvec + lengths.vecmat   # (the consts: matvec, vecmat, solve, ...)
  args = [*invals[start:start + lengths.solve], *invals[sum(lengths):]]
  return _token_pass.thread_jaxpr(solve.jaxpr, solve.consts, args, chains, mode)


_token_pass.register_rule(jprims.linear_solve_p, _linear_solve_rule,
                          keeps_stages=True)


# --- shard_map (and so pmap): per-device effects -----------------------------

def _explicit(mesh, axes) -> bool:
  """Whether any of ``axes`` of ``mesh`` is an Explicit axis."""
  types = getattr(mesh, "axis_types", ())
  return any(t == jax.sharding.AxisType.Explicit
             for name, t in zip(mesh.axis_names, types) if name in axes)


def _shard_map_rule(eqn, invals, chains: _token_pass.Chains, mode: str):
  p = eqn.params
  mesh = p["mesh"]
  manual = _compat.shard_map_manual_axes(p)
  axes = tuple(a for a in mesh.axis_names if a in manual)
  n = math.prod(mesh.shape[a] for a in axes)
  check_vma = p["check_vma"]
  keys = _effects.chain_keys(eqn.effects, mode)
  body_fn = _token_pass.region(p["jaxpr"], keys, mode)

  # After an effect that ran once only device 0's copy is current.
  after_once = [k in chains.carriers and not chains.still_entered(k) for k in keys]
  carriers_in = []
  for c, once in zip(chains.take(keys), after_once):
    if c.shape not in ((), (n,)):   # per-device vector of another mesh
      c = jnp.max(c)
    elif once and not c.shape:
      c = _threaded.from_first_device_p.bind(c)
    carriers_in.append(c)

  def body(carriers, *args):
    carriers = [c.reshape(()) for c in carriers]
    if check_vma:
      carriers = [_compat.to_varying(c, axes) for c in carriers]
    carriers, outs = body_fn(carriers, *args)
    if check_vma:
      carriers = [_compat.to_varying(c, axes) for c in carriers]
    return tuple(c.reshape((1,)) for c in carriers), list(outs)

  if _explicit(mesh, axes):
    # A per-device token passed back arrives typed replicated: split it.
    split = jax.sharding.NamedSharding(mesh, P(axes))
    carriers_in = [jax.sharding.reshard(c, split)
                   if c.shape and jax.typeof(c).sharding.spec != P(axes)
                   else c for c in carriers_in]
  carrier_in = tuple(P(axes) if c.shape else P() for c in carriers_in)
  carrier_out = tuple(P(axes) for _ in keys)
  carrier_vecs, outs = _jax_api.shard_map(
      body, mesh=mesh, in_specs=(carrier_in, *p["in_specs"]),
      out_specs=(carrier_out, list(p["out_specs"])),
      axis_names=set(manual), check_vma=check_vma)(tuple(carriers_in), *invals)
  # In a loop or branch the carrier keeps the shape it came in with (the
  # carry's type); at the top level it stays per device.
  at_top = _token_pass.region_kind() == "top"
  for key, c_in, vec in zip(keys, carriers_in, carrier_vecs):
    keep = at_top or c_in.shape == vec.shape
    chains.carriers[key] = vec if keep else jnp.max(vec)
  return outs


_token_pass.register_rule(_compat.shard_map_p, _shard_map_rule)


# --- exp.call of an exported jax_effects function ----------------------------

def _call_exported_rule(eqn, invals, chains: _token_pass.Chains, mode: str):
  exported = eqn.params["exported"]
  if _effects.EXPORTED_ORDER not in exported.ordered_effects:
    return _compat.bind_equation(eqn, invals)
  return _token_pass.bind_on_chain(
      chains, _token_pass.default_chain(None, mode),
      lambda token, carrier: _exported.call(token, carrier, invals, exported),
      from_first=False)


if _compat.call_exported_p is not None:   # (else: _compat.EXPORTED_CALLS)
  _token_pass.register_rule(_compat.call_exported_p, _call_exported_rule)
# (its chain, for the registry that answers which chain an effect is on)
_effects.register_chain_kind(_effects.ExportedOrder, _token_pass.default_chain)


# --- regions of ours under plain jax.jit: through the rules above ------------

PLAIN_JIT_ORDER = _effects.PLAIN_JIT_ORDER


def _holds_our_effects(params) -> bool:
  return any(_effects.has_own_marker(j.effects)
             for j in _compat.jaxprs_in_params(params))


def _one_equation(ctx, primitive, params) -> jcore.ClosedJaxpr:
  """The equation being lowered, as a jaxpr of its own (the pass's input);
  its effects are its sub-jaxprs' (the pass reads only its own kinds)."""
  effects = set().union(*(j.effects for j in _compat.jaxprs_in_params(params)))
  invars = [jcore.Var(a) for a in ctx.avals_in]
  outvars = [jcore.Var(a) for a in ctx.avals_out]
  eqn = _compat.new_jaxpr_eqn(invars, outvars, primitive, params, effects,
                              ctx=ctx.jaxpr_eqn_ctx)
  info = _compat.DebugInfo(primitive.name, "jax_effects plain jax.jit region",
                           None, None)
  return jcore.ClosedJaxpr(
      jcore.Jaxpr([], invars, outvars, [eqn], effects, info), [])


def through_the_pass(primitive, rule):
  """``primitive``'s lowering ``rule`` (JAX's), made to lower a region
  holding effects of ours through the pass (the module docstring)."""

  def rule_through_the_pass(ctx, *args, **params):
    if not _holds_our_effects(params):
      return rule(ctx, *args, **params)
    # (one chain, as JAX's one token of PLAIN_JIT_ORDER orders the effects
    # around the region: right in either mode, which jax.jit's cache of
    # the executable does not know)
    mode = "global"
    ordered = PLAIN_JIT_ORDER in ctx.tokens_in.effects()

    def region(*args):
      closed = _one_equation(ctx, primitive, params)
      carrier = (_exported.entry(PLAIN_JIT_ORDER) if ordered
                 else jnp.zeros((), _token_value.TOKEN_DTYPE))
      outs, token = _token_pass.thread_region(
          closed, args, _token_value.advance(carrier), mode)
      if ordered:
        _exported.exit(carrier if token is None else token, PLAIN_JIT_ORDER)
      return outs

    return mlir.lower_fun(region, multiple_results=True)(ctx, *args)

  return rule_through_the_pass


_compat.wrap_lowerings(
    [p for p in _token_pass.RULES if p.multiple_results],  # (higher-order)
    through_the_pass)

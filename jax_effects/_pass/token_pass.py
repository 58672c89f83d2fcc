"""The token-threading pass: a jaxpr interpreter with a rule per primitive.

Input: the closed jaxpr of a user function, traced with ``effect_p``
equations (each marked with a ``TraceEffect``). Output: the same computation,
re-traced into the current trace, in which every ``effect_p`` became a
``threaded_effect_p`` linked to its chain, and nothing carries a JAX effect.
Its part of the token calling convention (``design/tokens.md``, "Inside a
computation"): per chain key a compiler token and a carrier
(:class:`Chains`); only carriers cross a higher-order primitive's boundary;
the carriers start as the runtime tokens and end combined into the one
token the executable returns (:func:`thread_program`).

Higher-order primitives go through rules (:func:`register_rule`, in
``control_flow_rules``); one with an effect inside and no rule is
refused, naming why (:func:`refusal`). In a loop, an effect offered for
batching is written to the loop's stage instead, and anything
else on its chain flushes the stage first (``staging``). JAX's own
callbacks (``jax.debug.print``/``log``, ``jax.debug.callback``,
``io_callback``) are adopted: threaded on DEFAULT's chain as ours are
(:func:`adopt`), their host side registered by ``_frontends.adopted_host``.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Sequence

from jax import lax
import jax.numpy as jnp

from jax_effects import _compat
from jax_effects._compat import core as jcore
from jax_effects._core import effects as _effects
from jax_effects._core import jaxpr_eval as _jaxpr_eval
from jax_effects._pass import staging as _staging
from jax_effects._primitives import counter as _counters
from jax_effects._primitives import effect as _effect
from jax_effects._primitives import threaded as _threaded
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._runtime import token_value as _token_value

#: A rule: ``rule(eqn, invals, chains, mode) -> outputs`` (see the docstring).
Rule = Callable[..., Sequence[Any]]
#: Primitive -> rule; add to it only through :func:`register_rule`.
RULES: dict[jcore.Primitive, Rule] = {}
#: The primitives whose rules keep the stages in force (``staging``).
KEEPS_STAGES: set[jcore.Primitive] = set()


def register_rule(primitive: jcore.Primitive, rule: Rule,
                  keeps_stages: bool = False) -> None:
  """Makes the pass thread chains through ``primitive`` with ``rule``.

  ``rule(eqn, invals, chains, mode)`` binds the equation's computation into
  the current trace with every effect inside linked to its chain
  (``chains.take``/``put`` the carriers of ``chain_keys(eqn.effects)``;
  :func:`region` runs a sub-jaxpr threaded) and returns its outputs.
  ``keeps_stages``: the rule inlines its sub-jaxpr or carries the stages of
  its chains (a loop, ``staging.Loop``); other rules' chains are flushed
  before them.
  """
  RULES[primitive] = rule
  if keeps_stages:
    KEEPS_STAGES.add(primitive)


class Chains:
  """Current compiler token and carrier of each chain, during the pass.

  ``entered``: the top-level carriers (the runtime tokens advanced to this
  execution, :func:`thread_program`) while no effect has replaced them.
  """
  __slots__ = ("tokens", "carriers", "entered")

  def __init__(self, carriers: dict, entered: bool = False):
    self.tokens: dict = {}
    self.carriers: dict = dict(carriers)
    self.entered: dict = dict(carriers) if entered else {}

  def still_entered(self, key) -> bool:
    """Whether ``key``'s carrier is still the runtime token it entered with."""
    c = self.carriers.get(key)
    return c is not None and c is self.entered.get(key)

  def carrier(self, key):
    c = self.carriers.get(key)
    if c is None:  # an unordered chain starting here
      c = self.carriers[key] = jnp.zeros((), _token_value.TOKEN_DTYPE)
    return c

  def take(self, keys) -> tuple:
    return tuple(self.carrier(k) for k in keys)

  def put(self, keys, carriers) -> None:
    self.carriers.update(zip(keys, carriers))


class _Context(threading.local):
  """Where the pass is, for the effects it meets (dynamically scoped).

  ``kind``: "top", "branch" (directly in a cond branch) or "loop".
  ``masks``: batched predicates of the enclosing vmapped ``while_loop`` s, in
  whose bodies an element's effects run only while it is live.
  """

  def __init__(self):
    self.kind = "top"
    self.masks: tuple = ()
    # Chain keys with per-device effects in the program (None: every key).
    self.shard_map_chains: set | None = None
    # Counters stay on the host (a region under plain jax.jit, whose
    # counts the program around it keeps there: counter's fallback).
    self.host_counters = False
    # Long runs of unchanged equations are staged as one
    # (``jaxpr_eval.STRETCH``): in a threaded program only, so a program
    # without effects keeps the jaxpr jax.jit would make.
    self.stretches = False


_context = _Context()


def region_kind() -> str:
  """Where the pass is: "top", "branch" (directly in a cond branch), "loop"."""
  return _context.kind


@contextlib.contextmanager
def in_region(kind: str | None = None, mask=None):
  saved = _context.kind, _context.masks
  if kind is not None:
    _context.kind = kind
  if mask is not None:
    _context.masks = (*_context.masks, mask)
  try:
    yield
  finally:
    _context.kind, _context.masks = saved


# --- JAX's own callbacks, adopted ---------------------------------------------
# ``jax.debug.print``/``log`` (``debug_print_p``), ``jax.debug.callback``
# (``debug_callback_p``) and ``io_callback`` (``io_callback_p``) traced inside
# a ``jax_effects.jit`` function become ``threaded_effect_p`` equations:
# ordered or not, each joins the chain of DEFAULT (GLOBAL in global mode;
# their effect types are registered so here), so it runs in program order
# with jax_effects' effects, and no JAX effect is left. Their host side is a
# front end's (``_frontends.adopted_host``, :func:`register_host_side`),
# which keeps JAX's contract. Unlike JAX's lowering, ``io_callback``'s
# ``sharding=`` is ignored (it runs where ours run); an ordered
# ``io_callback`` under ``vmap`` is still refused by JAX. Left to JAX:
# ``jax.debug.callback(partitioned=True)`` and a callback inside a
# higher-order primitive without a rule (``design/architecture.md``).

def default_chain(effect, mode: str):
  """DEFAULT (GLOBAL in global mode), whatever the effect."""
  del effect
  return _effects.GLOBAL if mode == "global" else _effects.DEFAULT


for _effect_type in (_compat.OrderedDebugEffect, _compat.DebugEffect,
                     _compat.OrderedIOEffect, _compat.IOEffect):
  _effects.register_chain_kind(_effect_type, default_chain)


# primitive -> ``host_side(params, avals, source_info) -> HostCallback``,
# registered by ``_frontends.adopted_host``.
_host_sides: dict = {}


def register_host_side(primitive, host_side) -> None:
  """Registers ``host_side(params, avals, source_info)``, the
  :class:`~jax_effects._primitives.host_callback.HostCallback` that runs an
  adopted ``primitive`` equation (``avals``: its operands'; ``source_info``:
  the equation's, which names the user's line)."""
  _host_sides[primitive] = host_side


def adopt(eqn):
  """The ``HostCallback`` of an adoptable equation, or None if it stays
  JAX's (a new one per pass run)."""
  params = eqn.params
  host_side = _host_sides.get(eqn.primitive)
  if host_side is None or params.get("partitioned"):
    return None
  return host_side(params, tuple(v.aval for v in eqn.invars), eqn.source_info)


#: The primitives of JAX's callbacks that the pass adopts.
ADOPTED = frozenset({_compat.debug_callback_p, _compat.debug_print_p,
                     _compat.io_callback_p})


# --- the interpreter ---------------------------------------------------------

def _no_stages():
  """A region that starts with no stage (``staging.hidden``); nothing to do
  where none is in force, the common case, which never enters
  ``staging``."""
  return _staging.hidden() if _staging.stages.by_key else contextlib.nullcontext()


def thread_jaxpr(jaxpr: jcore.Jaxpr, consts: Sequence[Any],
                 args: Sequence[Any], chains: Chains, mode: str) -> list:
  """Evaluates ``jaxpr`` in the current trace, threading ``chains``."""
  def handle(eqn, invals):
    if eqn.primitive is _effect.effect_p:
      return _thread_effect(eqn, invals, chains, mode)
    if eqn.primitive in ADOPTED:
      host_callback = adopt(eqn)
      if host_callback is not None:   # JAX's own callback: threaded like ours
        (key,) = _effects.chain_keys(eqn.effects, mode)
        if _staging.stages.by_key:
          _staging.flush_for((key,), chains)
        return _bind_threaded(key, host_callback, invals, chains)
    effects = eqn.effects
    if (effects and _effects.has_chain(effects) and (
        eqn.primitive in RULES or _effects.has_own_marker(effects)
        or eqn.primitive.name in _compat.FEATURE_OF_PRIMITIVE)) or (
        eqn.primitive.name in _effect.HIDES_EFFECTS and _effect.effects_inside(eqn)):
      rule = RULES.get(eqn.primitive)
      if rule is None:
        raise refusal(eqn)
      if eqn.primitive not in KEEPS_STAGES and _staging.stages.by_key:
        _staging.flush_for(_effects.chain_keys(effects, mode) if effects
                           else _staging.keys(), chains)
      return rule(eqn, invals, chains, mode)
    return _jaxpr_eval.rebind(eqn, invals)
  return _jaxpr_eval.eval_jaxpr(jaxpr, consts, args, handle, unchanged,
                                _context.stretches)


def unchanged(eqn) -> bool:
  """Whether the pass re-emits ``eqn`` as it is (no effect of a chain in
  it, nothing a rule or a refusal looks at): it is copied, not re-traced."""
  effects = eqn.effects
  return not (
      eqn.primitive is _effect.effect_p
      or eqn.primitive in ADOPTED
      or (effects and _effects.has_chain(effects))
      or eqn.primitive.name in _effect.HIDES_EFFECTS)


def _thread_effect(eqn, invals, chains: Chains, mode: str):
  (key,) = _effects.chain_keys(eqn.effects, mode)
  host_callback = eqn.params["host_callback"]
  if host_callback.traced_in_branch and _context.kind != "branch":
    raise _effect.branch_vmapped_error(host_callback)
  stage = _staging.stages.by_key.get(key)
  if stage is not None:
    if stage.holds(eqn) and not _context.masks:
      stage.write(eqn, _host_callback.on_chain(host_callback, key), invals, chains)
      return []
    stage.flush(chains)   # (what was staged comes first)
  if _context.masks and not host_callback.batch_once:
    host_callback, masks = _host_callback.masked(host_callback, _context.masks)
    invals = [*masks, *invals]
  return _bind_threaded(key, host_callback, invals, chains)


def live_masked() -> bool:
  """Whether the pass is in a vmapped ``while_loop`` whose effects run for
  live elements only (not staged)."""
  return bool(_context.masks)


def flush_on_chain(key, host_callback, operands, carrier):
  """``staging.FlushCall``: one host call on chain ``key`` from
  ``carrier`` (in a ``lax.cond`` branch); returns the carrier after it."""
  chains = Chains({key: carrier})
  _bind_threaded(key, host_callback, list(operands), chains)
  return chains.carriers[key]


def bind_on_chain(chains: Chains, key, bind: Callable, from_first: bool):
  """Binds ``bind(token, carrier) -> (token, carrier, results)``, a call
  that runs once, on chain ``key``; returns ``results``. Per-device carriers
  enter as their max and leave broadcast, where ``from_first`` taken from
  the device that ran it (``design/placement.md``, "Tokens across
  devices")."""
  token = chains.tokens[key] if key in chains.tokens else lax.create_token()
  carrier = chains.carrier(key)
  shape = jnp.shape(carrier)
  if shape:
    carrier = jnp.max(carrier)
  token, carrier, results = bind(token, carrier)
  if shape:
    if from_first:
      carrier = _threaded.from_first_device_p.bind(carrier)
    carrier = jnp.broadcast_to(carrier, shape)
  chains.tokens[key] = token
  chains.carriers[key] = carrier
  return results


def _bind_threaded(key, host_callback, invals, chains: Chains):
  """One ``threaded_effect_p`` on chain ``key``; returns its results."""
  # (what the host keeps is named by it)
  host_callback = _host_callback.on_chain(host_callback, key)

  def bind(token, carrier):
    token, carrier, *results = _threaded.threaded_effect_p.bind(
        token, carrier, *invals, host_callback=host_callback, entry=False,
        ordered=key is not _effects.UNORDERED)
    return token, carrier, results
  # (a chain with no per-device effect here keeps device 0's copy)
  per_device = _context.shard_map_chains
  return bind_on_chain(chains, key, bind, per_device is None or key in per_device)


def region(closed: jcore.ClosedJaxpr | jcore.Jaxpr, keys: tuple,
           mode: str, consts: Sequence[Any] = (),
           kind: str | None = None) -> Callable:
  """``fn(carriers, *args) -> (carriers, outs)`` running a sub-jaxpr threaded.

  ``consts`` are values of the enclosing trace prepended to the arguments
  (closed over, so JAX's control-flow APIs hoist them as their own consts).
  ``kind`` ("branch", "loop"; None: as the caller) is what the region is.
  """
  jaxpr, jaxpr_consts = _jaxpr_eval.split(closed)

  def fn(carriers, *args):
    chains = Chains(dict(zip(keys, carriers)))
    # (a loop carries its stages; other regions hide them)
    stages = contextlib.nullcontext() if kind == "loop" else _no_stages()
    with in_region(kind), stages:
      outs = thread_jaxpr(jaxpr, jaxpr_consts, [*consts, *args], chains, mode)
    return chains.take(keys), outs
  return _compat.traced_as_region(fn)


def _counter_rule(eqn, invals, chains: Chains, mode: str):
  """``counter_p``: the count is the counter chain's carrier; a set keeps
  the type of the count it replaces (varying inside ``shard_map``)."""
  del mode
  if _context.host_counters:
    return _jaxpr_eval.rebind(eqn, invals)
  counter, op = eqn.params["counter"], eqn.params["op"]
  (x,) = invals
  count = chains.carrier(counter)
  count = count * 0 + x if op == "set" else count + x
  chains.carriers[counter] = count
  return count


register_rule(_counters.counter_p, _counter_rule)


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


def refusal(eqn) -> NotImplementedError:
  """The error for an effect inside a higher-order primitive with no rule."""
  name = eqn.primitive.name
  what = _effect.first_effect(eqn)
  feature = _compat.FEATURE_OF_PRIMITIVE.get(name)
  missing = feature and _compat.unsupported_reason(feature)
  if missing:   # (the installed JAX lacks what its rule needs)
    return _compat.UnsupportedFeature(f"{what}: {missing}")
  reason = REFUSED.get(
      name, "jax_effects does not know in which order this primitive runs "
            "its sub-computations")
  return NotImplementedError(
      f"{what} is inside JAX's higher-order primitive '{name}', where "
      f"jax_effects cannot order it: {reason}. Move the effect out of it "
      f"(compute the values there and print, log or call back after it).")


# --- top level ---------------------------------------------------------------

#: JAX's own primitives that call the host and fail their execution when the
#: host function raises (left to JAX by the pass).
_MAY_FAIL = ("pure_callback", "ffi_call", "custom_call")
#: JAX's own primitives that run the user's function on the host.
_USER_CODE = ("debug_callback", "io_callback", "pure_callback")


def host_calls(jaxpr) -> tuple[bool, bool]:
  """``(may_fail, user_code)``: whether ``jaxpr`` (or a sub-jaxpr) runs one
  of :data:`_MAY_FAIL`, so its computation may fail as a whole
  (``ThreadTokens.tokens_for``), and whether it runs the user's own
  function on the host, which may dispatch or block, so its call waits for
  the computation (``launch_lock.finish``). One walk of the equations."""
  fail = user = False
  for eqn in jaxpr.eqns:
    name, params = eqn.primitive.name, eqn.params
    if not fail and (name in _MAY_FAIL or (
        name == "debug_callback" and params.get("partitioned"))):
      fail = True
    if not user and (name in _USER_CODE or getattr(
        params.get("host_callback"), "user_code", False)):
      user = True
    if fail and user:
      break
    for sub in _compat.jaxprs_in_params(params):
      sub_fail, sub_user = host_calls(sub)
      fail, user = fail or sub_fail, user or sub_user
  return fail, user


def _shard_map_chain_keys(jaxpr, mode: str) -> set:
  """The chain keys with an effect inside a ``shard_map`` (per device)
  anywhere in ``jaxpr``."""
  keys = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive is _compat.shard_map_p:
      keys.update(_effects.chain_keys(eqn.effects, mode))
    elif ((eqn.effects and _effects.has_chain(eqn.effects))
          or eqn.primitive.name in _effect.HIDES_EFFECTS):
      for sub in _compat.jaxprs_in_params(eqn.params):
        keys |= _shard_map_chain_keys(sub, mode)
  return keys


def thread_program(closed: jcore.ClosedJaxpr, args: Sequence[Any],
                  runtime_tokens: dict, mode: str, stretches: bool = False):
  """Threads a whole program; returns ``(outs, token)``: ``token`` (None:
  nothing to combine) is ready once every effect of it has run.
  ``runtime_tokens``: ordered chain key -> runtime-token argument;
  ``stretches``: long runs of unchanged equations staged as one
  (``jaxpr_eval.STRETCH``)."""
  shard_map_chains = _shard_map_chain_keys(closed.jaxpr, mode)
  # Each chain enters advanced to this execution's identity; one with no
  # per-device effect here takes a per-device token as one scalar first
  # (``design/placement.md``).
  runtime_tokens = {
      k: _token_value.advance(t if jnp.ndim(t) == 0 or k in shard_map_chains
                              else jnp.max(t))
      for k, t in runtime_tokens.items()}
  chains = Chains(runtime_tokens, entered=True)
  outs = _thread_whole(closed, args, chains, mode, shard_map_chains,
                       stretches=stretches)
  # (Counters end here.)
  carriers = {k: c for k, c in chains.carriers.items() if _effects.crosses_dispatch(k)}
  finals = list(carriers.values())
  if any(jnp.shape(c) for c in finals):
    # A per-device token: a chain whose last effect ran once gives its
    # carrier to every device's element, but only where it has per-device
    # effects here (``design/placement.md``).
    finals = [c if jnp.shape(c) or chains.still_entered(k) or k not in shard_map_chains
              else _threaded.from_first_device_p.bind(c)
              for k, c in carriers.items()]
  return outs, _final_token(finals)


def thread_region(closed: jcore.ClosedJaxpr, args: Sequence[Any],
                  carrier, mode: str):
  """Threads a region lowered under plain ``jax.jit``
  (``control_flow_rules``), every chain entering with ``carrier``; returns
  ``(outs, token)`` as :func:`thread_program` does. Its counters stay on
  the host, where the program around the region keeps them (``counter``'s
  fallback)."""
  shard_map_chains = _shard_map_chain_keys(closed.jaxpr, mode)
  keys = _effects.chain_keys(closed.effects, mode)
  chains = Chains({k: carrier for k in keys if _effects.crosses_dispatch(k)},
                  entered=True)
  outs = _thread_whole(closed, args, chains, mode, shard_map_chains, region=True)
  return outs, _final_token([jnp.max(c) if jnp.shape(c) else c
                             for k, c in chains.carriers.items() if _effects.crosses_dispatch(k)])


def _thread_whole(closed, args, chains: Chains, mode: str, shard_map_chains: set,
                  region: bool = False, stretches: bool = False) -> list:
  """Threads the whole of ``closed``, no stage in force, the pass told
  which chains have per-device effects; a ``region`` (:func:`thread_region`)
  at the top, its counters on the host."""
  c = _context
  saved = c.kind, c.masks, c.shard_map_chains, c.host_counters, c.stretches
  c.shard_map_chains, c.stretches = shard_map_chains, stretches
  if region:
    c.kind, c.masks, c.host_counters = "top", (), True
  try:
    with _no_stages():
      return thread_jaxpr(closed.jaxpr, closed.consts, args, chains, mode)
  finally:
    c.kind, c.masks, c.shard_map_chains, c.host_counters, c.stretches = saved


def _final_token(finals: list):
  """The token returned: of the chains' final carriers, the latest
  identity, with ``FAILED`` if any has it. Compared without ``FAILED``, or
  the devices' tokens could name different executions (fault model seed
  5235)."""
  if not finals:
    return None
  if len(finals) == 1:
    return finals[0]
  ids = [c & _token_value.ID_MASK for c in finals]
  failed = functools.reduce(jnp.bitwise_or, [c & _token_value.FAILED for c in finals])
  return functools.reduce(jnp.maximum, ids) | failed

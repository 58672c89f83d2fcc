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
:func:`register_rule` under each rule's definition (in
``_pass.control_flow_rules`` and ``_pass.shard_map_rule``). A rule gets the equation, its input values, the chains
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

from jax import lax
from jax.extend import core as jex_core
import jax.numpy as jnp

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._core import jaxpr_eval as _jaxpr_eval
from jax_effects._pass import adopted as _adopted
from jax_effects._primitives import counter as _counters
from jax_effects._primitives import effect as _effect
from jax_effects._primitives import first_device as _first_device
from jax_effects._primitives import threaded as _threaded
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import markers as _markers
from jax_effects._runtime import token_value as _token_value

#: A rule: ``rule(eqn, invals, chains, mode) -> outputs`` (see the docstring).
Rule = Callable[..., Sequence[Any]]
#: Primitive -> rule; add to it only through :func:`register_rule`.
RULES: dict[jex_core.Primitive, Rule] = {}


def register_rule(primitive: jex_core.Primitive, rule: Rule) -> None:
  """Makes the pass thread chains through ``primitive`` with ``rule``.

  ``rule(eqn, invals, chains, mode)`` must bind the equation's computation
  into the current trace with every effect inside linked to its chain
  (``chains.take``/``chains.put`` the carriers of the chain keys it uses,
  ``_core.effects.chain_keys`` of ``eqn.effects``; :func:`region` runs a
  sub-jaxpr threaded) and return the equation's outputs.
  """
  RULES[primitive] = rule


class Chains:
  """Current compiler token and carrier of each chain, during the pass.

  At the top level a chain's carrier starts as its runtime token advanced
  to this execution (``_runtime.token_value.advance``: the next sequence
  number, an earlier execution's ``FAILED`` bit cleared), see
  :func:`thread_program`; an unordered chain starts from zero.
  ``entered``: those top-level carriers, while no effect has replaced them
  (the same on every device).
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
    self.shard_map_chains: set | None = None


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




# --- the interpreter -----------------------------------------------------------

def thread_jaxpr(jaxpr: jex_core.Jaxpr, consts: Sequence[Any],
                 args: Sequence[Any], chains: Chains, mode: str) -> list:
  """Evaluates ``jaxpr`` in the current trace, threading ``chains``."""
  def handle(eqn, invals):
    if eqn.primitive is _effect.effect_p:
      return _thread_effect(eqn, invals, chains, mode)
    if eqn.primitive in _adopted.PRIMITIVES:
      host_callback = _adopted.adopt(eqn)
      if host_callback is not None:   # JAX's own callback: threaded like ours
        (key,) = _effects.chain_keys(eqn.effects, mode)
        return _bind_threaded(key, host_callback, invals, chains)
    effects = eqn.effects
    if (effects and _effects.has_chain(effects) and (
        eqn.primitive in RULES or _effects.has_own_marker(effects)
        or eqn.primitive.name in _compat.FEATURE_OF_PRIMITIVE)) or (
        eqn.primitive.name in HIDES_EFFECTS and _markers.effects_inside(eqn)):
      rule = RULES.get(eqn.primitive)
      if rule is None:
        raise refusal(eqn)
      return rule(eqn, invals, chains, mode)
    return _jaxpr_eval.rebind(eqn, invals)
  return _jaxpr_eval.eval_jaxpr(jaxpr, consts, args, handle, unchanged)


def unchanged(eqn) -> bool:
  """Whether the pass re-emits ``eqn`` as it is (no effect of a chain in
  it, nothing a rule or a refusal looks at): it is copied, not re-traced."""
  effects = eqn.effects
  return not (
      eqn.primitive is _effect.effect_p
      or eqn.primitive in _adopted.PRIMITIVES
      or (effects and _effects.has_chain(effects))
      or eqn.primitive.name in HIDES_EFFECTS)


def _thread_effect(eqn, invals, chains: Chains, mode: str):
  (key,) = _effects.chain_keys(eqn.effects, mode)
  host_callback = eqn.params["host_callback"]
  if host_callback.traced_in_branch and _context.kind != "branch":
    raise _effect.branch_vmapped_error(host_callback)
  if _context.masks and not host_callback.batch_once:
    host_callback, masks = _host_callback.masked(host_callback, _context.masks)
    invals = [*masks, *invals]
  return _bind_threaded(key, host_callback, invals, chains)


def _bind_threaded(key, host_callback, invals, chains: Chains):
  """One ``threaded_effect_p`` on chain ``key``; returns its results."""
  token = chains.tokens.get(key)
  if token is None:
    token = lax.create_token()
  # (what the host keeps is named by it)
  host_callback = _host_callback.on_chain(host_callback, key)
  carrier = chains.carrier(key)
  shape = jnp.shape(carrier)
  if shape:
    # The per-device carriers of a shard_map (one per device) meet an effect
    # that runs once, on one device: it follows every device's effects. The
    # callback takes their max, a scalar, so XLA need not move the sharded
    # vector whole to the callback's device and back ("[SPMD] Involuntary
    # full rematerialization", a warning JAX's program does not get).
    carrier = jnp.max(carrier)
  token, carrier, *results = _threaded.threaded_effect_p.bind(
      token, carrier, *invals, host_callback=host_callback, entry=False,
      ordered=key is not _effects.UNORDERED)
  if shape:
    # The chain stays per device (a loop's carry must keep its type; at the
    # top level the token stays one element per device, so the deterministic
    # view releases at its combination): every element is the effect's
    # carrier, from the device that ran it (the others' copies are stale, see
    # first_device.on_first_device), so each device's later effects, in this
    # execution or the next, follow this one. Only here, where an effect that
    # runs once meets per-device ones, do the devices wait for a callback.
    # A chain with no per-device effect in the program keeps device 0's copy
    # in device 0's element (the others are stale, never read: its next once
    # effect takes the max of the elements), with no collective in which
    # every device would wait for this callback.
    if _context.shard_map_chains is None or key in _context.shard_map_chains:
      carrier = _first_device.from_first_device_p.bind(carrier)
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
    with in_region(kind):
      outs = thread_jaxpr(jaxpr, jaxpr_consts, [*consts, *args], chains, mode)
    return chains.take(keys), outs
  return fn


def _counter_rule(eqn, invals, chains: Chains, mode: str):
  """``counter_p``: the count is the counter chain's carrier
  (``_primitives/counter.py``).

  A set keeps the type of the count it replaces (``count * 0 + x``: inside
  ``shard_map`` the carrier varies over the manual axes, and a loop's carry
  must keep its type).
  """
  del mode
  counter, op = eqn.params["counter"], eqn.params["op"]
  (x,) = invals
  count = chains.carrier(counter)
  count = count * 0 + x if op == "set" else count + x
  chains.carriers[counter] = count
  return count


register_rule(_counters.counter_p, _counter_rule)


HIDES_EFFECTS = _markers.HIDES_EFFECTS

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
  what = _markers.first_effect(eqn)
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


# --- top level -----------------------------------------------------------------

#: JAX's own primitives that call the host and fail their execution when the
#: host function raises (left to JAX by the pass: ``jax.pure_callback``, a
#: ``jax.debug.callback(partitioned=True)``, a user's FFI call). A program
#: with one may fail as a whole while the next is dispatched
#: (``_runtime.threads.ThreadTokens.tokens_for``).
_MAY_FAIL = ("pure_callback", "ffi_call", "custom_call")


def may_fail(jaxpr) -> bool:
  """Whether ``jaxpr`` (or a sub-jaxpr) runs one of JAX's own host calls
  that fail their execution when they raise (:data:`_MAY_FAIL`)."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in _MAY_FAIL or (name == "debug_callback"
                             and eqn.params.get("partitioned")):
      return True
    for sub in _compat.jaxprs_in_params(eqn.params):
      if may_fail(sub):
        return True
  return False


#: JAX's own primitives that run the user's function on the host (adopted
#: by the pass or left to JAX): see :func:`runs_user_code`.
_USER_CODE = ("debug_callback", "io_callback", "pure_callback")


def runs_user_code(jaxpr) -> bool:
  """Whether ``jaxpr`` (or a sub-jaxpr) runs the user's own function on the
  host (``HostCallback.user_code``: ``callback``, or JAX's
  ``jax.debug.callback``/``io_callback``/``pure_callback``), which may
  dispatch JAX computations or block: its call waits for the computation
  (``_runtime.launch_lock.finish``)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _USER_CODE:
      return True
    host_callback = eqn.params.get("host_callback")
    if getattr(host_callback, "user_code", False):
      return True
    for sub in _compat.jaxprs_in_params(eqn.params):
      if runs_user_code(sub):
        return True
  return False


def _shard_map_chain_keys(jaxpr, mode: str) -> set:
  """The chain keys with an effect inside a ``shard_map`` (per device)
  anywhere in ``jaxpr``."""
  keys = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive is _compat.shard_map_p:
      keys.update(_effects.chain_keys(eqn.effects, mode))
    elif ((eqn.effects and _effects.has_chain(eqn.effects))
          or eqn.primitive.name in HIDES_EFFECTS):
      for sub in _compat.jaxprs_in_params(eqn.params):
        keys |= _shard_map_chain_keys(sub, mode)
  return keys


def thread_program(closed: jex_core.ClosedJaxpr, args: Sequence[Any],
                  runtime_tokens: dict, mode: str):
  """Threads a whole program; returns ``(outs, token)``.

  ``runtime_tokens`` maps each ordered chain key to its runtime-token argument
  (the initial carrier). ``token`` combines every chain's final carrier (and
  every runtime-token argument): it is ready only once every side effect of
  this computation has run. It is None when there is nothing to combine.
  """
  shard_map_chains = _shard_map_chain_keys(closed.jaxpr, mode)
  # A chain with no per-device effect here whose runtime token comes per
  # device (another chain's shard_map made it so) takes it as one scalar
  # first: one all-reduce as the execution starts, before any of its
  # callbacks, instead of a vector carried through its loops (reduced around
  # every once effect there: an all-reduce per iteration in which every
  # device waits for the callback before it).
  # Each chain enters with its token advanced to this execution's identity
  # (_runtime.token_value: the same on every device).
  runtime_tokens = {
      k: _token_value.advance(t if jnp.ndim(t) == 0 or k in shard_map_chains
                              else jnp.max(t))
      for k, t in runtime_tokens.items()}
  chains = Chains(runtime_tokens, entered=True)
  saved, _context.shard_map_chains = _context.shard_map_chains, shard_map_chains
  try:
    outs = thread_jaxpr(closed.jaxpr, closed.consts, args, chains, mode)
  finally:
    _context.shard_map_chains = saved
  # (Chains that stay in the computation, counters, end here: their last
  # values are dropped.)
  carriers = {k: c for k, c in chains.carriers.items()
              if _effects.crosses_dispatch(k)}
  finals = list(carriers.values())
  # (A chain that went through shard_map ends as a per-device vector, see
  # _shard_map_rule: the token is then that vector, no collective needed.)
  # A chain whose effect failed ends with the FAILED bit (its later effects
  # were skipped) and so may the token: the next computation's advance
  # clears it; the error itself is reported by the dispatching thread
  # (design/errors.md).
  if any(jnp.shape(c) for c in finals):
    # A per-device token: a chain whose last effect ran once contributes the
    # carrier of the device that ran it to every device's element (the
    # others' copies are stale, see first_device.on_first_device; a runtime
    # token no effect took is the same everywhere), so that the next call's
    # per-device effects of that chain follow it. A chain with no per-device
    # effect in this program keeps its scalar: device 0's element holds its
    # real carrier, which is what its next once effect (the max of the
    # elements) and the combination for any other computation read; a
    # broadcast would make every device wait for that chain's callbacks at
    # the end of the execution, for no effect of theirs.
    finals = [c if jnp.shape(c) or chains.still_entered(k) or k not in shard_map_chains
              else _first_device.from_first_device_p.bind(c)
              for k, c in carriers.items()]
  return outs, _final_token(finals)


def _final_token(finals: list):
  """The token returned: of the chains' final carriers, the latest
  identity (each chain has its own sequence number; the maximum takes the
  furthest), with ``FAILED`` if any has it. Compared without ``FAILED``:
  that bit is the highest but one, and would let a chain that failed on one
  device win over a later chain there only, so the devices' tokens would
  name different executions next time (fault model seed 5235: a
  summarized print's pieces never met)."""
  if not finals:
    return None
  if len(finals) == 1:
    return finals[0]
  ids = [c & _token_value.ID_MASK for c in finals]
  failed = functools.reduce(
      jnp.bitwise_or, [c & _token_value.FAILED for c in finals])
  return functools.reduce(jnp.maximum, ids) | failed

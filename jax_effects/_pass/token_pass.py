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
from jax_effects._primitives import effect as _primitives
from jax_effects._primitives import first_device as _first_device
from jax_effects._primitives import threaded as _threaded
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import markers as _markers
from jax_effects._runtime import errors as _errors

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
      c = self.carriers[key] = jnp.zeros((), _errors.TOKEN_DTYPE)
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


def chain_keys(effects, mode: str) -> tuple:
  """Chain keys of the markers in a set of JAX effects, in a stable order:
  the chains a sub-computation with these effects threads.

  JAX's own callback effects the pass adopts (``_pass.adopted``) count too,
  device-side counters (``_primitives.counter``: chains with no runtime
  token), and the calls of exported jax_effects functions (on the chain of
  DEFAULT, GLOBAL in global mode: ``_pass.exported_rule``).
  """
  keys = {_effects.chain_key(e, mode) for e in effects
          if isinstance(e, _effects.TraceEffect)}
  keys.update(_adopted.chain_key(e, mode) for e in effects
              if _adopted.is_adoptable_effect(e))
  keys.update(e.counter for e in effects if _counters.is_counter_effect(e))
  if _effects.EXPORTED_ORDER in effects:   # an exported function's call
    keys.add(_effects.GLOBAL if mode == "global" else _effects.DEFAULT)
  return tuple(sorted(keys, key=_sort_key))


def runtime_chain_keys(effects, mode: str) -> tuple:
  """The chains of :func:`chain_keys` that take a runtime token (all but the
  counters): what a program's dispatch passes and keeps."""
  return tuple(k for k in chain_keys(effects, mode)
               if not isinstance(k, _counters.Counter))


def _sort_key(key):
  return (1, "") if key is _effects.UNORDERED else (0, key.name)


def has_marker(effects) -> bool:
  """Whether the pass has work in an equation with these effects (a marker,
  or a JAX callback effect it adopts)."""
  return any(isinstance(e, _effects.TraceEffect)
             or _adopted.is_adoptable_effect(e)
             or _counters.is_counter_effect(e)
             or isinstance(e, _effects.ExportedOrder) for e in effects)


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
                                     _markers.has_own_marker(eqn.effects))) or (
        eqn.primitive.name in HIDES_EFFECTS and _markers.effects_inside(eqn)):
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
  if _context.masks and not host_callback.batch_once:
    host_callback, masks = _host_callback.masked(host_callback, _context.masks)
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
  token, carrier, *results = _threaded.threaded_effect_p.bind(
      token, carrier, *invals, host_callback=host_callback, entry=entry,
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
    if _context.per_device is None or key in _context.per_device:
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
  # (Counters end here: their last values are dropped.)
  carriers = {k: c for k, c in chains.carriers.items()
              if not isinstance(k, _counters.Counter)}
  finals = list(carriers.values())
  # (A chain that went through shard_map ends as a per-device vector, see
  # _shard_map_rule: the token is then that vector, no collective needed.)
  # A chain whose effect failed ends with the FAILED bit (its later effects
  # were skipped) and so may the token: the next computation's entries clear
  # it (Chains); the error itself is reported by the dispatching thread
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
    finals = [c if jnp.shape(c) or k in chains.entries or k not in per_device
              else _first_device.from_first_device_p.bind(c)
              for k, c in carriers.items()]
  token = functools.reduce(jnp.maximum, finals) if finals else None
  return outs, token

"""Effects: named streams of ordered side effects, and the ordering mode.

An :class:`Effect` names one *runtime-token stream*: two ordered side
effects with the same ``Effect`` happen in program order, within one
computation and across dispatches; in ``"global"`` mode every ordered
effect shares one stream (:data:`GLOBAL`). The mode is state here
(:func:`get_ordering`); switching it: ``_dispatch.modes``.

Its part of the token calling convention (``design/tokens.md``): a side
effect's equation carries a :class:`TraceEffect` marker (which JAX's
transformations keep, and the pass removes), ordered ones also
:data:`PLAIN_JIT_ORDER` for plain ``jax.jit``; which chain a JAX effect is
on is one registry of effect types (:func:`register_chain_kind`), which the
pass and the dispatch alone ask (:func:`chain_keys`,
:func:`runtime_chain_keys`, :func:`has_chain`, :func:`has_own_marker`).
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Callable, NamedTuple

import numpy as np

from jax_effects import _compat

ORDERING_MODES = ("per_effect", "global")


@functools.total_ordering
class Effect:
  """A named effect: its own runtime-token stream.

  ``Effect(name)`` is interned: the same name always gives the same object, so
  effects compare and hash by name (and sort by name) and can be created
  wherever they are used.

  >>> Effect("metrics") is Effect("metrics")
  True

  Setting: ``ordered`` (default True) is the default of the ``ordered=``
  argument of ``print``/``log``/``callback`` calls that use this effect;
  ``Effect("telemetry", ordered=False)`` names a stream of unordered effects.
  A name's settings are fixed by its first creation: ``Effect(name)`` without
  settings returns the existing effect, and creating it again with a different
  setting is a ``ValueError`` naming the effect.
  """
  __slots__ = ("name", "ordered", "__weakref__")
  name: str
  ordered: bool
  _registry: dict[str, "Effect"] = {}
  _registry_lock = threading.Lock()

  def __new__(cls, name: str, *, ordered: bool | None = None):
    if not isinstance(name, str) or not name:
      raise TypeError(f"Effect name must be a non-empty str, got {name!r}")
    if ordered is not None and not isinstance(ordered, bool):
      raise TypeError(f"Effect({name!r}): ordered= must be a bool, got {ordered!r}")
    with cls._registry_lock:
      eff = cls._registry.get(name)
      if eff is None:
        eff = object.__new__(cls)
        object.__setattr__(eff, "name", name)
        object.__setattr__(eff, "ordered", True if ordered is None else ordered)
        cls._registry[name] = eff
      elif ordered is not None and ordered != eff.ordered:
        raise ValueError(
            f"{eff!r} already exists with ordered={eff.ordered}; it cannot be "
            f"created again with ordered={ordered} (an effect name has one "
            f"setting: use another name, or Effect({name!r}) to get the "
            f"existing one)")
      return eff

  def __setattr__(self, key, value):
    raise AttributeError("Effect is immutable")

  def __reduce__(self):
    return (_make_effect, (self.name, self.ordered))

  def __repr__(self):
    if self.ordered:
      return f"Effect({self.name!r})"
    return f"Effect({self.name!r}, ordered=False)"

  def __lt__(self, other):
    if not isinstance(other, Effect):
      return NotImplemented
    return self.name < other.name


def _make_effect(name: str, ordered: bool) -> Effect:
  return Effect(name, ordered=ordered)


#: The effect of ``print``, ``log`` and ``callback`` when ``effect=None``: one
#: shared stream, so by default all of them keep program order with each other.
DEFAULT = Effect("default")
#: The single stream every ordered effect maps to in ``"global"`` mode.
GLOBAL = Effect("<global>")


class _Unordered:
  """Chain key of unordered effects: no runtime token, only the output token."""
  __slots__ = ()

  def __repr__(self):
    return "UNORDERED"


UNORDERED = _Unordered()


# --- ordering mode (state; switching waits for dispatched effects: _modes) ---

class _ModeStack(threading.local):
  # Class default: reading ``stack`` on a thread that never entered
  # ``ordering`` raises nothing (``get_ordering`` runs on every dispatch).
  stack: "list[str] | tuple" = ()
  # The process-wide mode: a class attribute, so every thread's instance
  # reads the one value (set_process_mode).
  process: str = "per_effect"


_local = _ModeStack()


def check_mode(mode: str) -> str:
  if mode not in ORDERING_MODES:
    raise ValueError(
        f"Unknown ordering mode {mode!r}; expected one of {ORDERING_MODES}")
  return mode


def get_ordering() -> str:
  """The ordering mode in effect on this thread."""
  stack = _local.stack
  return stack[-1] if stack else _local.process


def process_mode() -> str:
  """The process-wide mode (threads outside an ``ordering`` context)."""
  return _ModeStack.process


def set_process_mode(mode: str) -> None:
  """Sets the process-wide mode (``_dispatch.modes.set_ordering`` waits first)."""
  _ModeStack.process = check_mode(mode)


def push_mode(mode: str) -> None:
  """Enters ``mode`` on this thread (``_dispatch.modes.ordering``)."""
  stack = _local.stack
  if isinstance(stack, tuple):  # the class default: this thread's first use
    stack = _local.stack = []
  stack.append(check_mode(mode))


def pop_mode() -> None:
  _local.stack.pop()


# --- resolving a call's settings ---------------------------------------------

def resolve(what: str, effect, ordered) -> tuple[Effect, bool]:
  """``(effect, ordered)`` of a ``print``/``log``/``callback`` call.

  ``effect=None`` is :data:`DEFAULT`; ``ordered=None`` takes the effect's
  setting (``Effect.ordered``). Resolved once, when the call is traced;
  errors name the call (``what``).
  """
  if effect is None:
    effect = DEFAULT
  elif not isinstance(effect, Effect):
    raise TypeError(
        f"{what}: effect= must be a jax_effects.Effect or None, got {effect!r}")
  if ordered is None:
    ordered = effect.ordered
  elif not isinstance(ordered, (bool, np.bool_)):
    raise TypeError(
        f"{what}: ordered= must be a bool (or None for the effect's setting), "
        f"got {ordered!r}")
  return effect, bool(ordered)


# --- trace-time marker -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TraceEffect(_compat.Effect):
  """JAX-level marker on a side-effect equation before token threading.

  ``effect`` is the user's :class:`Effect` for an ordered side effect, or None
  for an unordered one (see :func:`marker`).
  """
  effect: Effect | None

  def __str__(self):
    return f"jax_effects[{self.effect.name if self.effect else 'unordered'}]"


@dataclasses.dataclass(frozen=True)
class PlainJitOrder(_compat.Effect):
  """A JAX *ordered* effect carried by every ordered side effect (one
  value), for code that ends up under plain ``jax.jit`` (or JAX's eager
  ``cond``/``while``/``scan``): JAX's own tokens order them there. The pass
  removes it with the equation."""

  def __str__(self):
    return "jax_effects[plain jax.jit order]"


PLAIN_JIT_ORDER = PlainJitOrder()


@dataclasses.dataclass(frozen=True)
class ExportedOrder(_compat.Effect):
  """The JAX *ordered* effect of a ``jax_effects.jit`` function exported
  with ``jax.export`` (one value; ``_dispatch.function``,
  ``_pass.control_flow_rules``). Serialized by its class's name: part of the
  exported format (``design/host_target.md``).
  """

  def __str__(self):
    return "jax_effects[exported]"


EXPORTED_ORDER = ExportedOrder()


def marker(effect: Effect, ordered: bool) -> TraceEffect:
  """The marker of an effect equation (equal settings give equal markers)."""
  return TraceEffect(effect if ordered else None)


def jax_effects_of(effect: Effect, ordered: bool, user_code: bool = False) -> set:
  """The JAX effects of an effect equation: its marker, and
  PLAIN_JIT_ORDER if ordered or if it runs the user's own code (under
  plain ``jax.jit`` its launch then waits for the thread's previous one,
  as ``jax_effects.jit`` waits: ``design/errors.md``, "No unbounded
  wait"). A ``while`` holding ours is lowered by
  ``_pass.control_flow_rules``, never by JAX's rule, which ignores a
  vmap-batched predicate where a ``cond_fun`` has ordered effects."""
  if ordered or user_code:
    return {marker(effect, ordered), PLAIN_JIT_ORDER}
  return {marker(effect, ordered)}


_compat.allow_effect_types(TraceEffect)
# Under grad, an effect in a scan body runs once per iteration, even with no
# operand that changes from one iteration to the next.
_compat.keep_effects_in_loops(TraceEffect)
# Ordered, shardable: on several devices JAX orders them like its own
# ordered io_callback (once per program point, on the first device).
_compat.allow_effect_types(PlainJitOrder, ExportedOrder, ordered=True)


# --- which chain a JAX effect is on: one registry (``design/tokens.md``) ---

class ChainKind(NamedTuple):
  """How an effect type joins a chain (see :func:`register_chain_kind`)."""
  key: Callable   # key(effect, mode) -> its chain key
  own_marker: bool


#: Effect type -> its ChainKind; add to it only through register_chain_kind.
_chain_kinds: dict[type, ChainKind] = {}
#: Types of the chain keys whose chains stay in one computation.
_local_key_types: set[type] = set()


def register_chain_kind(effect_type: type, key: Callable, *,
                        own_marker: bool = False,
                        local_key_type: type | None = None) -> None:
  """Makes an equation whose effects hold an ``effect_type`` join the chain
  ``key(effect, mode)`` (``mode``: the ordering mode). Matched by exact
  type (one dict lookup per effect; a subclass registers itself).

  ``own_marker``: the effect is the marker of a ``jax_effects`` side effect
  (:func:`has_own_marker`): the pass threads an equation holding it or
  refuses it, never leaves it to JAX. ``local_key_type``: the type of the
  keys ``key`` returns if their chains stay in one computation (no runtime
  token, not in the token it returns: :func:`crosses_dispatch`).
  """
  _chain_kinds[effect_type] = ChainKind(key, own_marker)
  if local_key_type is not None:
    _local_key_types.add(local_key_type)


def chain_key(effect, mode: str):
  """The chain key of a registered effect (a marker: :func:`marker`) under
  ordering ``mode``."""
  return _chain_kinds[type(effect)].key(effect, mode)


def _sort_key(key):
  return (1, "") if key is UNORDERED else (0, key.name)


def chain_keys(effects, mode: str) -> tuple:
  """The chain keys of a set of JAX effects, in a stable order: the chains a
  (sub-)computation with these effects threads."""
  kinds = _chain_kinds
  keys = {kinds[type(e)].key(e, mode) for e in effects if type(e) in kinds}
  return tuple(sorted(keys, key=_sort_key))


def crosses_dispatch(key) -> bool:
  """Whether the chain ``key`` crosses dispatches (a runtime token, or the
  output token for UNORDERED): all but the chains that stay in one
  computation (device-side counters)."""
  return type(key) not in _local_key_types


def runtime_chain_keys(effects, mode: str) -> tuple:
  """The chains of :func:`chain_keys` that cross dispatches: what a
  program's dispatch passes and keeps."""
  return tuple(k for k in chain_keys(effects, mode) if crosses_dispatch(k))


def has_chain(effects) -> bool:
  """Whether an equation with these effects joins a chain (the pass has
  work in it)."""
  kinds = _chain_kinds
  return any(type(e) in kinds for e in effects)


def has_own_marker(effects) -> bool:
  """Whether a set of JAX effects holds the marker of a ``jax_effects``
  side effect (a :class:`TraceEffect`)."""
  kinds = _chain_kinds
  return any(type(e) in kinds and kinds[type(e)].own_marker for e in effects)


def _trace_effect_key(trace_effect: TraceEffect, mode: str):
  if trace_effect.effect is None:
    return UNORDERED
  return GLOBAL if mode == "global" else trace_effect.effect


register_chain_kind(TraceEffect, _trace_effect_key, own_marker=True)

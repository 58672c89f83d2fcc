"""Effects: named streams of ordered side effects, and the ordering mode.

An :class:`Effect` names one *runtime-token stream*. Two ordered side effects
with the same ``Effect`` happen in program order, within one computation (a
compiler-token chain) and across dispatches (a runtime token per thread).
Side effects with different effects are not ordered relative to each other,
unless the ordering mode is ``"global"``, where every ordered effect shares one
stream (:data:`GLOBAL`) and so one total order.

Inside a trace, every side-effect primitive carries a :class:`TraceEffect`, a
JAX-level effect that tells JAX's transformations to keep the equation (no
dead-code elimination, no duplication under remat). It is not one of JAX's
*ordered* effects, so JAX's own runtime tokens never get involved. The
token-threading pass (``_thread_tokens``) reads these markers to learn which
streams a sub-computation touches and then removes them: after the pass, JAX
sees an effect-free function.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator

import jax.extend.core as jex_core

from jax_effects import _compat

__all__ = ["Effect", "DEFAULT", "GLOBAL", "UNORDERED", "ordering",
           "set_ordering", "get_ordering", "TraceEffect", "chain_key"]

ORDERING_MODES = ("per_effect", "global")


class Effect:
  """A named effect: its own runtime-token stream.

  ``Effect(name)`` is interned: the same name always gives the same object, so
  effects compare and hash by name and can be created wherever they are used.

  >>> Effect("metrics") is Effect("metrics")
  True
  """
  __slots__ = ("name", "__weakref__")
  _registry: dict[str, "Effect"] = {}
  _registry_lock = threading.Lock()

  def __new__(cls, name: str):
    if not isinstance(name, str) or not name:
      raise TypeError(f"Effect name must be a non-empty str, got {name!r}")
    with cls._registry_lock:
      eff = cls._registry.get(name)
      if eff is None:
        eff = object.__new__(cls)
        object.__setattr__(eff, "name", name)
        cls._registry[name] = eff
      return eff

  def __setattr__(self, key, value):
    raise AttributeError("Effect is immutable")

  def __reduce__(self):
    return (Effect, (self.name,))

  def __repr__(self):
    return f"Effect({self.name!r})"

  def __lt__(self, other):
    if not isinstance(other, Effect):
      return NotImplemented
    return self.name < other.name


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


# --- ordering mode -----------------------------------------------------------

_process_mode = "per_effect"
_local = threading.local()


def _check_mode(mode: str) -> str:
  if mode not in ORDERING_MODES:
    raise ValueError(
        f"Unknown ordering mode {mode!r}; expected one of {ORDERING_MODES}")
  return mode


def set_ordering(mode: str) -> None:
  """Sets the process-wide ordering mode (``"per_effect"`` or ``"global"``)."""
  global _process_mode
  _process_mode = _check_mode(mode)


def get_ordering() -> str:
  """The ordering mode in effect on this thread."""
  stack = getattr(_local, "stack", None)
  return stack[-1] if stack else _process_mode


@contextlib.contextmanager
def ordering(mode: str) -> Iterator[None]:
  """Context manager selecting the ordering mode on this thread.

  ``"per_effect"``: one runtime token per :class:`Effect`. ``"global"``: all
  ordered effects share one token (:data:`GLOBAL`), giving one total order.
  """
  _check_mode(mode)
  stack = getattr(_local, "stack", None)
  if stack is None:
    stack = _local.stack = []
  stack.append(mode)
  try:
    yield
  finally:
    stack.pop()


# --- trace-time marker --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TraceEffect(jex_core.Effect):
  """JAX-level marker on a side-effect equation before token threading.

  ``effect`` is the user's :class:`Effect` for an ordered side effect, or None
  for an unordered one.
  """
  effect: Effect | None

  def __str__(self):
    return f"jax_effects[{self.effect.name if self.effect else 'unordered'}]"


for _registry in (_compat.control_flow_allowed_effects,
                  _compat.custom_derivatives_allowed_effects,
                  _compat.remat_allowed_effects,
                  _compat.partial_eval_kept_effects,
                  _compat.lowerable_effects):
  _registry.add_type(TraceEffect)


def chain_key(trace_effect: TraceEffect, mode: str):
  """The compiler-token chain (and runtime-token stream) of a marker."""
  if trace_effect.effect is None:
    return UNORDERED
  return GLOBAL if mode == "global" else trace_effect.effect

"""Which equations of a jaxpr hold ``jax_effects`` effects, and which ones.

The questions both jaxpr walkers (``_pass.token_pass`` and
``control_flow_batching``) ask of an equation, answered once. No part of
the token calling convention: the walkers add it.
"""
from __future__ import annotations

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._primitives import effect as _effect

#: Higher-order primitives whose equation does not report the effects of
#: its sub-computations: the walkers look inside. (Names: ``pallas_call``
#: lives in a module jax_effects does not import.)
HIDES_EFFECTS = frozenset({
    "composite", "linear_call", "reduce", "reduce_window", "pallas_call"})


def effects_inside(eqn) -> list[str]:
  """The descriptions of the effects in ``eqn``'s sub-computations."""
  found: list[str] = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive is _effect.effect_p:
        found.append(e.params["host_callback"].description)
      for sub in _compat.jaxprs_in_params(e.params):
        walk(sub)
  for sub in _compat.jaxprs_in_params(eqn.params):
    walk(sub)
  return found


def holds_effect(eqn) -> bool:
  """Whether ``eqn`` holds an effect of ours (maybe hidden inside)."""
  return _effects.has_own_marker(eqn.effects) or (
      eqn.primitive.name in HIDES_EFFECTS and bool(effects_inside(eqn)))


def first_effect(eqn) -> str:
  """The description of the first effect inside ``eqn`` (for errors)."""
  inside = effects_inside(eqn)
  return inside[0] if inside else "a jax_effects side effect"

"""Which equations of a jaxpr hold ``jax_effects`` effects, and which ones.

Both jaxpr walkers (the token-threading pass, ``_pass.token_pass``, and the
masking of effects in a vmapped ``cond`` branch,
``control_flow_batching``) ask the same questions of an equation: does it
hide the effects of its sub-computations (:data:`HIDES_EFFECTS`), does it
hold an effect of ours (its own effects carry our marker, asked of the
registry of chain kinds, ``_core.effects.has_own_marker``, or one is hidden
inside), and what is the first effect inside (for error messages). They are
answered here, once. No part of the token calling convention: the walkers
add it.
"""
from __future__ import annotations

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._primitives import effect as _effect

#: Names of higher-order primitives whose equation does not report the
#: effects of its sub-computations (their abstract evaluation drops them):
#: the walkers look inside. Without this, an effect in them would reach XLA
#: unthreaded (or unmasked). Names: ``pallas_call`` lives in a module
#: jax_effects does not import.
HIDES_EFFECTS = frozenset({
    "composite", "linear_call", "reduce", "reduce_window", "pallas_call"})

#: What :func:`first_effect` says when no effect of ours is found.
SOME_EFFECT = "a jax_effects side effect"


def effects_inside(eqn) -> list[str]:
  """The descriptions of the ``jax_effects`` effects in ``eqn``'s
  sub-computations, at any depth, in program order."""
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
  """Whether ``eqn`` holds an effect of ours: its effects say so, or it
  hides its sub-computations' effects and one is inside."""
  return _effects.has_own_marker(eqn.effects) or (
      eqn.primitive.name in HIDES_EFFECTS and bool(effects_inside(eqn)))


def first_effect(eqn) -> str:
  """The description of the first effect inside ``eqn`` (for errors)."""
  inside = effects_inside(eqn)
  return inside[0] if inside else SOME_EFFECT

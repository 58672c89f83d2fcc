"""Which chain an effect is on: one registry of effect types
(``_core.effects.register_chain_kind``; ``design/tokens.md``, "Chain keys").

Ours (``TraceEffect``), JAX's callbacks' effects that the pass adopts, and
device-side counters are answered by the same registry, and the pass and the
dispatch follow it: a kind registered again moves its equations to another
chain, inside the computation and across dispatches (the runtime token).
"""
import contextlib
import io

import jax
import jax.numpy as jnp
import pytest

import jax_effects as je
from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._primitives import counter as _counters
from helpers import in_thread


def test_one_registry_answers_for_ours_jaxs_and_counters():
  named = je.Effect("chain-kinds-named")
  counter = _counters.Counter("a test counter")
  effects = {
      _effects.marker(named, True), _effects.marker(je.DEFAULT, False),
      _compat.OrderedDebugEffect(), _compat.DebugEffect(),
      _compat.OrderedIOEffect(), _compat.IOEffect(),
      _counters.CounterEffect(counter), _effects.PLAIN_JIT_ORDER}
  # Ordered chains by name, then the counter ("~counter"), UNORDERED last.
  assert _effects.chain_keys(effects, "per_effect") == (
      named, je.DEFAULT, counter, _effects.UNORDERED)
  assert _effects.chain_keys(effects, "global") == (
      je.GLOBAL, counter, _effects.UNORDERED)
  # The counter's chain stays in its computation: no runtime token.
  assert _effects.runtime_chain_keys(effects, "global") == (
      je.GLOBAL, _effects.UNORDERED)
  assert not _effects.crosses_dispatch(counter)
  assert _effects.crosses_dispatch(named) and _effects.crosses_dispatch(
      _effects.UNORDERED)
  # JAX's adopted effects, ordered or not, join DEFAULT (GLOBAL).
  for e in (_compat.DebugEffect(), _compat.OrderedIOEffect()):
    assert _effects.chain_key(e, "per_effect") is je.DEFAULT
    assert _effects.chain_key(e, "global") is je.GLOBAL
    assert _effects.has_chain({e}) and not _effects.has_own_marker({e})
  # Only our markers must be threaded (an equation without a rule holding
  # one is refused, never left to JAX); PLAIN_JIT_ORDER is on no chain.
  assert _effects.has_own_marker({_effects.marker(named, True)})
  assert not _effects.has_own_marker({_counters.CounterEffect(counter)})
  assert not _effects.has_chain({_effects.PLAIN_JIT_ORDER})
  assert _effects.chain_keys({_effects.PLAIN_JIT_ORDER}, "per_effect") == ()


def test_the_pass_and_the_dispatch_follow_the_registry(monkeypatch):
  """JAX's unordered ``jax.debug.print`` (``DebugEffect``) registered onto
  another chain than DEFAULT: the pass threads it on a chain of its own (a
  compiler token created for it beside DEFAULT's) and the dispatch passes
  and keeps that chain's runtime token."""
  moved = je.Effect("chain-kinds-jax-prints")
  kinds = _effects._chain_kinds
  monkeypatch.setitem(kinds, _compat.DebugEffect, kinds[_compat.DebugEffect])
  _effects.register_chain_kind(
      _compat.DebugEffect,
      lambda effect, mode: je.GLOBAL if mode == "global" else moved)

  @je.jit
  def f(x):
    je.print("ours {}", x)
    jax.debug.print("jax {}", x)
    return x + 1

  text = f.lower(jnp.int32(1)).as_text()
  assert text.count("stablehlo.create_token") == 2   # DEFAULT's and moved's

  def run():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      f(jnp.int32(1))
      je.effects_barrier()
    return out.getvalue(), set(je.runtime_tokens().effects)

  printed, keys = in_thread(run)
  # (two chains: no order between them)
  assert sorted(printed.splitlines()) == ["jax 1", "ours 1"]
  assert keys == {je.DEFAULT, moved}


def test_a_counters_chain_stays_in_its_computation():
  """A counter (registered with its key type as local) gets no runtime
  token: it starts at 0 in every execution and is not among the thread's
  tokens afterwards."""
  counter = _counters.Counter("a test counter")

  @je.jit
  def f(x):
    je.print("count {}", _counters.add_count(counter, 2))
    return x

  def run():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      f(jnp.int32(1))
      f(jnp.int32(1))
      je.effects_barrier()
    return out.getvalue(), set(je.runtime_tokens().effects)

  assert in_thread(run) == ("count 2\ncount 2\n", {je.DEFAULT})


def test_a_kind_registered_as_own_marker_is_refused_without_a_rule(
    monkeypatch):
  """An equation holding an own marker and no rule is refused (naming the
  primitive), one holding another registered kind is left to JAX: the pass
  asks the registry which is which."""
  kinds = _effects._chain_kinds
  monkeypatch.setitem(kinds, _compat.DebugEffect, kinds[_compat.DebugEffect])
  _effects.register_chain_kind(
      _compat.DebugEffect, lambda effect, mode: je.DEFAULT, own_marker=True)

  def g(x):   # partitioned=True: not adopted, an equation left to JAX ...
    jax.debug.callback(lambda v: None, x, partitioned=True)
    return x

  # ... unless its effect is registered as an own marker.
  with pytest.raises(NotImplementedError, match="debug_callback"):
    je.jit(g)(jnp.int32(1))

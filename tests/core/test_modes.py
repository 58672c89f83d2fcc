"""Named effects, ordering modes ("per_effect" / "global") and unordered
effects (``design/transformations.md``: "Named effects", "Ordering modes",
"Unordered effects (``ordered=False``)"; switching modes: ``design/errors.md``,
"Mode switches").

Runtime-token assertions run in a fresh thread (``in_thread``): runtime tokens
are thread-local, so a new thread starts with none and sees exactly the
streams its own calls used.
"""
import pickle
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_effects as je
import helpers
from helpers import in_thread


def _effect_keys(fn, *args):
  def go():
    fn(*args)
    je.effects_barrier()
    return set(je.runtime_tokens().effects)
  return in_thread(go)


# --- Effect --------------------------------------------------------------------

def test_effect_identity_order_repr_and_pickle():
  a, b = je.Effect("modes-a"), je.Effect("modes-b")
  assert a is je.Effect("modes-a") and a == je.Effect("modes-a") and a != b
  assert {a: 1}[je.Effect("modes-a")] == 1
  assert a < b and b > a and a <= a and sorted([b, a]) == [a, b]
  assert repr(a) == "Effect('modes-a')" and a.ordered
  assert pickle.loads(pickle.dumps(a)) is a
  u = je.Effect("modes-unordered", ordered=False)
  assert repr(u) == "Effect('modes-unordered', ordered=False)"
  assert pickle.loads(pickle.dumps(u)) is u
  assert je.Effect("modes-unordered") is u    # no setting: the existing one


def test_effect_name_reused_with_conflicting_setting_is_an_error():
  je.Effect("modes-conflict", ordered=False)
  with pytest.raises(ValueError, match=r"Effect\('modes-conflict', ordered=False\)"
                                       r" already exists with ordered=False"):
    je.Effect("modes-conflict", ordered=True)
  je.Effect("modes-conflict2")
  with pytest.raises(ValueError, match="'modes-conflict2'.*ordered=True"):
    je.Effect("modes-conflict2", ordered=False)
  with pytest.raises(TypeError, match="ordered= must be a bool"):
    je.Effect("modes-conflict3", ordered="yes")


def test_print_log_and_callback_default_to_the_default_effect():
  @je.jit
  def f(x):
    je.print("{}", x)
    je.callback(lambda v: None, None, x)
    return x

  assert _effect_keys(f, 1) == {je.DEFAULT}


def test_default_effect_keeps_print_and_callback_in_program_order(effects_capture):
  seen = []

  @je.jit
  def f(x):
    je.print("p{}", x)
    je.callback(lambda v: seen.append(("cb", int(v), list(effects_capture._printed))),
                None, x)
    je.print("q{}", x)
    return x

  f(1)
  je.effects_barrier()
  assert seen == [("cb", 1, ["p1"])]
  assert effects_capture.printed == ["p1", "q1"]


def test_named_effects_are_separate_streams():
  a, b = je.Effect("modes-s-a"), je.Effect("modes-s-b")

  @je.jit
  def f(x):
    je.print("{}", x, effect=a)
    je.print("{}", x, effect=b)
    return x

  assert _effect_keys(f, 1) == {a, b}


# --- ordering modes -------------------------------------------------------------

def _two_effects():
  return helpers.two_effects("modes-g")


def test_global_mode_uses_one_runtime_token(effects_capture):
  f, a, b = _two_effects()

  def go():
    with je.ordering("global"):
      assert je.get_ordering() == "global"
      f(1)
    assert je.get_ordering() == "per_effect"
    return set(je.runtime_tokens().effects)

  assert in_thread(go) == {je.GLOBAL}
  assert effects_capture.printed == ["a1", "b1"]


def test_compiled_function_caches_respect_the_mode():
  f, a, b = _two_effects()

  def go():
    f(1)
    k1 = set(je.runtime_tokens().effects)
    with je.ordering("global"):
      f(2)
      text_global = f.lower(2).as_text()
    k2 = set(je.runtime_tokens().effects)
    f(3)
    text_per_effect = f.lower(3).as_text()
    return k1, k2, text_global, text_per_effect

  k1, k2, text_global, text_per_effect = in_thread(go)
  assert k1 == {a, b}
  assert k2 == {a, b, je.GLOBAL}
  # global: one runtime-token argument; per effect: one per effect
  assert text_global != text_per_effect
  assert len(f.keys["global"]) == 1 and len(f.keys["per_effect"]) == 2


def test_ordering_is_per_thread_for_concurrent_callers():
  f, a, b = _two_effects()
  barrier = threading.Barrier(2)

  def run(mode):
    with je.ordering(mode):
      barrier.wait()
      for i in range(5):
        f(i)
      je.effects_barrier()
      return set(je.runtime_tokens().effects)

  results = {}
  threads = [threading.Thread(target=lambda m=m: results.__setitem__(m, run(m)))
             for m in ("global", "per_effect")]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert results == {"global": {je.GLOBAL}, "per_effect": {a, b}}


def test_set_ordering_is_process_wide_and_ordering_overrides_it():
  f, a, b = _two_effects()
  assert je.get_ordering() == "per_effect"
  je.set_ordering("global")
  try:
    assert in_thread(je.get_ordering) == "global"
    assert _effect_keys(f, 1) == {je.GLOBAL}

    def go():
      with je.ordering("per_effect"):
        f(1)
        inside = set(je.runtime_tokens().effects)
      # global mode again (process-wide): the snapshot has only GLOBAL
      return inside, set(je.runtime_tokens().effects)
    assert in_thread(go) == ({a, b}, {je.GLOBAL})
  finally:
    je.set_ordering("per_effect")
  assert _effect_keys(f, 1) == {a, b}


def test_switching_mode_keeps_program_order(effects_capture):
  release = threading.Event()
  a = je.Effect("modes-switch")

  def slow(x):
    release.wait(30)
    je.print("slow {}", x, effect=a)   # eager: prints immediately

  @je.jit
  def first(x):
    je.callback(slow, None, x, effect=a)
    return x

  @je.jit
  def second(x):
    je.print("after {}", x, effect=a)
    return x

  def go():
    threading.Timer(0.05, release.set).start()
    first(1)
    with je.ordering("global"):   # a different stream: waits at the switch
      second(2)
    je.effects_barrier()

  in_thread(go)
  assert effects_capture.printed == ["slow 1", "after 2"]


def test_global_mode_orders_effects_of_different_names_across_calls():
  release = threading.Event()
  seen = []

  def slow(x):
    release.wait(30)
    seen.append(("a", int(x)))

  a, b = je.Effect("modes-total-a"), je.Effect("modes-total-b")
  fa = je.jit(lambda x: (je.callback(slow, None, x, effect=a), x)[1])
  fb = je.jit(lambda x: (je.callback(lambda v: seen.append(("b", int(v))),
                                     None, x, effect=b), x)[1])

  def go():
    with je.ordering("global"):
      threading.Timer(0.05, release.set).start()
      fa(1)
      fb(2)        # same runtime token as fa's effect: runs after it
      je.effects_barrier()
  in_thread(go)
  assert seen == [("a", 1), ("b", 2)]


@pytest.mark.parametrize("mode", ["Global", "per-effect", "", None, 3])
def test_unknown_ordering_mode_is_a_value_error(mode):
  with pytest.raises(ValueError, match=f"Unknown ordering mode {mode!r}.*"
                                       r"'per_effect', 'global'"):
    with je.ordering(mode):
      pass
  with pytest.raises(ValueError, match="Unknown ordering mode"):
    je.set_ordering(mode)
  assert je.get_ordering() == "per_effect"


# --- unordered effects ----------------------------------------------------------

def test_unordered_effects_take_no_runtime_token_but_barrier_covers_them():
  release = threading.Event()
  done = []
  quiet = je.Effect("modes-quiet", ordered=False)

  def slow(x):
    release.wait(30)
    done.append(int(x))

  @je.jit
  def f(x):
    je.callback(slow, None, x, effect=quiet)        # unordered by its setting
    je.callback(slow, None, x + 1, ordered=False)   # unordered by the call
    return x

  def go():
    threading.Timer(0.05, release.set).start()
    f(1)
    keys = set(je.runtime_tokens().effects)
    devices = set(je.runtime_tokens().devices)
    je.effects_barrier()
    return keys, devices, list(done)

  keys, devices, after_barrier = in_thread(go)
  assert keys == set()
  assert jax.devices()[0] in devices
  assert sorted(after_barrier) == [1, 2]


def test_call_setting_overrides_effect_setting():
  quiet = je.Effect("modes-quiet2", ordered=False)

  @je.jit
  def f(x):
    je.print("{}", x, effect=quiet, ordered=True)
    return x

  assert _effect_keys(f, 1) == {quiet}


def test_unordered_effects_still_run_under_vmap_and_grad():
  seen = []

  def f(x):
    je.callback(lambda v: seen.append(float(v)), None, x, ordered=False)
    return x * x

  out = je.jit(jax.vmap(jax.grad(f)))(jnp.array([1.0, 2.0]))
  je.effects_barrier()
  np.testing.assert_allclose(out, [2.0, 4.0])
  assert sorted(seen) == [1.0, 2.0]

"""``jax_effects.jit(f)`` written inline reuses f's trace and executable, as ``jax.jit(f)`` does.

Every ``PjitFunction`` of one function object and equal options shares the
learnt state (``design/architecture.md``, the `_dispatch/function, core, ...` entry); the
state lives as long as the function. Differential: the same loops under
``jax.jit`` trace as often.
"""
import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import pytest

import jax_effects as je
from jax_effects._dispatch.function import describe


@pytest.fixture
def cache_misses(monkeypatch):
  """Counts "jit_cpp_cache_miss": a jax.jit call that left JAX's C++ path
  (the hook JAX's own tests use)."""
  from jax._src import util
  counts = {"jit_cpp_cache_miss": 0}

  def listen(name, *args):
    if name in counts:
      counts[name] += 1
  monkeypatch.setattr(util, "test_event_listener", listen)
  return counts


@pytest.mark.parametrize("jit", [jax.jit, je.jit], ids=["jax.jit", "je.jit"])
def test_twenty_inline_calls_trace_once_and_keep_the_executable(
    jit, cache_misses):
  traces, seen = [], []

  def f(x):
    traces.append(1)
    je.callback(lambda v: seen.append(int(v)), None, x)
    return x * 2

  for i in range(20):
    assert int(jit(f)(jnp.int32(i))) == 2 * i
  je.effects_barrier()
  assert traces == [1]
  assert seen == list(range(20))
  if jit is je.jit:
    # one learnt state whose executables do not grow, and no call leaving
    # the C++ path (the first learnt, the second installed the fast hook)
    executables = describe(jit(f)).executables
    cache_misses["jit_cpp_cache_miss"] = 0
    for i in range(20):
      jit(f)(jnp.int32(i))
    assert cache_misses["jit_cpp_cache_miss"] == 0
    assert len({describe(jit(f)).shared for _ in range(3)}) == 1
    assert describe(jit(f)).executables == executables
    assert describe(jit(f)).state == "fast"
    assert traces == [1]
    je.effects_barrier()


@pytest.mark.parametrize("jit", [jax.jit, je.jit], ids=["jax.jit", "je.jit"])
def test_inline_pure_function_traces_once(jit):
  traces = []

  def f(x, n):
    traces.append(n)
    return x * n

  for _ in range(20):
    assert int(jit(f, static_argnums=1)(jnp.int32(3), 2)) == 6
  assert traces == [2]
  jit(f, static_argnums=1)(jnp.int32(3), 4)
  assert traces == [2, 4]


def test_equal_options_share_other_options_do_not():
  def f(x, n):
    je.print("f {} {}", x, n)
    return x

  a = je.jit(f, static_argnums=1)
  b = je.jit(f, static_argnums=1)
  c = je.jit(f, static_argnames="n")
  d = je.jit(f)
  assert describe(a).shared == describe(b).shared
  assert len({describe(a).shared, describe(c).shared, describe(d).shared}) == 3
  # (sharing the decorator form: the same function object)
  assert describe(je.jit(static_argnums=1)(f)).shared == describe(a).shared


class _Model:
  def __init__(self, traces):
    self.traces = traces

  def step(self, x):
    self.traces.append(1)
    je.print("step {}", x)
    return x + 1


@pytest.mark.parametrize("make", [
    pytest.param(lambda t: (lambda x: (t.append(1), je.print("l {}", x),
                                       x + 1)[-1]), id="lambda"),
    pytest.param(lambda t: functools.partial(_Model.step, _Model(t)),
                 id="partial"),
    pytest.param(lambda t: _Model(t).step, id="bound-method"),
])
def test_functions_made_anew_per_call_trace_as_under_jax_jit(
    make, effects_capture):
  # A new function object per call is a new function to jax.jit's cache
  # (identity, weakly held): traced per call, under both.
  counts = {}
  for jit in (jax.jit, je.jit):
    traces = []
    for i in range(5):
      assert int(jit(make(traces))(jnp.int32(i))) == i + 1
    counts[jit] = len(traces)
  je.effects_barrier()
  assert counts[je.jit] == counts[jax.jit] == 5


def test_bound_method_of_one_instance_decorated_once_traces_once():
  traces = []

  class M:
    @functools.partial(je.jit, static_argnums=0)
    def step(self, x):
      traces.append(1)
      je.print("m {}", x)
      return x + 1

  m = M()
  for i in range(5):
    m.step(jnp.int32(i))
  je.effects_barrier()
  assert traces == [1]


def test_shared_state_goes_with_the_function(effects_capture):
  def make():
    def f(x):
      je.print("tmp {}", x)
      return x + 1
    return f

  fun = make()
  je.jit(fun)(jnp.int32(0))
  gone = weakref.ref(fun)
  before = describe(je.jit(make())).registered
  del fun
  gc.collect()
  assert gone() is None   # the learnt state does not keep it alive
  # many functions made and dropped: the registry does not grow with them
  # (10: a registry that kept dropped functions' entries has grown by 2 or
  # more, where new functions do not reuse every id of the dropped ones)
  for i in range(10):
    je.jit(make())(jnp.int32(i))
  gc.collect()
  assert describe(je.jit(make())).registered <= before
  je.effects_barrier()
  assert len(effects_capture.printed) == 11


def test_a_new_function_object_starts_where_the_last_one_left_off():
  def f(x):
    je.print("s {}", x)
    return x

  first = je.jit(f)
  assert describe(first).state == "first"
  first(jnp.int32(0))
  assert describe(je.jit(f)).state == "fast"
  assert describe(je.jit(f)).keys == {je.get_ordering(): (je.DEFAULT,)}
  je.effects_barrier()

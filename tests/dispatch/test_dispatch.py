"""Runtime and output tokens between calls, and jax.jit's fast path kept
(``design/tokens.md``, "Between computations"; ``design/architecture.md``,
"Why JAX keeps its fast path").

One runtime token per ordered effect used, thread-local and per effect;
output tokens per device; tokens follow the computation's device; order
across dispatches on different devices; the barrier; waiting at interpreter
exit; and jax.jit's C++ fast path staying in use.
"""
import collections
import random
import textwrap
import threading
import time

import jax
import jax.numpy as jnp

import jax_effects as je

import helpers
from jax_effects._core import effects as _effects
from jax_effects._dispatch.function import describe
from helpers import in_thread as run_in_thread


def _device_of(array):
  (device,) = array.sharding.device_set
  return device


# --- token calling convention ---------------------------------------------------

def test_one_runtime_token_per_ordered_effect_used():
  a, b = je.Effect("disp-a"), je.Effect("disp-b")

  @je.jit
  def f(x):
    je.print("a", effect=a)
    je.print("d")
    je.print("b", effect=b)
    je.print("u", ordered=False)
    return x

  def in_thread():
    f(jnp.int32(0))
    return je.runtime_tokens()

  snap = run_in_thread(in_thread)
  assert set(snap.effects) == {a, b, je.DEFAULT}
  for token in snap.effects.values():
    assert token.shape == () and token.dtype == jnp.int32
  # (unordered effects are passed the thread's initial token, never stored:
  # it only tells their callbacks the dispatching thread, design/errors.md)
  assert set(f.keys[je.get_ordering()]) == {a, b, je.DEFAULT,
                                            _effects.UNORDERED}


def test_runtime_tokens_are_per_effect():
  a, b = je.Effect("disp-pe-a"), je.Effect("disp-pe-b")
  fa = je.jit(lambda x: (je.print("a", effect=a), x)[1])
  fb = je.jit(lambda x: (je.print("b", effect=b), x)[1])

  def in_thread():
    fa(1)
    ta = je.runtime_tokens().effects[a]
    fb(1)
    snap = je.runtime_tokens()
    assert snap.effects[a] is ta  # fb neither took nor returned a's token
    fa(1)
    assert je.runtime_tokens().effects[a] is not ta
    assert je.runtime_tokens().effects[b] is snap.effects[b]
    return True

  assert run_in_thread(in_thread)


def test_runtime_tokens_are_thread_local():
  e = je.Effect("disp-thread")
  f = je.jit(lambda x: (je.print("t {}", x, effect=e), x)[1])
  before = je.runtime_tokens().effects.get(e)
  snap = run_in_thread(lambda: (f(1), je.runtime_tokens())[1])
  assert e in snap.effects
  assert je.runtime_tokens().effects.get(e) is before  # main thread untouched
  je.effects_barrier(all_threads=True)


def test_threads_keep_their_own_order():
  e = je.Effect("disp-threads-order")
  events = collections.defaultdict(list)

  def host(tid, i):
    time.sleep(random.random() * 0.002)
    events[int(tid)].append(int(i))

  @je.jit
  def f(tid, i):
    je.callback(host, None, tid, i, effect=e)
    return i

  def worker(tid):
    for i in range(20):
      f(tid, i)

  threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  je.effects_barrier(all_threads=True)
  assert dict(events) == {t: list(range(20)) for t in range(3)}


# --- devices ---------------------------------------------------------------------

def test_tokens_follow_the_device_of_the_computation():
  devices = jax.devices()
  assert len(devices) >= 6, "run with 8 simulated CPU devices"

  @je.jit
  def f(x):
    je.print("x={}", x)
    return x + 1

  def in_thread():
    x3 = jax.device_put(jnp.int32(1), devices[3])
    out = f(x3)
    assert _device_of(out) == devices[3]
    snap3 = je.runtime_tokens()
    token3 = snap3.effects[je.DEFAULT]
    assert _device_of(token3) == devices[3]
    assert not token3.committed  # never pins the next computation
    assert set(snap3.devices) == {devices[3]}
    # next computation on device 5: the token is copied there, no error
    x5 = jax.device_put(jnp.int32(2), devices[5])
    f(x5)
    snap5 = je.runtime_tokens()
    assert _device_of(snap5.effects[je.DEFAULT]) == devices[5]
    assert set(snap5.devices) == {devices[3], devices[5]}
    assert snap5.devices[devices[3]] is snap3.devices[devices[3]]
    assert _device_of(snap5.devices[devices[5]]) == devices[5]
    # back on device 3: only its output token is replaced
    f(x3)
    snap = je.runtime_tokens()
    assert snap.devices[devices[5]] is snap5.devices[devices[5]]
    assert snap.devices[devices[3]] is not snap3.devices[devices[3]]
    # an uncommitted input runs on the default device
    f(jnp.int32(0))
    assert _device_of(je.runtime_tokens().effects[je.DEFAULT]) == devices[0]
    return True

  assert run_in_thread(in_thread)


def test_order_across_devices_and_functions():
  events = []

  def slow(tag, i):
    time.sleep(0.001 * (int(i) % 3))
    events.append((int(tag), int(i)))

  @je.jit
  def f(tag, i):
    je.callback(slow, None, tag, i)
    return i

  @je.jit
  def g(tag, i):
    je.callback(slow, None, tag, i)
    je.callback(slow, None, tag, i + 100)
    return i

  devices = jax.devices()
  expected = []
  for i in range(24):
    d = devices[i % len(devices)]
    fn = f if i % 2 else g
    fn(jax.device_put(jnp.int32(i % 2), d), jax.device_put(jnp.int32(i), d))
    expected.append((i % 2, i))
    if fn is g:
      expected.append((i % 2, i + 100))
  je.effects_barrier()
  assert events == expected


def test_effects_barrier_blocks_on_output_tokens_of_every_device():
  # design/tokens.md "effects_barrier": unordered effects on 4 devices
  # (no runtime token orders them); the barrier waits for each device's
  # output token, not just the last dispatch's (whose callback is fastest).
  done = []
  devices = jax.devices()

  def slow(i):
    time.sleep(0.3 if int(i[0]) < 3 else 0)
    done.append(int(i[0]))

  @je.jit
  def f(i):
    je.callback(slow, None, i, ordered=False)
    return i

  def in_thread():
    with helpers.NotReadyYet(devices[:4]) as gate:
      for k in range(4):
        f(gate.arrays[k] + k)
      assert set(je.runtime_tokens().devices) == set(devices[:4])
      assert done == []          # dispatched; nothing ran yet
      gate.release()
      je.effects_barrier()
      return sorted(done)

  assert run_in_thread(in_thread) == [0, 1, 2, 3]


def test_barrier_all_threads_waits_for_other_threads():
  done = []

  def slow(i):
    time.sleep(0.1)
    done.append(int(i))

  @je.jit
  def f(i):
    je.callback(slow, None, i)
    return i

  started = threading.Event()
  release = threading.Event()

  def worker():
    f(jnp.int32(7))
    started.set()
    release.wait()  # alive, has not waited for its effects

  t = threading.Thread(target=worker)
  t.start()
  started.wait()
  je.effects_barrier(all_threads=True)
  assert done == [7]
  release.set()
  t.join()


def test_interpreter_exit_waits_for_every_thread():
  code = textwrap.dedent("""
      import threading, time
      import jax, jax.numpy as jnp
      jax.config.update("jax_num_cpu_devices", 4)
      import jax_effects as je

      def slow(i):
        time.sleep(0.01)

      @je.jit
      def f(i):
        je.callback(slow, None, i)
        je.print("line {}", i)
        return i

      def worker(dev):
        for i in range(25):
          f(jax.device_put(jnp.int32(dev * 100 + i), jax.devices()[dev]))

      t = threading.Thread(target=worker, args=(2,))
      t.start(); t.join()
      worker(1)
      # no effects_barrier: exit must still wait for both threads' effects
  """)
  out = helpers.run_script(code)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  # threads are not ordered relative to each other; each is in order
  for dev in (1, 2):
    mine = [l for l in lines if l.startswith(f"line {dev}")]
    assert mine == [f"line {dev * 100 + i}" for i in range(25)]
  assert len(lines) == 50


# --- fast path -------------------------------------------------------------------

def test_dispatch_stays_on_jax_cpp_fast_path(jax_events):
  e = je.Effect("disp-fast")
  traces = []

  @je.jit
  def f(x):
    traces.append(1)
    je.print("{}", x, effect=e)
    je.print("{}", x)
    return x + 1

  devices = jax.devices()
  x0 = jnp.int32(1)
  x3 = jax.device_put(jnp.int32(1), devices[3])

  def in_thread():  # fresh tokens: known devices only
    for _ in range(2):  # warm up every combination of token/argument devices
      f(x0)
      f(x0)
      f(x3)
    n_traces = len(traces)
    jax_events.clear()
    for _ in range(10):
      f(x0)
      f(x0)
      f(x3)
    je.effects_barrier()
    return n_traces

  n_traces = run_in_thread(in_thread)
  assert jax_events["jit_cpp_cache_miss"] == 0, jax_events
  assert len(traces) == n_traces


def test_pure_function_stays_on_fast_path(jax_events):
  f = je.jit(lambda x: x * 2)
  f(jnp.ones(3))
  jax_events.clear()
  for _ in range(5):
    f(jnp.ones(3))
  assert jax_events["jit_cpp_cache_miss"] == 0


def test_known_pure_function_is_called_straight_into_jax_jit():
  f = je.jit(lambda x: x * 2)
  assert float(f(jnp.float32(3))) == 6.0
  # No Python frame of ours on later calls: calling f calls the jax.jit object
  assert describe(f).state == "pure"
  assert type(f.__call__).__name__ == "PjitFunction"
  assert float(f(jnp.float32(4))) == 8.0


def test_function_pure_for_one_signature_effectful_for_another(effects_capture):
  from functools import partial

  @partial(je.jit, static_argnames=("debug",))
  def f(x, debug):
    if debug:
      je.print("debug x={}", x)
    return x + 1

  @je.jit
  def g(x):
    je.print("g x={}", x)
    return x

  assert float(f(jnp.float32(1), debug=False)) == 2.0
  assert describe(f).state == "pure"
  g(jnp.float32(0))
  # The first effectful signature goes straight into jax.jit's C++ path: it
  # still runs its effect, in order, and switches f to the threaded path.
  assert float(f(jnp.float32(2), debug=True)) == 3.0
  g(jnp.float32(5))
  assert float(f(jnp.float32(3), debug=True)) == 4.0
  assert float(f(jnp.float32(4), debug=False)) == 5.0
  # the threaded hook (the fast one: one chain, scalar tokens)
  assert describe(f).state in ("threaded", "fast")
  assert effects_capture.printed == ["g x=0.0", "debug x=2.0", "g x=5.0",
                                     "debug x=3.0"]
  assert je.DEFAULT in je.runtime_tokens().effects


def test_fast_hook_under_disable_jit_runs_the_function_eagerly_in_order():
  # Once a function takes the fast dispatch hook, jax.disable_jit() makes
  # jax.jit call the threaded function with values; it must run the user's
  # function eagerly, after the effects dispatched before it.
  events, traced = [], []
  release = threading.Event()

  def host(v):
    if int(v) == 1:
      release.wait(5)      # the first call's effect may still be pending...
    events.append(int(v))

  @je.jit
  def f(x):
    traced.append(isinstance(x, jax.core.Tracer))
    je.callback(host, None, x)
    return x + 1

  f(jnp.int32(0))
  f(jnp.int32(0))
  assert describe(f).state == "fast"
  je.effects_barrier()
  events.clear()
  traced.clear()
  threading.Timer(0.2, release.set).start()
  f(jnp.int32(1))
  with jax.disable_jit():
    assert int(f(jnp.int32(2))) == 3    # ... and this one runs after it
  f(jnp.int32(3))
  je.effects_barrier()
  assert events == [1, 2, 3]
  assert traced == [False]     # traced once before; eager under disable_jit

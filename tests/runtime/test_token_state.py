"""A thread's token state and its one owner (``design/tokens.md``, "Between
computations"; ``design/errors.md``, "Executions that fail as a whole"):
what ``_runtime/threads.ThreadTokens`` promises about the tokens it hands
on. A failed token is never handed on: neither after the failure is known,
nor to calls dispatched while the failing computation was still running;
tokens of computations that cannot fail as a whole are handed on without
waiting; a call made inside a call is joined; each execution's identity
(``_runtime/token_value``) is what the device computes.
"""
import gc
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_effects as je
from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import threads as _thread_slots
from jax_effects._runtime import token_store as _token_store
from jax_effects._runtime import token_value as _token_value


def _not_ready_input(devices, value=0):
  return helpers.NotReadyYet(devices[:2], value)


@pytest.mark.parametrize("later_calls", ["same-function", "another-function"])
def test_failed_token_is_not_handed_on_to_calls_dispatched_in_flight(
    devices, effects_capture, later_calls):
  # A pure_callback raising once, on an input not ready at dispatch: the
  # failure is the first call's (its result raises); the four calls
  # dispatched while it was still in flight run and print as under
  # jax.jit. "another-function": the calls in flight are another
  # function's on the same chain, one that cannot fail as a whole: its own
  # dispatches take the fast hook, which must not hand on the first
  # function's token while it may still fail (before the fix the four calls
  # failed with it and printed nothing).
  fail = []

  def host(x):
    if fail:
      fail.pop()
      raise helpers.Boom("transient")
    return x

  @je.jit
  def f(x):
    y = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    je.print("f {}", y[0])
    return y + 1

  @je.jit
  def g(x):
    je.print("g {}", x[0])
    return x + 1

  later_fn, name = (f, "f") if later_calls == "same-function" else (g, "g")
  for _ in range(3):   # (traced: f at risk; g's calls take its fast hook)
    f(jnp.zeros(1, jnp.int32)).block_until_ready()
    later_fn(jnp.zeros(1, jnp.int32))
  je.effects_barrier()
  effects_capture.clear()
  fail.append(True)
  with _not_ready_input(devices) as gate:
    first = f(gate.array)
    # (the next dispatch waits for the first call, which may fail as a
    # whole: released from another thread)
    threading.Timer(0.5, gate.release).start()
    later = [later_fn(jnp.full((1,), i, jnp.int32)) for i in range(1, 5)]
    with pytest.raises(jax.errors.JaxRuntimeError):
      np.asarray(first)
  assert [int(np.asarray(r)[0]) for r in later] == [2, 3, 4, 5]
  je.effects_barrier()   # the failure is the first call's: not reported
  assert effects_capture.printed == [f"{name} {i}" for i in range(1, 5)]


def test_failed_token_learnt_at_the_next_dispatch_restarts_the_chain(
    devices, effects_capture):
  # A computation that cannot be known to fail (no host call of JAX's own)
  # fails because its input did: the next call, dispatched after that is
  # known, does not get the failed token.
  upstream = helpers.failing_jit("upstream")

  @je.jit
  def f(x):
    je.print("f {}", x[0])
    return x + 1

  f(jnp.zeros(1, jnp.int32))
  je.effects_barrier()
  effects_capture.clear()
  with _not_ready_input(devices) as gate:
    bad = upstream(gate.array)
    failed = f(bad)
  with pytest.raises(jax.errors.JaxRuntimeError):
    np.asarray(failed)
  # (XLA marks a failed execution's outputs one after another: the thread
  # knows of the failure once its token, the last one, is marked too)
  for token in _threads.thread_state().pending():
    try:
      token.block_until_ready()
    except jax.errors.JaxRuntimeError:
      pass
  assert int(np.asarray(f(jnp.full((1,), 7, jnp.int32)))[0]) == 8
  je.effects_barrier()
  assert effects_capture.printed == ["f 7"]


def test_tokens_of_computations_that_cannot_fail_are_handed_on_in_flight(
    devices):
  # No waiting at dispatch: three calls on an input that is not ready all
  # return before any of their effects ran (the device orders them).
  ran = []

  @je.jit
  def f(x):
    je.callback(lambda v: ran.append(int(v[0])), None, x)
    return x

  with _not_ready_input(devices) as gate:
    for i in range(3):
      f(gate.array + i)
    assert ran == []
    gate.release()
    je.effects_barrier()
  assert ran == [0, 1, 2]


def test_execution_identity_is_the_one_the_device_computes():
  # The host's copy of each chain's sequence number (ThreadTokens.seqs)
  # is what the device puts in the token it returns: read it back.
  a, b = je.Effect("id-a"), je.Effect("id-b")

  @je.jit
  def f(x):
    je.print("{}", x, effect=a)
    return x

  @je.jit
  def g(x):
    je.print("{}", x, effect=a)
    je.print("{}", x, effect=b)
    return x

  def go():
    for fn in (f, f, g, f, g, g, f):
      fn(jnp.int32(0))
    state = _threads.thread_state()
    out = {}
    for key in (a, b):
      value = int(np.asarray(state.runtime[key]))
      out[key] = (_token_value.slot_of(value), _token_value.seq_of(value),
                  state.seqs[key], state.slot, state.base)
    je.effects_barrier()
    return out

  got = helpers.in_thread(go)
  for key, (slot, seq, mirrored, own_slot, _) in got.items():
    assert slot == own_slot
    assert seq == mirrored
  # a: 7 executions; b takes the maximum of both chains at each g
  # (f f g: a=3, b=3; f: a=4; g g: a=b=6; f: a=7), counted from where the
  # thread's chains start (past a previous owner's of its slot)
  since = {k: (v[1] - v[4]) & _token_value.SEQ_MASK for k, v in got.items()}
  assert since[a] == 7
  assert since[b] == 6


def test_execution_identity_survives_calls_made_inside_a_call():
  # A call made from a host callback of the thread's own call in flight is
  # an execution of its own (the next sequence number after the outer
  # one's): afterwards the host's copy is still the device's (before the
  # fix both took the same number and the copy ran one ahead, so a failed
  # execution was later cancelled under another's name).
  @je.jit
  def inner(x):
    je.print("inner {}", x)
    return x

  seen = []

  def host(x):
    seen.append(int(x))
    inner(x + 100)

  @je.jit
  def outer(x):
    je.callback(host, None, x)
    je.print("outer {}", x)
    return x

  def go():
    out = []
    for k in range(3):
      outer(jnp.int32(k))
      state = _threads.thread_state()
      value = int(np.asarray(state.runtime[_effects.DEFAULT]))
      out.append((_token_value.seq_of(value),
                  state.seqs[_effects.DEFAULT], state.base))
    je.effects_barrier()
    return out

  got = helpers.in_thread(go)
  assert seen == [0, 1, 2]
  for device_seq, mirrored, _ in got:
    assert device_seq == mirrored, got
  # each round: the outer execution, then the inner one after it (counted
  # from where the thread's chains start: past a previous owner's of its
  # slot)
  assert [(d - base) & _token_value.SEQ_MASK
          for d, _, base in got] == [2, 4, 6], got


def test_a_call_made_inside_a_call_is_joined(effects_capture):
  # The inner call stores its token while the outer one is in flight; the
  # outer one joins it instead of overwriting it, so the thread's next call
  # follows both.
  @je.jit
  def inner(x):
    je.print("inner {}", x)
    return x

  def host(x):
    inner(x + 100)

  @je.jit
  def outer(x):
    je.print("outer before {}", x)
    je.callback(host, None, x)
    je.print("outer after {}", x)
    return x

  @je.jit
  def later(x):
    je.print("later {}", x)
    return x

  def go():
    outer(jnp.int32(1))
    state = _threads.thread_state()
    joined = len(state.joined)
    later(jnp.int32(2))
    je.effects_barrier()
    return joined

  assert helpers.in_thread(go) == 1
  assert effects_capture.printed == [
      "outer before 1", "inner 101", "outer after 1", "later 2"]


def test_a_plain_jit_call_made_inside_a_call_is_waited_for_by_warm_calls(
    mesh, effects_capture):
  # A plain jax.jit call from a host callback of the thread's call, over
  # 8 devices (launched, still running when the outer call returns), is
  # joined; the thread's next call waits for it, also from its fast hook
  # (rounds 1 and 2). Mutation this catches: the outer call's store making
  # the fast hook usable again while a joined token is pending
  # (TokenStore._refresh_fast without `joined`): `later` then printed
  # before the plain call's line in the warm rounds.
  def slow(block):
    time.sleep(0.3)   # (each device slow: the plain call's print waits)
    return block

  stage = helpers.per_device_stage(mesh, slow)

  @jax.jit
  def plain(x, r):
    je.print("plain {} {}", r, stage(x).sum())
    return x

  x = helpers.sharded(mesh, jnp.arange(8, dtype=jnp.int32))

  def call_plain(r):
    plain(x, r)

  @je.jit
  def outer(r):
    je.callback(call_plain, None, r)
    return r

  @je.jit
  def later(r):
    je.print("later {}", r)
    return r

  for r in range(3):   # (the first calls compile; then the fast hooks)
    outer(jnp.int32(r))
    later(jnp.int32(r))
  je.effects_barrier()
  assert effects_capture.printed == [
      line for r in range(3) for line in (f"plain {r} 28", f"later {r}")]


def test_the_runtime_token_of_a_chain_is_never_a_failed_one(devices):
  # After any failure the thread's stored tokens are good once it
  # dispatches again: nothing failed stays in its state.
  g = helpers.failing_jit("x")

  @je.jit
  def f(x):
    je.print("{}", x[0])
    return x

  def go():
    with _not_ready_input(devices) as gate:
      failed = f(g(gate.array))
    with pytest.raises(jax.errors.JaxRuntimeError):
      np.asarray(failed)   # (its failure is known now)
    f(jnp.ones(1, jnp.int32))
    state = _threads.thread_state()
    je.effects_barrier()
    return [_token_store.settled(t) for t in state.runtime.values()]

  assert helpers.in_thread(go) == [True]


def test_a_reused_slot_never_names_an_earlier_threads_execution():
  # An execution is named by its thread's slot and its sequence number on a
  # chain. A thread's failed execution over several devices may still run
  # on one of them after the thread ended and its slot was freed (what the
  # host keeps to skip its late effects stays: host_jobs); the thread that
  # takes the slot next must name its executions past every one the ended
  # thread used, or its effects would be skipped as that execution's (fault
  # model seed 8653: a later call's three effects on a chain missing).
  @je.jit
  def f(x):
    je.print("f {}", x)
    return x

  def first():
    for i in range(5):
      f(jnp.int32(i))
    je.effects_barrier()
    state = _threads.thread_state()
    return state.slot, state.seqs[_effects.DEFAULT]

  def second():
    f(jnp.int32(9))
    je.effects_barrier()
    state = _threads.thread_state()
    value = int(np.asarray(state.runtime[_effects.DEFAULT]))
    return state.slot, state.seqs[_effects.DEFAULT], _token_value.seq_of(value)

  slot, last = helpers.in_thread(first)
  for _ in range(3):   # (its state goes with it; its slot is freed here)
    gc.collect()
    je.effects_barrier(all_threads=True)
  # (other tests' ended threads may be freed in the same barriers: the slot
  # taken next is made the first thread's)
  assert slot in _thread_slots._free_slots, (slot, _thread_slots._free_slots)
  _thread_slots._free_slots.remove(slot)
  _thread_slots._free_slots.append(slot)
  slot2, seq2, device_seq2 = helpers.in_thread(second)
  assert slot2 == slot   # (the slot freed last is taken first)
  assert device_seq2 == seq2
  assert _token_value.seq_after(seq2, last), (last, seq2)


def test_a_failed_token_kept_on_devices_is_not_handed_on(devices,
                                                         effects_capture):
  # A shard_map program's token stays on its devices and its calls take
  # the fast hook for such tokens (call_path.fast_dispatch). Its computation
  # fails because its input did (an upstream computation over the same
  # devices, still in flight at dispatch); once that is known, the next
  # call must start the chain afresh, not get the failed token, and its
  # devices print as under jax.jit.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(devices[:4]), ("i",))
  sharded = NamedSharding(mesh, P("i"))

  @je.jit
  def per_device(x):
    def body(b):
      je.print("d {}", b[0])
      return b + 1
    return jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                         out_specs=P("i"))(x)

  release = threading.Event()

  def wait_then_fail(v):
    release.wait(60)
    if int(v[0]) == 1:
      raise helpers.Boom("upstream")
    return v

  upstream = jax.jit(jax.shard_map(
      lambda v: jax.pure_callback(wait_then_fail, jax.ShapeDtypeStruct(
          v.shape, v.dtype), v), mesh=mesh, in_specs=P("i"),
      out_specs=P("i")))
  put = lambda k: jax.device_put(np.full((4,), k, np.int32), sharded)
  for k in range(3):
    per_device(put(10 + k))
  je.effects_barrier()
  assert per_device._core.state == "fast"   # (its devices' hook)
  effects_capture.clear()
  release.clear()
  first = per_device(upstream(put(1)))   # (returns at once)
  release.set()
  with pytest.raises(jax.errors.JaxRuntimeError):
    np.asarray(first)
  try:   # (its token ended too)
    je.runtime_tokens().effects[je.DEFAULT].block_until_ready()
  except Exception:  # noqa: BLE001 - the failed token
    pass
  out = per_device(put(20))
  assert np.asarray(out).tolist() == [21] * 4
  je.effects_barrier()
  # (JAX keeps the failed upstream's output tokens, a plain jax.jit's
  # failure, for every later jax.effects_barrier(): not this test's to leave)
  _compat.clear_jax_runtime_tokens()
  assert sorted(effects_capture.printed) == [
      f"[device {d} shard {d} process 0] d 20" for d in range(4)]


def test_every_device_names_the_same_execution_after_a_chain_failed_on_one(
    devices, effects_capture):
  # A computation over several devices returns one token for its chains:
  # the latest identity of them. A callback failing on the first device
  # sets FAILED on its chain's carrier there only; compared with FAILED,
  # that chain (behind the other one) won on the first device only, so
  # the devices' tokens named different executions and the next summarized
  # print's pieces never met its first device's call (fault model seed
  # 5235: a barrier waited for ever).
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(devices), ("i",))
  a = je.Effect("ahead")
  x = jax.device_put(jnp.arange(64, dtype=jnp.int32).reshape(8, 8),
                     NamedSharding(mesh, P("i")))

  @je.jit
  def summarized(v):
    je.print("S {}", v, effect=a)
    return v + 1

  fail = [True]

  def once(u):
    if fail:
      fail.pop()
      raise helpers.Boom("once")

  @je.jit
  def both(v):
    je.print("a {}", v[0, 0], effect=a)
    je.callback(once, None, v[0, 0])   # (the default chain, behind a)
    return v

  with np.printoptions(threshold=10, edgeitems=2):
    for _ in range(3):
      summarized(x)
    je.effects_barrier()
    both(x)
    with pytest.raises(helpers.Boom):
      je.effects_barrier()
    token = je.runtime_tokens().effects[a]
    seqs = {_token_value.seq_of(int(np.asarray(s.data)))
            for s in token.addressable_shards}
    assert len(seqs) == 1, seqs
    effects_capture.clear()
    summarized(x)
    je.effects_barrier()
    expected = "S " + str(np.arange(64, dtype=np.int32).reshape(8, 8))
  assert effects_capture.printed == [expected]

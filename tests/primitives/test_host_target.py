"""jax_effects' FFI target (``design/host_target.md``): the transport of
every host call on CPU, beneath the host functions.

Every dtype crosses it both ways (the handler reads and writes XLA's
buffers itself, sub-byte types packed as XLA packs them), in a function
and in the same function exported; a key's host side is never another's;
a host side that is gone is a clear error reported like a callback's, not
an XLA error; the registry does not keep closures alive; a call frame
whose buffers are not its site's is refused before a byte is read.
"""
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_effects as je
from jax_effects._primitives import host_target

import helpers

ALLOW = [jax.export.DisabledSafetyCheck.custom_call(je.HOST_TARGET)]


def _dtype_params():
  # Two groups, one compiled program each (every dtype and shape a call site
  # of its own): the 4-bit and 2-bit integers need a JAX that has them.
  names = ["bool", "int8", "int16", "int32", "uint8", "uint16", "uint32",
           "float16", "bfloat16", "float32", "complex64", "float8_e4m3fn",
           "float8_e5m2", "float8_e4m3b11fnuz", "float8_e4m3fnuz",
           "float8_e5m2fnuz", "float8_e4m3", "float8_e3m4", "float8_e8m0fnu",
           "float4_e2m1fn"]
  sub_byte_ints = ["int4", "uint4", "int2", "uint2"]
  have = lambda ns: [n for n in ns if getattr(jnp, n, None) is not None]
  yield pytest.param(have(names), id="bytes")
  yield pytest.param(have(sub_byte_ints), id="sub-byte-ints",
                     marks=pytest.mark.jax_feature("4-bit integer operands"))


def _values(dtype, shape):
  n = int(np.prod(shape))
  if dtype == np.bool_:
    return (np.arange(n) % 3 == 0).reshape(shape)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return (np.arange(n) + 1j * (np.arange(n) - 2)).astype(dtype).reshape(shape)
  if jnp.issubdtype(dtype, jnp.unsignedinteger) or dtype == jnp.float8_e8m0fnu:
    return (np.arange(n) % 3 + 1).astype(dtype).reshape(shape)
  return (np.arange(n) % 5 - 2).astype(dtype).reshape(shape)


@pytest.mark.parametrize("names", list(_dtype_params()))
def test_every_dtype_crosses_the_target_both_ways(names):
  cases = [(np.dtype(getattr(jnp, name)), shape) for name in names
           for shape in [(), (0,), (2, 3), (5,)]]
  xs = [_values(dtype, shape) for dtype, shape in cases]
  received = []

  def host(v, w):
    received.append((v.dtype, v.shape, v.tobytes(), w.tolist()))
    return v, np.int32(7)

  same = je.register_callback("test_host_target.same", host)
  try:
    specs = [jax.ShapeDtypeStruct(shape, dtype) for dtype, shape in cases]

    def f(*xs):   # one call site per case, in the order of the cases
      outs = []
      for spec, x in zip(specs, xs):
        y, k = je.callback(same, (spec, jax.ShapeDtypeStruct((), jnp.int32)),
                           x, jnp.arange(2))
        outs.append((y, k + 1))
      return outs

    jf = je.jit(f)
    exp = jax.export.export(jf, disabled_checks=ALLOW)(*specs)
    for call in (jf, exp.call):
      outs = call(*map(jnp.asarray, xs))
      je.effects_barrier()
      for (dtype, shape), x, (y, k) in zip(cases, xs, outs):
        case = f"{dtype} {shape} ({call})"
        assert y.dtype == dtype and y.shape == shape, case
        assert np.asarray(y).tobytes() == x.tobytes(), case
        assert int(k) == 8, case
  finally:
    je.register_callback("test_host_target.same", None)
  want = [(dtype, shape, x.tobytes(), [0, 1])
          for (dtype, shape), x in zip(cases, xs)]
  assert len(received) == 2 * len(cases)
  for i, (got, case) in enumerate(zip(received, want * 2)):
    assert got == case, f"call {i}: {case[:2]}"


def test_closures_of_the_same_code_keep_their_own_host_sides():
  seen = []

  def recorder(tag):
    return lambda v: seen.append((tag, float(v)))

  @je.jit
  def f(x):
    for tag in "abc":
      je.callback(recorder(tag), None, x)
      je.print("same {}", x)   # (one data key for the three: same spec)
    return x

  f(1.0)
  f(2.0)
  je.effects_barrier()
  assert seen == [(t, v) for v in (1.0, 2.0) for t in "abc"]


def test_a_host_side_that_is_gone_is_a_lookup_error_naming_it(effects_capture):
  seen = []

  def remember(v):
    seen.append(float(v))

  @je.jit
  def f(x):
    je.callback(remember, None, x)
    je.print("after {}", x)
    return x

  f(1.0)
  je.effects_barrier()
  with host_target._lock:   # the executable outlives its host sides' keys
    host_target._sites.clear()
  with pytest.raises(LookupError) as info:
    f(2.0)
    je.effects_barrier()
  msg = str(info.value)
  assert "jax_effects.callback(" in msg and "remember" in msg
  assert "not bound in this one" in msg
  # The chain's later effect of that execution is skipped (its print is
  # data: rebuilt from its spec, it would have run).
  assert seen == [1.0]
  assert effects_capture.printed == ["after 1.0"]


def test_the_registry_does_not_keep_a_closure_alive():
  class Big:
    pass

  big = Big()
  ref = weakref.ref(big)

  def make():
    def f(x):
      je.callback(lambda v, big=big: None, None, x)
      return x
    return je.jit(f)

  f = make()
  f(1.0)
  je.effects_barrier()
  keys = [k for k, r in host_target._sites.items() if r() is not None
          and "test_the_registry" in r().what]
  assert keys
  del f, big
  jax.clear_caches()
  gc.collect()
  assert ref() is None
  assert not any(k in host_target._sites for k in keys)


def test_calls_keep_no_memory_per_execution():
  # Every execution's carrier holds its own identity (a new value each
  # call, _runtime/token_value): nothing may be kept per value. 20,000
  # calls leave what 2,000 left (a cache of carrier values grew ~75 bytes
  # a call).
  import gc
  import tracemalloc

  @je.jit
  def f(x):
    je.callback(lambda v: None, None, x)
    return x

  x = jnp.float32(1)

  def run(n):
    for _ in range(n):
      f(x)
    je.effects_barrier()
    gc.collect()

  run(2000)
  tracemalloc.start()
  try:
    before = tracemalloc.take_snapshot()
    run(20000)
    after = tracemalloc.take_snapshot()
  finally:
    tracemalloc.stop()
  grown = sum(s.size_diff for s in after.compare_to(before, "filename")
              if s.size_diff > 0)
  assert grown < 200_000, after.compare_to(before, "lineno")[:5]


# --- a site outlives its function while its computation runs ---------------------

def test_a_plain_jit_executable_running_after_its_function_is_gone_finds_its_sites():
  # Under plain jax.jit nothing of ours owns the sites: the executable's
  # keepalives and the jaxpr in JAX's trace cache do, and both go with the
  # function (JAX's eager shard_map makes such a function for every
  # primitive). A launch over several devices waits at most a second for a
  # computation that runs the user's code (launch_lock.finish), so the
  # function can be gone while its computation runs. Here the first
  # callback holds every device past that second; the function, JAX's
  # caches and the executable are dropped; then the second callback's local
  # site must still be bound (it was UnboundHostFunction, reported at
  # exit: 1 in 25 runs of test_entries' eager entry on JAX 0.12).
  # The same program with its function kept is the reference.
  proc = helpers.run_script("""
import gc, threading
import jax, jax.numpy as jnp, numpy as np
import jax_effects as je
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("i",))

def run(drop):
  gate = threading.Event()
  seen = []
  def body(x):
    je.callback(lambda v: None if gate.wait(60) else print("timeout"), None, x)
    je.callback(lambda v: seen.append(v.tolist()), None, x + 1)   # (local)
    # (work enough that XLA runs the computation asynchronously, not
    # inline on the calling thread: design/host_target.md)
    return x * 2, jnp.full((64, 64), 1.0 / 64) @ jnp.full((64, 64), 1.0)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                            out_specs=(P("i"), P())))
  out, m = f(jnp.arange(8, dtype=jnp.int32))
  if drop:
    del f
    jax.clear_caches(); gc.collect()
  gate.set()
  je.effects_barrier()
  print(drop, out.tolist(), float(m.sum()), sorted(seen))

run(True)
run(False)
""", timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  lines = proc.stdout.splitlines()
  assert [line.split(" ", 1)[1] for line in lines] == [lines[1].split(" ", 1)[1]] * 2
  assert lines[1].startswith("False [0, 2, 4, 6, 8, 10, 12, 14] 4096.0 [")

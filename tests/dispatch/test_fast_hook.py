"""The fast dispatch hook hands every case it does not run to the general path.

A function's common calls run through the fast hook
(``call_path.fast_dispatch``), which hands every other case to the
function's general path. It knows a token verified
(``TokenStore.verified``) by asking whether the token is ready when its
call returns. A program runs in a fresh process: the printed
lines in order, the values returned, the errors raised (each once, by the
call it belongs to) and the thread's token after each call must be what the
program implies: calls with positional arguments passed as written and
unpacked (the two ways Python hands them over), keyword arguments, a
callback that fails, a failure of the computation as a whole (its token
never handed on), a call from inside a host callback, a retrace that finds
another chain.
"""
import json
import textwrap

import pytest

from helpers import run_python

SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp
import numpy as np
import jax_effects as je
from jax_effects._runtime import threads

out = {"errors": [],
       "values": [], "tokens": []}

def token_is_new(before):
  now = je.runtime_tokens().effects[je.DEFAULT]
  return now is not before

@je.jit
def f(x, *rest, scale=1.0):
  je.print("f {} {}", x, len(rest))
  return x * scale + sum(rest)

@je.jit
def g(x):
  je.print("g {}", x)
  return x + 1

def fails_on_3(v):
  if int(v) == 3:
    raise ValueError("callback 3")

@je.jit
def h(x):
  je.callback(fails_on_3, None, x)
  je.print("h {}", x)
  return x

for i in range(4):   # (the first calls trace; the later ones are common)
  before = je.runtime_tokens().effects.get(je.DEFAULT)
  out["values"].append(float(f(jnp.float32(i))))
  out["tokens"].append(token_is_new(before))
  out["values"].append(float(g(jnp.float32(i))))
args = [jnp.float32(k) for k in range(20)]
out["values"].append(float(f(*args)))          # (no free slot before args)
out["values"].append(float(f(*args[:3])))
out["values"].append(float(f(jnp.float32(7), scale=2.0)))
out["values"].append(float(f(jnp.float32(7), jnp.float32(1), scale=3.0)))
for i in range(5):
  try:
    h(jnp.float32(i))
  except ValueError as exc:
    out["errors"].append(f"h {i}: {exc}")
je.effects_barrier()
sys.stdout.flush()

# a computation that fails as a whole (launched asynchronously, over two
# devices) whose failed result is the next call's input: that call fails,
# once, and its failed token is never handed on
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()[:2]), ("i",))

def boom_on_1(v):
  if int(v[0]) == 1:
    raise RuntimeError("xla 1")
  return v

upstream = jax.jit(jax.shard_map(
    lambda v: jax.pure_callback(boom_on_1, jax.ShapeDtypeStruct(
        v.shape, v.dtype), v), mesh=mesh, in_specs=P("i"), out_specs=P("i")))
for i in range(3):
  y = upstream(jax.device_put(np.full((2,), i, np.float32),
                              NamedSharding(mesh, P("i"))))
  try:
    out["values"].append(float(g(y.addressable_shards[0].data[0])))
  except Exception as exc:
    out["errors"].append(f"g after upstream {i}: {type(exc).__name__}")
  je.effects_barrier()
sys.stdout.flush()

# the same failure still in flight when the call is dispatched: its input
# is not ready (a plain computation behind a slow one, both launched
# asynchronously, on the same device as g: g's token is of the kind the hook
# stores itself), so the call returns at once with its token not verified;
# the next call, dispatched once the failure has happened, must not get
# the failed token (one dispatched while it is in flight fails with it, as
# its input would under jax.jit: design/errors.md)
slow = jax.jit(lambda v: (jnp.full((2000, 2000), v) @ jnp.full(
    (2000, 2000), v))[0, 0] * 0 + v)

def boom_on_1_later(v):
  if int(v) == 1:
    raise RuntimeError("xla 1 later")
  return v

fails = jax.jit(lambda v: jax.pure_callback(
    boom_on_1_later, jax.ShapeDtypeStruct((), jnp.float32), v))
for i in range(3):
  first = g(fails(slow(jnp.float32(i))) + 10)   # (returns at once)
  try:
    out["values"].append(float(first))
  except Exception as exc:
    out["errors"].append(f"g in flight {i}: {type(exc).__name__}")
  try:   # (its token ended too: XLA marks a failed computation's outputs
    #       one after another, and the next dispatch would not wait for it)
    je.runtime_tokens().effects[je.DEFAULT].block_until_ready()
  except Exception:
    pass
  out["values"].append(float(g(jnp.float32(20 + i))))
  je.effects_barrier()
sys.stdout.flush()

# a call from inside a host callback keeps its place
@je.jit
def inner(x):
  je.print("inner {}", x)
  return x

@je.jit
def outer(x):
  je.print("outer before {}", x)
  je.callback(lambda v: (inner(v + 100), None)[1], None, x)
  je.print("outer after {}", x)
  return x

for i in range(3):
  outer(jnp.float32(i))
  g(jnp.float32(i))
je.effects_barrier()

# a retrace (a new shape) that finds another chain
@je.jit
def grows(x):
  je.print("grows {}", x.shape)
  if x.ndim:
    je.print("grows other {}", x.shape, effect=je.Effect("other"))
  return x

for x in (jnp.float32(1), jnp.float32(2), jnp.ones(2), jnp.ones(2)):
  grows(x)
je.effects_barrier()
sys.stdout.flush()
print(json.dumps(out), file=sys.stderr)
"""

EXPECTED_VALUES = (
    [v for i in range(4) for v in (float(i), float(i + 1))]
    + [float(sum(range(1, 20))), 3.0, 14.0, 22.0]
    + [1.0, 3.0]   # g after upstream 0 and 2 (upstream 1 failed)
    + [11.0, 21.0, 22.0, 13.0, 23.0]   # (the first g of 1 failed)
)


def _expected_stdout() -> list[str]:
  lines = []
  for i in range(4):
    lines += [f"f {i}.0 0", f"g {i}.0"]
  lines += ["f 0.0 19", "f 0.0 2", "f 7.0 0", "f 7.0 1"]
  lines += [f"h {i}.0" for i in range(5) if i != 3]
  lines += ["g 0.0", "g 2.0"]   # (g after the failed upstream call: none)
  lines += ["g 10.0", "g 20.0", "g 21.0", "g 12.0", "g 22.0"]
  for i in range(3):
    lines += [f"outer before {i}.0", f"inner {i + 100}.0",
              f"outer after {i}.0", f"g {i}.0"]
  lines += ["grows ()", "grows ()", "grows (2,)", "grows (2,)"]
  return lines


def test_fast_hook_dispatches_as_the_program_implies(tmp_path):
  proc = run_python("-c", textwrap.dedent(SCRIPT), timeout=600, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stderr.strip().splitlines()[-1])
  assert got["values"] == EXPECTED_VALUES
  assert got["tokens"] == [True] * 4
  assert got["errors"] == [
      "h 3: callback 3",
      "g after upstream 1: JaxRuntimeError",
      "g in flight 1: JaxRuntimeError"], got["errors"]
  assert [line for line in proc.stdout.splitlines()
          if not line.startswith("grows other")] == _expected_stdout()
  assert proc.stdout.count("grows other (2,)") == 2

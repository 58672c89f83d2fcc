"""The FFI host target's entry (``_primitives/_trampoline.c``) hands every
host call its operands as the program sent them.

A fresh process (``jax_enable_x64`` on) runs the program; what every host
function received (dtype, shape, the exact bytes, NaN payloads included,
writable), the partition ids of per-device calls, the printed text and
the errors raised (each once) must be what the program sent, call after
call (the common site: one operand, the carrier, no result).
"""
import inspect
import json
import textwrap

from helpers import run_python

SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_effects as je

seen = []

def record(v):
  seen.append([str(v.dtype), list(v.shape), v.tobytes().hex(),
               bool(v.flags.writeable) if v.ndim else None])

{OPERANDS}
operands = _operands()

@je.jit
def f(*xs):   # (a site per operand, in order)
  for x in xs:
    je.callback(record, None, x)
  return xs

jax.config.update("jax_enable_x64", True)
for _ in range(3):
  f(*operands)
je.effects_barrier()

mesh = Mesh(np.array(jax.devices()), ("i",))

@je.jit
def per_device(x):
  def body(b):
    je.callback(lambda v: seen.append(["device", v.tolist()]), None, b)
    return b
  return jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)

for k in range(3):
  per_device(jnp.arange(4.0) + 10 * k)
  je.effects_barrier()

@je.jit
def printing(x):
  je.print("x = {}", x)
  return x

for k in range(3):
  printing(jnp.float32(k) / 4)
je.effects_barrier()

def fails(v):
  raise ValueError(f"no {float(v)}")

@je.jit
def failing(x):
  je.callback(fails, None, x)
  je.callback(record, None, x + 1)   # (skipped after the failure)
  return x

errors = []
for k in range(3):
  try:   # (raised by the call, or by the barrier if it ran asynchronously)
    failing(jnp.float32(k))
    je.effects_barrier()
  except ValueError as exc:
    errors.append(str(exc))
sys.stdout.flush()
print(json.dumps({"seen": seen, "errors": errors}), file=sys.stderr)
"""


def _operands():
  """The operands the program sends, in order (its source is the script's
  too): every dtype in three shapes, then NaNs with payloads (their bits,
  as they are)."""
  import jax.numpy as jnp
  import numpy as np
  operands = []
  for name in ("bool", "int8", "uint16", "int32", "float16", "bfloat16",
               "float32", "float64", "complex64", "float8_e4m3fn"):
    dtype = jnp.dtype(getattr(jnp, name))
    for shape in ((), (5,), (2, 3)):
      n = int(np.prod(shape))
      values = (np.arange(n) % 5 - (0 if dtype == np.bool_ or
                jnp.issubdtype(dtype, jnp.unsignedinteger) else 2))
      operands.append(values.astype(dtype).reshape(shape))
  operands.append(
      np.array(0x7FC00123, np.uint32).view(np.float32).reshape(()))
  operands.append(
      np.array([0x7FF8000000000ABC, 0], np.uint64).view(np.float64))
  return operands


SCRIPT = SCRIPT.replace("{OPERANDS}", inspect.getsource(_operands))


def _expected_records():
  """What ``record`` receives, every operand in turn, three times, computed
  here: a 0-d operand as a NumPy scalar (no writable flag), an array
  writable."""
  return [[str(x.dtype), list(x.shape), x.tobytes().hex(),
           True if x.ndim else None]
          for _ in range(3) for x in _operands()]


def test_the_entry_hands_host_calls_their_operands(tmp_path):
  proc = run_python("-c", textwrap.dedent(SCRIPT), timeout=600, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stderr.strip().splitlines()[-1])
  records = [r for r in got["seen"] if r[0] != "device"]
  assert records == _expected_records()
  devices = [r[1] for r in got["seen"] if r[0] == "device"]
  assert sorted(devices) == sorted([[10.0 * k + d] for k in range(3)
                                    for d in range(4)])
  assert proc.stdout.splitlines() == ["x = 0.0", "x = 0.25", "x = 0.5"]
  assert got["errors"] == ["no 0.0", "no 1.0", "no 2.0"]

"""The multi-process SPMD program run by the test suite and the demo.

Run in every process by :func:`jax_effects._tools.launcher.launch` (after
``jax.distributed.initialize``): :func:`shard_map_logging` builds a mesh over
the *global* device list (all processes' devices), creates a sharded array
from process-local data, and calls a ``jax_effects.jit`` step several times.
Each step

* logs twice per device inside a ``shard_map`` (``jax_effects.log``): each
  device's records come out in program order across steps, attributed to the
  device, its mesh position and its process;
* prints once per device (``jax_effects.print``: lines prefixed with the
  device's placement);
* prints once after the ``shard_map`` under automatic partitioning: JAX's
  rule for such callbacks runs it once, on the computation's first device,
  i.e. in process 0 only.

The last call goes through the AOT path (``.lower().compile()``). With
:func:`shard_map_logging_deterministic` the loop runs inside
``jax_effects.deterministic()`` with an ``effects_barrier()`` (and a
``barrier`` marker in the observations) after each step.

It then calls ``effects_barrier()`` (this process's effects) and returns, as
JSON, what this process observed: its process index, its devices, the mesh
(device id per position) and every record and line in delivery order. The
parent checks attribution and order (``tests/tools/test_multiprocess.py``, the
``demo --processes`` section).
"""
from __future__ import annotations

import contextlib
import logging
import threading

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import jax_effects
from jax_effects._runtime import output as _output

STEPS = 3
AXIS = "devices"
LOGGER = "jax_effects.multiprocess_demo"


def _mesh():
  devices = np.array(jax.devices())   # global: every process's devices
  return jax.sharding.Mesh(devices, (AXIS,))


def shard_map_logging() -> dict:
  """Runs the program in this process; returns what it observed (JSON)."""
  return _run(deterministic=False)


def shard_map_logging_deterministic() -> dict:
  """The same program inside ``jax_effects.deterministic()``."""
  return _run(deterministic=True)


def _run(deterministic: bool) -> dict:
  mesh = _mesh()
  n = mesh.size
  sharding = NamedSharding(mesh, P(AXIS))
  data = np.arange(2 * n, dtype=np.float32)
  # Each process provides only the shards on its own devices.
  x = jax.make_array_from_callback(data.shape, sharding, lambda idx: data[idx])

  lock = threading.Lock()
  events: list[dict] = []   # records and lines, in delivery order

  def on_record(record: logging.LogRecord) -> None:
    if record.name != LOGGER:
      return
    shard = record.shard_index
    with lock:
      events.append({
          "kind": "log", "message": record.getMessage(),
          "device_id": record.device_id,
          "shard_index": list(shard) if isinstance(shard, tuple) else shard,
          "process_index": record.process_index})

  def on_line(line: str) -> None:
    with lock:
      events.append({"kind": "print", "line": line})

  def per_device(block, step):
    jax_effects.log("step {} first sum={}", step, block.sum(), logger=LOGGER)
    block = block * 2
    jax_effects.print("step {} per-device", step)
    jax_effects.log("step {} second sum={}", step, block.sum(), logger=LOGGER)
    return block

  @jax_effects.jit
  def step_fn(x, step):
    y = jax.shard_map(per_device, mesh=mesh, in_specs=(P(AXIS), P()),
                      out_specs=P(AXIS))(x, step)
    jax_effects.print("step {} total={}", step, y.sum())
    return y

  logging.getLogger(LOGGER).setLevel(logging.INFO)
  _output.add_record_listener(on_record)
  _output.add_line_listener(on_line)
  try:
    with (jax_effects.deterministic() if deterministic
          else contextlib.nullcontext()):
      # The last step goes through the AOT path (lower/compile/call).
      compiled = step_fn.lower(x, jnp.int32(0)).compile()
      for i in range(STEPS):
        x = (compiled if i == STEPS - 1 else step_fn)(x, jnp.int32(i))
        if deterministic:  # this step's output is out once its effects ran
          jax_effects.effects_barrier()
          with lock:
            events.append({"kind": "barrier", "step": i})
      jax_effects.effects_barrier()
  finally:
    _output.remove_record_listener(on_record)
    _output.remove_line_listener(on_line)
  with lock:
    observed = list(events)
  return {
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "local_device_ids": [d.id for d in jax.local_devices()],
      "mesh_device_ids": [d.id for d in mesh.devices.flat],
      "steps": STEPS,
      "deterministic": deterministic,
      "events": observed,
      "runtime_token_devices": sorted(
          d.id for d in jax_effects.runtime_tokens().devices),
  }


# --- the demo section (``python -m jax_effects demo --processes N``) ----------------

def _check(result: dict) -> list[str]:
  """Problems in one process's observations (empty: attribution and order ok)."""
  problems = []
  mesh = result["mesh_device_ids"]
  pid = result["process_index"]
  logs = [e for e in result["events"] if e["kind"] == "log"]
  for e in logs:
    if (e["process_index"] != pid or e["device_id"] not in result["local_device_ids"]
        or e["shard_index"] != mesh.index(e["device_id"])):
      problems.append(f"misattributed record {e}")
  for d in result["local_device_ids"]:
    got = [e["message"].split(" sum=")[0] for e in logs if e["device_id"] == d]
    want = [f"step {s} {w}" for s in range(result["steps"])
            for w in ("first", "second")]
    if got != want:
      problems.append(f"device {d}: records in order {got}, expected {want}")
  return problems


def demo(num_processes: int = 2, devices_per_process: int = 2,
         timeout: float = 120.0, out=None) -> int:
  """Runs :func:`shard_map_logging` in ``num_processes`` processes on this
  machine and shows what each process delivered; 0 if all checks hold."""
  import sys

  from jax_effects._tools import launcher
  write = out or (lambda line: sys.stdout.write(line + "\n"))
  write(f"{num_processes} JAX processes x {devices_per_process} CPU devices "
        "(jax.distributed on 127.0.0.1, gloo collectives); each runs a "
        "jax_effects.jit of a shard_map step that logs and prints per device, "
        f"{STEPS} times, then effects_barrier():")
  results = launcher.launch(
      f"{__name__}:shard_map_logging", num_processes=num_processes,
      devices_per_process=devices_per_process, timeout=timeout)
  failed = False
  for r in results:
    res = r.result
    write(f"\nprocess {r.process_id}: devices {res['local_device_ids']} at mesh "
          f"positions {[res['mesh_device_ids'].index(d) for d in res['local_device_ids']]}")
    for e in res["events"]:
      if e["kind"] == "log":
        write(f"  log   device={e['device_id']} shard={e['shard_index']} "
              f"process={e['process_index']}: {e['message']}")
      else:
        write(f"  print {e['line']}")
    problems = _check(res)
    failed = failed or bool(problems)
    write("  -> " + ("; ".join(problems) if problems else
                     "every record attributed to this process's devices; "
                     "each device's records in program order"))
  write("\nEach process delivers its own devices' effects, in order per device "
        "(and per thread/effect across calls); nothing orders one process's "
        "output against another's (see design/multihost.md). The print after "
        "the shard_map runs once, on the mesh's first device (process 0).")
  return 1 if failed else 0

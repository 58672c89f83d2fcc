"""Multi-process programs (``jax.distributed``): two JAX processes on 127.0.0.1
(``design/multihost.md``).

Each process has 2 simulated CPU devices and gloo CPU collectives; both run
``jax_effects._tools.multiprocess_program.shard_map_logging`` (a ``jax_effects.jit``
of a ``shard_map`` step over a mesh of all 4 devices that logs and prints per
device, called several times, then ``effects_barrier()``), launched by
``jax_effects._tools.launcher.launch`` (free port, bounded time, cleanup).
The checks are on what each process observed: attribution of every record
(process, device, mesh position), per-device program order across calls, the
order within a process around each ``shard_map``, and per-process tokens.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from jax_effects._tools import launcher
from jax_effects._tools import multiprocess_program

from helpers import run_python

TIMEOUT = 120  # seconds for the whole two-process run, startup included
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def results():
  return launcher.launch(
      "jax_effects._tools.multiprocess_program:shard_map_logging",
      num_processes=2, devices_per_process=2, timeout=TIMEOUT)


def _expected_device_messages(position: int, steps: int) -> list[str]:
  """What the device at mesh ``position`` logs, in its program order."""
  block = np.arange(8, dtype=np.float32)[2 * position:2 * position + 2]
  out = []
  for s in range(steps):
    out.append(f"step {s} first sum={np.float32(block.sum())}")
    block = block * 2
    out.append(f"step {s} second sum={np.float32(block.sum())}")
  return out


def test_each_process_ran_with_its_own_devices(results):
  assert [r.process_id for r in results] == [0, 1]
  meshes = {tuple(r.result["mesh_device_ids"]) for r in results}
  assert len(meshes) == 1, "both processes must build the same global mesh"
  (mesh,) = meshes
  locals_ = [r.result["local_device_ids"] for r in results]
  assert all(len(ids) == 2 for ids in locals_)
  assert sorted(locals_[0] + locals_[1]) == sorted(mesh)
  for r in results:
    assert r.returncode == 0
    assert r.result["process_index"] == r.process_id
    assert r.result["process_count"] == 2


def test_records_are_attributed_to_their_process_device_and_shard(results):
  for r in results:
    res = r.result
    mesh = res["mesh_device_ids"]
    logs = [e for e in res["events"] if e["kind"] == "log"]
    assert logs, f"process {r.process_id} logged nothing:\n{r.describe()}"
    for e in logs:
      assert e["process_index"] == r.process_id, e
      assert e["device_id"] in res["local_device_ids"], e
      assert e["shard_index"] == mesh.index(e["device_id"]), e
    # every local device logged, at its own mesh positions only
    assert sorted({e["device_id"] for e in logs}) == sorted(res["local_device_ids"])
    assert sorted({e["shard_index"] for e in logs}) == sorted(
        mesh.index(d) for d in res["local_device_ids"])


def test_per_device_order_across_calls(results):
  for r in results:
    res = r.result
    mesh = res["mesh_device_ids"]
    for device in res["local_device_ids"]:
      got = [e["message"] for e in res["events"]
             if e["kind"] == "log" and e["device_id"] == device]
      assert got == _expected_device_messages(mesh.index(device), res["steps"]), (
          f"process {r.process_id} device {device}")


def _step(event) -> int:
  text = event["message"] if event["kind"] == "log" else event["line"]
  return int(text.split("step ", 1)[1].split(" ", 1)[0])


def test_order_within_each_process(results):
  """Per-device prints interleave with logs in program order; each step's
  effects in a process come before the next step's (the runtime token of a
  call depends on every effect of the previous call)."""
  for r in results:
    res = r.result
    mesh = res["mesh_device_ids"]
    events = res["events"]
    for device in res["local_device_ids"]:
      prefix = (f"[device {device} shard {mesh.index(device)} "
                f"process {r.process_id}] ")
      mine = [e for e in events
              if (e["kind"] == "log" and e["device_id"] == device)
              or (e["kind"] == "print" and e["line"].startswith(prefix))]
      kinds = [(e["kind"], _step(e)) for e in mine]
      assert kinds == [(k, s) for s in range(res["steps"])
                       for k in ("log", "print", "log")], f"device {device}"
    steps = [_step(e) for e in events]
    assert steps == sorted(steps), f"process {r.process_id}: {steps}"


def test_automatic_partitioning_effect_runs_once_in_process_zero(results):
  """The print after the shard_map runs once, on the mesh's first device."""
  steps = results[0].result["steps"]
  for r in results:
    totals = [e["line"] for e in r.result["events"]
              if e["kind"] == "print" and " total=" in e["line"]]
    if r.process_id == 0:
      expected = [f"step {s} total={np.float32(np.arange(8).sum() * 2 ** (s + 1))}"
                  for s in range(steps)]
      assert totals == expected
      # each total follows every per-device effect of its step in process 0
      events = r.result["events"]
      for s in range(steps):
        i = events.index({"kind": "print", "line": expected[s]})
        assert all(_step(e) == s for e in events[i - 6:i]), events
    else:
      assert totals == []


def test_runtime_tokens_are_per_process(results):
  for r in results:
    assert r.result["runtime_token_devices"] == sorted(r.result["local_device_ids"])


@pytest.fixture(scope="module")
def deterministic_results():
  return launcher.launch(
      "jax_effects._tools.multiprocess_program:shard_map_logging_deterministic",
      num_processes=2, devices_per_process=2, timeout=TIMEOUT)


def test_deterministic_view_in_every_process(deterministic_results):
  """Inside ``deterministic()`` each process delivers its own devices' output
  of each step sorted by (program point, device id), as soon as the step's
  effects ran (before the barrier that follows the step), not at block exit."""
  for r in deterministic_results:
    res = r.result
    mesh = res["mesh_device_ids"]
    devices = sorted(res["local_device_ids"])
    expected = []
    for s in range(res["steps"]):
      msgs = {d: _expected_device_messages(mesh.index(d), res["steps"])[2 * s:2 * s + 2]
              for d in devices}
      for point in range(3):
        for d in devices:
          if point == 1:
            expected.append({"kind": "print", "line":
                             f"[device {d} shard {mesh.index(d)} process "
                             f"{r.process_id}] step {s} per-device"})
          else:
            expected.append({"kind": "log", "message": msgs[d][point // 2],
                             "device_id": d, "shard_index": mesh.index(d),
                             "process_index": r.process_id})
      if r.process_id == 0:
        total = np.float32(np.arange(8).sum() * 2 ** (s + 1))
        expected.append({"kind": "print", "line": f"step {s} total={total}"})
      expected.append({"kind": "barrier", "step": s})
    assert res["events"] == expected, f"process {r.process_id}"


# --- the launcher itself ---------------------------------------------------------

def _gone(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  return False


def test_launcher_stops_every_process_when_one_fails():
  env = {"PYTHONPATH": os.pathsep.join(
      [HERE, os.environ.get("PYTHONPATH", "")])}
  with pytest.raises(launcher.LaunchError,
                     match=r"process 1 exited with code 1") as info:
    launcher.launch("multiprocess_targets:fail_in_process_one",
                         num_processes=2, devices_per_process=1,
                         timeout=TIMEOUT, env=env)
  results = info.value.results
  assert "ValueError: process 1 fails on purpose" in results[1].stderr
  assert results[0].returncode is None     # was still waiting: killed
  assert all(_gone(r.pid) for r in results)


def test_launcher_bounds_time():
  env = {"PYTHONPATH": os.pathsep.join(
      [HERE, os.environ.get("PYTHONPATH", "")])}
  with pytest.raises(launcher.LaunchError, match="timed out") as info:
    launcher.launch("multiprocess_targets:hang", num_processes=2,
                         devices_per_process=1, timeout=3, env=env)
  assert all(r.returncode is None and _gone(r.pid) for r in info.value.results)


def test_launcher_rejects_bad_target():
  with pytest.raises(ValueError, match="module:function"):
    launcher.launch("jax_effects._tools.multiprocess_program")


def test_demo_command_with_processes():
  out = run_python("-m", "jax_effects", "demo", "--processes", "2",
                   timeout=TIMEOUT + 30)
  assert out.returncode == 0, out.stdout + out.stderr
  lines = out.stdout.splitlines()
  assert "process 0: devices [0, 1] at mesh positions [0, 1]" in lines
  assert any(l.startswith("process 1: devices [") and
             l.endswith("at mesh positions [2, 3]") for l in lines)
  verdicts = [l for l in lines if l.startswith("  -> ")]
  assert verdicts == ["  -> every record attributed to this process's devices; "
                      "each device's records in program order"] * 2
  logs = [l for l in lines if l.startswith("  log ")]
  assert len(logs) == 2 * 2 * 2 * multiprocess_program.STEPS   # processes x devices x 2 x steps

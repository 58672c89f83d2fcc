"""Launcher for multi-process JAX programs on one machine (``jax.distributed``).

A multi-host JAX program runs one Python process per host; each process
calls ``jax.distributed.initialize`` and then sees the global device list but
addresses only its own devices. :func:`launch` reproduces that on one machine
so the test suite and ``python -m jax_effects demo --processes N`` can run a
real multi-process program:

* it picks a free coordinator port (binds ``127.0.0.1:0``); process 0 checks
  it before starting the coordinator and exits with ``EXIT_PORT_IN_USE`` if
  another program took it meanwhile, and the launcher retries on another
  port (a port the caller gave is a clear ``OSError`` instead),
* everything a launched run listens on is bound to 127.0.0.1, so nothing of
  it is reachable from another host: the coordination service (JAX's default
  binds every interface: ``coordinator_bind_address``), probed by the port
  check at that same address, and the CPU collectives' connections (gloo
  would bind the address of the machine's hostname:
  ``_compat.cpu_collectives_on_host``); ``design/multihost.md`` says what a
  real multi-host run sets instead,
* starts ``num_processes`` children ``python -m jax_effects._tools.launcher
  worker TARGET``, each in its own process group, with the coordinator
  address, process count, process id and simulated CPU device count in its
  environment (``JAX_EFFECTS_*``),
* collects each child's stdout, stderr and JSON result (written to a file,
  so effect output on stdout never mixes with it),
* bounds the wall time: on timeout, or as soon as one child fails (the others
  would otherwise wait for it in a collective or at the coordinator), every
  child's process group is killed; all children are reaped in ``finally``.

In the child, :func:`worker_main` configures JAX *before* its backend starts
(``jax_num_cpu_devices``, ``jax_cpu_collectives_implementation="gloo"`` for
cross-process CPU collectives), calls ``jax.distributed.initialize``, imports
``TARGET`` (``"package.module:function"``), calls it with no arguments and
writes its JSON-serialisable return value to the result file. If the target
raises, the child prints the traceback and exits with code 1 at once (its
peers may be blocked waiting for it; the launcher then stops them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Sequence

ENV_COORDINATOR = "JAX_EFFECTS_COORDINATOR"
ENV_NUM_PROCESSES = "JAX_EFFECTS_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_EFFECTS_PROCESS_ID"
ENV_DEVICES = "JAX_EFFECTS_DEVICES_PER_PROCESS"
ENV_RESULT = "JAX_EFFECTS_RESULT_FILE"
#: Exit status of process 0 when the coordinator port is taken (EX_TEMPFAIL):
#: the launcher then retries with another port (when it picked the port).
EXIT_PORT_IN_USE = 75
#: How many ports the launcher tries when another program takes the one it
#: picked between picking it and the coordinator binding it.
PORT_ATTEMPTS = 3


class LaunchError(RuntimeError):
  """A child process failed or the launch ran out of time.

  ``results`` holds every child's :class:`ProcessResult` (output so far).
  """

  def __init__(self, message: str, results: Sequence["ProcessResult"]):
    self.results = list(results)
    details = "\n".join(r.describe() for r in self.results)
    super().__init__(f"{message}\n{details}")


@dataclasses.dataclass
class ProcessResult:
  """What one child process left behind."""
  process_id: int
  pid: int                 # the OS process id (the child led its own group)
  returncode: int | None   # None: killed by the launcher (timeout / peer failure)
  stdout: str
  stderr: str
  result: Any              # the target's return value (JSON), None if none

  def describe(self, tail: int = 3000) -> str:
    return (f"--- process {self.process_id}: returncode={self.returncode}\n"
            f"stdout (tail):\n{self.stdout[-tail:]}\n"
            f"stderr (tail):\n{self.stderr[-tail:]}")


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port on ``host`` that was free a moment ago (bound to port 0)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
  """Whether binding ``host:port`` fails with EADDRINUSE right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    try:
      s.bind((host, port))
    except OSError as err:
      if err.errno == errno.EADDRINUSE:
        return True
      raise
  return False


def _kill_group(proc: subprocess.Popen) -> None:
  if proc.poll() is not None:
    return
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGKILL)   # the child leads its own group


def launch(target: str, num_processes: int = 2, devices_per_process: int = 2,
           timeout: float = 120.0, env: dict[str, str] | None = None,
           check: bool = True,
           coordinator_port: int | None = None) -> list[ProcessResult]:
  """Runs ``target`` (``"module:function"``) in ``num_processes`` JAX processes.

  Returns one :class:`ProcessResult` per process, in process-id order. With
  ``check=True`` (default) raises :class:`LaunchError` (with every child's
  output) if any child exits non-zero or the launch exceeds ``timeout``
  seconds; all children are killed before it returns or raises.

  ``coordinator_port``: the coordinator's port on 127.0.0.1 (None: a free one
  is picked). Process 0 checks the port before starting the coordinator and
  exits with :data:`EXIT_PORT_IN_USE` if it is taken (the peers are stopped at
  once); a picked port is then replaced by another (up to
  :data:`PORT_ATTEMPTS` ports), a given one is an ``OSError`` naming it.
  """
  if ":" not in target:
    raise ValueError(f"target must be 'module:function', got {target!r}")
  if num_processes < 1 or devices_per_process < 1:
    raise ValueError("num_processes and devices_per_process must be >= 1")
  for attempt in range(1 if coordinator_port is not None else PORT_ATTEMPTS):
    port = coordinator_port if coordinator_port is not None else free_port()
    if coordinator_port is not None and port_in_use(port):
      raise _port_error(port)
    results, failure = _launch_once(target, num_processes, devices_per_process,
                                    timeout, env, f"127.0.0.1:{port}")
    if results and results[0].returncode == EXIT_PORT_IN_USE:
      if coordinator_port is not None:
        raise _port_error(port)
      continue   # taken since it was picked: another port
    break
  else:
    raise LaunchError(
        f"jax_effects multi-process launch of {target!r}: {PORT_ATTEMPTS} "
        "coordinator ports were taken by other programs before the "
        "coordinator could bind them", results)
  if check and failure:
    raise LaunchError(f"jax_effects multi-process launch of {target!r}: {failure}",
                      results)
  return results


def _port_error(port: int) -> OSError:
  return OSError(
      errno.EADDRINUSE,
      f"jax_effects multi-process launch: coordinator port {port} on "
      "127.0.0.1 is already in use; pass another coordinator_port, or None "
      "to let the launcher pick a free one")


def _launch_once(target, num_processes, devices_per_process, timeout, env,
                 coordinator):
  """One launch; returns (results, failure message or None)."""
  procs: list[subprocess.Popen] = []
  files = []
  killed: set[int] = set()
  with tempfile.TemporaryDirectory(prefix="jax_effects_mp_") as tmp:
    try:
      for pid in range(num_processes):
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env.update({
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(pid),
            ENV_DEVICES: str(devices_per_process),
            ENV_RESULT: os.path.join(tmp, f"result{pid}.json"),
        })
        out = open(os.path.join(tmp, f"stdout{pid}"), "w+b")
        err = open(os.path.join(tmp, f"stderr{pid}"), "w+b")
        files.append((out, err))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jax_effects._tools.launcher", "worker", target],
            stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=child_env,
            start_new_session=True))
      failure = _wait(procs, timeout, killed)
    finally:
      for proc in procs:
        if proc.poll() is None:
          killed.add(proc.pid)
        _kill_group(proc)
      for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
          proc.wait(timeout=10)
    results = []
    for pid, (proc, (out, err)) in enumerate(zip(procs, files)):
      out.seek(0)
      err.seek(0)
      stdout = out.read().decode(errors="replace")
      stderr = err.read().decode(errors="replace")
      out.close()
      err.close()
      result = None
      path = os.path.join(tmp, f"result{pid}.json")
      if os.path.exists(path):
        with open(path) as f:
          result = json.load(f)
      results.append(ProcessResult(
          pid, proc.pid, None if proc.pid in killed else proc.returncode,
          stdout, stderr, result))
  return results, failure


def _wait(procs: list[subprocess.Popen], timeout: float,
          killed: set[int]) -> str | None:
  """Waits for all children; kills all on timeout or a child's failure."""
  deadline = time.monotonic() + timeout
  while True:
    codes = [p.poll() for p in procs]
    failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      for p in procs:
        if p.poll() is None:
          killed.add(p.pid)
          _kill_group(p)
      return (f"process {failed[0]} exited with code {codes[failed[0]]}; "
              "the others were stopped")
    if all(c == 0 for c in codes):
      return None
    if time.monotonic() > deadline:
      for p in procs:
        if p.poll() is None:
          killed.add(p.pid)
          _kill_group(p)
      return f"timed out after {timeout:.0f} s; all processes were killed"
    time.sleep(0.05)


# --- child side ----------------------------------------------------------------

def worker_main(target: str) -> None:
  """Child entry point: configure JAX, join the cluster, run ``target``."""
  import jax  # imported here: the launcher side must not start a backend
  from jax_effects import _compat

  coordinator = os.environ[ENV_COORDINATOR]
  num_processes = int(os.environ[ENV_NUM_PROCESSES])
  process_id = int(os.environ[ENV_PROCESS_ID])
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", int(os.environ[ENV_DEVICES]))
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if process_id == 0:
    host, _, port = coordinator.rpartition(":")
    if port_in_use(int(port), host):
      # Taken since the launcher picked it (or given taken): say so and stop
      # (the launcher stops the peers waiting for this coordinator, and picks
      # another port if it chose this one).
      sys.stderr.write(f"jax_effects: coordinator port {port} on {host} is "
                       "already in use\n")
      sys.stderr.flush()
      os._exit(EXIT_PORT_IN_USE)
  try:
    # Bound where the port was checked (127.0.0.1), not JAX's default of
    # every interface: a launched run is reachable from this machine only.
    jax.distributed.initialize(coordinator_address=coordinator,
                               coordinator_bind_address=coordinator,
                               num_processes=num_processes,
                               process_id=process_id, initialization_timeout=60)
  except Exception as err:  # noqa: BLE001 - the bind raced with another program
    text = str(err).lower()
    if process_id == 0 and ("address already in use" in text
                            or "eaddrinuse" in text):
      sys.stderr.write(f"jax_effects: coordinator port of {coordinator} is "
                       f"already in use: {err}\n")
      sys.stderr.flush()
      os._exit(EXIT_PORT_IN_USE)
    raise
  # The CPU collectives listen on the coordinator's (loopback) address too.
  _compat.cpu_collectives_on_host(coordinator.rpartition(":")[0])
  try:
    module_name, _, fn_name = target.partition(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    result = fn()
    path = os.environ.get(ENV_RESULT)
    if path:
      tmp = path + ".tmp"
      with open(tmp, "w") as f:
        json.dump(result, f)
      os.replace(tmp, path)
  except BaseException:  # noqa: BLE001
    # Exit now: a normal exit would run jax.distributed's shutdown (and
    # jax_effects' barrier) at exit, which wait for the other processes,
    # which may be waiting for this one in a collective.
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
  sys.stdout.flush()
  jax.distributed.shutdown()


if __name__ == "__main__":
  if len(sys.argv) != 3 or sys.argv[1] != "worker":
    sys.exit("usage: python -m jax_effects._tools.launcher worker module:function")
  worker_main(sys.argv[2])

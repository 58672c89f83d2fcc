"""Test helpers shared by the test modules (fixtures live in ``conftest.py``).

* :func:`scale`: a size chosen at collection (CI default, or ``--run-slow``).
* :class:`Recorder`: ordered host callbacks recording ``(tag, *values)``.
* :func:`eager`, :data:`RUNNERS`: run a function eagerly or under ``je.jit``.
* :class:`Boom`: the exception test callbacks raise.
* :func:`in_thread`, :func:`run_threads`: test code on other Python threads
  (each has its own token state), bounded by :data:`JOIN_TIMEOUT_S`.
* :func:`run_python`, :func:`run_script`: Python in a fresh process (where
  exit, fork, XLA's start-up flags, stderr written by C++ or the process's
  network is at stake), bounded in time: every test that starts Python in a
  subprocess does it through them; :func:`run_scenario` runs a function of
  a test module there (8 devices, a watchdog that names a hang).
* :func:`runtime_inventory`: what the runtime holds (errors, host jobs,
  pieces of summarized prints, bars, exited threads' state), the one place
  that knows where; faults through public APIs: :func:`per_device_stage`
  (a ``pure_callback`` per device), :class:`FlakyStream` (a ``sys.stdout``
  whose write raises once).
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import jax_effects as je

#: Set by ``conftest.pytest_configure``: ``--run-slow`` (or the environment
#: variable ``JAX_EFFECTS_RUN_SLOW=1``) selects the long variants.
RUN_SLOW = False

JOIN_TIMEOUT_S = 900

#: The custom call of every host call jax_effects lowers for CPU
#: (``_primitives/host_target.py``, ``design/host_target.md``).
HOST_CALL = "jax_effects_host"


def scale(default, slow):
  """``slow`` under ``--run-slow``, else ``default`` (read at collection).

  Generated-case counts and stress sizes are chosen here, as JAX's
  ``JAX_NUM_GENERATED_CASES`` does, so a run collects what it runs.
  """
  return slow if RUN_SLOW else default


def sharded(mesh, x):
  """``x`` split along ``mesh``'s axis ``"i"``."""
  return jax.device_put(x, NamedSharding(mesh, P("i")))


def reports(call):
  """What ``call()`` and then barriers raise, until a barrier raises nothing."""
  got = []
  try:
    call()
  except BaseException as exc:  # noqa: BLE001 - collected for the test
    got.append(exc)
  for _ in range(10):
    try:
      je.effects_barrier()
      return got
    except BaseException as exc:  # noqa: BLE001
      got.append(exc)
  raise AssertionError(f"barriers keep raising: {got}")


def flat(report):
  """The errors of a report: a group's members, or the one error."""
  if isinstance(report, BaseExceptionGroup):
    return list(report.exceptions)
  return [report]


class Boom(Exception):
  """Raised by test callbacks."""


def failing_jit(message: str):
  """A plain ``jax.jit`` function whose computation fails as a whole in XLA
  (a ``jax.pure_callback`` raising ``Boom(message)``): its results carry
  the failure."""
  def boom(x):
    raise Boom(message)

  return jax.jit(lambda x: jax.pure_callback(
      boom, jax.ShapeDtypeStruct(x.shape, x.dtype), x))


class FailingRecorder:
  """A callback recording its arguments as an int tuple (the *key*); every
  ``fail_every``-th call (none if 0) raises ``Boom(key)`` instead, kept in
  ``raised[key]``. ``delay`` (seconds) keeps calls in flight (never a timing
  assertion)."""

  def __init__(self, fail_every, delay=0.0):
    self.lock = threading.Lock()
    self.calls = 0
    self.fail_every = fail_every
    self.delay = delay
    self.records = []
    self.raised = {}   # key -> the Boom instance raised for it

  def __call__(self, *key):
    key = tuple(int(k) for k in key)
    if self.delay:
      time.sleep(self.delay)
    with self.lock:
      self.calls += 1
      fail = self.fail_every and self.calls % self.fail_every == 0
      if fail:
        exc = self.raised[key] = Boom(key)
      else:
        self.records.append(key)
    if fail:
      raise exc


def two_effects(prefix: str):
  """``(f, a, b)``: a ``je.jit`` function printing ``a{x}`` on Effect ``a``
  and ``b{x}`` on Effect ``b`` (named ``prefix-a``/``prefix-b``)."""
  a, b = je.Effect(f"{prefix}-a"), je.Effect(f"{prefix}-b")

  @je.jit
  def f(x):
    je.print("a{}", x, effect=a)
    je.print("b{}", x, effect=b)
    return x + 1
  return f, a, b


class Recorder:
  """Ordered host callbacks that append ``(tag, *values)`` to ``self.events``.

  ``rec(tag, *vals, effect=None)`` inside traced code binds one callback;
  :meth:`take` waits for effects and returns (and clears) the events;
  :meth:`run` runs a function under ``je.jit`` and eagerly (``disable_jit``),
  checks the outputs agree and returns both event lists.
  """

  def __init__(self):
    self.events = []

  def __call__(self, tag, *vals, effect=None):
    def host(*xs):
      self.events.append((tag, *(np.asarray(x).tolist() for x in xs)))
    je.callback(host, None, *vals, effect=effect)

  def take(self):
    je.effects_barrier()
    events, self.events = self.events, []
    return events

  def run(self, fun, *args):
    """Events of ``je.jit(fun)(*args)`` and of eager execution; both outs."""
    self.events = []
    out = je.jit(fun)(*args)
    jitted = self.take()
    with jax.disable_jit():
      eager_out = fun(*args)
    eager = self.take()
    jax.tree_util.tree_map(np.testing.assert_allclose, out, eager_out)
    return jitted, eager


def eager(f):
  """A "runner" that leaves ``f`` as it is (see :data:`RUNNERS`)."""
  return f


#: ``@pytest.mark.parametrize("run", RUNNERS)``: the same test eagerly and
#: under ``je.jit``.
RUNNERS = [pytest.param(eager, id="eager"), pytest.param(je.jit, id="je.jit")]


def in_thread(fn, *args):
  """Runs ``fn(*args)`` in a fresh thread; returns its result or raises."""
  box = {}

  def target():
    try:
      box["out"] = fn(*args)
    except BaseException as e:  # noqa: BLE001 - re-raised below
      box["err"] = e

  t = threading.Thread(target=target)
  t.start()
  t.join(JOIN_TIMEOUT_S)
  assert not t.is_alive(), "the thread hangs"
  if "err" in box:
    raise box["err"]
  return box["out"]


def run_threads(targets, *, start_together=True):
  """Runs each target in its own thread (released together by default).

  Fails if a thread hangs; re-raises the first exception a target raised.
  """
  errors = []
  go = threading.Event()

  def wrap(fn):
    def run():
      if start_together:
        go.wait()
      try:
        fn()
      except BaseException as exc:  # noqa: BLE001 - re-raised below
        errors.append(exc)
    return run

  threads = [threading.Thread(target=wrap(t)) for t in targets]
  for t in threads:
    t.start()
  go.set()
  for t in threads:
    t.join(JOIN_TIMEOUT_S)
  assert not any(t.is_alive() for t in threads), "a worker thread hangs"
  if errors:
    raise errors[0]


class NotReadyYet:
  """``int32[1]`` arrays, one on each of ``devices`` (``.arrays``; ``.array``
  the first), that are not ready until :meth:`release`: the output shards of
  a ``shard_map`` over ``devices`` (at least 2) whose callback waits on an
  event (a computation over several CPU devices is
  launched asynchronously; one on one device whose inputs are ready may run
  inline in the dispatching call). A computation dispatched on it returns at
  once and runs on one of XLA's threads once it is released: what it did
  before the release is what the dispatch alone did.

  Use as a context manager: leaving releases it (a failed test never leaves
  XLA's threads waiting)."""

  def __init__(self, devices, value: int = 0):
    devices = list(devices)
    import threading
    from jax.experimental import io_callback
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    self._event = threading.Event()
    event = self._event
    mesh = Mesh(np.array(devices), ("gate",))

    def wait(x):
      if not event.wait(120):
        raise TimeoutError("NotReadyYet was never released")
      return x

    gate = jax.jit(jax.shard_map(
        lambda x: io_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                              ordered=False),
        mesh=mesh, in_specs=P("gate"), out_specs=P("gate")))
    x = jax.device_put(np.full((len(devices),), value, np.int32),
                       NamedSharding(mesh, P("gate")))
    self._out = gate(x)
    by_device = {s.device: s.data for s in self._out.addressable_shards}
    self.arrays = [by_device[d] for d in devices]
    self.array = self.arrays[0]
    assert not self.array.is_ready(), "the gate ran synchronously"

  def release(self):
    self._event.set()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()
    self._out.block_until_ready()


#: The start of a :func:`run_script` program: 8 simulated CPU devices, a mesh
#: ``("i",)`` over them and ``x = arange(8)`` sharded along it.
PRELUDE_8_DEVICES = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_effects as je
mesh = Mesh(np.array(jax.devices()), ("i",))
x = jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, P("i")))
"""


def run_python(*argv: str | os.PathLike, timeout: float = 300,
               env: dict[str, str | None] | None = None,
               cwd: str | os.PathLike | None = None
               ) -> subprocess.CompletedProcess:
  """Runs ``python *argv`` (this interpreter) in a fresh process; returns the
  completed process (text stdout, stderr, returncode). Raises
  ``subprocess.TimeoutExpired`` (killing it) after ``timeout`` seconds.

  ``env`` updates this process's environment (a value ``None`` removes the
  variable). The child imports the same ``jax_effects`` as the tests: a
  source checkout's (not an installed package's) folder goes first on
  ``PYTHONPATH``; an installed one is not shadowed by the working folder.
  """
  full_env = dict(os.environ)
  for name, value in (env or {}).items():
    if value is None:
      full_env.pop(name, None)
    else:
      full_env[name] = value
  root = os.path.dirname(os.path.dirname(os.path.abspath(je.__file__)))
  if os.path.basename(root) not in ("site-packages", "dist-packages"):
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, full_env.get("PYTHONPATH")) if p)
  elif argv and argv[0] in ("-c", "-m"):
    # An installed package (tox): ``-c``/``-m`` would put the working folder
    # first on sys.path, and from a checkout's root that is the source tree,
    # whose jax_effects has no compiled parts (a clean clone builds none).
    full_env["PYTHONSAFEPATH"] = "1"
  return subprocess.run([sys.executable, *map(os.fspath, argv)],
                        capture_output=True, text=True, timeout=timeout,
                        env=full_env, cwd=cwd)


def run_script(source: str, *args: str, timeout: float = 300,
               env: dict[str, str | None] | None = None
               ) -> subprocess.CompletedProcess:
  """Runs ``source`` (dedented) as ``python -c`` with ``args``
  (:func:`run_python`)."""
  return run_python("-c", textwrap.dedent(source), *args, timeout=timeout,
                    env=env)


def scenario_lines(proc: subprocess.CompletedProcess, name: str,
                   stream: str = "stdout") -> list[str]:
  """The lines scenario ``name`` printed in a child that runs several,
  each after a line ``== name`` (the last followed by ``== end``): the
  scenario the child died in, and those it never reached, fail their own
  tests (with its stderr); the ones it finished are judged by their lines;
  a child that exits with an error after all of them fails every one.
  (``stream="stderr"``: what it wrote to stderr, after the same lines
  written there.)"""
  lines = getattr(proc, stream).splitlines()
  died = (f"the child exited with status {proc.returncode}\n"
          f"{proc.stderr[-4000:]}")
  assert f"== {name}" in lines, f"scenario {name!r} never ran: {died}"
  start = lines.index(f"== {name}") + 1
  end = next((i for i in range(start, len(lines))
              if lines[i].startswith("== ")), None)
  assert end is not None, (
      f"scenario {name!r} did not finish: {lines[start:]}; {died}")
  assert proc.returncode == 0 or "== end" not in lines, died
  return lines[start:end]


# --- faults injected through public APIs, and what the runtime holds ----------
# (issue 31: tests/runtime/test_failed_executions.py and the files it names,
# and the model-based test tests/runtime/fault_model.py)

def runtime_inventory() -> dict[str, int]:
  """What the runtime holds now, per registry: every count is 0 once every
  execution has ended and an all-threads barrier has reported every error
  (the contract of issue 31: nothing is kept for an execution that ended or
  a thread that exited).

  The one place that knows where the runtime keeps things: when the
  runtime's owners change, re-point this function, not the tests.
  """
  from jax_effects._runtime import (bars, errors, executions, host_jobs,
                                    interrupts, output)
  from jax_effects._runtime import threads as thread_slots
  # (a thread whose state outlived its end, in a caller's frame or a
  # traceback, leaves its slot when the state goes; the runtime frees such
  # slots at the next thread start or all-threads barrier: here, now)
  thread_slots.sweep()
  try:
    import tqdm
    tqdm_bars = len(getattr(tqdm.tqdm, "_instances", ()))
  except ImportError:
    tqdm_bars = 0
  live = {s.slot for s in thread_slots.all_states() if s.alive()}
  with host_jobs.lock:
    lanes = [lane for lanes in list(host_jobs.queues.values())
             for lane in lanes]
    # (a chain keeps the memo of its last failed execution, one lane, whose
    # late effects on a device still running it must skip: bounded by the
    # slots and chains, it goes at the chain's next execution on its slot,
    # a later owner's too; an ended thread's may be filed after its slot
    # was freed, by the watcher, which learns of a failure on its own time)
    memos = sum(1 for chain_lanes in list(host_jobs.queues.values())
                if host_jobs.memo(chain_lanes))
    sites = list(host_jobs._sites)
    pieces = sum(len(q) for site in sites
                 for e in list(site.parts.values())
                 for q in list(e.by_device.values()))
    # (a live thread's site keeps the sequence number of its last
    # execution there, to know a late piece stale; an ended thread's goes)
    ended_entries = sum(1 for site in sites for slot in list(site.parts)
                        if slot not in live)
  return {
      # callback errors filed and not reported yet (kept or only counted)
      "deferred_errors": (sum(map(len, list(errors.deferred.values())))
                          + sum(list(errors._dropped.values()))),
      # effects left to run on the host, and their lanes
      "host_jobs": sum(len(lane.jobs) for lane in lanes),
      "job_slots": (len(host_jobs.queues) - memos
                    + len(host_jobs._draining)),
      # pieces of summarized prints waiting at call sites, and the entries
      # kept there for threads that ended
      "piece_entries": pieces + ended_entries,
      "open_bars": bars.open_bars(),
      "tqdm_bars": tqdm_bars,
      "held_output": sum(map(len, list(output._held.values()))),
      # token state of threads that have exited, and their pending tokens
      "exited_thread_states": sum(not s.alive()
                                  for s in thread_slots.all_states()),
      "orphan_tokens": len(thread_slots.orphans()),
      # slots of ended threads not freed yet, computations watched, calls
      # marked interrupted
      "ended_slots": thread_slots.held_slots(),
      "watched_executions": executions.watched(),
      "interrupted_calls": len(interrupts.slots),
  }


def leftovers(inventory: dict[str, int]) -> dict[str, int]:
  """The nonzero entries of :func:`runtime_inventory`'s result."""
  return {k: v for k, v in inventory.items() if v}


class Injected(Exception):
  """The exception an injected fault raises; ``str`` names the fault, so
  XLA's message for a failed execution says whose it was."""


#: NumPy print options under which :func:`call_values`' (8, 8) array is
#: summarized (rows 0-2 and 5-7, columns 0-2 and 5-7: six devices' parts
#: are shown), captured by the prints traced under them.
SUMMARIZED = dict(threshold=10, edgeitems=3)


def call_values(call: int) -> np.ndarray:
  """Call ``call``'s (8, 8) ``int32`` input: ``call * 1000 + row * 10 +
  column``, so every printed value names its call, and its device once the
  rows are split over 8 devices."""
  return (call * 1000 + np.arange(8)[:, None] * 10
          + np.arange(8)[None, :]).astype(np.int32)


def per_device_stage(mesh, host):
  """An identity stage over ``mesh`` (axis ``"i"``, leading dimension split)
  whose every device calls ``host(block)`` on its own block (a NumPy
  array) through
  ``jax.pure_callback`` inside ``shard_map`` (left to JAX, not adopted):
  ``host`` raising fails that device's computation (an XLA failure of the
  whole execution), ``host`` sleeping makes that device slow. What is
  computed from the stage's output comes after ``host`` on each device (a
  data dependency), so an effect on it, or its part of a summarized print,
  never runs before the fault on that device."""
  def body(v):
    return jax.pure_callback(lambda b: host(np.asarray(b)),
                             jax.ShapeDtypeStruct(v.shape, v.dtype), v)
  return jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))


class FlakyStream:
  """A ``sys.stdout`` replacement forwarding to ``target`` whose ``write``
  raises :attr:`error` (an ``OSError``) once: for the first text containing
  ``marker`` (never if None: a recorder). ``written`` is every text written
  (the failed one excluded), one entry per ``write``."""

  def __init__(self, target, marker: str | None = None):
    self.target = target
    self.marker = marker
    self.error: OSError | None = None
    self.written: list[str] = []
    self._lock = threading.Lock()

  def write(self, text: str) -> int:
    with self._lock:
      if (self.error is None and self.marker is not None
          and self.marker in text):
        self.error = OSError(f"injected write error on {self.marker!r}")
        raise self.error
      self.written.append(text)
    return self.target.write(text)

  def flush(self) -> None:
    self.target.flush()

  def isatty(self) -> bool:
    return False


def shorten_todays_give_up(seconds: float = 1.0) -> None:
  """The runtime before issue 31's fix gave up on effects still waiting for
  a device's part after a barrier had waited 60 s: shortened here so that a
  test shows it in seconds. The contract has no such clock (a barrier waits
  for running work however slow): where it is gone this does nothing."""
  from jax_effects._runtime import barrier
  if hasattr(barrier, "_PATIENCE_S"):
    barrier._PATIENCE_S = seconds


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
  """Polls ``condition()`` until true; fails naming ``what`` after
  ``timeout`` seconds (a bound on a wait, never a timing assertion)."""
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline:
      raise AssertionError(f"{what} (waited {timeout} s)")
    time.sleep(0.01)


#: Seconds a scenario may run before its process dumps every thread's stack
#: and exits (a hang); the subprocess's own time limit is a little longer.
SCENARIO_BOUND_S = 60

_SCENARIO_MAIN = """
import faulthandler, importlib.util, json, signal, sys
# Python's own SIGINT handler and SIGINT unblocked, as in a terminal,
# whatever the parent left (a background job, as under nohup or `cmd &`,
# inherits SIGINT ignored; a blocked SIGINT is inherited too)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
bound, path, name, args, out = (float(sys.argv[1]), sys.argv[2], sys.argv[3],
                                json.loads(sys.argv[4]), sys.argv[5])
faulthandler.dump_traceback_later(bound, exit=True)   # a hang: stacks, exit 1
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, {tests!r})
spec = importlib.util.spec_from_file_location("scenario_module", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
result = getattr(module, name)(*args)
with open(out, "w") as f:
  json.dump(result, f)
"""


class Scenario:
  """A finished :func:`run_scenario`: ``result`` (what the function
  returned), ``stdout``, ``stderr``, ``returncode``."""

  def __init__(self, result, proc):
    self.result = result
    self.stdout = proc.stdout
    self.stderr = proc.stderr
    self.returncode = proc.returncode

  @property
  def lines(self) -> list[str]:
    return self.stdout.splitlines()


def run_scenario(test_file: str, name: str, *args,
                 bound: float = SCENARIO_BOUND_S,
                 env: dict[str, str | None] | None = None) -> Scenario:
  """Runs ``name(*args)`` (a function of the module ``test_file``, JSON
  arguments and result) in a fresh process with 8 CPU devices, bounded in
  time: after ``bound`` seconds (function and interpreter exit) the process
  prints every thread's stack and exits, and the test fails naming the
  hang. A fresh process keeps a runtime that the fault left broken (on the
  code before issue 31's fix) away from the other tests."""
  import json
  import tempfile
  tests = os.path.dirname(os.path.abspath(__file__))
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "result.json")
    try:
      proc = run_python(
          "-c", _SCENARIO_MAIN.format(tests=tests), str(bound),
          os.path.abspath(test_file), name, json.dumps(list(args)), out,
          timeout=bound + 30, env=env)
    except subprocess.TimeoutExpired as exc:
      raise AssertionError(
          f"scenario {name}{args} hangs: still running after {bound + 30} s; "
          f"stderr: {exc.stderr!r:.3000}") from None
    if not os.path.exists(out):
      hang = "Timeout (" in proc.stderr
      raise AssertionError(
          f"scenario {name}{args} "
          + (f"hangs: not done within {bound} s (stacks below)" if hang
             else f"died (status {proc.returncode}) before returning")
          + f"\n--- stdout (end) ---\n{proc.stdout[-2000:]}"
          f"\n--- stderr (end) ---\n{proc.stderr[-6000:]}")
    with open(out) as f:
      result = json.load(f)
  return Scenario(result, proc)

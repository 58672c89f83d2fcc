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
  subprocess does it through them.
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
  ``PYTHONPATH``.
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

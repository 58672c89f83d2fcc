"""Model-based fault injection: random programs x random faults (issue 31).

Each *case* is a small random program run on a few threads: calls of six
compiled templates (:data:`TEMPLATES`: several effect streams, small and
summarized prints over 8 devices under automatic partitioning and in
``shard_map``, callbacks with and without results, a progress bar,
``fori_loop``s, JAX's own ``jax.debug.print``, a callback that calls
another compiled function), barriers (own and all threads), ordering modes
(``set_ordering`` between phases and beside running work, ``ordering()``
around calls), results read at once, later or never; with at most one
fault injected through a public API:

* ``xla-stage``: a ``jax.pure_callback`` raising on one device (per device
  in ``shard_map``, or at one step of a loop): the execution fails in XLA;
* ``xla-partitioned``: a ``jax.debug.callback(..., partitioned=True)``
  raising on one device's shard;
* ``slow``: the same callbacks sleeping on one device or step;
* ``callback-error``: a ``jax_effects.callback`` raising (on one device, or
  at one step);
* ``stdout``: a ``sys.stdout`` whose ``write`` raises once, for one line;
* ``reenter-jax``: a callback (JAX's ``pure_callback`` or a
  ``jax_effects.callback``, on one device or at one step) that launches JAX
  computations and waits for them (JAX issue 25861; ``design/errors.md``,
  "No unbounded wait"): nothing observable changes, nothing may hang.
* ``clear-caches`` (only when named, ``--faults``; issue 37):
  ``jax.clear_caches()`` and ``gc.collect()`` beside the phase of the
  faulty call, once per step it makes (at most ``CLEARS_PER_PHASE``),
  which must change nothing observable.

The model (plain Python, from the contract of issue 31, not from the
implementation, :func:`check`) says what must be observed: every record
(printed line, or callback call) of every call, in the order of its chain
(the ``Effect``; one chain in ``"global"`` mode; per device in
``shard_map``), and the order of a thread's calls; the failed execution's
lines on each chain a prefix of its program's (an XLA failure), or up to
the failed effect (a callback error, a failed write); summarized prints
whole or absent, never mixed (every printed value names its call and
device); every callback error reported once, as itself, to its thread at a
defined point (the call, a later call that then runs nothing, its barrier,
an all-threads barrier); an XLA failure only by its call or by reading its
results; barriers waiting for everything dispatched before them; nothing
left in the runtime after the final all-threads barrier; a call a host
callback makes in its thread's place when the callback runs on that thread
(the outer call ran inline), else as a call of the thread the callback
runs on (one of XLA's), which an all-threads barrier still waits for
(``helpers.runtime_inventory``); no case running past :data:`CASE_BOUND_S`
(a hang: the driver prints every thread's stack and exits).

Where the contract leaves a choice, the model allows both: a failed
execution's callbacks may run or be skipped (only its printed lines must
form a prefix), a barrier may or may not wait for work dispatched while it
waits. One choice is a switch: :data:`WRITE_ERROR_SKIPS_LATER_EFFECTS`.
Not modelled here: interpreter exit (``test_failed_executions.py``,
``test_barriers_wait.py``) and Ctrl-C (``test_interrupts.py``).

The templates are compiled once per process; cases vary inputs, faults,
threads, modes and interleavings. Run by ``test_fault_model.py`` in a
subprocess; by hand::

    python tests/runtime/fault_model.py --seeds 0:200 [--faults stdout,slow]
        [--out results.jsonl] [--verbose]

Each case's line in ``--out`` holds its seed, fault and violations; a
failing seed replays alone with ``--seeds SEED:SEED+1 --verbose``.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import json
import os
import random
import sys
import threading
import time
import traceback

#: Ambiguity kept in one place: after a failed write (a ``sys.stdout``
#: raising for one line), are the later effects of the same chain in the
#: same execution skipped? The contract (C3) makes a failed write "a
#: callback error of that print", and after a callback error those are
#: skipped, as after a ``raise``; every other line (other calls, streams,
#: threads) appears. Set False if the runtime keeps printing them instead.
WRITE_ERROR_SKIPS_LATER_EFFECTS = True

#: A case (all its phases, barriers and checks) must end within this many
#: seconds; its slowest fault sleeps 0.3 s.
CASE_BOUND_S = 45
FAULT_CLASSES = ("none", "xla-stage", "xla-partitioned", "slow",
                 "callback-error", "stdout", "reenter-jax")
#: Classes drawn only when named (``--faults``; issue 37), so that the
#: default draw (and every seed's case) stays what it was:
#: ``clear-caches``: ``jax.clear_caches()`` and ``gc.collect()`` stepping
#: with the faulty call's phase (nothing may change: a site in use is
#: never unbound, ``design/host_target.md``).
EXTRA_FAULT_CLASSES = ("clear-caches",)
#: ``clear-caches``: at most this many clears in the faulty call's phase,
#: one per step it makes (an entry of the log: a driver event, a printed
#: line, a callback's record), while the phase runs on: a case's work is
#: bounded by counts, not by how fast the machine is (issue 49).
CLEARS_PER_PHASE = 8
TEMPLATES = ("partitioned", "summarized", "shard_map", "loop", "streams",
             "reentrant")
#: How often each template is drawn.
WEIGHTS = (2, 2, 2, 2, 2, 1)
#: The template of the call a ``reentrant`` call's callback makes (uid + 1):
#: over 8 devices, so it runs asynchronously, after its callback returned.
INNER = "shard_map"
MODES = ("per_effect", "global")
SLEEP_S = 0.3
#: ``reenter-jax``: the faulty callback waits this long before it launches
#: computations, while its thread dispatches this many computations that
#: wait for the faulty call's result (JAX issue 25861's shape).
REENTER_PAUSE_S = 0.1
REENTER_AHEAD = 48
#: Uids of the warm-up's calls (a case's are ``seed * 64 + k``; a value
#: ``uid * 1000 + 157`` must fit in int32).
WARM_UP_UID = 2_100_000
MAX_SEED = 32_000
OPTIONS = dict(threshold=10, edgeitems=3)   # (8, 8), (2, 8), (16,) summarized
N_DEVICES = 8


# --- the model's records ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rec:
  """One record a call should produce: ``text`` (a printed line without
  its newline, or what a callback logs), its ``chain`` (``"A"``, ``"B"``,
  ``"D"`` for DEFAULT, ``"G"`` in global mode), ``device`` (per-device
  records in ``shard_map``; None for once-effects) and ``site`` (the
  effect's name in its template, where a fault is aimed)."""
  text: str
  chain: str
  device: int | None
  site: str
  is_print: bool


def _chain(effect: str, mode: str) -> str:
  return "G" if mode == "global" else effect


def prefix(device: int) -> str:
  """``print``'s label of a per-device line (one-axis mesh over 8 devices:
  shard index = device id)."""
  return f"[device {device} shard {device} process 0] "


def values_partitioned(u: int):
  import helpers
  return helpers.call_values(u)


def values_shard_map(u: int):
  import numpy as np
  return (u * 1000 + np.arange(16)[:, None] * 10
          + np.arange(8)[None, :]).astype(np.int32)


def values_loop(u: int):
  import numpy as np
  return (u * 1000 + np.arange(16)).astype(np.int32)


def expected_records(template: str, u: int, mode: str) -> list[Rec]:
  """Every record of one call of ``template`` with uid ``u`` in ``mode``,
  in program order (within each chain and device)."""
  import numpy as np
  with np.printoptions(**OPTIONS):
    if template == "partitioned":
      a, d = _chain("A", mode), _chain("D", mode)
      return [
          Rec(f"<S1 {u} {values_partitioned(u)}>", a, None, "S1", True),
          Rec(f"<s1 {u} 1>", a, None, "s1.1", True),
          Rec(f"<c1 {u} r>", a, None, "c1r", False),
          Rec(f"<s1 {u} 2>", d, None, "s1.2", True),
          Rec(f"<c1 {u} d>", d, None, "c1d", False),
          Rec(f"<s1 {u} 3>", d, None, "s1.3", True)]
    if template == "summarized":
      a = _chain("A", mode)
      return [
          Rec(f"<S6 {u} {values_partitioned(u)}>", a, None, "S6", True),
          Rec(f"<s6 {u} 1>", a, None, "s6.1", True)]
    if template == "shard_map":
      b = _chain("B", mode)
      out = []
      for dev in range(N_DEVICES):
        block = values_shard_map(u)[2 * dev:2 * dev + 2]
        v00 = int(block[0, 0])
        out += [
            Rec(f"{prefix(dev)}<M2 {u} {block}>", b, dev, "M2", True),
            Rec(f"<c2 {u} {dev}>", b, dev, "c2", False),
            Rec(f"{prefix(dev)}<l2 {u} {v00} 0>", b, dev, "l2.0", True),
            Rec(f"{prefix(dev)}<l2 {u} {v00} 1>", b, dev, "l2.1", True)]
      return out
    if template == "loop":
      d = _chain("D", mode)
      out = [Rec(f"<S3 {u} {values_loop(u)}>", d, None, "S3", True)]
      for i in range(4):
        out += [Rec(f"<l3 {u} {i}>", d, None, f"l3.{i}", True),
                Rec(f"<c3 {u} {i}>", d, None, f"c3.{i}", False)]
      return out + [Rec(f"<e3 {u} 4>", d, None, "e3", True),
                    Rec(f"<j3 {u} 4>", d, None, "j3", True)]
    if template == "reentrant":
      d = _chain("D", mode)
      return [Rec(f"<o5 {u} 0>", d, None, "o5.0", True),
              Rec(f"<c5 {u}>", d, None, "c5", False),
              Rec(f"<o5 {u} 1>", d, None, "o5.1", True)]
    if template == "streams":
      return [Rec(f"<a4 {u}>", _chain("A", mode), None, "a4", True),
              Rec(f"<b4 {u}>", _chain("B", mode), None, "b4", True),
              Rec(f"<c4 {u}>", _chain("A", mode), None, "c4", False),
              Rec(f"<d4 {u}>", _chain("D", mode), None, "d4", True)]
  raise ValueError(template)


def expected_result(template: str, u: int):
  import numpy as np
  if template in ("partitioned", "summarized"):
    return values_partitioned(u)
  if template == "shard_map":
    return values_shard_map(u) + 2
  if template == "loop":
    return (values_loop(u), np.int32(4))
  return np.int32(u + 1)   # streams, reentrant


# --- faults -------------------------------------------------------------------

@dataclasses.dataclass
class Fault:
  """One injected fault: its class, the call (uid) and where in it (a
  device, a loop step, a record's site), and the exception it raised once
  it did (``error``: the very object the thread must get, for callback
  errors and failed writes)."""
  cls: str
  uid: int
  template: str
  device: int = 0
  step: int = 0
  site: str = ""
  marker: str = ""
  error: BaseException | None = None
  fired: bool = False

  def describe(self) -> str:
    return (f"{self.cls} in call {self.uid} ({self.template}, device "
            f"{self.device}, step {self.step}, site {self.site or '-'})")


def record_site(fault: Fault) -> str:
  """The site of the record the fault stops (a loop's callback: per step)."""
  if fault.cls == "callback-error" and fault.site == "c3":
    return f"c3.{fault.step}"
  return fault.site


def fault_sites(cls: str, template: str) -> list[str]:
  """Where a fault of ``cls`` can be aimed in ``template``."""
  if cls in ("xla-stage", "slow"):
    return ["stage"] if template not in ("streams", "reentrant") else []
  if cls == "xla-partitioned":
    return ["dbg"] if template == "partitioned" else []
  if cls == "callback-error":
    return {"partitioned": ["c1d"], "summarized": [], "shard_map": ["c2"],
            "loop": ["c3"], "streams": ["c4"], "reentrant": []}[template]
  if cls == "reenter-jax":
    return fault_sites("slow", template) + fault_sites("callback-error",
                                                       template)
  if cls == "clear-caches":
    return ["beside"]
  if cls == "stdout":
    return {"partitioned": ["S1", "s1.1", "s1.2", "s1.3"],
            "summarized": ["S6", "s6.1"],
            "shard_map": ["M2", "l2.0", "l2.1"],
            "loop": ["S3", "l3", "e3", "j3"],
            "streams": ["a4", "b4", "d4"], "reentrant": []}[template]
  return []


# --- the compiled templates ---------------------------------------------------

class Log:
  """What happened, in order: printed text (``"out"``), what callbacks
  record (``"cb"``) and the driver's events (``"ev"``)."""

  def __init__(self):
    self.lock = threading.Lock()
    #: Notified on every entry (the clear-caches fault steps with them).
    self.grew = threading.Condition(self.lock)
    self.entries: list[tuple] = []

  def add(self, *entry) -> int:
    with self.lock:
      self.entries.append(entry)
      self.grew.notify_all()
      return len(self.entries) - 1


class Stdout:
  """``sys.stdout`` during the cases: every write goes to the log; the
  write of the text containing ``fail_marker`` raises once (the stdout
  fault)."""

  def __init__(self, runner: "Runner"):
    self.runner = runner

  def write(self, text: str) -> int:
    fault = self.runner.fault
    if (fault is not None and fault.cls == "stdout" and not fault.fired
        and fault.marker in text):
      fault.fired = True
      fault.error = OSError(f"injected write error, call {fault.uid}")
      raise fault.error
    self.runner.log.add("out", text)
    return len(text)

  def flush(self) -> None:
    pass

  def isatty(self) -> bool:
    return False


class Stderr:
  """``sys.stderr`` during the cases: what the runtime writes there itself
  (JAX's loggers keep the real stream) goes to the log too."""

  def __init__(self, runner: "Runner", target):
    self.runner = runner
    self.target = target

  def write(self, text: str) -> int:
    self.runner.log.add("err", text)
    return self.target.write(text)

  def flush(self) -> None:
    self.target.flush()

  def isatty(self) -> bool:
    return False


class _BarSink:
  def write(self, text):
    return len(text)

  def flush(self):
    pass


class Injected(Exception):
  pass


class Runner:
  """The compiled templates and their host functions (which consult the
  case's fault and write records to the log)."""

  def __init__(self):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_effects as je
    self.jax, self.np, self.je = jax, np, je
    self.log = Log()
    self.fault: Fault | None = None
    # call uid -> the thread that dispatches it; the inner calls whose
    # callback ran on another thread (one of XLA's: the outer call ran
    # asynchronously), which are that thread's calls (design/errors.md,
    # "Calls made inside a call")
    self.dispatchers: dict[int, int] = {}
    self.inner_elsewhere: set[int] = set()
    self.mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("i",))
    self.rows = NamedSharding(self.mesh, P("i"))
    self.device0 = jax.devices()[0]
    A, B = je.Effect("model-a"), je.Effect("model-b")
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    sink = _BarSink()

    def act(uid, site, device=0, step=0):
      """Runs the fault aimed here, if any."""
      f = self.fault
      if (f is None or f.uid != uid or f.device != device or f.step != step
          or f.site != site):
        return
      if f.cls == "slow":
        time.sleep(SLEEP_S)
      elif f.cls == "reenter-jax":
        f.fired = True
        time.sleep(REENTER_PAUSE_S)   # (its thread runs ahead meanwhile)
        for k in range(3):   # (computations launched from the callback)
          jax.block_until_ready(jnp.arange(8) * (uid % 7 + k))
      elif f.cls in ("xla-stage", "xla-partitioned"):
        f.fired = True
        raise Injected(f"xla fault call {uid} device {device} step {step}")
      elif f.cls == "callback-error" and not f.fired:
        f.fired = True
        f.error = Injected(f"callback error call {uid}")
        raise f.error

    def record(text):
      self.log.add("cb", text)

    # partitioned: automatic partitioning over 8 devices
    def stage1(block):
      block = np.asarray(block)
      u, rest = divmod(int(block[0, 0]), 1000)
      act(u, "stage", device=rest // 10)
      return block

    def dbg1(block):
      block = np.asarray(block)
      u, rest = divmod(int(block[0, 0]), 1000)
      act(u, "dbg", device=rest // 10)

    def cbres1(u):
      record(f"<c1 {int(u)} r>")
      return np.int32(1)

    def cb1(u):
      act(int(u), "c1d")
      record(f"<c1 {int(u)} d>")

    stage1_map = jax.shard_map(
        lambda v: jax.pure_callback(stage1, jax.ShapeDtypeStruct(
            v.shape, v.dtype), v), mesh=self.mesh, in_specs=P("i"),
        out_specs=P("i"))

    def partitioned(u, x):
      y = stage1_map(x)
      jax.debug.callback(dbg1, y[:, :1], partitioned=True)
      je.print("<S1 {} {}>", u, y, effect=A)
      je.print("<s1 {} 1>", u, effect=A)
      # (result unused: a used result is broadcast by a collective, which a
      # failed device never joins: XLA aborts the process, jax.jit alike)
      je.callback(cbres1, i32, u, effect=A)
      je.print("<s1 {} 2>", u)
      je.callback(cb1, None, u)
      je.print("<s1 {} 3>", u)
      return y

    # summarized: automatic partitioning, the print alone on its chain
    def summarized(u, x):
      y = stage1_map(x)
      je.print("<S6 {} {}>", u, y, effect=A)
      je.print("<s6 {} 1>", u, effect=A)
      return y

    # shard_map: per device
    def stage2(block):
      block = np.asarray(block)
      u, rest = divmod(int(block[0, 0]), 1000)
      act(u, "stage", device=rest // 20)
      return block

    def cb2(u, v00):
      dev = (int(v00) % 1000) // 20
      act(int(u), "c2", device=dev)
      record(f"<c2 {int(u)} {dev}>")

    def body2(u, v):
      v = jax.pure_callback(stage2, jax.ShapeDtypeStruct(v.shape, v.dtype), v)
      je.print("<M2 {} {}>", u, v, effect=B)
      je.callback(cb2, None, u, v[0, 0], effect=B)

      def step(i, c):
        je.print("<l2 {} {} {}>", u, v[0, 0], i, effect=B)
        return c + 1
      return v + lax.fori_loop(0, 2, step, jnp.int32(0))

    shard_mapped = jax.shard_map(body2, mesh=self.mesh, in_specs=(P(), P("i")),
                                 out_specs=P("i"))

    # loop: one device, a bar, callbacks with results, an adopted print
    def cbres3(u, i):
      act(int(u), "c3", step=int(i))
      record(f"<c3 {int(u)} {int(i)}>")
      return np.int32(1)

    def step3(u, i):
      act(int(u), "stage", step=int(i))
      return np.int32(0)

    def loop(u, x):
      with je.progress(4, file=sink) as bar:
        def step(i, c):
          je.print("<l3 {} {}>", u, i)
          r = je.callback(cbres3, i32, u, i)
          c = c + jax.pure_callback(step3, i32, u, i)
          bar.update()
          return c + r
        je.print("<S3 {} {}>", u, x)
        c = lax.fori_loop(0, 4, step, jnp.int32(0))
      je.print("<e3 {} {}>", u, c)
      jax.debug.print("<j3 {} {}>", u, c)
      return x, c

    # streams: one device, three effects
    def cb4(u):
      act(int(u), "c4")
      record(f"<c4 {int(u)}>")

    # reentrant: one device, a callback that calls another compiled function
    def cb5(u):
      record(f"<c5 {int(u)}>")
      if self.dispatchers.get(int(u)) != threading.get_ident():
        self.inner_elsewhere.add(int(u) + 1)
      self.call(INNER, int(u) + 1)     # dispatched here, runs after

    def reentrant(u):
      je.print("<o5 {} 0>", u)
      je.callback(cb5, None, u)
      je.print("<o5 {} 1>", u)
      return u + 1

    def streams(u):
      je.print("<a4 {}>", u, effect=A)
      je.print("<b4 {}>", u, effect=B)
      je.callback(cb4, None, u, effect=A)
      je.print("<d4 {}>", u)
      return u + 1

    with np.printoptions(**OPTIONS):   # (captured when traced)
      self.functions = {"partitioned": je.jit(partitioned),
                        "summarized": je.jit(summarized),
                        "shard_map": je.jit(shard_mapped),
                        "loop": je.jit(loop), "streams": je.jit(streams),
                        "reentrant": je.jit(reentrant)}

  def arguments(self, template: str, u: int) -> tuple:
    jax, np = self.jax, self.np
    uid = np.int32(u)
    if template in ("partitioned", "summarized"):
      return uid, jax.device_put(values_partitioned(u), self.rows)
    if template == "shard_map":
      return uid, jax.device_put(values_shard_map(u), self.rows)
    if template == "loop":
      return uid, jax.device_put(values_loop(u), self.device0)
    return (uid,)

  def call(self, template: str, u: int):
    np = self.np
    with np.printoptions(**OPTIONS):   # (a first call in a mode traces)
      return self.functions[template](*self.arguments(template, u))


# --- cases --------------------------------------------------------------------

@dataclasses.dataclass
class Op:
  kind: str                    # call | barrier | barrier_all | read
  template: str = ""
  uid: int = 0
  mode: str | None = None      # ordering() around the call (None: process)
  read: str = "now"            # now | later | never


@dataclasses.dataclass
class Phase:
  mode: str                          # set_ordering before the phase
  threads: list[list[Op]]
  beside: str | None = None          # barrier_all | set_ordering, from main


@dataclasses.dataclass
class Case:
  seed: int
  phases: list[Phase]
  fault: Fault | None

  def describe(self) -> str:
    lines = [f"seed {self.seed}: fault "
             + (self.fault.describe() if self.fault else "none")]
    for p, phase in enumerate(self.phases):
      lines.append(f"  phase {p}: set_ordering({phase.mode!r})"
                   + (f", main: {phase.beside} beside" if phase.beside else ""))
      for t, ops in enumerate(phase.threads):
        lines.append(f"    thread {t}: " + ", ".join(
            f"{o.template}#{o.uid}" + (f"[{o.mode}]" if o.mode else "")
            + ("" if o.read == "now" else f"(read {o.read})")
            if o.kind == "call" else o.kind for o in ops))
    return "\n".join(lines)


def generate(seed: int, classes: tuple[str, ...],
             templates: tuple[str, ...] = TEMPLATES) -> Case:
  """A random case (deterministic in ``seed``) with a fault of one of
  ``classes`` (``"none"``: no fault), calling ``templates``."""
  rng = random.Random(seed)
  weights = [WEIGHTS[TEMPLATES.index(t)] for t in templates]
  uid = seed * 64 + 1
  phases = []
  calls = []
  for _ in range(rng.choice((1, 1, 2))):
    threads = []
    for _ in range(rng.choice((1, 2, 2, 3))):
      ops = []
      for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.12 and ops:
          ops.append(Op("barrier"))
        elif roll < 0.17 and ops:
          ops.append(Op("barrier_all"))
        else:
          op = Op("call", rng.choices(templates, weights)[0], uid,
                  rng.choice(MODES) if rng.random() < 0.3 else None,
                  rng.choice(("now", "now", "later", "never")))
          uid += 2 if op.template == "reentrant" else 1
          ops.append(op)
          calls.append(op)
      threads.append(ops)
    beside = None
    if rng.random() < 0.25:
      explicit = all(o.mode for ops in threads for o in ops if o.kind == "call")
      beside = ("set_ordering" if explicit and rng.random() < 0.5
                else "barrier_all")
    phases.append(Phase(rng.choice(MODES), threads, beside))
  cls = rng.choice(classes)
  fault = None
  targets = [(op, site) for op in calls
             for site in fault_sites(cls, op.template)]
  if cls != "none" and targets:
    op, site = rng.choice(targets)
    fault = Fault(cls, op.uid, op.template, site=site)
    if op.template == "shard_map" or (
        op.template in ("partitioned", "summarized")
        and site in ("stage", "dbg")):
      fault.device = rng.randrange(N_DEVICES)
    if op.template == "loop" and site in ("stage", "c3", "l3"):
      fault.step = rng.randrange(4)
    if cls == "stdout":
      fault.site = site if site != "l3" else f"l3.{fault.step}"
      fault.step = 0
    if cls in ("callback-error", "reenter-jax") and (
        op.template == "loop" and site != "stage"):
      fault.site = "c3"
    # (a call made inside a callback would raise the thread's deferred
    # error there, which would become that callback's: not modelled)
    for phase in phases:
      for ops in phase.threads:
        if op in ops:
          for later in ops[ops.index(op):]:
            if later.kind == "call" and later.template == "reentrant":
              later.template = "streams"
  return Case(seed, phases, fault)


class Hang(Exception):
  pass


def run_case(runner: Runner, case: Case) -> dict:
  """Runs ``case``; returns the observations :func:`check` reads."""
  je, jax, np = runner.je, runner.jax, runner.np
  import helpers
  left_before = helpers.leftovers(helpers.runtime_inventory())
  log = runner.log
  log.entries.clear()
  fault = case.fault
  if fault is not None and fault.cls == "stdout":
    modes = {o.uid: (o.mode or ph.mode) for ph in case.phases
             for ops in ph.threads for o in ops if o.kind == "call"}
    rec = [r for r in expected_records(fault.template, fault.uid,
                                       modes[fault.uid])
           if r.site == record_site(fault)
           and (r.device is None or r.device == fault.device)]
    fault.marker = rec[0].text
  runner.fault = fault
  calls = {}     # uid -> dict(thread, seq, template, mode)
  errors = []    # exceptions seen by the driver, by id, kept alive

  def event(*what):
    return log.add("ev", *what)

  def raised(where, key, exc, uid=None):
    errors.append(exc)
    return event("raised", where, key, uid, exc)

  def read(key, uid, out):
    try:
      got = jax.tree.map(np.asarray, jax.block_until_ready(out))
    except BaseException as exc:  # noqa: BLE001 - the observation
      raised("read", key, exc, uid)
      return
    want = expected_result(calls[uid]["template"], uid)
    same = all(np.array_equal(g, w) for g, w in zip(
        jax.tree.leaves(got), jax.tree.leaves(want)))
    event("read", key, uid, same)

  def worker(key, ops, process_mode):
    later = []
    for seq, op in enumerate(ops):
      if op.kind == "call":
        calls[op.uid] = dict(thread=key, seq=seq, template=op.template,
                             mode=op.mode or process_mode)
        if op.template == "reentrant":   # the call its callback makes
          calls[op.uid + 1] = dict(thread=key, seq=seq + 0.5, template=INNER,
                                   mode=op.mode or process_mode,
                                   parent=op.uid)
        event("call", key, op.uid)
        runner.dispatchers[op.uid] = threading.get_ident()
        try:
          if op.mode:
            with je.ordering(op.mode):
              out = runner.call(op.template, op.uid)
          else:
            out = runner.call(op.template, op.uid)
        except BaseException as exc:  # noqa: BLE001 - the observation
          raised("call", key, exc, op.uid)
          continue
        event("returned", key, op.uid)
        f = runner.fault
        if f is not None and f.cls == "reenter-jax" and f.uid == op.uid:
          # the thread runs ahead of the faulty call: computations that
          # wait for its result (more than XLA's CPU client lets in flight
          # on a device) while its callback is about to launch its own
          y = jax.tree.leaves(out)[0]
          for _ in range(REENTER_AHEAD):
            y = y + 1
        if op.template == "reentrant":   # (its callback's call: dispatched)
          event("returned", key, op.uid + 1)
        if op.read == "now":
          read(key, op.uid, out)
        elif op.read == "later":
          later.append((op.uid, out))
      else:
        event("start", op.kind, key)
        try:
          je.effects_barrier(all_threads=op.kind == "barrier_all")
        except BaseException as exc:  # noqa: BLE001 - the observation
          raised(op.kind, key, exc)
        event("end", op.kind, key)
    for uid, out in later:
      read(key, uid, out)

  def set_ordering(mode, key="main"):
    # (only a switch waits for every thread's dispatched effects)
    kind = ("set_ordering" if mode != je.get_ordering()
            else "set_ordering-unchanged")
    event("start", kind, key)
    try:
      je.set_ordering(mode)
    except BaseException as exc:  # noqa: BLE001 - the observation
      raised(kind, key, exc)
    event("end", kind, key)

  def barrier_all(kind):
    event("start", kind, "main")
    try:
      je.effects_barrier(all_threads=True)
    except BaseException as exc:  # noqa: BLE001 - the observation
      raised(kind, "main", exc)
    event("end", kind, "main")

  for p, phase in enumerate(case.phases):
    set_ordering(phase.mode)
    go = threading.Event()
    failures = []

    def run(key, ops, mode=phase.mode):
      go.wait()
      try:
        worker(key, ops, mode)
      except BaseException:  # noqa: BLE001 - a driver bug: reported
        failures.append(traceback.format_exc())

    threads = [threading.Thread(target=run, args=((p, t), ops))
               for t, ops in enumerate(phase.threads)]
    for t in threads:
      t.start()
    clearing = None
    if fault is not None and fault.cls == "clear-caches" and any(
        o.kind == "call" and o.uid == fault.uid
        for ops in phase.threads for o in ops):
      done = threading.Event()

      def clear(done=done):
        # (bounded by work: one clear per step of the phase, at most
        # CLEARS_PER_PHASE; a loop until the phase ended starved it on a
        # loaded machine, issue 49)
        seen = len(log.entries)
        for _ in range(CLEARS_PER_PHASE):
          with log.grew:
            log.grew.wait_for(
                lambda: len(log.entries) > seen or done.is_set())
            seen = len(log.entries)
          if done.is_set():
            return
          jax.clear_caches()
          gc.collect()
      clearing = (done, threading.Thread(target=clear, daemon=True))
      clearing[1].start()
    go.set()
    if phase.beside == "set_ordering":
      time.sleep(0.005)
      set_ordering(random.Random(case.seed + p).choice(MODES))
    elif phase.beside == "barrier_all":
      time.sleep(0.005)
      barrier_all("barrier_all")
    for t in threads:
      t.join(CASE_BOUND_S)
      if t.is_alive():
        raise Hang(f"a thread of phase {p} did not finish")
    if clearing is not None:
      clearing[0].set()
      with log.grew:
        log.grew.notify_all()
      clearing[1].join(CASE_BOUND_S)
    if failures:
      raise RuntimeError("the driver failed:\n" + "\n".join(failures))
  barrier_all("final")
  je.set_ordering("per_effect")
  for exc in errors:   # (their frames would keep the runtime's state alive)
    _drop_tracebacks(exc)
  if fault is not None and fault.error is not None:
    _drop_tracebacks(fault.error)
  gc.collect()
  left = helpers.leftovers(helpers.runtime_inventory())
  runner.fault = None
  for u in runner.inner_elsewhere:   # (another thread's call: see Runner)
    if u in calls:
      calls[u]["thread"] = ("xla", u)
  runner.inner_elsewhere.clear()
  runner.dispatchers.clear()
  return dict(entries=list(log.entries), calls=calls, left=left,
              left_before=left_before, errors=errors)


def _drop_tracebacks(exc: BaseException, seen=None) -> None:
  """Clears the tracebacks of ``exc``, its group's members, its cause and
  context (the checks need the objects, not their frames)."""
  seen = set() if seen is None else seen
  if exc is None or id(exc) in seen:
    return
  seen.add(id(exc))
  exc.__traceback__ = None
  for sub in getattr(exc, "exceptions", ()):
    _drop_tracebacks(sub, seen)
  _drop_tracebacks(exc.__cause__, seen)
  _drop_tracebacks(exc.__context__, seen)


# --- the oracle ---------------------------------------------------------------

def _flat(exc: BaseException) -> list[BaseException]:
  if isinstance(exc, BaseExceptionGroup):
    return [e for sub in exc.exceptions for e in _flat(sub)]
  return [exc]


def check(case: Case, obs: dict) -> list[tuple[str, str]]:
  """The violations of the contract in ``obs`` (``(kind, detail)``)."""
  out: list[tuple[str, str]] = []
  entries, calls = obs["entries"], obs["calls"]
  fault = case.fault

  def bad(kind, detail):
    out.append((kind, detail))

  expected = {u: expected_records(c["template"], u, c["mode"])
              for u, c in calls.items()}
  owner = {r.text: (u, r) for u, recs in expected.items() for r in recs}
  seen: dict[int, dict[Rec, int]] = {u: {} for u in calls}
  reports = []   # (index, where, thread key, uid, exception)
  marks: dict[str, list] = {}
  for i, entry in enumerate(entries):
    if entry[0] in ("out", "cb"):
      text = entry[1]
      text = text[:-1] if entry[0] == "out" and text.endswith("\n") else text
      if text == "":
        continue
      if text not in owner:
        bad("unknown-output", f"{text!r:.400}")
        continue
      u, r = owner[text]
      if r in seen[u]:
        bad("printed-twice", text[:200])
      seen[u][r] = i
    elif entry[0] == "err":
      if entry[1].lstrip().startswith("jax_effects:"):
        bad("runtime-complaint", f"on stderr: {entry[1].strip()[:300]}")
    elif entry[1] == "raised":
      _, _, where, key, uid, exc = entry
      reports.append((i, where, key, uid, exc))
    else:
      marks.setdefault(entry[1], []).append((i, *entry[2:]))

  # --- every error: whose, reported where, how often
  def xla_of(e):
    """The call whose XLA failure ``e`` is (XLA's message holds the
    callback's; JAX raises it as a JaxRuntimeError, or from its C++ fast
    path as a ValueError)."""
    try:
      text = str(e)
    except Exception:  # noqa: BLE001 - not one of ours
      return None
    for u in calls:
      if f"xla fault call {u} " in text:
        return u
    return None

  injected = fault.error if fault is not None else None
  own_report = set()          # calls whose raise holds their own error
  reported_injected = []
  reported_xla: dict[int, list] = {}
  for i, where, key, uid, exc in reports:
    for e in _flat(exc):
      if injected is not None and (e is injected
                                   or getattr(e, "__cause__", None)
                                   is injected):
        reported_injected.append((i, where, key, uid))
        if where == "call" and uid == fault.uid:
          own_report.add(uid)
        continue
      x = xla_of(e)
      if x is not None:
        reported_xla.setdefault(x, []).append((i, where, key, uid))
        if where == "call" and uid == x:
          own_report.add(uid)
        continue
      bad("spurious-error", f"{where} of {key} (call {uid}) raised "
          f"{type(e).__name__}: {str(e)[-300:]}")
  raised_calls = {uid for _, where, _, uid, _ in reports if where == "call"}
  dispatched = {u for u in calls if u not in raised_calls or u in own_report}
  dispatched -= {u for u, c in calls.items()
                 if "parent" in c and c["parent"] not in dispatched}

  # --- records of each call
  faulty = fault.uid if fault is not None else None
  for u, c in calls.items():
    recs, got = expected[u], seen[u]
    if u not in dispatched:
      if got:
        bad("ran-after-reporting", f"call {u} raised an earlier call's error "
            f"yet ran: {sorted(r.site for r in got)}")
      continue
    chains: dict = {}
    for r in recs:
      chains.setdefault((r.chain, r.device), []).append(r)
    for (chain, device), seq in chains.items():
      present = [r in got for r in seq]
      where = f"call {u} ({c['template']}, {c['mode']}) chain {chain}" + (
          "" if device is None else f" device {device}")
      if u == faulty and fault.cls in ("xla-stage", "xla-partitioned"):
        # what the failed execution printed on the chain is a prefix of its
        # lines (its callbacks: run or skipped, C5)
        printed = [r in got for r in seq if r.is_print]
        if printed != sorted(printed, reverse=True):
          bad("not-a-prefix", f"{where}: {[r.site for r in seq if r in got]} "
              "(an XLA failure: a prefix of the chain's lines)")
        continue
      cut = None
      if u == faulty and fault.cls in ("callback-error", "stdout") and (
          fault.fired):
        hit = [k for k, r in enumerate(seq) if r.site == record_site(fault)
               and (r.device is None or r.device == fault.device)]
        if hit:
          cut = hit[0]
      want = [True] * len(seq)
      if cut is not None:
        want[cut] = False
        if fault.cls == "callback-error" or WRITE_ERROR_SKIPS_LATER_EFFECTS:
          want[cut + 1:] = [False] * (len(seq) - cut - 1)
      if present != want:
        missing = [r.site for r, p, w in zip(seq, present, want) if w and not p]
        extra = [r.site for r, p, w in zip(seq, present, want) if p and not w]
        bad("missing-output" if missing else "ran-after-failure",
            f"{where}: missing {missing}, unexpected {extra}")
      idx = [got[r] for r in seq if r in got]
      if idx != sorted(idx):
        bad("order-in-call", f"{where}: {[r.site for r in seq if r in got]}"
            f" at {idx}")

  # --- order of a thread's calls
  by_thread: dict = {}
  for u, c in calls.items():
    if u in dispatched:
      by_thread.setdefault(tuple(c["thread"]) if isinstance(c["thread"], list)
                           else c["thread"], []).append(u)
  for key, us in by_thread.items():
    us.sort(key=lambda u: calls[u]["seq"])
    for a_pos, ua in enumerate(us):
      for ub in us[a_pos + 1:]:
        if calls[ub].get("parent") == ua:
          continue   # (a call inside ua's callback: its place is after ua)
        same_mode = calls[ua]["mode"] == calls[ub]["mode"]
        wrong = [(ra.site, rb.site, ra.device)
                 for ra, ia in seen[ua].items() for rb, ib in seen[ub].items()
                 if ia > ib and not (same_mode and ra.chain != rb.chain)
                 and not (ra.device is not None and rb.device is not None
                          and ra.device != rb.device)]
        if wrong:
          a, b, dev = wrong[0]
          bad("order-across-calls", f"thread {key}: call {ub} ({b}) before "
              f"call {ua} ({a}" + ("" if dev is None else f", device {dev}")
              + f"); {len(wrong)} such pairs")

  # --- barriers: everything dispatched before them is done when they return
  starts = {}
  for i, kind, key in marks.get("start", []):
    starts.setdefault((kind, key), []).append(i)
  ends = {}
  for i, kind, key in marks.get("end", []):
    ends.setdefault((kind, key), []).append(i)
  returned = {uid: i for i, key, uid in marks.get("returned", [])}
  for (kind, key), ss in starts.items():
    if kind == "set_ordering-unchanged":
      continue
    for s, e in zip(ss, ends.get((kind, key), [])):
      if kind == "barrier":
        covered = [u for u, c in calls.items() if u in dispatched
                   and _key(c["thread"]) == _key(key)
                   and returned.get(u, 1 << 60) < s]
      else:
        covered = [u for u in calls if u in dispatched
                   and returned.get(u, 1 << 60) < s]
      for u in covered:
        late = [r.site for r, i in seen[u].items() if i > e]
        if late:
          bad("barrier-returned-early", f"{kind} of {key}: call {u}'s "
              f"{late} after it returned")
        if (kind != "set_ordering" and u == faulty and injected is not None
            and not any(i <= e for i, *_ in reported_injected)):
          bad("error-not-reported-by-barrier", f"{kind} of {key} returned "
              f"without call {u}'s {fault.cls} error")

  # --- the injected error: once, to its thread, at a defined point
  if injected is not None:
    if len(reported_injected) != 1:
      bad("error-reported-%s" % ("never" if not reported_injected
                                 else "several-times"),
          f"{fault.describe()}: reported {len(reported_injected)} times: "
          f"{[(w, k, u) for _, w, k, u in reported_injected]}")
    mine = _key(calls[fault.uid]["thread"])
    call_at = next(i for i, key, uid in marks.get("call", [])
                   if uid == fault.uid)
    for i, where, key, uid in reported_injected:
      ok = ((where == "call" and uid == fault.uid)
            or (where in ("call", "barrier") and _key(key) == mine
                and i > call_at)
            or (where in ("barrier_all", "final") and i > call_at))
      if not ok:
        bad("error-reported-elsewhere", f"{fault.describe()}: by {where} "
            f"of {key} (call {uid})")
  # --- an XLA failure: only by its call or its result
  reads = {uid: (i, same) for i, key, uid, same in marks.get("read", [])}
  for u, where_list in reported_xla.items():
    for i, where, key, uid in where_list:
      if not (where in ("call", "read") and uid == u):
        bad("xla-failure-reported-elsewhere", f"call {u}'s XLA failure "
            f"raised by {where} of {key}" + (f" (call {uid})" if uid else ""))
  if fault is not None and fault.cls.startswith("xla") and (
      fault.uid in dispatched):
    u = fault.uid
    by_result = [w for w in reported_xla.get(u, ()) if w[3] == u]
    was_read = u in reads or any(w[1] == "read" for w in by_result)
    if (was_read or u in own_report) and len(by_result) != 1:
      bad("xla-failure-not-reported-once", f"call {u}: {len(by_result)} "
          "reports by its call or result")
  for u, (i, same) in reads.items():
    if not same and u != faulty:
      bad("wrong-result", f"call {u} returned wrong values")
  for i, where, key, uid, exc in reports:
    if where == "read" and uid != faulty and not any(
        xla_of(e) == uid for e in _flat(exc)):
      pass   # (counted above: spurious or another call's XLA failure)
  if obs["left"]:
    new = {k: v - obs["left_before"].get(k, 0) for k, v in obs["left"].items()
           if v > obs["left_before"].get(k, 0)}
    bad("left-behind", f"{obs['left']} (new in this case: {new})")
  return out


def _dump_runtime(out) -> None:
  """What the runtime holds at a hang (lanes, watched computations, each
  thread's sequence numbers), read without its locks (it may hold them)."""
  try:
    from jax_effects._runtime import executions, host_jobs, threads
    for key, lanes in list(host_jobs.queues.items()):
      print(f"lanes {key}: " + ", ".join(
          f"seq {lane.seq} jobs {len(lane.jobs)}"
          + (" failed" if lane.failed else "") + (" kept" if lane.kept else "")
          for lane in list(lanes)), file=out)
    print(f"draining {sorted(map(str, host_jobs._draining))}", file=out)
    for item in list(executions._watched):
      print(f"watched early={item.early}: " + str(
          [(s.is_ready()) for s in item.shards]), file=out)
    for state in threads.all_states():
      print(f"slot {state.slot}: seqs {dict(state.seqs)} dispatching "
            f"{state.dispatching}", file=out)
  except Exception as exc:  # noqa: BLE001 - a diagnostic
    print(f"(runtime dump failed: {exc!r})", file=out)


def _key(k):
  return tuple(k) if isinstance(k, list) else k


# --- the driver ---------------------------------------------------------------

def warm_up(runner: Runner) -> list:
  """Compiles every template in both modes and the token hand-overs
  between them (fault-free cases; their violations are returned)."""
  je = runner.je
  found = []
  seed = -1
  for mode in MODES:
    ops = [Op("call", t, 0, None, "now") for t in
           ("partitioned", "shard_map", "loop", "streams", "shard_map",
            "summarized", "partitioned", "loop", "shard_map", "streams",
            "summarized", "reentrant", "partitioned")]
    for k, op in enumerate(ops):   # (uids no case uses)
      op.uid = WARM_UP_UID + 2 * k + (40 if mode == "global" else 0)
    case = Case(seed, [Phase(mode, [ops])], None)
    obs = run_case(runner, case)
    found += check(case, obs)
  je.set_ordering("per_effect")
  return found


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", default="0:50", help="A:B (B excluded)")
  parser.add_argument("--faults", default=",".join(FAULT_CLASSES))
  parser.add_argument("--templates", default=",".join(TEMPLATES),
                      help="the templates the cases call")
  parser.add_argument("--out", default=None, help="results, a JSON line "
                      "per case")
  parser.add_argument("--verbose", action="store_true")
  parser.add_argument("--bound", type=float, default=CASE_BOUND_S,
                      help="seconds a case may take (a hang past it)")
  args = parser.parse_args(argv)
  a, b = map(int, args.seeds.split(":"))
  if not 0 <= a <= b <= MAX_SEED:
    parser.error(f"seeds must be within 0:{MAX_SEED}")
  classes = tuple(args.faults.split(","))
  templates = tuple(args.templates.split(","))
  unknown = (set(classes) - set(FAULT_CLASSES) - set(EXTRA_FAULT_CLASSES)) | (
      set(templates) - set(TEMPLATES))
  if unknown:
    parser.error(f"unknown fault classes or templates {sorted(unknown)}")
  import jax
  jax.config.update("jax_num_cpu_devices", N_DEVICES)
  sys.path.insert(0, os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  import helpers
  # (the runtime before issue 31's fix gave up, after a barrier's 60 s
  # clock, on prints still waiting for a part: 1 s here, so that a case
  # shows what follows instead of ending as a hang)
  helpers.shorten_todays_give_up()
  results = open(args.out, "a") if args.out else sys.__stderr__
  current = {"case": None}

  def on_hang():
    case = current["case"]
    print(json.dumps(dict(seed=case.seed if case else None, hang=True,
                          fault=case.fault.describe() if case and case.fault
                          else None)), file=results, flush=True)
    print(f"HANG in case {case.seed if case else 'warm-up'}:\n"
          + (case.describe() if case else ""), file=sys.__stderr__)
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    _dump_runtime(sys.__stderr__)
    os._exit(3)

  real_stdout, real_stderr = sys.stdout, sys.stderr
  t0 = time.monotonic()
  runner = Runner()
  # The heap so far (JAX's, NumPy's and jax_effects' modules: ~100,000
  # objects, never garbage) is left out of the collections: each case's
  # gc.collect() and the clear-caches fault's then scan only what the
  # cases made (a full collection took ~60 ms, a third of a clear-caches
  # case's CPU time).
  gc.collect()
  gc.freeze()
  sys.stdout = Stdout(runner)
  sys.stderr = Stderr(runner, real_stderr)
  timer = threading.Timer(args.bound * 3, on_hang)
  timer.daemon = True
  timer.start()
  try:
    found = warm_up(runner)
  finally:
    timer.cancel()
  print(json.dumps(dict(seed="warm-up", violations=found,
                        seconds=round(time.monotonic() - t0, 1))),
        file=results, flush=True)
  failed = bool(found)
  for seed in range(a, b):
    case = generate(seed, classes, templates)
    current["case"] = case
    timer = threading.Timer(args.bound, on_hang)
    timer.daemon = True
    timer.start()
    try:
      obs = run_case(runner, case)
      violations = check(case, obs)
    except Hang as exc:
      on_hang()
    finally:
      timer.cancel()
    failed |= bool(violations)
    line = dict(seed=seed, fault=case.fault.cls if case.fault else "none",
                violations=violations)
    print(json.dumps(line), file=results, flush=True)
    if args.verbose or violations:
      print(case.describe(), file=sys.__stderr__)
      for kind, detail in violations:
        print(f"  VIOLATION {kind}: {detail}", file=sys.__stderr__)
    del obs
  sys.stdout, sys.stderr = real_stdout, real_stderr
  print(json.dumps(dict(seed="done", seconds=round(time.monotonic() - t0, 1))),
        file=results, flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())

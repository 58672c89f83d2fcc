"""Differential test across entries (issue 46, point 2): the same program
writes the same lines in the same order under ``jax_effects.jit``, plain
``jax.jit`` and eager (no outer jit: each control-flow primitive is run by
JAX on its own), within a call and across the calls of a thread, on one
device or many (``design/errors.md``, "Plain ``jax.jit``";
``design/placement.md``, "Order across devices, and the deterministic
view").

Programs: ``program_generator.py`` with the kinds of :data:`KINDS`: prints,
logs (routed to stdout) and callbacks (their host function prints), ordered
and ``ordered=False``, on the default and two named effects; in a
``while_loop``'s body and ``cond_fun``, ``cond``/``switch``, ``scan``,
``fori_loop``, nested ``jax.jit``/``jax_effects.jit``/``checkpoint``,
``jax.shard_map`` over 1, 4 or 8 devices (per-device lines inside, a print
after), ``jax.vmap`` (a vmapped ``while_loop``'s trip count differs per
element, a vmapped ``cond``'s predicate too) and ``jax.grad`` (prints of
primal values in the differentiated function).

Each ``(PYTHONHASHSEED, entry)`` is one fresh process running the whole
batch of programs (:func:`child`; :data:`HASH_SEEDS`, the eager entry under
:data:`EAGER_HASH_SEEDS`): every program is called :data:`CALLS` times in
a row, then ``jax_effects.effects_barrier()``, in the per-effect (odd
seeds) or global ordering mode (even seeds, each with a ``shard_map``;
every other one inside ``jax_effects.deterministic()``: per-device lines
must then come sorted). Every call starts with a print on each effect, so
that a line of one call showing after the next call's start is seen. The outputs (stdout: prints, records, callbacks'
lines, and a marker with the results after each barrier) are compared
section by section with ``jax_effects.jit``'s, after :func:`canonical`
forgets only what the contract leaves free: the order of ``ordered=False``
lines within a section, the order between streams of different effects in
the per-effect mode, and the interleaving of different devices' lines
between two lines that run once (each device's own lines keep their order;
inside ``deterministic()`` the interleaving is compared as it is, except
for per-device callbacks, whose own writes are not held).

``JAX_EFFECTS_ENTRY_PROGRAMS=N`` (``--run-slow``: 40) runs N more
programs per process, deeper ones (:data:`DEEP`); ``--run-slow`` runs the
eager entry under every hash seed too. To run the test against another
checkout of jax_effects (the code before a change, say), put that checkout
first on ``PYTHONPATH`` and start pytest from a folder outside this one
(``python -m pytest`` and xdist's workers put the working folder first on
``sys.path``): ``cd /tmp && PYTHONPATH=OLD python -m pytest -c
REPO/tox.ini --rootdir REPO REPO/tests/differential/test_entries.py``.

Differences seen on other seeds (not in the default batch; reported):
inside ``deterministic()``, (a) under ``jax_effects.jit`` a callback that
runs once after a ``shard_map`` writes before the held per-device lines
(plain ``jax.jit`` and eager: after them); (b) eagerly, where devices take
different branches in a ``shard_map``, the held lines come sorted per
primitive (each is a dispatch of its own), not by position in each
device's sequence as under both jits (seed 1072).
"""
import collections
import concurrent.futures
import contextlib
import os
import re
import sys

import pytest

import helpers
import program_generator as pg

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)

ENTRIES = ("jax_effects.jit", "jax.jit", "eager")
HASH_SEEDS = (0, 1, 2)
#: The hash seeds of the eager entry (``--run-slow``: all): eagerly, JAX
#: compiles every control-flow primitive, and every primitive inside a
#: ``shard_map`` or ``vmap``, at every call (more CPU than the other two
#: entries together); its lowering is plain ``jax.jit``'s, which runs
#: under every hash seed.
EAGER_HASH_SEEDS = helpers.scale((0,), HASH_SEEDS)
N_PROGRAMS = 5
#: Seeds from here on draw programs one level deeper: :data:`MORE_PROGRAMS`
#: of them run after the :data:`N_PROGRAMS` (``--run-slow``: 40;
#: ``JAX_EFFECTS_ENTRY_PROGRAMS=N``: N).
DEEP = 1000
MORE_PROGRAMS = int(os.environ.get("JAX_EFFECTS_ENTRY_PROGRAMS", "0")) or \
    helpers.scale(0, 40)
CALLS = 2
KINDS = ("arith", "print", "log", "callback", "cond", "switch", "while",
         "scan", "fori", "call", "vmap", "grad", "shard_map")
EFFECTS = ("default", "gen-a", "gen-b")
DEVICES = (1, 4, 8)
CHILD_TIMEOUT_S = 600


# --- the programs ------------------------------------------------------------

def _theme(seed: int, gen):
  """The node every program of ``seed`` has, so that a small batch has
  them all: even seeds, a ``shard_map`` (unless one was drawn); odd seeds,
  in turn, a vmapped ``while_loop`` (an effect in its ``cond_fun``, a trip
  count per element) and ``cond`` and an ``ordered=False`` callback, or a
  nested call of a ``while_loop`` of a count XLA knows (a print in its
  ``cond_fun``), a ``grad`` of a ``scan`` and an ``ordered=False``
  print."""
  if seed % 2 == 0:
    return pg.ShardMap.generate(gen, 1)
  if seed // 2 % 2 == 0:
    with gen.within("vmap"):
      loop = pg.While.generate(gen, 2)
      loop.trips, loop.static = max(loop.trips, 2), False
      if not (loop.cond_effect or loop.cond_nodes):
        loop.cond_nodes.append(pg.Print(gen.effect(), gen.tag("p")))
      unordered = pg.Callback(gen.effect(), gen.effect_tag("c", False),
                              None, False)
      return pg.Vmap(2, pg.Block([loop, pg.Cond.generate(gen, 2),
                                  unordered]))
  loop = pg.While.generate(gen, 2)
  loop.static = True
  loop.cond_nodes.append(pg.Print(gen.effect(), gen.tag("p")))
  effect, tag = gen.effect(), gen.tag("g")
  with gen.within("grad"):
    grad = pg.Grad(effect, tag, pg.Block([pg.Scan.generate(gen, 2)]))
  unordered = pg.Print(gen.effect(), gen.effect_tag("p", False), False)
  return pg.Call(gen.rng.choice(pg.Call.WRAPPERS),
                 pg.Block([loop, grad, unordered]))


def program(seed: int):
  """``(program, mode, x0)`` of ``seed``: a random program of the kinds of
  :data:`KINDS` with its :func:`_theme` node, its ``shard_map`` nodes over
  ``DEVICES[seed % 3]`` devices; even seeds in the global ordering mode,
  odd ones in the per-effect mode."""
  gen = pg.Generator(seed, kinds=KINDS, effects=EFFECTS,
                     max_depth=1 if seed < DEEP else 2,
                     max_block=2, p_unordered=0.15, rich=True,
                     devices=DEVICES[seed % len(DEVICES)])
  prog = gen.program()
  if not (seed % 2 == 0 and has_kind(prog, pg.ShardMap)):
    prog.nodes.insert(gen.rng.randint(0, len(prog.nodes)),
                      _theme(seed, gen))
  return prog, ("per_effect" if seed % 2 else "global"), seed % 13


def deterministic(seed: int) -> bool:
  """Whether the program of ``seed`` is called inside ``deterministic()``:
  every other one with a ``shard_map`` (seeds 0, 4, 8, ...: global mode).
  (Calling each of them both ways would cost one more compilation under
  ``jax_effects.jit``, and one more call, every primitive compiled again,
  eagerly.)"""
  return seed % 4 == 0


def nodes(node):
  """``node`` (a Node or Block) and every Node inside it."""
  if isinstance(node, pg.Node):
    yield node
  for value in vars(node).values():
    for v in (value if isinstance(value, list) else [value]):
      if isinstance(v, (pg.Node, pg.Block)):
        yield from nodes(v)


def has_kind(prog, cls) -> bool:
  return any(isinstance(n, cls) for n in nodes(prog))


# --- the child process --------------------------------------------------------

_CHILD_MAIN = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path[:0] = [{here!r}, {tests!r}]
import test_entries
test_entries.child(sys.argv[1], [int(s) for s in sys.argv[2].split(",")])
"""


def child(entry: str, seeds) -> None:
  """Runs the programs of ``seeds`` under ``entry``, writing their lines,
  each program's ended by a marker after its barrier (``=== <seed>
  <calls|deterministic> -> <results>``)."""
  import jax
  import jax.numpy as jnp
  import jax_effects as je

  pg.log_to_stdout()
  for seed in seeds:
    prog, mode, x0 = program(seed)
    body = prog.build(pg.StdoutContext())

    def f(x, body=body):
      for name in EFFECTS:   # the start of the call, on every stream
        je.print("{}|begin|{}", name, x, effect=pg._effect_object(name))
      return body(x)

    fn = {"jax_effects.jit": je.jit, "jax.jit": jax.jit,
          "eager": lambda f: f}[entry](f)
    det = deterministic(seed)
    try:
      with je.ordering(mode), \
          (je.deterministic() if det else contextlib.nullcontext()):
        outs = [fn(jnp.int32(x0 + i)) for i in range(CALLS)]
        je.effects_barrier()
      end = str([int(o) for o in outs])
    except Exception as err:  # noqa: BLE001 - compared as output
      try:
        je.effects_barrier()
      except Exception:  # noqa: BLE001
        pass
      end = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    phase = "deterministic" if det else "calls"
    sys.stdout.write(f"=== {seed} {phase} -> {end}\n")
    sys.stdout.flush()


def run_entry(entry: str, seeds, hash_seed: int, env=None):
  """The stdout of :func:`child` in a fresh process (8 CPU devices)."""
  proc = helpers.run_python(
      "-c", _CHILD_MAIN.format(here=HERE, tests=TESTS), entry,
      ",".join(map(str, seeds)), timeout=CHILD_TIMEOUT_S,
      env={"PYTHONHASHSEED": str(hash_seed), **(env or {})})
  assert proc.returncode == 0, (
      f"{entry} (PYTHONHASHSEED={hash_seed}) exited with status "
      f"{proc.returncode}\n--- stdout (end) ---\n{proc.stdout[-3000:]}"
      f"\n--- stderr (end) ---\n{proc.stderr[-6000:]}")
  return proc.stdout


# --- comparing ----------------------------------------------------------------

_PREFIX = re.compile(r"\[device (\d+) shard \S+ process \d+\] ")
_MARKER = re.compile(r"=== (\d+) (\S+) -> ")


def sections(stdout: str) -> dict:
  """``(seed, phase) -> (lines, marker)``: each program's lines, ended by
  its marker (lines after the last marker: key ``None``)."""
  out, lines = {}, []
  for line in stdout.splitlines():
    m = _MARKER.match(line)
    if m:
      out[int(m.group(1)), m.group(2)] = (lines, line)
      lines = []
    else:
      lines.append(line)
  if lines:
    out[None] = (lines, None)
  return out


def parse(line: str):
  """``(device or None, effect, tag)`` of an output line."""
  m = _PREFIX.match(line)
  fields = line[m.end() if m else 0:].split("|")
  if len(fields) < 3:
    return (int(m.group(1)) if m else None), "?", ""
  return (int(m.group(1)) if m else None), fields[0], fields[1]


def _sort_device_runs(items):
  """Each maximal run of per-device lines sorted by device, stably: each
  device's lines keep their order, the devices' interleaving is
  forgotten."""
  out, run = [], []
  for device, line in items + [(None, None)]:
    if device is not None:
      run.append((device, line))
      continue
    out += [line for _, line in sorted(run, key=lambda item: item[0])]
    run = []
    if line is not None:
      out.append(line)
  return out


def canonical(lines, mode: str, deterministic: bool) -> dict:
  """What the contract fixes of a section's lines (the module docstring):
  ``ordered=False`` lines as a sorted list; ordered lines per stream (one
  in the global mode, one per effect else), each device's lines in order
  between lines that run once (inside ``deterministic()``: as they are,
  except per-device callbacks' own lines, kept apart)."""
  unordered, streams = [], collections.defaultdict(list)
  for line in lines:
    device, effect, tag = parse(line)
    if tag.endswith(pg.UNORDERED_MARK):
      unordered.append(line)
      continue
    key = "all" if mode == "global" and effect != "?" else effect
    if deterministic and device is not None and tag[:1] in ("c", "w"):
      key += " (per-device callbacks)"
      streams[key].append((device, line))
    else:
      streams[key].append((None if deterministic else device, line))
  return {"unordered": sorted(unordered),
          **{k: _sort_device_runs(v) for k, v in sorted(streams.items())}}


def _canonical_section(key, lines):
  """:func:`canonical` of the lines of section ``key``, in its program's
  mode (lines after the last marker: as in the global mode)."""
  if key is None:
    return canonical(lines, "global", False)
  return canonical(lines, program(key[0])[1], key[1] == "deterministic")


def differences(outputs: dict) -> list:
  """``(key, {entry: (lines, marker)})`` of every section whose marker or
  canonical form differs from the first entry's (``outputs``: entry ->
  stdout)."""
  parsed = {entry: sections(out) for entry, out in outputs.items()}
  keys = sorted({k for p in parsed.values() for k in p},
                key=lambda k: (k is None, k))
  found = []
  for key in keys:
    by_entry = {entry: p.get(key, ([], None)) for entry, p in parsed.items()}
    forms = [(marker, _canonical_section(key, lines))
             for lines, marker in by_entry.values()]
    if any(form != forms[0] for form in forms):
      found.append((key, by_entry))
  return found


def _first_difference(key, ref, other):
  """Where section ``key``'s ``other`` (lines, marker) first differs from
  ``ref`` (None: nowhere)."""
  (ref_lines, ref_marker), (lines, marker) = ref, other
  if ref_marker != marker:
    return f"marker {marker!r} (reference {ref_marker!r})"
  a = _canonical_section(key, ref_lines)
  b = _canonical_section(key, lines)
  for stream in sorted(set(a) | set(b)):
    x, y = a.get(stream, []), b.get(stream, [])
    if x != y:
      i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v),
               min(len(x), len(y)))
      return (f"stream {stream!r}, line {i}: {y[i] if i < len(y) else None!r}"
              f" (reference {x[i] if i < len(x) else None!r}; "
              f"{len(y)} lines, reference {len(x)})")
  return None


def report(found: list, hash_seed: int) -> str:
  """A failure message: the differing sections, the first ones in full."""
  out = [f"PYTHONHASHSEED={hash_seed}: {len(found)} section(s) differ "
         f"between entries: {[key for key, _ in found]}"]
  for key, by_entry in found[:3]:
    if key is not None:
      prog, mode, x0 = program(key[0])
      out.append(f"\n--- seed {key[0]}, phase {key[1]}, mode {mode}, "
                 f"inputs {x0}, {x0 + 1}:\n{prog.describe(2)}")
    ref_entry, ref = next(iter(by_entry.items()))
    for entry, (lines, marker) in by_entry.items():
      where = (None if entry == ref_entry
               else _first_difference(key, ref, (lines, marker)))
      diff = ("" if entry == ref_entry else
              f" same as {ref_entry}" if where is None else
              f" differs from {ref_entry}: {where}")
      out.append(f"  [{entry}]{diff}")
      out += [f"    {line}" for line in lines] + [f"    {marker}"]
  return "\n".join(out)


# --- the tests ------------------------------------------------------------------

@pytest.mark.parametrize("hash_seed", HASH_SEEDS)
def test_entries_write_the_same_lines(hash_seed):
  seeds = [*range(N_PROGRAMS), *range(DEEP, DEEP + MORE_PROGRAMS)]
  entries = [e for e in ENTRIES
             if e != "eager" or hash_seed in EAGER_HASH_SEEDS]
  with concurrent.futures.ThreadPoolExecutor(len(entries)) as pool:
    futures = {e: pool.submit(run_entry, e, seeds, hash_seed)
               for e in entries}
    outputs = {e: f.result() for e, f in futures.items()}
  found = differences(outputs)
  assert not found, report(found, hash_seed)
  # every program ran, and ran without error, under every entry
  for entry, out in outputs.items():
    ends = [line for line in out.splitlines() if _MARKER.match(line)]
    assert len(ends) == len(seeds), entry
    assert all(re.search(r"-> \[[\d, ]+\]$", e) for e in ends), (entry, ends)


def test_programs_cover_every_kind():
  # The default batch draws every kind, every effect kind ordered and
  # unordered, effects in cond_fun (of a loop whose count XLA knows too), a
  # shard_map over 1, 4 and 8 devices, inside deterministic() and not, a
  # vmapped while_loop and cond, both ordering modes.
  kinds, devices, flags = set(), set(), set()
  for seed in range(N_PROGRAMS):
    prog, mode, _ = program(seed)
    flags.add(mode)
    if has_kind(prog, pg.ShardMap):
      flags.add("shard_map/deterministic" if deterministic(seed)
                else "shard_map/calls")
    for node in nodes(prog):
      kinds.add(node.kind)
      if isinstance(node, pg.ShardMap):
        devices.add(node.devices)
      if isinstance(node, (pg.Print, pg.Log, pg.Callback)):
        flags.add((node.kind, node.ordered))
      if isinstance(node, pg.While) and (node.cond_effect or node.cond_nodes):
        flags.add("cond_fun/static" if node.static else "cond_fun")
      if isinstance(node, pg.Vmap):
        inner = {n.kind for n in nodes(node.body)}
        flags.update(f"vmap/{k}" for k in inner & {"while", "cond", "fori"})
  assert kinds >= set(KINDS) - {"arith"}, set(KINDS) - kinds
  assert devices == set(DEVICES), devices
  for kind in ("print", "log", "callback"):
    assert {(kind, True), (kind, False)} <= flags, (kind, flags)
  assert {"cond_fun", "cond_fun/static", "vmap/while", "vmap/cond",
          "per_effect", "global", "shard_map/deterministic",
          "shard_map/calls"} <= flags, flags


def test_canonical_form_keeps_what_the_contract_fixes():
  d = lambda i, text: f"[device {i} shard {i} process 0] {text}"
  a = ["default|begin|1", d(1, "default|p1|5"), d(0, "default|p1|4"),
       d(0, "default|p2|4"), "default|p3|9"]
  # devices interleave freely between two lines that run once
  b = ["default|begin|1", d(0, "default|p1|4"), d(1, "default|p1|5"),
       d(0, "default|p2|4"), "default|p3|9"]
  assert canonical(a, "global", False) == canonical(b, "global", False)
  # a device's line after the line that follows the shard_map: a difference
  c = ["default|begin|1", d(1, "default|p1|5"), d(0, "default|p1|4"),
       "default|p3|9", d(0, "default|p2|4")]
  assert canonical(a, "global", False) != canonical(c, "global", False)
  # inside deterministic(): the order as it is
  assert canonical(a, "global", True) != canonical(b, "global", True)
  # streams of different effects interleave freely in the per-effect mode
  e = ["gen-a|p1|1", "default|p2|1"]
  assert canonical(e, "per_effect", False) == canonical(e[::-1],
                                                         "per_effect", False)
  assert canonical(e, "global", False) != canonical(e[::-1], "global", False)
  # unordered lines: a multiset
  u = ["default|p1~|1", "default|p2|1", "gen-b|c3~|2"]
  assert canonical(u, "global", False) == canonical(u[::-1], "global", False)
  assert canonical(u, "global", False) != canonical(u[:2], "global", False)

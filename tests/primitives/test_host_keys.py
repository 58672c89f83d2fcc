"""A key names exactly one host function, in every process (issue 37;
``design/host_target.md``, "Keys" and "Trust").

* the batched and masked forms ``vmap`` makes of an effect are keys of
  their own (a vmapped ``print`` is not the plain one of the same format and
  shape), and an importing process rebuilds them batched;
* a key arriving in a module is made again from the spec it carries: a
  mismatch is refused and never binds the key;
* a module never reaches a local host function of this process, whatever
  key it copies (issue 49): its non-data keys are replaced on arrival;
* a module's format strings pass the checks a traced one does;
* every frame's buffers are checked against the site before a byte is
  read, on both entries, on every call (not only the site's first);
* ``jax.clear_caches()`` never unbinds a site a live function still runs.

Modules from elsewhere are made here as another program would: a real
export whose attributes are rewritten (``_forged``), or a plain ``jax.jit``
function calling the target with ``jax.ffi.ffi_call``.
"""
import json
import textwrap

import pytest

import helpers

# (the child: helpers common to the scripts below)
_PRELUDE = """
import dataclasses, json, os, re, sys
import jax, jax.numpy as jnp, numpy as np
import jax_effects as je
from jax.interpreters import mlir
from jax_effects import _compat
from jax_effects._primitives import host_target as host_keys

ALLOW = [jax.export.DisabledSafetyCheck.custom_call(je.HOST_TARGET)]

def export(f, *specs):
  return jax.export.export(je.jit(f), disabled_checks=ALLOW)(*specs)

def sites(exp):
  # [(key, spec text)] of the module's host calls, in order
  text = exp.mlir_module()
  out = []
  for m in re.finditer(r'jax_effects_key = "([^"]*)", jax_effects_spec = '
                       r'"((?:[^"\\\\]|\\\\.)*)"', text):
    spec = re.sub(r"\\\\([0-9A-Fa-f]{2})",
                  lambda h: chr(int(h.group(1), 16)), m.group(2))
    out.append((m.group(1), spec))
  return out

def effect_site(exp):
  # (key, spec text) of the module's one print or callback
  (found,) = [(k, t) for k, t in sites(exp)
              if json.loads(t)["effect"].get("kind") in ("print", "callback")]
  return found

def mlir_str(s):
  return s.replace("\\\\", "\\\\5C").replace('"', "\\\\22")

def forged(exp, old_key, new_key, new_spec):
  # exp with the host call of old_key given another key and spec
  text = exp.mlir_module()
  pattern = (r'jax_effects_key = "' + re.escape(old_key) +
             r'", jax_effects_spec = "(?:[^"\\\\]|\\\\.)*"')
  new = ('jax_effects_key = "' + mlir_str(new_key) +
         '", jax_effects_spec = "' + mlir_str(new_spec) + '"')
  text, n = re.subn(pattern, lambda m: new, text)
  assert n == 1, n
  with mlir.make_ir_context() as ctx:
    module = jax.interpreters.mlir.ir.Module.parse(text)
    blob = _compat.export_module_bytes(module)
  return dataclasses.replace(exp, mlir_module_serialized=blob)

def key_of(spec):
  return host_keys.key_of(spec).decode()

def effect_spec(spec, **change):
  d = json.loads(spec)
  d["effect"].update(change)
  return json.dumps(d, sort_keys=True, separators=(",", ":"))

def text_spec(spec, **change):
  d = json.loads(spec)
  d["effect"]["text"].update(change)
  return json.dumps(d, sort_keys=True, separators=(",", ":"))

def run(what, thunk):
  try:
    out = thunk()
    je.effects_barrier()
    print(what, "ok", flush=True)
  except Exception as err:
    print(what, "raised", type(err).__name__, str(err).replace("\\n", " "),
          flush=True)
"""


def _run(body: str, *args, timeout: float = 240):
  proc = helpers.run_script(_PRELUDE + textwrap.dedent(body), *args,
                            timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc.stdout.splitlines()


# --- 1. batched and masked forms are keys of their own -------------------------------

def test_a_vmapped_print_and_a_plain_one_never_share_a_key():
  # Either lowered first: each prints what it is (one process).
  lines = _run("""
      def el(x):
        je.print("v={}", x)
        return x
      x = jnp.arange(3.0)
      je.jit(jax.vmap(el))(x); je.effects_barrier()
      je.jit(el)(x); je.effects_barrier()
      je.jit(jax.vmap(el))(x + 10); je.effects_barrier()
      """)
  assert lines == ["v=0.0", "v=1.0", "v=2.0", "v=[0. 1. 2.]",
                   "v=10.0", "v=11.0", "v=12.0"]


_EXPORT_BATCHED = """
def el(x):
  je.print("el={}", x)
  je.callback(je.register_callback("keys.note", lambda v: None), None, x)
  return x * 2
def c(x):
  return jax.lax.cond(x > 0.5, lambda y: (je.print("c={}", y), y)[1],
                      lambda y: y, x)
def w(x):
  def body(v):
    je.print("w={}", v)
    return v - 1
  return jax.lax.while_loop(lambda v: v > 0, body, x)
spec3 = jax.ShapeDtypeStruct((3,), jnp.float32)
for name, f in (("el", jax.vmap(el)), ("c", jax.vmap(c)),
                ("w", jax.vmap(w))):
  open(os.path.join(sys.argv[1], name), "wb").write(
      export(f, spec3).serialize())
"""

_IMPORT_BATCHED = """
je.register_callback("keys.note", lambda v: print("note", v, flush=True))
def load(name):
  return jax.export.deserialize(bytearray(open(
      os.path.join(sys.argv[1], name), "rb").read()))
print("out", load("el").call(jnp.arange(3.0)).tolist(), flush=True)
je.effects_barrier()
load("c").call(jnp.arange(3.0)); je.effects_barrier()
load("w").call(jnp.array([0.0, 2.0, 1.0])); je.effects_barrier()
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """A folder of the modules another process exported (one child for
  the tests of 1 and 2: their modules' keys are data, the same in every
  process): ``el``, ``c``, ``w`` (_EXPORT_BATCHED) and ``forged``
  (_KEY_NOT_ITS_SPECS)."""
  pytest.importorskip("flatbuffers")   # (jax.export's serialization)
  folder = tmp_path_factory.mktemp("exported")
  assert _run(_EXPORT_BATCHED + _KEY_NOT_ITS_SPECS + """
open(os.path.join(sys.argv[1], "forged"), "wb").write(blob)
""", str(folder)) == []
  return folder


def test_an_exported_vmapped_print_and_callback_run_batched_in_the_importer(
    exported):
  lines = _run(_IMPORT_BATCHED, str(exported))
  assert lines == ["el=0.0", "el=1.0", "el=2.0", "note 0.0", "note 1.0",
                   "note 2.0", "out [0.0, 2.0, 4.0]",
                   "c=1.0", "c=2.0",
                   "w=2.0", "w=1.0", "w=1.0"]


# --- 2. a module's key is made again from its spec ------------------------------------

_KEY_NOT_ITS_SPECS = """
def mine(x):
  je.print("mine {}", x)
  return x
def theirs(x):
  je.print("module says {}", x)
  return x
scalar = jax.ShapeDtypeStruct((), jnp.float32)
mine_key, mine_spec = effect_site(export(mine, scalar))
exp = export(theirs, scalar)
theirs_key, theirs_spec = effect_site(exp)
assert mine_key == key_of(mine_spec) and mine_key != theirs_key
blob = forged(exp, theirs_key, mine_key, theirs_spec).serialize()
"""


def test_a_key_that_is_not_its_specs_is_refused_and_never_bound(exported):
  # The module is made by another process: in this fresh one, its own
  # print's key is bound by nobody before the module arrives claiming it
  # with another spec.
  blob = exported / "forged"
  lines = _run("""
module = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
run("module", lambda: module.call(jnp.float32(1.0)))
run("module again", lambda: module.call(jnp.float32(1.5)))
def mine(x):
  je.print("mine {}", x)
  return x
run("mine", lambda: je.jit(mine)(jnp.float32(2.0)))
run("module after", lambda: module.call(jnp.float32(3.0)))
""", str(blob))
  assert len(lines) == 6, lines
  for line in lines[:2]:
    assert " raised " in line and "is not the key of the spec" in line, line
  # (its key bound now, by this process's own print: the module's frame
  # runs what the key names, never what the module's spec says)
  assert lines[2:] == ["mine 2.0", "mine ok", "mine 3.0",
                       "module after ok"], lines


# --- 2b. a module never reaches a local host function of this process -------------

# (the victim's program: the same source in both processes, so the attacker
# computes its local site's key and spec as the victim's lowering makes them)
_VICTIM = """
def victim(x):
  je.callback(lambda v: print("LOCAL RAN", v, flush=True), None, x)
  return x + 1
"""

_FORGE_LOCAL = _VICTIM + """
# The attacker lowers the victim's function (a local callback: not
# exportable) only to read its key and spec, then exports a function of
# its own whose named callback has the same buffers and forges that call.
text = je.jit(victim).lower(jnp.float32(0)).as_text()
((local_key, local_spec),) = [
    (k, re.sub(r"\\\\([0-9A-Fa-f]{2})", lambda h: chr(int(h.group(1), 16)), t))
    for k, t in re.findall(r'jax_effects_key = "([^"]*)", jax_effects_spec = '
                           r'"((?:[^"\\\\]|\\\\.)*)"', text)]
assert local_key.startswith("jfx1.L") and local_key.endswith(".0"), local_key
note = je.register_callback("keys.attacker", lambda v: None)
def theirs(x):
  je.callback(note, None, x)
  return x
exp = export(theirs, jax.ShapeDtypeStruct((), jnp.float32))
key, spec = effect_site(exp)
d = sys.argv[1]
# its spec copied too; its own (data) spec kept; both under other names
open(os.path.join(d, "copied"), "wb").write(
    forged(exp, key, local_key, local_spec).serialize())
open(os.path.join(d, "own spec"), "wb").write(
    forged(exp, key, local_key, spec).serialize())
text = exp.mlir_module()
renamed = re.sub(r'jax_effects_key = "[^"]*", jax_effects_spec = '
                 r'"(?:[^"\\\\]|\\\\.)*"', lambda m: m.group(0)
                 .replace("jax_effects_key", "a_key", 1)
                 .replace("jax_effects_spec", "b_spec", 1)
                 if key in m.group(0) else m.group(0), text)
renamed = renamed.replace(key, local_key)
with mlir.make_ir_context():
  blob = _compat.export_module_bytes(mlir.ir.Module.parse(renamed))
open(os.path.join(d, "renamed"), "wb").write(
    dataclasses.replace(exp, mlir_module_serialized=blob).serialize())
"""


@pytest.fixture(scope="module")
def forged_local(tmp_path_factory):
  """A folder of the attacker's modules (_FORGE_LOCAL, alone in its child:
  the victim's site must be the first local one there, as in the
  victim's process), read by both tests of 2b."""
  pytest.importorskip("flatbuffers")
  folder = tmp_path_factory.mktemp("forged_local")
  assert _run(_FORGE_LOCAL, str(folder)) == []
  return folder


def test_a_module_never_runs_a_local_host_function_whose_key_it_copies(
    forged_local):
  # Issue 49: a local key is the hash of a spec anyone with the same source
  # can compute; the module copies it (with the local spec, with its own
  # spec, or under other attribute names) into its host call. In the
  # process whose local site is bound under that key, the module's call
  # runs nothing of it: the effect fails (UnboundHostFunction naming the
  # local effect, or the key refused as not its spec's), and the process's
  # own local callback still runs.
  lines = _run(_VICTIM + """
v = je.jit(victim)
run("victim", lambda: v(jnp.float32(1.0)))
for name in ("copied", "own spec", "renamed"):
  module = jax.export.deserialize(bytearray(open(
      os.path.join(sys.argv[1], name), "rb").read()))
  run(name, lambda: module.call(jnp.float32(42.0)))
  run(name + " again", lambda: module.call(jnp.float32(43.0)))
copied = jax.export.deserialize(bytearray(open(
    os.path.join(sys.argv[1], "copied"), "rb").read()))
run("in jax_effects.jit", lambda: je.jit(copied.call)(jnp.float32(42.0)))
run("in jax.jit", lambda: jax.jit(copied.call)(jnp.float32(42.0)))
run("victim after", lambda: v(jnp.float32(2.0)))
""", str(forged_local))
  assert not any("42" in line or "43" in line for line in lines
                 if line.startswith("LOCAL RAN")), lines
  assert lines[:2] == ["LOCAL RAN 1.0", "victim ok"], lines
  assert lines[-2:] == ["LOCAL RAN 2.0", "victim after ok"], lines
  middle = lines[2:-2]
  assert [line.split(" raised ")[0] for line in middle] == [
      "copied", "copied again", "own spec", "own spec again", "renamed",
      "renamed again", "in jax_effects.jit", "in jax.jit"], lines
  for line in middle[:2] + middle[6:]:
    assert " raised UnboundHostFunction " in line, line
    assert "jax_effects.callback(victim.<locals>.<lambda>)" in line, line
  for line in middle[2:6]:
    assert "is not the key of the spec" in line, line


def test_where_modules_cannot_be_screened_local_keys_are_a_secret(
    forged_local):
  # On a JAX whose lowering of an exported call jax_effects cannot wrap
  # (its internals missing: simulated by removing them before the import),
  # a module's keys cannot be screened; local keys then mix in a secret of
  # the process, so a key computed elsewhere from the same source is not
  # the victim's, and the copied call runs nothing of it.
  proc = helpers.run_script("""
import importlib
export = importlib.import_module("jax._src.export._export")
del export._call_exported_lowering   # (JAX's rule stays registered)
""" + _PRELUDE + _VICTIM + """
assert _compat.EXPORTED_CALLS in _compat.MISSING, _compat.MISSING
v = je.jit(victim)
run("victim", lambda: v(jnp.float32(1.0)))
for name in ("copied", "own spec", "renamed"):
  module = jax.export.deserialize(bytearray(open(
      os.path.join(sys.argv[1], name), "rb").read()))
  run(name, lambda: module.call(jnp.float32(42.0)))
run("victim after", lambda: v(jnp.float32(2.0)))
""", str(forged_local))
  assert proc.returncode == 0, proc.stderr[-4000:]
  lines = proc.stdout.splitlines()
  assert lines[:2] == ["LOCAL RAN 1.0", "victim ok"], lines
  assert lines[-2:] == ["LOCAL RAN 2.0", "victim after ok"], lines
  assert [line.split(" raised ")[0] for line in lines[2:-2]] == [
      "copied", "own spec", "renamed"], lines
  for line in lines[2:-2]:
    assert "SiteMismatch" in line, line


# --- 3. a module's format string is checked as a traced one ---------------------------

# (one child for the scenarios below and 4's, each after a line "== name":
# each forges its own module, whose key is made from its own bad spec, so no
# two share a key (nor 4's print's), and a key one of them wrongly bound
# could only pass that one; each module is called and refused twice, and
# 4's site runs after its refusals, so a refusal that left the runtime
# broken fails its own scenario)
_FORMATS = ["{0.__class__}", "{0.__init__.__globals__}", "{0[0]}", "{0:{1}}"]

_SCREENED = """
def theirs(x):
  je.print("module says {}", x)
  return x
exp = export(theirs, jax.ShapeDtypeStruct((2,), jnp.float32))
key, spec = effect_site(exp)
for fmt in json.loads(sys.argv[1]):
  print("== format", fmt, flush=True)
  bad = text_spec(spec, fmt=fmt)
  module = forged(exp, key, key_of(bad), bad)
  run("module", lambda: module.call(jnp.array([1.0, 2.0])))
  run("module again", lambda: module.call(jnp.array([1.0, 2.0])))

print("== callback arguments", flush=True)
note = je.register_callback("keys.args",
                            lambda *a, **k: print("called", a, k))
def theirs(x):
  je.callback(note, None, x)
  return x
exp = export(theirs, jax.ShapeDtypeStruct((), jnp.float32))
key, spec = effect_site(exp)
d = json.loads(spec)
d["effect"]["args"] = {"t": [{"t": [{"op": 0}, {"v": {"x": 1}}]},
                             {"d": []}]}
bad = json.dumps(d, sort_keys=True, separators=(",", ":"))
module = forged(exp, key, key_of(bad), bad)
run("module", lambda: module.call(jnp.float32(1.0)))
print("== end", flush=True)
"""


@pytest.fixture(scope="module")
def screened():
  """The finished child of the scenarios of 3 and 4, 4's first (its own
  print's site, with frames of other buffers sent under its key; it needs
  no serialization): ``helpers.scenario_lines``."""
  return helpers.run_script(
      _PRELUDE + '\nprint("== other buffers", flush=True)\n'
      + _OTHER_BUFFERS + _SCREENED, json.dumps(_FORMATS), timeout=240)


@pytest.mark.parametrize("fmt", _FORMATS)
def test_a_modules_format_string_is_checked_as_a_traced_one(screened, fmt):
  pytest.importorskip("flatbuffers")
  lines = helpers.scenario_lines(screened, f"format {fmt}")
  assert len(lines) == 2, lines   # (nothing formatted, nothing printed)
  for line in lines:
    assert " raised UnboundHostFunction " in line, line
    assert repr(fmt) in line, line


def test_a_modules_callback_arguments_must_be_data(screened):
  pytest.importorskip("flatbuffers")
  lines = helpers.scenario_lines(screened, "callback arguments")
  assert len(lines) == 1 and " raised UnboundHostFunction " in lines[0], lines
  assert "static leaf of type dict" in lines[0], lines


# --- 4. every frame's buffers are checked before a byte is read -----------------------

_OTHER_BUFFERS = """
def mine(x):
  je.print("mine {}", x)
  return x
spec = jax.ShapeDtypeStruct((4,), jnp.float32)
key, text = effect_site(export(mine, spec))
f = je.jit(mine)
f(jnp.arange(4.0)); f(jnp.arange(4.0) + 1); je.effects_barrier()

def call(operand, results=(jax.ShapeDtypeStruct((), jnp.int32),)):
  return jax.jit(lambda c, v: jax.ffi.ffi_call(
      je.HOST_TARGET, results, has_side_effect=True)(
          c, v, jax_effects_key=key, jax_effects_spec=text))(
      jnp.int32(0), operand)

run("one element", lambda: call(jnp.zeros((1,), jnp.float32)))
run("a million", lambda: call(jnp.zeros((1 << 20,), jnp.float32)))
run("int32", lambda: call(jnp.zeros((4,), jnp.int32)))
run("2x2", lambda: call(jnp.zeros((2, 2), jnp.float32)))
run("two results", lambda: call(jnp.zeros((4,), jnp.float32), (
    jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))))
run("fits", lambda: call(jnp.full((4,), 7.0, jnp.float32)))
f(jnp.arange(4.0) + 2); je.effects_barrier()
"""


def test_a_frame_whose_buffers_are_not_its_sites_is_refused_on_every_call(
    screened):
  # The site has run twice; frames of other buffers with its key are
  # refused before a byte of them is read (the entry's one frame check,
  # naming the site and what differs), then the site still runs.
  lines = helpers.scenario_lines(screened, "other buffers")
  assert lines[:2] == ["mine [0. 1. 2. 3.]", "mine [1. 2. 3. 4.]"], lines
  for line, what in zip(lines[2:7], ["one element", "a million", "int32",
                                     "2x2", "two results"]):
    assert line.startswith(f"{what} raised "), lines
    assert "SiteMismatch: jax_effects.print('mine {}'): a " in line, line
    assert ("count" if what == "two results" else "shape" if what != "int32"
            else "dtype") in line, line
  assert lines[7:] == ["mine [7. 7. 7. 7.]", "fits ok",
                       "mine [2. 3. 4. 5.]"], lines


# --- 5. a site in use is never unbound by jax.clear_caches() --------------------------

def test_clear_caches_beside_running_calls_never_unbinds_their_sites():
  # Bounded by work, not by time (issue 49: a clearer looping until the
  # workers were done starved them on a loaded 2-core machine, and the
  # joins' timeouts cut the run short): T workers make N calls each, and
  # the clearer clears once per STEP calls made, while the workers run on,
  # so every clear lands beside calls in flight and the run does the same
  # work however slow the machine is. On the code before issue 37 (sites
  # not kept across a clear) this raises UnboundHostFunction.
  lines = _run("""
import gc, threading
gc.collect(); gc.freeze()   # (the imports' heap: each clear's collection
                            # then scans what the calls made, ~5 ms for ~60)
seen = []
def f(x):
  je.callback(lambda v: seen.append(1), None, x)   # (a local site)
  return x + 1
g = je.jit(f)
N, T, STEP = 150, 3, 5
CLEARS = N * T // STEP - 1       # (the last one before the last call)
errors = []
made = [0]
progress = threading.Condition()
def clearer():
  for k in range(1, CLEARS + 1):
    with progress:
      progress.wait_for(lambda: made[0] >= k * STEP)
    jax.clear_caches(); gc.collect()
def worker():
  for i in range(N):
    try:
      g(jnp.float32(i))
    except Exception as e:
      errors.append(f"{type(e).__name__}: {e}")
    with progress:
      made[0] += 1
      progress.notify_all()
  try:
    je.effects_barrier()
  except Exception as e:
    errors.append(f"{type(e).__name__}: {e}")
c = threading.Thread(target=clearer); c.start()
ws = [threading.Thread(target=worker) for _ in range(T)]
[w.start() for w in ws]; [w.join() for w in ws]
c.join()
je.effects_barrier()
print(len(seen), N * T, errors[:3])
""", timeout=600)
  assert lines == ["450 450 []"]


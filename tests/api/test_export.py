"""``jax.export`` of ``jax_effects.jit`` functions with effects
(``design/host_target.md``, "Exported modules"; ``_dispatch/function.py``).

The exported module calls jax_effects' FFI target; its host sides are
rebuilt from their specs wherever it runs: ``print``/``log`` from data, a
``callback`` from the function registered under its name. Round trips in a
fresh process that imports jax_effects and nothing of the exporting
program; effects keep program order with the caller's.
"""
import logging
import os
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_effects as je
from jax_effects import _compat
import helpers

ALLOW = [jax.export.DisabledSafetyCheck.custom_call(je.HOST_TARGET)]


def export(f, *specs):
  return jax.export.export(f, disabled_checks=ALLOW)(*specs)


def test_export_runs_print_log_and_named_callback_in_order_on_each_call(
    effects_capture):
  seen = []
  note = je.register_callback("test_export.note",
                              lambda tag, v: seen.append((str(tag), float(v))))
  try:
    @je.jit
    def f(x, k):
      je.print("x = {} k = {}", x, k)
      je.log("sum {:.1f}", x.sum(), logger="test_export")
      je.callback(note, None, "ignored" if False else 1, x.sum() * k)
      return x * k

    exp = export(f, jax.ShapeDtypeStruct((3,), jnp.float32),
                 jax.ShapeDtypeStruct((), jnp.int32))
    assert exp.ordered_effects and exp.in_avals[0].shape == (3,)
    out1 = exp.call(jnp.arange(3.0), 2)
    out2 = exp.call(jnp.ones(3), 3)
    je.effects_barrier()
  finally:
    je.register_callback("test_export.note", None)
  np.testing.assert_array_equal(out1, [0.0, 2.0, 4.0])
  np.testing.assert_array_equal(out2, [3.0, 3.0, 3.0])
  assert effects_capture.printed == ["x = [0. 1. 2.] k = 2",
                                     "x = [1. 1. 1.] k = 3"]
  assert [r.getMessage() for r in effects_capture.logged] == [
      "sum 3.0", "sum 3.0"]
  assert seen == [("1", 6.0), ("1", 9.0)]


def test_exported_call_inside_jax_effects_jit_keeps_program_order():
  seen = []
  rec = je.register_callback("test_export.rec",
                             lambda tag, v: seen.append((int(tag), float(v))))
  try:
    @je.jit
    def inner(x):
      je.callback(rec, None, 1, x.sum())
      je.callback(rec, None, 2, x.sum() * 2)
      return x + 1

    exp = export(inner, jax.ShapeDtypeStruct((4,), jnp.float32))

    @je.jit
    def outer(x):
      je.callback(rec, None, 0, x.sum())
      y = exp.call(x)
      je.callback(rec, None, 3, y.sum())
      y = exp.call(y)
      je.callback(rec, None, 4, y.sum())
      return y

    for _ in range(20):   # (no data dependency but the chain orders them)
      outer(jnp.ones(4))
    je.effects_barrier()
  finally:
    je.register_callback("test_export.rec", None)
  assert [t for t, _ in seen] == [0, 1, 2, 3, 1, 2, 4] * 20
  assert seen[:7] == [(0, 4.0), (1, 4.0), (2, 8.0), (3, 8.0), (1, 8.0),
                      (2, 16.0), (4, 12.0)]


def test_export_of_an_unnamed_callback_is_refused_naming_it_and_the_fix():
  def log_step(v):
    pass

  @je.jit
  def f(x):
    je.print("kept {}", x)
    je.callback(log_step, None, x)
    return x

  with pytest.raises(ValueError) as info:
    export(f, jax.ShapeDtypeStruct((), jnp.float32))
  msg = str(info.value)
  assert "jax.export cannot export jax_effects.callback(" in msg
  assert "log_step" in msg
  assert "register_callback" in msg and "name" in msg
  # The fix it names is real API (no ``name=`` keyword of callback): the
  # call it spells out exports.
  assert "name=" not in msg
  assert ("jax_effects.callback(jax_effects.register_callback("
          "'my_callback', fn), ...)") in msg
  note = je.register_callback("my_callback", log_step)
  try:
    @je.jit
    def g(x):
      je.callback(note, None, x)
      return x

    assert export(g, jax.ShapeDtypeStruct((), jnp.float32)).ordered_effects
  finally:
    je.register_callback("my_callback", None)


def test_export_without_the_custom_call_check_disabled_names_the_target():
  @je.jit
  def f(x):
    je.print("x {}", x)
    return x

  with pytest.raises(ValueError, match=je.HOST_TARGET):
    jax.export.export(f)(jax.ShapeDtypeStruct((), jnp.float32))


def test_plain_export_is_refused_in_one_line_naming_the_disabled_check():
  @je.jit
  def step(x):
    je.print("x {}", x)
    return x

  with pytest.raises(ValueError) as info:
    jax.export.export(step)(jax.ShapeDtypeStruct((), jnp.float32))
  msg = str(info.value)
  assert "\n" not in msg and "stablehlo" not in msg
  assert ("disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("
          "jax_effects.HOST_TARGET)]") in msg
  assert "'step'" in msg
  # Allowed by name or by "ALL" (JAX 0.10 on), it exports.
  every = ([[jax.export.DisabledSafetyCheck.custom_call("ALL")]]
           if _compat.JAX_VERSION >= (0, 10) else [])
  for checks in [ALLOW, *every]:
    exp = jax.export.export(step, disabled_checks=checks)(
        jax.ShapeDtypeStruct((), jnp.float32))
    assert exp.ordered_effects


_EXPORTER = """
import logging, sys
import jax, jax.numpy as jnp
import jax_effects as je

note = je.register_callback("roundtrip.note", lambda v: None)

@je.jit
def step(x, n):
  je.print("step {} of {}: x = {}", n, 3, x)
  je.log("mean {:.2f}", x.mean(), logger="roundtrip", level=logging.WARNING)
  y = je.callback(je.register_callback("roundtrip.double", lambda v: v * 2),
                  jax.ShapeDtypeStruct((2,), jnp.float32), x)
  je.print("doubled {}", y)
  return y + n

exp = jax.export.export(
    step, disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(je.HOST_TARGET)])(
    jax.ShapeDtypeStruct((2,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
open(sys.argv[1], "wb").write(exp.serialize())
"""

_IMPORTER = """
import logging, sys
import jax, jax.numpy as jnp
import jax_effects as je
logging.basicConfig(stream=sys.stdout, format="LOG %(name)s %(levelname)s %(message)s")
if sys.argv[2] == "register":
  je.register_callback("roundtrip.double", lambda v: v * 2)
exp = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))

@je.jit
def caller(x):
  je.print("before {}", x)
  y = exp.call(x, 1)
  je.print("after {}", y)
  return y

def run(what, thunk):
  try:
    print(what, thunk(), flush=True)
  except LookupError as err:
    print("LookupError", err, flush=True)

run("eager", lambda: exp.call(jnp.array([1.0, 2.0]), 2))
run("jit", lambda: caller(jnp.array([0.5, 0.25])))
run("jit", lambda: caller(jnp.array([0.5, 0.25])))
run("barrier", je.effects_barrier)
"""


#: The importer's two runs in one fresh process, each after a line naming
#: it: without the callback registered, then with it (the module read anew).
_IMPORTERS = """
import sys
blob = sys.argv[1]
for how in ("no", "register"):
  print("== " + how, flush=True)
  sys.argv[1:] = [blob, how]
  exec(IMPORTER, {"__name__": "__main__"})
print("== end", flush=True)
"""


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory, exported):
  """The finished child of both importer runs (``helpers.scenario_lines``);
  its script imports nothing of the exporter."""
  importer = tmp_path_factory.mktemp("importer") / "importer.py"
  importer.write_text(_IMPORTERS.replace(
      "IMPORTER", repr(textwrap.dedent(_IMPORTER)), 1))
  return helpers.run_python(importer, str(exported["step"]))


def _round_trip(round_trips, register: bool):
  return helpers.scenario_lines(round_trips,
                                "register" if register else "no")


def test_export_round_trip_in_a_fresh_process(round_trips):
  lines = _round_trip(round_trips, register=True)
  call = ["before [0.5  0.25]",
          "step 1 of 3: x = [0.5  0.25]",
          "LOG roundtrip WARNING mean 0.38",
          "doubled [1.  0.5]",
          "after [2.  1.5]",
          "jit [2.  1.5]"]
  assert lines == ["step 2 of 3: x = [1. 2.]",
                   "LOG roundtrip WARNING mean 1.50",
                   "doubled [2. 4.]",
                   "eager [4. 6.]", *call, *call, "barrier None"]


def test_exported_named_callback_not_registered_is_a_lookup_error_naming_it(
    round_trips):
  # The callback's effect fails like a callback that raises: its result is
  # zeros, the module's later effects of that execution are skipped, the
  # rest runs, and the error (a LookupError naming the callback and the fix)
  # reaches the thread that ran it (a computation run inline on it), once:
  # the eager call's by the next jax_effects call, before it runs anything.
  lookup = ("LookupError jax_effects.callback named 'roundtrip.double': no "
            "function is registered under that name in this process; call "
            "jax_effects.register_callback('roundtrip.double', fn) before "
            "the computation runs")
  call = ["before [0.5  0.25]",
          "step 1 of 3: x = [0.5  0.25]",
          "LOG roundtrip WARNING mean 0.38",
          "after [1. 1.]"]
  assert _round_trip(round_trips, register=False) == [
      "step 2 of 3: x = [1. 2.]",
      "LOG roundtrip WARNING mean 1.50",
      "eager [2. 2.]",
      lookup,            # (the first jit call ran nothing)
      *call, lookup,     # (its own callback's error, raised by the call)
      "barrier None"]


# --- over several devices (issue 49, item 3) -------------------------------------------

def _over_devices(mesh):
  """Two jax_effects.jit functions over the mesh's 8 devices: a print that
  runs once (a sharded input: automatic partitioning) and a per-device one
  (a shard_map), exported, serialized and deserialized."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  def once(x):
    # (slow: a device that did not wait for it would print first)
    je.callback(je.register_callback(
        "test_export.slow", lambda s: time.sleep(float(s))), None, 0.02)
    je.print("once {}", x.sum())
    return x * 2

  def per_device(x):
    def body(b):
      je.print("dev {}", b.sum())
      return b + 1
    return jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                         out_specs=P("i"))(x)

  spec = jax.ShapeDtypeStruct((8,), jnp.float32,
                              sharding=NamedSharding(mesh, P("i")))
  out = []
  for f in (once, per_device):
    exp = export(je.jit(f), spec)
    assert exp.nr_devices == 8 and exp.ordered_effects
    out.append(jax.export.deserialize(exp.serialize()))
  return out


def _per_device_lines(i):
  return sorted(f"[device {d} shard {d} process 0] dev {float(i + d)}"
                for d in range(8))


def test_export_over_several_devices_runs_its_effects_in_order(
    mesh, effects_capture):
  # Issue 49: JAX refused to serialize the module (its host_callbacks).
  pytest.importorskip("flatbuffers")   # (jax.export's serialization)
  once, per_device = _over_devices(mesh)
  x = helpers.sharded(mesh, jnp.arange(8.0))
  n = 12
  for i in range(n):
    np.testing.assert_array_equal(once.call(x + i), (x + i) * 2)
    np.testing.assert_array_equal(per_device.call(x + i), x + i + 1)
  je.effects_barrier()
  lines = effects_capture.printed
  assert len(lines) == 9 * n, lines
  for i in range(n):   # (a call's lines after the call before it)
    block = lines[9 * i:9 * i + 9]
    assert block[0] == f"once {float(28 + 8 * i)}", lines
    assert sorted(block[1:]) == _per_device_lines(i), lines


def test_export_over_several_devices_called_in_jax_effects_jit_keeps_order(
    mesh, effects_capture):
  pytest.importorskip("flatbuffers")
  once, per_device = _over_devices(mesh)

  @je.jit
  def caller(x):
    je.print("before {}", x.sum())
    y = per_device.call(x)
    z = once.call(y)
    je.print("after {}", z.sum())
    return z

  x = helpers.sharded(mesh, jnp.arange(8.0))
  for _ in range(3):
    np.testing.assert_array_equal(caller(x), (x + 1) * 2)
  je.effects_barrier()
  lines = effects_capture.printed
  assert len(lines) == 3 * 11, lines
  for k in range(3):
    block = lines[11 * k:11 * k + 11]
    assert block[0] == "before 28.0", lines
    assert sorted(block[1:9]) == _per_device_lines(0), lines
    assert block[9:] == ["once 36.0", "after 72.0"], lines


def test_export_over_several_devices_prints_a_summarized_array(
    mesh, effects_capture):
  # A summarized print of a sharded array, which a call assembles on the
  # host from the devices' parts (JAX's partitioned callback target, which
  # jax.export cannot serialize), is exported with its edges gathered: the
  # same line.
  pytest.importorskip("flatbuffers")
  from jax.sharding import NamedSharding, PartitionSpec as P

  def f(x):
    je.print("big {}", x)
    return x

  spec = jax.ShapeDtypeStruct((4096,), jnp.float32,
                              sharding=NamedSharding(mesh, P("i")))
  exp = jax.export.deserialize(export(je.jit(f), spec).serialize())
  x = helpers.sharded(mesh, jnp.arange(4096.0))
  je.jit(f)(x)
  exp.call(x)
  je.effects_barrier()
  ran, exported = effects_capture.printed
  assert exported == ran and "..." in ran and "4.095e+03" in ran, ran


_SEVERAL_EXPORTER = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np
import jax_effects as je
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("i",))

def f(x):
  je.print("once {}", x.sum())
  y = jax.shard_map(lambda b: (je.print("dev {}", b.sum()), b + 1)[1],
                    mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
  je.log("big {}", jnp.tile(y, 512), logger="several")   # (summarized)
  return y

spec = jax.ShapeDtypeStruct((8,), jnp.float32,
                            sharding=NamedSharding(mesh, P("i")))
open(sys.argv[1], "wb").write(jax.export.export(je.jit(f), disabled_checks=[
    jax.export.DisabledSafetyCheck.custom_call(je.HOST_TARGET)])(
        spec).serialize())
"""

_SEVERAL_IMPORTER = """
import logging, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np
import jax_effects as je
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
logging.getLogger("several").addHandler(logging.StreamHandler(sys.stdout))
logging.getLogger("several").setLevel(logging.INFO)
mesh = Mesh(np.array(jax.devices()), ("i",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
exp = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
print("out", exp.call(x).tolist(), flush=True)
je.effects_barrier()

@je.jit
def caller(x):
  je.print("before")
  y = exp.call(x)
  je.print("after {}", y.sum())
  return y

caller(x)
je.effects_barrier()
"""


def test_export_over_several_devices_round_trip_in_a_fresh_process(exported):
  proc = helpers.run_script(_SEVERAL_IMPORTER, str(exported["several"]))
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  devices = sorted(f"[device {d} shard {d} process 0] dev {float(d)}"
                   for d in range(8))
  big = "big [1. 2. 3. ... 6. 7. 8.]"
  assert len(lines) == 23, lines
  assert lines[0] == "once 28.0" and sorted(lines[1:9]) == devices, lines
  assert lines[9:11] == [big, "out [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]"]
  assert lines[11:13] == ["before", "once 28.0"], lines
  assert sorted(lines[13:21]) == devices, lines
  assert lines[21:] == [big, "after 36.0"], lines


#: One fresh process exports both modules (8 CPU devices, set first; ``step``
#: takes unsharded operands, so its module is a one-device one all the
#: same); the round trips import their modules in fresh processes (``step``'s
#: two runs in one: ``round_trips``).
_EXPORTERS = f"""
import sys
blobs = {{"several": sys.argv[2], "step": sys.argv[1]}}
for name, source in [("several", {_SEVERAL_EXPORTER!r}),
                     ("step", {_EXPORTER!r})]:
  sys.argv[1:] = [blobs[name]]
  exec(source, {{"__name__": "__main__"}})
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """The serialized modules of ``_EXPORTER`` and ``_SEVERAL_EXPORTER``."""
  pytest.importorskip("flatbuffers")   # (jax.export's serialization)
  folder = tmp_path_factory.mktemp("exported")
  blobs = {"step": folder / "step.jax_exported",
           "several": folder / "several.jax_exported"}
  proc = helpers.run_script(_EXPORTERS, str(blobs["step"]),
                            str(blobs["several"]))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout == ""   # (exporting runs nothing)
  return blobs


def test_export_of_plain_jax_jit_over_several_devices_is_refused_naming_why(
    mesh):
  # Under plain jax.jit over several devices an effect is a call of JAX's
  # callback target (design/host_target.md): refused in our words, naming
  # jax.export, several devices and the fix, not JAX's "serialization of
  # host_callbacks is not yet implemented".
  from jax.sharding import NamedSharding, PartitionSpec as P

  def f(x):
    je.print("x {}", x.sum())
    return x

  spec = jax.ShapeDtypeStruct((8,), jnp.float32,
                              sharding=NamedSharding(mesh, P("i")))
  with pytest.raises(NotImplementedError) as info:
    export(jax.jit(f), spec)
  msg = str(info.value)
  assert msg.startswith("jax.export cannot export jax_effects.print('x {}') "
                        "over several devices"), msg
  assert "export a jax_effects.jit function" in msg, msg


def test_export_for_another_platform_is_refused_naming_cpu():
  @je.jit
  def f(x):
    je.print("x {}", x)
    return x

  with pytest.raises(ValueError, match="for CPU only"):
    jax.export.export(f, platforms=["cuda"], disabled_checks=ALLOW)(
        jax.ShapeDtypeStruct((), jnp.float32))


def test_docs_do_not_say_export_of_effects_is_refused():
  # README "Existing jax.debug code" and the reference's jit entry once said
  # so while export worked (issue 39): they say what the code does.
  import pathlib
  root = pathlib.Path(__file__).parents[2]
  for doc in ("README.md", "docs/reference.md"):
    text = " ".join((root / doc).read_text().replace("`", "").split())
    assert "export of a function with effects is refused" not in text, doc
  reference = " ".join((root / "docs/reference.md").read_text().split())
  assert ("exports a function with effects: its `print`s, `log`s and named "
          "`callback`s run in the importing process") in reference


def test_export_of_a_progress_bar_is_refused_naming_it_and_the_docs_say_so():
  # (a bar's host side draws on this process's terminal: not rebuilt)
  @je.jit
  def f(xs):
    with je.progress(xs.shape[0], desc="train") as bar:
      def step(c, x):
        bar.update()
        return c + x, None
      c, _ = jax.lax.scan(step, 0.0, xs)
    return c

  with pytest.raises(ValueError) as info:
    export(f, jax.ShapeDtypeStruct((4,), jnp.float32))
  msg = str(info.value)
  assert msg.startswith(
      "jax.export cannot export jax_effects.progress(desc='train'):"), msg
  assert "run it around the exported call" in msg
  # README and the reference list it among what export refuses (issue 49).
  import pathlib
  root = pathlib.Path(__file__).parents[2]
  readme = " ".join((root / "README.md").read_text().split())
  assert ("A `progress` bar (or a jax-tqdm bar, an adopted "
          "`jax.debug.callback`) is refused at export too") in readme
  reference = " ".join((root / "docs/reference.md").read_text().split())
  assert ("an unnamed `callback`, a `progress` bar, a "
          "`jax.debug.print`/`callback` or an `io_callback` in it is refused "
          "at export") in reference
  assert ("`jax.export` of a function holding a bar is refused, naming "
          "it") in reference


@pytest.mark.parametrize("kind", ["print", "log", "callback", "io_callback"])
def test_export_of_an_adopted_jax_callback_suggests_jax_effects_own(kind):
  # jax.debug.print inside jax_effects.jit is adopted; its host side is
  # JAX's Python function, so export refuses it, suggesting the call of
  # jax_effects that exports in its place.
  if kind == "log" and not hasattr(jax.debug, "log"):
    pytest.skip("this JAX has no jax.debug.log")
  bind = {
      "print": lambda x: jax.debug.print("x = {}", x),
      "log": lambda x: jax.debug.log("x = {}", x),
      "callback": lambda x: jax.debug.callback(lambda v: None, x),
      "io_callback": lambda x: __import__(
          "jax.experimental", fromlist=["io_callback"]).io_callback(
              lambda v: None, None, x),
  }[kind]

  @je.jit
  def f(x):
    bind(x)
    return x

  with pytest.raises(ValueError) as info:
    export(f, jax.ShapeDtypeStruct((), jnp.float32))
  msg = str(info.value)
  assert "(adopted by jax_effects.jit)" in msg
  fix = msg.split("Fix: ", 1)[1]
  if kind in ("print", "log"):
    assert fix.startswith(f"use jax_effects.{kind}('x = {{}}', ...) (the same "
                          "format string and arguments) instead, which "
                          "exports; or export the function without it"), msg
    ours = getattr(je, kind)

    @je.jit
    def g(x):
      ours("x = {}", x)
      return x

    assert export(g, jax.ShapeDtypeStruct((), jnp.float32)).ordered_effects
  else:
    assert fix.startswith("use a named jax_effects.callback "
                          "(jax_effects.callback(jax_effects.register_callback("
                          "'my_callback', fn), ...)"), msg

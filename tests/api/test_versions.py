"""Supported JAX lines (0.8 to 0.12) and their limits
(``design/versions.md``).

Version differences live in ``jax_effects._compat``; a feature that a line
cannot support raises ``_compat.UnsupportedFeature`` with the reason that the
tests' ``jax_feature`` marker (tests/conftest.py) also skips with. Settings
read when JAX starts (pmap staging, jaxpr constants) are tried in a fresh
process (pmap staging: a child forked before JAX starts its backend).
"""
import configparser
import json
import os
import pathlib
import re
import types

import jax
import jax.numpy as jnp
import jaxlib
import pytest
from packaging.requirements import Requirement

import jax_effects as je
from jax_effects import _compat

from helpers import run_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _report(proc) -> dict:
  assert proc.returncode == 0, proc.stderr
  (report,) = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")]
  return json.loads(report[len("REPORT "):])


def test_installed_jax_is_in_the_range_setup_cfg_states():
  # tox pins one line per environment; the pins must lie in the stated range.
  cfg = configparser.ConfigParser()
  cfg.read(ROOT / "setup.cfg")
  lines = cfg["options"]["install_requires"].split()
  reqs = {r.name: r for r in map(Requirement, filter(None, lines))
          if r.name in ("jax", "jaxlib")}
  assert str(reqs["jax"].specifier) == str(reqs["jaxlib"].specifier)
  assert reqs["jax"].specifier.contains(jax.__version__), jax.__version__
  assert reqs["jaxlib"].specifier.contains(jaxlib.__version__)
  major_minor = tuple(map(int, jax.__version__.split(".")[:2]))
  assert _compat.JAX_VERSION[:2] == major_minor


_LEGACY_PMAP = """
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp
    try:
      jax.config.update("jax_pmap_shmap_merge", False)
    except AttributeError:   # JAX 0.10: no such option
      print("REPORT " + json.dumps({"option": False}))
      raise SystemExit
    import jax_effects as je
    from jax_effects._runtime import output as _output
    from jax_effects import _compat
    lines = []
    _output.add_line_listener(lines.append)

    def body(x):
      je.print("x={}", x)
      return x * 2

    errors = {}
    for name, make in [("je.jit(pmap)", lambda: je.jit(jax.pmap(body))),
                       ("pmap", lambda: jax.pmap(body)),
                       ("pmap(je.jit)", lambda: jax.pmap(je.jit(body)))]:
      try:
        make()(jnp.arange(4.0))
        je.effects_barrier()
        errors[name] = None
      except Exception as exc:
        errors[name] = [type(exc).__name__, str(exc)]
    reason = _compat.unsupported_reason("effects in jax.pmap")
    lines_before = list(lines)
    jax.config.update("jax_pmap_shmap_merge", True)   # the default again
    out = je.jit(jax.pmap(lambda x: body(x) + 1))(jnp.arange(4.0))
    je.effects_barrier()
    print("REPORT " + json.dumps({
        "option": True, "errors": errors, "reason": reason,
        "lines_before": lines_before, "lines_after": lines[len(lines_before):],
        "out": out.tolist(), "version": jax.__version__}))
"""


def test_effects_in_legacy_staged_pmap_are_a_clear_error(forked):
  report = _report(types.SimpleNamespace(**forked["legacy pmap"]))
  if not report["option"]:
    pytest.skip("jax_pmap_shmap_merge is an option of JAX 0.8 and 0.9 only; "
                f"JAX {jax.__version__} always stages pmap as shard_map")
  reason = report["reason"]
  assert reason is not None
  for words in ("jax.pmap", "jax_pmap_shmap_merge", "JAX >= 0.10",
                f"installed: JAX {report['version']}"):
    assert words in reason, words
  # Every route into a legacy pmap raises the same error, naming the call,
  # before anything runs; with JAX's default staging the same body works.
  expected = ["UnsupportedFeature", f"jax_effects.print('x={{}}'): {reason}"]
  assert report["errors"] == {"je.jit(pmap)": expected, "pmap": expected,
                              "pmap(je.jit)": expected}
  assert report["lines_before"] == []
  assert sorted(report["lines_after"]) == [
      f"[device {d} shard {d} process 0] x={float(d)}" for d in range(4)]
  assert report["out"] == [2 * d + 1 for d in range(4)]


_SIMPLIFIED_CONSTANTS = """
    import json
    import jax, jax.numpy as jnp, numpy as np
    import jax_effects as je
    from jax_effects._runtime import output as _output
    from jax_effects import _compat
    lines = []
    _output.add_line_listener(lines.append)
    x = jnp.ones(4, jnp.float32)
    c_np = np.full((4,), 2.0, np.float32)
    c_jax = jnp.full((4,), 3.0, jnp.float32)

    def numpy_constant(x):
      return x + c_np

    def jax_constant(x):
      je.print("s={}", (x + c_jax).sum())
      return x + c_jax

    try:
      jax.jit(numpy_constant)(x).block_until_ready()
      plain_numpy_ok = True
    except Exception:
      plain_numpy_ok = False
    out = je.jit(jax_constant)(x)
    je.effects_barrier()
    print("REPORT " + json.dumps({
        "simplified": jax.config.jax_use_simplified_jaxpr_constants,
        "plain_numpy_ok": plain_numpy_ok, "out": out.tolist(), "lines": lines,
        "reason": _compat.unsupported_reason("simplified jaxpr constants")}))
"""


def test_simplified_constants_limit_is_exactly_jaxs():
  # The limit _compat states for this line is JAX's own (plain jax.jit fails
  # exactly where the reason says so), and the fix it names (close over
  # jax.Arrays) works through jax_effects.jit on every line.
  # (JAX 0.8 and 0.9 read the setting when JAX is imported: a fresh process)
  report = _report(run_script(_SIMPLIFIED_CONSTANTS, env={
      "JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS": "1"}))
  assert report["simplified"] is True
  assert report["plain_numpy_ok"] == (report["reason"] is None)
  assert report["out"] == [4.0] * 4
  assert report["lines"] == ["s=16.0"]


def test_4bit_integer_operands_are_a_clear_error_where_jax_passes_them_wrong():
  # JAX 0.8 and 0.9 hand int4/uint4 arrays to host callbacks with wrong
  # values: refused there, naming the feature and the JAX version needed;
  # exact on JAX >= 0.10.
  from jax_effects import _compat
  seen = []
  x = jnp.array([1, 2, -3], dtype=jnp.int4)
  f = je.jit(lambda x: je.callback(lambda v: seen.append(v.tolist()), None, x))
  if _compat.unsupported_reason("4-bit integer operands"):
    with pytest.raises(NotImplementedError,
                       match=r"callback.*int4/uint4.*JAX >= 0\.10"):
      f(x)
  else:
    f(x)
    je.effects_barrier()
    assert seen == [[1, 2, -3]]


# --- a JAX whose internals jax_effects cannot find ---------------------------
# (design/versions.md, "A JAX line newer than the tested ones": an internal
# every feature needs -> one ImportError naming the installed JAX, the
# tested lines and the fix; one a feature needs -> that feature raises
# UnsupportedFeature, the rest works.)

_HIDE = {
    # an import that fails (the module is gone)
    "module": "sys.modules['jax._src.shard_map'] = None",
    # a name gone from a module (from ... import name)
    "name": "del jax._src.debugging.debug_print_p",
    # an attribute read at import (module.attribute)
    "attribute": "del jax._src.callback._callback_op_sharding",
}


#: The imports against a changed JAX (the tests below), and the legacy pmap
#: staging (above: set before JAX starts its backend), in one fresh process:
#: it imports JAX once (no backend), then forks a child per scenario that
#: changes JAX or its settings as the scenario says and imports jax_effects,
#: a first import (the parent never imports it); each child's stdout, stderr
#: and exit status are its scenario's.
_FORKED_SCENARIOS = """
    import json, os, sys, tempfile, textwrap, traceback
    import jax, jax._src.shard_map, jax._src.debugging, jax._src.callback
    from jax._src.interpreters import mlir
    report = {}
    for name, source in json.loads(sys.argv[1]).items():
      out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
      pid = os.fork()
      if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
          exec(textwrap.dedent(source), {})
          code = 0
        except SystemExit as exit:   # (as in a fresh process)
          code = exit.code or 0
        except BaseException:   # (as an uncaught exception: its traceback)
          traceback.print_exc()
          code = 1
        sys.exit(code)   # (its exit handlers run, as in a fresh process)
      _, status = os.waitpid(pid, 0)
      out.seek(0)
      err.seek(0)
      report[name] = {"returncode": os.waitstatus_to_exitcode(status),
                      "stdout": out.read(), "stderr": err.read()}
    print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def forked():
  """Scenario name -> what its child of ``_FORKED_SCENARIOS`` did
  (``stdout``, ``stderr``, ``returncode``)."""
  scenarios = {
      "legacy pmap": _LEGACY_PMAP,
      **{f"hide {how}": f"import sys, jax\n{line}\nimport jax_effects\n"
         for how, line in _HIDE.items()},
      **{f"reshape {how}": _RESHAPED_IMPORT.format(source=source)
         for how, source in _RESHAPE.items()},
      "feature missing": _FEATURE_MISSING}
  proc = run_script(_FORKED_SCENARIOS, json.dumps(scenarios))
  assert proc.returncode == 0, proc.stderr[-3000:]
  (report,) = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")]
  return json.loads(report[len("REPORT "):])


@pytest.mark.parametrize("how", sorted(_HIDE))
def test_import_without_an_internal_it_needs_names_jax_and_the_fix(
    how, forked):
  proc = types.SimpleNamespace(**forked[f"hide {how}"])
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("ImportError: jax_effects "), proc.stderr[-2000:]
  assert f"the installed JAX {jax.__version__} " in last
  assert ", ".join(_compat.TESTED) in last
  assert "Fix: install a tested JAX" in last
  assert "AttributeError: module" not in last.split("(", 1)[0]


# A JAX whose internals are there but have another shape: jax_effects
# re-registers JAX's lowering rules of the higher-order primitives (every
# line: ``_pass/control_flow_rules``) and of its ordered callbacks (0.10+) at import
# (``_compat.wrap_lowerings``), outside the guarded imports.
_RESHAPE = {
    # register_lowering without `inline` (the other rules' callers pass none)
    "register_lowering without inline": """
        register = mlir.register_lowering
        def register_lowering(prim, rule, platform=None, cacheable=True):
          return register(prim, rule, platform=platform, cacheable=cacheable)
        mlir.register_lowering = register_lowering
    """,
    # a registry entry that is a bare function (no .rule, no .inline)
    "lowering entry without rule": """
        from jax import lax
        mlir._lowerings[lax.while_p] = mlir._lowerings[lax.while_p].rule
    """,
}


_RESHAPED_IMPORT = """
import textwrap
import jax
from jax._src.interpreters import mlir
exec(textwrap.dedent({source!r}))
try:
  import jax_effects
  print("imported")
except ImportError as err:
  print("ImportError", err)
"""


@pytest.mark.parametrize("how", sorted(_RESHAPE))
def test_import_with_an_internal_of_another_shape_names_jax_and_the_fix(
    how, forked):
  proc = types.SimpleNamespace(**forked[f"reshape {how}"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [l for l in proc.stdout.splitlines()
             if l.startswith("ImportError")]
  assert line.startswith("ImportError jax_effects "), line
  assert f"the installed JAX {jax.__version__} " in line
  assert "missing or has changed" in line
  assert ", ".join(_compat.TESTED) in line
  assert "Fix: install a tested JAX" in line


def test_tested_lines_are_tox_s_lines():
  # versions.TESTED names the JAX of every line tox.ini pins, and the
  # installed JAX is one of them (but under `tox -e jaxnext`).
  tox = (ROOT / "tox.ini").read_text()
  pinned = sorted(set(re.findall(r"jax\d+: jax==([\d.]+)", tox)))
  assert pinned == sorted(_compat.TESTED)
  if not os.environ.get("JAX_EFFECTS_JAXNEXT"):
    assert jax.__version__ in _compat.TESTED


_FEATURE_MISSING = """
      import importlib
      import jax, jax.numpy as jnp
      import jax._src.export._export   # (JAX's own code has it)
      load = importlib.import_module

      def newer_jax(name, *args, **kwargs):   # (where jax_effects looks)
        if name == "jax._src.export._export":
          raise ImportError(f"No module named {name!r}")
        return load(name, *args, **kwargs)
      importlib.import_module = newer_jax
      import jax_effects as je
      importlib.import_module = load
      from jax_effects import _compat

      @je.jit
      def inner(x):
        je.print("inner {}", x.sum())
        return x + 1

      exp = jax.export.export(inner, disabled_checks=[
          jax.export.DisabledSafetyCheck.custom_call(je.HOST_TARGET)])(
              jax.ShapeDtypeStruct((2,), jnp.float32))
      print("plain", float(je.jit(lambda x: (je.print("p {}", x.sum()),
                                             x * 2)[1])(jnp.ones(2)).sum()))
      try:
        je.jit(lambda x: exp.call(x) * 2)(jnp.ones(2))
      except _compat.UnsupportedFeature as err:
        print("refused", err)
"""


def test_a_feature_whose_internals_are_missing_alone_is_refused(forked):
  proc = types.SimpleNamespace(**forked["feature missing"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout.splitlines()
  assert out[:2] == ["p 2.0", "plain 4.0"], proc.stdout
  (refused,) = [l for l in out if l.startswith("refused ")]
  assert "calling a jax.export function with effects needs a JAX internal" in refused
  assert f"JAX {jax.__version__} lacks" in refused
  assert "Fix: install a tested JAX" in refused


_NOTHING_OF_JAX_EXTEND = """
import json, sys
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import jax_effects as je

def step(x):
  je.print("sum {}", x.sum())
  je.log("log {}", x[0])
  return x + 1

def per_device(v):
  je.print("shard {}", v.sum())
  return v * 2

mesh = jax.sharding.Mesh(jax.devices()[:2], ("d",))
x = jax.device_put(jnp.arange(4.0), jax.NamedSharding(mesh, P("d")))
je.jit(step)(x)
je.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("d"),
                     out_specs=P("d")))(x)
je.effects_barrier()
print("REPORT", json.dumps(sorted(
    m for m in sys.modules if m == "jax.extend"
    or m.startswith(("jax.extend.", "jax._src.pallas")))))
"""


def test_import_and_use_load_nothing_of_jax_extend_or_pallas():
  # ``jax.extend``'s __init__ imports Pallas, whose configuration states
  # (JAX 0.11+) enter every jax.jit call's key, and costs ~25 ms of our
  # import: ``_compat.core`` takes the same objects from where it does.
  proc = run_script(_NOTHING_OF_JAX_EXTEND, env={
      "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
  assert _report(proc) == []
  assert "sum 6.0" in proc.stdout and "shard 1.0" in proc.stdout

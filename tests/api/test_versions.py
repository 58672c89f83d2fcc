"""Supported JAX lines (0.8, 0.9, 0.10) and their limits
(``design/versions.md``).

Version differences live in ``jax_effects._compat``; a feature that a line
cannot support raises ``_compat.UnsupportedFeature`` with the reason that the
tests' ``jax_feature`` marker (tests/conftest.py) also skips with. Settings
read when JAX starts (pmap staging, jaxpr constants) are tried in a subprocess.
"""
import configparser
import json
import pathlib

import jax
import jax.numpy as jnp
import jaxlib
import pytest
from packaging.requirements import Requirement

import jax_effects as je
from jax_effects import _compat

from helpers import run_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(script: str, **env_updates) -> dict:
  proc = run_script(script, env=env_updates)
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


def test_effects_in_legacy_staged_pmap_are_a_clear_error():
  report = _run(_LEGACY_PMAP)
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
  report = _run(_SIMPLIFIED_CONSTANTS, JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS="1")
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

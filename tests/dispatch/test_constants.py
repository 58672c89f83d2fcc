"""Closed-over constants keep JAX's treatment under jax_effects.jit
(``design/tokens.md``, "Parameter order of the lowered module").

JAX lowers closed-over constants in two ways, chosen when JAX is imported by
``JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS`` (the lowering default is read at
import, so each mode runs in a subprocess): inlined into the module (old) or
hoisted as ``jax.const`` arguments of ``main`` (simplified), never inlined.
An effectful function must be lowered like the same function under plain
``jax.jit``, with its runtime-token argument after the const arguments.
"""
import json
import textwrap

import pytest

from helpers import run_script

SCRIPT = textwrap.dedent(r"""
    import collections, json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax._src import util  # JAX's test-event hook: counts C++ cache misses
    import jax_effects as je

    events = collections.Counter()
    util.test_event_listener = lambda name, *a: events.update([name])

    big_np = np.full((4096,), 1234.5, np.float32)       # distinctive value
    big_jax = jnp.full((4096,), 777.25, jnp.float32)

    def pure(x):
      return x + big_np + big_jax

    def effectful(x):
      y = pure(x)
      je.print("sum={}", y.sum())
      return y

    x = jnp.ones(4096, jnp.float32)
    plain = jax.jit(pure).lower(x).as_text()
    ours = je.jit(effectful).lower(x).as_text()
    ours_pure = je.jit(pure).lower(x).as_text()

    f = je.jit(effectful)
    lines = []
    from jax_effects._runtime import output as _output
    _output.add_line_listener(lines.append)
    out = f(x)
    f(x)
    je.effects_barrier()
    events.clear()
    for _ in range(5):
      out = f(x)
    je.effects_barrier()

    def signature(text):
      return re.search(r"@main\((.*?)\) ->", text).group(1)

    def has_big(text):
      # the constants' values, as StableHLO prints them (hex or splat)
      return any(s in text for s in ("1.234500e+03", "7.772500e+02",
                                     "0x00509A44", "0x00504244"))

    sys.stdout.write("REPORT ")
    json.dump({
        "simplified": jax.config.jax_use_simplified_jaxpr_constants,
        "plain_len": len(plain), "ours_len": len(ours),
        "plain_has_big": has_big(plain), "ours_has_big": has_big(ours),
        "ours_pure_equals_plain": ours_pure == plain,
        "plain_sig": signature(plain), "ours_sig": signature(ours),
        "out_ok": bool(np.allclose(out, 1 + 1234.5 + 777.25)),
        "lines": lines,
        "cpp_misses": events["jit_cpp_cache_miss"],
    }, sys.stdout)
""")


_reports: dict = {}


def _run(simplified: bool) -> dict:
  """The subprocess's report for one constants mode (run once per mode)."""
  if simplified in _reports:
    return _reports[simplified]
  proc = run_script(SCRIPT, env={
      "JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS": "1" if simplified else "0",
      "XLA_FLAGS": None})
  assert proc.returncode == 0, proc.stderr
  (report,) = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")]
  out = _reports[simplified] = json.loads(report[len("REPORT "):])
  return out


@pytest.fixture(scope="module", params=[
    False,
    pytest.param(True, marks=pytest.mark.jax_feature(
        "simplified jaxpr constants"))],
                ids=["old-constants", "simplified-constants"])
def report(request):
  return _run(request.param)


def test_mode_is_the_requested_one(report, request):
  assert report["simplified"] == ("simplified" in request.node.callspec.id)


def test_effects_run_and_results_are_right(report):
  assert report["out_ok"]
  expected = f"sum={float(4096 * (1 + 1234.5 + 777.25)):.1f}"
  assert report["lines"] == [expected] * 7


def test_constants_lowered_as_plain_jax_jit_does(report):
  assert report["ours_pure_equals_plain"]
  assert report["ours_has_big"] == report["plain_has_big"]
  # the effectful module adds the callback and token plumbing, not constants
  assert report["ours_len"] - report["plain_len"] < 4000


@pytest.mark.jax_feature("simplified jaxpr constants")
def test_simplified_constants_are_hoisted_not_inlined():
  # (with old constants JAX inlines them, as plain jax.jit shows)
  report = _run(True)
  assert not report["plain_has_big"] and not report["ours_has_big"]
  assert report["ours_len"] < 4000
  params = [p.strip() for p in report["ours_sig"].split("%arg")[1:]]
  plain = [p.strip() for p in report["plain_sig"].split("%arg")[1:]]
  # const args first (as JAX orders them), then the runtime token, then x
  assert [("jax.const = true" in p) for p in params] == [True, True, False,
                                                         False]
  assert [("jax.const = true" in p) for p in plain] == [True, True, False]
  assert "tensor<i32>" in params[2]
  assert "tensor<4096xf32>" in params[3]


def test_fast_path_with_const_args(report):
  assert report["cpp_misses"] == 0

"""No XLA "[SPMD] Involuntary full rematerialization" warnings
(``design/placement.md``, "No resharding warnings").

The programs run in a subprocess (XLA writes the warning to the process's
stderr from C++), one after another, each after a line naming it. A program whose JAX equivalent (jax.debug.print) gets no
warning must get none with jax_effects either; the warning text is first
shown to appear for a program that really does reshard that way, so the
check cannot pass by not seeing stderr.
"""
import textwrap

import pytest

from helpers import run_python, run_script, scenario_lines

WARNING = "Involuntary full rematerialization"

PRELUDE = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_num_cpu_devices", 8)
    import jax_effects as je
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("i",))
    x = jax.device_put(jnp.arange(8), NamedSharding(mesh, P("i")))
""")

PROGRAMS = {
    # An effect in a shard_map body, then one after it (a per-device
    # carrier meets an effect that runs once), then in a loop and a branch
    # after it, then another shard_map.
    "after_shard_map": """
        def body(v):
          pr("in {}", v[0])
          return v * 2
        sm = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
        def f(x):
          y = sm(x)
          pr("after {}", y.sum())
          z = jax.lax.fori_loop(0, 2, lambda i, c: (pr("loop {}", i), c + 1)[1],
                                y.sum())
          z = jax.lax.cond(z > 0, lambda: (pr("branch {}", z), z)[1], lambda: z)
          return sm(y), z
        for _ in range(2):
          jit(f)(x)
    """,
    # A whole sharded array printed once (ours gathers it without the
    # warning; JAX's own program does warn here).
    "sharded_value": """
        jit(lambda x: (pr("x={}", x), x)[1])(x)
        jit(lambda x: (pr("y={}", x * 2), x)[1])(x)
    """,
}


#: The scenarios of one child, in order: (whose print, program). JAX's own
#: print of a sharded value, which does warn, comes last (no warning of it
#: can land in another's part of stderr).
SCENARIOS = [("ours", "after_shard_map"), ("ours", "sharded_value"),
             ("jax", "after_shard_map"), ("jax", "sharded_value")]


def _child_script():
  """Each scenario after a line ``== whose program`` on stdout and stderr
  (XLA writes the warning while it compiles: within its scenario)."""
  parts = [PRELUDE]
  for whose, name in SCENARIOS:
    parts.append(textwrap.dedent(f"""
        print("== {whose} {name}", flush=True)
        print("== {whose} {name}", file=sys.stderr, flush=True)
        pr = {"je.print" if whose == "ours" else "jax.debug.print"}
        jit = {"je.jit" if whose == "ours" else "jax.jit"}
    """) + textwrap.dedent(PROGRAMS[name])
        + "je.effects_barrier(); jax.effects_barrier()\n")
  parts.append('print("== end", flush=True)\n'
               'print("== end", file=sys.stderr, flush=True)\n')
  return "".join(parts)


@pytest.fixture(scope="module")
def child():
  """The finished child of every scenario (``helpers.scenario_lines``)."""
  return run_script(_child_script())


def _stderr(child, whose, name):
  return "\n".join(scenario_lines(child, f"{whose} {name}", "stderr"))


def test_the_warning_is_visible_to_these_tests(child):
  # JAX's own print of a sharded value warns: the check sees stderr.
  assert WARNING in _stderr(child, "jax", "sharded_value")


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_no_rematerialization_warning(child, name):
  err = _stderr(child, "ours", name)
  assert WARNING not in err, err[-3000:]
  lines = scenario_lines(child, f"ours {name}")
  if name == "after_shard_map":
    assert [l for l in lines if not l.startswith("[device")] == [
        "after 56", "loop 0", "loop 1", "branch 58"] * 2
    assert sum(l.startswith("[device") for l in lines) == 32
  else:
    assert lines == ["x=[0 1 2 3 4 5 6 7]", "y=[ 0  2  4  6  8 10 12 14]"]


def test_after_shard_map_jax_equivalent_has_no_warning(child):
  # The reference for "where JAX's equivalent program does not".
  assert WARNING not in _stderr(child, "jax", "after_shard_map")


def test_demo_has_no_rematerialization_warning():
  out = run_python("-m", "jax_effects", "demo")
  assert out.returncode == 0, out.stderr[-3000:]
  assert WARNING not in out.stderr, out.stderr[-3000:]

"""``python -m jax_effects demo`` runs and shows effects in program order
(``design/architecture.md``, "Tools"; README "Usage")."""
from helpers import run_python


def _run(*args):
  return run_python("-m", "jax_effects", *args)


def test_demo_runs_every_section_in_order():
  out = _run("demo")
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert "8 cpu device(s)" in lines[0]
  headings = [l for l in lines if l.startswith("=== ")]
  assert headings == [
      "=== ordered printing through cond / while_loop / scan ===",
      "=== callbacks with results ===",
      "=== named effects ===",
      "=== effects_barrier ===",
      "=== multi-device: sharded jit, shard_map, log, deterministic view ===",
  ]
  start = lines.index("start n=6")
  steps = [l.strip() for l in lines[start:] if l.strip().startswith("step ")]
  assert steps[-1] == "step 8: n=1" and len(steps) == 8
  assert "done: 8 steps, scan total 6" in lines
  assert lines.index("  check n=6") < lines.index("  step 1: n=3")
  assert [l for l in lines if l.startswith("[metrics]")] == [
      "[metrics] step 0 loss=1.000", "[metrics] step 1 loss=0.500",
      "[metrics] step 2 loss=0.333"]
  assert "in order: [0, 1, 2, 3, 4]" in out.stdout
  # Its five print sites are host calls in the StableHLO (jax_effects'
  # target, counted: the while loop's check is lowered twice).
  said = [l for l in lines if l.startswith("(its StableHLO threads")]
  assert len(said) == 1 and int(said[0].split()[-3]) >= 5, said


def test_demo_options():
  out = _run("demo", "--sections", "callback", "--devices", "2")
  assert out.returncode == 0, out.stderr
  assert "2 cpu device(s)" in out.stdout
  assert "x=3.0 -> square=9.0 (host call #3)" in out.stdout
  assert "named effects" not in out.stdout
  bad = _run("demo", "--sections", "nope")
  assert bad.returncode == 2 and "nope" in bad.stderr

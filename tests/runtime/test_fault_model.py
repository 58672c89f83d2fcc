"""The model-based fault-injection test of issue 31.

Random small programs x random injected faults, each run checked against a
plain-Python model of what must be observed: the programs, the faults, the
model and its checks are ``fault_model.py`` (its docstring). The cases run
in subprocesses (the templates compile once per process; a hang there is
bounded by the driver's watchdog, which prints every thread's stack, and
by the subprocess's time limit), split in :data:`PARTS` parts so that
``pytest -n`` runs them side by side.

Sizes: :data:`CASES` seeds (200; 3,000 with ``--run-slow``), fixed, so a
run is reproducible. 200 (300 before issue 49 item 12) still catch each
fault of the runtime that 300 caught, tried on JAX 0.12: a callback error
kept for thread 0 instead of its own (``errors.defer``: seeds 76, 96, 112,
118, 148, 159 of 200; 7 of 300), a failed write swallowed (26 of the first
150), an all-threads barrier that does not wait for exited threads' work
(a race: 2 and 4 of 200 in two runs, 5 of 300; 150 missed it in one run).
A failure lists each violating seed; replay one with
``JAX_EFFECTS_FAULT_SEED=<seed> pytest tests/runtime/test_fault_model.py``
(one part runs that seed, with its program printed), or by hand with
``python tests/runtime/fault_model.py --seeds <seed>:<seed+1> --verbose``.
"""
import json
import os

import pytest

import helpers

CASES = helpers.scale(200, 3000)
PARTS = helpers.scale(2, 8)
MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                     "fault_model.py")
REPLAY = os.environ.get("JAX_EFFECTS_FAULT_SEED")


def _seeds(part: int) -> tuple[int, int]:
  if REPLAY is not None:
    seed = int(REPLAY)
    return (seed, seed + 1) if part == 0 else (0, 0)
  per = -(-CASES // PARTS)
  return part * per, min(CASES, (part + 1) * per)


@pytest.mark.parametrize("part", range(PARTS))
def test_random_programs_under_random_faults_keep_the_contract(part,
                                                               tmp_path):
  a, b = _seeds(part)
  if a == b:
    pytest.skip("replaying one seed (JAX_EFFECTS_FAULT_SEED) in part 0")
  out = tmp_path / "results.jsonl"
  argv = [MODEL, "--seeds", f"{a}:{b}", "--out", str(out)]
  if REPLAY is not None:
    argv.append("--verbose")
  proc = helpers.run_python(*argv, timeout=180 + 3 * (b - a))
  lines = ([json.loads(line) for line in out.read_text().splitlines()]
           if out.exists() else [])
  hangs = [r for r in lines if r.get("hang")]
  violating = [r for r in lines if r.get("violations")]
  report = []
  for r in hangs:
    report.append(f"seed {r['seed']} HANGS (past the case's bound; fault "
                  f"{r['fault']}); stacks on stderr below")
  for r in violating[:12]:
    report.append(f"seed {r['seed']} (fault {r.get('fault')}):")
    report += [f"    {kind}: {detail[:400]}" for kind, detail in
               r["violations"][:4]]
  done = any(r.get("seed") == "done" for r in lines)
  if not done and not hangs:
    report.append(f"the driver died (status {proc.returncode}) after "
                  f"{len([r for r in lines if isinstance(r.get('seed'), int)])}"
                  " cases")
  assert not report, (
      f"{len(violating)} of seeds {a}:{b} violate the contract"
      + (f", {len(hangs)} hang" if hangs else "") + ":\n" + "\n".join(report)
      + "\nreplay: JAX_EFFECTS_FAULT_SEED=<seed> pytest "
      "tests/runtime/test_fault_model.py (program and violations on stderr)"
      + f"\n--- driver stderr (end) ---\n{proc.stderr[-8000:]}")


#: Seeds of the ``clear-caches`` class (issue 37: a site in use is never
#: unbound by ``jax.clear_caches()``), drawn only when named, so that the
#: cases above stay what they were. With the sites not kept across a clear
#: (``TraceCache.clear`` without its retired store, as before issue 37),
#: several of these seeds raise ``UnboundHostFunction`` (the race varies:
#: 3, 5 and 5 of the first 20 in three runs on a loaded 2-core machine,
#: JAX 0.12; 20 seeds, 40 before issue 49 item 12).
CLEAR_CASES = helpers.scale(20, 200)


def test_random_programs_beside_clear_caches_keep_the_contract(tmp_path):
  if REPLAY is not None:
    pytest.skip("replaying one seed (JAX_EFFECTS_FAULT_SEED)")
  out = tmp_path / "results.jsonl"
  # Bounded by work (issue 49): CLEAR_CASES cases, each clearing at most
  # fault_model.CLEARS_PER_PHASE times, one per step of its phase; the
  # timeout only catches a hang (a case past its bound is one already).
  proc = helpers.run_python(MODEL, "--seeds", f"0:{CLEAR_CASES}", "--faults",
                            "clear-caches", "--out", str(out),
                            timeout=max(600, 15 * CLEAR_CASES))
  lines = ([json.loads(line) for line in out.read_text().splitlines()]
           if out.exists() else [])
  report = [f"seed {r['seed']}: " + "; ".join(
      f"{kind}: {detail[:300]}" for kind, detail in r["violations"][:3])
      for r in lines if r.get("violations")]
  report += [f"seed {r['seed']} HANGS" for r in lines if r.get("hang")]
  if not any(r.get("seed") == "done" for r in lines):
    report.append(f"the driver died (status {proc.returncode})")
  assert not report, "\n".join(report) + (
      f"\n--- driver stderr (end) ---\n{proc.stderr[-4000:]}")

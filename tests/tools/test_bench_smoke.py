"""``python -m jax_effects bench`` runs and reports its targets (a smoke run).

Timings are never asserted here (README, "Benchmark"): this checks that the
command runs in a fresh process, with ``--quick``, for the rows that need no
simulated devices of their own (dispatch (a)-(d), the progress bar's loop
(k), which checks that XLA kept its floor's host calls, the warm-cache
first call (o), whose children check their own output and their cache hits
(also the program of 200 prints, 20 with ``--quick``, from its process's
start), and a print per step of a loop against Python's (q), batched or
not, which checks that the text is Python's own), and that its JSON report
has a finite value for each of their targets and says which FFI entry it
measured.
"""
import json
import math

from helpers import run_python


def test_bench_quick_reports_its_targets(tmp_path):
  proc = run_python("-m", "jax_effects", "bench", "--quick", "--json",
                    "--only", "abcdkoq", timeout=600, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout)
  targets = report["targets"]
  for name in ("c/i", "d/c", "b/a", "o_prints/jax", "o_plain/jax",
               "o_slices/jax", "o_200/jaxprint", "k_ours/plain",
               "k_iii/plain", "k_ours/iii", "k_rounds_ours/iii",
               "q_print/python", "q_log/python", "q_callback/python",
               "q_batched128/python", "q_batched1024/python"):
    assert math.isfinite(targets[name]["value"]), (name, targets[name])
  assert report["results"]["o_equations"] == 600
  assert report["results"]["o_200_prints"] == 20
  assert targets["q_same_text"]["value"] == 1.0
  assert report["results"]["q_setup"] == {"steps": 2000}

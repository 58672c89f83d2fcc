"""``tests/thirdparty/run.py`` (``tox -e thirdparty``) on a stand-in suite
(``design/thirdparty.md``, "Re-running third-party suites under the
replacement").

A source tree given with ``--src jax=PATH`` holding one of JAX's test file
names, whose tests pass with JAX's ``jax.jit`` and one of which fails when
``jax.jit`` is ``jax_effects.jit``: the harness runs it plain and replaced
(the replacement made before the test module is imported, also in xdist
workers; no pytest configuration but the suite's own), counts both runs
from pytest's summary, lists the test that passes plain and fails replaced
with its error, and exits 1. No network:
the real suites' sdists are only downloaded by ``tox -e thirdparty``.
"""
import json
import pathlib
import textwrap

from helpers import run_python

RUN = pathlib.Path(__file__).parents[1] / "thirdparty" / "run.py"

SUITE = textwrap.dedent("""
    import jax
    import jax.numpy as jnp

    AT_IMPORT = jax.jit(lambda x: x + 1)   # built when the module is imported

    def test_same_both_ways():
      assert float(AT_IMPORT(jnp.float32(1))) == 2.0
      assert float(jax.jit(lambda x: x * 2)(jnp.float32(2))) == 4.0

    def test_needs_jaxs_own_jit():
      assert not type(AT_IMPORT).__module__.startswith("jax_effects"), (
          "jax.jit was jax_effects.jit at import")

    def test_skipped():
      import pytest
      pytest.skip("not here")
""")


def test_runs_a_suite_plain_and_replaced(tmp_path):
  # A pytest configuration further up (as this project's tox.ini is above
  # .tox/) is not the suite's: it must not apply.
  (tmp_path / "tox.ini").write_text("[pytest]\naddopts = --not-an-option\n")
  src = tmp_path / "jax-src"
  (src / "tests").mkdir(parents=True)
  (src / "tests" / "debugging_primitives_test.py").write_text(SUITE)
  work = tmp_path / "work"
  out = run_python(RUN, "--suite", "jax", "--src", f"jax={src}",
                   "--workdir", str(work), "-n", "2", timeout=600)
  assert out.returncode == 1, out.stdout + out.stderr
  summary = json.loads((work / "summary.json").read_text())["jax"]
  counts = {mode: {k: v for k, v in run["counts"].items() if k != "seconds"}
            for mode, run in summary["runs"].items()}
  assert counts == {
      "plain": {"passed": 2, "failed": 0, "error": 0, "skipped": 1},
      "replaced": {"passed": 1, "failed": 1, "error": 0, "skipped": 1}}
  assert "python_callback_test.py" in summary["missing"]
  lost = "debugging_primitives_test.py::test_needs_jaxs_own_jit [failed]"
  lines = out.stdout.splitlines()
  assert [l.strip() for l in lines if "pass->fail" in l or "[failed]" in l] \
      == [l.strip() for l in lines if "pass->fail" in l] + [lost]
  row = [l for l in lines if l.startswith("jax ")]
  assert len(row) == 1 and row[0].rstrip().endswith("| 1")
  message = lines[lines.index("  " + lost) + 1]
  assert message.strip().startswith(
      "AssertionError: jax.jit was jax_effects.jit at import")


def test_a_one_process_suite_runs_its_files_in_one_process_in_order(
    tmp_path):
  # diffrax's suite: its adjoint tests run after a progress meter's effect,
  # in the same process (what jax.jit = jax_effects.jit must survive), even
  # when the run asks for xdist workers. A stand-in distribution named
  # diffrax (its metadata only) makes the suite count as installed.
  site = tmp_path / "site" / "diffrax-0.7.2.dist-info"
  site.mkdir(parents=True)
  (site / "METADATA").write_text(
      "Metadata-Version: 2.1\nName: diffrax\nVersion: 0.7.2\n")
  src = tmp_path / "diffrax-src"
  (src / "test").mkdir(parents=True)
  mark = tmp_path / "first.pid"
  (src / "test" / "test_progress_meter.py").write_text(textwrap.dedent(f"""
      import os
      def test_first():
        open({str(mark)!r}, "w").write(str(os.getpid()))
  """))
  (src / "test" / "test_adjoint.py").write_text(textwrap.dedent(f"""
      import os
      def test_second():
        assert open({str(mark)!r}).read() == str(os.getpid())
  """))
  work = tmp_path / "work"
  out = run_python(RUN, "--suite", "diffrax", "--src", f"diffrax={src}",
                   "--workdir", str(work), "-n", "2", "--mode", "plain",
                   timeout=600, env={"PYTHONPATH": str(tmp_path / "site")})
  assert out.returncode == 0, out.stdout + out.stderr
  summary = json.loads((work / "summary.json").read_text())["diffrax"]
  assert summary["version"] == "0.7.2"
  counts = summary["runs"]["plain"]["counts"]
  assert (counts["passed"], counts["failed"]) == (2, 0), out.stdout

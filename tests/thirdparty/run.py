"""Third-party test suites, plain and with ``jax.jit = jax_effects.jit``.

``tox -e thirdparty`` (or ``python tests/thirdparty/run.py`` in an
environment with the suites' packages installed) runs each suite twice:
once as it is ("plain") and once with ``jax.jit`` replaced by
``jax_effects.jit`` for the whole run ("replaced", the pytest plugin
``jax_effects_global_jit`` beside this file). It prints the counts of both
runs side by side and every test that passes plain and fails replaced, with
its error, and writes ``summary.json`` (every test's outcome and message in
both runs) to the work folder. Exit status 1 when such a test exists, 2 when
a suite could not run, else 0.

Where the tests come from: chex and optax ship their tests in their source
distributions, which are downloaded from the package index (``pip
download``) for the *installed* version. equinox's, diffrax's and JAX's
source distributions ship none: give a source tree of the installed
version (a checkout of its release tag) with ``--src equinox=PATH`` /
``--src diffrax=PATH`` / ``--src jax=PATH``, or the suite is reported as
not run. Only the test files named in ``SUITES`` run (the parts of each
suite that exercise ``jax.jit``; the whole of some suites takes hours on
two cores); a suite marked ``one_process`` runs its files in one process,
in their order (diffrax: a progress meter's effect, then the adjoints).

    python tests/thirdparty/run.py                       # every suite
    python tests/thirdparty/run.py --suite chex -n 2     # one suite
    python tests/thirdparty/run.py --src jax=~/src/jax --suite jax
    python tests/thirdparty/run.py --src diffrax=~/src/diffrax --suite diffrax
    python tests/thirdparty/run.py --suite optax -- -k adam  # pytest args
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
PLUGIN = "jax_effects_global_jit"
MODES = ("plain", "replaced")


@dataclasses.dataclass(frozen=True)
class Suite:
  name: str
  dist: str            # the installed distribution whose tests run
  files: tuple         # test files, relative to the source tree's root
  sdist_has_tests: bool
  note: str = ""
  # Its files run in one process, in the order given (no xdist workers):
  # a later file's tests depend on what an earlier one left in the process.
  one_process: bool = False


SUITES = {
    s.name: s for s in (
        Suite("chex", "chex", (
            "chex/_src/asserts_test.py",
            "chex/_src/asserts_chexify_test.py",
            "chex/_src/asserts_internal_test.py",
            "chex/_src/variants_test.py",
            "chex/_src/fake_test.py",
            "chex/_src/dataclass_test.py",
            "chex/_src/dimensions_test.py",
            "chex/_src/warnings_test.py",
        ), True),
        Suite("optax", "optax", (
            "optax/_src/alias_test.py",
        ), True, "the optimizer suite"),
        Suite("flax", "flax", (
            "tests/nnx/transforms_test.py",
            "tests/linen/linen_transforms_test.py",
        ), True, "nnx.jit and linen's lifted transforms"),
        Suite("equinox", "equinox", (
            "tests/test_jit.py",
            "tests/test_errors.py",
            "tests/test_debug.py",
        ), False, "a checkout of equinox's release tag"),
        Suite("diffrax", "diffrax", (
            "test/test_progress_meter.py",
            "test/test_adjoint.py",
        ), False, "a checkout of diffrax's release tag", one_process=True),
        Suite("jax", "jax", (
            "tests/debugging_primitives_test.py",
            "tests/python_callback_test.py",
            "tests/lax_control_flow_test.py",
        ), False, "a checkout of the tag jax-v<version>"),
    )
}


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _sdist_tree(suite: Suite, version: str, workdir: pathlib.Path
                ) -> pathlib.Path:
  """The unpacked source distribution of ``suite.dist==version``."""
  root = workdir / "src" / f"{suite.dist}-{version}"
  if root.is_dir():
    return root
  down = workdir / "sdists"
  down.mkdir(parents=True, exist_ok=True)
  subprocess.run(
      [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
       "--no-binary", ":all:", "--dest", str(down),
       f"{suite.dist}=={version}"], check=True)
  name = suite.dist.replace("-", "_")
  (archive,) = [p for p in down.iterdir()
                if p.name.lower().startswith(f"{name}-{version}".lower())
                or p.name.lower().startswith(f"{suite.dist}-{version}".lower())]
  tmp = workdir / "src" / f".{root.name}.tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  with tarfile.open(archive) as tar:
    try:
      tar.extractall(tmp, filter="data")
    except TypeError:   # Python without extraction filters (< 3.10.12)
      tar.extractall(tmp)
  (top,) = tmp.iterdir()
  top.rename(root)
  tmp.rmdir()
  return root


def _source(suite: Suite, given: dict, workdir: pathlib.Path
            ) -> tuple[pathlib.Path | None, str]:
  """``(tree, why)``: where the suite's test files are, or None and why not."""
  if suite.name in given:
    tree = pathlib.Path(given[suite.name]).expanduser().resolve()
  elif suite.sdist_has_tests:
    tree = _sdist_tree(suite, _version(suite.dist), workdir)
  else:
    return None, (f"{suite.dist}'s source distribution ships no tests; "
                  f"pass --src {suite.name}=PATH ({suite.note})")
  missing = [f for f in suite.files if not (tree / f).is_file()]
  if len(missing) == len(suite.files):
    return None, f"none of its test files is in {tree}: {', '.join(missing)}"
  return tree, (f"not in {tree} (not run): {', '.join(missing)}"
                if missing else "")


def _workspace(suite: Suite, tree: pathlib.Path, workdir: pathlib.Path
               ) -> tuple[pathlib.Path, list]:
  """``(cwd, files)`` for pytest: the suite's test files found in ``tree``.

  A source tree of JAX itself is not run in place (its package folder
  would shadow the installed jax and jaxlib's matching Python code): its
  test files are copied to a folder of their own.
  """
  files = [f for f in suite.files if (tree / f).is_file()]
  if suite.name != "jax":
    return tree, files
  run_dir = workdir / "jax-tests"
  shutil.rmtree(run_dir, ignore_errors=True)
  run_dir.mkdir(parents=True)
  for f in files:
    shutil.copy(tree / f, run_dir / pathlib.Path(f).name)
  return run_dir, [pathlib.Path(f).name for f in files]


def _has_pytest_config(tree: pathlib.Path) -> bool:
  """Whether ``tree`` (its root) holds a pytest configuration."""
  for name, marker in (("pytest.ini", ""), (".pytest.ini", ""),
                       ("pyproject.toml", "[tool.pytest.ini_options]"),
                       ("tox.ini", "[pytest]"), ("setup.cfg", "[tool:pytest]")):
    path = tree / name
    if path.is_file() and marker in path.read_text(errors="replace"):
      return True
  return False


def _run_pytest(suite: Suite, mode: str, cwd: pathlib.Path, files: list,
                workdir: pathlib.Path, workers: str, extra: list
                ) -> tuple[pathlib.Path, float, int]:
  xml = workdir / f"{suite.name}-{mode}.xml"
  xml.unlink(missing_ok=True)
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "no:randomly", f"--junitxml={xml}",
         "-o", "junit_family=xunit1", "--rootdir", str(cwd)]
  if not _has_pytest_config(cwd):
    # The suite's own configuration applies where it has one; else none
    # (pytest would look further up, e.g. into this project's tox.ini when
    # the work folder is under .tox/).
    empty = workdir / "pytest-none.ini"
    empty.write_text("[pytest]\n")
    cmd += ["-c", str(empty)]
  if workers not in ("0", "") and not suite.one_process:
    cmd += ["-n", workers]
  if mode == "replaced":
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd += ["-p", PLUGIN]
  cmd += [*files, *extra]
  log = workdir / f"{suite.name}-{mode}.log"
  print(f"[{suite.name} {mode}] {' '.join(cmd[1:])}  (log: {log})",
        flush=True)
  start = time.monotonic()
  with open(log, "w") as out:
    rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out,
                        stderr=subprocess.STDOUT).returncode
  took = time.monotonic() - start
  tail = log.read_text(errors="replace").strip().splitlines()[-1:]
  print(f"[{suite.name} {mode}] exit {rc} in {took:.0f} s: "
        f"{tail[0] if tail else ''}", flush=True)
  return xml, took, rc


def _outcomes(xml: pathlib.Path) -> dict:
  """Test id -> (outcome, one-line message) from a JUnit XML report."""
  out = {}
  if not xml.is_file():
    return out
  for case in ET.parse(xml).getroot().iter("testcase"):
    test_id = _node_id(case)
    outcome, message = "passed", ""
    for child in case:
      if child.tag in ("failure", "error", "skipped"):
        outcome = {"failure": "failed", "error": "error",
                   "skipped": "skipped"}[child.tag]
        message = _one_line(child.get("message") or child.text or "")
        if outcome != "skipped":
          break
    if test_id in out and out[test_id][0] in ("failed", "error"):
      continue   # (an error in teardown after a failure: keep the failure)
    out[test_id] = (outcome, message)
  return out


def _node_id(case) -> str:
  """pytest's node id of a JUnit ``testcase`` (xunit1: with ``file``)."""
  classname = case.get("classname") or ""
  path = case.get("file") or classname.replace(".", "/") + ".py"
  last = classname.rsplit(".", 1)[-1]
  parts = [path] + ([last] if last != pathlib.Path(path).stem else [])
  return "::".join([*parts, case.get("name") or ""])


def _one_line(message: str) -> str:
  lines = [l.strip() for l in message.strip().splitlines() if l.strip()]
  line = lines[0] if lines else ""
  return line if len(line) <= 240 else line[:237] + "..."


def _counts(log: pathlib.Path) -> dict:
  """The counts of pytest's last summary line (``5 failed, 579 passed, ...``;
  the JUnit report can hold fewer test cases: subtests)."""
  counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
  lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
  for line in reversed(lines):
    found = re.findall(r"(\d+) (passed|failed|errors?|skipped)\b", line)
    if found and (" in " in line):
      for n, what in found:
        counts["error" if what.startswith("error") else what] += int(n)
      took = re.search(r" in ([\d.]+)s", line)
      counts["seconds"] = round(float(took.group(1))) if took else None
      break
  return counts


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--suite", action="append", choices=sorted(SUITES),
                      help="run only these suites (repeatable)")
  parser.add_argument("--src", action="append", default=[],
                      metavar="NAME=PATH",
                      help="a suite's source tree (needed for equinox, "
                      "diffrax, jax)")
  parser.add_argument("--mode", choices=(*MODES, "both"), default="both",
                      help="run only one side (the other side's results "
                      "from an earlier run in --workdir are compared)")
  parser.add_argument("--reuse", action="store_true",
                      help="do not run again what an earlier run in "
                      "--workdir left results of")
  parser.add_argument("-n", "--workers", default="2",
                      help="pytest-xdist workers per run (0: none)")
  parser.add_argument("--workdir", default=".thirdparty",
                      help="downloads, logs, JUnit reports, summary.json")
  parser.add_argument("pytest_args", nargs="*",
                      help="after --: passed on to pytest")
  args = parser.parse_args(argv)
  given = {}
  for item in args.src:
    name, sep, path = item.partition("=")
    if not sep or name not in SUITES:
      parser.error(f"--src expects NAME=PATH with NAME one of "
                   f"{sorted(SUITES)}, got {item!r}")
    given[name] = path
  workdir = pathlib.Path(args.workdir).resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  modes = MODES if args.mode == "both" else (args.mode,)
  names = args.suite or list(SUITES)

  summary: dict = {}
  for name in names:
    suite = SUITES[name]
    version = _version(suite.dist)
    entry = summary[name] = {"version": version, "runs": {}}
    if version is None:
      entry["not_run"] = f"{suite.dist} is not installed"
      print(f"[{name}] not run: {entry['not_run']}", flush=True)
      continue
    try:
      tree, why = _source(suite, given, workdir)
    except (subprocess.CalledProcessError, OSError, ValueError) as err:
      tree, why = None, f"could not get the source distribution: {err}"
    if tree is None:
      entry["not_run"] = why
      print(f"[{name}] not run: {why}", flush=True)
      continue
    if why:
      entry["missing"] = why
      print(f"[{name}] {why}", flush=True)
    cwd, files = _workspace(suite, tree, workdir)
    for mode in MODES:
      xml = workdir / f"{name}-{mode}.xml"
      if mode not in modes or (args.reuse and xml.is_file()):
        if xml.is_file():   # an earlier run's results
          took, rc = None, None
        else:
          continue
      else:
        xml, took, rc = _run_pytest(suite, mode, cwd, files, workdir,
                                    args.workers, args.pytest_args)
      results = _outcomes(xml)
      entry["runs"][mode] = {"seconds": took and round(took), "exit": rc,
                             "counts": _counts(
                                 workdir / f"{name}-{mode}.log"),
                             "tests": {k: list(v) for k, v in results.items()}}
      if not results:
        entry["not_run"] = (f"pytest wrote no results ({mode}, exit {rc}); "
                            f"see {workdir / (name + '-' + mode + '.log')}")
  (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
  return _report(summary, workdir)


def _report(summary: dict, workdir: pathlib.Path) -> int:
  status = 0
  print()
  header = f"{'suite':<10} {'version':<9}"
  for mode in MODES:
    header += f" | {mode + ': pass fail err skip   s':<34}"
  print(header + " | pass->fail")
  regressions = {}
  for name, entry in summary.items():
    row = f"{name:<10} {entry['version'] or '-':<9}"
    if "not_run" in entry:
      print(f"{row} | not run: {entry['not_run']}")
      if entry["version"] and SUITES[name].sdist_has_tests:
        status = max(status, 2)
      continue
    runs = entry["runs"]
    for mode in MODES:
      c = runs.get(mode, {}).get("counts")
      cells = (f"{c['passed']:>5} {c['failed']:>4} {c['error']:>3} "
               f"{c['skipped']:>4} {c.get('seconds') or '?':>5}") if c else "-"
      row += f" | {cells:<34}"
    if len(runs) == 2:
      plain = runs["plain"]["tests"]
      replaced = runs["replaced"]["tests"]
      lost = sorted(t for t, (o, _) in plain.items() if o == "passed"
                    and replaced.get(t, ("missing", ""))[0] != "passed")
      regressions[name] = [(t, *replaced.get(t, ("missing", "not run")))
                           for t in lost]
      row += f" | {len(lost)}"
    print(row)
    if "missing" in entry:
      print(f"{'':<20} | {entry['missing']}")
  for name, lost in regressions.items():
    if not lost:
      continue
    status = max(status, 1)
    print(f"\n{name}: {len(lost)} pass plain, fail with jax.jit replaced:")
    for test_id, outcome, message in lost:
      print(f"  {test_id} [{outcome}]\n      {message}")
  print(f"\n(summary: {workdir / 'summary.json'})")
  return status


if __name__ == "__main__":
  sys.exit(main())

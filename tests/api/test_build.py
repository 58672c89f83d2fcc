"""The build (``setup.py``): the FFI host entry is compiled against jaxlib's
XLA FFI header, and a machine without a C compiler fails to install with
one clear message (README, "Set up").
"""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_build_needs_jaxlib_for_its_ffi_header():
  text = (ROOT / "pyproject.toml").read_text()
  assert '"jaxlib>=0.8.3"' in text.split("[build-system]")[1]


def test_a_build_without_a_c_compiler_fails_saying_so(tmp_path):
  pytest.importorskip("setuptools")
  shutil.copy(ROOT / "setup.py", tmp_path)
  (tmp_path / "jax_effects" / "_primitives").mkdir(parents=True)
  shutil.copy(ROOT / "jax_effects" / "_primitives" / "_trampoline.c",
              tmp_path / "jax_effects" / "_primitives")
  proc = subprocess.run(
      [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path,
      capture_output=True, text=True, timeout=300,
      env={"PATH": "/usr/bin:/bin", "CC": "false", "LDSHARED": "false"})
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(
      "jax_effects needs a C compiler and Python's headers to build its XLA "
      "FFI host entry (jax_effects/_primitives/_trampoline.c"), proc.stderr
  assert not list(tmp_path.rglob("_trampoline*.so"))

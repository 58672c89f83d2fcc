"""The configuration the package was built in (``setup.py``'s optional
extensions), as each tox line expects it.

``tox.ini`` sets ``JAX_EFFECTS_EXPECT_BUILD``: ``compiled`` (a C compiler
built every extension) or ``none`` (the ``-nocompiler`` line, built as a
machine without one builds it). The suite then runs in that configuration,
so both configurations a user can get run the whole suite.
"""
import ast
import importlib.util
import os
import pathlib

import pytest

from jax_effects._primitives import ffi_abi

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPECTED = os.environ.get("JAX_EFFECTS_EXPECT_BUILD")


def _extensions() -> list[str]:
  """The module names of setup.py's ``Extension(...)`` entries."""
  tree = ast.parse((ROOT / "setup.py").read_text())
  return [node.args[0].value for node in ast.walk(tree)
          if isinstance(node, ast.Call) and getattr(node.func, "id", "")
          == "Extension"]


def test_setup_declares_the_compiled_ffi_entry():
  assert "jax_effects._primitives._trampoline" in _extensions()


@pytest.mark.skipif(EXPECTED is None, reason="JAX_EFFECTS_EXPECT_BUILD unset "
                    "(set by tox.ini)")
def test_the_build_is_the_one_this_line_expects():
  built = {name: importlib.util.find_spec(name) is not None
           for name in _extensions()}
  if EXPECTED == "none":
    assert not any(built.values()), built
    assert ffi_abi.ENTRY == "ctypes"
  else:
    assert EXPECTED == "compiled", EXPECTED
    assert all(built.values()), built
    if os.environ.get("JAX_EFFECTS_FFI_ENTRY") != "ctypes":
      assert ffi_abi.ENTRY == "compiled"


def _factor_lines(value: str, env: str) -> list[str]:
  """The values of a tox factor-conditional setting (``a,b: value`` lines)
  that apply to ``env`` (its factors split at ``-``)."""
  factors = set(env.split("-"))
  out = []
  for line in value.strip().splitlines():
    condition, sep, rest = line.partition(":")
    if not sep:
      out.append(line.strip())
    elif any(f.strip() in factors for f in condition.split(",")):
      out.append(rest.strip())
  return out


def test_a_named_wheel_build_env_builds_for_its_line_s_python():
  # tox names each line's build env after its Python (.pkg-cpython311); one
  # named in wheel_build_env takes tox's own Python unless it sets
  # base_python, so a tox run from a Python 3.13 venv built jax09-nocompiler's
  # wheel for 3.13 (issue 49).
  import configparser
  tox = configparser.ConfigParser(interpolation=None)
  tox.read(ROOT / "tox.ini")
  base = tox["testenv"]
  envs = [e.strip() for e in tox["tox"]["envlist"].split(",")]
  named = {e: _factor_lines(base["wheel_build_env"], e) for e in envs}
  checked = 0
  for env, packages in named.items():
    for package in packages:
      (python,) = _factor_lines(base["base_python"], env)
      section = tox[f"testenv:{package}"]
      assert section.get("base_python", "").strip() == python, (env, package)
      checked += 1
  assert checked, named

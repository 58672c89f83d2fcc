"""The package is typed: ``py.typed`` ships, and ``mypy --strict`` finds no
error in a user's module using every public name (``tests/api/typed_usage.py``;
README, "Types").

mypy is in the ``test`` extra (tox has it); the check is skipped only where
it cannot be imported.
"""
import importlib.resources
import pathlib

import pytest

import jax_effects as je

from helpers import run_python

USER_FILE = pathlib.Path(__file__).with_name("typed_usage.py")


def test_py_typed_marker_ships():
  assert importlib.resources.files("jax_effects").joinpath("py.typed").is_file()


def test_user_file_uses_every_public_name():
  text = USER_FILE.read_text()
  missing = [n for n in je.__all__ if f"je.{n}" not in text]
  assert not missing, f"tests/api/typed_usage.py does not use {missing}"


def test_mypy_strict_finds_no_error_in_a_user_file(tmp_path):
  pytest.importorskip("mypy", reason="mypy is not installed (test extra)")
  env = {}
  package_parent = pathlib.Path(je.__file__).resolve().parent.parent
  if package_parent.name not in ("site-packages", "dist-packages"):
    # A source checkout (editable install): mypy cannot follow the
    # installer's import hook, so it is told where the package is.
    env["MYPYPATH"] = str(package_parent)
  result = run_python(
      "-m", "mypy", "--strict",
      # errors inside jax and jax_effects are theirs: only the user's count
      "--follow-imports=silent",
      "--cache-dir", str(tmp_path / "mypy_cache"), str(USER_FILE),
      cwd=tmp_path, env=env, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "Success: no issues found in 1 source file" in result.stdout

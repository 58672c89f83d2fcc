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

"""The optional compiled part (metadata: setup.cfg).

``jax_effects/_primitives/_trampoline.c`` (the FFI host target's entry) is
built where a C compiler and Python's headers exist; where they do not, its
build fails, setuptools warns and the package installs without it
(``optional``): the host target then enters through ctypes
(``ffi_abi.ENTRY``). pip hides setuptools' warning, so importing the
package warns instead (``jax_effects/_tools/compiled.py``).
"""
import os

from setuptools import Extension, setup

# A build folder of its own where asked (tox's -nocompiler line): a wheel
# built from the same tree after another takes that one's compiled files
# from the shared build/ folder, compiler or not.
_BUILD_BASE = os.environ.get("JAX_EFFECTS_BUILD_BASE")

setup(options={"build": {"build_base": _BUILD_BASE}} if _BUILD_BASE else {},
      ext_modules=[
    Extension("jax_effects._primitives._trampoline",
              ["jax_effects/_primitives/_trampoline.c"], optional=True),
])

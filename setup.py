"""The optional compiled part (metadata: setup.cfg).

``jax_effects/_primitives/_trampoline.c`` (the FFI host target's entry) is
built where a C compiler and Python's headers exist; where they do not, its
build fails, setuptools warns and the package installs without it
(``optional``): the host target then enters through ctypes
(``ffi_abi.ENTRY``). pip hides setuptools' warning, so importing the
package warns instead (``jax_effects/_tools/compiled.py``).
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("jax_effects._primitives._trampoline",
              ["jax_effects/_primitives/_trampoline.c"], optional=True),
])

"""The optional compiled parts (metadata: setup.cfg).

``jax_effects/_primitives/_trampoline.c`` (the FFI host target's entry) and
``jax_effects/_dispatch/_fast_call.c`` (the dispatch hook's common case) are
built where a C compiler and Python's headers exist; where they do not, the
build of an extension fails, setuptools warns and the package installs
without it (``optional``): the host target then enters through ctypes
(``ffi_abi.ENTRY``), and the hook is Python's (``call_path.HOOK``).
pip hides setuptools' warning, so importing the package warns instead
(``jax_effects/_tools/compiled.py``).
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("jax_effects._primitives._trampoline",
              ["jax_effects/_primitives/_trampoline.c"], optional=True),
    Extension("jax_effects._dispatch._fast_call",
              ["jax_effects/_dispatch/_fast_call.c"], optional=True),
])

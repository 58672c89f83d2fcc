"""The optional compiled entry of the FFI host target (metadata: setup.cfg).

``jax_effects/_primitives/_trampoline.c`` is built where a C compiler and
Python's headers exist; where they do not, the build of the extension
fails, setuptools warns and the package installs without it (``optional``):
the host target then enters through ctypes (``ffi_abi.ENTRY``).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "jax_effects._primitives._trampoline",
    ["jax_effects/_primitives/_trampoline.c"],
    optional=True)])

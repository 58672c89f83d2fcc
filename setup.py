"""The compiled part (metadata: setup.cfg).

``jax_effects/_primitives/_trampoline.c``, the FFI host target's entry, is
compiled against XLA's FFI header of the jaxlib in the build environment
(``jaxlib/include``, ``jax.ffi.include_dir()``; pyproject.toml requires
jaxlib to build). It is not optional: without a C compiler the install
fails, saying so (``design/host_target.md``).
"""
import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_NEEDS = ("jax_effects needs a C compiler and Python's headers to build its "
          "XLA FFI host entry (jax_effects/_primitives/_trampoline.c, "
          "compiled against jaxlib's xla/ffi/api/c_api.h); install gcc or "
          "clang and the Python headers (e.g. apt install gcc python3-dev) "
          "and install again")


def _include_dir() -> str:
  """jaxlib's headers (what ``jax.ffi.include_dir()`` returns)."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit("jax_effects' build needs jaxlib (for its XLA FFI "
                     "header): pip install jaxlib>=0.8.3")
  return os.path.join(list(spec.submodule_search_locations)[0], "include")


class _BuildExt(build_ext):
  def build_extension(self, ext):
    try:
      super().build_extension(ext)
    except Exception as err:  # noqa: BLE001 - CompileError, a missing cc
      raise SystemExit(f"{_NEEDS} ({type(err).__name__}: {err})") from err


setup(cmdclass={"build_ext": _BuildExt}, ext_modules=[
    Extension("jax_effects._primitives._trampoline",
              ["jax_effects/_primitives/_trampoline.c"],
              include_dirs=[_include_dir()]),
])

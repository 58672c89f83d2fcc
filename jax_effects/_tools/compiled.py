"""Whether the optional compiled parts were built, and the warning when not.

``pip install .`` builds an optional C extension where a C compiler and
Python's headers exist (``setup.py``): the host target's entry
(``_primitives/_trampoline.c``). Where the build fails, setuptools' warning
is hidden by pip and the package installs without it, working, slower. So
importing ``jax_effects`` warns once (:class:`CompiledPartsWarning`, a
``RuntimeWarning``) naming what is missing and what it costs. A part
turned off on purpose (``JAX_EFFECTS_FFI_ENTRY=ctypes``: the tests run
both entries) is not missing. To
silence it, before the import:
``warnings.filterwarnings("ignore", message="jax_effects was installed without")``
(or ``python -W "ignore:jax_effects was installed without"``).

A checkout's source tree imported in its own folder after ``pip install .``
(the README's first command: ``python -m`` puts the working folder first
on ``sys.path``) has no compiled parts, but the installed copy has them:
such a part is then taken from the installed distribution where it was
built from the same C source as the imported tree's
(``_primitives/installed.installed_copy``),
and nothing is missing. Built from another source (an edited checkout), it
is not used, and the warning stands.
"""
from __future__ import annotations

import os
import warnings

#: (module, what it is, what its absence costs, the variable that turns it
#: off on purpose).
PARTS = (
    ("jax_effects._primitives._trampoline", "the host target's compiled entry",
     "about 1 us more per host call (XLA enters through ctypes)",
     "JAX_EFFECTS_FFI_ENTRY", "ctypes"),
)


class CompiledPartsWarning(RuntimeWarning):
  """``jax_effects`` was installed without (some of) its compiled parts."""


def missing() -> list[tuple[str, str, str]]:
  """``(module, what, cost)`` of each part not built (not counting one
  turned off by its environment variable)."""
  from jax_effects._primitives import ffi_abi
  loaded = {"jax_effects._primitives._trampoline": ffi_abi._TRAMPOLINE}
  out = []
  for module, what, cost, variable, off in PARTS:
    if loaded[module] is None and os.environ.get(variable, "") != off:
      out.append((module, what, cost))
  return out


def describe() -> str:
  """One line for the demo's and bench's headers."""
  gone = missing()
  if not gone:
    return "compiled parts: built"
  return "compiled parts missing: " + ", ".join(m for m, _, _ in gone)


def warn_if_missing() -> None:
  """At import: warns once if a compiled part was not built."""
  gone = missing()
  if not gone:
    return
  parts = "; ".join(f"{what} ({module}): {cost}" for module, what, cost in gone)
  warnings.warn(
      f"jax_effects was installed without its compiled parts ({parts}). It "
      f"works the same, slower. Install a C compiler and Python's headers "
      f"(e.g. apt install gcc python3-dev) and reinstall "
      f"(pip install --force-reinstall --no-deps jax_effects, or "
      f"pip install -e . in a checkout) to build them",
      CompiledPartsWarning, stacklevel=3)

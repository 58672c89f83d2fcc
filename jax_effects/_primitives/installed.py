"""A compiled part of the installed ``jax_effects``, for a source tree
imported in its own folder (the README's first command, run in the
checkout after ``pip install .``: ``python -m`` puts the working folder
first on ``sys.path``, and a clean tree has no compiled parts). No part in
the token calling convention.
"""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import sys


def installed_copy(module: str):
  """Compiled ``module`` (``"jax_effects._primitives._trampoline"``) of the
  installed ``jax_effects`` distribution, loaded as ``module``, where the
  imported ``jax_effects`` is another copy (a source tree) that lacks it and
  the distribution holds the C source it was built from, byte for byte the
  imported tree's; else None."""
  parent, _, leaf = module.rpartition(".")
  package = sys.modules.get(parent)
  here = pathlib.Path(getattr(package, "__file__", None) or ".").parent
  try:
    source = (here / f"{leaf}.c").read_bytes()
  except OSError:   # (no C source beside the module: nothing to compare)
    return None
  stem = module.replace(".", "/")
  for dist in importlib.metadata.distributions(name="jax_effects"):
    try:
      files = {str(f): f for f in dist.files or ()}
      if f"{stem}.c" not in files:
        continue
      built = next((files[stem + suffix] for suffix
                    in importlib.machinery.EXTENSION_SUFFIXES
                    if stem + suffix in files), None)
      if built is None:
        continue
      path = pathlib.Path(dist.locate_file(built))
      if (path.parent.resolve() == here.resolve()
          or pathlib.Path(dist.locate_file(files[f"{stem}.c"])).read_bytes()
          != source):
        continue
      spec = importlib.util.spec_from_file_location(
          module, path,
          loader=importlib.machinery.ExtensionFileLoader(module, str(path)))
      loaded = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(loaded)
    except (OSError, ImportError, ValueError):
      continue
    sys.modules[module] = loaded
    if package is not None:
      setattr(package, leaf, loaded)
    return loaded
  return None

"""The compiled FFI entry is not optional (``setup.py``, README "Set up"):
a copy of ``jax_effects`` without it fails at import with one clear error
naming it and how to build it; a checkout's source tree imported after
``pip install .`` takes the installed entry where it was built from the
same C source (``_primitives/host_target.py``), and fails the same way where
it was not.

Fresh processes whose import system refuses the entry's module, as a copy
where it was never built has none.
"""
import importlib.util
import textwrap

from helpers import run_python

_TRAMPOLINE = "jax_effects._primitives._trampoline"


def _without(blocked, body):
  """Runs ``body`` in a fresh process where ``blocked`` modules are not
  importable (as if never built) and no installed distribution of
  ``jax_effects`` is found."""
  code = textwrap.dedent(f"""
      import sys
      BLOCKED = {sorted(blocked)!r}
      class NotBuilt:
        def find_spec(self, name, path=None, target=None):
          if name in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
          return None
      sys.meta_path.insert(0, NotBuilt())
      # (nor installed anywhere: a checkout run as `python -m pytest` after
      # `pip install .` would take the installed copy's entry)
      import importlib.metadata
      importlib.metadata.distributions = lambda **kwargs: iter(())
      """) + textwrap.dedent(body)
  return run_python("-c", code, timeout=300)


_NOT_BUILT = "jax_effects' compiled FFI host entry (jax_effects/_primitives/" \
    "_trampoline.c) is not built"


def test_import_without_the_entry_fails_naming_it_and_the_fix():
  proc = _without({_TRAMPOLINE}, "import jax_effects")
  assert proc.returncode == 1
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"ImportError: {_NOT_BUILT}"), proc.stderr[-3000:]
  assert "pip install ." in last and "build_ext --inplace" in last
  assert "C compiler" in last


# --- a checkout's source tree imported after `pip install .` -----------------
# (the README's first command, `pip install . && python -m jax_effects demo`,
# run in the checkout: `-m` puts the checkout first on sys.path, so the
# source tree, which has no compiled part, is imported, not the installed
# copy, which has it.)

def _checkout_and_install(tmp_path, edit_source=False):
  """A source tree without compiled parts (``checkout``) and, in ``site``,
  an installed distribution of the same package holding them (as
  ``pip install .`` leaves it: the entry and its C source, listed in
  RECORD)."""
  import pathlib
  import shutil
  import jax_effects
  package = pathlib.Path(jax_effects.__file__).parent
  checkout = tmp_path / "checkout"
  shutil.copytree(package, checkout / "jax_effects",
                  ignore=shutil.ignore_patterns("*.so", "*.pyd",
                                                "__pycache__"))
  source = checkout / "jax_effects" / "_primitives" / "_trampoline.c"
  if edit_source:
    source.write_text(source.read_text() + "\n/* edited */\n")
  built = pathlib.Path(importlib.util.find_spec(_TRAMPOLINE).origin)
  site = tmp_path / "site"
  (site / "jax_effects" / "_primitives").mkdir(parents=True)
  installed = [f"jax_effects/_primitives/{built.name}",
               "jax_effects/_primitives/_trampoline.c"]
  shutil.copy(built, site / installed[0])
  shutil.copy(package / "_primitives" / "_trampoline.c", site / installed[1])
  info = site / "jax_effects-0.1.0.dist-info"
  info.mkdir()
  (info / "METADATA").write_text(
      "Metadata-Version: 2.1\nName: jax_effects\nVersion: 0.1.0\n")
  (info / "RECORD").write_text("".join(
      f"{name},,\n" for name in installed + [
          "jax_effects-0.1.0.dist-info/METADATA",
          "jax_effects-0.1.0.dist-info/RECORD"]))
  return checkout, site


def _run_in(checkout, site):
  """Runs :data:`_CHECKOUT` as a script in ``checkout`` (first on sys.path,
  as ``python -m`` run there puts it), ``site`` on PYTHONPATH."""
  script = checkout / "main.py"
  script.write_text(_CHECKOUT)
  return run_python(script, cwd=checkout, env={"PYTHONPATH": str(site)})


_CHECKOUT = """
import os
import jax_effects as je
from jax_effects._primitives import host_target as host_sites
print(os.path.relpath(je.__file__), os.path.relpath(host_sites.ENTRY.__file__))
f = je.jit(lambda x: (je.print("x={}", x), x + 1)[1])
f(1); f(2)
je.effects_barrier()
"""


def test_a_checkout_imported_after_pip_install_takes_the_installed_entry(
    tmp_path):
  checkout, site = _checkout_and_install(tmp_path)
  proc = _run_in(checkout, site)
  assert proc.returncode == 0, proc.stderr[-3000:]
  here, entry = proc.stdout.splitlines()[0].split()
  assert here == "jax_effects/__init__.py"
  assert entry.startswith("../site/jax_effects/_primitives/_trampoline.")
  assert proc.stdout.splitlines()[1:] == ["x=1", "x=2"], proc.stdout


def test_a_checkout_whose_c_source_differs_from_the_installed_one_fails(
    tmp_path):
  # (an entry built from another source may describe sites otherwise)
  checkout, site = _checkout_and_install(tmp_path, edit_source=True)
  proc = _run_in(checkout, site)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith(
      f"ImportError: {_NOT_BUILT}"), proc.stderr[-3000:]

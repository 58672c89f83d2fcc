"""An install without a C compiler says so (``jax_effects/_tools/compiled.py``,
README "Set up"): importing ``jax_effects`` warns once, naming each missing
compiled part and its cost; a part turned off on purpose is not missing; the
warning can be silenced before the import; the demo's header names them.

Fresh processes whose import system refuses the extensions' modules, as an
install where their build failed has none.
"""
import importlib.util
import textwrap

import pytest

from helpers import run_python

_TRAMPOLINE = "jax_effects._primitives._trampoline"
#: Whether this install has the compiled entry (not in tox's -nocompiler
#: line, tests/api/test_build.py).
_BUILT = importlib.util.find_spec(_TRAMPOLINE) is not None


def _without(blocked, body, env=None):
  """Runs ``body`` in a fresh process where ``blocked`` modules are not
  importable (as if never built)."""
  code = textwrap.dedent(f"""
      import sys, warnings
      BLOCKED = {sorted(blocked)!r}
      class NotBuilt:
        def find_spec(self, name, path=None, target=None):
          if name in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
          return None
      sys.meta_path.insert(0, NotBuilt())
      """) + textwrap.dedent(body)
  # (the entry not forced to ctypes, as tox's -nocompiler line does)
  env = {"JAX_EFFECTS_FFI_ENTRY": None} if env is None else env
  return run_python("-c", code, env=env, timeout=300)


_IMPORT = """
with warnings.catch_warnings(record=True) as got:
  warnings.simplefilter("always")
  import jax_effects
mine = [w for w in got if "compiled parts" in str(w.message)]
print(len(mine))
for w in mine:
  print(w.category.__name__, w.category.__mro__[1].__name__)
  print(w.message)
"""


def test_import_without_compiled_parts_warns_once_naming_them():
  proc = _without({_TRAMPOLINE}, _IMPORT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines[0] == "1", proc.stdout
  assert lines[1] == "CompiledPartsWarning RuntimeWarning"
  msg = lines[2]
  assert msg.startswith("jax_effects was installed without its compiled parts")
  assert _TRAMPOLINE in msg
  assert "about 1 us more per host call" in msg
  assert "C compiler" in msg and "reinstall" in msg


@pytest.mark.skipif(not _BUILT, reason="this install has no compiled part")
def test_built_or_turned_off_on_purpose_is_no_warning():
  proc = _without(set(), _IMPORT)
  assert proc.returncode == 0 and proc.stdout.split()[0] == "0", (
      proc.stdout, proc.stderr[-2000:])
  proc = _without({_TRAMPOLINE}, _IMPORT,
                  env={"JAX_EFFECTS_FFI_ENTRY": "ctypes"})
  assert proc.returncode == 0 and proc.stdout.split()[0] == "0", (
      proc.stdout, proc.stderr[-2000:])


def test_warning_is_silenced_by_its_message_before_the_import_and_works():
  proc = _without({_TRAMPOLINE}, """
      warnings.simplefilter("error")
      warnings.filterwarnings("ignore", message="jax_effects was installed without")
      import jax, jax.numpy as jnp, jax_effects as je
      from jax_effects._primitives import ffi_abi
      print(ffi_abi.ENTRY)
      f = je.jit(lambda x: (je.print("x={}", x), x + 1)[1])
      f(jnp.int32(1)); f(jnp.int32(2))
      je.effects_barrier()
      """)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["ctypes", "x=1", "x=2"]
  assert "compiled parts" not in proc.stderr


def test_default_filters_show_it_once_on_stderr_and_demo_names_them():
  proc = _without({_TRAMPOLINE}, """
      import jax_effects
      import jax_effects   # (imported once: warned once)
      from jax_effects._tools import compiled
      print(compiled.describe())
      """)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stderr.count("CompiledPartsWarning") == 1, proc.stderr[-3000:]
  assert proc.stdout.strip() == f"compiled parts missing: {_TRAMPOLINE}"
  if not _BUILT:
    return
  built = run_python("-m", "jax_effects", "demo", "--sections", "callback",
                     "--devices", "1")
  assert built.returncode == 0, built.stderr[-3000:]
  assert "compiled parts: built" in built.stdout.splitlines()[0]


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
  return run_python(script, cwd=checkout,
                    env={"JAX_EFFECTS_FFI_ENTRY": None,
                         "PYTHONPATH": str(site)})


_CHECKOUT = """
import os, sys, warnings
with warnings.catch_warnings(record=True) as got:
  warnings.simplefilter("always")
  import jax_effects as je
print(len([w for w in got if "compiled parts" in str(w.message)]))
from jax_effects._primitives import ffi_abi
from jax_effects._tools import compiled
print(os.path.relpath(je.__file__), ffi_abi.ENTRY, compiled.describe())
f = je.jit(lambda x: (je.print("x={}", x), x + 1)[1])
f(1); f(2)
je.effects_barrier()
"""


@pytest.mark.skipif(not _BUILT, reason="this install has no compiled part")
def test_a_checkout_imported_after_pip_install_takes_the_installed_entry(
    tmp_path):
  checkout, site = _checkout_and_install(tmp_path)
  proc = _run_in(checkout, site)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "CompiledPartsWarning" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stdout.splitlines() == [
      "0", "jax_effects/__init__.py compiled compiled parts: built",
      "x=1", "x=2"], (proc.stdout, proc.stderr[-2000:])


@pytest.mark.skipif(not _BUILT, reason="this install has no compiled part")
def test_a_checkout_whose_c_source_differs_from_the_installed_one_warns(
    tmp_path):
  # (an entry built from another source may read another layout: not used)
  checkout, site = _checkout_and_install(tmp_path, edit_source=True)
  proc = _run_in(checkout, site)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines[0] == "1", (proc.stdout, proc.stderr[-2000:])
  assert lines[1] == ("jax_effects/__init__.py ctypes compiled parts "
                      f"missing: {_TRAMPOLINE}")
  assert lines[2:] == ["x=1", "x=2"]

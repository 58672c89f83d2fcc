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

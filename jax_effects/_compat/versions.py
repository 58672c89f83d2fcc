"""The installed JAX: its version, the tested lines, what a line lacks.

Part in the token calling convention: none (``jax_effects._compat``).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import threading

import jax
import jaxlib

# (major, minor, patch) of the installed JAX; compared only in this module.
JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def jax_caches_host_callbacks() -> bool:
  """Whether JAX's persistent cache keeps executables with host callbacks:
  from JAX 0.12 (``compiler._cache_write`` refused them before)."""
  return JAX_VERSION >= (0, 12)


#: The JAX releases this release of jax_effects is tested on: the newest
#: patch of each supported line (``tox.ini``, ``design/versions.md``).
TESTED = ("0.8.3", "0.9.2", "0.10.2", "0.11.2", "0.12.0.1")


def _own_version() -> str:
  try:
    return importlib.metadata.version("jax_effects")
  except importlib.metadata.PackageNotFoundError:   # (a source tree)
    return "(source tree)"


def unsupported_jax(err: BaseException) -> ImportError:
  """The error ``import jax_effects`` raises when a JAX internal every
  feature needs is missing, or there with another shape
  (``design/versions.md``)."""
  return ImportError(
      f"jax_effects {_own_version()} cannot run with the installed JAX "
      f"{jax.__version__} (jaxlib {jaxlib.__version__}): a JAX internal it "
      f"needs is missing or has changed ({type(err).__name__}: {err}). "
      f"jax_effects is tested with JAX {', '.join(TESTED)}. Fix: install a "
      f"tested JAX "
      f"(e.g. pip install 'jax=={TESTED[-1]}' 'jaxlib=={TESTED[-1]}'), or a "
      f"jax_effects release that supports JAX {jax.__version__}.")


#: Feature -> the missing JAX internal it needs (an ``optional`` import).
MISSING: dict[str, str] = {}


def optional(feature: str, load):
  """``load()`` (an import of JAX internals only ``feature`` needs), or
  None when they are missing (recorded in :data:`MISSING`)."""
  try:
    return load()
  except (ImportError, AttributeError) as err:
    MISSING[feature] = f"{type(err).__name__}: {err}"
    return None


# --- features that not every supported JAX line has --------------------------

class UnsupportedFeature(NotImplementedError):
  """A jax_effects feature the installed JAX version cannot support; the
  message names the feature, the installed JAX, what supports it, a fix."""


# name -> (is it unavailable now?, why and the fix): one entry per limit of a
# supported line (``design/versions.md``); the tests skip with the same text
# (marker ``jax_feature``).
FEATURES = {
    # (0.8/0.9's legacy xla_pmap primitive refuses ordered effects;
    # jax_pmap_shmap_merge: an option of JAX 0.8 and 0.9 only, default True:
    # pmap staged as jit(shard_map); JAX 0.10 removed it, always so)
    "effects in jax.pmap": (
        lambda: not getattr(jax.config, "jax_pmap_shmap_merge", True),
        "side effects inside jax.pmap need jax.pmap staged as shard_map: "
        "jax_pmap_shmap_merge=False (an option of JAX 0.8 and 0.9) is set. "
        "Fix: jax.config.update('jax_pmap_shmap_merge', True) (the default), "
        "or upgrade to JAX >= 0.10, where pmap is always staged so"),
    # ("'TypedNdArray' object has no attribute 'sharding'")
    "simplified jaxpr constants": (
        lambda: JAX_VERSION < (0, 10),
        "JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS=1 with closed-over NumPy "
        "constants needs JAX >= 0.10 (JAX 0.8 and 0.9 fail to lower them, "
        "under plain jax.jit too). Fix: upgrade to JAX >= 0.10, or close "
        "over jax.Arrays (jnp.asarray) instead of NumPy arrays"),
    # (a packed buffer read as unpacked: [1, 2, -3] arrives as [1, 2, 7])
    "4-bit integer operands": (
        lambda: JAX_VERSION < (0, 10),
        "int4/uint4 arrays passed to a host callback need JAX >= 0.10 (JAX "
        "0.8 and 0.9 hand them to the host with wrong values, in "
        "jax.debug.print and io_callback too). Fix: upgrade to JAX >= 0.10, "
        "or pass x.astype(jnp.int8)"),
}


# JAX 0.8 can crash (SIGSEGV in ``pxla.MeshExecutable.from_hlo``) when two
# threads compile the same new computation at once.
_NO_GUARD = contextlib.nullcontext()


def first_call_guard():
  """A new context for one jax_effects.jit function's first calls: a lock
  on JAX 0.8 (one per function, ``design/versions.md``), else nothing."""
  return threading.RLock() if JAX_VERSION < (0, 9) else _NO_GUARD


def has_4bit_integers(avals) -> bool:
  """Whether any of ``avals`` (or values with ``.dtype``) is int4/uint4."""
  import jax.numpy as jnp
  return any(getattr(a, "dtype", None) in (jnp.int4, jnp.uint4) for a in avals)


def unsupported_reason(feature: str) -> str | None:
  """Why ``feature`` (a key of ``FEATURES``, or one whose internals are
  :data:`MISSING`) is unavailable now, or None."""
  if feature in MISSING:
    return (f"{feature} needs a JAX internal that JAX {jax.__version__} "
            f"lacks ({MISSING[feature]}); jax_effects is tested with JAX "
            f"{', '.join(TESTED)}. Fix: install a tested JAX, or a "
            f"jax_effects release that supports JAX {jax.__version__}")
  if feature not in FEATURES:
    return None
  unavailable, reason = FEATURES[feature]
  return f"{reason} (installed: JAX {jax.__version__})" if unavailable() else None


def require(feature: str, call: str = "jax_effects") -> None:
  """Raises :class:`UnsupportedFeature`, prefixed with ``call``, when
  ``feature`` is unavailable."""
  reason = unsupported_reason(feature)
  if reason is not None:
    raise UnsupportedFeature(f"{call}: {reason}")

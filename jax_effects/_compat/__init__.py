"""JAX internals and JAX version differences: the only package that knows them.

No other module imports ``jax._src`` or compares JAX versions. Each
``jax._src`` import says why and which JAX lines it serves; each shim, which
difference between the supported lines (0.8 to 0.12, ``versions.TESTED``) it
hides. A feature a line cannot support raises ``UnsupportedFeature``
(``versions.require``). One module a topic; see ``design/versions.md``.

Part in the token calling convention: none of its own; it hands the other
layers the JAX pieces the convention is built from, the same on every line.
"""
from jax_effects._compat.versions import *  # noqa: F401,F403
from jax_effects._compat import versions as _versions

try:
  from jax_effects._compat.jaxprs import *  # noqa: F401,F403
  from jax_effects._compat.lowering import *  # noqa: F401,F403
  from jax_effects._compat.callbacks import *  # noqa: F401,F403
  from jax_effects._compat.runtime import *  # noqa: F401,F403
  from jax_effects._compat.export import *  # noqa: F401,F403
except (ImportError, AttributeError) as _err:
  raise _versions.unsupported_jax(_err) from _err

#: JAX primitive name -> the feature of ours that needs its internals: an
#: effect inside such a primitive, where they are missing, raises
#: ``UnsupportedFeature`` naming it (``_pass.token_pass.refusal``).
FEATURE_OF_PRIMITIVE = {"call_exported": EXPORTED_CALLS,  # noqa: F405
                        "compute_on": COMPUTE_ON,  # noqa: F405
                        "call_hi_primitive": HI_PRIMITIVES}  # noqa: F405

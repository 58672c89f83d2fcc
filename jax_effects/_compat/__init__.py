"""JAX internals and JAX version differences: the only package that knows them.

No other module imports ``jax._src`` or compares JAX versions. Supported:
the JAX range in ``setup.cfg`` (jax >= 0.8.3), tested on the newest patch
of each line from 0.8 to 0.12 (``versions.TESTED``; ``design/versions.md``).
Two kinds of names live here, one module a topic:

* JAX internals with no public route (``jax._src``), each with its reason and
  the versions it applies to; if a future JAX exposes a public route, replace
  the import here and nothing else changes.
* One named shim per difference between the supported JAX lines, each saying
  which versions need it. No other module compares JAX versions: they use
  these names, and a feature that a line cannot support raises
  :class:`UnsupportedFeature` (``require``) with the reason given by
  ``unsupported_reason``, which the tests also use to skip.

On a JAX line newer than the tested ones, an internal every feature needs
that is missing makes ``import jax_effects`` fail with one ``ImportError``
naming the installed JAX, the tested lines and the fix
(``versions.unsupported_jax``); one that only a feature needs is loaded with
``versions.optional``, and that feature alone raises ``UnsupportedFeature``.

Modules: ``versions`` (the installed JAX, the tested lines, the features a
line lacks), ``jaxprs`` (what the token pass reads and re-emits),
``lowering`` (MLIR and sharding helpers), ``callbacks`` (JAX's own
callbacks and functions), ``runtime`` (trace state, JAX's runtime tokens,
backends, transfer guards), ``export`` (``jax.export``'s call),
``tracebacks`` (filtering our frames as ``jax.jit`` filters its own).

Part in the token calling convention: none of its own; it hands the other
layers the JAX pieces the convention is built from (effect registries, JAX's
runtime tokens, lowering helpers), the same on every supported line.
"""
from jax_effects._compat.versions import *  # noqa: F401,F403
from jax_effects._compat import versions as _versions

try:
  from jax_effects._compat.jaxprs import *  # noqa: F401,F403
  from jax_effects._compat.lowering import *  # noqa: F401,F403
  from jax_effects._compat.callbacks import *  # noqa: F401,F403
  from jax_effects._compat.runtime import *  # noqa: F401,F403
  from jax_effects._compat.export import *  # noqa: F401,F403
  from jax_effects._compat.tracebacks import *  # noqa: F401,F403
except (ImportError, AttributeError) as _err:
  raise _versions.unsupported_jax(_err) from _err

#: JAX primitive name -> the feature of ours that needs its internals: an
#: effect inside such a primitive, where they are missing, raises
#: ``UnsupportedFeature`` naming it (``_pass.token_pass.refusal``).
FEATURE_OF_PRIMITIVE = {"call_exported": EXPORTED_CALLS,  # noqa: F405
                        "compute_on": COMPUTE_ON,  # noqa: F405
                        "call_hi_primitive": HI_PRIMITIVES}  # noqa: F405

"""jax_effects: side effects in compiled JAX code, in program order, fast.

Public API (everything else is private):

* :func:`jit` - drop-in for ``jax.jit`` that threads tokens through effects.
* :func:`print`, :func:`callback` - ordered side effects.
* :func:`log` - ``logging`` records from compiled code (with device, shard
  and process attribution); :class:`Placement`, :func:`placement` - where the
  running host callback is; :func:`deterministic` - per-device output of
  ``shard_map`` in a fixed order.
* :class:`Effect` - a named effect (its own runtime-token stream);
  :data:`DEFAULT` is the effect used when ``effect=None``.
* :func:`ordering`, :func:`set_ordering` - "per_effect" or "global" order.
* :func:`effects_barrier` - wait for dispatched effects.
* :func:`runtime_tokens` - a snapshot of the calling thread's tokens.

Layers (one module each): ``_effects`` (effects and modes) ->
``_primitives`` (side-effect primitives, lowering) -> ``_thread_tokens`` (the
compiler-token pass) -> ``_jit`` (dispatch hook) -> ``_runtime_tokens``
(runtime/output tokens, barrier, errors). See ``design/``.
"""
from jax_effects._callback import callback
from jax_effects._effects import DEFAULT, GLOBAL, Effect, get_ordering, ordering, set_ordering
from jax_effects._jit import jit
from jax_effects._logging import log
from jax_effects._placement import Placement, deterministic
from jax_effects._placement import current as placement
from jax_effects._printing import print  # noqa: A004
from jax_effects._runtime_tokens import RuntimeTokens, effects_barrier, runtime_tokens
from jax_effects import _transformation_rules  # noqa: F401  (registers vmap/jvp rules)
from jax_effects import _shard_map_rules  # noqa: F401  (registers the shard_map rule)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT", "GLOBAL", "Effect", "RuntimeTokens", "callback",
    "effects_barrier", "get_ordering", "jit", "ordering", "print",
    "runtime_tokens", "set_ordering",
    "Placement", "deterministic", "log", "placement",
]

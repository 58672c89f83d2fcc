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

Layers, each importing only from the ones above it (``design/architecture.md``):

1. effects and modes: ``_effects`` (``_compat`` fences JAX's internals;
   ``_jaxpr_eval`` is the jaxpr walk both interpreters share);
2. host-side runtime state, shared by host callbacks and dispatch:
   ``_placement`` (where a callback runs), ``_errors`` (callback errors),
   ``_output`` (sinks, deterministic view), ``_runtime_tokens`` (per-thread
   runtime and output tokens, the barrier);
3. primitives: ``_host`` (host functions, the primitives' parameter),
   ``_primitives`` (``effect_p``/``threaded_effect_p`` with all their rules)
   and ``_control_flow_batching`` (JAX's vmap rules of cond/while, wrapped);
4. the token-threading pass: ``_token_pass`` (+ ``_shard_map_rule``,
   ``_adopted``: JAX's own callbacks converted);
5. dispatch and switching: ``_jit``, ``_modes``;
6. front ends: ``_arguments``, ``_printing``, ``_logging``, ``_callback``,
   ``_adopted_host`` (the host side of JAX's own callbacks, registered with
   ``_adopted``);
7. tools (``_tools``: demo, bench, multi-process launcher, pytest plugin).
"""
from jax_effects._callback import callback
from jax_effects._effects import DEFAULT, GLOBAL, Effect, get_ordering
from jax_effects._jit import jit
from jax_effects._logging import log
from jax_effects._modes import deterministic, ordering, set_ordering
from jax_effects._placement import Placement
from jax_effects._placement import current as placement
from jax_effects._printing import print  # noqa: A004
from jax_effects._runtime_tokens import RuntimeTokens, effects_barrier, runtime_tokens
from jax_effects import _control_flow_batching  # noqa: F401  (vmap of cond/while)
from jax_effects import _shard_map_rule  # noqa: F401  (registers the shard_map rule)
from jax_effects import _adopted_host  # noqa: F401  (registers JAX's callbacks' host side)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT", "GLOBAL", "Effect", "RuntimeTokens", "callback",
    "effects_barrier", "get_ordering", "jit", "ordering", "print",
    "runtime_tokens", "set_ordering",
    "Placement", "deterministic", "log", "placement",
]

"""jax_effects: side effects in compiled JAX code, in program order, fast.

Public API (everything else is private):

* :func:`jit` - drop-in for ``jax.jit`` that threads tokens through effects.
* :func:`print`, :func:`callback` - ordered side effects;
  :func:`register_callback` - a host function under a stable name
  (:class:`NamedCallback`), for exported and cached computations;
  :data:`HOST_TARGET` - the custom call of every host call on CPU
  (``jax.export`` needs it allowed).
* :func:`log` - ``logging`` records from compiled code (with device, shard
  and process attribution); :class:`Placement`, :func:`placement` - where the
  running host callback is; :func:`deterministic` - per-device output of
  ``shard_map`` in a fixed order.
* :class:`Effect` - a named effect (its own runtime-token stream);
  :data:`DEFAULT` is the effect used when ``effect=None``.
* :func:`ordering`, :func:`set_ordering` - "per_effect" or "global" order.
* :func:`effects_barrier` - wait for dispatched effects.
* :func:`runtime_tokens` - a snapshot of the calling thread's tokens.
* :func:`progress` - progress bars for compiled loops.

The private folders are the layers, each importing only from the ones above
it (``design/architecture.md``): ``_core`` (effects, modes, jaxpr walking),
``_runtime`` (host-side state shared by callbacks and dispatch),
``_primitives``, ``_pass`` (token threading), ``_dispatch`` (the call path,
``jit``), ``_frontends`` (``print``/``log``/``callback``), ``_tools``.
``_compat`` alone imports ``jax._src``.
"""
import os as _os

from jax_effects import _compat
from jax_effects._core.effects import DEFAULT
from jax_effects._core.effects import Effect
from jax_effects._core.effects import get_ordering
from jax_effects._core.effects import GLOBAL
from jax_effects._dispatch.function import jit
from jax_effects._dispatch.modes import deterministic
from jax_effects._dispatch.modes import ordering
from jax_effects._dispatch.modes import set_ordering
from jax_effects._frontends import adopted_host as _ah  # noqa: F401  (registers)
from jax_effects._frontends.printing import batched
from jax_effects._frontends.callback import callback
from jax_effects._frontends.callback import NamedCallback
from jax_effects._frontends.callback import register_callback
from jax_effects._frontends.logging import log
from jax_effects._frontends.printing import print  # noqa: A004
from jax_effects._frontends.progress import progress
from jax_effects._pass import control_flow_rules as _cfr  # noqa: F401  (rules)
from jax_effects._primitives.host_target import TARGET as HOST_TARGET
from jax_effects._runtime import notebook as _notebook  # noqa: F401  (IPython: a cell's effects under it)
from jax_effects._runtime.barrier import effects_barrier
from jax_effects._runtime.placement import current as placement
from jax_effects._runtime.placement import Placement
from jax_effects._runtime.threads import runtime_tokens
from jax_effects._runtime.threads import RuntimeTokens

# As jax.jit's: a user error's filtered traceback shows no frame of ours.
_compat.exclude_from_tracebacks(_os.path.dirname(__file__))

__version__ = "0.1.0"

__all__ = [
    "DEFAULT", "GLOBAL", "Effect", "RuntimeTokens", "callback",
    "effects_barrier", "get_ordering", "jit", "ordering", "print",
    "runtime_tokens", "set_ordering",
    "Placement", "deterministic", "log", "placement", "progress",
    "NamedCallback", "register_callback", "HOST_TARGET", "batched",
]

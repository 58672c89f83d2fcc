"""The trace state, JAX's runtime tokens and backends, transfer guards.

For ``_dispatch`` and ``_runtime``. Part in the token calling convention:
JAX's runtime tokens are waited for beside ours (``jax_runtime_tokens``,
``on_jax_effects_barrier``).
"""
from __future__ import annotations

import contextlib
import operator

import jax

from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src.array import ArrayImpl as _ArrayImpl
from jax_effects._compat.callbacks import disable_jit_flag
from jax_effects._compat.versions import JAX_VERSION

# Whether JAX's backends have started (for the pytest plugin's device count
# and ``_runtime.fork``): no public query, ``jax.devices()`` would start
# them. JAX 0.8-0.12.
from jax._src import xla_bridge as _xla_bridge  # noqa: E402

backends_are_initialized = backend_started = (
    _xla_bridge.backends_are_initialized)


def clear_jax_runtime_tokens() -> None:
  """Forgets the tokens JAX keeps for ``jax.effects_barrier``, which would
  raise a reported callback error again at every later barrier."""
  _dispatch.runtime_tokens.clear()


def cpu_collectives_on_host(host: str) -> None:
  """Makes the CPU backend, when it starts, listen for its cross-process
  collectives (gloo over TCP) on ``host`` only (JAX has no option for it:
  its ``"cpu"`` factory is registered again, as ``xla_bridge`` does, with
  collectives bound to ``host``). Call after ``jax.distributed.initialize``
  and before the backend starts (``design/multihost.md``). JAX 0.8-0.12.
  """
  import functools
  from jax._src import distributed
  from jax._src.lib import _jax
  if backends_are_initialized():
    raise RuntimeError("jax_effects: the CPU collectives' address must be "
                       "set before JAX's backend starts")
  collectives = _jax.make_gloo_tcp_collectives(
      distributed_client=distributed.global_state.client, hostname=host)
  _xla_bridge.register_backend_factory(
      "cpu", functools.partial(_xla_bridge.make_cpu_client,
                               collectives=collectives),
      priority=0, fail_quietly=False)


_trace_ctx = _core.trace_ctx
_eval_trace = _core.eval_trace
_top_axis_env = _core.top_axis_env

# What ``trace_ctx.is_top_level()`` reads, without its two Python frames
# (on every dispatch): thread-local config states (``.value``) from JAX 0.10,
# attributes of the ``threading.local`` ``trace_ctx`` on 0.8/0.9.
if hasattr(_core, "trace_state_strong_ref"):   # JAX 0.10
  _trace_value = _core.trace_state_strong_ref
  _axis_env_value = _core.axis_env_state
else:   # JAX 0.8, 0.9: attributes of a threading.local, read as ``.value``
  class _TraceContextValue:
    __slots__ = ("_name",)

    def __init__(self, name: str):
      self._name = name

    @property
    def value(self):
      return getattr(_trace_ctx, self._name)

  _trace_value = _TraceContextValue("trace")
  _axis_env_value = _TraceContextValue("axis_env")

#: ``(trace, axis_env, eval_trace, top_axis_env)``, for a caller that
#: inlines :func:`at_top_level` (the dispatch fast path).
TOP_LEVEL = (_trace_value, _axis_env_value, _eval_trace, _top_axis_env)


def at_top_level() -> bool:
  """True when no JAX transformation or trace is active on this thread."""
  return (_trace_value.value is _eval_trace
          and _axis_env_value.value is _top_axis_env)


def compiled_dispatch() -> bool:
  """At the top level with ``jax.disable_jit`` off."""
  return at_top_level() and not disable_jit_flag.value


# ``jax.Array.committed`` without its Python property (on every dispatch).
committed = operator.attrgetter("_committed")


def uncommitted(array):
  """``array``'s first shard as an uncommitted single-device jax.Array (a
  runtime token that does not pin the next computation, ``design/tokens.md``).
  """
  shard = array._arrays[0]
  return _ArrayImpl(shard.aval, shard.sharding, [shard], committed=False,
                    _skip_checks=True)


def _staging_trace():
  """The innermost trace building a jaxpr, from the current one through
  ``parent_trace`` (past vmap/jvp traces), or None."""
  trace = _trace_ctx.trace
  while trace is not None:
    if getattr(trace, "frame", None) is not None:
      return trace
    trace = getattr(trace, "parent_trace", None)
  return None


def enclosing_staging() -> str | None:
  """What the innermost jaxpr being traced is for ("cond", "jit", ...), or
  None when no jaxpr is being built."""
  trace = _staging_trace()
  if trace is None:
    return None
  info = trace.frame.debug_info
  return None if info is None else info.traced_for


def building_jaxpr() -> bool:
  """True when a jaxpr is being built (``jit``, ``make_jaxpr``,
  ``.trace()``, control flow), under vmap/jvp traces too."""
  return _staging_trace() is not None


# BatchTrace: the trace of a jax.vmap (JAX 0.8-0.12; deprecated from
# jax.interpreters.batching).
from jax._src.interpreters.batching import BatchTrace as _BatchTrace  # noqa: E402


def enclosing_vmaps() -> tuple[tuple[int, int], ...]:
  """The ``vmap``s around the code being traced (around a loop whose body
  is traced too), innermost first, as ``(id of its trace, axis size)``."""
  found = []
  trace = _trace_ctx.trace
  while trace is not None:
    if isinstance(trace, _BatchTrace):
      found.append((id(trace), int(trace.axis_data.size)))
    trace = getattr(trace, "parent_trace", None)
  return tuple(found)


def on_jax_effects_barrier(before) -> None:
  """Makes ``jax.effects_barrier()`` call ``before()`` first, then JAX's
  own wait: ``dispatch.runtime_tokens.block_until_ready`` is wrapped, which
  every route to it goes through (JAX 0.8-0.12)."""
  tokens = _dispatch.runtime_tokens
  if getattr(tokens.block_until_ready, "_jax_effects_hook", False):
    return
  own = type(tokens).block_until_ready

  def block_until_ready():
    before()
    own(tokens)
  block_until_ready._jax_effects_hook = True
  tokens.block_until_ready = block_until_ready


def jax_runtime_tokens() -> list:
  """Every token JAX keeps for ``jax.effects_barrier`` on this thread
  (ordered effects', executables' output tokens), to wait for quietly."""
  tokens = _dispatch.runtime_tokens
  return [*tokens.current_tokens.values(),
          *tokens.output_runtime_tokens.values()]


def eager_transformation() -> bool:
  """True when the innermost trace is a transformation applied eagerly:
  transformation traces down to the eval trace (a ``jit`` bound now runs
  before its bind returns); False at the top level, and where the chain
  reaches a jaxpr-building trace or one of unknown kind. JAX 0.8-0.12.
  """
  trace = _trace_ctx.trace
  if trace is _eval_trace:
    return False
  while trace is not None:
    if trace is _eval_trace:
      return True
    if getattr(trace, "frame", None) is not None:
      return False
    trace = getattr(trace, "parent_trace", None)
  return False


def jax_runtime_token(effect):
  """JAX's own runtime token of an ordered effect on this thread, if any
  (of our effects under plain ``jax.jit``)."""
  return _dispatch.runtime_tokens.current_tokens.get(effect)


def no_user_mesh():
  """A context without the user's ambient mesh, for our helper computations
  on their operands' devices (else "Received incompatible devices"):
  ``jax.set_mesh(None)`` from JAX 0.10, JAX's empty mesh on 0.8/0.9 (which
  refuse None); nothing under a trace (where JAX refuses it).
  """
  if not _trace_ctx.is_top_level():
    return contextlib.nullcontext()
  if JAX_VERSION >= (0, 10):
    return jax.set_mesh(None)
  from jax._src.mesh import empty_concrete_mesh  # JAX 0.8, 0.9
  return jax.set_mesh(empty_concrete_mesh)

# ``trace_context()``: JAX's key for its trace caches (the config values
# that change tracing), which keys our kept traces too. No public route;
# JAX 0.8-0.12.
from jax._src.config import trace_context  # noqa: E402

# ``register_cache(obj, for_what)``: ``jax.clear_caches()`` calls
# ``obj.cache_clear()``, to drop our kept traces with JAX's. No public
# route; JAX 0.8-0.12.
from jax._src.util import register_cache  # noqa: E402

# The transfer guard levels in effect, the global flag included (which
# ``jax.config``'s states miss). No public route; JAX 0.8-0.12.
from jax._src.lib import guard_lib as _guard_lib  # noqa: E402


def host_transfers_guarded() -> bool:
  """Whether a transfer guard other than "allow" is in effect for implicit
  host-to-device transfers on this thread."""
  level = _guard_lib.thread_local_state().host_to_device
  if level is None:
    level = _guard_lib.global_state().host_to_device
  return level is not None and level != _guard_lib.TransferGuardLevel.ALLOW


#: ``transfer_guard_state()``: this thread's guard state, whose
#: ``explicit_device_put`` flag ``jax.device_put`` sets around its transfers
#: (JAX 0.8-0.12).
transfer_guard_state = _guard_lib.thread_local_state

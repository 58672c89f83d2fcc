"""The trace state, JAX's runtime tokens and backends, transfer guards.

JAX internals read by the dispatch path and the runtime (``_dispatch``,
``_runtime``): whether a call is at the top level, what is being traced,
JAX's own runtime tokens and ``effects_barrier``, the backends, the
transfer guards. Part in the token calling convention: JAX's runtime tokens
are waited for beside ours (``jax_runtime_tokens``, ``on_jax_effects_barrier``).
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

# Whether JAX's backends are initialised (the pytest plugin sets the number
# of CPU devices and must know whether that can still take effect). No
# public query: ``jax.devices()`` would initialise them. JAX 0.8-0.12.
from jax._src.xla_bridge import backends_are_initialized  # noqa: E402



def clear_jax_runtime_tokens() -> None:
  """Forgets the tokens JAX keeps for ``jax.effects_barrier``.

  JAX keeps an output token per device for every executable with host
  callbacks and never drops a failed one, so after one callback error every
  later ``jax.effects_barrier()`` would raise it again. Called once the error
  has been reported (``_barrier.effects_barrier``).
  """
  _dispatch.runtime_tokens.clear()


# Whether JAX's backend has started (``_runtime.fork``: XLA's runtime does
# not survive a fork after it). No public route: ``jax.devices()`` would start
# it. ``backends_are_initialized`` exists on JAX 0.8.3 to 0.12.x.
from jax._src import xla_bridge as _xla_bridge  # noqa: E402


def backend_started() -> bool:
  """Whether this process's JAX backend has started (starts nothing)."""
  return _xla_bridge.backends_are_initialized()


def cpu_collectives_on_host(host: str) -> None:
  """Makes the CPU backend, when it starts, listen for its cross-process
  collectives (gloo over TCP) on ``host`` only.

  JAX creates gloo's TCP device without an address, and gloo then binds the
  address the machine's hostname resolves to (often its outward address);
  ``make_gloo_tcp_collectives`` takes one, but JAX passes none and has no
  option for it. So the ``"cpu"`` backend factory is registered again (as
  ``xla_bridge`` registers it: priority 0, failures raised) with collectives
  bound to ``host``. Call after ``jax.distributed.initialize`` (the
  collectives use its client) and before the backend starts. Used by the
  multi-process launcher (``_tools.launcher``: 127.0.0.1). The same names on
  JAX 0.8.3 to 0.12.x (``jax._src.lib._jax`` is ``xla_client._xla``).
  """
  import functools
  from jax._src import distributed
  from jax._src.lib import _jax
  if _xla_bridge.backends_are_initialized():
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
# (read on every dispatch, see ``_call_path.fast_dispatch``). JAX 0.10
# keeps the trace and axis environment in thread-local config states
# (``.value``); 0.8 and 0.9 in attributes of the ``threading.local``
# ``trace_ctx``.
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

#: ``(trace, axis_env, eval_trace, top_axis_env)``: at the top level when
#: ``trace.value is eval_trace and axis_env.value is top_axis_env``; for a
#: caller that inlines :func:`at_top_level` (the dispatch fast path: one
#: Python frame less per call on JAX 0.10).
TOP_LEVEL = (_trace_value, _axis_env_value, _eval_trace, _top_axis_env)


def at_top_level() -> bool:
  """True when no JAX transformation or trace is active on this thread."""
  return (_trace_value.value is _eval_trace
          and _axis_env_value.value is _top_axis_env)


def compiled_dispatch() -> bool:
  """True when a call dispatches a compiled computation: no transformation or
  trace active on this thread and ``jax.disable_jit`` off."""
  return at_top_level() and not disable_jit_flag.value


# ``jax.Array.committed`` is a Python property; the C++ attribute behind it is
# read on every dispatch (``TokenStore.update``).
committed = operator.attrgetter("_committed")


def uncommitted(array):
  """Returns ``array``'s first shard as an uncommitted single-device jax.Array.

  Runtime tokens must not pin the next computation to their devices: an
  uncommitted array is moved by ``jax.jit``'s C++ dispatch to wherever the
  next computation runs, and only when that differs. A token replicated over
  several devices is represented by its first shard (as JAX itself does when it
  copies a runtime token to another device set).
  """
  shard = array._arrays[0]
  return _ArrayImpl(shard.aval, shard.sharding, [shard], committed=False,
                    _skip_checks=True)


def enclosing_staging() -> str | None:
  """What the innermost jaxpr being traced is for ("cond", "jit", ...).

  Walks from the current trace through its parents (vmap/jvp traces) to the
  innermost jaxpr-building trace and returns its ``traced_for``; None when no
  jaxpr is being built. Lets an effect record that it was bound directly in a
  ``cond``/``switch`` branch (a branch that ``vmap`` may later inline).
  """
  trace = _trace_ctx.trace
  while trace is not None:
    frame = getattr(trace, "frame", None)
    if frame is not None:
      info = frame.debug_info
      return None if info is None else info.traced_for
    trace = getattr(trace, "parent_trace", None)
  return None


# BatchTrace: the trace of a jax.vmap (JAX 0.8-0.12; deprecated from
# jax.interpreters.batching), found around an update of a progress bar.
from jax._src.interpreters.batching import BatchTrace as _BatchTrace  # noqa: E402


def enclosing_vmaps() -> tuple[tuple[int, int], ...]:
  """The ``vmap``s around the code being traced, innermost first, as
  ``(id of its trace, its axis size)``.

  Walks from the current trace through every trace's ``parent_trace`` (a
  sub-jaxpr's trace, a ``scan`` body's, has the trace it was traced in as
  parent: JAX 0.8-0.12), so a ``vmap`` around a loop whose body is being
  traced is found too. ``jax_effects.progress`` counts an update inside a
  ``vmap`` its bar was not opened in once per element.
  """
  found = []
  trace = _trace_ctx.trace
  while trace is not None:
    if isinstance(trace, _BatchTrace):
      found.append((id(trace), int(trace.axis_data.size)))
    trace = getattr(trace, "parent_trace", None)
  return tuple(found)


def on_jax_effects_barrier(before) -> None:
  """Makes ``jax.effects_barrier()`` call ``before()`` first (jax_effects'
  effects: ``_runtime.barrier.jax_barrier_hook``), then JAX's own wait.

  JAX's function waits through ``dispatch.runtime_tokens.block_until_ready``
  (also at exit and in ``clear_backends``): wrapped on that object, so every
  route to it (``jax.effects_barrier`` imported before jax_effects too) is
  covered and JAX's function itself is left as it is."""
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
  (ordered effects' runtime tokens, and the output token per device of
  every executable with host callbacks), to wait for without raising what
  JAX raises there (``_runtime.barrier``)."""
  tokens = _dispatch.runtime_tokens
  return [*tokens.current_tokens.values(),
          *tokens.output_runtime_tokens.values()]


def building_jaxpr() -> bool:
  """True when a jaxpr is being built: the current trace, or a trace below
  it (through ``parent_trace``: vmap/jvp traces), stages a jaxpr
  (``jit``, ``make_jaxpr``, ``.trace()``, control flow)."""
  trace = _trace_ctx.trace
  while trace is not None:
    if getattr(trace, "frame", None) is not None:
      return True
    trace = getattr(trace, "parent_trace", None)
  return False


def eager_transformation() -> bool:
  """True when the innermost trace is a transformation applied eagerly.

  That is a chain of transformation traces (``jvp``, ``vmap``,
  ``linearize``, partial evaluation) linked by their ``parent_trace`` down
  to the eval trace: a ``jit`` bound now is executed (compiled, dispatched)
  before its bind returns. False at the top level (no trace), and when the
  chain reaches a trace that builds a jaxpr (``jit``, ``make_jaxpr``,
  control flow: it has a ``frame``) or a trace of unknown kind (one with no
  ``parent_trace``): what is bound there runs later, if at all. The trace
  classes and their ``parent_trace``/``frame`` attributes are the same on
  JAX 0.8.3 to 0.12.x.
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
  """JAX's own runtime token of an ordered effect on this thread, if any.

  Only code under plain ``jax.jit`` (or eager control flow) uses JAX's tokens
  for our effects; eager effects wait for it to keep program order.
  """
  return _dispatch.runtime_tokens.current_tokens.get(effect)



def no_user_mesh():
  """A context in which the user's ambient mesh is not in effect.

  Our own helper computations (combining per-device runtime tokens, the
  initial token) run on the devices of their operands; a mesh the user set
  with ``jax.set_mesh`` (context or global setter) would make ``jax.jit``
  check them against that mesh ("Received incompatible devices").
  ``jax.set_mesh`` clears this thread's concrete and abstract mesh for the
  block: given None on JAX 0.10; JAX 0.8 and 0.9 refuse None and take JAX's
  empty mesh (``jax._src.mesh.empty_concrete_mesh``, the value "no mesh"
  there). JAX allows it only outside any trace; under one (our helpers are
  called at the top level, so only if a user reads ``runtime_tokens()``
  while tracing) nothing is changed.
  """
  if not _trace_ctx.is_top_level():
    return contextlib.nullcontext()
  if JAX_VERSION >= (0, 10):
    return jax.set_mesh(None)
  from jax._src.mesh import empty_concrete_mesh  # JAX 0.8, 0.9
  return jax.set_mesh(empty_concrete_mesh)

# ``trace_context()``: the ``jax.config`` values that change what tracing
# produces (x64, the mesh, ...), JAX's own key for its trace caches; a
# jax_effects.jit function's kept traces are keyed by it too
# (``_dispatch.tracing.TraceCache``: its learnt state outlives a config change).
# No public route; JAX 0.8-0.12.
from jax._src.config import trace_context  # noqa: E402

# ``register_cache(obj, for_what)``: ``jax.clear_caches()`` calls
# ``obj.cache_clear()`` (held weakly). A jax_effects.jit function's kept
# traces (``_dispatch.tracing.TraceCache``) are a staging cache like JAX's own
# tracing caches, so they are dropped with them. No public route; JAX 0.8-0.12.
from jax._src.util import register_cache  # noqa: E402

# The transfer guard levels in effect (``jax.transfer_guard``): the
# thread's, else the global one. ``jax.config``'s per-direction states miss
# the global ``jax_transfer_guard`` flag, which sets guard_lib directly.
# No public route; JAX 0.8-0.12.
from jax._src.lib import guard_lib as _guard_lib  # noqa: E402


def host_transfers_guarded() -> bool:
  """Whether a transfer guard other than "allow" is in effect for implicit
  host-to-device transfers on this thread (``threads.ThreadTokens.initial_token``)."""
  level = _guard_lib.thread_local_state().host_to_device
  if level is None:
    level = _guard_lib.global_state().host_to_device
  return level is not None and level != _guard_lib.TransferGuardLevel.ALLOW


#: ``transfer_guard_state()``: this thread's guard state; its
#: ``explicit_device_put`` flag is what ``jax.device_put`` sets around its
#: transfers (``config.explicit_device_put_scope``), so a guard of
#: "disallow" lets them through. The adopted host side of JAX's callbacks
#: sets it around its ``batched_device_put`` calls, so they count as the
#: explicit puts ``debug_callback_impl``/``io_callback_impl`` make (JAX
#: 0.8-0.12).
transfer_guard_state = _guard_lib.thread_local_state

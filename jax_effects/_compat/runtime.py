"""The trace state, JAX's runtime tokens, backends, transfer guards, tracebacks.

For ``_dispatch`` and ``_runtime``; traceback filtering as ``jax.jit``'s,
for errors leaving jax_effects (:func:`api_boundary`), and the user's line
of an equation (:func:`user_line`). Part in the token calling convention:
JAX's runtime tokens are waited for beside ours (``jax_runtime_tokens``,
``on_jax_effects_barrier``).
"""
from __future__ import annotations

import contextlib
import functools
import operator
import threading
import traceback as _traceback
import types as _types

import jax

from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src.array import ArrayImpl as _ArrayImpl
from jax.errors import JaxRuntimeError as _JaxRuntimeError
from jax_effects._compat.callbacks import disable_jit_flag
from jax_effects._compat.versions import JAX_VERSION

# Whether JAX's backends have started (for the pytest plugin's device count
# and ``_runtime.fork``): no public query, ``jax.devices()`` would start
# them. JAX 0.8-0.12.
from jax._src import xla_bridge as _xla_bridge  # noqa: E402

backends_are_initialized = backend_started = _xla_bridge.backends_are_initialized


def clear_jax_runtime_tokens() -> None:
  """Forgets the tokens JAX keeps for ``jax.effects_barrier`` (this
  thread's; every thread's we keep), which would raise a reported callback
  error again at every later barrier."""
  _dispatch.runtime_tokens.clear()
  with _every_thread_lock:
    _every_thread.clear()


def cpu_collectives_on_host(host: str) -> None:
  """Makes the CPU backend, when it starts, listen for its cross-process
  collectives (gloo over TCP) on ``host`` only (JAX has no option for it:
  its ``"cpu"`` factory is registered again, as ``xla_bridge`` does, with
  collectives bound to ``host``). Call after ``jax.distributed.initialize``
  and before the backend starts (``design/multihost.md``). JAX 0.8-0.12.
  """
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
  return _trace_value.value is _eval_trace and _axis_env_value.value is _top_axis_env


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
  info = None if trace is None else trace.frame.debug_info
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


_RuntimeTokenSet = type(_dispatch.runtime_tokens)
#: (thread ident, effect or device) -> the latest runtime token JAX keeps for
#: that thread's ``jax.effects_barrier`` (each thread's ``RuntimeTokenSet`` is
#: a ``threading.local``): what a barrier on any thread waits for.
_every_thread: dict = {}
_every_thread_lock = threading.Lock()


def hook_jax_runtime_tokens(before_barrier, ours, before_input,
                            after_result) -> None:
  """Hooks JAX's runtime tokens (``dispatch.RuntimeTokenSet``, whose
  methods every route to them takes, JAX 0.8-0.12), at its class, so on
  every thread:

  * ``jax.effects_barrier()`` calls ``before_barrier()`` first;
  * every thread's latest tokens are kept for :func:`jax_runtime_tokens`;
  * the token an executable takes for an ordered effect ``eff`` with
    ``ours(eff)`` calls ``before_input()`` first, and is the last one
    itself where it lives on the same devices (JAX's ``device_put`` of it
    costs more than the call it orders): waited for, as JAX waits, and
    passed on, unless it failed (then JAX's own path raises and resets);
    the token such an executable returns is given to ``after_result``
    (as a ``jax.Array``).
  """
  cls = _RuntimeTokenSet
  if getattr(cls.block_until_ready, "_jax_effects_hook", False):
    return
  own_barrier, own_input = cls.block_until_ready, cls.get_token_input
  own_result, own_output = cls.set_token_result, cls.set_output_runtime_token

  def block_until_ready(self):
    before_barrier()
    own_barrier(self)

  def get_token_input(self, eff, devices):
    if not ours(eff):
      return own_input(self, eff, devices)
    before_input()
    token = self.current_tokens.get(eff)
    buf = getattr(token, "_buf", None)
    if (buf is not None and tuple(devices) ==
        tuple(buf.sharding._device_assignment)):
      try:
        token.block_until_ready()
        return token
      except _JaxRuntimeError:
        pass
    return own_input(self, eff, devices)

  def set_token_result(self, eff, token):
    own_result(self, eff, token)
    if ours(eff):
      after_result(getattr(token, "_buf", token))
    with _every_thread_lock:
      _every_thread[(threading.get_ident(), eff)] = token

  def set_output_runtime_token(self, device, token):
    own_output(self, device, token)
    with _every_thread_lock:
      _every_thread[(threading.get_ident(), device)] = token

  block_until_ready._jax_effects_hook = True
  cls.block_until_ready = block_until_ready
  cls.get_token_input = get_token_input
  cls.set_token_result = set_token_result
  cls.set_output_runtime_token = set_output_runtime_token


def jax_runtime_tokens(all_threads: bool = False) -> list:
  """The tokens JAX keeps for ``jax.effects_barrier`` (ordered effects',
  executables' output tokens), this thread's or every thread's, to wait
  for quietly; a token of a thread that ended is forgotten once ready."""
  if not all_threads:
    tokens = _dispatch.runtime_tokens
    return [*tokens.current_tokens.values(), *tokens.output_runtime_tokens.values()]
  alive = {t.ident for t in threading.enumerate()}
  with _every_thread_lock:
    tokens = list(_every_thread.items())
    for key, token in tokens:
      if key[0] not in alive and _is_ready(token):
        del _every_thread[key]
  return [token for _, token in tokens]


def _is_ready(token) -> bool:
  buf = getattr(token, "_buf", token)
  try:
    return buf.is_ready()
  except Exception:  # noqa: BLE001 - a failed token is ended too
    return True


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


# --- tracebacks --------------------------------------------------------------

# Traceback filtering as ``jax.jit``'s (``jax._src.traceback_util``, the same
# on JAX 0.8-0.12): an exception leaving the outermost ``api_boundary`` has
# the frames of the registered paths removed (``JAX_TRACEBACK_FILTERING``).
from jax._src import traceback_util as _traceback_util


def _filtered(tb):
  """``tb`` without the frames of the excluded paths: a prefix test per
  frame (JAX's ``filter_traceback`` costs milliseconds per error)."""
  prefixes = tuple(_traceback_util._exclude_paths)
  out = None
  for frame, lineno in reversed(list(_traceback.walk_tb(tb))):
    if not frame.f_code.co_filename.startswith(prefixes):
      out = _types.TracebackType(out, frame, frame.f_lasti, lineno)
  return out


def api_boundary(fun):
  """As JAX's ``traceback_util.api_boundary`` (``JAX_TRACEBACK_FILTERING``
  honoured), but adding no note: a callback's error reaches the caller as
  the user's own object, unchanged but for its traceback."""
  @functools.wraps(fun)
  def boundary(*args, **kwargs):
    __tracebackhide__ = True  # noqa: F841 - read by IPython
    try:
      return fun(*args, **kwargs)
    except Exception as e:
      mode = _traceback_util._filtering_mode()
      if mode == "off":
        raise
      if mode == "tracebackhide":
        _traceback_util._add_tracebackhide_to_hidden_frames(e.__traceback__)
        raise
      e.with_traceback(_filtered(e.__traceback__))
      raise
  return boundary


def exclude_from_tracebacks(path: str) -> None:
  """Leaves the frames of files under ``path`` out of filtered tracebacks."""
  _traceback_util.register_exclusion(path)


# The user's line that bound an equation, from its ``source_info``: JAX's
# ``source_info_util.user_frame`` (its own files and the registered paths
# left out), the same on JAX 0.8-0.12; no public form (``jax.extend``'s
# ``summarize`` gives only its text). ``core`` imports the module.
from jax_effects._compat.core import (  # noqa: E402
    source_info_util as _source_info_util)


def user_line(source_info) -> tuple[str, int] | None:
  """``(file name, line)`` of the user's code that bound the equation whose
  ``source_info`` this is, or None where unknown."""
  frame = _source_info_util.user_frame(getattr(source_info, "traceback", None))
  return None if frame is None else (frame.file_name, frame.start_line)

"""Where a host callback runs, and the deterministic view of per-device output.

**Attribution.** A host callback receives only arrays, so where it runs is
decided when it is lowered, from the lowering's axis context:

* *Per device* (inside a fully manual ``shard_map``, and so inside ``pmap``,
  which JAX stages as ``shard_map``): XLA runs the callback once on every
  device. The lowering passes ``stablehlo.partition_id`` as one more operand;
  the host side maps it through the mesh to a :class:`Placement` with the
  device id, the shard index (the device's position in the mesh: an ``int``
  for a one-axis mesh, a tuple of ints in ``mesh.axis_names`` order otherwise)
  and the process index.
* *Once* (automatic partitioning, or a single device): XLA runs the callback
  once, on the first device of the computation's device assignment (JAX's own
  rule for callbacks, ``MAXIMAL`` sharding on device 0), on the full logical
  value. Its :class:`Placement` has that device's id and ``shard_index=None``.
* Eagerly (outside any compiled computation) there is no placement:
  :func:`current` returns None.

While the host function runs, :func:`current` returns its placement (a
thread-local: XLA may run the callbacks of several devices at the same time
on different threads). ``print`` prefixes per-device lines with
:meth:`Placement.prefix`; ``log`` copies the fields onto its records.

**Errors.** A failing callback never fails its computation (in a
multi-device one the other devices would wait forever in the next collective
and XLA's CPU runtime aborts the process): the error is recorded for the
dispatching thread (the value of the carrier is its slot, see
``_runtime_tokens``), the callback returns zeros and the carrier with the
``FAILED`` bit (the later effects of its chain are skipped), and that
thread's call raises it (when the callback ran inline in it), or else its
next call (before it dispatches) or barrier. Under plain ``jax.jit`` errors
are deferred the same way. See ``design/errors.md``.

**Deterministic view.** Per-device effects are ordered on each device
(program order, by that device's compiler-token chain), but devices run
concurrently, so the interleaving of their output changes from run to run.
Inside :func:`deterministic`, the ordered output of per-device callbacks of
``jax_effects.jit`` code is *held* instead of delivered, and released sorted
by (position in its device's sequence, device id) when the dispatch's
per-device token is combined into the next runtime token
(:func:`combine_per_device`, a host callback that runs after every device's
effects), or just before an ordered effect that runs once (which follows
them by data dependency), or when the block exits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jax_effects import _capture
from jax_effects import _compat
from jax_effects import _effects
from jax_effects import _runtime_tokens

__all__ = ["Placement", "current", "deterministic", "is_deterministic"]


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one run of a host callback happens.

  ``device_id``: id of the device whose computation ran the callback (None if
  unknown, e.g. lowered for an abstract mesh). ``shard_index``: the device's
  position along the mesh axes of a per-device (``shard_map``/``pmap``)
  computation: an ``int`` for a one-axis mesh, a tuple of ints (in
  ``mesh.axis_names`` order) otherwise; None where the value is not per-device.
  ``process_index``: the process that owns the device.
  """
  device_id: int | None
  shard_index: int | tuple[int, ...] | None
  process_index: int

  @property
  def per_device(self) -> bool:
    return self.shard_index is not None

  def prefix(self) -> str:
    """``"[device 3 shard 3 process 0] "`` (the prefix of per-device lines)."""
    shard = self.shard_index
    if isinstance(shard, tuple):
      shard = "(" + ", ".join(str(i) for i in shard) + ")"
    return f"[device {self.device_id} shard {shard} process {self.process_index}] "


# --- the running callback's placement --------------------------------------------

class _Site(threading.local):
  placement: Placement | None = None
  # True when the callback went through the token-threading pass: its
  # dispatch's per-device token will be combined (and held output released).
  threaded: bool = False


_site = _Site()


def current() -> Placement | None:
  """The placement of the host callback running on this thread, if any."""
  return _site.placement


def _run_at(placement: Placement, threaded: bool, fn: Callable, args):
  site = _site
  prev = site.placement, site.threaded
  site.placement, site.threaded = placement, threaded
  try:
    return fn(*args)
  finally:
    site.placement, site.threaded = prev


def _device_placement(device) -> Placement:
  return Placement(device.id, None, device.process_index)


def attribute(ctx, operands: list, avals_in: list, avals_out: list, *,
              threaded: bool, passthrough: int = 0):
  """Lowering side: where the callback lowered in ``ctx`` runs.

  ``operands``/``avals_in``/``avals_out`` are those of the host function;
  its first ``passthrough`` results are its first operands returned as
  received (the token placeholder and the carrier of a threaded effect).
  Returns ``(operands, avals_in, wrap)``: the operands and their avals (with
  the partition id appended in the per-device case) and ``wrap``, which turns
  the host function into one that takes those operands and runs the original
  with :func:`current` set.

  The wrapped function never fails its computation: a user error is recorded
  for the dispatching thread (``_runtime_tokens.defer_error``) and the
  results are zeros (the ``passthrough`` ones are returned as received, the
  carrier with the ``FAILED`` bit). A device failing its part of an SPMD
  program leaves the others waiting forever in the next collective; a failed
  computation's token fails every computation it is passed to; and under
  plain ``jax.jit`` no hook of ours could catch XLA's error
  (``design/errors.md``).
  """
  axis_ctx = ctx.module_context.axis_context
  if isinstance(axis_ctx, _compat.SPMDAxisContext):
    table, operands, avals_in = _per_device_table(axis_ctx.mesh, operands,
                                                  avals_in)
    return operands, avals_in, _wrapper(lambda args: table[int(args[-1])], 1,
                                        threaded, avals_out, passthrough)
  device = None
  n_devices = 1
  if isinstance(axis_ctx, _compat.ShardingContext):
    n_devices = axis_ctx.num_devices
    if axis_ctx.device_assignment:
      device = axis_ctx.device_assignment[0]
  placement = (_device_placement(device) if device is not None
               else Placement(None, None, jax.process_index()))
  # Single device too: a failed computation's token would fail every later
  # computation given it (silently, when the failure is asynchronous). The
  # call raises the error itself when the callback ran inline in it.
  return operands, avals_in, _wrapper(lambda args: placement, 0, threaded,
                                      avals_out, passthrough)


def _wrapper(placement_of, n_extra: int, threaded: bool, avals_out,
             passthrough: int):
  from jax_effects import _runtime_tokens
  FAILED = _runtime_tokens.FAILED
  SLOT_MASK = _runtime_tokens.SLOT_MASK
  carrier_at = passthrough - 1 if threaded and passthrough else None

  def zeros(args, carrier):
    out = [*args[:passthrough],
           *(np.zeros(a.shape, a.dtype) for a in avals_out[passthrough:])]
    if carrier_at is not None:
      out[carrier_at] = carrier
    return tuple(out)

  def wrap(host):
    def attributed(*args):
      placement = placement_of(args)
      if n_extra:
        args = args[:-n_extra]
      if carrier_at is not None:
        # The carrier holds the dispatching thread's slot (_runtime_tokens),
        # and FAILED once an earlier effect of its chain failed: as after a
        # raise in Python, the later effects of the chain do not run.
        carrier = args[carrier_at]
        # (a loop may carry a vector)
        value = int(carrier) if not carrier.ndim else int(carrier.max())
        if value & FAILED:
          return zeros(args, carrier)
        slot = int(value & SLOT_MASK)
      else:   # plain jax.jit: run on the dispatching thread if on one device
        slot = (0 if placement.per_device
                else _runtime_tokens.thread_tokens().slot)
        if _runtime_tokens.has_deferred(slot) and slot:
          return zeros(args, None)   # after an unreported failure: skipped
      try:
        return _run_at(placement, threaded, host, args)
      except BaseException as exc:  # noqa: BLE001 - reported by the thread
        _runtime_tokens.defer_error(_runtime_tokens.user_error(exc), slot,
                                    inline=carrier_at is not None)
        return zeros(args, None if carrier_at is None else
                     np.bitwise_or(carrier, FAILED))
    return attributed
  return wrap


def _per_device_table(mesh, operands, avals_in):
  from jax.extend.mlir.dialects import stablehlo  # lowering-time only

  sizes = tuple(mesh.axis_sizes)
  devices = getattr(mesh, "devices", None)
  flat = list(np.asarray(devices).flat) if devices is not None else None
  table = []
  for pid in range(int(np.prod(sizes, dtype=np.int64))):
    index = tuple(int(i) for i in np.unravel_index(pid, sizes))
    shard = index[0] if len(index) == 1 else index
    if flat is not None:
      d = flat[pid]
      table.append(Placement(d.id, shard, d.process_index))
    else:
      table.append(Placement(None, shard, jax.process_index()))
  pid_value = stablehlo.partition_id()
  pid_aval = jax.core.ShapedArray((), np.uint32)
  return tuple(table), [*operands, pid_value], [*avals_in, pid_aval]


# --- delivery and the deterministic view -------------------------------------------

_det_lock = threading.Lock()
_det_depth = 0
# device sort key -> [(effect, deliver thunk), ...] in that device's order
_held: dict[Any, list] = {}


def is_deterministic() -> bool:
  """Whether a :func:`deterministic` block is active (in any thread)."""
  return _det_depth > 0


def _hold_or_run(effect, ordered: bool | None, thunk: Callable[[], None]) -> None:
  site = _site
  p = site.placement
  if _det_depth and site.threaded:
    if effect is None:
      effect = _effects.DEFAULT
    if ordered is None:   # the effect's default (``Effect(..., ordered=...)``)
      ordered = getattr(effect, "ordered", True)
    if ordered and p is not None and p.per_device:
      key = (p.device_id if p.device_id is not None else -1, p.shard_index)
      with _det_lock:
        if _det_depth:
          _held.setdefault(key, []).append(thunk)
          return
    elif ordered and _held:
      # Runs once, after the per-device effects before it (data dependency):
      # they come first.
      release_held()
  thunk()


def deliver_line(text: str, effect, ordered: bool | None) -> None:
  """Delivers a printed line; per-device lines get :meth:`Placement.prefix`."""
  p = _site.placement
  if p is not None and p.per_device:
    text = p.prefix() + text
  _hold_or_run(effect, ordered,
               lambda: _capture.deliver_line(text))


def deliver_record(logger, record, effect, ordered: bool | None) -> None:
  """Delivers a log record (held in the deterministic view like lines)."""
  _hold_or_run(effect, ordered,
               lambda: _capture.deliver_record(logger, record))


def release_held() -> None:
  """Delivers the held output, ordered by (position on its device, device)."""
  if not _held:
    return
  with _det_lock:
    release = dict(_held)
    _held.clear()
  keys = sorted(release, key=lambda k: k[0])
  depth = max((len(v) for v in release.values()), default=0)
  for i in range(depth):
    for key in keys:
      entries = release[key]
      if i < len(entries):
        entries[i]()


def _release_and_pass(token):
  release_held()
  return token


def _combine(*shards):
  return jnp.max(jnp.concatenate([s.reshape((-1,)) for s in shards]))


def _combine_and_release(*shards):
  # The callback's result is the token: the next dispatch's effects follow
  # the release.
  return io_callback(_release_and_pass,
                     jax.ShapeDtypeStruct((), _runtime_tokens.TOKEN_DTYPE),
                     _combine(*shards))


_combine_jit = jax.jit(_combine)
_combine_release_jit = jax.jit(_combine_and_release)


def combine_per_device(token):
  """The next runtime token from a per-device token (one element per device).

  The elements are copied to the first device (plain copies, no collective)
  and reduced there; the result, uncommitted on that device, is ready only
  once every device's effects have run. In the deterministic view, the held
  per-device output is released at that point (a host callback).
  """
  shards = [s.data for s in token.addressable_shards]
  moved = jax.device_put(shards, shards[0].device)
  fn = _combine_release_jit if _det_depth else _combine_jit
  return _compat.uncommitted(fn(*moved))


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
  """Per-device output of each dispatch in a fixed order (process-wide).

  While the block is active (in any thread: the callbacks run on XLA's
  threads), ordered ``print`` lines and ``log`` records of per-device
  callbacks (``shard_map``/``pmap`` in ``jax_effects.jit`` code) are held and
  released once every device's effects of that dispatch have run, sorted by
  (position in the device's sequence of effects of the dispatch, device id).
  For SPMD code whose control flow is the same on every device, position =
  program point, so the same program logs identically run after run. On exit,
  waits for the calling thread's effects (``effects_barrier``) and releases
  anything still held.

  Guaranteed: on one device, program order (always); within one dispatch,
  sorted as above (in this view only); a dispatch's output before the next
  dispatch's on the same effect stream, and an ordered effect that runs once
  after the per-device output before it (always). Not guaranteed: any order
  across processes (each process delivers its own devices' output); an order
  for ``ordered=False`` effects (delivered at once); a fixed interleaving when
  several threads dispatch per-device effects at the same time (a release
  delivers everything held); per-device effects under plain ``jax.jit``
  (delivered at once).
  """
  global _det_depth
  from jax_effects import _runtime_tokens
  with _det_lock:
    _det_depth += 1
  try:
    yield
  finally:
    try:
      _runtime_tokens.effects_barrier()
    finally:
      with _det_lock:
        _det_depth -= 1
      release_held()   # everything still held: the effects have all run

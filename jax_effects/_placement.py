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

**Deterministic view.** Per-device effects of one ``shard_map`` execution are
ordered on each device (program order, by the compiler-token chain of that
device), but devices run concurrently, so the interleaving of their output
changes from run to run. Inside :func:`deterministic`, the ordered output of
per-device callbacks that went through the token-threading pass is *held*
instead of delivered. After each ``shard_map`` execution the pass adds one
host callback per ordered chain (the *segment end*, see
``_shard_map_rules``) that depends on every device's last effect of that
chain, and runs before any later effect of the chain; it releases the held
output of that chain sorted by (position in its device's sequence, device id).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator

import jax
import numpy as np

from jax_effects import _capture
from jax_effects import _compat
from jax_effects import _effects

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
  # True when the callback went through the token-threading pass: a segment
  # end will follow its per-device ordered effects.
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

  In a multi-device computation the wrapped function does not fail: a user
  error is recorded for the next ``effects_barrier``
  (``_runtime_tokens.defer_error``) and the results are zeros (the
  ``passthrough`` ones are returned as received), because a device failing its part of an SPMD program
  leaves the others waiting forever in the next collective.
  """
  axis_ctx = ctx.module_context.axis_context
  if isinstance(axis_ctx, _compat.SPMDAxisContext):
    table, operands, avals_in = _per_device_table(axis_ctx.mesh, operands,
                                                  avals_in)
    return operands, avals_in, _wrapper(lambda args: table[int(args[-1])], 1,
                                        threaded, avals_out, passthrough,
                                        defer=True)
  device = None
  n_devices = 1
  if isinstance(axis_ctx, _compat.ShardingContext):
    n_devices = axis_ctx.num_devices
    if axis_ctx.device_assignment:
      device = axis_ctx.device_assignment[0]
  placement = (_device_placement(device) if device is not None
               else Placement(None, None, jax.process_index()))
  return operands, avals_in, _wrapper(lambda args: placement, 0, threaded,
                                      avals_out, passthrough,
                                      defer=n_devices > 1)


def _wrapper(placement_of, n_extra: int, threaded: bool, avals_out,
             passthrough: int, *, defer: bool):
  from jax_effects import _runtime_tokens

  def wrap(host):
    def attributed(*args):
      placement = placement_of(args)
      if n_extra:
        args = args[:-n_extra]
      if not defer:
        return _run_at(placement, threaded, host, args)
      try:
        return _run_at(placement, threaded, host, args)
      except _runtime_tokens.CallbackFailed as failed:
        _runtime_tokens.defer_error(failed)
        return (*args[:passthrough],
                *(np.zeros(a.shape, a.dtype) for a in avals_out[passthrough:]))
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
  if effect is None:
    effect = _effects.DEFAULT
  if ordered is None:   # the effect's default (``Effect(..., ordered=...)``)
    ordered = getattr(effect, "ordered", True)
  if (_det_depth and ordered and site.threaded and p is not None
      and p.per_device):
    key = (p.device_id if p.device_id is not None else -1, p.shard_index)
    with _det_lock:
      if _det_depth:
        _held.setdefault(key, []).append((effect, thunk))
        return
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


def segment_end(chain_key) -> None:
  """Releases the held output of ``chain_key`` (all output for ``GLOBAL``).

  Called by the host callback that ends a ``shard_map`` execution's segment of
  the chain; everything of that chain held now belongs to that execution.
  """
  if not _held:
    return
  everything = chain_key is _effects.GLOBAL or chain_key is None
  with _det_lock:
    release = {}
    for key in list(_held):
      entries = _held[key]
      if everything:
        taken, kept = entries, []
      else:
        taken = [e for e in entries if e[0] == chain_key]
        kept = [e for e in entries if e[0] != chain_key]
      if taken:
        release[key] = taken
      if kept:
        _held[key] = kept
      else:
        del _held[key]
  _release(release)


def _release(release: dict) -> None:
  """Runs the thunks ordered by (position on its device, device)."""
  keys = sorted(release, key=lambda k: k[0])
  depth = max((len(v) for v in release.values()), default=0)
  for i in range(depth):
    for key in keys:
      entries = release[key]
      if i < len(entries):
        entries[i][1]()


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
  """Per-device output of each ``shard_map`` execution in a fixed order.

  While the block is active (process-wide: the callbacks run on XLA's
  threads), ordered ``print`` lines and ``log`` records of per-device
  callbacks in ``jax_effects.jit`` code are held and released when that
  ``shard_map`` execution's effects of the chain have all run, sorted by
  (position in the device's sequence of effects of that execution, device
  id). For SPMD code with the same control flow on every device, position =
  program point. On exit, waits for the calling thread's effects
  (``effects_barrier``) and releases anything still held.

  Guaranteed: on one device, program order (always); across devices of one
  ``shard_map`` execution, sorted as above (in this view only); output of
  one execution before the next one's, on the same effect (always, as the
  runtime token orders dispatches). Not guaranteed: any order across
  processes (each process delivers its own devices' output); an order for
  ``ordered=False`` effects (delivered immediately), or across effects that
  are not ordered with each other (different ``Effect`` s in ``"per_effect"``
  mode); per-device effects under plain ``jax.jit`` (not token-threaded, so
  delivered immediately).
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
      segment_end(None)   # everything still held: the effects have all run

"""Where a host callback runs: decided at lowering, read while it runs.

A host callback receives only arrays, so where it runs is decided when it is
lowered, from the lowering's axis context (:func:`at_lowering`):

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

While the host function runs (``_primitives.host_functions``), :func:`current` returns its
placement: from :data:`site` (a thread-local: XLA may run the callbacks of
several devices at the same time on different threads), which the host
functions of ``print``/``log`` set, or else from the innermost host-function
frame on the calling thread's stack (a callback's host function sets
nothing: no cost per run). ``print``
prefixes per-device lines with :meth:`Placement.prefix`; ``log`` copies the
fields onto its records.
"""
from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np

from jax_effects import _compat
from jax_effects._runtime import frames as _frames

__all__ = ["Placement", "current", "at_lowering"]


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

class _Running(threading.local):
  # ``(placement, threaded)`` set by the host function of an effect whose
  # host side reads its placement on every run (``print``/``log``:
  # ``HostCallback.reads_placement``), and by any host function running
  # nested inside one (a logging handler calling jitted code): ``threaded``
  # is True when the callback went through the token-threading pass (its
  # dispatch's per-device token will be combined, and held output released).
  # One attribute, so it is set and restored with one store each.
  running: tuple = (None, False)


#: The ``(placement, threaded)`` of the running host callback, where set (see
#: ``_Running``; :func:`running` builds the value).
site = _Running()

#: The name of the local (or free) variable in which a registered host
#: function's frame holds its ``(placement, threaded)`` (see
#: :func:`register_host_code`). Host functions set nothing per run: a rare
#: query (the user's ``placement()``, a barrier refusing to run in a
#: callback) finds the innermost host function's frame on the stack
#: (``frames``) and reads this local.
RUNNING_LOCAL = "running"


def register_host_code(code) -> None:
  """Marks the code of a host function (``frames.HOST``), whose frames hold
  their ``(placement, threaded)`` in a local (or free) variable named
  :data:`RUNNING_LOCAL`; refuses code without one (a renamed variable would
  otherwise silently hide every placement)."""
  if RUNNING_LOCAL not in (*code.co_varnames, *code.co_freevars,
                           *code.co_cellvars):
    raise AssertionError(
        f"jax_effects: host function {code.co_name} ({code.co_filename}:"
        f"{code.co_firstlineno}) has no variable {RUNNING_LOCAL!r} for "
        f"placement() to read")
  _frames.mark(code, _frames.HOST)


def running(placement: Placement | None, threaded: bool) -> tuple:
  """The ``(placement, threaded)`` of a host callback placed at
  ``placement`` (built once, at lowering)."""
  return (placement, threaded)


def host_local(name: str):
  """The local ``name`` of the innermost host-function frame on this
  thread's stack (None: no host function runs, or it has no such local).
  A rare query (a placement, a failure's carrier), never per run."""
  return _frames.local_of_innermost(_frames.HOST, name)


def current() -> Placement | None:
  """The placement of the host callback running on this thread, if any."""
  placement = site.running[0]
  if placement is not None:
    return placement
  found = host_local(RUNNING_LOCAL)
  return None if found is None else found[0]


def threaded() -> bool:
  """Whether the running host callback went through the token-threading pass
  (read by host sides that set ``site``: ``print``/``log``)."""
  return site.running[1]


# --- lowering side -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Where:
  """Where a callback lowered in some context runs (see :func:`at_lowering`).

  ``fixed``: the placement of a callback that runs once (None when per
  device). ``table``: per-device placements indexed by partition id (the
  extra last operand), or None.
  """
  fixed: Placement | None
  table: tuple | None


def at_lowering(ctx, operands: list, avals_in: list):
  """Where the callback lowered in ``ctx`` runs.

  Returns ``(where, operands, avals_in)``: with the partition id appended to
  the operands (and its aval to ``avals_in``) in the per-device case.
  """
  axis_ctx = ctx.module_context.axis_context
  if isinstance(axis_ctx, _compat.SPMDAxisContext):
    table, operands, avals_in = _per_device_table(axis_ctx.mesh, operands,
                                                  avals_in)
    return Where(None, table), operands, avals_in
  device = None
  if isinstance(axis_ctx, _compat.ShardingContext):
    if axis_ctx.device_assignment:
      device = axis_ctx.device_assignment[0]
  placement = (Placement(device.id, None, device.process_index)
               if device is not None
               else Placement(None, None, jax.process_index()))
  return Where(placement, None), operands, avals_in


def _per_device_table(mesh, operands, avals_in):
  from jax.extend.mlir.dialects import stablehlo  # lowering-time only

  sizes = tuple(mesh.axis_sizes)
  try:
    devices = mesh.devices
  except (AttributeError, ValueError):
    # An AbstractMesh (``jax.shard_map`` without ``mesh=`` under
    # ``jax.set_mesh``): no devices known here. Lowered outside a mesh
    # context, JAX itself reports the missing mesh.
    devices = None
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

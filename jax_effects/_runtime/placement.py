"""Where a host callback runs: decided at lowering, read while it runs.

A host callback receives only arrays, so where it runs is decided when it
is lowered, from the lowering's axis context (:func:`at_lowering`): *per
device* inside a fully manual ``shard_map`` (``pmap`` too; the partition id
is passed as one more operand), *once* under automatic partitioning or on
one device (on the first device of the assignment), none eagerly.
``design/placement.md``, "Three placements". While the host function runs,
:func:`current` returns its placement: from :data:`site` (set by the host
functions of ``print``/``log``), else from the innermost host-function frame
on the thread's stack: no cost per run.

*Is this frame ours?* Marked code objects, found by one walk up the stack:
*where does the running host callback run* (:func:`current`) and *what
does a SIGINT interrupt* (``interrupts``) are answered from the thread's
stack: code objects of jax_effects' functions are marked with a *kind*
(:func:`mark`) and :func:`innermost` walks ``f_back`` to the innermost
marked one. Not a flag set per call (as in trio's ``_core/_ki.py``): a
signal lands between any two bytecodes, and a host function runs per
effect. A frame called from C below one of ours has ours as its
``f_back``, so :func:`innermost` also says whether the marked frame *is*
the frame asked about.

Part in the token calling convention: none.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
from types import CodeType, FrameType

import jax
import numpy as np

from jax_effects import _compat
from jax_effects._compat import core as jcore
from jax_effects._runtime import token_value as _token_value


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one run of a host callback happens. ``device_id``: None if
  unknown (an abstract mesh); ``shard_index``: the device's position in a
  per-device computation's mesh (an ``int`` for one axis, else a tuple in
  ``mesh.axis_names`` order), else None."""
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


# --- is this frame ours ---------------------------------------------------

#: A host function XLA calls for an effect (its frame holds its placement).
HOST = "host"
#: A dispatching frame of the call path, from the launch to the storing of
#: the returned token.
DISPATCH = "dispatch"
#: Python called by the FFI entry around a host function (a site's
#: runner): an interrupt raised there would fail the computation in XLA.
ENTRY = "entry"

_kinds: dict[CodeType, str] = {}


def mark(code: CodeType, kind: str) -> None:
  """Marks ``code`` (a function's ``__code__``) as jax_effects' ``kind``."""
  _kinds[code] = kind


def innermost(frame: FrameType | None, kind: str | None = None):
  """``(marked_frame, its_kind, is_top)`` for the innermost frame from
  ``frame`` up that is marked (of ``kind``, if given); ``(None, None,
  False)`` if there is none. ``is_top``: the marked frame is ``frame``
  itself (nothing runs below it)."""
  top = frame
  kinds = _kinds
  while frame is not None:
    found = kinds.get(frame.f_code)
    if found is not None and (kind is None or found == kind):
      return frame, found, frame is top
    frame = frame.f_back
  return None, None, False


def local_of_innermost(kind: str, name: str):
  """The local ``name`` of the innermost ``kind`` frame on the calling
  thread's stack (None: none, or it has no such local)."""
  frame, _, _ = innermost(sys._getframe(1), kind)
  return None if frame is None else frame.f_locals.get(name)


# --- the running callback's placement --------------------------------------

class _Running(threading.local):
  # ``(placement, threaded)`` set by the host functions of ``print``/``log``
  # (and any nested in one); ``threaded``: it went through the
  # token-threading pass. One attribute: set and restored with one store.
  running: tuple = (None, False)


#: The ``(placement, threaded)`` of the running host callback, where set.
site = _Running()

#: The local (or free) variable in which a host function's frame holds its
#: ``(placement, threaded)``, read by a rare query (:func:`current`).
RUNNING_LOCAL = "running"


def register_host_code(code) -> None:
  """Marks the code of a host function (:data:`HOST`); refuses code
  without a :data:`RUNNING_LOCAL` (which would hide every placement)."""
  if RUNNING_LOCAL not in (*code.co_varnames, *code.co_freevars, *code.co_cellvars):
    raise AssertionError(
        f"jax_effects: host function {code.co_name} ({code.co_filename}:"
        f"{code.co_firstlineno}) has no variable {RUNNING_LOCAL!r} for "
        f"placement() to read")
  mark(code, HOST)


def running(placement: Placement | None, threaded: bool) -> tuple:
  """The ``(placement, threaded)`` of a host callback (built at lowering)."""
  return (placement, threaded)


def carrier_slot() -> int:
  """The slot of the thread that dispatched the running execution (its
  carrier's, ``token_value``; 0 outside one)."""
  carrier = local_of_innermost(HOST, "carrier")
  return 0 if carrier is None else _token_value.slot_of(int(np.max(carrier)))


def current() -> Placement | None:
  """The placement of the host callback running on this thread, if any."""
  placement = site.running[0]
  if placement is not None:
    return placement
  found = local_of_innermost(HOST, RUNNING_LOCAL)
  return None if found is None else found[0]


def python_thread(thread: threading.Thread | None = None) -> bool:
  """Whether ``thread`` (default: the calling thread, looked up without
  making a ``threading._DummyThread`` for it) was started by Python, not by
  XLA, whose threads run the host callbacks of compiled code. A Python
  thread runs one only inline in a launch of its own, or eagerly
  (``design/errors.md``, "Several threads launching ...")."""
  if thread is None:
    thread = threading._active.get(threading.get_ident())
  return thread is not None and not isinstance(thread, threading._DummyThread)


# --- lowering side ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Where:
  """Where a callback lowered in some context runs: ``fixed``, once (None
  when per device); ``table``, per-device placements by partition id."""
  fixed: Placement | None
  table: tuple | None


def at_lowering(ctx, operands: list, avals_in: list):
  """``(where, operands, avals_in)`` of the callback lowered in ``ctx``:
  the partition id appended to the operands in the per-device case."""
  axis_ctx = ctx.module_context.axis_context
  if isinstance(axis_ctx, _compat.SPMDAxisContext):
    table, operands, avals_in = _per_device_table(axis_ctx.mesh, operands, avals_in)
    return Where(None, table), operands, avals_in
  placement = Placement(None, None, jax.process_index())
  if isinstance(axis_ctx, _compat.ShardingContext) and axis_ctx.device_assignment:
    device = axis_ctx.device_assignment[0]
    placement = Placement(device.id, None, device.process_index)
  return Where(placement, None), operands, avals_in


def _per_device_table(mesh, operands, avals_in):
  sizes = tuple(mesh.axis_sizes)
  try:
    flat = list(np.asarray(mesh.devices).flat)
  except (AttributeError, ValueError):
    # An AbstractMesh (``jax.shard_map`` without ``mesh=`` under
    # ``jax.set_mesh``): no devices known here.
    flat = None
  table = []
  for pid in range(int(np.prod(sizes, dtype=np.int64))):
    index = tuple(int(i) for i in np.unravel_index(pid, sizes))
    shard = index[0] if len(index) == 1 else index
    if flat is None:
      table.append(Placement(None, shard, jax.process_index()))
    else:
      table.append(Placement(flat[pid].id, shard, flat[pid].process_index))
  pid_value = jcore.hlo.partition_id()
  pid_aval = jax.core.ShapedArray((), np.uint32)
  return tuple(table), [*operands, pid_value], [*avals_in, pid_aval]

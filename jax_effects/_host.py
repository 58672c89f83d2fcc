"""Host functions: what XLA calls when a side effect runs.

:class:`HostCallback` is the parameter of the side-effect primitives: the
user-facing function's host side (``fn``), built once, complete, when the
effect is bound, and never mutated (JAX compares and hashes primitive
parameters; this one by identity). :class:`BatchedHost` is its ``fn`` under
``vmap`` (once per batch element, in batch order) and :func:`masked` skips
the elements of a vmapped ``while_loop`` that are no longer iterating.

:func:`host_function` builds the one Python function XLA calls for a
lowered effect. Its operands are, in order: ``passthrough`` values it
returns as received (for a threaded effect the ``int32`` carrier, which
holds the dispatching thread's slot and the ``_errors.FAILED`` bit, and
orders the call after the chain's previous effect; the compiler token stays
in the program, see ``_primitives._threaded_lowering``), the effect's
operands, and, for a per-device callback, the partition id. While the user's function runs,
``_placement.site`` says where. A user exception never fails the
computation: it is deferred to the dispatching thread, which raises it once
(see ``design/errors.md``), and the results are zeros.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import types
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jax_effects import _errors
from jax_effects import _placement
from jax_effects import _runtime_tokens
from jax_effects import _sequence


@dataclasses.dataclass(frozen=True, eq=False)
class HostCallback:
  """A host function run by a side-effect primitive (a primitive parameter).

  ``fn`` takes the flat operands as NumPy arrays; its results must match
  ``result_avals`` (checked by :func:`check_results`, with a message naming
  ``description``). ``traced_in_branch``: bound directly in a
  ``cond``/``switch`` branch; ``traced_in_while_cond``: bound directly in a
  ``while_loop``'s ``cond_fun``. ``eager`` (optional, result-free effects
  only): run instead of ``fn`` outside any trace, with the operands as bound
  (``jax.Array`` and Python values, not NumPy arrays), so ``print``/``log``
  format eager values as ``jax.debug.print`` does. ``reads_placement``:
  ``fn`` calls ``_placement.current()`` on every run (``print``/``log``), so
  the host function sets ``_placement.site`` for it. ``edges``: an
  ``_edges.Edges`` or None for each of the last ``len(edges)`` operands
  (those the front end bound): ``fn`` receives that operand cut to its
  edges (the lowering or the eager impl cuts it). Compared and hashed by
  identity.
  """
  fn: Callable[..., Sequence[Any]]
  description: str
  result_avals: tuple = ()
  traced_in_branch: bool = False
  traced_in_while_cond: bool = False
  eager: Callable[..., None] | None = None
  reads_placement: bool = False
  edges: tuple = ()

  def __repr__(self):
    return f"<host callback {self.description}>"

  def __call__(self, *args):
    """Runs ``fn`` and checks its results (eagerly, and per batch element)."""
    results = self.fn(*args)
    avals = self.result_avals
    if not avals:
      return ()
    return check_results(self.description, results, avals)


def check_results(description, results, avals):
  if not isinstance(results, (tuple, list)) or len(results) != len(avals):
    n = len(results) if isinstance(results, (tuple, list)) else "a non-sequence"
    raise TypeError(
        f"{description} returned {n} results; expected {len(avals)} "
        f"(shapes/dtypes {[str(a.str_short()) for a in avals]})")
  out = []
  for i, (r, aval) in enumerate(zip(results, avals)):
    if type(r) is not np.ndarray:
      if (isinstance(r, (bool, int, float, complex, list, tuple))
          and not isinstance(r, np.generic)):
        # Python scalars and lists take the declared dtype, like literals
        # (not NumPy scalars, even those that are Python floats or complexes:
        # np.float64 has its own dtype).
        r = np.asarray(r, dtype=aval.dtype)
      else:
        # NumPy scalars, jax.Array, anything with __array__ (whatever its
        # signature: asarray without a dtype calls it without one).
        r = np.asarray(r)
    if r.shape != aval.shape or r.dtype != aval.dtype:
      raise TypeError(
          f"{description} result #{i} has shape {r.shape} and dtype {r.dtype}; "
          f"expected shape {aval.shape} and dtype {aval.dtype}")
    out.append(r)
  return tuple(out)




# --- the function XLA calls ------------------------------------------------------------

def host_function(host_callback: HostCallback, where: _placement.Where, *,
                  passthrough: int, threaded: bool, avals_out: Sequence,
                  entry: bool = False):
  """The function XLA calls for one lowered effect (see the module docstring).

  ``where``: from ``_placement.at_lowering``. ``threaded``: lowered from
  ``threaded_effect_p`` (the carrier, the last passthrough operand, holds the
  dispatching thread's slot and the ``FAILED`` bit). ``avals_out``: of all
  results, passthrough ones first. ``entry``: the carrier is the chain's
  runtime token (``threaded_effect_p``'s parameter): a ``FAILED`` bit there
  is an earlier execution's, cleared instead of skipping the effect.

  It never fails its computation (``design/errors.md``): a user exception is
  deferred to the dispatching thread (``_runtime_tokens.defer_error``) and
  the results are zeros (the passthrough ones as received, the carrier with
  ``FAILED`` set, so the later effects of the chain are skipped).

  Specialised when lowered: the common case (a threaded effect with a scalar
  carrier, running once at a fixed placement) gets
  :func:`_threaded_once`, which does only what that case needs.
  """
  if threaded and passthrough == 1 and avals_out[0].shape == ():
    if where.table is None:
      return _threaded_once(host_callback, where.fixed, avals_out, entry)
    return _threaded_per_device(host_callback, where.table, avals_out, entry)
  return _general(host_callback, where, passthrough, threaded, avals_out,
                  entry)


def _setting_site(fn, running):
  """``fn`` with ``_placement.site`` set to ``running`` while it runs: the
  host side of an effect that reads its placement on every run
  (``HostCallback.reads_placement``: ``print``, ``log``; they clear it again
  around the user code they call, see ``_output``)."""
  site = _placement.site

  def placed(*args):
    prev = site.running
    site.running = running
    try:
      return fn(*args)
    finally:
      site.running = prev
  return placed


def _behind(run, running, result_avals, skipped):
  """``behind(slot, carrier, args)``: an effect of a thread with jobs waiting
  (``_sequence``) runs after them: as a job of its own (with its placement
  set for it), or, if it has results, once they have run."""
  FAILED = int(_errors.FAILED)
  site = _placement.site

  def behind(slot, carrier, args):
    if result_avals:
      _sequence.wait_idle((slot,))
      return run(carrier, args)

    def job() -> bool:
      prev = site.running
      site.running = running
      try:
        return bool(int(run(carrier, args)[0]) & FAILED)
      finally:
        site.running = prev

    _sequence.submit(slot, _sequence.Job(job))
    return (carrier, *skipped)

  return behind


# The host functions below set nothing per run for ``_placement.current()``:
# it finds the innermost host frame on the stack and reads its ``running``
# (a keyword-only default here, never passed: XLA passes operands
# positionally), see ``_placement``. ``index(carrier)`` is the fastest read of
# a 0-d integer array.

def _threaded_once(host_callback: HostCallback, placement, avals_out,
                   entry: bool):
  """``host(carrier, *operands)`` of a threaded effect that runs once."""
  running = _placement.running(placement, True)
  fn = host_callback.fn
  if host_callback.reads_placement:
    fn = _setting_site(fn, running)
  what = host_callback.description
  result_avals = host_callback.result_avals
  n_operands = len(avals_out) - 1 - len(result_avals)
  FAILED, SLOT_MASK = int(_errors.FAILED), int(_errors.SLOT_MASK)
  skipped_results = tuple(np.zeros(a.shape, a.dtype) for a in avals_out[1:])
  index = operator.index

  def failed(carrier, exc):
    _runtime_tokens.defer_error(exc, index(carrier) & SLOT_MASK, inline=True)
    return (np.bitwise_or(carrier, _errors.FAILED), *skipped_results)

  def run(carrier, args):
    if index(carrier) & FAILED:
      if not entry:   # an earlier effect of the chain failed
        return (carrier, *skipped_results)
      carrier = np.bitwise_and(carrier, _errors.SLOT_MASK)   # an earlier execution's
    try:
      results = fn(*args)
      if result_avals:
        return (carrier, *check_results(what, results, result_avals))
    except BaseException as exc:  # noqa: BLE001 - reported by the thread
      return failed(carrier, exc)
    return (carrier,)

  behind = _behind(run, running, result_avals, skipped_results)
  queues, waits = _sequence.queues, _sequence.waits

  if n_operands == 1 and not result_avals:
    # The common case (one operand, no result): no packing, no other frame.
    def host(carrier, x, *, running=running):
      if queues and waits(index(carrier) & SLOT_MASK):
        return behind(index(carrier) & SLOT_MASK, carrier, (x,))
      if index(carrier) & FAILED:
        return run(carrier, (x,))
      try:
        fn(x)
      except BaseException as exc:  # noqa: BLE001 - reported by the thread
        return failed(carrier, exc)
      return (carrier,)
  else:
    def host(carrier, *args, running=running):
      if queues and waits(index(carrier) & SLOT_MASK):
        return behind(index(carrier) & SLOT_MASK, carrier, args)
      return run(carrier, args)
  return host


def _threaded_per_device(host_callback: HostCallback, table, avals_out,
                         entry: bool):
  """``host(carrier, *operands, partition_id)`` of a threaded effect that
  runs on every device (in a manual ``shard_map``): :func:`_threaded_once`,
  placed by the partition id through ``table``."""
  placed = tuple(_placement.running(p, True) for p in table)
  fn = host_callback.fn
  fns = ((tuple(_setting_site(fn, r) for r in placed)
          if host_callback.reads_placement else (fn,) * len(placed)))
  what = host_callback.description
  result_avals = host_callback.result_avals
  FAILED, SLOT_MASK = int(_errors.FAILED), int(_errors.SLOT_MASK)
  skipped_results = tuple(np.zeros(a.shape, a.dtype) for a in avals_out[1:])
  index = operator.index

  def host(carrier, *args):
    if queues and waits(index(carrier) & SLOT_MASK):
      behind = _behind(lambda c, a: host(c, *a), placed[index(args[-1])],
                       result_avals, skipped_results)
      return behind(index(carrier) & SLOT_MASK, carrier, args)
    if index(carrier) & FAILED:
      if not entry:   # an earlier effect of the chain failed
        return (carrier, *skipped_results)
      carrier = np.bitwise_and(carrier, _errors.SLOT_MASK)   # stale
    pid = index(args[-1])
    running = placed[pid]   # (read by _placement.current())
    try:
      results = fns[pid](*args[:-1])
      if result_avals:
        return (carrier, *check_results(what, results, result_avals))
    except BaseException as exc:  # noqa: BLE001 - reported by the thread
      _runtime_tokens.defer_error(exc, index(carrier) & SLOT_MASK, inline=True)
      return (np.bitwise_or(carrier, _errors.FAILED), *skipped_results)
    del running
    return (carrier,)

  queues, waits = _sequence.queues, _sequence.waits
  return host


def _general(host_callback: HostCallback, where: _placement.Where,
             passthrough: int, threaded: bool, avals_out: Sequence,
             entry: bool):
  """Every other lowered effect: per device (the partition id is the last
  operand), not threaded (plain ``jax.jit``: no carrier), or with a
  non-scalar carrier."""
  fn = host_callback.fn
  what = host_callback.description
  result_avals = host_callback.result_avals
  reads_placement = host_callback.reads_placement
  fixed = _placement.running(where.fixed, threaded)
  table = (None if where.table is None
           else tuple(_placement.running(p, threaded) for p in where.table))
  site = _placement.site
  carrier_at = passthrough - 1 if threaded and passthrough else None
  FAILED, SLOT_MASK = _errors.FAILED, _errors.SLOT_MASK

  def zeros(args, carrier):
    out = [*args[:passthrough],
           *(np.zeros(a.shape, a.dtype) for a in avals_out[passthrough:])]
    if carrier_at is not None:
      out[carrier_at] = carrier
    return tuple(out)

  def host(*args):
    if queues and carrier_at is not None:
      c = args[carrier_at]
      slot = int(c if not c.ndim else c.max()) & SLOT_MASK
      if waits(slot):
        if not result_avals:
          _sequence.submit(slot, _sequence.Job(functools.partial(
              job, args, fixed if table is None else table[int(args[-1])])))
          return zeros(args, c)
        _sequence.wait_idle((slot,))
    if table is None:
      running = fixed
    else:
      running = table[int(args[-1])]
      args = args[:-1]
    if carrier_at is not None:
      # The carrier holds the dispatching thread's slot, and FAILED once an
      # earlier effect of its chain failed: as after a raise in Python, the
      # later effects of the chain do not run.
      carrier = args[carrier_at]
      value = int(carrier) if not carrier.ndim else int(carrier.max())
      if value & FAILED:
        if not entry:
          return zeros(args, carrier)
        carrier = np.bitwise_and(carrier, SLOT_MASK)   # an earlier execution's
        args = (*args[:carrier_at], carrier, *args[carrier_at + 1:])
      slot = int(value & SLOT_MASK)
    else:   # plain jax.jit: run on the dispatching thread if on one device
      slot = 0 if running[0].per_device else _runtime_tokens.current_slot()
      if slot and _errors.has_deferred(slot):
        return zeros(args, None)   # after an unreported failure: skipped
    if reads_placement:   # (else _placement.current() finds ``running`` here)
      prev = site.running
      site.running = running
    try:
      results = fn(*args[passthrough:])
      results = (check_results(what, results, result_avals) if result_avals
                 else ())
    except BaseException as exc:  # noqa: BLE001 - reported by the thread
      _runtime_tokens.defer_error(exc, slot, inline=carrier_at is not None)
      return zeros(args, None if carrier_at is None
                   else np.bitwise_or(carrier, FAILED))
    finally:
      if reads_placement:
        site.running = prev
    return (*args[:passthrough], *results)

  queues, waits = _sequence.queues, _sequence.waits

  def job(args, place) -> bool:
    # (an effect behind a thread's waiting jobs, see _behind)
    prev = site.running
    site.running = place
    try:
      out = host(*args)
    finally:
      site.running = prev
    return bool(int(np.max(out[carrier_at])) & int(FAILED))

  return host


for _factory in (_threaded_once, _threaded_per_device, _general):
  for _code in _factory.__code__.co_consts:
    if isinstance(_code, types.CodeType) and _code.co_name == "host":
      _placement.register_host_code(_code)


# --- vmap ------------------------------------------------------------------------------

class BatchedHost:
  """Host function of a vmapped effect: the element callback per element.

  ``levels[i][j]`` says whether operand ``i`` has the batch axis of vmap level
  ``j`` (levels outermost first); its leading axes are the levels it has, in
  order. ``live`` (optional, a bool array of ``batch_shape``) skips elements:
  their results are zeros (JAX discards them).
  """
  __slots__ = ("element", "batch_shape", "levels", "element_avals")

  def __init__(self, element: HostCallback, batch_shape: tuple,
               levels: tuple, element_avals: tuple):
    self.element = element
    self.batch_shape = batch_shape
    self.levels = levels
    self.element_avals = element_avals

  def __call__(self, *args, live=None):
    shape = self.batch_shape
    outs = [np.zeros(shape + a.shape, a.dtype) for a in self.element_avals]
    for idx in np.ndindex(*shape):
      if live is not None and not live[idx]:
        continue
      el_args = []
      for x, lv in zip(args, self.levels):
        sub = tuple(i for i, has in zip(idx, lv) if has)
        el_args.append(np.asarray(x[sub]) if sub else x)
      results = self.element(*el_args)
      for out, r in zip(outs, results):
        out[idx] = r
    return tuple(outs)



class MaskedHost:
  """Host function of an effect in a ``cond`` branch that vmap batched the
  predicate of: its first operand says whether this element took the branch.
  Elements that did not take it run nothing; their results are zeros (the
  ``select`` after the branches discards them)."""
  __slots__ = ("inner", "result_avals")

  def __init__(self, inner, result_avals: tuple):
    self.inner = inner
    self.result_avals = result_avals

  def __call__(self, taken, *args):
    if np.asarray(taken):
      return self.inner(*args)
    return tuple(np.zeros(a.shape, a.dtype) for a in self.result_avals)


# --- liveness under vmap-of-while -------------------------------------------------------

def _alignments(mask_shape: tuple, batch_shape: tuple) -> list[tuple]:
  """Increasing positions p with batch_shape[p[i]] == mask_shape[i]."""
  return [p for p in itertools.combinations(range(len(batch_shape)),
                                            len(mask_shape))
          if all(batch_shape[j] == n for j, n in zip(p, mask_shape))]


def masked(host_callback: HostCallback, masks: Sequence):
  """``(host_callback', extra_operands)``: skip elements where a mask is False.

  ``masks`` are bool arrays (traced values), each the batched predicate of an
  enclosing vmapped ``while_loop``: its axes are some of the effect's vmap
  levels, in order (outermost first).
  """
  fn = host_callback.fn
  what = host_callback.description
  if not isinstance(fn, BatchedHost):
    raise AssertionError(
        f"{what}: inside a vmapped while_loop but not batched")
  shape = fn.batch_shape
  reshapes = []
  for m in masks:
    mshape = tuple(jnp.shape(m))
    found = _alignments(mshape, shape)
    if len(found) != 1:
      raise NotImplementedError(
          f"{what} is inside a jax.lax.while_loop whose predicate jax.vmap "
          f"batched over axes of sizes {mshape}, but the effect is batched "
          f"over vmap axes of sizes {shape}, so which element is still "
          f"iterating is ambiguous. Give the vmapped axes different sizes, or "
          f"move the effect out of the loop.")
    (pos,) = found
    reshapes.append(tuple(shape[j] if j in pos else 1 for j in range(len(shape))))
  k = len(masks)

  def run(*args):
    live = np.ones(shape, dtype=bool)
    for m, rs in zip(args[:k], reshapes):
      live &= np.reshape(np.asarray(m, dtype=bool), rs)
    return fn(*args[k:], live=live)

  return (dataclasses.replace(host_callback, fn=run),
          [jnp.asarray(m, dtype=bool) for m in masks])



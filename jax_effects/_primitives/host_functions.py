"""Host functions: what XLA calls when a side effect runs.

:func:`host_function` builds the Python function XLA calls for a lowered
effect. Part in the token calling convention: its first operands are
``passthrough`` values returned as received (for a threaded effect the
``int32`` carrier, holding the dispatching thread's slot and the ``FAILED``
bit), then the effect's operands and, per device, the partition id. A user
exception is deferred to the dispatching thread and the results are zeros
(:class:`FailedBit`, ``design/errors.md``); an interrupt of the
dispatching thread's call is raised into XLA.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import types
from typing import Sequence

import numpy as np

from jax_effects._primitives import host_callback as _host_callback
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import host_jobs as _host_jobs
from jax_effects._runtime import interrupts as _interrupts
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import token_value as _token_value


def host_function(host_callback: _host_callback.HostCallback, where: _placement.Where, *,
                  passthrough: int, threaded: bool, avals_out: Sequence,
                  entry: bool = False, operands: int | None = None):
  """The function XLA calls for one lowered effect (module docstring);
  ``threaded``: the carrier is the last passthrough operand."""
  if threaded and passthrough == 1 and avals_out[0].shape == ():
    return _threaded(host_callback, where, avals_out, entry, operands)
  return _general(host_callback, where, passthrough, threaded, avals_out, entry)


#: The attribute of a host callback's ``fn`` that is ``placed(running)``:
#: ``fn`` as it runs with ``placement.site.running`` set to ``running``,
#: reading no site (``print``'s line: the site's stores and loads were a
#: tenth of a line's cost in a compiled loop, issue 48). Only that very
#: function has it (a vmap form wrapping ``fn`` does not).
PLACED = "placed"


def _setting_site(fn, running):
  """``fn`` with ``_runtime.placement.site`` set to ``running``."""
  site = _placement.site

  def placed(*args):
    prev = site.running
    site.running = running
    try:
      return fn(*args)
    finally:
      site.running = prev
  return placed


def _waiting(value: int, chain):
  """The slow path's gate: raises ``KeyboardInterrupt`` for an interrupted
  slot; ``(slot, seq)`` if the effect must wait behind its chain's jobs."""
  slot = _token_value.slot_of(value)
  interrupted = _interrupts.slots
  if interrupted and slot in interrupted:
    raise KeyboardInterrupt
  seq = _token_value.seq_of(value)
  if _host_jobs.queues and _host_jobs.waits(slot, chain, seq):
    return slot, seq
  return None


def _behind(run, running, result_avals, skipped, chain):
  """``behind(slot, seq, carrier, args)``: the effect run after its
  thread's waiting jobs (``_runtime.host_jobs``)."""
  FAILED = int(_errors.FAILED)
  placed = _setting_site(run, running)

  def behind(slot, seq, carrier, args):
    if result_avals:
      if not _host_jobs.wait_turn(slot, chain, seq):
        # (its execution failed as a whole meanwhile: skipped)
        return (np.bitwise_or(carrier, _errors.FAILED), *skipped)
      return run(carrier, args)

    def job() -> bool:
      return bool(int(np.max(placed(carrier, args)[0])) & FAILED)

    if not _host_jobs.submit(slot, chain, seq, _host_jobs.Job(job)):
      # (its execution failed: skipped, and so are its later effects here)
      return (np.bitwise_or(carrier, _errors.FAILED), *skipped)
    return (carrier, *skipped)

  return behind


@dataclasses.dataclass(eq=False, repr=False, slots=True)
class FailedBit:
  """The ``FAILED``-bit rule of a threaded effect (``design/errors.md``);
  host functions test the bit themselves (the hot path)."""
  FAILED = int(_errors.FAILED)
  SLOT_MASK = int(_token_value.SLOT_MASK)
  entry: bool
  cleanup: bool

  def on_failed(self, carrier):
    """None (skip this effect), or the carrier to run with."""
    if self.cleanup:
      return carrier
    if not self.entry:
      return None
    return np.bitwise_and(carrier, _token_value.ID_MASK)

  @staticmethod
  def fail(carrier, exc: BaseException, slot: int):
    """Defers ``exc`` to thread ``slot``; returns the carrier with
    ``FAILED`` set. An interrupt of ``slot``'s call is raised instead."""
    if _interrupts.slots and slot in _interrupts.slots:
      raise exc
    _errors.defer(exc, slot, inline=True)
    return np.bitwise_or(carrier, _errors.FAILED)


# ``_runtime.placement.current()`` reads ``running`` in the innermost host
# frame (a keyword-only default, never passed); ``index(carrier)`` is the
# fastest read of a 0-d integer array.
def _threaded(host_callback: _host_callback.HostCallback, where: _placement.Where,
              avals_out, entry: bool, n_operands: int | None):
  """``host(carrier, *operands)`` of a threaded effect that runs once, or
  ``host(carrier, *operands, partition_id)`` of one run per device, placed
  by the partition id through ``where.table``."""
  fn = bare = host_callback.fn
  reads_placement = host_callback.reads_placement
  what = host_callback.description
  result_avals = host_callback.result_avals
  rule = FailedBit(entry, host_callback.cleanup)
  FAILED, SLOT_MASK = rule.FAILED, rule.SLOT_MASK
  skipped_results = tuple(np.zeros(a.shape, a.dtype) for a in avals_out[1:])
  index = operator.index
  chain = host_callback.chain
  queues, interrupted = _host_jobs.queues, _interrupts.slots
  if where.table is not None:
    places = tuple(_placement.running(p, True) for p in where.table)
    fns = (tuple(_setting_site(fn, r) for r in places)
           if reads_placement else (fn,) * len(places))

    def host(carrier, *args):
      if queues or interrupted:
        at = _waiting(index(carrier), chain)
        if at is not None:
          behind = _behind(lambda c, a: host(c, *a), places[index(args[-1])],
                           result_avals, skipped_results, chain)
          return behind(*at, carrier, args)
      if index(carrier) & FAILED:
        received, carrier = carrier, rule.on_failed(carrier)
        if carrier is None:
          return (received, *skipped_results)
      pid = index(args[-1])
      running = places[pid]   # (read by _runtime.placement.current())
      try:
        results = fns[pid](*args[:-1])
        if result_avals:
          return (carrier, *_host_callback.check_results(what, results, result_avals))
      except BaseException as exc:  # noqa: BLE001 - reported by the thread
        return (rule.fail(carrier, exc, index(carrier) & SLOT_MASK), *skipped_results)
      del running
      return (carrier,)

    return host

  running = _placement.running(where.fixed, True)
  if reads_placement:
    fn = _setting_site(fn, running)

  def failed(carrier, exc):
    return (rule.fail(carrier, exc, index(carrier) & SLOT_MASK), *skipped_results)

  def run(carrier, args):
    if index(carrier) & FAILED:
      received, carrier = carrier, rule.on_failed(carrier)
      if carrier is None:
        return (received, *skipped_results)
    try:
      results = fn(*args)
      if result_avals:
        return (carrier, *_host_callback.check_results(what, results, result_avals))
    except BaseException as exc:  # noqa: BLE001 - reported by the thread
      return failed(carrier, exc)
    return (carrier,)

  behind = _behind(run, running, result_avals, skipped_results, chain)

  def slow(carrier, args):
    # Jobs wait somewhere, or some thread's call is interrupted.
    at = _waiting(index(carrier), chain)
    if at is not None:
      return behind(*at, carrier, args)
    return run(carrier, args)

  placed = (getattr(bare, PLACED, None) if reads_placement else None)
  if n_operands == 1 and not result_avals and (
      placed is not None or not reads_placement):
    # The common case (one operand, no result): no packing, no other frame;
    # a print's placement given to it, no site set.
    call = fn if placed is None else placed(running)

    def host(carrier, x, *, running=running):
      if queues or interrupted:
        return slow(carrier, (x,))
      if index(carrier) & FAILED:
        return run(carrier, (x,))
      try:
        call(x)
      except BaseException as exc:  # noqa: BLE001 - reported by the thread
        return failed(carrier, exc)
      return (carrier,)
  elif n_operands == 1 and not result_avals:
    # The common case of log: _setting_site in this frame (a line in a
    # compiled loop pays for every frame, issue 48).
    site = _placement.site

    def host(carrier, x, *, running=running):
      if queues or interrupted:
        return slow(carrier, (x,))
      if index(carrier) & FAILED:
        return run(carrier, (x,))
      prev = site.running
      site.running = running
      try:
        bare(x)
      except BaseException as exc:  # noqa: BLE001 - reported by the thread
        site.running = prev
        return failed(carrier, exc)
      site.running = prev
      return (carrier,)
  else:
    def host(carrier, *args, running=running):
      if queues or interrupted:
        return slow(carrier, args)
      return run(carrier, args)
  return host


def _general(host_callback: _host_callback.HostCallback, where: _placement.Where,
             passthrough: int, threaded: bool, avals_out: Sequence,
             entry: bool):
  """Every other lowered effect: per device, not threaded (plain
  ``jax.jit``: no carrier), or with a non-scalar carrier."""
  fn = host_callback.fn
  what = host_callback.description
  result_avals = host_callback.result_avals
  reads_placement = host_callback.reads_placement
  fixed = _placement.running(where.fixed, threaded)
  table = (None if where.table is None
           else tuple(_placement.running(p, threaded) for p in where.table))
  site = _placement.site
  carrier_at = passthrough - 1 if threaded and passthrough else None
  rule = FailedBit(entry, host_callback.cleanup)
  chain = host_callback.chain

  def zeros(args, carrier):
    out = [*args[:passthrough],
           *(np.zeros(a.shape, a.dtype) for a in avals_out[passthrough:])]
    if carrier_at is not None:
      out[carrier_at] = carrier
    return tuple(out)

  def host(*args):
    if (queues or interrupted) and carrier_at is not None:
      c = args[carrier_at]
      at = _waiting(int(np.max(c)), chain)
      if at is not None:
        slot, seq = at
        # (False from either: its execution failed: skipped)
        if not result_avals:
          if _host_jobs.submit(slot, chain, seq, _host_jobs.Job(
              functools.partial(job, args, fixed if table is None
                                else table[int(args[-1])]))):
            return zeros(args, c)
          return zeros(args, np.bitwise_or(c, _errors.FAILED))
        if not _host_jobs.wait_turn(slot, chain, seq):
          return zeros(args, np.bitwise_or(c, _errors.FAILED))
    if table is None:
      running = fixed
    else:
      running = table[int(args[-1])]
      args = args[:-1]
    if carrier_at is not None:
      carrier = args[carrier_at]
      value = int(np.max(carrier))
      if value & rule.FAILED:
        received, carrier = carrier, rule.on_failed(carrier)
        if carrier is None:
          return zeros(args, received)
        args = (*args[:carrier_at], carrier, *args[carrier_at + 1:])
      slot = value & rule.SLOT_MASK
    else:   # plain jax.jit: run on the dispatching thread if on one device
      slot = 0 if running[0].per_device else _errors.plain_jit_slot()
    if reads_placement:   # (else _placement.current() finds ``running`` here)
      prev = site.running
      site.running = running
    try:
      results = fn(*args[passthrough:])
      results = (_host_callback.check_results(what, results, result_avals) if result_avals
                 else ())
    except BaseException as exc:  # noqa: BLE001 - reported by the thread
      if carrier_at is None:   # plain jax.jit: no carrier, no chain to skip
        _errors.defer(exc, slot)
        return zeros(args, None)
      return zeros(args, rule.fail(carrier, exc, slot))
    finally:
      if reads_placement:
        site.running = prev
    return (*args[:passthrough], *results)

  queues, interrupted = _host_jobs.queues, _interrupts.slots

  def job(args, place) -> bool:   # (see _behind)
    out = _setting_site(host, place)(*args)
    return bool(int(np.max(out[carrier_at])) & rule.FAILED)

  return host


for _factory in (_threaded, _general):
  for _code in _factory.__code__.co_consts:
    if isinstance(_code, types.CodeType) and _code.co_name == "host":
      _placement.register_host_code(_code)

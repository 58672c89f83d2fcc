"""Batched effects: what ``jax_effects.batched`` asks for, and the flush.

A ``print``/``log`` bound inside ``jax_effects.batched(k, max_bytes)``
(:func:`requesting`) is *offered* for batching (:func:`offer`): the pass
may stage it in a loop (``_pass/staging``) instead of calling the host per
step. :class:`Flush` is the host function of one flush: it gets a loop's
staging buffer (the fill count, each row's effect and the effects'
operands, ``K`` rows each) and runs each staged row's host function in row
order, so every line is the text and the delivery of the unbatched effect.

Part in the token calling convention: a flush is one threaded effect on
the staged effects' chain (the carrier in and out, as any host call); what
it stages is not on the chain until it is flushed (``design/tokens.md``,
"Batched effects in loops").
"""
from __future__ import annotations

import dataclasses
import threading
import weakref

from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_functions as _host_functions
from jax_effects._runtime import placement as _placement


@dataclasses.dataclass(frozen=True)
class Request:
  """``jax_effects.batched``'s arguments: at most ``k`` rows a flush, at
  most ``max_bytes`` of staging buffer a loop and chain."""
  k: int
  max_bytes: int


class _Requested(threading.local):
  request: Request | None = None


#: The request of the innermost ``batched`` block being traced, per thread
#: (read by ``effect.bind_effect`` before it calls in here).
requested = _Requested()

#: An offered effect (its ``HostCallback.origin``, kept by every form made
#: of it) -> the request in force where it was bound.
_offered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_current(request: Request | None) -> Request | None:
  """Makes ``request`` current; returns the one it replaces."""
  previous, requested.request = requested.request, request
  return previous


def offer(host_callback: _host_callback.HostCallback) -> None:
  """Offers a just-bound effect for batching, where a request is current."""
  request = requested.request
  if request is not None:
    _offered[host_callback.origin] = request


def request_of(host_callback: _host_callback.HostCallback) -> Request | None:
  """The request under which ``host_callback`` (any form of it) was bound
  and may be staged, or None: it is not offered, or it cannot be staged (it
  has results, runs user code, runs once a vmap batch or after a failure,
  or summarizes an operand, whose edges only cross to the host)."""
  request = _offered.get(host_callback.origin)
  if request is None or host_callback.result_avals or (
      host_callback.user_code or host_callback.batch_once
      or host_callback.cleanup or any(e is not None
                                      for e in host_callback.edges)):
    return None
  return request


#: The attribute of an effect's host function that is
#: ``placed_rows(running)``: ``emit_rows(column)``, the function run with
#: its placement given (``host_functions.PLACED``) for each row of a 1-D
#: column of its one operand, in order (``print``'s one-field line: the
#: lines formatted in one frame and written in one write).
PLACED_ROWS = "placed_rows"

#: ``placement.site.running`` where no host function set it.
_NO_SITE = (None, False)


class Flush:
  """The host function of a loop's flush: ``flush(count, ids, *buffers)``
  runs rows ``0 .. count-1`` in order, row ``i`` as effect ``ids[i]``'s host
  function of its operands' row ``i``. ``effects[j]``: effect ``j``'s host
  callback (set as the pass stages it) and its operands' buffer numbers.

  Run with ``placement.site`` set (``reads_placement``). An effect whose
  host function can be given its placement (``host_functions.PLACED``:
  ``print``'s one operand) gets it once a flush and its rows as NumPy
  scalars (the text is the same: ``format`` of a 0-d operand is that of
  its scalar, ``printing._single_text``); the others get each row's
  operands as arrays, as their unbatched host call does."""
  __slots__ = ("effects", "__weakref__")

  def __init__(self):
    self.effects: list = []

  def _emitters(self, running) -> list:
    emitters = []
    for host_callback, columns in self.effects:
      fn = host_callback.fn
      placed = getattr(fn, _host_functions.PLACED, None)
      if placed is not None and len(columns) == 1:
        emitters.append((True, placed(running), columns))
      else:
        emitters.append((False, fn, columns))
    return emitters

  def __call__(self, count, ids, *buffers):
    count = int(count)
    site = _placement.site
    emitters = self._emitters(site.running)
    if len(emitters) == 1:
      by_row, emit, columns = emitters[0]
      column = buffers[columns[0]]
      if by_row and column.ndim == 1:
        rows = getattr(self.effects[0][0].fn, PLACED_ROWS, None)
        if rows is not None:
          # (given its placement: no site, as an unbatched print's)
          running = site.running
          site.running = _NO_SITE
          try:
            rows(running)(column[:count])
          finally:
            site.running = running
          return ()
        for x in column[:count]:
          emit(x)
        return ()
    for i, j in enumerate(ids[:count].tolist()):
      by_row, emit, columns = emitters[j]
      emit(*[buffers[c][i, ...] for c in columns])
    return ()

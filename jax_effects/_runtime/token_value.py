"""What a runtime token's ``int32`` holds: the execution it came from.

Its part of the token calling convention: every runtime token, and every
chain's carrier inside a computation, is an ``int32`` scalar (a vector of
them, one per device, for a ``shard_map`` program) whose bits are

==========  ==========================================================
bits 0-13   the *slot*: the dispatching thread's number
            (``token_store.TokenStore.slot``; 0: unknown)
bits 14-29  the *sequence number* of the execution on this chain
bit 30      ``FAILED``: an earlier effect of this chain in this
            execution failed (``errors``), so the later ones are skipped
==========  ==========================================================

(slot, sequence number) is the *identity* of one execution on one chain,
unique in the process (``threads.base_of``) and the same on every
device (each computation :func:`advance` s a token as the chain enters it),
so a host function knows from its carrier who dispatched it and which
execution it belongs to. Nothing here is state.
"""
from __future__ import annotations

import numpy as np

#: The dtype of runtime tokens and carriers.
TOKEN_DTYPE = np.int32
SLOT_BITS = 14
SEQ_BITS = 16
#: Slots are 1..MAX_SLOT (0: the dispatching thread is unknown).
MAX_SLOT = (1 << SLOT_BITS) - 1
SLOT_MASK = np.int32(MAX_SLOT)
SEQ_SHIFT = SLOT_BITS
SEQ_MASK = (1 << SEQ_BITS) - 1
#: Slot and sequence number: everything but ``FAILED``.
ID_MASK = np.int32((1 << (SLOT_BITS + SEQ_BITS)) - 1)
#: One step of the sequence number.
SEQ_ONE = np.int32(1 << SEQ_SHIFT)
#: Carrier bit: an earlier effect of this chain in this execution failed.
FAILED = np.int32(1 << (SLOT_BITS + SEQ_BITS))


def initial(slot: int):
  """A thread's first token of a chain: its slot, sequence number 0 (the
  first execution advances it to 1)."""
  return TOKEN_DTYPE(slot)


def slot_of(value: int) -> int:
  """The slot in a carrier's value (a Python ``int``)."""
  return value & MAX_SLOT


def seq_of(value: int) -> int:
  """The sequence number in a carrier's value (a Python ``int``)."""
  return (value >> SEQ_SHIFT) & SEQ_MASK


def seq_after(a: int, b: int) -> bool:
  """Whether sequence number ``a`` is later than ``b`` (modulo the wrap:
  at most half the range apart, as serial numbers compare)."""
  d = (a - b) & SEQ_MASK
  return 0 < d < (1 << (SEQ_BITS - 1))


def advance(token):
  """The carrier a chain enters a computation with, from its runtime token
  (traced): the same slot, the next sequence number, no ``FAILED``."""
  # (one carry past the sequence number's bits goes into FAILED's and
  # the sign's, both masked off: the wrap, and FAILED cleared, in two ops)
  return (token + SEQ_ONE) & ID_MASK

"""``jax_effects.batched``: a loop's prints and logs reach the host in
flushes, not one host call a step.

A context manager around code being traced: a ``print``/``log`` bound
inside it is offered for batching (``_primitives/batching``), and a
``scan``, ``fori_loop`` or ``while_loop`` holding it stages its rows on the
device and flushes them to the host every ``K`` rows and at its exit
(``_pass/staging``; ``design/tokens.md``, "Batched effects in loops").
Part in the token calling convention: none of its own (a flush is a host
call on the effects' chain).
"""
from __future__ import annotations

import contextlib
import operator
from typing import Iterator

from jax_effects._primitives import batching as _batching

#: The default staging budget of one loop and chain: 1 MiB.
MAX_BYTES = 1 << 20


def _positive_int(what: str, name: str, value) -> int:
  try:
    n = operator.index(value)
  except TypeError:
    raise TypeError(f"{what}: {name} must be an int, got "
                    f"{type(value).__name__}") from None
  if n < 1:
    raise ValueError(f"{what}: {name} must be at least 1, got {n}")
  return n


@contextlib.contextmanager
def batched(k: int = 128, *, max_bytes: int = MAX_BYTES) -> Iterator[None]:
  """Batches the loops' prints and logs traced inside the block.

  Inside a compiled loop (``lax.scan``, ``fori_loop``, ``while_loop``,
  nested loops, under ``vmap`` and in ``shard_map``), each
  ``jax_effects.print``/``log`` bound in this block writes its operands to
  a staging buffer on the device instead of calling the host; the buffer
  reaches the host in one call every ``k`` rows and when the loop exits,
  and every line is delivered, in order, as the unbatched effect delivers
  it. An effect that is not batched on the same chain (a callback, a
  ``cond`` holding effects, ...) flushes the rows staged before it, so
  program order is kept. A loop's buffer holds at most ``max_bytes`` (its
  rows of operands, 4 bytes a row for the row's effect): ``k`` is reduced
  to fit, and a loop one row of which does not fit is an error at trace
  time.

  The block works where the function is traced (put it inside the jitted
  function; a cached trace is not traced again). Rows staged but not yet
  flushed are lost if the process dies or the computation fails as a whole
  before the flush; a host error in a flush is reported as any effect's,
  and the later rows of that flush are skipped, as later effects are.
  Summarized arrays (larger than NumPy's threshold), effects with results
  and effects inside a ``while_loop`` whose predicate ``vmap`` batched are
  not staged (they run unbatched, in order).
  """
  what = f"jax_effects.batched(k={k!r}, max_bytes={max_bytes!r})"
  request = _batching.Request(_positive_int(what, "k", k),
                              _positive_int(what, "max_bytes", max_bytes))
  previous = _batching.set_current(request)
  try:
    yield
  finally:
    _batching.set_current(previous)

"""``jax_effects.progress``: progress bars for compiled loops.

A bar is three ordered effects of :data:`~jax_effects.DEFAULT`: *open*
(returns the bar's id, an operand of the others), *advance* and *close*;
with ``every=k`` the updates are counted on the device in a ``Counter``
(``_primitives/counter.py``) and a ``lax.cond`` advances once ``k`` are
pending. The host side is ``_runtime/bars.py``. Behaviour under ``vmap``,
``shard_map`` and ``grad``: ``design/transformations.md``.

Part in the token calling convention: that of every effect, plus the
counter's chain, which has no runtime token.
"""
from __future__ import annotations

import math
import types
from typing import Any, Callable, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_effects import _compat
from jax_effects._core import effects as _effects
# (imported for the pass's rule of counter_p)
from jax_effects._pass import token_pass as _token_pass  # noqa: F401
from jax_effects._primitives import counter as _counters
from jax_effects._primitives import effect as _effect
from jax_effects._runtime import bars as _bars

__all__ = ["progress", "Progress"]

_ID_AVAL = jax.core.ShapedArray((), np.int32)


# --- trace side --------------------------------------------------------------

def _manual_axes() -> frozenset:
  """The manual mesh axes around the code being traced."""
  return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def _is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


_INT32_MAX = 2**31 - 1


class _OutOfRange(TypeError, ValueError):
  """A numeric argument out of range (a ``TypeError`` as every refusal)."""


class Progress:
  """A progress bar of a compiled loop (see :func:`progress`)."""

  def __init__(self, total: int | jax.Array | None, *, desc: str | None,
               every: int, file: TextIO | None, per_element: str | None,
               options: dict[str, Any]):
    self._what = (f"jax_effects.progress(desc={desc!r})" if desc is not None
                  else "jax_effects.progress()")
    if total is not None and not _is_traced(total):
      if (isinstance(total, (bool, np.bool_))
          or not np.issubdtype(np.asarray(total).dtype, np.integer)
          or np.ndim(total)):
        raise TypeError(
            f"{self._what}: total must be a non-negative int (or an int32 "
            f"array, or None for no total), got {total!r}")
      if int(total) < 0:
        raise _OutOfRange(
            f"{self._what}: total must be a non-negative int (or None for "
            f"no total), got {total!r}")
      total = int(total)
    elif total is not None and (
        jnp.shape(total) or not jnp.issubdtype(total.dtype, jnp.integer)):
      raise TypeError(
          f"{self._what}: a traced total must be an integer scalar, got "
          f"{jax.typeof(total).str_short()}")
    if desc is not None and not isinstance(desc, str):
      raise TypeError(f"{self._what}: desc must be a str or None, got {desc!r}")
    if (not isinstance(every, (int, np.integer))
        or isinstance(every, (bool, np.bool_))):   # (a Python or NumPy int)
      raise TypeError(
          f"{self._what}: every must be an int >= 1 (one host call per that "
          f"many updates), got {every!r} of type {type(every).__name__}")
    if not 1 <= every <= _INT32_MAX:
      raise _OutOfRange(
          f"{self._what}: every must be an int >= 1 (one host call per that "
          f"many updates) and at most 2**31 - 1 (updates are counted in an "
          f"int32 on the device), got every={every!r}")
    if file is not None and not callable(getattr(file, "write", None)):
      raise TypeError(
          f"{self._what}: file must have a write method (a text stream), "
          f"got {file!r}")
    if per_element is not None:
      if not isinstance(per_element, str):
        raise TypeError(
            f"{self._what}: per_element must be the axis_name of a jax.vmap "
            f"(a str), got {per_element!r}")
      if every != 1:
        raise NotImplementedError(
            f"{self._what}: every={every} with per_element: each element's "
            f"bar is advanced by its own host calls (every=1), as an "
            f"element may stop iterating before the others")
    _bars.check_options(self._what, file, options)
    self._total = total
    self._every = int(every)
    self._per_element = per_element
    self._spec = _bars.BarSpec(None if _is_traced(total) else total, desc,
                               file, dict(options), per_element is not None)
    self._state = "new"
    self._id: Any = None
    self._counter: _counters.Counter | None = None
    self._manual: frozenset = frozenset()
    self._vmaps: frozenset = frozenset()   # ids of the vmaps the bar is in

  def __repr__(self):
    return f"<{self._what} ({self._state})>"

  def _bind(self, fn: Callable, what: str, operands: list,
            result_avals: tuple = (), counts_elements: bool = False,
            cleanup: bool = False) -> list:
    return _effect.bind_effect(
        fn, what, operands, effect=_effects.DEFAULT, ordered=True,
        result_avals=result_avals, reads_placement=True,
        batch_once=self._per_element is None,
        counts_elements=counts_elements, cleanup=cleanup)

  def __enter__(self) -> "Progress":
    if self._state != "new":
      raise RuntimeError(
          f"{self._what} was already entered: a progress bar is used in one "
          f"with-block; call jax_effects.progress(...) again for another bar")
    operands = [self._total] if _is_traced(self._total) else []
    if self._per_element is not None:
      try:
        element = lax.axis_index(self._per_element)
      except NameError:
        raise ValueError(
            f"{self._what}: per_element={self._per_element!r} must name the "
            f"axis of an enclosing jax.vmap (jax.vmap(f, axis_name="
            f"{self._per_element!r})), which draws one bar per element of "
            f"that axis") from None
      operands = [element, *operands]
    (self._id,) = self._bind(self._spec.open, self._what, operands,
                             (_ID_AVAL,))
    self._manual = _manual_axes()
    self._vmaps = frozenset(t for t, _ in _compat.enclosing_vmaps())
    if self._every > 1:
      self._counter = _counters.Counter(self._what)
      _counters.set_count(self._counter, 0)
    self._state = "open"
    return self

  def update(self, n: int | jax.Array = 1) -> None:
    """Advances the bar by ``n`` (default 1) when the computation gets here,
    in program order; with ``every=k`` the host hears of it once ``k``
    updates are pending (and at the end). Inside a ``vmap`` the bar was not
    opened in (as ``jax.lax.map(f, xs, batch_size=k)``'s) it counts ``n``
    per element."""
    what = f"{self._what}.update"
    if self._state != "open":
      raise RuntimeError(
          f"{what}() was called "
          f"{'before entering' if self._state == 'new' else 'after leaving'} "
          f"its with-block: use it inside `with jax_effects.progress(...) as "
          f"bar:`")
    inner = _manual_axes() - self._manual
    if inner:
      raise NotImplementedError(
          f"{what}() is inside a shard_map (or pmap) over the axes "
          f"{sorted(inner)} that the bar was not opened in, where every "
          f"device would count its own updates of the one bar. Open the bar "
          f"inside the shard_map's function: each device then draws its own "
          f"bar, labelled with its device.")
    if isinstance(n, (bool, np.bool_)) or not jnp.issubdtype(
        jnp.result_type(n), jnp.integer) or jnp.ndim(n):
      raise TypeError(f"{what}(n): n must be an integer scalar, got {n!r}")
    # Elements of the vmaps around this update that the bar is not in.
    new_vmaps = [size for t, size in _compat.enclosing_vmaps()
                 if t not in self._vmaps]
    elements = math.prod(new_vmaps)
    if not _is_traced(n):
      if not -_INT32_MAX - 1 <= int(n) * elements <= _INT32_MAX:
        raise _OutOfRange(
            f"{what}(n): n={int(n)}"
            f"{f' for each of {elements} vmapped elements' if new_vmaps else ''}"
            f" is out of range: a bar advances by at most 2**31 - 1 at once "
            f"(an int32 on the device)")
      n = int(n) * elements
    elif new_vmaps:
      n = n * elements
    if self._counter is None:
      self._bind(self._spec.advance, what, [self._id, jnp.asarray(n, np.int32)],
                 counts_elements=bool(new_vmaps))
      return
    counter, every, bar_id = self._counter, self._every, self._id
    pending = _counters.add_count(counter, n, elements=bool(new_vmaps))

    def flush(pending):
      self._bind(self._spec.advance_counted, what,
                 [jnp.stack([bar_id, pending])])
      _counters.set_count(counter, 0)

    if _is_traced(pending):
      lax.cond(pending >= every, flush, lambda pending: None, pending)
    elif int(pending) >= every:   # eager
      flush(pending)

  def __exit__(self, exc_type: type[BaseException] | None,
               exc: BaseException | None,
               tb: types.TracebackType | None) -> None:
    if self._state != "open":
      return
    self._state = "closed"
    if exc_type is not None:
      if not _is_traced(self._id):   # eager: the bar was drawn; close it
        self._spec.close(self._id, 0)
      return
    pending = (jnp.zeros((), np.int32) if self._counter is None
               else _counters.add_count(self._counter, 0))
    # (a cleanup effect: closes the bar after a failed effect too, as tqdm)
    self._bind(self._spec.close, f"{self._what} closing", [self._id, pending],
               cleanup=True)


def progress(total: int | jax.Array | None, *, desc: str | None = None,
             every: int = 1, file: TextIO | None = None,
             per_element: str | None = None, **options: Any) -> Progress:
  """A progress bar for a loop in compiled code: a context manager.

  ::

      with jax_effects.progress(total=steps, desc="train") as bar:
        def step(state, batch):
          bar.update()          # one step done, in program order
          return update(state, batch), None
        state, _ = jax.lax.scan(step, state, batches)

  Entering the block draws the bar at ``0/total``, ``bar.update(n=1)``
  advances it and leaving the block closes it at its final count, each when
  the computation gets there, in program order with ``print``, ``log`` and
  ``callback`` (ordered effects of :data:`~jax_effects.DEFAULT`): one bar
  per execution of the block. Works in ``jax_effects.jit`` code (across
  ``scan``, ``fori_loop``, ``while_loop``, ``cond``, nested bars), eagerly
  and under plain ``jax.jit``.

  ``total``: the number of updates expected (an int, an integer scalar
  computed in the program, or None). ``desc``: the bar's label.
  ``every=k``: updates are counted on the device and the host is called
  once per ``k`` of them (and when the bar closes), so a long loop pays
  almost nothing (in ``jax_effects.jit`` code; elsewhere nothing carries
  the count through the program and it is kept on the host, one call per
  update; ``every`` is at most 2**31 - 1). The drawing itself is
  throttled by time (``mininterval``, 0.1 s, as tqdm). ``file``: where to
  draw (default ``sys.stderr``). ``**options`` are tqdm's keyword
  arguments: they go to ``tqdm`` when it is installed (``pip install
  jax_effects[progress]``; ``tqdm.auto``, a widget in notebooks, when
  ``file`` is None); without it a plain renderer draws
  ``desc:  40%|####      | 4/10 [00:01<00:01, 3.96it/s]`` and the options
  it can (``_runtime/bars.DRAWN``) as tqdm does. An unknown option or
  a value that cannot be drawn is refused here, naming it. Lines printed or
  logged while the bar is drawn are written around it, as ``tqdm.write``.

  Inside ``shard_map``/``pmap`` every device draws its own bar, labelled
  with ``print``'s device prefix (open the bar inside the mapped function).
  Under ``vmap`` one bar counts the batch (the count must be the same for
  every element; an update inside a ``vmap`` the bar was opened outside,
  as in ``jax.lax.map(f, xs, batch_size=k)``, counts per element), unless
  ``per_element`` names the ``vmap``'s
  ``axis_name``: then every element draws its own bar (labelled
  ``[element i]``, advanced by each update the element makes, also in a
  ``while_loop`` whose elements stop at different steps; ``every=1`` only).
  Under ``grad`` updates happen in the forward computation only.
  """
  return Progress(total, desc=desc, every=every, file=file,
                  per_element=per_element, options=options)


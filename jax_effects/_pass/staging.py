"""Staging buffers: a loop's batched effects reach the host in flushes.

Where a loop's body (its nested loops and calls included) holds effects
offered for batching (``jax_effects.batched``, ``_primitives/batching``),
the loop's rule carries one :class:`Stage` per chain of them: ``K`` rows
of each such effect's operands, each row's effect and the fill count. The
pass writes an offered effect's row instead of calling the host, and
flushes (one host call of ``batching.Flush`` with the whole buffer) when
the buffer is full, before anything else on the chain (an effect that is
not staged, a ``cond``, a ``shard_map``, ...: order is kept), and after the
loop (the remainder). A nested loop carries its enclosing loop's stage; a
``cond`` branch, a ``shard_map`` body and a ``while_loop`` with a batched
predicate start with none (their effects run unbatched, or staged by their
own loops). ``K`` is the request's ``k``, reduced so the buffer fits its
``max_bytes``.

Its part of the token calling convention: a flush is a threaded effect on
the chain, in a ``lax.cond`` on the count whose branches take and return
the chain's carrier; the rows wait on the device, off the chain, until
then (``design/tokens.md``, "Batched effects in loops").
"""
from __future__ import annotations

import math
import threading
from typing import Callable

from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects._compat.core import primitives as jprims
from jax_effects._core import effects as _effects
from jax_effects._core import jaxpr_eval as _jaxpr_eval
from jax_effects._primitives import batching as _batching
from jax_effects._primitives import effect as _effect
from jax_effects._primitives import host_callback as _host_callback

#: ``flush_call(key, host_callback, operands, carrier) -> carrier``: binds
#: one host call on chain ``key`` from its carrier (``token_pass``).
FlushCall = Callable


class _Stages(threading.local):
  """The stages in force where the pass is (chain key -> :class:`Stage`)."""

  def __init__(self):
    self.by_key: dict = {}


#: Read by ``token_pass`` before it calls in here: where no stage is in
#: force (a program without ``batched``), the pass never enters this module.
stages = _Stages()


def keys() -> list:
  """The chains with a stage in force here."""
  return list(stages.by_key)


class hidden:
  """A region that starts with no stage (a branch, a ``shard_map`` body, a
  ``while_loop`` with a batched predicate, a whole program)."""

  def __enter__(self):
    self.saved, stages.by_key = stages.by_key, {}

  def __exit__(self, *exc):
    stages.by_key = self.saved


def flush_for(keys, chains) -> None:
  """Flushes the stages of chains ``keys`` (something else on them comes)."""
  for key in keys:
    if key in stages.by_key:
      stages.by_key[key].flush(chains)


class Stage:
  """One chain's staging buffer in a loop: the layout (a slot per staged
  equation, its operands' columns), ``k`` rows, and ``state``, the traced
  ``(count, ids, buffers)`` where the pass is."""

  def __init__(self, key, found: list, flush_call: FlushCall):
    self.key = key
    self.flush_call = flush_call
    self.eqns = [eqn for eqn, _, _ in found]   # (their ids name the slots)
    # Rows a step of the loop writes, where every staged equation is
    # directly in its body (none in a nested loop): strip-mining bounds the
    # count (``checked`` off), else None.
    self.per_step = None if any(nested for _, _, nested in found) else len(found)
    self.checked = True
    self.slots: dict[int, tuple] = {}
    self.avals: list = []
    flush = _batching.Flush()
    for eqn in self.eqns:
      start = len(self.avals)
      columns = tuple(range(start, start + len(eqn.invars)))
      self.avals += [v.aval for v in eqn.invars]
      self.slots[id(eqn)] = (len(flush.effects), columns)
      flush.effects.append((None, columns))
    self.flush_fn = flush
    row = 4 + sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in self.avals)
    k = min(r.k for _, r, _ in found)
    max_bytes = min(r.max_bytes for _, r, _ in found)
    self.k = min(k, max_bytes // row)
    what = ", ".join(e.params["host_callback"].description for e in self.eqns)
    if self.k < 1:
      raise ValueError(
          f"jax_effects.batched(max_bytes={max_bytes}): one staged row of "
          f"{what} in a loop takes {row} bytes (its operands and the row's "
          f"effect id), more than max_bytes. Raise max_bytes to at least "
          f"{row} (it bounds the loop's staging buffer: up to k rows), or "
          f"print these values outside jax_effects.batched.")
    self.callback = _host_callback.HostCallback(
        flush, f"jax_effects.batched flush of {len(self.eqns)} effect(s) "
               f"({what})", reads_placement=True,
        spec="its rows are a loop's staged effects")
    self.state = None

  def initial(self) -> tuple:
    return (jnp.zeros((), jnp.int32), jnp.zeros((self.k,), jnp.int32),
            # (varying as its operand: a loop's carry inside shard_map keeps its type)
            tuple(_compat.to_varying(jnp.zeros((self.k, *a.shape), a.dtype),
                                     _compat.varying_axes(a)) for a in self.avals))

  def holds(self, eqn) -> bool:
    return id(eqn) in self.slots

  def write(self, eqn, host_callback, invals, chains) -> None:
    """Stages ``eqn``'s row (``host_callback`` of ``invals``); flushes when
    the buffer is full."""
    j, columns = self.slots[id(eqn)]
    self.flush_fn.effects[j] = (host_callback, columns)
    count, ids, buffers = self.state
    buffers = list(buffers)
    for c, x in zip(columns, invals):
      buffers[c] = lax.dynamic_update_index_in_dim(
          buffers[c], jnp.asarray(x, buffers[c].dtype), count, 0)
    ids = lax.dynamic_update_index_in_dim(ids, jnp.int32(j), count, 0)
    count = count + 1
    self.state = (count, ids, tuple(buffers))
    if self.checked:
      self._flush_if(count == self.k, chains)

  def flush(self, chains) -> None:
    """Flushes the rows staged so far (none: no host call)."""
    self._flush_if(self.state[0] > 0, chains)

  def _flush_if(self, pred, chains) -> None:
    count, ids, buffers = self.state
    key, callback, flush_call = self.key, self.callback, self.flush_call

    def run(carrier, *operands):
      return flush_call(key, callback, operands, carrier)

    chains.carriers[key] = lax.cond(pred, run, lambda carrier, *_: carrier,
                                    chains.carrier(key), count, ids,
                                    *buffers)
    self.state = (lax.select(pred, jnp.zeros_like(count), count), ids, buffers)


def _staged(jaxpr, mode: str, found: dict, nested: bool = False) -> dict:
  """Chain key -> ``[(eqn, request, nested)]``: the offered effects in
  ``jaxpr`` a loop may stage (its nested loops' bodies, ``nested``, and
  calls too)."""
  for eqn in jaxpr.eqns:
    prim = eqn.primitive
    if prim is _effect.effect_p:
      request = _batching.request_of(eqn.params["host_callback"])
      if request is not None and all(
          isinstance(v.aval.dtype, np.dtype) for v in eqn.invars):
        (key,) = _effects.chain_keys(eqn.effects, mode)
        found.setdefault(key, []).append((eqn, request, nested))
    elif prim is jprims.scan_p:
      _staged(eqn.params["jaxpr"].jaxpr, mode, found, True)
    elif prim is jprims.while_p:
      if not eqn.params["cond_jaxpr"].out_avals[0].shape:
        _staged(eqn.params["body_jaxpr"].jaxpr, mode, found, True)
    elif prim in _jaxpr_eval.CALLEES:
      _staged(_jaxpr_eval.split(eqn.params[_jaxpr_eval.CALLEES[prim]])[0],
              mode, found, nested)
  return found


class Loop:
  """The stages a loop carries: its chains' stages in force around it, and
  new ones for its staged effects (not under a vmapped ``while_loop``'s
  live mask, ``masked``, whose effects are not staged)."""

  def __init__(self, body, keys, mode: str, masked: bool,
               flush_call: FlushCall):
    by_key = stages.by_key
    self.new: list[Stage] = []
    if not masked:
      for key, found in _staged(body, mode, {}).items():
        if key in keys and key not in by_key:
          stage = Stage(key, found, flush_call)
          stage.state = stage.initial()
          by_key[key] = stage
          self.new.append(stage)
    self.carried = [by_key[k] for k in keys if k in by_key]

  def strip_steps(self, length: int | None = None) -> int | None:
    """Steps between flushes where the loop (of ``length`` steps, None:
    unknown) can be strip-mined (its stages all its own, every staged
    effect directly in its body, a strip shorter than the loop): a flush
    every that many steps, with no check of the count per row (a ``cond``
    per step costs the device about a microsecond on CPU); else None."""
    if not self.new or len(self.new) != len(self.carried) or any(
        s.per_step is None for s in self.new):
      return None
    steps = min(s.k // s.per_step for s in self.new)
    if steps < 2 or (length is not None and steps >= length):
      return None
    for s in self.new:
      s.checked = False
    return steps

  def flush(self, states, chains) -> list:
    """The stages at ``states`` flushed (a strip's end); their states after."""
    for s, state in zip(self.carried, states):
      s.state = state
      s.flush(chains)
    return self.states()

  def states(self) -> list:
    return [s.state for s in self.carried]

  def run(self, states, fn, *args):
    """``fn(*args)`` with the stages at ``states``; returns ``(its result,
    the states after)``."""
    for s, state in zip(self.carried, states):
      s.state = state
    return fn(*args), self.states()

  def exit(self, states, chains) -> None:
    """After the loop: the stages at its final ``states``; its own stages
    flushed (the remainder)."""
    for s, state in zip(self.carried, states):
      s.state = state
    for s in self.new:
      s.flush(chains)

  def close(self) -> None:
    """Its own stages go (also where its trace failed)."""
    by_key = stages.by_key
    for s in self.new:
      if by_key.get(s.key) is s:
        del by_key[s.key]

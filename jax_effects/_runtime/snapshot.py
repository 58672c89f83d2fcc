"""``runtime_tokens()``: a read-only snapshot of the calling thread's tokens.

Part of the public API: what the calling thread would pass as runtime tokens
to its next computation (``.effects``, one per stream it used) and the
latest output token of each device (``.devices``), as ``threads`` keeps them.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping

import jax

from jax_effects._core import effects as _effects
from jax_effects._runtime import threads as _threads


@dataclasses.dataclass(frozen=True)
class RuntimeTokens:
  """Read-only snapshot of one thread's tokens (see :func:`runtime_tokens`)."""
  effects: Mapping[Any, jax.Array]
  devices: Mapping[Any, jax.Array]


def runtime_tokens() -> RuntimeTokens:
  """Snapshot for the calling thread.

  ``.effects`` maps each :class:`~jax_effects.Effect` (or ``GLOBAL`` in global
  mode) to its current runtime token; ``.devices`` maps each device to the
  latest output token returned by a computation that ran on it.

  While ``ordering("global")`` is active on this thread, ``.effects`` has
  exactly one entry, ``GLOBAL`` (the initial token if no global-mode call
  has run yet). In ``"per_effect"`` mode it lists every stream this thread
  has used (``GLOBAL`` too, after a global block).
  """
  state = _threads.thread_state()
  if _effects.get_ordering() == "global":
    token = state.runtime.get(_effects.GLOBAL)
    if token is None:   # (a jax.Array, as every other token in the snapshot)
      token = _threads.as_array(state.initial_token())
    effects = {_effects.GLOBAL: token}
  else:
    effects = dict(state.runtime)
  return RuntimeTokens(types.MappingProxyType(effects),
                       types.MappingProxyType(state.devices()))

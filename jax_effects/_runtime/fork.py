"""``os.fork()``: a child starts with none of the parent's runtime state.

Everything jax_effects keeps at run time is per process, and a forked
child holds none of the computations it stands for: right after a fork, in
the child, each module that holds such state resets it (registered with
:func:`reset_in_child`). In a child forked after JAX's backend started
(:data:`forked_after_backend`), where a computation would hang, every call
that would dispatch or wait for one raises :func:`refused`. The contract:
``design/errors.md``, "Fork".

Part in the token calling convention: none; it empties the runtime state
the convention keeps, in the child.
"""
from __future__ import annotations

import os
from typing import Callable

from jax_effects import _compat

#: True in a process forked (at any depth) from one whose JAX backend had
#: started: XLA's runtime cannot run here.
forked_after_backend = False

_resets: list[Callable[[], None]] = []


def reset_in_child(fn: Callable[[], None]) -> Callable[[], None]:
  """Registers ``fn`` (no arguments) to reset its module's per-process state
  in a forked child, in registration (import) order; returns ``fn``."""
  _resets.append(fn)
  return fn


def _after_fork_in_child() -> None:
  global forked_after_backend
  forked_after_backend = forked_after_backend or _compat.backend_started()
  for fn in _resets:
    fn()


if hasattr(os, "register_at_fork"):   # (POSIX)
  os.register_at_fork(after_in_child=_after_fork_in_child)


def refused(call: str) -> RuntimeError:
  """The error of ``call`` in a child forked after JAX's backend started."""
  return RuntimeError(
      f"jax_effects: {call} in a process forked (os.fork) from a process "
      "whose JAX backend had started: XLA's runtime does not survive a fork "
      "(its threads exist only in the parent), so a computation here would "
      "hang. Start worker processes with multiprocessing's 'spawn' or "
      "'forkserver' start method (or subprocess), or fork before the parent "
      "runs its first JAX computation.")

"""``os.fork()``: a child process starts with none of the parent's runtime state.

Everything jax_effects keeps at run time is per process: the deferred errors
(``errors``), every thread's token state and the exited threads' pending
tokens (``threads``), held output and the locks of the sinks (``output``),
the launch lock (``launch_lock``), and JAX's own runtime tokens of the
forking thread. A forked child holds copies of all of it, but none of the
computations they stand for: the parent runs them, the parent's callbacks
fill the parent's registry, and the parent reports its own errors. So right
after a fork, in the child (``os.register_at_fork(after_in_child=...)``),
each module that holds such state resets it (registered with
:func:`reset_in_child`): no error, token, thread state or held line of the
parent is seen, waited for or reported there, and no lock is left held by
a thread that does not exist in the child.

JAX itself does not survive a fork once its backend has started: XLA's
runtime threads exist only in the parent, so a computation in the child
hangs (JAX warns at the fork). In such a child (:data:`forked_after_backend`)
every jax_effects call that would dispatch or wait for a computation, or
run an eager effect, raises :func:`refused` instead; a barrier has nothing
to wait for and returns, and interpreter exit reports nothing of the
parent's. A child forked before the parent's first computation starts its
own backend and uses jax_effects normally. The contract: ``design/errors.md``.

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

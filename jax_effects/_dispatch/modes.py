"""Switching how effects are ordered: ``set_ordering``, ``ordering``, ``deterministic``.

The ordering mode decides which runtime-token stream an ordered effect uses
(``_core.effects``): the two modes use different streams, so every switch
here first waits for the effects already dispatched, and each thread's next
dispatch in a new mode for its own (``ThreadTokens.switch_mode``): one
program order holds across it. A switch is refused inside a traced function
or a host callback (``design/errors.md``, "Mode switches").
:func:`deterministic` switches how per-device output is delivered
(``_runtime.output``; ``design/placement.md``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._runtime import barrier as _barrier
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import output as _output
from jax_effects._runtime import threads as _threads


def _before_switch(call: str, switching: bool, all_threads: bool) -> None:
  """A mode switch inside a trace or a host callback is refused; one that
  changes the mode first waits (quietly) for the dispatched effects."""
  if not _compat.at_top_level():
    raise RuntimeError(
        f"jax_effects: {call} was called while a function is being traced "
        "(under jit, vmap, grad, ...); the ordering mode of a computation is "
        "the one in effect when it is dispatched, so this switch would be "
        "ignored. Enter it around the call of the jitted function instead.")
  if switching:   # (it waits for dispatched effects: not from a callback)
    _barrier.check_not_in_callback(call)
    _barrier.quiet_barrier(all_threads=all_threads)


def set_ordering(mode: str) -> None:
  """Sets the process-wide ordering mode (``"per_effect"`` or ``"global"``).

  Threads inside an :func:`ordering` context keep their own mode. Changing
  the mode first waits for every thread's dispatched effects. Refused
  (``RuntimeError``) inside a traced function or a host callback.
  """
  _effects.check_mode(mode)
  _before_switch(f"set_ordering({mode!r})", mode != _effects.process_mode(),
                 all_threads=True)
  _effects.set_process_mode(mode)
  _threads.mode_changed(all_threads=True)


@contextlib.contextmanager
def ordering(mode: str) -> Iterator[None]:
  """Context manager selecting the ordering mode on this thread.

  ``"per_effect"``: one runtime token per :class:`~jax_effects.Effect`.
  ``"global"``: all ordered effects share one token
  (:data:`~jax_effects.GLOBAL`), giving one total order. Entering or leaving
  a context that changes the mode waits for this thread's dispatched
  effects, so order holds across the switch. Refused (``RuntimeError``)
  inside a traced function or a host callback.
  """
  _effects.check_mode(mode)
  outer = _effects.get_ordering()
  _before_switch(f"ordering({mode!r})", mode != outer, all_threads=False)
  _effects.push_mode(mode)
  _threads.mode_changed(all_threads=False)
  try:
    yield
  finally:
    _effects.pop_mode()
    _threads.mode_changed(all_threads=False)
  if mode != outer:  # not reached with an exception in flight
    _barrier.quiet_barrier(all_threads=False)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
  """Per-device output of each dispatch in a fixed order (process-wide).

  While the block is active (in any thread), ordered ``print`` lines and
  ``log`` records of per-device callbacks (``shard_map``/``pmap`` in
  ``jax_effects.jit`` code) are held and released once every device's
  effects of that dispatch have run, sorted by (position in the device's
  sequence of effects of the dispatch, device id): for SPMD code, the same
  program logs identically run after run. On exit, waits for the calling
  thread's effects, releases anything still held, then raises the thread's
  callback errors not reported yet; leaving on an exception, that exception
  propagates unchanged (the errors stay for the next call or barrier). A
  ``jax.debug.callback`` or ``io_callback`` in per-device code is refused
  inside it (a ``RuntimeError`` per device). What is and is not guaranteed:
  ``design/placement.md``, "Order across devices, and the deterministic
  view".

  Refused (``RuntimeError``) inside a function being traced: it takes
  effect when entered, around the call of the jitted function.
  """
  _barrier.check_not_in_traced("deterministic()")
  _output.start_holding()
  try:
    yield   # (the block's own exception propagates unchanged)
  finally:
    _leave_deterministic()   # (the errors stay for the next call or barrier)
  _barrier.effects_barrier()


def _leave_deterministic() -> None:
  """Ends the view: waits for this thread's effects (quietly), releases what
  is held; what a delivery raised is deferred for this thread."""
  try:
    _barrier.wait_for_thread()
  finally:
    failures = _output.stop_holding()   # releases what is still held
    if failures:
      slot = _threads.thread_state().slot
      for exc in failures:
        _errors.defer(exc, slot)
      del failures, exc   # (no reference cycle when a wait above raised)

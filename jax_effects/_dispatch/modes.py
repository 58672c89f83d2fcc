"""Switching how effects are ordered: ``set_ordering``, ``ordering``, ``deterministic``.

The ordering mode decides which runtime-token stream an ordered effect uses
(``_core.effects.chain_key``): one per :class:`~jax_effects.Effect`
(``"per_effect"``) or one for all (``"global"``). The two modes use different
streams, so nothing would order an effect dispatched after a switch behind
one dispatched before it: every switch here first waits for the effects
already dispatched (``effects_barrier``), which keeps one program order
across it. Switches are rare; blocking there costs nothing per call. The
wait reports no error (each stays for the thread that dispatched it). A
dispatch in flight in another thread while ``set_ordering`` runs is not
waited for here: that thread's next dispatch in the new mode first waits for
its own earlier ones (``ThreadTokens.switch_mode``), so every thread's
order holds across the switch. A switch is refused inside a traced function
(it would be ignored) and inside a host callback (it would wait for the
computation running it): ``design/errors.md``.

:func:`deterministic` switches how per-device output is *delivered*: held and
released in a fixed order (``_runtime.output``); leaving it waits for the calling
thread's effects and releases what is still held.
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


def _check_switch_allowed(call: str, switching: bool) -> None:
  """A mode switch inside a trace or a host callback is refused."""
  if not _compat.at_top_level():
    raise RuntimeError(
        f"jax_effects: {call} was called while a function is being traced "
        "(under jit, vmap, grad, ...); the ordering mode of a computation is "
        "the one in effect when it is dispatched, so this switch would be "
        "ignored. Enter it around the call of the jitted function instead.")
  if switching:   # (it waits for dispatched effects: not from a callback)
    _barrier.check_not_in_callback(call)


def set_ordering(mode: str) -> None:
  """Sets the process-wide ordering mode (``"per_effect"`` or ``"global"``).

  Threads inside an :func:`ordering` context keep their own mode. Changing
  the mode first waits for every thread's dispatched effects. Refused
  (``RuntimeError``) inside a traced function or a host callback.
  """
  _effects.check_mode(mode)
  switching = mode != _effects.process_mode()
  _check_switch_allowed(f"set_ordering({mode!r})", switching)
  if switching:
    _barrier.quiet_barrier(all_threads=True)
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
  _check_switch_allowed(f"ordering({mode!r})", mode != outer)
  if mode != outer:
    _barrier.quiet_barrier(all_threads=False)
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

  While the block is active (in any thread: the callbacks run on XLA's
  threads), ordered ``print`` lines and ``log`` records of per-device
  callbacks (``shard_map``/``pmap`` in ``jax_effects.jit`` code) are held and
  released once every device's effects of that dispatch have run, sorted by
  (position in the device's sequence of effects of the dispatch, device id).
  For SPMD code whose control flow is the same on every device, position =
  program point, so the same program logs identically run after run. On exit,
  waits for the calling thread's effects and releases anything still held,
  then raises the thread's callback errors not reported yet
  (``effects_barrier``). Leaving on an exception, that exception propagates
  unchanged (as from :func:`ordering`): the wait and release still happen,
  and the errors stay for the thread's next call or barrier.

  A release delivers every held line and record even when the output stream
  or a handler raises for one of them; what it raised is reported to the
  thread whose dispatch the output came from, once, like a callback's error
  (this block's exit, for its own calls: ``design/errors.md``).

  Guaranteed: on one device, program order (always); within one dispatch,
  sorted as above (in this view only); a dispatch's output before the next
  dispatch's on the same effect stream, and an ordered effect that runs once
  after the per-device output before it (always). Not guaranteed: any order
  across processes (each process delivers its own devices' output); an order
  for ``ordered=False`` effects (delivered at once); a fixed interleaving when
  several threads dispatch per-device effects at the same time (a release
  delivers everything held); per-device effects under plain ``jax.jit``
  (delivered at once). Refused: a ``jax.debug.callback`` or ``io_callback``
  in per-device code (it runs user code, which cannot be held, and would
  leave the output unsorted): a ``RuntimeError`` per device, reported as
  callbacks' errors are.

  Refused (``RuntimeError``) inside a function being traced (``jit``,
  ``make_jaxpr``, a loop body): it takes effect when entered, around the
  call of the jitted function, and would do nothing at run time there.
  """
  _barrier.check_not_in_traced("deterministic()")
  _output.start_holding()
  try:
    yield
  except BaseException:
    _leave_deterministic()   # (the errors stay for the next call or barrier)
    raise   # the block's own exception, unchanged
  _leave_deterministic()
  _barrier.effects_barrier()


def _leave_deterministic() -> None:
  """Ends the view: waits for this thread's effects (quietly), releases what
  is still held; what a delivery raised is deferred for this thread."""
  try:
    _barrier.wait_for_thread()
  finally:
    failures = _output.stop_holding()   # releases what is still held
    if failures:
      slot = _threads.thread_state().slot
      for exc in failures:
        _errors.defer(exc, slot)
      del failures, exc   # (no reference cycle when a wait above raised)

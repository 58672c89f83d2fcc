"""``effects_barrier``: waiting for dispatched effects, reporting their errors.

:func:`effects_barrier` waits, as long as it takes, for a thread's pending
tokens (``threads``; every thread's with ``all_threads=True``), its effects
left on the host (``host_jobs``) and JAX's own runtime tokens, then raises
the callback errors not reported yet; :func:`quiet_barrier` reports nothing
(a mode switch). ``jax.effects_barrier()`` waits for ours too
(:func:`jax_barrier_hook`). ``design/errors.md``.

At interpreter exit (``atexit``) every thread's effects are waited for; the
errors not reported yet are printed to stderr and the exit status becomes
1, as for an uncaught exception. A dispatch from an exit handler that runs
after this one reports its own (:func:`report_late`). The watcher thread is
then ended (``executions.stop``). ``design/errors.md``, "Interpreter exit".
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import traceback

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import executions as _executions
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import host_jobs as _host_jobs
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import token_store as _token_store


def _wait_host_jobs(all_threads: bool, states: list) -> None:
  """Waits for ``states``' (every thread's with ``all_threads``) effects
  left on the host, once their computations ended."""
  if all_threads or states:   # (a thread with no state queued nothing)
    slots = None if all_threads else (states[0].slot,)
    _executions.settle()   # (what ended executions kept: freed now)
    _host_jobs.wait_idle(slots)
    _host_jobs.retire_slots(slots)


def _wait_later_dispatches(waited: list) -> None:
  """Waits for what was dispatched from inside the computations an
  all-threads barrier waited for (``waited``, kept alive while their
  identities are compared), until a look finds nothing new."""
  seen = {id(t) for t in waited}
  while True:
    new = [t for state in _threads.all_states() for t in state.pending()
           if id(t) not in seen]
    new += [t for t in _threads.orphans() if id(t) not in seen]
    if not new:
      return
    seen.update(id(t) for t in new)
    waited += new
    _token_store.wait_quietly(new)


def _wait(all_threads: bool, states: list, own=None) -> None:
  """Waits for ``states``' dispatched effects (and exited threads' with
  ``all_threads``), then for JAX's own runtime tokens; ``own`` (this
  thread's state) is settled: a failed computation's chains start afresh."""
  orphans = _threads.orphans() if all_threads else []
  waited = []
  for state in states:
    pending = state.pending()
    waited += pending
    if state is own:
      state.settle()
    else:   # (another thread's state is written by that thread only)
      _token_store.wait_quietly(pending)
  _token_store.wait_quietly(orphans)
  if all_threads:
    _wait_later_dispatches(waited + orphans)
  _wait_host_jobs(all_threads, states)
  # (raising nothing: a plain jax.jit call's failure stays for
  # jax.effects_barrier, as JAX keeps it)
  _token_store.wait_quietly(_compat.jax_runtime_tokens(all_threads))


def check_not_in_callback(call: str) -> None:
  """Refuses ``call`` (a barrier or mode switch) inside a host callback:
  it would wait for the computation running the callback (a deadlock)."""
  if _placement.current() is not None:
    raise RuntimeError(
        f"jax_effects: {call} was called from a host callback of a running "
        "computation; it would wait for that computation (a deadlock). Call it "
        "after the jitted call returns, outside the callback.")


def quiet_barrier(all_threads: bool) -> None:
  """Blocks on this thread's tokens (every thread's, exited ones included,
  with ``all_threads``) and reports nothing."""
  states = _threads.all_states() if all_threads else [_threads.thread_state()]
  _wait(all_threads, states)


def wait_for_thread() -> None:
  """Blocks until this thread's dispatched effects have run (raises nothing:
  a failure is reported by the next call or barrier)."""
  state = _threads.thread_state()
  _token_store.wait_quietly(state.pending())
  _wait_host_jobs(False, [state])


def jax_barrier_hook() -> None:
  """What ``jax.effects_barrier()`` does first: waits for every thread's
  effects quietly, then reports this thread's errors as
  :func:`effects_barrier` does (nothing after jax_effects' exit handler)."""
  if _token_store.after_exit_handler or _compat.building_jaxpr():
    return   # (JAX's own barrier, called while tracing, is left as it is)
  check_not_in_callback("jax.effects_barrier()")
  quiet_barrier(True)
  effects_barrier(False)


def wait_for_thread_until(timeout: float) -> bool:
  """:func:`wait_for_thread`, for at most ``timeout`` seconds of computation
  (polled): False if this thread's computations are still running then
  (``notebook``)."""
  state = getattr(_threads.local, "state", None)
  if state is None:
    return True
  deadline = time.monotonic() + timeout
  pause = 1e-4
  while not all(_token_store.is_done(t) for t in state.pending()):
    if time.monotonic() >= deadline:
      return False
    time.sleep(pause)
    pause = min(pause * 2, 0.01)
  wait_for_thread()   # (ended: its effects left on the host run now)
  return True


def check_not_in_traced(call: str) -> None:
  """Refuses ``call`` while a jaxpr is being built, where it would run once,
  at trace time."""
  if _compat.building_jaxpr():
    raise RuntimeError(
        f"jax_effects: {call} was called inside a function being traced "
        f"(jit, make_jaxpr, a loop or cond body): it would run once, at "
        f"trace time, and do nothing when the computation runs. Call it "
        f"around the call of the jitted function instead.")


def effects_barrier(all_threads: bool = False) -> None:
  """Blocks until every effect dispatched so far has completed.

  With ``all_threads=False`` waits for the effects dispatched by the calling
  thread; with ``all_threads=True`` for those of every thread (including
  threads that have exited). Then raises the callback errors not reported yet
  (see ``design/errors.md``): this thread's; with ``all_threads=True`` every
  thread's and those whose dispatching thread is unknown (never another
  thread's on a thread's own barrier); one error as itself, several together
  (an ``ExceptionGroup``), each once.

  Refused (``RuntimeError``) inside a host callback of a running computation,
  which it would wait for, and inside a function being traced (``jit``,
  ``make_jaxpr``, a loop body), where it would do nothing at run time.
  """
  check_not_in_traced(f"effects_barrier(all_threads={all_threads})")
  check_not_in_callback(f"effects_barrier(all_threads={all_threads})")
  states = _threads.states(all_threads)
  # Dead before the wait: dispatches nothing after it, so it can be dropped
  # (its thread-local may outlive the thread a little).
  dead = [s for s in states if not s.alive()] if all_threads else []
  _wait(all_threads, states, getattr(_threads.local, "state", None))
  # Taken before ended threads' slots are freed (a slot with an unreported
  # error is kept).
  report = _errors.pop_deferred(None if all_threads
                                else tuple(state.slot for state in states))
  if all_threads:
    _threads.forget(dead)
  if report is not None:
    try:
      raise report
    finally:
      report = None   # (no reference cycle through this frame)


def _before_plain_jit_launch() -> None:
  """What a launch under plain ``jax.jit`` with ordered effects of ours
  does first (on the launching thread, before JAX takes its token): waits
  for the thread's ``jax_effects.jit`` calls still running, which it must
  not overtake (not inside a host callback: that would wait for the
  computation running it)."""
  state = getattr(_threads.local, "state", None)
  if state is None:
    return
  plain = state.plain   # (JAX itself waits for the thread's last plain call)
  if (_host_jobs.queues or not all(
      t is plain or _token_store.is_done(t) for t in state.pending())) and (
          _placement.current() is None):
    wait_for_thread()


def _after_plain_jit_launch(token) -> None:
  """The thread's next dispatch of ours waits for what a plain ``jax.jit``
  call launched (``token``: JAX's of ``PLAIN_JIT_ORDER``)."""
  _threads.thread_state().join_plain(token)


_compat.hook_jax_runtime_tokens(
    jax_barrier_hook, lambda eff: eff is _effects.PLAIN_JIT_ORDER,
    _before_plain_jit_launch, _after_plain_jit_launch)


# --- interpreter exit ------------------------------------------------------

#: Reports collected before giving up on a barrier that keeps raising.
_MAX_REPORTS = 16


def _wait_and_report() -> None:
  """Waits for every thread's effects; if callback errors were not raised
  yet, reports them (:func:`_report_and_exit`). Then ends the watcher
  thread (none of ours may be inside jaxlib at finalization; after the
  exit handler, the one a dispatch may have started)."""
  reports = []
  while len(reports) < _MAX_REPORTS:
    try:
      effects_barrier(all_threads=True)
      break
    except BaseException as exc:  # noqa: BLE001 - reported here, as uncaught
      reports.append(exc)
  if reports:
    _report_and_exit(reports)
  _executions.stop()


def _report_and_exit(reports: list[BaseException]) -> None:
  """Prints ``reports`` to stderr after a line that counts the failures;
  ends the process with status 1 (``os._exit``: nothing else can, at exit).
  """
  with contextlib.suppress(Exception):  # (a broken stdout)
    sys.stdout.flush()
  # (a broken stderr, or a hostile __str__: nothing more to do)
  with contextlib.suppress(Exception):
    n = sum(_errors.count(r) for r in reports)
    what = ("a host callback failed and its error was" if n == 1 else
            f"{n} host callbacks failed and their errors were")
    sys.stderr.write(f"jax_effects: {what} not reported before interpreter "
                     "exit:\n")
    for report in reports:
      traceback.print_exception(report, file=sys.stderr)
    sys.stderr.flush()
  os._exit(1)


@atexit.register
def _wait_at_exit() -> None:
  """The exit handler (module docstring); nothing in a child forked after
  JAX's backend started."""
  if _fork.forked_after_backend:
    return
  _wait_and_report()
  _token_store.after_exit_handler = True
  _threads.mode_changed(all_threads=True)   # (later dispatches: general path)


def report_late(state: _threads.ThreadTokens) -> None:
  """After the exit handler, called by every dispatch once its computation
  is launched: waits for everything and, if a callback failed, reports like
  the exit handler (no later point exists to raise the errors)."""
  del state
  _errors.move_own_errors()
  _wait_and_report()

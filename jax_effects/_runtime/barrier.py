"""``effects_barrier``: waiting for dispatched effects, and reporting their errors.

A thread's dispatched effects are done when its pending tokens (``threads``:
the latest output token of each device set and the runtime token of each
stream) are ready and the effects left to run on the host (``host_jobs``)
have run. :func:`effects_barrier` waits for them (every thread's, exited
ones included, with ``all_threads=True``, and then what those computations
dispatched meanwhile from host callbacks on XLA's threads) and for JAX's own
runtime tokens (effects under plain ``jax.jit``), as long as they take: it
never gives up on work that is still running. Then it raises the callback errors not
reported yet, once (``design/errors.md``). A computation that failed as a
whole (an XLA failure) is not reported here: it is its call's, raised by
the call or carried by its results, as under ``jax.jit``; the barrier only
frees what the host kept for it. :func:`quiet_barrier` waits the same way
and reports nothing (a mode switch: each error stays for the thread that
dispatched it). Both are refused inside a host callback, which they would
wait for. ``jax.effects_barrier()`` waits for ours too
(:func:`jax_barrier_hook`).
"""
from __future__ import annotations

import time

from jax_effects import _compat
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import executions as _executions
from jax_effects._runtime import host_jobs as _host_jobs
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import threads as _threads
from jax_effects._runtime import thread_slots as _thread_slots
from jax_effects._runtime import token_store as _token_store


def _wait_host_jobs(all_threads: bool, states: list) -> None:
  """Waits for the effects left to run on the host once every device's part
  is there (``host_jobs``) of ``states``' threads (every thread's with
  ``all_threads``); called once their computations ended, so every device's
  call has been made or its execution is known to have failed (nothing of
  theirs is to come: what was kept to skip a failed one's goes)."""
  if all_threads or states:   # (a thread with no state queued nothing)
    slots = None if all_threads else (states[0].slot,)
    _executions.settle()   # (what ended executions kept: freed now)
    _host_jobs.wait_idle(slots)
    _host_jobs.retire_slots(slots)


def _settle_orphans(orphans: list) -> None:
  for token in orphans:
    _token_store.settled(token)


def _wait_later_dispatches(waited: list) -> None:
  """An all-threads barrier, once it has waited for what every thread had
  dispatched when it started: waits for what was dispatched meanwhile from
  inside those computations (a call a host callback made on one of XLA's
  threads, which dispatches on that thread's own state: it is done before
  the computation that ran the callback ends), until a look finds nothing
  new. (``waited``: the tokens waited for so far, kept alive while their
  identities are compared.)"""
  seen = {id(t) for t in waited}
  while True:
    new = [t for state in _thread_slots.all_states() for t in state.pending()
           if id(t) not in seen]
    new += [t for t in _thread_slots.orphans() if id(t) not in seen]
    if not new:
      return
    seen.update(id(t) for t in new)
    waited += new
    _token_store.wait_quietly(new)


def _jax_barrier() -> None:
  """Waits for JAX's own tokens (effects under plain ``jax.jit``), raising
  nothing: a failure there is an XLA failure of a plain ``jax.jit`` call,
  that call's (``design/errors.md``), and stays for ``jax.effects_barrier``
  as JAX keeps it."""
  for token in _compat.jax_runtime_tokens():
    _token_store.settled(token)


def in_host_callback() -> bool:
  """True while a compiled computation's host callback runs on this thread."""
  return _placement.current() is not None


def check_not_in_callback(call: str) -> None:
  """Refuses ``call`` (a barrier or mode switch) inside a host callback.

  It would wait for the computation that is running the callback (and, in a
  multi-device computation, for the other devices' callbacks): a deadlock.
  """
  if in_host_callback():
    raise RuntimeError(
        f"jax_effects: {call} was called from a host callback of a running "
        "computation; it would wait for that computation (a deadlock). Call it "
        "after the jitted call returns, outside the callback.")


def quiet_barrier(all_threads: bool) -> None:
  """Blocks on this thread's tokens (every thread's, exited ones included, with
  ``all_threads``) and reports nothing: each error stays for the thread that
  dispatched it (a mode switch waits like this)."""
  if all_threads:
    states, orphans = _thread_slots.all_states(), _thread_slots.orphans()
  else:
    states, orphans = [_threads.thread_state()], []
  waited = [t for state in states for t in state.pending()]
  _token_store.wait_quietly(waited)
  _settle_orphans(orphans)
  if all_threads:
    _wait_later_dispatches(waited + orphans)
  _wait_host_jobs(all_threads, states)
  _jax_barrier()


def wait_for_thread() -> None:
  """Blocks until this thread's dispatched effects have run (raises nothing:
  a failure is reported by the next call or barrier)."""
  state = _threads.thread_state()
  _token_store.wait_quietly(state.pending())
  _wait_host_jobs(False, [state])


def jax_barrier_hook() -> None:
  """What ``jax.effects_barrier()`` does first (``_compat.on_jax_effects_barrier``):
  waits for every thread's effects, as JAX's waits for every device's
  (quietly: each error stays for its thread), then reports this thread's
  errors as :func:`effects_barrier` does. Refused inside a host callback,
  as ours is; nothing after jax_effects' exit handler (JAX's own exit
  handler calls it: everything was waited for)."""
  if _token_store.after_exit_handler or _compat.building_jaxpr():
    return   # (JAX's own barrier, called while tracing, is left as it is)
  check_not_in_callback("jax.effects_barrier()")
  quiet_barrier(True)
  effects_barrier(False)


def _done(token) -> bool:
  try:
    return token.is_ready()
  except Exception:  # noqa: BLE001 - failed, deleted, or a NumPy initial token
    return True


def wait_for_thread_until(timeout: float) -> bool:
  """:func:`wait_for_thread`, for at most ``timeout`` seconds of computation
  (polled): False if this thread's computations are still running then
  (the IPython cell hook, ``_runtime.notebook``)."""
  state = getattr(_threads.local, "state", None)
  if state is None:
    return True
  deadline = time.monotonic() + timeout
  pause = 1e-4
  while not all(_done(t) for t in state.pending()):
    if time.monotonic() >= deadline:
      return False
    time.sleep(pause)
    pause = min(pause * 2, 0.01)
  wait_for_thread()   # (ended: its effects left on the host run now)
  return True


def check_not_in_traced(call: str) -> None:
  """Refuses ``call`` while a jaxpr is being built (inside ``jit``,
  ``make_jaxpr``, a loop body): it would run once, when the function is
  traced, and do nothing when the computation runs."""
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
  if all_threads:
    states, orphans = _thread_slots.all_states(), _thread_slots.orphans()
    # Dead before the wait: dispatches nothing after it, so it can be dropped
    # (its thread-local may outlive the thread a little).
    dead = [s for s in states if not s.alive()]
  else:   # (a thread with no state has dispatched nothing: a forked child)
    state = getattr(_threads.local, "state", None)
    states, orphans = ([] if state is None else [state]), []
  own = getattr(_threads.local, "state", None)
  waited = []
  for state in states:
    pending = state.pending()
    waited += pending
    if state is own:
      state.settle()   # (a failed computation: its call's, see above)
    else:   # (another thread's state is written by that thread only)
      _token_store.wait_quietly(pending)
  _settle_orphans(orphans)
  if all_threads:
    _wait_later_dispatches(waited + orphans)
  _wait_host_jobs(all_threads, states)
  _jax_barrier()
  # deferred errors: this thread's (every thread's and those of unknown
  # origin with all_threads=True), taken before ended threads' slots are
  # freed (a slot with an unreported error is kept)
  report = _errors.pop_deferred(None if all_threads
                                else tuple(state.slot for state in states))
  if all_threads:
    _thread_slots.forget(dead)
  if report is not None:
    try:
      raise report
    finally:
      report = None   # (no reference cycle through this frame)


_compat.on_jax_effects_barrier(jax_barrier_hook)

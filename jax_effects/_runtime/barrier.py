"""``effects_barrier``: waiting for dispatched effects, and reporting their errors.

A thread's dispatched effects are done when its pending tokens (``threads``:
the latest output token of each device set and the runtime token of each
stream) are ready. :func:`effects_barrier` blocks on them (every thread's,
exited ones included, with ``all_threads=True``) and on JAX's own runtime
tokens (effects under plain ``jax.jit``), then raises the callback errors
not reported yet, once (``design/errors.md``). :func:`wait_quietly` waits the
same way and reports nothing (a mode switch: each error stays for the thread
that dispatched it). Both are refused inside a host callback, which they
would wait for.
"""
from __future__ import annotations

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import sequence as _sequence
from jax_effects._runtime import threads as _threads


#: Seconds a barrier waits, once its computations have completed, for effects
#: left to run on the host (``_runtime.sequence.wait_idle``).
_PATIENCE_S = 60.0


def _wait_host_jobs(all_threads: bool, states: list) -> None:
  """Waits for the effects left to run on the host once every device's part
  is there (``_runtime.sequence``) of ``states``' threads (every thread's
  with ``all_threads``); called once their computations completed, so every
  device's call has been made."""
  if all_threads or states:   # (a thread with no state queued nothing)
    _sequence.wait_idle(None if all_threads else (states[0].slot,),
                        patience=_PATIENCE_S)


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


def wait_quietly(all_threads: bool) -> None:
  """Blocks on this thread's tokens (every thread's, exited ones included, with
  ``all_threads``) and reports nothing: each error stays for the thread that
  dispatched it (a mode switch waits like this)."""
  if all_threads:
    states, orphans = _threads.all_states(), _threads.orphans()
  else:
    states, orphans = [_threads.thread_state()], []
  for state in states:
    _threads.wait_quietly(state.pending())
  _threads.wait_quietly(orphans)
  _wait_host_jobs(all_threads, states)
  try:   # effects under plain jax.jit (JAX keeps a failed token: reported later)
    _jax_api.effects_barrier()
  except Exception:  # noqa: BLE001
    pass


def wait_for_thread() -> None:
  """Blocks until this thread's dispatched effects have run (raises nothing:
  a failure is reported by the next call or barrier)."""
  state = _threads.thread_state()
  _threads.wait_quietly(state.pending())
  _wait_host_jobs(False, [state])


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
  which it would wait for.
  """
  check_not_in_callback(f"effects_barrier(all_threads={all_threads})")
  if all_threads:
    states, orphans = _threads.all_states(), _threads.orphans()
    # Dead before the wait: dispatches nothing after it, so it can be dropped
    # (its thread-local may outlive the thread a little).
    dead = [s for s in states if not s.alive()]
  else:   # (a thread with no state has dispatched nothing: a forked child)
    state = getattr(_threads.local, "state", None)
    states, orphans = ([] if state is None else [state]), []
  first_error = None
  for state in states:
    try:
      for token in state.pending():
        token.block_until_ready()
    except Exception as err:  # a failed computation: report it, reset tokens
      state.reset()
      first_error = first_error or err
  for token in orphans:
    try:
      token.block_until_ready()
    except Exception as err:  # noqa: BLE001
      first_error = first_error or err
  _wait_host_jobs(all_threads, states)
  try:   # effects under plain jax.jit use JAX's own tokens (this thread's)
    _jax_api.effects_barrier()
  except Exception as err:
    _compat.clear_jax_runtime_tokens()   # JAX keeps failed ones: report once
    first_error = first_error or err
  if all_threads:
    _threads.forget(dead, orphans)
  if first_error is not None:
    try:
      _errors.reraise(first_error, None)
    finally:
      first_error = None   # (no reference cycle through this frame)
  # deferred errors: this thread's (every thread's and those of unknown
  # origin with all_threads=True)
  _errors.raise_pending(None if all_threads
                        else tuple(state.slot for state in states))

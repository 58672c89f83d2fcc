"""When an execution fails: learnt from its own token, and what it held freed.

An execution fails as a whole in XLA (a ``jax.pure_callback`` raising, a
device's part failing, a failed input): that is its call's failure, raised
by the call or carried by its results as under ``jax.jit``
(``design/errors.md``). What the runtime kept on the host for it must go
with it, or it would wait or mix forever: the jobs waiting for pieces a
failed device never sent, the pieces the other devices did send
(``host_jobs``), its open progress bars (``bars``). :func:`failed` frees
them; it is called with the failed execution's slot and chains by whoever
learns of the failure from the execution's own token or dispatch, never on
a clock:

* its dispatch, when it raised (``_dispatch.call_path``);
* the thread's next dispatch on one of its chains, which waits for the
  chain's last computation before handing its token on
  (``threads.ThreadTokens.tokens_for``), and the thread's barrier
  (``threads.ThreadTokens.settle``);
* the watcher (:func:`watch`), a daemon thread that follows computations
  in flight device by device: an execution whose successor on a chain was
  dispatched before it ended (the successor's effects wait for it on the
  host: ``host_jobs``, gated lanes), and a computation over several
  devices whose first device may wait inside the computation for a job
  (an effect with results behind a summarized print), which can only end
  once that job does, so its failure elsewhere must be learnt while it
  runs.

Its part in the token calling convention: an execution is named by its
slot and, per chain, its sequence number (``token_value``).
"""
from __future__ import annotations

import threading

import jax

from jax_effects._runtime import bars as _bars
from jax_effects._runtime import fork as _fork
from jax_effects._runtime import host_jobs as _host_jobs


def failed(slot: int, chains: dict, ended: bool = True) -> None:
  """The execution of ``slot`` on ``chains`` (chain -> its sequence
  number there) failed: free what the host kept for it (idempotent:
  several may learn of one failure). ``ended``: it has ended on every
  device (else its later effects, still to come, are skipped until
  ``host_jobs.retire``)."""
  if not chains:
    return
  _host_jobs.cancel(slot, chains, ended)
  _bars.close_for(slot, tuple(chains))


def slot_freed(slot: int) -> None:
  """``slot`` is freed (``threads``: its thread ended, its computations
  completed, its errors reported): drop what is still kept under it."""
  _host_jobs.forget(slot)
  _bars.close_for(slot)


# --- the watcher -----------------------------------------------------------------

_lock = threading.Condition()
_watched: list = []   # [_Watch]
_thread: threading.Thread | None = None
#: Set by :func:`stop` while it ends the watcher thread.
_stopping = False
#: Seconds between two looks at the computations watched (a look is an
#: ``is_ready`` per device); the first looks come sooner.
_POLL_S = 0.01


class _Watch:
  __slots__ = ("shards", "on_end", "early")

  def __init__(self, shards, on_end, early):
    self.shards = shards
    self.on_end = on_end
    self.early = early


def watch(token, on_end, early: bool = False) -> None:
  """Calls ``on_end(failed, running)`` once the computation that returns
  ``token`` has ended (on every device: done, or failed; ``running``
  False), from the watcher thread (or a barrier's :func:`settle`); with
  ``early``, as soon as one device's part has failed (its first device may
  be waiting inside the computation for what the failure cancels;
  ``running`` says whether some part still runs)."""
  global _thread
  if isinstance(token, jax.Array):
    shards = [s.data for s in token.addressable_shards]
  else:   # (a NumPy initial token: ended)
    on_end(False, False)
    return
  with _lock:
    _watched.append(_Watch(shards, on_end, early))
    if _thread is None and not _stopping:
      _thread = threading.Thread(target=_run, name="jax_effects-watcher",
                                 daemon=True)
      try:
        _thread.start()
      except RuntimeError:
        # Python 3.12+ starts no thread once the interpreter is shutting
        # down (a dispatch from an exit handler): what is watched stays for
        # a barrier's settle (``exit.report_late`` waits for everything).
        _thread = None
    _lock.notify()


def _state(item: _Watch):
  """``(failed, running)``: whether a device's part failed, and whether
  some part still runs; None while it runs with no failure, or with one
  that the item does not ask for early."""
  running = False
  failed = False
  for shard in item.shards:
    try:
      if not shard.is_ready():
        running = True
        continue
      shard.block_until_ready()
    except Exception:  # noqa: BLE001 - that device's part failed
      failed = True
  if running and not (failed and item.early):
    return None
  return failed, running


def _look(items) -> bool:
  """Calls ``on_end`` of each of ``items`` whose computation has ended (or
  failed, if asked early), once: an item is taken out of the watched list
  by whoever looks first (the watcher, or a barrier: :func:`settle`).
  Returns whether any was."""
  any_done = False
  for item in items:
    state = _state(item)
    if state is None:
      continue
    with _lock:
      try:
        _watched.remove(item)   # (identity: _Watch defines no __eq__)
      except ValueError:
        continue   # (taken by another look)
    any_done = True
    try:
      item.on_end(*state)
    except Exception:  # noqa: BLE001 - a bug of ours: keep watching
      import traceback
      traceback.print_exc()
  return any_done


def _run() -> None:
  delay = 0.0005
  while True:
    with _lock:
      while not _watched and not _stopping:
        delay = 0.0005
        _lock.wait()
      if _stopping:
        return
      items = list(_watched)
    if _look(items):
      delay = 0.0005
    with _lock:
      if _watched and not _stopping:
        _lock.wait(delay)
        delay = min(delay * 2, _POLL_S)


def stop() -> None:
  """Ends the watcher thread and waits until it has (interpreter exit,
  once everything dispatched has ended: ``exit``). A daemon thread inside
  a jaxlib call that releases the GIL (``block_until_ready``) when the
  interpreter finalizes is ended by CPython from within jaxlib's C++, which
  aborts the process ("FATAL: exception not rethrown"); so none may be left
  there. What is still watched stays for a barrier's :func:`settle`; a
  later :func:`watch` starts a new thread."""
  global _thread, _stopping
  with _lock:
    thread = _thread
    if thread is None or thread is threading.current_thread():
      return
    _stopping = True
    _lock.notify_all()
  try:
    thread.join()
  finally:
    with _lock:
      _stopping = False
      if _thread is thread:
        _thread = None


def settle() -> None:
  """Acts now on every watched computation that has ended (a barrier, once
  the computations it waited for have: what they kept is freed before it
  returns, not at the watcher's next look)."""
  with _lock:
    items = list(_watched)
  _look(items)


def watch_failure(slot: int, chains: dict, token) -> None:
  """Follows a computation over several devices on ``chains`` (chain ->
  sequence number) of ``slot``, where a call site assembles operands on
  the host: :func:`failed` as soon as one device's part has failed;
  once every device's part has ended without failing, what the host kept
  to skip the later effects of a job that failed goes
  (``host_jobs.retire``)."""
  def on_end(failed_: bool, running: bool) -> None:
    if failed_:
      # Its later effects, still to come, are skipped (its lanes stay, as
      # tombstones). Never "ended" here: XLA may mark every device's
      # results failed while a device still runs its part (seen on JAX
      # 0.8-0.10 under load); a barrier, the chain's next execution or the
      # slot's end retires them (host_jobs).
      failed(slot, chains, ended=False)
    else:   # (ended: a job of it that failed no longer needs its lane)
      _host_jobs.retire(slot, chains)

  watch(token, on_end, early=True)


def watched() -> int:
  """Computations followed now that have not ended (for tests: one that
  ended leaves the watcher at its next look)."""
  with _lock:
    items = list(_watched)
  return sum(1 for item in items if _state(item) is None)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  """A forked child follows none of the parent's computations, and has no
  watcher thread (it starts one when it needs one)."""
  global _lock, _thread, _stopping
  _lock = threading.Condition()
  _watched.clear()
  _thread = None
  _stopping = False

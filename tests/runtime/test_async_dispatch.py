"""Asynchronous dispatch on CPU (``design/host_target.md``, "Asynchronous
dispatch"; ``design/errors.md``, "Who raises a callback's error").

A ``jax_effects.jit`` computation that XLA's CPU client does not find cheap
is dispatched asynchronously, as plain ``jax.jit``'s: the call returns
before the computation (and its callbacks, on one of XLA's threads) has run.
Ordering and ``effects_barrier()`` are unchanged; a callback's error is
raised by the thread's next call (before it runs anything) or barrier.
Observed without timing: a callback blocked on an event the caller sets
after the call returned (a computation that runs the user's own function
is waited for by its call at most ``launch_lock.FINISH_WAIT_S``, then the
call returns: ``test_callback_reentry.py``); every wait is bounded.
"""
import threading

import jax.numpy as jnp
import pytest

import jax_effects as je
from helpers import Boom
from jax_effects._runtime import launch_lock

#: Bound of every wait (seconds): a wait that ends by timing out fails.
WAIT_S = 20
X = jnp.ones((128, 128)) / 128   # x @ x: millions of flops (not "cheap")


def _not_cheap(callback):
  """A function calling ``callback`` on ``x[0, 0]`` and returning ``x @ x``:
  dispatched asynchronously, its callback on one of XLA's threads."""
  @je.jit
  def f(x):
    je.callback(callback, None, x[0, 0])
    return x @ x
  return f


def test_a_call_returns_while_its_callback_is_still_blocked():
  started, release = threading.Event(), threading.Event()
  waited = []

  def blocked(v):
    started.set()
    waited.append(release.wait(WAIT_S))   # False: it timed out

  f = _not_cheap(blocked)
  release.set()
  f(X)   # (compiles)
  je.effects_barrier()
  started.clear()
  release.clear()
  out = f(X)   # returns while the callback waits for the release
  assert started.wait(WAIT_S)
  release.set()
  je.effects_barrier()
  assert waited == [True, True]   # neither wait timed out
  assert float(out[0, 0]) == pytest.approx(1 / 128)


def test_async_effects_keep_program_order_across_calls(effects_capture):
  @je.jit
  def f(x, i):
    je.print("start {}", i)
    y = x @ x
    je.print("end {} {:.4f}", i, y[0, 0])
    return y

  outs = [f(X, i) for i in range(20)]
  je.effects_barrier()
  assert effects_capture.printed == [
      line for i in range(20) for line in (f"start {i}", f"end {i} 0.0078")]
  assert all(float(o[0, 0]) == pytest.approx(1 / 128) for o in outs)


def _failing_function(ran, done):
  @je.jit
  def f(x, k):
    def host(k):
      ran.append(int(k))
      done.set()
      if k == 1:
        raise Boom("callback 1")
    je.callback(host, None, k)
    return x @ x
  return f


def test_an_async_callback_error_is_raised_by_the_next_call_before_it_runs():
  ran, done = [], threading.Event()
  f = _failing_function(ran, done)
  f(X, 0)
  je.effects_barrier()
  done.clear()
  out = f(X, 1)   # returns: its callback runs after the call returned
  assert out.shape == (128, 128)
  assert done.wait(WAIT_S)
  with pytest.raises(Boom, match="callback 1"):
    f(X, 2)   # raises it before dispatching anything: callback 2 never runs
  f(X, 3)
  je.effects_barrier()   # (reported once: nothing left)
  assert ran == [0, 1, 3]


def test_an_async_callback_error_is_raised_by_the_barrier_once():
  ran, done = [], threading.Event()
  f = _failing_function(ran, done)
  f(X, 0)
  je.effects_barrier()
  f(X, 1)   # returns normally
  with pytest.raises(Boom, match="callback 1"):
    je.effects_barrier()
  je.effects_barrier()
  assert ran == [0, 1]


def test_a_call_inside_a_callback_does_not_wait_for_its_computation(
    monkeypatch):
  """A call made by a host callback returns without waiting for its own
  computation, even one that runs user code (``launch_lock.finish``): here
  that code waits for the callback, so waiting for it would hold both until
  ``FINISH_WAIT_S`` (made 600 s; the inner callback gives up after
  ``WAIT_S``, which fails the test)."""
  monkeypatch.setattr(launch_lock, "FINISH_WAIT_S", 600.0)
  release = threading.Event()
  got = []

  def inner_callback(v):
    got.append(release.wait(WAIT_S))

  inner = _not_cheap(inner_callback)

  def outer_callback(v):
    inner(X)   # (on one of XLA's threads)
    release.set()

  outer = _not_cheap(outer_callback)
  release.set()
  inner(X)   # (compiles)
  je.effects_barrier()
  release.clear()
  outer(X)
  je.effects_barrier(all_threads=True)   # (inner's: an XLA thread's call)
  assert release.is_set()
  assert got == [True, True]   # the inner callback's wait did not time out

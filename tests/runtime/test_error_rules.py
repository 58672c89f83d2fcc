"""The rules of the error contract that ``_runtime/errors`` owns
(``design/errors.md``, "Who raises a callback's error, when, how often" and
"One rule for what a failure stops"), one test each: where a deferred error
is raised (the next call, before it dispatches anything; the barrier), how
often (once), together (one group), bounded (64 kept), whose (a call made
inside a call raises its own), and what a failure stops (its own chain in
its own execution, nothing else).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import helpers
import jax_effects as je
from jax_effects._runtime import errors as _errors


def _per_device_failure(mesh, fail_at):
  """A shard_map program whose callback fails on device ``fail_at``: its
  error is deferred (the computation runs on XLA's threads)."""
  def host(x):
    if int(np.asarray(x).ravel()[0]) == fail_at:
      raise helpers.Boom(f"device {fail_at}")

  return je.jit(jax.shard_map(
      lambda x: (je.callback(host, None, x), x)[1], mesh=mesh,
      in_specs=P("i"), out_specs=P("i")))


def test_the_next_call_raises_a_deferred_error_before_it_dispatches(mesh):
  ran = []
  f = _per_device_failure(mesh, 3)

  @je.jit
  def g(x):
    je.callback(lambda v: ran.append(int(v)), None, x)
    return x

  def go():
    g(jnp.int32(0))   # (warm: its dispatch, not its first call, raises)
    je.effects_barrier()
    ran.clear()
    jax.block_until_ready(f(jnp.arange(8.0)))   # (its callbacks ran)
    with pytest.raises(helpers.Boom, match="device 3"):
      g(jnp.int32(1))   # raises the earlier error, runs nothing
    assert ran == []
    g(jnp.int32(2))      # retried: runs once
    je.effects_barrier()
    return list(ran)

  assert helpers.in_thread(go) == [2]


def test_a_deferred_error_is_raised_by_the_barrier_once(mesh):
  f = _per_device_failure(mesh, 5)

  def go():
    f(jnp.arange(8.0))
    with pytest.raises(helpers.Boom, match="device 5"):
      je.effects_barrier()
    je.effects_barrier()   # once: nothing left

  helpers.in_thread(go)


def test_several_errors_pending_are_one_report_and_at_most_64_are_kept(mesh):
  # One execution, 10 chains x 8 devices, every callback failing: 80
  # errors, one report, 64 kept and 16 counted.
  def host(x):
    raise helpers.Boom(f"device {int(np.asarray(x).ravel()[0])}")

  def body(x):
    for i in range(10):
      je.callback(host, None, x, effect=je.Effect(f"rules-cap-{i}"))
    return x

  f = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                           out_specs=P("i")))

  def go():
    f(jnp.arange(8.0))
    return helpers.reports(je.effects_barrier)

  @je.jit
  def once(x):
    je.callback(host, None, x[0], effect=je.Effect("rules-cap-0"))
    return x

  def go_twice():
    first = go()
    # The thread's next failure is reported alone: the count of errors
    # dropped from the first report went with that report.
    return first, helpers.reports(lambda: once(jnp.arange(8.0) + 3.0))

  (report,), (later,) = helpers.in_thread(go_twice)
  assert _errors.count(report) == 80
  assert len(_errors.flat_errors(report)) == _errors.MAX_KEPT_ERRORS
  assert report.jax_effects_dropped == 80 - _errors.MAX_KEPT_ERRORS
  assert type(later) is helpers.Boom and str(later) == "device 3"
  assert not _errors._dropped


def test_a_call_made_inside_a_call_raises_its_own_errors_only():
  seen = []

  @je.jit
  def inner(x):
    je.callback(lambda v: (_ for _ in ()).throw(helpers.Boom("inner")),
                None, x)
    return x

  def host(x):
    try:
      inner(x)
    except helpers.Boom as err:
      seen.append(str(err))

  @je.jit
  def outer(x):
    je.callback(lambda v: (_ for _ in ()).throw(helpers.Boom("outer first")),
                None, x, effect=je.Effect("err-rules-other"))
    je.callback(host, None, x)
    return x

  def go():
    with pytest.raises(helpers.Boom, match="outer first"):
      outer(jnp.int32(1))
    je.effects_barrier()

  helpers.in_thread(go)
  assert seen == ["inner"]   # the inner call raised the inner error only


def test_a_failure_stops_its_own_chain_in_its_own_execution_only(
    effects_capture):
  a, b = je.Effect("rules-a"), je.Effect("rules-b")

  @je.jit
  def f(x, fail):
    je.print("a before {}", x, effect=a)
    je.callback(lambda v: (_ for _ in ()).throw(helpers.Boom("a"))
                if bool(v) else None, None, fail, effect=a)
    je.print("a after {}", x, effect=a)
    je.print("b {}", x, effect=b)
    return x

  def go():
    f(jnp.int32(1), jnp.bool_(False))
    with pytest.raises(helpers.Boom):
      f(jnp.int32(2), jnp.bool_(True))
    f(jnp.int32(3), jnp.bool_(False))
    je.effects_barrier()

  helpers.in_thread(go)
  printed = effects_capture.printed
  assert [p for p in printed if p.startswith("a")] == [
      "a before 1", "a after 1", "a before 2", "a before 3", "a after 3"]
  assert [p for p in printed if p.startswith("b")] == ["b 1", "b 2", "b 3"]

"""Progress bars close when their execution fails (issue 31, case 5).

As ``with tqdm(...)`` closes its bar when the block raises: a bar whose
execution fails in XLA (a ``jax.pure_callback`` raising in the loop), or
whose loop has a callback error, is closed (cleanup effects always run, the
contract's C6). Many failing executions leave no bar open: none in the
runtime's registry, no ``tqdm`` instance (a leaked instance keeps its
screen position, so every later bar is drawn lower, and a notebook widget
stays "running"). Each error is reported once, as usual.

Bars closing on an interrupt (Ctrl-C): ``tests/runtime/test_interrupts.py``.
The scenario (the three kinds of failure in turn, each reporting its
own result) runs in a fresh process (``helpers.run_scenario``).
"""
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_effects as je

import helpers
from helpers import Injected, run_scenario

#: (8: each bar a failed execution leaves open, and each failure reported
#: twice, shows at any count)
EXECUTIONS = helpers.scale(8, 300)
FAILING_STEP = 3
FAILING_DEVICE = 3


KINDS = ["callback-error", "xla-failure", "xla-failure-in-shard_map"]


def scenario_bars_close_on_failure(executions: int) -> dict:
  """For each kind of failure, in turn, and ``every`` 1 and 4 (one host
  call per update, or counted on the device): what ``executions`` failing
  executions reported and left."""
  return {kind: {every: _failing_bars(kind, every, executions)
                 for every in (1, 4)} for kind in KINDS}


def _failing_bars(kind: str, every: int, executions: int) -> dict:
  sink = io.StringIO()
  raised = []   # the callback errors raised, each to be reported once

  def step_callback(i):
    if int(i) == FAILING_STEP:
      raised.append(Injected(f"step {int(i)}"))
      raise raised[-1]

  def step_pure(i):
    if int(np.asarray(i).ravel()[0]) == FAILING_STEP:
      raise Injected(f"step {FAILING_STEP} fails in XLA")
    return i

  def loop(x, device=None):
    with je.progress(10, file=sink, every=every) as bar:
      def body(i, c):
        if kind == "callback-error":
          je.callback(step_callback, None, i)
        else:
          # (on every device but FAILING_DEVICE, 100 + i: never fails)
          j = i if device is None else jnp.where(device == FAILING_DEVICE,
                                                 i, 100 + i)
          c = c + jax.pure_callback(step_pure,
                                    jax.ShapeDtypeStruct((), jnp.int32), j)
        bar.update()
        return c + 1
      return lax.fori_loop(0, 10, body, x)

  if kind == "xla-failure-in-shard_map":
    mesh = Mesh(np.array(jax.devices()), ("i",))
    f = je.jit(jax.shard_map(
        lambda v: loop(v[0], lax.axis_index("i"))[None], mesh=mesh,
        in_specs=P("i"), out_specs=P("i")))
    x = jax.device_put(np.zeros(8, np.int32), NamedSharding(mesh, P("i")))
  else:
    f = je.jit(loop)
    x = jnp.int32(0)
  reports = []   # (execution, what): every report, by a call/result/barrier
  for n in range(executions):
    try:
      jax.block_until_ready(f(x))
    except BaseException as exc:  # noqa: BLE001 - the observation
      reports.append((n, exc))
    try:
      je.effects_barrier()
    except BaseException as exc:  # noqa: BLE001 - the observation
      reports.append((n, exc))
  errors = [e for _, r in reports for e in helpers.flat(r)]
  return dict(
      executions_reported=sorted({n for n, _ in reports}),
      errors=len(errors),
      callback_errors_once=(kind != "callback-error" or (
          len(errors) == len(raised)
          and {id(e) for e in errors} == {id(e) for e in raised})),
      # (XLA's error for the failed execution, whose message holds the
      # callback's: a JaxRuntimeError, or a ValueError from JAX's C++ path)
      xla_errors=sum("fails in XLA" in str(e) for e in errors),
      left=helpers.leftovers(helpers.runtime_inventory()))


def test_bars_close_when_their_execution_fails():
  # Before the fix: every failed execution left its bar open (30 executions:
  # open_bars 30, tqdm_bars 30, every=1 and 4 alike; in shard_map 30 each),
  # and in shard_map the barrier reported each XLA failure again (60).
  # (One fresh process runs the kinds in turn; each reports its own.)
  got = run_scenario(__file__, "scenario_bars_close_on_failure", EXECUTIONS)
  assert sorted(got.result) == sorted(KINDS)
  for kind in KINDS:
    for every, r in got.result[kind].items():
      assert r["left"] == {}, (
          f"{kind}, every={every}: {EXECUTIONS} failed executions left "
          f"{r['left']}")
      # each execution's failure reported (once: callback errors by
      # identity, an XLA failure by its call alone)
      assert r["executions_reported"] == list(range(EXECUTIONS)), (kind, r)
      assert r["callback_errors_once"], (kind, r)
      if kind != "callback-error":
        assert r["errors"] == r["xla_errors"] == EXECUTIONS, (kind, every, r)

"""One contract, every entry: effects of ours under plain ``jax.jit`` (any
library's jit), eagerly, and under ``jax_effects.jit`` write the same lines
in the same order, within a call and across a thread's calls, on one device
or many (issue 46; ``design/errors.md``, "Plain ``jax.jit``").

Each test runs the same program under the entries and compares the lines
(and, where it is defined, with ``jax.disable_jit()``'s).
"""
import re
import threading
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_effects as je
import helpers

ENTRIES = {"ours": je.jit, "plain": jax.jit, "eager": lambda f: f}
PREFIX = re.compile(r"^\[device (\d+) shard \S+ process \d+\] ")


def _run(effects_capture, entry: str, f, *calls) -> list:
  """The lines ``f`` under ``entry`` prints over ``calls`` (argument tuples),
  called one after another before one barrier."""
  effects_capture.clear()
  g = ENTRIES[entry](f)
  for args in calls:
    g(*args)
  je.effects_barrier()
  return list(effects_capture.printed)


def _same_everywhere(effects_capture, f, *calls, eager=True) -> list:
  got = {e: _run(effects_capture, e, f, *calls) for e in ENTRIES
         if eager or e != "eager"}
  assert got["plain"] == got["ours"], got
  if eager:
    assert got["eager"] == got["ours"], got
  return got["ours"]


# --- 1. nothing lost in a while_loop's cond_fun --------------------------------

def test_cond_fun_print_with_a_loop_invariant_operand(effects_capture):
  # XLA knows this loop's trip count and skipped its condition computation
  # (and the print in it) under plain jax.jit.
  def f(x):
    def cond(c):
      je.print("cond y={}", c[1])
      return c[0] < 3
    return jax.lax.while_loop(cond, lambda c: (c[0] + 1, c[1]), (0, x))
  lines = _same_everywhere(effects_capture, f, (5,), (6,))
  assert lines == ["cond y=5"] * 4 + ["cond y=6"] * 4
  with jax.disable_jit():
    assert _run(effects_capture, "eager", f, (5,), (6,)) == lines


def test_cond_fun_print_beside_jax_ordered_print_in_the_body(effects_capture):
  def f(x):
    def cond(c):
      je.print("cond {}", c[1])
      return c[0] < 2
    def body(c):
      jax.debug.print("body {}", c[0], ordered=True)
      return c[0] + 1, c[1]
    return jax.lax.while_loop(cond, body, (0, x))
  lines = _same_everywhere(effects_capture, f, (7,), eager=False)
  assert [l for l in lines if l.startswith("cond")] == ["cond 7"] * 3


def test_vmapped_while_runs_effects_for_live_elements_only(effects_capture):
  def f(ns):
    def one(n):
      def cond(i):
        je.print("cond n={} i={}", n, i)
        return i < n
      def body(i):
        je.print("body n={} i={}", n, i)
        return i + 1
      return jax.lax.while_loop(cond, body, 0)
    return jax.vmap(one)(ns)
  lines = _same_everywhere(effects_capture, f, (jnp.array([1, 3]),))
  # (element 0 stops after one step: no line of it after its last cond)
  assert lines.count("body n=1 i=0") == 1 and "body n=1 i=1" not in lines
  assert lines.count("cond n=1 i=1") == 1
  assert [l for l in lines if "n=3" in l] == [
      "cond n=3 i=0", "body n=3 i=0", "cond n=3 i=1", "body n=3 i=1",
      "cond n=3 i=2", "body n=3 i=2", "cond n=3 i=3"]


# --- 2. per-device lines in order, within a call and across calls --------------

def _sharded_program(mesh):
  def body(x):
    je.print("dev {}", x[0])
    return x * 2

  def f(x, i):
    je.print("before {}", i)
    y = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
    je.print("after {}", i)
    return y
  return f


def _check_per_device_order(lines, calls):
  """Each call's 8 device lines between its before and after lines, and
  nothing of a call after the next call's first line."""
  at = 0
  for i in calls:
    assert lines[at] == f"before {i}", lines
    devices = lines[at + 1:at + 9]
    assert all(PREFIX.match(l) for l in devices), lines
    assert sorted(PREFIX.sub("", l) for l in devices) == [
        f"dev {float(d)}" for d in range(8)], lines
    assert lines[at + 9] == f"after {i}", lines
    at += 10
  assert at == len(lines), lines


@pytest.mark.parametrize("entry", ["plain", "ours"])
def test_per_device_lines_never_overtaken(mesh, effects_capture, entry):
  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
  f = _sharded_program(mesh)
  for _ in range(helpers.scale(4, 12)):
    calls = list(range(3))
    lines = _run(effects_capture, entry, f, *[(x, i) for i in calls])
    _check_per_device_order(lines, calls)


@pytest.mark.parametrize("entry", ["plain", "ours"])
def test_deterministic_sorts_per_device_lines(mesh, effects_capture, entry):
  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
  f = _sharded_program(mesh)
  with je.deterministic():
    lines = _run(effects_capture, entry, f, (x, 0), (x, 1))
  want = []
  for i in range(2):
    want += [f"before {i}",
             *[f"[device {d} shard {d} process 0] dev {float(d)}"
               for d in range(8)], f"after {i}"]
  assert lines == want


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_deterministic_releases_held_lines_before_a_user_callback(
    mesh, capsys, entry):
  # A callback that runs once after a shard_map writes after every device's
  # lines (its own writes cannot be held); under jax_effects.jit it came
  # first (the lines were released only at the next effect of ours).
  def body(x):
    je.print("device {}", x[0])
    return x

  def f(x):
    y = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
    je.callback(lambda s: print(f"callback after {s}"), None, y.sum())
    return y
  x = jax.device_put(jnp.arange(8), NamedSharding(mesh, P("i")))
  capsys.readouterr()
  with je.deterministic():
    ENTRIES[entry](f)(x)
    je.effects_barrier()
  assert capsys.readouterr().out.splitlines() == [
      *[f"[device {d} shard {d} process 0] device {d}" for d in range(8)],
      "callback after 28"]


def test_entries_mixed_on_one_thread_keep_call_order(mesh, effects_capture):
  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
  f = _sharded_program(mesh)
  plain, ours = jax.jit(f), je.jit(f)

  @je.jit
  def single(i):
    je.print("single {}", i)
  for _ in range(helpers.scale(3, 10)):
    effects_capture.clear()
    ours(x, 0)
    plain(x, 1)
    single(2)
    ours(x, 3)
    plain(x, 4)
    je.print("eager {}", 5)
    je.effects_barrier()
    lines = effects_capture.printed
    # (a sharded call's lines: before, its 8 device lines, after)
    _check_per_device_order(lines[:20], [0, 1])
    assert lines[20] == "single 2", lines
    _check_per_device_order(lines[21:41], [3, 4])
    assert lines[41:] == ["eager 5"], lines


# --- 3. barriers wait for everything, from any thread --------------------------

@pytest.mark.parametrize("barrier", ["jax", "ours_all_threads"])
def test_barrier_on_another_thread_waits_for_plain_jit_effects(mesh, barrier):
  ran = []

  def slow(v):
    time.sleep(0.05)
    ran.append(int(v))

  def body(x):
    je.callback(slow, None, x[0])
    return x + 1
  f = jax.jit(lambda x: jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                                      out_specs=P("i"))(x))
  x = jax.device_put(jnp.arange(8), NamedSharding(mesh, P("i")))
  f(x).block_until_ready()
  je.effects_barrier()
  ran.clear()
  f(x)
  seen = []

  def wait():
    if barrier == "jax":
      jax.effects_barrier()
    else:
      je.effects_barrier(all_threads=True)
    seen.append(len(ran))
  t = threading.Thread(target=wait)
  t.start()
  t.join()
  assert seen == [8]


# --- 4. a callback may use JAX, and nothing hangs -------------------------------

@pytest.mark.parametrize("entry", ["plain", "eager"])
@pytest.mark.parametrize("kind", ["ours", "debug"])
def test_callback_using_jax_dispatched_far_ahead_never_hangs(entry, kind):
  # JAX's issue-25861 program under plain jax.jit and eagerly: a fresh
  # process, bounded.
  proc = helpers.run_script(f"""
      import faulthandler, functools
      faulthandler.dump_traceback_later(150, exit=True)
      import jax, jax.numpy as jnp
      import jax_effects as je
      calls = []
      def uses_jax(i):
        calls.append(1)
        return jnp.asarray(i) == 20
      def run(pos):
        def step(v):
          i, pos = v
          if {kind!r} == "debug":
            jax.debug.callback(uses_jax, i + 1)
          else:
            je.callback(lambda i: (uses_jax(i), None)[1], None, i + 1)
          return i + 1, pos + 1
        return jax.lax.while_loop(lambda v: v[0] < 20, step,
                                  (jnp.array(0), pos))[1]
      if {entry!r} == "plain":
        run = jax.jit(run)
      xs = jax.random.normal(jax.random.key(0), (40, 64, 64))
      outs = [run(x) for x in xs]
      total = functools.reduce(lambda a, b: a + b, outs)
      jax.block_until_ready(total)
      je.effects_barrier()
      print("done", len(calls))
      """, timeout=200)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout.split() == ["done", str(40 * 20)], proc.stderr[-4000:]

"""``jax.jit = jax_effects.jit``: the drop-in applied to code one does not own.

jax_effects calls JAX's own functions (``jax_effects/_jax_api.py``), never
the names in the ``jax`` namespace at call time, so replacing ``jax.jit``
(and ``jax.effects_barrier``) by jax_effects' drop-ins globally makes every
``jax.jit`` in the program a ``jax_effects.jit`` without jax_effects calling
itself (``design/thirdparty.md``, "jax_effects never calls the replaced
names"; else it would recurse until ``RecursionError``). Oracle: the
same program with JAX's ``jax.jit`` under ``jax.disable_jit()`` (everything
eager, in program order). ``tox -e thirdparty`` runs whole third-party
suites this way (``tests/thirdparty/``).
"""
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.sharding import Mesh, PartitionSpec as P

import jax_effects as je
from jax_effects._dispatch import function as _function

from helpers import run_script

JAX_JIT = jax.jit


def _program(record):
  """Builds the program, reading ``jax.jit`` as it is now (as a library
  written against JAX does when its module or function is defined)."""

  @jax.jit
  def inner(y):
    jax.debug.print("inner {}", y)
    return jnp.sin(y) + 1.0

  @jax.jit
  def step(x):
    jax.debug.print("start {}", x)
    je.print("je {}", x)

    def body(i, c):
      io_callback(lambda i_, c_: record.append(("loop", int(i_), float(c_))),
                  None, i, c, ordered=True)
      return inner(c) * 0.5   # a nested jit, inside a loop

    c = lax.fori_loop(0, 3, body, x)
    c = lax.cond(c > 0.5, inner, lambda v: v - 1.0, c)

    def scan_body(carry, v):
      jax.debug.print("scan {}", v)
      return carry + v, carry

    total, _ = lax.scan(scan_body, c, jnp.arange(3.0))
    # jax.numpy / jax.nn functions that JAX jits internally
    v = jax.nn.softmax(jnp.arange(3.0) * total)
    n = jnp.linalg.norm(jnp.cumsum(v))
    jax.debug.print("end {} {}", total, n)
    return n + jnp.float32(total)

  return step, inner


def _run(step, record, capsys):
  outs = [float(step(jnp.float32(i) / 4)) for i in range(3)]
  je.effects_barrier()
  return outs, list(record), capsys.readouterr().out.splitlines()


def test_program_under_replaced_jax_jit_runs_as_without_jit(
    monkeypatch, capsys):
  record = []
  with jax.disable_jit():
    step, _ = _program(record)   # JAX's own jax.jit
    expected = _run(step, record, capsys)

  record.clear()
  monkeypatch.setattr(jax, "jit", je.jit)
  step, inner = _program(record)
  assert isinstance(step, _function.PjitFunction)
  assert isinstance(inner, _function.PjitFunction)
  got = _run(step, record, capsys)
  assert got[1:] == expected[1:]
  np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
  outs, events, lines = got
  assert [e[:2] for e in events] == [("loop", i) for _ in range(3)
                                      for i in range(3)]
  assert [l.split()[0] for l in lines] == (
      ["start", "je", "inner", "inner", "inner", "inner",
       "scan", "scan", "scan", "end"] * 3)

  # Calling again reuses what was compiled, and a nested jit alone works.
  again = [float(step(jnp.float32(i) / 4)) for i in range(3)]
  je.effects_barrier()
  np.testing.assert_allclose(again, outs)
  assert float(inner(jnp.float32(0))) == 1.0
  je.effects_barrier()
  assert capsys.readouterr().out.splitlines()[-1] == "inner 0.0"


def test_library_calls_none_of_the_replaced_jax_names(monkeypatch, capsys):
  # What a user replaced in the jax namespace is never called by
  # jax_effects itself: not jit, effects_barrier (both replaced by the
  # drop-ins, which would recurse), make_jaxpr or shard_map (counted).
  calls = []

  def counting(name, fun):
    def wrapper(*args, **kwargs):
      calls.append(name)
      return fun(*args, **kwargs)
    return wrapper

  shard_map = jax.shard_map
  monkeypatch.setattr(jax, "jit", je.jit)
  monkeypatch.setattr(jax, "effects_barrier", je.effects_barrier)
  monkeypatch.setattr(jax, "make_jaxpr", counting("make_jaxpr", jax.make_jaxpr))
  monkeypatch.setattr(jax, "shard_map", counting("shard_map", jax.shard_map))

  def per_element(x):   # an effect in a cond whose predicate vmap batches
    return lax.cond(x > 1, lambda v: je.print("big {}", v) or v,
                    lambda v: v, x)

  mesh = Mesh(np.array(jax.devices()[:2]), ("i",))

  def per_device(x):
    jax.debug.print("shard {}", x)
    return x * 2

  @jax.jit
  def f(x):
    y = jax.vmap(per_element)(x)
    z = shard_map(per_device, mesh=mesh, in_specs=P("i"),
                  out_specs=P("i"))(y)
    je.print("once {}", z.sum())   # once, on the first of two devices
    return z

  out = f(jnp.arange(4, dtype=jnp.int32))
  jax.effects_barrier()   # jax_effects.effects_barrier, which calls JAX's
  np.testing.assert_array_equal(out, [0, 2, 4, 6])
  lines = capsys.readouterr().out.splitlines()
  assert lines[:2] == ["big 2", "big 3"]
  assert sorted(lines[2:4]) == ["shard [0 1]", "shard [2 3]"]
  assert lines[4:] == ["once 12"]
  assert calls == []


def test_replaced_before_jax_effects_is_imported():
  # A script replacing jax.jit by a wrapper that imports jax_effects lazily,
  # before jax_effects is imported: jax_effects still finds JAX's own jit.
  code = textwrap.dedent("""
      import jax
      import jax.numpy as jnp

      def jit(fun=None, **kwargs):
        import jax_effects
        return jax_effects.jit(fun, **kwargs)

      jax.jit = jit

      @jax.jit
      def f(x):
        jax.debug.print("f {}", x)
        return jax.jit(lambda v: v + 1)(x) * 2

      for i in range(3):
        f(jnp.int32(i))
      import jax_effects
      jax_effects.effects_barrier()
      print("type", type(f).__module__)
  """)
  out = run_script(code)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.splitlines() == [
      "f 0", "f 1", "f 2", f"type {_function.__name__}"]


def test_jax_api_holds_jaxs_public_functions():
  # _compat takes them from the JAX modules that define them; unreplaced,
  # the public names are the same objects (on every supported JAX line).
  from jax_effects import _jax_api
  assert _jax_api.jit is JAX_JIT
  assert _jax_api.make_jaxpr is jax.make_jaxpr
  assert _jax_api.shard_map is jax.shard_map
  assert _jax_api.effects_barrier is jax.effects_barrier
  assert _jax_api.io_callback is io_callback
  assert _jax_api.debug_callback is jax.debug.callback

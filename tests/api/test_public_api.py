"""The public API as ``docs/reference.md`` states it.

``print``, ``callback``, ``Effect``, ``effects_barrier`` and
``runtime_tokens`` at their simplest, and ``jax_effects.jit`` as a drop-in
for ``jax.jit`` (``design/architecture.md``, the ``_dispatch/function``
entry): the same options (static, donated and sharded arguments), tracing
as often, wrapper attributes, stages (``trace``/``lower``/``compile``),
copies, methods, ``jax.export``. Differential where possible: the same
function without its effects under ``jax.jit`` is the oracle for what the
stages show (the user's arguments and outputs, never the runtime-token
argument or result; ``design/tokens.md``, "At the ``jax.jit`` boundary").

Ordering through control flow: ``tests/pass/test_token_pass.py``; tokens
between calls: ``tests/dispatch/test_dispatch.py``; errors:
``tests/runtime/test_errors.py``.
"""
import copy
import inspect
import pickle
import re
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_effects as je
from jax_effects._dispatch.function import describe

import helpers


# --- print -------------------------------------------------------------------

def test_print_formats_like_jax_debug_print(effects_capture):
  @je.jit
  def f(x, y):
    je.print("x={}", x)
    je.print("y={y} x={x}", x=x, y=y)
    je.print("{0} {1} {0}", x, y)
    je.print("vec={v}", v=jnp.arange(3))
    je.print("tree={} {}", {"a": x}, "static")
    je.print("fmt={:.2f}", y)
    je.print("no args")
    return x + y

  out = f(jnp.int32(3), jnp.float32(1.5))
  assert out == 4.5
  assert effects_capture.printed == [
      "x=3", "y=1.5 x=3", "3 1.5 3", "vec=[0 1 2]", "tree={'a': Array(3, dtype=int32)} static",
      "fmt=1.50", "no args"]


def test_print_writes_one_line_per_call_to_stdout(capsys):
  @je.jit
  def f(x):
    je.print("a {}", x)
    je.print("b {}", x + 1)
    return x

  f(jnp.int32(1))
  f(jnp.int32(10))
  je.effects_barrier()
  assert capsys.readouterr().out == "a 1\nb 2\na 10\nb 11\n"


def test_print_outside_jit_prints_immediately(capsys):
  je.print("now {} {k}", 1, k=np.float32(2.5))
  # no barrier: eager printing is synchronous
  assert capsys.readouterr().out == "now 1 2.5\n"


def test_print_with_named_effect_and_unordered(effects_capture):
  @je.jit
  def f(x):
    je.print("named {}", x, effect=je.Effect("api-named"))
    je.print("unordered {}", x, ordered=False)
    return x

  f(1)
  assert sorted(effects_capture.printed) == ["named 1", "unordered 1"]


def test_print_rejects_arrays_that_are_not_numbers():
  with pytest.raises(TypeError, match=r"argument #0 is a NumPy array of dtype "
                                      r"<U1 \(str\)"):
    je.print("{}", np.array(["a"]))


# --- jit as a drop-in for jax.jit -----------------------------------------------

def test_jit_pytrees_in_and_out_and_kwargs(effects_capture):
  @je.jit
  def f(tree, *, scale):
    je.print("a={} scale={}", tree["a"], scale)
    return {"sum": tree["a"] + tree["b"][0] * scale, "pair": (tree["b"][1], 7)}

  out = f({"a": jnp.float32(1), "b": (jnp.float32(2), jnp.arange(2))},
          scale=jnp.float32(3))
  assert set(out) == {"sum", "pair"}
  assert out["sum"] == 7.0
  np.testing.assert_array_equal(out["pair"][0], [0, 1])
  assert out["pair"][1] == 7
  assert effects_capture.printed == ["a=1.0 scale=3.0"]


def test_jit_decorator_forms(effects_capture):
  @je.jit(static_argnums=1)
  def f(x, n):
    for i in range(n):
      je.print("i={} x={}", i, x)
    return x * n

  assert f(jnp.int32(2), 3) == 6
  assert effects_capture.printed == ["i=0 x=2", "i=1 x=2", "i=2 x=2"]
  g = je.jit(lambda x, n: x * n, static_argnums=(1,))
  assert g(jnp.int32(2), 4) == 8


def test_static_argnames_and_retrace_only_on_new_signature(effects_capture):
  traces = []

  def fun(x, mode):
    traces.append((x.shape, mode))
    je.print("{} {}", mode, x.sum())
    return x + (1 if mode == "inc" else -1)

  f = je.jit(fun, static_argnames="mode")
  f(jnp.zeros(2), mode="inc")
  warm = len(traces)
  assert warm == 1, "the first call traces the user function once"
  for _ in range(3):
    f(jnp.zeros(2), mode="inc")
  assert len(traces) == warm, "same signature must not retrace"
  f(jnp.zeros(3), mode="inc")
  assert len(traces) == warm + 1, "a new shape traces once"
  f(jnp.zeros(2), mode="dec")
  assert len(traces) == warm + 2, "a new static value traces once"
  f(jnp.zeros(3), mode="inc")
  f(jnp.zeros(2), mode="dec")
  assert len(traces) == warm + 2
  assert effects_capture.printed == [
      "inc 0.0", "inc 0.0", "inc 0.0", "inc 0.0", "inc 0.0", "dec 0.0",
      "inc 0.0", "dec 0.0"]


def test_pure_function_retraces_only_on_new_signature():
  traces = []

  @je.jit
  def f(x):
    traces.append(1)
    return x * 2

  for _ in range(3):
    f(jnp.ones(2))
  assert len(traces) == 1
  f(jnp.ones(3))
  assert len(traces) == 2


def test_donate_argnums(effects_capture):
  def fun(x):
    je.print("sum={}", x.sum())
    return x * 2

  f = je.jit(fun, donate_argnums=0)
  x = jnp.ones(4)
  y = f(x)
  np.testing.assert_array_equal(y, 2 * np.ones(4))
  assert x.is_deleted()
  assert effects_capture.printed == ["sum=4.0"]


def test_in_and_out_shardings(effects_capture):
  dev = jax.devices()[2]
  s = jax.sharding.SingleDeviceSharding(dev)

  def fun(x):
    je.print("x={}", x)
    return x + 1, x * 2

  f = je.jit(fun, in_shardings=s, out_shardings=(s, s))
  a, b = f(jnp.arange(2))
  assert a.sharding.device_set == {dev} and b.sharding.device_set == {dev}
  assert effects_capture.printed == ["x=[0 1]"]


def test_in_shardings_broadcast_with_static_argnums(effects_capture):
  dev = jax.devices()[4]
  s = jax.sharding.SingleDeviceSharding(dev)

  def fun(n, x, y):
    je.print("n={} x={} y={}", n, x, y)
    return x * n + y

  f = je.jit(fun, in_shardings=s, static_argnums=0)
  out = f(3, jnp.int32(1), jnp.int32(2))
  assert out == 5 and out.sharding.device_set == {dev}
  g = je.jit(fun, static_argnums=-3, donate_argnums=(1,))
  x = jnp.ones(2)
  np.testing.assert_array_equal(g(2, x, jnp.ones(2)), [3.0, 3.0])
  assert x.is_deleted()
  assert effects_capture.printed == ["n=3 x=1 y=2", "n=2 x=[1. 1.] y=[1. 1.]"]


def test_jit_wrapper_metadata():
  def fun(x):
    """doc"""
    return x

  f = je.jit(fun)
  assert f.__name__ == "fun" and f.__doc__ == "doc"
  assert f(jnp.int32(1)) == 1


def test_jit_rejects_non_callable_and_reserved_name():
  with pytest.raises(TypeError, match="callable"):
    je.jit(3)
  with pytest.raises(ValueError, match="__jax_effects_runtime_tokens__"):
    je.jit(lambda x: x, static_argnames="__jax_effects_runtime_tokens__")


# --- lowering text ----------------------------------------------------------

def _main_signature(text):
  return re.search(r"func\.func public @main\((.*?)\) ->", text).group(1)


def test_lower_chains_callbacks_through_the_carrier():
  @je.jit
  def f(x):
    je.print("one {}", x)
    y = x * 2
    je.print("two {}", y)
    je.callback(lambda v: None, None, y)
    return y

  text = f.lower(jnp.float32(1)).as_text()
  calls = re.findall(
      r"(%[\w#:]+) = stablehlo\.custom_call @" + helpers.HOST_CALL +
      r"\(([^)]*)\)(.*)", text)
  assert len(calls) == 3
  # The first callback takes the runtime-token argument, advanced to this
  # execution (token_value.advance: its sequence number, an `add` to the
  # argument and an `and`), as its carrier; the carrier operand of callback
  # i+1 is the carrier result of callback i (the data dependency that
  # orders them), and the last one's is the token the computation returns.
  # No custom call takes or returns a !stablehlo.token (the carrier orders
  # them; see threaded._threaded_lowering).
  signature = _main_signature(text)
  assert signature.startswith("%arg0: tensor<i32>")
  first_carrier = calls[0][1].split(",")[0].strip()
  (masked,) = re.findall(rf"{re.escape(first_carrier)} = stablehlo\.and "
                         r"(%\w+), %\w+", text)
  assert re.search(rf"{re.escape(masked)} = stablehlo\.add %arg0, ", text)
  prev = first_carrier
  for result, operands, rest in calls:
    assert "!stablehlo.token" not in rest
    first = operands.split(",")[0].strip()
    assert first == prev, (first, prev)
    prev = result.split(":")[0]
  (returned,) = re.findall(r"return (.*?) :", text)
  assert returned.split(",")[-1].strip() == prev
  # the token is not passed in
  assert "!stablehlo.token" not in signature


def test_pure_function_lowers_like_plain_jax_jit():
  def fun(x, y):
    return jnp.sin(x) * y

  x = jnp.ones(3)
  ours = je.jit(fun).lower(x, 2.0).as_text()
  theirs = jax.jit(fun).lower(x, 2.0).as_text()
  assert ours == theirs
  assert "token" not in ours and "callback" not in ours


def test_lower_with_shape_dtype_structs_and_compile(effects_capture):
  @je.jit
  def f(x):
    je.print("c {}", x)
    return x + 1

  lowered = f.lower(jax.ShapeDtypeStruct((), jnp.int32))
  assert helpers.HOST_CALL in lowered.as_text()
  compiled = lowered.compile()
  assert compiled(jnp.int32(4)) == 5
  assert compiled(jnp.int32(5)) == 6
  assert effects_capture.printed == ["c 4", "c 5"]


# --- callback ----------------------------------------------------------------

def test_callback_results_match_result_shape_dtypes():
  def host(x, *, y):
    assert isinstance(x, np.ndarray) and isinstance(y, dict)
    return {"s": x.sum() + y["k"], "v": (x * 2).astype(np.int32)}

  @je.jit
  def f(x):
    spec = {"s": jax.ShapeDtypeStruct((), jnp.float32),
            "v": jax.ShapeDtypeStruct((3,), jnp.int32)}
    return je.callback(host, spec, x, y={"k": jnp.float32(10)})

  out = f(jnp.arange(3, dtype=jnp.float32))
  assert out["s"].dtype == jnp.float32 and out["s"] == 13
  assert out["v"].dtype == jnp.int32
  np.testing.assert_array_equal(out["v"], [0, 2, 4])


def test_callback_none_result_and_python_scalars():
  seen = []

  @je.jit
  def f(x):
    r = je.callback(lambda v: seen.append(int(v)), None, x)
    assert r is None
    return je.callback(lambda: 7, jax.ShapeDtypeStruct((), jnp.int32))

  assert f(jnp.int32(5)) == 7
  je.effects_barrier()
  assert seen == [5]


def test_callback_outside_jit_runs_immediately():
  seen = []
  out = je.callback(lambda v: seen.append(v) or v + 1,
                    jax.ShapeDtypeStruct((), jnp.int32), 1)
  assert seen == [1] and out == 2


def test_callback_result_feeds_later_computation_in_order():
  log = []

  def counter():
    log.append("read")
    return np.int32(len(log))

  @je.jit
  def f(x):
    spec = jax.ShapeDtypeStruct((), jnp.int32)
    a = je.callback(counter, spec)
    je.callback(lambda v: log.append(("got", int(v))), None, a + x)
    b = je.callback(counter, spec)
    return a, b

  a, b = f(jnp.int32(100))
  je.effects_barrier()
  assert (int(a), int(b)) == (1, 3)
  assert log == ["read", ("got", 101), "read"]


# --- Effect --------------------------------------------------------------------

def test_effect_is_interned_hashable_immutable():
  a = je.Effect("api-eff")
  assert a is je.Effect("api-eff")
  assert a != je.Effect("api-other") and hash(a) == hash(je.Effect("api-eff"))
  assert repr(a) == "Effect('api-eff')"
  assert je.DEFAULT is je.Effect("default")
  with pytest.raises(AttributeError):
    a.name = "x"
  with pytest.raises(TypeError):
    je.Effect("")
  with pytest.raises(TypeError):
    je.Effect(3)


def test_effect_argument_must_be_an_effect():
  with pytest.raises(TypeError, match="effect="):
    je.print("x", effect="named")


# --- effects_barrier and runtime_tokens -------------------------------------------

def test_effects_barrier_waits_for_dispatched_effects(devices):
  # design/tokens.md "effects_barrier": the calls return before their
  # effects ran (their input is not ready); the barrier returns after.
  done = []

  def slow(x):
    time.sleep(0.2)
    done.append(int(x[0]))

  @je.jit
  def f(x):
    je.callback(slow, None, x)
    return x

  with helpers.NotReadyYet(devices[:2]) as gate:
    for i in range(3):
      f(gate.array + i)
    assert done == []          # dispatched; nothing ran yet
    gate.release()
    je.effects_barrier()
    assert done == [0, 1, 2]


def test_effects_barrier_waits_for_unordered_effects():
  done = []

  def slow(x):
    time.sleep(0.2)
    done.append(int(x))

  @je.jit
  def f(x):
    je.callback(slow, None, x, ordered=False)
    return x

  before = dict(je.runtime_tokens().effects)
  f(jnp.int32(4))
  # unordered: no runtime token is taken or returned, but an output token is
  after = je.runtime_tokens()
  assert dict(after.effects) == before
  assert all(isinstance(k, je.Effect) for k in after.effects)
  assert jax.devices()[0] in after.devices
  je.effects_barrier()
  assert done == [4]


def test_runtime_tokens_snapshot_is_read_only_and_per_effect():
  e1, e2 = je.Effect("api-rt-1"), je.Effect("api-rt-2")

  @je.jit
  def f(x):
    je.print("{}", x, effect=e1)
    return x

  @je.jit
  def g(x):
    je.print("{}", x, effect=e2)
    return x

  f(1)
  snap = je.runtime_tokens()
  assert isinstance(snap, je.RuntimeTokens)
  assert isinstance(snap.effects, types.MappingProxyType)
  assert e1 in snap.effects and e2 not in snap.effects
  assert isinstance(snap.effects[e1], jax.Array)
  with pytest.raises(TypeError):
    snap.effects[e2] = snap.effects[e1]
  with pytest.raises(TypeError):
    snap.devices[jax.devices()[0]] = None
  g(1)
  assert e2 not in snap.effects  # a snapshot, not a live view
  now = je.runtime_tokens()
  assert e1 in now.effects and e2 in now.effects
  assert now.effects[e1] is snap.effects[e1]  # g did not touch e1's token
  assert jax.devices()[0] in now.devices
  je.effects_barrier()


# --- the jax.jit API on jax_effects.jit objects --------------------------------

def _body(x, y, *, scale=2.0):
  return {"sum": (x * scale).sum(), "y": y + 1}


def effectful(x, y, *, scale=2.0):
  """Prints, then computes."""
  je.print("x = {}", x)
  return _body(x, y, scale=scale)


def plain(x, y, *, scale=2.0):
  return _body(x, y, scale=scale)


ARGS = (jnp.arange(4.0), jnp.int32(3))
KW = {"scale": 3.0}


def test_wrapper_attributes_are_the_functions():
  jf = je.jit(effectful)
  assert jf.__wrapped__ is effectful
  assert jf.__name__ == "effectful" and jf.__doc__ == effectful.__doc__
  assert inspect.signature(jf) == inspect.signature(effectful)


@pytest.mark.parametrize("fun", [effectful, plain], ids=["effects", "pure"])
def test_stages_show_the_users_arguments_and_outputs(fun, effects_capture):
  ours = je.jit(fun, donate_argnums=1)
  theirs = jax.jit(plain, donate_argnums=1)

  t_ours, t_theirs = ours.trace(*ARGS, **KW), theirs.trace(*ARGS, **KW)
  assert t_ours.args_info == t_theirs.args_info
  assert t_ours.in_tree == t_theirs.in_tree
  assert t_ours.out_info == t_theirs.out_info
  assert t_ours.out_avals == t_theirs.out_avals
  assert t_ours.fun_name == fun.__name__

  l_ours, l_theirs = t_ours.lower(), t_theirs.lower()
  for name in ("args_info", "in_tree", "in_avals", "out_info", "out_tree",
               "donate_argnums"):
    assert getattr(l_ours, name) == getattr(l_theirs, name), name
  assert l_ours.donate_argnums == (1,)
  assert l_ours.cost_analysis()["flops"] > 0
  assert "func.func public @main" in str(l_ours.compiler_ir())
  assert (helpers.HOST_CALL in l_ours.as_text()) == (
      fun is effectful)

  c_ours, c_theirs = l_ours.compile(), l_theirs.compile()
  for name in ("args_info", "in_tree", "out_info", "out_tree",
               "input_shardings", "output_shardings", "input_formats",
               "output_formats", "donate_argnums"):
    assert getattr(c_ours, name) == getattr(c_theirs, name), name
  assert c_ours.cost_analysis() is not None
  assert c_ours.memory_analysis().argument_size_in_bytes > 0
  assert c_ours.runtime_executable() is not None
  assert isinstance(c_ours.as_text(), str)

  assert ours.eval_shape(*ARGS, **KW) == theirs.eval_shape(*ARGS, **KW)
  assert effects_capture.printed == []   # tracing runs no effect

  out = c_ours(jnp.arange(4.0), jnp.int32(3), **KW)
  assert float(out["sum"]) == 18.0 and int(out["y"]) == 4
  out = t_ours(jnp.arange(4.0), jnp.int32(3), **KW)   # as Traced.__call__
  assert float(out["sum"]) == 18.0 and int(out["y"]) == 4
  je.effects_barrier()
  assert effects_capture.printed == (["x = [0. 1. 2. 3.]"] * 2
                                     if fun is effectful else [])


def test_eval_shape_before_and_after_calls(effects_capture):
  jf = je.jit(effectful)
  expected = jax.eval_shape(plain, *ARGS)
  assert jf.eval_shape(*ARGS) == expected
  jf(*ARGS)
  assert jf.eval_shape(*ARGS) == expected
  je.effects_barrier()
  assert effects_capture.printed == ["x = [0. 1. 2. 3.]"]


def test_deepcopy_copy_and_pickle_give_working_functions(effects_capture):
  jf = je.jit(effectful, static_argnames="scale")
  jf(*ARGS)
  deep = copy.deepcopy(jf)
  shallow = copy.copy(jf)
  pickled = pickle.loads(pickle.dumps(jf))
  for i, g in enumerate([deep, shallow, pickled]):
    assert g is not jf and isinstance(g, type(jf))
    assert g.__wrapped__ is effectful
    assert float(g(jnp.full(2, float(i)), 0, scale=1.0)["sum"]) == 2.0 * i
  jf(jnp.ones(1), 0)
  je.effects_barrier()
  assert effects_capture.printed == [
      "x = [0. 1. 2. 3.]", "x = [0. 0.]", "x = [1. 1.]", "x = [2. 2.]",
      "x = [1.]"]


class Model:
  def __init__(self, k):
    self.k = k

  def __hash__(self):
    return hash(self.k)

  def __eq__(self, other):
    return isinstance(other, Model) and other.k == self.k

  @je.jit(static_argnums=0)
  def step(self, x):
    je.print("k={} x={}", self.k, x)
    return x * self.k


def test_use_as_a_method(effects_capture):
  m = Model(3)
  bound = m.step
  assert type(bound) is type(jax.jit(lambda s, x: x).__get__(m, Model))
  assert bound.__self__ is m
  assert isinstance(Model.step, type(je.jit(effectful)))
  assert int(m.step(jnp.int32(2))) == 6
  assert int(Model(4).step(jnp.int32(2))) == 8
  assert int(Model.step(m, jnp.int32(1))) == 3
  je.effects_barrier()
  assert effects_capture.printed == ["k=3 x=2", "k=4 x=2", "k=3 x=1"]


def test_clear_cache_retraces(effects_capture):
  traces = []

  @je.jit
  def f(x):
    traces.append(1)
    je.print("f {}", x)
    return x + 1

  f(1)
  f(2)
  assert len(traces) == 1
  assert describe(f).executables >= 1 and describe(f).traces >= 1
  f.clear_cache()
  assert describe(f).executables == 0 and describe(f).traces == 0
  f(3)
  assert len(traces) == 2
  je.effects_barrier()
  assert effects_capture.printed == ["f 1", "f 2", "f 3"]


# --- jax.export (effects: tests/api/test_export.py) ----------------------------

def test_export_of_a_pure_function_works_like_jax_jit():
  def pure(x):
    return jnp.sin(x) * 2

  spec = jax.ShapeDtypeStruct((3,), jnp.float32)
  exported = jax.export.export(je.jit(pure))(spec)
  reference = jax.export.export(jax.jit(pure))(spec)
  assert exported.fun_name == reference.fun_name == "pure"
  assert exported.in_avals == reference.in_avals
  assert exported.out_avals == reference.out_avals
  assert exported.in_shardings_hlo == reference.in_shardings_hlo
  assert "callback" not in exported.mlir_module()
  np.testing.assert_allclose(exported.call(jnp.ones(3)),
                             np.sin(np.ones(3)) * 2, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_stages_with_static_args_shardings_and_donation(effects_capture):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("i",))
  s = NamedSharding(mesh, P("i"))

  def f(n, x, y):
    je.print("n={} x={}", n, x.sum())
    return x * n + y

  kw = dict(static_argnums=0, in_shardings=(s, None), out_shardings=s,
            donate_argnums=2)
  ours = je.jit(f, **kw)
  theirs = jax.jit(lambda n, x, y: x * n + y, **kw)
  args = (3, jnp.arange(8.0), jnp.ones(8))
  l_ours, l_theirs = ours.lower(*args), theirs.lower(*args)
  c_ours, c_theirs = l_ours.compile(), l_theirs.compile()
  for name in ("args_info", "in_tree", "out_info", "donate_argnums"):
    assert getattr(l_ours, name) == getattr(l_theirs, name), name
  for name in ("args_info", "in_tree", "out_info", "donate_argnums",
               "input_shardings", "output_shardings", "input_formats",
               "output_formats"):
    assert getattr(c_ours, name) == getattr(c_theirs, name), name
  assert c_ours.output_shardings == s
  assert ours.eval_shape(*args) == theirs.eval_shape(*args)
  out = c_ours(jnp.arange(8.0), jnp.ones(8))
  np.testing.assert_array_equal(out, np.arange(8.0) * 3 + 1)
  je.effects_barrier()
  assert effects_capture.printed == ["n=3 x=28.0"]


# --- the jit object is a jit object (what libraries check) --------------------

@pytest.mark.parametrize("fun", [effectful, plain], ids=["effects", "pure"])
def test_stages_are_instances_of_jax_stages(fun, effects_capture):
  ours, theirs = je.jit(fun), jax.jit(plain)
  traced = ours.trace(*ARGS)
  lowered = ours.lower(*ARGS)
  compiled = lowered.compile()
  assert isinstance(traced, jax.stages.Traced)
  assert isinstance(lowered, jax.stages.Lowered)
  assert isinstance(compiled, jax.stages.Compiled)
  assert isinstance(ours, jax.stages.Wrapped)
  # Every public name of JAX's stage that answers on jax.jit's answers on
  # ours (nothing of JAX's class runs on our object: it forwards or overrides)
  for mine, jaxs in ((traced, theirs.trace(*ARGS)),
                     (lowered, theirs.lower(*ARGS)),
                     (compiled, theirs.lower(*ARGS).compile())):
    for name in dir(type(jaxs).__mro__[0]):
      if name.startswith("_"):
        continue
      try:
        getattr(jaxs, name)
      except Exception:  # noqa: BLE001 - not available on JAX's either
        continue
      getattr(mine, name)
  out = compiled(*ARGS)
  assert int(out["y"]) == 4
  je.effects_barrier()
  assert effects_capture.printed == (["x = [0. 1. 2. 3.]"]
                                     if fun is effectful else [])


def test_traced_jaxpr_is_token_threaded_as_the_reference_says(effects_capture):
  # docs/reference.md, "jit(...).trace": k int32 token inputs first, the
  # returned token last; evaluable under jax.jit; make_jaxpr's eagerly.
  def f(x):
    je.print("x={}", x)
    return x * 2

  traced = je.jit(f).trace(jnp.float32(1))
  j = traced.jaxpr
  k = len(j.in_avals) - len(jax.tree.leaves(traced.in_avals))
  assert k == 1
  assert [(a.shape, str(a.dtype)) for a in j.in_avals] == [
      ((), "int32"), ((), "float32")]
  assert [(a.shape, str(a.dtype)) for a in j.out_avals] == [
      ((), "float32"), ((), "int32")]
  with pytest.raises(Exception):
    jax.core.eval_jaxpr(j.jaxpr, j.consts, jnp.float32(3))
  with pytest.raises(NotImplementedError) as info:
    jax.core.eval_jaxpr(j.jaxpr, j.consts, jnp.int32(0), jnp.float32(3))
  assert "jax.make_jaxpr(f)" in str(info.value)
  assert "under jax.jit" in str(info.value)
  out, _ = jax.jit(lambda *a: jax.core.eval_jaxpr(j.jaxpr, j.consts, *a))(
      jnp.int32(0), jnp.float32(3))
  assert float(out) == 6.0
  plain = jax.make_jaxpr(je.jit(f))(jnp.float32(1))
  (out,) = jax.core.eval_jaxpr(plain.jaxpr, plain.consts, jnp.float32(4))
  assert float(out) == 8.0
  je.effects_barrier()
  assert effects_capture.printed == ["x=3.0", "x=4.0"]
  # Without effects: jax.jit's jaxpr.
  pure = je.jit(lambda x: x * 2).trace(jnp.float32(1)).jaxpr
  assert len(pure.in_avals) == 1 and len(pure.out_avals) == 1


def _sig_fun(x, y=2, *, z=3):
  je.print("{}", x)
  return x


class _WithMethods:
  theirs = jax.jit(lambda self, x, *, k=1: x)
  ours = je.jit(lambda self, x, *, k=1: x)


def test_signature_without_following_wrapped_is_jax_jits():
  # (chex's fake pmap reads it so: inspect.signature(f, follow_wrapped=False))
  for follow in (False, True):
    assert (inspect.signature(je.jit(_sig_fun), follow_wrapped=follow)
            == inspect.signature(jax.jit(_sig_fun), follow_wrapped=follow))
    m = _WithMethods()
    assert (inspect.signature(m.ours, follow_wrapped=follow)
            == inspect.signature(m.theirs, follow_wrapped=follow))
  assert str(inspect.signature(je.jit(_sig_fun), follow_wrapped=False)) == (
      "(x, y=2, *, z=3)")


def test_chex_detects_it_as_a_jit_function_as_jax_jits():
  chex = pytest.importorskip("chex")
  from chex._src import asserts_internal

  def f(x):
    return x + 1

  assert asserts_internal.is_traceable(jax.jit(f))
  assert asserts_internal.is_traceable(je.jit(f))
  assert not asserts_internal.is_traceable(f)
  # assert_max_traces refuses to wrap a jitted function, as for jax.jit
  for jit in (jax.jit, je.jit):
    with pytest.raises(ValueError, match="must not wrap"):
      chex.assert_max_traces(jit(f), n=1)

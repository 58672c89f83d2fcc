"""The ``jax.jit`` API on ``jax_effects.jit`` objects (JAX 0.10).

Differential where possible: the same function without its effects under
``jax.jit`` is the oracle for what ``trace``/``lower``/``compile`` stages
show (the user's arguments and outputs, never our runtime-token argument or
result).
"""
import copy
import inspect
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_effects as je
from jax_effects._dispatch.function import describe


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
  assert ("xla_ffi_python_cpu_callback" in l_ours.as_text()) == (
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


# --- jax.export --------------------------------------------------------------

def test_export_of_an_effectful_function_names_jax_effects_and_the_fix():
  jf = je.jit(effectful)
  with pytest.raises(ValueError) as info:
    jax.export.export(jf)(jax.ShapeDtypeStruct((4,), jnp.float32),
                          jax.ShapeDtypeStruct((), jnp.int32))
  msg = str(info.value)
  assert "jax_effects.jit function 'effectful'" in msg
  assert "host callbacks cannot be serialized" in msg
  assert "Export the pure part" in msg
  assert "must be the result of" not in msg


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

"""A callback's results: anything NumPy accepts as an array, dtypes compared
as JAX's callbacks compare them (``design/architecture.md``, the
``_primitives/host_functions`` entry; a mismatch is the callback's error:
``design/errors.md``, "Who raises a callback's error, when, how often")."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import jax_effects as je


class NoDtypeArg:
  """``__array__`` without a dtype parameter (allowed by NumPy)."""

  def __init__(self, value):
    self.value = value

  def __array__(self):
    return np.asarray(self.value)


RUNNERS = [pytest.param(lambda f: f, id="eager"),
           pytest.param(lambda f: je.jit(f), id="jit")]

F32_3 = jax.ShapeDtypeStruct((3,), jnp.float32)
I32 = jax.ShapeDtypeStruct((), jnp.int32)


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("result, spec, expected", [
    (NoDtypeArg(np.arange(3, dtype=np.float32)), F32_3, [0.0, 1.0, 2.0]),
    (NoDtypeArg(np.int32(7)), I32, 7),
    ([1, 2, 3], F32_3, [1.0, 2.0, 3.0]),
    ((4.0, 5.0, 6.0), F32_3, [4.0, 5.0, 6.0]),
    (7, I32, 7),
    (True, I32, 1),
    (np.int32(9), I32, 9),
    (jnp.arange(3.0), F32_3, [0.0, 1.0, 2.0]),
], ids=["array_no_dtype", "array_no_dtype_0d", "list", "tuple_leaf",
        "int", "bool", "numpy_scalar", "jax_array"])
def test_result_leaves_numpy_accepts(run, result, spec, expected):
  out = run(lambda x: je.callback(lambda v: result, spec, x))(jnp.int32(0))
  je.effects_barrier()
  assert out.dtype == spec.dtype and out.shape == spec.shape
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.parametrize("run", RUNNERS)
def test_structured_results_with_list_and_array_leaves(run):
  spec = {"a": F32_3, "b": (I32, jax.ShapeDtypeStruct((2,), jnp.int32))}
  out = run(lambda x: je.callback(
      lambda v: {"a": NoDtypeArg(np.ones(3, np.float32)), "b": (5, [1, 2])},
      spec, x))(jnp.int32(0))
  je.effects_barrier()
  assert out["a"].tolist() == [1.0, 1.0, 1.0]
  assert int(out["b"][0]) == 5 and out["b"][1].tolist() == [1, 2]


@pytest.mark.parametrize("run", RUNNERS)
def test_array_of_another_dtype_is_still_an_error(run, effects_capture):
  f = run(lambda x: je.callback(lambda v: NoDtypeArg(np.zeros(3, np.int32)),
                                F32_3, x))
  with pytest.raises(TypeError, match=r"result #0 has shape \(3,\) and dtype "
                                      r"int32; expected shape \(3,\) and "
                                      r"dtype float32"):
    f(jnp.int32(0))
    je.effects_barrier()


# Results JAX's callbacks accept after its dtype canonicalization (with
# jax_enable_x64 off, the test default): (result, declared dtype).
CANONICALIZED = {
    "float64 array for float32": (np.arange(3, dtype=np.float64) / 3,
                                  jnp.float32),
    "float64 scalar for float32": (np.float64(1 / 3), jnp.float32),
    "int64 array for int32": (np.arange(3, dtype=np.int64) - 1, jnp.int32),
    "uint64 array for uint32": (np.arange(3, dtype=np.uint64), jnp.uint32),
    "complex128 for complex64": (np.array([1j / 3, 2.0]), jnp.complex64),
    "python float for float32": (1 / 3, jnp.float32),
}


def _declared(value, dtype):
  return jax.ShapeDtypeStruct(np.shape(value), dtype)


def _through_jax(callback_api, value, dtype):
  """The result of ``value`` returned by JAX's own callback under jax.jit."""
  spec = _declared(value, dtype)
  return jax.jit(lambda x: callback_api(lambda v: value, spec, x))(
      jnp.int32(0))


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("case", list(CANONICALIZED))
def test_results_are_compared_after_jax_canonicalization(run, case):
  value, dtype = CANONICALIZED[case]
  spec = _declared(value, dtype)
  ours = run(lambda x: je.callback(lambda v: value, spec, x))(jnp.int32(0))
  je.effects_barrier()
  for api in (io_callback, jax.pure_callback):
    theirs = _through_jax(api, value, dtype)
    assert ours.dtype == theirs.dtype == dtype
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("run", RUNNERS)
def test_64_bit_results_count_as_64_bit_with_x64_on(run, effects_capture):
  value = np.arange(3, dtype=np.float64)
  with jax.enable_x64(True):
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="Expected: float32, Actual: float64"):
      _through_jax(io_callback, value, jnp.float32)
    f = run(lambda x: je.callback(lambda v: value, F32_3, x))
    with pytest.raises(TypeError, match=r"result #0 has shape \(3,\) and "
                                        r"dtype float64; expected shape "
                                        r"\(3,\) and dtype float32$"):
      f(jnp.int32(0))
      je.effects_barrier()


@pytest.mark.parametrize("run", RUNNERS)
def test_a_64_bit_result_of_another_kind_names_its_canonical_dtype(
    run, effects_capture):
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match="Expected: int32, Actual: float32"):
    _through_jax(io_callback, np.float64(1.5), jnp.int32)
  f = run(lambda x: je.callback(lambda v: np.float64(1.5), I32, x))
  with pytest.raises(TypeError, match=r"dtype float64; expected shape \(\) "
                                      r"and dtype int32 \(float64 counts as "
                                      r"float32 with jax_enable_x64 off\)"):
    f(jnp.int32(0))
    je.effects_barrier()


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("value", [np.float64(1.5), np.complex128(1j)],
                         ids=["float64", "complex128"])
def test_numpy_scalar_of_another_dtype_is_an_error(run, value, effects_capture):
  # np.float64 is a Python float (and np.complex128 a complex), but a NumPy
  # scalar has its own dtype: not converted like a Python number.
  f = run(lambda x: je.callback(lambda v: value, I32, x))
  with pytest.raises(TypeError, match=rf"result #0 has shape \(\) and dtype "
                                      rf"{value.dtype}; expected shape \(\) and "
                                      r"dtype int32"):
    f(jnp.int32(0))
    je.effects_barrier()


def test_wrong_structure_is_still_an_error():
  f = je.jit(lambda x: je.callback(lambda v: (1, 2, 3), (I32, I32), x))
  with pytest.raises(TypeError, match="returned 3 results where "
                                      "result_shape_dtypes declares 2"):
    f(jnp.int32(0))
    je.effects_barrier()

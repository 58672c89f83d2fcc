"""Errors (``design/errors.md``, "Who raises a callback's error, when, how
often"): a user's callback exception reaches the caller as itself,
once, and the runtime keeps working; bad format strings fail at trace time
naming the format; callback results of the wrong shape/dtype/structure fail
naming expected and actual.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_effects as je


class UserError(Exception):
  pass


def _call_and_barrier(fn, *args):
  """The error may surface at the call or at the barrier: accept either."""
  out = fn(*args)
  je.effects_barrier()
  return out


def _failing_at(n):
  def host(x):
    if int(x) == n:
      raise UserError(f"callback failed at {int(x)}")
  return host


# --- callback exceptions ------------------------------------------------------

def test_callback_exception_reaches_caller_once_then_runtime_works(
    effects_capture):
  host = _failing_at(2)

  @je.jit
  def f(x):
    je.print("before {}", x)
    je.callback(host, None, x)
    je.print("after {}", x)
    return x + 1

  assert _call_and_barrier(f, jnp.int32(1)) == 2
  with pytest.raises(UserError, match=r"^callback failed at 2$") as info:
    _call_and_barrier(f, jnp.int32(2))
  assert type(info.value) is UserError
  je.effects_barrier()  # reported once: nothing left to raise
  je.effects_barrier(all_threads=True)
  # the failed computation completed (its callback failed, not the
  # computation: design/errors.md), so its token is kept and followed
  assert je.DEFAULT in je.runtime_tokens().effects
  assert _call_and_barrier(f, jnp.int32(3)) == 4
  assert je.DEFAULT in je.runtime_tokens().effects
  printed = effects_capture.printed
  assert printed[:3] == ["before 1", "after 1", "before 2"]
  assert printed[-2:] == ["before 3", "after 3"]
  assert "after 2" not in printed


def test_callback_exception_inside_loop():
  host = _failing_at(3)

  @je.jit
  def f(n):
    def body(i, acc):
      je.callback(host, None, i)
      return acc + i
    return lax.fori_loop(0, n, body, 0)

  with pytest.raises(UserError, match="failed at 3"):
    _call_and_barrier(f, jnp.int32(5))
  assert _call_and_barrier(f, jnp.int32(3)) == 3


def test_callback_exception_with_result_and_named_effect():
  e = je.Effect("errors-named")

  def host(x):
    raise KeyError("missing key")

  @je.jit
  def f(x):
    return je.callback(host, jax.ShapeDtypeStruct((), jnp.int32), x, effect=e)

  with pytest.raises(KeyError, match="missing key"):
    _call_and_barrier(f, 1)
  assert e in je.runtime_tokens().effects   # kept: see design/errors.md


def test_callback_exception_outside_jit_is_raised_directly():
  with pytest.raises(UserError, match="failed at 0"):
    je.callback(_failing_at(0), None, 0)


def test_callback_exception_through_compiled():
  @je.jit
  def f(x):
    je.callback(_failing_at(1), None, x)
    return x

  compiled = f.lower(jnp.int32(0)).compile()
  assert _call_and_barrier(compiled, jnp.int32(0)) == 0
  with pytest.raises(UserError):
    _call_and_barrier(compiled, jnp.int32(1))
  assert _call_and_barrier(compiled, jnp.int32(2)) == 2


def test_errors_of_other_threads_do_not_leak_into_this_thread():
  import threading

  @je.jit
  def f(x):
    je.callback(_failing_at(9), None, x)
    return x

  caught = []

  def worker():
    try:
      _call_and_barrier(f, jnp.int32(9))
    except UserError as err:
      caught.append(err)

  t = threading.Thread(target=worker)
  t.start()
  t.join()
  assert len(caught) == 1
  je.effects_barrier(all_threads=True)  # already reported: no second raise
  assert _call_and_barrier(f, jnp.int32(1)) == 1


# --- format strings ------------------------------------------------------------

@pytest.mark.parametrize("fmt,args,kwargs,pattern", [
    ("{} {}", (1,), {}, "more positional arguments"),
    ("{name}", (), {}, "keyword argument 'name'"),
    ("{}", (1, 2), {}, r"does not use argument\(s\) #1"),
    ("x", (), {"k": 1}, r"does not use argument\(s\) 'k'"),
    ("{:q}", (1.0,), {}, "does not fit its arguments"),
    ("{:d}", (1.5,), {}, "does not fit its arguments"),
    ("{:.2f}", (np.ones(3),), {}, "does not fit its arguments"),
    ("{", (), {}, "bad format string"),
])
def test_format_mismatch_fails_at_trace_time_naming_format(fmt, args, kwargs,
                                                          pattern):
  ran = []

  @je.jit
  def f(x):
    je.print(fmt, *args, **kwargs)
    ran.append(1)
    return x

  with pytest.raises(ValueError, match=pattern) as info:
    f(jnp.int32(0))
  assert repr(fmt) in str(info.value)
  assert not ran  # failed while tracing, before anything ran
  with pytest.raises(ValueError, match=pattern):
    je.print(fmt, *args, **kwargs)  # eager: same check


def test_format_must_be_a_string():
  with pytest.raises(TypeError, match="must be a str"):
    je.print(3)


def test_format_with_attribute_and_index_fields_is_refused_at_trace_time():
  @je.jit
  def f(x):
    je.print("{0[a]} {t[1]}", {"a": x}, t=(x, x + 1))
    return x

  with pytest.raises(ValueError, match=r"the field \{0\[a\]\}"):
    f(jnp.int32(1))
  je.effects_barrier()


# --- callback results ----------------------------------------------------------

def test_callback_result_wrong_shape_names_expected_and_actual():
  @je.jit
  def f(x):
    return je.callback(lambda v: np.zeros((2, 3), np.float32),
                       jax.ShapeDtypeStruct((3,), jnp.float32), x)

  with pytest.raises(TypeError) as info:
    _call_and_barrier(f, 1.0)
  msg = str(info.value)
  assert "(2, 3)" in msg and "(3,)" in msg and "<lambda>" in msg
  assert f.lower(1.0) is not None  # still usable afterwards


def test_callback_result_wrong_dtype_names_expected_and_actual():
  @je.jit
  def f(x):
    return je.callback(lambda v: np.zeros((3,), np.int64),
                       jax.ShapeDtypeStruct((3,), jnp.float32), x)

  with pytest.raises(TypeError, match=r"int64.*float32"):
    _call_and_barrier(f, 1.0)


def test_callback_result_wrong_structure():
  spec = (jax.ShapeDtypeStruct((), jnp.int32),) * 2

  @je.jit
  def f(x):
    return je.callback(lambda v: np.int32(1), spec, x)

  with pytest.raises(TypeError, match="structure"):
    _call_and_barrier(f, 1)


def test_callback_result_wrong_shape_outside_jit():
  with pytest.raises(TypeError, match=r"\(2,\).*\(\)"):
    je.callback(lambda: np.zeros(2, np.int32),
                jax.ShapeDtypeStruct((), jnp.int32))


def test_callback_bad_result_shape_dtypes_and_fn():
  with pytest.raises(TypeError, match="result_shape_dtypes"):
    je.callback(lambda: 1, "int32")
  with pytest.raises(TypeError, match="not callable"):
    je.callback(3, None)


def test_format_spec_checked_against_traced_arguments():
  @je.jit
  def f(x, v):
    je.print("{:d} {v:.3f}", x, v=v)  # int fits {:d}, a scalar fits .3f
    return x

  f(jnp.int32(1), jnp.float32(2))

  @je.jit
  def g(x):
    je.print("{:.2f}", x)
    return x

  with pytest.raises(ValueError, match=r"'\{:.2f\}' does not fit"):
    g(jnp.ones(3))
  assert je.jit(lambda k: (je.print("{}", k), k)[1])(jnp.ones((2, 2))) \
      is not None

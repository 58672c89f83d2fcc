"""Bad input to print/callback/Effect/ordering: clear errors naming the problem
(``design/formatting.md``: "Arguments", "Format strings"; ``design/errors.md``,
"Who raises a callback's error, when, how often").

Errors about arguments and format strings are raised when the call is traced
(never inside XLA); errors about a callback's results are raised by the host
callback and reach the caller as that exception, under ``jax_effects.jit``,
under transformations and eagerly alike, and the runtime keeps working.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_effects as je


from helpers import RUNNERS


def _still_works(effects_capture):
  effects_capture.clear()
  je.jit(lambda x: (je.print("ok {}", x), x)[1])(1)
  assert effects_capture.printed == ["ok 1"]


# --- non-array arguments ---------------------------------------------------------

class Thing:
  pass


@pytest.mark.parametrize("run", RUNNERS)
def test_print_rejects_object_arrays_naming_the_argument(run):
  with pytest.raises(TypeError, match=r"print\('\{\} \{x\}'\): argument 'x'\['a'\] "
                                      r"is a NumPy array of dtype object"):
    run(lambda v: je.print("{} {x}", v, x={"a": np.array([Thing()])}))(1)


def test_print_accepts_str_leaves_as_static_values(effects_capture):
  je.jit(lambda v: je.print("{} {}", "label", v))(3)
  assert effects_capture.printed == ["label 3"]


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("bad, kind", [("text", "str"), (Thing(), "Thing"),
                                       (object(), "object")])
def test_callback_rejects_non_array_arguments(run, bad, kind):
  with pytest.raises(TypeError, match=rf"callback\(.*<lambda>\): argument #1\[0\] "
                                      rf"is of type {kind}"):
    run(lambda v: je.callback(lambda *a: None, None, v, [bad]))(1)


# --- results ---------------------------------------------------------------------

SPEC = jax.ShapeDtypeStruct((2,), jnp.float32)


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("result, message", [
    (np.zeros(3, np.float32), r"result #0 has shape \(3,\) and dtype float32; "
                              r"expected shape \(2,\) and dtype float32"),
    (np.zeros(2, np.int32), r"result #0 has shape \(2,\) and dtype int32; "
                            r"expected shape \(2,\) and dtype float32"),
])
def test_mismatched_result_shape_or_dtype(run, result, message, effects_capture):
  def host(x):
    return result
  with pytest.raises(TypeError, match=r"callback\(.*host\) " + message):
    run(lambda x: je.callback(host, SPEC, x))(1.0)
    je.effects_barrier()
  _still_works(effects_capture)


@pytest.mark.parametrize("run", RUNNERS)
def test_callback_returning_wrong_number_of_results(run, effects_capture):
  def host(x):
    return x, x, x
  spec = (jax.ShapeDtypeStruct((), jnp.float32),) * 2
  with pytest.raises(TypeError, match=r"callback\(.*host\) returned 3 results "
                                      r"where result_shape_dtypes declares 2"):
    run(lambda x: je.callback(host, spec, x))(jnp.float32(1.0))
    je.effects_barrier()
  _still_works(effects_capture)


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("named", [False, True])
def test_callback_declaring_a_result_that_returned_none_says_so(
    run, named, effects_capture):
  def host(x):
    x * 2          # forgot the return

  fn = je.register_callback("test_bad_input.host", host) if named else host
  try:
    with pytest.raises(TypeError) as info:
      run(lambda x: je.callback(fn, SPEC, x))(jnp.ones(2))
      je.effects_barrier()
  finally:
    je.register_callback("test_bad_input.host", None)
  msg = str(info.value)
  assert "returned None" in msg and "forget a `return`" in msg
  assert "dtype object" not in msg
  _still_works(effects_capture)


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("named", [False, True])
def test_callback_without_declared_result_returning_a_value_is_refused(
    run, named, effects_capture):
  # As io_callback(fn, None, x) refuses it: the value would be lost.
  seen = []

  def host(x):
    seen.append(float(x))
    return x * 2

  fn = je.register_callback("test_bad_input.host", host) if named else host
  try:
    with pytest.raises(TypeError) as info:
      run(lambda x: je.callback(fn, None, x))(jnp.float32(3))
      je.effects_barrier()
    msg = str(info.value)
    assert "returned np.float32(6.0)" in msg or "returned 6.0" in msg, msg
    assert "result_shape_dtypes=None" in msg and "return None" in msg
    # Returning None (or nothing, or a pytree without leaves, as
    # io_callback takes it) is what a no-result callback does.
    seen.clear()
    run(lambda x: je.callback(lambda v: seen.append(float(v)), None, x))(
        jnp.float32(4))
    run(lambda x: je.callback(lambda v: (seen.append(5.0), None), None, x))(
        jnp.float32(5))
    je.effects_barrier()
    assert seen == [4.0, 5.0]
  finally:
    je.register_callback("test_bad_input.host", None)
  _still_works(effects_capture)


@pytest.mark.parametrize("run", RUNNERS)
def test_callback_str_argument_suggests_functools_partial(run):
  with pytest.raises(TypeError) as info:
    run(lambda v: je.callback(lambda tag, x: None, None, "loss", v))(1.0)
  msg = str(info.value)
  assert "argument #0 is of type str" in msg
  assert "functools.partial(fn, value)" in msg
  assert "convert others yourself" not in msg


def test_wrong_number_of_results_under_vmap(effects_capture):
  def host(x):
    return ()
  spec = (jax.ShapeDtypeStruct((), jnp.float32),)
  with pytest.raises(TypeError, match=r"callback\(.*host\) returned 0 results"):
    je.jit(jax.vmap(lambda x: je.callback(host, spec, x)))(jnp.arange(2.0))
  _still_works(effects_capture)


def test_host_callback_result_count_is_checked():
  from jax_effects._primitives import host_callback as _host_callback
  avals = (jax.core.ShapedArray((), jnp.float32),) * 2
  with pytest.raises(TypeError, match=r"my effect returned 1 results; expected 2"):
    _host_callback.check_results("my effect", (np.float32(1),), avals)
  with pytest.raises(TypeError, match="my effect returned a non-sequence"):
    _host_callback.check_results("my effect", np.float32(1), avals)


# --- format strings --------------------------------------------------------------

@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("fmt, args, kwargs, message", [
    ("{} {}", (1,), {}, "refers to more positional arguments than the 1 given"),
    ("{x}", (), {}, "refers to keyword argument 'x', which was not given"),
    ("{}", (1, 2), {}, r"does not use argument\(s\) #1"),
    ("{}", (1,), {"y": 2}, r"does not use argument\(s\) 'y'"),
    ("{", (), {}, "bad format string"),
])
def test_format_with_missing_or_extra_fields(run, fmt, args, kwargs, message):
  with pytest.raises(ValueError, match=rf"print\({fmt!r}\): .*{message}"):
    run(lambda: je.print(fmt, *args, **kwargs))()


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("call", ["print", "log"])
def test_printf_style_format_names_the_braces_and_the_rewrite(run, call):
  # The logging habit: %-placeholders are not fields; the error says what
  # the fields are, that %-formatting is not supported, and the rewrite.
  fn = getattr(je, call)
  with pytest.raises(ValueError) as info:
    run(lambda x, k: fn("loss %s at step %d", x, k))(1.5, 3)
  msg = str(info.value)
  assert "does not use argument(s) #0, #1" in msg
  assert "str.format's {}" in msg
  assert "not printf-style (%d, %s: %-formatting is not supported)" in msg
  assert "'loss {} at step {}'" in msg
  # Unused arguments without %-placeholders: the fields only.
  with pytest.raises(ValueError) as info:
    run(lambda x: fn("loss", x))(1.5)
  assert "str.format's {}" in str(info.value)
  assert "printf" not in str(info.value)


@pytest.mark.parametrize("call", ["print", "log"])
def test_traced_value_text_in_the_format_warns_once_per_site(
    call, effects_capture, once_per_site):
  fn = getattr(je, call)

  def step(loss):
    fn(f"loss={loss}")            # the text of a tracer, fixed at trace time
    return loss

  with pytest.warns(UserWarning) as got:
    je.jit(step)(jnp.float32(1))
  mine = [w for w in got if "traced value" in str(w.message)]
  assert len(mine) == 1, [str(w.message) for w in got]
  msg = str(mine[0].message)
  assert "Tracer(" in msg and f'jax_effects.{call}("loss={{}}", loss)' in msg
  assert mine[0].filename == __file__   # the call site, not ours
  _warns_once_per_site(once_per_site, f"je.{call}")
  # A value as an argument, or a concrete value's text, is no warning.
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    je.jit(lambda v: (fn("loss={}", v), v)[1])(jnp.float32(1))
    fn(f"loss={jnp.float32(1)}")
    fn("TracerSpark(x) is a word")


#: The calls whose warning is shown once per site, each a scenario of one
#: fresh process (``once_per_site``).
_ONCE_PER_SITE = ["je.print", "je.log", "jax.debug.print", "jax.debug.log"]


@pytest.fixture(scope="module")
def once_per_site():
  """The finished child of a scenario per call of ``_ONCE_PER_SITE`` (its
  own ``step``, called three times, after a line ``== call`` on stderr;
  one this JAX does not have writes nothing): ``helpers.scenario_lines``."""
  from helpers import run_script
  script = ["import sys, jax, jax.numpy as jnp, jax_effects as je\n"]
  for fn in _ONCE_PER_SITE:
    module, name = fn.rsplit(".", 1)
    script.append(f"""
print("== {fn}", file=sys.stderr, flush=True)
if hasattr({module}, "{name}"):
  def step(loss):
    {fn}(f"loss={{loss}}")
    return loss
  for x in (1.0, 2.0, 3.0):
    je.jit(step)(jnp.float32(x))
  je.effects_barrier()
""")
  script.append('print("== end", file=sys.stderr, flush=True)\n')
  return run_script("".join(script), timeout=120)


def _warns_once_per_site(proc, fn: str) -> None:
  """Python's default filter shows the warning of ``fn(f"...{tracer}")``
  once per site (a fresh process, three calls)."""
  from helpers import scenario_lines
  err = "\n".join(scenario_lines(proc, fn, "stderr"))
  assert err.count("TracedTextWarning") == 1, err[-2000:]


@pytest.mark.parametrize("call", ["print", "log"])
def test_adopted_jax_debug_traced_value_text_warns_as_ours(call, once_per_site):
  # jax.debug.print/log inside jax_effects.jit is adopted (README, "Existing
  # jax.debug / io_callback code"): its f-string of a tracer warns as
  # jax_effects.print's does, at the user's line.
  fn = getattr(jax.debug, call, None)
  if fn is None:
    pytest.skip(f"this JAX has no jax.debug.{call}")

  def step(loss):
    fn(f"loss={loss}")            # the text of a tracer, fixed at trace time
    return loss

  with pytest.warns(UserWarning) as got:
    je.jit(step)(jnp.float32(1))
    je.effects_barrier()
  mine = [w for w in got if "traced value" in str(w.message)]
  assert len(mine) == 1, [str(w.message) for w in got]
  msg = str(mine[0].message)
  assert msg.startswith(f"jax.debug.{call}: the format string holds '")
  assert "Tracer(" in msg and f'jax.debug.{call}("loss={{}}", loss)' in msg
  assert type(mine[0].message).__name__ == "TracedTextWarning"
  assert mine[0].filename == __file__   # the call site, not ours
  assert mine[0].lineno == step.__code__.co_firstlineno + 1
  _warns_once_per_site(once_per_site, f"jax.debug.{call}")
  # A value as an argument is no warning.
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    je.jit(lambda v: (fn("loss={}", v), v)[1])(jnp.float32(1))
    je.effects_barrier()


def test_format_error_under_vmap_and_grad_is_raised_at_trace_time():
  def f(x):
    je.print("{} {}", x)
    return x * x
  with pytest.raises(ValueError, match="more positional arguments"):
    je.jit(jax.vmap(jax.grad(f)))(jnp.arange(2.0))


# --- options ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["Global", "per-effect", "", None])
def test_unknown_ordering_mode(mode):
  with pytest.raises(ValueError, match=f"Unknown ordering mode {mode!r}"):
    je.set_ordering(mode)
  with pytest.raises(ValueError, match=f"Unknown ordering mode {mode!r}"):
    with je.ordering(mode):
      pass


def test_effect_name_reused_with_conflicting_settings():
  je.Effect("bad-input-reused", ordered=False)
  with pytest.raises(ValueError, match=r"Effect\('bad-input-reused', ordered=False\)"
                                       r" already exists"):
    je.Effect("bad-input-reused", ordered=True)


@pytest.mark.parametrize("run", RUNNERS)
def test_bad_effect_and_ordered_arguments(run):
  with pytest.raises(TypeError, match=r"print\('x'\): effect= must be a "
                                      r"jax_effects.Effect or None, got 'named'"):
    run(lambda: je.print("x", effect="named"))()
  with pytest.raises(TypeError, match=r"print\('x'\): ordered= must be a bool"):
    run(lambda: je.print("x", ordered="yes"))()

"""JAX's own callbacks inside ``jax_effects.jit`` keep JAX's contract.

Adopted ``jax.debug.print``/``log``, ``jax.debug.callback`` and ``io_callback``
(``_frontends/adopted_host.py``): their errors reach the
caller as ``jax.jit`` delivers them (``design/errors.md``, "Errors of JAX's own
callbacks"); the user's function receives and prints what it does under
``jax.jit``, at jax_effects' cost; ``deterministic()`` holds their output
(``design/placement.md``); ``effects_capture`` records it. Oracle: the same
function under ``jax.jit`` (differential), where JAX supports it.
"""
import contextlib
import functools
import logging
import re
import string
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import tree_util
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

import jax_effects as je
from jax_effects import _compat
import helpers
from helpers import Boom
from test_formatting import CASES as FORMAT_CASES
from test_formatting import _by_case, _groups, _run

F32 = jax.ShapeDtypeStruct((), jnp.float32)
PREFIX = ("INTERNAL: CpuCallback error calling callback: "
          "Traceback (most recent call last):\n")
FRAME = re.compile(r'  File ".*", line \d+, in \S+')


def _raised(call):
  """The exception ``call()`` (and the barriers after it) raised.

  A failure ``jax.effects_barrier()`` raises stays in JAX's tokens (JAX
  keeps a failed token, and so raises it at every later barrier;
  jax_effects' barrier leaves JAX's tokens as JAX keeps them): forgotten
  here once returned, so later tests do not meet it."""
  try:
    call()
    je.effects_barrier()
    jax.effects_barrier()
  except Exception as err:  # noqa: BLE001 - returned to the test
    _compat.clear_jax_runtime_tokens()
    return err
  raise AssertionError("nothing was raised")


# --- 5. errors as jax.jit delivers them -----------------------------------------


raised_by_user = []


def _boom(*args):
  exc = Boom("boom!")
  raised_by_user.append(exc)
  raise exc


ERROR_CASES = {
    "io_callback raises": (
        lambda x: io_callback(_boom, F32, x), "Boom: boom!"),
    "ordered io_callback raises": (
        lambda x: io_callback(_boom, F32, x, ordered=True), "Boom: boom!"),
    "io_callback returns two results for one": (
        lambda x: io_callback(lambda v: (v, v), F32, x),
        "RuntimeError: Mismatched number of outputs from callback. "
        "Expected: 1, Actual: 2"),
    "io_callback result of another shape": (
        lambda x: io_callback(lambda v: np.zeros(2, np.float32), F32, x),
        "RuntimeError: Incorrect output shape for return value #0: "
        "Expected: (), Actual: (2,)"),
    "io_callback result of another dtype": (
        lambda x: io_callback(lambda v: np.int32(1), F32, x),
        "RuntimeError: Incorrect output dtype for return value #0: "
        "Expected: float32, Actual: int32"),
    "debug.callback raises": (
        lambda x: jax.debug.callback(_boom, x) or x, "Boom: boom!"),
    "ordered debug.callback raises": (
        lambda x: jax.debug.callback(_boom, x, ordered=True) or x,
        "Boom: boom!"),
    "debug.print's format fails at run time": (
        lambda x: jax.debug.print("{:d}", x, skip_format_check=True) or x,
        "ValueError: Unknown format code 'd' for object of type 'float'"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_of_jax_callbacks_are_raised_as_under_jax_jit(case, caplog):
  fun, last_line = ERROR_CASES[case]
  x = jnp.float32(1.5)
  raised_by_user.clear()
  with caplog.at_level(logging.ERROR):
    theirs = _raised(lambda: jax.jit(fun)(x))
    their_logs = [(r.name, r.getMessage()) for r in caplog.records]
    caplog.clear()
    ours = _raised(lambda: je.jit(fun)(x))
    our_logs = [(r.name, r.getMessage()) for r in caplog.records]
  assert our_logs == their_logs   # JAX logs a failing callback: the same
  for err in (theirs, ours):
    assert type(err) is jax.errors.JaxRuntimeError, err
    assert isinstance(err, RuntimeError)
    text = str(err)
    assert text.startswith(PREFIX), text
    lines = text.splitlines()
    assert lines[-1] == last_line
    assert all(FRAME.fullmatch(line) for line in lines[1:-1]), lines
  # The original exception is attached (jax.jit attaches none).
  cause = ours.__cause__
  if last_line.startswith("Boom"):
    assert cause is raised_by_user[-1]
    # The stack is the one at the raise: the same user frame raised it.
    assert str(theirs).splitlines()[-2] == str(ours).splitlines()[-2]
  else:
    assert f"{type(cause).__name__}: {cause}" == last_line
  je.effects_barrier()   # reported once: nothing is left
  jax.effects_barrier()


def test_except_runtime_error_catches_adopted_errors_and_ours_stay_original():
  def fun(x):
    return io_callback(_boom, F32, x) + x

  f = je.jit(fun)
  caught = 0
  for _ in range(3):   # existing code: retry on RuntimeError
    try:
      f(jnp.float32(1))
    except RuntimeError:
      caught += 1
  assert caught == 3
  # jax_effects' own effects keep raising the user's exception itself.
  g = je.jit(lambda x: je.callback(_boom, F32, x) + x)
  with pytest.raises(Boom) as info:
    g(jnp.float32(1))
  assert info.value is raised_by_user[-1]


def test_adopted_errors_on_every_device_are_one_runtime_error(mesh):
  def fun(x):
    def body(b):
      jax.debug.callback(_boom, b)
      return b * 2
    return jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                         out_specs=P("i"))(x)

  x = jnp.arange(8.0)
  theirs = _raised(lambda: jax.jit(fun)(x))   # one device's error
  raised_by_user.clear()
  ours = _raised(lambda: je.jit(fun)(x))
  assert isinstance(theirs, jax.errors.JaxRuntimeError)
  # (JAX 0.8 and 0.9 put where XLA saw it in between: "INTERNAL: Compute
  # error: CpuCallback error ..."; ours is the one-device message.)
  assert re.match(r"INTERNAL: ([\w ]+: )?CpuCallback error calling callback: "
                  r"Traceback", str(theirs))
  assert isinstance(ours, jax.errors.JaxRuntimeError)
  assert str(ours).startswith(PREFIX)
  errors = ours.jax_effects_errors   # every device's, raised once
  assert len(errors) == 8
  if sys.version_info >= (3, 11):
    assert isinstance(ours, ExceptionGroup)  # noqa: F821
    assert list(ours.exceptions) == list(errors)
  assert all(type(e) is jax.errors.JaxRuntimeError for e in errors)
  assert sorted(map(id, (e.__cause__ for e in errors))) == sorted(
      map(id, raised_by_user))
  je.effects_barrier()


# --- 6. what the user's function receives, and what is printed --------------------

def _describe(a):
  if not isinstance(a, jax.Array):
    return a
  return (type(a), a.dtype, a.shape, a.weak_type, a.sharding, a.committed,
          np.asarray(a).tolist())


def _observe(seen):
  def observe(*args, **kwargs):
    seen.append((
        tree_util.tree_map(_describe, (args, kwargs)),
        jax.config.jax_default_device,
        jax.sharding.get_abstract_mesh().empty,
        jnp.ones(2).devices()))
    return np.float32(0)
  return observe


@pytest.mark.parametrize("arguments", ["positional", "pytrees"])
@pytest.mark.parametrize("which", ["debug.callback", "io_callback"])
def test_callbacks_receive_what_they_receive_under_jax_jit(which, arguments):
  key = jax.random.key(1)

  def fun(x, k):
    if arguments == "positional":
      args, kwargs = (x, k, jnp.int8(3), 2), {}
    else:   # a dict, a keyword argument, a static leaf (debug.callback)
      args = ({"a": x, "b": (k, jnp.int8(3))},)
      kwargs = {"z": x[0]}
      if which == "debug.callback":
        args += ("static text",)
    if which == "debug.callback":
      jax.debug.callback(_observe(seen), *args, ordered=True, **kwargs)
    else:
      io_callback(_observe(seen), F32, *args, ordered=True, **kwargs)
    return x

  x = jnp.arange(3.0).reshape(1, 3)
  runs = []
  for jit, barrier in ((jax.jit, jax.effects_barrier),
                       (je.jit, je.effects_barrier)):
    seen = []
    f = jit(fun)
    f(x, key)
    f(x + 1, key)   # warm
    barrier()
    runs.append(seen)
  theirs, ours = runs
  assert len(theirs) == 2
  assert ours == theirs


def test_debug_callback_primitive_bound_by_other_code_is_called_as_is():
  # Code that binds debug_callback_p itself (not through jax.debug.callback)
  # gives a callable of its own: it is called with the flat arrays.
  from jax._src.debugging import debug_callback_p, debug_effect

  def fun(x):
    debug_callback_p.bind(x, x + 1, callback=_observe(seen),
                          effect=debug_effect, partitioned=False)
    return x

  runs = []
  for jit, barrier in ((jax.jit, jax.effects_barrier),
                       (je.jit, je.effects_barrier)):
    seen = []
    jit(fun)(jnp.arange(2.0))
    barrier()
    runs.append(seen)
  assert len(runs[0]) == 1 and runs[1] == runs[0]


def _print(fmt, *args, **kwargs):
  """``jax.debug.print`` for ``test_formatting._run``, ordered (one program
  prints every case; JAX orders only its ordered prints): a format without
  fields prints its arguments after the text only if JAX's format check is
  skipped."""
  if not any(True for _, name, _, _ in string.Formatter().parse(fmt)
             if name is not None):
    kwargs = dict(kwargs, skip_format_check=True)
  jax.debug.print(fmt, *args, ordered=True, **kwargs)


ADOPTED_ONLY_CASES = [
    # jax.debug.print allows fields that reach into arguments.
    ("attribute_and_index", "{x.shape} {x.dtype} {x[1]} {0[0]:.2f}",
     (jnp.arange(3.0),), {"x": jnp.arange(4)}, None),
    ("no_placeholders", "values:", (jnp.int32(1), jnp.arange(2.0)), {}, None),
    ("no_placeholders_options", "v", (jnp.linspace(0, 1, 3),), {},
     {"precision": 2}),
    ("first_literal_escaped", "{{}} {}", (jnp.int32(1),), {}, None),
]


@pytest.mark.parametrize("mode", ["jit", "jit_const"])
@pytest.mark.parametrize("cases",
                         list(_groups(FORMAT_CASES + ADOPTED_ONLY_CASES)))
def test_jax_debug_print_prints_what_it_prints_under_jax_jit(cases, mode,
                                                             capsys):
  options = cases[0][4]
  outputs = []
  for jit, barrier in ((jax.jit, jax.effects_barrier),
                       (je.jit, je.effects_barrier)):
    capsys.readouterr()
    with (np.printoptions(**options) if options else contextlib.nullcontext()):
      try:
        _run(_print, jit, barrier, mode, cases)
      except TypeError as err:
        if jit is jax.jit and "not hashable" in str(err):
          # JAX 0.8's jax.debug.print refuses np.printoptions(formatter=...)
          pytest.skip(f"the reference jax.debug.print fails: {err}")
        raise
    outputs.append(_by_case(capsys.readouterr().out.splitlines(), cases))
  theirs, ours = outputs
  for name, *_ in cases:
    assert theirs[name], f"{name}: the reference printed nothing"
    assert ours[name] == theirs[name], name


def test_adopted_callbacks_skip_jax_device_put_per_run(jax_events, capsys):
  # What made an adopted callback cost JAX's ~10x of ours: every
  # run put each operand on the CPU with jax.device_put. A print formats the
  # NumPy values; a callback's arrays come from jax.device_put's C++ call.
  # (Its speed is measured by ``python -m jax_effects bench``, rows l.)
  record = []

  @je.jit
  def f(x):
    jax.debug.print("x {} {}", x, x[0])
    jax.debug.callback(lambda v: record.append(int(v[0])), x)
    io_callback(lambda v: record.append(-int(v[0])), None, x)
    return x

  xs = [jnp.arange(3) + i for i in range(3)]
  f(xs[0])
  je.effects_barrier()
  jax_events.clear()
  for x in xs:
    f(x)
  je.effects_barrier()
  assert jax_events["batched_device_put_start"] == 0, jax_events
  assert record == [0, 0, 0, 0, 1, -1, 2, -2]
  assert capsys.readouterr().out.splitlines() == [
      "x [0 1 2] 0", "x [0 1 2] 0", "x [1 2 3] 1", "x [2 3 4] 2"]


# --- 7. deterministic() holds adopted output ----------------------------------------

def _per_device(mesh, body):
  return jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))


def test_deterministic_holds_jax_debug_print_with_ours(mesh, capfd):
  def fun(x):
    def body(b):
      je.print("ours {}", b[0])
      jax.debug.print("jax {}", b[0])
      je.print("ours again {}", b[0])
      return b
    y = _per_device(mesh, body)(x)
    jax.debug.print("after {}", y.sum())
    return y

  f = je.jit(fun)
  with je.deterministic():
    for _ in range(3):
      f(jnp.arange(8))
    je.effects_barrier()
  prefix = "[device {d} shard {d} process 0] "
  once = ([prefix.format(d=d) + f"ours {d}" for d in range(8)]
          + [f"jax {d}" for d in range(8)]
          + [prefix.format(d=d) + f"ours again {d}" for d in range(8)]
          + ["after 28"])
  assert capfd.readouterr().out.splitlines() == once * 3


@pytest.mark.parametrize("kind", ["jax.debug.callback", "io_callback"])
def test_deterministic_refuses_a_per_device_debug_callback_or_io_callback(
    mesh, capfd, kind):
  # It runs user code, which cannot be held: releasing the held output
  # before it (on the first device to reach it) left every device's output
  # unsorted, against deterministic()'s promise. Refused, per device.
  ran = []

  def fun(x):
    def body(b):
      je.print("ours {}", b[0])
      if kind == "io_callback":
        io_callback(lambda v: ran.append(int(v[0])), None, b)
      else:
        jax.debug.callback(lambda v: ran.append(int(v[0])), b)
      return b
    y = _per_device(mesh, body)(x)
    jax.debug.callback(lambda v: ran.append(("once", int(v))), y.sum())
    return y

  f = je.jit(fun)
  f(jnp.arange(8))   # outside the block: runs
  je.effects_barrier()
  assert sorted(r for r in ran if type(r) is int) == list(range(8))
  assert ran[-1] == ("once", 28)
  ran.clear()
  capfd.readouterr()
  with pytest.raises(BaseException) as info:
    with je.deterministic():
      f(jnp.arange(8))
  errors = helpers.flat(info.value)
  assert len(errors) == 8
  for err in errors:
    assert isinstance(err, RuntimeError)
    assert f"deterministic(): a{'n' if kind[0] == 'i' else ''} {kind} inside " \
           f"shard_map/pmap" in str(err)
    assert "refused" in str(err) and "jax_effects.print/log" in str(err)
  assert [r for r in ran if type(r) is int] == []   # refused before running
  # What the program printed before it still comes out, sorted.
  prefix = "[device {d} shard {d} process 0] "
  assert capfd.readouterr().out.splitlines() == [
      prefix.format(d=d) + f"ours {d}" for d in range(8)]
  # The runtime goes on; one that runs once is not refused.
  with je.deterministic():
    je.jit(lambda x: (jax.debug.callback(
        lambda v: ran.append(("once", int(v))), x), x)[1])(jnp.int32(5))
  assert ran == [("once", 5)]


# --- 8. effects_capture records adopted output --------------------------------------

def test_effects_capture_records_jax_debug_print_and_log(effects_capture):
  @je.jit
  def f(x):
    je.print("ours {}", x)
    jax.debug.print("jax {}", x)
    jax.debug.log("jax log {}", x)
    je.log("ours log {}", x)
    jax.debug.print("jax again {}", x)
    return x

  f(jnp.int32(1))
  f(jnp.int32(2))
  assert effects_capture.printed == [
      line for i in (1, 2) for line in (f"ours {i}", f"jax {i}",
                                        f"jax again {i}")]
  records = effects_capture.logged
  assert [r.getMessage() for r in records] == [
      m for i in (1, 2) for m in (f"jax log {i}", f"ours log {i}")]
  jax_record = records[0]
  assert jax_record.name == "jax._src.debugging"
  assert jax_record.levelno == logging.INFO
  effects_capture.set_level(logging.WARNING)
  f(jnp.int32(3))
  assert [r.getMessage() for r in effects_capture.logged] == [
      r.getMessage() for r in records]


def test_adopted_jax_debug_log_records_are_jaxs(caplog):
  def fun(x):
    jax.debug.log("value {}", x)
    return x

  def fields(r):
    return (r.name, r.levelno, r.pathname, r.lineno, r.funcName,
            r.getMessage())

  runs = []
  for jit, barrier in ((jax.jit, jax.effects_barrier),
                       (je.jit, je.effects_barrier)):
    caplog.clear()
    with caplog.at_level(logging.INFO):
      jit(fun)(jnp.int32(4))
      barrier()
    runs.append([fields(r) for r in caplog.records])
  theirs, ours = runs
  assert theirs and ours == theirs


@pytest.mark.parametrize("kind", ["io", "debug"])
def test_an_adopted_callback_sees_the_meshes_jax_gives_it(devices, kind):
  # Inside jax_effects.jit, JAX's callbacks run with the default device and
  # meshes JAX's own impls give them (JAX 0.12's io_callback clears the
  # meshes; 0.8-0.11's sets only the default device), under a user's mesh.
  seen = []

  def host(x):
    seen.append((jax.sharding.get_abstract_mesh().empty,
                 str(jax.config.jax_default_device)))
    return x

  def f(x):
    if kind == "io":
      return io_callback(host, jax.ShapeDtypeStruct((), jnp.float32), x,
                         ordered=True)
    jax.debug.callback(host, x, ordered=True)
    return x

  x = jnp.float32(1.0)
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("i",))   # (ordered: 1)
  with jax.set_mesh(mesh):
    jax.jit(f)(x)
    jax.effects_barrier()
    je.jit(f)(x)
    je.effects_barrier()
  assert len(seen) == 2 and seen[0] == seen[1], seen


def test_jax_debug_print_of_arrays_keeps_its_call_sites_print_options(capsys):
  """A field that reaches into its argument (``{x.dtype}``: the values are
  formatted as ``jax.Array`` s, not NumPy's) is formatted under the NumPy
  print options of the call site, as ``jax.jit`` formats it, also when the
  compiled function runs again outside them."""
  def f(x):
    jax.debug.print("{x.dtype} {x}", x=x)
    return x

  x = jnp.array([1 / 3, 2 / 3], jnp.float32)
  outputs = []
  for jit, barrier in ((jax.jit, jax.effects_barrier),
                       (je.jit, je.effects_barrier)):
    g = jit(f)
    with np.printoptions(precision=2):
      g(x)
      barrier()
    capsys.readouterr()
    g(x)   # outside the options: the compiled call site's are kept
    barrier()
    outputs.append(capsys.readouterr().out)
  theirs, ours = outputs
  assert theirs == "float32 [0.33 0.67]\n"
  assert ours == theirs

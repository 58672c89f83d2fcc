"""jax_effects.print formats exactly as jax.debug.print
(``design/formatting.md``: "What a value formats as", "Format strings").

The differential test runs each case of a table through ``jax.debug.print``
and ``jax_effects.print``, eagerly, under ``jit`` with the array leaves
traced, and under ``jit`` with every leaf a constant, and compares the
printed lines. One deliberate difference: a Python number given to
``jax_effects.print`` is a static value, formatted as Python formats it
(``print("{}", x.shape)`` prints ``(2, 3)``, ``0.1`` prints ``0.1``), where
``jax.debug.print`` makes it a weakly typed ``int32``/``float32`` array; the
reference gets those numbers wrapped in :class:`PyNumber`, which
``jax.debug.print`` keeps static and formats as the number. (Under ``jit``
with the leaves traced they are arrays in both.) The other tests cover what
is deliberately stricter (fields cannot reach into arguments) and the clear
errors.
"""
import collections
import contextlib
import dataclasses
import datetime
import functools
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import tree_util

import jax_effects as je

Point = collections.namedtuple("Point", "x y")


@functools.partial(tree_util.register_dataclass, data_fields=["a", "b"],
                   meta_fields=["name"])
@dataclasses.dataclass
class Pair:
  a: object
  b: object
  name: str


class Tag:
  def __repr__(self):
    return "<Tag>"

  def __str__(self):
    return "tag!"


TAG = Tag()


class PyNumber:
  """A Python number as ``jax_effects.print`` formats it (a static value),
  for the reference: ``jax.debug.print`` keeps it static (not an array)."""

  def __init__(self, value):
    self.value = value

  def __format__(self, spec):
    return format(self.value, spec)

  def __repr__(self):
    return repr(self.value)

  def __str__(self):
    return str(self.value)


def _python_number(leaf) -> bool:
  return (isinstance(leaf, (bool, int, float, complex))
          and not isinstance(leaf, np.generic))


def _static_numbers(args, kwargs):
  """``(args, kwargs)`` with every Python number wrapped in PyNumber."""
  return tree_util.tree_map(
      lambda x: PyNumber(x) if _python_number(x) else x, (args, kwargs))

DTYPES = [jnp.bool_, jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32,
          jnp.uint32, jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64,
          jnp.int4, jnp.uint4, ml_dtypes.float8_e4m3fn]


def _arr(dtype, shape):
  # (converted by NumPy: the module is imported at collection, where a
  # conversion by JAX would compile a program per array)
  n = int(np.prod(shape))
  return jnp.asarray((np.arange(n) % 5 + 1).reshape(shape).astype(
      jnp.dtype(dtype)))


# (id, fmt, args, kwargs, np print options or None)
CASES = [
    ("int", "{}", (jnp.int32(7),), {}, None),
    ("python_scalars", "{} {} {} {}", (3, 2.5, True, 1 + 2j), {}, None),
    ("numpy_scalars", "{} {} {}",
     (np.float32(1 / 3), np.int16(-4), np.bool_(False)), {}, None),
    ("numpy_array", "{}", (np.arange(4.0),), {}, None),
    ("float_default", "{} {!s} {!r} {!a}", (jnp.float32(1 / 3),) * 4, {}, None),
    ("specs", "{:.3f}|{:>8}|{:e}|{:x}|{:+d}|{:08.2f}",
     (jnp.float32(1 / 3), jnp.int32(42), jnp.float32(1234.5), jnp.uint8(255),
      jnp.int32(5), jnp.float32(-2.5)), {}, None),
    ("conversion_and_spec", "{x!r:>40}|{x!s:^9}", (), {"x": jnp.float32(2)},
     None),
    ("nested_spec", "{:>{w}}", (jnp.int32(3),), {"w": 6}, None),
    # (issue 29: the trace-time check filled the width with 0: ">0" is a
    # zero-padded spec, which complex refuses)
    ("nested_spec_complex", "z = {:>{w}}", (jnp.complex64(1 + 2j),),
     {"w": 12}, None),
    ("nested_spec_array_width", "{:>{w}}|{:.{p}f}|{:{f}^{w}}",
     (jnp.complex64(1 - 2j), jnp.float32(1 / 3), jnp.int32(7)),
     {"w": jnp.int32(12), "p": jnp.int32(3), "f": "*"}, None),
    ("nested_spec_auto_numbered", "{:{}}|{:^{}.{}}|{!r:>{}}",
     (jnp.float32(2.5), 9, jnp.float32(1 / 3), jnp.int32(12), 4,
      jnp.complex64(1j), 30), {}, None),
    ("shape", "{} {} {!r}", ((2, 3), (), (4,)), {}, None),
    ("python_numbers", "{} {} {!r} {:.3f} {:d} {}",
     (0.1, 7, 1 / 3, 2.5, True, -3 + 0.5j), {}, None),
    ("keywords_and_positions", "{1} {0} {a} {1}",
     (jnp.int32(1), jnp.arange(3)), {"a": jnp.float32(0.5)}, None),
    ("zero_d_and_zero_size", "{} {!r} {} {!r}",
     (jnp.float32(0), jnp.float32(0), jnp.zeros((0, 3)), jnp.zeros((0, 3))),
     {}, None),
    ("matrix", "{}\n{!r}", (jnp.arange(12.0).reshape(3, 4),) * 2, {}, None),
    ("new_style_key", "{} {!r}", (jax.random.key(3),) * 2, {}, None),
    ("key_array", "{}", (jax.random.split(jax.random.key(1), 3),), {}, None),
    ("raw_key", "{}", (jax.random.PRNGKey(5),), {}, None),
    ("key_in_tree", "{}", ({"k": jax.random.key(2), "n": 1},), {}, None),
    ("rbg_key", "{} {!r}", (jax.random.key(4, impl="rbg"),) * 2, {}, None),
    ("dict", "{}", ({"foo": jnp.int32(2), "bar": (jnp.arange(2), 4.5)},), {},
     None),
    ("python_int_in_tree", "{}", ({"foo": 2},), {}, None),
    ("tuple_list", "{} {}", ((1, 2.0, True), [jnp.int8(3)]), {}, None),
    ("namedtuple", "{p} {p!r}", (), {"p": Point(jnp.int32(1), jnp.ones(2))},
     None),
    ("dataclass", "{}", (Pair(jnp.int32(1), jnp.arange(3.0), "n"),), {}, None),
    ("none_in_tree", "{}", ((None, jnp.int32(1), {"z": None}),), {}, None),
    ("static", "{} {} {} {} {} {!r} {}",
     (np.float32, jnp.dtype("bfloat16"), "text", None, TAG, TAG, int), {},
     None),
    ("static_in_tree", "{}", ({"dtype": np.int32, "s": "x", "v": jnp.int32(1),
                               "t": TAG},), {}, None),
    ("string_leaf_kw", "{s}={v}", (), {"s": "name", "v": jnp.float32(1.5)},
     None),
    ("no_fields", "just text", (), {}, None),
    ("empty", "", (), {}, None),
    ("braces", "{} {{}} {{x}}", (jnp.int32(1),), {}, None),
    ("precision", "{} {}", (jnp.linspace(0, 1, 7), {"a": jnp.linspace(0, 1, 3)}),
     {}, {"precision": 2}),
    ("threshold", "{} {!r}", (jnp.arange(100),) * 2, {},
     {"threshold": 5, "edgeitems": 1}),
    ("suppress_linewidth", "{}\n{!r}", (jnp.array([1e-9, 1.0, 2e5]),) * 2, {},
     {"suppress": True, "linewidth": 20}),
    ("sign_fixed", "{}", (jnp.array([1.5, -2.0]),), {},
     {"sign": "+", "floatmode": "fixed", "precision": 3}),
    ("formatter", "{}", (jnp.array([1.5, 2.0]),), {},
     {"formatter": {"float": lambda v: f"<{v:.1f}>"}}),
]
_4BIT = (jnp.int4, jnp.uint4)

for _dtype in DTYPES:
  _name = np.dtype(_dtype).name
  CASES.append((f"dtype_{_name}", "{} {!r} {}",
                (_arr(_dtype, (2, 3)), _arr(_dtype, (3,)), _arr(_dtype, ())),
                {}, None))


def _traced(leaf) -> bool:
  return (isinstance(leaf, (jax.Array, np.ndarray, bool, int, float, complex))
          or isinstance(leaf, np.generic) and not isinstance(leaf, np.str_))


def _run(printer, jit, barrier, mode, cases):
  """Prints every case of ``cases`` (``(id, fmt, args, kwargs)``), each
  after a line naming it (``_by_case``), eagerly or in one function under
  ``jit``. ``printer`` must print in program order."""
  leaves, treedef = tree_util.tree_flatten([c[2:4] for c in cases])
  dyn = [i for i, x in enumerate(leaves) if _traced(x)] if mode == "jit" else []

  def body(*vals):
    full = list(leaves)
    for i, v in zip(dyn, vals):
      full[i] = v
    for (name, fmt, *_), (a, k) in zip(
        cases, tree_util.tree_unflatten(treedef, full)):
      printer("--- {} ---", name)
      printer(fmt, *a, **k)

  if mode == "eager":
    body()
  else:
    jit(body)(*[leaves[i] for i in dyn])
  barrier()


def _by_case(lines, cases) -> dict:
  """``lines`` printed by ``_run`` split by case id."""
  heads = {f"--- {c[0]} ---": c[0] for c in cases}
  out = {}
  for line in lines:
    if line in heads:
      out[heads[line]] = []
    else:
      assert out, f"a line before the first case's: {line!r}"
      out[list(out)[-1]].append(line)
  assert list(out) == [c[0] for c in cases], list(out)
  return out


def _groups(cases):
  """The cases as groups printed by one program each: those without print
  options, those with 4-bit operands, and each with options alone (the
  options are the program's)."""
  four_bit = lambda c: any(getattr(x, "dtype", None) in _4BIT for x in c[2])
  plain = [c for c in cases if c[4] is None and not four_bit(c)]
  yield pytest.param(plain, id="no-options")
  yield pytest.param([c for c in cases if c[4] is None and four_bit(c)],
                     id="4-bit", marks=pytest.mark.jax_feature(
                         "4-bit integer operands"))
  for c in cases:
    if c[4] is not None:
      assert not four_bit(c)
      yield pytest.param([c], id=c[0])


def _ordered_jax_print(fmt, *args, **kwargs):
  # (one program prints every case: JAX orders only its ordered prints)
  jax.debug.print(fmt, *args, ordered=True, **kwargs)


@pytest.mark.parametrize("mode", ["eager", "jit", "jit_const"])
@pytest.mark.parametrize("cases", list(_groups(CASES)))
def test_print_lines_match_jax_debug_print(cases, mode, capsys):
  options = cases[0][4]
  outputs = []
  for printer, jit, barrier in (
      (_ordered_jax_print, jax.jit, jax.effects_barrier),
      (je.print, je.jit, je.effects_barrier)):
    capsys.readouterr()
    run = [c[:2] + (_static_numbers(*c[2:4]) if printer is _ordered_jax_print
                    and mode != "jit" else c[2:4]) for c in cases]
    with (np.printoptions(**options) if options else contextlib.nullcontext()):
      try:
        _run(printer, jit, barrier, mode, run)
      except TypeError as err:
        if printer is _ordered_jax_print and "not hashable" in str(err):
          # JAX 0.8's jax.debug.print refuses np.printoptions(formatter=...)
          # under jit (an unhashable parameter): no reference to compare with.
          pytest.skip(f"the reference jax.debug.print fails: {err}")
        raise
    outputs.append(_by_case(capsys.readouterr().out.splitlines(), cases))
  theirs, ours = outputs
  for name, *_ in cases:
    assert theirs[name], f"{name}: the reference printed nothing"
    assert ours[name] == theirs[name], name


def test_escaped_braces_before_the_first_field_format_as_str_format(
    effects_capture):
  # Deliberately not like jax.debug.print, which (JAX 0.10) looks at the
  # first literal only and prints "{{}} {} 1" here: the line is what
  # fmt.format gives, the format the trace-time check validated.
  je.print("{{}} {}", 1)
  je.jit(lambda x: je.print("a {{b}} {}", x))(2)
  assert effects_capture.printed == ["{} 1", "a {b} 2"]


def test_print_options_apply_under_jit_as_traced(effects_capture):
  # Like jax.debug.print, the options in effect when the call is traced
  # apply, whatever the options of the thread running the callback.
  f = je.jit(lambda x: je.print("{}", x))
  with np.printoptions(precision=2):
    f(jnp.array([1 / 3]))
  f(jnp.array([1 / 3]))  # cached: the traced options stay
  g = je.jit(lambda x: je.print("{}", x))
  g(jnp.array([1 / 3]))
  assert effects_capture.printed == ["[0.33]", "[0.33]", "[0.33333334]"]


def test_key_arrays_print_eagerly_and_under_jit(effects_capture):
  key = jax.random.key(0)
  je.print("{}", key)
  je.jit(lambda k: je.print("{}", k))(key)
  assert effects_capture.printed == [
      "Array((), dtype=key<fry>) overlaying:\n[0 0]", "[0 0]"]


# --- fields cannot reach into arguments ------------------------------------------

@pytest.mark.parametrize("fmt, field", [
    ("{0.__class__}", "{0.__class__}"),
    ("{x.shape}", "{x.shape}"),
    ("{0[0]}", "{0[0]}"),
    ("{0.__array_interface__[data]}", "{0.__array_interface__[data]}"),
    ("a {x.nope} b", "{x.nope}"),
    ("{:{x.real}}", "{x.real}"),
])
@pytest.mark.parametrize("jit", [False, True])
def test_attribute_and_index_fields_fail_at_trace_time(fmt, field, jit,
                                                       effects_capture):
  args = () if "x" in fmt else (jnp.arange(3.0),)
  kwargs = {"x": jnp.arange(3.0)} if "x" in fmt else {}
  if "{:{" in fmt:
    args = (jnp.float32(1),)

  def f():
    je.print(fmt, *args, **kwargs)

  with pytest.raises(ValueError) as info:
    (je.jit(f) if jit else f)()
  msg = str(info.value)
  assert repr(fmt) in msg and f"the field {field}" in msg, msg
  assert "whole arguments" in msg
  assert effects_capture.printed == []


def test_the_refusals_advice_prints_what_it_says(effects_capture):
  """Issue 29: the refusal of ``{x.shape}`` advises ``print('{}', x.shape)``,
  which prints the shape as Python does (a tuple of Python ints, static)."""
  x = jnp.zeros((2, 3))
  with pytest.raises(ValueError) as info:
    je.jit(lambda x: je.print("{x.shape}", x=x))(x)
  assert "print('{}', x.shape)" in str(info.value)
  je.jit(lambda x: je.print("{}", x.shape))(x)
  je.print("{}", x.shape)
  je.jit(lambda x: je.log("{}", x.shape))(x)
  assert effects_capture.printed == ["{}".format(x.shape)] * 2 == ["(2, 3)"] * 2
  assert [r.getMessage() for r in effects_capture.logged] == ["(2, 3)"]


@pytest.mark.parametrize("jit", [False, True])
def test_python_numbers_are_formatted_as_python_formats_them(jit,
                                                             effects_capture):
  # (as arrays they were int32/float32: 12345678901 failed the trace, 0.1
  # printed 0.10000000149011612)
  def f():
    je.print("{} {} {!r} {:>{w}}", 12345678901, 0.1, True, 1 + 2j, w=9)

  (je.jit(f) if jit else f)()
  assert effects_capture.printed == [
      "{} {} {!r} {:>{w}}".format(12345678901, 0.1, True, 1 + 2j, w=9)]


def test_log_refuses_attribute_fields_too():
  with pytest.raises(ValueError, match=r"the field \{0\.dtype\}"):
    je.jit(lambda x: je.log("{0.dtype}", x))(jnp.int32(1))


# --- arguments that are not arrays of numbers --------------------------------------

BAD_ARRAYS = [
    (np.array([object()]), "object"),
    (np.array(["a", "b"]), "str"),
    (np.array([b"a"]), "bytes"),
    (np.array(["2020-01-01"], dtype="datetime64[D]"), "datetime64"),
    (np.timedelta64(3, "s"), "timedelta64"),
    (np.datetime64("2020-01-01"), "datetime64"),
]


@pytest.mark.parametrize("bad, kind", BAD_ARRAYS, ids=[k for _, k in BAD_ARRAYS])
@pytest.mark.parametrize("api", ["print", "log", "callback"])
@pytest.mark.parametrize("jit", [False, True])
def test_non_number_arrays_get_an_error_naming_the_argument(bad, kind, api,
                                                            jit):
  def f(x):
    if api == "print":
      je.print("{} {y}", x, y={"k": bad})
    elif api == "log":
      je.log("{} {y}", x, y={"k": bad})
    else:
      je.callback(lambda *a, **k: None, None, x, y={"k": bad})

  with pytest.raises(TypeError) as info:
    (je.jit(f) if jit else f)(jnp.int32(1))
  msg = str(info.value)
  assert f"jax_effects.{api}(" in msg, msg
  assert "argument 'y'['k'] is a NumPy" in msg and f"({kind})" in msg, msg
  assert "not an array of numbers" in msg, msg
  assert "Error interpreting argument" not in msg


def test_datetime_objects_are_static_values(effects_capture):
  # Not an array at all (as for jax.debug.print): formatted as it is.
  d = datetime.date(2020, 1, 2)
  je.jit(lambda x: je.print("{} {}", d, x))(1)
  assert effects_capture.printed == ["2020-01-02 1"]


# --- stdout gone or closed ---------------------------------------------------------

def test_stdout_none_prints_nothing_like_builtin_print(monkeypatch,
                                                       effects_capture):
  f = je.jit(lambda x: je.print("v {}", x))
  monkeypatch.setattr(sys, "stdout", None)
  print("builtin")  # what the builtin does: nothing, no error
  f(1)
  je.print("eager {}", 2)
  f(3)
  je.effects_barrier()
  monkeypatch.undo()
  assert effects_capture.printed == ["v 1", "eager 2", "v 3"]


def test_closed_stdout_raises_like_builtin_print(monkeypatch):
  import io
  closed = io.StringIO()
  closed.close()
  monkeypatch.setattr(sys, "stdout", closed)
  with pytest.raises(ValueError) as builtin:
    print("builtin")
  f = je.jit(lambda x: je.print("v {}", x))
  with pytest.raises(ValueError) as ours:  # at the call or the barrier
    f(1)
    je.effects_barrier()
  assert str(ours.value) == str(builtin.value)
  with pytest.raises(ValueError):
    je.print("eager {}", 2)
  monkeypatch.undo()
  je.effects_barrier()  # reported once: nothing left

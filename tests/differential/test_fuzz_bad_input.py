"""Bad-input fuzz: random format strings, argument mixes and result specs
(``design/formatting.md``: "Arguments", "What a value formats as", "Format
strings"; ``design/errors.md``, "Who raises a callback's error, when, how
often").

Every generated case must end in one of two ways:

* the output Python gives: ``jax_effects.print(fmt, *args, **kwargs)`` inside
  ``jax_effects.jit`` prints exactly ``fmt.format(...)`` of the values
  ``jax.debug.print`` formats under ``jax.jit`` (array leaves as CPU
  ``jax.Array`` values, other leaves as they are), fields that reach into
  an argument (``{0.shape}``, ``{x[0]}``) being an error of ours,
  and ``jax_effects.callback`` returns exactly the declared results; or
* a clear error, raised at trace or call time: a ``TypeError``/``ValueError``
  from jax_effects naming what was wrong, or the very exception Python's own
  ``str.format`` (or the user's callback) raises for those values.

Never an opaque runtime error (``JaxRuntimeError``, "INTERNAL: CpuCallback
..."), never a crash, never a hang (the cases run in a watchdog thread). After
every case ``effects_barrier()`` has nothing left to report.

``N_CASES`` cases per seed, over ``SEEDS``: both larger with ``--run-slow``.
"""
import faulthandler
import random
import string
import _string
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import tree_util

import helpers
from helpers import Boom
import jax_effects as je
from jax_effects._runtime import output as _output

# sizes chosen at collection: CI's, or --run-slow's
N_CASES = helpers.scale(60, 300)
SEEDS = list(range(helpers.scale(2, 12)))
CASE_TIMEOUT_S = 120

FORMAT_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError,
                 OverflowError)


class Opaque:
  """An argument that is neither an array nor a str."""

  def __repr__(self):
    return "<Opaque>"


def _is_array_like(x):
  return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex,
                        bool))


def _host_value(x):
  """What a host callback receives for an array-like leaf."""
  v = np.asarray(jnp.asarray(x))
  return v[()] if v.ndim == 0 else v


def _format_value(x):
  """What jax.debug.print formats for an array-like leaf under jax.jit."""
  return jax.device_put(np.asarray(jnp.asarray(x)), jax.devices("cpu")[0])


def _is_leaf(x):
  return x is None


def with_watchdog(run_cases, timeout):
  """Runs ``run_cases()`` in a thread; fails (with all stacks) if it hangs."""
  result = {}

  def target():
    try:
      run_cases()
    except BaseException as exc:  # noqa: BLE001 - re-raised below
      result["error"] = exc

  t = threading.Thread(target=target, daemon=True)
  t.start()
  t.join(timeout)
  if t.is_alive():
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    pytest.fail(f"fuzz cases did not finish in {timeout}s (hang)")
  if "error" in result:
    raise result["error"]


def check_clear_error(exc, case, *, python_error=None):
  """``exc`` is a clear error for ``case`` (see the module docstring)."""
  msg = str(exc)
  assert not isinstance(exc, jax.errors.JaxRuntimeError), (case, msg)
  for opaque in ("INTERNAL", "CpuCallback", "XlaRuntimeError",
                 "jax_effects callback error #"):
    assert opaque not in msg, (case, type(exc), msg)
  assert msg.strip(), (case, type(exc))
  ours = isinstance(exc, (TypeError, ValueError)) and "jax_effects" in msg
  same_as_python = python_error is not None and type(exc) is type(python_error)
  assert ours or same_as_python, (
      f"unclear error for {case}: {type(exc).__name__}: {msg}; "
      f"python says {python_error!r}")


def jit_with_dynamic_leaves(body, args, kwargs):
  """Calls ``body(*args, **kwargs)`` in ``je.jit`` with array-like leaves as
  traced arguments (Python numbers too) and the other leaves static."""
  leaves, treedef = tree_util.tree_flatten((args, kwargs), is_leaf=_is_leaf)
  dyn = [i for i, x in enumerate(leaves) if _is_array_like(x)]

  def f(*vals):
    full = list(leaves)
    for i, v in zip(dyn, vals):
      full[i] = v
    a, k = tree_util.tree_unflatten(treedef, full)
    return body(*a, **k)

  return je.jit(f)(*[leaves[i] for i in dyn])


# --- random values -----------------------------------------------------------

def rand_array_like(rng):
  kind = rng.randrange(9)
  if kind == 0:
    return rng.randint(-1000, 1000)
  if kind == 1:
    return rng.choice([0.5, -2.25, 1e-3, 3.0, 1e6])
  if kind == 2:
    return rng.choice([True, False])
  if kind == 3:
    return jnp.int32(rng.randint(-50, 50))
  if kind == 4:
    return jnp.float32(rng.random() * 10)
  if kind == 5:
    return jnp.arange(rng.randint(0, 4), dtype=rng.choice([jnp.int32, jnp.float32]))
  if kind == 6:
    return np.float32(rng.random())
  if kind == 7:
    return jnp.ones((2, 2), jnp.bool_)
  return complex(rng.randint(0, 3), 1)


def rand_leaf(rng):
  r = rng.random()
  if r < 0.75:
    return rand_array_like(rng)
  if r < 0.93:
    return rng.choice(["s", "", "héllo", "{}", "a\nb"])
  if r < 0.97:
    return None
  return rng.choice([Opaque(), object(), len, b"bytes"])


def rand_tree(rng, depth=0):
  r = rng.random()
  if depth >= 2 or r < 0.7:
    return rand_leaf(rng)
  n = rng.randint(0, 3)
  kind = rng.randrange(3)
  kids = [rand_tree(rng, depth + 1) for _ in range(n)]
  if kind == 0:
    return kids
  if kind == 1:
    return tuple(kids)
  return {k: v for k, v in zip("abc", kids)}


FIELD_NAMES = ["", "", "", "0", "1", "2", "5", "a", "b", "x", "a b"]
FIELD_SUFFIXES = ["", "", "", "[0]", "[1]", "[a]", "[x]", ".shape", ".dtype",
                  ".real", ".nope", ".__class__"]
CONVERSIONS = ["", "", "", "!r", "!s", "!a", "!z"]
SPECS = ["", "", "", ":", ":.2f", ":>6", ":d", ":x", ":e", ":%", ":q", ":08.3f",
         ":{}", ":{0}", ":,", ":^5s"]
LITERALS = ["", " ", "x=", "text", "{{", "}}", "{", "}", "é", "\t", "%s"]


def rand_format(rng):
  parts = []
  for _ in range(rng.randint(0, 4)):
    parts.append(rng.choice(LITERALS))
    if rng.random() < 0.8:
      parts.append("{" + rng.choice(FIELD_NAMES) + rng.choice(FIELD_SUFFIXES)
                   + rng.choice(CONVERSIONS) + rng.choice(SPECS) + "}")
  return "".join(parts)


def fitting_format(rng, n_args, names):
  """A format using every argument once, with harmless conversions/specs."""
  fields = [("{}" if rng.random() < 0.5 else "{%d}" % i) for i in range(n_args)]
  if any(f == "{}" for f in fields):   # no mixing of auto and manual numbering
    fields = ["{}"] * n_args
  fields += ["{%s}" % k for k in names]
  out = []
  for f in fields:
    extra = rng.choice(["", "", "!r", "!s", ":", ":>8", ":<3", ":^4"])
    if extra.startswith(":") and rng.random() < 0.5:
      extra = "!s" + extra
    out.append(rng.choice(LITERALS[:4]) + f[:-1] + extra + "}")
  return "".join(out) + rng.choice(["", " end", "{{}}"])


def mutate_format(rng, fmt):
  kind = rng.randrange(5)
  pos = rng.randint(0, len(fmt))
  if kind == 0:     # an extra random field
    return fmt[:pos] + rand_format(rng) + fmt[pos:]
  if kind == 1:     # a lone brace
    return fmt[:pos] + rng.choice("{}") + fmt[pos:]
  if kind == 2:     # drop a field
    i = fmt.find("{")
    j = fmt.find("}", i)
    return fmt if i < 0 or j < 0 else fmt[:i] + fmt[j + 1:]
  if kind == 3:     # a random spec on the first field
    i = fmt.find("}")
    return fmt if i < 0 else fmt[:i] + rng.choice(SPECS) + fmt[i:]
  return fmt.replace("{", "{" + rng.choice(FIELD_NAMES) + rng.choice(FIELD_SUFFIXES), 1)


def rand_print_case(rng):
  args = tuple(rand_tree(rng) for _ in range(rng.randint(0, 3)))
  names = rng.sample(["a", "b", "x", "y", "a b"], rng.randint(0, 3))
  kwargs = {k: rand_tree(rng) for k in names}
  r = rng.random()
  if r < 0.5:
    fmt = fitting_format(rng, len(args), names)
  elif r < 0.8:
    fmt = mutate_format(rng, fitting_format(rng, len(args), names))
  else:
    fmt = rand_format(rng)
  if rng.random() < 0.03:
    fmt = rng.choice([None, 3, b"{}"])
  return fmt, args, kwargs


# --- print ---------------------------------------------------------------------

def _fields(fmt: str):
  for _, field, spec, _ in string.Formatter().parse(fmt):
    if field is not None:
      yield field
      if spec:
        yield from _fields(spec)


def used_arguments(fmt: str) -> set:
  """Positions and names of the arguments ``fmt`` refers to (it formats)."""
  used, auto = set(), [0]

  def visit(s):
    for _, field, spec, _ in string.Formatter().parse(s):
      if field is None:
        continue
      first, _ = _string.formatter_field_name_split(field)
      if first == "":
        first, auto[0] = auto[0], auto[0] + 1
      used.add(first)
      if spec:
        visit(spec)

  visit(fmt)
  return used


def print_expectation(fmt, args, kwargs):
  """``("ok", line)`` or ``("error", python_error_or_None)``."""
  leaves, treedef = tree_util.tree_flatten((args, kwargs), is_leaf=_is_leaf)
  if not isinstance(fmt, str):
    return "error", None
  try:
    fields = list(_fields(fmt))
  except ValueError as err:
    return "error", err
  if any("." in f or "[" in f for f in fields):
    return "error", None  # jax_effects formats whole arguments only
  host = [_format_value(x) if _is_array_like(x) else x for x in leaves]
  a, k = tree_util.tree_unflatten(treedef, host)
  try:
    line = fmt.format(*a, **k)
  except FORMAT_ERRORS as err:
    return "error", err
  # jax_effects is stricter than str.format: every argument must be used.
  if used_arguments(fmt) != set(range(len(a))) | set(k):
    return "error", None
  return "ok", line


def run_print_case(case, lines):
  fmt, args, kwargs = case
  expect, detail = print_expectation(fmt, args, kwargs)
  lines.clear()
  try:
    jit_with_dynamic_leaves(
        lambda *a, **k: je.print(fmt, *a, **k), args, kwargs)
    je.effects_barrier()
  except FORMAT_ERRORS as exc:
    assert expect == "error", (
        f"{case} should print {detail!r}, raised {type(exc).__name__}: {exc}")
    check_clear_error(exc, case, python_error=detail)
    assert lines == [], (case, lines)
  else:
    assert expect == "ok", f"{case} printed {lines}, expected an error {detail!r}"
    assert lines == [detail], case
  je.effects_barrier()   # the error was reported once: nothing left


def _print_fuzz(seed, n):
  rng = random.Random(seed)
  lines = []
  _output.add_line_listener(lines.append)
  outcomes = {"ok": 0, "error": 0}

  def run_cases():
    for _ in range(n):
      case = rand_print_case(rng)
      run_print_case(case, lines)
      outcomes[print_expectation(*case)[0]] += 1

  try:
    with_watchdog(run_cases, CASE_TIMEOUT_S * 10)
  finally:
    _output.remove_line_listener(lines.append)
  # The generator exercises both outcomes.
  assert outcomes["ok"] > n // 10 and outcomes["error"] > n // 10, outcomes


@pytest.mark.parametrize("seed", SEEDS)
def test_print_fuzz(seed):
  _print_fuzz(seed, N_CASES)


# --- callback results ---------------------------------------------------------

DTYPES = [np.float32, np.int32, np.bool_, np.uint8, np.complex64]
SHAPES = [(), (3,), (2, 2), (0,)]


def rand_spec(rng, depth=0):
  r = rng.random()
  if depth < 2 and r < 0.25:
    kids = [rand_spec(rng, depth + 1) for _ in range(rng.randint(0, 2))]
    return tuple(kids) if rng.random() < 0.5 else {k: v for k, v in zip("pq", kids)}
  if r < 0.9:
    return jax.ShapeDtypeStruct(rng.choice(SHAPES), rng.choice(DTYPES))
  return rng.choice([3, "f32", Opaque(), jax.ShapeDtypeStruct((), np.float64),
                     jax.ShapeDtypeStruct((2,), np.int64), np.zeros((2,), np.int32)])


def _spec_ok(leaf):
  if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
    return False
  return jax.dtypes.canonicalize_dtype(leaf.dtype) == np.dtype(leaf.dtype)


def correct_value(rng, leaf):
  shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
  v = np.asarray(rng.random() * np.ones(shape) * 7).astype(dtype)
  if shape == () and rng.random() < 0.3:   # a Python scalar is fine too
    return v.item()
  if shape and rng.random() < 0.2:         # and so is a list
    return v.tolist()
  return v


def wrong_value(rng, leaf):
  shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
  kind = rng.randrange(6)
  if kind == 0:
    return np.zeros(shape + (1,), dtype)
  if kind == 1:
    other = np.float64 if dtype != np.float64 else np.int8
    return np.zeros(shape, other)
  if kind == 2:
    return "not a number"
  if kind == 3:
    return Opaque()
  if kind == 4:
    return None
  return -1   # out of range for unsigned, wrong shape for non-scalars


def rand_result(rng, spec):
  """A value for ``spec``, with random mistakes."""
  if rng.random() < 0.04:
    return rng.choice([None, (), [1, 2], Opaque()])
  leaves, treedef = tree_util.tree_flatten(spec)
  vals = [wrong_value(rng, l) if _spec_ok(l) and rng.random() < 0.15
          else (correct_value(rng, l) if _spec_ok(l) else 0) for l in leaves]
  out = tree_util.tree_unflatten(treedef, vals)
  if rng.random() < 0.05 and isinstance(out, tuple):
    out = out + (np.float32(0),)
  if rng.random() < 0.05 and isinstance(out, tuple):
    out = list(out)
  return out


def callback_expectation(spec, result, args, kwargs):
  """``("ok", expected_result)`` or ``("error", python_error_or_None)``."""
  arg_leaves = tree_util.tree_leaves((args, kwargs))
  if any(not _is_array_like(x) for x in arg_leaves):
    return "error", None
  leaves, treedef = tree_util.tree_flatten(spec)
  if not all(_spec_ok(l) for l in leaves):
    return "error", None
  if isinstance(result, Boom):
    return "error", result
  if spec is None:
    return "ok", None
  try:  # a leaf may be a list (or anything NumPy takes as an array)
    r_leaves = treedef.flatten_up_to(result)
  except (ValueError, TypeError):
    return "error", None
  out = []
  for r, l in zip(r_leaves, leaves):
    try:
      v = (np.asarray(r, l.dtype)
           if isinstance(r, (bool, int, float, complex, list, tuple))
           else np.asarray(r))
    except FORMAT_ERRORS as err:
      return "error", err
    if jax.dtypes.canonicalize_dtype(v.dtype) == np.dtype(l.dtype):
      v = v.astype(l.dtype)   # as JAX's callbacks: float64 is float32 (no x64)
    if v.shape != tuple(l.shape) or v.dtype != np.dtype(l.dtype):
      return "error", None
    out.append(v)
  return "ok", tree_util.tree_unflatten(treedef, out)


def rand_callback_case(rng):
  spec = None if rng.random() < 0.1 else rand_spec(rng)
  result = Boom("user error") if rng.random() < 0.05 else rand_result(rng, spec)
  args = tuple(rand_tree(rng) for _ in range(rng.randint(0, 2)))
  args = tuple(a for a in args if not isinstance(a, str) or rng.random() < 0.3)
  kwargs = {k: rand_array_like(rng) for k in rng.sample("uv", rng.randint(0, 2))}
  return spec, result, args, kwargs


def run_callback_case(case):
  spec, result, args, kwargs = case
  expect, detail = callback_expectation(spec, result, args, kwargs)
  received = []

  def fn(*a, **k):
    received.append((a, k))
    if isinstance(result, Boom):
      raise result
    return result

  try:
    out = jit_with_dynamic_leaves(
        lambda *a, **k: je.callback(fn, spec, *a, **k), args, kwargs)
    out = jax.device_get(out)
    je.effects_barrier()
  except (*FORMAT_ERRORS, Boom) as exc:
    assert expect == "error", (
        f"{case} should return {detail!r}, raised {type(exc).__name__}: {exc}")
    if isinstance(result, Boom) and received:
      assert exc is result, (case, exc)
    else:
      check_clear_error(exc, case, python_error=detail)
  else:
    assert expect == "ok", f"{case} returned {out!r}, expected an error"
    tree_util.tree_map(
        lambda got, want: np.testing.assert_array_equal(got, want, strict=True),
        out, detail)
    assert tree_util.tree_structure(out) == tree_util.tree_structure(detail)
    # The callback saw the arguments' NumPy values, structure kept.
    assert len(received) == 1
    want_args = tree_util.tree_map(_host_value, (args, kwargs))
    got_leaves, got_tree = tree_util.tree_flatten(received[0])
    assert got_tree == tree_util.tree_structure(want_args), case
    for got, want in zip(got_leaves, tree_util.tree_leaves(want_args)):
      np.testing.assert_array_equal(got, want, strict=True)
  je.effects_barrier()


def _callback_fuzz(seed, n):
  rng = random.Random(1000 + seed)
  outcomes = {"ok": 0, "error": 0}

  def run_cases():
    for _ in range(n):
      case = rand_callback_case(rng)
      run_callback_case(case)
      outcomes[callback_expectation(*case)[0]] += 1

  with_watchdog(run_cases, CASE_TIMEOUT_S * 10)
  assert outcomes["ok"] > n // 10 and outcomes["error"] > n // 10, outcomes


@pytest.mark.parametrize("seed", SEEDS)
def test_callback_fuzz(seed):
  _callback_fuzz(seed, N_CASES)

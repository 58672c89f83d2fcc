"""A print per step of a compiled loop: the fast host path prints what
``jax.debug.print`` prints (issue 48, point 1; ``design/formatting.md``, "In
a compiled loop").

The path a ``scan``'s print takes (one operand, its placement given to the
host function, a one-field format formatted without ``str.format``, 0-d
numbers formatted as their ``.item()``, NumPy's print options compared by
identity) is compared line for line with ``jax.debug.print`` under
``jax.jit`` for every dtype JAX prints and several formats, and pinned
where it could differ: the print options of the trace under changing
options, a NumPy whose scalars would format otherwise, and what a sink
written to sees of ``placement()``. No timing is asserted (the speed is
bench (q)).
"""
import io
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_effects as je
from jax_effects._primitives import edges

DTYPES = [jnp.bool_, jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32,
          jnp.uint32, jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64,
          ml_dtypes.float8_e4m3fn]
# Each group of dtypes is one compiled program per printer.
DTYPE_GROUPS = [
    pytest.param(DTYPES, id="every"),
    # (JAX 0.8/0.9 refuse 4-bit operands: skipped there, naming why)
    pytest.param([jnp.int4], id="int4", marks=pytest.mark.jax_feature(
        "4-bit integer operands"))]

FORMATS = ["{}", "v={:>12}|", "{0}", "x {0} y {0}", "{!r}", "{{}} {}",
           "{x}"]


def _values(dtype):
  v = np.array([0, 1, -2, 3.25, 7, -0.5, 100], np.float32)
  if jnp.dtype(dtype).kind in "ub":
    v = np.abs(v)
  return jnp.asarray(v).astype(dtype)


def _lines(printer, jit, fmts, *xss):
  """The lines of one compiled program: a scan printing each of ``xss`` per
  format, the scans in order; a list of lines per array (its index) and
  format."""
  def scan(fmt):
    def body(c, x):
      if "{x}" in fmt:
        printer(fmt, x=x)
      else:
        printer(fmt, x)
      return c, None
    return body

  def f(*vs):
    return [jax.lax.scan(scan(fmt), 0, v)[0] for v in vs for fmt in fmts]

  out = io.StringIO()
  saved, sys.stdout = sys.stdout, out
  try:
    jax.block_until_ready(jit(f)(*xss))
    je.effects_barrier()
    jax.effects_barrier()
  finally:
    sys.stdout = saved
  lines = out.getvalue().splitlines()
  n = len(xss[0])
  assert all(len(xs) == n for xs in xss)
  assert len(lines) == len(fmts) * len(xss) * n, lines
  keys = [(i, fmt) for i in range(len(xss)) for fmt in fmts]
  return {key: lines[j * n:(j + 1) * n] for j, key in enumerate(keys)}


def _jax_print(fmt, *args, **kwargs):
  jax.debug.print(fmt, *args, ordered=True, **kwargs)


@pytest.mark.parametrize("dtypes", DTYPE_GROUPS)
def test_scan_lines_match_jax_debug_print(dtypes):
  # One program per printer covers every dtype and format (a scan each, in
  # order).
  xss = [_values(d) for d in dtypes]
  ours = _lines(je.print, je.jit, FORMATS, *xss)
  # (JAX 0.10 looks at the first literal only: "{{}} {}" is "{}"'s lines)
  theirs = _lines(_jax_print, jax.jit, [f for f in FORMATS if f != "{{}} {}"],
                  *xss)
  for i, d in enumerate(dtypes):
    theirs[i, "{{}} {}"] = ["{{}} {}".format(v) for v in ours[i, "{}"]]
    for fmt in FORMATS:
      assert len(ours[i, fmt]) == len(xss[i]), (jnp.dtype(d).name, fmt)
      assert ours[i, fmt] == theirs[i, fmt], (jnp.dtype(d).name, fmt)


def test_print_options_of_the_trace_under_changing_options(effects_capture):
  # The host keeps the options dict it found equal to the trace's: a
  # different dict (other options, or equal ones set anew) is compared
  # again, never taken for the one it saw.
  def body(c, x):
    je.print("{}", x)
    return c, None

  def body_g(c, x):   # (JAX caches a scan body's trace by the function)
    je.print("{}", x)
    return c, None

  xs = jnp.full((2, 1), 1 / 3, jnp.float32)
  with np.printoptions(precision=2):
    f = je.jit(lambda v: jax.lax.scan(body, 0, v)[0])
    f(xs)
  g = je.jit(lambda v: jax.lax.scan(body_g, 1, v)[0])
  g(xs)
  for options in ({}, {"precision": 2}, {}, {"precision": 5}, {"precision": 2}):
    with np.printoptions(**options):
      f(xs)
      g(xs)
    je.effects_barrier()
  assert effects_capture.printed == (["[0.33]"] * 2 + ["[0.33333334]"] * 2
                                     + (["[0.33]"] * 2
                                        + ["[0.33333334]"] * 2) * 5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bool_,
                                   jnp.complex64])
def test_a_numpy_whose_scalars_format_otherwise_keeps_them(dtype,
                                                           monkeypatch):
  # formats_as_item is checked on samples of values and specs: where one
  # text differs, the dtype keeps formatting its NumPy scalars (the
  # reference's), and the lines are still jax.debug.print's.
  xs = _values(dtype)
  expected = _lines(_jax_print, jax.jit, ["v={:+}"], xs)
  checked = []

  def same_format(a, spec):
    checked.append(spec)
    return spec != "+"

  monkeypatch.setattr(edges, "_as_item", {})
  monkeypatch.setattr(edges, "_same_format", same_format)
  assert _lines(je.print, je.jit, ["v={:+}"], xs) == expected
  assert "+" in checked
  assert edges._as_item == {jnp.dtype(dtype): False}


def test_numpys_numbers_format_as_their_item():
  rng = np.random.default_rng(0)
  for dtype in (np.bool_, np.int8, np.uint16, np.int32, np.uint64,
                np.float16, np.float32, np.float64, np.complex64):
    assert edges.formats_as_item(np.dtype(dtype)), dtype
    values = rng.standard_normal(50) * 10.0 ** rng.integers(-5, 6, 50)
    with np.errstate(all="ignore"):
      arrays = [np.array(v).astype(dtype) for v in values]
    for a in arrays:
      for spec in ("", ".2f", "<9", "e", "g", "+"):
        try:
          expected = format(a[()], spec)
        except (TypeError, ValueError) as err:
          expected = type(err)
        try:
          got = format(a.item(), spec)
        except (TypeError, ValueError) as err:
          got = type(err)
        assert got == expected, (dtype, a, spec)


def test_no_dtype_outside_numpys_own_numbers_formats_as_item():
  for dtype in (jnp.bfloat16, ml_dtypes.float8_e4m3fn, jnp.int4,
                np.longdouble, np.clongdouble, np.dtype("datetime64[s]")):
    assert not edges.formats_as_item(np.dtype(dtype)), dtype
  for dtype in (np.bool_, np.int8, np.uint64, np.float16, np.float64,
                np.complex128):
    assert edges.formats_as_item(np.dtype(dtype)), dtype


def test_a_sink_sees_the_prints_placement(effects_capture):
  seen = []

  class Sink(io.StringIO):
    def write(self, text):
      seen.append(je.placement())
      return super().write(text)

  def body(c, x):
    je.print("{}", x)
    return c, None

  f = je.jit(lambda v: jax.lax.scan(body, 0, v)[0])
  sink, saved = Sink(), sys.stdout
  sys.stdout = sink
  try:
    f(jnp.arange(3.0))
    je.effects_barrier()
  finally:
    sys.stdout = saved
  assert sink.getvalue() == "0.0\n1.0\n2.0\n"
  device = jax.devices()[0]
  assert seen == [je.Placement(device.id, None, device.process_index)] * 3
  assert effects_capture.printed == ["0.0", "1.0", "2.0"]


class _CharByChar:
  """A Python-level stream that writes a text one character at a time,
  letting other threads run in between: lines stay whole only if the
  writer holds a lock around each write."""

  def __init__(self):
    self.chars = []

  def write(self, text):
    for c in text:
      self.chars.append(c)
      time.sleep(0)
    return len(text)

  def flush(self):
    pass

  def getvalue(self):
    return "".join(self.chars)


@pytest.mark.parametrize("one_field", [True, False])
@pytest.mark.parametrize("stream", [_CharByChar, io.StringIO])
def test_lines_stay_whole_across_threads(stream, one_field):
  # Python's own C streams (io.StringIO here, a file's TextIOWrapper) keep a
  # written line whole by themselves; any other stream is written under the
  # output lock. (One field: the print's own host path, output.line_at;
  # several: output.deliver_line.)
  n, steps = 4, 30

  fmt = "{}" if one_field else "{} of {}"
  statics = () if one_field else (steps,)

  def body(c, x):
    je.print(fmt, 1000 * c + x, *statics)
    return c, None

  f = je.jit(lambda c, xs: jax.lax.scan(body, c, xs)[0])
  xs = jnp.arange(steps)
  f(jnp.int32(0), xs)   # (compiled once, before the threads)
  je.effects_barrier()
  out, saved = stream(), sys.stdout
  start = threading.Barrier(n)

  def run(i):
    start.wait()
    f(jnp.int32(i + 1), xs)
    je.effects_barrier()

  sys.stdout = out
  try:
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    je.effects_barrier(all_threads=True)
  finally:
    sys.stdout = saved
  lines = out.getvalue().splitlines()
  tail = "" if one_field else f" of {steps}"
  for i in range(1, n + 1):
    assert [s for s in lines if s.startswith(str(i))] == [
        f"{1000 * i + k}{tail}" for k in range(steps)]
  assert len(lines) == n * steps

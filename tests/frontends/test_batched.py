"""Batched effects in loops: ``jax_effects.batched`` (issue 48, point 2;
``design/tokens.md``, "Batched effects in loops").

Each program runs twice, unbatched and inside ``batched``, and must write
exactly the same lines: in ``scan``, ``fori_loop``, ``while_loop`` with a
trip count known only at run time, nested loops, under ``vmap``, in
``shard_map`` (each device's lines), under plain ``jax.jit``, for every
dtype and several formats. Pinned besides: the loop stages its rows (its
trace holds a flush of ``K`` rows, and no per-step host call), order
against an unbatched callback in the same loop and against logs on the
same chain, the remainder flushed at the loop's exit, the barrier, a later
callback's error after the staged lines, a failing write in a flush, and
the byte budget (``K`` reduced to fit, or an error naming ``max_bytes``).
No timing is asserted (the speed is bench (q), ``q_batched``).
"""
import contextlib
import io
import logging
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np
import pytest

import helpers
import jax_effects as je

K = 4


def _lines(fn, *args, jit=je.jit):
  out = io.StringIO()
  saved, sys.stdout = sys.stdout, out
  try:
    jax.block_until_ready(jit(fn)(*args))
    je.effects_barrier()
  finally:
    sys.stdout = saved
  return out.getvalue().splitlines()


def _both(make, *args, k=K, jit=je.jit):
  """The lines of ``make(block)`` unbatched and batched (``block()`` is the
  context around the loop)."""
  plain = _lines(make(contextlib.nullcontext), *args, jit=jit)
  batched = _lines(make(lambda: je.batched(k=k)), *args, jit=jit)
  return plain, batched


def _host_calls(fn, *args) -> list[str]:
  """The host calls in ``fn``'s threaded trace, by description."""
  text = str(je.jit(fn).trace(*args).jaxpr)
  return re.findall(r"host_callback=<host callback (.*?)>\n", text)


def _scan(block):
  def f(xs):
    def body(c, x):
      je.print("x={} c={}", x, c)
      je.print("{}", x * 2)
      return c + 1, x
    with block():
      c, ys = jax.lax.scan(body, 0, xs)
    je.print("after {}", c)
    return ys
  return f


def _reverse_scan(block):
  def f(xs):
    def body(c, x):
      je.print("r {}", x)
      return c, x + 1
    with block():
      return jax.lax.scan(body, 0, xs, reverse=True)[1]
  return f


def _fori(block):
  def f(n):
    with block():
      return jax.lax.fori_loop(
          0, 10, lambda i, c: (je.print("i={} n={}", i, n), c + i)[1], 0)
  return f


def _while(block):
  def f(n):
    def body(c):
      je.print("w {}", c)
      return c + 1
    with block():
      return jax.lax.while_loop(lambda c: c < n, body, 0)
  return f


def _while_effectful_cond(block):
  def f(n):
    def cond(c):
      je.print("cond {}", c)
      return c < n
    def body(c):
      je.print("body {}", c)
      return c + 1
    with block():
      return jax.lax.while_loop(cond, body, 0)
  return f


def _nested(block):
  def f(xs):
    def inner(c, x):
      je.print("  in {}", x)
      return c, None

    def outer(c, row):
      je.print("out {}", c)
      jax.lax.scan(inner, 0, row)
      n = jax.lax.while_loop(lambda i: i < c, lambda i: (
          je.print("  w {}", i), i + 1)[1], 0)
      return c + 1 + 0 * n, None
    with block():
      return jax.lax.scan(outer, 0, xs)[0]
  return f


PROGRAMS = {
    "scan": (_scan, lambda: jnp.arange(10.0)),
    "reverse_scan": (_reverse_scan, lambda: jnp.arange(9.0)),
    "fori_loop": (_fori, lambda: jnp.int32(3)),
    "while_loop": (_while, lambda: jnp.int32(11)),
    "while_effectful_cond": (_while_effectful_cond, lambda: jnp.int32(6)),
    "nested": (_nested, lambda: jnp.arange(15.0).reshape(5, 3)),
}


def test_lines_as_unbatched():
  # One program runs them all, each after a line naming it (unbatched).
  def make_all(block):
    fs = [make(block) for make, _ in PROGRAMS.values()]

    def f(*args):
      outs = []
      for name, f, arg in zip(PROGRAMS, fs, args):
        je.print("== {}", name)
        outs.append(f(arg))
      return outs
    return f
  plain, batched = _both(make_all, *(arg() for _, arg in PROGRAMS.values()))
  assert [l for l in plain if l.startswith("== ")] == [
      f"== {name}" for name in PROGRAMS]
  for name in PROGRAMS:
    start = plain.index(f"== {name}") + 1
    end = next((i for i in range(start, len(plain))
                if plain[i].startswith("== ")), len(plain))
    assert end > start, name   # (the program prints)
    assert batched[start:end] == plain[start:end], name
  assert batched == plain


@pytest.mark.parametrize("name", PROGRAMS)
def test_loop_stages_its_rows(name):
  """The loop's trace flushes rows of K, and no loop calls the host once a
  print (every host call is a flush, or an unbatched print outside)."""
  make, arg = PROGRAMS[name]
  calls = _host_calls(make(lambda: je.batched(k=K)), arg())
  flushes = [c for c in calls if c.startswith("jax_effects.batched flush")]
  assert flushes
  others = [c for c in calls if c not in flushes]
  # (only what is outside the loop or in a cond_fun is called unbatched)
  assert all("after" in c or "cond" in c for c in others), others


def test_while_loop_count_known_at_run_time_only():
  # One compiled function per mode, called with each count.
  plain_f, batched_f = _while(contextlib.nullcontext), _while(
      lambda: je.batched(k=K))
  for n in (0, 1, K - 1, K, K + 1, 3 * K + 2):
    plain = _lines(plain_f, jnp.int32(n))
    batched = _lines(batched_f, jnp.int32(n))
    assert batched == plain == [f"w {i}" for i in range(n)]


def test_remainder_flushed_at_exit():
  """10 steps in rows of 4: the last 2 lines come from the exit's flush."""
  def make(block):
    def f(xs):
      with block():
        jax.lax.scan(lambda c, x: (je.print("{}", x), (c, None))[1], 0, xs)
      return xs
    return f
  _, batched = _both(make, jnp.arange(10))
  assert batched == [str(i) for i in range(10)]


def test_barrier_delivers_every_staged_line():
  def f(xs):
    with je.batched(k=8):
      jax.lax.scan(lambda c, x: (je.print("b {}", x), (c, None))[1], 0, xs)
    return xs
  out = io.StringIO()
  saved, sys.stdout = sys.stdout, out
  try:
    je.jit(f)(jnp.arange(21))   # (not waited for)
    je.effects_barrier()
  finally:
    sys.stdout = saved
  assert out.getvalue().splitlines() == [f"b {i}" for i in range(21)]


class _Events:
  """A ``sys.stdout`` that records each line as an event, beside callbacks'."""

  def __init__(self):
    self.events = []
    self._partial = ""

  def write(self, text):
    text = self._partial + text
    *lines, self._partial = text.split("\n")
    self.events.extend(("line", line) for line in lines)
    return len(text)

  def flush(self):
    pass


def _events(make, arg, k, events) -> list[list]:
  """The events of ``make(block, events)`` unbatched and batched (lines
  written and what its callbacks record, in one list)."""
  runs = []
  for block in (contextlib.nullcontext, lambda: je.batched(k=k)):
    stream = _Events()
    stream.events = events
    events.clear()
    saved, sys.stdout = sys.stdout, stream
    try:
      jax.block_until_ready(je.jit(make(block, events))(arg))
      je.effects_barrier()
    finally:
      sys.stdout = saved
    runs.append(list(events))
  return runs


def _order_program(block, events, every=3):
  """A callback every ``every`` steps (in a cond), or (``every=0``) one
  with a result at every step, between two prints."""
  def record(v):
    events.append(("callback", int(v)))

  def record_result(v):
    record(v)
    return np.int32(v)

  def f(xs):
    def body(c, x):
      je.print("p {}", x)
      if every:
        jax.lax.cond(x % every == 0, lambda: je.callback(record, None, x),
                     lambda: None)
      else:
        c = c + je.callback(record_result,
                            jax.ShapeDtypeStruct((), jnp.int32), x)
      je.print("q {}", x)
      return c, None
    with block():
      jax.lax.scan(body, 0, xs)
    return xs
  return f


def test_order_against_an_unbatched_callback():
  """A callback in the loop (with a result, or in a cond) comes after the
  lines staged before it and before the later ones (one program: a loop
  per kind of callback, in turn)."""
  everies = [0, 1, 3]

  def make(block, events):
    fs = [_order_program(block, events, every) for every in everies]
    return lambda xs: [f(xs) for f in fs]
  runs = _events(make, jnp.arange(10), K, [])
  expected = {}
  for every in everies:
    expected[every] = []
    for i in range(10):
      expected[every].append(("line", f"p {i}"))
      if not every or i % every == 0:
        expected[every].append(("callback", i))
      expected[every].append(("line", f"q {i}"))
  for run in runs:
    first = 0
    for every in everies:
      n = len(expected[every])
      assert run[first:first + n] == expected[every], every
      first += n
    assert len(run) == first
  assert runs[0] == runs[1]


def test_order_of_prints_and_logs_on_one_chain():
  """Two kinds of batched effects in one loop: one buffer, rows in order."""
  events = []

  class Handler(logging.Handler):
    def emit(self, record):
      events.append(("log", record.getMessage()))

  logger = logging.getLogger("jax_effects.test_batched")
  logger.handlers[:] = [Handler()]
  logger.setLevel(logging.INFO)
  logger.propagate = False

  def make(block, events):
    def f(xs):
      def body(c, x):
        je.log("log {}", x, logger=logger)
        je.print("print {}", x)
        return c, None
      with block():
        jax.lax.scan(body, 0, xs)
      return xs
    return f

  runs = _events(make, jnp.arange(7), 3, events)
  assert runs[0] == [e for i in range(7)
                     for e in (("log", f"log {i}"), ("line", f"print {i}"))]
  assert runs[1] == runs[0]


def test_error_in_a_later_callback_after_the_staged_lines():
  """A callback that raises at step 6: the lines staged before it are
  delivered, the error reported; its later effects skipped."""
  def fail_at_six(v):
    if int(v) == 6:
      raise helpers.Boom("six")

  def f(xs):
    def body(c, x):
      je.print("p {}", x)
      je.callback(fail_at_six, None, x)
      return c, None
    with je.batched(k=K):
      jax.lax.scan(body, 0, xs)
    return xs

  out = io.StringIO()
  saved, sys.stdout = sys.stdout, out
  try:
    got = helpers.reports(lambda: jax.block_until_ready(
        je.jit(f)(jnp.arange(10))))
  finally:
    sys.stdout = saved
  assert out.getvalue().splitlines() == [f"p {i}" for i in range(7)]
  errors = [e for r in got for e in helpers.flat(r)]
  assert [str(e) for e in errors] == ["six"]


def test_failing_write_in_a_flush_is_reported():
  """A write that raises in a flush: reported as a print's error; what the
  flush delivered before it is written."""
  def f(xs):
    with je.batched(k=K):
      jax.lax.scan(lambda c, x: (je.print("f {!r}", x), (c, None))[1], 0,
                   xs)
    return xs

  stream = helpers.FlakyStream(io.StringIO(), marker="Array(5,")
  saved, sys.stdout = sys.stdout, stream
  try:
    got = helpers.reports(lambda: jax.block_until_ready(
        je.jit(f)(jnp.arange(10))))
  finally:
    sys.stdout = saved
  errors = [e for r in got for e in helpers.flat(r)]
  assert errors == [stream.error]
  assert "".join(stream.written).splitlines() == [
      f"f Array({i}, dtype=int32)" for i in range(5)]


def test_vmap_of_a_loop():
  def make(block):
    def f(xs):
      def g(row):
        def body(c, x):
          je.print("v {} {}", x, c)
          return c + x, None
        return jax.lax.scan(body, 0.0, row)[0]
      with block():
        return jax.vmap(g)(xs)
    return f
  xs = jnp.arange(15.0).reshape(3, 5)
  plain, batched = _both(make, xs)
  assert len(plain) == 15
  assert batched == plain
  assert any(c.startswith("jax_effects.batched flush")
             for c in _host_calls(make(lambda: je.batched(k=K)), xs))


def _per_device(lines):
  by_device = {}
  for line in lines:
    prefix = line.split("]")[0]
    by_device.setdefault(prefix, []).append(line)
  return by_device


def _shard_map_program(mesh):
  """``make(block)``: a scan printing per device in a shard_map, then an
  "end" line after it."""
  def make(block):
    def f(xs):
      def g(row):
        def body(c, x):
          je.print("s {}", x)
          return c, None
        with block():
          jax.lax.scan(body, 0, row[0])
        return row
      out = jax.shard_map(g, mesh=mesh, in_specs=P("i"),
                          out_specs=P("i"))(xs)
      je.print("end")
      return out
    return f
  return make


def test_shard_map_each_device_lines(mesh):
  xs = helpers.sharded(mesh, jnp.arange(48.0).reshape(8, 6))
  plain, batched = _both(_shard_map_program(mesh), xs)
  assert len(plain) == 49 and plain[-1] == batched[-1] == "end"
  assert _per_device(batched) == _per_device(plain)
  assert len(_per_device(plain)) == 9   # (8 devices and "end")


def test_shard_map_in_the_deterministic_view(mesh):
  """In ``deterministic()`` the batched lines are held and released as the
  unbatched ones are: the same text, to the letter."""
  xs = helpers.sharded(mesh, jnp.arange(48.0).reshape(8, 6))
  with je.deterministic():
    plain, batched = _both(_shard_map_program(mesh), xs)
  assert len(plain) == 49 and plain[-1] == "end"
  assert batched == plain


def test_under_plain_jax_jit():
  make, arg = PROGRAMS["scan"]
  plain, batched = _both(make, arg(), jit=jax.jit)
  assert batched == plain
  assert batched == _lines(make(contextlib.nullcontext), arg())


DTYPES = [jnp.bool_, jnp.int8, jnp.uint16, jnp.int32, jnp.float16,
          jnp.bfloat16, jnp.float32, jnp.complex64, ml_dtypes.float8_e4m3fn]
FORMATS = ["{}", "v={:>12}|", "{!r}", "{} {}"]


def test_text_as_unbatched():
  # One program for every dtype: a loop (in its own block) per dtype and
  # format, in order.
  v = np.array([0, 1, -2, 3.25, 7, -0.5, 100], np.float32)
  xss = [jnp.asarray(np.abs(v) if jnp.dtype(d).kind in "ub" else v).astype(d)
         for d in DTYPES]

  def make(block):
    def f(*xss):
      for xs in xss:
        for fmt in FORMATS:
          def body(c, x, fmt=fmt):
            je.print(fmt, *([x] * fmt.count("{")))
            return c, None
          with block():
            jax.lax.scan(body, 0, xs)
      return xss
    return f
  plain, batched = _both(make, *xss, k=3)
  assert len(plain) == 7 * len(FORMATS) * len(DTYPES)
  for i, (dtype, fmt) in enumerate(
      (d, fmt) for d in DTYPES for fmt in FORMATS):
    lines = slice(7 * i, 7 * (i + 1))
    assert batched[lines] == plain[lines], (jnp.dtype(dtype).name, fmt)
  assert batched == plain


def _budget_program(max_bytes, k=128):
  def f(xs):
    def body(c, x):
      je.print("{}", x)
      return c, None
    with je.batched(k=k, max_bytes=max_bytes):
      jax.lax.scan(body, 0, xs)
    return xs
  return f


def _buffer_rows(f, *args) -> set[int]:
  """The row counts of the staging buffers in ``f``'s threaded trace (the
  ``ids`` operand of each flush: ``i32[K]``)."""
  text = str(je.jit(f).trace(*args).jaxpr)
  rows = set()
  for m in re.finditer(r"host_callback=<host callback jax_effects\.batched "
                       r"flush[^\n]*\n\s*ordered=\w+\n\s*\] (\w+) (\w+) "
                       r"(\w+) (\w+)", text):
    ids = m.group(4)
    found = re.search(rf"\b{ids}:i32\[(\d+)\]", text)
    rows.add(int(found.group(1)))
  return rows


def test_byte_budget_reduces_k():
  xs = jnp.zeros((20, 2), jnp.float32)   # (a row: 8 bytes + 4 for its id)
  assert _buffer_rows(_budget_program(1 << 20), xs) == {128}
  assert _buffer_rows(_budget_program(12 * 3 + 11), xs) == {3}
  assert _buffer_rows(_budget_program(1 << 20, k=5), xs) == {5}
  plain = _lines(lambda v: (jax.lax.scan(
      lambda c, x: (je.print("{}", x), (c, None))[1], 0, v), v)[1], xs)
  assert _lines(_budget_program(12 * 3), xs) == plain


def test_a_row_over_the_budget_is_an_error():
  with pytest.raises(ValueError, match=r"max_bytes=10\).*takes 12 bytes"):
    je.jit(_budget_program(10)).trace(jnp.zeros((20, 2), jnp.float32))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"k": 0}, ValueError, "k must be at least 1, got 0"),
    ({"k": 2.5}, TypeError, "k must be an int, got float"),
    ({"max_bytes": -1}, ValueError, "max_bytes must be at least 1"),
])
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    with je.batched(**kwargs):
      pass


def test_scan_results_and_lines_as_unbatched():
  """Strips of K steps and the rest, forwards and in reverse: the same
  carry, outputs and lines (one program: a loop per length and direction,
  each in its own block, in order)."""
  ns = [0, 1, K - 1, K, K + 1, 3 * K + 2]
  cases = [(n, reverse) for reverse in (False, True) for n in ns]

  def make(block):
    def f(*xss):
      def body(c, x):
        je.print("{} {}", x, c)
        return c + x, (x * 2, c)
      outs = []
      for xs, (_, reverse) in zip(xss, cases):
        with block():
          outs.append(jax.lax.scan(body, 0.0, xs, reverse=reverse))
      return outs
    return f
  xss = [jnp.arange(float(n)) for n, _ in cases]
  results = []
  for block in (contextlib.nullcontext, lambda: je.batched(k=K)):
    out = io.StringIO()
    saved, sys.stdout = sys.stdout, out
    try:
      r = jax.block_until_ready(je.jit(make(block))(*xss))
      je.effects_barrier()
    finally:
      sys.stdout = saved
    results.append((jax.tree.map(np.asarray, r), out.getvalue().splitlines()))
  (plain, plain_lines), (batched, batched_lines) = results
  assert len(plain_lines) == 2 * sum(ns)
  first = 0
  for (n, reverse), p, b in zip(cases, plain, batched):
    lines = slice(first, first + n)
    first += n
    xs = [float(line.split()[0]) for line in plain_lines[lines]]
    assert xs == sorted(range(n), reverse=reverse), (n, reverse)   # its own
    assert batched_lines[lines] == plain_lines[lines], (n, reverse)
    assert jax.tree.structure(b) == jax.tree.structure(p), (n, reverse)
    for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(p)):
      np.testing.assert_array_equal(x, y, err_msg=f"n={n} reverse={reverse}")
  assert batched_lines == plain_lines


def test_lines_reach_the_capture_fixture(effects_capture):
  """A line listener (the pytest fixture) gets every batched line (one
print in the loop: its rows formatted together)."""
  lines = _lines(_budget_program(1 << 20, k=K), jnp.arange(10))
  assert effects_capture.printed == lines == [str(i) for i in range(10)]

"""Printing big and sharded arrays: only what is shown crosses.

Contract (``design/formatting.md``, "Summarized arrays"): an operand of
``print``/``log`` (or of an adopted ``jax.debug.print``) that NumPy will
print summarized reaches the host as its edges only, and prints exactly what
``jax.debug.print`` prints for the whole array; under automatic partitioning
each device passes its part of the edges to the host, adding no collective
to the compiled module, and the first device never waits for the others
inside the computation.

* The differential test generates thousands of cases (shapes, 0-d and
  empty included, dtypes, PRNG keys, shardings over the 8 devices, values
  computed in the program, ``{}``/``{!r}``/``{!s}``/keywords/pytrees, NumPy
  print options), prints them from one ``jax_effects.jit`` program per
  batch, called with several sets of values, and compares the text of every
  case with ``jax.debug.print``'s for the whole array.
* The collective count compares the compiled module of programs printing
  big sharded arrays (top level, ``scan``, ``fori_loop``, ``cond``) with the
  same programs without the prints.
* A program with dozens of big prints and its own collectives runs (no
  device waits for another inside it), keeping every effect's order.
"""
import contextlib
import io
import re
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import helpers
import jax_effects as je
from jax_effects import _compat

#: Print sites per compiled program (each its own shape, dtype, sharding,
#: format and print options), programs (batches), and calls of each program
#: with new values: the CI default runs 4 x 150 x 4 = 2,400 cases, compiling
#: 4 programs; ``--run-slow`` 60 x 250 x 4 = 60,000.
BATCH = helpers.scale(150, 250)
BATCHES = helpers.scale(4, 60)
DRAWS = 4

_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32,
           np.uint32, np.float16, ml_dtypes.bfloat16, np.float32,
           np.complex64, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
           "key"]
if _compat.unsupported_reason("4-bit integer operands") is None:
  _DTYPES += [ml_dtypes.int4, ml_dtypes.uint4]

_FLOAT_MODES = ["fixed", "unique", "maxprec", "maxprec_equal"]


def _jax_print_takes_formatter() -> bool:
  """JAX 0.8's jax.debug.print refuses np.printoptions(formatter=...) under
  jit (an unhashable parameter): no reference for such cases there."""
  try:
    with np.printoptions(formatter={"float": str}):
      jax.jit(lambda x: jax.debug.print("{}", x)).trace(1.0)
  except TypeError:
    return False
  return True


def _meshes(devices):
  d = np.array(devices)
  return [Mesh(d, ("i",)), Mesh(d.reshape(4, 2), ("a", "b")),
          Mesh(d.reshape(2, 2, 2), ("a", "b", "c"))]


def _shape(rng):
  ndim = int(rng.choice([0, 1, 1, 1, 2, 2, 2, 3, 3, 4]))
  sizes = [1, 2, 3, 4, 5, 6, 7, 8, 8, 9, 12, 16, 16, 24, 32]
  shape = [int(rng.choice(sizes)) for _ in range(ndim)]
  if ndim and rng.random() < 0.04:
    shape[int(rng.integers(ndim))] = 0   # empty
  while np.prod(shape) > 2048:
    shape[int(np.argmax(shape))] //= 2
  return tuple(shape)


def _spec(rng, mesh, shape):
  """A random partition of ``shape``'s axes over ``mesh`` (even tiling)."""
  free = list(mesh.axis_names)
  spec = []
  for n in shape:
    rng.shuffle(free)
    use = []
    for name in list(free):
      if rng.random() < 0.5 and n % (mesh.shape[name] * int(np.prod(
          [mesh.shape[u] for u in use]))) == 0 and n:
        use.append(name)
        free.remove(name)
    spec.append(None if not use else use[0] if len(use) == 1 else tuple(use))
  return P(*spec)


def _values(rng, dtype, shape):
  """Random values (NumPy: made without compiling anything)."""
  if dtype == "key":   # a threefry key array, from random key data
    data = rng.integers(0, 1 << 32, size=(*shape, 2), dtype=np.uint32)
    return jax.random.wrap_key_data(data)
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.random(shape) < 0.5
  if jnp.issubdtype(dtype, jnp.integer):
    info = jnp.iinfo(dtype)
    lo, hi = int(info.min), int(info.max)
    if rng.random() < 0.5:
      lo, hi = max(lo, -20), min(hi, 20)
    v = rng.integers(lo, hi, size=shape, endpoint=True)
    return v.astype(dtype)
  scale = 10.0 ** float(rng.integers(-6, 7))
  v = rng.standard_normal(shape) * scale
  if rng.random() < 0.3:
    v = np.round(v)
  if rng.random() < 0.1 and v.size:
    flat = v.reshape(-1)
    flat[rng.integers(v.size)] = rng.choice([np.inf, -np.inf, np.nan])
  if jnp.issubdtype(dtype, jnp.complexfloating):
    v = v + 1j * rng.standard_normal(shape) * scale
  with np.errstate(over="ignore", invalid="ignore"):
    return v.astype(dtype)


def _options(rng, with_formatter: bool) -> dict:
  options = {
      "threshold": int(rng.choice([0, 1, 5, 10, 20, 40, 60] * 3 + [1000])),
      "edgeitems": int(rng.choice([1, 1, 2, 2, 3, 3, 3, 4] * 3 + [0])),
      "linewidth": int(rng.integers(10, 121)),
      "precision": int(rng.integers(1, 11)),
      "suppress": bool(rng.random() < 0.3),
      "floatmode": str(rng.choice(_FLOAT_MODES)),
      "sign": str(rng.choice(["-", "+", " "])),
      "legacy": [False, False, False, "1.13", "1.21", "1.25"][
          int(rng.integers(6))],
  }
  if options["legacy"] == "1.13" and options["floatmode"] == "unique":
    options["floatmode"] = "maxprec"   # NumPy itself fails to print then
  if with_formatter and rng.random() < 0.05:
    options["formatter"] = {"float_kind": lambda v: f"<{v:.2f}>",
                            "int": lambda v: f"i{v}"}
  return options


# (format with "{v}" standing for the value's field(s), how the value is
# passed: positionally, by keyword, or inside a pytree)
_FORMATS = [
    ("{}", "arg"), ("{!r}", "arg"), ("{!s}", "arg"), ("{v}", "kw"),
    ("{v!r}", "kw"), ("{0}|{0!r}", "arg"), ("{}", "arg"), ("{!r}", "arg"),
    ("{} and {!r}", "twice"), ("{}", "tree"),
]

# What the program computes from its argument before printing it (the
# printed value is then an intermediate with the partitioner's sharding).
# Values sharded unevenly (a slice of a sharded axis) are in a test of their
# own: their resharding costs a second of compilation each.
_OPS = [
    ("arg", lambda x: x, lambda x: x),
    ("arg", lambda x: x, lambda x: x),
    ("arg", lambda x: x, lambda x: x),
    ("transpose", lambda x: x.T, lambda x: x.T),
    ("flip", lambda x: jnp.flip(x, 0) if x.ndim else x,
     lambda x: np.flip(x, 0) if x.ndim else x),
]
_UNEVEN = ("drop_first", lambda x: x[1:] if x.ndim and x.shape[0] else x,
           lambda x: x[1:] if x.ndim and x.shape[0] else x)


def _case(rng, mesh, with_formatter, ops=_OPS):
  dtype = _DTYPES[int(rng.integers(len(_DTYPES)))]
  shape = _shape(rng)
  value = _values(rng, dtype, shape)
  spec = _spec(rng, mesh, shape)
  sharding = NamedSharding(mesh, spec)
  value = jax.device_put(value, sharding)
  fmt, how = _FORMATS[int(rng.integers(len(_FORMATS)))]
  op_name, op, np_op = ops[int(rng.integers(len(ops)))]
  if dtype == "key":
    op_name, op, np_op = _OPS[0]
  def draw(rng):   # another value of the same shape, dtype and sharding
    return jax.device_put(_values(rng, dtype, shape), sharding)

  return {"value": value, "draw": draw,
          "fmt": fmt, "how": how, "op": op, "np_op": np_op,
          "options": _options(rng, with_formatter),
          "what": f"{dtype} {shape} {mesh.shape} {spec} {op_name}"}


def _program(printer, cases):
  def program(*values):
    for i, (case, x) in enumerate(zip(cases, values)):
      x = case["op"](x)
      fmt, how = f"@@{i}@@ " + case["fmt"], case["how"]
      with np.printoptions(**case["options"]):
        if how == "arg":
          printer(fmt, x)
        elif how == "kw":
          printer(fmt, v=x)
        elif how == "twice":
          printer(fmt, x, x)
        else:
          printer(fmt, {"a": x, "b": (x, np.int32(1))})
    return values[0]
  return program


def _texts(out: str) -> dict:
  parts = re.split(r"@@(\d+)@@ ", out)
  return {int(i): text.rstrip("\n") for i, text in zip(parts[1::2], parts[2::2])}


def _run(printer, jit, barrier, cases, values):
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.block_until_ready(jit(_program(printer, cases))(*values))
    barrier()
  return _texts(buf.getvalue())


def _whole(cases) -> list:
  """Each case's value, whole on one device, as ``jax.debug.print``'s
  callback receives it under ``jax.jit`` (a key array as its key data)."""
  out = []
  for c in cases:
    x = c["value"]
    x = np.asarray(jax.random.key_data(x) if _is_key(x) else x)
    out.append(jax.device_put(np.array(c["np_op"](x)),
                              jax.devices()[0]))
  return out


def _expected(cases) -> dict:
  """What ``jax.debug.print`` prints for each case: under ``jax.jit`` its
  callback formats ``jax.Array`` values of the whole arrays with
  ``fmt.format`` under the print options of the call site (checked against
  ``jax.debug.print`` itself, eagerly and under ``jax.jit``, in batch 0)."""
  out = {}
  for i, (case, x) in enumerate(zip(cases, _whole(cases))):
    with np.printoptions(**case["options"]):
      fmt, how = case["fmt"], case["how"]
      if how == "arg":
        out[i] = fmt.format(x)
      elif how == "kw":
        out[i] = fmt.format(v=x)
      elif how == "twice":
        out[i] = fmt.format(x, x)
      else:
        out[i] = fmt.format({"a": x, "b": (x, jnp.int32(1))})
  return out


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize("batch", range(BATCHES))
def test_text_matches_jax_debug_print_of_the_whole_array(batch, devices):
  rng = np.random.default_rng(1000 + batch)
  mesh = _meshes(devices)[batch % 3]   # one mesh per program (JAX's rule)
  with_formatter = _jax_print_takes_formatter()
  cases = [_case(rng, mesh, with_formatter) for _ in range(BATCH)]
  theirs = _expected(cases)
  if batch == 0:   # that is jax.debug.print's text, eagerly and under jit
    identity = [{**c, "op": lambda x: x} for c in cases]
    whole = _whole(cases)
    assert _run(jax.debug.print, lambda f: f, jax.effects_barrier, identity,
                whole) == theirs
    if np.lib.NumpyVersion(np.__version__) >= "2.1.0":
      # (NumPy 2.0 keeps one set of print options for all threads: JAX's
      # unordered prints, which XLA runs concurrently, apply each other's.)
      assert _run(jax.debug.print, jax.jit, jax.effects_barrier, identity,
                  whole) == theirs
  assert sorted(theirs) == list(range(BATCH)), "the reference lost lines"
  program = je.jit(_program(je.print, cases))   # compiled once, called DRAWS times
  for draw in range(DRAWS):
    if draw:
      cases = [{**c, "value": c["draw"](rng)} for c in cases]
      theirs = _expected(cases)
    ours = _run(je.print, lambda f: program, je.effects_barrier, cases,
                [c["value"] for c in cases])
    for i, case in enumerate(cases):
      assert ours.get(i) == theirs[i], (
          f"draw {draw}, case {i}: {case['what']} {case['fmt']!r} "
          f"({case['how']}) with {case['options']}")


def test_text_of_unevenly_sharded_values(devices):
  # A slice of a sharded axis leaves a value sharded unevenly (the last
  # shards padded): what the partitioner does for it varies; the text does
  # not.
  rng = np.random.default_rng(7)
  mesh = _meshes(devices)[1]
  cases = [_case(rng, mesh, False, ops=[_UNEVEN]) for _ in range(6)]
  assert _run(je.print, je.jit, je.effects_barrier, cases,
              [c["value"] for c in cases]) == _expected(cases)


# --- no collective ------------------------------------------------------------

_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
                "reduce-scatter", "collective-broadcast", "ragged-all-to-all")


def _collectives(compiled_text: str) -> int:
  """Collective operations in a compiled module (async pairs counted once)."""
  ops = re.findall(r"=\s*\S+\s+([a-z\-]+)\(", compiled_text)
  return sum(1 for op in ops
             if op.removesuffix("-start") in _COLLECTIVES
             and not op.endswith("-done"))


def _programs(print_):
  """Programs printing big arrays (``print_(x)`` where they print) at the top
  level and in ``scan``, ``fori_loop`` and ``cond``, each with a reduction."""
  def top(x):
    print_(x)
    print_(x * 2)
    return x.sum()

  def scan(x):
    def body(c, _):
      print_(c)
      return c * 0.5, c.sum()
    return jax.lax.scan(body, x, None, length=3)[1].sum()

  def fori(x):
    def body(i, c):
      print_(c + i)
      return c * 0.5
    return jax.lax.fori_loop(0, 3, body, x).sum()

  def cond(x):
    def yes(v):
      print_(v)
      return v * 2
    return jax.lax.cond(x.sum() > 0, yes, lambda v: v - 1, x).sum()

  return {"top": top, "scan": scan, "fori_loop": fori, "cond": cond}


_PRINTERS = {
    "print": lambda x: je.print("x = {}", x),
    "print_repr_tree": lambda x: je.print("{}", {"x": x, "n": x.shape}),
    "log": lambda x: je.log("x = {!r}", x),
    "jax.debug.print": lambda x: jax.debug.print("x = {}", x),
}


@contextlib.contextmanager
def _partitioner(name: str):
  """Shardy (JAX's default) or GSPMD (``jax_use_shardy_partitioner=False``)."""
  saved = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", name == "shardy")
  try:
    yield
  finally:
    jax.config.update("jax_use_shardy_partitioner", saved)


@pytest.mark.parametrize("partitioner, layout", [
    ("shardy", "1d"), ("shardy", "2d"), ("shardy", "2d_minor"),
    ("gspmd", "2d")])
def test_a_summarized_operand_adds_no_collective(partitioner, layout, devices,
                                                 capsys, effects_capture):
  with _partitioner(partitioner):
    _no_collective_added(layout, devices, capsys, effects_capture)


def _no_collective_added(layout, devices, capsys, effects_capture):
  # Per printer, one program printing at the top level and in scan,
  # fori_loop and cond, next to the same program without the prints.
  d = np.array(devices)
  mesh, shape, spec = {
      "1d": (Mesh(d, ("i",)), (4096,), P("i")),
      "2d": (Mesh(d.reshape(4, 2), ("a", "b")), (64, 48), P("a", "b")),
      "2d_minor": (Mesh(d.reshape(4, 2), ("a", "b")), (48, 64),
                   P(None, ("a", "b"))),
  }[layout]
  x = jax.device_put(jnp.arange(np.prod(shape), dtype=jnp.float32)
                     .reshape(shape), NamedSharding(mesh, spec))

  def program(printer):
    return lambda v: sum(f(v) for f in _programs(printer).values())

  plain = _collectives(jax.jit(program(lambda v: None))
                       .lower(x).compile().as_text())
  # ... and they run, showing the text of the whole values, in program
  # order: the top level's two, each iteration's (the devices' parts of one
  # iteration assembled together, never another iteration's: a device may
  # run iterations ahead of the first one's host calls) and cond's.
  whole = np.asarray(x)
  values = [whole, whole * 2,                                   # top
            whole, whole * 0.5, whole * 0.25,                   # scan
            whole + 0, whole * 0.5 + 1, whole * 0.25 + 2,       # fori_loop
            whole]                                              # cond
  values = [jax.device_put(v.astype(np.float32), devices[0]) for v in values]
  texts = {
      "print": [f"x = {v}" for v in values],
      "print_repr_tree": ["{}".format({"n": shape, "x": v}) for v in values],
      "log": [f"x = {v!r}" for v in values],
      "jax.debug.print": [f"x = {v}" for v in values],
  }
  for name, printer in _PRINTERS.items():
    f = je.jit(program(printer))
    ours = _collectives(f.lower(x).compile().as_text())
    assert ours == plain, f"{name}: {ours} collectives, plain program {plain}"
    capsys.readouterr()
    logged, printed = (len(effects_capture.logged),
                       len(effects_capture.printed))
    f(x)
    je.effects_barrier()
    if name == "log":
      assert [r.getMessage() for r in effects_capture.logged[logged:]] == (
          texts[name])
      continue
    # (jax.debug.print is adopted: its lines are printed as je.print's)
    assert effects_capture.printed[printed:] == texts[name], name
    assert capsys.readouterr().out == "".join(
        line + "\n" for line in texts[name]), name


# --- order, with the program's own collectives --------------------------------

ORDER_WITH_COLLECTIVES = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_cpu_collective_call_warn_stuck_timeout_seconds=2"
        + " --xla_cpu_collective_call_terminate_timeout_seconds=10")
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_effects as je

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    specs = [P("a", "b"), P("b", "a"), P(("a", "b")), P(None, ("a", "b"))]
    xs = [jax.device_put(jnp.arange(64 * 48, dtype=jnp.float32)
                         .reshape(64, 48) + i,
                         NamedSharding(mesh, specs[i % 4])) for i in range(40)]
    events = []

    class Lines:
      def write(self, s):
        events.extend(("line", l) for l in s.splitlines() if l)
      def flush(self):
        pass

    def prints_only(*xs):   # stalled when the first device waited
      acc = 0.0
      for i, x in enumerate(xs):
        with np.printoptions(threshold=10, edgeitems=1):
          je.print("big {} {}", i, x * 2)
        acc = acc + (x.T @ x).sum()   # the program's own collectives
      return acc

    def with_others(*xs):   # other effects keep their place behind them
      acc = 0.0
      for i, x in enumerate(xs[:16]):
        with np.printoptions(threshold=10, edgeitems=1):
          je.print("big {} {}", i, x * 2)
        je.callback(lambda i: events.append(("callback", int(i))), None, i)
        je.print("small {}", i)
        acc = acc + (x.T @ x).sum()
      return acc

    def expected(n, others):
      out = []
      for i, x in enumerate(xs[:n]):
        with np.printoptions(threshold=10, edgeitems=1):
          out.extend(("line", l) for l in
                     f"big {i} {np.asarray(x) * 2}".splitlines())
        if others:
          out += [("callback", i), ("line", f"small {i}")]
      return out

    out, sys.stdout = sys.stdout, Lines()
    for f, n, reps, others in ((prints_only, 40, 5, False),
                               (with_others, 16, 3, True)):
      del events[:]
      g = je.jit(f)
      for _ in range(reps):
        g(*xs)
      je.effects_barrier()
      if events != expected(n, others) * reps:
        sys.stdout = out
        print(f"MISMATCH in {f.__name__}: {events[:8]}")
        sys.exit(1)
    sys.stdout = out
    print("OK")
""")


def test_order_holds_and_nothing_stalls_with_the_programs_collectives():
  # XLA's CPU runtime runs each device's program in its own order: the
  # first device must not wait inside the computation for the others' parts
  # (another device may first enter one of the program's collectives, which
  # waits for the first device: a deadlock, which XLA ends by aborting the
  # process). The effect is left to the call bringing the last part; the
  # thread's later effects keep their order behind it.
  proc = helpers.run_script(ORDER_WITH_COLLECTIVES, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip() == "OK", (
      f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


# --- where the edges are cut ---------------------------------------------------

def test_edges_under_vmap_shard_map_plain_jit_and_eagerly(mesh,
                                                          effects_capture):
  # Cut on the device (one device, per device in shard_map, per element
  # under vmap, under plain jax.jit), or not at all (eagerly, vmap too):
  # the same text as the whole array's.
  xs = jnp.arange(3 * 2000, dtype=jnp.float32).reshape(3, 2000) / 7

  def show(x):
    je.print("{}", x)

  texts = [str(np.asarray(x)) for x in xs]
  je.jit(jax.vmap(show))(xs)
  jax.vmap(show)(xs)
  jax.jit(jax.vmap(show))(xs)   # plain jax.jit: the fallback lowering
  show(xs[1])
  je.effects_barrier()
  assert effects_capture.printed == texts * 3 + [texts[1]]

  sharded = jax.device_put(jnp.arange(8 * 4000, dtype=jnp.int32),
                           NamedSharding(mesh, P("i")))
  start = len(effects_capture.printed)
  je.jit(jax.shard_map(lambda v: (show(v), v)[1], mesh=mesh,
                       in_specs=P("i"), out_specs=P("i")))(sharded)
  je.effects_barrier()
  shards = np.asarray(sharded).reshape(8, 4000)
  assert sorted(effects_capture.printed[start:]) == sorted(
      f"[device {d.id} shard {i} process 0] {shards[i]}"
      for i, d in enumerate(mesh.devices.flat))

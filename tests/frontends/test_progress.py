"""``jax_effects.progress``: progress bars for compiled loops.

The contract is ``jax_effects/_frontends/progress.py`` (and
``design/transformations.md``, "Progress bars"; README "Progress bars"):
entering the block draws the bar at ``0/total``, each ``bar.update()`` advances
it in program order (with ``every=k``, once per ``k`` updates, counted on the
device), leaving it draws the final count; one bar per execution, per device in
``shard_map``, one for a ``vmap`` batch, forward pass only under ``grad``.

The oracle is a plain-Python model of the bar (:func:`model`) interleaved
with the program's ``print`` lines, and the same program run eagerly
(``jax.disable_jit()``): what lands in one stream, in order, must be equal.
Bars are drawn by the standard-library renderer (tqdm hidden, ``no_tqdm``)
unless a test says otherwise; ``mininterval=0`` draws every host call.
"""
import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_effects as je
from jax_effects._runtime import bars as _bars
from jax_effects._runtime import output as _output


class Stream:
  """A text stream that files what it gets under ``tag`` in ``events``
  (shared by the streams of one test, so lines keep their order): each
  piece of one write between line ends (``\n``, or ``\r``: tqdm redraws
  with ``"\r" + text``) is one line."""

  def __init__(self, events, tag, lock):
    self.events, self.tag, self.lock = events, tag, lock
    self.raw = []   # what was written, as written

  def write(self, text):
    with self.lock:
      self.raw.append(text)
      self.events.extend((self.tag, line) for line in re.split(r"[\r\n]", text)
                         if line.strip())
    return len(text)

  def flush(self):
    pass

  def isatty(self):
    return False


class Streams:
  """``file``: a stream for the bar (``("bar", text)`` events); printed lines
  come as ``("print", line)`` (as they are written to stdout); ``events``:
  all of them in the order they were written."""

  def __init__(self):
    self.events, self.lock = [], threading.Lock()
    self.file = Stream(self.events, "bar", self.lock)
    self.printed = Stream(self.events, "print", self.lock)


@pytest.fixture
def streams():
  s = Streams()

  def listener(line):
    s.printed.write(line + "\n")

  _output.add_line_listener(listener)
  try:
    yield s.file, s.events
  finally:
    _output.remove_line_listener(listener)


@pytest.fixture
def no_tqdm(monkeypatch):
  """tqdm cannot be imported: the standard-library renderer draws."""
  for name in ("tqdm", "tqdm.auto", "tqdm.std"):
    monkeypatch.setitem(sys.modules, name, None)


_PLAIN = re.compile(
    r"^(?P<desc>.*?): +\d+%\|[# ]{10}\| (?P<n>\d+)/(?P<total>\d+) \[")
_PLAIN_NO_TOTAL = re.compile(r"^(?P<desc>.*?): (?P<n>\d+)it \[")


def drawn(events):
  """The events with each bar drawing reduced to ``("bar", desc, "n/total")``
  (``"n"`` without a total)."""
  out = []
  for tag, text in events:
    if tag == "bar":
      m = _PLAIN.match(text)
      if m:
        out.append(("bar", m["desc"], f"{m['n']}/{m['total']}"))
        continue
      m = _PLAIN_NO_TOTAL.match(text)
      assert m, f"not a bar drawing: {text!r}"
      out.append(("bar", m["desc"], m["n"]))
    else:
      out.append((tag, text))
  return out


def model(desc, total, every, steps, step_lines=lambda i: []):
  """The events a bar of ``total`` updated once per step gives, with
  ``step_lines(i)`` printed before the update of step ``i``."""
  out = [("bar", desc, f"0/{total}")]
  n = pending = 0
  for i in range(steps):
    out += [("print", line) for line in step_lines(i)]
    pending += 1
    if pending >= every:
      n, pending = n + pending, 0
      out.append(("bar", desc, f"{n}/{total}"))
  if pending:
    out.append(("bar", desc, f"{n + pending}/{total}"))
  return out


def run(f, *args):
  out = f(*args)
  je.effects_barrier()
  return out


LOOPS = {
    "scan": lambda n, body, x: jax.lax.scan(
        lambda c, i: (body(i, c), None), x, jnp.arange(n))[0],
    "fori_loop": lambda n, body, x: jax.lax.fori_loop(0, n, body, x),
    "fori_loop_dynamic": lambda n, body, x: jax.lax.fori_loop(
        0, jnp.int32(n) + 0 * x, body, x),
    "while_loop": lambda n, body, x: jax.lax.while_loop(
        lambda s: s[0] < n, lambda s: (s[0] + 1, body(s[0], s[1])),
        (0, x))[1],
}


def _training(loop, file, every, n=5):
  def train(x):
    je.print("before")
    with je.progress(n, desc="train", every=every, file=file,
                     mininterval=0) as bar:
      def step(i, c):
        je.print("step {}", i)
        bar.update()
        return c + 1
      x = LOOPS[loop](n, step, x)
    je.print("after {}", x)
    return x
  return train


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_open_update_close_in_order_with_print_lines(streams, no_tqdm, loop,
                                                     every):
  file, events = streams
  train = _training(loop, file, every)
  expected = ([("print", "before")]
              + model("train", 5, every, 5, lambda i: [f"step {i}"])
              + [("print", "after 5")])
  assert run(je.jit(train), jnp.int32(0)) == 5
  assert drawn(events) == expected
  events.clear()
  with jax.disable_jit():   # the eager program: the same stream
    run(train, jnp.int32(0))
  assert drawn(events) == expected
  events.clear()
  run(je.jit(train), jnp.int32(0))   # one bar per execution
  assert drawn(events) == expected


@pytest.mark.parametrize("every", [1, 3])
def test_under_plain_jax_jit(streams, no_tqdm, every):
  """Without the pass the count is kept on the host (one call per update),
  in the same order."""
  file, events = streams
  train = _training("scan", file, every)
  run(jax.jit(train), jnp.int32(0))
  steps = model("train", 5, every, 5, lambda i: [f"step {i}"])
  assert drawn(events) == [("print", "before"), *steps, ("print", "after 5")]


def test_every_k_makes_one_host_call_per_k_updates_plus_the_last(
    streams, no_tqdm, monkeypatch):
  calls = []
  advance = _bars.BarSpec.advance
  monkeypatch.setattr(_bars.BarSpec, "advance",
                      lambda self, *a: (calls.append(int(a[1])),
                                        advance(self, *a))[1])
  file, events = streams

  @je.jit
  def f(x):
    with je.progress(1005, desc="k", every=100, file=file,
                     mininterval=0) as bar:
      def step(c, _):
        bar.update()
        return c + 1, None
      return jax.lax.scan(step, x, None, length=1005)[0]

  assert run(f, 0) == 1005
  assert calls == [100] * 10   # the 5 left are the close's
  assert drawn(events) == model("k", 1005, 100, 1005)
  assert [e[2] for e in drawn(events)][-2:] == ["1000/1005", "1005/1005"]
  assert _bars.open_bars() == 0


def test_nested_loops_two_bars(streams, no_tqdm):
  file, events = streams

  @je.jit
  def f(x):
    with je.progress(2, desc="outer", file=file, mininterval=0) as outer:
      def outer_step(i, c):
        with je.progress(3, desc="inner", every=2, file=file,
                         mininterval=0) as inner:
          def inner_step(j, c):
            inner.update()
            return c + 1
          c = jax.lax.fori_loop(0, 3, inner_step, c)
        outer.update()
        return c
      return jax.lax.fori_loop(0, 2, outer_step, x)

  assert run(f, 0) == 6
  inner = model("inner", 3, 2, 3)
  assert drawn(events) == [("bar", "outer", "0/2"), *inner,
                           ("bar", "outer", "1/2"), *inner,
                           ("bar", "outer", "2/2")]


@pytest.mark.parametrize("every", [1, 2])
def test_one_bar_per_device_in_shard_map(streams, no_tqdm, mesh, every):
  file, events = streams

  def body(x):
    with je.progress(3, desc="dev", every=every, file=file,
                     mininterval=0) as bar:
      def step(c, _):
        je.print("s {}", c[0])
        bar.update()
        return c + 1, None
      return jax.lax.scan(step, x, None, length=3)[0]

  f = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  with je.deterministic():   # devices in a fixed order: by position, device
    out = run(f, jnp.zeros(8, jnp.int32))
  np.testing.assert_array_equal(out, np.full(8, 3))
  per_device = [model(f"[device {d} shard {d} process 0] dev", 3, every, 3,
                      lambda i: [f"[device {d} shard {d} process 0] s {i}"])
                for d in range(8)]
  expected = [e for step in zip(*per_device) for e in step]
  assert drawn(events) == expected
  # Without the deterministic view each device's own sequence is the same.
  events.clear()
  run(f, jnp.zeros(8, jnp.int32))
  got = drawn(events)
  for d in range(8):
    prefix = f"[device {d} shard {d} process 0] "
    assert [e for e in got if e[1].startswith(prefix)] == per_device[d]


def test_update_inside_a_shard_map_the_bar_was_not_opened_in_is_refused(
    mesh):
  @je.jit
  def f(x):
    with je.progress(3) as bar:
      def body(x):
        bar.update()
        return x
      return jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                           out_specs=P("i"))(x)

  with pytest.raises(NotImplementedError,
                     match=r"inside a shard_map .* the bar was not opened in"):
    f(jnp.zeros(8))


def test_vmap_one_bar_for_the_batch(streams, no_tqdm):
  file, events = streams

  def one(x):
    with je.progress(4, desc="batch", every=3, file=file,
                     mininterval=0) as bar:
      def step(c, _):
        bar.update()
        return c + x, None
      return jax.lax.scan(step, 0, None, length=4)[0]

  out = run(je.jit(jax.vmap(one)), jnp.arange(3))
  np.testing.assert_array_equal(out, [0, 4, 8])
  assert drawn(events) == model("batch", 4, 3, 4)


@pytest.mark.parametrize("every", [1, 2])
def test_vmap_of_a_while_loop_with_a_batched_predicate_counts_its_iterations(
    streams, no_tqdm, every):
  """The batched loop runs while any element does: one bar, one count per
  iteration (the longest element's), not per element."""
  file, events = streams

  def one(n):
    with je.progress(None, desc="w", every=every, file=file,
                     mininterval=0) as bar:
      def body(c):
        bar.update()
        return c + 1
      return jax.lax.while_loop(lambda c: c < n, body, 0)

  out = run(je.jit(jax.vmap(one)), jnp.array([2, 5, 3]))
  np.testing.assert_array_equal(out, [2, 5, 3])
  assert drawn(events) == [("bar", "w", e[2].split("/")[0])
                           for e in model("w", 0, every, 5)]


def test_vmap_a_bar_per_element_when_asked(streams, no_tqdm):
  """``per_element`` names the vmap axis: each element's bar counts the
  element's own iterations (host calls in batch order, per effect site)."""
  file, events = streams
  lengths = [2, 5, 3]

  def one(n):
    with je.progress(None, desc="w", file=file, mininterval=0,
                     per_element="batch") as bar:
      def body(c):
        bar.update()
        return c + 1
      return jax.lax.while_loop(lambda c: c < n, body, 0)

  out = run(je.jit(jax.vmap(one, axis_name="batch")), jnp.array(lengths))
  np.testing.assert_array_equal(out, lengths)
  expected = [("bar", f"[element {i}] w", str(k))
              for k in range(max(lengths) + 1)
              for i, n in enumerate(lengths) if k <= n]
  assert drawn(events) == expected
  with pytest.raises(ValueError, match="must name the axis of an enclosing "
                                       "jax.vmap"):
    je.jit(one)(3)


def _drawn_counts(events):
  return [e[2] for e in drawn(events)]


@pytest.mark.parametrize("every, counts", [
    (1, ["0/10", "3/10", "6/10", "9/10", "10/10"]),
    (2, ["0/10", "3/10", "6/10", "9/10", "10/10"]),
    (4, ["0/10", "6/10", "10/10"])])
def test_lax_map_with_batch_size_counts_elements(streams, no_tqdm, every,
                                                 counts):
  """Issue 29: ``lax.map(f, xs, batch_size=3)`` runs ``f`` vmapped over
  batches of 3 (and the remainder of 1): an update in ``f``, inside a vmap
  its bar was not opened in, counts once per element: 10/10, not 4/10."""
  file, events = streams

  def f(xs):
    with je.progress(10, desc="map", every=every, file=file,
                     mininterval=0) as bar:
      def step(x):
        bar.update()
        return x * 2
      return jax.lax.map(step, xs, batch_size=3)

  out = run(je.jit(f), jnp.arange(10.0))
  np.testing.assert_array_equal(out, np.arange(10.0) * 2)
  assert _drawn_counts(events) == counts
  events.clear()
  with jax.disable_jit():
    run(f, jnp.arange(10.0))
  assert _drawn_counts(events) == counts


@pytest.mark.parametrize("every", [1, 3])
def test_a_vmap_the_bar_is_not_in_counts_its_elements(streams, no_tqdm,
                                                      every):
  """Around a loop (the update in a scan body, the vmap outside it) and
  nested (the product of the sizes); a bar opened inside the vmap still
  counts the batch's steps (``test_vmap_one_bar_for_the_batch``)."""
  file, events = streams

  def f(xs):
    with je.progress(24, desc="v", every=every, file=file,
                     mininterval=0) as bar:
      def one(x):
        def step(c, _):
          bar.update(2)
          return c + x, None
        return jax.lax.scan(step, 0.0, None, length=4)[0]
      return jax.vmap(jax.vmap(one))(xs)

  out = run(je.jit(f), jnp.ones((3, 1)))
  np.testing.assert_array_equal(out, np.full((3, 1), 4.0))
  assert _drawn_counts(events) == [f"{6 * i}/24" for i in range(5)]


@pytest.mark.parametrize("every", [1, 2])
def test_counting_elements_in_a_batched_while_loop_is_refused(every):
  """Elements of a vmapped while_loop whose predicate is batched stop at
  different steps: the batch's steps are not the elements' updates."""
  @je.jit
  def f(ns):
    with je.progress(None, every=every) as bar:
      def one(n):
        def body(c):
          bar.update()
          return c + 1
        return jax.lax.while_loop(lambda c: c < n, body, 0)
      return jax.vmap(one)(ns)

  with pytest.raises(NotImplementedError,
                     match=r"counts the elements of a jax\.vmap its bar was "
                           r"not opened in .*while_loop whose predicate"):
    f(jnp.array([1, 2, 3]))


@pytest.mark.parametrize("every", [1, 2])
def test_vmap_batched_count_is_refused(every):
  def one(x):
    with je.progress(3, every=every) as bar:
      bar.update(x)
    return x

  with pytest.raises(NotImplementedError, match="batched by jax.vmap|jax.vmap "
                                                "batched one of its operands"):
    je.jit(jax.vmap(one))(jnp.arange(3))


@pytest.mark.parametrize("every", [1, 2])
def test_grad_updates_in_the_forward_pass_only(streams, no_tqdm, every):
  file, events = streams

  def loss(w):
    with je.progress(4, desc="fwd", every=every, file=file,
                     mininterval=0) as bar:
      def step(c, _):
        bar.update()
        return c * w, None
      return jax.lax.scan(step, 1.0, None, length=4)[0]

  expected = model("fwd", 4, every, 4)
  assert run(je.jit(jax.grad(loss)), 2.0) == 32.0
  assert drawn(events) == expected
  events.clear()
  # grad of a jax_effects.jit function: its scan runs under JAX's own
  # dispatch (the count is then kept on the host).
  assert run(jax.grad(je.jit(loss)), 2.0) == 32.0
  assert drawn(events) == expected


def test_alongside_a_jax_debug_callback_bar(streams, no_tqdm):
  """A jax-tqdm style bar (``jax.debug.callback`` in a ``lax.cond``) in the
  same function is adopted: both keep program order."""
  file, events = streams

  def theirs(i, n):
    def draw(i):
      file.events.append(("print", f"theirs {int(i)}/{n}"))
    jax.lax.cond(i % 2 == 0, lambda: jax.debug.callback(draw, i, ordered=True),
                 lambda: None)

  @je.jit
  def f(x):
    with je.progress(4, desc="ours", every=2, file=file,
                     mininterval=0) as bar:
      def step(c, i):
        theirs(i, 4)
        bar.update()
        return c + 1, None
      return jax.lax.scan(step, x, jnp.arange(4))[0]

  assert run(f, 0) == 4
  assert drawn(events) == model(
      "ours", 4, 2, 4,
      lambda i: [f"theirs {i}/4"] if i % 2 == 0 else [])


def test_a_total_computed_in_the_program(streams, no_tqdm):
  file, events = streams

  @je.jit
  def f(n):
    with je.progress(n, desc="t", every=3, file=file, mininterval=0) as bar:
      def body(c):
        bar.update()
        return c + 1
      return jax.lax.while_loop(lambda c: c < n, body, 0)

  assert run(f, 7) == 7
  assert drawn(events) == model("t", 7, 3, 7)


def test_eager(streams, no_tqdm):
  file, events = streams
  with je.progress(3, desc="e", every=2, file=file, mininterval=0) as bar:
    for _ in range(3):
      bar.update()
  je.effects_barrier()
  assert drawn(events) == model("e", 3, 2, 3)


def test_no_tqdm_fallback_draws_like_tqdm_on_stderr(no_tqdm, capsys):
  @je.jit
  def f(x):
    with je.progress(4, desc="plain", mininterval=0) as bar:
      def step(c, _):
        bar.update()
        return c + 1, None
      return jax.lax.scan(step, x, None, length=4)[0]

  run(f, 0)
  err = capsys.readouterr().err
  lines = err.splitlines()
  assert [drawn([("bar", line)])[0][2] for line in lines] == [
      "0/4", "1/4", "2/4", "3/4", "4/4"]
  assert lines[0].startswith("plain:   0%|          | 0/4 [00:00<?, ?it/s]")
  assert lines[-1].startswith("plain: 100%|##########| 4/4 [00:00<00:00, ")
  assert "\r" not in err   # not a terminal: a line per drawing


def test_tqdm_draws_when_installed(streams):
  pytest.importorskip("tqdm")
  file, events = streams

  @je.jit
  def f(x):
    je.print("before")
    with je.progress(3, desc="tq", file=file, mininterval=0,
                     miniters=1) as bar:
      def step(c, _):
        je.print("step {}", c)
        bar.update()
        return c + 1, None
      x = jax.lax.scan(step, x, None, length=3)[0]
    je.print("after")
    return x

  run(f, 0)
  got = []
  for tag, text in events:
    if tag == "bar":
      m = re.match(r"^tq: +\d+%\|.*\| (\d+/\d+) \[", text)
      assert m, text   # tqdm's own format (its bar is made of blocks)
      if got[-1:] != [m[1]]:
        got.append(m[1])
    else:
      got.append(text)
  assert got == ["before", "0/3", "step 0", "1/3", "step 1", "2/3", "step 2",
                 "3/3", "after"]
  assert "\r" in "".join(file.raw)   # tqdm redraws the line in place


def test_misuse_is_refused_naming_the_bar():
  bar = je.progress(3, desc="x")
  with pytest.raises(RuntimeError, match=r"progress\(desc='x'\)\.update\(\) "
                                         r"was called before entering"):
    bar.update()
  with pytest.raises(TypeError, match="every must be an int >= 1"):
    je.progress(3, every=0)
  with pytest.raises(TypeError, match="total must be a non-negative int"):
    je.progress(2.5)
  with pytest.raises(TypeError, match="file must have a write method"):
    je.progress(3, file="out.txt")


def test_plain_renderer_redraws_in_place_on_a_terminal(no_tqdm):
  """On a terminal each drawing rewrites the bar's line (``\\r``); another
  bar's drawing in between starts a new line; closing ends the line."""
  class Terminal:
    def __init__(self):
      self.writes = []

    def write(self, text):
      self.writes.append(text)

    def flush(self):
      pass

    def isatty(self):
      return True

  term = Terminal()

  @je.jit
  def f(x):
    with je.progress(2, desc="a", file=term, mininterval=0) as a:
      a.update()
      with je.progress(1, desc="b", file=term, mininterval=0) as b:
        b.update()
      a.update()
    return x

  run(f, 0)
  assert [(w[:1], drawn([("bar", w.strip("\r\n"))])[0][1:] if w.strip()
           else "") + (w.endswith("\n"),) for w in term.writes] == [
      ("\r", ("a", "0/2"), False), ("\r", ("a", "1/2"), False),
      ("\n", ("b", "0/1"), False), ("\r", ("b", "1/1"), False),
      ("\n", "", True),                # b's line ends where it is
      ("\r", ("a", "2/2"), False),     # a's continues below it
      ("\n", "", True)]

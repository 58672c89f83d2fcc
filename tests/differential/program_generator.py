"""Random programs with ordered side effects, for differential testing.

A program is a tree of nodes over one ``int32`` scalar state: every node maps
the state to a new state (``node.build(ctx)`` gives the JAX function,
``node.python(x, events)`` the same computation in plain Python). Side-effect
nodes record events ``(effect_name, tag, value)``; the differential tests run
a program three ways and compare the events of each effect stream:

* ``run_python``: the plain-Python interpretation (the specification),
* ``run_eager``: the JAX function under ``jax.disable_jit()``,
* ``run_jitted``: the JAX function under ``jax_effects.jit``.

Extending: node kinds live in :data:`KINDS` (name -> :class:`Kind`); a new
kind is a :class:`Node` subclass with ``generate``/``build``/``python``/
``describe``, registered with :func:`register_kind`. A :class:`Generator`
draws from any subset of kinds (``Generator(kinds=[...])``) and any list of
effects, so other test modules can add transformations (vmap, grad), modes or
unordered effects without touching these.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_effects as je

MOD = 1009  # states stay small: int32 arithmetic never overflows


@dataclasses.dataclass
class Context:
  """What ``Node.build`` needs: where to record events, and whether the
  function is built for ``jax.disable_jit()`` (see :class:`Call`)."""
  events: list
  eager: bool = False

  def record(self, effect_name: str, tag: str):
    """Host function appending ``(effect_name, tag, value)``."""
    def host(v):
      self.events.append((effect_name, tag, int(v)))
    return host


class Node:
  """A program node: state -> state."""
  kind: str = "?"

  @classmethod
  def generate(cls, gen: "Generator", depth: int) -> "Node":
    raise NotImplementedError

  def build(self, ctx: Context) -> Callable:
    """The JAX function ``x -> x`` (an ``int32`` scalar)."""
    raise NotImplementedError

  def python(self, x: int, events: list) -> int:
    """The same computation in plain Python, appending the same events."""
    raise NotImplementedError

  def describe(self, indent: int = 0) -> str:
    raise NotImplementedError


@dataclasses.dataclass
class Kind:
  cls: type
  weight: float
  compound: bool  # contains blocks (only drawn below the depth limit)


KINDS: dict[str, Kind] = {}


def register_kind(name: str, cls: type, weight: float = 1.0,
                  compound: bool = False) -> None:
  cls.kind = name
  KINDS[name] = Kind(cls, weight, compound)


class Generator:
  """Draws random programs from ``kinds`` using ``effects`` (Effect names)."""

  def __init__(self, seed: int, *, kinds: Sequence[str] | None = None,
               effects: Sequence[str] = ("default", "gen-a", "gen-b"),
               max_depth: int = 3, max_block: int = 4):
    self.rng = random.Random(seed)
    self.kinds = list(kinds) if kinds is not None else list(KINDS)
    self.effects = list(effects)
    self.max_depth = max_depth
    self.max_block = max_block
    self._tags = 0

  def tag(self, prefix: str) -> str:
    self._tags += 1
    return f"{prefix}{self._tags}"

  def effect(self) -> str:
    return self.rng.choice(self.effects)

  def node(self, depth: int) -> Node:
    names = [k for k in self.kinds
             if depth < self.max_depth or not KINDS[k].compound]
    weights = [KINDS[k].weight for k in names]
    name = self.rng.choices(names, weights)[0]
    return KINDS[name].cls.generate(self, depth)

  def block(self, depth: int, min_len: int = 1) -> "Block":
    n = self.rng.randint(min_len, self.max_block)
    return Block([self.node(depth) for _ in range(n)])

  def program(self) -> "Block":
    return self.block(0, min_len=2)


def _effect_object(name: str) -> je.Effect:
  return je.DEFAULT if name == "default" else je.Effect(name)


# --- blocks and leaves -------------------------------------------------------

@dataclasses.dataclass
class Block:
  nodes: list

  def build(self, ctx):
    fns = [n.build(ctx) for n in self.nodes]

    def run(x):
      for fn in fns:
        x = fn(x)
      return x
    return run

  def python(self, x, events):
    for n in self.nodes:
      x = n.python(x, events)
    return x

  def describe(self, indent=0):
    return "\n".join(n.describe(indent) for n in self.nodes)


@dataclasses.dataclass
class Arith(Node):
  """x -> (x * a + b) % MOD."""
  a: int
  b: int

  @classmethod
  def generate(cls, gen, depth):
    return cls(gen.rng.randint(1, 5), gen.rng.randint(0, 20))

  def build(self, ctx):
    return lambda x: (x * self.a + self.b) % MOD

  def python(self, x, events):
    return (x * self.a + self.b) % MOD

  def describe(self, indent=0):
    return " " * indent + f"x = (x * {self.a} + {self.b}) % {MOD}"


@dataclasses.dataclass
class Print(Node):
  """jax_effects.print of the state on an effect (events via line listener)."""
  effect: str
  tag: str

  @classmethod
  def generate(cls, gen, depth):
    return cls(gen.effect(), gen.tag("p"))

  def build(self, ctx):
    effect = _effect_object(self.effect)

    def run(x):
      je.print("{}|{}|{}", self.effect, self.tag, x, effect=effect)
      return x
    return run

  def python(self, x, events):
    events.append((self.effect, self.tag, x))
    return x

  def describe(self, indent=0):
    return " " * indent + f"print[{self.effect}] {self.tag} x"


def parse_printed(line: str):
  """The event of a line printed by a :class:`Print` node, or None."""
  parts = line.split("|")
  if len(parts) != 3:
    return None
  return parts[0], parts[1], int(parts[2])


@dataclasses.dataclass
class Callback(Node):
  """jax_effects.callback recording the state; with a result it feeds back:
  the host returns ``(v * 7 + k) % MOD`` and the state becomes it."""
  effect: str
  tag: str
  k: int | None  # None: no result

  @classmethod
  def generate(cls, gen, depth):
    k = gen.rng.choice([None, gen.rng.randint(0, 50)])
    return cls(gen.effect(), gen.tag("c"), k)

  def build(self, ctx):
    effect = _effect_object(self.effect)
    record = ctx.record(self.effect, self.tag)

    if self.k is None:
      def run(x):
        je.callback(record, None, x, effect=effect)
        return x
      return run

    def host(v):
      record(v)
      return np.int32((int(v) * 7 + self.k) % MOD)

    def run_with_result(x):
      return je.callback(host, jax.ShapeDtypeStruct((), jnp.int32), x,
                         effect=effect)
    return run_with_result

  def python(self, x, events):
    events.append((self.effect, self.tag, x))
    return x if self.k is None else (x * 7 + self.k) % MOD

  def describe(self, indent=0):
    res = "" if self.k is None else f" -> (x * 7 + {self.k}) % {MOD}"
    return " " * indent + f"callback[{self.effect}] {self.tag} x{res}"


# --- control flow ---------------------------------------------------------------

@dataclasses.dataclass
class Cond(Node):
  """lax.cond(x % 2 == 0, then, else)."""
  then: Block
  other: Block

  @classmethod
  def generate(cls, gen, depth):
    return cls(gen.block(depth + 1), gen.block(depth + 1))

  def build(self, ctx):
    t, e = self.then.build(ctx), self.other.build(ctx)
    return lambda x: lax.cond(x % 2 == 0, t, e, x)

  def python(self, x, events):
    return (self.then if x % 2 == 0 else self.other).python(x, events)

  def describe(self, indent=0):
    pad = " " * indent
    return (f"{pad}if x % 2 == 0:\n{self.then.describe(indent + 2)}\n"
            f"{pad}else:\n{self.other.describe(indent + 2)}")


@dataclasses.dataclass
class Switch(Node):
  """lax.switch(x % n, branches)."""
  branches: list

  @classmethod
  def generate(cls, gen, depth):
    n = gen.rng.randint(2, 3)
    return cls([gen.block(depth + 1) for _ in range(n)])

  def build(self, ctx):
    fns = [b.build(ctx) for b in self.branches]
    return lambda x: lax.switch(x % len(fns), fns, x)

  def python(self, x, events):
    return self.branches[x % len(self.branches)].python(x, events)

  def describe(self, indent=0):
    pad = " " * indent
    out = [f"{pad}switch x % {len(self.branches)}:"]
    for i, b in enumerate(self.branches):
      out += [f"{pad}  case {i}:", b.describe(indent + 4)]
    return "\n".join(out)


@dataclasses.dataclass
class While(Node):
  """while_loop over (i, x): runs ``x % trips + 1`` times (at least once),
  optional effect in cond_fun (recording i), body block on x."""
  trips: int
  cond_effect: str | None
  cond_tag: str
  body: Block

  @classmethod
  def generate(cls, gen, depth):
    cond_effect = gen.rng.choice([None, gen.effect()])
    return cls(gen.rng.randint(1, 3), cond_effect, gen.tag("w"),
               gen.block(depth + 1))

  def build(self, ctx):
    body = self.body.build(ctx)
    record = (ctx.record(self.cond_effect, self.cond_tag)
              if self.cond_effect else None)
    effect = _effect_object(self.cond_effect) if self.cond_effect else None

    def run(x):
      n = x % self.trips + 1

      def cond(c):
        if record is not None:
          je.callback(record, None, c[0], effect=effect)
        return c[0] < n

      def step(c):
        return c[0] + 1, body(c[1])

      return lax.while_loop(cond, step, (jnp.int32(0), x))[1]
    return run

  def python(self, x, events):
    n = x % self.trips + 1
    i = 0
    while True:
      if self.cond_effect:
        events.append((self.cond_effect, self.cond_tag, i))
      if not i < n:
        return x
      i, x = i + 1, self.body.python(x, events)

  def describe(self, indent=0):
    pad = " " * indent
    ce = f" cond-callback[{self.cond_effect}] {self.cond_tag} i" \
        if self.cond_effect else ""
    return (f"{pad}while i < x % {self.trips} + 1:{ce}\n"
            f"{self.body.describe(indent + 2)}")


@dataclasses.dataclass
class Scan(Node):
  """lax.scan over xs = arange(length): carry x, body block on x + xs[i]."""
  length: int
  reverse: bool
  body: Block

  @classmethod
  def generate(cls, gen, depth):
    return cls(gen.rng.randint(1, 3), gen.rng.random() < 0.3,
               gen.block(depth + 1))

  def build(self, ctx):
    body = self.body.build(ctx)

    def run(x):
      def step(c, i):
        y = body((c + i) % MOD)
        return y, y
      return lax.scan(step, x, jnp.arange(self.length, dtype=jnp.int32),
                      reverse=self.reverse)[0]
    return run

  def python(self, x, events):
    order = range(self.length)
    for i in (reversed(order) if self.reverse else order):
      x = self.body.python((x + i) % MOD, events)
    return x

  def describe(self, indent=0):
    pad = " " * indent
    r = " reversed" if self.reverse else ""
    return (f"{pad}scan i in range({self.length}){r}: x = body(x + i)\n"
            f"{self.body.describe(indent + 2)}")


@dataclasses.dataclass
class Fori(Node):
  """fori_loop(0, n, body): static n (a scan) or dynamic n = x % 3 (a while)."""
  n: int | None  # None: dynamic trip count x % 3
  body: Block

  @classmethod
  def generate(cls, gen, depth):
    return cls(gen.rng.choice([None, 1, 2, 3]), gen.block(depth + 1))

  def build(self, ctx):
    body = self.body.build(ctx)

    def run(x):
      upper = x % 3 if self.n is None else self.n
      return lax.fori_loop(0, upper, lambda i, c: body((c + i) % MOD), x)
    return run

  def python(self, x, events):
    upper = x % 3 if self.n is None else self.n
    for i in range(upper):
      x = self.body.python((x + i) % MOD, events)
    return x

  def describe(self, indent=0):
    pad = " " * indent
    n = "x % 3" if self.n is None else self.n
    return (f"{pad}fori i in range({n}): x = body(x + i)\n"
            f"{self.body.describe(indent + 2)}")


@dataclasses.dataclass
class Call(Node):
  """A call-like wrapper around a block: nested jax.jit, nested
  jax_effects.jit, jax.checkpoint, or jax.named_call."""
  wrapper: str
  body: Block

  WRAPPERS = ("jit", "je_jit", "checkpoint", "named_call")

  @classmethod
  def generate(cls, gen, depth):
    return cls(gen.rng.choice(cls.WRAPPERS), gen.block(depth + 1))

  def build(self, ctx):
    body = self.body.build(ctx)
    if self.wrapper == "jit":
      return jax.jit(body)
    if self.wrapper == "je_jit":
      return je.jit(body)
    if self.wrapper == "checkpoint":
      # Under disable_jit, jax.checkpoint still traces its body, and a
      # while_loop traced there first tries to run in Python: cond_fun's
      # effects are staged twice for its first evaluation (jax.debug.print
      # does the same). The eager oracle runs the body unwrapped instead.
      return body if ctx.eager else jax.checkpoint(body)
    return jax.named_call(body, name="gen_call")

  def python(self, x, events):
    return self.body.python(x, events)

  def describe(self, indent=0):
    return (" " * indent + f"{self.wrapper}:\n"
            + self.body.describe(indent + 2))


register_kind("arith", Arith, weight=1.0)
register_kind("print", Print, weight=1.5)
register_kind("callback", Callback, weight=1.5)
register_kind("cond", Cond, weight=0.8, compound=True)
register_kind("switch", Switch, weight=0.5, compound=True)
register_kind("while", While, weight=0.8, compound=True)
register_kind("scan", Scan, weight=0.6, compound=True)
register_kind("fori", Fori, weight=0.6, compound=True)
register_kind("call", Call, weight=0.6, compound=True)


# --- running ------------------------------------------------------------------------

def per_effect(events) -> dict:
  """Events grouped by effect stream, each in its order."""
  out: dict = {}
  for e in events:
    out.setdefault(e[0], []).append(e)
  return out


def run_python(program: Block, x: int):
  events: list = []
  return program.python(x, events), events


def _with_printed(ctx: Context, fn):
  from jax_effects._runtime import output as _output

  def on_line(line):
    event = parse_printed(line)
    if event is not None:
      ctx.events.append(event)
  _output.add_line_listener(on_line)
  try:
    return fn()
  finally:
    _output.remove_line_listener(on_line)


def run_eager(program: Block, x: int):
  ctx = Context([], eager=True)
  fn = program.build(ctx)

  def go():
    with jax.disable_jit():
      return int(fn(jnp.int32(x)))
  return _with_printed(ctx, go), ctx.events


def run_jitted(program: Block, x: int, *, calls: int = 1):
  """Runs ``jax_effects.jit`` of the program ``calls`` times (inputs x, x+1,
  ...) before one barrier; returns the outputs and all events."""
  ctx = Context([])
  fn = je.jit(program.build(ctx))

  def go():
    outs = [fn(jnp.int32(x + i)) for i in range(calls)]
    je.effects_barrier()
    return [int(o) for o in outs]
  outs = _with_printed(ctx, go)
  return (outs[0] if calls == 1 else outs), ctx.events

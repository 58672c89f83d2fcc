"""Random programs with ordered side effects, for differential testing.

A program is a tree of nodes over one ``int32`` scalar state: every node maps
the state to a new state (``node.build(ctx)`` gives the JAX function,
``node.python(x, events)`` the same computation in plain Python). Side-effect
nodes record events ``(effect_name, tag, value)``; the differential tests run
a program three ways and compare the events of each effect stream:

* ``run_python``: the plain-Python interpretation (the specification),
* ``run_eager``: the JAX function under ``jax.disable_jit()``,
* ``run_jitted``: the JAX function under ``jax_effects.jit``
  (``run_jitted_together``: several programs' functions, one after another,
  in one ``jax_effects.jit`` function compiled once).

Extending: node kinds live in :data:`KINDS` (name -> :class:`Kind`); a new
kind is a :class:`Node` subclass with ``generate``/``build``/``python``/
``describe``, registered with :func:`register_kind`. A :class:`Generator`
draws from any subset of kinds (``Generator(kinds=[...])``) and any list of
effects, so other test modules can add transformations (vmap, grad), modes or
unordered effects without touching these.

The kinds ``log``, ``vmap``, ``grad`` and ``shard_map`` (and the
generator's ``p_unordered``, ``rich`` and ``devices``) are for the
differential test across entries (``test_entries``), which compares what
programs write to stdout (:class:`StdoutContext`, :func:`log_to_stdout`)
between ``jax_effects.jit``, plain ``jax.jit`` and eager execution; a
Generator draws them only when named in ``kinds``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import sys
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_effects as je

MOD = 1009  # states stay small: int32 arithmetic never overflows

#: The end of the tag of an ``ordered=False`` effect (nothing orders it).
UNORDERED_MARK = "~"


@dataclasses.dataclass
class Context:
  """What ``Node.build`` needs: where to record events, whether the
  function is built for ``jax.disable_jit()`` (see :class:`Call`), and the
  label its :class:`Print` nodes write before the effect's name (which of
  the programs :func:`run_jitted_together` runs printed the line)."""
  events: list
  eager: bool = False
  label: str = ""

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
  default: bool = True   # drawn by a Generator given no ``kinds``
  not_inside: frozenset = frozenset()  # never drawn inside these kinds


KINDS: dict[str, Kind] = {}


def register_kind(name: str, cls: type, weight: float = 1.0,
                  compound: bool = False, default: bool = True,
                  not_inside: Sequence[str] = ()) -> None:
  """Registers a node kind. ``default=False``: drawn only by a Generator
  that names it in ``kinds`` (the kinds of :mod:`test_entries`, which
  the plain-Python oracle of the other tests does not model).
  ``not_inside``: kinds (of :meth:`Generator.within`) inside which it is
  never drawn."""
  cls.kind = name
  KINDS[name] = Kind(cls, weight, compound, default, frozenset(not_inside))


class Generator:
  """Draws random programs from ``kinds`` using ``effects`` (Effect names).

  The options below change nothing (not even the random draws) at their
  defaults, so the programs of a seed stay those the other tests know:

  * ``p_unordered``: the probability that a print, log or callback is
    ``ordered=False`` (its tag ends with ``UNORDERED_MARK``);
  * ``rich``: a ``while``'s ``cond_fun`` may hold prints and logs too,
    and its trip count may be a constant (``While.static``);
  * ``devices``: the number of devices of every ``shard_map`` node (one
    per program: a computation has one device assignment).
  """

  def __init__(self, seed: int, *, kinds: Sequence[str] | None = None,
               effects: Sequence[str] = ("default", "gen-a", "gen-b"),
               max_depth: int = 3, max_block: int = 4,
               p_unordered: float = 0.0, rich: bool = False,
               devices: int = 1):
    self.rng = random.Random(seed)
    self.kinds = (list(kinds) if kinds is not None
                  else [k for k in KINDS if KINDS[k].default])
    self.effects = list(effects)
    self.max_depth = max_depth
    self.max_block = max_block
    self.p_unordered = p_unordered
    self.rich = rich
    self.devices = devices
    self.inside: list = []   # the kinds of the enclosing ``within`` nodes
    self._tags = 0

  @contextlib.contextmanager
  def within(self, kind: str):
    """Draws the nodes of the block inside as inside ``kind``."""
    self.inside.append(kind)
    try:
      yield
    finally:
      self.inside.pop()

  def ordered(self) -> bool:
    """Whether the next effect is ordered (no draw at ``p_unordered=0``)."""
    return not (self.p_unordered and self.rng.random() < self.p_unordered)

  def effect_tag(self, prefix: str, ordered: bool) -> str:
    return self.tag(prefix) + ("" if ordered else UNORDERED_MARK)

  def tag(self, prefix: str) -> str:
    self._tags += 1
    return f"{prefix}{self._tags}"

  def effect(self) -> str:
    return self.rng.choice(self.effects)

  def node(self, depth: int) -> Node:
    names = [k for k in self.kinds
             if (depth < self.max_depth or not KINDS[k].compound)
             and not KINDS[k].not_inside.intersection(self.inside)]
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
  ordered: bool = True

  @classmethod
  def generate(cls, gen, depth):
    ordered = gen.ordered()
    return cls(gen.effect(), gen.effect_tag("p", ordered), ordered)

  def build(self, ctx):
    effect = _effect_object(self.effect)

    def run(x):
      je.print("{}|{}|{}", ctx.label + self.effect, self.tag, x,
               effect=effect, ordered=self.ordered)
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
  ordered: bool = True

  @classmethod
  def generate(cls, gen, depth):
    k = gen.rng.choice([None, gen.rng.randint(0, 50)])
    ordered = gen.ordered()
    return cls(gen.effect(), gen.effect_tag("c", ordered), k, ordered)

  def build(self, ctx):
    effect = _effect_object(self.effect)
    record = ctx.record(self.effect, self.tag)

    if self.k is None:
      def run(x):
        je.callback(record, None, x, effect=effect, ordered=self.ordered)
        return x
      return run

    def host(v):
      record(v)
      return np.int32((int(v) * 7 + self.k) % MOD)

    def run_with_result(x):
      return je.callback(host, jax.ShapeDtypeStruct((), jnp.int32), x,
                         effect=effect, ordered=self.ordered)
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
  optional effect in cond_fun (recording i), body block on x. With the
  generator's ``rich``, ``cond_nodes``: more effects in cond_fun (prints,
  logs, callbacks without result) of i, after that one; and ``static``:
  the loop runs ``trips`` times, a count XLA knows (it then may skip the
  condition computation)."""
  trips: int
  cond_effect: str | None
  cond_tag: str
  body: Block
  cond_nodes: list = dataclasses.field(default_factory=list)
  static: bool = False

  @classmethod
  def generate(cls, gen, depth):
    cond_effect = gen.rng.choice([None, gen.effect()])
    node = cls(gen.rng.randint(1, 3), cond_effect, gen.tag("w"),
               gen.block(depth + 1))
    if gen.rich:
      node.static = gen.rng.random() < 0.3
      leaves = [KINDS[k].cls for k in ("print", "log", "callback")
                if k in KINDS and k in gen.kinds]
      for _ in range(gen.rng.randint(0, 2)):
        leaf = gen.rng.choice(leaves).generate(gen, depth + 1)
        if isinstance(leaf, Callback):
          leaf.k = None   # (a result in cond_fun would go nowhere)
        node.cond_nodes.append(leaf)
    return node

  def build(self, ctx):
    body = self.body.build(ctx)
    record = (ctx.record(self.cond_effect, self.cond_tag)
              if self.cond_effect else None)
    effect = _effect_object(self.cond_effect) if self.cond_effect else None
    cond_fns = [n.build(ctx) for n in self.cond_nodes]

    # (cond and step are made once, here: JAX then traces and, eagerly,
    # compiles the loop once, not at every call)
    def cond(c):
      if record is not None:
        je.callback(record, None, c[0], effect=effect)
      for fn in cond_fns:
        fn(c[0])
      return c[0] < c[2]

    def step(c):
      return c[0] + 1, body(c[1]), c[2]

    def static_cond(c):   # (the bound a constant of the loop)
      return cond((*c, self.trips))

    def static_step(c):
      return step((*c, 0))[:2]

    def run(x):
      if self.static:
        return lax.while_loop(static_cond, static_step, (jnp.int32(0), x))[1]
      n = x % self.trips + 1
      return lax.while_loop(cond, step, (jnp.int32(0), x, n))[1]
    return run

  def python(self, x, events):
    n = self.trips if self.static else x % self.trips + 1
    i = 0
    while True:
      if self.cond_effect:
        events.append((self.cond_effect, self.cond_tag, i))
      for node in self.cond_nodes:
        node.python(i, events)
      if not i < n:
        return x
      i, x = i + 1, self.body.python(x, events)

  def describe(self, indent=0):
    pad = " " * indent
    ce = f" cond-callback[{self.cond_effect}] {self.cond_tag} i" \
        if self.cond_effect else ""
    ce += "".join(f"; cond-{n.describe().strip()} (of i)"
                  for n in self.cond_nodes)
    bound = self.trips if self.static else f"x % {self.trips} + 1"
    return (f"{pad}while i < {bound}:{ce}\n"
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

    def step(c, i):
      y = body((c + i) % MOD)
      return y, y

    def run(x):
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

    def step(i, c):
      return body((c + i) % MOD)

    def run(x):
      upper = x % 3 if self.n is None else self.n
      return lax.fori_loop(0, upper, step, x)
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


# --- kinds for the differential test across entries (test_entries) --------
# Not drawn by default: the plain-Python oracle of the other tests does not
# model vmap's order (site-major) or the free order of devices. Their lines
# go to stdout (:class:`StdoutContext`, :func:`log_to_stdout`).

#: The logger of :class:`Log` nodes.
LOGGER = "program_generator"


def device_prefix(device_id, shard_index, process_index) -> str:
  """``"[device D shard S process P] "`` in per-device code (the prefix of
  ``jax_effects.print``'s per-device lines), else ``""``."""
  if shard_index is None:
    return ""
  return f"[device {device_id} shard {shard_index} process {process_index}] "


class StdoutContext(Context):
  """A :class:`Context` whose callbacks print their event as a
  :class:`Print` node prints it (``effect|tag|value``, with the device
  prefix in per-device code) to ``sys.stdout``."""

  def __init__(self):
    super().__init__([])

  def record(self, effect_name: str, tag: str):
    def host(v):
      where = je.placement()
      prefix = ("" if where is None else
                device_prefix(where.device_id, where.shard_index,
                              where.process_index))
      sys.stdout.write(f"{prefix}{effect_name}|{tag}|{int(v)}\n")
    return host


class _LineFormatter(logging.Formatter):
  def format(self, record):
    return (device_prefix(getattr(record, "device_id", None),
                          getattr(record, "shard_index", None),
                          getattr(record, "process_index", 0))
            + record.getMessage() + "|" + record.levelname)


def log_to_stdout() -> logging.Handler:
  """Routes :data:`LOGGER`'s records (level INFO and up) to ``sys.stdout``
  as ``[prefix]effect|tag|value|LEVEL``; returns the handler."""
  handler = logging.StreamHandler(sys.stdout)
  handler.setFormatter(_LineFormatter())
  logger = logging.getLogger(LOGGER)
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  logger.propagate = False
  return handler


@dataclasses.dataclass
class Log(Node):
  """jax_effects.log of the state on an effect (DEBUG records are below
  :data:`LOGGER`'s level: never emitted)."""
  effect: str
  tag: str
  level: int
  ordered: bool = True

  @classmethod
  def generate(cls, gen, depth):
    level = gen.rng.choice([logging.DEBUG, logging.INFO, logging.WARNING])
    ordered = gen.ordered()
    return cls(gen.effect(), gen.effect_tag("l", ordered), level, ordered)

  def build(self, ctx):
    effect = _effect_object(self.effect)

    def run(x):
      je.log("{}|{}|{}", self.effect, self.tag, x, level=self.level,
             logger=LOGGER, effect=effect, ordered=self.ordered)
      return x
    return run

  def python(self, x, events):
    if self.level >= logging.INFO:
      events.append((self.effect, self.tag, x))
    return x

  def describe(self, indent=0):
    level = logging.getLevelName(self.level)
    return " " * indent + f"log[{self.effect}, {level}] {self.tag} x"


@dataclasses.dataclass
class Vmap(Node):
  """``jax.vmap`` of a block over ``size`` copies of the state
  (``x + 5 j``), summed back: every effect inside runs once per element
  (site-major: a site for every element, then the next site); a
  ``while`` inside has a trip count that differs per element (``x % 2``
  and ``x % 3`` differ between neighbours), a ``cond`` a predicate per
  element. Nested vmaps have different sizes."""
  size: int
  body: Block

  @classmethod
  def generate(cls, gen, depth):
    size = 2 + gen.inside.count("vmap")
    with gen.within("vmap"):
      return cls(size, gen.block(depth + 1))

  def build(self, ctx):
    body = jax.vmap(self.body.build(ctx))

    def run(x):
      xs = (x + 5 * jnp.arange(self.size, dtype=jnp.int32)) % MOD
      return jnp.sum(body(xs)) % MOD
    return run

  def python(self, x, events):
    raise NotImplementedError(
        "vmap orders effects site-major: compared between entries only "
        "(test_entries)")

  def describe(self, indent=0):
    return (" " * indent + f"vmap over x + 5 * arange({self.size}) "
            f"(summed):\n" + self.body.describe(indent + 2))


@dataclasses.dataclass
class Grad(Node):
  """``jax.grad`` of ``y -> y * y`` (``y`` the state as a float) with the
  block run on ``int(y)`` inside (its state an auxiliary output): prints of
  the primal values ``2 y`` (tag ``..a``) before and ``y + block`` (``..b``)
  after the block; the state becomes ``block + grad``."""
  effect: str
  tag: str
  body: Block

  @classmethod
  def generate(cls, gen, depth):
    effect, tag = gen.effect(), gen.tag("g")
    with gen.within("grad"):
      return cls(effect, tag, gen.block(depth + 1))

  def build(self, ctx):
    body = self.body.build(ctx)
    effect = _effect_object(self.effect)

    def loss(y):
      je.print("{}|{}|{}", self.effect, self.tag + "a", y * 2.0,
               effect=effect)
      xi = body(y.astype(jnp.int32))
      je.print("{}|{}|{}", self.effect, self.tag + "b",
               y + xi.astype(jnp.float32), effect=effect)
      return y * y, xi

    def run(x):
      g, xi = jax.grad(loss, has_aux=True)(x.astype(jnp.float32))
      return (xi + g.astype(jnp.int32)) % MOD
    return run

  def python(self, x, events):
    events.append((self.effect, self.tag + "a", 2.0 * x))
    xi = self.body.python(x, events)
    events.append((self.effect, self.tag + "b", float(x + xi)))
    return (xi + 2 * x) % MOD

  def describe(self, indent=0):
    pad = " " * indent
    return (f"{pad}grad of y*y, y = float(x) [print[{self.effect}] "
            f"{self.tag}a 2y; x = body(int(y)); print {self.tag}b y + x]; "
            f"x = x + grad:\n{self.body.describe(indent + 2)}")


@dataclasses.dataclass
class ShardMap(Node):
  """``jax.shard_map`` over the generator's ``devices`` (a one-axis mesh of
  the first ones): device ``d`` runs the block (with an effect at its
  top level, a print if none was drawn) on ``x + d``; the state
  becomes the sum, then an optional print after (one line, which must come
  after every device's lines)."""
  devices: int
  body: Block
  after: Node | None

  @classmethod
  def generate(cls, gen, depth):
    with gen.within("shard_map"):
      body = gen.block(depth + 1)
      if not any(isinstance(n, (Print, Log, Callback)) for n in body.nodes):
        body.nodes.append(Print.generate(gen, depth + 1))
    after = (Print.generate(gen, depth) if gen.rng.random() < 0.7
             else None)
    return cls(gen.devices, body, after)

  def build(self, ctx):
    from jax.sharding import Mesh, PartitionSpec
    body = self.body.build(ctx)
    after = self.after.build(ctx) if self.after is not None else None
    mesh = Mesh(np.array(jax.devices()[:self.devices]), ("i",))
    spmd = jax.shard_map(lambda v: body(v[0])[None], mesh=mesh,
                         in_specs=PartitionSpec("i"),
                         out_specs=PartitionSpec("i"), check_vma=False)

    def run(x):
      xs = (x + jnp.arange(self.devices, dtype=jnp.int32)) % MOD
      y = jnp.sum(spmd(xs)) % MOD
      return y if after is None else after(y)
    return run

  def python(self, x, events):
    # device-major (the order across devices is free; per device it is
    # program order)
    y = sum(self.body.python((x + d) % MOD, events)
            for d in range(self.devices)) % MOD
    return y if self.after is None else self.after.python(y, events)

  def describe(self, indent=0):
    pad = " " * indent
    after = ("" if self.after is None
             else "\n" + self.after.describe(indent) + "  (after)")
    return (f"{pad}shard_map over {self.devices} devices, device d on "
            f"x + d (summed):\n{self.body.describe(indent + 2)}{after}")


register_kind("arith", Arith, weight=1.0)
register_kind("print", Print, weight=1.5)
register_kind("callback", Callback, weight=1.5)
register_kind("cond", Cond, weight=0.8, compound=True)
register_kind("switch", Switch, weight=0.5, compound=True)
register_kind("while", While, weight=0.8, compound=True)
register_kind("scan", Scan, weight=0.6, compound=True)
register_kind("fori", Fori, weight=0.6, compound=True)
register_kind("call", Call, weight=0.6, compound=True)
register_kind("log", Log, weight=1.0, default=False)
register_kind("vmap", Vmap, weight=0.5, compound=True, default=False)
register_kind("grad", Grad, weight=0.4, compound=True, default=False)
register_kind("shard_map", ShardMap, weight=0.7, compound=True,
              default=False, not_inside=("shard_map", "vmap", "grad"))


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


def _with_printed(on_event, fn):
  """``fn()``, each event its lines print given to ``on_event``."""
  from jax_effects._runtime import output as _output

  def on_line(line):
    event = parse_printed(line)
    if event is not None:
      on_event(event)
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
  return _with_printed(ctx.events.append, go), ctx.events


def run_jitted(program: Block, x: int, *, calls: int = 1):
  """Runs ``jax_effects.jit`` of the program ``calls`` times (inputs x, x+1,
  ...) before one barrier; returns the outputs and all events."""
  ctx = Context([])
  fn = je.jit(program.build(ctx))

  def go():
    outs = [fn(jnp.int32(x + i)) for i in range(calls)]
    je.effects_barrier()
    return [int(o) for o in outs]
  outs = _with_printed(ctx.events.append, go)
  return (outs[0] if calls == 1 else outs), ctx.events


def run_jitted_together(programs: Sequence[Block], xs: Sequence[int], *,
                        calls: int = 1) -> list:
  """:func:`run_jitted` of several programs (the default kinds) at once,
  one compilation for all: one ``jax_effects.jit`` function runs them one
  after another, each at its top level on its own input (``xs[i] + c`` in
  call ``c`` of ``calls``, before one barrier), as it would run alone, its
  effects after the previous program's on each stream. Returns, per
  program, what :func:`run_jitted` returns for it: its prints are told apart
  by their label (``Context.label``), its callbacks by their context."""
  ctxs = [Context([], label=f"{i}/") for i in range(len(programs))]
  fns = [p.build(c) for p, c in zip(programs, ctxs)]
  fn = je.jit(lambda *ys: tuple(f(y) for f, y in zip(fns, ys)))
  stray: list = []

  def on_event(event):
    label, _, effect = event[0].rpartition("/")
    if label.isdigit() and int(label) < len(ctxs):
      ctxs[int(label)].events.append((effect, *event[1:]))
    else:
      stray.append(event)

  def go():
    outs = [fn(*[jnp.int32(x + c) for x in xs]) for c in range(calls)]
    je.effects_barrier()
    return outs
  outs = _with_printed(on_event, go)
  assert not stray, f"events of no program: {stray}"
  return [([int(o[i]) for o in outs] if calls > 1 else int(outs[0][i]),
           ctx.events) for i, ctx in enumerate(ctxs)]

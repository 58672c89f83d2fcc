"""How many modules a call goes through, and how many modules write each state.

A developer's measurement (``design/architecture.md``, "Measuring the
layout"; issue 30), not a test: it prints numbers and asserts nothing. Run
it from the root of a checkout, against that checkout::

    PYTHONPATH=$PWD python tests/tools/measure_crossings.py [--json] [--devices N]

**Calls** (``sys.setprofile``, the main thread only: host callbacks that XLA
runs on its own threads are not seen). In a fresh process::

    f = jax_effects.jit(lambda x: (jax_effects.print("x = {}", x), x + 1)[1])

three steps are measured: the first call ``f(x)`` (traced, lowered,
compiled), a warm call ``f(x)``, and ``jax_effects.effects_barrier()``. Only
``call`` events whose frame's file is inside the ``jax_effects`` package
count (generator resumptions and comprehensions are frames too):

* *modules entered*: distinct ``jax_effects`` modules with at least one frame;
* *crossings*: the calls from a frame of one ``jax_effects`` module into
  another (*direct*), and the calls from outside (JAX) into a module while
  the nearest ``jax_effects`` frame below is another module's (*via JAX*:
  a rule JAX calls back while the pass binds an equation), each counted
  twice, there and back (the issue's count: ``2 x (direct + via JAX)``);
  the edges are listed (``A -> B``, ``A -> (JAX) -> B``);
* *entries*: every call into ``jax_effects`` from a frame outside it (the
  user's, JAX's), reported apart.

**Writers per state** (a static scan with ``ast``): for each piece of
runtime state in :data:`STATES`, the modules that store to it: an
assignment, augmented assignment or ``del`` of the name or field (also of a
subscript or attribute of it), or a mutating method call on it
(``.append``, ``.pop``, ``.clear``, ``.update``, ...). Module globals are
matched through the owner's import aliases; a class's fields are derived,
not listed: its own and those of its base classes in the package (followed
through imports), each matched by attribute name (on any object but the
``self`` of a class outside that hierarchy). Good enough to count writer
modules; it follows a local alias (``runtime = state.runtime``) and a field
handed to a function of the same module, directly or as the arguments of a
callable also handed on (``weakref.finalize(obj, fn, state.runtime)``: a
store to ``fn``'s parameter writes the field); not ``setattr``.
"""
from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import json
import os
import pathlib
import sys

#: state -> (owner module, module globals, (class, fields or None: the
#: ``__slots__``/``self.x`` stores of it and its base classes)). Names that no longer exist are skipped
#: (the report says which were found).
STATES = {
    "ThreadTokens fields": ("jax_effects._runtime.threads", (),
                            ("ThreadTokens", None)),
    "error registry": ("jax_effects._runtime.errors",
                       ("deferred", "_dropped", "_lock"), None),
    "held output": ("jax_effects._runtime.output",
                    ("_held", "_hold_depth", "_releasing"), None),
    "host jobs (lanes)": ("jax_effects._runtime.host_jobs",
                          ("queues", "_draining", "_sites", "lock"),
                          ("Lane", None)),
    "pieces (sites)": ("jax_effects._runtime.host_jobs", (),
                       ("Pieces", None)),
    "bars": ("jax_effects._runtime.bars", ("_bars", "_by_slot",
                                           "_last_writer"), None),
    "executions watched": ("jax_effects._runtime.executions",
                           ("_watched", "_thread"), None),
    "interrupted slots": ("jax_effects._runtime.interrupts", ("slots",),
                          None),
}

MUTATORS = frozenset({
    "append", "appendleft", "extend", "extendleft", "insert", "pop",
    "popleft", "popitem", "clear", "update", "setdefault", "add", "discard",
    "remove", "rotate", "sort", "reverse", "difference_update",
    "intersection_update", "symmetric_difference_update"})


# --- calls -------------------------------------------------------------------------

def _module_of(filename: str, root: str) -> str | None:
  if not filename.startswith(root):
    return None
  rel = filename[len(root) - len("jax_effects/"):]
  return rel[:-3].replace(os.sep, ".").removesuffix(".__init__")


class CallRecorder:
  """Records ``call`` events of ``jax_effects`` frames while installed."""

  def __init__(self, root: str):
    self.root = root
    self.modules: collections.Counter = collections.Counter()
    self.crossings: collections.Counter = collections.Counter()
    self.entries: collections.Counter = collections.Counter()
    self.through_jax: collections.Counter = collections.Counter()
    self._cache: dict = {}

  def _mod(self, code):
    try:
      return self._cache[code]
    except KeyError:
      m = self._cache[code] = _module_of(code.co_filename, self.root)
      return m

  def __call__(self, frame, event, arg):
    if event != "call":
      return
    callee = self._mod(frame.f_code)
    if callee is None:
      return
    self.modules[callee] += 1
    back = frame.f_back
    caller = self._mod(back.f_code) if back is not None else None
    if caller is not None:
      if caller != callee:
        self.crossings[caller, callee] += 1
      return
    self.entries[callee] += 1
    while back is not None:   # the nearest jax_effects frame up the stack
      owner = self._mod(back.f_code)
      if owner is not None:
        if owner != callee:
          self.through_jax[owner, callee] += 1
        break
      back = back.f_back

  def summary(self) -> dict:
    return {
        "modules": len(self.modules),
        "crossings": 2 * (sum(self.crossings.values())
                          + sum(self.through_jax.values())),
        "direct": sum(self.crossings.values()),
        "entries": sum(self.entries.values()),
        "crossings_through_jax": sum(self.through_jax.values()),
        "modules_entered": sorted(self.modules),
        "edges": {f"{a} -> {b}": n
                  for (a, b), n in self.crossings.most_common()},
        "via_jax": {f"{a} -> {b}": n
                    for (a, b), n in self.through_jax.most_common()},
    }


def measure_calls() -> dict:
  import jax
  import jax.numpy as jnp
  import jax_effects

  root = os.path.dirname(os.path.abspath(jax_effects.__file__)) + os.sep
  f = jax_effects.jit(lambda x: (jax_effects.print("x = {}", x), x + 1)[1])
  x = jnp.arange(3.0)
  jax.block_until_ready(x)
  steps = {"first call": lambda: f(x), "warm call": lambda: f(x),
           "barrier": jax_effects.effects_barrier}
  out = {}
  for name, step in steps.items():
    recorder = CallRecorder(root)
    sys.setprofile(recorder)
    try:
      step()
    finally:
      sys.setprofile(None)
    out[name] = recorder.summary()
    jax_effects.effects_barrier()   # the print has run before the next step
  return out


# --- writers per state -------------------------------------------------------------

def _package_files(root: pathlib.Path):
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root.parent).with_suffix("")
    yield ".".join(rel.parts).removesuffix(".__init__"), path


def _class_def(tree: ast.Module, cls: str) -> ast.ClassDef | None:
  return next((n for n in tree.body
               if isinstance(n, ast.ClassDef) and n.name == cls), None)


def _base_of(trees: dict, module: str, base: ast.expr) -> tuple | None:
  """``(module, class)`` of the base class expression ``base`` written in
  ``module``, where that class is the package's (else None)."""
  tree = trees[module]
  if isinstance(base, ast.Name):
    if _class_def(tree, base.id) is not None:
      return module, base.id
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module in trees:
        for a in node.names:
          if (a.asname or a.name) == base.id:
            return node.module, a.name
  elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        for a in node.names:
          if (a.asname or a.name) == base.value.id:
            owner = f"{node.module}.{a.name}"
            if owner in trees:
              return owner, base.attr
  return None


def _hierarchy(trees: dict, owner: str, cls: str) -> set:
  """``(module, class)`` of ``cls`` and of its base classes in the
  package, followed through the imports."""
  found, todo = set(), [(owner, cls)]
  while todo:
    module, name = todo.pop()
    node = _class_def(trees[module], name)
    if node is None or (module, name) in found:
      continue
    found.add((module, name))
    for base in node.bases:
      resolved = _base_of(trees, module, base)
      if resolved is not None:
        todo.append(resolved)
  return found


def _class_fields(tree: ast.Module, cls: str) -> set:
  fields = set()
  node = _class_def(tree, cls)
  for item in ast.walk(node) if node is not None else ():
    if (isinstance(item, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__slots__"
        for t in item.targets)):
      fields.update(ast.literal_eval(item.value))
    elif (isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store)
          and isinstance(item.value, ast.Name) and item.value.id == "self"):
      fields.add(item.attr)
  fields.discard("__weakref__")
  return fields


def _aliases(tree: ast.Module, owner: str, names: tuple) -> tuple[set, set]:
  """(names bound to the owner module, names bound to its globals)."""
  mods, direct = set(), set()
  pkg, _, leaf = owner.rpartition(".")
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      for a in node.names:
        if node.module == pkg and a.name == leaf:
          mods.add(a.asname or a.name)
        elif node.module == owner and a.name in names:
          direct.add(a.asname or a.name)
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name == owner and a.asname:
          mods.add(a.asname)
  return mods, direct


class _Writes(ast.NodeVisitor):
  """Collects the state names a module writes."""

  def __init__(self, is_owner, mods, direct, globals_, classes, fields,
               others, functions):
    self.is_owner, self.mods, self.direct = is_owner, mods, direct
    # classes: the names of the state's classes defined in this module
    self.globals, self.classes, self.fields = globals_, classes, fields
    self.others = others   # module-level instances of the module's other classes
    self.functions = functions   # module-level function name -> parameters
    self.found: set = set()
    self._class: list = []
    self._aliases: dict = {}   # local name -> the state it was read from
    # function name -> {parameter: the state handed to it}
    self.handed: dict = collections.defaultdict(dict)

  def visit_FunctionDef(self, node):
    saved = self._aliases
    self._aliases = (dict(self.handed.get(node.name, {}))
                     if not self._class else {})
    self.generic_visit(node)
    self._aliases = saved

  visit_AsyncFunctionDef = visit_FunctionDef

  def visit_ClassDef(self, node):
    self._class.append(node.name)
    self.generic_visit(node)
    self._class.pop()

  def _ref(self, node) -> str | None:
    """The state name ``node`` denotes (a store through it writes it)."""
    while isinstance(node, ast.Subscript):
      node = node.value
    if isinstance(node, ast.Name):
      if (self.is_owner and node.id in self.globals) or node.id in self.direct:
        return node.id
      return self._aliases.get(node.id)
    if isinstance(node, ast.Attribute):
      base = node.value
      if (isinstance(base, ast.Name) and base.id in self.mods
          and node.attr in self.globals):
        return node.attr
      if node.attr in self.fields:
        in_other_class = (self._class and self._class[-1] not in self.classes)
        if not (isinstance(base, ast.Name) and (
            (base.id == "self" and in_other_class) or base.id in self.others)):
          return node.attr
      return self._ref(base)   # x.field.sub = ...: writes field
    return None

  def _store(self, target):
    if isinstance(target, (ast.Tuple, ast.List)):
      for t in target.elts:
        self._store(t)
      return
    if isinstance(target, ast.Starred):
      return self._store(target.value)
    name = self._ref(target)
    if name is not None:
      self.found.add(name)

  def visit_Assign(self, node):
    for t in node.targets:
      self._store(t)
    # ``runtime = state.runtime``: a later ``runtime[k] = v`` writes it.
    if (len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Attribute)):
      name = self._ref(node.value)
      if name is not None:
        self._aliases[node.targets[0].id] = name
    self.generic_visit(node)

  def visit_AugAssign(self, node):
    self._store(node.target)
    self.generic_visit(node)

  def visit_AnnAssign(self, node):
    if node.value is not None:
      self._store(node.target)
    self.generic_visit(node)

  def visit_Delete(self, node):
    for t in node.targets:
      self._store(t)
    self.generic_visit(node)

  def visit_Call(self, node):
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
      self._store(func.value)
    self._hand_on(node)
    self.generic_visit(node)

  def _hand_on(self, node):
    """Records state handed to a module-level function of this module as
    an argument: of the call itself (``fn(state.runtime)``), or after the
    function among the arguments (``weakref.finalize(obj, fn, ...)``)."""
    args = [node.func, *node.args]
    for i, arg in enumerate(args):
      if not (isinstance(arg, ast.Name) and arg.id in self.functions):
        continue
      for param, value in zip(self.functions[arg.id], args[i + 1:]):
        name = self._ref(value)
        if name is not None:
          self.handed[arg.id][param] = name


def _other_instances(tree: ast.Module, classes: set) -> set:
  """Module-level names bound to an instance of a class of the module not
  in ``classes`` (``_context = _Context()``): their fields are not the
  state's."""
  defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
  return {t.id for n in tree.body if isinstance(n, ast.Assign)
          and isinstance(n.value, ast.Call)
          and isinstance(n.value.func, ast.Name)
          and n.value.func.id in defined - classes
          for t in n.targets if isinstance(t, ast.Name)}


def _functions(tree: ast.Module) -> dict:
  """Module-level function name -> its positional parameters' names."""
  return {n.name: [a.arg for a in (*n.args.posonlyargs, *n.args.args)]
          for n in tree.body
          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _module_writes(tree, module, owner, globals_, hierarchy, fields) -> set:
  """The state names ``module`` writes (twice over: the second pass knows
  which parameters the first found handed state)."""
  mods, direct = _aliases(tree, owner, globals_)
  classes = {c for m, c in hierarchy if m == module}
  handed: dict = {}
  for _ in range(2):
    visitor = _Writes(module == owner, mods, direct, set(globals_), classes,
                      fields, _other_instances(tree, classes),
                      _functions(tree))
    visitor.handed.update(handed)
    visitor.visit(tree)
    handed = visitor.handed
  return visitor.found


def writers_per_state(root: pathlib.Path, states: dict = STATES) -> dict:
  """For each state of ``states`` (as :data:`STATES`), its writer modules in
  the package at ``root``."""
  trees = {m: ast.parse(p.read_text(), str(p)) for m, p in _package_files(root)}
  out = {}
  for state, (owner, globals_, cls_spec) in states.items():
    if owner not in trees:
      out[state] = {"owner": owner, "missing": True}
      continue
    cls, fields = cls_spec if cls_spec else (None, ())
    hierarchy = _hierarchy(trees, owner, cls) if cls is not None else set()
    if cls is not None and fields is None:
      fields = set().union(*(_class_fields(trees[m], c) for m, c in hierarchy))
    fields = set(fields or ())
    writers = {}
    for module, tree in trees.items():
      found = _module_writes(tree, module, owner, globals_, hierarchy, fields)
      if found:
        writers[module] = sorted(found)
    out[state] = {"owner": owner, "writers": len(writers),
                  "by_module": writers}
  return out


# --- report ------------------------------------------------------------------------

def _print_report(calls: dict, writers: dict) -> None:
  print("calls (sys.setprofile, main thread, jax_effects frames only)")
  print(f"  {'step':<11} {'modules':>7} {'crossings':>9} {'direct':>6} "
        f"{'via JAX':>7} {'entries':>7}")
  for step, s in calls.items():
    print(f"  {step:<11} {s['modules']:>7} {s['crossings']:>9} "
          f"{s['direct']:>6} {s['crossings_through_jax']:>7} "
          f"{s['entries']:>7}")
  for step, s in calls.items():
    print(f"\n{step}: modules entered: {', '.join(m.removeprefix('jax_effects.') for m in s['modules_entered'])}")
    for edge, n in s["edges"].items():
      print(f"    {n:4d}  {edge.replace('jax_effects.', '')}")
    for edge, n in s["via_jax"].items():
      a, b = edge.split(" -> ")
      print(f"    {n:4d}  {a.replace('jax_effects.', '')} -> (JAX) -> "
            f"{b.replace('jax_effects.', '')}")
  print("\nwriters per state (static scan)")
  for state, w in writers.items():
    if w.get("missing"):
      print(f"  {state}: owner {w['owner']} not found")
      continue
    print(f"  {state} ({w['owner'].removeprefix('jax_effects.')}): "
          f"{w['writers']} modules")
    for module, names in w["by_module"].items():
      print(f"      {module.removeprefix('jax_effects.')}: {', '.join(names)}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="print JSON")
  parser.add_argument("--devices", type=int, default=None,
                      help="host CPU devices (XLA_FLAGS); default JAX's")
  args = parser.parse_args(argv)
  if args.devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count="
                               f"{args.devices}")
  with contextlib.redirect_stdout(sys.stderr):   # the program's print lines
    calls = measure_calls()
  import jax_effects
  writers = writers_per_state(pathlib.Path(jax_effects.__file__).parent)
  if args.json:
    print(json.dumps({"calls": calls, "writers": writers}, indent=1))
  else:
    _print_report(calls, writers)
  return 0


if __name__ == "__main__":
  sys.exit(main())

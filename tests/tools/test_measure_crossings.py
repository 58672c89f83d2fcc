"""The layout measurement (``tests/tools/measure_crossings.py``;
``design/architecture.md``, "Measuring the layout") counts what it says, on
small packages made for the test: the crossings of a call, there and back,
directly and through a frame outside the package; the writer modules of a
state, through import aliases and local aliases, its base classes' methods
and a field handed to a function, not another class's fields."""
import importlib.util
import sys
import textwrap

import measure_crossings as mc


def _write(root, files):
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_calls_count_crossings_there_and_back(tmp_path, monkeypatch):
  # Modules in a folder named jax_effects count as the package's (by file).
  _write(tmp_path, {
      "mc_outside.py": "def call(fn):\n  return fn()\n",
      "jax_effects/b.py": """
          def g():
            return 1
          def h():
            return 2
          """,
      "jax_effects/a.py": """
          import mc_outside
          import mc_fake_b as b
          def helper():
            return 0
          def f():
            return helper() + b.g() + b.g() + mc_outside.call(b.h)
          """})
  for name, path in (("mc_outside", "mc_outside.py"),
                     ("mc_fake_b", "jax_effects/b.py"),
                     ("mc_fake_a", "jax_effects/a.py")):
    spec = importlib.util.spec_from_file_location(name, tmp_path / path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)

  recorder = mc.CallRecorder(str(tmp_path / "jax_effects") + "/")
  sys.setprofile(recorder)
  try:
    assert sys.modules["mc_fake_a"].f() == 4
  finally:
    sys.setprofile(None)
  s = recorder.summary()
  assert s["modules_entered"] == ["jax_effects.a", "jax_effects.b"]
  assert s["edges"] == {"jax_effects.a -> jax_effects.b": 2}
  assert s["via_jax"] == {"jax_effects.a -> jax_effects.b": 1}
  assert (s["direct"], s["crossings_through_jax"], s["crossings"]) == (2, 1, 6)
  assert s["entries"] == 2   # f (from the test), h (from mc_outside.call)


def test_writers_per_state(tmp_path):
  _write(tmp_path / "pkg", {
      "__init__.py": "",
      "owner.py": """
          from pkg import base as _base
          queue = []
          class Tokens(_base.Store):
            __slots__ = ("runtime", "slot")
            def __init__(self):
              super().__init__()
              self.runtime = {}
              self.slot = 0
          def push(x):
            queue.append(x)
          """,
      "base.py": """
          from pkg.root import Root
          class Store(Root):   # a base class's fields are the state's too
            __slots__ = ("joined",)
            def __init__(self):
              self.joined = []
          class Unrelated:
            __slots__ = ("seen",)
            def __init__(self):
              self.seen = 0
          """,
      "root.py": """
          class Root:
            __slots__ = ("seqs",)
            def bump(self):
              self.seqs += 1
          """,
      "slots.py": """
          import weakref
          def register(state):
            weakref.finalize(state, _exited, state.joined, 3)
          def _exited(joined, n):
            joined.clear()         # the field, handed on
          def _drop(seqs):
            seqs.clear()           # never handed a field
          def clear_later(state):
            _also(state.runtime)
          def _also(runtime):
            runtime.pop("k")
          """,
      "writer.py": """
          from pkg import owner as _owner
          def f(state):
            runtime = state.runtime
            runtime["k"] = 1
            _owner.queue.clear()
          """,
      "augmented.py": """
          def f(state):
            state.slot += 1
          """,
      "reader.py": """
          from pkg import owner as _owner
          class Other:
            def __init__(self):
              self.slot = 3        # another class's field
          class _Local:
            slot = None
          local = _Local()
          def f(state):
            local.slot = 2         # a module instance of another class
            return state.runtime.get("k"), len(_owner.queue)
          """})
  states = {"tokens": ("pkg.owner", (), ("Tokens", None)),
            "queue": ("pkg.owner", ("queue",), None)}
  out = mc.writers_per_state(tmp_path / "pkg", states)
  assert out["tokens"]["by_module"] == {
      "pkg.augmented": ["slot"], "pkg.base": ["joined"],
      "pkg.owner": ["runtime", "slot"], "pkg.root": ["seqs"],
      "pkg.slots": ["joined", "runtime"], "pkg.writer": ["runtime"]}
  assert out["queue"]["by_module"] == {
      "pkg.owner": ["queue"], "pkg.writer": ["queue"]}
  assert (out["tokens"]["writers"], out["queue"]["writers"]) == (6, 2)

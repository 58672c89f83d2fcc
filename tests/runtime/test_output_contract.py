"""Where output is read, it is where the user looks (issue 37 item 5;
README "Where output goes, and when"; ``design/errors.md``, "No unbounded
wait").

Each computation here prints after a callback that waits for an event set
by a timer once the call has returned (the call waits for a computation
that runs user code at most ``launch_lock.FINISH_WAIT_S``, lowered here),
so its line cannot have been written when the call returned: whatever
shows it under its cell, in a redirected stream or before the next Python
``print`` must have waited for it.
"""
import contextlib
import io
import threading

import jax
import jax.numpy as jnp
import pytest

import jax_effects as je
from jax_effects._runtime import launch_lock
from helpers import run_script, scenario_lines

X = jnp.ones((128, 128)) / 128   # x @ x: not "cheap", dispatched async
RELEASE_S = 0.3


@pytest.fixture(autouse=True)
def short_finish(monkeypatch):
  monkeypatch.setattr(launch_lock, "FINISH_WAIT_S", 0.02)


def late_printer():
  """``f(x)``: prints ``late <x[0,0]>`` once a timer started by the call
  sets an event."""
  release = threading.Event()

  def wait():
    assert release.wait(20)

  @je.jit
  def f(x):
    y = x @ x
    je.callback(wait, None)
    je.print("late {}", y[0, 0])
    return y

  def call(x):
    release.clear()
    out = f(x)
    threading.Timer(RELEASE_S, release.set).start()
    return out
  return call


def test_jax_effects_barrier_waits_for_jax_effects_effects(capsys):
  f = late_printer()
  for _ in range(3):   # (the first call, and the hook's)
    f(X)
    jax.effects_barrier()
    print("after")
    assert capsys.readouterr().out == "late 0.0078125\nafter\n"


def test_redirect_stdout_around_a_call_and_its_barrier_gets_the_line():
  f = late_printer()
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    f(X)
    jax.effects_barrier()
    print("after")
  assert buf.getvalue() == "late 0.0078125\nafter\n"


def test_jax_effects_barrier_inside_a_callback_is_refused_naming_it():
  def host():
    jax.effects_barrier()

  @je.jit
  def f(x):
    je.callback(host, None)
    return x + 1

  with pytest.raises(RuntimeError, match=r"jax\.effects_barrier\(\).*host "
                                         r"callback"):
    f(1.0)
    je.effects_barrier()


CELLS = """
import threading, warnings
import jax.numpy as jnp
import jax_effects as je
from jax_effects._runtime import launch_lock
launch_lock.FINISH_WAIT_S = 0.02

@je.jit
def f(x):
  y = x @ x
  je.callback(lambda: (release.wait(20), None)[1], None)
  je.print("from cell 1: {}", y[0, 0])
  return y

cell1 = '''
out = f(jnp.ones((128, 128)) / 128)
threading.Timer(0.3, release.set).start()
'''
"""

#: One run of ``cell1`` with the cell hook's wait at ``CELLWAIT`` seconds,
#: after a line naming it.
CELL = """
print("== CELLWAIT", flush=True)
try:   # (the module of the cell hook)
  from jax_effects._runtime import notebook
  notebook.CELL_WAIT_S = float(CELLWAIT)
except ImportError:
  pass
release = threading.Event()
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  shell.run_cell(cell1)
print("--- cell 2", [str(w.message).startswith(
    "jax_effects: this cell's effects were still running") for w in caught],
    flush=True)
release.wait(20)
je.effects_barrier()
"""

FAKE_SHELL = """
import sys, types

class EventManager:   # IPython.core.events.EventManager's contract
  def __init__(self):
    self.callbacks = {"pre_execute": [], "pre_run_cell": [],
                      "post_execute": [], "post_run_cell": [],
                      "shell_initialized": []}
  def register(self, event, function):
    if not callable(function):
      raise TypeError(function)
    if function not in self.callbacks[event]:   # (KeyError: unknown)
      self.callbacks[event].append(function)
  def trigger(self, event, *args, **kwargs):
    for func in self.callbacks[event][:]:
      func(*args, **kwargs)

class Shell:
  def __init__(self):
    self.events = EventManager()
    self.ns = {}
  def run_cell(self, source):
    self.events.trigger("pre_run_cell", None)
    exec(source, globals())
    self.events.trigger("post_run_cell", object())

shell = Shell()
ipython = types.ModuleType("IPython")
ipython.get_ipython = lambda: shell
sys.modules["IPython"] = ipython
"""

REAL_SHELL = """
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
_run = shell.run_cell
shell.run_cell = lambda source: _run(source, store_history=False)
import builtins
"""


def _cells(shell_source: str, *waits: float):
  """The finished child that runs ``cell1`` under the shell once per wait,
  in turn (``helpers.scenario_lines``)."""
  source = shell_source + CELLS + "".join(
      CELL.replace("CELLWAIT", repr(w)) for w in waits) + (
          'print("== end", flush=True)\n')
  if "InteractiveShell" in shell_source:   # (the cell runs in the shell's ns)
    source = source.replace("shell.run_cell(cell1)",
                            "shell.user_ns.update(globals()); "
                            "shell.run_cell(cell1)")
  return run_script(source, timeout=120)


@pytest.fixture(scope="module")
def fake_shell_cells():
  """The cell under a stand-in shell, in one child: the hook waits 20 s,
  then 0.01 s (``f``'s second call runs as a warm call does)."""
  return _cells(FAKE_SHELL, 20.0, 0.01)


def test_a_cells_effects_appear_under_that_cell(fake_shell_cells):
  assert scenario_lines(fake_shell_cells, "20.0") == [
      "from cell 1: 0.0078125", "--- cell 2 []"]


def test_a_cell_that_outlasts_the_wait_warns_and_its_line_comes_later(
    fake_shell_cells):
  lines = scenario_lines(fake_shell_cells, "0.01")
  assert lines == ["--- cell 2 [True]", "from cell 1: 0.0078125"]


def test_a_cells_effects_appear_under_that_cell_in_ipython():
  pytest.importorskip("IPython")
  assert scenario_lines(_cells(REAL_SHELL, 20.0), "20.0") == [
      "from cell 1: 0.0078125", "--- cell 2 []"]

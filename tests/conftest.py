"""Project-only test options and fixtures (helpers: ``tests/helpers.py``).

The jax_effects pytest plugin itself is loaded through its pytest11 entry
point (install the package, e.g. ``pip install -e .`` or ``tox``); it is
deliberately not registered here, which would load it twice.
"""
import collections
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import helpers

N_DEVICES = 8

# The heavy scenarios (issue 49, item 12): stress, fault and fuzz runs, the
# tools' end-to-end runs, and the slowest variants of a few differential
# tests. Marked ``heavy`` at collection; tox runs them on the newest JAX
# line and one older (jax012, jax010) and deselects them on the others
# (``-m "not heavy"``), which still run every other test. An entry is a
# test file, or a test's node id without its parameters (all of them), or
# with them (that one).
HEAVY = (
    # stress and fault scenarios
    "tests/runtime/test_fault_model.py",
    "tests/runtime/test_fault_contract.py",
    "tests/runtime/test_fault_boundaries.py",
    "tests/runtime/test_fault_soak.py",
    "tests/runtime/test_failed_executions.py",
    "tests/runtime/test_stress_threads.py",
    "tests/runtime/test_launch_deadlock.py",
    "tests/runtime/test_callback_reentry.py",
    "tests/runtime/test_exit.py",
    "tests/runtime/test_interrupts.py",
    "tests/primitives/test_host_keys.py",     # forged and corrupt modules
    "tests/primitives/test_host_target.py::"
    "test_calls_keep_no_memory_per_execution",
    "tests/placement/test_multidevice.py::"
    "test_callback_slower_than_xla_collective_timeout_does_not_abort",
    "tests/frontends/test_summarized_printing.py::"
    "test_order_holds_and_nothing_stalls_with_the_programs_collectives",
    "tests/frontends/test_under_any_jit.py::"
    "test_callback_using_jax_dispatched_far_ahead_never_hangs",
    # generated programs (each line still runs test_differential's)
    "tests/differential/test_fuzz_programs.py",
    "tests/differential/test_fuzz_bad_input.py",
    "tests/differential/test_entries.py",
    "tests/frontends/test_summarized_printing.py::"
    "test_text_matches_jax_debug_print_of_the_whole_array[1]",
    "tests/frontends/test_summarized_printing.py::"
    "test_text_matches_jax_debug_print_of_the_whole_array[2]",
    "tests/frontends/test_summarized_printing.py::"
    "test_text_matches_jax_debug_print_of_the_whole_array[3]",
    # the tools, end to end (a bench run, a third-party suite, pytest in
    # pytest, several processes, mypy, the demo)
    "tests/tools/test_bench_smoke.py",
    "tests/tools/test_thirdparty_harness.py",
    "tests/tools/test_pytest_plugin.py",
    "tests/tools/test_multiprocess.py",
    "tests/tools/test_multiprocess_port.py",
    "tests/tools/test_demo.py",
    "tests/api/test_typing.py",
)


def pytest_addoption(parser):
  parser.addoption(
      "--run-slow", action="store_true", default=False,
      help="run the long variants: more generated cases, larger stress "
           "sizes (also JAX_EFFECTS_RUN_SLOW=1)")


def pytest_xdist_auto_num_workers(config):
  """``-n auto`` (tox.ini): a worker per core and one more. A worker is often
  waiting, not computing: on a child process it started, on a test's sleep
  or on a callback another thread must run. With two workers on two idle
  cores, the light set took 183-189 s (jax08, jax09) for at most 318 CPU-s:
  an eighth of the machine or more was idle (issue 49, item 12)."""
  return len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") \
      else (os.cpu_count() or 1) + 1


def pytest_configure(config):
  # Read before the test modules are imported: sizes are chosen at collection.
  helpers.RUN_SLOW = bool(config.getoption("--run-slow")
                          or os.environ.get("JAX_EFFECTS_RUN_SLOW") == "1")
  config.addinivalue_line(
      "markers", "jax_feature(name): needs the feature `name` (a key of "
      "jax_effects._compat.FEATURES); skipped, with _compat's reason, where "
      "the installed JAX cannot support it")
  config.addinivalue_line(
      "markers", "heavy: a stress, fault, fuzz or end-to-end tool scenario "
      "(conftest.HEAVY): tox runs it on two JAX lines only")


def pytest_collection_modifyitems(config, items):
  # The one skip helper for JAX-version limits: the reason is the text of the
  # error jax_effects raises for the feature (jax_effects._compat).
  from jax_effects import _compat  # imports jax; starts no backend
  for item in items:
    test = item.nodeid.split("[")[0]
    if (item.nodeid.split("::")[0] in HEAVY or test in HEAVY
        or item.nodeid in HEAVY):
      item.add_marker(pytest.mark.heavy)
    for mark in item.iter_markers("jax_feature"):
      reason = _compat.unsupported_reason(*mark.args)
      if reason is not None:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def devices():
  """The 8 simulated CPU devices (tox.ini: ``jax_effects_devices = 8``)."""
  ds = jax.devices()
  assert len(ds) == N_DEVICES, "run with jax_effects_devices = 8"
  return ds


@pytest.fixture(scope="session")
def mesh(devices):
  """A one-axis mesh ``("i",)`` over the 8 devices."""
  return Mesh(np.array(devices), ("i",))


@pytest.fixture
def jax_events(monkeypatch):
  """Counts JAX's internal test events (``jax._src.util.test_event``), the
  hook JAX's own tests use: "jit_cpp_cache_miss" each time a ``jax.jit`` call
  leaves the C++ fast path for Python, "batched_device_put_start" for each
  ``jax.device_put`` of host values, ..."""
  from jax._src import util
  counts = collections.Counter()
  monkeypatch.setattr(util, "test_event_listener",
                      lambda name, *a: counts.update([name]))
  return counts

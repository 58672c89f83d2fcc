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


def pytest_addoption(parser):
  parser.addoption(
      "--run-slow", action="store_true", default=False,
      help="run the long variants: more generated cases, larger stress "
           "sizes (also JAX_EFFECTS_RUN_SLOW=1)")


def pytest_configure(config):
  # Read before the test modules are imported: sizes are chosen at collection.
  helpers.RUN_SLOW = bool(config.getoption("--run-slow")
                          or os.environ.get("JAX_EFFECTS_RUN_SLOW") == "1")
  config.addinivalue_line(
      "markers", "jax_feature(name): needs the feature `name` (a key of "
      "jax_effects._compat.FEATURES); skipped, with _compat's reason, where "
      "the installed JAX cannot support it")


def pytest_collection_modifyitems(config, items):
  # The one skip helper for JAX-version limits: the reason is the text of the
  # error jax_effects raises for the feature (jax_effects._compat).
  from jax_effects import _compat  # imports jax; starts no backend
  for item in items:
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

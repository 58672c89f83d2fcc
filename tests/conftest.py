"""Project-only test options. The jax_effects pytest plugin itself is loaded
through its pytest11 entry point (install the package, e.g. ``pip install -e .``
or ``tox``); it is deliberately not registered here, which would load it twice.
"""
import pytest


def pytest_addoption(parser):
  parser.addoption(
      "--run-slow", action="store_true", default=False,
      help="also run tests marked slow (long stress/fuzz variants)")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "slow: long stress/fuzz variants, run with --run-slow")
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
  if config.getoption("--run-slow"):
    return
  skip = pytest.mark.skip(reason="slow: run with --run-slow")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)

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


def pytest_collection_modifyitems(config, items):
  if config.getoption("--run-slow"):
    return
  skip = pytest.mark.skip(reason="slow: run with --run-slow")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)

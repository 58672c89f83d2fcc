"""Targets for the launcher's own tests (tests/test_multiprocess.py).

Run in child processes by ``jax_effects._tools.launcher.launch`` after
``jax.distributed.initialize``.
"""
import time

import jax


def fail_in_process_one():
  if jax.process_index() == 1:
    raise ValueError("process 1 fails on purpose")
  time.sleep(600)   # would wait for process 1 forever: the launcher kills it


def hang():
  time.sleep(600)


def process_index():
  return jax.process_index()

"""Tools built on the public API, apart from the core.

* :mod:`~jax_effects._tools.demo` and :mod:`~jax_effects._tools.bench`:
  ``python -m jax_effects demo`` / ``bench``.
* :mod:`~jax_effects._tools.launcher`: runs a ``jax.distributed`` program in
  several processes on one machine (``demo --processes``, the multi-process
  test); :mod:`~jax_effects._tools.multiprocess_program` is that program.
* :mod:`~jax_effects._tools.pytest_plugin`: the ``effects_capture`` fixture
  and a barrier after every test (registered as a ``pytest11`` entry point).

Nothing in the core imports this package.
"""

"""pytest plugin: ``jax.jit = jax_effects.jit`` for the whole test run.

Loaded with ``-p jax_effects_global_jit`` (this folder on ``PYTHONPATH``;
``run.py`` does both for the "replaced" run of each suite): pytest imports it
while it reads the command line, before any conftest or test module, so
every ``jax.jit`` the suite and the libraries it tests look up (at import or
at call time) is ``jax_effects.jit``, as for a user who applies the drop-in
to code they do not own. pytest-xdist passes ``-p`` on to its workers.

JAX's internal uses of ``jit`` (``jax.numpy`` functions and the like bind
``jax._src.api.jit`` when JAX is imported) stay JAX's, as they do for such
a user.
"""
import jax

import jax_effects

jax.jit = jax_effects.jit


def pytest_report_header(config):
  return [f"jax_effects_global_jit: jax.jit is {jax.jit.__module__}."
          f"{jax.jit.__qualname__} (jax_effects {jax_effects.__version__})"]

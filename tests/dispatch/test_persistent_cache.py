"""JAX's persistent compilation cache keeps ``jax_effects.jit`` functions
with effects (``design/host_target.md``, "The persistent cache").

Their executables hold no Python object (every host call is a custom call to
jax_effects' FFI target, named by a key), so JAX writes the cache entry,
and a fresh process running the same program loads it instead of compiling:
observed through JAX's own monitoring events (``cache_hits``,
``cache_misses``), never by time. The output is the same, in the same order.
"""
import os

import helpers

_PROGRAM = """
import logging, sys
import jax, jax.numpy as jnp
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
import jax_effects as je
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("LOG %(name)s %(message)s"))
logging.getLogger("cached").addHandler(handler)
logging.getLogger("cached").setLevel(logging.INFO)
named = je.register_callback("cached.named", lambda v: print("named", v))

@je.jit
def step(x):
  je.print("x = {}", x)
  je.log("sum {}", x.sum(), logger="cached")
  je.callback(lambda v: print("callback", v), None, x * 2)
  je.callback(named, None, x[0])
  jax.debug.print("debug.print {}", x[1])
  jax.debug.callback(lambda v: print("debug.callback", v), x[2])
  return x + 1

print("out", step(jnp.arange(3.0)))
je.effects_barrier()
print("hits", events.count("/jax/compilation_cache/cache_hits"),
      "misses", events.count("/jax/compilation_cache/cache_misses"),
      file=sys.stderr)
"""

_EXPECTED = ["x = [0. 1. 2.]", "LOG cached sum 3.0", "callback [0. 2. 4.]",
             "named 0.0", "debug.print 1.0", "debug.callback 2.0",
             "out [1. 2. 3.]"]


def _run(cache_dir):
  proc = helpers.run_script(_PROGRAM, env={
      "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  counts = proc.stderr.strip().splitlines()[-1].split()
  return proc.stdout.splitlines(), int(counts[1]), int(counts[3])


def test_a_fresh_process_hits_the_persistent_cache_with_the_same_output(
    tmp_path):
  lines, hits, misses = _run(tmp_path)
  assert lines == _EXPECTED
  assert hits == 0 and misses >= 1
  assert any("jit_step" in name for name in os.listdir(tmp_path))
  lines, hits, misses = _run(tmp_path)
  assert lines == _EXPECTED
  assert misses == 0 and hits >= 1

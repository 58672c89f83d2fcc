"""``bench`` row (m): printing a big sharded array, and operands assembled on
the host (issue 22; ``design/formatting.md``, "Summarized arrays").

On 8 (simulated) devices, a ``float32`` array of 2^24 elements sharded over
them; each step is a reduction of it:

* ``m_plain``: the step alone (``jax.jit``);
* ``m_ours_print``: the step with ``jax_effects.print("x = {}", x)``, whose
  operand NumPy summarizes: each device passes its part of the edges to the
  host (no collective);
* ``m_jax_print``: the step with ``jax.debug.print("x = {}", x)`` under
  ``jax.jit`` (the array gathered and moved to the host whole);
* ``m_ours_cut_on_devices`` (reported): the same print with
  ``ordered=False``, which takes no part from the host: the edges are cut
  on the devices and gathered there (small collectives);
* the whole array shown (host assembly or a gather on the devices, see
  ``host_assembly.WHOLE_ON_HOST``), reported both ways: a small array's
  print (128 elements, under NumPy's threshold), and a result-free
  ``jax_effects.callback`` receiving the 2^24 array, and a small one.

Targets: ours / plain <= 2, JAX's / ours >= 20, the same text, and no
collective added to the compiled module. Interleaved as the other rows
(``bench.interleave``).
"""
from __future__ import annotations

import contextlib
import io
import re
from typing import Any

N_DEVICES = 8
BIG = 2 ** 24

TARGETS = {
    "m_ours/plain": ("<=", 2.0, "big sharded print + step, ours / plain step"),
    "m_jax/ours": (">=", 20.0, "big sharded print + step, jax.debug.print / ours"),
    "m_same_text": (">=", 1.0, "big sharded print: ours prints jax.debug.print's text (1 = yes)"),
    "m_collectives_added": ("<", 1.0, "big sharded print: collectives ours adds to the plain step"),
    "m_cut/ours": ("=", None, "big print, edges cut and gathered on the devices / from the host"),
    "m_small_host/gather": ("=", None, "small sharded print (whole), host assembly / gather"),
    "m_cb_host/gather": ("=", None, "callback on the 2^24 array, host assembly / all-gather"),
    "m_cb_small_host/gather": ("=", None, "callback on a small sharded array, host assembly / all-gather"),
}

_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
                "reduce-scatter", "collective-broadcast")


def collectives(compiled_text: str) -> int:
  """Collective operations in a compiled module (async pairs once)."""
  ops = re.findall(r"=\s*\S+\s+([a-z\-]+)\(", compiled_text)
  return sum(1 for op in ops
             if op.removesuffix("-start") in _COLLECTIVES
             and not op.endswith("-done"))


@contextlib.contextmanager
def _whole_on_host(value: bool):
  from jax_effects._primitives import host_assembly
  saved = host_assembly.WHOLE_ON_HOST
  host_assembly.WHOLE_ON_HOST = value
  try:
    yield
  finally:
    host_assembly.WHOLE_ON_HOST = saved


def _noop(*args):
  del args


def bench_big_arrays(interleave, quiet, rounds: int, calls: int
                     ) -> tuple[dict[str, Any], dict[str, float]]:
  """Row (m); ``interleave``/``quiet`` are ``bench``'s."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_effects

  devices = jax.devices()
  if len(devices) < N_DEVICES:
    return {"m_skipped": f"only {len(devices)} devices"}, {}
  mesh = Mesh(devices[:N_DEVICES], ("d",))
  sharding = NamedSharding(mesh, P("d"))
  x = jax.device_put(jnp.arange(BIG, dtype=jnp.float32) / 3, sharding)
  small = jax.device_put(jnp.arange(128, dtype=jnp.float32) / 3, sharding)

  def step(v):
    return v.sum()

  def ours_step(v):
    jax_effects.print("x = {}", v)
    return step(v)

  def cut_step(v):
    jax_effects.print("x = {}", v, ordered=False)
    return step(v)

  def jax_step(v):
    jax.debug.print("x = {}", v)
    return step(v)

  def cb_step(v):
    jax_effects.callback(_noop, None, v)
    return step(v)

  plain = jax.jit(step)
  ours = jax_effects.jit(ours_step)
  cut = jax_effects.jit(cut_step)
  theirs = jax.jit(jax_step)

  # The same text, and the collectives of the compiled modules.
  texts = []
  for f in (ours, theirs):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      jax.block_until_ready(f(x))
      jax_effects.effects_barrier()
      jax.effects_barrier()
    texts.append(out.getvalue())
  same_text = float(texts[0] == texts[1] and texts[0].startswith("x = ["))
  added = (collectives(ours.lower(x).compile().as_text())
           - collectives(plain.lower(x).compile().as_text()))

  # Whole arrays both ways: each variant compiled (first call) under its
  # setting of WHOLE_ON_HOST.
  variants = {}
  for name, fn, arg in (("small", ours_step, small), ("cb", cb_step, x),
                        ("cb_small", cb_step, small)):
    for way, on_host in (("host", True), ("gather", False)):
      f = jax_effects.jit(fn)
      with _whole_on_host(on_host), quiet():
        jax.block_until_ready(f(arg))
        jax_effects.effects_barrier()
      variants[f"m_{name}_{way}"] = (lambda f=f, a=arg: f(a))

  jax_calls = max(2, calls // 5)
  with quiet():
    samples = interleave({
        "m_plain": (lambda: plain(x), calls),
        "m_ours_print": (lambda: ours(x), calls),
        "m_jax_print": (lambda: theirs(x), jax_calls),
        "m_ours_cut_on_devices": (lambda: cut(x), calls),
        **{name: (fn, calls) for name, fn in variants.items()},
    }, rounds)
  return samples, {"same_text": same_text, "added": float(added)}


def ratios(samples, extra, ratio, summary) -> tuple[dict, dict]:
  """``(results, ratios)`` of row (m) from its samples (``bench``'s
  ``_ratio``/``_summary``)."""
  if "m_skipped" in samples:
    return samples, {}
  results = {k: summary(v) for k, v in samples.items()}
  results["m_setup"] = {"devices": N_DEVICES, "elements": BIG,
                        "collectives_added": int(extra["added"])}
  return results, {
      "m_ours/plain": ratio(samples, "m_ours_print", "m_plain"),
      "m_jax/ours": ratio(samples, "m_jax_print", "m_ours_print"),
      "m_same_text": extra["same_text"],
      "m_collectives_added": extra["added"],
      "m_cut/ours": ratio(samples, "m_ours_cut_on_devices", "m_ours_print"),
      "m_small_host/gather": ratio(samples, "m_small_host", "m_small_gather"),
      "m_cb_host/gather": ratio(samples, "m_cb_host", "m_cb_gather"),
      "m_cb_small_host/gather": ratio(samples, "m_cb_small_host",
                                      "m_cb_small_gather"),
  }

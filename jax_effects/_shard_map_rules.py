"""Token-threading rule for ``shard_map`` (and so ``pmap``): per-device effects.

Inside a fully manual ``shard_map`` every side effect runs once per device
(see ``_placement``). The rule re-expresses the ``shard_map`` equation with
the carriers of the chains used inside as extra operands and results::

    carriers_vec, outs = shard_map(body', in_specs=(P(), ..., *in_specs),
                                   out_specs=(P(axes), ..., *out_specs))(
                                       carriers, *args)
    carrier = max(carriers_vec)            # all-reduce over the devices
    carrier = segment_end(token, carrier)  # one host callback per chain

* A carrier enters replicated (``P()``): every device's first effect depends
  on the chain's previous effect (the runtime token, or the last effect before
  the ``shard_map``). Inside, it is cast to *varying* over the manual axes
  (under ``check_vma``), which is what it is: each device threads its own.
* Each device's final carrier leaves as one element of a ``(n_devices,)``
  array (``P(axes)``), reduced with ``max`` outside: the reduced carrier (and
  so the next effect, and the runtime token the executable returns, whichever
  shard of it is kept) depends on the last effect of *every* device. So each
  device keeps program order across calls, and effects after the
  ``shard_map`` follow all of its per-device effects.
* ``segment_end`` is a host callback on one device that marks the end of this
  ``shard_map`` execution on the chain: it releases the output held by
  :func:`jax_effects.deterministic` (a no-op otherwise).

``jax.pmap`` is staged by JAX 0.10 as ``jit(shard_map)`` over the mapped
axis, so it is covered by the same rule.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P

from jax_effects import _compat
from jax_effects import _effects
from jax_effects import _placement
from jax_effects import _primitives
from jax_effects import _thread_tokens


def _to_varying(x, axes: tuple):
  """Casts ``x`` to varying over ``axes`` (where it is not already)."""
  varying = jax.typeof(x).manual_axis_type.varying
  missing = tuple(a for a in axes if a not in varying)
  return lax.pcast(x, missing, to="varying") if missing else x


def _segment_end_callback(key) -> _primitives.HostCallback:
  def end():
    _placement.segment_end(key)
    return ()
  return _primitives.HostCallback(end, f"jax_effects segment end ({key!r})")


def _segment_end_per_device(key, carrier, mesh, axes, manual, check_vma):
  """The segment end in a multi-process program: once on every device.

  A callback outside the ``shard_map`` runs on the computation's first device
  only, i.e. in one process, and the other processes would hold their
  devices' output until ``deterministic()`` exits. Run per device instead,
  each process releases its own held output; every device's call depends on
  the reduced carrier (so on every device's last effect), the first one in a
  process releases, the others find nothing held, and the chain continues
  from the max of their carriers (after all of them).
  """
  callback = _segment_end_callback(key)

  def body(c):
    if check_vma:
      c = _to_varying(c, axes)
    _, c = _primitives.threaded_effect_p.bind(
        lax.create_token(), c, host_callback=callback, result_avals=())
    return c.reshape((1,))

  vec = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(axes),
                      axis_names=set(manual), check_vma=check_vma)(carrier)
  return jnp.max(vec)


def _shard_map_rule(eqn, invals, chains: _thread_tokens.Chains, mode: str):
  p = eqn.params
  mesh = p["mesh"]
  manual = p["newly_manual_axes"]
  axes = tuple(a for a in mesh.axis_names if a in manual)
  check_vma = p["check_vma"]
  keys = _thread_tokens.chain_keys(eqn.effects, mode)
  body_fn = _thread_tokens.region(p["jaxpr"], keys, mode)

  def body(carriers, *args):
    if check_vma:
      carriers = [_to_varying(c, axes) for c in carriers]
    carriers, outs = body_fn(carriers, *args)
    if check_vma:
      carriers = [_to_varying(c, axes) for c in carriers]
    return tuple(c.reshape((1,)) for c in carriers), list(outs)

  carrier_in = tuple(P() for _ in keys)
  carrier_out = tuple(P(axes) for _ in keys)
  mapped = jax.shard_map(
      body, mesh=mesh, in_specs=(carrier_in, *p["in_specs"]),
      out_specs=(carrier_out, list(p["out_specs"])),
      axis_names=set(manual), check_vma=check_vma)
  carrier_vecs, outs = mapped(chains.take(keys), *invals)

  for key, vec in zip(keys, carrier_vecs):
    carrier = jnp.max(vec)
    if key is not _effects.UNORDERED and jax.process_count() > 1:
      carrier = _segment_end_per_device(key, carrier, mesh, axes, manual,
                                        check_vma)
    elif key is not _effects.UNORDERED:
      token = chains.tokens.get(key)
      if token is None:
        token = lax.create_token()
      token, carrier = _primitives.threaded_effect_p.bind(
          token, carrier, host_callback=_segment_end_callback(key),
          result_avals=())
      chains.tokens[key] = token
    chains.carriers[key] = carrier
  return outs


_thread_tokens.RULES[_compat.shard_map_p] = _shard_map_rule

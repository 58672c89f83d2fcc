"""The token calling convention of an exported ``jax_effects.jit`` function.

``jax.export`` of a ``jax_effects.jit`` function (``_dispatch.function``)
exports::

    h(*args) -> outputs:
      c = exported_entry()                  # JAX's ordered EXPORTED_ORDER
      outputs, token = g(c, ..., c, *args)  # the threaded computation
      exported_exit(token)                  # JAX's ordered EXPORTED_ORDER

every runtime-token argument of ``g`` replaced by one carrier, ``c``, tied
to the module's ``!stablehlo.token`` by host calls (:func:`_join`). The
same entry and exit, with ``order=PLAIN_JIT_ORDER``, bracket a region of
ours lowered under plain ``jax.jit`` (``_pass.control_flow_rules``): there
they join every ordered chain of the region, as ``host_target.join`` does.
:data:`exported_call_p` is an ``exp.call`` inside ``jax_effects.jit``,
joined to the chain's carrier (``_pass.control_flow_rules``). See
``design/host_target.md``, "Exported modules". CPU only.
"""
from __future__ import annotations

import dataclasses
import itertools

from jax.core import ShapedArray
from jax.interpreters import mlir
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects._compat import core as jcore
from jax_effects._core import effects as _effects
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_specs as _host_specs
from jax_effects._primitives import host_target as _host_target
from jax_effects._primitives import threaded as _threaded
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import output as _output
from jax_effects._runtime import token_value as _token_value

EXPORTED_ORDER = _effects.EXPORTED_ORDER
_CARRIER = ShapedArray((), np.dtype(_token_value.TOKEN_DTYPE))


def _one(value):
  """The IR value (JAX passes some as a one-element sequence)."""
  if isinstance(value, (tuple, list)):
    (value,) = value
  return value


def _token_in(ctx, order):
  return ctx.tokens_in.get(order) if order is EXPORTED_ORDER else _host_target.join(ctx, order)


def _set_token(ctx, token, order=EXPORTED_ORDER) -> None:
  if order is not EXPORTED_ORDER:
    _host_target.set_joined(ctx, order, token)
    return
  ctx.set_tokens_out(ctx.tokens_in.update_tokens(
      mlir.TokenSet({EXPORTED_ORDER: token})))


_TOKEN = _compat.abstract_token


_entries = itertools.count(1)


def _join_host(spec: dict) -> _host_callback.HostCallback:
  """The host side of a join: data (a kind of ``host_specs``)."""
  kind = spec["kind"]
  if kind == "exported_entry":   # (on every device of several: the slot)
    def entry_slot():
      return (np.int32(_errors.plain_jit_slot()),)
    return _host_callback.HostCallback(
        entry_slot, "the entry of an exported jax_effects function",
        (_CARRIER,), spec=spec)
  if kind == "plain_entry":   # (once, on the first device)
    def entry_identity():
      # (an identity of its own per execution: its pieces and lanes,
      # host_jobs, never meet another execution's)
      seq = next(_entries) & _token_value.SEQ_MASK
      return (np.int32(_errors.plain_jit_slot() | (seq << _token_value.SEQ_SHIFT)),)
    return _host_callback.HostCallback(
        entry_identity, "the entry of a jax_effects region under jax.jit",
        (_CARRIER,), spec=spec)
  def joined(*carrier):
    # (after every device's effects: per-device lines held by
    # deterministic() come out now, before anything after the join)
    _output.release_in_callback()
    return ()
  return _host_callback.HostCallback(
      joined, "a token joined to a jax_effects carrier", spec=spec)


for _kind in ("exported_entry", "plain_entry", "exported_join"):
  _host_specs.register_kind(_kind, _join_host)


def _join(ctx, kind: str, operands, n_out: int, passthrough: int = 0,
          order=EXPORTED_ORDER):
  """A host call from a token (and a carrier) to a token (and a carrier):
  a dependency XLA keeps between the two."""
  where, _, _ = _placement.at_lowering(ctx, [], [])
  side = _host_target.HostSide(_join_host({"kind": kind}), where,
                             passthrough=passthrough, threaded=False)
  operands = [_one(v) for v in operands]
  if order is not EXPORTED_ORDER:   # (a plain jax.jit region: ordered as
    # JAX's own callbacks, once, on the first of several devices)
    avals = [_CARRIER][:n_out - 1]
    sharding = _compat.callback_op_sharding(
        ctx.module_context.axis_context, None, avals)
    results, token = _host_target.emit_ordered(
        ctx, side, operands[0], operands[1:], [_CARRIER][:len(operands) - 1],
        avals, sharding)
    if results:
      _compat.token_on_devices(token, sharding)
    return [token, *results]
  sub = dataclasses.replace(ctx, avals_in=[_TOKEN, _CARRIER][:len(operands)],
                            avals_out=[_TOKEN, _CARRIER][:n_out])
  if (_host_target.once_across_devices(ctx)
      and _host_target.unavailable() is None):
    # Over several devices (automatic partitioning): XLA's partitioner
    # wants a side-effecting call placed, and Shardy keeps no placement on
    # our target (``host_target._own_target``), where JAX's callback targets
    # cannot be exported. A join has no effect of its own (its results are
    # the dependency, which XLA keeps): a call without side effect, which
    # the partitioner replicates, every device joining its own copies.
    return _host_target.emit_own(sub, side, operands, None, side_effect=False)
  return _host_target.emit(sub, side, operands, None)


exported_entry_p = jcore.Primitive("jax_effects_exported_entry")
exported_entry_p.def_effectful_abstract_eval(
    lambda *, order=EXPORTED_ORDER: (_CARRIER, {order}))


def _entry_lowering(ctx, *, order=EXPORTED_ORDER):
  kind = "exported_entry" if order is EXPORTED_ORDER else "plain_entry"
  token, carrier = _join(ctx, kind, [_token_in(ctx, order)], 2, order=order)
  _set_token(ctx, token, order)
  return [carrier]


mlir.register_lowering(exported_entry_p, _entry_lowering, cacheable=False)

exported_exit_p = jcore.Primitive("jax_effects_exported_exit")
exported_exit_p.multiple_results = True
exported_exit_p.def_effectful_abstract_eval(
    lambda carrier, *, order=EXPORTED_ORDER: ([], {order}))


def _exit_lowering(ctx, carrier, *, order=EXPORTED_ORDER):
  (token,) = _join(ctx, "exported_join", [_token_in(ctx, order), carrier], 1,
                   order=order)
  _set_token(ctx, token, order)
  return []


mlir.register_lowering(exported_exit_p, _exit_lowering, cacheable=False)


def _params(order) -> dict:
  """The entry's and exit's params for ``order``: none for the default,
  ``EXPORTED_ORDER`` (its equations as they were)."""
  return {} if order is EXPORTED_ORDER else {"order": order}


def entry(order=EXPORTED_ORDER):
  """The carrier every chain of an exported function (of a region ordered
  by ``order``) starts from."""
  return exported_entry_p.bind(**_params(order))


def exit(token, order=EXPORTED_ORDER) -> None:  # noqa: A001 - the convention's name
  """Ends an exported function (a region ordered by ``order``) after every
  effect behind ``token``."""
  if jnp.ndim(token):
    token = jnp.max(token)
  elif order is EXPORTED_ORDER:
    # (over several devices every device returns the module's token: each
    # takes the max of the per-device carriers, or device 0's carrier,
    # current after an effect that ran once, so no device's token is ready
    # before the module's effects have run; a plain-jit region's exit runs
    # on the first device only)
    token = _threaded.from_first_device_p.bind(token)
  exported_exit_p.bind(token, **_params(order))


exported_call_p = jcore.Primitive("jax_effects_exported_call")
exported_call_p.multiple_results = True


def _call_abstract_eval(token, carrier, *avals, exported):
  del avals
  return [token, carrier, *exported.out_avals]


exported_call_p.def_abstract_eval(_call_abstract_eval)


def _call_lowering(ctx, token, carrier, *args, exported):
  (token,) = _join(ctx, "exported_join", [token, carrier], 1)
  sub = dataclasses.replace(
      ctx, avals_in=ctx.avals_in[2:], avals_out=ctx.avals_out[2:],
      tokens_in=mlir.TokenSet({EXPORTED_ORDER: token}), tokens_out=None)
  results = _compat.call_exported_lowering(sub, *args, exported=exported)
  token, carrier = _join(ctx, "exported_join",
                         [sub.tokens_out.get(EXPORTED_ORDER), carrier], 2,
                         passthrough=1)
  return [token, carrier, *results]


mlir.register_lowering(exported_call_p, _call_lowering, cacheable=False)


def call(token, carrier, args, exported) -> tuple:
  """``(token', carrier', outputs)`` of ``exported`` called on ``args``."""
  # (over several devices every device joins the call: each takes device
  # 0's carrier, current after the caller's effects that ran once)
  carrier = _threaded.from_first_device_p.bind(carrier)
  token, carrier, *outs = exported_call_p.bind(token, carrier, *args, exported=exported)
  return token, carrier, outs

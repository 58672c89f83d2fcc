"""The token calling convention of an exported ``jax_effects.jit`` function.

``jax.export`` of a ``jax_effects.jit`` function (``_dispatch.exporting``)
exports::

    h(*args) -> outputs:
      c = exported_entry()                  # JAX's ordered EXPORTED_ORDER
      outputs, token = g(c, ..., c, *args)  # the threaded computation
      exported_exit(token)                  # JAX's ordered EXPORTED_ORDER

every runtime-token argument of ``g`` replaced by one carrier, ``c``, tied
to the module's ``!stablehlo.token`` by host calls (:func:`_join`).
:data:`exported_call_p` is an ``exp.call`` inside ``jax_effects.jit``,
joined to the chain's carrier (``_pass.exported_rule``). See
``design/host_target.md``, "Exported modules". CPU only.
"""
from __future__ import annotations

import dataclasses

from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir
import jax.numpy as jnp
import numpy as np

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._primitives import first_device as _first_device
from jax_effects._primitives import host_call as _host_call
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_specs as _host_specs
from jax_effects._primitives import host_target as _host_target
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import token_value as _token_value

EXPORTED_ORDER = _effects.EXPORTED_ORDER
_CARRIER = ShapedArray((), np.dtype(_token_value.TOKEN_DTYPE))


def _one(value):
  """The IR value (JAX passes some as a one-element sequence)."""
  if isinstance(value, (tuple, list)):
    (value,) = value
  return value


def _set_token(ctx, token) -> None:
  ctx.set_tokens_out(ctx.tokens_in.update_tokens(
      mlir.TokenSet({EXPORTED_ORDER: token})))


_TOKEN = _compat.abstract_token


def _join_host(spec: dict) -> _host_callback.HostCallback:
  """The host side of a join: data (a kind of ``host_specs``)."""
  kind = spec["kind"]
  if kind == "exported_entry":
    def entry_slot():
      return (np.int32(_errors.plain_jit_slot()),)
    return _host_callback.HostCallback(
        entry_slot, "the entry of an exported jax_effects function",
        (_CARRIER,), spec=spec)
  return _host_callback.HostCallback(
      lambda *carrier: (), "a token joined to a jax_effects carrier",
      spec=spec)


for _kind in ("exported_entry", "exported_join"):
  _host_specs.register_kind(_kind, _join_host)


def _join(ctx, kind: str, operands, n_out: int, passthrough: int = 0):
  """A host call from a token (and a carrier) to a token (and a carrier):
  a dependency XLA keeps between the two."""
  where, _, _ = _placement.at_lowering(ctx, [], [])
  side = _host_call.HostSide(_join_host({"kind": kind}), where,
                             passthrough=passthrough, threaded=False)
  sub = dataclasses.replace(ctx, avals_in=[_TOKEN, _CARRIER][:len(operands)],
                            avals_out=[_TOKEN, _CARRIER][:n_out])
  operands = [_one(v) for v in operands]
  if (_host_call.once_across_devices(ctx)
      and _host_target.unavailable() is None):
    # Over several devices (automatic partitioning): XLA's partitioner
    # wants a side-effecting call placed, and Shardy keeps no placement on
    # our target (``host_call._own_target``), where JAX's callback targets
    # cannot be exported. A join has no effect of its own (its results are
    # the dependency, which XLA keeps): a call without side effect, which
    # the partitioner replicates, every device joining its own copies.
    return _host_target.emit(sub, side, operands, None, side_effect=False)
  return _host_call.emit(sub, side, operands, None)


exported_entry_p = Primitive("jax_effects_exported_entry")
exported_entry_p.def_effectful_abstract_eval(
    lambda: (_CARRIER, {EXPORTED_ORDER}))


def _entry_lowering(ctx):
  token, carrier = _join(ctx, "exported_entry",
                         [ctx.tokens_in.get(EXPORTED_ORDER)], 2)
  _set_token(ctx, token)
  return [carrier]


mlir.register_lowering(exported_entry_p, _entry_lowering)

exported_exit_p = Primitive("jax_effects_exported_exit")
exported_exit_p.multiple_results = True
exported_exit_p.def_effectful_abstract_eval(
    lambda carrier: ([], {EXPORTED_ORDER}))


def _exit_lowering(ctx, carrier):
  (token,) = _join(ctx, "exported_join",
                   [ctx.tokens_in.get(EXPORTED_ORDER), carrier], 1)
  _set_token(ctx, token)
  return []


mlir.register_lowering(exported_exit_p, _exit_lowering)


def entry():
  """The carrier every chain of an exported function starts from."""
  return exported_entry_p.bind()


def exit(token) -> None:  # noqa: A001 - the convention's name
  """Ends an exported function after every effect behind ``token``."""
  # (over several devices every device returns the module's token: each
  # takes the max of the per-device carriers, or device 0's carrier,
  # current after an effect that ran once, so no device's token is ready
  # before the module's effects have run)
  if jnp.ndim(token):
    token = jnp.max(token)
  else:
    token = _first_device.from_first_device_p.bind(token)
  exported_exit_p.bind(token)


exported_call_p = Primitive("jax_effects_exported_call")
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
  carrier = _first_device.from_first_device_p.bind(carrier)
  token, carrier, *outs = exported_call_p.bind(token, carrier, *args,
                                               exported=exported)
  return token, carrier, outs

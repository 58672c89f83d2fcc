"""The token calling convention of an exported ``jax_effects.jit`` function.

``jax.export`` of a ``jax_effects.jit`` function with effects
(``_dispatch.exporting``) exports::

    h(*args) -> outputs:
      c = exported_entry()                  # JAX's ordered EXPORTED_ORDER
      outputs, token = g(c, ..., c, *args)  # the threaded computation
      exported_exit(token)                  # JAX's ordered EXPORTED_ORDER

``g`` is the function's threaded computation (``design/tokens.md``) with
every runtime-token argument replaced by one carrier, ``c``.
:data:`exported_entry_p` and :data:`exported_exit_p` carry JAX's *ordered*
effect ``EXPORTED_ORDER``, so the module's ``main`` takes and returns a
``!stablehlo.token`` for it (as for any ordered effect). Their lowerings
tie that token to the carriers with host calls of jax_effects' FFI target
that take a token and return a carrier or the other way round
(:func:`_join`): a data dependency XLA keeps (an
``optimization_barrier`` on a token and an array is simplified away on
CPU). The exit's token is ready only after every effect has run. The
entry's carrier is the slot of the thread the module runs on when that is
a Python thread (run inline), else 0 (errors of unknown origin,
``design/errors.md``).

:data:`exported_call_p` is an ``exp.call`` inside ``jax_effects.jit``,
after the pass: the chain's carrier is joined to the token JAX's own
lowering of ``call_exported`` passes the module, and the module's returned
token to the chain's carrier, so the exported module's effects run in
program order with the caller's (``_pass.exported_rule``).

CPU only: jax_effects' FFI target exists there (``host_call``).
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
from jax_effects._primitives import host_call as _host_call
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_specs as _host_specs
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import token_value as _token_value

EXPORTED_ORDER = _effects.EXPORTED_ORDER
_CARRIER = ShapedArray((), np.dtype(_token_value.TOKEN_DTYPE))


def _one(value):
  """The IR value of a one-value lowering (JAX passes some, a token among
  them, as a one-element sequence)."""
  if isinstance(value, (tuple, list)):
    (value,) = value
  return value


def _set_token(ctx, token) -> None:
  ctx.set_tokens_out(ctx.tokens_in.update_tokens(
      mlir.TokenSet({EXPORTED_ORDER: token})))


_TOKEN = _compat.abstract_token

# The host sides of the joins: data (kinds of ``host_specs``), the same in
# every process.


def _join_host(spec: dict) -> _host_callback.HostCallback:
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


def _join(ctx, kind: str, operands, avals_in, avals_out, passthrough: int):
  """A host call of jax_effects' target with these operands and results (a
  token among them), doing nothing but pass ``passthrough`` operands on (or
  return the entry's carrier): a dependency XLA keeps between the token and
  the carrier."""
  where, _, _ = _placement.at_lowering(ctx, [], [])
  side = _host_call.HostSide(_join_host({"kind": kind}), where,
                             passthrough=passthrough, threaded=False)
  sub = dataclasses.replace(ctx, avals_in=list(avals_in),
                            avals_out=list(avals_out))
  return _host_call.emit(sub, side, [_one(v) for v in operands], None)


# --- entry and exit of an exported function ----------------------------------------

exported_entry_p = Primitive("jax_effects_exported_entry")
exported_entry_p.def_effectful_abstract_eval(
    lambda: (_CARRIER, {EXPORTED_ORDER}))


def _entry_lowering(ctx):
  token, carrier = _join(ctx, "exported_entry",
                         [ctx.tokens_in.get(EXPORTED_ORDER)], [_TOKEN],
                         [_TOKEN, _CARRIER], passthrough=0)
  _set_token(ctx, token)
  return [carrier]


mlir.register_lowering(exported_entry_p, _entry_lowering)

exported_exit_p = Primitive("jax_effects_exported_exit")
exported_exit_p.multiple_results = True
exported_exit_p.def_effectful_abstract_eval(
    lambda carrier: ([], {EXPORTED_ORDER}))


def _exit_lowering(ctx, carrier):
  (token,) = _join(ctx, "exported_join",
                   [ctx.tokens_in.get(EXPORTED_ORDER), carrier],
                   [_TOKEN, _CARRIER], [_TOKEN], passthrough=0)
  _set_token(ctx, token)
  return []


mlir.register_lowering(exported_exit_p, _exit_lowering)


def entry():
  """The carrier every chain of an exported function starts from."""
  return exported_entry_p.bind()


def exit(token) -> None:  # noqa: A001 - the convention's name
  """Ends an exported function after every effect behind ``token`` (a
  per-device token is reduced first)."""
  if jnp.ndim(token):
    token = jnp.max(token)
  exported_exit_p.bind(token)


# --- an exported function called inside jax_effects.jit ------------------------------

exported_call_p = Primitive("jax_effects_exported_call")
exported_call_p.multiple_results = True


def _call_abstract_eval(token, carrier, *avals, exported):
  del avals
  return [token, carrier, *exported.out_avals]


exported_call_p.def_abstract_eval(_call_abstract_eval)


def _call_lowering(ctx, token, carrier, *args, exported):
  (token,) = _join(ctx, "exported_join", [token, carrier],
                   [_TOKEN, _CARRIER], [_TOKEN], passthrough=0)
  sub = dataclasses.replace(
      ctx, avals_in=ctx.avals_in[2:], avals_out=ctx.avals_out[2:],
      tokens_in=mlir.TokenSet({EXPORTED_ORDER: token}), tokens_out=None)
  results = _compat.call_exported_lowering(sub, *args, exported=exported)
  token, carrier = _join(ctx, "exported_join",
                         [sub.tokens_out.get(EXPORTED_ORDER), carrier],
                         [_TOKEN, _CARRIER], [_TOKEN, _CARRIER],
                         passthrough=1)
  return [token, carrier, *results]


mlir.register_lowering(exported_call_p, _call_lowering, cacheable=False)


def call(token, carrier, args, exported) -> tuple:
  """``(token', carrier', outputs)`` of ``exported`` called on ``args``
  after the chain's earlier effects (``token``, ``carrier``)."""
  token, carrier, *outs = exported_call_p.bind(token, carrier, *args,
                                               exported=exported)
  return token, carrier, outs

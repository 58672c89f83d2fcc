"""The two side-effect primitives, before and after token threading.

``effect_p`` is what user-facing functions (``print``, ``log``, ``callback``)
bind while a program is being traced::

    results = effect_p(*args; host_callback, effect, ordered, result_avals)

It carries a :class:`~jax_effects._effects.TraceEffect` marker so JAX keeps it
through its transformations, and it has the rules those transformations need
(eager impl, JVP, batching, a fallback lowering for plain ``jax.jit``).

``threaded_effect_p`` is what the token-threading pass replaces it with::

    token', carrier', results = threaded_effect_p(token, carrier, *args; ...)

``token`` is a *compiler token* (``!stablehlo.token``): consecutive side
effects of one chain are linked by it, so XLA cannot reorder them. ``carrier``
is a ``uint8`` scalar standing for the same chain where a token cannot go
(across ``cond``/``while``/``scan`` boundaries, and out to the runtime token):
the host callback takes it as an operand and returns it, which is a real data
dependency XLA must respect. It has *no* JAX-level effect, so after the pass
JAX sees an effect-free function and ``jax.jit``'s C++ fast path stays in use.

Both lower to one ``xla_ffi_python_*_callback`` custom call with
``has_side_effect = true``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_effects import _compat
from jax_effects import _effects
from jax_effects import _runtime_tokens


class HostCallback:
  """A host function run by a side-effect primitive.

  ``fn`` takes the flat operands as NumPy arrays and returns a tuple of NumPy
  arrays matching ``result_avals`` (checked here, with a message naming the
  callback). Compared and hashed by identity, as JAX requires of primitive
  parameters.
  """
  __slots__ = ("fn", "description", "result_avals", "__weakref__")

  def __init__(self, fn: Callable[..., Sequence[Any]], description: str,
               result_avals: tuple = ()):
    self.fn = fn
    self.description = description
    self.result_avals = result_avals

  def __repr__(self):
    return f"<host callback {self.description}>"

  def __call__(self, *args):
    results = self.fn(*args)
    avals = self.result_avals
    if not avals:
      return ()
    return check_results(self.description, results, avals)


def check_results(description, results, avals):
  if not isinstance(results, (tuple, list)) or len(results) != len(avals):
    n = len(results) if isinstance(results, (tuple, list)) else "a non-sequence"
    raise TypeError(
        f"{description} returned {n} results; expected {len(avals)} "
        f"(shapes/dtypes {[str(a.str_short()) for a in avals]})")
  out = []
  for i, (r, aval) in enumerate(zip(results, avals)):
    if isinstance(r, (np.ndarray, np.generic, jax.Array)):
      r = np.asarray(r)
    else:  # Python scalars and lists take the declared dtype, like literals
      r = np.asarray(r, dtype=aval.dtype)
    if r.shape != aval.shape or r.dtype != aval.dtype:
      raise TypeError(
          f"{description} result #{i} has shape {r.shape} and dtype {r.dtype}; "
          f"expected shape {aval.shape} and dtype {aval.dtype}")
    out.append(r)
  return tuple(out)


# --- trace-time primitive ------------------------------------------------------

effect_p = Primitive("jax_effects_effect")
effect_p.multiple_results = True


def _effect_abstract_eval(*avals, host_callback, effect, ordered, result_avals):
  del avals, host_callback
  return result_avals, {_effects.TraceEffect(effect if ordered else None)}


effect_p.def_effectful_abstract_eval(_effect_abstract_eval)


def _effect_impl(*args, host_callback, effect, ordered, result_avals):
  """Eager execution: wait for this stream's earlier dispatches, then run."""
  if ordered:
    state = _runtime_tokens.thread_tokens()
    key = _effects.chain_key(_effects.TraceEffect(effect),
                             _effects.get_ordering())
    token = state.runtime.get(key)
    if token is not None:
      token.block_until_ready()
  np_args = [np.asarray(a) for a in args]
  results = host_callback(*np_args)
  return [jnp.asarray(r) for r in results]


effect_p.def_impl(_effect_impl)


def _fallback_lowering(ctx, *args, host_callback, effect, ordered, result_avals):
  """Lowering under plain ``jax.jit`` (no token threading): unordered."""
  del effect, ordered, result_avals
  results, _, _ = mlir.emit_python_callback(
      ctx, _host_function(host_callback, with_carrier=False), None, list(args),
      ctx.avals_in, ctx.avals_out, has_side_effect=True, returns_token=False,
      sharding=_compat.callback_op_sharding(
          ctx.module_context.axis_context, None, ctx.avals_out))
  return results


mlir.register_lowering(effect_p, _fallback_lowering, cacheable=False)


# --- post-pass primitive -----------------------------------------------------

threaded_effect_p = Primitive("jax_effects_threaded_effect")
threaded_effect_p.multiple_results = True


def _threaded_abstract_eval(token, carrier, *avals, host_callback, result_avals):
  del avals, host_callback
  return [token, carrier, *result_avals]


threaded_effect_p.def_abstract_eval(_threaded_abstract_eval)


def _host_function(host_callback: HostCallback, with_carrier: bool):
  """The Python function XLA calls: runs the callback, records its errors."""
  if with_carrier:
    def host(carrier, *args):
      try:
        results = host_callback(*args)
      except BaseException as exc:  # reaches the caller as itself, once
        raise _runtime_tokens.record_error(exc) from None
      return (carrier, *results)
  else:
    def host(*args):
      try:
        return host_callback(*args)
      except BaseException as exc:
        raise _runtime_tokens.record_error(exc) from None
  return host


def _threaded_lowering(ctx, token, carrier, *args, host_callback, result_avals):
  del result_avals
  # emit_python_callback adds the token to avals itself.
  sub_ctx = dataclasses.replace(ctx, avals_in=ctx.avals_in[1:],
                                avals_out=ctx.avals_out[1:])
  results, token, _ = mlir.emit_python_callback(
      sub_ctx, _host_function(host_callback, with_carrier=True), token,
      [carrier, *args], sub_ctx.avals_in, sub_ctx.avals_out,
      has_side_effect=True, returns_token=True,
      sharding=_compat.callback_op_sharding(
          ctx.module_context.axis_context, None, sub_ctx.avals_out))
  return [token, *results]


mlir.register_lowering(threaded_effect_p, _threaded_lowering, cacheable=False)


def bind_effect(host_callback: HostCallback, flat_args: Sequence[Any], *,
                effect: _effects.Effect | None, ordered: bool,
                result_avals: tuple = ()) -> list:
  """Binds ``effect_p``: the one entry point of every user-facing effect."""
  if effect is None:
    effect = _effects.DEFAULT
  elif not isinstance(effect, _effects.Effect):
    raise TypeError(f"effect= must be a jax_effects.Effect or None, got {effect!r}")
  host_callback.result_avals = tuple(result_avals)
  return effect_p.bind(*flat_args, host_callback=host_callback, effect=effect,
                       ordered=bool(ordered), result_avals=tuple(result_avals))

"""Emitting the host call: the side-effecting custom call of one effect.

:func:`emit` (and :func:`emit_ordered` under plain ``jax.jit``, with JAX's
compiler token) emits a :class:`HostSide`'s host function as jax_effects'
own FFI target on CPU (``host_target``; see :func:`_own_target`), else as
one of JAX's callback targets (``design/host_target.md``, "Which custom
call, by platform").

Part in the token calling convention: the call takes the chain's carrier
as an operand and returns it (the data dependency that orders the calls).

Program order across ordered-effect kinds under plain ``jax.jit``. JAX
gives each ordered effect kind its own compiler-token chain: ours
(``PLAIN_JIT_ORDER``), ``jax.debug.*(ordered=True)``'s and
``io_callback(ordered=True)``'s. The chains are mutually unordered, so XLA
may run an effect of one kind before an earlier effect of another, in an
order that changes from one process to the next. So where a function
lowered by plain ``jax.jit`` holds ``PLAIN_JIT_ORDER``, every ordered host
call in it is a *join*: it takes the ``after_all`` of every ordered
chain's current token and hands its returned token to every chain
(:func:`join`, :func:`set_joined`). Our lowering rules do it, and JAX's
own ordered callbacks' rules are wrapped to do it
(:func:`in_program_order`); a region without ``PLAIN_JIT_ORDER`` lowers
exactly as JAX lowers it. A control-flow region carries each chain's
token in and out, so joins at every level give program order through
loops, branches and nested functions. From JAX 0.10 an uncacheable rule
sees every ordered token of its region (``_compat.RULES_SEE_EVERY_TOKEN``);
JAX 0.8/0.9 show a rule its own only, and there the chains stay as JAX
orders them (``design/errors.md``). Inside ``jax_effects.jit`` none of
this applies: JAX's callbacks are adopted into one chain by the token
pass.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir
import numpy as np

from jax_effects import _compat
from jax_effects._core import effects as _effects
from jax_effects._primitives import host_functions as _host_functions
from jax_effects._primitives import host_target as _host_target
from jax_effects._runtime import placement as _placement


# Custom-call targets of JAX's Python callbacks (jaxlib registers them).
FFI_TARGETS = {"cpu": "xla_ffi_python_cpu_callback",
                "cuda": "xla_ffi_python_gpu_callback",
                "rocm": "xla_ffi_python_gpu_callback"}


@dataclasses.dataclass(frozen=True, eq=False)
class HostSide:
  """The host side of one lowered effect: the arguments of
  ``host_functions.host_function`` (compared by identity)."""
  host_callback: Any
  where: _placement.Where
  passthrough: int
  threaded: bool
  entry: bool = False
  operands: int | None = None

  def function(self, avals_out) -> Callable:
    """The function XLA calls; ``avals_out``: passthrough ones first."""
    return _host_functions.host_function(
        self.host_callback, self.where, passthrough=self.passthrough,
        threaded=self.threaded, avals_out=avals_out, entry=self.entry,
        operands=self.operands)


def once_across_devices(ctx) -> bool:
  """Whether ``ctx`` is partitioned automatically over several devices."""
  axis_context = ctx.module_context.axis_context
  return (isinstance(axis_context, _compat.ShardingContext)
          and axis_context.num_devices > 1)


def _own_target(ctx, target) -> bool:
  """Whether the call goes to our target: on CPU, unless the partitioner
  places it (Shardy keeps ``MAXIMAL`` only on JAX's callback targets)."""
  platforms = ctx.module_context.platforms
  return (target is None and len(platforms) == 1 and platforms[0] == "cpu"
          and not once_across_devices(ctx)
          and _host_target.unavailable() is None)


def _refuse_export(ctx, side) -> None:
  """Refuses, in our words, a host call of one of JAX's Python callback
  targets over several devices in a module lowered for ``jax.export``
  (whose ``host_callbacks`` JAX cannot serialize: it would raise its own
  ``NotImplementedError`` after lowering)."""
  if not (_compat.lowering_for_export(ctx) and once_across_devices(ctx)):
    return
  what = getattr(getattr(side, "host_callback", None), "description", None) or "an effect"
  raise NotImplementedError(
      f"jax.export cannot export {what} over several devices as it is "
      f"lowered here (under plain jax.jit, automatic partitioning): its "
      f"host call is one of JAX's Python callback targets, whose "
      f"host_callbacks jax.export cannot serialize. Fix: export a "
      f"jax_effects.jit function, jax.export.export(jax_effects.jit(f), "
      f"disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("
      f"jax_effects.HOST_TARGET)]), whose effects over several devices "
      f"export")


def emit(ctx, side, operands, sharding, target=None):
  """The results of the custom call of ``side`` (a :class:`HostSide`, or a
  host function for JAX's ``target``): off our target, what
  ``emit_python_callback`` emits without its per-call wrapper (costlier
  than the callback) and token (the carrier orders the call)."""
  if isinstance(side, HostSide) and _own_target(ctx, target):
    return _host_target.emit(ctx, side, operands, sharding)
  _refuse_export(ctx, side)
  if isinstance(side, HostSide):
    side = side.function(ctx.avals_out)
  if target is None:
    target = FFI_TARGETS[ctx.module_context.platforms[0]]
  ctx.module_context.add_host_callback(side)
  index = np.uint64(len(ctx.module_context.host_callbacks) - 1)
  return _host_target.custom_call(ctx, target, operands, sharding, index=index)


def emit_ordered(ctx, side: HostSide, token, operands, avals_in, avals_out,
                 sharding):
  """``(results, token')`` of an effect under plain ``jax.jit``, with JAX's
  compiler ``token`` (None: unordered) first, as off CPU."""
  sub_ctx = dataclasses.replace(ctx, avals_in=list(avals_in), avals_out=list(avals_out))
  if not _own_target(ctx, None):
    _refuse_export(ctx, side)
    results, token, _ = mlir.emit_python_callback(
        sub_ctx, side.function(avals_out), token, operands, avals_in,
        avals_out, has_side_effect=True, returns_token=token is not None,
        sharding=sharding)
    return results, token
  if token is None:
    return _host_target.emit(sub_ctx, side, operands, sharding), None
  token_aval = _compat.abstract_token
  sub_ctx = dataclasses.replace(ctx, avals_in=[token_aval, *avals_in],
                                avals_out=[token_aval, *avals_out])
  token, *results = _host_target.emit(
      sub_ctx, side, [token, *operands],
      _compat.with_token_sharding(sharding, bool(avals_out)))
  return results, token


def gathered(ctx, args, avals) -> list:
  """The operands of a callback that runs once, annotated replicated (no
  "involuntary full rematerialization" warning) if partitioned."""
  if not once_across_devices(ctx):
    return list(args)
  return [_compat.replicated(ctx, x, aval) if aval.shape else x
          for x, aval in zip(args, avals)]


# --- program order across ordered-effect kinds, plain jax.jit ----------------

def _distinct(values):
  out = []
  for value in values:
    if not any(value == seen for seen in out):
      out.append(value)
  return out


def join(ctx, own):
  """The token an ordered host call of effect ``own`` takes: its chain's
  token, joined with every other ordered chain's when ``ctx`` lowers for
  plain ``jax.jit`` (``PLAIN_JIT_ORDER`` among its tokens)."""
  tokens = ctx.tokens_in
  if not _joins(ctx):
    return tokens.get(own)
  distinct = _distinct(tokens.get(e) for e in tokens.effects())
  return distinct[0] if len(distinct) == 1 else hlo.after_all(distinct)


def _joins(ctx) -> bool:
  return (_compat.RULES_SEE_EVERY_TOKEN
          and _effects.PLAIN_JIT_ORDER in ctx.tokens_in.effects())


def set_joined(ctx, own, token) -> None:
  """Sets ``ctx``'s output tokens: ``token`` for ``own`` and, where
  :func:`join` joined the chains, every other chain after ``token`` too
  (each by its own ``after_all``: a computation's output tokens must be
  distinct values)."""
  tokens = ctx.tokens_in
  if not _joins(ctx):
    ctx.set_tokens_out(tokens.update_tokens(mlir.TokenSet({own: token})))
    return
  ctx.set_tokens_out(mlir.TokenSet({
      e: token if e == own else hlo.after_all([token, tokens.get(e)])
      for e in tokens.effects()}))


def in_program_order(rule):
  """JAX's lowering ``rule`` of an ordered callback primitive, made a join
  (the module docstring) where the region holds ``PLAIN_JIT_ORDER``."""

  def rule_in_program_order(ctx, *args, **params):
    if not (_compat.jax_callback_is_ordered(params) and _joins(ctx)):
      return rule(ctx, *args, **params)
    tokens = ctx.tokens_in
    joined = join(ctx, _effects.PLAIN_JIT_ORDER)
    inner = ctx.replace(
        tokens_in=mlir.TokenSet({e: joined for e in tokens.effects()}),
        tokens_out=None)
    results = rule(inner, *args, **params)
    # (the one chain whose token the rule replaced is its own)
    own, token = next(
        ((e, t) for e in tokens.effects()
         if (t := inner.tokens_out.get(e)) != joined),
        (_effects.PLAIN_JIT_ORDER, joined))
    set_joined(ctx, own, token)
    return results

  rule_in_program_order.jax_effects_wraps = rule
  return rule_in_program_order


if _compat.RULES_SEE_EVERY_TOKEN:
  _compat.wrap_jax_callback_lowerings(in_program_order)

"""Program order across ordered-effect kinds under plain ``jax.jit``.

JAX gives each ordered effect kind its own compiler-token chain: ours
(``PLAIN_JIT_ORDER``), ``jax.debug.*(ordered=True)``'s and
``io_callback(ordered=True)``'s. The chains are mutually unordered, so XLA
may run an effect of one kind before an earlier effect of another, in an
order that changes from one process to the next.

Part in the token calling convention: where a function lowered by plain
``jax.jit`` holds ``PLAIN_JIT_ORDER``, every ordered host call in it is a
*join*: it takes the ``after_all`` of every ordered chain's current token
and hands its returned token to every chain (:func:`join`,
:func:`set_joined`). Our lowering rules do it, and JAX's own ordered
callbacks' rules are wrapped to do it (:func:`in_program_order`); a region
without ``PLAIN_JIT_ORDER`` lowers exactly as JAX lowers it. A control-flow
region carries each chain's token in and out, so joins at every level give
program order through loops, branches and nested functions.

From JAX 0.10 an uncacheable rule sees every ordered token of its region
(``_compat.RULES_SEE_EVERY_TOKEN``); JAX 0.8/0.9 show a rule its own only,
and there the chains stay as JAX orders them (``design/errors.md``).
Inside ``jax_effects.jit`` none of this applies: JAX's callbacks are adopted
into one chain by the token pass.
"""
from __future__ import annotations

from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir

from jax_effects import _compat
from jax_effects._core import effects as _effects


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

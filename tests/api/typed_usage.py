"""A user's module using every public name of ``jax_effects``.

Never imported by the tests: ``tests/api/test_typing.py`` runs
``mypy --strict`` on it and expects no error, so the package's annotations
(``py.typed``) give a user precise types. ``assert_type`` pins the types a
user relies on.
"""
from __future__ import annotations

import io
import logging
from typing import Any

import jax
import jax.numpy as jnp
from typing_extensions import assert_type

import jax_effects as je

METRICS = je.Effect("metrics", ordered=False)
assert_type(METRICS, je.Effect)
assert_type(je.DEFAULT, je.Effect)
assert_type(je.GLOBAL, je.Effect)


@je.jit
def step(x: jax.Array, scale: float = 2.0) -> jax.Array:
  je.print("x = {}", x, effect=METRICS)
  je.log("sum = {}", x.sum(), level=logging.INFO, logger="train",
         extra={"run": 1})
  doubled: jax.Array = je.callback(
      lambda v: v * 2, x, x)   # (an array gives the result shape, dtype)
  with je.progress(3, desc="steps", every=1, file=io.StringIO(),
                   per_element=None, mininterval=0) as bar:
    def body(c: jax.Array, _: None) -> tuple[jax.Array, None]:
      bar.update()
      bar.update(n=2)
      return c + 1, None
    x, _ = jax.lax.scan(body, x, None, length=3)
  return x * scale + doubled


@je.jit
def batched_loop(xs: jax.Array) -> jax.Array:
  def body(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    je.print("x = {}", x)
    return c + x, None
  with je.batched(k=16, max_bytes=1 << 16):
    total, _ = jax.lax.scan(body, jnp.zeros(()), xs)
  return total


@je.jit(static_argnums=1)
def power(x: jax.Array, n: int) -> jax.Array:
  return x ** n


def where() -> str:
  p = je.placement()
  assert_type(p, je.Placement | None)
  if p is None:
    return "eager"
  shard: int | tuple[int, ...] | None = p.shard_index
  return f"{p.prefix()}{p.device_id}{p.process_index}{shard}{p.per_device}"


def main() -> None:
  out = step(jnp.arange(3.0))
  assert_type(out, jax.Array)
  assert_type(step(jnp.arange(3.0), 3.0), jax.Array)
  assert_type(power(jnp.ones(2), 3), jax.Array)
  assert_type(batched_loop(jnp.arange(3.0)), jax.Array)
  je.effects_barrier()
  je.effects_barrier(all_threads=True)
  tokens = je.runtime_tokens()
  assert_type(tokens, je.RuntimeTokens)
  first: jax.Array = tokens.effects[je.DEFAULT]
  devices: dict[Any, jax.Array] = dict(tokens.devices)
  assert_type(je.get_ordering(), str)
  with je.ordering("global"):
    step(jnp.arange(3.0))
  je.set_ordering("per_effect")
  with je.deterministic():
    step(jnp.arange(3.0))
  lowered = step.lower(jnp.arange(3.0))
  text: str = lowered.as_text()
  named = je.register_callback("typed_usage.noted", lambda v: None)
  assert named is not None
  assert_type(named, je.NamedCallback)
  name: str = named.name
  je.callback(named, None, jnp.arange(3.0))
  target: str = je.HOST_TARGET
  print(name, target)
  print(first, devices, text, where())


if __name__ == "__main__":
  main()

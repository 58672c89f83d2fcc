"""Under plain ``jax.jit``, every ordered host call follows every earlier
one, of whatever kind (``_primitives/host_target.py``; ``design/errors.md``,
"Plain ``jax.jit``").

Read from the lowered program, not from a run: XLA orders host calls only by
their tokens, and picks among unordered ones in an order that changes from
one process to the next (a run's order is checked across processes by
``tests/frontends/test_plain_jit_order.py``). Here each host call's input
token must come, through ``after_all``\\ s, from the output token of every
host call before it in program order, and the function's returned tokens
from the last one's: then no run can reorder them.
"""
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import io_callback

import jax_effects as je
from jax_effects import _compat

pytestmark = pytest.mark.skipif(
    not _compat.RULES_SEE_EVERY_TOKEN,
    reason="JAX 0.8/0.9 show a lowering rule its own token only: the kinds "
           "stay mutually unordered there (design/errors.md)")

_ASSIGN = re.compile(r"^\s*(%[\w.]+)(?::\d+)? = ([\w.]+)(.*)$")
_VALUE = re.compile(r"%[\w.]+")


def _host_calls_and_returns(fn, *args):
  """``(calls, returned)`` of ``jax.jit(fn)``'s lowered main function
  (straight-line code): for each side-effecting ``custom_call`` in program
  order, the indices of the earlier calls its operands come from; and those
  the returned values come from."""
  text = jax.jit(fn).lower(*args).as_text()
  main = text[text.index("func.func public @main"):]
  main = main[:main.index("\n  }")]
  came_from = {}   # value -> indices of the host calls it comes from
  calls, returned = [], set()
  for line in main.splitlines()[1:]:
    code = line.split(" : ", 1)[0].split(" {", 1)[0]
    if line.strip().startswith("return "):
      for v in _VALUE.findall(code):
        returned |= came_from.get(v, set())
      continue
    match = _ASSIGN.match(code)
    assert match, f"not straight-line code: {line.strip()[:80]}"
    name, op, rest = match.groups()
    sources = set()
    for v in _VALUE.findall(rest):
      sources |= came_from.get(v.split("#")[0], set())
    if op == "stablehlo.custom_call" and "has_side_effect = true" in line:
      calls.append(sources)
      sources = sources | {len(calls) - 1}
    came_from[name] = sources
  return calls, returned


def _assert_in_program_order(fn, n_calls):
  calls, returned = _host_calls_and_returns(fn, jnp.float32(1))
  assert len(calls) == n_calls
  for i, before in enumerate(calls):
    assert before == set(range(i)), (
        f"host call {i} does not follow host calls "
        f"{sorted(set(range(i)) - before)}")
  assert returned == set(range(n_calls))


def test_a_jax_ordered_call_after_ours_follows_it():
  # jax.debug.print takes its own kind's token only: ours must have advanced
  # every chain (set_joined). Mutation this catches: our call advancing
  # only its own chain.
  def f(x):
    je.print("ours")
    jax.debug.print("theirs", ordered=True)
    je.callback(lambda v: None, None, x)
    io_callback(lambda v: None, None, x, ordered=True)
    return x

  _assert_in_program_order(f, 4)


def test_a_wrapped_jax_callback_hands_its_own_token_on():
  # JAX's ordered callbacks' rules are wrapped to join the chains
  # (in_program_order); what follows must come from the token the callback
  # returned. Mutation this catches: the wrapped rule continuing every chain
  # from the joined token it gave the callback (the callback then follows
  # the earlier calls, but nothing follows it).
  def f(x):
    jax.debug.callback(lambda v: None, x, ordered=True)
    je.print("ours")
    io_callback(lambda v: None, None, x, ordered=True)
    je.log("ours")
    jax.debug.callback(lambda v: None, x, ordered=True)
    return x

  _assert_in_program_order(f, 5)


def test_every_kind_in_turn_in_program_order():
  def f(x):
    je.callback(lambda v: None, None, x)
    jax.debug.callback(lambda v: None, x, ordered=True)
    je.print("3")
    io_callback(lambda v: None, None, x, ordered=True)
    je.log("5")
    jax.debug.print("6", ordered=True)
    je.callback(lambda v: None, None, x)
    return x + 1

  _assert_in_program_order(f, 7)

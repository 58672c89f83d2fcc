"""Argument trees as data (``_primitives/host_specs``): what a host side
rebuilds from a spec is the pytree that was traced, and a warm call of a
``print``'s or ``log``'s host side does not read the tree's structure again
(``tree_decoder``: read once, when the host side is built)."""
import gc
import itertools
import sys

import jax
import pytest

from jax_effects._primitives import host_specs

TREES = [
    ((1, 2.0), {}),
    ((1, "a", 3), {"b": 4, "a": 5}),
    ((1, (2, 3)), {}),
    ((None, [1, 2]), {"z": None}),
    ((), {}),
    ((True,), {"k": [1, {"x": 2}]}),
    (1, 2),
    [1, 2],
    {"a": 1},
    7,
]


def _cases():
  for tree in TREES:
    n = len(jax.tree_util.tree_leaves(tree))
    for r in range(n + 1):
      for ops in itertools.combinations(range(n), r):
        yield tree, set(ops)


@pytest.mark.parametrize("tree,ops", list(_cases()))
def test_decoder_rebuilds_the_tree(tree, ops):
  data = host_specs.encode_tree(tree, ops)
  values = [object() for _ in ops]
  leaves = jax.tree_util.tree_leaves(tree)
  expected = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(tree),
      [values[sorted(ops).index(i)] if i in ops else leaf
       for i, leaf in enumerate(leaves)])
  got = host_specs.tree_decoder(data)(values)
  assert got == expected and repr(got) == repr(expected)
  assert got == host_specs.decode_tree(data, values)
  # (dicts keep the order of the encoded keys, JAX's sorted order)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(
      tree)


def test_a_warm_decode_of_plain_arguments_is_one_call():
  # print("{} {x} {}", a, 1.5, x=b): its (args, kwargs) with two operands
  data = host_specs.encode_tree((("A", 1.5), {"x": "B"}), {0, 2})
  decode = host_specs.tree_decoder(data)
  calls = []

  def profile(frame, event, arg):
    if event == "call":
      calls.append(frame.f_code.co_name)

  # (no collection inside: JAX's gc callback, _xla_gc_callback, would be
  # recorded as a call, as it was once in tox's jax08)
  collecting = gc.isenabled()
  gc.disable()
  sys.setprofile(profile)
  try:
    got = decode(["a", "b"])
  finally:
    sys.setprofile(None)
    if collecting:
      gc.enable()
  assert got == (("a", 1.5), {"x": "b"})
  assert calls == ["decode"]

"""Clean tracebacks: the internal ``NeedsTokens`` retry never shows
(``design/architecture.md``, the ``_dispatch/function`` entry, state
``first``).

A function's first call learns which runtime tokens it needs from a trace
that raises ``NeedsTokens``, then calls again. That retry must not run inside
the exception handler, or every exception of the retried call (an error the
user sees, an exception the user's own callback raises and handles) gets
``NeedsTokens`` as ``__context__`` ("During handling of the above
exception, another exception occurred").
"""
import os
import textwrap
import traceback

import jax
import jax.numpy as jnp
import pytest

import jax_effects as je


def _chain(exc):
  """Every exception reachable through __context__ / __cause__."""
  seen = []
  stack = [exc]
  while stack:
    e = stack.pop()
    if e is None or any(e is s for s in seen):
      continue
    seen.append(e)
    stack += [e.__context__, e.__cause__]
  return seen


def test_exception_handled_in_a_callback_has_no_internal_context():
  contexts = []

  def host(x):
    try:
      raise KeyError("handled inside the callback")
    except KeyError as e:
      contexts.append(e.__context__)
    return x

  @je.jit
  def f(x):
    return je.callback(host, jax.ShapeDtypeStruct((), jnp.float32), x)

  f(1.0)   # the first call: learns its tokens, then runs
  f(2.0)
  je.effects_barrier()
  assert contexts == [None, None]


def test_first_call_error_shows_no_needs_tokens():
  def host(x):
    raise ValueError("boom from the callback")

  @je.jit
  def f(x):
    je.callback(host, jax.ShapeDtypeStruct((), jnp.float32), x)
    return x + 1

  with pytest.raises(ValueError, match="boom from the callback") as info:
    f(1.0)
    je.effects_barrier()
  text = "".join(traceback.format_exception(info.value))
  assert "NeedsTokens" not in text
  assert "retrace with runtime tokens" not in text
  assert not any(type(e).__name__ == "NeedsTokens" for e in _chain(info.value))


def test_first_call_trace_error_shows_no_needs_tokens():
  # An error raised while tracing the threaded call of a first call (here by
  # jax.jit itself: out_shardings of the wrong structure)
  @je.jit
  def f(x):
    je.print("x = {}", x)
    return x

  g = je.jit(f.__wrapped__, out_shardings=(None, None))
  with pytest.raises(Exception) as info:
    g(jnp.ones(2))
  text = "".join(traceback.format_exception(info.value))
  assert "NeedsTokens" not in text


def test_learning_a_new_chain_later_shows_no_needs_tokens():
  # A later signature needs a chain the function did not use before: that
  # call retries too (in the threaded path's loop).
  contexts = []
  other = je.Effect("tracebacks-other")

  def host(x):
    try:
      raise KeyError("handled")
    except KeyError as e:
      contexts.append(e.__context__)

  def failing(x):
    raise ValueError("boom on the new chain")

  @je.jit(static_argnums=1)
  def f(x, mode):
    je.print("x = {}", x)
    if mode == 1:
      je.callback(host, None, x, effect=other)
    if mode == 2:
      je.callback(failing, None, x, effect=je.Effect("tracebacks-third"))
    return x

  f(1.0, 0)
  f(1.0, 1)
  je.effects_barrier()
  assert contexts == [None]
  with pytest.raises(ValueError, match="boom on the new chain") as info:
    f(1.0, 2)
    je.effects_barrier()
  assert not any(type(e).__name__ == "NeedsTokens" for e in _chain(info.value))
  assert "NeedsTokens" not in "".join(traceback.format_exception(info.value))


# --- a user error's traceback, filtered as jax.jit's ---------------------------

_PACKAGE = os.path.dirname(je.__file__)


def _ours(exc):
  """The frames of jax_effects' package in ``exc``'s traceback."""
  return [(os.path.basename(f.filename), f.name)
          for f in traceback.extract_tb(exc.__traceback__)
          if f.filename.startswith(_PACKAGE + os.sep)]


def _shape_error(x):
  je.print("x={}", x)
  if x.shape[0] == 3:
    raise ValueError("the user's error")
  return x * 2


@pytest.mark.parametrize("how", ["first call", "retrace", "trace", "lower",
                                 "eval_shape"])
def test_user_error_traceback_shows_no_frame_of_ours(how, effects_capture):
  # As jax.jit's filtered traceback shows none of JAX's
  # (JAX_TRACEBACK_FILTERING=off shows them).
  f = je.jit(_shape_error)
  with pytest.raises(ValueError, match="the user's error") as info:
    if how == "first call":
      f(jnp.ones(3))
    elif how == "retrace":   # a later call's new shape (the fast hook)
      for _ in range(3):
        f(jnp.ones(2))
      f(jnp.ones(3))
    else:
      getattr(f, how)(jnp.ones(3))
  # (The Python hook's own frame stays where it ran the call: it is not an
  # api_boundary, whose cost would be per call; the compiled hook has none.)
  assert [f for f in _ours(info.value)
          if f != ("call_path.py", "call")] == []
  if how != "retrace":
    assert _ours(info.value) == []
  names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
  assert "_shape_error" in names
  je.effects_barrier()


def test_callback_error_traceback_shows_no_frame_of_ours():
  def host(v):
    raise KeyError("in the callback")

  f = je.jit(lambda x: (je.callback(host, None, x), x)[1])
  for i in range(3):   # the first call, the general path, the fast hook
    with pytest.raises(KeyError) as info:
      f(jnp.float32(i))
      je.effects_barrier()
    assert _ours(info.value) == [], i
    # The user's own object, unchanged but for its traceback: no note.
    assert getattr(info.value, "__notes__", []) == [], i
    assert "host" in [f.name for f in
                      traceback.extract_tb(info.value.__traceback__)]


def test_unfiltered_traceback_keeps_our_frames():
  # (one fresh process, each mode in turn: JAX reads the setting when it
  # filters a traceback)
  import subprocess, sys
  code = textwrap.dedent("""
      import os, traceback, jax, jax.numpy as jnp, jax_effects as je
      def f(x):
        raise ValueError("boom")
      for mode in ("off", "auto"):
        jax.config.update("jax_traceback_filtering", mode)
        try:
          je.jit(f)(jnp.ones(3))
        except ValueError as e:
          pkg = os.path.dirname(je.__file__)
          print(mode, sum(s.filename.startswith(pkg)
                          for s in traceback.extract_tb(e.__traceback__)))
      """)
  proc = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True,
      timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  counts = dict(line.split() for line in proc.stdout.splitlines())
  assert sorted(counts) == ["auto", "off"], proc.stdout
  for mode, some in (("off", True), ("auto", False)):
    assert (int(counts[mode]) > 0) is some, (mode, proc.stdout)

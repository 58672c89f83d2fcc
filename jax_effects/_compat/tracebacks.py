"""Traceback filtering as ``jax.jit``'s, for errors leaving jax_effects.

Part in the token calling convention: none (``jax_effects._compat``).
"""
from __future__ import annotations

import functools
import traceback as _traceback
import types as _types

# Traceback filtering as ``jax.jit``'s (``jax._src.traceback_util``, the same
# on JAX 0.8-0.12): an exception leaving the outermost ``api_boundary`` has
# the frames of the registered paths removed (``JAX_TRACEBACK_FILTERING``).
from jax._src import traceback_util as _traceback_util


def _filtered(tb):
  """``tb`` without the frames of the excluded paths: a prefix test per
  frame (JAX's ``filter_traceback`` costs milliseconds per error)."""
  prefixes = tuple(_traceback_util._exclude_paths)
  out = None
  for frame, lineno in reversed(list(_traceback.walk_tb(tb))):
    if not frame.f_code.co_filename.startswith(prefixes):
      out = _types.TracebackType(out, frame, frame.f_lasti, lineno)
  return out


def api_boundary(fun):
  """As JAX's ``traceback_util.api_boundary`` (``JAX_TRACEBACK_FILTERING``
  honoured), but adding no note: a callback's error reaches the caller as
  the user's own object, unchanged but for its traceback."""
  @functools.wraps(fun)
  def boundary(*args, **kwargs):
    __tracebackhide__ = True  # noqa: F841 - read by IPython
    try:
      return fun(*args, **kwargs)
    except Exception as e:
      mode = _traceback_util._filtering_mode()
      if mode == "off":
        raise
      if mode == "tracebackhide":
        _traceback_util._add_tracebackhide_to_hidden_frames(e.__traceback__)
        raise
      e.with_traceback(_filtered(e.__traceback__))
      raise
  return boundary


def exclude_from_tracebacks(path: str) -> None:
  """Leaves the frames of files under ``path`` out of filtered tracebacks."""
  _traceback_util.register_exclusion(path)


# The user's line that bound an equation, from its ``source_info``: JAX's
# ``source_info_util.user_frame`` (its own files and the registered paths
# left out), the same on JAX 0.8-0.12; no public form (``jax.extend``'s
# ``summarize`` gives only its text).
from jax._src import source_info_util as _source_info_util  # noqa: E402


def user_line(source_info) -> tuple[str, int] | None:
  """``(file name, line)`` of the user's code that bound the equation whose
  ``source_info`` this is, or None where unknown."""
  frame = _source_info_util.user_frame(getattr(source_info, "traceback", None))
  return None if frame is None else (frame.file_name, frame.start_line)

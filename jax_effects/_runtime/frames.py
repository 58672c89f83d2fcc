"""Is this frame ours? Marked code objects, found by one walk up the stack.

*Where does the running host callback run* (``placement``) and *what does
a SIGINT interrupt* (``interrupts``) are answered from the thread's stack:
code objects of jax_effects' functions are marked with a *kind*
(:func:`mark`) and :func:`innermost` walks ``f_back`` to the innermost
marked one. Not a flag set per call (as in trio's ``_core/_ki.py``): a
signal lands between any two bytecodes, and a host function runs per
effect. A frame called from C below one of ours has ours as its
``f_back``, so :func:`innermost` also says whether the marked frame *is*
the frame asked about.

Part in the token calling convention: none.
"""
from __future__ import annotations

import sys
from types import CodeType, FrameType

#: A host function XLA calls for an effect (its frame holds its placement).
HOST = "host"
#: A dispatching frame of the call path, from the launch to the storing of
#: the returned token.
DISPATCH = "dispatch"
#: Python called by the FFI entry around a host function (a site's
#: runner): an interrupt raised there would fail the computation in XLA.
ENTRY = "entry"

_kinds: dict[CodeType, str] = {}


def mark(code: CodeType, kind: str) -> None:
  """Marks ``code`` (a function's ``__code__``) as jax_effects' ``kind``."""
  _kinds[code] = kind


def innermost(frame: FrameType | None, kind: str | None = None):
  """``(marked_frame, its_kind, is_top)`` for the innermost frame from
  ``frame`` up that is marked (of ``kind``, if given); ``(None, None,
  False)`` if there is none. ``is_top``: the marked frame is ``frame``
  itself (nothing runs below it)."""
  top = frame
  kinds = _kinds
  while frame is not None:
    found = kinds.get(frame.f_code)
    if found is not None and (kind is None or found == kind):
      return frame, found, frame is top
    frame = frame.f_back
  return None, None, False


def local_of_innermost(kind: str, name: str):
  """The local ``name`` of the innermost ``kind`` frame on the calling
  thread's stack (None: none, or it has no such local)."""
  frame, _, _ = innermost(sys._getframe(1), kind)
  return None if frame is None else frame.f_locals.get(name)

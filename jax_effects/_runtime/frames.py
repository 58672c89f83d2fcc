"""Is this frame ours? Marked code objects, found by one walk up the stack.

Two questions are answered from a thread's stack, never from state set per
call (which would cost every call): *where does the running host callback
run* (``placement``: the innermost host function's frame holds it in a
local), and *what does a SIGINT interrupt* (``interrupts``). Both mark the
code objects of jax_effects' own functions with a *kind* (:func:`mark`) and
walk ``f_back`` from a frame to the innermost marked one (:func:`innermost`).

What does not work, and why (as in trio's ``_core/_ki.py``):

* A flag set on entry and cleared on exit of the protected region: a
  signal handler runs between any two bytecodes, also right between the
  call that returns and the store of the flag; and every call would pay
  for two stores (a host function runs per effect, millions of times).
* Asking the interpreter whether C code is running: a signal handler runs
  only when the main thread executes Python bytecode again, so when it
  runs, the innermost frame is always Python code: ours, JAX's, or the
  user's. The stack above it crosses C (XLA calling a host callback, JAX's
  C++ dispatch calling a trace) without a trace in ``f_back``: a frame
  called from C below one of ours has ours as its ``f_back``. So "the
  innermost marked frame" alone cannot tell our own dispatch frame from a
  foreign callback XLA runs below it; :func:`innermost` also says whether
  the marked frame *is* the frame asked about.

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
#: The entry of a C callback (the FFI handler XLA calls): an exception
#: raised in it before its ``try`` (a signal handler runs at its first
#: bytecode) is printed and dropped by ctypes, and the call is taken as done.
ENTRY = "entry"

_kinds: dict[CodeType, str] = {}


def mark(code: CodeType, kind: str) -> None:
  """Marks ``code`` (a function's ``__code__``) as jax_effects' ``kind``."""
  _kinds[code] = kind


def kind_of(code: CodeType) -> str | None:
  return _kinds.get(code)


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
  thread's stack (None: none, or it has no such local). A rare query (a
  placement, a carrier), never made per run."""
  frame, _, _ = innermost(sys._getframe(1), kind)
  return None if frame is None else frame.f_locals.get(name)

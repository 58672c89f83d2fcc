"""Is this frame ours (``_runtime/frames``): the one walk up the stack that
placement and interrupts both use; the innermost marked frame decides, and
whether it is the frame asked about (nothing of anyone else's below it).
"""
import sys

from jax_effects._runtime import placement as frames


def host(inner=None):
  if inner is not None:
    return inner()
  return sys._getframe()


def dispatch(inner=None):
  if inner is not None:
    return inner()
  return sys._getframe()


frames.mark(host.__code__, frames.HOST)
frames.mark(dispatch.__code__, frames.DISPATCH)


def test_innermost_marked_frame_decides_and_says_whether_it_is_the_top():
  def foreign():   # (a callback of someone else's, called below ours)
    return sys._getframe()

  top = dispatch()
  assert frames.innermost(top) == (top, frames.DISPATCH, True)
  below = dispatch(foreign)
  found, kind, is_top = frames.innermost(below)
  assert kind == frames.DISPATCH and not is_top
  # a host function called below a dispatching frame: the host function
  nested = dispatch(lambda: host(foreign))
  found, kind, is_top = frames.innermost(nested)
  assert kind == frames.HOST and not is_top
  # asked for one kind only
  found, kind, _ = frames.innermost(nested, frames.DISPATCH)
  assert kind == frames.DISPATCH
  assert frames.innermost(foreign()) == (None, None, False)


def test_local_of_the_innermost_host_frame():
  def host_function(running="placed here"):
    return frames.local_of_innermost(frames.HOST, "running")
  frames.mark(host_function.__code__, frames.HOST)
  assert host_function() == "placed here"
  assert frames.local_of_innermost(frames.HOST, "running") is None

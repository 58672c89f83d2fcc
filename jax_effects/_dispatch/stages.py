"""JAX's stages of a ``jax_effects.jit`` function, minus the token.

``PjitFunction.trace``/``lower`` return :class:`Traced`/:class:`Lowered` and
``Lowered.compile`` a :class:`Compiled`: each wraps JAX's stage of whichever
``jax.jit`` object the call would use (the pure one, or the threaded
``g(*tokens, *args, **kwargs) -> (outputs, token)``, see ``function``) and
shows the user's arguments and outputs (``args_info``, ``in_tree``,
``out_info``, ``input_shardings``, ...), never the token argument or result;
cost and memory analysis and the text are those of the threaded computation.
``Compiled.__call__`` runs the call path (``call_path.dispatch``) with the
tokens of the chains it was compiled for. Exporting a function with effects
is refused: host callbacks cannot be serialized.

Each is an instance of JAX's class (``jax.stages.Traced``, ``Lowered``,
``Compiled``: libraries check for them) without being built as one: it
defines or forwards to JAX's stage every public name of JAX's class
(:func:`_forwarding`), so nothing of JAX's class runs on it.
"""
from __future__ import annotations

import jax
from jax import tree_util

from jax_effects._core import effects as _effects
from jax_effects._dispatch import bodies as _bodies
from jax_effects._dispatch import call_path as _call_path
from jax_effects._dispatch import core as _core
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import launch_lock as _launch_lock
from jax_effects._runtime import threads as _threads


def _export_error(function) -> Exception:
  name = getattr(function._fun, "__qualname__", repr(function._fun))
  return ValueError(
      f"jax.export cannot export the jax_effects.jit function '{name}': it "
      f"has side effects (jax_effects print/log/callback, or JAX callbacks "
      f"such as jax.debug.print that jax_effects.jit adopts), which run as "
      f"host (Python) callbacks, and host callbacks cannot be serialized. "
      f"Export "
      f"the pure part instead: jax.export.export(jax.jit(g)) of a function g "
      f"without jax_effects effects, and run the effects around the exported "
      f"call.")


class _Stage:
  """What a JAX stage shows about inputs and outputs, minus our token.

  ``_inner`` is JAX's stage (``Traced``, ``Lowered`` or ``Compiled``) of the
  pure ``jax.jit`` (``_mode`` None: nothing to strip) or of the threaded
  ``g(*tokens, *args, **kwargs) -> (outputs, token)``. Attributes not defined
  here are JAX's.
  """

  def _strip_in(self, tree):
    if self._mode is None:
      return tree
    args, kwargs = tree
    return tuple(args[len(self._keys):]), kwargs

  def _strip_out(self, tree):
    return tree if self._mode is None else tree[0]

  @property
  def args_info(self):
    return self._strip_in(self._inner.args_info)

  @property
  def in_tree(self):
    return tree_util.tree_structure(self.args_info)

  @property
  def in_avals(self):
    return self._strip_in(self._inner.in_avals)

  @property
  def donate_argnums(self):
    n = 0 if self._mode is None else len(self._keys)
    return tuple(i - n for i in self._inner.donate_argnums if i >= n)

  @property
  def out_info(self):
    return self._strip_out(self._inner.out_info)

  @property
  def out_tree(self):
    tree = self._inner.out_tree
    return tree if self._mode is None else tree.children()[0]

  def __getattr__(self, name):
    if name.startswith("__") or name in ("_inner", "_mode", "_keys"):
      raise AttributeError(name)
    return getattr(self._inner, name)


def _forwarding(cls):
  """Forwards to ``_inner`` every public name of ``cls``'s JAX base class
  that ``cls`` does not define (JAX's methods would read slots that are not
  set here)."""
  jax_base = next(b for b in cls.__mro__ if b.__module__.startswith("jax."))
  for name in dir(jax_base):
    if name.startswith("_") or any(name in vars(b) for b in cls.__mro__
                                   if b is not jax_base
                                   and not b.__module__.startswith("jax.")
                                   and b is not object):
      continue
    setattr(cls, name, property(
        lambda self, name=name: getattr(self._inner, name)))
  return cls


@_forwarding
class Traced(_Stage, jax.stages.Traced):
  """A traced :class:`PjitFunction` (as ``jax.jit(f).trace(...)``).

  ``.jaxpr`` is the token-threaded jaxpr (what is lowered); ``args_info``,
  ``in_tree``, ``out_info``, ``out_avals`` show the user's arguments and
  outputs.
  """

  def __init__(self, function, traced, mode, keys):
    self._function = function
    self._inner = traced
    self._mode = mode
    self._keys = keys

  @property
  def jaxpr(self):
    return self._inner.jaxpr

  @property
  def fun_name(self):
    return self._inner.fun_name

  @property
  def out_avals(self):
    return self._strip_out(self._inner.out_avals)

  def __call__(self, *args, **kwargs):
    """Runs the function (with its effects, through the dispatch hook)."""
    return self._function(*args, **kwargs)

  def lower(self, *, lowering_platforms=None, _private_parameters=None):
    if self._mode is not None and getattr(_private_parameters, "for_export",
                                          False):
      raise _export_error(self._function)
    lowered = self._inner.lower(lowering_platforms=lowering_platforms,
                                _private_parameters=_private_parameters)
    return Lowered(self._function, lowered, self._mode, self._keys)


@_forwarding
class Lowered(_Stage, jax.stages.Lowered):
  """A lowered :class:`PjitFunction`; ``.as_text()`` shows the threaded StableHLO."""

  def __init__(self, function, lowered, mode, keys):
    self._function = function
    self._inner = lowered
    self._mode = mode
    self._keys = keys

  def as_text(self, *args, **kwargs) -> str:
    return self._inner.as_text(*args, **kwargs)

  def compiler_ir(self, *args, **kwargs):
    return self._inner.compiler_ir(*args, **kwargs)

  def cost_analysis(self):
    return self._inner.cost_analysis()

  def compile(self, *args, **kwargs) -> "Compiled":
    return Compiled(self._inner.compile(*args, **kwargs), self._mode,
                    self._keys)


@_forwarding
class Compiled(_Stage, jax.stages.Compiled):
  """A compiled :class:`PjitFunction`; calling it runs the dispatch hook.

  ``input_shardings``/``input_formats`` and ``output_shardings``/
  ``output_formats`` are those of the user's arguments and outputs.
  """

  def __init__(self, compiled, mode, keys):
    self._inner = compiled
    self._mode = mode
    self._keys = keys
    self._launch = _launch_lock.LaunchSite()

  def as_text(self) -> str:
    return self._inner.as_text()

  def cost_analysis(self):
    return self._inner.cost_analysis()

  def memory_analysis(self):
    return self._inner.memory_analysis()

  def runtime_executable(self):
    return self._inner.runtime_executable()

  @property
  def input_shardings(self):
    return self._strip_in(self._inner.input_shardings)

  @property
  def input_formats(self):
    return self._strip_in(self._inner.input_formats)

  @property
  def output_shardings(self):
    return self._strip_out(self._inner.output_shardings)

  @property
  def output_formats(self):
    return self._strip_out(self._inner.output_formats)

  def __call__(self, *args, **kwargs):
    if self._mode is None:
      return self._inner(*args, **kwargs)
    # compiled for scalar tokens (see PjitFunction.lower): no per-device sharding
    out, _ = _call_path.dispatch(_threads.thread_state(), self._mode, self._keys,
                       None, self._inner, args, kwargs, self._launch)
    return out


def trace(core, function, args, kwargs) -> Traced:
  """``function.trace(*args, **kwargs)`` (``core``: its learnt state): the
  stage of whichever ``jax.jit`` a call would use, learning as a call does.
  It traces under ``jax.disable_jit()`` too, as ``jax.jit``'s does."""
  previous_explicit = getattr(_bodies.explicit, "on", False)
  _bodies.explicit.on = True
  try:
    mode = _effects.get_ordering()
    if core.state in (_core.FIRST, _core.PURE):
      traced = core.plain.trace(*args, **kwargs)
      keys = core.chains(traced, mode)
      if keys is None:
        return Traced(function, traced, None, ())
      core.learn(mode, keys)
    while True:
      keys, jitted = core.keys_and_jit(mode, args)
      tokens = tuple(jax.ShapeDtypeStruct((), _errors.TOKEN_DTYPE)
                     for _ in keys)
      try:
        traced = jitted.trace(*tokens, *args, **kwargs)
      except _bodies.NeedsTokens as err:
        core.learn(mode, err.keys)
        continue
      return Traced(function, traced, mode, keys)
  finally:
    _bodies.explicit.on = previous_explicit

"""``jax_effects.jit``: a drop-in for ``jax.jit`` whose side effects are token-threaded.

A :class:`PjitFunction` holds the user's function and options and the
learnt state it shares with every ``PjitFunction`` of them (``core``);
calling it calls the core's current call target (``__call__`` is a property
returning it). The rest of ``jax.jit``'s object, and what it shows
(``design/architecture.md``, ``_dispatch``): ``trace``/``lower``/
``eval_shape`` learn as a call does; :func:`describe` is the hook through
which tests observe the state. The calling convention of its ``jax.jit``
objects: ``tracing``.

Its stages (:class:`Traced`, :class:`Lowered`, :class:`Compiled`) wrap JAX's
stage of whichever ``jax.jit`` object the call would use and show the
user's arguments and outputs, never the token; ``Compiled.__call__`` runs
the call path; lowered for ``jax.export``, the exported form
(:func:`_lower_for_export`). Each is an instance of JAX's class without being built as
one: it forwards to JAX's stage every public name it does not define
(:func:`_forwarding`), so nothing of JAX's class runs on it.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import types
from typing import (TYPE_CHECKING, Any, Callable, Generic, ParamSpec, TypeVar,
                    overload)

import jax
from jax import tree_util

from jax_effects import _compat
from jax_effects import _jax_api
from jax_effects._core import effects as _effects
from jax_effects._dispatch import call_path as _call_path
from jax_effects._dispatch import core as _core
from jax_effects._dispatch import tracing as _tracing
from jax_effects._primitives import exported as _exported
from jax_effects._primitives import host_target as _host_target
from jax_effects._runtime import token_value as _token_value
from jax_effects._runtime import launch_lock as _launch_lock
from jax_effects._runtime import threads as _threads


_P = ParamSpec("_P")
_R = TypeVar("_R")


class PjitFunction(Generic[_P, _R]):
  """A jitted function whose side effects are token-threaded.

  Call it like the function it wraps. Offers what a ``jax.jit`` object
  offers: ``.trace``, ``.lower`` (a ``jax.stages.Lowered`` whose
  ``.as_text()`` is the StableHLO of the threaded computation),
  ``.eval_shape``, ``.clear_cache``, ``__wrapped__``, ``__signature__``,
  ``copy.copy``/``copy.deepcopy``/pickle, and use as a method.
  """

  def __init__(self, fun: Callable[_P, _R], **jit_kwargs: Any) -> None:
    if not callable(fun):
      raise TypeError(f"jax_effects.jit expects a callable, got {fun!r}")
    _tracing.check_names(jit_kwargs)
    functools.update_wrapper(self, fun)
    self._fun = fun
    self._jit_kwargs = jit_kwargs
    self._core = _core.core_for(fun, jit_kwargs)

  if TYPE_CHECKING:   # (for type checkers: called like the wrapped function)
    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R: ...
  else:
    __call__ = property(operator.attrgetter("_core.call"))

  @property
  def __signature__(self):
    return self._core.signature

  @property
  def keys(self) -> dict[str, tuple]:
    """Ordering mode -> the ordered chains passed as runtime tokens."""
    return {mode: t.keys for mode, t in list(self._core.modes.items())}

  def __repr__(self):
    return f"<jax_effects.jit PjitFunction of {self._fun!r}>"

  def __get__(self, instance: Any, owner: Any = None) -> Any:
    # As jax.jit objects: a bound method when looked up on an instance.
    return self if instance is None else types.MethodType(self, instance)

  @_compat.api_boundary
  def trace(self, *args: Any, **kwargs: Any) -> Traced:
    """Traces for the given arguments (arrays or ``jax.ShapeDtypeStruct``).

    As ``jax.jit(f).trace``; the returned ``jax.stages.Traced`` shows the
    user's arguments and outputs (not the runtime-token argument and result):
    the stage of whichever ``jax.jit`` a call would use, learning as a call
    does.
    """
    core = self._core
    mode = _effects.get_ordering()
    if core.state in (_core.FIRST, _core.PURE):
      traced = core.plain.trace(*args, **kwargs)
      keys = _core.chains(traced.jaxpr.effects, mode)
      if keys is None:
        return Traced(self, traced, None, ())
      core.learn(mode, keys)
    while True:
      keys, jitted = core.keys_and_jit(mode, args)
      tokens = tuple(jax.ShapeDtypeStruct((), _token_value.TOKEN_DTYPE)
                     for _ in keys)
      try:
        traced = jitted.trace(*tokens, *args, **kwargs)
      except _call_path.NeedsTokens as err:
        core.learn(mode, err.keys)
        continue
      return Traced(self, traced, mode, keys, args, kwargs)

  @_compat.api_boundary
  def lower(self, *args: Any, **kwargs: Any) -> Lowered:
    """Lowers for the given arguments (arrays or ``jax.ShapeDtypeStruct``)."""
    return self.trace(*args, **kwargs).lower()

  @_compat.api_boundary
  def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
    """Output shapes/dtypes (``jax.ShapeDtypeStruct`` s), as ``jax.eval_shape``."""
    return self.trace(*args, **kwargs).out_info

  def clear_cache(self) -> None:
    """Drops the kept traces and the ``jax.jit`` caches of this function
    (shared by every PjitFunction of it, as ``jax.jit``'s are)."""
    self._core.clear_cache()

  def _cache_size(self) -> int:
    """Executables in this function's ``jax.jit`` caches (as ``jax.jit``'s)."""
    return self._core.cache_size()

  def __copy__(self) -> PjitFunction[_P, _R]:
    return PjitFunction(self._fun, **self._jit_kwargs)

  def __deepcopy__(self, memo: Any) -> PjitFunction[_P, _R]:
    return self.__copy__()

  def __reduce__(self):
    return (_rebuild, (self._fun, self._jit_kwargs))


def _rebuild(fun, jit_kwargs):
  return PjitFunction(fun, **jit_kwargs)


@overload
def jit(fun: Callable[_P, _R], /, **jit_kwargs: Any) -> PjitFunction[_P, _R]: ...
@overload
def jit(fun: None = None, /, **jit_kwargs: Any
        ) -> Callable[[Callable[_P, _R]], PjitFunction[_P, _R]]: ...


def jit(fun: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
  """Drop-in for ``jax.jit`` that keeps side effects in program order.

  Takes ``jax.jit``'s keyword arguments (``static_argnums``,
  ``static_argnames``, ``donate_argnums``, ``in_shardings``, ...). Usable as
  ``@jit``, ``@jit(static_argnums=...)`` or ``jit(f, ...)``. Returns a
  :class:`PjitFunction`, typed for type checkers as the function it wraps
  (``PjitFunction[P, R]``: called with ``f``'s parameters, returning
  ``f``'s result type).
  """
  if fun is None:
    return functools.partial(jit, **jit_kwargs)
  return PjitFunction(fun, **jit_kwargs)


@dataclasses.dataclass(frozen=True)
class Description:
  """What :func:`describe` observes of a :class:`PjitFunction`.

  ``state``: its dispatch state (``core``: "first", "pure", "threaded",
  "fast", "fallback"); ``keys``: ordering mode -> chains passed as runtime
  tokens; ``executables``: in its ``jax.jit`` caches; ``traces``: jaxprs
  kept; ``shared``: an identifier of the learnt state, equal where shared;
  ``registered``: how many shared states exist in the process.
  """
  state: str
  keys: dict
  executables: int
  traces: int
  shared: int
  registered: int


def describe(function: PjitFunction) -> Description:
  """The dispatch state of ``function``: the hook tests observe it through."""
  core = function._core
  return Description(state=core.state, keys=function.keys,
                     executables=core.cache_size(), traces=len(core.traces),
                     shared=id(core), registered=_core.registered())


# --- stages ------------------------------------------------------------------

def _inputs(name: str) -> property:
  """The inner stage's ``name`` (of the arguments), minus the token ones."""
  return property(lambda self: self._strip_in(getattr(self._inner, name)))


def _outputs(name: str) -> property:
  """The inner stage's ``name`` (of the outputs), minus the token."""
  return property(lambda self: self._strip_out(getattr(self._inner, name)))


class _Stage:
  """What a JAX stage shows about inputs and outputs, minus our token.

  ``_inner`` is JAX's stage of the pure ``jax.jit`` (``_mode`` None: nothing
  to strip) or of the threaded ``g``. Other attributes are JAX's.
  """

  def __init__(self, inner, mode, keys):
    self._inner = inner
    self._mode = mode
    self._keys = keys

  def _strip_in(self, tree):
    if self._mode is None:
      return tree
    args, kwargs = tree
    return tuple(args[len(self._keys):]), kwargs

  def _strip_out(self, tree):
    return tree if self._mode is None else tree[0]

  args_info = _inputs("args_info")
  in_avals = _inputs("in_avals")
  out_info = _outputs("out_info")

  @property
  def in_tree(self):
    return tree_util.tree_structure(self.args_info)

  @property
  def donate_argnums(self):
    n = 0 if self._mode is None else len(self._keys)
    return tuple(i - n for i in self._inner.donate_argnums if i >= n)

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
  that ``cls`` does not define (JAX's methods would read unset slots)."""
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
  """A traced :class:`PjitFunction` (as ``jax.jit(f).trace(...)``);
  ``.jaxpr`` is the token-threaded jaxpr (what is lowered)."""

  def __init__(self, function, traced, mode, keys, args=(), kwargs=None):
    super().__init__(traced, mode, keys)
    self._function = function
    self._args = args
    self._kwargs = {} if kwargs is None else kwargs
    self._export_traced = None   # (set by a lowering for jax.export)

  @property
  def jaxpr(self):
    if self._export_traced is not None:   # (what jax.export lowered)
      return self._export_traced.jaxpr
    return self._inner.jaxpr

  out_avals = _outputs("out_avals")

  def __call__(self, *args, **kwargs):
    """Runs the function (with its effects, through the dispatch hook)."""
    return self._function(*args, **kwargs)

  def lower(self, *, lowering_platforms=None, _private_parameters=None):
    if self._mode is not None and getattr(_private_parameters, "for_export",
                                          False):
      return _lower_for_export(self, lowering_platforms, _private_parameters)
    lowered = self._inner.lower(lowering_platforms=lowering_platforms,
                                _private_parameters=_private_parameters)
    return Lowered(self._function, lowered, self._mode, self._keys)


@_forwarding
class Lowered(_Stage, jax.stages.Lowered):
  """A lowered :class:`PjitFunction`; ``.as_text()`` shows the threaded StableHLO."""

  def __init__(self, function, lowered, mode, keys):
    super().__init__(lowered, mode, keys)
    self._function = function

  def compile(self, *args, **kwargs) -> "Compiled":
    compiled = Compiled(self._inner.compile(*args, **kwargs), self._mode,
                        self._keys)
    if self._function._core.traces.user_code:   # (launch_lock.finish)
      _launch_lock.wait_for_user_code(compiled._launch)
    return compiled


@_forwarding
class Compiled(_Stage, jax.stages.Compiled):
  """A compiled :class:`PjitFunction`; calling it runs the call path."""

  def __init__(self, compiled, mode, keys):
    super().__init__(compiled, mode, keys)
    self._launch = _launch_lock.LaunchSite()

  input_shardings = _inputs("input_shardings")
  input_formats = _inputs("input_formats")
  output_shardings = _outputs("output_shardings")
  output_formats = _outputs("output_formats")

  def __call__(self, *args, **kwargs):
    if self._mode is None:
      return self._inner(*args, **kwargs)
    # compiled for scalar tokens (see PjitFunction.lower): no per-device sharding
    return _call_path.dispatch(_threads.thread_state(), self._mode, self._keys,
                               None, self._inner, args, kwargs, self._launch)[0]


def _lower_for_export(traced, lowering_platforms, private_parameters):
  """JAX's ``Lowered`` for ``jax.export`` of ``traced`` (a ``stages.Traced``
  of the threaded computation): not the threaded ``g`` but its exported
  form (its part of the token calling convention: ``design/tokens.md``, "An
  exported function"; ``_primitives.exported``)::

    h(*args) -> outputs:
      c = exported_entry()                 # JAX's ordered EXPORTED_ORDER
      outputs, token = g(c, ..., c, *args)
      exported_exit(token)                 # JAX's ordered EXPORTED_ORDER

  with the user's ``jax.jit`` options. Refused, naming the reason, before
  lowering: where the host target is unavailable, for platforms other than
  CPU, and unless ``jax.export`` is told the target is allowed
  (``design/host_target.md``: what an exported module promises)."""
  why = _host_target.unavailable()
  if why is not None:
    raise ValueError(
        f"jax.export cannot export the jax_effects.jit function "
        f"{traced.fun_name!r} with effects in this process: {why}")
  platforms = tuple(lowering_platforms or ())
  if platforms != ("cpu",):
    raise ValueError(
        f"jax.export cannot export the jax_effects.jit function "
        f"{traced.fun_name!r} with effects for platforms {platforms}: "
        f"jax_effects' host target, which exported effects call, exists "
        f"for CPU only. Export for platforms=['cpu'], or export the "
        f"function without its effects")
  allowed = _compat.export_allowed_custom_calls()
  target = _host_target.TARGET
  if allowed is not None and target not in allowed and "ALL" not in allowed:
    raise ValueError(
        f"jax.export of the jax_effects.jit function {traced.fun_name!r} "
        f"with effects needs its host target ({target!r}) allowed: "
        f"jax.export.export(f, disabled_checks=[jax.export."
        f"DisabledSafetyCheck.custom_call(jax_effects.HOST_TARGET)])")
  core = traced._function._core
  keys, jitted = core.keys_and_jit(traced._mode, traced._args)

  @functools.wraps(traced._function._fun)
  def exported(*a, **kw):
    carrier = _exported.entry()
    out, token = jitted(*([carrier] * len(keys)), *a, **kw)
    _exported.exit(token)
    return out

  inner = _jax_api.jit(exported, **core.jit_kwargs).trace(*traced._args, **traced._kwargs)
  traced._export_traced = inner
  return inner.lower(lowering_platforms=lowering_platforms,
                     _private_parameters=private_parameters)


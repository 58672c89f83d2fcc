"""``jax_effects.jit``: a drop-in for ``jax.jit`` whose side effects are token-threaded.

A :class:`PjitFunction` (jax_effects' own, the drop-in for JAX's) is what
``jax_effects.jit(fun, **options)`` returns. It holds the user's function
and options and the learnt state it shares with every ``PjitFunction`` of
the same function object and equal options (a ``core.Core``, found in
``registry``): ``jax_effects.jit(f)(x)`` written inline, a new object per
call, reuses the trace and the executable as ``jax.jit(f)(x)`` does.
Calling it calls the core's current call target (``__call__`` is a
property returning it): the pure ``jax.jit`` object itself once the
function is known to be pure, the fast hook in the common threaded case,
else the core's first or general call (the states: ``core``). The calling convention of its ``jax.jit`` objects, ``g(t_1, ...,
t_k, *args, **kwargs) -> (outputs, token)``: ``convention``.

The rest of ``jax.jit``'s object: ``trace``/``lower``/``eval_shape`` learn
as a call does and return ``jax.stages.Traced``/``Lowered`` (``stages``:
JAX's stages of the ``jax.jit`` the call would use, minus the token);
``clear_cache``, ``__wrapped__``, ``__signature__`` (the function's, as
``inspect.signature(jax.jit(f), follow_wrapped=False)`` answers), a repr
and a class name saying what it is (tools that detect jit-wrapped functions
match ``PjitFunction`` in them, chex's ``is_traceable`` for one),
copy/deepcopy/pickle (one of the same function and options: the same
shared state, as ``jax.jit``'s caches are shared), use as a method (a
bound ``types.MethodType``). :func:`describe` is the documented hook through
which tests observe the state.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import types
from typing import (TYPE_CHECKING, Any, Callable, Generic, ParamSpec, TypeVar,
                    overload)

from jax_effects._dispatch import convention as _convention
from jax_effects._dispatch import core as _core
from jax_effects._dispatch import registry as _registry
from jax_effects._dispatch import stages as _stages
from jax_effects._dispatch.stages import Lowered, Traced

TOKENS_KW = _convention.TOKENS_KW
NeedsTokens = _core.NeedsTokens


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
    _convention.check_names(jit_kwargs)
    functools.update_wrapper(self, fun)
    self._fun = fun
    self._jit_kwargs = jit_kwargs
    self._core = _registry.core_for(
        fun, jit_kwargs, lambda ref: _core.Core(ref, fun, jit_kwargs))

  #: Calling it calls its core's current target (``core``): the
  #: ``jax.jit`` object itself once the function is known to be pure (no
  #: Python frame of ours), the fast hook, or the first/general call.
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
    if instance is None:
      return self
    return types.MethodType(self, instance)

  def trace(self, *args: Any, **kwargs: Any) -> Traced:
    """Traces for the given arguments (arrays or ``jax.ShapeDtypeStruct``).

    As ``jax.jit(f).trace``; the returned ``jax.stages.Traced`` shows the
    user's arguments and outputs (not the runtime-token argument and result).
    """
    return _stages.trace(self._core, self, args, kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Lowered:
    """Lowers for the given arguments (arrays or ``jax.ShapeDtypeStruct``)."""
    return self.trace(*args, **kwargs).lower()

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
    return PjitFunction(self._fun, **self._jit_kwargs)

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
  kept; ``shared``: an identifier of the learnt state, equal where shared; ``registered``: how many shared states exist in the
  process (every function with a live ``jax_effects.jit``).
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
                     shared=id(core), registered=_registry.registered())

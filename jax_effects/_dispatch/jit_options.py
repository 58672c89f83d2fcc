"""The options and the face of ``g``, the function a ``jax_effects.jit``
function's ``jax.jit`` objects trace (``tracing``).

Its part of the token calling convention (``design/tokens.md``, "At the
``jax.jit`` boundary"): the ``k`` runtime tokens are ``g``'s first
positional parameters (named with the reserved prefix :data:`TOKENS_KW`),
so the user's options shift (:func:`threaded_jit_kwargs`).
"""
from __future__ import annotations

import inspect
from typing import Callable

from jax_effects._dispatch import call_path as _call_path

TOKENS_KW = _call_path.TOKENS_KW


def argnums(value) -> tuple:
  """``static_argnums``/``donate_argnums`` as a tuple."""
  if value is None:
    return ()
  return (value,) if isinstance(value, int) else tuple(value)


def check_names(jit_kwargs: dict) -> None:
  """Refuses static argument names that would clash with the tokens'."""
  names = jit_kwargs.get("static_argnames") or ()
  if any(str(n).startswith(TOKENS_KW)
         for n in ((names,) if isinstance(names, str) else names)):
    raise ValueError(f"names starting with {TOKENS_KW} are reserved by "
                     "jax_effects")


def signature(fun) -> inspect.Signature | None:
  """``fun``'s signature, or None where it has none."""
  try:
    return inspect.signature(fun)
  except (TypeError, ValueError):
    return None


def n_dynamic(jit_kwargs: dict, args: tuple) -> int | None:
  """The number of non-static positional arguments of a call with ``args``
  where one ``in_shardings`` is given for every argument (it is expanded
  per argument, so the threaded ``jax.jit`` depends on it); else None."""
  s = jit_kwargs.get("in_shardings")
  if s is None or isinstance(s, (tuple, list)):
    return None
  n = len(args)
  static = {i % n for i in argnums(jit_kwargs.get("static_argnums"))
            if -n <= i < n}
  return n - len(static)


def threaded_jit_kwargs(jit_kwargs: dict, n_dynamic: int | None,
                        k: int) -> dict:
  """``jax.jit`` keyword arguments for ``g(t_1, ..., t_k, *args, **kwargs)``:
  positional indices shift by ``k`` (negative ones do not), the tokens get
  no sharding, nor does the returned one. ``n_dynamic``: :func:`n_dynamic`.
  """
  kwargs = dict(jit_kwargs)
  for name in ("static_argnums", "donate_argnums"):
    if kwargs.get(name) is not None:
      kwargs[name] = tuple(n + k if n >= 0 else n
                           for n in argnums(kwargs[name]))
  s = kwargs.get("in_shardings")
  if s is not None:
    per_argument = s if isinstance(s, (tuple, list)) else [s] * n_dynamic
    kwargs["in_shardings"] = (*([None] * k), *per_argument)
  if "out_shardings" in kwargs:
    kwargs["out_shardings"] = (kwargs["out_shardings"], None)
  return kwargs


class Traceable:
  """``g``: calls ``body(args, kwargs)``; looks like the user's function
  (``names``, its signature with ``tokens`` token parameters first, its
  ``__wrapped__`` through ``fun_ref``), so JAX names and locates its code.
  """

  def __init__(self, body: Callable, fun_ref: Callable[[], Callable | None],
               names: dict, sig: inspect.Signature | None,
               tokens: int | None):
    self._body = body
    self._fun_ref = fun_ref
    self.__dict__.update(names)
    if sig is not None and tokens is not None:
      sig = sig.replace(parameters=[
          *(inspect.Parameter(f"{TOKENS_KW}_{i}",
                              inspect.Parameter.POSITIONAL_ONLY)
            for i in range(tokens)),
          *sig.parameters.values()])
    if sig is not None:
      self.__signature__ = sig

  def __call__(self, *args, **kwargs):
    return self._body(args, kwargs)

  @property
  def __wrapped__(self):
    return self._fun_ref()

  def __repr__(self):
    return f"<function {self.__dict__.get('__qualname__', '?')}>"


def names_of(fun) -> dict:
  """The attributes a :class:`Traceable` copies from ``fun``."""
  out = {name: getattr(fun, name) for name in
         ("__module__", "__name__", "__qualname__", "__doc__")
         if hasattr(fun, name)}
  if "__name__" not in out:   # (callable objects, partials)
    out["__name__"] = type(fun).__name__
  return out

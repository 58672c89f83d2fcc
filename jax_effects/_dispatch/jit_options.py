"""The options and the face of ``g``, the function a ``jax_effects.jit``
function's ``jax.jit`` objects trace (``tracing``).

Part in the token calling convention: the threaded ``g`` takes the ``k``
runtime tokens as its first positional arguments (``t_1, ..., t_k``, named
with the reserved prefix :data:`TOKENS_KW`) and returns ``(outputs,
token)``, so the user's ``static_argnums``/``donate_argnums`` shift by
``k``, ``in_shardings`` gets None for the tokens and ``out_shardings`` None
for the returned token (:func:`threaded_jit_kwargs`); its
:class:`Traceable` is named, signed and located as the user's function.
"""
from __future__ import annotations

import inspect
from typing import Callable

from jax_effects._dispatch import call_path as _call_path

#: Prefix of the token parameters' names: reserved.
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


def signature_with_tokens(sig: inspect.Signature | None, k: int):
  """``sig`` (a user function's) with ``k`` runtime-token parameters first."""
  if sig is None:
    return None
  extra = [inspect.Parameter(f"{TOKENS_KW}_{i}",
                             inspect.Parameter.POSITIONAL_ONLY)
           for i in range(k)]
  return sig.replace(parameters=[*extra, *sig.parameters.values()])


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
  """``jax.jit`` keyword arguments for ``g(t_1, ..., t_k, *args, **kwargs)``.

  Positional indices shift by ``k`` (negative ones are unchanged); the tokens
  get no sharding constraint (None) and no sharding on the output.
  ``n_dynamic`` (:func:`n_dynamic`) is needed only when ``in_shardings`` is
  one sharding for every argument.
  """
  kwargs = dict(jit_kwargs)
  for name in ("static_argnums", "donate_argnums"):
    if kwargs.get(name) is not None:
      kwargs[name] = tuple(n + k if n >= 0 else n
                           for n in argnums(kwargs[name]))
  if kwargs.get("in_shardings") is not None:
    s = kwargs["in_shardings"]
    if isinstance(s, (tuple, list)):
      kwargs["in_shardings"] = (*([None] * k), *s)
    else:
      kwargs["in_shardings"] = (*([None] * k), *([s] * n_dynamic))
  if "out_shardings" in kwargs:
    kwargs["out_shardings"] = (kwargs["out_shardings"], None)
  return kwargs


class Traceable:
  """``g``: calls ``body(args, kwargs)``; looks like the user's function.

  ``__name__``, ``__qualname__``, ``__module__``, ``__doc__`` are the
  function's, ``__signature__`` is its signature with ``tokens`` token
  parameters first (None: the function's own), and ``__wrapped__`` reads
  it through ``fun_ref`` (a weak reference, or a getter of a strong one),
  so JAX's source locations name the user's code.
  """

  def __init__(self, body: Callable, fun_ref: Callable[[], Callable | None],
               names: dict, sig: inspect.Signature | None,
               tokens: int | None):
    self._body = body
    self._fun_ref = fun_ref
    self.__dict__.update(names)
    if sig is not None:
      self.__signature__ = (sig if tokens is None
                            else signature_with_tokens(sig, tokens))

  def __call__(self, *args, **kwargs):
    return self._body(args, kwargs)

  @property
  def __wrapped__(self):
    return self._fun_ref()

  def __repr__(self):
    return f"<function {self.__dict__.get('__qualname__', '?')}>"


def names_of(fun) -> dict:
  """The attributes a :class:`Traceable` copies from ``fun``."""
  out = {}
  for name in ("__module__", "__name__", "__qualname__", "__doc__"):
    try:
      out[name] = getattr(fun, name)
    except AttributeError:
      pass
  if "__name__" not in out:   # (callable objects, partials)
    out["__name__"] = type(fun).__name__
  return out

"""``jax_effects.callback``: host functions with results, in program order.

Results are checked as ``io_callback`` checks them (``docs/reference.md``).
Part in the token calling convention: that of every effect (the pass adds
the token and carrier); the results are the primitive's outputs after them.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import jax
from jax import tree_util
import numpy as np

from jax_effects._core import effects as _effects
from jax_effects._core.effects import Effect
from jax_effects._frontends import arguments as _arguments
from jax_effects._primitives import effect as _effect
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_specs as _host_specs
from jax_effects._runtime import output as _output


def _result_avals(what: str, result_shape_dtypes):
  leaves, treedef = tree_util.tree_flatten(result_shape_dtypes)
  avals = []
  for leaf in leaves:
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise TypeError(
          f"{what}: result_shape_dtypes must be a pytree of jax.ShapeDtypeStruct"
          f" (or arrays), got a leaf {leaf!r}")
    dtype = np.dtype(leaf.dtype)
    canonical = jax.dtypes.canonicalize_dtype(dtype)
    if canonical != dtype:
      raise TypeError(
          f"{what}: result dtype {dtype} is not available with jax_enable_x64 "
          f"disabled; declare {canonical}")
    avals.append(jax.core.ShapedArray(tuple(leaf.shape), dtype))
  return tuple(avals), treedef


@dataclasses.dataclass(slots=True, repr=False, unsafe_hash=True)
class NamedCallback:
  """A host function referred to by name (:func:`register_callback`):
  passed to :func:`callback` as its ``fn``, or called, it calls the
  function registered under ``name`` where and when it runs. Equal (and
  hashed alike) where the names are."""
  name: str

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return _registered(self.name)(*args, **kwargs)

  def __repr__(self):
    return f"NamedCallback({self.name!r})"


_named: dict[str, Callable[..., Any]] = {}
_named_lock = threading.Lock()


def register_callback(name: str, fn: Callable[..., Any] | None
                      ) -> NamedCallback | None:
  """Registers ``fn`` under ``name`` in this process; returns the
  :class:`NamedCallback` to pass to :func:`callback`.

  A call site made with ``callback(register_callback(name, fn), ...)``
  refers to its host function by name, so it runs in any process where
  ``name`` is registered: ``jax.export`` serializes it, and a persistent
  compilation cache hit in a fresh process runs it, when that process has
  called ``register_callback(name, ...)`` before the call runs (else the
  effect fails with a ``LookupError`` naming ``name``, reported like a
  callback's error). Registering a name again replaces its function
  (for every call site using it from then on); ``fn=None`` removes it.
  """
  if not isinstance(name, str) or not name:
    raise TypeError(
        f"jax_effects.register_callback: name must be a non-empty str, got "
        f"{name!r}")
  if fn is not None and not callable(fn):
    raise TypeError(
        f"jax_effects.register_callback({name!r}, ...): {fn!r} is not "
        f"callable")
  if isinstance(fn, NamedCallback):
    raise TypeError(
        f"jax_effects.register_callback({name!r}, ...): pass the function, "
        f"not the NamedCallback {fn!r}")
  with _named_lock:
    if fn is None:
      _named.pop(name, None)
      return None
    _named[name] = fn
  return NamedCallback(name)


def _registered(name: str) -> Callable[..., Any]:
  fn = _named.get(name)
  if fn is None:
    raise LookupError(
        f"jax_effects.callback named {name!r}: no function is registered "
        f"under that name in this process; call "
        f"jax_effects.register_callback({name!r}, fn) before the "
        f"computation runs")
  return fn


def _named_host(spec: dict) -> _host_callback.HostCallback:
  """The host side of a named callback's spec, in any process."""
  name, args_tree = spec["name"], spec["args"]
  _host_specs.check_tree(args_tree, f"{spec['what']}: its arguments")
  decode = _host_specs.decode_tree
  results = spec["results"]
  avals = tuple(jax.core.ShapedArray(tuple(shape), _host_specs.decode_aval(
      [dtype, shape])[0]) for dtype, shape in (results or {}).get("avals", ()))
  out_tree = (None if results is None else tree_util.tree_structure(
      decode(results["tree"], [0] * len(avals))))
  what = spec["what"]

  def call(*np_operands):
    _output.before_user_code()
    fn = _registered(name)
    a, k = decode(args_tree, [x[()] if x.ndim == 0 else x
                              for x in np_operands])
    out = fn(*a, **k)
    if out_tree is None:
      if out is not None and tree_util.tree_leaves(out):
        raise _no_result_expected(what, out)
      return ()
    return _flatten_results(what, out, out_tree, None)

  return _host_callback.HostCallback(call, what, avals, spec=spec,
                                     user_code=True)


_host_specs.register_kind("callback", _named_host)


def _no_result_expected(what: str, out) -> TypeError:
  """A callback declared without results that returned leaves: refused,
  as ``io_callback`` refuses it."""
  text = repr(out)
  if len(text) > 60:
    text = text[:57] + "..."
  return TypeError(
      f"{what} returned {text} (a {type(out).__name__}), but its call "
      f"declares no result (result_shape_dtypes=None): return None, or "
      f"declare the result's shape and dtype (a jax.ShapeDtypeStruct) to "
      f"receive it")


def _flatten_results(what: str, out, out_tree, result_shape_dtypes):
  if out is None and out_tree.num_leaves:
    raise TypeError(
        f"{what} returned None, but result_shape_dtypes declares "
        f"{out_tree.num_leaves} result(s) ({out_tree}): did it forget a "
        f"`return`?")
  try:
    # Up to the declared structure: a leaf may be a list, a scalar or any
    # object NumPy takes as an array.
    return out_tree.flatten_up_to(out)
  except (ValueError, TypeError):
    tree = tree_util.tree_structure(out)
    count = ""
    declared = (out_tree.num_children if result_shape_dtypes is None
                else len(result_shape_dtypes)
                if isinstance(result_shape_dtypes, (tuple, list)) else None)
    if (isinstance(out, (tuple, list)) and declared is not None
        and len(out) != declared):
      count = (f"{len(out)} results where result_shape_dtypes declares "
               f"{declared}: ")
    raise TypeError(
        f"{what} returned {count}a value of structure {tree}; expected "
        f"{out_tree} (from result_shape_dtypes)") from None


def callback(fn: Callable[..., Any], result_shape_dtypes: Any, *args: Any,
             ordered: bool | None = None,
             effect: Effect | None = None, **kwargs: Any) -> Any:
  """Calls ``fn(*args, **kwargs)`` on the host when the computation runs.

  Returns arrays matching ``result_shape_dtypes`` (a pytree of
  ``jax.ShapeDtypeStruct``, or None for no result: ``fn`` must then return
  None or a pytree without leaves, as for ``io_callback``; a value is a
  ``TypeError``).
  ``effect`` (default :data:`jax_effects.DEFAULT`, shared with ``print`` and
  ``log``) and ``ordered`` (default: the effect's setting) work as for
  :func:`jax_effects.print`. Results are not differentiable (their tangents
  are zero). ``fn`` may be a :class:`NamedCallback`
  (:func:`register_callback`): the call site then names its host function,
  so it can be exported and cached across processes.
  """
  if not callable(fn):
    raise TypeError(f"jax_effects.callback: {fn!r} is not callable")
  named = fn.name if isinstance(fn, NamedCallback) else None
  name = (repr(named) if named is not None
          else getattr(fn, "__qualname__", None) or repr(fn))
  what = f"jax_effects.callback({name})"
  effect, ordered = _effects.resolve(what, effect, ordered)
  operands, calling = _arguments.split(what, args, kwargs)
  avals, out_tree = _result_avals(what, result_shape_dtypes)

  if named is not None:
    try:
      # (the named callback's call site as data)
      args_tree = _host_specs.encode_tree((args, kwargs), set(range(len(operands))))
      out_spec = None
      if result_shape_dtypes is not None:
        out_spec = {"tree": _host_specs.encode_tree(result_shape_dtypes,
                                                    set(range(len(avals)))),
                    "avals": [_host_specs.encode_aval(a) for a in avals]}
      spec = {"kind": "callback", "what": what, "name": named,
              "args": args_tree, "results": out_spec}
    except _host_specs.NotData as err:
      spec = f"its arguments have {err}"
  else:
    spec = "its host side is a Python function of this process"
  host = calling(fn)
  if isinstance(spec, dict):
    call = _named_host(spec).fn
  elif result_shape_dtypes is None:
    def call(*np_operands):
      _output.before_user_code()
      out = host(*np_operands)
      if out is not None and tree_util.tree_leaves(out):
        raise _no_result_expected(what, out)
  else:
    def call(*np_operands):
      _output.before_user_code()
      return _flatten_results(what, host(*np_operands), out_tree,
                              result_shape_dtypes)

  results = _effect.bind_effect(call, what, operands, effect=effect,
                                ordered=ordered, result_avals=avals,
                                spec=spec, user_code=True)
  return (None if result_shape_dtypes is None
          else tree_util.tree_unflatten(out_tree, results))

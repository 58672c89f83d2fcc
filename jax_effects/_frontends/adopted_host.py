"""The host side of JAX's callbacks that the pass adopts (``_pass.token_pass``).

What an adopted ``jax.debug.print``/``log``, ``jax.debug.callback`` or
``io_callback`` runs: what the user observes is JAX's (arguments, text,
result checks, errors as ``jax.jit`` delivers them), at jax_effects' cost:
JAX's host-callback calling convention as JAX's impls keep it (operands as
they give them, arguments rebuilt from JAX's flat callback, results checked
as ``emit_python_callback`` checks them, errors as ``jax.jit`` raises them).
It registers itself with the pass (``_pass.token_pass.register_host_side``).
See ``design/formatting.md`` (text), ``design/errors.md`` (errors) and
``design/placement.md`` (held output).

Part in the token calling convention: that of every effect's host side
(``HostCallback.fn``: NumPy operands in, results out); the host function
around it (``_primitives.host_functions``) handles the carrier.
"""
from __future__ import annotations

import copy
import functools
import traceback
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import tree_util

from jax_effects import _compat
from jax_effects._frontends import printing as _printing
from jax_effects._pass import token_pass as _token_pass
from jax_effects._primitives import edges as _edges
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_specs as _host_specs
from jax_effects._runtime import output as _output
from jax_effects._runtime import placement as _placement

# --- errors as jax.jit delivers them -----------------------------------------

#: XLA's status prefix for a failed Python callback (jaxlib 0.8-0.10).
JAX_ERROR_PREFIX = "INTERNAL: CpuCallback error calling callback: "


def jax_error(exc: Exception) -> jax.errors.JaxRuntimeError:
  """The error ``jax.jit`` raises when a host callback raised ``exc`` (its
  ``__cause__``); built where ``exc`` is caught, while its frames are live.
  Its text: ``exc`` as jaxlib puts it in the status message (nanobind's
  ``python_error::what()``)."""
  parts = []
  tb = exc.__traceback__
  if tb is not None:
    while tb.tb_next is not None:
      tb = tb.tb_next
    parts.append("Traceback (most recent call last):\n")
    for frame, lineno in reversed(list(traceback.walk_stack(tb.tb_frame))):
      code = frame.f_code
      parts.append(f'  File "{code.co_filename}", line {lineno}, '
                   f"in {code.co_name}\n")
  parts.append(f"{type(exc).__name__}: ")
  try:
    parts.append(str(exc))
  except Exception:  # noqa: BLE001 - as jaxlib does
    parts.append("<exception str() failed>")
  err = jax.errors.JaxRuntimeError(JAX_ERROR_PREFIX + "".join(parts))
  err.__cause__ = exc
  return err


# --- arguments as JAX's impls give them --------------------------------------

@functools.cache
def cpu():
  """``(device, sharding)``: the first local CPU device (where JAX's impls
  put the operands) and its ``SingleDeviceSharding``."""
  try:
    device = jax.local_devices(backend="cpu")[0]
  except RuntimeError as e:
    raise RuntimeError(
        "jax.debug.callback failed to find a local CPU device to place the"
        " inputs on. Make sure \"cpu\" is listed in --jax_platforms or the"
        " JAX_PLATFORMS environment variable.") from e
  return device, jax.sharding.SingleDeviceSharding(device)


def putter() -> Callable[[tuple, Any, Any], Sequence]:
  """``put_all(operands, device, sharding)``: NumPy ``operands`` as the
  ``jax.Array`` s ``jax.device_put(x, device)`` returns, their avals cached
  by shape and dtype; marked explicit transfers, as ``jax.device_put``'s
  are for ``jax.transfer_guard``, only under a guard (the mark costs a
  tenth of the put)."""
  avals: dict = {}
  shaped = jax.core.ShapedArray
  put = _compat.batched_device_put
  guarded = _compat.host_transfers_guarded

  def aval_of(x):
    key = (x.shape, x.dtype)
    aval = avals.get(key)
    if aval is None:
      aval = avals[key] = shaped(x.shape, x.dtype)
    return aval

  def put_all(operands, device, sharding):
    devices = [device]
    if guarded():
      state = _compat.transfer_guard_state()
      previous = state.explicit_device_put
      state.explicit_device_put = True
      try:
        return [put(aval_of(x), sharding, [x], devices, True)
                for x in operands]
      finally:
        state.explicit_device_put = previous
    if len(operands) == 1:   # (no comprehension's frame)
      x = operands[0]
      return (put(aval_of(x), sharding, [x], devices, True),)
    return [put(aval_of(x), sharding, [x], devices, True) for x in operands]
  return put_all


def swap_settings(device, no_mesh) -> list:
  """Sets this thread's JAX default device to ``device`` and clears the
  ``no_mesh`` settings (``_compat.NO_MESH_SETTINGS``), as the ``with``
  blocks of JAX's callback impls do, directly (cheaper); returns
  ``[(setting, previous), ...]``, for the caller to put back in reverse."""
  default = _compat.default_device_setting
  swapped = [(default, default.swap_local(device))]
  for state, none in no_mesh:
    swapped.append((state, state.swap_local(none)))
  return swapped


class Slot:
  """Stands for flat argument ``i`` while the argument structure is read."""
  __slots__ = ("i",)

  def __init__(self, i):
    self.i = i


def slots(in_tree) -> tuple:
  """``(args, kwargs)`` of ``in_tree`` with each flat argument ``i`` a
  ``Slot(i)``."""
  return tree_util.tree_unflatten(
      in_tree, [Slot(i) for i in range(in_tree.num_leaves)])


def rebuilder(in_tree, static_args) -> Callable[[list], tuple]:
  """``rebuild(dynamic_values) -> (args, kwargs)`` as JAX's
  ``merge_callback_args`` does, without a pytree unflatten when every
  argument is itself a leaf."""
  static = dict(static_args)
  n = in_tree.num_leaves
  args, kwargs = slots(in_tree)
  dynamic = [i for i in range(n) if i not in static]
  where = {leaf: pos for pos, leaf in enumerate(dynamic)}

  def leaf(node):   # ("d", k): dynamic value k; ("s", v): static v
    i = node.i
    return ("d", where[i]) if i in where else ("s", static[i])

  if all(type(a) is Slot for a in args) and all(
      type(v) is Slot for v in kwargs.values()):
    arg_parts = [leaf(a) for a in args]
    kw_parts = [(k, leaf(v)) for k, v in kwargs.items()]

    def flat(values):
      return ([values[x] if kind == "d" else x for kind, x in arg_parts],
              {k: values[x] if kind == "d" else x for k, (kind, x) in kw_parts})
    return flat

  def general(values):
    full = [None] * n
    for i, v in static.items():
      full[i] = v
    for i, v in zip(dynamic, values):
      full[i] = v
    return tree_util.tree_unflatten(in_tree, full)
  return general


def caller(fn, in_tree, static_args) -> Callable[..., Any]:
  """``call(*values)``: ``fn`` called with the arguments JAX's flat callback
  rebuilds from ``values``; ``fn`` itself when they are those arguments."""
  n = in_tree.num_leaves
  args, kwargs = slots(in_tree)
  if (not static_args and not kwargs and len(args) == n
      and all(type(a) is Slot and a.i == i for i, a in enumerate(args))):
    return fn
  rebuild = rebuilder(in_tree, static_args)

  def call(*values):
    a, k = rebuild(values)
    return fn(*a, **k)
  return call


# --- results as JAX checks them ----------------------------------------------

def check_results(out, result_avals: tuple, n_results: int) -> tuple:
  """JAX's checks of a callback's flat results, with its messages."""
  if not n_results and not out:
    return ()
  out = tuple(out)
  if len(out) != n_results:
    raise RuntimeError(
        "Mismatched number of outputs from callback. "
        f"Expected: {n_results}, Actual: {len(out)}")
  # (with JAX's canonical dtypes, as JAX converts them before it compares)
  out = [np.asarray(a) for a in out]
  out = tuple(np.asarray(x, jax.dtypes.canonicalize_dtype(x.dtype)) for x in out)
  for i, (value, aval) in enumerate(zip(out, result_avals)):
    if value.shape != aval.shape:
      raise RuntimeError(
          f"Incorrect output shape for return value #{i}: "
          f"Expected: {aval.shape}, Actual: {value.shape}")
    if value.dtype != aval.dtype:
      raise RuntimeError(
          f"Incorrect output dtype for return value #{i}: "
          f"Expected: {aval.dtype}, Actual: {value.dtype}")
  return out


# --- jax.debug.callback / io_callback ---------------------------------------

_ADOPTED = "(adopted by jax_effects.jit)"
_HostCallback = _host_callback.HostCallback
#: What export suggests in place of an adopted callback (README, "Cache,
#: export and asynchronous dispatch").
_NAMED_CALLBACK = ("a named jax_effects.callback (jax_effects.callback("
                   "jax_effects.register_callback('my_callback', fn), ...), "
                   "with fn registered under that name in the process that "
                   "calls the exported function too)")


def _refuse_if_held(what: str) -> None:
  """Refuses a per-device callback inside ``deterministic()``: releasing
  the held output before it would leave it unsorted (``design/placement.md``).
  """
  p = _placement.current()
  if p is not None and p.per_device:
    raise RuntimeError(
        f"jax_effects.deterministic(): {what} inside shard_map/pmap (per "
        f"device) cannot be kept in the fixed order deterministic() promises "
        f"(it runs your code, which cannot be held, so every device's output "
        f"would come out unsorted); refused. Use jax_effects.print/log "
        f"there, move the callback out of the per-device code, or call the "
        f"function outside the deterministic() block")


# JAX's impls (``debug_callback_impl``, ``io_callback_impl``) with
# ``jax.device_put`` and the ``with`` blocks inlined, for speed.

def _run_as_jax(call, what: str, logger, failed: str, no_mesh, convert=None,
                check=None):
  """``host(*operands)``: ``call`` run as JAX's impl of an adopted ``what``
  runs it: refused per device inside ``deterministic()``, held lines
  released first, the operands put on the first CPU device, JAX's default
  device and the ``no_mesh`` settings swapped around it, a failure logged
  by ``logger`` (``failed``) and raised as ``jax.jit`` raises it.
  ``convert(out)``: its results as the impl returns them (inside the logged
  part); ``check``: ``emit_python_callback``'s checks of those (outside
  it); no results where None."""
  put_all = putter()
  release = _output.release_in_callback
  holding = _output.holding

  def host(*operands):
    if holding():
      _refuse_if_held(what)
    release()   # (what held lines' sinks raise: their dispatch's errors)
    try:
      device, sharding = cpu()
      args = put_all(operands, device, sharding)
      swapped = swap_settings(device, no_mesh)
      try:
        out = call(*args)
        if convert is not None:
          out = convert(out)
      except BaseException:
        logger.exception(failed)
        raise
      finally:
        for state, previous in reversed(swapped):
          state.set_local(previous)
      return () if check is None else check(out)
    except Exception as exc:  # noqa: BLE001 - delivered as jax.jit would
      raise jax_error(exc) from exc
  return host


def debug_callback(params: dict, avals: tuple,
                   source_info=None) -> _HostCallback:
  """The ``HostCallback`` of an adopted ``jax.debug.callback``
  (``debug_callback_p``'s params; ``token_pass.register_host_side``'s
  arguments), run as ``debug_callback_impl`` calls it."""
  parts = _compat.debug_callback_parts(params["callback"])
  if parts is None:   # bound by other code: called as it is
    call = params["callback"]
  else:   # jax.debug.callback's: its steps without its pytree unflatten
    fn, in_tree, static_args = parts
    call = caller(fn, in_tree, tuple(static_args.items()))
  host = _run_as_jax(call, "a jax.debug.callback", _compat.debugging_logger,
                     "jax.debug.callback failed", _compat.NO_MESH_SETTINGS)
  return _HostCallback(host, f"jax.debug.callback {_ADOPTED}", user_code=True,
                       instead=_NAMED_CALLBACK)


def io_callback(params: dict, avals: tuple, source_info=None) -> _HostCallback:
  """The ``HostCallback`` of an adopted ``io_callback``: ``io_callback_impl``
  (results as NumPy arrays) followed by ``emit_python_callback``'s checks."""
  result_avals = tuple(params["result_avals"])
  parts = _compat.io_callback_parts(params["callback"])
  if parts is None:   # bound by other code: called as it is
    callback, flat = params["callback"], True
  else:   # io_callback's: its steps without its pytree unflatten
    callback, flat = caller(*parts, ()), False
  leaves = tree_util.tree_leaves

  def convert(out):
    if not flat:   # what io_callback's flat callback returns
      out = [] if out is None else leaves(out)
    # io_callback_impl's tree_map(np.asarray, out) (of a list of leaves)
    return ([np.asarray(r) for r in out] if type(out) is list
            else tree_util.tree_map(np.asarray, out))

  # (JAX 0.12's io_callback_impl also runs it with no mesh: as its)
  no_mesh = (_compat.NO_MESH_SETTINGS if _compat.IO_CALLBACK_CLEARS_MESHES
             else ())
  check = functools.partial(check_results, result_avals=result_avals,
                            n_results=len(result_avals))
  host = _run_as_jax(callback, "an io_callback", _compat.callback_logger,
                     "jax.io_callback failed", no_mesh, convert, check)
  return _HostCallback(host, f"jax.experimental.io_callback {_ADOPTED}",
                       result_avals, user_code=True, instead=_NAMED_CALLBACK)


# --- jax.debug.print / jax.debug.log -----------------------------------------


def _reaches_into_arguments(fmt: str) -> bool:
  """Whether a field of ``fmt`` reaches into its argument (``{x.shape}``)."""
  try:
    return any("." in name or "[" in name for name in _printing.fields(fmt))
  except ValueError:   # JAX formats it and reports the error
    return True


def _plain_structure(node) -> bool:
  """Whether ``node`` (a print argument, leaves replaced by slots) is only
  tuples, lists and dicts around leaves."""
  if type(node) in (tuple, list):
    return all(_plain_structure(n) for n in node)
  if type(node) is dict:
    return all(_plain_structure(n) for n in node.values())
  return True


def print_edges(params: dict, avals: tuple) -> tuple:
  """For an adopted ``jax.debug.print``: per operand, the ``edges.Edges``
  NumPy prints of it under the call site's print options, or None (shown
  whole); ``()`` when every operand must pass whole (none summarized, no
  placeholders, or formatting more than the arrays' text)."""
  if not params["has_placeholders"] or not _formats_only_values(params):
    return ()
  options = dict(params["np_printoptions"])
  edges = tuple(
      None if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
      else _edges.plan(a.shape, options) for a in avals)
  return edges if any(e is not None for e in edges) else ()


def _formats_only_values(params: dict) -> bool:
  """Whether NumPy values can stand for the print's arrays."""
  args_, kwargs_ = slots(params["in_tree"])
  return not _reaches_into_arguments(params["fmt"]) and all(
      _plain_structure(a) for a in (*args_, *kwargs_.values()))


def _numpy_text(params: dict, edges: tuple):
  """``text(*np_operands)`` of a print whose values NumPy can stand for
  (:func:`_formats_only_values`) and whose static arguments are data
  (``host_specs.encode_tree``): ``jax_effects.print``'s formatter
  (``_printing.numpy_texts``, one frame for leaf arguments); else None."""
  in_tree = params["in_tree"]
  static = dict(params["static_args"])
  n = in_tree.num_leaves
  tree = tree_util.tree_unflatten(
      in_tree, [static[i] if i in static else Slot(i) for i in range(n)])
  try:
    args_data = _host_specs.encode_tree(tree, set(range(n)) - static.keys())
  except _host_specs.NotData:
    return None
  return _printing.numpy_texts(params["fmt"], args_data,
                               dict(params["np_printoptions"]),
                               edges or (None,) * (n - len(static)))


def _values_text(params: dict, edges: tuple, from_numpy: bool):
  """``text(*np_operands)`` where :func:`_numpy_text` has none: JAX's
  ``_format_print_callback`` of ``Value``s (``from_numpy``) or of real
  ``jax.Array``s."""
  fmt = params["fmt"]
  rebuild = rebuilder(params["in_tree"], params["static_args"])
  if params["has_placeholders"]:   # (under the call site's print options)
    text = _printing.formatted(fmt, rebuild, dict(params["np_printoptions"]))
  else:
    def text(values) -> str:
      args, kwargs = rebuild(values)
      assert not kwargs, "Format without placeholders should not have kwargs."
      return " ".join((fmt, *(str(a) for a in args)))

  if from_numpy:
    edges = edges or (None,) * (params["in_tree"].num_leaves
                                - len(params["static_args"]))

    def message(*operands) -> str:
      return text(_edges.host_values(operands, edges))
    return message
  put_all = putter()

  def message(*operands) -> str:
    device, sharding = cpu()
    values = put_all(operands, device, sharding)
    swapped = swap_settings(device, _compat.NO_MESH_SETTINGS)
    try:
      return text(values)
    finally:
      for state, previous in reversed(swapped):
        state.set_local(previous)
  return message


def debug_print(params: dict, avals: tuple, source_info=None) -> _HostCallback:
  """The ``HostCallback`` of an adopted ``jax.debug.print``/``log``: the
  text of JAX's ``_format_print_callback``, delivered through ``_output``
  (NumPy's edges of its operands: :func:`print_edges`). A format string
  that holds a traced value's text is warned of as ``jax_effects.print``
  warns, at the user's line (``source_info``'s)."""
  record = params["logging_record"]
  what = "jax.debug.print" if record is None else "jax.debug.log"
  _printing.warn_tracer_text_at(what, params["fmt"],
                                _compat.user_line(source_info))
  edges = print_edges(params, avals)
  from_numpy = _formats_only_values(params)
  message = ((params["has_placeholders"] and from_numpy
              and _numpy_text(params, edges))
             or _values_text(params, edges, from_numpy))
  deliver_line = _output.deliver_line
  deliver_record = _output.deliver_jax_record
  logger = _compat.debugging_logger

  def host(*operands):
    try:
      try:
        # (the text, then the line, in this frame: a line in a compiled
        # loop pays for every frame, issue 48)
        if record is None:
          deliver_line(message(*operands), True, False)   # (no prefix)
        else:
          rec = copy.copy(record)
          rec.msg = message(*operands)
          deliver_record(logger, rec)
      except BaseException:
        logger.exception("jax.debug.callback failed")   # as JAX's impl
        raise
    except Exception as exc:  # noqa: BLE001 - delivered as jax.jit would
      raise jax_error(exc) from exc
    return ()
  ours = "jax_effects.log" if record is not None else "jax_effects.print"
  return _HostCallback(host, f"{what}({params['fmt']!r}) {_ADOPTED}",
                       reads_placement=True, edges=edges,
                       instead=f"{ours}({params['fmt']!r}, ...) (the same "
                               f"format string and arguments)")


_token_pass.register_host_side(_compat.debug_print_p, debug_print)
_token_pass.register_host_side(_compat.debug_callback_p, debug_callback)
_token_pass.register_host_side(_compat.io_callback_p, io_callback)



"""The host side of JAX's own callbacks adopted by the pass (``_pass.adopted``).

What an adopted ``jax.debug.print``/``log``, ``jax.debug.callback`` or
``io_callback`` runs when its ``threaded_effect_p`` runs: JAX's semantics at
jax_effects' cost. A front end (it formats as ``_frontends.printing`` does),
so it registers itself with the pass (``_pass.adopted.register_host_side``)
instead of being imported by it. Its part in the token calling convention
is that of every effect's host side (``HostCallback.fn``: operands in as
NumPy arrays, results out); the host function around it
(``_primitives.host_functions``) handles the carrier.
What the user observes is JAX's:

* **Arguments.** ``jax.debug.callback`` and ``io_callback`` receive what
  JAX's impls give them: each operand as a committed ``jax.Array`` on the
  first CPU device, with ``jax_default_device`` set to that device (and, for
  ``debug.callback``, no mesh in effect). JAX builds them with
  ``jax.device_put`` (~30 us a call); here the same arrays come from the C++
  call it ends in (``_compat.batched_device_put``) and the settings are
  swapped directly (``_compat.default_device_setting``,
  ``NO_MESH_SETTINGS``).
* **Text.** ``jax.debug.print``/``log`` format as JAX's
  ``_format_print_callback`` does (``fmt.format`` under the traced NumPy
  print options, or ``" ".join`` without placeholders), but from the NumPy
  values: :class:`~jax_effects._frontends.printing.Value` formats,
  ``str``s and ``repr``s as the ``jax.Array`` JAX would build (its ``repr``
  builds one). Where a field reaches into an argument (``{x.shape}``,
  ``{x[0]}``) or an argument is a pytree node other than tuple/list/dict
  (whose ``repr`` may do anything with its leaves), real ``jax.Array`` s are
  built as for a callback. Lines go through
  :func:`jax_effects._runtime.output.deliver_jax_line` (stdout and
  listeners, held in the deterministic view), records through
  :func:`~jax_effects._runtime.output.deliver_jax_record`.
* **Results** (``io_callback``): checked and converted as JAX's
  ``emit_python_callback`` does (number, then shape and dtype after JAX's
  dtype canonicalization), with JAX's ``RuntimeError`` messages.
* **Errors.** An exception (``Exception``) of the user's function, of a
  result check or of formatting reaches the caller as ``jax.jit`` delivers
  it: :func:`jax_error`, a ``jax.errors.JaxRuntimeError`` (a
  ``RuntimeError``) with XLA's message, the original exception as its
  ``__cause__``. Delivered once, where ``design/errors.md`` says. A
  ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``,
  ``SystemExit``) stays itself.
* **Held output** (``deterministic()``): a callback runs user code, which
  cannot be held without moving it after the effects that follow it on its
  device; so the output held so far is released before the callback runs
  (:func:`jax_effects._runtime.output.release_held`): on each device, what
  the program printed before the callback comes out before what the
  callback writes.
"""
from __future__ import annotations

import copy
import string
from typing import Any, Callable

import jax
import numpy as np
from jax import tree_util

from jax_effects import _compat
from jax_effects._frontends import printing as _printing
from jax_effects._pass import adopted as _adopted
from jax_effects._primitives import edges as _edges
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._runtime import output as _output

# --- errors as jax.jit delivers them -----------------------------------------------

#: XLA's status prefix for a failed Python callback (jaxlib 0.8-0.10).
JAX_ERROR_PREFIX = "INTERNAL: CpuCallback error calling callback: "


def _traceback_text(exc: BaseException) -> str:
  """``exc`` as jaxlib puts it in the status message (nanobind's
  ``python_error::what()``): every frame of the stack at the raise, outermost
  first, without source lines, then ``Type: message``."""
  parts = []
  tb = exc.__traceback__
  if tb is not None:
    while tb.tb_next is not None:
      tb = tb.tb_next
    frames = []
    frame = tb.tb_frame
    while frame is not None:
      frames.append(frame)
      frame = frame.f_back
    parts.append("Traceback (most recent call last):\n")
    for frame in reversed(frames):
      code = frame.f_code
      parts.append(f'  File "{code.co_filename}", line {frame.f_lineno}, '
                   f"in {code.co_name}\n")
  parts.append(f"{type(exc).__name__}: ")
  try:
    parts.append(str(exc))
  except Exception:  # noqa: BLE001 - as jaxlib does
    parts.append("<exception str() failed>")
  return "".join(parts)


def jax_error(exc: Exception) -> jax.errors.JaxRuntimeError:
  """The error ``jax.jit`` raises when a host callback raised ``exc``,
  with ``exc`` as its ``__cause__``. Built where ``exc`` is caught, while
  the frames of its traceback are live (their line numbers are read)."""
  err = jax.errors.JaxRuntimeError(JAX_ERROR_PREFIX + _traceback_text(exc))
  err.__cause__ = exc
  return err


# --- arguments as JAX's impls give them ------------------------------------------------

_cpu_sharding: list = []


def _cpu():
  """``(device, sharding)``: the first local CPU device, where JAX's
  callback impls put the operands, and its ``SingleDeviceSharding``."""
  if not _cpu_sharding:
    try:
      device = jax.local_devices(backend="cpu")[0]
    except RuntimeError as e:
      raise RuntimeError(
          "jax.debug.callback failed to find a local CPU device to place the"
          " inputs on. Make sure \"cpu\" is listed in --jax_platforms or the"
          " JAX_PLATFORMS environment variable.") from e
    _cpu_sharding.append((device, jax.sharding.SingleDeviceSharding(device)))
  return _cpu_sharding[0]


def _avals() -> Callable[[np.ndarray], Any]:
  """``aval_of(x)``: the aval ``jax.device_put`` gives NumPy array ``x``
  (not weakly typed), cached by shape and dtype (a host function sees the
  same few)."""
  avals: dict = {}
  shaped = jax.core.ShapedArray

  def aval_of(x):
    key = (x.shape, x.dtype)
    aval = avals.get(key)
    if aval is None:
      aval = avals[key] = shaped(x.shape, x.dtype)
    return aval
  return aval_of


# The host functions below are written for speed (one frame per run; the
# settings swapped inline): they are JAX's impls (``debug_callback_impl``,
# ``io_callback_impl``) with ``jax.device_put`` and the ``with`` blocks
# replaced by what they do (``_compat``).

def debug_callback(params: dict) -> Callable[..., tuple]:
  """Host side of an adopted ``jax.debug.callback`` (``debug_callback_p``'s
  params): JAX's flat callback (merging static arguments, unflattening)
  called as ``debug_callback_impl`` calls it."""
  parts = _compat.debug_callback_parts(params["callback"])
  if parts is None:   # bound by other code: called as it is
    call = params["callback"]
  else:   # jax.debug.callback's: its steps without its pytree unflatten
    fn, in_tree, static_args = parts
    call = _caller(fn, in_tree, tuple(static_args.items()))
  aval_of = _avals()
  put = _compat.batched_device_put
  default_device = _compat.default_device_setting
  (concrete, no_concrete), (abstract, no_abstract) = _compat.NO_MESH_SETTINGS
  logger = _compat.debugging_logger
  release_held = _output.release_held
  defer = _output.defer_for_running_dispatch

  def host(*operands):
    failures = release_held()
    if failures:   # the held lines' sinks: their dispatch's errors, not this callback's
      defer(failures)
    try:
      device, sharding = _cpu()
      devices = [device]
      args = _explicit_puts(put, aval_of, sharding, devices, operands)
      d = default_device.swap_local(device)
      c = concrete.swap_local(no_concrete)
      a = abstract.swap_local(no_abstract)
      try:
        call(*args)
      except BaseException:
        logger.exception("jax.debug.callback failed")
        raise
      finally:
        abstract.set_local(a)
        concrete.set_local(c)
        default_device.set_local(d)
    except Exception as exc:  # noqa: BLE001 - delivered as jax.jit would
      raise jax_error(exc) from exc
    return ()
  return host


def _explicit_puts(put, aval_of, sharding, devices, operands) -> list:
  """``operands`` on ``devices`` as ``jax.device_put`` puts them: explicit
  transfers for ``jax.transfer_guard`` (JAX's impls call ``device_put``)."""
  state = _compat.transfer_guard_state()
  previous = state.explicit_device_put
  state.explicit_device_put = True
  try:
    return [put(aval_of(x), sharding, [x], devices, True) for x in operands]
  finally:
    state.explicit_device_put = previous


def io_callback(params: dict, result_avals: tuple) -> Callable[..., tuple]:
  """Host side of an adopted ``io_callback``: ``io_callback_impl`` (results
  as NumPy arrays) followed by ``emit_python_callback``'s checks."""
  parts = _compat.io_callback_parts(params["callback"])
  if parts is None:   # bound by other code: called as it is
    callback, flat = params["callback"], True
  else:   # io_callback's: its steps without its pytree unflatten
    callback, flat = _caller(*parts, ()), False
  leaves = tree_util.tree_leaves
  aval_of = _avals()
  put = _compat.batched_device_put
  default_device = _compat.default_device_setting
  logger = _compat.callback_logger
  release_held = _output.release_held
  defer = _output.defer_for_running_dispatch
  n_results = len(result_avals)

  def host(*operands):
    failures = release_held()
    if failures:   # the held lines' sinks: their dispatch's errors, not this callback's
      defer(failures)
    try:
      device, sharding = _cpu()
      devices = [device]
      args = _explicit_puts(put, aval_of, sharding, devices, operands)
      d = default_device.swap_local(device)
      try:
        out = callback(*args)
        if not flat:   # what io_callback's flat callback returns
          out = [] if out is None else leaves(out)
        # io_callback_impl's tree_map(np.asarray, out) (of a list of leaves)
        out = ([np.asarray(r) for r in out] if type(out) is list
               else tree_util.tree_map(np.asarray, out))
      except BaseException:
        logger.exception("jax.io_callback failed")
        raise
      finally:
        default_device.set_local(d)
      if not n_results and not out:
        return ()
      return check_results(out, result_avals, n_results)
    except Exception as exc:  # noqa: BLE001 - delivered as jax.jit would
      raise jax_error(exc) from exc
  return host


def canonical(x: np.ndarray) -> np.ndarray:
  """``x`` with JAX's canonical dtype (``jax.dtypes.canonicalize_dtype``:
  with ``jax_enable_x64`` off, 64-bit types are their 32-bit ones), as JAX
  converts a callback's results before it compares dtypes."""
  dtype = jax.dtypes.canonicalize_dtype(x.dtype)
  return x if x.dtype == dtype else np.asarray(x, dtype)


def check_results(out, result_avals: tuple, n_results: int) -> tuple:
  """JAX's checks of a callback's flat results (``emit_python_callback``),
  with its messages."""
  out = tuple(out)
  if len(out) != n_results:
    raise RuntimeError(
        "Mismatched number of outputs from callback. "
        f"Expected: {n_results}, Actual: {len(out)}")
  out = tuple(canonical(np.asarray(a)) for a in out)
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


# --- jax.debug.print / jax.debug.log ---------------------------------------------------

class _Slot:
  """Stands for flat argument ``i`` while the argument structure is read."""
  __slots__ = ("i",)

  def __init__(self, i):
    self.i = i


def _reaches_into_arguments(fmt: str) -> bool:
  """Whether a field of ``fmt`` (nested ones too) accesses an attribute or
  an item of its argument (``{x.shape}``, ``{0[1]}``)."""
  try:
    for _, name, spec, _ in string.Formatter().parse(fmt):
      if name is not None and ("." in name or "[" in name):
        return True
      if spec and _reaches_into_arguments(spec):
        return True
  except ValueError:   # JAX formats it and reports the error
    return True
  return False


def _plain_structure(node) -> bool:
  """Whether ``node`` (a print argument, its leaves replaced by slots) is a
  slot, a static leaf, or tuples, lists, dicts and None around them: things
  whose formatting only formats, ``str``s or ``repr``s the array leaves."""
  if type(node) in (tuple, list):
    return all(_plain_structure(n) for n in node)
  if type(node) is dict:
    return all(_plain_structure(n) for n in node.values())
  return True


def _rebuilder(in_tree, static_args) -> Callable[[list], tuple]:
  """``rebuild(dynamic_values) -> (args, kwargs)`` as JAX's
  ``merge_callback_args`` does, without a pytree unflatten when every
  argument is itself a leaf."""
  static = dict(static_args)
  n = in_tree.num_leaves
  slots = tree_util.tree_unflatten(in_tree, [_Slot(i) for i in range(n)])
  args, kwargs = slots
  dynamic = [i for i in range(n) if i not in static]
  where = {leaf: pos for pos, leaf in enumerate(dynamic)}

  def leaf(node):
    """How to get argument ``node``: ("d", k) dynamic value k, ("s", v)."""
    i = node.i
    return ("d", where[i]) if i in where else ("s", static[i])

  if all(type(a) is _Slot for a in args) and all(
      type(v) is _Slot for v in kwargs.values()):
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


def _caller(fn, in_tree, static_args) -> Callable[..., Any]:
  """``call(*values)``: ``fn(*args, **kwargs)`` with the arguments JAX's
  flat callback rebuilds from ``values``; ``fn`` itself when they are the
  positional arguments themselves (the common case: no frame of ours)."""
  n = in_tree.num_leaves
  args, kwargs = tree_util.tree_unflatten(in_tree,
                                          [_Slot(i) for i in range(n)])
  if (not static_args and not kwargs and len(args) == n
      and all(type(a) is _Slot and a.i == i for i, a in enumerate(args))):
    return fn
  rebuild = _rebuilder(in_tree, static_args)

  def call(*values):
    a, k = rebuild(values)
    return fn(*a, **k)
  return call


def print_edges(params: dict, avals: tuple) -> tuple:
  """For an adopted ``jax.debug.print``: one ``edges.Edges`` per operand that
  NumPy will print summarized under the print options its call site
  captured, None for one shown whole (``_primitives.edges.plan``); ``()``
  when every operand passes whole: none is summarized, the format has no
  placeholders (JAX then formats with the options of the callback's thread,
  unknown here), or it formats more than the arrays' text (a field reaching
  into an argument, an argument structure other than tuples, lists and
  dicts), which needs the whole array."""
  if not params["has_placeholders"] or not _formats_only_values(params):
    return ()
  options = dict(params["np_printoptions"])
  edges = tuple(
      None if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
      else _edges.plan(a.shape, options) for a in avals)
  return edges if any(e is not None for e in edges) else ()


def _formats_only_values(params: dict) -> bool:
  """Whether formatting the print's arguments only ``str``s, ``repr``s or
  formats the array values (then NumPy values stand for them)."""
  in_tree = params["in_tree"]
  args_, kwargs_ = tree_util.tree_unflatten(
      in_tree, [_Slot(i) for i in range(in_tree.num_leaves)])
  return not _reaches_into_arguments(params["fmt"]) and all(
      _plain_structure(a) for a in (*args_, *kwargs_.values()))


def debug_print(params: dict, edges: tuple = ()) -> Callable[..., tuple]:
  """Host side of an adopted ``jax.debug.print``/``jax.debug.log``
  (``debug_print_p``'s params): the text of JAX's ``_format_print_callback``,
  delivered through ``_output``. ``edges``: :func:`print_edges` (the
  operands that arrive as their edges, formatted as the whole arrays)."""
  fmt = params["fmt"]
  options = dict(params["np_printoptions"])
  has_placeholders = params["has_placeholders"]
  record = params["logging_record"]
  in_tree = params["in_tree"]
  rebuild = _rebuilder(in_tree, params["static_args"])
  from_numpy = _formats_only_values(params)
  Value = _printing.Value
  get_printoptions = np.get_printoptions
  printoptions = np.printoptions
  deliver_line = _output.deliver_jax_line
  deliver_record = _output.deliver_jax_record
  logger = _compat.debugging_logger

  def text(values) -> str:
    args, kwargs = rebuild(values)
    if not has_placeholders:
      assert not kwargs, "Format without placeholders should not have kwargs."
      return " ".join((fmt, *(str(a) for a in args)))
    if get_printoptions() == options:
      return fmt.format(*args, **kwargs)
    with printoptions(**options):
      return fmt.format(*args, **kwargs)

  if edges:   # (only where from_numpy)
    Summarized = _edges.Summarized
    shapes = [None if e is None else e.shape for e in edges]

    def message(operands) -> str:
      return text([Value(x) if s is None else Summarized(x, s)
                   for x, s in zip(operands, shapes)])
  elif from_numpy:
    def message(operands) -> str:
      return text([Value(x) for x in operands])
  else:
    aval_of = _avals()
    put = _compat.batched_device_put
    default_device = _compat.default_device_setting
    (concrete, no_concrete), (abstract, no_abstract) = (
        _compat.NO_MESH_SETTINGS)

    def message(operands) -> str:
      device, sharding = _cpu()
      values = [put(aval_of(x), sharding, [x], [device], True)
                for x in operands]
      d = default_device.swap_local(device)
      c = concrete.swap_local(no_concrete)
      a = abstract.swap_local(no_abstract)
      try:
        return text(values)
      finally:
        abstract.set_local(a)
        concrete.set_local(c)
        default_device.set_local(d)

  def host(*operands):
    try:
      try:
        msg = message(operands)
        if record is not None:
          rec = copy.copy(record)
          rec.msg = msg
          deliver_record(logger, rec)
        else:
          deliver_line(msg)
      except BaseException:
        logger.exception("jax.debug.callback failed")   # as JAX's impl
        raise
    except Exception as exc:  # noqa: BLE001 - delivered as jax.jit would
      raise jax_error(exc) from exc
    return ()
  return host


# --- registered with the pass -------------------------------------------------------

_ADOPTED = "(adopted by jax_effects.jit)"


def _print_host_callback(params: dict,
                         avals: tuple) -> _host_callback.HostCallback:
  what = "jax.debug.log" if params.get("logging_record") else "jax.debug.print"
  edges = print_edges(params, avals)
  return _host_callback.HostCallback(debug_print(params, edges),
                            f"{what}({params['fmt']!r}) {_ADOPTED}",
                            reads_placement=True, edges=edges)


def _debug_callback_host_callback(params: dict,
                                  avals: tuple) -> _host_callback.HostCallback:
  del avals
  return _host_callback.HostCallback(debug_callback(params),
                            f"jax.debug.callback {_ADOPTED}")


def _io_callback_host_callback(params: dict,
                               avals: tuple) -> _host_callback.HostCallback:
  del avals
  result_avals = tuple(params["result_avals"])
  return _host_callback.HostCallback(io_callback(params, result_avals),
                            f"jax.experimental.io_callback {_ADOPTED}",
                            result_avals)


_adopted.register_host_side(_compat.debug_print_p, _print_host_callback)
_adopted.register_host_side(_compat.debug_callback_p,
                            _debug_callback_host_callback)
_adopted.register_host_side(_compat.io_callback_p, _io_callback_host_callback)

"""The host side of JAX's own callbacks adopted by the pass (``_pass.adopted``).

What an adopted ``jax.debug.print``/``log``, ``jax.debug.callback`` or
``io_callback`` runs when its ``threaded_effect_p`` runs: JAX's semantics at
jax_effects' cost. A front end (it formats as ``_frontends.printing`` does),
so it registers itself with the pass (``_pass.adopted.register_host_side``)
instead of being imported by it. Its part in the token calling convention
is that of every effect's host side (``HostCallback.fn``: operands in as
NumPy arrays, results out); the host function around it
(``_primitives.host_functions``) handles the carrier.
What the user observes is JAX's (the calling convention JAX's impls keep
around a callback is ``jax_calling``'s):

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
  it: :func:`jax_calling.jax_error`, a ``jax.errors.JaxRuntimeError`` (a
  ``RuntimeError``) with XLA's message, the original exception as its
  ``__cause__``. Delivered once, where ``design/errors.md`` says. A
  ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``,
  ``SystemExit``) stays itself.
* **Held output** (``deterministic()``): a callback runs user code, which
  cannot be held without moving it after the effects that follow it on its
  device; so the output held so far is released before the callback runs
  (:func:`jax_effects._runtime.output.release_in_callback`): on each device, what
  the program printed before the callback comes out before what the
  callback writes. Per device (``shard_map``/``pmap``) that release would
  leave every device's output unsorted, against what ``deterministic()``
  promises: there the callback is refused instead (a ``RuntimeError``
  per device, reported as callbacks' errors are).
"""
from __future__ import annotations

import copy
import string
from typing import Callable

import jax
import numpy as np
from jax import tree_util

from jax_effects import _compat
from jax_effects._frontends import jax_calling as _jc
from jax_effects._frontends import printing as _printing
from jax_effects._pass import adopted as _adopted
from jax_effects._primitives import edges as _edges
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._runtime import output as _output
from jax_effects._runtime import placement as _placement


def _refuse_if_held(what: str) -> None:
  """Inside ``deterministic()``, a per-device ``jax.debug.callback`` or
  ``io_callback`` is refused: it runs user code, which cannot be held
  without moving it after the effects that follow it on its device, and
  releasing the held output before it (on the first device to reach it)
  leaves that output unsorted; so the sorted, byte-identical output
  ``deterministic()`` promises cannot be kept (``design/placement.md``)."""
  p = _placement.current()
  if p is not None and p.per_device:
    raise RuntimeError(
        f"jax_effects.deterministic(): {what} inside shard_map/pmap (per "
        f"device) cannot be kept in the fixed order deterministic() promises "
        f"(it runs your code, which cannot be held, so every device's output "
        f"would come out unsorted); refused. Use jax_effects.print/log "
        f"there, move the callback out of the per-device code, or call the "
        f"function outside the deterministic() block")


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
    call = _jc.caller(fn, in_tree, tuple(static_args.items()))
  put_all = _jc.putter()
  default_device = _compat.default_device_setting
  (concrete, no_concrete), (abstract, no_abstract) = _compat.NO_MESH_SETTINGS
  logger = _compat.debugging_logger
  release = _output.release_in_callback
  holding = _output.holding

  def host(*operands):
    if holding():
      _refuse_if_held("a jax.debug.callback")
    release()   # (what held lines' sinks raise: their dispatch's errors)
    try:
      device, sharding = _jc.cpu()
      args = put_all(operands, device, sharding)
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
      raise _jc.jax_error(exc) from exc
    return ()
  return host


def io_callback(params: dict, result_avals: tuple) -> Callable[..., tuple]:
  """Host side of an adopted ``io_callback``: ``io_callback_impl`` (results
  as NumPy arrays) followed by ``emit_python_callback``'s checks."""
  parts = _compat.io_callback_parts(params["callback"])
  if parts is None:   # bound by other code: called as it is
    callback, flat = params["callback"], True
  else:   # io_callback's: its steps without its pytree unflatten
    callback, flat = _jc.caller(*parts, ()), False
  leaves = tree_util.tree_leaves
  put_all = _jc.putter()
  default_device = _compat.default_device_setting
  # (JAX 0.12's io_callback_impl also runs it with no mesh: as its)
  no_mesh = (_compat.NO_MESH_SETTINGS if _compat.IO_CALLBACK_CLEARS_MESHES
             else ())
  logger = _compat.callback_logger
  release = _output.release_in_callback
  holding = _output.holding
  n_results = len(result_avals)

  def host(*operands):
    if holding():
      _refuse_if_held("an io_callback")
    release()   # (what held lines' sinks raise: their dispatch's errors)
    try:
      device, sharding = _jc.cpu()
      args = put_all(operands, device, sharding)
      d = default_device.swap_local(device)
      meshes = [state.swap_local(none) for state, none in no_mesh]
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
        for (state, _), previous in zip(no_mesh[::-1], meshes[::-1]):
          state.set_local(previous)
        default_device.set_local(d)
      if not n_results and not out:
        return ()
      return _jc.check_results(out, result_avals, n_results)
    except Exception as exc:  # noqa: BLE001 - delivered as jax.jit would
      raise _jc.jax_error(exc) from exc
  return host


# --- jax.debug.print / jax.debug.log ---------------------------------------------------


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
      in_tree, [_jc.Slot(i) for i in range(in_tree.num_leaves)])
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
  rebuild = _jc.rebuilder(in_tree, params["static_args"])
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
    aval_of = _jc.avals()
    put = _compat.batched_device_put
    default_device = _compat.default_device_setting
    (concrete, no_concrete), (abstract, no_abstract) = (
        _compat.NO_MESH_SETTINGS)

    def message(operands) -> str:
      device, sharding = _jc.cpu()
      values = _jc.explicit_puts(put, aval_of, sharding, [device], operands)
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
      raise _jc.jax_error(exc) from exc
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
                            f"jax.debug.callback {_ADOPTED}",
                            user_code=True)


def _io_callback_host_callback(params: dict,
                               avals: tuple) -> _host_callback.HostCallback:
  del avals
  result_avals = tuple(params["result_avals"])
  return _host_callback.HostCallback(io_callback(params, result_avals),
                            f"jax.experimental.io_callback {_ADOPTED}",
                            result_avals, user_code=True)


_adopted.register_host_side(_compat.debug_print_p, _print_host_callback)
_adopted.register_host_side(_compat.debug_callback_p,
                            _debug_callback_host_callback)
_adopted.register_host_side(_compat.io_callback_p, _io_callback_host_callback)

"""``jax_effects.print``: formatted lines from compiled code, in order.

The format is checked when the call is traced, naming the format string and
the field; at run time the host callback formats the values as
``jax.debug.print`` does and hands the line to ``_runtime.output``
(``design/formatting.md``). Part in the token calling convention: that of
every effect (one ``effect_p``; the pass adds the token and carrier).

Also ``jax_effects.batched``, the block whose loops' prints and logs reach
the host in flushes, not one host call a step: a ``print``/``log`` bound
inside it is offered for batching (``_primitives/batching``), and a
``scan``, ``fori_loop`` or ``while_loop`` holding it stages its rows on the
device and flushes them to the host every ``K`` rows and at its exit
(``_pass/staging``; ``design/tokens.md``, "Batched effects in loops"); a
flush is a host call on the effects' chain.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import os
import re
import string
import warnings
from typing import Any, Iterator

import jax
import numpy as np

from jax_effects._core import effects as _effects
from jax_effects._core.effects import Effect
from jax_effects._frontends import arguments as _arguments
from jax_effects._primitives import batching as _batching
from jax_effects._primitives import edges as _edges
from jax_effects._primitives import effect as _effect
from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_functions as _host_functions
from jax_effects._primitives import host_specs as _host_specs
from jax_effects._runtime import output as _output

# --- trace-time checks -------------------------------------------------------

class _Probe:
  """Stands for an argument during the trace-time format check."""
  __slots__ = ("used",)

  def __init__(self):
    self.used = False

  def __format__(self, spec=""):
    self.used = True
    return ""

  __str__ = __repr__ = __format__


_FORMATTER = string.Formatter()


def fields(fmt: str):
  """Yields every replacement field's name, nested ones (``{:{w}}``) too."""
  for _, name, spec, _ in _FORMATTER.parse(fmt):
    if name is not None:
      yield name
      if spec:
        yield from fields(spec)


def check_format(what: str, fmt: Any, args: tuple, kwargs: dict) -> None:
  """Raises ValueError/TypeError naming ``fmt`` if it does not fit the args
  or a field reaches into an argument (``{0.shape}``, ``{x[0]}``)."""
  if not isinstance(fmt, str):
    raise TypeError(f"{what}: the format must be a str, got {type(fmt).__name__}")
  try:
    names = list(fields(fmt))
  except ValueError as err:
    raise ValueError(f"{what}: bad format string {fmt!r}: {err}") from None
  for name in names:
    cut = min((i for i in (name.find("."), name.find("[")) if i >= 0),
              default=-1)
    if cut >= 0:
      raise ValueError(
          f"{what}: format string {fmt!r} has the field {{{name}}}, which "
          f"accesses {name[cut:]!r} of argument {name[:cut] or '#auto'!r}; "
          f"jax_effects formats whole arguments only (the host never "
          f"evaluates attribute or index access on your data): pass the part "
          f"you need as an argument of its own, e.g. "
          f"print('{{}}', x.shape) or print('{{}}', x[0])")
  probes = [_Probe() for _ in args]
  kw_probes = {k: _Probe() for k in kwargs}
  try:
    fmt.format(*probes, **kw_probes)
  except IndexError:
    raise ValueError(
        f"{what}: format string {fmt!r} refers to more positional arguments "
        f"than the {len(args)} given") from None
  except KeyError as err:
    raise ValueError(
        f"{what}: format string {fmt!r} refers to keyword argument "
        f"{err.args[0]!r}, which was not given (given: {sorted(kwargs)})") from None
  except ValueError as err:
    raise ValueError(f"{what}: bad format string {fmt!r}: {err}") from None
  unused = [f"#{i}" for i, p in enumerate(probes) if not p.used]
  unused += [repr(k) for k, p in kw_probes.items() if not p.used]
  if unused:
    printf = _PRINTF.findall(fmt)
    hint = ("; its fields are str.format's {} (\"{}\", \"{0}\", "
            "\"{name}\", \"{:.3f}\")")
    if printf:
      hint += (f", not printf-style ({', '.join(sorted(set(printf)))}: "
               f"%-formatting is not supported): write e.g. "
               f"{_PRINTF.sub('{}', fmt)!r}")
    raise ValueError(
        f"{what}: format string {fmt!r} does not use argument(s) "
        f"{', '.join(unused)}{hint}")


#: A printf-style conversion (``%s``, ``%d``, ``%.3f``, ``%(name)s``).
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(?:\d+|\*)?(?:\.\d+)?"
                     r"[diouxXeEfFgGcrsa]")

#: A traced value's repr, as an f-string or ``str()`` puts it in a format
#: string (``JitTracer(float32[])``, older JAX ``Traced<...>``).
_TRACER_TEXT = re.compile(r"\b\w*Tracer\([^)]*\)|Traced<")


# file name -> the registry of warn_tracer_text_at's warnings from its lines
# (``warnings``' ``__warningregistry__`` of a module: once per line under
# the default filter).
_registries: dict[str, dict] = {}


def warn_tracer_text_at(what: str, fmt: str, where, stacklevel: int = 2) -> None:
  """Warns where the format string ``fmt`` holds the text of a traced value
  (``print``'s and ``log``'s, from :func:`formatter`; an adopted
  ``jax.debug.print``'s, seen by the pass, traced earlier): at ``where``,
  ``(file name, line)`` of the call, or where None at ``stacklevel`` (as
  ``warnings.warn``'s, counted from here)."""
  found = _TRACER_TEXT.search(fmt) if "Trace" in fmt else None
  if found is None:
    return
  message = (f"{what}: the format string holds {found.group(0)!r}, the text "
             f"of a traced value (an f-string or str() of it, made when the "
             f"function was traced), so every run prints that text, not the "
             f"value. Pass the value as an argument: {what.split('(', 1)[0]}"
             f"(\"loss={{}}\", loss)")
  if where is None:
    warnings.warn(message, TracedTextWarning, stacklevel=stacklevel)
    return
  filename, lineno = where
  module = os.path.splitext(os.path.basename(filename))[0] or "<unknown>"
  warnings.warn_explicit(message, TracedTextWarning, filename, lineno,
                         module=module,
                         registry=_registries.setdefault(filename, {}))


class TracedTextWarning(UserWarning):
  """A ``print``/``log`` format string that holds the text of a traced
  value (``jax_effects.print(f"loss={loss}")`` under ``jit``)."""


def _format_known(fmt: str, args, kwargs, run_time_only: set[int]) -> None:
  """Formats ``fmt`` as ``str.format`` does, but for the fields whose spec
  takes a value from an argument in ``run_time_only`` (ids), known at run
  time only (``{:>{w}}``, ``w`` an array)."""
  auto = 0

  def value(name):
    nonlocal auto
    if name == "":
      name, auto = str(auto), auto + 1
    return _FORMATTER.get_value(int(name) if name.isdigit() else name,
                                args, kwargs)

  for _, name, spec, conversion in _FORMATTER.parse(fmt):
    if name is None:
      continue
    x = _FORMATTER.convert_field(value(name), conversion)
    parts, known = [], True
    for literal, inner, inner_spec, inner_conversion in _FORMATTER.parse(spec):
      parts.append(literal)
      if inner is None:
        continue
      w = value(inner)
      if id(w) in run_time_only:
        known = False
      else:
        parts.append(format(_FORMATTER.convert_field(w, inner_conversion),
                            inner_spec))
    if known:
      format(x, "".join(parts))


def check_format_specs(what: str, fmt: str, fa: _arguments.Formatting) -> None:
  """Formats zero-valued stand-ins (broadcast views of one zero) of the
  operands, so that a spec not fitting them (``"{:d}"`` of a float) fails
  at trace time, naming ``fmt``. Without a spec (``"{}"``, ``"{!r}"``)
  every field fits (:func:`check_format` checked the names): nothing is
  formatted."""
  if not any(spec for _, name, spec, _ in _FORMATTER.parse(fmt)
             if name is not None):
    return
  samples = [Value(np.broadcast_to(np.zeros((), x.dtype), np.shape(x)))
             for x in fa.operands]
  a, k = fa.rebuild(samples)
  try:
    _format_known(fmt, a, k, {id(v) for v in samples})
  except (ValueError, TypeError) as err:
    raise ValueError(
        f"{what}: format string {fmt!r} does not fit its arguments: "
        f"{err}") from None


# --- run-time formatting -----------------------------------------------------

@functools.cache
def _cpu():
  """The first local CPU device (where ``jax.debug.print`` puts values), or
  None where JAX has no CPU backend."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


#: An array operand as the host callback formats it (``_edges.Value``).
Value = _edges.Value


def formatter(what: str, fmt: str, args: tuple, kwargs: dict):
  """Checks ``fmt`` against the arguments; returns ``(operands, eager, jit,
  edges, spec)``.

  ``jit(*np_operands)`` and ``eager(*operands)`` return the text of values
  from a compiled computation and of values outside any trace. ``edges``:
  per operand, the ``_edges.Edges`` NumPy shows of it here (it arrives cut
  to them), or None. ``spec``: :func:`text_spec`.
  """
  check_format(what, fmt, args, kwargs)
  warn_tracer_text_at(what, fmt, None, stacklevel=4)   # (print's caller)
  fa = _arguments.split_for_format(what, args, kwargs)
  check_format_specs(what, fmt, fa)
  options = np.get_printoptions()
  edges = tuple(_edges.plan(np.shape(x), options) for x in fa.operands)
  spec = text_spec(fmt, fa, args, kwargs, options, edges)
  jit = (numpy_texts(fmt, spec["args"], options, edges)
         if isinstance(spec, dict) else _texts(fmt, fa.rebuild, options, edges))
  fmt_values = formatted(fmt, fa.rebuild, options)

  def eager(*operands):
    cpu = _cpu()
    values = []
    for x, impl in zip(operands, fa.key_impls):
      if impl is not None:
        x = jax.random.wrap_key_data(x, impl=impl)
      values.append(jax.device_put(x, cpu))
    return fmt_values(values)

  return fa.operands, eager, jit, edges, spec


# NumPy >= 2.1 keeps the print options in a ContextVar whose dict
# ``set_printoptions``/``printoptions`` replace and never change, so the
# dict found equal to a call site's options once is known equal while it is
# the current one (``np.get_printoptions()`` copies and converts it, ~1-4 us
# a line). NumPy 2.0 keeps one dict for the process, changed in place:
# compared on every line there.
try:
  from numpy._core.printoptions import format_options as _np_format_options
except ImportError:   # NumPy 2.0
  _np_format_options = None


def _options_check(options: dict):
  """``(current, same, match)``: ``current() is same[0] or match()`` tells
  whether the calling thread's NumPy print options are ``options`` (as
  ``np.get_printoptions() == options`` does), ``current() is same[0]``
  without a call of ours once they were found equal."""
  same = [None]
  if _np_format_options is None:
    def match():
      return np.get_printoptions() == options
    return (lambda: False), same, match
  current = _np_format_options.get

  def match():
    found = current()
    if np.get_printoptions() == options:
      same[0] = found
      return True
    return False
  return current, same, match


def formatted(fmt: str, rebuild, options: dict):
  """``text(values)``: ``fmt`` formatted under the NumPy print ``options``."""
  current, same, match = _options_check(options)

  def fmt_values(values):
    a, k = rebuild(values)
    if current() is same[0] or match():
      return fmt.format(*a, **k)
    with np.printoptions(**options):
      return fmt.format(*a, **k)
  return fmt_values


def _texts(fmt: str, rebuild, options: dict, edges: tuple):
  """``jit(*np_operands)``: the text of the values a computation passes."""
  fmt_values = formatted(fmt, rebuild, options)
  if any(e is not None for e in edges):
    def jit(*np_operands):
      return fmt_values(_edges.host_values(np_operands, edges))
  else:
    def jit(*np_operands):
      return fmt_values([Value(x) for x in np_operands])
  return jit


def _conversions(fmt: str) -> bool:
  """Whether a field of ``fmt`` (nested ones too) has a conversion (``!r``)."""
  return any(name is not None and (conversion or (spec and _conversions(spec)))
             for _, name, spec, conversion in _FORMATTER.parse(fmt))


def _one_field(fmt: str) -> tuple[str, str, str] | None:
  """``(before, spec, after)`` where ``fmt`` has one field, without a
  conversion or nested fields, naming the first positional argument
  (``"loss {:.3f}!"``): ``fmt.format(v)`` is then
  ``before + format(v, spec) + after`` (what ``str.format`` does for it),
  without parsing ``fmt`` per line; else None."""
  parts = list(_FORMATTER.parse(fmt))
  named = [p for p in parts if p[1] is not None]
  if (len(named) != 1 or named[0][1] not in ("", "0") or named[0][3]
      or "{" in named[0][2]):
    return None
  at = parts.index(named[0])
  before = "".join(p[0] for p in parts[:at + 1])
  after = "".join(p[0] for p in parts[at + 1:])
  return before, named[0][2], after


def _single_text(fmt: str, scalars: bool, current, same, match,
                 options: dict):
  """:func:`_flat_texts` of ``print("...{}...", x)``, the most common form;
  ``jit.line_at(ordered, running)`` is ``print``'s host function with
  :func:`_output.deliver_line_at`, in one frame."""
  one = _one_field(fmt)
  item_dtype = None   # (the operand's dtype, once it formats as .item())

  def jit(x):
    nonlocal item_dtype
    if x.dtype is item_dtype and x.ndim == 0:
      v = x.item()
    elif scalars and x.ndim == 0:
      v = x[()]
      if _edges.formats_as_item(x.dtype):
        item_dtype = x.dtype
    else:
      v = Value(x)
    if current() is same[0] or match():
      return fmt.format(v)
    with np.printoptions(**options):
      return fmt.format(v)
  jit.runs_no_user_code = True
  if one is None:
    return jit
  before, spec, after = one   # (no conversion: ``scalars``)

  def line_at(ordered: bool, running: tuple):
    deliver = _output.line_at(ordered, running)

    def emit_at(x):
      nonlocal item_dtype
      if x.dtype is item_dtype and x.ndim == 0:
        v = x.item()
      elif x.ndim == 0:
        v = x[()]
        if _edges.formats_as_item(x.dtype):
          item_dtype = x.dtype
      else:
        v = Value(x)
      if current() is same[0] or match():
        deliver(before + format(v, spec) + after)
      else:
        with np.printoptions(**options):
          text = before + format(v, spec) + after
        deliver(text)
      return ()
    return emit_at
  jit.line_at = line_at

  def lines_at(ordered: bool, running: tuple):
    deliver_all = _output.lines_at(ordered, running)

    def emit_rows(column):
      # (a 1-D column of rows: each row's 0-d value as emit_at takes it)
      values = (column.tolist() if _edges.formats_as_item(column.dtype)
                else list(column))
      if current() is same[0] or match():
        texts = [before + format(v, spec) + after for v in values]
      else:
        with np.printoptions(**options):
          texts = [before + format(v, spec) + after for v in values]
      deliver_all(texts)
    return emit_rows
  jit.lines_at = lines_at
  return jit


def _flat_texts(fmt: str, args_data, options: dict, edges: tuple):
  """:func:`_texts` for a spec whose arguments and keyword arguments are all
  leaves (``print("{} {:.3f}", 3, x)``), or None: the values put straight
  into ``fmt.format`` in one frame (a line in a compiled loop pays for
  every frame, issue 48). Where no field has a conversion, a 0-d operand
  shown whole goes in as its NumPy scalar: a field without conversion
  formats its value with ``format(value, spec)``, and ``Value.__format__``
  is ``format`` of that scalar, so the text is the same."""
  flat = _host_specs.flat_arguments(args_data)
  if flat is None:
    return None
  items, slots, keys, kw_items, kw_slots = flat
  scalars = not _conversions(fmt)
  wraps = tuple(Value if e is None else
                (lambda x, shape=e.shape: _edges.Summarized(x, shape))
                for e in edges)
  current, same, match = _options_check(options)
  if (len(items) == 1 and slots == [(0, 0)] and not keys
      and edges == (None,)):
    return _single_text(fmt, scalars, current, same, match, options)

  def jit(*np_operands):
    values = [x[()] if scalars and e is None and x.ndim == 0 else wrap(x)
              for x, e, wrap in zip(np_operands, edges, wraps)]
    a = list(items)
    for i, j in slots:
      a[i] = values[j]
    k = dict(zip(keys, kw_items))
    for key, j in kw_slots:
      k[key] = values[j]
    if current() is same[0] or match():
      return fmt.format(*a, **k)
    with np.printoptions(**options):
      return fmt.format(*a, **k)
  jit.runs_no_user_code = True   # (static leaves are str, numbers, None)
  return jit


def text_spec(fmt: str, fa, args: tuple, kwargs: dict, options: dict,
              edges: tuple) -> dict | str:
  """The formatted text as data (``_primitives.host_specs``), or why it is
  not data (a str)."""
  if options.get("formatter") is not None or options.get(
      "override_repr") is not None:
    return ("its NumPy print options hold functions (formatter= or "
            "override_repr=)")
  try:
    tree = _host_specs.encode_tree((args, kwargs), set(fa.positions))
    _host_specs.dumps(options)
  except _host_specs.NotData as err:
    return (f"its arguments have {err} (pass str(value), a number or an "
            f"array instead)")
  except (TypeError, ValueError):
    return "its NumPy print options are not data"
  return {"fmt": fmt, "args": tree, "options": dict(options),
          "edges": [None if e is None else [list(e.shape), e.edgeitems]
                    for e in edges]}


def spec_edges(spec: dict) -> tuple:
  """The operands' ``Edges`` of a :func:`text_spec`."""
  return tuple(None if e is None else _edges.Edges(tuple(e[0]), e[1])
               for e in spec["edges"])


def check_text_spec(what: str, spec) -> None:
  """Checks a :func:`text_spec` from a module (exported, cached) as
  :func:`check_format` checks a traced one; raises ``host_specs.NotData``."""
  if not isinstance(spec, dict) or not isinstance(spec.get("fmt"), str):
    raise _host_specs.NotData(f"{what}: a text spec without a format string")
  n = _host_specs.check_tree(spec.get("args"), f"{what}: its arguments")
  tree = _host_specs.decode_tree(spec["args"], [0] * n)
  args, kwargs = (tree if type(tree) is tuple and len(tree) == 2
                  else (None, None))
  if type(args) is not tuple or type(kwargs) is not dict:
    raise _host_specs.NotData(f"{what}: arguments that are not (args, "
                              f"kwargs)")
  options = spec.get("options")
  if not isinstance(options, dict) or not all(
      type(k) is str and type(v) in (str, int, float, bool, type(None))
      for k, v in options.items()):
    raise _host_specs.NotData(f"{what}: print options that are not data")
  edges = spec.get("edges")
  if not isinstance(edges, list) or not all(
      e is None or (isinstance(e, list) and len(e) == 2
                    and isinstance(e[0], list)
                    and all(type(d) is int for d in e[0])
                    and type(e[1]) is int) for e in edges):
    raise _host_specs.NotData(f"{what}: operand edges that are not data")
  try:
    check_format(what, spec["fmt"], args, kwargs)
  except (ValueError, TypeError) as err:
    raise _host_specs.NotData(str(err)) from None


def text_from_spec(spec: dict, what: str = "jax_effects.print"):
  """``jit(*np_operands)`` of a :func:`text_spec`, checked first
  (:func:`check_text_spec`)."""
  check_text_spec(what, spec)
  return numpy_texts(spec["fmt"], spec["args"], spec["options"],
                     spec_edges(spec))


def numpy_texts(fmt: str, args_data, options: dict, edges: tuple):
  """``jit(*np_operands)``: the text of ``fmt`` formatted with the arguments
  ``args_data`` (``host_specs.encode_tree``'s) under the NumPy print
  ``options``, an operand ``i`` shown whole (``Value``) or summarized by
  ``edges[i]``; in one frame where the arguments are all leaves
  (:func:`_flat_texts`). Also an adopted ``jax.debug.print``'s text
  (``_frontends.adopted_host``)."""
  return (_flat_texts(fmt, args_data, options, edges)
          or _texts(fmt, _host_specs.tree_decoder(args_data), options, edges))


def _emit_line(jit, ordered: bool):
  def emit(*np_operands):
    _output.deliver_line(jit(*np_operands), ordered)
    return ()
  if hasattr(jit, "line_at"):
    setattr(emit, _host_functions.PLACED, functools.partial(jit.line_at, ordered))
    setattr(emit, _batching.PLACED_ROWS, functools.partial(jit.lines_at, ordered))
  elif getattr(jit, "runs_no_user_code", False):
    # (nothing of the user's runs before the write, which clears the site:
    # the placement can be given instead of set)
    def placed(running):
      deliver = _output.line_at(ordered, running)

      def emit_at(*np_operands):
        deliver(jit(*np_operands))
        return ()
      return emit_at
    setattr(emit, _host_functions.PLACED, placed)
  return emit


def _print_host(spec: dict) -> _host_callback.HostCallback:
  """The host side of a ``print`` spec, in any process."""
  text = spec["text"]
  return _host_callback.HostCallback(
      _emit_line(text_from_spec(text), spec["ordered"]), spec["what"],
      reads_placement=True, edges=spec_edges(text), spec=spec)


_host_specs.register_kind("print", _print_host)


def print(fmt: str, *args: Any, ordered: bool | None = None,  # noqa: A001
          effect: Effect | None = None, **kwargs: Any) -> None:
  """Prints ``fmt.format(*args, **kwargs)`` when the computation runs.

  Works inside and outside ``jax_effects.jit`` (outside any trace it prints
  immediately). Ordered (the default: ``ordered=None`` takes
  ``effect.ordered``, True unless the :class:`Effect` was created with
  ``ordered=False``), it keeps program order with every other ordered effect
  of the same ``effect`` (default :data:`jax_effects.DEFAULT`, shared with
  ``log`` and ``callback``).

  Arguments are formatted as ``jax.debug.print`` formats them (array leaves
  as ``jax.Array`` values, other leaves as they are, under the NumPy print
  options at the call), except Python numbers, static and formatted as
  Python formats them (``print("{}", x.shape)`` prints ``(2, 3)``). Fields
  name whole arguments, with conversions and format specs (``{x!r}``,
  ``{:.3f}``); attribute or index access (``{x.shape}``) is an error. See
  ``design/formatting.md``.

  In per-device code (``shard_map``, ``pmap``) every device prints its own
  line, prefixed with where it ran: ``[device D shard S process P] text``
  (``S`` is the position in the mesh: ``3``, or ``(1, 2)`` for a 2-D mesh);
  see ``design/placement.md``.
  """
  what = f"jax_effects.print({fmt!r})"
  effect, ordered = _effects.resolve(what, effect, ordered)
  operands, eager, jit, edges, text = formatter(what, fmt, args, kwargs)
  spec = ({"kind": "print", "what": what, "text": text, "ordered": ordered}
          if isinstance(text, dict) else text)
  _effect.bind_effect(_emit_line(jit, ordered), what, operands,
                          effect=effect, ordered=ordered,
                          eager=_emit_line(eager, ordered),
                          reads_placement=True, edges=edges, spec=spec,
                          batchable=True)


# --- jax_effects.batched -----------------------------------------------------

#: The default staging budget of one loop and chain: 1 MiB.
MAX_BYTES = 1 << 20


def _positive_int(what: str, name: str, value) -> int:
  try:
    n = operator.index(value)
  except TypeError:
    raise TypeError(f"{what}: {name} must be an int, got "
                    f"{type(value).__name__}") from None
  if n < 1:
    raise ValueError(f"{what}: {name} must be at least 1, got {n}")
  return n


@contextlib.contextmanager
def batched(k: int = 128, *, max_bytes: int = MAX_BYTES) -> Iterator[None]:
  """Batches the loops' prints and logs traced inside the block.

  Inside a compiled loop (``lax.scan``, ``fori_loop``, ``while_loop``,
  nested loops, under ``vmap`` and in ``shard_map``), each
  ``jax_effects.print``/``log`` bound in this block writes its operands to
  a staging buffer on the device instead of calling the host; the buffer
  reaches the host in one call every ``k`` rows and when the loop exits,
  and every line is delivered, in order, as the unbatched effect delivers
  it. An effect that is not batched on the same chain (a callback, a
  ``cond`` holding effects, ...) flushes the rows staged before it, so
  program order is kept. A loop's buffer holds at most ``max_bytes`` (its
  rows of operands, 4 bytes a row for the row's effect): ``k`` is reduced
  to fit, and a loop one row of which does not fit is an error at trace
  time.

  The block works where the function is traced (put it inside the jitted
  function; a cached trace is not traced again). Rows staged but not yet
  flushed are lost if the process dies or the computation fails as a whole
  before the flush; a host error in a flush is reported as any effect's,
  and the later rows of that flush are skipped, as later effects are.
  Summarized arrays (larger than NumPy's threshold), effects with results
  and effects inside a ``while_loop`` whose predicate ``vmap`` batched are
  not staged (they run unbatched, in order).
  """
  what = f"jax_effects.batched(k={k!r}, max_bytes={max_bytes!r})"
  request = _batching.Request(_positive_int(what, "k", k),
                              _positive_int(what, "max_bytes", max_bytes))
  previous = _batching.set_current(request)
  try:
    yield
  finally:
    _batching.set_current(previous)

"""``jax_effects.print``: formatted lines from compiled code, in order.

The format string is checked when the call is traced (fields against
arguments, with Python's own ``str.format`` rules, and no unused arguments), so
a bad format fails at trace time naming the format string, never inside XLA.
At run time the host callback formats the NumPy values and hands the line to
:func:`jax_effects._output.deliver_line` (``sys.stdout`` plus listeners).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from jax_effects import _arguments
from jax_effects import _effects
from jax_effects import _output
from jax_effects import _primitives


class _Probe:
  """Stands for an argument during the trace-time format check."""
  __slots__ = ("used",)

  def __init__(self):
    self.used = False

  def __format__(self, spec):
    self.used = True
    return ""

  def __getitem__(self, key):
    self.used = True
    return self

  def __getattribute__(self, name):
    # Every attribute a format field reads (dunders too: "{0.__class__}")
    # is a use, and stands for another probe.
    if name == "used":
      return object.__getattribute__(self, name)
    self.used = True
    return _Probe()

  def __str__(self):
    self.used = True
    return ""

  __repr__ = __str__


def check_format(what: str, fmt: Any, args: tuple, kwargs: dict) -> None:
  """Raises ValueError/TypeError naming ``fmt`` if it does not fit the args."""
  if not isinstance(fmt, str):
    raise TypeError(f"{what}: the format must be a str, got {type(fmt).__name__}")
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
    raise ValueError(
        f"{what}: format string {fmt!r} does not use argument(s) "
        f"{', '.join(unused)}")


def check_format_specs(what: str, fmt: str, operands, rebuild) -> None:
  """Formats zero-valued stand-ins of the operands' shapes and dtypes.

  Catches format specs that do not fit the values (``"{:d}"`` of a float,
  ``"{:.2f}"`` of a non-scalar array) at trace time, naming ``fmt``. The
  stand-ins are broadcast views of one zero: no memory per element.
  """
  try:
    samples = []
    for x in operands:
      dtype = getattr(x, "dtype", None)
      dtype = np.dtype(np.asarray(x).dtype if dtype is None else dtype)
      samples.append(np.broadcast_to(np.zeros((), dtype), np.shape(x)))
  except TypeError:  # an extended dtype (e.g. PRNG keys): nothing to check
    return
  a, k = rebuild(samples)
  try:
    fmt.format(*a, **k)
  except (ValueError, TypeError) as err:
    raise ValueError(
        f"{what}: format string {fmt!r} does not fit its arguments: "
        f"{err}") from None


def print(fmt: str, *args, ordered: bool | None = None, effect=None,  # noqa: A001
          **kwargs) -> None:
  """Prints ``fmt.format(*args, **kwargs)`` when the computation runs.

  Works inside and outside ``jax_effects.jit`` (outside any trace it prints
  immediately). Ordered (the default: ``ordered=None`` takes
  ``effect.ordered``, True unless the :class:`Effect` was created with
  ``ordered=False``), it keeps program order with every other ordered effect
  of the same ``effect`` (default :data:`jax_effects.DEFAULT`, shared with
  ``log`` and ``callback``).
  Arguments are pytrees of arrays (0-d arrays format as scalars); ``str``
  leaves are static.

  In per-device code (``shard_map``, ``pmap``) every device prints its own
  line, prefixed with where it ran: ``[device D shard S process P] text``
  (``S`` is the position in the mesh: ``3``, or ``(1, 2)`` for a 2-D mesh);
  see ``design/placement.md``.
  """
  what = f"jax_effects.print({fmt!r})"
  effect, ordered = _effects.resolve(what, effect, ordered)
  check_format(what, fmt, args, kwargs)
  operands, rebuild = _arguments.split(what, args, kwargs, allow_str=True)
  check_format_specs(what, fmt, operands, rebuild)

  def emit(*np_operands):
    a, k = rebuild(np_operands)
    # Per-device lines get a "[device D shard S process P] " prefix.
    _output.deliver_line(fmt.format(*a, **k), ordered)
    return ()

  _primitives.bind_effect(emit, what, operands, effect=effect, ordered=ordered)



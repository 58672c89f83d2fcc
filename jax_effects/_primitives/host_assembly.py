"""Operands of a once-effect assembled on the host from the devices' parts.

Where an effect runs once over several devices, every device passes the
part of an operand it holds (its edges, or the whole) to its own host call
(:class:`Layout`), and the first device's call assembles them, or leaves
the effect as a job (``_runtime.host_jobs``) that the call bringing the
last part runs: no collective, no wait inside the computation
(``design/formatting.md``, "Where the edges are cut"). Used where
:func:`applies` (not in a module lowered for ``jax.export``).

Part in the token calling convention: the carrier enters and leaves every
device's call; its value (slot and sequence number) matches the parts of
one execution; the first device's carrier is the chain's.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import mlir

from jax_effects import _compat
from jax_effects._compat import core as jcore
from jax_effects._primitives import edges as _edges
from jax_effects._primitives import host_functions as _host_functions
from jax_effects._primitives import host_target as _host_target
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import host_jobs as _host_jobs
from jax_effects._runtime import placement as _placement
from jax_effects._runtime import token_value as _token_value

#: Whether an effect with no operand summarized assembles its sharded
#: operands on the host too (measured: ``design/formatting.md``).
WHOLE_ON_HOST = False


def _bits(dtype) -> int:
  """Bits per value of ``dtype`` (sub-byte ones: ``host_target.SUB_BYTE``)."""
  dtype = np.dtype(dtype)
  return _host_target.SUB_BYTE.get(dtype) or 8 * dtype.itemsize


def _wide(dtype):
  """The byte-wide type holding a sub-byte dtype's values exactly."""
  return (np.float32 if jnp.issubdtype(dtype, jnp.floating)
          else np.int8 if jnp.issubdtype(dtype, jnp.signedinteger)
          else np.uint8)


def _words_per_value(dtype) -> int:
  """``uint32`` words per value (a complex one's parts: one word each or
  two, as its real dtype's values)."""
  return (_bits(dtype) + 31) // 32


def _to_words(y):
  """``y`` as ``uint32`` words, ``(*y.shape, k)``, by operations every
  sharding keeps local (GSPMD gathers a bitcast that adds an axis)."""
  dtype = np.dtype(y.dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    parts = [_to_words(lax.real(y)), _to_words(lax.imag(y))]
    return jnp.concatenate(parts, axis=-1)
  if dtype == np.bool_:
    return y.astype(jnp.uint32)[..., None]
  bits = _bits(dtype)
  if bits < 8:
    return _to_words(y.astype(_wide(dtype)))
  u = lax.bitcast_convert_type(y, np.dtype(f"uint{bits}"))
  if bits <= 32:
    return u.astype(jnp.uint32)[..., None]
  lo = (u & jnp.uint64(0xFFFFFFFF)).astype(jnp.uint32)
  hi = (u >> jnp.uint64(32)).astype(jnp.uint32)
  return jnp.stack([lo, hi], axis=-1)


def _from_words(w: np.ndarray, dtype) -> np.ndarray:
  """The inverse of :func:`_to_words` on the host: ``w`` is ``(..., k)``."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    part = np.finfo(dtype).dtype
    k = _words_per_value(part)
    out = np.empty(w.shape[:-1], dtype)
    out.real = _from_words(w[..., :k], part)
    out.imag = _from_words(w[..., k:], part)
    return out
  if dtype == np.bool_:
    return w[..., 0] != 0
  bits = _bits(dtype)
  if bits < 8:
    return _from_words(w, _wide(dtype)).astype(dtype)
  if bits <= 32:
    return w[..., 0].astype(np.dtype(f"uint{bits}")).view(dtype)
  u = w[..., 0].astype(np.uint64) | (w[..., 1].astype(np.uint64) << np.uint64(32))
  return u.view(dtype)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one operand travels as rows of words, and how the host gets back
  its edges (``edges`` given) or the whole array."""
  shape: tuple
  dtype: np.dtype
  edges: _edges.Edges | None
  rows: tuple      # m per axis: gcd(length, devices)
  cols: tuple      # columns kept of each row's length // m
  cut: tuple       # per axis: summarized (only its edges are shown)

  @classmethod
  def of(cls, shape, dtype, edges, num_devices: int) -> "Layout":
    shape = tuple(shape)
    lead = len(shape) - (len(edges.shape) if edges is not None else 0)
    summarized = set() if edges is None else {lead + d for d in edges.axes}
    rows = tuple(math.gcd(n, num_devices) if n else 1 for n in shape)
    e = edges.edgeitems if edges is not None else 0
    cut = tuple(d in summarized for d in range(len(shape)))
    lengths = [n // m if m else 0 for n, m in zip(shape, rows)]
    cols = tuple(2 * e if c and n > 2 * e else n for c, n in zip(cut, lengths))
    return cls(shape, np.dtype(dtype), edges, rows, cols, cut)

  @property
  def words(self) -> int:
    return math.prod(self.cols) * _words_per_value(self.dtype)

  def pack(self, x):
    """``x`` (traced, of ``shape``) as ``uint32[*rows, 1 + words]``."""
    ndim = len(self.shape)
    e = self.edges.edgeitems if self.edges is not None else 0
    y = x.reshape(tuple(v for n, m in zip(self.shape, self.rows) for v in (m, n // m)))
    for d, (n, m, c) in enumerate(zip(self.shape, self.rows, self.cols)):
      if c != n // m:   # keep the edgeitems at both ends of each row
        y = _edges.ends(y, e, 2 * d + 1)
    y = jnp.transpose(y, tuple(range(0, 2 * ndim, 2)) + tuple(range(1, 2 * ndim, 2)))
    words = _to_words(y).reshape(self.rows + (self.words,))
    ids = jnp.zeros(self.rows, jnp.int32)
    stride = 1
    for d in reversed(range(ndim)):
      ids = ids + lax.broadcasted_iota(jnp.int32, self.rows, d) * stride
      stride *= self.rows[d]
    ids = lax.bitcast_convert_type(ids, jnp.uint32)[..., None]
    return jnp.concatenate([ids, words], axis=-1)

  def unpack(self, parts) -> np.ndarray:
    """The host value from the devices' parts (later ones win)."""
    n_rows = math.prod(self.rows)
    table = np.zeros((n_rows, self.words), np.uint32)
    for part in parts:
      part = np.asarray(part).reshape(-1, 1 + self.words)
      ids = part[:, 0]
      valid = ids < n_rows
      table[ids[valid]] = part[valid, 1:]
    k = _words_per_value(self.dtype)
    values = _from_words(
        table.reshape(self.rows + (math.prod(self.cols), k)), self.dtype)
    ndim = len(self.shape)
    values = values.reshape(self.rows + self.cols)
    values = values.transpose([v for d in range(ndim) for v in (d, ndim + d)])
    values = values.reshape(tuple(m * c for m, c in zip(self.rows, self.cols)))
    if self.edges is None:
      return values
    e = self.edges.edgeitems
    for d, (n, m, c) in enumerate(zip(self.shape, self.rows, self.cols)):
      if not self.cut[d]:
        continue
      length = n // m
      g = np.r_[0:e, n - e:n]
      row, col = g // length, g % length
      if c != length:
        col = np.where(col < e, col, col - length + 2 * e)
      values = np.take(values, row * c + col, axis=d)
    return values


def applies(ctx, host_callback, avals, edges: tuple, ordered: bool) -> bool:
  """Whether the once-effect lowered in ``ctx`` takes its operands through
  the host: ordered, without results, on CPU or GPU, in this process."""
  if (not ordered or host_callback.result_avals
      or not any(a.shape for a in avals)
      or not (WHOLE_ON_HOST or any(e is not None for e in edges))):
    return False
  module_context = ctx.module_context
  if (len(module_context.platforms) != 1
      or module_context.platforms[0] not in _TARGETS):
    return False
  if _compat.lowering_for_export(ctx):
    # (its per-device calls go to JAX's partitioned callback target, whose
    # host_callbacks jax.export cannot serialize: an exported effect takes
    # the edges cut on the devices, gathered to the first one)
    return False
  devices = module_context.axis_context.device_assignment
  if not devices:
    return False
  process = jax.process_index()
  return all(d.process_index == process for d in devices)


_TARGETS = {"cpu": "xla_ffi_partitioned_python_cpu_callback",
            "cuda": "xla_ffi_partitioned_python_gpu_callback",
            "rocm": "xla_ffi_partitioned_python_gpu_callback"}


def lower(ctx, host_callback, entry: bool, carrier, args,
          edges: tuple) -> list:
  """``[carrier', *results]`` of the effect lowered in ``ctx`` (avals:
  token, carrier, *args -> token, carrier, *results)."""
  where, _, _ = _placement.at_lowering(ctx, [], [])   # the first device
  axis_context = ctx.module_context.axis_context
  num_devices = axis_context.num_devices
  avals_out = list(ctx.avals_out[1:])
  operands, operand_avals, layouts = [carrier], [ctx.avals_in[1]], []
  for x, aval, e in zip(args, ctx.avals_in[2:], edges):
    layout = None
    if aval.shape:
      layout = Layout.of(aval.shape, aval.dtype, e, num_devices)
      packed_aval = jax.core.ShapedArray(layout.rows + (1 + layout.words,), np.uint32)
      (x,) = lower_cached(
          dataclasses.replace(ctx, avals_in=[aval], avals_out=[packed_aval]),
          ("pack", layout), layout.pack, x)
      x, aval = _compat.last_axis_whole(ctx, x, packed_aval), packed_aval
    operands.append(x)
    operand_avals.append(aval)
    layouts.append(layout)

  ids_aval = jax.core.ShapedArray((num_devices,), np.int32)
  (ids,) = lower_cached(
      dataclasses.replace(ctx, avals_in=[], avals_out=[ids_aval]),
      ("device_ids", num_devices),
      lambda: lax.iota(np.int32, num_devices))
  ids = _compat.one_per_device(ctx, ids, ids_aval, num_devices)
  operands.append(ids)
  operand_avals.append(ids_aval)

  inner = _host_functions.host_function(
      host_callback, where, passthrough=1, threaded=True,
      avals_out=avals_out, entry=entry)
  site = _host_jobs.Pieces(num_devices, host_callback.chain)
  host = _assembling_host(inner, site, layouts, avals_out)

  target = _TARGETS[ctx.module_context.platforms[0]]
  sub_ctx = dataclasses.replace(ctx, avals_in=operand_avals, avals_out=avals_out)
  new_carrier, *results = _host_target.emit(
      sub_ctx, host, operands, _compat.replicated_results(avals_out), target)
  return [new_carrier, *(_compat.on_first_device(sub_ctx, r, a)
                         for r, a in zip(results, avals_out[1:]))]


_jaxprs: dict = {}


def lower_cached(ctx, key, fn, *args) -> list:
  """``fn(*args)`` lowered in ``ctx``, traced once per ``key`` and avals."""
  key = (key, tuple(ctx.avals_in))
  closed = _jaxprs.get(key)
  if closed is None:
    if len(_jaxprs) > 1024:
      _jaxprs.clear()
    closed = _jaxprs[key] = jax.make_jaxpr(fn)(
        *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_in))
  return mlir.lower_fun(jcore.jaxpr_as_fun(closed),
                        multiple_results=True)(ctx, *args)


def _assembling_host(inner, site: _host_jobs.Pieces, layouts: list,
                     avals_out):
  """The function every device's call runs (module docstring)."""
  FAILED = int(_errors.FAILED)
  zeros = tuple(np.zeros(a.shape, a.dtype) for a in avals_out[1:])
  packed_at = [i for i, layout in enumerate(layouts) if layout is not None]

  def run(carrier, args, others):
    slot = _token_value.slot_of(int(carrier))
    try:
      for j, i in enumerate(packed_at):
        args[i] = layouts[i].unpack([*(o[j] for o in others), args[i]])
    except Exception as exc:  # noqa: BLE001 - reported like a callback's
      _errors.defer(exc, slot, inline=True)
      return (np.bitwise_or(carrier, _errors.FAILED), *zeros)
    return inner(carrier, *args)

  def host(carrier, *operands):
    device = int(operands[-1][0])
    args = list(operands[:-1])
    value = int(carrier)
    slot = _token_value.slot_of(value)
    seq = _token_value.seq_of(value)
    if device:
      site.deposit(slot, seq, device, tuple(args[i] for i in packed_at))
      return (carrier, *zeros)
    chain = site.chain
    waits = _host_jobs.queues and _host_jobs.waits(slot, chain, seq)
    with _host_jobs.lock:
      site.arrive(slot, seq)
      now = not waits and site.complete(slot, seq)
      others = site.take(slot, seq) if now else None
    if now:
      return run(carrier, args, others)

    def job() -> bool:
      with _host_jobs.lock:
        parts = site.take(slot, seq)
      return bool(int(run(carrier, args, parts)[0]) & FAILED)

    if not _host_jobs.submit(slot, chain, seq, _host_jobs.Job(
        job, lambda: site.complete(slot, seq))):
      # (its execution failed: skipped, and so are its later effects here)
      return (np.bitwise_or(carrier, FAILED), *zeros)
    return (carrier, *zeros)

  return host

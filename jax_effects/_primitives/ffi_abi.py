"""The XLA FFI C ABI, read and written from Python: no C compiler needed.

The layout of an ``XLA_FFI_CallFrame`` (``xla/ffi/api/c_api.h``) and what
hangs off it, for the FFI API versions it knows (:data:`KNOWN_VERSIONS`),
read through :data:`mem8`, :data:`mem32`, :data:`mem64` (the address
space); :func:`handler_capsule` makes a Python handler the C function XLA
registers (``design/host_target.md``). Where the layout is not known,
:data:`UNAVAILABLE` says why.

Part in the token calling convention: none; it is the transport under the
host calls (``host_target``).
"""
from __future__ import annotations

import ctypes
import math
import os
import re
import sys
from typing import Callable

import jax
import numpy as np

_SPAN = (1 << 62 if sys.maxsize >= 1 << 62 and sys.byteorder == "little"
         else 0)
#: The address space as bytes, int32 and uint64 (index: address >> 0, 2, 3).
mem8 = memoryview((ctypes.c_char * max(_SPAN, 8)).from_address(0)).cast("B")
mem32 = mem8.cast("i")
mem64 = mem8.cast("Q")

# --- layout (c_api.h; offsets on 64-bit little-endian platforms) ------------------

#: FFI API versions whose structs this module knows (identical where read).
KNOWN_VERSIONS = ((0, 2), (0, 3), (0, 4), (0, 5))

# XLA_FFI_CallFrame: struct_size, extension_start, api, ctx, stage (+pad),
# args {struct_size, extension_start, size, types, args},
# rets {struct_size, extension_start, size, types, rets},
# attrs {struct_size, extension_start, size, types, names, attrs}, future.
FRAME_SIZE = 168             # XLA_FFI_CallFrame_STRUCT_SIZE (up to attrs)
ARGS_SIZE = RETS_SIZE = 40   # XLA_FFI_Args/Rets_STRUCT_SIZE
ATTRS_SIZE = 48              # XLA_FFI_Attrs_STRUCT_SIZE
# Word (8-byte) indices into the frame:
F_EXTENSION = 1
F_API = 2
F_ARGS = 5           # args.struct_size
F_NARGS = 7          # args.size
F_ARGV = 9           # args.args (void**: XLA_FFI_Buffer*)
F_RETS = 10
F_NRETS = 12
F_RETV = 14
F_ATTRS = 15
F_NATTRS = 17
F_ATTR_TYPES = 18
F_ATTR_NAMES = 19
F_ATTRV = 20
# XLA_FFI_Buffer words: struct_size, extension_start, dtype (int32 + pad),
# data, rank, dims.
B_DTYPE = 2
B_DATA = 3
B_RANK = 4
B_DIMS = 5
# XLA_FFI_Api: struct_size, extension_start, api_version {struct_size,
# extension_start, major (int32), minor (int32)}, internal_api,
# XLA_FFI_Error_Create, ...
API_MIN_SIZE = 56
A_MAJOR_INT32 = 8     # int32 index of api_version.major_version
A_ERROR_CREATE = 6    # word index of XLA_FFI_Error_Create
ATTR_STRING = 4       # XLA_FFI_AttrType_STRING
DTYPE_TOKEN = 17
# XLA_FFI_Extension_Base {struct_size, type (int32 + pad), next};
# XLA_FFI_Metadata_Extension {base, metadata*}; XLA_FFI_Metadata
# {struct_size, api_version {struct_size, extension_start, major, minor},
# traits}.
EXTENSION_METADATA = 1
METADATA_EXTENSION_SIZE = 32
METADATA_SIZE = 36
API_VERSION_SIZE = 24
ERROR_INTERNAL = 13   # XLA_FFI_Error_Code_INTERNAL


def _header_version() -> tuple[int, int] | None:
  """``(major, minor)`` of the FFI API jaxlib was built with (its header)."""
  try:
    path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, AttributeError, RuntimeError):
    return None
  major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
  minor = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
  if major is None or minor is None:
    return None
  return int(major.group(1)), int(minor.group(1))


def _versions() -> str:
  import jaxlib   # (its version only)
  return (f"JAX {jax.__version__}, jaxlib "
          f"{getattr(jaxlib, '__version__', '?')}")


#: The FFI API version of this process's jaxlib (None: not found).
FRAMEWORK_VERSION = _header_version()


def _unavailable() -> str | None:
  if not _SPAN:
    return (f"jax_effects' FFI host target reads the XLA FFI call frame as "
            f"a 64-bit little-endian layout; this platform is not one "
            f"({sys.byteorder}-endian, maxsize {sys.maxsize:#x})")
  if FRAMEWORK_VERSION is None:
    return (f"jax_effects' FFI host target needs the XLA FFI API version, "
            f"read from jaxlib's header xla/ffi/api/c_api.h under "
            f"jax.ffi.include_dir(), which was not found ({_versions()})")
  if FRAMEWORK_VERSION not in KNOWN_VERSIONS:
    major, minor = FRAMEWORK_VERSION
    known = ", ".join(f"{a}.{b}" for a, b in KNOWN_VERSIONS)
    return (f"{_versions()} has XLA FFI API version {major}.{minor}, whose "
            f"call frame layout jax_effects does not know (it knows {known}: "
            f"jaxlib 0.8 to 0.10); its FFI host target is not registered "
            f"rather than read memory it does not understand")
  return None


#: Why the FFI host target cannot be used in this process (None: it can).
UNAVAILABLE: str | None = _unavailable()


def refuse(reason: str) -> None:
  """Marks the FFI transport unusable in this process, saying why."""
  global UNAVAILABLE
  if UNAVAILABLE is None:
    UNAVAILABLE = reason


_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_kept: list = []   # the ctypes function objects XLA holds pointers to


def answer_metadata(frame: int) -> bool:
  """Answers XLA's metadata query (at registration); False (refused) when a
  struct size differs from the layout this module knows."""
  extension = mem64[(frame >> 3) + F_EXTENSION]
  size = mem64[frame >> 3]
  ext_size = mem64[extension >> 3]
  ext_type = mem32[(extension + 8) >> 2]
  if ext_type != EXTENSION_METADATA:
    return False
  metadata = mem64[(extension >> 3) + 3]
  md_size = mem64[metadata >> 3]
  version_size = mem64[(metadata >> 3) + 1]
  found = (size, ext_size, md_size, version_size)
  wanted = (FRAME_SIZE, METADATA_EXTENSION_SIZE, METADATA_SIZE,
            API_VERSION_SIZE)
  if found != wanted:
    refuse(f"{_versions()}: the XLA FFI structs have sizes (call frame, "
           f"metadata extension, metadata, version) {found}, where "
           f"jax_effects knows {wanted}; its FFI host target is not used "
           f"rather than read memory it does not understand")
    return False
  major, minor = FRAMEWORK_VERSION
  mem32[(metadata + 24) >> 2] = major
  mem32[(metadata + 28) >> 2] = minor
  mem32[(metadata + 32) >> 2] = 0   # traits
  return True


def _compiled_entry():
  """``_trampoline``, or None (not built, or ``JAX_EFFECTS_FFI_ENTRY``)."""
  if os.environ.get("JAX_EFFECTS_FFI_ENTRY", "") == "ctypes":
    return None
  try:
    from jax_effects._primitives import _trampoline
  except ImportError:
    # (a checkout's source tree, imported in its folder after
    # ``pip install .``: the installed copy's, built from the same source)
    from jax_effects._primitives import installed
    return installed.installed_copy("jax_effects._primitives._trampoline")
  return _trampoline


_TRAMPOLINE = _compiled_entry()
#: How XLA enters the handler: "compiled" (``_trampoline.c``) or "ctypes".
ENTRY = "compiled" if _TRAMPOLINE is not None else "ctypes"


def handler_capsule(handler: Callable[[int], int], common=None):
  """``handler`` (frame address -> error address or 0) as a PyCapsule,
  through :data:`ENTRY`; ``common``: what ``_trampoline.c`` reads."""
  if _TRAMPOLINE is not None:
    address = _TRAMPOLINE.entry(handler)
    if common is not None:
      words = (F_EXTENSION, F_ARGV, F_RETV, F_NATTRS, F_ATTR_TYPES, F_ATTRV,
               B_DATA, ATTR_STRING, F_NARGS, F_NRETS, B_DTYPE, B_RANK,
               B_DIMS)
      _TRAMPOLINE.configure(words, *common)
    _kept.append(handler)
    return jax.ffi.pycapsule(address)
  cfunc = _HANDLER(handler)
  _kept.append((handler, cfunc))
  return jax.ffi.pycapsule(ctypes.cast(cfunc, ctypes.c_void_p).value)


_ERROR_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_error_create = None
_checked = False


def check_frame(frame: int) -> str | None:
  """Checks, once per process, an executing call frame's struct sizes and
  API version. Returns what is wrong (None: the layout is known)."""
  global _checked, _error_create
  if _checked:
    return None
  f = frame >> 3
  sizes = (mem64[f], mem64[f + F_ARGS], mem64[f + F_RETS], mem64[f + F_ATTRS])
  wanted = (FRAME_SIZE, ARGS_SIZE, RETS_SIZE, ATTRS_SIZE)
  if sizes != wanted:
    return (f"{_versions()}: an XLA FFI call frame has struct sizes (frame, "
            f"args, rets, attrs) {sizes}, where jax_effects knows {wanted}")
  api = mem64[f + F_API]
  if not api or mem64[api >> 3] < API_MIN_SIZE:
    return f"{_versions()}: the XLA FFI API table is missing or too small"
  version = (mem32[(api >> 2) + A_MAJOR_INT32],
             mem32[(api >> 2) + A_MAJOR_INT32 + 1])
  if version != FRAMEWORK_VERSION:
    return (f"{_versions()}: the XLA FFI API table has version "
            f"{version[0]}.{version[1]}, jaxlib's header "
            f"{FRAMEWORK_VERSION[0]}.{FRAMEWORK_VERSION[1]}")
  _error_create = _ERROR_CREATE(mem64[(api >> 3) + A_ERROR_CREATE])
  _checked = True
  return None


def error(message: str) -> int:
  """An ``XLA_FFI_Error`` with ``message`` (0 before a frame is checked)."""
  if _error_create is None:
    return 0
  text = ctypes.create_string_buffer(message.encode("utf-8", "replace"))
  # XLA_FFI_Error_Create_Args {struct_size, extension_start, message, errc}
  args = (ctypes.c_uint64 * 4)(28, 0, ctypes.addressof(text), ERROR_INTERNAL)
  return _error_create(ctypes.addressof(args)) or 0


def attr_strings(frame: int) -> dict[str, str] | None:
  """The frame's attributes as ``{name: value}`` if all are strings."""
  f = frame >> 3
  n = mem64[f + F_NATTRS]
  if n > 64:
    return None
  types, names, values = (mem64[f + F_ATTR_TYPES], mem64[f + F_ATTR_NAMES],
                          mem64[f + F_ATTRV])
  out = {}
  for i in range(n):
    if mem32[(types >> 2) + i] != ATTR_STRING:
      return None
    name = mem64[(names >> 3) + i]
    value = mem64[(values >> 3) + i]
    out[_span(name)] = _span(value)
  return out


def _span(address: int) -> str:
  """The text of an ``XLA_FFI_ByteSpan`` {ptr, len}."""
  ptr, n = mem64[address >> 3], mem64[(address >> 3) + 1]
  return bytes(mem8[ptr:ptr + n]).decode("utf-8", "replace")


def _of_jax(table: dict) -> dict:
  """``table`` keyed by the NumPy dtypes of the names this JAX has."""
  import jax.numpy as jnp
  return {np.dtype(getattr(jnp, name)): v for name, v in table.items()
          if getattr(jnp, name, None) is not None}


#: ``{numpy dtype: XLA_FFI_DataType}`` for the dtypes of this JAX.
DTYPES = _of_jax({
    "bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint8": 6,
    "uint16": 7, "uint32": 8, "uint64": 9, "float16": 10, "float32": 11,
    "float64": 12, "complex64": 15, "bfloat16": 16, "complex128": 18,
    "float8_e5m2": 19, "float8_e4m3fn": 20, "int4": 21, "uint4": 22,
    "float8_e4m3b11fnuz": 23, "float8_e5m2fnuz": 24, "float8_e4m3fnuz": 25,
    "int2": 26, "uint2": 27, "float8_e4m3": 28, "float8_e3m4": 29,
    "float4_e2m1fn": 32, "float8_e8m0fnu": 33})
#: Bits per element of the sub-byte dtypes (packed in XLA's buffers).
SUB_BYTE = _of_jax({"int4": 4, "uint4": 4, "float4_e2m1fn": 4, "int2": 2,
                    "uint2": 2})


def buffer(address: int) -> tuple[int, int, tuple]:
  """``(dtype code, data address, dims)`` of an ``XLA_FFI_Buffer``."""
  b = address >> 3
  rank = mem64[b + B_RANK]
  dims = mem64[b + B_DIMS] >> 3
  return (mem32[(address >> 2) + 4], mem64[b + B_DATA],
          tuple(mem64[dims + i] for i in range(rank)))


def view(address: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
  """The buffer data at ``address`` as a NumPy array (no copy; not for
  sub-byte dtypes; ``np.ndarray`` ignores a buffer this large)."""
  flat = np.frombuffer(mem8, dtype, math.prod(shape), address)
  return flat if len(shape) == 1 else flat.reshape(shape)


def read_array(address: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
  """A NumPy copy of the buffer data at ``address`` (``shape``, ``dtype``)."""
  count = math.prod(shape)
  if not count:
    return np.zeros(shape, dtype)
  bits = SUB_BYTE.get(dtype)
  if bits is None:
    return view(address, shape, dtype).copy()
  packed = np.frombuffer(mem8, np.uint8, (count * bits + 7) // 8, address)
  shifts = np.arange(8 // bits, dtype=np.uint8) * bits
  values = (packed[:, None] >> shifts) & np.uint8((1 << bits) - 1)
  return values.reshape(-1)[:count].view(dtype).reshape(shape)


def write_array(address: int, value: np.ndarray) -> None:
  """Writes ``value`` (C-contiguous or not) into the buffer at ``address``."""
  dtype = value.dtype
  bits = SUB_BYTE.get(dtype)
  if bits is None:
    if value.size:
      view(address, value.shape, dtype)[...] = value
    return
  count = value.size
  if not count:
    return
  per_byte = 8 // bits
  raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8) & np.uint8(
      (1 << bits) - 1)
  padded = np.zeros(-(-count // per_byte) * per_byte, np.uint8)
  padded[:count] = raw
  shifts = np.arange(per_byte, dtype=np.uint8) * bits
  packed = np.bitwise_or.reduce(padded.reshape(-1, per_byte) << shifts, axis=1)
  np.frombuffer(mem8, np.uint8, packed.size, address)[...] = packed

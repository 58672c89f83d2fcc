/* The FFI host target's entry: the C function XLA calls on every host call.

   Written against XLA's own FFI header (xla/ffi/api/c_api.h, from
   jax.ffi.include_dir() at build): the call frame, buffer and API layouts
   and the FFI API version are the header's. It holds no policy: Python
   decides, this replays (design/host_target.md). For each call it checks
   the frame's struct sizes and API version against the header's, finds the
   call's site by its key attribute (host_target._sites; an unknown key
   asks host_target._cold), checks the frame's buffers against the site's
   description (host_target.Site.c, made by Python when the site is made)
   before a byte of them is read, hands the operands to the site's runner
   (Python ints, NumPy arrays copied out of XLA's buffers, or for sub-byte
   dtypes a read-only memoryview of exactly the buffer's bytes, released
   after the call), writes its results back, and turns a Python exception
   into an FFI error. Every thread that enters keeps its Python thread
   state (one more PyGILState_Ensure, never released): XLA's threads run
   many host calls each.

   Built by `pip install .` (setup.py); an install without a C compiler
   fails there, saying so.

   Part in the token calling convention: none (the transport's entry). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

/* A buffer's kind in a site's description (host_target.TOKEN, ...). */
enum { K_TOKEN = 0, K_INT = 1, K_ARRAY = 2, K_BYTES = 3 };

static PyObject *sites;    /* key (bytes) -> weakref to a Site */
static PyObject *cold;     /* host_target._cold(key, attrs) -> Site */
static PyObject *np_empty; /* numpy.empty */
static PyObject *mismatch; /* host_target.SiteMismatch */
static PyObject *c_name;   /* "c" */
static PyObject *what_name; /* "what" */
static _Thread_local int pinned;

static XLA_FFI_Error *ffi_error(const XLA_FFI_Api *api, XLA_FFI_Error_Code code,
                                const char *message) {
  XLA_FFI_Error_Create_Args args = {XLA_FFI_Error_Create_Args_STRUCT_SIZE,
                                    NULL, message, code};
  return api->XLA_FFI_Error_Create(&args);
}

/* The FFI error of the Python exception being raised (taken). */
static XLA_FFI_Error *raised(const XLA_FFI_Api *api) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  PyObject *text = value == NULL ? NULL : PyUnicode_FromFormat(
      "jax_effects host target: %s: %S", Py_TYPE(value)->tp_name, value);
  const char *message = text == NULL ? NULL : PyUnicode_AsUTF8(text);
  PyErr_Clear();
  XLA_FFI_Error *error = ffi_error(api, XLA_FFI_Error_Code_INTERNAL,
      message != NULL ? message : "jax_effects host target: an exception");
  Py_XDECREF(text);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return error;
}

/* XLA's metadata query at registration: the header's API version, capped
   at the framework's own minor version (a build against a newer jaxlib's
   header is no different where it reads). */
static XLA_FFI_Error *metadata(XLA_FFI_CallFrame *frame) {
  XLA_FFI_Metadata_Extension *ext =
      (XLA_FFI_Metadata_Extension *)frame->extension_start;
  if (ext->extension_base.type != XLA_FFI_Extension_Metadata ||
      ext->extension_base.struct_size < XLA_FFI_Metadata_Extension_STRUCT_SIZE ||
      ext->metadata->struct_size < XLA_FFI_Metadata_STRUCT_SIZE ||
      frame->api->api_version.major_version != XLA_FFI_API_MAJOR)
    return ffi_error(frame->api, XLA_FFI_Error_Code_FAILED_PRECONDITION,
        "jax_effects host target: XLA's FFI metadata query has another API "
        "version or smaller structs than the XLA FFI header it was built "
        "against");
  int minor = frame->api->api_version.minor_version;
  ext->metadata->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  ext->metadata->api_version.extension_start = NULL;
  ext->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
  ext->metadata->api_version.minor_version =
      minor < XLA_FFI_API_MINOR ? minor : XLA_FFI_API_MINOR;
  ext->metadata->traits = 0;
  return NULL;
}

/* The frame's string attributes as {name: value} (the cold path's). */
static PyObject *attr_strings(const XLA_FFI_Attrs *attrs) {
  PyObject *out = PyDict_New();
  for (int64_t i = 0; out != NULL && i < attrs->size; i++) {
    const XLA_FFI_ByteSpan *name = attrs->names[i];
    const XLA_FFI_ByteSpan *value = attrs->attrs[i];
    PyObject *k = PyUnicode_DecodeUTF8(name->ptr, name->len, "replace");
    PyObject *v = PyUnicode_DecodeUTF8(value->ptr, value->len, "replace");
    if (k == NULL || v == NULL || PyDict_SetItem(out, k, v) < 0)
      Py_CLEAR(out);
    Py_XDECREF(k);
    Py_XDECREF(v);
  }
  return out;
}

/* The site of the call (a new reference), or NULL with an exception. */
static PyObject *site_of(const XLA_FFI_Attrs *attrs) {
  const XLA_FFI_ByteSpan *span = attrs->attrs[0];   /* (sorted by name) */
  PyObject *key = PyBytes_FromStringAndSize(span->ptr, (Py_ssize_t)span->len);
  if (key == NULL) return NULL;
  PyObject *site = NULL;
  PyObject *ref = PyDict_GetItemWithError(sites, key);   /* borrowed */
  if (ref != NULL) {
#if PY_VERSION_HEX >= 0x030D0000
    if (PyWeakref_GetRef(ref, &site) < 0) site = NULL;
#else
    site = PyWeakref_GetObject(ref);   /* borrowed */
    if (site == Py_None) site = NULL;
    Py_XINCREF(site);
#endif
  }
  if (site == NULL && !PyErr_Occurred()) {
    PyObject *strings = attr_strings(attrs);
    if (strings != NULL)
      site = PyObject_CallFunctionObjArgs(cold, key, strings, NULL);
    Py_XDECREF(strings);
  }
  Py_DECREF(key);
  return site;
}

/* Raises what differs between the frame's buffers and the site's
   description (int64 words: nargs, nrets, then per buffer kind, dtype
   code, rank, byte size, dims); 0 where they agree. */
static int check(const XLA_FFI_CallFrame *frame, const int64_t *w,
                 Py_ssize_t n, PyObject *site) {
  const char *problem = NULL;
  int64_t side = 0, i = 0, k = 2;
  PyObject *what;
  if (n < 2 || frame->args.size != w[0] || frame->rets.size != w[1]) {
    problem = "a call whose operand or result count is not its site's";
    goto mismatch;
  }
  for (side = 0; side < 2; side++) {
    void **bufs = side ? frame->rets.rets : frame->args.args;
    for (i = 0; i < w[side]; i++, k += 4 + w[k + 2]) {
      int buffer = side ? frame->rets.types[i] == XLA_FFI_RetType_BUFFER
                        : frame->args.types[i] == XLA_FFI_ArgType_BUFFER;
      const XLA_FFI_Buffer *b = bufs[i];
      problem = "a buffer that is not its site's";
      if (k + 4 > n || k + 4 + w[k + 2] > n || !buffer
          || b->struct_size < XLA_FFI_Buffer_STRUCT_SIZE)
        goto mismatch;
      problem = "a buffer whose dtype is not its site's";
      if ((int64_t)b->dtype != w[k + 1]) goto mismatch;
      if (w[k] == K_TOKEN) continue;
      problem = "a buffer whose shape is not its site's";
      if (b->rank != w[k + 2]) goto mismatch;
      for (int64_t j = 0; j < b->rank; j++)
        if (b->dims[j] != w[k + 4 + j]) goto mismatch;
    }
  }
  if (k == n) return 0;
  problem = "a call that does not fit its site's description";
mismatch:
  what = PyObject_GetAttr(site, what_name);
  if (what != NULL)
    PyErr_Format(mismatch, "%S: %s (%s %lld)", what, problem,
                 side ? "result" : "operand", (long long)i);
  Py_XDECREF(what);
  return -1;
}

/* The site's operands (new references in args[]): 0, or -1 raised. */
static int operands(const XLA_FFI_CallFrame *frame, const int64_t *w,
                    PyObject *empties, PyObject **args, Py_ssize_t *nargs) {
  int64_t k = 2;
  for (int64_t i = 0; i < w[0]; k += 4 + w[k + 2], i++) {
    const XLA_FFI_Buffer *b = frame->args.args[i];
    PyObject *x = NULL;
    switch (w[k]) {
      case K_TOKEN:
        continue;
      case K_INT:
        x = b->dtype == XLA_FFI_DataType_U32
                ? PyLong_FromUnsignedLong(*(const uint32_t *)b->data)
                : PyLong_FromLong(*(const int32_t *)b->data);
        break;
      case K_ARRAY: {
        PyObject *shape_dtype = PyTuple_GET_ITEM(empties, i);
        x = PyObject_Vectorcall(np_empty, &PyTuple_GET_ITEM(shape_dtype, 0),
                                2, NULL);
        Py_buffer view;
        if (x != NULL && PyObject_GetBuffer(x, &view, PyBUF_WRITABLE) == 0) {
          if (view.len == w[k + 3]) {
            if (view.len) memcpy(view.buf, b->data, (size_t)view.len);
          } else {
            PyErr_SetString(PyExc_SystemError, "an operand's byte size");
          }
          PyBuffer_Release(&view);
        }
        if (PyErr_Occurred()) Py_CLEAR(x);
        break;
      }
      default:
        x = PyMemoryView_FromMemory(b->data, (Py_ssize_t)w[k + 3], PyBUF_READ);
    }
    if (x == NULL) return -1;
    args[(*nargs)++] = x;
  }
  return 0;
}

/* Writes the runner's results (one per buffer that is not a token). */
static int results(const XLA_FFI_CallFrame *frame, const int64_t *w,
                   PyObject *out) {
  PyObject *seq = PySequence_Fast(out, "a site's runner returned no sequence");
  if (seq == NULL) return -1;
  Py_ssize_t at = 0, count = PySequence_Fast_GET_SIZE(seq);
  int64_t k = 2;
  for (int64_t i = 0; i < w[0]; i++) k += 4 + w[k + 2];
  for (int64_t i = 0; i < w[1]; k += 4 + w[k + 2], i++) {
    if (w[k] == K_TOKEN) continue;
    void *data = ((const XLA_FFI_Buffer *)frame->rets.rets[i])->data;
    if (at >= count) {
      PyErr_SetString(PyExc_ValueError, "a site's runner returned too few");
      break;
    }
    PyObject *x = PySequence_Fast_GET_ITEM(seq, at++);
    if (w[k] == K_INT) {
      long v = PyLong_AsLong(x);
      if (v == -1 && PyErr_Occurred()) break;
      if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "an int32 result out of range");
        break;
      }
      *(int32_t *)data = (int32_t)v;
      continue;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS) < 0) break;
    if (view.len == w[k + 3]) {
      if (view.len) memcpy(data, view.buf, (size_t)view.len);
    } else {
      PyErr_Format(PyExc_ValueError, "result %lld has %zd bytes, its site "
                   "says %lld", (long long)i, view.len, (long long)w[k + 3]);
    }
    PyBuffer_Release(&view);
    if (PyErr_Occurred()) break;
  }
  Py_DECREF(seq);
  return PyErr_Occurred() ? -1 : 0;
}

/* One host call: NULL, or an FFI error made from the exception raised. */
static XLA_FFI_Error *call(XLA_FFI_CallFrame *frame) {
  const XLA_FFI_Attrs *attrs = &frame->attrs;
  if (frame->args.struct_size < XLA_FFI_Args_STRUCT_SIZE ||
      frame->rets.struct_size < XLA_FFI_Rets_STRUCT_SIZE ||
      attrs->struct_size < XLA_FFI_Attrs_STRUCT_SIZE) {
    PyErr_SetString(PyExc_RuntimeError,
        "an XLA FFI call frame whose argument, result or attribute structs "
        "are smaller than those of the XLA FFI header jax_effects was built "
        "against: reinstall jax_effects against this jaxlib");
    return raised(frame->api);
  }
  if (attrs->size != 2 || attrs->types[0] != XLA_FFI_AttrType_STRING ||
      attrs->types[1] != XLA_FFI_AttrType_STRING) {
    PyErr_SetString(mismatch, "a call of jax_effects' host target with "
                    "attributes it does not know");
    return raised(frame->api);
  }
  PyObject *site = site_of(attrs);
  PyObject *c = site == NULL ? NULL : PyObject_GetAttr(site, c_name);
  PyObject *small[8], **args = small, *out = NULL;
  Py_ssize_t nargs = 0;
  if (c == NULL) goto done;
  /* (words, runner, empties): host_target.Site.c */
  PyObject *words = PyTuple_GET_ITEM(c, 0);
  const int64_t *w = (const int64_t *)PyBytes_AS_STRING(words);
  if (check(frame, w, PyBytes_GET_SIZE(words) / 8, site) < 0) goto done;
  if (w[0] > 8 && (args = PyMem_Malloc(w[0] * sizeof(PyObject *))) == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  if (operands(frame, w, PyTuple_GET_ITEM(c, 2), args, &nargs) == 0) {
    out = PyObject_Vectorcall(PyTuple_GET_ITEM(c, 1), args, nargs, NULL);
    if (out != NULL) results(frame, w, out);
  }
  for (Py_ssize_t i = 0; i < nargs; i++) {
    if (PyMemoryView_Check(args[i])) {   /* (XLA's memory: not kept) */
      PyObject *r = PyObject_CallMethod(args[i], "release", NULL);
      Py_XDECREF(r);
    }
    Py_DECREF(args[i]);
  }
  if (args != small) PyMem_Free(args);
done:
  Py_XDECREF(out);
  Py_XDECREF(c);
  Py_XDECREF(site);
  return PyErr_Occurred() ? raised(frame->api) : NULL;
}

static XLA_FFI_Error *entry(XLA_FFI_CallFrame *frame) {
  const XLA_FFI_Api *api = frame->api;
  if (frame->struct_size < XLA_FFI_CallFrame_STRUCT_SIZE || api == NULL ||
      api->struct_size < offsetof(XLA_FFI_Api, XLA_FFI_Error_Create) +
                             sizeof(api->XLA_FFI_Error_Create) ||
      api->api_version.major_version != XLA_FFI_API_MAJOR) {
    /* (no error can be made with an API table not known) */
    fprintf(stderr, "jax_effects host target: an XLA FFI call frame or API "
            "table that does not match the XLA FFI header it was built "
            "against (API %d.%d): the call is not run\n",
            XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
    return NULL;
  }
  if (frame->extension_start != NULL) return metadata(frame);
  PyGILState_STATE state = PyGILState_Ensure();
  if (!pinned) {   /* (this thread's state kept: one more, never released) */
    PyGILState_Ensure();
    pinned = 1;
  }
  XLA_FFI_Error *error = call(frame);
  PyGILState_Release(state);
  return error;
}

/* configure(sites, cold, empty, mismatch) -> the handler, a PyCapsule
   for jax.ffi.register_ffi_target. */
static PyObject *configure(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *sites_, *cold_, *empty_, *mismatch_;
  if (!PyArg_ParseTuple(args, "O!OOO", &PyDict_Type, &sites_, &cold_, &empty_,
                        &mismatch_))
    return NULL;
  Py_INCREF(mismatch_);
  Py_XSETREF(mismatch, mismatch_);
  Py_INCREF(sites_);
  Py_XSETREF(sites, sites_);
  Py_INCREF(cold_);
  Py_XSETREF(cold, cold_);
  Py_INCREF(empty_);
  Py_XSETREF(np_empty, empty_);
  if (c_name == NULL && ((c_name = PyUnicode_InternFromString("c")) == NULL ||
                         (what_name = PyUnicode_InternFromString("what")) == NULL))
    return NULL;
  return PyCapsule_New((void *)entry, NULL, NULL);
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(sites, cold, empty, mismatch) -> the FFI handler (a "
     "PyCapsule)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "jax_effects._primitives._trampoline",
    "The FFI host target's entry (see the source).", -1, methods,
    NULL, NULL, NULL, NULL};

#define DTYPE(name, code)                                           \
  if ((v = PyLong_FromLong(XLA_FFI_DataType_##code)) == NULL ||    \
      PyDict_SetItemString(dtypes, name, v) < 0)                  \
    goto fail;                                                    \
  Py_DECREF(v);

PyMODINIT_FUNC PyInit__trampoline(void) {
  PyObject *m = PyModule_Create(&module_def), *v = NULL;
  /* The header's dtype codes by NumPy name, its API version, the kinds. */
  PyObject *dtypes = PyDict_New();
  if (m == NULL || dtypes == NULL) goto fail;
  DTYPE("bool", PRED) DTYPE("int8", S8) DTYPE("int16", S16)
  DTYPE("int32", S32) DTYPE("int64", S64) DTYPE("uint8", U8)
  DTYPE("uint16", U16) DTYPE("uint32", U32) DTYPE("uint64", U64)
  DTYPE("float16", F16) DTYPE("float32", F32) DTYPE("float64", F64)
  DTYPE("complex64", C64) DTYPE("complex128", C128) DTYPE("bfloat16", BF16)
  DTYPE("float8_e5m2", F8E5M2) DTYPE("float8_e4m3fn", F8E4M3FN)
  DTYPE("int4", S4) DTYPE("uint4", U4) DTYPE("int2", S2) DTYPE("uint2", U2)
  DTYPE("float8_e4m3b11fnuz", F8E4M3B11FNUZ)
  DTYPE("float8_e5m2fnuz", F8E5M2FNUZ) DTYPE("float8_e4m3fnuz", F8E4M3FNUZ)
  DTYPE("float8_e4m3", F8E4M3) DTYPE("float8_e3m4", F8E3M4)
  DTYPE("float4_e2m1fn", F4E2M1FN) DTYPE("float8_e8m0fnu", F8E8M0FNU)
  DTYPE("token", TOKEN)
  v = Py_BuildValue("(ii)", XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  if (v == NULL || PyModule_AddObjectRef(m, "DTYPES", dtypes) < 0 ||
      PyModule_AddIntConstant(m, "TOKEN", K_TOKEN) < 0 ||
      PyModule_AddIntConstant(m, "INT", K_INT) < 0 ||
      PyModule_AddIntConstant(m, "ARRAY", K_ARRAY) < 0 ||
      PyModule_AddIntConstant(m, "BYTES", K_BYTES) < 0 ||
      PyModule_AddObjectRef(m, "API_VERSION", v) < 0)
    goto fail;
  Py_DECREF(v);
  Py_DECREF(dtypes);
  return m;
fail:
  Py_XDECREF(v);
  Py_XDECREF(dtypes);
  Py_XDECREF(m);
  return NULL;
}

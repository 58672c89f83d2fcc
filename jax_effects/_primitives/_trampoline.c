/* The compiled entry of jax_effects' FFI host target (optional).

   XLA calls an FFI handler as `XLA_FFI_Error *handler(XLA_FFI_CallFrame *)`
   on every host call. The handler is Python (`host_target._handle`, which
   reads the frame through `ffi_abi`); where a C compiler was found at
   install, this module is the C function XLA calls instead of a ctypes
   callback. It takes the GIL, keeps the calling thread's Python thread
   state (as `host_target._pin` does), and runs the common site itself
   (`host_sites.Site.compiled`: one operand, one carrier, no result, the
   frame's buffers checked against the site's signature on every call
   before any is read, the operand copied into a new NumPy array, the
   carrier written back), the
   work the Python handler's inline path does in bytecode, at a fraction of
   its cost. Anything else, and any failure before the host function ran,
   goes to the Python handler, which does everything.

   It knows no layout of its own: the word indices into the frame and its
   buffers are handed over by `ffi_abi` (`configure`), the one owner of the
   layout, which checks the FFI API version and the struct sizes before the
   target is registered (no memory is read whose layout is unknown).

   Built by `pip install .` where a C compiler exists (an optional
   extension: without one the package installs as it is and
   `ffi_abi.handler_capsule` falls back to ctypes, `ffi_abi.ENTRY`).

   Part in the token calling convention: none (the transport's entry). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Word indices (8-byte) into the call frame and a buffer; an attribute
   type code (ffi_abi.F_*, B_DATA, ATTR_STRING). */
static Py_ssize_t f_extension, f_argv, f_retv, f_nattrs, f_attr_types,
    f_attrv, b_data, f_nargs, f_nrets, b_dtype, b_rank, b_dims;
static int32_t attr_string;

static PyObject *handler;   /* host_target._handle(frame) -> error */
static PyObject *sites;     /* key (bytes) -> weakref to a Site */
static PyObject *compiled_name;   /* "compiled" */
static PyObject *np_empty;  /* numpy.empty */
static PyObject *partitions;   /* pid (int) -> numpy.uint32 */
static PyObject *raised;    /* host_target._raised(exc) -> error */
static int fast_ready;

static _Thread_local int pinned;

#define WORD(base, i) (((const uint64_t *)(uintptr_t)(base))[(i)])

/* The exception being raised, taken (Python 3.10 to 3.14). */
static PyObject *take_exception(void) {
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  if (value != NULL && traceback != NULL)
    PyException_SetTraceback(value, traceback);
  Py_XDECREF(type);
  Py_XDECREF(traceback);
  return value;
#endif
}

/* Whether the frame's buffers are the site's (host_sites._signature:
   int64 words nargs, nrets, then for each argument and result its dtype
   code, rank (-1: a token, its code only) and dims), read before any byte
   of a buffer is: a frame that does not fit goes to the Python handler,
   which refuses it. */
static int frame_matches(uint64_t frame, const int64_t *sig, Py_ssize_t n) {
  if (n < 2) return 0;
  int64_t nargs = sig[0], nrets = sig[1];
  if ((int64_t)WORD(frame, f_nargs) != nargs ||
      (int64_t)WORD(frame, f_nrets) != nrets)
    return 0;
  Py_ssize_t k = 2;
  for (int side = 0; side < 2; side++) {
    uint64_t vec = WORD(frame, side ? f_retv : f_argv);
    int64_t count = side ? nrets : nargs;
    for (int64_t i = 0; i < count; i++) {
      if (k + 2 > n) return 0;
      uint64_t buf = WORD(vec, i);
      int32_t code = *(const int32_t *)(uintptr_t)(buf + 8 * b_dtype);
      int64_t rank = sig[k + 1];
      if (code != sig[k]) return 0;
      k += 2;
      if (rank < 0) continue;   /* (a token) */
      if ((int64_t)WORD(buf, b_rank) != rank || k + rank > n) return 0;
      const int64_t *dims = (const int64_t *)(uintptr_t)WORD(buf, b_dims);
      for (int64_t j = 0; j < rank; j++)
        if (dims[j] != sig[k + j]) return 0;
      k += rank;
    }
  }
  return k == n;
}

/* The site's host function on an operand copied out of the frame: 1 (ran;
   *result: 0 or an XLA_FFI_Error address), 0 (not a common site, or a
   failure before the host function ran: the Python handler runs it). */
static int run_common(uint64_t frame, void **result) {
  if (WORD(frame, f_extension) != 0 || WORD(frame, f_nattrs) != 2) return 0;
  const int32_t *types = (const int32_t *)(uintptr_t)WORD(frame, f_attr_types);
  if (types[0] != attr_string) return 0;
  /* attribute 0 (attributes sorted by name): the key, a byte span */
  uint64_t span = WORD(WORD(frame, f_attrv), 0);
  PyObject *key = PyBytes_FromStringAndSize(
      (const char *)(uintptr_t)WORD(span, 0), (Py_ssize_t)WORD(span, 1));
  if (key == NULL) return 0;
  PyObject *ref = PyDict_GetItemWithError(sites, key);   /* borrowed */
  Py_DECREF(key);
  if (ref == NULL) return 0;
  PyObject *site;
#if PY_VERSION_HEX >= 0x030D0000
  if (PyWeakref_GetRef(ref, &site) <= 0) return 0;
#else
  site = PyWeakref_GetObject(ref);   /* borrowed */
  if (site == NULL || site == Py_None) return 0;
  Py_INCREF(site);
#endif
  PyObject *spec = PyObject_GetAttr(site, compiled_name);
  Py_DECREF(site);
  if (spec == NULL) return 0;
  /* (host, shape, dtype, nbytes, per_device, sig) */
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 6) {
    Py_DECREF(spec);
    return 0;
  }
  PyObject *sig = PyTuple_GET_ITEM(spec, 5);
  if (!PyBytes_Check(sig) ||
      !frame_matches(frame, (const int64_t *)PyBytes_AS_STRING(sig),
                     PyBytes_GET_SIZE(sig) / 8)) {
    Py_DECREF(spec);
    return 0;
  }
  PyObject *host = PyTuple_GET_ITEM(spec, 0);
  Py_ssize_t nbytes = PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, 3));
  int per_device = PyObject_IsTrue(PyTuple_GET_ITEM(spec, 4));
  if (nbytes < 0 || per_device < 0) {
    Py_DECREF(spec);
    return 0;
  }
  uint64_t argv = WORD(frame, f_argv);
  int32_t carrier = *(const int32_t *)(uintptr_t)WORD(WORD(argv, 0), b_data);
  const void *data = (const void *)(uintptr_t)WORD(WORD(argv, 1), b_data);
  PyObject *args[3] = {NULL, NULL, NULL};
  PyObject *empty_args[2] = {PyTuple_GET_ITEM(spec, 1),
                             PyTuple_GET_ITEM(spec, 2)};
  args[1] = PyObject_Vectorcall(np_empty, empty_args, 2, NULL);
  if (args[1] == NULL) {
    Py_DECREF(spec);
    return 0;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE) < 0) {
    Py_DECREF(args[1]);
    Py_DECREF(spec);
    return 0;
  }
  if (view.len != nbytes) {
    PyBuffer_Release(&view);
    Py_DECREF(args[1]);
    Py_DECREF(spec);
    return 0;
  }
  memcpy(view.buf, data, (size_t)nbytes);
  PyBuffer_Release(&view);
  Py_ssize_t nargs = 2;
  if (per_device) {
    uint32_t pid = *(const uint32_t *)(uintptr_t)WORD(WORD(argv, 2), b_data);
    PyObject *pid_int = PyLong_FromUnsignedLong(pid);
    PyObject *partition =
        pid_int == NULL ? NULL : PyDict_GetItemWithError(partitions, pid_int);
    Py_XDECREF(pid_int);
    if (partition == NULL) {   /* (a new one: the Python handler adds it) */
      Py_DECREF(args[1]);
      Py_DECREF(spec);
      return 0;
    }
    Py_INCREF(partition);
    args[2] = partition;
    nargs = 3;
  }
  args[0] = PyLong_FromLong(carrier);
  if (args[0] == NULL) {
    Py_XDECREF(args[2]);
    Py_DECREF(args[1]);
    Py_DECREF(spec);
    return 0;
  }
  /* From here the host function has run: never the Python handler again. */
  PyObject *out = PyObject_Vectorcall(host, args, (size_t)nargs, NULL);
  Py_DECREF(args[0]);
  Py_DECREF(args[1]);
  Py_XDECREF(args[2]);
  Py_DECREF(spec);
  long value = 0;
  if (out != NULL) {
    PyObject *first = PySequence_GetItem(out, 0);
    Py_DECREF(out);
    if (first != NULL) {
      value = PyLong_AsLong(first);
      Py_DECREF(first);
      if (value == -1 && PyErr_Occurred()) {
        /* (reported below) */
      } else if (value < INT32_MIN || value > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a carrier out of int32");
      }
    }
  }
  if (PyErr_Occurred()) {   /* an XLA error made by the Python side */
    PyObject *exc = take_exception();
    PyObject *error = exc == NULL ? NULL : PyObject_CallOneArg(raised, exc);
    Py_XDECREF(exc);
    *result = NULL;
    if (error != NULL) {
      *result = PyLong_AsVoidPtr(error);
      Py_DECREF(error);
    }
    if (PyErr_Occurred()) PyErr_WriteUnraisable(raised);
    return 1;
  }
  uint64_t retv = WORD(frame, f_retv);
  *(int32_t *)(uintptr_t)WORD(WORD(retv, 0), b_data) = (int32_t)value;
  *result = NULL;
  return 1;
}

static void *entry0(void *frame) {
  void *result = NULL;
  PyGILState_STATE state = PyGILState_Ensure();
  if (!pinned) {   /* (keeps this thread's state: see host_target._pin) */
    PyGILState_Ensure();
    pinned = 1;
  }
  if (fast_ready && run_common((uint64_t)(uintptr_t)frame, &result)) {
    PyGILState_Release(state);
    return result;
  }
  PyErr_Clear();
  PyObject *address = PyLong_FromVoidPtr(frame);
  if (address != NULL) {
    PyObject *out = PyObject_CallOneArg(handler, address);
    Py_DECREF(address);
    if (out != NULL) {
      result = PyLong_AsVoidPtr(out);
      Py_DECREF(out);
    }
  }
  if (PyErr_Occurred()) {   /* (the handler answers errors itself) */
    PyErr_WriteUnraisable(handler);
    result = NULL;
  }
  PyGILState_Release(state);
  return result;
}

/* entry(handler) -> the address of the C function XLA calls. */
static PyObject *entry(PyObject *module, PyObject *fn) {
  (void)module;
  if (handler != NULL && handler != fn) {
    PyErr_SetString(PyExc_RuntimeError, "the entry has a handler already");
    return NULL;
  }
  Py_INCREF(fn);   /* (kept for the process's life, as the registration) */
  Py_XSETREF(handler, fn);
  return PyLong_FromVoidPtr((void *)entry0);
}

/* configure(words, sites, empty, partitions, raised): enables the common
   sites' path. words: (F_EXTENSION, F_ARGV, F_RETV, F_NATTRS,
   F_ATTR_TYPES, F_ATTRV, B_DATA, ATTR_STRING, F_NARGS, F_NRETS, B_DTYPE,
   B_RANK, B_DIMS). */
static PyObject *configure(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *words, *sites_, *empty_, *partitions_, *raised_;
  if (!PyArg_ParseTuple(args, "O!O!OO!O", &PyTuple_Type, &words,
                        &PyDict_Type, &sites_, &empty_, &PyDict_Type,
                        &partitions_, &raised_))
    return NULL;
  Py_ssize_t w[13];
  if (PyTuple_GET_SIZE(words) != 13) {
    PyErr_SetString(PyExc_ValueError, "13 layout words expected");
    return NULL;
  }
  for (int i = 0; i < 13; i++) {
    w[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(words, i));
    if (w[i] < 0) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "a negative layout word");
      return NULL;
    }
  }
  f_extension = w[0];
  f_argv = w[1];
  f_retv = w[2];
  f_nattrs = w[3];
  f_attr_types = w[4];
  f_attrv = w[5];
  b_data = w[6];
  attr_string = (int32_t)w[7];
  f_nargs = w[8];
  f_nrets = w[9];
  b_dtype = w[10];
  b_rank = w[11];
  b_dims = w[12];
  Py_INCREF(sites_);
  Py_XSETREF(sites, sites_);
  Py_INCREF(empty_);
  Py_XSETREF(np_empty, empty_);
  Py_INCREF(partitions_);
  Py_XSETREF(partitions, partitions_);
  Py_INCREF(raised_);
  Py_XSETREF(raised, raised_);
  if (compiled_name == NULL) {
    compiled_name = PyUnicode_InternFromString("compiled");
    if (compiled_name == NULL) return NULL;
  }
  fast_ready = 1;
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"entry", entry, METH_O,
     "entry(handler) -> address of the C function XLA calls as the FFI "
     "handler: handler(frame_address) answers what the common path does "
     "not run (an XLA_FFI_Error address, or 0)."},
    {"configure", configure, METH_VARARGS,
     "configure(words, sites, empty, partitions, raised): the layout words "
     "and what the common sites' path reads (see the source)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "jax_effects._primitives._trampoline",
    "The compiled entry of jax_effects' FFI host target (see the source).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL};

PyMODINIT_FUNC PyInit__trampoline(void) { return PyModule_Create(&module_def); }

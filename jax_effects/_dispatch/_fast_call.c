/* The compiled form of the dispatch hook's common case (call_path.fast_dispatch).

   ``FastCall(python_call, ...)`` is a callable that runs, with no Python
   frame, exactly the steps of the Python hook ``python_call`` that the
   common case takes: the thread's runtime token of the one chain in (a
   verified one: ``ThreadTokens.verified``), the computation launched, the
   returned token stored (the new runtime token of the chain and the
   thread's last output token), the next sequence number recorded. Every
   other case is the Python hook's, called with the same arguments before
   anything happened (under a trace, the thread's first call, another
   ordering mode, errors pending, a call from a host callback of the
   thread's own call, a token not verified, a launch that takes the launch
   lock), and so are the rare steps after the launch (a launch that raised,
   a token that is not the last dispatch's kind, a SIGINT or a callback
   error during the call): the Python helpers given at construction run
   them, as the Python hook does.

   Two things differ, by construction only: the returned token is known
   verified from the compiled FFI entry's count of entries on this thread
   (_trampoline.counter: entered during the launch, so the CPU client ran
   the computation inline, here) instead of asking it (is_ready); and the
   hook has no frame for the SIGINT handler to find, so while it launches
   and stores it names the frame that called it (caller(): a SIGINT that
   jaxlib's own signal checks handle there is the hook's, as one in the
   Python hook's frame is, interrupts.compiled_hook_caller).

   Its part in the token calling convention: the hook's (call_path): the
   executable takes the thread's runtime token of its chain first and
   returns (outputs, token); the returned token is stored before the call
   returns. Optional: built where a C compiler exists (setup.py); without
   it, or with JAX_EFFECTS_FAST_CALL=python, the Python hook is the hook.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject *python_call;   /* the Python hook: every other case */
  PyObject *general;       /* the function's general call */
  PyObject *jitted;        /* jitted(token, *args, **kwargs) -> (out, token) */
  PyObject *key;           /* the chain */
  PyObject *mode;          /* the ordering mode */
  PyObject *local;         /* threads.local (.state: ThreadTokens) */
  PyObject *trace, *eval_trace, *axis_env, *top_axis_env;   /* _compat.TOP_LEVEL */
  PyObject *errors;        /* errors.deferred (a dict, emptied, never replaced) */
  PyObject *site;          /* the hook's launch_lock.LaunchSite */
  PyObject *interrupted;   /* interrupts.slots (a set) */
  PyObject *own;           /* errors.own (.errors: a list) */
  PyObject *failed;        /* failed(state, key, seq, err): raises */
  PyObject *launched;      /* launch_lock.launched(site, sharding) */
  PyObject *uncommitted;   /* _compat.uncommitted(token) */
  PyObject *after;         /* after(state, token): raises, or returns None */
  PyObject *needs_tokens;  /* call_path.NeedsTokens */
  PyObject *store_failed;  /* store_failed(state, key, token, passed, seq) */
  unsigned long long seq_mask;
  /* The compiled FFI entry's count of entries on the calling thread
     (_trampoline.counter), or NULL (the ctypes entry). */
  unsigned long (*entries)(void);
  PyObject *counter;       /* its capsule, or None */
} FastCall;

static PyObject *s_value, *s_state, *s_fast_mode, *s_dispatching, *s_runtime,
    *s_verified, *s_serialize, *s_finish, *s_seqs, *s_sharding, *s_last_sharding,
    *s_last_token, *s_committed, *s_is_ready, *s_update, *s_store_interrupted,
    *s_seq, *s_errors;
static PyObject *k_zero, *k_one;

/* 1 if ``obj.name is expected``, 0 if not, -1 on an error (set). */
static int attr_is(PyObject *obj, PyObject *name, PyObject *expected) {
  PyObject *v = PyObject_GetAttr(obj, name);
  if (v == NULL) return -1;
  int same = v == expected;
  Py_DECREF(v);
  return same;
}

/* The thread's state if the common case holds (a new reference), else NULL
   with no error set: the Python hook decides. */
static PyObject *common_state(FastCall *self) {
  PyObject *state = NULL, *v = NULL;
  if (attr_is(self->trace, s_value, self->eval_trace) != 1) goto no;
  if (attr_is(self->axis_env, s_value, self->top_axis_env) != 1) goto no;
  if (PyDict_GET_SIZE(self->errors) != 0) goto no;
  state = PyObject_GetAttr(self->local, s_state);
  if (state == NULL) goto no;
  v = PyObject_GetAttr(state, s_fast_mode);
  if (v == NULL) goto no;
  if (v != self->mode && PyObject_RichCompareBool(v, self->mode, Py_EQ) != 1)
    goto no;
  Py_CLEAR(v);
  if (attr_is(state, s_dispatching, k_zero) != 1) {
    /* (0 is a cached small int: any other value, or an error) */
    PyErr_Clear();
    v = PyObject_GetAttr(state, s_dispatching);
    if (v == NULL || !PyLong_Check(v) || PyLong_AsLong(v) != 0) goto no;
    Py_CLEAR(v);
  }
  if (attr_is(self->site, s_serialize, Py_True) != 0) goto no;
  return state;
no:
  Py_XDECREF(v);
  Py_XDECREF(state);
  PyErr_Clear();
  return NULL;
}

/* Sets state.dispatching = 0 keeping the exception being raised, if any. */
static void end_dispatch(PyObject *state) {
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  if (PyObject_SetAttr(state, s_dispatching, k_zero) < 0) PyErr_Clear();
  PyErr_Restore(t, v, tb);
}

/* The launch raised (an error set): NeedsTokens goes to the general call
   (nothing ran); anything else to ``failed``, which raises it (or
   KeyboardInterrupt after a SIGINT). Returns 1 for the general call. */
static int launch_failed(FastCall *self, PyObject *state, PyObject *seq) {
  if (PyErr_ExceptionMatches(self->needs_tokens)) {
    PyErr_Clear();
    return 1;
  }
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  PyErr_NormalizeException(&t, &v, &tb);
  if (tb != NULL && v != NULL) PyException_SetTraceback(v, tb);
  PyObject *r = PyObject_CallFunctionObjArgs(
      self->failed, state, self->key, seq, v != NULL ? v : Py_None, NULL);
  Py_XDECREF(t);
  Py_XDECREF(v);
  Py_XDECREF(tb);
  if (r != NULL) {   /* (failed always raises) */
    Py_DECREF(r);
    PyErr_SetString(PyExc_SystemError,
                    "jax_effects: a failed launch was not raised");
  }
  return 0;
}

/* Stores the returned token (ThreadTokens.update for this one scalar
   chain, inlined, as the Python hook does); 0, or -1 with an error set. */
static int store(FastCall *self, PyObject *state, PyObject *passed,
                 PyObject *token, PyObject *seq, int ran_here) {
  int rc = -1;
  PyObject *sharding = NULL, *runtime = NULL, *seqs = NULL, *last = NULL,
      *stored = NULL, *r = NULL;
  sharding = PyObject_GetAttr(token, s_sharding);
  if (sharding == NULL) goto done;
  int same = attr_is(self->site, s_sharding, sharding);
  if (same < 0) goto done;
  if (!same) {
    r = PyObject_CallFunctionObjArgs(self->launched, self->site, sharding,
                                     NULL);
    if (r == NULL) goto done;
    Py_CLEAR(r);
  }
  runtime = PyObject_GetAttr(state, s_runtime);
  if (runtime == NULL || !PyDict_Check(runtime)) goto mismatch;
  last = PyObject_GetAttr(state, s_last_sharding);
  if (last == NULL) goto done;
  PyObject *current = PyDict_GetItemWithError(runtime, self->key);
  if (current == NULL && PyErr_Occurred()) goto done;
  if (last != sharding || current != passed) goto general;
  if (PyObject_SetAttr(state, s_last_token, token) < 0) goto done;
  r = PyObject_GetAttr(token, s_committed);
  if (r == NULL) goto done;
  int committed = PyObject_IsTrue(r);
  Py_CLEAR(r);
  if (committed < 0) goto done;
  if (committed) {
    stored = PyObject_CallOneArg(self->uncommitted, token);
    if (stored == NULL) goto done;
  } else {
    stored = Py_NewRef(token);
  }
  if (PyDict_SetItem(runtime, self->key, stored) < 0) goto done;
  seqs = PyObject_GetAttr(state, s_seqs);
  if (seqs == NULL || PyObject_SetItem(seqs, self->key, seq) < 0) goto done;
  /* Verified (ThreadTokens.verified): its computation ran inside the call.
     An entry of ours on this thread during the launch says so at no cost:
     the CPU client ran the computation inline, here, so it ended before
     the launch returned, and a failure would have been raised by it (one
     device: a launch over several CPU devices takes the Python hook).
     Else the token is asked (is_ready: a third of a microsecond). */
  int ready = ran_here && attr_is(self->site, s_serialize, Py_False) == 1;
  if (!ready) {
    PyErr_Clear();
    r = PyObject_CallMethodNoArgs(token, s_is_ready);
    if (r == NULL) goto done;
    ready = PyObject_IsTrue(r);
    Py_CLEAR(r);
    if (ready < 0) goto done;
  }
  if (!ready) {
    /* A program that runs the user's own function on the host: the call
       waits for it (site.finish: launch_lock.finish), True once ended. */
    r = PyObject_GetAttr(self->site, s_finish);
    if (r == NULL) goto done;
    if (r != Py_None) {
      PyObject *f = r;
      r = PyObject_CallOneArg(f, token);
      Py_DECREF(f);
      if (r == NULL) goto done;
      ready = PyObject_IsTrue(r);
      if (ready < 0) goto done;
    }
    Py_CLEAR(r);
  }
  if (ready && PyObject_SetAttr(state, s_verified, stored) < 0) goto done;
  rc = 0;
  goto done;
mismatch:
  if (PyErr_Occurred()) goto done;
general:
  /* (another device set than the last dispatch's, or a token kept on
     devices, or a call made inside this one stored a token meanwhile) */
  {
    PyObject *keys = NULL, *read = NULL, *kw = NULL, *update = NULL;
    keys = PyTuple_Pack(1, self->key);
    read = PyTuple_Pack(1, passed);
    kw = Py_BuildValue("{OO}", s_seq, seq);
    update = PyObject_GetAttr(state, s_update);
    if (keys && read && kw && update) {
      PyObject *args = PyTuple_Pack(3, keys, token, read);
      if (args != NULL) {
        r = PyObject_Call(update, args, kw);
        Py_DECREF(args);
        if (r != NULL) rc = 0;
        Py_CLEAR(r);
      }
    }
    Py_XDECREF(keys);
    Py_XDECREF(read);
    Py_XDECREF(kw);
    Py_XDECREF(update);
  }
done:
  Py_XDECREF(sharding);
  Py_XDECREF(runtime);
  Py_XDECREF(seqs);
  Py_XDECREF(last);
  Py_XDECREF(stored);
  Py_XDECREF(r);
  return rc;
}

/* The store failed (an error set, e.g. a KeyboardInterrupt from a SIGINT
   handled in one of its Python calls): ``store_failed`` stores the token
   anyway (ThreadTokens.store_interrupted); the error stays the one raised. */
static void store_failed(FastCall *self, PyObject *state, PyObject *passed,
                         PyObject *token, PyObject *seq) {
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  PyObject *r = PyObject_CallFunctionObjArgs(self->store_failed, state,
                                             self->key, token, passed, seq,
                                             NULL);
  if (r == NULL) PyErr_WriteUnraisable(self->python_call);
  Py_XDECREF(r);
  PyErr_Restore(t, v, tb);
}

/* The frame that called the hook on this thread while it launches and
   stores (borrowed: that frame is alive meanwhile), else NULL: a SIGINT
   handled with it as the current frame landed in the hook (caller()). */
static _Thread_local PyObject *calling_frame;

#define SMALL_ARGS 16

static PyObject *fast_call(PyObject *op, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
  FastCall *self = (FastCall *)op;
  PyObject *state = common_state(self);
  if (state == NULL)
    return PyObject_Vectorcall(self->python_call, args, nargsf, kwnames);
  PyObject *runtime = NULL, *passed = NULL, *seqs = NULL, *seq = NULL,
      *res = NULL, *out = NULL, *token = NULL, *v = NULL;
  int general = 0;

  runtime = PyObject_GetAttr(state, s_runtime);
  if (runtime == NULL || !PyDict_Check(runtime)) goto python;
  passed = PyDict_GetItemWithError(runtime, self->key);
  if (passed == NULL) goto python;   /* (a chain starting) */
  Py_INCREF(passed);
  if (attr_is(state, s_verified, passed) != 1) goto python;
  seqs = PyObject_GetAttr(state, s_seqs);
  if (seqs == NULL || !PyDict_Check(seqs)) goto python;
  v = PyDict_GetItemWithError(seqs, self->key);
  if (v == NULL || !PyLong_Check(v)) goto python;
  unsigned long long prev = PyLong_AsUnsignedLongLongMask(v);
  v = NULL;
  if (PyErr_Occurred()) goto python;
  seq = PyLong_FromUnsignedLongLong((prev + 1) & self->seq_mask);
  if (seq == NULL) goto python;

  /* ThreadTokens.begin_dispatch: a SIGINT is now handled by interrupts */
  if (PyObject_SetAttr(state, s_dispatching, k_one) < 0) goto python;
  calling_frame = (PyObject *)PyEval_GetFrame();

  /* launch: jitted(passed, *args, **kwargs) */
  unsigned long before = self->entries != NULL ? self->entries() : 0;
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  if (nargsf & PY_VECTORCALL_ARGUMENTS_OFFSET) {
    PyObject **slot = (PyObject **)args - 1;
    PyObject *saved = *slot;
    *slot = passed;
    res = PyObject_Vectorcall(self->jitted, slot,
                              (nargs + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                              kwnames);
    *slot = saved;
  } else {
    PyObject *small[SMALL_ARGS + 1];
    PyObject **argv = total < SMALL_ARGS
        ? small : PyMem_Malloc((total + 2) * sizeof(PyObject *));
    if (argv == NULL) {
      PyErr_NoMemory();
    } else {
      argv[1] = passed;
      for (Py_ssize_t i = 0; i < total; i++) argv[i + 2] = args[i];
      res = PyObject_Vectorcall(self->jitted, argv + 1,
                                (nargs + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                kwnames);
      if (argv != small) PyMem_Free(argv);
    }
  }
  if (res == NULL) {
    calling_frame = NULL;
    general = launch_failed(self, state, seq);
    end_dispatch(state);
    if (general) goto general_call;
    goto error;
  }
  if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 2) {
    PyErr_SetString(PyExc_SystemError,
                    "jax_effects: a threaded executable returned no token");
    calling_frame = NULL;
    end_dispatch(state);
    goto error;
  }
  out = Py_NewRef(PyTuple_GET_ITEM(res, 0));
  token = Py_NewRef(PyTuple_GET_ITEM(res, 1));
  Py_CLEAR(res);
  int ran_here = self->entries != NULL && self->entries() != before;
  if (store(self, state, passed, token, seq, ran_here) < 0) {
    store_failed(self, state, passed, token, seq);
    calling_frame = NULL;
    end_dispatch(state);
    goto error;
  }
  calling_frame = NULL;
  end_dispatch(state);   /* ThreadTokens.end_dispatch */

  /* a SIGINT during the call, or errors of callbacks that ran inline */
  int after = PySet_GET_SIZE(self->interrupted) != 0;
  if (!after) {
    v = PyObject_GetAttr(self->own, s_errors);
    if (v == NULL) goto error;
    after = PyObject_IsTrue(v);
    Py_CLEAR(v);
    if (after < 0) goto error;
  }
  if (after) {
    PyObject *r = PyObject_CallFunctionObjArgs(self->after, state, token, NULL);
    if (r == NULL) goto error;
    Py_DECREF(r);
  }
  Py_DECREF(state);
  Py_DECREF(runtime);
  Py_DECREF(passed);
  Py_DECREF(seqs);
  Py_DECREF(seq);
  Py_DECREF(token);
  return out;

python:   /* (nothing happened yet: the Python hook's case) */
  PyErr_Clear();
  Py_XDECREF(state);
  Py_XDECREF(runtime);
  Py_XDECREF(passed);
  Py_XDECREF(seqs);
  Py_XDECREF(seq);
  return PyObject_Vectorcall(self->python_call, args, nargsf, kwnames);

general_call:
  Py_XDECREF(state);
  Py_XDECREF(runtime);
  Py_XDECREF(passed);
  Py_XDECREF(seqs);
  Py_XDECREF(seq);
  return PyObject_Vectorcall(self->general, args, nargsf, kwnames);

error:
  Py_XDECREF(state);
  Py_XDECREF(runtime);
  Py_XDECREF(passed);
  Py_XDECREF(seqs);
  Py_XDECREF(seq);
  Py_XDECREF(res);
  Py_XDECREF(out);
  Py_XDECREF(token);
  return NULL;
}

static PyObject **fields(FastCall *self, int i) {
  PyObject **all[] = {
      &self->python_call, &self->general, &self->jitted, &self->key,
      &self->mode, &self->local, &self->trace, &self->eval_trace,
      &self->axis_env, &self->top_axis_env, &self->errors, &self->site,
      &self->interrupted, &self->own, &self->failed, &self->launched,
      &self->uncommitted, &self->after, &self->needs_tokens,
      &self->store_failed, &self->counter};
  return i < (int)(sizeof(all) / sizeof(all[0])) ? all[i] : NULL;
}

#define N_FIELDS 21

static PyObject *fc_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  unsigned long long mask;
  PyObject *v[N_FIELDS];
  void *entries = NULL;
  if (kw != NULL && PyDict_GET_SIZE(kw) != 0) {
    PyErr_SetString(PyExc_TypeError, "FastCall takes positional arguments");
    return NULL;
  }
  if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOOOOOOOKO:FastCall", &v[0],
                        &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8],
                        &v[9], &v[10], &v[11], &v[12], &v[13], &v[14], &v[15],
                        &v[16], &v[17], &v[18], &v[19], &mask, &v[20]))
    return NULL;
  if (v[20] != Py_None) {
    entries = PyCapsule_GetPointer(v[20], "jax_effects.entries");
    if (entries == NULL) return NULL;
  }
  if (!PyDict_Check(v[10]) || !PyAnySet_Check(v[12])) {
    PyErr_SetString(PyExc_TypeError,
                    "FastCall: errors must be a dict, interrupted a set");
    return NULL;
  }
  FastCall *self = (FastCall *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  for (int i = 0; i < N_FIELDS; i++) *fields(self, i) = Py_NewRef(v[i]);
  self->seq_mask = mask;
  self->entries = (unsigned long (*)(void))entries;
  self->vectorcall = fast_call;
  return (PyObject *)self;
}

static int fc_traverse(FastCall *self, visitproc visit, void *arg) {
  for (int i = 0; i < N_FIELDS; i++) Py_VISIT(*fields(self, i));
  return 0;
}

static int fc_clear(FastCall *self) {
  for (int i = 0; i < N_FIELDS; i++) Py_CLEAR(*fields(self, i));
  return 0;
}

static void fc_dealloc(FastCall *self) {
  PyObject_GC_UnTrack(self);
  fc_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *fc_get_python(FastCall *self, void *closure) {
  return Py_NewRef(self->python_call);
}

static PyGetSetDef fc_getset[] = {
    {"python_call", (getter)fc_get_python, NULL,
     "The Python hook: every case but the common one.", NULL},
    {NULL}};

static PyTypeObject FastCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "jax_effects._dispatch._fast_call.FastCall",
    .tp_basicsize = sizeof(FastCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC
                | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The dispatch hook's common case, compiled (module docstring).",
    .tp_new = fc_new,
    .tp_dealloc = (destructor)fc_dealloc,
    .tp_traverse = (traverseproc)fc_traverse,
    .tp_clear = (inquiry)fc_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FastCall, vectorcall),
    .tp_getset = fc_getset,
};

/* caller() -> the frame that called the hook on this thread, while it
   launches and stores, else None (interrupts: a SIGINT handled there landed
   in the hook, as in the Python hook's own frame). */
static PyObject *caller(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  return Py_NewRef(calling_frame != NULL ? calling_frame : Py_None);
}

static PyMethodDef methods[] = {
    {"caller", caller, METH_NOARGS,
     "caller() -> the frame that called the compiled hook on this thread "
     "while it launches and stores, else None."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fast_call",
    "The dispatch hook's common case, compiled (see _fast_call.c).", -1,
    methods};

#define INTERN(var, text) \
  if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__fast_call(void) {
  INTERN(s_value, "value");
  INTERN(s_state, "state");
  INTERN(s_fast_mode, "fast_mode");
  INTERN(s_dispatching, "dispatching");
  INTERN(s_runtime, "runtime");
  INTERN(s_verified, "verified");
  INTERN(s_serialize, "serialize");
  INTERN(s_finish, "finish");
  INTERN(s_seqs, "seqs");
  INTERN(s_sharding, "sharding");
  INTERN(s_last_sharding, "last_sharding");
  INTERN(s_last_token, "last_token");
  INTERN(s_committed, "_committed");
  INTERN(s_is_ready, "is_ready");
  INTERN(s_update, "update");
  INTERN(s_store_interrupted, "store_interrupted");
  INTERN(s_seq, "seq");
  INTERN(s_errors, "errors");
  if ((k_zero = PyLong_FromLong(0)) == NULL) return NULL;
  if ((k_one = PyLong_FromLong(1)) == NULL) return NULL;
  if (PyType_Ready(&FastCallType) < 0) return NULL;
  PyObject *m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  Py_INCREF(&FastCallType);
  if (PyModule_AddObject(m, "FastCall", (PyObject *)&FastCallType) < 0) {
    Py_DECREF(&FastCallType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}

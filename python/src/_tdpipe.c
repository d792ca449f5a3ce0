/*
 * _tdpipe: the CPython binding of libtdpipe. The pure-Python package
 * (tdpipe/__init__.py) builds the user-facing API on these types:
 *
 *   Schema    an immutable tdp_schema (built, decoded or received)
 *   Td        a tdp_td: received (lent by a pipe), loaned, or wrapping a
 *             Python buffer; exports its tensor leaves as DLPack capsules
 *   Pipe      a tdp_pipe; blocking calls release the GIL while they wait
 *   Listener  a tdp_listener
 *   Op        a reusable tdp_op whose completion is signalled on an eventfd,
 *             for asyncio (loop.add_reader)
 *   Server    a tdp_server whose handler calls back into Python on the
 *             library's loop thread (under PyGILState_Ensure)
 *   FanIn     a tdp_fanin (many producers, one stream)
 *   FanOut    a tdp_fanout (one producer, many consumers)
 *
 * Every pipe, listener and server of the process runs on one tdp_loop that
 * runs on its own thread, started with the first of them and never freed:
 * the process exit ends it. Callbacks that need the interpreter check
 * g_finalizing first, so nothing on the loop thread takes the GIL once the
 * interpreter is going away.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlpack/dlpack.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <tdpipe/tdpipe.h>

/* ---- globals -------------------------------------------------------------- */

static tdp_loop *g_loop;
static pthread_mutex_t g_loop_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int g_finalizing;
/* tdpipe._errors.make_error(code, name, message) -> exception instance. */
static PyObject *g_make_error;

static PyTypeObject SchemaType, TdType, PipeType, ListenerType, OpType, ServerType, FanInType,
    FanOutType;

/* Raise the Python exception for a tdpipe error; returns NULL. */
static PyObject *raise_tdp(tdp_err rc, const char *context)
{
    char msg[256];
    if (context != NULL)
        snprintf(msg, sizeof msg, "%s: %s (%s)", context, tdp_strerror(rc), tdp_errname(rc));
    else
        snprintf(msg, sizeof msg, "%s (%s)", tdp_strerror(rc), tdp_errname(rc));
    if (g_make_error == NULL) {
        PyErr_SetString(PyExc_RuntimeError, msg);
        return NULL;
    }
    PyObject *exc = PyObject_CallFunction(g_make_error, "iss", (int)rc, tdp_errname(rc), msg);
    if (exc == NULL)
        return NULL;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

/*
 * The second loop: nobody runs it, so every blocking call on its pipes
 * drives it on the calling thread (several threads take turns: the C
 * library's rule). No hand-off to another thread per call: the lowest
 * latency for blocking use, but no async operations and no progress
 * between calls.
 */
static tdp_loop *g_loop_caller;

static tdp_loop *get_loop_caller(void)
{
    pthread_mutex_lock(&g_loop_mu);
    tdp_err rc = TDP_OK;
    if (g_loop_caller == NULL)
        rc = tdp_loop_new(NULL, &g_loop_caller);
    pthread_mutex_unlock(&g_loop_mu);
    if (rc != TDP_OK) {
        raise_tdp(rc, "loop");
        return NULL;
    }
    return g_loop_caller;
}

/*
 * One pass of the caller loop's queued work, made after a pipe or listener
 * on it is freed. The free defers part of its teardown to a later turn of
 * the loop (libevent finalizes the control socket there, the pipe's memory
 * is reaped there), and nobody drives this loop between calls: without the
 * pass the socket stays open, and a server keeps the client until its
 * linger runs out. A stop task posted behind that work ends the pass. When
 * another thread drives the loop (a blocking call on another pipe), that
 * thread does the work: if the task runs there first, the stop it leaves
 * ends this run at once (a run never blocks waiting for a stop that went
 * elsewhere); if this run is refused, the stop left behind makes some later
 * pass empty, which costs only that pass. Without the GIL.
 */
static void pump_stop(void *arg)
{
    tdp_loop_stop(arg);
}

static void pump_caller_loop(void)
{
    tdp_loop *l = g_loop_caller;
    if (l == NULL || tdp_loop_post(l, pump_stop, l) != TDP_OK)
        return;
    (void)tdp_loop_run(l);
}

static tdp_loop *get_loop(void)
{
    pthread_mutex_lock(&g_loop_mu);
    if (g_loop == NULL) {
        tdp_loop *l;
        tdp_err rc = tdp_loop_new(NULL, &l);
        if (rc == TDP_OK && (rc = tdp_loop_start_thread(l)) != TDP_OK) {
            tdp_loop_free(l);
        } else if (rc == TDP_OK) {
            g_loop = l;
        }
        if (rc != TDP_OK) {
            pthread_mutex_unlock(&g_loop_mu);
            raise_tdp(rc, "loop");
            return NULL;
        }
    }
    pthread_mutex_unlock(&g_loop_mu);
    return g_loop;
}

/* Seconds (None: forever) to the library's milliseconds (-1: forever);
 * negative: an error for a call's timeout (as Python's own waits), "none"
 * for an option that documents it (neg_ok). */
static int secs_to_ms(PyObject *o, int64_t *out, bool neg_ok)
{
    if (o == NULL || o == Py_None) {
        *out = -1;
        return 0;
    }
    double s = PyFloat_AsDouble(o);
    if (s == -1.0 && PyErr_Occurred())
        return -1;
    if (s != s) {
        PyErr_SetString(PyExc_ValueError, "timeout is NaN (seconds, or None for no limit)");
        return -1;
    }
    if (s < 0) {
        if (!neg_ok) {
            PyErr_Format(PyExc_ValueError,
                         "timeout must be a non-negative number of seconds, or None for no "
                         "limit (got %g)",
                         s);
            return -1;
        }
        *out = -1;
        return 0;
    }
    if (s > 1e12)
        s = 1e12;
    *out = (int64_t)(s * 1000.0 + 0.5);
    return 0;
}

/* A call's timeout: seconds >= 0, or None. */
static int timeout_ms(PyObject *o, int64_t *out)
{
    return secs_to_ms(o, out, false);
}

/* An option's time: seconds, None or < 0 for none. */
static int opt_ms(PyObject *o, int64_t *out)
{
    return secs_to_ms(o, out, true);
}

/*
 * Waits with no bound, or a long one, are made in slices so that a signal
 * is seen (Ctrl-C while a consumer waits for a producer): between slices
 * the GIL is taken back and PyErr_CheckSignals runs the handlers, and an
 * exception one raises (KeyboardInterrupt) ends the wait. Only for calls
 * whose timeout leaves everything as it was (recv, accept: the operation is
 * withdrawn, the next call takes what comes).
 */
#define WAIT_SLICE_MS 100

typedef tdp_err (*wait_fn)(void *ctx, int64_t ms);

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/*
 * fn(ctx, slice) until it returns something other than TDP_ETIMEDOUT or ms
 * (-1: none) has passed. With the GIL held; released during each slice.
 * Returns -1 with an exception set when a signal handler raised one.
 */
static int wait_sliced(wait_fn fn, void *ctx, int64_t ms, tdp_err *rc)
{
    int64_t deadline = ms >= 0 ? mono_ms() + ms : -1;
    for (;;) {
        int64_t step = WAIT_SLICE_MS;
        int last = 0;
        if (deadline >= 0) {
            int64_t left = deadline - mono_ms();
            if (left <= WAIT_SLICE_MS) {
                step = left > 0 ? left : 0;
                last = 1;
            }
        }
        Py_BEGIN_ALLOW_THREADS *rc = fn(ctx, step);
        Py_END_ALLOW_THREADS if (*rc != TDP_ETIMEDOUT || last) return 0;
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
}

/* Fill pipe options from a dict of keyword options (unknown keys: TypeError). */
static int parse_opts(PyObject *d, tdp_pipe_opts *o)
{
    tdp_pipe_opts_default(o);
    if (d == NULL || d == Py_None)
        return 0;
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "options must be a dict");
        return -1;
    }
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(d, &pos, &k, &v)) {
        const char *key = PyUnicode_AsUTF8(k);
        if (key == NULL)
            return -1;
        if (v == Py_None)
            continue;
        if (!strcmp(key, "depth") || !strcmp(key, "recv_depth")) {
            long n = PyLong_AsLong(v);
            if (n == -1 && PyErr_Occurred())
                return -1;
            if (n < 1 || n > 64) {
                PyErr_SetString(PyExc_ValueError, "depth must be 1..64");
                return -1;
            }
            o->recv_depth = (uint32_t)n;
        } else if (!strcmp(key, "window")) {
            unsigned long long n = PyLong_AsUnsignedLongLong(v);
            if (n == (unsigned long long)-1 && PyErr_Occurred())
                return -1;
            if (n != 0 && (n < 4096 || n > (1ull << 30))) {
                PyErr_SetString(PyExc_ValueError, "window must be 0 or 4096..2**30 bytes");
                return -1;
            }
            o->recv_window_bytes = n;
        } else if (!strcmp(key, "connect_timeout")) {
            if (opt_ms(v, &o->connect_timeout_ms) < 0)
                return -1;
        } else if (!strcmp(key, "linger")) {
            if (opt_ms(v, &o->linger_ms) < 0)
                return -1;
        } else if (!strcmp(key, "reconnect")) {
            if (opt_ms(v, &o->reconnect_ms) < 0)
                return -1;
        } else if (!strcmp(key, "connect_wait")) {
            if (opt_ms(v, &o->connect_wait_ms) < 0)
                return -1;
            if (o->connect_wait_ms < 0)
                o->connect_wait_ms = 0;
        } else if (!strcmp(key, "latency_stats")) {
            int b = PyObject_IsTrue(v);
            if (b < 0)
                return -1;
            o->latency_stats = b != 0;
        } else if (!strcmp(key, "plane")) {
            const char *s = PyUnicode_AsUTF8(v);
            if (s == NULL)
                return -1;
            if (tdp_plane_parse(s, &o->plane) != TDP_OK) {
                PyErr_Format(PyExc_ValueError, "unknown plane %R (auto, ucx, shm, cuda-ipc, tcp)", v);
                return -1;
            }
        } else if (!strcmp(key, "peer_mode")) {
            const char *s = PyUnicode_AsUTF8(v);
            if (s == NULL)
                return -1;
            if (!strcmp(s, "auto"))
                o->peer_mode = TDP_PEER_AUTO;
            else if (!strcmp(s, "ucx"))
                o->peer_mode = TDP_PEER_UCX;
            else if (!strcmp(s, "socket"))
                o->peer_mode = TDP_PEER_SOCKET;
            else {
                PyErr_Format(PyExc_ValueError, "unknown peer_mode %R (auto, ucx, socket)", v);
                return -1;
            }
#ifdef TDP_SECRET_MIN
        } else if (!strcmp(key, "secret")) {
            /*
             * The library copies the secret when the pipe, listener or server
             * is made; the bytes object lives in the options dict until then.
             */
            char *buf;
            Py_ssize_t len;
            if (PyBytes_AsStringAndSize(v, &buf, &len) < 0)
                return -1;
            if (len < TDP_SECRET_MIN || len > TDP_SECRET_MAX) {
                PyErr_Format(PyExc_ValueError, "secret must be %d..%d bytes", TDP_SECRET_MIN,
                             TDP_SECRET_MAX);
                return -1;
            }
            o->secret = buf;
            o->secret_len = (size_t)len;
#endif
        } else if (!strcmp(key, "recv_device")) {
            /* the receive-device override: messages land on this device */
            const char *s = PyUnicode_AsUTF8(v);
            if (s == NULL)
                return -1;
            if (tdp_device_parse(s, &o->recv_device) != TDP_OK) {
                PyErr_Format(PyExc_ValueError, "recv_device %R: expected 'cpu' or 'cuda:N'", v);
                return -1;
            }
            o->recv_device_set = true;
        } else if (!strcmp(key, "cuda_device")) {
            long n = PyLong_AsLong(v);
            if (n == -1 && PyErr_Occurred())
                return -1;
            if (n < 0 || n > INT32_MAX) {
                PyErr_SetString(PyExc_ValueError, "cuda_device must be a device index >= 0");
                return -1;
            }
            o->cuda_device = (int)n;
            o->cuda_device_set = true;
        } else if (!strcmp(key, "keepalive")) {
            int a, b, c;
            if (!PyArg_ParseTuple(v, "iii", &a, &b, &c))
                return -1;
            o->keepalive_idle_s = a;
            o->keepalive_intvl_s = b;
            o->keepalive_cnt = c;
        } else {
            PyErr_Format(PyExc_TypeError, "unknown pipe option %R", k);
            return -1;
        }
    }
    return 0;
}

/* ---- Schema ---------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD tdp_schema *s;
} SchemaObject;

static PyObject *schema_wrap(tdp_schema *s) /* takes a new reference on s */
{
    SchemaObject *o = PyObject_New(SchemaObject, &SchemaType);
    if (o == NULL)
        return NULL;
    o->s = tdp_schema_ref(s);
    return (PyObject *)o;
}

static void schema_dealloc(SchemaObject *self)
{
    tdp_schema_unref(self->s);
    PyObject_Free(self);
}

static int parse_device(const char *name, tdp_device *out)
{
    if (tdp_device_parse(name, out) != TDP_OK) {
        PyErr_Format(PyExc_ValueError, "device %s: expected 'cpu' or 'cuda:N'", name);
        return -1;
    }
    return 0;
}

static PyObject *device_str(tdp_device dev)
{
    char buf[TDP_DEVICE_STRLEN];
    return PyUnicode_FromString(tdp_device_format(dev, buf));
}

/*
 * Schema.build(nodes, tensors, values[, device]): nodes [(path, cls, batch_size)],
 * tensors [(path, dtype_name, shape)] in buffer order, values [(path,
 * json_text)].
 */
static PyObject *schema_build(PyObject *cls, PyObject *args)
{
    PyObject *nodes, *tensors, *values;
    const char *devname = NULL;
    if (!PyArg_ParseTuple(args, "OOO|z", &nodes, &tensors, &values, &devname))
        return NULL;
    tdp_device dev = TDP_DEVICE_CPU_INIT;
    if (devname != NULL && parse_device(devname, &dev) < 0)
        return NULL;
    PyObject *res = NULL, *fn = NULL, *ft = NULL, *fv = NULL;
    tdp_schema_builder *b = NULL;
    tdp_err rc = tdp_schema_builder_new(&b);
    if (rc != TDP_OK)
        return raise_tdp(rc, "schema builder");
    if (dev.type != TDP_DEVICE_CPU && (rc = tdp_schema_builder_set_device(b, dev)) != TDP_OK) {
        raise_tdp(rc, "schema device");
        goto done;
    }
    if ((fn = PySequence_Fast(nodes, "nodes")) == NULL ||
        (ft = PySequence_Fast(tensors, "tensors")) == NULL ||
        (fv = PySequence_Fast(values, "values")) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fn); i++) {
        const char *path, *ncls;
        PyObject *bs;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fn, i), "szO", &path, &ncls, &bs))
            goto done;
        int64_t dims[TDP_MAX_RANK];
        Py_ssize_t nd = PySequence_Size(bs);
        if (nd < 0 || nd > TDP_MAX_RANK) {
            PyErr_SetString(PyExc_ValueError, "batch_size rank");
            goto done;
        }
        for (Py_ssize_t d = 0; d < nd; d++) {
            PyObject *x = PySequence_GetItem(bs, d);
            if (x == NULL)
                goto done;
            dims[d] = PyLong_AsLongLong(x);
            Py_DECREF(x);
            if (dims[d] == -1 && PyErr_Occurred())
                goto done;
        }
        if ((rc = tdp_schema_builder_node(b, path, ncls, (uint32_t)nd, dims)) != TDP_OK) {
            raise_tdp(rc, path);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ft); i++) {
        const char *path, *dtn;
        PyObject *shape;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(ft, i), "ssO", &path, &dtn, &shape))
            goto done;
        tdp_dtype dt;
        if (tdp_dtype_parse(dtn, &dt) != TDP_OK) {
            PyErr_Format(PyExc_TypeError, "leaf '%s': dtype %s is not supported by tdpipe", path,
                         dtn);
            goto done;
        }
        int64_t dims[TDP_MAX_RANK];
        Py_ssize_t nd = PySequence_Size(shape);
        if (nd < 0 || nd > TDP_MAX_RANK) {
            PyErr_Format(PyExc_ValueError, "leaf %s: rank over %d", path, TDP_MAX_RANK);
            goto done;
        }
        for (Py_ssize_t d = 0; d < nd; d++) {
            PyObject *x = PySequence_GetItem(shape, d);
            if (x == NULL)
                goto done;
            dims[d] = PyLong_AsLongLong(x);
            Py_DECREF(x);
            if (dims[d] == -1 && PyErr_Occurred())
                goto done;
        }
        if ((rc = tdp_schema_builder_tensor(b, path, dt, (uint32_t)nd, dims)) != TDP_OK) {
            raise_tdp(rc, path);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fv); i++) {
        const char *path, *json;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fv, i), "ss", &path, &json))
            goto done;
        if ((rc = tdp_schema_builder_value(b, path, json)) != TDP_OK) {
            raise_tdp(rc, path);
            goto done;
        }
    }
    char why[256] = "";
    tdp_schema *s;
    if ((rc = tdp_schema_builder_finish(b, &s, why, sizeof why)) != TDP_OK) {
        raise_tdp(rc, why[0] ? why : "schema");
        goto done;
    }
    res = schema_wrap(s);
    tdp_schema_unref(s);
done:
    Py_XDECREF(fn);
    Py_XDECREF(ft);
    Py_XDECREF(fv);
    tdp_schema_builder_free(b);
    return res;
}

/* Schema.decode(json_bytes): validate untrusted JSON with the default limits. */
static PyObject *schema_decode(PyObject *cls, PyObject *arg)
{
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0)
        return NULL;
    char why[256] = "";
    tdp_schema *s;
    tdp_err rc = tdp_schema_decode(v.buf, (size_t)v.len, NULL, &s, why, sizeof why);
    PyBuffer_Release(&v);
    if (rc != TDP_OK)
        return raise_tdp(rc, why[0] ? why : "schema");
    PyObject *res = schema_wrap(s);
    tdp_schema_unref(s);
    return res;
}

static PyObject *schema_json(SchemaObject *self, void *c)
{
    size_t len;
    const char *j = tdp_schema_json(self->s, &len);
    return PyUnicode_FromStringAndSize(j, (Py_ssize_t)len);
}

static PyObject *schema_hash_get(SchemaObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(tdp_schema_hash(self->s));
}

static PyObject *schema_total_bytes(SchemaObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(tdp_schema_total_bytes(self->s));
}

static PyObject *int64_tuple(uint32_t n, const int64_t *v)
{
    PyObject *t = PyTuple_New(n);
    if (t == NULL)
        return NULL;
    for (uint32_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/*
 * leaves() -> [(path, dtype_name or None, shape, offset, nbytes, value_json
 * or None)] in the schema's order: tensors by offset, then values.
 */
static PyObject *schema_leaves(SchemaObject *self, PyObject *unused)
{
    uint32_t n = tdp_schema_num_leaves(self->s);
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (uint32_t i = 0; i < n; i++) {
        tdp_leaf lf;
        tdp_err rc = tdp_schema_leaf_at(self->s, i, &lf);
        if (rc != TDP_OK) {
            Py_DECREF(list);
            return raise_tdp(rc, "leaf");
        }
        PyObject *shape = int64_tuple(lf.ndim, lf.shape);
        if (shape == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyObject *t;
        if (lf.kind == TDP_LEAF_TENSOR)
            t = Py_BuildValue("(ssNKKO)", lf.path, tdp_dtype_name(lf.dtype), shape,
                              (unsigned long long)lf.offset, (unsigned long long)lf.nbytes,
                              Py_None);
        else
            t = Py_BuildValue("(sONKKs)", lf.path, Py_None, shape, 0ULL, 0ULL, lf.value_json);
        if (t == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, t);
    }
    return list;
}

/* nodes() -> [(path, cls, batch_size)] in depth-first pre-order. */
static PyObject *schema_nodes(SchemaObject *self, PyObject *unused)
{
    uint32_t n = tdp_schema_num_nodes(self->s);
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (uint32_t i = 0; i < n; i++) {
        tdp_node_info ni;
        tdp_err rc = tdp_schema_node_at(self->s, i, &ni);
        if (rc != TDP_OK) {
            Py_DECREF(list);
            return raise_tdp(rc, "node");
        }
        PyObject *t =
            Py_BuildValue("(ssN)", ni.path, ni.cls, int64_tuple(ni.batch_ndim, ni.batch_size));
        if (t == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, t);
    }
    return list;
}

static PyObject *schema_richcompare(PyObject *a, PyObject *b, int op)
{
    if ((op != Py_EQ && op != Py_NE) || !PyObject_TypeCheck(b, &SchemaType))
        Py_RETURN_NOTIMPLEMENTED;
    bool eq = tdp_schema_equal(((SchemaObject *)a)->s, ((SchemaObject *)b)->s);
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

static Py_hash_t schema_pyhash(SchemaObject *self)
{
    Py_hash_t h = (Py_hash_t)tdp_schema_hash(self->s);
    return h == -1 ? -2 : h;
}

static PyMethodDef schema_methods[] = {
    {"build", (PyCFunction)schema_build, METH_VARARGS | METH_CLASS, NULL},
    {"decode", (PyCFunction)schema_decode, METH_O | METH_CLASS, NULL},
    {"leaves", (PyCFunction)schema_leaves, METH_NOARGS, NULL},
    {"nodes", (PyCFunction)schema_nodes, METH_NOARGS, NULL},
    {NULL},
};

static PyObject *schema_device(SchemaObject *self, void *c)
{
    return device_str(tdp_schema_device(self->s));
}

static PyGetSetDef schema_getset[] = {
    {"device", (getter)schema_device, NULL, NULL, NULL},
    {"json", (getter)schema_json, NULL, NULL, NULL},
    {"hash", (getter)schema_hash_get, NULL, NULL, NULL},
    {"total_bytes", (getter)schema_total_bytes, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject SchemaType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tdpipe._tdpipe.Schema",
    .tp_basicsize = sizeof(SchemaObject),
    .tp_dealloc = (destructor)schema_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = schema_methods,
    .tp_getset = schema_getset,
    .tp_richcompare = schema_richcompare,
    .tp_hash = (hashfunc)schema_pyhash,
};

/* ---- Td -------------------------------------------------------------------- */

struct PipeObject;
struct FanInObject;

typedef struct {
    PyObject_HEAD tdp_td *td; /* one reference of ours */
    /* The pipe that lent it (NULL: not lent, nothing to give back). */
    struct PipeObject *pipe;
    /* Or the fan-in that lent it, and the producer it came from. */
    struct FanInObject *fanin;
    void *fsrc;
    int released;
    /* A message the server lent to its handler: valid during the call only. */
    int expired;
    uint64_t seq;
} TdObject;

typedef struct PipeObject {
    PyObject_HEAD tdp_pipe *pipe;
    uint32_t depth;
    int on_thread; /* on the loop thread's loop (async ops possible) */
    /* Depth 1: the message lent last (borrowed; it clears this when it dies). */
    TdObject *last_lent;
    /* The Schema object of the last message received, reused while it holds. */
    SchemaObject *recv_schema;
    int busy_tx, busy_rx; /* a blocking send (or prepare, close) / receive is under way */
    /* seq of the last message recv() handed out, and the last resume it saw:
     * stats' msgs_recv also counts messages that landed and wait (a window) */
    uint64_t recv_seq, resumed_seen;
    /* sends with no timeout (send_forever): the op, the gather buffer, and
     * whether a send interrupted by a signal may still be in flight on it */
    tdp_op *txop;
    tdp_td *gtd;
    int tx_orphan;
} PipeObject;

static TdObject *td_new_obj(tdp_td *td) /* takes a new reference on td */
{
    TdObject *o = PyObject_New(TdObject, &TdType);
    if (o == NULL)
        return NULL;
    o->td = tdp_td_ref(td);
    o->pipe = NULL;
    o->fanin = NULL;
    o->fsrc = NULL;
    o->released = 0;
    o->expired = 0;
    o->seq = 0;
    return o;
}

static void fanin_give_back(TdObject *self);

static void td_give_back(TdObject *self)
{
    if (self->pipe != NULL && !self->released && self->pipe->pipe != NULL)
        tdp_pipe_release(self->pipe->pipe, self->td);
    if (self->fanin != NULL && !self->released)
        fanin_give_back(self);
    self->released = 1;
}

static void td_dealloc(TdObject *self)
{
    if (self->fanin != NULL) {
        /* a fan-in's message is given back when it dies, as at depth N */
        td_give_back(self);
        Py_CLEAR(self->fanin);
    }
    if (self->pipe != NULL) {
        /* At depth N an unreleased message is given back when it dies. */
        if (self->pipe->depth > 1)
            td_give_back(self);
        if (self->pipe->last_lent == self)
            self->pipe->last_lent = NULL;
        Py_DECREF(self->pipe);
    }
    /* Dropping a wrapped Python buffer's last reference runs its release
     * (which takes the GIL we hold: PyGILState_Ensure nests). */
    tdp_td_unref(self->td);
    PyObject_Free(self);
}

static int td_check_live(TdObject *self)
{
    if (self->released || self->expired) {
        PyErr_SetString(PyExc_ValueError,
                        "message released: its buffer may already hold another message");
        return -1;
    }
    return 0;
}

static void capsule_free(PyObject *cap)
{
    /* Called when the capsule dies unconsumed ("used_dltensor" otherwise). */
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
        if (m != NULL && m->deleter != NULL)
            m->deleter(m);
    }
}

/* capsules() -> [DLPack capsule of each tensor leaf, in schema order]. */
static PyObject *td_capsules(TdObject *self, PyObject *unused)
{
    if (td_check_live(self) < 0)
        return NULL;
    tdp_schema *s = tdp_td_schema(self->td);
    uint32_t n = tdp_schema_num_tensors(s);
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (uint32_t i = 0; i < n; i++) {
        tdp_leaf lf;
        DLManagedTensor *m;
        tdp_err rc = tdp_schema_leaf_at(s, i, &lf);
        if (rc == TDP_OK)
            rc = tdp_td_to_dlpack(self->td, lf.path, &m);
        if (rc != TDP_OK) {
            Py_DECREF(list);
            return raise_tdp(rc, "dlpack export");
        }
        PyObject *cap = PyCapsule_New(m, "dltensor", capsule_free);
        if (cap == NULL) {
            m->deleter(m);
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, cap);
    }
    return list;
}

/* capsule(i) -> one DLPack capsule of tensor leaf i. */
static PyObject *td_capsule(TdObject *self, PyObject *arg)
{
    if (td_check_live(self) < 0)
        return NULL;
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    tdp_schema *s = tdp_td_schema(self->td);
    if (i < 0 || (uint32_t)i >= tdp_schema_num_tensors(s)) {
        PyErr_SetString(PyExc_IndexError, "leaf index");
        return NULL;
    }
    tdp_leaf lf;
    DLManagedTensor *m;
    tdp_err rc = tdp_schema_leaf_at(s, (uint32_t)i, &lf);
    if (rc == TDP_OK)
        rc = tdp_td_to_dlpack(self->td, lf.path, &m);
    if (rc != TDP_OK)
        return raise_tdp(rc, "dlpack export");
    PyObject *cap = PyCapsule_New(m, "dltensor", capsule_free);
    if (cap == NULL)
        m->deleter(m);
    return cap;
}

static PyObject *td_release(TdObject *self, PyObject *unused)
{
    td_give_back(self);
    Py_RETURN_NONE;
}

static PyObject *td_schema(TdObject *self, void *c)
{
    tdp_schema *s = tdp_td_schema(self->td);
    if (self->pipe != NULL && self->pipe->recv_schema != NULL && self->pipe->recv_schema->s == s) {
        Py_INCREF(self->pipe->recv_schema);
        return (PyObject *)self->pipe->recv_schema;
    }
    return schema_wrap(s);
}

static PyObject *td_data_ptr(TdObject *self, void *c)
{
    return PyLong_FromVoidPtr(tdp_td_data(self->td));
}

static PyObject *td_nbytes(TdObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(tdp_td_nbytes(self->td));
}

static PyObject *td_seq(TdObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(self->seq);
}

static PyObject *td_released(TdObject *self, void *c)
{
    return PyBool_FromLong(self->released || self->expired);
}

/* Td.alloc(schema): a new owned buffer (contents undefined). */
static PyObject *td_alloc(PyObject *cls, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &SchemaType)) {
        PyErr_SetString(PyExc_TypeError, "Schema expected");
        return NULL;
    }
    tdp_td *td;
    tdp_err rc = tdp_td_new(((SchemaObject *)arg)->s, &td);
    if (rc != TDP_OK)
        return raise_tdp(rc, "allocate");
    TdObject *o = td_new_obj(td);
    tdp_td_unref(td);
    return (PyObject *)o;
}

/*
 * A host buffer is filled with memcpy (the sources are host memory); a
 * device buffer through the library's copy, which takes host or device
 * sources and never touches device memory from host code.
 */
static tdp_err fill_leaves(tdp_td *td, const void *const *src, uint32_t n)
{
    bool dev = tdp_td_device(td).type != TDP_DEVICE_CPU;
    for (uint32_t i = 0; i < n; i++) {
        tdp_leaf lf;
        if (tdp_td_leaf_at(td, i, &lf) != TDP_OK || lf.nbytes == 0)
            continue;
        if (!dev) {
            memcpy(lf.data, src[i], lf.nbytes);
            continue;
        }
        tdp_err rc = tdp_mem_copy(lf.data, src[i], lf.nbytes);
        if (rc != TDP_OK)
            return rc;
    }
    return TDP_OK;
}

/* Copies of this many bytes or more are made without the GIL. */
#define FILL_NOGIL_BYTES (64u * 1024u)

/* fill_leaves, a large or device copy without the GIL (held on entry). */
static tdp_err fill_leaves_gil(tdp_td *td, const void *const *src, uint32_t n)
{
    tdp_err rc;
    if (tdp_td_nbytes(td) >= FILL_NOGIL_BYTES || tdp_td_device(td).type != TDP_DEVICE_CPU) {
        Py_BEGIN_ALLOW_THREADS rc = fill_leaves(td, src, n);
        Py_END_ALLOW_THREADS
    } else {
        rc = fill_leaves(td, src, n);
    }
    return rc;
}

/*
 * fill(ptrs): copy tensor leaf i from address ptrs[i] (host memory). The
 * caller keeps the source leaves alive for the call; a large copy is made
 * without the GIL so other threads (an asyncio loop's executor, the loop
 * thread's handlers) run meanwhile.
 */
static PyObject *td_fill(TdObject *self, PyObject *arg)
{
    PyObject *f = PySequence_Fast(arg, "ptrs");
    if (f == NULL)
        return NULL;
    tdp_td *td = self->td;
    uint32_t n = tdp_schema_num_tensors(tdp_td_schema(td));
    if ((uint32_t)PySequence_Fast_GET_SIZE(f) != n) {
        Py_DECREF(f);
        PyErr_SetString(PyExc_ValueError, "one address per tensor leaf");
        return NULL;
    }
    const void *small[64];
    const void **v = small;
    if (n > 64 && (v = PyMem_Malloc(sizeof(*v) * n)) == NULL) {
        Py_DECREF(f);
        return PyErr_NoMemory();
    }
    for (uint32_t i = 0; i < n; i++) {
        v[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(f, i));
        if (v[i] == NULL && PyErr_Occurred()) {
            if (v != small)
                PyMem_Free(v);
            Py_DECREF(f);
            return NULL;
        }
    }
    Py_DECREF(f);
    tdp_err rc = fill_leaves_gil(td, v, n);
    if (v != small)
        PyMem_Free(v);
    if (rc != TDP_OK)
        return raise_tdp(rc, "copy into the buffer");
    Py_RETURN_NONE;
}

static void wrap_release(void *buf, void *arg)
{
    if (atomic_load(&g_finalizing))
        return; /* the interpreter is going: leak the owner rather than touch it */
    PyGILState_STATE st = PyGILState_Ensure();
    Py_DECREF((PyObject *)arg);
    PyGILState_Release(st);
}

/*
 * Td.wrap(schema, address, nbytes, owner): borrow a Python buffer (owner
 * is kept alive until the library lets go of the buffer).
 */
static PyObject *td_wrap(PyObject *cls, PyObject *args)
{
    PyObject *schema, *addr, *owner;
    unsigned long long nbytes;
    const char *devname = NULL;
    if (!PyArg_ParseTuple(args, "O!OKO|z", &SchemaType, &schema, &addr, &nbytes, &owner, &devname))
        return NULL;
    tdp_device dev = TDP_DEVICE_CPU_INIT;
    if (devname != NULL && parse_device(devname, &dev) < 0)
        return NULL;
    void *p = PyLong_AsVoidPtr(addr);
    if (p == NULL && PyErr_Occurred())
        return NULL;
    tdp_td *td;
    Py_INCREF(owner);
    tdp_err rc = tdp_td_wrap(((SchemaObject *)schema)->s, p, nbytes, dev, wrap_release, owner, &td);
    if (rc != TDP_OK) {
        Py_DECREF(owner);
        return raise_tdp(rc, "wrap");
    }
    TdObject *o = td_new_obj(td);
    tdp_td_unref(td);
    return (PyObject *)o;
}

static PyObject *td_device(TdObject *self, void *c)
{
    return device_str(tdp_td_device(self->td));
}

/*
 * read(i) -> bytes of tensor leaf i, copied to the host by the library
 * (the buffer may be device memory, which host code must not touch).
 */
static PyObject *td_read(TdObject *self, PyObject *arg)
{
    if (td_check_live(self) < 0)
        return NULL;
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    tdp_leaf lf;
    if (i < 0 || (uint32_t)i >= tdp_schema_num_tensors(tdp_td_schema(self->td)) ||
        tdp_td_leaf_at(self->td, (uint32_t)i, &lf) != TDP_OK) {
        PyErr_SetString(PyExc_IndexError, "leaf index");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)lf.nbytes);
    if (out == NULL)
        return NULL;
    tdp_err rc;
    char *dst = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS rc = tdp_mem_copy(dst, lf.data, lf.nbytes);
    Py_END_ALLOW_THREADS if (rc != TDP_OK)
    {
        Py_DECREF(out);
        return raise_tdp(rc, "copy to the host");
    }
    return out;
}

/*
 * to_device(name) -> a new owned Td on that device ("cpu", "cuda:N") with
 * this one's bytes: one copy of the whole buffer by the library.
 */
static PyObject *td_to_device(TdObject *self, PyObject *arg)
{
    if (td_check_live(self) < 0)
        return NULL;
    const char *name = PyUnicode_AsUTF8(arg);
    tdp_device dev;
    if (name == NULL || parse_device(name, &dev) < 0)
        return NULL;
    tdp_schema *s;
    tdp_td *out;
    tdp_err rc = tdp_schema_with_device(tdp_td_schema(self->td), dev, &s);
    if (rc != TDP_OK)
        return raise_tdp(rc, "schema device");
    rc = tdp_td_new(s, &out);
    tdp_schema_unref(s);
    if (rc != TDP_OK)
        return raise_tdp(rc, "allocate");
    void *dst = tdp_td_data(out);
    const void *src = tdp_td_data(self->td);
    uint64_t n = tdp_schema_total_bytes(tdp_td_schema(self->td));
    Py_BEGIN_ALLOW_THREADS rc = tdp_mem_copy(dst, src, n);
    Py_END_ALLOW_THREADS if (rc != TDP_OK)
    {
        tdp_td_unref(out);
        return raise_tdp(rc, "copy between devices");
    }
    TdObject *o = td_new_obj(out);
    tdp_td_unref(out);
    return (PyObject *)o;
}

static PyMethodDef td_methods[] = {
    {"read", (PyCFunction)td_read, METH_O, NULL},
    {"to_device", (PyCFunction)td_to_device, METH_O, NULL},
    {"capsules", (PyCFunction)td_capsules, METH_NOARGS, NULL},
    {"capsule", (PyCFunction)td_capsule, METH_O, NULL},
    {"release", (PyCFunction)td_release, METH_NOARGS, NULL},
    {"fill", (PyCFunction)td_fill, METH_O, NULL},
    {"alloc", (PyCFunction)td_alloc, METH_O | METH_CLASS, NULL},
    {"wrap", (PyCFunction)td_wrap, METH_VARARGS | METH_CLASS, NULL},
    {NULL},
};

static PyGetSetDef td_getset[] = {
    {"device", (getter)td_device, NULL, NULL, NULL},
    {"schema", (getter)td_schema, NULL, NULL, NULL},
    {"data_ptr", (getter)td_data_ptr, NULL, NULL, NULL},
    {"nbytes", (getter)td_nbytes, NULL, NULL, NULL},
    {"seq", (getter)td_seq, NULL, NULL, NULL},
    {"released", (getter)td_released, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject TdType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tdpipe._tdpipe.Td",
    .tp_basicsize = sizeof(TdObject),
    .tp_dealloc = (destructor)td_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = td_methods,
    .tp_getset = td_getset,
};

/* ---- Pipe ------------------------------------------------------------------ */

static PipeObject *pipe_new_obj(tdp_pipe *p, uint32_t depth, int on_thread)
{
    PipeObject *o = PyObject_New(PipeObject, &PipeType);
    if (o == NULL) {
        Py_BEGIN_ALLOW_THREADS tdp_pipe_free(p);
        Py_END_ALLOW_THREADS return NULL;
    }
    o->pipe = p;
    o->depth = depth ? depth : 1;
    o->on_thread = on_thread;
    o->last_lent = NULL;
    o->recv_schema = NULL;
    o->busy_tx = o->busy_rx = 0;
    o->recv_seq = 0;
    o->resumed_seen = 0;
    o->txop = NULL;
    o->gtd = NULL;
    o->tx_orphan = 0;
    return o;
}

/*
 * A blocking call may start: the pipe is there and no other thread is in a
 * blocking call of the same direction on it (rx: a receive; else a send,
 * a prepare). A send on one thread and a receive on another may run at
 * once, as the C calls may.
 */
static int pipe_check(PipeObject *self, bool rx)
{
    if (self->pipe == NULL) {
        raise_tdp(TDP_ECANCELED, "pipe freed");
        return -1;
    }
    if (rx ? self->busy_rx : self->busy_tx) {
        PyErr_SetString(PyExc_RuntimeError,
                        rx ? "another thread is in a blocking receive on this pipe"
                           : "another thread is in a blocking send on this pipe");
        return -1;
    }
    return 0;
}

/* Pipe.connect(host, port, opts) */
static PyObject *pipe_connect(PyObject *cls, PyObject *args)
{
    const char *host;
    int port, on_thread = 0;
    PyObject *d = NULL;
    if (!PyArg_ParseTuple(args, "si|Op", &host, &port, &d, &on_thread))
        return NULL;
    if (port < 0 || port > 65535) {
        PyErr_SetString(PyExc_ValueError, "port must be 0..65535");
        return NULL;
    }
    tdp_pipe_opts o;
    if (parse_opts(d, &o) < 0)
        return NULL;
    tdp_loop *loop = on_thread ? get_loop() : get_loop_caller();
    if (loop == NULL)
        return NULL;
    tdp_pipe *p;
    tdp_err rc;
    Py_BEGIN_ALLOW_THREADS rc = tdp_pipe_connect(loop, host, (uint16_t)port, &o, &p);
    Py_END_ALLOW_THREADS if (rc != TDP_OK) return raise_tdp(rc, "connect");
    return (PyObject *)pipe_new_obj(p, o.recv_depth, on_thread);
}

/*
 * Start a send. A large one without the GIL: starting runs the send's first
 * steps here when the loop is idle, the copy into a shared-memory slot
 * among them. A small one keeps it (dropping and taking the GIL would cost
 * more than the copy).
 */
static void start_send(tdp_pipe *p, tdp_td *t, tdp_op *op)
{
    if (tdp_td_nbytes(t) >= FILL_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS tdp_pipe_send_async(p, t, op);
        Py_END_ALLOW_THREADS
    } else {
        tdp_pipe_send_async(p, t, op);
    }
}

static tdp_err op_wait_slice(void *ctx, int64_t ms)
{
    return tdp_op_wait((tdp_op *)ctx, ms);
}

/*
 * A send with no timeout, which Ctrl-C must be able to end: started on the
 * pipe's own op and waited for in slices (a blocking send cannot be, since
 * one that times out after the transport took it is still delivered). At
 * a signal the send stays in flight and may still be delivered; the op
 * keeps td (and what it wraps) until it completes, and the next send
 * waits for it first. Returns -1 with the signal's exception set.
 */
/* A send a signal interrupted is over (its outcome: a failed pipe fails the next send too). */
static int tx_settle(PipeObject *self, tdp_err *rc)
{
    if (!self->tx_orphan)
        return 0;
    if (wait_sliced(op_wait_slice, self->txop, -1, rc) < 0)
        return -1;
    self->tx_orphan = 0;
    return 0;
}

static int send_forever(PipeObject *self, tdp_td *t, tdp_err *rc)
{
    if (self->txop == NULL && (*rc = tdp_op_new(NULL, NULL, &self->txop)) != TDP_OK)
        return 0;
    if (tx_settle(self, rc) < 0)
        return -1;
    tdp_op *op = self->txop;
    start_send(self->pipe, t, op);
    if (wait_sliced(op_wait_slice, op, -1, rc) < 0) {
        self->tx_orphan = 1;
        return -1;
    }
    return 0;
}

/* The gather of send_gather into the pipe's own buffer for send_forever (host memory). */
static tdp_err gather_into(PipeObject *self, tdp_schema *s, const void *const *v, uint32_t n)
{
    if (self->gtd == NULL || tdp_td_schema(self->gtd) != s) {
        tdp_td *td;
        tdp_err rc = tdp_td_new(s, &td);
        if (rc != TDP_OK)
            return rc;
        tdp_td_unref(self->gtd);
        self->gtd = td;
    }
    return fill_leaves_gil(self->gtd, v, n);
}

static PyObject *pipe_send_td(PipeObject *self, PyObject *args)
{
    TdObject *td;
    PyObject *to = NULL;
    int64_t ms;
    if (!PyArg_ParseTuple(args, "O!|O", &TdType, &td, &to) || timeout_ms(to, &ms) < 0 ||
        pipe_check(self, false) < 0)
        return NULL;
    if (td->expired || td->released) {
        td_check_live(td);
        return NULL;
    }
    tdp_err rc;
    tdp_pipe *p = self->pipe;
    tdp_td *t = td->td;
    self->busy_tx = 1;
    if (ms < 0) {
        int sig = send_forever(self, t, &rc);
        self->busy_tx = 0;
        if (sig < 0)
            return NULL;
    } else {
        Py_BEGIN_ALLOW_THREADS rc = tdp_pipe_send(p, t, ms);
        Py_END_ALLOW_THREADS self->busy_tx = 0;
    }
    if (rc != TDP_OK)
        return raise_tdp(rc, "send");
    Py_RETURN_NONE;
}

/* send_gather(schema, ptrs, timeout): leaf i from ptrs[i]; the pipe's own buffer. */
static PyObject *pipe_send_gather(PipeObject *self, PyObject *args)
{
    SchemaObject *sch;
    PyObject *ptrs, *to = NULL;
    int64_t ms;
    if (!PyArg_ParseTuple(args, "O!O|O", &SchemaType, &sch, &ptrs, &to) ||
        timeout_ms(to, &ms) < 0 || pipe_check(self, false) < 0)
        return NULL;
    PyObject *f = PySequence_Fast(ptrs, "ptrs");
    if (f == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    if ((uint32_t)n != tdp_schema_num_tensors(sch->s)) {
        Py_DECREF(f);
        PyErr_SetString(PyExc_ValueError, "one address per tensor leaf");
        return NULL;
    }
    const void *small[64];
    const void **v = small;
    if (n > 64 && (v = PyMem_Malloc(sizeof(*v) * (size_t)n)) == NULL) {
        Py_DECREF(f);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        v[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(f, i));
        if (v[i] == NULL && PyErr_Occurred()) {
            if (v != small)
                PyMem_Free(v);
            Py_DECREF(f);
            return NULL;
        }
    }
    tdp_err rc;
    tdp_pipe *p = self->pipe;
    tdp_schema *s = sch->s;
    self->busy_tx = 1;
    int sig = 0;
    if (ms < 0) {
        /* the previous send from that buffer is over first (gather_into rewrites it) */
        sig = tx_settle(self, &rc);
        if (sig == 0 && (rc = gather_into(self, s, (const void *const *)v, (uint32_t)n)) == TDP_OK)
            sig = send_forever(self, self->gtd, &rc);
    } else {
        Py_BEGIN_ALLOW_THREADS rc = tdp_pipe_send_gather(p, s, (const void *const *)v, ms);
        Py_END_ALLOW_THREADS
    }
    self->busy_tx = 0;
    if (v != small)
        PyMem_Free(v);
    Py_DECREF(f);
    if (sig < 0)
        return NULL;
    if (rc != TDP_OK)
        return raise_tdp(rc, "send");
    Py_RETURN_NONE;
}

/* Wrap a td the pipe lent (recv or an async receive op). */
static PyObject *pipe_lent_td(PipeObject *self, tdp_td *t, uint64_t seq)
{
    if (self->depth == 1 && self->last_lent != NULL) {
        /* the receive that produced t released the previous message */
        self->last_lent->released = 1;
        self->last_lent = NULL;
    }
    TdObject *o = td_new_obj(t);
    if (o == NULL) {
        if (self->depth > 1)
            tdp_pipe_release(self->pipe, t);
        return NULL;
    }
    Py_INCREF(self);
    o->pipe = self;
    o->seq = seq;
    if (self->depth == 1)
        self->last_lent = o;
    tdp_schema *s = tdp_td_schema(t);
    if (self->recv_schema == NULL || self->recv_schema->s != s) {
        PyObject *so = schema_wrap(s);
        if (so == NULL) {
            Py_DECREF(o);
            return NULL;
        }
        Py_XSETREF(self->recv_schema, (SchemaObject *)so);
    }
    return (PyObject *)o;
}

typedef struct recv_ctx {
    tdp_pipe *p;
    tdp_td **t;
} recv_ctx;

static tdp_err recv_slice(void *ctx, int64_t ms)
{
    recv_ctx *r = ctx;
    return tdp_pipe_recv(r->p, ms, r->t);
}

static PyObject *pipe_recv(PipeObject *self, PyObject *args)
{
    PyObject *to = NULL;
    int64_t ms;
    if (!PyArg_ParseTuple(args, "|O", &to) || timeout_ms(to, &ms) < 0 || pipe_check(self, true) < 0)
        return NULL;
    tdp_err rc;
    tdp_td *t = NULL;
    tdp_pipe *p = self->pipe;
    tdp_pipe_stats st = {0};
    self->busy_rx = 1;
    recv_ctx rx = {p, &t};
    int sig = wait_sliced(recv_slice, &rx, ms, &rc);
    /*
     * Queries made off the loop thread wait for it (they run there), so
     * they are made without the GIL too: the loop thread may need it.
     */
    if (sig == 0 && (rc == TDP_OK || rc == TDP_ECHECKSUM)) {
        Py_BEGIN_ALLOW_THREADS tdp_pipe_stats_get(p, &st);
        Py_END_ALLOW_THREADS
    }
    self->busy_rx = 0;
    if (sig < 0) {
        /* interrupted between slices: nothing was taken; at depth 1 the
         * first slice gave the previous message back */
        if (self->depth == 1 && self->last_lent != NULL) {
            self->last_lent->released = 1;
            self->last_lent = NULL;
        }
        return NULL;
    }
    if (st.resumed_from != 0 && st.resumed_from != self->resumed_seen) {
        self->resumed_seen = st.resumed_from; /* a new link's stream goes on from there */
        self->recv_seq = st.resumed_from - 1;
    }
    if (rc == TDP_OK || rc == TDP_ECHECKSUM) /* a dropped message had its number too */
        self->recv_seq++;
    /* depth 1: the receive released the previous message first, whatever its outcome */
    if (self->depth == 1 && self->last_lent != NULL) {
        self->last_lent->released = 1;
        self->last_lent = NULL;
    }
    if (rc != TDP_OK)
        return raise_tdp(rc, "recv");
    return pipe_lent_td(self, t, self->recv_seq);
}

/* prepare(schema, timeout): tdp_pipe_prepare. */
static PyObject *pipe_prepare(PipeObject *self, PyObject *args)
{
    SchemaObject *sc;
    PyObject *to = NULL;
    int64_t ms;
    if (!PyArg_ParseTuple(args, "O!|O", &SchemaType, &sc, &to) || timeout_ms(to, &ms) < 0 ||
        pipe_check(self, false) < 0)
        return NULL;
    tdp_err rc;
    tdp_pipe *p = self->pipe;
    tdp_schema *s = sc->s;
    self->busy_tx = 1;
    Py_BEGIN_ALLOW_THREADS rc = tdp_pipe_prepare(p, s, ms);
    Py_END_ALLOW_THREADS self->busy_tx = 0;
    if (rc != TDP_OK)
        return raise_tdp(rc, "prepare");
    Py_RETURN_NONE;
}

static PyObject *pipe_loan(PipeObject *self, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &SchemaType)) {
        PyErr_SetString(PyExc_TypeError, "Schema expected");
        return NULL;
    }
    if (self->pipe == NULL)
        return raise_tdp(TDP_ECANCELED, "pipe freed");
    tdp_td *t;
    tdp_err rc;
    tdp_pipe *p = self->pipe;
    tdp_schema *s = ((SchemaObject *)arg)->s;
    Py_BEGIN_ALLOW_THREADS rc = tdp_pipe_loan(p, s, &t);
    Py_END_ALLOW_THREADS if (rc != TDP_OK) return raise_tdp(rc, "loan");
    TdObject *o = td_new_obj(t);
    tdp_td_unref(t);
    return (PyObject *)o;
}

static PyObject *pipe_close(PipeObject *self, PyObject *args)
{
    PyObject *to = NULL;
    int64_t ms;
    if (!PyArg_ParseTuple(args, "|O", &to) || timeout_ms(to, &ms) < 0)
        return NULL;
    if (self->pipe == NULL)
        Py_RETURN_NONE;
    if (self->busy_tx || self->busy_rx) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is in a blocking call on this pipe");
        return NULL;
    }
    tdp_err rc;
    tdp_pipe *p = self->pipe;
    self->busy_tx = self->busy_rx = 1;
    Py_BEGIN_ALLOW_THREADS rc = tdp_pipe_close(p, ms);
    Py_END_ALLOW_THREADS self->busy_tx = self->busy_rx = 0;
    if (rc != TDP_OK && rc != TDP_ECLOSED)
        return raise_tdp(rc, "close");
    Py_RETURN_NONE;
}

static PyObject *pipe_abort(PipeObject *self, PyObject *unused)
{
    tdp_pipe *p = self->pipe;
    if (p != NULL) {
        Py_BEGIN_ALLOW_THREADS tdp_pipe_abort(p, TDP_ECANCELED);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static void pipe_free_now(PipeObject *self)
{
    tdp_pipe *p = self->pipe;
    if (p == NULL)
        return;
    self->pipe = NULL;
    /* Messages still lent stay valid (we hold references) but go back to nobody. */
    int caller = !self->on_thread;
    Py_BEGIN_ALLOW_THREADS tdp_pipe_free(p);
    if (caller)
        pump_caller_loop();
    Py_END_ALLOW_THREADS
        /* the free completed a send still in flight on it (TDP_ECANCELED) */
        tdp_op_free(self->txop);
    self->txop = NULL;
    tdp_td_unref(self->gtd);
    self->gtd = NULL;
}

static PyObject *pipe_free_m(PipeObject *self, PyObject *unused)
{
    if (self->busy_tx || self->busy_rx) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is in a blocking call on this pipe");
        return NULL;
    }
    pipe_free_now(self);
    Py_RETURN_NONE;
}

static void pipe_dealloc(PipeObject *self)
{
    pipe_free_now(self);
    Py_CLEAR(self->recv_schema);
    PyObject_Free(self);
}

static PyObject *pipe_stats(PipeObject *self, PyObject *unused)
{
    if (self->pipe == NULL)
        return raise_tdp(TDP_ECANCELED, "pipe freed");
    tdp_pipe_stats s;
    tdp_pipe *p = self->pipe;
    Py_BEGIN_ALLOW_THREADS tdp_pipe_stats_get(p, &s);
    Py_END_ALLOW_THREADS return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsK}", "msgs_sent", s.msgs_sent, "msgs_recv", s.msgs_recv, "bytes_sent",
        s.bytes_sent, "bytes_recv", s.bytes_recv, "schemas_sent", s.schemas_sent, "schemas_recv",
        s.schemas_recv, "credit_waits", s.credit_waits, "reconnects", s.reconnects, "resumed_from",
        s.resumed_from, "unconfirmed", s.unconfirmed);
}

/* latency(which): the summary of a latency histogram, in ns (None: not kept). */
static PyObject *pipe_latency(PipeObject *self, PyObject *arg)
{
    if (self->pipe == NULL)
        return raise_tdp(TDP_ECANCELED, "pipe freed");
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL)
        return NULL;
    tdp_latency which;
    if (!strcmp(name, "send"))
        which = TDP_LAT_SEND;
    else if (!strcmp(name, "recv_wait"))
        which = TDP_LAT_RECV_WAIT;
    else {
        PyErr_Format(PyExc_ValueError, "unknown latency %R (send, recv_wait)", arg);
        return NULL;
    }
    tdp_hist *h = PyMem_Malloc(sizeof(*h)); /* about 15 KB: not on the stack */
    if (h == NULL)
        return PyErr_NoMemory();
    tdp_err rc;
    tdp_pipe *p = self->pipe;
    Py_BEGIN_ALLOW_THREADS rc = tdp_pipe_latency_get(p, which, h);
    Py_END_ALLOW_THREADS if (rc == TDP_ENOTSUP)
    {
        PyMem_Free(h);
        Py_RETURN_NONE;
    }
    if (rc != TDP_OK) {
        PyMem_Free(h);
        return raise_tdp(rc, "latency");
    }
    tdp_hist_summary sm;
    tdp_hist_summarize(h, &sm);
    PyMem_Free(h);
    return Py_BuildValue("{sKsKsKsKsKsKsKsd}", "count", sm.count, "min", sm.min, "p50", sm.p50,
                         "p90", sm.p90, "p99", sm.p99, "p999", sm.p999, "max", sm.max, "mean",
                         sm.mean);
}

static PyObject *pipe_plane(PipeObject *self, void *c)
{
    if (self->pipe == NULL)
        Py_RETURN_NONE;
    tdp_plane pl;
    tdp_pipe *p = self->pipe;
    Py_BEGIN_ALLOW_THREADS pl = tdp_pipe_plane(p);
    Py_END_ALLOW_THREADS return PyUnicode_FromString(tdp_plane_name(pl));
}

static PyObject *pipe_peer(PipeObject *self, void *c)
{
    if (self->pipe == NULL)
        Py_RETURN_NONE;
    char buf[128];
    const char *r;
    tdp_pipe *p = self->pipe;
    Py_BEGIN_ALLOW_THREADS r = tdp_pipe_peer(p, buf, sizeof buf);
    Py_END_ALLOW_THREADS return PyUnicode_FromString(r ? r : "");
}

static PyObject *pipe_status(PipeObject *self, void *c)
{
    tdp_err rc = TDP_ECANCELED;
    tdp_pipe *p = self->pipe;
    if (p != NULL) {
        Py_BEGIN_ALLOW_THREADS rc = tdp_pipe_status(p);
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLong(rc);
}

static PyObject *pipe_depth(PipeObject *self, void *c)
{
    return PyLong_FromUnsignedLong(self->depth);
}

static PyObject *pipe_on_thread(PipeObject *self, void *c)
{
    return PyBool_FromLong(self->on_thread);
}

static PyMethodDef pipe_methods[] = {
    {"connect", (PyCFunction)pipe_connect, METH_VARARGS | METH_CLASS, NULL},
    {"send_td", (PyCFunction)pipe_send_td, METH_VARARGS, NULL},
    {"send_gather", (PyCFunction)pipe_send_gather, METH_VARARGS, NULL},
    {"recv", (PyCFunction)pipe_recv, METH_VARARGS, NULL},
    {"loan", (PyCFunction)pipe_loan, METH_O, NULL},
    {"prepare", (PyCFunction)pipe_prepare, METH_VARARGS, NULL},
    {"close", (PyCFunction)pipe_close, METH_VARARGS, NULL},
    {"abort", (PyCFunction)pipe_abort, METH_NOARGS, NULL},
    {"free", (PyCFunction)pipe_free_m, METH_NOARGS, NULL},
    {"stats", (PyCFunction)pipe_stats, METH_NOARGS, NULL},
    {"latency", (PyCFunction)pipe_latency, METH_O, NULL},
    {NULL},
};

static PyGetSetDef pipe_getset[] = {
    {"plane", (getter)pipe_plane, NULL, NULL, NULL},
    {"peer", (getter)pipe_peer, NULL, NULL, NULL},
    {"status", (getter)pipe_status, NULL, NULL, NULL},
    {"depth", (getter)pipe_depth, NULL, NULL, NULL},
    {"on_thread", (getter)pipe_on_thread, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject PipeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tdpipe._tdpipe.Pipe",
    .tp_basicsize = sizeof(PipeObject),
    .tp_dealloc = (destructor)pipe_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = pipe_methods,
    .tp_getset = pipe_getset,
};

/* ---- Listener -------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD tdp_listener *l;
    uint32_t depth;
    int busy, on_thread;
} ListenerObject;

static PyObject *listener_listen(PyObject *cls, PyObject *args)
{
    const char *host;
    int port = 0, on_thread = 0;
    PyObject *d = NULL;
    if (!PyArg_ParseTuple(args, "z|iOp", &host, &port, &d, &on_thread))
        return NULL;
    if (port < 0 || port > 65535) {
        PyErr_SetString(PyExc_ValueError, "port must be 0..65535");
        return NULL;
    }
    tdp_pipe_opts o;
    if (parse_opts(d, &o) < 0)
        return NULL;
    tdp_loop *loop = on_thread ? get_loop() : get_loop_caller();
    if (loop == NULL)
        return NULL;
    tdp_listener *l;
    tdp_err rc;
    Py_BEGIN_ALLOW_THREADS rc = tdp_listener_new(loop, host, (uint16_t)port, &o, NULL, NULL, &l);
    Py_END_ALLOW_THREADS if (rc != TDP_OK) return raise_tdp(rc, "listen");
    ListenerObject *lo = PyObject_New(ListenerObject, &ListenerType);
    if (lo == NULL) {
        Py_BEGIN_ALLOW_THREADS tdp_listener_free(l);
        Py_END_ALLOW_THREADS return NULL;
    }
    lo->l = l;
    lo->depth = o.recv_depth;
    lo->busy = 0;
    lo->on_thread = on_thread;
    return (PyObject *)lo;
}

typedef struct accept_ctx {
    tdp_listener *l;
    tdp_pipe **p;
} accept_ctx;

static tdp_err accept_slice(void *ctx, int64_t ms)
{
    accept_ctx *a = ctx;
    return tdp_listener_accept(a->l, ms, a->p);
}

static PyObject *listener_accept(ListenerObject *self, PyObject *args)
{
    PyObject *to = NULL;
    int64_t ms;
    if (!PyArg_ParseTuple(args, "|O", &to) || timeout_ms(to, &ms) < 0)
        return NULL;
    if (self->l == NULL)
        return raise_tdp(TDP_ECANCELED, "listener closed");
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is accepting on this listener");
        return NULL;
    }
    tdp_pipe *p;
    tdp_err rc;
    tdp_listener *l = self->l;
    self->busy = 1;
    accept_ctx ax = {l, &p};
    int sig = wait_sliced(accept_slice, &ax, ms, &rc);
    self->busy = 0;
    if (sig < 0)
        return NULL;
    if (rc != TDP_OK)
        return raise_tdp(rc, "accept");
    return (PyObject *)pipe_new_obj(p, self->depth, self->on_thread);
}

static void listener_free_now(ListenerObject *self)
{
    tdp_listener *l = self->l;
    if (l == NULL)
        return;
    self->l = NULL;
    int caller = !self->on_thread;
    Py_BEGIN_ALLOW_THREADS tdp_listener_free(l);
    if (caller)
        pump_caller_loop();
    Py_END_ALLOW_THREADS
}

static PyObject *listener_close(ListenerObject *self, PyObject *unused)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is accepting on this listener");
        return NULL;
    }
    listener_free_now(self);
    Py_RETURN_NONE;
}

static void listener_dealloc(ListenerObject *self)
{
    listener_free_now(self);
    PyObject_Free(self);
}

static PyObject *listener_port(ListenerObject *self, void *c)
{
    if (self->l == NULL)
        Py_RETURN_NONE;
    return PyLong_FromLong(tdp_listener_port(self->l));
}

static PyMethodDef listener_methods[] = {
    {"listen", (PyCFunction)listener_listen, METH_VARARGS | METH_CLASS, NULL},
    {"accept", (PyCFunction)listener_accept, METH_VARARGS, NULL},
    {"close", (PyCFunction)listener_close, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef listener_getset[] = {
    {"port", (getter)listener_port, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject ListenerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tdpipe._tdpipe.Listener",
    .tp_basicsize = sizeof(ListenerObject),
    .tp_dealloc = (destructor)listener_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = listener_methods,
    .tp_getset = listener_getset,
};

/* ---- Op (asyncio) ---------------------------------------------------------- */

typedef struct {
    PyObject_HEAD tdp_op *op;
    int efd;
    /* While an operation is pending: what it uses (kept alive). */
    PipeObject *pipe;
    TdObject *td;
    int pending, is_recv;
} OpObject;

static void op_done(tdp_op *op, void *arg)
{
    /* Loop thread, no GIL: only wake the asyncio loop. */
    int fd = (int)(intptr_t)arg;
    uint64_t one = 1;
    ssize_t n;
    do {
        n = write(fd, &one, sizeof one);
    } while (n < 0 && errno == EINTR);
}

static PyObject *op_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    tdp_op *op;
    tdp_err rc = tdp_op_new(op_done, (void *)(intptr_t)fd, &op);
    if (rc != TDP_OK) {
        close(fd);
        return raise_tdp(rc, "op");
    }
    OpObject *o = (OpObject *)type->tp_alloc(type, 0);
    if (o == NULL) {
        tdp_op_free(op);
        close(fd);
        return NULL;
    }
    o->op = op;
    o->efd = fd;
    return (PyObject *)o;
}

static int op_check_idle(OpObject *self, PipeObject *p)
{
    if (!p->on_thread) {
        PyErr_SetString(PyExc_RuntimeError,
                        "async operations need a pipe on the loop thread (loop=\"thread\")");
        return -1;
    }
    if (self->pending) {
        PyErr_SetString(PyExc_RuntimeError, "operation already pending");
        return -1;
    }
    return 0;
}

static PyObject *op_start_recv(OpObject *self, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &PipeType)) {
        PyErr_SetString(PyExc_TypeError, "Pipe expected");
        return NULL;
    }
    PipeObject *p = (PipeObject *)arg;
    if (op_check_idle(self, p) < 0 || pipe_check(p, true) < 0)
        return NULL;
    if (p->depth == 1 && p->last_lent != NULL) {
        /* the receive releases the previous message */
        p->last_lent->released = 1;
        p->last_lent = NULL;
    }
    Py_INCREF(p);
    self->pipe = p;
    self->pending = 1;
    self->is_recv = 1;
    tdp_pipe_recv_async(p->pipe, self->op);
    Py_RETURN_NONE;
}

static PyObject *op_start_send(OpObject *self, PyObject *args)
{
    PipeObject *p;
    TdObject *td;
    if (!PyArg_ParseTuple(args, "O!O!", &PipeType, &p, &TdType, &td))
        return NULL;
    if (op_check_idle(self, p) < 0 || pipe_check(p, false) < 0)
        return NULL;
    Py_INCREF(p);
    Py_INCREF(td);
    self->pipe = p;
    self->td = td;
    self->pending = 1;
    self->is_recv = 0;
    start_send(p->pipe, td->td, self->op); /* its callback only writes the eventfd */
    Py_RETURN_NONE;
}

/*
 * result() -> None while pending (call again after the fd is readable);
 * else the received Td (receives), True (sends), or raises the error.
 */
static PyObject *op_result(OpObject *self, PyObject *unused)
{
    uint64_t v;
    while (read(self->efd, &v, sizeof v) > 0) {
    }
    if (!self->pending) {
        PyErr_SetString(PyExc_RuntimeError, "no operation started");
        return NULL;
    }
    tdp_err rc = tdp_op_result(self->op);
    if (rc == TDP_EAGAIN)
        Py_RETURN_NONE;
    PipeObject *p = self->pipe;
    self->pipe = NULL;
    self->pending = 0;
    Py_CLEAR(self->td);
    PyObject *res;
    if (rc != TDP_OK)
        res = raise_tdp(rc, self->is_recv ? "recv" : "send");
    else if (self->is_recv) {
        p->recv_seq = tdp_op_seq(self->op); /* a later recv() goes on from it */
        res = pipe_lent_td(p, tdp_op_td(self->op), p->recv_seq);
    } else
        res = Py_NewRef(Py_True);
    Py_DECREF(p);
    return res;
}

/*
 * settle(us): wait up to us microseconds, without the GIL, yielding the
 * CPU, for the operation to complete; then as result(). A send started
 * while the loop thread held the loop usually completes within a few
 * microseconds: waiting here for it costs less than a round through the
 * asyncio event loop (eventfd, epoll, a callback, a task step).
 */
static PyObject *op_result(OpObject *self, PyObject *unused);

static PyObject *op_settle(OpObject *self, PyObject *arg)
{
    long us = PyLong_AsLong(arg);
    if (us == -1 && PyErr_Occurred())
        return NULL;
    if (self->pending && us > 0 && tdp_op_result(self->op) == TDP_EAGAIN) {
        tdp_op *op = self->op;
        Py_BEGIN_ALLOW_THREADS struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        do {
            sched_yield();
            clock_gettime(CLOCK_MONOTONIC, &t);
        } while (tdp_op_result(op) == TDP_EAGAIN &&
                 (t.tv_sec - t0.tv_sec) * 1000000L + (t.tv_nsec - t0.tv_nsec) / 1000 < us);
        Py_END_ALLOW_THREADS
    }
    return op_result(self, NULL);
}

/* drain(): empty the eventfd (a wake-up nobody waits for any more). */
static PyObject *op_drain(OpObject *self, PyObject *unused)
{
    uint64_t v;
    while (read(self->efd, &v, sizeof v) > 0) {
    }
    Py_RETURN_NONE;
}

static PyObject *op_fileno(OpObject *self, PyObject *unused)
{
    return PyLong_FromLong(self->efd);
}

static void op_dealloc(OpObject *self)
{
    if (self->pending && tdp_op_result(self->op) == TDP_EAGAIN) {
        /*
         * Still pending (the coroutine was dropped without the pipe being
         * closed): the library may still complete it, so the op, its fd and
         * what it uses are leaked rather than freed under it.
         */
        PyObject_Free(self);
        return;
    }
    Py_CLEAR(self->pipe);
    Py_CLEAR(self->td);
    tdp_op_free(self->op);
    close(self->efd);
    Py_TYPE(self)->tp_free(self);
}

static PyMethodDef op_methods[] = {
    {"start_recv", (PyCFunction)op_start_recv, METH_O, NULL},
    {"start_send", (PyCFunction)op_start_send, METH_VARARGS, NULL},
    {"result", (PyCFunction)op_result, METH_NOARGS, NULL},
    {"fileno", (PyCFunction)op_fileno, METH_NOARGS, NULL},
    {"drain", (PyCFunction)op_drain, METH_NOARGS, NULL},
    {"settle", (PyCFunction)op_settle, METH_O, NULL},
    {NULL},
};

static PyTypeObject OpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tdpipe._tdpipe.Op",
    .tp_basicsize = sizeof(OpObject),
    .tp_dealloc = (destructor)op_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = op_new,
    .tp_methods = op_methods,
};

/* ---- Server ---------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD tdp_server *srv;
    /* handler(request: Td, client_id: int) -> Td or None; runs on the loop thread. */
    PyObject *handler;
    PyObject *on_close; /* on_close(client_id, code) or None */
} ServerObject;

static tdp_err srv_on_message(tdp_client *c, tdp_td *td, void *arg)
{
    if (atomic_load(&g_finalizing))
        return TDP_ECANCELED;
    ServerObject *self = arg;
    tdp_err ret = TDP_OK;
    PyGILState_STATE st = PyGILState_Ensure();
    TdObject *req = td_new_obj(td);
    if (req == NULL) {
        PyErr_WriteUnraisable(self->handler);
        PyGILState_Release(st);
        return TDP_ENOMEM;
    }
    PyObject *reply = PyObject_CallFunction(self->handler, "OK", (PyObject *)req,
                                            (unsigned long long)tdp_client_id(c));
    req->expired = 1; /* lent for the call only */
    Py_DECREF(req);
    if (reply == NULL) {
        PyErr_WriteUnraisable(self->handler);
        ret = TDP_EINTERNAL;
    } else if (reply != Py_None) {
        if (!PyObject_TypeCheck(reply, &TdType)) {
            PyErr_SetString(PyExc_TypeError, "server handler must return a Td or None");
            PyErr_WriteUnraisable(self->handler);
            ret = TDP_EINVAL;
        } else {
            tdp_err rc = tdp_client_send(c, ((TdObject *)reply)->td);
            if (rc != TDP_OK && rc != TDP_ECLOSED)
                ret = rc;
        }
    }
    Py_XDECREF(reply);
    PyGILState_Release(st);
    return ret;
}

static void srv_on_close(tdp_client *c, tdp_err status, void *arg)
{
    ServerObject *self = arg;
    if (atomic_load(&g_finalizing) || self->on_close == NULL)
        return;
    PyGILState_STATE st = PyGILState_Ensure();
    PyObject *r = PyObject_CallFunction(self->on_close, "Ki", (unsigned long long)tdp_client_id(c),
                                        (int)status);
    if (r == NULL)
        PyErr_WriteUnraisable(self->on_close);
    Py_XDECREF(r);
    PyGILState_Release(st);
}

/* A limit of tdp_server_opts from Python: None or 0 keeps the default. */
static int limit_u32(PyObject *o, const char *name, uint32_t *out)
{
    if (o == NULL || o == Py_None)
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "%s must be an integer >= 0", name);
        return -1;
    }
    if (v > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s must be at most %u", name, (unsigned)UINT32_MAX);
        return -1;
    }
    if (v > 0)
        *out = (uint32_t)v;
    return 0;
}

/* A timeout limit in seconds (None keeps the default; < 0: none). */
static int limit_ms(PyObject *o, int64_t *out)
{
    if (o == NULL || o == Py_None)
        return 0;
    return opt_ms(o, out);
}

/*
 * Server(host, port, handler, on_close, opts, max_clients, max_pending,
 *        max_per_source, idle_timeout, handshake_timeout)
 */
static PyObject *server_new_py(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    const char *host;
    int port;
    PyObject *handler, *on_close = Py_None, *d = NULL;
    PyObject *max_clients = NULL, *max_pending = NULL, *max_per_source = NULL;
    PyObject *idle = NULL, *handshake = NULL;
    if (!PyArg_ParseTuple(args, "ziO|OOOOOOO", &host, &port, &handler, &on_close, &d, &max_clients,
                          &max_pending, &max_per_source, &idle, &handshake))
        return NULL;
    if (port < 0 || port > 65535) {
        PyErr_SetString(PyExc_ValueError, "port must be 0..65535");
        return NULL;
    }
    tdp_server_opts so;
    tdp_server_opts_default(&so);
    if (parse_opts(d, &so.pipe) < 0 || limit_u32(max_clients, "max_clients", &so.max_clients) < 0 ||
        limit_u32(max_pending, "max_pending", &so.max_pending) < 0 ||
        limit_u32(max_per_source, "max_per_source", &so.max_per_source) < 0 ||
        limit_ms(idle, &so.idle_timeout_ms) < 0 ||
        limit_ms(handshake, &so.handshake_timeout_ms) < 0)
        return NULL;
    tdp_loop *loop = get_loop();
    if (loop == NULL)
        return NULL;
    ServerObject *o = (ServerObject *)type->tp_alloc(type, 0);
    if (o == NULL)
        return NULL;
    o->handler = Py_NewRef(handler);
    o->on_close = on_close == Py_None ? NULL : Py_NewRef(on_close);
    tdp_server_handler h = {
        .size = sizeof h, .on_message = srv_on_message, .on_close = srv_on_close};
    tdp_err rc;
    tdp_server *srv;
    Py_BEGIN_ALLOW_THREADS rc = tdp_server_new(loop, host, (uint16_t)port, &so, &h, o, &srv);
    Py_END_ALLOW_THREADS if (rc != TDP_OK)
    {
        Py_DECREF(o);
        return raise_tdp(rc, "server");
    }
    o->srv = srv;
    return (PyObject *)o;
}

static PyObject *server_shutdown(ServerObject *self, PyObject *args)
{
    PyObject *to = NULL;
    int64_t ms;
    if (!PyArg_ParseTuple(args, "|O", &to) || timeout_ms(to, &ms) < 0)
        return NULL;
    tdp_server *s = self->srv;
    if (s == NULL)
        Py_RETURN_NONE;
    tdp_err rc;
    Py_BEGIN_ALLOW_THREADS rc = tdp_server_shutdown(s, ms);
    Py_END_ALLOW_THREADS if (rc != TDP_OK) return raise_tdp(rc, "shutdown");
    Py_RETURN_NONE;
}

static void server_free_now(ServerObject *self)
{
    tdp_server *s = self->srv;
    if (s == NULL)
        return;
    self->srv = NULL;
    Py_BEGIN_ALLOW_THREADS tdp_server_free(s);
    Py_END_ALLOW_THREADS
}

static PyObject *server_close(ServerObject *self, PyObject *unused)
{
    server_free_now(self);
    Py_RETURN_NONE;
}

static void server_dealloc(ServerObject *self)
{
    server_free_now(self);
    Py_CLEAR(self->handler);
    Py_CLEAR(self->on_close);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *server_port(ServerObject *self, void *c)
{
    if (self->srv == NULL)
        Py_RETURN_NONE;
    return PyLong_FromLong(tdp_server_port(self->srv));
}

static PyObject *server_stats(ServerObject *self, PyObject *unused)
{
    if (self->srv == NULL)
        Py_RETURN_NONE;
    tdp_server_stats s;
    tdp_server *srv = self->srv;
    Py_BEGIN_ALLOW_THREADS tdp_server_stats_get(srv, &s);
    Py_END_ALLOW_THREADS return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsK}", "clients_now", s.clients_now, "clients_total",
        s.clients_total, "pending_now", s.pending_now, "idle_closed", s.idle_closed, "refused",
        s.refused, "handshakes_failed", s.handshakes_failed, "handler_errors", s.handler_errors,
        "client_errors", s.client_errors, "msgs_recv", s.msgs_recv, "msgs_sent", s.msgs_sent,
        "bytes_recv", s.bytes_recv, "bytes_sent", s.bytes_sent, "schemas_recv", s.schemas_recv);
}

static PyMethodDef server_methods[] = {
    {"shutdown", (PyCFunction)server_shutdown, METH_VARARGS, NULL},
    {"close", (PyCFunction)server_close, METH_NOARGS, NULL},
    {"stats", (PyCFunction)server_stats, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef server_getset[] = {
    {"port", (getter)server_port, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject ServerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tdpipe._tdpipe.Server",
    .tp_basicsize = sizeof(ServerObject),
    .tp_dealloc = (destructor)server_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = server_new_py,
    .tp_methods = server_methods,
    .tp_getset = server_getset,
};

/* ---- module ---------------------------------------------------------------- */

static PyObject *mod_set_error_factory(PyObject *m, PyObject *fn)
{
    Py_XSETREF(g_make_error, Py_NewRef(fn));
    Py_RETURN_NONE;
}

static PyObject *mod_finalizing(PyObject *m, PyObject *unused)
{
    atomic_store(&g_finalizing, 1);
    Py_RETURN_NONE;
}

static PyObject *mod_errname(PyObject *m, PyObject *arg)
{
    long c = PyLong_AsLong(arg);
    if (c == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(tdp_errname((int)c));
}

static PyObject *mod_strerror(PyObject *m, PyObject *arg)
{
    long c = PyLong_AsLong(arg);
    if (c == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(tdp_strerror((int)c));
}

/*
 * mem_stats() -> the library's allocation counters (cumulative since the
 * process started): buffers by memory kind and its small objects. Two
 * snapshots around a loop count the allocations per message.
 */
/* cuda_device_count(): devices of the library's CUDA layer (TDPIPE_CUDA, docs/gpu.md). */
static PyObject *mod_cuda_device_count(PyObject *m, PyObject *unused)
{
    return PyLong_FromLong(tdp_cuda_device_count());
}

static PyObject *mod_mem_stats(PyObject *m, PyObject *unused)
{
    tdp_mem_stats s;
    tdp_mem_stats_get(&s);
    return Py_BuildValue("{sKsKsKsKsK}", "host_allocs", s.allocs[TDP_MEM_HOST], "host_frees",
                         s.frees[TDP_MEM_HOST], "host_live_bytes", s.live_bytes[TDP_MEM_HOST],
                         "small_allocs", s.small_allocs, "total_allocs",
                         (unsigned long long)tdp_mem_total_allocs());
}

static PyObject *mod_version(PyObject *m, PyObject *unused)
{
    return PyUnicode_FromString(tdp_version_string());
}

static PyMethodDef mod_methods[] = {
    {"_set_error_factory", mod_set_error_factory, METH_O, NULL},
    {"_finalizing", mod_finalizing, METH_NOARGS, NULL},
    {"errname", mod_errname, METH_O, NULL},
    {"strerror", mod_strerror, METH_O, NULL},
    {"library_version", mod_version, METH_NOARGS, NULL},
    {"mem_stats", mod_mem_stats, METH_NOARGS, NULL},
    {"cuda_device_count", mod_cuda_device_count, METH_NOARGS, NULL},
    {NULL},
};

static struct PyModuleDef mod_def = {
    PyModuleDef_HEAD_INIT, "_tdpipe", "CPython binding of libtdpipe", -1, mod_methods,
};

/* ---- FanIn ------------------------------------------------------------------ */

/*
 * Many producers, one stream (tdp_fanin). recv() and the async form
 * (start_recv / result / fileno, an eventfd the completion writes) return
 * an item: (kind, producer, seq, peer, status, td or None).
 */
typedef struct FanInObject {
    PyObject_HEAD tdp_fanin *f;
    int on_thread, busy;
    tdp_op *op; /* the async receive */
    int efd;
    int pending;
    tdp_fanin_msg am; /* what the async receive writes */
} FanInObject;

static void fanin_give_back(TdObject *self)
{
    if (self->fanin->f == NULL)
        return; /* freed: its pipes went with it */
    tdp_fanin_msg m = {.kind = TDP_FANIN_MSG, .td = self->td, .src = self->fsrc};
    tdp_fanin_release(self->fanin->f, &m);
}

static PyObject *fanin_item(FanInObject *self, const tdp_fanin_msg *m)
{
    PyObject *td = Py_None;
    if (m->kind == TDP_FANIN_MSG) {
        TdObject *o = td_new_obj(m->td);
        if (o == NULL) {
            tdp_fanin_release(self->f, m);
            return NULL;
        }
        Py_INCREF(self);
        o->fanin = self;
        o->fsrc = m->src;
        o->seq = m->seq;
        td = (PyObject *)o;
    } else {
        Py_INCREF(td);
    }
    return Py_BuildValue("(iKKsiN)", (int)m->kind, (unsigned long long)m->producer,
                         (unsigned long long)m->seq, m->peer, (int)m->status, td);
}

static int fanin_check(FanInObject *self)
{
    if (self->f == NULL) {
        raise_tdp(TDP_ECANCELED, "fan-in freed");
        return -1;
    }
    return 0;
}

/* FanIn.listen(host, port, opts, on_thread, max_producers, max_memory) */
static PyObject *fanin_listen(PyObject *cls, PyObject *args)
{
    const char *host;
    int port = 0, on_thread = 1;
    unsigned int max_producers = 0;
    unsigned long long max_memory = 0;
    PyObject *d = NULL;
    if (!PyArg_ParseTuple(args, "z|iOpIK", &host, &port, &d, &on_thread, &max_producers,
                          &max_memory))
        return NULL;
    if (port < 0 || port > 65535) {
        PyErr_SetString(PyExc_ValueError, "port must be 0..65535");
        return NULL;
    }
    tdp_fanin_opts o;
    tdp_fanin_opts_default(&o);
    if (parse_opts(d, &o.listener.pipe) < 0)
        return NULL;
    o.max_producers = max_producers;
    o.max_memory = max_memory;
    tdp_loop *loop = on_thread ? get_loop() : get_loop_caller();
    if (loop == NULL)
        return NULL;
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    tdp_op *op;
    tdp_err rc = tdp_op_new(op_done, (void *)(intptr_t)fd, &op);
    if (rc != TDP_OK) {
        close(fd);
        return raise_tdp(rc, "fan-in");
    }
    tdp_fanin *f;
    Py_BEGIN_ALLOW_THREADS rc = tdp_fanin_new(loop, host, (uint16_t)port, &o, &f);
    Py_END_ALLOW_THREADS if (rc != TDP_OK)
    {
        tdp_op_free(op);
        close(fd);
        return raise_tdp(rc, "fan-in");
    }
    FanInObject *fo = PyObject_New(FanInObject, &FanInType);
    if (fo == NULL) {
        Py_BEGIN_ALLOW_THREADS tdp_fanin_free(f);
        Py_END_ALLOW_THREADS tdp_op_free(op);
        close(fd);
        return NULL;
    }
    fo->f = f;
    fo->on_thread = on_thread;
    fo->busy = 0;
    fo->op = op;
    fo->efd = fd;
    fo->pending = 0;
    memset(&fo->am, 0, sizeof(fo->am));
    return (PyObject *)fo;
}

typedef struct fanin_recv_ctx {
    tdp_fanin *f;
    tdp_fanin_msg *m;
} fanin_recv_ctx;

static tdp_err fanin_recv_slice(void *ctx, int64_t ms)
{
    fanin_recv_ctx *r = ctx;
    return tdp_fanin_recv(r->f, ms, r->m);
}

static PyObject *fanin_recv(FanInObject *self, PyObject *args)
{
    PyObject *to = NULL;
    int64_t ms;
    if (!PyArg_ParseTuple(args, "|O", &to) || timeout_ms(to, &ms) < 0 || fanin_check(self) < 0)
        return NULL;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is receiving on this fan-in");
        return NULL;
    }
    tdp_fanin_msg m;
    tdp_err rc;
    self->busy = 1;
    fanin_recv_ctx rx = {self->f, &m};
    /* a timed-out slice takes nothing: Ctrl-C between slices loses no item */
    int sig = wait_sliced(fanin_recv_slice, &rx, ms, &rc);
    self->busy = 0;
    if (sig < 0)
        return NULL;
    if (rc != TDP_OK)
        return raise_tdp(rc, "recv");
    return fanin_item(self, &m);
}

static PyObject *fanin_start_recv(FanInObject *self, PyObject *unused)
{
    if (fanin_check(self) < 0)
        return NULL;
    if (!self->on_thread) {
        PyErr_SetString(PyExc_RuntimeError, "async receives need a fan-in on the loop thread");
        return NULL;
    }
    if (self->pending) {
        PyErr_SetString(PyExc_RuntimeError, "a receive is already pending");
        return NULL;
    }
    self->pending = 1;
    tdp_fanin_recv_async(self->f, self->op, &self->am);
    Py_RETURN_NONE;
}

/* result() -> None while pending, else the item (or raises the error). */
static PyObject *fanin_result(FanInObject *self, PyObject *unused)
{
    uint64_t v;
    while (read(self->efd, &v, sizeof v) > 0) {
    }
    if (!self->pending) {
        PyErr_SetString(PyExc_RuntimeError, "no receive started");
        return NULL;
    }
    tdp_err rc = tdp_op_result(self->op);
    if (rc == TDP_EAGAIN)
        Py_RETURN_NONE;
    self->pending = 0;
    if (rc != TDP_OK)
        return raise_tdp(rc, "recv");
    return fanin_item(self, &self->am);
}

static PyObject *fanin_fileno(FanInObject *self, PyObject *unused)
{
    return PyLong_FromLong(self->efd);
}

static PyObject *fanin_drain(FanInObject *self, PyObject *unused)
{
    uint64_t v;
    while (read(self->efd, &v, sizeof v) > 0) {
    }
    Py_RETURN_NONE;
}

static PyObject *fanin_close(FanInObject *self, PyObject *unused)
{
    if (self->f == NULL)
        Py_RETURN_NONE;
    tdp_fanin *f = self->f;
    Py_BEGIN_ALLOW_THREADS tdp_fanin_close(f);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static void fanin_free_now(FanInObject *self)
{
    tdp_fanin *f = self->f;
    if (f == NULL)
        return;
    self->f = NULL;
    int caller = !self->on_thread;
    Py_BEGIN_ALLOW_THREADS tdp_fanin_free(f); /* a pending receive completes: TDP_ECANCELED */
    if (caller)
        pump_caller_loop();
    Py_END_ALLOW_THREADS
}

static PyObject *fanin_free_m(FanInObject *self, PyObject *unused)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is receiving on this fan-in");
        return NULL;
    }
    fanin_free_now(self);
    Py_RETURN_NONE;
}

static void fanin_dealloc(FanInObject *self)
{
    fanin_free_now(self); /* lent messages hold a reference: none is left */
    tdp_op_free(self->op);
    close(self->efd);
    PyObject_Free(self);
}

static PyObject *fanin_stats(FanInObject *self, PyObject *unused)
{
    if (fanin_check(self) < 0)
        return NULL;
    tdp_fanin_stats s;
    tdp_fanin_stats_get(self->f, &s);
    return Py_BuildValue("{sKsKsKsKsKsKsK}", "producers_now", s.producers_now, "producers_total",
                         s.producers_total, "producers_failed", s.producers_failed, "refused",
                         s.refused, "handshakes_failed", s.handshakes_failed, "msgs", s.msgs,
                         "bytes", s.bytes);
}

static PyObject *fanin_port(FanInObject *self, void *c)
{
    if (self->f == NULL)
        Py_RETURN_NONE;
    return PyLong_FromLong(tdp_fanin_port(self->f));
}

static PyObject *fanin_on_thread(FanInObject *self, void *c)
{
    return PyBool_FromLong(self->on_thread);
}

static PyMethodDef fanin_methods[] = {
    {"listen", (PyCFunction)fanin_listen, METH_VARARGS | METH_CLASS, NULL},
    {"recv", (PyCFunction)fanin_recv, METH_VARARGS, NULL},
    {"start_recv", (PyCFunction)fanin_start_recv, METH_NOARGS, NULL},
    {"result", (PyCFunction)fanin_result, METH_NOARGS, NULL},
    {"fileno", (PyCFunction)fanin_fileno, METH_NOARGS, NULL},
    {"drain", (PyCFunction)fanin_drain, METH_NOARGS, NULL},
    {"close", (PyCFunction)fanin_close, METH_NOARGS, NULL},
    {"free", (PyCFunction)fanin_free_m, METH_NOARGS, NULL},
    {"stats", (PyCFunction)fanin_stats, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef fanin_getset[] = {
    {"port", (getter)fanin_port, NULL, NULL, NULL},
    {"on_thread", (getter)fanin_on_thread, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject FanInType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tdpipe._tdpipe.FanIn",
    .tp_basicsize = sizeof(FanInObject),
    .tp_dealloc = (destructor)fanin_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = fanin_methods,
    .tp_getset = fanin_getset,
};

/* ---- FanOut ----------------------------------------------------------------- */

/*
 * One producer, many consumers (tdp_fanout). Sends are blocking (send)
 * or asynchronous (start_send / result / settle / fileno: an eventfd the
 * completion writes, for asyncio); one asynchronous send at a time, whose
 * Td is kept alive until it completes.
 */
typedef struct FanOutObject {
    PyObject_HEAD tdp_fanout *fo;
    int on_thread, busy;
    int port;   /* what listen bound, 0 before */
    tdp_op *op; /* the async send */
    int efd;
    int pending;
    TdObject *sending; /* the async send's tensordict */
} FanOutObject;

static int fanout_check(FanOutObject *self)
{
    if (self->fo == NULL) {
        raise_tdp(TDP_ECANCELED, "fan-out freed");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is in a blocking call on this fan-out");
        return -1;
    }
    return 0;
}

/* FanOut.new(mode, slow, depth, max_consumers, close_timeout_ms, on_thread) */
static PyObject *fanout_new(PyObject *cls, PyObject *args)
{
    int mode, slow, on_thread = 1;
    unsigned int depth, max_consumers;
    long long close_ms;
    if (!PyArg_ParseTuple(args, "iiIIL|p", &mode, &slow, &depth, &max_consumers, &close_ms,
                          &on_thread))
        return NULL;
    tdp_fanout_opts o;
    tdp_fanout_opts_default(&o);
    o.mode = (tdp_fanout_mode)mode;
    o.slow = (tdp_fanout_slow)slow;
    o.depth = depth;
    o.max_consumers = max_consumers;
    o.close_timeout_ms = close_ms;
    tdp_loop *loop = on_thread ? get_loop() : get_loop_caller();
    if (loop == NULL)
        return NULL;
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    tdp_op *op;
    tdp_err rc = tdp_op_new(op_done, (void *)(intptr_t)fd, &op);
    if (rc != TDP_OK) {
        close(fd);
        return raise_tdp(rc, "fan-out");
    }
    tdp_fanout *fo;
    if ((rc = tdp_fanout_new(loop, &o, &fo)) != TDP_OK) {
        tdp_op_free(op);
        close(fd);
        return raise_tdp(rc, "fan-out");
    }
    FanOutObject *self = PyObject_New(FanOutObject, &FanOutType);
    if (self == NULL) {
        Py_BEGIN_ALLOW_THREADS tdp_fanout_free(fo);
        Py_END_ALLOW_THREADS tdp_op_free(op);
        close(fd);
        return NULL;
    }
    self->fo = fo;
    self->on_thread = on_thread;
    self->busy = 0;
    self->port = 0;
    self->op = op;
    self->efd = fd;
    self->pending = 0;
    self->sending = NULL;
    return (PyObject *)self;
}

/* connect(host, port, opts) -> the consumer's id */
static PyObject *fanout_connect(FanOutObject *self, PyObject *args)
{
    const char *host;
    int port;
    PyObject *d = NULL;
    if (!PyArg_ParseTuple(args, "si|O", &host, &port, &d) || fanout_check(self) < 0)
        return NULL;
    if (port < 1 || port > 65535) {
        PyErr_SetString(PyExc_ValueError, "port must be 1..65535");
        return NULL;
    }
    tdp_pipe_opts o;
    if (parse_opts(d, &o) < 0)
        return NULL;
    tdp_fanout *fo = self->fo;
    uint64_t id = 0;
    tdp_err rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS rc = tdp_fanout_connect(fo, host, (uint16_t)port, &o, &id);
    Py_END_ALLOW_THREADS self->busy = 0;
    if (rc != TDP_OK)
        return raise_tdp(rc, "connect");
    return PyLong_FromUnsignedLongLong(id);
}

/* listen(host, port, opts) -> the port bound */
static PyObject *fanout_listen(FanOutObject *self, PyObject *args)
{
    const char *host;
    int port = 0;
    PyObject *d = NULL;
    if (!PyArg_ParseTuple(args, "z|iO", &host, &port, &d) || fanout_check(self) < 0)
        return NULL;
    if (port < 0 || port > 65535) {
        PyErr_SetString(PyExc_ValueError, "port must be 0..65535");
        return NULL;
    }
    tdp_listener_opts lo;
    tdp_listener_opts_default(&lo);
    if (parse_opts(d, &lo.pipe) < 0)
        return NULL;
    tdp_fanout *fo = self->fo;
    uint16_t bound = 0;
    tdp_err rc;
    Py_BEGIN_ALLOW_THREADS rc = tdp_fanout_listen(fo, host, (uint16_t)port, &lo, &bound);
    Py_END_ALLOW_THREADS if (rc != TDP_OK) return raise_tdp(rc, "listen");
    self->port = bound;
    return PyLong_FromLong(bound);
}

static PyObject *fanout_remove(FanOutObject *self, PyObject *arg)
{
    unsigned long long id = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || fanout_check(self) < 0)
        return NULL;
    tdp_fanout *fo = self->fo;
    tdp_err rc;
    Py_BEGIN_ALLOW_THREADS rc = tdp_fanout_remove(fo, id);
    Py_END_ALLOW_THREADS if (rc != TDP_OK) return raise_tdp(rc, "remove");
    Py_RETURN_NONE;
}

/* send(td, timeout) */
static PyObject *fanout_send(FanOutObject *self, PyObject *args)
{
    TdObject *td;
    PyObject *to = NULL;
    int64_t ms;
    if (!PyArg_ParseTuple(args, "O!|O", &TdType, &td, &to) || timeout_ms(to, &ms) < 0 ||
        fanout_check(self) < 0 || td_check_live(td) < 0)
        return NULL;
    tdp_fanout *fo = self->fo;
    tdp_td *t = td->td;
    tdp_err rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS rc = tdp_fanout_send(fo, t, ms);
    Py_END_ALLOW_THREADS self->busy = 0;
    if (rc != TDP_OK)
        return raise_tdp(rc, "send");
    Py_RETURN_NONE;
}

/* loan(schema) -> Td (raises EAGAIN while every slot is held) */
static PyObject *fanout_loan(FanOutObject *self, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &SchemaType)) {
        PyErr_SetString(PyExc_TypeError, "Schema expected");
        return NULL;
    }
    if (fanout_check(self) < 0)
        return NULL;
    tdp_fanout *fo = self->fo;
    tdp_schema *s = ((SchemaObject *)arg)->s;
    tdp_td *t;
    tdp_err rc;
    Py_BEGIN_ALLOW_THREADS rc = tdp_fanout_loan(fo, s, &t);
    Py_END_ALLOW_THREADS if (rc != TDP_OK) return raise_tdp(rc, "loan");
    TdObject *o = td_new_obj(t);
    tdp_td_unref(t);
    return (PyObject *)o;
}

static PyObject *fanout_start_send(FanOutObject *self, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &TdType)) {
        PyErr_SetString(PyExc_TypeError, "Td expected");
        return NULL;
    }
    TdObject *td = (TdObject *)arg;
    if (fanout_check(self) < 0 || td_check_live(td) < 0)
        return NULL;
    if (!self->on_thread) {
        PyErr_SetString(PyExc_RuntimeError, "async sends need a fan-out on the loop thread");
        return NULL;
    }
    if (self->pending) {
        PyErr_SetString(PyExc_RuntimeError, "a send is already pending");
        return NULL;
    }
    Py_INCREF(td);
    self->sending = td;
    self->pending = 1;
    tdp_fanout *fo = self->fo;
    tdp_td *t = td->td;
    tdp_op *op = self->op;
    Py_BEGIN_ALLOW_THREADS tdp_fanout_send_async(fo, t, op);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* result() -> None while pending, else the fan-out's sequence number (or raises). */
static PyObject *fanout_result(FanOutObject *self, PyObject *unused)
{
    uint64_t v;
    while (read(self->efd, &v, sizeof v) > 0) {
    }
    if (!self->pending) {
        PyErr_SetString(PyExc_RuntimeError, "no send started");
        return NULL;
    }
    tdp_err rc = tdp_op_result(self->op);
    if (rc == TDP_EAGAIN)
        Py_RETURN_NONE;
    self->pending = 0;
    Py_CLEAR(self->sending);
    if (rc != TDP_OK)
        return raise_tdp(rc, "send");
    return PyLong_FromUnsignedLongLong(tdp_op_seq(self->op));
}

/* settle(us): wait up to us microseconds without the GIL, then as result(). */
static PyObject *fanout_settle(FanOutObject *self, PyObject *arg)
{
    long us = PyLong_AsLong(arg);
    if (us == -1 && PyErr_Occurred())
        return NULL;
    if (self->pending && us > 0 && tdp_op_result(self->op) == TDP_EAGAIN) {
        tdp_op *op = self->op;
        Py_BEGIN_ALLOW_THREADS struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        do {
            sched_yield();
            clock_gettime(CLOCK_MONOTONIC, &t);
        } while (tdp_op_result(op) == TDP_EAGAIN &&
                 (t.tv_sec - t0.tv_sec) * 1000000L + (t.tv_nsec - t0.tv_nsec) / 1000 < us);
        Py_END_ALLOW_THREADS
    }
    return fanout_result(self, NULL);
}

static PyObject *fanout_fileno(FanOutObject *self, PyObject *unused)
{
    return PyLong_FromLong(self->efd);
}

static PyObject *fanout_drain(FanOutObject *self, PyObject *unused)
{
    uint64_t v;
    while (read(self->efd, &v, sizeof v) > 0) {
    }
    Py_RETURN_NONE;
}

static PyObject *fanout_close(FanOutObject *self, PyObject *args)
{
    PyObject *to = NULL;
    int64_t ms;
    if (!PyArg_ParseTuple(args, "|O", &to) || timeout_ms(to, &ms) < 0)
        return NULL;
    if (self->fo == NULL)
        Py_RETURN_NONE;
    if (fanout_check(self) < 0)
        return NULL;
    tdp_fanout *fo = self->fo;
    tdp_err rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS rc = tdp_fanout_close(fo, ms);
    Py_END_ALLOW_THREADS self->busy = 0;
    if (rc != TDP_OK)
        return raise_tdp(rc, "close");
    Py_RETURN_NONE;
}

static void fanout_free_now(FanOutObject *self)
{
    tdp_fanout *fo = self->fo;
    if (fo == NULL)
        return;
    self->fo = NULL;
    int caller = !self->on_thread;
    Py_BEGIN_ALLOW_THREADS tdp_fanout_free(fo); /* a pending send completes: TDP_ECANCELED */
    if (caller)
        pump_caller_loop();
    Py_END_ALLOW_THREADS
}

static PyObject *fanout_free_m(FanOutObject *self, PyObject *unused)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is in a blocking call on this fan-out");
        return NULL;
    }
    fanout_free_now(self);
    Py_RETURN_NONE;
}

static void fanout_dealloc(FanOutObject *self)
{
    fanout_free_now(self);
    Py_CLEAR(self->sending);
    tdp_op_free(self->op);
    close(self->efd);
    PyObject_Free(self);
}

static PyObject *fanout_peer_dict(const tdp_fanout_peer_stats *p)
{
    return Py_BuildValue(
        "{sKsssKsKsKsKsKsIsisOss}", "id", (unsigned long long)p->id, "peer", p->peer, "msgs_sent",
        (unsigned long long)p->msgs_sent, "bytes_sent", (unsigned long long)p->bytes_sent, "drops",
        (unsigned long long)p->drops, "first_seq", (unsigned long long)p->first_seq, "moved",
        (unsigned long long)p->moved, "queued", (unsigned int)p->queued, "status", (int)p->status,
        "leaving", p->leaving ? Py_True : Py_False, "plane", tdp_plane_name(p->plane));
}

/* stats() -> the fan-out's figures, "peers": a dict per consumer there now */
static PyObject *fanout_stats(FanOutObject *self, PyObject *unused)
{
    if (self->fo == NULL)
        return raise_tdp(TDP_ECANCELED, "fan-out freed");
    tdp_fanout *fo = self->fo;
    tdp_fanout_stats s;
    uint32_t cap = 64, n;
    tdp_fanout_peer_stats *ps = NULL;
    for (;;) { /* consumers may join between the two calls: grow until they fit */
        tdp_fanout_peer_stats *grown = PyMem_Realloc(ps, cap * sizeof(*ps));
        if (grown == NULL) {
            PyMem_Free(ps);
            return PyErr_NoMemory();
        }
        ps = grown;
        Py_BEGIN_ALLOW_THREADS n = tdp_fanout_stats_get(fo, &s, ps, cap);
        Py_END_ALLOW_THREADS if (n <= cap) break;
        cap = n + 16;
    }
    PyObject *peers = PyList_New(n);
    for (uint32_t i = 0; peers != NULL && i < n; i++) {
        PyObject *p = fanout_peer_dict(&ps[i]);
        if (p == NULL)
            Py_CLEAR(peers);
        else
            PyList_SET_ITEM(peers, i, p);
    }
    PyMem_Free(ps);
    if (peers == NULL)
        return NULL;
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsIsN}", "msgs", (unsigned long long)s.msgs, "bytes",
                         (unsigned long long)s.bytes, "unsent", (unsigned long long)s.unsent,
                         "drops", (unsigned long long)s.drops, "joined",
                         (unsigned long long)s.joined, "left", (unsigned long long)s.left, "failed",
                         (unsigned long long)s.failed, "refused", (unsigned long long)s.refused,
                         "moved", (unsigned long long)s.moved, "consumers",
                         (unsigned int)s.consumers, "peers", peers);
}

static PyObject *fanout_port(FanOutObject *self, void *c)
{
    if (self->port == 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(self->port);
}

static PyObject *fanout_on_thread(FanOutObject *self, void *c)
{
    return PyBool_FromLong(self->on_thread);
}

static PyMethodDef fanout_methods[] = {
    {"new", (PyCFunction)fanout_new, METH_VARARGS | METH_CLASS, NULL},
    {"connect", (PyCFunction)fanout_connect, METH_VARARGS, NULL},
    {"listen", (PyCFunction)fanout_listen, METH_VARARGS, NULL},
    {"remove", (PyCFunction)fanout_remove, METH_O, NULL},
    {"send", (PyCFunction)fanout_send, METH_VARARGS, NULL},
    {"loan", (PyCFunction)fanout_loan, METH_O, NULL},
    {"start_send", (PyCFunction)fanout_start_send, METH_O, NULL},
    {"result", (PyCFunction)fanout_result, METH_NOARGS, NULL},
    {"settle", (PyCFunction)fanout_settle, METH_O, NULL},
    {"fileno", (PyCFunction)fanout_fileno, METH_NOARGS, NULL},
    {"drain", (PyCFunction)fanout_drain, METH_NOARGS, NULL},
    {"close", (PyCFunction)fanout_close, METH_VARARGS, NULL},
    {"free", (PyCFunction)fanout_free_m, METH_NOARGS, NULL},
    {"stats", (PyCFunction)fanout_stats, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef fanout_getset[] = {
    {"port", (getter)fanout_port, NULL, NULL, NULL},
    {"on_thread", (getter)fanout_on_thread, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject FanOutType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tdpipe._tdpipe.FanOut",
    .tp_basicsize = sizeof(FanOutObject),
    .tp_dealloc = (destructor)fanout_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = fanout_methods,
    .tp_getset = fanout_getset,
};

PyMODINIT_FUNC PyInit__tdpipe(void)
{
    PyTypeObject *types[] = {&SchemaType, &TdType,     &PipeType,  &ListenerType,
                             &OpType,     &ServerType, &FanInType, &FanOutType};
    const char *names[] = {"Schema", "Td", "Pipe", "Listener", "Op", "Server", "FanIn", "FanOut"};
    PyObject *m = PyModule_Create(&mod_def);
    if (m == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        if (PyType_Ready(types[i]) < 0 ||
            PyModule_AddObjectRef(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
#define X(name, value, msg) PyModule_AddIntConstant(m, #name, value);
    TDP_ERR_TABLE(X)
#undef X
    return m;
}

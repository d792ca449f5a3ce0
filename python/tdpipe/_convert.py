"""Tensordicts to and from tdpipe buffers.

Sending: a nested mapping is flattened into (path, leaf) pairs; the layout
(paths, dtypes, shapes, values, node classes and batch sizes) is the cache
key of the schema, so sends of one layout build the schema once.

Receiving: a received buffer is turned into nested dicts of tensors that
are DLPack views of it; the plan (which leaf goes where, the decoded
non-tensor values) is made once per schema.
"""
import os
import json

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a dependency in practice
    np = None

try:
    import torch
    from torch.utils import dlpack as _torch_dlpack
except ImportError:
    torch = None
    _torch_dlpack = None

from . import _tdpipe
from .errors import Error, SchemaError

_SCALARS = (str, int, float, bool, type(None))

# The schema's rules for what this side sends (docs/schema.md): checked
# before the library sees them so the error names the key and the rule.
MAX_KEY_BYTES = 255
MAX_VALUE_BYTES = 4096
RESERVED_NODE_KEYS = ("cls", "cls_metadata", "leaves", "non_tensors")


def _schema_error(text):
    exc = SchemaError(text)
    exc.code = _tdpipe.ESCHEMA
    exc.errname = "ESCHEMA"
    return exc


def _dot_key_error(parent, key):
    return _schema_error(
        "key %r%s contains '.', the path separator: tdpipe keys may not contain '.' "
        "(nest a dict instead, or rename the key)" % (key, " under %r" % parent if parent else ""))


class Consolidated(dict):
    """A nested dict whose tensor leaves are views into one tdpipe buffer.

    Sending it (Pipe.send) hands the buffer itself to the pipe: nothing is
    copied, as long as its leaves are still the views it was made with
    (write into them in place: ``buf["x"][:] = ...``); a leaf replaced by
    another tensor makes the send gather (copy) instead.
    """

    __slots__ = ("_td", "_views", "_batch")

    def __getitem__(self, key):
        """m["obs"], or a tuple path into nested dicts: m["next", "reward"]."""
        if type(key) is tuple:
            node = self
            for k in key:
                node = dict.__getitem__(node, k) if node is self else node[k]
            return node
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        try:
            return self[key]
        except (KeyError, TypeError):
            return default

    def __contains__(self, key):
        if type(key) is tuple:
            try:
                self[key]
            except (KeyError, TypeError):
                return False
            return True
        return dict.__contains__(self, key)

    @property
    def batch_size(self):
        """The root's batch size, as the sender's tensordict had it
        (torch.Size; empty for a plain dict)."""
        b = self._batch
        return torch.Size(b) if torch is not None else b

    @property
    def buffer_address(self):
        """Address of the buffer the leaves lie in (for tests and debugging)."""
        return self._td.data_ptr

    @property
    def buffer_nbytes(self):
        return self._td.nbytes

    @property
    def schema(self):
        return self._td.schema


class Message(Consolidated):
    """A received tensordict: a nested dict of views into the pipe's
    receive buffer. It is *lent*: see Pipe.recv and docs/python.md.

    Use it as a context manager, or call release(), to give the buffer back.
    """

    __slots__ = ()

    @property
    def seq(self):
        """Sequence number on the pipe (1 for the first message)."""
        return self._td.seq

    @property
    def released(self):
        return self._td.released

    def release(self):
        """Give the buffer back (a credit goes to the sender). The views
        then point at memory the next message lands in. A GPU message first
        waits for torch's current stream on its device (the work queued
        there that reads the views)."""
        td = self._td
        if not td.released and td.device != "cpu":
            producer_done(td.device)
        td.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


# ---- leaves ------------------------------------------------------------------


def _is_mapping(x):
    return isinstance(x, dict) or (
        hasattr(x, "keys") and hasattr(x, "__getitem__") and not hasattr(x, "__dlpack__")
        and not hasattr(x, "__array_interface__"))


_DTYPE_NAME = {}


def _is_cpu(x):
    cpu = getattr(x, "is_cpu", None)
    return cpu if cpu is not None else x.device.type == "cpu"


def _leaf_info(x):
    """(dtype_name, shape, address, keepalive, device) of a tensor leaf,
    made C-contiguous (a copy only if it was not); device is None for host
    memory, else "cuda:N"."""
    if torch is not None and isinstance(x, torch.Tensor):
        # is_cpu and a dtype-name table: x.device and str(x.dtype) cost more
        # than the rest of a small send's Python work
        dev = None
        if not _is_cpu(x):
            if x.device.type != "cuda":
                raise NotImplementedError(
                    "tdpipe sends host and CUDA tensors only (got %s)" % x.device)
            dev = "cuda:%d" % x.device.index
        if not x.is_contiguous():
            x = x.contiguous()
        if x.is_conj() or x.is_neg():
            # a lazy conjugate or negative view (x.conj(), x.conj().imag):
            # its memory holds the values before the conjugation or
            # negation, which only the bit says to apply; materialize them
            x = x.resolve_conj().resolve_neg()
        name = _DTYPE_NAME.get(x.dtype)
        if name is None:
            name = _DTYPE_NAME[x.dtype] = str(x.dtype)
        return name, tuple(x.shape), x.data_ptr(), x, dev
    if np is not None and isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return x.dtype.name, x.shape, x.__array_interface__["data"][0], x, None
    if isinstance(x, DLPackArray):  # a received leaf, forwarded
        return x.dtype, x.shape, x.data_ptr, x, None if x.device == "cpu" else x.device
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return _cai_info(x, cai)
    if hasattr(x, "__dlpack__"):
        if torch is not None:
            return _leaf_info(torch.from_dlpack(x))
        return _leaf_info(np.from_dlpack(x))
    if hasattr(x, "__array_interface__") or hasattr(x, "__array__"):
        return _leaf_info(np.asarray(x))
    raise TypeError("leaf of type %s is neither a tensor nor a scalar" % type(x).__name__)


def _cai_info(x, cai):
    """_leaf_info of a non-torch CUDA array (CuPy, Numba, ...) through its
    __cuda_array_interface__: C-contiguous only. Its device is the one the
    library's CUDA layer finds the address on; the caller finishes its
    stream's work first (docs/python.md, "GPU tensors")."""
    if np is None:
        raise ImportError("sending a __cuda_array_interface__ array needs NumPy (for its dtype)")
    dt = np.dtype(cai["typestr"])
    shape = tuple(int(d) for d in cai["shape"])
    strides = cai.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, dt.itemsize):
        raise ValueError("a __cuda_array_interface__ leaf must be C-contiguous")
    dev = getattr(x, "device", None)
    index = getattr(dev, "id", None)
    return dt.name, shape, int(cai["data"][0]), x, "cuda:%d" % (index or 0)


def _c_strides(shape, itemsize):
    out, step = [], itemsize
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def _node_meta(x):
    """(cls, batch_size) of a tensordict-like node, or None for a plain mapping."""
    bs = getattr(x, "batch_size", None)
    if bs is None:
        return None
    return type(x).__name__, tuple(int(d) for d in bs)


def flatten(obj):
    """key, nodes, tensors, values, addresses, keepalive of a nested mapping.

    Keys are walked in sorted order at every level, so the layout (and the
    schema, its hash and the buffer) does not depend on insertion order: a
    dict with its keys reordered sends the same schema. key is hashable and
    equal for equal layouts."""
    if not _is_mapping(obj):
        raise TypeError("a message is a mapping of names to tensors (a dict or a TensorDict), "
                        "not %s" % type(obj).__name__)
    nodes, tensors, values, addrs, keep, devs = [], [], [], [], [], []
    meta = _node_meta(obj)
    if meta is not None:
        nodes.append(("", meta[0], meta[1]))

    def walk(m, prefix):
        try:
            items = sorted(m.items())
        except TypeError:
            bad = [k for k in m.keys() if not isinstance(k, str)]
            raise _key_type_error(bad[0] if bad else None, prefix) from None
        for k, v in items:
            if type(k) is not str:
                if not isinstance(k, str):
                    raise _key_type_error(k, prefix)
                k = str.__str__(k)  # the text itself, not a subclass's __str__
            if "." in k:
                raise _dot_key_error(prefix[:-1], k)
            path = prefix + k
            if isinstance(v, _SCALARS):
                values.append((path, json.dumps(v)))
            elif _is_mapping(v):
                meta = _node_meta(v)
                if meta is not None:
                    nodes.append((path, meta[0], meta[1]))
                elif len(v) == 0:
                    nodes.append((path, None, ()))
                else:
                    nodes.append((path, None, None))  # an implicit node: checked, not built
                walk(v, path + ".")
            else:
                try:
                    dt, shape, addr, k2, dev = _leaf_info(v)
                except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
                    raise _leaf_error(e, path, v) from e
                tensors.append((path, dt, shape))
                addrs.append(addr)
                keep.append(k2)
                devs.append(dev)

    walk(obj, "")
    device = _one_device(tensors, devs)
    key = (tuple(nodes), tuple(tensors), tuple(values), device)
    return key, nodes, tensors, values, addrs, keep


def _key_type_error(key, prefix):
    where = " under %r" % prefix[:-1] if prefix else ""
    return TypeError("key %r%s is of type %s: tdpipe keys are str (for a nested path, nest a "
                     "dict)" %
                     (key, where, type(key).__name__))


def _leaf_error(e, path, v):
    """e, raised making leaf `path` a buffer, again with the key in front
    (the same class, so callers catching TypeError or ValueError still do)."""
    if torch is not None and isinstance(v, torch.Tensor) and v.layout is not torch.strided:
        return TypeError("leaf %r: a %s tensor: tdpipe sends dense (strided) tensors; "
                         "send x.to_dense()" % (path, str(v.layout).replace("torch.", "")))
    text = str(e)
    if text.startswith("leaf %s:" % path) or text.startswith("leaf %r" % path):
        return e
    try:
        return type(e)("leaf %r: %s" % (path, text))
    except Exception:  # a class that takes other arguments
        return TypeError("leaf %r: %s: %s" % (path, type(e).__name__, text))


def _one_device(tensors, devs):
    """The device every tensor leaf is on (None: the host). One message is
    one buffer on one device: leaves on several raise ValueError naming
    them."""
    if not devs:
        return None
    first = devs[0]
    if all(d == first for d in devs):
        return first
    where = {}
    for (path, _dt, _shape), d in zip(tensors, devs):
        where.setdefault(d or "cpu", []).append(path)
    raise ValueError(
        "tensor leaves on several devices (%s): a message is one buffer on one device; move "
        "them to one device first" % "; ".join(
            "%s: %s" % (d, ", ".join(repr(p) for p in ps)) for d, ps in sorted(where.items())))


def _check_key(path):
    parent, _, key = path.rpartition(".")
    where = " under %r" % parent if parent else ""
    if not key:
        return _schema_error("empty key%s: tdpipe keys are 1..%d bytes" % (where, MAX_KEY_BYTES))
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return _schema_error("key %r%s is not valid Unicode text (a lone surrogate): tdpipe "
                             "keys are UTF-8" % (key, where))
    if n > MAX_KEY_BYTES:
        return _schema_error("key %r%s is %d bytes, limit %d" % (key, where, n, MAX_KEY_BYTES))
    if any(ord(c) < 0x20 or ord(c) == 0x7f for c in key):
        return _schema_error("key %r%s contains a control character, which tdpipe keys may "
                             "not" % (key, where))
    return None


def check_layout(nodes, tensors, values):
    """Raise SchemaError (a ValueError) naming the key and the rule a
    flattened layout breaks, if any."""
    for path, cls, _bs in nodes:
        if not path:
            continue
        exc = _check_key(path)
        if exc is None and path.rpartition(".")[2] in RESERVED_NODE_KEYS:
            exc = _schema_error(
                "sub-dict key %r collides with a reserved field name of the schema (%s): "
                "rename it, or make it a leaf" % (path, ", ".join(RESERVED_NODE_KEYS)))
        if exc is not None:
            raise exc
    for path, _dt, _shape in tensors:
        exc = _check_key(path)
        if exc is not None:
            raise exc
    for path, vjson in values:
        exc = _check_key(path)
        if exc is not None:
            raise exc
        if len(vjson) > MAX_VALUE_BYTES:
            raise _schema_error(
                "value %r is %d bytes encoded, limit %d for a non-tensor value (it travels "
                "in the schema as JSON, non-ASCII text as \\uXXXX escapes): send long text or "
                "bytes as a uint8 tensor" % (path, len(vjson), MAX_VALUE_BYTES))
        exc = _check_value(path, vjson)
        if exc is not None:
            raise exc


def _check_value(path, vjson):
    """The JSON scalars the schema cannot carry (jansson's rules): NaN and
    the infinities, integers beyond int64, text with NUL or a lone surrogate."""
    if vjson in ("NaN", "Infinity", "-Infinity"):
        return _schema_error("value %r is %s, which JSON (the schema's encoding of a "
                             "non-tensor value) cannot carry: send it as a 0-d tensor" %
                             (path, vjson.lower().replace("infinity", "inf")))
    c = vjson[0]
    if c == "-" or c.isdigit():
        if "." not in vjson and "e" not in vjson and "E" not in vjson and \
                not -2**63 <= int(vjson) < 2**63:
            return _schema_error("value %r is an int outside int64, the schema's integer "
                                 "range: send it as a str or a tensor" % path)
    elif c == '"':
        text = json.loads(vjson)
        if "\0" in text:
            return _schema_error("value %r contains a NUL character, which a schema string may "
                                 "not: send it as a uint8 tensor" % path)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return _schema_error("value %r is not valid Unicode text (a lone surrogate): "
                                 "schema strings are UTF-8" % path)
    return None


def build_schema(nodes, tensors, values, device=None):
    """The schema of a flattened layout. What breaks a rule raises
    SchemaError (a ValueError) naming the key and the rule, never the
    ProtocolError a peer's bad schema gets."""
    check_layout(nodes, tensors, values)
    built = [n for n in nodes if n[2] is not None]
    try:
        return _tdpipe.Schema.build(built, tensors, values, device)
    except Error as e:
        if isinstance(e, SchemaError):
            raise
        raise _schema_error(str(e)) from None


class SchemaCache:
    """The schema of the last layout sent (sends of one layout repeat)."""

    __slots__ = ("key", "schema", "fkey", "fschema")

    def __init__(self):
        self.key = None
        self.schema = None
        self.fkey = None  # the last foreign layout (see shared_buffer)
        self.fschema = None

    def get(self, obj):
        key, nodes, tensors, values, addrs, keep = flatten(obj)
        if key != self.key:
            self.schema = build_schema(nodes, tensors, values, key[3])
            self.key = key
        return self.schema, addrs, keep

    def get_send(self, obj):
        """(schema, None, None, td) when obj's tensor leaves already lie in
        one buffer (sent as it is), else (schema, addrs, keep, None). The
        layout's device (None: the host) is then in self.key[3] or
        self.fkey[0][3]."""
        key, nodes, tensors, values, addrs, keep = flatten(obj)
        shared = shared_buffer(tensors, addrs, keep)
        if shared is not None:
            base, total, offsets = shared
            fkey = (key, base % 64, total, offsets)
            if fkey != self.fkey:
                check_layout(nodes, tensors, values)
                try:
                    self.fschema = _tdpipe.Schema.decode(
                        foreign_json(nodes, tensors, values, offsets, total,
                                     key[3] or "cpu").encode())
                except Error as e:
                    raise _schema_error(str(e)) from None
                self.fkey = fkey
            return self.fschema, None, None, _tdpipe.Td.wrap(self.fschema, base, total, keep,
                                                             key[3])
        if key != self.key:
            self.schema = build_schema(nodes, tensors, values, key[3])
            self.key = key
        return self.schema, addrs, keep, None


_ITEMSIZE = {}


def _storage_of(x):
    """(start address, nbytes) of the allocation a leaf views, or None."""
    if torch is not None and isinstance(x, torch.Tensor):
        st = x.untyped_storage() if hasattr(x, "untyped_storage") else x.storage()
        return st.data_ptr(), st.nbytes()
    if np is not None and isinstance(x, np.ndarray):
        root = x
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.base is not None or not root.flags.c_contiguous:
            return None  # a buffer numpy does not own: its extent is unknown
        return root.__array_interface__["data"][0], root.nbytes
    return None


def shared_buffer(tensors, addrs, keep):
    """(base, total_bytes, offsets) when every tensor leaf is a view into one
    allocation, they do not overlap, fill at least half of the span they
    cover, and the span starts 64-byte aligned (the library's rule for a
    wrapped buffer); else None. Then the span is sent as it is."""
    if len(tensors) < 2:
        return None
    nbytes = [x.element_size() * x.numel() if torch is not None and isinstance(x, torch.Tensor)
              else x.nbytes for x in keep]
    base = min(addrs)
    end = max(a + n for a, n in zip(addrs, nbytes))
    # the cheap tests first: separate allocations usually fail them, and
    # then no storage is looked up (that is most of a plain send's cost)
    if base % 64 or end - base > 2 * sum(nbytes):
        return None
    st = _storage_of(keep[0])
    if st is None:
        return None
    for x in keep[1:]:
        if _storage_of(x) != st:
            return None
    if base < st[0] or end > st[0] + st[1]:
        return None
    order = sorted(range(len(addrs)), key=lambda i: addrs[i])
    for prev, nxt in zip(order, order[1:]):
        if addrs[prev] + nbytes[prev] > addrs[nxt]:
            return None  # overlapping leaves
    return base, end - base, tuple((a - base, n) for a, n in zip(addrs, nbytes))


def foreign_json(nodes, tensors, values, offsets, total, device="cpu"):
    """Schema JSON (docs/schema.md) of leaves at the given offsets."""
    def node(cls="TensorDict", batch=()):
        return {"cls": cls, "cls_metadata": {"batch_size": list(batch), "device": device,
                                             "is_locked": False, "names": None},
                "leaves": {}, "non_tensors": {}}

    root = node()
    tree = {"": root}

    def at(path):
        if path in tree:
            return tree[path]
        parent, _, key = path.rpartition(".")
        n = node()
        at(parent)[key] = n
        tree[path] = n
        return n

    for path, cls, batch in nodes:
        n = at(path)
        if cls is not None:
            n["cls"] = cls
            n["cls_metadata"]["batch_size"] = list(batch)
    starts = sorted(o for o, _n in offsets)
    nxt = {s: (starts[i + 1] if i + 1 < len(starts) else total) for i, s in enumerate(starts)}
    for (path, dt, shape), (off, nb) in zip(tensors, offsets):
        parent, _, key = path.rpartition(".")
        name = dt if dt.startswith("torch.") else "torch." + dt
        stop = nxt[off]
        at(parent)["leaves"][key] = [name, list(shape), off, stop, stop - off - nb]
    for path, vjson in values:
        parent, _, key = path.rpartition(".")
        at(parent)["non_tensors"][key] = json.loads(vjson)
    return json.dumps({"format": "tdpipe.schema", "version": 1, "total_bytes": total,
                       "device": device, "td": root})


def consolidated_check(obj):
    """The Td of a Consolidated whose leaves are still its own views, else None."""
    td = getattr(obj, "_td", None)
    if td is None or not isinstance(obj, Consolidated):
        return None
    for container, key, view in obj._views:
        if dict.get(obj if container is None else container, key) is not view:
            return None
    return td


# ---- views of a buffer ---------------------------------------------------------


class _Cap:
    """Hands a DLPack capsule to numpy.from_dlpack, which wants __dlpack__."""

    __slots__ = ("c",)

    def __init__(self, c):
        self.c = c

    def __dlpack__(self, stream=None):
        return self.c

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


KDL_CPU, KDL_CUDA = 1, 2


def device_code(name):
    """(DLPack device type, index) of "cpu" / "cuda:N"."""
    if name == "cpu":
        return (KDL_CPU, 0)
    return (KDL_CUDA, int(name.partition(":")[2] or 0))


class DLPackArray:
    """A tensor leaf of a received buffer, as a DLPack producer, for
    consumers other than PyTorch and NumPy (CuPy, JAX, ...) and for GPU
    messages where PyTorch has no CUDA. It views the buffer (lent as the
    message is); nothing reads the data until a consumer does.

    __dlpack__() makes a new capsule on each call (each holds a reference
    on the buffer); the data is complete on every stream when recv returns,
    so the consumer's `stream` needs no wait. __cuda_array_interface__ is
    there for GPU leaves (stream None: nothing to synchronize)."""

    __slots__ = ("_td", "_i", "shape", "dtype", "device", "data_ptr", "nbytes")

    def __init__(self, td, i, dtype, shape, off, nbytes, device):
        self._td = td
        self._i = i
        self.dtype = dtype
        self.shape = shape
        self.device = device
        self.data_ptr = td.data_ptr + off
        self.nbytes = nbytes

    def __dlpack__(self, stream=None):
        return self._td.capsule(self._i)

    def __dlpack_device__(self):
        return device_code(self.device)

    @property
    def __cuda_array_interface__(self):
        if self.device == "cpu":
            raise AttributeError("__cuda_array_interface__: a host leaf")
        try:
            typestr = np.dtype(self.dtype[6:]).str
        except (AttributeError, TypeError):  # no NumPy, or a dtype it lacks (bfloat16)
            raise AttributeError("__cuda_array_interface__: no typestr for %s" %
                                 self.dtype) from None
        return {"shape": self.shape, "typestr": typestr,
                "data": (self.data_ptr, False), "version": 3, "strides": None, "stream": None}

    def tobytes(self):
        """The leaf's bytes, copied to the host by the library."""
        return self._td.read(self._i)

    def __repr__(self):
        return "DLPackArray(%s, %s, %s)" % (self.dtype, self.shape, self.device)


class Plan:
    """How a schema's buffer becomes nested dicts: made once per schema."""

    __slots__ = ("schema", "nodes", "tensors", "values", "batch", "leaves", "device", "_paths")

    def __init__(self, schema):
        self.schema = schema
        nodes = schema.nodes()
        self.batch = next((tuple(bs) for p, _cls, bs in nodes if not p), ())
        # node paths in pre-order (parents first), root excluded
        self.nodes = [p for p, _cls, _bs in nodes if p]
        self.tensors, self.values, self.leaves = [], [], []
        self.device = schema.device
        for path, dt, shape, off, nb, vjson in schema.leaves():
            parent, _, key = path.rpartition(".")
            if dt is None:
                self.values.append((parent, key, json.loads(vjson)))
            else:
                self.tensors.append((parent, key, dt == "torch.bool"))
                self.leaves.append((dt, tuple(shape), off, nb))
        self._paths = None

    def paths(self):
        """{path: is_node} of every key in the message (made on first use)."""
        if self._paths is None:
            paths = {p: True for p in self.nodes}
            for parent, key, _b in self.tensors:
                paths[parent + "." + key if parent else key] = False
            for parent, key, _v in self.values:
                paths[parent + "." + key if parent else key] = False
            self._paths = paths
        return self._paths


def _to_torch(cap, is_bool):
    t = _torch_dlpack.from_dlpack(cap)
    # DLPack 0.6 has no bool type: the library exports bool as uint8
    return t.view(torch.bool) if is_bool and t.dtype != torch.bool else t


def _to_numpy(cap, is_bool):
    a = np.from_dlpack(_Cap(cap))
    return a.view(np.bool_) if is_bool and a.dtype != np.bool_ else a


AS_KINDS = ("torch", "numpy", "dlpack")


def check_as(as_):
    """as_ checked before anything is received or lent: a typo never costs
    a message."""
    if as_ not in AS_KINDS:
        raise ValueError("as_ must be 'torch', 'numpy' or 'dlpack', got %r" % (as_,))
    if as_ == "torch" and torch is None:
        raise ImportError("as_='torch' needs PyTorch (or use as_='numpy' or as_='dlpack')")
    return as_


def _gpu_check(as_, device):
    """A GPU buffer becomes torch CUDA tensors or DLPackArrays, never
    NumPy arrays (host memory only)."""
    if as_ == "numpy":
        raise ValueError(
            "the message is on %s and NumPy arrays live in host memory: receive it with "
            "recv(device='cpu') (a copy to the host), as_='torch' or as_='dlpack'" % device)
    if as_ == "torch" and torch is not None and not torch.cuda.is_available():
        raise RuntimeError(
            "the message is on %s but this PyTorch has no CUDA: receive it with "
            "recv(device='cpu') (a copy to the host) or as_='dlpack'" % device)


def unpack(td, plan, as_, cls):
    """A `cls` (Message or Consolidated) of views into td's buffer."""
    if plan.device != "cpu":
        _gpu_check(as_, plan.device)
    if as_ == "torch":
        if torch is None:
            raise ImportError("as_='torch' needs PyTorch")
        conv = _to_torch
    elif as_ == "numpy":
        conv = _to_numpy
    elif as_ == "dlpack":
        conv = None
    else:
        raise ValueError("as_ must be 'torch', 'numpy' or 'dlpack'")
    root = cls()
    root._td = td
    root._batch = plan.batch
    dicts = {"": root}
    for p in plan.nodes:
        parent, _, key = p.rpartition(".")
        d = {}
        dicts[parent][key] = d
        dicts[p] = d
    views = []
    caps = td.capsules() if conv is not None else None
    for i, (parent, key, is_bool) in enumerate(plan.tensors):
        if conv is None:
            dt, shape, off, nb = plan.leaves[i]
            v = DLPackArray(td, i, dt, shape, off, nb, plan.device)
        elif conv is _to_torch:
            try:
                v = _to_torch(caps[i], is_bool)
            except (RuntimeError, TypeError, BufferError) as e:
                dt = str(plan.leaves[i][0]).rpartition(".")[2]
                key_path = parent + "." + key if parent else key
                raise TypeError(
                    "leaf %r is %s, which this PyTorch (%s) cannot hold (%s): receive "
                    "it with as_='numpy' or as_='dlpack'" % (key_path, dt, torch.__version__, e)
                ) from e
        else:
            try:
                v = _to_numpy(caps[i], is_bool)
            except (RuntimeError, TypeError, BufferError, AttributeError) as e:
                dt = str(plan.leaves[i][0]).rpartition(".")[2]
                key_path = parent + "." + key if parent else key
                raise TypeError(
                    "leaf %r is %s, which NumPy cannot hold (%s): receive it with "
                    "as_='torch' or as_='dlpack'" % (key_path, dt, e)) from e
        d = dicts[parent]
        d[key] = v
        # the root is named None, not itself: no reference cycle, so a
        # message is freed (and at depth N given back) as soon as it is dropped
        views.append((d if parent else None, key, v))
    for parent, key, value in plan.values:
        dicts[parent][key] = value
    root._views = views
    return root


def _node_of(dst, parent):
    node = dst
    if parent:
        for k in parent.split("."):
            node = node[k]
    return node


def copy_into(dst, td, plan):
    """Copy received buffer td into dst, a nested mapping of tensors laid
    out like it (tensordict's recv(td)): every tensor leaf is written in
    place (torch copy_ / numpy copyto), non-tensor values are set. A leaf
    dst lacks, or one of another shape or dtype, raises ValueError naming
    the key; nothing is allocated for the payload."""
    if plan.device != "cpu":
        _gpu_check("torch" if torch is not None else "numpy", plan.device)
    _check_no_extra(dst, plan)
    if torch is not None:
        # a receive writes storage, as torch.distributed's recv does: a leaf
        # that requires grad (a parameter being synced) takes the data
        with torch.no_grad():
            return _copy_leaves(dst, td, plan)
    return _copy_leaves(dst, td, plan)


def _check_no_extra(dst, plan):
    """A key of dst the message lacks would keep stale contents: refused,
    naming it (before anything is written)."""
    have = plan.paths()
    stack = [(dst, "")]
    while stack:
        node, prefix = stack.pop()
        for k in node.keys():
            path = prefix + k if isinstance(k, str) else k
            if path not in have:
                raise ValueError(
                    "recv into a tensordict: it has a key %r, which the message lacks (the "
                    "message's layout differs: receive without one to get it)" % (path,))
            if have[path]:
                sub = node[k]
                if _is_mapping(sub):
                    stack.append((sub, path + "."))


def _copy_leaves(dst, td, plan):
    gpu_copies = False
    caps = td.capsules()
    for i, (parent, key, is_bool) in enumerate(plan.tensors):
        path = parent + "." + key if parent else key
        try:
            node = _node_of(dst, parent)
            out = node[key]
        except (KeyError, TypeError):
            raise ValueError("recv into a tensordict: it has no leaf %r, which the message "
                             "has (receive without one to get the new layout)" % path) from None
        if torch is not None and isinstance(out, torch.Tensor):
            src = _to_torch(caps[i], is_bool)
            if out.shape != src.shape or out.dtype != src.dtype:
                raise ValueError("recv into a tensordict: leaf %r is %s %s there, %s %s in the "
                                 "message" % (path, out.dtype, tuple(out.shape), src.dtype,
                                              tuple(src.shape)))
            out.copy_(src)
            if out.device.type == "cuda" or src.device.type == "cuda":
                gpu_copies = True
        elif np is not None and isinstance(out, np.ndarray):
            src = _to_numpy(caps[i], is_bool)
            if out.shape != src.shape or out.dtype != src.dtype:
                raise ValueError("recv into a tensordict: leaf %r is %s %s there, %s %s in the "
                                 "message" % (path, out.dtype, out.shape, src.dtype, src.shape))
            try:
                np.copyto(out, src)
            except ValueError as e:  # a read-only array
                raise ValueError("recv into a tensordict: leaf %r: %s" % (path, e)) from None
        else:
            raise ValueError("recv into a tensordict: leaf %r is a %s there, not a tensor" %
                             (path, type(out).__name__))
    for parent, key, value in plan.values:
        node = _node_of(dst, parent)
        try:
            same = node[key] == value
        except Exception:  # a missing key, or a comparison that is not a bool
            same = False
        if same is not True:
            node[key] = value
    if gpu_copies:
        # copy_ ran on torch's current stream; the message is released
        # (its buffer reused) when this returns
        torch.cuda.synchronize()
    return dst


class Unpacker:
    """Caches the plan of the last schema received."""

    __slots__ = ("plan",)

    def __init__(self):
        self.plan = None

    def __call__(self, td, as_, cls=Message):
        schema = td.schema
        plan = self.plan
        if plan is None or (plan.schema is not schema and plan.schema != schema):
            plan = self.plan = Plan(schema)
        return unpack(td, plan, as_, cls)

    def into(self, td, dst):
        """copy_into with the cached plan of td's schema."""
        schema = td.schema
        plan = self.plan
        if plan is None or (plan.schema is not schema and plan.schema != schema):
            plan = self.plan = Plan(schema)
        return copy_into(dst, td, plan)


def producer_done(device):
    """Before the library reads a CUDA buffer the caller wrote: wait for the
    work queued on torch's current stream of that device (the library reads
    on its own stream and waits for no other; docs/python.md, "GPU
    tensors"). Nothing for the host (None), without torch's CUDA, or when the
    library runs on its fake device (TDPIPE_CUDA=fake: its device memory is
    not torch's, and its device numbers need not exist in torch)."""
    if device is None or device == "cpu" or torch is None or _fake_cuda():
        return
    if torch.cuda.is_available():
        torch.cuda.current_stream(device).synchronize()


def _fake_cuda():
    return os.environ.get("TDPIPE_CUDA", "").startswith(("fake", "off"))


def consolidate(obj, as_="torch", _cache=None):
    """Copy a nested mapping of tensors into one new tdpipe buffer (on the
    leaves' device) and return it as a Consolidated dict of views (send it
    without a copy)."""
    cache = _cache or SchemaCache()
    schema, addrs, keep = cache.get(obj)
    producer_done(cache.key[3])
    td = _tdpipe.Td.alloc(schema)
    td.fill(addrs)
    del keep
    return unpack(td, Plan(schema), as_, Consolidated)

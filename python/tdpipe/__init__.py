"""tdpipe: stream tensordicts between processes, received as zero-copy
PyTorch tensors or NumPy arrays.

    import tdpipe
    with tdpipe.listen("127.0.0.1") as lst:        # lst.port: the bound port
        pipe = lst.accept(timeout=10)
        for msg in pipe:                           # ends at the peer's clean close
            train(msg["obs"], msg["next"]["reward"])

    pipe = tdpipe.connect("127.0.0.1", port)
    pipe.send({"obs": torch.zeros(4, 84), "next": {"reward": np.ones(4)}})
    pipe.close()

See docs/python.md for lending rules, threading and asyncio.
"""
import asyncio
import atexit
import inspect
import threading
import time

from . import _tdpipe
from ._watch import loan_retry
from .errors import (AuthError, CanceledError, ChecksumError, ClosedError, Error, PeerError,
                     ProtocolError, RefusedError, SchemaError, TimeoutError, error_for)
from ._convert import check_as as _check_as
from ._convert import Consolidated, DLPackArray, Message, SchemaCache, Unpacker, \
    consolidate, consolidated_check, producer_done as _producer_done, _is_mapping

try:
    import torch as _torch
except ImportError:
    _torch = None

__all__ = [
    "connect", "aconnect", "listen", "Pipe", "Listener", "Server", "Message", "Consolidated",
    "consolidate", "Error", "ClosedError", "PeerError", "TimeoutError", "ProtocolError",
    "RefusedError", "CanceledError", "AuthError", "ChecksumError", "SchemaError", "Schema",
    "library_version", "mem_stats", "DLPackArray", "cuda_device_count", "FanIn", "FanOut",
]

Schema = _tdpipe.Schema
library_version = _tdpipe.library_version
mem_stats = _tdpipe.mem_stats
cuda_device_count = _tdpipe.cuda_device_count
__version__ = _tdpipe.library_version()

# Nothing on the library's loop thread may take the GIL once the
# interpreter is shutting down.
atexit.register(_tdpipe._finalizing)

# asend gathers a dict of at least this many bytes into a loaned shm slot
# (measured: below it the loan per message costs more than the copy saved)
_ALOAN_MIN_BYTES = 64 * 1024

_OPTS = ("depth", "recv_depth", "window", "connect_timeout", "linger", "reconnect", "connect_wait",
         "latency_stats", "plane", "peer_mode", "keepalive", "secret", "recv_device",
         "cuda_device")


def _loop_flag(loop):
    if loop not in ("caller", "thread"):
        raise ValueError("loop must be 'caller' or 'thread'")
    return loop == "thread"


# asend waits this long for its send on the calling thread (GIL released,
# CPU yielded) before it hands the wait to the event loop: a send usually
# completes within it, and a round through the event loop (eventfd, epoll,
# a callback, a task step) costs more than the wait. The bound grows with
# the message, whose copy into the transport takes time, and is capped so
# that the event loop is never held long.
_SPIN_BASE_US = 100
_SPIN_MAX_US = 1000


def _check_device(device):
    """recv's device as the library names it ("cpu", "cuda:N"), or None."""
    if device is None:
        return None
    kind = getattr(device, "type", None)
    if kind is not None:  # a torch.device
        index = device.index
        if kind == "cuda" and index is None:
            index = _torch.cuda.current_device() if _torch.cuda.is_available() else 0
        name = "cpu" if kind == "cpu" else "%s:%d" % (kind, index)
    else:
        name = str(device)
        if name == "cuda":
            name = "cuda:0"
    kind, _, index = name.partition(":")
    if name != "cpu" and not (kind == "cuda" and index.isdigit()):
        raise ValueError("device %r: expected 'cpu', 'cuda' or 'cuda:N'" % (str(device),))
    if name != "cpu" and int(index) >= _tdpipe.cuda_device_count():
        # said before anything is received, so no message is lost to it
        raise ValueError("device %r: no CUDA device %s (the library sees %d; docs/gpu.md)" %
                         (str(device), index, _tdpipe.cuda_device_count()))
    return name


def _on_device(raw, device):
    """A received Td on `device`: itself, or a copy there made by the
    library (the message is then released at once)."""
    if device is None or raw.device == device:
        return raw
    try:
        return raw.to_device(device)
    finally:
        raw.release()




def _check_into(td):
    if td is not None and not _is_mapping(td):
        # refused before a message is taken
        raise TypeError("recv(td): td is a tensordict or a nested mapping of tensors or arrays "
                        "to receive into, got %s" % type(td).__name__)


def _as_timeout(td, timeout):
    """recv(td) takes the tensordict first (as tensordict's pipe does); a
    number there is the timeout of older calls, recv(5)."""
    if isinstance(td, (int, float)) and not isinstance(td, bool):
        return None, td
    _check_into(td)
    return td, timeout


async def _run_blocking(fn):
    """fn() on the default executor: for the calls with no async form in the
    library (connect, accept, close), which release the GIL while they wait."""
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def _opts(kw):
    for k in kw:
        if k not in _OPTS:
            raise TypeError("unknown option %r (known: %s)" % (k, ", ".join(_OPTS)))
    return dict(kw)


def _op_ready(op, holder):
    """The eventfd of op is readable: hand its result to the waiting future
    (holder[0]); with none waiting, only empty the fd (it is level-triggered)."""
    fut = holder[0]
    if fut is None or fut.done():
        op.drain()
        return
    try:
        res = op.result()
    except BaseException as e:  # the op's error, raised in the coroutine
        fut.set_exception(e)
        return
    if res is not None:
        fut.set_result(res)


class Pipe:
    """One end of a stream. Made by connect() or Listener.accept().

    Blocking calls release the GIL while they wait. One blocking call at a
    time per pipe (another thread's concurrent call raises RuntimeError).
    """

    def __init__(self, raw, as_="torch"):
        self._raw = raw
        self.as_ = as_
        self._send_cache = SchemaCache()
        self._unpack = Unpacker()
        self._loan_unpack = Unpacker()
        self._rop = None
        self._rop_pending = False
        self._sop = None
        self._sop_pending = False
        self._abuf = None  # asend's gather buffer, reused while its schema holds
        self._held = None  # a received message its caller could not take (_unpack_held)
        self._abuf_schema = None
        self._aloans = 0  # asends gathered into a loaned slot (the tests read it)
        self._dbuf = None  # send's device gather buffer, reused while its schema holds
        self._dbuf_schema = None
        # depth 1: the device of the GPU message lent last, whose buffer the
        # next receive reuses (torch's current stream there is waited for)
        self._lent_dev = None
        self._bg_recv = None  # pending background receive (loop="caller" asyncio)
        # asend's short wait on the calling thread before the event loop's
        # (microseconds; None: by size, see _SPIN_*; 0: none)
        self.async_spin_us = None
        self._watch = {}  # op -> (event loop its fd is registered with, [waiting future])

    # -- sending

    def _send_args(self, td):
        """The Td to send as is, or (schema, addresses, keepalive) to gather.
        A CUDA buffer's producer work is waited for here (_producer_done)."""
        raw_td = consolidated_check(td)
        if raw_td is not None:
            dev = raw_td.device
            if dev != "cpu":
                _producer_done(dev)
            return raw_td, None
        cache = self._send_cache
        schema, addrs, keep, wrapped = cache.get_send(td)
        if wrapped is not None:
            _producer_done(cache.fkey[0][3])
            return wrapped, None
        dev = cache.key[3]
        if dev is not None:
            _producer_done(dev)
            return self._gather_device(schema, addrs), None
        return None, (schema, addrs, keep)

    def _gather_device(self, schema, addrs):
        """CUDA leaves gathered into the pipe's device send buffer, reused
        while the layout holds, by device-to-device copies of the library."""
        if self._dbuf_schema is not schema:
            self._dbuf = None
            self._dbuf = _tdpipe.Td.alloc(schema)
            self._dbuf_schema = schema
        self._dbuf.fill(addrs)
        return self._dbuf

    def send(self, td, timeout=None):
        """Send a nested mapping of tensors / arrays / scalars.

        Leaves in separate buffers are gathered (one copy) into a send
        buffer the pipe keeps and reuses; a Consolidated (from consolidate(),
        loan(), or a received Message being forwarded) goes without a copy,
        and so do leaves that are views into one allocation (a
        TensorDict.consolidate() storage, say; see docs/python.md).
        Returns when the buffer may be reused (the transport took the bytes).
        CUDA leaves (all on one device; several raise ValueError naming
        them) are gathered into a device buffer by the library's copies,
        after torch's current stream on that device is synchronized; work
        on other streams must be finished first (docs/python.md, "GPU
        tensors").
        A key or value that breaks a schema rule (a '.' in a key, an empty
        key, a value over 4096 bytes, ...) raises SchemaError, a
        ValueError naming the key, before anything is sent.
        """
        raw_td, gather = self._send_args(td)
        if raw_td is not None:
            self._raw.send_td(raw_td, timeout)
        else:
            schema, addrs, keep = gather
            self._raw.send_gather(schema, addrs, timeout)
            del keep

    def prepare(self, like, timeout=None):
        """Set up for messages laid out like `like` (a nested mapping, or a
        Schema) before the first one: pools and receive storage are made,
        and their pages faulted in, now, so that the first send of that
        layout costs what a steady one does (tdp_pipe_prepare,
        docs/pipe.md). Returns once the receiver is ready; a send of the
        layout then carries no schema. Raises what a send of the layout
        would: ProtocolError (EMSGSIZE) over the receiver's limit, here
        without closing the pipe; TimeoutError."""
        if isinstance(like, Schema):
            schema = like
        else:
            schema, _addrs, _keep = self._send_cache.get(like)
        self._raw.prepare(schema, timeout)

    def loan(self, like, timeout=None, as_=None):
        """A Consolidated laid out like `like` (a nested mapping), in a send
        buffer borrowed from the data plane (a slot of the shared pool on the
        shm plane): fill its leaves in place and send it, copying nothing.
        Once sent it is the receiver's: loan a new one for the next message.
        When every slot is out (the receiver holds them, or sends are in
        flight) this waits, polling, up to `timeout` seconds (None: forever),
        then raises TimeoutError.

        A layout of CUDA leaves gives a device buffer (on the cuda-ipc plane
        a slot of the device pool, which the receiver views): fill it on the
        GPU; send synchronizes torch's current stream, other streams must be
        finished first. as_ (default: the pipe's) picks the leaves: "torch"
        or "dlpack" (DLPackArray, for a PyTorch without CUDA)."""
        as_ = _check_as(as_ or self.as_)
        schema, _addrs, _keep = self._send_cache.get(like)
        if as_ == "torch" and schema.device != "cpu" and _torch is not None and \
                not _torch.cuda.is_available():
            # before a slot is taken: unpacking it would fail with a receive's advice
            raise RuntimeError("loan: the layout is on %s but this PyTorch has no CUDA: loan "
                               "with as_='dlpack'" % schema.device)
        td = loan_retry(self._raw, schema, timeout, "in use")
        return self._loan_unpack(td, as_, Consolidated)

    # -- receiving

    def recv(self, td=None, timeout=None, as_=None, device=None):
        """The next message: a Message (nested dict) of views into the
        receive buffer. Raises ClosedError at the peer's clean end,
        TimeoutError when `timeout` seconds pass (the pipe stays usable).

        Depth 1: the message is lent until the next recv (which overwrites
        it) or release(). Depth N: until release(), the end of its `with`
        block, or until the Message object is garbage.

        recv(td): receive into an existing nested mapping of tensors (a
        tensordict, a dict of tensors or arrays) laid out like the message:
        its leaves are overwritten in place, the message is released at once
        and td is returned (one copy, no allocation). A leaf it lacks, or of
        another shape or dtype, raises ValueError (the message is consumed).

        device: None (where the message is: the sender's device, or the
        pipe's recv_device option), "cpu" or "cuda:N". A message elsewhere
        is copied there by the library into a new buffer (an allocation per
        message; the pipe option recv_device="cuda:N" lands it there without
        one) and the pipe's buffer is released at once. A GPU message gives
        torch CUDA tensors viewing the receive buffer (as_="torch"; as_="dlpack"
        gives DLPackArray leaves; NumPy refuses). See docs/python.md, "GPU
        tensors", for the stream contract."""
        td, timeout = _as_timeout(td, timeout)
        device = _check_device(device)
        as_ = _check_as(as_ or self.as_)  # before a message is taken
        self._gpu_reuse()
        raw = self._take_held()
        raw = _on_device(raw if raw is not None else self._raw.recv(timeout), device)
        if td is None:
            return self._lent(self._unpack_held(raw, as_))
        try:
            return self._unpack.into(raw, td)
        finally:
            raw.release()

    def _take_held(self):
        raw, self._held = self._held, None
        return raw

    def _unpack_held(self, raw, as_):
        """The message's leaves as as_ asks. Where they cannot be (a dtype
        this PyTorch or NumPy lacks, a GPU message as NumPy arrays), the
        error is raised and the message stays the next one any receive
        returns, so that one with another as_ or device takes it: nothing
        is lost."""
        try:
            return self._unpack(raw, as_)
        except (TypeError, ValueError, RuntimeError):
            self._held = raw
            raise

    def release(self, msg):
        msg.release()

    def _lent(self, msg):
        if self._unpack.plan.device != "cpu" and self._raw.depth == 1 and msg._td.seq:
            self._lent_dev = self._unpack.plan.device
        return msg

    def _gpu_reuse(self):
        """At depth 1 a receive gives the last message's buffer back: a GPU
        one after torch's current stream has passed the work reading it."""
        if self._lent_dev is not None:
            _producer_done(self._lent_dev)
            self._lent_dev = None

    def __iter__(self):
        """Messages until the peer's clean end; other errors raise."""
        while True:
            try:
                msg = self.recv()
            except ClosedError:
                return
            yield msg

    # -- asyncio

    async def _wait(self, op):
        """The op's result, awaited on its eventfd. The fd stays registered
        with the event loop between operations (one registration per op and
        loop, not an add and a remove per message); _unwatch drops it."""
        r = op.result()
        if r is not None:
            return r
        loop = asyncio.get_running_loop()
        w = self._watch.get(op)
        if w is None or w[0] is not loop:
            if w is not None:
                self._unwatch(op)
            w = (loop, [None])
            loop.add_reader(op.fileno(), _op_ready, op, w[1])
            self._watch[op] = w
        fut = loop.create_future()
        w[1][0] = fut
        try:
            return await fut
        finally:
            w[1][0] = None

    def _unwatch(self, op=None):
        """Take op's eventfd (every op's, with None) off its event loop:
        directly on that loop's thread or while it does not run, else
        through call_soon_threadsafe."""
        for o in ([op] if op is not None else list(self._watch)):
            loop, _holder = self._watch.pop(o)
            if loop.is_closed():
                continue
            if asyncio._get_running_loop() is loop or not loop.is_running():
                loop.remove_reader(o.fileno())
            else:
                loop.call_soon_threadsafe(loop.remove_reader, o.fileno())

    def _in_thread(self, fn):
        """An asyncio future of fn() run on a daemon thread (the blocking
        call releases the GIL); for pipes on the caller-driven loop."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(res, exc):
            if fut.cancelled():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(res)

        def run():
            try:
                res, exc = fn(), None
            except BaseException as e:  # delivered to the awaiting coroutine
                res, exc = None, e
            try:
                loop.call_soon_threadsafe(done, res, exc)
            except RuntimeError:
                pass  # the event loop is closed: nobody waits any more

        threading.Thread(target=run, daemon=True).start()
        return fut

    async def arecv(self, td=None, as_=None, device=None):
        """recv() for asyncio. On a loop="thread" pipe it waits on an
        eventfd the library's completion callback signals (loop.add_reader);
        on a loop="caller" pipe a daemon thread makes the blocking call.
        Either way the event loop never blocks, and a cancelled arecv leaves
        its receive pending: the next arecv takes its message. arecv(td)
        receives into td as recv(td) does."""
        _check_into(td)
        device = _check_device(device)
        as_ = _check_as(as_ or self.as_)
        self._gpu_reuse()
        raw = self._take_held()
        raw = _on_device(raw if raw is not None else await self._arecv_raw(), device)
        if td is None:
            return self._lent(self._unpack_held(raw, as_))
        try:
            return self._unpack.into(raw, td)
        finally:
            raw.release()

    async def _arecv_raw(self):
        if not self._raw.on_thread:
            if self._bg_recv is None:
                self._bg_recv = self._in_thread(lambda: self._raw.recv(None))
            try:
                return await asyncio.shield(self._bg_recv)
            finally:
                if self._bg_recv.done():
                    self._bg_recv = None
        if self._rop is None:
            self._rop = _tdpipe.Op()
        if not self._rop_pending:
            self._rop.start_recv(self._raw)
            self._rop_pending = True
        try:
            td = await self._wait(self._rop)
        except Error:
            self._rop_pending = False
            raise
        self._rop_pending = False
        return td

    async def asend(self, td):
        """send() for asyncio. A Consolidated goes as it is; separate
        leaves are gathered (one copy) into a send buffer this pipe keeps
        for its asynchronous sends and reuses while the layout repeats, or,
        for 64 KB or more on the shm plane, into a loaned pool slot (the
        send then copies nothing more): no allocation in steady state, as
        for send(). The data is referenced
        until the send completes; a cancelled asend's send still completes,
        and the next asend waits for it first.

        asend first waits briefly on the calling thread, without the GIL and
        yielding the CPU, for the send to complete (100 us plus 1 us per
        4 KB, at most 1 ms; pipe.async_spin_us sets another bound, 0 none),
        and only then on the event loop: most sends complete within it,
        and that is cheaper than a round through the event loop."""
        if not self._raw.on_thread:
            await self._in_thread(lambda: self.send(td))
            return
        if self._sop is None:
            self._sop = _tdpipe.Op()
        if self._sop_pending:
            # a cancelled asend's send is still using the buffer: finish it
            try:
                await self._wait(self._sop)
            finally:
                self._sop_pending = False
        raw_td, gather = self._send_args(td)
        if raw_td is None:
            schema, addrs, keep = gather
            if self._abuf_schema is not schema:
                # made with the layout even where loans carry it, so that a
                # loan refused later (every slot out) allocates nothing
                self._abuf = _tdpipe.Td.alloc(schema)
                self._abuf_schema = schema
            raw_td = self._aloan(schema)
            if raw_td is None:
                raw_td = self._abuf
            else:
                self._aloans += 1
            raw_td.fill(addrs)
            del keep
        self._sop.start_send(self._raw, raw_td)
        self._sop_pending = True
        spin = self.async_spin_us
        if spin is None:
            spin = min(_SPIN_MAX_US, _SPIN_BASE_US + raw_td.nbytes // 4096)
        if spin <= 0 or self._sop.settle(spin) is None:
            await self._wait(self._sop)
        self._sop_pending = False

    def _aloan(self, schema):
        """On the shm plane, a pool slot for asend to gather a dict into:
        the send then copies nothing more (one copy in all, where the
        pipe's own buffer costs a second one into a slot). None below 64 KB
        (a loan per message costs more than copying that much twice), when
        every slot is out (the receiver holds them), or on another plane:
        then the pipe's buffer."""
        if schema.total_bytes < _ALOAN_MIN_BYTES or self._raw.plane != "shm":
            return None
        try:
            return self._raw.loan(schema)
        except Error as e:
            if e.errname != "EAGAIN":
                raise
            return None

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.arecv()
        except ClosedError:
            raise StopAsyncIteration from None

    # -- ending

    def close(self, timeout=10.0):
        """Clean end: queued sends go, then BYE; the peer's receives end
        with ClosedError after the last message. The pipe is then freed;
        messages still held stay readable (their memory is referenced)."""
        try:
            self._raw.close(timeout)
        finally:
            self._raw.free()
            self._unwatch()

    def abort(self):
        """End at once; the peer sees PeerError."""
        self._raw.abort()
        self._raw.free()
        self._unwatch()

    async def aclose(self, timeout=10.0):
        """close() for asyncio (the close runs on an executor thread)."""
        self._unwatch()
        await _run_blocking(lambda: self.close(timeout))

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            self.close()
        else:
            self.abort()
        return False

    async def __aenter__(self):
        return self

    async def __aexit__(self, et, ev, tb):
        """`async with pipe:` closes cleanly on normal exit, aborts on an
        exception (as `with pipe:` does)."""
        if et is None:
            await self.aclose()
        else:
            self.abort()
        return False

    # -- queries

    def stats(self):
        return self._raw.stats()

    def latency(self, which="send"):
        """Latency percentiles in ns, as a dict (count, min, p50, p90, p99,
        p999, max, mean), of a pipe made with latency_stats=True; None
        otherwise. which: "send" (call to completion) or "recv_wait" (a
        message's wait for the receive that took it)."""
        return self._raw.latency(which)

    @property
    def plane(self):
        """"ucx", "shm", "cuda-ipc" or "tcp": the data plane the handshake chose."""
        return self._raw.plane

    @property
    def peer(self):
        return self._raw.peer

    @property
    def depth(self):
        return self._raw.depth

    @property
    def loop(self):
        """"thread" or "caller": see connect()."""
        return "thread" if self._raw.on_thread else "caller"


def connect(host, port, *, as_="torch", loop="caller", **opts):
    """Connect to a listener and handshake. Options (keyword): depth (alias
    recv_depth, 1..64), window (bytes: the receive window for small messages,
    0 (off) or 4096..2**30, default 256 KiB, docs/pipe.md#receive-window), connect_timeout and
    linger (seconds), plane ("auto",
    "ucx", "shm", "cuda-ipc": the last for pipes that name cuda_device; "tcp": the pipe's own TCP connection), peer_mode ("auto", "ucx", "socket"), keepalive
    ((idle_s, intvl_s, count)). as_: "torch" or "numpy" for received leaves.

    loop: "caller" (default): blocking calls drive the pipe's event loop on
    the calling thread, the fastest for blocking use; "thread": the pipe
    runs on the library's loop thread, which keeps a depth-N receive ring
    filling between calls and lets asyncio wait on an eventfd."""
    _check_as(as_)
    return Pipe(_tdpipe.Pipe.connect(host, int(port), _opts(opts), _loop_flag(loop)), as_)


async def aconnect(host, port, *, as_="torch", loop="thread", **opts):
    """connect() for asyncio: the connect and handshake run on an executor
    thread, so the event loop goes on. loop defaults to "thread", the pipe
    kind whose arecv/asend wait on an eventfd. `async with await
    tdpipe.aconnect(...) as pipe:` closes it at the end."""
    return await _run_blocking(lambda: connect(host, port, as_=as_, loop=loop, **opts))


def _closed_listener():
    exc = CanceledError("accept: listener closed (ECANCELED)")
    exc.code = _tdpipe.ECANCELED
    exc.errname = "ECANCELED"
    return exc


class Listener:
    """Accepts pipes. ``port`` is the port bound (listen with port 0)."""

    def __init__(self, host, port=0, *, as_="torch", loop="caller", **opts):
        _check_as(as_)
        self._raw = _tdpipe.Listener.listen(host, int(port), _opts(opts), _loop_flag(loop))
        self.as_ = as_
        self._bg_accept = None
        self._closing = False

    @property
    def port(self):
        return self._raw.port

    def accept(self, timeout=None):
        """The next pipe whose handshake completed (TimeoutError after
        `timeout` seconds). Connections that fail their handshake (garbage,
        wrong version) are dropped by the library and never returned."""
        return Pipe(self._raw.accept(timeout), self.as_)

    async def aaccept(self, timeout=None):
        """accept() for asyncio, on an executor thread. A cancelled aaccept
        leaves its accept running: the next aaccept returns its pipe. close()
        ends a pending one with CanceledError (within 0.1 s)."""
        if self._bg_accept is None:
            fut = asyncio.get_running_loop().run_in_executor(None, self._accept_bg, timeout)
            self._bg_accept = fut
        try:
            raw = await asyncio.shield(self._bg_accept)
        finally:
            if self._bg_accept is not None and self._bg_accept.done():
                self._bg_accept = None
        return Pipe(raw, self.as_)

    def _accept_bg(self, timeout):
        """accept in slices of 0.1 s, so that a close() from the event loop
        is seen; a pipe that arrives between slices waits in the listener's
        queue for the next one. The listener is freed here if close() came
        meanwhile (the C listener takes no close while an accept runs)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._closing:
                step = 0.1
                if deadline is not None:
                    step = max(0.0, min(step, deadline - time.monotonic()))
                try:
                    return self._raw.accept(step)
                except TimeoutError:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
            raise _closed_listener()
        finally:
            if self._closing:
                self._raw.close()

    def __aiter__(self):
        return self

    async def __anext__(self):
        """`async for pipe in listener`: each pipe as its handshake completes
        (ends when the listener is closed)."""
        try:
            return await self.aaccept()
        except CanceledError:
            raise StopAsyncIteration from None

    def close(self):
        """Stop listening. A pending aaccept ends with CanceledError (and
        `async for` over the listener ends); the listener is freed when it
        has."""
        self._closing = True
        bg = self._bg_accept
        if bg is not None and not bg.done():
            return  # _accept_bg frees it
        self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()
        return False


def listen(host="127.0.0.1", port=0, *, as_="torch", loop="caller", **opts):
    """A Listener on host:port (port 0: a free one, read back as .port).
    Options as for connect(); accepted pipes take its loop and options."""
    return Listener(host, port, as_=as_, loop=loop, **opts)


def _takes_two(fn):
    """Does handler take (request, client_id)? One positional parameter: (request)."""
    try:
        ps = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    ps = list(ps)
    pos = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
           and p.default is p.empty]
    return len(pos) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in ps)


class Server:
    """Many clients, one handler: handler(request) -> reply or None, or
    handler(request, client_id) when it takes two positional parameters
    (per-client state, keyed by the id on_close also gets).

    request is a Message (nested dict of views) lent for the call only;
    the reply is any nested mapping (another schema than the request's is
    fine), copied into a new buffer and sent back on the client's pipe.
    The handler runs on the library's loop thread, holding the GIL; an
    exception in it is printed and closes that client only (it sees
    PeerError). on_close(client_id, error) is called when a client goes:
    error is the tdpipe exception object of how it ended (ClosedError for
    the client's clean close, PeerError when it died, ...; its .code and
    .errname are the library's), or None when this side closed it cleanly.

    Limits (None or 0: the library's default; docs/server.md, "Limits"):
    max_clients; max_pending, handshakes under way (one more drops the
    oldest); max_per_source, handshakes under way from one IPv4 address or
    IPv6 /64; idle_timeout, seconds without a message either way before a
    client is closed (< 0: never); handshake_timeout, seconds.
    """

    def __init__(self, host, port, handler, *, as_="torch", on_close=None,
                 max_clients=None, max_pending=None, max_per_source=None,
                 idle_timeout=None, handshake_timeout=None, **opts):
        _check_as(as_)
        self._handler = handler
        self._with_id = _takes_two(handler)
        self.as_ = as_
        self._unpack = Unpacker()
        self._cache = SchemaCache()
        self._on_close = on_close
        self._raw = _tdpipe.Server(host, int(port), self._on_message,
                                   None if on_close is None else self._closed,
                                   _opts(opts), max_clients, max_pending, max_per_source,
                                   idle_timeout, handshake_timeout)

    def _closed(self, client_id, code):
        self._on_close(client_id, error_for(code))

    def _on_message(self, td, client_id):
        req = self._unpack(td, self.as_)
        reply = self._handler(req, client_id) if self._with_id else self._handler(req)
        if reply is None:
            return None
        raw_td = consolidated_check(reply)
        if raw_td is not None:
            return raw_td
        schema, addrs, keep = self._cache.get(reply)
        _producer_done(self._cache.key[3])
        out = _tdpipe.Td.alloc(schema)
        out.fill(addrs)
        del keep
        return out

    @property
    def port(self):
        return self._raw.port

    def stats(self):
        return self._raw.stats()

    def shutdown(self, timeout=5.0):
        """Stop accepting, let queued replies go, close every client cleanly."""
        self._raw.shutdown(timeout)

    def close(self):
        self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


from .fanin import FanIn  # noqa: E402  (it uses the helpers above)
from .fanout import FanOut  # noqa: E402

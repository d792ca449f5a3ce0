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
import threading
import time

from . import _tdpipe
from .errors import (AuthError, CanceledError, ChecksumError, ClosedError, Error, PeerError,
                     ProtocolError, RefusedError, TimeoutError)
from ._convert import Consolidated, Message, SchemaCache, Unpacker, consolidate, \
    consolidated_check

__all__ = [
    "connect", "listen", "Pipe", "Listener", "Server", "Message", "Consolidated",
    "consolidate", "Error", "ClosedError", "PeerError", "TimeoutError", "ProtocolError",
    "RefusedError", "CanceledError", "AuthError", "ChecksumError", "Schema", "library_version",
]

Schema = _tdpipe.Schema
library_version = _tdpipe.library_version
__version__ = _tdpipe.library_version()

# Nothing on the library's loop thread may take the GIL once the
# interpreter is shutting down.
atexit.register(_tdpipe._finalizing)

_OPTS = ("depth", "recv_depth", "connect_timeout", "linger", "reconnect", "connect_wait",
         "latency_stats", "plane", "peer_mode", "keepalive", "secret")


def _loop_flag(loop):
    if loop not in ("caller", "thread"):
        raise ValueError("loop must be 'caller' or 'thread'")
    return loop == "thread"


def _opts(kw):
    for k in kw:
        if k not in _OPTS:
            raise TypeError("unknown option %r (known: %s)" % (k, ", ".join(_OPTS)))
    return dict(kw)


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
        self._bg_recv = None  # pending background receive (loop="caller" asyncio)

    # -- sending

    def _send_args(self, td):
        """The Td to send as is, or (schema, addresses, keepalive) to gather."""
        raw_td = consolidated_check(td)
        if raw_td is not None:
            return raw_td, None
        schema, addrs, keep, wrapped = self._send_cache.get_send(td)
        if wrapped is not None:
            return wrapped, None
        return None, (schema, addrs, keep)

    def send(self, td, timeout=None):
        """Send a nested mapping of tensors / arrays / scalars.

        Leaves in separate buffers are gathered (one copy) into a send
        buffer the pipe keeps and reuses; a Consolidated (from consolidate(),
        loan(), or a received Message being forwarded) goes without a copy,
        and so do leaves that are views into one allocation (a
        TensorDict.consolidate() storage, say; see docs/python.md).
        Returns when the buffer may be reused (the transport took the bytes).
        """
        raw_td, gather = self._send_args(td)
        if raw_td is not None:
            self._raw.send_td(raw_td, timeout)
        else:
            schema, addrs, keep = gather
            self._raw.send_gather(schema, addrs, timeout)
            del keep

    def loan(self, like, timeout=None):
        """A Consolidated laid out like `like` (a nested mapping), in a send
        buffer borrowed from the data plane (a slot of the shared pool on the
        shm plane): fill its leaves in place and send it, copying nothing.
        Once sent it is the receiver's: loan a new one for the next message.
        When every slot is out (the receiver holds them, or sends are in
        flight) this waits, polling, up to `timeout` seconds (None: forever),
        then raises TimeoutError."""
        schema, _addrs, _keep = self._send_cache.get(like)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 20e-6
        while True:
            try:
                td = self._raw.loan(schema)
                break
            except Error as e:
                if e.errname != "EAGAIN":
                    raise
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("loan: every slot is in use (ETIMEDOUT)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return self._loan_unpack(td, self.as_, Consolidated)

    # -- receiving

    def recv(self, timeout=None, as_=None):
        """The next message: a Message (nested dict) of views into the
        receive buffer. Raises ClosedError at the peer's clean end,
        TimeoutError when `timeout` seconds pass (the pipe stays usable).

        Depth 1: the message is lent until the next recv (which overwrites
        it) or release(). Depth N: until release(), the end of its `with`
        block, or until the Message object is garbage.
        """
        return self._unpack(self._raw.recv(timeout), as_ or self.as_)

    def release(self, msg):
        msg.release()

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
        r = op.result()
        if r is not None:
            return r
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fd = op.fileno()

        def ready():
            if fut.done():
                return
            try:
                res = op.result()
            except BaseException as e:  # the op's error, raised in the coroutine
                fut.set_exception(e)
                return
            if res is not None:
                fut.set_result(res)

        loop.add_reader(fd, ready)
        try:
            return await fut
        finally:
            loop.remove_reader(fd)

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

    async def arecv(self, as_=None):
        """recv() for asyncio. On a loop="thread" pipe it waits on an
        eventfd the library's completion callback signals (loop.add_reader);
        on a loop="caller" pipe a daemon thread makes the blocking call.
        Either way the event loop never blocks, and a cancelled arecv leaves
        its receive pending: the next arecv takes its message."""
        if not self._raw.on_thread:
            if self._bg_recv is None:
                self._bg_recv = self._in_thread(lambda: self._raw.recv(None))
            try:
                td = await asyncio.shield(self._bg_recv)
            finally:
                if self._bg_recv.done():
                    self._bg_recv = None
            return self._unpack(td, as_ or self.as_)
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
        return self._unpack(td, as_ or self.as_)

    async def asend(self, td):
        """send() for asyncio. The data is referenced until it completes."""
        if not self._raw.on_thread:
            await self._in_thread(lambda: self.send(td))
            return
        if self._sop is None:
            self._sop = _tdpipe.Op()
        raw_td, gather = self._send_args(td)
        if raw_td is None:
            # gather into a fresh buffer: the op reads it after this returns
            schema, addrs, keep = gather
            raw_td = _tdpipe.Td.alloc(schema)
            raw_td.fill(addrs)
            del keep
        self._sop.start_send(self._raw, raw_td)
        await self._wait(self._sop)

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

    def abort(self):
        """End at once; the peer sees PeerError."""
        self._raw.abort()
        self._raw.free()

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            self.close()
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
        """"ucx" or "shm": the data plane the handshake chose."""
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
    recv_depth, 1..64), connect_timeout and linger (seconds), plane ("auto",
    "ucx", "shm"), peer_mode ("auto", "ucx", "socket"), keepalive
    ((idle_s, intvl_s, count)). as_: "torch" or "numpy" for received leaves.

    loop: "caller" (default): blocking calls drive the pipe's event loop on
    the calling thread, the fastest for blocking use; "thread": the pipe
    runs on the library's loop thread, which keeps a depth-N receive ring
    filling between calls and lets asyncio wait on an eventfd."""
    return Pipe(_tdpipe.Pipe.connect(host, int(port), _opts(opts), _loop_flag(loop)), as_)


class Listener:
    """Accepts pipes. ``port`` is the port bound (listen with port 0)."""

    def __init__(self, host, port=0, *, as_="torch", loop="caller", **opts):
        self._raw = _tdpipe.Listener.listen(host, int(port), _opts(opts), _loop_flag(loop))
        self.as_ = as_

    @property
    def port(self):
        return self._raw.port

    def accept(self, timeout=None):
        """The next pipe whose handshake completed (TimeoutError after
        `timeout` seconds). Connections that fail their handshake (garbage,
        wrong version) are dropped by the library and never returned."""
        return Pipe(self._raw.accept(timeout), self.as_)

    def close(self):
        self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def listen(host="127.0.0.1", port=0, *, as_="torch", loop="caller", **opts):
    """A Listener on host:port (port 0: a free one, read back as .port).
    Options as for connect(); accepted pipes take its loop and options."""
    return Listener(host, port, as_=as_, loop=loop, **opts)


class Server:
    """Many clients, one handler: handler(request) -> reply or None.

    request is a Message (nested dict of views) lent for the call only;
    the reply is any nested mapping (another schema than the request's is
    fine), copied into a new buffer and sent back on the client's pipe.
    The handler runs on the library's loop thread, holding the GIL; an
    exception in it is printed and closes that client only (it sees
    PeerError). on_close(client_id, code) is called when a client goes.

    Limits (None or 0: the library's default; docs/server.md, "Limits"):
    max_clients; max_pending, handshakes under way (one more drops the
    oldest); max_per_source, handshakes under way from one IPv4 address or
    IPv6 /64; idle_timeout, seconds without a message either way before a
    client is closed (< 0: never); handshake_timeout, seconds.
    """

    def __init__(self, host, port, handler, *, as_="torch", on_close=None,
                 max_clients=None, max_pending=None, max_per_source=None,
                 idle_timeout=None, handshake_timeout=None, **opts):
        self._handler = handler
        self.as_ = as_
        self._unpack = Unpacker()
        self._cache = SchemaCache()
        self._raw = _tdpipe.Server(host, int(port), self._on_message, on_close,
                                   _opts(opts), max_clients, max_pending, max_per_source,
                                   idle_timeout, handshake_timeout)

    def _on_message(self, td, client_id):
        req = self._unpack(td, self.as_)
        reply = self._handler(req)
        if reply is None:
            return None
        raw_td = consolidated_check(reply)
        if raw_td is not None:
            return raw_td
        schema, addrs, keep = self._cache.get(reply)
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

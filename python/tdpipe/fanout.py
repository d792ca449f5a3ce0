"""Fan-out: one producer feeds many consumers (the C library's tdp_fanout;
docs/python.md, "Fan-out").

    with tdpipe.FanOut("broadcast") as fan:      # or "distribute"
        fan.listen("127.0.0.1")                  # fan.port: consumers connect() there
        fan.connect("127.0.0.1", 5000)           # and/or dial consumers that listen
        fan.wait_consumers(4, timeout=10)
        fan.send({"w": weights})                 # every consumer gets it

Consumers are ordinary pipes: tdpipe.connect(host, fan.port) or
Listener.accept(), then recv() as from one producer.
"""
import asyncio
import time

from . import _tdpipe
from ._convert import Consolidated, SchemaCache, Unpacker, check_as, consolidated_check, \
    producer_done as _producer_done
from ._watch import EfdWatch, loan_retry
from .errors import TimeoutError

MODES = {"broadcast": 0, "distribute": 1}
SLOW = {"block": 0, "drop_oldest": 1}

# asend's wait on the calling thread before the event loop's (as Pipe.asend)
_SPIN_BASE_US = 100
_SPIN_MAX_US = 1000


def _choice(what, value, table):
    if value not in table:
        raise ValueError("%s must be %s, not %r" % (what, " or ".join(map(repr, table)), value))
    return table[value]


def _bounded(what, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError("%s must be an integer %d..%d, not %r" % (what, lo, hi, value))
    return value


class FanOut(EfdWatch):
    """Sends each message to the consumers it holds: every one of them
    (mode="broadcast"; a consumer that joins late starts at the next
    message) or one that is free (mode="distribute"). Consumers are dialed
    (connect) or accepted (listen), and come and go at any time; one that
    fails leaves without stopping the others.

    slow: "block" (the default: at most `depth` messages in flight, the
    producer goes at the pace of the slowest consumer, every consumer gets
    everything) or "drop_oldest" (broadcast: a consumer a whole window
    behind loses its oldest messages, counted in its "drops"; send then
    returns once the message is queued, so send a fresh buffer each time).
    depth: 1..64 (default 4); max_consumers: 1..1024 (default 64);
    close_timeout: seconds a leaving consumer's pipe may take to close.
    loop="thread" (the default) allows asend."""

    def __init__(self, mode="broadcast", *, slow="block", depth=4, max_consumers=64,
                 close_timeout=5.0, loop="thread"):
        from . import _loop_flag
        m = _choice("mode", mode, MODES)
        s = _choice("slow", slow, SLOW)
        if s == SLOW["drop_oldest"] and m != MODES["broadcast"]:
            raise ValueError("slow='drop_oldest' is for mode='broadcast' (distribute sends each "
                             "message to a consumer that is free)")
        _bounded("depth", depth, 1, 64)
        _bounded("max_consumers", max_consumers, 1, 1024)
        if close_timeout is None or close_timeout < 0:
            raise ValueError("close_timeout must be seconds, 0 or more")
        self._raw = _tdpipe.FanOut.new(m, s, depth, max_consumers,
                                       int(close_timeout * 1000 + 0.5), _loop_flag(loop))
        self.mode = mode
        self.slow = slow
        self.depth = depth
        self._cache = SchemaCache()
        self._loan_unpack = Unpacker()
        self._buf = None  # the gather buffer, reused while its schema holds and it is free
        self._buf_schema = None
        self._buf_free = True
        self._sop_pending = False
        self._watch = None  # (event loop, [waiting future]) while the fd is registered
        self.async_spin_us = None

    # -- consumers

    @property
    def port(self):
        """The port listen() bound (None before)."""
        return self._raw.port

    def connect(self, host, port, **opts):
        """Dial a consumer (a tdpipe.listen() that accepts) and add it; returns
        its id. Options as for tdpipe.connect() (plane, secret, ...)."""
        from . import _opts
        return self._raw.connect(host, int(port), _opts(opts))

    def listen(self, host="127.0.0.1", port=0, **opts):
        """Accept consumers on host:port (0: a free port); every pipe accepted
        joins. One listener per fan-out. Returns the port bound (also .port).
        Options as for tdpipe.listen()."""
        from . import _opts
        return self._raw.listen(host, int(port), _opts(opts))

    def remove(self, consumer):
        """Let a consumer leave cleanly: it gets no new message, sends what it
        holds, then its pipe closes (its peer's recv raises ClosedError)."""
        self._raw.remove(int(consumer))

    def wait_consumers(self, n, timeout=None):
        """Wait until at least n consumers are there (accepted ones join as
        their handshakes complete); TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 1e-3
        while self._raw.stats()["consumers"] < n:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("wait_consumers: %d of %d consumers after %gs (ETIMEDOUT)" % (
                    self._raw.stats()["consumers"], n, timeout))
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    # -- sending

    def _send_td(self, td):
        """The Td to send for td: a Consolidated (loan, consolidate(), a
        received Message) or leaves already in one buffer go as they are;
        separate leaves are gathered (one copy) into a buffer the fan-out
        reuses while the layout repeats and no send holds it."""
        raw_td = consolidated_check(td)
        if raw_td is not None:
            if raw_td.device != "cpu":
                _producer_done(raw_td.device)
            return raw_td
        cache = self._cache
        schema, addrs, keep, wrapped = cache.get_send(td)
        if wrapped is not None:
            if cache.fkey[0][3] is not None:
                _producer_done(cache.fkey[0][3])
            return wrapped
        if cache.key[3] is not None:
            _producer_done(cache.key[3])
        if self._buf_schema is not schema or not self._buf_free or self.slow != "block":
            # drop_oldest: a send returns while lagging consumers still read
            # the buffer, so every message gets a buffer of its own
            self._buf = _tdpipe.Td.alloc(schema)
            self._buf_schema = schema
        self._buf.fill(addrs)
        del keep
        return self._buf

    def send(self, td, timeout=None):
        """Send a nested mapping of tensors / arrays / scalars, or a
        Consolidated (a loan, consolidate(), a received Message) without a
        copy. Returns when every consumer it went to has sent it (the buffer
        may be written again); with slow="drop_oldest", once it is queued.
        Broadcast to no consumer returns at once (counted in stats()
        "unsent"); distribute waits for a consumer. TimeoutError after
        `timeout` seconds (the message still goes to the consumers that took
        it); ClosedError after close()."""
        raw_td = self._send_td(td)
        gathered = raw_td is self._buf
        if gathered:
            self._buf_free = False
        self._raw.send(raw_td, timeout)
        if gathered:
            self._buf_free = True

    def loan(self, like, timeout=None, as_="torch"):
        """A Consolidated laid out like `like` (a nested mapping, or a
        Schema) to fill in place and send once: with consumers on the shm
        plane (broadcast), a slot of the pool their links share, which send
        gives every one of them without a copy; else an ordinary buffer.
        When every slot is held by a consumer this waits, polling, up to
        `timeout` seconds (None: forever), then raises TimeoutError."""
        check_as(as_)
        schema = like if isinstance(like, _tdpipe.Schema) else self._cache.get(like)[0]
        td = loan_retry(self._raw, schema, timeout, "held by a consumer")
        return self._loan_unpack(td, as_, Consolidated)

    async def asend(self, td):
        """send() for asyncio (a fan-out with loop="thread"): waits briefly
        on the calling thread (as Pipe.asend), then on an eventfd the
        library's completion writes. Returns the message's fan-out sequence
        number (1 for the first). A cancelled asend's send still completes;
        the next asend waits for it first."""
        if self._sop_pending:
            try:
                await self._wait()
            finally:
                self._sop_pending = False
                self._buf_free = True
        raw_td = self._send_td(td)
        gathered = raw_td is self._buf
        self._buf_free = not gathered
        self._raw.start_send(raw_td)
        self._sop_pending = True
        spin = self.async_spin_us
        if spin is None:
            spin = min(_SPIN_MAX_US, _SPIN_BASE_US + raw_td.nbytes // 4096)
        seq = self._raw.settle(spin) if spin > 0 else self._raw.result()
        if seq is None:
            seq = await self._wait()
        self._sop_pending = False
        self._buf_free = True
        return seq

    async def _wait(self):
        r = self._raw.result()
        return r if r is not None else await self._wait_efd()

    # -- queries

    def stats(self):
        """The fan-out's figures (msgs, bytes, unsent, drops, joined, left,
        failed, refused, moved, consumers) and "peers": one dict per
        consumer there now (id, peer, plane, msgs_sent, bytes_sent, drops,
        first_seq, moved, queued, status, leaving)."""
        return self._raw.stats()

    def peers(self):
        """stats()["peers"]."""
        return self._raw.stats()["peers"]

    # -- ending

    def close(self, timeout=10.0):
        """Clean end: no new sends, every consumer gets what it was sent and
        its pipe closes (its recv raises ClosedError after the last
        message), the listener stops; then the fan-out is freed.
        TimeoutError if consumers are still there after `timeout` seconds
        (their pipes are then aborted)."""
        self._unwatch()
        try:
            self._raw.close(timeout)
        finally:
            self._raw.free()

    def free(self):
        """End every consumer's pipe now (they see PeerError) and free."""
        self._unwatch()
        self._raw.free()

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            self.close()
        else:
            self.free()
        return False

    async def __aenter__(self):
        return self

    async def __aexit__(self, et, ev, tb):
        if et is None:
            await asyncio.get_running_loop().run_in_executor(None, self.close)
        else:
            self.free()
        return False

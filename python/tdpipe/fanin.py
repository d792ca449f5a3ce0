"""Fan-in: many producers feed one consumer as one stream (the C
library's tdp_fanin; docs/python.md, "Fan-in").

    with tdpipe.FanIn("127.0.0.1", producers=4) as fan:   # fan.port: the bound port
        for item in fan:                                  # ends when the 4 have left
            train(item.data["obs"])                       # item.producer, item.seq

Producers are ordinary pipes: tdpipe.connect(host, fan.port).send(...).
"""

from . import _tdpipe
from ._convert import Unpacker, check_as
from ._watch import EfdWatch
from .errors import ClosedError

KINDS = ("msg", "join", "leave")


class Item:
    """One item of the stream. kind: "msg", "join" or "leave"; producer:
    its id (from 1, in the order producers joined); peer: its address;
    seq: a message's number in that producer's stream (1 for the first);
    data: a message's Message (views into the producer's receive buffer,
    lent until release(), the end of a `with` block or garbage); status: a
    leave's error code (_tdpipe.ECLOSED for a clean end, see `clean`)."""

    __slots__ = ("kind", "producer", "seq", "peer", "status", "data")

    def __init__(self, kind, producer, seq, peer, status, data):
        self.kind = kind
        self.producer = producer
        self.seq = seq
        self.peer = peer
        self.status = status
        self.data = data

    @property
    def clean(self):
        """A leave: the producer closed (rather than died or failed)."""
        return self.kind == "leave" and self.status == _tdpipe.ECLOSED

    def release(self):
        """Give a message's buffer back to its producer's pipe (a credit)."""
        if self.data is not None:
            self.data.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def __repr__(self):
        return "Item(%s, producer=%d, seq=%d, peer=%r%s)" % (
            self.kind, self.producer, self.seq, self.peer,
            ", status=%d" % self.status if self.kind == "leave" else "")


class FanIn(EfdWatch):
    """Accepts producers and delivers their messages as one stream, round
    robin over the producers with a message ready, each producer's in
    order. `producers=N`: stop accepting once N have left, so that
    iteration ends there. `events=True`: iteration also yields the join
    and leave items. Options as for listen() (depth: per producer, default
    4; secret, plane...), and max_producers, max_memory as for the C
    tdp_fanin_opts. loop="thread" (the default) allows arecv and `async
    for`."""

    def __init__(self, host="127.0.0.1", port=0, *, producers=None, events=False, as_="torch",
                 loop="thread", max_producers=0, max_memory=0, **opts):
        from . import _loop_flag, _opts
        check_as(as_)
        kw = _opts(opts)
        if "depth" not in kw and "recv_depth" not in kw:
            kw["depth"] = 4
        self._raw = _tdpipe.FanIn.listen(host, int(port), kw, _loop_flag(loop),
                                         int(max_producers), int(max_memory))
        self.as_ = as_
        self.expect = producers
        self.events = events
        self.left = 0
        self._unpack = {}  # producer id -> its Unpacker (each producer has its own schema)
        self._pending = False
        self._held = None  # an item whose leaves as_ could not give (_item)
        self._watch = None  # (event loop, [waiting future]) while the fd is registered

    @property
    def port(self):
        return self._raw.port

    def stats(self):
        return self._raw.stats()

    def _item(self, t):
        kind, producer, seq, peer, status, raw = t
        data = None
        if kind == 0:
            up = self._unpack.get(producer)
            if up is None:
                up = self._unpack[producer] = Unpacker()
            try:
                data = up(raw, self.as_)
            except (TypeError, ValueError, RuntimeError):
                # a dtype as_ cannot hold: the item stays the next one, for
                # a receive after as_ is changed (nothing is lost)
                self._held = t
                raise
        elif kind == 2:
            self._unpack.pop(producer, None)
            self.left += 1
            if self.expect is not None and self.left >= self.expect:
                self._raw.close()
        return Item(KINDS[kind], producer, seq, peer, status if kind == 2 else None, data)

    def recv(self, timeout=None):
        """The next item (of any kind). ClosedError once the stream is over
        (after close(), or after `producers` have left), TimeoutError after
        `timeout` seconds."""
        t, self._held = self._held, None
        return self._item(t if t is not None else self._raw.recv(timeout))

    def __iter__(self):
        while True:
            try:
                item = self.recv()
            except ClosedError:
                return
            if self.events or item.kind == "msg":
                yield item

    async def arecv(self):
        """recv() for asyncio: waits on an eventfd the library's completion
        writes (loop.add_reader). A cancelled arecv leaves its receive
        pending; the next arecv takes its item."""
        if self._held is not None:
            t, self._held = self._held, None
            return self._item(t)
        if not self._pending:
            self._raw.start_recv()
            self._pending = True
        try:
            r = self._raw.result()
        except BaseException:
            self._pending = False
            raise
        if r is None:
            r = await self._wait_efd()
        self._pending = False
        return self._item(r)

    def _efd_failed(self):
        self._pending = False  # the receive ended with the error arecv raises

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            try:
                item = await self.arecv()
            except ClosedError:
                raise StopAsyncIteration from None
            if self.events or item.kind == "msg":
                return item

    def close(self):
        """Stop accepting producers; once those connected have left, the
        stream ends (ClosedError, the end of iteration)."""
        self._raw.close()

    def free(self):
        """End every producer's pipe now and free the fan-in."""
        self._unwatch()
        self._raw.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()
        return False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.free()
        return False

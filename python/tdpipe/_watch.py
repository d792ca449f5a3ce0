"""What FanIn and FanOut share to wait on their operation's eventfd from
asyncio, and the loan retry Pipe and FanOut share."""
import asyncio
import time

from .errors import Error, TimeoutError


class EfdWatch:
    """Waits from asyncio for the completion of self._raw's one operation:
    its eventfd (self._raw.fileno()) is registered with the running event
    loop while a coroutine waits (self._watch: (event loop, [waiting
    future])), and self._raw.result() is None until the operation ends."""

    _watch = None

    async def _wait_efd(self):
        """The operation's result: from the future _ready completes; a
        cancelled wait leaves the operation pending."""
        loop = asyncio.get_running_loop()
        if self._watch is None or self._watch[0] is not loop:
            self._unwatch()
            self._watch = (loop, [None])
            loop.add_reader(self._raw.fileno(), self._ready)
        fut = loop.create_future()
        self._watch[1][0] = fut
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                self._efd_failed()
            raise
        finally:
            self._watch[1][0] = None

    def _efd_failed(self):
        """The operation ended with the error being raised (not a cancelled wait)."""

    def _ready(self):
        fut = self._watch[1][0] if self._watch is not None else None
        if fut is None or fut.done():
            self._raw.drain()
            return
        try:
            r = self._raw.result()
        except BaseException as e:  # the operation's error, raised in the coroutine
            fut.set_exception(e)
            return
        if r is not None:
            fut.set_result(r)

    def _unwatch(self):
        if self._watch is None:
            return
        loop, _ = self._watch
        self._watch = None
        if loop.is_closed():
            return
        if asyncio._get_running_loop() is loop or not loop.is_running():
            loop.remove_reader(self._raw.fileno())
        else:
            loop.call_soon_threadsafe(loop.remove_reader, self._raw.fileno())


def loan_retry(raw, schema, timeout, held):
    """raw.loan(schema), looked at again (20 us, doubling to 1 ms) while it
    raises EAGAIN, up to timeout seconds (None: forever); then TimeoutError
    naming what holds the slots."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 20e-6
    while True:
        try:
            return raw.loan(schema)
        except Error as e:
            if e.errname != "EAGAIN":
                raise
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("loan: every slot is %s (ETIMEDOUT)" % held)
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)

import asyncio
import threading

import numpy as np
import pytest
import torch

import tdpipe


@pytest.mark.parametrize("loop", ["thread", "caller"])
def test_async_for_and_asend(loop):
    async def main():
        lst = tdpipe.listen("127.0.0.1", loop=loop)
        tx = tdpipe.connect("127.0.0.1", lst.port, loop=loop)
        rx = lst.accept(timeout=10)

        async def produce():
            for i in range(20):
                await tx.asend({"i": torch.tensor([i]), "a": np.full(3, i)})
            tx.close(5)

        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        tk = asyncio.create_task(ticker())
        prod = asyncio.create_task(produce())
        got = []
        async for msg in rx:
            got.append(msg["i"].item())
        await asyncio.wait_for(prod, 10)
        tk.cancel()
        assert got == list(range(20))
        assert rx.loop == loop
        assert ticks > 0
        rx.close(5)
        lst.close()

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("loop", ["thread", "caller"])
def test_async_recv_timeout_and_cancel_then_resume(loop):
    async def main():
        lst = tdpipe.listen("127.0.0.1", loop=loop)
        tx = tdpipe.connect("127.0.0.1", lst.port, loop=loop)
        rx = lst.accept(timeout=10)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(rx.arecv(), 0.2)
        # the receive cancelled above is still pending; the next arecv takes it
        sender = threading.Timer(0.1, lambda: tx.send({"x": torch.ones(2)}, timeout=5))
        sender.start()
        msg = await asyncio.wait_for(rx.arecv(), 10)
        assert msg["x"].tolist() == [1.0, 1.0]
        msg.release()
        # the message can arrive before that thread's send has returned: a
        # pipe takes one blocking call at a time, so let it finish first
        await asyncio.get_running_loop().run_in_executor(None, sender.join, 10)
        tx.close(5)
        with pytest.raises(tdpipe.ClosedError):
            await asyncio.wait_for(rx.arecv(), 10)
        rx.close(5)
        lst.close()

    asyncio.run(asyncio.wait_for(main(), 30))

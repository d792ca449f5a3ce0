"""An asyncio producer and consumer: batches flow from one coroutine to
another through a tdpipe pipe, while the event loop keeps serving other
tasks (a ticker here). The consumer receives into a buffer it already has
(recv into a tensordict), so the steady state allocates nothing on either
side.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/async_pipeline.py [--batches N]

Across processes, run the two halves apart: the consumer's listener is the
`tdpipe.listen(...)` below, the producer's `tdpipe.aconnect(host, port)`.
"""
import argparse
import asyncio
import time

import torch

import tdpipe


async def produce(port, batches):
    # aconnect: the connect and handshake run off the event loop
    async with await tdpipe.aconnect("127.0.0.1", port) as pipe:
        batch = {"obs": torch.zeros(64, 84), "next": {"reward": torch.zeros(64)}, "env": "sim"}
        for i in range(batches):
            batch["obs"].normal_()
            batch["next"]["reward"].fill_(float(i))
            await pipe.asend(batch)  # gathered into a buffer the pipe reuses
        # leaving the block closes the pipe cleanly: the consumer's loop ends


async def consume(lst, batches):
    async with await lst.aaccept(timeout=30) as pipe:
        into = {"obs": torch.empty(64, 84), "next": {"reward": torch.empty(64)}, "env": None}
        total = 0.0
        n = 0
        while True:
            try:
                await pipe.arecv(into)  # written in place; the message is released at once
            except tdpipe.ClosedError:
                break
            total += float(into["next"]["reward"][0])
            n += 1
        return n, total


async def main(batches):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    tick = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    async with tdpipe.listen("127.0.0.1", 0, loop="thread") as lst:
        consumer = asyncio.create_task(consume(lst, batches))
        await produce(lst.port, batches)
        n, total = await consumer
    dt = time.perf_counter() - t0
    tick.cancel()
    assert n == batches and total == sum(range(batches)), (n, total)
    print("%d batches in %.3f s (%.0f batches/s); the event loop ticked %d times meanwhile"
          % (n, dt, n / dt, ticks))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=2000)
    asyncio.run(main(ap.parse_args().batches))

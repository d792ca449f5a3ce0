"""An asyncio inference client for infer_server.py: several requests in
flight from concurrent coroutines, each on its own pipe opened with
`async with await tdpipe.aconnect(...)`, replies read with tuple keys.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/async_infer_client.py --port P
    PYTHONPATH=build/python /usr/bin/python3 examples/python/async_infer_client.py --spawn-server
"""
import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time

import torch

import tdpipe


async def client(port, k, requests, rtts):
    async with await tdpipe.aconnect("127.0.0.1", port) as pipe:
        obs = torch.randn(8, 16)
        for i in range(requests):
            obs[0, 0] = float(i)
            t0 = time.perf_counter()
            await pipe.asend({"obs": obs})
            with await pipe.arecv() as reply:  # lent until the end of the block
                rtts.append(time.perf_counter() - t0)
                action = reply["action"].tolist()
                model = reply["model"]
        return k, action, model


async def main(port, clients, requests):
    rtts = []
    t0 = time.perf_counter()
    done = await asyncio.gather(*(client(port, k, requests, rtts) for k in range(clients)))
    dt = time.perf_counter() - t0
    for k, action, model in done:
        print("client %d: last reply %s from %s" % (k, action, model))
    rtts.sort()
    print("%d clients x %d requests in %.2f s: round trip p50 %.1f us, p99 %.1f us"
          % (clients, requests, dt, statistics.median(rtts) * 1e6,
             rtts[int(len(rtts) * 0.99) - 1] * 1e6))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--spawn-server", action="store_true")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=250)
    a = ap.parse_args()
    server = None
    if a.spawn_server:
        here = os.path.dirname(os.path.abspath(__file__))
        server = subprocess.Popen([sys.executable, os.path.join(here, "infer_server.py")],
                                  stdout=subprocess.PIPE, text=True)
        a.port = int(server.stdout.readline())
    if not a.port:
        ap.error("--port or --spawn-server")
    try:
        asyncio.run(main(a.port, a.clients, a.requests))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            print(server.stdout.read().strip())
            server.wait(30)

"""An inference client: sends requests, prints the replies' round-trip time.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/infer_client.py --port P
    PYTHONPATH=build/python /usr/bin/python3 examples/python/infer_client.py --spawn-server
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import torch

import tdpipe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--spawn-server", action="store_true")
    ap.add_argument("--requests", type=int, default=1000)
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
        rtts = []
        with tdpipe.connect("127.0.0.1", a.port) as pipe:
            obs = torch.randn(8, 16)
            for i in range(a.requests):
                obs[0, 0] = float(i)
                t0 = time.perf_counter()
                pipe.send({"obs": obs}, timeout=10)
                with pipe.recv(timeout=10) as reply:
                    rtts.append(time.perf_counter() - t0)
                    action = reply["action"]
            print("%d requests: reply %s from %s, round trip p50 %.1f us, p99 %.1f us"
                  % (a.requests, action.tolist(), reply["model"],
                     statistics.median(rtts) * 1e6,
                     sorted(rtts)[int(len(rtts) * 0.99) - 1] * 1e6))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            print(server.stdout.read().strip())
            server.wait(30)


if __name__ == "__main__":
    main()

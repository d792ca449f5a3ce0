"""The Python binding's cost next to `tdpipe bench`: one-way latency (half a
ping-pong) and throughput on loopback, producer and consumer in two
processes, depth 4, payload one uint8 tensor leaf.

    PYTHONPATH=build/python /usr/bin/python3 bench/python_bench.py [--sizes 1000,1000000]
"""
import argparse
import subprocess
import sys
import time

import torch

import tdpipe


def peer(port, size, rounds, msgs, loan):
    with tdpipe.connect("127.0.0.1", port, depth=4) as pipe:
        for _ in range(rounds):  # echo: the received buffer goes back as is
            msg = pipe.recv(timeout=30)
            pipe.send(msg, timeout=30)
            msg.release()
        x = torch.zeros(size, dtype=torch.uint8)
        for i in range(msgs):
            if loan:
                buf = pipe.loan({"x": x})
                pipe.send(buf, timeout=30)
            else:
                pipe.send({"x": x}, timeout=30)
        pipe.send({"end": torch.zeros(1)}, timeout=30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,1000000")
    ap.add_argument("--loan", action="store_true", help="producer sends loaned buffers")
    ap.add_argument("--peer", nargs=4, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer:
        peer(a.peer[0], a.peer[1], a.peer[2], a.peer[3], a.loan)
        return
    print("%10s %12s %12s %14s %12s" % ("size", "lat p50 us", "lat mean us", "msgs/s", "MB/s"))
    for size in map(int, a.sizes.split(",")):
        rounds = 2000 if size <= 100000 else 500
        msgs = 20000 if size <= 100000 else 2000
        with tdpipe.listen("127.0.0.1", depth=4) as lst:
            cmd = [sys.executable, __file__, "--peer", str(lst.port), str(size), str(rounds),
                   str(msgs)] + (["--loan"] if a.loan else [])
            child = subprocess.Popen(cmd)
            pipe = lst.accept(timeout=30)
            x = torch.zeros(size, dtype=torch.uint8)
            lat = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                pipe.send({"x": x}, timeout=30)
                with pipe.recv(timeout=30):
                    lat.append((time.perf_counter() - t0) / 2)
            lat = lat[rounds // 10:]  # warm-up
            n = 0
            for msg in pipe:
                if n == 0:
                    t0 = time.perf_counter()
                if "end" in msg:
                    break
                n += 1
                msg.release()
            dt = time.perf_counter() - t0
            child.wait(60)
            pipe.close(5)
        lat.sort()
        rate = (n - 1) / dt
        print("%10d %12.1f %12.1f %14.0f %12.1f" % (size, lat[len(lat) // 2] * 1e6,
                                                    sum(lat) / len(lat) * 1e6, rate,
                                                    rate * size / 1e6))


if __name__ == "__main__":
    main()

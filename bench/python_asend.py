"""Sync send against asyncio asend on a loop="thread" pipe (the asyncio
setup docs/python.md recommends): messages per second and the library's
allocations per message on the sending side, for three ways to send:

  send        pipe.send(dict)                   blocking, gathered (one copy)
  asend dict  await pipe.asend(dict)            gathered (one copy)
  asend cons  await pipe.asend(consolidated)    tdpipe.consolidate() once, sent as is

The payload is a plain dict {"obs": uint8[size], "next": {"reward": float32[8]}}.
The receiver is a second process (loop="caller", depth 4) that releases each
message at once. Each (size, way) runs for --seconds, --repeats times in turn;
the median rate is printed. Allocations come from tdpipe.mem_stats(): buffer
allocations ("host") and the library's small objects ("small"), counted over
the timed loop and divided by the messages sent.

    PYTHONPATH=build/python /usr/bin/python3 bench/python_asend.py [--sizes 1000,1000000,3000000]
"""
import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import torch

import tdpipe

WAYS = ("send", "asend dict", "asend cons")


def payload(size):
    return {"obs": torch.zeros(size, dtype=torch.uint8),
            "next": {"reward": torch.zeros(8, dtype=torch.float32)}}


def drain(port):
    with tdpipe.connect("127.0.0.1", port, depth=4) as pipe:
        for msg in pipe:
            msg.release()


def _allocs(s0, s1):
    return s1["host_allocs"] - s0["host_allocs"], s1["small_allocs"] - s0["small_allocs"]


def _sync(pipe, d, seconds):
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while True:
        for _ in range(16):
            pipe.send(d, timeout=30)
        n += 16
        if time.perf_counter() >= end:
            return n, time.perf_counter() - t0


async def _async(pipe, d, seconds):
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while True:
        for _ in range(16):
            await pipe.asend(d)
        n += 16
        if time.perf_counter() >= end:
            return n, time.perf_counter() - t0


def one(pipe, way, d, seconds):
    """(msgs/s, host allocs per msg, small allocs per msg) of one timed run."""
    if way == "asend cons":
        d = tdpipe.consolidate(d)
    # warm-up: the schema frame and the send buffer come now, not in the count
    if way == "send":
        _sync(pipe, d, 0.05)
    else:
        asyncio.run(_async(pipe, d, 0.05))
    s0 = tdpipe.mem_stats()
    if way == "send":
        n, dt = _sync(pipe, d, seconds)
    else:
        n, dt = asyncio.run(_async(pipe, d, seconds))
    host, small = _allocs(s0, tdpipe.mem_stats())
    return n / dt, host / n, small / n


def run(sizes, seconds=1.0, repeats=3):
    """[(size, way, median msgs/s, host allocs/msg, small allocs/msg, plane)]."""
    rows = []
    # one receiver process for every size (starting one, which imports
    # torch, takes seconds on a loaded machine)
    with tdpipe.listen("127.0.0.1", loop="thread") as lst:
        child = subprocess.Popen([sys.executable, __file__, "--drain", str(lst.port)])
        try:
            pipe = lst.accept(timeout=120)
            for size in sizes:
                d = payload(size)
                got = {w: [] for w in WAYS}
                for _ in range(repeats):
                    for w in WAYS:
                        got[w].append(one(pipe, w, d, seconds))
                for w in WAYS:
                    rate = statistics.median(r[0] for r in got[w])
                    rows.append((size, w, rate, max(r[1] for r in got[w]),
                                 max(r[2] for r in got[w]), pipe.plane))
            pipe.close(10)
            child.wait(60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
    return rows


def table(rows):
    out = ["%9s %-11s %12s %9s %11s %12s %6s" % ("size", "way", "msgs/s", "x send",
                                                 "host/msg", "small/msg", "plane")]
    base = {}
    for size, w, rate, host, small, plane in rows:
        if w == "send":
            base[size] = rate
        out.append("%9d %-11s %12.0f %9.2f %11.3f %12.3f %6s" %
                   (size, w, rate, rate / base[size], host, small, plane))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,1000000,3000000")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drain", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.drain:
        drain(a.drain)
        return
    print(table(run([int(s) for s in a.sizes.split(",")], a.seconds, a.repeats)))


if __name__ == "__main__":
    main()

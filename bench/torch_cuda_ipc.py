#!/usr/bin/env python3
"""PyTorch's own same-host GPU hand-off, the peer a user would pick instead of
tdpipe's cuda-ipc plane: a CUDA tensor put on a torch.multiprocessing.Queue
(torch shares its storage by CUDA IPC) and an 8-byte answer on a second queue.
One-way latency is half the round trip; the consumer reads one element of
each tensor back, so the bytes are visible end to end.

    python3 bench/torch_cuda_ipc.py [--sizes 1000,1000000,100000000]
                                    [--rounds 300] [--json FILE]

Needs torch with CUDA and a GPU; exits 3 (and says why) otherwise.
"""
import argparse
import json
import statistics
import sys
import time


def consumer(q, ack, rounds):
    import torch
    torch.cuda.init()
    for _ in range(rounds):
        t = q.get()
        ack.put(int(t[0].item()))  # a device read: the bytes are there
        del t


def one_size(mp, torch, size, rounds):
    ctx = mp.get_context("spawn")  # CUDA does not survive fork
    q, ack = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, ack, rounds))
    p.start()
    # four buffers in turn, as a pipe's depth-4 pool; values 1..250 mark each message
    pool = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    lat = []
    first_us = None
    for i in range(rounds):
        t = pool[i % 4]
        mark = i % 250 + 1
        t[0] = mark
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        q.put(t)
        got = ack.get(timeout=120)
        dt = (time.perf_counter() - t0) / 2 * 1e6
        if got != mark:
            raise SystemExit("torch_cuda_ipc: message %d: the consumer read %d, not %d" % (i, got, mark))
        if first_us is None:
            first_us = dt
        lat.append(dt)
    p.join(timeout=60)
    steady = lat[min(len(lat) - 1, max(4, rounds // 10)):]
    return {"bytes": size, "p50_us": statistics.median(steady),
            "mean_us": statistics.fmean(steady), "first_us": first_us}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,1000000,100000000")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--json")
    a = ap.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        print("torch_cuda_ipc: no torch here (%s)" % e, file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("torch_cuda_ipc: torch sees no GPU", file=sys.stderr)
        return 3
    sizes = [int(s) for s in a.sizes.split(",") if s]
    res = [one_size(mp, torch, s, a.rounds) for s in sizes]
    out = {"peer": "torch.multiprocessing.Queue (CUDA IPC)", "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "rounds": a.rounds, "results": res}
    for r in res:
        print("%-12d p50 %9.1f us  mean %9.1f us  first %9.1f us" %
              (r["bytes"], r["p50_us"], r["mean_us"], r["first_us"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

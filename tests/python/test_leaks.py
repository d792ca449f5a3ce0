import gc
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

import tdpipe

N = 10000


def rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.mark.parametrize("loop", ["caller", "thread"])
def test_no_leak_over_10000_messages(loop):
    payload = {"obs": torch.arange(256, dtype=torch.float32), "meta": {"id": np.arange(4)},
               "tag": "x"}
    sentinel = payload["obs"]
    with tdpipe.listen("127.0.0.1", depth=2, loop=loop) as lst:
        tx = tdpipe.connect("127.0.0.1", lst.port, loop=loop)
        rx = lst.accept(timeout=10)
        errors = []

        def produce():
            try:
                for _ in range(N):
                    tx.send(payload, timeout=10)
                tx.close(10)
            except Exception as e:  # reported by the main thread
                errors.append(e)

        def consume(n):
            got = 0
            for _ in range(n):
                msg = rx.recv(timeout=10)
                got += int(msg["obs"][1].item() == 1.0)
                msg.release()
            return got

        t = threading.Thread(target=produce)
        t0 = time.monotonic()
        t.start()
        consume(1000)  # warm-up: caches, allocator pools
        gc.collect()
        refs0 = sys.getrefcount(sentinel)
        rss0 = rss_kb()
        tracemalloc.start()
        snap0 = tracemalloc.take_snapshot()
        got = consume(N - 1000)
        gc.collect()
        snap1 = tracemalloc.take_snapshot()
        tracemalloc.stop()
        rss1 = rss_kb()
        t.join(30)
        elapsed = time.monotonic() - t0
        assert not errors
        assert got == N - 1000
        grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
        print("10000 msgs in %.2f s; python heap %+d B; RSS %d -> %d kB"
              % (elapsed, grown, rss0, rss1))
        assert grown < 64 * 1024
        assert rss1 - rss0 < 4 * 1024
        assert sys.getrefcount(sentinel) <= refs0  # the producer may hold one mid-send at refs0
        assert rx.stats()["msgs_recv"] == N
        assert rx.stats()["schemas_recv"] == 1
        rx.close(5)

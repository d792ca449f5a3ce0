"""tdpipe.FanOut: one producer, consumer processes — broadcast order, distribute,
a loan broadcast, asend, a consumer killed mid-stream, slow-consumer drops,
and bad arguments (the weights-broadcast example: test_examples.py)."""
import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import tdpipe

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def consumers():
    """Start fanout_consumer.py children; every one still running is killed at the end."""
    procs = []

    def start(how, port=0, sleep_ms=None):
        args = [sys.executable, os.path.join(HERE, "fanout_consumer.py"), how, str(port)]
        if sleep_ms is not None:
            args.append(str(sleep_ms))
        p = subprocess.Popen(args, stdout=subprocess.PIPE, env=os.environ.copy())
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def msg(k, n=1024):
    return {"k": torch.tensor([k]), "x": torch.full((n,), k % 251, dtype=torch.uint8)}


def result(p, timeout=120):
    """The consumer's JSON summary (its last line)."""
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out
    return json.loads(out.decode().strip().splitlines()[-1])


def test_fanout_broadcast_in_order(consumers):
    """Three consumers that dial the fan-out's listener each get all 200
    messages, in order, intact; the per-consumer figures say so."""
    with tdpipe.FanOut("broadcast") as fan:
        port = fan.listen("127.0.0.1")
        assert fan.port == port
        cs = [consumers("dial", port) for _ in range(3)]
        fan.wait_consumers(3, timeout=120)
        for k in range(200):
            fan.send(msg(k), timeout=60)
        st = fan.stats()
    assert st["msgs"] == 200 and st["unsent"] == 0 and st["joined"] == 3
    assert len(st["peers"]) == 3
    for p in st["peers"]:
        assert p["msgs_sent"] == 200 and p["drops"] == 0 and p["first_seq"] == 1
        assert p["bytes_sent"] == st["bytes"] >= 200 * (1024 + 8)
    for c in cs:
        r = result(c)
        assert r["ks"] == list(range(200)) and r["bad"] == 0 and r["end"] == "closed"


def test_fanout_distribute_spreads(consumers):
    """Distribute mode over three dialed consumers: every message goes to
    exactly one of them, each consumer's share in order, and slow
    consumers make the others take more."""
    cs = [consumers("listen", 0, sleep_ms=2) for _ in range(3)]
    ports = [int(c.stdout.readline()) for c in cs]
    fan = tdpipe.FanOut("distribute", depth=2)
    try:
        ids = [fan.connect("127.0.0.1", p, connect_timeout=60) for p in ports]
        assert len(set(ids)) == 3 and 0 not in ids
        for k in range(150):
            fan.send(msg(k), timeout=60)
        peers = {p["id"]: p["msgs_sent"] for p in fan.peers()}
        fan.close(20)
    finally:
        fan.free()
    assert sum(peers.values()) == 150
    got = []
    for c in cs:
        ks = result(c)["ks"]
        assert ks == sorted(ks) and len(ks) > 0, ks
        got += ks
    assert sorted(got) == list(range(150))


def test_fanout_loan_broadcast(consumers):
    """Loaned buffers broadcast to two consumers on the shm plane: filled in
    place, sent once, every consumer sees every one."""
    fan = tdpipe.FanOut("broadcast")
    try:
        port = fan.listen("127.0.0.1", plane="shm")
        cs = [consumers("dial", port) for _ in range(2)]
        fan.wait_consumers(2, timeout=120)
        like = msg(0, 1 << 16)
        for k in range(60):
            buf = fan.loan(like, timeout=60)
            assert isinstance(buf, tdpipe.Consolidated)
            buf["k"][0] = k
            buf["x"].fill_(k % 251)
            fan.send(buf, timeout=60)
        planes = {p["plane"] for p in fan.peers()}
        fan.close(20)
    finally:
        fan.free()
    assert planes == {"shm"}
    for c in cs:
        r = result(c)
        assert r["ks"] == list(range(60)) and r["bad"] == 0 and r["plane"] == "shm"


def test_fanout_asend(consumers):
    """asend from a coroutine: the sequence numbers count up, both consumers get everything."""
    async def run(fan):
        seqs = []
        for k in range(100):
            seqs.append(await fan.asend(msg(k)))
        return seqs

    async def main():
        async with tdpipe.FanOut("broadcast") as fan:
            port = fan.listen("127.0.0.1")
            cs = [consumers("dial", port) for _ in range(2)]
            await asyncio.get_running_loop().run_in_executor(None, fan.wait_consumers, 2, 20)
            seqs = await asyncio.wait_for(run(fan), 60)
        return seqs, cs

    seqs, cs = asyncio.run(main())
    assert seqs == list(range(1, 101))
    for c in cs:
        assert result(c)["ks"] == list(range(100))


def test_fanout_consumer_killed(consumers):
    """One of four consumers killed mid-stream: the fan-out counts it failed,
    the other three receive every message, in order."""
    fan = tdpipe.FanOut("broadcast")
    try:
        port = fan.listen("127.0.0.1")
        good = [consumers("dial", port) for _ in range(3)]
        slow = consumers("dial", port, sleep_ms=5)
        fan.wait_consumers(4, timeout=120)
        killed = False
        for k in range(300):
            fan.send(msg(k), timeout=120)
            if k == 40:
                while slow.stdout.readline().strip() != b"got 10":
                    pass
                slow.kill()
                killed = True
        assert killed
        deadline = time.monotonic() + 10
        while fan.stats()["failed"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = fan.stats()
        fan.close(20)
    finally:
        fan.free()
    assert st["failed"] == 1 and st["consumers"] == 3 and st["msgs"] == 300
    for c in good:
        assert result(c)["ks"] == list(range(300))


def test_fanout_drop_oldest(consumers):
    """slow='drop_oldest': a stalled consumer loses messages (counted), the
    fast one gets all of them in order, and the stalled one what it got
    is still in order."""
    # the stalled consumer's receive window lets up to 64 small messages be
    # in flight to it, 200 ms each: its close may take 13 s
    fan = tdpipe.FanOut("broadcast", slow="drop_oldest", depth=2, close_timeout=60)
    try:
        port = fan.listen("127.0.0.1")
        fast = consumers("dial", port)
        fan.wait_consumers(1, timeout=120)
        stall = consumers("dial", port, sleep_ms=200)
        fan.wait_consumers(2, timeout=120)
        for k in range(100):
            fan.send(msg(k), timeout=120)
        drops = {p["id"]: p["drops"] for p in fan.peers()}
        fan.close(30)
    finally:
        fan.free()
    assert result(fast)["ks"] == list(range(100))
    ks = result(stall, 120)["ks"]
    assert ks == sorted(ks) and len(ks) < 100
    assert sorted(drops.values())[0] == 0 and sorted(drops.values())[1] >= 100 - len(ks) - 4


def test_fanout_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        tdpipe.FanOut("everyone")
    with pytest.raises(ValueError, match="slow"):
        tdpipe.FanOut(slow="never")
    with pytest.raises(ValueError, match="depth"):
        tdpipe.FanOut(depth=0)
    with pytest.raises(ValueError, match="depth"):
        tdpipe.FanOut(depth=65)
    with pytest.raises(ValueError, match="max_consumers"):
        tdpipe.FanOut(max_consumers=0)
    with pytest.raises(ValueError, match="drop_oldest"):
        tdpipe.FanOut("distribute", slow="drop_oldest")
    with tdpipe.FanOut() as fan:
        with pytest.raises(TypeError, match="unknown option"):
            fan.connect("127.0.0.1", 1, colour="red")
        with pytest.raises(ValueError, match="port"):
            fan.connect("127.0.0.1", 0)
        with pytest.raises(tdpipe.Error):
            fan.connect("127.0.0.1", 1, connect_timeout=2)  # nobody listens there
        fan.listen("127.0.0.1")
        with pytest.raises(tdpipe.Error, match="EINVAL"):
            fan.listen("127.0.0.1")  # one listener per fan-out
        with pytest.raises(tdpipe.Error, match="EINVAL"):
            fan.remove(12345)
        with pytest.raises(tdpipe.SchemaError):
            fan.send({"a.b": torch.zeros(2)})
        # broadcast to nobody completes, counted unsent
        fan.send(msg(0))
        assert fan.stats()["unsent"] == 1
    with pytest.raises(tdpipe.Error):
        fan.send(msg(1))  # freed by the with block


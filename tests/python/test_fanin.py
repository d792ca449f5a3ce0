"""tdpipe.FanIn: many producers, one stream — iteration, asyncio, a producer
killed mid-stream, the DataLoader example with worker processes."""
import asyncio
import os
import subprocess
import sys
import threading

import torch

import tdpipe
from tdpipe import _tdpipe

EX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python")


def produce(port, tag, count):
    p = tdpipe.connect("127.0.0.1", port, connect_timeout=10)
    for k in range(count):
        p.send({"x": torch.full((256,), float(tag)), "k": torch.tensor([k])}, timeout=10)
    p.close()


def check(items, producers, count):
    """Every producer's messages, in order (seq and payload), between its join and leave."""
    by = {}
    for it in items:
        s = by.setdefault(it.producer, {"join": 0, "msgs": [], "leave": None})
        if it.kind == "join":
            s["join"] += 1
        elif it.kind == "msg":
            assert s["join"] == 1 and s["leave"] is None
            s["msgs"].append((it.seq, it.k, it.tag))
        else:
            s["leave"] = it.status
    assert len(by) == producers
    tags = set()
    for s in by.values():
        assert s["join"] == 1 and s["leave"] == _tdpipe.ECLOSED
        assert [m[0] for m in s["msgs"]] == list(range(1, count + 1))
        assert [m[1] for m in s["msgs"]] == list(range(count))
        assert len({m[2] for m in s["msgs"]}) == 1
        tags.add(s["msgs"][0][2])
    assert len(tags) == producers


class Rec:
    __slots__ = ("kind", "producer", "seq", "status", "k", "tag")

    def __init__(self, it):
        self.kind, self.producer, self.seq, self.status = it.kind, it.producer, it.seq, it.status
        self.k = self.tag = None
        if it.kind == "msg":
            self.k, self.tag = int(it.data["k"][0]), float(it.data["x"][0])
            it.release()


def test_fanin_iterate():
    with tdpipe.FanIn("127.0.0.1", producers=3, events=True) as fan:
        ts = [threading.Thread(target=produce, args=(fan.port, i, 100)) for i in range(3)]
        for t in ts:
            t.start()
        items = [Rec(it) for it in fan]  # ends once the three have left
        for t in ts:
            t.join(20)
        check(items, 3, 100)
        st = fan.stats()
        assert st["msgs"] == 300 and st["producers_total"] == 3 and st["producers_failed"] == 0


def test_fanin_only_messages_and_timeout():
    with tdpipe.FanIn("127.0.0.1", producers=1) as fan:
        try:
            fan.recv(timeout=0.05)
            raise AssertionError("nothing was sent")
        except tdpipe.TimeoutError:
            pass
        t = threading.Thread(target=produce, args=(fan.port, 5, 20))
        t.start()
        kinds = [Rec(it).kind for it in fan]
        t.join(20)
        assert kinds == ["msg"] * 20


def test_fanin_async_for():
    async def run(fan):
        loop = asyncio.get_running_loop()
        ts = [loop.run_in_executor(None, produce, fan.port, i, 80) for i in range(2)]
        items = []
        async for it in fan:
            items.append(Rec(it))
        await asyncio.gather(*ts)
        return items

    with tdpipe.FanIn("127.0.0.1", producers=2, events=True) as fan:
        items = asyncio.run(asyncio.wait_for(run(fan), 60))
    check(items, 2, 80)


def test_fanin_killed_producer(peer):
    """A producer process killed mid-stream is a leave with an error; the others go on."""
    fan = tdpipe.FanIn("127.0.0.1", producers=3, events=True)
    try:
        hang = peer("hang", fan.port)
        assert hang.stdout.readline().strip() == b"sent"
        good = [peer("torch", fan.port, 50) for _ in range(2)]
        seen, killed = {}, False
        for it in fan:
            s = seen.setdefault(it.producer, {"msgs": 0, "leave": None})
            if it.kind == "msg":
                assert it.seq == s["msgs"] + 1
                s["msgs"] += 1
                it.release()
                if not killed and sum(x["msgs"] for x in seen.values()) >= 20:
                    hang.kill()
                    killed = True
            elif it.kind == "leave":
                s["leave"] = it.status
        for g in good:
            assert g.wait(20) == 0
        leaves = sorted((s["msgs"], s["leave"]) for s in seen.values())
        assert leaves[0][0] == 1 and leaves[0][1] not in (0, _tdpipe.ECLOSED)  # the killed one
        assert leaves[1:] == [(50, _tdpipe.ECLOSED), (50, _tdpipe.ECLOSED)]
        assert fan.stats()["producers_failed"] == 1
    finally:
        fan.free()


def test_fanin_dataloader_example():
    r = subprocess.run([sys.executable, os.path.join(EX, "fanin_loader.py"), "--workers", "3",
                        "--batches-per-worker", "20"],
                       capture_output=True, text=True, timeout=180, env=os.environ.copy())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 workers, 60 steps" in r.stdout, r.stdout


_INTERRUPT = r"""
import os, signal, sys, threading, time, torch, tdpipe
with tdpipe.FanIn("127.0.0.1", events=True) as fan:
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        fan.recv()
        print("returned")
    except KeyboardInterrupt:
        print("interrupted after %.2f s" % (time.monotonic() - t0))
    # nothing was lost: a producer that comes now is the stream's first item
    p = tdpipe.connect("127.0.0.1", fan.port, connect_timeout=10)
    p.send({"x": torch.arange(3)}, timeout=10)
    p.close()
    kinds = []
    while len(kinds) < 3:
        it = fan.recv(timeout=10)
        kinds.append(it.kind)
        if it.kind == "msg":
            assert it.data["x"].tolist() == [0, 1, 2]
            it.release()
    assert kinds == ["join", "msg", "leave"], kinds
print("usable")
"""


def test_blocking_recv_without_timeout_is_interrupted_by_ctrl_c():
    """fan.recv() with no timeout (`for item in fan`, a trainer waiting for
    its workers) ends with KeyboardInterrupt at Ctrl-C and takes nothing:
    the fan-in goes on."""
    r = subprocess.run([sys.executable, "-c", _INTERRUPT], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "interrupted after" in r.stdout, r.stdout + r.stderr
    assert "usable" in r.stdout


def test_item_as_cannot_hold_stays_next():
    """A leaf the fan-in's as_ cannot give (bfloat16 as NumPy): a TypeError
    naming it, and the item is the next one after as_ is changed; a typo in
    as_ is refused before anything listens."""
    import pytest
    with pytest.raises(ValueError, match="as_ must be"):
        tdpipe.FanIn("127.0.0.1", as_="jax")
    with tdpipe.FanIn("127.0.0.1", producers=1, as_="numpy") as fan:
        p = tdpipe.connect("127.0.0.1", fan.port, connect_timeout=10)
        p.send({"b": torch.full((2,), 2.5, dtype=torch.bfloat16)}, timeout=10)
        p.send({"b": torch.full((2,), 3.5, dtype=torch.bfloat16)}, timeout=10)
        p.close()
        with pytest.raises(TypeError, match=r"'b' is bfloat16.*as_='torch'"):
            assert fan.recv(timeout=10).kind == "join"
            fan.recv(timeout=10)
        fan.as_ = "torch"
        got = []
        for it in fan:
            got.append((it.seq, it.data["b"].tolist()))
            it.release()
        assert got == [(1, [2.5, 2.5]), (2, [3.5, 3.5])]

"""What tensordict's TensorDictPipe users reach for: recv into an existing
tensordict, the receive device, tuple keys and batch_size, async with and
async connect/accept, key order, and the errors of what this side sends."""
import asyncio
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import tdpipe


@pytest.fixture
def pair():
    """(tx, rx) connected on loopback, loop="thread"; both closed at the end."""
    lst = tdpipe.listen("127.0.0.1", loop="thread")
    tx = tdpipe.connect("127.0.0.1", lst.port, loop="thread")
    rx = lst.accept(timeout=10)
    lst.close()
    yield tx, rx
    tx.abort()
    rx.abort()


class FakeTD(dict):
    """Duck-typed like a tensordict.TensorDict (a mapping with batch_size)."""

    def __init__(self, d, batch_size):
        super().__init__(d)
        self.batch_size = torch.Size(batch_size)


# ---- keys and the errors of what this side sends --------------------------------


@pytest.mark.parametrize("bad,key", [
    ({"a.b": torch.ones(1)}, "'a.b'"),
    ({"x": {"a.b": torch.ones(1)}}, "'a.b' under 'x'"),
    ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, "'a.b'"),
    ({"v.w": 3}, "'v.w'"),
])
def test_dotted_key_refused_at_send_naming_key(pair, bad, key):
    tx, rx = pair
    with pytest.raises(tdpipe.SchemaError) as ei:
        tx.send(bad, timeout=5)
    assert isinstance(ei.value, ValueError) and not isinstance(ei.value, tdpipe.ProtocolError)
    assert key in str(ei.value) and "'.'" in str(ei.value)
    assert ei.value.errname == "ESCHEMA"
    # nothing went out and the pipe is usable
    tx.send({"ok": torch.arange(3)}, timeout=5)
    with rx.recv(timeout=5) as m:
        assert m["ok"].tolist() == [0, 1, 2] and m.seq == 1


def test_empty_key_refused(pair):
    tx, _rx = pair
    with pytest.raises(tdpipe.SchemaError, match="empty key under 'n'"):
        tx.send({"n": {"": torch.ones(1)}}, timeout=5)
    with pytest.raises(tdpipe.SchemaError, match="empty key"):
        tx.send({"": 1}, timeout=5)


def test_reserved_subdict_name_is_schema_error(pair):
    tx, _rx = pair
    with pytest.raises(tdpipe.SchemaError, match=r"sub-dict key 'x\.cls' collides with a reserved"):
        tx.send({"x": {"cls": {"y": torch.ones(1)}}}, timeout=5)


def test_long_string_value_names_key_and_limit(pair):
    tx, rx = pair
    with pytest.raises(tdpipe.SchemaError) as ei:
        tx.send({"meta": {"text": "x" * 5000}, "t": torch.ones(1)}, timeout=5)
    assert "'meta.text'" in str(ei.value) and "limit 4096" in str(ei.value)
    tx.send({"meta": {"text": "x" * 4000}, "t": torch.ones(1)}, timeout=5)
    with rx.recv(timeout=5) as m:
        assert m["meta", "text"] == "x" * 4000


def test_every_key_roundtrips_or_is_refused(pair):
    """Keys a Python dict can hold: sent exactly or refused with SchemaError."""
    tx, rx = pair
    keys = ["plain", "with space", "ünï", "a-b", "x" * 255, "x" * 256, "a.b", "", "tab\there",
            "cls", "leaves"]
    for k in keys:
        try:
            tx.send({k: torch.tensor([1])}, timeout=5)
        except tdpipe.SchemaError:
            assert k in ("x" * 256, "a.b", "", "tab\there")
            continue
        with rx.recv(timeout=5) as m:
            assert list(m.keys()) == [k], k


def test_key_order_is_not_part_of_the_schema(pair):
    tx, rx = pair
    a = {"x": torch.ones(2), "y": {"p": torch.zeros(3), "q": 1}}
    b = {"y": {"q": 1, "p": torch.zeros(3)}, "x": torch.ones(2)}
    tx.send(a, timeout=5)
    rx.recv(timeout=5).release()
    h0 = tdpipe.mem_stats()["host_allocs"]
    orders = set()
    for i in range(6):
        tx.send(a if i % 2 else b, timeout=5)
        with rx.recv(timeout=5) as m:
            assert m["x"].tolist() == [1.0, 1.0] and m["y", "q"] == 1
            orders.add((tuple(m), tuple(m["y"])))
    assert len(orders) == 1  # one layout, whatever order the sender's dict had
    assert tx.stats()["schemas_sent"] == 1
    assert rx.stats()["schemas_recv"] == 1
    assert tdpipe.mem_stats()["host_allocs"] == h0  # no new send or receive buffer


# ---- received messages ------------------------------------------------------------


def test_tuple_keys_and_batch_size(pair):
    tx, rx = pair
    tx.send(FakeTD({"obs": torch.ones(4, 3), "info": {"reward": torch.arange(4)}}, [4]),
            timeout=5)
    with rx.recv(timeout=5) as m:
        assert m["info", "reward"].tolist() == [0, 1, 2, 3]
        assert m[("obs",)].shape == (4, 3)
        assert ("info", "reward") in m and ("info", "nope") not in m
        assert m.get(("info", "nope"), 7) == 7
        with pytest.raises(KeyError):
            m["info", "nope"]
        assert m.batch_size == torch.Size([4])
    tx.send({"x": torch.ones(1)}, timeout=5)
    with rx.recv(timeout=5) as m:
        assert m.batch_size == torch.Size([])


def test_recv_into_existing_tensordict(pair):
    tx, rx = pair
    dst = {"obs": torch.zeros(4, 3), "next": {"reward": torch.zeros(4, dtype=torch.int64),
                                              "done": torch.zeros(4, dtype=torch.bool)},
           "tag": ""}
    keep = (dst["obs"].data_ptr(), dst["next"]["reward"].data_ptr())
    for i in range(3):
        tx.send({"obs": torch.full((4, 3), float(i)), "next": {
            "reward": torch.arange(4) + i, "done": torch.tensor([True, False] * 2)},
            "tag": "t%d" % i}, timeout=5)
        got = rx.recv(dst, timeout=5)
        assert got is dst
        assert dst["obs"].eq(float(i)).all() and dst["next"]["reward"].tolist() == [
            i, i + 1, i + 2, i + 3]
        assert dst["next"]["done"].tolist() == [True, False, True, False]
        assert dst["tag"] == "t%d" % i
    assert (dst["obs"].data_ptr(), dst["next"]["reward"].data_ptr()) == keep
    # numpy destination, timeout as keyword
    nd = {"a": np.zeros(3, dtype=np.float32)}
    tx.send({"a": np.arange(3, dtype=np.float32)}, timeout=5)
    assert rx.recv(nd, timeout=5) is nd and nd["a"].tolist() == [0.0, 1.0, 2.0]
    # at depth 1 the message was released: the sender is not stuck on credit
    tx.send({"a": np.ones(3, dtype=np.float32)}, timeout=2)
    assert rx.recv(nd, timeout=5)["a"].tolist() == [1.0, 1.0, 1.0]


def test_recv_into_mismatch_names_the_key(pair):
    tx, rx = pair
    tx.send({"a": torch.ones(3), "b": torch.ones(2)}, timeout=5)
    with pytest.raises(ValueError, match=r"leaf 'a' is torch.float32 \(4,\) there"):
        rx.recv({"a": torch.zeros(4), "b": torch.zeros(2)}, timeout=5)
    tx.send({"a": torch.ones(3), "b": torch.ones(2)}, timeout=5)
    with pytest.raises(ValueError, match="no leaf 'b'"):
        rx.recv({"a": torch.zeros(3)}, timeout=5)


def test_recv_positional_timeout_still_works(pair):
    _tx, rx = pair
    t0 = time.monotonic()
    with pytest.raises(tdpipe.TimeoutError):
        rx.recv(0.2)
    assert time.monotonic() - t0 < 5


def test_recv_device(pair):
    tx, rx = pair
    tx.send({"a": torch.ones(2)}, timeout=5)
    with rx.recv(timeout=5, device="cpu") as m:
        assert m["a"].device.type == "cpu"
    tx.send({"a": torch.ones(2)}, timeout=5)
    with rx.recv(timeout=5, device=torch.device("cpu")) as m:
        assert m["a"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
        rx.recv(timeout=5, device="gpu0")
    if tdpipe.cuda_device_count() > 0:
        return  # GPU receives: test_gpu.py
    # no device: refused before anything is received
    for dev in ("cuda", "cuda:0", torch.device("cuda", 0)):
        with pytest.raises(ValueError, match="no CUDA device 0"):
            rx.recv(timeout=5, device=dev)
    with pytest.raises(ValueError, match="no CUDA device 0"):
        asyncio.run(rx.arecv(device="cuda:0"))
    tx.send({"a": torch.ones(2)}, timeout=5)
    with rx.recv(timeout=5) as m:
        assert m["a"].tolist() == [1.0, 1.0]


# ---- asyncio ----------------------------------------------------------------------


def test_async_with_aconnect_aaccept_and_arecv_into():
    async def main():
        async with tdpipe.listen("127.0.0.1", loop="thread") as lst:
            acc = asyncio.create_task(lst.aaccept(timeout=10))
            async with await tdpipe.aconnect("127.0.0.1", lst.port) as tx:
                assert tx.loop == "thread"
                async with await acc as rx:
                    dst = {"x": torch.zeros(3)}
                    for i in range(5):
                        await tx.asend({"x": torch.full((3,), float(i))})
                        got = await rx.arecv(dst)
                        assert got is dst and dst["x"].tolist() == [float(i)] * 3
                    await tx.aclose()
                    with pytest.raises(tdpipe.ClosedError):
                        await rx.arecv()
        return True

    assert asyncio.run(asyncio.wait_for(main(), 30))


def test_async_with_aborts_on_exception():
    async def main():
        lst = tdpipe.listen("127.0.0.1", loop="thread")
        tx = await tdpipe.aconnect("127.0.0.1", lst.port)
        rx = await lst.aaccept(timeout=10)
        with pytest.raises(RuntimeError):
            async with tx:
                raise RuntimeError("boom")
        with pytest.raises(tdpipe.PeerError):
            await asyncio.wait_for(rx.arecv(), 10)
        rx.abort()
        lst.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_asend_plain_dict_allocates_nothing_in_steady_state(pair):
    tx, rx = pair

    async def main():
        d = {"obs": torch.zeros(300000, dtype=torch.uint8), "r": {"x": torch.ones(8)}}
        for _ in range(3):
            await tx.asend(d)
            (await rx.arecv()).release()
        s0 = tdpipe.mem_stats()
        for i in range(40):
            d["r"]["x"].fill_(float(i))
            await tx.asend(d)
            with await rx.arecv() as m:
                assert m["r", "x"][0].item() == float(i)
        return s0, tdpipe.mem_stats()

    s0, s1 = asyncio.run(asyncio.wait_for(main(), 30))
    # process-wide counters: pipes of earlier tests may still be freeing
    # their buffers on the loop thread, so frees and live bytes can move
    assert s1["host_allocs"] == s0["host_allocs"]


def test_cancelled_asend_completes_before_the_next(pair):
    tx, rx = pair

    async def main():
        d = {"x": torch.ones(4)}
        await tx.asend(d)  # fills the receiver's only buffer (depth 1)
        t = asyncio.ensure_future(tx.asend({"x": torch.full((4,), 2.0)}))
        await asyncio.sleep(0.1)
        t.cancel()  # its send waits for credit and still goes
        m1 = await rx.arecv()
        assert m1["x"].tolist() == [1.0] * 4
        nxt = asyncio.ensure_future(tx.asend({"x": torch.full((4,), 3.0)}))
        m2 = await rx.arecv()  # releases m1: the cancelled send's message arrives
        assert m2["x"].tolist() == [2.0] * 4
        m3 = await rx.arecv()
        assert m3["x"].tolist() == [3.0] * 4
        await asyncio.wait_for(nxt, 10)

    asyncio.run(asyncio.wait_for(main(), 30))


# ---- server --------------------------------------------------------------------


def test_server_on_close_gets_the_exception():
    got = []
    with tdpipe.Server("127.0.0.1", 0, lambda r: None,
                       on_close=lambda cid, e: got.append(e)) as srv:
        p = tdpipe.connect("127.0.0.1", srv.port)
        p.send({"x": torch.ones(1)}, timeout=5)
        p.close(5)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(got) == 1 and isinstance(got[0], tdpipe.ClosedError)
    assert got[0].errname == "ECLOSED" and got[0].code == -6


@pytest.mark.parametrize("loop", ["caller", "thread"])
def test_server_sees_in_process_clients_go_at_once(loop):
    with tdpipe.Server("127.0.0.1", 0, lambda r: {"y": r["x"] * 2}) as srv:
        clients = [tdpipe.connect("127.0.0.1", srv.port, loop=loop) for _ in range(3)]
        for p in clients:
            p.send({"x": torch.ones(2)}, timeout=5)
            p.recv(timeout=5).release()
        for p in clients:
            p.close(5)
        deadline = time.monotonic() + 2
        while srv.stats()["clients_now"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.stats()["clients_now"] == 0
        t0 = time.monotonic()
        srv.shutdown(5)
        assert time.monotonic() - t0 < 1.0


def test_server_handler_may_take_the_client_id():
    """A serve(on_connect) coroutine keeps per-client state in its frame; a
    Server handler keys it by the client id instead."""
    counts = {}

    def handler(req, client_id):
        counts[client_id] = counts.get(client_id, 0) + 1
        return {"n": torch.tensor([counts[client_id]]), "who": client_id}

    with tdpipe.Server("127.0.0.1", 0, handler, on_close=lambda cid, e: counts.pop(cid)) as srv:
        a = tdpipe.connect("127.0.0.1", srv.port)
        b = tdpipe.connect("127.0.0.1", srv.port)
        for i in range(3):
            for p in (a, b):
                p.send({"x": torch.ones(1)}, timeout=5)
                with p.recv(timeout=5) as r:
                    assert r["n"].item() == i + 1
        ids = set()
        for p in (a, b):
            p.send({"x": torch.ones(1)}, timeout=5)
            with p.recv(timeout=5) as r:
                ids.add(r["who"])
        assert len(ids) == 2
        a.close(5)
        b.close(5)
        srv.shutdown(5)
    assert counts == {}


def test_async_for_over_listener_ends_at_close():
    async def main():
        lst = tdpipe.listen("127.0.0.1", loop="thread")
        got = []

        async def serve():
            async for pipe in lst:
                got.append(pipe)

        task = asyncio.create_task(serve())
        for _ in range(2):
            p = await tdpipe.aconnect("127.0.0.1", lst.port)
            p.send({"x": torch.ones(1)}, timeout=5)
            p.close(5)
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        lst.close()
        await asyncio.wait_for(task, 5)  # the iteration ends
        assert time.monotonic() - t0 < 2
        assert len(got) == 2
        for p in got:
            with p.recv(timeout=5) as m:
                assert m["x"].tolist() == [1.0]
            p.abort()
        with pytest.raises(tdpipe.CanceledError):
            await lst.aaccept(timeout=1)

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("spin", [0, None, 5000])
def test_asend_spin_bound_and_event_loop_path(pair, spin):
    """asend's short wait on the calling thread is bounded (async_spin_us;
    0: the event loop's wait alone) and every setting delivers in order."""
    tx, rx = pair
    tx.async_spin_us = spin

    async def main():
        t0 = time.monotonic()
        for i in range(30):
            await tx.asend({"i": torch.tensor([i]), "x": torch.zeros(100000)})
            with await rx.arecv() as m:
                assert m["i"].item() == i
        # a send that cannot complete (the receiver holds its only buffer)
        # is waited for on the event loop once the bound has passed
        await tx.asend({"i": torch.tensor([99]), "x": torch.zeros(100000)})
        held = await rx.arecv()
        t1 = time.monotonic()
        task = asyncio.ensure_future(tx.asend({"i": torch.tensor([100]),
                                               "x": torch.zeros(100000)}))
        await asyncio.sleep(0)  # the asend runs until it waits
        blocked = time.monotonic() - t1
        assert not task.done()
        held.release()
        await asyncio.wait_for(task, 10)
        with await rx.arecv() as m:
            assert m["i"].item() == 100
        return blocked, time.monotonic() - t0

    blocked, _total = asyncio.run(asyncio.wait_for(main(), 30))
    bound = 1e-3 if spin is None else spin * 1e-6
    # the bound plus scheduling slack: on 2 cores at load 20 a thread waited 1 s for a
    # CPU; a wait for the credit itself would never end (the release comes after)
    assert blocked < bound + 2.0


# ---- what a new user tries: odd keys, values and leaves ----------------------------


def _same(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(np.ascontiguousarray(a))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    return type(a) is type(b) and a == b


def _clone(m):
    if isinstance(m, dict):
        return {k: _clone(v) for k, v in m.items()}
    return m.clone() if isinstance(m, torch.Tensor) else m


@pytest.mark.parametrize("name,d", [
    ("unicode, '/', space and quote keys", {"ünï€😀": torch.ones(2), "a/b": torch.ones(1),
                                            "a b": {"c\"d\\e": torch.zeros(3)}}),
    ("255-byte key", {"é" * 127 + "x": torch.ones(1)}),
    ("nested empty dicts", {"a": {}, "b": {"c": {}}, "t": torch.ones(1)}),
    ("only an empty dict", {}),
    ("0-d tensors", {"f": torch.tensor(3.5), "i": torch.tensor(-7)}),
    ("non-contiguous", {"t": torch.arange(12.).reshape(3, 4).t(), "s": torch.arange(9)[::2],
                        "e": torch.ones(1, 3).expand(4, 3), "n": np.arange(5)[::-1]}),
    ("bool, bfloat16, float16", {"b": torch.tensor([True, False, True]),
                                 "bf": torch.arange(5, dtype=torch.bfloat16) / 3,
                                 "h": torch.arange(5, dtype=torch.float16) / 3}),
    ("complex", {"c": torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64),
                 "z": torch.tensor([1e300 + 1j], dtype=torch.complex128),
                 "n": np.array([1 - 1j], dtype=np.complex64)}),
    ("empty tensor", {"x": torch.zeros(0, 3)}),
    ("values", {"s": "a\nb\t😀", "i": -2**63, "j": 2**63 - 1, "f": -0.0, "t": 5e-324,
                "b": True, "n": None}),
])
def test_odd_but_valid_messages_roundtrip_exactly(pair, name, d):
    tx, rx = pair
    tx.send(d, timeout=5)
    with rx.recv(timeout=5) as m:
        got = _clone(m)
    assert _same(d, got), name
    if name == "bool, bfloat16, float16":
        assert got["b"].dtype == torch.bool and got["bf"].dtype == torch.bfloat16


@pytest.mark.parametrize("d,exc,text", [
    ({1: torch.ones(1)}, TypeError, r"key 1 is of type int: tdpipe keys are str"),
    ({"a": {("b", "c"): torch.ones(1)}}, TypeError,
     r"key \('b', 'c'\) under 'a' is of type tuple"),
    ({"a": {None: 1, "b": 2}}, TypeError, r"key None under 'a' is of type NoneType"),
    ({"a\ud800": torch.ones(1)}, tdpipe.SchemaError, r"key 'a\\ud800' is not valid Unicode"),
    ({"k\n": torch.ones(1)}, tdpipe.SchemaError, r"key 'k\\n' contains a control character"),
    ({"x" * 256: torch.ones(1)}, tdpipe.SchemaError, r"is 256 bytes, limit 255"),
    ({"n": {"v": float("nan")}}, tdpipe.SchemaError, r"value 'n.v' is nan, which JSON"),
    ({"v": float("-inf")}, tdpipe.SchemaError, r"value 'v' is -inf"),
    ({"v": 2**63}, tdpipe.SchemaError, r"value 'v' is an int outside int64"),
    ({"v": "a\0b"}, tdpipe.SchemaError, r"value 'v' contains a NUL character"),
    ({"v": "\udc80"}, tdpipe.SchemaError, r"value 'v' is not valid Unicode"),
    ({"v": "é" * 1000}, tdpipe.SchemaError, r"value 'v' is 6002 bytes encoded, limit 4096"),
    ({"n": {"l": [1, 2]}}, TypeError, r"leaf 'n.l': leaf of type list"),
    ({"s": torch.eye(3).to_sparse()}, TypeError, r"leaf 's': a sparse_coo tensor"),
    ({"o": np.array([1, "a"], dtype=object)}, TypeError, r"leaf 'o'.*dtype object"),
    ({"r": torch.zeros([1] * 17)}, tdpipe.SchemaError, r"leaf 'r': rank 17 over the limit 16"),
])
def test_hostile_message_refused_naming_key_and_rule(pair, d, exc, text):
    tx, rx = pair
    with pytest.raises(exc, match=text) as ei:
        tx.send(d, timeout=5)
    if exc is tdpipe.SchemaError:
        assert isinstance(ei.value, ValueError) and ei.value.errname == "ESCHEMA"
    # nothing went out, the pipe goes on
    tx.send({"ok": torch.tensor([1])}, timeout=5)
    with rx.recv(timeout=5) as m:
        assert list(m) == ["ok"] and m.seq == 1


def test_recv_into_refuses_what_would_go_stale_and_non_mappings(pair):
    tx, rx = pair
    msg = {"a": torch.ones(3), "n": {"b": torch.arange(2)}, "s": "x"}
    # a key the message lacks: refused before anything is written
    dst = {"a": torch.zeros(3), "n": {"b": torch.zeros(2, dtype=torch.int64),
                                      "z": torch.zeros(1)}, "s": ""}
    tx.send(msg, timeout=5)
    with pytest.raises(ValueError, match=r"it has a key 'n.z', which the message lacks"):
        rx.recv(dst, timeout=5)
    assert dst["a"].tolist() == [0.0] * 3 and dst["s"] == ""
    # not a mapping: refused before a message is taken
    tx.send(msg, timeout=5)
    for bad in (torch.zeros(3), [1, 2], "td"):
        with pytest.raises(TypeError, match="recv\\(td\\): td is a tensordict or a nested"):
            rx.recv(bad, timeout=5)
        with pytest.raises(TypeError, match="recv\\(td\\)"):
            asyncio.run(rx.arecv(bad))
    # a read-only array names its key
    ro = np.zeros(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"leaf 'a': .*read-only"):
        rx.recv({"a": ro, "n": {"b": np.zeros(2, np.int64)}, "s": ""}, timeout=5)
    # a leaf that requires grad (a parameter being synced) takes the data
    tx.send(msg, timeout=5)
    p = {"a": torch.zeros(3, requires_grad=True), "n": {"b": torch.zeros(2, dtype=torch.int64)},
         "s": ""}
    assert rx.recv(p, timeout=5) is p
    assert p["a"].tolist() == [1.0] * 3 and p["a"].requires_grad and p["a"].grad_fn is None
    assert p["n"]["b"].tolist() == [0, 1] and p["s"] == "x"


def test_async_calls_after_close_raise_and_never_hang():
    async def main():
        lst = tdpipe.listen("127.0.0.1", loop="thread")
        tx = await tdpipe.aconnect("127.0.0.1", lst.port)
        rx = await lst.aaccept(timeout=10)
        lst.close()
        await tx.asend({"x": torch.ones(1)})
        await tx.aclose()
        with pytest.raises(tdpipe.CanceledError):
            await asyncio.wait_for(tx.asend({"x": torch.ones(1)}), 5)
        with pytest.raises(tdpipe.CanceledError):
            await asyncio.wait_for(tx.arecv(), 5)
        with await asyncio.wait_for(rx.arecv(), 5) as m:
            assert m["x"].tolist() == [1.0]
        for _ in range(2):
            with pytest.raises(tdpipe.ClosedError):
                await asyncio.wait_for(rx.arecv(), 5)
        rx.close()
        with pytest.raises(tdpipe.CanceledError):
            await asyncio.wait_for(rx.arecv(), 5)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_cancelled_arecvs_lose_nothing_and_close_at_once(pair):
    tx, rx = pair

    async def main():
        for _ in range(2):  # cancelled while waiting, twice
            t = asyncio.ensure_future(rx.arecv())
            await asyncio.sleep(0.02)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
        for _ in range(10):  # timed out at once, many times
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(rx.arecv(), 0.001)
        await tx.asend({"x": torch.full((2,), 5.0)})
        with await asyncio.wait_for(rx.arecv(), 5) as m:
            assert m["x"].tolist() == [5.0, 5.0] and m.seq == 1
        t = asyncio.ensure_future(rx.arecv())
        await asyncio.sleep(0.02)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        t0 = time.monotonic()
        rx.close(5)  # a pending receive does not hold up the close
        assert time.monotonic() - t0 < 2
        with pytest.raises(tdpipe.ClosedError):
            await asyncio.wait_for(tx.arecv(), 5)

    asyncio.run(asyncio.wait_for(main(), 30))


# ---- across hosts (docs/python.md, "Across hosts"), as far as one host shows it ------

_ACROSS = r"""
import os, socket, sys, torch, tdpipe
assert os.environ["UCX_NET_DEVICES"] == "lo"
hosts = ["127.0.0.1"]
try:
    s = socket.socket(socket.AF_INET6)
    s.bind(("::1", 0))
    s.close()
    hosts.append("::1")
except OSError:
    pass
with tdpipe.listen(None, 0, loop="thread", plane="ucx") as lst:  # every address
    for h in hosts:
        tx = tdpipe.connect(h, lst.port, plane="ucx")
        rx = lst.accept(timeout=20)
        assert tx.plane == rx.plane == "ucx", (tx.plane, rx.plane)
        tx.send({"x": torch.arange(5), "h": h}, timeout=10)
        with rx.recv(timeout=10) as m:
            assert m["x"].tolist() == list(range(5)) and m["h"] == h
        tx.close(5)
        rx.abort()
if "::1" in hosts:  # a listener on one address is reached there only
    with tdpipe.listen("127.0.0.1", 0, loop="thread") as lst:
        try:
            tdpipe.connect("::1", lst.port, connect_timeout=5)
            raise AssertionError("::1 reached a listener bound to 127.0.0.1")
        except tdpipe.RefusedError:
            pass
print("across:", " ".join(hosts))
"""


def test_every_address_listener_with_ucx_net_devices_in_a_fresh_process():
    """listen(None) binds every address (reached here by 127.0.0.1 and ::1),
    the ucx plane (the one used between hosts) carries the message, and
    UCX_NET_DEVICES set before the process's first pipe is taken."""
    env = dict(os.environ, UCX_NET_DEVICES="lo")
    r = subprocess.run([sys.executable, "-c", _ACROSS], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "across: 127.0.0.1" in r.stdout


def test_large_asend_gathers_into_pool_slots_and_held_messages_stay_intact():
    """On shm an asend of a dict of 64 KB or more is gathered straight into a
    loaned pool slot (not into the pipe's own gather buffer); messages
    the receiver holds keep their contents while later asends go, and an
    asend with every slot held waits for a release."""
    async def main():
        lst = tdpipe.listen("127.0.0.1", loop="thread", depth=3)
        tx = await tdpipe.aconnect("127.0.0.1", lst.port, plane="shm")
        rx = await lst.aaccept(timeout=10)
        lst.close()
        assert tx.plane == "shm"
        d = {"obs": torch.zeros(200000, dtype=torch.uint8), "i": {"x": torch.zeros(4)}}
        # loans wait for the peer's shared-memory connection to be proven
        # (an asend before that takes the pipe's buffer): one loan first
        tx.loan(d, timeout=10)  # dropped at once: the slot goes back to the pool
        held = []
        for i in range(3):
            d["obs"].fill_(i + 1)
            d["i"]["x"].fill_(float(i))
            await tx.asend(d)
            held.append(await asyncio.wait_for(rx.arecv(), 10))
        assert tx._aloans == 3  # every one went through a loaned slot
        d["obs"].fill_(9)
        late = asyncio.ensure_future(tx.asend(d))  # every receive buffer is held
        await asyncio.sleep(0.2)
        assert not late.done()  # no credit: it waits
        for i, m in enumerate(held):
            assert m["i", "x"].tolist() == [float(i)] * 4
            assert int(m["obs"].min()) == int(m["obs"].max()) == i + 1
        held.pop(0).release()
        await asyncio.wait_for(late, 10)
        with await asyncio.wait_for(rx.arecv(), 10) as m:
            assert int(m["obs"].min()) == int(m["obs"].max()) == 9
        for m in held:
            m.release()
        # small messages take the pipe's buffer (a loan each costs more)
        n = tx._aloans
        await tx.asend({"s": torch.ones(16)})
        assert tx._aloans == n
        with await asyncio.wait_for(rx.arecv(), 10) as m:
            assert m["s"].tolist() == [1.0] * 16
        tx.abort()
        rx.abort()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_lazy_conjugate_and_negative_views_send_their_values(pair):
    """x.conj() and x.conj().imag are lazy views (torch's conj and neg bits):
    their memory holds the values before the conjugation or negation.
    What arrives is what the tensor reads as, on send and consolidate."""
    tx, rx = pair
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    d = {"conj": z.conj(), "neg": z.conj().imag, "plain": torch.ones(2)}
    assert d["conj"].is_conj() and d["neg"].is_neg()
    want = {k: v.resolve_conj().resolve_neg().clone() for k, v in d.items()}
    tx.send(d, timeout=10)
    with rx.recv(timeout=10) as m:
        for k in want:
            assert torch.equal(m[k], want[k]), (k, m[k], want[k])
    c = tdpipe.consolidate(d)
    for k in want:
        assert torch.equal(c[k], want[k]), (k, c[k], want[k])
    tx.send(c, timeout=10)
    with rx.recv(timeout=10) as m:
        assert torch.equal(m["conj"], want["conj"]) and torch.equal(m["neg"], want["neg"])

"""GPU cases on the fake CUDA device, without torch's CUDA:
python gpu_fake.py CASE PLANE, run by test_gpu.py with TDPIPE_CUDA=fake.

The fake's device memory is a PROT_NONE mapping: a host read or write of a
received or sent device buffer kills this process with SIGSEGV, so a case
that exits 0 has kept its hands off device memory. Bytes are compared
through copies to the host made by the library (DLPackArray.tobytes,
Td.read, recv(device="cpu")).
"""
import asyncio
import faulthandler
import subprocess
import sys
import threading
import time

import numpy as np

try:
    import torch
except ImportError:
    torch = None

import tdpipe
from tdpipe import _tdpipe
from tdpipe._convert import Consolidated, Plan, build_schema, flatten, unpack

T = 10  # seconds, every blocking call


def pair(plane, tx_opts=None, rx_opts=None, loop="caller"):
    if plane == "cuda-ipc":
        # offered only by pipes that name their GPU
        tx_opts = dict({"cuda_device": 0}, **(tx_opts or {}))
        rx_opts = dict({"cuda_device": 0}, **(rx_opts or {}))
    lst = tdpipe.listen("127.0.0.1", loop=loop, plane=plane, **(rx_opts or {}))
    got = {}
    th = threading.Thread(target=lambda: got.setdefault("rx", lst.accept(timeout=T)))
    th.start()
    tx = tdpipe.connect("127.0.0.1", lst.port, loop=loop, plane=plane, connect_timeout=T,
                        **(tx_opts or {}))
    th.join(T)
    lst.close()
    assert tx.plane == plane, tx.plane
    return tx, got["rx"]


def payload(seed):
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((16, 33)).astype(np.float32),
            "next": {"reward": rng.integers(-9, 9, 7), "done": rng.random(5) < 0.5},
            "tag": "step %d" % seed}


def device_td(src, device="cuda:0"):
    """A device buffer laid out as src, filled by the library's copies."""
    _key, nodes, tensors, values, addrs, keep = flatten(src)
    td = _tdpipe.Td.alloc(build_schema(nodes, tensors, values, device))
    td.fill(addrs)
    del keep
    assert td.device == device
    return td


def device_like(src, device="cuda:0"):
    """A layout on `device` to loan by: DLPackArray leaves of a device
    buffer (what a torch CUDA dict gives where torch has CUDA)."""
    td = device_td(src, device)
    return unpack(td, Plan(td.schema), "dlpack", Consolidated)


def check_bytes(msg, src):
    """Every tensor leaf of a dlpack message equals src's, byte for byte."""
    assert msg["obs"].tobytes() == src["obs"].tobytes()
    assert msg["next", "reward"].tobytes() == src["next"]["reward"].tobytes()
    assert msg["next", "done"].tobytes() == src["next"]["done"].tobytes()
    assert msg["tag"] == src["tag"]


def check_host(msg, src):
    """A message received onto the host (torch tensors) equals src."""
    assert msg["obs"].device.type == "cpu"
    assert np.array_equal(msg["obs"].numpy(), src["obs"])
    assert np.array_equal(msg["next"]["reward"].numpy(), src["next"]["reward"])
    assert np.array_equal(msg["next"]["done"].numpy(), src["next"]["done"])
    assert msg["tag"] == src["tag"]


def case_recv_dlpack(plane):
    """A GPU message: kDLCUDA leaves on device 0, the receive buffer's own
    addresses, and NumPy refused with a clear error."""
    tx, rx = pair(plane)
    src = payload(1)
    tx._raw.send_td(device_td(src), T)
    with rx.recv(timeout=T, as_="dlpack") as m:
        assert m.schema.device == "cuda:0"
        for leaf in (m["obs"], m["next", "reward"], m["next", "done"]):
            assert leaf.__dlpack_device__() == (2, 0), leaf.__dlpack_device__()
            assert leaf.device == "cuda:0"
            assert m.buffer_address <= leaf.data_ptr < m.buffer_address + m.buffer_nbytes
        assert m["obs"].shape == (16, 33) and m["obs"].dtype == "torch.float32"
        cai = m["obs"].__cuda_array_interface__
        assert cai["data"][0] == m["obs"].data_ptr and cai["typestr"] == "<f4"
        check_bytes(m, src)
    tx._raw.send_td(device_td(src), T)
    try:
        rx.recv(timeout=T, as_="numpy")
        raise AssertionError("numpy took a GPU message")
    except ValueError as e:
        assert "NumPy arrays live in host memory" in str(e), e
    tx.close(T)
    rx.close(T)


def case_recv_to_host(plane):
    """recv(device="cpu") of a GPU message: host torch tensors, equal."""
    tx, rx = pair(plane)
    for i in range(3):
        src = payload(10 + i)
        tx._raw.send_td(device_td(src), T)
        with rx.recv(timeout=T, device="cpu") as m:
            check_host(m, src)
    tx.close(T)
    rx.close(T)


def case_override(plane):
    """The receive-device override both ways (recv_device), and
    recv(device="cuda:0") of a host message (a copy)."""
    tx, rx = pair(plane, rx_opts={"recv_device": "cuda:0"})
    src = payload(20)
    tx.send(src, timeout=T)  # numpy leaves: a host message
    with rx.recv(timeout=T, as_="dlpack") as m:
        assert m["obs"].__dlpack_device__() == (2, 0)
        check_bytes(m, src)
    tx.close(T)
    rx.close(T)

    tx, rx = pair(plane, rx_opts={"recv_device": "cpu"})
    src = payload(21)
    tx._raw.send_td(device_td(src), T)
    with rx.recv(timeout=T) as m:  # torch, on the host: no copy in Python
        assert m.schema.device == "cpu"
        check_host(m, src)
    tx.close(T)
    rx.close(T)

    tx, rx = pair(plane)
    src = payload(22)
    tx.send(src, timeout=T)
    with rx.recv(timeout=T, device="cuda:0", as_="dlpack") as m:
        assert m["next", "done"].__dlpack_device__() == (2, 0)
        check_bytes(m, src)
    tx.close(T)
    rx.close(T)


def case_send_device_leaves(plane):
    """Device leaves (received ones, forwarded) are gathered into the pipe's
    device buffer by the library and arrive byte-exact; a steady stream of
    one layout allocates nothing per message."""
    a, b = pair(plane)
    c, d = pair(plane)
    src = payload(30)
    a._raw.send_td(device_td(src), T)
    m = b.recv(timeout=T, as_="dlpack")
    fwd = {"obs": m["obs"], "next": {"reward": m["next", "reward"], "done": m["next", "done"]},
           "tag": m["tag"]}
    base = None
    for i in range(40):
        c.send(fwd, timeout=T)
        with d.recv(timeout=T, as_="dlpack") as got:
            if i == 0:
                check_bytes(got, src)
        if i == 9:
            base = tdpipe.mem_stats()["total_allocs"]
    grown = tdpipe.mem_stats()["total_allocs"] - base
    assert grown == 0, "%d allocations over 30 steady messages" % grown
    assert c._dbuf is not None and c._dbuf.device == "cuda:0"
    c.send(fwd, timeout=T)
    with d.recv(timeout=T, device="cpu") as got:
        check_host(got, src)
    # leaves on two devices: one message is one buffer
    try:
        c.send({"a": m["obs"], "b": src["obs"]}, timeout=T)
        raise AssertionError("mixed devices sent")
    except ValueError as e:
        assert "cpu: 'b'" in str(e) and "cuda:0: 'a'" in str(e), e
    m.release()
    for p in (a, b, c, d):
        p.close(T)


def case_consolidated(plane):
    """consolidate() of device leaves gives a buffer on the device that is
    sent as it is: no gather buffer is made."""
    a, b = pair(plane)
    c, d = pair(plane)
    src = payload(40)
    a._raw.send_td(device_td(src), T)
    with b.recv(timeout=T, as_="dlpack") as m:
        cons = tdpipe.consolidate({"obs": m["obs"], "next": {"reward": m["next", "reward"],
                                   "done": m["next", "done"]}, "tag": m["tag"]}, as_="dlpack")
    assert cons._td.device == "cuda:0"
    c.send(cons, timeout=T)
    assert c._dbuf is None
    with d.recv(timeout=T, as_="dlpack") as got:
        check_bytes(got, src)
    for p in (a, b, c, d):
        p.close(T)


def case_loan(plane, gpu=0):
    """pipe.loan() of a GPU layout: a device buffer of kDLCUDA leaves on
    device `gpu`, filled (here by the library's copies: host code cannot write
    the fake's device memory), sent and received byte-exact, with nothing
    allocated per message on cuda-ipc. There the loan is a slot of the
    sender's device pool and the receiver's views are that very slot (zero
    copy: one process shares the pool's pointer)."""
    opts = {"cuda_device": gpu} if plane == "cuda-ipc" else {}
    tx, rx = pair(plane, opts, opts)
    like = device_like(payload(60), "cuda:%d" % gpu)
    if torch is not None and not torch.cuda.is_available():
        try:
            tx.loan(like, timeout=T)  # as_="torch", the pipe's
            raise AssertionError("a GPU loan became torch tensors without CUDA")
        except RuntimeError as e:
            assert "as_='dlpack'" in str(e), e
    slots = set()
    base = None
    for i in range(40):
        ln = tx.loan(like, timeout=T, as_="dlpack")
        assert ln._td.device == "cuda:%d" % gpu, ln._td.device
        start, end = ln.buffer_address, ln.buffer_address + ln.buffer_nbytes
        ptrs = []
        for leaf in (ln["obs"], ln["next", "reward"], ln["next", "done"]):
            assert leaf.__dlpack_device__() == (2, gpu), leaf.__dlpack_device__()
            assert start <= leaf.data_ptr and leaf.data_ptr + leaf.nbytes <= end
            ptrs.append(leaf.data_ptr)
        src = payload(61 + i)
        _key, _nodes, _tensors, _values, addrs, keep = flatten(src)
        ln._td.fill(addrs)
        del keep
        tx.send(ln, timeout=T)
        with rx.recv(timeout=T, as_="dlpack") as m:
            assert m.schema.device == "cuda:%d" % gpu, m.schema.device
            assert m["obs"].__dlpack_device__() == (2, gpu)
            got = [m["obs"].data_ptr, m["next", "reward"].data_ptr, m["next", "done"].data_ptr]
            if plane == "cuda-ipc":
                assert m.buffer_address == start, (hex(m.buffer_address), hex(start))
                assert got == ptrs, (got, ptrs)
            if i < 3:
                check_bytes(m, dict(src, tag=like["tag"]))  # values are the layout's
        slots.add(start)
        if i == 9:
            base = tdpipe.mem_stats()["total_allocs"]
    if plane == "cuda-ipc":
        # the pool's slots (depth 1: 1 + 2), lent in turn, nothing allocated;
        # shm and ucx lend a new device buffer per GPU loan instead
        grown = tdpipe.mem_stats()["total_allocs"] - base
        assert grown == 0, "%d allocations over 30 steady loans" % grown
        assert 1 <= len(slots) <= 3, slots
    tx.close(T)
    rx.close(T)


def case_loan_gpu1(plane):
    """case_loan on the second GPU (TDPIPE_CUDA=fake:2), both pipes naming
    it: the loan and the message carry device index 1."""
    assert tdpipe.cuda_device_count() >= 2, "run with TDPIPE_CUDA=fake:2"
    case_loan(plane, 1)


def produce_loans(port, n):
    """The child of case_child: connect naming GPU 0, send n loans filled
    with payload(70 + i), then wait to be killed."""
    tx = tdpipe.connect("127.0.0.1", int(port), plane="cuda-ipc", cuda_device=0,
                        connect_timeout=T)
    like = device_like(payload(70))
    for i in range(int(n)):
        ln = tx.loan(like, timeout=T, as_="dlpack")
        _key, _nodes, _tensors, _values, addrs, keep = flatten(payload(70 + i))
        ln._td.fill(addrs)
        tx.send(ln, timeout=T)
    print("sent", flush=True)
    time.sleep(60)


def case_child(plane):
    """Loans from a producer process: the receiver imports the pool and its
    kDLCUDA leaves arrive byte-exact, with no buffer allocated per message;
    the producer killed while a message is held leaves it readable, and the
    next receive fails instead of waiting."""
    assert plane == "cuda-ipc"
    n = 30
    lst = tdpipe.listen("127.0.0.1", plane=plane, cuda_device=0, depth=2)
    child = subprocess.Popen([sys.executable, __file__, "produce_loans", str(lst.port), str(n)],
                             stdout=subprocess.PIPE)
    try:
        rx = lst.accept(timeout=T)
        lst.close()
        assert rx.plane == "cuda-ipc", rx.plane
        held, base = None, None
        for i in range(n):
            m = rx.recv(timeout=T, as_="dlpack")
            assert m["obs"].__dlpack_device__() == (2, 0)
            assert m.buffer_address <= m["obs"].data_ptr < m.buffer_address + m.buffer_nbytes
            if i < 3 or i == n - 1:
                check_bytes(m, dict(payload(70 + i), tag="step 70"))
            if i == 9:
                base = _buffers()
            if i < n - 1:
                m.release()
            else:
                held = m
        assert _buffers() == base, "%d buffers over 20 messages" % (_buffers() - base)
        assert child.stdout.readline() == b"sent\n"
        child.kill()
        child.wait(T)
        check_bytes(held, dict(payload(70 + n - 1), tag="step 70"))  # still readable
        try:
            rx.recv(timeout=T)
            raise AssertionError("a receive from a killed producer returned")
        except tdpipe.PeerError:
            pass
        held.release()
        rx.abort()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(T)


def _buffers():
    """Allocations of every memory kind, device included; not small objects."""
    s = tdpipe.mem_stats()
    return s["total_allocs"] - s["small_allocs"]


def case_async(plane):
    """asend of device leaves and arecv(device="cpu") on loop="thread" pipes."""
    a, b = pair(plane, loop="thread")
    src = payload(50)
    a._raw.send_td(device_td(src), T)
    m = b.recv(timeout=T, as_="dlpack")
    fwd = {"obs": m["obs"], "next": {"reward": m["next", "reward"], "done": m["next", "done"]},
           "tag": m["tag"]}

    async def main():
        for _ in range(3):
            await asyncio.wait_for(b.asend(fwd), T)
            got = await asyncio.wait_for(a.arecv(device="cpu"), T)
            check_host(got, src)
            got.release()

    asyncio.run(main())
    m.release()
    a.close(T)
    b.close(T)


if __name__ == "__main__":
    # a case that hangs prints where every thread is, and ends (a hang of
    # async-ucx on a 16-core GPU machine left nothing to read)
    faulthandler.dump_traceback_later(60, exit=True)
    assert tdpipe.cuda_device_count() >= 1, "run with TDPIPE_CUDA=fake"
    if sys.argv[1] == "produce_loans":
        produce_loans(*sys.argv[2:])
        sys.exit(0)
    globals()["case_" + sys.argv[1]](sys.argv[2])
    print("ok", flush=True)

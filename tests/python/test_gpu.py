"""GPU tensors in the Python binding (docs/python.md, "GPU tensors").

Two sets:
- on the fake CUDA device (TDPIPE_CUDA=fake, docs/gpu.md), in a child
  process per case (the backend is chosen once per process), without
  torch's CUDA: gpu_fake.py;
- on a real GPU with torch CUDA, in this process: skipped, with the reason,
  where torch has no CUDA or the library sees no device.
"""
import os
import subprocess
import sys
import threading

import pytest
import torch

import tdpipe

HERE = os.path.dirname(os.path.abspath(__file__))
T = 10

FAKE_CASES = ["recv_dlpack", "recv_to_host", "override", "send_device_leaves", "consolidated",
              "loan", "async"]


def _run_fake(case, plane, devices="fake"):
    """gpu_fake.py CASE PLANE in a child process on the fake device."""
    env = dict(os.environ, TDPIPE_CUDA=devices, TDPIPE_FAKE_CUDA_DELAY_US="50")
    r = subprocess.run([sys.executable, os.path.join(HERE, "gpu_fake.py"), case, plane],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    out = r.stdout.decode(errors="replace")
    # -11: a host read or write of fake device memory (SIGSEGV)
    assert r.returncode == 0 and out.rstrip().endswith("ok"), "rc %d\n%s" % (r.returncode, out)


@pytest.mark.parametrize("plane", ["shm", "ucx", "cuda-ipc"])
@pytest.mark.parametrize("case", FAKE_CASES)
def test_fake_device(case, plane):
    _run_fake(case, plane)


@pytest.mark.parametrize("plane", ["shm", "cuda-ipc"])
def test_fake_loan_second_device(plane):
    """A GPU loan on device 1 of two (TDPIPE_CUDA=fake:2) keeps its index."""
    _run_fake("loan_gpu1", plane, "fake:2")


def test_fake_loans_from_a_process():
    """cuda-ipc loans from a producer process (the pool imported, not
    shared), and that producer killed while a message is held."""
    _run_fake("child", "cuda-ipc")


def _real_gpu():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here (the fake-device cases cover the binding)")
    if os.environ.get("TDPIPE_CUDA", "").startswith("fake"):
        pytest.skip("the library runs on the fake device: torch's CUDA memory is not its")
    if tdpipe.cuda_device_count() < 1:
        pytest.skip("tdpipe's CUDA layer sees no device (%s)" %
                    os.environ.get("TDPIPE_CUDA", "driver backend"))


@pytest.fixture
def gpu_pair():
    _real_gpu()
    made = []

    def make(plane="auto", **rx_opts):
        tx_opts = {}
        if plane == "cuda-ipc":  # offered only by pipes that name their GPU
            tx_opts["cuda_device"] = 0
            rx_opts.setdefault("cuda_device", 0)
        with tdpipe.listen("127.0.0.1", plane=plane, **rx_opts) as lst:
            got = {}
            th = threading.Thread(target=lambda: got.setdefault("rx", lst.accept(timeout=T)))
            th.start()
            tx = tdpipe.connect("127.0.0.1", lst.port, plane=plane, connect_timeout=T,
                                **tx_opts)
            th.join(T)
        assert plane == "auto" or tx.plane == plane, tx.plane
        made.extend([tx, got["rx"]])
        return tx, got["rx"]

    yield make
    for p in made:
        p.abort()


def _batch(i, device="cuda:0"):
    g = torch.Generator().manual_seed(i)
    return {"obs": torch.randn(64, 129, generator=g).to(device),
            "next": {"reward": torch.arange(17, device=device) * i,
                     "done": (torch.arange(9, device=device) % 2) == 0},
            "tag": "t%d" % i}


def _same(m, src, values=True):
    assert torch.equal(m["obs"].cpu(), src["obs"].cpu())
    assert torch.equal(m["next"]["reward"].cpu(), src["next"]["reward"].cpu())
    assert torch.equal(m["next"]["done"].cpu(), src["next"]["done"].cpu())
    assert not values or m["tag"] == src["tag"]


@pytest.mark.parametrize("plane", ["shm", "ucx", "cuda-ipc"])
def test_gpu_round_trip(gpu_pair, plane):
    tx, rx = gpu_pair(plane)
    for i in range(5):
        src = _batch(i)
        tx.send(src, timeout=T)
        with rx.recv(timeout=T) as m:
            assert m["obs"].is_cuda and m["obs"].device.index == 0
            assert m.buffer_address <= m["obs"].data_ptr() < m.buffer_address + m.buffer_nbytes
            _same(m, src)
    def buffers():  # allocations of every memory kind, device included; not small objects
        s = tdpipe.mem_stats()
        return s["total_allocs"] - s["small_allocs"]

    src = _batch(9)
    tx.send(src, timeout=T)
    rx.recv(timeout=T).release()
    before = buffers()
    for _ in range(20):
        tx.send(src, timeout=T)
        rx.recv(timeout=T).release()
    assert buffers() == before


@pytest.mark.parametrize("plane", ["shm", "cuda-ipc"])
def test_gpu_loan(gpu_pair, plane):
    """pipe.loan() of a CUDA layout: torch CUDA views, filled on torch's
    stream, sent (the binding synchronizes that stream first) and received
    equal. On cuda-ipc the loan is a slot of the device pool and the
    received views are that slot (one process shares the pool's pointer),
    with no buffer allocated per message."""
    tx, rx = gpu_pair(plane)
    like = _batch(0)

    def buffers():
        s = tdpipe.mem_stats()
        return s["total_allocs"] - s["small_allocs"]

    before = None
    for i in range(30):
        ln = tx.loan(like, timeout=T)
        assert ln["obs"].is_cuda and ln["obs"].device.index == 0
        src = _batch(i)
        ln["obs"].copy_(src["obs"])
        ln["next"]["reward"].copy_(src["next"]["reward"])
        ln["next"]["done"].copy_(src["next"]["done"])
        addr, ptr = ln.buffer_address, ln["obs"].data_ptr()
        assert addr <= ptr < addr + ln.buffer_nbytes
        tx.send(ln, timeout=T)
        with rx.recv(timeout=T) as m:
            assert m["obs"].is_cuda and m["obs"].device.index == 0
            if plane == "cuda-ipc":
                assert m.buffer_address == addr and m["obs"].data_ptr() == ptr
            _same(m, src, values=False)  # the tag is the loan's layout's
        if i == 9:
            before = buffers()
    if plane == "cuda-ipc":
        assert buffers() == before


def test_gpu_override_both_ways(gpu_pair):
    tx, rx = gpu_pair(recv_device="cpu")
    src = _batch(1)
    tx.send(src, timeout=T)
    with rx.recv(timeout=T) as m:
        assert m["obs"].device.type == "cpu"
        _same(m, src)
    tx, rx = gpu_pair(recv_device="cuda:0")
    src = _batch(2, "cpu")
    tx.send(src, timeout=T)
    with rx.recv(timeout=T) as m:
        assert m["obs"].is_cuda
        _same(m, src)
    tx.send(src, timeout=T)
    with rx.recv(timeout=T, device="cpu") as m:
        assert m["obs"].device.type == "cpu"
        _same(m, src)


def test_gpu_consolidated_and_mixed(gpu_pair):
    tx, rx = gpu_pair()
    src = _batch(3)
    cons = tdpipe.consolidate(src)
    assert cons["obs"].is_cuda
    tx.send(cons, timeout=T)
    assert tx._dbuf is None
    with rx.recv(timeout=T) as m:
        _same(m, src)
    # views into one CUDA allocation (a TensorDict.consolidate() storage) go as they are
    big = torch.arange(1024, dtype=torch.float32, device="cuda:0")
    tx.send({"a": big[:256], "b": big[256:768]}, timeout=T)
    assert tx._dbuf is None
    with rx.recv(timeout=T) as m:
        assert torch.equal(m["a"], big[:256]) and torch.equal(m["b"], big[256:768])
    with pytest.raises(ValueError, match="several devices"):
        tx.send({"a": torch.ones(2, device="cuda:0"), "b": torch.ones(2)}, timeout=T)
    with pytest.raises(ValueError, match="NumPy"):
        tx.send(src, timeout=T)
        rx.recv(timeout=T, as_="numpy")

"""A training loop fed GPU batches by a producer process, over cuda-ipc.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/gpu_dataloader.py [--batches N]

The training process listens; the producer (this file run with --produce
PORT, started as a child process) connects. Both pipes name their GPU
(cuda_device), so on one host they use the cuda-ipc plane: the producer
loans a slot of its device pool, fills it on the GPU and sends it, and only
a descriptor crosses; the training loop gets torch CUDA tensors that view
that very slot. Nothing is copied on either side.

The stream contract (docs/python.md, "GPU tensors"): send() waits for
torch's current stream, so the batch is complete before the descriptor
goes; release() waits for the consumer's current stream, so the step has
stopped reading the slot before the producer may refill it. Work on other
streams must be finished by hand.

Needs PyTorch with CUDA and a libtdpipe built with -DTDP_CUDA=ON; exits 3,
saying why, where either is missing.
"""
import argparse
import os
import subprocess
import sys
import time

import torch
from torch.utils.data import DataLoader, IterableDataset

import tdpipe

SKIPPED = 3


def gpu_or_exit():
    if not torch.cuda.is_available():
        why = "this PyTorch has no CUDA"
    elif os.environ.get("TDPIPE_CUDA", "").startswith("fake"):
        why = "TDPIPE_CUDA=fake: torch's CUDA memory is not the fake device's"
    elif tdpipe.cuda_device_count() < 1:
        why = "tdpipe's CUDA layer sees no GPU (docs/gpu.md)"
    else:
        return
    print("gpu_dataloader.py: skipped: %s" % why)
    sys.exit(SKIPPED)


class PipeDataset(IterableDataset):
    """GPU batches from a tdpipe pipe, until the producer closes it."""

    def __init__(self, pipe):
        self.pipe = pipe

    def __iter__(self):
        return iter(self.pipe)


def produce(port, batches):
    torch.manual_seed(0)
    rule = torch.randn(3 * 32 * 32, 10, device="cuda")  # the labels the model learns
    like = {"obs": torch.empty(64, 3, 32, 32, device="cuda"),
            "label": torch.empty(64, dtype=torch.int64, device="cuda")}
    with tdpipe.connect("127.0.0.1", port, cuda_device=0) as pipe:
        for _ in range(batches):
            batch = pipe.loan(like, timeout=30)  # CUDA views of a pool slot
            obs = batch["obs"].normal_()
            batch["label"].copy_((obs.flatten(1) @ rule).argmax(1))
            pipe.send(batch, timeout=30)  # after torch's stream: only a descriptor goes


def train(batches):
    with tdpipe.listen("127.0.0.1", 0, depth=2, cuda_device=0) as lst:
        child = subprocess.Popen([sys.executable, __file__, "--produce", str(lst.port),
                                  "--batches", str(batches)])
        pipe = lst.accept(timeout=60)
        # batch_size=None: the producer batches; the identity collate keeps
        # each Message (and its release()) as it is
        loader = DataLoader(PipeDataset(pipe), batch_size=None, collate_fn=lambda b: b)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        t0, n, first = time.monotonic(), 0, None
        for batch in loader:
            assert batch["obs"].is_cuda  # a view of the producer's slot
            loss = torch.nn.functional.cross_entropy(model(batch["obs"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if first is None:
                first = loss.item()
            n += 1
            batch.release()  # after this stream's step: the slot goes back
        dt = time.monotonic() - t0
        plane = pipe.plane
        pipe.close(5)
        if child.wait(60) != 0:
            sys.exit("the producer failed (exit status %d)" % child.returncode)
        print("trained on %d GPU batches over %s in %.2f s, loss %.3f -> %.3f"
              % (n, plane, dt, first, loss.item()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--produce", type=int, metavar="PORT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    gpu_or_exit()
    if a.produce:
        produce(a.produce, a.batches)
    else:
        train(a.batches)

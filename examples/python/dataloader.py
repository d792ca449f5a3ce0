"""A PyTorch DataLoader fed by a tdpipe consumer, with a producer process.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/dataloader.py [--batches N]

The training process listens; the producer (this file run with --produce
PORT, started as a child process) connects and streams batches. Each batch
arrives as a dict of tensors that are views into the pipe's receive buffer:
no copy between the socket and the model. With depth 2 the next batch is
received while the model works on this one; a batch is lent until
release(), so the step releases it when done with it.
"""
import argparse
import subprocess
import sys
import time

import torch
from torch.utils.data import DataLoader, IterableDataset

import tdpipe


class PipeDataset(IterableDataset):
    """Batches from a tdpipe pipe, until the producer closes it."""

    def __init__(self, pipe):
        self.pipe = pipe

    def __iter__(self):
        return iter(self.pipe)  # ends at the producer's clean close


def produce(port, batches):
    with tdpipe.connect("127.0.0.1", port) as pipe:
        g = torch.Generator().manual_seed(0)
        for i in range(batches):
            obs = torch.randn(64, 3, 32, 32, generator=g)
            label = torch.randint(0, 10, (64,), generator=g)
            pipe.send({"obs": obs, "label": label, "step": i}, timeout=30)


def train(batches):
    with tdpipe.listen("127.0.0.1", 0, depth=2) as lst:
        child = subprocess.Popen([sys.executable, __file__, "--produce", str(lst.port),
                                  "--batches", str(batches)])
        pipe = lst.accept(timeout=30)
        # batch_size=None: the producer already batches; the identity collate
        # keeps the received Message (and its release()) as it is. Workers
        # stay 0: the pipe lives in this process.
        loader = DataLoader(PipeDataset(pipe), batch_size=None, collate_fn=lambda b: b)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        t0, n, nbytes = time.monotonic(), 0, 0
        for batch in loader:
            loss = torch.nn.functional.cross_entropy(model(batch["obs"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            n += 1
            nbytes += batch.buffer_nbytes
            batch.release()  # a credit goes back to the producer
        dt = time.monotonic() - t0
        pipe.close(5)
        child.wait(30)
        print("trained on %d batches (%.1f MB) in %.2f s, last loss %.3f"
              % (n, nbytes / 1e6, dt, loss.item()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--produce", type=int, metavar="PORT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.produce:
        produce(a.produce, a.batches)
    else:
        train(a.batches)

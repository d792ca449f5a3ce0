"""N loader worker processes feed one training loop through a fan-in
(what torch's DataLoader does with worker processes and queues).

    PYTHONPATH=build/python /usr/bin/python3 examples/python/fanin_loader.py \
        [--workers N] [--batches-per-worker B]

The training process makes a tdpipe.FanIn and starts N worker processes
(multiprocessing, spawn). Each worker connects to the fan-in, builds
batches and sends them; the training loop iterates over the fan-in as a
torch IterableDataset would: one stream, served round robin over the
workers with a batch ready, each batch a dict of tensors viewing the
worker's receive buffer (on one host, the worker's shared-memory slot: no
copy). A batch is lent until released; each worker's pipe holds `depth`
batches, so a slow step slows every worker without unbounded memory.
"""
import argparse
import multiprocessing as mp
import sys
import time

import torch
from torch.utils.data import DataLoader, IterableDataset

import tdpipe

FEATURES = 256


def worker(rank, port, batches, batch_size):
    """A loader worker: its shard of the data set, as batches."""
    g = torch.Generator().manual_seed(rank)
    pipe = tdpipe.connect("127.0.0.1", port, connect_timeout=20)
    for i in range(batches):
        x = torch.randn(batch_size, FEATURES, generator=g)
        y = (x.sum(dim=1, keepdim=True) > 0).float()
        pipe.send({"x": x, "y": y, "meta": {"worker": torch.tensor([rank]),
                                             "index": torch.tensor([i])}})
    pipe.close()


class FanInDataset(IterableDataset):
    """Batches from every worker, until all of them have finished."""

    def __init__(self, fan):
        self.fan = fan

    def __iter__(self):
        return iter(self.fan)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batches-per-worker", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    a = ap.parse_args()

    fan = tdpipe.FanIn("127.0.0.1", producers=a.workers, depth=4)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, fan.port, a.batches_per_worker, a.batch_size))
             for r in range(a.workers)]
    for p in procs:
        p.start()

    model = torch.nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    # batch_size=None: the fan-in yields whole batches; no worker processes
    # of DataLoader's own (the fan-in's producers are the workers)
    loader = DataLoader(FanInDataset(fan), batch_size=None)
    per_worker = {}
    steps, t0, first_loss, loss = 0, None, None, None
    for item in loader:
        with item:  # the batch goes back to its worker's pipe at the end of the step
            b = item.data
            w = int(b["meta"]["worker"][0])
            # per-producer order: each worker's batches come in the order it sent them
            assert int(b["meta"]["index"][0]) == item.seq - 1, (w, item.seq)
            per_worker[w] = per_worker.get(w, 0) + 1
            opt.zero_grad()
            loss = loss_fn(model(b["x"]), b["y"])
            loss.backward()
            opt.step()
            if first_loss is None:
                first_loss, t0 = loss.item(), time.monotonic()  # the workers have started
            steps += 1
    dt = time.monotonic() - t0
    for p in procs:
        p.join(30)
    st = fan.stats()
    fan.free()
    ok = (steps == a.workers * a.batches_per_worker and
          all(per_worker.get(r) == a.batches_per_worker for r in range(a.workers)) and
          all(p.exitcode == 0 for p in procs) and st["producers_failed"] == 0)
    print("%d workers, %d steps in %.2f s (%.0f batches/s); per worker: %s; loss %.3f -> %.3f"
          % (a.workers, steps, dt, steps / dt, dict(sorted(per_worker.items())), first_loss,
             loss.item()))
    if not ok:
        print("FAILED: %s, exit codes %s" % (st, [p.exitcode for p in procs]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

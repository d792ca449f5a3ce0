"""One trainer broadcasts new weights to N inference replica processes
through a fan-out (what an RL learner does for its actors).

    PYTHONPATH=build/python /usr/bin/python3 examples/python/weights_broadcast.py \
        [--replicas N] [--steps S]

The trainer makes a tdpipe.FanOut in broadcast mode, listens, and starts N
replica processes (multiprocessing, spawn); each replica connects and
loads every weight version it receives into its own copy of the model.
After each training step the trainer loans a buffer laid out like the
model's state (on one host, a slot of the shared-memory pool every
replica's link shares), copies the parameters into it once, and sends it:
every replica gets the same slot, with no copy per replica. A send returns
when every replica is done with the version (the default, slow="block");
slow="drop_oldest" would let a stalled replica fall behind alone.

Each replica checks that versions arrive in order and reports a checksum
of the last one, which the trainer compares with its own weights.
"""
import argparse
import multiprocessing as mp
import sys

import torch

import tdpipe


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 16))


def nested(state):
    """A state dict ("0.weight": t) as nested dicts ({"0": {"weight": t}}):
    a tensordict key may not hold a '.'."""
    out = {}
    for name, t in state.items():
        node = out
        *path, leaf = name.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = t
    return out


def flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from flat(v, prefix + k + ".")
        else:
            yield prefix + k, v


def checksum(model):
    return float(sum(p.double().sum() for p in model.parameters()))


def replica(rank, port, results):
    """An inference replica: load each version, run a forward pass."""
    model = make_model()
    pipe = tdpipe.connect("127.0.0.1", port, connect_timeout=60)
    versions = []
    x = torch.ones(4, 128)
    try:
        for msg in pipe:  # ends at the trainer's close
            versions.append(int(msg["version"][0]))
            with torch.no_grad():
                state = {k: v for k, v in flat(msg["weights"])}
                model.load_state_dict(state)  # copies out of the lent buffer
                model(x)
            msg.release()
        results.put((rank, versions, checksum(model), pipe.plane))
    finally:
        pipe.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tdpipe.FanOut("broadcast") as fan:
        port = fan.listen("127.0.0.1")
        procs = [ctx.Process(target=replica, args=(r, port, results)) for r in range(a.replicas)]
        for p in procs:
            p.start()
        fan.wait_consumers(a.replicas, timeout=180)
        like = {"version": torch.zeros(1, dtype=torch.int64),
                "weights": nested(model.state_dict())}
        for step in range(1, a.steps + 1):
            loss = model(torch.randn(32, 128)).pow(2).mean()  # a training step
            opt.zero_grad()
            loss.backward()
            opt.step()
            buf = fan.loan(like, timeout=60)  # the shared slot: one copy for every replica
            buf["version"][0] = step
            with torch.no_grad():
                for name, t in model.state_dict().items():
                    node = buf["weights"]
                    *path, leaf = name.split(".")
                    for p in path:
                        node = node[p]
                    node[leaf].copy_(t)
            fan.send(buf, timeout=60)
        st = fan.stats()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    want = checksum(model)
    ok = True
    for rank, versions, sum_, plane in sorted(got):
        if versions != list(range(1, a.steps + 1)) or abs(sum_ - want) > 1e-6 * max(1, abs(want)):
            print("replica %d: versions %s, checksum %r (want %r)" % (rank, versions[:8], sum_, want))
            ok = False
    drops = sum(p["drops"] for p in st["peers"])
    print("%d replicas got %d weight versions (%d bytes each, plane %s, %d dropped)" % (
        len(got), a.steps, st["bytes"] // max(1, st["msgs"]), got[0][3], drops))
    return 0 if ok and all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The other process of the two-process tests: python peer.py MODE PORT [COUNT].

MODE: torch, numpy (send COUNT messages, then close cleanly), schemas (three
layouts in turn), hang (send one message, then wait to be killed), garbage
(listen on a raw TCP socket, write garbage to whoever connects).
"""
import socket
import sys
import time

import numpy as np
import torch

import tdpipe


def batch(kind, i):
    if kind == "torch":
        return {"obs": torch.full((4, 8), float(i)), "next": {"reward": torch.arange(4) + i,
                "done": torch.tensor([i % 2 == 0] * 4)}, "tag": "t%d" % i}
    return {"obs": np.full((4, 8), float(i), dtype=np.float32),
            "next": {"reward": np.arange(4, dtype=np.int64) + i,
                     "done": np.array([i % 2 == 0] * 4)}, "tag": "t%d" % i}


def main():
    mode, port = sys.argv[1], int(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    if mode == "garbage":
        srv = socket.socket()
        srv.bind(("127.0.0.1", port))
        srv.listen(1)
        print(srv.getsockname()[1], flush=True)
        srv.settimeout(20)
        c, _ = srv.accept()
        c.sendall(b"GET / HTTP/1.0\r\n" + bytes(range(256)) * 8)
        time.sleep(2)
        return
    pipe = tdpipe.connect("127.0.0.1", port, connect_timeout=10)
    if mode in ("torch", "numpy"):
        for i in range(count):
            pipe.send(batch(mode, i), timeout=10)
    elif mode == "schemas":
        pipe.send({"a": torch.ones(3)}, timeout=10)
        pipe.send({"a": torch.ones(3), "b": {"c": np.zeros((2, 5), dtype=np.float64)}},
                  timeout=10)
        pipe.send({"a": torch.ones(3)}, timeout=10)
    elif mode == "hang":
        pipe.send(batch("torch", 0), timeout=10)
        print("sent", flush=True)
        time.sleep(30)
        return
    pipe.close(10)


if __name__ == "__main__":
    main()

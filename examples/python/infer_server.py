"""An inference server: requests {"obs": [B, 16]} -> replies {"action": [B],
"logits": [B, 4], "model": name}, a schema other than the request's.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/infer_server.py [--port P]

Prints the port it listens on, then serves any number of clients until
SIGINT / SIGTERM (or --seconds). The handler runs on the library's loop
thread; the request's tensors are views into the client's receive buffer,
valid during the call.
"""
import argparse
import signal
import threading

import torch

import tdpipe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).eval()

    def handler(req):
        with torch.no_grad():
            logits = model(req["obs"])
        return {"action": logits.argmax(dim=1), "logits": logits, "model": "linear-16-4"}

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with tdpipe.Server("127.0.0.1", a.port, handler) as srv:
        print(srv.port, flush=True)
        stop.wait(a.seconds)
        srv.shutdown(5)
        print("served %(clients_total)d clients, %(msgs_recv)d requests" % srv.stats(),
              flush=True)


if __name__ == "__main__":
    main()

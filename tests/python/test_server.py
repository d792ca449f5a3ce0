import threading
import time

import numpy as np
import pytest
import torch

import tdpipe


def test_server_many_clients_reply_of_another_schema():
    seen = []

    def handler(req):
        x = req["x"]
        seen.append(int(req["client"]))
        return {"y": (x * 2).sum(dim=0, keepdim=True), "meta": {"n": np.array([x.shape[0]])},
                "who": req["client"]}

    closed = []
    with tdpipe.Server("127.0.0.1", 0, handler,
                       on_close=lambda cid, code: closed.append(code)) as srv:
        errors = []

        def client(k):
            try:
                with tdpipe.connect("127.0.0.1", srv.port) as p:
                    for i in range(20):
                        p.send({"x": torch.full((3, 2), float(i)), "client": k}, timeout=10)
                        with p.recv(timeout=10) as r:
                            assert r["y"].tolist() == [[6.0 * i, 6.0 * i]]
                            assert r["meta"]["n"].tolist() == [3]
                            assert r["who"] == k
            except Exception as e:
                errors.append(e)

        ts = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert not errors, errors
        assert sorted(set(seen)) == [0, 1, 2, 3] and len(seen) == 80
        st = srv.stats()
        assert st["clients_total"] == 4 and st["msgs_recv"] == 80 and st["msgs_sent"] == 80
        srv.shutdown(5)
    assert len(closed) == 4


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_server_handler_error_closes_only_that_client():
    def handler(req):
        if req["bad"]:
            raise RuntimeError("handler failed on purpose")
        return {"ok": torch.ones(1)}

    with tdpipe.Server("127.0.0.1", 0, handler) as srv:
        good = tdpipe.connect("127.0.0.1", srv.port)
        bad = tdpipe.connect("127.0.0.1", srv.port)
        bad.send({"bad": True, "x": torch.zeros(1)}, timeout=5)
        with pytest.raises(tdpipe.PeerError):
            bad.recv(timeout=10)
        bad.abort()
        good.send({"bad": False, "x": torch.zeros(1)}, timeout=5)
        assert good.recv(timeout=10)["ok"].tolist() == [1.0]
        good.close(5)
        assert srv.stats()["handler_errors"] == 1


def test_server_limits_idle_timeout():
    def handler(req):
        return None

    closed = []
    with tdpipe.Server("127.0.0.1", 0, handler, idle_timeout=0.3, max_pending=8,
                       max_per_source=4, max_clients=2,
                       on_close=lambda cid, code: closed.append(code)) as srv:
        with tdpipe.connect("127.0.0.1", srv.port) as p:
            # silent for longer than idle_timeout (checked every quarter of it)
            deadline = time.monotonic() + 5
            while srv.stats()["idle_closed"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            st = srv.stats()
            assert st["idle_closed"] == 1, st
            assert st["pending_now"] == 0 and st["clients_total"] == 1, st
            with pytest.raises(tdpipe.ClosedError):
                p.recv(timeout=5)
        srv.shutdown(5)
    assert len(closed) == 1


def test_server_limits_bad_values():
    with pytest.raises(ValueError):
        tdpipe.Server("127.0.0.1", 0, lambda r: None, max_pending=-1)
    with pytest.raises(ValueError):
        tdpipe.Server("127.0.0.1", 0, lambda r: None, max_clients=2**32)

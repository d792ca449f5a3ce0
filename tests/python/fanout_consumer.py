"""A fan-out consumer for the tests: python fanout_consumer.py HOW PORT [SLEEP_MS].

HOW: dial (connect to the fan-out's listener at PORT) or listen (listen on
a free port, print it, accept the fan-out's dial). Receives until the
clean end, checks each message's payload against its counter k, and
prints one JSON line: {"ks": [...], "end": "closed", "bad": N, "plane": P}.
With SLEEP_MS, sleeps that long after each message and prints "got N"
after every one (the tests kill such a slow consumer mid-stream).
"""
import json
import sys
import time

sys.modules["torch"] = None  # NumPy views only: starts in a fraction of torch's import time
import tdpipe  # noqa: E402


def main():
    how, port = sys.argv[1], int(sys.argv[2])
    sleep_ms = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    if how == "dial":
        pipe = tdpipe.connect("127.0.0.1", port, as_="numpy", connect_timeout=30, depth=4)
    else:
        lst = tdpipe.listen("127.0.0.1", 0, as_="numpy", depth=4)
        print(lst.port, flush=True)
        pipe = lst.accept(timeout=120)
        lst.close()
    ks, bad, end = [], 0, "closed"
    while True:
        try:
            msg = pipe.recv(timeout=120)
        except tdpipe.ClosedError:
            break
        except tdpipe.Error as e:
            end = e.errname
            break
        k = int(msg["k"][0])
        x = msg["x"]
        if int(x[0]) != k % 251 or int(x[-1]) != k % 251:
            bad += 1
        ks.append(k)
        msg.release()
        if sleep_ms:
            print("got %d" % len(ks), flush=True)
            time.sleep(sleep_ms / 1000)
    print(json.dumps({"ks": ks, "end": end, "bad": bad, "plane": pipe.plane}), flush=True)
    pipe.close()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""bench/raw_tcp.py recv|send HOST PORT SIZE COUNT: the raw-TCP baseline of
bench/netns_tcp.sh. COUNT messages of SIZE bytes over one connection
(TCP_NODELAY, no framing: both sides know SIZE); the receiver prints the rate
from the end of the first message to the end of the last, as tdpipe recv
times its own. Python moves the bytes with sendall / recv_into, so the
kernel's copies are the cost, as in bench/peer_tcp.c (which binds loopback
only)."""
import socket, sys, time, struct
mode, host, port, size, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if mode == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(1); print("listening", flush=True)
    c, _ = s.accept(); buf = bytearray(size); mv = memoryview(buf); t0 = None
    for i in range(count):
        got = 0
        while got < size:
            n = c.recv_into(mv[got:], size - got)
            if n == 0: sys.exit(1)
            got += n
        if i == 0: t0 = time.monotonic()
    dt = time.monotonic() - t0
    print("%.3f GB/s" % ((count - 1) * size / dt / 1e9))
else:
    c = socket.create_connection((host, port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytes(size)
    for i in range(count): c.sendall(buf)
    c.close()

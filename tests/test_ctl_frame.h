/*
 * test_ctl_frame.h: a raw peer's read of one whole control frame, for the
 * suites that speak the wire by hand (a hostile or hand-made peer).
 * Include after test_util.h.
 */
#ifndef TDP_TEST_CTL_FRAME_H
#define TDP_TEST_CTL_FRAME_H

#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include "pipe/wire.h"

/* Read one whole control frame from fd within ms; its length, or -1 (the
 * peer closed, a frame over cap or not a frame, or the time ran out). */
static inline ssize_t read_ctl_frame(int fd, uint8_t *buf, size_t cap, int64_t ms)
{
    size_t got = 0, want = TDP_CTL_HDR_LEN;
    int64_t end = mono_ms() + ms;
    while (got < want && mono_ms() < end) {
        ssize_t n = recv(fd, buf + got, want - got, MSG_DONTWAIT);
        if (n == 0)
            return -1;
        if (n < 0) {
            usleep(1000);
            continue;
        }
        got += (size_t)n;
        if (got == TDP_CTL_HDR_LEN) {
            tdp_ctl_hdr h;
            if (tdp_wire_ctl_hdr_decode(buf, &h) != TDP_OK || TDP_CTL_HDR_LEN + h.length > cap)
                return -1;
            want = TDP_CTL_HDR_LEN + h.length;
        }
    }
    return got == want ? (ssize_t)got : -1;
}

#endif

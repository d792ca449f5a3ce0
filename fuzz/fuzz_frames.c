/*
 * fuzz_frames: the frame decoders a peer reaches before anything else —
 * control header, HELLO, BYE and the active-message header. Every decode
 * must either fail cleanly or produce fields inside their documented bounds,
 * and an accepted frame must re-encode to the same bytes.
 */
#include <stdlib.h>
#include <string.h>

#include "pipe/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size >= TDP_CTL_HDR_LEN) {
        tdp_ctl_hdr h;
        if (tdp_wire_ctl_hdr_decode(data, &h) == TDP_OK) {
            const uint8_t *pl = data + TDP_CTL_HDR_LEN;
            size_t avail = size - TDP_CTL_HDR_LEN;
            size_t n = h.length < avail ? h.length : avail;
            if (h.type == TDP_CTL_HELLO) {
                tdp_hello hello;
                if (tdp_wire_hello_decode(pl, n, &hello) == TDP_OK) {
                    if (hello.addr_len == 0 || hello.addr_len > TDP_MAX_UCX_ADDR ||
                        hello.recv_depth == 0 || hello.recv_depth > 64 ||
                        (const uint8_t *)hello.addr + hello.addr_len > pl + n)
                        abort();
                    uint8_t *re = malloc(tdp_wire_hello_size(&hello));
                    if (re == NULL)
                        return 0;
                    tdp_wire_hello_encode(re, &hello);
                    if (memcmp(re + TDP_CTL_HDR_LEN, pl, n) != 0)
                        abort();
                    free(re);
                }
            } else if (h.type == TDP_CTL_BYE) {
                tdp_bye bye;
                if (tdp_wire_bye_decode(pl, n, &bye) == TDP_OK && bye.reason > 0)
                    abort();
            }
        }
    }
    tdp_am_hdr am;
    if (tdp_wire_am_decode(data, size, &am) == TDP_OK) {
        uint8_t re[TDP_AM_HDR_LEN];
        if (am.type < TDP_AM_SCHEMA || am.type > TDP_AM_CREDIT)
            abort();
        tdp_wire_am_encode(re, &am);
        if (memcmp(re, data, TDP_AM_HDR_LEN) != 0)
            abort();
    }
    return 0;
}

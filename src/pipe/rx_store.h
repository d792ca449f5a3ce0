/*
 * rx_store.h (internal): a receive slot's storage for the planes that
 * receive into buffers of their own (ucx, tcp). One buffer, refcounted,
 * seen through a tdp_td per layout: a new layout that fits (as many bytes,
 * the same memory type and device) reuses it, so a schema change allocates
 * nothing when the storage is large enough, and a view the application
 * still holds keeps the old buffer alive (the last td that wraps it frees
 * it).
 */
#ifndef TDP_PIPE_RX_STORE_H
#define TDP_PIPE_RX_STORE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <tdpipe/mem.h>
#include <tdpipe/td.h>

typedef struct tdp__rx_store {
    _Atomic uint32_t refs; /* one per td that wraps it */
    void *buf;
    uint64_t cap;
    tdp_mem_type mt;
} tdp__rx_store;

/* Whether st (NULL: none) and its td can hold need bytes of mt on dev. */
bool tdp__rx_store_fits(const tdp__rx_store *st, const tdp_td *td, uint64_t need, tdp_mem_type mt,
                        tdp_device dev);
/* *td becomes a view of layout sc over st (its old td unref'd): storage kept. */
tdp_err tdp__rx_store_rewrap(tdp__rx_store *st, tdp_schema *sc, tdp_device dev, tdp_td **td);
/*
 * New storage of need bytes of mt on dev, seen as layout sc: *st and *td
 * (whatever they held is let go of by the caller first). Host storage is
 * faulted in when populate is set (a prepared layout: its first DATA lands
 * on present pages).
 */
tdp_err tdp__rx_store_new(tdp_schema *sc, tdp_mem_type mt, tdp_device dev, uint64_t need,
                          bool populate, tdp__rx_store **st, tdp_td **td);

#endif

/* rx_store.c: a receive slot's refcounted storage (rx_store.h). */
#include "rx_store.h"
#include "../core/alloc.h"
#include "../core/populate.h"
#include "../schema/td_int.h"

static void store_unref(void *buf, void *arg)
{
    tdp__rx_store *st = arg;
    (void)buf;
    if (atomic_fetch_sub_explicit(&st->refs, 1, memory_order_acq_rel) == 1) {
        tdp_mem_free(st->mt, st->buf);
        tdp__free(st);
    }
}

bool tdp__rx_store_fits(const tdp__rx_store *st, const tdp_td *td, uint64_t need, tdp_mem_type mt,
                        tdp_device dev)
{
    return st != NULL && td != NULL && st->cap >= need && st->mt == mt &&
           tdp_device_equal(td->device, dev);
}

tdp_err tdp__rx_store_rewrap(tdp__rx_store *st, tdp_schema *sc, tdp_device dev, tdp_td **td)
{
    tdp_td *nt;
    atomic_fetch_add(&st->refs, 1);
    tdp_err rc = tdp_td_wrap(sc, st->buf, st->cap, dev, store_unref, st, &nt);
    if (rc != TDP_OK) {
        store_unref(NULL, st);
        return rc;
    }
    tdp_td_unref(*td);
    *td = nt;
    return TDP_OK;
}

tdp_err tdp__rx_store_new(tdp_schema *sc, tdp_mem_type mt, tdp_device dev, uint64_t need,
                          bool populate, tdp__rx_store **out, tdp_td **td)
{
    tdp__rx_store *st = tdp__calloc(1, sizeof(*st));
    if (st == NULL)
        return TDP_ENOMEM;
    tdp_err rc = tdp_mem_alloc(mt, dev.index, need, 0, &st->buf);
    if (rc != TDP_OK) {
        tdp__free(st);
        return rc;
    }
    st->cap = need;
    st->mt = mt;
    atomic_init(&st->refs, 1);
    if ((rc = tdp_td_wrap(sc, st->buf, need, dev, store_unref, st, td)) != TDP_OK) {
        store_unref(NULL, st);
        return rc;
    }
    *out = st;
    if (populate && mt == TDP_MEM_HOST)
        tdp__populate_write(st->buf, need);
    return TDP_OK;
}

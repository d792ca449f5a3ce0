/*
 * fuzz_schema: the schema decoder and validator on arbitrary bytes — the
 * first thing an unauthenticated peer reaches. Any accepted schema must
 * re-encode to a schema that decodes to the same bytes and hash.
 */
#include <stdlib.h>
#include <string.h>
#include <tdpipe/tdpipe.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tdp_schema *s = NULL, *again = NULL;
    char why[256];
    tdp_schema_limits lim;

    tdp_schema_limits_default(&lim);
    lim.max_total_bytes = 1ull << 40;
    if (tdp_schema_decode(data, size, &lim, &s, why, sizeof(why)) != TDP_OK)
        return 0;
    size_t len;
    const char *json = tdp_schema_json(s, &len);
    if (tdp_schema_decode(json, len, &lim, &again, why, sizeof(why)) != TDP_OK)
        abort(); /* our own canonical output must always decode */
    if (!tdp_schema_equal(s, again) || tdp_schema_hash(s) != tdp_schema_hash(again))
        abort(); /* canonical form must be a fixed point */
    for (uint32_t i = 0; i < tdp_schema_num_leaves(s); i++) {
        tdp_leaf l;
        if (tdp_schema_leaf_at(s, i, &l) != TDP_OK)
            abort();
        if (l.kind == TDP_LEAF_TENSOR && (l.offset > tdp_schema_total_bytes(s) ||
                                          l.nbytes > tdp_schema_total_bytes(s) - l.offset))
            abort(); /* validation let an out-of-bounds leaf through */
    }
    tdp_schema_unref(again);
    tdp_schema_unref(s);
    return 0;
}

/*
 * schema_demo: build a nested tensordict schema, consolidate it into one
 * buffer, fill it, print the tree, the canonical JSON and the hash, decode
 * the JSON back and check it is the same schema, and export a leaf through
 * DLPack.
 */
#include <dlpack/dlpack.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <tdpipe/tdpipe.h>

#define CHECK(call)                                                                                \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ != TDP_OK) {                                                                       \
            fprintf(stderr, "%s failed: %s\n", #call, tdp_strerror(rc_));                          \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

int main(void)
{
    tdp_schema_builder *b;
    tdp_schema *s, *back;
    tdp_td *td;
    char why[256];
    const int64_t batch[] = {4};
    const int64_t obs[] = {4, 3, 84, 84}, act[] = {4, 6}, rew[] = {4, 1};

    CHECK(tdp_schema_builder_new(&b));
    CHECK(tdp_schema_builder_node(b, "", NULL, 1, batch));
    CHECK(tdp_schema_builder_node(b, "next", "Transition", 1, batch));
    CHECK(tdp_schema_builder_tensor(b, "obs", TDP_UINT8, 4, obs));
    CHECK(tdp_schema_builder_tensor(b, "action", TDP_FLOAT32, 2, act));
    CHECK(tdp_schema_builder_tensor(b, "next.reward", TDP_FLOAT32, 2, rew));
    CHECK(tdp_schema_builder_tensor(b, "next.done", TDP_BOOL, 2, rew));
    CHECK(tdp_schema_builder_string(b, "env_name", "CartPole-v1"));
    CHECK(tdp_schema_builder_finish(b, &s, why, sizeof(why)));
    tdp_schema_builder_free(b);

    CHECK(tdp_td_new(s, &td));
    memset(tdp_td_data(td), 0, tdp_td_nbytes(td));
    tdp_leaf reward;
    CHECK(tdp_td_get(td, "next.reward", &reward));
    for (uint64_t i = 0; i < reward.numel; i++)
        ((float *)reward.data)[i] = (float)i * 0.5f;

    tdp_schema_print(s, stdout);
    size_t len;
    const char *json = tdp_schema_json(s, &len);
    printf("\ncanonical JSON (%zu bytes):\n%s\n", len, json);
    printf("\nXXH3-64 hash: %016" PRIx64 "\n", tdp_schema_hash(s));

    CHECK(tdp_schema_decode(json, len, NULL, &back, why, sizeof(why)));
    printf("decoded back: %s\n", tdp_schema_equal(s, back) ? "identical" : "DIFFERENT");

    struct DLManagedTensor *dl;
    CHECK(tdp_td_to_dlpack(td, "next.reward", &dl));
    printf("DLPack next.reward: ndim=%d shape=[%" PRId64 ", %" PRId64 "] code=%u bits=%u "
           "data[3]=%.1f\n",
           dl->dl_tensor.ndim, dl->dl_tensor.shape[0], dl->dl_tensor.shape[1],
           dl->dl_tensor.dtype.code, dl->dl_tensor.dtype.bits,
           ((float *)dl->dl_tensor.data)[3]);
    dl->deleter(dl);

    tdp_td_unref(td);
    tdp_schema_unref(back);
    tdp_schema_unref(s);
    return 0;
}

/*
 * plane.c: the plane registry — the planes this build has, in this
 * library's order of preference, then the planes tests add. Bounded: never
 * more than TDP__PLANES_MAX, so the session's arrays sized by it hold all.
 */
#include <string.h>

#include "plane.h"

static const tdp__plane_ops *const built[] = {
#ifdef TDP_HAVE_SHM_PLANE
    &tdp__plane_cuda_ipc, /* offered only by a pipe that names a GPU */
    &tdp__plane_shm,
#endif
    &tdp__plane_tcp, /* other hosts where TCP is the only way (usable_link), or when asked for */
    &tdp__plane_ucx, /* any peer */
};
#define NBUILT (sizeof(built) / sizeof(built[0]))

_Static_assert(NBUILT < TDP__PLANES_MAX, "the registry must fit the HELLO's plane list");

/* tdp__plane_add_test: one per test id, while the registry has room */
static const tdp__plane_ops *tests[TDP__PLANE_TEST - TDP__PLANE_TEST_MIN + 1];
static size_t ntests;

void tdp__plane_register_test(const tdp__plane_ops *ops)
{
    ntests = 0;
    if (ops != NULL)
        (void)tdp__plane_add_test(ops);
}

tdp_err tdp__plane_add_test(const tdp__plane_ops *ops)
{
    if (ops == NULL || ops->id < TDP__PLANE_TEST_MIN || ops->id > TDP__PLANE_TEST ||
        ops->name == NULL)
        return TDP_EINVAL;
    for (size_t i = 0; i < ntests; i++)
        if (tests[i]->id == ops->id)
            return TDP_EINVAL;
    if (ntests >= sizeof(tests) / sizeof(tests[0]) || NBUILT + ntests >= TDP__PLANES_MAX)
        return TDP_ELIMIT;
    tests[ntests++] = ops;
    return TDP_OK;
}

size_t tdp__plane_count(void)
{
    return NBUILT + ntests;
}

const tdp__plane_ops *tdp__plane_at(size_t i)
{
    if (i < NBUILT)
        return built[i];
    return i - NBUILT < ntests ? tests[i - NBUILT] : NULL;
}

const tdp__plane_ops *tdp__plane_by_id(uint8_t id)
{
    const tdp__plane_ops *o;
    for (size_t i = 0; (o = tdp__plane_at(i)) != NULL; i++)
        if (o->id == id)
            return o;
    return NULL;
}

const tdp__plane_ops *tdp__plane_by_name(const char *name)
{
    const tdp__plane_ops *o;
    for (size_t i = 0; name != NULL && (o = tdp__plane_at(i)) != NULL; i++)
        if (strcmp(o->name, name) == 0)
            return o;
    return NULL;
}

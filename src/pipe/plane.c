/* plane.c: the planes this build has. */
#include <string.h>

#include "plane.h"

static const tdp__plane_ops *const planes[] = {
#ifdef TDP_HAVE_SHM_PLANE
    &tdp__plane_shm,
#endif
    &tdp__plane_ucx,
};

static const tdp__plane_ops *test_plane; /* tdp__plane_register_test */

void tdp__plane_register_test(const tdp__plane_ops *ops)
{
    test_plane = ops != NULL && ops->id == TDP__PLANE_TEST ? ops : NULL;
}

const tdp__plane_ops *tdp__plane_by_id(uint8_t id)
{
    for (size_t i = 0; i < sizeof(planes) / sizeof(planes[0]); i++)
        if (planes[i]->id == id)
            return planes[i];
    return test_plane != NULL && test_plane->id == id ? test_plane : NULL;
}

const tdp__plane_ops *tdp__plane_by_name(const char *name)
{
    for (size_t i = 0; name != NULL && i < sizeof(planes) / sizeof(planes[0]); i++)
        if (strcmp(planes[i]->name, name) == 0)
            return planes[i];
    return test_plane != NULL && name != NULL && strcmp(test_plane->name, name) == 0 ? test_plane
                                                                                     : NULL;
}

/* plane.c: the planes this build has. */
#include <string.h>

#include "plane.h"

static const tdp__plane_ops *const planes[] = {
#ifdef TDP_HAVE_SHM_PLANE
    &tdp__plane_shm,
#endif
    &tdp__plane_ucx,
};

const tdp__plane_ops *tdp__plane_by_id(uint8_t id)
{
    for (size_t i = 0; i < sizeof(planes) / sizeof(planes[0]); i++)
        if (planes[i]->id == id)
            return planes[i];
    return NULL;
}

const tdp__plane_ops *tdp__plane_by_name(const char *name)
{
    for (size_t i = 0; name != NULL && i < sizeof(planes) / sizeof(planes[0]); i++)
        if (strcmp(planes[i]->name, name) == 0)
            return planes[i];
    return NULL;
}

/* err.c: error strings from the single table in err.h. */
#include <tdpipe/err.h>

#include "version.h"

const char *tdp_strerror(int err)
{
    switch (err) {
#define TDP__ERR_STR(name, value, msg)                                                             \
    case (value):                                                                                  \
        return msg;
        TDP_ERR_TABLE(TDP__ERR_STR)
#undef TDP__ERR_STR
    default:
        return "unknown error";
    }
}

const char *tdp_errname(int err)
{
    switch (err) {
#define TDP__ERR_NAME(name, value, msg)                                                            \
    case (value):                                                                                  \
        return #name;
        TDP_ERR_TABLE(TDP__ERR_NAME)
#undef TDP__ERR_NAME
    default:
        return "UNKNOWN";
    }
}

uint32_t tdp_version(void)
{
    return TDP_VERSION;
}

const char *tdp_version_string(void)
{
    return TDP_VERSION_STRING;
}

/* version.h: the version string, derived from the header's numbers. */
#ifndef TDP_CORE_VERSION_H
#define TDP_CORE_VERSION_H

#include <tdpipe/common.h>

#define TDP__STR2(x) #x
#define TDP__STR(x)  TDP__STR2(x)
#define TDP_VERSION_STRING                                                                         \
    TDP__STR(TDP_VERSION_MAJOR) "." TDP__STR(TDP_VERSION_MINOR) "." TDP__STR(TDP_VERSION_PATCH)

#endif

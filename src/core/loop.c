/* loop.c: libevent event_base + UCP worker. (being written) */
#include "loop_int.h"

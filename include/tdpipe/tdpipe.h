/*
 * tdpipe: stream tensordicts between processes and hosts.
 *
 * Umbrella header; include this one. See docs/ for the guides.
 */
#ifndef TDPIPE_TDPIPE_H
#define TDPIPE_TDPIPE_H

#include <tdpipe/common.h>
#include <tdpipe/err.h>
#include <tdpipe/log.h>
#include <tdpipe/mem.h>
#include <tdpipe/dtype.h>
#include <tdpipe/schema.h>
#include <tdpipe/td.h>
#include <tdpipe/loop.h>
#include <tdpipe/stats.h>
#include <tdpipe/pipe.h>
#include <tdpipe/server.h>
#include <tdpipe/fanin.h>
#include <tdpipe/fanout.h>

#endif /* TDPIPE_TDPIPE_H */

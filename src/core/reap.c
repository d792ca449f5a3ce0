/*
 * reap.c: deferred destruction. Each object embeds its tdp__reap; the loop
 * runs it on a later turn, and tdp_loop_free runs whatever is left before
 * anything else of the loop goes (TDP__EXT_REAP has the highest key, so
 * its pre_fini runs first).
 */
#include "reap.h"
#include "alloc.h"

typedef struct reaper {
    tdp__reap *head;
} reaper;

static void reaper_pre_fini(void *ext)
{
    reaper *rp = ext;
    while (rp->head != NULL) {
        tdp__reap *r = rp->head;
        rp->head = r->next;
        if (rp->head != NULL)
            rp->head->prev = NULL;
        r->queued = false;
        /* its task must not stay queued: the object that holds it goes now,
         * and the loop's free walks what is still queued */
        tdp__loop_unpost_task(r->loop, &r->task);
        r->fn(r->arg);
    }
}

static void reaper_fini(void *ext)
{
    tdp__free(ext);
}

static void reap_run(void *arg)
{
    tdp__reap *r = arg;
    reaper *rp = tdp__loop_ext(r->loop, TDP__EXT_REAP);
    if (!r->queued)
        return;
    if (r->prev != NULL)
        r->prev->next = r->next;
    else
        rp->head = r->next;
    if (r->next != NULL)
        r->next->prev = r->prev;
    r->queued = false;
    r->fn(r->arg);
}

void tdp__reap_later(tdp_loop *loop, tdp__reap *r, void (*fn)(void *arg), void *arg)
{
    reaper *rp = tdp__loop_ext(loop, TDP__EXT_REAP);
    if (rp == NULL) {
        rp = tdp__calloc(1, sizeof(*rp));
        if (rp == NULL) {
            fn(arg); /* no memory to wait: now is the only choice left */
            return;
        }
        tdp__loop_set_ext(loop, TDP__EXT_REAP, rp, reaper_pre_fini, reaper_fini);
    }
    if (r->queued)
        return;
    r->fn = fn;
    r->arg = arg;
    r->loop = loop;
    r->queued = true;
    r->prev = NULL;
    r->next = rp->head;
    if (rp->head != NULL)
        rp->head->prev = r;
    rp->head = r;
    r->task = (tdp__task){.fn = reap_run, .arg = r};
    tdp__loop_post_task(loop, &r->task);
}

/*
 * test_gpu_pin: the host memory a link stages GPU payloads through (shm
 * pools, ucx and tcp bounces) is page-locked off the first message's path.
 * On the fake device, whose host registrations are made slow
 * (tdp__cuda_fake_set_register_ms, as cuMemHostRegister of hundreds of MB
 * is on a GPU machine): a layout's first message does not wait for them
 * (its copies go at pageable speed), later messages use them once they
 * landed, a prepare waits for them (off the path), and a pipe closed while
 * they run ends cleanly (ASan, TSan). Bytes are compared through copies.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <tdpipe/tdpipe.h>

#include "core/cuda.h"
#include "test_gpu_util.h"
#include "test_util.h"

#define OK(x)  assert_int_equal((x), TDP_OK)
#define TMO    30000
#define DEPTH  2
#define PIN_MS 1000
#define CUDA0  ((tdp_device){TDP_DEVICE_CUDA, 0})

typedef struct env {
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *srv, *cli;
} env;

static void env_up(env *e, tdp_plane plane)
{
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.plane = plane;
    o.recv_depth = DEPTH;
    o.cuda_device_set = true;
    o.cuda_device = 0;
    memset(e, 0, sizeof(*e));
    OK(tdp_loop_new(NULL, &e->sl));
    OK(tdp_loop_new(NULL, &e->cl));
    OK(tdp_loop_start_thread(e->sl));
    OK(tdp_loop_start_thread(e->cl));
    OK(tdp_listener_new(e->sl, "127.0.0.1", 0, &o, NULL, NULL, &e->l));
    OK(tdp_pipe_connect(e->cl, "127.0.0.1", tdp_listener_port(e->l), &o, &e->cli));
    OK(tdp_listener_accept(e->l, TMO, &e->srv));
    assert_int_equal(tdp_pipe_plane(e->cli), plane);
}

static void env_down(env *e)
{
    tdp_pipe_free(e->cli);
    tdp_pipe_free(e->srv);
    tdp_listener_free(e->l);
    tdp_loop_free(e->cl);
    tdp_loop_free(e->sl);
}

/* One message sent and received whole; how long it took, ms. */
static int64_t one(env *e, tdp_td *td, uint64_t tag)
{
    tdp_td *got = NULL;
    int64_t t0 = mono_ms();
    gpu_fill(td, tag);
    OK(tdp_pipe_send(e->cli, td, TMO));
    OK(tdp_pipe_recv(e->srv, TMO, &got));
    int64_t took = mono_ms() - t0;
    assert_true(gpu_holds(got, tag));
    tdp_pipe_release(e->srv, got);
    return took;
}

static void run(tdp_plane plane)
{
    tdp__cuda_fake_set_register_ms(PIN_MS);
    tdp_schema *sc = gpu_schema_of(3 << 20, CUDA0), *sc2 = gpu_schema_of(5 << 20, CUDA0);
    tdp_td *td, *td2;
    OK(tdp_td_new(sc, &td));
    OK(tdp_td_new(sc2, &td2));
    for (int round = 0; round < 2; round++) {
        env e;
        env_up(&e, plane);
        uint64_t landed = tdp__cuda_pins_landed();
        int64_t took = one(&e, td, 1);
        print_message("%s: first GPU message, page-locking %d ms a registration: %lld ms\n",
                      tdp_plane_name(plane), PIN_MS, (long long)took);
        assert_true(took < PIN_MS); /* it waited for no registration */
        assert_int_equal(tdp__cuda_pins_landed(), landed);
        if (round == 0) {
            /* the registrations land (each on its own thread); the next
             * messages are copied through them */
            uint64_t seen = landed;
            for (int i = 0; i < 100; i++) {
                usleep(50 * 1000);
                uint64_t now = tdp__cuda_pins_landed();
                if (now > landed && now == seen && i * 50 > PIN_MS + 500)
                    break;
                seen = now;
            }
            assert_true(tdp__cuda_pins_landed() > landed);
            for (uint64_t tag = 2; tag < 6; tag++)
                one(&e, td, tag);
            /* a prepared layout: the prepare returns once its memory is
             * page-locked (this side's, and the peer's where it answers) */
            int64_t t0 = mono_ms();
            OK(tdp_pipe_prepare(e.cli, sc2, TMO));
            took = mono_ms() - t0;
            print_message("%s: prepare: %lld ms\n", tdp_plane_name(plane), (long long)took);
            assert_true(took >= PIN_MS - 50);
            one(&e, td2, 7);
        }
        /* round 1: closed with the registrations still running */
        env_down(&e);
    }
    tdp__cuda_fake_set_register_ms(0);
    tdp_td_unref(td);
    tdp_td_unref(td2);
    tdp_schema_unref(sc);
    tdp_schema_unref(sc2);
}

static void test_shm(void **state)
{
    (void)state;
    run(TDP_PLANE_SHM);
}

static void test_ucx(void **state)
{
    (void)state;
    run(TDP_PLANE_UCX);
}

static void test_tcp(void **state)
{
    (void)state;
    run(TDP_PLANE_TCP);
}

static int setup(void **state)
{
    (void)state;
    OK(tdp__cuda_select("fake"));
    tdp__cuda_fake_set_delay_us(100);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_shm, setup),
        cmocka_unit_test_setup(test_ucx, setup),
        cmocka_unit_test_setup(test_tcp, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_log: levels, the installable handler, the default handler, TDP_LOG_LEVEL. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <tdpipe/log.h>
#include <tdpipe/schema.h>

#include "core/log.h" /* the internal macros, to log at an exact level */

typedef struct captured {
    int calls;
    tdp_log_level level;
    char file[256];
    int line;
    char msg[1024];
} captured;

static void capture(tdp_log_level level, const char *file, int line, const char *msg, void *arg)
{
    captured *c = arg;
    c->calls++;
    c->level = level;
    snprintf(c->file, sizeof(c->file), "%s", file ? file : "");
    c->line = line;
    snprintf(c->msg, sizeof(c->msg), "%s", msg ? msg : "");
}

/* A decode failure: the schema module logs it at debug level. */
static tdp_err failing_decode(void)
{
    static const char bad[] = "{not json";
    tdp_schema *s = NULL;
    tdp_err rc = tdp_schema_decode(bad, sizeof(bad) - 1, NULL, &s, NULL, 0);
    assert_null(s);
    return rc;
}

static int teardown_restore(void **state)
{
    (void)state;
    tdp_log_set_handler(NULL, NULL);
    tdp_log_set_level(TDP_LOG_OFF);
    return 0;
}

static void test_quiet_by_default(void **state)
{
    (void)state;
    if (getenv("TDP_LOG_LEVEL") != NULL)
        skip(); /* the environment raised the level on purpose */
    assert_int_equal(tdp_log_get_level(), TDP_LOG_OFF);

    captured c = {0};
    tdp_log_set_handler(capture, &c);
    assert_int_equal(failing_decode(), TDP_ESCHEMA);
    assert_int_equal(c.calls, 0);
}

static void test_handler_receives_debug_with_location(void **state)
{
    (void)state;
    captured c = {0};
    tdp_log_set_handler(capture, &c);
    tdp_log_set_level(TDP_LOG_DEBUG);
    assert_int_equal(failing_decode(), TDP_ESCHEMA);
    assert_true(c.calls >= 1);
    assert_int_equal(c.level, TDP_LOG_DEBUG);
    assert_non_null(strstr(c.file, "schema")); /* logged from src/schema/ */
    assert_true(c.line > 0);
    assert_non_null(strstr(c.msg, "JSON"));
    assert_null(strchr(c.msg, '\n'));
}

static void test_level_threshold(void **state)
{
    (void)state;
    captured c = {0};
    tdp_log_set_handler(capture, &c);

    tdp_log_set_level(TDP_LOG_WARN);
    assert_int_equal(tdp_log_get_level(), TDP_LOG_WARN);
    tdp_log_debug("dropped %d", 1);
    tdp_log_info("dropped %d", 2);
    assert_int_equal(failing_decode(), TDP_ESCHEMA); /* debug: dropped */
    assert_int_equal(c.calls, 0);

    tdp_log_warn("kept %d", 3);
    assert_int_equal(c.calls, 1);
    assert_int_equal(c.level, TDP_LOG_WARN);
    assert_string_equal(c.msg, "kept 3");
    assert_int_equal(c.line, __LINE__ - 4);
    assert_non_null(strstr(c.file, "test_log.c"));

    tdp_log_error("also kept");
    assert_int_equal(c.calls, 2);
    assert_int_equal(c.level, TDP_LOG_ERROR);

    tdp_log_set_level(TDP_LOG_TRACE);
    tdp_log_trace("trace %s", "line");
    assert_int_equal(c.calls, 3);
    assert_int_equal(c.level, TDP_LOG_TRACE);
    assert_string_equal(c.msg, "trace line");

    tdp_log_set_level(TDP_LOG_OFF);
    tdp_log_error("nothing at off");
    assert_int_equal(c.calls, 3);
}

static void test_set_level_clamps(void **state)
{
    (void)state;
    tdp_log_set_level((tdp_log_level)99);
    assert_int_equal(tdp_log_get_level(), TDP_LOG_TRACE);
    tdp_log_set_level((tdp_log_level)-5);
    assert_int_equal(tdp_log_get_level(), TDP_LOG_OFF);
}

static void test_level_parse(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        tdp_log_level lvl;
    } good[] = {
        {"off", TDP_LOG_OFF},   {"error", TDP_LOG_ERROR}, {"warn", TDP_LOG_WARN},
        {"info", TDP_LOG_INFO}, {"debug", TDP_LOG_DEBUG}, {"trace", TDP_LOG_TRACE},
        {"OFF", TDP_LOG_OFF},   {"Error", TDP_LOG_ERROR}, {"WARN", TDP_LOG_WARN},
        {"InFo", TDP_LOG_INFO}, {"DEBUG", TDP_LOG_DEBUG}, {"tRaCe", TDP_LOG_TRACE},
    };
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        tdp_log_level out = (tdp_log_level)77;
        assert_int_equal(tdp_log_level_parse(good[i].name, &out), TDP_OK);
        assert_int_equal(out, good[i].lvl);
    }

    static const char *const bad[] = {"",    "verbose", "warning", "debug ", " debug", "deb",
                                      "err", "5",       "trace\n", "off2",   "fatal",  "none"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tdp_log_level out = (tdp_log_level)77;
        assert_int_equal(tdp_log_level_parse(bad[i], &out), TDP_EINVAL);
        assert_int_equal(out, (tdp_log_level)77); /* untouched on failure */
    }
    tdp_log_level out;
    assert_int_equal(tdp_log_level_parse(NULL, &out), TDP_EINVAL);
    assert_int_equal(tdp_log_level_parse("info", NULL), TDP_EINVAL);
}

/* NULL restores the default handler, which writes one line to stderr. */
static void test_restore_default_handler(void **state)
{
    (void)state;
    captured c = {0};
    tdp_log_set_handler(capture, &c);
    tdp_log_set_level(TDP_LOG_DEBUG);
    tdp_log_set_handler(NULL, NULL);

    FILE *tmp = tmpfile();
    assert_non_null(tmp);
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    assert_true(saved >= 0);
    assert_true(dup2(fileno(tmp), STDERR_FILENO) >= 0);
    tdp_log_info("default handler line %d", 7);
    assert_int_equal(failing_decode(), TDP_ESCHEMA);
    fflush(stderr);
    assert_true(dup2(saved, STDERR_FILENO) >= 0);
    close(saved);

    char text[4096] = {0};
    rewind(tmp);
    size_t n = fread(text, 1, sizeof(text) - 1, tmp);
    fclose(tmp);
    text[n] = '\0';

    assert_int_equal(c.calls, 0); /* the old handler is gone */
    assert_non_null(strstr(text, "tdpipe info"));
    assert_non_null(strstr(text, "test_log.c:"));
    assert_non_null(strstr(text, "default handler line 7\n"));
    assert_non_null(strstr(text, "tdpipe debug"));
    assert_non_null(strstr(text, "schema: JSON error"));
}

/* TDP_LOG_LEVEL is read before main: check it in a fresh process. */
static void test_env_sets_level(void **state)
{
    (void)state;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char *const argv[] = {(char *)"test_log", (char *)"--env-child", NULL};
        /* the rest of the environment stays: the loader may need LD_LIBRARY_PATH */
        setenv("TDP_LOG_LEVEL", "Debug", 1);
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);

    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char *const argv[] = {(char *)"test_log", (char *)"--env-child-bad", NULL};
        setenv("TDP_LOG_LEVEL", "loud", 1);
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--env-child") == 0)
        return tdp_log_get_level() == TDP_LOG_DEBUG ? 0 : 1;
    if (argc == 2 && strcmp(argv[1], "--env-child-bad") == 0)
        return tdp_log_get_level() == TDP_LOG_OFF ? 0 : 1; /* bad names are ignored */

    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_quiet_by_default, teardown_restore),
        cmocka_unit_test_teardown(test_handler_receives_debug_with_location, teardown_restore),
        cmocka_unit_test_teardown(test_level_threshold, teardown_restore),
        cmocka_unit_test_teardown(test_set_level_clamps, teardown_restore),
        cmocka_unit_test(test_level_parse),
        cmocka_unit_test_teardown(test_restore_default_handler, teardown_restore),
        cmocka_unit_test(test_env_sets_level),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

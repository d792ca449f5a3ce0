/*
 * test_free_null: every public free and unref function takes NULL and does
 * nothing, as each header comment says, and this list is the whole set
 * (the public headers are read to find them all).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <tdpipe/tdpipe.h>

static void test_each_free_takes_null(void **state)
{
    (void)state;
    tdp_mem_stats before, after;
    tdp_mem_stats_get(&before);

    tdp_loop_free(NULL);
    for (int t = 0; t < TDP_MEM_TYPE_COUNT; t++)
        tdp_mem_free((tdp_mem_type)t, NULL);
    tdp_listener_free(NULL);
    tdp_op_free(NULL);
    tdp_pipe_free(NULL);
    tdp_schema_unref(NULL);
    tdp_schema_builder_free(NULL);
    tdp_server_free(NULL);
    tdp_fanout_free(NULL);
    tdp_fanin_free(NULL);
    tdp_td_unref(NULL);

    /* and none of them counted a free */
    tdp_mem_stats_get(&after);
    for (int t = 0; t < TDP_MEM_TYPE_COUNT; t++)
        assert_int_equal(after.frees[t], before.frees[t]);
}

/* The functions test_each_free_takes_null calls. */
static const char *const covered[] = {
    "tdp_loop_free", "tdp_mem_free",     "tdp_listener_free",       "tdp_op_free",
    "tdp_pipe_free", "tdp_schema_unref", "tdp_schema_builder_free", "tdp_server_free",
    "tdp_td_unref",  "tdp_fanout_free",  "tdp_fanin_free",
};

static bool is_covered(const char *name)
{
    for (size_t i = 0; i < sizeof(covered) / sizeof(covered[0]); i++)
        if (strcmp(covered[i], name) == 0)
            return true;
    return false;
}

/* A "TDP_API void tdp_..._free(" or "_unref(" declaration: its name, else false. */
static bool free_decl(const char *line, char *name, size_t len)
{
    const char *p = strstr(line, "TDP_API void tdp_");
    if (p == NULL)
        return false;
    p += strlen("TDP_API void ");
    size_t n = strcspn(p, "(");
    if (p[n] != '(' || n >= len)
        return false;
    memcpy(name, p, n);
    name[n] = '\0';
    return (n > 5 && strcmp(name + n - 5, "_free") == 0) ||
           (n > 6 && strcmp(name + n - 6, "_unref") == 0);
}

static void test_list_is_complete(void **state)
{
    (void)state;
    char dir[1024];
    snprintf(dir, sizeof(dir), "%s/tdpipe", TDP_INCLUDE_DIR);
    DIR *d = opendir(dir);
    if (d == NULL)
        fail_msg("cannot open %s", dir);
    int found = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        size_t n = strlen(e->d_name);
        if (n < 3 || strcmp(e->d_name + n - 2, ".h") != 0)
            continue;
        char path[2048], line[512], name[128];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            fail_msg("cannot read %s", path);
        while (fgets(line, sizeof(line), f) != NULL) {
            if (!free_decl(line, name, sizeof(name)))
                continue;
            found++;
            if (!is_covered(name))
                fail_msg("%s (%s) is not called with NULL here", name, e->d_name);
        }
        fclose(f);
    }
    closedir(d);
    assert_int_equal(found, (int)(sizeof(covered) / sizeof(covered[0])));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_free_takes_null),
        cmocka_unit_test(test_list_is_complete),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

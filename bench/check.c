/*
 * check.c: `tdp_peers check FILE...`, for the smoke test — each file is a
 * result of tdpipe bench or tdp_peers, has results, and every figure the
 * table uses is a positive number. It says nothing about speed.
 */
#include <stdio.h>
#include <string.h>

#include "peers.h"

static bool known_tool(json_t *root)
{
    const char *tool = json_string_value(json_object_get(root, "tool"));
    return tool != NULL && (strcmp(tool, "tdpipe bench") == 0 || strcmp(tool, "tdp_peers") == 0);
}

/* A positive number at results[i].group.key. */
static bool positive(json_t *e, const char *group, const char *key)
{
    json_t *v = json_object_get(json_object_get(e, group), key);
    return json_is_number(v) && json_number_value(v) > 0;
}

int peers_check_main(int argc, char **argv)
{
    static const char *const need[][2] = {
        {"latency_us", "mean"},       {"latency_us", "p50"},     {"latency_us", "p99"},
        {"throughput_Bps", "median"}, {"throughput_Bps", "min"}, {"throughput_Bps", "max"},
    };
    int bad = argc < 2;
    for (int i = 1; i < argc; i++) {
        json_error_t err;
        json_t *root = json_load_file(argv[i], 0, &err), *res, *e;
        size_t k;
        if (root == NULL || !known_tool(root)) {
            fprintf(stderr, "tdp_peers check: %s: %s\n", argv[i],
                    root ? "not a tdpipe bench or tdp_peers result" : err.text);
            bad++;
            json_decref(root);
            continue;
        }
        res = json_object_get(root, "results");
        if (json_array_size(res) == 0) {
            fprintf(stderr, "tdp_peers check: %s: no results\n", argv[i]);
            bad++;
        }
        json_array_foreach(res, k, e)
        {
            for (size_t f = 0; f < sizeof(need) / sizeof(need[0]); f++) {
                if (!positive(e, need[f][0], need[f][1])) {
                    fprintf(stderr, "tdp_peers check: %s: results[%zu].%s.%s is not positive\n",
                            argv[i], k, need[f][0], need[f][1]);
                    bad++;
                }
            }
        }
        json_decref(root);
    }
    return bad ? 1 : 0;
}

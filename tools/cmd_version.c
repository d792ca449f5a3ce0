/* cmd_version.c: `tdpipe version` — what this binary runs on. */
#include <stdio.h>
#include <ucp/api/ucp.h>

#include "cli.h"

static const char version_help[] =
    "usage: tdpipe version\n\n"
    "Print the library version (and the headers this tool was built with), the\n"
    "wire protocol and schema format versions, the CUDA backend in use and its\n"
    "devices (TDPIPE_CUDA selects it: docs/gpu.md),\n"
    "the UCX version and the data plane names '--plane' accepts, one 'key: value'\n"
    "line each.\n";

int tdp_cmd_version(int argc, char **argv)
{
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'},
        {"verbose", no_argument, NULL, 'v'},
        {NULL, 0, NULL, 0},
    };
    int c;

    tdp_cli_getopt_reset();
    while ((c = getopt_long(argc, argv, ":vh", opts, NULL)) != -1) {
        if (c == 'v') {
            tdp_cli_more_verbose();
            continue;
        }
        if (c != 'h')
            return tdp_cli_bad_option("version", argv, c);
        fputs(version_help, stdout);
        return TDP_EXIT_OK;
    }
    if (optind < argc)
        return tdp_cli_usage_error("version", "unexpected argument '%s'", argv[optind]);

    printf("tdpipe:   %s (built with headers %d.%d.%d)\n", tdp_version_string(), TDP_VERSION_MAJOR,
           TDP_VERSION_MINOR, TDP_VERSION_PATCH);
    printf("protocol: %d\n", TDP_PROTOCOL_VERSION);
    printf("schema:   format %d\n", TDP_SCHEMA_FORMAT_VERSION);
    char cuda[128];
    printf("cuda:     %s\n", tdp_cuda_describe(cuda, sizeof(cuda)));
    printf("ucx:      %s\n", ucp_get_version_string());
    char planes[128];
    printf("planes:   %s\n", tdp_cli_plane_names(planes, sizeof(planes)));
    char huge[128];
    printf("huge pages: %s\n", tdp_mem_huge_describe(huge, sizeof(huge)));
    return TDP_EXIT_OK;
}

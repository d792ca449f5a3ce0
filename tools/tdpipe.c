/*
 * tdpipe.c: the `tdpipe` command — global options, then one subcommand.
 *
 *   tdpipe [-v|--verbose]... SUBCOMMAND [OPTIONS] [ARGS]
 *
 * See docs/cli.md; the man page (tdpipe.1) is generated from the help
 * texts by tools/mkman.sh.
 */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

typedef struct subcommand {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} subcommand;

static const subcommand subcommands[] = {
    {"bench", tdp_cmd_bench, "measure throughput and latency over loopback"},
    {"serve", tdp_cmd_serve, "run a server: echo messages back, or verify and drop them"},
    {"send", tdp_cmd_send, "connect and stream synthetic tensordicts, or a file's tensors"},
    {"recv", tdp_cmd_recv, "listen, accept one producer, receive and verify"},
    {"inspect", tdp_cmd_inspect, "listen, accept one producer, print its schema and messages"},
    {"version", tdp_cmd_version, "print library, protocol, CUDA and UCX versions"},
    {"help", NULL, "show this help, or a subcommand's (tdpipe help SUBCOMMAND)"},
};
#define NSUB (sizeof(subcommands) / sizeof(subcommands[0]))

static const char *doc_dir(void);

static void usage(FILE *f)
{
    fprintf(f, "usage: tdpipe [-v|--verbose]... SUBCOMMAND [OPTIONS] [ARGS]\n\n"
               "Stream tensordicts between processes over UCX.\n\n"
               "Subcommands:\n");
    for (size_t i = 0; i < NSUB; i++)
        fprintf(f, "  %-9s %s\n", subcommands[i].name, subcommands[i].summary);
    fprintf(f,
            "\nGlobal options:\n"
            "  -v, --verbose   library log level: -v info, -vv debug, -vvv trace\n"
            "                  (before or after the subcommand)\n"
            "  -h, --help      show this help (after a subcommand: its own)\n"
            "  -V, --version   same as 'tdpipe version' (before a subcommand)\n\n"
            "Each subcommand takes --help ('tdpipe help SUBCOMMAND' says the same).\n\n"
            "%s\n"
            "Documentation: 'man tdpipe'; README.md, docs/ (docs/cli.md for this\n"
            "command) and examples/, in the source tree and installed in\n%s\n",
            TDP_CLI_EXIT_HELP, doc_dir());
}

/*
 * Where the guides are installed: next to this binary's prefix when they
 * are there (an install moved with --prefix or DESTDIR still finds them),
 * else where the build was configured to put them.
 */
static const char *doc_dir(void)
{
    static char found[PATH_MAX];
    char exe[PATH_MAX], guess[2 * PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash != NULL) {
            *slash = '\0';
            snprintf(guess, sizeof(guess), "%s/%s", exe, TDP_CLI_DOCDIR_FROM_BINDIR);
            if (realpath(guess, found) != NULL)
                return found;
        }
    }
    return TDP_CLI_DOCDIR;
}

/*
 * `tdpipe help --list`: one line per subcommand, "NAME<TAB>SUMMARY", for
 * scripts (the man page is generated from it and from each --help).
 */
static void list_subcommands(void)
{
    for (size_t i = 0; i < NSUB; i++)
        printf("%s\t%s\n", subcommands[i].name, subcommands[i].summary);
}

static const subcommand *find_subcommand(const char *name)
{
    for (size_t i = 0; i < NSUB; i++)
        if (strcmp(subcommands[i].name, name) == 0)
            return &subcommands[i];
    return NULL;
}

/*
 * `tdpipe help [SUBCOMMAND]`: the subcommand's own --help, or the list;
 * `tdpipe help --list`: the names and summaries alone.
 */
static int run_help(int argc, char **argv)
{
    if (argc < 2) {
        usage(stdout);
        return TDP_EXIT_OK;
    }
    if (strcmp(argv[1], "--list") == 0) {
        list_subcommands();
        return TDP_EXIT_OK;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(stdout);
        return TDP_EXIT_OK;
    }
    const subcommand *sc = find_subcommand(argv[1]);
    if (sc == NULL || sc->run == NULL) {
        if (sc != NULL) {
            usage(stdout);
            return TDP_EXIT_OK;
        }
        return tdp_cli_usage_error(NULL, "unknown subcommand '%s'", argv[1]);
    }
    char *sub_argv[] = {argv[1], "--help", NULL};
    return sc->run(2, sub_argv);
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    int verbose = 0, c;

    /* a peer that vanishes must surface as an error code, not kill us */
    signal(SIGPIPE, SIG_IGN);
    /* scripts read our lines as they come (e.g. "listening on ...") */
    setvbuf(stdout, NULL, _IOLBF, 0);

    tdp_cli_route_ucx_log();
    tdp_cli_getopt_reset();
    /* '+': stop at the subcommand; what follows is its own */
    while ((c = getopt_long(argc, argv, "+:vhV", opts, NULL)) != -1) {
        switch (c) {
        case 'v':
            verbose++;
            break;
        case 'h':
            usage(stdout);
            return TDP_EXIT_OK;
        case 'V': {
            char *vargv[] = {"version", NULL};
            return tdp_cmd_version(1, vargv);
        }
        default:
            return tdp_cli_bad_option(NULL, argv, c);
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return TDP_EXIT_USAGE;
    }
    tdp_cli_set_verbosity(verbose);

    int sub_argc = argc - optind;
    char **sub_argv = argv + optind;
    const subcommand *sc = find_subcommand(sub_argv[0]);
    if (sc == NULL)
        return tdp_cli_usage_error(NULL, "unknown subcommand '%s'", sub_argv[0]);
    if (sc->run == NULL)
        return run_help(sub_argc, sub_argv);
    return sc->run(sub_argc, sub_argv);
}

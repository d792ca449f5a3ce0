/*
 * cli.h: helpers shared by the subcommands of the `tdpipe` tool.
 *
 * Nothing here is part of the library: these are the conventions every
 * subcommand follows, so that `send`, `recv`, `serve`, `inspect` and
 * `bench` parse, print and fail the same way. See docs/cli.md for the user's
 * view.
 *
 * Conventions:
 *   - Options are parsed with getopt_long (long and short forms); a
 *     subcommand starts with tdp_cli_getopt_reset() and reports a bad
 *     option with tdp_cli_bad_option(), which returns TDP_EXIT_USAGE.
 *   - Errors go to stderr as one line, "tdpipe CMD: what: why"; results go
 *     to stdout. stdout is line-buffered (main sets it up), so a script that
 *     reads "listening on HOST:PORT" sees it at once.
 *   - The exit status is one of tdp_cli_exit; tdp_cli_exit_for() maps a
 *     library error to it.
 */
#ifndef TDPIPE_TOOLS_CLI_H
#define TDPIPE_TOOLS_CLI_H

#include <getopt.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <tdpipe/tdpipe.h>

/* ---- exit codes -------------------------------------------------------- */

/* Exit status of every subcommand (docs/cli.md has the table). */
typedef enum tdp_cli_exit {
    TDP_EXIT_OK = 0,      /* done as asked */
    TDP_EXIT_FAIL = 1,    /* runtime failure: transfer or verification error */
    TDP_EXIT_USAGE = 2,   /* bad command line */
    TDP_EXIT_CONNECT = 3, /* cannot connect or listen: refused, unreachable, address in use */
    TDP_EXIT_PEER = 4,    /* the peer ended with an error: reset, protocol error, schema */
    TDP_EXIT_TIMEOUT = 5, /* a deadline passed */
} tdp_cli_exit;

/*
 * The exit status for a library error. TDP_OK gives 0. A clean end
 * (TDP_ECLOSED) gives TDP_EXIT_PEER: where the caller expected the peer to
 * go on, its leaving early is the peer's doing; callers for which a clean
 * end is success test for TDP_ECLOSED first.
 */
int tdp_cli_exit_for(tdp_err err);

/* ---- numbers, sizes, rates ---------------------------------------------- */

/* "s" unless n is 1: "%" PRIu64 " message%s", n, tdp_cli_s(n). */
static inline const char *tdp_cli_s(uint64_t n)
{
    return n == 1 ? "" : "s";
}

/*
 * Parse an unsigned decimal integer in [min, max], whole string. False on
 * anything else (sign, junk, overflow, out of range).
 */
bool tdp_cli_parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out);

/* Parse a finite, non-negative decimal real ("2.5", "1e3"). */
bool tdp_cli_parse_double(const char *s, double *out);

/*
 * Parse a timeout in milliseconds: 1..TDP_CLI_TIMEOUT_MAX_MS (about 31
 * years, so that it still fits in nanoseconds), or -1 for "wait forever".
 * 0 is refused: as a deadline it fails every wait at once, and a user who
 * types it means "none" as often as "now".
 */
#define TDP_CLI_TIMEOUT_MAX_MS 1000000000000ull
bool tdp_cli_parse_timeout(const char *s, int64_t *ms);

/*
 * Parse a --keepalive value "IDLE,INTVL,CNT": seconds before the first
 * probe (1..32767), seconds between probes (1..32767), probes (1..127), the
 * ranges Linux takes; into the pipe options' keepalive fields. False on
 * anything else; *o is written only on success.
 */
bool tdp_cli_parse_keepalive(const char *s, tdp_pipe_opts *o);

/*
 * --secret-file PATH: the file's bytes, as they are (a trailing newline
 * included), become o->secret (kept for the life of the process). On
 * failure prints why for cmd and returns false: unreadable, or not
 * TDP_SECRET_MIN..TDP_SECRET_MAX bytes.
 */
bool tdp_cli_read_secret(const char *cmd, const char *path, tdp_pipe_opts *o);

/*
 * Onto o, what --keepalive, --secret-file and --checksum put in given (the fields they
 * set; left as they are where the flag was not given), and given's receive window as it
 * is (--window, 0 for off: start given from tdp_pipe_opts_default).
 */
void tdp_cli_apply_net_opts(const tdp_pipe_opts *given, tdp_pipe_opts *o);

/*
 * Parse a byte count, the one grammar of every subcommand
 * (tdp_bm_parse_size_why in bench_method.h): a number, integer or decimal
 * fraction, and an optional unit, with or without a space:
 *   none or B              bytes
 *   K, M, G, T (+ B)       SI: 1000^1..4        ("1M" = "1MB" = 1000000)
 *   Ki, Mi, Gi, Ti (+ B)   IEC: 1024^1..4       ("1MiB" = 1048576)
 * The prefix is case-insensitive, the B is not: "1Mb" (megabits) is
 * refused. Fractions must come to a whole number of bytes ("1.5MB" =
 * 1500000). False on anything else, with *why (if not NULL) saying what.
 */
bool tdp_cli_parse_size(const char *s, uint64_t *out, const char **why);

/* --window SIZE: 0 (off) or 4 KiB .. 1 GiB (tdp_pipe_opts.recv_window_bytes) */
#define TDP_CLI_WINDOW_MIN 4096u
#define TDP_CLI_WINDOW_MAX (1ull << 30)
/* Parses --window's value into *out; on failure prints cmd's usage error and
 * returns the exit status, else -1. */
int tdp_cli_parse_window(const char *cmd, const char *s, uint64_t *out);

/*
 * Format a byte count for people, SI units, three significant digits:
 * "512 B", "64.0 KB", "1.00 MB", "12.3 GB". Writes into buf and returns it.
 */
const char *tdp_cli_format_size(uint64_t bytes, char *buf, size_t len);

/* Format a rate in bytes per second the same way: "5.71 GB/s", "0 B/s". */
const char *tdp_cli_format_rate(double bytes_per_s, char *buf, size_t len);

/* Enough for any string the two formatters write. */
#define TDP_CLI_FMT_LEN 32

/* ---- addresses ------------------------------------------------------------ */

/* Longest host name or address we accept, NUL included. */
#define TDP_CLI_HOST_LEN 256

/*
 * Split "HOST:PORT" into its parts. HOST is a name, an IPv4 literal or an
 * IPv6 literal in brackets ("[::1]:5000"; the brackets are removed). A bare
 * IPv6 literal without brackets is refused (its colons are ambiguous).
 * PORT is 1..65535 unless allow_zero (then 0 too). False on any error; host
 * (of hostlen bytes) and *port are written only on success.
 */
bool tdp_cli_parse_hostport(const char *s, bool allow_zero, char *host, size_t hostlen,
                            uint16_t *port);

/* Parse a port number 0..65535 (0 only if allow_zero). */
bool tdp_cli_parse_port(const char *s, bool allow_zero, uint16_t *port);

/*
 * Format host and port for display and for scripts: "127.0.0.1:5000",
 * "[::1]:5000", and "[::]:5000" for a NULL or empty host (all addresses).
 */
const char *tdp_cli_format_hostport(const char *host, uint16_t port, char *buf, size_t len);

/* ---- data planes ------------------------------------------------------------ */

/*
 * Parse a --plane value with tdp_plane_parse (so every name the library
 * knows is accepted, "auto" included). On a bad name, print "tdpipe CMD:
 * unknown plane 'X' (valid: auto, ucx, ...)" and the --help pointer, and
 * return false (the caller exits with TDP_EXIT_USAGE).
 */
bool tdp_cli_parse_plane(const char *cmd, const char *s, tdp_plane *out);

/* The names tdp_plane_parse accepts, comma-separated, into buf. */
const char *tdp_cli_plane_names(char *buf, size_t len);

/* The plane a pipe uses, for summaries: "ucx", "shm"; "?" before the HELLO. */
const char *tdp_cli_plane_of(const tdp_pipe *pipe);

/*
 * Why listening on host:port failed, in words, for the library's
 * TDP_EADDR (which covers them all): the name does not resolve, the port
 * is in use, the address is not one of this host's, or the port needs
 * privileges. Found by resolving and binding a scratch socket the way the
 * library does; host NULL or "" is every address. Prints "tdpipe CMD:
 * cannot listen on WHERE: WHY" and returns the exit status. Other errors
 * are printed with tdp_cli_strerror.
 */
int tdp_cli_listen_failed(const char *cmd, const char *host, uint16_t port, tdp_err rc);

/*
 * Why a connect to host:port failed, in words: "not a tdpipe peer",
 * "closed during handshake", "cannot resolve", ... Prints "tdpipe CMD:
 * cannot connect to WHERE: WHY" and returns the exit status (3, or 5 for a
 * deadline).
 */
int tdp_cli_connect_failed(const char *cmd, const char *host, uint16_t port, tdp_err rc,
                           tdp_plane plane);

/* tdp_strerror, with a pointer to -v for UCX errors (UCX's log is quiet). */
const char *tdp_cli_strerror(tdp_err rc);

/*
 * This host's addresses another host could connect to on port: the IPv4
 * and IPv6 addresses of every interface that is up and not loopback
 * (IPv6 link-local ones are left out: they need a zone to be used),
 * without repeats, formatted "10.0.0.5:5000, [2001:db8::5]:5000" into buf
 * (at most 8; "and N more" after). Returns how many there are. Only
 * printed: nothing connects to them.
 */
int tdp_cli_host_addresses(uint16_t port, char *buf, size_t len);

/*
 * "listening on HOST:PORT" (the first line on stdout, which scripts read),
 * and when listening on every address, a second line with the addresses
 * another host can use: "other hosts: 10.0.0.5:5000, ..." or "other
 * hosts: none (no address besides loopback)".
 */
void tdp_cli_print_listening(const char *bind, uint16_t port);

/* ---- synthetic payloads --------------------------------------------------- */

/* Key of the tensor leaf of the synthetic schema. */
#define TDP_CLI_SYNTH_LEAF "data"

/*
 * The schema `send` and `bench` stream: a root TensorDict holding one
 * float32 leaf "data" of shape [n] at offset 0 with no padding, and a nested
 * TensorDict "meta" holding one non-tensor value, meta.source = "tdpipe".
 * The consolidated buffer is exactly `nbytes` bytes when nbytes is a multiple
 * of 4, otherwise nbytes rounded up to the next multiple of 4 (n =
 * ceil(nbytes / 4)); nbytes 0 is allowed (an empty leaf). The schema is
 * made from JSON rather than with the builder because the builder pads
 * leaves to 64 bytes, and message sizes should be what the user asked for.
 * `dev` is the buffer's device. *out holds one reference on success.
 */
tdp_err tdp_cli_synth_schema(uint64_t nbytes, tdp_device dev, tdp_schema **out);

/* The buffer size tdp_cli_synth_schema makes for a requested size. */
uint64_t tdp_cli_synth_bytes(uint64_t nbytes);

/*
 * The schema `tdpipe send` streams: the synthetic one, with one more value
 * in "meta", meta.echo = true or false, which tells the receiver whether
 * this producer reads a reply to each message (`send --echo`). Receivers
 * read it with tdp_cli_wants_echo, so that every pair of tdpipe commands
 * either works or fails at once saying which flag to change.
 */
tdp_err tdp_cli_send_schema(uint64_t nbytes, tdp_device dev, bool echo, tdp_schema **out);

/*
 * What the producer of a stream with schema s expects back: 1 when it
 * waits for each message to be echoed (`send --echo`), 0 when it reads
 * nothing (`send`), -1 when the schema is not `tdpipe send`'s (another
 * producer: nothing is known).
 */
int tdp_cli_wants_echo(const tdp_schema *s);

/*
 * Notices: a receiver that cannot serve a tdpipe producer as it asks sends
 * it one small message whose schema carries meta.notice = CODE and
 * meta.from = who (e.g. "tdpipe recv"), then closes cleanly. The producer
 * reads it where it expected an echo or a clean end, and says what to do.
 */
#define TDP_CLI_NOTICE_NO_ECHO "no-echo" /* this receiver never sends messages back */
#define TDP_CLI_NOTICE_ECHOES  "echoes"  /* this receiver sends every message back */

/* A notice message (host memory, a few bytes); *out holds one reference. */
tdp_err tdp_cli_notice_new(const char *code, const char *from, tdp_td **out);

/*
 * The code of the notice td carries, or NULL when it is not a notice; the
 * sender's name goes into from (of len bytes, "?" when absent).
 */
const char *tdp_cli_notice_of(const tdp_td *td, char *from, size_t len);

/*
 * Fill the whole consolidated buffer of td (host memory) with the pattern
 * of message `seq`: 64-bit words that depend on seq and their index, so a
 * message that arrives out of order, twice or torn is caught. Works on any
 * schema (the whole buffer, padding included), 8 bytes at a time; a tail of
 * fewer than 8 bytes gets the low bytes of the next word. TDP_ENOTSUP for a
 * buffer that is not in host memory.
 */
tdp_err tdp_cli_fill(tdp_td *td, uint64_t seq);

/*
 * Check td's buffer against the pattern of `seq`. TDP_OK when it matches;
 * TDP_EMISMATCH when it does not, with the offset of the first wrong 8-byte
 * word in *bad_offset (if not NULL); TDP_ENOTSUP for device memory.
 */
tdp_err tdp_cli_verify(const tdp_td *td, uint64_t seq, uint64_t *bad_offset);

/* The same on a plain host buffer (what fill/verify apply to td's buffer). */
void tdp_cli_fill_buf(void *buf, uint64_t len, uint64_t seq);
bool tdp_cli_verify_buf(const void *buf, uint64_t len, uint64_t seq, uint64_t *bad_offset);

/* ---- time ------------------------------------------------------------------ */

/* CLOCK_MONOTONIC in nanoseconds: for durations and rates only. */
uint64_t tdp_cli_now_ns(void);

/* Sleep until the monotonic clock reads deadline_ns (returns at once if past). */
void tdp_cli_sleep_until_ns(uint64_t deadline_ns);

/* A throughput meter: totals since start. Not thread-safe. */
typedef struct tdp_cli_meter {
    uint64_t start_ns;
    uint64_t msgs, bytes; /* totals */
} tdp_cli_meter;

/* Start counting now (the rate lines are report.h's). */
void tdp_cli_meter_start(tdp_cli_meter *m);

/* Count one message of `bytes` bytes. */
static inline void tdp_cli_meter_add(tdp_cli_meter *m, uint64_t bytes)
{
    m->msgs++;
    m->bytes += bytes;
}

/*
 * The totals as one line (no newline) into buf:
 * "VERB N messages (SIZE) in S.SSS s: RATE, M msgs/s", e.g.
 * "received 50 messages (3.20 MB) in 0.012 s: 266 MB/s, 4167 msgs/s".
 * The duration runs from start to now_ns. Returns buf.
 */
const char *tdp_cli_meter_summary(const tdp_cli_meter *m, const char *verb, uint64_t now_ns,
                                  char *buf, size_t len);

/* ---- interruption ------------------------------------------------------------ */

/*
 * SIGINT and SIGTERM for `send`, `recv` and `inspect`: call this first,
 * before any thread exists (the loop's, UCX's), so that they all inherit
 * the signals blocked. A watcher thread takes them with sigwait: the first
 * only sets a flag (tdp_cli_interrupted), which the command polls between
 * messages and in its waits, so it closes the stream cleanly and prints its
 * summary; a second one (half a second or more after the first: a
 * process-group kill may deliver one signal twice) ends the process at
 * once with the signal's default action. No handler ever runs inside the library. Returns false
 * if the watcher cannot be started (the signals then act as by default).
 */
bool tdp_cli_catch_signals(void);

/* The first SIGINT/SIGTERM caught, or 0. */
int tdp_cli_interrupted(void);

/* The exit status for an interruption by sig: 128 + sig (130, 143). */
#define TDP_EXIT_SIGNAL(sig) (128 + (sig))

/* ---- option parsing ------------------------------------------------------- */

/*
 * Prepare getopt_long for a subcommand's own argv (argv[0] is the
 * subcommand's name): resets getopt's state and turns its own messages off,
 * so that tdp_cli_bad_option can say which subcommand complained.
 */
void tdp_cli_getopt_reset(void);

/*
 * After getopt_long returned '?' or ':' (when the short option string
 * starts with ':'): print "tdpipe CMD: unknown option '--x'" or "option
 * '--x' needs a value", and a pointer to CMD --help, on stderr. Returns
 * TDP_EXIT_USAGE.
 */
int tdp_cli_bad_option(const char *cmd, char **argv, int c);

/*
 * Print "tdpipe CMD: MESSAGE" and the --help pointer on stderr; returns
 * TDP_EXIT_USAGE. For bad option values and missing or extra arguments.
 */
int tdp_cli_usage_error(const char *cmd, const char *fmt, ...) TDP_CHECK_FMT(2, 3);

/* Print "tdpipe CMD: MESSAGE" on stderr (runtime errors). */
void tdp_cli_error(const char *cmd, const char *fmt, ...) TDP_CHECK_FMT(2, 3);

/*
 * Verbosity (verbosity.c). tdp_cli_set_verbosity: the -v count given before
 * the subcommand. tdp_cli_more_verbose: one more -v, given after it
 * (`tdpipe send ... -v`), the same as before it; every subcommand takes
 * -v/--verbose. tdp_cli_route_ucx_log: UCX's log to stderr (UCX_LOG_FILE
 * overrides).
 */
void tdp_cli_set_verbosity(int verbose);
void tdp_cli_more_verbose(void);
void tdp_cli_route_ucx_log(void);
/* in a forked child before exec: UCX's log level as this process set it */
void tdp_cli_ucx_log_env(void);

/* ---- subcommands ---------------------------------------------------------- */

/* Each takes its own argv (argv[0] is its name) and returns a tdp_cli_exit. */
int tdp_cmd_bench(int argc, char **argv);
int tdp_cmd_serve(int argc, char **argv);
int tdp_cmd_send(int argc, char **argv);
int tdp_cmd_recv(int argc, char **argv);
int tdp_cmd_inspect(int argc, char **argv);
int tdp_cmd_version(int argc, char **argv);

/* bench_clients.c: `tdpipe bench --clients N` and its server process. */
int tdp_bench_clients(int n, uint64_t size, int total, uint32_t depth, tdp_plane plane, bool quiet);
int tdp_bench_clients_server(uint64_t expect, uint32_t depth, tdp_plane plane);
/*
 * n producer pipes send `total` messages of `size` bytes, back to back, to
 * a consumer process started from child_argv (argv[0] the path): it prints
 * "port P", then "result BYTES NS" (what it timed), and stops when its
 * stdin closes. *bps is its figure. The producers are pipes on one loop of
 * this process, or with procs each a process of its own (as data-loader
 * workers are), forked before this process makes any loop.
 */
tdp_err tdp_bench_producers(int n, uint64_t size, int total, tdp_plane plane, bool procs,
                            const char *const *child_argv, double *bps, const char **plane_used);

/*
 * bench_fanin.c: `tdpipe bench --fanin N` (N producers into one tdp_fanin
 * against one alone, and against a baseline consumer program) and its
 * consumer process.
 */
int tdp_bench_fanin(int n, uint64_t size, int total, uint32_t depth, tdp_plane plane, bool procs,
                    const char *baseline, const char *json, bool quiet);
int tdp_bench_fanin_consumer(uint64_t expect, uint32_t depth, tdp_plane plane);

/*
 * bench_fanout.c: `tdpipe bench --fanout N` (one producer broadcasting to
 * N consumer pipes of this process, loaned and plain, for each size).
 */
int tdp_bench_fanout(int n, const uint64_t *sizes, int nsizes, int rounds, uint32_t depth,
                     tdp_plane plane, bool no_loan, const char *json, bool quiet);

/*
 * Receive buffers of recv and serve (and each side of bench) unless --depth
 * says otherwise: with 4 the sender keeps messages in flight instead of
 * waiting for each to be read, which is the speed docs/benchmarks.md
 * reports; 1 is the library's default (each receive overwrites the last).
 */
#define TDP_CLI_DEFAULT_DEPTH 4u

/* Subcommand help texts end with this pointer to the exit-status table. */
#define TDP_CLI_EXIT_HELP                                                                          \
    "Exit status: 0 ok, 1 runtime failure, 2 usage error, 3 cannot connect/listen,\n"              \
    "4 peer ended with an error, 5 timed out, 130/143 interrupted by SIGINT/SIGTERM\n"             \
    "(after a clean close and the summary; a second signal ends it at once).\n"

#endif /* TDPIPE_TOOLS_CLI_H */

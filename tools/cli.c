/* cli.c: helpers shared by the tdpipe subcommands (see cli.h). */
#include "cli.h"
#include "bench_method.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <math.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ---- exit codes -------------------------------------------------------- */

int tdp_cli_exit_for(tdp_err err)
{
    switch (err) {
    case TDP_OK:
        return TDP_EXIT_OK;
    case TDP_ECONNREFUSED:
    case TDP_EADDR:
    case TDP_ELIMIT: /* a server at max_clients refuses: we could not get in */
    case TDP_EAUTH:  /* nor with the wrong secret, or none */
        return TDP_EXIT_CONNECT;
    case TDP_ECLOSED:
    case TDP_ECONNRESET:
    case TDP_EPROTO:
    case TDP_EVERSION:
    case TDP_ESCHEMA:
    case TDP_EMISMATCH:
    case TDP_EMSGSIZE:
        return TDP_EXIT_PEER;
    case TDP_ETIMEDOUT:
        return TDP_EXIT_TIMEOUT;
    case TDP_ECHECKSUM: /* a payload arrived damaged: a failed verification */
        return TDP_EXIT_FAIL;
    default:
        return TDP_EXIT_FAIL;
    }
}

/* ---- numbers, sizes, rates ---------------------------------------------- */

bool tdp_cli_parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
    if (s == NULL || !isdigit((unsigned char)s[0]))
        return false; /* strtoull would accept a sign and leading space */
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < min || v > max)
        return false;
    *out = v;
    return true;
}

bool tdp_cli_parse_double(const char *s, double *out)
{
    if (s == NULL || !(isdigit((unsigned char)s[0]) || s[0] == '.'))
        return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || *end != '\0' || !isfinite(v) || v < 0)
        return false;
    *out = v;
    return true;
}

bool tdp_cli_parse_timeout(const char *s, int64_t *ms)
{
    uint64_t v;
    if (s != NULL && strcmp(s, "-1") == 0) {
        *ms = -1;
        return true;
    }
    if (!tdp_cli_parse_u64(s, 1, TDP_CLI_TIMEOUT_MAX_MS, &v))
        return false;
    *ms = (int64_t)v;
    return true;
}

bool tdp_cli_parse_keepalive(const char *s, tdp_pipe_opts *o)
{
    static const uint64_t max[3] = {32767, 32767, 127};
    uint64_t v[3];
    char part[24];
    for (int i = 0; i < 3; i++) {
        const char *end = i < 2 ? strchr(s, ',') : s + strlen(s);
        if (end == NULL || (size_t)(end - s) >= sizeof(part))
            return false;
        memcpy(part, s, (size_t)(end - s));
        part[end - s] = '\0';
        if (!tdp_cli_parse_u64(part, 1, max[i], &v[i]))
            return false;
        s = end + (i < 2);
    }
    o->keepalive_idle_s = (int)v[0];
    o->keepalive_intvl_s = (int)v[1];
    o->keepalive_cnt = (int)v[2];
    return true;
}

bool tdp_cli_read_secret(const char *cmd, const char *path, tdp_pipe_opts *o)
{
    static uint8_t buf[TDP_SECRET_MAX + 1];
    /* O_NONBLOCK: a FIFO (or a device) opens at once and is refused below,
     * instead of blocking the command before it listens or dials */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        tdp_cli_error(cmd, "cannot read the secret file '%s': %s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return false;
    }
    if (!S_ISREG(st.st_mode)) {
        tdp_cli_error(cmd, "the secret file '%s' is not a regular file", path);
        close(fd);
        return false;
    }
    FILE *f = fdopen(fd, "rb");
    if (f == NULL) {
        tdp_cli_error(cmd, "cannot read the secret file '%s': %s", path, strerror(errno));
        close(fd);
        return false;
    }
    size_t n = fread(buf, 1, sizeof(buf), f);
    bool bad = ferror(f);
    fclose(f);
    if (bad || n < TDP_SECRET_MIN || n > TDP_SECRET_MAX) {
        tdp_cli_error(cmd, "the secret file '%s' %s", path,
                      bad ? "cannot be read"
                          : n < TDP_SECRET_MIN ? "is too short: at least 16 bytes (e.g. head -c 32 "
                                                 "/dev/urandom > FILE)"
                                               : "is too long: at most 256 bytes");
        return false;
    }
    o->secret = buf;
    o->secret_len = n;
    return true;
}

int tdp_cli_parse_window(const char *cmd, const char *s, uint64_t *out)
{
    const char *bad = NULL;
    uint64_t v = 0;
    bool parsed = tdp_cli_parse_size(s, &v, &bad);
    if (!parsed || (v != 0 && (v < TDP_CLI_WINDOW_MIN || v > TDP_CLI_WINDOW_MAX)))
        return tdp_cli_usage_error(cmd,
                                   "--window wants 0 (off) or a size from 4 KiB to 1 GiB, not '%s'%s%s",
                                   s, !parsed && bad != NULL ? ": " : "",
                                   !parsed && bad != NULL ? bad : "");
    *out = v;
    return -1;
}

void tdp_cli_apply_net_opts(const tdp_pipe_opts *given, tdp_pipe_opts *o)
{
    o->recv_window_bytes = given->recv_window_bytes; /* 0 is --window 0: off */
    if (given->secret != NULL) {
        o->secret = given->secret;
        o->secret_len = given->secret_len;
    }
    if (given->checksum)
        o->checksum = true;
    if (given->keepalive_idle_s != 0) {
        o->keepalive_idle_s = given->keepalive_idle_s;
        o->keepalive_intvl_s = given->keepalive_intvl_s;
        o->keepalive_cnt = given->keepalive_cnt;
    }
}

bool tdp_cli_parse_size(const char *s, uint64_t *out, const char **why)
{
    return tdp_bm_parse_size_why(s, out, why);
}

/* Three significant digits in SI units; rounding may carry into the next unit. */
static const char *format_si(double v, bool integer_bytes, const char *suffix, char *buf,
                             size_t len)
{
    static const char *const units[] = {"B", "KB", "MB", "GB", "TB", "PB", "EB"};
    size_t u = 0;
    if (integer_bytes && v < 999.5) {
        snprintf(buf, len, "%.0f B%s", v, suffix);
        return buf;
    }
    while (u + 1 < sizeof(units) / sizeof(units[0]) && v >= 999.5) {
        v /= 1000.0;
        u++;
    }
    int prec = v < 9.995 ? 2 : v < 99.95 ? 1 : 0;
    snprintf(buf, len, "%.*f %s%s", prec, v, units[u], suffix);
    return buf;
}

const char *tdp_cli_format_size(uint64_t bytes, char *buf, size_t len)
{
    return format_si((double)bytes, true, "", buf, len);
}

const char *tdp_cli_format_rate(double bytes_per_s, char *buf, size_t len)
{
    if (!(bytes_per_s > 0) || !isfinite(bytes_per_s))
        bytes_per_s = 0;
    return format_si(bytes_per_s, bytes_per_s == 0, "/s", buf, len);
}

/* ---- addresses ------------------------------------------------------------ */

bool tdp_cli_parse_port(const char *s, bool allow_zero, uint16_t *port)
{
    uint64_t v;
    if (!tdp_cli_parse_u64(s, allow_zero ? 0 : 1, 65535, &v))
        return false;
    *port = (uint16_t)v;
    return true;
}

bool tdp_cli_parse_hostport(const char *s, bool allow_zero, char *host, size_t hostlen,
                            uint16_t *port)
{
    const char *h, *colon;
    size_t hlen;

    if (s == NULL)
        return false;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (close == NULL || close[1] != ':')
            return false;
        h = s + 1;
        hlen = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (colon == NULL || memchr(s, ':', (size_t)(colon - s)) != NULL)
            return false; /* no port, or a bare IPv6 literal */
        h = s;
        hlen = (size_t)(colon - s);
    }
    if (hlen == 0 || hlen >= hostlen || memchr(h, '\0', hlen) != NULL)
        return false;
    uint16_t p;
    if (!tdp_cli_parse_port(colon + 1, allow_zero, &p))
        return false;
    memcpy(host, h, hlen);
    host[hlen] = '\0';
    *port = p;
    return true;
}

const char *tdp_cli_format_hostport(const char *host, uint16_t port, char *buf, size_t len)
{
    if (host == NULL || host[0] == '\0')
        snprintf(buf, len, "[::]:%u", port);
    else if (strchr(host, ':') != NULL)
        snprintf(buf, len, "[%s]:%u", host, port);
    else
        snprintf(buf, len, "%s:%u", host, port);
    return buf;
}

/* ---- this host's addresses ----------------------------------------------------- */

#define MAX_SHOWN_ADDRS 8

int tdp_cli_host_addresses(uint16_t port, char *buf, size_t len)
{
    struct ifaddrs *ifs = NULL;
    char shown[MAX_SHOWN_ADDRS][INET6_ADDRSTRLEN];
    int n = 0;
    size_t used = 0;

    buf[0] = '\0';
    if (getifaddrs(&ifs) != 0)
        return 0;
    for (struct ifaddrs *i = ifs; i != NULL; i = i->ifa_next) {
        char a[INET6_ADDRSTRLEN];
        const struct sockaddr *sa = i->ifa_addr;
        if (sa == NULL || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK))
            continue;
        if (sa->sa_family == AF_INET) {
            const struct sockaddr_in *s4 = (const void *)sa;
            inet_ntop(AF_INET, &s4->sin_addr, a, sizeof(a));
        } else if (sa->sa_family == AF_INET6) {
            const struct sockaddr_in6 *s6 = (const void *)sa;
            if (IN6_IS_ADDR_LINKLOCAL(&s6->sin6_addr) || IN6_IS_ADDR_LOOPBACK(&s6->sin6_addr))
                continue;
            inet_ntop(AF_INET6, &s6->sin6_addr, a, sizeof(a));
        } else {
            continue;
        }
        bool seen = false;
        for (int k = 0; k < n && k < MAX_SHOWN_ADDRS; k++)
            seen |= strcmp(shown[k], a) == 0;
        if (seen)
            continue;
        if (n < MAX_SHOWN_ADDRS) {
            char hp[INET6_ADDRSTRLEN + 16];
            snprintf(shown[n], sizeof(shown[n]), "%s", a);
            tdp_cli_format_hostport(a, port, hp, sizeof(hp));
            int w = snprintf(buf + used, len - used, "%s%s", n ? ", " : "", hp);
            if (w > 0 && (size_t)w < len - used)
                used += (size_t)w;
        }
        n++;
    }
    freeifaddrs(ifs);
    if (n > MAX_SHOWN_ADDRS)
        snprintf(buf + used, len - used, " and %d more", n - MAX_SHOWN_ADDRS);
    return n;
}

void tdp_cli_print_listening(const char *bind, uint16_t port)
{
    char where[TDP_CLI_HOST_LEN + 16], addrs[MAX_SHOWN_ADDRS * (INET6_ADDRSTRLEN + 20) + 32];
    printf("listening on %s\n", tdp_cli_format_hostport(bind, port, where, sizeof(where)));
    if (bind != NULL && bind[0] != '\0')
        return;
    if (tdp_cli_host_addresses(port, addrs, sizeof(addrs)) > 0)
        printf("other hosts: %s\n", addrs);
    else
        printf("other hosts: none (no address besides loopback)\n");
}

/* ---- why a listen or connect failed ---------------------------------------- */

const char *tdp_cli_strerror(tdp_err rc)
{
    return rc == TDP_EUCX ? "UCX error (run with -v to see UCX's own messages)" : tdp_strerror(rc);
}

/*
 * Bind a scratch socket to host:port as the library's listener does
 * (first resolved address, SO_REUSEADDR, dual stack for every address)
 * and say why it fails, into why. False when it binds (the cause was
 * elsewhere, or has gone).
 */
static bool diagnose_bind(const char *host, uint16_t port, char *why, size_t len)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                    *res = NULL;
    struct sockaddr_in6 any = {
        .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_ANY_INIT, .sin6_port = htons(port)};
    const struct sockaddr *sa = (const struct sockaddr *)&any;
    socklen_t salen = sizeof(any);
    bool wildcard = host == NULL || host[0] == '\0';
    char ps[8];

    if (!wildcard) {
        snprintf(ps, sizeof(ps), "%u", port);
        int r = getaddrinfo(host, ps, &hints, &res);
        if (r != 0 || res == NULL) {
            snprintf(why, len, "cannot resolve '%s': %s", host,
                     r != 0 ? gai_strerror(r) : "no address");
            return true;
        }
        sa = res->ai_addr;
        salen = res->ai_addrlen;
    }
    int fd = socket(sa->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1, zero = 0, e = 0;
    if (fd < 0) {
        e = errno;
    } else {
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (wildcard)
            setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
        if (bind(fd, sa, salen) != 0)
            e = errno;
        close(fd);
    }
    if (res != NULL)
        freeaddrinfo(res);
    if (e == EADDRINUSE)
        snprintf(why, len, "port %u is in use", port);
    else if (e == EADDRNOTAVAIL)
        snprintf(why, len, "'%s' is not an address of this host", host ? host : "");
    else if (e == EACCES)
        snprintf(why, len, "permission denied (ports below 1024 need privileges)");
    else if (e != 0)
        snprintf(why, len, "%s", strerror(e));
    return e != 0;
}

int tdp_cli_listen_failed(const char *cmd, const char *host, uint16_t port, tdp_err rc)
{
    char where[TDP_CLI_HOST_LEN + 16], why[TDP_CLI_HOST_LEN + 64];
    tdp_cli_format_hostport(host, port, where, sizeof(where));
    if (rc == TDP_EADDR && !diagnose_bind(host, port, why, sizeof(why)))
        snprintf(why, sizeof(why), "address in use or invalid");
    else if (rc != TDP_EADDR)
        snprintf(why, sizeof(why), "%s", tdp_cli_strerror(rc));
    tdp_cli_error(cmd, "cannot listen on %s: %s", where, why);
    return rc == TDP_EADDR ? TDP_EXIT_CONNECT : tdp_cli_exit_for(rc);
}

int tdp_cli_connect_failed(const char *cmd, const char *host, uint16_t port, tdp_err rc,
                           tdp_plane plane)
{
    char where[TDP_CLI_HOST_LEN + 16], why[TDP_CLI_HOST_LEN + 160];
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    int r;

    tdp_cli_format_hostport(host, port, where, sizeof(where));
    switch (rc) {
    case TDP_EADDR: /* unresolvable, or every address unreachable */
        r = getaddrinfo(host, NULL, &hints, &res);
        if (r != 0)
            snprintf(why, sizeof(why), "cannot resolve '%s': %s", host, gai_strerror(r));
        else
            snprintf(why, sizeof(why), "unreachable (no route to it)");
        if (res != NULL)
            freeaddrinfo(res);
        break;
    case TDP_EPROTO:
        snprintf(why, sizeof(why),
                 "not a tdpipe peer (it answered with something other than a tdpipe HELLO, or "
                 "said nothing)");
        break;
    case TDP_ECONNRESET:
        snprintf(why, sizeof(why),
                 "closed during handshake (not a tdpipe peer, or it turned this client away)");
        break;
    case TDP_EVERSION:
        snprintf(why, sizeof(why), "the peer speaks another tdpipe protocol version (this is %d)",
                 TDP_PROTOCOL_VERSION);
        break;
    case TDP_ENOTSUP:
        snprintf(why, sizeof(why),
                 "no data plane both sides can use (--plane %s: not available here, or refused "
                 "by the peer)",
                 tdp_plane_name(plane) ? tdp_plane_name(plane) : "?");
        break;
    case TDP_ETIMEDOUT:
        snprintf(why, sizeof(why), "timed out (no answer to the handshake in time)");
        break;
    default:
        snprintf(why, sizeof(why), "%s", tdp_cli_strerror(rc));
        break;
    }
    tdp_cli_error(cmd, "cannot connect to %s: %s", where, why);
    return rc == TDP_ETIMEDOUT                                      ? TDP_EXIT_TIMEOUT
           : rc == TDP_EUCX || rc == TDP_ENOMEM || rc == TDP_EINVAL ? TDP_EXIT_FAIL
                                                                    : TDP_EXIT_CONNECT;
}

/* ---- data planes ------------------------------------------------------------ */

/* Plane ids are small (the wire keeps them below 64): try them all. */
#define PLANE_ID_LIMIT 64

const char *tdp_cli_plane_names(char *buf, size_t len)
{
    size_t n = 0;
    buf[0] = '\0';
    for (int i = 0; i < PLANE_ID_LIMIT; i++) {
        const char *name = tdp_plane_name((tdp_plane)i);
        tdp_plane back;
        if (name == NULL || tdp_plane_parse(name, &back) != TDP_OK)
            continue;
        int w = snprintf(buf + n, len - n, "%s%s", n ? ", " : "", name);
        if (w < 0 || (size_t)w >= len - n)
            break;
        n += (size_t)w;
    }
    return buf;
}

bool tdp_cli_parse_plane(const char *cmd, const char *s, tdp_plane *out)
{
    char names[128];
    if (tdp_plane_parse(s, out) == TDP_OK)
        return true;
    tdp_cli_usage_error(cmd, "unknown plane '%s' (valid: %s)", s,
                        tdp_cli_plane_names(names, sizeof(names)));
    return false;
}

const char *tdp_cli_plane_of(const tdp_pipe *pipe)
{
    tdp_plane p = tdp_pipe_plane(pipe);
    const char *name = p == TDP_PLANE_AUTO ? NULL : tdp_plane_name(p);
    return name != NULL ? name : "?";
}

/* ---- synthetic payloads --------------------------------------------------- */

uint64_t tdp_cli_synth_bytes(uint64_t nbytes)
{
    return tdp_bm_whole_floats(nbytes);
}

/*
 * The synthetic schema with extra values in meta: `meta_values` is JSON
 * object members, each followed by a comma, whose keys sort before
 * "source" (the text is written in canonical form, keys in byte order).
 */
static tdp_err synth_schema(uint64_t nbytes, tdp_device dev, const char *meta_values,
                            tdp_schema **out)
{
    /*
     * Written in canonical form already, so it reads as what it is; the
     * decoder would accept any order. The leaf is unpadded: the total is
     * the leaf's size, not a multiple of TDP_LEAF_ALIGN as the builder's is.
     */
    static const char fmt[] =
        "{\"device\":\"%s\",\"format\":\"tdpipe.schema\",\"td\":{\"cls\":\"TensorDict\","
        "\"cls_metadata\":{\"batch_size\":[],\"device\":\"%s\",\"is_locked\":false,"
        "\"names\":null},\"leaves\":{\"" TDP_CLI_SYNTH_LEAF "\":[\"torch.float32\",[%" PRIu64
        "],0,%" PRIu64 ",0]},\"meta\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":"
        "[],\"device\":\"%s\",\"is_locked\":false,\"names\":null},\"leaves\":{},"
        "\"non_tensors\":{%s\"source\":\"tdpipe\"}},\"non_tensors\":{}},\"total_bytes\":%" PRIu64
        ",\"version\":1}";
    char dname[TDP_DEVICE_STRLEN], json[1024];
    uint64_t total = tdp_cli_synth_bytes(nbytes);

    tdp_device_format(dev, dname);
    int n = snprintf(json, sizeof(json), fmt, dname, dname, total / 4, total, dname, meta_values,
                     total);
    if (n < 0 || (size_t)n >= sizeof(json))
        return TDP_EINTERNAL;
    return tdp_schema_decode(json, (size_t)n, NULL, out, NULL, 0);
}

tdp_err tdp_cli_synth_schema(uint64_t nbytes, tdp_device dev, tdp_schema **out)
{
    return synth_schema(nbytes, dev, "", out);
}

tdp_err tdp_cli_send_schema(uint64_t nbytes, tdp_device dev, bool echo, tdp_schema **out)
{
    return synth_schema(nbytes, dev, echo ? "\"echo\":true," : "\"echo\":false,", out);
}

/* The canonical JSON of value leaf `path`, or NULL. */
static const char *value_of(const tdp_schema *s, const char *path)
{
    tdp_leaf l;
    if (s == NULL || tdp_schema_find(s, path, &l) != TDP_OK || l.kind != TDP_LEAF_VALUE)
        return NULL;
    return l.value_json;
}

int tdp_cli_wants_echo(const tdp_schema *s)
{
    const char *src = value_of(s, "meta.source"), *echo = value_of(s, "meta.echo");
    if (src == NULL || strcmp(src, "\"tdpipe\"") != 0 || echo == NULL)
        return -1;
    return strcmp(echo, "true") == 0 ? 1 : strcmp(echo, "false") == 0 ? 0 : -1;
}

/* Our notice strings are plain: letters, digits, spaces, '-' and '/'. */
static bool plain_text(const char *t)
{
    for (; *t != '\0'; t++)
        if (!(isalnum((unsigned char)*t) || *t == ' ' || *t == '-' || *t == '/'))
            return false;
    return true;
}

tdp_err tdp_cli_notice_new(const char *code, const char *from, tdp_td **out)
{
    char values[160];
    tdp_schema *s;
    if (code == NULL || from == NULL || !plain_text(code) || !plain_text(from))
        return TDP_EINVAL;
    int n = snprintf(values, sizeof(values), "\"from\":\"%s\",\"notice\":\"%s\",", from, code);
    if (n < 0 || (size_t)n >= sizeof(values))
        return TDP_EINVAL;
    tdp_err rc = synth_schema(4, TDP_DEVICE_CPU_INIT, values, &s);
    if (rc != TDP_OK)
        return rc;
    rc = tdp_td_new(s, out);
    tdp_schema_unref(s); /* the td holds it */
    if (rc == TDP_OK)
        memset(tdp_td_data(*out), 0, tdp_td_nbytes(*out));
    return rc;
}

/* A JSON string value without its quotes into buf; false if it is not one. */
static bool unquote(const char *json, char *buf, size_t len)
{
    size_t n = json != NULL ? strlen(json) : 0;
    if (n < 2 || json[0] != '"' || json[n - 1] != '"' || n - 2 >= len)
        return false;
    memcpy(buf, json + 1, n - 2);
    buf[n - 2] = '\0';
    return true;
}

const char *tdp_cli_notice_of(const tdp_td *td, char *from, size_t len)
{
    static const char *const codes[] = {TDP_CLI_NOTICE_NO_ECHO, TDP_CLI_NOTICE_ECHOES};
    const tdp_schema *s = tdp_td_schema(td);
    char code[32];
    if (!unquote(value_of(s, "meta.notice"), code, sizeof(code)))
        return NULL;
    if (!unquote(value_of(s, "meta.from"), from, len))
        snprintf(from, len, "?");
    for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++)
        if (strcmp(code, codes[i]) == 0)
            return codes[i];
    return NULL;
}

/*
 * Word i of message seq is k(seq) + i * C. Both constants are odd, so
 * different seqs differ in every word and different words of one message
 * differ: a stale, repeated, shifted or torn buffer never passes. It is one
 * add per 8 bytes, which the compiler vectorizes.
 */
#define PAT_SEQ_MUL  0x9E3779B97F4A7C15ull
#define PAT_SEQ_ADD  0x632BE59BD9B4E019ull
#define PAT_WORD_MUL 0xD6E8FEB86659FD93ull

static inline uint64_t pat_base(uint64_t seq)
{
    return seq * PAT_SEQ_MUL + PAT_SEQ_ADD;
}

void tdp_cli_fill_buf(void *buf, uint64_t len, uint64_t seq)
{
    uint8_t *b = buf;
    uint64_t words = len / 8, k = pat_base(seq);
    for (uint64_t i = 0; i < words; i++) {
        uint64_t w = k + i * PAT_WORD_MUL;
        memcpy(b + i * 8, &w, 8); /* one store; no alignment assumed */
    }
    uint64_t w = k + words * PAT_WORD_MUL;
    memcpy(b + words * 8, &w, len % 8);
}

bool tdp_cli_verify_buf(const void *buf, uint64_t len, uint64_t seq, uint64_t *bad_offset)
{
    enum { BLOCK = 512 }; /* words compared branch-free before looking closer */
    const uint8_t *b = buf;
    uint64_t words = len / 8, k = pat_base(seq);

    for (uint64_t start = 0; start < words; start += BLOCK) {
        uint64_t end = words - start < BLOCK ? words : start + BLOCK, diff = 0;
        for (uint64_t i = start; i < end; i++) {
            uint64_t w;
            memcpy(&w, b + i * 8, 8);
            diff |= w ^ (k + i * PAT_WORD_MUL);
        }
        if (diff == 0)
            continue;
        for (uint64_t i = start; i < end; i++) {
            uint64_t w;
            memcpy(&w, b + i * 8, 8);
            if (w != k + i * PAT_WORD_MUL) {
                if (bad_offset != NULL)
                    *bad_offset = i * 8;
                return false;
            }
        }
    }
    uint64_t w = k + words * PAT_WORD_MUL;
    if (memcmp(b + words * 8, &w, len % 8) != 0) {
        if (bad_offset != NULL)
            *bad_offset = words * 8;
        return false;
    }
    return true;
}

tdp_err tdp_cli_fill(tdp_td *td, uint64_t seq)
{
    if (td == NULL)
        return TDP_EINVAL;
    if (tdp_td_device(td).type != TDP_DEVICE_CPU)
        return TDP_ENOTSUP;
    tdp_cli_fill_buf(tdp_td_data(td), tdp_td_nbytes(td), seq);
    return TDP_OK;
}

tdp_err tdp_cli_verify(const tdp_td *td, uint64_t seq, uint64_t *bad_offset)
{
    if (td == NULL)
        return TDP_EINVAL;
    if (tdp_td_device(td).type != TDP_DEVICE_CPU)
        return TDP_ENOTSUP;
    return tdp_cli_verify_buf(tdp_td_data(td), tdp_td_nbytes(td), seq, bad_offset) ? TDP_OK
                                                                                   : TDP_EMISMATCH;
}

/* ---- time ------------------------------------------------------------------ */

uint64_t tdp_cli_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void tdp_cli_sleep_until_ns(uint64_t deadline_ns)
{
    struct timespec ts = {
        .tv_sec = (time_t)(deadline_ns / 1000000000ull),
        .tv_nsec = (long)(deadline_ns % 1000000000ull),
    };
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

/* ---- interruption ------------------------------------------------------------ */

static atomic_int caught_signal;

/* A repeat of the signal sooner than this after the first is the same request. */
#define SECOND_SIGNAL_NS 500000000ull

static void *signal_watcher(void *arg)
{
    sigset_t *set = arg;
    int sig;
    if (sigwait(set, &sig) != 0)
        return NULL;
    atomic_store(&caught_signal, sig);
    /*
     * A second one: the user insists; end now, as the signal would. Not
     * one that comes right after the first: `timeout` and process-group
     * kills deliver the same signal twice.
     */
    uint64_t first = tdp_cli_now_ns();
    do {
        if (sigwait(set, &sig) != 0)
            return NULL;
    } while (tdp_cli_now_ns() - first < SECOND_SIGNAL_NS);
    signal(sig, SIG_DFL);
    pthread_sigmask(SIG_UNBLOCK, set, NULL);
    raise(sig);
    _exit(TDP_EXIT_SIGNAL(sig)); /* not reached */
}

static void no_op_handler(int sig)
{
    (void)sig;
}

bool tdp_cli_catch_signals(void)
{
    static sigset_t set;
    pthread_t t;
    pthread_attr_t attr;

    /*
     * A handler, not SIG_IGN: a shell starts background jobs with SIGINT
     * ignored, and an ignored signal may be dropped before sigwait sees it.
     * The handler never runs: the signals stay blocked in every thread.
     */
    struct sigaction sa = {.sa_handler = no_op_handler};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    if (pthread_sigmask(SIG_BLOCK, &set, NULL) != 0)
        return false;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int err = pthread_create(&t, &attr, signal_watcher, &set);
    pthread_attr_destroy(&attr);
    if (err != 0) {
        pthread_sigmask(SIG_UNBLOCK, &set, NULL);
        return false;
    }
    return true;
}

int tdp_cli_interrupted(void)
{
    return atomic_load(&caught_signal);
}

/* ---- option parsing ------------------------------------------------------- */

void tdp_cli_getopt_reset(void)
{
    optind = 0; /* glibc: 0 re-initialises getopt completely, unlike 1 */
    opterr = 0;
}

static void vreport(const char *cmd, const char *fmt, va_list ap) TDP_CHECK_FMT(2, 0);

static void vreport(const char *cmd, const char *fmt, va_list ap)
{
    fprintf(stderr, "tdpipe%s%s: ", cmd ? " " : "", cmd ? cmd : "");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
}

int tdp_cli_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vreport(cmd, fmt, ap);
    va_end(ap);
    fprintf(stderr, "Try 'tdpipe %s%s--help' for more information.\n", cmd ? cmd : "",
            cmd ? " " : "");
    return TDP_EXIT_USAGE;
}

void tdp_cli_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vreport(cmd, fmt, ap);
    va_end(ap);
}

int tdp_cli_bad_option(const char *cmd, char **argv, int c)
{
    /* getopt leaves optind past the offending word; a long option is named there */
    const char *word = optind > 0 ? argv[optind - 1] : "";
    bool is_long = strncmp(word, "--", 2) == 0;
    char shortname[3] = {'-', (char)optopt, '\0'};
    const char *name = is_long || optopt == 0 ? word : shortname;

    if (c == ':')
        return tdp_cli_usage_error(cmd, "option '%s' needs a value", name);
    if (is_long && strchr(word, '=') != NULL && optopt != 0)
        return tdp_cli_usage_error(cmd, "option '%s' takes no value", word);
    return tdp_cli_usage_error(cmd, "unknown option '%s'", name);
}

/* ---- meter ------------------------------------------------------------------ */

void tdp_cli_meter_start(tdp_cli_meter *m)
{
    *m = (tdp_cli_meter){.start_ns = tdp_cli_now_ns()};
}

const char *tdp_cli_meter_summary(const tdp_cli_meter *m, const char *verb, uint64_t now_ns,
                                  char *buf, size_t len)
{
    double s = now_ns > m->start_ns ? (double)(now_ns - m->start_ns) / 1e9 : 0;
    char size[TDP_CLI_FMT_LEN], rate[TDP_CLI_FMT_LEN];
    snprintf(buf, len, "%s %" PRIu64 " message%s (%s) in %.3f s: %s, %.0f msgs/s", verb, m->msgs,
             tdp_cli_s(m->msgs), tdp_cli_format_size(m->bytes, size, sizeof(size)), s,
             tdp_cli_format_rate(s > 0 ? (double)m->bytes / s : 0, rate, sizeof(rate)),
             s > 0 ? (double)m->msgs / s : 0);
    return buf;
}

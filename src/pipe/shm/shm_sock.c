/* shm_sock.c: Unix sockets for the shm plane: fd passing, abstract listener. */
#include "shm.h"

#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "../../core/log.h"

_Static_assert(TDP__SHM_NAME_MAX + 1 == sizeof(((struct sockaddr_un *)0)->sun_path),
               "an abstract name fills sun_path after its leading zero byte");

#define NAME_PREFIX "tdpipe."

/* Control buffer for TDP__SHM_MAX_FDS fds, aligned for cmsghdr. */
typedef union fd_ctl {
    char buf[CMSG_SPACE(sizeof(int) * TDP__SHM_MAX_FDS)];
    struct cmsghdr align;
} fd_ctl;

static tdp_err sock_err(int e)
{
    switch (e) {
    case EAGAIN:
#if EWOULDBLOCK != EAGAIN
    case EWOULDBLOCK:
#endif
        return TDP_EAGAIN;
    case EPIPE:
    case ECONNRESET:
    case ENOTCONN:
        return TDP_ECONNRESET;
    case EMSGSIZE:
        return TDP_EMSGSIZE;
    case ENOMEM:
    case ENOBUFS:
    case EMFILE:
    case ENFILE:
        return TDP_ENOMEM;
    case EBADF:
    case ENOTSOCK:
    case EINVAL:
        return TDP_EINVAL;
    default:
        return TDP_EINTERNAL;
    }
}

tdp_err tdp__shm_sock_send(int sock, const void *buf, size_t len, const int *fds, size_t nfds)
{
    /* at least one byte: on a stream, fds need data to ride on */
    if (sock < 0 || buf == NULL || len == 0 || nfds > TDP__SHM_MAX_FDS || (nfds && fds == NULL))
        return TDP_EINVAL;
    fd_ctl ctl;
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0) {
        memset(&ctl, 0, sizeof(ctl));
        msg.msg_control = ctl.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
    }
    ssize_t n;
    do {
        n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        return sock_err(errno);

    /* A stream may take part of it; the fds went with the first byte, the
     * rest must follow or the peer's framing breaks */
    size_t done = (size_t)n;
    while (done < len) {
        n = send(sock, (const char *)buf + done, len - done, MSG_NOSIGNAL);
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd p = {.fd = sock, .events = POLLOUT};
            int r = poll(&p, 1, 1000);
            if (r == 0) {
                tdp_log_warn("shm socket: the peer stopped reading mid-message");
                return TDP_ETIMEDOUT;
            }
            continue;
        }
        return n == 0 ? TDP_EINTERNAL : sock_err(errno);
    }
    return TDP_OK;
}

static void close_all(const int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        close(fds[i]);
}

tdp_err tdp__shm_sock_recv(int sock, void *buf, size_t cap, size_t *len, int *fds, size_t maxfds,
                           size_t *nfds)
{
    if (sock < 0 || buf == NULL || cap == 0 || len == NULL || nfds == NULL ||
        maxfds > TDP__SHM_MAX_FDS || (maxfds && fds == NULL))
        return TDP_EINVAL;
    /* Room for TDP__SHM_MAX_FDS whatever maxfds is: surplus fds then land
     * here, where they can be closed, and a sender of more than that is
     * seen through MSG_CTRUNC (the kernel drops what did not fit) */
    fd_ctl ctl;
    struct iovec iov = {.iov_base = buf, .iov_len = cap};
    struct msghdr msg = {
        .msg_iov = &iov,
        .msg_iovlen = 1,
        .msg_control = ctl.buf,
        .msg_controllen = sizeof(ctl.buf),
    };
    ssize_t n;
    do {
        n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        return sock_err(errno);

    int got[TDP__SHM_MAX_FDS];
    size_t ngot = 0;
    bool overflow = false;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len < CMSG_LEN(0))
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        const unsigned char *p = CMSG_DATA(c);
        for (size_t i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, p + i * sizeof(int), sizeof(int));
            if (ngot < TDP__SHM_MAX_FDS) {
                got[ngot++] = fd;
            } else {
                close(fd); /* cannot happen with this buffer; never leak */
                overflow = true;
            }
        }
    }

    tdp_err err = TDP_OK;
    const char *why = NULL;
    if (msg.msg_flags & MSG_CTRUNC) {
        err = TDP_EPROTO;
        why = "control message truncated (too many fds)";
    } else if (overflow || ngot > maxfds) {
        err = TDP_EPROTO;
        why = "more fds than expected";
    } else if (msg.msg_flags & MSG_TRUNC) {
        err = TDP_EMSGSIZE;
        why = "message larger than the buffer";
    } else if (n == 0) {
        /* we never send empty messages: 0 is the end, whatever came along */
        err = TDP_ECLOSED;
    }
    if (err != TDP_OK) {
        if (why != NULL)
            tdp_log_warn("shm socket: %s; closing %zu received fd(s)", why, ngot);
        close_all(got, ngot);
        return err;
    }
    if (ngot > 0)
        memcpy(fds, got, ngot * sizeof(int));
    *len = (size_t)n;
    *nfds = ngot;
    return TDP_OK;
}

static socklen_t abstract_addr(struct sockaddr_un *a, const char *name, size_t len)
{
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    /* sun_path[0] == 0: the abstract namespace; the length says where the
     * name ends (no terminating zero) */
    memcpy(a->sun_path + 1, name, len);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len);
}

/* Only our own user may hold the other end. */
static tdp_err check_peer(int s, const char *what, pid_t *peer_pid)
{
    struct ucred cr;
    socklen_t l = sizeof(cr);
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &l) != 0 || l != sizeof(cr)) {
        tdp_log_error("shm socket %s: SO_PEERCRED: %s", what, strerror(errno));
        return TDP_EINTERNAL;
    }
    if (cr.uid != geteuid()) {
        tdp_log_warn("shm socket %s: refusing pid %ld of uid %lu (this process runs as uid %lu)",
                     what, (long)cr.pid, (unsigned long)cr.uid, (unsigned long)geteuid());
        return TDP_ECONNREFUSED;
    }
    if (peer_pid != NULL)
        *peer_pid = cr.pid;
    return TDP_OK;
}

static bool sock_type_ok(int type)
{
    return type == SOCK_SEQPACKET || type == SOCK_STREAM;
}

tdp_err tdp__shm_listen(int type, bool nonblock, char name[TDP__SHM_NAME_LEN], int *fd)
{
    static const char hex[] = "0123456789abcdef";
    if (!sock_type_ok(type) || name == NULL || fd == NULL)
        return TDP_EINVAL;
    int flags = type | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0);

    /* 128 random bits make a clash all but impossible; a few tries cover
     * a squatter that guessed one anyway */
    for (int attempt = 0; attempt < 4; attempt++) {
        unsigned char rnd[16];
        ssize_t r;
        do {
            r = getrandom(rnd, sizeof(rnd), 0);
        } while (r < 0 && errno == EINTR);
        if (r != (ssize_t)sizeof(rnd)) {
            tdp_log_error("getrandom: %s", r < 0 ? strerror(errno) : "short read");
            return TDP_EINTERNAL;
        }
        char nm[TDP__SHM_NAME_LEN];
        memcpy(nm, NAME_PREFIX, sizeof(NAME_PREFIX) - 1);
        for (size_t i = 0; i < sizeof(rnd); i++) {
            nm[sizeof(NAME_PREFIX) - 1 + 2 * i] = hex[rnd[i] >> 4];
            nm[sizeof(NAME_PREFIX) - 1 + 2 * i + 1] = hex[rnd[i] & 15];
        }
        _Static_assert(sizeof(NAME_PREFIX) - 1 + 32 == TDP__SHM_NAME_LEN, "name length");

        int s = socket(AF_UNIX, flags, 0);
        if (s < 0) {
            tdp_log_error("shm listener: socket: %s", strerror(errno));
            return sock_err(errno) == TDP_ENOMEM ? TDP_ENOMEM : TDP_EINTERNAL;
        }
        struct sockaddr_un a;
        socklen_t al = abstract_addr(&a, nm, sizeof(nm));
        if (bind(s, (struct sockaddr *)&a, al) != 0) {
            int e = errno;
            close(s);
            if (e == EADDRINUSE)
                continue;
            tdp_log_error("shm listener: bind: %s", strerror(e));
            return TDP_EINTERNAL;
        }
        if (listen(s, 16) != 0) {
            int e = errno;
            close(s);
            tdp_log_error("shm listener: listen: %s", strerror(e));
            return TDP_EINTERNAL;
        }
        memcpy(name, nm, sizeof(nm));
        *fd = s;
        return TDP_OK;
    }
    tdp_log_error("shm listener: every random name was taken");
    return TDP_EADDR;
}

tdp_err tdp__shm_accept(int lfd, bool nonblock, int *fd, pid_t *peer_pid)
{
    if (lfd < 0 || fd == NULL)
        return TDP_EINVAL;
    int s;
    do {
        s = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0));
    } while (s < 0 && errno == EINTR);
    if (s < 0) {
        if (errno == ECONNABORTED) /* gone before we took it: nothing to accept */
            return TDP_EAGAIN;
        tdp_err e = sock_err(errno);
        if (e != TDP_EAGAIN && errno != EMFILE && errno != ENFILE)
            tdp_log_error("shm listener: accept: %s", strerror(errno));
        else if (e != TDP_EAGAIN) /* the caller pauses; the TCP listener says it once */
            tdp_log_debug("shm listener: accept: %s", strerror(errno));
        return e == TDP_ECONNRESET ? TDP_EINTERNAL : e;
    }
    tdp_err err = check_peer(s, "accept", peer_pid);
    if (err != TDP_OK) {
        close(s);
        return err;
    }
    *fd = s;
    return TDP_OK;
}

tdp_err tdp__shm_connect(int type, const char *name, size_t len, bool nonblock, int *fd,
                         pid_t *peer_pid)
{
    if (!sock_type_ok(type) || name == NULL || len == 0 || len > TDP__SHM_NAME_MAX || fd == NULL)
        return TDP_EINVAL;
    int s = socket(AF_UNIX, type | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), 0);
    if (s < 0) {
        tdp_log_error("shm connect: socket: %s", strerror(errno));
        return sock_err(errno) == TDP_ENOMEM ? TDP_ENOMEM : TDP_EINTERNAL;
    }
    struct sockaddr_un a;
    socklen_t al = abstract_addr(&a, name, len);
    int r;
    do {
        r = connect(s, (struct sockaddr *)&a, al);
    } while (r != 0 && errno == EINTR);
    /* EISCONN: an interrupted connect that went through meanwhile */
    if (r != 0 && errno != EISCONN) {
        int e = errno;
        close(s);
        if (e == ECONNREFUSED || e == ENOENT)
            return TDP_ECONNREFUSED;
        if (e == EAGAIN)
            return TDP_EAGAIN;
        tdp_log_debug("shm connect: %s", strerror(e));
        return TDP_EINTERNAL;
    }
    tdp_err err = check_peer(s, "connect", peer_pid);
    if (err != TDP_OK) {
        close(s);
        return err;
    }
    *fd = s;
    return TDP_OK;
}

/*
 * net.c: loopback sockets for the peers (127.0.0.1 only, ephemeral ports)
 * and waiting for a child process with a deadline.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "peers.h"

static void loopback_addr(struct sockaddr_in *sa, uint16_t port)
{
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = htons(port);
    sa->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
}

static void set_nodelay(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* Bind a new socket to 127.0.0.1:0 and read back the port the kernel chose. */
static int bind_ephemeral(uint16_t *port)
{
    struct sockaddr_in sa;
    socklen_t len = sizeof(sa);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    loopback_addr(&sa, 0);
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &len) != 0) {
        close(fd);
        return -1;
    }
    *port = ntohs(sa.sin_port);
    return fd;
}

int net_listen_loopback(uint16_t *port)
{
    int fd = bind_ephemeral(port);
    if (fd >= 0 && listen(fd, 4) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

uint16_t net_free_port(void)
{
    uint16_t port = 0;
    int fd = bind_ephemeral(&port);
    if (fd < 0)
        return 0;
    close(fd);
    return port;
}

int net_connect_loopback(uint16_t port)
{
    struct sockaddr_in sa;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    loopback_addr(&sa, port);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        return -1;
    }
    set_nodelay(fd);
    return fd;
}

int net_accept_timeout(int lfd, int timeout_ms)
{
    struct pollfd p = {.fd = lfd, .events = POLLIN};
    int n;
    while ((n = poll(&p, 1, timeout_ms)) < 0 && errno == EINTR)
        ;
    if (n <= 0)
        return -1;
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd >= 0)
        set_nodelay(fd);
    return fd;
}

bool net_send_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        p += n;
        len -= (size_t)n;
    }
    return true;
}

int peers_wait_child(int pid, int timeout_ms, bool *timed_out)
{
    uint64_t deadline = peers_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    struct timespec tick = {0, 5 * 1000 * 1000};
    int st = 0;
    *timed_out = false;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid || (r < 0 && errno != EINTR))
            return st;
        if (peers_now_ns() > deadline) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            *timed_out = true;
            return st;
        }
        nanosleep(&tick, NULL);
    }
}

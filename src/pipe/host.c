/*
 * host.c: this host's identity for same-host detection — the kernel's boot
 * id, the host name and the IPC and network namespaces. Two processes with
 * the same id share a kernel, shared memory and the abstract Unix socket
 * namespace (the same-host plane needs all three).
 */
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "host.h"

static uint8_t host_id[TDP_HOST_ID_LEN];
static pthread_once_t host_once = PTHREAD_ONCE_INIT;

static void host_id_init(void)
{
    char buf[768] = {0};
    size_t n = 0;
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t r = read(fd, buf, 64);
        n = r > 0 ? (size_t)r : 0;
        close(fd);
    }
    gethostname(buf + n, 128);
    n += strlen(buf + n);
    static const char *const ns[] = {"/proc/self/ns/ipc", "/proc/self/ns/net"};
    for (size_t i = 0; i < 2; i++) {
        ssize_t r = readlink(ns[i], buf + n, sizeof(buf) - n - 1);
        n += r > 0 ? (size_t)r : 0;
    }
    XXH128_hash_t h = XXH3_128bits(buf, n);
    memcpy(host_id, &h.low64, 8);
    memcpy(host_id + 8, &h.high64, 8);
}

void tdp__host_id(uint8_t out[TDP_HOST_ID_LEN])
{
    pthread_once(&host_once, host_id_init);
    memcpy(out, host_id, TDP_HOST_ID_LEN);
}

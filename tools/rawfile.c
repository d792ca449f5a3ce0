/*
 * rawfile.c: a raw consolidated buffer and its schema JSON as a tensordict
 * (datafile.h), for `tdpipe send --schema S.json --file RAW`.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "datafile.h"

/* The schema file, decoded with the limits a receiver applies. */
static tdp_err read_schema(const char *path, tdp_schema **out, char *why, size_t len)
{
    char msg[256] = "";
    struct stat st;
    tdp_err rc;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return tdp_cli_data_fail(why, len, TDP_EINVAL, "schema %s: cannot open: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return tdp_cli_data_fail(why, len, TDP_EINVAL, "schema %s: not a regular file", path);
    }
    if ((uint64_t)st.st_size > TDP_SCHEMA_DEFAULT_MAX_JSON_BYTES) {
        close(fd);
        return tdp_cli_data_fail(why, len, TDP_EINVAL,
                    "schema %s: %" PRIu64 " bytes, over the %u a schema takes", path,
                    (uint64_t)st.st_size, TDP_SCHEMA_DEFAULT_MAX_JSON_BYTES);
    }
    size_t n = (size_t)st.st_size, got = 0;
    char *text = malloc(n ? n : 1);
    if (text == NULL) {
        close(fd);
        return tdp_cli_data_fail(why, len, TDP_ENOMEM, "out of memory");
    }
    while (got < n) {
        ssize_t r = read(fd, text + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    /* a trailing newline (an editor's, or `inspect`'s line) is not part of the JSON */
    while (got > 0 && (text[got - 1] == '\n' || text[got - 1] == '\r'))
        got--;
    rc = tdp_schema_decode(text, got, NULL, out, msg, sizeof(msg));
    free(text);
    if (rc != TDP_OK)
        return tdp_cli_data_fail(why, len, rc == TDP_ENOMEM ? rc : TDP_EINVAL, "schema %s: %s", path,
                    msg[0] ? msg : tdp_strerror(rc));
    return TDP_OK;
}

static void unmap(void *buf, void *arg)
{
    munmap(buf, (size_t)(uintptr_t)arg);
}

tdp_err tdp_cli_raw_load(const char *schema_path, const char *data_path, tdp_td **out, char *why,
                         size_t why_len)
{
    tdp_device cpu = TDP_DEVICE_CPU_INIT;
    tdp_schema *s, *host;
    struct stat st;
    tdp_td *td;
    tdp_err rc = read_schema(schema_path, &s, why, why_len);
    if (rc != TDP_OK)
        return rc;
    /* the bytes are in host memory, whatever device the schema names */
    if (tdp_schema_device(s).type != TDP_DEVICE_CPU) {
        rc = tdp_schema_with_device(s, cpu, &host);
        tdp_schema_unref(s);
        if (rc != TDP_OK)
            return tdp_cli_data_fail(why, why_len, rc, "schema: cannot move it to cpu: %s", tdp_strerror(rc));
        s = host;
    }
    uint64_t total = tdp_schema_total_bytes(s);
    int fd = open(data_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL, "cannot open: %s", strerror(errno));
        goto out_unref;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL, "not a regular file");
        goto out_close;
    }
    if ((uint64_t)st.st_size != total) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL,
                  "%" PRIu64 " bytes, but the schema's buffer (total_bytes) is %" PRIu64,
                  (uint64_t)st.st_size, total);
        goto out_close;
    }
    if (total == 0) {
        rc = tdp_td_new(s, &td);
    } else {
        /*
         * Private and writable, though nothing writes it: registering the
         * buffer with a transport may ask for write access; the pages stay
         * the file's (copy-on-write) unless written.
         */
        void *m = mmap(NULL, (size_t)total, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL, "cannot map: %s", strerror(errno));
            goto out_close;
        }
        rc = tdp_td_wrap(s, m, total, cpu, unmap, (void *)(uintptr_t)total, &td);
        if (rc != TDP_OK)
            munmap(m, (size_t)total);
    }
    if (rc != TDP_OK)
        rc = tdp_cli_data_fail(why, why_len, rc, "cannot make a tensordict of it: %s", tdp_strerror(rc));
    else
        *out = td;
out_close:
    close(fd);
out_unref:
    tdp_schema_unref(s);
    return rc;
}

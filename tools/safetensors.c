/*
 * safetensors.c: safetensors files to and from tensordicts (datafile.h).
 *
 * The format: 8 bytes, little-endian, the header's length N; N bytes of
 * JSON, {"NAME": {"dtype": "F32", "shape": [...], "data_offsets": [BEGIN,
 * END]}, ..., "__metadata__": {"k": "v"}}; then the data, offsets counted
 * from its start.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "datafile.h"

tdp_err tdp_cli_data_fail(char *why, size_t len, tdp_err rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (why != NULL && len > 0)
        vsnprintf(why, len, fmt, ap);
    va_end(ap);
    return rc;
}

static const struct {
    const char *name;
    tdp_dtype dt;
} st_dtypes[] = {
    {"BOOL", TDP_BOOL},
    {"U8", TDP_UINT8},
    {"I8", TDP_INT8},
    {"U16", TDP_UINT16},
    {"I16", TDP_INT16},
    {"U32", TDP_UINT32},
    {"I32", TDP_INT32},
    {"U64", TDP_UINT64},
    {"I64", TDP_INT64},
    {"F16", TDP_FLOAT16},
    {"BF16", TDP_BFLOAT16},
    {"F32", TDP_FLOAT32},
    {"F64", TDP_FLOAT64},
    {"F8_E4M3", TDP_FLOAT8_E4M3FN},
    {"F8_E5M2", TDP_FLOAT8_E5M2},
    {"C64", TDP_COMPLEX64},
};
#define N_ST_DTYPES (sizeof(st_dtypes) / sizeof(st_dtypes[0]))

/* For the message that refuses a dtype. */
#define ST_DTYPE_LIST                                                                              \
    "BOOL, U8, I8, U16, I16, U32, I32, U64, I64, F16, BF16, F32, F64, F8_E4M3, F8_E5M2, C64"

const char *tdp_cli_st_dtype_name(tdp_dtype dt)
{
    for (size_t i = 0; i < N_ST_DTYPES; i++)
        if (st_dtypes[i].dt == dt)
            return st_dtypes[i].name;
    return NULL;
}

static tdp_dtype st_dtype_parse(const char *name)
{
    for (size_t i = 0; i < N_ST_DTYPES; i++)
        if (strcmp(st_dtypes[i].name, name) == 0)
            return st_dtypes[i].dt;
    return TDP_DTYPE_INVALID;
}

/* len bytes at off, whole; false (errno set) on an error or an early end. */
static bool read_at(int fd, void *buf, uint64_t len, uint64_t off)
{
    uint8_t *p = buf;
    while (len > 0) {
        size_t chunk = len > (1u << 30) ? (size_t)1 << 30 : (size_t)len;
        ssize_t n = pread(fd, p, chunk, (off_t)off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            if (n == 0)
                errno = EIO; /* shorter than it was a moment ago */
            return false;
        }
        p += n;
        off += (uint64_t)n;
        len -= (uint64_t)n;
    }
    return true;
}

/*
 * Why `name` cannot be a tensordict path, or NULL when it can: keys are
 * 1..255 bytes without control characters, and dots separate them.
 */
static const char *path_problem(const char *name)
{
    size_t run = 0;
    if (name[0] == '\0')
        return "is empty";
    for (const char *p = name;; p++) {
        if (*p == '.' || *p == '\0') {
            if (run == 0)
                return "has an empty key (a dot at an end, or two in a row)";
            if (run > TDP_SCHEMA_DEFAULT_MAX_KEY_LEN)
                return "has a key over 255 bytes";
            if (*p == '\0')
                return NULL;
            run = 0;
            continue;
        }
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            return "has a control character";
        run++;
    }
}

/* ---- loading ------------------------------------------------------------------ */

typedef struct st_entry {
    const char *name; /* borrowed from the parsed header */
    tdp_dtype dtype;
    const char *dtype_name;
    uint32_t ndim;
    int64_t shape[TDP_SCHEMA_DEFAULT_MAX_RANK];
    uint64_t begin, end;
} st_entry;

static int entry_cmp(const void *a, const void *b)
{
    const st_entry *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* A non-negative JSON integer into *out. */
static bool json_u64(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

/* One header entry, checked against itself and the data's length. */
static tdp_err parse_entry(const char *name, json_t *v, uint64_t data_len, st_entry *e, char *why,
                           size_t len)
{
    json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape"),
           *offs = json_object_get(v, "data_offsets");
    uint64_t numel = 1, nbytes, d;

    *e = (st_entry){.name = name};
    if (!json_is_object(v))
        return tdp_cli_data_fail(why, len, TDP_EINVAL, "tensor '%s': its entry is not a JSON object", name);
    if (!json_is_string(dt))
        return tdp_cli_data_fail(why, len, TDP_EINVAL, "tensor '%s': no \"dtype\" string", name);
    e->dtype_name = json_string_value(dt);
    if ((e->dtype = st_dtype_parse(e->dtype_name)) == TDP_DTYPE_INVALID)
        return tdp_cli_data_fail(why, len, TDP_ENOTSUP,
                    "tensor '%s': dtype '%s' is not supported (tdpipe takes " ST_DTYPE_LIST ")",
                    name, e->dtype_name);
    if (!json_is_array(shape))
        return tdp_cli_data_fail(why, len, TDP_EINVAL, "tensor '%s': no \"shape\" array", name);
    if (json_array_size(shape) > TDP_SCHEMA_DEFAULT_MAX_RANK)
        return tdp_cli_data_fail(why, len, TDP_ENOTSUP,
                    "tensor '%s': %zu dimensions, over the %u a schema takes", name,
                    json_array_size(shape), TDP_SCHEMA_DEFAULT_MAX_RANK);
    e->ndim = (uint32_t)json_array_size(shape);
    for (uint32_t i = 0; i < e->ndim; i++) {
        if (!json_u64(json_array_get(shape, i), &d))
            return tdp_cli_data_fail(why, len, TDP_EINVAL,
                        "tensor '%s': shape[%u] is not a non-negative integer", name, i);
        e->shape[i] = (int64_t)d; /* json_int_t is 64-bit: d < 2^63 */
        if (__builtin_mul_overflow(numel, d, &numel))
            return tdp_cli_data_fail(why, len, TDP_EINVAL, "tensor '%s': its shape's element count overflows",
                        name);
    }
    if (__builtin_mul_overflow(numel, tdp_dtype_itemsize(e->dtype), &nbytes))
        return tdp_cli_data_fail(why, len, TDP_EINVAL, "tensor '%s': its size in bytes overflows", name);
    if (!json_is_array(offs) || json_array_size(offs) != 2 ||
        !json_u64(json_array_get(offs, 0), &e->begin) ||
        !json_u64(json_array_get(offs, 1), &e->end))
        return tdp_cli_data_fail(why, len, TDP_EINVAL,
                    "tensor '%s': \"data_offsets\" is not [BEGIN, END] (non-negative integers)",
                    name);
    if (e->begin > e->end)
        return tdp_cli_data_fail(why, len, TDP_EINVAL,
                    "tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] end before they begin",
                    name, e->begin, e->end);
    if (e->end > data_len)
        return tdp_cli_data_fail(why, len, TDP_EINVAL,
                    "tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] go past the end of the "
                    "data (%" PRIu64 " bytes after the header)",
                    name, e->begin, e->end, data_len);
    if (e->end - e->begin != nbytes)
        return tdp_cli_data_fail(why, len, TDP_EINVAL,
                    "tensor '%s': data_offsets span %" PRIu64 " bytes, but %" PRIu64
                    " elements of %s take %" PRIu64,
                    name, e->end - e->begin, numel, e->dtype_name, nbytes);
    return TDP_OK;
}

/*
 * The format has no gaps and no sharing: the ranges, sorted, start at 0,
 * touch end to end and stop at the end of the data.
 */
static tdp_err check_cover(const st_entry *e, size_t n, uint64_t data_len, char *why, size_t len)
{
    uint64_t at = 0;
    for (size_t i = 0; i < n; i++) {
        if (e[i].begin < at)
            return tdp_cli_data_fail(why, len, TDP_EINVAL,
                        "tensors '%s' and '%s' overlap (data_offsets [%" PRIu64 ", %" PRIu64
                        "] and [%" PRIu64 ", %" PRIu64 "])",
                        e[i - 1].name, e[i].name, e[i - 1].begin, e[i - 1].end, e[i].begin,
                        e[i].end);
        if (e[i].begin > at)
            return tdp_cli_data_fail(why, len, TDP_EINVAL,
                        "data bytes [%" PRIu64 ", %" PRIu64 ") belong to no tensor (the format "
                        "has no gaps)",
                        at, e[i].begin);
        at = e[i].end;
    }
    if (at != data_len)
        return tdp_cli_data_fail(why, len, TDP_EINVAL,
                    "the data after the header is %" PRIu64
                    " bytes, but the tensors end at %" PRIu64,
                    data_len, at);
    return TDP_OK;
}

/* Bytes of a string value as a schema encodes it (ASCII, escaped). */
static size_t encoded_len(const char *s)
{
    json_t *v = json_string(s);
    char *t = v ? json_dumps(v, JSON_ENCODE_ANY | JSON_ENSURE_ASCII) : NULL;
    size_t n = t ? strlen(t) : SIZE_MAX;
    free(t);
    json_decref(v);
    return n;
}

/* The metadata as string values under TDP_CLI_ST_META; what cannot be one is left out. */
static tdp_err add_metadata(tdp_schema_builder *b, json_t *meta, FILE *warn, char *why, size_t len)
{
    const char *key;
    json_t *v;
    char path[TDP_SCHEMA_DEFAULT_MAX_KEY_LEN * 2 + 32];

    json_object_foreach(meta, key, v)
    {
        if (!json_is_string(v))
            return tdp_cli_data_fail(why, len, TDP_EINVAL,
                        "__metadata__ '%s': not a string (the format maps "
                        "strings to strings)",
                        key);
        const char *problem = path_problem(key);
        if (problem == NULL && strlen(key) + sizeof(TDP_CLI_ST_META) + 1 > sizeof(path))
            problem = "is too long";
        if (problem == NULL &&
            encoded_len(json_string_value(v)) > TDP_SCHEMA_DEFAULT_MAX_VALUE_BYTES)
            problem = "has a value over the schema's limit (4096 bytes encoded)";
        if (problem == NULL) {
            snprintf(path, sizeof(path), TDP_CLI_ST_META ".%s", key);
            tdp_err rc = tdp_schema_builder_string(b, path, json_string_value(v));
            if (rc == TDP_ENOMEM)
                return tdp_cli_data_fail(why, len, rc, "out of memory");
            if (rc != TDP_OK)
                problem = "clashes with another key";
        }
        if (problem != NULL && warn != NULL)
            fprintf(warn, "tdpipe send: __metadata__ '%s' left out: it %s\n", key, problem);
    }
    return TDP_OK;
}

/* The schema: tensors in data order, then the metadata. */
static tdp_err build_schema(const st_entry *e, size_t n, json_t *meta, FILE *warn, tdp_schema **out,
                            char *why, size_t len)
{
    tdp_schema_builder *b;
    char msg[256];
    tdp_err rc = tdp_schema_builder_new(&b);
    if (rc != TDP_OK)
        return tdp_cli_data_fail(why, len, rc, "cannot make a schema: %s", tdp_strerror(rc));
    for (size_t i = 0; i < n; i++) {
        const char *problem = path_problem(e[i].name);
        if (problem != NULL) {
            rc = tdp_cli_data_fail(why, len, TDP_ENOTSUP,
                      "tensor '%s': its name %s; a tensordict's keys are separated by dots",
                      e[i].name, problem);
            goto out_free;
        }
        rc = tdp_schema_builder_tensor(b, e[i].name, e[i].dtype, e[i].ndim, e[i].shape);
        if (rc == TDP_EINVAL)
            rc = tdp_cli_data_fail(why, len, TDP_ENOTSUP,
                      "tensor '%s': its name clashes with another's (a tensor cannot also be "
                      "a node: 'a' and 'a.b')",
                      e[i].name);
        else if (rc != TDP_OK)
            rc = tdp_cli_data_fail(why, len, rc, "tensor '%s': %s", e[i].name, tdp_strerror(rc));
        if (rc != TDP_OK)
            goto out_free;
    }
    if (meta != NULL && (rc = add_metadata(b, meta, warn, why, len)) != TDP_OK)
        goto out_free;
    msg[0] = '\0';
    rc = tdp_schema_builder_finish(b, out, msg, sizeof(msg));
    if (rc != TDP_OK)
        rc = tdp_cli_data_fail(why, len, rc == TDP_ENOMEM ? rc : TDP_ENOTSUP,
                  "not a schema a tensordict can carry: %s", msg[0] ? msg : tdp_strerror(rc));
out_free:
    tdp_schema_builder_free(b);
    return rc;
}

/* The header, parsed and checked against the data's length. */
static tdp_err parse_header(json_t *root, uint64_t data_len, st_entry **entries, size_t *count,
                            json_t **meta, char *why, size_t len)
{
    const char *key;
    json_t *v;
    size_t n = 0, cap;
    tdp_err rc;

    if (!json_is_object(root))
        return tdp_cli_data_fail(why, len, TDP_EINVAL, "the header is not a JSON object");
    *meta = json_object_get(root, TDP_CLI_ST_META);
    cap = json_object_size(root) - (*meta != NULL);
    if (json_is_null(*meta))
        *meta = NULL; /* as good as absent */
    if (*meta != NULL && !json_is_object(*meta))
        return tdp_cli_data_fail(why, len, TDP_EINVAL, "\"__metadata__\" is not an object");
    if (cap > TDP_SCHEMA_DEFAULT_MAX_KEYS)
        return tdp_cli_data_fail(why, len, TDP_ENOTSUP, "%zu tensors, over the %u keys a schema takes", cap,
                    TDP_SCHEMA_DEFAULT_MAX_KEYS);
    st_entry *e = calloc(cap ? cap : 1, sizeof(*e));
    if (e == NULL)
        return tdp_cli_data_fail(why, len, TDP_ENOMEM, "out of memory");
    json_object_foreach(root, key, v)
    {
        if (strcmp(key, TDP_CLI_ST_META) == 0)
            continue;
        if ((rc = parse_entry(key, v, data_len, &e[n], why, len)) != TDP_OK) {
            free(e);
            return rc;
        }
        n++;
    }
    qsort(e, n, sizeof(*e), entry_cmp);
    if ((rc = check_cover(e, n, data_len, why, len)) != TDP_OK) {
        free(e);
        return rc;
    }
    *entries = e;
    *count = n;
    return TDP_OK;
}

tdp_err tdp_cli_st_load(const char *path, FILE *warn, tdp_td **out, char *why, size_t why_len)
{
    uint8_t lenbuf[8];
    uint64_t hlen = 0, size;
    struct stat st;
    json_error_t jerr;
    json_t *root = NULL, *meta;
    st_entry *e = NULL;
    size_t n = 0;
    char *hdr = NULL;
    tdp_schema *s = NULL;
    tdp_td *td = NULL;
    tdp_err rc;

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return tdp_cli_data_fail(why, why_len, TDP_EINVAL, "cannot open: %s", strerror(errno));
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL, "not a regular file");
        goto out_close;
    }
    size = (uint64_t)st.st_size;
    if (size < 8) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL,
                  "%" PRIu64 " bytes: too short for a safetensors file (8-byte header length)",
                  size);
        goto out_close;
    }
    if (!read_at(fd, lenbuf, 8, 0)) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL, "cannot read: %s", strerror(errno));
        goto out_close;
    }
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | lenbuf[i];
    if (hlen > size - 8) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL,
                  "the header length (%" PRIu64 " bytes) goes past the end of the file (%" PRIu64
                  " bytes): not a safetensors file, or a truncated one",
                  hlen, size);
        goto out_close;
    }
    if (hlen > TDP_CLI_ST_MAX_HEADER) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL,
                  "the header is %" PRIu64 " bytes, over the format's limit of %llu", hlen,
                  TDP_CLI_ST_MAX_HEADER);
        goto out_close;
    }
    if ((hdr = malloc(hlen ? hlen : 1)) == NULL) {
        rc = tdp_cli_data_fail(why, why_len, TDP_ENOMEM, "out of memory for a %" PRIu64 "-byte header", hlen);
        goto out_close;
    }
    if (!read_at(fd, hdr, hlen, 8)) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL, "cannot read the header: %s", strerror(errno));
        goto out_free;
    }
    /* duplicate names would make two tensors one; NUL bytes are refused by default */
    if (hlen == 0 || hdr[0] != '{') {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL,
                  "the header does not start with '{': not a safetensors file");
        goto out_free;
    }
    if ((root = json_loadb(hdr, hlen, JSON_REJECT_DUPLICATES, &jerr)) == NULL) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL, "the header is not valid JSON: %s (header byte %d)",
                  jerr.text, jerr.position);
        goto out_free;
    }
    uint64_t data_off = 8 + hlen, data_len = size - data_off;
    if ((rc = parse_header(root, data_len, &e, &n, &meta, why, why_len)) != TDP_OK ||
        (rc = build_schema(e, n, meta, warn, &s, why, why_len)) != TDP_OK)
        goto out_free;
    if ((rc = tdp_td_new(s, &td)) != TDP_OK) {
        rc = tdp_cli_data_fail(why, why_len, rc, "cannot allocate %" PRIu64 " bytes: %s",
                  tdp_schema_total_bytes(s), tdp_strerror(rc));
        goto out_free;
    }
    for (size_t i = 0; i < n; i++) {
        tdp_leaf l;
        if ((rc = tdp_td_get(td, e[i].name, &l)) != TDP_OK) {
            rc = tdp_cli_data_fail(why, why_len, TDP_EINTERNAL, "tensor '%s' is not in its own schema",
                      e[i].name);
            goto out_free;
        }
        if (!read_at(fd, l.data, l.nbytes, data_off + e[i].begin)) {
            rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL, "tensor '%s': cannot read its data: %s", e[i].name,
                      strerror(errno));
            goto out_free;
        }
    }
    *out = td;
    td = NULL;
    rc = TDP_OK;
out_free:
    tdp_td_unref(td);
    tdp_schema_unref(s);
    free(e);
    json_decref(root);
    free(hdr);
out_close:
    close(fd);
    return rc;
}

/* ---- writing ------------------------------------------------------------------ */

/* The header: "__metadata__" first (from value leaves), then the tensors. */
static tdp_err make_header(const tdp_td *td, json_t **out, char *why, size_t len)
{
    static const char meta_prefix[] = TDP_CLI_ST_META ".";
    json_t *root = json_object(), *meta = json_object();
    uint32_t n = tdp_td_num_leaves(td);
    uint64_t off = 0;
    tdp_err rc = TDP_ENOMEM;

    if (root == NULL || meta == NULL)
        goto err;
    for (uint32_t i = 0; i < n; i++) {
        tdp_leaf l;
        if (tdp_td_leaf_at(td, i, &l) != TDP_OK || l.kind != TDP_LEAF_VALUE)
            continue;
        const char *key = l.path, *text = l.value_json;
        json_t *v = NULL;
        if (strncmp(key, meta_prefix, sizeof(meta_prefix) - 1) == 0) {
            v = json_loads(l.value_json, JSON_DECODE_ANY, NULL);
            if (json_is_string(v)) {
                key += sizeof(meta_prefix) - 1;
                text = json_string_value(v);
            }
        }
        int bad = json_object_set_new(meta, key, json_string(text));
        json_decref(v);
        if (bad)
            goto err;
    }
    if (json_object_size(meta) > 0 && json_object_set(root, TDP_CLI_ST_META, meta) != 0)
        goto err;
    for (uint32_t i = 0; i < n; i++) {
        tdp_leaf l;
        if (tdp_td_leaf_at(td, i, &l) != TDP_OK || l.kind != TDP_LEAF_TENSOR)
            continue;
        const char *dt = tdp_cli_st_dtype_name(l.dtype);
        if (dt == NULL) {
            rc = tdp_cli_data_fail(why, len, TDP_ENOTSUP, "tensor '%s': safetensors has no name for %s", l.path,
                      tdp_dtype_name(l.dtype));
            goto err_quiet;
        }
        if (strcmp(l.path, TDP_CLI_ST_META) == 0) {
            rc = tdp_cli_data_fail(why, len, TDP_ENOTSUP,
                      "a tensor named '" TDP_CLI_ST_META "' (the format reserves the name)");
            goto err_quiet;
        }
        json_t *shape = json_array(), *e;
        for (uint32_t d = 0; shape != NULL && d < l.ndim; d++)
            if (json_array_append_new(shape, json_integer(l.shape[d])) != 0) {
                json_decref(shape);
                shape = NULL;
            }
        e = shape ? json_pack("{s:s, s:o, s:[I, I]}", "dtype", dt, "shape", shape, "data_offsets",
                              (json_int_t)off, (json_int_t)(off + l.nbytes))
                  : NULL;
        if (e == NULL || json_object_set_new(root, l.path, e) != 0)
            goto err;
        off += l.nbytes;
    }
    json_decref(meta);
    *out = root;
    return TDP_OK;
err:
    rc = tdp_cli_data_fail(why, len, TDP_ENOMEM, "out of memory (or a name that is not UTF-8)");
err_quiet:
    json_decref(meta);
    json_decref(root);
    return rc;
}

tdp_err tdp_cli_st_write(const tdp_td *td, const char *path, char *why, size_t why_len)
{
    json_t *root;
    char *hdr = NULL, *tmp = NULL;
    FILE *f = NULL;
    tdp_err rc;

    if (tdp_td_device(td).type != TDP_DEVICE_CPU)
        return tdp_cli_data_fail(why, why_len, TDP_ENOTSUP, "the message is in device memory");
    if ((rc = make_header(td, &root, why, why_len)) != TDP_OK)
        return rc;
    hdr = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    size_t plen = strlen(path) + 5;
    if (hdr == NULL || (tmp = malloc(plen)) == NULL) {
        rc = tdp_cli_data_fail(why, why_len, TDP_ENOMEM, "out of memory");
        goto out_free;
    }
    snprintf(tmp, plen, "%s.tmp", path);
    size_t hlen = strlen(hdr), padded = (hlen + 7) & ~(size_t)7;
    uint8_t lenbuf[8];
    for (int i = 0; i < 8; i++)
        lenbuf[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    if ((f = fopen(tmp, "wb")) == NULL) {
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL, "cannot create %s: %s", tmp, strerror(errno));
        goto out_free;
    }
    bool ok = fwrite(lenbuf, 1, 8, f) == 8 && fwrite(hdr, 1, hlen, f) == hlen &&
              fwrite("       ", 1, padded - hlen, f) == padded - hlen;
    for (uint32_t i = 0; ok && i < tdp_td_num_leaves(td); i++) {
        tdp_leaf l;
        if (tdp_td_leaf_at(td, i, &l) == TDP_OK && l.kind == TDP_LEAF_TENSOR && l.nbytes > 0)
            ok = fwrite(l.data, 1, l.nbytes, f) == l.nbytes;
    }
    int err = ok ? 0 : errno;
    if (fclose(f) != 0 && ok) {
        ok = false;
        err = errno;
    }
    if (ok && rename(tmp, path) != 0) {
        ok = false;
        err = errno;
    }
    if (!ok) {
        unlink(tmp);
        rc = tdp_cli_data_fail(why, why_len, TDP_EINVAL, "cannot write %s: %s", path, strerror(err ? err : EIO));
    }
out_free:
    free(tmp);
    free(hdr);
    return rc;
}

/* ---- recv --dump ------------------------------------------------------------------ */

bool tdp_cli_dump_dir(const char *dir, char *why, size_t why_len)
{
    char buf[PATH_MAX];
    struct stat st;
    size_t n = strlen(dir);
    if (n == 0 || n >= sizeof(buf)) {
        tdp_cli_data_fail(why, why_len, TDP_EINVAL, n ? "the path is too long" : "an empty path");
        return false;
    }
    memcpy(buf, dir, n + 1);
    /* each parent in turn, as mkdir -p */
    for (char *p = buf + 1;; p++) {
        if (*p != '/' && *p != '\0')
            continue;
        char c = *p;
        *p = '\0';
        if (mkdir(buf, 0777) != 0 && errno != EEXIST) {
            tdp_cli_data_fail(why, why_len, TDP_EINVAL, "cannot create %s: %s", buf, strerror(errno));
            return false;
        }
        *p = c;
        if (c == '\0')
            break;
    }
    const char *problem = stat(dir, &st) != 0             ? strerror(errno)
                          : !S_ISDIR(st.st_mode)          ? "not a directory"
                          : access(dir, W_OK | X_OK) != 0 ? strerror(errno)
                                                          : NULL;
    if (problem != NULL)
        tdp_cli_data_fail(why, why_len, TDP_EINVAL, "%s", problem);
    return problem == NULL;
}

tdp_err tdp_cli_dump(const char *dir, uint64_t n, const tdp_td *td, char *why, size_t why_len)
{
    char path[PATH_MAX];
    int len = snprintf(path, sizeof(path), "%s/msg-%06" PRIu64 ".safetensors", dir, n);
    if (len < 0 || (size_t)len >= sizeof(path))
        return tdp_cli_data_fail(why, why_len, TDP_EINVAL, "the path is too long");
    return tdp_cli_st_write(td, path, why, why_len);
}

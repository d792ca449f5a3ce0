/*
 * datafile.h: real tensors from and to files, for `tdpipe send --file` and
 * `tdpipe recv --dump` (docs/cli.md#files).
 *
 * Loaders read a file the user named, so they trust nothing in it: every
 * length, offset and shape is checked (overflow included) before a byte of
 * data is read. On failure they return an error and write one line into
 * `why` (NUL-terminated, no file name and no newline) saying what is wrong:
 *   TDP_EINVAL   the file is unreadable or not what it claims to be
 *   TDP_ENOTSUP  well-formed, but holds something a tensordict cannot carry
 *                (an unknown dtype, a name that is not a valid path)
 *   TDP_ENOMEM   out of memory
 * On success *out holds one reference on a host-memory tensordict.
 */
#ifndef TDPIPE_TOOLS_DATAFILE_H
#define TDPIPE_TOOLS_DATAFILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <tdpipe/tdpipe.h>

/*
 * Largest safetensors header read (JSON bytes). The format's own reference
 * reader stops at 100 MB; the schema a tensordict can carry is far smaller
 * (TDP_SCHEMA_DEFAULT_MAX_JSON_BYTES), which finish() then enforces.
 */
#define TDP_CLI_ST_MAX_HEADER 100000000ull

/*
 * Metadata of a safetensors file ("__metadata__": string to string) lives
 * in the tensordict as string values under this node, so that a dump
 * writes it back.
 */
#define TDP_CLI_ST_META "__metadata__"

/* Write why (printf-style, when why is not NULL) and return rc. */
tdp_err tdp_cli_data_fail(char *why, size_t len, tdp_err rc, const char *fmt, ...)
    TDP_CHECK_FMT(4, 5);

/*
 * Read a safetensors file: 8 bytes of little-endian header length N, N
 * bytes of JSON, then the data. Tensor "a.b.c" becomes leaf c of node a.b
 * (a name's dots are the tensordict's path separator); tensors are laid
 * out in the file's order, each copied once into a fresh buffer (the
 * builder pads leaves to TDP_LEAF_ALIGN, so the file cannot be used in
 * place). The data must be covered exactly, as the format requires: the
 * tensors' byte ranges, sorted, start at 0, touch end to end and stop at
 * the file's end. Metadata entries that cannot be a value leaf (a key that
 * is not a valid path, a value over the schema's value limit) are left
 * out, each with a warning line on `warn` (may be NULL; the lines start
 * "tdpipe send: ", its only user).
 */
tdp_err tdp_cli_st_load(const char *path, FILE *warn, tdp_td **out, char *why, size_t why_len);

/*
 * Write td's tensor leaves as a safetensors file: names are the leaves'
 * dotted paths, data in leaf order with no padding, the header padded
 * with spaces to a multiple of 8 bytes. String values under
 * TDP_CLI_ST_META go back into "__metadata__" under their own key; other
 * value leaves go there too, as PATH -> the value's JSON text. The file
 * is written next to `path` and renamed onto it, so a reader never sees
 * half a file. TDP_ENOTSUP for a dtype safetensors cannot name
 * (complex128), device memory or a tensor named "__metadata__";
 * TDP_EINVAL when the file cannot be written (why says why).
 */
tdp_err tdp_cli_st_write(const tdp_td *td, const char *path, char *why, size_t why_len);

/*
 * A raw buffer and its schema: `schema_path` holds tdpipe schema JSON
 * (docs/schema.md, as `tdpipe inspect` prints it), `data_path` exactly its
 * total_bytes. The data file is mapped (private, copy-on-write, never
 * written), not copied; the schema's device becomes cpu.
 */
tdp_err tdp_cli_raw_load(const char *schema_path, const char *data_path, tdp_td **out, char *why,
                         size_t why_len);

/*
 * `recv --dump DIR`: make DIR (and its parents) unless it exists, and check
 * that it is a directory this process can write in. False with why set
 * otherwise.
 */
bool tdp_cli_dump_dir(const char *dir, char *why, size_t why_len);

/* Write message n (from 1) as DIR/msg-NNNNNN.safetensors (tdp_cli_st_write). */
tdp_err tdp_cli_dump(const char *dir, uint64_t n, const tdp_td *td, char *why, size_t why_len);

/* The safetensors name of dt ("F32"), or NULL when it has none. */
const char *tdp_cli_st_dtype_name(tdp_dtype dt);

#endif /* TDPIPE_TOOLS_DATAFILE_H */

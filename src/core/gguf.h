/*
 * gguf.h - GGUF v2/v3 reader (mmap, fully bounds-checked) and streaming writer.
 *
 * Layout of a GGUF file (all little-endian):
 *   u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv x { string key | u32 value_type | value }
 *   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 type | u64 offset }
 *   padding to `general.alignment` (default 32)
 *   tensor data; each tensor at data_start + offset (offset aligned)
 * A string is u64 length + bytes (no terminator). An array value is
 * u32 element_type + u64 count + elements; arrays may nest.
 *
 * The reader validates everything when the file opens: every count, length,
 * offset and size is checked against the bytes that remain before it is used,
 * so no later accessor can read outside the mapping, and no count from the file
 * can make it allocate more than the file could describe. Errors name the byte
 * offset and what was wrong.
 */
#ifndef DS4_CORE_GGUF_H
#define DS4_CORE_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gguf_value_type {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT = 13,
} gguf_value_type;

#define GGUF_MAGIC 0x46554747u /* "GGUF" */
#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_DIMS 4
#define GGUF_MAX_ARRAY_DEPTH 8

/* A string inside the mapped file: not NUL-terminated. */
typedef struct gguf_str {
    const char *ptr;
    uint64_t len;
} gguf_str;

/* A metadata value. For scalars `data` points at the value bytes. For strings
 * `str` is set. For arrays, `elem_type` and `count` are set and `data` points
 * at the first element; `bytes` is the encoded size of the whole value. */
typedef struct gguf_value {
    gguf_value_type type;
    gguf_value_type elem_type; /* arrays only */
    uint64_t count;            /* arrays only */
    const uint8_t *data;
    uint64_t bytes;
    gguf_str str; /* strings only */
} gguf_value;

typedef struct gguf_kv {
    gguf_str key;
    gguf_value value;
    uint64_t file_offset; /* where the key starts */
} gguf_kv;

typedef struct gguf_tensor {
    gguf_str name;
    uint32_t n_dims;
    uint64_t ne[GGUF_MAX_DIMS]; /* ne[0] is the fastest-varying dimension; unused dims are 1 */
    uint32_t type;              /* ds4_type id */
    uint64_t offset;            /* relative to the data section */
    uint64_t n_elements;
    uint64_t n_bytes;
    const uint8_t *data; /* inside the mapping */
    uint64_t file_offset; /* absolute offset of the data */
} gguf_tensor;

typedef struct gguf_file {
    char *path;
    const uint8_t *map;
    uint64_t size;
    uint32_t version;
    uint32_t alignment;
    uint64_t n_kv;
    gguf_kv *kv;
    uint64_t n_tensors;
    gguf_tensor *tensors;
    uint64_t data_offset; /* start of the data section */
    bool owns_map;        /* true when mmap'd by gguf_open */
    uint64_t *name_hash;  /* open-addressing index of tensor names -> index+1 */
    uint64_t name_hash_cap;
} gguf_file;

/* Open and validate a file (mmap, read-only). */
ds4_status gguf_open(const char *path, gguf_file **out, ds4_error *err);
/* Validate an in-memory image (the caller keeps it alive; used by the fuzzer). */
ds4_status gguf_open_memory(const void *data, size_t size, gguf_file **out, ds4_error *err);
void gguf_close(gguf_file *f);

/* Lookups. NULL when absent. */
const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);

/* Typed getters: DS4_ERR_NOT_FOUND when absent, DS4_ERR_FORMAT when the stored
 * type differs (the message names the key, the expected and the found type). */
ds4_status gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, ds4_error *err);
ds4_status gguf_get_u64(const gguf_file *f, const char *key, uint64_t *out, ds4_error *err);
ds4_status gguf_get_f32(const gguf_file *f, const char *key, float *out, ds4_error *err);
ds4_status gguf_get_bool(const gguf_file *f, const char *key, bool *out, ds4_error *err);
ds4_status gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, ds4_error *err);

/* Scalar value as a number: u8..f64 and bool. false for strings/arrays. */
bool gguf_value_as_double(const gguf_value *v, double *out);
bool gguf_value_as_i64(const gguf_value *v, int64_t *out);

/* Array iteration (arrays were validated at open; iteration cannot fail). */
typedef struct gguf_array_iter {
    const gguf_value *array;
    uint64_t index;
    const uint8_t *pos;
} gguf_array_iter;
void gguf_array_iter_init(gguf_array_iter *it, const gguf_value *array);
/* Next element as a value (nested arrays come out as array values). */
bool gguf_array_iter_next(gguf_array_iter *it, gguf_value *elem);

const char *gguf_value_type_name(uint32_t t);
/* Size in bytes of a fixed-size scalar type, 0 for string/array/unknown. */
size_t gguf_value_type_size(uint32_t t);
/* Compare a gguf_str with a C string. */
bool gguf_str_eq(gguf_str s, const char *c);

/* ------------------------------------------------------------------ writer
 * Streaming writer: declare metadata and tensors first, then write each
 * tensor's bytes in declaration order. The header (with every offset) is
 * written on the first tensor write (or at finish); tensor data is padded to
 * the alignment. The output is written to "<path>.tmp" and renamed over
 * `path` by gguf_writer_finish, so a crash never leaves a half-written file
 * under the final name.
 */
typedef struct gguf_writer gguf_writer;

/* A non-default alignment is recorded as `general.alignment` (u32): callers may
 * add that key themselves to place it (it must equal `alignment`), otherwise
 * the writer appends it. */
ds4_status gguf_writer_open(const char *path, uint32_t alignment, gguf_writer **out, ds4_error *err);
ds4_status gguf_writer_add_u8(gguf_writer *w, const char *key, uint8_t v);
ds4_status gguf_writer_add_i8(gguf_writer *w, const char *key, int8_t v);
ds4_status gguf_writer_add_u16(gguf_writer *w, const char *key, uint16_t v);
ds4_status gguf_writer_add_i16(gguf_writer *w, const char *key, int16_t v);
ds4_status gguf_writer_add_u32(gguf_writer *w, const char *key, uint32_t v);
ds4_status gguf_writer_add_i32(gguf_writer *w, const char *key, int32_t v);
ds4_status gguf_writer_add_u64(gguf_writer *w, const char *key, uint64_t v);
ds4_status gguf_writer_add_i64(gguf_writer *w, const char *key, int64_t v);
ds4_status gguf_writer_add_f32(gguf_writer *w, const char *key, float v);
ds4_status gguf_writer_add_f64(gguf_writer *w, const char *key, double v);
ds4_status gguf_writer_add_bool(gguf_writer *w, const char *key, bool v);
ds4_status gguf_writer_add_str(gguf_writer *w, const char *key, const char *v);
/* Array of fixed-size scalars (elem_type u8..f64, bool), `count` elements at `data`. */
ds4_status gguf_writer_add_array(gguf_writer *w, const char *key, gguf_value_type elem_type,
                                 const void *data, uint64_t count);
/* Array of strings. */
ds4_status gguf_writer_add_str_array(gguf_writer *w, const char *key, const char *const *strs, uint64_t count);
/* Copy a metadata value verbatim (any type, nested arrays too) from a reader. */
ds4_status gguf_writer_add_value(gguf_writer *w, const char *key, const gguf_value *v);

ds4_status gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                                  const uint64_t *ne);
/* Append bytes of the current tensor; a tensor may be written in pieces. */
ds4_status gguf_writer_write(gguf_writer *w, const void *data, uint64_t n);
/* Append n zero bytes of the current tensor(s) without writing them: the
 * file gets a hole (sparse on file systems that support it). */
ds4_status gguf_writer_write_zeros(gguf_writer *w, uint64_t n);
/* Finish: check every tensor got exactly its bytes, flush, fsync, rename.
 * Always frees the writer; on failure the temp file is removed and `err`
 * says why (the first error of any earlier call). */
ds4_status gguf_writer_finish(gguf_writer *w, ds4_error *err);
/* Abandon: remove the temp file and free the writer. */
void gguf_writer_abort(gguf_writer *w);
/* The first error recorded by the writer (writer calls return its status). */
const ds4_error *gguf_writer_error(const gguf_writer *w);

#ifdef __cplusplus
}
#endif

#endif

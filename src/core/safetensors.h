/*
 * safetensors.h - safetensors reader (mmap, fully bounds-checked), single
 * files and multi-file checkpoints.
 *
 * Layout of a .safetensors file (little-endian):
 *   u64 header_len | header_len bytes of UTF-8 JSON | data section
 * The JSON is an object; each key other than "__metadata__" names a tensor:
 *   "name": {"dtype": "F16", "shape": [a, b], "data_offsets": [begin, end]}
 * with offsets relative to the start of the data section. Shapes are in torch
 * order (outermost dimension first). The format requires the tensors to cover
 * the data section exactly: no overlaps, no holes, no trailing bytes.
 *
 * safetensors_open validates everything up front (header length, JSON, every
 * dtype, shape, size and offset against the file), so accessors can trust the
 * parsed table. Errors name the byte offset or tensor and what was wrong.
 *
 * A checkpoint directory holds either model.safetensors or
 * model.safetensors.index.json whose "weight_map" maps tensor names to shard
 * file names (plain names inside the directory).
 */
#ifndef DS4_CORE_SAFETENSORS_H
#define DS4_CORE_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SAFETENSORS_MAX_DIMS 8
#define SAFETENSORS_MAX_HEADER (100u * 1024u * 1024u) /* bytes of JSON header accepted */

typedef enum safetensors_dtype {
    ST_F64,
    ST_F32,
    ST_F16,
    ST_BF16,
    ST_I64,
    ST_I32,
    ST_I16,
    ST_I8,
    ST_U8,
    ST_BOOL,
    /* Known to the format, sized here, but not convertible by our helpers. */
    ST_U64,
    ST_U32,
    ST_U16,
    ST_F8_E4M3,
    ST_F8_E5M2,
    ST_F8_E8M0,
    ST_DTYPE_COUNT,
} safetensors_dtype;

typedef struct safetensors_tensor {
    char *name;                              /* NUL-terminated */
    safetensors_dtype dtype;
    uint32_t n_dims;                         /* 0 for a scalar */
    uint64_t shape[SAFETENSORS_MAX_DIMS];    /* torch order: shape[0] outermost */
    uint64_t n_elements;
    uint64_t n_bytes;
    const uint8_t *data;                     /* inside the mapping */
    uint64_t file_offset;                    /* absolute offset of the data */
    const char *file_path;                   /* the file it lives in */
} safetensors_tensor;

typedef struct safetensors_file {
    char *path;
    const uint8_t *map;
    uint64_t size;
    bool owns_map;
    uint64_t header_len;
    uint64_t data_offset; /* 8 + header_len */
    uint64_t n_tensors;
    safetensors_tensor *tensors; /* in data-offset order */
    uint64_t *name_hash;         /* open addressing: index + 1 */
    uint64_t name_hash_cap;
} safetensors_file;

/* Open and validate a file (mmap, read-only). */
ds4_status safetensors_open(const char *path, safetensors_file **out, ds4_error *err);
/* Validate an in-memory image (the caller keeps it alive). */
ds4_status safetensors_open_memory(const void *data, size_t size, safetensors_file **out, ds4_error *err);
void safetensors_close(safetensors_file *f);
const safetensors_tensor *safetensors_find(const safetensors_file *f, const char *name);

/* A checkpoint: one or more files, one tensor namespace. */
typedef struct safetensors_checkpoint {
    char *dir;
    int n_files;
    safetensors_file **files;
    uint64_t n_tensors;
    const safetensors_tensor **tensors; /* every tensor of every file */
    uint64_t *name_hash;
    uint64_t name_hash_cap;
} safetensors_checkpoint;

/* Open DIR/model.safetensors.index.json if present, else DIR/model.safetensors. */
ds4_status safetensors_checkpoint_open(const char *dir, safetensors_checkpoint **out, ds4_error *err);
void safetensors_checkpoint_close(safetensors_checkpoint *c);
const safetensors_tensor *safetensors_checkpoint_find(const safetensors_checkpoint *c, const char *name);
/* Index of a tensor in c->tensors, or UINT64_MAX when absent. */
uint64_t safetensors_checkpoint_index(const safetensors_checkpoint *c, const char *name);

const char *safetensors_dtype_name(safetensors_dtype t);
size_t safetensors_dtype_size(safetensors_dtype t);
bool safetensors_dtype_is_float(safetensors_dtype t); /* F64, F32, F16, BF16 */
bool safetensors_dtype_is_int(safetensors_dtype t);   /* I64..I8, U8, BOOL */

/* Elements [first, first + n) of a float tensor (F64/F32/F16/BF16) as float32
 * (F64 rounds to nearest). DS4_ERR_UNSUPPORTED for other dtypes,
 * DS4_ERR_INVALID when the range exceeds the tensor. */
ds4_status safetensors_read_f32(const safetensors_tensor *t, uint64_t first, uint64_t n, float *out, ds4_error *err);
/* Same for integer tensors (I64/I32/I16/I8/U8/BOOL) as int64. */
ds4_status safetensors_read_i64(const safetensors_tensor *t, uint64_t first, uint64_t n, int64_t *out,
                                ds4_error *err);

#ifdef __cplusplus
}
#endif

#endif

/*
 * gguf_writer.c - streaming GGUF v3 writer.
 *
 * Metadata and tensor infos are collected in memory (they are small); tensor
 * data streams straight to disk. Because every tensor's size is known when it
 * is declared, all offsets are fixed before the first data byte is written,
 * so a multi-gigabyte model never has to sit in memory. The file is written
 * as "<path>.tmp", fsync'd, and renamed into place by gguf_writer_finish.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/error.h"
#include "core/gguf.h"
#include "core/quant.h"

typedef struct writer_tensor {
    char *name;
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne[GGUF_MAX_DIMS];
    uint64_t n_bytes;
    uint64_t offset;
} writer_tensor;

struct gguf_writer {
    char *path;
    char *tmp_path;
    FILE *fp;
    uint32_t alignment;
    /* encoded metadata section */
    uint8_t *kv_buf;
    uint64_t kv_len, kv_cap, n_kv;
    char **keys;
    writer_tensor *tensors;
    uint64_t n_tensors, tensors_cap;
    uint64_t data_size; /* next free offset in the data section */
    bool header_written;
    uint64_t current;      /* tensor being written */
    uint64_t current_done; /* bytes of it written */
    bool sparse_end;       /* the last bytes may be a hole: extend the file at finish */
    ds4_error err;
};

const ds4_error *gguf_writer_error(const gguf_writer *w) { return &w->err; }

static ds4_status fail(gguf_writer *w, ds4_status st, const char *fmt, const char *arg) {
    if (w->err.status == DS4_OK) ds4_error_set(&w->err, st, fmt, arg);
    return w->err.status;
}

static ds4_status kv_reserve(gguf_writer *w, uint64_t extra) {
    if (w->kv_len + extra <= w->kv_cap) return DS4_OK;
    uint64_t cap = w->kv_cap ? w->kv_cap : 4096;
    while (cap < w->kv_len + extra) cap *= 2;
    uint8_t *p = realloc(w->kv_buf, cap);
    if (!p) return fail(w, DS4_ERR_NOMEM, "%s: out of memory for metadata", w->path);
    w->kv_buf = p;
    w->kv_cap = cap;
    return DS4_OK;
}

static ds4_status put(gguf_writer *w, const void *p, uint64_t n) {
    if (n == 0) return DS4_OK; /* p may be NULL for an empty array */
    ds4_status st = kv_reserve(w, n);
    if (st) return st;
    memcpy(w->kv_buf + w->kv_len, p, n);
    w->kv_len += n;
    return DS4_OK;
}

static void le32(uint8_t *b, uint32_t v) { for (int i = 0; i < 4; i++) b[i] = (uint8_t)(v >> (8 * i)); }
static void le64(uint8_t *b, uint64_t v) { for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i)); }

static ds4_status put_u32(gguf_writer *w, uint32_t v) { uint8_t b[4]; le32(b, v); return put(w, b, 4); }
static ds4_status put_u64(gguf_writer *w, uint64_t v) { uint8_t b[8]; le64(b, v); return put(w, b, 8); }

static ds4_status put_str(gguf_writer *w, const char *s, uint64_t n) {
    ds4_status st = put_u64(w, n);
    return st ? st : put(w, s, n);
}

static bool has_key(const gguf_writer *w, const char *key) {
    for (uint64_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->keys[i], key) == 0) return true;
    return false;
}

/* Start a key: reject duplicates and late additions, write key + type. */
static ds4_status begin_kv(gguf_writer *w, const char *key, gguf_value_type type) {
    if (w->err.status) return w->err.status;
    if (w->header_written) return fail(w, DS4_ERR_INVALID, "metadata key '%s' added after tensor data started", key);
    size_t n = strlen(key);
    if (n == 0 || n > 65535) return fail(w, DS4_ERR_INVALID, "metadata key '%s' has a bad length", key);
    if (has_key(w, key)) return fail(w, DS4_ERR_INVALID, "duplicate metadata key '%s'", key);
    char **keys = realloc(w->keys, (w->n_kv + 1) * sizeof *keys);
    if (!keys) return fail(w, DS4_ERR_NOMEM, "out of memory adding key '%s'", key);
    w->keys = keys;
    if (!(w->keys[w->n_kv] = strdup(key))) return fail(w, DS4_ERR_NOMEM, "out of memory adding key '%s'", key);
    w->n_kv++;
    ds4_status st = put_str(w, key, n);
    return st ? st : put_u32(w, type);
}

static ds4_status add_scalar(gguf_writer *w, const char *key, gguf_value_type type, const void *v) {
    if (strcmp(key, "general.alignment") == 0 &&
        (type != GGUF_TYPE_UINT32 || memcmp(v, &w->alignment, sizeof w->alignment) != 0))
        return fail(w, DS4_ERR_INVALID, "%s must be a u32 equal to the writer's alignment", key);
    ds4_status st = begin_kv(w, key, type);
    return st ? st : put(w, v, gguf_value_type_size(type)); /* host is little-endian (checked at open) */
}

ds4_status gguf_writer_add_u8(gguf_writer *w, const char *k, uint8_t v) { return add_scalar(w, k, GGUF_TYPE_UINT8, &v); }
ds4_status gguf_writer_add_i8(gguf_writer *w, const char *k, int8_t v) { return add_scalar(w, k, GGUF_TYPE_INT8, &v); }
ds4_status gguf_writer_add_u16(gguf_writer *w, const char *k, uint16_t v) { return add_scalar(w, k, GGUF_TYPE_UINT16, &v); }
ds4_status gguf_writer_add_i16(gguf_writer *w, const char *k, int16_t v) { return add_scalar(w, k, GGUF_TYPE_INT16, &v); }
ds4_status gguf_writer_add_u32(gguf_writer *w, const char *k, uint32_t v) { return add_scalar(w, k, GGUF_TYPE_UINT32, &v); }
ds4_status gguf_writer_add_i32(gguf_writer *w, const char *k, int32_t v) { return add_scalar(w, k, GGUF_TYPE_INT32, &v); }
ds4_status gguf_writer_add_u64(gguf_writer *w, const char *k, uint64_t v) { return add_scalar(w, k, GGUF_TYPE_UINT64, &v); }
ds4_status gguf_writer_add_i64(gguf_writer *w, const char *k, int64_t v) { return add_scalar(w, k, GGUF_TYPE_INT64, &v); }
ds4_status gguf_writer_add_f32(gguf_writer *w, const char *k, float v) { return add_scalar(w, k, GGUF_TYPE_FLOAT32, &v); }
ds4_status gguf_writer_add_f64(gguf_writer *w, const char *k, double v) { return add_scalar(w, k, GGUF_TYPE_FLOAT64, &v); }

ds4_status gguf_writer_add_bool(gguf_writer *w, const char *k, bool v) {
    uint8_t b = v ? 1 : 0;
    return add_scalar(w, k, GGUF_TYPE_BOOL, &b);
}

ds4_status gguf_writer_add_str(gguf_writer *w, const char *key, const char *v) {
    ds4_status st = begin_kv(w, key, GGUF_TYPE_STRING);
    return st ? st : put_str(w, v, strlen(v));
}

ds4_status gguf_writer_add_array(gguf_writer *w, const char *key, gguf_value_type elem_type, const void *data,
                                 uint64_t count) {
    size_t es = gguf_value_type_size(elem_type);
    if (!es) return fail(w, DS4_ERR_INVALID, "array '%s': element type must be a fixed-size scalar", key);
    if (count > UINT64_MAX / es) return fail(w, DS4_ERR_INVALID, "array '%s' is too large", key);
    ds4_status st = begin_kv(w, key, GGUF_TYPE_ARRAY);
    if (!st) st = put_u32(w, elem_type);
    if (!st) st = put_u64(w, count);
    if (!st) st = put(w, data, count * es);
    return st;
}

ds4_status gguf_writer_add_str_array(gguf_writer *w, const char *key, const char *const *strs, uint64_t count) {
    ds4_status st = begin_kv(w, key, GGUF_TYPE_ARRAY);
    if (!st) st = put_u32(w, GGUF_TYPE_STRING);
    if (!st) st = put_u64(w, count);
    for (uint64_t i = 0; i < count && !st; i++) st = put_str(w, strs[i], strlen(strs[i]));
    return st;
}

ds4_status gguf_writer_add_value(gguf_writer *w, const char *key, const gguf_value *v) {
    if (v->type != GGUF_TYPE_STRING && v->type != GGUF_TYPE_ARRAY) return add_scalar(w, key, v->type, v->data);
    ds4_status st = begin_kv(w, key, v->type);
    if (st) return st;
    /* A parsed value's bytes are its exact encoding after the type tag. */
    const uint8_t *start = v->data;
    if (v->type == GGUF_TYPE_STRING) start = v->data - 8;
    else if (v->type == GGUF_TYPE_ARRAY) start = v->data - 12;
    return put(w, start, v->bytes);
}

ds4_status gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                                  const uint64_t *ne) {
    if (w->err.status) return w->err.status;
    if (w->header_written) return fail(w, DS4_ERR_INVALID, "tensor '%s' declared after tensor data started", name);
    size_t nl = strlen(name);
    if (nl == 0 || nl > 65535) return fail(w, DS4_ERR_INVALID, "tensor name '%s' has a bad length", name);
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS) return fail(w, DS4_ERR_INVALID, "tensor '%s': n_dims outside 1..4", name);
    const ds4_type_traits *tr = ds4_type_traits_get(type);
    if (!tr) return fail(w, DS4_ERR_INVALID, "tensor '%s': unknown type", name);
    uint64_t n = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] > (uint64_t)INT64_MAX || (ne[d] && n > (uint64_t)INT64_MAX / ne[d]))
            return fail(w, DS4_ERR_INVALID, "tensor '%s': element count overflows", name);
        n *= ne[d];
    }
    if (ne[0] % (uint64_t)tr->block_elems)
        return fail(w, DS4_ERR_INVALID, "tensor '%s': row length is not a multiple of the type's block", name);
    for (uint64_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0) return fail(w, DS4_ERR_INVALID, "duplicate tensor name '%s'", name);
    if (w->n_tensors == w->tensors_cap) {
        uint64_t cap = w->tensors_cap ? 2 * w->tensors_cap : 64;
        writer_tensor *t = realloc(w->tensors, cap * sizeof *t);
        if (!t) return fail(w, DS4_ERR_NOMEM, "out of memory declaring tensor '%s'", name);
        w->tensors = t;
        w->tensors_cap = cap;
    }
    writer_tensor *t = &w->tensors[w->n_tensors];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name))) return fail(w, DS4_ERR_NOMEM, "out of memory declaring tensor '%s'", name);
    t->type = type;
    t->n_dims = n_dims;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = d < n_dims ? ne[d] : 1;
    t->n_bytes = n / (uint64_t)tr->block_elems * (uint64_t)tr->block_bytes;
    t->offset = w->data_size;
    uint64_t padded = t->n_bytes + (w->alignment - t->n_bytes % w->alignment) % w->alignment;
    w->data_size += padded;
    w->n_tensors++;
    return DS4_OK;
}

ds4_status gguf_writer_open(const char *path, uint32_t alignment, gguf_writer **out, ds4_error *err) {
    *out = NULL;
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "big-endian hosts are not supported");
    if (alignment == 0 || (alignment & (alignment - 1)))
        return ds4_error_set(err, DS4_ERR_INVALID, "alignment %u is not a power of two", alignment);
    gguf_writer *w = calloc(1, sizeof *w);
    if (!w) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    w->alignment = alignment;
    size_t n = strlen(path);
    w->path = strdup(path);
    w->tmp_path = malloc(n + 5);
    if (!w->path || !w->tmp_path) {
        gguf_writer_abort(w);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    }
    memcpy(w->tmp_path, path, n);
    memcpy(w->tmp_path + n, ".tmp", 5);
    w->fp = fopen(w->tmp_path, "wb");
    if (!w->fp) {
        ds4_status st = ds4_error_set(err, DS4_ERR_IO, "%s: %s", w->tmp_path, strerror(errno));
        gguf_writer_abort(w);
        return st;
    }
    *out = w;
    return DS4_OK;
}

static ds4_status io_fail(gguf_writer *w, const char *what) {
    if (w->err.status == DS4_OK)
        ds4_error_set(&w->err, DS4_ERR_IO, "%s: %s: %s", w->tmp_path, what, errno ? strerror(errno) : "short write");
    return w->err.status;
}

static ds4_status write_raw(gguf_writer *w, const void *p, uint64_t n) {
    errno = 0;
    if (n && fwrite(p, 1, n, w->fp) != n) return io_fail(w, "write failed");
    if (n) w->sparse_end = false;
    return DS4_OK;
}

static ds4_status write_zeros(gguf_writer *w, uint64_t n) {
    static const uint8_t zeros[256];
    while (n) {
        uint64_t k = n < sizeof zeros ? n : sizeof zeros;
        ds4_status st = write_raw(w, zeros, k);
        if (st) return st;
        n -= k;
    }
    return DS4_OK;
}

static ds4_status write_header(gguf_writer *w) {
    /* A non-default alignment must be recorded; callers may add the key
     * themselves (to keep a key order), otherwise it goes last. */
    if (w->alignment != GGUF_DEFAULT_ALIGNMENT && !has_key(w, "general.alignment")) {
        ds4_status st = gguf_writer_add_u32(w, "general.alignment", w->alignment);
        if (st) return st;
    }
    uint8_t b[24];
    le32(b, GGUF_MAGIC);
    le32(b + 4, 3);
    le64(b + 8, w->n_tensors);
    le64(b + 16, w->n_kv);
    ds4_status st = write_raw(w, b, 24);
    if (!st) st = write_raw(w, w->kv_buf, w->kv_len);
    uint64_t pos = 24 + w->kv_len;
    for (uint64_t i = 0; i < w->n_tensors && !st; i++) {
        const writer_tensor *t = &w->tensors[i];
        uint8_t buf[8 + 4 + 8 * GGUF_MAX_DIMS + 4 + 8];
        uint64_t nl = strlen(t->name), o = 0;
        le64(buf, nl);
        st = write_raw(w, buf, 8);
        if (!st) st = write_raw(w, t->name, nl);
        le32(buf + o, t->n_dims); o += 4;
        for (uint32_t d = 0; d < t->n_dims; d++) { le64(buf + o, t->ne[d]); o += 8; }
        le32(buf + o, t->type); o += 4;
        le64(buf + o, t->offset); o += 8;
        if (!st) st = write_raw(w, buf, o);
        pos += 8 + nl + o;
    }
    if (!st) st = write_zeros(w, (w->alignment - pos % w->alignment) % w->alignment);
    w->header_written = true;
    return st;
}

/* Move to the next tensor with bytes left to write, padding finished ones. */
static ds4_status advance(gguf_writer *w) {
    while (w->current < w->n_tensors && w->current_done == w->tensors[w->current].n_bytes) {
        const writer_tensor *t = &w->tensors[w->current];
        ds4_status st = write_zeros(w, (w->alignment - t->n_bytes % w->alignment) % w->alignment);
        if (st) return st;
        w->current++;
        w->current_done = 0;
    }
    return DS4_OK;
}

/* Append n bytes to the tensor data, crossing tensor boundaries (with their
 * padding) as needed. data NULL = zeros, skipped with a seek so the file
 * gets a hole. */
static ds4_status append(gguf_writer *w, const uint8_t *data, uint64_t n) {
    if (w->err.status) return w->err.status;
    ds4_status st = w->header_written ? DS4_OK : write_header(w);
    while (!st && n) {
        if ((st = advance(w))) break;
        if (w->current >= w->n_tensors)
            return fail(w, DS4_ERR_INVALID, "%s: more tensor bytes written than declared", w->path);
        uint64_t room = w->tensors[w->current].n_bytes - w->current_done;
        uint64_t k = n < room ? n : room;
        if (data) {
            st = write_raw(w, data, k);
            data += k;
        } else {
            errno = 0;
            if (k > (uint64_t)INT64_MAX || fseeko(w->fp, (off_t)k, SEEK_CUR) != 0) return io_fail(w, "seek failed");
            w->sparse_end = true;
        }
        n -= k;
        w->current_done += k;
    }
    return st;
}

ds4_status gguf_writer_write(gguf_writer *w, const void *data, uint64_t n) {
    if (!data && n) return fail(w, DS4_ERR_INVALID, "%s: NULL data", w->path);
    return append(w, data, n);
}

ds4_status gguf_writer_write_zeros(gguf_writer *w, uint64_t n) { return append(w, NULL, n); }

static void writer_free(gguf_writer *w) {
    for (uint64_t i = 0; i < w->n_kv; i++) free(w->keys[i]);
    for (uint64_t i = 0; i < w->n_tensors; i++) free(w->tensors[i].name);
    free(w->keys);
    free(w->tensors);
    free(w->kv_buf);
    free(w->path);
    free(w->tmp_path);
    free(w);
}

ds4_status gguf_writer_finish(gguf_writer *w, ds4_error *err) {
    ds4_status st = w->err.status;
    if (!st && !w->header_written) st = write_header(w);
    if (!st) st = advance(w);
    if (!st && w->current < w->n_tensors) {
        char msg[DS4_ERROR_MSG_MAX];
        snprintf(msg, sizeof msg, "tensor '%s' got %llu of its %llu bytes", w->tensors[w->current].name,
                 (unsigned long long)w->current_done, (unsigned long long)w->tensors[w->current].n_bytes);
        st = fail(w, DS4_ERR_INVALID, "%s", msg);
    }
    if (!st) {
        errno = 0;
        if (fflush(w->fp) != 0) st = io_fail(w, "flush failed");
        /* A trailing hole made by fseeko is only part of the file once its size covers it. */
        off_t end = st ? 0 : ftello(w->fp);
        if (!st && w->sparse_end && ftruncate(fileno(w->fp), end) != 0) st = io_fail(w, "extend failed");
        if (!st && fsync(fileno(w->fp)) != 0) st = io_fail(w, "fsync failed");
    }
    if (w->fp) {
        errno = 0;
        if (fclose(w->fp) != 0 && !st) st = io_fail(w, "close failed");
        w->fp = NULL;
    }
    if (!st && rename(w->tmp_path, w->path) != 0) st = io_fail(w, "rename failed");
    if (st) {
        ds4_error_set(err, st, "%s", w->err.message);
        unlink(w->tmp_path);
    }
    writer_free(w);
    return st;
}

void gguf_writer_abort(gguf_writer *w) {
    if (!w) return;
    if (w->fp) fclose(w->fp);
    if (w->tmp_path) unlink(w->tmp_path);
    writer_free(w);
}

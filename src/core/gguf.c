/*
 * gguf.c - GGUF reader: parse and validate a whole file up front.
 *
 * Every read goes through a cursor that knows how many bytes remain, and every
 * count read from the file is checked against the bytes that remain before it
 * sizes an allocation or a loop. After gguf_open succeeds, the accessors below
 * can trust the parsed structure without re-checking.
 */
#include "core/gguf.h"

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/mapfile.h"
#include "core/quant.h"

/* ------------------------------------------------------------ value types */

static const char *const VALUE_TYPE_NAMES[GGUF_TYPE_COUNT] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
};

const char *gguf_value_type_name(uint32_t t) {
    return t < GGUF_TYPE_COUNT ? VALUE_TYPE_NAMES[t] : "unknown";
}

size_t gguf_value_type_size(uint32_t t) {
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

bool gguf_str_eq(gguf_str s, const char *c) {
    size_t n = strlen(c);
    return s.len == n && memcmp(s.ptr, c, n) == 0;
}

/* ------------------------------------------------------------ cursor */

typedef struct cursor {
    const uint8_t *base;
    uint64_t size;
    uint64_t pos;
    ds4_error *err;
} cursor;

static uint64_t cursor_left(const cursor *c) { return c->size - c->pos; }

static ds4_status cursor_need(cursor *c, uint64_t n, const char *what) {
    if (n > cursor_left(c))
        return ds4_error_set(c->err, DS4_ERR_FORMAT,
                             "truncated at byte %llu: %s needs %llu bytes, %llu remain",
                             (unsigned long long)c->pos, what, (unsigned long long)n,
                             (unsigned long long)cursor_left(c));
    return DS4_OK;
}

static uint32_t load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t load_u64(const uint8_t *p) { return (uint64_t)load_u32(p) | (uint64_t)load_u32(p + 4) << 32; }

static ds4_status cursor_u32(cursor *c, uint32_t *out, const char *what) {
    ds4_status st = cursor_need(c, 4, what);
    if (st) return st;
    *out = load_u32(c->base + c->pos);
    c->pos += 4;
    return DS4_OK;
}

static ds4_status cursor_u64(cursor *c, uint64_t *out, const char *what) {
    ds4_status st = cursor_need(c, 8, what);
    if (st) return st;
    *out = load_u64(c->base + c->pos);
    c->pos += 8;
    return DS4_OK;
}

static ds4_status cursor_str(cursor *c, gguf_str *out, const char *what) {
    uint64_t at = c->pos, len;
    ds4_status st = cursor_u64(c, &len, what);
    if (st) return st;
    if (len > cursor_left(c))
        return ds4_error_set(c->err, DS4_ERR_FORMAT,
                             "byte %llu: %s length %llu runs past the end of the file (%llu bytes remain)",
                             (unsigned long long)at, what, (unsigned long long)len,
                             (unsigned long long)cursor_left(c));
    out->ptr = (const char *)(c->base + c->pos);
    out->len = len;
    c->pos += len;
    return DS4_OK;
}

/* Minimum encoded size of one element of a type (for bounding counts). */
static uint64_t min_encoded_size(uint32_t t) {
    if (t == GGUF_TYPE_STRING) return 8;
    if (t == GGUF_TYPE_ARRAY) return 12;
    return gguf_value_type_size(t);
}

static ds4_status parse_value(cursor *c, uint32_t type, int depth, gguf_value *out) {
    uint64_t start = c->pos;
    memset(out, 0, sizeof *out);
    out->type = (gguf_value_type)type;
    if (type >= GGUF_TYPE_COUNT)
        return ds4_error_set(c->err, DS4_ERR_FORMAT, "byte %llu: unknown metadata value type %u",
                             (unsigned long long)start, type);
    if (type == GGUF_TYPE_STRING) {
        ds4_status st = cursor_str(c, &out->str, "string value");
        if (st) return st;
        out->data = (const uint8_t *)out->str.ptr;
    } else if (type == GGUF_TYPE_ARRAY) {
        uint32_t et;
        uint64_t count;
        ds4_status st = cursor_u32(c, &et, "array element type");
        if (!st) st = cursor_u64(c, &count, "array length");
        if (st) return st;
        if (et >= GGUF_TYPE_COUNT)
            return ds4_error_set(c->err, DS4_ERR_FORMAT, "byte %llu: array has unknown element type %u",
                                 (unsigned long long)start, et);
        if (et == GGUF_TYPE_ARRAY && depth + 1 >= GGUF_MAX_ARRAY_DEPTH)
            return ds4_error_set(c->err, DS4_ERR_FORMAT, "byte %llu: arrays nested deeper than %d",
                                 (unsigned long long)start, GGUF_MAX_ARRAY_DEPTH);
        uint64_t min = min_encoded_size(et);
        if (count > cursor_left(c) / min)
            return ds4_error_set(c->err, DS4_ERR_FORMAT,
                                 "byte %llu: array of %llu %s elements cannot fit in the %llu bytes that remain",
                                 (unsigned long long)start, (unsigned long long)count, gguf_value_type_name(et),
                                 (unsigned long long)cursor_left(c));
        out->elem_type = (gguf_value_type)et;
        out->count = count;
        out->data = c->base + c->pos;
        if (et != GGUF_TYPE_STRING && et != GGUF_TYPE_ARRAY) {
            c->pos += count * min; /* bounded above */
        } else {
            for (uint64_t i = 0; i < count; i++) {
                gguf_value elem;
                if (et == GGUF_TYPE_STRING) {
                    gguf_str s;
                    st = cursor_str(c, &s, "string array element");
                } else {
                    st = parse_value(c, GGUF_TYPE_ARRAY, depth + 1, &elem);
                }
                if (st) return st;
            }
        }
    } else {
        uint64_t n = gguf_value_type_size(type);
        ds4_status st = cursor_need(c, n, gguf_value_type_name(type));
        if (st) return st;
        out->data = c->base + c->pos;
        c->pos += n;
    }
    out->bytes = c->pos - start;
    return DS4_OK;
}

/* ------------------------------------------------------------ name index */

static uint64_t hash_bytes(const char *p, uint64_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (uint64_t i = 0; i < n; i++) h = (h ^ (uint8_t)p[i]) * 0x100000001b3ULL;
    return h;
}

static uint64_t pow2_at_least(uint64_t n) {
    uint64_t cap = 16;
    while (cap < n) cap <<= 1;
    return cap;
}

/* Insert names[i] for i < n into a table of indices+1; returns the index of a
 * duplicate or UINT64_MAX when all names are distinct. */
static uint64_t index_names(uint64_t *table, uint64_t cap, uint64_t n, const gguf_str *(*get)(const void *, uint64_t),
                            const void *ctx) {
    for (uint64_t i = 0; i < n; i++) {
        const gguf_str *s = get(ctx, i);
        uint64_t slot = hash_bytes(s->ptr, s->len) & (cap - 1);
        while (table[slot]) {
            const gguf_str *o = get(ctx, table[slot] - 1);
            if (o->len == s->len && memcmp(o->ptr, s->ptr, s->len) == 0) return i;
            slot = (slot + 1) & (cap - 1);
        }
        table[slot] = i + 1;
    }
    return UINT64_MAX;
}

static const gguf_str *kv_key(const void *ctx, uint64_t i) { return &((const gguf_kv *)ctx)[i].key; }
static const gguf_str *tensor_name(const void *ctx, uint64_t i) { return &((const gguf_tensor *)ctx)[i].name; }

/* Print at most 64 bytes of a name, escaping non-printable bytes. */
static const char *printable(gguf_str s, char *buf, size_t cap) {
    size_t o = 0;
    for (uint64_t i = 0; i < s.len && o + 5 < cap; i++) {
        unsigned char ch = (unsigned char)s.ptr[i];
        if (i == 64) { memcpy(buf + o, "...", 3); o += 3; break; }
        if (ch >= 0x20 && ch < 0x7f && ch != '\\') buf[o++] = (char)ch;
        else o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", ch);
    }
    buf[o] = '\0';
    return buf;
}

/* ------------------------------------------------------------ parsing */

typedef struct offset_index {
    uint64_t offset;
    uint64_t index;
} offset_index;

static int compare_by_offset(const void *a, const void *b) {
    uint64_t x = ((const offset_index *)a)->offset, y = ((const offset_index *)b)->offset;
    return x < y ? -1 : x > y;
}

static ds4_status parse_tensor_info(cursor *c, const gguf_file *f, gguf_tensor *t) {
    uint64_t start = c->pos;
    char nb[300];
    ds4_status st = cursor_str(c, &t->name, "tensor name");
    if (st) return st;
    if (t->name.len == 0 || t->name.len > 65535)
        return ds4_error_set(c->err, DS4_ERR_FORMAT, "byte %llu: tensor name length %llu outside 1..65535",
                             (unsigned long long)start, (unsigned long long)t->name.len);
    printable(t->name, nb, sizeof nb);
    if ((st = cursor_u32(c, &t->n_dims, "tensor n_dims"))) return st;
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return ds4_error_set(c->err, DS4_ERR_FORMAT, "byte %llu: tensor '%s' has n_dims %u, outside 1..%d",
                             (unsigned long long)start, nb, t->n_dims, GGUF_MAX_DIMS);
    uint64_t n = 1;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        if ((st = cursor_u64(c, &t->ne[d], "tensor dimension"))) return st;
        if (t->ne[d] > (uint64_t)INT64_MAX || (t->ne[d] && n > (uint64_t)INT64_MAX / t->ne[d]))
            return ds4_error_set(c->err, DS4_ERR_FORMAT,
                                 "byte %llu: tensor '%s' dimension %u = %llu overflows the element count",
                                 (unsigned long long)start, nb, d, (unsigned long long)t->ne[d]);
        n *= t->ne[d];
    }
    t->n_elements = n;
    if ((st = cursor_u32(c, &t->type, "tensor type"))) return st;
    const ds4_type_traits *tr = ds4_type_traits_get(t->type);
    if (!tr)
        return ds4_error_set(c->err, DS4_ERR_FORMAT, "byte %llu: tensor '%s' has unknown type %u",
                             (unsigned long long)start, nb, t->type);
    if (t->ne[0] % (uint64_t)tr->block_elems != 0)
        return ds4_error_set(c->err, DS4_ERR_FORMAT,
                             "byte %llu: tensor '%s' row of %llu elements is not a multiple of the %s block (%d)",
                             (unsigned long long)start, nb, (unsigned long long)t->ne[0], tr->name,
                             tr->block_elems);
    /* n_elements < 2^63 and block_bytes <= 292, so blocks * bytes fits in 128 bits; check 64. */
    uint64_t blocks = n / (uint64_t)tr->block_elems;
    if (blocks > UINT64_MAX / (uint64_t)tr->block_bytes)
        return ds4_error_set(c->err, DS4_ERR_FORMAT, "byte %llu: tensor '%s' byte size overflows",
                             (unsigned long long)start, nb);
    t->n_bytes = blocks * (uint64_t)tr->block_bytes;
    if ((st = cursor_u64(c, &t->offset, "tensor data offset"))) return st;
    if (t->offset % f->alignment != 0)
        return ds4_error_set(c->err, DS4_ERR_FORMAT,
                             "byte %llu: tensor '%s' data offset %llu is not a multiple of the alignment %u",
                             (unsigned long long)start, nb, (unsigned long long)t->offset, f->alignment);
    return DS4_OK;
}

static ds4_status read_alignment(gguf_file *f, ds4_error *err) {
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const gguf_kv *kv = gguf_find_kv(f, "general.alignment");
    if (!kv) return DS4_OK;
    if (kv->value.type != GGUF_TYPE_UINT32)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte %llu: general.alignment must be u32, found %s",
                             (unsigned long long)kv->file_offset, gguf_value_type_name(kv->value.type));
    uint32_t a = load_u32(kv->value.data);
    if (a == 0 || (a & (a - 1)) != 0)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte %llu: general.alignment %u is not a power of two",
                             (unsigned long long)kv->file_offset, a);
    f->alignment = a;
    return DS4_OK;
}

static ds4_status parse(gguf_file *f, ds4_error *err) {
    cursor c = { f->map, f->size, 0, err };
    uint32_t magic;
    uint64_t n_tensors, n_kv;
    ds4_status st;
    if (f->size < 24)
        return ds4_error_set(err, DS4_ERR_FORMAT, "file is %llu bytes, smaller than a GGUF header (24 bytes)",
                             (unsigned long long)f->size);
    cursor_u32(&c, &magic, "magic");
    if (magic != GGUF_MAGIC)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte 0: bad magic 0x%08x (not a GGUF file)", magic);
    cursor_u32(&c, &f->version, "version");
    if (f->version == 1)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte 4: GGUF version 1 is not supported (only 2 and 3)");
    if (f->version != 2 && f->version != 3)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte 4: unsupported GGUF version %u%s", f->version,
                             (f->version & 0xffff) == 0 ? " (a big-endian file?)" : "");
    cursor_u64(&c, &n_tensors, "tensor count");
    cursor_u64(&c, &n_kv, "metadata count");

    /* A key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes. */
    if (n_kv > cursor_left(&c) / 13)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte 16: metadata count %llu cannot fit in a %llu-byte file",
                             (unsigned long long)n_kv, (unsigned long long)f->size);
    f->kv = calloc(n_kv ? n_kv : 1, sizeof *f->kv);
    if (!f->kv) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for %llu metadata entries",
                                     (unsigned long long)n_kv);
    for (uint64_t i = 0; i < n_kv; i++) {
        gguf_kv *kv = &f->kv[i];
        uint32_t type;
        kv->file_offset = c.pos;
        if ((st = cursor_str(&c, &kv->key, "metadata key"))) return st;
        if (kv->key.len == 0 || kv->key.len > 65535)
            return ds4_error_set(err, DS4_ERR_FORMAT, "byte %llu: metadata key length %llu outside 1..65535",
                                 (unsigned long long)kv->file_offset, (unsigned long long)kv->key.len);
        if ((st = cursor_u32(&c, &type, "metadata value type"))) return st;
        if ((st = parse_value(&c, type, 0, &kv->value))) {
            char kb[300];
            return ds4_error_prefix(err, "metadata key '%s'", printable(kv->key, kb, sizeof kb));
        }
        f->n_kv = i + 1;
    }
    {
        uint64_t cap = pow2_at_least(2 * n_kv);
        uint64_t *table = calloc(cap, sizeof *table);
        if (!table) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory indexing metadata");
        uint64_t dup = index_names(table, cap, n_kv, kv_key, f->kv);
        free(table);
        if (dup != UINT64_MAX) {
            char kb[300];
            return ds4_error_set(err, DS4_ERR_FORMAT, "byte %llu: duplicate metadata key '%s'",
                                 (unsigned long long)f->kv[dup].file_offset, printable(f->kv[dup].key, kb, sizeof kb));
        }
    }
    if ((st = read_alignment(f, err))) return st;

    /* A tensor info takes at least 8 + 1 (name) + 4 + 8 + 4 + 8 bytes. */
    if (n_tensors > cursor_left(&c) / 33)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte 8: tensor count %llu cannot fit in the %llu bytes left",
                             (unsigned long long)n_tensors, (unsigned long long)cursor_left(&c));
    f->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *f->tensors);
    if (!f->tensors) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for %llu tensors",
                                          (unsigned long long)n_tensors);
    for (uint64_t i = 0; i < n_tensors; i++) {
        if ((st = parse_tensor_info(&c, f, &f->tensors[i]))) return st;
        f->n_tensors = i + 1;
    }
    /* Data section: tensor infos end, rounded up to the alignment. */
    uint64_t data = c.pos + (f->alignment - c.pos % f->alignment) % f->alignment;
    f->data_offset = data;
    uint64_t data_size = data <= f->size ? f->size - data : 0;
    for (uint64_t i = 0; i < n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        char nb[300];
        if (t->n_bytes == 0) { t->data = f->map + (data <= f->size ? data : f->size); continue; }
        if (data > f->size || t->offset > data_size || t->n_bytes > data_size - t->offset)
            return ds4_error_set(err, DS4_ERR_FORMAT,
                                 "tensor '%s': data at byte %llu + %llu bytes runs past the end of the file (%llu bytes)",
                                 printable(t->name, nb, sizeof nb), (unsigned long long)(data + t->offset),
                                 (unsigned long long)t->n_bytes, (unsigned long long)f->size);
        t->file_offset = data + t->offset;
        t->data = f->map + t->file_offset;
    }
    /* Names must be distinct, and tensor data must not overlap. */
    uint64_t cap = pow2_at_least(2 * n_tensors);
    f->name_hash = calloc(cap, sizeof *f->name_hash);
    if (!f->name_hash) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory indexing tensors");
    f->name_hash_cap = cap;
    uint64_t dup = index_names(f->name_hash, cap, n_tensors, tensor_name, f->tensors);
    if (dup != UINT64_MAX) {
        char nb[300];
        return ds4_error_set(err, DS4_ERR_FORMAT, "duplicate tensor name '%s' (tensor %llu)",
                             printable(f->tensors[dup].name, nb, sizeof nb), (unsigned long long)dup);
    }
    if (n_tensors > 1) {
        offset_index *order = malloc(n_tensors * sizeof *order);
        if (!order) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory checking tensor overlaps");
        for (uint64_t i = 0; i < n_tensors; i++) order[i] = (offset_index){ f->tensors[i].offset, i };
        qsort(order, n_tensors, sizeof *order, compare_by_offset);
        uint64_t prev = UINT64_MAX;
        for (uint64_t k = 0; k < n_tensors; k++) {
            const gguf_tensor *t = &f->tensors[order[k].index];
            if (t->n_bytes == 0) continue;
            if (prev != UINT64_MAX) {
                const gguf_tensor *p = &f->tensors[prev];
                if (p->offset + p->n_bytes > t->offset) {
                    char a[300], b[300];
                    st = ds4_error_set(err, DS4_ERR_FORMAT,
                                       "tensors '%s' (bytes %llu..%llu) and '%s' (from byte %llu) overlap",
                                       printable(p->name, a, sizeof a), (unsigned long long)p->file_offset,
                                       (unsigned long long)(p->file_offset + p->n_bytes),
                                       printable(t->name, b, sizeof b), (unsigned long long)t->file_offset);
                    free(order);
                    return st;
                }
            }
            prev = order[k].index;
        }
        free(order);
    }
    return DS4_OK;
}

/* ------------------------------------------------------------ open/close */

ds4_status gguf_open_memory(const void *data, size_t size, gguf_file **out, ds4_error *err) {
    *out = NULL;
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    f->map = data;
    f->size = size;
    ds4_status st = parse(f, err);
    if (st) {
        gguf_close(f);
        return st;
    }
    *out = f;
    return DS4_OK;
}

ds4_status gguf_open(const char *path, gguf_file **out, ds4_error *err) {
    *out = NULL;
    const uint8_t *map;
    uint64_t size;
    ds4_status st = ds4_map_file(path, 24, "a GGUF header (24 bytes)", &map, &size, err);
    if (st) return st;
    gguf_file *f = NULL;
    st = gguf_open_memory(map, (size_t)size, &f, err);
    if (st) {
        ds4_unmap_file(map, size);
        ds4_error_prefix(err, "%s", path);
        return st;
    }
    f->owns_map = true;
    f->path = strdup(path);
    if (!f->path) {
        gguf_close(f);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    }
    *out = f;
    return DS4_OK;
}

void gguf_close(gguf_file *f) {
    if (!f) return;
    if (f->owns_map) ds4_unmap_file(f->map, f->size);
    free(f->kv);
    free(f->tensors);
    free(f->name_hash);
    free(f->path);
    free(f);
}

/* ------------------------------------------------------------ lookups */

const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key) {
    for (uint64_t i = 0; i < f->n_kv; i++)
        if (gguf_str_eq(f->kv[i].key, key)) return &f->kv[i];
    return NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    if (!f->name_hash_cap) return NULL;
    size_t n = strlen(name);
    const uint64_t *table = f->name_hash;
    uint64_t slot = hash_bytes(name, n) & (f->name_hash_cap - 1);
    while (table[slot]) {
        const gguf_tensor *t = &f->tensors[table[slot] - 1];
        if (t->name.len == n && memcmp(t->name.ptr, name, n) == 0) return t;
        slot = (slot + 1) & (f->name_hash_cap - 1);
    }
    return NULL;
}

static ds4_status find_typed(const gguf_file *f, const char *key, gguf_value_type want, const gguf_kv **kv,
                             ds4_error *err) {
    *kv = gguf_find_kv(f, key);
    if (!*kv) return ds4_error_set(err, DS4_ERR_NOT_FOUND, "metadata key '%s' is missing", key);
    if ((*kv)->value.type != want)
        return ds4_error_set(err, DS4_ERR_FORMAT, "metadata key '%s' must be %s, found %s", key,
                             gguf_value_type_name(want), gguf_value_type_name((*kv)->value.type));
    return DS4_OK;
}

ds4_status gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, ds4_error *err) {
    const gguf_kv *kv;
    ds4_status st = find_typed(f, key, GGUF_TYPE_UINT32, &kv, err);
    if (!st) *out = load_u32(kv->value.data);
    return st;
}

ds4_status gguf_get_u64(const gguf_file *f, const char *key, uint64_t *out, ds4_error *err) {
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (kv && kv->value.type == GGUF_TYPE_UINT32) {
        *out = load_u32(kv->value.data);
        return DS4_OK;
    }
    ds4_status st = find_typed(f, key, GGUF_TYPE_UINT64, &kv, err);
    if (!st) *out = load_u64(kv->value.data);
    return st;
}

ds4_status gguf_get_f32(const gguf_file *f, const char *key, float *out, ds4_error *err) {
    const gguf_kv *kv = gguf_find_kv(f, key);
    double d;
    if (!kv) return ds4_error_set(err, DS4_ERR_NOT_FOUND, "metadata key '%s' is missing", key);
    if (kv->value.type == GGUF_TYPE_BOOL || !gguf_value_as_double(&kv->value, &d))
        return ds4_error_set(err, DS4_ERR_FORMAT, "metadata key '%s' must be a number, found %s", key,
                             gguf_value_type_name(kv->value.type));
    *out = (float)d;
    return DS4_OK;
}

ds4_status gguf_get_bool(const gguf_file *f, const char *key, bool *out, ds4_error *err) {
    const gguf_kv *kv;
    ds4_status st = find_typed(f, key, GGUF_TYPE_BOOL, &kv, err);
    if (!st) *out = kv->value.data[0] != 0;
    return st;
}

ds4_status gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, ds4_error *err) {
    const gguf_kv *kv;
    ds4_status st = find_typed(f, key, GGUF_TYPE_STRING, &kv, err);
    if (!st) *out = kv->value.str;
    return st;
}

bool gguf_value_as_double(const gguf_value *v, double *out) {
    const uint8_t *p = v->data;
    switch (v->type) {
    case GGUF_TYPE_UINT8: *out = p[0]; return true;
    case GGUF_TYPE_INT8: *out = (int8_t)p[0]; return true;
    case GGUF_TYPE_BOOL: *out = p[0] != 0; return true;
    case GGUF_TYPE_UINT16: *out = (uint16_t)(p[0] | p[1] << 8); return true;
    case GGUF_TYPE_INT16: *out = (int16_t)(uint16_t)(p[0] | p[1] << 8); return true;
    case GGUF_TYPE_UINT32: *out = load_u32(p); return true;
    case GGUF_TYPE_INT32: *out = (int32_t)load_u32(p); return true;
    case GGUF_TYPE_UINT64: *out = (double)load_u64(p); return true;
    case GGUF_TYPE_INT64: *out = (double)(int64_t)load_u64(p); return true;
    case GGUF_TYPE_FLOAT32: {
        uint32_t u = load_u32(p);
        float fv;
        memcpy(&fv, &u, 4);
        *out = fv;
        return true;
    }
    case GGUF_TYPE_FLOAT64: {
        uint64_t u = load_u64(p);
        memcpy(out, &u, 8);
        return true;
    }
    default: return false;
    }
}

bool gguf_value_as_i64(const gguf_value *v, int64_t *out) {
    const uint8_t *p = v->data;
    switch (v->type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_BOOL: *out = p[0]; return true;
    case GGUF_TYPE_INT8: *out = (int8_t)p[0]; return true;
    case GGUF_TYPE_UINT16: *out = (uint16_t)(p[0] | p[1] << 8); return true;
    case GGUF_TYPE_INT16: *out = (int16_t)(uint16_t)(p[0] | p[1] << 8); return true;
    case GGUF_TYPE_UINT32: *out = load_u32(p); return true;
    case GGUF_TYPE_INT32: *out = (int32_t)load_u32(p); return true;
    case GGUF_TYPE_INT64: *out = (int64_t)load_u64(p); return true;
    case GGUF_TYPE_UINT64: {
        uint64_t u = load_u64(p);
        if (u > (uint64_t)INT64_MAX) return false;
        *out = (int64_t)u;
        return true;
    }
    default: return false;
    }
}

/* ------------------------------------------------------------ arrays */

void gguf_array_iter_init(gguf_array_iter *it, const gguf_value *array) {
    it->array = array;
    it->index = 0;
    it->pos = array->data;
}

bool gguf_array_iter_next(gguf_array_iter *it, gguf_value *elem) {
    const gguf_value *a = it->array;
    if (a->type != GGUF_TYPE_ARRAY || it->index >= a->count) return false;
    /* The array was validated at open, so a cursor over its own bytes cannot
     * fail. `bytes` counts the 12-byte header (element type + count) too. */
    const uint8_t *end = a->data + (a->bytes - 12);
    cursor c = { it->pos, (uint64_t)(end - it->pos), 0, NULL };
    if (parse_value(&c, a->elem_type, 0, elem) != DS4_OK) return false;
    it->pos += c.pos;
    it->index++;
    return true;
}

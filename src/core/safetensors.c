/*
 * safetensors.c - safetensors reader: parse and validate a whole file up front.
 *
 * The 8-byte header length is checked against a fixed cap and the file size
 * before anything is allocated; the JSON header is pre-scanned (nesting of
 * strings, NUL bytes, a bound on the number of JSON values so the parse tree
 * stays proportional to the header) and then parsed with cJSON. Every tensor
 * entry is checked: known dtype, at most SAFETENSORS_MAX_DIMS non-negative
 * integer dimensions without overflow, offsets inside the data section, byte
 * size equal to elements x dtype size, and the entries must tile the data
 * section exactly (no overlap, no hole, nothing trailing), as the format asks.
 */
#include "core/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/error.h"
#include "core/mapfile.h"
#include "core/quant.h"

/* ------------------------------------------------------------ dtypes */

static const struct {
    const char *name;
    size_t size;
} DTYPES[ST_DTYPE_COUNT] = {
    [ST_F64] = { "F64", 8 },         [ST_F32] = { "F32", 4 },         [ST_F16] = { "F16", 2 },
    [ST_BF16] = { "BF16", 2 },       [ST_I64] = { "I64", 8 },         [ST_I32] = { "I32", 4 },
    [ST_I16] = { "I16", 2 },         [ST_I8] = { "I8", 1 },           [ST_U8] = { "U8", 1 },
    [ST_BOOL] = { "BOOL", 1 },       [ST_U64] = { "U64", 8 },         [ST_U32] = { "U32", 4 },
    [ST_U16] = { "U16", 2 },         [ST_F8_E4M3] = { "F8_E4M3", 1 }, [ST_F8_E5M2] = { "F8_E5M2", 1 },
    [ST_F8_E8M0] = { "F8_E8M0", 1 },
};

const char *safetensors_dtype_name(safetensors_dtype t) {
    return (unsigned)t < ST_DTYPE_COUNT ? DTYPES[t].name : "unknown";
}

size_t safetensors_dtype_size(safetensors_dtype t) { return (unsigned)t < ST_DTYPE_COUNT ? DTYPES[t].size : 0; }

bool safetensors_dtype_is_float(safetensors_dtype t) {
    return t == ST_F64 || t == ST_F32 || t == ST_F16 || t == ST_BF16;
}

bool safetensors_dtype_is_int(safetensors_dtype t) {
    return t == ST_I64 || t == ST_I32 || t == ST_I16 || t == ST_I8 || t == ST_U8 || t == ST_BOOL;
}

static int dtype_from_name(const char *s) {
    for (int i = 0; i < ST_DTYPE_COUNT; i++)
        if (!strcmp(s, DTYPES[i].name)) return i;
    return -1;
}

/* ------------------------------------------------------------ helpers */

static uint64_t load_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static uint64_t hash_str(const char *p) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ULL;
    return h;
}

static uint64_t pow2_at_least(uint64_t n) {
    uint64_t cap = 16;
    while (cap < n) cap <<= 1;
    return cap;
}

/* At most 64 bytes of a name for messages, non-printable bytes escaped. */
static const char *printable(const char *s, char *buf, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; s[i] && o + 5 < cap; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (i == 64) { memcpy(buf + o, "...", 3); o += 3; break; }
        if (ch >= 0x20 && ch < 0x7f && ch != '\\') buf[o++] = (char)ch;
        else o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", ch);
    }
    buf[o] = '\0';
    return buf;
}

/* Insert `name` -> index into an open-addressing table; false if present. */
static bool hash_insert(uint64_t *table, uint64_t cap, const char *name, uint64_t index,
                        const char *(*name_of)(const void *, uint64_t), const void *ctx, uint64_t *dup) {
    uint64_t slot = hash_str(name) & (cap - 1);
    while (table[slot]) {
        if (!strcmp(name_of(ctx, table[slot] - 1), name)) {
            if (dup) *dup = table[slot] - 1;
            return false;
        }
        slot = (slot + 1) & (cap - 1);
    }
    table[slot] = index + 1;
    return true;
}

static uint64_t hash_lookup(const uint64_t *table, uint64_t cap, const char *name,
                            const char *(*name_of)(const void *, uint64_t), const void *ctx) {
    if (!cap) return UINT64_MAX;
    uint64_t slot = hash_str(name) & (cap - 1);
    while (table[slot]) {
        if (!strcmp(name_of(ctx, table[slot] - 1), name)) return table[slot] - 1;
        slot = (slot + 1) & (cap - 1);
    }
    return UINT64_MAX;
}

/* ------------------------------------------------------------ JSON */

/*
 * Pre-scan a JSON text before cJSON sees it: refuse NUL bytes and \u0000
 * escapes (names are C strings), and count the values it can hold (each is
 * preceded by '[', ',' or ':' outside strings, plus the top level). cJSON
 * allocates a node per value, so a bound on the count bounds the memory the
 * parse can take: at most one value per 4 header bytes (+1024), which every
 * real header satisfies by a wide margin (a tensor entry is ~9 values in
 * ~50+ bytes) while "[0,0,0,..." is refused.
 */
static ds4_status json_prescan(const char *s, uint64_t n, uint64_t base, const char *what, ds4_error *err) {
    uint64_t values = 1;
    bool in_str = false;
    for (uint64_t i = 0; i < n; i++) {
        char ch = s[i];
        if (ch == '\0')
            return ds4_error_set(err, DS4_ERR_FORMAT, "byte %llu: NUL byte in the %s", (unsigned long long)(base + i),
                                 what);
        if (in_str) {
            if (ch == '\\') {
                if (i + 5 < n && !memcmp(s + i + 1, "u0000", 5))
                    return ds4_error_set(err, DS4_ERR_FORMAT, "byte %llu: \\u0000 escape in the %s",
                                         (unsigned long long)(base + i), what);
                i++;
            } else if (ch == '"') {
                in_str = false;
            }
        } else if (ch == '"') {
            in_str = true;
        } else if (ch == '[' || ch == ',' || ch == ':') {
            values++;
        }
    }
    if (values > n / 4 + 1024)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte %llu: the %s holds %llu JSON values in %llu bytes, more "
                             "than any real header (refused to bound memory)", (unsigned long long)base, what,
                             (unsigned long long)values, (unsigned long long)n);
    return DS4_OK;
}

/* Parse JSON text; trailing whitespace allowed. */
static ds4_status json_parse(const char *s, uint64_t n, uint64_t base, const char *what, cJSON **out,
                             ds4_error *err) {
    *out = NULL;
    ds4_status st = json_prescan(s, n, base, what, err);
    if (st) return st;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(s, (size_t)n, &end, 0);
    if (!root) {
        uint64_t at = end && end >= s && end <= s + n ? (uint64_t)(end - s) : 0;
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte %llu: invalid JSON in the %s", (unsigned long long)(base + at),
                             what);
    }
    for (const char *p = end; p < s + n; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            return ds4_error_set(err, DS4_ERR_FORMAT, "byte %llu: unexpected data after the JSON object in the %s",
                                 (unsigned long long)(base + (uint64_t)(p - s)), what);
        }
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte %llu: the %s is not a JSON object", (unsigned long long)base,
                             what);
    }
    *out = root;
    return DS4_OK;
}

/* A JSON number that is a non-negative integer that a double holds exactly. */
static bool json_u64(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 0) || d > 9007199254740992.0 || floor(d) != d) return false;
    *out = (uint64_t)d;
    return true;
}

/* ------------------------------------------------------------ parsing */

static const char *tensor_name_of(const void *ctx, uint64_t i) { return ((const safetensors_tensor *)ctx)[i].name; }

static int compare_by_offset(const void *a, const void *b) {
    const safetensors_tensor *x = a, *y = b;
    if (x->file_offset != y->file_offset) return x->file_offset < y->file_offset ? -1 : 1;
    if (x->n_bytes != y->n_bytes) return x->n_bytes < y->n_bytes ? -1 : 1;
    return strcmp(x->name, y->name);
}

static ds4_status parse_entry(safetensors_file *f, const cJSON *e, safetensors_tensor *t, ds4_error *err) {
    char nb[300];
    const char *name = printable(t->name, nb, sizeof nb);
    const uint64_t data_size = f->size - f->data_offset;
    if (!cJSON_IsObject(e))
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': entry is not a JSON object", name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt))
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': \"dtype\" is %s", name, dt ? "not a string" : "missing");
    int dtype = dtype_from_name(dt->valuestring);
    if (dtype < 0) {
        char db[300];
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': unknown dtype '%s'", name,
                             printable(dt->valuestring, db, sizeof db));
    }
    t->dtype = (safetensors_dtype)dtype;
    if (!cJSON_IsArray(sh))
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': \"shape\" is %s", name, sh ? "not an array" : "missing");
    int nd = cJSON_GetArraySize(sh);
    if (nd > SAFETENSORS_MAX_DIMS)
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': %d dimensions, more than %d", name, nd,
                             SAFETENSORS_MAX_DIMS);
    t->n_dims = (uint32_t)nd;
    uint64_t n = 1;
    int d = 0;
    for (const cJSON *v = sh->child; v; v = v->next, d++) {
        uint64_t x;
        if (!json_u64(v, &x))
            return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': shape[%d] is not a non-negative integer", name, d);
        if (x && n > UINT64_MAX / x)
            return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': shape overflows the element count", name);
        t->shape[d] = x;
        n *= x;
    }
    t->n_elements = n;
    size_t es = DTYPES[dtype].size;
    if (n > UINT64_MAX / es)
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': byte size overflows", name);
    t->n_bytes = n * es;
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2)
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': \"data_offsets\" is %s", name,
                             off ? "not an array of two integers" : "missing");
    uint64_t begin, end;
    if (!json_u64(off->child, &begin) || !json_u64(off->child->next, &end))
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': data_offsets are not non-negative integers", name);
    if (begin > end)
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': data_offsets [%llu, %llu] end before they begin", name,
                             (unsigned long long)begin, (unsigned long long)end);
    if (end > data_size)
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': data_offsets [%llu, %llu] (bytes %llu..%llu) run past "
                             "the end of the file (%llu bytes)", name, (unsigned long long)begin,
                             (unsigned long long)end, (unsigned long long)(f->data_offset + begin),
                             (unsigned long long)(f->data_offset + end), (unsigned long long)f->size);
    if (end - begin != t->n_bytes)
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s': %s shape of %llu elements needs %llu bytes, "
                             "data_offsets [%llu, %llu] hold %llu", name, DTYPES[dtype].name,
                             (unsigned long long)n, (unsigned long long)t->n_bytes, (unsigned long long)begin,
                             (unsigned long long)end, (unsigned long long)(end - begin));
    t->file_offset = f->data_offset + begin;
    t->data = f->map + t->file_offset;
    t->file_path = f->path;
    return DS4_OK;
}

static ds4_status parse_tensors(safetensors_file *f, cJSON *root, ds4_error *err) {
    uint64_t count = 0;
    for (const cJSON *m = root->child; m; m = m->next)
        if (strcmp(m->string, "__metadata__") != 0) count++;
    f->tensors = calloc(count ? count : 1, sizeof *f->tensors);
    if (!f->tensors) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for %llu tensors", (unsigned long long)count);
    for (const cJSON *m = root->child; m; m = m->next) {
        if (!strcmp(m->string, "__metadata__")) {
            if (!cJSON_IsObject(m))
                return ds4_error_set(err, DS4_ERR_FORMAT, "\"__metadata__\" is not a JSON object");
            for (const cJSON *v = m->child; v; v = v->next)
                if (!cJSON_IsString(v)) {
                    char kb[300];
                    return ds4_error_set(err, DS4_ERR_FORMAT, "\"__metadata__\" value '%s' is not a string",
                                         printable(v->string, kb, sizeof kb));
                }
            continue;
        }
        size_t len = strlen(m->string);
        if (len == 0 || len > 65535)
            return ds4_error_set(err, DS4_ERR_FORMAT, "tensor %llu: name length %zu outside 1..65535",
                                 (unsigned long long)f->n_tensors, len);
        safetensors_tensor *t = &f->tensors[f->n_tensors];
        t->name = strdup(m->string);
        if (!t->name) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
        f->n_tensors++;
        ds4_status st = parse_entry(f, m, t, err);
        if (st) return st;
    }
    /* The entries must tile the data section exactly. */
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, compare_by_offset);
    uint64_t pos = f->data_offset;
    const safetensors_tensor *prev = NULL;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const safetensors_tensor *t = &f->tensors[i];
        char a[300], b[300];
        if (t->file_offset < pos)
            return ds4_error_set(err, DS4_ERR_FORMAT, "tensors '%s' (bytes %llu..%llu) and '%s' (bytes %llu..%llu) "
                                 "overlap", printable(prev->name, a, sizeof a), (unsigned long long)prev->file_offset,
                                 (unsigned long long)(prev->file_offset + prev->n_bytes),
                                 printable(t->name, b, sizeof b), (unsigned long long)t->file_offset,
                                 (unsigned long long)(t->file_offset + t->n_bytes));
        if (t->file_offset > pos)
            return ds4_error_set(err, DS4_ERR_FORMAT, "bytes %llu..%llu of the data section belong to no tensor "
                                 "(before '%s')", (unsigned long long)pos, (unsigned long long)t->file_offset,
                                 printable(t->name, b, sizeof b));
        pos = t->file_offset + t->n_bytes;
        prev = t;
    }
    if (pos != f->size)
        return ds4_error_set(err, DS4_ERR_FORMAT, "bytes %llu..%llu at the end of the file belong to no tensor",
                             (unsigned long long)pos, (unsigned long long)f->size);
    f->name_hash_cap = pow2_at_least(2 * f->n_tensors);
    f->name_hash = calloc(f->name_hash_cap, sizeof *f->name_hash);
    if (!f->name_hash) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory indexing tensors");
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        if (!hash_insert(f->name_hash, f->name_hash_cap, f->tensors[i].name, i, tensor_name_of, f->tensors, NULL)) {
            char a[300];
            return ds4_error_set(err, DS4_ERR_FORMAT, "duplicate tensor name '%s'",
                                 printable(f->tensors[i].name, a, sizeof a));
        }
    }
    return DS4_OK;
}

static ds4_status parse(safetensors_file *f, ds4_error *err) {
    if (f->size < 8)
        return ds4_error_set(err, DS4_ERR_FORMAT, "file is %llu bytes, smaller than the 8-byte header length",
                             (unsigned long long)f->size);
    f->header_len = load_u64(f->map);
    if (f->header_len > SAFETENSORS_MAX_HEADER)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte 0: header length %llu exceeds the %u-byte limit",
                             (unsigned long long)f->header_len, SAFETENSORS_MAX_HEADER);
    if (f->header_len > f->size - 8)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte 0: header length %llu runs past the end of the file "
                             "(%llu bytes remain)", (unsigned long long)f->header_len,
                             (unsigned long long)(f->size - 8));
    if (f->header_len < 2)
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte 0: header length %llu cannot hold a JSON object",
                             (unsigned long long)f->header_len);
    f->data_offset = 8 + f->header_len;
    const char *hdr = (const char *)f->map + 8;
    if (hdr[0] != '{')
        return ds4_error_set(err, DS4_ERR_FORMAT, "byte 8: the header does not start with '{' (not a safetensors "
                             "file?)");
    cJSON *root;
    ds4_status st = json_parse(hdr, f->header_len, 8, "header", &root, err);
    if (st) return st;
    st = parse_tensors(f, root, err);
    cJSON_Delete(root);
    return st;
}

/* ------------------------------------------------------------ open/close */

ds4_status safetensors_open_memory(const void *data, size_t size, safetensors_file **out, ds4_error *err) {
    *out = NULL;
    safetensors_file *f = calloc(1, sizeof *f);
    if (!f) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    f->map = data;
    f->size = size;
    ds4_status st = parse(f, err);
    if (st) {
        safetensors_close(f);
        return st;
    }
    *out = f;
    return DS4_OK;
}

ds4_status safetensors_open(const char *path, safetensors_file **out, ds4_error *err) {
    *out = NULL;
    const uint8_t *map;
    uint64_t size;
    ds4_status st = ds4_map_file(path, 8, "the 8-byte header length", &map, &size, err);
    if (st) return st;
    safetensors_file *f = calloc(1, sizeof *f);
    char *p = strdup(path);
    if (!f || !p) {
        free(f);
        free(p);
        ds4_unmap_file(map, size);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    }
    f->map = map;
    f->size = size;
    f->owns_map = true;
    f->path = p;
    st = parse(f, err);
    if (st) {
        safetensors_close(f);
        return ds4_error_prefix(err, "%s", path);
    }
    *out = f;
    return DS4_OK;
}

void safetensors_close(safetensors_file *f) {
    if (!f) return;
    if (f->owns_map) ds4_unmap_file(f->map, f->size);
    for (uint64_t i = 0; i < f->n_tensors; i++) free(f->tensors[i].name);
    free(f->tensors);
    free(f->name_hash);
    free(f->path);
    free(f);
}

const safetensors_tensor *safetensors_find(const safetensors_file *f, const char *name) {
    uint64_t i = hash_lookup(f->name_hash, f->name_hash_cap, name, tensor_name_of, f->tensors);
    return i == UINT64_MAX ? NULL : &f->tensors[i];
}

/* ------------------------------------------------------------ checkpoints */

static const char *ckpt_name_of(const void *ctx, uint64_t i) {
    return ((const safetensors_tensor *const *)ctx)[i]->name;
}

static char *join_path(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static bool plain_file_name(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 255 || s[0] == '.') return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] == '/' || s[i] == '\\') return false;
    return true;
}

static ds4_status ckpt_add_file(safetensors_checkpoint *c, const char *name, ds4_error *err) {
    char *path = join_path(c->dir, name);
    if (!path) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    safetensors_file **nf = realloc(c->files, (size_t)(c->n_files + 1) * sizeof *nf);
    if (!nf) {
        free(path);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    }
    c->files = nf;
    ds4_status st = safetensors_open(path, &c->files[c->n_files], err);
    free(path);
    if (st) return st;
    c->n_files++;
    return DS4_OK;
}

/* Union of every file's tensors; a name in two files is an error. */
static ds4_status ckpt_index(safetensors_checkpoint *c, ds4_error *err) {
    uint64_t total = 0;
    for (int i = 0; i < c->n_files; i++) total += c->files[i]->n_tensors;
    c->tensors = calloc(total ? total : 1, sizeof *c->tensors);
    c->name_hash_cap = pow2_at_least(2 * total);
    c->name_hash = calloc(c->name_hash_cap, sizeof *c->name_hash);
    if (!c->tensors || !c->name_hash) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory indexing tensors");
    for (int i = 0; i < c->n_files; i++) {
        for (uint64_t j = 0; j < c->files[i]->n_tensors; j++) {
            const safetensors_tensor *t = &c->files[i]->tensors[j];
            uint64_t dup = 0;
            c->tensors[c->n_tensors] = t;
            if (!hash_insert(c->name_hash, c->name_hash_cap, t->name, c->n_tensors, ckpt_name_of, c->tensors, &dup)) {
                char a[300];
                return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s' is in both %s and %s",
                                     printable(t->name, a, sizeof a), c->tensors[dup]->file_path, t->file_path);
            }
            c->n_tensors++;
        }
    }
    return DS4_OK;
}

static ds4_status ckpt_open_index(safetensors_checkpoint *c, const char *index_path, ds4_error *err) {
    char *text;
    uint64_t size = 0;
    ds4_status st = ds4_read_small_file(index_path, SAFETENSORS_MAX_HEADER, &text, &size, err);
    if (st) return st;
    cJSON *root;
    st = json_parse(text, size, 0, "index", &root, err);
    free(text);
    if (st) return ds4_error_prefix(err, "%s", index_path);
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        cJSON_Delete(root);
        return ds4_error_set(err, DS4_ERR_FORMAT, "%s: \"weight_map\" is %s", index_path,
                             wm ? "not a JSON object" : "missing");
    }
    /* Open each distinct shard once, in order of first mention. */
    for (const cJSON *m = wm->child; m && !st; m = m->next) {
        char a[300];
        if (!cJSON_IsString(m) || !plain_file_name(m->valuestring)) {
            st = ds4_error_set(err, DS4_ERR_FORMAT, "%s: weight_map entry '%s' is not a plain file name in the "
                               "checkpoint directory", index_path, printable(m->string, a, sizeof a));
            break;
        }
        bool seen = false;
        for (int i = c->n_files - 1; i >= 0 && !seen; i--) {
            const char *p = c->files[i]->path, *slash = strrchr(p, '/');
            seen = !strcmp(slash ? slash + 1 : p, m->valuestring);
        }
        if (!seen) st = ckpt_add_file(c, m->valuestring, err);
    }
    if (!st) st = ckpt_index(c, err);
    /* Every weight_map entry must be in the file it names. */
    for (const cJSON *m = wm->child; m && !st; m = m->next) {
        const safetensors_tensor *t = safetensors_checkpoint_find(c, m->string);
        const char *slash = t ? strrchr(t->file_path, '/') : NULL;
        if (!t || strcmp(slash ? slash + 1 : t->file_path, m->valuestring) != 0) {
            char a[300];
            st = ds4_error_set(err, DS4_ERR_FORMAT, "%s: weight_map puts '%s' in %s, which does not contain it",
                               index_path, printable(m->string, a, sizeof a), m->valuestring);
        }
    }
    cJSON_Delete(root);
    return st;
}

ds4_status safetensors_checkpoint_open(const char *dir, safetensors_checkpoint **out, ds4_error *err) {
    *out = NULL;
    safetensors_checkpoint *c = calloc(1, sizeof *c);
    if (!c || !(c->dir = strdup(dir))) {
        free(c);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    }
    char *index = join_path(dir, "model.safetensors.index.json");
    char *single = join_path(dir, "model.safetensors");
    ds4_status st = DS4_OK;
    struct stat sb;
    if (!index || !single) {
        st = ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    } else if (stat(index, &sb) == 0) {
        st = ckpt_open_index(c, index, err);
    } else if (stat(single, &sb) == 0) {
        st = ckpt_add_file(c, "model.safetensors", err);
        if (!st) st = ckpt_index(c, err);
    } else {
        st = ds4_error_set(err, DS4_ERR_NOT_FOUND, "%s: neither model.safetensors.index.json nor model.safetensors "
                           "is there", dir);
    }
    free(index);
    free(single);
    if (st) {
        safetensors_checkpoint_close(c);
        return st;
    }
    *out = c;
    return DS4_OK;
}

void safetensors_checkpoint_close(safetensors_checkpoint *c) {
    if (!c) return;
    for (int i = 0; i < c->n_files; i++) safetensors_close(c->files[i]);
    free(c->files);
    free(c->tensors);
    free(c->name_hash);
    free(c->dir);
    free(c);
}

uint64_t safetensors_checkpoint_index(const safetensors_checkpoint *c, const char *name) {
    return hash_lookup(c->name_hash, c->name_hash_cap, name, ckpt_name_of, c->tensors);
}

const safetensors_tensor *safetensors_checkpoint_find(const safetensors_checkpoint *c, const char *name) {
    uint64_t i = safetensors_checkpoint_index(c, name);
    return i == UINT64_MAX ? NULL : c->tensors[i];
}

/* ------------------------------------------------------------ conversion */

static ds4_status check_range(const safetensors_tensor *t, uint64_t first, uint64_t n, ds4_error *err) {
    if (first > t->n_elements || n > t->n_elements - first)
        return ds4_error_set(err, DS4_ERR_INVALID, "tensor '%s': elements %llu..%llu requested, it has %llu", t->name,
                             (unsigned long long)first, (unsigned long long)(first + n),
                             (unsigned long long)t->n_elements);
    return DS4_OK;
}

ds4_status safetensors_read_f32(const safetensors_tensor *t, uint64_t first, uint64_t n, float *out, ds4_error *err) {
    ds4_status st = check_range(t, first, n, err);
    if (st) return st;
    const uint8_t *p = t->data + first * DTYPES[t->dtype].size;
    switch (t->dtype) {
    case ST_F32: memcpy(out, p, n * sizeof(float)); break;
    case ST_F64:
        for (uint64_t i = 0; i < n; i++) {
            double d;
            memcpy(&d, p + 8 * i, 8);
            out[i] = (float)d;
        }
        break;
    case ST_F16:
    case ST_BF16:
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = t->dtype == ST_F16 ? ds4_f16_to_f32(h) : ds4_bf16_to_f32(h);
        }
        break;
    default:
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "tensor '%s' has dtype %s, not a float type (F64, F32, F16, "
                             "BF16)", t->name, DTYPES[t->dtype].name);
    }
    return DS4_OK;
}

ds4_status safetensors_read_i64(const safetensors_tensor *t, uint64_t first, uint64_t n, int64_t *out,
                                ds4_error *err) {
    ds4_status st = check_range(t, first, n, err);
    if (st) return st;
    const size_t es = DTYPES[t->dtype].size;
    const uint8_t *p = t->data + first * es;
    for (uint64_t i = 0; i < n; i++, p += es) {
        switch (t->dtype) {
        case ST_I64: memcpy(&out[i], p, 8); break;
        case ST_I32: { int32_t v; memcpy(&v, p, 4); out[i] = v; break; }
        case ST_I16: { int16_t v; memcpy(&v, p, 2); out[i] = v; break; }
        case ST_I8: out[i] = (int8_t)p[0]; break;
        case ST_U8:
        case ST_BOOL: out[i] = p[0]; break;
        default:
            return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "tensor '%s' has dtype %s, not an integer type (I64, I32, "
                                 "I16, I8, U8, BOOL)", t->name, DTYPES[t->dtype].name);
        }
    }
    return DS4_OK;
}

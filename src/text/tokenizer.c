/*
 * tokenizer.c - vocabulary tables, byte-level BPE, special tokens and decoding
 * for the DeepSeek V4 tokenizer (spec: deepseek-v4-flash.md 5.1-5.3). The
 * pre-tokenizers are in pretok.c.
 */
#include "text/tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "text/pretok.h"

/* ------------------------------------------------------------------ tables
 * Symbols. BPE works on ids, not strings: every string that can be a BPE
 * symbol has one id. Vocabulary tokens are ids 0..n_vocab-1; a byte or merge
 * result that is not in the vocabulary gets a "virtual" id >= n_vocab (none
 * in the real vocabulary). When two tokens share a string, the later id wins,
 * as in ds4's hash table (and Hugging Face's JSON vocab). */

struct ds4_tokenizer {
    int32_t n_vocab;
    int32_t n_sym;       /* n_vocab + virtual symbols */
    char *str;           /* symbol strings, byte-mapped form */
    uint64_t *str_off;   /* [n_sym + 1] */
    uint64_t str_cap, off_cap;
    int32_t *index;      /* open addressing: string -> symbol id, -1 empty */
    uint64_t index_mask;
    struct merge_slot {
        uint64_t key; /* left << 32 | right; UINT64_MAX when empty */
        int32_t rank, result;
    } *merges;
    uint64_t merge_mask;
    int32_t *types;      /* [n_vocab] */
    char *dec;           /* decoded bytes of every token */
    uint64_t *dec_off;   /* [n_vocab + 1] */
    size_t max_token_bytes;
    int32_t byte_sym[256];   /* symbol of each byte's mapped character */
    int32_t single_byte[256]; /* token whose string is that single byte, or -1 (ds4's fallback) */
    int32_t special[DS4_SPECIAL_COUNT];
    pretok_regex *regex;
};

static const char *const SPECIAL_TEXT[DS4_SPECIAL_COUNT] = {
    u8"<\uff5cbegin\u2581of\u2581sentence\uff5c>",
    u8"<\uff5cend\u2581of\u2581sentence\uff5c>",
    u8"<\uff5cUser\uff5c>",
    u8"<\uff5cAssistant\uff5c>",
    "<think>",
    "</think>",
    u8"\uff5cDSML\uff5c",
};

const char *ds4_special_text(ds4_special s) {
    return (unsigned)s < DS4_SPECIAL_COUNT ? SPECIAL_TEXT[s] : "";
}

/* GPT-2 byte mapping: bytes 33..126, 161..172, 174..255 are their own code
 * point; the other 68 bytes take 256, 257, ... in increasing byte order. */
static bool byte_is_printable(unsigned b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174; }

static uint32_t byte_to_cp(unsigned b) {
    if (byte_is_printable(b)) return b;
    uint32_t n = 0;
    for (unsigned x = 0; x < b; x++) n += !byte_is_printable(x);
    return 256 + n;
}

/* The inverse map: cp_byte[cp] for cp < 256 + 68, -1 when cp is no byte's image. */
#define N_BYTE_CPS (256 + 68)
static void byte_inverse(int16_t cp_byte[N_BYTE_CPS]) {
    for (int cp = 0; cp < N_BYTE_CPS; cp++) cp_byte[cp] = -1;
    for (unsigned b = 0; b < 256; b++) cp_byte[byte_to_cp(b)] = (int16_t)b;
}

static size_t put_utf8(char *p, uint32_t cp) {
    if (cp < 0x80) { p[0] = (char)cp; return 1; }
    if (cp < 0x800) { p[0] = (char)(0xC0 | cp >> 6); p[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    p[0] = (char)(0xE0 | cp >> 12);
    p[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    p[2] = (char)(0x80 | (cp & 0x3F));
    return 3; /* byte images are below U+0800 */
}

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a, then a final mix */
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ull;
    return h ^ (h >> 32);
}

static uint64_t hash_u64(uint64_t x) { /* splitmix64 finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static const char *sym_str(const ds4_tokenizer *t, int32_t id, size_t *len) {
    *len = (size_t)(t->str_off[id + 1] - t->str_off[id]);
    return t->str + t->str_off[id];
}

/* Slot of `s` in the index: its id's slot, or the empty slot where it goes. */
static uint64_t index_slot(const ds4_tokenizer *t, const char *s, size_t n) {
    uint64_t i = hash_bytes(s, n) & t->index_mask;
    for (;;) {
        int32_t id = t->index[i];
        if (id < 0) return i;
        size_t len;
        const char *p = sym_str(t, id, &len);
        if (len == n && memcmp(p, s, n) == 0) return i;
        i = (i + 1) & t->index_mask;
    }
}

static int32_t lookup(const ds4_tokenizer *t, const char *s, size_t n) {
    return t->index[index_slot(t, s, n)];
}

static ds4_status index_grow(ds4_tokenizer *t) {
    uint64_t cap = (t->index_mask + 1) * 2;
    int32_t *old = t->index;
    uint64_t old_cap = t->index_mask + 1;
    if (!(t->index = malloc(cap * sizeof *t->index))) { t->index = old; return DS4_ERR_NOMEM; }
    memset(t->index, 0xff, cap * sizeof *t->index);
    t->index_mask = cap - 1;
    for (uint64_t i = 0; i < old_cap; i++) {
        if (old[i] < 0) continue;
        size_t len;
        const char *p = sym_str(t, old[i], &len);
        t->index[index_slot(t, p, len)] = old[i];
    }
    free(old);
    return DS4_OK;
}

/* Append a symbol string (not yet indexed); returns its id or -1 (no memory). */
static int32_t add_string(ds4_tokenizer *t, const char *s, size_t n) {
    if (t->n_sym == INT32_MAX - 1) return -1;
    if ((uint64_t)t->n_sym + 2 > t->off_cap) {
        uint64_t cap = t->off_cap ? t->off_cap * 2 : 1024;
        uint64_t *p = realloc(t->str_off, cap * sizeof *p);
        if (!p) return -1;
        t->str_off = p;
        t->off_cap = cap;
    }
    uint64_t end = t->str_off[t->n_sym];
    if (end + n > t->str_cap) {
        uint64_t cap = t->str_cap ? t->str_cap : 1 << 16;
        while (cap < end + n) cap *= 2;
        char *p = realloc(t->str, cap);
        if (!p) return -1;
        t->str = p;
        t->str_cap = cap;
    }
    memcpy(t->str + end, s, n);
    t->str_off[t->n_sym + 1] = end + n;
    return t->n_sym++;
}

/* The symbol id of a string, adding a virtual symbol when it is unknown. */
static int32_t intern(ds4_tokenizer *t, const char *s, size_t n) {
    int32_t id = lookup(t, s, n);
    if (id >= 0) return id;
    if ((uint64_t)t->n_sym * 2 >= t->index_mask && index_grow(t)) return -1;
    if ((id = add_string(t, s, n)) < 0) return -1;
    size_t len;
    const char *p = sym_str(t, id, &len);
    t->index[index_slot(t, p, len)] = id;
    return id;
}

static struct merge_slot *merge_find(const ds4_tokenizer *t, int32_t left, int32_t right) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    uint64_t i = hash_u64(key) & t->merge_mask;
    while (t->merges[i].key != UINT64_MAX && t->merges[i].key != key) i = (i + 1) & t->merge_mask;
    return &t->merges[i];
}

/* Decode a token string the way ds4 does [ds4_token_text]: verbatim when it
 * contains U+FF5C, else code points -> bytes with unmapped ones dropped. The
 * code point reader is ds4's lenient one (no continuation-byte checks; a lead
 * byte without room for its sequence reads as itself), which only matters for
 * token strings that are not valid UTF-8. */
static size_t decode_token_string(const int16_t *cp_byte, const char *str, size_t len, char *out) {
    const unsigned char *s = (const unsigned char *)str;
    for (size_t i = 0; i + 3 <= len; i++)
        if (s[i] == 0xEF && s[i + 1] == 0xBD && s[i + 2] == 0x9C) {
            memcpy(out, str, len);
            return len;
        }
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        unsigned char c = s[i];
        uint32_t cp;
        if ((c & 0xE0) == 0xC0 && i + 1 < len) {
            cp = (uint32_t)(c & 0x1F) << 6 | (s[i + 1] & 0x3Fu);
            i += 2;
        } else if ((c & 0xF0) == 0xE0 && i + 2 < len) {
            cp = (uint32_t)(c & 0x0F) << 12 | (uint32_t)(s[i + 1] & 0x3F) << 6 | (s[i + 2] & 0x3Fu);
            i += 3;
        } else if ((c & 0xF8) == 0xF0 && i + 3 < len) {
            cp = (uint32_t)(c & 0x07) << 18 | (uint32_t)(s[i + 1] & 0x3F) << 12 | (uint32_t)(s[i + 2] & 0x3F) << 6 |
                 (s[i + 3] & 0x3Fu);
            i += 4;
        } else {
            cp = c;
            i++;
        }
        if (cp < N_BYTE_CPS && cp_byte[cp] >= 0) out[n++] = (char)cp_byte[cp];
    }
    return n;
}

void ds4_tokenizer_free(ds4_tokenizer *t) {
    if (!t) return;
    free(t->str);
    free(t->str_off);
    free(t->index);
    free(t->merges);
    free(t->types);
    free(t->dec);
    free(t->dec_off);
    pretok_regex_free(t->regex);
    free(t);
}

static ds4_status build_tables(ds4_tokenizer *t, const ds4_strref *tokens, int64_t n_tokens, const int32_t *types,
                               const ds4_strref *merges, int64_t n_merges, ds4_error *err) {
    const ds4_status nomem = DS4_ERR_NOMEM;
    uint64_t cap = 1024;
    while (cap < (uint64_t)n_tokens * 2 + 1024) cap *= 2;
    if (!(t->index = malloc(cap * sizeof *t->index))) return ds4_error_set(err, nomem, "tokenizer: out of memory");
    memset(t->index, 0xff, cap * sizeof *t->index);
    t->index_mask = cap - 1;
    if (!(t->str_off = calloc(1024, sizeof *t->str_off))) return ds4_error_set(err, nomem, "tokenizer: out of memory");
    t->off_cap = 1024;

    /* Vocabulary strings; the later id wins a shared string. */
    for (int64_t i = 0; i < n_tokens; i++) {
        if (tokens[i].len && !tokens[i].ptr) return ds4_error_set(err, DS4_ERR_INVALID, "tokenizer: token %lld is NULL",
                                                                   (long long)i);
        if (add_string(t, tokens[i].ptr, tokens[i].len) < 0)
            return ds4_error_set(err, nomem, "tokenizer: out of memory");
        if ((uint64_t)t->n_sym * 2 >= t->index_mask && index_grow(t))
            return ds4_error_set(err, nomem, "tokenizer: out of memory");
        t->index[index_slot(t, tokens[i].ptr, tokens[i].len)] = (int32_t)i;
    }
    t->n_vocab = (int32_t)n_tokens;

    if (!(t->types = malloc((size_t)n_tokens * sizeof *t->types)))
        return ds4_error_set(err, nomem, "tokenizer: out of memory");
    for (int64_t i = 0; i < n_tokens; i++) t->types[i] = types ? types[i] : 1;

    for (int s = 0; s < DS4_SPECIAL_COUNT; s++) {
        t->special[s] = lookup(t, SPECIAL_TEXT[s], strlen(SPECIAL_TEXT[s]));
        if (t->special[s] < 0)
            return ds4_error_set(err, DS4_ERR_FORMAT, "tokenizer: required special token \"%s\" is not in the vocabulary",
                                 SPECIAL_TEXT[s]);
    }

    for (unsigned b = 0; b < 256; b++) { /* before any virtual symbol exists */
        char one = (char)b;
        t->single_byte[b] = lookup(t, &one, 1);
    }
    for (unsigned b = 0; b < 256; b++) {
        char buf[4];
        size_t n = put_utf8(buf, byte_to_cp(b));
        if ((t->byte_sym[b] = intern(t, buf, n)) < 0) return ds4_error_set(err, nomem, "tokenizer: out of memory");
    }

    /* Merges: rank = index; the later entry wins a repeated pair. Symbols
     * never hold a raw space (byte 0x20 maps to U+0120), so an entry without
     * exactly one space, or with an empty side, can never apply: skip it. */
    cap = 1024;
    while (cap < (uint64_t)n_merges * 2 + 1024) cap *= 2;
    if (!(t->merges = malloc(cap * sizeof *t->merges))) return ds4_error_set(err, nomem, "tokenizer: out of memory");
    memset(t->merges, 0xff, cap * sizeof *t->merges);
    t->merge_mask = cap - 1;
    char *joined = NULL;
    size_t joined_cap = 0;
    for (int64_t r = 0; r < n_merges; r++) {
        const char *m = merges[r].ptr;
        size_t n = merges[r].len;
        const char *sp = n ? memchr(m, ' ', n) : NULL;
        if (!sp || sp == m || sp == m + n - 1 || memchr(sp + 1, ' ', (size_t)(m + n - sp - 1))) continue;
        size_t la = (size_t)(sp - m), lb = n - la - 1;
        if (la + lb > joined_cap) {
            char *p = realloc(joined, la + lb);
            if (!p) { free(joined); return ds4_error_set(err, nomem, "tokenizer: out of memory"); }
            joined = p;
            joined_cap = la + lb;
        }
        memcpy(joined, m, la);
        memcpy(joined + la, sp + 1, lb);
        int32_t a = intern(t, m, la), b = intern(t, sp + 1, lb), ab = intern(t, joined, la + lb);
        if (a < 0 || b < 0 || ab < 0) { free(joined); return ds4_error_set(err, nomem, "tokenizer: out of memory"); }
        struct merge_slot *slot = merge_find(t, a, b);
        slot->key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
        slot->rank = (int32_t)r;
        slot->result = ab;
    }
    free(joined);

    /* Decoded bytes of every token (a decoded token is never longer than its string). */
    if (!(t->dec = malloc(t->str_off[t->n_vocab] + 1)) || !(t->dec_off = malloc(((size_t)t->n_vocab + 1) * 8)))
        return ds4_error_set(err, nomem, "tokenizer: out of memory");
    int16_t cp_byte[N_BYTE_CPS];
    byte_inverse(cp_byte);
    t->dec_off[0] = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        size_t len;
        const char *s = sym_str(t, i, &len);
        size_t n = decode_token_string(cp_byte, s, len, t->dec + t->dec_off[i]);
        t->dec_off[i + 1] = t->dec_off[i] + n;
        if (n > t->max_token_bytes) t->max_token_bytes = n;
    }
    return pretok_regex_new(&t->regex, err);
}

ds4_status ds4_tokenizer_build(const ds4_strref *tokens, int64_t n_tokens, const int32_t *types,
                               const ds4_strref *merges, int64_t n_merges, ds4_tokenizer **out, ds4_error *err) {
    *out = NULL;
    if (n_tokens <= 0 || n_tokens > (1 << 30) || n_merges < 0 || n_merges > (1 << 30) || !tokens ||
        (n_merges && !merges))
        return ds4_error_set(err, DS4_ERR_INVALID, "tokenizer: bad table sizes (%lld tokens, %lld merges)",
                             (long long)n_tokens, (long long)n_merges);
    ds4_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return ds4_error_set(err, DS4_ERR_NOMEM, "tokenizer: out of memory");
    ds4_status st = build_tables(t, tokens, n_tokens, types, merges, n_merges, err);
    if (st) {
        ds4_tokenizer_free(t);
        return st;
    }
    *out = t;
    return DS4_OK;
}

/* A metadata array of strings as refs into the mapping. */
static ds4_status string_array(const gguf_file *f, const char *key, ds4_strref **out, int64_t *n, ds4_error *err) {
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) return ds4_error_set(err, DS4_ERR_NOT_FOUND, "tokenizer: metadata key '%s' is missing", key);
    if (kv->value.type != GGUF_TYPE_ARRAY || kv->value.elem_type != GGUF_TYPE_STRING)
        return ds4_error_set(err, DS4_ERR_FORMAT, "tokenizer: '%s' must be an array of strings", key);
    if (kv->value.count > (1u << 30))
        return ds4_error_set(err, DS4_ERR_FORMAT, "tokenizer: '%s' has %llu entries (too many)", key,
                             (unsigned long long)kv->value.count);
    ds4_strref *v = malloc((kv->value.count ? kv->value.count : 1) * sizeof *v);
    if (!v) return ds4_error_set(err, DS4_ERR_NOMEM, "tokenizer: out of memory reading '%s'", key);
    gguf_array_iter it;
    gguf_value e;
    int64_t i = 0;
    gguf_array_iter_init(&it, &kv->value);
    while (gguf_array_iter_next(&it, &e)) v[i++] = (ds4_strref){ e.str.ptr, (size_t)e.str.len };
    *out = v;
    *n = i;
    return DS4_OK;
}

ds4_status ds4_tokenizer_load(const gguf_file *f, ds4_tokenizer **out, ds4_error *err) {
    *out = NULL;
    const gguf_kv *model = gguf_find_kv(f, "tokenizer.ggml.model");
    if (model && (model->value.type != GGUF_TYPE_STRING || !gguf_str_eq(model->value.str, "gpt2")))
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "tokenizer: tokenizer.ggml.model must be \"gpt2\" (byte-level BPE)");
    ds4_strref *tokens = NULL, *merges = NULL;
    int32_t *types = NULL;
    int64_t n_tokens = 0, n_merges = 0;
    ds4_status st = string_array(f, "tokenizer.ggml.tokens", &tokens, &n_tokens, err);
    if (!st) st = string_array(f, "tokenizer.ggml.merges", &merges, &n_merges, err);
    const gguf_kv *tt = gguf_find_kv(f, "tokenizer.ggml.token_type");
    if (!st && tt) {
        if (tt->value.type != GGUF_TYPE_ARRAY || tt->value.count != (uint64_t)n_tokens) {
            st = ds4_error_set(err, DS4_ERR_FORMAT, "tokenizer: tokenizer.ggml.token_type must be an array of %lld integers",
                               (long long)n_tokens);
        } else if (!(types = malloc(((size_t)n_tokens + 1) * sizeof *types))) {
            st = ds4_error_set(err, DS4_ERR_NOMEM, "tokenizer: out of memory");
        } else {
            gguf_array_iter it;
            gguf_value e;
            int64_t i = 0, v;
            gguf_array_iter_init(&it, &tt->value);
            while (!st && gguf_array_iter_next(&it, &e)) {
                if (!gguf_value_as_i64(&e, &v) || v < INT32_MIN || v > INT32_MAX)
                    st = ds4_error_set(err, DS4_ERR_FORMAT, "tokenizer: tokenizer.ggml.token_type[%lld] is not an int32",
                                       (long long)i);
                else types[i++] = (int32_t)v;
            }
        }
    }
    if (!st && n_tokens == 0) st = ds4_error_set(err, DS4_ERR_FORMAT, "tokenizer: tokenizer.ggml.tokens is empty");
    if (!st) st = ds4_tokenizer_build(tokens, n_tokens, types, merges, n_merges, out, err);
    free(tokens);
    free(merges);
    free(types);
    return st;
}

int32_t ds4_tokenizer_n_vocab(const ds4_tokenizer *t) { return t->n_vocab; }

int32_t ds4_tokenizer_special(const ds4_tokenizer *t, ds4_special s) {
    return (unsigned)s < DS4_SPECIAL_COUNT ? t->special[s] : -1;
}

const char *ds4_tokenizer_token_str(const ds4_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab) {
        if (len) *len = 0;
        return NULL;
    }
    size_t n;
    const char *s = sym_str(t, id, &n);
    if (len) *len = n;
    return s;
}

int32_t ds4_tokenizer_token_type(const ds4_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab ? t->types[id] : 0;
}

size_t ds4_tokenizer_max_token_bytes(const ds4_tokenizer *t) { return t->max_token_bytes; }

size_t ds4_token_bytes(const ds4_tokenizer *t, int32_t id, char *buf, size_t cap) {
    if (id < 0 || id >= t->n_vocab) return 0;
    size_t n = (size_t)(t->dec_off[id + 1] - t->dec_off[id]);
    memcpy(buf, t->dec + t->dec_off[id], n < cap ? n : cap);
    return n;
}

/* ------------------------------------------------------------------ BPE
 * One piece: byte-map it, one symbol per byte, then repeatedly merge the
 * adjacent pair of lowest rank (the leftmost one on equal rank) until no pair
 * has a rank. A heap of candidate pairs keeps this O(n log n): a popped pair
 * that no longer exists (either side merged since) is skipped. */

typedef struct tokvec {
    int32_t *v;
    int64_t n, cap;
} tokvec;

static ds4_status tokvec_push(tokvec *tv, int32_t id, ds4_error *err) {
    if (tv->n == tv->cap) {
        int64_t cap = tv->cap ? tv->cap * 2 : 64;
        int32_t *p = realloc(tv->v, (size_t)cap * sizeof *p);
        if (!p) return ds4_error_set(err, DS4_ERR_NOMEM, "tokenizer: out of memory for %lld ids", (long long)cap);
        tv->v = p;
        tv->cap = cap;
    }
    tv->v[tv->n++] = id;
    return DS4_OK;
}

typedef struct bpe_sym {
    int32_t id, prev, next; /* id -1: merged into its left neighbour */
} bpe_sym;

typedef struct bpe_pair {
    int32_t rank, left, left_id, right_id, result;
} bpe_pair;

typedef struct bpe_run {
    const ds4_tokenizer *t;
    tokvec *out;
    bpe_sym *sym;
    bpe_pair *heap;
    size_t cap, n_heap; /* sym holds cap entries, heap 3 * cap */
} bpe_run;

static bool pair_before(const bpe_pair *a, const bpe_pair *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(bpe_run *r, bpe_pair p) {
    size_t i = r->n_heap++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!pair_before(&p, &r->heap[up])) break;
        r->heap[i] = r->heap[up];
        i = up;
    }
    r->heap[i] = p;
}

static bpe_pair heap_pop(bpe_run *r) {
    bpe_pair top = r->heap[0], last = r->heap[--r->n_heap];
    size_t i = 0, n = r->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pair_before(&r->heap[c + 1], &r->heap[c])) c++;
        if (!pair_before(&r->heap[c], &last)) break;
        r->heap[i] = r->heap[c];
        i = c;
    }
    if (n) r->heap[i] = last;
    return top;
}

static void consider_pair(bpe_run *r, int32_t left) {
    int32_t right = r->sym[left].next;
    if (right < 0) return;
    const struct merge_slot *m = merge_find(r->t, r->sym[left].id, r->sym[right].id);
    if (m->key == UINT64_MAX) return;
    heap_push(r, (bpe_pair){ m->rank, left, r->sym[left].id, r->sym[right].id, m->result });
}

/* A final symbol: its token, or for a symbol outside the vocabulary ds4's
 * fallback - the tokens of the single bytes of its string, others dropped. */
static ds4_status emit_symbol(bpe_run *r, int32_t id, ds4_error *err) {
    const ds4_tokenizer *t = r->t;
    if (id < t->n_vocab) return tokvec_push(r->out, id, err);
    size_t len;
    const unsigned char *s = (const unsigned char *)sym_str(t, id, &len);
    for (size_t i = 0; i < len; i++)
        if (t->single_byte[s[i]] >= 0) {
            ds4_status st = tokvec_push(r->out, t->single_byte[s[i]], err);
            if (st) return st;
        }
    return DS4_OK;
}

static ds4_status bpe_piece(void *ctx, const char *piece, size_t n, ds4_error *err) {
    bpe_run *r = ctx;
    const unsigned char *p = (const unsigned char *)piece;
    if (n == 1) return emit_symbol(r, r->t->byte_sym[p[0]], err);
    if (n > INT32_MAX) return ds4_error_set(err, DS4_ERR_INVALID, "tokenizer: piece of %zu bytes is too long", n);
    if (n > r->cap) {
        size_t cap = r->cap ? r->cap : 64;
        while (cap < n) cap *= 2;
        bpe_sym *s = malloc(cap * sizeof *s);
        bpe_pair *h = malloc(3 * cap * sizeof *h);
        if (!s || !h) {
            free(s);
            free(h);
            return ds4_error_set(err, DS4_ERR_NOMEM, "tokenizer: out of memory for a %zu-byte piece", n);
        }
        free(r->sym);
        free(r->heap);
        r->sym = s;
        r->heap = h;
        r->cap = cap;
    }
    for (size_t i = 0; i < n; i++)
        r->sym[i] = (bpe_sym){ r->t->byte_sym[p[i]], (int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1 };
    r->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++) consider_pair(r, (int32_t)i);
    while (r->n_heap) {
        bpe_pair m = heap_pop(r);
        bpe_sym *left = &r->sym[m.left];
        if (left->id != m.left_id || left->next < 0) continue;
        bpe_sym *right = &r->sym[left->next];
        if (right->id != m.right_id) continue;
        left->id = m.result;
        right->id = -1;
        left->next = right->next;
        if (right->next >= 0) r->sym[right->next].prev = m.left;
        if (left->prev >= 0) consider_pair(r, left->prev);
        consider_pair(r, m.left);
    }
    for (int32_t i = 0; i >= 0; i = r->sym[i].next) {
        ds4_status st = emit_symbol(r, r->sym[i].id, err);
        if (st) return st;
    }
    return DS4_OK;
}

/* ------------------------------------------------------------------ tokenize */

ds4_status ds4_pretokenize(const ds4_tokenizer *t, const char *text, size_t len, ds4_pretok mode, ds4_piece_fn fn,
                           void *ctx, ds4_error *err) {
    if (!text && len) return ds4_error_set(err, DS4_ERR_INVALID, "tokenizer: NULL text");
    if (mode == DS4_PRETOK_DS4) return pretok_ds4(text, len, fn, ctx, err);
    if (mode == DS4_PRETOK_OFFICIAL) return pretok_official(t->regex, text, len, fn, ctx, err);
    return ds4_error_set(err, DS4_ERR_INVALID, "tokenizer: unknown pre-tokenizer mode %d", (int)mode);
}

/* The special string starting at s (n bytes left), tried in ds4's order. */
static int special_at(const char *s, size_t n) {
    if (s[0] != '<' && s[0] != (char)0xEF) return -1;
    for (int k = 0; k < DS4_SPECIAL_COUNT; k++) {
        size_t m = strlen(SPECIAL_TEXT[k]);
        if (m <= n && memcmp(s, SPECIAL_TEXT[k], m) == 0) return k;
    }
    return -1;
}

ds4_status ds4_tokenize(const ds4_tokenizer *t, const char *text, size_t len, ds4_pretok mode, bool specials,
                        int32_t **ids, int64_t *n, ds4_error *err) {
    *ids = NULL;
    *n = 0;
    tokvec out = { 0 };
    bpe_run run = { .t = t, .out = &out };
    ds4_status st = DS4_OK;
    if (!specials) {
        st = ds4_pretokenize(t, text, len, mode, bpe_piece, &run, err);
    } else {
        size_t span = 0;
        for (size_t i = 0; i < len && !st;) {
            int k = special_at(text + i, len - i);
            if (k < 0) {
                i++;
                continue;
            }
            st = ds4_pretokenize(t, text + span, i - span, mode, bpe_piece, &run, err);
            if (!st) st = tokvec_push(&out, t->special[k], err);
            i += strlen(SPECIAL_TEXT[k]);
            span = i;
        }
        if (!st && span < len) st = ds4_pretokenize(t, text + span, len - span, mode, bpe_piece, &run, err);
    }
    free(run.sym);
    free(run.heap);
    if (st) {
        free(out.v);
        return st;
    }
    *ids = out.v;
    *n = out.n;
    return DS4_OK;
}

/* ------------------------------------------------------------------ streaming decode */

void ds4_detok_init(ds4_detok *d, const ds4_tokenizer *t) {
    memset(d, 0, sizeof *d);
    d->tok = t;
}

/* Every input byte yields at most one U+FFFD (3 bytes); up to 3 held bytes
 * come before the token's own. */
size_t ds4_detok_bound(const ds4_tokenizer *t) { return 3 * (t->max_token_bytes + 4); }

static size_t put_replacement(char *out) {
    memcpy(out, "\xEF\xBF\xBD", 3);
    return 3;
}

/* Feed one byte; the held bytes are always a valid, incomplete prefix. */
static size_t detok_byte(ds4_detok *d, unsigned char b, char *out) {
    size_t w = 0;
    for (;;) {
        unsigned char seq[4];
        memcpy(seq, d->held, (size_t)d->n_held);
        seq[d->n_held] = b;
        size_t adv;
        int kind = text_utf8_next(seq, (size_t)d->n_held + 1, &adv);
        if (kind == UTF8_SHORT) {
            d->held[d->n_held++] = b;
            return w;
        }
        if (kind == UTF8_CHAR) {
            memcpy(out + w, seq, adv);
            d->n_held = 0;
            return w + adv;
        }
        /* Invalid: the held prefix (or b alone) is one maximal subpart. */
        w += put_replacement(out + w);
        if (d->n_held == 0) return w;
        d->n_held = 0; /* b starts afresh */
    }
}

size_t ds4_detok_push(ds4_detok *d, int32_t id, char *out) {
    const ds4_tokenizer *t = d->tok;
    if (id < 0 || id >= t->n_vocab) return 0;
    const unsigned char *s = (const unsigned char *)t->dec + t->dec_off[id];
    size_t n = (size_t)(t->dec_off[id + 1] - t->dec_off[id]), w = 0;
    for (size_t i = 0; i < n; i++) {
        if (d->n_held == 0 && s[i] < 0x80) out[w++] = (char)s[i];
        else w += detok_byte(d, s[i], out + w);
    }
    return w;
}

size_t ds4_detok_flush(ds4_detok *d, char *out) {
    if (!d->n_held) return 0;
    d->n_held = 0;
    return put_replacement(out);
}

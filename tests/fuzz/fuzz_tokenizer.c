/*
 * fuzz_tokenizer.c - libFuzzer target for the tokenizer.
 *
 * The vocabulary is built in memory (ds4_tokenizer_build): the seven special
 * strings, the 256 byte tokens and a few merges, one of them giving a symbol
 * outside the vocabulary. The first input byte picks the pre-tokenizer and the
 * rendered-chat flag; the rest is the text. Properties checked on every input:
 *   - tokenizing never fails, and the tokens' bytes are the text again;
 *   - the pre-tokenizer's pieces are non-empty and tile the text;
 *   - the streaming decoder writes valid UTF-8 within its bound, equal to the
 *     text when the text is valid UTF-8;
 *   - decoding arbitrary ids (from the input, many out of range) is safe.
 */
#include <stdlib.h>
#include <string.h>

#include "text/tokenizer.h"

static ds4_tokenizer *tok;

static size_t put_cp(char *p, unsigned cp) {
    if (cp < 0x80) { p[0] = (char)cp; return 1; }
    p[0] = (char)(0xC0 | cp >> 6);
    p[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

static void build(void) {
    static char bytes[256][3];
    static const char *const extra[] = { "ab", "bc", "\xC4\xA0t", "he", "\xC4\xA0the", "aa", "aaaa", "\xC4\x8A\xC4\x8A" };
    static const char *const merges[] = { "\xC4\xA0 t", "b c", "a b", "h e", "\xC4\xA0t he", "a a", "aa aa", "q z",
                                          "\xC4\x8A \xC4\x8A", "qz q", "bad" };
    ds4_strref toks[7 + 256 + 8];
    int n = 0;
    for (int s = 0; s < DS4_SPECIAL_COUNT; s++)
        toks[n++] = (ds4_strref){ ds4_special_text((ds4_special)s), strlen(ds4_special_text((ds4_special)s)) };
    for (unsigned b = 0; b < 256; b++) {
        unsigned cp = b;
        if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174))
            cp = b <= 32 ? 256 + b : b <= 160 ? 289 + (b - 127) : 323;
        toks[n++] = (ds4_strref){ bytes[b], put_cp(bytes[b], cp) };
    }
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++) toks[n++] = (ds4_strref){ extra[i], strlen(extra[i]) };
    ds4_strref m[sizeof merges / sizeof merges[0]];
    for (size_t i = 0; i < sizeof merges / sizeof merges[0]; i++) m[i] = (ds4_strref){ merges[i], strlen(merges[i]) };
    ds4_error err;
    if (ds4_tokenizer_build(toks, n, NULL, m, (int64_t)(sizeof m / sizeof m[0]), &tok, &err)) abort();
}

static bool valid_utf8(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t len = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
        if (!len || i + len > n) return false;
        unsigned lo = 0x80, hi = 0xBF;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
        for (size_t k = 1; k < len; k++) {
            unsigned b = s[i + k];
            if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return false;
        }
        i += len;
    }
    return true;
}

typedef struct tiling {
    const char *text;
    size_t pos;
} tiling;

static ds4_status check_piece(void *ctx, const char *piece, size_t len, ds4_error *err) {
    tiling *t = ctx;
    if (len == 0 || piece != t->text + t->pos) abort();
    t->pos += len;
    return DS4_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!tok) build();
    if (size == 0) return 0;
    const ds4_pretok mode = data[0] & 1 ? DS4_PRETOK_DS4 : DS4_PRETOK_OFFICIAL;
    const bool specials = (data[0] & 2) != 0;
    const char *text = (const char *)data + 1;
    const size_t len = size - 1;
    ds4_error err;

    tiling t = { text, 0 };
    if (ds4_pretokenize(tok, text, len, mode, check_piece, &t, &err) || t.pos != len) abort();

    int32_t *ids;
    int64_t n;
    if (ds4_tokenize(tok, text, len, mode, specials, &ids, &n, &err)) abort();
    char *back = malloc(len + 1);
    size_t w = 0;
    for (int64_t i = 0; i < n; i++) {
        char buf[64];
        size_t k = ds4_token_bytes(tok, ids[i], buf, sizeof buf);
        if (k > sizeof buf || w + k > len) abort();
        memcpy(back + w, buf, k);
        w += k;
    }
    if (w != len || memcmp(back, text, len) != 0) abort();

    /* Streaming decode of the ids, then of ids taken from the input bytes. */
    /* The decoded text of the ids is at most 3 bytes per text byte (U+FFFD per
     * byte); the input-derived ids are capped at 4096. */
    const size_t bound = ds4_detok_bound(tok);
    const int64_t n_raw = len / 2 < 4096 ? (int64_t)(len / 2) : 4096;
    size_t cap = 3 * len > (size_t)n_raw * bound ? 3 * len : (size_t)n_raw * bound;
    char *out = malloc(cap + 2 * bound);
    for (int pass = 0; pass < 2; pass++) {
        ds4_detok d;
        ds4_detok_init(&d, tok);
        size_t o = 0;
        int64_t count = pass == 0 ? n : n_raw;
        for (int64_t i = 0; i < count; i++) {
            int32_t id = pass == 0 ? ids[i] : (int32_t)(int16_t)(data[1 + 2 * i] | data[2 + 2 * i] << 8);
            size_t k = ds4_detok_push(&d, id, out + o);
            if (k > bound) abort();
            o += k;
        }
        size_t k = ds4_detok_flush(&d, out + o);
        if (k > bound) abort();
        o += k;
        if (!valid_utf8((const unsigned char *)out, o)) abort();
        if (pass == 0 && valid_utf8((const unsigned char *)text, len) && (o != len || memcmp(out, text, len))) abort();
    }
    free(out);
    free(back);
    free(ids);
    return 0;
}

/*
 * test_tokenizer.c - the tokenizer on a small vocabulary written here as a
 * GGUF (so nothing skips): byte mapping, special tokens, rendered-chat
 * splitting, every rule of ds4's scanner, the official regex split, BPE
 * merge order, decoding and the streaming decoder, invalid UTF-8, loader
 * errors. With DS4_TOKENIZER_GGUF set (a GGUF with the real vocabulary, e.g.
 * from `ds4server synth --tokenizer`), golden ids from Hugging Face too.
 * tests/python/test_tokenizer_oracle.py compares the real vocabulary with
 * Hugging Face `tokenizers` at scale.
 */
#include <stdlib.h>
#include <unistd.h>

#include "core/error.h"
#include "core/gguf.h"
#include "text/tokenizer.h"
#include "test.h"

/* ------------------------------------------------------------------ vocabulary */

/* GPT-2 byte -> code point, written independently of the library. */
static uint32_t gpt2_cp(unsigned b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174) return b;
    if (b <= 32) return 256 + b;               /* 0..32   -> 256..288 */
    if (b >= 127 && b <= 160) return 289 + (b - 127); /* 127..160 -> 289..322 */
    return 323;                                /* 173 */
}

static void utf8_of(uint32_t cp, char *out) {
    if (cp < 0x80) { out[0] = (char)cp; out[1] = 0; }
    else { out[0] = (char)(0xC0 | cp >> 6); out[1] = (char)(0x80 | (cp & 0x3F)); out[2] = 0; }
}

#define BYTE_ID(b) (2 + (int32_t)(b)) /* ids 2..257 are the 256 byte tokens */

/* Extra tokens after the bytes, then the specials other than BOS/EOS. */
static const char *const EXTRA[] = {
    "ab", "bc", "xx", "he", "\xC4\xA0t", "\xC4\xA0the", "aa", "aaaa", "ll",
    u8"<\uff5cUser\uff5c>", u8"<\uff5cAssistant\uff5c>", "<think>", "</think>", u8"\uff5cDSML\uff5c",
};
#define N_EXTRA ((int)(sizeof EXTRA / sizeof EXTRA[0]))
static int32_t extra_id(const char *s) {
    for (int i = 0; i < N_EXTRA; i++)
        if (!strcmp(EXTRA[i], s)) return 258 + i;
    return -1;
}

/* Ranks: "b c" (1) beats "a b" (2), so "abc" -> a + bc; "x x" ties resolve leftmost.
 * "q z" makes a symbol outside the vocabulary (ds4's per-byte fallback). The
 * last three entries are malformed and must be skipped. */
static const char *const MERGES[] = {
    "\xC4\xA0 t", "b c", "a b", "x x", "h e", "\xC4\xA0t he", "a a", "aa aa", "l l", "q z",
    "nospace", "a  b", " a",
};
#define N_MERGES ((int)(sizeof MERGES / sizeof MERGES[0]))

static char gguf_path[256];

/* Write the small vocabulary; `drop` (if not NULL) is a token left out,
 * `skip_key` a metadata key left out. */
static int write_vocab(const char *path, const char *drop, const char *skip_key, const char *model) {
    const char *toks[2 + 256 + N_EXTRA];
    char bytes[256][3];
    int32_t types[2 + 256 + N_EXTRA];
    int n = 0;
    toks[n++] = u8"<\uff5cbegin\u2581of\u2581sentence\uff5c>";
    toks[n++] = u8"<\uff5cend\u2581of\u2581sentence\uff5c>";
    for (unsigned b = 0; b < 256; b++) {
        utf8_of(gpt2_cp(b), bytes[b]);
        toks[n++] = bytes[b];
    }
    for (int i = 0; i < N_EXTRA; i++) toks[n++] = drop && !strcmp(EXTRA[i], drop) ? "<unused>" : EXTRA[i];
    for (int i = 0; i < n; i++) types[i] = i < 2 || i >= 258 + 9 ? 3 : 1;
    gguf_writer *w;
    ds4_error err = { 0 };
    if (gguf_writer_open(path, 32, &w, &err)) return 1;
    gguf_writer_add_str(w, "general.architecture", "test");
    gguf_writer_add_str(w, "tokenizer.ggml.model", model);
    if (!skip_key || strcmp(skip_key, "tokens")) gguf_writer_add_str_array(w, "tokenizer.ggml.tokens", toks, (uint64_t)n);
    if (!skip_key || strcmp(skip_key, "types")) gguf_writer_add_array(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, (uint64_t)n);
    else gguf_writer_add_array(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, 3); /* wrong length */
    if (!skip_key || strcmp(skip_key, "merges")) gguf_writer_add_str_array(w, "tokenizer.ggml.merges", MERGES, N_MERGES);
    return gguf_writer_finish(w, &err) != DS4_OK;
}

static ds4_status load_path(const char *path, ds4_tokenizer **t, ds4_error *err) {
    gguf_file *f = NULL;
    ds4_status st = gguf_open(path, &f, err);
    if (!st) st = ds4_tokenizer_load(f, t, err);
    gguf_close(f); /* the tokenizer keeps copies */
    return st;
}

static ds4_tokenizer *small_vocab(void) {
    snprintf(gguf_path, sizeof gguf_path, "/tmp/ds4_test_tok_%d.gguf", (int)getpid());
    if (write_vocab(gguf_path, NULL, NULL, "gpt2")) return NULL;
    ds4_tokenizer *t = NULL;
    ds4_error err = { 0 };
    if (load_path(gguf_path, &t, &err)) fprintf(stderr, "  load: %s\n", err.message);
    unlink(gguf_path);
    return t;
}

/* ------------------------------------------------------------------ helpers */

typedef struct pieces {
    char buf[4096];
    size_t n;
} pieces;

static ds4_status collect(void *ctx, const char *p, size_t len, ds4_error *err) {
    pieces *ps = ctx;
    if (ps->n + len + 1 >= sizeof ps->buf) return ds4_error_set(err, DS4_ERR_INVALID, "too many pieces");
    memcpy(ps->buf + ps->n, p, len);
    ps->n += len;
    ps->buf[ps->n++] = '|';
    ps->buf[ps->n] = 0;
    return DS4_OK;
}

static pieces split_out;

/* Pieces of `text` joined with '|' after each (e.g. "a|b|"). */
static const char *split(const ds4_tokenizer *t, ds4_pretok mode, const char *text, size_t len) {
    pieces *ps = &split_out;
    ps->n = 0;
    ps->buf[0] = 0;
    ds4_error err = { 0 };
    if (ds4_pretokenize(t, text, len, mode, collect, ps, &err)) snprintf(ps->buf, sizeof ps->buf, "(error: %s)", err.message);
    return ps->buf;
}

/* The same for texts with NUL bytes: compare want_len bytes. */
static bool split_is(const ds4_tokenizer *t, ds4_pretok mode, const char *text, size_t len, const char *want,
                     size_t want_len) {
    split(t, mode, text, len);
    return split_out.n == want_len && !memcmp(split_out.buf, want, want_len);
}
#define DS4_SPLIT(t, s) split(t, DS4_PRETOK_DS4, s, sizeof(s) - 1)
#define OFF_SPLIT(t, s) split(t, DS4_PRETOK_OFFICIAL, s, sizeof(s) - 1)

static int64_t tok(const ds4_tokenizer *t, const char *s, size_t len, ds4_pretok mode, bool specials, int32_t *out,
                   int64_t cap) {
    int32_t *ids;
    int64_t n;
    ds4_error err = { 0 };
    if (ds4_tokenize(t, s, len, mode, specials, &ids, &n, &err)) {
        fprintf(stderr, "  tokenize: %s\n", err.message);
        return -1;
    }
    for (int64_t i = 0; i < n && i < cap; i++) out[i] = ids[i];
    free(ids);
    return n;
}

static bool ids_eq(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
    return na == nb && (na == 0 || memcmp(a, b, (size_t)na * sizeof *a) == 0);
}

/* Both pre-tokenizers give `want` for plain `text`. */
static bool expect_ids(const ds4_tokenizer *t, const char *text, const int32_t *want, int64_t n_want) {
    int32_t got[64];
    bool ok = true;
    for (int mode = 0; mode < 2; mode++) {
        int64_t n = tok(t, text, strlen(text), (ds4_pretok)mode, false, got, 64);
        ok = ok && ids_eq(got, n, want, n_want);
    }
    return ok;
}

/* Concatenated token bytes (the raw decode). */
static size_t raw_decode(const ds4_tokenizer *t, const int32_t *ids, int64_t n, char *out, size_t cap) {
    size_t w = 0;
    for (int64_t i = 0; i < n; i++) w += ds4_token_bytes(t, ids[i], out + w, w < cap ? cap - w : 0);
    return w;
}

static bool valid_utf8(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = u[i];
        size_t len = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
        if (!len || i + len > n) return false;
        uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1Fu) : len == 3 ? (c & 0x0Fu) : (c & 0x07u);
        for (size_t k = 1; k < len; k++) {
            if ((u[i + k] & 0xC0) != 0x80) return false;
            cp = cp << 6 | (u[i + k] & 0x3Fu);
        }
        if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += len;
    }
    return true;
}

/* ------------------------------------------------------------------ tests */

static void test_byte_mapping(void) {
    ds4_tokenizer *t = small_vocab();
    CHECK(t);
    if (!t) return;
    CHECK_EQ_INT(ds4_tokenizer_n_vocab(t), 258 + N_EXTRA);
    /* Spot values of the GPT-2 map: ' ' -> U+0120, '\n' -> U+010A, 0x7F -> U+0121, 0xAD -> U+0143. */
    size_t len;
    CHECK(!memcmp(ds4_tokenizer_token_str(t, BYTE_ID(' '), &len), "\xC4\xA0", 2) && len == 2);
    CHECK(!memcmp(ds4_tokenizer_token_str(t, BYTE_ID('\n'), &len), "\xC4\x8A", 2) && len == 2);
    CHECK(!memcmp(ds4_tokenizer_token_str(t, BYTE_ID(0x7F), &len), "\xC4\xA1", 2) && len == 2);
    CHECK(!memcmp(ds4_tokenizer_token_str(t, BYTE_ID(0xAD), &len), "\xC5\x83", 2) && len == 2);
    for (unsigned b = 0; b < 256; b++) {
        char buf[8];
        char one = (char)b;
        CHECK_EQ_INT(ds4_token_bytes(t, BYTE_ID(b), buf, sizeof buf), 1);
        CHECK_EQ_INT((unsigned char)buf[0], b);
        /* and every single byte encodes to its byte token, in both modes */
        int32_t ids[4];
        CHECK_EQ_INT(tok(t, &one, 1, DS4_PRETOK_OFFICIAL, false, ids, 4), 1);
        CHECK_EQ_INT(ids[0], BYTE_ID(b));
        CHECK_EQ_INT(tok(t, &one, 1, DS4_PRETOK_DS4, false, ids, 4), 1);
        CHECK_EQ_INT(ids[0], BYTE_ID(b));
    }
    char buf[8];
    CHECK_EQ_INT(ds4_token_bytes(t, -1, buf, sizeof buf), 0);
    CHECK_EQ_INT(ds4_token_bytes(t, 1 << 20, buf, sizeof buf), 0);
    CHECK(ds4_tokenizer_token_str(t, -5, &len) == NULL && len == 0);
    CHECK_EQ_INT(ds4_tokenizer_token_type(t, 0), 3);
    CHECK_EQ_INT(ds4_tokenizer_token_type(t, BYTE_ID('a')), 1);
    ds4_tokenizer_free(t);
}

static void test_special_tokens(void) {
    ds4_tokenizer *t = small_vocab();
    CHECK(t);
    if (!t) return;
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_BOS), 0);
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_EOS), 1);
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_USER), extra_id(u8"<\uff5cUser\uff5c>"));
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_ASSISTANT), extra_id(u8"<\uff5cAssistant\uff5c>"));
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_THINK), extra_id("<think>"));
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_THINK_END), extra_id("</think>"));
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_DSML), extra_id(u8"\uff5cDSML\uff5c"));
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_COUNT), -1);
    CHECK_STR(ds4_special_text(DS4_SPECIAL_DSML), u8"\uff5cDSML\uff5c");
    /* Decoding: U+FF5C tokens verbatim, <think> through the byte map. */
    char buf[64];
    for (int s = 0; s < DS4_SPECIAL_COUNT; s++) {
        size_t n = ds4_token_bytes(t, ds4_tokenizer_special(t, (ds4_special)s), buf, sizeof buf);
        CHECK(n == strlen(ds4_special_text((ds4_special)s)) && !memcmp(buf, ds4_special_text((ds4_special)s), n));
    }
    ds4_tokenizer_free(t);
}

static void test_rendered_chat(void) {
    ds4_tokenizer *t = small_vocab();
    CHECK(t);
    if (!t) return;
    const int32_t dsml = ds4_tokenizer_special(t, DS4_SPECIAL_DSML);
    for (int mode = 0; mode < 2; mode++) {
        int32_t got[64], want[64], tail[64];
        /* <｜DSML｜tool_calls> -> '<' + DSML + tool_calls> */
        const char *s = u8"<\uff5cDSML\uff5ctool_calls>";
        int64_t n = tok(t, s, strlen(s), (ds4_pretok)mode, true, got, 64);
        int64_t nt = tok(t, "tool_calls>", 11, (ds4_pretok)mode, false, tail, 64);
        want[0] = BYTE_ID('<');
        want[1] = dsml;
        CHECK(nt > 0 && nt <= 60);
        if (nt > 0 && nt <= 60) {
            memcpy(want + 2, tail, (size_t)nt * sizeof *tail);
            CHECK(ids_eq(got, n, want, nt + 2));
        }
        /* </｜DSML｜parameter> starts with the ids of "</" then DSML */
        s = u8"</\uff5cDSML\uff5cparameter>";
        n = tok(t, s, strlen(s), (ds4_pretok)mode, true, got, 64);
        CHECK(n >= 3 && got[0] == BYTE_ID('<') && got[1] == BYTE_ID('/') && got[2] == dsml);
        /* All seven, adjacent, at both ends; BPE never crosses one. */
        s = u8"<\uff5cbegin\u2581of\u2581sentence\uff5c><\uff5cUser\uff5c>ab<\uff5cAssistant\uff5c><think>"
            u8"a</think>b<\uff5cend\u2581of\u2581sentence\uff5c>";
        n = tok(t, s, strlen(s), (ds4_pretok)mode, true, got, 64);
        const int32_t seq[] = { 0, extra_id(u8"<\uff5cUser\uff5c>"), extra_id("ab"), extra_id(u8"<\uff5cAssistant\uff5c>"),
                                extra_id("<think>"), BYTE_ID('a'), extra_id("</think>"), BYTE_ID('b'), 1 };
        CHECK(ids_eq(got, n, seq, 9));
        /* Without specials the same text is plain bytes: no special id appears. */
        n = tok(t, s, strlen(s), (ds4_pretok)mode, false, got, 64);
        CHECK(n > 9);
        for (int64_t i = 0; i < n && i < 64; i++) CHECK(got[i] != 0 && got[i] != 1 && got[i] != dsml);
        /* Look-alikes are not special. */
        s = u8"<\uff5cUser|><think <|User|>\uff5cDSML";
        n = tok(t, s, strlen(s), (ds4_pretok)mode, true, got, 64);
        for (int64_t i = 0; i < n && i < 64; i++) CHECK(got[i] >= 2 && got[i] < 258 + 9);
    }
    ds4_tokenizer_free(t);
}

/* Each rule of spec 5.2 with golden pieces. */
static void test_ds4_scanner_rules(void) {
    ds4_tokenizer *t = small_vocab();
    CHECK(t);
    if (!t) return;
    /* 1: up to three ASCII digits */
    CHECK_STR(DS4_SPLIT(t, "12345"), "123|45|");
    CHECK_STR(DS4_SPLIT(t, "a1234b"), "a|123|4|b|");
    /* 2: CJK / kana runs */
    CHECK_STR(DS4_SPLIT(t, u8"中文テストab"), u8"中文テスト|ab|");
    CHECK_STR(DS4_SPLIT(t, u8"ひらがな、"), u8"ひらがな|、|");
    /* 3: punct + ASCII letters */
    CHECK_STR(DS4_SPLIT(t, "(abc.def's"), "(abc|.def|'s|");
    /* 4: letter-like runs: any byte >= 0x80 counts, so runs swallow CJK,
     * non-ASCII punctuation and symbols */
    CHECK_STR(DS4_SPLIT(t, u8"naïve"), u8"naïve|");
    CHECK_STR(DS4_SPLIT(t, u8"abc中文"), u8"abc中文|");
    CHECK_STR(DS4_SPLIT(t, u8"x—y“z”👍"), u8"x—y“z”👍|");
    /* 5: a non-newline, non-punct byte + a letter-like run */
    CHECK_STR(DS4_SPLIT(t, " word\tword"), " word|\tword|");
    CHECK_STR(DS4_SPLIT(t, u8"a 中文"), u8"a| 中文|");
    CHECK_STR(DS4_SPLIT(t, "\x01" "abc"), "\x01" "abc|");
    /* 6: space + punct run + newlines */
    CHECK_STR(DS4_SPLIT(t, "a ((\n\nx"), "a| ((\n\n|x|");
    /* 7: punct run + newlines */
    CHECK_STR(DS4_SPLIT(t, ">;\n}"), ">;\n|}|");
    CHECK_STR(DS4_SPLIT(t, "...\r\n"), "...\r\n|");
    /* 8: whitespace runs */
    CHECK_STR(DS4_SPLIT(t, "    int"), "   | int|");
    CHECK_STR(DS4_SPLIT(t, "a \n\n  b"), "a| \n\n| | b|");
    CHECK_STR(DS4_SPLIT(t, "x   "), "x|   |");
    CHECK_STR(DS4_SPLIT(t, "  1"), "  |1|");
    CHECK_STR(DS4_SPLIT(t, "  ("), " | (|");
    CHECK_STR(DS4_SPLIT(t, "\t\t("), "\t|\t|(|");
    /* 9: anything else, one character */
    CHECK_STR(DS4_SPLIT(t, "\x01\x02"), "\x01|\x02|");
    /* Bytes: a lead byte claims its length unchecked; a cut one is 1 byte. */
    CHECK_STR(DS4_SPLIT(t, "\xE2 x!"), "\xE2 x|!|");
    CHECK_STR(DS4_SPLIT(t, "a\xE4"), "a\xE4|");
    CHECK_STR(DS4_SPLIT(t, "\xFF\xFE"), "\xFF\xFE|");
    /* A NUL is an ordinary byte (ds4 itself stops at it). */
    CHECK(split_is(t, DS4_PRETOK_DS4, "a\0b", 3, "a|\0b|", 5));
    ds4_tokenizer_free(t);
}

/* The official split, including the places where it differs from ds4. */
static void test_official_split(void) {
    ds4_tokenizer *t = small_vocab();
    CHECK(t);
    if (!t) return;
    CHECK_STR(OFF_SPLIT(t, "Hello world"), "Hello| world|");
    CHECK_STR(OFF_SPLIT(t, "12345"), "123|45|");
    CHECK_STR(OFF_SPLIT(t, "    int"), "   | int|");
    CHECK_STR(OFF_SPLIT(t, "a \n\n  b"), "a| \n\n| | b|");
    CHECK_STR(OFF_SPLIT(t, ">;\n}"), ">;\n|}|");
    CHECK_STR(OFF_SPLIT(t, "(abc.def's"), "(abc|.def|'s|");
    CHECK_STR(OFF_SPLIT(t, u8"abc中文"), u8"abc|中文|");           /* CJK isolated first */
    CHECK_STR(OFF_SPLIT(t, u8"a 中文"), u8"a| |中文|");
    CHECK_STR(OFF_SPLIT(t, u8"x—y👍"), u8"x|—|y|👍|");             /* \p{P}, \p{S} */
    CHECK_STR(OFF_SPLIT(t, u8"x²½١٢٣٤"), u8"x|²½١|٢٣٤|");          /* \p{N} */
    CHECK_STR(OFF_SPLIT(t, u8"a\u00a0b"), u8"a|\u00a0b|");
    CHECK_STR(OFF_SPLIT(t, "\x01\x02"), "\x01\x02|");               /* one unmatched stretch */
    /* Invalid UTF-8 splits like U+FFFD (a symbol) but keeps its bytes. */
    CHECK_STR(OFF_SPLIT(t, "a\xFF" "b"), "a|\xFF|b|");
    CHECK_STR(OFF_SPLIT(t, "\xFF\xFE!x"), "\xFF\xFE!|x|");
    CHECK_STR(OFF_SPLIT(t, "x\xE2\x82 y"), "x|\xE2\x82| y|");     /* one maximal subpart */
    CHECK_STR(OFF_SPLIT(t, "x\xE2\x82"), "x|\xE2\x82|");
    CHECK_STR(OFF_SPLIT(t, "\xED\xA0\x80z"), "\xED\xA0\x80|z|");  /* surrogate: three subparts */
    CHECK(split_is(t, DS4_PRETOK_OFFICIAL, "a\0b", 3, "a|\0b|", 5));
    ds4_tokenizer_free(t);
}

static void test_bpe_merges(void) {
    ds4_tokenizer *t = small_vocab();
    CHECK(t);
    if (!t) return;
    /* "b c" outranks "a b" */
    const int32_t abc[] = { BYTE_ID('a'), extra_id("bc") }, ab[] = { extra_id("ab") };
    CHECK(expect_ids(t, "abc", abc, 2));
    CHECK(expect_ids(t, "ab", ab, 1));
    /* equal ranks: leftmost first */
    const int32_t xxx[] = { extra_id("xx"), BYTE_ID('x') };
    CHECK(expect_ids(t, "xxx", xxx, 2));
    /* chained merges across ranks: Ġ t, h e, then Ġt he */
    const int32_t the[] = { extra_id("\xC4\xA0the") }, a7[] = { extra_id("aaaa"), extra_id("aa"), BYTE_ID('a') };
    CHECK(expect_ids(t, " the", the, 1));
    CHECK(expect_ids(t, "aaaaaaa", a7, 3));
    /* "qz" is a merge result outside the vocabulary: ds4 emits the tokens of
     * its single bytes */
    const int32_t qz[] = { BYTE_ID('q'), BYTE_ID('z') };
    CHECK(expect_ids(t, "qz", qz, 2));
    int64_t n;
    /* Long pieces stay fast (heap merge) and exact: 2^16 + 3 letters. */
    size_t len = (1u << 16) + 3;
    char *s = malloc(len);
    memset(s, 'a', len);
    int32_t *ids;
    ds4_error err = { 0 };
    CHECK(ds4_tokenize(t, s, len, DS4_PRETOK_DS4, false, &ids, &n, &err) == DS4_OK);
    CHECK_EQ_INT(n, (1 << 14) + 2);
    if (n == (1 << 14) + 2) {
        CHECK(ids[0] == extra_id("aaaa") && ids[n - 2] == extra_id("aa") && ids[n - 1] == BYTE_ID('a'));
    }
    free(ids);
    CHECK(ds4_tokenize(t, s, len, DS4_PRETOK_OFFICIAL, false, &ids, &n, &err) == DS4_OK);
    CHECK_EQ_INT(n, (1 << 14) + 2);
    free(ids);
    /* Long whitespace, digit and punctuation runs through PCRE2. */
    const char fill[] = { ' ', '7', '!', '\n' };
    for (int k = 0; k < 4; k++) {
        memset(s, fill[k], len);
        CHECK(ds4_tokenize(t, s, len, DS4_PRETOK_OFFICIAL, false, &ids, &n, &err) == DS4_OK);
        CHECK(n > 0);
        free(ids);
    }
    free(s);
    /* Empty input. */
    CHECK(ds4_tokenize(t, "", 0, DS4_PRETOK_OFFICIAL, true, &ids, &n, &err) == DS4_OK && n == 0 && ids == NULL);
    ds4_tokenizer_free(t);
}

/* Random bytes (mostly valid UTF-8 from a mixed alphabet, some junk) survive
 * tokenize -> raw decode exactly, in every mode. */
static void test_round_trip(void) {
    ds4_tokenizer *t = small_vocab();
    CHECK(t);
    if (!t) return;
    static const char *const alphabet[] = {
        "a", "b", "c", "x", "q", "z", "h", "e", " ", "  ", "\t", "\n", "\r\n", "1", "23", "(", ">", ";", ".",
        u8"é", u8"中", u8"テ", u8"—", u8"👍", u8"\u200d", u8"\u00a0", u8"١", "\x01", "\x7f", "\xFF", "\xE2\x82",
        "\xC3", u8"<\uff5cUser\uff5c>", "<think>", u8"\uff5cDSML\uff5c",
    };
    const int n_alpha = (int)(sizeof alphabet / sizeof alphabet[0]);
    char text[512], back[4096];
    for (int iter = 0; iter < 2000; iter++) {
        size_t len = 0;
        int parts = (int)(test_rand_u64() % 40);
        for (int p = 0; p < parts; p++) {
            const char *a = alphabet[test_rand_u64() % (uint64_t)n_alpha];
            size_t l = strlen(a);
            if (len + l >= sizeof text) break;
            memcpy(text + len, a, l);
            len += l;
        }
        for (int mode = 0; mode < 4; mode++) {
            int32_t *ids;
            int64_t n;
            ds4_error err = { 0 };
            if (ds4_tokenize(t, text, len, (ds4_pretok)(mode & 1), mode >> 1, &ids, &n, &err)) {
                CHECK_MSG(0, "tokenize failed: %s", err.message);
                continue;
            }
            size_t w = raw_decode(t, ids, n, back, sizeof back);
            CHECK_MSG(w == len && !memcmp(back, text, len), "mode %d, %zu bytes", mode, len);
            free(ids);
        }
    }
    ds4_tokenizer_free(t);
}

static size_t detok_all(const ds4_tokenizer *t, const int32_t *ids, int n, char *out, size_t *per_step) {
    ds4_detok d;
    ds4_detok_init(&d, t);
    size_t w = 0;
    for (int i = 0; i < n; i++) {
        size_t k = ds4_detok_push(&d, ids[i], out + w);
        if (per_step) per_step[i] = k;
        w += k;
    }
    return w + ds4_detok_flush(&d, out + w);
}

static void test_stream_decoder(void) {
    ds4_tokenizer *t = small_vocab();
    CHECK(t);
    if (!t) return;
    CHECK(ds4_detok_bound(t) >= 3 * (ds4_tokenizer_max_token_bytes(t) + 3));
    char out[256];
    size_t step[16];
    /* 👩‍👩 split into single-byte tokens: nothing comes out mid-character. */
    const char *emoji = u8"👩\u200d👩";
    int32_t ids[16];
    int n = (int)strlen(emoji);
    for (int i = 0; i < n; i++) ids[i] = BYTE_ID((unsigned char)emoji[i]);
    size_t w = detok_all(t, ids, n, out, step);
    CHECK(w == (size_t)n && !memcmp(out, emoji, (size_t)n));
    const size_t want_steps[11] = { 0, 0, 0, 4, 0, 0, 3, 0, 0, 0, 4 };
    for (int i = 0; i < n; i++) CHECK_EQ_INT(step[i], want_steps[i]);
    /* Invalid sequences: one U+FFFD per maximal subpart, as a lossy decoder. */
    struct { const char *in; const char *want; } cases[] = {
        { "\xF0\x9F" "A", "\xEF\xBF\xBD" "A" },
        { "\xF0\x9F", "\xEF\xBF\xBD" },                       /* flushed at the end */
        { "\xFF\xFE", "\xEF\xBF\xBD\xEF\xBF\xBD" },
        { "\xE0\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD" }, /* overlong */
        { "\xED\xA0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD" }, /* surrogate */
        { "\xE2\x82\xE2\x82\xAC", "\xEF\xBF\xBD\xE2\x82\xAC" },
        { "a\xC3", "a\xEF\xBF\xBD" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        n = (int)strlen(cases[c].in);
        for (int i = 0; i < n; i++) ids[i] = BYTE_ID((unsigned char)cases[c].in[i]);
        w = detok_all(t, ids, n, out, NULL);
        CHECK_MSG(w == strlen(cases[c].want) && !memcmp(out, cases[c].want, w), "case %zu", c);
    }
    /* Out-of-range ids decode to nothing; specials verbatim. */
    ids[0] = -7;
    ids[1] = 1 << 30;
    ids[2] = ds4_tokenizer_special(t, DS4_SPECIAL_USER);
    w = detok_all(t, ids, 3, out, NULL);
    CHECK(w == strlen(u8"<\uff5cUser\uff5c>") && !memcmp(out, u8"<\uff5cUser\uff5c>", w));
    /* Random byte tokens: the output is always valid UTF-8 and, for valid input, the input. */
    for (int iter = 0; iter < 2000; iter++) {
        int32_t r[16];
        char in[16];
        n = 1 + (int)(test_rand_u64() % 16);
        for (int i = 0; i < n; i++) {
            static const unsigned char pool[] = { 'a', 0x80, 0x9F, 0xBF, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98,
                                                  0x80, 0xED, 0xF4, 0x90, 0xFF, 0xC0 };
            in[i] = (char)pool[test_rand_u64() % sizeof pool];
            r[i] = BYTE_ID((unsigned char)in[i]);
        }
        w = detok_all(t, r, n, out, NULL);
        CHECK(valid_utf8(out, w));
        if (valid_utf8(in, (size_t)n)) CHECK(w == (size_t)n && !memcmp(out, in, w));
    }
    ds4_tokenizer_free(t);
}

static void test_load_errors(void) {
    char path[256];
    snprintf(path, sizeof path, "/tmp/ds4_test_tok_err_%d.gguf", (int)getpid());
    ds4_tokenizer *t = NULL;
    ds4_error err = { 0 };
    CHECK(write_vocab(path, u8"<\uff5cUser\uff5c>", NULL, "gpt2") == 0);
    CHECK(load_path(path, &t, &err) == DS4_ERR_FORMAT && !t);
    CHECK_MSG(strstr(err.message, u8"<\uff5cUser\uff5c>") != NULL, "%s", err.message);
    CHECK(write_vocab(path, u8"\uff5cDSML\uff5c", NULL, "gpt2") == 0);
    CHECK(load_path(path, &t, &err) == DS4_ERR_FORMAT && strstr(err.message, u8"\uff5cDSML\uff5c"));
    CHECK(write_vocab(path, NULL, "merges", "gpt2") == 0);
    CHECK(load_path(path, &t, &err) == DS4_ERR_NOT_FOUND && strstr(err.message, "tokenizer.ggml.merges"));
    CHECK(write_vocab(path, NULL, "tokens", "gpt2") == 0);
    CHECK(load_path(path, &t, &err) == DS4_ERR_NOT_FOUND && strstr(err.message, "tokenizer.ggml.tokens"));
    CHECK(write_vocab(path, NULL, "types", "gpt2") == 0);
    CHECK(load_path(path, &t, &err) == DS4_ERR_FORMAT && strstr(err.message, "token_type"));
    CHECK(write_vocab(path, NULL, NULL, "llama") == 0);
    CHECK(load_path(path, &t, &err) == DS4_ERR_UNSUPPORTED && strstr(err.message, "gpt2"));
    unlink(path);
    /* A shared string: the later id wins (as ds4's table and HF's JSON vocab). */
    ds4_strref toks[9];
    for (int s = 0; s < DS4_SPECIAL_COUNT; s++) toks[s] = (ds4_strref){ ds4_special_text((ds4_special)s), strlen(ds4_special_text((ds4_special)s)) };
    toks[7] = (ds4_strref){ "a", 1 };
    toks[8] = (ds4_strref){ "a", 1 };
    CHECK(ds4_tokenizer_build(toks, 9, NULL, NULL, 0, &t, &err) == DS4_OK);
    if (t) {
        int32_t ids[4];
        CHECK_EQ_INT(tok(t, "a", 1, DS4_PRETOK_OFFICIAL, false, ids, 4), 1);
        CHECK_EQ_INT(ids[0], 8);
        /* bytes with no token are dropped by ds4's fallback */
        CHECK_EQ_INT(tok(t, "b ", 2, DS4_PRETOK_OFFICIAL, false, ids, 4), 0);
        ds4_tokenizer_free(t);
    }
    CHECK(ds4_tokenizer_build(toks, 0, NULL, NULL, 0, &t, &err) == DS4_ERR_INVALID);
}

/* Golden ids from Hugging Face tokenizers on the real vocabulary. */
static void test_real_vocab(void) {
    const char *path = getenv("DS4_TOKENIZER_GGUF");
    if (!path || !*path) TEST_SKIP("DS4_TOKENIZER_GGUF is not set (the Python oracle test covers the real vocabulary)");
    ds4_tokenizer *t = NULL;
    ds4_error err = { 0 };
    if (load_path(path, &t, &err)) {
        CHECK_MSG(0, "%s: %s", path, err.message);
        return;
    }
    CHECK_EQ_INT(ds4_tokenizer_n_vocab(t), 129280);
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_BOS), 0);
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_EOS), 1);
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_USER), 128803);
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_ASSISTANT), 128804);
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_THINK), 128821);
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_THINK_END), 128822);
    CHECK_EQ_INT(ds4_tokenizer_special(t, DS4_SPECIAL_DSML), 128825);
    static const struct { const char *text; bool specials; int n; int32_t ids[12]; } golden[] = {
        { "Hello world", false, 2, { 19923, 2058 } },
        { "    int main(void) {\n\treturn 0;\n}\n", false, 11, { 361, 688, 1840, 40374, 11, 875, 5562, 223, 18, 510, 1778 } },
        { u8"naïve café 中文テスト 12345", false, 9, { 2720, 91223, 57664, 223, 21134, 109288, 223, 6895, 1883 } },
        { u8"Привет 👩\u200d👩\u200d👧!", false, 11, { 24797, 8919, 52780, 105, 46088, 25730, 105, 46088, 25730, 103, 3 } },
        { u8"<\uff5cUser\uff5c>hi<\uff5cAssistant\uff5c></think>", true, 4, { 128803, 6366, 128804, 128822 } },
        { u8"<\uff5cDSML\uff5ctool_calls>", true, 6, { 30, 128825, 72461, 4941, 12548, 32 } },
    };
    for (size_t g = 0; g < sizeof golden / sizeof golden[0]; g++) {
        int32_t got[64];
        int64_t n = tok(t, golden[g].text, strlen(golden[g].text), DS4_PRETOK_OFFICIAL, golden[g].specials, got, 64);
        CHECK_MSG(ids_eq(got, n, golden[g].ids, golden[g].n), "golden %zu", g);
    }
    /* 😀 = [28927, 225]: the first token ends mid-character. */
    const int32_t smile[2] = { 28927, 225 };
    char out[64];
    size_t step[2];
    size_t w = detok_all(t, smile, 2, out, step);
    CHECK(step[0] == 0 && step[1] == 4 && w == 4 && !memcmp(out, u8"😀", 4));
    ds4_tokenizer_free(t);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_byte_mapping),   TEST_ENTRY(test_special_tokens),  TEST_ENTRY(test_rendered_chat),
    TEST_ENTRY(test_ds4_scanner_rules), TEST_ENTRY(test_official_split), TEST_ENTRY(test_bpe_merges),
    TEST_ENTRY(test_round_trip),     TEST_ENTRY(test_stream_decoder),  TEST_ENTRY(test_load_errors),
    TEST_ENTRY(test_real_vocab),     { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

/*
 * pretok.c - the pre-tokenizers: DeepSeek's official regex split (PCRE2) and
 * ds4's ASCII-centred scanner. Both cut a byte string into pieces that tile
 * it; the BPE (tokenizer.c) then encodes each piece on its own.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "text/pretok.h"
#include "text/unicode_new.inc"

/* ------------------------------------------------------------------ UTF-8 */

int text_utf8_next(const unsigned char *s, size_t n, size_t *adv) {
    unsigned char c = s[0];
    size_t need;
    unsigned char lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c < 0x80) { *adv = 1; return UTF8_CHAR; }
    if (c >= 0xC2 && c <= 0xDF) need = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0) lo = 0xA0;      /* no overlong forms */
        else if (c == 0xED) hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0) lo = 0x90;      /* no overlong forms */
        else if (c == 0xF4) hi = 0x8F; /* nothing above U+10FFFF */
    } else {
        *adv = 1; /* 0x80..0xC1 and 0xF5..0xFF never start a character */
        return UTF8_BAD;
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= n) { *adv = n; return UTF8_SHORT; }
        unsigned char b = s[i];
        if (b < (i == 1 ? lo : 0x80) || b > (i == 1 ? hi : 0xBF)) { *adv = i; return UTF8_BAD; }
    }
    *adv = need;
    return UTF8_CHAR;
}

/* ------------------------------------------------------------------ official
 * tokenizer.json's pre_tokenizer is a Sequence of three Split(Isolated)
 * regexes and a ByteLevel step without regex (the byte mapping, done by the
 * BPE). Each Split runs on every piece the previous one produced, with that
 * piece alone as the subject (so a lookahead never sees past the piece), and
 * emits both the matches and the non-empty stretches between them.
 * The literal CR and LF in the third pattern are real control characters,
 * as in the JSON. */
const char *const ds4_pretok_official_patterns[] = {
    "\\p{N}{1,3}",
    u8"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
    "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*"
    "|\\s*[\r\n]+"
    "|\\s+(?!\\S)"
    "|\\s+",
    NULL,
};
#define N_STAGES 3

struct pretok_regex {
    pcre2_code *code[N_STAGES];
};

/* Unicode versions. Hugging Face `tokenizers` (0.22, Oniguruma 6.9.10) classifies with
 * Unicode 16.0; the PCRE2 of Debian 12 and Ubuntu 24.04 (10.42) has Unicode 14.0. So
 * each \p{X} of the patterns (X one of L M N P S) is compiled as the union of \p{X}
 * and the code points that 16.0 added to class X (unicode_new.inc); no assigned code
 * point changed class between the two, so the union is exact with PCRE2's 14.0 to
 * 16.0 tables. A PCRE2 with Unicode tables newer than 16.0 would put the code points
 * assigned after 16.0 in their classes, where Hugging Face does not.
 * Likewise \s: PCRE2's (with UCP) also matches U+180E, Oniguruma's is exactly the
 * White_Space property, spelled out here; \S outside a class is its complement. */
#define WHITE_SPACE "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"

static const char *new_in_class(char x) {
    switch (x) {
    case 'L': return UNICODE_NEW_L;
    case 'M': return UNICODE_NEW_M;
    case 'N': return UNICODE_NEW_N;
    case 'P': return UNICODE_NEW_P;
    case 'S': return UNICODE_NEW_S;
    default: return NULL;
    }
}

/* The pattern with \p{X} and \s widened as above (malloc'd; NULL when out of memory). */
static char *widen_pattern(const char *pat) {
    size_t cap = strlen(pat) + 1;
    for (const char *p = pat; *p; p++)
        cap += sizeof WHITE_SPACE + 3 + (p[0] == '\\' && p[1] == 'p' && p[2] == '{' && p[3] && new_in_class(p[3])
                                            ? strlen(new_in_class(p[3])) : 0);
    char *out = malloc(cap), *o = out;
    bool in_class = false;
    while (out && *pat) {
        if (pat[0] == '\\' && (pat[1] == 's' || (pat[1] == 'S' && !in_class))) {
            o += sprintf(o, "%s%s%s", in_class ? "" : pat[1] == 's' ? "[" : "[^", WHITE_SPACE, in_class ? "" : "]");
            pat += 2;
        } else if (pat[0] == '\\' && pat[1] == 'p' && pat[2] == '{' && pat[3] && pat[4] == '}' && new_in_class(pat[3])) {
            const char *extra = new_in_class(pat[3]);
            o += sprintf(o, "%s%.5s%s%s", in_class ? "" : "[", pat, extra, in_class ? "" : "]");
            pat += 5;
        } else if (pat[0] == '\\' && pat[1]) {
            *o++ = *pat++;
            *o++ = *pat++;
        } else {
            if (*pat == '[') in_class = true;
            else if (*pat == ']') in_class = false;
            *o++ = *pat++;
        }
    }
    if (out) *o = 0;
    return out;
}

void pretok_regex_free(pretok_regex *r) {
    if (!r) return;
    for (int i = 0; i < N_STAGES; i++) pcre2_code_free(r->code[i]);
    free(r);
}

ds4_status pretok_regex_new(pretok_regex **out, ds4_error *err) {
    *out = NULL;
    pretok_regex *r = calloc(1, sizeof *r);
    if (!r) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory compiling the pre-tokenizer");
    for (int i = 0; i < N_STAGES; i++) {
        int code = PCRE2_ERROR_NOMEMORY;
        PCRE2_SIZE off = 0;
        char *pat = widen_pattern(ds4_pretok_official_patterns[i]);
        if (pat)
            r->code[i] = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &code, &off, NULL);
        free(pat);
        if (!r->code[i]) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(code, msg, sizeof msg);
            pretok_regex_free(r);
            return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "pre-tokenizer regex %d: PCRE2 error at offset %zu: %s",
                                 i + 1, (size_t)off, (const char *)msg);
        }
        /* JIT is an optimisation: without it (not built in, or no executable
         * memory) pcre2_match interprets the same pattern. */
        (void)pcre2_jit_compile(r->code[i], PCRE2_JIT_COMPLETE);
    }
    *out = r;
    return DS4_OK;
}

/* A maximal invalid UTF-8 subpart of the input, stood in for by U+FFFD. */
typedef struct bad_span {
    size_t sub_pos;  /* where its U+FFFD starts in the substituted text */
    size_t orig_len; /* its length in the input (1..3) */
} bad_span;

typedef struct official_run {
    const pretok_regex *r;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit_stack; /* created when the JIT needs a larger stack */
    const char *sub;  /* the text the regexes see */
    const char *orig; /* the caller's text */
    const bad_span *bad;
    size_t n_bad, cursor, shrink; /* spans before `cursor` shrink offsets by `shrink` */
    ds4_piece_fn fn;
    void *ctx;
    ds4_status status; /* of a failed match */
} official_run;

/* Offset in the substituted text -> offset in the input (calls must come in
 * non-decreasing order; offsets are never inside a U+FFFD stand-in). */
static size_t map_offset(official_run *run, size_t pos) {
    while (run->cursor < run->n_bad && run->bad[run->cursor].sub_pos + 3 <= pos)
        run->shrink += 3 - run->bad[run->cursor++].orig_len;
    return pos - run->shrink;
}

static ds4_status emit_official(official_run *run, const char *s, size_t n, ds4_error *err) {
    size_t a = map_offset(run, (size_t)(s - run->sub));
    size_t b = map_offset(run, (size_t)(s - run->sub) + n);
    return run->fn(run->ctx, run->orig + a, b - a, err);
}

/* One pcre2_match; retries with a growing JIT stack when the default one is
 * too small. Returns >0 on a match, 0 on no match, <0 with err set. */
static int match_once(official_run *run, int stage, const char *s, size_t n, size_t start, size_t *ms, size_t *me,
                      ds4_error *err) {
    for (;;) {
        int rc = pcre2_match(run->r->code[stage], (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK, run->md, run->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) return 0;
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !run->jit_stack) {
            if (!(run->jit_stack = pcre2_jit_stack_create(64 << 10, 256 << 20, NULL))) break;
            pcre2_jit_stack_assign(run->mctx, NULL, run->jit_stack);
            continue;
        }
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(rc, msg, sizeof msg);
            run->status = ds4_error_set(err, rc == PCRE2_ERROR_NOMEMORY ? DS4_ERR_NOMEM : DS4_ERR_UNSUPPORTED,
                                        "pre-tokenizer regex %d failed on a %zu-byte piece: %s", stage + 1, n,
                                        (const char *)msg);
            return -1;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(run->md);
        *ms = ov[0];
        *me = ov[1];
        return 1;
    }
    run->status = ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for the regex JIT stack");
    return -1;
}

static ds4_status split_stage(official_run *run, int stage, const char *s, size_t n, ds4_error *err) {
    if (stage == N_STAGES) return emit_official(run, s, n, err);
    size_t pos = 0, ms, me;
    ds4_status st;
    while (pos < n) {
        int rc = match_once(run, stage, s, n, pos, &ms, &me, err);
        if (rc < 0) return run->status;
        if (rc == 0) break;
        if (me == ms) {
            if (ms >= n) break;
            /* None of the patterns can match empty; if one did, step a
             * character so the loop always ends. */
            size_t adv;
            text_utf8_next((const unsigned char *)s + me, n - me, &adv);
            if (ms > pos && (st = split_stage(run, stage + 1, s + pos, ms - pos, err))) return st;
            if ((st = split_stage(run, stage + 1, s + ms, adv, err))) return st;
            pos = ms + adv;
            continue;
        }
        if (ms > pos && (st = split_stage(run, stage + 1, s + pos, ms - pos, err))) return st;
        if ((st = split_stage(run, stage + 1, s + ms, me - ms, err))) return st;
        pos = me;
    }
    if (pos < n) return split_stage(run, stage + 1, s + pos, n - pos, err);
    return DS4_OK;
}

/* Make a valid UTF-8 copy with each maximal invalid subpart replaced by
 * U+FFFD, and the list of replacements. */
static ds4_status substitute_invalid(const char *text, size_t len, char **sub_out, size_t *sub_len,
                                     bad_span **bad_out, size_t *n_bad_out, ds4_error *err) {
    const unsigned char *s = (const unsigned char *)text;
    size_t n_bad = 0, adv;
    for (size_t i = 0; i < len; i += adv)
        if (text_utf8_next(s + i, len - i, &adv) != UTF8_CHAR) n_bad++;
    char *sub = malloc(len + 2 * n_bad + 1);
    bad_span *bad = malloc((n_bad ? n_bad : 1) * sizeof *bad);
    if (!sub || !bad) {
        free(sub);
        free(bad);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory scanning %zu bytes of text", len);
    }
    size_t o = 0, k = 0;
    for (size_t i = 0; i < len; i += adv) {
        if (text_utf8_next(s + i, len - i, &adv) == UTF8_CHAR) {
            memcpy(sub + o, s + i, adv);
            o += adv;
        } else {
            bad[k++] = (bad_span){ o, adv };
            memcpy(sub + o, "\xEF\xBF\xBD", 3);
            o += 3;
        }
    }
    *sub_out = sub;
    *sub_len = o;
    *bad_out = bad;
    *n_bad_out = n_bad;
    return DS4_OK;
}

static bool utf8_valid(const char *text, size_t len) {
    const unsigned char *s = (const unsigned char *)text;
    size_t i = 0, adv;
    while (i < len) {
        if (s[i] < 0x80) { i++; continue; }
        if (text_utf8_next(s + i, len - i, &adv) != UTF8_CHAR) return false;
        i += adv;
    }
    return true;
}

ds4_status pretok_official(const pretok_regex *r, const char *text, size_t len, ds4_piece_fn fn, void *ctx,
                           ds4_error *err) {
    if (len == 0) return DS4_OK;
    official_run run = { .r = r, .orig = text, .fn = fn, .ctx = ctx };
    char *sub = NULL;
    bad_span *bad = NULL;
    size_t sub_len = len;
    ds4_status st = DS4_OK;
    if (utf8_valid(text, len)) {
        run.sub = text;
    } else {
        if ((st = substitute_invalid(text, len, &sub, &sub_len, &bad, &run.n_bad, err))) return st;
        run.sub = sub;
        run.bad = bad;
    }
    /* The patterns backtrack at most linearly in a piece, so the default match
     * limit (10 million steps) would only refuse long but harmless inputs, e.g.
     * megabytes of spaces. */
    run.md = pcre2_match_data_create(1, NULL);
    run.mctx = pcre2_match_context_create(NULL);
    if (!run.md || !run.mctx) {
        st = ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for regex match data");
    } else {
        pcre2_set_match_limit(run.mctx, UINT32_MAX);
        pcre2_set_depth_limit(run.mctx, UINT32_MAX);
        pcre2_set_heap_limit(run.mctx, UINT32_MAX);
        st = split_stage(&run, 0, run.sub, sub_len, err);
    }
    pcre2_match_data_free(run.md);
    pcre2_match_context_free(run.mctx);
    pcre2_jit_stack_free(run.jit_stack);
    free(sub);
    free(bad);
    return st;
}

/* ------------------------------------------------------------------ ds4
 * ds4's scanner [ds4.c:bpe_tokenize_text], rule for rule (spec 5.2). It looks
 * at bytes: "punct" is ASCII punctuation/symbols, "letter-like" is an ASCII
 * letter or ANY byte >= 0x80, "space" is ASCII whitespace. A character's
 * length comes from its lead byte alone (cut to 1 byte at the end of the
 * text), with no check of the continuation bytes. */

static bool ds4_alpha(unsigned char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); }
static bool ds4_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static bool ds4_newline(unsigned char c) { return c == '\n' || c == '\r'; }
static bool ds4_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}
static bool ds4_punct(unsigned char c) {
    return (c >= '!' && c <= '/') || (c >= ':' && c <= '@') || (c >= '[' && c <= '`') || (c >= '{' && c <= '~');
}
static bool ds4_letter_like(unsigned char c) { return c >= 0x80 || ds4_alpha(c); }

/* Length the lead byte claims, cut to 1 when it would run past the end. */
static size_t ds4_char_len(const unsigned char *s, size_t len, size_t pos) {
    unsigned char c = s[pos];
    size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return pos + n > len ? 1 : n;
}

/* CJK U+4E00..9FA5, Hiragana U+3040..309F, Katakana U+30A0..30FF, decoding the
 * claimed sequence without validation (so only lead bytes E3/E4..E9 can hit). */
static bool ds4_cjk_at(const unsigned char *s, size_t len, size_t pos) {
    if (s[pos] < 0x80) return false;
    size_t n = ds4_char_len(s, len, pos);
    uint32_t cp;
    if (n == 1) cp = s[pos];
    else if (n == 2) cp = (uint32_t)(s[pos] & 0x1F) << 6 | (s[pos + 1] & 0x3Fu);
    else if (n == 3) cp = (uint32_t)(s[pos] & 0x0F) << 12 | (uint32_t)(s[pos + 1] & 0x3F) << 6 | (s[pos + 2] & 0x3Fu);
    else
        cp = (uint32_t)(s[pos] & 0x07) << 18 | (uint32_t)(s[pos + 1] & 0x3F) << 12 | (uint32_t)(s[pos + 2] & 0x3F) << 6 |
             (s[pos + 3] & 0x3Fu);
    return (cp >= 0x4E00 && cp <= 0x9FA5) || (cp >= 0x3040 && cp <= 0x309F) || (cp >= 0x30A0 && cp <= 0x30FF);
}

static size_t ds4_letters(const unsigned char *s, size_t len, size_t pos) {
    while (pos < len && ds4_letter_like(s[pos])) pos += ds4_char_len(s, len, pos);
    return pos;
}

ds4_status pretok_ds4(const char *text, size_t len, ds4_piece_fn fn, void *ctx, ds4_error *err) {
    const unsigned char *s = (const unsigned char *)text;
    size_t pos = 0;
    while (pos < len) {
        const size_t start = pos;
        const unsigned char c = s[pos];
        const bool has_next = pos + 1 < len;
        if (ds4_digit(c)) { /* 1: up to three ASCII digits */
            while (pos < len && pos - start < 3 && ds4_digit(s[pos])) pos++;
        } else if (ds4_cjk_at(s, len, pos)) { /* 2: a CJK / kana run */
            do pos += ds4_char_len(s, len, pos);
            while (pos < len && ds4_cjk_at(s, len, pos));
        } else if (ds4_punct(c) && has_next && ds4_alpha(s[pos + 1])) { /* 3: punct + ASCII letters */
            pos++;
            while (pos < len && ds4_alpha(s[pos])) pos++;
        } else if (ds4_letter_like(c)) { /* 4: letter-like run */
            pos = ds4_letters(s, len, pos);
        } else if (!ds4_newline(c) && !ds4_punct(c) && has_next && ds4_letter_like(s[pos + 1])) {
            pos = ds4_letters(s, len, pos + 1); /* 5: one other byte + letter-like run */
        } else if (c == ' ' && has_next && ds4_punct(s[pos + 1])) { /* 6: space + punct run + newlines */
            pos++;
            while (pos < len && ds4_punct(s[pos])) pos++;
            while (pos < len && ds4_newline(s[pos])) pos++;
        } else if (ds4_punct(c)) { /* 7: punct run + newlines */
            while (pos < len && ds4_punct(s[pos])) pos++;
            while (pos < len && ds4_newline(s[pos])) pos++;
        } else if (ds4_space(c)) { /* 8: whitespace run */
            size_t p = pos, after_newline = 0;
            while (p < len && ds4_space(s[p])) {
                if (ds4_newline(s[p])) after_newline = p + 1;
                p++;
            }
            if (after_newline) pos = after_newline;
            else if (p < len && p > pos + 1 && (ds4_letter_like(s[p]) || ds4_punct(s[p]))) pos = p - 1;
            else pos = p;
        } else { /* 9: one character */
            pos += ds4_char_len(s, len, pos);
        }
        if (pos == start) pos += ds4_char_len(s, len, pos);
        ds4_status st = fn(ctx, text + start, pos - start, err);
        if (st) return st;
    }
    return DS4_OK;
}

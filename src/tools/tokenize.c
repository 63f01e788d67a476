/*
 * tokenize.c - `ds4server tokenize`: text -> token ids, ids -> text.
 *
 *   ds4server tokenize -m FILE (--text T | --file F) [--json] [--pretokenizer official|ds4]
 *                      [--specials] [--pieces] [--bench N]
 *   ds4server tokenize -m FILE --decode 1,2,3 [--json] [--raw]
 *   ds4server tokenize -m FILE --batch F [...]       many texts, one output line each
 *   ds4server tokenize -m FILE --decode-batch F      many id lists, one output record each
 *   ds4server tokenize --patterns                    the official pre-tokenizer regexes (JSON)
 *
 * Output: ids separated by spaces (a JSON array with --json). --pieces prints
 * the pre-tokenizer's pieces instead: one per line, escaped for a terminal, or
 * with --json a JSON array of hex strings (exact bytes). --decode writes the
 * decoded bytes (valid UTF-8: see ds4_detok) or, with --json, a JSON string;
 * --raw writes the tokens' bytes unrepaired (ds4_token_bytes).
 * --bench N tokenizes the input N times and prints the speed.
 *
 * Batch files (for tests, to load the vocabulary once): --batch reads records
 * of [u32 little-endian length][bytes]; --decode-batch reads one id list per
 * line (spaces or commas) and writes records of [u32 LE length][bytes].
 */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/gguf.h"
#include "text/tokenizer.h"
#include "tools/tools.h"

static char *read_all(const char *path, size_t *len) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, fp);
        if (n < cap) break;
        char *p = realloc(buf, cap *= 2);
        if (!p) { free(buf); buf = NULL; }
        else buf = p;
    }
    if (buf && ferror(fp)) { free(buf); buf = NULL; }
    fclose(fp);
    *len = n;
    return buf;
}

/* Parse "1,2,3" or "1 2 3" (n bytes); false on anything else. */
static bool parse_ids(const char *s, size_t n, int32_t **ids, int64_t *count) {
    int64_t cap = 16, k = 0;
    int32_t *v = malloc((size_t)cap * sizeof *v);
    size_t i = 0;
    while (v && i < n) {
        if (s[i] == ',' || s[i] == ' ' || s[i] == '\t' || s[i] == '\r') { i++; continue; }
        if (s[i] < '0' || s[i] > '9') break;
        long long x = 0;
        while (i < n && s[i] >= '0' && s[i] <= '9' && x <= INT32_MAX) x = x * 10 + (s[i++] - '0');
        if (x > INT32_MAX) break;
        if (k == cap) {
            int32_t *p = realloc(v, (size_t)(cap *= 2) * sizeof *v);
            if (!p) break;
            v = p;
        }
        v[k++] = (int32_t)x;
    }
    if (!v || i < n) { free(v); return false; }
    *ids = v;
    *count = k;
    return true;
}

static void print_ids(const int32_t *ids, int64_t n, bool json) {
    if (json) putchar('[');
    for (int64_t i = 0; i < n; i++) printf(i ? (json ? ",%d" : " %d") : "%d", ids[i]);
    puts(json ? "]" : "");
}

typedef struct piece_out {
    bool json;
    int count;
} piece_out;

static ds4_status print_piece(void *ctx, const char *piece, size_t len, ds4_error *err) {
    piece_out *po = ctx;
    if (po->json) {
        fputs(po->count++ ? ",\"" : "\"", stdout);
        for (size_t i = 0; i < len; i++) printf("%02x", (unsigned char)piece[i]);
        putchar('"');
    } else {
        tool_text_escape(stdout, piece, len, len);
        putchar('\n');
    }
    return DS4_OK;
}

typedef struct opts {
    ds4_pretok mode;
    bool specials, json, pieces, raw;
} opts;

/* One text -> one output line (or piece list). */
static int tokenize_one(const ds4_tokenizer *t, const opts *o, const char *text, size_t len) {
    ds4_error err = { 0 };
    if (o->pieces) {
        piece_out po = { o->json, 0 };
        if (o->json) putchar('[');
        if (ds4_pretokenize(t, text, len, o->mode, print_piece, &po, &err))
            return tool_fail("tokenize", "%s", err.message);
        if (o->json) puts("]");
        return 0;
    }
    int32_t *ids;
    int64_t n;
    if (ds4_tokenize(t, text, len, o->mode, o->specials, &ids, &n, &err)) return tool_fail("tokenize", "%s", err.message);
    print_ids(ids, n, o->json);
    free(ids);
    return 0;
}

static int run_batch(const ds4_tokenizer *t, const opts *o, const char *path) {
    size_t len;
    char *buf = read_all(path, &len);
    if (!buf) return tool_fail("tokenize", "%s: %s", path, strerror(errno));
    int rc = 0;
    for (size_t pos = 0; pos < len && !rc;) {
        if (len - pos < 4) { rc = tool_fail("tokenize", "%s: truncated record header at byte %zu", path, pos); break; }
        const unsigned char *h = (const unsigned char *)buf + pos;
        size_t n = (size_t)h[0] | (size_t)h[1] << 8 | (size_t)h[2] << 16 | (size_t)h[3] << 24;
        pos += 4;
        if (n > len - pos) { rc = tool_fail("tokenize", "%s: record at byte %zu runs past the end", path, pos - 4); break; }
        rc = tokenize_one(t, o, buf + pos, n);
        pos += n;
    }
    free(buf);
    return rc;
}

/* Decode ids through the streaming decoder, one id at a time, or with raw
 * the tokens' bytes as they are (not necessarily UTF-8). */
static char *decode_ids(const ds4_tokenizer *t, const int32_t *ids, int64_t n, bool raw, size_t *out_len) {
    size_t bound = ds4_detok_bound(t), cap = bound * 2 + 64, w = 0;
    char *out = malloc(cap);
    ds4_detok d;
    ds4_detok_init(&d, t);
    for (int64_t i = 0; out && i <= n; i++) {
        if (w + bound > cap) {
            char *p = realloc(out, cap = cap * 2 + bound);
            if (!p) { free(out); return NULL; }
            out = p;
        }
        if (raw) w += i < n ? ds4_token_bytes(t, ids[i], out + w, cap - w) : 0;
        else w += i < n ? ds4_detok_push(&d, ids[i], out + w) : ds4_detok_flush(&d, out + w);
    }
    *out_len = w;
    return out;
}

static void put_record(const char *s, size_t n) {
    unsigned char h[4] = { (unsigned char)n, (unsigned char)(n >> 8), (unsigned char)(n >> 16), (unsigned char)(n >> 24) };
    fwrite(h, 1, 4, stdout);
    fwrite(s, 1, n, stdout);
}

static int run_decode_batch(const ds4_tokenizer *t, const char *path, bool raw) {
    size_t len;
    char *buf = read_all(path, &len);
    if (!buf) return tool_fail("tokenize", "%s: %s", path, strerror(errno));
    int rc = 0;
    for (size_t pos = 0; pos < len && !rc;) {
        const char *nl = memchr(buf + pos, '\n', len - pos);
        size_t end = nl ? (size_t)(nl - buf) : len;
        int32_t *ids = NULL;
        int64_t n;
        size_t out_len;
        char *text;
        if (!parse_ids(buf + pos, end - pos, &ids, &n)) rc = tool_fail("tokenize", "%s: bad id list at byte %zu", path, pos);
        else if (!(text = decode_ids(t, ids, n, raw, &out_len))) rc = tool_fail("tokenize", "out of memory");
        else {
            put_record(text, out_len);
            free(text);
        }
        free(ids);
        pos = end + 1;
    }
    free(buf);
    return rc;
}

static int run_bench(const ds4_tokenizer *t, const opts *o, const char *text, size_t len, int reps) {
    int64_t tokens = 0;
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        ds4_error err = { 0 };
        int32_t *ids;
        int64_t n;
        double t0 = tool_now();
        if (ds4_tokenize(t, text, len, o->mode, o->specials, &ids, &n, &err)) return tool_fail("tokenize", "%s", err.message);
        double dt = tool_now() - t0;
        if (dt < best) best = dt;
        tokens = n;
        free(ids);
    }
    printf("pretokenizer %-8s %10zu bytes %9lld tokens  best of %d: %8.3f ms  %7.2f MB/s  %10.0f tokens/s\n",
           o->mode == DS4_PRETOK_DS4 ? "ds4" : "official", len, (long long)tokens, reps, best * 1e3,
           (double)len / best / 1e6, (double)tokens / best);
    return 0;
}

static int usage(void) {
    printf("usage: ds4server tokenize -m FILE (--text T | --file F | --batch F) [--json]\n"
           "                          [--pretokenizer official|ds4] [--specials] [--pieces] [--bench N]\n"
           "       ds4server tokenize -m FILE (--decode 1,2,3 | --decode-batch F) [--json] [--raw]\n"
           "       ds4server tokenize --patterns\n");
    return 0;
}

int tool_tokenize(int argc, char **argv) {
    const char *model = NULL, *text = NULL, *file = NULL, *batch = NULL, *decode = NULL, *decode_batch = NULL;
    opts o = { DS4_PRETOK_OFFICIAL, false, false, false, false };
    int bench = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return usage();
        if (!strcmp(a, "--json")) { o.json = true; continue; }
        if (!strcmp(a, "--specials")) { o.specials = true; continue; }
        if (!strcmp(a, "--pieces")) { o.pieces = true; continue; }
        if (!strcmp(a, "--raw")) { o.raw = true; continue; }
        if (!strcmp(a, "--patterns")) {
            putchar('[');
            for (int k = 0; ds4_pretok_official_patterns[k]; k++) {
                fputs(k ? ",\"" : "\"", stdout);
                tool_json_escape(stdout, ds4_pretok_official_patterns[k], strlen(ds4_pretok_official_patterns[k]));
                putchar('"');
            }
            puts("]");
            return 0;
        }
        if (!v) return tool_fail("tokenize", "%s needs a value", a);
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--text")) text = v;
        else if (!strcmp(a, "--file")) file = v;
        else if (!strcmp(a, "--batch")) batch = v;
        else if (!strcmp(a, "--decode")) decode = v;
        else if (!strcmp(a, "--decode-batch")) decode_batch = v;
        else if (!strcmp(a, "--bench")) bench = atoi(v);
        else if (!strcmp(a, "--pretokenizer")) {
            if (!strcmp(v, "official")) o.mode = DS4_PRETOK_OFFICIAL;
            else if (!strcmp(v, "ds4")) o.mode = DS4_PRETOK_DS4;
            else return tool_fail("tokenize", "unknown --pretokenizer '%s' (official or ds4)", v);
        } else return tool_fail("tokenize", "unknown option '%s'", a);
        i++;
    }
    int inputs = !!text + !!file + !!batch + !!decode + !!decode_batch;
    if (!model || inputs != 1)
        return tool_fail("tokenize", "need -m FILE and exactly one of --text, --file, --batch, --decode, --decode-batch");
    if (bench < 0 || (bench && !text && !file)) return tool_fail("tokenize", "--bench N needs N > 0 and --text or --file");

    ds4_error err = { 0 };
    gguf_file *f = NULL;
    ds4_tokenizer *t = NULL;
    if (gguf_open(model, &f, &err) || ds4_tokenizer_load(f, &t, &err)) {
        gguf_close(f);
        return tool_fail("tokenize", "%s: %s", model, err.message);
    }
    gguf_close(f);

    int rc = 0;
    if (batch) rc = run_batch(t, &o, batch);
    else if (decode_batch) rc = run_decode_batch(t, decode_batch, o.raw);
    else if (decode) {
        int32_t *ids = NULL;
        int64_t n;
        size_t len;
        char *out;
        if (!parse_ids(decode, strlen(decode), &ids, &n)) rc = tool_fail("tokenize", "--decode: bad id list '%s'", decode);
        else if (!(out = decode_ids(t, ids, n, o.raw, &len))) rc = tool_fail("tokenize", "out of memory");
        else {
            if (o.json) {
                putchar('"');
                tool_json_escape(stdout, out, len);
                puts("\"");
            } else fwrite(out, 1, len, stdout);
            free(out);
        }
        free(ids);
    } else {
        size_t len = text ? strlen(text) : 0;
        char *buf = NULL;
        if (file && !(buf = read_all(file, &len))) rc = tool_fail("tokenize", "%s: %s", file, strerror(errno));
        else if (bench) rc = run_bench(t, &o, file ? buf : text, len, bench);
        else rc = tokenize_one(t, &o, file ? buf : text, len);
        free(buf);
    }
    ds4_tokenizer_free(t);
    if (fflush(stdout) != 0) rc = tool_fail("tokenize", "write failed");
    return rc;
}

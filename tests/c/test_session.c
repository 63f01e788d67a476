/* test_session.c - sessions: prefix reuse, rewind, context limits, checkpoints. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/error.h"
#include "core/gguf.h"
#include "core/quant.h"
#include "core/rounding.h"
#include "ds4.h"
#include "backends/backend.h"
#include "models/deepseek4/ds4_model.h"
#include "models/deepseek4/ds4_synth.h"
#include "session/engine.h"
#include "session/sampling.h"
#include "test.h"
#include "test_state.h"

static char model_a[256], model_b[256];
static ds4_engine *engine;
static int64_t vocab;

static bool setup(void) {
    if (engine) return true;
    snprintf(model_a, sizeof model_a, "/tmp/ds4_test_session_%d_a.gguf", (int)getpid());
    snprintf(model_b, sizeof model_b, "/tmp/ds4_test_session_%d_b.gguf", (int)getpid());
    ds4_error err = { 0 };
    if (ds4_synth_write(model_a, DS4_SCALE_TINY, DS4_QUANT_Q2, 5, NULL, false, &err) ||
        ds4_synth_write(model_b, DS4_SCALE_TINY, DS4_QUANT_Q2, 6, NULL, false, &err)) {
        fprintf(stderr, "synth: %s\n", err.message);
        return false;
    }
    ds4_engine_params p = { model_a, "cpu", 2, DS4_NUMERICS_MODE_DS4, NULL, NULL };
    if (ds4_engine_open(&p, &engine, &err)) {
        fprintf(stderr, "engine: %s\n", err.message);
        return false;
    }
    vocab = ds4_engine_vocab_size(engine);
    return true;
}

static int32_t *random_tokens(int64_t n) {
    int32_t *t = malloc((size_t)n * sizeof *t);
    for (int64_t i = 0; i < n; i++) t[i] = (int32_t)(test_rand_u64() % (uint64_t)vocab);
    return t;
}

static ds4_session *new_session(int64_t ctx) {
    ds4_session *s = NULL;
    ds4_error err = { 0 };
    CHECK_MSG(ds4_session_create(engine, ctx, &s, &err) == DS4_OK, "%s", err.message);
    return s;
}

static bool same_logits(const float *a, const float *b) { return a && b && memcmp(a, b, (size_t)vocab * 4) == 0; }

/* The engine's model file on a CPU backend of its own, through the model
 * API (NULL, with the failure checked and nothing left open, when it cannot
 * be loaded). */
static ds4_model *cpu_model(ds4_backend **cpu) {
    ds4_error err = { 0 };
    ds4_model *m = NULL;
    CHECK(ds4_backend_create("cpu", 2, cpu, &err) == DS4_OK);
    CHECK_MSG(*cpu && ds4_model_load((gguf_file *)ds4_engine_gguf(engine), *cpu, &m, &err) == DS4_OK, "%s",
              err.message);
    if (!m) {
        ds4_backend_destroy(*cpu);
        *cpu = NULL;
    }
    return m;
}

/* Prefill of a whole sequence equals prefill + token-by-token decode. */
static void test_decode_matches_prefill(void) {
    if (!setup()) { CHECK(0); return; }
    int32_t *t = random_tokens(150);
    ds4_session *a = new_session(512), *b = new_session(512);
    ds4_error err = { 0 };
    CHECK(ds4_session_sync(a, t, 150, NULL, &err) == DS4_OK);
    CHECK(ds4_session_sync(b, t, 40, NULL, &err) == DS4_OK);
    for (int i = 40; i < 150; i++) CHECK(ds4_session_decode(b, t[i], &err) == DS4_OK);
    CHECK(same_logits(ds4_session_logits(a), ds4_session_logits(b)));
    ds4_session_free(a);
    ds4_session_free(b);
    free(t);
}

static void test_prefix_reuse_and_rewind(void) {
    if (!setup()) { CHECK(0); return; }
    int32_t *t = random_tokens(200);
    ds4_session *s = new_session(512), *fresh = new_session(512);
    ds4_error err = { 0 };
    int64_t ev = -1;
    CHECK(ds4_session_sync(s, t, 60, &ev, &err) == DS4_OK && ev == 60);
    /* extension: only the suffix is evaluated */
    CHECK(ds4_session_sync(s, t, 100, &ev, &err) == DS4_OK && ev == 40);
    CHECK(ds4_session_sync(fresh, t, 100, NULL, &err) == DS4_OK);
    CHECK(same_logits(ds4_session_logits(s), ds4_session_logits(fresh)));
    /* same prompt again: nothing to do */
    CHECK(ds4_session_sync(s, t, 100, &ev, &err) == DS4_OK && ev == 0);
    /* generate, then regenerate differently: rewinds to the prompt snapshot */
    for (int i = 100; i < 130; i++) CHECK(ds4_session_decode(s, t[i], &err) == DS4_OK);
    int32_t *alt = malloc(140 * sizeof *alt);
    memcpy(alt, t, 100 * sizeof *alt);
    for (int i = 100; i < 140; i++) alt[i] = (t[i] + 1) % (int32_t)vocab;
    CHECK(ds4_session_sync(s, alt, 140, &ev, &err) == DS4_OK);
    CHECK_EQ_INT(ev, 40);
    ds4_session *fresh2 = new_session(512);
    CHECK(ds4_session_sync(fresh2, alt, 140, NULL, &err) == DS4_OK);
    CHECK(same_logits(ds4_session_logits(s), ds4_session_logits(fresh2)));
    /* diverging before the snapshot: evaluated from the start */
    alt[10] = (alt[10] + 1) % (int32_t)vocab;
    CHECK(ds4_session_sync(s, alt, 140, &ev, &err) == DS4_OK && ev == 140);
    /* a strict prefix of the history */
    CHECK(ds4_session_sync(s, alt, 120, &ev, &err) == DS4_OK);
    CHECK(ev == 120 || ev == 0);
    int64_t n;
    ds4_session_tokens(s, &n);
    CHECK_EQ_INT(n, 120);
    ds4_session_free(s);
    ds4_session_free(fresh);
    ds4_session_free(fresh2);
    free(alt);
    free(t);
}

static void test_context_limits(void) {
    if (!setup()) { CHECK(0); return; }
    int32_t *t = random_tokens(64);
    ds4_session *s = new_session(32);
    ds4_error err = { 0 };
    CHECK(ds4_session_sync(s, t, 32, NULL, &err) == DS4_ERR_INVALID);
    CHECK(strstr(err.message, "at most 31") != NULL);
    CHECK(ds4_session_sync(s, t, 31, NULL, &err) == DS4_OK);
    CHECK(ds4_session_decode(s, t[31], &err) == DS4_OK);
    CHECK(ds4_session_decode(s, t[32], &err) == DS4_ERR_INVALID);
    CHECK(strstr(err.message, "full") != NULL);
    int32_t bad = (int32_t)vocab;
    CHECK(ds4_session_sync(s, &bad, 1, NULL, &err) == DS4_ERR_INVALID);
    CHECK(ds4_session_sync(s, t, 0, NULL, &err) == DS4_ERR_INVALID);
    ds4_session *tiny = NULL;
    CHECK(ds4_session_create(engine, 1, &tiny, &err) == DS4_ERR_INVALID && tiny == NULL);
    ds4_session_free(s);
    free(t);
}

static char ckpt[256];

/* Save at several positions (inside and across compressor windows), restore
 * into a new session and continue: exactly the logits of never stopping. */
static void test_checkpoint_roundtrip(void) {
    if (!setup()) { CHECK(0); return; }
    snprintf(ckpt, sizeof ckpt, "/tmp/ds4_test_session_%d.ckpt", (int)getpid());
    int32_t *t = random_tokens(300);
    const int64_t points[] = { 1, 3, 4, 50, 127, 128, 129, 200 };
    ds4_error err = { 0 };
    for (size_t k = 0; k < sizeof points / sizeof points[0]; k++) {
        int64_t at = points[k];
        ds4_session *a = new_session(400), *b = new_session(400);
        CHECK(ds4_session_sync(a, t, at, NULL, &err) == DS4_OK);
        CHECK_MSG(ds4_session_save(a, ckpt, &err) == DS4_OK, "%s", err.message);
        CHECK_MSG(ds4_session_load(b, ckpt, &err) == DS4_OK, "at %lld: %s", (long long)at, err.message);
        CHECK(same_logits(ds4_session_logits(a), ds4_session_logits(b)));
        for (int64_t i = at; i < at + 70; i++) {
            CHECK(ds4_session_decode(a, t[i], &err) == DS4_OK);
            CHECK(ds4_session_decode(b, t[i], &err) == DS4_OK);
        }
        CHECK_MSG(same_logits(ds4_session_logits(a), ds4_session_logits(b)), "diverged after restoring at %lld",
                  (long long)at);
        /* the restored session also reuses the restored prefix */
        int64_t ev = -1;
        CHECK(ds4_session_sync(b, t, at + 71, &ev, &err) == DS4_OK && ev == 1);
        ds4_session_free(a);
        ds4_session_free(b);
    }
    unlink(ckpt);
    free(t);
}

static void write_bytes(const char *path, const uint8_t *p, size_t n) {
    FILE *fp = fopen(path, "wb");
    fwrite(p, 1, n, fp);
    fclose(fp);
}

static void test_checkpoint_damage(void) {
    if (!setup()) { CHECK(0); return; }
    snprintf(ckpt, sizeof ckpt, "/tmp/ds4_test_session_%d.ckpt", (int)getpid());
    int32_t *t = random_tokens(100);
    ds4_error err = { 0 };
    ds4_session *a = new_session(256), *b = new_session(256);
    CHECK(ds4_session_save(a, ckpt, &err) == DS4_ERR_INVALID); /* empty */
    CHECK(ds4_session_sync(a, t, 90, NULL, &err) == DS4_OK);
    CHECK(ds4_session_save(a, ckpt, &err) == DS4_OK);
    FILE *fp = fopen(ckpt, "rb");
    fseek(fp, 0, SEEK_END);
    size_t size = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *good = malloc(size), *bad = malloc(size + 16);
    CHECK(fread(good, 1, size, fp) == size);
    fclose(fp);
    /* b holds its own history; every failed load must leave it untouched */
    CHECK(ds4_session_sync(b, t + 5, 20, NULL, &err) == DS4_OK);
    float *before = malloc((size_t)vocab * 4);
    memcpy(before, ds4_session_logits(b), (size_t)vocab * 4);
    char damaged[300];
    snprintf(damaged, sizeof damaged, "%s.bad", ckpt);
    struct { const char *what; size_t len; size_t flip; const char *expect; } cases[] = {
        { "truncated", size - 100, SIZE_MAX, "truncated" },
        { "header only", 40, SIZE_MAX, "truncated" },
        { "tiny", 10, SIZE_MAX, "too short" },
        { "payload flip", size, size / 2, "corrupt" },
        { "last byte flip", size, size - 1, "corrupt" },
        { "header flip", size, 20, "corrupt" },
        { "magic", size, 0, "not a DS4Server checkpoint" },
        { "extended", size + 16, SIZE_MAX, "truncated or extended" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        memcpy(bad, good, size);
        memset(bad + size, 0, 16);
        if (cases[k].flip != SIZE_MAX) bad[cases[k].flip] ^= 0x40;
        write_bytes(damaged, bad, cases[k].len);
        err.message[0] = 0;
        CHECK_MSG(ds4_session_load(b, damaged, &err) != DS4_OK && strstr(err.message, cases[k].expect),
                  "%s: %s", cases[k].what, err.message);
        int64_t n;
        ds4_session_tokens(b, &n);
        CHECK_EQ_INT(n, 20);
        CHECK(same_logits(before, ds4_session_logits(b)));
    }
    /* another model's session */
    ds4_engine *other = NULL;
    ds4_engine_params p = { model_b, "cpu", 1, DS4_NUMERICS_MODE_DS4, NULL, NULL };
    CHECK(ds4_engine_open(&p, &other, &err) == DS4_OK);
    ds4_session *c = NULL;
    if (other && ds4_session_create(other, 256, &c, &err) == DS4_OK) {
        CHECK(ds4_session_load(c, ckpt, &err) == DS4_ERR_FORMAT);
        CHECK(strstr(err.message, "another model") != NULL);
    }
    /* a smaller context than the checkpoint needs */
    ds4_session *small = new_session(64);
    CHECK(ds4_session_load(small, ckpt, &err) == DS4_ERR_FORMAT);
    CHECK(strstr(err.message, "context") != NULL);
    CHECK(ds4_session_load(b, "/nonexistent/x.ckpt", &err) == DS4_ERR_IO);
    CHECK(ds4_session_save(a, "/nonexistent-dir/x.ckpt", &err) == DS4_ERR_IO);
    CHECK(strstr(err.message, "/nonexistent-dir/x.ckpt") != NULL);
    ds4_session_free(small);
    ds4_session_free(c);
    ds4_engine_close(other);
    ds4_session_free(a);
    ds4_session_free(b);
    unlink(ckpt);
    unlink(damaged);
    free(before);
    free(good);
    free(bad);
    free(t);
}

static void test_checkpoint_disk_full(void) {
    if (!setup()) { CHECK(0); return; }
    if (access("/dev/full", W_OK) != 0) TEST_SKIP("/dev/full not available");
    char path[256], tmp[300];
    snprintf(path, sizeof path, "/tmp/ds4_test_session_full_%d.ckpt", (int)getpid());
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    unlink(tmp);
    if (symlink("/dev/full", tmp) != 0) TEST_SKIP("cannot create symlink");
    int32_t *t = random_tokens(40);
    ds4_session *a = new_session(128);
    ds4_error err = { 0 };
    CHECK(ds4_session_sync(a, t, 40, NULL, &err) == DS4_OK);
    CHECK(ds4_session_save(a, path, &err) == DS4_ERR_IO);
    CHECK(strstr(err.message, "No space") != NULL);
    CHECK(access(path, F_OK) != 0);
    unlink(tmp);
    ds4_session_free(a);
    free(t);
}

typedef struct prefetch_log {
    int64_t calls, last, total;
    bool monotonic;
} prefetch_log;

static bool record_prefetch(void *ctx, int64_t done, int64_t total) {
    prefetch_log *log = ctx;
    log->monotonic &= done > log->last;
    log->last = done;
    log->total = total;
    log->calls++;
    return true;
}

static void test_prefetch_reads_the_whole_file(void) {
    if (!setup()) { CHECK(0); return; }
    prefetch_log log = { 0, 0, 0, true };
    ds4_engine_prefetch(engine, record_prefetch, &log);
    CHECK(log.calls >= 1 && log.monotonic);
    CHECK_EQ_INT(log.last, (int64_t)ds4_engine_gguf(engine)->size);
    CHECK_EQ_INT(log.total, (int64_t)ds4_engine_gguf(engine)->size);
}

/* A backend whose table lacks an op the model needs is refused at load,
 * and the error names the op (never a crash later, never a fallback). */
static void test_load_refuses_incomplete_backend(void) {
    if (!setup()) { CHECK(0); return; }
    ds4_error err = { 0 };
    ds4_backend *cpu = NULL;
    CHECK(ds4_backend_create("cpu", 1, &cpu, &err) == DS4_OK);
    if (!cpu) return;
    ds4_backend_ops partial = *cpu->ops;
    partial.moe = NULL;
    ds4_backend lacking = *cpu;
    lacking.ops = &partial;
    ds4_model *m = NULL;
    CHECK(ds4_model_load((gguf_file *)ds4_engine_gguf(engine), &lacking, &m, &err) == DS4_ERR_UNSUPPORTED);
    CHECK(m == NULL);
    CHECK_MSG(strstr(err.message, "moe") != NULL, "%s", err.message);
    /* the grouped product (attention output) is required too */
    partial = *cpu->ops;
    partial.matmul_grouped = NULL;
    CHECK(ds4_model_load((gguf_file *)ds4_engine_gguf(engine), &lacking, &m, &err) == DS4_ERR_UNSUPPORTED);
    CHECK(m == NULL);
    CHECK_MSG(strstr(err.message, "matmul_grouped") != NULL, "%s", err.message);
    /* and the per-head norm + RoPE (the path without an inspection hook) */
    partial = *cpu->ops;
    partial.head_norm_rope = NULL;
    CHECK(ds4_model_load((gguf_file *)ds4_engine_gguf(engine), &lacking, &m, &err) == DS4_ERR_UNSUPPORTED);
    CHECK(m == NULL);
    CHECK_MSG(strstr(err.message, "head_norm_rope") != NULL, "%s", err.message);
    ds4_backend_destroy(cpu);
}

/*
 * Batched decode: several states at different positions (inside and past
 * the sliding window, before and after compressor rows and indexer
 * selection) decode one token each in one call, and every row's logits are
 * those of a single-token decode of its state, bit for bit on the CPU.
 */
/* A prefill chunk's compressors in batched calls (compressor_chunk) leave
 * the same logits and the same state, byte for byte, as token by token:
 * chunks starting at, inside and just before window ends of both ratios,
 * chunks ending there, chunks spanning several windows of both, both
 * numerics. The same for the indexer's scores and selections made for
 * batches of rows (the tiny model selects from position 36 on). */
static void test_compressor_chunks_match(void) {
    if (!setup()) { CHECK(0); return; }
    ds4_error err = { 0 };
    ds4_backend *cpu = NULL;
    ds4_model *m = cpu_model(&cpu);
    if (!m) return;
    static const int64_t cases[][2] = { { 0, 2 },   { 0, 4 },   { 0, 9 },     { 3, 2 },   { 5, 7 },  { 2, 300 },
                                        { 126, 2 }, { 127, 1 }, { 127, 5 },   { 124, 136 }, { 0, 128 }, { 1, 259 },
                                        { 30, 20 }, { 36, 3 },  { 200, 140 } };
    int32_t *t = random_tokens(400);
    float *la = malloc((size_t)vocab * sizeof *la), *lb = malloc((size_t)vocab * sizeof *lb);
    for (int mode = 0; mode < 6; mode++) {
        const int num = mode & 1;
        /* 0, 1: compressor chunks on / off; 2, 3: indexer batches on / off; 4, 5: batches of at most 7 rows */
        const bool idx = mode >= 2;
        ds4_model_set_indexer_batches(m, mode >= 4 ? 7 : -1);
        const ds4_numerics nm = num ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            const int64_t pre = cases[c][0], n = cases[c][1];
            ds4_state *a = NULL, *b = NULL;
            CHECK(ds4_state_create(m, 512, &a, &err) == DS4_OK && ds4_state_create(m, 512, &b, &err) == DS4_OK);
            if (!a || !b) break;
            /* the same prefix token by token on both, then the chunk batched on a, per token on b */
            for (int64_t i = 0; i < pre; i++) {
                CHECK(ds4_model_eval(m, a, t + i, 1, nm, NULL, false, &err) == DS4_OK);
                CHECK(ds4_model_eval(m, b, t + i, 1, nm, NULL, false, &err) == DS4_OK);
            }
            CHECK(ds4_model_eval(m, a, t + pre, n, nm, la, false, &err) == DS4_OK);
            if (idx) ds4_model_set_indexer_batches(m, 0);
            else ds4_model_set_compressor_chunks(m, false);
            CHECK(ds4_model_eval(m, b, t + pre, n, nm, lb, false, &err) == DS4_OK);
            ds4_model_set_compressor_chunks(m, true);
            ds4_model_set_indexer_batches(m, mode >= 4 ? 7 : -1);
            CHECK_MSG(memcmp(la, lb, (size_t)vocab * sizeof *la) == 0, "%s, %s numerics, %lld tokens after %lld: logits",
                      idx ? "indexer" : "compressors", num ? "reference" : "ds4", (long long)n, (long long)pre);
            int64_t sa = 0, sb = 0;
            uint8_t *ba = test_state_bytes(a, t, pre + n, vocab, &sa);
            uint8_t *bb = test_state_bytes(b, t, pre + n, vocab, &sb);
            CHECK_MSG(ba && bb && sa == sb && memcmp(ba, bb, (size_t)sa) == 0,
                      "%s numerics, %lld tokens after %lld: the states differ", num ? "reference" : "ds4",
                      (long long)n, (long long)pre);
            /* and a decoded token after it */
            CHECK(ds4_model_eval(m, a, t + pre + n, 1, nm, la, false, &err) == DS4_OK);
            CHECK(ds4_model_eval(m, b, t + pre + n, 1, nm, lb, false, &err) == DS4_OK);
            CHECK(memcmp(la, lb, (size_t)vocab * sizeof *la) == 0);
            free(ba);
            free(bb);
            ds4_state_free(a);
            ds4_state_free(b);
        }
    }
    ds4_model_set_indexer_batches(m, -1);
    free(la);
    free(lb);
    free(t);
    ds4_model_free(m);
    ds4_backend_destroy(cpu);
}

/* $DS4_EVAL_CHUNK at model open: a row count sets the chunk; anything else
 * (not a number, trailing characters, 0, past DS4_EVAL_CHUNK_MAX) fails the
 * open with a message naming the variable; unset, the default. */
static void test_eval_chunk_env(void) {
    if (!setup()) { CHECK(0); return; }
    ds4_backend *cpu = NULL;
    static const char *bad[] = { "abc", "12x", "0", "-5", "65537" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("DS4_EVAL_CHUNK", bad[i], 1);
        ds4_error err = { 0 };
        ds4_model *m = NULL;
        CHECK(ds4_backend_create("cpu", 1, &cpu, &err) == DS4_OK);
        const ds4_status st = ds4_model_load((gguf_file *)ds4_engine_gguf(engine), cpu, &m, &err);
        CHECK_MSG(st == DS4_ERR_INVALID && !m && strstr(err.message, "DS4_EVAL_CHUNK"), "'%s': status %d, '%s'",
                  bad[i], (int)st, err.message);
        if (m) ds4_model_free(m);
        ds4_backend_destroy(cpu);
    }
    setenv("DS4_EVAL_CHUNK", "37", 1);
    ds4_model *m = cpu_model(&cpu);
    CHECK(m && ds4_model_eval_chunk(m) == 37);
    if (m) ds4_model_free(m);
    ds4_backend_destroy(cpu);
    unsetenv("DS4_EVAL_CHUNK");
    m = cpu_model(&cpu);
    CHECK(m && ds4_model_eval_chunk(m) == DS4_EVAL_CHUNK);
    if (m) ds4_model_free(m);
    ds4_backend_destroy(cpu);
}

/* The layer-major chunk size (ds4_model_set_eval_chunk) does not change
 * anything: 300 tokens in one call as one chunk (the default), in chunks of
 * 7, 128 and 256 (and one after a prefix), the same logits and the same
 * state byte for byte, both numerics. */
static void test_eval_chunk_sizes_match(void) {
    if (!setup()) { CHECK(0); return; }
    ds4_error err = { 0 };
    ds4_backend *cpu = NULL;
    ds4_model *m = cpu_model(&cpu);
    if (!m) return;
    CHECK(ds4_model_eval_chunk(m) == DS4_EVAL_CHUNK);
    enum { N = 300 };
    int32_t *t = random_tokens(N + 1);
    float *la = malloc((size_t)vocab * sizeof *la), *lb = malloc((size_t)vocab * sizeof *lb);
    static const int64_t chunks[] = { 7, 128, 256 };
    for (int num = 0; num < 2; num++) {
        const ds4_numerics nm = num ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
        ds4_state *a = NULL;
        CHECK(ds4_state_create(m, 512, &a, &err) == DS4_OK);
        if (!a) break;
        CHECK(ds4_model_eval(m, a, t, N, nm, la, false, &err) == DS4_OK);
        int64_t sa = 0;
        uint8_t *ba = test_state_bytes(a, t, N, vocab, &sa);
        for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
            ds4_state *b = NULL;
            CHECK(ds4_state_create(m, 512, &b, &err) == DS4_OK);
            if (!b) break;
            ds4_model_set_eval_chunk(m, chunks[c]);
            CHECK(ds4_model_eval_chunk(m) == chunks[c]);
            CHECK(ds4_model_eval(m, b, t, 5, nm, NULL, false, &err) == DS4_OK); /* chunks off the start too */
            CHECK(ds4_model_eval(m, b, t + 5, N - 5, nm, lb, false, &err) == DS4_OK);
            ds4_model_set_eval_chunk(m, 0);
            CHECK_MSG(memcmp(la, lb, (size_t)vocab * sizeof *la) == 0, "%s numerics, chunks of %lld: logits",
                      num ? "reference" : "ds4", (long long)chunks[c]);
            int64_t sb = 0;
            uint8_t *bb = test_state_bytes(b, t, N, vocab, &sb);
            CHECK_MSG(ba && bb && sa == sb && memcmp(ba, bb, (size_t)sa) == 0,
                      "%s numerics, chunks of %lld: the states differ", num ? "reference" : "ds4",
                      (long long)chunks[c]);
            free(bb);
            ds4_state_free(b);
        }
        free(ba);
        ds4_state_free(a);
    }
    CHECK(ds4_model_eval_chunk(m) == DS4_EVAL_CHUNK);
    free(la);
    free(lb);
    free(t);
    ds4_model_free(m);
    ds4_backend_destroy(cpu);
}

static void test_batch_decode_matches_single(void) {
    if (!setup()) { CHECK(0); return; }
    ds4_error err = { 0 };
    ds4_backend *cpu = NULL;
    ds4_model *m = cpu_model(&cpu);
    if (!m) return;
    enum { K = 5, STEPS = 9 };
    /* (122: a ratio-128 window ends at 127 in the batch; rows that select (122, 130) between rows that do not) */
    const int64_t prefix[K] = { 130, 1, 122, 14, 31 };
    ds4_state *batch[K] = { 0 }, *single[K] = { 0 };
    int32_t *t = random_tokens(200 + K * STEPS);
    float *lb = malloc((size_t)(K * vocab) * sizeof *lb), *ls = malloc((size_t)vocab * sizeof *ls);
    for (int i = 0; i < K; i++) {
        CHECK(ds4_state_create(m, 256, &batch[i], &err) == DS4_OK);
        CHECK(ds4_state_create(m, 256, &single[i], &err) == DS4_OK);
        CHECK(ds4_model_eval(m, batch[i], t + 7 * i, prefix[i], DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
        CHECK(ds4_model_eval(m, single[i], t + 7 * i, prefix[i], DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
    }
    int bad = 0;
    for (int step = 0; step < STEPS; step++) {
        int32_t next[K];
        for (int i = 0; i < K; i++) next[i] = t[200 + step * K + i];
        CHECK_MSG(ds4_model_eval_batch(m, batch, next, K, DS4_NUMERICS_DS4, lb, &err) == DS4_OK, "%s", err.message);
        for (int i = 0; i < K; i++) {
            CHECK(ds4_model_eval(m, single[i], &next[i], 1, DS4_NUMERICS_DS4, ls, false, &err) == DS4_OK);
            bad += memcmp(lb + i * vocab, ls, (size_t)vocab * sizeof *ls) != 0;
            CHECK(ds4_state_pos(batch[i]) == prefix[i] + step + 1);
        }
    }
    CHECK_MSG(bad == 0, "%d of %d batched rows differ from single-token decode", bad, K * STEPS);
    {
        /* row by row (ds4_model_set_state_batches off): the same logits as the batched calls */
        ds4_state *off[K] = { 0 }, *on[K] = { 0 };
        float *lo = malloc((size_t)(K * vocab) * sizeof *lo);
        for (int i = 0; i < K; i++) {
            CHECK(ds4_state_create(m, 256, &off[i], &err) == DS4_OK && ds4_state_create(m, 256, &on[i], &err) == DS4_OK);
            CHECK(ds4_model_eval(m, off[i], t + 7 * i, prefix[i], DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
            CHECK(ds4_model_eval(m, on[i], t + 7 * i, prefix[i], DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
        }
        int differ = 0;
        for (int step = 0; step < 3; step++) {
            int32_t next[K];
            for (int i = 0; i < K; i++) next[i] = t[200 + step * K + i];
            ds4_model_set_state_batches(m, false);
            CHECK(ds4_model_eval_batch(m, off, next, K, DS4_NUMERICS_DS4, lo, &err) == DS4_OK);
            ds4_model_set_state_batches(m, true);
            CHECK(ds4_model_eval_batch(m, on, next, K, DS4_NUMERICS_DS4, lb, &err) == DS4_OK);
            differ += memcmp(lo, lb, (size_t)(K * vocab) * sizeof *lo) != 0;
        }
        CHECK_MSG(differ == 0, "%d batched steps differ with the state batches off", differ);
        for (int i = 0; i < K; i++) {
            ds4_state_free(off[i]);
            ds4_state_free(on[i]);
        }
        free(lo);
    }
    /* a batch of one is a decode step; NULL logits are allowed */
    CHECK(ds4_model_eval_batch(m, batch, &t[0], 1, DS4_NUMERICS_DS4, NULL, &err) == DS4_OK);
    /* refused, with nothing advanced: the same state twice, a full context,
     * a token outside the vocabulary, an empty batch */
    const int64_t before = ds4_state_pos(batch[1]);
    ds4_state *twice[2] = { batch[1], batch[1] };
    int32_t two[2] = { 1, 2 };
    CHECK(ds4_model_eval_batch(m, twice, two, 2, DS4_NUMERICS_DS4, lb, &err) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(err.message, "same state") != NULL, "%s", err.message);
    ds4_state *tiny = NULL;
    CHECK(ds4_state_create(m, 1, &tiny, &err) == DS4_OK);
    CHECK(ds4_model_eval(m, tiny, t, 1, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
    ds4_state *full[2] = { batch[1], tiny };
    CHECK(ds4_model_eval_batch(m, full, two, 2, DS4_NUMERICS_DS4, lb, &err) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(err.message, "end of its context") != NULL, "%s", err.message);
    int32_t oov[2] = { 1, (int32_t)vocab };
    CHECK(ds4_model_eval_batch(m, batch, oov, 2, DS4_NUMERICS_DS4, lb, &err) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(err.message, "vocabulary") != NULL, "%s", err.message);
    CHECK(ds4_model_eval_batch(m, batch, two, 0, DS4_NUMERICS_DS4, lb, &err) == DS4_ERR_INVALID);
    CHECK(ds4_model_eval_batch(m, NULL, two, 2, DS4_NUMERICS_DS4, lb, &err) == DS4_ERR_INVALID);
    CHECK(ds4_model_eval_batch(m, batch, NULL, 2, DS4_NUMERICS_DS4, lb, &err) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(err.message, "NULL tokens") != NULL, "%s", err.message);
    CHECK(ds4_state_pos(batch[1]) == before);
    ds4_state_free(tiny);
    for (int i = 0; i < K; i++) {
        ds4_state_free(batch[i]);
        ds4_state_free(single[i]);
    }
    free(lb);
    free(ls);
    free(t);
    ds4_model_free(m);
    ds4_backend_destroy(cpu);
}

/* ds4_model_eval_greedy picks ds4_sample_argmax's token of the logits that
 * ds4_model_eval returns, after a prefill and over greedy decode steps,
 * and advances the state the same way; the batched form likewise per row;
 * no place for the token is refused with nothing advanced. */
static void test_greedy_eval_matches_argmax(void) {
    if (!setup()) { CHECK(0); return; }
    ds4_error err = { 0 };
    ds4_backend *cpu = NULL;
    ds4_model *m = cpu_model(&cpu);
    if (!m) return;
    int32_t *t = random_tokens(64);
    float *lg = malloc((size_t)(3 * vocab) * sizeof *lg);
    ds4_state *a = NULL, *b = NULL;
    CHECK(ds4_state_create(m, 128, &a, &err) == DS4_OK);
    CHECK(ds4_state_create(m, 128, &b, &err) == DS4_OK);
    CHECK(ds4_model_eval(m, a, t, 37, DS4_NUMERICS_DS4, lg, false, &err) == DS4_OK);
    int32_t next = -5;
    CHECK_MSG(ds4_model_eval_greedy(m, b, t, 37, DS4_NUMERICS_DS4, &next, &err) == DS4_OK, "%s", err.message);
    CHECK_EQ_INT(next, ds4_sample_argmax(lg, vocab));
    CHECK(ds4_state_pos(a) == 37 && ds4_state_pos(b) == 37);
    {
        /* the kept logits are b's own: another state's prefill and a batched
         * decode (which use the model's chunk scratch) leave them as they were */
        ds4_state *c = NULL, *d = NULL;
        CHECK(ds4_state_create(m, 128, &c, &err) == DS4_OK && ds4_state_create(m, 128, &d, &err) == DS4_OK);
        CHECK(ds4_model_eval(m, c, t + 40, 20, DS4_NUMERICS_DS4, lg + vocab, false, &err) == DS4_OK);
        CHECK(ds4_model_eval(m, d, t + 20, 9, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
        ds4_state *cd[2] = { c, d };
        const int32_t two[2] = { t[1], t[2] };
        CHECK(ds4_model_eval_batch(m, cd, two, 2, DS4_NUMERICS_DS4, lg + vocab, &err) == DS4_OK);
        CHECK_MSG(ds4_model_fetch_logits(m, b, lg + 2 * vocab, &err) == DS4_OK, "%s", err.message);
        CHECK_MSG(memcmp(lg, lg + 2 * vocab, (size_t)vocab * sizeof *lg) == 0,
                  "the greedy prefill's kept logits changed under other states' evaluations");
        CHECK(ds4_model_fetch_logits(m, c, lg + 2 * vocab, &err) == DS4_ERR_INVALID); /* c's last was batched */
        ds4_state_free(c);
        ds4_state_free(d);
    }
    for (int step = 0; step < 12; step++) {
        const int32_t tok = next;
        CHECK(ds4_model_eval(m, a, &tok, 1, DS4_NUMERICS_DS4, lg, false, &err) == DS4_OK);
        CHECK(ds4_model_eval_greedy(m, b, &tok, 1, DS4_NUMERICS_DS4, &next, &err) == DS4_OK);
        CHECK_MSG(next == ds4_sample_argmax(lg, vocab), "step %d: %d, argmax %d", step, next,
                  ds4_sample_argmax(lg, vocab));
    }
    CHECK(ds4_model_eval_greedy(m, b, t, 1, DS4_NUMERICS_DS4, NULL, &err) == DS4_ERR_INVALID);
    CHECK(ds4_state_pos(b) == 37 + 12);
    /* batched: three states at different positions */
    ds4_state *st[3] = { 0 }, *st2[3] = { 0 };
    for (int i = 0; i < 3; i++) {
        CHECK(ds4_state_create(m, 128, &st[i], &err) == DS4_OK);
        CHECK(ds4_state_create(m, 128, &st2[i], &err) == DS4_OK);
        CHECK(ds4_model_eval(m, st[i], t + 3 * i, 5 + 9 * i, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
        CHECK(ds4_model_eval(m, st2[i], t + 3 * i, 5 + 9 * i, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
    }
    int32_t cur[3] = { t[50], t[51], t[52] }, got[3] = { -1, -1, -1 };
    for (int step = 0; step < 4; step++) {
        CHECK(ds4_model_eval_batch(m, st, cur, 3, DS4_NUMERICS_DS4, lg, &err) == DS4_OK);
        CHECK(ds4_model_eval_batch_greedy(m, st2, cur, 3, DS4_NUMERICS_DS4, got, &err) == DS4_OK);
        for (int i = 0; i < 3; i++) {
            CHECK_MSG(got[i] == ds4_sample_argmax(lg + i * vocab, vocab), "batch step %d row %d", step, i);
            cur[i] = got[i];
        }
    }
    CHECK(ds4_model_eval_batch_greedy(m, st2, cur, 3, DS4_NUMERICS_DS4, NULL, &err) == DS4_ERR_INVALID);
    CHECK(ds4_state_pos(st2[0]) == 5 + 4);
    for (int i = 0; i < 3; i++) {
        ds4_state_free(st[i]);
        ds4_state_free(st2[i]);
    }
    ds4_state_free(a);
    ds4_state_free(b);
    free(lg);
    free(t);
    ds4_model_free(m);
    ds4_backend_destroy(cpu);
}

/* ds4_session_decode_greedy picks the temperature-0 token of the logits a
 * plain decode would give, appends the token, and leaves the logits on the
 * backend: ds4_session_logits fetches them (bit for bit the plain decode's),
 * a checkpoint saved then holds them, a sync to the same history keeps them;
 * bad calls are refused. */
static void test_session_decode_greedy(void) {
    if (!setup()) { CHECK(0); return; }
    ds4_error err = { 0 };
    int32_t *t = random_tokens(40);
    ds4_session *a = new_session(96), *b = new_session(96);
    CHECK(ds4_session_sync(a, t, 40, NULL, &err) == DS4_OK);
    CHECK(ds4_session_sync(b, t, 40, NULL, &err) == DS4_OK);
    int32_t next = ds4_sample_argmax(ds4_session_logits(b), vocab);
    for (int step = 0; step < 20; step++) {
        const int32_t tok = next;
        CHECK(ds4_sample_argmax(ds4_session_logits(a), vocab) == tok);
        CHECK(ds4_session_decode(a, tok, &err) == DS4_OK);
        CHECK_MSG(ds4_session_decode_greedy(b, tok, &next, &err) == DS4_OK, "%s", err.message);
        CHECK_MSG(next == ds4_sample_argmax(ds4_session_logits(a), vocab), "step %d", step);
        if (step % 7 == 3) CHECK(same_logits(ds4_session_logits(a), ds4_session_logits(b))); /* fetched */
    }
    int64_t na = 0, nb = 0;
    const int32_t *ha = ds4_session_tokens(a, &na), *hb = ds4_session_tokens(b, &nb);
    CHECK(na == 60 && nb == 60 && memcmp(ha, hb, 60 * sizeof *ha) == 0);
    /* after a greedy step: a checkpoint holds the logits; a sync to the same
     * history keeps the session and gives them */
    CHECK(ds4_session_decode_greedy(b, next, &next, &err) == DS4_OK);
    CHECK(ds4_session_decode(a, ds4_sample_argmax(ds4_session_logits(a), vocab), &err) == DS4_OK);
    char path[256];
    snprintf(path, sizeof path, "/tmp/ds4_test_session_%d_greedy.ckpt", (int)getpid());
    CHECK_MSG(ds4_session_save(b, path, &err) == DS4_OK, "%s", err.message);
    ds4_session *c = new_session(96);
    CHECK_MSG(ds4_session_load(c, path, &err) == DS4_OK, "%s", err.message);
    CHECK(same_logits(ds4_session_logits(a), ds4_session_logits(c)));
    unlink(path);
    CHECK(ds4_session_decode_greedy(b, next, &next, &err) == DS4_OK);
    CHECK(ds4_session_decode(a, ds4_sample_argmax(ds4_session_logits(a), vocab), &err) == DS4_OK);
    hb = ds4_session_tokens(b, &nb);
    int32_t *copy = malloc((size_t)nb * sizeof *copy);
    memcpy(copy, hb, (size_t)nb * sizeof *copy);
    int64_t evaluated = -1;
    CHECK(ds4_session_sync(b, copy, nb, &evaluated, &err) == DS4_OK);
    CHECK(evaluated == 0);
    CHECK(same_logits(ds4_session_logits(a), ds4_session_logits(b)));
    /* refused: no place for the token, a token outside the vocabulary, a full context */
    CHECK(ds4_session_decode_greedy(b, 1, NULL, &err) == DS4_ERR_INVALID);
    CHECK(ds4_session_decode_greedy(b, (int32_t)vocab, &next, &err) == DS4_ERR_INVALID);
    CHECK(ds4_session_tokens(b, &nb) && nb == 62);
    ds4_session *full = new_session(41);
    CHECK(ds4_session_sync(full, t, 40, NULL, &err) == DS4_OK);
    CHECK(ds4_session_decode_greedy(full, 1, &next, &err) == DS4_OK);
    CHECK(ds4_session_decode_greedy(full, 1, &next, &err) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(err.message, "full") != NULL, "%s", err.message);
    ds4_session_free(full);
    free(copy);
    ds4_session_free(a);
    ds4_session_free(b);
    ds4_session_free(c);
    free(t);
}

/* Sessions decoded together are the sessions decoded one by one; a batch
 * that cannot run changes none of them. */
static void test_session_decode_batch(void) {
    if (!setup()) { CHECK(0); return; }
    ds4_error err = { 0 };
    enum { K = 3 };
    const int64_t prompt[K] = { 5, 33, 70 };
    int32_t *t = random_tokens(160);
    ds4_session *a[K], *b[K];
    for (int i = 0; i < K; i++) {
        a[i] = new_session(128);
        b[i] = new_session(128);
        CHECK(ds4_session_sync(a[i], t + 10 * i, prompt[i], NULL, &err) == DS4_OK);
        CHECK(ds4_session_sync(b[i], t + 10 * i, prompt[i], NULL, &err) == DS4_OK);
    }
    int same = 0;
    for (int step = 0; step < 6; step++) {
        int32_t next[K];
        for (int i = 0; i < K; i++) next[i] = t[100 + step * K + i];
        CHECK_MSG(ds4_session_decode_batch(a, next, K, &err) == DS4_OK, "%s", err.message);
        for (int i = 0; i < K; i++) {
            CHECK(ds4_session_decode(b[i], next[i], &err) == DS4_OK);
            same += same_logits(ds4_session_logits(a[i]), ds4_session_logits(b[i]));
            int64_t na = 0, nb = 0;
            const int32_t *ta = ds4_session_tokens(a[i], &na), *tb = ds4_session_tokens(b[i], &nb);
            CHECK(na == nb && na == prompt[i] + step + 1 && memcmp(ta, tb, (size_t)na * sizeof *ta) == 0);
        }
    }
    CHECK_EQ_INT(same, K * 6);
    /* refused, nothing changed: a repeated session, an empty one, a bad token */
    int64_t before = 0;
    (void)ds4_session_tokens(a[1], &before);
    ds4_session *twice[2] = { a[1], a[1] }, *empty = new_session(64), *with_empty[2] = { a[1], empty };
    int32_t two[2] = { 1, 2 }, oov[2] = { 1, (int32_t)vocab };
    CHECK(ds4_session_decode_batch(twice, two, 2, &err) == DS4_ERR_INVALID);
    CHECK(ds4_session_decode_batch(with_empty, two, 2, &err) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(err.message, "empty") != NULL, "%s", err.message);
    CHECK(ds4_session_decode_batch(a, oov, 2, &err) == DS4_ERR_INVALID);
    CHECK(ds4_session_decode_batch(a, two, 0, &err) == DS4_ERR_INVALID);
    CHECK(ds4_session_decode_batch(NULL, two, 2, &err) == DS4_ERR_INVALID);
    ds4_engine *other = NULL;
    ds4_engine_params po = { model_b, "cpu", 1, DS4_NUMERICS_MODE_DS4, NULL, NULL };
    CHECK(ds4_engine_open(&po, &other, &err) == DS4_OK);
    ds4_session *foreign = NULL;
    if (other) CHECK(ds4_session_create(other, 64, &foreign, &err) == DS4_OK);
    if (foreign) {
        CHECK(ds4_session_sync(foreign, t, 4, NULL, &err) == DS4_OK);
        ds4_session *mixed[2] = { a[1], foreign };
        CHECK(ds4_session_decode_batch(mixed, two, 2, &err) == DS4_ERR_INVALID);
        CHECK_MSG(strstr(err.message, "another engine") != NULL, "%s", err.message);
    }
    ds4_session_free(foreign);
    ds4_engine_close(other);
    int64_t after = 0;
    (void)ds4_session_tokens(a[1], &after);
    CHECK(after == before);
    CHECK(ds4_session_decode(a[1], 3, &err) == DS4_OK); /* still usable */
    ds4_session_free(empty);
    for (int i = 0; i < K; i++) {
        ds4_session_free(a[i]);
        ds4_session_free(b[i]);
    }
    free(t);
}

/* Layer 0's inputs and outputs of two products of a prompt's chunk: the
 * first buffer of each of F16_TAPS' names (buf[k], n[k] floats). */
enum { TAP_ATTN_NORM, TAP_Q_A, TAP_FFN_NORM, TAP_ROUTER, N_F16_TAPS };
static const char *const F16_TAPS[N_F16_TAPS] = { "attn_norm", "q_a", "ffn_norm", "router_logits" };
typedef struct f16_tap {
    ds4_backend *be;
    float *buf[N_F16_TAPS];
    int64_t n[N_F16_TAPS];
} f16_tap;

static void f16_tap_fn(void *ctx, const char *name, int layer, int64_t token, float *buf, int64_t n, bool host) {
    f16_tap *t = ctx;
    if (layer != 0 || token != -1) return;
    for (int k = 0; k < N_F16_TAPS; k++) {
        if (strcmp(name, F16_TAPS[k]) || t->buf[k]) continue;
        t->buf[k] = malloc((size_t)n * sizeof *t->buf[k]);
        t->n[k] = n;
        if (host) memcpy(t->buf[k], buf, (size_t)n * sizeof *t->buf[k]);
        else t->be->ops->download(t->be, t->buf[k], buf, n);
    }
}

/* out[r][o] of the file's weight `name` (Q8_0 or F16, rows of n_in) on x
 * [n_rows, n_in] with binary16 operands, against got: each within one
 * float rounding of the float64 sum (the numerics' value); the count of
 * outputs off. */
static int f16_product_off(const gguf_file *f, const char *name, const float *x, const float *got, int64_t n_rows,
                           int64_t n_out) {
    const gguf_tensor *t = gguf_find_tensor(f, name);
    CHECK_MSG(t && (t->type == DS4_TYPE_Q8_0 || t->type == DS4_TYPE_F16) && (int64_t)t->ne[1] == n_out, "%s", name);
    if (!t) return 1;
    const int64_t n_in = (int64_t)t->ne[0], rb = ds4_type_row_bytes(t->type, n_in);
    float *w = malloc((size_t)n_in * sizeof *w);
    int off = 0;
    for (int64_t o = 0; o < n_out; o++) {
        /* d q (exact) or the F16 value, then f16() */
        ds4_type_traits_get(t->type)->dequant_row(t->data + o * rb, w, n_in);
        for (int64_t i = 0; i < n_in; i++) w[i] = ds4_round_f16(w[i]);
        for (int64_t r = 0; r < n_rows; r++) {
            double want = 0, mag = 0;
            for (int64_t i = 0; i < n_in; i++) {
                const double p = (double)w[i] * ds4_round_f16(x[r * n_in + i]);
                want += p;
                mag += fabs(p);
            }
            const double g = got[r * n_out + o];
            if (!(fabs(g - want) <= 0x1p-24 * fabs(want) + 1e-13 * mag)) {
                if (!off) fprintf(stderr, "    %s row %lld out %lld: %.9g, want %.9g\n", name, (long long)r, (long long)o, g, want);
                off++;
            }
        }
    }
    free(w);
    return off;
}

/*
 * The ds4-f16 numerics through the model:
 * - a prompt's chunk takes binary16 operands in its Q8_0 and F16 products:
 *   layer 0's q_a (Q8_0) and router logits (F16) of a 24-token prefill are
 *   the test's own binary16 products of the inputs the hook saw;
 * - the prefill's logits differ from ds4's (and stay finite);
 * - decoded tokens are ds4's: the same tokens decoded one at a time, and
 *   batched, under both give the same logits bit for bit;
 * - a backend without the numerics refuses them (the error names them),
 *   with nothing advanced; so does an engine, before loading weights; an
 *   engine opens with them on the CPU; a mode out of range is refused.
 */
static void test_f16_numerics(void) {
    if (!setup()) { CHECK(0); return; }
    ds4_error err = { 0 };
    ds4_backend *cpu = NULL;
    ds4_model *m = cpu_model(&cpu);
    if (!m) return;
    const ds4_config *c = ds4_model_config(m);
    const gguf_file *f = ds4_engine_gguf(engine);
    enum { N = 24, STEPS = 6 };
    int32_t *t = random_tokens(N + 2 * STEPS);

    f16_tap tap = { .be = cpu };
    ds4_state *sf = NULL, *sd = NULL;
    CHECK(ds4_state_create(m, 128, &sf, &err) == DS4_OK && ds4_state_create(m, 128, &sd, &err) == DS4_OK);
    float *lf = malloc((size_t)(2 * vocab) * sizeof *lf), *ld = malloc((size_t)(2 * vocab) * sizeof *ld);
    ds4_model_set_tap(m, f16_tap_fn, &tap);
    CHECK_MSG(ds4_model_eval(m, sf, t, N, DS4_NUMERICS_DS4_F16, lf, false, &err) == DS4_OK, "%s", err.message);
    ds4_model_set_tap(m, NULL, NULL);
    float *const *tb = tap.buf;
    CHECK(tb[TAP_ATTN_NORM] && tb[TAP_Q_A] && tb[TAP_FFN_NORM] && tb[TAP_ROUTER]);
    if (tb[TAP_ATTN_NORM] && tb[TAP_Q_A] && tb[TAP_FFN_NORM] && tb[TAP_ROUTER]) {
        CHECK(tap.n[TAP_ATTN_NORM] == N * c->n_embd && tap.n[TAP_Q_A] == N * c->q_lora &&
              tap.n[TAP_ROUTER] == N * c->n_expert);
        CHECK_EQ_INT(f16_product_off(f, "blk.0.attn_q_a.weight", tb[TAP_ATTN_NORM], tb[TAP_Q_A], N, c->q_lora), 0);
        CHECK_EQ_INT(f16_product_off(f, "blk.0.ffn_gate_inp.weight", tb[TAP_FFN_NORM], tb[TAP_ROUTER], N,
                                     c->n_expert),
                     0);
    }
    CHECK(ds4_model_eval(m, sd, t, N, DS4_NUMERICS_DS4, ld, false, &err) == DS4_OK);
    CHECK_MSG(memcmp(lf, ld, (size_t)vocab * sizeof *lf) != 0, "a ds4-f16 prefill gave ds4's logits");
    int finite = 0;
    for (int64_t i = 0; i < vocab; i++) finite += isfinite(lf[i]) != 0;
    CHECK_EQ_INT(finite, vocab);

    /* decoded tokens: two fresh states fed the same tokens one at a time */
    ds4_state *a[2] = { 0 }, *b[2] = { 0 };
    for (int i = 0; i < 2; i++)
        CHECK(ds4_state_create(m, 128, &a[i], &err) == DS4_OK && ds4_state_create(m, 128, &b[i], &err) == DS4_OK);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        CHECK(ds4_model_eval(m, a[0], &t[i], 1, DS4_NUMERICS_DS4_F16, lf, false, &err) == DS4_OK);
        CHECK(ds4_model_eval(m, b[0], &t[i], 1, DS4_NUMERICS_DS4, ld, false, &err) == DS4_OK);
        CHECK(ds4_model_eval(m, a[1], &t[i + 1], 1, DS4_NUMERICS_DS4_F16, NULL, false, &err) == DS4_OK);
        CHECK(ds4_model_eval(m, b[1], &t[i + 1], 1, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
        bad += memcmp(lf, ld, (size_t)vocab * sizeof *lf) != 0;
    }
    for (int step = 0; step < STEPS; step++) {
        CHECK(ds4_model_eval_batch(m, a, t + N + 2 * step, 2, DS4_NUMERICS_DS4_F16, lf, &err) == DS4_OK);
        CHECK(ds4_model_eval_batch(m, b, t + N + 2 * step, 2, DS4_NUMERICS_DS4, ld, &err) == DS4_OK);
        bad += memcmp(lf, ld, (size_t)(2 * vocab) * sizeof *lf) != 0;
    }
    CHECK_MSG(bad == 0, "%d decode steps differ between ds4-f16 and ds4", bad);

    /* a backend without the numerics */
    ds4_backend_ops fewer = *cpu->ops;
    fewer.numerics &= ~(1u << DS4_NUMERICS_DS4_F16);
    ds4_backend lacking = *cpu;
    lacking.ops = &fewer;
    ds4_model *ml = NULL;
    CHECK(ds4_model_load((gguf_file *)f, &lacking, &ml, &err) == DS4_OK);
    if (ml) {
        ds4_state *sl = NULL;
        CHECK(ds4_state_create(ml, 64, &sl, &err) == DS4_OK);
        CHECK(ds4_model_eval(ml, sl, t, 4, DS4_NUMERICS_DS4_F16, NULL, false, &err) == DS4_ERR_UNSUPPORTED);
        CHECK_MSG(strstr(err.message, "ds4-f16") != NULL, "%s", err.message);
        CHECK(ds4_model_eval_batch(ml, &sl, t, 1, DS4_NUMERICS_DS4_F16, NULL, &err) == DS4_ERR_UNSUPPORTED);
        CHECK(ds4_state_pos(sl) == 0);
        CHECK(ds4_model_eval(ml, sl, t, 4, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
        ds4_state_free(sl);
        ds4_model_free(ml);
    }

    /* engines */
    ds4_engine *e = NULL;
    ds4_engine_params p = { model_a, "cpu", 2, DS4_NUMERICS_MODE_DS4_F16, NULL, NULL };
    CHECK_MSG(ds4_engine_open(&p, &e, &err) == DS4_OK, "%s", err.message);
    if (e) {
        ds4_session *s = NULL;
        CHECK(ds4_session_create(e, 64, &s, &err) == DS4_OK);
        if (s) {
            CHECK_MSG(ds4_session_sync(s, t, N, NULL, &err) == DS4_OK, "%s", err.message);
            CHECK(ds4_session_decode(s, t[N], &err) == DS4_OK);
            ds4_session_free(s);
        }
        ds4_engine_close(e);
    }
    p.numerics = (ds4_numerics_mode)9;
    e = NULL;
    CHECK(ds4_engine_open(&p, &e, &err) == DS4_ERR_INVALID && !e);
    CHECK_MSG(strstr(err.message, "ds4-f16") != NULL, "%s", err.message);

    for (int i = 0; i < 2; i++) {
        ds4_state_free(a[i]);
        ds4_state_free(b[i]);
    }
    ds4_state_free(sf);
    ds4_state_free(sd);
    for (int k = 0; k < N_F16_TAPS; k++) free(tap.buf[k]);
    free(lf);
    free(ld);
    free(t);
    ds4_model_free(m);
    ds4_backend_destroy(cpu);
}

static void test_teardown(void) {
    ds4_engine_close(engine);
    engine = NULL;
    unlink(model_a);
    unlink(model_b);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_decode_matches_prefill),
    TEST_ENTRY(test_prefix_reuse_and_rewind),
    TEST_ENTRY(test_context_limits),
    TEST_ENTRY(test_checkpoint_roundtrip),
    TEST_ENTRY(test_checkpoint_damage),
    TEST_ENTRY(test_checkpoint_disk_full),
    TEST_ENTRY(test_prefetch_reads_the_whole_file),
    TEST_ENTRY(test_load_refuses_incomplete_backend),
    TEST_ENTRY(test_batch_decode_matches_single),
    TEST_ENTRY(test_f16_numerics),
    TEST_ENTRY(test_compressor_chunks_match),
    TEST_ENTRY(test_eval_chunk_env),
    TEST_ENTRY(test_eval_chunk_sizes_match),
    TEST_ENTRY(test_greedy_eval_matches_argmax),
    TEST_ENTRY(test_session_decode_greedy),
    TEST_ENTRY(test_session_decode_batch),
    TEST_ENTRY(test_teardown),
    { 0, 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

/* test_cuda_session.c - whole-model runs on the CUDA backend through the
 * public API: prefill vs token-by-token decode on the GPU, GPU logits against
 * the CPU's, and checkpoints that cross backends (saved on CUDA, restored on
 * the CPU, and the reverse) and continue with the same tokens; and, through
 * the model API, how often one decoded token makes the host wait for the GPU.
 *
 * Tolerances: the tiny model under reference numerics computes in float32
 * on both backends; sums in another order drift by ~1e-6 relative per layer,
 * so logits agree to 1e-3 normwise (max |a-b| / max |a|), and greedy
 * choices agree. Without a usable CUDA device every test reports SKIPPED. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/backend.h"
#include "backends/cuda/cuda_backend.h"
#include "core/error.h"
#include "core/gguf.h"
#include "ds4.h"
#include "models/deepseek4/ds4_model.h"
#include "models/deepseek4/ds4_synth.h"
#include "session/sampling.h"
#include "test.h"
#include "test_state.h"

static char model_path[256];
static ds4_engine *cpu_engine, *gpu_engine;
static int64_t vocab;
static char skip_reason[200];

static bool setup(void) {
    if (gpu_engine) return true;
    ds4_error err = { 0 };
    int n = 0;
    if (ds4_cuda_probe(&n, &err) != DS4_OK || n < 1) {
        snprintf(skip_reason, sizeof skip_reason, "%.190s", err.message[0] ? err.message : "no CUDA device");
        return false;
    }
    snprintf(model_path, sizeof model_path, "/tmp/ds4_test_cuda_session_%d.gguf", (int)getpid());
    if (ds4_synth_write(model_path, DS4_SCALE_TINY, DS4_QUANT_Q2, 9, NULL, false, &err)) {
        fprintf(stderr, "synth: %s\n", err.message);
        test_current_failures++;
        return false;
    }
    ds4_engine_params pc = { model_path, "cpu", 2, DS4_NUMERICS_MODE_REFERENCE, NULL, NULL };
    ds4_engine_params pg = { model_path, "cuda", 0, DS4_NUMERICS_MODE_REFERENCE, NULL, NULL };
    if (ds4_engine_open(&pc, &cpu_engine, &err) || ds4_engine_open(&pg, &gpu_engine, &err)) {
        fprintf(stderr, "engine: %s\n", err.message);
        test_current_failures++;
        return false;
    }
    vocab = ds4_engine_vocab_size(gpu_engine);
    return true;
}

#define SETUP_OR_SKIP()                                                                  \
    do {                                                                                 \
        if (!setup()) {                                                                  \
            if (skip_reason[0]) TEST_SKIP("%s", skip_reason);                            \
            return;                                                                      \
        }                                                                                \
    } while (0)

/* An environment switch: "0" off, "1" on, else the default. */
static bool env_flag(const char *name, bool dflt) {
    const char *v = getenv(name);
    return v && !strcmp(v, "0") ? false : v && !strcmp(v, "1") ? true : dflt;
}

static int32_t *random_tokens(int64_t n) {
    int32_t *t = malloc((size_t)n * sizeof *t);
    for (int64_t i = 0; i < n; i++) t[i] = (int32_t)(test_rand_u64() % (uint64_t)vocab);
    return t;
}

static ds4_session *new_session(ds4_engine *e, int64_t ctx) {
    ds4_session *s = NULL;
    ds4_error err = { 0 };
    CHECK_MSG(ds4_session_create(e, ctx, &s, &err) == DS4_OK, "%s", err.message);
    return s;
}

/* The test model on a CUDA backend of its own, through the model API (NULL,
 * with the failure checked, when it cannot be opened). */
static ds4_model *open_model(gguf_file **f, ds4_backend **be) {
    ds4_error err = { 0 };
    ds4_model *m = NULL;
    CHECK_MSG(gguf_open(model_path, f, &err) == DS4_OK, "%s", err.message);
    CHECK_MSG(*f && ds4_backend_create("cuda", 0, be, &err) == DS4_OK, "%s", err.message);
    CHECK_MSG(*be && ds4_model_load(*f, *be, &m, &err) == DS4_OK, "%s", err.message);
    return m;
}

static void close_model(gguf_file *f, ds4_backend *be, ds4_model *m) {
    ds4_model_free(m);
    ds4_backend_destroy(be);
    gguf_close(f);
}

static double normwise(const float *a, const float *b) {
    double max_abs = 0, max_ref = 0;
    for (int64_t i = 0; i < vocab; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= max_abs)) max_abs = isnan(d) ? INFINITY : d;
        if (fabs(a[i]) > max_ref) max_ref = fabs(a[i]);
    }
    return max_ref > 0 ? max_abs / max_ref : max_abs;
}

/* The first of n floats where a and b differ bit for bit, or -1. */
static int64_t first_diff(const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
    return -1;
}

static int32_t argmax(const float *v) {
    int64_t best = 0;
    for (int64_t i = 1; i < vocab; i++)
        if (v[i] > v[best]) best = i;
    return (int32_t)best;
}

/* GPU prefill vs GPU token-by-token decode, and both vs the CPU. */
static void test_gpu_matches_cpu_and_itself(void) {
    SETUP_OR_SKIP();
    const int64_t n = 150;
    int32_t *t = random_tokens(n);
    ds4_session *g1 = new_session(gpu_engine, 512), *g2 = new_session(gpu_engine, 512);
    ds4_session *c = new_session(cpu_engine, 512);
    ds4_error err = { 0 };
    CHECK_MSG(ds4_session_sync(g1, t, n, NULL, &err) == DS4_OK, "%s", err.message);
    CHECK_MSG(ds4_session_sync(g2, t, 37, NULL, &err) == DS4_OK, "%s", err.message);
    for (int64_t i = 37; i < n; i++) CHECK(ds4_session_decode(g2, t[i], &err) == DS4_OK);
    CHECK_MSG(ds4_session_sync(c, t, n, NULL, &err) == DS4_OK, "%s", err.message);
    const float *l1 = ds4_session_logits(g1), *l2 = ds4_session_logits(g2), *lc = ds4_session_logits(c);
    CHECK(l1 && l2 && lc);
    if (l1 && l2 && lc) {
        double d12 = normwise(l1, l2), d1c = normwise(lc, l1);
        CHECK_MSG(d12 <= 1e-3, "gpu prefill vs decode: %.3g", d12);
        CHECK_MSG(d1c <= 1e-3, "gpu vs cpu: %.3g", d1c);
        CHECK_EQ_INT(argmax(l1), argmax(lc));
    }
    /* 24 greedy tokens on each backend: identical */
    for (int i = 0; i < 24; i++) {
        int32_t a = argmax(ds4_session_logits(g1)), b = argmax(ds4_session_logits(c));
        CHECK_EQ_INT(a, b);
        if (a != b) break;
        CHECK(ds4_session_decode(g1, a, &err) == DS4_OK);
        CHECK(ds4_session_decode(c, b, &err) == DS4_OK);
    }
    ds4_session_free(g1);
    ds4_session_free(g2);
    ds4_session_free(c);
    free(t);
}

/* Save on one backend, load on the other, continue on both: same tokens. */
static void cross(ds4_engine *from, ds4_engine *to, const char *what) {
    const int64_t n = 133;
    int32_t *t = random_tokens(n + 20);
    char ckpt[300];
    snprintf(ckpt, sizeof ckpt, "%s.%s.ckpt", model_path, what);
    ds4_session *a = new_session(from, 512), *b = new_session(to, 512), *ref = new_session(from, 512);
    ds4_error err = { 0 };
    CHECK_MSG(ds4_session_sync(a, t, n, NULL, &err) == DS4_OK, "%s", err.message);
    CHECK_MSG(ds4_session_save(a, ckpt, &err) == DS4_OK, "%s: %s", what, err.message);
    CHECK_MSG(ds4_session_load(b, ckpt, &err) == DS4_OK, "%s: %s", what, err.message);
    CHECK_MSG(ds4_session_sync(ref, t, n, NULL, &err) == DS4_OK, "%s", err.message);
    int64_t nb = 0;
    ds4_session_tokens(b, &nb);
    CHECK_EQ_INT(nb, n);
    /* the restored logits are the saved ones, bit for bit */
    CHECK(memcmp(ds4_session_logits(a), ds4_session_logits(b), (size_t)vocab * sizeof(float)) == 0);
    for (int64_t i = n; i < n + 20; i++) {
        CHECK(ds4_session_decode(b, t[i], &err) == DS4_OK);
        CHECK(ds4_session_decode(ref, t[i], &err) == DS4_OK);
        double d = normwise(ds4_session_logits(ref), ds4_session_logits(b));
        CHECK_MSG(d <= 1e-3, "%s: after %lld tokens: %.3g", what, (long long)(i - n + 1), d);
        CHECK_EQ_INT(argmax(ds4_session_logits(ref)), argmax(ds4_session_logits(b)));
    }
    unlink(ckpt);
    ds4_session_free(a);
    ds4_session_free(b);
    ds4_session_free(ref);
    free(t);
}

static void test_checkpoint_cuda_to_cpu(void) {
    SETUP_OR_SKIP();
    cross(gpu_engine, cpu_engine, "cuda-to-cpu");
}

static void test_checkpoint_cpu_to_cuda(void) {
    SETUP_OR_SKIP();
    cross(cpu_engine, gpu_engine, "cpu-to-cuda");
}

/*
 * One decoded token (ds4_model_eval, n = 1) keeps the routing and the
 * indexer's choices on the GPU: the router, top_k, moe and attention ops
 * neither wait for the stream nor copy to the host. The host waits in a step
 * are the logits download and take_error (every wait counts: stream syncs
 * and the control-upload ring's event waits alike), and the only
 * device-to-host bytes are the logits and take_error's error record. The
 * context is long enough that the ratio-4 layers select rows (top_k), and
 * the tiny model has hash-routed and top-k-routed layers.
 */
static void test_decode_step_waits(void) {
    SETUP_OR_SKIP();
    ds4_error err = { 0 };
    gguf_file *f = NULL;
    ds4_backend *be = NULL;
    ds4_model *m = open_model(&f, &be);
    ds4_state *st = NULL;
    CHECK_MSG(m && ds4_state_create(m, 256, &st, &err) == DS4_OK, "%s", err.message);
    if (st) {
        const ds4_config *c = ds4_model_config(m);
        const int64_t n = 100;
        CHECK(n / 4 > c->idx_top_k); /* the indexer selects */
        int32_t *t = random_tokens(n + 2);
        float *logits = malloc((size_t)vocab * sizeof *logits);
        CHECK(ds4_model_eval(m, st, t, n, DS4_NUMERICS_DS4, logits, false, &err) == DS4_OK);
        /* a first step grows whatever scratch a step needs; the second is measured */
        CHECK(ds4_model_eval(m, st, t + n, 1, DS4_NUMERICS_DS4, logits, false, &err) == DS4_OK);
        ds4_backend_counters c0, c1;
        ds4_backend_counters_get(be, &c0);
        CHECK_MSG(ds4_model_eval(m, st, t + n + 1, 1, DS4_NUMERICS_DS4, logits, false, &err) == DS4_OK, "%s",
                  err.message);
        ds4_backend_counters_get(be, &c1);
        const uint64_t syncs = c1.syncs - c0.syncs, d2h = c1.d2h_bytes - c0.d2h_bytes;
        fprintf(stderr, "  one decode step: %llu syncs, %llu copies (%llu bytes to the host, %llu to the device), "
                "%llu launches\n", (unsigned long long)syncs, (unsigned long long)(c1.copies - c0.copies),
                (unsigned long long)d2h, (unsigned long long)(c1.h2d_bytes - c0.h2d_bytes),
                (unsigned long long)(c1.launches - c0.launches));
        CHECK_MSG(syncs <= 2, "one decode step waited for the GPU %llu times (at most 2: logits and take_error)",
                  (unsigned long long)syncs);
        CHECK_MSG(d2h <= (uint64_t)vocab * sizeof(float) + 256,
                  "one decode step copied %llu bytes to the host (logits: %llu)", (unsigned long long)d2h,
                  (unsigned long long)vocab * sizeof(float));
        /* greedy steps: the GPU picks ds4_sample_argmax's token of the logits
         * a twin state gets, and only the token id comes back */
        ds4_state *twin = NULL;
        CHECK_MSG(ds4_state_create(m, 256, &twin, &err) == DS4_OK, "%s", err.message);
        int32_t next = 0;
        if (twin) { /* the same calls as st's: the same state, bit for bit */
            CHECK(ds4_model_eval(m, twin, t, n, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
            CHECK(ds4_model_eval(m, twin, t + n, 1, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
            CHECK(ds4_model_eval(m, twin, t + n + 1, 1, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
            next = ds4_sample_argmax(logits, vocab);
        }
        for (int step = 0; twin && step < 6; step++) {
            const int32_t tok = next;
            CHECK(ds4_model_eval(m, st, &tok, 1, DS4_NUMERICS_DS4, logits, false, &err) == DS4_OK);
            ds4_backend_counters_get(be, &c0);
            CHECK_MSG(ds4_model_eval_greedy(m, twin, &tok, 1, DS4_NUMERICS_DS4, &next, &err) == DS4_OK, "%s",
                      err.message);
            ds4_backend_counters_get(be, &c1);
            CHECK_MSG(next == ds4_sample_argmax(logits, vocab), "greedy step %d: %d, argmax of the logits %d", step,
                      next, ds4_sample_argmax(logits, vocab));
            CHECK_MSG(c1.d2h_bytes - c0.d2h_bytes <= 256, "a greedy step copied %llu bytes to the host",
                      (unsigned long long)(c1.d2h_bytes - c0.d2h_bytes));
            if (step == 0)
                fprintf(stderr, "  one greedy decode step: %llu bytes to the host, %llu syncs\n",
                        (unsigned long long)(c1.d2h_bytes - c0.d2h_bytes), (unsigned long long)(c1.syncs - c0.syncs));
        }
        ds4_state_free(twin);
        free(logits);
        free(t);
    }
    ds4_state_free(st);
    close_model(f, be, m);
}

/*
 * A prefill chunk's compressors in batched calls, and its selecting rows'
 * indexer scores and top-k in batches of rows, on the GPU leave the same
 * logits and state, byte for byte, as the GPU's token-by-token path (the
 * same kernels row by row: pooling with a window offset, the APE rows of
 * a run, norm / RoPE / rounding over several rows, the indexer kernel with
 * a row per grid row, the one-block select per row), for chunks starting
 * inside, at and before window ends of both ratios, and past the point
 * where the indexer starts to select.
 */
static void test_compressor_chunks_match(void) {
    SETUP_OR_SKIP();
    ds4_error err = { 0 };
    gguf_file *f = NULL;
    ds4_backend *be = NULL;
    ds4_model *m = open_model(&f, &be);
    if (m) {
        static const int64_t cases[][2] = { { 0, 9 }, { 5, 7 }, { 127, 5 }, { 124, 136 }, { 1, 259 } };
        int32_t *t = random_tokens(400);
        float *la = malloc((size_t)vocab * sizeof *la), *lb = malloc((size_t)vocab * sizeof *lb);
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            const int64_t pre = cases[c][0], n = cases[c][1];
            ds4_state *a = NULL, *b = NULL;
            CHECK(ds4_state_create(m, 512, &a, &err) == DS4_OK && ds4_state_create(m, 512, &b, &err) == DS4_OK);
            if (!a || !b) break;
            if (pre) {
                CHECK(ds4_model_eval(m, a, t, pre, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
                CHECK(ds4_model_eval(m, b, t, pre, DS4_NUMERICS_DS4, NULL, false, &err) == DS4_OK);
            }
            CHECK(ds4_model_eval(m, a, t + pre, n, DS4_NUMERICS_DS4, la, false, &err) == DS4_OK);
            ds4_model_set_compressor_chunks(m, false);
            ds4_model_set_indexer_batches(m, 0);
            CHECK(ds4_model_eval(m, b, t + pre, n, DS4_NUMERICS_DS4, lb, false, &err) == DS4_OK);
            ds4_model_set_compressor_chunks(m, true);
            ds4_model_set_indexer_batches(m, -1);
            CHECK_MSG(memcmp(la, lb, (size_t)vocab * sizeof *la) == 0, "%lld tokens after %lld: logits differ",
                      (long long)n, (long long)pre);
            int64_t sa = 0, sb = 0;
            uint8_t *ba = test_state_bytes(a, t, pre + n, vocab, &sa);
            uint8_t *bb = test_state_bytes(b, t, pre + n, vocab, &sb);
            CHECK_MSG(ba && bb && sa == sb && memcmp(ba, bb, (size_t)sa) == 0, "%lld tokens after %lld: states differ",
                      (long long)n, (long long)pre);
            free(ba);
            free(bb);
            ds4_state_free(a);
            ds4_state_free(b);
        }
        free(la);
        free(lb);
        free(t);
    }
    close_model(f, be, m);
}

/*
 * Recorded steps: decoded tokens replayed as CUDA graphs compute exactly
 * what launching every kernel directly computes (the same kernels with the
 * same arguments in the same order: the logits are equal bit for bit), and
 * the graphs are replayed rather than rebuilt (a step shape changes only
 * when a compressor emits a row, the window fills, the window's rows move
 * to the front of their buffer or the indexer starts selecting). The tokens start inside the window and cross the point where
 * the ratio-4 layers' indexer starts to select. The FFN's shared expert is
 * a side branch of each step's graph (one per layer, counted); with
 * branches off it is on the main chain, and the logits are the same.
 */
static void test_graph_replay_matches_direct(void) {
    SETUP_OR_SKIP();
    ds4_error err = { 0 };
    gguf_file *f = NULL;
    ds4_backend *be = NULL;
    ds4_model *m = open_model(&f, &be);
    if (m) {
        const ds4_config *c = ds4_model_config(m);
        const int64_t n_pre = 4 * c->idx_top_k - 6, n_dec = 48;
        int32_t *t = random_tokens(n_pre + n_dec);
        float *direct = malloc((size_t)(n_dec * vocab) * sizeof *direct);
        float *graph = malloc((size_t)(n_dec * vocab) * sizeof *graph);
        float *seg = malloc((size_t)(n_dec * vocab) * sizeof *seg);
        float *chain = malloc((size_t)(n_dec * vocab) * sizeof *chain);
        static const char *const names[4] = { "direct", "graphs", "segments", "one chain" };
        /* pass 0: direct launches; 1: one graph per step; 2: steps in
         * segments; 3: segments without side branches (the shared expert
         * on the main chain) */
        for (int pass = 0; pass < 4 && direct && graph && seg && chain; pass++) {
            ds4_cuda_backend_set_graphs(be, pass > 0);
            ds4_cuda_backend_set_segments(be, pass >= 2);
            ds4_cuda_backend_set_branches(be, pass != 3);
            float *out = pass == 0 ? direct : pass == 1 ? graph : pass == 2 ? seg : chain;
            uint64_t br0 = 0, br1 = 0;
            ds4_cuda_backend_branch_stats(be, &br0, NULL);
            ds4_state *st = NULL;
            CHECK_MSG(ds4_state_create(m, 512, &st, &err) == DS4_OK, "%s", err.message);
            if (!st) break;
            CHECK(ds4_model_eval(m, st, t, n_pre, DS4_NUMERICS_DS4, out, false, &err) == DS4_OK);
            ds4_backend_counters c0, c1;
            ds4_backend_counters_get(be, &c0);
            for (int64_t i = 0; i < n_dec; i++)
                CHECK_MSG(ds4_model_eval(m, st, t + n_pre + i, 1, DS4_NUMERICS_DS4, out + i * vocab, false, &err) ==
                              DS4_OK, "%s", err.message);
            ds4_backend_counters_get(be, &c1);
            ds4_cuda_backend_branch_stats(be, &br1, NULL);
            const uint64_t graphs = c1.graphs - c0.graphs, builds = c1.graph_builds - c0.graph_builds;
            const uint64_t glaunch = c1.graph_launches - c0.graph_launches;
            fprintf(stderr, "  %s: %lld steps, %llu as graphs, %llu graph launches, %llu built (%llu for a refused "
                    "update, last: %s), %llu node updates, %llu launches, %llu cut short (last: %s)\n",
                    names[pass], (long long)n_dec,
                    (unsigned long long)graphs, (unsigned long long)glaunch, (unsigned long long)builds,
                    (unsigned long long)(c1.graph_refusals - c0.graph_refusals), ds4_cuda_backend_last_refusal(be),
                    (unsigned long long)(c1.node_updates - c0.node_updates),
                    (unsigned long long)(c1.launches - c0.launches),
                    (unsigned long long)(c1.step_breaks - c0.step_breaks), ds4_cuda_backend_last_break(be));
            /* a branch per layer of every step where they are on (the FFN's shared expert) */
            if (pass == 1 || pass == 2)
                CHECK_MSG(br1 - br0 >= (uint64_t)(n_dec * c->n_layer), "%s: %llu branches in %lld steps of %d layers",
                          names[pass], (unsigned long long)(br1 - br0), (long long)n_dec, (int)c->n_layer);
            else
                CHECK_MSG(br1 == br0, "%s: %llu branches recorded", names[pass], (unsigned long long)(br1 - br0));
            if (pass == 0) {
                CHECK(graphs == 0 && builds == 0 && glaunch == 0);
            } else {
                CHECK_MSG(graphs == (uint64_t)n_dec, "%llu of %lld steps ran as graphs", (unsigned long long)graphs,
                          (long long)n_dec);
                /* one graph per step, or (segments; more than one layer) several */
                if (pass == 1 || c->n_layer < 2)
                    CHECK_MSG(glaunch == graphs, "%llu graph launches for %llu steps", (unsigned long long)glaunch,
                              (unsigned long long)graphs);
                else
                    CHECK_MSG(glaunch >= 2 * graphs, "%llu graph launches for %llu steps of %d layers: not segmented",
                              (unsigned long long)glaunch, (unsigned long long)graphs, (int)c->n_layer);
                CHECK_MSG(builds * 4 <= glaunch, "%llu graphs built for %llu launches: not replayed",
                          (unsigned long long)builds, (unsigned long long)glaunch);
            }
            ds4_state_free(st);
        }
        for (int pass = 1; pass < 4 && direct && graph && seg && chain; pass++) {
            const float *other = pass == 1 ? graph : pass == 2 ? seg : chain;
            const int64_t first = first_diff(direct, other, n_dec * vocab);
            CHECK_MSG(first < 0, "%s differ from direct launches at step %lld, logit %lld: %.9g vs %.9g",
                      names[pass], first < 0 ? 0LL : (long long)(first / vocab),
                      first < 0 ? 0LL : (long long)(first % vocab), first < 0 ? 0.0 : (double)direct[first],
                      first < 0 ? 0.0 : (double)other[first]);
        }
        ds4_cuda_backend_set_segments(be, 1);
        ds4_cuda_backend_set_branches(be, !getenv("DS4_CUDA_BRANCH") || strcmp(getenv("DS4_CUDA_BRANCH"), "0") != 0);
        free(seg);
        free(chain);
        free(direct);
        free(graph);
        free(t);
    }
    close_model(f, be, m);
}

/*
 * hc_pre's Sinkhorn rounds off the chain (ds4_cuda_backend_set_hc_defer):
 * the whole model, recorded steps with side branches, a prefill of 8 rows
 * (the most deferred) then decoded tokens, gives the logits of the split in
 * the finishing kernel bit for bit whichever way the rounds run: every
 * task taken by the first product after its hc_pre (a bound of one byte),
 * the FFN's taken by the routed experts' gate/up launch (a bound just past
 * the router's weight: a grid of expert slots and two matrices, whose
 * extra blocks of slot 0 and matrix 0 alone run it), or none taken (every
 * task settled by its own kernel). Each pass counts its tasks: the model's
 * two hc_pre a layer, every step.
 */
static void test_deferred_sinkhorn_matches(void) {
    SETUP_OR_SKIP();
    ds4_error err = { 0 };
    gguf_file *f = NULL;
    ds4_backend *be = NULL;
    ds4_model *m = open_model(&f, &be);
    const gguf_tensor *router = f ? gguf_find_tensor(f, "blk.0.ffn_gate_inp.weight") : NULL;
    const gguf_tensor *gate = f ? gguf_find_tensor(f, "blk.0.ffn_gate_exps.weight") : NULL;
    CHECK(router && gate);
    if (m && router && gate) {
        const ds4_config *c = ds4_model_config(m);
        const int64_t n_pre = 8, n_dec = 12, per_step = 2 * (int64_t)c->n_layer;
        /* gate and up of the token's experts against the router's matrix */
        const int64_t experts_bytes = (int64_t)(gate->n_bytes / (uint64_t)c->n_expert) * c->n_expert_used * 2;
        CHECK_MSG(experts_bytes > (int64_t)router->n_bytes + 1, "the experts' gate/up (%lld bytes) do not outweigh "
                  "the router (%llu)", (long long)experts_bytes, (unsigned long long)router->n_bytes);
        int32_t *t = random_tokens(n_pre + n_dec);
        float *ref = malloc((size_t)((n_dec + 1) * vocab) * sizeof *ref);
        float *got = malloc((size_t)((n_dec + 1) * vocab) * sizeof *got);
        static const char *const names[4] = { "split in the finishing kernel", "first product",
                                              "routed experts' gate/up", "own kernel" };
        const int64_t bounds[4] = { 0, 1, (int64_t)router->n_bytes + 1, INT64_MAX / 4 };
        ds4_cuda_backend_set_graphs(be, 1);
        ds4_cuda_backend_set_branches(be, 1);
        for (int pass = 0; pass < 4 && ref && got; pass++) {
            float *out = pass == 0 ? ref : got;
            ds4_cuda_backend_set_hc_defer(be, pass != 0, bounds[pass]);
            uint64_t t0 = 0, s0 = 0, t1 = 0, s1 = 0;
            ds4_cuda_backend_hc_defer_stats(be, &t0, &s0);
            ds4_state *st = NULL;
            CHECK_MSG(ds4_state_create(m, 512, &st, &err) == DS4_OK, "%s", err.message);
            if (!st) break;
            CHECK(ds4_model_eval(m, st, t, n_pre, DS4_NUMERICS_DS4, out, false, &err) == DS4_OK);
            for (int64_t i = 0; i < n_dec; i++)
                CHECK_MSG(ds4_model_eval(m, st, t + n_pre + i, 1, DS4_NUMERICS_DS4, out + (i + 1) * vocab, false,
                                         &err) == DS4_OK, "%s", err.message);
            ds4_cuda_backend_hc_defer_stats(be, &t1, &s1);
            ds4_state_free(st);
            const uint64_t tasks = (uint64_t)((n_dec + 1) * per_step), taken = t1 - t0, settled = s1 - s0;
            fprintf(stderr, "  %s: %llu tasks taken by products, %llu settled\n", names[pass],
                    (unsigned long long)taken, (unsigned long long)settled);
            /* every hc_pre leaves a task (the prefill's 8 rows too), run one way or the other */
            CHECK_MSG(pass == 0 ? taken + settled == 0 : taken + settled == tasks,
                      "%s: %llu taken + %llu settled of %llu tasks", names[pass], (unsigned long long)taken,
                      (unsigned long long)settled, (unsigned long long)(pass == 0 ? 0 : tasks));
            /* decoded tokens: every task taken (pass 1), the FFN's at least (pass 2: the experts) */
            const uint64_t want = pass == 1 ? (uint64_t)(n_dec * per_step) : pass == 2 ? (uint64_t)(n_dec * c->n_layer) : 0;
            if (env_flag("DS4_CUDA_MATVEC", true))
                CHECK_MSG(taken >= want && (pass != 3 || taken == 0), "%s: %llu tasks taken by products (want %s%llu)",
                          names[pass], (unsigned long long)taken, pass == 3 ? "" : "at least ",
                          (unsigned long long)want);
            if (pass > 0) {
                const int64_t first = first_diff(ref, got, (n_dec + 1) * vocab);
                CHECK_MSG(first < 0, "%s: logits differ from the split in the finishing kernel at step %lld, "
                          "logit %lld", names[pass], first < 0 ? 0LL : (long long)(first / vocab),
                          first < 0 ? 0LL : (long long)(first % vocab));
            }
        }
        ds4_cuda_backend_set_hc_defer(be, env_flag("DS4_CUDA_HC_DEFER", true), 0);
        ds4_cuda_backend_set_branches(be, env_flag("DS4_CUDA_BRANCH", true));
        free(ref);
        free(got);
        free(t);
    }
    close_model(f, be, m);
}

/*
 * Weights into the L2 ahead of their products (ds4_cuda_backend_set_prefetch):
 * the whole model, a prefill of 8 rows then decoded tokens as recorded
 * steps, gives the same logits bit for bit with the prefetch off, by the
 * copy engine and by loads. The decoded steps ask for three sets a layer
 * (the normed input's products, the output products, the FFN's shared
 * expert and router) and at most one more (the routed experts' down
 * matrices); the prefill, not a recorded step, for none.
 */
static void test_prefetch_matches(void) {
    SETUP_OR_SKIP();
    ds4_error err = { 0 };
    gguf_file *f = NULL;
    ds4_backend *be = NULL;
    ds4_model *m = open_model(&f, &be);
    if (m) {
        const ds4_config *c = ds4_model_config(m);
        const int64_t n_pre = 8, n_dec = 12;
        int32_t *t = random_tokens(n_pre + n_dec);
        float *ref = malloc((size_t)((n_dec + 1) * vocab) * sizeof *ref);
        float *got = malloc((size_t)((n_dec + 1) * vocab) * sizeof *got);
        const bool recorded = !env_flag("DS4_CUDA_PROFILE", false); /* (kernel timing records no steps) */
        ds4_cuda_backend_set_graphs(be, 1);
        ds4_cuda_backend_set_prefetch_parts(be, 1, 1);
        static const int modes[3] = { 0, 1, 2 };
        for (int pass = 0; pass < 3 && ref && got; pass++) {
            float *out = pass == 0 ? ref : got;
            ds4_cuda_backend_set_prefetch(be, modes[pass], 0);
            uint64_t l0 = 0, b0 = 0, l1 = 0, b1 = 0, l2 = 0, b2 = 0;
            ds4_state *st = NULL;
            CHECK_MSG(ds4_state_create(m, 512, &st, &err) == DS4_OK, "%s", err.message);
            if (!st) break;
            ds4_cuda_backend_prefetch_stats(be, &l0, &b0);
            CHECK(ds4_model_eval(m, st, t, n_pre, DS4_NUMERICS_DS4, out, false, &err) == DS4_OK);
            ds4_cuda_backend_prefetch_stats(be, &l1, &b1);
            for (int64_t i = 0; i < n_dec; i++)
                CHECK_MSG(ds4_model_eval(m, st, t + n_pre + i, 1, DS4_NUMERICS_DS4, out + (i + 1) * vocab, false,
                                         &err) == DS4_OK, "%s", err.message);
            ds4_cuda_backend_prefetch_stats(be, &l2, &b2);
            ds4_state_free(st);
            const uint64_t steps = (uint64_t)n_dec, per = (l2 - l1) / steps, layers = (uint64_t)c->n_layer;
            fprintf(stderr, "  prefetch mode %d: %llu launches in the prefill, %llu a decoded token (%llu bytes)\n",
                    modes[pass], (unsigned long long)(l1 - l0), (unsigned long long)per,
                    (unsigned long long)((b2 - b1) / steps));
            CHECK_MSG(l1 == l0 && b1 == b0, "mode %d: the prefill prefetched (%llu launches)", modes[pass],
                      (unsigned long long)(l1 - l0));
            if (recorded && modes[pass] != 0)
                CHECK_MSG(l2 - l1 >= 3 * layers * steps && l2 - l1 <= 4 * layers * steps && b2 > b1,
                          "mode %d: %llu launches over %llu decoded tokens of %llu layers", modes[pass],
                          (unsigned long long)(l2 - l1), (unsigned long long)steps, (unsigned long long)layers);
            else
                CHECK_MSG(l2 == l1, "mode %d: %llu launches", modes[pass], (unsigned long long)(l2 - l1));
            if (pass > 0) {
                const int64_t first = first_diff(ref, got, (n_dec + 1) * vocab);
                CHECK_MSG(first < 0, "prefetch mode %d: logits differ from no prefetch at step %lld, logit %lld",
                          modes[pass], first < 0 ? 0LL : (long long)(first / vocab),
                          first < 0 ? 0LL : (long long)(first % vocab));
            }
        }
        const char *pe = getenv("DS4_CUDA_PREFETCH"); /* the default back */
        ds4_cuda_backend_set_prefetch(be, pe && !strcmp(pe, "1") ? 1 : pe && !strcmp(pe, "2") ? 2 : 0, 0);
        ds4_cuda_backend_set_prefetch_parts(be, env_flag("DS4_CUDA_PREFETCH_OPS", true),
                                            env_flag("DS4_CUDA_PREFETCH_EXPERTS", true));
        ds4_cuda_backend_set_graphs(be, env_flag("DS4_CUDA_GRAPH", true));
        free(ref);
        free(got);
        free(t);
    }
    close_model(f, be, m);
}

/*
 * Batched decode on the GPU: four states at different positions decode one
 * token each per call (weights read once for all rows; the products take
 * the several-row kernels), and every row's logits agree with a
 * single-token decode of its state (reference numerics: float32 in another
 * summation order, 1e-3 normwise); the batch runs as recorded steps.
 */
static void test_batch_decode_matches_single(void) {
    SETUP_OR_SKIP();
    ds4_error err = { 0 };
    gguf_file *f = NULL;
    ds4_backend *be = NULL;
    ds4_model *m = open_model(&f, &be);
    if (m) {
        enum { K = 4, STEPS = 6 };
        /* (3 and 19 end a ratio-4 window together at step 0, 46 and 90 at step 1; 46 and 90 select) */
        const int64_t prefix[K] = { 3, 19, 46, 90 };
        ds4_state *batch[K] = { 0 }, *single[K] = { 0 };
        int32_t *t = random_tokens(120 + K * STEPS);
        float *lb = malloc((size_t)(K * vocab) * sizeof *lb), *ls = malloc((size_t)vocab * sizeof *ls);
        for (int i = 0; i < K; i++) {
            CHECK(ds4_state_create(m, 256, &batch[i], &err) == DS4_OK);
            CHECK(ds4_state_create(m, 256, &single[i], &err) == DS4_OK);
            if (!batch[i] || !single[i]) break;
            CHECK(ds4_model_eval(m, batch[i], t + i, prefix[i], DS4_NUMERICS_REFERENCE, NULL, false, &err) == DS4_OK);
            CHECK(ds4_model_eval(m, single[i], t + i, prefix[i], DS4_NUMERICS_REFERENCE, NULL, false, &err) ==
                  DS4_OK);
        }
        ds4_backend_counters c0, c1;
        ds4_backend_counters_get(be, &c0);
        double worst = 0;
        for (int step = 0; step < STEPS && batch[K - 1] && single[K - 1]; step++) {
            int32_t next[K];
            for (int i = 0; i < K; i++) next[i] = t[120 + step * K + i];
            CHECK_MSG(ds4_model_eval_batch(m, batch, next, K, DS4_NUMERICS_REFERENCE, lb, &err) == DS4_OK, "%s",
                      err.message);
            for (int i = 0; i < K; i++) {
                CHECK(ds4_model_eval(m, single[i], &next[i], 1, DS4_NUMERICS_REFERENCE, ls, false, &err) == DS4_OK);
                const double d = normwise(ls, lb + i * vocab);
                if (!(d <= worst)) worst = d;
            }
        }
        ds4_backend_counters_get(be, &c1);
        fprintf(stderr, "  batched decode of %d streams: worst row %.3g normwise from single decode; %llu graphs\n",
                K, worst, (unsigned long long)(c1.graphs - c0.graphs));
        CHECK_MSG(worst <= 1e-3, "a batched row is %.3g normwise from single-token decode", worst);
        {
            /* the batch's row-by-row path (ds4_model_set_state_batches off) gives the same logits bit for bit:
             * copy_rows, add_weight_rows_at and attention_states compute what the per-row ops do */
            float *lo = malloc((size_t)(K * vocab) * sizeof *lo);
            for (int ni = 0; ni < 2; ni++) { /* both numerics (DS4's FP8 / QAT / F16 rounding of a block of rows) */
                const ds4_numerics nm = ni ? DS4_NUMERICS_DS4 : DS4_NUMERICS_REFERENCE;
                ds4_state *off[K] = { 0 }, *on[K] = { 0 };
                bool made = true;
                for (int i = 0; i < K; i++) {
                    made &= ds4_state_create(m, 256, &off[i], &err) == DS4_OK &&
                            ds4_state_create(m, 256, &on[i], &err) == DS4_OK;
                    if (!made) break;
                    CHECK(ds4_model_eval(m, off[i], t + i, prefix[i], nm, NULL, false, &err) == DS4_OK);
                    CHECK(ds4_model_eval(m, on[i], t + i, prefix[i], nm, NULL, false, &err) == DS4_OK);
                }
                CHECK(made);
                int differ = 0;
                for (int step = 0; made && step < 3; step++) {
                    int32_t next[K];
                    for (int i = 0; i < K; i++) next[i] = t[120 + step * K + i];
                    ds4_model_set_state_batches(m, false);
                    CHECK(ds4_model_eval_batch(m, off, next, K, nm, lo, &err) == DS4_OK);
                    ds4_model_set_state_batches(m, true);
                    CHECK(ds4_model_eval_batch(m, on, next, K, nm, lb, &err) == DS4_OK);
                    differ += memcmp(lo, lb, (size_t)(K * vocab) * sizeof *lo) != 0;
                }
                CHECK_MSG(differ == 0, "%s numerics: %d batched steps differ with the state batches off",
                          ni ? "ds4" : "reference", differ);
                for (int i = 0; i < K; i++) {
                    ds4_state_free(off[i]);
                    ds4_state_free(on[i]);
                }
            }
            free(lo);
        }
        for (int i = 0; i < K; i++) {
            ds4_state_free(batch[i]);
            ds4_state_free(single[i]);
        }
        free(lb);
        free(ls);
        free(t);
    }
    close_model(f, be, m);
}

/*
 * A host wait in the middle of a recorded step (here a download) submits
 * what was recorded so far first: the values seen are those of program
 * order, before and after the wait, and the step's work is all done.
 */
static void test_step_break_keeps_order(void) {
    SETUP_OR_SKIP();
    ds4_error err = { 0 };
    ds4_backend *be = NULL;
    CHECK_MSG(ds4_backend_create("cuda", 0, &be, &err) == DS4_OK, "%s", err.message);
    if (!be) return;
    ds4_cuda_backend_set_graphs(be, 1);
    const ds4_backend_ops *o = be->ops;
    const int64_t n = 4099;
    float *a = o->alloc(be, n), *b = o->alloc(be, n), *h = malloc((size_t)n * sizeof *h);
    for (int round = 0; round < 3; round++) {
        o->step_begin(be);
        o->fill(be, a, 1.5f + (float)round, n);
        o->fill(be, b, 2.0f, n);
        o->add(be, a, b, a, n); /* a = 3.5 + round */
        o->download(be, h, a, n);
        int bad = 0;
        for (int64_t i = 0; i < n; i++) bad += h[i] != 3.5f + (float)round;
        CHECK_MSG(bad == 0, "round %d: %d values before the wait are wrong (first %g)", round, bad, (double)h[0]);
        o->add(be, a, a, b, n); /* b = 7 + 2 round */
        o->copy(be, a + 1, a, n - 1); /* overlapping: a[i] = a[i - 1] for i >= 1 */
        o->step_end(be);
        o->download(be, h, b, n);
        bad = 0;
        for (int64_t i = 0; i < n; i++) bad += h[i] != 7.0f + 2.0f * (float)round;
        CHECK_MSG(bad == 0, "round %d: %d values after the wait are wrong (first %g)", round, bad, (double)h[0]);
        o->download(be, h, a, n);
        bad = 0;
        for (int64_t i = 0; i < n; i++) bad += h[i] != 3.5f + (float)round;
        CHECK_MSG(bad == 0, "round %d: the overlapping copy left %d wrong values", round, bad);
    }
    /* a whole recorded step without a wait, replayed with other values */
    for (int round = 0; round < 3; round++) {
        o->step_begin(be);
        o->fill(be, a, (float)round, n);
        o->add(be, a, a, b, n);
        o->step_end(be);
        o->download(be, h, b, n);
        int bad = 0;
        for (int64_t i = 0; i < n; i++) bad += h[i] != 2.0f * (float)round;
        CHECK_MSG(bad == 0, "replayed step %d: %d wrong values (first %g)", round, bad, (double)h[0]);
    }
    ds4_backend_counters c;
    ds4_backend_counters_get(be, &c);
    CHECK_MSG(c.graphs == 3 && c.graph_builds == 1 && c.graph_launches == 3,
              "%llu steps as graphs, %llu graph launches, %llu built (3, 3 and 1 expected)",
              (unsigned long long)c.graphs, (unsigned long long)c.graph_launches, (unsigned long long)c.graph_builds);
    /* a step in segments: marks 1 and 3 cut it (marks 2 and 4 do not), a
     * download after the cuts submits the rest; every value as in program
     * order, and the three segments' graphs are replayed the next rounds */
    ds4_cuda_backend_set_segments(be, 1);
    for (int round = 0; round < 3; round++) {
        ds4_backend_counters s0, s1;
        ds4_backend_counters_get(be, &s0);
        o->step_begin(be);
        o->fill(be, a, (float)round, n);
        o->step_mark(be); /* 1: cut */
        o->fill(be, b, 1.0f, n);
        o->add(be, a, b, a, n); /* a = round + 1 */
        o->step_mark(be); /* 2 */
        o->add(be, a, a, b, n); /* b = 2 round + 2 */
        o->step_mark(be); /* 3: cut */
        o->add(be, a, b, a, n); /* a = 3 round + 3 */
        o->step_mark(be); /* 4 */
        o->step_end(be);
        ds4_backend_counters_get(be, &s1);
        o->download(be, h, a, n);
        int bad = 0;
        for (int64_t i = 0; i < n; i++) bad += h[i] != 3.0f * (float)round + 3.0f;
        o->download(be, h, b, n);
        for (int64_t i = 0; i < n; i++) bad += h[i] != 2.0f * (float)round + 2.0f;
        CHECK_MSG(bad == 0, "segmented step %d: %d wrong values", round, bad);
        CHECK_MSG(s1.graph_launches - s0.graph_launches == 3 && s1.graphs - s0.graphs == 1 &&
                      s1.graph_builds - s0.graph_builds == (round == 0 ? 3u : 0u),
                  "segmented step %d: %llu graph launches, %llu steps, %llu built", round,
                  (unsigned long long)(s1.graph_launches - s0.graph_launches),
                  (unsigned long long)(s1.graphs - s0.graphs),
                  (unsigned long long)(s1.graph_builds - s0.graph_builds));
    }
    CHECK(o->take_error(be, &err) == DS4_OK);
    free(h);
    o->free(be, a);
    o->free(be, b);
    ds4_backend_destroy(be);
}

static void test_teardown(void) {
    ds4_engine_close(gpu_engine);
    ds4_engine_close(cpu_engine);
    gpu_engine = cpu_engine = NULL;
    if (skip_reason[0]) TEST_SKIP("%s", skip_reason);
    CHECK(model_path[0] && unlink(model_path) == 0); /* the model file was made and is removed */
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_gpu_matches_cpu_and_itself),
    TEST_ENTRY(test_checkpoint_cuda_to_cpu),
    TEST_ENTRY(test_checkpoint_cpu_to_cuda),
    TEST_ENTRY(test_decode_step_waits),
    TEST_ENTRY(test_graph_replay_matches_direct),
    TEST_ENTRY(test_deferred_sinkhorn_matches),
    TEST_ENTRY(test_prefetch_matches),
    TEST_ENTRY(test_batch_decode_matches_single),
    TEST_ENTRY(test_compressor_chunks_match),
    TEST_ENTRY(test_step_break_keeps_order),
    TEST_ENTRY(test_teardown),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

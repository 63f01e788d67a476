/* test_cuda_attention.c - the CUDA attention-side ops (rope_tail, attention,
 * compressor_pool, indexer_scores, top_k) against the CPU backend, element by
 * element, plus their error paths.
 *
 * Tolerances (u = 2^-24, the float unit roundoff) follow from how each side
 * computes; they are worst-case bounds of float rounding, computed per element
 * from the data (a double-precision pass on the host gives the magnitudes), so
 * a reordered but correct GPU reduction passes and a wrong row, weight or
 * index does not:
 *   rope_tail       both sides round the same double angle's cos/sin to float
 *                   and rotate in the same float order; they differ only when
 *                   CUDA's and the C library's double pow/cos/sin differ in
 *                   the last double bit across a float rounding boundary: one
 *                   ulp of a cos/sin, i.e. 2u (|x0| + |x1|) per element.
 *   attention       float dots (CPU: 8 sequential lanes; GPU: any tree),
 *                   float softmax and weighted sums in different orders.
 *   compressor_pool the same operation order on both sides; expf may differ
 *                   in its last ulps.
 *   indexer_scores  float dots in different orders, the same head order.
 *   top_k           exact: the same index list.
 * Without a usable CUDA device every test reports itself as skipped. */
#include <float.h>
#include <stdlib.h>

#include "cuda_op_test.h"
#include "core/rounding.h"

#define OPEN_OR_SKIP(p)                                                           \
    do {                                                                          \
        if (!op_pair_open(p)) TEST_SKIP("%s", op_pair_skip_reason);               \
    } while (0)

#define U ((double)FLT_EPSILON / 2.0) /* float unit roundoff, 2^-24 */
#define GUARD 64                      /* poisoned floats after each output */

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

static int64_t rand_range(int64_t lo, int64_t hi) { /* [lo, hi] */
    return lo + (int64_t)(test_rand_u64() % (uint64_t)(hi - lo + 1));
}

static double max_abs(const float *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        if (fabs(x[i]) > m) m = fabs(x[i]);
    return m;
}

/* Compare n floats of b with a tolerance per element: |g - c| <= tol[i]
 * (equal infinities pass; NaN never does). Returns the failures. */
static int64_t compare_each(const char *what, op_pair *p, op_buf b, int64_t n, const double *tol) {
    float *hc = malloc((size_t)(n > 0 ? n : 1) * sizeof *hc), *hg = malloc((size_t)(n > 0 ? n : 1) * sizeof *hg);
    p->cpu->ops->download(p->cpu, hc, b.c, n);
    p->gpu->ops->download(p->gpu, hg, b.g, n);
    int64_t bad = 0, worst = -1;
    double worst_ratio = -1;
    for (int64_t i = 0; i < n; i++) {
        const double c = hc[i], g = hg[i];
        bool ok;
        if (isinf(c) || isinf(g)) ok = c == g;
        else ok = fabs(g - c) <= tol[i];
        if (!ok) {
            bad++;
            const double r = isnan(g - c) ? INFINITY : fabs(g - c) / (tol[i] > 0 ? tol[i] : 1e-300);
            if (r > worst_ratio) worst_ratio = r, worst = i;
        }
    }
    if (bad) {
        fprintf(stderr, "  FAIL %s: %lld of %lld elements out of tolerance; worst [%lld] cpu %.9g cuda %.9g tol %.3g\n",
                what, (long long)bad, (long long)n, (long long)worst, hc[worst], hg[worst], tol[worst]);
        test_current_failures++;
    }
    free(hc);
    free(hg);
    return bad;
}

/* The GPU side wrote nothing in [from, from + count) of a poisoned buffer. */
static void expect_untouched(const char *what, op_pair *p, op_buf b, int64_t from, int64_t count) {
    float *h = malloc((size_t)count * sizeof *h);
    p->gpu->ops->download(p->gpu, h, b.g + from, count);
    int64_t written = 0;
    for (int64_t i = 0; i < count; i++) written += !isnan(h[i]);
    CHECK_MSG(written == 0, "%s: %lld floats past the output were written", what, (long long)written);
    free(h);
}

/* Both backends recorded DS4_ERR_INVALID with the same message. */
static void expect_same_error(op_pair *p, const char *what) {
    ds4_error ec = { 0 }, eg = { 0 };
    ds4_status sc = p->cpu->ops->take_error(p->cpu, &ec);
    ds4_status sg = p->gpu->ops->take_error(p->gpu, &eg);
    CHECK_MSG(sc == DS4_ERR_INVALID, "%s: cpu status %d", what, (int)sc);
    CHECK_MSG(sg == DS4_ERR_INVALID, "%s: cuda status %d: %s", what, (int)sg, eg.message);
    CHECK_MSG(strcmp(ec.message, eg.message) == 0, "%s: messages differ: cpu \"%s\" cuda \"%s\"", what, ec.message,
              eg.message);
}

/* ------------------------------------------------------------------------ */
/* rope_tail                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct rope_case {
    int64_t n_rows, n_heads, head_dim;
    int n_rot;
    float base, factor, yarn_lo, yarn_hi;
    int64_t max_pos;
} rope_case;

static void test_rope_tail(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    static const rope_case cases[] = {
        { 5, 64, 512, 64, 10000.0f, 1.0f, 0.0f, 0.0f, 1 << 20 },        /* q, plain (dense layers) */
        { 3, 1, 512, 64, 160000.0f, 16.0f, 9.6f, 21.3f, 1000000 },    /* kv / compressed row, YaRN */
        { 1, 64, 128, 64, 160000.0f, 16.0f, 9.6f, 21.3f, 1048575 },   /* indexer q */
        { 300, 8, 64, 64, 10000.0f, 1.0f, 0.0f, 0.0f, 4096 },         /* many rows, n_rot == head_dim */
        { 7, 3, 10, 4, 10000.0f, 1.0f, 0.0f, 0.0f, 999999 },          /* small heads */
        { 4, 2, 16, 16, 500.0f, 4.0f, 2.0f, 2.0f, 1000000 },          /* empty ramp (span clamped) */
        { 2, 5, 64, 32, 10000.0f, 8.0f, 12.0f, 3.0f, 1000000 },       /* lo > hi */
        { 2, 3000, 8, 8, 10000.0f, 1.0f, 0.0f, 0.0f, 1000000 },       /* many heads: several head groups */
        { 1, 1, 2, 2, 10000.0f, 1.0f, 0.0f, 0.0f, 1000000 },          /* one pair */
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const rope_case *rc = &cases[ci];
        const ds4_rope rope = { rc->n_rot, rc->base, rc->factor, rc->yarn_lo, rc->yarn_hi };
        const int64_t n = rc->n_rows * rc->n_heads * rc->head_dim;
        int32_t *pos = malloc((size_t)rc->n_rows * sizeof *pos);
        for (int64_t r = 0; r < rc->n_rows; r++) pos[r] = (int32_t)rand_range(0, rc->max_pos);
        pos[0] = (int32_t)rc->max_pos;
        if (rc->n_rows > 1) pos[1] = 0;
        for (int inverse = 0; inverse <= 1; inverse++) {
            float *hx = op_rand(n, 1.0);
            op_buf x = op_buf_from(&p, hx, n);
            p.cpu->ops->rope_tail(p.cpu, x.c, rc->n_rows, rc->n_heads, rc->head_dim, pos, &rope, inverse);
            p.gpu->ops->rope_tail(p.gpu, x.g, rc->n_rows, rc->n_heads, rc->head_dim, pos, &rope, inverse);
            op_expect_ok(&p);
            /* one ulp (2u relative) of a cos or sin moves an output by at most
             * 2u (|x0| + |x1|) <= 4u max|x|; plus the output's own rounding
             * flipping (2u relative). The unrotated dims must be unchanged. */
            char what[96];
            snprintf(what, sizeof what, "rope_tail case %zu%s", ci, inverse ? " inverse" : "");
            op_compare(what, &p, x, n, 4.0 * U * max_abs(hx, n), 2.0 * U);
            op_buf_free(&p, &x);
            free(hx);
        }
        free(pos);
    }
    /* n_rows 0 and n_heads 0 do nothing and are no error */
    {
        float *hx = op_rand(64, 1.0);
        op_buf x = op_buf_from(&p, hx, 64);
        const ds4_rope rope = { 64, 10000.0f, 1.0f, 0.0f, 0.0f };
        const int32_t pos0 = 5;
        p.gpu->ops->rope_tail(p.gpu, x.g, 0, 1, 64, &pos0, &rope, false);
        p.gpu->ops->rope_tail(p.gpu, x.g, 1, 0, 64, &pos0, &rope, false);
        op_expect_ok(&p);
        op_compare("rope_tail nothing to do", &p, x, 64, 0, 0);
        op_buf_free(&p, &x);
        free(hx);
    }
    op_pair_close(&p);
}

/* head_norm_rope: the fused kernel (ds4_cuda_backend_set_norm_rope) equals
 * the rmsnorm, rope_tail and rounding kernels one after the other bit for
 * bit, in one launch instead of two or four; both are near the CPU's op
 * (the norm's sum order and a cos/sin ulp; with the FP8 rounding an input
 * that far from the CPU's may land one FP8 step away). Shapes of q (64
 * heads of 512, no weight), KV (one head, an F32 or F16 weight, DS4
 * rounding), the indexer's q, heads that are not a multiple of 64 before
 * their RoPE dims (one sharing a thread's four values between FP8 values
 * and a RoPE pair), wide RoPE without the host's frequency table, and a
 * head the fused kernel does not take (the ops run). */
static void test_head_norm_rope(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    static const struct {
        int64_t n_rows, n_heads, head_dim;
        int n_rot;
        float factor;
        uint32_t wtype; /* 0: no weight */
        bool round_kv, fused;
    } cases[] = {
        { 5, 64, 512, 64, 1.0f, 0, false, true },
        { 9, 64, 512, 64, 1.0f, 0, false, true }, /* rows enough for the warp a head (CUDA_WIDE_MIN_ROWS) */
        { 3, 1, 512, 64, 16.0f, DS4_TYPE_F32, true, true },
        { 12, 1, 512, 64, 16.0f, DS4_TYPE_F32, true, true },
        { 8, 2, 352, 18, 1.0f, DS4_TYPE_F32, true, true },
        { 4, 1, 512, 64, 16.0f, DS4_TYPE_F16, true, true },
        { 2, 64, 128, 64, 16.0f, 0, false, true },
        { 3, 2, 352, 16, 1.0f, DS4_TYPE_F32, true, true },
        { 3, 2, 352, 18, 1.0f, DS4_TYPE_F32, true, true }, /* a float4 of FP8 values and a RoPE pair */
        { 2, 3, 4096, 64, 1.0f, 0, true, true },
        { 2, 1, 4096, 192, 16.0f, 0, false, true }, /* no host frequency table (n_rot > 128) */
        { 3, 2, 98, 18, 1.0f, DS4_TYPE_F32, true, false },
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int64_t rows = cases[ci].n_rows, heads = cases[ci].n_heads, hd = cases[ci].head_dim;
        const int64_t n = rows * heads * hd;
        const ds4_rope rope = { cases[ci].n_rot, 160000.0f, cases[ci].factor, 9.6f, 21.3f };
        int32_t *pos = malloc((size_t)rows * sizeof *pos);
        for (int64_t r = 0; r < rows; r++) pos[r] = (int32_t)rand_range(0, 1000000);
        float *hw = op_rand(hd, 1.0), *hx = op_rand(n, 3.0);
        op_weight *w = cases[ci].wtype ? op_weight_floats(&p, "blk.0.attn_kv_a_norm.weight", cases[ci].wtype, hd, 1, 1, hw)
                                       : NULL;
        op_buf x = op_buf_from(&p, hx, n), x2 = op_buf_from(&p, hx, n);
        char what[128];
        snprintf(what, sizeof what, "head_norm_rope case %zu (%lld x %lld heads of %lld)", ci, (long long)rows,
                 (long long)heads, (long long)hd);
        p.cpu->ops->head_norm_rope(p.cpu, x.c, rows, heads, hd, w ? &w->c : NULL, 1e-6f, pos, &rope,
                                   cases[ci].round_kv);
        ds4_cuda_backend_set_norm_rope(p.gpu, 0);
        const ds4_backend_counters c0 = op_gpu_counters(&p);
        p.gpu->ops->head_norm_rope(p.gpu, x2.g, rows, heads, hd, w ? &w->g : NULL, 1e-6f, pos, &rope,
                                   cases[ci].round_kv);
        const ds4_backend_counters c1 = op_gpu_counters(&p);
        ds4_cuda_backend_set_norm_rope(p.gpu, 1);
        p.gpu->ops->head_norm_rope(p.gpu, x.g, rows, heads, hd, w ? &w->g : NULL, 1e-6f, pos, &rope,
                                   cases[ci].round_kv);
        const ds4_backend_counters c2 = op_gpu_counters(&p);
        ds4_cuda_backend_set_norm_rope(p.gpu, env_on_default("DS4_CUDA_NORM_ROPE", true));
        /* the fused kernel's block per head (set_wide_rows 0) against its warp per head (heads of <= 512) */
        op_buf x3 = op_buf_from(&p, hx, n);
        ds4_cuda_backend_set_wide_rows(p.gpu, !env_on_default("DS4_CUDA_WIDE_ROWS", true));
        p.gpu->ops->head_norm_rope(p.gpu, x3.g, rows, heads, hd, w ? &w->g : NULL, 1e-6f, pos, &rope,
                                   cases[ci].round_kv);
        ds4_cuda_backend_set_wide_rows(p.gpu, env_on_default("DS4_CUDA_WIDE_ROWS", true));
        op_expect_ok(&p);
        /* (a weight other than F32 is dequantised by a kernel of its own each call) */
        const uint64_t ops_n = c1.launches - c0.launches, fused_n = c2.launches - c1.launches;
        const uint64_t dq = cases[ci].wtype && cases[ci].wtype != DS4_TYPE_F32 ? 1u : 0u;
        CHECK_MSG(ops_n == (cases[ci].round_kv ? 4u : 2u) + dq && fused_n == (cases[ci].fused ? 1u + dq : ops_n),
                  "%s: %llu launches as ops, %llu fused", what, (unsigned long long)ops_n,
                  (unsigned long long)fused_n);
        float *ha = malloc((size_t)n * sizeof *ha), *hb = malloc((size_t)n * sizeof *hb);
        p.gpu->ops->download(p.gpu, ha, x.g, n);
        p.gpu->ops->download(p.gpu, hb, x2.g, n);
        CHECK_MSG(memcmp(ha, hb, (size_t)n * sizeof *ha) == 0, "%s: the fused kernel differs from the ops' kernels",
                  what);
        p.gpu->ops->download(p.gpu, hb, x3.g, n);
        CHECK_MSG(memcmp(ha, hb, (size_t)n * sizeof *ha) == 0,
                  "%s: the fused kernel's warp and block forms differ", what);
        op_buf_free(&p, &x3);
        /* the norm: a few roundings of |y| <= sqrt(hd) max|w|; RoPE: 4u max|y|
         * more; FP8: one step of E4M3 (2^-3 relative, or its subnormal quantum) */
        const double ymax = sqrt((double)hd) * (w ? max_abs(hw, hd) : 1.0);
        const double atol = cases[ci].round_kv ? ymax / 512.0 : 16.0 * U * ymax;
        op_compare(what, &p, x, n, atol, cases[ci].round_kv ? 0.125 : 8.0 * U);
        free(ha);
        free(hb);
        op_buf_free(&p, &x);
        op_buf_free(&p, &x2);
        op_weight_free(&p, w);
        free(hx);
        free(hw);
        free(pos);
    }
    /* bad arguments: the op's message, nothing written */
    {
        float *hx = op_rand(128, 1.0);
        op_buf x = op_buf_from(&p, hx, 128);
        const ds4_rope odd = { 15, 10000.0f, 1.0f, 0.0f, 0.0f };
        const int32_t pos0 = 5;
        /* (checked before the fused kernel or the ops are chosen) */
        p.gpu->ops->head_norm_rope(p.gpu, x.g, 1, 1, 128, NULL, 1e-6f, &pos0, NULL, false);
        op_expect_error_with(&p, "head_norm_rope without RoPE", "head_norm_rope", "no RoPE parameters", NULL);
        p.gpu->ops->head_norm_rope(p.gpu, x.g, 1, 1, 128, NULL, 1e-6f, &pos0, &odd, false);
        op_expect_error_with(&p, "head_norm_rope odd n_rot", "15 rotated dims in heads of 128", NULL);
        op_compare("head_norm_rope refused", &p, x, 128, 0, 0);
        op_buf_free(&p, &x);
        free(hx);
    }
    op_pair_close(&p);
}

/* head_norm_rope2: a row set of q heads and one of KV rows of the same rows
 * in one launch where both suit the fused kernel, bit for bit the two
 * head_norm_rope calls (on the GPU, each fused the same way) and so near
 * the CPU's two calls; where one does not suit it, the two calls' kernels.
 * Refused: a NULL row set, row sets that overlap, a set head_norm_rope
 * refuses (its message); nothing written. */
static void test_head_norm_rope2(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    static const struct {
        int64_t n_rows, heads_q, head_dim;
        int n_rot;
        uint32_t wtype; /* the KV set's weight */
        uint32_t wtype_q; /* the q set's (0: none, the model's) */
        bool fused;
    } cases[] = {
        { 1, 64, 512, 64, DS4_TYPE_F32, 0, true }, /* the model's decode */
        { 5, 64, 512, 64, DS4_TYPE_F32, 0, true },
        { 10, 64, 512, 64, DS4_TYPE_F32, 0, true }, /* the warp a head (rows >= CUDA_WIDE_MIN_ROWS) */
        { 3, 2, 352, 18, DS4_TYPE_F16, 0, true },
        { 3, 2, 352, 18, DS4_TYPE_F16, DS4_TYPE_F32, true },
        { 3, 2, 352, 18, DS4_TYPE_F16, DS4_TYPE_F16, false }, /* two converted weights: the two calls */
        { 2, 3, 98, 18, DS4_TYPE_F32, 0, false },
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int64_t rows = cases[ci].n_rows, hq = cases[ci].heads_q, hd = cases[ci].head_dim;
        const int64_t nq = rows * hq * hd, nk = rows * hd;
        const ds4_rope rope = { cases[ci].n_rot, 160000.0f, 16.0f, 9.6f, 21.3f };
        int32_t *pos = malloc((size_t)rows * sizeof *pos);
        for (int64_t r = 0; r < rows; r++) pos[r] = (int32_t)rand_range(0, 1000000);
        float *hw = op_rand(hd, 1.0), *hwq = op_rand(hd, 1.0), *hxq = op_rand(nq, 3.0), *hxk = op_rand(nk, 3.0);
        op_weight *w = op_weight_floats(&p, "blk.0.attn_kv_a_norm.weight", cases[ci].wtype, hd, 1, 1, hw);
        op_weight *wq = cases[ci].wtype_q ? op_weight_floats(&p, "blk.0.q_norm.weight", cases[ci].wtype_q, hd, 1, 1, hwq)
                                          : NULL;
        op_buf q = op_buf_from(&p, hxq, nq), k = op_buf_from(&p, hxk, nk);
        op_buf q2 = op_buf_from(&p, hxq, nq), k2 = op_buf_from(&p, hxk, nk);
        char what[128];
        snprintf(what, sizeof what, "head_norm_rope2 case %zu (%lld rows, %lld + 1 heads of %lld)", ci,
                 (long long)rows, (long long)hq, (long long)hd);
        p.cpu->ops->head_norm_rope(p.cpu, q.c, rows, hq, hd, wq ? &wq->c : NULL, 1e-6f, pos, &rope, false);
        p.cpu->ops->head_norm_rope(p.cpu, k.c, rows, 1, hd, &w->c, 1e-6f, pos, &rope, true);
        const ds4_backend_counters c0 = op_gpu_counters(&p);
        p.gpu->ops->head_norm_rope(p.gpu, q2.g, rows, hq, hd, wq ? &wq->g : NULL, 1e-6f, pos, &rope, false);
        p.gpu->ops->head_norm_rope(p.gpu, k2.g, rows, 1, hd, &w->g, 1e-6f, pos, &rope, true);
        const ds4_backend_counters c1 = op_gpu_counters(&p);
        const ds4_head_rows a = { q.g, hq, wq ? &wq->g : NULL, false }, b = { k.g, 1, &w->g, true };
        p.gpu->ops->head_norm_rope2(p.gpu, &a, &b, rows, hd, 1e-6f, pos, &rope);
        const ds4_backend_counters c2 = op_gpu_counters(&p);
        op_expect_ok(&p);
        /* (an F16 weight is dequantised by a kernel of its own each call) */
        const uint64_t dq = (cases[ci].wtype != DS4_TYPE_F32) + (cases[ci].wtype_q == DS4_TYPE_F16);
        const uint64_t two = c1.launches - c0.launches, one = c2.launches - c1.launches;
        const bool fused = cases[ci].fused && env_on_default("DS4_CUDA_NORM_ROPE", true) &&
                           env_on_default("DS4_CUDA_NORM_ROPE2", true);
        CHECK_MSG(one == (fused ? 1u + dq : two), "%s: %llu launches (the two calls: %llu)", what,
                  (unsigned long long)one, (unsigned long long)two);
        float *ha = malloc((size_t)nq * sizeof *ha), *hb = malloc((size_t)nq * sizeof *hb);
        p.gpu->ops->download(p.gpu, ha, q.g, nq);
        p.gpu->ops->download(p.gpu, hb, q2.g, nq);
        CHECK_MSG(memcmp(ha, hb, (size_t)nq * sizeof *ha) == 0, "%s: q differs from head_norm_rope's", what);
        p.gpu->ops->download(p.gpu, ha, k.g, nk);
        p.gpu->ops->download(p.gpu, hb, k2.g, nk);
        CHECK_MSG(memcmp(ha, hb, (size_t)nk * sizeof *ha) == 0, "%s: kv differs from head_norm_rope's", what);
        /* against the CPU as test_head_norm_rope */
        const double ymax = sqrt((double)hd) * (wq ? max_abs(hwq, hd) : 1.0);
        op_compare(what, &p, q, nq, 16.0 * U * ymax, 8.0 * U);
        op_compare(what, &p, k, nk, sqrt((double)hd) * max_abs(hw, hd) / 512.0, 0.125);
        free(ha);
        free(hb);
        op_buf_free(&p, &q);
        op_buf_free(&p, &k);
        op_buf_free(&p, &q2);
        op_buf_free(&p, &k2);
        op_weight_free(&p, w);
        op_weight_free(&p, wq);
        free(hxq);
        free(hxk);
        free(hw);
        free(hwq);
        free(pos);
    }
    /* refused: the message, nothing written */
    {
        float *hx = op_rand(256, 1.0);
        op_buf x = op_buf_from(&p, hx, 256);
        const ds4_rope rope = { 64, 10000.0f, 1.0f, 0.0f, 0.0f }, odd = { 15, 10000.0f, 1.0f, 0.0f, 0.0f };
        const int32_t pos0 = 5;
        const ds4_head_rows a = { x.g, 1, NULL, false }, b = { x.g + 128, 1, NULL, true }, over = { x.g + 64, 1, NULL, true };
        p.gpu->ops->head_norm_rope2(p.gpu, &a, NULL, 1, 128, 1e-6f, &pos0, &rope);
        op_expect_error_with(&p, "head_norm_rope2 without a set", "head_norm_rope2", "NULL row set", NULL);
        p.gpu->ops->head_norm_rope2(p.gpu, &a, &over, 1, 128, 1e-6f, &pos0, &rope);
        op_expect_error_with(&p, "head_norm_rope2 overlapping", "head_norm_rope2", "overlap", NULL);
        p.gpu->ops->head_norm_rope2(p.gpu, &a, &b, 1, 128, 1e-6f, &pos0, &odd);
        op_expect_error_with(&p, "head_norm_rope2 odd n_rot", "15 rotated dims in heads of 128", NULL);
        op_compare("head_norm_rope2 refused", &p, x, 256, 0, 0);
        op_buf_free(&p, &x);
        free(hx);
    }
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* attention                                                                 */
/* ------------------------------------------------------------------------ */

typedef enum { SEL_NONE, SEL_DISTINCT, SEL_REPEATS } sel_kind;

typedef struct att_case {
    const char *name;
    int64_t n_heads, dim, n_a, n_b, n_rows_b; /* n_rows_b: rows in rows_b (selection) */
    sel_kind sel;
    double q_scale, sink_mean, sink_scale;
    uint32_t sink_type;
    int64_t sink_ne0; /* >= n_heads; 0 = n_heads */
} att_case;

/*
 * Tolerance of out[h][i]. Per head, in double: s_r = q_h . row_r * kq, the
 * softmax weights p_r (with the sink) and A_i = sum_r p_r |row_r[i]|.
 *   scores: a float dot of dim terms accumulated in chains of dim/8 (CPU) and
 *     about dim/32 + 5 (GPU, warp lanes then a tree) terms errs by at most
 *     (chain + 1) u sum_i |q_i r_i| kq on each side: E = (dim/8 + dim/32 + 16)
 *     u S, S = max_r sum_i |q_i r_i| kq;
 *   weights: p_r = exp(s_r - m) / den shifts by at most 2E relatively from
 *     the scores, plus the expf error and the denominators' sums (chains of
 *     n on the CPU): (2n + 24) u;
 *   output: the weighted sums of n rows on each side, (2n + 24) u A_i more.
 * tol = A_i (2E + (4n + 48) u). Worst-case bounds: typical errors are far
 * smaller, but a misplaced row, weight or sink moves outputs by p_r |row|.
 */
static void attention_tolerance(const att_case *ac, const float *q, const float *rows_a, const float *rows_b,
                                const int32_t *idx, const float *sinks, double *tol) {
    const int64_t n = ac->n_a + ac->n_b, dim = ac->dim;
    const double kq = (double)(1.0f / sqrtf((float)dim));
    double *s = malloc((size_t)(n > 0 ? n : 1) * sizeof *s);
    for (int64_t h = 0; h < ac->n_heads; h++) {
        const float *qh = q + h * dim;
        double m = sinks[h], S = 0;
        for (int64_t r = 0; r < n; r++) {
            const float *row = r < ac->n_a ? rows_a + r * dim
                                           : rows_b + (idx ? (int64_t)idx[r - ac->n_a] : r - ac->n_a) * dim;
            double d = 0, a = 0;
            for (int64_t i = 0; i < dim; i++) {
                d += (double)qh[i] * row[i];
                a += fabs((double)qh[i] * row[i]);
            }
            s[r] = d * kq;
            if (s[r] > m) m = s[r];
            if (a * kq > S) S = a * kq;
        }
        double den = exp(sinks[h] - m);
        for (int64_t r = 0; r < n; r++) den += exp(s[r] - m);
        const double E = ((double)dim / 8 + (double)dim / 32 + 16) * U * S;
        const double rel = 2 * E + (4 * (double)n + 48) * U;
        for (int64_t i = 0; i < dim; i++) {
            double A = 0, R = 0;
            for (int64_t r = 0; r < n; r++) {
                const float *row = r < ac->n_a ? rows_a + r * dim
                                               : rows_b + (idx ? (int64_t)idx[r - ac->n_a] : r - ac->n_a) * dim;
                A += exp(s[r] - m) / den * fabs((double)row[i]);
                R += fabs((double)row[i]);
            }
            /* plus underflow: a weight or a product in the subnormal range is
             * off by up to half its spacing, 2^-150, absolutely (the relative
             * bound above does not hold there) */
            tol[h * dim + i] = A * rel + 4 * 0x1p-150 * (R + (double)n);
        }
    }
    free(s);
}

static void attention_case(op_pair *p, const att_case *ac) {
    const int64_t dim = ac->dim, n_heads = ac->n_heads, n_b = ac->n_b;
    const int64_t n_rows_b = ac->sel == SEL_NONE ? n_b : ac->n_rows_b;
    const int64_t sink_ne0 = ac->sink_ne0 ? ac->sink_ne0 : n_heads;
    /* at least one float each: a buffer of 1 is uploaded for empty inputs */
    float *hq = op_rand(n_heads * dim, ac->q_scale);
    float *ha = op_rand(ac->n_a * dim > 0 ? ac->n_a * dim : 1, 1.0);
    float *hb = op_rand(n_rows_b * dim > 0 ? n_rows_b * dim : 1, 1.0);
    float *hs = op_rand(sink_ne0, ac->sink_scale);
    for (int64_t h = 0; h < sink_ne0; h++) hs[h] += (float)ac->sink_mean;
    int32_t *idx = NULL;
    if (ac->sel != SEL_NONE) {
        idx = malloc((size_t)(n_b > 0 ? n_b : 1) * sizeof *idx);
        if (ac->sel == SEL_DISTINCT) { /* a random subset of distinct rows, in random order */
            int32_t *perm = malloc((size_t)n_rows_b * sizeof *perm);
            for (int64_t i = 0; i < n_rows_b; i++) perm[i] = (int32_t)i;
            for (int64_t i = n_rows_b - 1; i > 0; i--) {
                const int64_t j = rand_range(0, i);
                const int32_t t = perm[i];
                perm[i] = perm[j];
                perm[j] = t;
            }
            for (int64_t i = 0; i < n_b; i++) idx[i] = perm[i];
            free(perm);
        } else {
            for (int64_t i = 0; i < n_b; i++) idx[i] = (int32_t)rand_range(0, n_rows_b - 1);
            if (n_b >= 3) idx[n_b - 1] = idx[n_b - 2] = idx[0]; /* certainly repeated */
        }
    }
    op_weight *sinks = op_weight_floats(p, "attn_sinks", ac->sink_type, sink_ne0, 1, 1, hs);
    /* the sink values the op sees (rounded to the weight's type) */
    float *sink_vals = malloc((size_t)sink_ne0 * sizeof *sink_vals);
    ds4_type_traits_get(ac->sink_type)->dequant_row(sinks->bytes, sink_vals, sink_ne0);

    op_buf q = op_buf_from(p, hq, n_heads * dim);
    op_buf ra = op_buf_from(p, ha, ac->n_a * dim > 0 ? ac->n_a * dim : 1);
    op_buf rb = op_buf_from(p, hb, n_rows_b * dim > 0 ? n_rows_b * dim : 1);
    op_buf out = op_buf_poisoned(p, n_heads * dim + GUARD);
    /* the selected rows in backend memory, as top_k leaves them */
    op_buf ib = op_ints_from(p, idx, idx ? n_b : 0);
    p->cpu->ops->attention(p->cpu, q.c, n_heads, dim, ra.c, ac->n_a, rb.c, n_rows_b, idx ? (const int32_t *)ib.c : NULL,
                           n_b, &sinks->c, out.c);
    p->gpu->ops->attention(p->gpu, q.g, n_heads, dim, ra.g, ac->n_a, rb.g, n_rows_b, idx ? (const int32_t *)ib.g : NULL,
                           n_b, &sinks->g, out.g);
    op_expect_ok(p);

    double *tol = malloc((size_t)(n_heads * dim) * sizeof *tol);
    attention_tolerance(ac, hq, ha, hb, idx, sink_vals, tol);
    char what[160];
    snprintf(what, sizeof what, "attention %s (%lld heads of %lld, %lld + %lld rows)", ac->name, (long long)n_heads,
             (long long)dim, (long long)ac->n_a, (long long)n_b);
    compare_each(what, p, out, n_heads * dim, tol);
    expect_untouched(what, p, out, n_heads * dim, GUARD);
    /* again: the selected rows are read on the GPU, nothing waits */
    const ds4_backend_counters c0 = op_gpu_counters(p);
    p->gpu->ops->attention(p->gpu, q.g, n_heads, dim, ra.g, ac->n_a, rb.g, n_rows_b, idx ? (const int32_t *)ib.g : NULL,
                           n_b, &sinks->g, out.g);
    op_expect_no_host_traffic(p, what, &c0);
    op_expect_ok(p);

    free(tol);
    op_buf_free(p, &q);
    op_buf_free(p, &ra);
    op_buf_free(p, &rb);
    op_buf_free(p, &out);
    op_buf_free(p, &ib);
    op_weight_free(p, sinks);
    free(sink_vals);
    free(idx);
    free(hq);
    free(ha);
    free(hb);
    free(hs);
}

static void test_attention(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const uint32_t F32 = DS4_TYPE_F32;
    const att_case cases[] = {
        /* name                 heads dim  n_a  n_b  rows_b sel          q    sink mean/scale  type */
        { "decode ratio 4", 64, 512, 128, 512, 2000, SEL_REPEATS, 1.0, 0.0, 1.0, F32, 0 },
        { "window only 1", 64, 512, 1, 0, 0, SEL_NONE, 1.0, 0.0, 1.0, F32, 0 },
        { "window only 37", 8, 512, 37, 0, 0, SEL_NONE, 1.0, 0.0, 1.0, F32, 0 },
        { "window only 128", 64, 512, 128, 0, 0, SEL_NONE, 1.0, 0.0, 1.0, F32, 0 },
        { "distinct selection", 16, 512, 128, 512, 600, SEL_DISTINCT, 1.0, 0.0, 1.0, F32, 0 },
        { "repeated selection", 4, 64, 10, 300, 7, SEL_REPEATS, 1.0, 0.0, 1.0, F32, 0 },
        { "selection empty", 8, 512, 20, 0, 10, SEL_REPEATS, 1.0, 0.0, 1.0, F32, 0 },
        { "all rows (ratio 128)", 64, 512, 128, 1000, 0, SEL_NONE, 1.0, 0.0, 1.0, F32, 0 },
        { "many rows", 2, 64, 3, 20000, 0, SEL_NONE, 1.0, 0.0, 1.0, F32, 0 },
        { "no window", 8, 512, 0, 100, 300, SEL_DISTINCT, 1.0, 0.0, 1.0, F32, 0 },
        { "no rows at all", 8, 64, 0, 0, 0, SEL_NONE, 1.0, 0.0, 1.0, F32, 0 },
        { "dim 8", 3, 8, 5, 9, 4, SEL_REPEATS, 1.0, 0.0, 1.0, F32, 0 },
        { "dim 33", 5, 33, 17, 40, 0, SEL_NONE, 1.0, 0.0, 1.0, F32, 0 },
        { "dim 1", 2, 1, 3, 4, 0, SEL_NONE, 1.0, 0.0, 1.0, F32, 0 },
        { "dim 1000", 3, 1000, 50, 70, 90, SEL_DISTINCT, 1.0, 0.0, 1.0, F32, 0 },
        { "128 heads", 128, 512, 128, 64, 0, SEL_NONE, 1.0, 0.0, 1.0, F32, 0 },
        { "large sinks", 64, 512, 128, 512, 900, SEL_REPEATS, 1.0, 30.0, 2.0, F32, 0 },
        { "small sinks", 64, 512, 128, 512, 900, SEL_REPEATS, 1.0, -40.0, 2.0, F32, 0 },
        { "large scores", 64, 512, 128, 512, 900, SEL_REPEATS, 8.0, 0.0, 1.0, F32, 0 },
        { "huge scores", 16, 512, 64, 256, 300, SEL_DISTINCT, 16.0, 0.0, 50.0, F32, 0 },
        { "F16 sinks", 64, 512, 32, 64, 80, SEL_DISTINCT, 1.0, 0.0, 1.0, DS4_TYPE_F16, 0 },
        { "BF16 sinks", 64, 512, 32, 64, 0, SEL_NONE, 1.0, 0.0, 1.0, DS4_TYPE_BF16, 0 },
        { "Q8_0 sinks", 64, 512, 32, 64, 0, SEL_NONE, 1.0, 0.0, 1.0, DS4_TYPE_Q8_0, 0 },
        { "more sinks than heads", 16, 128, 40, 30, 50, SEL_REPEATS, 1.0, 0.0, 1.0, F32, 64 },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) attention_case(&p, &cases[i]);
    /* random shapes in the model's ranges */
    for (int t = 0; t < 6; t++) {
        att_case ac = { "random shape", 0, 0, 0, 0, 0, SEL_NONE, 1.0, 0.0, 1.0, F32, 0 };
        ac.n_heads = rand_range(1, 64);
        ac.dim = (t & 1) ? 512 : rand_range(1, 700);
        ac.n_a = rand_range(1, 128);
        ac.n_b = rand_range(0, 512);
        ac.sel = (sel_kind)(t % 3);
        ac.n_rows_b = ac.sel == SEL_DISTINCT ? ac.n_b + rand_range(0, 300) : rand_range(1, 1000);
        ac.q_scale = 0.5 + 3.0 * test_rand_uniform();
        ac.sink_mean = 4.0 * test_rand_normal();
        attention_case(&p, &ac);
    }
    op_pair_close(&p);
}

/* attention_rows: the rows of a prefill run, each with its own view of one
 * window buffer (first row, rows; empty views too) and its own count of
 * compressed rows (0 .. all), no selection, against the CPU with
 * test_attention's tolerance: 8 and 64 heads of 512 take the one-launch
 * shared-row kernel (rows of different lengths, so some splits are empty),
 * 4 heads and dim 64 the single-row kernels row by row. Bad views and NULL
 * arrays are errors. */
static void attention_rows_case(op_pair *p, int64_t nh, int64_t dim) {
    enum { N = 13 };
    const int64_t n_win = 140, n_comp = 90;
    int64_t a_off[N], a_n[N], b_n[N];
    for (int r = 0; r < N; r++) {
        a_off[r] = r;                                    /* a window that slides, as in a run */
        a_n[r] = r == 0 ? 0 : rand_range(1, n_win - r);  /* row 0: no window rows */
        b_n[r] = r == 1 ? 0 : r == 2 ? n_comp : rand_range(0, n_comp);
    }
    float *hq = op_rand(N * nh * dim, 1.0), *ha = op_rand(n_win * dim, 1.0), *hb = op_rand(n_comp * dim, 1.0);
    float *hs = op_rand(nh, 1.0);
    op_weight *sinks = op_weight_floats(p, "attn_sinks", DS4_TYPE_F32, nh, 1, 1, hs);
    op_buf q = op_buf_from(p, hq, N * nh * dim), ra = op_buf_from(p, ha, n_win * dim);
    op_buf rb = op_buf_from(p, hb, n_comp * dim);
    op_buf out = op_buf_poisoned(p, N * nh * dim + GUARD);
    p->cpu->ops->attention_rows(p->cpu, q.c, N, nh, dim, ra.c, a_off, a_n, rb.c, b_n, &sinks->c, out.c);
    p->gpu->ops->attention_rows(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_n, &sinks->g, out.g);
    op_expect_ok(p);
    double *tol = malloc((size_t)(N * nh * dim) * sizeof *tol);
    for (int r = 0; r < N; r++) {
        const att_case ac = { "row", nh, dim, a_n[r], b_n[r], b_n[r], SEL_NONE, 1.0, 0.0, 1.0, DS4_TYPE_F32, 0 };
        attention_tolerance(&ac, hq + r * nh * dim, ha + a_off[r] * dim, hb, NULL, hs, tol + r * nh * dim);
    }
    char what[96];
    snprintf(what, sizeof what, "attention_rows (13 rows, %lld heads of %lld)", (long long)nh, (long long)dim);
    compare_each(what, p, out, N * nh * dim, tol);
    expect_untouched(what, p, out, N * nh * dim, GUARD);
    /* the combine with a block per (head, row) (set_wide_rows 0) against its warp form: the same bits */
    {
        op_buf o0 = op_buf_poisoned(p, N * nh * dim);
        ds4_cuda_backend_set_wide_rows(p->gpu, 0);
        p->gpu->ops->attention_rows(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_n, &sinks->g, o0.g);
        ds4_cuda_backend_set_wide_rows(p->gpu, env_on_default("DS4_CUDA_WIDE_ROWS", true));
        op_expect_ok(p);
        CHECK_MSG(op_gpu_differ(p, o0, out, N * nh * dim) == 0, "%s: the combine's block and warp forms differ", what);
        op_buf_free(p, &o0);
    }
    /* attention_states: the same rows as rows of different states, odd rows reading the compressed rows of
     * another buffer (another allocation, other values) */
    {
        float *hb2 = op_rand(n_comp * dim, 1.0);
        op_buf rb2 = op_buf_from(p, hb2, n_comp * dim);
        const float *pa_c[N], *pa_g[N], *pb_c[N], *pb_g[N];
        for (int r = 0; r < N; r++) {
            pa_c[r] = ra.c + a_off[r] * dim, pa_g[r] = ra.g + a_off[r] * dim;
            pb_c[r] = r & 1 ? rb2.c : rb.c, pb_g[r] = r & 1 ? rb2.g : rb.g;
        }
        op_buf out2 = op_buf_poisoned(p, N * nh * dim + GUARD);
        p->cpu->ops->attention_states(p->cpu, q.c, N, nh, dim, pa_c, a_n, pb_c, b_n, &sinks->c, out2.c);
        p->gpu->ops->attention_states(p->gpu, q.g, N, nh, dim, pa_g, a_n, pb_g, b_n, &sinks->g, out2.g);
        op_expect_ok(p);
        for (int r = 0; r < N; r++) {
            const att_case ac = { "row", nh, dim, a_n[r], b_n[r], b_n[r], SEL_NONE, 1.0, 0.0, 1.0, DS4_TYPE_F32, 0 };
            attention_tolerance(&ac, hq + r * nh * dim, ha + a_off[r] * dim, r & 1 ? hb2 : hb, NULL, hs,
                                tol + r * nh * dim);
        }
        snprintf(what, sizeof what, "attention_states (13 rows, %lld heads of %lld)", (long long)nh, (long long)dim);
        compare_each(what, p, out2, N * nh * dim, tol);
        expect_untouched(what, p, out2, N * nh * dim, GUARD);
        pb_g[2] = NULL; /* row 2 reads every compressed row */
        p->gpu->ops->attention_states(p->gpu, q.g, N, nh, dim, pa_g, a_n, pb_g, b_n, &sinks->g, out2.g);
        op_expect_error_with(p, "attention_states missing rows", "attention_states", "row 2", NULL);
        op_buf_free(p, &out2);
        op_buf_free(p, &rb2);
        free(hb2);
    }
    /* a negative view, NULL arrays */
    int64_t bad_off[N];
    memcpy(bad_off, a_off, sizeof bad_off);
    bad_off[5] = -1;
    p->gpu->ops->attention_rows(p->gpu, q.g, N, nh, dim, ra.g, bad_off, a_n, rb.g, b_n, &sinks->g, out.g);
    op_expect_error_with(p, "attention_rows bad view", "attention_rows", "row 5", NULL);
    p->gpu->ops->attention_rows(p->gpu, q.g, N, nh, dim, ra.g, a_off, NULL, rb.g, b_n, &sinks->g, out.g);
    op_expect_error_with(p, "attention_rows NULL", "attention_rows", "NULL", NULL);
    free(tol);
    op_buf_free(p, &q);
    op_buf_free(p, &ra);
    op_buf_free(p, &rb);
    op_buf_free(p, &out);
    op_weight_free(p, sinks);
    free(hq);
    free(ha);
    free(hb);
    free(hs);
}

/* k distinct random indices below n (n >= k), in random order. */
static void distinct_indices(int32_t *idx, int k, int64_t n) {
    for (int j = 0; j < k; j++) {
        bool dup;
        do {
            idx[j] = (int32_t)rand_range(0, n - 1);
            dup = false;
            for (int i = 0; i < j; i++) dup |= idx[i] == idx[j];
        } while (dup);
    }
}

/* attention_rows_sel: each row with its window view and its own selection
 * of K compressed rows (distinct, below its own count of compressed rows;
 * the counts grow along the run as a prefill's do), against the CPU with
 * test_attention's tolerance; 8 heads of 512 take the shared-row kernel, 4
 * heads the single-row kernels row by row. An index past a row's count is
 * reported. */
static void attention_rows_sel_case(op_pair *p, int64_t nh, int64_t dim) {
    enum { N = 9, K = 24 };
    const int64_t n_win = 140, n_comp = 90;
    int64_t a_off[N], a_n[N], b_rows[N];
    int32_t idx[N * K];
    for (int r = 0; r < N; r++) {
        a_off[r] = r;
        a_n[r] = rand_range(1, n_win - r);
        b_rows[r] = 40 + 5 * r; /* >= K */
        distinct_indices(idx + r * K, K, b_rows[r]);
    }
    float *hq = op_rand(N * nh * dim, 1.0), *ha = op_rand(n_win * dim, 1.0), *hb = op_rand(n_comp * dim, 1.0);
    float *hs = op_rand(nh, 1.0);
    op_weight *sinks = op_weight_floats(p, "attn_sinks", DS4_TYPE_F32, nh, 1, 1, hs);
    op_buf q = op_buf_from(p, hq, N * nh * dim), ra = op_buf_from(p, ha, n_win * dim);
    op_buf rb = op_buf_from(p, hb, n_comp * dim), sel = op_ints_from(p, idx, N * K);
    op_buf out = op_buf_poisoned(p, N * nh * dim + GUARD);
    p->cpu->ops->attention_rows_sel(p->cpu, q.c, N, nh, dim, ra.c, a_off, a_n, rb.c, b_rows, (const int32_t *)sel.c, K,
                                    &sinks->c, out.c);
    p->gpu->ops->attention_rows_sel(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_rows, (const int32_t *)sel.g, K,
                                    &sinks->g, out.g);
    op_expect_ok(p);
    double *tol = malloc((size_t)(N * nh * dim) * sizeof *tol);
    for (int r = 0; r < N; r++) {
        const att_case ac = { "row", nh, dim, a_n[r], K, b_rows[r], SEL_DISTINCT, 1.0, 0.0, 1.0, DS4_TYPE_F32, 0 };
        attention_tolerance(&ac, hq + r * nh * dim, ha + a_off[r] * dim, hb, idx + r * K, hs, tol + r * nh * dim);
    }
    char what[96];
    snprintf(what, sizeof what, "attention_rows_sel (%d rows of %d selected, %lld heads of %lld)", N, K, (long long)nh,
             (long long)dim);
    compare_each(what, p, out, N * nh * dim, tol);
    expect_untouched(what, p, out, N * nh * dim, GUARD);
    /* and bit for bit the GPU's one-row attention of each row (the model's
     * batched selecting rows promise the row-by-row results) */
    {
        float *hb_rows = malloc((size_t)(N * nh * dim) * sizeof *hb_rows);
        float *h1 = malloc((size_t)(nh * dim) * sizeof *h1);
        op_buf one = op_buf_poisoned(p, nh * dim);
        p->gpu->ops->download(p->gpu, hb_rows, out.g, N * nh * dim);
        int bad_rows = 0;
        for (int r = 0; r < N; r++) {
            p->gpu->ops->attention(p->gpu, q.g + r * nh * dim, nh, dim, ra.g + a_off[r] * dim, a_n[r], rb.g, b_rows[r],
                                   (const int32_t *)sel.g + r * K, K, &sinks->g, one.g);
            p->gpu->ops->download(p->gpu, h1, one.g, nh * dim);
            bad_rows += memcmp(h1, hb_rows + r * nh * dim, (size_t)(nh * dim) * sizeof *h1) != 0;
        }
        op_expect_ok(p);
        CHECK_MSG(bad_rows == 0, "%s: %d rows differ from one-row attention", what, bad_rows);
        op_buf_free(p, &one);
        free(hb_rows);
        free(h1);
    }
    /* an index at row 4's count: reported (as attention reports it) */
    idx[4 * K + 3] = (int32_t)b_rows[4];
    op_buf bad = op_ints_from(p, idx, N * K);
    p->gpu->ops->attention_rows_sel(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_rows, (const int32_t *)bad.g, K,
                                    &sinks->g, out.g);
    op_expect_error(p, DS4_ERR_INVALID);
    op_buf_free(p, &bad);
    free(tol);
    op_buf_free(p, &q);
    op_buf_free(p, &ra);
    op_buf_free(p, &rb);
    op_buf_free(p, &sel);
    op_buf_free(p, &out);
    op_weight_free(p, sinks);
    free(hq);
    free(ha);
    free(hb);
    free(hs);
}

/* Rows far apart in length (up to 17,000 keys: past the 2,048 keys (64
 * heads) and the 16,384 (8 heads) where a row's split size starts to grow
 * with its length) in one shared-row launch, as
 * attention_rows and as attention_states (rows of their own compressed-row
 * buffers): each row bit for bit what the GPU's one-row attention gives it,
 * whatever rows share its batch. */
static void attention_rows_long_case(op_pair *p, int64_t nh) {
    enum { N = 5 };
    const int64_t dim = 512, n_win = 128, n_comp = 17000;
    const int64_t a_off[N] = { 0, 3, 0, 7, 1 }, a_n[N] = { 128, 100, 0, 121, 60 };
    const int64_t b_n[N] = { 3000, 17000, 40, 500, 16500 };
    float *hq = op_rand(N * nh * dim, 1.0), *ha = op_rand(n_win * dim, 1.0), *hb = op_rand(n_comp * dim, 1.0);
    float *hs = op_rand(nh, 1.0);
    op_weight *sinks = op_weight_floats(p, "attn_sinks", DS4_TYPE_F32, nh, 1, 1, hs);
    op_buf q = op_buf_from(p, hq, N * nh * dim), ra = op_buf_from(p, ha, n_win * dim);
    op_buf rb = op_buf_from(p, hb, n_comp * dim);
    op_buf out = op_buf_poisoned(p, N * nh * dim), out2 = op_buf_poisoned(p, N * nh * dim), one = op_buf_poisoned(p, nh * dim);
    p->gpu->ops->attention_rows(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_n, &sinks->g, out.g);
    const float *pa[N], *pb[N];
    for (int r = 0; r < N; r++) pa[r] = ra.g + a_off[r] * dim, pb[r] = rb.g + (n_comp - b_n[r]) * dim;
    p->gpu->ops->attention_states(p->gpu, q.g, N, nh, dim, pa, a_n, pb, b_n, &sinks->g, out2.g);
    op_expect_ok(p);
    float *h_rows = malloc((size_t)(N * nh * dim) * sizeof *h_rows), *h_states = malloc((size_t)(N * nh * dim) * sizeof *h_states);
    float *h1 = malloc((size_t)(nh * dim) * sizeof *h1);
    p->gpu->ops->download(p->gpu, h_rows, out.g, N * nh * dim);
    p->gpu->ops->download(p->gpu, h_states, out2.g, N * nh * dim);
    int bad_rows = 0, bad_states = 0, nan = 0;
    for (int r = 0; r < N; r++) {
        p->gpu->ops->attention(p->gpu, q.g + r * nh * dim, nh, dim, ra.g + a_off[r] * dim, a_n[r], rb.g, b_n[r], NULL,
                               b_n[r], &sinks->g, one.g);
        p->gpu->ops->download(p->gpu, h1, one.g, nh * dim);
        bad_rows += memcmp(h1, h_rows + r * nh * dim, (size_t)(nh * dim) * sizeof *h1) != 0;
        p->gpu->ops->attention(p->gpu, q.g + r * nh * dim, nh, dim, pa[r], a_n[r], pb[r], b_n[r], NULL, b_n[r],
                               &sinks->g, one.g);
        p->gpu->ops->download(p->gpu, h1, one.g, nh * dim);
        bad_states += memcmp(h1, h_states + r * nh * dim, (size_t)(nh * dim) * sizeof *h1) != 0;
        for (int64_t i = 0; i < nh * dim; i++) nan += isnan(h1[i]);
    }
    op_expect_ok(p);
    CHECK_MSG(bad_rows == 0 && bad_states == 0 && nan == 0,
              "long rows, %lld heads: %d attention_rows rows and %d attention_states rows differ from one-row "
              "attention (%d NaN)", (long long)nh, bad_rows, bad_states, nan);
    free(h_rows);
    free(h_states);
    free(h1);
    op_buf_free(p, &q);
    op_buf_free(p, &ra);
    op_buf_free(p, &rb);
    op_buf_free(p, &out);
    op_buf_free(p, &out2);
    op_buf_free(p, &one);
    op_weight_free(p, sinks);
    free(hq);
    free(ha);
    free(hb);
    free(hs);
}

/*
 * attention_rows_f16 (the rows F16-rounded, as DS4 numerics stores them):
 * 64 heads of 512 take the tensor-core kernel in one launch (queries and
 * weights in two binary16 parts, the MMAs' float sums), against the CPU's
 * attention_rows / attention_rows_sel within 4 times test_attention's bound
 * (the parts keep 22 bits, the MMAs sum 16 products a step); rows longer
 * than a split (three splits of 512), a row with no rows at all, one with
 * only compressed rows. With the tensor cores off (or 8 heads) the op is
 * the op it replaces, bit for bit. An index past a row's count is
 * reported.
 */
static void attention_rows_f16_case(op_pair *p, int64_t nh, bool sel) {
    enum { N = 7, K = 24 };
    const int64_t dim = 512, n_win = 140, n_comp = sel ? 90 : 1300;
    int64_t a_off[N], a_n[N], b_rows[N];
    int32_t idx[N * K];
    for (int r = 0; r < N; r++) {
        a_off[r] = r;
        a_n[r] = r == 0 || r == 3 ? 0 : rand_range(1, n_win - r);
        b_rows[r] = sel ? 40 + 5 * r : r == 0 ? 0 : r == 2 ? n_comp : rand_range(0, n_comp);
        if (sel) distinct_indices(idx + r * K, K, b_rows[r]);
    }
    float *hq = op_rand(N * nh * dim, 1.0), *ha = op_rand(n_win * dim, 1.0), *hb = op_rand(n_comp * dim, 1.0);
    for (int64_t i = 0; i < n_win * dim; i++) ha[i] = ds4_round_f16(ha[i]);
    for (int64_t i = 0; i < n_comp * dim; i++) hb[i] = ds4_round_f16(hb[i]);
    float *hs = op_rand(nh, 1.0);
    op_weight *sinks = op_weight_floats(p, "attn_sinks", DS4_TYPE_F32, nh, 1, 1, hs);
    op_buf q = op_buf_from(p, hq, N * nh * dim), ra = op_buf_from(p, ha, n_win * dim);
    op_buf rb = op_buf_from(p, hb, n_comp * dim), ids = op_ints_from(p, idx, sel ? N * K : 1);
    const int32_t *ic = sel ? (const int32_t *)ids.c : NULL, *ig = sel ? (const int32_t *)ids.g : NULL;
    const int64_t k = sel ? K : 0;
    op_buf out = op_buf_poisoned(p, N * nh * dim + GUARD), ref = op_buf_poisoned(p, N * nh * dim + GUARD);
    if (sel) p->cpu->ops->attention_rows_sel(p->cpu, q.c, N, nh, dim, ra.c, a_off, a_n, rb.c, b_rows, ic, K, &sinks->c, out.c);
    else p->cpu->ops->attention_rows(p->cpu, q.c, N, nh, dim, ra.c, a_off, a_n, rb.c, b_rows, &sinks->c, out.c);
    const int64_t calls0 = ds4_cuda_backend_att_tc_calls(p->gpu);
    p->gpu->ops->attention_rows_f16(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_rows, ig, k, &sinks->g, out.g);
    op_expect_ok(p);
    const bool tc = nh == 64 && env_on_default("DS4_CUDA_ATT_TC", true);
    char what[128];
    snprintf(what, sizeof what, "attention_rows_f16 (%d rows%s, %lld heads of 512)", N, sel ? " selecting 24" : "",
             (long long)nh);
    CHECK_MSG(ds4_cuda_backend_att_tc_calls(p->gpu) - calls0 == (tc ? 1 : 0), "%s: %lld launches on the tensor cores",
              what, (long long)(ds4_cuda_backend_att_tc_calls(p->gpu) - calls0));
    double *tol = malloc((size_t)(N * nh * dim) * sizeof *tol);
    for (int r = 0; r < N; r++) {
        const int64_t nb = sel ? K : b_rows[r];
        const att_case ac = { "row", nh, dim, a_n[r], nb, b_rows[r], sel ? SEL_DISTINCT : SEL_NONE, 1.0, 0.0, 1.0,
                              DS4_TYPE_F32, 0 };
        attention_tolerance(&ac, hq + r * nh * dim, ha + a_off[r] * dim, hb, sel ? idx + r * K : NULL, hs,
                            tol + r * nh * dim);
    }
    for (int64_t i = 0; i < N * nh * dim; i++) tol[i] *= 4.0;
    compare_each(what, p, out, N * nh * dim, tol);
    expect_untouched(what, p, out, N * nh * dim, GUARD);
    if (tc) { /* both forms of the kernel (8 and 16 warps a block) within the same bound, the default's bits
               * those of the run above; each first runs on other queries, so partials it failed to write
               * would be those (the combine reads them from scratch) and fail */
        const int dflt = ds4_cuda_backend_att_tc_warps(p->gpu);
        const int64_t nout = N * nh * dim;
        float *hcpu = malloc((size_t)nout * sizeof *hcpu);
        p->cpu->ops->download(p->cpu, hcpu, out.c, nout);
        float *hq2 = op_rand(N * nh * dim, 1.0);
        op_buf q2 = op_buf_from(p, hq2, N * nh * dim);
        for (int w = 8; w <= 16; w += 8) {
            char wh[160];
            snprintf(wh, sizeof wh, "%s, %d warps a block", what, w);
            ds4_cuda_backend_set_att_tc_warps(p->gpu, w);
            op_buf f = op_buf_poisoned(p, nout + GUARD);
            p->cpu->ops->upload(p->cpu, f.c, hcpu, nout);
            p->gpu->ops->attention_rows_f16(p->gpu, q2.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_rows, ig, k, &sinks->g,
                                            f.g);
            const int64_t c0 = ds4_cuda_backend_att_tc_calls(p->gpu);
            p->gpu->ops->attention_rows_f16(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_rows, ig, k, &sinks->g,
                                            f.g);
            op_expect_ok(p);
            CHECK_MSG(ds4_cuda_backend_att_tc_calls(p->gpu) - c0 == 1, "%s: not on the tensor cores", wh);
            compare_each(wh, p, f, nout, tol);
            expect_untouched(wh, p, f, nout, GUARD);
            if (w == dflt) CHECK_MSG(op_gpu_differ(p, f, out, nout) == 0, "%s: not the default run's bits", wh);
            op_buf_free(p, &f);
        }
        ds4_cuda_backend_set_att_tc_warps(p->gpu, dflt);
        op_buf_free(p, &q2);
        free(hq2);
        free(hcpu);
    }
    /* the combine (1 to 3 splits here) with a block per (head, row) against its warp form: the same bits */
    {
        ds4_cuda_backend_set_wide_rows(p->gpu, 0);
        p->gpu->ops->attention_rows_f16(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_rows, ig, k, &sinks->g,
                                        ref.g);
        ds4_cuda_backend_set_wide_rows(p->gpu, env_on_default("DS4_CUDA_WIDE_ROWS", true));
        op_expect_ok(p);
        CHECK_MSG(op_gpu_differ(p, out, ref, N * nh * dim) == 0, "%s: the combine's block and warp forms differ", what);
    }
    /* the tensor cores off: the op it replaces, bit for bit */
    ds4_cuda_backend_set_att_tc(p->gpu, 0);
    p->gpu->ops->attention_rows_f16(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_rows, ig, k, &sinks->g, out.g);
    ds4_cuda_backend_set_att_tc(p->gpu, env_on_default("DS4_CUDA_ATT_TC", true));
    if (sel) p->gpu->ops->attention_rows_sel(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_rows, ig, K, &sinks->g, ref.g);
    else p->gpu->ops->attention_rows(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_rows, &sinks->g, ref.g);
    op_expect_ok(p);
    CHECK_MSG(op_gpu_differ(p, out, ref, N * nh * dim) == 0, "%s, tensor cores off: not the float op's", what);
    if (sel) { /* an index at row 4's count: reported */
        idx[4 * K + 3] = (int32_t)b_rows[4];
        op_buf bad = op_ints_from(p, idx, N * K);
        p->gpu->ops->attention_rows_f16(p->gpu, q.g, N, nh, dim, ra.g, a_off, a_n, rb.g, b_rows, (const int32_t *)bad.g,
                                        K, &sinks->g, out.g);
        op_expect_error(p, DS4_ERR_INVALID);
        op_buf_free(p, &bad);
    }
    free(tol);
    op_buf_free(p, &q);
    op_buf_free(p, &ra);
    op_buf_free(p, &rb);
    op_buf_free(p, &ids);
    op_buf_free(p, &out);
    op_buf_free(p, &ref);
    op_weight_free(p, sinks);
    free(hq);
    free(ha);
    free(hb);
    free(hs);
}

static void test_attention_rows_f16(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    attention_rows_f16_case(&p, 64, false);
    attention_rows_f16_case(&p, 64, true);
    attention_rows_f16_case(&p, 8, true);
    op_pair_close(&p);
}

static void test_attention_rows(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    attention_rows_long_case(&p, 64);
    attention_rows_long_case(&p, 8);
    attention_rows_sel_case(&p, 8, 512);
    attention_rows_sel_case(&p, 64, 512);
    attention_rows_sel_case(&p, 4, 512);
    attention_rows_case(&p, 8, 512);
    attention_rows_case(&p, 64, 512);
    attention_rows_case(&p, 4, 512);
    attention_rows_case(&p, 8, 64);
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* compressor_pool                                                           */
/* ------------------------------------------------------------------------ */

/*
 * Tolerance of out[j]: both sides run the same float operations in the same
 * order; only expf differs (CUDA <= 2 ulp, glibc <= 1 ulp: each weight within
 * 6u relatively). Through the c-candidate sums of weights and of weighted
 * values (each side within c u of exact) and the division:
 * tol = A_j (4c + 24) u, A_j = sum_r p_r |kv_r| (double). A column whose
 * scores are all -inf must be exactly 0 (A_j = 0).
 */
static void compressor_case(op_pair *p, int ratio, int64_t dim) {
    const bool overlap = ratio == 4;
    const int64_t width = overlap ? 2 * dim : dim, rows = overlap ? 8 : ratio, n = rows * width;
    float *kv = op_rand(n, 1.0), *sc = op_rand(n, 2.0);
    /* ratio 4 reads rows 0..3 at lane A and rows 4..7 at lane B: poison the
     * other halves so reading them shows */
    if (overlap) {
        for (int64_t r = 0; r < 8; r++)
            for (int64_t j = 0; j < dim; j++) {
                const int64_t unused = r * width + (r < 4 ? dim : 0) + j;
                kv[unused] = NAN;
                sc[unused] = NAN;
            }
    }
    const int c = overlap ? 8 : ratio;
    for (int64_t j = 0; j < dim; j++) {
        const int mode = (int)(j % 7); /* 0: all -inf; 1: one finite; else ~15% -inf */
        for (int k = 0; k < c; k++) {
            const int64_t at = overlap ? (k < 4 ? k * width + j : k * width + dim + j) : k * width + j;
            if (mode == 0 || (mode == 1 && k != c / 2) || (mode > 1 && test_rand_uniform() < 0.15))
                sc[at] = -INFINITY;
        }
    }
    double *tol = malloc((size_t)dim * sizeof *tol);
    for (int64_t j = 0; j < dim; j++) {
        double m = -INFINITY, den = 0, num = 0;
        for (int k = 0; k < c; k++) {
            const int64_t at = overlap ? (k < 4 ? k * width + j : k * width + dim + j) : k * width + j;
            if (sc[at] > m) m = sc[at];
        }
        if (m == -INFINITY) {
            tol[j] = 0;
            continue;
        }
        for (int k = 0; k < c; k++) {
            const int64_t at = overlap ? (k < 4 ? k * width + j : k * width + dim + j) : k * width + j;
            const double w = exp(sc[at] - m);
            den += w;
            num += w * fabs(kv[at]);
        }
        tol[j] = num / den * (4.0 * c + 24) * U;
    }
    op_buf bkv = op_buf_from(p, kv, n), bsc = op_buf_from(p, sc, n), out = op_buf_poisoned(p, dim + GUARD);
    p->cpu->ops->compressor_pool(p->cpu, bkv.c, bsc.c, ratio, dim, 1, out.c);
    p->gpu->ops->compressor_pool(p->gpu, bkv.g, bsc.g, ratio, dim, 1, out.g);
    op_expect_ok(p);
    char what[96];
    snprintf(what, sizeof what, "compressor_pool ratio %d dim %lld", ratio, (long long)dim);
    compare_each(what, p, out, dim, tol);
    expect_untouched(what, p, out, dim, GUARD);
    op_buf_free(p, &bkv);
    op_buf_free(p, &bsc);
    op_buf_free(p, &out);
    free(tol);
    free(kv);
    free(sc);
}

/* Several windows in one call (consecutive windows of rows in position
 * order; ratio 4's overlap): each window's output is the GPU's one-window
 * pool of the same rows, bit for bit, and within compressor_case's bound of
 * the CPU's (checked there); here against the CPU with the same bound's
 * simple form, max over the window of sum |kv| * (4c + 24) u. */
static void compressor_windows_case(op_pair *p, int ratio, int64_t dim, int64_t nw) {
    const int64_t width = ratio == 4 ? 2 * dim : dim, rows = ratio == 4 ? 4 * (nw + 1) : ratio * nw, n = rows * width;
    float *kv = op_rand(n, 1.0), *sc = op_rand(n, 2.0);
    op_buf bkv = op_buf_from(p, kv, n), bsc = op_buf_from(p, sc, n);
    op_buf out = op_buf_poisoned(p, nw * dim + GUARD), one = op_buf_poisoned(p, dim);
    p->cpu->ops->compressor_pool(p->cpu, bkv.c, bsc.c, ratio, dim, nw, out.c);
    p->gpu->ops->compressor_pool(p->gpu, bkv.g, bsc.g, ratio, dim, nw, out.g);
    op_expect_ok(p);
    char what[96];
    snprintf(what, sizeof what, "compressor_pool ratio %d dim %lld, %lld windows", ratio, (long long)dim,
             (long long)nw);
    const int c = ratio == 4 ? 8 : ratio;
    double *tol = malloc((size_t)(nw * dim) * sizeof *tol);
    for (int64_t w = 0; w < nw; w++)
        for (int64_t j = 0; j < dim; j++) {
            double mag = 0;
            for (int k = 0; k < c; k++) {
                const int64_t r = w * ratio + k;
                mag += fabs(kv[r * width + (ratio == 4 && k >= 4 ? dim : 0) + j]);
            }
            tol[w * dim + j] = mag * (4.0 * c + 24) * U;
        }
    compare_each(what, p, out, nw * dim, tol);
    expect_untouched(what, p, out, nw * dim, GUARD);
    float *hw = malloc((size_t)(nw * dim) * sizeof *hw), *h1 = malloc((size_t)dim * sizeof *h1);
    p->gpu->ops->download(p->gpu, hw, out.g, nw * dim);
    int bad = 0;
    for (int64_t w = 0; w < nw; w++) {
        p->gpu->ops->compressor_pool(p->gpu, bkv.g + w * ratio * width, bsc.g + w * ratio * width, ratio, dim, 1,
                                     one.g);
        p->gpu->ops->download(p->gpu, h1, one.g, dim);
        bad += memcmp(h1, hw + w * dim, (size_t)dim * sizeof *h1) != 0;
    }
    op_expect_ok(p);
    CHECK_MSG(bad == 0, "%s: %d windows differ from one-window pools", what, bad);
    /* compressor_pool_states: the windows as windows of states of their own (in reverse order), against the
     * CPU's and bit for bit the GPU's one-window pools */
    if (nw <= 64) {
        const float *kc[64], *sc_c[64], *kg[64], *sg[64];
        for (int64_t w = 0; w < nw; w++) {
            const int64_t at = (nw - 1 - w) * ratio * width;
            kc[w] = bkv.c + at, sc_c[w] = bsc.c + at, kg[w] = bkv.g + at, sg[w] = bsc.g + at;
        }
        op_buf out2 = op_buf_poisoned(p, nw * dim + GUARD);
        p->cpu->ops->compressor_pool_states(p->cpu, kc, sc_c, ratio, dim, nw, out2.c);
        p->gpu->ops->compressor_pool_states(p->gpu, kg, sg, ratio, dim, nw, out2.g);
        op_expect_ok(p);
        double *tol2 = malloc((size_t)(nw * dim) * sizeof *tol2); /* window w is window nw - 1 - w above */
        for (int64_t w = 0; w < nw; w++)
            for (int64_t j = 0; j < dim; j++) tol2[w * dim + j] = tol[(nw - 1 - w) * dim + j];
        snprintf(what, sizeof what, "compressor_pool_states ratio %d dim %lld, %lld windows", ratio, (long long)dim,
                 (long long)nw);
        compare_each(what, p, out2, nw * dim, tol2);
        expect_untouched(what, p, out2, nw * dim, GUARD);
        p->gpu->ops->download(p->gpu, hw, out2.g, nw * dim);
        int bad2 = 0;
        for (int64_t w = 0; w < nw; w++) {
            p->gpu->ops->compressor_pool(p->gpu, kg[w], sg[w], ratio, dim, 1, one.g);
            p->gpu->ops->download(p->gpu, h1, one.g, dim);
            bad2 += memcmp(h1, hw + w * dim, (size_t)dim * sizeof *h1) != 0;
        }
        op_expect_ok(p);
        CHECK_MSG(bad2 == 0, "%s: %d windows differ from one-window pools", what, bad2);
        sg[0] = NULL;
        p->gpu->ops->compressor_pool_states(p->gpu, kg, sg, ratio, dim, nw, out2.g);
        op_expect_error(p, DS4_ERR_INVALID);
        free(tol2);
        op_buf_free(p, &out2);
    }
    free(hw);
    free(h1);
    free(tol);
    op_buf_free(p, &bkv);
    op_buf_free(p, &bsc);
    op_buf_free(p, &out);
    op_buf_free(p, &one);
    free(kv);
    free(sc);
}

static void test_compressor_pool(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    compressor_windows_case(&p, 4, 512, 37);
    compressor_windows_case(&p, 4, 128, 64);
    compressor_windows_case(&p, 128, 512, 3);
    compressor_case(&p, 4, 512);
    compressor_case(&p, 4, 128);
    compressor_case(&p, 128, 512);
    compressor_case(&p, 128, 128);
    compressor_case(&p, 1, 7);
    compressor_case(&p, 16, 33);
    compressor_case(&p, 2, 100);
    compressor_case(&p, 4, 1);
    compressor_case(&p, 128, 70000); /* a wide state: many blocks */
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* indexer_scores                                                            */
/* ------------------------------------------------------------------------ */

/*
 * Tolerance of score[c] = sum_h relu(q_h . key_c) w_h: each dot errs by at
 * most (dim/8 + 4) u sum_i |q_hi k_ci| on the CPU and (dim/32 + 6) u ... on
 * the GPU (relu does not enlarge a difference), times |w_h|; the sequential
 * weighted sums over heads add (n_heads + 2) u sum_h |relu(d_h) w_h| each.
 */
static void indexer_case(op_pair *p, int64_t n_heads, int64_t dim, int64_t n_keys, float scale) {
    /* at least one float each: a buffer of 1 is uploaded for empty inputs */
    float *hq = op_rand(n_heads * dim > 0 ? n_heads * dim : 1, 1.0);
    float *hk = op_rand(n_keys * dim > 0 ? n_keys * dim : 1, 1.0);
    /* the head weights as the op applies them: hw[h] * scale in float */
    float *hw = op_rand(n_heads > 0 ? n_heads : 1,
                        1.0 / sqrt((double)(n_heads > 0 ? n_heads : 1) * (double)(dim > 0 ? dim : 1)) / scale);
    float *weff = malloc((size_t)(n_heads > 0 ? n_heads : 1) * sizeof *weff);
    for (int64_t h = 0; h < n_heads; h++) weff[h] = hw[h] * scale;
    double *tol = malloc((size_t)(n_keys > 0 ? n_keys : 1) * sizeof *tol);
    const double chain = ((double)dim / 8 + 4) + ((double)dim / 32 + 6);
    for (int64_t c = 0; c < n_keys; c++) {
        double dots = 0, terms = 0;
        for (int64_t h = 0; h < n_heads; h++) {
            double d = 0, a = 0;
            for (int64_t i = 0; i < dim; i++) {
                d += (double)hq[h * dim + i] * hk[c * dim + i];
                a += fabs((double)hq[h * dim + i] * hk[c * dim + i]);
            }
            dots += fabs((double)weff[h]) * chain * U * a;
            terms += fabs((d > 0 ? d : 0) * weff[h]);
        }
        tol[c] = dots + 2 * ((double)n_heads + 2) * U * terms;
    }
    op_buf q = op_buf_from(p, hq, n_heads * dim > 0 ? n_heads * dim : 1);
    op_buf k = op_buf_from(p, hk, n_keys * dim > 0 ? n_keys * dim : 1);
    op_buf w = op_buf_from(p, hw, n_heads > 0 ? n_heads : 1);
    op_buf out = op_buf_poisoned(p, n_keys + GUARD);
    p->cpu->ops->indexer_scores(p->cpu, q.c, w.c, scale, n_heads, dim, k.c, n_keys, out.c);
    p->gpu->ops->indexer_scores(p->gpu, q.g, w.g, scale, n_heads, dim, k.g, n_keys, out.g);
    op_expect_ok(p);
    char what[128];
    snprintf(what, sizeof what, "indexer_scores %lld heads of %lld, %lld keys, weight scale %g", (long long)n_heads,
             (long long)dim, (long long)n_keys, (double)scale);
    compare_each(what, p, out, n_keys, tol);
    expect_untouched(what, p, out, n_keys, GUARD);
    op_buf_free(p, &q);
    op_buf_free(p, &k);
    op_buf_free(p, &w);
    op_buf_free(p, &out);
    free(tol);
    free(hq);
    free(hk);
    free(hw);
    free(weff);
}

/* The bound on a row-op indexer score against the CPU's (the float sums
 * of the dots and of the heads' terms in another order): query row q
 * [n_heads, dim], its head weights w, one key. */
static double indexer_row_bound(const float *q, const float *w, const float *key, int64_t n_heads, int64_t dim,
                                float scale) {
    double mag = 0;
    for (int64_t h = 0; h < n_heads; h++) {
        double dm = 0;
        for (int64_t i = 0; i < dim; i++) dm += fabs((double)q[h * dim + i] * key[i]);
        mag += dm * fabs((double)w[h] * scale);
    }
    return (2.0 * dim + 2.0 * n_heads + 8) * U * mag;
}

/* indexer_scores_rows and top_k_rows: rows of different key counts (one
 * with none, one with fewer than k) in one call each; scores against the
 * CPU's with indexer_case's bound, selections exactly (the CUDA side ranks
 * its own scores: a near tie may order differently, so the CPU ranks the
 * GPU's scores for the comparison). */
static void indexer_rows_case(op_pair *p, int64_t n_heads, int64_t dim, const int64_t *n_keys, int64_t n_rows,
                              int64_t stride, int64_t k) {
    float *hq = op_rand(n_rows * n_heads * dim, 1.0), *hw = op_rand(n_rows * n_heads, 1.0);
    float *hk = op_rand(stride * dim, 1.0);
    op_buf q = op_buf_from(p, hq, n_rows * n_heads * dim), w = op_buf_from(p, hw, n_rows * n_heads);
    op_buf keys = op_buf_from(p, hk, stride * dim), sc = op_buf_poisoned(p, n_rows * stride);
    const float scale = 0.125f;
    p->cpu->ops->indexer_scores_rows(p->cpu, q.c, w.c, scale, n_heads, dim, keys.c, n_keys, n_rows, sc.c, stride);
    p->gpu->ops->indexer_scores_rows(p->gpu, q.g, w.g, scale, n_heads, dim, keys.g, n_keys, n_rows, sc.g, stride);
    op_expect_ok(p);
    float *cs = malloc((size_t)(n_rows * stride) * sizeof *cs), *gs = malloc((size_t)(n_rows * stride) * sizeof *gs);
    p->cpu->ops->download(p->cpu, cs, sc.c, n_rows * stride);
    p->gpu->ops->download(p->gpu, gs, sc.g, n_rows * stride);
    int64_t bad = 0;
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t c = 0; c < n_keys[r]; c++) {
            const double d = fabs((double)gs[r * stride + c] - cs[r * stride + c]);
            bad += !(d <= indexer_row_bound(hq + r * n_heads * dim, hw + r * n_heads, hk + c * dim, n_heads, dim, scale));
        }
    CHECK_MSG(bad == 0, "indexer_scores_rows %lld rows: %lld scores out of bound", (long long)n_rows, (long long)bad);
    /* the one-key and four-key warps: the same bits, each into a fresh
     * poisoned buffer (a score a form failed to write stays poison) */
    const int dflt = ds4_cuda_backend_idx_keys(p->gpu);
    float *fs = malloc((size_t)(n_rows * stride) * sizeof *fs);
    for (int kw = 1; kw <= 4; kw += 3) {
        ds4_cuda_backend_set_idx_keys(p->gpu, kw);
        const int64_t calls = ds4_cuda_backend_idx_keys_calls(p->gpu);
        op_buf fsc = op_buf_poisoned(p, n_rows * stride);
        p->gpu->ops->indexer_scores_rows(p->gpu, q.g, w.g, scale, n_heads, dim, keys.g, n_keys, n_rows, fsc.g, stride);
        op_expect_ok(p);
        p->gpu->ops->download(p->gpu, fs, fsc.g, n_rows * stride);
        int64_t diff = 0;
        for (int64_t r = 0; r < n_rows; r++)
            for (int64_t c = 0; c < n_keys[r]; c++)
                diff += memcmp(&fs[r * stride + c], &gs[r * stride + c], sizeof *fs) != 0;
        CHECK_MSG(diff == 0, "indexer_scores_rows %lld rows, %d keys a warp: %lld scores differ from the default's",
                  (long long)n_rows, kw, (long long)diff);
        const bool four = kw == 4 && n_rows > 1 && dim <= 128;
        CHECK_MSG(ds4_cuda_backend_idx_keys_calls(p->gpu) - calls == (four ? 1 : 0),
                  "%d keys a warp, %lld rows: %lld four-key launches", kw, (long long)n_rows,
                  (long long)(ds4_cuda_backend_idx_keys_calls(p->gpu) - calls));
        op_buf_free(p, &fsc);
    }
    ds4_cuda_backend_set_idx_keys(p->gpu, dflt);
    free(fs);
    /* selections: both sides rank the GPU's scores */
    op_buf gsc = op_buf_from(p, gs, n_rows * stride);
    int32_t *ic = malloc((size_t)(n_rows * k) * sizeof *ic), *ig = malloc((size_t)(n_rows * k) * sizeof *ig);
    op_buf idx = op_ints_from(p, ic, n_rows * k);
    p->cpu->ops->top_k_rows(p->cpu, gsc.c, stride, n_keys, n_rows, k, (int32_t *)idx.c);
    p->gpu->ops->top_k_rows(p->gpu, gsc.g, stride, n_keys, n_rows, k, (int32_t *)idx.g);
    op_expect_ok(p);
    op_ints_get(p, idx, n_rows * k, ic, ig);
    CHECK_MSG(memcmp(ic, ig, (size_t)(n_rows * k) * sizeof *ic) == 0, "top_k_rows %lld rows, k %lld differ",
              (long long)n_rows, (long long)k);
    /* a count past the stride: refused on both sides, with the same message */
    const int64_t too_many[1] = { stride + 1 };
    for (int op = 0; op < 2; op++) {
        if (op == 0) {
            p->cpu->ops->indexer_scores_rows(p->cpu, q.c, w.c, scale, n_heads, dim, keys.c, too_many, 1, sc.c, stride);
            p->gpu->ops->indexer_scores_rows(p->gpu, q.g, w.g, scale, n_heads, dim, keys.g, too_many, 1, sc.g, stride);
        } else {
            p->cpu->ops->top_k_rows(p->cpu, gsc.c, stride, too_many, 1, k, (int32_t *)idx.c);
            p->gpu->ops->top_k_rows(p->gpu, gsc.g, stride, too_many, 1, k, (int32_t *)idx.g);
        }
        ds4_error ec = { 0 }, eg = { 0 };
        CHECK(p->cpu->ops->take_error(p->cpu, &ec) == DS4_ERR_INVALID);
        CHECK(p->gpu->ops->take_error(p->gpu, &eg) == DS4_ERR_INVALID);
        CHECK_MSG(strcmp(ec.message, eg.message) == 0 && strstr(eg.message, "stride"), "cpu \"%s\" cuda \"%s\"",
                  ec.message, eg.message);
    }
    op_buf_free(p, &idx);
    op_buf_free(p, &gsc);
    op_buf_free(p, &q);
    op_buf_free(p, &w);
    op_buf_free(p, &keys);
    op_buf_free(p, &sc);
    free(ic);
    free(ig);
    free(cs);
    free(gs);
    free(hq);
    free(hw);
    free(hk);
}

static void test_indexer_rows(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const int64_t n4[4] = { 700, 0, 300, 513 };
    indexer_rows_case(&p, 64, 128, n4, 4, 700, 512); /* the model's shape: 512 of up to 700 */
    const int64_t n3[3] = { 5, 40, 17 };
    indexer_rows_case(&p, 16, 128, n3, 3, 40, 8); /* the tiny model's top-k of 8 */
    const int64_t n6[3] = { 33, 1, 30 };
    indexer_rows_case(&p, 12, 100, n6, 3, 33, 4); /* heads past a batch of 8, dims past 96, keys past a warp's 4 */
    const int64_t n1[1] = { 50 };
    indexer_rows_case(&p, 8, 128, n1, 1, 50, 1); /* k = 1: row by row */
    /* rows of more keys than one block sorts whole beside rows it does sort
     * whole: each row's own path in one launch */
    const int64_t n5[3] = { 6000, 4096, 520 };
    indexer_rows_case(&p, 4, 64, n5, 3, 6000, 512);
    op_pair_close(&p);
}

/* indexer_scores_rows_f16: queries and keys of binary16 values. QAT'd
 * rows (the model's under DS4 numerics; the queries asserted binary16
 * here, the keys F16-rounded after their QAT as the model does): every
 * score the CPU's indexer_scores_rows bit for bit, on the tensor cores and
 * with them off (DS4_CUDA_IDX_TC=0: the float kernels, also those bits);
 * other values, rounded to binary16 on the host: the CPU's scores of them
 * within indexer_rows_case's bound. Scores past a row's count stay poison;
 * the tensor-core launches counted (tc: the kernel holds the sizes and the
 * queries' alignment; q_off floats before the queries move them off 16
 * bytes). */
static void indexer_rows_f16_case(op_pair *p, int64_t n_heads, int64_t dim, const int64_t *n_keys, int64_t n_rows,
                                  int64_t stride, bool qat, bool tc, int64_t q_off) {
    float *hq = op_rand(n_rows * n_heads * dim, 1.0), *hw = op_rand(n_rows * n_heads, 1.0);
    float *hk = op_rand(stride * dim, 1.0);
    int64_t not_f16 = 0;
    if (qat) {
        for (int64_t i = 0; i < n_rows * n_heads; i++) ds4_indexer_qat_row(hq + i * dim, dim);
        for (int64_t c = 0; c < stride; c++) ds4_indexer_qat_row(hk + c * dim, dim);
        for (int64_t i = 0; i < n_rows * n_heads * dim; i++) not_f16 += ds4_round_f16(hq[i]) != hq[i];
    }
    CHECK_MSG(not_f16 == 0, "%lld QAT'd query values are not binary16", (long long)not_f16);
    for (int64_t i = 0; i < n_rows * n_heads * dim; i++) hq[i] = ds4_round_f16(hq[i]);
    for (int64_t i = 0; i < stride * dim; i++) hk[i] = ds4_round_f16(hk[i]);
    float *hq_off = calloc((size_t)(q_off + n_rows * n_heads * dim), sizeof *hq_off);
    memcpy(hq_off + q_off, hq, (size_t)(n_rows * n_heads * dim) * sizeof *hq);
    op_buf qb = op_buf_from(p, hq_off, q_off + n_rows * n_heads * dim), w = op_buf_from(p, hw, n_rows * n_heads);
    const op_buf q = { qb.c + q_off, qb.g + q_off };
    op_buf keys = op_buf_from(p, hk, stride * dim);
    const float scale = (float)(1.0 / sqrt((double)dim * (double)n_heads));
    char what[160];
    snprintf(what, sizeof what, "indexer_scores_rows_f16 %lld rows of %lld heads of %lld%s", (long long)n_rows,
             (long long)n_heads, (long long)dim, qat ? ", QAT'd" : "");
    op_buf sc = op_buf_poisoned(p, n_rows * stride);
    p->cpu->ops->indexer_scores_rows(p->cpu, q.c, w.c, scale, n_heads, dim, keys.c, n_keys, n_rows, sc.c, stride);
    op_expect_ok(p);
    float *cs = malloc((size_t)(n_rows * stride) * sizeof *cs), *gs = malloc((size_t)(n_rows * stride) * sizeof *gs);
    p->cpu->ops->download(p->cpu, cs, sc.c, n_rows * stride);
    /* each score's bound, once for both forms */
    double *bound = malloc((size_t)(n_rows * stride) * sizeof *bound);
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t c = 0; c < n_keys[r]; c++)
            bound[r * stride + c] =
                indexer_row_bound(hq + r * n_heads * dim, hw + r * n_heads, hk + c * dim, n_heads, dim, scale);
    const int dflt = ds4_cuda_backend_idx_tc(p->gpu);
    /* the tensor cores, then off */
    for (int v = 0; v < 2; v++) {
        const int on = v == 0;
        ds4_cuda_backend_set_idx_tc(p->gpu, on);
        const int64_t calls = ds4_cuda_backend_idx_tc_calls(p->gpu);
        op_buf gsc = op_buf_poisoned(p, n_rows * stride);
        p->gpu->ops->indexer_scores_rows_f16(p->gpu, q.g, w.g, scale, n_heads, dim, keys.g, n_keys, n_rows, gsc.g,
                                             stride);
        op_expect_ok(p);
        CHECK_MSG(ds4_cuda_backend_idx_tc_calls(p->gpu) - calls == (on && tc ? 1 : 0), "%s, tensor cores %s: %lld launches",
                  what, on ? "on" : "off", (long long)(ds4_cuda_backend_idx_tc_calls(p->gpu) - calls));
        p->gpu->ops->download(p->gpu, gs, gsc.g, n_rows * stride);
        int64_t bad = 0, diff = 0, written = 0;
        for (int64_t r = 0; r < n_rows; r++) {
            for (int64_t c = 0; c < n_keys[r]; c++) {
                const float g = gs[r * stride + c], cv = cs[r * stride + c];
                diff += memcmp(&g, &cv, sizeof g) != 0;
                bad += !(fabs((double)g - cv) <= bound[r * stride + c]);
            }
            for (int64_t c = n_keys[r]; c < stride; c++) written += !isnan(gs[r * stride + c]);
        }
        CHECK_MSG(bad == 0, "%s, form %d: %lld scores out of bound", what, v, (long long)bad);
        if (qat)
            CHECK_MSG(diff == 0, "%s, form %d: %lld scores differ from the CPU's bits", what, v, (long long)diff);
        CHECK_MSG(written == 0, "%s: %lld scores past the rows' counts written", what, (long long)written);
        op_buf_free(p, &gsc);
    }
    ds4_cuda_backend_set_idx_tc(p->gpu, dflt);
    /* refused as indexer_scores_rows is, under its own name */
    const int64_t too_many[1] = { stride + 1 };
    p->gpu->ops->indexer_scores_rows_f16(p->gpu, q.g, w.g, scale, n_heads, dim, keys.g, too_many, 1, sc.g, stride);
    ds4_error eg = { 0 };
    CHECK(p->gpu->ops->take_error(p->gpu, &eg) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(eg.message, "indexer_scores_rows_f16") && strstr(eg.message, "stride"), "cuda \"%s\"", eg.message);
    p->gpu->ops->indexer_scores_rows_f16(p->gpu, q.g, w.g, scale, n_heads, dim, keys.g, n_keys, n_rows, NULL, stride);
    CHECK(p->gpu->ops->take_error(p->gpu, &eg) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(eg.message, "indexer_scores_rows_f16") && strstr(eg.message, "NULL scores"), "cuda \"%s\"",
              eg.message);
    op_buf_free(p, &qb);
    op_buf_free(p, &w);
    op_buf_free(p, &keys);
    op_buf_free(p, &sc);
    free(cs);
    free(gs);
    free(bound);
    free(hq);
    free(hq_off);
    free(hw);
    free(hk);
}

static void test_indexer_rows_f16(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    /* the model's shape: rows in blocks of 8 (the last one short), keys in blocks of 256, a row of none */
    int64_t n20[21];
    for (int r = 0; r < 21; r++) n20[r] = r == 3 ? 0 : 513 + 37 * r;
    indexer_rows_f16_case(&p, 64, 128, n20, 21, 1300, true, true, 0);
    indexer_rows_f16_case(&p, 64, 128, n20, 21, 1300, false, true, 0);
    const int64_t n3[3] = { 5, 40, 17 };
    indexer_rows_f16_case(&p, 16, 128, n3, 3, 40, true, true, 0); /* the tiny model's */
    const int64_t n2[2] = { 300, 299 };
    indexer_rows_f16_case(&p, 8, 64, n2, 2, 300, true, true, 0);  /* 64 dims (the k-steps past them zeros), half an m-tile */
    indexer_rows_f16_case(&p, 40, 128, n2, 2, 300, true, true, 0); /* two full m-tiles and a half one */
    const int64_t n6[3] = { 33, 1, 30 };
    indexer_rows_f16_case(&p, 12, 100, n6, 3, 33, false, true, 0); /* heads and dims padded (dims past 96: a k-step of 4) */
    const int64_t n1[1] = { 70 };
    indexer_rows_f16_case(&p, 80, 128, n1, 1, 70, true, false, 0); /* more heads than the kernel holds: the float kernels */
    indexer_rows_f16_case(&p, 4, 130, n1, 1, 70, false, false, 0); /* more dims than it holds */
    indexer_rows_f16_case(&p, 4, 126, n1, 1, 70, false, false, 0); /* dims not a multiple of 4 */
    indexer_rows_f16_case(&p, 16, 128, n3, 3, 40, true, false, 1); /* queries off 16 bytes: the float kernels */
    op_pair_close(&p);
}

static void test_indexer_scores(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const float model_scale = (float)(1.0 / sqrt(128.0 * 64.0)); /* the model's 1/sqrt(dim * heads) */
    indexer_case(&p, 64, 128, 1, 1.0f);
    indexer_case(&p, 64, 128, 2, 1.0f);
    indexer_case(&p, 64, 128, 31, model_scale);
    indexer_case(&p, 64, 128, 1000, model_scale);
    indexer_case(&p, 64, 128, 5000, 1.0f);
    indexer_case(&p, 64, 128, 0, 1.0f);   /* nothing to do */
    indexer_case(&p, 3, 40, 77, 0.3f);    /* partial register lanes */
    indexer_case(&p, 13, 128, 50, 0.7f);  /* heads not a multiple of the kernel's batch of 8 */
    indexer_case(&p, 8, 512, 300, 1.0f);  /* key in 16 registers per lane */
    indexer_case(&p, 4, 600, 100, 2.5f);  /* key read from memory */
    indexer_case(&p, 128, 128, 500, model_scale); /* queries too large for shared memory */
    indexer_case(&p, 1, 1, 10, 1.0f);
    indexer_case(&p, 0, 128, 10, 1.0f);   /* no heads: scores 0 */
    indexer_case(&p, 64, 128, 9000, model_scale); /* more keys than the capped grid's warps: the blocks stride */
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* top_k                                                                     */
/* ------------------------------------------------------------------------ */

#define IDX_SENTINEL 0x5a5a5a5a

/* Run top_k on both sides (idx, in backend memory, prefilled with a
 * sentinel) and compare the index lists exactly; k + 4 entries are checked
 * so writes past k show. */
static void top_k_case(op_pair *p, const char *name, const float *scores, int64_t n, int64_t k) {
    op_buf s = op_buf_from(p, scores, n > 0 ? n : 1);
    int32_t *ic = malloc((size_t)(k + 4) * sizeof *ic), *ig = malloc((size_t)(k + 4) * sizeof *ig);
    for (int64_t i = 0; i < k + 4; i++) ic[i] = ig[i] = IDX_SENTINEL;
    op_buf idx = op_ints_from(p, ic, k + 4);
    p->cpu->ops->top_k(p->cpu, s.c, n, k, (int32_t *)idx.c);
    p->gpu->ops->top_k(p->gpu, s.g, n, k, (int32_t *)idx.g);
    op_expect_ok(p);
    op_ints_get(p, idx, k + 4, ic, ig);
    op_buf_free(p, &idx);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < k + 4; i++)
        if (ic[i] != ig[i]) {
            if (first < 0) first = i;
            bad++;
        }
    CHECK_MSG(bad == 0, "top_k %s (n %lld, k %lld): %lld entries differ; first [%lld] cpu %d cuda %d", name,
              (long long)n, (long long)k, (long long)bad, (long long)first, first >= 0 ? ic[first] : 0,
              first >= 0 ? ig[first] : 0);
    /* the oracle itself: -1 padding past n, sentinels past k */
    for (int64_t i = n; i < k; i++) CHECK_EQ_INT(ic[i], -1);
    for (int64_t i = k; i < k + 4; i++) CHECK_EQ_INT(ic[i], IDX_SENTINEL);
    /* again: the indices stay on the GPU, nothing waits */
    op_buf again = op_ints_from(p, ic, k + 4);
    const ds4_backend_counters c0 = op_gpu_counters(p);
    p->gpu->ops->top_k(p->gpu, s.g, n, k, (int32_t *)again.g);
    op_expect_no_host_traffic(p, name, &c0);
    op_expect_ok(p);
    op_buf_free(p, &again);
    op_buf_free(p, &s);
    free(ic);
    free(ig);
}

static void test_top_k(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const int64_t big = 262144;
    float *s = malloc((size_t)big * sizeof *s);

    for (int64_t i = 0; i < 1000; i++) s[i] = (float)test_rand_normal();
    top_k_case(&p, "random", s, 1000, 100);
    top_k_case(&p, "k = 1", s, 1000, 1);
    top_k_case(&p, "k = n", s, 777, 777);
    top_k_case(&p, "k = 0", s, 1000, 0);

    /* many ties, with -0.0 and +0.0 (equal: the lower index first) */
    for (int64_t i = 0; i < 5000; i++) {
        const int v = (int)rand_range(-1, 2);
        s[i] = v == 0 ? ((test_rand_u64() & 1) ? -0.0f : 0.0f) : (float)v;
    }
    top_k_case(&p, "ties", s, 5000, 512);
    top_k_case(&p, "ties, all", s, 5000, 5000);

    /* NaN (ranks as -inf, tying with -inf), infinities, and k = n */
    for (int64_t i = 0; i < 300; i++) {
        const double u = test_rand_uniform();
        s[i] = u < 0.1 ? NAN : u < 0.15 ? -INFINITY : u < 0.2 ? INFINITY : u < 0.25 ? -NAN : (float)test_rand_normal();
    }
    top_k_case(&p, "NaN and infinities", s, 300, 300);
    top_k_case(&p, "NaN and infinities, k < n", s, 300, 40);
    for (int64_t i = 0; i < 50; i++) s[i] = NAN;
    top_k_case(&p, "all NaN", s, 50, 20);

    /* n < k: -1 padding; n = 0: all -1 */
    for (int64_t i = 0; i < 5; i++) s[i] = (float)test_rand_normal();
    top_k_case(&p, "n < k", s, 5, 16);
    top_k_case(&p, "n = 1", s, 1, 4);
    top_k_case(&p, "n = 0", s, 0, 8);

    /* a decoded token's selection (a little past 2K context: 512 of 520
     * compressed rows), rows sorted whole up to 4096 keys and the radix
     * select past them, around the bound, with and without ties */
    for (int64_t i = 0; i < 8192; i++) s[i] = (float)test_rand_normal();
    top_k_case(&p, "decode, 512 of 520", s, 520, 512);
    top_k_case(&p, "512 of 513", s, 513, 512);
    top_k_case(&p, "512 of 4096 (sorted whole)", s, 4096, 512);
    top_k_case(&p, "512 of 4097 (selected)", s, 4097, 512);
    top_k_case(&p, "4096 of 4096", s, 4096, 4096);
    top_k_case(&p, "3 of 65", s, 65, 3);
    top_k_case(&p, "2 of 2", s, 2, 2);
    for (int64_t i = 0; i < 8192; i++) s[i] = (float)rand_range(-3, 4);
    top_k_case(&p, "ties, 512 of 3000 (sorted whole)", s, 3000, 512);
    top_k_case(&p, "ties, 1000 of 8192 (selected)", s, 8192, 1000);

    /* the model's size: 1M context / 4 rows, top 512 */
    for (int64_t i = 0; i < big; i++) s[i] = (float)test_rand_normal();
    top_k_case(&p, "large", s, big, 512);
    top_k_case(&p, "large, k 2048", s, big, 2048);
    for (int64_t i = 0; i < big; i++) s[i] = (float)(floor(test_rand_normal() * 4.0) / 4.0); /* heavy ties */
    top_k_case(&p, "large with ties", s, big, 2048);
    top_k_case(&p, "large with ties, k 4096 (one block's limit)", s, big, 4096);
    top_k_case(&p, "large with ties, k 4097 (the sort)", s, big, 4097);
    top_k_case(&p, "odd size", s, 100003, 512);
    /* k = 1 (one pass): the greedy token of a vocabulary-sized row, with the
     * maximum tied at several places, at the first and the last index, NaN
     * around it, and a row of only NaN and -inf */
    const int64_t V = 129280;
    for (int64_t i = 0; i < V; i++) s[i] = (float)test_rand_normal();
    top_k_case(&p, "vocabulary row, k 1", s, V, 1);
    s[77777] = s[100] = s[129279] = 9.0f;
    top_k_case(&p, "vocabulary row, tied maximum, k 1", s, V, 1);
    s[0] = 9.0f;
    top_k_case(&p, "vocabulary row, maximum first, k 1", s, V, 1);
    for (int64_t i = 0; i < V; i += 7) s[i] = NAN;
    top_k_case(&p, "vocabulary row with NaN, k 1", s, V, 1);
    for (int64_t i = 0; i < V; i++) s[i] = (i % 3) ? NAN : -INFINITY;
    top_k_case(&p, "NaN and -inf only, k 1", s, V, 1);
    s[V - 1] = 0.0f;
    top_k_case(&p, "one finite value last, k 1", s, V, 1);
    free(s);
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* Error paths                                                               */
/* ------------------------------------------------------------------------ */

static void test_attention_ops_errors(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    float *h = op_rand(4096, 1.0);
    op_buf x = op_buf_from(&p, h, 4096), y = op_buf_from(&p, h, 4096), out = op_buf_poisoned(&p, 4096);
    const int32_t pos[4] = { 1, 2, 3, 4 };

    /* rope_tail: odd, zero or too many rotated dims (same message as the CPU) */
    const int bad_rot[] = { 3, 0, -2, 66 };
    for (size_t i = 0; i < sizeof bad_rot / sizeof bad_rot[0]; i++) {
        const ds4_rope rope = { bad_rot[i], 10000.0f, 1.0f, 0.0f, 0.0f };
        p.cpu->ops->rope_tail(p.cpu, x.c, 2, 2, 64, pos, &rope, false);
        p.gpu->ops->rope_tail(p.gpu, x.g, 2, 2, 64, pos, &rope, false);
        expect_same_error(&p, "rope_tail n_rot");
    }
    p.gpu->ops->rope_tail(p.gpu, x.g, 2, 2, 64, pos, NULL, false); /* the CPU would crash */
    op_expect_error(&p, DS4_ERR_INVALID);
    op_compare("rope_tail after errors: untouched", &p, x, 4096, 0, 0);

    /* attention: sinks, shapes */
    float sv[64];
    for (int i = 0; i < 64; i++) sv[i] = (float)i;
    op_weight *sinks = op_weight_floats(&p, "sinks", DS4_TYPE_F32, 8, 1, 1, sv);
    ds4_weight bogus = { "bogus", 1000, { 64, 1, 1, 1 }, 0, NULL, NULL, NULL }; /* a type nobody can read */
    struct {
        int64_t heads, dim, n_a, n_b;
        int sinks; /* 0 NULL, 1 ok, 2 bogus */
    } bad_att[] = {
        { 4, 8, 2, 0, 0 }, { 9, 8, 2, 0, 1 }, { 4, 0, 2, 0, 1 }, { 4, 8, -1, 0, 1 },
        { 4, 8, 2, -1, 1 }, { -1, 8, 2, 0, 1 }, { 4, 8, 2, 0, 2 },
    };
    for (size_t i = 0; i < sizeof bad_att / sizeof bad_att[0]; i++) {
        const ds4_weight *sc = bad_att[i].sinks == 0 ? NULL : bad_att[i].sinks == 1 ? &sinks->c : &bogus;
        const ds4_weight *sg = bad_att[i].sinks == 0 ? NULL : bad_att[i].sinks == 1 ? &sinks->g : &bogus;
        p.cpu->ops->attention(p.cpu, x.c, bad_att[i].heads, bad_att[i].dim, y.c, bad_att[i].n_a, y.c, 16, NULL,
                              bad_att[i].n_b, sc, out.c);
        p.gpu->ops->attention(p.gpu, x.g, bad_att[i].heads, bad_att[i].dim, y.g, bad_att[i].n_a, y.g, 16, NULL,
                              bad_att[i].n_b, sg, out.g);
        expect_same_error(&p, "attention arguments");
    }
    /* rows_b: a negative row count, more rows than it has */
    const int64_t bad_rows_b[2][2] = { { -1, 0 }, { 3, 4 } }; /* n_rows_b, n_b */
    for (int i = 0; i < 2; i++) {
        p.cpu->ops->attention(p.cpu, x.c, 4, 8, y.c, 2, y.c, bad_rows_b[i][0], NULL, bad_rows_b[i][1], &sinks->c,
                              out.c);
        p.gpu->ops->attention(p.gpu, x.g, 4, 8, y.g, 2, y.g, bad_rows_b[i][0], NULL, bad_rows_b[i][1], &sinks->g,
                              out.g);
        expect_same_error(&p, "attention rows_b");
    }
    expect_untouched("attention after errors", &p, out, 0, 4096);

    /* compressor_pool */
    const int bad_ratio[] = { 0, -3, 4 };
    const int64_t bad_dim[] = { 8, 8, 0 };
    for (int i = 0; i < 3; i++) {
        p.cpu->ops->compressor_pool(p.cpu, x.c, y.c, bad_ratio[i], bad_dim[i], 1, out.c);
        p.gpu->ops->compressor_pool(p.gpu, x.g, y.g, bad_ratio[i], bad_dim[i], 1, out.g);
        expect_same_error(&p, "compressor_pool arguments");
    }
    p.cpu->ops->compressor_pool(p.cpu, x.c, y.c, 4, 8, -1, out.c);
    p.gpu->ops->compressor_pool(p.gpu, x.g, y.g, 4, 8, -1, out.g);
    expect_same_error(&p, "compressor_pool windows");

    /* indexer_scores: negative sizes (the CPU does nothing with them) */
    p.gpu->ops->indexer_scores(p.gpu, x.g, y.g, 1.0f, 4, 8, y.g, -1, out.g);
    op_expect_error(&p, DS4_ERR_INVALID);
    p.gpu->ops->indexer_scores(p.gpu, x.g, y.g, 1.0f, -4, 8, y.g, 10, out.g);
    op_expect_error(&p, DS4_ERR_INVALID);
    expect_untouched("indexer_scores after errors", &p, out, 0, 4096);

    /* top_k: negative sizes, more rows than int32 indices */
    const int32_t none[8] = { 0 };
    op_buf tk = op_ints_from(&p, none, 8);
    const int64_t bad_n[] = { -1, 10, (int64_t)INT32_MAX + 1 };
    const int64_t bad_k[] = { 4, -1, 4 };
    for (int i = 0; i < 3; i++) {
        p.cpu->ops->top_k(p.cpu, x.c, bad_n[i], bad_k[i], (int32_t *)tk.c);
        p.gpu->ops->top_k(p.gpu, x.g, bad_n[i], bad_k[i], (int32_t *)tk.g);
        expect_same_error(&p, "top_k arguments");
    }
    op_buf_free(&p, &tk);

    /* after all that the backend still works */
    op_expect_ok(&p);
    compressor_case(&p, 4, 64);
    top_k_case(&p, "after errors", h, 4096, 64);

    op_weight_free(&p, sinks);
    op_buf_free(&p, &x);
    op_buf_free(&p, &y);
    op_buf_free(&p, &out);
    free(h);
    op_pair_close(&p);
}

/* Selected-row indices in device memory outside rows_b: the kernel finds
 * them; take_error reports the first (the CPU's message for the same index,
 * naming the op, the entry, the index, the range and the sinks), and the
 * backend computes correctly afterwards. */
static void test_attention_bad_index(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const int64_t heads = 8, dim = 64, n_a = 5, n_rows_b = 7, n_b = 4;
    float *hq = op_rand(heads * dim, 1.0), *ha = op_rand(n_a * dim, 1.0), *hb = op_rand(n_rows_b * dim, 1.0);
    float *hs = op_rand(heads, 1.0);
    op_weight *sinks = op_weight_floats(&p, "blk.2.attn_sinks.weight", DS4_TYPE_F32, heads, 1, 1, hs);
    op_buf q = op_buf_from(&p, hq, heads * dim), ra = op_buf_from(&p, ha, n_a * dim);
    op_buf rb = op_buf_from(&p, hb, n_rows_b * dim), out = op_buf_poisoned(&p, heads * dim);
    const struct {
        int32_t idx[4];
        const char *index, *row;
    } bad[] = {
        { { 0, 6, 7, 1 }, "index 7,", "row 2 " },             /* one past the end */
        { { -3, 2, 2, 5 }, "index -3,", "row 0 " },           /* negative */
        { { 3, 1, 0, INT32_MAX }, "index 2147483647,", "row 3 " }, /* far out */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        op_buf ib = op_ints_from(&p, bad[i].idx, n_b);
        p.cpu->ops->attention(p.cpu, q.c, heads, dim, ra.c, n_a, rb.c, n_rows_b, (const int32_t *)ib.c, n_b,
                              &sinks->c, out.c);
        p.gpu->ops->attention(p.gpu, q.g, heads, dim, ra.g, n_a, rb.g, n_rows_b, (const int32_t *)ib.g, n_b,
                              &sinks->g, out.g);
        ds4_error ec = { 0 }, eg = { 0 };
        CHECK(p.cpu->ops->take_error(p.cpu, &ec) == DS4_ERR_INVALID);
        CHECK_MSG(p.gpu->ops->take_error(p.gpu, &eg) == DS4_ERR_INVALID, "attention bad index %zu: %s", i,
                  eg.message);
        CHECK_MSG(strcmp(ec.message, eg.message) == 0, "messages differ: cpu \"%s\" cuda \"%s\"", ec.message,
                  eg.message);
        CHECK_MSG(strstr(eg.message, "attention") && strstr(eg.message, bad[i].index) &&
                  strstr(eg.message, bad[i].row) && strstr(eg.message, "[0, 7)") &&
                  strstr(eg.message, "blk.2.attn_sinks.weight"), "%s", eg.message);
        op_expect_ok(&p); /* taken and cleared */
        op_buf_free(&p, &ib);
    }
    /* two bad calls before take_error: the first one is reported */
    {
        op_buf b1 = op_ints_from(&p, bad[0].idx, n_b), b2 = op_ints_from(&p, bad[1].idx, n_b);
        p.gpu->ops->attention(p.gpu, q.g, heads, dim, ra.g, n_a, rb.g, n_rows_b, (const int32_t *)b1.g, n_b,
                              &sinks->g, out.g);
        p.gpu->ops->attention(p.gpu, q.g, heads, dim, ra.g, n_a, rb.g, n_rows_b, (const int32_t *)b2.g, n_b,
                              &sinks->g, out.g);
        op_expect_error_with(&p, "first of two bad indices", "attention", "index 7,", "row 2 ", NULL);
        op_buf_free(&p, &b1);
        op_buf_free(&p, &b2);
    }
    /* the backend still computes, from device indices, as the CPU does */
    const att_case after = { "after bad indices", 16, 512, 40, 64, 90, SEL_REPEATS, 1.0, 0.0, 1.0, DS4_TYPE_F32, 0 };
    attention_case(&p, &after);
    op_weight_free(&p, sinks);
    op_buf_free(&p, &q);
    op_buf_free(&p, &ra);
    op_buf_free(&p, &rb);
    op_buf_free(&p, &out);
    free(hq);
    free(ha);
    free(hb);
    free(hs);
    op_pair_close(&p);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_rope_tail),
    TEST_ENTRY(test_head_norm_rope),
    TEST_ENTRY(test_head_norm_rope2),
    TEST_ENTRY(test_attention),
    TEST_ENTRY(test_attention_rows),
    TEST_ENTRY(test_attention_rows_f16),
    TEST_ENTRY(test_indexer_rows_f16),
    TEST_ENTRY(test_compressor_pool),
    TEST_ENTRY(test_indexer_scores),
    TEST_ENTRY(test_indexer_rows),
    TEST_ENTRY(test_top_k),
    TEST_ENTRY(test_attention_ops_errors),
    TEST_ENTRY(test_attention_bad_index),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

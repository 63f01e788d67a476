/* test_cuda_hc_ffn.c - the CUDA hyper-connection ops (hc_pre, hc_post,
 * hc_head), router and SwiGLU against the CPU backend, through the op table:
 * the same random inputs on both sides, outputs poisoned with NaN before
 * each launch, every output element compared, plus the error paths.
 *
 * Tolerances (atol, rtol for op_compare) follow from the precision of each op:
 *
 *  - hc_pre / hc_head: the CUDA kernel repeats the CPU's operations except for
 *    the order of the long float sums of the mix (fn . f over n_hc * dim
 *    terms; tree on the GPU, 8 sequential lanes on the CPU). With O(1) terms
 *    their rounding errors grow like sqrt(n) * FLT_EPSILON (random walk); the
 *    mix is O(1) by construction (fn ~ N(0, 1/n)). The sigmoid / softmax /
 *    Sinkhorn split passes a mix error on with a gain below ~1 (scales are
 *    <= 1.5), and the weighted stream sum multiplies it by O(|X|) <= ~5
 *    times the row's scale (so x_out is compared per row with atol scaled
 *    by the row: its elements may cancel far below the row's magnitude);
 *    CUDA's expf may differ from the C library's by 2 ulp. tol = 4 *
 *    sqrt(n) * FLT_EPSILON (6.1e-5 at the real 16384, 7.6e-6 at 256); a host
 *    emulation of the kernel's exact summation order stayed below 0.5 *
 *    sqrt(n) * FLT_EPSILON over several seeds, so the margin is >= 8x, and
 *    the bound is still orders of magnitude below what a wrong index, stream
 *    or Sinkhorn step does (errors of 1e-2 .. 1).
 *  - hc_post: the same float operations in the same order, no FMA, no
 *    library function on either side: exact (0, 0).
 *  - router: expert ids exactly (inputs are drawn so that no two distinct
 *    scores near the selection boundary are within 1e-5 of each other, while
 *    exact ties are deliberate). Weights: prob = sqrt(softplus) differs by a
 *    few ulp (CUDA expf / log1pf vs the C library, ~3 ulp after the sqrt), the
 *    normalisation adds the sum's and the division's: ~7 ulp = 4e-7 relative;
 *    rtol 2e-6. Every case runs as one token and as 5 tokens in one call
 *    (each row drawn well posed on its own).
 *  - swiglu: one expf (<= 2 ulp apart) and four correctly rounded operations:
 *    rtol 2e-6; atol 1e-30 for results in the subnormal range, where the
 *    2-ulp difference of expf is a large relative one.
 *
 * Without a usable CUDA device every test reports SKIPPED.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_op_test.h"

#define OPEN_OR_SKIP(p)                                                  \
    do {                                                                 \
        if (!op_pair_open(p)) TEST_SKIP("%s", op_pair_skip_reason);      \
    } while (0)

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

static double hc_tol(int64_t hc_dim) { return 4.0 * sqrt((double)hc_dim) * FLT_EPSILON; }

/* n host floats uniform in [lo, hi) (malloc'd). */
static float *rand_uniform(int64_t n, double lo, double hi) {
    float *h = malloc((size_t)(n > 0 ? n : 1) * sizeof *h);
    for (int64_t i = 0; i < n; i++) h[i] = (float)(lo + (hi - lo) * test_rand_uniform());
    return h;
}

/* The GPU side of b[off .. off + n) is still all NaN (a kernel wrote nothing
 * past the output it owns). */
static void check_guard(const char *what, op_pair *p, op_buf b, int64_t off, int64_t n) {
    float *h = malloc((size_t)n * sizeof *h);
    p->gpu->ops->download(p->gpu, h, b.g + off, n);
    int64_t written = 0;
    for (int64_t i = 0; i < n; i++) written += !isnan(h[i]);
    CHECK_MSG(written == 0, "%s: %lld floats past the output were written", what, (long long)written);
    free(h);
}

/* HC states: rows of N(0, 1) scaled by a per-row factor, so the plain norm
 * sees very different magnitudes (the outputs scale with the row). */
static const double hc_row_scale[] = { 1.0, 1e3, 1e-3, 7.0, 0.05 };

static float *hc_states(int64_t n_rows, int64_t hc_dim) {
    float *X = op_rand(n_rows * hc_dim, 1.0);
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t i = 0; i < hc_dim; i++) X[r * hc_dim + i] *= (float)hc_row_scale[r % 5];
    return X;
}

/* Compare the weighted stream sums row by row: an output element is
 * sum_s w_s X[s][i], so its error is relative to the row's scale (the sum may
 * cancel to far below it), i.e. atol = tol * row scale. */
static void compare_hc_rows(const char *what, op_pair *p, op_buf b, int64_t n_rows, int64_t dim, double tol) {
    for (int64_t r = 0; r < n_rows; r++) {
        const op_buf row = { b.c + r * dim, b.g + r * dim };
        char name[160];
        snprintf(name, sizeof name, "%s row %lld", what, (long long)r);
        op_compare(name, p, row, dim, tol * hc_row_scale[r % 5], tol);
    }
}

/* ------------------------------------------------------------------------ */
/* hc_pre                                                                    */
/* ------------------------------------------------------------------------ */

static void check_hc_pre_norm(op_pair *p, const ds4_hc *hc, op_weight *fn, op_weight *scale, op_weight *base,
                              op_buf X, int64_t n_rows, bool weighted, bool in_place, const char *what);
static void check_hc_post_pre_norm(op_pair *p, const ds4_hc *hc, op_weight *fn, op_weight *scale, op_weight *base,
                                   int64_t n_rows, bool with_y2, const char *what);
static void check_hc_all_same(op_pair *p, const ds4_hc *hc, op_weight *fn, op_weight *scale, op_weight *base,
                              op_buf X, int64_t n_rows, int mode, const char *what);
static long env_long_default(const char *name, long dflt);

/* n streams: up to 5 (the model's 4 among them) the split runs on one
 * warp, past that on one thread; every case runs hc_pre_norm too. */
static void check_hc_pre_n(op_pair *p, int n, int64_t dim, int64_t n_rows, uint32_t fn_type) {
    const ds4_hc hc = { n, dim, 20, 1e-6f, 1e-6f };
    const int64_t hc_dim = n * dim, n_mix = (2 + n) * n;
    float *hfn = op_rand(hc_dim * n_mix, 1.0 / sqrt((double)hc_dim)); /* mix ~ N(0, 1) */
    float *hscale = rand_uniform(3, 0.5, 1.5);
    float *hbase = op_rand(n_mix, 0.5);
    float *hX = hc_states(n_rows, hc_dim);
    op_weight *fn = op_weight_floats(p, "hc_fn", fn_type, hc_dim, n_mix, 1, hfn);
    op_weight *scale = op_weight_floats(p, "hc_scale", DS4_TYPE_F32, 3, 1, 1, hscale);
    op_weight *base = op_weight_floats(p, "hc_base", DS4_TYPE_F32, n_mix, 1, 1, hbase);
    op_buf X = op_buf_from(p, hX, n_rows * hc_dim);
    /* one extra (poisoned) row past each output: nothing may be written there */
    op_buf x_out = op_buf_poisoned(p, (n_rows + 1) * dim);
    op_buf post = op_buf_poisoned(p, (n_rows + 1) * n);
    op_buf comb = op_buf_poisoned(p, (n_rows + 1) * n * n);

    p->cpu->ops->hc_pre(p->cpu, &hc, X.c, &fn->c, &scale->c, &base->c, x_out.c, post.c, comb.c, n_rows);
    p->gpu->ops->hc_pre(p->gpu, &hc, X.g, &fn->g, &scale->g, &base->g, x_out.g, post.g, comb.g, n_rows);
    op_expect_ok(p);
    const double tol = hc_tol(hc_dim);
    char what[96];
    snprintf(what, sizeof what, "hc_pre x_out (%d streams, dim %lld, %lld rows, %s)", n, (long long)dim,
             (long long)n_rows, ds4_type_name(fn_type));
    compare_hc_rows(what, p, x_out, n_rows, dim, tol);
    check_guard(what, p, x_out, n_rows * dim, dim);
    snprintf(what, sizeof what, "hc_pre post (dim %lld, %lld rows, %s)", (long long)dim, (long long)n_rows,
             ds4_type_name(fn_type));
    op_compare(what, p, post, n_rows * n, tol, tol);
    check_guard(what, p, post, n_rows * n, n);
    snprintf(what, sizeof what, "hc_pre comb (dim %lld, %lld rows, %s)", (long long)dim, (long long)n_rows,
             ds4_type_name(fn_type));
    op_compare(what, p, comb, n_rows * n * n, tol, tol);
    check_guard(what, p, comb, n_rows * n * n, n * n);
    snprintf(what, sizeof what, "%d streams, dim %lld, %lld rows, %s", n, (long long)dim, (long long)n_rows,
             ds4_type_name(fn_type));
    check_hc_pre_norm(p, &hc, fn, scale, base, X, n_rows, n == 4 || n_rows % 2 == 0, n_rows == 3, what);
    check_hc_post_pre_norm(p, &hc, fn, scale, base, n_rows, true, what);
    if (n_rows == 1) check_hc_post_pre_norm(p, &hc, fn, scale, base, n_rows, false, what);
    /* the partial blocks taking every mix row (set_hc_all 2), then one group each (0): the same bits */
    for (int mode = 2; mode >= 0; mode -= 2) {
        ds4_cuda_backend_set_hc_all(p->gpu, mode);
        char m[160];
        snprintf(m, sizeof m, "%s, hc_all %d", what, mode);
        check_hc_all_same(p, &hc, fn, scale, base, X, n_rows, mode, m);
        check_hc_post_pre_norm(p, &hc, fn, scale, base, n_rows, true, m);
    }
    ds4_cuda_backend_set_hc_all(p->gpu, (int)env_long_default("DS4_CUDA_HC_ALL", 1));

    op_buf_free(p, &X);
    op_buf_free(p, &x_out);
    op_buf_free(p, &post);
    op_buf_free(p, &comb);
    op_weight_free(p, fn);
    op_weight_free(p, scale);
    op_weight_free(p, base);
    free(hfn);
    free(hscale);
    free(hbase);
    free(hX);
}

/* An integer setting from the environment (dflt when unset or not a number). */
static long env_long_default(const char *name, long dflt) {
    const char *e = getenv(name);
    char *end = NULL;
    const long v = e && *e ? strtol(e, &end, 10) : dflt;
    return end && *end ? dflt : v;
}

static void check_gpu_same(const char *what, op_pair *p, op_buf a, op_buf b, int64_t n);

/* hc_pre under hc_all `mode` against hc_pre with the partial blocks one
 * mix group each (set_hc_all 0), bit for bit in every output; mode is set
 * again on return. */
static void check_hc_all_same(op_pair *p, const ds4_hc *hc, op_weight *fn, op_weight *scale, op_weight *base,
                              op_buf X, int64_t n_rows, int mode, const char *what) {
    const int n = hc->n_hc;
    const int64_t dim = hc->dim;
    op_buf x[2], post[2], comb[2];
    for (int v = 0; v < 2; v++) {
        x[v] = op_buf_poisoned(p, (n_rows + 1) * dim);
        post[v] = op_buf_poisoned(p, (n_rows + 1) * n);
        comb[v] = op_buf_poisoned(p, (n_rows + 1) * n * n);
    }
    for (int v = 0; v < 2; v++) {
        ds4_cuda_backend_set_hc_all(p->gpu, v ? 0 : mode);
        p->gpu->ops->hc_pre(p->gpu, hc, X.g, &fn->g, &scale->g, &base->g, x[v].g, post[v].g, comb[v].g, n_rows);
        op_expect_ok(p);
    }
    ds4_cuda_backend_set_hc_all(p->gpu, mode);
    char name[200];
    snprintf(name, sizeof name, "hc_pre (%s) against one mix group a block", what);
    check_gpu_same(name, p, x[0], x[1], (n_rows + 1) * dim);
    check_gpu_same(name, p, post[0], post[1], (n_rows + 1) * n);
    check_gpu_same(name, p, comb[0], comb[1], (n_rows + 1) * n * n);
    for (int v = 0; v < 2; v++) {
        op_buf_free(p, &x[v]);
        op_buf_free(p, &post[v]);
        op_buf_free(p, &comb[v]);
    }
}

/* The GPU sides of a and b hold the same n floats, bit for bit. */
static void check_gpu_same(const char *what, op_pair *p, op_buf a, op_buf b, int64_t n) {
    const int64_t diff = op_gpu_differ(p, a, b, n);
    CHECK_MSG(diff == 0, "%s: %lld of %lld floats differ from the reference's (bit for bit)", what,
              (long long)diff, (long long)n);
}

/* The GPU's norm rows a (n_rows of dim) against the CPU's, each element
 * within the bound that an error of tol * (row scale) in the normed x
 * (CPU side x.c) implies: a_i = x_i w_i s with s = 1 / rms(x), so about
 * 2 tol (row scale) s (|w_i| + |a_i|). w: the norm weight's floats (NULL:
 * plain). */
static void check_norm_rows(const char *name, op_pair *p, op_buf a, op_buf x, const float *w, int64_t n_rows,
                            int64_t dim, double tol) {
    float *ac = malloc((size_t)(n_rows * dim) * sizeof *ac), *ag = malloc((size_t)(n_rows * dim) * sizeof *ag);
    float *xc = malloc((size_t)(n_rows * dim) * sizeof *xc);
    p->cpu->ops->download(p->cpu, ac, a.c, n_rows * dim);
    p->gpu->ops->download(p->gpu, ag, a.g, n_rows * dim);
    p->cpu->ops->download(p->cpu, xc, x.c, n_rows * dim);
    int64_t bad = 0;
    double worst = 0.0;
    for (int64_t r = 0; r < n_rows; r++) {
        double ss = 0.0;
        for (int64_t i = 0; i < dim; i++) ss += (double)xc[r * dim + i] * xc[r * dim + i];
        const double s = 1.0 / sqrt(ss / (double)dim + 1e-6);
        for (int64_t i = 0; i < dim; i++) {
            const double c = ac[r * dim + i], g = ag[r * dim + i], wi = w ? fabs((double)w[i]) : 1.0;
            const double bound = 2.0 * tol * hc_row_scale[r % 5] * s * (wi + fabs(c)) + 1e-30;
            const double e = fabs(g - c);
            if (!(e <= bound)) bad++;
            if (e / bound > worst) worst = e / bound;
        }
    }
    CHECK_MSG(bad == 0, "%s norm: %lld elements outside the bound (worst %.3g of it)", name, (long long)bad, worst);
    free(ac);
    free(ag);
    free(xc);
}

/*
 * hc_pre_norm on one set of inputs (the caller's hc_pre case): the fused
 * kernel (ds4_cuda_backend_set_hc_norm 1) against the hc_pre and rmsnorm
 * kernels (0), bit for bit in every output, and against the CPU: x_out
 * as hc_pre's, the norm row by row with the bound x_out's error implies
 * (a_i = x_i w_i s, s = 1 / rms(x): an error e per element of x moves a_i
 * by about s (|w_i| + |a_i|) e). A norm weight (F32) or plain; a_out
 * apart from x_out or equal to it (then it holds the norm).
 */
static void check_hc_pre_norm(op_pair *p, const ds4_hc *hc, op_weight *fn, op_weight *scale, op_weight *base,
                              op_buf X, int64_t n_rows, bool weighted, bool in_place, const char *what) {
    const int n = hc->n_hc;
    const int64_t dim = hc->dim;
    float *hw = op_rand(dim, 1.0);
    op_weight *nw = op_weight_floats(p, "blk.0.attn_norm.weight", DS4_TYPE_F32, dim, 1, 1, hw);
    const ds4_weight *nc = weighted ? &nw->c : NULL, *ng = weighted ? &nw->g : NULL;
    op_buf x[2], a[2], post[2], comb[2];
    for (int v = 0; v < 2; v++) {
        x[v] = op_buf_poisoned(p, (n_rows + 1) * dim);
        a[v] = in_place ? x[v] : op_buf_poisoned(p, (n_rows + 1) * dim);
        post[v] = op_buf_poisoned(p, (n_rows + 1) * n);
        comb[v] = op_buf_poisoned(p, (n_rows + 1) * n * n);
    }
    p->cpu->ops->hc_pre_norm(p->cpu, hc, X.c, &fn->c, &scale->c, &base->c, nc, 1e-6f, x[0].c, post[0].c,
                             comb[0].c, a[0].c, n_rows);
    for (int v = 0; v < 2; v++) { /* v 0: fused, 1: the ops' kernels */
        ds4_cuda_backend_set_hc_norm(p->gpu, v == 0);
        p->gpu->ops->hc_pre_norm(p->gpu, hc, X.g, &fn->g, &scale->g, &base->g, ng, 1e-6f, x[v].g, post[v].g,
                                 comb[v].g, a[v].g, n_rows);
    }
    ds4_cuda_backend_set_hc_norm(p->gpu, env_on_default("DS4_CUDA_HC_NORM", true));
    op_expect_ok(p);
    char name[160];
    snprintf(name, sizeof name, "hc_pre_norm (%s, %s%s)", what, weighted ? "weighted" : "plain",
             in_place ? ", in place" : "");
    check_gpu_same(name, p, a[0], a[1], (n_rows + 1) * dim);
    check_gpu_same(name, p, post[0], post[1], (n_rows + 1) * n);
    check_gpu_same(name, p, comb[0], comb[1], (n_rows + 1) * n * n);
    const double tol = hc_tol(n * dim);
    if (!in_place) {
        check_gpu_same(name, p, x[0], x[1], (n_rows + 1) * dim);
        compare_hc_rows(name, p, x[0], n_rows, dim, tol);
    }
    check_guard(name, p, a[0], n_rows * dim, dim);
    op_compare(name, p, post[0], n_rows * n, tol, tol);
    op_compare(name, p, comb[0], n_rows * n * n, tol, tol);
    /* the norm against the CPU's, with the bound from x's error (x: hc_pre's
     * on the CPU; in place a[0] holds the norm) */
    p->cpu->ops->hc_pre(p->cpu, hc, X.c, &fn->c, &scale->c, &base->c, x[1].c, post[1].c, comb[1].c, n_rows);
    op_expect_ok(p);
    check_norm_rows(name, p, a[0], x[1], weighted ? hw : NULL, n_rows, dim, tol);
    for (int v = 0; v < 2; v++) {
        op_buf_free(p, &x[v]);
        if (!in_place) op_buf_free(p, &a[v]);
        op_buf_free(p, &post[v]);
        op_buf_free(p, &comb[v]);
    }
    op_weight_free(p, nw);
    free(hw);
}

/*
 * hc_post_pre_norm (with the routed sum y2 or without): the fused kernels
 * (ds4_cuda_backend_set_hc_post_pre 1), and the fused partial kernel with
 * the norm's kernel apart (set_hc_norm 0), against hc_post's kernel and
 * then hc_pre_norm's (0), bit for bit in every output; the new state against
 * the CPU's bit for bit (add and hc_post are exact), x_out, post, comb and
 * the norm as hc_pre_norm's. The mix is written over the one read, as the
 * model calls it.
 */
static void check_hc_post_pre_norm(op_pair *p, const ds4_hc *hc, op_weight *fn, op_weight *scale, op_weight *base,
                                   int64_t n_rows, bool with_y2, const char *what) {
    const int n = hc->n_hc;
    const int64_t dim = hc->dim, hc_dim = n * dim;
    float *hw = op_rand(dim, 1.0), *hXp = hc_states(n_rows, hc_dim), *hy = hc_states(n_rows, dim);
    float *hy2 = hc_states(n_rows, dim), *hpost = rand_uniform(n_rows * n, 0.0, 2.0);
    float *hcomb = rand_uniform(n_rows * n * n, 0.0, 0.5);
    op_weight *nw = op_weight_floats(p, "blk.0.ffn_norm.weight", DS4_TYPE_F32, dim, 1, 1, hw);
    op_buf Xp = op_buf_from(p, hXp, n_rows * hc_dim), y = op_buf_from(p, hy, n_rows * dim);
    op_buf y2 = op_buf_from(p, hy2, n_rows * dim);
    op_buf Xo[3], x[3], a[3], post[3], comb[3];
    for (int v = 0; v < 3; v++) {
        Xo[v] = op_buf_poisoned(p, (n_rows + 1) * hc_dim);
        x[v] = op_buf_poisoned(p, (n_rows + 1) * dim);
        a[v] = op_buf_poisoned(p, (n_rows + 1) * dim);
        post[v] = op_buf_from(p, hpost, n_rows * n);
        comb[v] = op_buf_from(p, hcomb, n_rows * n * n);
    }
    p->cpu->ops->hc_post_pre_norm(p->cpu, hc, y.c, with_y2 ? y2.c : NULL, Xp.c, post[0].c, comb[0].c, Xo[0].c,
                                  &fn->c, &scale->c, &base->c, &nw->c, 1e-6f, x[0].c, post[0].c, comb[0].c, a[0].c,
                                  n_rows);
    for (int v = 0; v < 3; v++) { /* v 0: fused, 1: the norm's kernel apart, 2: hc_post's kernel, then hc_pre_norm's */
        ds4_cuda_backend_set_hc_post_pre(p->gpu, v < 2);
        ds4_cuda_backend_set_hc_norm(p->gpu, v != 1);
        p->gpu->ops->hc_post_pre_norm(p->gpu, hc, y.g, with_y2 ? y2.g : NULL, Xp.g, post[v].g, comb[v].g, Xo[v].g,
                                      &fn->g, &scale->g, &base->g, &nw->g, 1e-6f, x[v].g, post[v].g, comb[v].g,
                                      a[v].g, n_rows);
    }
    ds4_cuda_backend_set_hc_post_pre(p->gpu, env_on_default("DS4_CUDA_HC_POST_PRE", true));
    ds4_cuda_backend_set_hc_norm(p->gpu, env_on_default("DS4_CUDA_HC_NORM", true));
    op_expect_ok(p);
    char name[160];
    snprintf(name, sizeof name, "hc_post_pre_norm (%s%s)", what, with_y2 ? ", y2" : "");
    for (int v = 0; v < 2; v++) {
        check_gpu_same(name, p, Xo[v], Xo[2], (n_rows + 1) * hc_dim);
        check_gpu_same(name, p, x[v], x[2], (n_rows + 1) * dim);
        check_gpu_same(name, p, a[v], a[2], (n_rows + 1) * dim);
        check_gpu_same(name, p, post[v], post[2], n_rows * n);
        check_gpu_same(name, p, comb[v], comb[2], n_rows * n * n);
    }
    op_compare(name, p, Xo[0], n_rows * hc_dim, 0.0, 0.0);
    check_guard(name, p, Xo[0], n_rows * hc_dim, hc_dim);
    const double tol = hc_tol(hc_dim);
    compare_hc_rows(name, p, x[0], n_rows, dim, tol);
    op_compare(name, p, post[0], n_rows * n, tol, tol);
    op_compare(name, p, comb[0], n_rows * n * n, tol, tol);
    check_norm_rows(name, p, a[0], x[0], hw, n_rows, dim, tol);
    for (int v = 0; v < 3; v++) {
        op_buf_free(p, &Xo[v]);
        op_buf_free(p, &x[v]);
        op_buf_free(p, &a[v]);
        op_buf_free(p, &post[v]);
        op_buf_free(p, &comb[v]);
    }
    op_buf_free(p, &Xp);
    op_buf_free(p, &y);
    op_buf_free(p, &y2);
    op_weight_free(p, nw);
    free(hw);
    free(hXp);
    free(hy);
    free(hy2);
    free(hpost);
    free(hcomb);
}

static void check_hc_pre(op_pair *p, int64_t dim, int64_t n_rows, uint32_t fn_type) {
    check_hc_pre_n(p, 4, dim, n_rows, fn_type);
}

static void test_hc_pre_small(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    check_hc_pre(&p, 64, 1, DS4_TYPE_F32);
    check_hc_pre(&p, 64, 37, DS4_TYPE_F32);
    check_hc_pre(&p, 64, 1, DS4_TYPE_F16);
    check_hc_pre(&p, 64, 37, DS4_TYPE_F16);
    check_hc_pre(&p, 64, 5, DS4_TYPE_BF16);
    check_hc_pre(&p, 64, 11, DS4_TYPE_BF16); /* two blocks of hc_partial_rows_kernel's rows, the second partial */
    check_hc_pre(&p, 3, 9, DS4_TYPE_F32); /* a state narrower than the block */
    check_hc_pre(&p, 36, 3, DS4_TYPE_F16); /* 144 values: the last thread's eight straddle no row end, rows 8-aligned */
    check_hc_pre(&p, 33, 3, DS4_TYPE_F16); /* 132 values, not a multiple of 8: element-wise loads */
    check_hc_pre_n(&p, 3, 64, 5, DS4_TYPE_F16); /* the split over one warp */
    check_hc_pre_n(&p, 5, 40, 2, DS4_TYPE_F32);
    check_hc_pre_n(&p, 7, 64, 3, DS4_TYPE_F16); /* the split on one thread; 63 mix rows, a partial last group */
    check_hc_pre(&p, 64, 70, DS4_TYPE_F16);     /* rows enough for the fused norm kernel */
    check_hc_pre(&p, 36, 65, DS4_TYPE_F32);
    check_hc_pre_n(&p, 3, 64, 66, DS4_TYPE_F32);
    op_pair_close(&p);
}

static void test_hc_pre_real(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    check_hc_pre(&p, 4096, 1, DS4_TYPE_F32);
    check_hc_pre(&p, 4096, 37, DS4_TYPE_F32);
    check_hc_pre(&p, 4096, 1, DS4_TYPE_F16);
    check_hc_pre(&p, 4096, 37, DS4_TYPE_F16);
    op_pair_close(&p);
}

/* The largest batch the model runs (256 rows) at the real width, F16 fn. */
static void test_hc_pre_batch(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    check_hc_pre(&p, 4096, 256, DS4_TYPE_F16);
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* hc_pre's deferred Sinkhorn                                                */
/* ------------------------------------------------------------------------ */

/*
 * hc_pre's comb logits left for later (ds4_cuda_backend_set_hc_defer): a
 * weight product after it runs the Sinkhorn rounds beside its own work, or
 * whatever reads comb first (hc_post, a download) settles them in a kernel
 * of their own. Either way x_out, post, comb and the state hc_post makes
 * from them are those of the split in the finishing kernel, bit for bit,
 * and the products' outputs are their own. Modes:
 *   0 the split in the finishing kernel (the reference, also against the
 *     CPU; the reference products too);
 *   1 a product after hc_pre takes the task;
 *   2 no product is long enough: hc_post settles it;
 *   3 a recorded step: the one product long enough runs on a side branch,
 *     which must not take the task (a product or settle on the main chain
 *     would not wait for the branch); hc_post settles it;
 *   4 a recorded step: hc_post on a side branch settles the task there, and
 *     an hc_post on the main chain before the join must join that branch;
 *   5 a recorded step: a product on the main chain takes it;
 *   6 a matmul_multi of two products (a grid of two matrices: only the
 *     first matrix's extra blocks may run the task) takes it.
 * Past 8 rows nothing is deferred (every mode is the reference's path).
 */
#define DEFER_MODES 7
static void check_hc_defer(op_pair *p, int64_t n_rows) {
    const int n = 4;
    const int64_t dim = 4096, hc_dim = n * dim, n_mix = (2 + n) * n, pin = 1024, pout = 256, pbig = 512;
    const ds4_hc hc = { n, dim, 20, 1e-6f, 1e-6f };
    float *hfn = op_rand(hc_dim * n_mix, 1.0 / sqrt((double)hc_dim));
    float *hscale = rand_uniform(3, 0.5, 1.5), *hbase = op_rand(n_mix, 0.5);
    float *hX = hc_states(n_rows, hc_dim), *hy = op_rand(n_rows * dim, 2.0);
    float *hw = op_rand(pin * pbig, 1.0 / sqrt((double)pin)), *hxp = op_rand(pin, 1.0);
    op_weight *fn = op_weight_floats(p, "hc_fn", DS4_TYPE_F16, hc_dim, n_mix, 1, hfn);
    op_weight *scale = op_weight_floats(p, "hc_scale", DS4_TYPE_F32, 3, 1, 1, hscale);
    op_weight *base = op_weight_floats(p, "hc_base", DS4_TYPE_F32, n_mix, 1, 1, hbase);
    op_weight *wp = op_weight_floats(p, "blk.0.defer_w.weight", DS4_TYPE_F16, pin, pout, 1, hw);
    op_weight *wb = op_weight_floats(p, "blk.0.defer_big.weight", DS4_TYPE_F16, pin, pbig, 1, hw);
    const int64_t big_bytes = pin * pbig * 2; /* wb's: only it reaches mode 3's bound */
    op_buf X = op_buf_from(p, hX, n_rows * hc_dim), y = op_buf_from(p, hy, n_rows * dim), xp = op_buf_from(p, hxp, pin);
    op_buf x_out[DEFER_MODES], post[DEFER_MODES], comb[DEFER_MODES], Xo[DEFER_MODES], yp[DEFER_MODES];
    op_buf side = op_buf_poisoned(p, pbig), side_ref = op_buf_poisoned(p, pbig), Xo2 = op_buf_poisoned(p, n_rows * hc_dim);
    op_buf ym[2], ym_ref[2];
    for (int i = 0; i < 2; i++) ym[i] = op_buf_poisoned(p, pout), ym_ref[i] = op_buf_poisoned(p, pout);
    const bool mv = env_on_default("DS4_CUDA_MATVEC", true);
    const bool recorded = env_on_default("DS4_CUDA_GRAPH", true) && !env_on_default("DS4_CUDA_PROFILE", false);
    const bool deferred = n_rows <= 8;
    ds4_backend *g = p->gpu;
    ds4_cuda_backend_set_branches(g, 1);
    for (int m = 0; m < DEFER_MODES; m++) {
        x_out[m] = op_buf_poisoned(p, n_rows * dim);
        post[m] = op_buf_poisoned(p, n_rows * n);
        comb[m] = op_buf_poisoned(p, n_rows * n * n);
        Xo[m] = op_buf_poisoned(p, n_rows * hc_dim);
        yp[m] = op_buf_poisoned(p, pout);
        ds4_cuda_backend_set_hc_defer(g, m != 0, m == 2 ? INT64_MAX / 4 : m == 3 ? big_bytes : 1);
        uint64_t t0 = 0, s0 = 0, t1 = 0, s1 = 0, b0 = 0, j0 = 0, b1 = 0, j1 = 0;
        ds4_cuda_backend_hc_defer_stats(g, &t0, &s0);
        ds4_cuda_backend_branch_stats(g, &b0, &j0);
        const bool step = m == 3 || m == 4 || m == 5;
        if (step) g->ops->step_begin(g);
        g->ops->hc_pre(g, &hc, X.g, &fn->g, &scale->g, &base->g, x_out[m].g, post[m].g, comb[m].g, n_rows);
        if (m == 4) {
            g->ops->branch_begin(g);
            g->ops->hc_post(g, &hc, y.g, X.g, post[m].g, comb[m].g, Xo[m].g, n_rows);
            g->ops->branch_end(g);
            g->ops->hc_post(g, &hc, y.g, X.g, post[m].g, comb[m].g, Xo2.g, n_rows);
            g->ops->branch_join(g);
            g->ops->matmul(g, &wp->g, 0, pout, xp.g, pin, yp[m].g, pout, 1, DS4_NUMERICS_DS4);
        } else if (m == 6) {
            const ds4_product pr[2] = { { &wp->g, pout, ym[0].g, pout, NULL, 0 }, { &wp->g, pout / 2, ym[1].g, pout, NULL, 0 } };
            g->ops->matmul_multi(g, pr, 2, xp.g, pin, 1, DS4_NUMERICS_DS4);
            g->ops->matmul(g, &wp->g, 0, pout, xp.g, pin, yp[m].g, pout, 1, DS4_NUMERICS_DS4);
            g->ops->hc_post(g, &hc, y.g, X.g, post[m].g, comb[m].g, Xo[m].g, n_rows);
        } else {
            if (m == 3) {
                g->ops->branch_begin(g);
                g->ops->matmul(g, &wb->g, 0, pbig, xp.g, pin, side.g, pbig, 1, DS4_NUMERICS_DS4);
                g->ops->branch_end(g);
            }
            g->ops->matmul(g, &wp->g, 0, pout, xp.g, pin, yp[m].g, pout, 1, DS4_NUMERICS_DS4);
            if (m == 3) g->ops->branch_join(g);
            g->ops->hc_post(g, &hc, y.g, X.g, post[m].g, comb[m].g, Xo[m].g, n_rows);
        }
        if (step) g->ops->step_end(g);
        if (m == 0) { /* the products' references, no task pending */
            g->ops->matmul(g, &wb->g, 0, pbig, xp.g, pin, side_ref.g, pbig, 1, DS4_NUMERICS_DS4);
            const ds4_product pr[2] = { { &wp->g, pout, ym_ref[0].g, pout, NULL, 0 }, { &wp->g, pout / 2, ym_ref[1].g, pout, NULL, 0 } };
            g->ops->matmul_multi(g, pr, 2, xp.g, pin, 1, DS4_NUMERICS_DS4);
        }
        op_expect_ok(p);
        ds4_cuda_backend_hc_defer_stats(g, &t1, &s1);
        ds4_cuda_backend_branch_stats(g, &b1, &j1);
        /* mode 3 outside a recorded step: no branch, so its long product takes it */
        const bool takes = m == 1 || m == 5 || m == 6 || (m == 3 && !recorded);
        const uint64_t want_taken = deferred && mv && takes ? 1 : 0;
        const uint64_t want_settled = deferred && m != 0 && !want_taken ? 1 : 0;
        CHECK_MSG(t1 - t0 == want_taken && s1 - s0 == want_settled,
                  "%lld rows, mode %d: %llu tasks taken by a product (want %llu), %llu settled (want %llu)",
                  (long long)n_rows, m, (unsigned long long)(t1 - t0), (unsigned long long)want_taken,
                  (unsigned long long)(s1 - s0), (unsigned long long)want_settled);
        if (m == 4) {
            const uint64_t want_joins = deferred && recorded ? 1 : 0;
            CHECK_MSG(j1 - j0 == want_joins, "%lld rows: %llu joins forced by the branch's settle (want %llu)",
                      (long long)n_rows, (unsigned long long)(j1 - j0), (unsigned long long)want_joins);
        }
    }
    /* the reference against the CPU (same inputs) */
    p->cpu->ops->hc_pre(p->cpu, &hc, X.c, &fn->c, &scale->c, &base->c, x_out[0].c, post[0].c, comb[0].c, n_rows);
    p->cpu->ops->hc_post(p->cpu, &hc, y.c, X.c, post[0].c, comb[0].c, Xo[0].c, n_rows);
    op_expect_ok(p);
    const double tol = hc_tol(hc_dim);
    char what[96];
    snprintf(what, sizeof what, "deferred split reference comb (%lld rows)", (long long)n_rows);
    op_compare(what, p, comb[0], n_rows * n * n, tol, tol);
    snprintf(what, sizeof what, "deferred split reference post (%lld rows)", (long long)n_rows);
    op_compare(what, p, post[0], n_rows * n, tol, tol);
    for (int m = 1; m < DEFER_MODES; m++) {
        snprintf(what, sizeof what, "%lld rows, mode %d: x_out", (long long)n_rows, m);
        check_gpu_same(what, p, x_out[m], x_out[0], n_rows * dim);
        snprintf(what, sizeof what, "%lld rows, mode %d: post", (long long)n_rows, m);
        check_gpu_same(what, p, post[m], post[0], n_rows * n);
        snprintf(what, sizeof what, "%lld rows, mode %d: comb", (long long)n_rows, m);
        check_gpu_same(what, p, comb[m], comb[0], n_rows * n * n);
        snprintf(what, sizeof what, "%lld rows, mode %d: hc_post's state", (long long)n_rows, m);
        check_gpu_same(what, p, Xo[m], Xo[0], n_rows * hc_dim);
        snprintf(what, sizeof what, "%lld rows, mode %d: the product", (long long)n_rows, m);
        check_gpu_same(what, p, yp[m], yp[0], pout);
    }
    snprintf(what, sizeof what, "%lld rows: the product on the branch", (long long)n_rows);
    check_gpu_same(what, p, side, side_ref, pbig);
    snprintf(what, sizeof what, "%lld rows: hc_post on the main chain", (long long)n_rows);
    check_gpu_same(what, p, Xo2, Xo[0], n_rows * hc_dim);
    for (int i = 0; i < 2; i++) {
        snprintf(what, sizeof what, "%lld rows: matmul_multi's product %d", (long long)n_rows, i);
        check_gpu_same(what, p, ym[i], ym_ref[i], i ? pout / 2 : pout);
    }
    ds4_cuda_backend_set_hc_defer(g, env_on_default("DS4_CUDA_HC_DEFER", true), 0);
    ds4_cuda_backend_set_branches(g, env_on_default("DS4_CUDA_BRANCH", true));

    for (int m = 0; m < DEFER_MODES; m++) {
        op_buf_free(p, &x_out[m]);
        op_buf_free(p, &post[m]);
        op_buf_free(p, &comb[m]);
        op_buf_free(p, &Xo[m]);
        op_buf_free(p, &yp[m]);
    }
    for (int i = 0; i < 2; i++) op_buf_free(p, &ym[i]), op_buf_free(p, &ym_ref[i]);
    op_buf_free(p, &side);
    op_buf_free(p, &side_ref);
    op_buf_free(p, &Xo2);
    op_buf_free(p, &X);
    op_buf_free(p, &y);
    op_buf_free(p, &xp);
    op_weight_free(p, fn);
    op_weight_free(p, scale);
    op_weight_free(p, base);
    op_weight_free(p, wp);
    op_weight_free(p, wb);
    free(hfn);
    free(hscale);
    free(hbase);
    free(hX);
    free(hy);
    free(hw);
    free(hxp);
}

static void test_hc_defer(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    check_hc_defer(&p, 1);
    check_hc_defer(&p, 3);
    check_hc_defer(&p, 8); /* the most rows deferred: one block of the product's eight warps */
    check_hc_defer(&p, 9); /* past that: the split in the finishing kernel */
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* hc_head                                                                   */
/* ------------------------------------------------------------------------ */

static void check_hc_head(op_pair *p, int64_t dim, int64_t n_rows, uint32_t fn_type) {
    const int n = 4;
    const ds4_hc hc = { n, dim, 20, 1e-6f, 1e-6f };
    const int64_t hc_dim = n * dim;
    float *hfn = op_rand(hc_dim * n, 1.0 / sqrt((double)hc_dim));
    float *hscale = rand_uniform(1, 0.5, 1.5);
    float *hbase = op_rand(n, 0.5);
    float *hX = hc_states(n_rows, hc_dim);
    op_weight *fn = op_weight_floats(p, "out_hc_fn", fn_type, hc_dim, n, 1, hfn);
    op_weight *scale = op_weight_floats(p, "out_hc_scale", DS4_TYPE_F32, 1, 1, 1, hscale);
    op_weight *base = op_weight_floats(p, "out_hc_base", DS4_TYPE_F32, n, 1, 1, hbase);
    op_buf X = op_buf_from(p, hX, n_rows * hc_dim);
    op_buf out = op_buf_poisoned(p, (n_rows + 1) * dim);

    p->cpu->ops->hc_head(p->cpu, &hc, X.c, &fn->c, &scale->c, &base->c, out.c, n_rows);
    p->gpu->ops->hc_head(p->gpu, &hc, X.g, &fn->g, &scale->g, &base->g, out.g, n_rows);
    op_expect_ok(p);
    char what[96];
    snprintf(what, sizeof what, "hc_head (dim %lld, %lld rows, %s)", (long long)dim, (long long)n_rows,
             ds4_type_name(fn_type));
    const double tol = hc_tol(hc_dim);
    compare_hc_rows(what, p, out, n_rows, dim, tol);
    check_guard(what, p, out, n_rows * dim, dim);

    op_buf_free(p, &X);
    op_buf_free(p, &out);
    op_weight_free(p, fn);
    op_weight_free(p, scale);
    op_weight_free(p, base);
    free(hfn);
    free(hscale);
    free(hbase);
    free(hX);
}

static void test_hc_head(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    check_hc_head(&p, 64, 1, DS4_TYPE_F32);
    check_hc_head(&p, 64, 37, DS4_TYPE_F16);
    check_hc_head(&p, 4096, 1, DS4_TYPE_F16);
    check_hc_head(&p, 4096, 37, DS4_TYPE_F32);
    check_hc_head(&p, 4096, 3, DS4_TYPE_BF16);
    check_hc_head(&p, 33, 5, DS4_TYPE_BF16); /* element-wise loads */
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* hc_post                                                                   */
/* ------------------------------------------------------------------------ */

static void check_hc_post(op_pair *p, int64_t dim, int64_t n_rows) {
    const int n = 4;
    const ds4_hc hc = { n, dim, 20, 1e-6f, 1e-6f };
    const int64_t hc_dim = n * dim;
    float *hy = op_rand(n_rows * dim, 2.0), *hX = hc_states(n_rows, hc_dim);
    float *hpost = rand_uniform(n_rows * n, 0.0, 2.0), *hcomb = rand_uniform(n_rows * n * n, 0.0, 1.0);
    op_buf y = op_buf_from(p, hy, n_rows * dim), X = op_buf_from(p, hX, n_rows * hc_dim);
    op_buf post = op_buf_from(p, hpost, n_rows * n), comb = op_buf_from(p, hcomb, n_rows * n * n);
    op_buf out = op_buf_poisoned(p, (n_rows + 1) * hc_dim);

    p->cpu->ops->hc_post(p->cpu, &hc, y.c, X.c, post.c, comb.c, out.c, n_rows);
    p->gpu->ops->hc_post(p->gpu, &hc, y.g, X.g, post.g, comb.g, out.g, n_rows);
    op_expect_ok(p);
    char what[64];
    snprintf(what, sizeof what, "hc_post (dim %lld, %lld rows)", (long long)dim, (long long)n_rows);
    op_compare(what, p, out, n_rows * hc_dim, 0.0, 0.0); /* same operations, same order: exact */
    check_guard(what, p, out, n_rows * hc_dim, hc_dim);

    op_buf_free(p, &y);
    op_buf_free(p, &X);
    op_buf_free(p, &post);
    op_buf_free(p, &comb);
    op_buf_free(p, &out);
    free(hy);
    free(hX);
    free(hpost);
    free(hcomb);
}

static void test_hc_post(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    check_hc_post(&p, 64, 1);
    check_hc_post(&p, 64, 37);
    check_hc_post(&p, 4096, 1);
    check_hc_post(&p, 4096, 37);
    check_hc_post(&p, 4096, 256);
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* Router                                                                    */
/* ------------------------------------------------------------------------ */

static double softplus_d(double x) { return x > 20.0 ? x : x < -20.0 ? exp(x) : log1p(exp(x)); }

/*
 * true when the selection is well defined in float: walking the scores
 * prob + bias (in double) from the best down to rank n_used, each step down
 * is either an exact tie (identical inputs, which both backends resolve by
 * index) or a gap of more than 1e-5 relative to the scores, far above the
 * few-ulp differences of the two backends' expf / log1pf.
 */
static bool router_well_posed(const float *logits, const float *bias, int64_t n_expert, int n_used) {
    double *s = malloc((size_t)n_expert * sizeof *s);
    char *taken = calloc((size_t)n_expert, 1);
    for (int64_t e = 0; e < n_expert; e++) s[e] = sqrt(softplus_d(logits[e])) + (bias ? bias[e] : 0.0);
    bool ok = true;
    double prev = 0.0;
    for (int k = 0; k <= n_used && k < n_expert && ok; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n_expert; e++)
            if (!taken[e] && (best < 0 || s[e] > s[best])) best = e;
        taken[best] = 1;
        if (k > 0) {
            const double gap = prev - s[best];
            if (gap != 0.0 && gap <= 1e-5 * fmax(fabs(prev), fabs(s[best]))) ok = false;
        }
        prev = s[best];
    }
    free(s);
    free(taken);
    return ok;
}

/* Round host values to what a weight of `type` holds (F32: unchanged). */
static void round_to_type(uint32_t type, float *v, int64_t n) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    void *bytes = malloc((size_t)ds4_type_row_bytes(type, n));
    t->quantize_row(v, bytes, n);
    t->dequant_row(bytes, v, n);
    free(bytes);
}

typedef struct router_case {
    const char *name;
    int64_t n_expert;
    int n_used;
    int bias_type;     /* -1: no bias; else the weight type */
    bool hash;         /* hash-selected ids */
    bool normalise;
    float scale;
    int logit_kind;    /* 0: N(0, 2); 1: ties (a few values); 2: tiny (~ -30); 3: many -inf */
} router_case;

/* Logits of one kind (host); bias values (host, may be NULL) to match. */
static void router_inputs(const router_case *rc, float *logits, float *bias) {
    static const float tie_logits[] = { -1.0f, 0.0f, 0.5f, 2.0f };
    static const float tie_bias[] = { 0.0f, 0.25f };
    for (int64_t e = 0; e < rc->n_expert; e++) {
        switch (rc->logit_kind) {
        case 1: logits[e] = tie_logits[test_rand_u64() % 4]; break;
        case 2: logits[e] = (float)(-30.0 + test_rand_normal()); break;
        case 3: logits[e] = test_rand_u64() % 4 ? -INFINITY : (float)(test_rand_normal() * 2.0); break;
        default: logits[e] = (float)(test_rand_normal() * 2.0); break;
        }
        if (bias) bias[e] = rc->logit_kind == 1 ? tie_bias[test_rand_u64() % 2] : (float)(test_rand_normal() * 0.1);
    }
}

/* `trials` draws of n_rows token rows in one call: logits [n_rows, E] (each
 * row well posed on its own), one bias, hash ids [n_rows, K]. */
static void check_router(op_pair *p, const router_case *rc, int trials, int64_t n_rows) {
    const int64_t E = rc->n_expert, R = n_rows;
    const int K = rc->n_used;
    const int64_t RK = R * K > 0 ? R * K : 1;
    float *hl = malloc((size_t)(R * E) * sizeof *hl), *hb = rc->bias_type >= 0 ? malloc((size_t)E * sizeof *hb) : NULL;
    float *spare = malloc((size_t)E * sizeof *spare); /* router_inputs' other output, unused */
    int32_t *hash = malloc((size_t)RK * sizeof *hash);
    int32_t *sel_c = malloc((size_t)RK * sizeof *sel_c), *sel_g = malloc((size_t)RK * sizeof *sel_g);
    float *w_c = malloc((size_t)RK * sizeof *w_c), *w_g = malloc((size_t)RK * sizeof *w_g);
    for (int t = 0; t < trials; t++) {
        /* the bias first (shared by the rows), then each row's logits; a
         * bias with a near tie that no row's logits can break (tiny probs:
         * the bias dominates) is drawn again with all the rows */
        bool posed = false;
        for (int tries = 0; !posed && tries < 100; tries++) {
            if (hb) {
                router_inputs(rc, spare, hb);
                round_to_type((uint32_t)rc->bias_type, hb, E); /* the values the bias weight will hold */
            }
            posed = true;
            for (int64_t r = 0; r < R && posed; r++) {
                int attempts = 0;
                do {
                    router_inputs(rc, hl + r * E, hb ? spare : NULL);
                } while (!rc->hash && !router_well_posed(hl + r * E, hb, E, K) && ++attempts < 20);
                posed = attempts < 20;
            }
        }
        CHECK_MSG(posed, "%s: could not draw well-posed router inputs", rc->name);
        op_weight *bias = hb ? op_weight_floats(p, "exp_probs_b", (uint32_t)rc->bias_type, E, 1, 1, hb) : NULL;
        for (int64_t k = 0; k < R * K; k++) hash[k] = (int32_t)(test_rand_u64() % (uint64_t)E);
        op_buf logits = op_buf_from(p, hl, R * E > 0 ? R * E : 1);
        for (int64_t k = 0; k < R * K; k++) sel_c[k] = sel_g[k] = -7, w_c[k] = w_g[k] = NAN;
        /* the results stay in backend memory (poisoned first) */
        op_buf sel = op_ints_from(p, sel_c, R * K), wts = op_buf_poisoned(p, RK);

        p->cpu->ops->router(p->cpu, logits.c, E, bias ? &bias->c : NULL, rc->hash ? hash : NULL, K, rc->normalise,
                            rc->scale, (int32_t *)sel.c, wts.c, R);
        p->gpu->ops->router(p->gpu, logits.g, E, bias ? &bias->g : NULL, rc->hash ? hash : NULL, K, rc->normalise,
                            rc->scale, (int32_t *)sel.g, wts.g, R);
        op_expect_ok(p);
        if (!rc->hash) { /* again: the choices stay on the GPU, nothing waits (hash ids are a host upload) */
            const ds4_backend_counters c0 = op_gpu_counters(p);
            p->gpu->ops->router(p->gpu, logits.g, E, bias ? &bias->g : NULL, NULL, K, rc->normalise, rc->scale,
                                (int32_t *)sel.g, wts.g, R);
            op_expect_no_host_traffic(p, rc->name, &c0);
            op_expect_ok(p);
        }
        op_ints_get(p, sel, R * K, sel_c, sel_g);
        if (R * K > 0) {
            p->cpu->ops->download(p->cpu, w_c, wts.c, R * K);
            p->gpu->ops->download(p->gpu, w_g, wts.g, R * K);
            /* the other selection kernel (on chip or through global
             * scratch): the same choices and weights bit for bit */
            const bool reg = env_on_default("DS4_CUDA_ROUTER_REG", false);
            op_buf sel2 = op_ints_from(p, sel_c, R * K), wts2 = op_buf_poisoned(p, RK);
            ds4_cuda_backend_set_router_reg(p->gpu, !reg);
            p->gpu->ops->router(p->gpu, logits.g, E, bias ? &bias->g : NULL, rc->hash ? hash : NULL, K,
                                rc->normalise, rc->scale, (int32_t *)sel2.g, wts2.g, R);
            ds4_cuda_backend_set_router_reg(p->gpu, reg);
            op_expect_ok(p);
            int32_t *s2 = malloc((size_t)RK * sizeof *s2);
            float *w2 = malloc((size_t)RK * sizeof *w2);
            p->gpu->ops->download(p->gpu, (float *)s2, sel2.g, R * K);
            p->gpu->ops->download(p->gpu, w2, wts2.g, R * K);
            CHECK_MSG(memcmp(s2, sel_g, (size_t)(R * K) * sizeof *s2) == 0 &&
                          memcmp(w2, w_g, (size_t)(R * K) * sizeof *w2) == 0,
                      "%s, %lld rows (trial %d): the two router kernels differ", rc->name, (long long)R, t);
            free(s2);
            free(w2);
            op_buf_free(p, &sel2);
            op_buf_free(p, &wts2);
        }
        op_buf_free(p, &sel);
        op_buf_free(p, &wts);
        int64_t bad_sel = 0, bad_w = 0, worst = -1, first_bad = -1;
        for (int64_t k = 0; k < R * K; k++) {
            if (sel_c[k] != sel_g[k] && first_bad < 0) first_bad = k;
            bad_sel += sel_c[k] != sel_g[k];
            const bool ok = fabs((double)w_g[k] - (double)w_c[k]) <= 2e-6 * fabs((double)w_c[k]); /* NaN fails */
            if (!ok) bad_w++, worst = k;
        }
        CHECK_MSG(bad_sel == 0, "%s, %lld rows (trial %d): %lld of %lld selected experts differ (first [%lld] cpu %d "
                  "cuda %d)", rc->name, (long long)R, t, (long long)bad_sel, (long long)(R * K), (long long)first_bad,
                  first_bad >= 0 ? sel_c[first_bad] : -1, first_bad >= 0 ? sel_g[first_bad] : -1);
        if (bad_sel)
            for (int64_t k = 0; k < R * K && k < 16; k++)
                fprintf(stderr, "    [%lld] cpu %d cuda %d\n", (long long)k, sel_c[k], sel_g[k]);
        CHECK_MSG(bad_w == 0, "%s, %lld rows (trial %d): %lld weights out of tolerance, worst [%lld] cpu %.9g cuda "
                  "%.9g", rc->name, (long long)R, t, (long long)bad_w, (long long)worst, worst >= 0 ? w_c[worst] : 0.0,
                  worst >= 0 ? w_g[worst] : 0.0);
        op_buf_free(p, &logits);
        op_weight_free(p, bias);
    }
    free(hl);
    free(hb);
    free(spare);
    free(hash);
    free(sel_c);
    free(sel_g);
    free(w_c);
    free(w_g);
}

/* Each case as one token (the decode shape) and as 5 tokens in one call
 * (prefill: every row routed on its own). */
static void check_router_rows(op_pair *p, const router_case *rc, int trials) {
    check_router(p, rc, trials, 1);
    check_router(p, rc, trials / 2 > 0 ? trials / 2 : 1, 5);
}

static void test_router_topk(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    static const router_case cases[] = {
        /* name                     E     K  bias           hash   norm   scale logits */
        { "router 256/6 bias",       256, 6, DS4_TYPE_F32, false, true,  1.5f, 0 },
        { "router 256/6 no bias",    256, 6, -1,           false, true,  1.0f, 0 },
        { "router 256/6 raw x2.5",   256, 6, DS4_TYPE_F32, false, false, 2.5f, 0 },
        { "router 256/6 f16 bias",   256, 6, DS4_TYPE_F16, false, true,  1.5f, 0 },
        { "router 5000/40",         5000, 40, DS4_TYPE_F32, false, true, 1.5f, 0 },
        { "router 8/8 (all)",          8, 8, -1,           false, true,  1.0f, 0 },
        { "router 1/1",                1, 1, DS4_TYPE_F32, false, true,  1.5f, 0 },
        { "router 300/0",            300, 0, -1,           false, true,  1.5f, 0 },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_router_rows(&p, &cases[i], 8);
    op_pair_close(&p);
}

static void test_router_hash(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    static const router_case cases[] = {
        { "router hash",              256, 6, -1,           true, true,  1.5f, 0 },
        { "router hash raw",          256, 6, -1,           true, false, 1.5f, 0 },
        { "router hash, bias unused", 256, 6, DS4_TYPE_F32, true, true,  0.7f, 0 },
        { "router hash tiny probs",   256, 6, -1,           true, true,  1.5f, 2 },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_router_rows(&p, &cases[i], 8);
    op_pair_close(&p);
}

/* Exact ties (lowest index wins), -inf logits (probability 0, ranked by
 * index), and probabilities whose sum is below the 6.1e-5 floor. */
static void test_router_ties(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    static const router_case cases[] = {
        { "router ties",             256, 6, -1,           false, true,  1.5f, 1 },
        { "router ties + bias",      256, 6, DS4_TYPE_F32, false, true,  1.5f, 1 },
        { "router ties, 64 of 256",  256, 64, DS4_TYPE_F32, false, false, 1.0f, 1 },
        { "router -inf logits",       40, 20, -1,          false, true,  1.5f, 3 },
        { "router tiny probs",       256, 6, -1,           false, true,  1.5f, 2 },
        { "router tiny probs raw",   256, 6, DS4_TYPE_F32, false, false, 3.0f, 2 },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_router_rows(&p, &cases[i], 6);
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* SwiGLU                                                                    */
/* ------------------------------------------------------------------------ */

static void check_swiglu(op_pair *p, int64_t n, double sigma, float limit, float scale, bool in_place) {
    float *hg = op_rand(n, sigma), *hu = op_rand(n, sigma);
    op_buf g = op_buf_from(p, hg, n), u = op_buf_from(p, hu, n);
    op_buf out = in_place ? g : op_buf_poisoned(p, n + 64);
    p->cpu->ops->swiglu(p->cpu, g.c, u.c, limit, scale, out.c, n);
    p->gpu->ops->swiglu(p->gpu, g.g, u.g, limit, scale, out.g, n);
    op_expect_ok(p);
    char what[96];
    snprintf(what, sizeof what, "swiglu (n %lld, sigma %g, limit %g, scale %g%s)", (long long)n, sigma, limit,
             scale, in_place ? ", in place" : "");
    op_compare(what, p, out, n, 1e-30, 2e-6);
    if (!in_place) {
        check_guard(what, p, out, n, 64);
        op_buf_free(p, &out);
    }
    op_buf_free(p, &g);
    op_buf_free(p, &u);
    free(hg);
    free(hu);
}

static void test_swiglu(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    check_swiglu(&p, 100003, 3.0, 0.0f, 1.0f, false);   /* no clamp */
    check_swiglu(&p, 100003, 3.0, 10.0f, 1.0f, false);  /* the model's limit */
    check_swiglu(&p, 100003, 8.0, 7.0f, 0.37f, false);  /* clamps active, scaled */
    check_swiglu(&p, 100003, 1e4, 0.0f, 1.0f, false);   /* large values, no clamp */
    check_swiglu(&p, 100003, 1e4, 10.0f, 1.5f, false);  /* large values, clamped */
    check_swiglu(&p, 2048 * 37, 3.0, 10.0f, 1.0f, true); /* out == g, as the model calls it */
    check_swiglu(&p, 1, 3.0, 10.0f, 1.0f, false);
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* Error paths: an error is recorded, nothing crashes, the backend goes on   */
/* ------------------------------------------------------------------------ */

static void test_errors(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const int n = 4;
    const int64_t dim = 64, hc_dim = n * dim, n_mix = (2 + n) * n;
    float *hfn = op_rand(hc_dim * n_mix, 0.05), *hvec = op_rand(n_mix, 0.5), *hX = op_rand(2 * hc_dim, 1.0);
    op_weight *fn = op_weight_floats(&p, "fn", DS4_TYPE_F16, hc_dim, n_mix, 1, hfn);
    op_weight *fn_narrow = op_weight_floats(&p, "fn_narrow", DS4_TYPE_F16, hc_dim / 2, n_mix, 1, hfn);
    op_weight *fn_q8 = op_weight_floats(&p, "fn_q8", DS4_TYPE_Q8_0, hc_dim, n_mix, 1, hfn);
    op_weight *scale = op_weight_floats(&p, "scale", DS4_TYPE_F32, 3, 1, 1, hvec);
    op_weight *base = op_weight_floats(&p, "base", DS4_TYPE_F32, n_mix, 1, 1, hvec);
    op_weight *base_short = op_weight_floats(&p, "base_short", DS4_TYPE_F32, n_mix - 1, 1, 1, hvec);
    op_buf X = op_buf_from(&p, hX, 2 * hc_dim), out = op_buf_poisoned(&p, 2 * hc_dim);
    op_buf post = op_buf_poisoned(&p, 2 * n), comb = op_buf_poisoned(&p, 2 * n * n);
    ds4_backend *g = p.gpu;
    const ds4_hc good = { n, dim, 20, 1e-6f, 1e-6f };
    ds4_hc bad = good;

    /* hc_pre */
    bad.n_hc = 0;
    g->ops->hc_pre(g, &bad, X.g, &fn->g, &scale->g, &base->g, out.g, post.g, comb.g, 2);
    op_expect_error(&p, DS4_ERR_INVALID);
    bad = good, bad.n_hc = 17;
    g->ops->hc_pre(g, &bad, X.g, &fn->g, &scale->g, &base->g, out.g, post.g, comb.g, 2);
    op_expect_error(&p, DS4_ERR_INVALID);
    g->ops->hc_pre(g, &good, X.g, &fn_narrow->g, &scale->g, &base->g, out.g, post.g, comb.g, 2);
    op_expect_error(&p, DS4_ERR_INVALID);
    g->ops->hc_pre(g, &good, X.g, &fn->g, &scale->g, &base_short->g, out.g, post.g, comb.g, 2);
    op_expect_error(&p, DS4_ERR_INVALID);
    g->ops->hc_pre(g, &good, X.g, &fn->g, NULL, &base->g, out.g, post.g, comb.g, 2);
    op_expect_error(&p, DS4_ERR_INVALID);
    bad = good, bad.iters = 0;
    g->ops->hc_pre(g, &bad, X.g, &fn->g, &scale->g, &base->g, out.g, post.g, comb.g, 2);
    op_expect_error(&p, DS4_ERR_INVALID);
    g->ops->hc_pre(g, &good, X.g, &fn_q8->g, &scale->g, &base->g, out.g, post.g, comb.g, 2);
    op_expect_error(&p, DS4_ERR_UNSUPPORTED); /* the CPU computes with Q8_0; this backend does not */

    /* hc_head: fn needs n_hc rows, base n_hc values, scale 1 */
    op_weight *fn_head_short = op_weight_floats(&p, "fn_head_short", DS4_TYPE_F16, hc_dim, n - 1, 1, hfn);
    g->ops->hc_head(g, &good, X.g, &fn_head_short->g, &scale->g, &base->g, out.g, 2);
    op_expect_error(&p, DS4_ERR_INVALID);
    bad = good, bad.dim = 0;
    g->ops->hc_head(g, &bad, X.g, &fn->g, &scale->g, &base->g, out.g, 2);
    op_expect_error(&p, DS4_ERR_INVALID);

    /* hc_post: bad stream count, output aliasing the input */
    bad = good, bad.n_hc = 17;
    g->ops->hc_post(g, &bad, X.g, X.g, post.g, comb.g, out.g, 1);
    op_expect_error(&p, DS4_ERR_INVALID);
    g->ops->hc_post(g, &good, out.g, X.g, post.g, comb.g, X.g, 1);
    op_expect_error(&p, DS4_ERR_INVALID);
    g->ops->hc_post(g, &good, out.g, X.g, post.g, comb.g, out.g, -1);
    op_expect_error(&p, DS4_ERR_INVALID);

    /* router */
    op_buf logits = op_buf_from(&p, hX, 256);
    op_weight *bias_short = op_weight_floats(&p, "bias_short", DS4_TYPE_F32, 100, 1, 1, hX);
    op_weight *bias_q8 = op_weight_floats(&p, "bias_q8", DS4_TYPE_Q8_0, 256, 1, 1, hX);
    int32_t hsel[8], hash[6] = { 0, 5, 255, 3, 2, 1 };
    op_buf rsel = op_ints_from(&p, hash, 6), rw = op_buf_poisoned(&p, 8);
    int32_t *sel = (int32_t *)rsel.g; /* device results */
    float *w = rw.g;
    g->ops->router(g, logits.g, 256, NULL, NULL, 257, true, 1.5f, sel, w, 1);
    op_expect_error(&p, DS4_ERR_INVALID);
    g->ops->router(g, logits.g, 0, NULL, NULL, 0, true, 1.5f, sel, w, 1);
    op_expect_error(&p, DS4_ERR_INVALID);
    g->ops->router(g, logits.g, 256, NULL, NULL, -1, true, 1.5f, sel, w, 1);
    op_expect_error(&p, DS4_ERR_INVALID);
    g->ops->router(g, logits.g, 256, &bias_short->g, NULL, 6, true, 1.5f, sel, w, 1);
    op_expect_error(&p, DS4_ERR_INVALID);
    g->ops->router(g, logits.g, 256, &bias_q8->g, NULL, 6, true, 1.5f, sel, w, 1);
    op_expect_error(&p, DS4_ERR_UNSUPPORTED);
    hash[2] = 256;
    g->ops->router(g, logits.g, 256, NULL, hash, 6, true, 1.5f, sel, w, 1);
    op_expect_error(&p, DS4_ERR_INVALID);
    hash[2] = -1;
    g->ops->router(g, logits.g, 256, NULL, hash, 6, true, 1.5f, sel, w, 1);
    op_expect_error(&p, DS4_ERR_INVALID);
    /* rows: a negative count; a bad hash id in the last of 3 rows */
    g->ops->router(g, logits.g, 256, NULL, NULL, 6, true, 1.5f, sel, w, -1);
    op_expect_error(&p, DS4_ERR_INVALID);
    {
        float *hl3 = op_rand(3 * 256, 2.0);
        int32_t hash3[18];
        for (int k = 0; k < 18; k++) hash3[k] = k;
        hash3[15] = 256;
        op_buf logits3 = op_buf_from(&p, hl3, 3 * 256), sel3 = op_buf_poisoned(&p, 18), w3 = op_buf_poisoned(&p, 18);
        g->ops->router(g, logits3.g, 256, NULL, hash3, 6, true, 1.5f, (int32_t *)sel3.g, w3.g, 3);
        op_expect_error_with(&p, "router: bad hash id in row 2", "router", "expert 256 ", "[0, 256)", NULL);
        op_buf_free(&p, &logits3);
        op_buf_free(&p, &sel3);
        op_buf_free(&p, &w3);
        free(hl3);
    }

    /* swiglu */
    g->ops->swiglu(g, X.g, X.g, 10.0f, 1.0f, out.g, -1);
    op_expect_error(&p, DS4_ERR_INVALID);

    /* the backend still computes after all that */
    check_hc_pre(&p, 64, 2, DS4_TYPE_F16);
    hash[2] = 9;
    for (int k = 0; k < 6; k++) hsel[k] = -7;
    g->ops->upload(g, rsel.g, (const float *)hsel, 6);
    g->ops->router(g, logits.g, 256, NULL, hash, 6, true, 1.5f, sel, w, 1);
    op_expect_ok(&p);
    g->ops->download(g, (float *)hsel, rsel.g, 6);
    for (int k = 0; k < 6; k++) CHECK_EQ_INT(hsel[k], hash[k]);
    check_swiglu(&p, 1000, 3.0, 10.0f, 1.0f, false);

    op_buf_free(&p, &logits);
    op_buf_free(&p, &rsel);
    op_buf_free(&p, &rw);
    op_buf_free(&p, &X);
    op_buf_free(&p, &out);
    op_buf_free(&p, &post);
    op_buf_free(&p, &comb);
    op_weight_free(&p, fn);
    op_weight_free(&p, fn_narrow);
    op_weight_free(&p, fn_q8);
    op_weight_free(&p, fn_head_short);
    op_weight_free(&p, scale);
    op_weight_free(&p, base);
    op_weight_free(&p, base_short);
    op_weight_free(&p, bias_short);
    op_weight_free(&p, bias_q8);
    free(hfn);
    free(hvec);
    free(hX);
    op_pair_close(&p);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_hc_pre_small),
    TEST_ENTRY(test_hc_pre_real),
    TEST_ENTRY(test_hc_pre_batch),
    TEST_ENTRY(test_hc_defer),
    TEST_ENTRY(test_hc_head),
    TEST_ENTRY(test_hc_post),
    TEST_ENTRY(test_router_topk),
    TEST_ENTRY(test_router_hash),
    TEST_ENTRY(test_router_ties),
    TEST_ENTRY(test_swiglu),
    TEST_ENTRY(test_errors),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

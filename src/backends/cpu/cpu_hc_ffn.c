/*
 * cpu_hc_ffn.c - hyper-connections (spec 3.2, 3.3, 3.8) and the small
 * feed-forward ops: router and SwiGLU (spec 3.7).
 *
 * The HC state of one token is n_hc streams of dim floats, stream-major.
 * HC projections (fn) are F16 weights in the model and use DS4's F16 matmul
 * numerics: float activations, float accumulation (identical for both
 * numerics modes up to summation order, which is why these ops take none).
 */
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/cpu_internal.h"

/* ------------------------------------------------------------------------ */
/* Shared pieces                                                             */
/* ------------------------------------------------------------------------ */

/* Rows are processed in chunks so the normalised states of one chunk (n_hc *
 * dim floats each) stay small. */
#define HC_ROW_CHUNK 16

/* Plain RMSNorm of one flattened state (squares summed in double). */
static void hc_plain_norm(const float *X, int64_t n, float eps, float *f) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)X[i] * (double)X[i];
    const float scale = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) f[i] = X[i] * scale;
}

/* sum_s w[s] * X[s][i], s in order. */
static void hc_weighted_sum(const float *X, const float *w, int n_hc, int64_t dim, float *out) {
    for (int64_t i = 0; i < dim; i++) {
        float acc = 0.0f;
        for (int s = 0; s < n_hc; s++) acc += X[s * dim + i] * w[s];
        out[i] = acc;
    }
}

/* Check an HC op's weights: fn [n_hc*dim, n_mix], scale [>= n_scale], base [>= n_mix]. */
static bool hc_check(ds4_backend *be, const char *op, const ds4_hc *hc, const ds4_weight *fn,
                     const ds4_weight *scale, const ds4_weight *base, int64_t n_mix, int64_t n_scale) {
    cpu_dot_kind kind;
    if (hc->n_hc < 1 || hc->n_hc > 16 || hc->dim <= 0 || !fn || !scale || !base || fn->ne[0] != hc->n_hc * hc->dim ||
        cpu_weight_rows(fn) < n_mix || scale->ne[0] < n_scale || base->ne[0] < n_mix ||
        !cpu_dot_kind_for(fn, DS4_NUMERICS_DS4, &kind) || !cpu_has_dequant(scale) || !cpu_has_dequant(base)) {
        cpu_fail(be, DS4_ERR_INVALID, "%s: n_hc %d, dim %lld: weights %s / %s / %s do not fit", op, hc->n_hc,
                 (long long)hc->dim, cpu_wname(fn), cpu_wname(scale), cpu_wname(base));
        return false;
    }
    return true;
}

/* mix[r][k] = fn[k] . plain_rmsnorm(X[r]) for the rows of one chunk. */
static void hc_mix_chunk(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn, int64_t n_mix,
                         int64_t n_rows, float *f, float *mix) {
    const int64_t hc_dim = hc->n_hc * hc->dim;
    for (int64_t r = 0; r < n_rows; r++) hc_plain_norm(X + r * hc_dim, hc_dim, hc->norm_eps, f + r * hc_dim);
    cpu_matmul(be, fn, 0, n_mix, f, hc_dim, mix, n_mix, n_rows, DS4_NUMERICS_DS4);
}

/* ------------------------------------------------------------------------ */
/* HC pre: split and Sinkhorn (spec 3.2)                                     */
/* ------------------------------------------------------------------------ */

/*
 * From one token's mix (n = n_hc; (2 + n) * n values):
 *   pre[s]  = sigmoid(mix[s] * scale0 + base[s]) + eps
 *   post[s] = 2 * sigmoid(mix[n + s] * scale1 + base[n + s])
 *   C[r][c] = softmax_c(mix[2n + r*n + c] * scale2 + base[...]) + eps,
 *   r the source stream, c the destination; then a column normalisation and
 *   iters - 1 rounds of {row, column} normalisations, each multiplying by
 *   1 / (sum + eps) (ds4.c multiplies by the reciprocal).
 */
static void hc_split(const ds4_hc *hc, const float *mix, const float *sc, const float *base, float *pre, float *post,
                     float *comb) {
    const int n = hc->n_hc;
    const float eps = hc->eps;
    for (int s = 0; s < n; s++) {
        pre[s] = cpu_sigmoid(mix[s] * sc[0] + base[s]) + eps;
        post[s] = 2.0f * cpu_sigmoid(mix[n + s] * sc[1] + base[n + s]);
    }
    float *C = comb; /* C[r * n + c] */
    for (int r = 0; r < n; r++) {
        float m = -INFINITY;
        for (int c = 0; c < n; c++) {
            const int k = 2 * n + r * n + c;
            C[r * n + c] = mix[k] * sc[2] + base[k];
            if (C[r * n + c] > m) m = C[r * n + c];
        }
        float sum = 0.0f;
        for (int c = 0; c < n; c++) {
            C[r * n + c] = expf(C[r * n + c] - m);
            sum += C[r * n + c];
        }
        const float inv = 1.0f / sum;
        for (int c = 0; c < n; c++) C[r * n + c] = C[r * n + c] * inv + eps;
    }
    for (int iter = 0; iter < hc->iters; iter++) {
        if (iter > 0) {
            for (int r = 0; r < n; r++) {
                float sum = 0.0f;
                for (int c = 0; c < n; c++) sum += C[r * n + c];
                const float inv = 1.0f / (sum + eps);
                for (int c = 0; c < n; c++) C[r * n + c] *= inv;
            }
        }
        for (int c = 0; c < n; c++) {
            float sum = 0.0f;
            for (int r = 0; r < n; r++) sum += C[r * n + c];
            const float inv = 1.0f / (sum + eps);
            for (int r = 0; r < n; r++) C[r * n + c] *= inv;
        }
    }
}

void cpu_hc_pre(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn, const ds4_weight *scale,
                const ds4_weight *base, float *x_out, float *post, float *comb, int64_t n_rows) {
    const int n = hc->n_hc;
    const int64_t n_mix = (int64_t)(2 + n) * n, hc_dim = n * hc->dim;
    if (!hc_check(be, "hc_pre", hc, fn, scale, base, n_mix, 3)) return;
    if (hc->iters < 1) {
        cpu_fail(be, DS4_ERR_INVALID, "hc_pre: %d Sinkhorn iterations", hc->iters);
        return;
    }
    float *f = malloc((size_t)HC_ROW_CHUNK * (size_t)hc_dim * sizeof *f);
    float *mix = malloc((size_t)HC_ROW_CHUNK * (size_t)n_mix * sizeof *mix);
    float *vec = malloc((size_t)(3 + n_mix) * sizeof *vec);
    if (!f || !mix || !vec) {
        cpu_fail(be, DS4_ERR_NOMEM, "hc_pre: out of memory");
    } else {
        const float *sc = cpu_weight_vector(scale, 3, vec);
        const float *bs = cpu_weight_vector(base, n_mix, vec + 3);
        float pre[16];
        for (int64_t r0 = 0; r0 < n_rows; r0 += HC_ROW_CHUNK) {
            const int64_t rows = n_rows - r0 < HC_ROW_CHUNK ? n_rows - r0 : HC_ROW_CHUNK;
            hc_mix_chunk(be, hc, X + r0 * hc_dim, fn, n_mix, rows, f, mix);
            for (int64_t i = 0; i < rows; i++) {
                const int64_t r = r0 + i;
                hc_split(hc, mix + i * n_mix, sc, bs, pre, post + r * n, comb + r * n * n);
                hc_weighted_sum(X + r * hc_dim, pre, n, hc->dim, x_out + r * hc->dim);
            }
        }
    }
    free(vec);
    free(mix);
    free(f);
}

/* ------------------------------------------------------------------------ */
/* HC post and the output head (spec 3.3, 3.8)                               */
/* ------------------------------------------------------------------------ */

/* X_out[d] = post[d] * y + sum_s comb[s * n + d] * X[s], s in order. */
void cpu_hc_post(ds4_backend *be, const ds4_hc *hc, const float *y, const float *X, const float *post,
                 const float *comb, float *X_out, int64_t n_rows) {
    const int n = hc->n_hc;
    const int64_t dim = hc->dim;
    for (int64_t r = 0; r < n_rows; r++) {
        const float *yr = y + r * dim, *Xr = X + r * n * dim, *pr = post + r * n, *cr = comb + r * n * n;
        float *Or = X_out + r * n * dim;
        for (int d = 0; d < n; d++) {
            for (int64_t i = 0; i < dim; i++) {
                float acc = yr[i] * pr[d];
                for (int s = 0; s < n; s++) acc += cr[s * n + d] * Xr[s * dim + i];
                Or[d * dim + i] = acc;
            }
        }
    }
}

/* w_s = sigmoid(fn_s . plain_rmsnorm(X) * scale0 + base_s) + eps; out = sum_s w_s X[s]. */
void cpu_hc_head(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn, const ds4_weight *scale,
                 const ds4_weight *base, float *out, int64_t n_rows) {
    const int n = hc->n_hc;
    const int64_t hc_dim = n * hc->dim;
    if (!hc_check(be, "hc_head", hc, fn, scale, base, n, 1)) return;
    float *f = malloc((size_t)HC_ROW_CHUNK * (size_t)hc_dim * sizeof *f);
    float *mix = malloc((size_t)HC_ROW_CHUNK * (size_t)n * sizeof *mix);
    float *vec = malloc((size_t)(1 + n) * sizeof *vec);
    if (!f || !mix || !vec) {
        cpu_fail(be, DS4_ERR_NOMEM, "hc_head: out of memory");
    } else {
        const float *sc = cpu_weight_vector(scale, 1, vec);
        const float *bs = cpu_weight_vector(base, n, vec + 1);
        float w[16];
        for (int64_t r0 = 0; r0 < n_rows; r0 += HC_ROW_CHUNK) {
            const int64_t rows = n_rows - r0 < HC_ROW_CHUNK ? n_rows - r0 : HC_ROW_CHUNK;
            hc_mix_chunk(be, hc, X + r0 * hc_dim, fn, n, rows, f, mix);
            for (int64_t i = 0; i < rows; i++) {
                for (int s = 0; s < n; s++) w[s] = cpu_sigmoid(mix[i * n + s] * sc[0] + bs[s]) + hc->eps;
                hc_weighted_sum(X + (r0 + i) * hc_dim, w, n, hc->dim, out + (r0 + i) * hc->dim);
            }
        }
    }
    free(vec);
    free(mix);
    free(f);
}

/* ------------------------------------------------------------------------ */
/* Router and SwiGLU (spec 3.7)                                              */
/* ------------------------------------------------------------------------ */

static float softplus(float x) {
    if (x > 20.0f) return x;
    if (x < -20.0f) return expf(x);
    return log1pf(expf(x));
}

/* One token's routing: logits [n_expert] -> sel_out, weight_out [n_used].
 * prob is scratch of 3 * n_expert floats; b the bias as floats (NULL: none).
 * false (error recorded) on a hash id out of range. */
static bool router_row(ds4_backend *be, const float *logits, int64_t n_expert, const float *b, const int32_t *hash_ids,
                       int n_used, bool normalise, float scale, int32_t *sel_out, float *weight_out, float *prob) {
    for (int64_t e = 0; e < n_expert; e++) prob[e] = sqrtf(softplus(logits[e]));
    if (hash_ids) {
        for (int k = 0; k < n_used; k++) {
            if (hash_ids[k] < 0 || hash_ids[k] >= n_expert) {
                cpu_fail(be, DS4_ERR_INVALID, "router: hash-selected expert %d is outside [0, %lld)", hash_ids[k],
                         (long long)n_expert);
                return false;
            }
            sel_out[k] = hash_ids[k];
        }
    } else {
        float *selection = prob + n_expert;
        for (int64_t e = 0; e < n_expert; e++) selection[e] = b ? prob[e] + b[e] : prob[e];
        cpu_select_top_k(selection, n_expert, n_used, sel_out);
    }
    /* The weights use the unbiased probabilities. */
    float sum = 0.0f;
    for (int k = 0; k < n_used; k++) sum += prob[sel_out[k]];
    if (sum < 6.103515625e-5f) sum = 6.103515625e-5f;
    for (int k = 0; k < n_used; k++)
        weight_out[k] = normalise ? prob[sel_out[k]] / sum * scale : prob[sel_out[k]] * scale;
    return true;
}

void cpu_router(ds4_backend *be, const float *logits, int64_t n_expert, const ds4_weight *bias,
                const int32_t *hash_ids, int n_used, bool normalise, float scale, int32_t *sel_out,
                float *weight_out, int64_t n_rows) {
    if (n_expert <= 0 || n_expert > INT32_MAX || n_used < 0 || n_used > n_expert || n_rows < 0 ||
        (bias && (bias->ne[0] < n_expert || !cpu_has_dequant(bias)))) {
        cpu_fail(be, DS4_ERR_INVALID, "router: %d of %lld experts for %lld rows (bias %s)", n_used,
                 (long long)n_expert, (long long)n_rows, cpu_wname(bias));
        return;
    }
    if (n_rows == 0) return;
    float *prob = malloc((size_t)n_expert * 3 * sizeof *prob); /* prob, selection score, bias */
    if (!prob) {
        cpu_fail(be, DS4_ERR_NOMEM, "router: out of memory");
        return;
    }
    /* the bias as floats once for all rows (it only ranks: hash rows ignore it) */
    const float *b = bias && !hash_ids ? cpu_weight_vector(bias, n_expert, prob + 2 * n_expert) : NULL;
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t k0 = r * n_used;
        if (!router_row(be, logits + r * n_expert, n_expert, b, hash_ids ? hash_ids + k0 : NULL, n_used, normalise,
                        scale, sel_out + k0, weight_out + k0, prob))
            break;
    }
    free(prob);
}

void cpu_swiglu(ds4_backend *be, const float *g, const float *u, float limit, float scale, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = cpu_swiglu1(g[i], u[i], limit, scale);
}

/*
 * test_cuda_matmul.c - the matmul, matmul_grouped, matmul_multi and moe ops, CPU backend
 * (the oracle) vs CUDA backend, through the op table; every output element
 * is compared.
 *
 * Tolerances are per output element, from quantities computed on the host
 * (weights dequantised with the CPU's dequant_row, u = 2^-24 the float unit
 * roundoff):
 *   S = sum_i |w_i x_i|   (the scale of a dot's rounding errors)
 *   T = sum_b |term_b|    (DS4 quantised kinds: the block terms, computed with
 *                          the CPU's own per-block functions)
 *   REFERENCE   both sides sum exact products in float64 (error <= n 2^-53 S,
 *               negligible) and round to float once, so they differ by at
 *               most one float rounding: tol = 2.5e-7 |c| + 1e-9 S.
 *   DS4 F32/F16/BF16   float sums in different orders: the CPU's 8 lanes of
 *               n/8 terms (+3 levels) and the GPU's 32 lanes of n/32 (+5):
 *               tol = (n/8 + n/32 + 16) u S (the worst-case bound); F16
 *               products of 16 or more tokens (the tensor-core GEMM: x split
 *               into two binary16 parts to 2^-22, stages of 64 products summed
 *               by the MMAs) 32 u S more, and normwise within 1e-5 of the
 *               exact products (normwise_vs_exact).
 *   DS4 Q8_0 / Q8_K kinds   the quantised activations are bit-identical and
 *               each block term uses the CPU's float operations, so only the
 *               float sum over the nb blocks may differ in order:
 *               tol = (2 nb + 8) u T. Rows of one or two blocks must be equal
 *               (a sum of <= 2 terms does not depend on order), which checks
 *               the GPU's activation quantisation bit for bit.
 *   matmul_grouped   each group is its own matmul (its x slice quantised on
 *               its own), so each output takes the tolerance above of its
 *               group's product; groups of one block must be equal.
 *   MoE         SwiGLU uses expf, whose CUDA version may differ from glibc's
 *               by an ulp or two, so mids agree only to a few ulps; under DS4
 *               a mid may then (rarely) land on the other side of a Q8 rounding
 *               boundary, moving one code by one step (one flip moves an
 *               output by about |w| amax/127, ~1e-5 of S_o here). With S_o =
 *               sum_k sum_j |down_k[o][j] * mid_k[j]| (host mids in double):
 *               REFERENCE tol = 1e-5 S_o, DS4 tol = 1e-4 S_o (+ 2.5e-7 |c|);
 *               one wrong term (~S_o / (n_used n_ff) = 3e-4 S_o) still fails.
 *               Several token rows per call: each row its own S_o.
 *
 * Without a usable CUDA device every test reports itself as skipped.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_op_test.h"

#define U24 0x1p-24

#define OPEN_PAIR(p)                                              \
    op_pair p;                                                    \
    if (!op_pair_open(&p)) TEST_SKIP("%s", op_pair_skip_reason)

static const uint32_t ALL_TYPES[] = { DS4_TYPE_F32,  DS4_TYPE_F16,  DS4_TYPE_BF16, DS4_TYPE_Q8_0,    DS4_TYPE_Q2_K,
                                      DS4_TYPE_Q4_K, DS4_TYPE_Q5_K, DS4_TYPE_Q6_K, DS4_TYPE_IQ2_XXS, DS4_TYPE_Q8_K };
#define N_TYPES (sizeof ALL_TYPES / sizeof ALL_TYPES[0])

static const char *num_name(ds4_numerics num) { return num == DS4_NUMERICS_DS4 ? "ds4" : "reference"; }

static bool is_float_type(uint32_t t) { return t == DS4_TYPE_F32 || t == DS4_TYPE_F16 || t == DS4_TYPE_BF16; }

/* ------------------------------------------------------------------------ */
/* Weights                                                                   */
/* ------------------------------------------------------------------------ */

static void put_u16(uint8_t *p, uint16_t v) { memcpy(p, &v, sizeof v); }

/* A positive f16 scale around `target` (x 0.5 .. 1.5). */
static uint16_t scale_f16(double target) {
    return ds4_f32_to_f16((float)(target * (0.5 + test_rand_uniform())));
}

/* Random valid blocks: random code bytes, scales chosen so the dequantised
 * values are around 0.05 in magnitude. */
static void random_blocks(uint32_t type, uint8_t *p, int64_t n_blocks) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    for (int64_t i = 0; i < n_blocks * t->block_bytes; i++) p[i] = (uint8_t)test_rand_u64();
    for (int64_t b = 0; b < n_blocks; b++) {
        uint8_t *blk = p + b * t->block_bytes;
        switch (type) {
        case DS4_TYPE_Q8_0: put_u16(blk + offsetof(ds4_block_q8_0, d), scale_f16(4e-4)); break;
        case DS4_TYPE_Q2_K:
            put_u16(blk + offsetof(ds4_block_q2_K, d), scale_f16(2e-3));
            put_u16(blk + offsetof(ds4_block_q2_K, dmin), scale_f16(2e-3));
            break;
        case DS4_TYPE_Q4_K:
            put_u16(blk + offsetof(ds4_block_q4_K, d), scale_f16(1e-4));
            put_u16(blk + offsetof(ds4_block_q4_K, dmin), scale_f16(1e-4));
            break;
        case DS4_TYPE_Q5_K:
            put_u16(blk + offsetof(ds4_block_q5_K, d), scale_f16(5e-5));
            put_u16(blk + offsetof(ds4_block_q5_K, dmin), scale_f16(5e-5));
            break;
        case DS4_TYPE_Q6_K: put_u16(blk + offsetof(ds4_block_q6_K, d), scale_f16(2e-5)); break;
        case DS4_TYPE_IQ2_XXS: put_u16(blk + offsetof(ds4_block_iq2_xxs, d), scale_f16(3e-4)); break;
        case DS4_TYPE_Q8_K: {
            float d = (float)(4e-4 * (0.5 + test_rand_uniform()));
            memcpy(blk + offsetof(ds4_block_q8_K, d), &d, sizeof d);
            break;
        }
        default: break;
        }
    }
}

/* Weight bytes of `rows` rows of ne0 (malloc'd): the reference quantiser on
 * N(0, 0.05^2) floats (quantiser = true, or always for float types), or
 * random valid blocks. *deq = the CPU's dequantisation of the bytes. */
static uint8_t *weight_bytes(uint32_t type, int64_t ne0, int64_t rows, bool quantiser, float **deq) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    const int64_t rb = ds4_type_row_bytes(type, ne0);
    uint8_t *bytes = malloc((size_t)(rb * rows));
    *deq = malloc((size_t)(ne0 * rows) * sizeof(float));
    if (quantiser || is_float_type(type)) {
        float *v = op_rand(ne0, 0.05);
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t i = 0; i < ne0; i++) v[i] = (float)(test_rand_normal() * 0.05);
            t->quantize_row(v, bytes + r * rb, ne0);
        }
        free(v);
    } else {
        random_blocks(type, bytes, rows * (ne0 / t->block_elems));
    }
    for (int64_t r = 0; r < rows; r++) t->dequant_row(bytes + r * rb, *deq + r * ne0, ne0);
    return bytes;
}

/* The end of a case: its activation buffer, weight and host arrays. */
static void weight_case_free(op_pair *p, op_buf *x, op_weight *w, float *hx, uint8_t *bytes, float *deq) {
    op_buf_free(p, x);
    op_weight_free(p, w);
    free(hx);
    free(bytes);
    free(deq);
}

/* ------------------------------------------------------------------------ */
/* Host-side tolerances                                                      */
/* ------------------------------------------------------------------------ */

/* DS4's Q8_0 activation block, as the CPU quantises it (cpu_matmul.c). */
typedef struct {
    float d;
    int8_t q[32];
} act_q8_0;

static void host_quant_q8_0(const float *x, act_q8_0 *y, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++)
            if (fabsf(x[32 * b + j]) > amax) amax = fabsf(x[32 * b + j]);
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = d;
        for (int j = 0; j < 32; j++) {
            long q = lrintf(x[32 * b + j] * id);
            y[b].q[j] = (int8_t)(q > 127 ? 127 : q < -128 ? -128 : q);
        }
    }
}

typedef enum { KIND_REF, KIND_F32, KIND_Q8_0, KIND_Q8_K } dot_kind;

static dot_kind kind_of(uint32_t type, ds4_numerics num) {
    if (num == DS4_NUMERICS_REFERENCE) return KIND_REF;
    if (is_float_type(type)) return KIND_F32;
    return type == DS4_TYPE_Q8_0 ? KIND_Q8_0 : KIND_Q8_K;
}

/* Number of blocks summed in float per dot for the quantised kinds. */
static int64_t dot_blocks(dot_kind k, int64_t n) { return k == KIND_Q8_0 ? n / 32 : n / DS4_QK_K; }

/*
 * tol[r * n_out + o] for out[r][o] = W[row0 + o] . x[r] (see the top of the
 * file). `bytes`/`deq` are the whole weight, x rows x_stride apart.
 */
static bool float_gemm_on; /* the F16 GEMM's cases run (matmul_case also bounds the normwise error) */
static double x_amp = 1.0; /* the activations' scale in matmul_case */

static double *matmul_tolerances(uint32_t type, ds4_numerics num, const uint8_t *bytes, const float *deq, int64_t n,
                                 int64_t row0, int64_t n_out, const float *x, int64_t x_stride, int64_t n_rows) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    const int64_t rb = ds4_type_row_bytes(type, n);
    const dot_kind kind = kind_of(type, num);
    const bool f16_gemm = type == DS4_TYPE_F16 && n_rows >= 16 && env_on_default("DS4_CUDA_FGEMM", true);
    double *tol = malloc((size_t)(n_rows * n_out > 0 ? n_rows * n_out : 1) * sizeof *tol);
    ds4_block_q8_K *xk = malloc((size_t)(n / DS4_QK_K + 1) * sizeof *xk);
    act_q8_0 *x0 = malloc((size_t)(n / 32 + 1) * sizeof *x0);
    for (int64_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * x_stride;
        if (kind == KIND_Q8_K) ds4_quantize_row_q8_K(xr, xk, n);
        if (kind == KIND_Q8_0) host_quant_q8_0(xr, x0, n);
        for (int64_t o = 0; o < n_out; o++) {
            const float *w = deq + (row0 + o) * n;
            const uint8_t *wrow = bytes + (row0 + o) * rb;
            double S = 0;
            for (int64_t i = 0; i < n; i++) S += fabs((double)w[i] * xr[i]);
            double T = 0;
            if (kind == KIND_Q8_K) {
                for (int64_t b = 0; b < n / DS4_QK_K; b++)
                    T += fabs(t->dot_q8_K(wrow + b * t->block_bytes, &xk[b], DS4_QK_K));
            } else if (kind == KIND_Q8_0) {
                for (int64_t b = 0; b < n / 32; b++) {
                    const ds4_block_q8_0 *wb = (const ds4_block_q8_0 *)wrow + b;
                    int32_t isum = 0;
                    for (int j = 0; j < 32; j++) isum += (int32_t)wb->qs[j] * x0[b].q[j];
                    T += fabs(ds4_f16_to_f32(wb->d) * x0[b].d * (float)isum);
                }
            }
            double v;
            switch (kind) {
            case KIND_REF: v = 1e-9 * S; break;
            /* (the float GEMM sums each output's n products one after another: n more) */
            /* (the F16 tensor-core GEMM: x split to 2^-22, stages of 64 products summed by the
             * tensor cores, 32 more) */
            case KIND_F32: v = ((double)n / 8 + (double)n / 32 + 16 + (f16_gemm ? 32.0 : 0.0)) * U24 * S; break;
            default: v = (2.0 * (double)dot_blocks(kind, n) + 8) * U24 * T; break;
            }
            tol[r * n_out + o] = v;
        }
    }
    free(xk);
    free(x0);
    return tol;
}

/*
 * Compare out[r][o] (r < n_rows, o < n_out; rows out_stride apart) of the two
 * sides: |g - c| <= tol + rel |c| (exact: g == c); NaN never passes. The gap
 * of each row past n_out must still hold the GPU's NaN poison.
 */
static void compare_out(const char *what, op_pair *p, op_buf y, int64_t n_rows, int64_t n_out, int64_t out_stride,
                        const double *tol, double rel, bool exact) {
    const int64_t total = n_rows * out_stride;
    float *hc = malloc((size_t)total * sizeof *hc), *hg = malloc((size_t)total * sizeof *hg);
    p->cpu->ops->download(p->cpu, hc, y.c, total);
    p->gpu->ops->download(p->gpu, hg, y.g, total);
    int64_t bad = 0, worst = -1, gap_written = 0;
    double worst_ex = -1;
    for (int64_t r = 0; r < n_rows; r++) {
        for (int64_t o = 0; o < out_stride; o++) {
            const int64_t i = r * out_stride + o;
            if (o >= n_out) {
                gap_written += !isnan(hg[i]);
                continue;
            }
            const double c = hc[i], g = hg[i];
            const double lim = exact ? 0.0 : tol[r * n_out + o] + rel * fabs(c);
            const bool ok = exact ? (c == g) : fabs(g - c) <= lim;
            if (!ok) {
                bad++;
                const double ex = isnan(g - c) ? INFINITY : fabs(g - c) - lim;
                if (ex > worst_ex) worst_ex = ex, worst = i;
            }
        }
    }
    if (bad) {
        const int64_t r = worst / out_stride, o = worst % out_stride;
        fprintf(stderr, "  FAIL %s: %lld of %lld outputs out of tolerance; worst [%lld][%lld] cpu %.9g cuda %.9g "
                "(tol %.3g)\n", what, (long long)bad, (long long)(n_rows * n_out), (long long)r, (long long)o,
                hc[worst], hg[worst], exact ? 0.0 : tol[r * n_out + o] + rel * fabs(hc[worst]));
        test_current_failures++;
    }
    CHECK_MSG(gap_written == 0, "%s: %lld elements between out rows were written", what, (long long)gap_written);
    free(hc);
    free(hg);
}

/* ------------------------------------------------------------------------ */
/* matmul                                                                    */
/* ------------------------------------------------------------------------ */

/* ||g - e|| / ||e|| over the outputs, e the exact (float64) products: the
 * worst-case bounds above are loose enough to pass a product of x rounded to
 * binary16 (relative error ~1e-4 normwise), this holds the F16 GEMM's split
 * activations to float accuracy. */
static void normwise_vs_exact(const char *what, op_pair *p, op_buf y, const float *deq, int64_t n, int64_t row0,
                              int64_t n_out, const float *x, int64_t x_stride, int64_t n_rows, int64_t out_stride) {
    float *hg = malloc((size_t)(n_rows * out_stride) * sizeof *hg);
    p->gpu->ops->download(p->gpu, hg, y.g, n_rows * out_stride);
    double num = 0, den = 0;
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t o = 0; o < n_out; o++) {
            const float *w = deq + (row0 + o) * n, *xr = x + r * x_stride;
            double e = 0;
            for (int64_t i = 0; i < n; i++) e += (double)w[i] * xr[i];
            const double d = hg[r * out_stride + o] - e;
            num += d * d, den += e * e;
        }
    const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    CHECK_MSG(rel <= 1e-5, "%s: normwise error %.3g from the exact products (bound 1e-5)", what, rel);
    free(hg);
}

/* One matmul of a [n, rows] weight of `type`: out rows row0..row0+n_out,
 * n_rows activation rows (x_stride / out_stride apart), both numerics. */
static void matmul_case(op_pair *p, uint32_t type, int64_t n, int64_t rows, bool quantiser, int64_t row0,
                        int64_t n_out, int64_t n_rows, int64_t x_stride, int64_t out_stride, bool exact) {
    float *deq = NULL;
    uint8_t *bytes = weight_bytes(type, n, rows, quantiser, &deq);
    op_weight *w = op_weight_make(p, "blk.0.test_matmul.weight", type, n, rows, 1, bytes);
    const int64_t nx = n_rows > 0 ? (n_rows - 1) * x_stride + n : 1;
    float *hx = op_rand(nx, x_amp);
    op_buf x = op_buf_from(p, hx, nx);
    for (int ni = 0; ni < 2; ni++) {
        const ds4_numerics num = ni ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
        if (exact && num == DS4_NUMERICS_REFERENCE) continue;
        op_buf y = op_buf_poisoned(p, n_rows * out_stride > 0 ? n_rows * out_stride : 1);
        p->cpu->ops->matmul(p->cpu, &w->c, row0, n_out, x.c, x_stride, y.c, out_stride, n_rows, num);
        p->gpu->ops->matmul(p->gpu, &w->g, row0, n_out, x.g, x_stride, y.g, out_stride, n_rows, num);
        op_expect_ok(p);
        double *tol = matmul_tolerances(type, num, bytes, deq, n, row0, n_out, hx, x_stride, n_rows);
        char what[160];
        snprintf(what, sizeof what, "matmul %s %s [%lld -> %lld rows %lld..+%lld] x %lld rows (strides %lld, %lld)%s",
                 ds4_type_name(type), num_name(num), (long long)n, (long long)rows, (long long)row0,
                 (long long)n_out, (long long)n_rows, (long long)x_stride, (long long)out_stride,
                 exact ? " bit-exact" : "");
        compare_out(what, p, y, n_rows, n_out, out_stride, tol, num == DS4_NUMERICS_REFERENCE ? 2.5e-7 : 0.0, exact);
        if (float_gemm_on && num == DS4_NUMERICS_DS4) normwise_vs_exact(what, p, y, deq, n, row0, n_out, hx, x_stride,
                                                                        n_rows, out_stride);
        free(tol);
        op_buf_free(p, &y);
    }
    weight_case_free(p, &x, w, hx, bytes, deq);
}

/* Every n_rows in {1, 3, 37}; full range with tight strides and a sub-range
 * with strides wider than the data; a row of several blocks and a large one;
 * products of tens of thousands of short rows. */
static void check_matmul_type(uint32_t type) {
    OPEN_PAIR(p);
    const ds4_type_traits *t = ds4_type_traits_get(type);
    const int64_t bl = t->block_elems;
    const int64_t n_small = bl == 1 ? 300 : bl == 32 ? 96 : 512;
    const int64_t n_mid = bl == 1 ? 1000 : 1024;
    const bool slow_quantiser = type == DS4_TYPE_IQ2_XXS; /* its reference encoder is slow: random blocks */
    static const int64_t ROWS[] = { 1, 3, 37 };
    for (size_t ri = 0; ri < 3; ri++) {
        const int64_t nr = ROWS[ri];
        matmul_case(&p, type, n_small, 40, !slow_quantiser, 0, 40, nr, n_small, 40, false);
        matmul_case(&p, type, n_small, 40, !slow_quantiser, 5, 31, nr, n_small + 7, 36, false);
        matmul_case(&p, type, n_mid, 24, false, 3, 20, nr, n_mid + 1, 23, false);
    }
    matmul_case(&p, type, 4096, 300, false, 0, 300, 1, 4096, 300, false);
    matmul_case(&p, type, 4096, 300, false, 0, 300, 37, 4096, 300, false);
    /* decode shapes (the streaming matvec kernels: every row count up to 8,
     * rows split over warps, offsets and wide strides, many outputs) and a
     * batch with partial tiles (the tensor-core GEMM for Q8_0) */
    static const int64_t MV_ROWS[] = { 2, 4, 5, 8 };
    for (size_t ri = 0; ri < sizeof MV_ROWS / sizeof MV_ROWS[0]; ri++)
        matmul_case(&p, type, 4096, 300, false, 0, 300, MV_ROWS[ri], 4096, 300, false);
    matmul_case(&p, type, 4096, 300, false, 7, 200, 5, 4100, 256, false);
    matmul_case(&p, type, 2048, 5000, false, 0, 5000, 1, 2048, 5000, false);
    if (type == DS4_TYPE_IQ2_XXS || type == DS4_TYPE_Q2_K || type == DS4_TYPE_Q4_K)
        /* one row of 72 blocks in two parts: a part of several stages, the
         * last one short (the unrolled one-row stage decoder; Q4_K's stages
         * of 15 blocks end inside a warp step) */
        matmul_case(&p, type, 18432, 2048, false, 0, 2048, 1, 18432, 2048, false);
    matmul_case(&p, type, 4096, 300, false, 3, 290, 130, 4096, 300, false);
    /* batched-decode shapes (9 to 64 rows): few output tiles, so the GEMMs
     * split K over several blocks and sum the parts in order */
    matmul_case(&p, type, 4096, 1024, false, 0, 1024, 32, 4096, 1024, false);
    matmul_case(&p, type, 4096, 520, false, 8, 512, 9, 4100, 515, false);
    if (type == DS4_TYPE_F16) { /* the F16 GEMM (16 tokens or more, K in 32s): short K, odd strides, partial tiles */
        ds4_cuda_backend_set_fgemm(p.gpu, 1);
        float_gemm_on = true;
        const int64_t calls0 = ds4_cuda_backend_fgemm_calls(p.gpu);
        matmul_case(&p, type, 96, 70, false, 1, 69, 20, 101, 75, false);
        matmul_case(&p, type, 4096, 300, false, 0, 300, 16, 4097, 301, false);
        matmul_case(&p, type, 1024, 130, false, 0, 130, 65, 1024, 130, false);
        matmul_case(&p, type, 4096, 300, false, 3, 290, 130, 4096, 300, false);
        /* activations far from 1: the split's power-of-two scale down (|x| past binary16's range) and up */
        x_amp = 3e4;
        matmul_case(&p, type, 1024, 130, false, 0, 130, 40, 1024, 130, false);
        x_amp = 1e-9;
        matmul_case(&p, type, 1024, 130, false, 0, 130, 40, 1024, 130, false);
        x_amp = 1.0;
        /* each case once in DS4 numerics (REFERENCE keeps the double-sum kernels) */
        CHECK_MSG(ds4_cuda_backend_fgemm_calls(p.gpu) - calls0 == 6, "%s: %lld products ran as the F16 GEMM",
                  ds4_type_name(type), (long long)(ds4_cuda_backend_fgemm_calls(p.gpu) - calls0));
        float_gemm_on = false;
        ds4_cuda_backend_set_fgemm(p.gpu, env_on_default("DS4_CUDA_FGEMM", true));
    }
    /* many short rows: warps stream 2 (16391 outputs) and 8 (70001) rows
     * each, the last warp of each product with fewer; an offset range with
     * several activation rows and wide strides */
    matmul_case(&p, type, 256, 16391, false, 0, 16391, 1, 256, 16391, false);
    matmul_case(&p, type, 256, 70001, false, 0, 70001, 2, 256, 70001, false);
    matmul_case(&p, type, 256, 40000, false, 9, 33000, 5, 300, 33005, false);
    op_pair_close(&p);
}

static void test_matmul_f32(void) { check_matmul_type(DS4_TYPE_F32); }
static void test_matmul_f16(void) { check_matmul_type(DS4_TYPE_F16); }
static void test_matmul_bf16(void) { check_matmul_type(DS4_TYPE_BF16); }
static void test_matmul_q8_0(void) { check_matmul_type(DS4_TYPE_Q8_0); }
static void test_matmul_q2_K(void) { check_matmul_type(DS4_TYPE_Q2_K); }
static void test_matmul_q4_K(void) { check_matmul_type(DS4_TYPE_Q4_K); }
static void test_matmul_q5_K(void) { check_matmul_type(DS4_TYPE_Q5_K); }
static void test_matmul_q6_K(void) { check_matmul_type(DS4_TYPE_Q6_K); }
static void test_matmul_iq2_xxs(void) { check_matmul_type(DS4_TYPE_IQ2_XXS); }
static void test_matmul_q8_K(void) { check_matmul_type(DS4_TYPE_Q8_K); }

/*
 * DS4 numerics, rows of one and two blocks: the result is a sum of at most
 * two block terms, which does not depend on the order, so CPU and GPU must be
 * equal - any difference in the GPU's Q8_0 / Q8_K activation codes or scales
 * would show. The activations include the quantisers' edge cases: an all-zero
 * block (a zero Q8_K block), equal largest |x| of opposite signs (the first
 * one sets the scale's sign), and values on exact half-code ties.
 */
static void test_matmul_act_quant_bitexact(void) {
    OPEN_PAIR(p);
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const uint32_t type = ALL_TYPES[ti];
        if (is_float_type(type)) continue;
        const int64_t bl = ds4_type_traits_get(type)->block_elems;
        for (int nb = 1; nb <= 2; nb++) {
            const int64_t n = bl * nb, n_rows = 37, rows = 16;
            float *deq = NULL;
            uint8_t *bytes = weight_bytes(type, n, rows, false, &deq);
            op_weight *w = op_weight_make(&p, "blk.0.bitexact.weight", type, n, rows, 1, bytes);
            float *hx = op_rand(n_rows * n, 1.0);
            for (int64_t i = 0; i < bl; i++) hx[i] = 0.0f;           /* row 0, block 0: zeros */
            hx[n + 3] = 2.5f, hx[n + 7] = -2.5f;                      /* row 1: tie, + first */
            for (int64_t i = 0; i < n; i++)
                if (fabsf(hx[n + i]) > 2.4f && i != 3 && i != 7) hx[n + i] = 0.1f;
            hx[2 * n + 1] = -3.0f, hx[2 * n + 2] = 3.0f;              /* row 2: tie, - first */
            for (int64_t i = 0; i < n; i++)
                if (fabsf(hx[2 * n + i]) > 2.9f && i != 1 && i != 2) hx[2 * n + i] = 0.2f;
            /* row 3: max 127 so iscale = -1 and d = 1: x.5 values are exact ties */
            hx[3 * n] = -127.0f;
            for (int64_t i = 1; i < bl; i++) hx[3 * n + i] = (float)((int)(test_rand_u64() % 200) - 100) + 0.5f;
            op_buf x = op_buf_from(&p, hx, n_rows * n);
            op_buf y = op_buf_poisoned(&p, n_rows * rows);
            p.cpu->ops->matmul(p.cpu, &w->c, 0, rows, x.c, n, y.c, rows, n_rows, DS4_NUMERICS_DS4);
            p.gpu->ops->matmul(p.gpu, &w->g, 0, rows, x.g, n, y.g, rows, n_rows, DS4_NUMERICS_DS4);
            op_expect_ok(&p);
            char what[96];
            snprintf(what, sizeof what, "matmul %s ds4, %d block(s) per row: exact", ds4_type_name(type), nb);
            compare_out(what, &p, y, n_rows, rows, rows, NULL, 0.0, true);
            op_buf_free(&p, &y);
            weight_case_free(&p, &x, w, hx, bytes, deq);
        }
    }
    op_pair_close(&p);
}

/* n_rows == 0 and n_out == 0 do nothing (and record no error). */
static void test_matmul_empty(void) {
    OPEN_PAIR(p);
    float *deq = NULL;
    uint8_t *bytes = weight_bytes(DS4_TYPE_Q4_K, 256, 8, false, &deq);
    op_weight *w = op_weight_make(&p, "blk.0.empty.weight", DS4_TYPE_Q4_K, 256, 8, 1, bytes);
    float *hx = op_rand(256, 1.0);
    op_buf x = op_buf_from(&p, hx, 256);
    op_buf y = op_buf_poisoned(&p, 8);
    float *hf = op_rand(256 * 8, 0.05);
    op_weight *wf = op_weight_floats(&p, "blk.0.empty_f16.weight", DS4_TYPE_F16, 256, 8, 1, hf);
    for (int ni = 0; ni < 2; ni++) {
        const ds4_numerics num = ni ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
        p.gpu->ops->matmul(p.gpu, &w->g, 0, 8, x.g, 256, y.g, 8, 0, num);
        p.gpu->ops->matmul(p.gpu, &w->g, 2, 0, x.g, 256, y.g, 8, 1, num);
        p.gpu->ops->matmul(p.gpu, &wf->g, 0, 8, x.g, 256, y.g, 8, 0, num);
        p.gpu->ops->matmul(p.gpu, &wf->g, 8, 0, x.g, 256, y.g, 8, 3, num);
        op_expect_ok(&p);
    }
    op_weight_free(&p, wf);
    free(hf);
    float hy[8];
    p.gpu->ops->download(p.gpu, hy, y.g, 8);
    int written = 0;
    for (int i = 0; i < 8; i++) written += !isnan(hy[i]);
    CHECK_EQ_INT(written, 0);
    op_buf_free(&p, &y);
    weight_case_free(&p, &x, w, hx, bytes, deq);
    op_pair_close(&p);
}

/* Bad arguments record an error (and do not crash); the backend then still
 * computes correctly. */
static void test_matmul_errors(void) {
    OPEN_PAIR(p);
    float *deq = NULL;
    uint8_t *bytes = weight_bytes(DS4_TYPE_Q8_0, 64, 16, true, &deq);
    op_weight *w = op_weight_make(&p, "blk.0.err.weight", DS4_TYPE_Q8_0, 64, 16, 1, bytes);
    float *hx = op_rand(4 * 64, 1.0);
    op_buf x = op_buf_from(&p, hx, 4 * 64);
    op_buf y = op_buf_poisoned(&p, 4 * 16);
    const ds4_backend_ops *g = p.gpu->ops;
    for (int ni = 0; ni < 2; ni++) {
        const ds4_numerics num = ni ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
        /* row ranges */
        g->matmul(p.gpu, &w->g, 10, 7, x.g, 64, y.g, 16, 1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        g->matmul(p.gpu, &w->g, -1, 4, x.g, 64, y.g, 16, 1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        g->matmul(p.gpu, &w->g, 0, -2, x.g, 64, y.g, 16, 1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        g->matmul(p.gpu, &w->g, 0, 16, x.g, 64, y.g, 16, -1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        /* strides narrower than the rows */
        g->matmul(p.gpu, &w->g, 0, 16, x.g, 63, y.g, 16, 4, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        g->matmul(p.gpu, &w->g, 0, 16, x.g, 64, y.g, 15, 4, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        /* unsupported type (a known type without a kernel), unknown type id */
        ds4_weight bad = w->g;
        bad.type = DS4_TYPE_Q4_0;
        g->matmul(p.gpu, &bad, 0, 4, x.g, 64, y.g, 16, 1, num);
        ds4_error e = { 0 };
        CHECK_EQ_INT(g->take_error(p.gpu, &e), DS4_ERR_UNSUPPORTED);
        CHECK_MSG(strstr(e.message, "blk.0.err.weight") != NULL, "%s", e.message);
        bad.type = 1000;
        g->matmul(p.gpu, &bad, 0, 4, x.g, 64, y.g, 16, 1, num);
        CHECK(g->take_error(p.gpu, &e) != DS4_OK);
        /* a row length that is not a whole number of blocks */
        bad = w->g;
        bad.ne[0] = 48;
        g->matmul(p.gpu, &bad, 0, 4, x.g, 64, y.g, 16, 1, num);
        CHECK(g->take_error(p.gpu, &e) != DS4_OK);
        CHECK_MSG(strstr(e.message, "blk.0.err.weight") != NULL, "%s", e.message);
        /* not bound */
        bad = w->g;
        bad.device = NULL;
        g->matmul(p.gpu, &bad, 0, 4, x.g, 64, y.g, 16, 1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        g->matmul(p.gpu, NULL, 0, 4, x.g, 64, y.g, 16, 1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
    }
    /* nothing was written by the failed calls ... */
    {
        float hy[4 * 16];
        g->download(p.gpu, hy, y.g, 4 * 16);
        int written = 0;
        for (int i = 0; i < 4 * 16; i++) written += !isnan(hy[i]);
        CHECK_EQ_INT(written, 0);
    }
    /* ... and a valid call afterwards is correct */
    p.cpu->ops->matmul(p.cpu, &w->c, 0, 16, x.c, 64, y.c, 16, 4, DS4_NUMERICS_DS4);
    g->matmul(p.gpu, &w->g, 0, 16, x.g, 64, y.g, 16, 4, DS4_NUMERICS_DS4);
    op_expect_ok(&p);
    double *tol = matmul_tolerances(DS4_TYPE_Q8_0, DS4_NUMERICS_DS4, bytes, deq, 64, 0, 16, hx, 64, 4);
    compare_out("matmul after errors", &p, y, 4, 16, 16, tol, 0.0, false);
    free(tol);
    op_buf_free(&p, &y);
    weight_case_free(&p, &x, w, hx, bytes, deq);
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* matmul_grouped                                                            */
/* ------------------------------------------------------------------------ */

/*
 * One grouped product: W of n_groups * n_out + extra rows of n_in, group g
 * multiplies x columns g*n_in.. by W rows g*n_out..; n_rows rows x_stride /
 * out_stride apart, both numerics (DS4 only when exact). On the CPU the op
 * must equal n_groups separate matmul calls bit for bit; the CUDA result is
 * held to the matmul tolerances of each group's own product (exact: rows of
 * one block per group, where a per-group activation quantisation is checked
 * bit for bit).
 */
static void grouped_case(op_pair *p, uint32_t type, int64_t n_groups, int64_t n_in, int64_t n_out, int64_t extra,
                         int64_t n_rows, int64_t x_stride, int64_t out_stride, bool exact) {
    const int64_t rows = n_groups * n_out + extra, width = n_groups * n_out;
    float *deq = NULL;
    uint8_t *bytes = weight_bytes(type, n_in, rows, false, &deq);
    op_weight *w = op_weight_make(p, "blk.0.attn_output_a.weight", type, n_in, rows, 1, bytes);
    const int64_t nx = n_rows > 0 ? (n_rows - 1) * x_stride + n_groups * n_in : 1;
    float *hx = op_rand(nx, 1.0);
    op_buf x = op_buf_from(p, hx, nx);
    const int64_t ny = n_rows * out_stride > 0 ? n_rows * out_stride : 1;
    float *hy = malloc((size_t)ny * sizeof *hy), *hy_sep = malloc((size_t)ny * sizeof *hy_sep);
    double *tol = malloc((size_t)(n_rows * width > 0 ? n_rows * width : 1) * sizeof *tol);
    for (int ni = 0; ni < 2; ni++) {
        const ds4_numerics num = ni ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
        if (exact && num == DS4_NUMERICS_REFERENCE) continue;
        char what[200];
        snprintf(what, sizeof what, "matmul_grouped %s %s [%lld groups of %lld -> %lld rows (+%lld)] x %lld rows "
                 "(strides %lld, %lld)%s", ds4_type_name(type), num_name(num), (long long)n_groups, (long long)n_in,
                 (long long)n_out, (long long)extra, (long long)n_rows, (long long)x_stride, (long long)out_stride,
                 exact ? " bit-exact" : "");
        op_buf y = op_buf_poisoned(p, ny), ysep = op_buf_poisoned(p, ny);
        p->cpu->ops->matmul_grouped(p->cpu, &w->c, n_groups, n_out, x.c, x_stride, y.c, out_stride, n_rows, num);
        p->gpu->ops->matmul_grouped(p->gpu, &w->g, n_groups, n_out, x.g, x_stride, y.g, out_stride, n_rows, num);
        for (int64_t g = 0; g < n_groups; g++)
            p->cpu->ops->matmul(p->cpu, &w->c, g * n_out, n_out, x.c + g * n_in, x_stride, ysep.c + g * n_out,
                                out_stride, n_rows, num);
        op_expect_ok(p);
        /* CPU: the grouped op is the separate calls, bit for bit (NaN gaps included) */
        p->cpu->ops->download(p->cpu, hy, y.c, ny);
        p->cpu->ops->download(p->cpu, hy_sep, ysep.c, ny);
        CHECK_MSG(memcmp(hy, hy_sep, (size_t)ny * sizeof *hy) == 0, "%s: the CPU's grouped op differs from its "
                  "per-group matmul calls", what);
        /* CUDA vs CPU: each group's tolerances, placed at its columns */
        for (int64_t g = 0; g < n_groups; g++) {
            double *tg = matmul_tolerances(type, num, bytes, deq, n_in, g * n_out, n_out, hx + g * n_in, x_stride,
                                           n_rows);
            for (int64_t r = 0; r < n_rows; r++)
                for (int64_t o = 0; o < n_out; o++) tol[r * width + g * n_out + o] = tg[r * n_out + o];
            free(tg);
        }
        compare_out(what, p, y, n_rows, width, out_stride, tol, num == DS4_NUMERICS_REFERENCE ? 2.5e-7 : 0.0, exact);
        op_buf_free(p, &y);
        op_buf_free(p, &ysep);
    }
    free(tol);
    free(hy);
    free(hy_sep);
    weight_case_free(p, &x, w, hx, bytes, deq);
}

static bool env_on(const char *name);
static bool launch_counts_apply(void);

/* The attention output's shape (8 groups of 4096 inputs, outputs of 64..300
 * per group) for 1, 3 and 37 rows; small groups with extra weight rows and
 * strides wider than the data; one group (plain matmul); and, for the
 * quantised kinds, groups of one block compared bit for bit. */
static void check_matmul_grouped_type(uint32_t type) {
    OPEN_PAIR(p);
    const int64_t bl = ds4_type_traits_get(type)->block_elems;
    const int64_t n_small = bl == 1 ? 96 : bl == 32 ? 96 : 512;
    static const int64_t ROWS[] = { 1, 3, 37 };
    for (size_t ri = 0; ri < 3; ri++) {
        const int64_t nr = ROWS[ri];
        grouped_case(&p, type, 8, 4096, 64, 0, nr, 8 * 4096, 8 * 64, false);
        grouped_case(&p, type, 3, n_small, 5, 4, nr, 3 * n_small + 9, 3 * 5 + 2, false);
    }
    grouped_case(&p, type, 8, 4096, 300, 0, 1, 8 * 4096, 8 * 300, false);
    grouped_case(&p, type, 8, 4096, 300, 0, 37, 8 * 4096, 8 * 300, false);
    grouped_case(&p, type, 8, 4096, 100, 3, 5, 8 * 4096 + 64, 8 * 100 + 7, false);
    /* a batched decode's 32 rows (Q8_0: one split-K GEMM launch for all groups) */
    grouped_case(&p, type, 8, 4096, 128, 0, 32, 8 * 4096, 8 * 128, false);
    grouped_case(&p, type, 8, 4096, 100, 3, 12, 8 * 4096 + 64, 8 * 100 + 7, false);
    grouped_case(&p, type, 1, 4096, 200, 0, 3, 4096, 200, false);
    /* groups of an odd 2051 rows with two rows per warp: warps that straddle two groups */
    grouped_case(&p, type, 8, 256, 2051, 0, 1, 8 * 256, 8 * 2051, false);
    if (!is_float_type(type)) grouped_case(&p, type, 8, bl, 16, 0, 37, 8 * bl, 8 * 16, true);
    if (type == DS4_TYPE_Q8_0 && launch_counts_apply() && env_on("DS4_CUDA_GEMM")) {
        /* 32 rows of the eight groups: one quantiser, one GEMM launch for all
         * groups and at most one reduction (not a GEMM per group) */
        float *deq = NULL;
        uint8_t *bytes = weight_bytes(type, 4096, 8 * 128, false, &deq);
        op_weight *w = op_weight_make(&p, "blk.0.attn_output_a.weight", type, 4096, 8 * 128, 1, bytes);
        float *hx = op_rand(32 * 8 * 4096, 1.0);
        op_buf x = op_buf_from(&p, hx, 32 * 8 * 4096), y = op_buf_poisoned(&p, 32 * 8 * 128);
        const ds4_backend_counters c0 = op_gpu_counters(&p);
        p.gpu->ops->matmul_grouped(p.gpu, &w->g, 8, 128, x.g, 8 * 4096, y.g, 8 * 128, 32, DS4_NUMERICS_DS4);
        const ds4_backend_counters c1 = op_gpu_counters(&p);
        op_expect_ok(&p);
        CHECK_MSG(c1.launches - c0.launches >= 2 && c1.launches - c0.launches <= 3,
                  "matmul_grouped Q8_0 of 32 rows: %llu launches (2 or 3 expected: one GEMM for all groups)",
                  (unsigned long long)(c1.launches - c0.launches));
        op_buf_free(&p, &x);
        op_buf_free(&p, &y);
        op_weight_free(&p, w);
        free(hx);
        free(bytes);
        free(deq);
    }
    op_pair_close(&p);
}

static void test_matmul_grouped_f32(void) { check_matmul_grouped_type(DS4_TYPE_F32); }
static void test_matmul_grouped_f16(void) { check_matmul_grouped_type(DS4_TYPE_F16); }
static void test_matmul_grouped_bf16(void) { check_matmul_grouped_type(DS4_TYPE_BF16); }
static void test_matmul_grouped_q8_0(void) { check_matmul_grouped_type(DS4_TYPE_Q8_0); }

/* The int8 GEMM's blocks of 128 weight rows (set_gemm_bm 128, the default, taken where
 * their tiles fill the device: prefill-sized products) against its blocks
 * of 64, which the cases above check against the CPU: the same bits, for a
 * plain product with a row offset and partial row and token tiles, and for
 * eight groups. */
static void test_gemm_bm(void) {
    OPEN_PAIR(p);
    const int bm_dflt = ds4_cuda_backend_gemm_bm(p.gpu);
    static const struct {
        int64_t n_in, n_out, row0, n_tok, n_groups;
    } CASES[] = { { 512, 1000, 3, 4200, 1 }, { 1024, 300, 0, 1100, 8 } };
    for (size_t ci = 0; ci < sizeof CASES / sizeof CASES[0]; ci++) {
        const int64_t n_in = CASES[ci].n_in, n_out = CASES[ci].n_out, row0 = CASES[ci].row0;
        const int64_t n_tok = CASES[ci].n_tok, ng = CASES[ci].n_groups, width = ng * n_out;
        float *deq = NULL;
        uint8_t *bytes = weight_bytes(DS4_TYPE_Q8_0, n_in, row0 + width, false, &deq);
        op_weight *w = op_weight_make(&p, "blk.0.gemm_bm.weight", DS4_TYPE_Q8_0, n_in, row0 + width, 1, bytes);
        float *hx = op_rand(n_tok * ng * n_in, 1.0);
        op_buf x = op_buf_from(&p, hx, n_tok * ng * n_in);
        op_buf y[2] = { op_buf_poisoned(&p, n_tok * width), op_buf_poisoned(&p, n_tok * width) };
        int64_t calls[2];
        for (int v = 0; v < 2; v++) {
            ds4_cuda_backend_set_gemm_bm(p.gpu, v ? 128 : 64);
            const int64_t c0 = ds4_cuda_backend_gemm_bm128_calls(p.gpu);
            if (ng == 1)
                p.gpu->ops->matmul(p.gpu, &w->g, row0, n_out, x.g, n_in, y[v].g, n_out, n_tok, DS4_NUMERICS_DS4);
            else
                p.gpu->ops->matmul_grouped(p.gpu, &w->g, ng, n_out, x.g, ng * n_in, y[v].g, width, n_tok,
                                           DS4_NUMERICS_DS4);
            op_expect_ok(&p);
            calls[v] = ds4_cuda_backend_gemm_bm128_calls(p.gpu) - c0;
        }
        ds4_cuda_backend_set_gemm_bm(p.gpu, bm_dflt);
        CHECK_MSG(calls[0] == 0 && calls[1] >= 1, "gemm_bm case %zu: %lld / %lld launches of 128-row blocks "
                  "(none, then some expected)", ci, (long long)calls[0], (long long)calls[1]);
        const int64_t diff = op_gpu_differ(&p, y[0], y[1], n_tok * width);
        CHECK_MSG(diff == 0, "gemm_bm case %zu (%lld x %lld, %lld groups): %lld of %lld outputs differ between "
                  "blocks of 64 and 128 rows", ci, (long long)n_out, (long long)n_tok, (long long)ng, (long long)diff,
                  (long long)(n_tok * width));
        op_buf_free(&p, &y[0]);
        op_buf_free(&p, &y[1]);
        weight_case_free(&p, &x, w, hx, bytes, deq);
    }
    op_pair_close(&p);
}

static void test_matmul_grouped_q2_K(void) { check_matmul_grouped_type(DS4_TYPE_Q2_K); }
static void test_matmul_grouped_q4_K(void) { check_matmul_grouped_type(DS4_TYPE_Q4_K); }
static void test_matmul_grouped_iq2_xxs(void) { check_matmul_grouped_type(DS4_TYPE_IQ2_XXS); }

/* Bad arguments record an error naming the weight and write nothing; empty
 * products do nothing; a valid call afterwards is correct. */
static void test_matmul_grouped_errors(void) {
    OPEN_PAIR(p);
    float *deq = NULL;
    uint8_t *bytes = weight_bytes(DS4_TYPE_Q8_0, 64, 12, true, &deq);
    op_weight *w = op_weight_make(&p, "blk.0.grouped_err.weight", DS4_TYPE_Q8_0, 64, 12, 1, bytes);
    float *hx = op_rand(4 * 4 * 64, 1.0);
    op_buf x = op_buf_from(&p, hx, 4 * 4 * 64);
    op_buf y = op_buf_poisoned(&p, 4 * 16);
    const ds4_backend_ops *g = p.gpu->ops;
    const struct {
        int64_t n_groups, n_out, x_stride, out_stride, n_rows;
    } bad[] = {
        { 0, 4, 4 * 64, 12, 1 },     /* no groups */
        { -1, 4, 4 * 64, 12, 1 },    /* negative groups */
        { 3, -1, 4 * 64, 12, 1 },    /* negative n_out */
        { 3, 5, 4 * 64, 15, 1 },     /* 15 rows of a 12-row weight */
        { 13, 1, 13 * 64, 13, 1 },   /* 13 groups of 1 row */
        { 3, 4, 3 * 64 - 1, 12, 2 }, /* x rows overlap */
        { 3, 4, 3 * 64, 11, 2 },     /* out rows overlap */
        { 3, 4, 3 * 64, 12, -1 },    /* negative rows */
    };
    for (int ni = 0; ni < 2; ni++) {
        const ds4_numerics num = ni ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            g->matmul_grouped(p.gpu, &w->g, bad[i].n_groups, bad[i].n_out, x.g, bad[i].x_stride, y.g,
                              bad[i].out_stride, bad[i].n_rows, num);
            ds4_error e = { 0 };
            CHECK_MSG(g->take_error(p.gpu, &e) == DS4_ERR_INVALID, "case %zu: %s", i, e.message);
            CHECK_MSG(strstr(e.message, "blk.0.grouped_err.weight") != NULL, "case %zu: %s", i, e.message);
        }
        /* unsupported type; not bound */
        ds4_weight badw = w->g;
        badw.type = DS4_TYPE_Q4_0;
        g->matmul_grouped(p.gpu, &badw, 3, 4, x.g, 3 * 64, y.g, 12, 1, num);
        op_expect_error(&p, DS4_ERR_UNSUPPORTED);
        badw = w->g;
        badw.device = NULL;
        g->matmul_grouped(p.gpu, &badw, 3, 4, x.g, 3 * 64, y.g, 12, 1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        /* empty products */
        g->matmul_grouped(p.gpu, &w->g, 3, 0, x.g, 3 * 64, y.g, 12, 4, num);
        g->matmul_grouped(p.gpu, &w->g, 3, 4, x.g, 3 * 64, y.g, 12, 0, num);
        op_expect_ok(&p);
    }
    {
        float hy[4 * 16];
        g->download(p.gpu, hy, y.g, 4 * 16);
        int written = 0;
        for (int i = 0; i < 4 * 16; i++) written += !isnan(hy[i]);
        CHECK_EQ_INT(written, 0);
    }
    /* a valid call afterwards: 3 groups of 4 rows, 4 x rows of 4 * 64 */
    p.cpu->ops->matmul_grouped(p.cpu, &w->c, 3, 4, x.c, 4 * 64, y.c, 16, 4, DS4_NUMERICS_DS4);
    g->matmul_grouped(p.gpu, &w->g, 3, 4, x.g, 4 * 64, y.g, 16, 4, DS4_NUMERICS_DS4);
    op_expect_ok(&p);
    double tol[4 * 12];
    for (int64_t gi = 0; gi < 3; gi++) {
        double *tg = matmul_tolerances(DS4_TYPE_Q8_0, DS4_NUMERICS_DS4, bytes, deq, 64, gi * 4, 4, hx + gi * 64,
                                       4 * 64, 4);
        for (int64_t r = 0; r < 4; r++)
            for (int64_t o = 0; o < 4; o++) tol[r * 12 + gi * 4 + o] = tg[r * 4 + o];
        free(tg);
    }
    compare_out("matmul_grouped after errors", &p, y, 4, 12, 16, tol, 0.0, false);
    op_buf_free(&p, &y);
    weight_case_free(&p, &x, w, hx, bytes, deq);
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* MoE                                                                       */
/* ------------------------------------------------------------------------ */

static double host_swiglu(double g, double u, float limit, double scale) {
    if (limit > 0.0f) {
        if (g > limit) g = limit;
        if (u > limit) u = limit;
        if (u < -limit) u = -limit;
    }
    return g / (1.0 + exp(-g)) * u * scale;
}

typedef struct moe_weights {
    op_weight *gate, *up, *down;
    float *dg, *du, *dd; /* dequantised */
} moe_weights;

static moe_weights moe_make(op_pair *p, uint32_t tg, uint32_t td, int64_t dim, int64_t n_ff, int64_t n_expert) {
    moe_weights m;
    uint8_t *b;
    b = weight_bytes(tg, dim, n_ff * n_expert, false, &m.dg);
    m.gate = op_weight_make(p, "blk.3.ffn_gate_exps.weight", tg, dim, n_ff, n_expert, b);
    free(b);
    b = weight_bytes(tg, dim, n_ff * n_expert, false, &m.du);
    m.up = op_weight_make(p, "blk.3.ffn_up_exps.weight", tg, dim, n_ff, n_expert, b);
    free(b);
    b = weight_bytes(td, n_ff, dim * n_expert, false, &m.dd);
    m.down = op_weight_make(p, "blk.3.ffn_down_exps.weight", td, n_ff, dim, n_expert, b);
    free(b);
    return m;
}

static void moe_free(op_pair *p, moe_weights *m) {
    op_weight_free(p, m->gate);
    op_weight_free(p, m->up);
    op_weight_free(p, m->down);
    free(m->dg);
    free(m->du);
    free(m->dd);
}

/* n_used distinct random experts and positive routing weights. */
static void moe_route(int64_t n_expert, int n_used, int32_t *sel, float *wts) {
    for (int k = 0; k < n_used; k++) {
        bool dup;
        do {
            sel[k] = (int32_t)(test_rand_u64() % (uint64_t)n_expert);
            dup = false;
            for (int j = 0; j < k; j++) dup |= sel[j] == sel[k];
        } while (dup);
        wts[k] = (float)(0.1 + test_rand_uniform());
    }
}

static bool env_on(const char *name) { return env_on_default(name, true); }

/* The grouped MoE and its tensor-core products back to the backend's
 * defaults (on unless DS4_CUDA_MOE_GROUPED=0, DS4_CUDA_MOE_MMA=0). */
static void default_moe_grouped(op_pair *p) {
    ds4_cuda_backend_set_moe_grouped(p->gpu, env_on("DS4_CUDA_MOE_GROUPED"));
    const char *sg = getenv("DS4_CUDA_MOE_STEP_GROUP");
    char *end = NULL;
    const long rows = sg && *sg ? strtol(sg, &end, 10) : 0;
    ds4_cuda_backend_set_moe_step_group(p->gpu, end && !*end ? (int)rows : 0);
    ds4_cuda_backend_set_moe_mma(p->gpu, env_on("DS4_CUDA_MOE_MMA"));
    const char *mr = getenv("DS4_CUDA_MOE_MMA_ROWS");
    ds4_cuda_backend_set_moe_mma_rows(p->gpu, mr && strcmp(mr, "32") == 0 ? 32 : 64);
}

/* n_rows tokens in one call, each row with its own experts and weights:
 * on the streaming path (mma false), which waits for nothing
 * (test_moe_grouped holds the grouped matvec path to it), or grouped on
 * the tensor cores (mma true; under DS4 numerics the call must run there). */
static void moe_case_on(op_pair *p, uint32_t tg, uint32_t td, int64_t dim, int64_t n_ff, int64_t n_expert, int n_used,
                        float limit, int64_t n_rows, bool mma) {
    ds4_cuda_backend_set_moe_grouped(p->gpu, mma);
    ds4_cuda_backend_set_moe_mma(p->gpu, mma);
    moe_weights m = moe_make(p, tg, td, dim, n_ff, n_expert);
    const int64_t R = n_rows;
    int32_t *sel = malloc((size_t)(R * n_used) * sizeof *sel);
    float *wts = malloc((size_t)(R * n_used) * sizeof *wts);
    for (int64_t r = 0; r < R; r++) moe_route(n_expert, n_used, sel + r * n_used, wts + r * n_used);
    float *hx = op_rand(R * dim, 1.0);
    op_buf x = op_buf_from(p, hx, R * dim);

    /* S_o of each row from host mids in double; and under DS4 numerics the
     * most one code of a quantised mid can move an output: the mids reach
     * the down product quantised (Q8_0 blocks of 32 for Q8_0 down weights,
     * Q8_K blocks of 256 for the others; float down weights take them as
     * they are), and since CPU and GPU add the gate/up blocks in different
     * orders, a mid lying on a code boundary can round to neighbouring codes
     * on the two sides: a step of amax/127 of its block, times the down
     * weight it meets. flip[r][o] is the largest such term of row r's
     * output o over its experts' mids. */
    const int64_t qblock = td == DS4_TYPE_Q8_0 ? 32 : ds4_type_traits_get(td)->block_elems == 1 ? 0 : 256;
    double *mid = malloc((size_t)(n_used * n_ff) * sizeof *mid), *S = calloc((size_t)(R * dim), sizeof *S);
    double *flip = calloc((size_t)(R * dim), sizeof *flip), *step = malloc((size_t)n_ff * sizeof *step);
    for (int64_t r = 0; r < R; r++) {
        const float *xr = hx + r * dim;
        const int32_t *sr = sel + r * n_used;
        for (int k = 0; k < n_used; k++) {
            for (int64_t j = 0; j < n_ff; j++) {
                const float *gr = m.dg + ((int64_t)sr[k] * n_ff + j) * dim, *ur = m.du + ((int64_t)sr[k] * n_ff + j) * dim;
                double gs = 0, us = 0;
                for (int64_t i = 0; i < dim; i++) gs += (double)gr[i] * xr[i], us += (double)ur[i] * xr[i];
                mid[k * n_ff + j] = host_swiglu(gs, us, limit, wts[r * n_used + k]);
            }
            for (int64_t j = 0; j < n_ff; j++) step[j] = 0.0; /* float mids: no step */
            for (int64_t j0 = 0; qblock && j0 < n_ff; j0 += qblock) {
                const int64_t j1 = j0 + qblock < n_ff ? j0 + qblock : n_ff;
                double amax = 0;
                for (int64_t j = j0; j < j1; j++) amax = fmax(amax, fabs(mid[k * n_ff + j]));
                for (int64_t j = j0; j < j1; j++) step[j] = amax / 127.0;
            }
            for (int64_t o = 0; o < dim; o++) {
                const float *dr = m.dd + ((int64_t)sr[k] * dim + o) * n_ff;
                for (int64_t j = 0; j < n_ff; j++) {
                    S[r * dim + o] += fabs((double)dr[j] * mid[k * n_ff + j]);
                    flip[r * dim + o] = fmax(flip[r * dim + o], fabs((double)dr[j]) * step[j]);
                }
            }
        }
    }
    /* the routing in backend memory, as the router leaves it */
    op_buf dsel = op_ints_from(p, sel, R * n_used), dw = op_buf_from(p, wts, R * n_used);
    for (int ni = 0; ni < 2; ni++) {
        const ds4_numerics num = ni ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
        op_buf y = op_buf_poisoned(p, R * dim);
        p->cpu->ops->moe(p->cpu, &m.gate->c, &m.up->c, &m.down->c, x.c, (const int32_t *)dsel.c, dw.c, n_used, limit,
                         y.c, R, num);
        const int64_t mma0 = ds4_cuda_backend_moe_mma_calls(p->gpu);
        p->gpu->ops->moe(p->gpu, &m.gate->g, &m.up->g, &m.down->g, x.g, (const int32_t *)dsel.g, dw.g, n_used, limit,
                         y.g, R, num);
        op_expect_ok(p);
        const int64_t mma_ran = ds4_cuda_backend_moe_mma_calls(p->gpu) - mma0;
        double *tol = malloc((size_t)(R * dim) * sizeof *tol);
        /* DS4 numerics: room for a mid on the other side of a code boundary,
         * at most as much again as the sums' own room (so a lost mid, about
         * S / (n_used * n_ff), still shows where mids are heavy-tailed) */
        for (int64_t o = 0; o < R * dim; o++)
            tol[o] = num == DS4_NUMERICS_REFERENCE ? 1e-5 * S[o] : 1e-4 * S[o] + fmin(flip[o], 1e-4 * S[o]);
        char what[160];
        snprintf(what, sizeof what, "moe %s/%s %s dim %lld n_ff %lld, %d of %lld experts, limit %g, %lld rows",
                 ds4_type_name(tg), ds4_type_name(td), num_name(num), (long long)dim, (long long)n_ff, n_used,
                 (long long)n_expert, (double)limit, (long long)R);
        compare_out(what, p, y, R, dim, dim, tol, 2.5e-7, false);
        /* the tensor cores take every DS4-numerics call of several tokens (Q8_K products) */
        const bool want_mma = mma && num == DS4_NUMERICS_DS4 && R > 1;
        CHECK_MSG(mma_ran == (want_mma ? 1 : 0), "%s: %lld calls on the tensor cores", what, (long long)mma_ran);
        if (!mma) { /* again: the routing is read on the GPU, nothing waits */
            const ds4_backend_counters c0 = op_gpu_counters(p);
            p->gpu->ops->moe(p->gpu, &m.gate->g, &m.up->g, &m.down->g, x.g, (const int32_t *)dsel.g, dw.g, n_used,
                             limit, y.g, R, num);
            op_expect_no_host_traffic(p, what, &c0);
            op_expect_ok(p);
        }
        free(tol);
        op_buf_free(p, &y);
    }
    free(mid);
    free(S);
    free(flip);
    free(step);
    free(sel);
    free(wts);
    op_buf_free(p, &dsel);
    op_buf_free(p, &dw);
    op_buf_free(p, &x);
    free(hx);
    moe_free(p, &m);
    default_moe_grouped(p);
}

static void moe_case(op_pair *p, uint32_t tg, uint32_t td, int64_t dim, int64_t n_ff, int64_t n_expert, int n_used,
                     float limit, int64_t n_rows) {
    moe_case_on(p, tg, td, dim, n_ff, n_expert, n_used, limit, n_rows, false);
}

/* gate/up of type tg, down of td; limit off and on (0.7 clamps often: the
 * gate/up dots are ~N(0, 1)); one token (decode) and 3 tokens with
 * different experts each (prefill). */
static void check_moe(uint32_t tg, uint32_t td) {
    OPEN_PAIR(p);
    for (int64_t nr = 1; nr <= 3; nr += 2) {
        moe_case(&p, tg, td, 512, 256, 8, 6, 0.0f, nr);
        moe_case(&p, tg, td, 512, 256, 8, 6, 0.7f, nr);
        moe_case(&p, tg, td, 256, 512, 16, 6, 0.7f, nr);
        /* rows of whole 16-byte units (the streaming kernels), up to 8 experts */
        moe_case(&p, tg, td, 2048, 1024, 8, 6, 0.7f, nr);
        moe_case(&p, tg, td, 2048, 1024, 12, 8, 0.0f, nr);
    }
    op_pair_close(&p);
}

static void test_moe_iq2_xxs(void) { check_moe(DS4_TYPE_IQ2_XXS, DS4_TYPE_IQ2_XXS); }
static void test_moe_q2_K(void) { check_moe(DS4_TYPE_Q2_K, DS4_TYPE_Q2_K); }
static void test_moe_q4_K(void) { check_moe(DS4_TYPE_Q4_K, DS4_TYPE_Q4_K); }
static void test_moe_q8_0(void) { check_moe(DS4_TYPE_Q8_0, DS4_TYPE_Q8_0); }
static void test_moe_f16(void) { check_moe(DS4_TYPE_F16, DS4_TYPE_F16); }
/* DS4 Flash's own mix: IQ2_XXS gate/up, Q2_K down; and differing kinds. */
static void test_moe_mixed(void) {
    check_moe(DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K);
    check_moe(DS4_TYPE_Q8_0, DS4_TYPE_Q4_K);
}

/* One moe call on each side with the routing in backend memory. */
static void moe_both(op_pair *p, const moe_weights *m, op_buf x, op_buf sel, op_buf w, int n_used, op_buf y,
                     int64_t n_rows, ds4_numerics num) {
    p->cpu->ops->moe(p->cpu, &m->gate->c, &m->up->c, &m->down->c, x.c, (const int32_t *)sel.c, w.c, n_used, 0.0f, y.c,
                     n_rows, num);
    p->gpu->ops->moe(p->gpu, &m->gate->g, &m->up->g, &m->down->g, x.g, (const int32_t *)sel.g, w.g, n_used, 0.0f, y.g,
                     n_rows, num);
}

/* One moe call on the CUDA side only (DS4 numerics). */
static void moe_gpu(op_pair *p, const moe_weights *m, op_buf x, op_buf sel, op_buf w, int n_used, float limit, op_buf y,
                    int64_t n_rows) {
    p->gpu->ops->moe(p->gpu, &m->gate->g, &m->up->g, &m->down->g, x.g, (const int32_t *)sel.g, w.g, n_used, limit, y.g,
                     n_rows, DS4_NUMERICS_DS4);
}

/* loose scale-free check: |g - c| <= 1e-3 * sum|c| / dim + 1e-4 |c| */
static void moe_expect_close(const char *what, op_pair *p, op_buf y, int64_t dim) {
    float *hc = malloc((size_t)dim * sizeof *hc), *hg = malloc((size_t)dim * sizeof *hg);
    p->cpu->ops->download(p->cpu, hc, y.c, dim);
    p->gpu->ops->download(p->gpu, hg, y.g, dim);
    double mean = 0;
    for (int64_t i = 0; i < dim; i++) mean += fabs(hc[i]) / (double)dim;
    int bad = 0;
    for (int64_t i = 0; i < dim; i++) bad += !(fabs((double)hg[i] - hc[i]) <= 1e-3 * mean + 1e-4 * fabs(hc[i]));
    CHECK_MSG(bad == 0, "%s: %d of %lld outputs differ", what, bad, (long long)dim);
    free(hc);
    free(hg);
}

/* The launch-count expectations hold for the streaming kernels with their
 * launches joined (DS4_CUDA_MATVEC=0 or DS4_CUDA_MULTI=0 change them; the
 * results are still compared then). */


/* An environment switch that is on unless set to "0". */
static bool launch_counts_apply(void) { return env_on("DS4_CUDA_MATVEC") && env_on("DS4_CUDA_MULTI"); }


/* The fusions back to the backend's defaults (DS4_CUDA_MV_XQ, DS4_CUDA_MOE_XQ). */
static void default_fusions(op_pair *p) {
    ds4_cuda_backend_set_fusions(p->gpu, env_on("DS4_CUDA_MV_XQ"), env_on("DS4_CUDA_MOE_XQ"));
}

/* Launches of one GPU call (the expression `call`) checked against `want`. */
#define EXPECT_LAUNCHES(p, want, what, call)                                                                   \
    do {                                                                                                       \
        const ds4_backend_counters c0_ = op_gpu_counters(p);                                                  \
        call;                                                                                                  \
        const ds4_backend_counters c1_ = op_gpu_counters(p);                                                  \
        op_expect_ok(p);                                                                                       \
        CHECK_MSG(!launch_counts_apply() || c1_.launches - c0_.launches == (uint64_t)(want),                  \
                  "%s: %llu launches, expected %llu", what, (unsigned long long)(c1_.launches - c0_.launches), \
                  (unsigned long long)(want));                                                                 \
    } while (0)

/* Outputs of the GPU buffer b (n_rows rows of n_out, stride apart) equal
 * those of r, bit for bit (NaNs included); nothing past a row written. */
static void expect_same_rows(op_pair *p, const char *what, float *b, float *r, int64_t n_rows, int64_t n_out,
                             int64_t stride) {
    const int64_t ny = (n_rows - 1) * stride + n_out + 1;
    float *hb = malloc((size_t)ny * sizeof *hb), *hr = malloc((size_t)ny * sizeof *hr);
    p->gpu->ops->download(p->gpu, hb, b, ny - 1);
    p->gpu->ops->download(p->gpu, hr, r, ny - 1);
    for (int64_t row = 0; row < n_rows; row++)
        CHECK_MSG(memcmp(hb + row * stride, hr + row * stride, (size_t)n_out * sizeof *hb) == 0,
                  "%s: row %lld differs from the quantiser kernel's path", what, (long long)row);
    free(hb);
    free(hr);
}

/* The streaming MoE of a decoded token takes three launches: gate and up
 * together (quantising x to Q8_K blocks themselves, reading the router's
 * ids themselves; with ds4_cuda_backend_set_moe_ids off, a routing check
 * first), the mids (SwiGLU and their Q8_K blocks in one kernel) and down
 * summed over the experts. With the fusion off x's quantiser and the
 * mids' run as kernels of their own (five launches); Q8_0 weights keep
 * the quantiser, SwiGLU and Q8_0 quantiser kernels.
 * With the fusion off (ds4_cuda_backend_set_fusions) the results are the
 * same bit for bit; against the CPU as moe_expect_close (moe_case holds
 * them to the precise bound). */
static void moe_launches_case(op_pair *p, uint32_t tg, uint32_t td, uint64_t fused, uint64_t unfused) {
    const int64_t dim = 2048, n_ff = 1024, n_expert = 8;
    const int n_used = 6;
    moe_weights m = moe_make(p, tg, td, dim, n_ff, n_expert);
    int32_t sel[6];
    float wts[6];
    moe_route(n_expert, n_used, sel, wts);
    float *hx = op_rand(dim, 1.0);
    /* the Q8_K quantisers' edge cases: an all-zero block, and a block whose
     * largest magnitude is there twice with both signs (the first wins) */
    for (int i = 0; i < 256; i++) hx[i] = 0.0f;
    for (int i = 256; i < 512; i++) hx[i] = 0.01f * (float)(i % 7) - 0.03f;
    hx[259] = 9.0f;
    hx[356] = -9.0f;
    op_buf x = op_buf_from(p, hx, dim), y = op_buf_poisoned(p, dim), y2 = op_buf_poisoned(p, dim);
    op_buf dsel = op_ints_from(p, sel, n_used), dw = op_buf_from(p, wts, n_used);
    moe_both(p, &m, x, dsel, dw, n_used, y, 1, DS4_NUMERICS_DS4); /* scratch grown */
    op_expect_ok(p);
    char what[96];
    snprintf(what, sizeof what, "moe %s/%s", ds4_type_name(tg), ds4_type_name(td));
    EXPECT_LAUNCHES(p, fused, what, moe_gpu(p, &m, x, dsel, dw, n_used, 0.0f, y, 1));
    moe_expect_close(what, p, y, dim);
    ds4_cuda_backend_set_fusions(p->gpu, env_on("DS4_CUDA_MV_XQ"), 0);
    EXPECT_LAUNCHES(p, unfused, what, moe_gpu(p, &m, x, dsel, dw, n_used, 0.0f, y2, 1));
    default_fusions(p);
    expect_same_rows(p, what, y.g, y2.g, 1, dim, dim);
    op_buf_free(p, &x);
    op_buf_free(p, &y);
    op_buf_free(p, &y2);
    op_buf_free(p, &dsel);
    op_buf_free(p, &dw);
    free(hx);
    moe_free(p, &m);
}

/* One token: the ids checked and copied by a kernel of their own, or
 * (ds4_cuda_backend_set_moe_ids, the default) read by the products
 * themselves, one launch fewer; the results are the same (moe_launches_case
 * holds each to the CPU). */
static void test_moe_launches(void) {
    OPEN_PAIR(p);
    const uint64_t mids = env_on("DS4_CUDA_MOE_XQ") ? 1 : 2;
    /* x's Q8_K blocks in the gate/up kernel (with the fusion, DS4_CUDA_MOE_XK) */
    const uint64_t xq = env_on("DS4_CUDA_MOE_XQ") && env_on("DS4_CUDA_MOE_XK") ? 0 : 1;
    for (int direct = 1; direct >= 0; direct--) {
        ds4_cuda_backend_set_moe_ids(p.gpu, direct);
        const uint64_t route = direct ? 0 : 1;
        moe_launches_case(&p, DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, 2 + xq + route + mids, 5 + route);
        moe_launches_case(&p, DS4_TYPE_Q4_K, DS4_TYPE_Q4_K, 2 + xq + route + mids, 5 + route);
        moe_launches_case(&p, DS4_TYPE_Q8_0, DS4_TYPE_Q8_0, 5 + route, 5 + route);
    }
    ds4_cuda_backend_set_moe_ids(p.gpu, env_on("DS4_CUDA_MOE_IDS"));
    op_pair_close(&p);
}

/* Expert weights, a random routing of n_rows tokens (n_used experts each)
 * and their activations, in backend memory. */
typedef struct moe_fix {
    moe_weights m;
    int32_t *sel;
    float *wts, *hx;
    op_buf x, dsel, dw;
} moe_fix;

static moe_fix moe_fix_make(op_pair *p, uint32_t tg, uint32_t td, int64_t dim, int64_t n_ff, int64_t n_expert,
                            int n_used, int64_t n_rows) {
    moe_fix f;
    f.m = moe_make(p, tg, td, dim, n_ff, n_expert);
    f.sel = malloc((size_t)(n_rows * n_used) * sizeof *f.sel);
    f.wts = malloc((size_t)(n_rows * n_used) * sizeof *f.wts);
    for (int64_t r = 0; r < n_rows; r++) moe_route(n_expert, n_used, f.sel + r * n_used, f.wts + r * n_used);
    f.hx = op_rand(n_rows * dim, 1.0);
    f.x = op_buf_from(p, f.hx, n_rows * dim);
    f.dsel = op_ints_from(p, f.sel, n_rows * n_used);
    f.dw = op_buf_from(p, f.wts, n_rows * n_used);
    return f;
}

static void moe_fix_free(op_pair *p, moe_fix *f) {
    op_buf_free(p, &f->x);
    op_buf_free(p, &f->dsel);
    op_buf_free(p, &f->dw);
    free(f->hx);
    free(f->sel);
    free(f->wts);
    moe_free(p, &f->m);
}

/* Several tokens' routed experts grouped by expert (ds4_cuda_backend_set_
 * moe_grouped): the same results bit for bit as one pass per (token,
 * expert) slot (which moe_case holds to the CPU), the ids read back once
 * (one more wait); shapes it does not take (one token, Q8_0 weights) keep
 * the streaming path and wait for nothing. Groups of up to eight rows: 40
 * tokens over 8 experts give experts with more than eight tokens. With
 * DS4_CUDA_MATVEC=0 neither path streams (the waits are not checked). */
static void moe_grouped_case(op_pair *p, uint32_t tg, uint32_t td, int64_t dim, int64_t n_ff, int64_t n_expert,
                             int n_used, int64_t n_rows, bool grouped) {
    ds4_cuda_backend_set_moe_mma(p->gpu, 0); /* the multi-row matvec kernels (test_moe_mma: the tensor cores) */
    moe_fix f = moe_fix_make(p, tg, td, dim, n_ff, n_expert, n_used, n_rows);
    moe_weights m = f.m;
    op_buf x = f.x, dsel = f.dsel, dw = f.dw;
    op_buf y = op_buf_poisoned(p, n_rows * dim), y2 = op_buf_poisoned(p, n_rows * dim);
    char what[128];
    snprintf(what, sizeof what, "moe %s/%s grouped, %lld tokens over %lld experts", ds4_type_name(tg),
             ds4_type_name(td), (long long)n_rows, (long long)n_expert);
    ds4_cuda_backend_set_moe_grouped(p->gpu, 0);
    moe_gpu(p, &m, x, dsel, dw, n_used, 0.7f, y, n_rows);
    op_expect_ok(p);
    ds4_cuda_backend_set_moe_grouped(p->gpu, 1);
    const ds4_backend_counters c0 = op_gpu_counters(p);
    moe_gpu(p, &m, x, dsel, dw, n_used, 0.7f, y2, n_rows);
    const ds4_backend_counters c1 = op_gpu_counters(p);
    op_expect_ok(p);
    default_moe_grouped(p);
    CHECK_MSG(!env_on("DS4_CUDA_MATVEC") || (grouped ? c1.syncs > c0.syncs : c1.syncs == c0.syncs), "%s: %llu waits",
              what, (unsigned long long)(c1.syncs - c0.syncs));
    expect_same_rows(p, what, y2.g, y.g, n_rows, dim, dim);
    op_buf_free(p, &y);
    op_buf_free(p, &y2);
    moe_fix_free(p, &f);
}

/* Inside a recorded step (a batched decode), with the step grouping on, the
 * slots of 16 tokens or more are grouped on the device (moe_group_kernel): no wait for the ids, more
 * launches than the per-slot path (the grouping, gathers and the sum), and
 * the same results bit for bit as the per-slot launches in a step and as
 * the per-slot path outside one. With DS4_CUDA_GRAPH=0 there are no
 * recorded steps (the host groups them; only the results are compared). */
static void moe_step_case(op_pair *p, uint32_t tg, uint32_t td, int64_t dim, int64_t n_ff, int64_t n_expert,
                          int n_used, int64_t n_rows, int step_rows) {
    ds4_cuda_backend_set_moe_mma(p->gpu, 0);
    ds4_cuda_backend_set_moe_step_group(p->gpu, step_rows);
    moe_fix f = moe_fix_make(p, tg, td, dim, n_ff, n_expert, n_used, n_rows);
    moe_weights m = f.m;
    op_buf x = f.x, dsel = f.dsel, dw = f.dw;
    op_buf y = op_buf_poisoned(p, n_rows * dim), y_off = op_buf_poisoned(p, n_rows * dim);
    op_buf y_on = op_buf_poisoned(p, n_rows * dim);
    char what[128];
    snprintf(what, sizeof what, "moe %s/%s in a step, %lld tokens over %lld experts, groups of %d", ds4_type_name(tg),
             ds4_type_name(td), (long long)n_rows, (long long)n_expert, step_rows);
    ds4_cuda_backend_set_moe_grouped(p->gpu, 0);
    moe_gpu(p, &m, x, dsel, dw, n_used, 0.7f, y, n_rows); /* outside a step, per slot */
    op_expect_ok(p);
    ds4_backend_counters c[4];
    for (int on = 0; on < 2; on++) {
        ds4_cuda_backend_set_moe_grouped(p->gpu, on);
        for (int rep = 0; rep < 2; rep++) { /* counted the second time (the first may grow scratch) */
            c[2 * on] = op_gpu_counters(p);
            p->gpu->ops->step_begin(p->gpu);
            moe_gpu(p, &m, x, dsel, dw, n_used, 0.7f, on ? y_on : y_off, n_rows);
            p->gpu->ops->step_end(p->gpu);
            c[2 * on + 1] = op_gpu_counters(p);
            op_expect_ok(p);
        }
    }
    default_moe_grouped(p);
    /* steps are recorded unless graphs or kernel timing say otherwise */
    const bool recorded = env_on("DS4_CUDA_GRAPH") && !env_on_default("DS4_CUDA_PROFILE", false);
    if (recorded) {
        CHECK_MSG(c[3].graphs > c[2].graphs && c[1].graphs > c[0].graphs && c[3].step_breaks == c[2].step_breaks,
                  "%s: the steps did not run as whole graphs", what);
    }
    if (recorded && launch_counts_apply()) {
        CHECK_MSG(c[3].syncs - c[2].syncs == c[1].syncs - c[0].syncs, "%s: %llu waits grouped, %llu per slot", what,
                  (unsigned long long)(c[3].syncs - c[2].syncs), (unsigned long long)(c[1].syncs - c[0].syncs));
        CHECK_MSG(c[3].launches - c[2].launches > c[1].launches - c[0].launches,
                  "%s: %llu launches grouped, %llu per slot (not grouped on the device?)", what,
                  (unsigned long long)(c[3].launches - c[2].launches), (unsigned long long)(c[1].launches - c[0].launches));
    }
    expect_same_rows(p, what, y_off.g, y.g, n_rows, dim, dim);
    expect_same_rows(p, what, y_on.g, y.g, n_rows, dim, dim);
    op_buf_free(p, &y);
    op_buf_free(p, &y_off);
    op_buf_free(p, &y_on);
    moe_fix_free(p, &f);
}

static void test_moe_grouped(void) {
    OPEN_PAIR(p);
    const uint32_t IQ2 = DS4_TYPE_IQ2_XXS, Q2 = DS4_TYPE_Q2_K, Q4 = DS4_TYPE_Q4_K, Q8 = DS4_TYPE_Q8_0;
    moe_grouped_case(&p, IQ2, Q2, 2048, 1024, 12, 6, 2, true);
    moe_grouped_case(&p, IQ2, Q2, 2048, 1024, 12, 6, 17, true);
    moe_grouped_case(&p, IQ2, Q2, 2048, 1024, 8, 6, 40, true); /* experts with more than 8 tokens */
    moe_grouped_case(&p, Q4, Q4, 2048, 1024, 12, 6, 9, true);
    /* few outputs: the rows split over warps as the streaming launch splits them */
    moe_grouped_case(&p, Q4, Q4, 1024, 1024, 2, 2, 2, true);
    moe_grouped_case(&p, IQ2, Q2, 2048, 1024, 12, 6, 1, false); /* one token: the streaming path */
    moe_grouped_case(&p, Q8, Q8, 2048, 1024, 12, 6, 9, false);  /* Q8_0 activations: not grouped */
    /* recorded steps: grouped on the device; 40 tokens over 8 experts split experts past 8 rows */
    moe_step_case(&p, IQ2, Q2, 2048, 1024, 12, 6, 17, 8);
    moe_step_case(&p, IQ2, Q2, 2048, 1024, 8, 6, 40, 8);
    moe_step_case(&p, IQ2, Q2, 2048, 1024, 8, 6, 40, 2);
    moe_step_case(&p, IQ2, Q2, 2048, 1024, 12, 6, 24, 1);
    moe_step_case(&p, Q4, Q4, 1024, 1024, 64, 6, 32, 4);
    default_moe_grouped(&p);
    op_pair_close(&p);
}

/* The grouped MoE on the int8 tensor cores against the CPU (the same
 * bounds as the streaming path's): every weight type they take, gate/up
 * and down of different types, experts with more tokens than a group's 32
 * (and token tiles partly filled), rows of one and of several 256-blocks. */
static void test_moe_mma(void) {
    OPEN_PAIR(p);
    const uint32_t IQ2 = DS4_TYPE_IQ2_XXS, Q2 = DS4_TYPE_Q2_K, Q4 = DS4_TYPE_Q4_K;
    const uint32_t types[4][2] = { { IQ2, IQ2 }, { Q2, Q2 }, { Q4, Q4 }, { IQ2, Q2 } };
    for (int i = 0; i < 4; i++) {
        const uint32_t tg = types[i][0], td = types[i][1];
        moe_case_on(&p, tg, td, 256, 256, 8, 2, 0.7f, 3, true); /* one 256-block per row (rows off the 16-byte pitch) */
        moe_case_on(&p, tg, td, 512, 768, 8, 6, 0.0f, 4, true);
        moe_case_on(&p, tg, td, 1024, 1024, 8, 6, 0.7f, 2, true);
        moe_case_on(&p, tg, td, 1024, 2048, 16, 6, 0.0f, 7, true);
        moe_case_on(&p, tg, td, 1024, 1024, 8, 6, 0.7f, 45, true); /* about 34 tokens per expert */
        moe_case_on(&p, tg, td, 2048, 1024, 12, 8, 0.7f, 5, true);
        moe_case_on(&p, tg, td, 512, 512, 8, 6, 0.7f, 100, true); /* about 75: groups of 64 and the rest */
    }
    moe_case_on(&p, IQ2, Q2, 1024, 1024, 8, 6, 0.7f, 1, true); /* one token: not grouped */
    /* the kernel of eight token tiles held to the other register budget (set_moe_mma_blocks: 1 block's
     * registers an SM, or 3 where DS4_CUDA_MOE_MMA_BLOCKS=1 made 1 the default), then the default again */
    const int mb_dflt = ds4_cuda_backend_moe_mma_blocks(p.gpu);
    ds4_cuda_backend_set_moe_mma_blocks(p.gpu, mb_dflt == 1 ? 3 : 1);
    for (int i = 0; i < 4; i++) {
        moe_case_on(&p, types[i][0], types[i][1], 1024, 1024, 8, 6, 0.7f, 45, true);
        moe_case_on(&p, types[i][0], types[i][1], 512, 512, 8, 6, 0.7f, 100, true);
    }
    ds4_cuda_backend_set_moe_mma_blocks(p.gpu, mb_dflt);
    op_pair_close(&p);
}

/* The tensor-core MoE with groups of up to 32 tokens (four token tiles a
 * block) and of up to 64 (eight, on twice the warps) gives the same outputs
 * bit for bit: every product is the CPU's block terms in its order either
 * way. Token counts that fill the groups of 32 exactly, spill past them,
 * fill a 64-group partly, and pass 64. */
static void moe_rows_case(op_pair *p, uint32_t tg, uint32_t td, int64_t dim, int64_t n_ff, int64_t n_expert,
                          int n_used, int64_t n_rows, bool wide) {
    moe_weights m = moe_make(p, tg, td, dim, n_ff, n_expert);
    int32_t *sel = malloc((size_t)(n_rows * n_used) * sizeof *sel);
    float *wts = malloc((size_t)(n_rows * n_used) * sizeof *wts);
    for (int64_t r = 0; r < n_rows; r++) moe_route(n_expert, n_used, sel + r * n_used, wts + r * n_used);
    float *hx = op_rand(n_rows * dim, 1.0);
    op_buf x = op_buf_from(p, hx, n_rows * dim);
    op_buf dsel = op_ints_from(p, sel, n_rows * n_used), dw = op_buf_from(p, wts, n_rows * n_used);
    op_buf y[2] = { op_buf_poisoned(p, n_rows * dim), op_buf_poisoned(p, n_rows * dim) };
    ds4_cuda_backend_set_moe_grouped(p->gpu, 1);
    ds4_cuda_backend_set_moe_mma(p->gpu, 1);
    char what[160];
    snprintf(what, sizeof what, "moe %s/%s dim %lld n_ff %lld, %d of %lld experts, %lld rows: %s",
             ds4_type_name(tg), ds4_type_name(td), (long long)dim, (long long)n_ff, n_used, (long long)n_expert,
             (long long)n_rows, wide ? "the quantisers' block and warp forms" : "groups of 32 and 64");
    for (int i = 0; i < 2; i++) {
        if (wide) ds4_cuda_backend_set_wide_rows(p->gpu, i);
        else ds4_cuda_backend_set_moe_mma_rows(p->gpu, i ? 64 : 32);
        const int64_t mma0 = ds4_cuda_backend_moe_mma_calls(p->gpu);
        p->gpu->ops->moe(p->gpu, &m.gate->g, &m.up->g, &m.down->g, x.g, (const int32_t *)dsel.g, dw.g, n_used, 0.7f,
                         y[i].g, n_rows, DS4_NUMERICS_DS4);
        op_expect_ok(p);
        CHECK_MSG(ds4_cuda_backend_moe_mma_calls(p->gpu) - mma0 == 1, "%s: not on the tensor cores", what);
    }
    float *h[2];
    for (int i = 0; i < 2; i++) {
        h[i] = malloc((size_t)(n_rows * dim) * sizeof *h[i]);
        p->gpu->ops->download(p->gpu, h[i], y[i].g, n_rows * dim);
    }
    op_expect_ok(p);
    int64_t differ = 0, nonfinite = 0;
    for (int64_t o = 0; o < n_rows * dim; o++) {
        differ += memcmp(&h[0][o], &h[1][o], sizeof(float)) != 0;
        nonfinite += !isfinite(h[1][o]);
    }
    CHECK_MSG(differ == 0 && nonfinite == 0, "%s: %lld outputs differ, %lld not finite", what, (long long)differ,
              (long long)nonfinite);
    for (int i = 0; i < 2; i++) {
        free(h[i]);
        op_buf_free(p, &y[i]);
    }
    op_buf_free(p, &dsel);
    op_buf_free(p, &dw);
    op_buf_free(p, &x);
    free(hx);
    free(sel);
    free(wts);
    moe_free(p, &m);
    default_moe_grouped(p);
    ds4_cuda_backend_set_wide_rows(p->gpu, env_on("DS4_CUDA_WIDE_ROWS"));
}

static void test_moe_mma_rows(void) {
    OPEN_PAIR(p);
    const uint32_t IQ2 = DS4_TYPE_IQ2_XXS, Q2 = DS4_TYPE_Q2_K, Q4 = DS4_TYPE_Q4_K;
    moe_rows_case(&p, IQ2, Q2, 1024, 512, 4, 2, 64, false);   /* 32 per expert on average */
    moe_rows_case(&p, IQ2, Q2, 1024, 512, 8, 6, 60, false);   /* about 45 */
    moe_rows_case(&p, IQ2, IQ2, 512, 1024, 8, 6, 120, false); /* about 90: past 64 */
    moe_rows_case(&p, Q2, Q2, 768, 512, 8, 6, 70, false);
    moe_rows_case(&p, Q4, Q4, 512, 768, 8, 6, 50, false);
    op_pair_close(&p);
}

/* The Q8_K quantisers of the MoE's inputs and mids (the SwiGLU's) with a
 * warp per block (ds4_cuda_backend_set_wide_rows 1) against a block per
 * block (0): the same outputs bit for bit. */
static void test_moe_wide_rows(void) {
    OPEN_PAIR(p);
    moe_rows_case(&p, DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, 1024, 512, 8, 6, 60, true);
    moe_rows_case(&p, DS4_TYPE_Q4_K, DS4_TYPE_Q4_K, 512, 768, 8, 6, 9, true);
    op_pair_close(&p);
}

static void test_moe_errors(void) {
    OPEN_PAIR(p);
    const int64_t dim = 512, n_ff = 256, n_expert = 4;
    moe_weights m = moe_make(&p, DS4_TYPE_Q4_K, DS4_TYPE_Q4_K, dim, n_ff, n_expert);
    float *hx = op_rand(dim, 1.0);
    op_buf x = op_buf_from(&p, hx, dim);
    op_buf y = op_buf_poisoned(&p, dim);
    const ds4_backend_ops *g = p.gpu->ops;
    const int32_t hsel[6] = { 0, 1, 2, 3, 1, 0 };
    const float hw[6] = { 0.5f, 0.25f, 0.125f, 0.5f, 0.25f, 0.125f };
    op_buf dsel = op_ints_from(&p, hsel, 6), dw = op_buf_from(&p, hw, 6);
    const int32_t *sel = (const int32_t *)dsel.g;
    const float *wts = dw.g;
    for (int ni = 0; ni < 2; ni++) {
        const ds4_numerics num = ni ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
        /* shapes that do not fit together: up used as down */
        g->moe(p.gpu, &m.gate->g, &m.up->g, &m.up->g, x.g, sel, wts, 6, 0.0f, y.g, 1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        /* unbound */
        ds4_weight unbound = m.down->g;
        unbound.device = NULL;
        g->moe(p.gpu, &m.gate->g, &m.up->g, &unbound, x.g, sel, wts, 6, 0.0f, y.g, 1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        /* unsupported type */
        ds4_weight bad = m.up->g;
        bad.type = DS4_TYPE_Q3_K;
        g->moe(p.gpu, &m.gate->g, &bad, &m.down->g, x.g, sel, wts, 6, 0.0f, y.g, 1, num);
        op_expect_error(&p, DS4_ERR_UNSUPPORTED);
        /* no routing arrays */
        g->moe(p.gpu, &m.gate->g, &m.up->g, &m.down->g, x.g, NULL, wts, 6, 0.0f, y.g, 1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
        /* a negative row count */
        g->moe(p.gpu, &m.gate->g, &m.up->g, &m.down->g, x.g, sel, wts, 6, 0.0f, y.g, -1, num);
        op_expect_error(&p, DS4_ERR_INVALID);
    }
    {
        float hy[512];
        g->download(p.gpu, hy, y.g, dim);
        int written = 0;
        for (int i = 0; i < dim; i++) written += !isnan(hy[i]);
        CHECK_EQ_INT(written, 0);
    }
    /* zero rows: nothing written */
    moe_both(&p, &m, x, dsel, dw, 6, y, 0, DS4_NUMERICS_DS4);
    op_expect_ok(&p);
    {
        float hy[512];
        g->download(p.gpu, hy, y.g, dim);
        int written = 0;
        for (int i = 0; i < dim; i++) written += !isnan(hy[i]);
        CHECK_EQ_INT(written, 0);
    }
    /* n_used == 0: zeros on both sides */
    moe_both(&p, &m, x, dsel, dw, 0, y, 1, DS4_NUMERICS_DS4);
    op_expect_ok(&p);
    CHECK_EQ_INT(op_compare("moe n_used 0", &p, y, dim, 0.0, 0.0), 0);
    /* and a valid call after the errors; repeated experts are allowed */
    op_buf_free(&p, &y);
    y = op_buf_poisoned(&p, dim);
    moe_both(&p, &m, x, dsel, dw, 6, y, 1, DS4_NUMERICS_DS4);
    op_expect_ok(&p);
    moe_expect_close("moe after errors", &p, y, dim);
    op_buf_free(&p, &y);
    op_buf_free(&p, &dsel);
    op_buf_free(&p, &dw);
    op_buf_free(&p, &x);
    free(hx);
    moe_free(&p, &m);
    op_pair_close(&p);
}

/* Expert ids out of range in device memory (as a faulty router would leave
 * them): the kernel finds them, leaves those experts out and take_error
 * reports the first, naming the op, the id, the range and the gate weight
 * (the CPU's message for the same id); no kernel reads past the weights
 * (compute-sanitizer in scripts/gpu-check.sh), and the backend computes
 * correctly afterwards. */
static void test_moe_bad_expert(void) {
    OPEN_PAIR(p);
    const int64_t dim = 512, n_ff = 256, n_expert = 4;
    moe_weights m = moe_make(&p, DS4_TYPE_Q4_K, DS4_TYPE_Q4_K, dim, n_ff, n_expert);
    float *hx = op_rand(dim, 1.0);
    op_buf x = op_buf_from(&p, hx, dim);
    op_buf y = op_buf_poisoned(&p, dim);
    const float hw[6] = { 0.5f, 0.25f, 0.125f, 0.5f, 0.25f, 0.125f };
    op_buf dw = op_buf_from(&p, hw, 6);
    const struct {
        int32_t sel[6];
        const char *expert;
    } bad[] = {
        { { 0, 1, 4, 3, 1, 0 }, "expert 4 " },                   /* one past the last */
        { { 0, 1, 2, 3, -1, 0 }, "expert -1 " },                 /* negative */
        { { INT32_MIN, 1, 2, 3, 1, 0 }, "expert -2147483648 " }, /* far out */
    };
    /* one token in DS4 numerics: the ids read by the products themselves
     * (direct, the default) or checked by a kernel first; the same message */
    const size_t n_bad = sizeof bad / sizeof bad[0];
    for (size_t i = 0; i < 2 * n_bad; i++) {
        ds4_cuda_backend_set_moe_ids(p.gpu, i < n_bad);
        for (int ni = 0; ni < 2; ni++) {
            const ds4_numerics num = ni ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
            op_buf dsel = op_ints_from(&p, bad[i % n_bad].sel, 6);
            moe_both(&p, &m, x, dsel, dw, 6, y, 1, num);
            ds4_error ec = { 0 }, eg = { 0 };
            CHECK(p.cpu->ops->take_error(p.cpu, &ec) == DS4_ERR_INVALID);
            CHECK_MSG(p.gpu->ops->take_error(p.gpu, &eg) == DS4_ERR_INVALID, "moe bad expert %zu: %s", i, eg.message);
            CHECK_MSG(strcmp(ec.message, eg.message) == 0, "messages differ: cpu \"%s\" cuda \"%s\"", ec.message,
                      eg.message);
            CHECK_MSG(strstr(eg.message, "moe") && strstr(eg.message, bad[i % n_bad].expert) && strstr(eg.message, "[0, 4)") &&
                      strstr(eg.message, "blk.3.ffn_gate_exps.weight"), "%s", eg.message);
            op_expect_ok(&p); /* taken and cleared */
            op_buf_free(&p, &dsel);
        }
    }
    ds4_cuda_backend_set_moe_ids(p.gpu, env_on("DS4_CUDA_MOE_IDS"));
    /* two bad calls before take_error: the first is reported */
    {
        op_buf s1 = op_ints_from(&p, bad[0].sel, 6), s2 = op_ints_from(&p, bad[1].sel, 6);
        p.gpu->ops->moe(p.gpu, &m.gate->g, &m.up->g, &m.down->g, x.g, (const int32_t *)s1.g, dw.g, 6, 0.0f, y.g, 1,
                        DS4_NUMERICS_DS4);
        p.gpu->ops->moe(p.gpu, &m.gate->g, &m.up->g, &m.down->g, x.g, (const int32_t *)s2.g, dw.g, 6, 0.0f, y.g, 1,
                        DS4_NUMERICS_DS4);
        op_expect_error_with(&p, "first of two bad ids", "moe", "expert 4 ", "[0, 4)", NULL);
        op_buf_free(&p, &s1);
        op_buf_free(&p, &s2);
    }
    /* a bad id in the last of 3 rows (the other rows valid): the same
     * message on both sides */
    {
        float *hx3 = op_rand(3 * dim, 1.0);
        float hw3[18];
        int32_t sel3[18];
        for (int k = 0; k < 18; k++) sel3[k] = k % 4, hw3[k] = 0.25f;
        sel3[14] = 4;
        op_buf x3 = op_buf_from(&p, hx3, 3 * dim), s3 = op_ints_from(&p, sel3, 18), w3 = op_buf_from(&p, hw3, 18);
        op_buf y3 = op_buf_poisoned(&p, 3 * dim);
        moe_both(&p, &m, x3, s3, w3, 6, y3, 3, DS4_NUMERICS_DS4);
        ds4_error ec = { 0 }, eg = { 0 };
        CHECK(p.cpu->ops->take_error(p.cpu, &ec) == DS4_ERR_INVALID);
        CHECK_MSG(p.gpu->ops->take_error(p.gpu, &eg) == DS4_ERR_INVALID, "moe bad expert in row 2: %s", eg.message);
        CHECK_MSG(strcmp(ec.message, eg.message) == 0, "messages differ: cpu \"%s\" cuda \"%s\"", ec.message,
                  eg.message);
        CHECK_MSG(strstr(eg.message, "expert 4 ") && strstr(eg.message, "[0, 4)"), "%s", eg.message);
        op_expect_ok(&p);
        op_buf_free(&p, &x3);
        op_buf_free(&p, &s3);
        op_buf_free(&p, &w3);
        op_buf_free(&p, &y3);
        free(hx3);
    }
    /* a valid call afterwards gives the CPU's result */
    const int32_t good[6] = { 3, 1, 2, 0, 1, 3 };
    op_buf dsel = op_ints_from(&p, good, 6);
    op_buf_free(&p, &y);
    y = op_buf_poisoned(&p, dim);
    moe_both(&p, &m, x, dsel, dw, 6, y, 1, DS4_NUMERICS_DS4);
    op_expect_ok(&p);
    moe_expect_close("moe after bad expert ids", &p, y, dim);
    op_buf_free(&p, &dsel);
    op_buf_free(&p, &dw);
    op_buf_free(&p, &y);
    op_buf_free(&p, &x);
    free(hx);
    moe_free(&p, &m);
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* matmul_multi                                                              */
/* ------------------------------------------------------------------------ */

/*
 * Products of one input x [n_rows, n_in] (x_stride apart): weights of the
 * given types and output counts (outputs `pad` floats wider than the
 * data). On the CPU the op must equal separate matmul calls bit for bit;
 * on CUDA each product is held to its own matmul tolerances (the launches
 * that join products of one type choose their own split), and to equality
 * where exact (rows of one block).
 */
static void multi_case(op_pair *p, const uint32_t *types, const int64_t *n_outs, int n, int64_t n_in, int64_t n_rows,
                       int64_t x_stride, int64_t pad, bool exact) {
    CHECK(n >= 1 && n <= DS4_PRODUCTS_MAX);
    op_weight *w[DS4_PRODUCTS_MAX];
    uint8_t *bytes[DS4_PRODUCTS_MAX];
    float *deq[DS4_PRODUCTS_MAX];
    for (int j = 0; j < n; j++) {
        bytes[j] = weight_bytes(types[j], n_in, n_outs[j] + 2, false, &deq[j]);
        char name[64];
        snprintf(name, sizeof name, "blk.0.multi_%d.weight", j);
        w[j] = op_weight_make(p, name, types[j], n_in, n_outs[j] + 2, 1, bytes[j]);
    }
    const int64_t nx = n_rows > 0 ? (n_rows - 1) * x_stride + n_in : 1;
    float *hx = op_rand(nx, x_amp);
    op_buf x = op_buf_from(p, hx, nx);
    for (int ni = 0; ni < 2; ni++) {
        const ds4_numerics num = ni ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
        if (exact && num == DS4_NUMERICS_REFERENCE) continue;
        op_buf y[DS4_PRODUCTS_MAX], ysep[DS4_PRODUCTS_MAX];
        ds4_product pc[DS4_PRODUCTS_MAX], pg[DS4_PRODUCTS_MAX];
        for (int j = 0; j < n; j++) {
            const int64_t ny = n_rows * (n_outs[j] + pad) > 0 ? n_rows * (n_outs[j] + pad) : 1;
            y[j] = op_buf_poisoned(p, ny);
            ysep[j] = op_buf_poisoned(p, ny);
            pc[j] = (ds4_product){ &w[j]->c, n_outs[j], y[j].c, n_outs[j] + pad, NULL, 0 };
            pg[j] = (ds4_product){ &w[j]->g, n_outs[j], y[j].g, n_outs[j] + pad, NULL, 0 };
        }
        p->cpu->ops->matmul_multi(p->cpu, pc, n, x.c, x_stride, n_rows, num);
        p->gpu->ops->matmul_multi(p->gpu, pg, n, x.g, x_stride, n_rows, num);
        for (int j = 0; j < n; j++)
            p->cpu->ops->matmul(p->cpu, &w[j]->c, 0, n_outs[j], x.c, x_stride, ysep[j].c, n_outs[j] + pad, n_rows, num);
        op_expect_ok(p);
        for (int j = 0; j < n; j++) {
            char what[200];
            snprintf(what, sizeof what, "matmul_multi %s product %d of %d (%s, %lld -> %lld) x %lld rows (stride %lld)%s",
                     num_name(num), j, n, ds4_type_name(types[j]), (long long)n_in, (long long)n_outs[j],
                     (long long)n_rows, (long long)x_stride, exact ? " bit-exact" : "");
            const int64_t ny = n_rows * (n_outs[j] + pad) > 0 ? n_rows * (n_outs[j] + pad) : 1;
            float *a = malloc((size_t)ny * sizeof *a), *b = malloc((size_t)ny * sizeof *b);
            p->cpu->ops->download(p->cpu, a, y[j].c, ny);
            p->cpu->ops->download(p->cpu, b, ysep[j].c, ny);
            CHECK_MSG(memcmp(a, b, (size_t)ny * sizeof *a) == 0, "%s: the CPU's op differs from its matmul calls",
                      what);
            free(a);
            free(b);
            if (n_outs[j] > 0) {
                double *tol =
                    matmul_tolerances(types[j], num, bytes[j], deq[j], n_in, 0, n_outs[j], hx, x_stride, n_rows);
                compare_out(what, p, y[j], n_rows, n_outs[j], n_outs[j] + pad, tol,
                            num == DS4_NUMERICS_REFERENCE ? 2.5e-7 : 0.0, exact);
                free(tol);
            } else { /* no outputs: nothing written */
                float g0 = 0.0f;
                p->gpu->ops->download(p->gpu, &g0, y[j].g, 1);
                CHECK_MSG(isnan(g0), "%s: written", what);
            }
            op_buf_free(p, &y[j]);
            op_buf_free(p, &ysep[j]);
        }
    }
    op_buf_free(p, &x);
    free(hx);
    for (int j = 0; j < n; j++) {
        op_weight_free(p, w[j]);
        free(bytes[j]);
        free(deq[j]);
    }
}

/*
 * matmul_multi's added rows (ds4_product.add: the compressors' APE rows of
 * a decoded token): the attention input's seven products with the two
 * gate products adding an F16 row, kv an F32 row and q_a a Q8_0 row (no
 * float row: added by the add_weight_row op after the product), for 1 and
 * 3 rows (the streaming kernels, where a float row is added in the
 * kernel's last step: three add_row launches fewer than the products and
 * the add_weight_row calls; the 3 rows' outputs 3 floats wider than the
 * data, added row by row) and 11 (product by product). The outputs equal
 * the products without rows followed by add_weight_row, bit for bit. A row
 * of the wrong width, or of an unbound weight, is an error.
 */
static void test_matmul_multi_add(void) {
    OPEN_PAIR(p);
    enum { NP = 7 };
    const int64_t n_in = 4096;
    const uint32_t types[NP] = { DS4_TYPE_Q8_0, DS4_TYPE_Q8_0, DS4_TYPE_F16, DS4_TYPE_F16,
                                 DS4_TYPE_F16, DS4_TYPE_F16, DS4_TYPE_F16 };
    const int64_t n_outs[NP] = { 1024, 512, 1024, 1024, 256, 256, 64 };
    /* the rows to add: product j adds row add_rows[j] of adds[j] (-1: none) */
    const uint32_t add_types[NP] = { DS4_TYPE_Q8_0, DS4_TYPE_F32, 0, DS4_TYPE_F16, 0, DS4_TYPE_F16, 0 };
    const int64_t add_rows[NP] = { 1, 0, -1, 3, -1, 2, -1 };
    op_weight *w[NP], *adds[NP] = { NULL };
    uint8_t *bytes[NP], *abytes[NP] = { NULL };
    float *deq[NP], *adeq[NP] = { NULL };
    int in_kernel = 0; /* float rows */
    static const char *const names[NP] = { "blk.0.multi_add_0.weight", "blk.0.multi_add_1.weight",
                                           "blk.0.multi_add_2.weight", "blk.0.multi_add_3.weight",
                                           "blk.0.multi_add_4.weight", "blk.0.multi_add_5.weight",
                                           "blk.0.multi_add_6.weight" };
    static const char *const ape_names[NP] = { "blk.0.multi_add_0_ape.weight", "blk.0.multi_add_1_ape.weight", NULL,
                                               "blk.0.multi_add_3_ape.weight", NULL, "blk.0.multi_add_5_ape.weight",
                                               NULL }; /* (weights keep their name's pointer) */
    for (int j = 0; j < NP; j++) {
        bytes[j] = weight_bytes(types[j], n_in, n_outs[j], false, &deq[j]);
        w[j] = op_weight_make(&p, names[j], types[j], n_in, n_outs[j], 1, bytes[j]);
        if (add_rows[j] < 0) continue;
        abytes[j] = weight_bytes(add_types[j], n_outs[j], 4, false, &adeq[j]);
        adds[j] = op_weight_make(&p, ape_names[j], add_types[j], n_outs[j], 4, 1, abytes[j]);
        in_kernel += add_types[j] != DS4_TYPE_Q8_0;
    }
    static const int64_t ROWS[] = { 1, 3, 11 };
    for (size_t ri = 0; ri < 3; ri++) {
        const int64_t n_rows = ROWS[ri], pad = n_rows == 3 ? 3 : 0; /* (3 rows: output rows 3 floats apart more) */
        float *hx = op_rand(n_rows * n_in, x_amp);
        op_buf x = op_buf_from(&p, hx, n_rows * n_in), y[NP], ysep[NP];
        ds4_product pf[NP], ps[NP];
        for (int j = 0; j < NP; j++) {
            y[j] = op_buf_poisoned(&p, n_rows * (n_outs[j] + pad));
            ysep[j] = op_buf_poisoned(&p, n_rows * (n_outs[j] + pad));
            pf[j] = (ds4_product){ &w[j]->g, n_outs[j], y[j].g, n_outs[j] + pad, adds[j] ? &adds[j]->g : NULL,
                                   adds[j] ? add_rows[j] : 0 };
            ps[j] = (ds4_product){ &w[j]->g, n_outs[j], ysep[j].g, n_outs[j] + pad, NULL, 0 };
        }
        /* (each way once before it is counted: scratch grows the first time) */
        for (int rep = 0; rep < 2; rep++) {
            const ds4_backend_counters c0 = op_gpu_counters(&p);
            p.gpu->ops->matmul_multi(p.gpu, ps, NP, x.g, n_in, n_rows, DS4_NUMERICS_DS4);
            for (int j = 0; j < NP; j++) {
                if (!adds[j]) continue;
                if (!pad) p.gpu->ops->add_weight_row(p.gpu, ysep[j].g, &adds[j]->g, add_rows[j], n_rows);
                for (int64_t r = 0; pad && r < n_rows; r++) /* row by row where the rows are apart */
                    p.gpu->ops->add_weight_row(p.gpu, ysep[j].g + r * (n_outs[j] + pad), &adds[j]->g, add_rows[j], 1);
            }
            const ds4_backend_counters c1 = op_gpu_counters(&p);
            p.gpu->ops->matmul_multi(p.gpu, pf, NP, x.g, n_in, n_rows, DS4_NUMERICS_DS4);
            const ds4_backend_counters c2 = op_gpu_counters(&p);
            op_expect_ok(&p);
            const uint64_t sep = c1.launches - c0.launches, fused = c2.launches - c1.launches;
            const uint64_t saved = (uint64_t)in_kernel * (pad ? (uint64_t)n_rows : 1u); /* add_row_kernel launches */
            const uint64_t want = n_rows <= 8 && env_on("DS4_CUDA_MV_ADD") ? sep - saved : sep;
            if (rep == 1)
                CHECK_MSG(!launch_counts_apply() || fused == want,
                          "matmul_multi with rows to add, %lld rows: %llu launches (the products, then the rows: "
                          "%llu; want %llu)", (long long)n_rows, (unsigned long long)fused, (unsigned long long)sep,
                          (unsigned long long)want);
        }
        for (int j = 0; j < NP; j++) {
            char what[160];
            snprintf(what, sizeof what, "matmul_multi product %d (%s -> %lld) adding %s row %lld, %lld rows", j,
                     ds4_type_name(types[j]), (long long)n_outs[j],
                     adds[j] ? ds4_type_name(add_types[j]) : "no", (long long)add_rows[j], (long long)n_rows);
            expect_same_rows(&p, what, y[j].g, ysep[j].g, n_rows, n_outs[j], n_outs[j] + pad);
            op_buf_free(&p, &y[j]);
            op_buf_free(&p, &ysep[j]);
        }
        /* a row of another width: an error, nothing written */
        if (ri == 0) {
            op_buf yb = op_buf_poisoned(&p, n_outs[2]);
            ds4_product bad = { &w[2]->g, n_outs[2], yb.g, n_outs[2], &adds[5]->g, 0 };
            p.gpu->ops->matmul_multi(p.gpu, &bad, 1, x.g, n_in, 1, DS4_NUMERICS_DS4);
            op_expect_error_with(&p, "matmul_multi adding a row of 256 to 1024 outputs", "matmul_multi", "adds row",
                                 "multi_add_5_ape", NULL);
            ds4_weight unbound = adds[3]->g; /* (1024 wide, for product 2) */
            unbound.device = NULL;
            bad.add = &unbound;
            p.gpu->ops->matmul_multi(p.gpu, &bad, 1, x.g, n_in, 1, DS4_NUMERICS_DS4);
            op_expect_error_with(&p, "matmul_multi adding a row of an unbound weight", "matmul_multi",
                                 "multi_add_3_ape", "not bound", NULL);
            float g0 = 0.0f;
            p.gpu->ops->download(p.gpu, &g0, yb.g, 1);
            CHECK_MSG(isnan(g0), "matmul_multi adding a row of another width: written");
            op_buf_free(&p, &yb);
        }
        op_buf_free(&p, &x);
        free(hx);
    }
    for (int j = 0; j < NP; j++) {
        op_weight_free(&p, w[j]);
        free(bytes[j]);
        free(deq[j]);
        if (adds[j]) op_weight_free(&p, adds[j]);
        free(abytes[j]);
        free(adeq[j]);
    }
    op_pair_close(&p);
}

/* The model's two calls (the attention input's seven products: two Q8_0
 * and five F16 of three sizes; the FFN input's router and shared expert),
 * for 1, 3 and 8 rows (one launch per type) and 11 rows (product by
 * product); mixed types with a product of no outputs; eight products of one
 * type (one launch of eight matrices). */
static void test_matmul_multi(void) {
    OPEN_PAIR(p);
    const uint32_t attn_t[] = { DS4_TYPE_Q8_0, DS4_TYPE_Q8_0, DS4_TYPE_F16, DS4_TYPE_F16,
                                DS4_TYPE_F16, DS4_TYPE_F16, DS4_TYPE_F16 };
    const int64_t attn_o[] = { 1024, 512, 1024, 1024, 256, 256, 64 };
    const uint32_t ffn_t[] = { DS4_TYPE_F16, DS4_TYPE_Q8_0, DS4_TYPE_Q8_0 };
    const int64_t ffn_o[] = { 256, 2048, 2048 };
    static const int64_t ROWS[] = { 1, 3, 8, 11 };
    for (size_t ri = 0; ri < 4; ri++) {
        multi_case(&p, attn_t, attn_o, 7, 4096, ROWS[ri], 4096, 0, false);
        multi_case(&p, ffn_t, ffn_o, 3, 4096, ROWS[ri], 4096 + 8, 3, false);
    }
    const uint32_t mixed_t[] = { DS4_TYPE_Q2_K, DS4_TYPE_F32, DS4_TYPE_Q8_0, DS4_TYPE_Q2_K, DS4_TYPE_BF16 };
    const int64_t mixed_o[] = { 300, 77, 0, 129, 5 };
    multi_case(&p, mixed_t, mixed_o, 5, 512, 1, 512, 0, false);
    multi_case(&p, mixed_t, mixed_o, 5, 512, 2, 520, 1, false);
    uint32_t eight_t[8];
    int64_t eight_o[8];
    for (int j = 0; j < 8; j++) eight_t[j] = DS4_TYPE_Q8_0, eight_o[j] = 40 + 97 * j;
    multi_case(&p, eight_t, eight_o, 8, 1024, 1, 1024, 0, false);
    multi_case(&p, eight_t, eight_o, 8, 1024, 5, 1024, 2, false);
    op_pair_close(&p);
}

/* Bad arguments record an error (naming the weight where there is one) and
 * write nothing; a valid call afterwards is correct. */
static void test_matmul_multi_errors(void) {
    OPEN_PAIR(p);
    float *deq = NULL, *deq2 = NULL;
    uint8_t *bytes = weight_bytes(DS4_TYPE_Q8_0, 64, 16, true, &deq);
    uint8_t *bytes2 = weight_bytes(DS4_TYPE_Q8_0, 96, 16, true, &deq2);
    op_weight *w = op_weight_make(&p, "blk.0.multi_err.weight", DS4_TYPE_Q8_0, 64, 16, 1, bytes);
    op_weight *w96 = op_weight_make(&p, "blk.0.multi_96.weight", DS4_TYPE_Q8_0, 96, 16, 1, bytes2);
    float *hx = op_rand(4 * 64, 1.0);
    op_buf x = op_buf_from(&p, hx, 4 * 64);
    op_buf y = op_buf_poisoned(&p, 4 * 16), y2 = op_buf_poisoned(&p, 4 * 16);
    for (int side = 0; side < 2; side++) {
        ds4_backend *be = side ? p.gpu : p.cpu;
        const ds4_weight *wv = side ? &w->g : &w->c, *w96v = side ? &w96->g : &w96->c;
        float *yv = side ? y.g : y.c, *y2v = side ? y2.g : y2.c;
        const float *xv = side ? x.g : x.c;
        ds4_product ok[2] = { { wv, 16, yv, 16, NULL, 0 }, { wv, 8, y2v, 16, NULL, 0 } };
        ds4_product bad[2];
        ds4_error e = { 0 };
        be->ops->matmul_multi(be, ok, 0, xv, 64, 1, DS4_NUMERICS_DS4); /* no products */
        CHECK_EQ_INT(be->ops->take_error(be, &e), DS4_ERR_INVALID);
        be->ops->matmul_multi(be, ok, DS4_PRODUCTS_MAX + 1, xv, 64, 1, DS4_NUMERICS_DS4);
        CHECK_EQ_INT(be->ops->take_error(be, &e), DS4_ERR_INVALID);
        memcpy(bad, ok, sizeof bad);
        bad[1].w = w96v; /* another row length */
        be->ops->matmul_multi(be, bad, 2, xv, 64, 1, DS4_NUMERICS_DS4);
        CHECK_EQ_INT(be->ops->take_error(be, &e), DS4_ERR_INVALID);
        CHECK_MSG(strstr(e.message, "blk.0.multi_96.weight") != NULL, "%s", e.message);
        memcpy(bad, ok, sizeof bad);
        bad[1].n_out = 17; /* beyond the weight's rows */
        be->ops->matmul_multi(be, bad, 2, xv, 64, 1, DS4_NUMERICS_DS4);
        CHECK_EQ_INT(be->ops->take_error(be, &e), DS4_ERR_INVALID);
        memcpy(bad, ok, sizeof bad);
        bad[0].out = NULL;
        be->ops->matmul_multi(be, bad, 2, xv, 64, 1, DS4_NUMERICS_DS4);
        CHECK_EQ_INT(be->ops->take_error(be, &e), DS4_ERR_INVALID);
        memcpy(bad, ok, sizeof bad);
        bad[1].out_stride = 7; /* narrower than the outputs, several rows */
        be->ops->matmul_multi(be, bad, 2, xv, 64, 4, DS4_NUMERICS_DS4);
        CHECK_EQ_INT(be->ops->take_error(be, &e), DS4_ERR_INVALID);
        be->ops->matmul_multi(be, ok, 2, xv, 63, 4, DS4_NUMERICS_DS4); /* x stride */
        CHECK_EQ_INT(be->ops->take_error(be, &e), DS4_ERR_INVALID);
        be->ops->matmul_multi(be, ok, 2, NULL, 64, 1, DS4_NUMERICS_DS4);
        CHECK_EQ_INT(be->ops->take_error(be, &e), DS4_ERR_INVALID);
        memcpy(bad, ok, sizeof bad);
        ds4_weight q40 = *wv;
        q40.type = DS4_TYPE_Q4_0; /* a type without a kernel */
        bad[1].w = &q40;
        be->ops->matmul_multi(be, bad, 2, xv, 64, 1, DS4_NUMERICS_DS4);
        CHECK_EQ_INT(be->ops->take_error(be, &e), DS4_ERR_UNSUPPORTED);
        CHECK_MSG(strstr(e.message, "blk.0.multi_err.weight") != NULL, "%s", e.message);
    }
    {
        float hy[4 * 16];
        p.gpu->ops->download(p.gpu, hy, y.g, 4 * 16);
        int written = 0;
        for (int i = 0; i < 4 * 16; i++) written += !isnan(hy[i]);
        CHECK_EQ_INT(written, 0);
    }
    ds4_product okc[2] = { { &w->c, 16, y.c, 16, NULL, 0 }, { &w->c, 8, y2.c, 16, NULL, 0 } };
    ds4_product okg[2] = { { &w->g, 16, y.g, 16, NULL, 0 }, { &w->g, 8, y2.g, 16, NULL, 0 } };
    p.cpu->ops->matmul_multi(p.cpu, okc, 2, x.c, 64, 4, DS4_NUMERICS_DS4);
    p.gpu->ops->matmul_multi(p.gpu, okg, 2, x.g, 64, 4, DS4_NUMERICS_DS4);
    op_expect_ok(&p);
    double *tol = matmul_tolerances(DS4_TYPE_Q8_0, DS4_NUMERICS_DS4, bytes, deq, 64, 0, 16, hx, 64, 4);
    compare_out("matmul_multi after errors", &p, y, 4, 16, 16, tol, 0.0, false);
    free(tol);
    tol = matmul_tolerances(DS4_TYPE_Q8_0, DS4_NUMERICS_DS4, bytes, deq, 64, 0, 8, hx, 64, 4);
    compare_out("matmul_multi after errors (8 outputs)", &p, y2, 4, 8, 16, tol, 0.0, false);
    free(tol);
    op_buf_free(&p, &y);
    op_buf_free(&p, &y2);
    op_buf_free(&p, &x);
    op_weight_free(&p, w);
    op_weight_free(&p, w96);
    free(hx);
    free(bytes);
    free(bytes2);
    free(deq);
    free(deq2);
    op_pair_close(&p);
}

/* ------------------------------------------------------------------------ */
/* Q8_0 decode products that quantise their own activations                  */
/* ------------------------------------------------------------------------ */

/* The quantiser's edge cases (n >= 128): in row 0 an all-zero block, exact
 * half-code ties (largest |x| 127, so d = 1), a block whose largest |x| is
 * in its second half; with two rows or more, ties of opposite signs in row
 * 1 and, in the last row (whose outputs they turn to NaN), an infinity and
 * a NaN. */
static void plant_quant_edges(float *hx, int64_t n_rows, int64_t x_stride) {
    for (int i = 0; i < 32; i++) hx[i] = 0.0f;
    hx[32] = -127.0f;
    for (int i = 1; i < 32; i++) hx[32 + i] = (float)((int)(test_rand_u64() % 200) - 100) + 0.5f;
    for (int i = 0; i < 16; i++) hx[64 + i] *= 0.01f;
    hx[64 + 20] = 3.0f;
    if (n_rows < 2) return;
    hx[x_stride + 7] = -4.0f, hx[x_stride + 9] = 4.0f;
    float *last = hx + (n_rows - 1) * x_stride;
    last[96 + 5] = INFINITY;
    last[64 + 17] = NAN;
}

/* A Q8_0 decode product (1 to 8 rows) whose float rows fit 4608 bytes of
 * quantised blocks, on a grid of at most 1,056 thread blocks (one row: up to
 * 9216 bytes on a grid of at most 396), quantises them
 * in the product kernel itself: one launch instead of the quantiser's and
 * the product's (`fused`: the single product; `fused_multi`: it and its
 * first half as one matmul_multi). Its results must equal, bit for bit,
 * those of the same calls with the fusion off (ds4_cuda_backend_set_fusions:
 * the quantiser kernel first), the quantisers' edge cases included. Rows
 * that are not 16-byte aligned, and outputs overlapping x (the product's
 * blocks would read x while others write it), keep the quantiser kernel. */
static void quantises_x_case(op_pair *p, int64_t n, int64_t n_out, int64_t n_rows, bool fused, bool fused_multi) {
    if (!env_on("DS4_CUDA_MV_XQ")) fused = fused_multi = false;
    float *deq = NULL;
    uint8_t *bytes = weight_bytes(DS4_TYPE_Q8_0, n, n_out, false, &deq);
    op_weight *w = op_weight_make(p, "blk.0.xq.weight", DS4_TYPE_Q8_0, n, n_out, 1, bytes);
    const int64_t x_stride = n + 32, out_stride = n_out + 3, ny = n_rows * out_stride;
    float *hx = op_rand(n_rows * x_stride + 4, 1.0);
    plant_quant_edges(hx, n_rows, x_stride);
    op_buf x = op_buf_from(p, hx, n_rows * x_stride + 4);
    op_buf y[4], ref[4];
    for (int i = 0; i < 4; i++) y[i] = op_buf_poisoned(p, ny), ref[i] = op_buf_poisoned(p, ny);
    const ds4_backend_ops *g = p->gpu->ops;
    const ds4_numerics num = DS4_NUMERICS_DS4;
    char what[160];
    snprintf(what, sizeof what, "Q8_0 %lld -> %lld, %lld rows", (long long)n, (long long)n_out, (long long)n_rows);

    /* the quantiser kernel's path: single, multi (all rows and the first half) */
    ds4_cuda_backend_set_fusions(p->gpu, 0, env_on("DS4_CUDA_MOE_XQ"));
    EXPECT_LAUNCHES(p, 2, what, g->matmul(p->gpu, &w->g, 0, n_out, x.g, x_stride, ref[0].g, out_stride, n_rows, num));
    ds4_product pr[2] = { { &w->g, n_out, ref[1].g, out_stride, NULL, 0 }, { &w->g, n_out / 2, ref[2].g, out_stride, NULL, 0 } };
    EXPECT_LAUNCHES(p, 2, what, g->matmul_multi(p->gpu, pr, 2, x.g, x_stride, n_rows, num));
    default_fusions(p);
    /* the same calls, fused where they fit */
    EXPECT_LAUNCHES(p, fused ? 1 : 2, what,
                    g->matmul(p->gpu, &w->g, 0, n_out, x.g, x_stride, y[0].g, out_stride, n_rows, num));
    ds4_product py[2] = { { &w->g, n_out, y[1].g, out_stride, NULL, 0 }, { &w->g, n_out / 2, y[2].g, out_stride, NULL, 0 } };
    EXPECT_LAUNCHES(p, fused_multi ? 1 : 2, what, g->matmul_multi(p->gpu, py, 2, x.g, x_stride, n_rows, num));
    expect_same_rows(p, what, y[0].g, ref[0].g, n_rows, n_out, out_stride);
    expect_same_rows(p, what, y[1].g, ref[1].g, n_rows, n_out, out_stride);
    expect_same_rows(p, what, y[2].g, ref[2].g, n_rows, n_out / 2, out_stride);
    float last;
    g->download(p->gpu, &last, y[0].g + (n_rows - 1) * out_stride + n_out, 1);
    CHECK_MSG(isnan(last), "%s: written past the last row's outputs", what);

    /* x one float off 16-byte alignment, and (more than one row) rows an odd
     * number of floats apart: the quantiser kernel, the same results */
    ds4_cuda_backend_set_fusions(p->gpu, 0, env_on("DS4_CUDA_MOE_XQ"));
    g->matmul(p->gpu, &w->g, 0, n_out, x.g + 1, x_stride, ref[3].g, out_stride, n_rows, num);
    default_fusions(p);
    EXPECT_LAUNCHES(p, 2, what, g->matmul(p->gpu, &w->g, 0, n_out, x.g + 1, x_stride, y[3].g, out_stride, n_rows, num));
    expect_same_rows(p, what, y[3].g, ref[3].g, n_rows, n_out, out_stride);
    if (n_rows > 1) {
        ds4_cuda_backend_set_fusions(p->gpu, 0, env_on("DS4_CUDA_MOE_XQ"));
        g->matmul(p->gpu, &w->g, 0, n_out, x.g, x_stride - 1, ref[3].g, out_stride, n_rows, num);
        default_fusions(p);
        EXPECT_LAUNCHES(p, 2, what,
                        g->matmul(p->gpu, &w->g, 0, n_out, x.g, x_stride - 1, y[3].g, out_stride, n_rows, num));
        expect_same_rows(p, what, y[3].g, ref[3].g, n_rows, n_out, out_stride);
    }

    /* outputs overlapping x (n_out <= n): in place for one row; over row 1
     * of x and past it for two rows or more; the reference from a copy */
    if (n_out <= n) {
        const int64_t span = n_rows * x_stride + 4;
        op_buf xi = op_buf_from(p, hx, span + x_stride);
        float *out = n_rows == 1 ? xi.g : xi.g + x_stride;
        const int64_t ostride = n_rows == 1 ? n_out : x_stride;
        op_buf ro = op_buf_poisoned(p, (n_rows - 1) * ostride + n_out);
        ds4_cuda_backend_set_fusions(p->gpu, 0, env_on("DS4_CUDA_MOE_XQ"));
        g->matmul(p->gpu, &w->g, 0, n_out, x.g, x_stride, ro.g, ostride, n_rows, num);
        default_fusions(p);
        EXPECT_LAUNCHES(p, 2, what, g->matmul(p->gpu, &w->g, 0, n_out, xi.g, x_stride, out, ostride, n_rows, num));
        expect_same_rows(p, what, out, ro.g, n_rows, n_out, ostride);
        op_buf_free(p, &ro);
        op_buf_free(p, &xi);
    }
    for (int i = 0; i < 4; i++) op_buf_free(p, &y[i]), op_buf_free(p, &ref[i]);
    weight_case_free(p, &x, w, hx, bytes, deq);
}

/* A grouped Q8_0 decode product (o_a: 8 groups of 4096 -> 1024) whose
 * thread blocks each hold outputs of one group quantises each group's slice
 * of x in the product kernel (cuda_mv_grouped_quantises): one launch instead
 * of the quantiser's and the product's, bit for bit the quantiser kernel's
 * path (the fusion off), the quantisers' edge cases included. Groups a
 * block would straddle, and rows past the shared memory, keep the
 * quantiser kernel. */
static void grouped_xq_case(op_pair *p, int64_t n_groups, int64_t n_in, int64_t n_out, int64_t n_rows, bool fused) {
    if (!env_on("DS4_CUDA_MV_XQ")) fused = false;
    float *deq = NULL;
    uint8_t *bytes = weight_bytes(DS4_TYPE_Q8_0, n_in, n_groups * n_out, false, &deq);
    op_weight *w = op_weight_make(p, "blk.0.attn_output_a.weight", DS4_TYPE_Q8_0, n_in, n_groups * n_out, 1, bytes);
    const int64_t x_stride = n_groups * n_in + 32, width = n_groups * n_out, out_stride = width + 3;
    const int64_t ny = n_rows * out_stride;
    float *hx = op_rand(n_rows * x_stride, 1.0);
    plant_quant_edges(hx, n_rows, x_stride);
    op_buf x = op_buf_from(p, hx, n_rows * x_stride), y = op_buf_poisoned(p, ny), ref = op_buf_poisoned(p, ny);
    const ds4_backend_ops *g = p->gpu->ops;
    char what[160];
    snprintf(what, sizeof what, "Q8_0 grouped %lld x %lld -> %lld, %lld rows", (long long)n_groups, (long long)n_in,
             (long long)n_out, (long long)n_rows);
    ds4_cuda_backend_set_fusions(p->gpu, 0, env_on("DS4_CUDA_MOE_XQ"));
    EXPECT_LAUNCHES(p, 2, what,
                    g->matmul_grouped(p->gpu, &w->g, n_groups, n_out, x.g, x_stride, ref.g, out_stride, n_rows,
                                      DS4_NUMERICS_DS4));
    default_fusions(p);
    EXPECT_LAUNCHES(p, fused ? 1 : 2, what,
                    g->matmul_grouped(p->gpu, &w->g, n_groups, n_out, x.g, x_stride, y.g, out_stride, n_rows,
                                      DS4_NUMERICS_DS4));
    expect_same_rows(p, what, y.g, ref.g, n_rows, width, out_stride);
    op_buf_free(p, &x);
    op_buf_free(p, &y);
    op_buf_free(p, &ref);
    op_weight_free(p, w);
    free(hx);
    free(bytes);
    free(deq);
}

static void test_matvec_grouped_quantises_x(void) {
    OPEN_PAIR(p);
    grouped_xq_case(&p, 8, 4096, 1024, 1, true);  /* o_a: 256 blocks of 32 outputs, 4608 bytes a group */
    grouped_xq_case(&p, 8, 4096, 1024, 2, false); /* 2 x 4608 bytes */
    grouped_xq_case(&p, 4, 1024, 256, 3, true);   /* 3 x 1152 bytes, blocks of 8 outputs */
    grouped_xq_case(&p, 8, 4096, 100, 1, true);   /* rows split over two warps, blocks of 4 outputs */
    grouped_xq_case(&p, 8, 4096, 102, 1, false);  /* a block would straddle two groups */
    grouped_xq_case(&p, 8, 256, 2051, 1, false);  /* blocks of 64 outputs over groups of 2051 */
    op_pair_close(&p);
}

static void test_matvec_quantises_x(void) {
    OPEN_PAIR(p);
    quantises_x_case(&p, 1024, 2048, 1, true, true);    /* 512 blocks; multi 2 x 512 */
    quantises_x_case(&p, 1024, 300, 2, true, true);     /* 2 x 1152 bytes */
    quantises_x_case(&p, 1024, 300, 3, true, true);     /* 3 rows in the 4-row kernel */
    quantises_x_case(&p, 1024, 300, 4, true, true);     /* 4 x 1152 bytes */
    quantises_x_case(&p, 1024, 300, 5, false, false);   /* too many rows */
    quantises_x_case(&p, 4096, 1024, 1, true, true);    /* 4608 bytes, 512 blocks; multi 2 x 512 */
    quantises_x_case(&p, 4096, 512, 2, false, false);   /* 9216 bytes */
    quantises_x_case(&p, 512, 77, 8, true, true);       /* 8 x 576 bytes */
    quantises_x_case(&p, 768, 64, 1, true, true);       /* 24 blocks a row */
    /* grids of warps of 8 rows (MV_MIN_WARPS): 70,000 outputs in 1,094
     * blocks (the head's kind of shape); 40,000 in 625, but 2 x 625 for the
     * multi; 8,192 in 256 (warps of 4 rows) */
    quantises_x_case(&p, 1024, 70000, 1, false, false);
    quantises_x_case(&p, 1024, 40000, 1, true, false);
    quantises_x_case(&p, 1024, 8192, 1, true, true);
    /* one row of up to 9216 bytes: o_b's 8192 -> 4096 in 256 blocks (the
     * multi's 2 x 256 are too many); 500 blocks; 9504 bytes */
    quantises_x_case(&p, 8192, 4096, 1, env_on("DS4_CUDA_MV_XQ_WIDE"), false);
    quantises_x_case(&p, 8192, 8000, 1, false, false);
    quantises_x_case(&p, 8448, 1024, 1, false, false);
    op_pair_close(&p);
}

/* Short rows packed into the streaming kernels' stages
 * (ds4_cuda_backend_set_mv_pack): rows of 4 or 8 Q2_K blocks, of 8 or 16
 * IQ2_XXS blocks and of 32 Q8_0 blocks (the full-size model's experts:
 * IQ2_XXS gate/up rows of 16 blocks, Q2_K down rows of 8; q_b), two to six
 * rows a stage, warps of 2, 4
 * or 8 rows whose last stage holds fewer. Against the CPU (matmul_case's
 * bounds, moe_case's) with packing on, then bit for bit the same results
 * as with it off; the launch counter shows which way each ran. */
static void pack_runs(op_pair *p, const char *what, int64_t c0, bool on) {
    const int64_t ran = ds4_cuda_backend_mv_packed_launches(p->gpu) - c0;
    CHECK_MSG(!env_on("DS4_CUDA_MATVEC") || (on ? ran >= 1 : ran == 0), "%s: %lld packed launches with packing %s",
              what, (long long)ran, on ? "on" : "off");
}

static void pack_plain_case(op_pair *p, uint32_t type, int64_t n, int64_t rows) {
    char what[128];
    snprintf(what, sizeof what, "matmul %s [%lld -> %lld rows] packed", ds4_type_name(type), (long long)n,
             (long long)rows);
    ds4_cuda_backend_set_mv_pack(p->gpu, 1);
    const int64_t c0 = ds4_cuda_backend_mv_packed_launches(p->gpu);
    matmul_case(p, type, n, rows, false, 0, rows, 1, n, rows, false);
    pack_runs(p, what, c0, true);
    float *deq = NULL;
    uint8_t *bytes = weight_bytes(type, n, rows, false, &deq);
    op_weight *w = op_weight_make(p, "blk.0.test_pack.weight", type, n, rows, 1, bytes);
    float *hx = op_rand(n, 1.0);
    op_buf x = op_buf_from(p, hx, n), y[2];
    for (int on = 1; on >= 0; on--) {
        ds4_cuda_backend_set_mv_pack(p->gpu, on);
        const int64_t c = ds4_cuda_backend_mv_packed_launches(p->gpu);
        y[on] = op_buf_poisoned(p, rows);
        p->gpu->ops->matmul(p->gpu, &w->g, 0, rows, x.g, n, y[on].g, rows, 1, DS4_NUMERICS_DS4);
        op_expect_ok(p);
        pack_runs(p, what, c, on);
    }
    expect_same_rows(p, what, y[1].g, y[0].g, 1, rows, rows);
    ds4_cuda_backend_set_mv_pack(p->gpu, env_on("DS4_CUDA_MV_PACK"));
    for (int i = 0; i < 2; i++) op_buf_free(p, &y[i]);
    weight_case_free(p, &x, w, hx, bytes, deq);
}

static void pack_moe_case(op_pair *p, int64_t dim, int64_t n_ff, int64_t n_rows) {
    const uint32_t IQ2 = DS4_TYPE_IQ2_XXS, Q2 = DS4_TYPE_Q2_K;
    char what[128];
    snprintf(what, sizeof what, "moe IQ2_XXS/Q2_K dim %lld n_ff %lld, %lld rows, packed", (long long)dim,
             (long long)n_ff, (long long)n_rows);
    ds4_cuda_backend_set_mv_pack(p->gpu, 1);
    const int64_t c0 = ds4_cuda_backend_mv_packed_launches(p->gpu);
    moe_case(p, IQ2, Q2, dim, n_ff, 6, 6, 0.7f, n_rows); /* per slot (not grouped): the one-row kernels */
    pack_runs(p, what, c0, true);
    moe_fix f = moe_fix_make(p, IQ2, Q2, dim, n_ff, 6, 6, n_rows);
    op_buf y[2];
    ds4_cuda_backend_set_moe_grouped(p->gpu, 0);
    for (int on = 1; on >= 0; on--) {
        ds4_cuda_backend_set_mv_pack(p->gpu, on);
        const int64_t c = ds4_cuda_backend_mv_packed_launches(p->gpu);
        y[on] = op_buf_poisoned(p, n_rows * dim);
        moe_gpu(p, &f.m, f.x, f.dsel, f.dw, 6, 0.7f, y[on], n_rows);
        op_expect_ok(p);
        pack_runs(p, what, c, on);
    }
    default_moe_grouped(p);
    ds4_cuda_backend_set_mv_pack(p->gpu, env_on("DS4_CUDA_MV_PACK"));
    expect_same_rows(p, what, y[1].g, y[0].g, n_rows, dim, dim);
    for (int i = 0; i < 2; i++) op_buf_free(p, &y[i]);
    moe_fix_free(p, &f);
}

/* The branch tests' weights (two Q8_0, one F16: 512 rows of 1024) and
 * three activations of 8 rows, on both sides. */
typedef struct branch_fix {
    op_weight *wq, *wq2, *wf;
    op_buf x[3];
    uint8_t *bytes[3];
    float *deq[3], *host[3];
} branch_fix;
#define BRANCH_N 1024
#define BRANCH_ROWS 512
#define BRANCH_R 8

static void branch_fix_make(op_pair *p, const char *tag, branch_fix *f) {
    static const uint32_t types[3] = { DS4_TYPE_Q8_0, DS4_TYPE_Q8_0, DS4_TYPE_F16 };
    static const char *const names[3] = { "q", "q2", "f" };
    op_weight **ws[3] = { &f->wq, &f->wq2, &f->wf };
    for (int i = 0; i < 3; i++) {
        char name[64];
        snprintf(name, sizeof name, "blk.0.%s_%s.weight", tag, names[i]);
        f->deq[i] = NULL;
        f->bytes[i] = weight_bytes(types[i], BRANCH_N, BRANCH_ROWS, true, &f->deq[i]);
        *ws[i] = op_weight_make(p, name, types[i], BRANCH_N, BRANCH_ROWS, 1, f->bytes[i]);
        f->host[i] = op_rand(BRANCH_R * BRANCH_N, 1.0);
        f->x[i] = op_buf_from(p, f->host[i], BRANCH_R * BRANCH_N);
    }
}

static void branch_fix_free(op_pair *p, branch_fix *f) {
    op_weight *ws[3] = { f->wq, f->wq2, f->wf };
    for (int i = 0; i < 3; i++) {
        op_buf_free(p, &f->x[i]);
        op_weight_free(p, ws[i]);
        free(f->bytes[i]);
        free(f->deq[i]);
        free(f->host[i]);
    }
}

/* The outputs of a branch test's recorded pass (got) against its direct
 * pass (ref), row by row, then freed. */
static void branch_outputs_check(op_pair *p, const char *tag, int cs, op_buf *got, op_buf *ref, int n) {
    for (int i = 0; i < n; i++) {
        char what[96];
        snprintf(what, sizeof what, "%s case %d, output %d", tag, cs, i);
        expect_same_rows(p, what, got[i].g, ref[i].g, BRANCH_R, BRANCH_ROWS, BRANCH_ROWS);
        op_buf_free(p, &ref[i]);
        op_buf_free(p, &got[i]);
    }
}

/* Side branches of a recorded step (backend.h's branch_begin / _end /
 * _join): a branch's products and the main chain's after it give the
 * results of direct launches bit for bit, and outside a step the branch
 * calls do nothing. Two Q8_0 products of 8 rows each quantise their x into
 * the same scratch slot, so the main chain's joins the branch before its
 * own (counted); an F16 product (the matvec kernels: no scratch) beside a
 * Q8_0 one shares nothing and runs beside it to the explicit join. With
 * DS4_CUDA_GRAPH=0 (no recorded steps) only the results are compared. */
static void test_step_branch(void) {
    OPEN_PAIR(p);
    const int64_t n = BRANCH_N, rows = BRANCH_ROWS, R = BRANCH_R;
    branch_fix f;
    branch_fix_make(&p, "branch", &f);
    const op_weight *wq = f.wq, *wq2 = f.wq2, *wf = f.wf;
    const op_buf x1 = f.x[0], x2 = f.x[1];
    op_buf ref[3], got[3];
    const op_weight *side_w[2] = { wq, wf }; /* case 0: a shared slot; case 1: none */
    const bool recorded = env_on("DS4_CUDA_GRAPH") && !env_on_default("DS4_CUDA_PROFILE", false);
    ds4_cuda_backend_set_branches(p.gpu, 1);
    for (int cs = 0; cs < 2; cs++) {
        const op_weight *ws[2] = { side_w[cs], wq2 };
        for (int i = 0; i < 3; i++) ref[i] = op_buf_poisoned(&p, R * rows), got[i] = op_buf_poisoned(&p, R * rows);
        /* side: ws[0] x1; main: ws[1] x2; after the join: the sum of both.
         * Pass 0 outside a step, pass 1 recorded */
        for (int pass = 0; pass < 2; pass++) {
            op_buf *y = pass ? got : ref;
            uint64_t b0 = 0, j0 = 0, b1 = 0, j1 = 0;
            ds4_cuda_backend_branch_stats(p.gpu, &b0, &j0);
            const ds4_backend_counters c0 = op_gpu_counters(&p);
            if (pass) p.gpu->ops->step_begin(p.gpu);
            p.gpu->ops->branch_begin(p.gpu);
            p.gpu->ops->matmul(p.gpu, &ws[0]->g, 0, rows, x1.g, n, y[0].g, rows, R, DS4_NUMERICS_DS4);
            p.gpu->ops->branch_end(p.gpu);
            p.gpu->ops->matmul(p.gpu, &ws[1]->g, 0, rows, x2.g, n, y[1].g, rows, R, DS4_NUMERICS_DS4);
            p.gpu->ops->branch_join(p.gpu);
            p.gpu->ops->add(p.gpu, y[0].g, y[1].g, y[2].g, R * rows);
            if (pass) p.gpu->ops->step_end(p.gpu);
            const ds4_backend_counters c1 = op_gpu_counters(&p);
            op_expect_ok(&p);
            ds4_cuda_backend_branch_stats(p.gpu, &b1, &j1);
            if (pass && recorded) {
                CHECK_MSG(c1.graphs > c0.graphs && c1.step_breaks == c0.step_breaks, "case %d: not one graph", cs);
                CHECK_MSG(b1 - b0 == 1, "case %d: %llu branches recorded", cs, (unsigned long long)(b1 - b0));
                /* (with DS4_CUDA_MATVEC=0 the F16 product takes a GEMM that quantises into the slot too) */
                CHECK_MSG(j1 - j0 == (cs == 0 || !env_on("DS4_CUDA_MATVEC") ? 1u : 0u),
                          "case %d: %llu joins forced by a scratch slot", cs, (unsigned long long)(j1 - j0));
            } else {
                CHECK_MSG(b1 == b0 && j1 == j0, "case %d pass %d: branches outside a recorded step", cs, pass);
            }
        }
        branch_outputs_check(&p, "branch", cs, got, ref, 3);
    }
    ds4_cuda_backend_set_branches(p.gpu, env_on("DS4_CUDA_BRANCH"));
    branch_fix_free(&p, &f);
    op_pair_close(&p);
}

/* Two branches beside each other (backend.h: a branch begun after
 * another's end and before a join): both fork from the main chain, one
 * join takes both, and every output is the direct launches' bit for bit.
 * Case 0: an F16 product (no scratch) on the first, a Q8_0 one of 8 rows
 * (its quantised x in a scratch slot) on the second; case 1: Q8_0 on both,
 * so the second's product waits for the first's (the shared slot). The
 * main chain runs an F16 product beside them; after the join, the sum of
 * the three. */
static void test_step_branch_beside(void) {
    OPEN_PAIR(p);
    const int64_t n = BRANCH_N, rows = BRANCH_ROWS, R = BRANCH_R;
    branch_fix f;
    branch_fix_make(&p, "beside", &f);
    const op_weight *wq = f.wq, *wq2 = f.wq2, *wf = f.wf;
    const op_buf x1 = f.x[0], x2 = f.x[1], x3 = f.x[2];
    enum { NOUT = 5 };
    op_buf ref[NOUT], got[NOUT];
    const bool recorded = env_on("DS4_CUDA_GRAPH") && !env_on_default("DS4_CUDA_PROFILE", false);
    ds4_cuda_backend_set_branches(p.gpu, 1);
    for (int cs = 0; cs < 2; cs++) {
        const op_weight *first = cs == 0 ? wf : wq, *second = cs == 0 ? wq : wq2;
        for (int i = 0; i < NOUT; i++) ref[i] = op_buf_poisoned(&p, R * rows), got[i] = op_buf_poisoned(&p, R * rows);
        for (int pass = 0; pass < 2; pass++) { /* pass 0 outside a step, pass 1 recorded */
            op_buf *y = pass ? got : ref;
            uint64_t b0 = 0, j0 = 0, s0 = 0, b1 = 0, j1 = 0, s1 = 0;
            ds4_cuda_backend_branch_stats(p.gpu, &b0, &j0);
            ds4_cuda_backend_branch_beside(p.gpu, &s0);
            const ds4_backend_counters c0 = op_gpu_counters(&p);
            if (pass) p.gpu->ops->step_begin(p.gpu);
            p.gpu->ops->branch_begin(p.gpu);
            p.gpu->ops->matmul(p.gpu, &first->g, 0, rows, x1.g, n, y[0].g, rows, R, DS4_NUMERICS_DS4);
            p.gpu->ops->branch_end(p.gpu);
            p.gpu->ops->branch_begin(p.gpu);
            p.gpu->ops->matmul(p.gpu, &second->g, 0, rows, x2.g, n, y[1].g, rows, R, DS4_NUMERICS_DS4);
            p.gpu->ops->branch_end(p.gpu);
            p.gpu->ops->matmul(p.gpu, &wf->g, 0, rows, x3.g, n, y[2].g, rows, R, DS4_NUMERICS_DS4);
            p.gpu->ops->branch_join(p.gpu);
            p.gpu->ops->add(p.gpu, y[0].g, y[1].g, y[3].g, R * rows);
            p.gpu->ops->add(p.gpu, y[3].g, y[2].g, y[4].g, R * rows);
            if (pass) p.gpu->ops->step_end(p.gpu);
            const ds4_backend_counters c1 = op_gpu_counters(&p);
            op_expect_ok(&p);
            ds4_cuda_backend_branch_stats(p.gpu, &b1, &j1);
            ds4_cuda_backend_branch_beside(p.gpu, &s1);
            if (pass && recorded) {
                CHECK_MSG(c1.graphs > c0.graphs && c1.step_breaks == c0.step_breaks, "beside case %d: not one graph", cs);
                CHECK_MSG(b1 - b0 == 2 && s1 - s0 == 1, "beside case %d: %llu branches, %llu beside", cs,
                          (unsigned long long)(b1 - b0), (unsigned long long)(s1 - s0));
                /* (the main chain's F16 product takes no slot unless DS4_CUDA_MATVEC=0 sends it to a GEMM) */
                CHECK_MSG(j1 - j0 == (env_on("DS4_CUDA_MATVEC") ? 0u : 1u), "beside case %d: %llu joins forced", cs,
                          (unsigned long long)(j1 - j0));
            } else {
                CHECK_MSG(b1 == b0 && s1 == s0, "beside case %d pass %d: branches outside a recorded step", cs, pass);
            }
        }
        branch_outputs_check(&p, "beside", cs, got, ref, NOUT);
    }
    ds4_cuda_backend_set_branches(p.gpu, env_on("DS4_CUDA_BRANCH"));
    branch_fix_free(&p, &f);
    op_pair_close(&p);
}

/* Beside branches and scratch slots: the first takes the overlapping
 * copy's slot and a Q8_0 product's (8 rows: its quantised x), the second
 * the product's slot only (so it waits for the first there); the pending
 * pair then holds both branches' slots, so a main-chain overlapping copy
 * (the first's other slot) joins them before it runs (one forced join).
 * Every output is the direct launches' bit for bit. */
static void test_step_branch_beside_slots(void) {
    OPEN_PAIR(p);
    const int64_t n = BRANCH_N, rows = BRANCH_ROWS, R = BRANCH_R, nc = 4096, shift = 16;
    branch_fix f;
    branch_fix_make(&p, "slots", &f);
    const op_weight *wq = f.wq, *wq2 = f.wq2;
    const op_buf x1 = f.x[0], x2 = f.x[1];
    float *ha = op_rand(nc + shift, 1.0), *hb = op_rand(nc + shift, 1.0);
    op_buf bufs[2][5]; /* per pass: y0, y1, y0 + y1, the two copies' buffers */
    const bool recorded = env_on("DS4_CUDA_GRAPH") && !env_on_default("DS4_CUDA_PROFILE", false);
    ds4_cuda_backend_set_branches(p.gpu, 1);
    for (int pass = 0; pass < 2; pass++) { /* pass 0 outside a step, pass 1 recorded */
        op_buf *y = bufs[pass];
        for (int i = 0; i < 3; i++) y[i] = op_buf_poisoned(&p, R * rows);
        y[3] = op_buf_from(&p, ha, nc + shift);
        y[4] = op_buf_from(&p, hb, nc + shift);
        uint64_t b0 = 0, j0 = 0, s0 = 0, b1 = 0, j1 = 0, s1 = 0;
        ds4_cuda_backend_branch_stats(p.gpu, &b0, &j0);
        ds4_cuda_backend_branch_beside(p.gpu, &s0);
        if (pass) p.gpu->ops->step_begin(p.gpu);
        p.gpu->ops->branch_begin(p.gpu);
        p.gpu->ops->copy(p.gpu, y[3].g + shift, y[3].g, nc); /* overlapping: through the copy slot */
        p.gpu->ops->matmul(p.gpu, &wq->g, 0, rows, x1.g, n, y[0].g, rows, R, DS4_NUMERICS_DS4);
        p.gpu->ops->branch_end(p.gpu);
        p.gpu->ops->branch_begin(p.gpu);
        p.gpu->ops->matmul(p.gpu, &wq2->g, 0, rows, x2.g, n, y[1].g, rows, R, DS4_NUMERICS_DS4);
        p.gpu->ops->branch_end(p.gpu);
        p.gpu->ops->copy(p.gpu, y[4].g + shift, y[4].g, nc); /* the first branch's copy slot */
        p.gpu->ops->branch_join(p.gpu);
        p.gpu->ops->add(p.gpu, y[0].g, y[1].g, y[2].g, R * rows);
        if (pass) p.gpu->ops->step_end(p.gpu);
        op_expect_ok(&p);
        ds4_cuda_backend_branch_stats(p.gpu, &b1, &j1);
        ds4_cuda_backend_branch_beside(p.gpu, &s1);
        if (pass && recorded)
            CHECK_MSG(b1 - b0 == 2 && s1 - s0 == 1 && j1 - j0 == 1,
                      "slots: %llu branches (want 2), %llu beside (want 1), %llu joins forced (want 1)",
                      (unsigned long long)(b1 - b0), (unsigned long long)(s1 - s0), (unsigned long long)(j1 - j0));
        else
            CHECK_MSG(b1 == b0 && s1 == s0 && j1 == j0, "slots pass %d: branches outside a recorded step", pass);
    }
    expect_same_rows(&p, "slots y0", bufs[1][0].g, bufs[0][0].g, R, rows, rows);
    expect_same_rows(&p, "slots y1", bufs[1][1].g, bufs[0][1].g, R, rows, rows);
    expect_same_rows(&p, "slots y0 + y1", bufs[1][2].g, bufs[0][2].g, R, rows, rows);
    expect_same_rows(&p, "slots first copy", bufs[1][3].g, bufs[0][3].g, 1, nc + shift, nc + shift);
    expect_same_rows(&p, "slots main copy", bufs[1][4].g, bufs[0][4].g, 1, nc + shift, nc + shift);
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < 5; i++) op_buf_free(&p, &bufs[pass][i]);
    ds4_cuda_backend_set_branches(p.gpu, env_on("DS4_CUDA_BRANCH"));
    branch_fix_free(&p, &f);
    free(ha);
    free(hb);
    op_pair_close(&p);
}

/* The bytes the prefetch asks for of [dev, dev + bytes): its whole 16-byte
 * pieces (what the backend documents). */
static uint64_t inner_bytes(const void *dev, uint64_t bytes) {
    const uintptr_t a = ((uintptr_t)dev + 15) & ~(uintptr_t)15, e = ((uintptr_t)dev + bytes) & ~(uintptr_t)15;
    return e > a ? (uint64_t)(e - a) : 0;
}

/*
 * The prefetch op, a hint: outside a recorded step it launches nothing; in
 * a step each call is one leaf launch (up to 8 weights) asking for each
 * weight's whole 16-byte pieces in order, at most the set bound in all;
 * each way (the copy engine's L2 prefetch, loads, off) the products after it
 * give the results of no step bit for bit, and the step runs as one graph.
 * One token's routed experts in a step add a launch for the chosen experts'
 * down matrices (the 6 of them, whole). Bad arguments are errors.
 */
static void test_prefetch(void) {
    OPEN_PAIR(p);
    const int64_t n = 1024, rows = 512;
    float *dq = NULL, *df = NULL;
    uint8_t *bq = weight_bytes(DS4_TYPE_Q8_0, n, rows, true, &dq);
    uint8_t *bf = weight_bytes(DS4_TYPE_F16, n, rows, true, &df);
    op_weight *wq = op_weight_make(&p, "blk.0.pf_q.weight", DS4_TYPE_Q8_0, n, rows, 1, bq);
    op_weight *wf = op_weight_make(&p, "blk.0.pf_f.weight", DS4_TYPE_F16, n, rows, 1, bf);
    float *hx = op_rand(n, 1.0);
    op_buf x = op_buf_from(&p, hx, n), ref[2], got[2];
    const ds4_weight *ws[2] = { &wq->g, &wf->g };
    const uint64_t whole = inner_bytes(wq->g.device, (uint64_t)(wq->g.row_bytes * rows)) +
                           inner_bytes(wf->g.device, (uint64_t)(wf->g.row_bytes * rows));
    const bool recorded = env_on("DS4_CUDA_GRAPH") && !env_on_default("DS4_CUDA_PROFILE", false);
    for (int i = 0; i < 2; i++) ref[i] = op_buf_poisoned(&p, rows), got[i] = op_buf_poisoned(&p, rows);
    ds4_cuda_backend_set_prefetch_parts(p.gpu, 1, 1);
    p.gpu->ops->matmul(p.gpu, ws[0], 0, rows, x.g, n, ref[0].g, rows, 1, DS4_NUMERICS_DS4);
    p.gpu->ops->matmul(p.gpu, ws[1], 0, rows, x.g, n, ref[1].g, rows, 1, DS4_NUMERICS_DS4);
    op_expect_ok(&p);
    /* outside a step: nothing launched, nothing asked */
    {
        uint64_t l0 = 0, b0 = 0, l1 = 0, b1 = 0;
        ds4_cuda_backend_set_prefetch(p.gpu, 1, 64 << 20);
        ds4_cuda_backend_prefetch_stats(p.gpu, &l0, &b0);
        const ds4_backend_counters c0 = op_gpu_counters(&p);
        p.gpu->ops->prefetch(p.gpu, ws, 2);
        const ds4_backend_counters c1 = op_gpu_counters(&p);
        ds4_cuda_backend_prefetch_stats(p.gpu, &l1, &b1);
        op_expect_ok(&p);
        CHECK_MSG(c1.launches == c0.launches && l1 == l0 && b1 == b0,
                  "prefetch outside a step: %llu launches, %llu recorded, %llu bytes",
                  (unsigned long long)(c1.launches - c0.launches), (unsigned long long)(l1 - l0),
                  (unsigned long long)(b1 - b0));
    }
    static const struct { int mode; int64_t bound; } cases[] = { { 1, 64 << 20 }, { 2, 64 << 20 }, { 1, 1000 },
                                                                 { 2, 1000 }, { 0, 64 << 20 } };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const int mode = cases[k].mode;
        char what[96];
        snprintf(what, sizeof what, "prefetch mode %d, at most %lld bytes", mode, (long long)cases[k].bound);
        ds4_cuda_backend_set_prefetch(p.gpu, mode, cases[k].bound);
        for (int rep = 0; rep < 2; rep++) { /* the second replays the first's graph */
            uint64_t l0 = 0, b0 = 0, l1 = 0, b1 = 0;
            ds4_cuda_backend_prefetch_stats(p.gpu, &l0, &b0);
            const ds4_backend_counters c0 = op_gpu_counters(&p);
            p.gpu->ops->step_begin(p.gpu);
            p.gpu->ops->prefetch(p.gpu, ws, 2);
            p.gpu->ops->matmul(p.gpu, ws[0], 0, rows, x.g, n, got[0].g, rows, 1, DS4_NUMERICS_DS4);
            p.gpu->ops->matmul(p.gpu, ws[1], 0, rows, x.g, n, got[1].g, rows, 1, DS4_NUMERICS_DS4);
            p.gpu->ops->step_end(p.gpu);
            const ds4_backend_counters c1 = op_gpu_counters(&p);
            ds4_cuda_backend_prefetch_stats(p.gpu, &l1, &b1);
            op_expect_ok(&p);
            const bool on = recorded && mode != 0;
            const uint64_t want = !on ? 0 : cases[k].bound < (int64_t)whole ? (uint64_t)cases[k].bound & ~(uint64_t)15
                                                                             : whole;
            CHECK_MSG(l1 - l0 == (on ? 1u : 0u) && b1 - b0 == want, "%s: %llu launches asking for %llu bytes "
                      "(want %u, %llu)", what, (unsigned long long)(l1 - l0), (unsigned long long)(b1 - b0),
                      on ? 1u : 0u, (unsigned long long)want);
            if (recorded)
                CHECK_MSG(c1.graphs > c0.graphs && c1.step_breaks == c0.step_breaks, "%s: not one graph", what);
            for (int i = 0; i < 2; i++) expect_same_rows(&p, what, got[i].g, ref[i].g, 1, rows, rows);
        }
    }
    /* one token's routed experts in a step: their down matrices too */
    {
        const int64_t dim = 2048, n_ff = 1024, n_expert = 8;
        const int n_used = 6;
        moe_weights m = moe_make(&p, DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, dim, n_ff, n_expert);
        int32_t sel[6];
        float wts[6];
        moe_route(n_expert, n_used, sel, wts);
        float *hm = op_rand(dim, 1.0);
        op_buf mx = op_buf_from(&p, hm, dim), y = op_buf_poisoned(&p, dim), y2 = op_buf_poisoned(&p, dim);
        op_buf dsel = op_ints_from(&p, sel, n_used), dw = op_buf_from(&p, wts, n_used);
        ds4_cuda_backend_set_prefetch(p.gpu, 1, 64 << 20);
        moe_gpu(&p, &m, mx, dsel, dw, n_used, 0.0f, y, 1);
        uint64_t l0 = 0, b0 = 0, l1 = 0, b1 = 0;
        ds4_cuda_backend_prefetch_stats(p.gpu, &l0, &b0);
        p.gpu->ops->step_begin(p.gpu);
        moe_gpu(&p, &m, mx, dsel, dw, n_used, 0.0f, y2, 1);
        p.gpu->ops->step_end(p.gpu);
        ds4_cuda_backend_prefetch_stats(p.gpu, &l1, &b1);
        op_expect_ok(&p);
        const uint64_t expert = (uint64_t)(m.down->g.row_bytes * dim);
        if (recorded && env_on("DS4_CUDA_MATVEC"))
            CHECK_MSG(l1 - l0 == 1 && b1 - b0 == expert * (uint64_t)n_used,
                      "moe in a step: %llu prefetch launches asking for %llu bytes (want 1, %llu)",
                      (unsigned long long)(l1 - l0), (unsigned long long)(b1 - b0),
                      (unsigned long long)(expert * (uint64_t)n_used));
        expect_same_rows(&p, "moe with its experts' down matrices prefetched", y2.g, y.g, 1, dim, dim);
        op_buf_free(&p, &mx);
        op_buf_free(&p, &y);
        op_buf_free(&p, &y2);
        op_buf_free(&p, &dsel);
        op_buf_free(&p, &dw);
        free(hm);
        moe_free(&p, &m);
    }
    /* bad arguments: errors, in a step or not */
    {
        ds4_weight unbound = wq->g;
        unbound.device = NULL;
        const ds4_weight *with_null[2] = { &wq->g, NULL }, *with_unbound[1] = { &unbound };
        for (int step = 0; step < 2; step++) {
            if (step) p.gpu->ops->step_begin(p.gpu);
            p.gpu->ops->prefetch(p.gpu, NULL, 1);
            op_expect_error_with(&p, "prefetch of a NULL list", "prefetch", "NULL list", NULL);
            p.gpu->ops->prefetch(p.gpu, ws, -1);
            op_expect_error_with(&p, "prefetch of -1 weights", "prefetch", "-1 weights", NULL);
            p.gpu->ops->prefetch(p.gpu, with_null, 2);
            op_expect_error_with(&p, "prefetch of a NULL weight", "prefetch", "weight 1", "NULL", NULL);
            p.gpu->ops->prefetch(p.gpu, with_unbound, 1);
            op_expect_error_with(&p, "prefetch of an unbound weight", "prefetch", "pf_q", "not bound", NULL);
            p.gpu->ops->prefetch(p.gpu, ws, 0); /* nothing */
            if (step) p.gpu->ops->step_end(p.gpu);
            op_expect_ok(&p);
        }
    }
    const char *pe = getenv("DS4_CUDA_PREFETCH"); /* the default back */
    ds4_cuda_backend_set_prefetch(p.gpu, pe && !strcmp(pe, "1") ? 1 : pe && !strcmp(pe, "2") ? 2 : 0, 0);
    ds4_cuda_backend_set_prefetch_parts(p.gpu, env_on("DS4_CUDA_PREFETCH_OPS"), env_on("DS4_CUDA_PREFETCH_EXPERTS"));
    for (int i = 0; i < 2; i++) op_buf_free(&p, &ref[i]), op_buf_free(&p, &got[i]);
    op_buf_free(&p, &x);
    op_weight_free(&p, wq);
    op_weight_free(&p, wf);
    free(hx);
    free(bq);
    free(bf);
    free(dq);
    free(df);
    op_pair_close(&p);
}

/*
 * XS (ds4_cuda_backend_set_mv_xs): one-row products of float weights read x
 * from the block's copy in shared memory. F16, BF16 and F32 rows of 4,096
 * (the compressors' 2,560 outputs: whole rows a warp; the router's 256: rows
 * split over warps), two F16 products of one matmul_multi, and rows of
 * 8,192 (too wide: global memory as before) give the same outputs bit for
 * bit with it on and off, in the same number of launches.
 */
static void test_matvec_xs(void) {
    OPEN_PAIR(p);
    static const struct { uint32_t type; int64_t n, rows; } cases[] = {
        { DS4_TYPE_F16, 4096, 2560 }, { DS4_TYPE_F16, 4096, 256 }, { DS4_TYPE_BF16, 4096, 512 },
        { DS4_TYPE_F32, 4096, 256 },  { DS4_TYPE_F16, 8192, 64 },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const uint32_t type = cases[k].type;
        const int64_t n = cases[k].n, rows = cases[k].rows;
        float *dq = NULL;
        uint8_t *b = weight_bytes(type, n, rows, true, &dq);
        op_weight *w = op_weight_make(&p, "blk.0.xs.weight", type, n, rows, 1, b);
        float *hx = op_rand(n, 1.0);
        op_buf x = op_buf_from(&p, hx, n), y[2][2];
        char what[96];
        snprintf(what, sizeof what, "matvec XS %s %lld -> %lld", ds4_type_name(type), (long long)n, (long long)rows);
        uint64_t launches[2] = { 0, 0 };
        for (int on = 0; on < 2; on++) {
            ds4_cuda_backend_set_mv_xs(p.gpu, on);
            y[on][0] = op_buf_poisoned(&p, rows);
            y[on][1] = op_buf_poisoned(&p, rows);
            const ds4_product pr[2] = { { &w->g, rows, y[on][0].g, rows, NULL, 0 },
                                        { &w->g, rows / 2, y[on][1].g, rows, NULL, 0 } };
            p.gpu->ops->matmul(p.gpu, &w->g, 0, rows, x.g, n, y[on][0].g, rows, 1, DS4_NUMERICS_DS4); /* (scratch) */
            const ds4_backend_counters c0 = op_gpu_counters(&p);
            p.gpu->ops->matmul(p.gpu, &w->g, 0, rows, x.g, n, y[on][0].g, rows, 1, DS4_NUMERICS_DS4);
            if (type == DS4_TYPE_F16) p.gpu->ops->matmul_multi(p.gpu, pr, 2, x.g, n, 1, DS4_NUMERICS_DS4);
            const ds4_backend_counters c1 = op_gpu_counters(&p);
            op_expect_ok(&p);
            launches[on] = c1.launches - c0.launches;
        }
        CHECK_MSG(launches[0] == launches[1], "%s: %llu launches off, %llu on", what, (unsigned long long)launches[0],
                  (unsigned long long)launches[1]);
        expect_same_rows(&p, what, y[1][0].g, y[0][0].g, 1, rows, rows);
        if (type == DS4_TYPE_F16) expect_same_rows(&p, what, y[1][1].g, y[0][1].g, 1, rows / 2, rows);
        for (int on = 0; on < 2; on++) op_buf_free(&p, &y[on][0]), op_buf_free(&p, &y[on][1]);
        op_buf_free(&p, &x);
        op_weight_free(&p, w);
        free(hx);
        free(b);
        free(dq);
    }
    ds4_cuda_backend_set_mv_xs(p.gpu, env_on_default("DS4_CUDA_MV_XS", false));
    op_pair_close(&p);
}

/* rope_matmul_grouped (the attention output's inverse RoPE and o_a): the
 * fused launch, where the product rotates each row back as it quantises
 * it, gives rope_tail's inverse then matmul_grouped bit for bit, in one
 * launch and without writing x; shapes it does not take (rows past its
 * shared memory, RoPEs of more than 64 dims, heads that straddle a group's
 * slice) make the two calls, and so does DS4_CUDA_MV_ROPE=0. */
static void rope_grouped_case(op_pair *p, int64_t n_groups, int64_t n_in, int64_t n_out, int64_t head_dim,
                              const ds4_rope *rope, int64_t n_rows, int32_t pos0, bool fused) {
    if (!env_on("DS4_CUDA_MV_XQ") || !env_on("DS4_CUDA_MV_ROPE")) fused = false;
    const ds4_backend_ops *g = p->gpu->ops;
    float *deq = NULL;
    uint8_t *bytes = weight_bytes(DS4_TYPE_Q8_0, n_in, n_groups * n_out, false, &deq);
    op_weight *w = op_weight_make(p, "blk.0.attn_output_a.weight", DS4_TYPE_Q8_0, n_in, n_groups * n_out, 1, bytes);
    const int64_t width = n_groups * n_in, n_heads = width / head_dim, out_stride = n_groups * n_out + 5;
    const int64_t nx = n_rows * width, ny = n_rows * out_stride;
    float *hx = op_rand(nx, 1.0), *hx_after = malloc((size_t)nx * sizeof *hx_after);
    plant_quant_edges(hx, n_rows, width);
    int32_t *pos = malloc((size_t)n_rows * sizeof *pos);
    for (int64_t r = 0; r < n_rows; r++) pos[r] = pos0 + (int32_t)(r * 7919 % 1000); /* (not in order) */
    op_buf xr = op_buf_from(p, hx, nx), x = op_buf_from(p, hx, nx);
    op_buf y = op_buf_poisoned(p, ny), ref = op_buf_poisoned(p, ny);
    char what[200];
    snprintf(what, sizeof what, "rope_matmul_grouped %lld x %lld -> %lld, heads of %lld, %d rotated, %lld rows from %d",
             (long long)n_groups, (long long)n_in, (long long)n_out, (long long)head_dim, rope->n_rot,
             (long long)n_rows, pos0);
    const ds4_backend_counters c0 = op_gpu_counters(p);
    g->rope_tail(p->gpu, xr.g, n_rows, n_heads, head_dim, pos, rope, true);
    g->matmul_grouped(p->gpu, &w->g, n_groups, n_out, xr.g, width, ref.g, out_stride, n_rows, DS4_NUMERICS_DS4);
    const ds4_backend_counters c1 = op_gpu_counters(p);
    op_expect_ok(p);
    const uint64_t two_calls = c1.launches - c0.launches;
    EXPECT_LAUNCHES(p, fused ? two_calls - 1 : two_calls, what,
                    g->rope_matmul_grouped(p->gpu, &w->g, n_groups, n_out, x.g, n_heads, head_dim, pos, rope, y.g,
                                           out_stride, n_rows, DS4_NUMERICS_DS4));
    CHECK_MSG(!fused || !launch_counts_apply() || two_calls == 2, "%s: %llu launches for the two calls", what,
              (unsigned long long)two_calls);
    expect_same_rows(p, what, y.g, ref.g, n_rows, n_groups * n_out, out_stride);
    if (fused) { /* x as it was */
        g->download(p->gpu, hx_after, x.g, nx);
        CHECK_MSG(memcmp(hx, hx_after, (size_t)nx * sizeof *hx) == 0, "%s: the fused launch wrote x", what);
    }
    op_buf_free(p, &xr);
    op_buf_free(p, &x);
    op_buf_free(p, &y);
    op_buf_free(p, &ref);
    op_weight_free(p, w);
    free(pos);
    free(hx);
    free(hx_after);
    free(bytes);
    free(deq);
}

static void test_rope_matmul_grouped(void) {
    OPEN_PAIR(p);
    const ds4_rope plain = { 64, 10000.0f, 1.0f, 0.0f, 0.0f }, yarn = { 64, 160000.0f, 16.0f, 3.5f, 21.25f };
    const ds4_rope small = { 16, 10000.0f, 1.0f, 0.0f, 0.0f }, wide = { 128, 10000.0f, 1.0f, 0.0f, 0.0f };
    rope_grouped_case(&p, 8, 4096, 1024, 512, &yarn, 1, 1000003, true); /* o_a of one decoded token */
    rope_grouped_case(&p, 8, 4096, 1024, 512, &plain, 1, 0, true);
    rope_grouped_case(&p, 4, 1024, 256, 256, &yarn, 3, 77, true);       /* 3 rows of 1152 bytes */
    rope_grouped_case(&p, 4, 1024, 256, 64, &plain, 2, 5, true);        /* heads all RoPE */
    rope_grouped_case(&p, 4, 1024, 256, 128, &small, 1, 12345, true);
    rope_grouped_case(&p, 8, 4096, 1024, 512, &yarn, 2, 9, false);      /* 2 x 4608 bytes: the two calls */
    rope_grouped_case(&p, 4, 1024, 256, 256, &wide, 1, 9, false);       /* 64 pairs */
    rope_grouped_case(&p, 4, 1024, 256, 2048, &plain, 1, 9, false);     /* a head over two groups */
    rope_grouped_case(&p, 8, 4096, 1024, 512, &yarn, 12, 31, false);    /* rows of the GEMM */
    /* bad arguments: the error of the call that checks them, the backend still usable */
    {
        float *deq = NULL;
        uint8_t *bytes = weight_bytes(DS4_TYPE_Q8_0, 256, 8, false, &deq);
        op_weight *w = op_weight_make(&p, "blk.0.attn_output_a.weight", DS4_TYPE_Q8_0, 256, 8, 1, bytes);
        op_buf x = op_buf_poisoned(&p, 1024), y = op_buf_poisoned(&p, 16);
        const ds4_backend_ops *g = p.gpu->ops;
        const int32_t pos0 = 3;
        g->rope_matmul_grouped(p.gpu, &w->g, 2, 4, x.g, 3, 128, &pos0, &plain, y.g, 8, 1, DS4_NUMERICS_DS4);
        op_expect_error_with(&p, "rope_matmul_grouped 3 heads of 128", "rope_matmul_grouped", "3 heads of 128",
                             "attn_output_a", NULL);
        g->rope_matmul_grouped(p.gpu, &w->g, 2, 4, x.g, 4, 128, &pos0, NULL, y.g, 8, 1, DS4_NUMERICS_DS4);
        op_expect_error_with(&p, "rope_matmul_grouped without a RoPE", "rope_tail", "no RoPE", NULL);
        g->rope_matmul_grouped(p.gpu, &w->g, 2, 4, x.g, 4, 128, NULL, &plain, y.g, 8, 1, DS4_NUMERICS_DS4);
        op_expect_error_with(&p, "rope_matmul_grouped without positions", "rope_tail", "positions", NULL);
        g->rope_matmul_grouped(p.gpu, &w->g, 4, 4, x.g, 8, 128, &pos0, &plain, y.g, 16, 1, DS4_NUMERICS_DS4);
        op_expect_error_with(&p, "rope_matmul_grouped past the weight", "matmul_grouped", "4 groups of 4", NULL);
        ds4_weight unbound = w->g;
        unbound.device = NULL;
        g->rope_matmul_grouped(p.gpu, &unbound, 2, 4, x.g, 4, 128, &pos0, &plain, y.g, 8, 1, DS4_NUMERICS_DS4);
        op_expect_error_with(&p, "rope_matmul_grouped unbound", "rope_matmul_grouped", "not bound", NULL);
        op_buf_free(&p, &x);
        op_buf_free(&p, &y);
        op_weight_free(&p, w);
        free(bytes);
        free(deq);
    }
    rope_grouped_case(&p, 8, 4096, 1024, 512, &yarn, 1, 2048, true); /* after the errors */
    op_pair_close(&p);
}

static void test_matvec_pack(void) {
    OPEN_PAIR(p);
    pack_plain_case(&p, DS4_TYPE_Q2_K, 1024, 70001);    /* 6 rows a stage, warps of 8: stages of 6 and 2 */
    pack_plain_case(&p, DS4_TYPE_Q2_K, 2048, 40001);    /* 3 a stage, warps of 4: 3 and 1 */
    pack_plain_case(&p, DS4_TYPE_IQ2_XXS, 2048, 40001); /* 4 a stage, warps of 4 */
    pack_plain_case(&p, DS4_TYPE_IQ2_XXS, 4096, 20001); /* 2 a stage, warps of 2 */
    /* Q8_0 rows of 32 blocks (q_b's), 2 a stage: warps of 4 rows, with the
     * activations quantised by the kernel itself (at most 1,056 blocks of
     * 32 rows) and by the quantiser kernel */
    pack_plain_case(&p, DS4_TYPE_Q8_0, 1024, 32773);
    pack_plain_case(&p, DS4_TYPE_Q8_0, 1024, 40001);
    /* the experts: gate/up rows of 16 IQ2_XXS blocks with down rows of 4 Q2_K
     * blocks, and of 8 with 8 (warps of 8 rows: stages of 3, 3 and 2 for the down) */
    for (int64_t nr = 1; nr <= 3; nr += 2) {
        pack_moe_case(&p, 4096, 1024, nr);
        pack_moe_case(&p, 2048, 2048, nr);
    }
    op_pair_close(&p);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_matmul_f32),
    TEST_ENTRY(test_matmul_f16),
    TEST_ENTRY(test_matmul_bf16),
    TEST_ENTRY(test_matmul_q8_0),
    TEST_ENTRY(test_matmul_q2_K),
    TEST_ENTRY(test_matmul_q4_K),
    TEST_ENTRY(test_matmul_q5_K),
    TEST_ENTRY(test_matmul_q6_K),
    TEST_ENTRY(test_matmul_iq2_xxs),
    TEST_ENTRY(test_matmul_q8_K),
    TEST_ENTRY(test_matmul_act_quant_bitexact),
    TEST_ENTRY(test_matmul_empty),
    TEST_ENTRY(test_matmul_errors),
    TEST_ENTRY(test_matmul_grouped_f32),
    TEST_ENTRY(test_matmul_grouped_f16),
    TEST_ENTRY(test_matmul_grouped_bf16),
    TEST_ENTRY(test_matmul_grouped_q8_0),
    TEST_ENTRY(test_gemm_bm),
    TEST_ENTRY(test_matmul_grouped_q2_K),
    TEST_ENTRY(test_matmul_grouped_q4_K),
    TEST_ENTRY(test_matmul_grouped_iq2_xxs),
    TEST_ENTRY(test_matmul_grouped_errors),
    TEST_ENTRY(test_matmul_multi),
    TEST_ENTRY(test_matmul_multi_add),
    TEST_ENTRY(test_matmul_multi_errors),
    TEST_ENTRY(test_matvec_quantises_x),
    TEST_ENTRY(test_moe_iq2_xxs),
    TEST_ENTRY(test_moe_q2_K),
    TEST_ENTRY(test_moe_q4_K),
    TEST_ENTRY(test_moe_q8_0),
    TEST_ENTRY(test_moe_f16),
    TEST_ENTRY(test_moe_mixed),
    TEST_ENTRY(test_moe_launches),
    TEST_ENTRY(test_moe_grouped),
    TEST_ENTRY(test_moe_mma),
    TEST_ENTRY(test_moe_mma_rows),
    TEST_ENTRY(test_moe_wide_rows),
    TEST_ENTRY(test_moe_errors),
    TEST_ENTRY(test_moe_bad_expert),
    TEST_ENTRY(test_matvec_pack),
    TEST_ENTRY(test_step_branch),
    TEST_ENTRY(test_step_branch_beside),
    TEST_ENTRY(test_step_branch_beside_slots),
    TEST_ENTRY(test_prefetch),
    TEST_ENTRY(test_matvec_xs),
    TEST_ENTRY(test_rope_matmul_grouped),
    TEST_ENTRY(test_matvec_grouped_quantises_x),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

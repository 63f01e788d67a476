/*
 * test_cpu_ops.c - every op of the CPU backend against an independent
 * float64 computation written here, plus DS4's rounding primitives.
 *
 * Inputs are fresh random numbers each run (the harness prints the seed).
 * Tolerances follow from the precision of the op under test: an op computed
 * in float32 is compared against float64 with a bound of a few float ulps
 * per rounding step (2^-24 = 6e-8 relative each), scaled by the sum of
 * absolute terms where there are sums (the usual bound for a float sum of n
 * terms is n * 2^-24 * sum|terms|; ours are split in 8 lanes, so n/8 + 3).
 *
 * DS4_BENCH=1 also runs the matmul throughput benchmark (test_bench_matmul).
 */
#include <float.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backends/backend.h"
#include "core/quant.h"
#include "core/rounding.h"
#include "session/sampling.h"
#include "test.h"

#define EPS32 5.960464477539063e-08 /* 2^-24: float's unit roundoff */

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

static ds4_backend *new_backend(int n_threads) {
    ds4_backend *be = NULL;
    ds4_error err = { 0 };
    ds4_status st = ds4_backend_create("cpu", n_threads, &be, &err);
    CHECK_MSG(st == DS4_OK && be, "%s", err.message);
    return be;
}

/* The backend's pending error (DS4_OK if none); its message into msg. */
static ds4_status take_error(ds4_backend *be, char *msg, size_t cap) {
    ds4_error err = { 0 };
    ds4_status st = be->ops->take_error(be, &err);
    if (msg) snprintf(msg, cap, "%s", st == DS4_OK ? "" : err.message);
    return st;
}

static void expect_no_error(ds4_backend *be) {
    char msg[DS4_ERROR_MSG_MAX];
    ds4_status st = take_error(be, msg, sizeof msg);
    CHECK_MSG(st == DS4_OK, "unexpected backend error: %s", msg);
}

static float *fvec(int64_t n) {
    float *p = calloc((size_t)(n > 0 ? n : 1), sizeof *p);
    if (!p) abort();
    return p;
}

static double *dvec(int64_t n) {
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof *p);
    if (!p) abort();
    return p;
}

static void fill_normal(float *x, int64_t n, double sd) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(test_rand_normal() * sd);
}

/* A weight built from floats by the type's reference quantiser. */
typedef struct test_weight {
    ds4_weight w;
    void *data;
} test_weight;

static void weight_make(test_weight *tw, const char *name, uint32_t type, int64_t n_in, int64_t n_rows,
                        const float *src) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    const int64_t rb = ds4_type_row_bytes(type, n_in);
    tw->data = malloc((size_t)(rb * n_rows));
    if (!t || rb <= 0 || !tw->data) abort();
    for (int64_t r = 0; r < n_rows; r++) t->quantize_row(src + r * n_in, (uint8_t *)tw->data + r * rb, n_in);
    tw->w = (ds4_weight){ name, type, { n_in, n_rows, 1, 1 }, rb, tw->data, NULL, NULL };
}

static void weight_free(test_weight *tw) { free(tw->data); }

/* Row r of a weight, dequantised by the format's reference dequantiser. */
static void weight_row(const ds4_weight *w, int64_t r, float *dst) {
    ds4_type_traits_get(w->type)->dequant_row((const uint8_t *)w->host + r * w->row_bytes, dst, w->ne[0]);
}

static double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }
static double silu_d(double x) { return x * sigmoid_d(x); }

/* ------------------------------------------------------------------------ */
/* Rounding primitives                                                       */
/* ------------------------------------------------------------------------ */

/* E4M3FN decoded from the spec's formula (code bits: s eeee mmm). */
static double e4m3_value(int code) {
    const int e = (code >> 3) & 15, m = code & 7;
    const double v = e == 0 ? m * ldexp(1.0, -9) : (1.0 + m / 8.0) * ldexp(1.0, e - 7);
    return (code & 0x80) ? -v : v;
}

static const double E2M1[8] = { 0, 0.5, 1, 1.5, 2, 3, 4, 6 };

/* Nearest of a sorted magnitude table, ties to the even index (naive scan). */
static double nearest_even(const double *table, int n, double a) {
    int best = 0;
    for (int i = 1; i < n; i++) {
        const double db = fabs(a - table[best]), di = fabs(a - table[i]);
        if (di < db || (di == db && (i & 1) == 0)) best = i;
    }
    return table[best];
}

static double e4m3_table[127];

static double naive_fp8(double v) {
    if (!e4m3_table[1]) {
        for (int c = 0; c < 127; c++) e4m3_table[c] = e4m3_value(c);
    }
    const double a = fmin(fabs(v), 448.0);
    return copysign(nearest_even(e4m3_table, 127, a), v);
}

static double naive_fp4(double v) { return copysign(nearest_even(E2M1, 8, fmin(fabs(v), 6.0)), v); }

static void test_fp8_codes(void) {
    /* Every one of the 256 codes round-trips exactly, except the two NaNs. */
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) {
            CHECK(isnan(ds4_round_fp8_e4m3(NAN)));
            continue;
        }
        const float v = (float)e4m3_value(c);
        const float r = ds4_round_fp8_e4m3(v);
        CHECK_MSG(memcmp(&r, &v, sizeof r) == 0, "code %d: %g -> %g", c, v, r);
    }
    /* Midpoints between consecutive codes go to the even code; a hair to
     * either side goes to the nearer one. */
    for (int c = 0; c < 126; c++) {
        const double lo = e4m3_value(c), hi = e4m3_value(c + 1);
        const float mid = (float)((lo + hi) / 2); /* exact: 5 significant bits */
        const double even = (c & 1) ? hi : lo;
        CHECK_MSG(ds4_round_fp8_e4m3(mid) == (float)even, "mid %d: %g -> %g", c, mid, ds4_round_fp8_e4m3(mid));
        CHECK(ds4_round_fp8_e4m3(-mid) == (float)-even);
        CHECK(ds4_round_fp8_e4m3(nextafterf(mid, 0.0f)) == (float)lo);
        CHECK(ds4_round_fp8_e4m3(nextafterf(mid, 1e9f)) == (float)hi);
    }
    /* Saturation beyond 448 (E4M3FN has no infinity). */
    const float big[] = { 448.0f, 449.0f, 464.0f, 480.0f, 1e6f, FLT_MAX, INFINITY };
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        CHECK(ds4_round_fp8_e4m3(big[i]) == 448.0f);
        CHECK(ds4_round_fp8_e4m3(-big[i]) == -448.0f);
    }
    CHECK(signbit(ds4_round_fp8_e4m3(-0.0f)) && ds4_round_fp8_e4m3(-0.0f) == 0.0f);
    CHECK(ds4_round_fp8_e4m3(1e-30f) == 0.0f);
    /* Random magnitudes over the whole range against the naive scan. */
    for (int i = 0; i < 20000; i++) {
        const float v = (float)(exp(test_rand_uniform() * 20.0 - 14.0) * (test_rand_u64() & 1 ? 1 : -1));
        CHECK_MSG(ds4_round_fp8_e4m3(v) == (float)naive_fp8(v), "%.9g", v);
    }
}

static void test_fp4_codes(void) {
    for (int c = 0; c < 16; c++) {
        const float v = (float)((c & 8) ? -E2M1[c & 7] : E2M1[c & 7]);
        const float r = ds4_round_fp4_e2m1(v);
        CHECK_MSG(memcmp(&r, &v, sizeof r) == 0, "code %d: %g -> %g", c, v, r);
    }
    for (int i = 0; i < 7; i++) {
        const float mid = (float)((E2M1[i] + E2M1[i + 1]) / 2);
        const double even = (i & 1) ? E2M1[i + 1] : E2M1[i];
        CHECK_MSG(ds4_round_fp4_e2m1(mid) == (float)even, "mid %g -> %g", mid, ds4_round_fp4_e2m1(mid));
        CHECK(ds4_round_fp4_e2m1(-mid) == (float)-even);
        CHECK(ds4_round_fp4_e2m1(nextafterf(mid, 0.0f)) == (float)E2M1[i]);
        CHECK(ds4_round_fp4_e2m1(nextafterf(mid, 100.0f)) == (float)E2M1[i + 1]);
    }
    CHECK(ds4_round_fp4_e2m1(7.0f) == 6.0f);
    CHECK(ds4_round_fp4_e2m1(-1e30f) == -6.0f);
    CHECK(ds4_round_fp4_e2m1(INFINITY) == 6.0f);
    CHECK(isnan(ds4_round_fp4_e2m1(NAN)));
    for (int i = 0; i < 20000; i++) {
        const float v = (float)((test_rand_uniform() * 16.0 - 8.0));
        CHECK_MSG(ds4_round_fp4_e2m1(v) == (float)naive_fp4(v), "%.9g", v);
    }
}

static void test_f16_round(void) {
    CHECK(ds4_round_f16(1.0f + ldexpf(1.0f, -11)) == 1.0f);                          /* tie to even */
    CHECK(ds4_round_f16(1.0f + 3 * ldexpf(1.0f, -11)) == 1.0f + ldexpf(1.0f, -9)); /* tie to even (up) */
    CHECK(ds4_round_f16(65504.0f) == 65504.0f);
    CHECK(isinf(ds4_round_f16(65520.0f)));
    CHECK(ds4_round_f16(ldexpf(1.0f, -24)) == ldexpf(1.0f, -24)); /* smallest subnormal */
    CHECK(ds4_round_f16(ldexpf(1.0f, -25)) == 0.0f);             /* tie to 0 */
    for (int i = 0; i < 10000; i++) {
        const float v = (float)(test_rand_normal() * 100.0);
        const float r = ds4_round_f16(v);
        CHECK(fabs((double)r - v) <= fabs((double)v) * ldexp(1.0, -11) + ldexp(1.0, -25));
    }
}

/* 2^ceil(log2(a)) for a > 0, exactly (frexp: a = f * 2^e, f in [0.5, 1)). */
static double pow2_ceil(double a) {
    int e;
    const double f = frexp(a, &e);
    return ldexp(1.0, f == 0.5 ? e - 1 : e);
}

/* Spec 3.0 block rounding, computed here in double with the naive tables.
 * Returns false for a block whose amax / max lies within 2^-20 above a power
 * of two: there ceil(log2()) in float (ds4's log2f) may round down to the
 * power itself, a legitimate implementation difference the comparison skips
 * (random data lands there with probability ~1e-6 per block). */
static bool naive_block_round(float *x, int64_t n, double amax_floor, double max_mag, double (*rnd)(double)) {
    double amax = 0;
    for (int64_t i = 0; i < n; i++) amax = fmax(amax, fabs(x[i]));
    /* The library divides amax / max in float, as ds4 does. */
    const double q = (double)((float)fmax(amax, amax_floor) / (float)max_mag);
    int e;
    const double f = frexp(q, &e);
    const double scale = pow2_ceil(q);
    for (int64_t i = 0; i < n; i++) {
        const double v = fmax(-max_mag, fmin(max_mag, x[i] / scale));
        x[i] = (float)(rnd(v) * scale);
    }
    return !(f > 0.5 && f < 0.5 * (1 + ldexp(1.0, -20)));
}

static void test_fp8_kv_row(void) {
    const int64_t dim = 512, n_rope = 64;
    float *x = fvec(dim), *y = fvec(dim), *want = fvec(dim);
    for (int trial = 0; trial < 50; trial++) {
        fill_normal(x, dim, exp(test_rand_uniform() * 10 - 5));
        if (trial == 1) memset(x, 0, 64 * sizeof *x); /* an all-zero block: amax floor 1e-4 */
        if (trial == 2) x[70] = 1000.0f;              /* one outlier dominates its block */
        memcpy(y, x, (size_t)dim * sizeof *x);
        memcpy(want, x, (size_t)dim * sizeof *x);
        ds4_fp8_kv_round_row(y, dim, n_rope);
        bool comparable = true;
        for (int64_t off = 0; off < dim - n_rope; off += 64)
            comparable &= naive_block_round(want + off, 64, 1e-4, 448.0, naive_fp8);
        if (comparable) CHECK(memcmp(y, want, (size_t)dim * sizeof *y) == 0);
        CHECK(memcmp(y + dim - n_rope, x + dim - n_rope, (size_t)n_rope * sizeof *x) == 0); /* RoPE dims untouched */
    }
    /* A value that scales onto an E4M3 midpoint ties to the even code: block
     * amax 448 gives scale 1, and 19 lies between 18 (code 0x51) and 20 (0x52). */
    float row[64] = { 448.0f, 19.0f, 17.0f, -19.0f };
    ds4_fp8_kv_round_row(row, 64, 0);
    CHECK(row[0] == 448.0f && row[1] == 20.0f && row[2] == 16.0f && row[3] == -20.0f);
    free(x);
    free(y);
    free(want);
}

static void test_hadamard(void) {
    const int64_t n = 128;
    float *x = fvec(n), *y = fvec(n);
    fill_normal(x, n, 1.0);
    memcpy(y, x, (size_t)n * sizeof *x);
    ds4_hadamard_row(y, n);
    /* Against the Sylvester matrix H[i][j] = (-1)^popcount(i & j) / sqrt(n):
     * 7 float butterfly levels, then one scaling: <= 8 roundings of values
     * bounded by sum|x| / sqrt(n). */
    double sum_abs = 0;
    for (int64_t j = 0; j < n; j++) sum_abs += fabs(x[j]);
    for (int64_t i = 0; i < n; i++) {
        double h = 0;
        for (int64_t j = 0; j < n; j++) h += (__builtin_popcountll((unsigned long long)(i & j)) & 1 ? -x[j] : x[j]);
        h /= sqrt((double)n);
        CHECK_NEAR(y[i], h, 8 * EPS32 * sum_abs);
    }
    /* Orthonormal and symmetric: applying it twice returns x. */
    ds4_hadamard_row(y, n);
    for (int64_t i = 0; i < n; i++) CHECK_NEAR(y[i], x[i], 16 * EPS32 * sum_abs / sqrt((double)n));
    free(x);
    free(y);
}

static void test_indexer_qat_row(void) {
    const int64_t n = 128;
    float *x = fvec(n), *want = fvec(n);
    for (int trial = 0; trial < 50; trial++) {
        fill_normal(x, n, exp(test_rand_uniform() * 8 - 4));
        memcpy(want, x, (size_t)n * sizeof *x);
        ds4_indexer_qat_row(x, n);
        ds4_hadamard_row(want, n); /* checked above */
        bool comparable = true;
        for (int64_t off = 0; off < n; off += 32)
            comparable &= naive_block_round(want + off, 32, 7.052966104933725e-38, 6.0, naive_fp4);
        if (comparable) CHECK(memcmp(x, want, (size_t)n * sizeof *x) == 0);
    }
    free(x);
    free(want);
}

/* ------------------------------------------------------------------------ */
/* Creation, memory and elementwise ops                                      */
/* ------------------------------------------------------------------------ */

static void test_backend_create(void) {
    ds4_backend *be = NULL;
    ds4_error err = { 0 };
    CHECK(ds4_backend_create(NULL, 1, &be, &err) == DS4_OK && be && strcmp(be->ops->name, "cpu") == 0);
    ds4_backend_destroy(be);
    CHECK(ds4_backend_create("cpu", 0, &be, &err) == DS4_OK && be && be->n_threads >= 1);
    ds4_backend_destroy(be);
    be = NULL;
    CHECK(ds4_backend_create("cuda", 1, &be, &err) == DS4_ERR_UNSUPPORTED && !be);
    CHECK(strstr(err.message, "CUDA") != NULL);
    CHECK(ds4_backend_create("tpu", 1, &be, &err) == DS4_ERR_INVALID && !be);
    CHECK(strstr(err.message, "tpu") != NULL);
    ds4_backend_destroy(NULL);
}

/* Every op the model needs is in the CPU table; the optional step
 * recording ops are not (the CPU runs each op as it is called, so there is
 * nothing to record). */
static void test_op_table(void) {
    ds4_backend *be = new_backend(1);
    const ds4_backend_ops *o = be->ops;
    CHECK(o->alloc && o->free && o->upload && o->download && o->copy && o->fill && o->repeat_rows && o->bind_weight &&
          o->release_weight && o->embed && o->rmsnorm && o->add && o->add_weight_row && o->add_weight_rows_mod && o->round_f16 &&
          o->round_fp8_kv && o->indexer_qat && o->matmul && o->matmul_grouped && o->matmul_multi && o->rope_tail && o->head_norm_rope && o->hc_pre && o->hc_pre_norm && o->hc_post_pre_norm &&
          o->hc_post && o->hc_head && o->attention && o->compressor_pool && o->indexer_scores && o->top_k &&
          o->indexer_scores_rows && o->top_k_rows && o->attention_rows_sel &&
          o->router && o->swiglu && o->moe && o->take_error && o->copy_rows && o->add_weight_rows_at &&
          o->attention_rows && o->attention_states && o->compressor_pool_states);
    CHECK(!o->step_begin && !o->step_end && !o->step_mark);
    CHECK(!o->branch_begin && !o->branch_end && !o->branch_join); /* runs ops in call order */
    CHECK(!o->head_norm_rope2); /* the model makes the two head_norm_rope calls */
    CHECK(!o->attention_rows_f16); /* the model calls attention_rows / attention_rows_sel */
    CHECK(!o->indexer_scores_rows_f16); /* ... and indexer_scores_rows */
    CHECK(!o->rope_matmul_grouped); /* the model makes the rope_tail and matmul_grouped calls */
    CHECK(!o->prefetch);        /* weights are read from host memory where they lie */
    ds4_backend_destroy(be);
}

static void test_memory_ops(void) {
    ds4_backend *be = new_backend(2);
    const int64_t n = 1000;
    float *a = be->ops->alloc(be, n), *b = be->ops->alloc(be, n), *c = be->ops->alloc(be, n);
    float *h = fvec(n), *g = fvec(n);
    CHECK(a && b && c && ((uintptr_t)a & 63) == 0);
    for (int64_t i = 0; i < n; i++) CHECK(a[i] == 0.0f);
    fill_normal(h, n, 1.0);
    be->ops->upload(be, a, h, n);
    be->ops->copy(be, b, a, n);
    be->ops->fill(be, c, 2.5f, n);
    be->ops->add(be, b, c, c, n);
    be->ops->download(be, g, c, n);
    for (int64_t i = 0; i < n; i++) CHECK(g[i] == h[i] + 2.5f);
    /* repeat_rows: 5 rows of 50, each 4 times (1000 floats from 250) */
    be->ops->repeat_rows(be, b, a, 5, 50, 4);
    be->ops->download(be, g, b, n);
    for (int64_t i = 0; i < n; i++) CHECK(g[i] == h[(i / 50 / 4) * 50 + i % 50]);
    be->ops->repeat_rows(be, b, a, 5, -1, 4);
    CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
    /* copy_rows: 7 rows of 30 of a to scattered places of c (rows 3 i + 1 apart, reversed), the rest kept */
    be->ops->fill(be, c, -1.0f, n);
    float *dsts[7];
    const float *srcs[7];
    for (int i = 0; i < 7; i++) dsts[i] = c + (3 * (6 - i) + 1) * 30 + i, srcs[i] = a + 30 * i;
    be->ops->copy_rows(be, dsts, srcs, 30, 7);
    be->ops->download(be, g, c, n);
    int64_t written = 0;
    for (int i = 0; i < 7; i++)
        for (int j = 0; j < 30; j++) CHECK(g[dsts[i] - c + j] == h[30 * i + j]);
    for (int64_t i = 0; i < n; i++) written += g[i] != -1.0f;
    CHECK_EQ_INT(written, 7 * 30);
    be->ops->copy_rows(be, dsts, srcs, 30, 0); /* nothing */
    expect_no_error(be);
    be->ops->copy_rows(be, dsts, srcs, -1, 7);
    CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
    dsts[3] = NULL;
    be->ops->copy_rows(be, dsts, srcs, 30, 7);
    CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
    be->ops->free(be, a);
    be->ops->free(be, b);
    be->ops->free(be, c);
    expect_no_error(be);
    free(h);
    free(g);
    ds4_backend_destroy(be);
}

/* bind_synthetic: the weight's bytes are every block of the fill, held by
 * the backend (w->owned, w->host) until release_weight frees them; a fill
 * that does not suit the weight (another type, a block size of another
 * type, a type the generator cannot make) is refused, naming the weight. */
static void test_bind_synthetic(void) {
    ds4_backend *be = new_backend(1);
    ds4_error err = { 0 };
    const uint32_t types[] = { DS4_TYPE_F32, DS4_TYPE_F16, DS4_TYPE_Q8_0, DS4_TYPE_Q2_K, DS4_TYPE_Q4_K,
                               DS4_TYPE_IQ2_XXS };
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        const ds4_type_traits *t = ds4_type_traits_get(types[k]);
        ds4_fill f;
        memset(&f, 0, sizeof f);
        f.stream = 77 + k;
        f.type = types[k];
        f.block_bytes = t->block_bytes;
        f.block_elems = t->block_elems;
        f.half = 0.5f;
        f.f16_exp = 14;
        f.d16[0] = 0x2000;
        f.d16[1] = 0x1c00;
        ds4_weight w = { "blk.0.synthetic.weight", types[k], { 512, 3, 1, 1 }, ds4_type_row_bytes(types[k], 512),
                         NULL, NULL, NULL };
        CHECK(be->ops->bind_synthetic(be, &w, &f, &err) == DS4_OK);
        CHECK(w.host != NULL && w.owned == w.host && w.device == NULL);
        if (!w.host) continue;
        const int64_t bytes = w.row_bytes * 3;
        uint8_t *want = malloc((size_t)bytes);
        for (int64_t b = 0; b < bytes / t->block_bytes; b++) ds4_fill_block(&f, b, want + b * t->block_bytes);
        CHECK_MSG(memcmp(want, w.host, (size_t)bytes) == 0, "%s", t->name);
        free(want);
        float x[512], y[3];
        fill_normal(x, 512, 1.0);
        be->ops->matmul(be, &w, 0, 3, x, 512, y, 3, 1, DS4_NUMERICS_DS4); /* it computes like any weight */
        CHECK(take_error(be, NULL, 0) == DS4_OK && isfinite(y[0]) && isfinite(y[2]));
        be->ops->release_weight(be, &w);
        CHECK(w.host == NULL && w.owned == NULL);
    }
    ds4_fill f;
    memset(&f, 0, sizeof f);
    f.type = DS4_TYPE_Q8_0;
    f.block_bytes = 34;
    f.block_elems = 32;
    ds4_weight w = { "blk.0.mismatch.weight", DS4_TYPE_Q4_K, { 256, 1, 1, 1 }, 144, NULL, NULL, NULL };
    CHECK(be->ops->bind_synthetic(be, &w, &f, &err) == DS4_ERR_INVALID && !w.owned && !w.host);
    CHECK(strstr(err.message, "blk.0.mismatch.weight") != NULL);
    f.type = DS4_TYPE_Q4_K; /* the right type, another type's block size */
    CHECK(be->ops->bind_synthetic(be, &w, &f, &err) == DS4_ERR_INVALID);
    ds4_weight w5 = { "blk.0.q5.weight", DS4_TYPE_Q5_K, { 256, 1, 1, 1 }, 176, NULL, NULL, NULL };
    f.type = DS4_TYPE_Q5_K;
    f.block_bytes = 176;
    CHECK(be->ops->bind_synthetic(be, &w5, &f, &err) == DS4_ERR_INVALID);
    ds4_backend_destroy(be);
}

static void test_bind_weight(void) {
    ds4_backend *be = new_backend(1);
    ds4_error err = { 0 };
    float src[64];
    fill_normal(src, 64, 1.0);
    test_weight tw;
    weight_make(&tw, "blk.0.attn_q_a.weight", DS4_TYPE_Q8_0, 64, 1, src);
    tw.w.device = (void *)1;
    CHECK(be->ops->bind_weight(be, &tw.w, &err) == DS4_OK && tw.w.device == NULL);
    be->ops->release_weight(be, &tw.w);
    ds4_weight q40 = { "blk.1.ffn_down.weight", DS4_TYPE_Q4_0, { 64, 1, 1, 1 }, 36, tw.data, NULL, NULL };
    CHECK(be->ops->bind_weight(be, &q40, &err) == DS4_ERR_UNSUPPORTED);
    CHECK(strstr(err.message, "blk.1.ffn_down.weight") && strstr(err.message, "Q4_0"));
    /* integer tables (tid2eid) bind: the model reads them from host memory */
    int32_t ids[12] = { 0 };
    ds4_weight i32 = { "blk.0.ffn_gate_tid2eid.weight", DS4_TYPE_I32, { 6, 2, 1, 1 }, 24, ids, NULL, NULL };
    CHECK(be->ops->bind_weight(be, &i32, &err) == DS4_OK);
    ds4_weight bad_rb = tw.w;
    bad_rb.row_bytes = 35;
    CHECK(be->ops->bind_weight(be, &bad_rb, &err) == DS4_ERR_INVALID);
    /* An op on a type with no dequantiser records an error naming the weight. */
    float x[64] = { 0 }, y[1];
    be->ops->matmul(be, &q40, 0, 1, x, 64, y, 1, 1, DS4_NUMERICS_DS4);
    char msg[DS4_ERROR_MSG_MAX];
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_UNSUPPORTED && strstr(msg, "blk.1.ffn_down.weight"));
    CHECK(take_error(be, NULL, 0) == DS4_OK); /* taking clears it */
    be->ops->matmul(be, &tw.w, 0, 2, x, 64, y, 1, 1, DS4_NUMERICS_DS4); /* rows 0..1 of a 1-row weight */
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
    weight_free(&tw);
    ds4_backend_destroy(be);
}

static void test_embed(void) {
    ds4_backend *be = new_backend(1);
    const int64_t dim = 48, vocab = 20;
    float *src = fvec(dim * vocab), *out = fvec(3 * dim), *row = fvec(dim);
    fill_normal(src, dim * vocab, 1.0);
    const uint32_t types[] = { DS4_TYPE_F16, DS4_TYPE_F32 };
    for (int t = 0; t < 2; t++) {
        test_weight tw;
        weight_make(&tw, "token_embd.weight", types[t], dim, vocab, src);
        const int32_t tokens[3] = { 7, 0, 19 };
        be->ops->embed(be, &tw.w, tokens, 3, out);
        expect_no_error(be);
        for (int r = 0; r < 3; r++) {
            weight_row(&tw.w, tokens[r], row);
            CHECK(memcmp(out + r * dim, row, (size_t)dim * sizeof *row) == 0);
        }
        const int32_t bad = 20;
        be->ops->embed(be, &tw.w, &bad, 1, out);
        CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
        weight_free(&tw);
    }
    free(src);
    free(out);
    free(row);
    ds4_backend_destroy(be);
}

static void test_rmsnorm(void) {
    ds4_backend *be = new_backend(2);
    const int64_t rows = 5, dim = 300;
    float *x = fvec(rows * dim), *out = fvec(rows * dim), *wsrc = fvec(dim);
    fill_normal(x, rows * dim, 3.0);
    fill_normal(wsrc, dim, 1.0);
    test_weight w;
    weight_make(&w, "attn_norm.weight", DS4_TYPE_F32, dim, 1, wsrc);
    const float eps = 1e-6f;
    for (int weighted = 0; weighted < 2; weighted++) {
        be->ops->rmsnorm(be, x, weighted ? &w.w : NULL, eps, out, rows, dim);
        for (int64_t r = 0; r < rows; r++) {
            double ss = 0;
            for (int64_t i = 0; i < dim; i++) ss += (double)x[r * dim + i] * x[r * dim + i];
            const double scale = 1.0 / sqrt(ss / dim + eps);
            /* float: mean -> float, + eps, sqrtf, 1/, x*scale, *w: <= 6 roundings */
            for (int64_t i = 0; i < dim; i++) {
                const double want = x[r * dim + i] * scale * (weighted ? wsrc[i] : 1.0);
                CHECK_NEAR(out[r * dim + i], want, 6 * EPS32 * fabs(want));
            }
        }
    }
    /* In place (out == x) gives the same numbers. */
    float *y = fvec(rows * dim);
    memcpy(y, x, (size_t)(rows * dim) * sizeof *x);
    be->ops->rmsnorm(be, y, &w.w, eps, y, rows, dim);
    CHECK(memcmp(y, out, (size_t)(rows * dim) * sizeof *y) == 0);
    expect_no_error(be);
    weight_free(&w);
    free(x);
    free(y);
    free(out);
    free(wsrc);
    ds4_backend_destroy(be);
}

/* add_weight_row: one table row added to every row; add_weight_rows_mod:
 * row r gets table row (first + r) mod R, past the table's end and around
 * it more than once. Rows outside the table are refused. */
static void test_add_weight_row(void) {
    ds4_backend *be = new_backend(1);
    const int64_t dim = 32, n = 6, rows = 3, mrows = 15;
    float *src = fvec(dim * n), *x = fvec(mrows * dim), *x0 = fvec(mrows * dim), *row = fvec(dim);
    fill_normal(src, dim * n, 1.0);
    fill_normal(x, rows * dim, 1.0);
    memcpy(x0, x, (size_t)(rows * dim) * sizeof *x);
    test_weight tw;
    weight_make(&tw, "steer", DS4_TYPE_F16, dim, n, src);
    be->ops->add_weight_row(be, x, &tw.w, 4, rows);
    weight_row(&tw.w, 4, row);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < dim; i++) CHECK(x[r * dim + i] == x0[r * dim + i] + row[i]);
    expect_no_error(be);
    be->ops->add_weight_row(be, x, &tw.w, 6, rows);
    CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
    for (int64_t first = 0; first < n; first += 5) {
        fill_normal(x, mrows * dim, 1.0);
        memcpy(x0, x, (size_t)(mrows * dim) * sizeof *x);
        be->ops->add_weight_rows_mod(be, x, &tw.w, first, mrows);
        expect_no_error(be);
        for (int64_t r = 0; r < mrows; r++) {
            weight_row(&tw.w, (first + r) % n, row);
            for (int64_t i = 0; i < dim; i++) CHECK(x[r * dim + i] == x0[r * dim + i] + row[i]);
        }
    }
    be->ops->add_weight_rows_mod(be, x, &tw.w, n, mrows);
    CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
    be->ops->add_weight_rows_mod(be, x, &tw.w, -1, mrows);
    CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
    /* add_weight_rows_at: rows of positions of their own (a batch of states) */
    {
        int64_t at[15];
        for (int64_t r = 0; r < mrows; r++) at[r] = (r * 7 + 3) % n;
        fill_normal(x, mrows * dim, 1.0);
        memcpy(x0, x, (size_t)(mrows * dim) * sizeof *x);
        be->ops->add_weight_rows_at(be, x, &tw.w, at, mrows);
        expect_no_error(be);
        for (int64_t r = 0; r < mrows; r++) {
            weight_row(&tw.w, at[r], row);
            for (int64_t i = 0; i < dim; i++) CHECK(x[r * dim + i] == x0[r * dim + i] + row[i]);
        }
        at[9] = n; /* outside the table: refused before any row changes */
        memcpy(x0, x, (size_t)(mrows * dim) * sizeof *x);
        be->ops->add_weight_rows_at(be, x, &tw.w, at, mrows);
        char msg[DS4_ERROR_MSG_MAX], want[64];
        CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
        snprintf(want, sizeof want, "row 9 asks for row %lld of", (long long)n);
        CHECK_MSG(strstr(msg, want) != NULL, "add_weight_rows_at's message: %s", msg);
        CHECK(memcmp(x, x0, (size_t)(mrows * dim) * sizeof *x) == 0);
        be->ops->add_weight_rows_at(be, x, &tw.w, NULL, mrows);
        CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
        CHECK_MSG(strstr(msg, "without their table rows") != NULL, "add_weight_rows_at's message: %s", msg);
    }
    weight_free(&tw);
    free(src);
    free(x);
    free(x0);
    free(row);
    ds4_backend_destroy(be);
}

/* The rounding ops are the scalar primitives applied row by row. */
static void test_rounding_ops(void) {
    ds4_backend *be = new_backend(1);
    const int64_t rows = 3, dim = 512, qdim = 128;
    float *x = fvec(rows * dim), *y = fvec(rows * dim);
    fill_normal(x, rows * dim, 10.0);
    memcpy(y, x, (size_t)(rows * dim) * sizeof *x);
    be->ops->round_f16(be, y, rows * dim);
    for (int64_t i = 0; i < rows * dim; i++) CHECK(y[i] == ds4_round_f16(x[i]));
    memcpy(y, x, (size_t)(rows * dim) * sizeof *x);
    be->ops->round_fp8_kv(be, y, rows, dim, 64);
    for (int64_t r = 0; r < rows; r++) ds4_fp8_kv_round_row(x + r * dim, dim, 64);
    CHECK(memcmp(x, y, (size_t)(rows * dim) * sizeof *x) == 0);
    fill_normal(x, rows * qdim, 1.0);
    memcpy(y, x, (size_t)(rows * qdim) * sizeof *x);
    be->ops->indexer_qat(be, y, rows, qdim);
    for (int64_t r = 0; r < rows; r++) ds4_indexer_qat_row(x + r * qdim, qdim);
    CHECK(memcmp(x, y, (size_t)(rows * qdim) * sizeof *x) == 0);
    expect_no_error(be);
    be->ops->indexer_qat(be, y, 1, 96);
    CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
    free(x);
    free(y);
    ds4_backend_destroy(be);
}

/* ------------------------------------------------------------------------ */
/* matmul                                                                    */
/* ------------------------------------------------------------------------ */

/* The spec's Q8_0 activation quantiser, written out again: per 32 block
 * d = amax / 127 (float), q = lrint(x * (1/d)), clamp [-128, 127]. Returns
 * the dequantised activation values d * q (exact in double) and the block d. */
static void naive_q8_0_act(const float *x, int64_t n, double *xq) {
    for (int64_t b = 0; b < n / 32; b++) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[b * 32 + j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) {
            long q = lrintf(x[b * 32 + j] * id);
            q = q > 127 ? 127 : q < -128 ? -128 : q;
            xq[b * 32 + j] = (double)d * (double)q;
        }
    }
}

/* The spec's Q8_K quantiser: per 256 block, m = the first element of largest
 * |x|, iscale = -127 / m, q = lrint(iscale * x) clamped, d = 1 / iscale. */
static void naive_q8_K_act(const float *x, int64_t n, double *xq) {
    for (int64_t b = 0; b < n / 256; b++) {
        const float *xb = x + b * 256;
        float amax = 0, m = 0;
        for (int j = 0; j < 256; j++)
            if (fabsf(xb[j]) > amax) amax = fabsf(xb[j]), m = xb[j];
        if (amax == 0) {
            for (int j = 0; j < 256; j++) xq[b * 256 + j] = 0;
            continue;
        }
        const float iscale = -127.0f / m, d = 1.0f / iscale;
        for (int j = 0; j < 256; j++) {
            long q = lrintf(iscale * xb[j]);
            q = q > 127 ? 127 : q < -128 ? -128 : q;
            xq[b * 256 + j] = (double)d * (double)q;
        }
    }
}

typedef struct matmul_case {
    uint32_t type;
    double ds4_rel_tol; /* DS4 numerics: |err| <= tol * sum_i |w_i| |xq_i| */
} matmul_case;

/*
 * DS4-numerics tolerances, relative to S = sum_i |w_i| |x_i| of the exact
 * product of the dequantised weight and the (same) quantised activations:
 *   F32/F16/BF16: float sums in 8 lanes of n/8 = 64 terms: (64 + 4) * 2^-24 = 4e-6.
 *   Q8_0: per block f16(d_w) * d_x rounded, times an exact integer sum, then
 *     a float sum over 16 blocks: (16 + 3) * 2^-24 = 1.1e-6; 2e-6 allowed.
 *   Q2_K..Q6_K, IQ2_XXS: ggml's integer sub-block sums scaled in float, and
 *     the dequantiser's own float products (d * scale, dmin * min) that
 *     the dot forms in another order: ~3 roundings per sub-block (16 per
 *     super-block) plus the block sum, and the Q2_K/Q4_K/Q5_K min terms
 *     cancel against the scale terms, so their rounding is relative to the
 *     larger sum over |d sc q| + |dmin m| (up to ~2x S): 50 * 2^-24 * 2 S = 6e-6,
 *     1e-5 allowed.
 * Measured worst |err| / S over 100 seeds: 6e-8 (every type, DS4 numerics)
 * and 1.3e-8 (REFERENCE, i.e. the final rounding to float).
 * DS4_F16: Q8_0 and F16 weights against the float64 sum of f16(w) f16(x)
 * (their own rounding steps; exact products, one rounding: REFERENCE's
 * tolerance); the other types bit for bit as under DS4.
 */
static const matmul_case MATMUL_CASES[] = {
    { DS4_TYPE_F32, 5e-6 },  { DS4_TYPE_F16, 5e-6 },  { DS4_TYPE_BF16, 5e-6 },
    { DS4_TYPE_Q8_0, 2e-6 }, { DS4_TYPE_Q2_K, 1e-5 }, { DS4_TYPE_Q4_K, 1e-5 },
    { DS4_TYPE_Q5_K, 1e-5 }, { DS4_TYPE_Q6_K, 1e-5 }, { DS4_TYPE_IQ2_XXS, 1e-5 },
};

static void test_matmul_types(void) {
    const int64_t n_in = 512, total_rows = 45, row0 = 3, n_out = 37, n_rows = 3;
    const int64_t x_stride = n_in + 5, out_stride = n_out + 2;
    ds4_backend *be1 = new_backend(1), *be2 = new_backend(2), *be3 = new_backend(3);
    float *src = fvec(n_in * total_rows), *x = fvec(n_rows * x_stride), *wrow = fvec(n_in);
    float *out = fvec(n_rows * out_stride), *out2 = fvec(n_rows * out_stride), *out3 = fvec(n_rows * out_stride);
    float *out_ds4 = fvec(n_rows * out_stride);
    double *xq = dvec(n_in);
    fill_normal(src, n_in * total_rows, 0.05);
    fill_normal(x, n_rows * x_stride, 1.0);
    for (size_t c = 0; c < sizeof MATMUL_CASES / sizeof MATMUL_CASES[0]; c++) {
        const matmul_case *mc = &MATMUL_CASES[c];
        test_weight tw;
        weight_make(&tw, ds4_type_name(mc->type), mc->type, n_in, total_rows, src);
        for (int num = 0; num < DS4_NUMERICS_COUNT; num++) {
            const ds4_numerics nm = (ds4_numerics)num;
            const char *nname = ds4_numerics_name(nm);
            /* binary16 operands (the others compute as under DS4) */
            const bool f16x = nm == DS4_NUMERICS_DS4_F16 && (mc->type == DS4_TYPE_Q8_0 || mc->type == DS4_TYPE_F16);
            for (int64_t i = 0; i < n_rows * out_stride; i++) out[i] = out2[i] = out3[i] = -7.0f;
            be1->ops->matmul(be1, &tw.w, row0, n_out, x, x_stride, out, out_stride, n_rows, nm);
            be2->ops->matmul(be2, &tw.w, row0, n_out, x, x_stride, out2, out_stride, n_rows, nm);
            be3->ops->matmul(be3, &tw.w, row0, n_out, x, x_stride, out3, out_stride, n_rows, nm);
            expect_no_error(be1);
            expect_no_error(be2);
            expect_no_error(be3);
            /* Any thread count gives the same bits; padding is untouched. */
            CHECK_MSG(memcmp(out, out2, (size_t)(n_rows * out_stride) * sizeof *out) == 0, "%s", tw.w.name);
            CHECK_MSG(memcmp(out, out3, (size_t)(n_rows * out_stride) * sizeof *out) == 0, "%s", tw.w.name);
            if (nm == DS4_NUMERICS_DS4) memcpy(out_ds4, out, (size_t)(n_rows * out_stride) * sizeof *out);
            if (nm == DS4_NUMERICS_DS4_F16 && !f16x)
                CHECK_MSG(memcmp(out, out_ds4, (size_t)(n_rows * out_stride) * sizeof *out) == 0,
                          "%s: ds4-f16 computes it as ds4", tw.w.name);
            double worst = 0;
            for (int64_t r = 0; r < n_rows; r++) {
                CHECK(out[r * out_stride + n_out] == -7.0f && out[r * out_stride + n_out + 1] == -7.0f);
                const float *xr = x + r * x_stride;
                if (nm == DS4_NUMERICS_REFERENCE) {
                    for (int64_t i = 0; i < n_in; i++) xq[i] = xr[i];
                } else if (f16x) {
                    for (int64_t i = 0; i < n_in; i++) xq[i] = ds4_round_f16(xr[i]);
                } else if (mc->type == DS4_TYPE_Q8_0) {
                    naive_q8_0_act(xr, n_in, xq);
                } else if (mc->type == DS4_TYPE_F32 || mc->type == DS4_TYPE_F16 || mc->type == DS4_TYPE_BF16) {
                    for (int64_t i = 0; i < n_in; i++) xq[i] = xr[i];
                } else {
                    naive_q8_K_act(xr, n_in, xq);
                }
                for (int64_t o = 0; o < n_out; o++) {
                    weight_row(&tw.w, row0 + o, wrow);
                    if (f16x) /* f16(d q) (F16 rows are binary16 already) */
                        for (int64_t i = 0; i < n_in; i++) wrow[i] = ds4_round_f16(wrow[i]);
                    double want = 0, S = 0;
                    for (int64_t i = 0; i < n_in; i++) {
                        want += (double)wrow[i] * xq[i];
                        S += fabs((double)wrow[i] * xq[i]);
                    }
                    /* REFERENCE: exact float64 sum of exact products, rounded to
                     * float once: half an ulp of the result, plus float64 noise. */
                    const double tol = nm == DS4_NUMERICS_REFERENCE || f16x ? EPS32 * fabs(want) + 1e-13 * S
                                                                            : mc->ds4_rel_tol * S;
                    const double got = out[r * out_stride + o];
                    CHECK_MSG(fabs(got - want) <= tol, "%s %s row %lld out %lld: %.9g vs %.9g (tol %.3g)", tw.w.name,
                              nname, (long long)r, (long long)o, got, want, tol);
                    if (S > 0) worst = fmax(worst, fabs(got - want) / S);
                }
            }
            if (getenv("DS4_TEST_VERBOSE"))
                fprintf(stderr, "  %-8s %-9s worst |err| / sum|w x| = %.3g\n", tw.w.name, nname, worst);
        }
        weight_free(&tw);
    }
    free(src);
    free(x);
    free(wrow);
    free(out);
    free(out2);
    free(out3);
    free(out_ds4);
    free(xq);
    ds4_backend_destroy(be1);
    ds4_backend_destroy(be2);
    ds4_backend_destroy(be3);
}

/* The numerics' names round trip; other strings are refused; a backend is
 * asked for the numerics it implements (the CPU all three) and refuses
 * the others, naming them and what it has. */
static void test_numerics_names(void) {
    for (int n = 0; n < DS4_NUMERICS_COUNT; n++) {
        ds4_numerics got = DS4_NUMERICS_REFERENCE;
        const char *name = ds4_numerics_name((ds4_numerics)n);
        CHECK(name && ds4_numerics_parse(name, &got) && got == (ds4_numerics)n);
    }
    CHECK(!strcmp(ds4_numerics_name(DS4_NUMERICS_DS4_F16), "ds4-f16"));
    CHECK(ds4_numerics_name((ds4_numerics)DS4_NUMERICS_COUNT) == NULL);
    const char *bad[] = { "", "DS4", "ds4-f", "ds4-f16 ", "f16", "reference,ds4" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ds4_numerics got = DS4_NUMERICS_DS4_F16;
        CHECK_MSG(!ds4_numerics_parse(bad[i], &got) && got == DS4_NUMERICS_DS4_F16, "'%s'", bad[i]);
    }
    ds4_numerics got;
    CHECK(!ds4_numerics_parse(NULL, &got));
    CHECK(ds4_numerics_decode(DS4_NUMERICS_DS4_F16) == DS4_NUMERICS_DS4);
    CHECK(ds4_numerics_decode(DS4_NUMERICS_REFERENCE) == DS4_NUMERICS_REFERENCE);
    CHECK(ds4_numerics_rounds(DS4_NUMERICS_DS4_F16) && !ds4_numerics_rounds(DS4_NUMERICS_REFERENCE));

    ds4_backend *be = new_backend(1);
    ds4_error err = { 0 };
    for (int n = 0; n < DS4_NUMERICS_COUNT; n++) CHECK(ds4_backend_check_numerics(be, (ds4_numerics)n, &err) == DS4_OK);
    ds4_backend_ops fewer = *be->ops;
    fewer.numerics &= ~(1u << DS4_NUMERICS_DS4_F16);
    ds4_backend lacking = *be;
    lacking.ops = &fewer;
    CHECK(ds4_backend_check_numerics(&lacking, DS4_NUMERICS_DS4_F16, &err) == DS4_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(err.message, "cpu") && strstr(err.message, "ds4-f16") &&
                  strstr(err.message, "(it has: ds4, reference)"), "%s", err.message);
    CHECK(ds4_backend_check_numerics(&lacking, DS4_NUMERICS_DS4, &err) == DS4_OK);
    CHECK(ds4_backend_check_numerics(be, (ds4_numerics)7, &err) == DS4_ERR_INVALID);
    ds4_backend_destroy(be);
}

/* DS4_F16's binary16 operands, worked by hand:
 *   Q8_0, d = f16 0x2E66 = 0.0999755859375: q 7 -> d q = 0.6998291015625,
 *   whose nearest half (steps of 2^-11 in [0.5, 1)) is 0.69970703125; q -127
 *   -> 12.6968994140625 -> -12.6953125 (steps of 2^-7). x 1.0001 -> 1 (steps
 *   of 2^-10), x 0.5 exact: 0.69970703125 - 6.34765625 = -5.64794921875
 *   (the other 30 weights are 0; their x, 1000.3, is what makes DS4's Q8_0
 *   activations round x 1.0001 and 0.5 to 0).
 *   F16 row (0.0999755859375, 2, 0.333251953125) . (1.0001, 0.5, 3) =
 *   0.0999755859375 + 1 + 0.999755859375 = 2.0997314453125; x 65520 rounds
 *   to inf (past the largest half, 65504), and stays inf.
 *   F16 row (1024, 2^-14, -1024) . (1024, 2^-10, 1024): products 2^20,
 *   2^-24, -2^20, whose float64 sum is exactly 2^-24 (a float sum in that
 *   order loses the 2^-24: ulp(2^20) is 2^-3 in float).
 * Any row count (1 and 2 here) takes the same operands. */
static void test_matmul_f16_operands(void) {
    ds4_backend *be = new_backend(2);
    ds4_block_q8_0 q[1];
    memset(q, 0, sizeof q);
    q[0].d = 0x2E66;
    q[0].qs[0] = 7;
    q[0].qs[1] = -127;
    ds4_weight wq = { "q8_0", DS4_TYPE_Q8_0, { 32, 1, 1, 1 }, 34, q, NULL, NULL };
    float xq[64], yq[2] = { 0, 0 };
    for (int i = 0; i < 64; i++) xq[i] = 1000.3f;
    xq[0] = xq[32] = 1.0001f;
    xq[1] = xq[33] = 0.5f;
    be->ops->matmul(be, &wq, 0, 1, xq, 32, yq, 1, 2, DS4_NUMERICS_DS4_F16);
    CHECK_MSG(yq[0] == -5.64794921875f && yq[1] == -5.64794921875f, "%.10g %.10g", yq[0], yq[1]);
    be->ops->matmul(be, &wq, 0, 1, xq, 32, yq, 1, 1, DS4_NUMERICS_DS4);
    CHECK_MSG(fabsf(yq[0]) < 1e-3f, "ds4: %.10g", yq[0]); /* (x 1.0001 and 0.5 quantised to 0) */

    const uint16_t h[2][3] = { { 0x2E66, 0x4000, 0x3555 }, { 0x6400, 0x0400, 0xE400 } };
    ds4_weight wh = { "f16", DS4_TYPE_F16, { 3, 2, 1, 1 }, 6, h, NULL, NULL };
    const float xh[3][3] = { { 1.0001f, 0.5f, 3.0f }, { 65520.0f, 0.0f, 0.0f }, { 1024.0f, 0x1p-10f, 1024.0f } };
    float yh[3][2];
    for (int r = 0; r < 3; r++) {
        be->ops->matmul(be, &wh, 0, 2, xh[r], 3, yh[r], 2, 1, DS4_NUMERICS_DS4_F16);
        float y2[2];
        be->ops->matmul(be, &wh, 0, 2, xh[r], 3, y2, 2, 1, DS4_NUMERICS_DS4_F16); /* (rows alone: the same) */
        CHECK(memcmp(y2, yh[r], sizeof y2) == 0);
    }
    CHECK_MSG(yh[0][0] == 2.0997314453125f, "%.12g", yh[0][0]);
    CHECK(isinf(yh[1][0]) && yh[1][0] > 0);
    CHECK_MSG(yh[2][1] == 0x1p-24f, "%.9g", yh[2][1]);
    float y3[3 * 2];
    be->ops->matmul(be, &wh, 0, 2, &xh[0][0], 3, y3, 2, 3, DS4_NUMERICS_DS4_F16); /* three rows at once */
    CHECK(memcmp(y3, yh, sizeof y3) == 0);
    expect_no_error(be);
    ds4_backend_destroy(be);
}

/* DS4's Q8_0 activation rounding is half-to-even (lrint), unlike the
 * weight quantiser's half-away: with block amax 127 the scale is exactly 1,
 * so x = 2.5, -3.5, 0.5 sit on ties. Weight row j is the one-hot e_j with
 * d = 1, so out[j] = q_j. */
static void test_matmul_q8_0_ties(void) {
    ds4_backend *be = new_backend(1);
    ds4_block_q8_0 w[32];
    memset(w, 0, sizeof w);
    for (int j = 0; j < 32; j++) {
        w[j].d = ds4_f32_to_f16(1.0f);
        w[j].qs[j] = 1;
    }
    ds4_weight wt = { "onehot", DS4_TYPE_Q8_0, { 32, 32, 1, 1 }, 34, w, NULL, NULL };
    float x[32] = { 127.0f, 2.5f, -3.5f, 0.5f, 1.5f, -0.5f, 126.5f, 3.4f, -127.0f }, out[32];
    be->ops->matmul(be, &wt, 0, 32, x, 32, out, 32, 1, DS4_NUMERICS_DS4);
    const float want[9] = { 127, 2, -4, 0, 2, -0.0f, 126, 3, -127 };
    for (int j = 0; j < 9; j++) CHECK_MSG(out[j] == want[j], "x %g -> q %g", x[j], out[j]);
    expect_no_error(be);
    ds4_backend_destroy(be);
}

/* The F16 weight path converts halves with its own bit trick: every finite
 * half (all 63488 of them, subnormals included) must come out exactly as the
 * reference converter gives it. W is 31 rows of 2048 halves; x row j is the
 * one-hot e_j, so out[j][o] = W[o][j] exactly. */
static void test_matmul_f16_all_values(void) {
    ds4_backend *be = new_backend(2);
    const int64_t n_in = 2048, n_w = 31;
    uint16_t *h = malloc((size_t)(n_in * n_w) * sizeof *h);
    float *x = fvec(n_in * n_in), *out = fvec(n_in * n_w);
    int64_t k = 0;
    for (uint32_t bits = 0; bits < 65536; bits++)
        if ((bits & 0x7c00u) != 0x7c00u) h[k++] = (uint16_t)bits;
    CHECK(k == n_in * n_w);
    for (int64_t j = 0; j < n_in; j++) x[j * n_in + j] = 1.0f;
    ds4_weight w = { "f16", DS4_TYPE_F16, { n_in, n_w, 1, 1 }, n_in * 2, h, NULL, NULL };
    for (int num = 0; num < 2; num++) {
        be->ops->matmul(be, &w, 0, n_w, x, n_in, out, n_w, n_in, num ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4);
        int bad = 0;
        for (int64_t j = 0; j < n_in; j++)
            for (int64_t o = 0; o < n_w; o++) {
                const float want = ds4_f16_to_f32(h[o * n_in + j]), got = out[j * n_w + o];
                /* +-0 products sum to +0, so compare values (0 == -0) */
                bad += !(got == want);
            }
        CHECK_EQ_INT(bad, 0);
    }
    /* inf and NaN weights propagate. */
    uint16_t special[2] = { 0x7c00u, 0x7e00u };
    float one = 1.0f, y[2];
    ds4_weight ws = { "f16-special", DS4_TYPE_F16, { 1, 2, 1, 1 }, 2, special, NULL, NULL };
    be->ops->matmul(be, &ws, 0, 2, &one, 1, y, 2, 1, DS4_NUMERICS_DS4);
    CHECK(isinf(y[0]) && y[0] > 0 && isnan(y[1]));
    expect_no_error(be);
    free(h);
    free(x);
    free(out);
    ds4_backend_destroy(be);
}

/* matmul_grouped equals n_groups matmul calls (W rows g*n_out.., x columns
 * g*n_in..) bit for bit, for every type and both numerics, with strides wider
 * than the data (the gaps untouched) and with more rows than one x tile (16);
 * W may have rows past the groups. Any thread count gives the same bits. */
static void test_matmul_grouped(void) {
    const int64_t n_in = 256, n_groups = 3, n_out = 7, total_rows = n_groups * n_out + 2;
    const int64_t ROWS[] = { 1, 3, 20 };
    const int64_t x_stride = n_groups * n_in + 9, out_stride = n_groups * n_out + 3, max_rows = 20;
    ds4_backend *be1 = new_backend(1), *be2 = new_backend(2);
    float *src = fvec(n_in * total_rows), *x = fvec(max_rows * x_stride);
    float *out = fvec(max_rows * out_stride), *out2 = fvec(max_rows * out_stride), *want = fvec(max_rows * out_stride);
    fill_normal(src, n_in * total_rows, 0.05);
    fill_normal(x, max_rows * x_stride, 1.0);
    for (size_t c = 0; c < sizeof MATMUL_CASES / sizeof MATMUL_CASES[0]; c++) {
        test_weight tw;
        weight_make(&tw, ds4_type_name(MATMUL_CASES[c].type), MATMUL_CASES[c].type, n_in, total_rows, src);
        for (int num = 0; num < DS4_NUMERICS_COUNT; num++) {
            const ds4_numerics nm = (ds4_numerics)num;
            for (size_t ri = 0; ri < sizeof ROWS / sizeof ROWS[0]; ri++) {
                const int64_t n_rows = ROWS[ri], n = n_rows * out_stride;
                for (int64_t i = 0; i < n; i++) out[i] = out2[i] = want[i] = -7.0f;
                be1->ops->matmul_grouped(be1, &tw.w, n_groups, n_out, x, x_stride, out, out_stride, n_rows, nm);
                be2->ops->matmul_grouped(be2, &tw.w, n_groups, n_out, x, x_stride, out2, out_stride, n_rows, nm);
                for (int64_t g = 0; g < n_groups; g++)
                    be1->ops->matmul(be1, &tw.w, g * n_out, n_out, x + g * n_in, x_stride, want + g * n_out,
                                     out_stride, n_rows, nm);
                expect_no_error(be1);
                expect_no_error(be2);
                CHECK_MSG(memcmp(out, want, (size_t)n * sizeof *out) == 0, "%s %s, %lld rows", tw.w.name,
                          ds4_numerics_name(nm), (long long)n_rows);
                CHECK_MSG(memcmp(out2, want, (size_t)n * sizeof *out) == 0, "%s %s, %lld rows (2 threads)",
                          tw.w.name, ds4_numerics_name(nm), (long long)n_rows);
                for (int64_t r = 0; r < n_rows; r++)
                    for (int64_t o = n_groups * n_out; o < out_stride; o++) CHECK(out[r * out_stride + o] == -7.0f);
            }
        }
        weight_free(&tw);
    }
    free(src);
    free(x);
    free(out);
    free(out2);
    free(want);
    ds4_backend_destroy(be1);
    ds4_backend_destroy(be2);
}

/* matmul_multi equals its products' matmul calls bit for bit (types mixed,
 * both numerics, 1, 3 and 20 rows, strides wider than the data, a product
 * of no outputs); bad arguments or an unusable weight in any product record
 * an error and write nothing. */
static void test_matmul_multi(void) {
    const int64_t n_in = 256, x_stride = n_in + 3, max_rows = 20;
    const uint32_t types[] = { DS4_TYPE_Q8_0, DS4_TYPE_F16, DS4_TYPE_Q2_K, DS4_TYPE_F32, DS4_TYPE_IQ2_XXS };
    const int64_t n_outs[] = { 9, 17, 0, 5, 12 };
    enum { NP = 5 };
    ds4_backend *be = new_backend(2);
    test_weight tw[NP];
    float *src = fvec(n_in * 20), *x = fvec(max_rows * x_stride);
    fill_normal(src, n_in * 20, 0.05);
    fill_normal(x, max_rows * x_stride, 1.0);
    float *out[NP], *want[NP];
    for (int j = 0; j < NP; j++) {
        weight_make(&tw[j], ds4_type_name(types[j]), types[j], n_in, 20, src);
        out[j] = fvec(max_rows * (n_outs[j] + 2));
        want[j] = fvec(max_rows * (n_outs[j] + 2));
    }
    /* rows to add after products 1 (F16 rows of its 17 outputs) and 3 (F32, 5) */
    test_weight add1, add3;
    weight_make(&add1, "blk.0.add1.weight", DS4_TYPE_F16, 17, 3, src);
    weight_make(&add3, "blk.0.add3.weight", DS4_TYPE_F32, 5, 4, src + 60);
    static const int64_t ROWS[] = { 1, 3, 20 };
    for (int num = 0; num < DS4_NUMERICS_COUNT; num++) {
        const ds4_numerics nm = (ds4_numerics)num;
        for (size_t ri = 0; ri < 3; ri++) {
            const int64_t n_rows = ROWS[ri];
            ds4_product p[NP];
            for (int j = 0; j < NP; j++) {
                for (int64_t i = 0; i < max_rows * (n_outs[j] + 2); i++) out[j][i] = want[j][i] = -7.0f;
                p[j] = (ds4_product){ &tw[j].w, n_outs[j], out[j], n_outs[j] + 2, NULL, 0 };
                be->ops->matmul(be, &tw[j].w, 0, n_outs[j], x, x_stride, want[j], n_outs[j] + 2, n_rows, nm);
            }
            /* the added rows: as add_weight_row adds them, row by row */
            p[1].add = &add1.w, p[1].add_row = 2;
            p[3].add = &add3.w, p[3].add_row = (int64_t)ri;
            for (int64_t r = 0; r < n_rows; r++) {
                be->ops->add_weight_row(be, want[1] + r * (n_outs[1] + 2), &add1.w, 2, 1);
                be->ops->add_weight_row(be, want[3] + r * (n_outs[3] + 2), &add3.w, (int64_t)ri, 1);
            }
            be->ops->matmul_multi(be, p, NP, x, x_stride, n_rows, nm);
            expect_no_error(be);
            for (int j = 0; j < NP; j++)
                CHECK_MSG(memcmp(out[j], want[j], (size_t)(max_rows * (n_outs[j] + 2)) * sizeof(float)) == 0,
                          "product %d (%s) %s, %lld rows", j, ds4_type_name(types[j]), ds4_numerics_name(nm),
                          (long long)n_rows);
        }
    }
    /* errors: nothing written anywhere */
    char msg[DS4_ERROR_MSG_MAX];
    ds4_weight q40 = { "blk.1.q40.weight", DS4_TYPE_Q4_0, { 256, 20, 1, 1 }, 144, tw[0].data, NULL, NULL };
    ds4_weight unbound = tw[1].w;
    unbound.host = NULL;
    test_weight narrow;
    weight_make(&narrow, "blk.0.narrow.weight", DS4_TYPE_Q8_0, 128, 20, src);
    ds4_weight add_unbound = add1.w, add_q40 = { "blk.1.add_q40.weight", DS4_TYPE_Q4_0, { 12, 1, 1, 1 }, 18,
                                                   tw[0].data, NULL, NULL }; /* (12 wide: the type is what fails) */
    add_unbound.host = NULL;
    add_unbound.name = "blk.0.add_unbound.weight";
    for (int c = 0; c < 13; c++) {
        ds4_product p[NP];
        for (int j = 0; j < NP; j++) {
            for (int64_t i = 0; i < max_rows * (n_outs[j] + 2); i++) out[j][i] = -7.0f;
            p[j] = (ds4_product){ &tw[j].w, n_outs[j], out[j], n_outs[j] + 2, NULL, 0 };
        }
        int n = NP;
        int64_t rows = 3, xs = x_stride;
        ds4_status want_st = DS4_ERR_INVALID;
        const char *name = NULL;
        switch (c) {
        case 0: n = 0; break;
        case 1: n = DS4_PRODUCTS_MAX + 1; break;
        case 2: p[3].w = &narrow.w, name = "blk.0.narrow.weight"; break; /* another row length */
        case 3: p[4].n_out = 21; break;                                 /* past the weight's 20 rows */
        case 4: p[1].out_stride = 16; break;                            /* out rows overlap */
        case 5: xs = n_in - 1; break;                                   /* x rows overlap */
        case 6: p[4].out = NULL; break;
        case 7: p[4].w = &q40, want_st = DS4_ERR_UNSUPPORTED, name = "blk.1.q40.weight"; break;
        case 8: p[3].w = &unbound, name = ds4_type_name(types[1]); break;
        case 9: p[1].add = &add3.w, name = "blk.0.add3.weight"; break;             /* 5 wide for 17 outputs */
        case 10: p[3].add = &add3.w, p[3].add_row = 4, name = "blk.0.add3.weight"; break; /* past its 4 rows */
        case 11: p[1].add = &add_unbound, name = "blk.0.add_unbound.weight"; break; /* (the last product checked too) */
        case 12: p[4].add = &add_q40, want_st = DS4_ERR_UNSUPPORTED, name = "blk.1.add_q40.weight"; break;
        }
        be->ops->matmul_multi(be, p, n, x, xs, rows, DS4_NUMERICS_DS4);
        CHECK_MSG(take_error(be, msg, sizeof msg) == want_st, "case %d: %s", c, msg);
        CHECK_MSG(strstr(msg, "matmul_multi") && (!name || strstr(msg, name)), "case %d: %s", c, msg);
        int written = 0;
        for (int j = 0; j < NP; j++)
            for (int64_t i = 0; i < max_rows * (n_outs[j] + 2); i++) written += out[j][i] != -7.0f;
        CHECK_MSG(written == 0, "case %d: %d values written", c, written);
    }
    weight_free(&narrow);
    weight_free(&add1);
    weight_free(&add3);
    for (int j = 0; j < NP; j++) {
        weight_free(&tw[j]);
        free(out[j]);
        free(want[j]);
    }
    free(src);
    free(x);
    ds4_backend_destroy(be);
}

/* Bad arguments record an error naming the op and the weight, and write
 * nothing; empty products (n_out 0, n_rows 0) do nothing. */
static void test_matmul_grouped_errors(void) {
    ds4_backend *be = new_backend(1);
    const int64_t n_in = 64, rows = 12;
    float *src = fvec(n_in * rows), *x = fvec(4 * 4 * n_in), *out = fvec(4 * 16);
    fill_normal(src, n_in * rows, 0.05);
    fill_normal(x, 4 * 4 * n_in, 1.0);
    test_weight tw;
    weight_make(&tw, "blk.0.attn_output_a.weight", DS4_TYPE_Q8_0, n_in, rows, src);
    const ds4_numerics nm = DS4_NUMERICS_DS4;
    const struct {
        int64_t n_groups, n_out, x_stride, out_stride, n_rows;
    } bad[] = {
        { 0, 4, 4 * 64, 12, 1 },         /* no groups */
        { -1, 4, 4 * 64, 12, 1 },        /* negative groups */
        { 3, -1, 4 * 64, 12, 1 },        /* negative n_out */
        { 3, 5, 4 * 64, 15, 1 },         /* 15 rows of a 12-row weight */
        { 13, 1, 13 * 64, 13, 1 },       /* 13 groups of 1 row */
        { 3, 4, 3 * 64 - 1, 12, 2 },     /* x rows overlap */
        { 3, 4, 3 * 64, 11, 2 },         /* out rows overlap */
        { 3, 4, 3 * 64, 12, -1 },        /* negative rows */
        { INT64_MAX, 1, 64, 1, 1 },      /* counts that would overflow */
        { 2, INT64_MAX / 2 + 1, 128, 1, 1 },
    };
    char msg[DS4_ERROR_MSG_MAX];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        for (int64_t j = 0; j < 4 * 16; j++) out[j] = -7.0f;
        be->ops->matmul_grouped(be, &tw.w, bad[i].n_groups, bad[i].n_out, x, bad[i].x_stride, out, bad[i].out_stride,
                                bad[i].n_rows, nm);
        CHECK_MSG(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID, "case %zu", i);
        CHECK_MSG(strstr(msg, "matmul_grouped") && strstr(msg, "blk.0.attn_output_a.weight"), "case %zu: %s", i, msg);
        int written = 0;
        for (int64_t j = 0; j < 4 * 16; j++) written += out[j] != -7.0f;
        CHECK_EQ_INT(written, 0);
    }
    /* a type without a dequantiser; an unbound weight */
    ds4_weight q40 = { "blk.1.q40.weight", DS4_TYPE_Q4_0, { 64, 4, 1, 1 }, 36, tw.data, NULL, NULL };
    be->ops->matmul_grouped(be, &q40, 2, 2, x, 128, out, 4, 1, nm);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_UNSUPPORTED && strstr(msg, "blk.1.q40.weight"));
    ds4_weight unbound = tw.w;
    unbound.host = NULL;
    be->ops->matmul_grouped(be, &unbound, 2, 2, x, 128, out, 4, 1, nm);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID && strstr(msg, "blk.0.attn_output_a.weight"));
    /* empty products; one row ignores the strides (as matmul does) */
    for (int64_t j = 0; j < 4 * 16; j++) out[j] = -7.0f;
    be->ops->matmul_grouped(be, &tw.w, 3, 0, x, 3 * 64, out, 0, 4, nm);
    be->ops->matmul_grouped(be, &tw.w, 3, 4, x, 3 * 64, out, 12, 0, nm);
    expect_no_error(be);
    CHECK(out[0] == -7.0f);
    be->ops->matmul_grouped(be, &tw.w, 3, 4, x, 0, out, 0, 1, nm);
    expect_no_error(be);
    CHECK(out[0] != -7.0f && out[11] != -7.0f && out[12] == -7.0f);
    weight_free(&tw);
    free(src);
    free(x);
    free(out);
    ds4_backend_destroy(be);
}

/* ------------------------------------------------------------------------ */
/* RoPE                                                                      */
/* ------------------------------------------------------------------------ */

static double naive_rope_theta(const ds4_rope *rope, double p, int k) {
    const double theta = p * pow(rope->base, -2.0 * k / rope->n_rot);
    if (rope->factor <= 1.0f) return theta;
    const double y = fmin(1.0, fmax(0.0, (k - rope->yarn_lo) / fmax(0.001, rope->yarn_hi - rope->yarn_lo)));
    const double ramp = 1.0 - y;
    return theta / rope->factor * (1.0 - ramp) + theta * ramp;
}

static void test_rope(void) {
    ds4_backend *be = new_backend(1);
    const int64_t rows = 3, heads = 4, hd = 96;
    const int32_t pos[3] = { 0, 5, 70000 };
    const ds4_rope ropes[2] = { { 64, 10000.0f, 1.0f, 0, 0 }, { 64, 160000.0f, 16.0f, 15.0f, 25.0f } };
    float *x = fvec(rows * heads * hd), *y = fvec(rows * heads * hd);
    for (int ri = 0; ri < 2; ri++) {
        const ds4_rope *rope = &ropes[ri];
        fill_normal(x, rows * heads * hd, 1.0);
        memcpy(y, x, (size_t)(rows * heads * hd) * sizeof *x);
        be->ops->rope_tail(be, y, rows, heads, hd, pos, rope, false);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < heads; h++) {
                const float *xs = x + (r * heads + h) * hd, *ys = y + (r * heads + h) * hd;
                CHECK(memcmp(xs, ys, (size_t)(hd - 64) * sizeof *xs) == 0); /* head start untouched */
                for (int k = 0; k < 32; k++) {
                    const double t = naive_rope_theta(rope, pos[r], k), c = cos(t), s = sin(t);
                    const double x0 = xs[hd - 64 + 2 * k], x1 = xs[hd - 64 + 2 * k + 1];
                    /* cos/sin rounded to float, two products and a sum: 4 roundings */
                    const double tol = 4 * EPS32 * (fabs(x0) + fabs(x1));
                    CHECK_NEAR(ys[hd - 64 + 2 * k], x0 * c - x1 * s, tol);
                    CHECK_NEAR(ys[hd - 64 + 2 * k + 1], x0 * s + x1 * c, tol);
                }
            }
        /* The inverse undoes it (rotation then counter-rotation: ~8 roundings). */
        be->ops->rope_tail(be, y, rows, heads, hd, pos, rope, true);
        for (int64_t i = 0; i < rows * heads * hd; i++) CHECK_NEAR(y[i], x[i], 8 * EPS32 * (fabs(x[i]) + 2.0));
    }
    /* Known angle: position 1, pair 0 rotates by exactly 1 radian; pair 16 of
     * base 10000 (n_rot 64) by 10000^-0.5 = 0.01. */
    float v[64] = { 0 };
    v[0] = 1.0f;
    v[32] = 1.0f;
    const int32_t p1 = 1;
    be->ops->rope_tail(be, v, 1, 1, 64, &p1, &ropes[0], false);
    CHECK_NEAR(v[0], cos(1.0), 1e-7);
    CHECK_NEAR(v[1], sin(1.0), 1e-7);
    CHECK_NEAR(v[32], cos(0.01), 1e-7);
    CHECK_NEAR(v[33], sin(0.01), 1e-7);
    /* YaRN ramp: pairs <= lo keep theta, pairs >= hi use theta / factor, pair
     * 20 (halfway) uses the mean of the two. Unit vectors read cos/sin. */
    const int32_t p = 1000;
    for (int k = 0; k < 32; k++) {
        float u[64] = { 0 };
        u[2 * k] = 1.0f;
        be->ops->rope_tail(be, u, 1, 1, 64, &p, &ropes[1], false);
        const double theta = p * pow(160000.0, -2.0 * k / 64);
        const double want = k <= 15 ? theta : k >= 25 ? theta / 16 : (k == 20 ? (theta + theta / 16) / 2 : NAN);
        if (!isnan(want)) {
            CHECK_NEAR(u[2 * k], cos(want), 1e-7);
            CHECK_NEAR(u[2 * k + 1], sin(want), 1e-7);
        }
    }
    expect_no_error(be);
    free(x);
    free(y);
    ds4_backend_destroy(be);
}

/* head_norm_rope: exactly rmsnorm, rope_tail and (round_kv) round_fp8_kv and
 * round_f16 one after the other, bit for bit, for q-shaped rows (several
 * heads, no weight) and KV-shaped ones (one head, a norm weight, a head
 * that is not a multiple of 64 before its RoPE dims, YaRN); bad arguments
 * are refused with the op's own message before anything is written. */
static void test_head_norm_rope(void) {
    ds4_backend *be = new_backend(2);
    const int32_t pos[3] = { 0, 7, 70000 };
    const ds4_rope ropes[2] = { { 16, 10000.0f, 1.0f, 0, 0 }, { 64, 160000.0f, 16.0f, 15.0f, 25.0f } };
    struct { int64_t heads, hd; int rope; bool weighted, round_kv; } cases[] = {
        { 4, 64, 0, false, false }, { 1, 352, 1, true, true }, { 3, 96, 1, true, true }, { 2, 128, 0, false, true },
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int64_t rows = 3, heads = cases[ci].heads, hd = cases[ci].hd, n = rows * heads * hd;
        const ds4_rope *rope = &ropes[cases[ci].rope];
        float *x = fvec(n), *want = fvec(n), *wsrc = fvec(hd);
        fill_normal(x, n, 2.0);
        fill_normal(wsrc, hd, 1.0);
        test_weight w;
        weight_make(&w, "blk.0.attn_kv_a_norm.weight", DS4_TYPE_F32, hd, 1, wsrc);
        const ds4_weight *wp = cases[ci].weighted ? &w.w : NULL;
        memcpy(want, x, (size_t)n * sizeof *x);
        be->ops->rmsnorm(be, want, wp, 1e-6f, want, rows * heads, hd);
        be->ops->rope_tail(be, want, rows, heads, hd, pos, rope, false);
        if (cases[ci].round_kv) {
            be->ops->round_fp8_kv(be, want, rows * heads, hd, rope->n_rot);
            be->ops->round_f16(be, want, n);
        }
        be->ops->head_norm_rope(be, x, rows, heads, hd, wp, 1e-6f, pos, rope, cases[ci].round_kv);
        expect_no_error(be);
        CHECK_MSG(memcmp(x, want, (size_t)n * sizeof *x) == 0, "head_norm_rope case %zu differs from its ops", ci);
        weight_free(&w);
        free(x);
        free(want);
        free(wsrc);
    }
    /* refused, x untouched */
    float x[128], keep[128];
    fill_normal(x, 128, 1.0);
    memcpy(keep, x, sizeof x);
    float wsrc[64];
    fill_normal(wsrc, 64, 1.0);
    test_weight w;
    weight_make(&w, "blk.0.attn_kv_a_norm.weight", DS4_TYPE_F32, 64, 1, wsrc);
    const ds4_rope odd = { 15, 10000.0f, 1.0f, 0, 0 }, wide = { 160, 10000.0f, 1.0f, 0, 0 };
    char msg[DS4_ERROR_MSG_MAX];
    be->ops->head_norm_rope(be, x, 1, 1, 128, NULL, 1e-6f, pos, NULL, false);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID && strstr(msg, "no RoPE parameters"));
    be->ops->head_norm_rope(be, x, 1, 1, 128, NULL, 1e-6f, pos, &odd, false);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID && strstr(msg, "15 rotated dims in heads of 128"));
    be->ops->head_norm_rope(be, x, 1, 1, 128, NULL, 1e-6f, pos, &wide, false);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID && strstr(msg, "160 rotated dims in heads of 128"));
    be->ops->head_norm_rope(be, x, 1, 1, 128, &w.w, 1e-6f, pos, &ropes[0], true);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID && strstr(msg, "64 wide, heads 128") &&
          strstr(msg, "blk.0.attn_kv_a_norm.weight"));
    be->ops->head_norm_rope(be, x, 1, 1, 128, NULL, 1e-6f, NULL, &ropes[0], false);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID && strstr(msg, "without positions"));
    be->ops->head_norm_rope(be, x, -1, 1, 128, NULL, 1e-6f, pos, &ropes[0], false);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID && strstr(msg, "-1 rows"));
    CHECK(memcmp(x, keep, sizeof x) == 0);
    be->ops->head_norm_rope(be, NULL, 0, 1, 128, NULL, 1e-6f, NULL, NULL, false); /* no rows: nothing to check */
    expect_no_error(be);
    weight_free(&w);
    ds4_backend_destroy(be);
}

/* ------------------------------------------------------------------------ */
/* Hyper-connections                                                         */
/* ------------------------------------------------------------------------ */

typedef struct hc_weights {
    test_weight fn, scale, base;
} hc_weights;

static void hc_weights_make(hc_weights *w, int n_hc, int64_t dim, int64_t n_mix, int64_t n_scale) {
    float *fn = fvec(n_hc * dim * n_mix), sc[3], *base = fvec(n_mix);
    fill_normal(fn, n_hc * dim * n_mix, 0.05);
    for (int i = 0; i < 3; i++) sc[i] = (float)(0.5 + test_rand_uniform());
    fill_normal(base, n_mix, 0.5);
    weight_make(&w->fn, "hc_fn", DS4_TYPE_F16, n_hc * dim, n_mix, fn);
    weight_make(&w->scale, "hc_scale", DS4_TYPE_F32, n_scale, 1, sc);
    weight_make(&w->base, "hc_base", DS4_TYPE_F32, n_mix, 1, base);
    free(fn);
    free(base);
}

static void hc_weights_free(hc_weights *w) {
    weight_free(&w->fn);
    weight_free(&w->scale);
    weight_free(&w->base);
}

/* mix = fn . plain_rmsnorm(X) in float64; S[k] = sum |fn_kj f_j| */
static void naive_hc_mix(const ds4_hc *hc, const float *X, const ds4_weight *fn, int64_t n_mix, double *mix,
                         double *S) {
    const int64_t n = hc->n_hc * hc->dim;
    float *row = fvec(n);
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)X[i] * X[i];
    const double scale = 1.0 / sqrt(ss / n + hc->norm_eps);
    for (int64_t k = 0; k < n_mix; k++) {
        weight_row(fn, k, row);
        mix[k] = 0;
        S[k] = 0;
        for (int64_t i = 0; i < n; i++) {
            mix[k] += row[i] * X[i] * scale;
            S[k] += fabs(row[i] * X[i] * scale);
        }
    }
    free(row);
}

static void hc_pre_case(const ds4_hc *hcp);

/* iters 1 and 2 make the order and count of the normalisations visible (20
 * rounds converge, so an off-by-one there would not show). */
static void test_hc_pre(void) {
    for (int iters = 1; iters <= 20; iters += iters == 1 ? 1 : 18) {
        const ds4_hc hc = { 4, 64, iters, 1e-6f, 1e-6f };
        hc_pre_case(&hc);
    }
}

static void hc_pre_case(const ds4_hc *hcp) {
    ds4_backend *be = new_backend(2);
    const ds4_hc hc = *hcp;
    const int n = hc.n_hc;
    const int64_t rows = 3, n_mix = (2 + n) * n, hc_dim = n * hc.dim;
    hc_weights w;
    hc_weights_make(&w, n, hc.dim, n_mix, 3);
    const float *sc = w.scale.w.host, *base = w.base.w.host;
    float *X = fvec(rows * hc_dim), *x_out = fvec(rows * hc.dim), *post = fvec(rows * n), *comb = fvec(rows * n * n);
    fill_normal(X, rows * hc_dim, 2.0);
    be->ops->hc_pre(be, &hc, X, &w.fn.w, &w.scale.w, &w.base.w, x_out, post, comb, rows);
    expect_no_error(be);
    double mix[24], S[24];
    for (int64_t r = 0; r < rows; r++) {
        const float *Xr = X + r * hc_dim;
        naive_hc_mix(&hc, Xr, &w.fn.w, n_mix, mix, S);
        double pre[4], pst[4], C[4][4];
        for (int s = 0; s < n; s++) {
            pre[s] = sigmoid_d(mix[s] * sc[0] + base[s]) + hc.eps;
            pst[s] = 2 * sigmoid_d(mix[n + s] * sc[1] + base[n + s]);
        }
        for (int i = 0; i < n; i++) {
            double m = -INFINITY, sum = 0;
            for (int j = 0; j < n; j++) m = fmax(m, C[i][j] = mix[2 * n + i * n + j] * sc[2] + base[2 * n + i * n + j]);
            for (int j = 0; j < n; j++) sum += (C[i][j] = exp(C[i][j] - m));
            for (int j = 0; j < n; j++) C[i][j] = C[i][j] / sum + hc.eps;
        }
        for (int it = 0; it < hc.iters; it++) {
            for (int i = 0; i < n && it > 0; i++) {
                double sum = 0;
                for (int j = 0; j < n; j++) sum += C[i][j];
                for (int j = 0; j < n; j++) C[i][j] /= sum + hc.eps;
            }
            for (int j = 0; j < n; j++) {
                double sum = 0;
                for (int i = 0; i < n; i++) sum += C[i][j];
                for (int i = 0; i < n; i++) C[i][j] /= sum + hc.eps;
            }
        }
        /* The mix carries the F16 matmul's float error, <= 36 * 2^-24 * S_k
         * (256-term sums in 8 lanes); through sigmoid (slope <= 1/4) and the
         * scales (<= 1.5) into pre/post, and through softmax and 20
         * contractive normalisations into C. 1e-5 absolute covers that plus
         * ~40 float roundings on O(1) values (measured: below 3e-7 over 40 seeds). */
        for (int s = 0; s < n; s++) {
            CHECK_NEAR(post[r * n + s], pst[s], 1e-5);
            for (int d = 0; d < n; d++) CHECK_NEAR(comb[r * n * n + s * n + d], C[s][d], 1e-5);
        }
        /* Sinkhorn: columns were normalised last, to sum / (sum + eps) each,
         * which is 1 - eps / (sum + eps): near 1, but by more than eps when a
         * column's sum before the last step was small. So each column sum is
         * checked against the reference's (same formula in double), and
         * loosely against 1. Rows are not normalised last: after 20 rounds
         * they are near 1 only as far as the iteration has converged, which
         * depends on the logits (some random ones leave 3.5e-3), so each row
         * sum is held to the reference's and only loosely to 1. */
        for (int i = 0; i < n; i++) {
            double rs = 0, cs = 0, cs_ref = 0, rs_ref = 0;
            for (int j = 0; j < n; j++) {
                rs += comb[r * n * n + i * n + j];
                cs += comb[r * n * n + j * n + i];
                cs_ref += C[j][i];
                rs_ref += C[i][j];
            }
            CHECK_NEAR(cs, cs_ref, 1e-5);
            CHECK_NEAR(cs, 1.0, 1e-3);
            CHECK_NEAR(rs, rs_ref, 1e-5);
            if (hc.iters == 20) CHECK_NEAR(rs, 1.0, 2e-2);
        }
        for (int64_t i = 0; i < hc.dim; i++) {
            double want = 0, mag = 0;
            for (int s = 0; s < n; s++) want += pre[s] * Xr[s * hc.dim + i], mag += fabs(Xr[s * hc.dim + i]);
            CHECK_NEAR(x_out[r * hc.dim + i], want, 1e-5 * mag);
        }
    }
    hc_weights_free(&w);
    free(X);
    free(x_out);
    free(post);
    free(comb);
    ds4_backend_destroy(be);
}

/* hc_pre_norm: exactly hc_pre and then rmsnorm of its x_out, bit for bit
 * (with a norm weight and plain; a_out apart from x_out and equal to it);
 * a NULL norm output or a norm weight of another width is refused. */
static void test_hc_pre_norm(void) {
    ds4_backend *be = new_backend(2);
    const ds4_hc hc = { 4, 64, 20, 1e-6f, 1e-6f };
    const int n = hc.n_hc;
    const int64_t rows = 3, n_mix = (2 + n) * n, hc_dim = n * hc.dim;
    hc_weights w;
    hc_weights_make(&w, n, hc.dim, n_mix, 3);
    float *X = fvec(rows * hc_dim), *nsrc = fvec(hc.dim);
    fill_normal(X, rows * hc_dim, 2.0);
    fill_normal(nsrc, hc.dim, 1.0);
    test_weight nw, wide;
    weight_make(&nw, "blk.0.attn_norm.weight", DS4_TYPE_F32, hc.dim, 1, nsrc);
    float *x_want = fvec(rows * hc.dim), *a_want = fvec(rows * hc.dim), *post_want = fvec(rows * n);
    float *comb_want = fvec(rows * n * n);
    float *x_out = fvec(rows * hc.dim), *a_out = fvec(rows * hc.dim), *post = fvec(rows * n), *comb = fvec(rows * n * n);
    for (int weighted = 0; weighted < 2; weighted++) {
        const ds4_weight *norm = weighted ? &nw.w : NULL;
        be->ops->hc_pre(be, &hc, X, &w.fn.w, &w.scale.w, &w.base.w, x_want, post_want, comb_want, rows);
        be->ops->rmsnorm(be, x_want, norm, 1e-6f, a_want, rows, hc.dim);
        expect_no_error(be);
        for (int same = 0; same < 2; same++) {
            float *ao = same ? x_out : a_out;
            be->ops->hc_pre_norm(be, &hc, X, &w.fn.w, &w.scale.w, &w.base.w, norm, 1e-6f, x_out, post, comb, ao,
                                 rows);
            expect_no_error(be);
            if (!same) CHECK_MSG(memcmp(x_out, x_want, (size_t)(rows * hc.dim) * sizeof *x_out) == 0, "hc_pre_norm x");
            CHECK_MSG(memcmp(ao, a_want, (size_t)(rows * hc.dim) * sizeof *ao) == 0, "hc_pre_norm norm (weighted %d, in place %d)",
                      weighted, same);
            CHECK_MSG(memcmp(post, post_want, (size_t)(rows * n) * sizeof *post) == 0, "hc_pre_norm post");
            CHECK_MSG(memcmp(comb, comb_want, (size_t)(rows * n * n) * sizeof *comb) == 0, "hc_pre_norm comb");
        }
    }
    char msg[DS4_ERROR_MSG_MAX];
    be->ops->hc_pre_norm(be, &hc, X, &w.fn.w, &w.scale.w, &w.base.w, &nw.w, 1e-6f, x_out, post, comb, NULL, rows);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(msg, "hc_pre_norm") != NULL, "message: %s", msg);
    float *wsrc = fvec(2 * hc.dim);
    weight_make(&wide, "blk.0.ffn_norm.weight", DS4_TYPE_F32, 2 * hc.dim, 1, wsrc);
    be->ops->hc_pre_norm(be, &hc, X, &w.fn.w, &w.scale.w, &w.base.w, &wide.w, 1e-6f, x_out, post, comb, a_out, rows);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(msg, "ffn_norm") != NULL, "message: %s", msg);
    weight_free(&wide);
    weight_free(&nw);
    hc_weights_free(&w);
    free(wsrc);
    free(X);
    free(nsrc);
    free(x_want);
    free(a_want);
    free(post_want);
    free(comb_want);
    free(x_out);
    free(a_out);
    free(post);
    free(comb);
    ds4_backend_destroy(be);
}

/* hc_post_pre_norm: exactly add (y2), hc_post and hc_pre_norm one after
 * the other, bit for bit, with and without y2, the mix written over the
 * one it read; y is left as it was. */
static void test_hc_post_pre_norm(void) {
    ds4_backend *be = new_backend(2);
    const ds4_hc hc = { 4, 64, 20, 1e-6f, 1e-6f };
    const int n = hc.n_hc;
    const int64_t rows = 3, dim = hc.dim, n_mix = (2 + n) * n, hc_dim = n * dim;
    hc_weights w;
    hc_weights_make(&w, n, dim, n_mix, 3);
    float *nsrc = fvec(dim);
    fill_normal(nsrc, dim, 1.0);
    test_weight nw;
    weight_make(&nw, "blk.0.ffn_norm.weight", DS4_TYPE_F32, dim, 1, nsrc);
    float *y = fvec(rows * dim), *y2 = fvec(rows * dim), *y_keep = fvec(rows * dim), *X = fvec(rows * hc_dim);
    float *post0 = fvec(rows * n), *comb0 = fvec(rows * n * n);
    fill_normal(y, rows * dim, 1.0);
    fill_normal(y2, rows * dim, 1.0);
    fill_normal(X, rows * hc_dim, 1.0);
    fill_normal(post0, rows * n, 1.0);
    fill_normal(comb0, rows * n * n, 0.5);
    memcpy(y_keep, y, (size_t)(rows * dim) * sizeof *y);
    float *sum = fvec(rows * dim), *Xw = fvec(rows * hc_dim), *xw = fvec(rows * dim), *aw = fvec(rows * dim);
    float *pw = fvec(rows * n), *cw = fvec(rows * n * n);
    float *Xo = fvec(rows * hc_dim), *xo = fvec(rows * dim), *ao = fvec(rows * dim), *po = fvec(rows * n),
          *co = fvec(rows * n * n);
    for (int with_y2 = 0; with_y2 < 2; with_y2++) {
        const float *ys = y;
        if (with_y2) {
            be->ops->add(be, y, y2, sum, rows * dim);
            ys = sum;
        }
        be->ops->hc_post(be, &hc, ys, X, post0, comb0, Xw, rows);
        be->ops->hc_pre_norm(be, &hc, Xw, &w.fn.w, &w.scale.w, &w.base.w, &nw.w, 1e-6f, xw, pw, cw, aw, rows);
        memcpy(po, post0, (size_t)(rows * n) * sizeof *po); /* the op writes its mix over the one it reads */
        memcpy(co, comb0, (size_t)(rows * n * n) * sizeof *co);
        be->ops->hc_post_pre_norm(be, &hc, y, with_y2 ? y2 : NULL, X, po, co, Xo, &w.fn.w, &w.scale.w, &w.base.w,
                                  &nw.w, 1e-6f, xo, po, co, ao, rows);
        expect_no_error(be);
        CHECK_MSG(memcmp(Xo, Xw, (size_t)(rows * hc_dim) * sizeof *Xo) == 0, "hc_post_pre_norm state (y2 %d)", with_y2);
        CHECK_MSG(memcmp(xo, xw, (size_t)(rows * dim) * sizeof *xo) == 0, "hc_post_pre_norm x (y2 %d)", with_y2);
        CHECK_MSG(memcmp(ao, aw, (size_t)(rows * dim) * sizeof *ao) == 0, "hc_post_pre_norm norm (y2 %d)", with_y2);
        CHECK_MSG(memcmp(po, pw, (size_t)(rows * n) * sizeof *po) == 0, "hc_post_pre_norm post (y2 %d)", with_y2);
        CHECK_MSG(memcmp(co, cw, (size_t)(rows * n * n) * sizeof *co) == 0, "hc_post_pre_norm comb (y2 %d)", with_y2);
        CHECK_MSG(memcmp(y, y_keep, (size_t)(rows * dim) * sizeof *y) == 0, "hc_post_pre_norm wrote y");
    }
    weight_free(&nw);
    hc_weights_free(&w);
    float *bufs[] = { nsrc, y, y2, y_keep, X, post0, comb0, sum, Xw, xw, aw, pw, cw, Xo, xo, ao, po, co };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    ds4_backend_destroy(be);
}

static void test_hc_post(void) {
    ds4_backend *be = new_backend(1);
    const ds4_hc hc = { 4, 100, 20, 1e-6f, 1e-6f };
    const int n = hc.n_hc;
    const int64_t rows = 2, dim = hc.dim;
    float *y = fvec(rows * dim), *X = fvec(rows * n * dim), *post = fvec(rows * n), *comb = fvec(rows * n * n);
    float *out = fvec(rows * n * dim);
    fill_normal(y, rows * dim, 1.0);
    fill_normal(X, rows * n * dim, 1.0);
    fill_normal(post, rows * n, 1.0);
    fill_normal(comb, rows * n * n, 1.0);
    be->ops->hc_post(be, &hc, y, X, post, comb, out, rows);
    for (int64_t r = 0; r < rows; r++)
        for (int d = 0; d < n; d++)
            for (int64_t i = 0; i < dim; i++) {
                double want = (double)post[r * n + d] * y[r * dim + i], mag = fabs(want);
                for (int s = 0; s < n; s++) {
                    const double t = (double)comb[r * n * n + s * n + d] * X[(r * n + s) * dim + i];
                    want += t;
                    mag += fabs(t);
                }
                /* 5 products and 4 sums in float */
                CHECK_NEAR(out[(r * n + d) * dim + i], want, 9 * EPS32 * mag);
            }
    expect_no_error(be);
    free(y);
    free(X);
    free(post);
    free(comb);
    free(out);
    ds4_backend_destroy(be);
}

static void test_hc_head(void) {
    ds4_backend *be = new_backend(2);
    const ds4_hc hc = { 4, 64, 20, 1e-6f, 1e-6f };
    const int n = hc.n_hc;
    const int64_t rows = 2, hc_dim = n * hc.dim;
    hc_weights w;
    hc_weights_make(&w, n, hc.dim, n, 1);
    float *X = fvec(rows * hc_dim), *out = fvec(rows * hc.dim);
    fill_normal(X, rows * hc_dim, 1.5);
    be->ops->hc_head(be, &hc, X, &w.fn.w, &w.scale.w, &w.base.w, out, rows);
    expect_no_error(be);
    const float *sc = w.scale.w.host, *base = w.base.w.host;
    for (int64_t r = 0; r < rows; r++) {
        double mix[4], S[4], wt[4];
        naive_hc_mix(&hc, X + r * hc_dim, &w.fn.w, n, mix, S);
        for (int s = 0; s < n; s++) wt[s] = sigmoid_d(mix[s] * sc[0] + base[s]) + hc.eps;
        for (int64_t i = 0; i < hc.dim; i++) {
            double want = 0, mag = 0;
            for (int s = 0; s < n; s++) {
                const double v = X[r * hc_dim + s * hc.dim + i];
                want += wt[s] * v;
                mag += fabs(v);
            }
            /* weights within ~1e-6 (see hc_pre), then 4 products and sums */
            CHECK_NEAR(out[r * hc.dim + i], want, 1e-5 * mag);
        }
    }
    hc_weights_free(&w);
    free(X);
    free(out);
    ds4_backend_destroy(be);
}

/* ------------------------------------------------------------------------ */
/* Attention, compressor, indexer                                            */
/* ------------------------------------------------------------------------ */

static void naive_attention(const float *q, int64_t n_heads, int64_t dim, const float **rows, int64_t n,
                            const float *sinks, double *out, double *mag) {
    double *s = dvec(n);
    for (int64_t h = 0; h < n_heads; h++) {
        double m = sinks[h];
        for (int64_t r = 0; r < n; r++) {
            double d = 0;
            for (int64_t i = 0; i < dim; i++) d += (double)q[h * dim + i] * rows[r][i];
            s[r] = d / sqrt((double)dim);
            m = fmax(m, s[r]);
        }
        double den = exp(sinks[h] - m);
        for (int64_t r = 0; r < n; r++) den += exp(s[r] - m);
        for (int64_t i = 0; i < dim; i++) {
            double o = 0, a = 0;
            for (int64_t r = 0; r < n; r++) o += exp(s[r] - m) / den * rows[r][i], a += fabs(rows[r][i]);
            out[h * dim + i] = o;
            mag[h * dim + i] = a;
        }
    }
    free(s);
}

static void test_attention(void) {
    ds4_backend *be1 = new_backend(1), *be2 = new_backend(2);
    const int64_t heads = 5, dim = 64, n_a = 6, n_rows_b = 9;
    float *q = fvec(heads * dim), *a = fvec(n_a * dim), *b = fvec(n_rows_b * dim), sinks[5];
    float *out = fvec(heads * dim), *out2 = fvec(heads * dim);
    double *want = dvec(heads * dim), *mag = dvec(heads * dim);
    fill_normal(q, heads * dim, 1.0);
    fill_normal(a, n_a * dim, 1.0);
    fill_normal(b, n_rows_b * dim, 1.0);
    fill_normal(sinks, heads, 2.0);
    sinks[1] = 40.0f;      /* a dominant sink: almost no weight left for the rows */
    sinks[2] = -INFINITY; /* no sink: a plain softmax */
    test_weight ws;
    weight_make(&ws, "attn_sinks", DS4_TYPE_F32, heads, 1, sinks);
    const int32_t idx[4] = { 8, 0, 3, 3 };
    for (int variant = 0; variant < 3; variant++) {
        const int32_t *ib = variant == 0 ? idx : NULL;
        const int64_t nb = variant == 0 ? 4 : variant == 1 ? 2 : 0;
        const float *rows[16];
        int64_t n = 0;
        for (int64_t r = 0; r < n_a; r++) rows[n++] = a + r * dim;
        for (int64_t r = 0; r < nb; r++) rows[n++] = b + (ib ? ib[r] : r) * dim;
        be1->ops->attention(be1, q, heads, dim, a, n_a, b, n_rows_b, ib, nb, &ws.w, out);
        be2->ops->attention(be2, q, heads, dim, a, n_a, b, n_rows_b, ib, nb, &ws.w, out2);
        CHECK(memcmp(out, out2, (size_t)(heads * dim) * sizeof *out) == 0);
        naive_attention(q, heads, dim, rows, n, sinks, want, mag);
        /* Scores: float dots of 64 terms (error ~ 12 * 2^-24 * |q||k| ~ 1e-5
         * absolute here), then exp (relative error = absolute score error),
         * then a weighted sum of rows: 2e-5 of the rows' magnitude. */
        for (int64_t i = 0; i < heads * dim; i++) CHECK_NEAR(out[i], want[i], 2e-5 * mag[i] + 1e-30);
    }
    expect_no_error(be1);
    expect_no_error(be2);
    /* Selected rows in backend memory (an int32 array in a float buffer);
     * an index outside rows_b, negative or too large, is an error that
     * names the op, the entry, the index and the range. */
    int32_t *dev_idx = (int32_t *)be1->ops->alloc(be1, 4);
    const int32_t bad_idx[2][4] = { { 8, 0, 9, 3 }, { 8, -2, 3, 3 } };
    for (int i = 0; i < 2; i++) {
        char msg[DS4_ERROR_MSG_MAX];
        be1->ops->upload(be1, (float *)dev_idx, (const float *)bad_idx[i], 4);
        be1->ops->attention(be1, q, heads, dim, a, n_a, b, n_rows_b, dev_idx, 4, &ws.w, out);
        CHECK(take_error(be1, msg, sizeof msg) == DS4_ERR_INVALID);
        CHECK_MSG(strstr(msg, "attention") && strstr(msg, i ? "index -2" : "index 9") && strstr(msg, "[0, 9)") &&
                  strstr(msg, i ? "row 1 " : "row 2 "), "%s", msg);
    }
    /* without indices: more rows than rows_b has */
    be1->ops->attention(be1, q, heads, dim, a, n_a, b, n_rows_b, NULL, n_rows_b + 1, &ws.w, out);
    CHECK(take_error(be1, NULL, 0) == DS4_ERR_INVALID);
    /* and a valid call after the errors, from backend memory */
    be1->ops->upload(be1, (float *)dev_idx, (const float *)idx, 4);
    be1->ops->attention(be1, q, heads, dim, a, n_a, b, n_rows_b, dev_idx, 4, &ws.w, out);
    be2->ops->attention(be2, q, heads, dim, a, n_a, b, n_rows_b, idx, 4, &ws.w, out2);
    expect_no_error(be1);
    CHECK(memcmp(out, out2, (size_t)(heads * dim) * sizeof *out) == 0);
    be1->ops->free(be1, (float *)dev_idx);
    weight_free(&ws);
    free(q);
    free(a);
    free(b);
    free(out);
    free(out2);
    free(want);
    free(mag);
    ds4_backend_destroy(be1);
    ds4_backend_destroy(be2);
}
/* attention_rows: each row exactly what attention gives for it (a view of
 * the window rows from a_off, b_n compressed rows, no selection), empty views
 * included; bad views and NULL arrays are errors that name the op. */
static void test_attention_rows(void) {
    ds4_backend *be = new_backend(2);
    enum { N = 7 };
    const int64_t heads = 4, dim = 64, n_win = 20, n_comp = 11;
    const int64_t a_off[N] = { 0, 1, 2, 3, 4, 10, 19 }, a_n[N] = { 0, 3, 6, 9, 12, 10, 1 };
    const int64_t b_n[N] = { 0, 0, 4, 5, 11, 11, 2 };
    float *q = fvec(N * heads * dim), *a = fvec(n_win * dim), *b = fvec(n_comp * dim), sinks[4];
    float *out = fvec(N * heads * dim), *one = fvec(heads * dim);
    fill_normal(q, N * heads * dim, 1.0);
    fill_normal(a, n_win * dim, 1.0);
    fill_normal(b, n_comp * dim, 1.0);
    fill_normal(sinks, heads, 2.0);
    test_weight ws;
    weight_make(&ws, "attn_sinks", DS4_TYPE_F32, heads, 1, sinks);
    be->ops->attention_rows(be, q, N, heads, dim, a, a_off, a_n, b, b_n, &ws.w, out);
    expect_no_error(be);
    for (int r = 0; r < N; r++) {
        be->ops->attention(be, q + r * heads * dim, heads, dim, a + a_off[r] * dim, a_n[r], b, b_n[r], NULL, b_n[r],
                           &ws.w, one);
        CHECK_MSG(memcmp(out + r * heads * dim, one, (size_t)(heads * dim) * sizeof *one) == 0, "row %d", r);
    }
    expect_no_error(be);
    char msg[DS4_ERROR_MSG_MAX];
    const int64_t bad_n[N] = { 0, 3, -1, 9, 12, 10, 1 };
    be->ops->attention_rows(be, q, N, heads, dim, a, a_off, bad_n, b, b_n, &ws.w, out);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(msg, "attention_rows") && strstr(msg, "row 2"), "%s", msg);
    be->ops->attention_rows(be, q, N, heads, dim, a, NULL, a_n, b, b_n, &ws.w, out);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(msg, "attention_rows") && strstr(msg, "NULL"), "%s", msg);
    be->ops->attention_rows(be, q, 0, heads, dim, a, NULL, NULL, b, NULL, &ws.w, out); /* no rows: nothing to do */
    expect_no_error(be);
    /* attention_states: rows of "different states" (windows and compressed rows of their own, here slices
     * of a and b at per-row places: the compressed rows end at b's end), each exactly what attention gives */
    {
        const float *ra[N], *rb[N];
        for (int r = 0; r < N; r++) ra[r] = a_n[r] ? a + a_off[r] * dim : NULL, rb[r] = b_n[r] ? b + (n_comp - b_n[r]) * dim : NULL;
        be->ops->attention_states(be, q, N, heads, dim, ra, a_n, rb, b_n, &ws.w, out);
        expect_no_error(be);
        for (int r = 0; r < N; r++) {
            be->ops->attention(be, q + r * heads * dim, heads, dim, ra[r], a_n[r], rb[r], b_n[r], NULL, b_n[r], &ws.w,
                               one);
            CHECK_MSG(memcmp(out + r * heads * dim, one, (size_t)(heads * dim) * sizeof *one) == 0, "state row %d", r);
        }
        rb[4] = NULL; /* row 4 reads 11 compressed rows */
        be->ops->attention_states(be, q, N, heads, dim, ra, a_n, rb, b_n, &ws.w, out);
        CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
        CHECK_MSG(strstr(msg, "attention_states") && strstr(msg, "row 4"), "%s", msg);
        be->ops->attention_states(be, q, N, heads, dim, NULL, a_n, rb, b_n, &ws.w, out);
        CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
        be->ops->attention_states(be, q, 0, heads, dim, NULL, NULL, NULL, NULL, &ws.w, out); /* no rows */
        expect_no_error(be);
    }
    /* attention_rows_sel: each row what attention gives with its selection of 3 of its b_rows */
    const int64_t b_rows[N] = { 3, 4, 5, 6, 11, 11, 7 };
    const int32_t sel[N * 3] = { 0, 1, 2, 3, 0, 2, 4, 1, 0, 5, 2, 3, 10, 0, 9, 1, 2, 3, 6, 5, 4 };
    be->ops->attention_rows_sel(be, q, N, heads, dim, a, a_off, a_n, b, b_rows, sel, 3, &ws.w, out);
    expect_no_error(be);
    for (int r = 0; r < N; r++) {
        be->ops->attention(be, q + r * heads * dim, heads, dim, a + a_off[r] * dim, a_n[r], b, b_rows[r], sel + 3 * r,
                           3, &ws.w, one);
        CHECK_MSG(memcmp(out + r * heads * dim, one, (size_t)(heads * dim) * sizeof *one) == 0, "selected row %d", r);
    }
    be->ops->attention_rows_sel(be, q, N, heads, dim, a, a_off, a_n, b, b_rows, NULL, 3, &ws.w, out);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
    weight_free(&ws);
    free(q);
    free(a);
    free(b);
    free(out);
    free(one);
    ds4_backend_destroy(be);
}

static void test_compressor_pool(void) {
    ds4_backend *be = new_backend(1);
    const int ratios[2] = { 4, 128 };
    for (int t = 0; t < 2; t++) {
        const int ratio = ratios[t];
        const int64_t dim = 16, width = ratio == 4 ? 2 * dim : dim, n_state = ratio == 4 ? 8 : ratio;
        float *kv = fvec(n_state * width), *sc = fvec(n_state * width), *out = fvec(dim);
        fill_normal(kv, n_state * width, 1.0);
        fill_normal(sc, n_state * width, 2.0);
        /* dim 0: every candidate -inf -> 0; dim 1: all but one -inf */
        for (int64_t r = 0; r < n_state; r++) {
            sc[r * width + 0] = -INFINITY;
            sc[r * width + 1] = -INFINITY;
            if (ratio == 4) sc[r * width + dim + 0] = sc[r * width + dim + 1] = -INFINITY;
        }
        if (ratio == 4) sc[5 * width + dim + 1] = 0.3f;
        else sc[77 * width + 1] = 0.3f;
        be->ops->compressor_pool(be, kv, sc, ratio, dim, 1, out);
        for (int64_t j = 0; j < dim; j++) {
            double m = -INFINITY, den = 0, num = 0, mag = 0;
            for (int r = 0; r < (ratio == 4 ? 8 : ratio); r++) {
                const int64_t at = ratio == 4 ? (r < 4 ? r * width + j : r * width + dim + j) : r * width + j;
                m = fmax(m, sc[at]);
            }
            for (int r = 0; r < (ratio == 4 ? 8 : ratio); r++) {
                const int64_t at = ratio == 4 ? (r < 4 ? r * width + j : r * width + dim + j) : r * width + j;
                const double e = m == -INFINITY ? 0 : exp(sc[at] - m);
                den += e;
                num += e * kv[at];
                mag += fabs(kv[at]);
            }
            const double want = den > 0 ? num / den : 0;
            if (j == 0) CHECK(out[j] == 0.0f);
            if (j == 1) CHECK(out[j] == kv[ratio == 4 ? 5 * width + dim + 1 : 77 * width + 1]);
            /* float exps (~2 ulps each) and sums of up to 128 terms */
            CHECK_NEAR(out[j], want, (ratio + 4) * EPS32 * mag);
        }
        free(kv);
        free(sc);
        free(out);
    }
    /* several windows in one call: window w is the single pool of the rows
     * from w * ratio on (ratio 4: overlapping by four rows), bit for bit */
    for (int t = 0; t < 2; t++) {
        const int ratio = ratios[t];
        const int64_t dim = 8, width = ratio == 4 ? 2 * dim : dim, nw = 5;
        const int64_t n_state = ratio == 4 ? 4 * (nw + 1) : ratio * nw;
        float *kv = fvec(n_state * width), *sc = fvec(n_state * width), *out = fvec(nw * dim), *one = fvec(dim);
        fill_normal(kv, n_state * width, 1.0);
        fill_normal(sc, n_state * width, 2.0);
        be->ops->compressor_pool(be, kv, sc, ratio, dim, nw, out);
        for (int64_t w = 0; w < nw; w++) {
            be->ops->compressor_pool(be, kv + w * ratio * width, sc + w * ratio * width, ratio, dim, 1, one);
            CHECK(memcmp(one, out + w * dim, (size_t)dim * sizeof *one) == 0);
        }
        be->ops->compressor_pool(be, kv, sc, ratio, dim, -1, out);
        CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
        /* compressor_pool_states: each window from a state of its own (here windows of kv in reverse order) */
        const float *pk[5], *ps[5];
        for (int64_t w = 0; w < nw; w++) pk[w] = kv + (nw - 1 - w) * ratio * width, ps[w] = sc + (nw - 1 - w) * ratio * width;
        be->ops->compressor_pool_states(be, pk, ps, ratio, dim, nw, out);
        expect_no_error(be);
        for (int64_t w = 0; w < nw; w++) {
            be->ops->compressor_pool(be, pk[w], ps[w], ratio, dim, 1, one);
            CHECK(memcmp(one, out + w * dim, (size_t)dim * sizeof *one) == 0);
        }
        ps[2] = NULL;
        be->ops->compressor_pool_states(be, pk, ps, ratio, dim, nw, out);
        CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
        free(kv);
        free(sc);
        free(out);
        free(one);
    }
    expect_no_error(be);
    ds4_backend_destroy(be);
}

static void test_indexer_scores(void) {
    ds4_backend *be1 = new_backend(1), *be2 = new_backend(2);
    const int64_t heads = 8, dim = 128, n_keys = 300;
    float *q = fvec(heads * dim), *w = fvec(heads), *keys = fvec(n_keys * dim);
    float *s1 = fvec(n_keys), *s2 = fvec(n_keys), *ws = fvec(heads);
    fill_normal(q, heads * dim, 1.0);
    fill_normal(w, heads, 1.0);
    fill_normal(keys, n_keys * dim, 1.0);
    be1->ops->indexer_scores(be1, q, w, 1.0f, heads, dim, keys, n_keys, s1);
    be2->ops->indexer_scores(be2, q, w, 1.0f, heads, dim, keys, n_keys, s2);
    CHECK(memcmp(s1, s2, (size_t)n_keys * sizeof *s1) == 0);
    /* weight_scale is the float product w[h] * scale, rounded once: the same
     * bits as pre-scaled weights with scale 1 (the model's 1/sqrt(dim * heads)) */
    const float scale = (float)(1.0 / sqrt((double)dim * (double)heads));
    for (int64_t h = 0; h < heads; h++) ws[h] = w[h] * scale;
    be1->ops->indexer_scores(be1, q, w, scale, heads, dim, keys, n_keys, s1);
    be2->ops->indexer_scores(be2, q, ws, 1.0f, heads, dim, keys, n_keys, s2);
    CHECK(memcmp(s1, s2, (size_t)n_keys * sizeof *s1) == 0);
    be1->ops->indexer_scores(be1, q, w, 1.0f, heads, dim, keys, n_keys, s1);
    for (int64_t c = 0; c < n_keys; c++) {
        double want = 0, mag = 0;
        for (int64_t h = 0; h < heads; h++) {
            double d = 0, dm = 0;
            for (int64_t i = 0; i < dim; i++) {
                const double p = (double)q[h * dim + i] * keys[c * dim + i];
                d += p;
                dm += fabs(p);
            }
            want += fmax(d, 0.0) * w[h];
            mag += dm * fabs(w[h]);
        }
        /* 128-term float dots (16 per lane + 4), then 8 products and sums */
        CHECK_NEAR(s1[c], want, 30 * EPS32 * mag);
    }
    expect_no_error(be1);
    expect_no_error(be2);
    free(q);
    free(w);
    free(ws);
    free(keys);
    free(s1);
    free(s2);
    ds4_backend_destroy(be1);
    ds4_backend_destroy(be2);
}

/* Naive top-k: repeated arg-max with a strict '>' (lowest index wins ties). */
static void naive_top_k(const float *s, int64_t n, int64_t k, int32_t *idx) {
    char *taken = calloc((size_t)n + 1, 1);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++) {
            if (taken[i]) continue;
            const float si = isnan(s[i]) ? -INFINITY : s[i];
            if (best < 0 || si > (isnan(s[best]) ? -INFINITY : s[best])) best = i;
        }
        idx[j] = (int32_t)best;
        if (best >= 0) taken[best] = 1;
    }
    free(taken);
}

static void test_top_k(void) {
    ds4_backend *be = new_backend(1);
    const int64_t n = 1000;
    float *s = fvec(n);
    int32_t *got = calloc(n + 10, sizeof *got), *want = calloc(n + 10, sizeof *want);
    for (int trial = 0; trial < 4; trial++) {
        /* Many ties: integer scores 0..9 (trial 0..1), or continuous. */
        for (int64_t i = 0; i < n; i++) s[i] = trial < 2 ? (float)(test_rand_u64() % 10) : (float)test_rand_normal();
        if (trial == 1) s[17] = NAN, s[500] = -INFINITY, s[3] = INFINITY;
        const int64_t ks[] = { 0, 1, 7, 100, 999, 1000 };
        for (size_t t = 0; t < sizeof ks / sizeof ks[0]; t++) {
            be->ops->top_k(be, s, n, ks[t], got);
            naive_top_k(s, n, ks[t], want);
            CHECK_MSG(memcmp(got, want, (size_t)ks[t] * sizeof *got) == 0, "trial %d k %lld", trial, (long long)ks[t]);
        }
    }
    /* k > n: the rest is -1. */
    const float few[3] = { 1.0f, 2.0f, 2.0f };
    int32_t idx[5];
    be->ops->top_k(be, few, 3, 5, idx);
    CHECK(idx[0] == 1 && idx[1] == 2 && idx[2] == 0 && idx[3] == -1 && idx[4] == -1);
    expect_no_error(be);
    free(s);
    free(got);
    free(want);
    ds4_backend_destroy(be);
}

/* indexer_scores_rows and top_k_rows: each row is the one-row op's result,
 * bit for bit (rows of different key counts, one with none); counts past
 * the row stride are refused. */
static void test_indexer_rows(void) {
    ds4_backend *be = new_backend(2);
    enum { R = 4 };
    const int64_t heads = 8, dim = 128, stride = 90, k = 16;
    const int64_t n_keys[R] = { 90, 17, 0, 55 };
    float *q = fvec(R * heads * dim), *w = fvec(R * heads), *keys = fvec(stride * dim);
    float *rows = fvec(R * stride), *one = fvec(stride);
    int32_t *idx = calloc(R * k, sizeof *idx), *idx1 = calloc(k, sizeof *idx1);
    fill_normal(q, R * heads * dim, 1.0);
    fill_normal(w, R * heads, 1.0);
    fill_normal(keys, stride * dim, 1.0);
    const float scale = 0.3f;
    be->ops->indexer_scores_rows(be, q, w, scale, heads, dim, keys, n_keys, R, rows, stride);
    be->ops->top_k_rows(be, rows, stride, n_keys, R, k, idx);
    expect_no_error(be);
    for (int r = 0; r < R; r++) {
        be->ops->indexer_scores(be, q + r * heads * dim, w + r * heads, scale, heads, dim, keys, n_keys[r], one);
        CHECK_MSG(memcmp(one, rows + r * stride, (size_t)n_keys[r] * sizeof *one) == 0, "row %d scores", r);
        be->ops->top_k(be, one, n_keys[r], k, idx1);
        CHECK_MSG(memcmp(idx1, idx + r * k, (size_t)k * sizeof *idx1) == 0, "row %d selection", r);
    }
    const int64_t too_many[1] = { stride + 1 };
    be->ops->indexer_scores_rows(be, q, w, scale, heads, dim, keys, too_many, 1, rows, stride);
    CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
    be->ops->top_k_rows(be, rows, stride, too_many, 1, k, idx);
    CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
    free(q);
    free(w);
    free(keys);
    free(rows);
    free(one);
    free(idx);
    free(idx1);
    ds4_backend_destroy(be);
}

/* top_k of 1 is ds4_sample_argmax (the greedy pick the model's greedy
 * evaluation makes with it): the first maximum, NaN and -inf never above
 * anything, +inf wins, -0 ties +0, a row of only NaN / -inf gives 0. */
static void test_top_k_one_is_argmax(void) {
    ds4_backend *be = new_backend(1);
    const int64_t n = 4099;
    float *s = fvec(n);
    int32_t idx[2] = { -7, -7 };
    for (int c = 0; c < 9; c++) {
        for (int64_t i = 0; i < n; i++) s[i] = (float)test_rand_normal();
        switch (c) {
        case 1: s[17] = s[2000] = s[4098] = 7.0f; break;                  /* tied maximum */
        case 2: s[0] = 9.0f; break;                                       /* first */
        case 3: s[n - 1] = 9.0f; break;                                   /* last */
        case 4: for (int64_t i = 0; i < n; i += 3) s[i] = NAN; break;      /* NaN around */
        case 5: for (int64_t i = 0; i < n; i++) s[i] = (i & 1) ? NAN : -INFINITY; break;
        case 6: s[5] = INFINITY, s[6] = INFINITY, s[7] = NAN; break;
        case 7: for (int64_t i = 0; i < n; i++) s[i] = (i % 5) ? -INFINITY : NAN; s[300] = -0.0f, s[301] = 0.0f; break;
        case 8: for (int64_t i = 0; i < n; i++) s[i] = -1e30f; s[4000] = -0.0f; s[12] = 0.0f; break;
        default: break;
        }
        be->ops->top_k(be, s, n, 1, idx);
        expect_no_error(be);
        CHECK_MSG(idx[0] == ds4_sample_argmax(s, n), "case %d: top_k %d, argmax %d", c, idx[0],
                  ds4_sample_argmax(s, n));
        CHECK(idx[1] == -7);
    }
    free(s);
    ds4_backend_destroy(be);
}

/* ------------------------------------------------------------------------ */
/* Router, SwiGLU, MoE                                                       */
/* ------------------------------------------------------------------------ */

static double softplus_d(double x) { return x > 20 ? x : x < -20 ? exp(x) : log1p(exp(x)); }

static void test_router(void) {
    ds4_backend *be = new_backend(1);
    const int64_t n_exp = 64;
    const int n_used = 6;
    float logits[64], bias_v[64];
    fill_normal(logits, n_exp, 3.0);
    fill_normal(bias_v, n_exp, 0.2);
    logits[10] = 25.0f;  /* softplus branch x > 20 */
    logits[11] = -25.0f; /* branch x < -20 */
    /* an exact tie between experts 40 and 41 at the top: 40 must come first */
    logits[40] = logits[41] = 30.0f;
    bias_v[40] = bias_v[41] = 1.0f;
    test_weight bias;
    weight_make(&bias, "exp_probs_b", DS4_TYPE_F32, n_exp, 1, bias_v);
    double prob[64];
    for (int e = 0; e < n_exp; e++) prob[e] = sqrt(softplus_d(logits[e]));
    int32_t sel[6];
    float wts[6];
    for (int mode = 0; mode < 4; mode++) {
        const bool use_bias = mode == 0 || mode == 3, normalise = mode != 2, hashed = mode == 3;
        const int32_t hash[6] = { 5, 63, 0, 5, 12, 40 };
        be->ops->router(be, logits, n_exp, use_bias ? &bias.w : NULL, hashed ? hash : NULL, n_used, normalise, 1.5f,
                        sel, wts, 1);
        int32_t want_sel[6];
        if (hashed) {
            memcpy(want_sel, hash, sizeof want_sel);
        } else {
            float key[64];
            for (int e = 0; e < n_exp; e++) key[e] = (float)(prob[e] + (use_bias ? bias_v[e] : 0.0));
            naive_top_k(key, n_exp, n_used, want_sel);
        }
        CHECK(memcmp(sel, want_sel, sizeof sel) == 0);
        if (!hashed) CHECK(sel[0] == 40 && sel[1] == 41);
        double sum = 0;
        for (int k = 0; k < n_used; k++) sum += prob[want_sel[k]];
        for (int k = 0; k < n_used; k++) {
            const double p = prob[want_sel[k]];
            const double want = normalise ? p / fmax(sum, 6.103515625e-5) * 1.5 : p * 1.5;
            CHECK_NEAR(wts[k], want, 8 * EPS32 * fabs(want)); /* softplus, sqrt, sum, divide, scale */
        }
    }
    /* Tiny probabilities: the sum is floored at 6.103515625e-5. */
    float low[64];
    for (int e = 0; e < n_exp; e++) low[e] = -30.0f - (float)e * 0.01f;
    be->ops->router(be, low, n_exp, NULL, NULL, n_used, true, 1.0f, sel, wts, 1);
    for (int k = 0; k < n_used; k++) {
        CHECK(sel[k] == k);
        CHECK_NEAR(wts[k], sqrt(exp(low[k])) / 6.103515625e-5, 8 * EPS32 * wts[k]);
    }
    const int32_t bad_hash[6] = { 0, 1, 2, 3, 4, 64 };
    be->ops->router(be, logits, n_exp, NULL, bad_hash, n_used, true, 1.5f, sel, wts, 1);
    CHECK(take_error(be, NULL, 0) == DS4_ERR_INVALID);
    expect_no_error(be);
    weight_free(&bias);
    ds4_backend_destroy(be);
}

/* Several rows in one call: row r is exactly the single-row router on row
 * r (bit for bit), with and without bias, hashed and top-k; zero rows do
 * nothing; a bad hash id in a later row and a negative row count are errors. */
static void test_router_rows(void) {
    ds4_backend *be = new_backend(2);
    const int64_t n_exp = 40, n_rows = 5;
    const int n_used = 4;
    float *logits = fvec(n_rows * n_exp), *bias_v = fvec(n_exp), *w_all = fvec(n_rows * n_used), *w_one = fvec(n_used);
    int32_t sel_all[5 * 4], sel_one[4], hash[5 * 4];
    fill_normal(logits, n_rows * n_exp, 2.0);
    fill_normal(bias_v, n_exp, 0.2);
    logits[2 * n_exp + 7] = logits[2 * n_exp + 8] = 30.0f; /* a tie in row 2 (bias too): 7 first */
    bias_v[7] = bias_v[8] = 0.125f;
    for (int64_t i = 0; i < n_rows * n_used; i++) hash[i] = (int32_t)(test_rand_u64() % (uint64_t)n_exp);
    test_weight bias;
    weight_make(&bias, "exp_probs_b", DS4_TYPE_F16, n_exp, 1, bias_v);
    for (int mode = 0; mode < 4; mode++) {
        const bool use_bias = mode & 1, hashed = mode & 2;
        const ds4_weight *b = use_bias ? &bias.w : NULL;
        for (int64_t i = 0; i < n_rows * n_used; i++) sel_all[i] = -7, w_all[i] = NAN;
        be->ops->router(be, logits, n_exp, b, hashed ? hash : NULL, n_used, mode != 1, 1.5f, sel_all, w_all, n_rows);
        expect_no_error(be);
        for (int64_t r = 0; r < n_rows; r++) {
            be->ops->router(be, logits + r * n_exp, n_exp, b, hashed ? hash + r * n_used : NULL, n_used, mode != 1,
                            1.5f, sel_one, w_one, 1);
            expect_no_error(be);
            CHECK_MSG(memcmp(sel_all + r * n_used, sel_one, sizeof sel_one) == 0, "mode %d row %lld", mode,
                      (long long)r);
            CHECK_MSG(memcmp(w_all + r * n_used, w_one, (size_t)n_used * sizeof *w_one) == 0, "mode %d row %lld",
                      mode, (long long)r);
            if (hashed) CHECK(memcmp(sel_one, hash + r * n_used, sizeof sel_one) == 0);
        }
        if (!hashed) CHECK(sel_all[2 * n_used] == 7 && sel_all[2 * n_used + 1] == 8);
    }
    /* zero rows: nothing written, no error */
    sel_all[0] = -7;
    be->ops->router(be, logits, n_exp, NULL, NULL, n_used, true, 1.5f, sel_all, w_all, 0);
    expect_no_error(be);
    CHECK(sel_all[0] == -7);
    char msg[DS4_ERROR_MSG_MAX];
    hash[3 * n_used + 1] = (int32_t)n_exp;
    be->ops->router(be, logits, n_exp, NULL, hash, n_used, true, 1.5f, sel_all, w_all, n_rows);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(msg, "router") && strstr(msg, "expert 40 ") && strstr(msg, "[0, 40)"), "%s", msg);
    be->ops->router(be, logits, n_exp, NULL, NULL, n_used, true, 1.5f, sel_all, w_all, -1);
    CHECK(take_error(be, msg, sizeof msg) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(msg, "router"), "%s", msg);
    weight_free(&bias);
    free(logits);
    free(bias_v);
    free(w_all);
    free(w_one);
    ds4_backend_destroy(be);
}

static void test_swiglu(void) {
    ds4_backend *be = new_backend(1);
    const int64_t n = 200;
    float *g = fvec(n), *u = fvec(n), *out = fvec(n);
    fill_normal(g, n, 15.0);
    fill_normal(u, n, 15.0);
    g[0] = 50.0f, u[0] = 50.0f;   /* both clamped to 10 */
    g[1] = -50.0f, u[1] = -50.0f; /* gate has no lower clamp; up clamped to -10 */
    const float limits[2] = { 10.0f, 0.0f };
    for (int li = 0; li < 2; li++) {
        const float limit = limits[li];
        be->ops->swiglu(be, g, u, limit, 0.75f, out, n);
        for (int64_t i = 0; i < n; i++) {
            double gg = g[i], uu = u[i];
            if (limit > 0) gg = fmin(gg, limit), uu = fmax(-limit, fmin(uu, limit));
            const double want = silu_d(gg) * uu * 0.75;
            CHECK_NEAR(out[i], want, 8 * EPS32 * fabs(want) + 1e-37);
        }
    }
    be->ops->swiglu(be, g, u, 10.0f, 1.0f, out, 2);
    CHECK_NEAR(out[0], silu_d(10.0) * 10.0, 1e-5);
    CHECK_NEAR(out[1], silu_d(-50.0) * -10.0, 1e-25); /* ~1e-20: the gate was not clamped to -10 */
    CHECK(fabs(out[1]) < 1e-15);
    expect_no_error(be);
    free(g);
    free(u);
    free(out);
    ds4_backend_destroy(be);
}

typedef struct moe_case {
    uint32_t gate_type, down_type;
} moe_case;

static void test_moe(void) {
    const int64_t dim = 256, n_ff = 512, n_expert = 5;
    const int n_used = 3;
    const int32_t sel[3] = { 4, 1, 3 };
    const float wts[3] = { 0.7f, 0.5f, 0.3f };
    const float limit = 10.0f;
    const moe_case cases[] = { { DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K }, { DS4_TYPE_Q4_K, DS4_TYPE_Q4_K },
                               { DS4_TYPE_Q8_0, DS4_TYPE_F16 } };
    ds4_backend *be1 = new_backend(1), *be2 = new_backend(2);
    float *gsrc = fvec(dim * n_ff * n_expert), *usrc = fvec(dim * n_ff * n_expert), *dsrc = fvec(n_ff * dim * n_expert);
    float *x = fvec(dim), *out = fvec(dim), *out2 = fvec(dim), *g = fvec(n_ff), *u = fvec(n_ff), *mid = fvec(n_ff);
    float *down_k = fvec(dim), *comp = fvec(dim), *row = fvec(n_ff);
    double *mid_d = dvec(n_used * n_ff);
    fill_normal(gsrc, dim * n_ff * n_expert, 0.2);
    fill_normal(usrc, dim * n_ff * n_expert, 0.2);
    fill_normal(dsrc, n_ff * dim * n_expert, 0.05);
    fill_normal(x, dim, 1.0);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        test_weight gate, up, down;
        weight_make(&gate, "ffn_gate_exps", cases[c].gate_type, dim, n_ff * n_expert, gsrc);
        weight_make(&up, "ffn_up_exps", cases[c].gate_type, dim, n_ff * n_expert, usrc);
        weight_make(&down, "ffn_down_exps", cases[c].down_type, n_ff, dim * n_expert, dsrc);
        gate.w.ne[1] = up.w.ne[1] = n_ff, gate.w.ne[2] = up.w.ne[2] = n_expert;
        down.w.ne[1] = dim, down.w.ne[2] = n_expert;
        for (int num = 0; num < 2; num++) {
            const ds4_numerics nm = num ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
            be1->ops->moe(be1, &gate.w, &up.w, &down.w, x, sel, wts, n_used, limit, out, 1, nm);
            be2->ops->moe(be2, &gate.w, &up.w, &down.w, x, sel, wts, n_used, limit, out2, 1, nm);
            expect_no_error(be1);
            expect_no_error(be2);
            CHECK(memcmp(out, out2, (size_t)dim * sizeof *out) == 0);
            if (nm == DS4_NUMERICS_DS4) { /* the routed experts are DS4's under DS4_F16 too */
                be2->ops->moe(be2, &gate.w, &up.w, &down.w, x, sel, wts, n_used, limit, out2, 1, DS4_NUMERICS_DS4_F16);
                expect_no_error(be2);
                CHECK_MSG(memcmp(out, out2, (size_t)dim * sizeof *out) == 0, "case %zu ds4-f16", c);
            }
            /* The same computation composed from the matmul and swiglu ops
             * (each tested on its own) gives the same bits: this pins the
             * expert row offsets, the routing weight before the down
             * projection, and the per-mid quantisation. */
            for (int64_t i = 0; i < dim; i++) comp[i] = 0.0f;
            for (int k = 0; k < n_used; k++) {
                be1->ops->matmul(be1, &gate.w, sel[k] * n_ff, n_ff, x, dim, g, n_ff, 1, nm);
                be1->ops->matmul(be1, &up.w, sel[k] * n_ff, n_ff, x, dim, u, n_ff, 1, nm);
                be1->ops->swiglu(be1, g, u, limit, wts[k], mid, n_ff);
                be1->ops->matmul(be1, &down.w, sel[k] * dim, dim, mid, n_ff, down_k, dim, 1, nm);
                for (int64_t i = 0; i < dim; i++) comp[i] += down_k[i];
            }
            CHECK_MSG(memcmp(out, comp, (size_t)dim * sizeof *out) == 0, "case %zu %s", c, num ? "reference" : "ds4");
            if (nm != DS4_NUMERICS_REFERENCE) continue;
            /* REFERENCE against float64 throughout (dequantised weights): the
             * op rounds g, u (exact sums, rounded once), the float SwiGLU
             * (~8 roundings), and sums 3 float down dots: 1e-5 of the sum
             * of |down * mid| terms covers it. */
            for (int k = 0; k < n_used; k++) {
                for (int64_t j = 0; j < n_ff; j++) {
                    double gd = 0, ud = 0;
                    weight_row(&gate.w, sel[k] * n_ff + j, row);
                    for (int64_t i = 0; i < dim; i++) gd += (double)row[i] * x[i];
                    weight_row(&up.w, sel[k] * n_ff + j, row);
                    for (int64_t i = 0; i < dim; i++) ud += (double)row[i] * x[i];
                    gd = fmin(gd, limit);
                    ud = fmax(-limit, fmin(ud, limit));
                    mid_d[k * n_ff + j] = silu_d(gd) * ud * wts[k];
                }
            }
            for (int64_t o = 0; o < dim; o++) {
                double want = 0, mag = 0;
                for (int k = 0; k < n_used; k++) {
                    weight_row(&down.w, sel[k] * dim + o, row);
                    for (int64_t j = 0; j < n_ff; j++) {
                        const double t = row[j] * mid_d[k * n_ff + j];
                        want += t;
                        mag += fabs(t);
                    }
                }
                CHECK_NEAR(out[o], want, 1e-5 * mag);
            }
        }
        weight_free(&gate);
        weight_free(&up);
        weight_free(&down);
    }
    /* An expert id out of range, in backend memory (the router's output
     * form: an int32 array in a float buffer): an error naming the op, the
     * id, the range and the weight. */
    const int32_t bad[2][3] = { { 4, 5, 0 }, { -1, 1, 0 } };
    ds4_weight fake = { "w", DS4_TYPE_F32, { dim, n_ff, n_expert, 1 }, dim * 4, gsrc, NULL, NULL };
    ds4_weight fake_down = { "d", DS4_TYPE_F32, { n_ff, dim, n_expert, 1 }, n_ff * 4, dsrc, NULL, NULL };
    int32_t *dev_sel = (int32_t *)be1->ops->alloc(be1, n_used);
    float *dev_w = be1->ops->alloc(be1, n_used);
    be1->ops->upload(be1, dev_w, wts, n_used);
    for (int i = 0; i < 2; i++) {
        char msg[DS4_ERROR_MSG_MAX];
        be1->ops->upload(be1, (float *)dev_sel, (const float *)bad[i], n_used);
        be1->ops->moe(be1, &fake, &fake, &fake_down, x, dev_sel, dev_w, n_used, limit, out, 1, DS4_NUMERICS_DS4);
        CHECK(take_error(be1, msg, sizeof msg) == DS4_ERR_INVALID);
        CHECK_MSG(strstr(msg, "moe") && strstr(msg, i ? "expert -1 " : "expert 5 ") && strstr(msg, "[0, 5)") &&
                  strstr(msg, " w"), "%s", msg);
    }
    be1->ops->free(be1, (float *)dev_sel);
    be1->ops->free(be1, dev_w);
    free(gsrc);
    free(usrc);
    free(dsrc);
    free(x);
    free(out);
    free(out2);
    free(g);
    free(u);
    free(mid);
    free(down_k);
    free(comp);
    free(row);
    free(mid_d);
    ds4_backend_destroy(be1);
    ds4_backend_destroy(be2);
}

/* Several token rows in one call: row r equals the single-row op on x row r
 * with sel / weights row r, bit for bit (each row's x and mids quantised on
 * their own, k summed in order), for any thread count; rows beyond one
 * internal block (32) too. Every row routes to different experts, some
 * repeated within a row. A bad id in a later row is reported with the
 * single-row message; n_used 0 zeroes every row; zero rows do nothing. */
static void test_moe_rows(void) {
    const int64_t dim = 256, n_ff = 256, n_expert = 6;
    const int n_used = 3;
    const float limit = 7.0f;
    const moe_case cases[] = { { DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K }, { DS4_TYPE_Q8_0, DS4_TYPE_Q4_K },
                               { DS4_TYPE_F16, DS4_TYPE_F32 } };
    const int64_t ROWS[] = { 1, 3, 37 };
    const int64_t max_rows = 37;
    ds4_backend *be1 = new_backend(1), *be3 = new_backend(3);
    float *gsrc = fvec(dim * n_ff * n_expert), *usrc = fvec(dim * n_ff * n_expert), *dsrc = fvec(n_ff * dim * n_expert);
    float *x = fvec(max_rows * dim), *out = fvec(max_rows * dim), *out3 = fvec(max_rows * dim), *one = fvec(dim);
    float *wts = fvec(max_rows * n_used);
    int32_t *sel = malloc((size_t)(max_rows * n_used) * sizeof *sel);
    fill_normal(gsrc, dim * n_ff * n_expert, 0.2);
    fill_normal(usrc, dim * n_ff * n_expert, 0.2);
    fill_normal(dsrc, n_ff * dim * n_expert, 0.05);
    fill_normal(x, max_rows * dim, 1.0);
    for (int64_t i = 0; i < max_rows * n_used; i++) {
        sel[i] = (int32_t)((i * 5 + i / n_used) % n_expert); /* differs from row to row */
        wts[i] = (float)(0.1 + test_rand_uniform());
    }
    sel[1] = sel[0]; /* a repeated expert in row 0 */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        test_weight gate, up, down;
        weight_make(&gate, "ffn_gate_exps", cases[c].gate_type, dim, n_ff * n_expert, gsrc);
        weight_make(&up, "ffn_up_exps", cases[c].gate_type, dim, n_ff * n_expert, usrc);
        weight_make(&down, "ffn_down_exps", cases[c].down_type, n_ff, dim * n_expert, dsrc);
        gate.w.ne[1] = up.w.ne[1] = n_ff, gate.w.ne[2] = up.w.ne[2] = n_expert;
        down.w.ne[1] = dim, down.w.ne[2] = n_expert;
        for (int num = 0; num < 2; num++) {
            const ds4_numerics nm = num ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
            for (size_t ri = 0; ri < sizeof ROWS / sizeof ROWS[0]; ri++) {
                const int64_t n_rows = ROWS[ri];
                be1->ops->moe(be1, &gate.w, &up.w, &down.w, x, sel, wts, n_used, limit, out, n_rows, nm);
                be3->ops->moe(be3, &gate.w, &up.w, &down.w, x, sel, wts, n_used, limit, out3, n_rows, nm);
                expect_no_error(be1);
                expect_no_error(be3);
                CHECK(memcmp(out, out3, (size_t)(n_rows * dim) * sizeof *out) == 0);
                for (int64_t r = 0; r < n_rows; r++) {
                    be1->ops->moe(be1, &gate.w, &up.w, &down.w, x + r * dim, sel + r * n_used, wts + r * n_used,
                                  n_used, limit, one, 1, nm);
                    CHECK_MSG(memcmp(out + r * dim, one, (size_t)dim * sizeof *one) == 0, "case %zu %s, %lld rows: "
                              "row %lld", c, num ? "reference" : "ds4", (long long)n_rows, (long long)r);
                }
                expect_no_error(be1);
            }
        }
        weight_free(&gate);
        weight_free(&up);
        weight_free(&down);
    }
    ds4_weight fake = { "w", DS4_TYPE_F32, { dim, n_ff, n_expert, 1 }, dim * 4, gsrc, NULL, NULL };
    ds4_weight fake_down = { "d", DS4_TYPE_F32, { n_ff, dim, n_expert, 1 }, n_ff * 4, dsrc, NULL, NULL };
    /* n_used 0: every row zero */
    for (int64_t i = 0; i < 3 * dim; i++) out[i] = NAN;
    be1->ops->moe(be1, &fake, &fake, &fake_down, x, sel, wts, 0, limit, out, 3, DS4_NUMERICS_DS4);
    expect_no_error(be1);
    for (int64_t i = 0; i < 3 * dim; i++) CHECK(out[i] == 0.0f);
    /* zero rows: nothing written */
    out[0] = -7.0f;
    be1->ops->moe(be1, &fake, &fake, &fake_down, x, sel, wts, n_used, limit, out, 0, DS4_NUMERICS_DS4);
    expect_no_error(be1);
    CHECK(out[0] == -7.0f);
    /* a bad id in row 2 of 3 (backend memory, as the router leaves it) */
    char msg[DS4_ERROR_MSG_MAX];
    sel[2 * n_used + 1] = (int32_t)n_expert;
    be1->ops->moe(be1, &fake, &fake, &fake_down, x, sel, wts, n_used, limit, out, 3, DS4_NUMERICS_DS4);
    CHECK(take_error(be1, msg, sizeof msg) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(msg, "moe: selected expert 6 is outside [0, 6) of w"), "%s", msg);
    be1->ops->moe(be1, &fake, &fake, &fake_down, x, sel, wts, n_used, limit, out, -1, DS4_NUMERICS_DS4);
    CHECK(take_error(be1, msg, sizeof msg) == DS4_ERR_INVALID);
    CHECK_MSG(strstr(msg, "moe"), "%s", msg);
    free(gsrc);
    free(usrc);
    free(dsrc);
    free(x);
    free(out);
    free(out3);
    free(one);
    free(wts);
    free(sel);
    ds4_backend_destroy(be1);
    ds4_backend_destroy(be3);
}

/* ------------------------------------------------------------------------ */
/* Throughput (DS4_BENCH=1)                                                  */
/* ------------------------------------------------------------------------ */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Random blocks with sane f16 scales: throughput does not depend on values. */
static void *random_blocks(uint32_t type, int64_t n_in, int64_t rows, int64_t *row_bytes) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    *row_bytes = ds4_type_row_bytes(type, n_in);
    const int64_t n_blocks = rows * n_in / t->block_elems;
    uint8_t *p = malloc((size_t)(n_blocks * t->block_bytes));
    for (int64_t i = 0; i < n_blocks * t->block_bytes; i++) p[i] = (uint8_t)test_rand_u64();
    for (int64_t b = 0; b < n_blocks; b++) { /* d is the first field of both Q8_0 and IQ2_XXS */
        const uint16_t d = ds4_f32_to_f16(0.001f);
        memcpy(p + b * t->block_bytes, &d, 2);
    }
    return p;
}

static void test_bench_matmul(void) {
    if (!getenv("DS4_BENCH")) TEST_SKIP("set DS4_BENCH=1 to run the matmul benchmark");
    struct {
        uint32_t type;
        int64_t n_in, n_out;
    } shapes[] = { { DS4_TYPE_Q8_0, 4096, 4096 }, { DS4_TYPE_IQ2_XXS, 4096, 2048 }, { DS4_TYPE_F16, 4096, 1024 } };
    float *x = fvec(4096), *out = fvec(4096);
    fill_normal(x, 4096, 1.0);
    printf("%-8s %-11s %-9s %7s %9s %8s\n", "type", "shape", "numerics", "threads", "ms/matvec", "GB/s");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t rb;
        void *data = random_blocks(shapes[s].type, shapes[s].n_in, shapes[s].n_out, &rb);
        ds4_weight w = { ds4_type_name(shapes[s].type), shapes[s].type, { shapes[s].n_in, shapes[s].n_out, 1, 1 }, rb,
                         data, NULL, NULL };
        for (int num = 0; num < 2; num++)
            for (int nt = 1; nt <= 2; nt++) {
                ds4_backend *be = new_backend(nt);
                const ds4_numerics nm = num ? DS4_NUMERICS_REFERENCE : DS4_NUMERICS_DS4;
                be->ops->matmul(be, &w, 0, w.ne[1], x, w.ne[0], out, w.ne[1], 1, nm); /* warm */
                int iters = 0;
                const double t0 = now_s();
                double t1;
                do {
                    be->ops->matmul(be, &w, 0, w.ne[1], x, w.ne[0], out, w.ne[1], 1, nm);
                    iters++;
                } while ((t1 = now_s()) - t0 < 1.0);
                const double per = (t1 - t0) / iters;
                printf("%-8s %5lldx%-5lld %-9s %7d %9.2f %8.2f\n", w.name, (long long)w.ne[0], (long long)w.ne[1],
                       num ? "reference" : "ds4", nt, per * 1e3, (double)(rb * w.ne[1]) / per / 1e9);
                ds4_backend_destroy(be);
            }
        free(data);
    }
    free(x);
    free(out);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_fp8_codes),
    TEST_ENTRY(test_fp4_codes),
    TEST_ENTRY(test_f16_round),
    TEST_ENTRY(test_fp8_kv_row),
    TEST_ENTRY(test_hadamard),
    TEST_ENTRY(test_indexer_qat_row),
    TEST_ENTRY(test_backend_create),
    TEST_ENTRY(test_op_table),
    TEST_ENTRY(test_memory_ops),
    TEST_ENTRY(test_bind_weight),
    TEST_ENTRY(test_bind_synthetic),
    TEST_ENTRY(test_embed),
    TEST_ENTRY(test_rmsnorm),
    TEST_ENTRY(test_head_norm_rope),
    TEST_ENTRY(test_add_weight_row),
    TEST_ENTRY(test_rounding_ops),
    TEST_ENTRY(test_matmul_types),
    TEST_ENTRY(test_matmul_q8_0_ties),
    TEST_ENTRY(test_numerics_names),
    TEST_ENTRY(test_matmul_f16_operands),
    TEST_ENTRY(test_matmul_f16_all_values),
    TEST_ENTRY(test_matmul_grouped),
    TEST_ENTRY(test_matmul_multi),
    TEST_ENTRY(test_matmul_grouped_errors),
    TEST_ENTRY(test_rope),
    TEST_ENTRY(test_hc_pre),
    TEST_ENTRY(test_hc_pre_norm),
    TEST_ENTRY(test_hc_post_pre_norm),
    TEST_ENTRY(test_hc_post),
    TEST_ENTRY(test_hc_head),
    TEST_ENTRY(test_attention),
    TEST_ENTRY(test_attention_rows),
    TEST_ENTRY(test_compressor_pool),
    TEST_ENTRY(test_indexer_scores),
    TEST_ENTRY(test_top_k),
    TEST_ENTRY(test_indexer_rows),
    TEST_ENTRY(test_top_k_one_is_argmax),
    TEST_ENTRY(test_router),
    TEST_ENTRY(test_router_rows),
    TEST_ENTRY(test_swiglu),
    TEST_ENTRY(test_moe),
    TEST_ENTRY(test_moe_rows),
    TEST_ENTRY(test_bench_matmul),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

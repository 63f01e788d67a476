/*
 * cpu_matmul.c - weight x activation products: the matmul and MoE ops.
 *
 * One row dot, four ways (cpu_dot_kind), chosen by the weight type and the
 * numerics (spec 3.0, 3.9):
 *   REFERENCE  every type: the weight row dequantised to float32
 *              (traits->dequant_row), products and sums in float64, rounded
 *              to float once. This is "float32 weights, exact sums": the
 *              result does not depend on summation order, so it is the
 *              cleanest oracle for transformers' float32 GEMMs.
 *   DS4 F32/F16/BF16   float activations, float accumulation (8 interleaved
 *              partial sums in a fixed order, combined pairwise).
 *   DS4 Q8_0   each activation row quantised once to Q8_0 (d = amax/127
 *              kept in float, q = lrint(x / d) half-even, clamp [-128,127]);
 *              dot = sum over blocks, in float, of f16(w.d) * d_x * int_dot.
 *   DS4 K-quants, IQ2_XXS   each activation row quantised once to Q8_K
 *              (ds4_quantize_row_q8_K); dot = traits->dot_q8_K (ggml's
 *              integer-per-sub-block vec_dot).
 *   DS4_F16 Q8_0/F16 (CPU_DOT_F16X)   binary16 operands (backend.h): the
 *              weight row as f16(d * q) (Q8_0) or as stored (F16), each
 *              activation f16(x); the products are exact in float, summed in
 *              float64 and rounded once, so the result is the numerics' own
 *              value whatever order a device sums in. (Other types under
 *              DS4_F16 take their DS4 kinds.)
 * Activation rows are quantised once per call, before the output rows are
 * split across the worker threads.
 */
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/cpu_internal.h"
#include "core/rounding.h"

/* ------------------------------------------------------------------------ */
/* Float rows                                                                */
/* ------------------------------------------------------------------------ */

/*
 * binary16 bits -> float, exact (the same values as ds4_f16_to_f32, without
 * its branches, so the loop vectorises): the exponent and mantissa fields are
 * moved to the float positions, which reads as the half value times 2^-112,
 * and one exact multiplication by 2^112 re-biases it (half subnormals come
 * out normalised). Infinities and NaNs (exponent 31, i.e. 2^16 and up after
 * the multiplication) get the float all-ones exponent OR-ed in, keeping the
 * mantissa (payload) bits.
 */
static inline float f16_to_f32_fast(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t mag = (uint32_t)(h & 0x7fffu) << 13;
    float f;
    memcpy(&f, &mag, sizeof f);
    f *= 0x1p112f;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits |= (mag >= 0x0f800000u ? 0x7f800000u : 0u) | sign;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Whether a dot kind reads the weight row as floats (cpu_weight_row_floats). */
static bool kind_reads_floats(cpu_dot_kind kind) {
    return kind == CPU_DOT_REF || kind == CPU_DOT_F32 || kind == CPU_DOT_F16X;
}

/* A Q8_0 row as binary16 values: f16(d * q), d * q exact in float. */
static void q8_0_row_f16(const ds4_block_q8_0 *b, float *y, int64_t n) {
    for (int64_t i = 0; i < n / 32; i++) {
        const float d = f16_to_f32_fast(b[i].d);
        for (int j = 0; j < 32; j++) y[32 * i + j] = ds4_round_f16(d * (float)b[i].qs[j]);
    }
}

const float *cpu_weight_row_floats(const ds4_weight *w, const void *row, cpu_dot_kind kind, float *scratch) {
    if (!kind_reads_floats(kind)) return NULL;
    const int64_t n = w->ne[0];
    if (kind == CPU_DOT_F16X && w->type == DS4_TYPE_Q8_0) {
        q8_0_row_f16(row, scratch, n);
        return scratch;
    }
    if (w->type == DS4_TYPE_F32) return row;
    if (w->type == DS4_TYPE_F16) {
        const uint16_t *h = row;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) /* groups of 8: the compiler vectorises them */
            for (int j = 0; j < 8; j++) scratch[i + j] = f16_to_f32_fast(h[i + j]);
        for (; i < n; i++) scratch[i] = f16_to_f32_fast(h[i]);
        return scratch;
    }
    ds4_type_traits_get(w->type)->dequant_row(row, scratch, n);
    return scratch;
}

/* Float products, float sums: lane j sums elements j, j+8, j+16, ...; the
 * fixed order makes it deterministic (and lets the compiler vectorise it). */
float cpu_dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = { 0 };
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* float32 inputs, float64 products (exact) and sums. */
static double dot_f64_acc(const float *a, const float *b, int64_t n) {
    double acc[4] = { 0 };
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) acc[j] += (double)a[i + j] * (double)b[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += (double)a[i] * (double)b[i];
    return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

/* ------------------------------------------------------------------------ */
/* Q8_0 activations                                                          */
/* ------------------------------------------------------------------------ */

/* DS4's Q8_0 activation quantiser (spec 3.0), n a multiple of 32. Unlike the
 * weight quantiser it rounds half to even (lrintf) and keeps d in float. */
static void quantize_act_q8_0(const float *x, cpu_q8_0_act *y, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float a = fabsf(xb[j]);
            if (a > amax) amax = a;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = d;
        for (int j = 0; j < 32; j++) {
            long q = lrintf(xb[j] * id);
            y[b].q[j] = (int8_t)(q > 127 ? 127 : q < -128 ? -128 : q);
        }
    }
}

static float dot_q8_0_act(const ds4_block_q8_0 *w, const cpu_q8_0_act *x, int64_t n_blocks) {
    float acc = 0.0f;
    for (int64_t b = 0; b < n_blocks; b++) {
        int32_t isum = 0;
        for (int j = 0; j < 32; j++) isum += (int32_t)w[b].qs[j] * (int32_t)x[b].q[j];
        acc += f16_to_f32_fast(w[b].d) * x[b].d * (float)isum;
    }
    return acc;
}

/* ------------------------------------------------------------------------ */
/* Activation rows and row dots                                              */
/* ------------------------------------------------------------------------ */

bool cpu_dot_kind_for(const ds4_weight *w, ds4_numerics num, cpu_dot_kind *kind) {
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    if (!t || !t->dequant_row || w->ne[0] <= 0 || w->ne[0] % t->block_elems != 0) return false;
    if (num == DS4_NUMERICS_REFERENCE) {
        *kind = CPU_DOT_REF;
    } else if (num == DS4_NUMERICS_DS4_F16 && (w->type == DS4_TYPE_Q8_0 || w->type == DS4_TYPE_F16)) {
        *kind = CPU_DOT_F16X;
    } else if (w->type == DS4_TYPE_Q8_0) {
        *kind = CPU_DOT_Q8_0;
    } else if (t->dot_q8_K && t->block_elems == DS4_QK_K) {
        *kind = CPU_DOT_Q8_K;
    } else {
        *kind = CPU_DOT_F32; /* F32, F16, BF16 (and any other dequantisable type) */
    }
    return true;
}

bool cpu_acts_prepare(cpu_acts *a, cpu_dot_kind kind, const float *x, int64_t x_stride, int64_t n,
                      int64_t n_rows) {
    memset(a, 0, sizeof *a);
    a->kind = kind;
    a->n = n;
    a->n_rows = n_rows;
    a->x = x;
    a->x_stride = x_stride;
    if (kind == CPU_DOT_Q8_0) {
        const int64_t nb = n / 32;
        a->q8_0 = malloc((size_t)(nb * n_rows > 0 ? nb * n_rows : 1) * sizeof *a->q8_0);
        if (!a->q8_0) return false;
        for (int64_t r = 0; r < n_rows; r++) quantize_act_q8_0(x + r * x_stride, a->q8_0 + r * nb, n);
    } else if (kind == CPU_DOT_Q8_K) {
        const int64_t nb = n / DS4_QK_K;
        a->q8_K = malloc((size_t)(nb * n_rows > 0 ? nb * n_rows : 1) * sizeof *a->q8_K);
        if (!a->q8_K) return false;
        for (int64_t r = 0; r < n_rows; r++) ds4_quantize_row_q8_K(x + r * x_stride, a->q8_K + r * nb, n);
    } else if (kind == CPU_DOT_F16X) {
        a->xh = malloc((size_t)(n * n_rows > 0 ? n * n_rows : 1) * sizeof *a->xh);
        if (!a->xh) return false;
        for (int64_t r = 0; r < n_rows; r++)
            for (int64_t i = 0; i < n; i++) a->xh[r * n + i] = ds4_round_f16(x[r * x_stride + i]);
    }
    return true;
}

void cpu_acts_free(cpu_acts *a) {
    free(a->q8_0);
    free(a->q8_K);
    free(a->xh);
    a->q8_0 = NULL;
    a->q8_K = NULL;
    a->xh = NULL;
}

float cpu_dot(const cpu_acts *a, const ds4_weight *w, const void *row, const float *wf, int64_t r) {
    const int64_t n = a->n;
    switch (a->kind) {
    case CPU_DOT_REF: return (float)dot_f64_acc(wf, a->x + r * a->x_stride, n);
    case CPU_DOT_F32: return cpu_dot_f32(wf, a->x + r * a->x_stride, n);
    case CPU_DOT_Q8_0: return dot_q8_0_act(row, a->q8_0 + r * (n / 32), n / 32);
    case CPU_DOT_Q8_K: return ds4_type_traits_get(w->type)->dot_q8_K(row, a->q8_K + r * (n / DS4_QK_K), n);
    case CPU_DOT_F16X: return (float)dot_f64_acc(wf, a->xh + r * n, n);
    }
    return 0.0f;
}

/* Per-thread float rows for dequantised weights, NULL when the kind needs none. */
static bool alloc_thread_scratch(ds4_backend *be, const ds4_weight *w, cpu_dot_kind kind, int64_t n_per_thread,
                                 float **out) {
    *out = NULL;
    if (!kind_reads_floats(kind)) return true;
    if (w->type == DS4_TYPE_F32) return true;
    *out = malloc((size_t)cpu_impl(be)->n_threads * (size_t)n_per_thread * sizeof(float));
    return *out != NULL;
}

/* ------------------------------------------------------------------------ */
/* matmul                                                                    */
/* ------------------------------------------------------------------------ */

/* x rows are walked in tiles so a tile stays in cache while every weight row
 * of the thread's range passes over it. */
#define MATMUL_ROW_TILE 16

typedef struct matmul_job {
    const ds4_weight *w;
    int64_t row0;
    const cpu_acts *acts;
    float *out;
    int64_t out_stride;
    float *scratch; /* n_threads * n_in floats, or NULL */
} matmul_job;

static void matmul_range(void *vctx, int64_t begin, int64_t end, int thread) {
    const matmul_job *job = vctx;
    const cpu_acts *acts = job->acts;
    float *scratch = job->scratch ? job->scratch + (int64_t)thread * acts->n : NULL;
    for (int64_t r0 = 0; r0 < acts->n_rows; r0 += MATMUL_ROW_TILE) {
        const int64_t r1 = r0 + MATMUL_ROW_TILE < acts->n_rows ? r0 + MATMUL_ROW_TILE : acts->n_rows;
        for (int64_t o = begin; o < end; o++) {
            const void *row = cpu_weight_row(job->w, job->row0 + o);
            const float *wf = cpu_weight_row_floats(job->w, row, acts->kind, scratch);
            for (int64_t r = r0; r < r1; r++) job->out[r * job->out_stride + o] = cpu_dot(acts, job->w, row, wf, r);
        }
    }
}

/* A product's weight is bound and of a type the CPU computes with under
 * `num` (its dot kind into *kind); else the error is recorded, naming the
 * op and the weight. */
static bool product_weight_ok(ds4_backend *be, const char *op, const ds4_weight *w, ds4_numerics num,
                              cpu_dot_kind *kind) {
    if (!w || !w->host) {
        cpu_fail(be, DS4_ERR_INVALID, "%s: weight %s is not bound", op, cpu_wname(w));
        return false;
    }
    if (!cpu_dot_kind_for(w, num, kind)) {
        cpu_fail(be, DS4_ERR_UNSUPPORTED, "%s: weight %s has type %s, which the CPU backend cannot compute with", op,
                 cpu_wname(w), ds4_type_name(w->type));
        return false;
    }
    return true;
}

void cpu_matmul(ds4_backend *be, const ds4_weight *w, int64_t row0, int64_t n_out, const float *x, int64_t x_stride,
                float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num) {
    cpu_dot_kind kind;
    if (!product_weight_ok(be, "matmul", w, num, &kind)) return;
    const int64_t n_in = w->ne[0];
    if (row0 < 0 || n_out < 0 || n_rows < 0 || row0 + n_out > cpu_weight_rows(w) ||
        (n_rows > 1 && (x_stride < n_in || out_stride < n_out))) {
        cpu_fail(be, DS4_ERR_INVALID,
                 "matmul: weight %s [%lld x %lld rows]: rows %lld..+%lld, %lld x rows (stride %lld), out stride %lld",
                 cpu_wname(w), (long long)n_in, (long long)cpu_weight_rows(w), (long long)row0, (long long)n_out,
                 (long long)n_rows, (long long)x_stride, (long long)out_stride);
        return;
    }
    if (n_out == 0 || n_rows == 0) return;

    cpu_acts acts;
    matmul_job job = { w, row0, &acts, out, out_stride, NULL };
    if (!cpu_acts_prepare(&acts, kind, x, x_stride, n_in, n_rows) ||
        !alloc_thread_scratch(be, w, kind, n_in, &job.scratch)) {
        cpu_acts_free(&acts);
        cpu_fail(be, DS4_ERR_NOMEM, "matmul: out of memory for the activations of %s", cpu_wname(w));
        return;
    }
    cpu_parallel_for(be, n_out, n_in * n_rows, matmul_range, &job);
    free(job.scratch);
    cpu_acts_free(&acts);
}

/* Group g is exactly the matmul of W rows g*n_out.. with the x columns
 * g*n_in..: calling the matmul per group makes the result bit-identical to
 * separate calls by construction (each group's x slice quantised on its
 * own). The arguments are checked here once, so the per-group calls cannot
 * fail on them. */
void cpu_matmul_grouped(ds4_backend *be, const ds4_weight *w, int64_t n_groups, int64_t n_out, const float *x,
                        int64_t x_stride, float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num) {
    cpu_dot_kind kind;
    if (!product_weight_ok(be, "matmul_grouped", w, num, &kind)) return;
    const int64_t n_in = w->ne[0], rows = cpu_weight_rows(w);
    /* n_groups * n_out and n_groups * n_in are formed only once they are
     * known not to overflow (n_out <= rows / n_groups) */
    const bool counts_ok = n_groups >= 1 && n_out >= 0 && n_rows >= 0 && n_out <= rows / n_groups &&
                           n_groups <= INT64_MAX / n_in;
    if (!counts_ok ||
        (n_rows > 1 && (x_stride < n_groups * n_in || out_stride < n_groups * n_out))) {
        cpu_fail(be, DS4_ERR_INVALID,
                 "matmul_grouped: weight %s [%lld x %lld rows]: %lld groups of %lld rows, %lld x rows (stride "
                 "%lld), out stride %lld",
                 cpu_wname(w), (long long)n_in, (long long)rows, (long long)n_groups, (long long)n_out,
                 (long long)n_rows, (long long)x_stride, (long long)out_stride);
        return;
    }
    if (n_out == 0 || n_rows == 0) return;
    for (int64_t g = 0; g < n_groups; g++)
        cpu_matmul(be, w, g * n_out, n_out, x + g * n_in, x_stride, out + g * n_out, out_stride, n_rows, num);
}

/* The products one by one (each with its row added after it): bit-identical
 * to separate matmul (and add_weight_row) calls. */
void cpu_matmul_multi(ds4_backend *be, const ds4_product *p, int n, const float *x, int64_t x_stride, int64_t n_rows,
                      ds4_numerics num) {
    ds4_error err = { 0 };
    if (!ds4_products_valid(p, n, x, x_stride, n_rows, &err)) {
        cpu_fail(be, err.status, "%s", err.message);
        return;
    }
    cpu_dot_kind kind;
    for (int j = 0; j < n; j++) { /* every weight usable before any product is written */
        if (!product_weight_ok(be, "matmul_multi", p[j].w, num, &kind)) return;
        const ds4_weight *a = p[j].add;
        const ds4_type_traits *t = a ? ds4_type_traits_get(a->type) : NULL;
        if (a && (!a->host || !t || !t->dequant_row)) {
            cpu_fail(be, a->host ? DS4_ERR_UNSUPPORTED : DS4_ERR_INVALID,
                     "matmul_multi: product %d adds a row of %s, which is %s", j, cpu_wname(a),
                     a->host ? "of a type with no row decoder" : "not bound");
            return;
        }
    }
    for (int j = 0; j < n; j++) {
        cpu_matmul(be, p[j].w, 0, p[j].n_out, x, x_stride, p[j].out, p[j].out_stride, n_rows, num);
        ds4_product_add_row(be, &p[j], n_rows);
    }
}

/* ------------------------------------------------------------------------ */
/* Routed experts (spec 3.7)                                                 */
/* ------------------------------------------------------------------------ */

/* Token rows are processed in blocks, which bounds the mid buffer (block *
 * n_used * n_ff floats) while a whole block shares one pass over the pool. */
#define MOE_ROW_BLOCK 32

typedef struct moe_job {
    const ds4_weight *gate, *up, *down;
    const cpu_acts *x_gate, *x_up, *mids; /* x: one row per token; mids: n_used rows per token */
    const int32_t *sel;                   /* [rows, n_used] of this block */
    const float *weights;                 /* [rows, n_used] */
    int n_used;
    float limit;
    int64_t dim, n_ff;
    float *mid; /* [rows, n_used, n_ff] */
    float *out; /* [rows, dim] */
    float *scratch; /* per thread: 2 * dim floats (gate/up rows) or n_ff (down rows) */
    int64_t scratch_per_thread;
} moe_job;

/* Items are (r, k, j): mid[r][k][j] = swiglu(gate_e[j] . x[r], up_e[j] . x[r]) * w[r][k], e = sel[r][k]. */
static void moe_mid_range(void *vctx, int64_t begin, int64_t end, int thread) {
    const moe_job *job = vctx;
    float *scratch = job->scratch ? job->scratch + (int64_t)thread * job->scratch_per_thread : NULL;
    for (int64_t i = begin; i < end; i++) {
        const int64_t rk = i / job->n_ff, j = i % job->n_ff, r = rk / job->n_used;
        const int64_t row = (int64_t)job->sel[rk] * job->n_ff + j;
        const void *grow = cpu_weight_row(job->gate, row);
        const void *urow = cpu_weight_row(job->up, row);
        const float *gf = cpu_weight_row_floats(job->gate, grow, job->x_gate->kind, scratch);
        const float g = cpu_dot(job->x_gate, job->gate, grow, gf, r);
        const float *uf = cpu_weight_row_floats(job->up, urow, job->x_up->kind, scratch ? scratch + job->dim : NULL);
        const float u = cpu_dot(job->x_up, job->up, urow, uf, r);
        job->mid[i] = cpu_swiglu1(g, u, job->limit, job->weights[rk]);
    }
}

/* Items are (r, o): out[r][o] = sum_k down_e[o] . mid[r][k], in order of k. */
static void moe_down_range(void *vctx, int64_t begin, int64_t end, int thread) {
    const moe_job *job = vctx;
    float *scratch = job->scratch ? job->scratch + (int64_t)thread * job->scratch_per_thread : NULL;
    for (int64_t i = begin; i < end; i++) {
        const int64_t r = i / job->dim, o = i % job->dim;
        float acc = 0.0f;
        for (int k = 0; k < job->n_used; k++) {
            const int64_t rk = r * job->n_used + k;
            const void *row = cpu_weight_row(job->down, (int64_t)job->sel[rk] * job->dim + o);
            const float *wf = cpu_weight_row_floats(job->down, row, job->mids->kind, scratch);
            acc += cpu_dot(job->mids, job->down, row, wf, rk);
        }
        job->out[i] = acc;
    }
}

void cpu_moe(ds4_backend *be, const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down, const float *x,
             const int32_t *sel, const float *weights, int n_used, float limit, float *out, int64_t n_rows,
             ds4_numerics num) {
    if (!gate || !up || !down || !gate->host || !up->host || !down->host) {
        cpu_fail(be, DS4_ERR_INVALID, "moe: expert weights are not bound");
        return;
    }
    const int64_t dim = gate->ne[0], n_ff = gate->ne[1], n_expert = gate->ne[2];
    if (up->ne[0] != dim || up->ne[1] != n_ff || up->ne[2] != n_expert || down->ne[0] != n_ff ||
        down->ne[1] != dim || down->ne[2] != n_expert || n_used < 0) {
        cpu_fail(be, DS4_ERR_INVALID,
                 "moe: %s [%lld, %lld, %lld], %s [%lld, %lld, %lld] and %s [%lld, %lld, %lld] do not fit together",
                 cpu_wname(gate), (long long)gate->ne[0], (long long)gate->ne[1], (long long)gate->ne[2], cpu_wname(up),
                 (long long)up->ne[0], (long long)up->ne[1], (long long)up->ne[2], cpu_wname(down),
                 (long long)down->ne[0], (long long)down->ne[1], (long long)down->ne[2]);
        return;
    }
    if (n_rows < 0) {
        cpu_fail(be, DS4_ERR_INVALID, "moe: %lld rows", (long long)n_rows);
        return;
    }
    /* every id of every row, before any work: the first bad one (in row
     * order) is the one reported */
    for (int64_t i = 0; i < n_rows * n_used; i++) {
        if (sel[i] < 0 || sel[i] >= n_expert) {
            cpu_fail(be, DS4_ERR_INVALID, "moe: selected expert %d is outside [0, %lld) of %s", sel[i],
                     (long long)n_expert, cpu_wname(gate));
            return;
        }
    }
    num = ds4_numerics_decode(num); /* the routed experts are DS4's under DS4_F16 too */
    cpu_dot_kind kg, ku, kd;
    const ds4_weight *bad = !cpu_dot_kind_for(gate, num, &kg) ? gate
                          : !cpu_dot_kind_for(up, num, &ku)   ? up
                          : !cpu_dot_kind_for(down, num, &kd) ? down
                                                              : NULL;
    if (bad) {
        cpu_fail(be, DS4_ERR_UNSUPPORTED, "moe: weight %s has type %s, which the CPU backend cannot compute with",
                 cpu_wname(bad), ds4_type_name(bad->type));
        return;
    }
    if (n_rows == 0) return;
    if (n_used == 0) {
        memset(out, 0, (size_t)(n_rows * dim) * sizeof *out);
        return;
    }

    const int n_threads = cpu_impl(be)->n_threads;
    const int64_t block = n_rows < MOE_ROW_BLOCK ? n_rows : MOE_ROW_BLOCK;
    const int64_t per_thread = 2 * dim > n_ff ? 2 * dim : n_ff;
    float *mid = malloc((size_t)(block * n_used) * (size_t)n_ff * sizeof *mid);
    float *scratch = malloc((size_t)n_threads * (size_t)per_thread * sizeof *scratch);
    bool ok = mid && scratch;
    for (int64_t r0 = 0; ok && r0 < n_rows; r0 += block) {
        const int64_t rows = n_rows - r0 < block ? n_rows - r0 : block;
        const float *xb = x + r0 * dim;
        cpu_acts x_gate, x_up, mids;
        memset(&x_gate, 0, sizeof x_gate);
        memset(&x_up, 0, sizeof x_up);
        memset(&mids, 0, sizeof mids);
        /* each x row is quantised on its own, as a single-token call does */
        ok = cpu_acts_prepare(&x_gate, kg, xb, dim, dim, rows);
        if (ok && ku == kg) {
            x_up = x_gate; /* gate and up share the quantised x (they always do in DS4) */
        } else if (ok) {
            ok = cpu_acts_prepare(&x_up, ku, xb, dim, dim, rows);
        }
        if (ok) {
            moe_job job = { gate, up, down, &x_gate, &x_up, &mids, sel + r0 * n_used, weights + r0 * n_used, n_used,
                            limit, dim, n_ff, mid, out + r0 * dim, scratch, per_thread };
            cpu_parallel_for(be, rows * n_used * n_ff, 2 * dim, moe_mid_range, &job);
            /* each mid row is quantised on its own (Q8_K under DS4 numerics) */
            ok = cpu_acts_prepare(&mids, kd, mid, n_ff, n_ff, rows * n_used);
            if (ok) cpu_parallel_for(be, rows * dim, (int64_t)n_used * n_ff, moe_down_range, &job);
        }
        if (ku != kg) cpu_acts_free(&x_up);
        cpu_acts_free(&x_gate);
        cpu_acts_free(&mids);
    }
    if (!ok) cpu_fail(be, DS4_ERR_NOMEM, "moe: out of memory for the activations of %s", cpu_wname(gate));
    free(scratch);
    free(mid);
}

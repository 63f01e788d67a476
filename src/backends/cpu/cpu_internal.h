/*
 * cpu_internal.h - what the CPU backend's files share: the backend state, the
 * worker pool, error recording, and the row-dot machinery of the matmuls.
 *
 * Files: cpu_backend.c (the op table, memory, elementwise ops, norms,
 * rounding), cpu_pool.c (threads), cpu_matmul.c (activation quantisation,
 * matmul, MoE), cpu_attention.c (RoPE, attention, compressor, indexer,
 * top-k), cpu_hc_ffn.c (hyper-connections, router, SwiGLU).
 */
#ifndef DS4_BACKENDS_CPU_INTERNAL_H
#define DS4_BACKENDS_CPU_INTERNAL_H

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "backends/backend.h"
#include "core/error.h"
#include "core/quant.h"

/* ---- worker pool (cpu_pool.c) ------------------------------------------- */

/* Work on items [begin, end); `thread` in [0, n_threads) names the caller's
 * slot for per-thread scratch. */
typedef void (*cpu_range_fn)(void *ctx, int64_t begin, int64_t end, int thread);

typedef struct cpu_pool cpu_pool;

ds4_status cpu_pool_create(int n_threads, cpu_pool **out, ds4_error *err);
void cpu_pool_destroy(cpu_pool *pool);

/* ---- backend state ------------------------------------------------------- */

typedef struct cpu_backend {
    cpu_pool *pool;
    int n_threads;
    pthread_mutex_t error_mu;
    ds4_error error; /* first error since the last take_error; status DS4_OK if none */
} cpu_backend;

static inline cpu_backend *cpu_impl(ds4_backend *be) { return (cpu_backend *)be->impl; }

/* Record an error (only the first one since the last take_error is kept). */
void cpu_fail(ds4_backend *be, ds4_status status, const char *fmt, ...) DS4_PRINTF(3, 4);

/* Split items [0, n) into contiguous ranges, one per thread, and run fn on
 * each (the calling thread takes the first range). `cost` is the rough work
 * per item in multiply-adds: small jobs run inline on the caller. Each item
 * must be computed independently of the split, so results never depend on
 * the thread count. One call at a time per backend (the pool serialises). */
void cpu_parallel_for(ds4_backend *be, int64_t n, int64_t cost, cpu_range_fn fn, void *ctx);

/* ---- row dots (cpu_matmul.c) --------------------------------------------- */

/* How one weight row is dotted with one activation row. */
typedef enum cpu_dot_kind {
    CPU_DOT_REF,  /* REFERENCE: dequantised weight row, float64 accumulation */
    CPU_DOT_F32,  /* DS4, F32/F16/BF16 weights: float activations, float accumulation */
    CPU_DOT_Q8_0, /* DS4, Q8_0 weights: Q8_0 activations, int8 dots */
    CPU_DOT_Q8_K, /* DS4, K-quant / IQ2 weights: Q8_K activations, traits->dot_q8_K */
    CPU_DOT_F16X, /* DS4_F16, Q8_0 / F16 weights: binary16 weights and activations, float64 sums */
} cpu_dot_kind;

/* DS4's Q8_0 activation block: the scale stays a float (only the weight's
 * scale is an f16). */
typedef struct cpu_q8_0_act {
    float d;
    int8_t q[32];
} cpu_q8_0_act;

/* n_rows activation rows of n floats, prepared for one dot kind. */
typedef struct cpu_acts {
    cpu_dot_kind kind;
    int64_t n, n_rows;
    const float *x; /* float kinds: row r at x + r * x_stride */
    int64_t x_stride;
    cpu_q8_0_act *q8_0;   /* CPU_DOT_Q8_0: n/32 blocks per row (owned) */
    ds4_block_q8_K *q8_K; /* CPU_DOT_Q8_K: n/256 blocks per row (owned) */
    float *xh;            /* CPU_DOT_F16X: f16(x), n per row (owned) */
} cpu_acts;

/* The dot kind for a weight type under numerics `num`; false if the type has
 * no dequantiser (or its row length does not suit its activation format). */
bool cpu_dot_kind_for(const ds4_weight *w, ds4_numerics num, cpu_dot_kind *kind);
/* Quantise (or just reference) the rows; false when out of memory. */
bool cpu_acts_prepare(cpu_acts *a, cpu_dot_kind kind, const float *x, int64_t x_stride, int64_t n,
                      int64_t n_rows);
void cpu_acts_free(cpu_acts *a);
/* The float form of weight row `row` when the kind needs one (dequantised
 * into scratch[n] unless the weight is F32), else NULL. */
const float *cpu_weight_row_floats(const ds4_weight *w, const void *row, cpu_dot_kind kind, float *scratch);
/* Weight row (raw bytes `row`, float form `wf` from cpu_weight_row_floats)
 * dotted with activation row r. */
float cpu_dot(const cpu_acts *a, const ds4_weight *w, const void *row, const float *wf, int64_t r);

/* sum a[i] * b[i] in float (DS4's float dot; fixed order of 8 partial sums). */
float cpu_dot_f32(const float *a, const float *b, int64_t n);

static inline const void *cpu_weight_row(const ds4_weight *w, int64_t row) {
    return (const uint8_t *)w->host + row * w->row_bytes;
}

/* A weight's name for messages (NULL-safe). */
static inline const char *cpu_wname(const ds4_weight *w) { return w && w->name ? w->name : "(unnamed)"; }

static inline bool cpu_has_dequant(const ds4_weight *w) {
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    return t && t->dequant_row && w->ne[0] % t->block_elems == 0;
}

static inline int64_t cpu_weight_rows(const ds4_weight *w) { return w->ne[1] * w->ne[2] * w->ne[3]; }

/* out[r][o] = W[row0 + o] . x[r] with DS4 or REFERENCE numerics (the matmul op). */
void cpu_matmul(ds4_backend *be, const ds4_weight *w, int64_t row0, int64_t n_out, const float *x, int64_t x_stride,
                float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num);
/* The matmul_grouped op: n_groups cpu_matmul calls, one per group. */
void cpu_matmul_multi(ds4_backend *be, const ds4_product *p, int n, const float *x, int64_t x_stride, int64_t n_rows,
                      ds4_numerics num);
void cpu_matmul_grouped(ds4_backend *be, const ds4_weight *w, int64_t n_groups, int64_t n_out, const float *x,
                        int64_t x_stride, float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num);
void cpu_moe(ds4_backend *be, const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down, const float *x,
             const int32_t *sel, const float *weights, int n_used, float limit, float *out, int64_t n_rows,
             ds4_numerics num);

/* ---- small shared math -------------------------------------------------- */

/* Two-branch sigmoid: exp of a non-positive argument only. */
static inline float cpu_sigmoid(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    const float e = expf(x);
    return e / (1.0f + e);
}

static inline float cpu_silu(float x) { return x * cpu_sigmoid(x); }

/* silu(min(g, limit)) * clamp(u, -limit, limit) * scale; limit <= 0: no clamp. */
static inline float cpu_swiglu1(float g, float u, float limit, float scale) {
    if (limit > 0.0f) {
        if (g > limit) g = limit;
        if (u > limit) u = limit;
        if (u < -limit) u = -limit;
    }
    return cpu_silu(g) * u * scale;
}

/* A small F32 vector weight (norm weights, sinks, biases, HC scale/base) as
 * floats: the mapping itself for F32, else dequantised into scratch (n floats). */
const float *cpu_weight_vector(const ds4_weight *w, int64_t n, float *scratch);

/* The k best of scores (descending, lowest index first among ties; NaN
 * ranks lowest) into idx; idx[k..) = -1 when k > n. */
void cpu_select_top_k(const float *scores, int64_t n, int64_t k, int32_t *idx);

/* ds4_backend_destroy's part for a CPU backend (cpu_backend.c). */
void ds4_cpu_backend_free(ds4_backend *be);

/* The ops of cpu_attention.c and cpu_hc_ffn.c. */
void cpu_rope_tail(ds4_backend *be, float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t *pos,
                   const ds4_rope *rope, bool inverse);
void cpu_hc_pre(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn, const ds4_weight *scale,
                const ds4_weight *base, float *x_out, float *post, float *comb, int64_t n_rows);
void cpu_hc_post(ds4_backend *be, const ds4_hc *hc, const float *y, const float *X, const float *post,
                 const float *comb, float *X_out, int64_t n_rows);
void cpu_hc_head(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn, const ds4_weight *scale,
                 const ds4_weight *base, float *out, int64_t n_rows);
void cpu_attention(ds4_backend *be, const float *q, int64_t n_heads, int64_t dim, const float *rows_a, int64_t n_a,
                   const float *rows_b, int64_t n_rows_b, const int32_t *idx_b, int64_t n_b,
                   const ds4_weight *sinks, float *out);
void cpu_compressor_pool(ds4_backend *be, const float *state_kv, const float *state_score, int ratio, int64_t dim,
                         int64_t n_windows, float *out);
void cpu_compressor_pool_states(ds4_backend *be, const float *const *state_kv, const float *const *state_score,
                               int ratio, int64_t dim, int64_t n, float *out);
void cpu_indexer_scores(ds4_backend *be, const float *q, const float *weights, float weight_scale, int64_t n_heads,
                        int64_t dim, const float *keys, int64_t n_keys, float *scores);
void cpu_top_k(ds4_backend *be, const float *scores, int64_t n, int64_t k, int32_t *idx);
void cpu_attention_states(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                          const float *const *rows_a, const int64_t *a_n, const float *const *rows_b, const int64_t *b_n,
                          const ds4_weight *sinks, float *out);
void cpu_attention_rows_sel(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                            const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                            const int64_t *b_rows, const int32_t *idx, int64_t k, const ds4_weight *sinks, float *out);
void cpu_indexer_scores_rows(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                             int64_t n_heads, int64_t dim, const float *keys, const int64_t *n_keys, int64_t n_rows,
                             float *scores, int64_t stride);
void cpu_top_k_rows(ds4_backend *be, const float *scores, int64_t stride, const int64_t *n, int64_t n_rows, int64_t k,
                    int32_t *idx);
void cpu_attention_rows(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                        const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                        const int64_t *b_n, const ds4_weight *sinks, float *out);
void cpu_router(ds4_backend *be, const float *logits, int64_t n_expert, const ds4_weight *bias,
                const int32_t *hash_ids, int n_used, bool normalise, float scale, int32_t *sel_out,
                float *weight_out, int64_t n_rows);
void cpu_swiglu(ds4_backend *be, const float *g, const float *u, float limit, float scale, float *out, int64_t n);

#endif

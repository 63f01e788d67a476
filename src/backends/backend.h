/*
 * backend.h - the operation table: the one seam between models and backends.
 *
 * A model computes only through these ops; a backend implements them and
 * knows no model. Every op is semantic: shapes, layouts and quantisation types
 * are explicit in its arguments. Activations are float32 row-major buffers
 * that live in the backend's memory (host memory for the CPU backend, device
 * memory for CUDA); the model allocates them through the table and never
 * dereferences them itself. Small control data that the model knows before
 * the ops run (token ids, positions, hash-routed expert ids) is passed in
 * host memory.
 *
 * Choices that ops make and other ops consume (the router's experts and
 * weights, the indexer's top-k rows) stay in backend memory, so a decode
 * step never waits for them. An int32 array in backend memory is stored in
 * a float buffer from alloc with the same element count (the buffer holds
 * the int32 bit patterns; the op casts the pointer); upload and download of
 * n floats move such an array to and from the host bit for bit.
 *
 * Weight matrices use GGUF/ggml order: a weight of shape [in, out] has `out`
 * rows of `in` elements, and y[o] = sum_i W[o][i] * x[i]. A 3-D expert tensor
 * [in, out, n_expert] is n_expert * out rows; expert e starts at row e * out.
 *
 * Numerics (ds4_numerics): DS4 rounds in specific places (spec section 3.9).
 * Under DS4_NUMERICS_DS4 an op applies exactly those rounding steps (Q8_0
 * activations for Q8_0 weights, Q8_K activations for K-quant and IQ2 weights,
 * FP8 / FP4 / F16 round trips where the op says so); under
 * DS4_NUMERICS_REFERENCE every op computes in float32 on the dequantised
 * weights, which is what the transformers implementation does.
 * DS4_NUMERICS_DS4_F16 is DS4's except in the products of Q8_0 and F16
 * weights (matmul, matmul_multi, matmul_grouped, rope_matmul_grouped),
 * which take binary16 operands as DS4's CUDA prefill does (spec 3.9):
 * each weight element f16(d * q) (Q8_0; d * q is exact in float, so one
 * rounding to nearest even) or as stored (F16), each activation f16(x),
 * the products (exact in float) summed in float in an order the backend
 * chooses (the CPU's: in float64, rounded once; tensor cores accumulate
 * with their own rounding, within the float sum's worst-case bound). The routed experts (moe)
 * and every other op are DS4's. The model gives these numerics to the
 * ops of a prompt's chunks only; its decoded tokens (one or a batch of
 * streams) are DS4's (ds4_numerics_decode).
 */
#ifndef DS4_BACKENDS_BACKEND_H
#define DS4_BACKENDS_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/synth_fill.h"
#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One product of matmul_multi: out[r][o] = W[o] . x[r] for o < n_out (the
 * first n_out rows of W), out rows out_stride apart. With `add` (NULL:
 * none), row add_row of that weight (n_out wide) is then added to every
 * output row, exactly as add_weight_row adds it (one float add each). */
typedef struct ds4_product {
    const struct ds4_weight *w;
    int64_t n_out;
    float *out;
    int64_t out_stride;
    const struct ds4_weight *add;
    int64_t add_row;
} ds4_product;
#define DS4_PRODUCTS_MAX 8 /* products of one matmul_multi call */

/* One row set of head_norm_rope2: n_heads heads a row at x, norm weight w
 * (NULL: plain), round_kv as head_norm_rope's. */
typedef struct ds4_head_rows {
    float *x;
    int64_t n_heads;
    const struct ds4_weight *w;
    bool round_kv;
} ds4_head_rows;

typedef enum ds4_numerics {
    DS4_NUMERICS_DS4 = 0,       /* DS4's rounding steps (the default) */
    DS4_NUMERICS_REFERENCE = 1, /* float32 throughout */
    DS4_NUMERICS_DS4_F16 = 2,   /* DS4's, with binary16 Q8_0 and F16 products (prefill) */
} ds4_numerics;
#define DS4_NUMERICS_COUNT 3

/* DS4's rounding steps (FP8, FP4, F16 round trips, Q8_K experts): every
 * numerics but REFERENCE */
static inline bool ds4_numerics_rounds(ds4_numerics n) { return n != DS4_NUMERICS_REFERENCE; }
/* the numerics of a decoded token's ops under n: DS4_F16's are DS4's */
static inline ds4_numerics ds4_numerics_decode(ds4_numerics n) {
    return n == DS4_NUMERICS_DS4_F16 ? DS4_NUMERICS_DS4 : n;
}
/* "ds4", "reference", "ds4-f16" (NULL for a value out of range) */
const char *ds4_numerics_name(ds4_numerics n);
/* The numerics named v (ds4_numerics_name's names); false for any other
 * string. */
bool ds4_numerics_parse(const char *v, ds4_numerics *out);
/* The names, for messages: "ds4, reference or ds4-f16" */
#define DS4_NUMERICS_NAMES "ds4, reference or ds4-f16"

/* A weight tensor bound from the model file. `host` points into the mmap;
 * `device` is the backend's copy (NULL for the CPU backend, which reads the
 * mapping in place). */
typedef struct ds4_weight {
    const char *name;
    uint32_t type; /* ds4_type */
    int64_t ne[4]; /* ggml order; unused dims are 1 */
    int64_t row_bytes;
    const void *host;
    void *device;
    void *owned; /* host memory the backend allocated for it (synthetic weights); release_weight frees it */
} ds4_weight;

/* RoPE of the last `n_rot` dims of each head, adjacent pairs (2k, 2k+1).
 * theta_k = p * base^(-2k/n_rot); with YaRN (factor > 1) the per-pair
 * frequency is blended between theta and theta/factor by the ramp over
 * [yarn_lo, yarn_hi] (spec 3.4.4). No magnitude scaling. */
typedef struct ds4_rope {
    int n_rot;
    float base;
    float factor;      /* 1 = plain RoPE */
    float yarn_lo;     /* ramp start (pair index), computed from the betas */
    float yarn_hi;     /* ramp end */
} ds4_rope;

/* Hyper-connection parameters (spec 3.2, 3.3, 3.8). */
typedef struct ds4_hc {
    int n_hc;       /* streams (4) */
    int64_t dim;    /* width of one stream (H) */
    int iters;      /* Sinkhorn iterations (20) */
    float eps;      /* hc epsilon */
    float norm_eps; /* RMSNorm epsilon of the flattened state */
} ds4_hc;

typedef struct ds4_backend ds4_backend;

typedef struct ds4_backend_ops {
    const char *name;
    /* the numerics it implements: bit n for ds4_numerics n */
    unsigned numerics;

    /* ---- memory ---------------------------------------------------- */
    /* Float buffers in backend memory (zero-filled). NULL on failure. */
    float *(*alloc)(ds4_backend *be, int64_t n_floats);
    void (*free)(ds4_backend *be, float *buf);
    void (*upload)(ds4_backend *be, float *dst, const float *host_src, int64_t n);
    void (*download)(ds4_backend *be, float *host_dst, const float *src, int64_t n);
    void (*copy)(ds4_backend *be, float *dst, const float *src, int64_t n);
    void (*fill)(ds4_backend *be, float *dst, float value, int64_t n);
    /* dst[(r * copies + c) * dim + i] = src[r * dim + i] for r < n_rows,
     * c < copies: each row repeated `copies` times (the embedding into every
     * HC stream). dst and src do not overlap. */
    void (*repeat_rows)(ds4_backend *be, float *dst, const float *src, int64_t n_rows, int64_t dim, int64_t copies);
    /* dst[i][0 .. width) = src[i][0 .. width) for i < n: n copies of one
     * width in one call (dst, src: host arrays of n backend pointers; the
     * rows of a batch of states going to their own states). No destination
     * overlaps any copy's source (its own too) or another destination. */
    void (*copy_rows)(ds4_backend *be, float *const *dst, const float *const *src, int64_t width, int64_t n);
    /* Make a weight usable by this backend (e.g. upload it). */
    ds4_status (*bind_weight)(ds4_backend *be, ds4_weight *w, ds4_error *err);
    /* Bind a weight of w's name, type and shape whose bytes the backend makes
     * itself, block by block from `fill` (core/synth_fill.h), where it keeps
     * weights: the same bytes on every backend. Integer tables are made in
     * host memory (the model reads them there). w->host is left as given
     * unless the backend computes from host memory (the CPU: w->host then
     * points at the bytes, held in w->owned). Optional (NULL: none). */
    ds4_status (*bind_synthetic)(ds4_backend *be, ds4_weight *w, const ds4_fill *fill, ds4_error *err);
    void (*release_weight)(ds4_backend *be, ds4_weight *w);

    /* ---- elementwise and norms -------------------------------------- */
    /* out[r] = row tokens[r] of the embedding [dim, vocab] (F16 or F32). */
    void (*embed)(ds4_backend *be, const ds4_weight *table, const int32_t *tokens, int n, float *out);
    /* out[r][i] = x[r][i] * w[i] / sqrt(mean(x[r]^2) + eps); w NULL = plain.
     * The mean of squares is accumulated in double. out may equal x. */
    void (*rmsnorm)(ds4_backend *be, const float *x, const ds4_weight *w, float eps, float *out, int64_t n_rows,
                    int64_t dim);
    void (*add)(ds4_backend *be, const float *a, const float *b, float *out, int64_t n);
    /* x[r][i] += W row `row` [i] (W is [dim, n] in F16/F32), for r < n_rows. */
    void (*add_weight_row)(ds4_backend *be, float *x, const ds4_weight *w, int64_t row, int64_t n_rows);
    /* x[r][i] += W row (first + r) mod R [i] (W is [dim, R]), for r < n_rows:
     * the rows of a position table (R positions, repeating) for a run of
     * consecutive positions starting at one of residue `first`. */
    void (*add_weight_rows_mod)(ds4_backend *be, float *x, const ds4_weight *w, int64_t first, int64_t n_rows);
    /* x[r][i] += W row rows[r] [i] (rows: host, n_rows of them, each in [0,
     * R)): the rows of a position table for rows at positions of their own
     * (a batch of states). */
    void (*add_weight_rows_at)(ds4_backend *be, float *x, const ds4_weight *w, const int64_t *rows, int64_t n_rows);
    /* In-place round trip through IEEE half precision (round to nearest even). */
    void (*round_f16)(ds4_backend *be, float *x, int64_t n);
    /* FP8 E4M3 round trip of dims [0, dim - n_rope) of each row, in blocks of 64
     * with a power-of-two scale per block (spec 3.0); the last n_rope dims are
     * untouched. */
    void (*round_fp8_kv)(ds4_backend *be, float *x, int64_t n_rows, int64_t dim, int64_t n_rope);
    /* Indexer QAT on rows of `dim` (power of two): orthonormal Walsh-Hadamard
     * transform, then FP4 E2M1 round trip in blocks of 32 (spec 3.0). */
    void (*indexer_qat)(ds4_backend *be, float *x, int64_t n_rows, int64_t dim);

    /* ---- matrix products -------------------------------------------- */
    /* out[r][o] = sum_i W[row0 + o][i] * x[r][i] for o < n_out, r < n_rows.
     * x rows are `x_stride` floats apart, out rows `out_stride` apart. Any
     * weight type with a dequantiser; numerics as described at the top. */
    void (*matmul)(ds4_backend *be, const ds4_weight *w, int64_t row0, int64_t n_out, const float *x,
                   int64_t x_stride, float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num);
    /* Several products of one input x [n_rows, n_in], x_stride apart: for
     * j < n, exactly matmul(p[j].w, 0, p[j].n_out, x, x_stride, p[j].out,
     * p[j].out_stride, n_rows, num), in any order (the outputs overlap
     * neither x nor each other). Every p[j].w has rows of n_in = p[0].w->ne[0]
     * elements; 1 <= n <= DS4_PRODUCTS_MAX. A device backend may quantise x
     * once for all of them and run the products of one weight type in one
     * launch (which may sum in another order than separate calls). */
    void (*matmul_multi)(ds4_backend *be, const ds4_product *p, int n, const float *x, int64_t x_stride,
                         int64_t n_rows, ds4_numerics num);
    /* Grouped product over the first n_groups * n_out rows of W (rows of
     * n_in = W->ne[0] elements); for g < n_groups, o < n_out, r < n_rows:
     *   out[r][g*n_out + o] = sum_i W[g*n_out + o][i] * x[r][g*n_in + i],
     * i.e. group g multiplies its own slice of each x row by its own block
     * of W rows (the attention output's low-rank projection, one call for
     * all groups). x rows are x_stride floats apart (>= n_groups * n_in), out
     * rows out_stride apart (>= n_groups * n_out). Same numerics as matmul,
     * applied per group: under DS4 each group's slice of x is quantised on
     * its own, exactly as n_groups separate matmul calls with row0 = g*n_out
     * and x + g*n_in would do (on the CPU the results are bit-identical to
     * those calls). Requires n_groups >= 1, n_out >= 0, n_rows >= 0 and
     * n_groups * n_out <= the rows of W; the strides matter only when
     * n_rows > 1 (as for matmul). n_out 0 or n_rows 0 does nothing. */
    void (*matmul_grouped)(ds4_backend *be, const ds4_weight *w, int64_t n_groups, int64_t n_out, const float *x,
                           int64_t x_stride, float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num);
    /* Optional (NULL: the caller makes the two calls): exactly
     * rope_tail(x, n_rows, n_heads, head_dim, pos, rope, true), then
     * matmul_grouped(w, n_groups, n_out, x, n_heads * head_dim, out,
     * out_stride, n_rows, num): the attention output's inverse RoPE and its
     * grouped low-rank projection, in one pass where the backend rotates
     * the rows as it quantises them. Rows of x hold n_heads heads of
     * head_dim floats, n_heads * head_dim = n_groups * W->ne[0]. x is not to
     * be read after: a backend that rotates as it quantises leaves it as it
     * was, the two calls leave it rotated. The arguments are checked as the
     * two calls check them. */
    void (*rope_matmul_grouped)(ds4_backend *be, const ds4_weight *w, int64_t n_groups, int64_t n_out, float *x,
                                int64_t n_heads, int64_t head_dim, const int32_t *pos, const ds4_rope *rope,
                                float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num);

    /* ---- rotary ------------------------------------------------------ */
    /* Rotate the last rope->n_rot dims of each of n_heads heads of width
     * head_dim, row r at position pos[r]; inverse uses -sin. */
    void (*rope_tail)(ds4_backend *be, float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim,
                      const int32_t *pos, const ds4_rope *rope, bool inverse);
    /* The per-head finish of q and KV rows, in place: exactly rmsnorm(x, w,
     * eps, x, n_rows * n_heads, head_dim) (w [head_dim] or NULL: plain), then
     * rope_tail(x, n_rows, n_heads, head_dim, pos, rope, false), then with
     * round_kv (the KV rows under DS4 numerics) round_fp8_kv(x, n_rows *
     * n_heads, head_dim, rope->n_rot) and round_f16(x, n_rows * n_heads *
     * head_dim): one pass over the rows where the backend fuses them. The
     * arguments are checked first (ds4_head_norm_rope_valid). */
    void (*head_norm_rope)(ds4_backend *be, float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim,
                           const ds4_weight *w, float eps, const int32_t *pos, const ds4_rope *rope, bool round_kv);
    /* Two row sets of the same rows and positions (the model's q heads and
     * KV row): exactly head_norm_rope(a->x, n_rows, a->n_heads, head_dim,
     * a->w, eps, pos, rope, a->round_kv), then the same for b, in one pass
     * where the backend fuses them. a's and b's rows must not overlap
     * (DS4_ERR_INVALID). Optional: NULL (the CPU), the two calls. */
    void (*head_norm_rope2)(ds4_backend *be, const ds4_head_rows *a, const ds4_head_rows *b, int64_t n_rows,
                            int64_t head_dim, float eps, const int32_t *pos, const ds4_rope *rope);

    /* ---- hyper-connections ------------------------------------------ */
    /* For each of n_rows token states X [n_hc * dim]: mix = fn . plain_rmsnorm(X)
     * (fn [n_hc*dim, (2+n_hc)*n_hc]); pre/post/comb via sigmoid and Sinkhorn;
     * x_out = sum_s pre[s] X[s]. post [n_rows, n_hc], comb [n_rows, n_hc*n_hc]
     * with comb[s*n_hc + d] the weight from source s to destination d. */
    void (*hc_pre)(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn,
                   const ds4_weight *scale, const ds4_weight *base, float *x_out, float *post, float *comb,
                   int64_t n_rows);
    /* A sublayer's input: exactly hc_pre(hc, X, fn, scale, base, x_out,
     * post, comb, n_rows), then rmsnorm(x_out, norm, eps, a_out, n_rows,
     * hc->dim) (norm NULL: plain; a_out may equal x_out, which then holds
     * the norm): one pass over the rows where the backend fuses them. */
    void (*hc_pre_norm)(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn,
                        const ds4_weight *scale, const ds4_weight *base, const ds4_weight *norm, float eps,
                        float *x_out, float *post, float *comb, float *a_out, int64_t n_rows);
    /* X_out[d] = post[d] * y + sum_s comb[s][d] * X[s] (X_out must not alias X). */
    void (*hc_post)(ds4_backend *be, const ds4_hc *hc, const float *y, const float *X, const float *post,
                    const float *comb, float *X_out, int64_t n_rows);
    /* The boundary of two sublayers: exactly add(y, y2) (y2 non-NULL; into
     * a buffer of the backend's own, y is not written), then hc_post(hc,
     * y', X, post, comb, X_out, n_rows), then hc_pre_norm(hc, X_out, fn,
     * scale, base, norm, eps, x_out, post_out, comb_out, a_out, n_rows).
     * post_out and comb_out may be post and comb. */
    void (*hc_post_pre_norm)(ds4_backend *be, const ds4_hc *hc, const float *y, const float *y2, const float *X,
                             const float *post, const float *comb, float *X_out, const ds4_weight *fn,
                             const ds4_weight *scale, const ds4_weight *base, const ds4_weight *norm, float eps,
                             float *x_out, float *post_out, float *comb_out, float *a_out, int64_t n_rows);
    /* Final merge: w_s = sigmoid(fn_s . plain_rmsnorm(X) * scale + base_s) + eps;
     * out = sum_s w_s X[s]. fn [n_hc*dim, n_hc]. */
    void (*hc_head)(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn,
                    const ds4_weight *scale, const ds4_weight *base, float *out, int64_t n_rows);

    /* ---- attention --------------------------------------------------- */
    /* One query token: q [n_heads, dim]; the key/value rows are rows_a
     * [n_a, dim] followed by the rows of rows_b [n_rows_b, dim] listed in
     * idx_b (n_b int32 indices in backend memory; idx_b NULL = the first n_b
     * rows in order, n_b <= n_rows_b). Per head h: softmax over
     * {q_h . row / sqrt(dim)} and the sink logit sinks[h] (which has no
     * value); out_h = sum of weights * rows. An index outside [0, n_rows_b)
     * is an error (a device backend finds it while the op runs, leaves the
     * row out and reports it at the next take_error). */
    void (*attention)(ds4_backend *be, const float *q, int64_t n_heads, int64_t dim, const float *rows_a,
                      int64_t n_a, const float *rows_b, int64_t n_rows_b, const int32_t *idx_b, int64_t n_b,
                      const ds4_weight *sinks, float *out);
    /* n query rows, row r exactly as `attention` with q + r * n_heads * dim,
     * the a_n[r] rows of rows_a from row a_off[r], the first b_n[r] rows of
     * rows_b (no selection) and out + r * n_heads * dim: the rows of a
     * prefill run, each with its own view of one state's window and
     * compressed rows. a_off, a_n, b_n: host arrays of n. */
    void (*attention_rows)(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                           const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                           const int64_t *b_n, const ds4_weight *sinks, float *out);
    /* attention_rows for rows of different states (a batched decode): row
     * r attends to its a_n[r] window rows from rows_a[r] and to the first
     * b_n[r] rows of rows_b[r] (host arrays of n backend pointers; a pointer
     * may be NULL where its count is 0), exactly as `attention` with
     * rows_a = rows_a[r], rows_b = rows_b[r], n_b = n_rows_b = b_n[r]. */
    void (*attention_states)(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                             const float *const *rows_a, const int64_t *a_n, const float *const *rows_b,
                             const int64_t *b_n, const ds4_weight *sinks, float *out);
    /* The same with a selection per row (the indexer's): row r attends to
     * its view of rows_a and to the k rows idx[r * k .. r * k + k) of rows_b
     * (idx: int32 in backend memory, each below b_rows[r]), exactly as
     * `attention` with idx_b = idx + r * k, n_b = k, n_rows_b = b_rows[r]. */
    void (*attention_rows_sel)(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                               const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                               const int64_t *b_rows, const int32_t *idx, int64_t k, const ds4_weight *sinks,
                               float *out);
    /* attention_rows_sel (idx NULL and k 0: attention_rows, b_rows[r] then
     * the count of rows_b row r reads) for key/value rows whose every value
     * is a binary16 value (DS4 numerics stores them F16-rounded), which
     * the backend may then read at binary16 (the CUDA backend: on the
     * tensor cores); the results within float rounding of the op it
     * replaces. Optional: NULL (the CPU), the model calls those ops. */
    void (*attention_rows_f16)(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                               const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                               const int64_t *b_rows, const int32_t *idx, int64_t k, const ds4_weight *sinks,
                               float *out);

    /* ---- compressor (spec 3.5) ---------------------------------------- */
    /* Per-dimension softmax-gated pooling over the compressor state.
     * state_kv / state_score are [n_state_rows, width]. ratio 4 (coff 2):
     * candidates are rows 0..3 at lane [j] and rows 4..7 at lane [dim + j];
     * otherwise rows 0..ratio-1 at lane [j]. out[j] = sum softmax(score) * kv,
     * 0 when every score is -inf. n_windows pools in one call: pool w reads
     * the rows from w * ratio on (consecutive windows of rows in position
     * order; ratio 4's overlap: window w's lane B rows are window w + 1's
     * lane A rows) and writes out[w * dim ..]. */
    void (*compressor_pool)(ds4_backend *be, const float *state_kv, const float *state_score, int ratio,
                            int64_t dim, int64_t n_windows, float *out);
    /* compressor_pool of one window for each of n states (a batch of states
     * whose windows end together): window w reads the rows of state_kv[w] /
     * state_score[w] (host arrays of backend pointers) and writes
     * out[w * dim ..]. */
    void (*compressor_pool_states)(ds4_backend *be, const float *const *state_kv, const float *const *state_score,
                                   int ratio, int64_t dim, int64_t n, float *out);

    /* ---- indexer (spec 3.6) ------------------------------------------- */
    /* score[c] = sum_h relu(q_h . keys[c]) * w_h, for c < n_keys, heads in
     * order, with the head weight w_h = weights[h] * weight_scale rounded to
     * float once (the model's 1/sqrt(dim * n_heads), spec 3.6.3); q
     * [n_heads, dim], keys [n_keys, dim], weights [n_heads]. */
    void (*indexer_scores)(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                           int64_t n_heads, int64_t dim, const float *keys, int64_t n_keys, float *scores);
    /* The k highest of scores[0..n) into idx (k int32 in backend memory), in
     * descending score order, lowest index first among ties; idx[n..k) = -1
     * when k > n. */
    void (*top_k)(ds4_backend *be, const float *scores, int64_t n, int64_t k, int32_t *idx);
    /* Both for n_rows queries at once (a prefill chunk's rows that select):
     * row r's query q + r * n_heads * dim and weights + r * n_heads score the
     * first n_keys[r] keys (n_keys: host) into scores + r * stride, exactly
     * as indexer_scores does for one; top_k_rows ranks row r's first n[r]
     * scores (scores + r * stride, n: host) into idx + r * k as top_k. */
    void (*indexer_scores_rows)(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                                int64_t n_heads, int64_t dim, const float *keys, const int64_t *n_keys,
                                int64_t n_rows, float *scores, int64_t stride);
    void (*top_k_rows)(ds4_backend *be, const float *scores, int64_t stride, const int64_t *n, int64_t n_rows,
                       int64_t k, int32_t *idx);
    /* indexer_scores_rows for queries and keys whose every value is a
     * binary16 value (DS4 numerics: the indexer QAT's FP4 values times
     * powers of two, the keys F16-rounded too), which the backend may read
     * at binary16 (values that are not are rounded to it, as DS4's CUDA
     * prefill casts them: then an error of binary16's size; the CUDA
     * backend: on the tensor cores); for binary16 values the results are
     * within float rounding of indexer_scores_rows, the same bits wherever
     * every partial sum of a dot is exact in float (the QAT'd rows: in
     * practice always). Optional: NULL (the CPU), the model calls
     * indexer_scores_rows. */
    void (*indexer_scores_rows_f16)(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                                    int64_t n_heads, int64_t dim, const float *keys, const int64_t *n_keys,
                                    int64_t n_rows, float *scores, int64_t stride);

    /* ---- feed-forward (spec 3.7) -------------------------------------- */
    /* Router for n_rows tokens, each on its own. Row r: prob_e =
     * sqrt(softplus(logits[r][e])); selection = hash_ids[r] (n_used ids)
     * when hash_ids is non-NULL, else the top n_used of prob + bias (bias
     * may be NULL; lowest index wins ties); weights = prob_sel /
     * max(sum prob_sel, 6.103515625e-5) * scale (normalised when
     * `normalise`, else prob_sel * scale). logits is [n_rows, n_expert]
     * (rows n_expert apart, backend memory); hash_ids [n_rows, n_used] is in
     * host memory; sel_out (int32) and weight_out, both [n_rows, n_used], are
     * in backend memory. Row r is exactly the single-token router (n_rows 1)
     * applied to row r; n_rows 0 does nothing, a negative count is an
     * error, and so is a hash id outside [0, n_expert) in any row. */
    void (*router)(ds4_backend *be, const float *logits, int64_t n_expert, const ds4_weight *bias,
                   const int32_t *hash_ids, int n_used, bool normalise, float scale, int32_t *sel_out,
                   float *weight_out, int64_t n_rows);
    /* out = silu(min(g, limit)) * clamp(u, -limit, limit) * scale (limit <= 0: no clamp). */
    void (*swiglu)(ds4_backend *be, const float *g, const float *u, float limit, float scale, float *out,
                   int64_t n);
    /* Routed experts for n_rows tokens, each with its own routing. Row r:
     * out[r] = sum_k down_e(swiglu(gate_e x[r], up_e x[r]) * w_k), summed in
     * the order k = 0, 1, ..., with e = sel[r][k], w_k = weights[r][k]. x and
     * out are [n_rows, dim] (rows dim apart); sel (int32) and weights are
     * [n_rows, n_used], all in backend memory (e.g. the router's outputs);
     * gate/up [dim, n_ff, n_expert], down [n_ff, dim, n_expert]. Under ds4
     * numerics each x row and each mid are quantised on their own (Q8_K for
     * K-quant/IQ2 weights, Q8_0 for Q8_0), so row r is exactly the
     * single-token op (n_rows 1) on x row r with sel / weights row r;
     * n_rows 0 does nothing, a negative count is an error. An id outside
     * [0, n_expert) in any row is an error (a device backend finds it while
     * the op runs, leaves that expert out and reports it at the next
     * take_error). */
    void (*moe)(ds4_backend *be, const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down,
                const float *x, const int32_t *sel, const float *weights, int n_used, float limit, float *out,
                int64_t n_rows, ds4_numerics num);

    /* ---- recording (optional: NULL when the backend has none) -------- */
    /* The ops called between step_begin and step_end form one step (a
     * decoded token) that the backend may record and submit as a whole
     * (the CUDA backend: a CUDA graph, updated in place from step to step);
     * step_end submits it. Semantics are unchanged: an op in between that
     * must return data to the host (download) still does, the backend then
     * submits what it recorded so far first. */
    void (*step_begin)(ds4_backend *be);
    void (*step_end)(ds4_backend *be);
    /* A point inside a step (the model: after each layer) where the backend
     * may submit what it recorded so far and go on recording the rest, so
     * the device starts while the host is still recording. Optional (NULL);
     * semantics are unchanged. */
    void (*step_mark)(ds4_backend *be);
    /* A side branch of a step (optional: NULL when the backend has none):
     * the ops called between branch_begin and branch_end may run beside
     * the ops called after branch_end, until branch_join; what comes after
     * the join sees the results of both. The caller promises that neither
     * side reads or writes a buffer the other writes, between the begin and
     * the join (scratch of the backend's own is the backend's concern).
     * Semantics are unchanged: outside a recorded step, or on a backend
     * that runs ops in call order, the calls do nothing. A branch begun
     * after another's end and before any join may run beside it (both
     * from the main chain; the caller's promise then holds between every
     * two of them), and one join takes them all. */
    void (*branch_begin)(ds4_backend *be);
    void (*branch_end)(ds4_backend *be);
    void (*branch_join)(ds4_backend *be);
    /* A hint (optional: NULL when the backend has none): the n weights
     * w[0..n) are read soon, in that order, by ops called after this one.
     * The backend may start bringing them nearer its compute units beside
     * the ops in between (the CUDA backend, in a recorded step: into its L2
     * cache, as much as the cache holds). Results are unchanged; n 0 does
     * nothing; a NULL or unbound weight, or n < 0, is an error. */
    void (*prefetch)(ds4_backend *be, const ds4_weight *const *w, int n);

    /* ---- errors ------------------------------------------------------ */
    /* The ops above return nothing; an op that cannot run (bad shapes or
     * arguments, a weight type it cannot compute with, scratch memory that
     * could not be allocated, a device fault, a bad index read from backend
     * memory) records an error and leaves its outputs unspecified.
     * take_error returns the FIRST error recorded since the previous call
     * (filling err) and clears it; DS4_OK if none. Errors that a device
     * finds while an op runs surface here (take_error waits for the device). */
    ds4_status (*take_error)(ds4_backend *be, ds4_error *err);
} ds4_backend_ops;

struct ds4_backend {
    const ds4_backend_ops *ops;
    void *impl;      /* backend-private state */
    int n_threads;   /* CPU worker threads (CPU backend) */
};

/* What a backend has done since it was created (for benchmarks): device
 * kernel launches and device-side copies, host <-> device copies and bytes,
 * host waits for the device, and device memory. All zero on the CPU backend
 * except what it can say (nothing moves between memories there). */
typedef struct ds4_backend_counters {
    uint64_t launches;  /* kernels and device-to-device copies/fills enqueued */
    uint64_t copies;    /* host <-> device copies */
    uint64_t h2d_bytes; /* bytes copied to the device (weights excluded) */
    uint64_t d2h_bytes; /* bytes copied to the host */
    uint64_t syncs;     /* host waits for the device */
    uint64_t wait_ns;   /* host time spent in those waits */
    uint64_t graphs;       /* recorded steps launched as graphs */
    uint64_t graph_launches; /* graphs launched (a step submitted in segments launches several) */
    uint64_t graph_builds; /* graphs instantiated (a step shape not cached, or an update refused) */
    uint64_t graph_refusals; /* ... of them because CUDA refused to update a cached graph's nodes */
    uint64_t node_updates; /* graph nodes whose parameters were set anew */
    uint64_t step_breaks;  /* recorded steps cut short (the rest ran unrecorded) */
    uint64_t step_host_ns; /* host time inside recorded steps (step_begin to the end of step_end) */
    uint64_t graph_gpu_ns; /* device time of the steps launched as graphs (events; finished ones) */
    uint64_t weight_bytes; /* device memory held by weights now */
    uint64_t peak_bytes;   /* peak device memory in use */
} ds4_backend_counters;
void ds4_backend_counters_get(ds4_backend *be, ds4_backend_counters *out);

/* Device time per kernel (for benchmarks), when the backend was created
 * with kernel timing on (CUDA: DS4_CUDA_PROFILE=1, which also turns
 * recorded steps off: every launch is bracketed by events). One entry per
 * kernel (copies and memsets have their own), the launches since the last
 * reset. */
typedef struct ds4_kernel_time {
    const char *name; /* the kernel's symbol (or "copy" / "memset") */
    const char *what; /* what the op calls it */
    uint64_t count;
    double ms;
} ds4_kernel_time;
/* Fills up to cap entries, busiest first; returns how many there are (0
 * when timing is off or the backend has none). Waits for the device. */
int ds4_backend_kernel_times(ds4_backend *be, ds4_kernel_time *out, int cap);
void ds4_backend_kernel_times_reset(ds4_backend *be);
/* Open (on) or close the backend's profiler range once the work queued so
 * far is done: CUDA brackets it with cudaProfilerStart/Stop, for external
 * profilers whose capture starts off (ncu --profile-from-start off); the
 * CPU backend has none (a no-op). */
void ds4_backend_profiler_range(ds4_backend *be, bool on);

/* The host bytes of synthetic weight w made from `fill` (every block, in a
 * malloc'd buffer the caller frees); NULL with err set (naming `who`) when
 * the fill does not suit w's type and shape or memory is short. For the
 * backends' bind_synthetic. */
void *ds4_fill_host_bytes(const ds4_weight *w, const ds4_fill *fill, const char *who, ds4_error *err);

/* attention_rows' view arrays and buffers, as both backends check them:
 * false with the message in err (status DS4_ERR_INVALID). */
/* indexer_scores_rows' and top_k_rows' per-row counts (host, n_rows of
 * them, `what` they count), as both backends check them: each within
 * 0 .. stride; the largest into *most (may be NULL). */
bool ds4_row_counts_valid(const char *op, const char *what, const int64_t *counts, int64_t n_rows, int64_t stride,
                          int64_t *most, ds4_error *err);
bool ds4_attention_rows_valid(int64_t n, const float *q, const float *out, const int64_t *a_off, const int64_t *a_n,
                              const int64_t *b_n, ds4_error *err);
/* n pairs of backend pointers (host arrays a, b; copy_rows' destinations
 * and sources, compressor_pool_states' state rows and scores), as both
 * backends check them: n >= 0, the arrays there when n > 0 and no pointer
 * NULL; false with the message in err ("OP: ITEM i has no B_NAME"). */
bool ds4_pointer_pairs_valid(const char *op, const char *item, const void *const *a, const char *a_name,
                             const void *const *b, const char *b_name, int64_t n, ds4_error *err);
/* add_weight_rows_at's table rows as both backends check them: n_rows >= 0,
 * rows there when n_rows > 0, each in [0, n_table) of the weight named
 * `table`; false with the message in err ("OP: row r asks for row i of
 * TABLE (R rows)"). */
bool ds4_table_rows_valid(const char *op, const char *table, const int64_t *rows, int64_t n_rows, int64_t n_table,
                          ds4_error *err);
/* head_norm_rope's arguments as both backends check them: n_rows >= 0;
 * when n_rows > 0, x and pos there, n_heads >= 1, head_dim >= 1, RoPE
 * parameters with an even n_rot in 1 .. head_dim, and w NULL or head_dim
 * wide; false with the message in err. */
bool ds4_head_norm_rope_valid(const float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const ds4_weight *w,
                              const int32_t *pos, const ds4_rope *rope, ds4_error *err);
/* attention_states' arrays as both backends check them (counts >= 0, a
 * pointer wherever its count is not 0). */
bool ds4_attention_states_valid(int64_t n, const float *q, const float *out, const float *const *rows_a,
                                const int64_t *a_n, const float *const *rows_b, const int64_t *b_n, ds4_error *err);

/* matmul_multi's arguments as both backends check them (the count, every
 * weight present with p[0]'s row length, outputs within the weights and
 * not NULL, strides for several rows): false with the message in err
 * (DS4_ERR_INVALID). Weight types are each backend's to check. */
bool ds4_products_valid(const ds4_product *p, int n, const float *x, int64_t x_stride, int64_t n_rows, ds4_error *err);
/* Product p's row (p->add, when set) added to its n_rows output rows with
 * the backend's add_weight_row op: one call where the rows are contiguous,
 * else one a row. For matmul_multi implementations, after the product. */
void ds4_product_add_row(ds4_backend *be, const ds4_product *p, int64_t n_rows);

/* DS4_OK when the backend implements numerics n, else DS4_ERR_UNSUPPORTED
 * naming the numerics and the backend (never a fallback to others). */
ds4_status ds4_backend_check_numerics(const ds4_backend *be, ds4_numerics n, ds4_error *err);

/* Create a backend by name ("cpu"; "cuda" when built in). NULL name = "cpu".
 * An unknown or unavailable backend is an error, never a fallback. */
ds4_status ds4_backend_create(const char *name, int n_threads, ds4_backend **out, ds4_error *err);
void ds4_backend_destroy(ds4_backend *be);

/* The CPU backend's constructor (used by ds4_backend_create). */
ds4_status ds4_cpu_backend_create(int n_threads, ds4_backend **out, ds4_error *err);

#ifdef __cplusplus
}
#endif

#endif

/*
 * cpu_attention.c - the attention side of the CPU backend: tail RoPE,
 * attention with sinks, the compressor's softmax-gated pooling, indexer
 * scores and top-k selection (spec 3.4 - 3.6).
 */
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/cpu_internal.h"

/* ------------------------------------------------------------------------ */
/* RoPE on the tail of each head (spec 3.4.4)                                */
/* ------------------------------------------------------------------------ */

/*
 * The angle of pair k at position p: theta = p * base^(-2k/n_rot); with YaRN
 * (factor > 1) blended between theta (ramp 1, pairs below yarn_lo) and
 * theta / factor (ramp 0, pairs above yarn_hi).
 *
 * Computed in double, and cos/sin taken in double, then rounded to float.
 * ds4.c computes theta in float by repeated multiplication by
 * base^(-2/n_rot); at position p the float angle carries an absolute error
 * of order p * 2^-24 radians (already ~0.06 rad at p = 1e6), which depends on
 * the formula's rounding rather than on the model. The double angle is exact
 * to ~1e-10 rad at any context length the model supports, so cos/sin are the
 * correctly rounded values of the spec's formula: a reproducible reference
 * that any backend's float error can be measured against.
 */
static double rope_angle(const ds4_rope *rope, int64_t p, int64_t k) {
    const double theta = (double)p * pow((double)rope->base, -2.0 * (double)k / (double)rope->n_rot);
    if (!(rope->factor > 1.0f)) return theta;
    double span = (double)rope->yarn_hi - (double)rope->yarn_lo;
    if (span < 0.001) span = 0.001;
    double y = ((double)k - (double)rope->yarn_lo) / span;
    if (y < 0.0) y = 0.0;
    if (y > 1.0) y = 1.0;
    const double ramp = 1.0 - y;
    return theta / (double)rope->factor * (1.0 - ramp) + theta * ramp;
}

void cpu_rope_tail(ds4_backend *be, float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t *pos,
                   const ds4_rope *rope, bool inverse) {
    const int64_t n_rot = rope->n_rot;
    if (n_rot <= 0 || n_rot % 2 != 0 || n_rot > head_dim) {
        cpu_fail(be, DS4_ERR_INVALID, "rope_tail: %lld rotated dims in heads of %lld", (long long)n_rot,
                 (long long)head_dim);
        return;
    }
    const int64_t half = n_rot / 2;
    float *cs = malloc((size_t)n_rot * sizeof *cs); /* cos of each pair, then sin */
    if (!cs) {
        cpu_fail(be, DS4_ERR_NOMEM, "rope_tail: out of memory");
        return;
    }
    const double sin_sign = inverse ? -1.0 : 1.0;
    for (int64_t r = 0; r < n_rows; r++) {
        for (int64_t k = 0; k < half; k++) {
            const double theta = rope_angle(rope, pos[r], k);
            cs[k] = (float)cos(theta);
            cs[half + k] = (float)(sin_sign * sin(theta));
        }
        for (int64_t h = 0; h < n_heads; h++) {
            float *tail = x + (r * n_heads + h) * head_dim + (head_dim - n_rot);
            for (int64_t k = 0; k < half; k++) {
                const float c = cs[k], s = cs[half + k];
                const float x0 = tail[2 * k], x1 = tail[2 * k + 1];
                tail[2 * k] = x0 * c - x1 * s;
                tail[2 * k + 1] = x0 * s + x1 * c;
            }
        }
    }
    free(cs);
}

/* ------------------------------------------------------------------------ */
/* Attention with sinks (spec 3.4.7)                                         */
/* ------------------------------------------------------------------------ */

typedef struct attention_job {
    const float *q;
    int64_t dim;
    const float *rows_a;
    int64_t n_a;
    const float *rows_b;
    const int32_t *idx_b;
    int64_t n_b;
    const float *sinks;
    float *out;
    float *scores; /* per thread: n_a + n_b floats */
} attention_job;

static const float *attention_row(const attention_job *job, int64_t r) {
    if (r < job->n_a) return job->rows_a + r * job->dim;
    r -= job->n_a;
    return job->rows_b + (job->idx_b ? (int64_t)job->idx_b[r] : r) * job->dim;
}

/* Per head h: s_r = q_h . row_r / sqrt(dim); m = max(sink, s_r);
 * out_h = sum_r exp(s_r - m) row_r / (exp(sink - m) + sum_r exp(s_r - m)). */
static void attention_range(void *vctx, int64_t begin, int64_t end, int thread) {
    const attention_job *job = vctx;
    const int64_t n = job->n_a + job->n_b, dim = job->dim;
    float *score = job->scores + (int64_t)thread * (n > 0 ? n : 1);
    const float kq_scale = 1.0f / sqrtf((float)dim);
    for (int64_t h = begin; h < end; h++) {
        const float *qh = job->q + h * dim;
        float *oh = job->out + h * dim;
        const float sink = job->sinks[h];
        float m = sink;
        for (int64_t r = 0; r < n; r++) {
            score[r] = cpu_dot_f32(qh, attention_row(job, r), dim) * kq_scale;
            if (score[r] > m) m = score[r];
        }
        memset(oh, 0, (size_t)dim * sizeof *oh);
        float den = expf(sink - m);
        for (int64_t r = 0; r < n; r++) {
            const float w = expf(score[r] - m);
            const float *row = attention_row(job, r);
            den += w;
            for (int64_t i = 0; i < dim; i++) oh[i] += w * row[i];
        }
        const float inv = 1.0f / den;
        for (int64_t i = 0; i < dim; i++) oh[i] *= inv;
    }
}

void cpu_attention(ds4_backend *be, const float *q, int64_t n_heads, int64_t dim, const float *rows_a, int64_t n_a,
                   const float *rows_b, int64_t n_rows_b, const int32_t *idx_b, int64_t n_b,
                   const ds4_weight *sinks, float *out) {
    if (!sinks || !cpu_has_dequant(sinks) || sinks->ne[0] < n_heads || n_heads < 0 || dim <= 0 || n_a < 0 || n_b < 0) {
        cpu_fail(be, DS4_ERR_INVALID, "attention: %lld heads of %lld, %lld + %lld rows, sinks %s", (long long)n_heads,
                 (long long)dim, (long long)n_a, (long long)n_b, cpu_wname(sinks));
        return;
    }
    if (n_rows_b < 0 || (!idx_b && n_b > n_rows_b)) {
        cpu_fail(be, DS4_ERR_INVALID, "attention: the first %lld of %lld rows of rows_b (sinks %s)", (long long)n_b,
                 (long long)n_rows_b, cpu_wname(sinks));
        return;
    }
    /* The message is the one the CUDA backend gives for the same index. */
    for (int64_t r = 0; idx_b && r < n_b; r++) {
        if (idx_b[r] < 0 || idx_b[r] >= n_rows_b) {
            cpu_fail(be, DS4_ERR_INVALID, "attention: selected row %lld has index %d, outside [0, %lld) of rows_b "
                     "(sinks %s)", (long long)r, idx_b[r], (long long)n_rows_b, cpu_wname(sinks));
            return;
        }
    }
    const int64_t n = n_a + n_b;
    float *sink_buf = malloc((size_t)sinks->ne[0] * sizeof *sink_buf);
    float *scores = malloc((size_t)cpu_impl(be)->n_threads * (size_t)(n > 0 ? n : 1) * sizeof *scores);
    if (!sink_buf || !scores) {
        cpu_fail(be, DS4_ERR_NOMEM, "attention: out of memory for %lld rows", (long long)n);
    } else {
        const float *sink_v = cpu_weight_vector(sinks, sinks->ne[0], sink_buf);
        attention_job job = { q, dim, rows_a, n_a, rows_b, idx_b, n_b, sink_v, out, scores };
        cpu_parallel_for(be, n_heads, 2 * n * dim, attention_range, &job);
    }
    free(scores);
    free(sink_buf);
}

/* ------------------------------------------------------------------------ */
/* Compressor pooling (spec 3.5.4)                                           */
/* ------------------------------------------------------------------------ */

/*
 * Per output dim j, a softmax over the candidates' scores gates their values.
 * Ratio 4 (two lanes of width dim, rows of 2 * dim): candidate pairs are
 * (row r, lane A [j]) and (row 4 + r, lane B [dim + j]) for r = 0..3, summed
 * pair by pair as ds4.c does. Other ratios: rows 0..ratio-1 at [j], rows of
 * dim. A -inf score weighs 0; all -inf gives 0.
 */
static void pool_window(const float *state_kv, const float *state_score, int ratio, int64_t dim, float *out) {
    const bool overlap = ratio == 4;
    const int64_t width = overlap ? 2 * dim : dim;
    for (int64_t j = 0; j < dim; j++) {
        float m = -INFINITY;
        for (int r = 0; r < ratio; r++) {
            const float s = state_score[r * width + j];
            if (s > m) m = s;
            if (overlap) {
                const float sb = state_score[(ratio + r) * width + dim + j];
                if (sb > m) m = sb;
            }
        }
        if (m == -INFINITY) {
            out[j] = 0.0f;
            continue;
        }
        float den = 0.0f, sum = 0.0f;
        for (int r = 0; r < ratio; r++) {
            const float wa = expf(state_score[r * width + j] - m);
            if (overlap) {
                const float wb = expf(state_score[(ratio + r) * width + dim + j] - m);
                den += wa + wb;
                sum += wa * state_kv[r * width + j];
                sum += wb * state_kv[(ratio + r) * width + dim + j];
            } else {
                den += wa;
                sum += wa * state_kv[r * width + j];
            }
        }
        out[j] = sum / den;
    }
}

void cpu_compressor_pool(ds4_backend *be, const float *state_kv, const float *state_score, int ratio, int64_t dim,
                         int64_t n_windows, float *out) {
    if (ratio < 1 || dim <= 0 || n_windows < 0) {
        cpu_fail(be, DS4_ERR_INVALID, "compressor_pool: ratio %d, dim %lld, %lld windows", ratio, (long long)dim,
                 (long long)n_windows);
        return;
    }
    const int64_t step = (int64_t)ratio * (ratio == 4 ? 2 * dim : dim); /* floats from one window to the next */
    for (int64_t w = 0; w < n_windows; w++)
        pool_window(state_kv + w * step, state_score + w * step, ratio, dim, out + w * dim);
}

void cpu_compressor_pool_states(ds4_backend *be, const float *const *state_kv, const float *const *state_score,
                                int ratio, int64_t dim, int64_t n, float *out) {
    ds4_error err = { 0 };
    if (ratio < 1 || dim <= 0 || (n > 0 && !out))
        ds4_error_set(&err, DS4_ERR_INVALID, "compressor_pool_states: ratio %d, dim %lld%s", ratio, (long long)dim,
                      n > 0 && !out ? ", no output" : "");
    else ds4_pointer_pairs_valid("compressor_pool_states", "window", (const void *const *)state_kv, "state",
                                 (const void *const *)state_score, "scores", n, &err);
    if (err.status) {
        cpu_fail(be, err.status, "%s", err.message);
        return;
    }
    for (int64_t w = 0; w < n; w++) pool_window(state_kv[w], state_score[w], ratio, dim, out + w * dim);
}

/* ------------------------------------------------------------------------ */
/* Indexer (spec 3.6)                                                        */
/* ------------------------------------------------------------------------ */

typedef struct indexer_job {
    const float *q, *weights, *keys;
    float weight_scale;
    int64_t n_heads, dim;
    float *scores;
} indexer_job;

/* score[c] = sum over heads, in order, of relu(q_h . key_c) * w_h (float),
 * w_h = weights[h] * weight_scale rounded to float on its own (the file
 * builds with -ffp-contract=off, so it is never fused into the sum). */
static void indexer_range(void *vctx, int64_t begin, int64_t end, int thread) {
    const indexer_job *job = vctx;
    for (int64_t c = begin; c < end; c++) {
        const float *key = job->keys + c * job->dim;
        float s = 0.0f;
        for (int64_t h = 0; h < job->n_heads; h++) {
            float d = cpu_dot_f32(job->q + h * job->dim, key, job->dim);
            if (d < 0.0f) d = 0.0f;
            const float w = job->weights[h] * job->weight_scale;
            s += d * w;
        }
        job->scores[c] = s;
    }
}

void cpu_indexer_scores(ds4_backend *be, const float *q, const float *weights, float weight_scale, int64_t n_heads,
                        int64_t dim, const float *keys, int64_t n_keys, float *scores) {
    indexer_job job = { q, weights, keys, weight_scale, n_heads, dim, scores };
    cpu_parallel_for(be, n_keys, n_heads * dim, indexer_range, &job);
}

void cpu_indexer_scores_rows(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                             int64_t n_heads, int64_t dim, const float *keys, const int64_t *n_keys, int64_t n_rows,
                             float *scores, int64_t stride) {
    if (n_rows < 0 || n_heads < 0 || dim < 0 || (n_rows > 0 && !n_keys)) {
        cpu_fail(be, DS4_ERR_INVALID, "indexer_scores_rows: %lld rows of %lld heads of %lld", (long long)n_rows,
                 (long long)n_heads, (long long)dim);
        return;
    }
    ds4_error err = { 0 };
    if (!ds4_row_counts_valid("indexer_scores_rows", "keys", n_keys, n_rows, stride, NULL, &err)) {
        cpu_fail(be, err.status, "%s", err.message);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++) {
        cpu_indexer_scores(be, q + r * n_heads * dim, weights + r * n_heads, weight_scale, n_heads, dim, keys,
                           n_keys[r], scores + r * stride);
    }
}

/* Rank order: a ranks above b if its score is higher, or equal with a lower
 * index. NaN ranks as -inf. */
static bool ranks_above(const float *s, int32_t a, int32_t b) {
    const float sa = isnan(s[a]) ? -INFINITY : s[a];
    const float sb = isnan(s[b]) ? -INFINITY : s[b];
    return sa > sb || (sa == sb && a < b);
}

/* heap[0..size) is a heap whose root ranks lowest; restore it below i. */
static void heap_sift_down(const float *s, int32_t *heap, int64_t size, int64_t i) {
    for (;;) {
        int64_t low = i;
        const int64_t c1 = 2 * i + 1, c2 = 2 * i + 2;
        if (c1 < size && ranks_above(s, heap[low], heap[c1])) low = c1;
        if (c2 < size && ranks_above(s, heap[low], heap[c2])) low = c2;
        if (low == i) return;
        const int32_t t = heap[i];
        heap[i] = heap[low];
        heap[low] = t;
        i = low;
    }
}

/* O(n log k) with the output array as the heap: keep the k best seen so far
 * (the root is the worst of them), then heap-sort them into rank order. */
void cpu_select_top_k(const float *scores, int64_t n, int64_t k, int32_t *idx) {
    const int64_t size = k < n ? k : n;
    for (int64_t i = size; i < k; i++) idx[i] = -1;
    if (size <= 0) return;
    for (int64_t i = 0; i < size; i++) idx[i] = (int32_t)i;
    for (int64_t i = size / 2 - 1; i >= 0; i--) heap_sift_down(scores, idx, size, i);
    for (int64_t i = size; i < n; i++) {
        if (ranks_above(scores, (int32_t)i, idx[0])) {
            idx[0] = (int32_t)i;
            heap_sift_down(scores, idx, size, 0);
        }
    }
    for (int64_t end = size - 1; end > 0; end--) {
        const int32_t t = idx[0];
        idx[0] = idx[end];
        idx[end] = t;
        heap_sift_down(scores, idx, end, 0);
    }
}

void cpu_attention_rows(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                        const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                        const int64_t *b_n, const ds4_weight *sinks, float *out) {
    ds4_error err = { 0 };
    if (!ds4_attention_rows_valid(n, q, out, a_off, a_n, b_n, &err)) {
        cpu_fail(be, err.status, "%s", err.message);
        return;
    }
    for (int64_t r = 0; r < n; r++)
        cpu_attention(be, q + r * n_heads * dim, n_heads, dim, rows_a ? rows_a + a_off[r] * dim : NULL, a_n[r],
                      rows_b, b_n[r], NULL, b_n[r], sinks, out + r * n_heads * dim);
}

void cpu_attention_states(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                          const float *const *rows_a, const int64_t *a_n, const float *const *rows_b, const int64_t *b_n,
                          const ds4_weight *sinks, float *out) {
    ds4_error err = { 0 };
    if (!ds4_attention_states_valid(n, q, out, rows_a, a_n, rows_b, b_n, &err)) {
        cpu_fail(be, err.status, "%s", err.message);
        return;
    }
    for (int64_t r = 0; r < n; r++)
        cpu_attention(be, q + r * n_heads * dim, n_heads, dim, rows_a[r], a_n[r], rows_b[r], b_n[r], NULL, b_n[r],
                      sinks, out + r * n_heads * dim);
}

void cpu_attention_rows_sel(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                            const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                            const int64_t *b_rows, const int32_t *idx, int64_t k, const ds4_weight *sinks, float *out) {
    ds4_error err = { 0 };
    if (!ds4_attention_rows_valid(n, q, out, a_off, a_n, b_rows, &err)) {
        cpu_fail(be, err.status, "%s", err.message);
        return;
    }
    if (k < 0 || (n > 0 && k > 0 && !idx)) {
        cpu_fail(be, DS4_ERR_INVALID, "attention_rows_sel: %lld selected rows%s", (long long)k, k > 0 ? ", NULL" : "");
        return;
    }
    for (int64_t r = 0; r < n; r++)
        cpu_attention(be, q + r * n_heads * dim, n_heads, dim, rows_a ? rows_a + a_off[r] * dim : NULL, a_n[r],
                      rows_b, b_rows[r], idx ? idx + r * k : NULL, k, sinks, out + r * n_heads * dim);
}

void cpu_top_k(ds4_backend *be, const float *scores, int64_t n, int64_t k, int32_t *idx) {
    if (n < 0 || k < 0 || n > INT32_MAX) {
        cpu_fail(be, DS4_ERR_INVALID, "top_k: %lld of %lld", (long long)k, (long long)n);
        return;
    }
    cpu_select_top_k(scores, n, k, idx);
}

void cpu_top_k_rows(ds4_backend *be, const float *scores, int64_t stride, const int64_t *n, int64_t n_rows, int64_t k,
                    int32_t *idx) {
    if (n_rows < 0 || k < 0 || (n_rows > 0 && !n)) {
        cpu_fail(be, DS4_ERR_INVALID, "top_k_rows: %lld rows, k %lld", (long long)n_rows, (long long)k);
        return;
    }
    ds4_error err = { 0 };
    if (!ds4_row_counts_valid("top_k_rows", "scores", n, n_rows, stride, NULL, &err)) {
        cpu_fail(be, err.status, "%s", err.message);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++) cpu_top_k(be, scores + r * stride, n[r], k, idx + r * k);
}

/*
 * cpu_backend.c - the CPU reference backend: its op table and constructor,
 * memory, elementwise ops, norms and the rounding ops.
 *
 * The CPU backend is the oracle the CUDA backend is tested against, so every
 * op is written for clarity, with the math visible in the loops (float32 as
 * DS4 computes it, float64 where spec 3.0 says so). Activations live in host
 * memory: alloc is an aligned calloc, upload/download are memcpy. Weights are
 * read in place from the file mapping (bind_weight only checks them).
 * Threads: matmul, MoE, attention, indexer scores and row-wise ops split
 * their independent output items over a small persistent pool (cpu_pool.c).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/cpu/cpu_internal.h"
#include "core/rounding.h"

/* ------------------------------------------------------------------------ */
/* Errors                                                                    */
/* ------------------------------------------------------------------------ */

void cpu_fail(ds4_backend *be, ds4_status status, const char *fmt, ...) {
    cpu_backend *cpu = cpu_impl(be);
    pthread_mutex_lock(&cpu->error_mu);
    if (cpu->error.status == DS4_OK) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(cpu->error.message, sizeof cpu->error.message, fmt, ap);
        va_end(ap);
        cpu->error.status = status;
    }
    pthread_mutex_unlock(&cpu->error_mu);
}

/* An error is recorded (not yet taken). */
static bool cpu_failed(ds4_backend *be) {
    cpu_backend *cpu = cpu_impl(be);
    pthread_mutex_lock(&cpu->error_mu);
    const bool failed = cpu->error.status != DS4_OK;
    pthread_mutex_unlock(&cpu->error_mu);
    return failed;
}

static ds4_status cpu_take_error(ds4_backend *be, ds4_error *err) {
    cpu_backend *cpu = cpu_impl(be);
    pthread_mutex_lock(&cpu->error_mu);
    ds4_status status = cpu->error.status;
    if (status != DS4_OK && err) *err = cpu->error;
    ds4_error_clear(&cpu->error);
    pthread_mutex_unlock(&cpu->error_mu);
    return status;
}

/* ------------------------------------------------------------------------ */
/* Memory and weights                                                        */
/* ------------------------------------------------------------------------ */

static float *cpu_alloc(ds4_backend *be, int64_t n_floats) {
    if (n_floats < 0 || (uint64_t)n_floats > SIZE_MAX / sizeof(float) - 64) return NULL;
    size_t bytes = (size_t)(n_floats > 0 ? n_floats : 1) * sizeof(float);
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes) != 0) return NULL;
    memset(p, 0, bytes);
    return p;
}

static void cpu_free(ds4_backend *be, float *buf) { free(buf); }

static void cpu_upload(ds4_backend *be, float *dst, const float *host_src, int64_t n) {
    if (n > 0) memmove(dst, host_src, (size_t)n * sizeof(float));
}

static void cpu_download(ds4_backend *be, float *host_dst, const float *src, int64_t n) {
    if (n > 0) memmove(host_dst, src, (size_t)n * sizeof(float));
}

static void cpu_copy(ds4_backend *be, float *dst, const float *src, int64_t n) {
    if (n > 0) memmove(dst, src, (size_t)n * sizeof(float));
}

static void cpu_fill(ds4_backend *be, float *dst, float value, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = value;
}

static void cpu_repeat_rows(ds4_backend *be, float *dst, const float *src, int64_t n_rows, int64_t dim,
                            int64_t copies) {
    if (n_rows < 0 || dim < 0 || copies < 0) {
        cpu_fail(be, DS4_ERR_INVALID, "repeat_rows: %lld rows of %lld, %lld copies", (long long)n_rows,
                 (long long)dim, (long long)copies);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t c = 0; c < copies; c++)
            memcpy(dst + (r * copies + c) * dim, src + r * dim, (size_t)dim * sizeof *dst);
}

static void cpu_copy_rows(ds4_backend *be, float *const *dst, const float *const *src, int64_t width, int64_t n) {
    ds4_error err = { 0 };
    if (width < 0) ds4_error_set(&err, DS4_ERR_INVALID, "copy_rows: copies of %lld", (long long)width);
    else ds4_pointer_pairs_valid("copy_rows", "copy", (const void *const *)dst, "destination",
                                 (const void *const *)src, "source", n, &err);
    if (err.status) {
        cpu_fail(be, err.status, "%s", err.message);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        if (width > 0) memcpy(dst[i], src[i], (size_t)width * sizeof(float)); /* (no overlaps: the contract) */
}

/* The CPU reads the mapping in place; binding checks that every row can be
 * dequantised, which is all the ops need. Integer tensors (token -> expert
 * tables) are bound too: no op computes with them, the model reads their
 * host bytes (e.g. for the router's hash_ids). */
static bool is_integer_type(uint32_t type) {
    return type == DS4_TYPE_I8 || type == DS4_TYPE_I16 || type == DS4_TYPE_I32 || type == DS4_TYPE_I64;
}

static ds4_status cpu_bind_weight(ds4_backend *be, ds4_weight *w, ds4_error *err) {
    const char *name = cpu_wname(w);
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    if (!t || (!t->dequant_row && !is_integer_type(w->type)))
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "cpu backend: weight %s has type %s, which has no dequantiser",
                             name, ds4_type_name(w->type));
    const int64_t expect = ds4_type_row_bytes(w->type, w->ne[0]);
    if (expect <= 0 || w->row_bytes != expect)
        return ds4_error_set(err, DS4_ERR_INVALID,
                             "cpu backend: weight %s (%s, %lld per row) has row_bytes %lld, not %lld", name, t->name, (long long)w->ne[0], (long long)w->row_bytes, (long long)expect);
    if (!w->host) return ds4_error_set(err, DS4_ERR_INVALID, "cpu backend: weight %s has no data", name);
    w->device = NULL;
    return DS4_OK;
}

static ds4_status cpu_bind_synthetic(ds4_backend *be, ds4_weight *w, const ds4_fill *fill, ds4_error *err) {
    void *buf = ds4_fill_host_bytes(w, fill, "cpu backend", err);
    if (!buf) return err->status;
    w->host = buf;
    w->owned = buf;
    ds4_status st = cpu_bind_weight(be, w, err);
    if (st) {
        free(buf);
        w->owned = NULL;
        w->host = NULL;
    }
    return st;
}

static void cpu_release_weight(ds4_backend *be, ds4_weight *w) {
    w->device = NULL;
    if (w->owned) {
        if (w->host == w->owned) w->host = NULL;
        free(w->owned);
        w->owned = NULL;
    }
}

const float *cpu_weight_vector(const ds4_weight *w, int64_t n, float *scratch) {
    if (w->type == DS4_TYPE_F32) return w->host;
    ds4_type_traits_get(w->type)->dequant_row(w->host, scratch, n);
    return scratch;
}

/* ------------------------------------------------------------------------ */
/* Elementwise ops and norms                                                 */
/* ------------------------------------------------------------------------ */

static void cpu_embed(ds4_backend *be, const ds4_weight *table, const int32_t *tokens, int n, float *out) {
    const ds4_type_traits *t = ds4_type_traits_get(table->type);
    const int64_t dim = table->ne[0], vocab = cpu_weight_rows(table);
    if (!t || !t->dequant_row) {
        cpu_fail(be, DS4_ERR_UNSUPPORTED, "embed: table %s has type %s", cpu_wname(table), ds4_type_name(table->type));
        return;
    }
    for (int r = 0; r < n; r++) {
        if (tokens[r] < 0 || tokens[r] >= vocab) {
            cpu_fail(be, DS4_ERR_INVALID, "embed: token id %d is outside the vocabulary of %s (%lld rows)", tokens[r],
                     cpu_wname(table), (long long)vocab);
            memset(out + (int64_t)r * dim, 0, (size_t)dim * sizeof *out);
            continue;
        }
        t->dequant_row(cpu_weight_row(table, tokens[r]), out + (int64_t)r * dim, dim);
    }
}

typedef struct rmsnorm_job {
    const float *x, *w;
    float eps;
    float *out;
    int64_t dim;
} rmsnorm_job;

/* y = x * w / sqrt(mean(x^2) + eps): squares summed in double, the scale
 * 1 / sqrtf(float(mean) + eps) and the products in float (ds4.c's order). */
static void rmsnorm_range(void *vctx, int64_t begin, int64_t end, int thread) {
    const rmsnorm_job *job = vctx;
    for (int64_t r = begin; r < end; r++) {
        const float *x = job->x + r * job->dim;
        float *y = job->out + r * job->dim;
        double ss = 0.0;
        for (int64_t i = 0; i < job->dim; i++) ss += (double)x[i] * (double)x[i];
        const float scale = 1.0f / sqrtf((float)(ss / (double)job->dim) + job->eps);
        if (job->w) {
            for (int64_t i = 0; i < job->dim; i++) y[i] = x[i] * scale * job->w[i];
        } else {
            for (int64_t i = 0; i < job->dim; i++) y[i] = x[i] * scale;
        }
    }
}

static void cpu_rmsnorm(ds4_backend *be, const float *x, const ds4_weight *w, float eps, float *out, int64_t n_rows,
                        int64_t dim) {
    if (dim <= 0 || n_rows <= 0) return;
    float *scratch = NULL;
    const float *wv = NULL;
    if (w) {
        const ds4_type_traits *t = ds4_type_traits_get(w->type);
        if (!t || !t->dequant_row || w->ne[0] != dim) {
            cpu_fail(be, DS4_ERR_INVALID, "rmsnorm: weight %s (%s, %lld wide) does not fit rows of %lld", cpu_wname(w),
                     ds4_type_name(w->type), (long long)w->ne[0], (long long)dim);
            return;
        }
        if (w->type != DS4_TYPE_F32 && !(scratch = malloc((size_t)dim * sizeof *scratch))) {
            cpu_fail(be, DS4_ERR_NOMEM, "rmsnorm: out of memory");
            return;
        }
        wv = cpu_weight_vector(w, dim, scratch);
    }
    rmsnorm_job job = { x, wv, eps, out, dim };
    cpu_parallel_for(be, n_rows, 2 * dim, rmsnorm_range, &job);
    free(scratch);
}

static void cpu_add(ds4_backend *be, const float *a, const float *b, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

static void cpu_add_weight_row(ds4_backend *be, float *x, const ds4_weight *w, int64_t row, int64_t n_rows) {
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    const int64_t dim = w->ne[0];
    if (!t || !t->dequant_row || row < 0 || row >= cpu_weight_rows(w)) {
        cpu_fail(be, DS4_ERR_INVALID, "add_weight_row: row %lld of %s (%s, %lld rows)", (long long)row, cpu_wname(w),
                 ds4_type_name(w->type), (long long)cpu_weight_rows(w));
        return;
    }
    float *v = malloc((size_t)dim * sizeof *v);
    if (!v) {
        cpu_fail(be, DS4_ERR_NOMEM, "add_weight_row: out of memory");
        return;
    }
    t->dequant_row(cpu_weight_row(w, row), v, dim);
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t i = 0; i < dim; i++) x[r * dim + i] += v[i];
    free(v);
}

static void cpu_add_weight_rows_mod(ds4_backend *be, float *x, const ds4_weight *w, int64_t first, int64_t n_rows) {
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    const int64_t dim = w->ne[0], R = cpu_weight_rows(w);
    if (!t || !t->dequant_row || R < 1 || first < 0 || first >= R) {
        cpu_fail(be, DS4_ERR_INVALID, "add_weight_rows_mod: from row %lld of %s (%s, %lld rows)", (long long)first,
                 cpu_wname(w), ds4_type_name(w->type), (long long)R);
        return;
    }
    const int64_t used = n_rows < R ? n_rows : R; /* the rows the run meets */
    float *v = malloc((size_t)((used > 0 ? used : 1) * dim) * sizeof *v);
    if (!v) {
        cpu_fail(be, DS4_ERR_NOMEM, "add_weight_rows_mod: out of memory");
        return;
    }
    for (int64_t k = 0; k < used; k++) t->dequant_row(cpu_weight_row(w, (first + k) % R), v + k * dim, dim);
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t i = 0; i < dim; i++) x[r * dim + i] += v[(r % R) * dim + i];
    free(v);
}

static void cpu_add_weight_rows_at(ds4_backend *be, float *x, const ds4_weight *w, const int64_t *rows,
                                   int64_t n_rows) {
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    const int64_t dim = w->ne[0], R = cpu_weight_rows(w);
    ds4_error err = { 0 };
    if (!t || !t->dequant_row) {
        cpu_fail(be, DS4_ERR_INVALID, "add_weight_rows_at: %s (%s) has no row decoder", cpu_wname(w),
                 ds4_type_name(w->type));
        return;
    }
    if (!ds4_table_rows_valid("add_weight_rows_at", cpu_wname(w), rows, n_rows, R, &err)) {
        cpu_fail(be, err.status, "%s", err.message);
        return;
    }
    float *v = malloc((size_t)(dim > 0 ? dim : 1) * sizeof *v);
    if (!v) {
        cpu_fail(be, DS4_ERR_NOMEM, "add_weight_rows_at: out of memory");
        return;
    }
    for (int64_t r = 0; r < n_rows; r++) {
        t->dequant_row(cpu_weight_row(w, rows[r]), v, dim);
        for (int64_t i = 0; i < dim; i++) x[r * dim + i] += v[i];
    }
    free(v);
}

static void cpu_round_f16(ds4_backend *be, float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = ds4_round_f16(x[i]);
}

static void cpu_round_fp8_kv(ds4_backend *be, float *x, int64_t n_rows, int64_t dim, int64_t n_rope) {
    if (n_rope < 0 || n_rope > dim) {
        cpu_fail(be, DS4_ERR_INVALID, "round_fp8_kv: %lld RoPE dims in rows of %lld", (long long)n_rope,
                 (long long)dim);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++) ds4_fp8_kv_round_row(x + r * dim, dim, n_rope);
}

static void cpu_indexer_qat(ds4_backend *be, float *x, int64_t n_rows, int64_t dim) {
    if (dim < 1 || (dim & (dim - 1)) != 0) {
        cpu_fail(be, DS4_ERR_INVALID, "indexer_qat: row width %lld is not a power of two", (long long)dim);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++) ds4_indexer_qat_row(x + r * dim, dim);
}

/* The ops it stands for, one after the other (the CPU has nothing to fuse). */
static void cpu_head_norm_rope(ds4_backend *be, float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim,
                               const ds4_weight *w, float eps, const int32_t *pos, const ds4_rope *rope,
                               bool round_kv) {
    ds4_error err = { 0 };
    if (!ds4_head_norm_rope_valid(x, n_rows, n_heads, head_dim, w, pos, rope, &err)) {
        cpu_fail(be, err.status, "%s", err.message);
        return;
    }
    if (n_rows == 0) return;
    cpu_rmsnorm(be, x, w, eps, x, n_rows * n_heads, head_dim);
    cpu_rope_tail(be, x, n_rows, n_heads, head_dim, pos, rope, false);
    if (round_kv) {
        cpu_round_fp8_kv(be, x, n_rows * n_heads, head_dim, rope->n_rot);
        cpu_round_f16(be, x, n_rows * n_heads * head_dim);
    }
}

static void cpu_hc_pre_norm(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn,
                            const ds4_weight *scale, const ds4_weight *base, const ds4_weight *norm, float eps,
                            float *x_out, float *post, float *comb, float *a_out, int64_t n_rows) {
    if (!hc) {
        cpu_fail(be, DS4_ERR_INVALID, "hc_pre_norm: no hyper-connection shape");
        return;
    }
    cpu_hc_pre(be, hc, X, fn, scale, base, x_out, post, comb, n_rows);
    if (n_rows <= 0 || cpu_failed(be)) return;
    if (!a_out) {
        cpu_fail(be, DS4_ERR_INVALID, "hc_pre_norm: NULL norm output");
        return;
    }
    cpu_rmsnorm(be, x_out, norm, eps, a_out, n_rows, hc->dim);
}

/* add (into a buffer of its own), hc_post, hc_pre_norm: one after the other. */
static void cpu_hc_post_pre_norm(ds4_backend *be, const ds4_hc *hc, const float *y, const float *y2, const float *X,
                                 const float *post, const float *comb, float *X_out, const ds4_weight *fn,
                                 const ds4_weight *scale, const ds4_weight *base, const ds4_weight *norm, float eps,
                                 float *x_out, float *post_out, float *comb_out, float *a_out, int64_t n_rows) {
    if (!hc || hc->n_hc < 1 || hc->dim < 1) {
        cpu_fail(be, DS4_ERR_INVALID, "hc_post_pre_norm: no hyper-connection shape");
        return;
    }
    if (n_rows <= 0) return;
    float *sum = NULL;
    if (y2) {
        sum = malloc((size_t)(n_rows * hc->dim) * sizeof *sum);
        if (!sum) {
            cpu_fail(be, DS4_ERR_NOMEM, "hc_post_pre_norm: out of memory");
            return;
        }
        cpu_add(be, y, y2, sum, n_rows * hc->dim);
    }
    cpu_hc_post(be, hc, sum ? sum : y, X, post, comb, X_out, n_rows);
    free(sum);
    cpu_hc_pre_norm(be, hc, X_out, fn, scale, base, norm, eps, x_out, post_out, comb_out, a_out, n_rows);
}

/* ------------------------------------------------------------------------ */
/* The table and the constructor                                             */
/* ------------------------------------------------------------------------ */

static const ds4_backend_ops CPU_OPS = {
    .name = "cpu",
    .numerics = 1u << DS4_NUMERICS_DS4 | 1u << DS4_NUMERICS_REFERENCE | 1u << DS4_NUMERICS_DS4_F16,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_upload,
    .download = cpu_download,
    .copy = cpu_copy,
    .fill = cpu_fill,
    .repeat_rows = cpu_repeat_rows,
    .copy_rows = cpu_copy_rows,
    .bind_weight = cpu_bind_weight,
    .bind_synthetic = cpu_bind_synthetic,
    .release_weight = cpu_release_weight,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .add = cpu_add,
    .add_weight_row = cpu_add_weight_row,
    .add_weight_rows_mod = cpu_add_weight_rows_mod,
    .add_weight_rows_at = cpu_add_weight_rows_at,
    .round_f16 = cpu_round_f16,
    .round_fp8_kv = cpu_round_fp8_kv,
    .indexer_qat = cpu_indexer_qat,
    .matmul = cpu_matmul,
    .matmul_multi = cpu_matmul_multi,
    .matmul_grouped = cpu_matmul_grouped,
    .rope_tail = cpu_rope_tail,
    .head_norm_rope = cpu_head_norm_rope,
    .hc_pre = cpu_hc_pre,
    .hc_pre_norm = cpu_hc_pre_norm,
    .hc_post = cpu_hc_post,
    .hc_post_pre_norm = cpu_hc_post_pre_norm,
    .hc_head = cpu_hc_head,
    .attention = cpu_attention,
    .attention_rows = cpu_attention_rows,
    .attention_states = cpu_attention_states,
    .attention_rows_sel = cpu_attention_rows_sel,
    .compressor_pool = cpu_compressor_pool,
    .compressor_pool_states = cpu_compressor_pool_states,
    .indexer_scores = cpu_indexer_scores,
    .top_k = cpu_top_k,
    .indexer_scores_rows = cpu_indexer_scores_rows,
    .top_k_rows = cpu_top_k_rows,
    .router = cpu_router,
    .swiglu = cpu_swiglu,
    .moe = cpu_moe,
    .take_error = cpu_take_error,
};

/* n_threads <= 0: one per online CPU. */
ds4_status ds4_cpu_backend_create(int n_threads, ds4_backend **out, ds4_error *err) {
    *out = NULL;
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)(n < 256 ? n : 256) : 1;
    }
    if (n_threads > 1024)
        return ds4_error_set(err, DS4_ERR_INVALID, "cpu backend: %d threads is more than 1024", n_threads);
    ds4_backend *be = calloc(1, sizeof *be);
    cpu_backend *cpu = calloc(1, sizeof *cpu);
    if (!be || !cpu) {
        free(be);
        free(cpu);
        return ds4_error_set(err, DS4_ERR_NOMEM, "cpu backend: out of memory");
    }
    ds4_status st = cpu_pool_create(n_threads, &cpu->pool, err);
    if (st != DS4_OK) {
        free(be);
        free(cpu);
        return st;
    }
    pthread_mutex_init(&cpu->error_mu, NULL);
    cpu->n_threads = n_threads;
    be->ops = &CPU_OPS;
    be->impl = cpu;
    be->n_threads = n_threads;
    *out = be;
    return DS4_OK;
}

void ds4_cpu_backend_free(ds4_backend *be) {
    cpu_backend *cpu = cpu_impl(be);
    cpu_pool_destroy(cpu->pool);
    pthread_mutex_destroy(&cpu->error_mu);
    free(cpu);
    free(be);
}

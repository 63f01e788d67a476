/*
 * backend.c - choosing a backend by name (there is no fallback: a backend
 * that is unknown or not usable in this build is an error naming it), and
 * the host bytes of synthetic weights that backends share.
 *
 * Names: "cpu"; "cuda" (device 0) or "cuda:N" (device N) when built with
 * `make cuda`.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "backends/backend.h"
#include "backends/cpu/cpu_internal.h"
#include "core/error.h"
#ifdef DS4_WITH_CUDA
#include "backends/cuda/cuda_backend.h"
#endif

ds4_status ds4_backend_create(const char *name, int n_threads, ds4_backend **out, ds4_error *err) {
    *out = NULL;
    if (!name || strcmp(name, "cpu") == 0) return ds4_cpu_backend_create(n_threads, out, err);
    if (strncmp(name, "cuda", 4) == 0 && (name[4] == '\0' || name[4] == ':')) {
        long device = 0;
        if (name[4] == ':') {
            char *end = NULL;
            errno = 0;
            device = strtol(name + 5, &end, 10);
            if (errno || end == name + 5 || *end || device < 0 || device > 1024)
                return ds4_error_set(err, DS4_ERR_INVALID, "bad backend \"%s\" (cuda or cuda:N)", name);
        }
#ifdef DS4_WITH_CUDA
        return ds4_cuda_backend_create((int)device, out, err);
#else
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "this build has no CUDA backend (make cuda)");
#endif
    }
    return ds4_error_set(err, DS4_ERR_INVALID, "unknown backend \"%s\" (known: cpu, cuda)", name);
}

/* the public modes (ds4.h) are the numerics of the same number */
_Static_assert(DS4_NUMERICS_MODE_DS4 == (int)DS4_NUMERICS_DS4 && DS4_NUMERICS_MODE_REFERENCE == (int)DS4_NUMERICS_REFERENCE &&
                   DS4_NUMERICS_MODE_DS4_F16 == (int)DS4_NUMERICS_DS4_F16,
               "ds4_numerics_mode and ds4_numerics agree");

static const char *const numerics_names[DS4_NUMERICS_COUNT] = { "ds4", "reference", "ds4-f16" };

const char *ds4_numerics_name(ds4_numerics n) {
    return (unsigned)n < DS4_NUMERICS_COUNT ? numerics_names[n] : NULL;
}

bool ds4_numerics_parse(const char *v, ds4_numerics *out) {
    for (unsigned i = 0; v && i < DS4_NUMERICS_COUNT; i++)
        if (!strcmp(v, numerics_names[i])) {
            *out = (ds4_numerics)i;
            return true;
        }
    return false;
}

ds4_status ds4_backend_check_numerics(const ds4_backend *be, ds4_numerics n, ds4_error *err) {
    const char *name = ds4_numerics_name(n);
    if (!name) return ds4_error_set(err, DS4_ERR_INVALID, "numerics %d is not one of " DS4_NUMERICS_NAMES, (int)n);
    if (!(be->ops->numerics & (1u << n))) {
        char have[64] = "";
        for (unsigned i = 0; i < DS4_NUMERICS_COUNT; i++)
            if (be->ops->numerics & (1u << i)) {
                if (have[0]) strcat(have, ", ");
                strcat(have, numerics_names[i]);
            }
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "the %s backend does not implement numerics %s (it has: %s)",
                             be->ops->name, name, have[0] ? have : "none");
    }
    return DS4_OK;
}

void ds4_backend_destroy(ds4_backend *be) {
    if (!be) return;
    if (strcmp(be->ops->name, "cpu") == 0) ds4_cpu_backend_free(be);
#ifdef DS4_WITH_CUDA
    else if (strcmp(be->ops->name, "cuda") == 0) ds4_cuda_backend_free(be);
#endif
}

int ds4_backend_kernel_times(ds4_backend *be, ds4_kernel_time *out, int cap) {
    if (!be) return 0;
#ifdef DS4_WITH_CUDA
    if (strcmp(be->ops->name, "cuda") == 0) return ds4_cuda_backend_kernel_times(be, out, cap);
#endif
    (void)out;
    (void)cap;
    return 0;
}

void ds4_backend_kernel_times_reset(ds4_backend *be) {
    if (!be) return;
#ifdef DS4_WITH_CUDA
    if (strcmp(be->ops->name, "cuda") == 0) ds4_cuda_backend_kernel_times_reset(be);
#endif
}

void ds4_backend_profiler_range(ds4_backend *be, bool on) {
    if (!be) return;
#ifdef DS4_WITH_CUDA
    if (strcmp(be->ops->name, "cuda") == 0) ds4_cuda_backend_profiler_range(be, on);
#endif
    (void)on;
}

void ds4_backend_counters_get(ds4_backend *be, ds4_backend_counters *out) {
    memset(out, 0, sizeof *out);
    if (!be) return;
#ifdef DS4_WITH_CUDA
    if (strcmp(be->ops->name, "cuda") == 0) ds4_cuda_backend_counters(be, out);
#endif
}

void *ds4_fill_host_bytes(const ds4_weight *w, const ds4_fill *fill, const char *who, ds4_error *err) {
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    const int64_t rows = w->ne[1] * w->ne[2] * w->ne[3];
    const int64_t row_bytes = ds4_type_row_bytes(w->type, w->ne[0]);
    if (!t || !fill || fill->type != w->type || !ds4_fill_type_ok(w->type) || row_bytes <= 0 ||
        w->row_bytes != row_bytes || rows < 0 || fill->block_bytes != t->block_bytes ||
        (rows > 0 && row_bytes > INT64_MAX / rows)) {
        ds4_error_set(err, DS4_ERR_INVALID, "%s: synthetic weight %s (%s) does not match its fill", who,
                      w->name ? w->name : "(unnamed)", ds4_type_name(w->type));
        return NULL;
    }
    const int64_t bytes = row_bytes * rows, n_blocks = bytes / t->block_bytes;
    uint8_t *buf = malloc(bytes ? (size_t)bytes : 1);
    if (!buf) {
        ds4_error_set(err, DS4_ERR_NOMEM, "%s: out of memory for synthetic weight %s (%.1f MiB)", who,
                      w->name ? w->name : "(unnamed)", (double)bytes / 1048576.0);
        return NULL;
    }
    for (int64_t b = 0; b < n_blocks; b++) ds4_fill_block(fill, b, buf + b * t->block_bytes);
    return buf;
}

bool ds4_attention_rows_valid(int64_t n, const float *q, const float *out, const int64_t *a_off, const int64_t *a_n,
                              const int64_t *b_n, ds4_error *err) {
    if (n < 0 || (n > 0 && (!a_off || !a_n || !b_n || !q || !out))) {
        ds4_error_set(err, DS4_ERR_INVALID, "attention_rows: %lld rows (a NULL array or buffer)", (long long)n);
        return false;
    }
    for (int64_t r = 0; r < n; r++) {
        if (a_off[r] < 0 || a_n[r] < 0 || b_n[r] < 0) {
            ds4_error_set(err, DS4_ERR_INVALID, "attention_rows: row %lld: %lld rows from %lld, %lld compressed rows",
                          (long long)r, (long long)a_n[r], (long long)a_off[r], (long long)b_n[r]);
            return false;
        }
    }
    return true;
}

bool ds4_pointer_pairs_valid(const char *op, const char *item, const void *const *a, const char *a_name,
                             const void *const *b, const char *b_name, int64_t n, ds4_error *err) {
    if (n < 0 || (n > 0 && (!a || !b))) {
        ds4_error_set(err, DS4_ERR_INVALID, "%s: %lld %ss%s", op, (long long)n, item, n < 0 ? "" : " without their pointers");
        return false;
    }
    for (int64_t i = 0; i < n; i++) {
        if (!a[i] || !b[i]) {
            ds4_error_set(err, DS4_ERR_INVALID, "%s: %s %lld has no %s", op, item, (long long)i, a[i] ? b_name : a_name);
            return false;
        }
    }
    return true;
}

bool ds4_table_rows_valid(const char *op, const char *table, const int64_t *rows, int64_t n_rows, int64_t n_table,
                          ds4_error *err) {
    if (n_rows < 0 || (n_rows > 0 && !rows)) {
        ds4_error_set(err, DS4_ERR_INVALID, "%s: %lld rows of %s (%lld rows)%s", op, (long long)n_rows, table,
                      (long long)n_table, n_rows < 0 ? "" : " without their table rows");
        return false;
    }
    for (int64_t r = 0; r < n_rows; r++) {
        if (rows[r] < 0 || rows[r] >= n_table) {
            ds4_error_set(err, DS4_ERR_INVALID, "%s: row %lld asks for row %lld of %s (%lld rows)", op, (long long)r,
                          (long long)rows[r], table, (long long)n_table);
            return false;
        }
    }
    return true;
}

bool ds4_head_norm_rope_valid(const float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const ds4_weight *w,
                              const int32_t *pos, const ds4_rope *rope, ds4_error *err) {
    if (n_rows < 0) {
        ds4_error_set(err, DS4_ERR_INVALID, "head_norm_rope: %lld rows", (long long)n_rows);
        return false;
    }
    if (n_rows == 0) return true;
    if (!x || !pos || n_heads < 1 || head_dim < 1) {
        ds4_error_set(err, DS4_ERR_INVALID, "head_norm_rope: %lld rows of %lld heads of %lld%s", (long long)n_rows,
                      (long long)n_heads, (long long)head_dim, !x ? " without a buffer" : !pos ? " without positions" : "");
        return false;
    }
    if (!rope) {
        ds4_error_set(err, DS4_ERR_INVALID, "head_norm_rope: no RoPE parameters");
        return false;
    }
    if (rope->n_rot <= 0 || rope->n_rot % 2 != 0 || rope->n_rot > head_dim) {
        ds4_error_set(err, DS4_ERR_INVALID, "head_norm_rope: %d rotated dims in heads of %lld", rope->n_rot,
                      (long long)head_dim);
        return false;
    }
    if (w && w->ne[0] != head_dim) {
        ds4_error_set(err, DS4_ERR_INVALID, "head_norm_rope: norm weight %s is %lld wide, heads %lld",
                      w->name ? w->name : "(unnamed)", (long long)w->ne[0], (long long)head_dim);
        return false;
    }
    return true;
}

bool ds4_attention_states_valid(int64_t n, const float *q, const float *out, const float *const *rows_a,
                                const int64_t *a_n, const float *const *rows_b, const int64_t *b_n, ds4_error *err) {
    if (n < 0 || (n > 0 && (!rows_a || !a_n || !rows_b || !b_n || !q || !out))) {
        ds4_error_set(err, DS4_ERR_INVALID, "attention_states: %lld rows (a NULL array or buffer)", (long long)n);
        return false;
    }
    for (int64_t r = 0; r < n; r++) {
        if (a_n[r] < 0 || b_n[r] < 0 || (a_n[r] > 0 && !rows_a[r]) || (b_n[r] > 0 && !rows_b[r])) {
            ds4_error_set(err, DS4_ERR_INVALID, "attention_states: row %lld: %lld window rows%s, %lld compressed rows%s",
                          (long long)r, (long long)a_n[r], rows_a[r] ? "" : " (none given)", (long long)b_n[r],
                          rows_b[r] ? "" : " (none given)");
            return false;
        }
    }
    return true;
}

bool ds4_row_counts_valid(const char *op, const char *what, const int64_t *counts, int64_t n_rows, int64_t stride,
                          int64_t *most, ds4_error *err) {
    int64_t m = 0;
    for (int64_t r = 0; r < n_rows; r++) {
        if (counts[r] < 0 || counts[r] > stride) {
            ds4_error_set(err, DS4_ERR_INVALID, "%s: row %lld has %lld %s, outside 0 .. %lld (the rows' stride)", op,
                          (long long)r, (long long)counts[r], what, (long long)stride);
            return false;
        }
        if (counts[r] > m) m = counts[r];
    }
    if (most) *most = m;
    return true;
}

bool ds4_products_valid(const ds4_product *p, int n, const float *x, int64_t x_stride, int64_t n_rows, ds4_error *err) {
    if (n < 1 || n > DS4_PRODUCTS_MAX || !p || n_rows < 0 || (n_rows > 0 && !x)) {
        ds4_error_set(err, DS4_ERR_INVALID, "matmul_multi: %d products (1 to %d) of %lld rows%s", n, DS4_PRODUCTS_MAX,
                      (long long)n_rows, n_rows > 0 && !x ? " of a NULL input" : "");
        return false;
    }
    const int64_t n_in = p[0].w ? p[0].w->ne[0] : 0;
    for (int j = 0; j < n; j++) {
        const ds4_weight *w = p[j].w;
        const int64_t rows = w ? w->ne[1] * w->ne[2] * w->ne[3] : 0;
        if (!w || w->ne[0] != n_in || p[j].n_out < 0 || p[j].n_out > rows || (p[j].n_out > 0 && n_rows > 0 && !p[j].out) ||
            (n_rows > 1 && (x_stride < n_in || p[j].out_stride < p[j].n_out))) {
            ds4_error_set(err, DS4_ERR_INVALID,
                          "matmul_multi: product %d: weight %s [%lld x %lld rows], %lld outputs (stride %lld), %lld x "
                          "rows of %lld (stride %lld)%s",
                          j, w && w->name ? w->name : "(none)", w ? (long long)w->ne[0] : 0LL, (long long)rows,
                          (long long)p[j].n_out, (long long)p[j].out_stride, (long long)n_rows, (long long)n_in,
                          (long long)x_stride, p[j].n_out > 0 && n_rows > 0 && !p[j].out ? ", NULL output" : "");
            return false;
        }
        const ds4_weight *a = p[j].add;
        if (a && (a->ne[0] != p[j].n_out || p[j].add_row < 0 || p[j].add_row >= a->ne[1] * a->ne[2] * a->ne[3])) {
            ds4_error_set(err, DS4_ERR_INVALID,
                          "matmul_multi: product %d (%s, %lld outputs) adds row %lld of %s [%lld x %lld rows]", j,
                          w->name ? w->name : "(unnamed)", (long long)p[j].n_out, (long long)p[j].add_row,
                          a->name ? a->name : "(unnamed)", (long long)a->ne[0],
                          (long long)(a->ne[1] * a->ne[2] * a->ne[3]));
            return false;
        }
    }
    return true;
}

void ds4_product_add_row(ds4_backend *be, const ds4_product *p, int64_t n_rows) {
    if (!p->add || p->n_out == 0) return;
    if (p->out_stride == p->n_out || n_rows == 1) {
        be->ops->add_weight_row(be, p->out, p->add, p->add_row, n_rows);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++) be->ops->add_weight_row(be, p->out + r * p->out_stride, p->add, p->add_row, 1);
}

/*
 * cuda_op_test.h - shared helpers of the per-op CUDA tests: each op runs on
 * the CPU backend (the oracle) and on the CUDA backend with the same random
 * inputs, and every output element is compared.
 *
 *   op_pair p;
 *   if (!op_pair_open(&p)) TEST_SKIP("%s", op_pair_skip_reason);
 *   float *hx = op_rand(n, 1.0);                    host random N(0, scale)
 *   op_buf x = op_buf_from(&p, hx, n);              same data on both sides
 *   op_buf y = op_buf_poisoned(&p, m);              NaN-filled outputs
 *   p.cpu->ops->rmsnorm(p.cpu, x.c, ...);  p.gpu->ops->rmsnorm(p.gpu, x.g, ...);
 *   op_expect_ok(&p);                               no error recorded on either side
 *   op_compare("rmsnorm", &p, y, m, atol, rtol);    every element, NaN never passes
 *   op_buf_free(&p, &x); ... op_pair_close(&p);
 *
 * Integer arrays in backend memory (expert ids, selected rows):
 * op_ints_from / op_ints_get. Errors: op_expect_ok, op_expect_error,
 * op_expect_error_with (status and message parts).
 *
 * Weights: op_weight_make(&p, name, type, ne0, ne1, ne2, bytes) binds the
 * same raw bytes on both backends (the CPU reads them in place, CUDA uploads).
 * Without a usable CUDA device op_pair_open returns false with the reason.
 */
#ifndef DS4_TESTS_CUDA_OP_TEST_H
#define DS4_TESTS_CUDA_OP_TEST_H

#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "backends/backend.h"
#include "backends/cuda/cuda_backend.h"
#include "core/error.h"
#include "core/quant.h"
#include "test.h"

typedef struct op_pair {
    ds4_backend *cpu, *gpu;
} op_pair;

typedef struct op_buf {
    float *c; /* CPU backend buffer */
    float *g; /* CUDA backend buffer */
} op_buf;

typedef struct op_weight {
    ds4_weight c, g;
    void *bytes; /* host copy (owned) */
} op_weight;

static char op_pair_skip_reason[200];

static bool op_pair_open(op_pair *p) {
    memset(p, 0, sizeof *p);
    ds4_error err = { 0 };
    int n = 0;
    if (ds4_cuda_probe(&n, &err) != DS4_OK || n < 1) {
        snprintf(op_pair_skip_reason, sizeof op_pair_skip_reason, "%.190s", err.message[0] ? err.message : "no CUDA device");
        return false;
    }
    if (ds4_backend_create("cpu", 2, &p->cpu, &err) != DS4_OK ||
        ds4_backend_create("cuda", 0, &p->gpu, &err) != DS4_OK) {
        /* a present GPU whose backend cannot start is a failure, not a skip */
        fprintf(stderr, "  backend creation failed: %s\n", err.message);
        test_current_failures++;
        ds4_backend_destroy(p->cpu);
        p->cpu = NULL;
        snprintf(op_pair_skip_reason, sizeof op_pair_skip_reason, "backend creation failed");
        return false;
    }
    return true;
}

static void op_pair_close(op_pair *p) {
    ds4_backend_destroy(p->gpu);
    ds4_backend_destroy(p->cpu);
    p->gpu = p->cpu = NULL;
}

/* n host floats ~ N(0, scale^2) (malloc'd). */
static float *op_rand(int64_t n, double scale) {
    float *h = malloc((size_t)(n > 0 ? n : 1) * sizeof *h);
    for (int64_t i = 0; i < n; i++) h[i] = (float)(test_rand_normal() * scale);
    return h;
}

static op_buf op_buf_from(op_pair *p, const float *host, int64_t n) {
    op_buf b = { p->cpu->ops->alloc(p->cpu, n), p->gpu->ops->alloc(p->gpu, n) };
    CHECK(b.c && b.g);
    if (b.c && b.g && n > 0) {
        p->cpu->ops->upload(p->cpu, b.c, host, n);
        p->gpu->ops->upload(p->gpu, b.g, host, n);
    }
    return b;
}

/* Outputs: NaN on both sides, so an element the op fails to write fails. */
static op_buf op_buf_poisoned(op_pair *p, int64_t n) {
    op_buf b = { p->cpu->ops->alloc(p->cpu, n), p->gpu->ops->alloc(p->gpu, n) };
    CHECK(b.c && b.g);
    if (b.c && b.g && n > 0) {
        p->cpu->ops->fill(p->cpu, b.c, NAN, n);
        p->gpu->ops->fill(p->gpu, b.g, NAN, n);
    }
    return b;
}

/* (The helpers below are inline: not every test file uses them.) */

/* n int32 values in backend memory on both sides (the ops' convention: a
 * float buffer of n elements holding the int32 bits), e.g. expert ids or
 * selected rows. The int32 views are (int32_t *)b.c and (int32_t *)b.g. */
static inline op_buf op_ints_from(op_pair *p, const int32_t *host, int64_t n) {
    op_buf b = { p->cpu->ops->alloc(p->cpu, n > 0 ? n : 1), p->gpu->ops->alloc(p->gpu, n > 0 ? n : 1) };
    CHECK(b.c && b.g);
    if (b.c && b.g && n > 0) {
        p->cpu->ops->upload(p->cpu, b.c, (const float *)host, n);
        p->gpu->ops->upload(p->gpu, b.g, (const float *)host, n);
    }
    return b;
}

/* The int32 arrays of b (n values) to the host: cpu[] and gpu[]. */
static inline void op_ints_get(op_pair *p, op_buf b, int64_t n, int32_t *cpu, int32_t *gpu) {
    if (n <= 0) return;
    p->cpu->ops->download(p->cpu, (float *)cpu, b.c, n);
    p->gpu->ops->download(p->gpu, (float *)gpu, b.g, n);
}

/* The CUDA side recorded DS4_ERR_INVALID whose message contains every one
 * of the NULL-terminated strings (and the error was cleared). */
static inline void op_expect_error_with(op_pair *p, const char *what, ...) {
    ds4_error e = { 0 };
    ds4_status s = p->gpu->ops->take_error(p->gpu, &e);
    CHECK_MSG(s == DS4_ERR_INVALID, "%s: cuda status %d: %s", what, (int)s, e.message);
    va_list ap;
    va_start(ap, what);
    for (const char *part = va_arg(ap, const char *); part; part = va_arg(ap, const char *))
        CHECK_MSG(strstr(e.message, part) != NULL, "%s: \"%s\" not in \"%s\"", what, part, e.message);
    va_end(ap);
    CHECK(p->gpu->ops->take_error(p->gpu, &e) == DS4_OK);
}

/* An environment switch: "0" off, "1" on, else the default. */
static inline bool env_on_default(const char *name, bool dflt) {
    const char *v = getenv(name);
    return v && !strcmp(v, "0") ? false : v && !strcmp(v, "1") ? true : dflt;
}

/* The CUDA backend's counters now. */
static inline ds4_backend_counters op_gpu_counters(op_pair *p) {
    ds4_backend_counters c;
    ds4_backend_counters_get(p->gpu, &c);
    return c;
}

/* Since c0 the CUDA side neither waited for the device nor copied between
 * host and device: an op whose inputs and outputs are all in device memory
 * (run once before, so that its scratch has grown already). */
static inline void op_expect_no_host_traffic(op_pair *p, const char *what, const ds4_backend_counters *c0) {
    const ds4_backend_counters c1 = op_gpu_counters(p);
    CHECK_MSG(c1.syncs == c0->syncs && c1.copies == c0->copies,
              "%s: %llu host waits and %llu host<->device copies (%llu bytes to the host)", what,
              (unsigned long long)(c1.syncs - c0->syncs), (unsigned long long)(c1.copies - c0->copies),
              (unsigned long long)(c1.d2h_bytes - c0->d2h_bytes));
}

static void op_buf_free(op_pair *p, op_buf *b) {
    p->cpu->ops->free(p->cpu, b->c);
    p->gpu->ops->free(p->gpu, b->g);
    b->c = b->g = NULL;
}

/* Both sides report no error since the last call. */
static void op_expect_ok(op_pair *p) {
    ds4_error e1 = { 0 }, e2 = { 0 };
    ds4_status s1 = p->cpu->ops->take_error(p->cpu, &e1);
    ds4_status s2 = p->gpu->ops->take_error(p->gpu, &e2);
    CHECK_MSG(s1 == DS4_OK, "cpu: %s", e1.message);
    CHECK_MSG(s2 == DS4_OK, "cuda: %s", e2.message);
}

/* The CUDA side recorded an error of `status` (and the error was cleared). */
static void op_expect_error(op_pair *p, ds4_status status) {
    ds4_error e = { 0 };
    ds4_status s = p->gpu->ops->take_error(p->gpu, &e);
    CHECK_MSG(s == status, "cuda status %d (want %d): %s", (int)s, (int)status, e.message);
    CHECK(p->gpu->ops->take_error(p->gpu, &e) == DS4_OK);
}

/*
 * Compare n floats of b (CPU vs CUDA): element i passes when
 * |g - c| <= atol + rtol * |c| (both infinite with the same sign also pass;
 * a NaN on either side fails). Prints the worst element and the count of
 * failures; returns the number of failures.
 */
static int64_t op_compare(const char *what, op_pair *p, op_buf b, int64_t n, double atol, double rtol) {
    float *hc = malloc((size_t)(n > 0 ? n : 1) * sizeof *hc), *hg = malloc((size_t)(n > 0 ? n : 1) * sizeof *hg);
    p->cpu->ops->download(p->cpu, hc, b.c, n);
    p->gpu->ops->download(p->gpu, hg, b.g, n);
    int64_t bad = 0, worst = -1;
    double worst_excess = -1;
    for (int64_t i = 0; i < n; i++) {
        double c = hc[i], g = hg[i];
        bool ok;
        if (isinf(c) || isinf(g)) ok = c == g;
        else ok = fabs(g - c) <= atol + rtol * fabs(c); /* NaN compares false */
        if (!ok) {
            bad++;
            double ex = isnan(g - c) ? INFINITY : fabs(g - c) - (atol + rtol * fabs(c));
            if (ex > worst_excess) worst_excess = ex, worst = i;
        }
    }
    if (bad) {
        fprintf(stderr, "  FAIL %s: %lld of %lld elements out of tolerance (atol %.3g, rtol %.3g); worst [%lld] "
                "cpu %.9g cuda %.9g\n", what, (long long)bad, (long long)n, atol, rtol, (long long)worst,
                hc[worst], hg[worst]);
        test_current_failures++;
    }
    free(hc);
    free(hg);
    return bad;
}

/* How many of the n floats of the GPU sides of a and b differ, bit for bit. */
static inline int64_t op_gpu_differ(op_pair *p, op_buf a, op_buf b, int64_t n) {
    float *ha = malloc((size_t)(n > 0 ? n : 1) * sizeof *ha), *hb = malloc((size_t)(n > 0 ? n : 1) * sizeof *hb);
    p->gpu->ops->download(p->gpu, ha, a.g, n);
    p->gpu->ops->download(p->gpu, hb, b.g, n);
    int64_t diff = 0;
    for (int64_t i = 0; i < n; i++) diff += memcmp(&ha[i], &hb[i], sizeof *ha) != 0;
    free(ha);
    free(hb);
    return diff;
}

/* Bind the same raw weight bytes on both backends. ne1, ne2 >= 1. */
static op_weight *op_weight_make(op_pair *p, const char *name, uint32_t type, int64_t ne0, int64_t ne1, int64_t ne2,
                                 const void *bytes) {
    op_weight *w = calloc(1, sizeof *w);
    const int64_t rb = ds4_type_row_bytes(type, ne0);
    const size_t total = (size_t)(rb * ne1 * ne2);
    w->bytes = malloc(total ? total : 1);
    memcpy(w->bytes, bytes, total);
    ds4_weight base = { name, type, { ne0, ne1, ne2, 1 }, rb, w->bytes, NULL, NULL };
    w->c = base;
    w->g = base;
    ds4_error err = { 0 };
    ds4_status s1 = p->cpu->ops->bind_weight(p->cpu, &w->c, &err);
    CHECK_MSG(s1 == DS4_OK, "cpu bind %s: %s", name, err.message);
    ds4_status s2 = p->gpu->ops->bind_weight(p->gpu, &w->g, &err);
    CHECK_MSG(s2 == DS4_OK, "cuda bind %s: %s", name, err.message);
    return w;
}

/* A float weight (F32, F16 or BF16) from host floats (rounded to the type). */
static op_weight *op_weight_floats(op_pair *p, const char *name, uint32_t type, int64_t ne0, int64_t ne1,
                                   int64_t ne2, const float *values) {
    const int64_t n = ne0 * ne1 * ne2;
    const ds4_type_traits *t = ds4_type_traits_get(type);
    const int64_t rb = ds4_type_row_bytes(type, ne0);
    uint8_t *bytes = malloc((size_t)(rb * ne1 * ne2));
    for (int64_t r = 0; r < n / ne0; r++) t->quantize_row(values + r * ne0, bytes + r * rb, ne0);
    op_weight *w = op_weight_make(p, name, type, ne0, ne1, ne2, bytes);
    free(bytes);
    return w;
}

static void op_weight_free(op_pair *p, op_weight *w) {
    if (!w) return;
    p->cpu->ops->release_weight(p->cpu, &w->c);
    p->gpu->ops->release_weight(p->gpu, &w->g);
    free(w->bytes);
    free(w);
}

#endif

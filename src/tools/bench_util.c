/* bench_util.c - see bench_util.h. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/bench_util.h"
#include "tools/tools.h"

bool bench_dvec_push(dvec *d, double x) {
    if (d->n == d->cap) {
        int64_t cap = d->cap ? d->cap * 2 : 16;
        double *nv = realloc(d->v, (size_t)cap * sizeof *nv);
        if (!nv) return false;
        d->v = nv;
        d->cap = cap;
    }
    d->v[d->n++] = x;
    return true;
}

static int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

stats bench_stats_of(const dvec *d) {
    stats s = { 0 };
    s.n = d->n;
    if (d->n == 0) return s;
    double *v = malloc((size_t)d->n * sizeof *v);
    if (!v) return s;
    memcpy(v, d->v, (size_t)d->n * sizeof *v);
    qsort(v, (size_t)d->n, sizeof *v, bench_cmp_double);
    const int64_t n = d->n;
    s.median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    s.p95 = v[(95 * n + 99) / 100 - 1];
    s.min = v[0];
    s.max = v[n - 1];
    for (int64_t i = 0; i < n; i++) s.sum += v[i];
    s.mean = s.sum / (double)n;
    free(v);
    return s;
}


/* Strict number parsing: the whole string, in range. */
bool bench_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (errno || *end || x < lo || x > hi) return false;
    *out = x;
    return true;
}

bool bench_parse_u64(const char *s, uint64_t *out) {
    if (!s || !*s || *s == '-') return false;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(s, &end, 0);
    if (errno || *end) return false;
    *out = x;
    return true;
}

/* "a,b,c" of integers in [lo, hi] into out (sorted ascending, duplicates dropped). */
bool bench_parse_list(const char *s, int64_t lo, int64_t hi, int64_t *out, int *n_out) {
    int n = 0;
    const char *p = s;
    if (!s || !*s) return false;
    while (*p) {
        char buf[32];
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len == 0 || len >= sizeof buf || n == MAX_LIST) return false;
        memcpy(buf, p, len);
        buf[len] = 0;
        int64_t x;
        if (!bench_parse_i64(buf, lo, hi, &x)) return false;
        out[n++] = x;
        p += len;
        if (*p == ',') {
            p++;
            if (!*p) return false;
        }
    }
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && out[j - 1] > out[j]; j--) {
            int64_t t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    int m = 0;
    for (int i = 0; i < n; i++)
        if (m == 0 || out[m - 1] != out[i]) out[m++] = out[i];
    *n_out = m;
    return m > 0;
}


void bench_json_str(FILE *f, const char *s) {
    fputc('"', f);
    tool_json_escape(f, s, strlen(s));
    fputc('"', f);
}


/* A finite double, or null. */
void bench_json_num(FILE *f, double x) {
    if (isfinite(x)) fprintf(f, "%.9g", x);
    else fputs("null", f);
}

void bench_json_samples(FILE *f, const dvec *d) {
    fputc('[', f);
    for (int64_t i = 0; i < d->n; i++) {
        if (i) fputs(", ", f);
        bench_json_num(f, d->v[i]);
    }
    fputc(']', f);
}

/* "median_s", "p95_s", "min_s", "max_s", "mean_s" of a stats (no braces). */
void bench_json_stats_s(FILE *f, const stats *s) {
    fprintf(f, "\"n\": %lld, \"median_s\": ", (long long)s->n);
    bench_json_num(f, s->median);
    fputs(", \"p95_s\": ", f);
    bench_json_num(f, s->p95);
    fputs(", \"min_s\": ", f);
    bench_json_num(f, s->min);
    fputs(", \"max_s\": ", f);
    bench_json_num(f, s->max);
    fputs(", \"mean_s\": ", f);
    bench_json_num(f, s->mean);
}

int bench_next_option(int argc, char **argv, int *i, const char *cmd, const char *help, const char **opt,
                      const char **val) {
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) return -1;
    if (strncmp(a, "-", 1)) return bench_usage_error(cmd, help, "unexpected argument '%s'", a);
    if (!v) return bench_usage_error(cmd, help, "option %s needs a value", a);
    (*i)++;
    *opt = a;
    *val = v;
    return 0;
}

int64_t bench_default_threads(void) {
    const long nproc = sysconf(_SC_NPROCESSORS_ONLN);
    return nproc > 0 ? nproc : 1;
}

bool bench_valid_backend(const char *v) { return !strcmp(v, "cpu") || !strcmp(v, "cuda"); }


bool bench_parse_positive(const char *s, double *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    const double x = strtod(s, &end);
    if (errno || *end || !(x > 0) || !isfinite(x)) return false;
    *out = x;
    return true;
}

uint64_t bench_rng_next(uint64_t *x) {
    *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
    return *x;
}

double bench_rng_uniform(uint64_t *x) { return (double)(bench_rng_next(x) >> 11) / 9007199254740992.0; }

int bench_usage_error(const char *cmd, const char *help, const char *fmt, const char *arg) {
    fprintf(stderr, "ds4server %s: ", cmd);
    fprintf(stderr, fmt, arg ? arg : "");
    fprintf(stderr, " (see ds4server %s --help)\n", help);
    return 2;
}

bool bench_copy_bandwidth(ds4_backend *be, int64_t mib, int rounds, dvec *samples, char *reason, size_t cap) {
    const int64_t n = mib * 1024 * 256; /* floats */
    const int64_t bytes = n * 4;
    float *src = be->ops->alloc(be, n), *dst = src ? be->ops->alloc(be, n) : NULL;
    ds4_error e = { 0 };
    samples->n = 0;
    if (!src || !dst) {
        snprintf(reason, cap, "could not allocate two %lld MiB buffers", (long long)mib);
        if (src) be->ops->free(be, src);
        be->ops->take_error(be, &e);
        return false;
    }
    float probe;
    be->ops->fill(be, src, 1.5f, n);
    be->ops->copy(be, dst, src, n); /* warm */
    be->ops->download(be, &probe, dst + n - 1, 1);
    const int inner = 4;
    for (int r = 0; r < rounds; r++) {
        be->ops->download(be, &probe, dst, 1);
        double t0 = tool_now();
        for (int k = 0; k < inner; k++) be->ops->copy(be, dst, src, n);
        be->ops->download(be, &probe, dst + n - 1, 1);
        double dt = tool_now() - t0;
        if (dt > 0) bench_dvec_push(samples, 2.0 * (double)bytes * inner / dt / 1e9);
    }
    be->ops->free(be, dst);
    be->ops->free(be, src);
    if (be->ops->take_error(be, &e)) {
        snprintf(reason, cap, "copy failed: %s", e.message);
        samples->n = 0;
        return false;
    }
    return samples->n > 0;
}

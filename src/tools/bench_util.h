/*
 * bench_util.h - what `ds4server bench` and its op benchmark share: sample
 * vectors and their statistics, strict number and list parsing, JSON
 * number/string writers and the copy-bandwidth measurement.
 */
#ifndef DS4_TOOLS_BENCH_UTIL_H
#define DS4_TOOLS_BENCH_UTIL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "backends/backend.h"

#define MAX_LIST 64 /* entries of a comma-separated option */

typedef struct dvec {
    double *v;
    int64_t n, cap;
} dvec;
bool bench_dvec_push(dvec *d, double x);

/* Median (mean of the middle two for an even count), p95 by nearest rank
 * (the ceil(95 n / 100)-th smallest), min, max, mean, sum. */
typedef struct stats {
    int64_t n;
    double median, p95, min, max, mean, sum;
} stats;
stats bench_stats_of(const dvec *d);

/* Strict number parsing: the whole string, in range. */
bool bench_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out);
bool bench_parse_u64(const char *s, uint64_t *out);
/* "a,b,c" of integers in [lo, hi] into out (at most MAX_LIST; sorted
 * ascending, duplicates dropped). */
bool bench_parse_list(const char *s, int64_t lo, int64_t hi, int64_t *out, int *n_out);

/* The next "--option VALUE" of argv from *i (which moves past both): 0 with
 * *opt and *val set, -1 for --help / -h, or 2 after a usage error (an
 * argument that is not an option, an option without a value). */
int bench_next_option(int argc, char **argv, int *i, const char *cmd, const char *help, const char **opt,
                      const char **val);
/* Worker threads by default: the online cores (at least 1). */
int64_t bench_default_threads(void);
/* "cpu" or "cuda". */
bool bench_valid_backend(const char *v);

/* A positive finite number (a bandwidth in GB/s): the whole string. */
bool bench_parse_positive(const char *s, double *out);
/* The seeded xorshift64 stream of the benches: the next value of *x, and
 * the next as a double in [0, 1) (53 bits). */
uint64_t bench_rng_next(uint64_t *x);
double bench_rng_uniform(uint64_t *x);
/* "ds4server CMD: " + fmt (with arg) + " (see ds4server HELP --help)" on
 * stderr; returns 2, the exit status of a usage error. */
int bench_usage_error(const char *cmd, const char *help, const char *fmt, const char *arg);

/* A JSON string; a finite double or null; an array of samples; the
 * "n", "median_s", "p95_s", "min_s", "max_s", "mean_s" members of a stats
 * (no braces). */
void bench_json_str(FILE *f, const char *s);
void bench_json_num(FILE *f, double x);
void bench_json_samples(FILE *f, const dvec *d);
void bench_json_stats_s(FILE *f, const stats *s);

/* The backend's copy op on two buffers of `mib` MiB, timed `rounds` times
 * (4 copies each, the device idle before and after): each sample, 2 x bytes
 * x 4 / seconds in GB/s, goes to `samples`. false with `reason` filled when
 * the buffers could not be allocated or the copy failed (samples emptied). */
bool bench_copy_bandwidth(ds4_backend *be, int64_t mib, int rounds, dvec *samples, char *reason, size_t cap);

/* `ds4server bench --ops ...` (bench_ops.c); argv[0] is "--ops". */
int bench_ops_main(int argc, char **argv);

#endif

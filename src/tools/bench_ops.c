/*
 * bench_ops.c - `ds4server bench --ops`: the decode-shaped weight products of
 * DeepSeek V4 Flash, each measured in isolation, as bytes read per second
 * and as a fraction of the measured copy bandwidth.
 *
 *   ds4server bench --ops [--backend cpu|cuda] [--numerics ds4|reference|ds4-f16]
 *                   [--rows 1,8] [--keys 4096,16384] [--div N] [--only S[,S...]]
 *                   [--repeat N] [--warmup N]
 *                   [--rotate-mib N] [--seed S] [--threads N] [--json OUT] [--md OUT]
 *                   [--bandwidth GBPS | --bandwidth-mib N]
 *
 * The products are the ones a decoded token runs, at the widths of the real
 * model (spec section 2; --div N divides every width by N, down to 256, for
 * a quick run): the Q8_0 projections of attention, shared expert and head,
 * the F16 router, compressor and indexer projections, and the routed
 * experts of the q2 and q4 files (six of 256); the decoded row's sparse
 * attention selection at --keys compressed rows (a context of 4 x keys:
 * the indexer's scores over its compressed key rows, on the float op and
 * on the binary16 one, and the top 512 of those scores); and, for the cost
 * of a short kernel inside a step, the hyper-connection pre-mix, an RMSNorm
 * and the floor: a fill of one float per row. Each is the backend op the
 * model calls (matmul, matmul_grouped, moe, indexer_scores(_rows)(_f16),
 * top_k(_rows), hc_pre, rmsnorm, fill), with --rows activation rows (1 =
 * one stream; more = batched decode, or for the selection a prefill's rows
 * over the same keys); bytes are those of the weights (the selection: of
 * the key rows or scores) and, for the small ops, of the activations read
 * and written.
 *
 * Weights hold valid quantised data (a few rows quantised from seeded
 * random values, repeated), uploaded through bind_weight. A real token
 * reads each weight once, from memory, so the weights rotate: a dense
 * weight is bound in as many copies as make --rotate-mib MiB (default 512,
 * ten times the H200's L2; each copy its own host buffer on a backend that
 * computes from host memory; the indexer's key rows rotate the same way),
 * and the routed experts rotate by their ids
 * (every call another seeded choice of six per row; with several rows the
 * bytes count the distinct experts of a call, on average). One sample is a step of
 * `calls` products (at least every copy once) between step_begin and
 * step_end; on the CUDA backend that step is one CUDA graph and the
 * sample is its device time (events), on the CPU the wall time. Per call:
 * seconds, bytes of weights read, GB/s, and that over the bandwidth.
 *
 * Output: a Markdown table on stdout (and --md FILE), JSON to --json.
 * Exit status: 0 done, 1 a runtime failure, 2 bad usage.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backends/backend.h"
#include "core/quant.h"
#include "tools/bench_util.h"
#include "tools/tools.h"

#define CMD "bench --ops"
#define SCHEMA "ds4server-bench-ops/1"
#define REASON 768 /* room for an error message and its context */
#define DISTINCT_ROWS 16 /* rows quantised per weight; the rest repeat them */
#define MOE_USED 6
#define MOE_EXPERTS 256
#define TOP_K 512 /* the indexer's selection (spec 3.6) */

typedef enum op_kind {
    OP_MATMUL,
    OP_GROUPED,
    OP_MOE,
    OP_INDEXER,     /* indexer_scores (one row), indexer_scores_rows */
    OP_INDEXER_F16, /* indexer_scores_rows_f16 (else indexer_scores_rows, as the model) */
    OP_TOPK,        /* top_k (one row), top_k_rows */
    OP_HC_PRE,
    OP_RMSNORM,
    OP_FILL
} op_kind;
static const char *const KIND_NAMES[] = { "matmul", "matmul_grouped", "moe", "indexer_scores", "indexer_scores_f16",
                                          "top_k", "hc_pre", "rmsnorm", "fill" };
_Static_assert(sizeof KIND_NAMES / sizeof KIND_NAMES[0] == OP_FILL + 1, "a name for every kind");

/* One product: W [n_in, n_out] (grouped: n_groups blocks of n_out rows,
 * each on its own n_in slice of x; moe: gate/up [n_in, n_out, experts],
 * down [n_out, n_in, experts]; the indexer: n_out heads of n_in dims
 * against --keys key rows of n_in; top_k: the n_out best of --keys
 * scores). Widths are those of the real model. */
typedef struct op_spec {
    const char *name;
    op_kind kind;
    uint32_t type;      /* matmul weight, or moe gate/up */
    uint32_t down_type; /* moe */
    int64_t n_in, n_out, n_groups;
} op_spec;

static const op_spec SPECS[] = {
    { "attn_q_a", OP_MATMUL, DS4_TYPE_Q8_0, 0, 4096, 1024, 1 },
    { "attn_q_b", OP_MATMUL, DS4_TYPE_Q8_0, 0, 1024, 32768, 1 },
    { "attn_kv", OP_MATMUL, DS4_TYPE_Q8_0, 0, 4096, 512, 1 },
    { "attn_output_a", OP_GROUPED, DS4_TYPE_Q8_0, 0, 4096, 1024, 8 },
    { "attn_output_b", OP_MATMUL, DS4_TYPE_Q8_0, 0, 8192, 4096, 1 },
    { "ffn_gate_shexp", OP_MATMUL, DS4_TYPE_Q8_0, 0, 4096, 2048, 1 },
    { "ffn_down_shexp", OP_MATMUL, DS4_TYPE_Q8_0, 0, 2048, 4096, 1 },
    { "output", OP_MATMUL, DS4_TYPE_Q8_0, 0, 4096, 129280, 1 },
    { "ffn_gate_inp", OP_MATMUL, DS4_TYPE_F16, 0, 4096, 256, 1 },
    { "attn_compressor_kv", OP_MATMUL, DS4_TYPE_F16, 0, 4096, 1024, 1 },
    { "indexer.attn_q_b", OP_MATMUL, DS4_TYPE_F16, 0, 1024, 8192, 1 },
    { "indexer_compressor_kv", OP_MATMUL, DS4_TYPE_F16, 0, 4096, 256, 1 },
    { "experts q2", OP_MOE, DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, 4096, 2048, 1 },
    { "experts q4", OP_MOE, DS4_TYPE_Q4_K, DS4_TYPE_Q4_K, 4096, 2048, 1 },
    /* the decoded row's selection over its compressed rows (ratio-4 layers) */
    { "indexer_scores", OP_INDEXER, DS4_TYPE_F32, 0, 128, 64, 1 },
    { "indexer_scores_f16", OP_INDEXER_F16, DS4_TYPE_F16, 0, 128, 64, 1 },
    { "top_k", OP_TOPK, DS4_TYPE_F32, 0, 0, TOP_K, 1 },
    /* two small ops of every layer, for the cost of a short kernel in a step */
    { "hc_pre", OP_HC_PRE, DS4_TYPE_F16, 0, 4 * 4096, 24, 1 },
    { "rmsnorm", OP_RMSNORM, DS4_TYPE_F32, 0, 4096, 1, 1 },
    /* the floor: the smallest op there is (one float per row filled) */
    { "fill", OP_FILL, DS4_TYPE_F32, 0, 1, 1, 1 },
};
#define N_SPECS ((int)(sizeof SPECS / sizeof SPECS[0]))

typedef struct opts {
    char backend[16];
    ds4_numerics num;
    int64_t rows[MAX_LIST], keys[MAX_LIST];
    int n_rows, n_keys;
    int64_t div, repeat, warmup, rotate_mib, threads, bw_mib;
    uint64_t seed;
    double bandwidth;
    const char *only, *json, *md;
} opts;

typedef struct op_result {
    const op_spec *spec;
    int64_t n_in, n_out, rows, experts; /* widths after --div */
    int64_t keys; /* the selection's key rows (after --div), else 0 */
    int64_t copies, calls;
    double bytes; /* weight bytes read per call */
    double experts_read; /* moe: distinct experts per call, on average */
    dvec samples; /* seconds per call */
    stats st;
    char timing[16]; /* "graph" (device events) or "wall" */
    char skipped[REASON];
} op_result;

static int usage_error(const char *fmt, const char *arg) {
    return bench_usage_error(CMD, "bench --ops", fmt, arg);
}

static void print_help(void) {
    printf("usage: ds4server bench --ops [--backend cpu|cuda] [--numerics ds4|reference|ds4-f16] [--rows 1,8]\n"
           "                       [--keys 4096,16384] [--div N] [--only S[,S...]] [--repeat N] [--warmup N]\n"
           "                       [--rotate-mib N]\n"
           "                       [--seed S] [--threads N] [--json OUT] [--md OUT]\n"
           "                       [--bandwidth GBPS | --bandwidth-mib N]\n"
           "  Times each decode-shaped weight product of DeepSeek V4 Flash on its own (the model's\n"
           "  op, real widths divided by --div, default 1) with --rows activation rows, and reports\n"
           "  weight bytes read per second and their share of the copy bandwidth.\n"
           "  --keys N,...      compressed key rows of the indexer and top-k ops (default 4096,16384:\n"
           "                    contexts of 16K and 64K tokens; divided by --div too)\n"
           "  --only S,...      only the products whose name contains one of the S\n"
           "  --repeat N        timed samples per product (default 5); --warmup N untimed (default 1)\n"
           "  --rotate-mib N    dense weights rotate over copies of at least N MiB (default 512)\n"
           "  --bandwidth GBPS  bandwidth to compare with; default: the copy op on --bandwidth-mib MiB\n"
           "  Markdown goes to stdout (and --md FILE), samples to --json OUT.\n");
}

/* The next name of a comma-separated --only list at *p into one (room for
 * ONLY_NAME bytes): 1 (and *p past it and its comma), 0 at the end, -1 for
 * an empty or overlong name. */
#define ONLY_NAME 128
static int only_next(const char **p, char *one) {
    if (!*p) return 0;
    const size_t n = strcspn(*p, ",");
    if (n == 0 || n >= ONLY_NAME) return -1;
    memcpy(one, *p, n);
    one[n] = 0;
    *p = (*p)[n] ? *p + n + 1 : NULL; /* (NULL: that was the last name) */
    return 1;
}

static int parse_opts(int argc, char **argv, opts *o) {
    memset(o, 0, sizeof *o);
    snprintf(o->backend, sizeof o->backend, "cpu");
    o->num = DS4_NUMERICS_DS4;
    o->rows[0] = 1;
    o->n_rows = 1;
    o->keys[0] = 4096;
    o->keys[1] = 16384;
    o->n_keys = 2;
    o->div = 1;
    o->repeat = 5;
    o->warmup = 1;
    o->rotate_mib = 512;
    o->bw_mib = 1024;
    o->seed = 1;
    o->threads = bench_default_threads();
    for (int i = 1; i < argc; i++) {
        const char *a, *v;
        const int next = bench_next_option(argc, argv, &i, CMD, "bench --ops", &a, &v);
        if (next) return next;
        if (!strcmp(a, "--backend")) {
            if (!bench_valid_backend(v)) return usage_error("--backend must be cpu or cuda, not '%s'", v);
            snprintf(o->backend, sizeof o->backend, "%s", v);
        } else if (!strcmp(a, "--numerics")) {
            if (!ds4_numerics_parse(v, &o->num))
                return usage_error("--numerics must be " DS4_NUMERICS_NAMES ", not '%s'", v);
        } else if (!strcmp(a, "--rows")) {
            if (!bench_parse_list(v, 1, 64, o->rows, &o->n_rows))
                return usage_error("--rows must be a list of 1..64, not '%s'", v);
        } else if (!strcmp(a, "--keys")) {
            if (!bench_parse_list(v, 1, 1 << 20, o->keys, &o->n_keys))
                return usage_error("--keys must be a list of 1..1048576, not '%s'", v);
        } else if (!strcmp(a, "--div")) {
            if (!bench_parse_i64(v, 1, 64, &o->div) || (o->div & (o->div - 1)))
                return usage_error("--div must be a power of two 1..64, not '%s'", v);
        } else if (!strcmp(a, "--only")) o->only = v;
        else if (!strcmp(a, "--repeat")) {
            if (!bench_parse_i64(v, 1, 1000, &o->repeat)) return usage_error("--repeat must be 1..1000, not '%s'", v);
        } else if (!strcmp(a, "--warmup")) {
            if (!bench_parse_i64(v, 0, 1000, &o->warmup)) return usage_error("--warmup must be 0..1000, not '%s'", v);
        } else if (!strcmp(a, "--rotate-mib")) {
            if (!bench_parse_i64(v, 0, 1 << 20, &o->rotate_mib))
                return usage_error("--rotate-mib must be 0..1048576, not '%s'", v);
        } else if (!strcmp(a, "--seed")) {
            if (!bench_parse_u64(v, &o->seed)) return usage_error("--seed must be a number, not '%s'", v);
        } else if (!strcmp(a, "--threads")) {
            if (!bench_parse_i64(v, 1, 1024, &o->threads)) return usage_error("--threads must be 1..1024, not '%s'", v);
        } else if (!strcmp(a, "--json")) o->json = v;
        else if (!strcmp(a, "--md")) o->md = v;
        else if (!strcmp(a, "--bandwidth-mib")) {
            if (!bench_parse_i64(v, 1, 1 << 20, &o->bw_mib))
                return usage_error("--bandwidth-mib must be 1..1048576, not '%s'", v);
        } else if (!strcmp(a, "--bandwidth")) {
            if (!bench_parse_positive(v, &o->bandwidth))
                return usage_error("--bandwidth must be a positive number of GB/s, not '%s'", v);
        } else return usage_error("unknown option '%s'", a);
    }
    if (o->only) { /* each of its names must name a product */
        const char *p = o->only;
        char one[ONLY_NAME];
        int got;
        while ((got = only_next(&p, one)) > 0) {
            bool any = false;
            for (int k = 0; k < N_SPECS && !any; k++) any = strstr(SPECS[k].name, one) != NULL;
            if (!any) return usage_error("--only names no product called '%s'", one);
        }
        if (got < 0) return usage_error("--only '%s' names no product", o->only);
    }
    return 0;
}

/* --only: whether the product's name contains one of the listed names */
static bool only_names(const char *only, const char *name) {
    if (!only) return true;
    char one[ONLY_NAME];
    while (only_next(&only, one) > 0)
        if (strstr(name, one)) return true;
    return false;
}

/* ------------------------------------------------------------ weights */

/* Host bytes of `n_rows` rows of `n` elements of `type`: DISTINCT_ROWS rows
 * quantised from seeded values in [-1, 1), repeated. NULL (reason set)
 * when the type cannot be quantised or memory is short. */
static uint8_t *make_rows(uint32_t type, int64_t n, int64_t n_rows, uint64_t seed, int64_t *row_bytes, char *reason) {
    const ds4_type_traits *tr = ds4_type_traits_get(type);
    const int64_t rb = ds4_type_row_bytes(type, n);
    if (!tr || rb <= 0) {
        snprintf(reason, REASON, "%s rows of %lld elements are not whole blocks", ds4_type_name(type), (long long)n);
        return NULL;
    }
    if (type != DS4_TYPE_F16 && type != DS4_TYPE_F32 && !tr->quantize_row) {
        snprintf(reason, REASON, "no quantiser for %s", ds4_type_name(type));
        return NULL;
    }
    uint8_t *buf = malloc((size_t)(rb * n_rows));
    float *src = malloc((size_t)n * sizeof *src);
    if (!buf || !src) {
        free(buf);
        free(src);
        snprintf(reason, REASON, "out of memory for %lld rows of %lld bytes", (long long)n_rows, (long long)rb);
        return NULL;
    }
    uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 0x2545F4914F6CDD1DULL;
    const int64_t distinct = n_rows < DISTINCT_ROWS ? n_rows : DISTINCT_ROWS;
    for (int64_t r = 0; r < distinct; r++) {
        for (int64_t i = 0; i < n; i++) src[i] = (float)(2.0 * bench_rng_uniform(&x) - 1.0);
        uint8_t *dst = buf + r * rb;
        if (type == DS4_TYPE_F32) memcpy(dst, src, (size_t)rb);
        else if (type == DS4_TYPE_F16)
            for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = ds4_f32_to_f16(src[i]);
        else tr->quantize_row(src, dst, n);
    }
    for (int64_t r = distinct; r < n_rows; r++) memcpy(buf + r * rb, buf + (r % distinct) * rb, (size_t)rb);
    free(src);
    *row_bytes = rb;
    return buf;
}

static void weight_init(ds4_weight *w, const char *name, uint32_t type, int64_t n, int64_t rows, int64_t experts,
                        int64_t row_bytes, const void *host) {
    memset(w, 0, sizeof *w);
    w->name = name;
    w->type = type;
    w->ne[0] = n;
    w->ne[1] = rows;
    w->ne[2] = experts;
    w->ne[3] = 1;
    w->row_bytes = row_bytes;
    w->host = host;
}

/* ------------------------------------------------------------ one product */

typedef struct bench_ops {
    opts o;
    ds4_backend *be;
    bool graphs; /* the backend records steps and times them on the device */
    double bw_gbps;
    bool bw_measured;
    dvec bw_samples;
    char bw_reason[REASON];
    op_result *res;
    int n_res;
} bench_ops;

/* Seconds of one sample of `calls` products: the device time of the step's
 * graph when the backend gives it, else the wall time of the step. */
static double timed_step(bench_ops *b, void (*run)(void *ctx, int64_t call), void *ctx, const float *sync_from,
                         int64_t calls, char *timing) {
    ds4_backend *be = b->be;
    float probe;
    ds4_backend_counters c0, c1;
    be->ops->take_error(be, &(ds4_error){ 0 });
    be->ops->download(be, &probe, sync_from, 1); /* the device idle */
    ds4_backend_counters_get(be, &c0);
    const double t0 = tool_now();
    if (be->ops->step_begin) be->ops->step_begin(be);
    for (int64_t c = 0; c < calls; c++) run(ctx, c);
    if (be->ops->step_end) be->ops->step_end(be);
    be->ops->download(be, &probe, sync_from, 1);
    const double wall = tool_now() - t0;
    ds4_backend_counters_get(be, &c1);
    if (c1.graphs == c0.graphs + 1 && c1.step_breaks == c0.step_breaks && c1.graph_gpu_ns > c0.graph_gpu_ns) {
        snprintf(timing, 16, "graph");
        return (double)(c1.graph_gpu_ns - c0.graph_gpu_ns) * 1e-9;
    }
    snprintf(timing, 16, "wall");
    return wall;
}

/* What a dense product's calls need: out, x, the copies of W. */
typedef struct dense_ctx {
    float *out, *x;
    ds4_weight *w;
    int64_t copies, n_out, n_in, groups, rows;
    ds4_backend *be;
    ds4_numerics num;
} dense_ctx;

static void dense_call(void *p, int64_t call) {
    dense_ctx *d = p;
    const ds4_weight *w = &d->w[call % d->copies];
    const int64_t xs = d->n_in * d->groups, os = d->n_out * d->groups;
    if (d->groups > 1)
        d->be->ops->matmul_grouped(d->be, w, d->groups, d->n_out, d->x, xs, d->out, os, d->rows, d->num);
    else d->be->ops->matmul(d->be, w, 0, d->n_out, d->x, xs, d->out, os, d->rows, d->num);
}

typedef struct moe_ctx {
    float *out, *x;
    const ds4_weight *gate, *up, *down;
    float *sel, *wts; /* [calls][rows][MOE_USED] */
    int64_t rows, per_call;
    ds4_backend *be;
    ds4_numerics num;
} moe_ctx;

static void moe_call(void *p, int64_t call) {
    moe_ctx *m = p;
    m->be->ops->moe(m->be, m->gate, m->up, m->down, m->x, (const int32_t *)(m->sel + call * m->per_call),
                    m->wts + call * m->per_call, MOE_USED, 10.0f, m->out, m->rows, m->num);
}

/* Fill x with seeded values (the activation; its content does not change
 * the time). */
static bool upload_seeded(ds4_backend *be, float *dst, int64_t n, uint64_t seed) {
    float *h = malloc((size_t)n * sizeof *h);
    if (!h) return false;
    uint64_t x = seed * 0xD1B54A32D192ED03ULL + 1;
    for (int64_t i = 0; i < n; i++) h[i] = (float)(2.0 * bench_rng_uniform(&x) - 0.5);
    be->ops->upload(be, dst, h, n);
    free(h);
    return true;
}

/* An error from setting a product up (an upload, say) skips it. */
static bool setup_failed(ds4_backend *be, op_result *r) {
    ds4_error e = { 0 };
    if (!be->ops->take_error(be, &e)) return false;
    snprintf(r->skipped, REASON, "setting up: %s", e.message);
    return true;
}

static void take_samples(bench_ops *b, op_result *r, void (*run)(void *, int64_t), void *ctx, const float *out) {
    for (int64_t k = 0; k < b->o.warmup + b->o.repeat && !r->skipped[0]; k++) {
        char timing[16];
        const double s = timed_step(b, run, ctx, out, r->calls, timing);
        ds4_error e = { 0 };
        if (b->be->ops->take_error(b->be, &e)) {
            snprintf(r->skipped, REASON, "the op failed: %s", e.message);
            break;
        }
        if (k >= b->o.warmup) {
            if (r->timing[0] && strcmp(r->timing, timing)) {
                snprintf(r->skipped, REASON, "samples timed two ways (%s and %s): a step was cut short", r->timing,
                         timing);
                break;
            }
            if (!bench_dvec_push(&r->samples, s / (double)r->calls)) {
                snprintf(r->skipped, REASON, "out of memory for the samples");
                break;
            }
            snprintf(r->timing, sizeof r->timing, "%s", timing);
        }
    }
    r->st = bench_stats_of(&r->samples);
}

/* Copies of `bytes` (0: one copy) that make --rotate-mib (1 .. 4096 of
 * them), and the calls of a sample: every copy once, at least 8. */
static void rotate_copies(const bench_ops *b, op_result *r, double bytes) {
    r->copies = bytes > 0 ? (int64_t)ceil((double)b->o.rotate_mib * 1048576.0 / bytes) : 1;
    if (r->copies < 1) r->copies = 1;
    if (r->copies > 4096) r->copies = 4096;
    r->calls = r->copies < 8 ? 8 : r->copies;
}

static void run_dense(bench_ops *b, op_result *r) {
    const op_spec *sp = r->spec;
    ds4_backend *be = b->be;
    const int64_t total_rows = r->n_out * sp->n_groups;
    int64_t rb = 0;
    uint8_t *host = make_rows(sp->type, r->n_in, total_rows, b->o.seed, &rb, r->skipped);
    if (!host) return;
    const double wbytes = (double)rb * (double)total_rows;
    r->bytes = wbytes;
    rotate_copies(b, r, wbytes);
    dense_ctx d = { 0 };
    d.be = be;
    d.num = b->o.num;
    d.n_out = r->n_out;
    d.n_in = r->n_in;
    d.groups = sp->n_groups;
    d.rows = r->rows;
    d.w = calloc((size_t)r->copies, sizeof *d.w);
    d.x = be->ops->alloc(be, r->rows * r->n_in * sp->n_groups);
    d.out = be->ops->alloc(be, r->rows * total_rows);
    int64_t bound = 0;
    ds4_error err = { 0 };
    if (!d.w || !d.x || !d.out) {
        snprintf(r->skipped, REASON, "out of memory for the activations or %lld copies", (long long)r->copies);
        goto done;
    }
    for (; bound < r->copies; bound++) {
        /* a backend that computes from host memory (the CPU: no device
         * copy) needs a buffer per copy, or every copy is the same bytes */
        const void *src = host;
        if (bound > 0 && !d.w[0].device) {
            uint8_t *own = malloc((size_t)wbytes);
            if (!own) {
                snprintf(r->skipped, REASON, "out of memory for copy %lld of the weight", (long long)bound);
                goto done;
            }
            memcpy(own, host, (size_t)wbytes);
            src = own;
        }
        weight_init(&d.w[bound], sp->name, sp->type, r->n_in, total_rows, 1, rb, src);
        if (be->ops->bind_weight(be, &d.w[bound], &err)) {
            if (src != host) free((void *)src);
            snprintf(r->skipped, REASON, "binding copy %lld: %s", (long long)bound, err.message);
            goto done;
        }
    }
    d.copies = r->copies;
    if (!upload_seeded(be, d.x, r->rows * r->n_in * sp->n_groups, b->o.seed + 1)) {
        snprintf(r->skipped, REASON, "out of memory for the activation");
        goto done;
    }
    if (setup_failed(be, r)) goto done;
    take_samples(b, r, dense_call, &d, d.out);
done:
    for (int64_t i = 0; i < bound; i++) {
        const void *own = d.w[i].host != host ? d.w[i].host : NULL;
        be->ops->release_weight(be, &d.w[i]);
        free((void *)own);
    }
    free(d.w);
    if (d.x) be->ops->free(be, d.x);
    if (d.out) be->ops->free(be, d.out);
    be->ops->take_error(be, &err);
    free(host);
}

static void run_moe(bench_ops *b, op_result *r) {
    const op_spec *sp = r->spec;
    ds4_backend *be = b->be;
    const int64_t dim = r->n_in, n_ff = r->n_out, ne = r->experts;
    int64_t rb_gu = 0, rb_d = 0;
    uint8_t *h_gu = make_rows(sp->type, dim, n_ff * ne, b->o.seed, &rb_gu, r->skipped);
    uint8_t *h_d = h_gu ? make_rows(sp->down_type, n_ff, dim * ne, b->o.seed + 7, &rb_d, r->skipped) : NULL;
    ds4_weight gate, up, down;
    bool bg = false, bu = false, bd = false;
    moe_ctx m = { 0 };
    int32_t *hsel = NULL;
    float *hw = NULL;
    ds4_error err = { 0 };
    if (!h_d) goto done;
    r->calls = 64;
    r->copies = 1;
    weight_init(&gate, "ffn_gate_exps", sp->type, dim, n_ff, ne, rb_gu, h_gu);
    weight_init(&up, "ffn_up_exps", sp->type, dim, n_ff, ne, rb_gu, h_gu);
    weight_init(&down, "ffn_down_exps", sp->down_type, n_ff, dim, ne, rb_d, h_d);
    if (!(bg = !be->ops->bind_weight(be, &gate, &err)) || !(bu = !be->ops->bind_weight(be, &up, &err)) ||
        !(bd = !be->ops->bind_weight(be, &down, &err))) {
        snprintf(r->skipped, REASON, "binding the experts: %s", err.message);
        goto done;
    }
    m.be = be;
    m.num = b->o.num;
    m.gate = &gate, m.up = &up, m.down = &down;
    m.rows = r->rows;
    m.per_call = r->rows * MOE_USED;
    const int64_t n_sel = r->calls * m.per_call;
    m.x = be->ops->alloc(be, r->rows * dim);
    m.out = be->ops->alloc(be, r->rows * dim);
    m.sel = be->ops->alloc(be, n_sel);
    m.wts = be->ops->alloc(be, n_sel);
    hsel = malloc((size_t)n_sel * sizeof *hsel);
    hw = malloc((size_t)n_sel * sizeof *hw);
    if (!m.x || !m.out || !m.sel || !m.wts || !hsel || !hw || !upload_seeded(be, m.x, r->rows * dim, b->o.seed + 2)) {
        snprintf(r->skipped, REASON, "out of memory for the activations and routing");
        goto done;
    }
    /* every call a seeded choice of MOE_USED distinct experts per row */
    uint64_t x = b->o.seed * 0xA0761D6478BD642FULL + 3;
    for (int64_t s = 0; s < n_sel; s += MOE_USED)
        for (int k = 0; k < MOE_USED; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(bench_rng_next(&x) % (uint64_t)ne);
                dup = false;
                for (int q = 0; q < k; q++) dup |= hsel[s + q] == e;
            } while (dup);
            hsel[s + k] = e;
            hw[s + k] = 1.0f / MOE_USED;
        }
    be->ops->upload(be, m.sel, (const float *)hsel, n_sel);
    be->ops->upload(be, m.wts, hw, n_sel);
    /* bytes: the distinct experts of a call (rows may pick the same one), on average */
    double distinct = 0;
    for (int64_t c = 0; c < r->calls; c++) {
        const int32_t *cs = hsel + c * m.per_call;
        for (int64_t i = 0; i < m.per_call; i++) {
            bool seen = false;
            for (int64_t j = 0; j < i && !seen; j++) seen = cs[j] == cs[i];
            distinct += !seen;
        }
    }
    r->experts_read = distinct / (double)r->calls;
    r->bytes = r->experts_read * ((double)rb_gu * n_ff * 2 + (double)rb_d * dim);
    if (setup_failed(be, r)) goto done;
    take_samples(b, r, moe_call, &m, m.out);
done:
    if (bg) be->ops->release_weight(be, &gate);
    if (bu) be->ops->release_weight(be, &up);
    if (bd) be->ops->release_weight(be, &down);
    if (m.x) be->ops->free(be, m.x);
    if (m.out) be->ops->free(be, m.out);
    if (m.sel) be->ops->free(be, m.sel);
    if (m.wts) be->ops->free(be, m.wts);
    free(hsel);
    free(hw);
    free(h_gu);
    free(h_d);
    be->ops->take_error(be, &err);
}

/* The decoded row's selection: the indexer's scores of `rows` query rows
 * (heads x dim, and a weight per head) over `keys` compressed key rows of
 * dim, or the top TOP_K of `rows` rows of `keys` scores. */
typedef struct select_ctx {
    ds4_backend *be;
    op_kind kind;
    float **keys; /* the indexer's key rows, `copies` copies */
    int64_t copies;
    float *q, *w, *scores;
    int32_t *idx;
    int64_t n_keys, rows, heads, dim, k;
    int64_t counts[MAX_LIST]; /* n_keys for every row (host) */
} select_ctx;

static void select_call(void *p, int64_t call) {
    select_ctx *c = p;
    ds4_backend *be = c->be;
    const ds4_backend_ops *ops = be->ops;
    const float scale = 1.0f / sqrtf((float)(c->heads * c->dim)); /* (the model's 1/sqrt(dim * heads)) */
    const float *keys = c->keys ? c->keys[call % c->copies] : NULL;
    if (c->kind == OP_TOPK) {
        if (c->rows == 1) ops->top_k(be, c->scores, c->n_keys, c->k, c->idx);
        else ops->top_k_rows(be, c->scores, c->n_keys, c->counts, c->rows, c->k, c->idx);
    } else if (c->kind == OP_INDEXER && c->rows == 1) {
        ops->indexer_scores(be, c->q, c->w, scale, c->heads, c->dim, keys, c->n_keys, c->scores);
    } else if (c->kind == OP_INDEXER_F16 && ops->indexer_scores_rows_f16) {
        ops->indexer_scores_rows_f16(be, c->q, c->w, scale, c->heads, c->dim, keys, c->counts, c->rows, c->scores,
                                     c->n_keys);
    } else { /* several rows, or the binary16 op where the backend has none (the model's call then) */
        ops->indexer_scores_rows(be, c->q, c->w, scale, c->heads, c->dim, keys, c->counts, c->rows, c->scores,
                                 c->n_keys);
    }
}

/* Seeded values rounded to binary16 (the indexer's rows and queries under
 * DS4 numerics are binary16 values: the QAT's FP4 codes times powers of
 * two), uploaded to dst. */
static bool upload_seeded_f16(ds4_backend *be, float *dst, int64_t n, uint64_t seed) {
    float *h = malloc((size_t)n * sizeof *h);
    if (!h) return false;
    uint64_t x = seed * 0xD1B54A32D192ED03ULL + 1;
    for (int64_t i = 0; i < n; i++) h[i] = ds4_f16_to_f32(ds4_f32_to_f16((float)(2.0 * bench_rng_uniform(&x) - 1.0)));
    be->ops->upload(be, dst, h, n);
    free(h);
    return true;
}

/* The indexer's key rows rotate over copies of --rotate-mib, as dense
 * weights do (a token's 21 selecting layers read theirs from memory); the
 * top-k's scores do not (the indexer has just written them: in the
 * cache), and are the indexer's own scores of seeded rows, so that the
 * select passes meet the real clustering of their digits. */
static void run_select(bench_ops *b, op_result *r) {
    const op_spec *sp = r->spec;
    ds4_backend *be = b->be;
    select_ctx c = { 0 };
    c.be = be;
    c.kind = sp->kind;
    c.n_keys = r->keys;
    c.rows = r->rows;
    c.heads = 64;
    c.dim = 128;
    c.k = TOP_K;
    for (int64_t i = 0; i < c.rows; i++) c.counts[i] = c.n_keys;
    const double key_bytes = (double)c.n_keys * (double)c.dim * 4.0;
    const bool topk = sp->kind == OP_TOPK;
    rotate_copies(b, r, topk ? 0.0 : key_bytes);
    if (topk) r->bytes = (double)c.rows * (double)c.n_keys * 4.0 + (double)c.rows * (double)c.k * 4.0;
    else r->bytes = key_bytes + (double)c.rows * ((double)c.heads * (c.dim + 1) + (double)c.n_keys) * 4.0;
    int64_t made = 0;
    const int64_t n_copies = topk ? 1 : r->copies; /* top_k: one copy, for its scores */
    c.keys = calloc((size_t)n_copies, sizeof *c.keys);
    c.q = be->ops->alloc(be, c.rows * c.heads * c.dim);
    c.w = be->ops->alloc(be, c.rows * c.heads);
    c.scores = be->ops->alloc(be, c.rows * c.n_keys);
    c.idx = topk ? (int32_t *)be->ops->alloc(be, c.rows * c.k) : NULL;
    bool ok = c.keys && c.q && c.w && c.scores && (!topk || c.idx);
    for (; ok && made < n_copies; made++) {
        c.keys[made] = be->ops->alloc(be, c.n_keys * c.dim);
        ok = c.keys[made] && upload_seeded_f16(be, c.keys[made], c.n_keys * c.dim, b->o.seed + 11 + (uint64_t)made);
        if (!c.keys[made]) break;
    }
    if (!ok || !upload_seeded_f16(be, c.q, c.rows * c.heads * c.dim, b->o.seed + 4) ||
        !upload_seeded(be, c.w, c.rows * c.heads, b->o.seed + 5)) {
        snprintf(r->skipped, REASON, "out of memory for %lld key rows (%lld copies) and the queries",
                 (long long)c.n_keys, (long long)n_copies);
        goto done;
    }
    c.copies = n_copies;
    if (topk) { /* the scores to rank: the indexer's of the seeded rows */
        c.kind = OP_INDEXER;
        select_call(&c, 0);
        c.kind = OP_TOPK;
    }
    if (setup_failed(be, r)) goto done;
    take_samples(b, r, select_call, &c, c.scores);
done:
    for (int64_t i = 0; i < made; i++)
        if (c.keys[i]) be->ops->free(be, c.keys[i]);
    free(c.keys);
    float *bufs[4] = { c.q, c.w, c.scores, (float *)c.idx };
    for (int i = 0; i < 4; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    ds4_error err = { 0 };
    be->ops->take_error(be, &err);
}

typedef struct small_ctx {
    float *out, *x, *post, *comb;
    const ds4_weight *fn, *scale, *base, *norm;
    ds4_hc hc;
    int64_t rows, dim;
    ds4_backend *be;
} small_ctx;

static void small_call(void *p, int64_t call) {
    small_ctx *c = p;
    if (c->fn) c->be->ops->hc_pre(c->be, &c->hc, c->x, c->fn, c->scale, c->base, c->out, c->post, c->comb, c->rows);
    else c->be->ops->rmsnorm(c->be, c->x, c->norm, 1e-6f, c->out, c->rows, c->dim);
}

/* hc_pre (state [rows, n_in], fn [n_in, n_out] F16, 4 streams) or rmsnorm
 * (rows of n_in); 256 calls a step, weights bound once (they are small). */
static void run_small(bench_ops *b, op_result *r) {
    const op_spec *sp = r->spec;
    ds4_backend *be = b->be;
    const bool hc = sp->kind == OP_HC_PRE;
    const int n_hc = 4;
    int64_t rb_fn = 0, rb_v = 0;
    uint8_t *h_fn = make_rows(sp->type, r->n_in, r->n_out, b->o.seed, &rb_fn, r->skipped);
    uint8_t *h_v = h_fn ? make_rows(DS4_TYPE_F32, r->n_out, 1, b->o.seed + 5, &rb_v, r->skipped) : NULL;
    ds4_weight fn, scale, base;
    bool bf = false, bs = false, bb = false;
    small_ctx c = { 0 };
    ds4_error err = { 0 };
    if (!h_v) goto done;
    c.be = be;
    c.rows = r->rows;
    c.dim = r->n_in;
    r->copies = 1;
    r->calls = 256;
    weight_init(&fn, hc ? "hc_attn_fn" : "attn_norm", sp->type, r->n_in, r->n_out, 1, rb_fn, h_fn);
    weight_init(&scale, "hc_attn_scale", DS4_TYPE_F32, 3, 1, 1, 12, h_v);
    weight_init(&base, "hc_attn_base", DS4_TYPE_F32, r->n_out, 1, 1, rb_v, h_v);
    if (!(bf = !be->ops->bind_weight(be, &fn, &err)) || (hc && !(bs = !be->ops->bind_weight(be, &scale, &err))) ||
        (hc && !(bb = !be->ops->bind_weight(be, &base, &err)))) {
        snprintf(r->skipped, REASON, "binding the weights: %s", err.message);
        goto done;
    }
    if (hc) {
        c.fn = &fn, c.scale = &scale, c.base = &base;
        c.hc.n_hc = n_hc;
        c.hc.dim = r->n_in / n_hc;
        c.hc.iters = 20;
        c.hc.eps = 1e-6f;
        c.hc.norm_eps = 1e-6f;
    } else {
        c.norm = &fn;
    }
    /* the weights once per call (small: they stay in the cache), the state
     * read and the result written */
    r->bytes = (double)rb_fn * r->n_out + (double)r->rows * r->n_in * 4 * (hc ? 1.25 : 2.0);
    c.x = be->ops->alloc(be, r->rows * r->n_in);
    c.out = be->ops->alloc(be, r->rows * r->n_in);
    c.post = be->ops->alloc(be, r->rows * n_hc);
    c.comb = be->ops->alloc(be, r->rows * n_hc * n_hc);
    if (!c.x || !c.out || !c.post || !c.comb || !upload_seeded(be, c.x, r->rows * r->n_in, b->o.seed + 3)) {
        snprintf(r->skipped, REASON, "out of memory for the activations");
        goto done;
    }
    if (setup_failed(be, r)) goto done;
    take_samples(b, r, small_call, &c, c.out);
done:
    if (bf) be->ops->release_weight(be, &fn);
    if (bs) be->ops->release_weight(be, &scale);
    if (bb) be->ops->release_weight(be, &base);
    float *bufs[4] = { c.x, c.out, c.post, c.comb };
    for (int i = 0; i < 4; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    free(h_fn);
    free(h_v);
    be->ops->take_error(be, &err);
}

typedef struct fill_ctx {
    float *out;
    int64_t rows;
    ds4_backend *be;
} fill_ctx;

static void fill_call(void *p, int64_t call) {
    fill_ctx *c = p;
    c->be->ops->fill(c->be, c->out, (float)call, c->rows);
}

/* The cost of an op that does nearly nothing (a fill of `rows` floats),
 * 256 calls a step: what any kernel of a step costs at least. */
static void run_fill(bench_ops *b, op_result *r) {
    fill_ctx c = { NULL, r->rows, b->be };
    r->copies = 1;
    r->calls = 256;
    r->bytes = (double)r->rows * 4;
    c.out = b->be->ops->alloc(b->be, r->rows);
    if (!c.out) snprintf(r->skipped, REASON, "out of memory for %lld floats", (long long)r->rows);
    else if (!setup_failed(b->be, r)) take_samples(b, r, fill_call, &c, c.out);
    if (c.out) b->be->ops->free(b->be, c.out);
    ds4_error err = { 0 };
    b->be->ops->take_error(b->be, &err);
}

/* ------------------------------------------------------------ output */

static double gbps_of(const op_result *r) { return r->st.n && r->st.median > 0 ? r->bytes / r->st.median / 1e9 : NAN; }

static void write_md(FILE *f, const bench_ops *b) {
    fprintf(f, "| product | weight | shape (in x out) | rows | us/call (median) | p95 | GB/s | of bandwidth |\n");
    fprintf(f, "|---|---|---|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < b->n_res; i++) {
        const op_result *r = &b->res[i];
        const op_spec *sp = r->spec;
        char type[48], shape[64];
        if (sp->kind == OP_MOE)
            snprintf(type, sizeof type, "%s/%s", ds4_type_name(sp->type), ds4_type_name(sp->down_type));
        else snprintf(type, sizeof type, "%s", ds4_type_name(sp->type));
        if (sp->kind == OP_MOE)
            snprintf(shape, sizeof shape, "%lldx%lld, %d of %lld", (long long)r->n_in, (long long)r->n_out, MOE_USED,
                     (long long)r->experts);
        else if (sp->kind == OP_TOPK)
            snprintf(shape, sizeof shape, "%lld of %lld", (long long)r->n_out, (long long)r->keys);
        else if (sp->kind == OP_INDEXER || sp->kind == OP_INDEXER_F16)
            snprintf(shape, sizeof shape, "%lld heads x %lld, %lld keys", (long long)r->n_out, (long long)r->n_in,
                     (long long)r->keys);
        else if (sp->n_groups > 1)
            snprintf(shape, sizeof shape, "%lld x (%lldx%lld)", (long long)sp->n_groups, (long long)r->n_in,
                     (long long)r->n_out);
        else snprintf(shape, sizeof shape, "%lldx%lld", (long long)r->n_in, (long long)r->n_out);
        if (r->skipped[0]) {
            fprintf(f, "| %s | %s | %s | %lld | skipped: %s | | | |\n", sp->name, type, shape, (long long)r->rows,
                    r->skipped);
            continue;
        }
        const double g = gbps_of(r);
        fprintf(f, "| %s | %s | %s | %lld | %.2f | %.2f | %.0f | ", sp->name, type, shape, (long long)r->rows,
                r->st.median * 1e6, r->st.p95 * 1e6, g);
        if (b->bw_gbps > 0 && isfinite(g)) fprintf(f, "%.0f%% |\n", 100.0 * g / b->bw_gbps);
        else fprintf(f, "- |\n");
    }
    if (b->bw_gbps > 0)
        fprintf(f, "\nbandwidth: %.1f GB/s (%s)\n", b->bw_gbps,
                b->o.bandwidth > 0 ? "given" : "measured: backend copy op, best of 5");
    else if (b->bw_reason[0]) fprintf(f, "\nbandwidth: not measured (%s)\n", b->bw_reason);
}

static int write_json(const bench_ops *b, const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) return tool_fail(CMD, "%s: %s", path, strerror(errno));
    const char *commit = getenv("DS4_BENCH_COMMIT");
    fprintf(f, "{\n  \"schema\": \"%s\",\n  \"backend\": ", SCHEMA);
    bench_json_str(f, b->o.backend);
    fprintf(f, ",\n  \"numerics\": \"%s\",\n  \"div\": %lld,\n  \"rotate_mib\": %lld,\n  \"commit\": ",
            b->o.num == DS4_NUMERICS_DS4 ? "ds4" : "reference", (long long)b->o.div, (long long)b->o.rotate_mib);
    if (commit && *commit) bench_json_str(f, commit);
    else fputs("null", f);
    fputs(",\n  \"bandwidth\": {\"gbps\": ", f);
    bench_json_num(f, b->bw_gbps > 0 ? b->bw_gbps : NAN);
    fputs(", \"source\": ", f);
    fputs(b->o.bandwidth > 0 ? "\"given\"" : b->bw_measured ? "\"measured\"" : "null", f);
    fputs(", \"samples\": ", f);
    bench_json_samples(f, &b->bw_samples);
    fputs(", \"reason\": ", f);
    if (b->bw_gbps > 0 || !b->bw_reason[0]) fputs("null", f);
    else bench_json_str(f, b->bw_reason);
    fputs("},\n  \"ops\": [", f);
    for (int i = 0; i < b->n_res; i++) {
        const op_result *r = &b->res[i];
        const op_spec *sp = r->spec;
        fprintf(f, "%s\n    {\"name\": ", i ? "," : "");
        bench_json_str(f, sp->name);
        fprintf(f, ", \"kind\": \"%s\", \"type\": \"%s\"", KIND_NAMES[sp->kind], ds4_type_name(sp->type));
        if (r->keys) fprintf(f, ", \"keys\": %lld", (long long)r->keys);
        if (sp->kind == OP_MOE) {
            fprintf(f, ", \"down_type\": \"%s\", \"used\": %d, \"experts_read\": ", ds4_type_name(sp->down_type),
                    MOE_USED);
            bench_json_num(f, r->experts_read);
        }
        fprintf(f, ", \"n_in\": %lld, \"n_out\": %lld, \"groups\": %lld, \"experts\": %lld, \"rows\": %lld",
                (long long)r->n_in, (long long)r->n_out, (long long)sp->n_groups, (long long)r->experts,
                (long long)r->rows);
        fprintf(f, ", \"copies\": %lld, \"calls\": %lld, \"bytes\": ", (long long)r->copies, (long long)r->calls);
        bench_json_num(f, r->bytes);
        if (r->skipped[0]) {
            fputs(", \"skipped\": ", f);
            bench_json_str(f, r->skipped);
            fputc('}', f);
            continue;
        }
        fprintf(f, ", \"timing\": \"%s\", \"per_call\": {", r->timing);
        bench_json_stats_s(f, &r->st);
        fputs(", \"samples_s\": ", f);
        bench_json_samples(f, &r->samples);
        fputs("}, \"gbps\": ", f);
        bench_json_num(f, gbps_of(r));
        fputs(", \"of_bandwidth\": ", f);
        bench_json_num(f, b->bw_gbps > 0 ? gbps_of(r) / b->bw_gbps : NAN);
        fputc('}', f);
    }
    fputs("\n  ]\n}\n", f);
    if (fclose(f)) return tool_fail(CMD, "%s: write failed", path);
    return 0;
}

/* ------------------------------------------------------------ main */

int bench_ops_main(int argc, char **argv) {
    bench_ops b;
    memset(&b, 0, sizeof b);
    int rc = parse_opts(argc, argv, &b.o);
    if (rc) {
        if (rc < 0) {
            print_help();
            return 0;
        }
        return rc;
    }
    const opts *o = &b.o;
    const char *outs[2] = { o->json, o->md };
    for (int i = 0; i < 2; i++) {
        FILE *probe = outs[i] ? fopen(outs[i], "a") : NULL;
        if (outs[i] && !probe) return tool_fail(CMD, "%s: %s", outs[i], strerror(errno));
        if (probe) fclose(probe);
    }
    ds4_error err = { 0 };
    if (ds4_backend_create(o->backend, (int)o->threads, &b.be, &err)) return tool_fail(CMD, "%s", err.message);
    b.res = calloc((size_t)N_SPECS * (size_t)o->n_rows * (size_t)o->n_keys, sizeof *b.res);
    if (!b.res) {
        ds4_backend_destroy(b.be);
        return tool_fail(CMD, "out of memory");
    }
    for (int s = 0; s < N_SPECS; s++) {
        const op_spec *sp = &SPECS[s];
        if (!only_names(o->only, sp->name)) continue;
        const bool select = sp->kind == OP_INDEXER || sp->kind == OP_INDEXER_F16 || sp->kind == OP_TOPK;
        for (int kk = 0; kk < (select ? o->n_rows * o->n_keys : o->n_rows); kk++) {
            const int k = select ? kk / o->n_keys : kk;
            op_result *r = &b.res[b.n_res++];
            r->spec = sp;
            r->rows = o->rows[k];
            if (select) {
                r->keys = o->keys[kk % o->n_keys] / o->div;
                if (r->keys < 1) r->keys = 1;
            }
            /* widths that are a product's input stay whole 256-blocks of every type */
            r->n_in = sp->n_in / o->div > 256 ? sp->n_in / o->div : 256;
            r->n_out = sp->n_out / o->div > 0 ? sp->n_out / o->div : 1;
            if (sp->kind == OP_MOE && r->n_out < 256) r->n_out = 256; /* the down product's input */
            if (sp->kind == OP_HC_PRE || sp->kind == OP_RMSNORM || sp->kind == OP_FILL || select)
                r->n_out = sp->n_out; /* mix entries, 1; heads, the selection */
            if (select) r->n_in = sp->kind == OP_TOPK ? r->keys : sp->n_in; /* head dims; scores */
            if (sp->kind == OP_FILL) r->n_in = 1;
            r->experts = sp->kind == OP_MOE ? (MOE_EXPERTS / o->div > MOE_USED ? MOE_EXPERTS / o->div : MOE_USED + 2)
                                            : 0;
            fprintf(stderr, "ds4server " CMD ": %s, %lld row%s", sp->name, (long long)r->rows, r->rows > 1 ? "s" : "");
            if (select) fprintf(stderr, ", %lld keys", (long long)r->keys);
            fputc('\n', stderr);
            if (sp->kind == OP_MOE) run_moe(&b, r);
            else if (select) run_select(&b, r);
            else if (sp->kind == OP_HC_PRE || sp->kind == OP_RMSNORM) run_small(&b, r);
            else if (sp->kind == OP_FILL) run_fill(&b, r);
            else run_dense(&b, r);
        }
    }
    if (o->bandwidth > 0) b.bw_gbps = o->bandwidth;
    else if (bench_copy_bandwidth(b.be, o->bw_mib, 5, &b.bw_samples, b.bw_reason, sizeof b.bw_reason)) {
        for (int64_t i = 0; i < b.bw_samples.n; i++)
            if (b.bw_samples.v[i] > b.bw_gbps) b.bw_gbps = b.bw_samples.v[i];
        b.bw_measured = true;
    }
    write_md(stdout, &b);
    if (o->md) {
        FILE *f = fopen(o->md, "w");
        if (!f) rc = tool_fail(CMD, "%s: %s", o->md, strerror(errno));
        else {
            write_md(f, &b);
            if (fclose(f)) rc = tool_fail(CMD, "%s: write failed", o->md);
        }
    }
    if (o->json && !rc) rc = write_json(&b, o->json);
    int failed = 0;
    for (int i = 0; i < b.n_res; i++) {
        failed += b.res[i].skipped[0] != 0;
        free(b.res[i].samples.v);
    }
    free(b.res);
    free(b.bw_samples.v);
    ds4_backend_destroy(b.be);
    if (!rc && failed && failed == b.n_res) rc = tool_fail(CMD, "every product failed");
    return rc;
}

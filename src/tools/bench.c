/*
 * bench.c - `ds4server bench`: load, prefill, time to first token, steady
 * decode at context frontiers, device counters and the roofline, with an A/B
 * mode that alternates two variants in one run.
 *
 *   ds4server bench -m FILE | --synthetic NAME [--backend cpu|cuda] [--numerics ds4|reference|ds4-f16]
 *                   [--ctx 2048,16384,65536] [--prefill 1,128,512,2048,8192] [--gen 128]
 *                   [--repeat N] [--warmup N] [--ttft 2048] [--threads N] [--seed S]
 *                   [--chunk N] [--json OUT] [--md OUT] [--ab KEY=VALUE | --compare CMD]
 *                   [--bandwidth GBPS | --bandwidth-mib N] [--batch 1,8,32 [--batch-ctx N]]
 *                   [--profile-token N] [--profile-prefill N [--profile-layers FIRST,COUNT]]
 *
 * Protocol (../shared/docs/MEASURING.md): a fixed seeded token sequence,
 * greedy decoding with EOS ignored, warm-up runs first, every figure repeated
 * and reported as median, p95 (nearest rank), min and max of the raw samples,
 * which go to the JSON with the provenance. Every timed evaluation downloads
 * logits to host memory, so it ends with the device idle: host clock times
 * are complete.
 *
 * - Load: gguf_open, then ds4_model_load_progress (for a device backend the
 *   first upload of the weights: bytes bound / seconds = upload GB/s). With
 *   --synthetic NAME (deepseek4-SCALE-QUANT, the layouts of `synth`) there
 *   is no weight file: a GGUF of the layout without weight data goes to
 *   $TMPDIR and the backend makes the weights from --seed where it keeps
 *   them (ds4_model_load_synthetic), so the load time is that of making
 *   them, not of reading a file.
 * - Prefill at each --prefill size: a fresh state per sample, --warmup
 *   untimed runs first, --repeat timed ones.
 * - Time to first token: prefill of --ttft tokens plus the argmax of the last
 *   logits, on a fresh state.
 * - Decode: one state advanced through the --ctx frontiers in order. Before a
 *   frontier the tokens since the previous decode are prefilled in --chunk
 *   batches (timed as the interval's prefill rate); then --warmup x
 *   min(--gen, 8) untimed greedy steps (graphs of the step shapes the
 *   context cycles through are built there) and --gen timed ones (one-token
 *   evaluation + argmax of its logits), one by one, from pos_start. Each row
 *   therefore measures only its new interval. A frontier beyond the
 *   model's context, or one whose state or batch does not fit in memory, is
 *   skipped with the reason.
 * - Counters (ds4_backend_counters_get) around the decode steps give kernel
 *   launches, host<->device copies and bytes and syncs per token; the peak
 *   device memory is read after each frontier.
 * - Roofline: bytes read per decoded token from the tensor table (every
 *   tensor once, routed experts n_expert_used / n_expert of their bytes, one
 *   row of the embedding and of a hash-routing table) and, added, the
 *   attention state read at the position (sliding-window rows, compressed
 *   rows, indexer keys of ratio-4 layers, the top-k rows it selects: an
 *   estimate from the config). Divided by the bandwidth (--bandwidth, else
 *   the backend's copy op timed on a --bandwidth-mib buffer after everything
 *   else, so its buffer never raises the reported peak) it gives the floor;
 *   measured / floor is reported.
 * - A/B (--ab KEY=VALUE, KEY backend|numerics|threads): variant A is the
 *   command line, B the same with KEY changed. --repeat rounds of the decode
 *   at the first frontier and of the prefill at the largest size run in the
 *   order A B B A A B B A ..., and the B/A ratio of tokens/s comes with a
 *   paired 95% confidence interval (Student t on the per-pair log ratios).
 * - Compare (--compare CMD): the same A/B rounds, but A is this binary and B
 *   the command CMD (another build, or this one under other environment
 *   variables), each run as a child `bench` process per sample (one decode
 *   of --gen tokens at the frontier and one prefill, after --warmup untimed
 *   runs), so only one of them holds the model at a time; its --json output
 *   gives the sample. Both record their commit and model fingerprint.
 *
 * Output: a Markdown table on stdout (and --md FILE), the JSON to --json.
 * Progress goes to stderr. Exit status: 0 done, 1 a runtime failure, 2 bad
 * usage. Timings are never judged here.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <sys/wait.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "backends/backend.h"
#include "core/error.h"
#include "core/gguf.h"
#include "core/mapfile.h"
#include "models/deepseek4/ds4_model.h"
#include "models/deepseek4/ds4_synth.h"
#include "session/sampling.h"
#include "tools/bench_util.h"
#include "tools/tools.h"
#ifdef DS4_WITH_CUDA
#include "backends/cuda/cuda_backend.h"
#endif

#define CMD "bench"
#define SCHEMA "ds4server-bench/1"
#define REASON_MAX 640

/* ------------------------------------------------------------ small helpers */

/* Two-sided 95% critical value of Student's t with df degrees of freedom:
 * the x with CDF(x) = 0.975, by bisection on the CDF integrated with
 * Simpson's rule from the density (exact to ~1e-9, plenty for a CI). */
static double t_density(double x, double df, double lnorm) {
    return exp(lnorm - (df + 1) / 2 * log1p(x * x / df));
}

static double t_cdf_pos(double x, double df) {
    const double lnorm = lgamma((df + 1) / 2) - lgamma(df / 2) - 0.5 * log(df * M_PI);
    const int n = 4000; /* even */
    const double h = x / n;
    double s = t_density(0, df, lnorm) + t_density(x, df, lnorm);
    for (int i = 1; i < n; i++) s += (i % 2 ? 4 : 2) * t_density(i * h, df, lnorm);
    return 0.5 + s * h / 3;
}

static double t_crit_975(int64_t df) {
    if (df < 1) return NAN;
    double lo = 0, hi = 20;
    while (t_cdf_pos(hi, (double)df) < 0.975 && hi < 1e6) hi *= 2;
    for (int i = 0; i < 60; i++) {
        double mid = (lo + hi) / 2;
        if (t_cdf_pos(mid, (double)df) < 0.975) lo = mid;
        else hi = mid;
    }
    return (lo + hi) / 2;
}

/* Seeded tokens in [0, V): the same for a given seed on every machine. */
static void fill_tokens(int32_t *t, int64_t n, uint64_t seed, int64_t V) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 0x2545F4914F6CDD1DULL;
    for (int64_t i = 0; i < n; i++) {
        t[i] = (int32_t)(bench_rng_next(&x) % (uint64_t)V);
    }
}

/* One item of a "skipped" list: {"<key>": value, "reason": "..."}, with a
 * separator after the first (*k counts the items written). */
static void json_skipped(FILE *f, int *k, const char *key, long long value, const char *reason) {
    fprintf(f, "%s{\"%s\": %lld, \"reason\": ", (*k)++ ? ", " : "", key, value);
    bench_json_str(f, reason);
    fputc('}', f);
}

/* First line of a command's output (popen), or NULL. */
static char *command_line(const char *cmd, char *buf, size_t cap) {
    FILE *p = popen(cmd, "r");
    if (!p) return NULL;
    char *got = fgets(buf, (int)cap, p);
    int rc = pclose(p);
    if (!got || rc != 0) return NULL;
    buf[strcspn(buf, "\r\n")] = 0;
    return buf[0] ? buf : NULL;
}

/* ------------------------------------------------------------ options */

typedef enum ab_key { AB_NONE, AB_BACKEND, AB_NUMERICS, AB_THREADS, AB_COMMAND } ab_key;
static const char *const AB_KEYS[] = { "", "backend", "numerics", "threads", "command" };

typedef struct opts {
    const char *model, *json, *md;
    const char *synthetic; /* --synthetic NAME: weights made by the backend, no file */
    int64_t syn_layers;    /* --layers N: only the first N layers of its layout (0: all) */
    ds4_scale syn_scale;
    ds4_quant_scheme syn_quant;
    char syn_path[512];    /* the weightless GGUF written for it (removed once open) */
    char model_label[160]; /* what the report calls the model */
    char backend[16];
    ds4_numerics num;
    int64_t ctx[MAX_LIST], prefill[MAX_LIST], batch[MAX_LIST];
    int n_ctx, n_prefill, n_batch;
    int64_t batch_ctx;
    int64_t gen, repeat, warmup, ttft, threads, chunk, bw_mib;
    int64_t profile_token; /* --profile-token N: decoded token N of the first frontier in the profiler range (0: none) */
    int64_t profile_prefill; /* --profile-prefill N: the first timed prefill of N tokens in the profiler range (0: none) */
    int64_t profile_layers[2]; /* --profile-layers FIRST,COUNT: only those layers of it (COUNT 0: all) */
    int n_profile_layers;
    uint64_t seed;
    double bandwidth; /* GB/s given, 0 = measure */
    ab_key ab;
    char ab_value[16];
    ds4_numerics ab_num; /* AB_NUMERICS: B's numerics (ab_value parsed) */
    const char *ab_arg;
    const char *compare; /* --compare CMD: variant B is another ds4server (AB_COMMAND) */
    bool ttft_given, bw_mib_given; /* options --compare does not take */
} opts;

static int usage_error(const char *fmt, const char *arg) { return bench_usage_error(CMD, "bench", fmt, arg); }

static void print_help(void) {
    printf("usage: ds4server bench -m FILE | --synthetic NAME [--backend cpu|cuda] [--numerics ds4|reference|ds4-f16]\n"
           "                       [--ctx 2048,16384,65536] [--prefill 1,128,512,2048,8192] [--gen 128]\n"
           "                       [--repeat N] [--warmup N] [--ttft 2048] [--threads N] [--seed S]\n"
           "                       [--chunk N] [--json OUT] [--md OUT] [--ab KEY=VALUE]\n"
           "                       [--bandwidth GBPS | --bandwidth-mib N] [--batch 1,8,32 [--batch-ctx N]]\n"
           "                       [--profile-token N] [--profile-prefill N [--profile-layers F,N]]\n"
           "                       [--compare CMD]\n"
           "  Measures model load (and the first upload), prefill tokens/s at each --prefill size\n"
           "  (fresh state each sample), time to first token for a --ttft-token prompt (0: skip),\n"
           "  and steady greedy decode of --gen tokens at each --ctx frontier (one state, the gap\n"
           "  between frontiers prefilled in --chunk batches), with kernel launches, host<->device\n"
           "  bytes and syncs per token, peak device memory and the roofline ratio.\n"
           "  --synthetic NAME  no weight file: the backend makes seeded weights (--seed) of the layout\n"
           "                    NAME = deepseek4-tiny|small|full-f32|q8_0|q2|q4 (as `synth` writes it)\n"
           "  --layers N        with --synthetic: only the first N layers of the layout (a full-size model's\n"
           "                    layers on a device too small for all of them; per-layer figures and A/B)\n"
           "  --repeat N        timed samples per figure (default 5); --warmup N untimed runs (default 1;\n"
           "                    decode: N x min(--gen, 8) untimed steps at each frontier)\n"
           "  --batch LIST      batched decode: for each count N, N streams (each prefilled with its own\n"
           "                    --batch-ctx tokens, default 128) decode --gen tokens together, one\n"
           "                    step for all of them; aggregate and per-stream tokens/s, step latency\n"
           "  --profile-token N decoded token N (1 = the first) of the first --ctx frontier runs inside the\n"
           "                    backend's profiler range (CUDA: cudaProfilerStart/Stop), so an external\n"
           "                    profiler started with its capture off times that one step, e.g.\n"
           "                    ncu --profile-from-start off ds4server bench ... --profile-token 2\n"
           "  --profile-prefill N the first timed prefill of N tokens (one of the --prefill sizes) runs\n"
           "                    inside the profiler range, the same way; with --profile-layers F,N only\n"
           "                    its layers F .. F+N-1 (a long prefill has too many kernels to time all)\n"
           "  --bandwidth GBPS  memory bandwidth for the roofline; default: the backend's copy op\n"
           "                    timed on a --bandwidth-mib buffer (default 1024 MiB)\n"
           "  --ab KEY=VALUE    A/B mode: B is the command line with KEY (backend, numerics, threads)\n"
           "                    set to VALUE; --repeat rounds of decode at the first frontier and\n"
           "                    prefill at the largest size, in the order A B B A A B B A ...;\n"
           "                    the B/A ratio of tokens/s with a paired 95%% confidence interval\n"
           "  --compare CMD     A/B mode against another build or configuration: CMD (a shell command\n"
           "                    line that runs a ds4server, e.g. 'env DS4_CUDA_GRAPH=0 ./ds4server' or\n"
           "                    '../old/build/cuda/ds4server') is B, this binary A; each round runs\n"
           "                    `bench` once per variant as a child process (one model in memory at\n"
           "                    a time) for decode at the first frontier and prefill at the largest\n"
           "                    size, in the order A B B A ...; ratio and interval as --ab (a failing\n"
           "                    child run ends it, with its last line of output)\n"
           "  Markdown goes to stdout (and --md FILE), raw samples and provenance to --json OUT.\n"
           "  DS4_BENCH_COMMIT=ID records ID as the commit when git cannot tell.\n"
           "  ds4server bench --ops [...] times the model's weight products one by one (--ops --help).\n");
}

/* "deepseek4-SCALE-QUANT": the layout of `ds4server synth --scale SCALE --quant QUANT`. */
static bool parse_synthetic(const char *v, ds4_scale *scale, ds4_quant_scheme *quant) {
    static const struct { const char *name; ds4_scale scale; } scales[] = {
        { "tiny", DS4_SCALE_TINY }, { "small", DS4_SCALE_SMALL }, { "full", DS4_SCALE_FULL }
    };
    if (strncmp(v, "deepseek4-", 10)) return false;
    for (size_t i = 0; i < sizeof scales / sizeof scales[0]; i++) {
        const size_t n = strlen(scales[i].name);
        if (strncmp(v + 10, scales[i].name, n) || v[10 + n] != '-') continue;
        const int q = ds4_quant_scheme_parse(v + 11 + n);
        if (q < 0) return false;
        *scale = scales[i].scale;
        *quant = (ds4_quant_scheme)q;
        return true;
    }
    return false;
}

/* 0 when parsed, 2 on a usage error (message printed), -1 for --help. */
static int parse_opts(int argc, char **argv, opts *o) {
    memset(o, 0, sizeof *o);
    snprintf(o->backend, sizeof o->backend, "cpu");
    o->num = DS4_NUMERICS_DS4;
    o->gen = 128;
    o->repeat = 5;
    o->warmup = 1;
    o->ttft = 2048;
    o->threads = bench_default_threads();
    o->chunk = 2048;
    o->bw_mib = 1024;
    o->seed = 1;
    o->batch_ctx = 128;
    const int64_t dctx[] = { 2048, 16384, 65536 }, dpre[] = { 1, 128, 512, 2048, 8192 };
    o->n_ctx = 3;
    memcpy(o->ctx, dctx, sizeof dctx);
    o->n_prefill = 5;
    memcpy(o->prefill, dpre, sizeof dpre);
    const int64_t BIG = (int64_t)1 << 30;
    for (int i = 1; i < argc; i++) {
        const char *a, *v;
        const int next = bench_next_option(argc, argv, &i, CMD, "bench", &a, &v);
        if (next) return next;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--synthetic")) {
            if (!parse_synthetic(v, &o->syn_scale, &o->syn_quant))
                return usage_error("--synthetic must be deepseek4-tiny|small|full-f32|q8_0|q2|q4, not '%s'", v);
            o->synthetic = v;
        }
        else if (!strcmp(a, "--json")) o->json = v;
        else if (!strcmp(a, "--md")) o->md = v;
        else if (!strcmp(a, "--backend")) {
            if (!bench_valid_backend(v)) return usage_error("--backend must be cpu or cuda, not '%s'", v);
            snprintf(o->backend, sizeof o->backend, "%s", v);
        } else if (!strcmp(a, "--numerics")) {
            if (!ds4_numerics_parse(v, &o->num))
                return usage_error("--numerics must be " DS4_NUMERICS_NAMES ", not '%s'", v);
        } else if (!strcmp(a, "--ctx")) {
            if (!bench_parse_list(v, 1, BIG, o->ctx, &o->n_ctx))
                return usage_error("--ctx takes a comma-separated list of positive positions, not '%s'", v);
        } else if (!strcmp(a, "--prefill")) {
            if (!bench_parse_list(v, 1, BIG, o->prefill, &o->n_prefill))
                return usage_error("--prefill takes a comma-separated list of positive token counts, not '%s'", v);
        } else if (!strcmp(a, "--batch")) {
            if (!bench_parse_list(v, 1, 4096, o->batch, &o->n_batch))
                return usage_error("--batch takes a comma-separated list of stream counts (1..4096), not '%s'", v);
        } else if (!strcmp(a, "--batch-ctx")) {
            if (!bench_parse_i64(v, 1, BIG, &o->batch_ctx))
                return usage_error("--batch-ctx must be a positive token count, not '%s'", v);
        } else if (!strcmp(a, "--gen")) {
            if (!bench_parse_i64(v, 1, 1000000, &o->gen)) return usage_error("--gen must be 1..1000000, not '%s'", v);
        } else if (!strcmp(a, "--repeat")) {
            if (!bench_parse_i64(v, 1, 100000, &o->repeat)) return usage_error("--repeat must be 1..100000, not '%s'", v);
        } else if (!strcmp(a, "--warmup")) {
            if (!bench_parse_i64(v, 0, 100000, &o->warmup)) return usage_error("--warmup must be 0..100000, not '%s'", v);
        } else if (!strcmp(a, "--ttft")) {
            if (!bench_parse_i64(v, 0, BIG, &o->ttft)) return usage_error("--ttft must be a token count (0: skip), not '%s'", v);
            o->ttft_given = true;
        } else if (!strcmp(a, "--threads")) {
            if (!bench_parse_i64(v, 1, 4096, &o->threads)) return usage_error("--threads must be 1..4096, not '%s'", v);
        } else if (!strcmp(a, "--chunk")) {
            if (!bench_parse_i64(v, 1, BIG, &o->chunk)) return usage_error("--chunk must be a positive token count, not '%s'", v);
        } else if (!strcmp(a, "--bandwidth-mib")) {
            if (!bench_parse_i64(v, 1, 1 << 20, &o->bw_mib)) return usage_error("--bandwidth-mib must be 1..1048576, not '%s'", v);
            o->bw_mib_given = true;
        } else if (!strcmp(a, "--profile-token")) {
            if (!bench_parse_i64(v, 1, 1000000, &o->profile_token))
                return usage_error("--profile-token must be a decoded token 1..1000000, not '%s'", v);
        } else if (!strcmp(a, "--profile-prefill")) {
            if (!bench_parse_i64(v, 1, BIG, &o->profile_prefill))
                return usage_error("--profile-prefill must be a positive token count, not '%s'", v);
        } else if (!strcmp(a, "--profile-layers")) {
            const char *comma = strchr(v, ',');
            char first[32] = "";
            const size_t len = comma ? (size_t)(comma - v) : 0;
            if (len && len < sizeof first) memcpy(first, v, len);
            if (!len || len >= sizeof first || !bench_parse_i64(first, 0, 100000, &o->profile_layers[0]) ||
                !bench_parse_i64(comma + 1, 1, 100000, &o->profile_layers[1]))
                return usage_error("--profile-layers takes FIRST,COUNT (a layer and a positive count), not '%s'", v);
            o->n_profile_layers = 2;
        } else if (!strcmp(a, "--layers")) {
            if (!bench_parse_i64(v, 1, 1000, &o->syn_layers))
                return usage_error("--layers must be a positive layer count, not '%s'", v);
        } else if (!strcmp(a, "--seed")) {
            if (!bench_parse_u64(v, &o->seed)) return usage_error("--seed must be a non-negative integer, not '%s'", v);
        } else if (!strcmp(a, "--bandwidth")) {
            if (!bench_parse_positive(v, &o->bandwidth))
                return usage_error("--bandwidth must be a positive number of GB/s, not '%s'", v);
        } else if (!strcmp(a, "--ab")) {
            const char *eq = strchr(v, '=');
            if (!eq || !eq[1]) return usage_error("--ab takes KEY=VALUE (backend, numerics or threads), not '%s'", v);
            size_t klen = (size_t)(eq - v);
            const char *val = eq + 1;
            o->ab_arg = v;
            if (klen == 7 && !strncmp(v, "backend", 7)) {
                if (!bench_valid_backend(val)) return usage_error("--ab backend= must be cpu or cuda, not '%s'", val);
                o->ab = AB_BACKEND;
            } else if (klen == 8 && !strncmp(v, "numerics", 8)) {
                if (!ds4_numerics_parse(val, &o->ab_num))
                    return usage_error("--ab numerics= must be " DS4_NUMERICS_NAMES ", not '%s'", val);
                o->ab = AB_NUMERICS;
            } else if (klen == 7 && !strncmp(v, "threads", 7)) {
                int64_t t;
                if (!bench_parse_i64(val, 1, 4096, &t)) return usage_error("--ab threads= must be 1..4096, not '%s'", val);
                o->ab = AB_THREADS;
            } else {
                return usage_error("--ab key must be backend, numerics or threads, not '%s'", v);
            }
            snprintf(o->ab_value, sizeof o->ab_value, "%s", val);
        } else if (!strcmp(a, "--compare")) {
            /* spliced into a shell line before bench's arguments: nothing that would end it there */
            size_t n = strlen(v);
            while (n && (v[n - 1] == ' ' || v[n - 1] == '\t')) n--;
            if (!n || strchr(v, '\n') || strchr(v, '\r') || strchr(";&|#\\", v[n - 1]))
                return usage_error("--compare takes the command line of another ds4server, one line that does not "
                                   "end in ; & | # or \\, not '%s'", v);
            o->compare = v;
        } else {
            return usage_error("unknown option '%s'", a);
        }
    }
    if (!o->model == !o->synthetic) return usage_error("give a model: -m FILE or --synthetic NAME (one of them)%s", NULL);
    if (o->syn_layers && !o->synthetic) return usage_error("--layers takes a --synthetic model%s", "");
    if (o->compare && o->ab)
        return usage_error("--compare and --ab are two A/B modes: give one of them%s", NULL);
    if (o->compare && (o->n_batch || o->ttft_given || o->bandwidth > 0 || o->bw_mib_given))
        return usage_error("--compare measures decode and prefill only: not with --batch, --ttft or --bandwidth%s",
                           NULL);
    if (o->compare) o->ab = AB_COMMAND;
    if (o->profile_token && (o->ab || o->profile_token > o->gen))
        return usage_error("--profile-token must name one of the --gen decoded tokens of a sweep (not with --ab)%s",
                           NULL);
    if (o->profile_prefill) {
        bool listed = false;
        for (int i = 0; i < o->n_prefill; i++) listed |= o->prefill[i] == o->profile_prefill;
        if (!listed || o->ab)
            return usage_error("--profile-prefill must name one of the --prefill sizes of a sweep with timed samples "
                               "(not with --ab or --compare)%s", NULL);
    }
    if (o->n_profile_layers && !o->profile_prefill)
        return usage_error("--profile-layers narrows --profile-prefill: give that too%s", NULL);
    const char *bk[2] = { o->backend, o->ab == AB_BACKEND ? o->ab_value : NULL };
    for (int k = 0; k < 2; k++)
        if (bk[k] && !ds4_backend_compiled(bk[k]))
            return usage_error("backend '%s' is not built into this binary (`make cuda` builds build/cuda/ds4server)",
                               bk[k]);
    return 0;
}

/* ------------------------------------------------------------ results */

typedef struct load_info {
    double open_s, weights_s;
    int64_t bytes_bound;     /* from the load progress */
    uint64_t device_weights; /* counters.weight_bytes */
} load_info;

typedef struct variant {
    char backend[16];
    ds4_numerics num;
    int64_t threads;
    ds4_backend *be;
    ds4_model *m;
    bool owns; /* false when sharing A's backend and model */
    load_info load;
} variant;

typedef struct prefill_row {
    int64_t tokens;
    dvec s;
    bool skipped;
    char reason[REASON_MAX];
    ds4_backend_counters c; /* delta of the last sample */
} prefill_row;

/* What a decoded token (or a batched step) cost, from the backend counters. */
typedef struct step_cost {
    double launches, copies, h2d, d2h, syncs, wait_ms;
    double graphs, graph_launches, graph_builds, graph_refusals, node_updates, step_breaks, step_host_ms, graph_gpu_ms;
} step_cost;

/* The counters from a to z divided over `steps`. */
static step_cost step_cost_of(const ds4_backend_counters *a, const ds4_backend_counters *z, double steps) {
    step_cost c;
    c.launches = (double)(z->launches - a->launches) / steps;
    c.copies = (double)(z->copies - a->copies) / steps;
    c.h2d = (double)(z->h2d_bytes - a->h2d_bytes) / steps;
    c.d2h = (double)(z->d2h_bytes - a->d2h_bytes) / steps;
    c.syncs = (double)(z->syncs - a->syncs) / steps;
    c.wait_ms = (double)(z->wait_ns - a->wait_ns) / 1e6 / steps;
    c.graphs = (double)(z->graphs - a->graphs) / steps;
    c.graph_launches = (double)(z->graph_launches - a->graph_launches) / steps;
    c.graph_builds = (double)(z->graph_builds - a->graph_builds) / steps;
    c.graph_refusals = (double)(z->graph_refusals - a->graph_refusals) / steps;
    c.node_updates = (double)(z->node_updates - a->node_updates) / steps;
    c.step_breaks = (double)(z->step_breaks - a->step_breaks) / steps;
    c.step_host_ms = (double)(z->step_host_ns - a->step_host_ns) / 1e6 / steps;
    c.graph_gpu_ms = (double)(z->graph_gpu_ns - a->graph_gpu_ns) / 1e6 / steps;
    return c;
}

static void json_step_cost(FILE *f, const step_cost *c) {
    const struct { const char *key; double v; } k[] = {
        { "launches", c->launches }, { "copies", c->copies }, { "h2d_bytes", c->h2d }, { "d2h_bytes", c->d2h },
        { "syncs", c->syncs }, { "wait_ms", c->wait_ms }, { "graphs", c->graphs },
        { "graph_launches", c->graph_launches }, { "graph_builds", c->graph_builds }, { "graph_refusals", c->graph_refusals }, { "node_updates", c->node_updates }, { "step_breaks", c->step_breaks },
        { "step_host_ms", c->step_host_ms }, { "graph_gpu_ms", c->graph_gpu_ms },
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        fprintf(f, "%s\"%s\": ", i ? ", " : "{", k[i].key);
        bench_json_num(f, k[i].v);
    }
    fputc('}', f);
}

typedef struct decode_row {
    int64_t ctx, pos_start, interval_tokens;
    double interval_s;
    dvec s;
    bool skipped;
    char reason[REASON_MAX];
    step_cost pt; /* per token */
    uint64_t peak;
    double kv_bytes; /* estimate at the middle of the decode run */
} decode_row;

typedef struct batch_row {
    int64_t streams;
    dvec s; /* seconds per batched step */
    bool skipped;
    char reason[REASON_MAX];
    step_cost ps; /* per step */
    uint64_t peak;
} batch_row;

typedef struct ab_result {
    int64_t size;
    bool skipped;
    char reason[REASON_MAX];
    char *order;    /* "ABBA..." */
    dvec seconds;   /* in executed order */
    dvec tps;       /* in executed order */
    dvec log_ratio; /* per round: log(tps_B / tps_A) */
    double ratio, lo, hi, t_crit;
} ab_result;

#define KERNELS_MAX 48 /* rows of the kernel table */

typedef struct bench {
    opts o;
    gguf_file *f;
    const ds4_config *cfg;
    int32_t *tokens;
    int64_t n_tokens;
    float *logits;
    variant var[2];
    int n_var;
    prefill_row prefill[MAX_LIST];
    bool ttft_run;
    char ttft_reason[REASON_MAX];
    dvec ttft;
    decode_row decode[MAX_LIST];
    batch_row batch[MAX_LIST];
    uint64_t peak; /* before the bandwidth buffers */
    double weights_bytes, dense_bytes, expert_bytes_tok, expert_bytes_all, embd_row_bytes;
    double bw_gbps;
    bool bw_measured;
    char bw_reason[REASON_MAX];
    dvec bw_samples;
    int64_t bw_bytes;
    ab_result ab_dec, ab_pre;
    /* --compare: the config read from the file (no model is loaded here),
     * each variant's command, and the commit and model fingerprint its
     * first run reported */
    ds4_config cfg_file;
    char *cmd[2];
    char *model_abs; /* the model file's absolute path (a child may start elsewhere) */
    char cmp_commit[2][64], cmp_fingerprint[2][24];
    /* device time per kernel over the last frontier's decode (kernel timing on) */
    ds4_kernel_time kernels[KERNELS_MAX];
    int n_kernels, n_kernels_all;
    int64_t kernels_ctx, kernels_tokens;
} bench;

/* ------------------------------------------------------------ roofline */

static bool gstr_contains(gguf_str s, const char *x) {
    size_t n = strlen(x);
    for (uint64_t i = 0; i + n <= s.len; i++)
        if (!memcmp(s.ptr + i, x, n)) return true;
    return false;
}

static void weight_bytes_per_token(bench *b) {
    const ds4_config *c = b->cfg;
    for (uint64_t i = 0; i < b->f->n_tensors; i++) {
        const gguf_tensor *t = &b->f->tensors[i];
        const double bytes = (double)t->n_bytes;
        if (gstr_contains(t->name, "ffn_gate_exps") || gstr_contains(t->name, "ffn_up_exps") ||
            gstr_contains(t->name, "ffn_down_exps")) {
            b->expert_bytes_all += bytes;
            b->expert_bytes_tok += bytes * c->n_expert_used / (c->n_expert > 0 ? c->n_expert : 1);
        } else if (gstr_contains(t->name, "token_embd") || gstr_contains(t->name, "tid2eid")) {
            /* one row per token: the last dimension counts the rows */
            uint64_t rows = t->n_dims > 1 ? t->ne[t->n_dims - 1] : 1;
            b->embd_row_bytes += bytes / (double)(rows ? rows : 1);
        } else {
            b->dense_bytes += bytes;
        }
    }
    b->weights_bytes = b->dense_bytes + b->expert_bytes_tok + b->embd_row_bytes;
}

/* Attention state read by one decode step at position p (p + 1 rows seen):
 * float32 window rows, compressed rows (all of them, or the top-k chosen by
 * the indexer on ratio-4 layers) and the indexer keys it scores. */
static double kv_bytes_at(const ds4_config *c, int64_t p) {
    const double D = (double)c->head_dim, id = (double)c->idx_head_dim;
    const int64_t n = p + 1;
    double bytes = 0;
    for (int l = 0; l < c->n_layer; l++) {
        int64_t w = n < c->sliding_window ? n : c->sliding_window;
        bytes += (double)w * D * 4;
        const int r = c->compress_ratio[l];
        if (!r) continue;
        const int64_t rows = n / r;
        if (r == 4) {
            bytes += (double)rows * id * 4;
            bytes += (double)(rows < c->idx_top_k ? rows : c->idx_top_k) * D * 4;
        } else {
            bytes += (double)rows * D * 4;
        }
    }
    return bytes;
}

/* ------------------------------------------------------------ measurements */

static void load_progress(void *ctx, int64_t done, int64_t total) {
    load_info *li = ctx;
    li->bytes_bound = total > done ? total : done;
}

static int load_variant(bench *b, variant *v) {
    ds4_error err = { 0 };
    if (ds4_backend_create(v->backend, (int)v->threads, &v->be, &err))
        return tool_fail(CMD, "backend %s: %s", v->backend, err.message);
    v->owns = true;
    double t0 = tool_now();
    const ds4_status st = b->o.synthetic
                              ? ds4_model_load_synthetic(b->f, v->be, b->o.seed, load_progress, &v->load, &v->m, &err)
                              : ds4_model_load_progress(b->f, v->be, load_progress, &v->load, &v->m, &err);
    if (st) return tool_fail(CMD, "loading %s on %s: %s", b->o.model_label, v->backend, err.message);
    v->load.weights_s = tool_now() - t0;
    ds4_backend_counters c;
    ds4_backend_counters_get(v->be, &c);
    v->load.device_weights = c.weight_bytes;
    /* results go to stderr as they come, so a run cut short still says something */
    fprintf(stderr, "ds4server bench:   weights bound in %.3f s (%.2f GiB on the device)\n", v->load.weights_s,
            (double)c.weight_bytes / 1073741824.0);
    return 0;
}

/* Runtime failure (1) unless the error is a lack of memory, which is recorded
 * as the reason for a skip (0). */
static int skip_or_fail(const ds4_error *err, const char *what, char *reason) {
    if (err->status == DS4_ERR_NOMEM) {
        snprintf(reason, REASON_MAX, "%s: %s", what, err->message);
        fprintf(stderr, "ds4server bench: skipped %s: %s\n", what, err->message);
        return 0;
    }
    return tool_fail(CMD, "%s: %s", what, err->message);
}

/* Evaluate tok[0, n) on st in batches of chunk; logits of the last. */
static ds4_status eval_range_on(bench *b, variant *v, ds4_state *st, const int32_t *tok, int64_t n, ds4_error *err) {
    for (int64_t p = 0; p < n;) {
        int64_t len = n - p < b->o.chunk ? n - p : b->o.chunk;
        ds4_status s = ds4_model_eval(v->m, st, tok + p, len, v->num, b->logits, false, err);
        if (s) return s;
        p += len;
    }
    return DS4_OK;
}

/* Evaluate tokens[from, to) on st in batches of chunk; logits of the last. */
static ds4_status eval_range(bench *b, variant *v, ds4_state *st, int64_t from, int64_t to, ds4_error *err) {
    return eval_range_on(b, v, st, b->tokens + from, to - from, err);
}

/* One prefill of n tokens on a fresh state, its seconds into *secs. With
 * pick, the argmax of the last logits is inside the timing (TTFT). */
static ds4_status time_prefill(bench *b, variant *v, int64_t n, bool pick, double *secs, ds4_error *err) {
    ds4_state *st = NULL;
    ds4_status s = ds4_state_create(v->m, n + 1, &st, err);
    if (s) return s;
    double t0 = tool_now();
    if (pick) { /* the first token picked by the backend: only its id comes back */
        int32_t tok = 0;
        s = ds4_model_eval_greedy(v->m, st, b->tokens, n, v->num, &tok, err);
    } else {
        s = ds4_model_eval(v->m, st, b->tokens, n, v->num, b->logits, false, err);
    }
    *secs = tool_now() - t0;
    ds4_state_free(st);
    return s;
}

static void counters_delta(const ds4_backend_counters *a, const ds4_backend_counters *z, ds4_backend_counters *d) {
    d->launches = z->launches - a->launches;
    d->copies = z->copies - a->copies;
    d->h2d_bytes = z->h2d_bytes - a->h2d_bytes;
    d->d2h_bytes = z->d2h_bytes - a->d2h_bytes;
    d->syncs = z->syncs - a->syncs;
    d->weight_bytes = z->weight_bytes;
    d->peak_bytes = z->peak_bytes;
}

static int run_prefill(bench *b) {
    variant *v = &b->var[0];
    bool profiled = false; /* --profile-prefill: one sample only, even when the size is listed twice */
    for (int i = 0; i < b->o.n_prefill; i++) {
        prefill_row *r = &b->prefill[i];
        r->tokens = b->o.prefill[i];
        if ((uint64_t)r->tokens > b->cfg->context_length) {
            r->skipped = true;
            snprintf(r->reason, REASON_MAX, "beyond the model's context of %llu",
                     (unsigned long long)b->cfg->context_length);
            continue;
        }
        fprintf(stderr, "ds4server bench: prefill %lld tokens\n", (long long)r->tokens);
        ds4_error err = { 0 };
        double secs;
        ds4_status s = DS4_OK;
        for (int64_t w = 0; w < b->o.warmup && !s; w++) s = time_prefill(b, v, r->tokens, false, &secs, &err);
        for (int64_t k = 0; k < b->o.repeat && !s; k++) {
            ds4_backend_counters c0, c1;
            ds4_backend_counters_get(v->be, &c0);
            const bool prof = !profiled && r->tokens == b->o.profile_prefill;
            profiled |= prof;
            const bool by_layer = prof && b->o.n_profile_layers; /* the model opens and closes the range */
            if (by_layer) ds4_model_set_profile_layers(v->m, (int)b->o.profile_layers[0], (int)b->o.profile_layers[1]);
            else if (prof) ds4_backend_profiler_range(v->be, true);
            s = time_prefill(b, v, r->tokens, false, &secs, &err);
            if (by_layer) ds4_model_set_profile_layers(v->m, 0, 0);
            else if (prof) ds4_backend_profiler_range(v->be, false);
            ds4_backend_counters_get(v->be, &c1);
            if (!s && !bench_dvec_push(&r->s, secs)) return tool_fail(CMD, "out of memory");
            if (!s)
                fprintf(stderr, "ds4server bench:   %.4f s, %.1f tokens/s\n", secs, (double)r->tokens / secs);
            counters_delta(&c0, &c1, &r->c);
        }
        if (s) {
            char what[64];
            snprintf(what, sizeof what, "prefill of %lld tokens", (long long)r->tokens);
            if (skip_or_fail(&err, what, r->reason)) return 1;
            r->skipped = true;
            r->s.n = 0;
        }
    }
    if (b->o.ttft > 0) {
        if ((uint64_t)b->o.ttft > b->cfg->context_length) {
            snprintf(b->ttft_reason, REASON_MAX, "beyond the model's context of %llu",
                     (unsigned long long)b->cfg->context_length);
            return 0;
        }
        fprintf(stderr, "ds4server bench: time to first token, %lld-token prompt\n", (long long)b->o.ttft);
        ds4_error err = { 0 };
        double secs;
        ds4_status s = DS4_OK;
        for (int64_t w = 0; w < b->o.warmup && !s; w++) s = time_prefill(b, v, b->o.ttft, true, &secs, &err);
        for (int64_t k = 0; k < b->o.repeat && !s; k++) {
            s = time_prefill(b, v, b->o.ttft, true, &secs, &err);
            if (!s && !bench_dvec_push(&b->ttft, secs)) return tool_fail(CMD, "out of memory");
            if (!s) fprintf(stderr, "ds4server bench:   %.4f s\n", secs);
        }
        if (s) {
            if (skip_or_fail(&err, "time to first token", b->ttft_reason)) return 1;
            b->ttft.n = 0;
            return 0;
        }
        b->ttft_run = true;
    } else {
        snprintf(b->ttft_reason, REASON_MAX, "not asked (--ttft 0)");
    }
    return 0;
}

/* Untimed decode steps at each frontier before its samples: --warmup x
 * min(--gen, 8) (8 covers the ratio-4 compressors' cycle of step shapes). */
static int64_t frontier_warmup(const opts *o) { return o->warmup * (o->gen < 8 ? o->gen : 8); }

/* n greedy steps from *next on st (*next is then the token after them):
 * per-token seconds into d (may be NULL), the total into *total; step
 * `profile` (1-based, 0: none) runs inside the backend's profiler range (its
 * time, and the two waits for the device around it, count in the samples
 * like any step's). Each step is ds4_model_eval_greedy: the backend picks
 * the token and only its id comes back. */
static ds4_status decode_steps(bench *b, variant *v, ds4_state *st, int32_t *next, int64_t n, dvec *d, double *total,
                               int64_t profile, ds4_error *err) {
    double sum = 0;
    for (int64_t g = 0; g < n; g++) {
        if (g + 1 == profile) ds4_backend_profiler_range(v->be, true);
        double t0 = tool_now();
        const int32_t tok = *next;
        ds4_status s = ds4_model_eval_greedy(v->m, st, &tok, 1, v->num, next, err);
        if (g + 1 == profile) ds4_backend_profiler_range(v->be, false);
        if (s) return s;
        double dt = tool_now() - t0;
        sum += dt;
        if (d && !bench_dvec_push(d, dt)) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for samples");
    }
    if (total) *total = sum;
    return DS4_OK;
}

static int run_decode(bench *b) {
    variant *v = &b->var[0];
    const int64_t gen = b->o.gen;
    const int64_t fwarm = frontier_warmup(&b->o);
    int last = -1; /* the last frontier that fits the model's context */
    for (int i = 0; i < b->o.n_ctx; i++) {
        decode_row *r = &b->decode[i];
        r->ctx = b->o.ctx[i];
        if ((uint64_t)(r->ctx + fwarm + gen) > b->cfg->context_length) {
            r->skipped = true;
            snprintf(r->reason, REASON_MAX, "%lld + %lld decoded tokens exceed the model's context of %llu",
                     (long long)r->ctx, (long long)(fwarm + gen), (unsigned long long)b->cfg->context_length);
        } else {
            last = i;
        }
    }
    ds4_error err = { 0 };
    /* one state for every frontier that fits; drop the largest while memory lacks */
    ds4_state *st = NULL;
    while (last >= 0) {
        ds4_status s = ds4_state_create(v->m, b->decode[last].ctx + fwarm + gen, &st, &err);
        if (!s) break;
        if (err.status != DS4_ERR_NOMEM) return tool_fail(CMD, "decode state: %s", err.message);
        decode_row *r = &b->decode[last];
        r->skipped = true;
        snprintf(r->reason, REASON_MAX, "state for %lld positions: %s", (long long)(r->ctx + fwarm + gen),
                 err.message);
        fprintf(stderr, "ds4server bench: skipped frontier %lld: %s\n", (long long)r->ctx, err.message);
        last--;
    }
    int64_t pos = 0;
    int32_t next = b->tokens[0];
    bool dead = false, profile_first = true;
    for (int i = 0; i <= last; i++) {
        decode_row *r = &b->decode[i];
        if (r->skipped) continue;
        if (dead) {
            r->skipped = true;
            snprintf(r->reason, REASON_MAX, "an earlier frontier ran out of memory");
            continue;
        }
        fprintf(stderr, "ds4server bench: decode at %lld\n", (long long)r->ctx);
        ds4_status s = DS4_OK;
        r->interval_tokens = r->ctx > pos ? r->ctx - pos : 0;
        double t0 = tool_now();
        if (r->interval_tokens) {
            s = eval_range(b, v, st, pos, r->ctx, &err);
            if (!s) next = ds4_sample_argmax(b->logits, b->cfg->n_vocab);
        }
        r->interval_s = tool_now() - t0;
        pos += r->interval_tokens;
        /* untimed steps at the frontier first: the graphs of the step shapes
         * this context cycles through are built there, not in the samples */
        if (!s && fwarm) s = decode_steps(b, v, st, &next, fwarm, NULL, NULL, 0, &err);
        if (!s) pos += fwarm;
        r->pos_start = pos;
        ds4_backend_counters c0, c1;
        ds4_backend_kernel_times_reset(v->be);
        ds4_backend_counters_get(v->be, &c0);
        if (!s) s = decode_steps(b, v, st, &next, gen, &r->s, NULL, profile_first ? b->o.profile_token : 0, &err);
        profile_first = false;
        ds4_backend_counters_get(v->be, &c1);
        if (!s) {
            const int nk = ds4_backend_kernel_times(v->be, b->kernels, KERNELS_MAX);
            if (nk > 0) {
                b->n_kernels_all = nk;
                b->n_kernels = nk < KERNELS_MAX ? nk : KERNELS_MAX;
                b->kernels_ctx = r->ctx;
                b->kernels_tokens = gen;
            }
        }
        if (s) {
            char what[96];
            snprintf(what, sizeof what, "decode at frontier %lld", (long long)r->ctx);
            if (skip_or_fail(&err, what, r->reason)) {
                ds4_state_free(st);
                return 1;
            }
            r->skipped = true;
            r->s.n = 0;
            dead = true;
            continue;
        }
        pos += gen;
        const double g = (double)gen;
        double dsum = 0;
        for (int64_t k = 0; k < r->s.n; k++) dsum += r->s.v[k];
        fprintf(stderr, "ds4server bench:   %lld new tokens prefilled in %.3f s; decode %.2f tokens/s\n",
                (long long)r->interval_tokens, r->interval_s, dsum > 0 ? g / dsum : 0.0);
        r->pt = step_cost_of(&c0, &c1, g);
        r->peak = c1.peak_bytes;
        r->kv_bytes = kv_bytes_at(b->cfg, r->pos_start + gen / 2);
    }
    ds4_state_free(st);
    return 0;
}

/* The backend's copy op on two buffers of bw_mib MiB: 2 x bytes / time. */
static void run_bandwidth(bench *b) {
    if (b->o.bandwidth > 0) {
        b->bw_gbps = b->o.bandwidth;
        return;
    }
    b->bw_bytes = b->o.bw_mib * 1024 * 1024;
    fprintf(stderr, "ds4server bench: copy bandwidth, %lld MiB\n", (long long)b->o.bw_mib);
    if (!bench_copy_bandwidth(b->var[0].be, b->o.bw_mib, 5, &b->bw_samples, b->bw_reason, REASON_MAX)) return;
    for (int64_t i = 0; i < b->bw_samples.n; i++)
        if (b->bw_samples.v[i] > b->bw_gbps) b->bw_gbps = b->bw_samples.v[i];
    b->bw_measured = b->bw_gbps > 0;
}

/* ------------------------------------------------------------ A/B */

/* One A/B sample of variant v: tokens/s and seconds. */
static ds4_status ab_sample(bench *b, variant *v, bool decode, int64_t size, double *secs, double *tps,
                            ds4_error *err) {
    if (!decode) {
        ds4_status s = time_prefill(b, v, size, false, secs, err);
        if (!s) *tps = (double)size / *secs;
        return s;
    }
    ds4_state *st = NULL;
    ds4_status s = ds4_state_create(v->m, size + b->o.gen, &st, err);
    if (!s) s = eval_range(b, v, st, 0, size, err);
    int32_t next = s ? 0 : ds4_sample_argmax(b->logits, b->cfg->n_vocab);
    if (!s) s = decode_steps(b, v, st, &next, b->o.gen, NULL, secs, 0, err);
    if (!s) *tps = (double)b->o.gen / *secs;
    ds4_state_free(st);
    return s;
}

/* Batched decode: for each stream count n, n states (stream k prefilled
 * with tokens[k .. k + batch_ctx)) decode --gen greedy tokens in lockstep,
 * one ds4_model_eval_batch call per step. */
static int run_batch(bench *b) {
    variant *v = &b->var[0];
    const opts *o = &b->o;
    const int64_t gen = o->gen, V = b->cfg->n_vocab;
    const int64_t warm = o->warmup * 2 < gen ? o->warmup * 2 : gen; /* untimed steps (new graph shapes) */
    for (int i = 0; i < o->n_batch; i++) {
        batch_row *r = &b->batch[i];
        const int64_t n = r->streams = o->batch[i];
        if ((uint64_t)(o->batch_ctx + warm + gen) > b->cfg->context_length) {
            r->skipped = true;
            snprintf(r->reason, REASON_MAX, "%lld + %lld decoded tokens exceed the model's context of %llu",
                     (long long)o->batch_ctx, (long long)(warm + gen), (unsigned long long)b->cfg->context_length);
            continue;
        }
        fprintf(stderr, "ds4server bench: batched decode of %lld streams\n", (long long)n);
        ds4_error err = { 0 };
        ds4_state **st = calloc((size_t)n, sizeof *st);
        int32_t *next = malloc((size_t)n * sizeof *next), *cur = malloc((size_t)n * sizeof *cur);
        float *logits = malloc((size_t)(n * V) * sizeof *logits);
        ds4_status s =
            st && next && cur && logits ? DS4_OK : ds4_error_set(&err, DS4_ERR_NOMEM, "out of host memory");
        for (int64_t k = 0; k < n && !s; k++) {
            s = ds4_state_create(v->m, o->batch_ctx + warm + gen, &st[k], &err);
            const int64_t at = k % (b->n_tokens - o->batch_ctx + 1); /* stream k's own prompt */
            if (!s) s = eval_range_on(b, v, st[k], b->tokens + at, o->batch_ctx, &err);
            if (!s) next[k] = ds4_sample_argmax(b->logits, V);
        }
        /* a few untimed steps first (graphs of the new shapes are built there) */
        for (int64_t g = 0; g < warm && !s; g++)
            s = ds4_model_eval_batch(v->m, st, next, n, v->num, logits, &err);
        ds4_backend_counters c0, c1;
        ds4_backend_counters_get(v->be, &c0);
        /* greedy steps: the backend picks each row's token, only the ids come back */
        for (int64_t g = 0; g < gen && !s; g++) {
            const double t0 = tool_now();
            memcpy(cur, next, (size_t)n * sizeof *cur);
            s = ds4_model_eval_batch_greedy(v->m, st, cur, n, v->num, next, &err);
            if (s) break;
            if (!bench_dvec_push(&r->s, tool_now() - t0)) s = ds4_error_set(&err, DS4_ERR_NOMEM, "out of memory");
        }
        ds4_backend_counters_get(v->be, &c1);
        for (int64_t k = 0; st && k < n; k++) ds4_state_free(st[k]);
        free(st);
        free(next);
        free(cur);
        free(logits);
        if (s) {
            char what[96];
            snprintf(what, sizeof what, "batched decode of %lld streams", (long long)n);
            if (skip_or_fail(&err, what, r->reason)) return 1;
            r->skipped = true;
            r->s.n = 0;
            continue;
        }
        const double g = (double)gen;
        r->ps = step_cost_of(&c0, &c1, g);
        r->peak = c1.peak_bytes;
        double sum = 0;
        for (int64_t k = 0; k < r->s.n; k++) sum += r->s.v[k];
        fprintf(stderr, "ds4server bench:   %lld streams: %.2f tokens/s in all (%.2f per stream)\n", (long long)n,
                sum > 0 ? (double)n * g / sum : 0.0, sum > 0 ? g / sum : 0.0);
    }
    return 0;
}


/* The B/A ratio (geometric mean of the pairs) and its paired 95% interval
 * (Student t on the per-pair log ratios; none for one pair). */
static void ab_finish(ab_result *res) {
    const dvec *d = &res->log_ratio;
    const stats st = bench_stats_of(d);
    res->ratio = exp(st.mean);
    res->lo = res->hi = res->t_crit = NAN;
    if (d->n >= 2) {
        double ss = 0;
        for (int64_t i = 0; i < d->n; i++) ss += (d->v[i] - st.mean) * (d->v[i] - st.mean);
        const double se = sqrt(ss / (double)(d->n - 1)) / sqrt((double)d->n);
        res->t_crit = t_crit_975(d->n - 1);
        res->lo = exp(st.mean - res->t_crit * se);
        res->hi = exp(st.mean + res->t_crit * se);
    }
}

static int run_ab_exp(bench *b, ab_result *res, bool decode) {
    const int64_t R = b->o.repeat;
    res->order = calloc((size_t)(2 * R + 1), 1);
    if (!res->order) return tool_fail(CMD, "out of memory");
    const char *what = decode ? "A/B decode" : "A/B prefill";
    ds4_error err = { 0 };
    double secs, tps;
    ds4_status s = DS4_OK;
    for (int64_t w = 0; w < b->o.warmup && !s; w++)
        for (int k = 0; k < 2 && !s; k++) s = ab_sample(b, &b->var[k], decode, res->size, &secs, &tps, &err);
    double pair[2];
    for (int64_t r = 0; r < R && !s; r++) {
        fprintf(stderr, "ds4server bench: %s round %lld of %lld\n", what, (long long)r + 1, (long long)R);
        for (int j = 0; j < 2 && !s; j++) {
            const int k = (r % 2 == 0) ? j : 1 - j; /* A B, then B A */
            s = ab_sample(b, &b->var[k], decode, res->size, &secs, &tps, &err);
            if (s) break;
            res->order[2 * r + j] = k ? 'B' : 'A';
            pair[k] = tps;
            if (!bench_dvec_push(&res->seconds, secs) || !bench_dvec_push(&res->tps, tps)) return tool_fail(CMD, "out of memory");
        }
        if (!s && !bench_dvec_push(&res->log_ratio, log(pair[1] / pair[0]))) return tool_fail(CMD, "out of memory");
    }
    if (s) {
        if (skip_or_fail(&err, what, res->reason)) return 1;
        res->skipped = true;
        res->seconds.n = res->tps.n = res->log_ratio.n = 0;
        res->order[0] = 0;
        return 0;
    }
    ab_finish(res);
    return 0;
}

/* The A/B sizes: decode at the first frontier that fits, prefill at the
 * largest size that fits (a result is marked skipped when none does). */
static void ab_sizes(bench *b) {
    ab_result *d = &b->ab_dec, *p = &b->ab_pre;
    d->size = -1;
    for (int i = 0; i < b->o.n_ctx && d->size < 0; i++)
        if ((uint64_t)(b->o.ctx[i] + b->o.gen) <= b->cfg->context_length) d->size = b->o.ctx[i];
    p->size = -1;
    for (int i = b->o.n_prefill - 1; i >= 0 && p->size < 0; i--)
        if ((uint64_t)b->o.prefill[i] <= b->cfg->context_length) p->size = b->o.prefill[i];
    if (d->size < 0) {
        d->skipped = true;
        snprintf(d->reason, REASON_MAX, "no --ctx frontier + --gen fits the model's context of %llu",
                 (unsigned long long)b->cfg->context_length);
    }
    if (p->size < 0) {
        p->skipped = true;
        snprintf(p->reason, REASON_MAX, "no --prefill size fits the model's context of %llu",
                 (unsigned long long)b->cfg->context_length);
    }
}

static int run_ab(bench *b) {
    ab_sizes(b);
    if (!b->ab_dec.skipped && run_ab_exp(b, &b->ab_dec, true)) return 1;
    if (!b->ab_pre.skipped && run_ab_exp(b, &b->ab_pre, false)) return 1;
    return 0;
}

/* ------------------------------------------------------------ --compare */

/* s in single quotes for /bin/sh (each ' as '\''); NULL when out of memory. */
static char *sh_quote(const char *s) {
    size_t n = 3;
    for (const char *c = s; *c; c++) n += *c == '\'' ? 4 : 1;
    char *q = malloc(n), *w = q;
    if (!q) return NULL;
    *w++ = '\'';
    for (const char *c = s; *c; c++) {
        if (*c == '\'') {
            memcpy(w, "'\\''", 4);
            w += 4;
        } else {
            *w++ = *c;
        }
    }
    *w++ = '\'';
    *w = 0;
    return q;
}

/* The last non-empty line of a file (at most cap - 1 bytes of it). */
static void last_line(const char *path, char *out, size_t cap) {
    out[0] = 0;
    FILE *f = fopen(path, "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (line[0]) snprintf(out, cap, "%.*s", (int)(cap - 1), line);
    }
    if (f) fclose(f);
}

/* The sum and count of a JSON array of positive numbers (false if it is
 * not one). */
static bool json_positive_sum(const cJSON *arr, double *sum, int64_t *n) {
    *sum = 0;
    *n = 0;
    if (!cJSON_IsArray(arr)) return false;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) {
        if (!cJSON_IsNumber(e) || !(e->valuedouble > 0) || !isfinite(e->valuedouble)) return false;
        *sum += e->valuedouble;
        (*n)++;
    }
    return *n > 0;
}

/* The row of `arr` whose `key` is `value`. */
static const cJSON *json_row(const cJSON *arr, const char *key, int64_t value) {
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) {
        const cJSON *k = cJSON_GetObjectItemCaseSensitive(e, key);
        if (cJSON_IsNumber(k) && (int64_t)k->valuedouble == value) return e;
    }
    return NULL;
}

/* One run of variant k (0: this binary, 1: --compare's command): `bench`
 * with the same model, backend, numerics, threads, seed and chunk, decode
 * of --gen tokens at ab_dec.size and prefill of ab_pre.size tokens, one
 * sample each after --warmup untimed runs; its JSON gives seconds and
 * tokens/s of each (a skipped size is not read). 0, or 1 with the error
 * printed (naming the variant's command and the last line it printed). */
/* The directory of a --compare run's child outputs (mkdtemp), and the
 * child running now (a process group of its own: the shell and what it
 * starts): a SIGINT, SIGTERM or SIGHUP stops the group, removes the
 * directory and ends the run with that signal. */
static char g_cmp_dir[600], g_cmp_json[640], g_cmp_log[640];
static volatile pid_t g_cmp_child;

static void compare_cleanup(void) {
    if (!g_cmp_dir[0]) return;
    unlink(g_cmp_json);
    unlink(g_cmp_log);
    rmdir(g_cmp_dir);
}

static void compare_on_signal(int sig) {
    const pid_t c = g_cmp_child;
    if (c > 0) kill(-c, SIGTERM);
    compare_cleanup();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Run `line` with /bin/sh as a child; its wait status, or -1. */
static int compare_spawn(const char *line) {
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        setpgid(0, 0);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        signal(SIGHUP, SIG_DFL);
        execl("/bin/sh", "sh", "-c", line, (char *)NULL);
        _exit(127);
    }
    setpgid(pid, pid); /* also here: the group exists before a signal can come */
    g_cmp_child = pid;
    int st;
    pid_t r;
    while ((r = waitpid(pid, &st, 0)) < 0 && errno == EINTR) {
    }
    g_cmp_child = 0;
    return r == pid ? st : -1;
}

static int compare_run(bench *b, int k, double secs[2], double tps[2]) {
    const opts *o = &b->o;
    const char *js = g_cmp_json, *log = g_cmp_log;
    unlink(js); /* nothing of the previous run can be read as this one's */
    const int64_t dsz = b->ab_dec.skipped ? o->ctx[0] : b->ab_dec.size;
    const int64_t psz = b->ab_pre.skipped ? o->prefill[0] : b->ab_pre.size;
    char *model = sh_quote(o->synthetic ? o->synthetic : b->model_abs), *qjs = sh_quote(js), *qlog = sh_quote(log);
    char *line = NULL;
    int rc = 0;
    if (model && qjs && qlog) {
        const char *fmt = "%s bench %s %s%s --backend %s --numerics %s --threads %lld --seed %llu --chunk %lld "
                          "--ctx %lld --prefill %lld --gen %lld --repeat 1 --warmup %lld --ttft 0 --bandwidth 1 "
                          "--json %s >/dev/null 2>%s";
        const char *margs[2] = { o->synthetic ? "--synthetic" : "-m", model };
        char layers[32] = "";
        if (o->syn_layers) snprintf(layers, sizeof layers, " --layers %lld", (long long)o->syn_layers);
        const int len = snprintf(NULL, 0, fmt, b->cmd[k], margs[0], margs[1], layers, o->backend, ds4_numerics_name(o->num),
                                 (long long)o->threads, (unsigned long long)o->seed, (long long)o->chunk,
                                 (long long)dsz, (long long)psz, (long long)o->gen, (long long)o->warmup, qjs, qlog);
        line = len > 0 ? malloc((size_t)len + 1) : NULL;
        if (line)
            snprintf(line, (size_t)len + 1, fmt, b->cmd[k], margs[0], margs[1], layers, o->backend,
                     ds4_numerics_name(o->num), (long long)o->threads, (unsigned long long)o->seed, (long long)o->chunk,
                     (long long)dsz, (long long)psz, (long long)o->gen, (long long)o->warmup, qjs, qlog);
    }
    free(model);
    free(qjs);
    free(qlog);
    const char *name = k ? "B" : "A";
    if (!line) return tool_fail(CMD, "out of memory");
    const int st = compare_spawn(line);
    free(line);
    char tail[400];
    last_line(log, tail, sizeof tail);
    if (st == -1) return tool_fail(CMD, "variant %s (`%s`): cannot run /bin/sh: %s", name, b->cmd[k], strerror(errno));
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        char how[64];
        if (WIFSIGNALED(st)) snprintf(how, sizeof how, "killed by signal %d", WTERMSIG(st));
        else if (WEXITSTATUS(st) > 128 && WEXITSTATUS(st) < 128 + 65) /* the shell's report of a killed command */
            snprintf(how, sizeof how, "exit status %d: signal %d", WEXITSTATUS(st), WEXITSTATUS(st) - 128);
        else snprintf(how, sizeof how, "exit status %d", WIFEXITED(st) ? WEXITSTATUS(st) : st);
        return tool_fail(CMD, "variant %s (`%s`) failed (%s)%s%s", name, b->cmd[k], how, tail[0] ? ": " : "", tail);
    }
    char *text = NULL;
    uint64_t text_len;
    ds4_error rerr = { 0 };
    cJSON *root = ds4_read_small_file(js, (uint64_t)64 << 20, &text, &text_len, &rerr) ? NULL : cJSON_Parse(text);
    free(text);
    const cJSON *schema = cJSON_GetObjectItemCaseSensitive(root, "schema");
    const cJSON *prov = cJSON_GetObjectItemCaseSensitive(root, "provenance");
    const cJSON *dec = json_row(cJSON_GetObjectItemCaseSensitive(root, "decode"), "ctx", dsz);
    const cJSON *pre = json_row(cJSON_GetObjectItemCaseSensitive(root, "prefill"), "tokens", psz);
    double sum[2] = { 0, 0 };
    int64_t n[2] = { 0, 0 };
    const char *bad = !root ? "is not JSON"
                      : !cJSON_IsString(schema) || strcmp(schema->valuestring, SCHEMA) ? "is not a " SCHEMA " result"
                      : !b->ab_dec.skipped && (!dec || !json_positive_sum(cJSON_GetObjectItemCaseSensitive(dec,
                                                           "samples_s"), &sum[0], &n[0]))
                          ? "has no decode samples at the A/B frontier"
                      : !b->ab_pre.skipped && (!pre || !json_positive_sum(cJSON_GetObjectItemCaseSensitive(pre,
                                                           "samples_s"), &sum[1], &n[1]))
                          ? "has no prefill sample at the A/B size"
                          : NULL;
    if (bad) {
        rc = tool_fail(CMD, "variant %s (`%s`): its --json output %s", name, b->cmd[k], bad);
        cJSON_Delete(root);
        return rc;
    }
    /* decode: --gen tokens over the sum of their latencies; prefill: its one sample */
    secs[0] = sum[0];
    tps[0] = n[0] ? (double)n[0] / sum[0] : 0;
    secs[1] = sum[1];
    tps[1] = n[1] ? (double)psz / sum[1] : 0;
    if (!b->cmp_commit[k][0]) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(prov, "commit");
        const cJSON *fp = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(prov, "model"), "fingerprint");
        snprintf(b->cmp_commit[k], sizeof b->cmp_commit[k], "%.63s", cJSON_IsString(c) ? c->valuestring : "unknown");
        snprintf(b->cmp_fingerprint[k], sizeof b->cmp_fingerprint[k], "%.23s",
                 cJSON_IsString(fp) ? fp->valuestring : "unknown");
    }
    cJSON_Delete(root);
    return rc;
}

/* --compare: --repeat rounds, A B then B A, each variant one child run for
 * both measurements; the pairs' ratio and interval as run_ab's. */
static int run_compare_rounds(bench *b);

static int run_compare(bench *b) {
    ab_sizes(b);
    if (b->ab_dec.skipped && b->ab_pre.skipped) return 0;
    const char *tmp = getenv("TMPDIR");
    char base[4096];
    if (!realpath(tmp && *tmp ? tmp : "/tmp", base)) return tool_fail(CMD, "%s: %s", tmp && *tmp ? tmp : "/tmp", strerror(errno));
    if ((size_t)snprintf(g_cmp_dir, sizeof g_cmp_dir, "%s/ds4-compare-XXXXXX", base) >= sizeof g_cmp_dir) {
        g_cmp_dir[0] = 0;
        return tool_fail(CMD, "TMPDIR %s is too long a path", base);
    }
    if (!mkdtemp(g_cmp_dir)) {
        const int e = errno;
        g_cmp_dir[0] = 0;
        return tool_fail(CMD, "a directory in %s: %s", base, strerror(e));
    }
    snprintf(g_cmp_json, sizeof g_cmp_json, "%s/result.json", g_cmp_dir);
    snprintf(g_cmp_log, sizeof g_cmp_log, "%s/stderr.log", g_cmp_dir);
    struct sigaction sa, old[3];
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = compare_on_signal;
    sigemptyset(&sa.sa_mask);
    const int sigs[3] = { SIGINT, SIGTERM, SIGHUP };
    for (int i = 0; i < 3; i++) sigaction(sigs[i], &sa, &old[i]);
    const int rc = run_compare_rounds(b);
    for (int i = 0; i < 3; i++) sigaction(sigs[i], &old[i], NULL);
    compare_cleanup();
    g_cmp_dir[0] = 0;
    return rc;
}

static int run_compare_rounds(bench *b) {
    const int64_t R = b->o.repeat;
    ab_result *res[2] = { &b->ab_dec, &b->ab_pre };
    for (int e = 0; e < 2; e++)
        if (!(res[e]->order = calloc((size_t)(2 * R + 1), 1))) return tool_fail(CMD, "out of memory");
    for (int64_t r = 0; r < R; r++) {
        fprintf(stderr, "ds4server bench: compare round %lld of %lld\n", (long long)r + 1, (long long)R);
        double pair[2][2];
        for (int j = 0; j < 2; j++) {
            const int k = (r % 2 == 0) ? j : 1 - j; /* A B, then B A */
            double secs[2], tps[2];
            if (compare_run(b, k, secs, tps)) return 1;
            for (int e = 0; e < 2; e++) {
                if (res[e]->skipped) continue;
                res[e]->order[2 * r + j] = k ? 'B' : 'A';
                pair[e][k] = tps[e];
                if (!bench_dvec_push(&res[e]->seconds, secs[e]) || !bench_dvec_push(&res[e]->tps, tps[e]))
                    return tool_fail(CMD, "out of memory");
            }
        }
        for (int e = 0; e < 2; e++)
            if (!res[e]->skipped && !bench_dvec_push(&res[e]->log_ratio, log(pair[e][1] / pair[e][0])))
                return tool_fail(CMD, "out of memory");
    }
    for (int e = 0; e < 2; e++)
        if (!res[e]->skipped) ab_finish(res[e]);
    if (strcmp(b->cmp_fingerprint[0], b->cmp_fingerprint[1]))
        fprintf(stderr, "ds4server bench: warning: the variants report different model fingerprints (%s, %s): "
                "they did not run the same weights\n", b->cmp_fingerprint[0], b->cmp_fingerprint[1]);
    return 0;
}

/* ------------------------------------------------------------ provenance */

typedef struct prov {
    char commit[64];
    int dirty; /* -1 unknown */
    char compiler[160];
    char device[600];
    char host_cpu[160];
    long host_cores;
    char date[32];
    int64_t file_bytes;
    uint64_t fingerprint;
    bool fingerprint_known;
} prov;

static void get_provenance(bench *b, prov *p) {
    memset(p, 0, sizeof *p);
    p->dirty = -1;
    snprintf(p->commit, sizeof p->commit, "unknown");
    const char *env = getenv("DS4_BENCH_COMMIT");
    char dir[4096] = "", cmd[4300], buf[256];
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    if (n > 0) {
        dir[n] = 0;
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
    }
    const bool dir_ok = n > 0 && !strchr(dir, '\'');
    if (env && *env) {
        snprintf(p->commit, sizeof p->commit, "%.63s", env);
    } else {
        snprintf(cmd, sizeof cmd, "git %s%s%s rev-parse --short HEAD 2>/dev/null", dir_ok ? "-C '" : "",
                 dir_ok ? dir : "", dir_ok ? "'" : "");
        if (command_line(cmd, buf, sizeof buf)) {
            snprintf(p->commit, sizeof p->commit, "%.63s", buf);
            snprintf(cmd, sizeof cmd, "git %s%s%s diff --quiet HEAD -- 2>/dev/null && echo clean || echo dirty",
                     dir_ok ? "-C '" : "", dir_ok ? dir : "", dir_ok ? "'" : "");
            if (command_line(cmd, buf, sizeof buf)) p->dirty = !strcmp(buf, "dirty");
        }
    }
#if defined(__clang__)
    snprintf(p->compiler, sizeof p->compiler, "clang %s", __VERSION__);
#elif defined(__GNUC__)
    snprintf(p->compiler, sizeof p->compiler, "gcc %s", __VERSION__);
#elif defined(__VERSION__)
    snprintf(p->compiler, sizeof p->compiler, "%s", __VERSION__);
#else
    snprintf(p->compiler, sizeof p->compiler, "unknown");
#endif
    snprintf(p->device, sizeof p->device, "cpu");
#ifdef DS4_WITH_CUDA
    if (!strcmp(b->var[0].backend, "cuda") || (b->n_var > 1 && !strcmp(b->var[1].backend, "cuda"))) {
        ds4_error err = { 0 };
        if (ds4_cuda_device_describe(0, p->device, sizeof p->device, &err))
            snprintf(p->device, sizeof p->device, "cuda: %s", err.message);
    }
#endif
    FILE *ci = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (ci && fgets(line, sizeof line, ci)) {
        if (!strncmp(line, "model name", 10)) {
            const char *c = strchr(line, ':');
            if (c) {
                c++;
                while (*c == ' ' || *c == '\t') c++;
                snprintf(p->host_cpu, sizeof p->host_cpu, "%s", c);
                p->host_cpu[strcspn(p->host_cpu, "\r\n")] = 0;
            }
            break;
        }
    }
    if (ci) fclose(ci);
    if (!p->host_cpu[0]) snprintf(p->host_cpu, sizeof p->host_cpu, "unknown");
    p->host_cores = sysconf(_SC_NPROCESSORS_ONLN);
    time_t t = time(NULL);
    struct tm tm;
    if (gmtime_r(&t, &tm)) strftime(p->date, sizeof p->date, "%Y-%m-%dT%H:%M:%SZ", &tm);
    struct stat sb;
    p->file_bytes = b->o.model && stat(b->o.model, &sb) == 0 ? (int64_t)sb.st_size : (int64_t)b->f->size;
    p->fingerprint_known = true;
    if (b->var[0].m) {
        p->fingerprint = ds4_model_fingerprint(b->var[0].m);
    } else { /* --compare: as variant A reported it */
        char *end = NULL;
        p->fingerprint = strtoull(b->cmp_fingerprint[0], &end, 16);
        p->fingerprint_known = strlen(b->cmp_fingerprint[0]) == 16 && end && !*end;
    }
}

/* ------------------------------------------------------------ JSON */

static void json_load(FILE *f, const variant *v) {
    fprintf(f, "{\"backend\": \"%s\", \"numerics\": \"%s\", \"threads\": %lld, \"open_s\": ", v->backend,
            ds4_numerics_name(v->num), (long long)v->threads);
    bench_json_num(f, v->load.open_s);
    fputs(", \"weights_s\": ", f);
    bench_json_num(f, v->load.weights_s);
    fputs(", \"total_s\": ", f);
    bench_json_num(f, v->load.open_s + v->load.weights_s);
    fprintf(f, ", \"bytes_bound\": %lld, \"device_weight_bytes\": %llu, \"upload_gbps\": ",
            (long long)v->load.bytes_bound, (unsigned long long)v->load.device_weights);
    if (v->load.device_weights > 0 && v->load.weights_s > 0)
        bench_json_num(f, (double)v->load.device_weights / v->load.weights_s / 1e9);
    else
        fputs("null", f);
    fputc('}', f);
}

static void json_list(FILE *f, const int64_t *v, int n) {
    fputc('[', f);
    for (int i = 0; i < n; i++) fprintf(f, "%s%lld", i ? ", " : "", (long long)v[i]);
    fputc(']', f);
}

static void json_ab(FILE *f, const ab_result *r, const char *size_key) {
    fprintf(f, "{\"%s\": %lld, \"skipped\": %s, \"reason\": ", size_key, (long long)r->size,
            r->skipped ? "true" : "false");
    if (r->skipped) bench_json_str(f, r->reason);
    else fputs("null", f);
    fputs(", \"order\": [", f);
    for (size_t i = 0; r->order && r->order[i]; i++) fprintf(f, "%s\"%c\"", i ? ", " : "", r->order[i]);
    fputs("], \"samples\": [", f);
    for (int64_t i = 0; i < r->tps.n; i++) {
        fprintf(f, "%s{\"variant\": \"%c\", \"round\": %lld, \"seconds\": ", i ? ", " : "", r->order[i],
                (long long)(i / 2));
        bench_json_num(f, r->seconds.v[i]);
        fputs(", \"tokens_per_s\": ", f);
        bench_json_num(f, r->tps.v[i]);
        fputc('}', f);
    }
    fputs("], \"log_ratios\": ", f);
    bench_json_samples(f, &r->log_ratio);
    /* per-variant medians */
    dvec a = { 0 }, bb = { 0 };
    for (int64_t i = 0; i < r->tps.n; i++) bench_dvec_push(r->order[i] == 'A' ? &a : &bb, r->tps.v[i]);
    stats sa = bench_stats_of(&a), sb = bench_stats_of(&bb);
    fputs(", \"a_tokens_per_s_median\": ", f);
    bench_json_num(f, a.n ? sa.median : NAN);
    fputs(", \"b_tokens_per_s_median\": ", f);
    bench_json_num(f, bb.n ? sb.median : NAN);
    free(a.v);
    free(bb.v);
    fprintf(f, ", \"n_pairs\": %lld, \"ratio\": ", (long long)r->log_ratio.n);
    bench_json_num(f, r->skipped ? NAN : r->ratio);
    fputs(", \"ci95\": ", f);
    if (!r->skipped && isfinite(r->lo)) {
        fputc('[', f);
        bench_json_num(f, r->lo);
        fputs(", ", f);
        bench_json_num(f, r->hi);
        fputc(']', f);
    } else {
        fputs("null", f);
    }
    fputs(", \"t_crit\": ", f);
    bench_json_num(f, r->t_crit);
    fputc('}', f);
}

static int write_json(bench *b, const prov *p, int argc, char **argv) {
    FILE *f = fopen(b->o.json, "w");
    if (!f) return tool_fail(CMD, "%s: %s", b->o.json, strerror(errno));
    const opts *o = &b->o;
    const ds4_config *c = b->cfg;
    fprintf(f, "{\n  \"schema\": \"" SCHEMA "\",\n  \"mode\": \"%s\",\n", o->ab ? "ab" : "sweep");
    fputs("  \"provenance\": {\"commit\": ", f);
    bench_json_str(f, p->commit);
    fprintf(f, ", \"git_dirty\": %s, \"compiler\": ", p->dirty < 0 ? "null" : p->dirty ? "true" : "false");
    bench_json_str(f, p->compiler);
#ifdef DS4_WITH_CUDA
    fputs(", \"build\": \"cuda\"", f);
#else
    fputs(", \"build\": \"cpu\"", f);
#endif
#ifdef __OPTIMIZE__
    fputs(", \"optimized\": true", f);
#else
    fputs(", \"optimized\": false", f);
#endif
    fprintf(f, ", \"version\": \"%s\", \"device\": ", ds4_version());
    bench_json_str(f, p->device);
    fputs(", \"host_cpu\": ", f);
    bench_json_str(f, p->host_cpu);
    fprintf(f, ", \"host_cores\": %ld, \"date_utc\": \"%s\", \"command_line\": ", p->host_cores, p->date);
    fputs("\"ds4server", f);
    for (int i = 0; i < argc; i++) {
        fputc(' ', f);
        tool_json_escape(f, argv[i], strlen(argv[i]));
    }
    fputs("\",\n    \"model\": {\"path\": ", f);
    bench_json_str(f, o->model_label);
    fputs(", \"synthetic\": ", f);
    if (o->synthetic) bench_json_str(f, o->synthetic);
    else fputs("null", f);
    char fp[24];
    if (p->fingerprint_known) snprintf(fp, sizeof fp, "\"%016llx\"", (unsigned long long)p->fingerprint);
    else snprintf(fp, sizeof fp, "null");
    fprintf(f, ", \"file_bytes\": %lld, \"fingerprint\": %s, \"n_layer\": %d, \"n_embd\": %lld, "
            "\"n_vocab\": %lld, \"n_expert\": %d, \"n_expert_used\": %d, \"sliding_window\": %d, "
            "\"context_length\": %llu},\n",
            (long long)p->file_bytes, fp, c->n_layer, (long long)c->n_embd,
            (long long)c->n_vocab, c->n_expert, c->n_expert_used, c->sliding_window,
            (unsigned long long)c->context_length);
    fprintf(f, "    \"tokens\": {\"seed\": %llu, \"generated\": %lld, \"prefill_sizes\": ",
            (unsigned long long)o->seed, (long long)b->n_tokens);
    json_list(f, o->prefill, o->n_prefill);
    fprintf(f, ", \"ttft_tokens\": %lld, \"ctx\": ", (long long)o->ttft);
    json_list(f, o->ctx, o->n_ctx);
    fprintf(f, ", \"gen\": %lld}},\n", (long long)o->gen);
    fprintf(f, "  \"options\": {\"backend\": \"%s\", \"numerics\": \"%s\", \"threads\": %lld, \"ctx\": ", o->backend,
            ds4_numerics_name(o->num), (long long)o->threads);
    json_list(f, o->ctx, o->n_ctx);
    fputs(", \"prefill\": ", f);
    json_list(f, o->prefill, o->n_prefill);
    fprintf(f, ", \"gen\": %lld, \"repeat\": %lld, \"warmup\": %lld, \"ttft\": %lld, \"seed\": %llu, "
            "\"chunk\": %lld, \"ab\": ",
            (long long)o->gen, (long long)o->repeat, (long long)o->warmup, (long long)o->ttft,
            (unsigned long long)o->seed, (long long)o->chunk);
    if (o->ab_arg) bench_json_str(f, o->ab_arg);
    else fputs("null", f);
    fputs(", \"compare\": ", f);
    if (o->compare) bench_json_str(f, o->compare);
    else fputs("null", f);
    fputs(", \"bandwidth_gbps\": ", f);
    bench_json_num(f, o->bandwidth > 0 ? o->bandwidth : NAN);
    fprintf(f, ", \"bandwidth_mib\": %lld},\n", (long long)o->bw_mib);
    fputs("  \"stats_method\": {\"median\": \"middle sample (mean of the middle two for an even count)\", "
          "\"p95\": \"nearest rank: the ceil(95 n / 100)-th smallest sample\", "
          "\"ci95\": \"exp(mean +- t(0.975, n-1) * sd / sqrt(n)) of the per-pair log(B/A) ratios\"},\n",
          f);
    fputs("  \"load\": ", f);
    json_load(f, &b->var[0]);
    fputs(",\n", f);

    /* bandwidth and roofline */
    fputs("  \"bandwidth\": {\"source\": ", f);
    if (o->ab) fputs("null", f);
    else fputs(o->bandwidth > 0 ? "\"given\"" : b->bw_measured ? "\"measured\"" : "null", f);
    fputs(", \"gbps\": ", f);
    bench_json_num(f, b->bw_gbps > 0 ? b->bw_gbps : NAN);
    fputs(", \"samples_gbps\": ", f);
    bench_json_samples(f, &b->bw_samples);
    fprintf(f, ", \"buffer_bytes\": %lld, \"method\": \"best of the samples; each times 4 copy ops of the buffer "
            "between two 4-byte downloads, 2 x bytes / time\", \"reason\": ", (long long)b->bw_bytes);
    if (b->bw_reason[0]) bench_json_str(f, b->bw_reason);
    else fputs("null", f);
    fputs("},\n", f);
    fputs("  \"roofline\": {\"weights_bytes_per_token\": ", f);
    bench_json_num(f, b->weights_bytes);
    fputs(", \"dense_bytes\": ", f);
    bench_json_num(f, b->dense_bytes);
    fputs(", \"routed_expert_bytes_total\": ", f);
    bench_json_num(f, b->expert_bytes_all);
    fputs(", \"routed_expert_bytes_per_token\": ", f);
    bench_json_num(f, b->expert_bytes_tok);
    fputs(", \"row_bytes_per_token\": ", f);
    bench_json_num(f, b->embd_row_bytes);
    fputs(", \"kv\": \"float32 window rows + compressed rows (ratio 128: all; ratio 4: the indexer's top-k) + "
          "indexer keys of ratio-4 layers, at the middle position of each decode run\"},\n",
          f);

    /* prefill */
    fputs("  \"prefill\": [", f);
    int k = 0;
    for (int i = 0; i < o->n_prefill && !o->ab; i++) {
        const prefill_row *r = &b->prefill[i];
        if (r->skipped) continue;
        stats s = bench_stats_of(&r->s);
        fprintf(f, "%s\n    {\"tokens\": %lld, \"samples_s\": ", k++ ? "," : "", (long long)r->tokens);
        bench_json_samples(f, &r->s);
        fputs(", ", f);
        bench_json_stats_s(f, &s);
        fputs(", \"tokens_per_s\": ", f);
        bench_json_num(f, (double)r->tokens / s.median);
        fputs(", \"tokens_per_s_min\": ", f);
        bench_json_num(f, (double)r->tokens / s.max);
        fputs(", \"tokens_per_s_max\": ", f);
        bench_json_num(f, (double)r->tokens / s.min);
        fprintf(f, ", \"last_sample\": {\"launches\": %llu, \"copies\": %llu, \"h2d_bytes\": %llu, "
                "\"d2h_bytes\": %llu, \"syncs\": %llu}}",
                (unsigned long long)r->c.launches, (unsigned long long)r->c.copies,
                (unsigned long long)r->c.h2d_bytes, (unsigned long long)r->c.d2h_bytes,
                (unsigned long long)r->c.syncs);
    }
    fputs(k ? "\n  ],\n" : "],\n", f);
    fputs("  \"prefill_skipped\": [", f);
    k = 0;
    for (int i = 0; i < o->n_prefill && !o->ab; i++) {
        const prefill_row *r = &b->prefill[i];
        if (!r->skipped) continue;
        json_skipped(f, &k, "tokens", r->tokens, r->reason);
    }
    fputs("],\n  \"ttft\": ", f);
    if (b->ttft_run) {
        stats s = bench_stats_of(&b->ttft);
        fprintf(f, "{\"tokens\": %lld, \"samples_s\": ", (long long)o->ttft);
        bench_json_samples(f, &b->ttft);
        fputs(", ", f);
        bench_json_stats_s(f, &s);
        fputs("}", f);
    } else {
        fputs("null", f);
    }
    fputs(",\n  \"ttft_reason\": ", f);
    if (!b->ttft_run && !o->ab) bench_json_str(f, b->ttft_reason);
    else fputs("null", f);
    fputs(",\n", f);

    /* decode */
    fputs("  \"decode\": [", f);
    k = 0;
    for (int i = 0; i < o->n_ctx && !o->ab; i++) {
        const decode_row *r = &b->decode[i];
        if (r->skipped) continue;
        stats s = bench_stats_of(&r->s);
        fprintf(f, "%s\n    {\"ctx\": %lld, \"pos_start\": %lld, \"warmup_tokens\": %lld, \"gen\": %lld, "
                "\"interval_tokens\": %lld, \"interval_s\": ",
                k++ ? "," : "", (long long)r->ctx, (long long)r->pos_start, (long long)frontier_warmup(o),
                (long long)o->gen, (long long)r->interval_tokens);
        bench_json_num(f, r->interval_s);
        fputs(", \"interval_tokens_per_s\": ", f);
        bench_json_num(f, r->interval_tokens ? (double)r->interval_tokens / r->interval_s : NAN);
        fputs(", \"samples_s\": ", f);
        bench_json_samples(f, &r->s);
        fputs(", ", f);
        bench_json_stats_s(f, &s);
        fputs(", \"p50_s\": ", f);
        bench_json_num(f, s.median);
        fputs(", \"tokens_per_s\": ", f);
        bench_json_num(f, (double)s.n / s.sum);
        fputs(", \"per_token\": ", f);
        json_step_cost(f, &r->pt);
        fprintf(f, ", \"peak_device_bytes\": %llu, \"roofline\": {\"weights_bytes\": ", (unsigned long long)r->peak);
        bench_json_num(f, b->weights_bytes);
        fputs(", \"kv_bytes\": ", f);
        bench_json_num(f, r->kv_bytes);
        const double bw = b->bw_gbps * 1e9;
        const double fw = bw > 0 ? b->weights_bytes / bw : NAN, fk = bw > 0 ? (b->weights_bytes + r->kv_bytes) / bw : NAN;
        fputs(", \"floor_s_weights\": ", f);
        bench_json_num(f, fw);
        fputs(", \"floor_s_weights_kv\": ", f);
        bench_json_num(f, fk);
        fputs(", \"measured_s\": ", f);
        bench_json_num(f, s.median);
        fputs(", \"measured_over_floor_weights\": ", f);
        bench_json_num(f, s.median / fw);
        fputs(", \"measured_over_floor_weights_kv\": ", f);
        bench_json_num(f, s.median / fk);
        fputs("}}", f);
    }
    fputs(k ? "\n  ],\n" : "],\n", f);
    fputs("  \"decode_skipped\": [", f);
    k = 0;
    for (int i = 0; i < o->n_ctx && !o->ab; i++) {
        const decode_row *r = &b->decode[i];
        if (!r->skipped) continue;
        json_skipped(f, &k, "ctx", r->ctx, r->reason);
    }
    fputs("],\n  \"batch\": [", f);
    k = 0;
    for (int i = 0; i < o->n_batch && !o->ab; i++) {
        const batch_row *r = &b->batch[i];
        if (r->skipped) continue;
        stats st = bench_stats_of(&r->s);
        fprintf(f, "%s\n    {\"streams\": %lld, \"ctx\": %lld, \"gen\": %lld, \"samples_s\": ", k++ ? "," : "",
                (long long)r->streams, (long long)o->batch_ctx, (long long)o->gen);
        bench_json_samples(f, &r->s);
        fputs(", ", f);
        bench_json_stats_s(f, &st);
        fputs(", \"tokens_per_s\": ", f);
        bench_json_num(f, (double)r->streams * (double)st.n / st.sum);
        fputs(", \"per_stream_tokens_per_s\": ", f);
        bench_json_num(f, (double)st.n / st.sum);
        fputs(", \"per_step\": ", f);
        json_step_cost(f, &r->ps);
        fprintf(f, ", \"peak_device_bytes\": %llu}", (unsigned long long)r->peak);
    }
    fputs(k ? "\n  ],\n" : "],\n", f);
    fputs("  \"batch_skipped\": [", f);
    k = 0;
    for (int i = 0; i < o->n_batch && !o->ab; i++)
        if (b->batch[i].skipped) json_skipped(f, &k, "streams", b->batch[i].streams, b->batch[i].reason);
    fprintf(f, "],\n  \"peak_device_bytes\": %llu,\n", (unsigned long long)b->peak);
    fputs("  \"kernels\": ", f);
    if (b->n_kernels > 0) {
        const double g = (double)b->kernels_tokens;
        fprintf(f, "{\"context\": %lld, \"tokens\": %lld, \"distinct\": %d, \"per_token\": [",
                (long long)b->kernels_ctx, (long long)b->kernels_tokens, b->n_kernels_all);
        for (int i = 0; i < b->n_kernels; i++) {
            const ds4_kernel_time *kt = &b->kernels[i];
            fputs(i ? ", {\"name\": " : "{\"name\": ", f);
            bench_json_str(f, kt->name ? kt->name : "");
            fputs(", \"what\": ", f);
            bench_json_str(f, kt->what ? kt->what : "");
            fputs(", \"launches\": ", f);
            bench_json_num(f, (double)kt->count / g);
            fputs(", \"ms\": ", f);
            bench_json_num(f, kt->ms / g);
            fputs("}", f);
        }
        fputs("]},\n", f);
    } else {
        fputs("null,\n", f);
    }

    /* A/B */
    fputs("  \"ab\": ", f);
    if (o->ab) {
        fprintf(f, "{\"key\": \"%s\", \"value\": ", AB_KEYS[o->ab]);
        bench_json_str(f, o->ab == AB_COMMAND ? o->compare : o->ab_value);
        fputs(",\n    \"variants\": {\"A\": ", f);
        for (int v = 0; v < 2; v++) {
            if (v) fputs(", \"B\": ", f);
            if (o->ab != AB_COMMAND) {
                json_load(f, &b->var[v]);
                continue;
            }
            fprintf(f, "{\"backend\": \"%s\", \"numerics\": \"%s\", \"threads\": %lld, \"command\": ", o->backend,
                    ds4_numerics_name(o->num), (long long)o->threads);
            bench_json_str(f, b->cmd[v]);
            fputs(", \"commit\": ", f);
            bench_json_str(f, b->cmp_commit[v]);
            fputs(", \"fingerprint\": ", f);
            bench_json_str(f, b->cmp_fingerprint[v]);
            fputc('}', f);
        }
        fputs("},\n    \"decode\": ", f);
        json_ab(f, &b->ab_dec, "ctx");
        fputs(",\n    \"prefill\": ", f);
        json_ab(f, &b->ab_pre, "tokens");
        fputs("}\n", f);
    } else {
        fputs("null\n", f);
    }
    fputs("}\n", f);
    if (ferror(f) | (fclose(f) != 0)) return tool_fail(CMD, "%s: write failed", o->json);
    return 0;
}

/* ------------------------------------------------------------ Markdown */

static void md_ab_row(FILE *f, const char *name, const ab_result *r, const char *unit) {
    if (r->skipped) {
        fprintf(f, "| %s | - | - | - | - | 0 | skipped: %s |\n", name, r->reason);
        return;
    }
    dvec a = { 0 }, bb = { 0 };
    for (int64_t i = 0; i < r->tps.n; i++) bench_dvec_push(r->order[i] == 'A' ? &a : &bb, r->tps.v[i]);
    stats sa = bench_stats_of(&a), sb = bench_stats_of(&bb);
    fprintf(f, "| %s %lld %s | %.2f | %.2f | %.4f | ", name, (long long)r->size, unit, sa.median, sb.median,
            r->ratio);
    if (isfinite(r->lo)) fprintf(f, "%.4f .. %.4f", r->lo, r->hi);
    else fputs("- (one pair)", f);
    fprintf(f, " | %lld | %.*s%s |\n", (long long)r->log_ratio.n, 16, r->order, strlen(r->order) > 16 ? "..." : "");
    free(a.v);
    free(bb.v);
}

static void write_md(FILE *f, bench *b, const prov *p) {
    const opts *o = &b->o;
    const variant *v = &b->var[0];
    fprintf(f, "## ds4server bench\n\n");
    char fp[24];
    if (p->fingerprint_known) snprintf(fp, sizeof fp, "%016llx", (unsigned long long)p->fingerprint);
    else snprintf(fp, sizeof fp, "unknown");
    fprintf(f, "- model: `%s` (%.3f GB, fingerprint %s, %d layers, vocab %lld, %d of %d experts)\n", o->model_label,
            (double)p->file_bytes / 1e9, fp, b->cfg->n_layer,
            (long long)b->cfg->n_vocab, b->cfg->n_expert_used, b->cfg->n_expert);
    fprintf(f, "- backend %s, numerics %s, threads %lld; commit %s%s; %s\n", v->backend, ds4_numerics_name(v->num),
            (long long)v->threads, p->commit, p->dirty == 1 ? " (modified)" : "", p->date);
    fprintf(f, "- device: %s; host: %s, %ld cores; compiler: %s\n", p->device, p->host_cpu, p->host_cores,
            p->compiler);
    for (int k = 0; k < b->n_var && o->ab != AB_COMMAND; k++) {
        const variant *w = &b->var[k];
        fprintf(f, "- load%s: %.3f s (open %.3f s, weights %.3f s, %.3f GB bound", b->n_var > 1 ? (k ? " B" : " A") : "",
                w->load.open_s + w->load.weights_s, w->load.open_s, w->load.weights_s, (double)w->load.bytes_bound / 1e9);
        if (w->load.device_weights > 0 && w->load.weights_s > 0)
            fprintf(f, "; upload %.2f GB/s", (double)w->load.device_weights / w->load.weights_s / 1e9);
        fprintf(f, ")\n");
    }
    if (o->ab == AB_COMMAND)
        fprintf(f, "\nA/B: A = `%s` (commit %s), B = `%s` (commit %s), each round one child run per variant; "
                "%lld rounds in the order A B B A ...; ratio = B/A tokens/s (geometric mean of the pairs) with a "
                "paired 95%% CI\n\n",
                b->cmd[0], b->cmp_commit[0], b->cmd[1], b->cmp_commit[1], (long long)o->repeat);
    else if (o->ab)
        fprintf(f, "\nA/B: B = A with %s=%s; %lld rounds in the order A B B A ...; ratio = B/A tokens/s "
                "(geometric mean of the pairs) with a paired 95%% CI\n\n",
                AB_KEYS[o->ab], o->ab_value, (long long)o->repeat);
    if (o->ab) {
        fprintf(f, "| measurement | A tokens/s | B tokens/s | B/A | 95%% CI | pairs | order |\n");
        fprintf(f, "|---|---:|---:|---:|---|---:|---|\n");
        md_ab_row(f, "decode at", &b->ab_dec, "");
        md_ab_row(f, "prefill", &b->ab_pre, "tokens");
        return;
    }
    fprintf(f, "- bytes per decoded token: %.4f GB of weights (dense %.4f, routed experts %.4f, rows %.6f)\n",
            b->weights_bytes / 1e9, b->dense_bytes / 1e9, b->expert_bytes_tok / 1e9, b->embd_row_bytes / 1e9);
    if (b->bw_gbps > 0)
        fprintf(f, "- bandwidth: %.1f GB/s (%s)\n", b->bw_gbps,
                o->bandwidth > 0 ? "given" : "measured: backend copy op, best of 5");
    else
        fprintf(f, "- bandwidth: not measured (%s)\n", b->bw_reason);
    if (b->peak) fprintf(f, "- peak device memory: %.2f GiB\n", (double)b->peak / 1073741824.0);
    fprintf(f, "\n| prefill tokens | tokens/s (median) | median s | p95 s | min s | max s | samples |\n");
    fprintf(f, "|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < o->n_prefill; i++) {
        const prefill_row *r = &b->prefill[i];
        if (r->skipped) {
            fprintf(f, "| %lld | skipped: %s | | | | | 0 |\n", (long long)r->tokens, r->reason);
            continue;
        }
        stats s = bench_stats_of(&r->s);
        fprintf(f, "| %lld | %.2f | %.6f | %.6f | %.6f | %.6f | %lld |\n", (long long)r->tokens,
                (double)r->tokens / s.median, s.median, s.p95, s.min, s.max, (long long)s.n);
    }
    if (b->ttft_run) {
        stats s = bench_stats_of(&b->ttft);
        fprintf(f, "\ntime to first token (%lld-token prompt): median %.6f s, p95 %.6f s, min %.6f s, max %.6f s "
                "(%lld samples)\n", (long long)o->ttft, s.median, s.p95, s.min, s.max, (long long)s.n);
    } else {
        fprintf(f, "\ntime to first token: skipped (%s)\n", b->ttft_reason);
    }
    fprintf(f, "\n| context | interval prefill tok/s | decode tok/s | p50 ms | p95 ms | launches/tok | H2D B/tok | "
            "D2H B/tok | syncs/tok | wait ms/tok | peak GiB | GB/tok w | GB/tok w+KV | floor ms w+KV | "
            "measured/floor w | measured/floor w+KV |\n");
    fprintf(f, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < o->n_ctx; i++) {
        const decode_row *r = &b->decode[i];
        if (r->skipped) {
            fprintf(f, "| %lld | skipped: %s | | | | | | | | | | | | | | |\n", (long long)r->ctx, r->reason);
            continue;
        }
        stats s = bench_stats_of(&r->s);
        const double bw = b->bw_gbps * 1e9;
        const double wk = b->weights_bytes + r->kv_bytes;
        fprintf(f, "| %lld | ", (long long)r->ctx);
        if (r->interval_tokens) fprintf(f, "%.1f | ", (double)r->interval_tokens / r->interval_s);
        else fputs("- | ", f);
        fprintf(f, "%.2f | %.3f | %.3f | %.1f | %.0f | %.0f | %.2f | %.3f | %.2f | %.4f | %.4f | ", (double)s.n / s.sum,
                s.median * 1e3, s.p95 * 1e3, r->pt.launches, r->pt.h2d, r->pt.d2h, r->pt.syncs, r->pt.wait_ms,
                (double)r->peak / 1073741824.0,
                b->weights_bytes / 1e9, wk / 1e9);
        if (bw > 0)
            fprintf(f, "%.4f | %.2f | %.2f |\n", wk / bw * 1e3, s.median / (b->weights_bytes / bw), s.median / (wk / bw));
        else
            fputs("- | - | - |\n", f);
    }
    /* how the decoded tokens were submitted (recorded steps: CUDA graphs) */
    bool any = false;
    for (int i = 0; i < o->n_ctx; i++) any |= !b->decode[i].skipped && b->decode[i].pt.graphs > 0;
    if (!any) return;
    fprintf(f, "\nRecorded steps (per decoded token): steps run as graphs, graph launches (a step in segments "
            "launches several), graphs built (of them for an update CUDA refused), node parameters set, steps cut "
            "short, host time inside the step, device time from the step's first graph to the end of its last.\n\n");
    fprintf(f, "| context | graphs | launched | built | refused | node updates | cut short | host ms | graph GPU ms |\n");
    fprintf(f, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < o->n_ctx; i++) {
        const decode_row *r = &b->decode[i];
        if (r->skipped) continue;
        const step_cost *c = &r->pt;
        fprintf(f, "| %lld | %.2f | %.2f | %.3f | %.3f | %.1f | %.2f | %.3f | %.3f |\n", (long long)r->ctx, c->graphs,
                c->graph_launches, c->graph_builds, c->graph_refusals, c->node_updates, c->step_breaks, c->step_host_ms,
                c->graph_gpu_ms);
    }
}

static void write_md_batch(FILE *f, const bench *b) {
    const opts *o = &b->o;
    if (o->n_batch == 0 || o->ab) return;
    fprintf(f, "\nBatched decode (each stream prefilled with %lld tokens of its own, then %lld greedy tokens in "
            "lockstep):\n\n", (long long)o->batch_ctx, (long long)o->gen);
    fprintf(f, "| streams | tokens/s (all) | tokens/s (per stream) | p50 ms/step | p95 ms/step | launches/step | "
            "peak GiB |\n|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < o->n_batch; i++) {
        const batch_row *r = &b->batch[i];
        if (r->skipped) {
            fprintf(f, "| %lld | skipped: %s | | | | | |\n", (long long)r->streams, r->reason);
            continue;
        }
        stats s = bench_stats_of(&r->s);
        fprintf(f, "| %lld | %.2f | %.2f | %.3f | %.3f | %.1f | %.2f |\n", (long long)r->streams,
                (double)r->streams * (double)s.n / s.sum, (double)s.n / s.sum, s.median * 1e3, s.p95 * 1e3,
                r->ps.launches, (double)r->peak / 1073741824.0);
    }
}

static void write_md_kernels(FILE *f, const bench *b) {
    if (b->n_kernels <= 0) return;
    const double g = (double)b->kernels_tokens;
    double total = 0;
    for (int i = 0; i < b->n_kernels; i++) total += b->kernels[i].ms;
    fprintf(f, "\nDevice time per decoded token by kernel at context %lld (%lld tokens, every launch timed with "
            "events; the %d busiest of %d):\n\n", (long long)b->kernels_ctx, (long long)b->kernels_tokens,
            b->n_kernels, b->n_kernels_all);
    fprintf(f, "| kernel | op | launches/tok | us/tok | us/launch | share |\n|---|---|---:|---:|---:|---:|\n");
    for (int i = 0; i < b->n_kernels; i++) {
        const ds4_kernel_time *kt = &b->kernels[i];
        fprintf(f, "| `%s` | %s | %.1f | %.1f | %.2f | %.1f%% |\n", kt->name ? kt->name : "", kt->what ? kt->what : "",
                (double)kt->count / g, kt->ms * 1e3 / g, kt->count ? kt->ms * 1e3 / (double)kt->count : 0.0,
                total > 0 ? 100.0 * kt->ms / total : 0.0);
    }
}

/* ------------------------------------------------------------ main */

static void bench_free(bench *b) {
    for (int k = b->n_var - 1; k >= 0; k--) {
        variant *v = &b->var[k];
        if (!v->owns) continue;
        ds4_model_free(v->m);
        ds4_backend_destroy(v->be);
    }
    for (int i = 0; i < MAX_LIST; i++) {
        free(b->prefill[i].s.v);
        free(b->decode[i].s.v);
        free(b->batch[i].s.v);
    }
    ab_result *ab[2] = { &b->ab_dec, &b->ab_pre };
    for (int i = 0; i < 2; i++) {
        free(ab[i]->order);
        free(ab[i]->seconds.v);
        free(ab[i]->tps.v);
        free(ab[i]->log_ratio.v);
    }
    free(b->cmd[0]);
    free(b->cmd[1]);
    free(b->model_abs);
    free(b->ttft.v);
    free(b->bw_samples.v);
    free(b->tokens);
    free(b->logits);
    gguf_close(b->f);
}

/* --synthetic: the model's layout as a GGUF without weight data (a sparse
 * file: metadata only), in $TMPDIR (default /tmp); the backend makes the
 * weights when the model is loaded. */
static int write_synthetic(opts *o) {
    const char *dir = getenv("TMPDIR");
    snprintf(o->syn_path, sizeof o->syn_path, "%s/ds4-synthetic-XXXXXX", dir && *dir ? dir : "/tmp");
    const int fd = mkstemp(o->syn_path);
    if (fd < 0) return tool_fail(CMD, "%s: %s", o->syn_path, strerror(errno));
    close(fd);
    if (o->syn_layers)
        snprintf(o->model_label, sizeof o->model_label, "synthetic %s (first %lld layers), seed %llu", o->synthetic,
                 (long long)o->syn_layers, (unsigned long long)o->seed);
    else
        snprintf(o->model_label, sizeof o->model_label, "synthetic %s, seed %llu", o->synthetic,
                 (unsigned long long)o->seed);
    ds4_error err = { 0 };
    fprintf(stderr, "ds4server bench: %s: layout in %s\n", o->model_label, o->syn_path);
    if (ds4_synth_write_layers(o->syn_path, o->syn_scale, o->syn_quant, o->seed, NULL, true, (int)o->syn_layers,
                               &err)) {
        unlink(o->syn_path);
        return tool_fail(CMD, "%s", err.message);
    }
    return 0;
}

int tool_bench(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--ops")) return bench_ops_main(argc - 1, argv + 1);
    bench *b = calloc(1, sizeof *b);
    if (!b) return tool_fail(CMD, "out of memory");
    int rc = parse_opts(argc, argv, &b->o);
    if (rc) {
        free(b);
        if (rc < 0) {
            print_help();
            return 0;
        }
        return rc;
    }
    opts *o = &b->o;
    ds4_error err = { 0 };
    double t0 = tool_now();
    if (o->synthetic && (rc = write_synthetic(o))) goto done;
    if (!o->synthetic) snprintf(o->model_label, sizeof o->model_label, "%s", o->model);
    const char *path = o->synthetic ? o->syn_path : o->model;
    if (gguf_open(path, &b->f, &err)) {
        rc = tool_fail(CMD, "%s", err.message);
        if (o->synthetic) unlink(o->syn_path);
        goto done;
    }
    if (o->synthetic) unlink(o->syn_path); /* the mapping stays; nothing is left behind */
    const double open_s = tool_now() - t0;
    /* fail now, not after a long run, when an output cannot be written */
    const char *outs[2] = { o->json, o->md };
    for (int i = 0; i < 2; i++) {
        FILE *probe = outs[i] ? fopen(outs[i], "a") : NULL;
        if (outs[i] && !probe) {
            rc = tool_fail(CMD, "%s: %s", outs[i], strerror(errno));
            goto done;
        }
        if (probe) fclose(probe);
    }
    variant *A = &b->var[0];
    snprintf(A->backend, sizeof A->backend, "%s", o->backend);
    A->num = o->num;
    A->threads = o->threads;
    if (o->ab == AB_COMMAND) { /* no model here: each round runs both variants as child processes */
        if (ds4_config_from_gguf(b->f, &b->cfg_file, &err)) {
            rc = tool_fail(CMD, "%s", err.message);
            goto done;
        }
        b->cfg = &b->cfg_file;
        char self[4096];
        const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        if (n <= 0) {
            rc = tool_fail(CMD, "cannot tell this binary's path (/proc/self/exe): %s", strerror(errno));
            goto done;
        }
        self[n] = 0;
        b->cmd[0] = sh_quote(self);
        b->cmd[1] = strdup(o->compare);
        if (!o->synthetic && !(b->model_abs = realpath(o->model, NULL))) {
            rc = tool_fail(CMD, "%s: %s", o->model, strerror(errno));
            goto done;
        }
        if (!b->cmd[0] || !b->cmd[1]) {
            rc = tool_fail(CMD, "out of memory");
            goto done;
        }
        if ((rc = run_compare(b))) goto done;
        goto report;
    }
    b->n_var = 1; /* from here bench_free releases what the variants own */
    fprintf(stderr, "ds4server bench: loading %s on %s\n", o->model_label, A->backend);
    if ((rc = load_variant(b, A))) goto done;
    A->load.open_s = open_s;
    b->cfg = ds4_model_config(A->m);
    if (o->ab) {
        variant *B = &b->var[1];
        *B = *A;
        B->owns = false;
        B->load.open_s = 0;
        if (o->ab == AB_NUMERICS) {
            B->num = o->ab_num;
        } else {
            if (o->ab == AB_BACKEND) snprintf(B->backend, sizeof B->backend, "%s", o->ab_value);
            else B->threads = atoll(o->ab_value);
            memset(&B->load, 0, sizeof B->load);
            B->be = NULL;
            B->m = NULL;
            b->n_var = 2;
            fprintf(stderr, "ds4server bench: loading %s on %s (variant B)\n", o->model_label, B->backend);
            if ((rc = load_variant(b, B))) goto done;
        }
        b->n_var = 2;
    }
    /* tokens for the largest need */
    int64_t need = o->ttft;
    for (int i = 0; i < o->n_prefill; i++) need = o->prefill[i] > need ? o->prefill[i] : need;
    for (int i = 0; i < o->n_ctx; i++) need = o->ctx[i] > need ? o->ctx[i] : need;
    for (int i = 0; i < o->n_batch; i++)
        need = o->batch_ctx + o->batch[i] > need ? o->batch_ctx + o->batch[i] : need;
    if ((uint64_t)need > b->cfg->context_length) need = (int64_t)b->cfg->context_length;
    b->n_tokens = need > 1 ? need : 1;
    b->tokens = malloc((size_t)b->n_tokens * sizeof *b->tokens);
    b->logits = malloc((size_t)b->cfg->n_vocab * sizeof *b->logits);
    if (!b->tokens || !b->logits) {
        rc = tool_fail(CMD, "out of memory");
        goto done;
    }
    fill_tokens(b->tokens, b->n_tokens, o->seed, b->cfg->n_vocab);
    weight_bytes_per_token(b);

    if (o->ab) {
        if ((rc = run_ab(b))) goto done;
    } else {
        if ((rc = run_prefill(b)) || (rc = run_decode(b)) || (rc = run_batch(b))) goto done;
    }
    ds4_backend_counters c;
    ds4_backend_counters_get(A->be, &c);
    b->peak = c.peak_bytes;
    if (b->n_var > 1 && b->var[1].owns) {
        ds4_backend_counters_get(b->var[1].be, &c);
        if (c.peak_bytes > b->peak) b->peak = c.peak_bytes;
    }
    if (!o->ab) run_bandwidth(b);

report:;
    prov p;
    get_provenance(b, &p);
    write_md(stdout, b, &p);
    write_md_batch(stdout, b);
    write_md_kernels(stdout, b);
    fflush(stdout);
    if (o->md) {
        FILE *mf = fopen(o->md, "w");
        if (!mf) {
            rc = tool_fail(CMD, "%s: %s", o->md, strerror(errno));
            goto done;
        }
        write_md(mf, b, &p);
        write_md_batch(mf, b);
        write_md_kernels(mf, b);
        if (ferror(mf) | (fclose(mf) != 0)) {
            rc = tool_fail(CMD, "%s: write failed", o->md);
            goto done;
        }
    }
    if (o->json) rc = write_json(b, &p, argc, argv);
done:
    bench_free(b);
    free(b);
    return rc;
}

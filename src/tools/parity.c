/*
 * parity.c - `ds4server parity`: one model file on two backends, compared op
 * by op, layer by layer and end to end.
 *
 *   ds4server parity -m FILE [--backends cpu,cuda] [--tokens 1,2,3 | --n-tokens N]
 *                    [--decode K] [--greedy N] [--layers N] [--numerics ds4|reference|ds4-f16]
 *                    [--seed S] [--threads N] [--json OUT] [--all-rows]
 *
 * Three passes, each over the same tokens (the last K of them decoded one at
 * a time after a batched prefill of the rest, so both paths are covered):
 *
 * 1. Op by op ("forced"). The first backend (the reference) runs with the
 *    model's inspection hook recording the output of every op. The second
 *    runs with a hook that compares its output of each op with the
 *    reference's and then overwrites it with the reference's values, so
 *    every op on the second backend starts from exactly the reference's
 *    inputs: each row measures one op's own error, not the drift of all the
 *    ops before it. Tolerances (normwise: max |a - b| / max |a|) follow the
 *    arithmetic of the op: pure data movement and rounding steps must agree
 *    to the bit (their inputs are identical); norms to a few float ulps;
 *    reductions (matmul, attention, HC mixing, MoE) to 64 ulps; routing and
 *    top-k selections exactly.
 * 2. Layer by layer and end to end ("free"). Both backends run on their own;
 *    each layer's output state and the logits are compared (drift, reported;
 *    the logits must stay within a tolerance of the numerics).
 * 3. Paths. On the second backend, token-by-token decoding of the whole
 *    sequence must match its batched prefill; with --greedy N both backends
 *    continue greedily for N tokens and the continuations must be identical.
 *
 * With --layers N only the first N layers run (no head, no logits): full-size
 * layers of a large file are checked without the whole model on the CPU.
 * Exit status: 0 when every check passed, 1 on a failure, 2 on bad usage.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backends/backend.h"
#include "core/error.h"
#include "core/gguf.h"
#include "models/deepseek4/ds4_model.h"
#include "session/sampling.h"
#include "tools/tools.h"

#define CMD "parity"

static const double F32_EPS = 1.1920928955078125e-7;

/* ------------------------------------------------------------ records */

typedef struct tap_rec {
    char name[32];
    int layer;
    int64_t token;
    int64_t n;
    float *data;
} tap_rec;

typedef struct tap_log {
    tap_rec *v;
    int64_t n, cap;
    bool oom;
} tap_log;

static void log_free(tap_log *l) {
    for (int64_t i = 0; i < l->n; i++) free(l->v[i].data);
    free(l->v);
    memset(l, 0, sizeof *l);
}

/* One row of the report: an op at a layer, over every call. */
typedef struct op_row {
    char name[32];
    int layer;
    int64_t calls, elems;
    double max_abs, max_ref; /* max |a - b|, max |a| */
    double worst_rel;        /* max over calls of max|a-b| / max|a| */
    double tol;
    bool exact;              /* selection: must be identical */
    int64_t mismatches;      /* exact rows: differing elements */
    bool bad_shape;          /* call sequence or sizes differed */
} op_row;

typedef struct report {
    op_row *v;
    int64_t n, cap;
} report;

static op_row *report_row(report *r, const char *name, int layer) {
    for (int64_t i = r->n - 1; i >= 0; i--)
        if (r->v[i].layer == layer && !strcmp(r->v[i].name, name)) return &r->v[i];
    if (r->n == r->cap) {
        int64_t cap = r->cap ? r->cap * 2 : 256;
        op_row *nv = realloc(r->v, (size_t)cap * sizeof *nv);
        if (!nv) return NULL;
        r->v = nv;
        r->cap = cap;
    }
    op_row *row = &r->v[r->n++];
    memset(row, 0, sizeof *row);
    snprintf(row->name, sizeof row->name, "%s", name);
    row->layer = layer;
    return row;
}

/* ------------------------------------------------------------ tolerances */

static bool has_suffix(const char *s, const char *x) {
    size_t a = strlen(s), b = strlen(x);
    return a >= b && !strcmp(s + a - b, x);
}

/* Selections must be identical. */
static bool op_is_selection(const char *name) { return !strcmp(name, "router_experts") || !strcmp(name, "idx_top_k"); }

/* Normwise tolerance of one op, from its arithmetic (inputs identical). */
static double op_tolerance(const char *name, ds4_numerics num) {
    /* Under DS4 numerics the MoE quantises each expert's SwiGLU output to
     * Q8: gate/up sums in another order (or an exp one ulp apart) can move
     * one mid value across a rounding boundary, which changes the output by
     * one Q8 step of that value (1/127 of its block's largest magnitude)
     * times a down-projection column: about 1e-3 of the output at most. */
    if (ds4_numerics_rounds(num) && !strcmp(name, "moe")) return 2e-3;
    /* data movement and rounding of identical inputs: bit-identical */
    if (!strcmp(name, "embed") || has_suffix(name, "_fp8") || has_suffix(name, "_f16") || has_suffix(name, "_qat") ||
        !strcmp(name, "comp_score") || !strcmp(name, "idx_comp_score"))
        return 0.0;
    /* one rounding of a double sum, a product, a rotation: a few ulps */
    if (has_suffix(name, "_norm") || has_suffix(name, "_rope") || !strcmp(name, "attn_rope_inv") ||
        !strcmp(name, "q_head_norm") || !strcmp(name, "shexp_swiglu") || !strcmp(name, "ffn_sum"))
        return 8 * F32_EPS;
    /* softmax pooling, router weights: short reductions and exp/log */
    if (has_suffix(name, "_pool") || !strcmp(name, "router_weights")) return 16 * F32_EPS;
    /* long reductions in another order (matmul, attention, HC, MoE, indexer) */
    return 64 * F32_EPS;
}

/* ------------------------------------------------------------ the hooks */

typedef struct tap_ctx {
    ds4_backend *be;    /* the backend whose buffers the hook sees */
    tap_log *log;       /* recording (reference) or replay (other) */
    int64_t next;       /* replay position */
    bool force;         /* overwrite with the reference's values */
    report *rep;        /* where comparisons go (replay) */
    float *scratch;     /* download buffer */
    int64_t scratch_cap;
    bool diverged;      /* the call sequence differed: stop comparing */
    const char *inject; /* harness self-test: perturb this op's output */
    ds4_numerics num;
    bool only_selections; /* record only expert / top-k choices */
    int64_t pos_base;     /* position of the evaluation's first token (records keep absolute positions) */
} tap_ctx;

static float *ctx_scratch(tap_ctx *c, int64_t n) {
    if (c->scratch_cap < n) {
        float *p = realloc(c->scratch, (size_t)n * sizeof *p);
        if (!p) return NULL;
        c->scratch = p;
        c->scratch_cap = n;
    }
    return c->scratch;
}

static void record_tap(void *vctx, const char *name, int layer, int64_t token, float *buf, int64_t n, bool host) {
    tap_ctx *c = vctx;
    tap_log *l = c->log;
    if (l->oom || (c->only_selections && !op_is_selection(name))) return;
    if (l->n == l->cap) {
        int64_t cap = l->cap ? l->cap * 2 : 1024;
        tap_rec *nv = realloc(l->v, (size_t)cap * sizeof *nv);
        if (!nv) { l->oom = true; return; }
        l->v = nv;
        l->cap = cap;
    }
    tap_rec *r = &l->v[l->n];
    snprintf(r->name, sizeof r->name, "%s", name);
    r->layer = layer;
    r->token = token < 0 ? token : c->pos_base + token;
    r->n = n;
    r->data = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!r->data) { l->oom = true; return; }
    if (host) memcpy(r->data, buf, (size_t)n * sizeof(float));
    else c->be->ops->download(c->be, r->data, buf, n);
    l->n++;
}

static void compare_into(op_row *row, const float *ref, const float *got, int64_t n) {
    double max_abs = 0, max_ref = 0;
    int64_t mism = 0;
    for (int64_t i = 0; i < n; i++) {
        double a = ref[i], b = got[i];
        double d = fabs(a - b);
        if (isnan(a) != isnan(b) || (isinf(a) || isinf(b) ? a != b : false)) d = INFINITY;
        else if (isnan(a) || isinf(a)) d = 0;
        if (d > max_abs || isnan(d)) max_abs = isnan(d) ? INFINITY : d;
        if (isfinite(a) && fabs(a) > max_ref) max_ref = fabs(a);
        if (a != b && !(isnan(a) && isnan(b))) mism++;
    }
    const double rel = max_abs == 0 ? 0 : max_ref > 0 ? max_abs / max_ref : INFINITY;
    row->calls++;
    row->elems += n;
    if (max_abs > row->max_abs) row->max_abs = max_abs;
    if (max_ref > row->max_ref) row->max_ref = max_ref;
    if (rel > row->worst_rel) row->worst_rel = rel;
    row->mismatches += mism;
}

static void replay_tap(void *vctx, const char *name, int layer, int64_t token, float *buf, int64_t n, bool host) {
    tap_ctx *c = vctx;
    if (c->diverged) return;
    op_row *row = report_row(c->rep, name, layer);
    if (!row) return;
    row->exact = op_is_selection(name);
    row->tol = row->exact ? 0 : op_tolerance(name, c->num);
    if (c->next >= c->log->n) {
        row->bad_shape = true;
        c->diverged = true;
        return;
    }
    const tap_rec *r = &c->log->v[c->next++];
    if (strcmp(r->name, name) || r->layer != layer || r->token != (token < 0 ? token : c->pos_base + token) ||
        r->n != n) {
        row->bad_shape = true;
        c->diverged = true;
        return;
    }
    float *got = host ? buf : ctx_scratch(c, n);
    if (!got) return;
    if (!host) c->be->ops->download(c->be, got, buf, n);
    if (c->inject && !strcmp(c->inject, name) && n > 0) got[n / 2] = got[n / 2] * 1.001f + 1e-3f;
    compare_into(row, r->data, got, n);
    if (c->force) {
        if (host) memcpy(buf, r->data, (size_t)n * sizeof(float));
        else c->be->ops->upload(c->be, buf, r->data, n);
    }
}

/* ------------------------------------------------------------ running */

typedef struct side {
    const char *name;
    ds4_backend *be;
    ds4_model *m;
} side;

/* Prefill all but the last `decode` tokens, then decode those one by one;
 * logits of every position into `logits` ([n, V], may be NULL). */
/* Prefill n - decode tokens, then decode the rest one by one; `rec` (NULL:
 * none) is a recording hook's context, told each evaluation's position. */
static ds4_status run_tokens(side *s, const int32_t *tokens, int64_t n, int64_t decode, ds4_numerics num,
                             float *logits, int64_t V, tap_ctx *rec, ds4_error *err) {
    ds4_state *st = NULL;
    ds4_status rc = ds4_state_create(s->m, n + 1, &st, err);
    const int64_t pre = n - decode;
    if (rec) rec->pos_base = 0;
    if (!rc && pre > 0) rc = ds4_model_eval(s->m, st, tokens, pre, num, logits, true, err);
    for (int64_t t = pre < 0 ? 0 : pre; !rc && t < n; t++) {
        if (rec) rec->pos_base = t;
        rc = ds4_model_eval(s->m, st, tokens + t, 1, num, logits ? logits + t * V : NULL, true, err);
    }
    ds4_state_free(st);
    if (rc) ds4_error_prefix(err, "%s backend", s->name);
    return rc;
}

/* true when some choice (expert ids, top-k rows) recorded in both logs for
 * the same op, layer and position came out differently. */
static bool selections_differ(const tap_log *a, const tap_log *b) {
    for (int64_t j = 0; j < b->n; j++) {
        const tap_rec *y = &b->v[j];
        if (!op_is_selection(y->name)) continue;
        for (int64_t i = 0; i < a->n; i++) {
            const tap_rec *x = &a->v[i];
            if (x->layer != y->layer || x->token != y->token || strcmp(x->name, y->name)) continue;
            if (x->n != y->n || memcmp(x->data, y->data, (size_t)x->n * sizeof(float))) return true;
            break;
        }
    }
    return false;
}

/* Normwise relative difference of two float arrays (max |a-b| / max |a|). */
static double normwise(const float *a, const float *b, int64_t n, double *max_abs_out) {
    double max_abs = 0, max_ref = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= max_abs)) max_abs = isnan(d) ? INFINITY : d;
        if (fabs(a[i]) > max_ref) max_ref = fabs(a[i]);
    }
    if (max_abs_out) *max_abs_out = max_abs;
    return max_abs == 0 ? 0 : max_ref > 0 ? max_abs / max_ref : INFINITY;
}

/* Greedy continuation of n_gen tokens after the prompt. */
static ds4_status greedy(side *s, const int32_t *prompt, int64_t n, int64_t n_gen, ds4_numerics num, int64_t V,
                         int32_t *out, ds4_error *err) {
    ds4_state *st = NULL;
    float *logits = malloc((size_t)V * sizeof *logits);
    ds4_status rc = logits ? ds4_state_create(s->m, n + n_gen + 1, &st, err)
                           : ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    if (!rc) rc = ds4_model_eval(s->m, st, prompt, n, num, logits, false, err);
    for (int64_t i = 0; !rc && i < n_gen; i++) {
        out[i] = ds4_sample_argmax(logits, V);
        if (i + 1 < n_gen) rc = ds4_model_eval(s->m, st, &out[i], 1, num, logits, false, err);
    }
    ds4_state_free(st);
    free(logits);
    if (rc) ds4_error_prefix(err, "%s backend", s->name);
    return rc;
}

/* ------------------------------------------------------------ output */

static const char *row_verdict(const op_row *r) {
    if (r->bad_shape) return "FAIL (call sequence)";
    if (r->exact) return r->mismatches ? "FAIL" : "PASS";
    return r->worst_rel <= r->tol ? "PASS" : "FAIL";
}

static void print_rows(const report *rep, bool all_rows) {
    printf("%-16s %5s %6s %12s %12s %10s  %s\n", "op", "layer", "calls", "max abs", "rel err", "tol", "result");
    /* per op: every layer when asked (or few layers), else the worst layer */
    for (int64_t i = 0; i < rep->n; i++) {
        const op_row *r = &rep->v[i];
        if (!all_rows) {
            bool worst = true;
            for (int64_t j = 0; j < rep->n; j++) {
                if (strcmp(rep->v[j].name, r->name)) continue;
                const op_row *o = &rep->v[j];
                bool o_fail = strcmp(row_verdict(o), "PASS") != 0, r_fail = strcmp(row_verdict(r), "PASS") != 0;
                if (j != i && (o_fail > r_fail || (o_fail == r_fail && o->worst_rel > r->worst_rel) ||
                               (o_fail == r_fail && o->worst_rel == r->worst_rel && j < i)))
                    worst = false;
            }
            if (!worst) continue;
        }
        char layer[16];
        if (r->layer < 0) snprintf(layer, sizeof layer, "-");
        else snprintf(layer, sizeof layer, "%d", r->layer);
        printf("%-16s %5s %6lld %12.4g %12.4g %10.3g  %s", r->name, layer, (long long)r->calls, r->max_abs,
               r->worst_rel, r->tol, row_verdict(r));
        if (r->exact && r->mismatches) printf(" (%lld differ)", (long long)r->mismatches);
        printf("\n");
    }
}

static void json_rows(FILE *f, const report *rep) {
    fprintf(f, "  \"ops\": [\n");
    for (int64_t i = 0; i < rep->n; i++) {
        const op_row *r = &rep->v[i];
        fprintf(f, "    {\"op\": \"%s\", \"layer\": %d, \"calls\": %lld, \"elements\": %lld, \"max_abs\": %.9g, "
                "\"rel_err\": %.9g, \"tol\": %.9g, \"exact\": %s, \"mismatches\": %lld, \"pass\": %s}%s\n",
                r->name, r->layer, (long long)r->calls, (long long)r->elems, isfinite(r->max_abs) ? r->max_abs : 1e300,
                isfinite(r->worst_rel) ? r->worst_rel : 1e300, r->tol, r->exact ? "true" : "false",
                (long long)r->mismatches, strcmp(row_verdict(r), "PASS") ? "false" : "true",
                i + 1 < rep->n ? "," : "");
    }
    fprintf(f, "  ]");
}

/* ------------------------------------------------------------ main */

static int usage_error(const char *msg) {
    tool_fail(CMD, "%s (see ds4server parity --help)", msg);
    return 2;
}

int tool_parity(int argc, char **argv) {
    const char *model = NULL, *backends = "cpu,cuda", *tokens_s = NULL, *json = NULL, *numerics = "reference";
    const char *inject = NULL;
    int64_t n_tokens = 8, decode = 2, n_greedy = 0;
    int layers = 0, threads = 0;
    uint64_t seed = 1;
    bool all_rows = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: ds4server parity -m FILE [--backends cpu,cuda] [--tokens 1,2,3 | --n-tokens N]\n"
                   "                        [--decode K] [--greedy N] [--layers N] [--numerics reference|ds4|ds4-f16]\n"
                   "                        [--seed S] [--threads N] [--json OUT] [--all-rows]\n"
                   "  Runs the same tokens through two backends (the first is the reference) and compares\n"
                   "  every op's output with the reference's inputs forced, then each layer and the logits\n"
                   "  free-running, then decode vs prefill (and --greedy N continuations).\n"
                   "  --n-tokens N   N seeded random tokens (default 8); the last --decode K (default 2)\n"
                   "                 are decoded one at a time after a batched prefill\n"
                   "  --layers N     only the first N layers (no head): for full-size files\n"
                   "  --all-rows     one table row per op and layer (default: the worst layer per op)\n"
                   "  --inject-error OP  perturb one element of OP's output on the second backend (a\n"
                   "                 self-test: that op must then FAIL)\n");
            return 0;
        }
        if (!strcmp(a, "--all-rows")) { all_rows = true; continue; }
        if (!v) return usage_error("an option is missing its value");
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--backends")) backends = v;
        else if (!strcmp(a, "--tokens")) tokens_s = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--numerics")) numerics = v;
        else if (!strcmp(a, "--n-tokens")) n_tokens = atoll(v);
        else if (!strcmp(a, "--decode")) decode = atoll(v);
        else if (!strcmp(a, "--greedy")) n_greedy = atoll(v);
        else if (!strcmp(a, "--layers")) layers = atoi(v);
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--seed")) seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--inject-error")) inject = v;
        else return usage_error("unknown option");
        i++;
    }
    if (!model) return usage_error("no model given (-m FILE)");
    ds4_numerics num;
    if (!ds4_numerics_parse(numerics, &num)) return usage_error("--numerics must be " DS4_NUMERICS_NAMES);
    char names[2][32];
    const char *comma = strchr(backends, ',');
    if (!comma || comma == backends || !comma[1] || strchr(comma + 1, ',') || (size_t)(comma - backends) >= 32 ||
        strlen(comma + 1) >= 32)
        return usage_error("--backends takes two names, e.g. cpu,cuda");
    snprintf(names[0], sizeof names[0], "%.*s", (int)(comma - backends), backends);
    snprintf(names[1], sizeof names[1], "%s", comma + 1);
    if (n_tokens < 1 || n_tokens > 65536 || decode < 0 || n_greedy < 0 || n_greedy > 4096 || layers < 0)
        return usage_error("a count is out of range");

    ds4_error err = { 0 };
    gguf_file *f = NULL;
    side s[2] = { { names[0], NULL, NULL }, { names[1], NULL, NULL } };
    int32_t *tokens = NULL, *gen[2] = { NULL, NULL };
    float *lg[2] = { NULL, NULL }, *lg_dec = NULL;
    report rep = { 0 };
    tap_log ref_log = { 0 };
    tap_ctx rec = { 0 }, rpl = { 0 };
    int rc = 0;
    if (tokens_s && !(tokens = tool_parse_tokens(tokens_s, &n_tokens)))
        return usage_error("--tokens must be a comma-separated list of token ids");
    if (gguf_open(model, &f, &err)) {
        rc = tool_fail(CMD, "%s", err.message);
        goto done;
    }
    for (int k = 0; k < 2; k++) {
        if (ds4_backend_create(s[k].name, threads, &s[k].be, &err) || ds4_model_load(f, s[k].be, &s[k].m, &err)) {
            rc = tool_fail(CMD, "%s backend: %s", s[k].name, err.message);
            goto done;
        }
        ds4_model_set_layer_limit(s[k].m, layers);
    }
    const ds4_config *cfg = ds4_model_config(s[0].m);
    const int64_t V = cfg->n_vocab;
    if (!tokens) {
        tokens = malloc((size_t)n_tokens * sizeof *tokens);
        uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 1;
        for (int64_t i = 0; tokens && i < n_tokens; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            tokens[i] = (int32_t)(x % (uint64_t)V);
        }
    }
    if (decode > n_tokens) decode = n_tokens;
    const bool with_head = layers == 0 || layers >= cfg->n_layer;
    lg[0] = malloc((size_t)(n_tokens * V) * sizeof(float));
    lg[1] = malloc((size_t)(n_tokens * V) * sizeof(float));
    lg_dec = malloc((size_t)(n_tokens * V) * sizeof(float));
    gen[0] = calloc((size_t)n_greedy + 1, sizeof(int32_t));
    gen[1] = calloc((size_t)n_greedy + 1, sizeof(int32_t));
    if (!tokens || !lg[0] || !lg[1] || !lg_dec || !gen[0] || !gen[1]) {
        rc = tool_fail(CMD, "out of memory");
        goto done;
    }
    printf("parity: %s, %s (reference) vs %s, %s numerics, %lld tokens (%lld decoded), %d of %d layers%s\n", model,
           s[0].name, s[1].name, numerics, (long long)n_tokens, (long long)decode, layers ? layers : cfg->n_layer,
           cfg->n_layer, with_head ? " + head" : "");

    /* 1. op by op, the second backend forced onto the reference's values */
    rec.be = s[0].be;
    rec.log = &ref_log;
    ds4_model_set_tap(s[0].m, record_tap, &rec);
    if (run_tokens(&s[0], tokens, n_tokens, decode, num, lg[0], V, &rec, &err)) {
        rc = tool_fail(CMD, "%s", err.message);
        goto done;
    }
    ds4_model_set_tap(s[0].m, NULL, NULL);
    if (ref_log.oom) {
        rc = tool_fail(CMD, "out of memory recording the reference's ops (use fewer tokens or --layers)");
        goto done;
    }
    rpl.be = s[1].be;
    rpl.log = &ref_log;
    rpl.force = true;
    rpl.rep = &rep;
    rpl.inject = inject;
    rpl.num = num;
    ds4_model_set_tap(s[1].m, replay_tap, &rpl);
    if (run_tokens(&s[1], tokens, n_tokens, decode, num, lg[1], V, &rpl, &err)) {
        rc = tool_fail(CMD, "%s", err.message);
        goto done;
    }
    ds4_model_set_tap(s[1].m, NULL, NULL);
    if (rpl.next != ref_log.n) {
        op_row *row = report_row(&rep, "(sequence)", -1);
        if (row) row->bad_shape = true;
    }
    log_free(&ref_log);
    int64_t failed_ops = 0;
    for (int64_t i = 0; i < rep.n; i++) failed_ops += strcmp(row_verdict(&rep.v[i]), "PASS") != 0;
    printf("\nop by op (each op from the reference's inputs): %lld rows, %lld failed\n", (long long)rep.n,
           (long long)failed_ops);
    print_rows(&rep, all_rows || (layers && layers <= 4) || cfg->n_layer <= 8);

    /* 2. free-running: each layer's state and the logits */
    report drift = { 0 };
    tap_log logs[2] = { { 0 }, { 0 } };
    tap_ctx rc2[2] = { { 0 }, { 0 } };
    for (int k = 0; k < 2; k++) {
        rc2[k].be = s[k].be;
        rc2[k].log = &logs[k];
        ds4_model_set_tap(s[k].m, record_tap, &rc2[k]);
        ds4_status st = run_tokens(&s[k], tokens, n_tokens, decode, num, lg[k], V, &rc2[k], &err);
        ds4_model_set_tap(s[k].m, NULL, NULL);
        if (st) {
            rc = tool_fail(CMD, "%s", err.message);
            log_free(&logs[0]);
            log_free(&logs[1]);
            goto done;
        }
    }
    /* Drift is judged against the first discrete decision that came out
     * differently (an expert or a top-k row chosen on a near-tie): before
     * it, every layer must stay within the numerics' tolerance; after it,
     * the two runs legitimately compute different things. */
    const double layer_tol = num == DS4_NUMERICS_REFERENCE ? 1e-3 : 5e-2;
    int64_t first_flip = -1, first_drift = -1, flips = 0, selections = 0;
    for (int64_t i = 0; i < logs[0].n && i < logs[1].n; i++) {
        const tap_rec *a = &logs[0].v[i], *b = &logs[1].v[i];
        if (strcmp(a->name, b->name) || a->n != b->n) break;
        if (op_is_selection(a->name)) {
            selections++;
            if (memcmp(a->data, b->data, (size_t)a->n * sizeof(float))) {
                flips++;
                if (first_flip < 0) first_flip = i;
            }
        }
        if (strcmp(a->name, "ffn_X")) continue;
        op_row *row = report_row(&drift, "layer_out", a->layer);
        if (!row) continue;
        double before = row->worst_rel;
        row->worst_rel = 0;
        compare_into(row, a->data, b->data, a->n);
        if (row->worst_rel > layer_tol && first_drift < 0) first_drift = i;
        if (before > row->worst_rel) row->worst_rel = before;
    }
    log_free(&logs[0]);
    bool flipped = first_flip >= 0;
    const bool drift_ok = first_drift < 0 || (flipped && first_flip < first_drift);
    printf("\nfree-running, each layer's output state (tol %.3g until a selection differs):\n", layer_tol);
    printf("%5s %12s %12s\n", "layer", "max abs", "rel err");
    for (int64_t i = 0; i < drift.n; i++)
        printf("%5d %12.4g %12.4g\n", drift.v[i].layer, drift.v[i].max_abs, drift.v[i].worst_rel);
    printf("selections (experts, top-k rows) that differ: %lld of %lld%s; layer drift: %s\n", (long long)flips,
           (long long)selections, flipped ? " (near-ties: the runs diverge from there)" : "",
           drift_ok ? "PASS" : "FAIL (drift beyond tolerance before any selection differed)");
    /* logits: float32 throughout allows ~1e-4 of drift over the layers; DS4's
     * FP8 / Q8 steps can flip single roundings, so its bound is wider */
    const double logit_tol = layer_tol;
    double lg_rel = 0, lg_abs = 0, dec_rel = 0, dec_abs = 0;
    int64_t agree = 0;
    bool logits_ok = true, dec_ok = true, dec_judged = true, greedy_ok = true;
    if (with_head) {
        lg_rel = normwise(lg[0], lg[1], n_tokens * V, &lg_abs);
        for (int64_t t = 0; t < n_tokens; t++)
            agree += ds4_sample_argmax(lg[0] + t * V, V) == ds4_sample_argmax(lg[1] + t * V, V);
        logits_ok = lg_rel <= logit_tol || flipped;
        printf("logits: max abs %.4g, rel err %.4g (tol %.3g), argmax agrees at %lld of %lld positions: %s\n",
               lg_abs, lg_rel, logit_tol, (long long)agree, (long long)n_tokens,
               lg_rel <= logit_tol ? "PASS" : flipped ? "diverged after a selection near-tie (not judged)" : "FAIL");
        /* 3. decode vs prefill on the second backend. The two runs may use
         * different kernels (batched vs one-row products) and so round
         * differently: a choice that then differs at the same position
         * (a near-tie) legitimately changes everything after it. */
        tap_log dec_log = { 0 };
        tap_ctx dc = { 0 };
        dc.be = s[1].be;
        dc.log = &dec_log;
        dc.only_selections = true;
        ds4_model_set_tap(s[1].m, record_tap, &dc);
        ds4_status dst = run_tokens(&s[1], tokens, n_tokens, n_tokens, num, lg_dec, V, &dc, &err);
        ds4_model_set_tap(s[1].m, NULL, NULL);
        if (dst) {
            log_free(&dec_log);
            log_free(&logs[1]);
            rc = tool_fail(CMD, "%s", err.message);
            goto done;
        }
        const bool dec_flip = selections_differ(&logs[1], &dec_log);
        log_free(&dec_log);
        dec_rel = normwise(lg[1], lg_dec, n_tokens * V, &dec_abs);
        /* under ds4-f16 a prompt's products take binary16 operands and a
         * decoded token's Q8_0 activations: two numerics, compared for the
         * record only */
        dec_judged = num != DS4_NUMERICS_DS4_F16;
        dec_ok = !dec_judged || dec_rel <= logit_tol || dec_flip;
        printf("%s: token-by-token decode vs prefill+decode: max abs %.4g, rel err %.4g: %s\n", s[1].name, dec_abs,
               dec_rel, !dec_judged ? "not judged (ds4-f16: the prefill's products are binary16, decode's Q8_0)"
                        : dec_rel <= logit_tol ? "PASS"
                        : dec_flip             ? "diverged after a selection near-tie (not judged)"
                                               : "FAIL");
        if (n_greedy > 0) {
            /* the expert / top-k choices of both runs, to explain a difference */
            tap_log sl[2] = { { 0 }, { 0 } };
            tap_ctx sc[2] = { { 0 }, { 0 } };
            ds4_status gst = DS4_OK;
            for (int k = 0; k < 2 && !gst; k++) {
                sc[k].be = s[k].be;
                sc[k].log = &sl[k];
                sc[k].only_selections = true;
                ds4_model_set_tap(s[k].m, record_tap, &sc[k]);
                gst = greedy(&s[k], tokens, n_tokens, n_greedy, num, V, gen[k], &err);
                ds4_model_set_tap(s[k].m, NULL, NULL);
            }
            bool gen_flip = false;
            for (int64_t i = 0; !gst && i < sl[0].n && i < sl[1].n && !gen_flip; i++)
                gen_flip = sl[0].v[i].n != sl[1].v[i].n ||
                           memcmp(sl[0].v[i].data, sl[1].v[i].data, (size_t)sl[0].v[i].n * sizeof(float)) != 0;
            log_free(&sl[0]);
            log_free(&sl[1]);
            if (gst) {
                log_free(&logs[1]);
                rc = tool_fail(CMD, "%s", err.message);
                goto done;
            }
            flipped = flipped || gen_flip;
            int64_t same = 0;
            while (same < n_greedy && gen[0][same] == gen[1][same]) same++;
            greedy_ok = same == n_greedy || flipped;
            printf("greedy %lld tokens: %s", (long long)n_greedy,
                   same == n_greedy ? "identical: PASS\n" : flipped ? "differ after a selection near-tie (not judged)"
                                                                      : "differ: FAIL");
            if (same < n_greedy) printf(" (first difference at token %lld)\n", (long long)same);
        }
    }
    log_free(&logs[1]);
    const bool pass = failed_ops == 0 && drift_ok && logits_ok && dec_ok && greedy_ok;
    printf("\nparity: %s\n", pass ? "PASS" : "FAIL");
    if (json) {
        FILE *jf = fopen(json, "w");
        if (!jf) {
            rc = tool_fail(CMD, "%s: %s", json, strerror(errno));
        } else {
            fprintf(jf, "{\n  \"model\": \"");
            tool_json_escape(jf, model, strlen(model));
            fprintf(jf, "\",\n  \"reference\": \"%s\",\n  \"backend\": \"%s\",\n  \"numerics\": \"%s\",\n"
                    "  \"tokens\": %lld,\n  \"decoded\": %lld,\n  \"layers\": %d,\n", s[0].name, s[1].name, numerics,
                    (long long)n_tokens, (long long)decode, layers ? layers : cfg->n_layer);
            json_rows(jf, &rep);
            fprintf(jf, ",\n  \"layer_drift\": [");
            for (int64_t i = 0; i < drift.n; i++)
                fprintf(jf, "%s{\"layer\": %d, \"max_abs\": %.9g, \"rel_err\": %.9g}", i ? ", " : "",
                        drift.v[i].layer, drift.v[i].max_abs, drift.v[i].worst_rel);
            fprintf(jf, "],\n  \"selections\": {\"checked\": %lld, \"differ\": %lld},\n  \"drift_pass\": %s,\n",
                    (long long)selections, (long long)flips, drift_ok ? "true" : "false");
            fprintf(jf, "  \"logits\": {\"checked\": %s, \"max_abs\": %.9g, \"rel_err\": %.9g, \"tol\": %.9g, "
                    "\"argmax_agree\": %lld, \"pass\": %s},\n", with_head ? "true" : "false", lg_abs, lg_rel,
                    logit_tol, (long long)agree, logits_ok ? "true" : "false");
            fprintf(jf, "  \"decode_vs_prefill\": {\"rel_err\": %.9g, \"judged\": %s, \"pass\": %s},\n", dec_rel,
                    dec_judged ? "true" : "false", dec_ok ? "true" : "false");
            fprintf(jf, "  \"greedy\": {\"tokens\": %lld, \"pass\": %s},\n", (long long)(with_head ? n_greedy : 0),
                    greedy_ok ? "true" : "false");
            fprintf(jf, "  \"pass\": %s\n}\n", pass ? "true" : "false");
            if (fclose(jf) != 0) rc = tool_fail(CMD, "%s: %s", json, strerror(errno));
        }
    }
    free(drift.v);
    if (!rc && !pass) rc = 1;
done:
    for (int k = 0; k < 2; k++) {
        ds4_model_free(s[k].m);
        ds4_backend_destroy(s[k].be);
        free(lg[k]);
        free(gen[k]);
    }
    free(lg_dec);
    free(tokens);
    free(rep.v);
    free(rpl.scratch);
    log_free(&ref_log);
    gguf_close(f);
    return rc;
}

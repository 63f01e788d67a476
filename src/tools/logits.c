/*
 * logits.c - `ds4server logits`: float32 logits for every position.
 *
 *   ds4server logits -m FILE --tokens 1,2,3,... --out PATH [--backend cpu|cuda]
 *                    [--numerics ds4|reference|ds4-f16] [--incremental | --chunks A,B,...] [--threads N]
 *                    [--greedy N]
 *
 * Writes [n_tokens x vocab] float32 little-endian. By default the whole
 * sequence is prefilled in one call; --incremental feeds one token at a time
 * (the decode path); --chunks evaluates successive batches of the given sizes
 * (then the rest in one batch), i.e. prefill, then prefill again from a
 * non-zero position. Every split must give the same logits: that is a test.
 * --greedy N then decodes N more tokens, each the argmax of the previous
 * logits, appending their logits rows too; the generated ids, a count of
 * non-finite logits and (CUDA) the peak device memory go to stdout.
 * --profile (with --greedy) times the decode steps op by op: after every op
 * the backend is synchronised (a one-float download) and the wall time since
 * the previous op is charged to it; a table of the ops by total time, with
 * the time per decoded token, goes to stdout. The synchronisation slows the
 * run down; the table shows where the time goes, not the speed.
 */
#include <errno.h>
#include <math.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/backend.h"
#include "core/error.h"
#include "core/gguf.h"
#include "models/deepseek4/ds4_model.h"
#include "session/sampling.h"
#include "tools/tools.h"
#ifdef DS4_WITH_CUDA
#include "backends/cuda/cuda_backend.h"
#endif

/* --profile: wall time per op name, charged between consecutive ops. */
typedef struct op_time {
    char name[32];
    double seconds;
    int64_t calls;
} op_time;

typedef struct profiler {
    ds4_backend *be;
    bool on;
    double last;
    op_time ops[128];
    int n_ops;
} profiler;

static void profile_tap(void *ctx, const char *name, int layer, int64_t token, float *buf, int64_t n, bool host) {
    profiler *p = ctx;
    if (!p->on) return;
    float one;
    if (!host && n > 0) p->be->ops->download(p->be, &one, buf, 1); /* waits for the op */
    const double t = tool_now();
    int i = 0;
    while (i < p->n_ops && strcmp(p->ops[i].name, name)) i++;
    if (i == p->n_ops && p->n_ops < 128) snprintf(p->ops[p->n_ops++].name, sizeof p->ops[0].name, "%s", name);
    if (i < p->n_ops) {
        p->ops[i].seconds += t - p->last;
        p->ops[i].calls++;
    }
    p->last = t;
}

static int by_time(const void *a, const void *b) {
    const op_time *x = a, *y = b;
    return x->seconds < y->seconds ? 1 : x->seconds > y->seconds ? -1 : 0;
}

int tool_logits(int argc, char **argv) {
    const char *model = NULL, *tokens_s = NULL, *out = NULL, *backend = "cpu", *numerics = "ds4", *chunks_s = NULL;
    bool incremental = false;
    long long n_greedy = 0;
    bool profile = false;
    static profiler prof;
    int threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: ds4server logits -m FILE --tokens 1,2,3 --out PATH [--backend cpu] "
                   "[--numerics ds4|reference|ds4-f16] [--incremental | --chunks A,B,...] [--threads N] [--greedy N]\n");
            return 0;
        }
        if (!strcmp(a, "--profile")) {
            profile = true;
            continue;
        }
        if (!strcmp(a, "--incremental")) { incremental = true; continue; }
        if (!v) return tool_fail("logits", "%s needs a value", a);
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--tokens")) tokens_s = v;
        else if (!strcmp(a, "--out") || !strcmp(a, "-o")) out = v;
        else if (!strcmp(a, "--backend")) backend = v;
        else if (!strcmp(a, "--numerics")) numerics = v;
        else if (!strcmp(a, "--chunks")) chunks_s = v;
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--greedy")) n_greedy = atoll(v);
        else return tool_fail("logits", "unknown option '%s'", a);
        i++;
    }
    if (!model || !tokens_s || !out) return tool_fail("logits", "usage: ds4server logits -m FILE --tokens 1,2,3 --out PATH");
    if (n_greedy < 0 || n_greedy > 1000000) return tool_fail("logits", "--greedy must be between 0 and 1000000");
    ds4_numerics num;
    if (!ds4_numerics_parse(numerics, &num))
        return tool_fail("logits", "unknown --numerics '%s' (" DS4_NUMERICS_NAMES ")", numerics);
    int64_t n, n_chunks = 0;
    int32_t *tokens = tool_parse_tokens(tokens_s, &n);
    if (!tokens) return tool_fail("logits", "--tokens must be a comma-separated list of token ids");
    int32_t *chunks = chunks_s ? tool_parse_tokens(chunks_s, &n_chunks) : NULL;
    if (chunks_s && !chunks) {
        free(tokens);
        return tool_fail("logits", "--chunks must be a comma-separated list of batch sizes");
    }

    ds4_error err = { 0 };
    gguf_file *f = NULL;
    ds4_backend *be = NULL;
    ds4_model *m = NULL;
    ds4_state *st = NULL;
    float *logits = NULL;
    FILE *fp = NULL;
    int rc = 0;
    char *tmp = NULL;
    if (gguf_open(model, &f, &err) || ds4_backend_create(backend, threads, &be, &err) ||
        ds4_model_load(f, be, &m, &err) || ds4_state_create(m, n + n_greedy, &st, &err)) {
        rc = tool_fail("logits", "%s", err.message);
        goto done;
    }
    const int64_t V = ds4_model_config(m)->n_vocab;
    logits = malloc((size_t)((n + n_greedy) * V) * sizeof *logits);
    if (!logits) {
        rc = tool_fail("logits", "out of memory for %lld x %lld logits", (long long)n, (long long)V);
        goto done;
    }
    for (int64_t done = 0, c = 0; done < n && !rc; c++) {
        int64_t len = incremental ? 1 : c < n_chunks ? chunks[c] : n - done;
        if (len < 1 || len > n - done) len = n - done;
        if (ds4_model_eval(m, st, tokens + done, len, num, logits + done * V, true, &err))
            rc = tool_fail("logits", "%s", err.message);
        done += len;
    }
    if (rc) goto done;
    if (profile) {
        memset(&prof, 0, sizeof prof);
        prof.be = be;
        prof.on = true;
        ds4_model_set_tap(m, profile_tap, &prof);
    }
    const double t_gen = tool_now();
    prof.last = t_gen;
    if (n_greedy > 0) printf("generated:");
    for (int64_t g = 0; g < n_greedy && !rc; g++) {
        int32_t next = ds4_sample_argmax(logits + (n + g - 1) * V, V);
        printf("%s%d", g ? "," : " ", next);
        if (ds4_model_eval(m, st, &next, 1, num, logits + (n + g) * V, true, &err))
            rc = tool_fail("logits", "%s", err.message);
    }
    if (n_greedy > 0) printf("\n");
    if (rc) goto done;
    if (n_greedy > 0)
        printf("decode: %lld tokens in %.3f s, %.2f tokens/s%s\n", n_greedy, tool_now() - t_gen,
               (double)n_greedy / (tool_now() - t_gen), profile ? " (synchronised after every op: --profile)" : "");
    if (profile && n_greedy > 0) {
        ds4_model_set_tap(m, NULL, NULL);
        qsort(prof.ops, (size_t)prof.n_ops, sizeof prof.ops[0], by_time);
        double total = 0;
        for (int i = 0; i < prof.n_ops; i++) total += prof.ops[i].seconds;
        printf("%-18s %10s %12s %8s\n", "op (ends at)", "calls/tok", "ms/token", "share");
        for (int i = 0; i < prof.n_ops; i++)
            printf("%-18s %10.1f %12.3f %7.1f%%\n", prof.ops[i].name, (double)prof.ops[i].calls / (double)n_greedy,
                   1e3 * prof.ops[i].seconds / (double)n_greedy, 100.0 * prof.ops[i].seconds / (total > 0 ? total : 1));
    }
    n += n_greedy;
    int64_t bad = 0;
    for (int64_t i = 0; i < n * V; i++) bad += !isfinite(logits[i]);
    printf("logits: %lld positions, %lld non-finite values\n", (long long)n, (long long)bad);
#ifdef DS4_WITH_CUDA
    if (!strncmp(be->ops->name, "cuda", 4))
        printf("device memory: weights %.2f GiB, peak in use %.2f GiB\n",
               (double)ds4_cuda_backend_weight_bytes(be) / 1073741824.0,
               (double)ds4_cuda_backend_peak_bytes(be) / 1073741824.0);
#endif
    tmp = malloc(strlen(out) + 5);
    if (!tmp) { rc = tool_fail("logits", "out of memory"); goto done; }
    sprintf(tmp, "%s.tmp", out);
    fp = fopen(tmp, "wb");
    if (!fp || fwrite(logits, sizeof *logits, (size_t)(n * V), fp) != (size_t)(n * V) || fclose(fp) != 0) {
        fp = NULL;
        unlink(tmp);
        rc = tool_fail("logits", "%s: %s", out, strerror(errno));
        goto done;
    }
    fp = NULL;
    if (rename(tmp, out) != 0) rc = tool_fail("logits", "%s: %s", out, strerror(errno));
done:
    free(tmp);
    free(logits);
    free(tokens);
    free(chunks);
    ds4_state_free(st);
    ds4_model_free(m);
    ds4_backend_destroy(be);
    gguf_close(f);
    return rc;
}

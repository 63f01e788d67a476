/*
 * cli.c - the generation core shared by `ds4server run` and `ds4server chat`.
 */
#define _POSIX_C_SOURCE 200809L
#include "tools/cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backends/backend.h"
#include "session/engine.h"
#include "tools/tools.h"

volatile sig_atomic_t cli_interrupted;

static void on_sigint(int sig) {
    (void)sig;
    cli_interrupted = 1;
}

void cli_install_sigint(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0; /* no SA_RESTART: a blocking read returns EINTR */
    sigaction(SIGINT, &sa, NULL);
}

void cli_opts_defaults(cli_opts *o) {
    memset(o, 0, sizeof *o);
    o->backend = "cpu";
    o->ctx = 8192;
    o->n_predict = 512;
    o->threads = 0;
    o->numerics = DS4_NUMERICS_MODE_DS4;
    o->pretok = DS4_PRETOK_OFFICIAL;
    o->think = DS4_CHAT_THINK_HIGH;
    o->sampling = ds4_sampler_defaults();
}

const char *cli_common_usage(void) {
    return "  -m, --model FILE          model file (GGUF)\n"
           "  --backend cpu|cuda        compute backend (default cpu)\n"
           "  --threads N               CPU threads (default: one per core)\n"
           "  --ctx N                   context size in tokens (default 8192)\n"
           "  -n N                      maximum tokens to generate (default 512)\n"
           "  --think | --nothink | --think-max   thinking mode (default --think)\n"
           "  --system TEXT             system prompt\n"
           "  --temp T --top-p P --top-k K --min-p M --seed S   sampling (DS4 defaults 1 / 1 / 0 / 0.05)\n"
           "  --numerics ds4|reference|ds4-f16  rounding steps (default ds4; ds4-f16: a prompt's Q8_0\n"
           "                    and F16 products in binary16, as DS4's CUDA prefill)\n"
           "  --pretokenizer official|ds4   pre-tokenizer rules (default official)\n";
}

static bool parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    *out = strtod(s, &end);
    return !errno && end != s && !*end;
}

static bool parse_int(const char *s, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    *out = v;
    return !errno && end != s && !*end;
}

int cli_parse_common(const char *cmd, cli_opts *o, int argc, char **argv, int *i) {
    const char *a = argv[*i];
    if (!strcmp(a, "--think")) { o->think = DS4_CHAT_THINK_HIGH; return 1; }
    if (!strcmp(a, "--nothink")) { o->think = DS4_CHAT_THINK_NONE; return 1; }
    if (!strcmp(a, "--think-max")) { o->think = DS4_CHAT_THINK_MAX; return 1; }
    static const char *const WITH_VALUE[] = { "-m", "--model", "--backend", "--threads", "--ctx", "-n", "--system",
                                              "--temp", "--top-p", "--top-k", "--min-p", "--seed", "--numerics",
                                              "--pretokenizer", "-p", "--prompt", NULL };
    bool known = false;
    for (int k = 0; WITH_VALUE[k]; k++) known |= !strcmp(a, WITH_VALUE[k]);
    if (!known) return 0;
    if (*i + 1 >= argc) {
        tool_fail(cmd, "%s needs a value", a);
        return -1;
    }
    const char *v = argv[++*i];
    double d;
    int64_t n;
    if (!strcmp(a, "-m") || !strcmp(a, "--model")) o->model = v;
    else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) o->prompt = v;
    else if (!strcmp(a, "--backend")) o->backend = v;
    else if (!strcmp(a, "--system")) o->system = v;
    else if (!strcmp(a, "--numerics")) {
        ds4_numerics num;
        if (!ds4_numerics_parse(v, &num)) {
            tool_fail(cmd, "--numerics must be " DS4_NUMERICS_NAMES ", not '%s'", v);
            return -1;
        }
        o->numerics = (ds4_numerics_mode)num; /* the same numbers (backend.c) */
    } else if (!strcmp(a, "--pretokenizer")) {
        if (!strcmp(v, "official")) o->pretok = DS4_PRETOK_OFFICIAL;
        else if (!strcmp(v, "ds4")) o->pretok = DS4_PRETOK_DS4;
        else { tool_fail(cmd, "--pretokenizer must be official or ds4"); return -1; }
    } else if (!strcmp(a, "--threads") || !strcmp(a, "--ctx") || !strcmp(a, "-n") || !strcmp(a, "--top-k") ||
               !strcmp(a, "--seed")) {
        if (!parse_int(v, &n) || (n < 0 && strcmp(a, "--top-k"))) {
            tool_fail(cmd, "%s '%s' is not a valid number", a, v);
            return -1;
        }
        if (!strcmp(a, "--threads")) o->threads = (int)n;
        else if (!strcmp(a, "--ctx")) o->ctx = n;
        else if (!strcmp(a, "-n")) o->n_predict = n;
        else if (!strcmp(a, "--top-k")) o->sampling.top_k = (int)n;
        else o->sampling.seed = (uint64_t)n;
    } else {
        if (!parse_double(v, &d)) {
            tool_fail(cmd, "%s '%s' is not a number", a, v);
            return -1;
        }
        if (!strcmp(a, "--temp")) o->sampling.temperature = (float)d;
        else if (!strcmp(a, "--top-p")) o->sampling.top_p = (float)d;
        else o->sampling.min_p = (float)d;
    }
    return 1;
}

/* Model loading progress on stderr (only when it is a terminal); ctx is the
 * label. */
static bool load_bar(void *ctx, int64_t done, int64_t total) {
    int width = 40, filled = (int)(width * (double)done / (double)(total ? total : 1));
    fprintf(stderr, "\r%s [%.*s%*s] %.1f / %.1f GiB", (const char *)ctx, filled,
            "########################################", width - filled, "", (double)done / 1073741824.0,
            (double)total / 1073741824.0);
    if (done == total) fputs("\r\033[K", stderr);
    fflush(stderr);
    return !cli_interrupted;
}

/* Weight upload progress (device backends), for files over 1 GiB. */
static void upload_bar(void *ctx, int64_t done, int64_t total) {
    if (total > ((int64_t)1 << 30)) (void)load_bar(ctx, done, total);
}

int cli_parse_args(const char *cmd, const char *synopsis, cli_opts *o, int argc, char **argv) {
    cli_opts_defaults(o);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: ds4server %s\n%s", synopsis, cli_common_usage());
            return 1;
        }
        int r = cli_parse_common(cmd, o, argc, argv, &i);
        if (r < 0) return -1;
        if (r == 0) {
            tool_fail(cmd, "unknown option '%s'", argv[i]);
            return -1;
        }
    }
    return 0;
}

int cli_open(const char *cmd, const cli_opts *o, cli_model *m) {
    memset(m, 0, sizeof *m);
    if (!o->model) return tool_fail(cmd, "no model given (-m FILE)");
    ds4_error err = { 0 };
    double t0 = tool_now();
    const bool on_cpu = !o->backend || !strcmp(o->backend, "cpu");
    ds4_engine_params p = { o->model, o->backend, o->threads, o->numerics, NULL, NULL };
    if (!on_cpu && isatty(STDERR_FILENO)) p.load_progress = upload_bar, p.load_progress_ctx = (void *)"uploading";
    if (ds4_engine_open(&p, &m->engine, &err) || ds4_tokenizer_load(ds4_engine_gguf(m->engine), &m->tok, &err) ||
        ds4_session_create(m->engine, o->ctx, &m->session, &err) ||
        ds4_sample_scratch_init(&m->scratch, ds4_engine_vocab_size(m->engine), &err)) {
        cli_close(m);
        return tool_fail(cmd, "%s", err.message);
    }
    /* Bring the weights into memory now, with a progress bar, rather than
     * stalling the first tokens on page faults (large files only). */
    if (on_cpu && isatty(STDERR_FILENO) && ds4_engine_gguf(m->engine)->size > ((uint64_t)1 << 30))
        ds4_engine_prefetch(m->engine, load_bar, (void *)"loading");
    m->load_seconds = tool_now() - t0;
    ds4_rng_seed(&m->rng, ds4_sampler_resolve_seed(o->sampling.seed));
    return 0;
}

void cli_close(cli_model *m) {
    ds4_sample_scratch_free(&m->scratch);
    ds4_session_free(m->session);
    ds4_tokenizer_free(m->tok);
    ds4_engine_close(m->engine);
    memset(m, 0, sizeof *m);
}

int cli_tokenize_segments(const char *cmd, const cli_model *m, const ds4_chat_segments *segs, ds4_pretok pretok,
                          int32_t **ids, int64_t *n) {
    int64_t cap = 256, len = 0;
    int32_t *out = malloc((size_t)cap * sizeof *out);
    ds4_error err = { 0 };
    for (size_t i = 0; out && i < segs->n; i++) {
        int32_t *part = NULL, one;
        int64_t k = 0;
        if (segs->v[i].is_special) {
            one = ds4_tokenizer_special(m->tok, (ds4_special)segs->v[i].special);
            part = &one;
            k = 1;
        } else if (ds4_tokenize(m->tok, segs->v[i].text, segs->v[i].len, pretok, false, &part, &k, &err)) {
            free(out);
            return tool_fail(cmd, "%s", err.message);
        }
        if (len + k > cap) {
            while (len + k > cap) cap *= 2;
            int32_t *grown = realloc(out, (size_t)cap * sizeof *out);
            if (!grown) {
                free(out);
                out = NULL;
            } else {
                out = grown;
            }
        }
        if (out) memcpy(out + len, part, (size_t)k * sizeof *part);
        len += k;
        if (part != &one) free(part);
    }
    if (!out) return tool_fail(cmd, "out of memory");
    *ids = out;
    *n = len;
    return 0;
}

/* Prefill progress bar on stderr (only when it is a terminal and the prompt is long). */
static bool progress_bar(void *ctx, int64_t done, int64_t total) {
    (void)ctx;
    int width = 40, filled = (int)(width * done / (total ? total : 1));
    fprintf(stderr, "\rprefill [%.*s%*s] %lld/%lld", filled, "########################################",
            width - filled, "", (long long)done, (long long)total);
    if (done == total) fputs("\r\033[K", stderr);
    fflush(stderr);
    return !cli_interrupted;
}

int cli_generate(const char *cmd, cli_model *m, const cli_opts *o, const int32_t *prompt, int64_t n_prompt,
                 char **reply, cli_stats *st) {
    memset(st, 0, sizeof *st);
    if (reply) *reply = NULL;
    ds4_error err = { 0 };
    st->prompt_tokens = n_prompt;
    bool bar = isatty(STDERR_FILENO) && n_prompt >= 512;
    ds4_session_set_progress(m->session, bar ? progress_bar : NULL, NULL);
    double t0 = tool_now();
    int64_t evaluated = 0;
    ds4_status status = ds4_session_sync(m->session, prompt, n_prompt, &evaluated, &err);
    ds4_session_set_progress(m->session, NULL, NULL);
    st->prefilled = evaluated;
    st->prefill_seconds = tool_now() - t0;
    if (status) {
        if (cli_interrupted) {
            st->interrupted = true;
            return 0;
        }
        return tool_fail(cmd, "%s", err.message);
    }
    const int32_t eos = ds4_tokenizer_special(m->tok, DS4_SPECIAL_EOS);
    const int64_t vocab = ds4_engine_vocab_size(m->engine);
    int64_t pos;
    ds4_session_tokens(m->session, &pos);
    /* Leave one position free, as DS4's CLI does. */
    int64_t budget = ds4_session_context(m->session) - pos - 1;
    int64_t limit = o->n_predict < budget ? o->n_predict : budget;
    size_t cap = 4096, len = 0;
    char *text = malloc(cap);
    char *piece = malloc(ds4_detok_bound(m->tok) + 8);
    if (!text || !piece) {
        free(text);
        free(piece);
        return tool_fail(cmd, "out of memory");
    }
    ds4_detok detok;
    ds4_detok_init(&detok, m->tok);
    double t1 = tool_now();
    int rc = 0;
    /* greedy sampling: the backend picks each next token in the decode (only its id comes back) */
    const bool greedy = o->sampling.temperature <= 0.0f;
    int32_t picked = -1;
    for (int64_t i = 0; i < limit; i++) {
        if (cli_interrupted) {
            st->interrupted = true;
            break;
        }
        int32_t tok = picked >= 0 ? picked
                                  : ds4_sample(ds4_session_logits(m->session), vocab, &o->sampling, &m->rng, &m->scratch);
        picked = -1;
        if (tok < 0) {
            rc = tool_fail(cmd, "sampling failed (invalid parameters)");
            break;
        }
        if (tok == eos) {
            st->hit_eos = true;
            break;
        }
        size_t k = ds4_detok_push(&detok, tok, piece);
        if (len + k + 1 > cap) {
            while (len + k + 1 > cap) cap *= 2;
            char *grown = realloc(text, cap);
            if (!grown) {
                rc = tool_fail(cmd, "out of memory");
                break;
            }
            text = grown;
        }
        memcpy(text + len, piece, k);
        len += k;
        fwrite(piece, 1, k, stdout);
        fflush(stdout);
        st->generated++;
        if (i + 1 == limit) break; /* the last token need not be evaluated */
        if (greedy ? ds4_session_decode_greedy(m->session, tok, &picked, &err)
                   : ds4_session_decode(m->session, tok, &err)) {
            rc = tool_fail(cmd, "%s", err.message);
            break;
        }
    }
    if (!rc && st->generated == limit && limit == budget) st->hit_context = true;
    size_t k = ds4_detok_flush(&detok, piece);
    fwrite(piece, 1, k, stdout);
    if (len + k + 1 <= cap) {
        memcpy(text + len, piece, k);
        len += k;
    }
    text[len] = '\0';
    fflush(stdout);
    st->decode_seconds = tool_now() - t1;
    free(piece);
    if (reply) *reply = text;
    else free(text);
    return rc;
}

void cli_print_stats(const cli_model *m, const cli_stats *st) {
    fprintf(stderr, "\nload %.2f s | prompt %lld tokens (%lld evaluated) in %.2f s, %.1f tokens/s | "
                    "generated %lld tokens in %.2f s, %.1f tokens/s%s\n",
            m->load_seconds, (long long)st->prompt_tokens, (long long)st->prefilled, st->prefill_seconds,
            st->prefill_seconds > 0 ? (double)st->prefilled / st->prefill_seconds : 0.0, (long long)st->generated,
            st->decode_seconds, st->decode_seconds > 0 ? (double)st->generated / st->decode_seconds : 0.0,
            st->interrupted ? " (interrupted)" : st->hit_context ? " (context full)" : "");
}

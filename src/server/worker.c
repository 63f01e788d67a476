/*
 * worker.c - the request queue and the inference thread.
 *
 * One thread owns the engine and its single live session; requests wait in a
 * bounded FIFO (first come, first served; the HTTP layer answers 503 when it
 * is full) and run one at a time, never batched.
 *
 * For each request the prompt text is rendered (spec 5.4) and matched against
 * what the session already holds, best first:
 *   1. the live tokens decode to a byte prefix of the prompt text: keep them
 *      and tokenize only the rest (this also absorbs tokenizations of the
 *      model's own reply that differ from the canonical one);
 *   2. a disk checkpoint (kvstore.c) whose text is a longer prefix than the
 *      tokens the live session shares with the canonical tokenization;
 *   3. the canonical tokens, through ds4_session_sync's own prefix reuse.
 * Then the suffix is prefilled and tokens are decoded, detokenized, checked
 * for stop sequences, parsed for reasoning and DSML tool calls
 * (ds4_chat_stream) and handed to format.c as they come.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "core/error.h"
#include "server/server_internal.h"
#include "session/engine.h"

void srv_log(const char *fmt, ...) {
    char stamp[32];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s ds4server serve: %s\n", stamp, line);
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------ ids and tool memory */

void srv_random_id(char *out, size_t cap, const char *prefix) {
    unsigned char raw[16];
    size_t got = 0;
    while (got < sizeof raw) {
        ssize_t k = getrandom(raw + got, sizeof raw - got, 0);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            break;
        }
        got += (size_t)k;
    }
    if (got < sizeof raw) { /* no kernel randomness: never expected; still unique per process */
        static atomic_ulong fallback;
        uint64_t x = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^ atomic_fetch_add(&fallback, 1);
        for (size_t i = 0; i < sizeof raw; i++) raw[i] = (unsigned char)(x >> (8 * (i % 8)));
    }
    size_t n = (size_t)snprintf(out, cap, "%s", prefix);
    for (size_t i = 0; i < sizeof raw && n + 2 < cap; i++) n += (size_t)snprintf(out + n, cap - n, "%02x", raw[i]);
}

#define TOOL_MEMORY_IDS 100000

void srv_tool_memory_put(srv_tool_memory *t, const char *id, const char *dsml) {
    if (!id || !dsml || !*id || !*dsml) return;
    if (!t->ids) {
        t->ids = calloc(TOOL_MEMORY_IDS, sizeof *t->ids);
        t->dsml = calloc(TOOL_MEMORY_IDS, sizeof *t->dsml);
        if (!t->ids || !t->dsml) {
            free(t->ids);
            free(t->dsml);
            t->ids = t->dsml = NULL;
            return;
        }
        t->cap = TOOL_MEMORY_IDS;
    }
    size_t slot = t->head;
    free(t->ids[slot]);
    free(t->dsml[slot]);
    t->ids[slot] = strdup(id);
    t->dsml[slot] = strdup(dsml);
    if (!t->ids[slot] || !t->dsml[slot]) {
        free(t->ids[slot]);
        free(t->dsml[slot]);
        t->ids[slot] = t->dsml[slot] = NULL;
        return;
    }
    t->head = (t->head + 1) % t->cap;
    if (t->n < t->cap) t->n++;
}

const char *srv_tool_memory_get(const srv_tool_memory *t, const char *id) {
    if (!id || !t->ids) return NULL;
    /* newest first: a client replays recent calls */
    for (size_t k = 0; k < t->n; k++) {
        size_t slot = (t->head + t->cap - 1 - k) % t->cap;
        if (t->ids[slot] && !strcmp(t->ids[slot], id)) return t->dsml[slot];
    }
    return NULL;
}

void srv_tool_memory_free(srv_tool_memory *t) {
    for (size_t i = 0; i < t->cap; i++) {
        free(t->ids[i]);
        free(t->dsml[i]);
    }
    free(t->ids);
    free(t->dsml);
    memset(t, 0, sizeof *t);
}

/* ------------------------------------------------------------ job output */

void srv_job_begin(srv_job *job, int status, const char *mime) {
    pthread_mutex_lock(&job->mu);
    job->status = status;
    job->mime = mime;
    pthread_cond_signal(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

void srv_job_write(srv_job *job, const char *bytes, size_t n) {
    pthread_mutex_lock(&job->mu);
    chat_buf_put(&job->out, bytes, n);
    pthread_cond_signal(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

void srv_job_finish(srv_job *job) {
    pthread_mutex_lock(&job->mu);
    job->done = true;
    pthread_cond_signal(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

void srv_job_error(srv_job *job, const srv_error *e) {
    chat_buf b = { 0 };
    srv_format_error(&b, job->req.api, e);
    pthread_mutex_lock(&job->mu);
    job->status = e->status;
    job->mime = "application/json";
    job->retry_after = e->status == 503 ? "1" : NULL;
    chat_buf_reset(&job->out);
    if (b.ptr) chat_buf_put(&job->out, b.ptr, b.len);
    pthread_cond_signal(&job->cv);
    pthread_mutex_unlock(&job->mu);
    chat_buf_free(&b);
}

void srv_job_fail(srv_job *job, const srv_error *e) {
    srv_job_error(job, e);
    srv_job_finish(job);
}

/* ------------------------------------------------------------ queue */

int srv_enqueue(srv_server *s, srv_job *job) {
    pthread_mutex_lock(&s->qmu);
    if (s->stopping || s->queued >= s->cfg->queue_max) {
        pthread_mutex_unlock(&s->qmu);
        return -1;
    }
    job->next = NULL;
    if (s->tail) s->tail->next = job;
    else s->head = job;
    s->tail = job;
    s->queued++;
    pthread_cond_signal(&s->qcv);
    pthread_mutex_unlock(&s->qmu);
    return 0;
}

int srv_queue_length(srv_server *s, int *busy) {
    pthread_mutex_lock(&s->qmu);
    int n = s->queued;
    if (busy) *busy = s->busy;
    pthread_mutex_unlock(&s->qmu);
    return n;
}

/* ------------------------------------------------------------ prompt tokens */

/* The bytes the tokens stand for (special tokens as their strings). */
static int tokens_text(const ds4_tokenizer *tok, const int32_t *ids, int64_t n, chat_buf *out) {
    char small[256];
    for (int64_t i = 0; i < n; i++) {
        size_t k = ds4_token_bytes(tok, ids[i], small, sizeof small);
        if (k <= sizeof small) {
            chat_buf_put(out, small, k);
        } else {
            char *big = malloc(k);
            if (!big) return -1;
            ds4_token_bytes(tok, ids[i], big, k);
            chat_buf_put(out, big, k);
            free(big);
        }
    }
    if (!out->ptr) chat_buf_put(out, "", 0);
    return out->oom ? -1 : 0;
}

/* prefix[0..n_prefix) followed by the rendered-chat tokens of text[0..len). */
static ds4_status append_tokens(srv_server *s, const int32_t *prefix, int64_t n_prefix, const char *text,
                                size_t len, int32_t **ids, int64_t *n, ds4_error *err) {
    int32_t *rest = NULL;
    int64_t n_rest = 0;
    if (len && ds4_tokenize(s->tok, text, len, s->cfg->pretok, true, &rest, &n_rest, err)) return err->status;
    int32_t *all = malloc((size_t)(n_prefix + n_rest + 1) * sizeof *all);
    if (!all) {
        free(rest);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    }
    if (n_prefix) memcpy(all, prefix, (size_t)n_prefix * sizeof *all);
    if (n_rest) memcpy(all + n_prefix, rest, (size_t)n_rest * sizeof *all);
    free(rest);
    *ids = all;
    *n = n_prefix + n_rest;
    return DS4_OK;
}

typedef struct prompt_plan {
    int32_t *ids;
    int64_t n;
    bool live_hit, disk_hit;
} prompt_plan;

static ds4_status plan_prompt(srv_server *s, const char *text, size_t len, prompt_plan *p, ds4_error *err) {
    memset(p, 0, sizeof *p);
    int64_t n_live = 0;
    const int32_t *live = ds4_session_tokens(s->session, &n_live);
    chat_buf lt = { 0 };
    if (n_live > 0 && tokens_text(s->tok, live, n_live, &lt) == 0 && lt.len <= len && !memcmp(lt.ptr, text, lt.len)) {
        size_t used = lt.len;
        chat_buf_free(&lt);
        p->live_hit = true;
        return append_tokens(s, live, n_live, text + used, len - used, &p->ids, &p->n, err);
    }
    chat_buf_free(&lt);
    if (s->visible && n_live == s->visible_tokens && s->visible_len <= len &&
        !memcmp(s->visible, text, s->visible_len)) {
        p->live_hit = true;
        return append_tokens(s, live, n_live, text + s->visible_len, len - s->visible_len, &p->ids, &p->n, err);
    }
    ds4_status st = append_tokens(s, NULL, 0, text, len, &p->ids, &p->n, err);
    if (st) return st;
    int64_t common = 0;
    while (common < n_live && common < p->n && live[common] == p->ids[common]) common++;
    int64_t n_disk = 0;
    int idx = s->kv ? srv_kv_find(s->kv, text, len, &n_disk) : -1;
    if (idx >= 0 && n_disk > common && srv_kv_load(s->kv, idx, s->session) == 0) {
        const int32_t *disk = ds4_session_tokens(s->session, &n_disk);
        chat_buf dt = { 0 };
        if (tokens_text(s->tok, disk, n_disk, &dt) == 0 && dt.len <= len && !memcmp(dt.ptr, text, dt.len)) {
            free(p->ids);
            p->ids = NULL;
            p->disk_hit = true;
            s->kv_saved_tokens = n_disk;
            st = append_tokens(s, disk, n_disk, text + dt.len, len - dt.len, &p->ids, &p->n, err);
        }
        chat_buf_free(&dt);
    } else if (common > 0) {
        p->live_hit = true;
    }
    return st;
}

/* ------------------------------------------------------------ generation */

static bool cancelled(const srv_gen *g) {
    return atomic_load(&g->job->cancel) || (g->s && atomic_load(&g->s->cancel_all));
}

static void on_event(void *user, const ds4_chat_event *ev) {
    srv_gen *g = user;
    srv_job *job = g->job;
    if (!job->req.stream) {
        if (ev->kind == DS4_CHAT_EVENT_TOOL_START && job->n_calls < SRV_MAX_CALLS) {
            srv_random_id(job->call_ids[job->n_calls], sizeof job->call_ids[0], srv_call_id_prefix(job->req.api));
            job->n_calls++;
        }
        return;
    }
    switch (ev->kind) {
    case DS4_CHAT_EVENT_REASONING: srv_format_reasoning(job, ev->text, ev->len); break;
    case DS4_CHAT_EVENT_CONTENT: srv_format_content(job, ev->text, ev->len); break;
    case DS4_CHAT_EVENT_TOOL_START:
        if (ev->call_index < SRV_MAX_CALLS && ev->call_index == job->n_calls) {
            srv_random_id(job->call_ids[job->n_calls], sizeof job->call_ids[0], srv_call_id_prefix(job->req.api));
            job->n_calls++;
            srv_format_tool_start(job, ev->call_index, ev->name ? ev->name : "");
        }
        break;
    case DS4_CHAT_EVENT_TOOL_ARGS:
        if (ev->call_index < job->n_calls) srv_format_tool_args(job, ev->call_index, ev->text, ev->len);
        break;
    case DS4_CHAT_EVENT_TOOL_END:
        if (ev->call_index < job->n_calls) srv_format_tool_end(job, ev->call_index);
        break;
    case DS4_CHAT_EVENT_ERROR: break;
    }
}

static void feed(srv_gen *g, const char *text, size_t len) {
    if (!len) return;
    if (g->stream) {
        if (ds4_chat_stream_feed(g->stream, text, len, on_event, g, &g->err)) g->failed = true;
    } else if (g->job->req.stream) {
        srv_format_content(g->job, text, len);
    }
}

/* New generated bytes: cut at a stop sequence, hold back what may start one. */
void srv_gen_push(srv_gen *g, const char *text, size_t len) {
    if (g->finish == SRV_FINISH_STOP_SEQ) return; /* nothing after a stop sequence counts */
    chat_buf_put(&g->all, text, len);
    const srv_request *r = &g->job->req;
    if (!r->n_stop) {
        feed(g, text, len);
        return;
    }
    chat_buf_put(&g->pending, text, len);
    const char *p = g->pending.ptr;
    size_t n = g->pending.len;
    size_t cut = n, hold = 0;
    for (size_t i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        for (size_t at = 0; at + sl <= n && at < cut; at++)
            if (!memcmp(p + at, r->stop[i], sl)) {
                cut = at;
                g->stop_hit = r->stop[i];
                break;
            }
        for (size_t k = sl - 1; k > hold && k > 0; k--)
            if (k <= n && !memcmp(p + n - k, r->stop[i], k)) {
                hold = k;
                break;
            }
    }
    if (g->stop_hit) {
        feed(g, p, cut);
        g->all.len -= n - cut; /* the text ends before the stop sequence */
        g->all.ptr[g->all.len] = '\0';
        chat_buf_reset(&g->pending);
        g->finish = SRV_FINISH_STOP_SEQ;
        return;
    }
    feed(g, p, n - hold);
    memmove(g->pending.ptr, p + n - hold, hold);
    g->pending.len = hold;
}

int srv_gen_init(srv_gen *g, srv_server *s, srv_job *job, bool thinking, ds4_error *err) {
    memset(g, 0, sizeof *g);
    g->s = s;
    g->job = job;
    g->finish = SRV_FINISH_STOP;
    g->last_keepalive = now_seconds();
    if (job->req.api != SRV_API_COMPLETIONS && ds4_chat_stream_new(thinking, &g->stream, err)) return -1;
    return 0;
}

void srv_gen_free(srv_gen *g) {
    ds4_chat_reply_free(&g->reply);
    ds4_chat_stream_free(g->stream);
    chat_buf_free(&g->all);
    chat_buf_free(&g->pending);
    memset(g, 0, sizeof *g);
}

/* After the last token: the authoritative parse, call ids (remembered with
 * their exact DSML), and the closing events or the whole body. */
void srv_gen_complete(srv_gen *g, srv_tool_memory *tools, const srv_usage *usage) {
    srv_error e = { 0 };
    ds4_error perr = { 0 };
    if (g->pending.len && g->finish != SRV_FINISH_STOP_SEQ) feed(g, g->pending.ptr, g->pending.len);
    chat_buf_reset(&g->pending);
    if (g->stream) {
        ds4_status ps = ds4_chat_stream_finish(g->stream, on_event, g, &g->reply, &perr);
        if (ps && ps != DS4_ERR_FORMAT) g->finish = SRV_FINISH_ERROR;
    }
    if (g->reply.n_calls && (g->finish == SRV_FINISH_STOP || g->finish == SRV_FINISH_TOOLS))
        g->finish = SRV_FINISH_TOOLS;
    else if (g->finish == SRV_FINISH_TOOLS) g->finish = SRV_FINISH_STOP;
    /* Ids for the calls: the ones streamed, then fresh ones; remember the exact DSML. */
    const char *ids[SRV_MAX_CALLS];
    size_t n_calls = g->reply.n_calls < SRV_MAX_CALLS ? g->reply.n_calls : SRV_MAX_CALLS;
    g->reply.n_calls = n_calls;
    for (size_t i = 0; i < n_calls; i++) {
        if (i >= g->job->n_calls) {
            srv_random_id(g->job->call_ids[i], sizeof g->job->call_ids[0], srv_call_id_prefix(g->job->req.api));
            g->job->n_calls = i + 1;
        }
        ids[i] = g->job->call_ids[i];
        srv_tool_memory_put(tools, ids[i], g->reply.calls[i].raw_dsml);
    }
    if (g->finish == SRV_FINISH_ERROR && !g->job->req.stream) {
        srv_fail(&e, 500, "api_error", NULL, "generation failed: %s",
                 g->err.message[0] ? g->err.message : perr.message);
        srv_job_error(g->job, &e);
    } else if (g->finish == SRV_FINISH_CANCELLED && !g->job->req.stream) {
        srv_fail(&e, 499, "api_error", NULL, "the request was cancelled");
        srv_job_error(g->job, &e);
    } else {
        srv_result res = { &g->reply, g->all.ptr ? g->all.ptr : "", g->all.len, g->finish, g->stop_hit, *usage, ids };
        if (!g->job->req.stream) srv_job_begin(g->job, 200, "application/json");
        srv_format_finish(g->job, &res);
    }
}

/* Last occurrence of needle in hay[0..n), or NULL. */
static const char *find_last(const char *hay, size_t n, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = n >= k ? n - k + 1 : 0; i-- > 0;)
        if (!memcmp(hay + i, needle, k)) return hay + i;
    return NULL;
}

/* True while the decoder is inside a DSML tool-call block but not inside
 * the body of a string="true" parameter: tags, attributes, whitespace and
 * JSON values are structure, decoded greedily as ds4 does; free text inside
 * string parameters is sampled normally. (ds4 also samples the inside of
 * JSON strings normally; here a string="false" value is structure.) */
bool srv_gen_dsml_structural(const srv_gen *g) {
    if (!g->stream || !ds4_chat_stream_in_block(g->stream)) return false;
    const char *text = g->all.ptr ? g->all.ptr : "";
    size_t n = g->all.len;
    const char *block = find_last(text, n, "DSML\xef\xbd\x9ctool_calls>");
    if (block) {
        n -= (size_t)(block - text);
        text = block;
    }
    const char *open = find_last(text, n, "string=\"true\">");
    if (!open) return true;
    const char *close = find_last(text, n, "</\xef\xbd\x9c" "DSML\xef\xbd\x9c" "parameter>");
    return close && close > open;
}

static bool prefill_progress(void *ctx, int64_t done, int64_t total) {
    srv_gen *g = ctx;
    (void)done;
    (void)total;
    double t = now_seconds();
    if (g->job->req.stream && t - g->last_keepalive >= 5.0) {
        srv_job_write(g->job, ": prefill\n\n", 11);
        g->last_keepalive = t;
    }
    return !cancelled(g);
}

static ds4_sampler_params sampler_for(const srv_server *s, const srv_job *job, bool thinking) {
    const srv_request *r = &job->req;
    ds4_sampler_params p = s->cfg->sampling;
    if (thinking) {
        /* DS4 semantics: a thinking turn samples with the defaults (spec 6.1). */
        uint64_t seed = p.seed;
        p = ds4_sampler_defaults();
        p.seed = seed;
    } else {
        if (r->has_temperature) p.temperature = r->temperature;
        if (r->has_top_p) p.top_p = r->top_p;
        if (r->has_top_k) p.top_k = r->top_k;
        if (r->has_min_p) p.min_p = r->min_p;
    }
    if (r->seed) p.seed = r->seed;
    return p;
}

void srv_worker_persist(srv_server *s, int64_t min_new) {
    int64_t n_live = 0;
    const int32_t *live = ds4_session_tokens(s->session, &n_live);
    if (!s->kv || n_live < s->cfg->kv_min_tokens || n_live - s->kv_saved_tokens < min_new) return;
    chat_buf lt = { 0 };
    if (tokens_text(s->tok, live, n_live, &lt) == 0) {
        srv_kv_save(s->kv, s->session, lt.ptr, lt.len);
        s->kv_saved_tokens = n_live;
    }
    chat_buf_free(&lt);
}

/* A thinking turn that ended normally, outside tool context: the next
 * prompt will show it as `prompt minus its final <think>` + </think> +
 * content, which the live session (holding the reasoning too) stands for. */
static void remember_visible(srv_server *s, const srv_job *job, const srv_gen *g, bool thinking, const char *text,
                             size_t len) {
    const srv_request *r = &job->req;
    static const char THINK[] = "<think>", END[] = "</think>";
    bool tool_context = r->n_tools > 0 && !r->tool_choice_none;
    for (size_t i = 0; i < r->n_messages; i++)
        tool_context |= r->messages[i].n_calls > 0 || r->messages[i].role == DS4_CHAT_ROLE_TOOL;
    if (!thinking || tool_context || g->finish != SRV_FINISH_STOP || !g->reply.reasoning ||
        g->reply.thinking_unclosed || g->reply.n_calls || (r->api != SRV_API_CHAT && r->api != SRV_API_MESSAGES) ||
        len < sizeof THINK - 1 || memcmp(text + len - (sizeof THINK - 1), THINK, sizeof THINK - 1))
        return;
    chat_buf b = { 0 };
    chat_buf_put(&b, text, len - (sizeof THINK - 1));
    chat_buf_puts(&b, END);
    chat_buf_put(&b, g->reply.content, g->reply.content_len);
    if (b.oom) {
        chat_buf_free(&b);
        return;
    }
    s->visible = chat_buf_take(&b, &s->visible_len);
    ds4_session_tokens(s->session, &s->visible_tokens);
}

/* The sampler of the next token: inside a tool-call block, structure is
 * decoded greedily (spec 6.1). */
static const ds4_sampler_params *step_sampler(bool tools_active, const srv_gen *g, const ds4_sampler_params *greedy,
                                              const ds4_sampler_params *sp) {
    return tools_active && srv_gen_dsml_structural(g) ? greedy : sp;
}

static void run_job(srv_server *s, srv_job *job) {
    srv_request *r = &job->req;
    const srv_config *cfg = s->cfg;
    ds4_error err = { 0 };
    srv_error e = { 0 };
    if (atomic_load(&job->cancel) || atomic_load(&s->cancel_all)) {
        srv_fail(&e, 503, "overloaded_error", NULL, "the server is shutting down");
        srv_job_fail(job, &e);
        return;
    }
    /* Exact replay: calls whose ids we issued render as the bytes generated. */
    for (size_t i = 0; i < r->n_messages; i++)
        for (size_t k = 0; k < r->messages[i].n_calls; k++) {
            ds4_chat_tool_call *c = (ds4_chat_tool_call *)&r->messages[i].calls[k];
            c->raw_dsml = srv_tool_memory_get(&s->tools, c->id);
        }
    const bool thinking = ds4_chat_think_for_context(r->think, (uint64_t)cfg->ctx) != DS4_CHAT_THINK_NONE;
    char *text = NULL;
    size_t len = 0;
    ds4_status st;
    if (r->api == SRV_API_COMPLETIONS) {
        st = ds4_chat_render_completion(r->prompt, r->think, (uint64_t)cfg->ctx, &text, &len, &err);
    } else {
        ds4_chat_conversation conv = { r->messages, r->n_messages, r->tools, r->n_tools, r->tool_choice_none,
                                       r->think, (uint64_t)cfg->ctx };
        st = ds4_chat_render(&conv, &text, &len, &err);
    }
    prompt_plan plan = { 0 };
    if (!st) st = plan_prompt(s, text, len, &plan, &err);
    free(s->visible); /* the session is about to change */
    s->visible = NULL;
    if (st) {
        free(text);
        srv_fail(&e, st == DS4_ERR_NOMEM ? 500 : 400, st == DS4_ERR_NOMEM ? "api_error" : "invalid_request_error",
                 NULL, "%s", err.message);
        srv_job_fail(job, &e);
        free(plan.ids);
        return;
    }
    if (plan.n >= cfg->ctx) {
        srv_fail(&e, 400, "invalid_request_error", "messages",
                 "the prompt has %lld tokens; the context holds %lld, so a prompt must be shorter (context length "
                 "exceeded)", (long long)plan.n, (long long)cfg->ctx);
        srv_job_fail(job, &e);
        free(plan.ids);
        free(text);
        return;
    }
    srv_gen g;
    const bool tools_active = r->n_tools > 0 && !r->tool_choice_none;
    if (srv_gen_init(&g, s, job, thinking, &err)) {
        srv_fail(&e, 500, "api_error", NULL, "%s", err.message);
        srv_job_fail(job, &e);
        free(plan.ids);
        free(text);
        return;
    }
    if (r->stream) {
        srv_job_begin(job, 200, "text/event-stream");
        srv_format_stream_begin(job);
    }
    srv_usage usage = { .prompt_tokens = plan.n };
    double t0 = now_seconds();
    int64_t evaluated = 0;
    ds4_session_set_progress(s->session, prefill_progress, &g);
    st = ds4_session_sync(s->session, plan.ids, plan.n, &evaluated, &err);
    ds4_session_set_progress(s->session, NULL, NULL);
    free(plan.ids);
    usage.prefill_seconds = now_seconds() - t0;
    usage.cached_tokens = plan.n - evaluated;
    if (usage.cached_tokens < s->kv_saved_tokens) s->kv_saved_tokens = 0; /* the stored prefix was left */
    ds4_sample_scratch *scratch = &s->scratch;
    ds4_sampler_params sp = sampler_for(s, job, thinking), greedy = sp;
    greedy.temperature = 0;
    ds4_rng rng;
    ds4_rng_seed(&rng, sp.seed ? sp.seed
                               : ((uint64_t)time(NULL) << 32) ^ (++s->counter << 1) ^ (uint64_t)(uintptr_t)job);
    const int32_t eos = ds4_tokenizer_special(s->tok, DS4_SPECIAL_EOS);
    const int64_t vocab = ds4_engine_vocab_size(s->engine);
    char *piece = malloc(ds4_detok_bound(s->tok) + 8);
    double t1 = now_seconds();
    if (st || !piece) {
        g.finish = cancelled(&g) ? SRV_FINISH_CANCELLED : SRV_FINISH_ERROR;
        if (!st) ds4_error_set(&err, DS4_ERR_NOMEM, "out of memory");
    } else {
        int64_t pos;
        ds4_session_tokens(s->session, &pos);
        int64_t budget = cfg->ctx - pos - 1;
        int64_t limit = r->max_tokens ? r->max_tokens : cfg->max_tokens ? cfg->max_tokens : budget;
        if (limit > budget) limit = budget;
        ds4_detok detok;
        ds4_detok_init(&detok, s->tok);
        if (limit <= 0) g.finish = SRV_FINISH_LENGTH;
        int32_t picked = -1; /* the next token, when the last decode let the backend pick it greedily */
        for (int64_t i = 0; i < limit; i++) {
            if (cancelled(&g)) {
                g.finish = SRV_FINISH_CANCELLED;
                break;
            }
            const ds4_sampler_params *use = step_sampler(tools_active, &g, &greedy, &sp);
            int32_t tok = picked >= 0 ? picked : ds4_sample(ds4_session_logits(s->session), vocab, use, &rng, scratch);
            picked = -1;
            if (tok < 0) {
                ds4_error_set(&err, DS4_ERR_INVALID, "sampling failed (invalid parameters)");
                g.finish = SRV_FINISH_ERROR;
                break;
            }
            if (tok == eos) break; /* EOS is neither emitted nor evaluated (spec 6.2) */
            usage.completion_tokens++;
            size_t k = ds4_detok_push(&detok, tok, piece);
            srv_gen_push(&g, piece, k);
            if (g.failed) {
                g.finish = SRV_FINISH_ERROR;
                break;
            }
            if (g.finish == SRV_FINISH_STOP_SEQ) break;
            if (tools_active && g.stream && ds4_chat_stream_block_closed(g.stream)) {
                g.finish = SRV_FINISH_TOOLS;
                break;
            }
            if (i + 1 == limit) {
                g.finish = SRV_FINISH_LENGTH;
                break;
            }
            /* the next token's sampler is known now: a greedy one is picked
             * by the backend in the decode (the same token; no logits back) */
            const ds4_sampler_params *next = step_sampler(tools_active, &g, &greedy, &sp);
            const ds4_status ds = next->temperature <= 0.0f
                                      ? ds4_session_decode_greedy(s->session, tok, &picked, &err)
                                      : ds4_session_decode(s->session, tok, &err);
            if (ds) {
                g.finish = SRV_FINISH_ERROR;
                break;
            }
        }
        if (g.finish != SRV_FINISH_STOP_SEQ) {
            size_t k = ds4_detok_flush(&detok, piece);
            srv_gen_push(&g, piece, k);
        }
    }
    free(piece);
    usage.decode_seconds = now_seconds() - t1;
    if (g.finish == SRV_FINISH_ERROR) srv_log("generation failed: %s", err.message);

    if (g.finish == SRV_FINISH_ERROR && !g.err.message[0]) g.err = err;
    srv_gen_complete(&g, &s->tools, &usage);
    /* Account. */
    pthread_mutex_lock(&s->metrics.mu);
    srv_metrics *m = &s->metrics;
    m->prompt_tokens += (uint64_t)usage.prompt_tokens;
    m->prefill_tokens += (uint64_t)evaluated;
    m->cached_tokens += (uint64_t)usage.cached_tokens;
    m->generated_tokens += (uint64_t)usage.completion_tokens;
    m->prefill_seconds += usage.prefill_seconds;
    m->decode_seconds += usage.decode_seconds;
    if (evaluated > 0 && usage.prefill_seconds > 0) m->last_prefill_tps = (double)evaluated / usage.prefill_seconds;
    if (usage.completion_tokens > 0 && usage.decode_seconds > 0)
        m->last_decode_tps = (double)usage.completion_tokens / usage.decode_seconds;
    if (plan.live_hit && usage.cached_tokens > 0) m->live_hits++;
    if (plan.disk_hit) m->disk_hits++;
    if (g.finish == SRV_FINISH_CANCELLED) m->cancelled++;
    pthread_mutex_unlock(&s->metrics.mu);
    srv_log("%s %s: prompt %lld tokens (%lld cached), %lld generated, finish %d", srv_api_name(r->api), job->id,
            (long long)usage.prompt_tokens, (long long)usage.cached_tokens, (long long)usage.completion_tokens,
            (int)g.finish);

    remember_visible(s, job, &g, thinking, text, len);
    free(text);
    srv_job_finish(job); /* the job belongs to its connection thread from here on */
    /* Persist the conversation (after the answer went out) once it has grown
     * by kv_min_tokens since it was last stored. */
    if (g.finish != SRV_FINISH_CANCELLED && g.finish != SRV_FINISH_ERROR) srv_worker_persist(s, cfg->kv_min_tokens);
    srv_gen_free(&g);
}

void *srv_worker_main(void *arg) {
    srv_server *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->qmu);
        while (!s->head && !s->stopping) pthread_cond_wait(&s->qcv, &s->qmu);
        if (!s->head) { /* stopping and drained */
            pthread_mutex_unlock(&s->qmu);
            break;
        }
        srv_job *job = s->head;
        s->head = job->next;
        if (!s->head) s->tail = NULL;
        s->queued--;
        s->busy = true;
        pthread_mutex_unlock(&s->qmu);
        run_job(s, job);
        pthread_mutex_lock(&s->qmu);
        s->busy = false;
        pthread_cond_broadcast(&s->qcv);
        pthread_mutex_unlock(&s->qmu);
    }
    return NULL;
}

/*
 * http.c - the HTTP side (civetweb): routing, authentication, CORS, body
 * limits, errors in each API's format, and the pump that moves a job's output
 * to its connection; srv_run ties the server's life together.
 *
 * civetweb runs one thread per connection. A POST to a generation endpoint
 * parses and validates the body on that thread (bad input never reaches the
 * queue), queues a job and then waits on it: streamed output is written as
 * chunks while the worker produces it, a whole body when the job is done.
 * While waiting, the thread watches its socket: a client that hangs up sets
 * the job's cancel flag, which the worker checks at every token and between
 * prefill chunks.
 */
#define _GNU_SOURCE /* POLLRDHUP */
#include <arpa/inet.h>
#include <civetweb.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "server/server_internal.h"
#include "session/engine.h"

void srv_config_defaults(srv_config *c) {
    memset(c, 0, sizeof *c);
    c->host = "127.0.0.1";
    c->port = 8000;
    c->max_body = 16 << 20;
    c->request_timeout_ms = 600000;
    c->idle_timeout_ms = 5000;
    c->queue_max = 16;
    c->http_threads = 0;
    c->model_name = "deepseek-v4-flash";
    c->backend = "cpu";
    c->ctx = 32768;
    c->numerics = DS4_NUMERICS_MODE_DS4;
    c->pretok = DS4_PRETOK_OFFICIAL;
    c->think = DS4_CHAT_THINK_HIGH;
    c->sampling = ds4_sampler_defaults();
    c->kv_max_mb = 4096;
    c->kv_min_tokens = 512;
}

/* ------------------------------------------------------------ responses */

static void add_common_headers(struct mg_connection *conn, const srv_server *s) {
    if (s->cfg->cors) {
        mg_response_header_add(conn, "Access-Control-Allow-Origin", "*", -1);
        mg_response_header_add(conn, "Access-Control-Allow-Headers",
                               "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta", -1);
        mg_response_header_add(conn, "Access-Control-Allow-Methods", "GET, POST, OPTIONS", -1);
    }
}

static void count_status(srv_server *s, int status) {
    if (status < 400) return;
    pthread_mutex_lock(&s->metrics.mu);
    if (status >= 500) s->metrics.errors_5xx++;
    else s->metrics.errors_4xx++;
    if (status == 503) s->metrics.rejected_full++;
    pthread_mutex_unlock(&s->metrics.mu);
}

static int send_body(struct mg_connection *conn, srv_server *s, int status, const char *mime, const char *body,
                     size_t len, const char *retry_after) {
    char cl[32];
    snprintf(cl, sizeof cl, "%zu", len);
    mg_response_header_start(conn, status);
    mg_response_header_add(conn, "Content-Type", mime, -1);
    mg_response_header_add(conn, "Content-Length", cl, -1);
    if (retry_after) { /* and free this connection thread for others */
        mg_response_header_add(conn, "Retry-After", retry_after, -1);
        mg_response_header_add(conn, "Connection", "close", -1);
    }
    add_common_headers(conn, s);
    mg_response_header_send(conn);
    if (len && strcmp(mg_get_request_info(conn)->request_method, "HEAD")) mg_write(conn, body, len);
    count_status(s, status);
    return status;
}

static int send_error(struct mg_connection *conn, srv_server *s, srv_api api, const srv_error *e) {
    chat_buf b = { 0 };
    srv_format_error(&b, api, e);
    int rc = send_body(conn, s, e->status, "application/json", b.ptr ? b.ptr : "{}", b.ptr ? b.len : 2,
                       e->status == 503 ? "1" : NULL);
    chat_buf_free(&b);
    return rc;
}

static int send_json(struct mg_connection *conn, srv_server *s, cJSON *o) {
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    int rc = send_body(conn, s, text ? 200 : 500, "application/json", text ? text : "{}", text ? strlen(text) : 2,
                       NULL);
    free(text);
    return rc;
}

/* ------------------------------------------------------------ client liveness */

/* The socket of this connection: the descriptor whose peer and local ports
 * are the request's (civetweb does not hand out the descriptor). */
static int find_socket(const struct mg_request_info *ri) {
    struct rlimit rl;
    int max = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 65536 ? (int)rl.rlim_cur : 65536;
    for (int fd = 3; fd < max; fd++) {
        struct sockaddr_storage peer, local;
        socklen_t pl = sizeof peer, ll = sizeof local;
        if (getpeername(fd, (struct sockaddr *)&peer, &pl) != 0) continue;
        if (getsockname(fd, (struct sockaddr *)&local, &ll) != 0) continue;
        int pport, lport;
        char addr[64] = "";
        if (peer.ss_family == AF_INET) {
            const struct sockaddr_in *p = (const void *)&peer;
            pport = ntohs(p->sin_port);
            lport = ntohs(((const struct sockaddr_in *)(const void *)&local)->sin_port);
            inet_ntop(AF_INET, &p->sin_addr, addr, sizeof addr);
        } else if (peer.ss_family == AF_INET6) {
            const struct sockaddr_in6 *p = (const void *)&peer;
            pport = ntohs(p->sin6_port);
            lport = ntohs(((const struct sockaddr_in6 *)(const void *)&local)->sin6_port);
            inet_ntop(AF_INET6, &p->sin6_addr, addr, sizeof addr);
        } else {
            continue;
        }
        if (pport == ri->remote_port && lport == ri->server_port && !strcmp(addr, ri->remote_addr)) return fd;
    }
    return -1;
}

/* 0 when the peer has closed (or reset) the connection. */
static int client_alive(int fd) {
    if (fd < 0) return 1;
    struct pollfd p = { .fd = fd, .events = POLLIN | POLLRDHUP };
    if (poll(&p, 1, 0) <= 0) return 1;
    if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return 0;
    if (p.revents & POLLIN) {
        char c;
        ssize_t k = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (k == 0) return 0;
    }
    return 1;
}

/* ------------------------------------------------------------ jobs */

srv_job *srv_job_new(void) {
    srv_job *job = calloc(1, sizeof *job);
    if (!job) return NULL;
    pthread_mutex_init(&job->mu, NULL);
    pthread_cond_init(&job->cv, NULL);
    return job;
}

void srv_job_free(srv_job *job) {
    if (!job) return;
    srv_request_free(&job->req);
    chat_buf_free(&job->out);
    chat_buf_free(&job->reasoning_acc);
    chat_buf_free(&job->content_acc);
    for (int i = 0; i < SRV_MAX_CALLS; i++) chat_buf_free(&job->args_acc[i]);
    pthread_mutex_destroy(&job->mu);
    pthread_cond_destroy(&job->cv);
    free(job);
}

/* Wait for the job, writing its output; returns the HTTP status sent. */
static int pump(struct mg_connection *conn, srv_server *s, srv_job *job) {
    int fd = find_socket(mg_get_request_info(conn));
    bool headers_sent = false, client_gone = false;
    int status = 0;
    chat_buf local = { 0 };
    for (;;) {
        pthread_mutex_lock(&job->mu);
        bool streaming = job->status == 200 && job->mime && !strcmp(job->mime, "text/event-stream");
        while (!job->done && !(streaming && (job->out.len || !headers_sent))) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            int w = pthread_cond_timedwait(&job->cv, &job->mu, &ts);
            streaming = job->status == 200 && job->mime && !strcmp(job->mime, "text/event-stream");
            if (w == ETIMEDOUT && !client_gone) {
                pthread_mutex_unlock(&job->mu);
                if (!client_alive(fd)) {
                    client_gone = true;
                    atomic_store(&job->cancel, 1);
                }
                pthread_mutex_lock(&job->mu);
            }
        }
        bool done = job->done;
        status = job->status;
        const char *mime = job->mime, *retry = job->retry_after;
        if (streaming || done) {
            chat_buf tmp = local;
            local = job->out;
            job->out = tmp;
            chat_buf_reset(&job->out);
        }
        pthread_mutex_unlock(&job->mu);
        if (!streaming) { /* done: the whole body at once */
            if (!client_gone) send_body(conn, s, status ? status : 500, mime ? mime : "application/json",
                                        local.ptr ? local.ptr : "", local.len, retry);
            break;
        }
        if (!headers_sent) {
            mg_response_header_start(conn, 200);
            mg_response_header_add(conn, "Content-Type", "text/event-stream; charset=utf-8", -1);
            mg_response_header_add(conn, "Cache-Control", "no-cache", -1);
            mg_response_header_add(conn, "Transfer-Encoding", "chunked", -1);
            mg_response_header_add(conn, "X-Accel-Buffering", "no", -1);
            add_common_headers(conn, s);
            if (mg_response_header_send(conn) != 0) client_gone = true;
            headers_sent = true;
        }
        if (local.len && !client_gone && mg_send_chunk(conn, local.ptr, (unsigned)local.len) < 0) client_gone = true;
        chat_buf_reset(&local);
        if (client_gone) atomic_store(&job->cancel, 1);
        if (done) {
            if (!client_gone) mg_send_chunk(conn, "", 0);
            break;
        }
    }
    chat_buf_free(&local);
    /* The worker may still hold the job (client gone): wait for it. */
    pthread_mutex_lock(&job->mu);
    while (!job->done) pthread_cond_wait(&job->cv, &job->mu);
    pthread_mutex_unlock(&job->mu);
    return status;
}

/* ------------------------------------------------------------ routes */

static bool authorized(struct mg_connection *conn, const srv_server *s) {
    const char *key = s->cfg->api_key;
    if (!key || !*key) return true;
    const char *auth = mg_get_header(conn, "Authorization");
    const char *x = mg_get_header(conn, "x-api-key");
    const char *given = NULL;
    if (auth && !strncasecmp(auth, "Bearer ", 7)) given = auth + 7;
    else if (x) given = x;
    if (!given) return false;
    size_t a = strlen(given), b = strlen(key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a; i++) diff |= (unsigned char)given[i] ^ (unsigned char)key[i % (b ? b : 1)];
    return diff == 0;
}

static cJSON *model_object(const srv_server *s, const char *id) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", id);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", 0);
    cJSON_AddStringToObject(m, "owned_by", "ds4server");
    cJSON_AddNumberToObject(m, "context_length", (double)s->cfg->ctx);
    return m;
}

/* Read the body (at most max_body bytes). -1 with *e filled on failure. */
static int read_body(struct mg_connection *conn, const srv_server *s, char **out, size_t *len, srv_error *e) {
    const struct mg_request_info *ri = mg_get_request_info(conn);
    int64_t limit = s->cfg->max_body;
    if (ri->content_length > limit)
        return srv_fail(e, 413, "request_too_large", NULL, "the request body has %lld bytes; the limit is %lld",
                        ri->content_length, (long long)limit);
    size_t cap = ri->content_length >= 0 ? (size_t)ri->content_length + 1 : 65536, n = 0;
    char *buf = malloc(cap);
    if (!buf) return srv_fail(e, 500, "api_error", NULL, "out of memory");
    for (;;) {
        if (n + 1 >= cap) {
            if ((int64_t)cap > limit + 1) {
                free(buf);
                return srv_fail(e, 413, "request_too_large", NULL, "the request body exceeds the limit of %lld bytes",
                                (long long)limit);
            }
            char *g = realloc(buf, cap * 2);
            if (!g) {
                free(buf);
                return srv_fail(e, 500, "api_error", NULL, "out of memory");
            }
            buf = g;
            cap *= 2;
        }
        int k = mg_read(conn, buf + n, cap - n - 1);
        if (k < 0) {
            free(buf);
            return srv_fail(e, 400, "invalid_request_error", NULL, "the request body could not be read");
        }
        if (k == 0) break;
        n += (size_t)k;
        if ((int64_t)n > limit) {
            free(buf);
            return srv_fail(e, 413, "request_too_large", NULL, "the request body exceeds the limit of %lld bytes",
                            (long long)limit);
        }
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return 0;
}

static int handle_generate(struct mg_connection *conn, srv_server *s, srv_api api) {
    srv_error e = { 0 };
    char *body = NULL;
    size_t len = 0;
    if (read_body(conn, s, &body, &len, &e)) return send_error(conn, s, api, &e);
    srv_job *job = srv_job_new();
    if (!job) {
        free(body);
        srv_fail(&e, 500, "api_error", NULL, "out of memory");
        return send_error(conn, s, api, &e);
    }
    int rc = srv_request_parse(api, body, len, &s->limits, &job->req, &e);
    free(body);
    if (rc) {
        srv_job_free(job);
        return send_error(conn, s, api, &e);
    }
    static const char *const PREFIX[] = { "chatcmpl-", "cmpl-", "resp_", "msg_" };
    srv_random_id(job->id, sizeof job->id, PREFIX[api]);
    job->created = (int64_t)time(NULL);
    pthread_mutex_lock(&s->metrics.mu);
    s->metrics.requests[api]++;
    pthread_mutex_unlock(&s->metrics.mu);
    if (srv_enqueue(s, job)) {
        bool stopping;
        pthread_mutex_lock(&s->qmu);
        stopping = s->stopping;
        pthread_mutex_unlock(&s->qmu);
        srv_job_free(job);
        srv_fail(&e, 503, "overloaded_error", NULL,
                 stopping ? "the server is shutting down" : "the server is busy (request queue full); retry later");
        return send_error(conn, s, api, &e);
    }
    int status = pump(conn, s, job);
    srv_job_free(job);
    return status ? status : 500;
}

/* Anthropic's token counter: the prompt the request would render, tokenized
 * here (rendering and the tokenizer are safe on any thread). */
static int handle_count_tokens(struct mg_connection *conn, srv_server *s) {
    srv_error e = { 0 };
    char *body = NULL;
    size_t len = 0;
    if (read_body(conn, s, &body, &len, &e)) return send_error(conn, s, SRV_API_MESSAGES, &e);
    srv_request r;
    int rc = srv_request_parse(SRV_API_MESSAGES, body, len, &s->limits, &r, &e);
    free(body);
    if (rc) return send_error(conn, s, SRV_API_MESSAGES, &e);
    ds4_chat_conversation conv = { r.messages, r.n_messages, r.tools, r.n_tools, r.tool_choice_none, r.think,
                                   (uint64_t)s->cfg->ctx };
    char *text = NULL;
    size_t n_text = 0;
    int32_t *ids = NULL;
    int64_t n = 0;
    ds4_error err = { 0 };
    if (ds4_chat_render(&conv, &text, &n_text, &err) ||
        ds4_tokenize(s->tok, text, n_text, s->cfg->pretok, true, &ids, &n, &err)) {
        srv_fail(&e, 400, "invalid_request_error", NULL, "%s", err.message);
        free(text);
        srv_request_free(&r);
        return send_error(conn, s, SRV_API_MESSAGES, &e);
    }
    free(text);
    free(ids);
    srv_request_free(&r);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "input_tokens", (double)n);
    return send_json(conn, s, o);
}

static int handler(struct mg_connection *conn, void *user) {
    srv_server *s = user;
    const struct mg_request_info *ri = mg_get_request_info(conn);
    const char *method = ri->request_method, *uri = ri->local_uri ? ri->local_uri : "/";
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    srv_api api = !strncmp(uri, "/v1/messages", 12) ? SRV_API_MESSAGES : SRV_API_CHAT;
    srv_error e = { 0 };
    if (!strcmp(method, "OPTIONS")) {
        mg_response_header_start(conn, 204);
        mg_response_header_add(conn, "Content-Length", "0", -1);
        add_common_headers(conn, s);
        mg_response_header_send(conn);
        return 204;
    }
    /* The page itself holds no data; it asks for the key when the API wants one. */
    if (get && (!strcmp(uri, "/") || !strcmp(uri, "/index.html")))
        return send_body(conn, s, 200, "text/html; charset=utf-8", srv_webpage_html, strlen(srv_webpage_html), NULL);
    if (!authorized(conn, s)) {
        srv_fail(&e, 401, "authentication_error", NULL, "missing or invalid API key (send 'Authorization: Bearer "
                 "KEY' or 'x-api-key: KEY')");
        return send_error(conn, s, api, &e);
    }
    if (get && !strcmp(uri, "/health")) {
        int busy = 0, q = srv_queue_length(s, &busy);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", "ok");
        cJSON_AddStringToObject(o, "model", s->cfg->model_name);
        cJSON_AddNumberToObject(o, "queue_length", q);
        cJSON_AddBoolToObject(o, "busy", busy);
        return send_json(conn, s, o);
    }
    if (get && !strcmp(uri, "/metrics")) {
        int busy = 0, q = srv_queue_length(s, &busy);
        char *text = srv_metrics_render(&s->metrics, q, busy);
        int rc = send_body(conn, s, text ? 200 : 500, "text/plain; version=0.0.4; charset=utf-8", text ? text : "",
                           text ? strlen(text) : 0, NULL);
        free(text);
        return rc;
    }
    if (get && !strcmp(uri, "/v1/models")) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "object", "list");
        cJSON *data = cJSON_AddArrayToObject(o, "data");
        cJSON_AddItemToArray(data, model_object(s, s->cfg->model_name));
        return send_json(conn, s, o);
    }
    if (get && !strncmp(uri, "/v1/models/", 11)) {
        const char *id = uri + 11;
        if (strcmp(id, s->cfg->model_name) && strcmp(id, "deepseek-v4-flash") && strcmp(id, "deepseek-chat") &&
            strcmp(id, "deepseek-reasoner")) {
            srv_fail(&e, 404, "not_found_error", "model", "the model '%s' does not exist", id);
            return send_error(conn, s, api, &e);
        }
        return send_json(conn, s, model_object(s, id));
    }
    if (post && !strcmp(uri, "/v1/messages/count_tokens")) return handle_count_tokens(conn, s);
    static const struct { const char *path; srv_api api; } ROUTES[] = {
        { "/v1/chat/completions", SRV_API_CHAT },
        { "/v1/completions", SRV_API_COMPLETIONS },
        { "/v1/responses", SRV_API_RESPONSES },
        { "/v1/messages", SRV_API_MESSAGES },
    };
    for (size_t i = 0; i < sizeof ROUTES / sizeof ROUTES[0]; i++) {
        if (strcmp(uri, ROUTES[i].path)) continue;
        if (!post) {
            srv_fail(&e, 405, "invalid_request_error", NULL, "%s needs POST", uri);
            return send_error(conn, s, ROUTES[i].api, &e);
        }
        return handle_generate(conn, s, ROUTES[i].api);
    }
    srv_fail(&e, 404, "not_found_error", NULL, "no such endpoint: %s %s", method, uri);
    return send_error(conn, s, api, &e);
}

static int log_message(const struct mg_connection *conn, const char *message) {
    (void)conn;
    srv_log("http: %s", message);
    return 1;
}

/* ------------------------------------------------------------ lifecycle */

static int open_model(srv_server *s, const srv_config *cfg) {
    ds4_error err = { 0 };
    ds4_engine_params p = { .model_path = cfg->model_path, .backend = cfg->backend, .n_threads = cfg->threads,
                            .numerics = cfg->numerics };
    if (ds4_engine_open(&p, &s->engine, &err) || ds4_tokenizer_load(ds4_engine_gguf(s->engine), &s->tok, &err) ||
        ds4_session_create(s->engine, cfg->ctx, &s->session, &err) ||
        ds4_sample_scratch_init(&s->scratch, ds4_engine_vocab_size(s->engine), &err)) {
        srv_log("error: %s", err.message);
        return -1;
    }
    return 0;
}

static void close_model(srv_server *s) {
    ds4_sample_scratch_free(&s->scratch);
    ds4_session_free(s->session);
    ds4_tokenizer_free(s->tok);
    ds4_engine_close(s->engine);
}

int srv_run(const srv_config *cfg, volatile sig_atomic_t *stop) {
    srv_server *s = calloc(1, sizeof *s);
    if (!s) return 1;
    s->cfg = cfg;
    s->limits = (srv_limits){ cfg->model_name, cfg->ctx, cfg->think, cfg->any_model };
    srv_metrics_init(&s->metrics);
    pthread_mutex_init(&s->qmu, NULL);
    pthread_cond_init(&s->qcv, NULL);
    int rc = 1;
    struct mg_context *mg = NULL;
    bool worker_started = false;
    if (open_model(s, cfg)) goto out;
    if (cfg->kv_dir && !(s->kv = srv_kv_open(cfg->kv_dir, cfg->kv_max_mb << 20, &s->metrics, &s->tools))) goto out;
    if (pthread_create(&s->worker, NULL, srv_worker_main, s) != 0) {
        srv_log("error: cannot start the worker thread");
        goto out;
    }
    worker_started = true;

    char ports[300], threads[16], req_timeout[16], idle_timeout[16];
    bool v6 = strchr(cfg->host, ':') != NULL;
    snprintf(ports, sizeof ports, v6 ? "[%s]:%d" : "%s:%d", cfg->host, cfg->port);
    /* Each keep-alive connection holds a thread while it idles. */
    int n_threads = cfg->http_threads > 0 ? cfg->http_threads : cfg->queue_max + 112;
    snprintf(threads, sizeof threads, "%d", n_threads);
    snprintf(req_timeout, sizeof req_timeout, "%d", cfg->request_timeout_ms);
    snprintf(idle_timeout, sizeof idle_timeout, "%d", cfg->idle_timeout_ms);
    const char *options[] = { "listening_ports", ports, "num_threads", threads, "request_timeout_ms", req_timeout,
                              "keep_alive_timeout_ms", idle_timeout, "enable_keep_alive", "yes",
                              "listen_backlog", "256", NULL };
    struct mg_callbacks cb;
    memset(&cb, 0, sizeof cb);
    cb.log_message = log_message;
    mg_init_library(0);
    mg = mg_start(&cb, s, options);
    if (!mg) {
        srv_log("error: cannot listen on %s (address in use or not available)", ports);
        goto out;
    }
    mg_set_request_handler(mg, "/", handler, s);
    struct mg_server_port sp[4];
    int np = mg_get_server_ports(mg, 4, sp);
    int port = np > 0 ? sp[0].port : cfg->port;
    srv_log("listening on http://%s%s%s:%d (model %s, backend %s, ctx %lld, queue %d)", v6 ? "[" : "", cfg->host,
            v6 ? "]" : "", port, cfg->model_name, cfg->backend, (long long)cfg->ctx, cfg->queue_max);

    bool draining = false;
    for (;;) {
        struct timespec ts = { 0, 50 * 1000000L };
        nanosleep(&ts, NULL);
        if (!*stop) continue;
        if (!draining) {
            srv_log("shutting down: finishing the running and queued requests (signal again to cancel them)");
            pthread_mutex_lock(&s->qmu);
            s->stopping = true;
            pthread_cond_broadcast(&s->qcv);
            pthread_mutex_unlock(&s->qmu);
            draining = true;
        }
        if (*stop > 1) { /* a second signal: cancel everything */
            atomic_store(&s->cancel_all, 1);
        }
        int busy = 0;
        if (srv_queue_length(s, &busy) == 0 && !busy) break;
    }
    rc = 0;
out:
    if (mg) mg_stop(mg); /* waits for the connection threads; their jobs are done */
    if (worker_started) {
        pthread_mutex_lock(&s->qmu);
        s->stopping = true;
        pthread_cond_broadcast(&s->qcv);
        pthread_mutex_unlock(&s->qmu);
        pthread_join(s->worker, NULL);
        srv_worker_persist(s, 1); /* what the last turns added */
    }
    if (mg || worker_started) mg_exit_library();
    srv_kv_close(s->kv);
    srv_tool_memory_free(&s->tools);
    free(s->visible);
    close_model(s);
    srv_metrics_destroy(&s->metrics);
    pthread_mutex_destroy(&s->qmu);
    pthread_cond_destroy(&s->qcv);
    free(s);
    if (!rc) srv_log("stopped");
    return rc;
}

/*
 * server.h - `ds4server serve`: configuration and the entry point.
 *
 * The server is three parts that share one srv_server:
 *   http.c     civetweb handlers: auth, CORS, body limit, routing, errors,
 *              and the pump that writes a job's output to its connection;
 *   worker.c   the bounded FIFO queue and the one inference thread that owns
 *              the engine and its single live session;
 *   format.c   the response shapes of the four APIs (bodies and SSE events).
 * kvstore.c keeps session checkpoints on disk, metrics.c counts, and
 * webpage.c holds the chat page served at /.
 */
#ifndef DS4_SERVER_H
#define DS4_SERVER_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "ds4.h"
#include "session/sampling.h"
#include "text/chat.h"
#include "text/tokenizer.h"

typedef struct srv_config {
    /* HTTP */
    const char *host;     /* default 127.0.0.1 */
    int port;             /* default 8000; 0 picks a free port */
    const char *api_key;  /* NULL: no authentication */
    bool cors;
    int64_t max_body;     /* bytes */
    int request_timeout_ms, idle_timeout_ms;
    int queue_max;        /* requests waiting for the worker (running one excluded) */
    int http_threads;
    const char *model_name;
    bool any_model;       /* accept any model name in requests */
    /* Model */
    const char *model_path, *backend;
    int threads;
    int64_t ctx;
    ds4_numerics_mode numerics;
    ds4_pretok pretok;
    ds4_chat_think think;        /* default thinking mode */
    ds4_sampler_params sampling; /* defaults for fields a request leaves out */
    int64_t max_tokens;          /* default output limit; 0 = up to the context end */
    /* Disk KV store */
    const char *kv_dir;
    int64_t kv_max_mb;
    int64_t kv_min_tokens;
} srv_config;

void srv_config_defaults(srv_config *c);

/* Load the model, serve until *stop becomes non-zero, drain the queue and
 * return 0 (or print why it could not start and return 1). */
int srv_run(const srv_config *cfg, volatile sig_atomic_t *stop);

#endif

/*
 * serve.c - `ds4server serve`: the OpenAI- and Anthropic-compatible HTTP server.
 *
 *   ds4server serve -m FILE [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--cors]
 *                   [--kv-dir DIR --kv-max-mb N] [model and sampling options of `run`]
 *
 * The model options are those of run/chat (cli_parse_common); the sampling
 * options become the defaults for fields a request leaves out. SIGINT or
 * SIGTERM stops accepting requests, finishes the running and queued ones and
 * exits; a second signal cancels them.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"
#include "tools/cli.h"
#include "tools/tools.h"

static volatile sig_atomic_t serve_stop;

static void on_signal(int sig) {
    (void)sig;
    if (serve_stop < 2) serve_stop++;
}

static const char USAGE[] =
    "usage: ds4server serve -m FILE [options]\n"
    "  --host ADDR               address to listen on (default 127.0.0.1)\n"
    "  --port N                  port (default 8000; 0 picks a free one)\n"
    "  --api-key KEY             require 'Authorization: Bearer KEY' or 'x-api-key: KEY'\n"
    "                            (default: $DS4SERVER_API_KEY when set)\n"
    "  --cors                    answer with permissive CORS headers\n"
    "  --model-name NAME         the model id clients use (default deepseek-v4-flash)\n"
    "  --any-model               accept requests for any model name (clients with fixed names)\n"
    "  --max-body-mb N           request body limit (default 16)\n"
    "  --request-timeout S       seconds to receive a request (default 600)\n"
    "  --idle-timeout S          keep-alive idle seconds (default 5)\n"
    "  --queue N                 requests that may wait for the worker (default 16; more get 503)\n"
    "  --http-threads N          connection threads (default queue + 112)\n"
    "  --kv-dir DIR              keep KV checkpoints of conversations in DIR\n"
    "  --kv-max-mb N             size limit of DIR (default 4096)\n"
    "  --kv-min-tokens N         store conversations of at least N tokens (default 512)\n"
    "  -n N                      default output limit (default: up to the context end)\n"
    "  --ctx N                   context size in tokens (default 32768 for serve)\n";

static int parse_count(const char *opt, const char *v, int64_t lo, int64_t *out) {
    char *end;
    errno = 0;
    long long n = strtoll(v, &end, 10);
    if (errno || end == v || *end || n < lo) return tool_fail("serve", "%s '%s' is not a valid number", opt, v);
    *out = n;
    return 0;
}

int tool_serve(int argc, char **argv);

int tool_serve(int argc, char **argv) {
    cli_opts o;
    cli_opts_defaults(&o);
    o.ctx = 32768;
    o.n_predict = 0;
    srv_config c;
    srv_config_defaults(&c);
    c.api_key = getenv("DS4SERVER_API_KEY");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("%s%s", USAGE, cli_common_usage());
            return 0;
        }
        if (!strcmp(a, "--cors") || !strcmp(a, "--any-model")) {
            if (!strcmp(a, "--cors")) c.cors = true;
            else c.any_model = true;
            continue;
        }
        static const char *const WITH_VALUE[] = { "--host", "--port", "--api-key", "--model-name", "--max-body-mb",
                                                  "--request-timeout", "--idle-timeout", "--queue",
                                                  "--http-threads", "--kv-dir", "--kv-max-mb", "--kv-min-tokens",
                                                  NULL };
        bool known = false;
        for (int k = 0; WITH_VALUE[k]; k++) known |= !strcmp(a, WITH_VALUE[k]);
        if (known) {
            if (i + 1 >= argc) return tool_fail("serve", "%s needs a value", a);
            const char *v = argv[++i];
            int64_t n = 0;
            if (!strcmp(a, "--host")) c.host = v;
            else if (!strcmp(a, "--api-key")) c.api_key = v;
            else if (!strcmp(a, "--model-name")) c.model_name = v;
            else if (!strcmp(a, "--kv-dir")) c.kv_dir = v;
            else if (parse_count(a, v, !strcmp(a, "--port") || !strcmp(a, "--kv-min-tokens") ? 0 : 1, &n)) return 1;
            else if (!strcmp(a, "--port")) {
                if (n > 65535) return tool_fail("serve", "--port must be at most 65535");
                c.port = (int)n;
            } else if (!strcmp(a, "--max-body-mb")) c.max_body = n << 20;
            else if (!strcmp(a, "--request-timeout")) c.request_timeout_ms = (int)(n * 1000);
            else if (!strcmp(a, "--idle-timeout")) c.idle_timeout_ms = (int)(n * 1000);
            else if (!strcmp(a, "--queue")) c.queue_max = (int)n;
            else if (!strcmp(a, "--http-threads")) c.http_threads = (int)n;
            else if (!strcmp(a, "--kv-max-mb")) c.kv_max_mb = n;
            else c.kv_min_tokens = n;
            continue;
        }
        int r = cli_parse_common("serve", &o, argc, argv, &i);
        if (r < 0) return 1;
        if (r == 0) return tool_fail("serve", "unknown option '%s' (--help lists them)", a);
    }
    if (!o.model) return tool_fail("serve", "no model given (-m FILE)");
    if (o.ctx < 16) return tool_fail("serve", "--ctx must be at least 16");
    c.model_path = o.model;
    c.backend = o.backend;
    c.threads = o.threads;
    c.ctx = o.ctx;
    c.numerics = o.numerics;
    c.pretok = o.pretok;
    c.think = o.think;
    c.sampling = o.sampling;
    c.max_tokens = o.n_predict;
    if (c.kv_min_tokens < 1) c.kv_min_tokens = 1;

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    return srv_run(&c, &serve_stop);
}

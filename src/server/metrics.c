/*
 * metrics.c - counters of the server, in the Prometheus text format (GET /metrics).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

void srv_metrics_init(srv_metrics *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
}

void srv_metrics_destroy(srv_metrics *m) { pthread_mutex_destroy(&m->mu); }

static void metric(chat_buf *b, const char *name, const char *type, const char *help, double value) {
    char line[512];
    snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, value);
    chat_buf_puts(b, line);
}

char *srv_metrics_render(srv_metrics *m, int queue_length, int busy) {
    chat_buf b = { 0 };
    char line[256];
    pthread_mutex_lock(&m->mu);
    chat_buf_puts(&b, "# HELP ds4_requests_total Generation requests with a valid body (queued or refused), by API.\n"
                      "# TYPE ds4_requests_total counter\n");
    for (int api = 0; api < 4; api++) {
        snprintf(line, sizeof line, "ds4_requests_total{api=\"%s\"} %llu\n", srv_api_name((srv_api)api),
                 (unsigned long long)m->requests[api]);
        chat_buf_puts(&b, line);
    }
    chat_buf_puts(&b, "# HELP ds4_errors_total Requests answered with an error status, by class.\n"
                      "# TYPE ds4_errors_total counter\n");
    snprintf(line, sizeof line, "ds4_errors_total{class=\"4xx\"} %llu\nds4_errors_total{class=\"5xx\"} %llu\n",
             (unsigned long long)m->errors_4xx, (unsigned long long)m->errors_5xx);
    chat_buf_puts(&b, line);
    metric(&b, "ds4_rejected_queue_full_total", "counter", "Requests refused with 503 because the queue was full.",
           (double)m->rejected_full);
    metric(&b, "ds4_cancelled_total", "counter", "Generations stopped because the client went away.",
           (double)m->cancelled);
    metric(&b, "ds4_prompt_tokens_total", "counter", "Prompt tokens of all requests.", (double)m->prompt_tokens);
    metric(&b, "ds4_prefill_tokens_total", "counter", "Prompt tokens actually evaluated (not reused).",
           (double)m->prefill_tokens);
    metric(&b, "ds4_cached_tokens_total", "counter", "Prompt tokens reused from the KV state.",
           (double)m->cached_tokens);
    metric(&b, "ds4_generated_tokens_total", "counter", "Tokens generated.", (double)m->generated_tokens);
    metric(&b, "ds4_prefill_seconds_total", "counter", "Time spent in prefill.", m->prefill_seconds);
    metric(&b, "ds4_decode_seconds_total", "counter", "Time spent decoding.", m->decode_seconds);
    metric(&b, "ds4_prefill_tokens_per_second", "gauge", "Prefill speed of the last request that prefilled.",
           m->last_prefill_tps);
    metric(&b, "ds4_decode_tokens_per_second", "gauge", "Decode speed of the last request that generated.",
           m->last_decode_tps);
    metric(&b, "ds4_kv_live_hits_total", "counter", "Requests that reused the live session's KV state.",
           (double)m->live_hits);
    metric(&b, "ds4_kv_disk_hits_total", "counter", "Requests that resumed from a disk checkpoint.",
           (double)m->disk_hits);
    metric(&b, "ds4_kv_disk_saves_total", "counter", "Checkpoints written to the disk KV store.",
           (double)m->disk_saves);
    metric(&b, "ds4_kv_disk_failures_total", "counter", "Disk KV store writes or reads that failed.",
           (double)m->disk_failures);
    metric(&b, "ds4_kv_disk_bytes", "gauge", "Bytes in the disk KV store.", (double)m->disk_bytes);
    metric(&b, "ds4_kv_disk_files", "gauge", "Checkpoints in the disk KV store.", (double)m->disk_files);
    pthread_mutex_unlock(&m->mu);
    metric(&b, "ds4_queue_length", "gauge", "Requests waiting for the worker.", queue_length);
    metric(&b, "ds4_worker_busy", "gauge", "1 while a request is being generated.", busy);
    return chat_buf_take(&b, NULL);
}

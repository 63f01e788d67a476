/*
 * server_internal.h - what the parts of the server share: the server, the
 * job (one request on its way through the queue) and the module interfaces.
 */
#ifndef DS4_SERVER_INTERNAL_H
#define DS4_SERVER_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "server/request.h"
#include "server/server.h"
#include "text/chat_internal.h"

/* ------------------------------------------------------------ metrics */

typedef struct srv_metrics {
    pthread_mutex_t mu;
    uint64_t requests[4];      /* per srv_api */
    uint64_t errors_4xx, errors_5xx, rejected_full, cancelled;
    uint64_t prompt_tokens, prefill_tokens, cached_tokens, generated_tokens;
    double prefill_seconds, decode_seconds;
    double last_prefill_tps, last_decode_tps;
    uint64_t live_hits, disk_hits, disk_saves, disk_failures;
    int64_t disk_bytes, disk_files;
} srv_metrics;

void srv_metrics_init(srv_metrics *m);
void srv_metrics_destroy(srv_metrics *m);
/* Prometheus text exposition; malloc'd. */
char *srv_metrics_render(srv_metrics *m, int queue_length, int busy);

/* ------------------------------------------------------------ tool memory */

/* API tool-call id -> the exact DSML block the model generated (bounded;
 * the oldest ids are forgotten first). Used by the worker thread only. */
typedef struct srv_tool_memory {
    char **ids, **dsml;
    size_t n, cap, head; /* ring of cap entries */
} srv_tool_memory;

void srv_tool_memory_free(srv_tool_memory *t);
void srv_tool_memory_put(srv_tool_memory *t, const char *id, const char *dsml);
const char *srv_tool_memory_get(const srv_tool_memory *t, const char *id);

/* An unguessable id: prefix + 32 lowercase hex digits from 16 random bytes. */
void srv_random_id(char *out, size_t cap, const char *prefix);

/* ------------------------------------------------------------ disk KV store */

typedef struct srv_kvstore srv_kvstore;

/* Open (creating) dir; problems are logged and give a store that caches
 * nothing. Never NULL unless out of memory. The tool ids stored with the
 * entries go into `tools`, and saving stores the ids of `tools` whose DSML
 * occurs in the saved text. */
srv_kvstore *srv_kv_open(const char *dir, int64_t max_bytes, srv_metrics *metrics, srv_tool_memory *tools);
void srv_kv_close(srv_kvstore *kv);
/* The entry with the longest token count whose text is a byte prefix of
 * text[0..len); -1 when none. *n_tokens receives its token count. */
int srv_kv_find(srv_kvstore *kv, const char *text, size_t len, int64_t *n_tokens);
/* Load entry idx into the session. A file that fails to load is deleted
 * (with a warning) and -1 returned. */
int srv_kv_load(srv_kvstore *kv, int idx, ds4_session *session);
/* Store the session's current state (its tokens decode to `text`); failures
 * are logged and disable writing. */
void srv_kv_save(srv_kvstore *kv, ds4_session *session, const char *text, size_t text_len);

typedef struct srv_server srv_server;

/* ------------------------------------------------------------ jobs */

typedef enum srv_finish {
    SRV_FINISH_STOP = 0,  /* EOS */
    SRV_FINISH_LENGTH,    /* max_tokens or the context end */
    SRV_FINISH_TOOLS,     /* a tool-call block closed */
    SRV_FINISH_STOP_SEQ,  /* a stop sequence */
    SRV_FINISH_ERROR,     /* generation failed after the response started */
    SRV_FINISH_CANCELLED, /* the client went away or the server is shutting down */
} srv_finish;

#define SRV_MAX_CALLS 64

typedef struct srv_usage {
    int64_t prompt_tokens, cached_tokens, completion_tokens;
    double prefill_seconds, decode_seconds;
} srv_usage;

typedef struct srv_job {
    srv_request req;
    char id[64];      /* response id: chatcmpl-..., cmpl-..., resp_..., msg_... */
    int64_t created;  /* unix time */
    /* Output, written by the worker and drained by the connection thread. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    chat_buf out;
    int status;            /* HTTP status once decided; 0 before */
    const char *mime;      /* content type with status */
    const char *retry_after;
    bool done;             /* no more output */
    atomic_int cancel;     /* set by the connection thread (client gone) or shutdown */
    struct srv_job *next;
    /* Streaming state (worker only). */
    int block;             /* open Anthropic/Responses block kind (format.c) */
    int block_index;       /* Anthropic content block index / Responses output index */
    int seq;               /* Responses sequence_number */
    size_t n_calls;        /* calls started while streaming */
    char call_ids[SRV_MAX_CALLS][48];
    char call_item_ids[SRV_MAX_CALLS][48];
    char msg_item_id[48], reasoning_item_id[48];
    chat_buf reasoning_acc, content_acc, args_acc[SRV_MAX_CALLS]; /* for streamed "done" events */
    char call_names[SRV_MAX_CALLS][128];
} srv_job;

/* ------------------------------------------------------------ server */

struct srv_server {
    const srv_config *cfg;
    srv_limits limits;
    ds4_engine *engine;
    ds4_session *session;
    ds4_tokenizer *tok;
    ds4_sample_scratch scratch;
    srv_metrics metrics;
    srv_kvstore *kv;
    srv_tool_memory tools;
    /* After a thinking turn outside tool context the next prompt renders that
     * turn without its reasoning (spec 5.4): `visible` is the text the live
     * session stands for in that rendering, valid while the session still
     * holds visible_tokens tokens (spec 6.2, the thinking-visible match). */
    char *visible;
    size_t visible_len;
    int64_t visible_tokens;
    /* Tokens of the live session already in the disk store (a prefix of it). */
    int64_t kv_saved_tokens;
    uint64_t counter;
    /* queue */
    pthread_mutex_t qmu;
    pthread_cond_t qcv;
    srv_job *head, *tail;
    int queued;
    atomic_int cancel_all; /* a second stop signal: cancel every job */
    bool busy, stopping;
    pthread_t worker;
};

/* worker.c: 0 and the job queued, or -1 when the queue is full or the server
 * is stopping. */
int srv_enqueue(srv_server *s, srv_job *job);
void *srv_worker_main(void *arg);
/* Store the live session on disk when it holds at least min_new tokens more
 * than what is stored (worker thread, or after it stopped). */
void srv_worker_persist(srv_server *s, int64_t min_new);
int srv_queue_length(srv_server *s, int *busy);

/* A job with its lock and condition ready (NULL when out of memory), and
 * its release (request, output buffers, lock; NULL-safe). */
srv_job *srv_job_new(void);
void srv_job_free(srv_job *job);

/* Job output (worker side). */
void srv_job_begin(srv_job *job, int status, const char *mime);
void srv_job_write(srv_job *job, const char *bytes, size_t n);
void srv_job_finish(srv_job *job);
/* An error before any output: the API's error body with that status
 * (srv_job_fail also finishes the job). */
void srv_job_error(srv_job *job, const srv_error *e);
void srv_job_fail(srv_job *job, const srv_error *e);

/* Generated text -> API output for one job: stop sequences, the reasoning /
 * content / DSML split (ds4_chat_stream) and the response events. The worker
 * pushes the detokenized text as it is sampled; tests push text directly. */
typedef struct srv_gen {
    srv_server *s;           /* for the shutdown flag; may be NULL */
    srv_job *job;
    ds4_chat_stream *stream; /* NULL for /v1/completions */
    chat_buf all;            /* every generated byte up to a stop sequence */
    chat_buf pending;        /* held back: may start a stop sequence */
    double last_keepalive;
    srv_finish finish;
    const char *stop_hit;
    ds4_error err;
    bool failed;
    ds4_chat_reply reply;
} srv_gen;

int srv_gen_init(srv_gen *g, srv_server *s, srv_job *job, bool thinking, ds4_error *err);
void srv_gen_push(srv_gen *g, const char *text, size_t len);
/* Inside a DSML block on structure (not a string parameter's body): the
 * worker samples such tokens greedily. */
bool srv_gen_dsml_structural(const srv_gen *g);
/* The closing output (or the error body) of the job; does not finish it. */
void srv_gen_complete(srv_gen *g, srv_tool_memory *tools, const srv_usage *usage);
void srv_gen_free(srv_gen *g);

/* format.c: the response of one API, event by event. */
typedef struct srv_result {
    const ds4_chat_reply *reply; /* parsed reply (chat APIs) */
    const char *text;            /* completions: the raw text */
    size_t text_len;
    srv_finish finish;
    const char *stop_sequence;
    srv_usage usage;
    const char *const *call_ids; /* one per reply call */
} srv_result;

void srv_format_error(chat_buf *b, srv_api api, const srv_error *e);
void srv_format_stream_begin(srv_job *job);
void srv_format_reasoning(srv_job *job, const char *text, size_t len);
void srv_format_content(srv_job *job, const char *text, size_t len);
void srv_format_tool_start(srv_job *job, size_t index, const char *name);
void srv_format_tool_args(srv_job *job, size_t index, const char *text, size_t len);
void srv_format_tool_end(srv_job *job, size_t index);
/* Non-streaming: the whole body. Streaming: the closing events. */
void srv_format_finish(srv_job *job, const srv_result *res);
const char *srv_call_id_prefix(srv_api api);

/* webpage.c */
extern const char srv_webpage_html[];

/* Log a line to stderr with a timestamp. */
void srv_log(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

#endif

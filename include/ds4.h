/*
 * ds4.h - the public API of libds4.
 *
 * This is the only header that tools, the server and language bindings use.
 * Everything here is plain C11 with fixed-width types, so it binds from any
 * language with a C FFI. Functions report failure through a return status and
 * fill a caller-provided ds4_error with a one-line, human-readable message.
 */
#ifndef DS4_H
#define DS4_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DS4_VERSION_MAJOR 0
#define DS4_VERSION_MINOR 1
#define DS4_VERSION_PATCH 0

typedef enum ds4_status {
    DS4_OK = 0,
    DS4_ERR_IO = 1,          /* open/read/write/mmap failed */
    DS4_ERR_FORMAT = 2,      /* malformed file or data */
    DS4_ERR_NOMEM = 3,       /* allocation failed */
    DS4_ERR_INVALID = 4,     /* bad argument from the caller */
    DS4_ERR_UNSUPPORTED = 5, /* valid but not implemented here */
    DS4_ERR_NOT_FOUND = 6,   /* named key/tensor/file absent */
    DS4_ERR_DEVICE = 7,      /* the accelerator failed (driver, launch, kernel fault) */
} ds4_status;

#define DS4_ERROR_MSG_MAX 512

typedef struct ds4_error {
    ds4_status status;
    char message[DS4_ERROR_MSG_MAX];
} ds4_error;

/* "0.1.0" plus build flavour, e.g. "0.1.0 (cpu)" or "0.1.0 (cpu+cuda)". */
const char *ds4_version(void);

/* Name of a status code, e.g. "format error". */
const char *ds4_status_name(ds4_status status);

/* Backends compiled into this library: 1 if `name` ("cpu", "cuda") is built in. */
int ds4_backend_compiled(const char *name);

/*
 * Model files (GGUF). A ds4_file is a memory-mapped, fully validated GGUF:
 * every count, offset and size was checked against the file when it opened.
 */
typedef struct ds4_file ds4_file;

ds4_status ds4_file_open(const char *path, ds4_file **out, ds4_error *err);
void ds4_file_close(ds4_file *file);
uint32_t ds4_file_version(const ds4_file *file);
uint64_t ds4_file_n_tensors(const ds4_file *file);
uint64_t ds4_file_n_metadata(const ds4_file *file);
/* Architecture from general.architecture, or "" when absent. */
const char *ds4_file_architecture(const ds4_file *file);

/*
 * Engines and sessions.
 *
 * An engine is a model file bound to one backend ("cpu", or "cuda" in CUDA
 * builds; never a silent fallback). A session owns a model state and its
 * token history: it evaluates prompts (reusing the longest prefix it already
 * holds), decodes tokens one at a time, keeps the logits of the next token,
 * and saves and restores its whole state to a checkpoint file.
 */
typedef struct ds4_engine ds4_engine;
typedef struct ds4_session ds4_session;

typedef enum ds4_numerics_mode {
    DS4_NUMERICS_MODE_DS4 = 0,       /* DS4's rounding steps (default) */
    DS4_NUMERICS_MODE_REFERENCE = 1, /* float32 throughout */
    /* DS4's, except that a prompt's Q8_0 and F16 weight products take
     * binary16 weights and activations, as DS4's CUDA prefill does; decoded
     * tokens are DS4's (docs/f16-prefill-numerics.md) */
    DS4_NUMERICS_MODE_DS4_F16 = 2,
} ds4_numerics_mode;

typedef struct ds4_engine_params {
    const char *model_path;
    const char *backend;        /* "cpu" (NULL = "cpu") or "cuda" */
    int n_threads;              /* CPU threads; <= 0 = one per core */
    ds4_numerics_mode numerics;
    /* Optional: called while the weights are bound to the backend (for CUDA,
     * uploaded to device memory) with the bytes done and the total. */
    void (*load_progress)(void *ctx, int64_t done, int64_t total);
    void *load_progress_ctx;
} ds4_engine_params;

ds4_status ds4_engine_open(const ds4_engine_params *params, ds4_engine **out, ds4_error *err);
void ds4_engine_close(ds4_engine *engine);
int64_t ds4_engine_vocab_size(const ds4_engine *engine);

/* A session with room for n_ctx positions. */
ds4_status ds4_session_create(ds4_engine *engine, int64_t n_ctx, ds4_session **out, ds4_error *err);
void ds4_session_free(ds4_session *session);

/* Make the session hold exactly tokens[0..n): the common prefix with what it
 * holds is kept (a prompt that extends the history prefills only the
 * suffix; one that diverges rewinds to the last prompt snapshot at or before
 * the divergence, else re-prefills). n must be at least 1 and below the
 * context size. *n_evaluated (may be NULL) receives how many tokens were
 * actually evaluated. Afterwards ds4_session_logits gives the next-token
 * logits. */
ds4_status ds4_session_sync(ds4_session *session, const int32_t *tokens, int64_t n, int64_t *n_evaluated,
                            ds4_error *err);
/* Append one token (decode). Fails when the context is full. */
ds4_status ds4_session_decode(ds4_session *session, int32_t token, ds4_error *err);
/* Append one token, and let the backend pick the greedy next token into
 * *next: the first index of the maximum next-token logit (what a
 * temperature-0 sampler takes from ds4_session_logits), with only the token
 * id brought back from the device. ds4_session_logits still gives the
 * logits (fetched from the backend when asked for). */
ds4_status ds4_session_decode_greedy(ds4_session *session, int32_t token, int32_t *next, ds4_error *err);
/* Append one token to each of n sessions of the same engine in one
 * evaluation (the weights are read once for all of them): session i gets
 * tokens[i], exactly as n ds4_session_decode calls would (on the CPU
 * backend bit for bit). The sessions must be distinct, hold at least one
 * token and have room for one more; nothing changes when any check fails.
 * If the evaluation itself fails, every session in the call is emptied. */
ds4_status ds4_session_decode_batch(ds4_session *const *sessions, const int32_t *tokens, int64_t n,
                                    ds4_error *err);
/* Next-token logits [vocab] for the current history; NULL when empty, or
 * when logits left on the backend by a greedy decode could not be brought
 * back (a device error: the next evaluation reports it). */
const float *ds4_session_logits(const ds4_session *session);
const int32_t *ds4_session_tokens(const ds4_session *session, int64_t *n);
int64_t ds4_session_context(const ds4_session *session);

/* Checkpoints: the whole state, versioned, with the model fingerprint and a
 * CRC-32 of the payload, written atomically (temporary file + rename). A
 * truncated, corrupt or other-model file is refused and the session is left
 * as it was (in the rare case of a well-formed file whose state does not fit
 * this session, at its last prompt snapshot). */
ds4_status ds4_session_save(const ds4_session *session, const char *path, ds4_error *err);
ds4_status ds4_session_load(ds4_session *session, const char *path, ds4_error *err);

#ifdef __cplusplus
}
#endif

#endif /* DS4_H */

/*
 * session.c - engines (model file + backend) and sessions (state + history).
 *
 * Prefix reuse: a session remembers the tokens its state holds. A new prompt
 * that extends them is prefilled from where the state stands. Compressed
 * caches are append-only, so a prompt that diverges cannot simply be rolled
 * back; instead the session keeps an in-memory snapshot of the state taken at
 * the end of the last prompt it evaluated, restores it when the divergence
 * comes after that point (the common case of regenerating a reply), and
 * otherwise evaluates the prompt from the start.
 *
 * Checkpoint file: a 40-byte header, then the state payload of spec 4.3.
 *   0  "DS4CKPT\n"         8 bytes
 *   8  u32 version (1)     12 u32 reserved (0)
 *   16 u64 model fingerprint
 *   24 u64 payload bytes
 *   32 u32 CRC-32 of the payload   36 u32 CRC-32 of bytes 0..35
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "backends/backend.h"
#include "core/error.h"
#include "core/gguf.h"
#include "ds4.h"
#include "models/deepseek4/ds4_model.h"
#include "session/engine.h"

#define CKPT_MAGIC "DS4CKPT\n"
#define CKPT_VERSION 1u
#define CKPT_HEADER 40

struct ds4_engine {
    gguf_file *file;
    ds4_backend *be;
    ds4_model *model;
    ds4_numerics num;
};

struct ds4_session {
    ds4_engine *engine;
    ds4_state *state;
    int64_t n_ctx;
    int32_t *tokens;
    int64_t n_tokens;
    float *logits; /* [vocab], valid when n_tokens > 0 and not logits_stale */
    bool logits_stale; /* a greedy decode left them on the backend (fetched when asked for) */
    uint8_t *snap; /* payload of the state at the end of the last prompt */
    int64_t snap_size, snap_tokens;
    ds4_progress_fn progress;
    void *progress_ctx;
};


/* ------------------------------------------------------------ engine */

ds4_status ds4_engine_open(const ds4_engine_params *p, ds4_engine **out, ds4_error *err) {
    *out = NULL;
    if (!p || !p->model_path) return ds4_error_set(err, DS4_ERR_INVALID, "no model path given");
    ds4_engine *e = calloc(1, sizeof *e);
    if (!e) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    e->num = (ds4_numerics)p->numerics; /* the same numbers (backend.c) */
    if (!ds4_numerics_name(e->num)) {
        free(e);
        return ds4_error_set(err, DS4_ERR_INVALID, "numerics mode %d is not one of " DS4_NUMERICS_NAMES,
                             (int)p->numerics);
    }
    ds4_status st = gguf_open(p->model_path, &e->file, err);
    if (!st) st = ds4_backend_create(p->backend, p->n_threads, &e->be, err);
    if (!st) st = ds4_backend_check_numerics(e->be, e->num, err); /* before the weights are read */
    if (!st) st = ds4_model_load_progress(e->file, e->be, p->load_progress, p->load_progress_ctx, &e->model, err);
    if (st) {
        ds4_engine_close(e);
        return st;
    }
    *out = e;
    return DS4_OK;
}

void ds4_engine_close(ds4_engine *e) {
    if (!e) return;
    ds4_model_free(e->model);
    ds4_backend_destroy(e->be);
    gguf_close(e->file);
    free(e);
}

int64_t ds4_engine_vocab_size(const ds4_engine *e) { return ds4_model_config(e->model)->n_vocab; }
const gguf_file *ds4_engine_gguf(const ds4_engine *e) { return e->file; }

void ds4_engine_prefetch(const ds4_engine *e, bool (*fn)(void *ctx, int64_t done, int64_t total), void *ctx) {
    const uint8_t *map = e->file->map;
    const int64_t size = (int64_t)e->file->size, step = (int64_t)256 << 20;
    volatile uint8_t sink = 0;
    for (int64_t off = 0; off < size; off += step) {
        int64_t len = size - off < step ? size - off : step;
        /* the mapping is page-aligned at its start, so off is too */
        madvise((void *)(map + off), (size_t)len, MADV_WILLNEED);
        for (int64_t i = 0; i < len; i += 4096) sink ^= map[off + i];
        if (fn && !fn(ctx, off + len, size)) break;
    }
    (void)sink;
}

/* ------------------------------------------------------------ session */

ds4_status ds4_session_create(ds4_engine *e, int64_t n_ctx, ds4_session **out, ds4_error *err) {
    *out = NULL;
    if (n_ctx < 2) return ds4_error_set(err, DS4_ERR_INVALID, "context size %lld is too small (at least 2)",
                                        (long long)n_ctx);
    if (n_ctx > UINT32_MAX / 2) return ds4_error_set(err, DS4_ERR_INVALID, "context size %lld is too large",
                                                     (long long)n_ctx);
    ds4_session *s = calloc(1, sizeof *s);
    if (!s) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    s->engine = e;
    s->n_ctx = n_ctx;
    s->tokens = malloc((size_t)n_ctx * sizeof *s->tokens);
    s->logits = malloc((size_t)ds4_engine_vocab_size(e) * sizeof *s->logits);
    ds4_status st = (!s->tokens || !s->logits) ? ds4_error_set(err, DS4_ERR_NOMEM, "out of memory")
                                               : ds4_state_create(e->model, n_ctx, &s->state, err);
    if (st) {
        ds4_session_free(s);
        return st;
    }
    *out = s;
    return DS4_OK;
}

void ds4_session_free(ds4_session *s) {
    if (!s) return;
    ds4_state_free(s->state);
    free(s->tokens);
    free(s->logits);
    free(s->snap);
    free(s);
}

/* The logits are current: brought back from the backend after a greedy
 * decode left them there. */
static ds4_status ensure_logits(ds4_session *s, ds4_error *err) {
    if (!s->logits_stale || s->n_tokens == 0) return DS4_OK;
    ds4_status st = ds4_model_fetch_logits(s->engine->model, s->state, s->logits, err);
    if (!st) s->logits_stale = false;
    return st;
}

const float *ds4_session_logits(const ds4_session *s) {
    if (!s->n_tokens) return NULL;
    ds4_error err = { 0 };
    /* the logits are the session's value: fetching them changes no state */
    return ensure_logits((ds4_session *)s, &err) ? NULL : s->logits;
}
int64_t ds4_session_context(const ds4_session *s) { return s->n_ctx; }

const int32_t *ds4_session_tokens(const ds4_session *s, int64_t *n) {
    if (n) *n = s->n_tokens;
    return s->tokens;
}

static void forget(ds4_session *s) {
    ds4_state_reset(s->state);
    s->n_tokens = 0;
    s->logits_stale = false;
}

void ds4_session_set_progress(ds4_session *s, ds4_progress_fn fn, void *ctx) {
    s->progress = fn;
    s->progress_ctx = ctx;
}

/* Evaluate tokens[0..n) on top of the current history, in chunks when a
 * progress callback is set. On failure the state is unusable: the session is
 * emptied. A callback that asks to stop ends the evaluation early with
 * DS4_ERR_INVALID ("interrupted"); what was evaluated stays. */
static ds4_status evaluate(ds4_session *s, const int32_t *tokens, int64_t n, ds4_error *err) {
    int64_t chunk = s->progress ? ds4_model_eval_chunk(s->engine->model) : n; /* a report per model chunk */
    for (int64_t done = 0; done < n;) {
        int64_t len = n - done < chunk ? n - done : chunk;
        ds4_status st = ds4_model_eval(s->engine->model, s->state, tokens + done, len, s->engine->num, s->logits,
                                       false, err);
        if (st) {
            forget(s);
            return st;
        }
        memcpy(s->tokens + s->n_tokens, tokens + done, (size_t)len * sizeof *tokens);
        s->n_tokens += len;
        s->logits_stale = false;
        done += len;
        if (s->progress && !s->progress(s->progress_ctx, done, n) && done < n)
            return ds4_error_set(err, DS4_ERR_INVALID, "interrupted after %lld of %lld tokens", (long long)done,
                                 (long long)n);
    }
    return DS4_OK;
}

static ds4_status take_snapshot(ds4_session *s, ds4_error *err) {
    int64_t size = ds4_state_payload_size(s->state, s->n_tokens);
    if (size > s->snap_size) {
        uint8_t *p = realloc(s->snap, (size_t)size);
        if (!p) {
            s->snap_tokens = -1; /* no snapshot: divergence re-prefills */
            return DS4_OK;
        }
        s->snap = p;
    }
    s->snap_size = size;
    ds4_status st = ds4_state_save_payload(s->state, s->tokens, s->n_tokens, s->logits, s->snap, size, err);
    s->snap_tokens = st ? -1 : s->n_tokens;
    return st;
}

static ds4_status restore_payload(ds4_session *s, const uint8_t *data, int64_t size, ds4_error *err) {
    int32_t *tokens = NULL;
    int64_t n = 0;
    ds4_status st = ds4_state_load_payload(s->state, data, size, &tokens, &n, s->logits, err);
    if (st) {
        forget(s);
        return st;
    }
    memcpy(s->tokens, tokens, (size_t)n * sizeof *tokens);
    s->n_tokens = n;
    s->logits_stale = false;
    free(tokens);
    return DS4_OK;
}

ds4_status ds4_session_sync(ds4_session *s, const int32_t *tokens, int64_t n, int64_t *n_evaluated, ds4_error *err) {
    if (n_evaluated) *n_evaluated = 0;
    if (n < 1) return ds4_error_set(err, DS4_ERR_INVALID, "empty prompt");
    if (n >= s->n_ctx)
        return ds4_error_set(err, DS4_ERR_INVALID, "the prompt has %lld tokens; the context holds %lld, so a prompt "
                             "must be at most %lld tokens", (long long)n, (long long)s->n_ctx,
                             (long long)s->n_ctx - 1);
    int64_t vocab = ds4_engine_vocab_size(s->engine);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= vocab)
            return ds4_error_set(err, DS4_ERR_INVALID, "token %d at index %lld is outside the vocabulary",
                                 tokens[i], (long long)i);
    int64_t common = 0;
    while (common < s->n_tokens && common < n && s->tokens[common] == tokens[common]) common++;
    if (common == n && common == s->n_tokens) return ensure_logits(s, err); /* already there */
    if (common < s->n_tokens || common == n) {
        /* Diverges (or the prompt is a strict prefix of the history): go back. */
        if (s->snap_tokens > 0 && s->snap_tokens <= common && s->snap_tokens <= n) {
            ds4_status st = restore_payload(s, s->snap, s->snap_size, err);
            if (st) return st;
        } else {
            forget(s);
        }
    }
    int64_t start = s->n_tokens;
    if (start < n) {
        ds4_status st = evaluate(s, tokens + start, n - start, err);
        if (st) return st;
    }
    if (n_evaluated) *n_evaluated = n - start;
    return take_snapshot(s, err);
}

/* One more token fits the context and is in the vocabulary. */
static ds4_status decode_check(const ds4_session *s, int32_t token, ds4_error *err) {
    if (s->n_tokens + 1 > s->n_ctx)
        return ds4_error_set(err, DS4_ERR_INVALID, "the context of %lld tokens is full", (long long)s->n_ctx);
    if (token < 0 || token >= ds4_engine_vocab_size(s->engine))
        return ds4_error_set(err, DS4_ERR_INVALID, "token %d is outside the vocabulary", token);
    return DS4_OK;
}

ds4_status ds4_session_decode(ds4_session *s, int32_t token, ds4_error *err) {
    ds4_status st = decode_check(s, token, err);
    return st ? st : evaluate(s, &token, 1, err);
}

ds4_status ds4_session_decode_greedy(ds4_session *s, int32_t token, int32_t *next, ds4_error *err) {
    if (!next) return ds4_error_set(err, DS4_ERR_INVALID, "greedy decode: no place for the next token");
    ds4_status st = decode_check(s, token, err);
    if (st) return st;
    st = ds4_model_eval_greedy(s->engine->model, s->state, &token, 1, s->engine->num, next, err);
    if (st) {
        forget(s);
        return st;
    }
    s->tokens[s->n_tokens++] = token;
    s->logits_stale = true;
    return DS4_OK;
}

ds4_status ds4_session_decode_batch(ds4_session *const *ss, const int32_t *tokens, int64_t n, ds4_error *err) {
    if (n < 1 || !ss || !tokens) return ds4_error_set(err, DS4_ERR_INVALID, "no sessions to decode");
    ds4_engine *e = ss[0] ? ss[0]->engine : NULL;
    for (int64_t i = 0; i < n; i++) {
        const ds4_session *s = ss[i];
        if (!s || s->engine != e)
            return ds4_error_set(err, DS4_ERR_INVALID, "batch entry %lld: %s", (long long)i,
                                 s ? "a session of another engine" : "no session");
        if (s->n_tokens < 1)
            return ds4_error_set(err, DS4_ERR_INVALID, "batch entry %lld: the session is empty (sync a prompt first)",
                                 (long long)i);
        if (s->n_tokens + 1 > s->n_ctx)
            return ds4_error_set(err, DS4_ERR_INVALID, "batch entry %lld: the context of %lld tokens is full",
                                 (long long)i, (long long)s->n_ctx);
    }
    const int64_t V = ds4_engine_vocab_size(e);
    ds4_state **states = malloc((size_t)n * sizeof *states);
    float *logits = malloc((size_t)(n * V) * sizeof *logits);
    if (!states || !logits) {
        free(states);
        free(logits);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for a batch of %lld", (long long)n);
    }
    for (int64_t i = 0; i < n; i++) states[i] = ss[i]->state;
    /* the model checks the tokens and that no state appears twice before it
     * changes anything */
    const int64_t pos0 = ds4_state_pos(states[0]);
    ds4_status st = ds4_model_eval_batch(e->model, states, tokens, n, e->num, logits, err);
    if (st && ds4_state_pos(states[0]) != pos0) {
        for (int64_t i = 0; i < n; i++) forget(ss[i]); /* the evaluation failed: the states are unusable */
    } else if (!st) {
        for (int64_t i = 0; i < n; i++) {
            ds4_session *s = ss[i];
            memcpy(s->logits, logits + i * V, (size_t)V * sizeof *logits);
            s->logits_stale = false;
            s->tokens[s->n_tokens++] = tokens[i];
        }
    }
    free(states);
    free(logits);
    return st;
}

/* ------------------------------------------------------------ checkpoints */

static void put_le(uint8_t *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static uint32_t crc32_of(const uint8_t *p, uint64_t n) {
    uLong c = crc32(0L, Z_NULL, 0);
    while (n) {
        uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
        c = crc32(c, p, k);
        p += k;
        n -= k;
    }
    return (uint32_t)c;
}

ds4_status ds4_session_save(const ds4_session *s, const char *path, ds4_error *err) {
    if (s->n_tokens == 0) return ds4_error_set(err, DS4_ERR_INVALID, "the session is empty: nothing to save");
    /* a checkpoint holds the next-token logits: bring them back after a greedy decode */
    ds4_status ls = ensure_logits((ds4_session *)s, err);
    if (ls) return ls;
    int64_t size = ds4_state_payload_size(s->state, s->n_tokens);
    uint8_t *buf = malloc((size_t)(CKPT_HEADER + size));
    if (!buf) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for a %lld-byte checkpoint", (long long)size);
    ds4_status st = ds4_state_save_payload(s->state, s->tokens, s->n_tokens, s->logits, buf + CKPT_HEADER, size, err);
    if (st) {
        free(buf);
        return st;
    }
    memcpy(buf, CKPT_MAGIC, 8);
    put_le(buf + 8, CKPT_VERSION, 4);
    put_le(buf + 12, 0, 4);
    put_le(buf + 16, ds4_model_fingerprint(s->engine->model), 8);
    put_le(buf + 24, (uint64_t)size, 8);
    put_le(buf + 32, crc32_of(buf + CKPT_HEADER, (uint64_t)size), 4);
    put_le(buf + 36, crc32_of(buf, 36), 4);

    size_t plen = strlen(path);
    char *tmp = malloc(plen + 5);
    if (!tmp) {
        free(buf);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    }
    snprintf(tmp, plen + 5, "%s.tmp", path);
    FILE *fp = fopen(tmp, "wb");
    const char *what = NULL;
    if (!fp) what = "open";
    else if (fwrite(buf, 1, (size_t)(CKPT_HEADER + size), fp) != (size_t)(CKPT_HEADER + size)) what = "write";
    else if (fflush(fp) != 0) what = "write";
    else if (fsync(fileno(fp)) != 0) what = "fsync";
    int e = errno;
    if (fp && fclose(fp) != 0 && !what) {
        what = "close";
        e = errno;
    }
    if (!what && rename(tmp, path) != 0) {
        what = "rename";
        e = errno;
    }
    if (what) {
        unlink(tmp);
        st = ds4_error_set(err, DS4_ERR_IO, "%s: checkpoint %s failed: %s", path, what, strerror(e));
    }
    free(tmp);
    free(buf);
    return st;
}

ds4_status ds4_session_load(ds4_session *s, const char *path, ds4_error *err) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return ds4_error_set(err, DS4_ERR_IO, "%s: %s", path, strerror(errno));
    struct stat sb;
    uint8_t hdr[CKPT_HEADER];
    ds4_status st = DS4_OK;
    if (fstat(fileno(fp), &sb) != 0) st = ds4_error_set(err, DS4_ERR_IO, "%s: %s", path, strerror(errno));
    else if (sb.st_size < CKPT_HEADER || fread(hdr, 1, CKPT_HEADER, fp) != CKPT_HEADER)
        st = ds4_error_set(err, DS4_ERR_FORMAT, "%s: too short to be a checkpoint (%lld bytes)", path,
                           (long long)sb.st_size);
    else if (memcmp(hdr, CKPT_MAGIC, 8) != 0)
        st = ds4_error_set(err, DS4_ERR_FORMAT, "%s: not a DS4Server checkpoint", path);
    else if (get_le(hdr + 36, 4) != crc32_of(hdr, 36))
        st = ds4_error_set(err, DS4_ERR_FORMAT, "%s: checkpoint header is corrupt (checksum mismatch)", path);
    else if (get_le(hdr + 8, 4) != CKPT_VERSION)
        st = ds4_error_set(err, DS4_ERR_FORMAT, "%s: checkpoint version %u is not supported (only %u)", path,
                           (unsigned)get_le(hdr + 8, 4), CKPT_VERSION);
    else if (get_le(hdr + 16, 8) != ds4_model_fingerprint(s->engine->model))
        st = ds4_error_set(err, DS4_ERR_FORMAT, "%s: checkpoint was saved with another model file "
                           "(fingerprint %016llx, this model %016llx)", path,
                           (unsigned long long)get_le(hdr + 16, 8),
                           (unsigned long long)ds4_model_fingerprint(s->engine->model));
    else if (get_le(hdr + 24, 8) != (uint64_t)sb.st_size - CKPT_HEADER)
        st = ds4_error_set(err, DS4_ERR_FORMAT, "%s: checkpoint is %lld bytes, its header says %llu (truncated or "
                           "extended)", path, (long long)sb.st_size,
                           (unsigned long long)(get_le(hdr + 24, 8) + CKPT_HEADER));
    uint64_t size = st ? 0 : get_le(hdr + 24, 8);
    uint8_t *payload = st ? NULL : malloc(size ? (size_t)size : 1);
    if (!st && !payload) st = ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for a %llu-byte checkpoint",
                                            (unsigned long long)size);
    if (!st && fread(payload, 1, (size_t)size, fp) != size)
        st = ds4_error_set(err, DS4_ERR_IO, "%s: read failed", path);
    fclose(fp);
    if (!st && get_le(hdr + 32, 4) != crc32_of(payload, size))
        st = ds4_error_set(err, DS4_ERR_FORMAT, "%s: checkpoint data is corrupt (checksum mismatch)", path);
    if (st) {
        free(payload);
        return st; /* the session is untouched */
    }
    st = restore_payload(s, payload, (int64_t)size, err);
    if (st) {
        ds4_error_prefix(err, "%s", path);
        free(payload);
        /* Fall back to the last prompt snapshot rather than an empty session. */
        if (s->snap_tokens > 0) {
            ds4_error ignored;
            restore_payload(s, s->snap, s->snap_size, &ignored);
        }
        return st;
    }
    /* The restored state is the new prompt snapshot. */
    free(s->snap);
    s->snap = payload;
    s->snap_size = (int64_t)size;
    s->snap_tokens = s->n_tokens;
    return DS4_OK;
}

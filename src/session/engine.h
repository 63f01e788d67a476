/*
 * engine.h - library-internal access to an engine's parts (the parsed model
 * file, for the tokenizer). Tools and the server use include/ds4.h for
 * everything else.
 */
#ifndef DS4_SESSION_ENGINE_H
#define DS4_SESSION_ENGINE_H

#include <stdbool.h>

#include "core/gguf.h"
#include "ds4.h"

const gguf_file *ds4_engine_gguf(const ds4_engine *engine);

/* Read the whole mapped model file once (page by page, with read-ahead
 * advice) so the first tokens do not stall on page faults; `fn` is called
 * with the bytes done and the total after every 256 MiB (and at the end).
 * Returning false stops early. */
void ds4_engine_prefetch(const ds4_engine *engine, bool (*fn)(void *ctx, int64_t done, int64_t total), void *ctx);

/* Called between prefill chunks with the tokens done so far and the total;
 * returning false stops the prefill there (the history keeps what was
 * evaluated). */
typedef bool (*ds4_progress_fn)(void *ctx, int64_t done, int64_t total);
void ds4_session_set_progress(ds4_session *session, ds4_progress_fn fn, void *ctx);

#endif

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

/* Called between prefill chunks with the tokens done so far and the total;
 * returning false stops the prefill there (the history keeps what was
 * evaluated). */
typedef bool (*ds4_progress_fn)(void *ctx, int64_t done, int64_t total);
void ds4_session_set_progress(ds4_session *session, ds4_progress_fn fn, void *ctx);

#endif

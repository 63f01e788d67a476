/*
 * ds4_model.h - DeepSeek V4 Flash: weights, state and the forward pass.
 *
 * The model binds its tensors from a validated GGUF file, checks every shape
 * and type, and computes only through the backend's operation table. The
 * state (raw sliding-window KV, compressed KV, indexer keys, compressor
 * partial state) lives in backend memory and is advanced by ds4_model_eval,
 * which processes a batch of tokens layer-major (prefill) or a single token
 * (decode) with the same semantics: prefill of n tokens gives the logits that
 * n decode steps would.
 */
#ifndef DS4_MODELS_DEEPSEEK4_MODEL_H
#define DS4_MODELS_DEEPSEEK4_MODEL_H

#include "backends/backend.h"
#include "core/gguf.h"
#include "models/deepseek4/ds4_config.h"

typedef struct ds4_model ds4_model;
typedef struct ds4_state ds4_state;

/* Bind a model from an open GGUF (kept open by the caller while the model
 * lives) onto a backend. Errors name the tensor, the expected and the found
 * shape or type. */
ds4_status ds4_model_load(gguf_file *file, ds4_backend *be, ds4_model **out, ds4_error *err);
void ds4_model_free(ds4_model *m);
const ds4_config *ds4_model_config(const ds4_model *m);

/* A fresh state for up to `n_ctx` positions. */
ds4_status ds4_state_create(ds4_model *m, int64_t n_ctx, ds4_state **out, ds4_error *err);
void ds4_state_free(ds4_state *s);
int64_t ds4_state_pos(const ds4_state *s); /* tokens consumed so far */

/* Evaluate n tokens at the state's position and advance it. When `logits`
 * is non-NULL it receives float32 logits in host memory: every position
 * ([n, vocab]) when all_logits, else only the last ([vocab]). */
ds4_status ds4_model_eval(ds4_model *m, ds4_state *s, const int32_t *tokens, int64_t n, ds4_numerics num,
                          float *logits, bool all_logits, ds4_error *err);

#endif

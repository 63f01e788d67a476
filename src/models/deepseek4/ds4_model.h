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
/* Fingerprint of the model file: a 64-bit FNV-1a hash of its GGUF header,
 * metadata and tensor directory (everything before the tensor data) and its
 * size. Checkpoints carry it so that one model's state never loads into
 * another's. */
uint64_t ds4_model_fingerprint(const ds4_model *m);
ds4_backend *ds4_model_backend(const ds4_model *m);

/* A fresh state for up to `n_ctx` positions. */
ds4_status ds4_state_create(ds4_model *m, int64_t n_ctx, ds4_state **out, ds4_error *err);
void ds4_state_free(ds4_state *s);
int64_t ds4_state_pos(const ds4_state *s); /* tokens consumed so far */

/* Evaluate n tokens at the state's position and advance it. When `logits`
 * is non-NULL it receives float32 logits in host memory: every position
 * ([n, vocab]) when all_logits, else only the last ([vocab]). */
ds4_status ds4_model_eval(ds4_model *m, ds4_state *s, const int32_t *tokens, int64_t n, ds4_numerics num,
                          float *logits, bool all_logits, ds4_error *err);

/* As ds4_model_eval without logits: next[0] receives the greedy next token
 * after the last of the n tokens, the first index of the maximum logit
 * (NaN and -inf never win: ds4_sample_argmax's choice), found by the
 * backend, so only the token id comes back from it. */
ds4_status ds4_model_eval_greedy(ds4_model *m, ds4_state *s, const int32_t *tokens, int64_t n, ds4_numerics num,
                                 int32_t *next, ds4_error *err);

/* The logits [vocab] (host) of the last position of st's last evaluation,
 * when that was a ds4_model_eval_greedy (the backend keeps them in the
 * state's scratch until its next evaluation); DS4_ERR_INVALID otherwise. */
ds4_status ds4_model_fetch_logits(ds4_model *m, ds4_state *st, float *logits, ds4_error *err);

/* Decode one token for each of n_seq states at once: row s is token
 * tokens[s] appended to states[s] (each at its own position), and logits
 * [n_seq, vocab] (host, may be NULL) get row s's next-token logits. The
 * weights are read once for all rows; each row computes exactly what a
 * single-token ds4_model_eval of its state computes (on the CPU backend bit
 * for bit; a device backend may pick other kernels for several rows, which
 * sum in another order). The states must be distinct, of this model, and
 * each have room for one more token; every state advances by one. On an
 * evaluation error every state in the batch is unusable. */
ds4_status ds4_model_eval_batch(ds4_model *m, ds4_state *const *states, const int32_t *tokens, int64_t n_seq,
                                ds4_numerics num, float *logits, ds4_error *err);

/* ds4_model_eval_batch with the greedy next token of each row in next
 * [n_seq] instead of the logits (as ds4_model_eval_greedy). */
ds4_status ds4_model_eval_batch_greedy(ds4_model *m, ds4_state *const *states, const int32_t *tokens, int64_t n_seq,
                                       ds4_numerics num, int32_t *next, ds4_error *err);

/* ---- inspection (the parity harness) ---------------------------------- */

/* Called after every op of the forward pass with the op's output: `name`
 * (e.g. "attn_norm", "q", "kv", "attn", "moe", "X"), the layer (-1 for the
 * embedding and the head), the token index within the batch (-1 when the
 * buffer holds the whole batch), the buffer and its length in floats. The
 * buffer is in backend memory unless `host` is true. The callback may
 * overwrite the buffer (through the backend's upload op, or directly when
 * `host`): the forward pass continues from what it holds then, which lets the
 * harness feed one backend's values to the next op of another. Integer
 * results (expert ids "router_experts", top-k rows "idx_top_k") live in
 * backend memory as int32; the hook gets a host copy converted to floats
 * (host true), and what it leaves there is rounded and written back. */
typedef void (*ds4_model_tap_fn)(void *ctx, const char *name, int layer, int64_t token, float *buf, int64_t n,
                                 bool host);
void ds4_model_set_tap(ds4_model *m, ds4_model_tap_fn fn, void *ctx);
/* Evaluate only the first n layers (0 = all); the head is then skipped and
 * no logits are produced. For checking real-size layers of a large file. */
void ds4_model_set_layer_limit(ds4_model *m, int n_layers);
/* Run layers first .. first + n - 1 of every evaluation inside the backend's
 * profiler range (ds4_backend_profiler_range), so an external profiler with
 * its capture off times only them; n 0 turns it off. Layers past the model's
 * are ignored. */
void ds4_model_set_profile_layers(ds4_model *m, int first, int n);
/* A prefill chunk's compressors in a few batched calls (on, the default)
 * or token by token as a batch of several states goes (off): the same
 * results bit for bit; the switch is there to show that. */
void ds4_model_set_compressor_chunks(ds4_model *m, bool on);
/* The indexer scores, top-k selections and attention of a chunk's rows that
 * select (a prompt past 4 x top_k tokens) in batches of rows: rows < 0 as
 * many as the scratch holds (the default), 0 row by row, else at most that
 * many per batch. The same results bit for bit. */
void ds4_model_set_indexer_batches(ds4_model *m, int rows);
/* A batch of distinct states (ds4_model_eval_batch of up to 64) moves its
 * rows into their states, adds their position biases and attends the rows
 * without a selection in one call each (on, the default), or row by row
 * (off): the same results; the switch is there to show that and to
 * measure it. */
void ds4_model_set_state_batches(ds4_model *m, bool on);
/* Tokens of an evaluation that go through the layers together (a chunk:
 * each layer's products see this many rows at once; the scratch of a state
 * that evaluates that many holds them, about 0.56 MB per row for the
 * full-size model). n < 1 restores the default, DS4_EVAL_CHUNK ($DS4_EVAL_CHUNK
 * at model open sets another, 1 .. DS4_EVAL_CHUNK_MAX; anything else fails
 * the open). The results do not depend on it on the CPU (bit for bit); on
 * a GPU, rows of chunks too small for its batched kernels are summed in
 * another order. */
#define DS4_EVAL_CHUNK 2048
#define DS4_EVAL_CHUNK_MAX 65536 /* the most that $DS4_EVAL_CHUNK may set */
void ds4_model_set_eval_chunk(ds4_model *m, int64_t n);
int64_t ds4_model_eval_chunk(const ds4_model *m);

/* Progress of ds4_model_load_progress: bytes of weights bound so far. */
typedef void (*ds4_model_load_fn)(void *ctx, int64_t done, int64_t total);
ds4_status ds4_model_load_progress(gguf_file *file, ds4_backend *be, ds4_model_load_fn fn, void *ctx,
                                   ds4_model **out, ds4_error *err);
/* As ds4_model_load_progress, but the weights' bytes are not read from the
 * file: the backend makes them itself (bind_synthetic) from `seed`, tensor
 * by tensor, with the file's names, types and shapes. For benchmarks of
 * models of the real size without a file of their weights: the file may be
 * one written with no weight data (ds4_synth_write with `zero`). The same
 * seed gives the same weights on every backend. */
ds4_status ds4_model_load_synthetic(gguf_file *file, ds4_backend *be, uint64_t seed, ds4_model_load_fn fn,
                                    void *ctx, ds4_model **out, ds4_error *err);

/* ---- state as bytes (DS4's session payload, spec 4.3) ------------------ */

/* Size of the payload of a state holding n_tokens tokens. */
int64_t ds4_state_payload_size(const ds4_state *s, int64_t n_tokens);
/* Serialise: tokens[n_tokens] (n_tokens must equal the state's position) and
 * the next-token logits [vocab] (host) go into the payload with the state. */
ds4_status ds4_state_save_payload(const ds4_state *s, const int32_t *tokens, int64_t n_tokens, const float *logits,
                                  uint8_t *out, int64_t cap, ds4_error *err);
/* Restore from a payload after every check of spec 4.3; on success the
 * tokens (malloc'd) and logits come back. On failure the state is reset to
 * empty, never left half-restored. */
ds4_status ds4_state_load_payload(ds4_state *s, const uint8_t *data, int64_t size, int32_t **tokens,
                                  int64_t *n_tokens, float *logits, ds4_error *err);
/* Forget everything: position 0, empty caches. */
void ds4_state_reset(ds4_state *s);

#endif

/*
 * ds4_model_internal.h - the model's and the state's private structures,
 * shared by the files of the deepseek4 model (forward pass, state
 * serialisation). Nothing outside src/models/deepseek4 includes this.
 */
#ifndef DS4_MODELS_DEEPSEEK4_MODEL_INTERNAL_H
#define DS4_MODELS_DEEPSEEK4_MODEL_INTERNAL_H

#include "models/deepseek4/ds4_model.h"

typedef struct layer_weights {
    ds4_weight hc_attn_fn, hc_attn_scale, hc_attn_base, attn_norm;
    ds4_weight q_a, q_a_norm, q_b, kv, kv_norm, sinks, out_a, out_b;
    ds4_weight hc_ffn_fn, hc_ffn_scale, hc_ffn_base, ffn_norm, gate_inp, probs_bias;
    ds4_weight gate_exps, up_exps, down_exps, gate_sh, up_sh, down_sh, tid2eid;
    ds4_weight comp_ape, comp_kv, comp_gate, comp_norm;
    ds4_weight idx_q_b, idx_proj, idx_ape, idx_kv, idx_gate, idx_norm;
    bool has_bias;
} layer_weights;

/* An evaluation scratch (ds4_model.c) and what it has room for: `rows`
 * tokens of states of up to `ctx` positions (its indexer scores), logits for
 * all of them when all_logits. */
typedef struct scratch_slot {
    struct eval_scratch *s;
    int64_t rows, ctx;
    bool all_logits;
} scratch_slot;

struct ds4_model {
    ds4_config cfg;
    gguf_file *file;
    ds4_backend *be;
    ds4_weight token_embd, out_hc_base, out_hc_fn, out_hc_scale, out_norm, output;
    layer_weights *layers;
    ds4_rope rope_dense, rope_comp;
    ds4_hc hc;
    ds4_weight **bound; /* every bound weight, for release */
    char **names;       /* their names (ds4_weight.name points here) */
    int64_t n_bound;
    ds4_model_tap_fn tap; /* inspection hook (NULL: none) */
    void *tap_ctx;
    int layer_limit; /* 0: all layers */
    int prof_first, prof_n; /* layers inside the backend's profiler range (prof_n 0: none) */
    bool comp_per_token;    /* compressors token by token even for a chunk (ds4_model_set_compressor_chunks) */
    int idx_batch; /* selecting rows per batch (ds4_model_set_indexer_batches): 0 the scratch's, -1 row by row, n */
    int64_t eval_chunk; /* tokens per layer-major pass (ds4_model_set_eval_chunk) */
    bool no_state_batches; /* batches of states row by row (ds4_model_set_state_batches) */
    /* the attention's compressor and indexer products on a side branch of a
     * recorded step, beside q's chain (on; $DS4_ATTN_BRANCH=0: off) */
    bool attn_branch;
    /* one decoded token's indexer queries on a second branch beside the
     * first and q's chain (on; $DS4_IQ_BRANCH=0: off) */
    bool iq_branch;
    /* the scratch of evaluations of several rows (prefill chunks, batched
     * decode): one for the model, as its evaluations run one at a time,
     * instead of one of a chunk's size in every state that prefilled */
    scratch_slot chunk_scratch;
};

/* Compressor state of one layer: kv and score rows plus the emitted rows. */
typedef struct compressor_state {
    int ratio, coff;
    int64_t dim;       /* D of an emitted row */
    float *state_kv;   /* [coff*ratio, coff*dim] */
    float *state_sc;
    float *rows;       /* [cap, dim] emitted rows */
    int64_t n_rows, cap;
} compressor_state;

typedef struct layer_state {
    /* [2W, D]: the live raw KV rows in position order (oldest first) are rows
     * win_start .. win_start + n_window - 1; new rows go after them, and when
     * they reach the end the live rows move to the front (one copy every W
     * tokens, not a shift of the whole window every token) */
    float *window;
    int64_t n_window, win_start;
    compressor_state attn, index;
} layer_state;

/* The first live row of a layer's window. */
static inline float *ds4_window_rows(const layer_state *L, int64_t dim) { return L->window + L->win_start * dim; }

struct ds4_state {
    ds4_model *model;
    int64_t n_ctx, pos;
    layer_state *layers;
    /* This state's own evaluation scratch, kept between calls (decode steps
     * would otherwise allocate and free it every token): one row, for its
     * decoded tokens and the logits a greedy evaluation keeps. Evaluations of
     * several rows use the model's (ds4_model.chunk_scratch). */
    scratch_slot scratch;
    /* the scratch holds the logits of this state's last evaluation, made by
     * ds4_model_eval_greedy and not brought back (ds4_model_fetch_logits) */
    bool greedy_logits;
};

#endif

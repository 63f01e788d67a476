/*
 * ds4_config.h - DeepSeek V4 Flash: hyper-parameters and the tensor layout.
 *
 * One description of the model's shape serves every tool: the loader reads
 * and validates it from GGUF metadata, `synth` writes it for a preset scale,
 * `convert` writes it from a Hugging Face config. The tensor layout
 * (ds4_layout_*) enumerates every tensor of a file in the DS4 GGUF naming,
 * with its shape and, per quantisation scheme, its type.
 *
 * Shapes are ggml order (ne[0] contiguous). Notation follows the spec:
 * H hidden, V vocab, nh heads, D head dim, R rope dims, qr q rank, G output
 * groups, ro output rank per group, E experts, k used, I expert width,
 * hc streams, ih/id indexer heads/dim, m compression ratio.
 */
#ifndef DS4_MODELS_DEEPSEEK4_CONFIG_H
#define DS4_MODELS_DEEPSEEK4_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "core/gguf.h"
#include "ds4.h"

#define DS4_MAX_LAYERS 128

typedef struct ds4_config {
    int n_layer;          /* block_count */
    int64_t n_embd;       /* H */
    int64_t n_vocab;      /* V */
    int n_head;           /* nh */
    int n_head_kv;        /* must be 1 */
    int64_t head_dim;     /* D (key_length == value_length) */
    int n_rot;            /* R */
    int64_t q_lora;       /* qr */
    int64_t o_lora;       /* ro, per group */
    int o_groups;         /* G */
    int n_expert;         /* E */
    int n_expert_used;    /* k */
    int64_t n_ff;         /* I */
    int n_expert_shared;  /* must be 1 */
    int n_hash_layers;    /* informational: hash layers are those with tid2eid */
    int sliding_window;   /* W, raw rows including the current token */
    int idx_n_head;       /* ih */
    int64_t idx_head_dim; /* id */
    int idx_top_k;
    int n_hc;
    int hc_iters;
    float hc_eps;
    float rms_eps;
    float rope_base;          /* dense layers */
    float compress_rope_base; /* compressed layers */
    float rope_factor;        /* YaRN factor of compressed layers (1 = none) */
    float yarn_beta_fast, yarn_beta_slow;
    uint64_t rope_orig_ctx;
    float expert_weights_scale;
    bool expert_weights_norm;
    uint64_t context_length; /* informational */
    int compress_ratio[DS4_MAX_LAYERS]; /* 0, 4 or 128 */
    bool hash_layer[DS4_MAX_LAYERS];    /* routed by token id (tid2eid) */
    float swiglu_limit[DS4_MAX_LAYERS];
} ds4_config;

typedef enum ds4_scale { DS4_SCALE_TINY, DS4_SCALE_SMALL, DS4_SCALE_FULL } ds4_scale;

/* Quantisation schemes of a whole file. Q2 and Q4 are the published DS4
 * layouts (spec 2.3); F32 stores every float tensor as F32; Q8_0 is the Q2
 * layout with Q8_0 routed experts. */
typedef enum ds4_quant_scheme { DS4_QUANT_F32, DS4_QUANT_Q8_0, DS4_QUANT_Q2, DS4_QUANT_Q4 } ds4_quant_scheme;

/* Fill a preset. Full = the real DeepSeek V4 Flash shape (spec section 1). */
void ds4_config_preset(ds4_scale scale, ds4_config *cfg);

/* Structural checks that every shape satisfies (kv heads 1, ratios 0/4/128,
 * divisibility of heads by groups, rope dims even and <= head dims, ...). */
ds4_status ds4_config_validate(const ds4_config *cfg, ds4_error *err);

/* Read deepseek4.* metadata (spec 2.2 key names and types) and validate.
 * hash_layer[] is taken from the presence of blk.N.ffn_gate_tid2eid.weight. */
ds4_status ds4_config_from_gguf(const gguf_file *f, ds4_config *cfg, ds4_error *err);

/* Write the deepseek4.* metadata keys (and general.architecture). */
ds4_status ds4_config_write_gguf(const ds4_config *cfg, gguf_writer *w);

/* YaRN ramp bounds (pair indices) for the compressed layers (spec 3.4.4). */
void ds4_config_yarn_bounds(const ds4_config *cfg, float *lo, float *hi);

/* ---- tensor layout ---------------------------------------------------- */

/* What a tensor is, so generators know how to fill it. */
typedef enum ds4_tensor_role {
    DS4_ROLE_MATRIX,    /* a projection: random normal / sqrt(fan-in) */
    DS4_ROLE_EMBEDDING, /* token embedding */
    DS4_ROLE_NORM,      /* norm weight: around 1 */
    DS4_ROLE_HC_SCALE,  /* HC scale: small positive */
    DS4_ROLE_HC_BASE,   /* HC base: small */
    DS4_ROLE_SINK,      /* attention sink logits */
    DS4_ROLE_BIAS,      /* router bias */
    DS4_ROLE_APE,       /* compressor position bias */
    DS4_ROLE_EXPERTS,   /* stacked routed experts */
    DS4_ROLE_TID2EID,   /* hash routing table (I32) */
} ds4_tensor_role;

typedef struct ds4_tensor_spec {
    char name[96];
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne[4];
    ds4_tensor_role role;
    int layer;             /* -1 for global tensors */
    int64_t fan_in;        /* for MATRIX/EXPERTS: the input width */
} ds4_tensor_spec;

/* Enumerate every tensor in file order. Returns the count; fills at most
 * `cap` entries of `out` (call with cap 0 to size). -1 if the scheme cannot
 * store this shape (e.g. K-quant experts need widths that are multiples of
 * 256); then `err` says why. */
int64_t ds4_layout_tensors(const ds4_config *cfg, ds4_quant_scheme scheme, ds4_tensor_spec *out, int64_t cap,
                           ds4_error *err);

const char *ds4_quant_scheme_name(ds4_quant_scheme s);
int ds4_quant_scheme_parse(const char *s); /* -1 if unknown */

#endif

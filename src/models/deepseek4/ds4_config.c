/*
 * ds4_config.c - DeepSeek V4 Flash hyper-parameters: presets, validation,
 * GGUF metadata (read and write) and the tensor layout of a file.
 *
 * The engine reads every shape from metadata rather than hard-coding DS4's
 * values, so the real model and any smaller model with the same structure
 * (the tiny oracle configs) run through the same code.
 */
#include "models/deepseek4/ds4_config.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "core/error.h"
#include "core/quant.h"

#define KEY(k) "deepseek4." k

/* ------------------------------------------------------------ presets */

void ds4_config_preset(ds4_scale scale, ds4_config *c) {
    memset(c, 0, sizeof *c);
    /* Fixed structure of the family (spec section 1). */
    c->n_head_kv = 1;
    c->n_expert_shared = 1;
    c->n_hc = 4;
    c->hc_iters = 20;
    c->hc_eps = 1e-6f;
    c->rms_eps = 1e-6f;
    c->rope_base = 10000.0f;
    c->compress_rope_base = 160000.0f;
    c->rope_factor = 16.0f;
    c->yarn_beta_fast = 32.0f;
    c->yarn_beta_slow = 1.0f;
    c->rope_orig_ctx = 65536;
    c->expert_weights_scale = 1.5f;
    c->expert_weights_norm = true;
    c->context_length = 1048576;
    if (scale == DS4_SCALE_FULL) {
        c->n_layer = 43;
        c->n_embd = 4096;
        c->n_vocab = 129280;
        c->n_head = 64;
        c->head_dim = 512;
        c->n_rot = 64;
        c->q_lora = 1024;
        c->o_lora = 1024;
        c->o_groups = 8;
        c->n_expert = 256;
        c->n_expert_used = 6;
        c->n_ff = 2048;
        c->n_hash_layers = 3;
        c->sliding_window = 128;
        c->idx_n_head = 64;
        c->idx_head_dim = 128;
        c->idx_top_k = 512;
    } else if (scale == DS4_SCALE_SMALL) {
        c->n_layer = 8;
        c->n_embd = 512;
        c->n_vocab = 129280;
        c->n_head = 8;
        c->head_dim = 256;
        c->n_rot = 64;
        c->q_lora = 256;
        c->o_lora = 128;
        c->o_groups = 4;
        c->n_expert = 32;
        c->n_expert_used = 4;
        c->n_ff = 512;
        c->n_hash_layers = 3;
        c->sliding_window = 128;
        c->idx_n_head = 16;
        c->idx_head_dim = 128;
        c->idx_top_k = 64;
        c->context_length = 65536;
    } else { /* tiny: every structural feature, widths aligned to DS4's blocks */
        c->n_layer = 5;
        c->n_embd = 256;
        c->n_vocab = 1024;
        c->n_head = 4;
        c->head_dim = 128;
        c->n_rot = 64;
        c->q_lora = 128;
        c->o_lora = 64;
        c->o_groups = 2;
        c->n_expert = 8;
        c->n_expert_used = 2;
        c->n_ff = 256;
        c->n_hash_layers = 3;
        c->sliding_window = 16;
        c->idx_n_head = 16;
        c->idx_head_dim = 128;
        c->idx_top_k = 8;
        c->context_length = 4096;
    }
    for (int l = 0; l < c->n_layer; l++) {
        /* 0, 0, then 4 on even and 128 on odd layers (the Flash schedule). */
        c->compress_ratio[l] = l < 2 ? 0 : (l % 2 == 0 ? 4 : 128);
        c->hash_layer[l] = l < c->n_hash_layers;
        c->swiglu_limit[l] = 10.0f;
    }
}

/* ------------------------------------------------------------ validation */

ds4_status ds4_config_validate(const ds4_config *c, ds4_error *err) {
#define REQUIRE(cond, ...) \
    do { if (!(cond)) return ds4_error_set(err, DS4_ERR_FORMAT, __VA_ARGS__); } while (0)
    REQUIRE(c->n_layer >= 1 && c->n_layer <= DS4_MAX_LAYERS, "block_count %d outside 1..%d", c->n_layer,
            DS4_MAX_LAYERS);
    REQUIRE(c->n_embd > 0 && c->n_vocab > 0 && c->n_head > 0 && c->head_dim > 0, "zero model dimension");
    REQUIRE(c->n_head_kv == 1, "attention.head_count_kv is %d; this model family has exactly 1 KV head",
            c->n_head_kv);
    REQUIRE(c->n_rot > 0 && c->n_rot % 2 == 0 && c->n_rot <= c->head_dim, "rope.dimension_count %d must be even "
            "and at most key_length %lld", c->n_rot, (long long)c->head_dim);
    REQUIRE(c->n_rot <= c->idx_head_dim || c->idx_n_head == 0, "rope.dimension_count %d exceeds the indexer key "
            "length %lld", c->n_rot, (long long)c->idx_head_dim);
    REQUIRE(c->o_groups > 0 && c->n_head % c->o_groups == 0, "head_count %d is not a multiple of "
            "output_group_count %d", c->n_head, c->o_groups);
    REQUIRE(c->q_lora > 0 && c->o_lora > 0, "zero low rank");
    REQUIRE(c->n_expert > 0 && c->n_expert_used > 0 && c->n_expert_used <= c->n_expert,
            "expert_used_count %d must be in 1..expert_count (%d)", c->n_expert_used, c->n_expert);
    REQUIRE(c->n_expert_used <= 16, "expert_used_count %d is larger than this engine supports (16)",
            c->n_expert_used);
    REQUIRE(c->n_ff > 0, "expert_feed_forward_length is 0");
    REQUIRE(c->n_expert_shared == 1, "expert_shared_count is %d; this model family has exactly 1",
            c->n_expert_shared);
    REQUIRE(c->sliding_window >= 1, "attention.sliding_window is %d", c->sliding_window);
    REQUIRE(c->n_hc >= 1 && c->n_hc <= 8, "hyper_connection.count %d outside 1..8", c->n_hc);
    REQUIRE(c->hc_iters >= 1 && c->hc_iters <= 1000, "sinkhorn_iterations %d outside 1..1000", c->hc_iters);
    bool any_ratio4 = false;
    for (int l = 0; l < c->n_layer; l++) {
        int r = c->compress_ratio[l];
        REQUIRE(r == 0 || r == 4 || r == 128, "compress_ratios[%d] = %d; supported ratios are 0, 4 and 128", l, r);
        any_ratio4 |= r == 4;
        REQUIRE(c->swiglu_limit[l] >= 0 && isfinite(c->swiglu_limit[l]), "swiglu_clamp_exp[%d] = %g", l,
                (double)c->swiglu_limit[l]);
    }
    if (any_ratio4) {
        REQUIRE(c->idx_n_head > 0 && c->idx_head_dim > 0 && c->idx_top_k > 0, "ratio-4 layers need an indexer "
                "(attention.indexer.* are zero)");
        REQUIRE((c->idx_head_dim & (c->idx_head_dim - 1)) == 0, "attention.indexer.key_length %lld is not a power "
                "of two", (long long)c->idx_head_dim);
    }
    REQUIRE(c->rope_base > 0 && c->compress_rope_base > 0 && c->rope_factor >= 1, "bad rope parameters");
#undef REQUIRE
    return DS4_OK;
}

void ds4_config_yarn_bounds(const ds4_config *c, float *lo, float *hi) {
    /* corr(b) = R * ln(L0 / (2 pi b)) / (2 ln base), over pair indices. */
    double R = c->n_rot, base = c->compress_rope_base, L0 = (double)c->rope_orig_ctx;
    double cf = R * log(L0 / (2.0 * M_PI * c->yarn_beta_fast)) / (2.0 * log(base));
    double cs = R * log(L0 / (2.0 * M_PI * c->yarn_beta_slow)) / (2.0 * log(base));
    double l = floor(cf), h = ceil(cs);
    *lo = (float)(l < 0 ? 0 : l);
    *hi = (float)(h > R - 1 ? R - 1 : h);
}

/* ------------------------------------------------------------ metadata */

static ds4_status get_int(const gguf_file *f, const char *key, int64_t max, int64_t *out, ds4_error *err) {
    uint32_t v;
    ds4_status st = gguf_get_u32(f, key, &v, err);
    if (st) return st;
    if ((int64_t)v > max) return ds4_error_set(err, DS4_ERR_FORMAT, "metadata %s = %u is larger than %lld", key, v,
                                               (long long)max);
    *out = v;
    return DS4_OK;
}

static ds4_status get_float(const gguf_file *f, const char *key, float *out, ds4_error *err) {
    ds4_status st = gguf_get_f32(f, key, out, err);
    if (!st && !isfinite(*out)) return ds4_error_set(err, DS4_ERR_FORMAT, "metadata %s is not finite", key);
    return st;
}

/* Numeric array (any integer or float element type) of at least n entries. */
static ds4_status get_array(const gguf_file *f, const char *key, int n, double *out, ds4_error *err) {
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) return ds4_error_set(err, DS4_ERR_NOT_FOUND, "metadata key '%s' is missing", key);
    if (kv->value.type != GGUF_TYPE_ARRAY || gguf_value_type_size(kv->value.elem_type) == 0 ||
        kv->value.elem_type == GGUF_TYPE_BOOL)
        return ds4_error_set(err, DS4_ERR_FORMAT, "metadata key '%s' must be a numeric array", key);
    if (kv->value.count < (uint64_t)n)
        return ds4_error_set(err, DS4_ERR_FORMAT, "metadata key '%s' has %llu entries, the model has %d layers", key,
                             (unsigned long long)kv->value.count, n);
    gguf_array_iter it;
    gguf_value e;
    gguf_array_iter_init(&it, &kv->value);
    for (int i = 0; i < n && gguf_array_iter_next(&it, &e); i++) gguf_value_as_double(&e, &out[i]);
    return DS4_OK;
}

ds4_status ds4_config_from_gguf(const gguf_file *f, ds4_config *c, ds4_error *err) {
    memset(c, 0, sizeof *c);
    gguf_str arch;
    if (gguf_get_str(f, "general.architecture", &arch, err) == DS4_OK && !gguf_str_eq(arch, "deepseek4"))
        return ds4_error_set(err, DS4_ERR_FORMAT, "general.architecture is '%.*s', expected 'deepseek4'",
                             (int)(arch.len < 64 ? arch.len : 64), arch.ptr);
    struct { const char *key; int64_t max; int64_t v; } ints[] = {
        { KEY("block_count"), DS4_MAX_LAYERS, 0 },
        { KEY("embedding_length"), 1 << 20, 0 },
        { KEY("vocab_size"), 1 << 24, 0 },
        { KEY("attention.head_count"), 4096, 0 },
        { KEY("attention.head_count_kv"), 4096, 0 },
        { KEY("attention.key_length"), 1 << 16, 0 },
        { KEY("attention.value_length"), 1 << 16, 0 },
        { KEY("rope.dimension_count"), 1 << 16, 0 },
        { KEY("attention.q_lora_rank"), 1 << 20, 0 },
        { KEY("attention.output_lora_rank"), 1 << 20, 0 },
        { KEY("attention.output_group_count"), 4096, 0 },
        { KEY("expert_count"), 1 << 16, 0 },
        { KEY("expert_used_count"), 1 << 16, 0 },
        { KEY("expert_feed_forward_length"), 1 << 20, 0 },
        { KEY("expert_shared_count"), 1 << 16, 0 },
        { KEY("hash_layer_count"), DS4_MAX_LAYERS, 0 },
        { KEY("attention.sliding_window"), 1 << 24, 0 },
        { KEY("attention.indexer.head_count"), 4096, 0 },
        { KEY("attention.indexer.key_length"), 1 << 16, 0 },
        { KEY("attention.indexer.top_k"), 1 << 24, 0 },
        { KEY("hyper_connection.count"), 64, 0 },
        { KEY("hyper_connection.sinkhorn_iterations"), 1 << 16, 0 },
    };
    const int n_ints = (int)(sizeof ints / sizeof ints[0]);
    for (int i = 0; i < n_ints; i++) {
        ds4_status st = get_int(f, ints[i].key, ints[i].max, &ints[i].v, err);
        if (st) return st;
    }
    c->n_layer = (int)ints[0].v;
    c->n_embd = ints[1].v;
    c->n_vocab = ints[2].v;
    c->n_head = (int)ints[3].v;
    c->n_head_kv = (int)ints[4].v;
    c->head_dim = ints[5].v;
    if (ints[6].v != ints[5].v)
        return ds4_error_set(err, DS4_ERR_FORMAT, "attention.value_length %lld differs from key_length %lld "
                             "(one KV row is both key and value)", (long long)ints[6].v, (long long)ints[5].v);
    c->n_rot = (int)ints[7].v;
    c->q_lora = ints[8].v;
    c->o_lora = ints[9].v;
    c->o_groups = (int)ints[10].v;
    c->n_expert = (int)ints[11].v;
    c->n_expert_used = (int)ints[12].v;
    c->n_ff = ints[13].v;
    c->n_expert_shared = (int)ints[14].v;
    c->n_hash_layers = (int)ints[15].v;
    c->sliding_window = (int)ints[16].v;
    c->idx_n_head = (int)ints[17].v;
    c->idx_head_dim = ints[18].v;
    c->idx_top_k = (int)ints[19].v;
    c->n_hc = (int)ints[20].v;
    c->hc_iters = (int)ints[21].v;

    struct { const char *key; float *dst; } floats[] = {
        { KEY("rope.freq_base"), &c->rope_base },
        { KEY("attention.compress_rope_freq_base"), &c->compress_rope_base },
        { KEY("rope.scaling.factor"), &c->rope_factor },
        { KEY("rope.scaling.yarn_beta_fast"), &c->yarn_beta_fast },
        { KEY("rope.scaling.yarn_beta_slow"), &c->yarn_beta_slow },
        { KEY("expert_weights_scale"), &c->expert_weights_scale },
        { KEY("attention.layer_norm_rms_epsilon"), &c->rms_eps },
        { KEY("hyper_connection.epsilon"), &c->hc_eps },
    };
    for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++) {
        ds4_status st = get_float(f, floats[i].key, floats[i].dst, err);
        if (st) return st;
    }
    ds4_status st = gguf_get_u64(f, KEY("rope.scaling.original_context_length"), &c->rope_orig_ctx, err);
    if (st) return st;
    if ((st = gguf_get_bool(f, KEY("expert_weights_norm"), &c->expert_weights_norm, err))) return st;
    if (gguf_get_u64(f, KEY("context_length"), &c->context_length, NULL) != DS4_OK) c->context_length = 0;
    if (c->n_layer < 1) return ds4_error_set(err, DS4_ERR_FORMAT, "block_count is 0");

    double vals[DS4_MAX_LAYERS];
    if ((st = get_array(f, KEY("attention.compress_ratios"), c->n_layer, vals, err))) return st;
    for (int l = 0; l < c->n_layer; l++) c->compress_ratio[l] = vals[l] < 0 ? -1 : (int)vals[l];
    if ((st = get_array(f, KEY("swiglu_clamp_exp"), c->n_layer, vals, err))) return st;
    for (int l = 0; l < c->n_layer; l++) c->swiglu_limit[l] = (float)vals[l];
    for (int l = 0; l < c->n_layer; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.ffn_gate_tid2eid.weight", l);
        c->hash_layer[l] = gguf_find_tensor(f, name) != NULL;
    }
    if ((st = ds4_config_validate(c, err))) return ds4_error_prefix(err, "model metadata");
    return DS4_OK;
}

ds4_status ds4_config_write_gguf(const ds4_config *c, gguf_writer *w) {
    gguf_writer_add_str(w, "general.architecture", "deepseek4");
    gguf_writer_add_u32(w, KEY("block_count"), (uint32_t)c->n_layer);
    gguf_writer_add_u64(w, KEY("context_length"), c->context_length);
    gguf_writer_add_u32(w, KEY("embedding_length"), (uint32_t)c->n_embd);
    gguf_writer_add_u32(w, KEY("vocab_size"), (uint32_t)c->n_vocab);
    gguf_writer_add_u32(w, KEY("attention.head_count"), (uint32_t)c->n_head);
    gguf_writer_add_u32(w, KEY("attention.head_count_kv"), (uint32_t)c->n_head_kv);
    gguf_writer_add_u32(w, KEY("attention.key_length"), (uint32_t)c->head_dim);
    gguf_writer_add_u32(w, KEY("attention.value_length"), (uint32_t)c->head_dim);
    gguf_writer_add_u32(w, KEY("rope.dimension_count"), (uint32_t)c->n_rot);
    gguf_writer_add_u32(w, KEY("attention.q_lora_rank"), (uint32_t)c->q_lora);
    gguf_writer_add_u32(w, KEY("attention.output_lora_rank"), (uint32_t)c->o_lora);
    gguf_writer_add_u32(w, KEY("attention.output_group_count"), (uint32_t)c->o_groups);
    gguf_writer_add_u32(w, KEY("expert_count"), (uint32_t)c->n_expert);
    gguf_writer_add_u32(w, KEY("expert_used_count"), (uint32_t)c->n_expert_used);
    gguf_writer_add_u32(w, KEY("expert_feed_forward_length"), (uint32_t)c->n_ff);
    gguf_writer_add_u32(w, KEY("expert_shared_count"), (uint32_t)c->n_expert_shared);
    gguf_writer_add_u32(w, KEY("hash_layer_count"), (uint32_t)c->n_hash_layers);
    gguf_writer_add_u32(w, KEY("expert_group_count"), 0);
    gguf_writer_add_u32(w, KEY("expert_group_used_count"), 0);
    gguf_writer_add_u32(w, KEY("attention.sliding_window"), (uint32_t)c->sliding_window);
    gguf_writer_add_u32(w, KEY("attention.indexer.head_count"), (uint32_t)c->idx_n_head);
    gguf_writer_add_u32(w, KEY("attention.indexer.key_length"), (uint32_t)c->idx_head_dim);
    gguf_writer_add_u32(w, KEY("attention.indexer.top_k"), (uint32_t)c->idx_top_k);
    gguf_writer_add_u32(w, KEY("hyper_connection.count"), (uint32_t)c->n_hc);
    gguf_writer_add_u32(w, KEY("hyper_connection.sinkhorn_iterations"), (uint32_t)c->hc_iters);
    uint32_t ratios[DS4_MAX_LAYERS];
    float limits[DS4_MAX_LAYERS];
    for (int l = 0; l < c->n_layer; l++) {
        ratios[l] = (uint32_t)c->compress_ratio[l];
        limits[l] = c->swiglu_limit[l];
    }
    gguf_writer_add_array(w, KEY("attention.compress_ratios"), GGUF_TYPE_UINT32, ratios, (uint64_t)c->n_layer);
    gguf_writer_add_array(w, KEY("swiglu_clamp_exp"), GGUF_TYPE_FLOAT32, limits, (uint64_t)c->n_layer);
    gguf_writer_add_u64(w, KEY("rope.scaling.original_context_length"), c->rope_orig_ctx);
    gguf_writer_add_f32(w, KEY("rope.freq_base"), c->rope_base);
    gguf_writer_add_f32(w, KEY("rope.scaling.factor"), c->rope_factor);
    gguf_writer_add_f32(w, KEY("rope.scaling.yarn_beta_fast"), c->yarn_beta_fast);
    gguf_writer_add_f32(w, KEY("rope.scaling.yarn_beta_slow"), c->yarn_beta_slow);
    gguf_writer_add_f32(w, KEY("attention.compress_rope_freq_base"), c->compress_rope_base);
    gguf_writer_add_f32(w, KEY("expert_weights_scale"), c->expert_weights_scale);
    gguf_writer_add_f32(w, KEY("attention.layer_norm_rms_epsilon"), c->rms_eps);
    gguf_writer_add_f32(w, KEY("hyper_connection.epsilon"), c->hc_eps);
    gguf_writer_add_bool(w, KEY("expert_weights_norm"), c->expert_weights_norm);
    return gguf_writer_error(w)->status;
}

/* ------------------------------------------------------------ layout */

const char *ds4_quant_scheme_name(ds4_quant_scheme s) {
    switch (s) {
    case DS4_QUANT_F32: return "f32";
    case DS4_QUANT_Q8_0: return "q8_0";
    case DS4_QUANT_Q2: return "q2";
    case DS4_QUANT_Q4: return "q4";
    }
    return "?";
}

int ds4_quant_scheme_parse(const char *s) {
    for (int i = DS4_QUANT_F32; i <= DS4_QUANT_Q4; i++)
        if (!strcasecmp(s, ds4_quant_scheme_name((ds4_quant_scheme)i))) return i;
    return -1;
}

typedef struct layout_builder {
    ds4_quant_scheme scheme;
    ds4_tensor_spec *out;
    int64_t cap, n;
    bool bad;
    ds4_error *err;
} layout_builder;

/* Storage classes of the published files (spec 2.3); F32 scheme stores every
 * float tensor as F32. */
enum { CLS_F32, CLS_F16, CLS_Q8, CLS_GATE_UP, CLS_DOWN, CLS_I32 };

static void add(layout_builder *b, int layer, ds4_tensor_role role, int cls, int64_t fan_in, uint32_t n_dims,
                uint64_t ne0, uint64_t ne1, uint64_t ne2, const char *fmt, ...) __attribute__((format(printf, 10, 11)));

static void add(layout_builder *b, int layer, ds4_tensor_role role, int cls, int64_t fan_in, uint32_t n_dims,
                uint64_t ne0, uint64_t ne1, uint64_t ne2, const char *fmt, ...) {
    ds4_tensor_spec t;
    memset(&t, 0, sizeof t);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t.name, sizeof t.name, fmt, ap);
    va_end(ap);
    t.layer = layer;
    t.role = role;
    t.fan_in = fan_in;
    t.n_dims = n_dims;
    t.ne[0] = ne0;
    t.ne[1] = n_dims > 1 ? ne1 : 1;
    t.ne[2] = n_dims > 2 ? ne2 : 1;
    t.ne[3] = 1;
    uint32_t type = DS4_TYPE_F32;
    switch (cls) {
    case CLS_F32: type = DS4_TYPE_F32; break;
    case CLS_F16: type = b->scheme == DS4_QUANT_F32 ? DS4_TYPE_F32 : DS4_TYPE_F16; break;
    case CLS_Q8: type = b->scheme == DS4_QUANT_F32 ? DS4_TYPE_F32 : DS4_TYPE_Q8_0; break;
    case CLS_GATE_UP:
    case CLS_DOWN:
        switch (b->scheme) {
        case DS4_QUANT_F32: type = DS4_TYPE_F32; break;
        case DS4_QUANT_Q8_0: type = DS4_TYPE_Q8_0; break;
        case DS4_QUANT_Q2: type = cls == CLS_GATE_UP ? DS4_TYPE_IQ2_XXS : DS4_TYPE_Q2_K; break;
        case DS4_QUANT_Q4: type = DS4_TYPE_Q4_K; break;
        }
        break;
    case CLS_I32: type = DS4_TYPE_I32; break;
    }
    t.type = type;
    if (ds4_type_row_bytes(type, (int64_t)ne0) < 0 && !b->bad) {
        b->bad = true;
        ds4_error_set(b->err, DS4_ERR_INVALID, "tensor %s: a row of %llu elements cannot be stored as %s "
                      "(scheme %s)", t.name, (unsigned long long)ne0, ds4_type_name(type),
                      ds4_quant_scheme_name(b->scheme));
    }
    if (b->n < b->cap) b->out[b->n] = t;
    b->n++;
}

int64_t ds4_layout_tensors(const ds4_config *c, ds4_quant_scheme scheme, ds4_tensor_spec *out, int64_t cap,
                           ds4_error *err) {
    layout_builder b = { scheme, out, cap, 0, false, err };
    const uint64_t H = (uint64_t)c->n_embd, V = (uint64_t)c->n_vocab, hc = (uint64_t)c->n_hc;
    const uint64_t M = (2 + hc) * hc, D = (uint64_t)c->head_dim, nh = (uint64_t)c->n_head;
    const uint64_t qr = (uint64_t)c->q_lora, G = (uint64_t)c->o_groups, ro = (uint64_t)c->o_lora;
    const uint64_t E = (uint64_t)c->n_expert, I = (uint64_t)c->n_ff, k = (uint64_t)c->n_expert_used;
    const uint64_t ih = (uint64_t)c->idx_n_head, id = (uint64_t)c->idx_head_dim;

    add(&b, -1, DS4_ROLE_EMBEDDING, CLS_F16, (int64_t)H, 2, H, V, 0, "token_embd.weight");
    add(&b, -1, DS4_ROLE_HC_BASE, CLS_F32, 0, 1, hc, 0, 0, "output_hc_base.weight");
    add(&b, -1, DS4_ROLE_MATRIX, CLS_F16, (int64_t)(hc * H), 2, hc * H, hc, 0, "output_hc_fn.weight");
    add(&b, -1, DS4_ROLE_HC_SCALE, CLS_F32, 0, 1, 1, 0, 0, "output_hc_scale.weight");
    add(&b, -1, DS4_ROLE_NORM, CLS_F32, 0, 1, H, 0, 0, "output_norm.weight");
    add(&b, -1, DS4_ROLE_MATRIX, CLS_Q8, (int64_t)H, 2, H, V, 0, "output.weight");
    for (int l = 0; l < c->n_layer; l++) {
        const int m = c->compress_ratio[l];
        add(&b, l, DS4_ROLE_MATRIX, CLS_F16, (int64_t)(hc * H), 2, hc * H, M, 0, "blk.%d.hc_attn_fn.weight", l);
        add(&b, l, DS4_ROLE_HC_SCALE, CLS_F32, 0, 1, 3, 0, 0, "blk.%d.hc_attn_scale.weight", l);
        add(&b, l, DS4_ROLE_HC_BASE, CLS_F32, 0, 1, M, 0, 0, "blk.%d.hc_attn_base.weight", l);
        add(&b, l, DS4_ROLE_NORM, CLS_F32, 0, 1, H, 0, 0, "blk.%d.attn_norm.weight", l);
        add(&b, l, DS4_ROLE_MATRIX, CLS_Q8, (int64_t)H, 2, H, qr, 0, "blk.%d.attn_q_a.weight", l);
        add(&b, l, DS4_ROLE_NORM, CLS_F32, 0, 1, qr, 0, 0, "blk.%d.attn_q_a_norm.weight", l);
        add(&b, l, DS4_ROLE_MATRIX, CLS_Q8, (int64_t)qr, 2, qr, nh * D, 0, "blk.%d.attn_q_b.weight", l);
        add(&b, l, DS4_ROLE_MATRIX, CLS_Q8, (int64_t)H, 2, H, D, 0, "blk.%d.attn_kv.weight", l);
        add(&b, l, DS4_ROLE_NORM, CLS_F32, 0, 1, D, 0, 0, "blk.%d.attn_kv_a_norm.weight", l);
        add(&b, l, DS4_ROLE_SINK, CLS_F32, 0, 1, nh, 0, 0, "blk.%d.attn_sinks.weight", l);
        add(&b, l, DS4_ROLE_MATRIX, CLS_Q8, (int64_t)(nh * D / G), 2, nh * D / G, G * ro, 0,
            "blk.%d.attn_output_a.weight", l);
        add(&b, l, DS4_ROLE_MATRIX, CLS_Q8, (int64_t)(G * ro), 2, G * ro, H, 0, "blk.%d.attn_output_b.weight", l);
        add(&b, l, DS4_ROLE_MATRIX, CLS_F16, (int64_t)(hc * H), 2, hc * H, M, 0, "blk.%d.hc_ffn_fn.weight", l);
        add(&b, l, DS4_ROLE_HC_SCALE, CLS_F32, 0, 1, 3, 0, 0, "blk.%d.hc_ffn_scale.weight", l);
        add(&b, l, DS4_ROLE_HC_BASE, CLS_F32, 0, 1, M, 0, 0, "blk.%d.hc_ffn_base.weight", l);
        add(&b, l, DS4_ROLE_NORM, CLS_F32, 0, 1, H, 0, 0, "blk.%d.ffn_norm.weight", l);
        add(&b, l, DS4_ROLE_MATRIX, CLS_F16, (int64_t)H, 2, H, E, 0, "blk.%d.ffn_gate_inp.weight", l);
        if (!c->hash_layer[l]) add(&b, l, DS4_ROLE_BIAS, CLS_F32, 0, 1, E, 0, 0, "blk.%d.exp_probs_b.bias", l);
        add(&b, l, DS4_ROLE_EXPERTS, CLS_GATE_UP, (int64_t)H, 3, H, I, E, "blk.%d.ffn_gate_exps.weight", l);
        add(&b, l, DS4_ROLE_EXPERTS, CLS_GATE_UP, (int64_t)H, 3, H, I, E, "blk.%d.ffn_up_exps.weight", l);
        add(&b, l, DS4_ROLE_EXPERTS, CLS_DOWN, (int64_t)I, 3, I, H, E, "blk.%d.ffn_down_exps.weight", l);
        add(&b, l, DS4_ROLE_MATRIX, CLS_Q8, (int64_t)H, 2, H, I, 0, "blk.%d.ffn_gate_shexp.weight", l);
        add(&b, l, DS4_ROLE_MATRIX, CLS_Q8, (int64_t)H, 2, H, I, 0, "blk.%d.ffn_up_shexp.weight", l);
        add(&b, l, DS4_ROLE_MATRIX, CLS_Q8, (int64_t)I, 2, I, H, 0, "blk.%d.ffn_down_shexp.weight", l);
        if (c->hash_layer[l])
            add(&b, l, DS4_ROLE_TID2EID, CLS_I32, 0, 2, k, V, 0, "blk.%d.ffn_gate_tid2eid.weight", l);
        if (m != 0) {
            const uint64_t w = (m == 4 ? 2 : 1) * D;
            add(&b, l, DS4_ROLE_APE, CLS_F16, 0, 2, w, (uint64_t)m, 0, "blk.%d.attn_compressor_ape.weight", l);
            add(&b, l, DS4_ROLE_MATRIX, CLS_F16, (int64_t)H, 2, H, w, 0, "blk.%d.attn_compressor_kv.weight", l);
            add(&b, l, DS4_ROLE_MATRIX, CLS_F16, (int64_t)H, 2, H, w, 0, "blk.%d.attn_compressor_gate.weight", l);
            add(&b, l, DS4_ROLE_NORM, CLS_F32, 0, 1, D, 0, 0, "blk.%d.attn_compressor_norm.weight", l);
        }
        if (m == 4) {
            add(&b, l, DS4_ROLE_MATRIX, CLS_F16, (int64_t)qr, 2, qr, ih * id, 0, "blk.%d.indexer.attn_q_b.weight", l);
            add(&b, l, DS4_ROLE_MATRIX, CLS_F16, (int64_t)H, 2, H, ih, 0, "blk.%d.indexer.proj.weight", l);
            add(&b, l, DS4_ROLE_APE, CLS_F16, 0, 2, 2 * id, 4, 0, "blk.%d.indexer_compressor_ape.weight", l);
            add(&b, l, DS4_ROLE_MATRIX, CLS_F16, (int64_t)H, 2, H, 2 * id, 0, "blk.%d.indexer_compressor_kv.weight", l);
            add(&b, l, DS4_ROLE_MATRIX, CLS_F16, (int64_t)H, 2, H, 2 * id, 0, "blk.%d.indexer_compressor_gate.weight",
                l);
            add(&b, l, DS4_ROLE_NORM, CLS_F32, 0, 1, id, 0, 0, "blk.%d.indexer_compressor_norm.weight", l);
        }
    }
    return b.bad ? -1 : b.n;
}

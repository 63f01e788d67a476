/*
 * convert.c - `ds4server convert --from-hf DIR --out FILE [--quant f32|q8_0|q2|q4]`.
 *
 * Reads a Hugging Face DeepseekV4 checkpoint (config.json plus
 * model.safetensors or a sharded model.safetensors.index.json) and writes a
 * DS4 GGUF: deepseek4.* metadata from the config, and every tensor of
 * ds4_layout_tensors() for the chosen scheme, taken from its HF name(s).
 *
 * Layout rule (spec 12.3): no tensor is transposed. A torch [a, b] tensor is
 * a rows of b elements, which is exactly a GGUF [b, a] tensor, so each GGUF
 * row is read straight from the source. Routed experts come either per
 * expert (ffn.experts.E.w1/w2/w3) or fused (mlp.experts.gate_up_proj [E, 2I, H]
 * whose first I rows per expert are the gate, and down_proj [E, H, I]).
 *
 * Every source tensor and shape is checked before the output is opened;
 * data is then streamed a block of rows at a time (one expert at a time for
 * the routed experts), so memory stays small whatever the model size. The
 * output appears under its name only when complete (the writer's temp file).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/gguf.h"
#include "core/quant.h"
#include "core/safetensors.h"
#include "models/deepseek4/ds4_config.h"
#include "tools/tools.h"

#define CMD "convert"
#define MAX_ALTS 4

/* ------------------------------------------------------------ config.json */

static const cJSON *jget(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

/* Integer key with a default (present = must be an integer in [lo, hi]). */
static ds4_status jint(const cJSON *obj, const char *key, int64_t def, int64_t lo, int64_t hi, int64_t *out,
                       ds4_error *err) {
    const cJSON *v = jget(obj, key);
    if (!v) {
        *out = def;
        return DS4_OK;
    }
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || floor(d) != d || d < (double)lo || d > (double)hi)
        return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: \"%s\" must be an integer in %lld..%lld", key,
                             (long long)lo, (long long)hi);
    *out = (int64_t)d;
    return DS4_OK;
}

static ds4_status jnum(const cJSON *obj, const char *key, double def, double *out, ds4_error *err) {
    const cJSON *v = jget(obj, key);
    if (!v) {
        *out = def;
        return DS4_OK;
    }
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: \"%s\" must be a finite number", key);
    *out = v->valuedouble;
    return DS4_OK;
}

static ds4_status jbool(const cJSON *obj, const char *key, bool def, bool *out, ds4_error *err) {
    const cJSON *v = jget(obj, key);
    if (!v) {
        *out = def;
        return DS4_OK;
    }
    if (!cJSON_IsBool(v)) return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: \"%s\" must be true or false", key);
    *out = cJSON_IsTrue(v);
    return DS4_OK;
}

static ds4_status jstr(const cJSON *obj, const char *key, const char *def, const char **out, ds4_error *err) {
    const cJSON *v = jget(obj, key);
    if (!v) {
        *out = def;
        return DS4_OK;
    }
    if (!cJSON_IsString(v)) return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: \"%s\" must be a string", key);
    *out = v->valuestring;
    return DS4_OK;
}

/* The YaRN magnitude factor transformers applies to cos and sin when the
 * "compress" rope parameters do not state one (modeling_rope_utils). */
static double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * log(scale) + 1.0; }

/* RoPE parameters (spec 12.2, row 13): main must be plain; compress is plain
 * or YaRN with attention_factor exactly 1. */
static ds4_status parse_rope(const cJSON *root, ds4_config *c, double *prf, ds4_error *err) {
    double rope_theta, compress_theta;
    ds4_status st;
    if ((st = jnum(root, "rope_theta", 10000.0, &rope_theta, err))) return st;
    if ((st = jnum(root, "compress_rope_theta", 160000.0, &compress_theta, err))) return st;
    const cJSON *rp = jget(root, "rope_parameters");
    if (rp && !cJSON_IsObject(rp)) return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: \"rope_parameters\" must be an object");
    const cJSON *legacy = jget(root, "rope_scaling");
    const cJSON *main_p = rp ? jget(rp, "main") : NULL, *comp_p = rp ? jget(rp, "compress") : NULL;
    const cJSON *flat = NULL;
    bool nested = cJSON_IsObject(main_p) && cJSON_IsObject(comp_p);
    if (!nested) {
        flat = rp ? rp : (cJSON_IsObject(legacy) ? legacy : NULL);
        main_p = comp_p = NULL;
    }
    double main_base = rope_theta, comp_base = compress_theta;
    if (nested) {
        const char *mt;
        if ((st = jstr(main_p, "rope_type", NULL, &mt, err))) return st;
        if (!mt && (st = jstr(main_p, "type", "default", &mt, err))) return st;
        if (strcmp(mt, "default") != 0)
            return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: rope_parameters.main.rope_type is '%s'; the "
                                 "sliding layers' RoPE must be 'default'", mt);
        if ((st = jnum(main_p, "rope_theta", rope_theta, &main_base, err))) return st;
        if ((st = jnum(comp_p, "rope_theta", compress_theta, &comp_base, err))) return st;
        double pm, pc;
        if ((st = jnum(main_p, "partial_rotary_factor", *prf, &pm, err))) return st;
        if ((st = jnum(comp_p, "partial_rotary_factor", *prf, &pc, err))) return st;
        if (pm != pc)
            return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: partial_rotary_factor differs between the "
                                 "main (%g) and compress (%g) RoPE; the engine has one RoPE width", pm, pc);
        *prf = pm;
    }
    const cJSON *cp = nested ? comp_p : flat;
    const char *ct = "default";
    if (cp) {
        if ((st = jstr(cp, "rope_type", NULL, &ct, err))) return st;
        if (!ct && (st = jstr(cp, "type", "default", &ct, err))) return st;
    }
    c->rope_base = (float)main_base;
    c->compress_rope_base = (float)comp_base;
    c->rope_factor = 1.0f;
    c->yarn_beta_fast = 32.0f;
    c->yarn_beta_slow = 1.0f;
    c->rope_orig_ctx = 65536;
    if (!strcmp(ct, "default")) return DS4_OK;
    if (strcmp(ct, "yarn") != 0)
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: compress RoPE type '%s' is not supported (only "
                             "'default' and 'yarn')", ct);
    double factor, bf, bs, af, ms, msa;
    int64_t orig;
    bool truncate;
    if (!jget(cp, "factor") || !jget(cp, "original_max_position_embeddings"))
        return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: YaRN compress RoPE needs \"factor\" and "
                             "\"original_max_position_embeddings\"");
    if ((st = jnum(cp, "factor", 1.0, &factor, err))) return st;
    if ((st = jint(cp, "original_max_position_embeddings", 0, 1, INT64_MAX / 2, &orig, err))) return st;
    if ((st = jnum(cp, "beta_fast", 32.0, &bf, err))) return st;
    if ((st = jnum(cp, "beta_slow", 1.0, &bs, err))) return st;
    if ((st = jbool(cp, "truncate", true, &truncate, err))) return st;
    if ((st = jnum(cp, "mscale", 0.0, &ms, err))) return st;
    if ((st = jnum(cp, "mscale_all_dim", 0.0, &msa, err))) return st;
    if (bf == 0) bf = 32.0; /* transformers: `beta_fast or 32` */
    if (bs == 0) bs = 1.0;
    if (!truncate)
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: YaRN with \"truncate\": false is not supported");
    if (factor < 1) return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: YaRN factor %g is below 1", factor);
    /* Transformers forces attention_factor 1.0 only for the flat form; a nested
     * "compress" dict without it gets the YaRN mscale. */
    if (jget(cp, "attention_factor")) {
        if ((st = jnum(cp, "attention_factor", 1.0, &af, err))) return st;
    } else if (!nested) {
        af = 1.0;
    } else if (ms != 0 && msa != 0) {
        af = yarn_mscale(factor, ms) / yarn_mscale(factor, msa);
    } else {
        af = yarn_mscale(factor, 1.0);
    }
    if (fabs(af - 1.0) > 1e-6)
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: the compress RoPE's YaRN attention_factor is %.6g "
                             "(transformers derives 0.1*ln(factor)+1 when a nested \"compress\" dict omits it); this "
                             "engine, like DS4, scales cos/sin by exactly 1: set \"attention_factor\": 1.0", af);
    c->rope_factor = (float)factor;
    c->yarn_beta_fast = (float)bf;
    c->yarn_beta_slow = (float)bs;
    c->rope_orig_ctx = (uint64_t)orig;
    return DS4_OK;
}

static ds4_status parse_config(const cJSON *root, ds4_config *c, ds4_error *err) {
    memset(c, 0, sizeof *c);
    ds4_status st;
    const char *s;
    if ((st = jstr(root, "model_type", "deepseek_v4", &s, err))) return st;
    if (strcmp(s, "deepseek_v4") != 0)
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: model_type is '%s', expected 'deepseek_v4'", s);
    if (jget(root, "quantization_config"))
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: the checkpoint is quantised "
                             "(\"quantization_config\"); convert reads F32/F16/BF16/F64 weights only");
    struct { const char *key; int64_t def, lo, hi; int64_t v; } ints[] = {
        { "num_hidden_layers", 43, 1, DS4_MAX_LAYERS, 0 },  /* 0 */
        { "hidden_size", 4096, 1, 1 << 20, 0 },             /* 1 */
        { "vocab_size", 129280, 1, 1 << 24, 0 },            /* 2 */
        { "num_attention_heads", 64, 1, 4096, 0 },          /* 3 */
        { "num_key_value_heads", 1, 1, 4096, 0 },           /* 4 */
        { "head_dim", 512, 1, 1 << 16, 0 },                 /* 5 */
        { "q_lora_rank", 1024, 1, 1 << 20, 0 },             /* 6 */
        { "o_lora_rank", 1024, 1, 1 << 20, 0 },             /* 7 */
        { "o_groups", 8, 1, 4096, 0 },                      /* 8 */
        { "n_routed_experts", 256, 1, 1 << 16, 0 },         /* 9 */
        { "num_experts_per_tok", 6, 1, 1 << 16, 0 },        /* 10 */
        { "moe_intermediate_size", 2048, 1, 1 << 20, 0 },   /* 11 */
        { "n_shared_experts", 1, 0, 1 << 16, 0 },           /* 12 */
        { "sliding_window", 128, 1, 1 << 24, 0 },           /* 13 */
        { "index_n_heads", 64, 1, 4096, 0 },                /* 14 */
        { "index_head_dim", 128, 1, 1 << 16, 0 },           /* 15 */
        { "index_topk", 512, 1, 1 << 24, 0 },               /* 16 */
        { "hc_mult", 4, 1, 64, 0 },                         /* 17 */
        { "hc_sinkhorn_iters", 20, 1, 1 << 16, 0 },         /* 18 */
        { "max_position_embeddings", 1048576, 1, INT64_MAX / 2, 0 }, /* 19 */
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if ((st = jint(root, ints[i].key, ints[i].def, ints[i].lo, ints[i].hi, &ints[i].v, err))) return st;
    c->n_layer = (int)ints[0].v;
    c->n_embd = ints[1].v;
    c->n_vocab = ints[2].v;
    c->n_head = (int)ints[3].v;
    c->n_head_kv = (int)ints[4].v;
    c->head_dim = ints[5].v;
    c->q_lora = ints[6].v;
    c->o_lora = ints[7].v;
    c->o_groups = (int)ints[8].v;
    c->n_expert = (int)ints[9].v;
    c->n_expert_used = (int)ints[10].v;
    c->n_ff = ints[11].v;
    c->n_expert_shared = (int)ints[12].v;
    c->sliding_window = (int)ints[13].v;
    c->idx_n_head = (int)ints[14].v;
    c->idx_head_dim = ints[15].v;
    c->idx_top_k = (int)ints[16].v;
    c->n_hc = (int)ints[17].v;
    c->hc_iters = (int)ints[18].v;
    c->context_length = (uint64_t)ints[19].v;
    if (c->n_head_kv != 1)
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: num_key_value_heads is %d; this model family has "
                             "exactly one shared KV head", c->n_head_kv);
    if (c->n_expert_shared != 1)
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: n_shared_experts is %d; the engine runs exactly 1",
                             c->n_expert_shared);

    double d;
    if ((st = jnum(root, "hc_eps", 1e-6, &d, err))) return st;
    c->hc_eps = (float)d;
    if ((st = jnum(root, "rms_norm_eps", 1e-6, &d, err))) return st;
    c->rms_eps = (float)d;
    if ((st = jnum(root, "routed_scaling_factor", 1.5, &d, err))) return st;
    c->expert_weights_scale = (float)d;
    c->expert_weights_norm = true; /* transformers always normalises (spec 12.1 row 30) */
    double limit;
    if ((st = jnum(root, "swiglu_limit", 10.0, &limit, err))) return st;
    if (!(limit > 0))
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: swiglu_limit %g must be positive", limit);

    if ((st = jstr(root, "scoring_func", "sqrtsoftplus", &s, err))) return st;
    if (strcmp(s, "sqrtsoftplus") != 0)
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: scoring_func is '%s'; the engine implements "
                             "'sqrtsoftplus' only", s);
    if ((st = jstr(root, "hidden_act", "silu", &s, err))) return st;
    if (strcmp(s, "silu") != 0)
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: hidden_act is '%s'; the engine implements 'silu' "
                             "only", s);
    const char *no[] = { "tie_word_embeddings", "attention_bias", "mlp_bias" };
    for (size_t i = 0; i < 3; i++) {
        bool b;
        if ((st = jbool(root, no[i], false, &b, err))) return st;
        if (b)
            return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: \"%s\" is true; the engine has no biases and "
                                 "an untied output matrix", no[i]);
    }

    /* RoPE width: partial_rotary_factor, else legacy qk_rope_head_dim, else 64/512. */
    double prf = 64.0 / 512.0;
    if (jget(root, "partial_rotary_factor")) {
        if ((st = jnum(root, "partial_rotary_factor", prf, &prf, err))) return st;
    } else if (jget(root, "qk_rope_head_dim")) {
        int64_t r;
        if ((st = jint(root, "qk_rope_head_dim", 64, 1, 1 << 16, &r, err))) return st;
        prf = (double)r / (double)c->head_dim;
    }
    if ((st = parse_rope(root, c, &prf, err))) return st;
    c->n_rot = (int)((double)c->head_dim * prf);

    /* Compression rates per attention type (legacy scalar overrides). */
    int64_t rate_csa = 4, rate_hca = 128;
    const cJSON *rates = jget(root, "compress_rates");
    if (rates) {
        if (!cJSON_IsObject(rates))
            return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: \"compress_rates\" must be an object");
        if ((st = jint(rates, "compressed_sparse_attention", 4, 0, 1 << 20, &rate_csa, err))) return st;
        if ((st = jint(rates, "heavily_compressed_attention", 128, 0, 1 << 20, &rate_hca, err))) return st;
    }
    if ((st = jint(root, "compress_rate_csa", rate_csa, 0, 1 << 20, &rate_csa, err))) return st;
    if ((st = jint(root, "compress_rate_hca", rate_hca, 0, 1 << 20, &rate_hca, err))) return st;

    const cJSON *lt = jget(root, "layer_types"), *legacy_ratios = jget(root, "compress_ratios");
    if (lt) {
        if (!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != c->n_layer)
            return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: \"layer_types\" must be a list of "
                                 "num_hidden_layers (%d) strings", c->n_layer);
        int l = 0;
        for (const cJSON *v = lt->child; v; v = v->next, l++) {
            const char *t = cJSON_IsString(v) ? v->valuestring : "";
            if (!strcmp(t, "sliding_attention")) {
                c->compress_ratio[l] = 0;
            } else if (!strcmp(t, "compressed_sparse_attention")) {
                if (rate_csa != 4)
                    return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: layer %d is compressed_sparse_attention "
                                         "with ratio %lld; the engine runs sparse (indexed, overlapping) layers at "
                                         "ratio 4 only", l, (long long)rate_csa);
                c->compress_ratio[l] = 4;
            } else if (!strcmp(t, "heavily_compressed_attention")) {
                if (rate_hca != 128)
                    return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: layer %d is heavily_compressed_attention "
                                         "with ratio %lld; the engine runs heavily compressed layers at ratio 128 only",
                                         l, (long long)rate_hca);
                c->compress_ratio[l] = 128;
            } else {
                return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: layer_types[%d] is not one of "
                                     "sliding_attention, compressed_sparse_attention, heavily_compressed_attention", l);
            }
        }
    } else if (legacy_ratios) {
        if (!cJSON_IsArray(legacy_ratios) || cJSON_GetArraySize(legacy_ratios) < c->n_layer)
            return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: \"compress_ratios\" must list at least "
                                 "num_hidden_layers (%d) ratios", c->n_layer);
        const cJSON *v = legacy_ratios->child;
        for (int l = 0; l < c->n_layer; l++, v = v->next) {
            if (!cJSON_IsNumber(v) || (v->valuedouble != 0 && v->valuedouble != 4 && v->valuedouble != 128))
                return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "config.json: compress_ratios[%d] must be 0, 4 or 128",
                                     l);
            c->compress_ratio[l] = (int)v->valuedouble;
        }
    } else {
        return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: neither \"layer_types\" nor \"compress_ratios\" is "
                             "given (transformers would silently use the V4-Pro schedule; refusing to guess)");
    }

    const cJSON *mt = jget(root, "mlp_layer_types");
    if (mt) {
        if (!cJSON_IsArray(mt) || cJSON_GetArraySize(mt) != c->n_layer)
            return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: \"mlp_layer_types\" must be a list of "
                                 "num_hidden_layers (%d) strings", c->n_layer);
        int l = 0;
        for (const cJSON *v = mt->child; v; v = v->next, l++) {
            const char *t = cJSON_IsString(v) ? v->valuestring : "";
            if (strcmp(t, "hash_moe") != 0 && strcmp(t, "moe") != 0)
                return ds4_error_set(err, DS4_ERR_FORMAT, "config.json: mlp_layer_types[%d] is not 'hash_moe' or "
                                     "'moe'", l);
            c->hash_layer[l] = !strcmp(t, "hash_moe");
        }
    } else {
        int64_t nh;
        if ((st = jint(root, "num_hash_layers", 3, 0, DS4_MAX_LAYERS, &nh, err))) return st;
        for (int l = 0; l < c->n_layer; l++) c->hash_layer[l] = l < nh;
    }
    c->n_hash_layers = 0;
    for (int l = 0; l < c->n_layer; l++) {
        c->n_hash_layers += c->hash_layer[l];
        c->swiglu_limit[l] = (float)limit;
    }
    if ((st = ds4_config_validate(c, err))) return ds4_error_prefix(err, "config.json");
    return DS4_OK;
}

static ds4_status load_config(const char *dir, ds4_config *c, ds4_error *err) {
    size_t n = strlen(dir) + 16;
    char *path = malloc(n);
    if (!path) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    snprintf(path, n, "%s/config.json", dir);
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        ds4_status st = ds4_error_set(err, DS4_ERR_IO, "config.json: %s", strerror(errno));
        free(path);
        return st;
    }
    free(path);
    char *text = malloc(1u << 20);
    size_t len = text ? fread(text, 1, 1u << 20, fp) : 0;
    bool more = text && fgetc(fp) != EOF;
    fclose(fp);
    if (!text) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    if (more) {
        free(text);
        return ds4_error_set(err, DS4_ERR_FORMAT, "config.json is larger than 1 MiB");
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    ds4_status st;
    if (!root || !cJSON_IsObject(root)) {
        st = ds4_error_set(err, DS4_ERR_FORMAT, "config.json: invalid JSON%s near byte %lld", root ? " object" : "",
                           end ? (long long)(end - text) : 0LL);
    } else {
        st = parse_config(root, c, err);
    }
    cJSON_Delete(root);
    free(text);
    return st;
}

/* ------------------------------------------------------------ name map */

/* Where a GGUF tensor's data comes from. */
typedef enum src_kind {
    SRC_PLAIN,      /* one HF tensor, same element order */
    SRC_EXPERTS,    /* per-expert tensors fmt % expert */
    SRC_FUSED_GATE, /* first half of each expert of gate_up_proj */
    SRC_FUSED_UP,   /* second half */
    SRC_FUSED_DOWN, /* down_proj [E, H, I] */
} src_kind;

typedef struct source {
    src_kind kind;
    const safetensors_tensor *t; /* PLAIN and FUSED */
    char expert_fmt[128];        /* EXPERTS: "layers.N.ffn.experts.%d.w1.weight" (model. prefix added if needed) */
    bool expert_model_prefix;
} source;

typedef struct converter {
    safetensors_checkpoint *ck;
    bool *used;
    ds4_config cfg;
    const char *prefix; /* "model." when the checkpoint's names carry it, for messages */
} converter;

/* Look a name up with and without the "model." prefix; marks it used. */
static const safetensors_tensor *find_src(converter *cv, const char *name, bool *model_prefix) {
    char buf[256];
    uint64_t i = safetensors_checkpoint_index(cv->ck, name);
    if (model_prefix) *model_prefix = false;
    if (i == UINT64_MAX) {
        snprintf(buf, sizeof buf, "model.%s", name);
        i = safetensors_checkpoint_index(cv->ck, buf);
        if (i != UINT64_MAX && model_prefix) *model_prefix = true;
    }
    if (i == UINT64_MAX) return NULL;
    cv->used[i] = true;
    return cv->ck->tensors[i];
}

static void shape_str(const uint64_t *shape, uint32_t nd, char *buf, size_t cap) {
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (uint32_t i = 0; i < nd && o < cap; i++) o += (size_t)snprintf(buf + o, cap - o, "%s%llu", i ? ", " : "",
                                                                         (unsigned long long)shape[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

static ds4_status check_shape(const safetensors_tensor *t, const uint64_t *want, uint32_t nd, const char *gguf_name,
                              ds4_error *err) {
    bool ok = t->n_dims == nd;
    for (uint32_t i = 0; ok && i < nd; i++) ok = t->shape[i] == want[i];
    if (!ok) {
        char a[160], b[160];
        shape_str(want, nd, a, sizeof a);
        shape_str(t->shape, t->n_dims, b, sizeof b);
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s' (for %s): expected shape %s, found %s", t->name,
                             gguf_name, a, b);
    }
    return DS4_OK;
}

static ds4_status check_dtype(const safetensors_tensor *t, bool want_int, ds4_error *err) {
    if (want_int ? !safetensors_dtype_is_int(t->dtype) : !safetensors_dtype_is_float(t->dtype))
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "tensor '%s' has dtype %s; convert reads %s here", t->name,
                             safetensors_dtype_name(t->dtype), want_int ? "an integer dtype (I64, I32, ...)" :
                             "F32, F16, BF16 or F64");
    return DS4_OK;
}

/* HF names (without "model."), alternatives in order: 5.17 saved name,
 * upstream name, transformers module name. */
static int hf_names(const ds4_tensor_spec *s, char alts[MAX_ALTS][128]) {
    int n = 0;
#define ALT(...) snprintf(alts[n++], 128, __VA_ARGS__)
    if (s->layer < 0) {
        if (!strcmp(s->name, "token_embd.weight")) { ALT("embed_tokens.weight"); ALT("embed.weight"); }
        else if (!strcmp(s->name, "output_hc_base.weight")) { ALT("hc_head.hc_base"); ALT("hc_head_base"); }
        else if (!strcmp(s->name, "output_hc_fn.weight")) { ALT("hc_head.hc_fn"); ALT("hc_head_fn"); }
        else if (!strcmp(s->name, "output_hc_scale.weight")) { ALT("hc_head.hc_scale"); ALT("hc_head_scale"); }
        else if (!strcmp(s->name, "output_norm.weight")) { ALT("norm.weight"); }
        else if (!strcmp(s->name, "output.weight")) { ALT("head.weight"); ALT("lm_head.weight"); }
        return n;
    }
    const int L = s->layer;
    const char *suffix = strchr(s->name + 4, '.') + 1; /* after "blk.N." */
    static const struct { const char *gguf, *saved, *upstream, *module; } MAP[] = {
        { "hc_attn_fn.weight", "hc_attn_fn", NULL, "attn_hc.fn" },
        { "hc_attn_scale.weight", "hc_attn_scale", NULL, "attn_hc.scale" },
        { "hc_attn_base.weight", "hc_attn_base", NULL, "attn_hc.base" },
        { "attn_norm.weight", "attn_norm.weight", NULL, "input_layernorm.weight" },
        { "attn_q_a.weight", "attn.wq_a.weight", NULL, "self_attn.q_a_proj.weight" },
        { "attn_q_a_norm.weight", "attn.q_norm.weight", NULL, "self_attn.q_a_norm.weight" },
        { "attn_q_b.weight", "attn.wq_b.weight", NULL, "self_attn.q_b_proj.weight" },
        { "attn_kv.weight", "attn.wkv.weight", NULL, "self_attn.kv_proj.weight" },
        { "attn_kv_a_norm.weight", "attn.norm.weight", "attn.kv_norm.weight", "self_attn.kv_norm.weight" },
        { "attn_sinks.weight", "attn.attn_sink", NULL, "self_attn.sinks" },
        { "attn_output_a.weight", "attn.wo_a.weight", NULL, "self_attn.o_a_proj.weight" },
        { "attn_output_b.weight", "attn.wo_b.weight", NULL, "self_attn.o_b_proj.weight" },
        { "hc_ffn_fn.weight", "hc_ffn_fn", NULL, "ffn_hc.fn" },
        { "hc_ffn_scale.weight", "hc_ffn_scale", NULL, "ffn_hc.scale" },
        { "hc_ffn_base.weight", "hc_ffn_base", NULL, "ffn_hc.base" },
        { "ffn_norm.weight", "ffn_norm.weight", NULL, "post_attention_layernorm.weight" },
        { "ffn_gate_inp.weight", "ffn.gate.weight", NULL, "mlp.gate.weight" },
        { "exp_probs_b.bias", "ffn.gate.bias", NULL, "mlp.gate.e_score_correction_bias" },
        { "ffn_gate_tid2eid.weight", "ffn.gate.tid2eid", NULL, "mlp.gate.tid2eid" },
        { "ffn_gate_shexp.weight", "ffn.shared_experts.w1.weight", NULL, "mlp.shared_experts.gate_proj.weight" },
        { "ffn_up_shexp.weight", "ffn.shared_experts.w3.weight", NULL, "mlp.shared_experts.up_proj.weight" },
        { "ffn_down_shexp.weight", "ffn.shared_experts.w2.weight", NULL, "mlp.shared_experts.down_proj.weight" },
        { "attn_compressor_ape.weight", "attn.compressor.ape", NULL, "self_attn.compressor.position_bias" },
        { "attn_compressor_kv.weight", "attn.compressor.wkv.weight", NULL, "self_attn.compressor.kv_proj.weight" },
        { "attn_compressor_gate.weight", "attn.compressor.wgate.weight", NULL, "self_attn.compressor.gate_proj.weight" },
        { "attn_compressor_norm.weight", "attn.compressor.norm.weight", NULL, "self_attn.compressor.kv_norm.weight" },
        { "indexer.attn_q_b.weight", "attn.indexer.wq_b.weight", NULL, "self_attn.compressor.indexer.q_b_proj.weight" },
        { "indexer.proj.weight", "attn.indexer.weights_proj.weight", NULL,
          "self_attn.compressor.indexer.scorer.weights_proj.weight" },
        { "indexer_compressor_ape.weight", "attn.indexer.compressor.ape", NULL,
          "self_attn.compressor.indexer.position_bias" },
        { "indexer_compressor_kv.weight", "attn.indexer.compressor.wkv.weight", NULL,
          "self_attn.compressor.indexer.kv_proj.weight" },
        { "indexer_compressor_gate.weight", "attn.indexer.compressor.wgate.weight", NULL,
          "self_attn.compressor.indexer.gate_proj.weight" },
        { "indexer_compressor_norm.weight", "attn.indexer.compressor.norm.weight", NULL,
          "self_attn.compressor.indexer.kv_norm.weight" },
    };
    for (size_t i = 0; i < sizeof MAP / sizeof MAP[0]; i++) {
        if (strcmp(MAP[i].gguf, suffix) != 0) continue;
        ALT("layers.%d.%s", L, MAP[i].saved);
        if (MAP[i].upstream) ALT("layers.%d.%s", L, MAP[i].upstream);
        ALT("layers.%d.%s", L, MAP[i].module);
        break;
    }
#undef ALT
    return n;
}

/* Resolve the source of one GGUF tensor and check its shape and dtype. */
static ds4_status resolve(converter *cv, const ds4_tensor_spec *s, source *src, ds4_error *err) {
    memset(src, 0, sizeof *src);
    src->kind = SRC_PLAIN;
    const uint64_t ne0 = s->ne[0], ne1 = s->ne[1];
    if (s->role == DS4_ROLE_EXPERTS) {
        const uint64_t E = s->ne[2];
        const int L = s->layer;
        const bool down = strstr(s->name, "ffn_down_exps") != NULL;
        const char *w = down ? "w2" : strstr(s->name, "ffn_gate_exps") ? "w1" : "w3";
        char name[128];
        snprintf(name, sizeof name, "layers.%d.ffn.experts.0.%s.weight", L, w);
        bool prefix;
        if (find_src(cv, name, &prefix)) {
            src->kind = SRC_EXPERTS;
            snprintf(src->expert_fmt, sizeof src->expert_fmt, "%slayers.%d.ffn.experts.%%d.%s.weight",
                     prefix ? "model." : "", L, w);
            const uint64_t want[2] = { ne1, ne0 };
            for (uint64_t e = 0; e < E; e++) {
                snprintf(name, sizeof name, src->expert_fmt, (int)e);
                const safetensors_tensor *t = find_src(cv, name, NULL);
                if (!t)
                    return ds4_error_set(err, DS4_ERR_NOT_FOUND, "tensor '%s' (expert %llu of %s) is missing", name,
                                         (unsigned long long)e, s->name);
                ds4_status st = check_shape(t, want, 2, s->name, err);
                if (!st) st = check_dtype(t, false, err);
                if (st) return st;
            }
            return DS4_OK;
        }
        const char *fused[2] = { down ? "mlp.experts.down_proj" : "mlp.experts.gate_up_proj",
                                 down ? "ffn.experts.down_proj" : "ffn.experts.gate_up_proj" };
        for (int k = 0; k < 2 && !src->t; k++) {
            snprintf(name, sizeof name, "layers.%d.%s", L, fused[k]);
            src->t = find_src(cv, name, NULL);
        }
        if (!src->t)
            return ds4_error_set(err, DS4_ERR_NOT_FOUND, "no source for %s: neither %slayers.%d.ffn.experts.E.%s.weight "
                                 "nor %slayers.%d.mlp.experts.%s is in the checkpoint", s->name, cv->prefix, L, w,
                                 cv->prefix, L, down ? "down_proj" : "gate_up_proj");
        src->kind = down ? SRC_FUSED_DOWN : !strcmp(w, "w1") ? SRC_FUSED_GATE : SRC_FUSED_UP;
        const uint64_t want[3] = { E, down ? ne1 : 2 * ne1, ne0 };
        ds4_status st = check_shape(src->t, want, 3, s->name, err);
        return st ? st : check_dtype(src->t, false, err);
    }
    char alts[MAX_ALTS][128];
    int n = hf_names(s, alts);
    for (int i = 0; i < n && !src->t; i++) src->t = find_src(cv, alts[i], NULL);
    if (!src->t) {
        if (n == 0) return ds4_error_set(err, DS4_ERR_INVALID, "no HF name is known for %s", s->name);
        return ds4_error_set(err, DS4_ERR_NOT_FOUND, "tensor '%s%s' (for %s) is missing from the checkpoint%s%s%s%s",
                             cv->prefix, alts[0], s->name, n > 1 ? " (also tried '" : "", n > 1 ? cv->prefix : "",
                             n > 1 ? alts[1] : "", n > 1 ? "')" : "");
    }
    uint64_t want[2];
    uint32_t nd = s->n_dims;
    if (nd == 1) want[0] = ne0;
    else { want[0] = ne1; want[1] = ne0; }
    ds4_status st = check_shape(src->t, want, nd, s->name, err);
    return st ? st : check_dtype(src->t, s->role == DS4_ROLE_TID2EID, err);
}

/* ------------------------------------------------------------ streaming */

typedef struct stream_buf {
    float *f;
    int64_t *i64;
    uint8_t *out;
    uint64_t cap_elems;
} stream_buf;

/* Convert n elements (whole rows of ne0) of `t` starting at `first` to the
 * target type and write them. */
static ds4_status write_rows(gguf_writer *w, const ds4_tensor_spec *s, const safetensors_tensor *t, uint64_t first,
                             uint64_t n, stream_buf *b, ds4_error *err) {
    const uint64_t ne0 = s->ne[0];
    while (n > 0) {
        uint64_t rows = b->cap_elems / ne0;
        if (rows == 0) rows = 1;
        uint64_t chunk = rows * ne0 < n ? rows * ne0 : n;
        ds4_status st = safetensors_read_f32(t, first, chunk, b->f, err);
        if (st) return st;
        for (uint64_t i = 0; i < chunk; i++)
            if (!isfinite(b->f[i]))
                return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s' element %llu is not finite (%g)", t->name,
                                     (unsigned long long)(first + i), (double)b->f[i]);
        uint64_t bytes;
        if (s->type == DS4_TYPE_F32) {
            memcpy(b->out, b->f, chunk * 4);
            bytes = chunk * 4;
        } else if (s->type == DS4_TYPE_F16) {
            uint16_t *h = (uint16_t *)(void *)b->out;
            for (uint64_t i = 0; i < chunk; i++) h[i] = ds4_f32_to_f16(b->f[i]);
            bytes = chunk * 2;
        } else {
            const ds4_type_traits *tr = ds4_type_traits_get(s->type);
            int64_t rb = ds4_type_row_bytes(s->type, (int64_t)ne0);
            if (!tr || !tr->quantize_row || rb < 0)
                return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "%s: cannot quantise to %s", s->name, ds4_type_name(s->type));
            for (uint64_t r = 0; r < chunk / ne0; r++)
                tr->quantize_row(b->f + r * ne0, b->out + r * (uint64_t)rb, (int64_t)ne0);
            bytes = chunk / ne0 * (uint64_t)rb;
        }
        if ((st = gguf_writer_write(w, b->out, bytes))) {
            *err = *gguf_writer_error(w);
            return st;
        }
        first += chunk;
        n -= chunk;
    }
    return DS4_OK;
}

static ds4_status write_tid2eid(gguf_writer *w, const ds4_tensor_spec *s, const safetensors_tensor *t, int n_expert,
                                stream_buf *b, ds4_error *err) {
    uint64_t n = t->n_elements, first = 0;
    while (n > 0) {
        uint64_t chunk = n < b->cap_elems ? n : b->cap_elems;
        ds4_status st = safetensors_read_i64(t, first, chunk, b->i64, err);
        if (st) return st;
        int32_t *o = (int32_t *)(void *)b->out;
        for (uint64_t i = 0; i < chunk; i++) {
            int64_t v = b->i64[i];
            if (v < 0 || v >= n_expert)
                return ds4_error_set(err, DS4_ERR_FORMAT, "tensor '%s' (for %s): token %llu routes to expert %lld, "
                                     "outside [0, %d)", t->name, s->name,
                                     (unsigned long long)((first + i) / s->ne[0]), (long long)v, n_expert);
            o[i] = (int32_t)v;
        }
        if ((st = gguf_writer_write(w, b->out, chunk * 4))) {
            *err = *gguf_writer_error(w);
            return st;
        }
        first += chunk;
        n -= chunk;
    }
    return DS4_OK;
}

static ds4_status write_tensor(converter *cv, gguf_writer *w, const ds4_tensor_spec *s, const source *src,
                               stream_buf *b, ds4_error *err) {
    if (s->role == DS4_ROLE_TID2EID) return write_tid2eid(w, s, src->t, cv->cfg.n_expert, b, err);
    const uint64_t per_expert = s->ne[0] * s->ne[1];
    const uint64_t E = s->ne[2];
    switch (src->kind) {
    case SRC_PLAIN: return write_rows(w, s, src->t, 0, src->t->n_elements, b, err);
    case SRC_EXPERTS:
        for (uint64_t e = 0; e < E; e++) {
            char name[160];
            snprintf(name, sizeof name, src->expert_fmt, (int)e);
            const safetensors_tensor *t = safetensors_checkpoint_find(cv->ck, name);
            ds4_status st = write_rows(w, s, t, 0, per_expert, b, err);
            if (st) return st;
        }
        return DS4_OK;
    case SRC_FUSED_GATE:
    case SRC_FUSED_UP:
    case SRC_FUSED_DOWN:
        for (uint64_t e = 0; e < E; e++) {
            uint64_t first = src->kind == SRC_FUSED_DOWN ? e * per_expert
                           : e * 2 * per_expert + (src->kind == SRC_FUSED_UP ? per_expert : 0);
            ds4_status st = write_rows(w, s, src->t, first, per_expert, b, err);
            if (st) return st;
        }
        return DS4_OK;
    }
    return DS4_OK;
}

/* ------------------------------------------------------------ main */

static int usage(FILE *out) {
    fprintf(out, "usage: ds4server convert --from-hf DIR --out FILE [--quant f32|q8_0|q2|q4]\n"
                 "converts a Hugging Face DeepseekV4 checkpoint (config.json + model.safetensors or a sharded\n"
                 "model.safetensors.index.json) to a DS4 GGUF. --quant picks the storage scheme (default q8_0):\n"
                 "  f32   every float tensor F32\n"
                 "  q8_0  the published q2 layout with Q8_0 routed experts\n"
                 "  q2    the published 2-bit layout (IQ2_XXS gate/up, Q2_K down)\n"
                 "  q4    the published 4-bit layout (Q4_K experts)\n");
    return 0;
}

int tool_convert(int argc, char **argv) {
    const char *dir = NULL, *out_path = NULL, *quant = "q8_0";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--from-hf")) {
            if (++i >= argc) return tool_fail(CMD, "--from-hf needs a directory");
            dir = argv[i];
        } else if (!strcmp(argv[i], "--out") || !strcmp(argv[i], "-o")) {
            if (++i >= argc) return tool_fail(CMD, "--out needs a path");
            out_path = argv[i];
        } else if (!strcmp(argv[i], "--quant")) {
            if (++i >= argc) return tool_fail(CMD, "--quant needs one of f32, q8_0, q2, q4");
            quant = argv[i];
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            return usage(stdout);
        } else {
            return tool_fail(CMD, "unexpected argument '%s' (see --help)", argv[i]);
        }
    }
    if (!dir || !out_path) return tool_fail(CMD, "usage: ds4server convert --from-hf DIR --out FILE [--quant f32|q8_0|q2|q4]");
    int scheme = ds4_quant_scheme_parse(quant);
    if (scheme < 0) return tool_fail(CMD, "unknown --quant '%s' (f32, q8_0, q2, q4)", quant);

    ds4_error err = { 0 };
    converter cv;
    memset(&cv, 0, sizeof cv);
    if (load_config(dir, &cv.cfg, &err)) return tool_fail(CMD, "%s/%s", dir, err.message);
    int64_t n = ds4_layout_tensors(&cv.cfg, (ds4_quant_scheme)scheme, NULL, 0, &err);
    if (n < 0) return tool_fail(CMD, "--quant %s cannot store this model: %s", quant, err.message);
    ds4_tensor_spec *specs = calloc((size_t)n, sizeof *specs);
    source *srcs = calloc((size_t)n, sizeof *srcs);
    stream_buf b = { 0 };
    gguf_writer *w = NULL;
    int rc = 0;
    if (!specs || !srcs) {
        rc = tool_fail(CMD, "out of memory");
        goto done;
    }
    ds4_layout_tensors(&cv.cfg, (ds4_quant_scheme)scheme, specs, n, &err);
    if (safetensors_checkpoint_open(dir, &cv.ck, &err)) {
        rc = tool_fail(CMD, "%s", err.message);
        goto done;
    }
    cv.used = calloc(cv.ck->n_tensors ? cv.ck->n_tensors : 1, sizeof *cv.used);
    if (!cv.used) {
        rc = tool_fail(CMD, "out of memory");
        goto done;
    }
    cv.prefix = "";
    for (uint64_t i = 0; i < cv.ck->n_tensors; i++)
        if (!strncmp(cv.ck->tensors[i]->name, "model.", 6)) cv.prefix = "model.";
    /* Resolve and check every source before writing anything. */
    uint64_t max_row = 1;
    for (int64_t i = 0; i < n; i++) {
        if (resolve(&cv, &specs[i], &srcs[i], &err)) {
            rc = tool_fail(CMD, "%s: %s", dir, err.message);
            goto done;
        }
        if (specs[i].ne[0] > max_row) max_row = specs[i].ne[0];
    }
    b.cap_elems = max_row > (1u << 20) ? max_row : (1u << 20);
    b.f = malloc(b.cap_elems * sizeof *b.f);
    b.i64 = malloc(b.cap_elems * sizeof *b.i64);
    b.out = malloc(b.cap_elems * sizeof(float));
    if (!b.f || !b.i64 || !b.out) {
        rc = tool_fail(CMD, "out of memory for a %llu-element buffer", (unsigned long long)b.cap_elems);
        goto done;
    }
    if (gguf_writer_open(out_path, GGUF_DEFAULT_ALIGNMENT, &w, &err)) {
        rc = tool_fail(CMD, "%s", err.message);
        goto done;
    }
    ds4_config_write_gguf(&cv.cfg, w);
    gguf_writer_add_str(w, "general.name", "deepseek4 (converted from Hugging Face)");
    for (int64_t i = 0; i < n; i++)
        gguf_writer_add_tensor(w, specs[i].name, specs[i].type, specs[i].n_dims, specs[i].ne);
    if (gguf_writer_error(w)->status) {
        rc = tool_fail(CMD, "%s", gguf_writer_error(w)->message);
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        if (write_tensor(&cv, w, &specs[i], &srcs[i], &b, &err)) {
            rc = tool_fail(CMD, "%s: %s", dir, err.message);
            goto done;
        }
    }
    ds4_status st = gguf_writer_finish(w, &err);
    w = NULL;
    if (st) {
        rc = tool_fail(CMD, "%s", err.message);
        goto done;
    }
    uint64_t unused = 0;
    const char *example = NULL;
    for (uint64_t i = 0; i < cv.ck->n_tensors; i++) {
        if (cv.used[i]) continue;
        if (!example) example = cv.ck->tensors[i]->name;
        unused++;
    }
    printf("convert: wrote %s: %lld tensors, %d layers, scheme %s", out_path, (long long)n, cv.cfg.n_layer,
           ds4_quant_scheme_name((ds4_quant_scheme)scheme));
    if (unused) printf("; ignored %llu unused checkpoint tensors (e.g. %s)", (unsigned long long)unused, example);
    printf("\n");
done:
    if (w) gguf_writer_abort(w);
    free(b.f);
    free(b.i64);
    free(b.out);
    free(specs);
    free(srcs);
    free(cv.used);
    safetensors_checkpoint_close(cv.ck);
    return rc;
}

/*
 * ds4_model.c - DeepSeek V4 Flash forward pass over the operation table.
 *
 * Per layer (spec section 3):
 *   attention sublayer: HC pre-mix -> RMSNorm -> low-rank q (norm, per-head
 *     norm, RoPE) and the shared KV row (norm, RoPE, FP8) -> compressors
 *     (ratio 4 / 128) -> indexer (ratio 4) -> attention with sinks over the raw
 *     window and the visible compressed rows -> inverse RoPE -> grouped
 *     low-rank output -> HC post.
 *   FFN sublayer: HC pre-mix -> RMSNorm -> router (sqrt-softplus; hash layers
 *     route by token id) -> routed experts (clamped SwiGLU) + shared expert ->
 *     HC post.
 * then the HC head merge, the output norm and the LM head.
 *
 * A batch is processed layer-major. The dense projections, the router and
 * the routed experts run over the whole batch (each token's row on its own).
 * The parts that read or write the per-layer state keep each token's view:
 * the compressors run over the batch in position order, recording how many
 * compressed rows each token sees; a run of a state's tokens goes into the
 * KV window in one copy while the window does not move, each token's view
 * of it recorded; then the run's tokens attend (in one attention_rows call
 * up to the first that needs the indexer's selection, then one by one). So
 * a batch computes exactly what single-token decoding computes.
 */
#include "models/deepseek4/ds4_model.h"
#include "models/deepseek4/ds4_model_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/quant.h"
#include "models/deepseek4/ds4_synth.h"


/* The inspection hook (ds4_model_set_tap): a no-op unless a harness set it. */
#define TAP(name, layer, token, buf, n)                                                 \
    do {                                                                                \
        if (m->tap) m->tap(m->tap_ctx, (name), (layer), (token), (buf), (n), false);    \
    } while (0)

/* TAP of rows t0 .. t0 + rows - 1 of a batched result, one tap per token. */
#define TAP_ROWS(name, layer, t0, rows, buf, width)                                     \
    do {                                                                                \
        if (m->tap)                                                                     \
            for (int64_t u_ = 0; u_ < (rows); u_++)                                     \
                TAP(name, layer, (t0) + u_, (buf) + u_ * (width), (width));             \
    } while (0)

/* Integer results (expert ids, selected rows: n int32 in the backend buffer
 * `buf`) pass through the hook as host floats (exact below 2^24) and go
 * back rounded. Only with a hook set: the bit patterns come down through the
 * download op and go back through upload; without one nothing moves. */
static void tap_ints(const ds4_model *m, const char *name, int layer, int64_t token, float *buf, int64_t n) {
    if (!m->tap || n <= 0) return;
    ds4_backend *be = m->be;
    int32_t *v = malloc((size_t)n * sizeof *v);
    float *f = malloc((size_t)n * sizeof *f);
    if (v && f) {
        be->ops->download(be, (float *)v, buf, n);
        for (int64_t i = 0; i < n; i++) f[i] = (float)v[i];
        m->tap(m->tap_ctx, name, layer, token, f, n, true);
        for (int64_t i = 0; i < n; i++) v[i] = (int32_t)lrintf(f[i]);
        be->ops->upload(be, buf, (const float *)v, n);
    }
    free(v);
    free(f);
}

void ds4_model_set_tap(ds4_model *m, ds4_model_tap_fn fn, void *ctx) {
    m->tap = fn;
    m->tap_ctx = ctx;
}

void ds4_model_set_layer_limit(ds4_model *m, int n_layers) {
    m->layer_limit = n_layers > 0 && n_layers < m->cfg.n_layer ? n_layers : 0;
}

void ds4_model_set_compressor_chunks(ds4_model *m, bool on) { m->comp_per_token = !on; }
void ds4_model_set_indexer_batches(ds4_model *m, int rows) { m->idx_batch = rows < 0 ? 0 : rows == 0 ? -1 : rows; }
void ds4_model_set_state_batches(ds4_model *m, bool on) { m->no_state_batches = !on; }
void ds4_model_set_eval_chunk(ds4_model *m, int64_t n) { m->eval_chunk = n < 1 ? DS4_EVAL_CHUNK : n; }
int64_t ds4_model_eval_chunk(const ds4_model *m) { return m->eval_chunk > 0 ? m->eval_chunk : DS4_EVAL_CHUNK; }

void ds4_model_set_profile_layers(ds4_model *m, int first, int n) {
    m->prof_first = first > 0 ? first : 0;
    m->prof_n = n > 0 ? n : 0;
}

const ds4_config *ds4_model_config(const ds4_model *m) { return &m->cfg; }
int64_t ds4_state_pos(const ds4_state *s) { return s->pos; }
ds4_backend *ds4_model_backend(const ds4_model *m) { return m->be; }

uint64_t ds4_model_fingerprint(const ds4_model *m) {
    uint64_t h = 0xcbf29ce484222325ULL;
    uint64_t n = m->file->data_offset < m->file->size ? m->file->data_offset : m->file->size;
    for (uint64_t i = 0; i < n; i++) h = (h ^ m->file->map[i]) * 0x100000001b3ULL;
    for (int i = 0; i < 8; i++) h = (h ^ (uint8_t)(m->file->size >> (8 * i))) * 0x100000001b3ULL;
    return h;
}

/* ------------------------------------------------------------ binding */

/* Types a tensor may have, from the class the published q2 layout gives it:
 * F32 tensors must be F32; F16 ones may be any float type; Q8_0 projections
 * any float type or Q8_0; routed experts any type the backends multiply. */
static bool type_allowed(uint32_t q2_type, uint32_t got) {
    switch (q2_type) {
    case DS4_TYPE_F32: return got == DS4_TYPE_F32;
    case DS4_TYPE_I32: return got == DS4_TYPE_I32;
    case DS4_TYPE_F16: return got == DS4_TYPE_F16 || got == DS4_TYPE_BF16 || got == DS4_TYPE_F32;
    case DS4_TYPE_Q8_0:
        return got == DS4_TYPE_Q8_0 || got == DS4_TYPE_F16 || got == DS4_TYPE_BF16 || got == DS4_TYPE_F32;
    default: /* routed experts */
        return got == DS4_TYPE_IQ2_XXS || got == DS4_TYPE_Q2_K || got == DS4_TYPE_Q4_K || got == DS4_TYPE_Q8_0 ||
               got == DS4_TYPE_F16 || got == DS4_TYPE_BF16 || got == DS4_TYPE_F32;
    }
}

static ds4_weight *weight_slot(ds4_model *m, const char *name) {
    int layer = -1, n = 0;
    char suffix[96];
    if (sscanf(name, "blk.%d.%95s%n", &layer, suffix, &n) != 2) {
        struct { const char *name; ds4_weight *w; } g[] = {
            { "token_embd.weight", &m->token_embd }, { "output_hc_base.weight", &m->out_hc_base },
            { "output_hc_fn.weight", &m->out_hc_fn }, { "output_hc_scale.weight", &m->out_hc_scale },
            { "output_norm.weight", &m->out_norm }, { "output.weight", &m->output },
        };
        for (size_t i = 0; i < sizeof g / sizeof g[0]; i++)
            if (!strcmp(name, g[i].name)) return g[i].w;
        return NULL;
    }
    if (layer < 0 || layer >= m->cfg.n_layer) return NULL;
    layer_weights *L = &m->layers[layer];
    struct { const char *suffix; ds4_weight *w; } t[] = {
        { "hc_attn_fn.weight", &L->hc_attn_fn }, { "hc_attn_scale.weight", &L->hc_attn_scale },
        { "hc_attn_base.weight", &L->hc_attn_base }, { "attn_norm.weight", &L->attn_norm },
        { "attn_q_a.weight", &L->q_a }, { "attn_q_a_norm.weight", &L->q_a_norm }, { "attn_q_b.weight", &L->q_b },
        { "attn_kv.weight", &L->kv }, { "attn_kv_a_norm.weight", &L->kv_norm }, { "attn_sinks.weight", &L->sinks },
        { "attn_output_a.weight", &L->out_a }, { "attn_output_b.weight", &L->out_b },
        { "hc_ffn_fn.weight", &L->hc_ffn_fn }, { "hc_ffn_scale.weight", &L->hc_ffn_scale },
        { "hc_ffn_base.weight", &L->hc_ffn_base }, { "ffn_norm.weight", &L->ffn_norm },
        { "ffn_gate_inp.weight", &L->gate_inp }, { "exp_probs_b.bias", &L->probs_bias },
        { "ffn_gate_exps.weight", &L->gate_exps }, { "ffn_up_exps.weight", &L->up_exps },
        { "ffn_down_exps.weight", &L->down_exps }, { "ffn_gate_shexp.weight", &L->gate_sh },
        { "ffn_up_shexp.weight", &L->up_sh }, { "ffn_down_shexp.weight", &L->down_sh },
        { "ffn_gate_tid2eid.weight", &L->tid2eid }, { "attn_compressor_ape.weight", &L->comp_ape },
        { "attn_compressor_kv.weight", &L->comp_kv }, { "attn_compressor_gate.weight", &L->comp_gate },
        { "attn_compressor_norm.weight", &L->comp_norm }, { "indexer.attn_q_b.weight", &L->idx_q_b },
        { "indexer.proj.weight", &L->idx_proj }, { "indexer_compressor_ape.weight", &L->idx_ape },
        { "indexer_compressor_kv.weight", &L->idx_kv }, { "indexer_compressor_gate.weight", &L->idx_gate },
        { "indexer_compressor_norm.weight", &L->idx_norm },
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(suffix, t[i].suffix)) return t[i].w;
    return NULL;
}

static void shape_str(const uint64_t *ne, uint32_t n, char *buf, size_t cap) {
    size_t o = 0;
    for (uint32_t d = 0; d < n && o < cap; d++) o += (size_t)snprintf(buf + o, cap - o, "%s%llu", d ? ", " : "[",
                                                                      (unsigned long long)ne[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

/* Synthetic weights (ds4_model_load_synthetic): the seed they are drawn from. */
typedef struct synth_src {
    uint64_t seed;
} synth_src;

static ds4_status bind_one(ds4_model *m, const ds4_tensor_spec *spec, int64_t index, uint32_t q2_type,
                           const synth_src *syn, ds4_error *err) {
    const gguf_tensor *t = gguf_find_tensor(m->file, spec->name);
    if (!t) {
        if (strstr(spec->name, "exp_probs_b")) return DS4_OK; /* optional: no selection bias */
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor %s is missing", spec->name);
    }
    char want[96], got[96];
    shape_str(spec->ne, spec->n_dims, want, sizeof want);
    shape_str(t->ne, t->n_dims, got, sizeof got);
    bool same = t->n_dims == spec->n_dims;
    for (uint32_t d = 0; same && d < spec->n_dims; d++) same = t->ne[d] == spec->ne[d];
    if (!same) return ds4_error_set(err, DS4_ERR_FORMAT, "tensor %s has shape %s, expected %s", spec->name, got, want);
    if (!type_allowed(q2_type, t->type))
        return ds4_error_set(err, DS4_ERR_FORMAT, "tensor %s has type %s, which is not allowed here (the published "
                             "files use %s)", spec->name, ds4_type_name(t->type), ds4_type_name(q2_type));
    ds4_weight *w = weight_slot(m, spec->name);
    if (!w) return ds4_error_set(err, DS4_ERR_FORMAT, "tensor %s has no slot (internal)", spec->name);
    char *name = strdup(spec->name);
    if (!name) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    m->names[m->n_bound] = name;
    w->name = name;
    w->type = t->type;
    for (int d = 0; d < 4; d++) w->ne[d] = (int64_t)t->ne[d];
    w->row_bytes = ds4_type_row_bytes(t->type, (int64_t)t->ne[0]);
    w->host = t->data;
    w->device = NULL;
    m->bound[m->n_bound++] = w;
    ds4_status st;
    if (syn) {
        ds4_fill fill;
        st = ds4_synth_fill_for(spec, w->type, &m->cfg, syn->seed, index, &fill, err);
        if (!st && !m->be->ops->bind_synthetic)
            st = ds4_error_set(err, DS4_ERR_UNSUPPORTED, "the %s backend cannot make synthetic weights",
                               m->be->ops->name);
        if (!st) st = m->be->ops->bind_synthetic(m->be, w, &fill, err);
    } else {
        st = m->be->ops->bind_weight(m->be, w, err);
    }
    if (st) {
        m->n_bound--; /* not bound: nothing to release */
        free(name);
        return ds4_error_prefix(err, "tensor %s", spec->name);
    }
    return DS4_OK;
}

/* A model switch: on unless the variable is "0". */
static bool env_not_zero(const char *name) {
    const char *v = getenv(name);
    return !(v && !strcmp(v, "0"));
}

ds4_status ds4_model_load(gguf_file *file, ds4_backend *be, ds4_model **out, ds4_error *err) {
    return ds4_model_load_progress(file, be, NULL, NULL, out, err);
}

/* Every op the forward pass calls must be in the backend's table: a backend
 * that lacks one cannot run this model, and says which. */
static ds4_status check_ops(const ds4_backend *be, ds4_error *err) {
    const ds4_backend_ops *o = be->ops;
    const struct { const char *name; bool present; } need[] = {
        { "alloc", o->alloc }, { "free", o->free }, { "upload", o->upload }, { "download", o->download },
        { "copy", o->copy }, { "fill", o->fill }, { "repeat_rows", o->repeat_rows }, { "copy_rows", o->copy_rows },
        { "bind_weight", o->bind_weight },
        { "release_weight", o->release_weight }, { "embed", o->embed }, { "rmsnorm", o->rmsnorm }, { "add", o->add },
        { "add_weight_row", o->add_weight_row }, { "add_weight_rows_mod", o->add_weight_rows_mod },
        { "add_weight_rows_at", o->add_weight_rows_at },
        { "round_f16", o->round_f16 }, { "round_fp8_kv", o->round_fp8_kv },
        { "indexer_qat", o->indexer_qat }, { "matmul", o->matmul }, { "matmul_grouped", o->matmul_grouped },
        { "matmul_multi", o->matmul_multi },
        { "rope_tail", o->rope_tail }, { "head_norm_rope", o->head_norm_rope },
        { "hc_pre", o->hc_pre }, { "hc_pre_norm", o->hc_pre_norm },
        { "hc_post_pre_norm", o->hc_post_pre_norm }, { "hc_post", o->hc_post }, { "hc_head", o->hc_head }, { "attention", o->attention },
        { "compressor_pool", o->compressor_pool }, { "compressor_pool_states", o->compressor_pool_states }, { "indexer_scores", o->indexer_scores }, { "top_k", o->top_k },
        { "indexer_scores_rows", o->indexer_scores_rows }, { "top_k_rows", o->top_k_rows },
        { "attention_rows", o->attention_rows }, { "attention_rows_sel", o->attention_rows_sel },
        { "attention_states", o->attention_states },
        { "router", o->router }, { "swiglu", o->swiglu }, { "moe", o->moe }, { "take_error", o->take_error },
    };
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
        if (!need[i].present)
            return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "the %s backend has no %s op, which DeepSeek V4 needs",
                                 o->name, need[i].name);
    return DS4_OK;
}

static ds4_status load_model(gguf_file *file, ds4_backend *be, ds4_model_load_fn fn, void *ctx, const synth_src *syn,
                             ds4_model **out, ds4_error *err);

ds4_status ds4_model_load_progress(gguf_file *file, ds4_backend *be, ds4_model_load_fn fn, void *ctx,
                                   ds4_model **out, ds4_error *err) {
    return load_model(file, be, fn, ctx, NULL, out, err);
}

ds4_status ds4_model_load_synthetic(gguf_file *file, ds4_backend *be, uint64_t seed, ds4_model_load_fn fn,
                                    void *ctx, ds4_model **out, ds4_error *err) {
    const synth_src syn = { seed };
    return load_model(file, be, fn, ctx, &syn, out, err);
}

static ds4_status load_model(gguf_file *file, ds4_backend *be, ds4_model_load_fn fn, void *ctx, const synth_src *syn,
                             ds4_model **out, ds4_error *err) {
    *out = NULL;
    ds4_status ops_st = check_ops(be, err);
    if (ops_st) return ops_st;
    ds4_model *m = calloc(1, sizeof *m);
    if (!m) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    m->file = file;
    m->be = be;
    m->attn_branch = env_not_zero("DS4_ATTN_BRANCH");
    m->iq_branch = env_not_zero("DS4_IQ_BRANCH");
    /* $DS4_EVAL_CHUNK: the rows one evaluation step holds (ds4_model_set_eval_chunk), for measuring */
    const char *ec = getenv("DS4_EVAL_CHUNK");
    if (ec && *ec) {
        char *end = NULL;
        const long long v = strtoll(ec, &end, 10);
        if (*end || v < 1 || v > DS4_EVAL_CHUNK_MAX) {
            free(m);
            return ds4_error_set(err, DS4_ERR_INVALID, "DS4_EVAL_CHUNK must be a row count from 1 to %d, not '%s'",
                                 DS4_EVAL_CHUNK_MAX, ec);
        }
        m->eval_chunk = (int64_t)v;
    }
    ds4_status st = ds4_config_from_gguf(file, &m->cfg, err);
    if (st) {
        free(m);
        return st;
    }
    const ds4_config *c = &m->cfg;
    ds4_error ignore;
    int64_t n = ds4_layout_tensors(c, DS4_QUANT_F32, NULL, 0, &ignore);
    ds4_tensor_spec *specs = calloc((size_t)n, sizeof *specs);
    ds4_tensor_spec *q2 = calloc((size_t)n, sizeof *q2);
    m->layers = calloc((size_t)c->n_layer, sizeof *m->layers);
    m->bound = calloc((size_t)n, sizeof *m->bound);
    m->names = calloc((size_t)n, sizeof *m->names);
    if (!specs || !q2 || !m->layers || !m->bound || !m->names) {
        free(specs);
        free(q2);
        ds4_model_free(m);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    }
    ds4_layout_tensors(c, DS4_QUANT_F32, specs, n, &ignore);
    ds4_layout_tensors(c, DS4_QUANT_Q2, q2, n, &ignore); /* classes only: may not fit the widths */
    int64_t total = 0, done = 0;
    for (int64_t i = 0; i < n && fn; i++) {
        const gguf_tensor *t = gguf_find_tensor(file, specs[i].name);
        if (t) total += (int64_t)t->n_bytes;
    }
    for (int64_t i = 0; i < n && !st; i++) {
        st = bind_one(m, &specs[i], i, q2[i].type, syn, err);
        const gguf_tensor *t = fn && !st ? gguf_find_tensor(file, specs[i].name) : NULL;
        if (t) {
            done += (int64_t)t->n_bytes;
            fn(ctx, done, total);
        }
    }
    for (int l = 0; l < c->n_layer && !st; l++) {
        layer_weights *L = &m->layers[l];
        L->has_bias = L->probs_bias.host != NULL;
        if (L->gate_exps.type != L->up_exps.type)
            st = ds4_error_set(err, DS4_ERR_FORMAT, "blk.%d: ffn_gate_exps is %s but ffn_up_exps is %s (they must "
                               "match)", l, ds4_type_name(L->gate_exps.type), ds4_type_name(L->up_exps.type));
        if (!st && L->tid2eid.host) {
            const int32_t *ids = L->tid2eid.host;
            for (int64_t i = 0; i < c->n_vocab * c->n_expert_used; i++) {
                int32_t e;
                memcpy(&e, ids + i, sizeof e);
                if (e < 0 || e >= c->n_expert) {
                    st = ds4_error_set(err, DS4_ERR_FORMAT, "blk.%d.ffn_gate_tid2eid.weight: token %lld routes to "
                                       "expert %d, outside 0..%d", l, (long long)(i / c->n_expert_used), e,
                                       c->n_expert - 1);
                    break;
                }
            }
        }
    }
    free(specs);
    free(q2);
    if (st) {
        ds4_model_free(m);
        return st;
    }
    m->rope_dense = (ds4_rope){ c->n_rot, c->rope_base, 1.0f, 0, 0 };
    m->rope_comp = (ds4_rope){ c->n_rot, c->compress_rope_base, c->rope_factor, 0, 0 };
    ds4_config_yarn_bounds(c, &m->rope_comp.yarn_lo, &m->rope_comp.yarn_hi);
    m->hc = (ds4_hc){ c->n_hc, c->n_embd, c->hc_iters, c->hc_eps, c->rms_eps };
    *out = m;
    return DS4_OK;
}

static void scratch_free(ds4_backend *be, struct eval_scratch *s);
static void slot_free(ds4_backend *be, scratch_slot *slot);

void ds4_model_free(ds4_model *m) {
    if (!m) return;
    slot_free(m->be, &m->chunk_scratch);
    for (int64_t i = 0; i < m->n_bound; i++) {
        m->be->ops->release_weight(m->be, m->bound[i]);
        free(m->names[i]);
    }
    free(m->bound);
    free(m->names);
    free(m->layers);
    free(m);
}

/* ------------------------------------------------------------ state */

static void compressor_free(ds4_backend *be, compressor_state *c) {
    be->ops->free(be, c->state_kv);
    be->ops->free(be, c->state_sc);
    be->ops->free(be, c->rows);
}

static bool compressor_init(ds4_backend *be, compressor_state *c, int ratio, int64_t dim, int64_t n_ctx) {
    c->ratio = ratio;
    c->coff = ratio == 4 ? 2 : 1;
    c->dim = dim;
    c->cap = n_ctx / ratio + 2;
    int64_t state = (int64_t)c->coff * ratio * c->coff * dim;
    c->state_kv = be->ops->alloc(be, state);
    c->state_sc = be->ops->alloc(be, state);
    c->rows = be->ops->alloc(be, c->cap * dim);
    if (!c->state_kv || !c->state_sc || !c->rows) return false;
    be->ops->fill(be, c->state_sc, -INFINITY, state);
    return true;
}

ds4_status ds4_state_create(ds4_model *m, int64_t n_ctx, ds4_state **out, ds4_error *err) {
    *out = NULL;
    if (n_ctx < 1) return ds4_error_set(err, DS4_ERR_INVALID, "context size %lld must be positive", (long long)n_ctx);
    const ds4_config *c = &m->cfg;
    ds4_backend *be = m->be;
    ds4_state *s = calloc(1, sizeof *s);
    if (!s) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    s->model = m;
    s->n_ctx = n_ctx;
    s->layers = calloc((size_t)c->n_layer, sizeof *s->layers);
    bool ok = s->layers != NULL;
    for (int l = 0; ok && l < c->n_layer; l++) {
        layer_state *L = &s->layers[l];
        L->window = be->ops->alloc(be, 2 * (int64_t)c->sliding_window * c->head_dim);
        ok = L->window != NULL;
        int r = c->compress_ratio[l];
        if (ok && r) ok = compressor_init(be, &L->attn, r, c->head_dim, n_ctx);
        if (ok && r == 4) ok = compressor_init(be, &L->index, r, c->idx_head_dim, n_ctx);
    }
    if (!ok) {
        ds4_state_free(s);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for the state of a %lld-token context",
                             (long long)n_ctx);
    }
    *out = s;
    return DS4_OK;
}

void ds4_state_free(ds4_state *s) {
    if (!s) return;
    ds4_backend *be = s->model->be;
    slot_free(be, &s->scratch);
    for (int l = 0; s->layers && l < s->model->cfg.n_layer; l++) {
        be->ops->free(be, s->layers[l].window);
        compressor_free(be, &s->layers[l].attn);
        compressor_free(be, &s->layers[l].index);
    }
    free(s->layers);
    free(s);
}

/* ------------------------------------------------------------ scratch */

/* Rows of room before the compressor projections of a chunk: the state rows
 * its first window needs (up to 127 of a ratio-128 window, 4 + 3 of width
 * 2 D for ratio 4), copied there so the chunk's windows lie in one run of
 * rows (compressor_chunk). */
#define COMP_PRE 128
#define OWN_STATES_MAX 64 /* a batch of states taking the batched paths (rows_own_states) */

typedef struct eval_scratch {
    float *X, *X2;      /* HC state [n, hc*H] and its successor */
    float *x, *a;       /* sublayer input and its norm [n, H] */
    float *post, *comb; /* HC mix [n, hc], [n, hc*hc] */
    float *qr, *q;      /* [n, qr], [n, nh*D] */
    float *kv;          /* [n, D] */
    float *ckv, *csc;   /* compressor projections [n, 2*D], after room for COMP_PRE rows of D (compressor_chunk) */
    float *ikv, *isc;   /* indexer compressor projections [n, 2*id], after room for 8 rows of 2*id */
    float *iq, *iw;     /* indexer queries [n, ih*id] and weights [n, ih] */
    float *iscores;     /* [sel_rows, score_stride]: indexer scores of rows that select */
    float *crow;        /* pooled rows [min(n, OWN_STATES_MAX), max(D, id)]: one per state whose window ends */
    float *attn;        /* attention output [n, nh*D] */
    float *low;         /* [n, G*ro] */
    float *y;           /* sublayer output [n, H] */
    float *logits_e;    /* router logits [n, E] */
    float *moe;         /* routed experts' output [n, H] */
    float *g, *u;       /* shared expert [n, I] */
    float *h;           /* [n, H] */
    float *logits;      /* [n, V] */
    float *next;        /* greedy next tokens, int32 [n] (eval_greedy) */
    /* the choices ops hand to later ops, in backend memory (int32 arrays
     * stored in float buffers, see backend.h) */
    float *sel;         /* expert ids, int32 [n, k] */
    float *sel_w;       /* routing weights [n, k] */
    float *topk;        /* selected compressed rows, int32 [sel_rows, top_k] */
    int32_t *hash_ids;  /* host: hash layers' expert ids [n, k] */
    int64_t *n_comp;    /* host: compressed rows each row's attention sees [n] */
    int64_t *n_index;   /* host: indexer rows each row's indexer sees [n] */
    int64_t *win_off, *win_n; /* host: each row's view of its window (first row, rows) [n] */
    int64_t score_stride;     /* n_ctx/4 + 2: the most indexer rows a state holds, and room */
    /* the residual step a sublayer left to the next one's input (y, and
     * y2 summed to it when non-NULL; sublayer_output) */
    bool post_pending;
    const float *post_y2;
    int64_t sel_rows;         /* rows whose scores and selections are made in one call (iscores, topk) */
} scratch;

static void scratch_free(ds4_backend *be, scratch *s) {
    float *bufs[] = { s->X, s->X2, s->x, s->a, s->post, s->comb, s->qr, s->q, s->kv, s->ckv, s->csc, s->ikv,
                      s->isc, s->iq, s->iw, s->iscores, s->crow, s->attn, s->low, s->y, s->logits_e, s->moe,
                      s->g, s->u, s->h, s->logits, s->next, s->sel, s->sel_w, s->topk };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->ops->free(be, bufs[i]);
    free(s->hash_ids);
    free(s->n_comp);
    free(s->n_index);
    free(s->win_off);
    free(s->win_n);
}

static bool scratch_alloc(ds4_backend *be, const ds4_config *c, int64_t n, int64_t n_ctx, bool all_logits,
                          scratch *s) {
    memset(s, 0, sizeof *s);
    const int64_t H = c->n_embd, hcH = c->n_hc * H, D = c->head_dim;
    /* the selecting rows' scores in batches of up to 4M floats (at least one row) */
    s->score_stride = n_ctx / 4 + 2;
    s->sel_rows = ((int64_t)1 << 22) / s->score_stride;
    if (s->sel_rows > n) s->sel_rows = n;
    if (s->sel_rows < 1) s->sel_rows = 1;
    const int64_t crow = D > c->idx_head_dim ? D : c->idx_head_dim;
    float **slots[] = { &s->X, &s->X2, &s->x, &s->a, &s->post, &s->comb, &s->qr, &s->q, &s->kv, &s->ckv, &s->csc,
                        &s->ikv, &s->isc, &s->iq, &s->iw, &s->iscores, &s->crow, &s->attn, &s->low, &s->y,
                        &s->logits_e, &s->moe, &s->g, &s->u, &s->h, &s->logits, &s->next, &s->sel, &s->sel_w,
                        &s->topk };
    const int64_t sizes[] = { n * hcH, n * hcH, n * H, n * H, n * c->n_hc, n * c->n_hc * c->n_hc, n * c->q_lora,
                              n * c->n_head * D, n * D, n * 2 * D + COMP_PRE * D, n * 2 * D + COMP_PRE * D,
                              (n + 8) * 2 * c->idx_head_dim, (n + 8) * 2 * c->idx_head_dim,
                              n * c->idx_n_head * c->idx_head_dim,
                              n * c->idx_n_head, s->sel_rows * s->score_stride,
                              (n < OWN_STATES_MAX ? n : OWN_STATES_MAX) * crow,
                              n * c->n_head * D, n * c->o_groups * c->o_lora, n * H, n * c->n_expert, n * H,
                              n * c->n_ff, n * c->n_ff, n * H, (all_logits ? n : 1) * c->n_vocab, n,
                              n * c->n_expert_used, n * c->n_expert_used, s->sel_rows * c->idx_top_k };
    bool ok = true;
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) {
        *slots[i] = be->ops->alloc(be, sizes[i] > 0 ? sizes[i] : 1);
        ok &= *slots[i] != NULL;
    }
    s->hash_ids = malloc((size_t)(n * c->n_expert_used > 0 ? n * c->n_expert_used : 1) * sizeof *s->hash_ids);
    ok &= s->hash_ids != NULL;
    s->n_comp = malloc((size_t)(n > 0 ? n : 1) * sizeof *s->n_comp);
    s->n_index = malloc((size_t)(n > 0 ? n : 1) * sizeof *s->n_index);
    s->win_off = malloc((size_t)(n > 0 ? n : 1) * sizeof *s->win_off);
    s->win_n = malloc((size_t)(n > 0 ? n : 1) * sizeof *s->win_n);
    ok &= s->n_comp && s->n_index && s->win_off && s->win_n;
    if (!ok) scratch_free(be, s);
    return ok;
}

/* ------------------------------------------------------------ sublayers */

/* A full window drops its oldest row (before the next one is added). */
static void window_drop_full(const ds4_config *c, layer_state *L) {
    if (L->n_window == c->sliding_window) {
        L->win_start++;
        L->n_window--;
    }
}

/* Where the next raw KV row of the window goes: the oldest row is dropped
 * when the window is full, and the live rows move to the buffer's front
 * when the next one would not fit (they cannot overlap their new place:
 * W - 1 rows at most, from row W + 1 on). window_commit then counts it. */
static float *window_slot(ds4_backend *be, const ds4_config *c, layer_state *L) {
    const int64_t D = c->head_dim, W = c->sliding_window;
    window_drop_full(c, L);
    if (L->win_start + L->n_window == 2 * W) {
        if (L->n_window > 0) be->ops->copy(be, L->window, ds4_window_rows(L, D), L->n_window * D);
        L->win_start = 0;
    }
    return L->window + (L->win_start + L->n_window) * D;
}

static void window_commit(layer_state *L) { L->n_window++; }

/* The state row a compressor keeps the token at position p's projections in. */
static int64_t comp_state_row(const compressor_state *cs, int64_t p) {
    return cs->ratio == 4 ? 4 + p % 4 : p % cs->ratio;
}

/* The window end at position p (spec 3.5): the state rows are pooled into
 * a row that is normalised, rotated and rounded, and appended (or made in
 * `row` and dropped when the rows are full); a ratio-4 compressor's current
 * window then becomes the previous one. t is the batch row (for the taps). */
/* cnt pooled rows of dim made compressed rows (spec 3.5 step 5): the norm,
 * RoPE at first[w] (the first position of each row's window) and, under
 * DS4 numerics, the FP8 (attention) or QAT (indexer) and F16 rounding. t
 * is the batch row the taps name (one row: the per-token path). */
static void compressor_rows(ds4_model *m, int l, int64_t t, const ds4_weight *norm, bool is_index, float *rows,
                            int64_t cnt, int64_t dim, const int32_t *first, ds4_numerics num) {
    ds4_backend *be = m->be;
    be->ops->rmsnorm(be, rows, norm, m->cfg.rms_eps, rows, cnt, dim);
    TAP(is_index ? "idx_comp_norm" : "comp_norm", l, t, rows, cnt * dim);
    be->ops->rope_tail(be, rows, cnt, 1, dim, first, &m->rope_comp, false);
    TAP(is_index ? "idx_comp_rope" : "comp_rope", l, t, rows, cnt * dim);
    if (ds4_numerics_rounds(num)) {
        if (is_index) be->ops->indexer_qat(be, rows, cnt, dim);
        else be->ops->round_fp8_kv(be, rows, cnt, dim, m->cfg.n_rot);
        TAP(is_index ? "idx_comp_qat" : "comp_fp8", l, t, rows, cnt * dim);
        be->ops->round_f16(be, rows, cnt * dim);
        TAP(is_index ? "idx_comp_f16" : "comp_f16", l, t, rows, cnt * dim);
    }
}

static void compressor_emit(ds4_model *m, int l, int64_t t, compressor_state *cs, const ds4_weight *norm,
                            bool is_index, int64_t p, float *row, ds4_numerics num) {
    ds4_backend *be = m->be;
    const int ratio = cs->ratio;
    const int64_t width = cs->coff * cs->dim;
    /* the emitted row is made in place when there is room for it */
    const bool kept = cs->n_rows < cs->cap;
    if (kept) row = cs->rows + cs->n_rows * cs->dim;
    be->ops->compressor_pool(be, cs->state_kv, cs->state_sc, ratio, cs->dim, 1, row);
    TAP(is_index ? "idx_comp_pool" : "comp_pool", l, t, row, cs->dim);
    const int32_t first = (int32_t)(p + 1 - ratio);
    compressor_rows(m, l, t, norm, is_index, row, 1, cs->dim, &first, num);
    if (kept) cs->n_rows++;
    if (ratio == 4) { /* the current window becomes the previous one */
        be->ops->copy(be, cs->state_kv, cs->state_kv + 4 * width, 4 * width);
        be->ops->copy(be, cs->state_sc, cs->state_sc + 4 * width, 4 * width);
    }
}

/* One compressor (the attention's, or with is_index the indexer's) over
 * the batch (spec 3.5): row t's projections kv + t * width, sc + t * width
 * (width = coff * dim) for position pos[t] of state rs[t]. Each score row
 * gets its position's APE row; the rows of a run of consecutive positions
 * of one state inside one window go to their (consecutive) state rows in
 * one copy per buffer; a window end emits. n_rows[t] gets the compressed
 * rows row t's attention sees (its own window's, if it ends one, among
 * them): rows are only appended, so the attention of every row can follow
 * once the whole batch has gone through. */
/*
 * The same for a chunk of one state at consecutive positions p0 .. p0+n-1
 * (no inspection hook: its taps are per token), in a few launches whatever
 * n is: every score row gets its APE row in one call; the state rows the
 * first window needs (the partial window before p0, and for ratio 4 the
 * previous window) are copied into the room before kv and sc, so every
 * window ending in the chunk has its candidate rows in one run of rows laid
 * out as the state lays them out (ratio 128: its 128 rows in position
 * order; ratio 4: the previous window's 4 rows, then its own), window w + 1
 * `ratio` rows after window w; the windows are pooled in one call, and
 * normalised, rotated and rounded as one block of rows appended to the
 * compressed rows. The state is then left as token-by-token evaluation
 * leaves it: ratio 128, row r holds the last position of residue r
 * (positions since the last window end, then the rest of the window
 * before); ratio 4, rows 0..3 the last complete window, rows 4..7 the
 * positions since (then the stale rest of that copy). The same values
 * bit for bit as compressor_pass's token by token (test_compressor_chunks_match).
 */
static void compressor_chunk(ds4_model *m, compressor_state *cs, const ds4_weight *ape, const ds4_weight *norm,
                             bool is_index, float *kv, float *sc, int64_t p0, int64_t n, ds4_numerics num,
                             int64_t *n_rows) {
    ds4_backend *be = m->be;
    const int ratio = cs->ratio;
    const int64_t width = cs->coff * cs->dim, dim = cs->dim, end = p0 + n; /* positions < end done after */
    be->ops->add_weight_rows_mod(be, sc, ape, p0 % ratio, n);
    /* the run of rows from position h0: the state's rows before p0, then the chunk's */
    const int64_t k = ratio == 4 ? 4 + p0 % 4 : p0 % ratio, h0 = p0 - k;
    float *hkv = kv - k * width, *hsc = sc - k * width;
    if (k) {
        be->ops->copy(be, hkv, cs->state_kv, k * width);
        be->ops->copy(be, hsc, cs->state_sc, k * width);
    }
    /* windows ending in the chunk: at e_w = e0 + w * ratio, their rows from e_w + 1 - span (offset w * ratio) */
    const int64_t e0 = (p0 / ratio + 1) * ratio - 1;
    const int64_t n_win = e0 < end ? (end - 1 - e0) / ratio + 1 : 0;
    const int64_t room = cs->cap - cs->n_rows, kept = n_win < room ? n_win : (room > 0 ? room : 0);
    /* the windows' rows, up to 256 at a time (their positions in a host array) */
    for (int64_t w0 = 0; w0 < kept; w0 += 256) {
        const int64_t cnt = kept - w0 < 256 ? kept - w0 : 256;
        float *rows = cs->rows + (cs->n_rows + w0) * dim;
        int32_t first[256];
        be->ops->compressor_pool(be, hkv + w0 * ratio * width, hsc + w0 * ratio * width, ratio, dim, cnt, rows);
        for (int64_t w = 0; w < cnt; w++) first[w] = (int32_t)(e0 + (w0 + w) * ratio + 1 - ratio);
        compressor_rows(m, -1, -1, norm, is_index, rows, cnt, dim, first, num); /* (no taps on this path) */
    }
    const int64_t n0 = cs->n_rows;
    cs->n_rows += kept;
    for (int64_t t = 0; t < n; t++) { /* the rows emitted up to and including row t's position */
        const int64_t ended = p0 + t >= e0 ? (p0 + t - e0) / ratio + 1 : 0;
        n_rows[t] = n0 + (ended < kept ? ended : kept);
    }
    /* the state as token-by-token evaluation leaves it */
    float *const bufs[2][2] = { { cs->state_kv, hkv }, { cs->state_sc, hsc } };
    for (int b = 0; b < 2; b++) {
        float *st = bufs[b][0];
        const float *h = bufs[b][1];
        if (n_win == 0) { /* the chunk lies inside one window: its rows after the state's */
            const int64_t r = ratio == 4 ? 4 + p0 % 4 : p0 % ratio;
            be->ops->copy(be, st + r * width, h + k * width, n * width);
            continue;
        }
        const int64_t e_last = e0 + (n_win - 1) * ratio, j = end - 1 - e_last; /* j positions since it */
        if (ratio == 4) {
            const float *last = h + (e_last - 3 - h0) * width; /* the last complete window's 4 rows */
            be->ops->copy(be, st, last, 4 * width);
            if (j) be->ops->copy(be, st + 4 * width, h + (e_last + 1 - h0) * width, j * width);
            be->ops->copy(be, st + (4 + j) * width, last + j * width, (4 - j) * width);
        } else {
            if (j) be->ops->copy(be, st, h + (e_last + 1 - h0) * width, j * width);
            be->ops->copy(be, st + j * width, h + (e_last + 1 - ratio + j - h0) * width, (ratio - j) * width);
        }
    }
}

/* Every row of the batch is a state of its own (a batched decode of up to
 * 64 states; larger batches, and any batch with a state twice, take the
 * row-by-row paths): their rows' copies into their states go in one
 * copy_rows call, as no row's copy can touch another's state. */
static bool rows_own_states(ds4_model *m, ds4_state *const *rs, int64_t n) {
    if (n < 2 || n > OWN_STATES_MAX || m->tap || m->no_state_batches) return false;
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = 0; j < i; j++)
            if (rs[i] == rs[j]) return false;
    return true;
}

/* Layer l's attention or indexer compressor of state st. */
static compressor_state *comp_of(ds4_state *st, int l, bool is_index) {
    return is_index ? &st->layers[l].index : &st->layers[l].attn;
}

/* compressor_pass for a batch whose rows are states of their own
 * (rows_own_states): the position biases, the rows into their states, then
 * the window ends, each step one call for all the states. */
static void compressor_states_batch(ds4_model *m, ds4_state *const *rs, int l, bool is_index, const ds4_weight *ape,
                                    const ds4_weight *norm, float *kv, float *sc, const int32_t *pos, int64_t n,
                                    float *row, ds4_numerics num, int64_t *n_rows) {
    ds4_backend *be = m->be;
    float *dst[2][OWN_STATES_MAX] = { { NULL } };
    const float *src[2][OWN_STATES_MAX] = { { NULL } };
    int64_t at[OWN_STATES_MAX] = { 0 }, width = 0;
    for (int64_t t = 0; t < n; t++) {
        compressor_state *cs = comp_of(rs[t], l, is_index);
        width = cs->coff * cs->dim;
        at[t] = pos[t] % cs->ratio;
        const int64_t r = comp_state_row(cs, pos[t]);
        dst[0][t] = cs->state_kv + r * width, src[0][t] = kv + t * width;
        dst[1][t] = cs->state_sc + r * width, src[1][t] = sc + t * width;
    }
    be->ops->add_weight_rows_at(be, sc, ape, at, n);
    be->ops->copy_rows(be, dst[0], src[0], width, n);
    be->ops->copy_rows(be, dst[1], src[1], width, n);
    /* the states whose windows end here: pooled, normalised, rotated and
     * rounded as one block of rows (in `row`), each kept row copied to its
     * state's compressed rows, ratio 4's current windows made the previous */
    int64_t e_t[OWN_STATES_MAX], ne = 0, dim = 0;
    for (int64_t t = 0; t < n; t++) {
        compressor_state *cs = comp_of(rs[t], l, is_index);
        if ((pos[t] + 1) % cs->ratio == 0) e_t[ne++] = t;
        dim = cs->dim;
    }
    if (ne > 0) {
        const float *pk[OWN_STATES_MAX] = { NULL }, *ps[OWN_STATES_MAX] = { NULL };
        float *kd[OWN_STATES_MAX] = { NULL }, *sd[OWN_STATES_MAX] = { NULL };
        const float *kept_src[OWN_STATES_MAX] = { NULL }, *k4[OWN_STATES_MAX] = { NULL }, *s4[OWN_STATES_MAX] = { NULL };
        float *kept_dst[OWN_STATES_MAX] = { NULL };
        int32_t first[OWN_STATES_MAX];
        int64_t n_kept = 0;
        int ratio = 0;
        for (int64_t e = 0; e < ne; e++) {
            compressor_state *cs = comp_of(rs[e_t[e]], l, is_index);
            ratio = cs->ratio;
            pk[e] = cs->state_kv, ps[e] = cs->state_sc;
            first[e] = (int32_t)(pos[e_t[e]] + 1 - ratio);
            if (cs->n_rows < cs->cap) { /* (else made and dropped, as compressor_emit does) */
                kept_dst[n_kept] = cs->rows + cs->n_rows * dim, kept_src[n_kept++] = row + e * dim;
                cs->n_rows++;
            }
            kd[e] = cs->state_kv, k4[e] = cs->state_kv + 4 * width;
            sd[e] = cs->state_sc, s4[e] = cs->state_sc + 4 * width;
        }
        be->ops->compressor_pool_states(be, pk, ps, ratio, dim, ne, row);
        compressor_rows(m, -1, -1, norm, is_index, row, ne, dim, first, num); /* (no taps on this path) */
        be->ops->copy_rows(be, kept_dst, kept_src, dim, n_kept);
        if (ratio == 4) { /* the current window becomes the previous one */
            be->ops->copy_rows(be, kd, k4, 4 * width, ne);
            be->ops->copy_rows(be, sd, s4, 4 * width, ne);
        }
    }
    for (int64_t t = 0; t < n; t++)
        n_rows[t] = comp_of(rs[t], l, is_index)->n_rows;
}

/* compressor_pass token by token: each run of consecutive positions of one
 * state within one window stored in one copy, each window end emitted. */
static void compressor_each(ds4_model *m, ds4_state *const *rs, int l, bool is_index, const ds4_weight *ape,
                            const ds4_weight *norm, float *kv, float *sc, const int32_t *pos, int64_t n, float *row,
                            ds4_numerics num, int64_t *n_rows) {
    ds4_backend *be = m->be;
    int64_t run = 0; /* first row of the run not yet stored */
    for (int64_t t = 0; t < n; t++) {
        compressor_state *cs = comp_of(rs[t], l, is_index);
        const int ratio = cs->ratio;
        const int64_t width = cs->coff * cs->dim, p = pos[t];
        float *sc_t = sc + t * width;
        if (ape) be->ops->add_weight_row(be, sc_t, ape, p % ratio, 1); /* (NULL: its product added it) */
        TAP(is_index ? "idx_comp_score" : "comp_score", l, t, sc_t, width);
        const bool window_end = (p + 1) % ratio == 0;
        if (window_end || t + 1 == n || rs[t + 1] != rs[t] || pos[t + 1] != p + 1) {
            /* rows run .. t: consecutive positions of one window, so consecutive state rows */
            const int64_t r = comp_state_row(cs, pos[run]), k = t + 1 - run;
            float *dkv = cs->state_kv + r * width, *dsc = cs->state_sc + r * width;
            /* a single decoded token's projections were written to their state row (no copy) */
            if (kv + run * width != dkv) be->ops->copy(be, dkv, kv + run * width, k * width);
            if (sc + run * width != dsc) be->ops->copy(be, dsc, sc + run * width, k * width);
            if (window_end) compressor_emit(m, l, t, cs, norm, is_index, p, row, num);
            run = t + 1;
        }
        n_rows[t] = cs->n_rows;
    }
}

/* (ape NULL: one row, n 1, whose score row got its APE row from its
 * product; that takes compressor_each) */
static void compressor_pass(ds4_model *m, ds4_state *const *rs, int l, bool is_index, const ds4_weight *ape,
                            const ds4_weight *norm, float *kv, float *sc, const int32_t *pos, int64_t n,
                            float *row, ds4_numerics num, int64_t *n_rows) {
    bool one_run = n > 1 && !m->tap && !m->comp_per_token;
    for (int64_t t = 1; one_run && t < n; t++) one_run = rs[t] == rs[0] && pos[t] == pos[0] + t;
    if (one_run) {
        compressor_chunk(m, comp_of(rs[0], l, is_index), ape, norm, is_index, kv, sc, pos[0], n, num, n_rows);
        return;
    }
    if (rows_own_states(m, rs, n))
        compressor_states_batch(m, rs, l, is_index, ape, norm, kv, sc, pos, n, row, num, n_rows);
    else
        compressor_each(m, rs, l, is_index, ape, norm, kv, sc, pos, n, row, num, n_rows);
}

/* The indexer queries of batch rows t .. n-1: up-projection of the low-rank
 * q, RoPE, and (DS4 numerics) the QAT rounding. */
static void idx_queries(ds4_model *m, int l, scratch *s, int64_t t, int64_t n, const int32_t *pos, const ds4_rope *rope,
                        ds4_numerics num) {
    ds4_backend *be = m->be;
    const ds4_config *c = &m->cfg;
    const int64_t ih = c->idx_n_head, id = c->idx_head_dim, qr = c->q_lora, m_rows = n - t;
    float *iq = s->iq + t * ih * id;
    be->ops->matmul(be, &m->layers[l].idx_q_b, 0, ih * id, s->qr + t * qr, qr, iq, ih * id, m_rows, num);
    TAP_ROWS("idx_q", l, t, m_rows, iq, ih * id);
    be->ops->rope_tail(be, iq, m_rows, ih, id, &pos[t], rope, false);
    TAP_ROWS("idx_q_rope", l, t, m_rows, iq, ih * id);
    if (ds4_numerics_rounds(num)) {
        be->ops->indexer_qat(be, iq, m_rows * ih, id);
        TAP_ROWS("idx_q_qat", l, t, m_rows, iq, ih * id);
    }
}

/* head weights times 1/sqrt(id * ih) (spec 3.6.3), applied by the indexer score ops */
static float idx_weight_scale(const ds4_config *c) {
    return (float)(1.0 / sqrt((double)c->idx_head_dim * (double)c->idx_n_head));
}

/* Batch row t of layer l (state layer Lr) attends: with the indexer's
 * top-k selection of the compressed rows when it sees more of them than
 * that (its query made first for rows t .. n-1 if not yet: a later row of
 * the same state has at least as many compressed rows; a row of another
 * state may not need its query), else with every compressed row. */
static void attend_row(ds4_model *m, int l, scratch *s, layer_state *Lr, int64_t t, int64_t n, const int32_t *pos,
                       const ds4_rope *rope, ds4_numerics num, bool *iq_made) {
    ds4_backend *be = m->be;
    const ds4_config *c = &m->cfg;
    const layer_weights *W = &m->layers[l];
    const int ratio = c->compress_ratio[l];
    const int64_t D = c->head_dim, nh = c->n_head, ih = c->idx_n_head, id = c->idx_head_dim;
    const int32_t *sel = NULL; /* backend memory */
    const int64_t n_rows_b = ratio ? s->n_comp[t] : 0;
    int64_t n_b = n_rows_b;
    if (ratio == 4 && n_b > c->idx_top_k) {
        if (!*iq_made) {
            idx_queries(m, l, s, t, n, pos, rope, num);
            *iq_made = true;
        }
        be->ops->indexer_scores(be, s->iq + t * ih * id, s->iw + t * ih, idx_weight_scale(c), ih, id, Lr->index.rows,
                                s->n_index[t], s->iscores);
        TAP("idx_scores", l, t, s->iscores, s->n_index[t]);
        /* both compressors emit a row every 4 tokens: the indexer's rows
         * number the attention compressor's rows */
        be->ops->top_k(be, s->iscores, s->n_index[t], c->idx_top_k, (int32_t *)s->topk);
        tap_ints(m, "idx_top_k", l, t, s->topk, c->idx_top_k);
        sel = (const int32_t *)s->topk;
        n_b = c->idx_top_k;
    }
    be->ops->attention(be, s->q + t * nh * D, nh, D, Lr->window + s->win_off[t] * D, s->win_n[t],
                       ratio ? Lr->attn.rows : NULL, n_rows_b, sel, n_b, &W->sinks, s->attn + t * nh * D);
    TAP("attention", l, t, s->attn + t * nh * D, nh * D);
}

/* Whether a prefill's rows attend through attention_rows_f16: under DS4
 * numerics the key/value rows are F16-rounded, so a backend that has the
 * op may read them so. */
static bool rows_f16(const ds4_backend *be, ds4_numerics num) {
    return ds4_numerics_rounds(num) && be->ops->attention_rows_f16;
}

/* Rows tb .. t1 - 1 of one state (layer Lr), which all select: their
 * scores, selections and attention for batches of rows at once
 * (m->idx_batch: 0 the scratch's batch, else at most that many rows; no
 * inspection hook on this path). */
static void attend_rows_selected(ds4_model *m, int l, scratch *s, layer_state *Lr, int64_t tb, int64_t t1, int64_t n,
                                 const int32_t *pos, const ds4_rope *rope, ds4_numerics num, bool *iq_made) {
    ds4_backend *be = m->be;
    const ds4_config *c = &m->cfg;
    const layer_weights *W = &m->layers[l];
    const int64_t D = c->head_dim, nh = c->n_head, ih = c->idx_n_head, id = c->idx_head_dim, k = c->idx_top_k;
    const int64_t per = m->idx_batch > 0 && m->idx_batch < s->sel_rows ? m->idx_batch : s->sel_rows;
    if (!*iq_made) {
        idx_queries(m, l, s, tb, n, pos, rope, num);
        *iq_made = true;
    }
    const float wscale = idx_weight_scale(c);
    for (int64_t u0 = tb; u0 < t1; u0 += per) {
        const int64_t cnt = t1 - u0 < per ? t1 - u0 : per;
        /* under DS4 numerics the queries and rows are QAT'd (the rows F16-rounded): binary16 values */
        (ds4_numerics_rounds(num) && be->ops->indexer_scores_rows_f16 ? be->ops->indexer_scores_rows_f16
                                                                     : be->ops->indexer_scores_rows)(
            be, s->iq + u0 * ih * id, s->iw + u0 * ih, wscale, ih, id, Lr->index.rows, s->n_index + u0, cnt,
            s->iscores, s->score_stride);
        be->ops->top_k_rows(be, s->iscores, s->score_stride, s->n_index + u0, cnt, k, (int32_t *)s->topk);
        (rows_f16(be, num) ? be->ops->attention_rows_f16 : be->ops->attention_rows_sel)(
            be, s->q + u0 * nh * D, cnt, nh, D, Lr->window, s->win_off + u0, s->win_n + u0, Lr->attn.rows,
            s->n_comp + u0, (const int32_t *)s->topk, k, &W->sinks, s->attn + u0 * nh * D);
    }
}

/* A batch of states of their own (rows_own_states): the rows marked plain
 * (no selection), each with its own window and compressed rows, attend in
 * one call per block of such rows. */
static void attend_plain_states(ds4_model *m, ds4_state *const *rs, int l, scratch *s, const bool *plain, int64_t n) {
    ds4_backend *be = m->be;
    const ds4_config *c = &m->cfg;
    const int ratio = c->compress_ratio[l];
    const int64_t D = c->head_dim, nh = c->n_head;
    for (int64_t t0 = 0; t0 < n;) {
        if (!plain[t0]) {
            t0++;
            continue;
        }
        int64_t t1 = t0 + 1;
        while (t1 < n && plain[t1]) t1++;
        const float *ra[OWN_STATES_MAX] = { NULL }, *rb[OWN_STATES_MAX] = { NULL };
        for (int64_t t = t0; t < t1; t++) {
            const layer_state *Lt = &rs[t]->layers[l];
            ra[t] = Lt->window + s->win_off[t] * D;
            rb[t] = ratio ? Lt->attn.rows : NULL;
        }
        be->ops->attention_states(be, s->q + t0 * nh * D, t1 - t0, nh, D, ra + t0, s->win_n + t0, rb + t0,
                                  s->n_comp + t0, &m->layers[l].sinks, s->attn + t0 * nh * D);
        t0 = t1;
    }
}

/* ------------------------------------------------------------ sublayer boundaries */

/* HC state X -> X2, then X2 is the state (the buffers swap). */
static void state_advance(scratch *s) {
    float *tmp = s->X;
    s->X = s->X2;
    s->X2 = tmp;
}

/* The residual step left pending (sublayer_output), as its ops: y (+ y2),
 * hc_post, the state advances. */
static void sublayer_flush(ds4_model *m, scratch *s, int64_t n) {
    if (!s->post_pending) return;
    ds4_backend *be = m->be;
    const int64_t H = m->cfg.n_embd;
    if (s->post_y2) be->ops->add(be, s->y, s->post_y2, s->y, n * H);
    be->ops->hc_post(be, &m->hc, s->y, s->X, s->post, s->comb, s->X2, n);
    state_advance(s);
    s->post_pending = false;
    s->post_y2 = NULL;
}

/* A sublayer's input from the state: x, its norm a, and the HC mix
 * (post, comb), after the residual step the sublayer before left pending,
 * in one op with it. */
static void sublayer_input(ds4_model *m, scratch *s, const ds4_weight *fn, const ds4_weight *scale,
                           const ds4_weight *base, const ds4_weight *norm, int64_t n) {
    ds4_backend *be = m->be;
    const float eps = m->cfg.rms_eps;
    if (s->post_pending) {
        be->ops->hc_post_pre_norm(be, &m->hc, s->y, s->post_y2, s->X, s->post, s->comb, s->X2, fn, scale, base,
                                  norm, eps, s->x, s->post, s->comb, s->a, n);
        state_advance(s);
        s->post_pending = false;
        s->post_y2 = NULL;
        return;
    }
    be->ops->hc_pre_norm(be, &m->hc, s->X, fn, scale, base, norm, eps, s->x, s->post, s->comb, s->a, n);
}

/* A sublayer's output y (the FFN's: y + y2, y2 its routed experts' sum) into
 * the state. Without an inspection hook the residual step is left pending,
 * for the next sublayer's input (or sublayer_flush) to make with it; with
 * one it is made now, so the hook sees each step ("ffn_sum", "attn_X" /
 * "ffn_X"). */
static void sublayer_output(ds4_model *m, int l, scratch *s, const float *y2, int64_t n) {
    const int64_t H = m->cfg.n_embd;
    s->post_pending = true;
    s->post_y2 = y2;
    if (!m->tap) return;
    if (y2) {
        m->be->ops->add(m->be, s->y, y2, s->y, n * H);
        for (int64_t t = 0; t < n; t++) TAP("ffn_sum", l, t, s->y + t * H, H);
        s->post_y2 = NULL;
    }
    sublayer_flush(m, s, n);
    TAP(y2 ? "ffn_X" : "attn_X", l, -1, s->X, n * m->cfg.n_hc * H);
}

/* The weights of the products ahead, for a backend that can bring them in
 * beside the ops before them (backend.h's prefetch). */
static void prefetch(ds4_model *m, const ds4_weight *const *w, int n) {
    if (m->be->ops->prefetch) m->be->ops->prefetch(m->be, w, n);
}

/* Row t of the batch belongs to state rs[t] (at position pos[t]): a prefill
 * chunk has one state for every row, a batched decode one state per row. */
static void attention_sublayer(ds4_model *m, ds4_state *const *rs, int l, scratch *s, const int32_t *pos, int64_t n,
                               ds4_numerics num) {
    ds4_backend *be = m->be;
    const ds4_config *c = &m->cfg;
    const layer_weights *W = &m->layers[l];
    const int64_t H = c->n_embd, D = c->head_dim, nh = c->n_head, qr = c->q_lora;
    const int ratio = c->compress_ratio[l];
    const ds4_rope *rope = ratio ? &m->rope_comp : &m->rope_dense;

    /* the normed input's products first (their weights come in beside the
     * HC mix), then q_b's */
    {
        const ds4_weight *pw[7] = { &W->q_a, &W->kv };
        int np = 2;
        if (ratio) pw[np++] = &W->comp_kv, pw[np++] = &W->comp_gate;
        if (ratio == 4) pw[np++] = &W->idx_kv, pw[np++] = &W->idx_gate, pw[np++] = &W->idx_proj;
        prefetch(m, pw, np);
    }
    sublayer_input(m, s, &W->hc_attn_fn, &W->hc_attn_scale, &W->hc_attn_base, &W->attn_norm, n);
    TAP("attn_hc_x", l, -1, s->x, n * H);
    TAP("attn_hc_post", l, -1, s->post, n * c->n_hc);
    TAP("attn_hc_comb", l, -1, s->comb, n * c->n_hc * c->n_hc);
    TAP("attn_norm", l, -1, s->a, n * H);
    /* One decoded token of one state writes its KV row and compressor
     * projections straight into the state (window slot, compressor state
     * rows); a chunk or a batch of states goes through the scratch rows. */
    const bool direct = n == 1;
    layer_state *L0 = &rs[0]->layers[l];
    const int64_t cw = (ratio == 4 ? 2 : 1) * D, iw = 2 * c->idx_head_dim;
    float *kv = direct ? window_slot(be, c, L0) : s->kv;
    /* (after the room compressor_chunk copies state rows into) */
    float *ckv = s->ckv + COMP_PRE * D, *csc = s->csc + COMP_PRE * D, *ikv = s->ikv + 8 * iw, *isc = s->isc + 8 * iw;
    if (direct && ratio) {
        const int64_t r = comp_state_row(&L0->attn, pos[0]);
        ckv = L0->attn.state_kv + r * cw;
        csc = L0->attn.state_sc + r * cw;
    }
    if (direct && ratio == 4) {
        const int64_t r = comp_state_row(&L0->index, pos[0]);
        ikv = L0->index.state_kv + r * iw;
        isc = L0->index.state_sc + r * iw;
    }
    /* every product of the normed input in one call: q low rank, kv, and
     * the compressor and indexer projections */
    /* (one decoded token without an inspection hook: each score row's APE
     * row is added by its product, not by the compressor pass after it) */
    const bool ape_added = direct && !m->tap;
    ds4_product prod[7] = {
        { .w = &W->q_a, .n_out = qr, .out = s->qr, .out_stride = qr },
        { .w = &W->kv, .n_out = D, .out = kv, .out_stride = D },
    };
    int n_prod = 2;
    if (ratio) {
        prod[n_prod++] = (ds4_product){ .w = &W->comp_kv, .n_out = cw, .out = ckv, .out_stride = cw };
        prod[n_prod++] = (ds4_product){ .w = &W->comp_gate, .n_out = cw, .out = csc, .out_stride = cw,
                                        .add = ape_added ? &W->comp_ape : NULL, .add_row = pos[0] % ratio };
    }
    if (ratio == 4) {
        prod[n_prod++] = (ds4_product){ .w = &W->idx_kv, .n_out = iw, .out = ikv, .out_stride = iw };
        prod[n_prod++] = (ds4_product){ .w = &W->idx_gate, .n_out = iw, .out = isc, .out_stride = iw,
                                        .add = ape_added ? &W->idx_ape : NULL, .add_row = pos[0] % ratio };
        prod[n_prod++] = (ds4_product){ .w = &W->idx_proj, .n_out = c->idx_n_head, .out = s->iw,
                                        .out_stride = c->idx_n_head };
    }
    /* the compressor and indexer projections (all but q_a and kv) may run
     * on a side branch of a recorded step, beside q's chain up to the
     * compressor pass: they read only the normed input and write only their
     * own rows, which nothing reads before the join */
    const bool side = ratio && !m->tap && m->attn_branch && be->ops->branch_begin;
    be->ops->matmul_multi(be, prod, side ? 2 : n_prod, s->a, H, n, num);
    if (side) {
        be->ops->branch_begin(be);
        be->ops->matmul_multi(be, prod + 2, n_prod - 2, s->a, H, n, num);
        be->ops->branch_end(be);
    }
    /* q: low rank, norm, up, per-head plain norm, RoPE */
    TAP("q_a", l, -1, s->qr, n * qr);
    be->ops->rmsnorm(be, s->qr, &W->q_a_norm, c->rms_eps, s->qr, n, qr);
    TAP("q_a_norm", l, -1, s->qr, n * qr);
    /* one decoded token that will select (its compressed rows, this
     * token's included, may pass top_k): its indexer queries, which read
     * only the normed low-rank q, on a second branch beside the first and
     * q's chain (attend_row finds them made); nothing reads them before the
     * join */
    bool iq_made = false;
    if (side && direct && ratio == 4 && m->iq_branch && L0->attn.n_rows + 1 > c->idx_top_k) {
        be->ops->branch_begin(be);
        idx_queries(m, l, s, 0, n, pos, rope, num);
        be->ops->branch_end(be);
        iq_made = true;
    }
    be->ops->matmul(be, &W->q_b, 0, nh * D, s->qr, qr, s->q, nh * D, n, num);
    TAP("q_b", l, -1, s->q, n * nh * D);
    { /* the output products' weights, beside the norms, compressors and attention */
        const ds4_weight *pw[2] = { &W->out_a, &W->out_b };
        prefetch(m, pw, 2);
    }
    /* the per-head norm and RoPE of q, then of kv with its FP8 and F16
     * rounding: both in one call (head_norm_rope2) where the backend has
     * it, else each in one (head_norm_rope), unless an inspection hook
     * wants the steps in between */
    const bool steps = m->tap || rope->n_rot != c->n_rot;
    const bool both = !steps && be->ops->head_norm_rope2; /* q's and kv's in one call */
    if (both) {
        const ds4_head_rows hq = { s->q, nh, NULL, false }, hkv = { kv, 1, &W->kv_norm, ds4_numerics_rounds(num) };
        be->ops->head_norm_rope2(be, &hq, &hkv, n, D, c->rms_eps, pos, rope);
    } else if (steps) {
        be->ops->rmsnorm(be, s->q, NULL, c->rms_eps, s->q, n * nh, D);
        TAP("q_head_norm", l, -1, s->q, n * nh * D);
        be->ops->rope_tail(be, s->q, n, nh, D, pos, rope, false);
    } else {
        be->ops->head_norm_rope(be, s->q, n, nh, D, NULL, c->rms_eps, pos, rope, false);
    }
    TAP("q_rope", l, -1, s->q, n * nh * D);
    /* kv: projection (above), norm, RoPE, FP8 */
    TAP("kv", l, -1, kv, n * D);
    if (steps) {
        be->ops->rmsnorm(be, kv, &W->kv_norm, c->rms_eps, kv, n, D);
        TAP("kv_norm", l, -1, kv, n * D);
        be->ops->rope_tail(be, kv, n, 1, D, pos, rope, false);
        TAP("kv_rope", l, -1, kv, n * D);
        if (ds4_numerics_rounds(num)) {
            be->ops->round_fp8_kv(be, kv, n, D, c->n_rot);
            TAP("kv_fp8", l, -1, kv, n * D);
            be->ops->round_f16(be, kv, n * D); /* stored F16-rounded (CPU semantics) */
            TAP("kv_f16", l, -1, kv, n * D);
        }
    } else if (!both) {
        be->ops->head_norm_rope(be, kv, n, 1, D, &W->kv_norm, c->rms_eps, pos, rope, ds4_numerics_rounds(num));
    }
    /* compressor and indexer projections (above), batched */
    if (ratio) {
        TAP("comp_kv", l, -1, ckv, n * cw);
        TAP("comp_gate", l, -1, csc, n * cw);
    }
    if (ratio == 4) {
        TAP("idx_comp_kv", l, -1, ikv, n * iw);
        TAP("idx_comp_gate", l, -1, isc, n * iw);
        TAP("idx_proj", l, -1, s->iw, n * c->idx_n_head);
    }
    /* the compressors over the whole batch, then token by token: window
     * push, indexer and attention; the indexer queries of the rows from the
     * first that needs them on are made in one batch */
    if (side) be->ops->branch_join(be);
    if (ratio)
        compressor_pass(m, rs, l, false, ape_added ? NULL : &W->comp_ape, &W->comp_norm, ckv, csc, pos, n, s->crow,
                        num, s->n_comp);
    else
        for (int64_t t = 0; t < n; t++) s->n_comp[t] = 0;
    if (ratio == 4)
        compressor_pass(m, rs, l, true, ape_added ? NULL : &W->idx_ape, &W->idx_norm, ikv, isc, pos, n, s->crow,
                        num, s->n_index);
    const int64_t Wn = c->sliding_window;
    /* a batch of states: every row's KV row into its own window in one call */
    const bool own = !direct && rows_own_states(m, rs, n);
    bool plain[OWN_STATES_MAX] = { false }; /* own: rows that attend without a selection, in one call below */
    if (own) {
        float *dst[OWN_STATES_MAX] = { NULL };
        const float *src[OWN_STATES_MAX] = { NULL };
        for (int64_t t = 0; t < n; t++) dst[t] = window_slot(be, c, &rs[t]->layers[l]), src[t] = kv + t * D;
        be->ops->copy_rows(be, dst, src, D, n);
    }
    for (int64_t t0 = 0; t0 < n;) {
        /* a run of rows of one state at consecutive positions whose window
         * slots follow one another (the window does not move in between):
         * their KV rows go into the window in one copy, then each row
         * attends with the window as it stood after its own row (the rows
         * after it lie past the end of that view) */
        layer_state *Lr = &rs[t0]->layers[l];
        int64_t t1 = t0 + 1;
        if (direct || own) { /* (own: its slot was taken and filled above) */
            window_commit(Lr);
        } else {
            float *slot = window_slot(be, c, Lr);
            const int64_t first = Lr->win_start + Lr->n_window;
            while (t1 < n && rs[t1] == rs[t0] && pos[t1] == pos[t1 - 1] + 1 && first + (t1 - t0) < 2 * Wn) t1++;
            be->ops->copy(be, slot, kv + t0 * D, (t1 - t0) * D);
            window_commit(Lr);
        }
        for (int64_t t = t0; t < t1; t++) { /* each row's view of the window */
            if (t > t0) { /* what window_slot does for the next slot when the window does not move */
                window_drop_full(c, Lr);
                window_commit(Lr);
            }
            s->win_off[t] = Lr->win_start;
            s->win_n[t] = Lr->n_window;
        }
        /* the rows before the first that needs the indexer's selection (a
         * later row of the run sees at least as many compressed rows) attend
         * in one call, every compressed row they see taking part */
        int64_t tb = t0;
        while (tb < t1 && !(ratio == 4 && s->n_comp[tb] > c->idx_top_k)) tb++;
        if (tb > t0 && own) { /* (a run of one row) */
            plain[t0] = true;
        } else if (tb > t0) {
            if (rows_f16(be, num))
                be->ops->attention_rows_f16(be, s->q + t0 * nh * D, tb - t0, nh, D, Lr->window, s->win_off + t0,
                                            s->win_n + t0, ratio ? Lr->attn.rows : NULL, s->n_comp + t0, NULL, 0,
                                            &W->sinks, s->attn + t0 * nh * D);
            else
                be->ops->attention_rows(be, s->q + t0 * nh * D, tb - t0, nh, D, Lr->window, s->win_off + t0,
                                        s->win_n + t0, ratio ? Lr->attn.rows : NULL, s->n_comp + t0, &W->sinks,
                                        s->attn + t0 * nh * D);
            TAP_ROWS("attention", l, t0, tb - t0, s->attn + t0 * nh * D, nh * D);
        }
        /* rows tb .. t1 - 1 all select (a later row of the run sees at least
         * as many compressed rows): without an inspection hook, their scores
         * and selections are made for batches of rows at once */
        if (ratio == 4 && t1 - tb > 1 && !m->tap && m->idx_batch >= 0) {
            attend_rows_selected(m, l, s, Lr, tb, t1, n, pos, rope, num, &iq_made);
            tb = t1;
        }
        for (int64_t t = tb; t < t1; t++) attend_row(m, l, s, Lr, t, n, pos, rope, num, &iq_made);
        t0 = t1;
    }
    if (own) attend_plain_states(m, rs, l, s, plain, n);
    /* the inverse RoPE of the attention output, then the grouped low-rank
     * output: group g reads heads g*nh/G .. (g+1)*nh/G - 1 (its nh*D/G
     * columns of each row) through its ro rows of out_a; in one call where
     * the backend has it, unless an inspection hook wants the rotated rows */
    const int64_t G = c->o_groups, ro = c->o_lora;
    if (!m->tap && be->ops->rope_matmul_grouped) {
        be->ops->rope_matmul_grouped(be, &W->out_a, G, ro, s->attn, nh, D, pos, rope, s->low, G * ro, n, num);
    } else {
        be->ops->rope_tail(be, s->attn, n, nh, D, pos, rope, true);
        TAP("attn_rope_inv", l, -1, s->attn, n * nh * D);
        be->ops->matmul_grouped(be, &W->out_a, G, ro, s->attn, nh * D, s->low, G * ro, n, num);
    }
    TAP("attn_out_a", l, -1, s->low, n * G * ro);
    be->ops->matmul(be, &W->out_b, 0, H, s->low, G * ro, s->y, H, n, num);
    TAP("attn_out_b", l, -1, s->y, n * H);
    sublayer_output(m, l, s, NULL, n);
}

static void ffn_sublayer(ds4_model *m, int l, scratch *s, const int32_t *tokens, int64_t n, ds4_numerics num) {
    ds4_backend *be = m->be;
    const ds4_config *c = &m->cfg;
    const layer_weights *W = &m->layers[l];
    const int64_t H = c->n_embd, I = c->n_ff, E = c->n_expert;
    const int k = c->n_expert_used;
    const float limit = c->swiglu_limit[l];

    { /* the shared expert's and the router's weights, beside the HC mix */
        const ds4_weight *pw[4] = { &W->gate_sh, &W->up_sh, &W->gate_inp, &W->down_sh };
        prefetch(m, pw, 4);
    }
    sublayer_input(m, s, &W->hc_ffn_fn, &W->hc_ffn_scale, &W->hc_ffn_base, &W->ffn_norm, n);
    TAP("ffn_hc_x", l, -1, s->x, n * H);
    TAP("ffn_hc_post", l, -1, s->post, n * c->n_hc);
    TAP("ffn_hc_comb", l, -1, s->comb, n * c->n_hc * c->n_hc);
    TAP("ffn_norm", l, -1, s->a, n * H);
    /* the shared expert, a side branch of a recorded step: it reads s->a
     * and writes s->g, s->u and s->y, which the routed experts' ops do not
     * touch, so it may run beside them until the join before s->y is read */
    if (be->ops->branch_begin) be->ops->branch_begin(be);
    const ds4_product prod[2] = {
        { .w = &W->gate_sh, .n_out = I, .out = s->g, .out_stride = I },
        { .w = &W->up_sh, .n_out = I, .out = s->u, .out_stride = I },
    };
    be->ops->matmul_multi(be, prod, 2, s->a, H, n, num);
    TAP("shexp_gate", l, -1, s->g, n * I);
    TAP("shexp_up", l, -1, s->u, n * I);
    be->ops->swiglu(be, s->g, s->u, limit, 1.0f, s->g, n * I);
    TAP("shexp_swiglu", l, -1, s->g, n * I);
    be->ops->matmul(be, &W->down_sh, 0, H, s->g, I, s->y, H, n, num);
    TAP("shexp_down", l, -1, s->y, n * H);
    if (be->ops->branch_end) be->ops->branch_end(be);
    be->ops->matmul(be, &W->gate_inp, 0, E, s->a, H, s->logits_e, E, n, num);
    TAP("router_logits", l, -1, s->logits_e, n * E);
    /* routed experts: each token routes on its own, but the whole batch is
     * one router call and one moe call (hash layers: each token's row of
     * tid2eid, gathered on the host) */
    const int32_t *hash = NULL;
    if (W->tid2eid.host) {
        for (int64_t t = 0; t < n; t++)
            memcpy(s->hash_ids + t * k, (const int32_t *)W->tid2eid.host + (int64_t)tokens[t] * k,
                   (size_t)k * sizeof(int32_t));
        hash = s->hash_ids;
    }
    be->ops->router(be, s->logits_e, E, W->has_bias ? &W->probs_bias : NULL, hash, k, c->expert_weights_norm,
                    c->expert_weights_scale, (int32_t *)s->sel, s->sel_w, n);
    for (int64_t t = 0; t < n; t++) {
        tap_ints(m, "router_experts", l, t, s->sel + t * k, k);
        TAP("router_weights", l, t, s->sel_w + t * k, k);
    }
    be->ops->moe(be, &W->gate_exps, &W->up_exps, &W->down_exps, s->a, (const int32_t *)s->sel, s->sel_w, k, limit,
                 s->moe, n, num);
    for (int64_t t = 0; t < n; t++) TAP("moe", l, t, s->moe + t * H, H);
    if (be->ops->branch_join) be->ops->branch_join(be);
    sublayer_output(m, l, s, s->moe, n);
}

/* ------------------------------------------------------------ eval */

/* n rows: row t is token tokens[t] of state rs[t] at position pos[t]. The
 * caller advances the states. `step`: the rows are decoded tokens (one per
 * state), recorded as one step when the backend records. The head's output
 * goes to `logits` (host) when non-NULL, and the greedy next token of each
 * row whose logits are wanted to `greedy` (host int32), found by the
 * backend, when non-NULL. */
static void eval_chunk(ds4_model *m, ds4_state *const *rs, const int32_t *pos, const int32_t *tokens, int64_t n,
                       ds4_numerics num, float *logits, int32_t *greedy, bool all_logits, bool decode, scratch *s) {
    ds4_backend *be = m->be;
    const ds4_config *c = &m->cfg;
    const int64_t H = c->n_embd, V = c->n_vocab;

    /* decoded tokens are one recorded step (without an inspection hook,
     * which reads buffers between ops) */
    const bool step = decode && !m->tap && be->ops->step_begin && be->ops->step_end;
    /* binary16 products (DS4_F16) are a prompt chunk's: decoded tokens, and
     * the head (DS4's CUDA prefill keeps its Q8_0 activations), are DS4's */
    const ds4_numerics head_num = ds4_numerics_decode(num);
    if (decode) num = head_num;
    if (step) be->ops->step_begin(be);
    s->post_pending = false;
    s->post_y2 = NULL;
    /* embedding, copied into every HC stream */
    be->ops->embed(be, &m->token_embd, tokens, (int)n, s->x);
    TAP("embed", -1, -1, s->x, n * H);
    be->ops->repeat_rows(be, s->X, s->x, n, H, c->n_hc);

    const int n_layer = m->layer_limit ? m->layer_limit : c->n_layer;
    const int prof_end = m->prof_n ? (m->prof_first + m->prof_n < n_layer ? m->prof_first + m->prof_n : n_layer) : -1;
    for (int l = 0; l < n_layer; l++) {
        if (l == m->prof_first && l < prof_end) ds4_backend_profiler_range(be, true);
        attention_sublayer(m, rs, l, s, pos, n, num);
        ffn_sublayer(m, l, s, tokens, n, num);
        if (l + 1 == prof_end && l >= m->prof_first) ds4_backend_profiler_range(be, false);
        if (step && be->ops->step_mark) be->ops->step_mark(be); /* the device may start on the layers so far */
    }
    sublayer_flush(m, s, n); /* the last layer's residual step */
    /* head: only the rows whose logits are wanted */
    int64_t first = all_logits ? 0 : n - 1, rows = n - first;
    if ((logits || greedy) && m->layer_limit) {
        if (step) be->ops->step_end(be);
        if (logits) memset(logits, 0, (size_t)(rows * V) * sizeof *logits); /* layers only: no head */
        if (greedy) memset(greedy, 0, (size_t)rows * sizeof *greedy);
    } else if (logits || greedy) {
        be->ops->hc_head(be, &m->hc, s->X + first * c->n_hc * H, &m->out_hc_fn, &m->out_hc_scale, &m->out_hc_base,
                         s->h, rows);
        TAP("hc_head", -1, -1, s->h, rows * H);
        be->ops->rmsnorm(be, s->h, &m->out_norm, c->rms_eps, s->h, rows, H);
        TAP("out_norm", -1, -1, s->h, rows * H);
        be->ops->matmul(be, &m->output, 0, V, s->h, H, s->logits, V, rows, head_num);
        TAP("logits", -1, -1, s->logits, rows * V);
        /* the first maximum of each row (top_k of 1 ranks as ds4_sample_argmax does) */
        if (greedy)
            for (int64_t r = 0; r < rows; r++) be->ops->top_k(be, s->logits + r * V, V, 1, (int32_t *)s->next + r);
        if (step) be->ops->step_end(be);
        if (logits) be->ops->download(be, logits, s->logits, rows * V);
        if (greedy) be->ops->download(be, (float *)greedy, s->next, rows); /* int32 bits (backend.h) */
    } else if (step) {
        be->ops->step_end(be);
    }
}

static void slot_free(ds4_backend *be, scratch_slot *slot) {
    if (slot->s) {
        scratch_free(be, slot->s);
        free(slot->s);
    }
    memset(slot, 0, sizeof *slot);
}

/* A scratch in `slot` for chunks of `rows` tokens and states of up to n_ctx
 * positions (reallocated when it is smaller). */
static ds4_status ensure_scratch(ds4_model *m, scratch_slot *slot, int64_t rows, int64_t n_ctx, bool all_logits,
                                 ds4_error *err) {
    if (slot->s && slot->rows >= rows && slot->ctx >= n_ctx && (!all_logits || slot->all_logits)) return DS4_OK;
    slot_free(m->be, slot);
    scratch *fresh = calloc(1, sizeof *fresh);
    if (!fresh || !scratch_alloc(m->be, &m->cfg, rows, n_ctx, all_logits, fresh)) {
        free(fresh);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for a %lld-token batch", (long long)rows);
    }
    slot->s = fresh;
    slot->rows = rows;
    slot->ctx = n_ctx;
    slot->all_logits = all_logits;
    return DS4_OK;
}

static ds4_status eval_tokens(ds4_model *m, ds4_state *st, const int32_t *tokens, int64_t n, ds4_numerics num,
                              float *logits, int32_t *greedy, bool all_logits, ds4_error *err) {
    const ds4_config *c = &m->cfg;
    if (n < 1) return ds4_error_set(err, DS4_ERR_INVALID, "no tokens to evaluate");
    ds4_status status = ds4_backend_check_numerics(m->be, num, err);
    if (status) return status;
    if (st->pos + n > st->n_ctx)
        return ds4_error_set(err, DS4_ERR_INVALID, "%lld tokens at position %lld exceed the context of %lld",
                             (long long)n, (long long)st->pos, (long long)st->n_ctx);
    for (int64_t t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= c->n_vocab)
            return ds4_error_set(err, DS4_ERR_INVALID, "token %d at index %lld is outside the vocabulary (0..%lld)",
                                 tokens[t], (long long)t, (long long)c->n_vocab - 1);
    const int64_t max_chunk = ds4_model_eval_chunk(m), chunk = n < max_chunk ? n : max_chunk;
    st->greedy_logits = false; /* set again only by a greedy evaluation that completes */
    /* one row: the state's own scratch; several: the model's, and the state's
     * own keeps a greedy evaluation's logits (made before anything changes) */
    const bool own = n == 1;
    scratch_slot *slot = own ? &st->scratch : &m->chunk_scratch;
    status = ensure_scratch(m, slot, chunk, st->n_ctx, all_logits, err);
    if (!status && greedy && !own) status = ensure_scratch(m, &st->scratch, 1, st->n_ctx, false, err);
    if (status) return status;
    int32_t *pos = malloc((size_t)chunk * sizeof *pos);
    ds4_state **rs = malloc((size_t)chunk * sizeof *rs);
    if (!pos || !rs) {
        free(pos);
        free(rs);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    }
    for (int64_t t = 0; t < chunk; t++) rs[t] = st;
    for (int64_t off = 0; off < n; off += chunk) {
        int64_t len = n - off < chunk ? n - off : chunk;
        bool last = off + len == n;
        float *out = NULL;
        if (logits && all_logits) out = logits + off * c->n_vocab;
        else if (logits && last) out = logits;
        for (int64_t t = 0; t < len; t++) pos[t] = (int32_t)(st->pos + t);
        eval_chunk(m, rs, pos, tokens + off, len, num, out, last ? greedy : NULL, all_logits, own, slot->s);
        st->pos += len;
    }
    free(pos);
    free(rs);
    /* the last row's logits (at the start of the chunk's) stay with the state */
    if (greedy && !own && !m->layer_limit)
        m->be->ops->copy(m->be, st->scratch.s->logits, m->chunk_scratch.s->logits, m->cfg.n_vocab);
    /* An op that failed (bad shape, device fault) recorded why; the state is
     * then unusable and the caller must discard it. */
    status = m->be->ops->take_error(m->be, err);
    st->greedy_logits = !status && greedy && !m->layer_limit;
    if (status) return ds4_error_prefix(err, "evaluation failed at position %lld", (long long)st->pos);
    return DS4_OK;
}

ds4_status ds4_model_fetch_logits(ds4_model *m, ds4_state *st, float *logits, ds4_error *err) {
    if (!st || st->model != m || !logits)
        return ds4_error_set(err, DS4_ERR_INVALID, "fetch logits: %s", !logits ? "no place for them" : "not a state of this model");
    if (!st->greedy_logits || !st->scratch.s)
        return ds4_error_set(err, DS4_ERR_INVALID,
                             "fetch logits: the state's last evaluation was not a greedy one (its logits are not kept)");
    m->be->ops->download(m->be, logits, st->scratch.s->logits, m->cfg.n_vocab); /* the last row's, at the start */
    ds4_status status = m->be->ops->take_error(m->be, err);
    if (status) return ds4_error_prefix(err, "fetch logits");
    return DS4_OK;
}

ds4_status ds4_model_eval(ds4_model *m, ds4_state *st, const int32_t *tokens, int64_t n, ds4_numerics num,
                          float *logits, bool all_logits, ds4_error *err) {
    return eval_tokens(m, st, tokens, n, num, logits, NULL, all_logits, err);
}

ds4_status ds4_model_eval_greedy(ds4_model *m, ds4_state *st, const int32_t *tokens, int64_t n, ds4_numerics num,
                                 int32_t *next, ds4_error *err) {
    if (!next) return ds4_error_set(err, DS4_ERR_INVALID, "greedy evaluation: no place for the next token");
    return eval_tokens(m, st, tokens, n, num, NULL, next, false, err);
}

static ds4_status eval_batch(ds4_model *m, ds4_state *const *states, const int32_t *tokens, int64_t n_seq,
                             ds4_numerics num, float *logits, int32_t *greedy, ds4_error *err) {
    const ds4_config *c = &m->cfg;
    if (n_seq < 1) return ds4_error_set(err, DS4_ERR_INVALID, "no sequences to decode");
    ds4_status status = ds4_backend_check_numerics(m->be, num, err);
    if (status) return status;
    if (!states || !tokens)
        return ds4_error_set(err, DS4_ERR_INVALID, "batched decode: NULL %s", states ? "tokens" : "states");
    int64_t max_ctx = 0;
    for (int64_t i = 0; i < n_seq; i++) {
        const ds4_state *st = states[i];
        if (!st || st->model != m)
            return ds4_error_set(err, DS4_ERR_INVALID, "batch row %lld: %s", (long long)i,
                                 st ? "the state belongs to another model" : "no state");
        if (st->pos + 1 > st->n_ctx)
            return ds4_error_set(err, DS4_ERR_INVALID, "batch row %lld: position %lld is the end of its context of "
                                 "%lld", (long long)i, (long long)st->pos, (long long)st->n_ctx);
        if (tokens[i] < 0 || tokens[i] >= c->n_vocab)
            return ds4_error_set(err, DS4_ERR_INVALID, "batch row %lld: token %d is outside the vocabulary (0..%lld)",
                                 (long long)i, tokens[i], (long long)c->n_vocab - 1);
        for (int64_t j = 0; j < i; j++)
            if (states[j] == st)
                return ds4_error_set(err, DS4_ERR_INVALID, "batch rows %lld and %lld are the same state",
                                     (long long)j, (long long)i);
        if (st->n_ctx > max_ctx) max_ctx = st->n_ctx;
    }
    const int64_t max_chunk = ds4_model_eval_chunk(m), chunk = n_seq < max_chunk ? n_seq : max_chunk;
    for (int64_t i = 0; i < n_seq; i++) states[i]->greedy_logits = false; /* (no logits are kept) */
    status = ensure_scratch(m, &m->chunk_scratch, chunk, max_ctx, true, err);
    if (status) return status;
    int32_t *pos = malloc((size_t)chunk * sizeof *pos);
    if (!pos) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    for (int64_t off = 0; off < n_seq; off += chunk) {
        const int64_t len = n_seq - off < chunk ? n_seq - off : chunk;
        for (int64_t t = 0; t < len; t++) pos[t] = (int32_t)states[off + t]->pos;
        eval_chunk(m, states + off, pos, tokens + off, len, num, logits ? logits + off * c->n_vocab : NULL,
                   greedy ? greedy + off : NULL, true, true, m->chunk_scratch.s);
        for (int64_t t = 0; t < len; t++) states[off + t]->pos++;
    }
    free(pos);
    status = m->be->ops->take_error(m->be, err);
    if (status) return ds4_error_prefix(err, "batched decode of %lld sequences failed", (long long)n_seq);
    return DS4_OK;
}

ds4_status ds4_model_eval_batch(ds4_model *m, ds4_state *const *states, const int32_t *tokens, int64_t n_seq,
                                ds4_numerics num, float *logits, ds4_error *err) {
    return eval_batch(m, states, tokens, n_seq, num, logits, NULL, err);
}

ds4_status ds4_model_eval_batch_greedy(ds4_model *m, ds4_state *const *states, const int32_t *tokens, int64_t n_seq,
                                       ds4_numerics num, int32_t *next, ds4_error *err) {
    if (!next) return ds4_error_set(err, DS4_ERR_INVALID, "greedy batched decode: no place for the next tokens");
    return eval_batch(m, states, tokens, n_seq, num, NULL, next, err);
}

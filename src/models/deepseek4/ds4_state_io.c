/*
 * ds4_state_io.c - the model state as bytes: DS4's session payload (spec 4.3).
 *
 * Layout, little-endian: 13 u32 header fields (magic "DSV4", version 1, ctx,
 * prefill chunk, raw ring capacity, raw window, compressed capacity, token
 * count N, layers, KV head dim, indexer head dim, vocab, live raw rows R),
 * then u32[N] tokens, f32[vocab] next-token logits, u32[layers] n_comp,
 * u32[layers] n_index_comp, and per layer: R raw rows in position order;
 * for compressed layers the n_comp attention rows and the compressor's kv and
 * score images; for ratio-4 layers the n_index_comp indexer rows and the
 * indexer compressor's kv and score images. The same bytes come from every
 * backend (buffers are downloaded to the host), so a payload saved on one
 * backend restores on another.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "models/deepseek4/ds4_model.h"
#include "models/deepseek4/ds4_model_internal.h"

#define PAYLOAD_MAGIC 0x34565344u /* "DSV4" */
#define PAYLOAD_VERSION 1u
#define HEADER_FIELDS 13

typedef struct geometry {
    uint32_t ctx, chunk, ring, window, comp_cap, layers, dim, idx_dim, vocab;
} geometry;

static geometry state_geometry(const ds4_state *s) {
    const ds4_config *c = &s->model->cfg;
    geometry g;
    g.ctx = (uint32_t)s->n_ctx;
    g.chunk = s->n_ctx > 2048 ? 2048u : (uint32_t)s->n_ctx;
    g.window = (uint32_t)(c->sliding_window < s->n_ctx ? c->sliding_window : s->n_ctx);
    g.ring = g.window; /* the CPU keeps exactly the window */
    g.comp_cap = (uint32_t)(s->n_ctx / 4 + 2);
    g.layers = (uint32_t)c->n_layer;
    g.dim = (uint32_t)c->head_dim;
    g.idx_dim = (uint32_t)c->idx_head_dim;
    g.vocab = (uint32_t)c->n_vocab;
    return g;
}

static int64_t compressor_image(const compressor_state *cs) {
    return (int64_t)cs->coff * cs->ratio * cs->coff * cs->dim;
}

int64_t ds4_state_payload_size(const ds4_state *s, int64_t n_tokens) {
    const ds4_config *c = &s->model->cfg;
    geometry g = state_geometry(s);
    int64_t live = n_tokens < g.window ? n_tokens : g.window;
    int64_t bytes = 4 * HEADER_FIELDS + 4 * n_tokens + 4 * (int64_t)g.vocab + 8 * (int64_t)g.layers;
    for (int l = 0; l < c->n_layer; l++) {
        const layer_state *L = &s->layers[l];
        bytes += 4 * live * g.dim;
        if (c->compress_ratio[l]) bytes += 4 * (L->attn.n_rows * g.dim + 2 * compressor_image(&L->attn));
        if (c->compress_ratio[l] == 4) bytes += 4 * (L->index.n_rows * g.idx_dim + 2 * compressor_image(&L->index));
    }
    return bytes;
}

typedef struct writer {
    uint8_t *p, *end;
} writer;

static void put_u32(writer *w, uint32_t v) {
    for (int i = 0; i < 4; i++) w->p[i] = (uint8_t)(v >> (8 * i));
    w->p += 4;
}

static void put_floats(ds4_backend *be, writer *w, const float *buf, int64_t n) {
    if (n <= 0) return;
    be->ops->download(be, (float *)(void *)w->p, buf, n); /* host is little-endian */
    w->p += 4 * n;
}

ds4_status ds4_state_save_payload(const ds4_state *s, const int32_t *tokens, int64_t n_tokens, const float *logits,
                                  uint8_t *out, int64_t cap, ds4_error *err) {
    const ds4_config *c = &s->model->cfg;
    ds4_backend *be = s->model->be;
    int64_t need = ds4_state_payload_size(s, n_tokens);
    if (cap < need) return ds4_error_set(err, DS4_ERR_INVALID, "payload buffer of %lld bytes, %lld needed",
                                         (long long)cap, (long long)need);
    if (n_tokens != s->pos) return ds4_error_set(err, DS4_ERR_INVALID, "%lld tokens given for a state at position "
                                                 "%lld", (long long)n_tokens, (long long)s->pos);
    geometry g = state_geometry(s);
    uint32_t live = (uint32_t)(n_tokens < g.window ? n_tokens : g.window);
    writer w = { out, out + cap };
    const uint32_t header[HEADER_FIELDS] = { PAYLOAD_MAGIC, PAYLOAD_VERSION, g.ctx, g.chunk, g.ring, g.window,
                                             g.comp_cap, (uint32_t)n_tokens, g.layers, g.dim, g.idx_dim, g.vocab,
                                             live };
    for (int i = 0; i < HEADER_FIELDS; i++) put_u32(&w, header[i]);
    for (int64_t i = 0; i < n_tokens; i++) put_u32(&w, (uint32_t)tokens[i]);
    memcpy(w.p, logits, 4 * (size_t)g.vocab);
    w.p += 4 * (size_t)g.vocab;
    for (int l = 0; l < c->n_layer; l++) put_u32(&w, (uint32_t)s->layers[l].attn.n_rows);
    for (int l = 0; l < c->n_layer; l++) put_u32(&w, (uint32_t)s->layers[l].index.n_rows);
    for (int l = 0; l < c->n_layer; l++) {
        const layer_state *L = &s->layers[l];
        /* the window holds min(pos, W) rows, oldest first: the last `live` of them */
        put_floats(be, &w, ds4_window_rows(L, g.dim) + (L->n_window - live) * (int64_t)g.dim, (int64_t)live * g.dim);
        if (c->compress_ratio[l]) {
            put_floats(be, &w, L->attn.rows, L->attn.n_rows * g.dim);
            put_floats(be, &w, L->attn.state_kv, compressor_image(&L->attn));
            put_floats(be, &w, L->attn.state_sc, compressor_image(&L->attn));
        }
        if (c->compress_ratio[l] == 4) {
            put_floats(be, &w, L->index.rows, L->index.n_rows * g.idx_dim);
            put_floats(be, &w, L->index.state_kv, compressor_image(&L->index));
            put_floats(be, &w, L->index.state_sc, compressor_image(&L->index));
        }
    }
    if (w.p != out + need) return ds4_error_set(err, DS4_ERR_INVALID, "payload size mismatch (internal)");
    return DS4_OK;
}

typedef struct reader {
    const uint8_t *p, *end;
} reader;

static bool get_u32(reader *r, uint32_t *v) {
    if (r->end - r->p < 4) return false;
    *v = (uint32_t)r->p[0] | (uint32_t)r->p[1] << 8 | (uint32_t)r->p[2] << 16 | (uint32_t)r->p[3] << 24;
    r->p += 4;
    return true;
}

static bool get_floats(ds4_backend *be, reader *r, float *buf, int64_t n) {
    if (n < 0 || (r->end - r->p) / 4 < n) return false;
    if (n == 0) return true;
    be->ops->upload(be, buf, (const float *)(const void *)r->p, n);
    r->p += 4 * n;
    return true;
}

void ds4_state_reset(ds4_state *s) {
    const ds4_config *c = &s->model->cfg;
    ds4_backend *be = s->model->be;
    s->greedy_logits = false;
    for (int l = 0; l < c->n_layer; l++) {
        layer_state *L = &s->layers[l];
        L->n_window = 0;
        L->win_start = 0;
        compressor_state *cs[2] = { &L->attn, &L->index };
        for (int k = 0; k < 2; k++) {
            if (!cs[k]->state_kv) continue;
            cs[k]->n_rows = 0;
            be->ops->fill(be, cs[k]->state_kv, 0.0f, compressor_image(cs[k]));
            be->ops->fill(be, cs[k]->state_sc, -INFINITY, compressor_image(cs[k]));
        }
    }
    s->pos = 0;
}

#define BAD(...) ds4_error_set(err, DS4_ERR_FORMAT, __VA_ARGS__)

ds4_status ds4_state_load_payload(ds4_state *s, const uint8_t *data, int64_t size, int32_t **tokens_out,
                                  int64_t *n_tokens_out, float *logits_out, ds4_error *err) {
    const ds4_config *c = &s->model->cfg;
    ds4_backend *be = s->model->be;
    geometry g = state_geometry(s);
    reader r = { data, data + size };
    uint32_t h[HEADER_FIELDS];
    for (int i = 0; i < HEADER_FIELDS; i++)
        if (!get_u32(&r, &h[i])) return BAD("session payload is truncated in its header");
    if (h[0] != PAYLOAD_MAGIC) return BAD("not a session payload (magic 0x%08x)", h[0]);
    if (h[1] != PAYLOAD_VERSION) return BAD("session payload version %u is not supported (only %u)", h[1],
                                            PAYLOAD_VERSION);
    uint32_t ctx = h[2], chunk = h[3], ring = h[4], window = h[5], comp_cap = h[6], n = h[7], live = h[12];
    if (h[8] != g.layers || h[9] != g.dim || h[10] != g.idx_dim || h[11] != g.vocab)
        return BAD("session payload is for another model shape (layers %u, dims %u/%u, vocab %u; this model has "
                   "%u, %u/%u, %u)", h[8], h[9], h[10], h[11], g.layers, g.dim, g.idx_dim, g.vocab);
    if (ctx > g.ctx || n >= g.ctx)
        return BAD("session payload needs a context of %u (it holds %u tokens); this session has %u", ctx, n, g.ctx);
    if (chunk != g.chunk) return BAD("session payload prefill chunk %u differs from this session's %u", chunk, g.chunk);
    if (window != g.window) return BAD("session payload window %u differs from this session's %u", window, g.window);
    if (ring == 0 || live != (n < window ? n : window) || live > ring || live > g.ring)
        return BAD("session payload has inconsistent raw rows (%u live, ring %u)", live, ring);
    if (comp_cap > g.comp_cap) return BAD("session payload compressed capacity %u exceeds this session's %u", comp_cap,
                                          g.comp_cap);
    if ((int64_t)n > (r.end - r.p) / 4) return BAD("session payload is truncated in its token list");
    int32_t *tokens = malloc((size_t)(n ? n : 1) * sizeof *tokens);
    if (!tokens) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    for (uint32_t i = 0; i < n; i++) {
        uint32_t t = 0;
        get_u32(&r, &t); /* cannot fail: the length was checked above */
        if (t >= g.vocab) {
            free(tokens);
            return BAD("session payload token %u at index %u is outside the vocabulary", t, i);
        }
        tokens[i] = (int32_t)t;
    }
    ds4_status st = DS4_OK;
    uint32_t *n_comp = calloc(2 * (size_t)g.layers, sizeof *n_comp);
    if (!n_comp) st = ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    if (!st && (r.end - r.p) / 4 < (int64_t)g.vocab) st = BAD("session payload is truncated in its logits");
    if (!st) {
        memcpy(logits_out, r.p, 4 * (size_t)g.vocab);
        r.p += 4 * (size_t)g.vocab;
    }
    for (uint32_t i = 0; !st && i < 2 * g.layers; i++) {
        if (!get_u32(&r, &n_comp[i])) st = BAD("session payload is truncated in its row counters");
        else {
            int l = (int)(i % g.layers);
            bool index = i >= g.layers;
            int ratio = c->compress_ratio[l];
            const compressor_state *cs = index ? &s->layers[l].index : &s->layers[l].attn;
            bool has = index ? ratio == 4 : ratio != 0;
            if (!has && n_comp[i]) st = BAD("session payload has compressed rows for layer %d, which has none", l);
            else if (has && (n_comp[i] > comp_cap || n_comp[i] > cs->cap || n_comp[i] != (uint32_t)(n / ratio)))
                st = BAD("session payload layer %d has %u compressed rows, inconsistent with %u tokens", l, n_comp[i], n);
        }
    }
    ds4_state_reset(s);
    for (int l = 0; !st && l < c->n_layer; l++) {
        layer_state *L = &s->layers[l];
        bool ok = get_floats(be, &r, L->window, (int64_t)live * g.dim); /* reset: win_start 0 */
        L->n_window = live;
        if (ok && c->compress_ratio[l]) {
            L->attn.n_rows = n_comp[l];
            ok = get_floats(be, &r, L->attn.rows, L->attn.n_rows * g.dim) &&
                 get_floats(be, &r, L->attn.state_kv, compressor_image(&L->attn)) &&
                 get_floats(be, &r, L->attn.state_sc, compressor_image(&L->attn));
        }
        if (ok && c->compress_ratio[l] == 4) {
            L->index.n_rows = n_comp[g.layers + (uint32_t)l];
            ok = get_floats(be, &r, L->index.rows, L->index.n_rows * g.idx_dim) &&
                 get_floats(be, &r, L->index.state_kv, compressor_image(&L->index)) &&
                 get_floats(be, &r, L->index.state_sc, compressor_image(&L->index));
        }
        if (!ok) st = BAD("session payload is truncated in layer %d", l);
    }
    if (!st && r.p != r.end) st = BAD("session payload has %lld trailing bytes", (long long)(r.end - r.p));
    free(n_comp);
    if (st) {
        ds4_state_reset(s); /* never leave a half-restored state */
        free(tokens);
        return st;
    }
    s->pos = n;
    *tokens_out = tokens;
    *n_tokens_out = n;
    return DS4_OK;
}

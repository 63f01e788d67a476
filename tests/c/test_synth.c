/*
 * test_synth.c - synthetic weights made by a backend (core/synth_fill.h,
 * ds4_synth_fill_for, bind_synthetic, ds4_model_load_synthetic): values of
 * the intended size for every type, the same bytes from the same seed in
 * any block order, a model that evaluates to finite logits without a file
 * of weights, and clear errors for fills that do not suit a weight.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/backend.h"
#include "core/error.h"
#include "core/gguf.h"
#include "core/quant.h"
#include "models/deepseek4/ds4_config.h"
#include "models/deepseek4/ds4_model.h"
#include "models/deepseek4/ds4_synth.h"
#include "test.h"

static ds4_tensor_spec spec_of(const char *name, ds4_tensor_role role, int64_t n, int64_t rows, int64_t fan_in) {
    ds4_tensor_spec t;
    memset(&t, 0, sizeof t);
    snprintf(t.name, sizeof t.name, "%s", name);
    t.role = role;
    t.n_dims = 2;
    t.ne[0] = (uint64_t)n;
    t.ne[1] = (uint64_t)rows;
    t.ne[2] = t.ne[3] = 1;
    t.fan_in = fan_in;
    return t;
}

static void weight_of(ds4_weight *w, const ds4_tensor_spec *t, uint32_t type) {
    memset(w, 0, sizeof *w);
    w->name = t->name;
    w->type = type;
    for (int d = 0; d < 4; d++) w->ne[d] = (int64_t)t->ne[d];
    w->row_bytes = ds4_type_row_bytes(type, w->ne[0]);
}

/* Every type the generator makes: the CPU backend's bytes are those of
 * ds4_fill_block in any order, the seed changes them, and the values
 * (dequantised) are finite and of the role's size. */
static void test_fill_values(void) {
    ds4_config cfg;
    ds4_config_preset(DS4_SCALE_TINY, &cfg);
    ds4_backend *be = NULL;
    ds4_error err = { 0 };
    CHECK(ds4_backend_create("cpu", 1, &be, &err) == DS4_OK);
    if (!be) return;
    const struct {
        uint32_t type;
        ds4_tensor_role role;
        int64_t n, rows;
        double lo, hi; /* bounds of the values */
    } cases[] = {
        { DS4_TYPE_F32, DS4_ROLE_NORM, 256, 4, 1.0 - 0.1733, 1.0 + 0.1733 },
        { DS4_TYPE_F32, DS4_ROLE_MATRIX, 256, 4, -1.7321 / 16, 1.7321 / 16 },
        { DS4_TYPE_F16, DS4_ROLE_MATRIX, 256, 4, -1.7321 / 16, 1.7321 / 16 },
        { DS4_TYPE_Q8_0, DS4_ROLE_MATRIX, 256, 4, -128.0 / (74 * 16) * 1.01, 127.0 / (74 * 16) * 1.01 },
        { DS4_TYPE_Q2_K, DS4_ROLE_EXPERTS, 256, 4, -1.0, 1.0 },
        { DS4_TYPE_Q4_K, DS4_ROLE_EXPERTS, 256, 4, -1.0, 1.0 },
        { DS4_TYPE_IQ2_XXS, DS4_ROLE_EXPERTS, 256, 4, -1.0, 1.0 },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const ds4_tensor_spec t = spec_of("blk.0.test.weight", cases[c].role, cases[c].n, cases[c].rows, 256);
        ds4_fill f, g;
        CHECK(ds4_synth_fill_for(&t, cases[c].type, &cfg, 7, 3, &f, &err) == DS4_OK);
        CHECK(ds4_synth_fill_for(&t, cases[c].type, &cfg, 8, 3, &g, &err) == DS4_OK);
        ds4_weight w, w2;
        weight_of(&w, &t, cases[c].type);
        weight_of(&w2, &t, cases[c].type);
        CHECK_MSG(be->ops->bind_synthetic(be, &w, &f, &err) == DS4_OK, "%s: %s", ds4_type_name(cases[c].type),
                  err.message);
        CHECK(be->ops->bind_synthetic(be, &w2, &g, &err) == DS4_OK);
        if (!w.host || !w2.host) continue;
        CHECK(w.owned == w.host);
        const int64_t bytes = w.row_bytes * cases[c].rows;
        CHECK(memcmp(w.host, w2.host, (size_t)bytes) != 0); /* another seed, other bytes */
        /* blocks in reverse order give the same tensor */
        const int bb = f.block_bytes;
        uint8_t *rev = malloc((size_t)bytes);
        for (int64_t b = bytes / bb - 1; b >= 0; b--) ds4_fill_block(&f, b, rev + b * bb);
        CHECK(memcmp(rev, w.host, (size_t)bytes) == 0);
        free(rev);
        /* blocks are drawn each on its own: no two neighbours alike */
        bool distinct = true;
        for (int64_t b = 1; b < bytes / bb; b++)
            distinct &= memcmp((const uint8_t *)w.host + (b - 1) * bb, (const uint8_t *)w.host + b * bb, (size_t)bb) != 0;
        CHECK_MSG(distinct, "%s: equal neighbouring blocks", ds4_type_name(cases[c].type));
        float *v = malloc((size_t)(cases[c].n * cases[c].rows) * sizeof *v);
        double ss = 0;
        bool in_range = true;
        for (int64_t r = 0; r < cases[c].rows; r++)
            ds4_type_traits_get(cases[c].type)->dequant_row((const uint8_t *)w.host + r * w.row_bytes,
                                                            v + r * cases[c].n, cases[c].n);
        for (int64_t i = 0; i < cases[c].n * cases[c].rows; i++) {
            in_range &= isfinite(v[i]) && v[i] >= cases[c].lo && v[i] <= cases[c].hi;
            ss += (double)v[i] * v[i];
        }
        CHECK_MSG(in_range, "%s role %d: a value outside [%g, %g]", ds4_type_name(cases[c].type), cases[c].role,
                  cases[c].lo, cases[c].hi);
        CHECK_MSG(ss > 0, "%s: all zero", ds4_type_name(cases[c].type));
        if (cases[c].type == DS4_TYPE_F16) { /* |v| in [half / 16, half) */
            for (int64_t i = 0; i < cases[c].n; i++) in_range &= fabsf(v[i]) >= 1.7320508f / 16 / 16;
            CHECK(in_range);
        }
        free(v);
        be->ops->release_weight(be, &w);
        be->ops->release_weight(be, &w2);
        CHECK(!w.owned && !w.host);
    }
    /* the routing table: distinct ids in range, per row */
    const ds4_tensor_spec ids = spec_of("blk.0.ffn_gate_tid2eid.weight", DS4_ROLE_TID2EID, cfg.n_expert_used,
                                        cfg.n_vocab, 0);
    ds4_fill f;
    CHECK(ds4_synth_fill_for(&ids, DS4_TYPE_I32, &cfg, 7, 9, &f, &err) == DS4_OK);
    ds4_weight w;
    weight_of(&w, &ids, DS4_TYPE_I32);
    CHECK(be->ops->bind_synthetic(be, &w, &f, &err) == DS4_OK);
    bool ok = w.host != NULL;
    for (int64_t r = 0; ok && r < cfg.n_vocab; r++) {
        const int32_t *row = (const int32_t *)w.host + r * cfg.n_expert_used;
        for (int k = 0; k < cfg.n_expert_used; k++) {
            ok &= row[k] >= 0 && row[k] < cfg.n_expert;
            for (int j = 0; j < k; j++) ok &= row[j] != row[k];
        }
    }
    CHECK(ok);
    be->ops->release_weight(be, &w);
    ds4_backend_destroy(be);
}

/* Fills that do not suit: a type the generator cannot make, an F16 tensor
 * centred away from 0, a fill of another type than the weight. */
static void test_fill_errors(void) {
    ds4_config cfg;
    ds4_config_preset(DS4_SCALE_TINY, &cfg);
    ds4_error err = { 0 };
    ds4_fill f;
    const ds4_tensor_spec m = spec_of("blk.0.attn_q_a.weight", DS4_ROLE_MATRIX, 256, 4, 256);
    CHECK(ds4_synth_fill_for(&m, DS4_TYPE_Q5_K, &cfg, 1, 0, &f, &err) == DS4_ERR_UNSUPPORTED);
    CHECK(strstr(err.message, "blk.0.attn_q_a.weight") && strstr(err.message, "Q5_K"));
    const ds4_tensor_spec norm = spec_of("blk.0.attn_norm.weight", DS4_ROLE_NORM, 256, 1, 0);
    CHECK(ds4_synth_fill_for(&norm, DS4_TYPE_F16, &cfg, 1, 0, &f, &err) == DS4_ERR_UNSUPPORTED);
    CHECK(ds4_synth_fill_for(&m, DS4_TYPE_I32, &cfg, 1, 0, &f, &err) == DS4_ERR_UNSUPPORTED);
    ds4_backend *be = NULL;
    CHECK(ds4_backend_create("cpu", 1, &be, &err) == DS4_OK);
    if (!be) return;
    CHECK(ds4_synth_fill_for(&m, DS4_TYPE_Q8_0, &cfg, 1, 0, &f, &err) == DS4_OK);
    ds4_weight w;
    weight_of(&w, &m, DS4_TYPE_F16);
    CHECK(be->ops->bind_synthetic(be, &w, &f, &err) == DS4_ERR_INVALID && !w.owned);
    CHECK(strstr(err.message, "does not match its fill") != NULL);
    ds4_backend_destroy(be);
}

/* The first layers of a layout (ds4_synth_write_layers): block_count and
 * the per-layer arrays are the preset's first N, and the file opens as a
 * model of N layers whose tensors are the full layout's for those layers;
 * 0 layers is all of them, more than the preset has is refused. */
static void test_synth_layers(void) {
    char path[256];
    snprintf(path, sizeof path, "/tmp/ds4_test_synth_layers_%d.gguf", (int)getpid());
    ds4_error err = { 0 };
    int64_t counts[2] = { 0, 0 };
    const int layers[2] = { 3, 0 };
    for (int k = 0; k < 2; k++) {
        CHECK(ds4_synth_write_layers(path, DS4_SCALE_TINY, DS4_QUANT_Q2, 5, NULL, true, layers[k], &err) == DS4_OK);
        gguf_file *file = NULL;
        CHECK(gguf_open(path, &file, &err) == DS4_OK);
        if (!file) continue;
        ds4_config cfg;
        CHECK_MSG(ds4_config_from_gguf(file, &cfg, &err) == DS4_OK, "%s", err.message);
        CHECK(cfg.n_layer == (k ? 5 : 3));
        CHECK(cfg.compress_ratio[2] == 4 && cfg.hash_layer[0]);
        counts[k] = (int64_t)file->n_tensors;
        gguf_close(file);
    }
    unlink(path);
    CHECK(counts[0] > 0 && counts[0] < counts[1]);
    CHECK(ds4_synth_write_layers(path, DS4_SCALE_TINY, DS4_QUANT_Q2, 5, NULL, true, 6, &err) == DS4_ERR_INVALID);
    CHECK(strstr(err.message, "6 layers") != NULL);
    CHECK(access(path, F_OK) != 0); /* nothing written */
}

/* A model without a file of weights: the tiny q2 layout written with no
 * weight data, its weights made by the CPU backend. The same seed gives the
 * same logits, another seed others; all finite. */
static void test_synthetic_model(void) {
    char path[256];
    snprintf(path, sizeof path, "/tmp/ds4_test_synth_%d.gguf", (int)getpid());
    ds4_error err = { 0 };
    CHECK(ds4_synth_write(path, DS4_SCALE_TINY, DS4_QUANT_Q2, 5, NULL, true, &err) == DS4_OK);
    gguf_file *file = NULL;
    CHECK(gguf_open(path, &file, &err) == DS4_OK);
    unlink(path);
    if (!file) return;
    const int32_t tokens[6] = { 1, 17, 300, 42, 9, 511 };
    float *logits[3] = { NULL, NULL, NULL };
    int64_t V = 0;
    const uint64_t seeds[3] = { 11, 11, 12 };
    for (int k = 0; k < 3; k++) {
        ds4_backend *be = NULL;
        ds4_model *m = NULL;
        ds4_state *st = NULL;
        CHECK(ds4_backend_create("cpu", 2, &be, &err) == DS4_OK);
        CHECK_MSG(be && ds4_model_load_synthetic(file, be, seeds[k], NULL, NULL, &m, &err) == DS4_OK, "%s",
                  err.message);
        if (m) {
            V = ds4_model_config(m)->n_vocab;
            logits[k] = malloc((size_t)V * sizeof(float));
            CHECK(ds4_state_create(m, 64, &st, &err) == DS4_OK);
            CHECK_MSG(st && ds4_model_eval(m, st, tokens, 6, DS4_NUMERICS_DS4, logits[k], false, &err) == DS4_OK,
                      "%s", err.message);
        }
        ds4_state_free(st);
        ds4_model_free(m);
        ds4_backend_destroy(be);
    }
    if (logits[0] && logits[1] && logits[2]) {
        bool finite = true;
        for (int64_t i = 0; i < V; i++) finite &= isfinite(logits[0][i]) && isfinite(logits[2][i]);
        CHECK(finite);
        CHECK(memcmp(logits[0], logits[1], (size_t)V * sizeof(float)) == 0);
        CHECK(memcmp(logits[0], logits[2], (size_t)V * sizeof(float)) != 0);
    }
    for (int k = 0; k < 3; k++) free(logits[k]);
    gguf_close(file);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_fill_values),
    TEST_ENTRY(test_fill_errors),
    TEST_ENTRY(test_synthetic_model),
    TEST_ENTRY(test_synth_layers),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

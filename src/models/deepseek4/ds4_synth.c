/*
 * ds4_synth.c - a DS4-layout GGUF with seeded random weights (`ds4server synth`).
 *
 *   ds4server synth --arch deepseek4 --scale tiny|small|full --quant f32|q8_0|q2|q4
 *                   --seed N --out FILE [--tokenizer tokenizer.json] [--zero]
 *
 * The file has the real tensor names, shapes, types and metadata of the
 * chosen scale (full = the published DeepSeek V4 Flash layout), so a real
 * file and a synthetic one differ only in weight values. Float tensors get
 * normal weights scaled by 1/sqrt(fan-in) (norm weights near 1, small HC and
 * bias terms); the 2-bit and 4-bit expert types are written as random valid
 * blocks with scales chosen for the same spread, which is fast enough for
 * the 87 GB full-size file. --tokenizer embeds a real vocabulary (tokens,
 * token types, merges) from a Hugging Face tokenizer.json, and the model's
 * vocabulary size follows it (the full scale requires exactly the real
 * 129,280); otherwise a byte-level vocabulary of the scale's size is written.
 * --zero writes no weight data at all (a sparse
 * file of zeros): enough to check a full-size layout on a small disk.
 * Every row of every tensor has its own random stream (seed, tensor index,
 * row), so the output depends only on the arguments, not on the number of
 * threads that generate it (all cores, in 64 MiB batches).
 */
#include <errno.h>
#include <pthread.h>
#include <unistd.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/gguf.h"
#include "core/quant.h"
#include "models/deepseek4/ds4_synth.h"
#include "text/hf_vocab.h"

/* ------------------------------------------------------------ randomness */

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double rng_uniform(rng *r) { return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }

/* Approximately standard normal: the sum of four uniforms, rescaled (mean 0,
 * variance 1, tails cut at +-3.5). Cheap, and random weights need no more. */
static float rng_normal(rng *r) {
    uint64_t a = rng_next(r), b = rng_next(r);
    double s = (double)(a & 0xffffffffu) + (double)(a >> 32) + (double)(b & 0xffffffffu) + (double)(b >> 32);
    return (float)((s / 4294967296.0 - 2.0) * 1.7320508075688772);
}

/* ------------------------------------------------------------ vocabulary */

/* A byte-level vocabulary of n tokens: the 256 GPT-2 byte symbols, the seven
 * special strings of the DS4 prompt format, then filler tokens. */
static char **byte_vocab(int64_t n) {
    static const char *const SPECIAL[] = {
        "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
        "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
        "<\xef\xbd\x9c" "User\xef\xbd\x9c>",
        "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>",
        "<think>",
        "</think>",
        "\xef\xbd\x9c" "DSML\xef\xbd\x9c",
    };
    if (n < 256 + 7) return NULL;
    char **v = calloc((size_t)n, sizeof *v);
    if (!v) return NULL;
    for (int64_t i = 0; i < n; i++) {
        char buf[64];
        if (i < 7) {
            snprintf(buf, sizeof buf, "%s", SPECIAL[i]);
        } else if (i < 7 + 256) {
            /* GPT-2 byte-to-unicode: printable bytes map to themselves, the
             * others to U+0100 + k in order. */
            int b = (int)(i - 7), cp;
            if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)) {
                cp = b;
            } else {
                int k = 0;
                for (int x = 0; x < b; x++)
                    if (!((x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || (x >= 0xae && x <= 0xff))) k++;
                cp = 0x100 + k;
            }
            if (cp < 0x80) snprintf(buf, sizeof buf, "%c", cp);
            else snprintf(buf, sizeof buf, "%c%c", 0xc0 | (cp >> 6), 0x80 | (cp & 0x3f));
        } else {
            snprintf(buf, sizeof buf, "<|synth_%lld|>", (long long)i);
        }
        if (!(v[i] = strdup(buf))) {
            for (int64_t j = 0; j < i; j++) free(v[j]);
            free(v);
            return NULL;
        }
    }
    return v;
}

/* ------------------------------------------------------------ tensors */

static float role_value(rng *r, const ds4_tensor_spec *t) {
    switch (t->role) {
    case DS4_ROLE_NORM: return 1.0f + 0.1f * rng_normal(r);
    case DS4_ROLE_HC_SCALE: return 0.5f + (float)rng_uniform(r);
    case DS4_ROLE_HC_BASE: return 0.5f * rng_normal(r);
    case DS4_ROLE_SINK: return rng_normal(r);
    case DS4_ROLE_BIAS: return 0.05f * rng_normal(r);
    case DS4_ROLE_APE: return 0.5f * rng_normal(r);
    case DS4_ROLE_EMBEDDING: return rng_normal(r);
    default: return rng_normal(r) / sqrtf((float)(t->fan_in > 0 ? t->fan_in : 1));
    }
}

/* The f16 scale fields (d, dmin) of a quantised block type whose values
 * should spread like normal(0, 1/fan_in): |value| of IQ2_XXS ~ d * (0.5 +
 * s) / 4 * 25 with s ~ 7.5; Q2_K value = d*sc*q - dmin*m with sc, m ~ 7.5, q
 * ~ 1.5; Q4_K the same with sc, m up to 63, q ~ 7.5; Q8_0 d * q with q
 * uniform over the codes (|q| ~ 74 rms). */
static void block_scales(uint32_t type, int64_t fan_in, uint16_t d16[2]) {
    const float sd = 1.0f / sqrtf((float)(fan_in > 0 ? fan_in : 1));
    d16[0] = d16[1] = 0;
    switch (type) {
    case DS4_TYPE_IQ2_XXS: d16[0] = ds4_f32_to_f16(sd / 50.0f); break;
    case DS4_TYPE_Q2_K:
        d16[0] = ds4_f32_to_f16(sd / 6.0f);
        d16[1] = ds4_f32_to_f16(sd / 10.0f);
        break;
    case DS4_TYPE_Q4_K:
        d16[0] = ds4_f32_to_f16(sd / 120.0f);
        d16[1] = ds4_f32_to_f16(sd / 60.0f);
        break;
    case DS4_TYPE_Q8_0: d16[0] = ds4_f32_to_f16(sd / 74.0f); break;
    }
}

/* Fill one row of a 2/4-bit expert type with random valid blocks whose
 * values spread like normal(0, 1/fan_in). */
static void random_blocks(rng *r, uint32_t type, uint8_t *row, int64_t row_bytes, int64_t fan_in) {
    for (int64_t i = 0; i < row_bytes; i += 8) {
        uint64_t v = rng_next(r);
        memcpy(row + i, &v, (size_t)(row_bytes - i < 8 ? row_bytes - i : 8));
    }
    uint16_t d16[2];
    block_scales(type, fan_in, d16);
    const int64_t bb = ds4_type_traits_get(type)->block_bytes;
    for (int64_t b = 0; b < row_bytes / bb; b++) {
        uint8_t *blk = row + b * bb;
        switch (type) {
        case DS4_TYPE_IQ2_XXS: memcpy(blk, &d16[0], 2); break;
        case DS4_TYPE_Q2_K:
            memcpy(blk + 80, &d16[0], 2);
            memcpy(blk + 82, &d16[1], 2);
            break;
        case DS4_TYPE_Q4_K: memcpy(blk, d16, 4); break;
        }
    }
}

ds4_status ds4_synth_fill_for(const ds4_tensor_spec *t, uint32_t type, const ds4_config *cfg, uint64_t seed,
                              int64_t index, ds4_fill *f, ds4_error *err) {
    memset(f, 0, sizeof *f);
    const ds4_type_traits *tr = ds4_type_traits_get(type);
    if (!tr || !ds4_fill_type_ok(type) || (type == DS4_TYPE_I32) != (t->role == DS4_ROLE_TID2EID))
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "synthetic weights: %s cannot be made as %s", t->name,
                             ds4_type_name(type));
    f->stream = ds4_fill_mix(seed * 0x100000001B3ULL ^ (uint64_t)(index + 1) * 0x9E3779B97F4A7C15ULL);
    f->type = type;
    f->block_bytes = tr->block_bytes;
    f->block_elems = tr->block_elems;
    /* the roles' centres and spreads (uniform: half = sqrt(3) standard deviations) */
    const float k = 1.7320508f;
    const float sd = 1.0f / sqrtf((float)(t->fan_in > 0 ? t->fan_in : 1));
    switch (t->role) {
    case DS4_ROLE_NORM: f->center = 1.0f, f->half = 0.1f * k; break;
    case DS4_ROLE_HC_SCALE: f->center = 1.0f, f->half = 0.5f; break;
    case DS4_ROLE_HC_BASE: f->half = 0.5f * k; break;
    case DS4_ROLE_SINK: f->half = k; break;
    case DS4_ROLE_BIAS: f->half = 0.05f * k; break;
    case DS4_ROLE_APE: f->half = 0.5f * k; break;
    case DS4_ROLE_EMBEDDING: f->half = k; break;
    default: f->half = sd * k; break;
    }
    if (type == DS4_TYPE_F16) {
        if (f->center != 0.0f)
            return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "synthetic weights: %s is F16 but centred away from 0",
                                 t->name);
        f->f16_exp = (int32_t)((ds4_f32_to_f16(f->half) >> 10) & 0x1f);
    }
    if (type == DS4_TYPE_I32) {
        f->id_mod = cfg->n_expert;
        f->id_per_row = (int32_t)t->ne[0];
        if (f->id_per_row < 1 || f->id_per_row > f->id_mod)
            return ds4_error_set(err, DS4_ERR_INVALID, "synthetic weights: %s has rows of %d ids of %d experts",
                                 t->name, f->id_per_row, f->id_mod);
    }
    block_scales(type, t->fan_in, f->d16);
    return DS4_OK;
}

/* One row of tensor t into buf: its own random stream (seed, tensor, row),
 * so rows can be generated in any order and on any number of threads. */
static void synth_row(const ds4_tensor_spec *t, const ds4_config *cfg, uint64_t seed, int64_t index, int64_t rr,
                      uint8_t *buf, float *f) {
    const int64_t row = (int64_t)t->ne[0];
    const int64_t row_bytes = ds4_type_row_bytes(t->type, row);
    rng r = { seed * 0x100000001B3ULL ^ (uint64_t)(index + 1) * 0x9E3779B97F4A7C15ULL };
    r.s ^= rng_next(&r) + (uint64_t)rr * 0xD1B54A32D192ED03ULL;
    (void)rng_next(&r);
    if (t->role == DS4_ROLE_TID2EID) { /* n_used distinct expert ids per token */
        int32_t *ids = (int32_t *)buf;
        for (int64_t k = 0; k < row; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(rng_next(&r) % (uint64_t)cfg->n_expert);
                dup = false;
                for (int64_t j = 0; j < k; j++) dup |= ids[j] == e;
            } while (dup);
            ids[k] = e;
        }
    } else if (t->type == DS4_TYPE_IQ2_XXS || t->type == DS4_TYPE_Q2_K || t->type == DS4_TYPE_Q4_K) {
        random_blocks(&r, t->type, buf, row_bytes, t->fan_in);
    } else {
        for (int64_t i = 0; i < row; i++) f[i] = role_value(&r, t);
        ds4_type_traits_get(t->type)->quantize_row(f, buf, row);
    }
}

typedef struct synth_job {
    const ds4_tensor_spec *t;
    const ds4_config *cfg;
    uint64_t seed;
    int64_t index, first, n_rows, row_bytes;
    uint8_t *out;
    float *f; /* row scratch of this job */
} synth_job;

static void *synth_rows(void *arg) {
    synth_job *j = arg;
    for (int64_t k = 0; k < j->n_rows; k++)
        synth_row(j->t, j->cfg, j->seed, j->index, j->first + k, j->out + k * j->row_bytes, j->f);
    return NULL;
}

#define SYNTH_BATCH_BYTES ((int64_t)64 << 20)
#define SYNTH_MAX_THREADS 64

/* Rows are generated in batches of about 64 MiB, each split over the
 * machine's cores, and written in order. */
static ds4_status write_tensor(gguf_writer *w, const ds4_tensor_spec *t, uint64_t seed, int64_t index,
                               const ds4_config *cfg, bool zero, int n_threads, ds4_error *err) {
    const int64_t row = (int64_t)t->ne[0], rows = (int64_t)(t->ne[1] * t->ne[2] * t->ne[3]);
    const int64_t row_bytes = ds4_type_row_bytes(t->type, row);
    if (zero) return gguf_writer_write_zeros(w, (uint64_t)(row_bytes * rows));
    int64_t batch = SYNTH_BATCH_BYTES / (row_bytes > 0 ? row_bytes : 1);
    if (batch < 1) batch = 1;
    if (batch > rows) batch = rows;
    if (rows < 64) n_threads = 1; /* small tensors: not worth threads */
    uint8_t *buf = malloc((size_t)(batch * row_bytes));
    float *f = malloc((size_t)n_threads * (size_t)row * sizeof *f);
    ds4_status st = DS4_OK;
    if (!buf || !f) st = ds4_error_set(err, DS4_ERR_NOMEM, "out of memory for rows of %s", t->name);
    for (int64_t r0 = 0; r0 < rows && !st; r0 += batch) {
        const int64_t nb = rows - r0 < batch ? rows - r0 : batch;
        synth_job jobs[SYNTH_MAX_THREADS];
        pthread_t tid[SYNTH_MAX_THREADS];
        bool started[SYNTH_MAX_THREADS] = { false };
        const int nt = nb < n_threads ? (int)nb : n_threads;
        for (int k = 0; k < nt; k++) {
            const int64_t a = nb * k / nt, b = nb * (k + 1) / nt;
            jobs[k] = (synth_job){ t, cfg, seed, index, r0 + a, b - a, row_bytes, buf + a * row_bytes, f + k * row };
            started[k] = k > 0 && pthread_create(&tid[k], NULL, synth_rows, &jobs[k]) == 0;
            if (k > 0 && !started[k]) synth_rows(&jobs[k]); /* no thread: do it here */
        }
        if (nt > 0) synth_rows(&jobs[0]);
        for (int k = 1; k < nt; k++)
            if (started[k]) pthread_join(tid[k], NULL);
        st = gguf_writer_write(w, buf, (uint64_t)(nb * row_bytes));
    }
    free(buf);
    free(f);
    return st;
}

ds4_status ds4_synth_write(const char *out, ds4_scale scale, ds4_quant_scheme quant, uint64_t seed,
                           const char *tokenizer, bool zero, ds4_error *err) {
    return ds4_synth_write_layers(out, scale, quant, seed, tokenizer, zero, 0, err);
}

ds4_status ds4_synth_write_layers(const char *out, ds4_scale scale, ds4_quant_scheme quant, uint64_t seed,
                                  const char *tokenizer, bool zero, int n_layers, ds4_error *err) {
    const char *scale_s = scale == DS4_SCALE_FULL ? "full" : scale == DS4_SCALE_SMALL ? "small" : "tiny";
    ds4_config cfg;
    ds4_config_preset(scale, &cfg);
    if (n_layers < 0 || n_layers > cfg.n_layer)
        return ds4_error_set(err, DS4_ERR_INVALID, "%d layers: the %s layout has 1 to %d", n_layers, scale_s,
                             cfg.n_layer);
    if (n_layers > 0) cfg.n_layer = n_layers; /* the first layers of the preset (their ratios, hash layers) */
    hf_vocab hv = { 0 };
    char **vocab = NULL;
    if (tokenizer) {
        ds4_status vst = hf_vocab_load(tokenizer, &hv, err);
        if (vst) return vst;
        if (scale == DS4_SCALE_FULL && hv.n_tokens != cfg.n_vocab) {
            hf_vocab_free(&hv);
            return ds4_error_set(err, DS4_ERR_INVALID, "%s has %lld tokens; the full-size model needs exactly %lld", tokenizer,
                             (long long)hv.n_tokens, (long long)cfg.n_vocab);
        }
        cfg.n_vocab = hv.n_tokens;
        vocab = hv.tokens;
    } else {
        vocab = byte_vocab(cfg.n_vocab);
    }
    ds4_status rc = DS4_OK;
    ds4_tensor_spec *specs = NULL;
    gguf_writer *w;
    int64_t n = ds4_layout_tensors(&cfg, (ds4_quant_scheme)quant, NULL, 0, err);
    if (n < 0) {
        rc = err->status;
        goto done;
    }
    specs = calloc((size_t)n, sizeof *specs);
    if (!specs || !vocab) {
        rc = ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
        goto done;
    }
    ds4_layout_tensors(&cfg, (ds4_quant_scheme)quant, specs, n, err);
    if ((rc = gguf_writer_open(out, 32, &w, err))) goto done;
    char name[128];
    snprintf(name, sizeof name, "DS4Server synthetic deepseek4 %s %s seed %llu (random weights)", scale_s,
             ds4_quant_scheme_name((ds4_quant_scheme)quant), (unsigned long long)seed);
    gguf_writer_add_str(w, "general.name", name);
    ds4_config_write_gguf(&cfg, w);
    gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2");
    gguf_writer_add_str(w, "tokenizer.ggml.pre", "joyai-llm");
    gguf_writer_add_str_array(w, "tokenizer.ggml.tokens", (const char *const *)vocab, (uint64_t)cfg.n_vocab);
    if (tokenizer) {
        gguf_writer_add_array(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, hv.types, (uint64_t)hv.n_tokens);
        gguf_writer_add_str_array(w, "tokenizer.ggml.merges", (const char *const *)hv.merges, (uint64_t)hv.n_merges);
        if (hv.bos >= 0) gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)hv.bos);
        if (hv.eos >= 0) gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)hv.eos);
    } else {
        gguf_writer_add_str_array(w, "tokenizer.ggml.merges", NULL, 0);
    }
    for (int64_t i = 0; i < n; i++) gguf_writer_add_tensor(w, specs[i].name, specs[i].type, specs[i].n_dims, specs[i].ne);
    ds4_status st = DS4_OK;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const int n_threads = cores < 1 ? 1 : cores > SYNTH_MAX_THREADS ? SYNTH_MAX_THREADS : (int)cores;
    for (int64_t i = 0; i < n && !st; i++) st = write_tensor(w, &specs[i], seed, i, &cfg, zero, n_threads, err);
    if (st) {
        const ds4_error *we = gguf_writer_error(w);
        rc = we->status ? ds4_error_set(err, we->status, "%s", we->message) : st;
        gguf_writer_abort(w);
    } else {
        rc = gguf_writer_finish(w, err);
    }
done:
    if (tokenizer) {
        hf_vocab_free(&hv);
    } else if (vocab) {
        for (int64_t i = 0; i < cfg.n_vocab; i++) free(vocab[i]);
        free(vocab);
    }
    free(specs);
    return rc;
}

/*
 * quant_iq2xxs.c - IQ2_XXS (GGML type 16), 2.0625 bits per weight.
 *
 * Block of 256 = f16 d, then 8 groups of 32 elements, each group 8 bytes:
 *   aux0 (u32 LE, bytes 0..3)  four grid indices, byte l for elements 8l..8l+7
 *   aux1 (u32 LE, bytes 4..7)  bits 7l..7l+6: sign index of elements 8l..8l+7
 *                              bits 28..31:  group scale s
 * Value of element j of subgroup l:
 *   db = (d * (0.5 + s)) * 0.25        (float32, in this order)
 *   y  = (db * grid[aux0 byte l][j]) * (sign bit j ? -1 : +1)
 * The grid (256 vectors of 8 magnitudes from {8, 25, 43}) is a fact of the
 * format, stored packed in quant_iq2xxs_grid.inc (generated). The sign
 * pattern of a 7-bit index i is i plus a parity bit 7 making the number of
 * negated elements even, so it is computed rather than stored.
 */
#include "core/quant.h"

#include <math.h>
#include <string.h>

#include "core/quant_iq2xxs_grid.inc"

#define QK DS4_QK_K

/* 2-bit grid code -> magnitude (code 3 never occurs in the table). */
static const uint8_t GRID_MAG[4] = { 8, 25, 43, 0 };
static const float SIGN_MUL[2] = { 1.0f, -1.0f };

uint8_t ds4_iq2xxs_grid_value(int g, int j) {
    if (g < 0 || g > 255 || j < 0 || j > 7) return 0;
    return GRID_MAG[(ds4_iq2xxs_grid_packed[g] >> (2 * j)) & 3];
}

static inline uint8_t sign_pattern(uint32_t index7) {
    uint32_t v = index7 & 127u;
    uint32_t p = v ^ (v >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    return (uint8_t)(v | ((p & 1u) << 7));
}

uint8_t ds4_iq2xxs_sign_pattern(int index7) { return sign_pattern((uint32_t)index7); }

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v); /* host is little-endian, as the format */
    return v;
}

static inline void store_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, sizeof v); }

static void dequant_block_iq2_xxs(const ds4_block_iq2_xxs *b, float *y) {
    const float d = ds4_f16_to_f32(b->d);
    const uint8_t *qs = (const uint8_t *)b->qs;
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux0 = load_u32(qs + 8 * ib), aux1 = load_u32(qs + 8 * ib + 4);
        const float db = d * (0.5f + (float)(aux1 >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++) {
            const uint16_t grid = ds4_iq2xxs_grid_packed[(aux0 >> (8 * l)) & 255];
            const uint8_t signs = sign_pattern(aux1 >> (7 * l));
            float *out = y + 32 * ib + 8 * l;
            for (int j = 0; j < 8; j++) {
                /* a real multiply by +-1 (not a negation), so that even a NaN
                 * keeps the sign bit numpy's db * grid * signs gives it */
                out[j] = (db * (float)GRID_MAG[(grid >> (2 * j)) & 3]) * SIGN_MUL[(signs >> j) & 1];
            }
        }
    }
}

void ds4_dequant_row_iq2_xxs(const void *src, float *dst, int64_t n) {
    const ds4_block_iq2_xxs *b = src;
    for (int64_t i = 0; i < n / QK; i++) dequant_block_iq2_xxs(&b[i], dst + i * QK);
}

float ds4_dot_f32_iq2_xxs(const void *row, const float *x, int64_t n) {
    const ds4_block_iq2_xxs *b = row;
    float buf[QK], sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        dequant_block_iq2_xxs(&b[i], buf);
        const float *xb = x + i * QK;
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += buf[j] * xb[j];
        sum += s;
    }
    return sum;
}

/*
 * As ggml's vec_dot_iq2_xxs_q8_K: per group an integer sum of
 * grid * sign * q8, times the odd integer 2s + 1 (db = d * (2s+1) / 8), summed
 * per block; then (f16(d) * x.d) * bsum in float, and the 1/8 applied once
 * at the end (exact: a power of two).
 */
float ds4_dot_q8_K_iq2_xxs(const void *row, const ds4_block_q8_K *x, int64_t n) {
    const ds4_block_iq2_xxs *b = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        const uint8_t *qs = (const uint8_t *)b[i].qs;
        const int8_t *q8 = x[i].qs;
        int32_t bsum = 0;
        for (int ib = 0; ib < 8; ib++) {
            const uint32_t aux0 = load_u32(qs + 8 * ib), aux1 = load_u32(qs + 8 * ib + 4);
            const int32_t ls = 2 * (int32_t)(aux1 >> 28) + 1;
            int32_t sumi = 0;
            for (int l = 0; l < 4; l++) {
                const uint16_t grid = ds4_iq2xxs_grid_packed[(aux0 >> (8 * l)) & 255];
                const uint8_t signs = sign_pattern(aux1 >> (7 * l));
                for (int j = 0; j < 8; j++) {
                    const int32_t p = GRID_MAG[(grid >> (2 * j)) & 3] * q8[j];
                    sumi += (signs >> j) & 1 ? -p : p;
                }
                q8 += 8;
            }
            bsum += sumi * ls;
        }
        sum += (ds4_f16_to_f32(b[i].d) * x[i].d) * (float)bsum;
    }
    return 0.125f * sum;
}

/* ------------------------------------------------------------------------ */
/* Reference encoder                                                         */
/* ------------------------------------------------------------------------ */
/*
 * A valid, simple (not optimal) encoder:
 *  1. Per 8-element subgroup the signs are those of x; if that makes an odd
 *     number of negatives (not representable: the 8th sign bit is parity),
 *     the sign of the smallest-|x| element is flipped. The targets are then
 *     t_j = x_j * sign_j >= 0 except for a flipped element (t_j = -|x_j|).
 *  2. For a subgroup with scale db the squared error of grid entry g is
 *     |t|^2 - 2 db <t, G_g> + db^2 |G_g|^2, so with <t, G_g> precomputed for
 *     all 256 entries, each (db, subgroup) costs 256 multiply-adds.
 *  3. For two candidate super-scales d (0.8 and 0.95 times the one that maps
 *     the block's largest |x| onto 43 at s = 15), every group tries all 16 scales
 *     s and keeps the best; the candidate d with the least total error wins.
 *     d is rounded to f16 before use, so the codes fit the stored scale.
 */

typedef struct iq2_ctx {
    float grid[256][8]; /* decoded magnitudes */
    float norm[256];    /* |G_g|^2 */
} iq2_ctx;

static void iq2_ctx_init(iq2_ctx *c) {
    for (int g = 0; g < 256; g++) {
        float s = 0.0f;
        for (int j = 0; j < 8; j++) {
            c->grid[g][j] = (float)GRID_MAG[(ds4_iq2xxs_grid_packed[g] >> (2 * j)) & 3];
            s += c->grid[g][j] * c->grid[g][j];
        }
        c->norm[g] = s;
    }
}

/* Best grid entry for a subgroup at scale db; returns the error less |t|^2. */
static float best_grid(const iq2_ctx *c, const float *dots, float db, int *g_out) {
    float best = INFINITY;
    int bg = 0;
    const float db2 = db * db;
    for (int g = 0; g < 256; g++) {
        const float e = db2 * c->norm[g] - 2.0f * db * dots[g];
        if (e < best) {
            best = e;
            bg = g;
        }
    }
    *g_out = bg;
    return best;
}

static void quantize_block_iq2_xxs(const iq2_ctx *c, const float *x, ds4_block_iq2_xxs *out) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]);
    memset(out, 0, sizeof *out);
    if (!(amax > 0.0f) || !isfinite(amax)) return; /* all zero (or unusable): d = 0 */

    uint8_t sidx[32];
    float dots[32][256];
    for (int sg = 0; sg < 32; sg++) {
        const float *xs = x + 8 * sg;
        unsigned mask = 0;
        int smallest = 0;
        for (int j = 0; j < 8; j++) {
            if (xs[j] < 0.0f) mask |= 1u << j;
            if (fabsf(xs[j]) < fabsf(xs[smallest])) smallest = j;
        }
        int neg = 0;
        for (int j = 0; j < 8; j++) neg += (mask >> j) & 1;
        if (neg & 1) mask ^= 1u << smallest;
        sidx[sg] = (uint8_t)(mask & 127u); /* bit 7 is implied by parity */
        float t[8];
        for (int j = 0; j < 8; j++) t[j] = (mask >> j) & 1 ? -xs[j] : xs[j];
        for (int g = 0; g < 256; g++) {
            float s = 0.0f;
            for (int j = 0; j < 8; j++) s += t[j] * c->grid[g][j];
            dots[sg][g] = s;
        }
    }

    static const float FACTORS[] = { 0.8f, 0.95f }; /* measured: more barely helps */
    const float d_base = amax / (43.0f * 15.5f * 0.25f);
    float best_total = INFINITY;
    uint16_t best_d = 0;
    int best_s[8] = { 0 }, best_g[32] = { 0 };
    for (size_t fi = 0; fi < sizeof FACTORS / sizeof FACTORS[0]; fi++) {
        const uint16_t dh = ds4_f32_to_f16(d_base * FACTORS[fi]);
        const float d = ds4_f16_to_f32(dh);
        if (!(d > 0.0f) || !isfinite(d)) continue;
        float total = 0.0f;
        int s_sel[8], g_sel[32];
        for (int ib = 0; ib < 8; ib++) {
            float gbest = INFINITY;
            for (int s = 0; s < 16; s++) {
                const float db = d * (0.5f + (float)s) * 0.25f;
                float e = 0.0f;
                int g4[4];
                for (int l = 0; l < 4; l++) e += best_grid(c, dots[4 * ib + l], db, &g4[l]);
                if (e < gbest) {
                    gbest = e;
                    s_sel[ib] = s;
                    for (int l = 0; l < 4; l++) g_sel[4 * ib + l] = g4[l];
                }
            }
            total += gbest;
        }
        if (total < best_total) {
            best_total = total;
            best_d = dh;
            memcpy(best_s, s_sel, sizeof best_s);
            memcpy(best_g, g_sel, sizeof best_g);
        }
    }
    if (!(best_total < INFINITY)) return; /* no usable d (e.g. underflow): zeros */

    out->d = best_d;
    uint8_t *qs = (uint8_t *)out->qs;
    for (int ib = 0; ib < 8; ib++) {
        uint32_t aux0 = 0, aux1 = (uint32_t)best_s[ib] << 28;
        for (int l = 0; l < 4; l++) {
            aux0 |= (uint32_t)best_g[4 * ib + l] << (8 * l);
            aux1 |= (uint32_t)sidx[4 * ib + l] << (7 * l);
        }
        store_u32(qs + 8 * ib, aux0);
        store_u32(qs + 8 * ib + 4, aux1);
    }
}

void ds4_quantize_row_iq2_xxs(const float *src, void *dst, int64_t n) {
    iq2_ctx c; /* ~9 KiB, rebuilt per call: cheap next to encoding one block */
    iq2_ctx_init(&c);
    ds4_block_iq2_xxs *b = dst;
    for (int64_t i = 0; i < n / QK; i++) quantize_block_iq2_xxs(&c, src + i * QK, &b[i]);
}

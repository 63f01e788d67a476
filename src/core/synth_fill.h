/*
 * synth_fill.h - seeded synthetic weight bytes, block by block, the same on
 * the host and on a device.
 *
 * A benchmark of a full-size model needs weights of the real shapes and
 * types, not real values; writing and reading an 87 GB file of random
 * weights costs minutes. A backend instead fills each weight where it lives
 * (device memory for CUDA) from a ds4_fill: block b of a tensor is a pure
 * function of (stream, b), computed with integer operations only (and, for
 * F32, one float multiply and add rounded as written), so the host and a
 * device produce identical bytes and any order of blocks gives the same
 * tensor. The values are valid and of the intended size:
 *   F32      center + half * u, u uniform in [-1, 1) on a 2^-23 grid;
 *   F16      a random sign and mantissa in one of the three binades below
 *            half's (|v| in [half / 16, half)), built as f16 bits;
 *   I32      expert-id tables: row r holds id_per_row consecutive ids
 *            (mod id_mod) from a random start, so they are distinct;
 *   Q8_0, Q2_K, Q4_K, IQ2_XXS   random bytes with the f16 scale fields
 *            (d, and dmin for the K-quants) set to d16[0], d16[1].
 * ds4_synth.c (the model layer) chooses center, half and the scales from a
 * tensor's role; backends call ds4_fill_block for every block.
 */
#ifndef DS4_CORE_SYNTH_FILL_H
#define DS4_CORE_SYNTH_FILL_H

#include <stdbool.h>
#include <stdint.h>

#include "core/quant.h"

#ifdef __CUDACC__
#define DS4_HD __host__ __device__
#else
#define DS4_HD
#endif

typedef struct ds4_fill {
    uint64_t stream;     /* the tensor's random stream (seed and tensor) */
    uint32_t type;       /* one of the types above */
    int32_t block_bytes; /* bytes of a block (of an element for F32/F16/I32) */
    int32_t block_elems; /* elements of a block (1 for F32/F16/I32) */
    float center, half;  /* F32 values; F16 uses half only */
    int32_t f16_exp;     /* F16: the biased exponent of half (4..30) */
    uint16_t d16[2];     /* quantised blocks: d, dmin */
    int32_t id_mod;      /* I32: ids in [0, id_mod) */
    int32_t id_per_row;  /* I32: ids per row (<= id_mod) */
} ds4_fill;

/* true when ds4_fill_block can fill blocks of this type. */
static inline DS4_HD bool ds4_fill_type_ok(uint32_t type) {
    return type == DS4_TYPE_F32 || type == DS4_TYPE_F16 || type == DS4_TYPE_I32 || type == DS4_TYPE_Q8_0 ||
           type == DS4_TYPE_Q2_K || type == DS4_TYPE_Q4_K || type == DS4_TYPE_IQ2_XXS;
}

/* splitmix64's finaliser: a well-mixed 64-bit value of x. */
static inline DS4_HD uint64_t ds4_fill_mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static inline DS4_HD void ds4_fill_put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* a * b + c with two roundings (never fused), on the host and the device. */
static inline DS4_HD float ds4_fill_mad(float a, float b, float c) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(__fmul_rn(a, b), c);
#else
    volatile float p = a * b; /* the C build also has -ffp-contract=off */
    return p + c;
#endif
}

/* Block b (element b for F32/F16/I32) of the tensor into dst
 * (f->block_bytes bytes). */
static inline DS4_HD void ds4_fill_block(const ds4_fill *f, int64_t b, uint8_t *dst) {
    const uint64_t s = f->stream ^ ((uint64_t)b * 0xD1B54A32D192ED03ULL);
    if (f->type == DS4_TYPE_F32) {
        const uint64_t h = ds4_fill_mix(s);
        const float u = (float)((int32_t)(h >> 40) - 8388608) * 1.1920928955078125e-07f; /* exact */
        const float v = ds4_fill_mad(f->half, u, f->center);
        union {
            float f;
            uint32_t u;
        } c;
        c.f = v;
        for (int i = 0; i < 4; i++) dst[i] = (uint8_t)(c.u >> (8 * i));
    } else if (f->type == DS4_TYPE_F16) {
        const uint64_t h = ds4_fill_mix(s);
        const uint32_t mant = (uint32_t)(h & 0x3ffu), down = 1u + (uint32_t)((h >> 10) % 3u);
        const uint32_t sign = (uint32_t)((h >> 16) & 1u) << 15;
        ds4_fill_put16(dst, (uint16_t)(sign | (((uint32_t)f->f16_exp - down) << 10) | mant));
    } else if (f->type == DS4_TYPE_I32) {
        const int64_t row = b / f->id_per_row, k = b % f->id_per_row;
        const uint64_t start = ds4_fill_mix(f->stream ^ ((uint64_t)row * 0x9E3779B97F4A7C15ULL));
        const uint32_t id = (uint32_t)((start % (uint64_t)f->id_mod + (uint64_t)k) % (uint64_t)f->id_mod);
        for (int i = 0; i < 4; i++) dst[i] = (uint8_t)(id >> (8 * i));
    } else {
        for (int i = 0; i < f->block_bytes; i += 8) {
            const uint64_t h = ds4_fill_mix(s + (uint64_t)i);
            for (int k = 0; k < 8 && i + k < f->block_bytes; k++) dst[i + k] = (uint8_t)(h >> (8 * k));
        }
        switch (f->type) {
        case DS4_TYPE_Q8_0:
        case DS4_TYPE_IQ2_XXS: ds4_fill_put16(dst, f->d16[0]); break;
        case DS4_TYPE_Q4_K:
            ds4_fill_put16(dst, f->d16[0]);
            ds4_fill_put16(dst + 2, f->d16[1]);
            break;
        case DS4_TYPE_Q2_K:
            ds4_fill_put16(dst + 80, f->d16[0]);
            ds4_fill_put16(dst + 82, f->d16[1]);
            break;
        default: break;
        }
    }
}

#endif

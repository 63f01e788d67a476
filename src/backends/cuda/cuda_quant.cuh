/*
 * cuda_quant.cuh - bit-exact per-element decoders of the GGUF weight types,
 * shared by the CUDA .cu files that read quantised weights (cuda_dequant.cu,
 * cuda_matmul.cu). Each including file gets its own copy of the constant
 * IQ2_XXS grid (no relocatable device code is needed).
 *
 * deq<T>::elem(block, e) is element e of a block of type T, bit-identical to
 * the CPU's dequant_row (see cuda_dequant.cu for the floating-point rules:
 * __fmul_rn / __fadd_rn / __fsub_rn, never contracted into an FMA).
 */
#ifndef DS4_BACKENDS_CUDA_QUANT_CUH
#define DS4_BACKENDS_CUDA_QUANT_CUH

#include <stdint.h>

#include <cuda_runtime.h>

#include "core/quant.h"

static_assert(sizeof(ds4_block_q8_0) == 34, "q8_0 block size");
static_assert(sizeof(ds4_block_q2_K) == 84, "q2_K block size");
static_assert(sizeof(ds4_block_q4_K) == 144, "q4_K block size");
static_assert(sizeof(ds4_block_q5_K) == 176, "q5_K block size");
static_assert(sizeof(ds4_block_q6_K) == 210, "q6_K block size");
static_assert(sizeof(ds4_block_iq2_xxs) == 66, "iq2_xxs block size");
static_assert(sizeof(ds4_block_q8_K) == 292, "q8_K block size");

/* ------------------------------------------------------------------------ */
/* The IQ2_XXS grid in constant memory, from the same generated table the    */
/* CPU uses (copied at compile time: no runtime upload, valid on every GPU). */
/* ------------------------------------------------------------------------ */

namespace ds4_iq2xxs_host {
#include "core/quant_iq2xxs_grid.inc"
}

struct iq2xxs_grid_table {
    uint16_t packed[256];
};

static constexpr iq2xxs_grid_table make_iq2xxs_grid() {
    iq2xxs_grid_table t{};
    for (int g = 0; g < 256; g++) t.packed[g] = ds4_iq2xxs_host::ds4_iq2xxs_grid_packed[g];
    return t;
}

static __constant__ iq2xxs_grid_table c_iq2xxs_grid = make_iq2xxs_grid();

/* ------------------------------------------------------------------------ */
/* Exact scalar helpers                                                      */
/* ------------------------------------------------------------------------ */

/* binary16 -> binary32 on the bits, the same algorithm as ds4_f16_to_f32
 * (so NaNs keep their payload and signalling bit, subnormals normalise). */
static __device__ __forceinline__ float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {
        /* mant in [1, 1023]: shift its leading one up to bit 10. */
        const uint32_t k = (uint32_t)__clz((int)mant) - 21u; /* 1 .. 10 */
        bits = sign | ((113u - k) << 23) | (((mant << k) & 0x3ffu) << 13);
    }
    return __uint_as_float(bits);
}

static __device__ __forceinline__ float i2f(int v) { return __int2float_rn(v); } /* exact for |v| < 2^24 */

static __device__ __forceinline__ float neg_bits(float v) { return __uint_as_float(__float_as_uint(v) ^ 0x80000000u); }

/* ------------------------------------------------------------------------ */
/* Per-type element decoders: value of element e of block b                  */
/* ------------------------------------------------------------------------ */

template <uint32_t T> struct deq;

template <> struct deq<DS4_TYPE_F32> {
    typedef uint32_t block;
    static constexpr int ELEMS = 1;
    static __device__ __forceinline__ float elem(const block *b, int) { return __uint_as_float(*b); }
};

template <> struct deq<DS4_TYPE_F16> {
    typedef uint16_t block;
    static constexpr int ELEMS = 1;
    static __device__ __forceinline__ float elem(const block *b, int) { return f16_to_f32(*b); }
};

template <> struct deq<DS4_TYPE_BF16> {
    typedef uint16_t block;
    static constexpr int ELEMS = 1;
    static __device__ __forceinline__ float elem(const block *b, int) { return __uint_as_float((uint32_t)*b << 16); }
};

/* y = (float)q * d */
template <> struct deq<DS4_TYPE_Q8_0> {
    typedef ds4_block_q8_0 block;
    static constexpr int ELEMS = DS4_QK8_0;
    static __device__ __forceinline__ float elem(const block *b, int e) {
        return __fmul_rn(i2f(b->qs[e]), f16_to_f32(b->d));
    }
};

/* e = 128h + 32s + l: q = (qs[32h + l] >> 2s) & 3, sub-block j = e/16,
 * y = (d * sc) * q - (dmin * m) */
template <> struct deq<DS4_TYPE_Q2_K> {
    typedef ds4_block_q2_K block;
    static constexpr int ELEMS = DS4_QK_K;
    static __device__ __forceinline__ float elem(const block *b, int e) {
        const int h = e >> 7, s = (e & 127) >> 5, l = e & 31, j = e >> 4;
        const float d = f16_to_f32(b->d), dmin = f16_to_f32(b->dmin);
        const int sc = b->scales[j];
        const float dl = __fmul_rn(d, i2f(sc & 15));
        const float ml = __fmul_rn(dmin, i2f(sc >> 4));
        const int q = (b->qs[32 * h + l] >> (2 * s)) & 3;
        return __fsub_rn(__fmul_rn(dl, i2f(q)), ml);
    }
};

/* The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block. */
static __device__ __forceinline__ void unpack_scale_min_k4(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* sub-block j = e/32, l = e%32: q = (qs[32(j/2) + l] >> 4(j%2)) & 15,
 * y = (d * sc) * q - (dmin * m) */
template <> struct deq<DS4_TYPE_Q4_K> {
    typedef ds4_block_q4_K block;
    static constexpr int ELEMS = DS4_QK_K;
    static __device__ __forceinline__ float elem(const block *b, int e) {
        const int j = e >> 5, l = e & 31;
        int sc, m;
        unpack_scale_min_k4(b->scales, j, &sc, &m);
        const float dl = __fmul_rn(f16_to_f32(b->d), i2f(sc));
        const float ml = __fmul_rn(f16_to_f32(b->dmin), i2f(m));
        const int q = (b->qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 15;
        return __fsub_rn(__fmul_rn(dl, i2f(q)), ml);
    }
};

/* As Q4_K, with bit 4 of q = bit j of qh[l]. */
template <> struct deq<DS4_TYPE_Q5_K> {
    typedef ds4_block_q5_K block;
    static constexpr int ELEMS = DS4_QK_K;
    static __device__ __forceinline__ float elem(const block *b, int e) {
        const int j = e >> 5, l = e & 31;
        int sc, m;
        unpack_scale_min_k4(b->scales, j, &sc, &m);
        const float dl = __fmul_rn(f16_to_f32(b->d), i2f(sc));
        const float ml = __fmul_rn(f16_to_f32(b->dmin), i2f(m));
        const int q = ((b->qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 15) | (((b->qh[l] >> j) & 1) << 4);
        return __fsub_rn(__fmul_rn(dl, i2f(q)), ml);
    }
};

/* e = 128h + i: low 4 bits (ql[64h + i%64] >> 4(i/64)) & 15, high 2 bits
 * (qh[32h + i%32] >> 2(i/32)) & 3; y = (d * scales[e/16]) * (q - 32) */
template <> struct deq<DS4_TYPE_Q6_K> {
    typedef ds4_block_q6_K block;
    static constexpr int ELEMS = DS4_QK_K;
    static __device__ __forceinline__ float elem(const block *b, int e) {
        const int h = e >> 7, i = e & 127;
        const int lo = (b->ql[64 * h + (i & 63)] >> (4 * (i >> 6))) & 15;
        const int hi = (b->qh[32 * h + (i & 31)] >> (2 * (i >> 5))) & 3;
        const float dl = __fmul_rn(f16_to_f32(b->d), i2f(b->scales[e >> 4]));
        return __fmul_rn(dl, i2f((lo | (hi << 4)) - 32));
    }
};

/* Group ib = e/32 (8 bytes: aux0, aux1 little-endian u32), subgroup
 * l = (e%32)/8, element j = e%8:
 *   db = (d * (0.5 + (aux1 >> 28))) * 0.25
 *   y  = db * grid[aux0 byte l][j], negated if bit j of sign_pattern(aux1 >> 7l) */
template <> struct deq<DS4_TYPE_IQ2_XXS> {
    typedef ds4_block_iq2_xxs block;
    static constexpr int ELEMS = DS4_QK_K;
    static __device__ __forceinline__ float elem(const block *b, int e) {
        const int ib = e >> 5, l = (e >> 3) & 3, j = e & 7;
        const uint32_t aux0 = (uint32_t)b->qs[4 * ib] | ((uint32_t)b->qs[4 * ib + 1] << 16);
        const uint32_t aux1 = (uint32_t)b->qs[4 * ib + 2] | ((uint32_t)b->qs[4 * ib + 3] << 16);
        const float db = __fmul_rn(__fmul_rn(f16_to_f32(b->d), __fadd_rn(0.5f, i2f((int)(aux1 >> 28)))), 0.25f);
        const uint32_t grid = c_iq2xxs_grid.packed[(aux0 >> (8 * l)) & 255u];
        const uint32_t code = (grid >> (2 * j)) & 3u; /* 0 -> 8, 1 -> 25, 2 -> 43 (3 unused -> 0) */
        const int mag = code == 0 ? 8 : code == 1 ? 25 : code == 2 ? 43 : 0;
        const uint32_t v7 = (aux1 >> (7 * l)) & 127u; /* sign pattern: 7 bits + even-parity bit 7 */
        const uint32_t signs = v7 | ((uint32_t)(__popc(v7) & 1) << 7);
        const float v = __fmul_rn(db, i2f(mag));
        return (signs >> j) & 1u ? neg_bits(v) : v;
    }
};

/* y = d * (float)q, d a float */
template <> struct deq<DS4_TYPE_Q8_K> {
    typedef ds4_block_q8_K block;
    static constexpr int ELEMS = DS4_QK_K;
    static __device__ __forceinline__ float elem(const block *b, int e) { return __fmul_rn(b->d, i2f(b->qs[e])); }
};

#endif

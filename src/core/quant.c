/*
 * quant.c - the type table, scalar conversions and the plain / 8-bit formats
 * (F32, F16, BF16, Q8_0, Q8_K). The K-quants live in quant_kquants.c and
 * IQ2_XXS in quant_iq2xxs.c.
 *
 * Floating-point contract: dequantisation reproduces gguf-py's numpy
 * dequantisers bit for bit, so every formula below keeps numpy's float32
 * operation order, and the build uses -ffp-contract=off (no FMA contraction).
 * On the targets we support FLT_EVAL_METHOD is 0, so float expressions are
 * evaluated in float, exactly like numpy's float32 arrays.
 */
#include "core/quant.h"

#include <ctype.h>
#include <float.h>
#include <math.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the block structs are read in place; GGUF data is little-endian"
#endif
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "float expressions must be evaluated in float for bit-exact dequantisation"
#endif

_Static_assert(sizeof(ds4_block_q8_0) == 34, "q8_0 block size");
_Static_assert(sizeof(ds4_block_q2_K) == 84, "q2_K block size");
_Static_assert(sizeof(ds4_block_q4_K) == 144, "q4_K block size");
_Static_assert(sizeof(ds4_block_q5_K) == 176, "q5_K block size");
_Static_assert(sizeof(ds4_block_q6_K) == 210, "q6_K block size");
_Static_assert(sizeof(ds4_block_iq2_xxs) == 66, "iq2_xxs block size");
_Static_assert(sizeof(ds4_block_q8_K) == 292, "q8_K block size");
_Static_assert(sizeof(float) == 4, "float must be IEEE binary32");

/* ------------------------------------------------------------------------ */
/* Scalar conversions                                                        */
/* ------------------------------------------------------------------------ */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/*
 * binary16 -> binary32, exact. binary16: 1 sign, 5 exponent (bias 15), 10
 * mantissa bits. Normal numbers re-bias the exponent (+112 = 127 - 15);
 * subnormals (exponent 0, value mant * 2^-24) are normalised by shifting the
 * mantissa up to the implicit-one position; inf/NaN keep their payload
 * (mant << 13), so a signalling NaN stays signalling - the same bits numpy's
 * float16 -> float32 cast produces.
 */
float ds4_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {
        /* mant * 2^-24 with mant in [1, 1023]: find the leading one. */
        uint32_t e = 113; /* biased exponent of 2^-14, the f16 normal minimum */
        while (!(mant & 0x400u)) {
            mant <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
    return f32_from_bits(bits);
}

/*
 * binary32 -> binary16, round to nearest, ties to even.
 *   |x| >= 65520 (half-way between 65504, the largest f16, and 2^16) -> inf
 *   normal range [2^-14, 65520): drop 13 mantissa bits with rounding; a carry
 *     out of the mantissa correctly bumps the exponent
 *   below 2^-14: f16 subnormal m * 2^-24, m = round(|x| / 2^-24); |x| <= 2^-25
 *     rounds to zero (2^-25 itself is a tie, and 0 is even)
 *   NaN: sign kept, top 10 payload bits kept, and a payload that would become
 *     0 (which would read as inf) is set to 1 - numpy's float16 cast does
 *     exactly this, so F16 / Q8_0 scales match gguf-py even for NaN input.
 */
uint16_t ds4_f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {
        uint32_t m = (a >> 13) & 0x3ffu;
        return (uint16_t)(sign | 0x7c00u | (m ? m : 1u));
    }
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 or inf */
    if (a >= 0x38800000u) {                                  /* >= 2^-14: normal */
        uint32_t h = (a >> 13) - (112u << 10);
        uint32_t rem = a & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    if (a <= 0x33000000u) return sign; /* <= 2^-25 */
    /* Subnormal result: |x| = m24 * 2^(e-150), wanted m = |x| * 2^24. */
    uint32_t e = a >> 23;                      /* 102 ..112 here */
    uint32_t m24 = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;                 /* 14 .. 24 */
    uint32_t h = m24 >> shift;
    uint32_t rem = m24 & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) h++; /* may carry into 0x400: 2^-14 */
    return (uint16_t)(sign | h);
}

/* bfloat16 is the top half of a binary32, so widening is a shift. */
float ds4_bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/*
 * binary32 -> bfloat16 as ggml / gguf-py do it: a NaN is forced quiet by
 * keeping its top 16 bits and setting bit 22 (the bf16 quiet bit); everything
 * else rounds to nearest even by adding 0x7fff plus the lowest kept bit and
 * truncating (overflow rounds to inf naturally through the exponent carry).
 */
uint16_t ds4_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    uint64_t r = (uint64_t)u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(r >> 16);
}

/* ------------------------------------------------------------------------ */
/* F32, F16, BF16 rows                                                       */
/* ------------------------------------------------------------------------ */

/* Q8_K's block of 256 is the unit of the dot_q8_K functions for plain types:
 * sum_i w_i * q_i in float over the block, then times the block scale d. */

static void dequant_row_f32(const void *src, float *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void quantize_row_f32(const float *src, void *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static float dot_f32_f32(const void *row, const float *x, int64_t n) {
    const float *w = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += w[i] * x[i];
    return sum;
}

static float dot_q8_K_f32(const void *row, const ds4_block_q8_K *x, int64_t n) {
    const float *w = row;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / DS4_QK_K; b++) {
        const float *wb = w + b * DS4_QK_K;
        float s = 0.0f;
        for (int i = 0; i < DS4_QK_K; i++) s += wb[i] * (float)x[b].qs[i];
        sum += s * x[b].d;
    }
    return sum;
}

static void dequant_row_f16(const void *src, float *dst, int64_t n) {
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++) dst[i] = ds4_f16_to_f32(h[i]);
}

static void quantize_row_f16(const float *src, void *dst, int64_t n) {
    uint16_t *h = dst;
    for (int64_t i = 0; i < n; i++) h[i] = ds4_f32_to_f16(src[i]);
}

static float dot_f32_f16(const void *row, const float *x, int64_t n) {
    const uint16_t *h = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += ds4_f16_to_f32(h[i]) * x[i];
    return sum;
}

static float dot_q8_K_f16(const void *row, const ds4_block_q8_K *x, int64_t n) {
    const uint16_t *h = row;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / DS4_QK_K; b++) {
        const uint16_t *hb = h + b * DS4_QK_K;
        float s = 0.0f;
        for (int i = 0; i < DS4_QK_K; i++) s += ds4_f16_to_f32(hb[i]) * (float)x[b].qs[i];
        sum += s * x[b].d;
    }
    return sum;
}

static void dequant_row_bf16(const void *src, float *dst, int64_t n) {
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++) dst[i] = ds4_bf16_to_f32(h[i]);
}

static void quantize_row_bf16(const float *src, void *dst, int64_t n) {
    uint16_t *h = dst;
    for (int64_t i = 0; i < n; i++) h[i] = ds4_f32_to_bf16(src[i]);
}

static float dot_f32_bf16(const void *row, const float *x, int64_t n) {
    const uint16_t *h = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += ds4_bf16_to_f32(h[i]) * x[i];
    return sum;
}

static float dot_q8_K_bf16(const void *row, const ds4_block_q8_K *x, int64_t n) {
    const uint16_t *h = row;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / DS4_QK_K; b++) {
        const uint16_t *hb = h + b * DS4_QK_K;
        float s = 0.0f;
        for (int i = 0; i < DS4_QK_K; i++) s += ds4_bf16_to_f32(hb[i]) * (float)x[b].qs[i];
        sum += s * x[b].d;
    }
    return sum;
}

/* ------------------------------------------------------------------------ */
/* Q8_0: blocks of 32, y = q * d with d an f16 and q an int8                */
/* ------------------------------------------------------------------------ */

static void dequant_row_q8_0(const void *src, float *dst, int64_t n) {
    const ds4_block_q8_0 *b = src;
    for (int64_t i = 0; i < n / DS4_QK8_0; i++) {
        const float d = ds4_f16_to_f32(b[i].d);
        float *y = dst + i * DS4_QK8_0;
        for (int j = 0; j < DS4_QK8_0; j++) y[j] = (float)b[i].qs[j] * d;
    }
}

/*
 * Reference Q8_0 quantiser, bit-exact with ggml's and gguf-py's:
 * d = amax / 127 (in float), id = 1/d (0 if d == 0), q = round-half-away(x*id),
 * then d is stored as f16. Note q is computed with the unrounded d.
 * Non-finite input gives unspecified (but defined) codes.
 */
static void quantize_row_q8_0(const float *src, void *dst, int64_t n) {
    ds4_block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / DS4_QK8_0; i++) {
        const float *x = src + i * DS4_QK8_0;
        float amax = 0.0f;
        for (int j = 0; j < DS4_QK8_0; j++) {
            float a = fabsf(x[j]);
            if (a > amax) amax = a;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = ds4_f32_to_f16(d);
        for (int j = 0; j < DS4_QK8_0; j++) {
            float r = roundf(x[j] * id);
            int q = r > 127.0f ? 127 : r < -127.0f ? -127 : (r == r ? (int)r : 0);
            b[i].qs[j] = (int8_t)q;
        }
    }
}

static float dot_f32_q8_0(const void *row, const float *x, int64_t n) {
    const ds4_block_q8_0 *b = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / DS4_QK8_0; i++) {
        const float d = ds4_f16_to_f32(b[i].d);
        const float *xb = x + i * DS4_QK8_0;
        float s = 0.0f;
        for (int j = 0; j < DS4_QK8_0; j++) s += ((float)b[i].qs[j] * d) * xb[j];
        sum += s;
    }
    return sum;
}

/* Integer dot per 32-element Q8_0 block against the matching 32 Q8_K int8
 * values, then scaled by f16(w.d) * x.d (as ggml's q8_0 x q8 dot does). */
static float dot_q8_K_q8_0(const void *row, const ds4_block_q8_K *x, int64_t n) {
    const ds4_block_q8_0 *b = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / DS4_QK8_0; i++) {
        const ds4_block_q8_K *xk = &x[i / (DS4_QK_K / DS4_QK8_0)];
        const int8_t *q8 = xk->qs + (i % (DS4_QK_K / DS4_QK8_0)) * DS4_QK8_0;
        int32_t isum = 0;
        for (int j = 0; j < DS4_QK8_0; j++) isum += (int32_t)b[i].qs[j] * q8[j];
        sum += (float)isum * (ds4_f16_to_f32(b[i].d) * xk->d);
    }
    return sum;
}

/* ------------------------------------------------------------------------ */
/* Q8_K: blocks of 256, float d, int8 q, int16 sums of each 16 q (bsums)     */
/* ------------------------------------------------------------------------ */

/*
 * The activation quantiser. Per block: m = the signed value of the first
 * element with the largest |x|. If m == 0 the block is all zeros. Otherwise
 * iscale = -127/m maps m to -127 exactly, q = round-half-even(iscale * x)
 * clamped to [-128, 127] (an element of the opposite sign with |x| == |m|
 * lands on +127), and d = 1/iscale.
 */
void ds4_quantize_row_q8_K(const float *src, ds4_block_q8_K *dst, int64_t n) {
    for (int64_t i = 0; i < n / DS4_QK_K; i++) {
        const float *x = src + i * DS4_QK_K;
        ds4_block_q8_K *y = &dst[i];
        float amax = 0.0f, m = 0.0f;
        for (int j = 0; j < DS4_QK_K; j++) {
            float a = fabsf(x[j]);
            if (a > amax) {
                amax = a;
                m = x[j];
            }
        }
        if (amax == 0.0f) {
            memset(y, 0, sizeof *y);
            continue;
        }
        const float iscale = -127.0f / m;
        for (int j = 0; j < DS4_QK_K; j++) {
            long q = lrintf(iscale * x[j]);
            y->qs[j] = (int8_t)(q > 127 ? 127 : q < -128 ? -128 : q);
        }
        for (int k = 0; k < DS4_QK_K / 16; k++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += y->qs[16 * k + j];
            y->bsums[k] = (int16_t)s;
        }
        y->d = 1.0f / iscale;
    }
}

static void quantize_row_q8_K(const float *src, void *dst, int64_t n) {
    ds4_quantize_row_q8_K(src, dst, n);
}

static void dequant_row_q8_K(const void *src, float *dst, int64_t n) {
    const ds4_block_q8_K *b = src;
    for (int64_t i = 0; i < n / DS4_QK_K; i++) {
        float *y = dst + i * DS4_QK_K;
        for (int j = 0; j < DS4_QK_K; j++) y[j] = b[i].d * (float)b[i].qs[j];
    }
}

static float dot_f32_q8_K(const void *row, const float *x, int64_t n) {
    const ds4_block_q8_K *b = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / DS4_QK_K; i++) {
        const float *xb = x + i * DS4_QK_K;
        float s = 0.0f;
        for (int j = 0; j < DS4_QK_K; j++) s += (b[i].d * (float)b[i].qs[j]) * xb[j];
        sum += s;
    }
    return sum;
}

static float dot_q8_K_q8_K(const void *row, const ds4_block_q8_K *x, int64_t n) {
    const ds4_block_q8_K *b = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / DS4_QK_K; i++) {
        int32_t isum = 0;
        for (int j = 0; j < DS4_QK_K; j++) isum += (int32_t)b[i].qs[j] * x[i].qs[j];
        sum += (float)isum * (b[i].d * x[i].d);
    }
    return sum;
}

/* ------------------------------------------------------------------------ */
/* The type table                                                            */
/* ------------------------------------------------------------------------ */

#define SIZE_ONLY(id, nm, elems, bytes) [id] = { nm, elems, bytes, NULL, NULL, NULL, NULL }
#define WITH_FNS(id, nm, elems, bytes, deq, quant, dotf, dotk) \
    [id] = { nm, elems, bytes, deq, quant, dotf, dotk }

/* Sizes are those of ggml's block structs (Q8_1 is 36: f16 d, f16 s, 32 q;
 * some gguf-py versions still list its pre-2024 40-byte float layout). */
static const ds4_type_traits TYPE_TABLE[DS4_TYPE_COUNT] = {
    WITH_FNS(DS4_TYPE_F32, "F32", 1, 4, dequant_row_f32, quantize_row_f32, dot_f32_f32, dot_q8_K_f32),
    WITH_FNS(DS4_TYPE_F16, "F16", 1, 2, dequant_row_f16, quantize_row_f16, dot_f32_f16, dot_q8_K_f16),
    SIZE_ONLY(DS4_TYPE_Q4_0, "Q4_0", 32, 18),
    SIZE_ONLY(DS4_TYPE_Q4_1, "Q4_1", 32, 20),
    SIZE_ONLY(DS4_TYPE_Q5_0, "Q5_0", 32, 22),
    SIZE_ONLY(DS4_TYPE_Q5_1, "Q5_1", 32, 24),
    WITH_FNS(DS4_TYPE_Q8_0, "Q8_0", 32, 34, dequant_row_q8_0, quantize_row_q8_0, dot_f32_q8_0,
             dot_q8_K_q8_0),
    SIZE_ONLY(DS4_TYPE_Q8_1, "Q8_1", 32, 36),
    WITH_FNS(DS4_TYPE_Q2_K, "Q2_K", 256, 84, ds4_dequant_row_q2_K, ds4_quantize_row_q2_K,
             ds4_dot_f32_q2_K, ds4_dot_q8_K_q2_K),
    SIZE_ONLY(DS4_TYPE_Q3_K, "Q3_K", 256, 110),
    WITH_FNS(DS4_TYPE_Q4_K, "Q4_K", 256, 144, ds4_dequant_row_q4_K, ds4_quantize_row_q4_K,
             ds4_dot_f32_q4_K, ds4_dot_q8_K_q4_K),
    WITH_FNS(DS4_TYPE_Q5_K, "Q5_K", 256, 176, ds4_dequant_row_q5_K, ds4_quantize_row_q5_K,
             ds4_dot_f32_q5_K, ds4_dot_q8_K_q5_K),
    WITH_FNS(DS4_TYPE_Q6_K, "Q6_K", 256, 210, ds4_dequant_row_q6_K, ds4_quantize_row_q6_K,
             ds4_dot_f32_q6_K, ds4_dot_q8_K_q6_K),
    WITH_FNS(DS4_TYPE_Q8_K, "Q8_K", 256, 292, dequant_row_q8_K, quantize_row_q8_K, dot_f32_q8_K,
             dot_q8_K_q8_K),
    WITH_FNS(DS4_TYPE_IQ2_XXS, "IQ2_XXS", 256, 66, ds4_dequant_row_iq2_xxs, ds4_quantize_row_iq2_xxs,
             ds4_dot_f32_iq2_xxs, ds4_dot_q8_K_iq2_xxs),
    SIZE_ONLY(DS4_TYPE_IQ2_XS, "IQ2_XS", 256, 74),
    SIZE_ONLY(DS4_TYPE_IQ3_XXS, "IQ3_XXS", 256, 98),
    SIZE_ONLY(DS4_TYPE_IQ1_S, "IQ1_S", 256, 50),
    SIZE_ONLY(DS4_TYPE_IQ4_NL, "IQ4_NL", 32, 18),
    SIZE_ONLY(DS4_TYPE_IQ3_S, "IQ3_S", 256, 110),
    SIZE_ONLY(DS4_TYPE_IQ2_S, "IQ2_S", 256, 82),
    SIZE_ONLY(DS4_TYPE_IQ4_XS, "IQ4_XS", 256, 136),
    SIZE_ONLY(DS4_TYPE_I8, "I8", 1, 1),
    SIZE_ONLY(DS4_TYPE_I16, "I16", 1, 2),
    SIZE_ONLY(DS4_TYPE_I32, "I32", 1, 4),
    SIZE_ONLY(DS4_TYPE_I64, "I64", 1, 8),
    SIZE_ONLY(DS4_TYPE_F64, "F64", 1, 8),
    SIZE_ONLY(DS4_TYPE_IQ1_M, "IQ1_M", 256, 56),
    WITH_FNS(DS4_TYPE_BF16, "BF16", 1, 2, dequant_row_bf16, quantize_row_bf16, dot_f32_bf16,
             dot_q8_K_bf16),
    SIZE_ONLY(DS4_TYPE_TQ1_0, "TQ1_0", 256, 54),
    SIZE_ONLY(DS4_TYPE_TQ2_0, "TQ2_0", 256, 66),
    SIZE_ONLY(DS4_TYPE_MXFP4, "MXFP4", 32, 17),
    /* ids 4, 5 (removed Q4_2/Q4_3), 31-33, 36-38 (removed) stay zeroed: unknown */
};

const ds4_type_traits *ds4_type_traits_get(uint32_t type) {
    if (type >= DS4_TYPE_COUNT || TYPE_TABLE[type].name == NULL) return NULL;
    return &TYPE_TABLE[type];
}

const char *ds4_type_name(uint32_t type) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    return t ? t->name : "unknown";
}

int ds4_type_from_name(const char *name) {
    if (!name) return -1;
    for (int id = 0; id < DS4_TYPE_COUNT; id++) {
        const char *tn = TYPE_TABLE[id].name;
        if (!tn) continue;
        size_t k = 0;
        while (tn[k] && name[k] && toupper((unsigned char)name[k]) == (unsigned char)tn[k]) k++;
        if (tn[k] == '\0' && name[k] == '\0') return id;
    }
    return -1;
}

int64_t ds4_type_row_bytes(uint32_t type, int64_t n) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    if (!t || n < 0 || n % t->block_elems != 0) return -1;
    int64_t blocks = n / t->block_elems;
    if (blocks > INT64_MAX / t->block_bytes) return -1;
    return blocks * t->block_bytes;
}

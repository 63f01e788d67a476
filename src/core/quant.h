/*
 * quant.h - tensor element types and quantised block formats (CPU reference).
 *
 * Type ids are the GGML/GGUF ids stored in files. The block layouts below are
 * facts of the GGUF format: a tensor row of n elements is n/block_elems blocks
 * laid end to end, and a block is exactly block_bytes bytes, little-endian.
 *
 * For each supported type this module provides, per row:
 *   dequant_row   blocks -> float32
 *   quantize_row  float32 -> blocks (reference quantiser, used by synth/tests)
 *   dot_f32       sum_i w_i * x_i against a float32 vector
 *   dot_q8_K      sum_i w_i * x_i against Q8_K-quantised activations, computed
 *                 the way ggml's vec_dot_*_q8_K does: integer sums per
 *                 sub-block, scaled in float (DS4's routed-expert semantics)
 * These are the clear reference paths every fast path is tested against.
 */
#ifndef DS4_CORE_QUANT_H
#define DS4_CORE_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ds4_type {
    DS4_TYPE_F32 = 0,
    DS4_TYPE_F16 = 1,
    DS4_TYPE_Q4_0 = 2,
    DS4_TYPE_Q4_1 = 3,
    DS4_TYPE_Q5_0 = 6,
    DS4_TYPE_Q5_1 = 7,
    DS4_TYPE_Q8_0 = 8,
    DS4_TYPE_Q8_1 = 9,
    DS4_TYPE_Q2_K = 10,
    DS4_TYPE_Q3_K = 11,
    DS4_TYPE_Q4_K = 12,
    DS4_TYPE_Q5_K = 13,
    DS4_TYPE_Q6_K = 14,
    DS4_TYPE_Q8_K = 15,
    DS4_TYPE_IQ2_XXS = 16,
    DS4_TYPE_IQ2_XS = 17,
    DS4_TYPE_IQ3_XXS = 18,
    DS4_TYPE_IQ1_S = 19,
    DS4_TYPE_IQ4_NL = 20,
    DS4_TYPE_IQ3_S = 21,
    DS4_TYPE_IQ2_S = 22,
    DS4_TYPE_IQ4_XS = 23,
    DS4_TYPE_I8 = 24,
    DS4_TYPE_I16 = 25,
    DS4_TYPE_I32 = 26,
    DS4_TYPE_I64 = 27,
    DS4_TYPE_F64 = 28,
    DS4_TYPE_IQ1_M = 29,
    DS4_TYPE_BF16 = 30,
    DS4_TYPE_TQ1_0 = 34,
    DS4_TYPE_TQ2_0 = 35,
    DS4_TYPE_MXFP4 = 39,
    DS4_TYPE_COUNT = 40, /* one past the largest id in the table */
} ds4_type;

#define DS4_QK_K 256 /* elements per K-quant / IQ super-block */
#define DS4_QK8_0 32

/* ---- block layouts (sizes are asserted in quant.c) ---- */

typedef struct { uint16_t d; int8_t qs[32]; } ds4_block_q8_0;                         /* 34 */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } ds4_block_q2_K; /* 84 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } ds4_block_q4_K; /* 144 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } ds4_block_q5_K; /* 176 */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } ds4_block_q6_K; /* 210 */
typedef struct { uint16_t d; uint16_t qs[32]; } ds4_block_iq2_xxs;                    /* 66 */
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } ds4_block_q8_K;         /* 292 */

typedef void (*ds4_dequant_row_fn)(const void *src, float *dst, int64_t n);
typedef void (*ds4_quantize_row_fn)(const float *src, void *dst, int64_t n);
typedef float (*ds4_dot_f32_fn)(const void *row, const float *x, int64_t n);
typedef float (*ds4_dot_q8_K_fn)(const void *row, const ds4_block_q8_K *x, int64_t n);

typedef struct ds4_type_traits {
    const char *name;        /* GGUF spelling: "F32", "Q4_K", "IQ2_XXS", ... */
    int32_t block_elems;     /* elements per block (1 for plain types) */
    int32_t block_bytes;     /* bytes per block */
    /* NULL where not implemented (the type is still known for sizes). */
    ds4_dequant_row_fn dequant_row;
    ds4_quantize_row_fn quantize_row;
    ds4_dot_f32_fn dot_f32;
    ds4_dot_q8_K_fn dot_q8_K;
} ds4_type_traits;

/* Traits of a type id, or NULL if the id is not a known GGML type. */
const ds4_type_traits *ds4_type_traits_get(uint32_t type);
const char *ds4_type_name(uint32_t type); /* "unknown" for unknown ids */
/* Parse a GGUF type name ("q8_0", "IQ2_XXS", case-insensitive); -1 if unknown. */
int ds4_type_from_name(const char *name);

/* Bytes of a row of n elements, or -1 if the type is unknown or n is not a
 * multiple of its block size. */
int64_t ds4_type_row_bytes(uint32_t type, int64_t n);

/* ---- scalar conversions (exact, round to nearest even) ---- */
float ds4_f16_to_f32(uint16_t h);
uint16_t ds4_f32_to_f16(float f);
float ds4_bf16_to_f32(uint16_t h);
uint16_t ds4_f32_to_bf16(float f); /* NaN quieted, as ggml does */

/* ---- the IQ2_XXS tables (facts of the format) ---- */
/* Grid entry g: 8 magnitudes, each one of {8, 25, 43}; value j of entry g. */
uint8_t ds4_iq2xxs_grid_value(int g, int j);
/* Sign pattern for a 7-bit index: bit j set = negate element j; bit 7 is the
 * parity bit that makes the number of negated elements even. */
uint8_t ds4_iq2xxs_sign_pattern(int index7);

/* Convenience: Q8_K activation quantiser (n multiple of 256). */
void ds4_quantize_row_q8_K(const float *src, ds4_block_q8_K *dst, int64_t n);

/* ---- per-type row functions (the same ones the traits table points to) ----
 * Defined in quant_kquants.c and quant_iq2xxs.c; declared here so quant.c can
 * build the table and so fast paths can be tested against them directly. */
void ds4_dequant_row_q2_K(const void *src, float *dst, int64_t n);
void ds4_quantize_row_q2_K(const float *src, void *dst, int64_t n);
float ds4_dot_f32_q2_K(const void *row, const float *x, int64_t n);
float ds4_dot_q8_K_q2_K(const void *row, const ds4_block_q8_K *x, int64_t n);

void ds4_dequant_row_q4_K(const void *src, float *dst, int64_t n);
void ds4_quantize_row_q4_K(const float *src, void *dst, int64_t n);
float ds4_dot_f32_q4_K(const void *row, const float *x, int64_t n);
float ds4_dot_q8_K_q4_K(const void *row, const ds4_block_q8_K *x, int64_t n);

void ds4_dequant_row_q5_K(const void *src, float *dst, int64_t n);
void ds4_quantize_row_q5_K(const float *src, void *dst, int64_t n);
float ds4_dot_f32_q5_K(const void *row, const float *x, int64_t n);
float ds4_dot_q8_K_q5_K(const void *row, const ds4_block_q8_K *x, int64_t n);

void ds4_dequant_row_q6_K(const void *src, float *dst, int64_t n);
void ds4_quantize_row_q6_K(const float *src, void *dst, int64_t n);
float ds4_dot_f32_q6_K(const void *row, const float *x, int64_t n);
float ds4_dot_q8_K_q6_K(const void *row, const ds4_block_q8_K *x, int64_t n);

void ds4_dequant_row_iq2_xxs(const void *src, float *dst, int64_t n);
void ds4_quantize_row_iq2_xxs(const float *src, void *dst, int64_t n);
float ds4_dot_f32_iq2_xxs(const void *row, const float *x, int64_t n);
float ds4_dot_q8_K_iq2_xxs(const void *row, const ds4_block_q8_K *x, int64_t n);

#ifdef __cplusplus
}
#endif

#endif

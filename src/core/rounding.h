/*
 * rounding.h - DS4's scalar rounding primitives (spec 3.0), in plain C.
 *
 * These are the reference definitions every backend is tested against:
 * IEEE half round trips, the FP8 E4M3 round trip of KV rows and the indexer's
 * Hadamard + FP4 E2M1 "QAT" round trip. All round to nearest, ties to even,
 * under the default floating-point environment (round-to-nearest mode).
 */
#ifndef DS4_CORE_ROUNDING_H
#define DS4_CORE_ROUNDING_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* f32 -> f16 -> f32, round to nearest even (|v| >= 65520 becomes inf). */
float ds4_round_f16(float v);

/* Nearest E4M3FN value (magnitudes of codes 0..126: 0, 2^-9 .. 448), ties to
 * the even code, sign kept (-0 stays -0). |v| > 448 (inf included) saturates
 * to 448; NaN stays NaN. (ds4.c maps NaN to 448 and -0 to +0; see rounding.c.) */
float ds4_round_fp8_e4m3(float v);

/* Nearest of {0, 0.5, 1, 1.5, 2, 3, 4, 6} in magnitude, ties to the even
 * index, sign kept; |v| > 6 saturates to 6; NaN stays NaN. */
float ds4_round_fp4_e2m1(float v);

/* FP8 KV round trip of one row (spec 3.0): dims [0, dim - n_rope) in blocks of
 * 64 (a shorter last block if dim - n_rope is not a multiple of 64), each with
 * scale = 2^ceil(log2(max(amax, 1e-4) / 448)) and v = round_fp8(clamp(x /
 * scale, -448, 448)) * scale. The last n_rope dims are untouched. */
void ds4_fp8_kv_round_row(float *x, int64_t dim, int64_t n_rope);

/* In-place orthonormal Walsh-Hadamard transform in natural (Sylvester) order:
 * butterflies with stride 1, 2, 4, ... (a + b, a - b), then times 1/sqrt(n).
 * n must be a power of two (the caller checks; other n leave x unchanged). */
void ds4_hadamard_row(float *x, int64_t n);

/* Indexer QAT round trip (spec 3.0): Hadamard, then FP4 E2M1 in blocks of 32
 * with scale = 2^ceil(log2(max(amax, 7.052966104933725e-38) / 6)). The row
 * stays in the Hadamard basis. n a power of two. */
void ds4_indexer_qat_row(float *x, int64_t n);

#ifdef __cplusplus
}
#endif

#endif

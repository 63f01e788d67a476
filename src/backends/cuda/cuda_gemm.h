/*
 * cuda_gemm.h - batched (prefill) products on the tensor cores (cuda_gemm.cu).
 */
#ifndef DS4_BACKENDS_CUDA_GEMM_H
#define DS4_BACKENDS_CUDA_GEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backends/backend.h"

#define CUDA_GEMM_MIN_TOKENS 9    /* below this the matvec / tile kernels are used */
#define CUDA_GEMM_MAX_GROUPS 2048 /* groups of one cuda_gemm_q8_0_grouped launch */

/* true when a Q8_0 weight of n_in-element rows (row_bytes apart) times n_tok
 * DS4 Q8_0 activation rows (x_row_bytes apart) can use the int8 GEMM. */
bool cuda_gemm_q8_0_fits(int64_t n_in, int64_t row_bytes, int64_t x_row_bytes, int64_t n_tok);

/* out[m][o] (m * out_stride) = W[o] . x[m] for o < n_out, m < n_tok under DS4
 * numerics (w: the first weight row; xq: DS4 Q8_0 activation rows). false
 * with the error recorded when it could not be launched. */
bool cuda_gemm_q8_0(ds4_backend *be, const void *w, int64_t row_bytes, int64_t n_in, int64_t n_out, const void *xq,
                    int64_t x_row_bytes, int64_t n_tok, float *out, int64_t out_stride);

/* n_groups such products in one launch (the matmul_grouped op): group g
 * multiplies weight rows [g n_out, (g + 1) n_out) by elements
 * [g n_in, (g + 1) n_in) of each activation row (whole Q8_0 blocks: the rows
 * hold n_groups n_in elements) into outputs [g n_out, (g + 1) n_out) of each
 * output row. Skinny products (few tokens) split K over several blocks and
 * sum the parts in order. */
bool cuda_gemm_q8_0_grouped(ds4_backend *be, const void *w, int64_t row_bytes, int64_t n_in, int64_t n_out,
                            int64_t n_groups, const void *xq, int64_t x_row_bytes, int64_t n_tok, float *out,
                            int64_t out_stride);

/* true when F16 weights with n_in-element rows (row_bytes apart) times n_tok
 * float activation rows can use the f16 tensor-core GEMM. */
bool cuda_gemm_f16_fits(uint32_t type, int64_t n_in, int64_t row_bytes, int64_t n_tok);

/* Bytes of device scratch cuda_gemm_f16 needs for n_tok rows of n_in (the
 * split activations and their scales; 16-byte aligned). */
size_t cuda_gemm_f16_scratch(int64_t n_in, int64_t n_tok);

/* out[m][o] = W[o] . x[m] (DS4's float products: float activations, float
 * sums) for o < n_out, m < n_tok; w the first weight row (16-byte aligned
 * rows of row_bytes). false with the error recorded when it could not be
 * launched. */
bool cuda_gemm_f16(ds4_backend *be, const void *w, int64_t row_bytes, int64_t n_in, int64_t n_out, const float *x,
                   int64_t x_stride, int64_t n_tok, float *out, int64_t out_stride, void *scratch);

#endif

/*
 * cuda_hc_comb.cuh - the Sinkhorn half of the HC split on one warp: from a
 * row's comb logits (mix * scale[2] + base, lane L holding entry L = row
 * L / n, column L % n) the row-wise softmax plus eps, then `iters` rounds
 * of column (and, after the first, row) normalisation, each sum gathered
 * by shuffles in the CPU's order, so every lane computes exactly the CPU's
 * sums and quotients (cpu_hc_ffn.c's hc_split). hc_pre's finishing kernel
 * runs it inline, or leaves the logits in comb for a cuda_comb_task: the
 * kernel of its own in cuda_hc_ffn.cu, or blocks of a weight product that
 * run beside it (cuda_matvec.cu).
 */
#pragma once

#include "backends/cuda/cuda_internal.h"

/* NT > 0: the stream count known when compiling (the model's 4: the sums
 * are straight-line shuffles and adds); 0: n_hc. All 32 lanes call it;
 * lanes at or past n * n carry values that nothing keeps. */
template <int NT>
static __device__ __forceinline__ float hc_comb_rounds(float v, int n_hc, float eps, int iters) {
    const int n = NT > 0 ? NT : n_hc, lane = threadIdx.x & 31;
    const bool mine = lane < n * n;
    const int r = mine ? lane / n : 0, c = mine ? lane % n : 0;
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < n; j++) {
        const float o = __shfl_sync(0xffffffffu, v, r * n + j);
        if (o > m) m = o;
    }
    v = cuda_expf(__fsub_rn(v, m));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < n; j++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, v, r * n + j));
    v = __fadd_rn(__fmul_rn(v, __frcp_rn(sum)), eps);
    for (int iter = 0; iter < iters; iter++) {
        if (iter > 0) {
            sum = 0.0f;
#pragma unroll
            for (int j = 0; j < n; j++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, v, r * n + j));
            v = __fmul_rn(v, __frcp_rn(__fadd_rn(sum, eps)));
        }
        sum = 0.0f;
#pragma unroll
        for (int j = 0; j < n; j++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, v, j * n + c));
        v = __fmul_rn(v, __frcp_rn(__fadd_rn(sum, eps)));
    }
    return v;
}

/* Row `row` of task t on the calling warp (a row past the task's: nothing;
 * the whole warp takes the same branch). The logits are read and the comb
 * written in place. */
static __device__ __forceinline__ void hc_comb_row(const cuda_comb_task &t, int64_t row) {
    if (row >= t.n_rows) return;
    const int n = t.n_hc, lane = threadIdx.x & 31, nn = n * n;
    float *C = t.comb + row * nn;
    float v = lane < nn ? C[lane] : 0.0f;
    v = n == 4 ? hc_comb_rounds<4>(v, n, t.eps, t.iters) : hc_comb_rounds<0>(v, n, t.eps, t.iters);
    if (lane < nn) C[lane] = v;
}

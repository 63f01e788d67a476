/*
 * cuda_matmul.cu - weight x activation products on the GPU: activation
 * quantisation, the matmul op and the routed-expert (MoE) op.
 *
 * The four dot kinds of the CPU backend (cpu_matmul.c), chosen the same way
 * from the weight type and the numerics:
 *   MM_REF   REFERENCE, every type: each weight element dequantised exactly as
 *            the CPU does (deq<T>, bit-identical), products and sums in
 *            float64 (a float*float product is exact in double), rounded to
 *            float once. Only the order of the double additions differs from
 *            the CPU, so results agree to the float rounding of the sum.
 *   MM_F32   DS4, F32/F16/BF16: float products and float sums (fmaf per lane,
 *            then a warp tree); the CPU uses 8 interleaved float partial
 *            sums, so the two differ by float summation-order error only.
 *   MM_Q8_0  DS4, Q8_0 weights: every activation row quantised to DS4's Q8_0
 *            activation blocks (float d = amax/127, q = round-half-even(x/d)
 *            clamped) - bit-identical to the CPU's quantiser - then per block
 *            an exact int8 dot, and the block term (f16(w.d) * x.d) * isum
 *            computed with the CPU's float operations; only the order of the
 *            float sum over blocks differs.
 *   MM_Q8_K  DS4, K-quants / IQ2_XXS / Q8_K weights: activations quantised to
 *            Q8_K bit-identically to ds4_quantize_row_q8_K; per 256-block the
 *            integer sums (sum_j sc_j * isub_j, sum_j m_j * bsum_j) are exact
 *            integers (any order), the block term uses the CPU's float
 *            formula, and the block terms are added in the CPU's order (lane
 *            0, block by block, from 0.0f), so the result is the CPU's bit
 *            for bit.
 * All float arithmetic whose rounding matters goes through __fmul_rn /
 * __fadd_rn / __fsub_rn / __fdiv_rn (never contracted into an FMA: the build
 * uses --fmad=true).
 *
 * Kernel layout: one warp per output (weight) row, 4 warps per thread block;
 * blockIdx.y walks tiles of ROWS activation rows (1, 4 or 8), so each decoded
 * weight chunk is reused for ROWS activation rows from registers. Inside a
 * row, lane l handles elements 8l..8l+7 of each 256-block (K-quants, Q8_K
 * acts; 8-byte contiguous reads per lane), 8-element chunks for Q8_0 (four
 * lanes per 32-block), or every 32nd element for float types (coalesced).
 *
 * MoE (one token): the selected experts' gate and up rows are the same kernels
 * with a row indirection (row = sel[k] * rows_per_expert + j, shared
 * activation row), then a SwiGLU kernel applies the routing weight, each mid
 * row is quantised on its own, the down rows run the same way, and the n_used
 * partial outputs are added in the order k = 0, 1, ... as the CPU does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_gemm.h"
#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/cuda_matvec.h"
#include "backends/cuda/cuda_quant.cuh"

#define MM_WARPS 4
#define MM_THREADS (32 * MM_WARPS)
#define FULL_MASK 0xffffffffu
#define MOE_MAX_USED 256

typedef enum mm_mode { MM_REF, MM_F32, MM_Q8_0, MM_Q8_K } mm_mode;

/* DS4's Q8_0 activation block: float scale, 32 int8 codes. */
struct act_q8_0 {
    float d;
    int8_t q[32];
};
static_assert(sizeof(act_q8_0) == 36, "q8_0 activation block size");

/* One launch's geometry. Weight row of output o for activation-row tile y:
 * (sel ? sel[y] * rows_per_expert : row0) + o (with sel, ROWS is 1). Row r of
 * the activations is act + r * act_stride (floats, or quantised blocks), row
 * r of the outputs out + r * out_stride. */
struct mm_args {
    const uint8_t *w;
    int64_t row_bytes;
    int64_t n; /* elements per weight row */
    int64_t row0;
    const int32_t *sel;
    int64_t rows_per_expert;
    int64_t n_out;
    const void *act;
    int64_t act_stride;
    float *out;
    int64_t out_stride;
    int64_t n_rows;
    int64_t y0; /* first tile of this launch */
};

/* ------------------------------------------------------------------------ */
/* Activation quantisers                                                     */
/* ------------------------------------------------------------------------ */

/* Where block ib of row `row` (nb blocks a row) goes: interleaved blocks,
 * or the split layout of cuda_matvec.h (per row: codes, then d, then bsums). */
struct q8_K_dst {
    int8_t *qs;
    int16_t *bsums;
    float *dp;
};
static __device__ __forceinline__ q8_K_dst q8_K_place(ds4_block_q8_K *out, int64_t row, int64_t ib, int64_t nb,
                                                      bool split) {
    q8_K_dst d;
    if (split) {
        uint8_t *base = (uint8_t *)out + row * nb * (int64_t)sizeof(ds4_block_q8_K);
        d.qs = (int8_t *)(base + ib * DS4_QK_K);
        d.dp = (float *)(base + nb * DS4_QK_K) + ib;
        d.bsums = (int16_t *)(base + nb * (DS4_QK_K + 4)) + ib * (DS4_QK_K / 16);
    } else {
        ds4_block_q8_K *y = out + row * nb + ib;
        d.qs = y->qs;
        d.bsums = y->bsums;
        d.dp = &y->d;
    }
    return d;
}

/*
 * Q8_K, one thread block of 256 threads per (row, 256-block), thread t
 * holding element t (v): as ds4_quantize_row_q8_K, m = the first element of
 * largest |x| (NaNs never win, as `a > amax` never holds for them); m == 0
 * -> an all-zero block; iscale = -127/m, q = round-half-even(iscale * x)
 * clamped to [-128, 127], bsums of 16, d = 1/iscale.
 */
static __device__ __forceinline__ void q8_K_block(float v, q8_K_dst dst) {
    __shared__ float s_a[8];
    __shared__ int s_i[8];
    __shared__ float s_x[DS4_QK_K];
    __shared__ float s_m;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    s_x[t] = v;
    float ba = fabsf(v);
    if (!(ba == ba)) ba = -1.0f;
    int bi = t;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float oa = __shfl_xor_sync(FULL_MASK, ba, off);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, off);
        if (oa > ba || (oa == ba && oi < bi)) ba = oa, bi = oi;
    }
    if (lane == 0) s_a[warp] = ba, s_i[warp] = bi;
    __syncthreads();
    if (warp == 0) {
        ba = lane < 8 ? s_a[lane] : -2.0f;
        bi = lane < 8 ? s_i[lane] : 1 << 30;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float oa = __shfl_xor_sync(FULL_MASK, ba, off);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, off);
            if (oa > ba || (oa == ba && oi < bi)) ba = oa, bi = oi;
        }
        if (lane == 0) s_m = ba > 0.0f ? s_x[bi] : 0.0f;
    }
    __syncthreads();
    const float m = s_m;
    int8_t *qs = dst.qs;
    int16_t *bsums = dst.bsums;
    float *dp = dst.dp;
    if (m == 0.0f) {
        qs[t] = 0;
        if (t < 16) bsums[t] = 0;
        if (t == 0) *dp = 0.0f;
        return;
    }
    const float iscale = __fdiv_rn(-127.0f, m);
    int q = __float2int_rn(__fmul_rn(iscale, v));
    q = q > 127 ? 127 : q < -128 ? -128 : q;
    qs[t] = (int8_t)q;
    int s = q;
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) s += __shfl_xor_sync(FULL_MASK, s, off);
    if ((t & 15) == 0) bsums[t >> 4] = (int16_t)s;
    if (t == 0) *dp = __fdiv_rn(1.0f, iscale);
}

__global__ void __launch_bounds__(256) quant_q8_K_kernel(const float *__restrict__ x, int64_t x_stride, int64_t nb,
                                                         ds4_block_q8_K *__restrict__ out, int split) {
    cuda_grid_wait();
    const int64_t row = blockIdx.x / nb, ib = blockIdx.x % nb;
    q8_K_block(x[row * x_stride + ib * DS4_QK_K + threadIdx.x], q8_K_place(out, row, ib, nb, split != 0));
}

/* The MoE mids of the streaming path in one kernel: SwiGLU of gate and up
 * with the slot's routing weight (moe_swiglu_kernel's arithmetic), then the
 * Q8_K blocks of each mid row (quant_q8_K_kernel's), in the split layout;
 * one thread block per (slot, 256-block). The float mids are not stored. */
__global__ void __launch_bounds__(256) moe_swiglu_q8_K_kernel(const float *__restrict__ g, const float *__restrict__ u,
                                                              const float *__restrict__ weights, int64_t n_ff,
                                                              float limit, ds4_block_q8_K *__restrict__ out) {
    cuda_grid_wait();
    const int64_t nb = n_ff / DS4_QK_K, row = blockIdx.x / nb, ib = blockIdx.x % nb;
    const int64_t i = row * n_ff + ib * DS4_QK_K + threadIdx.x;
    q8_K_block(cuda_swiglu1(g[i], u[i], limit, weights[row]), q8_K_place(out, row, ib, nb, true));
}

/*
 * Q8_K with a warp per 256-block, lane l holding elements 8l .. 8l + 7 (v):
 * q8_K_block's operations. m, the first element of largest |x|, is the
 * least of the order (|x| descending, index ascending) whatever the
 * reduction's shape, so it is q8_K_block's m; the codes and d are formed
 * from it as there, and a bsum (16 elements: a lane pair) is an exact
 * integer sum. The same bits, without a block's barriers (a prefill's
 * thousands of 256-thread blocks were latency-bound).
 */
static __device__ __forceinline__ void q8_K_warp(const float (&v)[8], q8_K_dst dst) {
    const int lane = threadIdx.x & 31;
    float ba = fabsf(v[0]);
    if (!(ba == ba)) ba = -1.0f;
    int bi = 8 * lane;
#pragma unroll
    for (int j = 1; j < 8; j++) {
        float a = fabsf(v[j]);
        if (!(a == a)) a = -1.0f;
        if (a > ba) ba = a, bi = 8 * lane + j; /* (ties keep the first) */
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float oa = __shfl_xor_sync(FULL_MASK, ba, off);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, off);
        if (oa > ba || (oa == ba && oi < bi)) ba = oa, bi = oi;
    }
    float mine = v[0];
#pragma unroll
    for (int j = 1; j < 8; j++)
        if ((bi & 7) == j) mine = v[j];
    const float mv = __shfl_sync(FULL_MASK, mine, bi >> 3);
    const float m = ba > 0.0f ? mv : 0.0f;
    uint32_t *qs = (uint32_t *)(dst.qs + 8 * lane); /* (4-byte aligned in both layouts) */
    if (m == 0.0f) {
        qs[0] = qs[1] = 0u;
        if ((lane & 1) == 0) dst.bsums[lane >> 1] = 0;
        if (lane == 0) *dst.dp = 0.0f;
        return;
    }
    const float iscale = __fdiv_rn(-127.0f, m);
    uint32_t w[2] = { 0u, 0u };
    int s = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int q = __float2int_rn(__fmul_rn(iscale, v[j]));
        q = q > 127 ? 127 : q < -128 ? -128 : q;
        s += q;
        w[j >> 2] |= (uint32_t)(uint8_t)(int8_t)q << (8 * (j & 3));
    }
    s += __shfl_xor_sync(FULL_MASK, s, 1);
    qs[0] = w[0], qs[1] = w[1];
    if ((lane & 1) == 0) dst.bsums[lane >> 1] = (int16_t)s;
    if (lane == 0) *dst.dp = __fdiv_rn(1.0f, iscale);
}

/* quant_q8_K_kernel with a warp per (row, 256-block), 8 warps a block
 * (rows 16-byte aligned). */
__global__ void __launch_bounds__(256) quant_q8_K_warp_kernel(const float *__restrict__ x, int64_t x_stride,
                                                              int64_t nb, int64_t total, ds4_block_q8_K *__restrict__ out,
                                                              int split) {
    cuda_grid_wait();
    const int64_t gw = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (gw >= total) return; /* the whole warp */
    const int64_t row = gw / nb, ib = gw % nb;
    const float4 *src = (const float4 *)(x + row * x_stride + ib * DS4_QK_K) + 2 * (threadIdx.x & 31);
    const float4 a = src[0], b = src[1];
    const float v[8] = { a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w };
    q8_K_warp(v, q8_K_place(out, row, ib, nb, split != 0));
}

/* moe_swiglu_q8_K_kernel with a warp per (slot, 256-block), 8 warps a block
 * (g and u 16-byte aligned). */
__global__ void __launch_bounds__(256) moe_swiglu_q8_K_warp_kernel(const float *__restrict__ g,
                                                                   const float *__restrict__ u,
                                                                   const float *__restrict__ weights, int64_t n_ff,
                                                                   int64_t total, float limit,
                                                                   ds4_block_q8_K *__restrict__ out) {
    cuda_grid_wait();
    const int64_t gw = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (gw >= total) return; /* the whole warp */
    const int64_t nb = n_ff / DS4_QK_K, row = gw / nb, ib = gw % nb;
    const int64_t i = row * n_ff + ib * DS4_QK_K + 8 * (threadIdx.x & 31);
    const float4 g0 = *(const float4 *)(g + i), g1 = *(const float4 *)(g + i + 4);
    const float4 u0 = *(const float4 *)(u + i), u1 = *(const float4 *)(u + i + 4);
    const float wr = weights[row];
    const float v[8] = { cuda_swiglu1(g0.x, u0.x, limit, wr), cuda_swiglu1(g0.y, u0.y, limit, wr),
                         cuda_swiglu1(g0.z, u0.z, limit, wr), cuda_swiglu1(g0.w, u0.w, limit, wr),
                         cuda_swiglu1(g1.x, u1.x, limit, wr), cuda_swiglu1(g1.y, u1.y, limit, wr),
                         cuda_swiglu1(g1.z, u1.z, limit, wr), cuda_swiglu1(g1.w, u1.w, limit, wr) };
    q8_K_warp(v, q8_K_place(out, row, ib, nb, true));
}

/* DS4's Q8_0 activations, one warp per 32-block: d = amax / 127 (float),
 * id = 1/d (0 when d == 0), q = round-half-even(x * id) clamped. Layout:
 * interleaved act_q8_0 blocks (the general kernels and the GEMM), or, when
 * `split` (the streaming matvec kernels, cuda_matvec.h), per row of nb
 * blocks the nb x 32 codes and then the nb float scales (36 nb bytes too). */
__global__ void __launch_bounds__(256) quant_q8_0_kernel(const float *__restrict__ x, int64_t x_stride, int64_t nb,
                                                         int64_t total, act_q8_0 *__restrict__ out, int split) {
    cuda_grid_wait();
    const int lane = threadIdx.x & 31;
    const int64_t gw = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (gw >= total) return;
    const int64_t row = gw / nb, ib = gw % nb;
    int8_t q;
    const float d = cuda_q8_0_quant_lane(x[row * x_stride + ib * DS4_QK8_0 + lane], &q);
    if (split) {
        uint8_t *r = (uint8_t *)out + row * nb * (int64_t)sizeof(act_q8_0);
        ((int8_t *)r)[ib * DS4_QK8_0 + lane] = q;
        if (lane == 0) ((float *)(r + nb * DS4_QK8_0))[ib] = d;
    } else {
        out[gw].q[lane] = q;
        if (lane == 0) out[gw].d = d;
    }
}

/* quant_q8_0_kernel with two lanes a block (cuda_q8_0_quant_half: 16
 * values each, the same d and codes), 128 blocks a thread block, rows
 * 16-byte aligned: 16-byte loads instead of one float a lane. */
__global__ void __launch_bounds__(256) quant_q8_0_pair_kernel(const float *__restrict__ x, int64_t x_stride, int64_t nb,
                                                              int64_t total, act_q8_0 *__restrict__ out, int split) {
    cuda_grid_wait();
    const int64_t gb = ((int64_t)blockIdx.x * 256 + threadIdx.x) >> 1;
    const int half = threadIdx.x & 1;
    const int64_t b = gb < total ? gb : total - 1; /* (both lanes of a pair take the shuffle) */
    const int64_t row = b / nb, ib = b % nb;
    const float4 *src = (const float4 *)(x + row * x_stride + ib * DS4_QK8_0) + 4 * half;
    const float4 v[4] = { src[0], src[1], src[2], src[3] };
    uint4 codes;
    const float d = cuda_q8_0_quant_half(v, &codes);
    if (gb >= total) return;
    uint32_t *q;
    if (split) {
        uint8_t *r = (uint8_t *)out + row * nb * (int64_t)sizeof(act_q8_0);
        q = (uint32_t *)(r + ib * DS4_QK8_0 + 16 * half);
        if (half == 0) ((float *)(r + nb * DS4_QK8_0))[ib] = d;
    } else {
        q = (uint32_t *)(out[gb].q + 16 * half);
        if (half == 0) out[gb].d = d;
    }
    q[0] = codes.x, q[1] = codes.y, q[2] = codes.z, q[3] = codes.w;
}

/* ------------------------------------------------------------------------ */
/* Per-type integer codes for the Q8_K dot (ggml's vec_dot_*_q8_K)           */
/* ------------------------------------------------------------------------ */

/*
 * codes(b, lane, w, mul, mmul): the integer weight codes of elements
 * 8*lane .. 8*lane+7 of block b, the integer multiplier of their sub-block
 * (scale) and of its min (0 if none). Then per block
 *   isum  = sum_lanes mul * sum_i w_i * q8_i
 *   summs = sum_lanes mmul * sum_i q8_i       (= sum_j m_j * bsum_j)
 * and term(b, y.d, isum, summs) is the CPU's float formula; finish() is
 * applied to the sum of the terms.
 */
template <uint32_t T> struct q8k;

static __device__ __forceinline__ float fi(int v) { return __int2float_rn(v); }

template <> struct q8k<DS4_TYPE_Q2_K> {
    typedef ds4_block_q2_K block;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void codes(const block *b, int lane, int w[8], int &mul, int &mmul) {
        const int h = lane >> 4, s = (lane & 15) >> 2, l0 = (lane & 3) * 8, j = lane >> 1;
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = (b->qs[32 * h + l0 + i] >> (2 * s)) & 3;
        mul = b->scales[j] & 15;
        mmul = b->scales[j] >> 4;
    }
    static __device__ __forceinline__ float term(const block *b, float yd, int isum, int summs) {
        const float dall = __fmul_rn(yd, f16_to_f32(b->d)), dmin = __fmul_rn(yd, f16_to_f32(b->dmin));
        return __fsub_rn(__fmul_rn(dall, fi(isum)), __fmul_rn(dmin, fi(summs)));
    }
    static __device__ __forceinline__ float finish(float s) { return s; }
};

template <> struct q8k<DS4_TYPE_Q4_K> {
    typedef ds4_block_q4_K block;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void codes(const block *b, int lane, int w[8], int &mul, int &mmul) {
        const int j = lane >> 2, l0 = (lane & 3) * 8;
        const uint8_t *qs = b->qs + 32 * (j >> 1);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = (qs[l0 + i] >> shift) & 15;
        unpack_scale_min_k4(b->scales, j, &mul, &mmul);
    }
    static __device__ __forceinline__ float term(const block *b, float yd, int isum, int summs) {
        const float d = __fmul_rn(f16_to_f32(b->d), yd), dmin = __fmul_rn(f16_to_f32(b->dmin), yd);
        return __fsub_rn(__fmul_rn(d, fi(isum)), __fmul_rn(dmin, fi(summs)));
    }
    static __device__ __forceinline__ float finish(float s) { return s; }
};

template <> struct q8k<DS4_TYPE_Q5_K> {
    typedef ds4_block_q5_K block;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void codes(const block *b, int lane, int w[8], int &mul, int &mmul) {
        const int j = lane >> 2, l0 = (lane & 3) * 8;
        const uint8_t *qs = b->qs + 32 * (j >> 1);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = ((qs[l0 + i] >> shift) & 15) | (((b->qh[l0 + i] >> j) & 1) << 4);
        unpack_scale_min_k4(b->scales, j, &mul, &mmul);
    }
    static __device__ __forceinline__ float term(const block *b, float yd, int isum, int summs) {
        const float d = __fmul_rn(f16_to_f32(b->d), yd), dmin = __fmul_rn(f16_to_f32(b->dmin), yd);
        return __fsub_rn(__fmul_rn(d, fi(isum)), __fmul_rn(dmin, fi(summs)));
    }
    static __device__ __forceinline__ float finish(float s) { return s; }
};

template <> struct q8k<DS4_TYPE_Q6_K> {
    typedef ds4_block_q6_K block;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void codes(const block *b, int lane, int w[8], int &mul, int &mmul) {
        const int h = lane >> 4, i0 = (8 * lane) & 127;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int ii = i0 + i;
            const int lo = (b->ql[64 * h + (ii & 63)] >> (4 * (ii >> 6))) & 15;
            const int hi = (b->qh[32 * h + (ii & 31)] >> (2 * (ii >> 5))) & 3;
            w[i] = (lo | (hi << 4)) - 32;
        }
        mul = b->scales[lane >> 1];
        mmul = 0;
    }
    static __device__ __forceinline__ float term(const block *b, float yd, int isum, int) {
        return __fmul_rn(__fmul_rn(f16_to_f32(b->d), yd), fi(isum));
    }
    static __device__ __forceinline__ float finish(float s) { return s; }
};

/* Lane l: group ib = l/4 (ls = 2s + 1), subgroup l%4 (grid byte, 7 sign
 * bits + parity); the 1/8 of db is applied once at the end, as the CPU does. */
template <> struct q8k<DS4_TYPE_IQ2_XXS> {
    typedef ds4_block_iq2_xxs block;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void codes(const block *b, int lane, int w[8], int &mul, int &mmul) {
        const int ib = lane >> 2, l = lane & 3;
        const uint32_t aux0 = (uint32_t)b->qs[4 * ib] | ((uint32_t)b->qs[4 * ib + 1] << 16);
        const uint32_t aux1 = (uint32_t)b->qs[4 * ib + 2] | ((uint32_t)b->qs[4 * ib + 3] << 16);
        const uint32_t grid = c_iq2xxs_grid.packed[(aux0 >> (8 * l)) & 255u];
        const uint32_t v7 = (aux1 >> (7 * l)) & 127u;
        const uint32_t signs = v7 | ((uint32_t)(__popc(v7) & 1) << 7);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint32_t code = (grid >> (2 * i)) & 3u;
            const int mag = code == 0 ? 8 : code == 1 ? 25 : code == 2 ? 43 : 0;
            w[i] = (signs >> i) & 1u ? -mag : mag;
        }
        mul = 2 * (int)(aux1 >> 28) + 1;
        mmul = 0;
    }
    static __device__ __forceinline__ float term(const block *b, float yd, int isum, int) {
        return __fmul_rn(__fmul_rn(f16_to_f32(b->d), yd), fi(isum));
    }
    static __device__ __forceinline__ float finish(float s) { return __fmul_rn(0.125f, s); }
};

template <> struct q8k<DS4_TYPE_Q8_K> {
    typedef ds4_block_q8_K block;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void codes(const block *b, int lane, int w[8], int &mul, int &mmul) {
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = b->qs[8 * lane + i];
        mul = 1;
        mmul = 0;
    }
    static __device__ __forceinline__ float term(const block *b, float yd, int isum, int) {
        return __fmul_rn(fi(isum), __fmul_rn(b->d, yd));
    }
    static __device__ __forceinline__ float finish(float s) { return s; }
};

/* Four int8 codes packed into a word (low byte first). */
static __device__ __forceinline__ int pack4(int a, int b, int c, int d) {
    return (int)((uint32_t)(a & 0xff) | ((uint32_t)(b & 0xff) << 8) | ((uint32_t)(c & 0xff) << 16) |
                 ((uint32_t)(d & 0xff) << 24));
}

/* ------------------------------------------------------------------------ */
/* Product kernels                                                           */
/* ------------------------------------------------------------------------ */

/*
 * One output row per block: its MM_WARPS warps split the row's length (warp
 * `part` takes every MM_WARPS-th chunk), which keeps enough warps in flight
 * when a decode step has few output rows; the partial sums are combined in
 * shared memory in warp order (mm_store), so results are deterministic.
 */
struct mm_tile {
    int64_t o, r0;
    int nr, part;
    const uint8_t *wrow;
};

/* Output row, first activation row, rows in the tile, weight row, and this
 * warp's part of the row; false when the block has no output row. */
static __device__ __forceinline__ bool mm_tile_of(const mm_args &a, int rows, mm_tile *t) {
    t->o = (int64_t)blockIdx.x;
    t->part = (int)(threadIdx.x >> 5);
    if (t->o >= a.n_out) return false;
    const int64_t y = a.y0 + blockIdx.y;
    t->r0 = y * rows;
    const int64_t left = a.n_rows - t->r0;
    t->nr = left < rows ? (int)left : rows;
    const int64_t wr = (a.sel ? (int64_t)a.sel[y] * a.rows_per_expert : a.row0) + t->o;
    t->wrow = a.w + wr * a.row_bytes;
    return true;
}

/* Sum the warps' partial results (lane 0 of each warp holds its part) in
 * warp order and write the tile's outputs. Every thread of the block calls it. */
template <int ROWS, typename Acc, typename Fin>
static __device__ __forceinline__ void mm_store(const mm_args &a, const mm_tile &t, const Acc (&acc)[ROWS], Fin fin) {
    __shared__ Acc red[MM_WARPS][ROWS];
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) red[t.part][r] = acc[r];
    }
    __syncthreads();
    if (threadIdx.x < ROWS && (int)threadIdx.x < t.nr) {
        Acc sum = red[0][threadIdx.x];
#pragma unroll
        for (int p = 1; p < MM_WARPS; p++) sum += red[p][threadIdx.x];
        a.out[(t.r0 + threadIdx.x) * a.out_stride + t.o] = fin(sum);
    }
}

/* Float activations: REFERENCE (Acc = double, every type) and DS4's float
 * dot for F32/F16/BF16 (Acc = float). */
template <uint32_t T, int ROWS, typename Acc>
__global__ void __launch_bounds__(MM_THREADS) mm_float_kernel(mm_args a) {
    cuda_grid_wait();
    typedef deq<T> D;
    mm_tile t;
    if (!mm_tile_of(a, ROWS, &t)) return;
    const int lane = threadIdx.x & 31;
    const typename D::block *blocks = (const typename D::block *)t.wrow;
    const float *x = (const float *)a.act + t.r0 * a.act_stride;
    Acc acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0;
    if constexpr (D::ELEMS == 1) {
        for (int64_t i = t.part * 32 + lane; i < a.n; i += 32 * MM_WARPS) {
            const float wv = D::elem(&blocks[i], 0);
#pragma unroll
            for (int r = 0; r < ROWS; r++)
                if (r < t.nr) acc[r] = fma((Acc)wv, (Acc)x[r * a.act_stride + i], acc[r]);
        }
    } else {
        for (int64_t c = t.part * 32 + lane; c < a.n / 8; c += 32 * MM_WARPS) {
            const int64_t e0 = c * 8;
            const typename D::block *b = &blocks[e0 / D::ELEMS];
            const int eb = (int)(e0 % D::ELEMS);
            float wv[8];
#pragma unroll
            for (int i = 0; i < 8; i++) wv[i] = D::elem(b, eb + i);
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                if (r < t.nr) {
                    const float *xr = x + r * a.act_stride + e0;
                    Acc s = 0;
#pragma unroll
                    for (int i = 0; i < 8; i++) s = fma((Acc)wv[i], (Acc)xr[i], s);
                    acc[r] += s;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(FULL_MASK, acc[r], off);
    }
    mm_store<ROWS>(a, t, acc, [](Acc v) { return (float)v; });
}

/* DS4 numerics, Q8_K activations (act_stride in blocks). */
template <uint32_t T, int ROWS>
__global__ void __launch_bounds__(MM_THREADS) mm_q8k_kernel(mm_args a) {
    cuda_grid_wait();
    typedef q8k<T> K;
    mm_tile t;
    if (!mm_tile_of(a, ROWS, &t)) return;
    const int lane = threadIdx.x & 31;
    const typename K::block *blocks = (const typename K::block *)t.wrow;
    const ds4_block_q8_K *xq = (const ds4_block_q8_K *)a.act + t.r0 * a.act_stride;
    const int64_t nb = a.n / DS4_QK_K;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    for (int64_t ib = t.part; ib < nb; ib += MM_WARPS) {
        const typename K::block *b = &blocks[ib];
        int w[8], mul, mmul;
        K::codes(b, lane, w, mul, mmul);
        const int w0 = pack4(w[0], w[1], w[2], w[3]), w1 = pack4(w[4], w[5], w[6], w[7]);
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r < t.nr) { /* warp-uniform */
                const ds4_block_q8_K *y = xq + r * a.act_stride + ib;
                const int *q8 = (const int *)(y->qs + 8 * lane); /* 4-byte aligned: qs at offset 4 */
                const int x0 = q8[0], x1 = q8[1];
                const int isub = __dp4a(w1, x1, __dp4a(w0, x0, 0));
                const int isum = __reduce_add_sync(FULL_MASK, mul * isub);
                int summs = 0;
                if (K::HAS_MIN) {
                    const int qsum = __dp4a(x1, 0x01010101, __dp4a(x0, 0x01010101, 0));
                    summs = __reduce_add_sync(FULL_MASK, mmul * qsum);
                }
                if (lane == 0) acc[r] = __fadd_rn(acc[r], K::term(b, y->d, isum, summs));
            }
        }
    }
    mm_store<ROWS>(a, t, acc, [](float v) { return K::finish(v); });
}

/* DS4 numerics, Q8_0 weights with Q8_0 activations (act_stride in blocks):
 * lanes 4k..4k+3 share a 32-block, 8 blocks per warp step. */
template <int ROWS>
__global__ void __launch_bounds__(MM_THREADS) mm_q8_0_kernel(mm_args a) {
    cuda_grid_wait();
    mm_tile t;
    if (!mm_tile_of(a, ROWS, &t)) return;
    const int lane = threadIdx.x & 31, k = lane & 3;
    const ds4_block_q8_0 *blocks = (const ds4_block_q8_0 *)t.wrow;
    const act_q8_0 *xq = (const act_q8_0 *)a.act + t.r0 * a.act_stride;
    const int64_t nch = a.n / 8;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    for (int64_t base = t.part * 32; base < nch; base += 32 * MM_WARPS) {
        const int64_t c = base + lane, bi = c >> 2;
        const bool valid = c < nch;
        int w0 = 0, w1 = 0;
        float wd = 0.0f;
        if (valid) {
            const ds4_block_q8_0 *b = &blocks[bi];
            const int8_t *q = b->qs + 8 * k;
            w0 = pack4(q[0], q[1], q[2], q[3]);
            w1 = pack4(q[4], q[5], q[6], q[7]);
            wd = f16_to_f32(b->d);
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r < t.nr) {
                int isub = 0;
                float xd = 0.0f;
                if (valid) {
                    const act_q8_0 *xa = xq + r * a.act_stride + bi;
                    const int *q8 = (const int *)(xa->q + 8 * k); /* 4-byte aligned */
                    isub = __dp4a(w1, q8[1], __dp4a(w0, q8[0], 0));
                    xd = xa->d;
                }
                isub += __shfl_xor_sync(FULL_MASK, isub, 1);
                isub += __shfl_xor_sync(FULL_MASK, isub, 2);
                if (valid && k == 0) acc[r] = __fadd_rn(acc[r], __fmul_rn(__fmul_rn(wd, xd), fi(isub)));
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r] = __fadd_rn(acc[r], __shfl_xor_sync(FULL_MASK, acc[r], off));
    }
    mm_store<ROWS>(a, t, acc, [](float v) { return v; });
}

/* mid[i] = swiglu(g[i], u[i]) * weights[i / n_ff], in place over g. */
__global__ void __launch_bounds__(256) moe_swiglu_kernel(float *__restrict__ g, const float *__restrict__ u,
                                                         const float *__restrict__ weights, int64_t n_ff,
                                                         int64_t n, float limit) {
    cuda_grid_wait();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) g[i] = cuda_swiglu1(g[i], u[i], limit, weights[i / n_ff]);
}

/* Row r of dst (dst_pitch bytes apart) = row idx[r] of src (rows of
 * row_bytes, a multiple of 4, 4-byte aligned): one block per row, in
 * 16-byte pieces where both pitches allow. */
__global__ void __launch_bounds__(256) gather_rows_kernel(const uint8_t *__restrict__ src, int64_t row_bytes,
                                                          const int32_t *__restrict__ idx, uint8_t *__restrict__ dst,
                                                          int64_t dst_pitch) {
    cuda_grid_wait();
    const int64_t r = blockIdx.x;
    const uint8_t *s = src + (int64_t)idx[r] * row_bytes;
    uint8_t *d = dst + r * dst_pitch;
    if (row_bytes % 16 == 0 && dst_pitch % 16 == 0) /* the same for the whole grid */
        for (int64_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) ((uint4 *)d)[i] = ((const uint4 *)s)[i];
    else
        for (int64_t i = threadIdx.x; i < row_bytes / 4; i += blockDim.x) ((uint32_t *)d)[i] = ((const uint32_t *)s)[i];
}

/* The experts of token t (blockIdx.y) summed: out[t][o] = sum over k (in
 * order, from 0.0f) of part[t n_used + k][o]. */
__global__ void __launch_bounds__(256) moe_sum_rows_kernel(const float *__restrict__ part, int n_used, int64_t dim,
                                                           float *__restrict__ out, int64_t out_stride) {
    cuda_grid_wait();
    const int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (o >= dim) return;
    float acc = 0.0f;
    for (int k = 0; k < n_used; k++) acc = __fadd_rn(acc, part[(t * n_used + k) * dim + o]);
    out[t * out_stride + o] = acc;
}


/* ------------------------------------------------------------------------ */
/* Host side                                                                 */
/* ------------------------------------------------------------------------ */

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool cuda_matmul_supported(uint32_t type, ds4_numerics num) {
    (void)num; /* every supported type has both numerics */
    switch (type) {
    case DS4_TYPE_F32:
    case DS4_TYPE_F16:
    case DS4_TYPE_BF16:
    case DS4_TYPE_Q8_0:
    case DS4_TYPE_Q2_K:
    case DS4_TYPE_Q4_K:
    case DS4_TYPE_Q5_K:
    case DS4_TYPE_Q6_K:
    case DS4_TYPE_IQ2_XXS:
    case DS4_TYPE_Q8_K: return true;
    default: return false;
    }
}

static mm_mode mode_for(uint32_t type, ds4_numerics num) {
    if (num == DS4_NUMERICS_REFERENCE) return MM_REF;
    if (cuda_is_float_type(type)) return MM_F32;
    if (type == DS4_TYPE_Q8_0) return MM_Q8_0;
    return MM_Q8_K;
}

/* The weight's type and row length suit a product (else the error is
 * recorded, naming the weight). */
static bool check_weight(ds4_backend *be, const char *op, const ds4_weight *w, ds4_numerics num) {
    ds4_error e;
    memset(&e, 0, sizeof e);
    if (ds4_backend_check_numerics(be, num, &e)) { /* the numerics CUDA_OPS declares */
        cuda_fail(be, e.status, "%s: %s", op, e.message);
        return false;
    }
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    if (!t || !cuda_matmul_supported(w->type, num)) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "%s: weight %s has type %s, which the CUDA backend cannot compute with", op,
                  cuda_wname(w), ds4_type_name(w->type));
        return false;
    }
    if (w->ne[0] <= 0 || w->ne[0] % t->block_elems != 0) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "%s: weight %s: row of %lld elements is not a whole number of %s blocks (%d)",
                  op, cuda_wname(w), (long long)w->ne[0], t->name, t->block_elems);
        return false;
    }
    return true;
}

/* Bytes of n_rows quantised activation rows of n elements (0: float kinds). */
static size_t act_bytes(mm_mode mode, int64_t n, int64_t n_rows) {
    if (mode == MM_Q8_K) return (size_t)(n / DS4_QK_K) * (size_t)n_rows * sizeof(ds4_block_q8_K);
    if (mode == MM_Q8_0) return (size_t)(n / DS4_QK8_0) * (size_t)n_rows * sizeof(act_q8_0);
    return 0;
}

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

/* The quantisers' warp and lane-pair kernels (ds4_cuda_backend_set_wide_rows
 * 0: a thread a value; the same bits either way). */
static bool quant_vec_on(ds4_backend *be) { return cuda_impl(be)->wide_rows; }

/* Quantise n_rows rows of n floats (x_stride apart) into dst for `mode`,
 * n / block elements per row; Q8_0 and Q8_K in the matvec kernels' split
 * layouts when for_mv. Float kinds: nothing to do (act = x). */
static bool quantize_acts(ds4_backend *be, mm_mode mode, const float *x, int64_t x_stride, int64_t n, int64_t n_rows,
                          void *dst, bool for_mv) {
    /* rows 16-byte aligned: the warp (Q8_K) and lane-pair (Q8_0) kernels, the same bits */
    const bool vec = quant_vec_on(be) && n_rows >= CUDA_WIDE_MIN_ROWS && (uintptr_t)x % 16 == 0 && x_stride % 4 == 0;
    if (mode == MM_Q8_K) {
        const int64_t nb = n / DS4_QK_K;
        if (vec)
            return cuda_launch(be, "quant_q8_K_warp_kernel", quant_q8_K_warp_kernel, (unsigned)cdiv(nb * n_rows, 8),
                               256, 0, x, x_stride, nb, nb * n_rows, (ds4_block_q8_K *)dst, for_mv ? 1 : 0);
        return cuda_launch(be, "quant_q8_K_kernel", quant_q8_K_kernel, (unsigned)(nb * n_rows), 256, 0, x, x_stride,
                           nb, (ds4_block_q8_K *)dst, for_mv ? 1 : 0);
    }
    if (mode == MM_Q8_0) {
        const int64_t nb = n / DS4_QK8_0, total = nb * n_rows;
        if (vec)
            return cuda_launch(be, "quant_q8_0_pair_kernel", quant_q8_0_pair_kernel, (unsigned)cdiv(total, 128), 256,
                               0, x, x_stride, nb, total, (act_q8_0 *)dst, for_mv ? 1 : 0);
        return cuda_launch(be, "quant_q8_0_kernel", quant_q8_0_kernel, (unsigned)cdiv(total, 8), 256, 0, x, x_stride,
                           nb, total, (act_q8_0 *)dst, for_mv ? 1 : 0);
    }
    return true;
}

/* The activations a product of `mode` reads: x itself for the float kinds,
 * else x quantised into scratch `slot` (as quantize_acts); NULL with the
 * error recorded when that failed. */
static const void *acts_for(ds4_backend *be, cuda_scratch_slot slot, mm_mode mode, const float *x, int64_t x_stride,
                            int64_t n, int64_t n_rows, bool for_mv) {
    const size_t qbytes = act_bytes(mode, n, n_rows);
    if (!qbytes) return x;
    void *q = cuda_scratch(be, slot, qbytes);
    if (!q || !quantize_acts(be, mode, x, x_stride, n, n_rows, q, for_mv)) return NULL;
    return q;
}

static int64_t act_stride_of(mm_mode mode, int64_t n, int64_t float_stride) {
    if (mode == MM_Q8_K) return n / DS4_QK_K;
    if (mode == MM_Q8_0) return n / DS4_QK8_0;
    return float_stride;
}

#define MM_FLOAT_CASES(ACC)                                                                            \
    case DS4_TYPE_F32: ok = cuda_launch(be, "matmul kernel", mm_float_kernel<DS4_TYPE_F32, ROWS, ACC>, grid, MM_THREADS, 0, b); break; \
    case DS4_TYPE_F16: ok = cuda_launch(be, "matmul kernel", mm_float_kernel<DS4_TYPE_F16, ROWS, ACC>, grid, MM_THREADS, 0, b); break; \
    case DS4_TYPE_BF16: ok = cuda_launch(be, "matmul kernel", mm_float_kernel<DS4_TYPE_BF16, ROWS, ACC>, grid, MM_THREADS, 0, b); break;

#define MM_REF_CASE(T) \
    case T: ok = cuda_launch(be, "matmul kernel", mm_float_kernel<T, ROWS, double>, grid, MM_THREADS, 0, b); break;
#define MM_Q8K_CASE(T) \
    case T: ok = cuda_launch(be, "matmul kernel", mm_q8k_kernel<T, ROWS>, grid, MM_THREADS, 0, b); break;

/* Launch the product kernel of (type, mode) over a.n_rows activation rows in
 * tiles of ROWS (blockIdx.y, at most 65535 tiles per launch). */
template <int ROWS> static bool launch_mm(ds4_backend *be, uint32_t type, mm_mode mode, const mm_args &a) {
    const int64_t n_tiles = cdiv(a.n_rows, ROWS);
    for (int64_t y0 = 0; y0 < n_tiles; y0 += 65535) {
        mm_args b = a;
        b.y0 = y0;
        const int64_t ny = n_tiles - y0 < 65535 ? n_tiles - y0 : 65535;
        const dim3 grid((unsigned)a.n_out, (unsigned)ny); /* one output row per block */
        bool known = true, ok = false;
        if (mode == MM_REF) {
            switch (type) {
                MM_FLOAT_CASES(double)
                MM_REF_CASE(DS4_TYPE_Q8_0)
                MM_REF_CASE(DS4_TYPE_Q2_K)
                MM_REF_CASE(DS4_TYPE_Q4_K)
                MM_REF_CASE(DS4_TYPE_Q5_K)
                MM_REF_CASE(DS4_TYPE_Q6_K)
                MM_REF_CASE(DS4_TYPE_IQ2_XXS)
                MM_REF_CASE(DS4_TYPE_Q8_K)
            default: known = false;
            }
        } else if (mode == MM_F32) {
            switch (type) {
                MM_FLOAT_CASES(float)
            default: known = false;
            }
        } else if (mode == MM_Q8_0) {
            if (type == DS4_TYPE_Q8_0) ok = cuda_launch(be, "matmul kernel", mm_q8_0_kernel<ROWS>, grid, MM_THREADS,
                                                        0, b);
            else known = false;
        } else {
            switch (type) {
                MM_Q8K_CASE(DS4_TYPE_Q2_K)
                MM_Q8K_CASE(DS4_TYPE_Q4_K)
                MM_Q8K_CASE(DS4_TYPE_Q5_K)
                MM_Q8K_CASE(DS4_TYPE_Q6_K)
                MM_Q8K_CASE(DS4_TYPE_IQ2_XXS)
                MM_Q8K_CASE(DS4_TYPE_Q8_K)
            default: known = false;
            }
        }
        if (!known) { /* unreachable after check_weight; kept as a guard */
            cuda_fail(be, DS4_ERR_UNSUPPORTED, "matmul: no kernel for type %s", ds4_type_name(type));
            return false;
        }
        if (!ok) return false;
    }
    return true;
}

static bool launch_product(ds4_backend *be, uint32_t type, mm_mode mode, const mm_args &a) {
    if (a.sel || a.n_rows <= 1) return launch_mm<1>(be, type, mode, a);
    if (a.n_rows <= 4) return launch_mm<4>(be, type, mode, a);
    return launch_mm<8>(be, type, mode, a);
}

static cuda_mv_act mv_kind(mm_mode mode) {
    return mode == MM_Q8_0 ? CUDA_MV_Q8_0 : mode == MM_Q8_K ? CUDA_MV_Q8_K : CUDA_MV_FLOAT;
}

/* The streaming matvec kernels take DS4-numerics products of up to
 * CUDA_MV_MAX_ROWS rows whose weight rows are whole 16-byte units; float
 * activations must also be 16-byte aligned rows. $DS4_CUDA_MATVEC=0 turns
 * them off (for A/B measurements). */
static bool mv_suits(const ds4_weight *w, mm_mode mode, const float *x, int64_t x_stride, int64_t n_rows) {
    static const bool enabled = cuda_env_flag("DS4_CUDA_MATVEC", true);
    if (!enabled || mode == MM_REF || n_rows < 1 || n_rows > CUDA_MV_MAX_ROWS) return false;
    if (!cuda_mv_fits(w->type, mv_kind(mode), w->row_bytes, w->ne[0])) return false;
    if (mode == MM_F32 && (((uintptr_t)x & 15) != 0 || (n_rows > 1 && x_stride % 4 != 0))) return false;
    return true;
}

/* Whether the float ranges [a, a + na) and [b, b + nb) share an element. */
static bool ranges_overlap(const float *a, int64_t na, const float *b, int64_t nb) {
    return (uintptr_t)a < (uintptr_t)(b + nb) && (uintptr_t)b < (uintptr_t)(a + na);
}

/* The floats n_rows rows of n, `stride` apart, span. */
static int64_t rows_span(int64_t n_rows, int64_t stride, int64_t n) { return (n_rows - 1) * stride + n; }

/* x rows of len floats that a product kernel may quantise itself: 16-byte
 * loads (x aligned, rows a multiple of 4 floats apart) and no output it
 * writes overlapping x (its blocks read x while others write). */
static bool xq_input_ok(const float *x, int64_t x_stride, int64_t len, int64_t n_rows, const float *const *outs,
                        const int64_t *n_outs, const int64_t *out_strides, int n_outs_n) {
    if ((uintptr_t)x % 16 != 0 || (n_rows > 1 && x_stride % 4 != 0)) return false;
    for (int k = 0; k < n_outs_n; k++)
        if (ranges_overlap(x, rows_span(n_rows, x_stride, len), outs[k], rows_span(n_rows, out_strides[k], n_outs[k])))
            return false;
    return true;
}

/* A Q8_0 streaming product quantises x itself (no quantiser launch) when
 * its rows fit the kernel's shared memory and x suits it (xq_input_ok). */
static bool mv_quantises_x(ds4_backend *be, const ds4_weight *w, mm_mode mode, const float *x, int64_t x_stride, int64_t n_rows,
                           const float *const *outs, const int64_t *n_outs, const int64_t *out_strides, int n_outs_n) {
    return mode == MM_Q8_0 && cuda_mv_quantises(be, w->type, w->ne[0], n_rows, n_outs, n_outs_n) &&
           xq_input_ok(x, x_stride, w->ne[0], n_rows, outs, n_outs, out_strides, n_outs_n);
}

/* The streaming kernels on n_groups groups of n_out weight rows from row0
 * (activation group g at g * group_stride blocks or floats; one group:
 * plain; xf: the float rows the kernel quantises itself, act unused). */
static void run_mv(ds4_backend *be, const ds4_weight *w, mm_mode mode, int64_t row0, int64_t n_out, int64_t n_groups,
                   const void *act, int64_t act_stride, int64_t group_stride, float *out, int64_t out_stride,
                   int64_t n_rows, const float *xf, int64_t xf_stride, const ds4_rope *rope = NULL,
                   const int32_t *rope_pos = NULL, int64_t rope_head_dim = 0) {
    cuda_mv_job j;
    memset(&j, 0, sizeof j);
    j.rope = rope;
    j.rope_pos = rope_pos;
    j.rope_head_dim = rope_head_dim;
    j.type = w->type;
    j.act_kind = mv_kind(mode);
    j.w = w->device;
    j.row_bytes = w->row_bytes;
    j.n = w->ne[0];
    j.row0 = row0;
    j.n_out = n_out;
    j.act = act;
    j.act_stride = act_stride;
    j.out = out;
    j.out_stride = out_stride;
    j.n_rows = (int)n_rows;
    j.xf = xf;
    j.xf_stride = xf_stride;
    cuda_mv_run_grouped(be, &j, n_groups, group_stride);
}

/* The int8 tensor-core GEMM for batched Q8_0 products; $DS4_CUDA_GEMM=0
 * turns it off (for A/B measurements). */
static bool gemm_enabled(void) {
    static const bool enabled = cuda_env_flag("DS4_CUDA_GEMM", true);
    return enabled;
}

void cuda_matmul(ds4_backend *be, const ds4_weight *w, int64_t row0, int64_t n_out, const float *x,
                 int64_t x_stride, float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num) {
    if (!w || !w->device) {
        cuda_fail(be, DS4_ERR_INVALID, "matmul: weight %s is not bound", cuda_wname(w));
        return;
    }
    if (!check_weight(be, "matmul", w, num)) return;
    const int64_t n_in = w->ne[0];
    if (row0 < 0 || n_out < 0 || n_rows < 0 || row0 + n_out > cuda_weight_rows(w) ||
        (n_rows > 1 && (x_stride < n_in || out_stride < n_out))) {
        cuda_fail(be, DS4_ERR_INVALID,
                  "matmul: weight %s [%lld x %lld rows]: rows %lld..+%lld, %lld x rows (stride %lld), out stride %lld",
                  cuda_wname(w), (long long)n_in, (long long)cuda_weight_rows(w), (long long)row0, (long long)n_out,
                  (long long)n_rows, (long long)x_stride, (long long)out_stride);
        return;
    }
    if (n_out == 0 || n_rows == 0 || cuda_failed(be)) return;

    const mm_mode mode = mode_for(w->type, num);
    const bool mv = mv_suits(w, mode, x, x_stride, n_rows); /* decode shapes: the streaming kernels */
    const float *outs[1] = { out };
    const int64_t n_outs[1] = { n_out }, out_strides[1] = { out_stride };
    if (mv && mv_quantises_x(be, w, mode, x, x_stride, n_rows, outs, n_outs, out_strides, 1)) {
        run_mv(be, w, mode, row0, n_out, 1, NULL, act_stride_of(mode, n_in, x_stride), 0, out, out_stride, n_rows, x,
               x_stride);
        return;
    }
    const void *act = acts_for(be, CUDA_SCRATCH_MATMUL_ACT, mode, x, x_stride, n_in, n_rows, mv);
    if (!act) return;
    if (mv) {
        run_mv(be, w, mode, row0, n_out, 1, act, act_stride_of(mode, n_in, x_stride), 0, out, out_stride, n_rows, NULL,
               0);
        return;
    }
    const int64_t xq_row_bytes = (n_in / DS4_QK8_0) * (int64_t)sizeof(act_q8_0);
    if (mode == MM_Q8_0 && gemm_enabled() && cuda_gemm_q8_0_fits(n_in, w->row_bytes, xq_row_bytes, n_rows)) {
        cuda_gemm_q8_0(be, cuda_weight_row(w, row0), w->row_bytes, n_in, n_out, act, xq_row_bytes, n_rows, out,
                       out_stride);
        return;
    }
    if (mode == MM_F32 && cuda_impl(be)->fgemm && cuda_gemm_f16_fits(w->type, n_in, w->row_bytes, n_rows)) {
        void *xs = cuda_scratch(be, CUDA_SCRATCH_MATMUL_ACT, cuda_gemm_f16_scratch(n_in, n_rows));
        if (xs && cuda_gemm_f16(be, cuda_weight_row(w, row0), w->row_bytes, n_in, n_out, x, x_stride, n_rows, out,
                                out_stride, xs))
            cuda_impl(be)->fgemm_calls++;
        return;
    }
    mm_args a;
    memset(&a, 0, sizeof a);
    a.w = (const uint8_t *)w->device;
    a.row_bytes = w->row_bytes;
    a.n = n_in;
    a.row0 = row0;
    a.sel = NULL;
    a.rows_per_expert = 0;
    a.n_out = n_out;
    a.act = act;
    a.act_stride = act_stride_of(mode, n_in, x_stride);
    a.out = out;
    a.out_stride = out_stride;
    a.n_rows = n_rows;
    launch_product(be, w->type, mode, a);
}

/*
 * Products of one input: the ones the streaming kernels take (decode
 * shapes, DS4 numerics) are gathered by weight type and row length, x is
 * quantised once per gathering (two weight types of one activation kind
 * quantise it twice), and each gathering runs as one launch (blockIdx.z the
 * matrix); the rest go through cuda_matmul one by one.
 */
static_assert(DS4_PRODUCTS_MAX <= CUDA_MV_MAX_MATS, "one launch holds every product of a call");
void cuda_matmul_multi(ds4_backend *be, const ds4_product *p, int n, const float *x, int64_t x_stride, int64_t n_rows,
                       ds4_numerics num) {
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (!ds4_products_valid(p, n, x, x_stride, n_rows, &err)) {
        cuda_fail(be, err.status, "%s", err.message);
        return;
    }
    for (int j = 0; j < n; j++) {
        if (!p[j].w->device) {
            cuda_fail(be, DS4_ERR_INVALID, "matmul_multi: weight %s is not bound", cuda_wname(p[j].w));
            return;
        }
        if (!check_weight(be, "matmul_multi", p[j].w, num)) return;
        const ds4_weight *a = p[j].add;
        if (a && (!a->device || !ds4_cuda_dequant_supported(a->type))) {
            cuda_fail(be, a->device ? DS4_ERR_UNSUPPORTED : DS4_ERR_INVALID,
                      "matmul_multi: product %d adds a row of %s, which is %s", j, cuda_wname(a),
                      a->device ? "of a type with no row decoder" : "not bound");
            return;
        }
    }
    if (n_rows == 0 || cuda_failed(be)) return;
    static const bool joined = cuda_env_flag("DS4_CUDA_MULTI", true); /* 0: product by product (A/B) */
    const int64_t n_in = p[0].w->ne[0];
    bool done[DS4_PRODUCTS_MAX] = { false };
    for (int j = 0; j < n; j++) {
        if (done[j]) continue;
        const ds4_weight *w = p[j].w;
        const mm_mode mode = mode_for(w->type, num);
        if (!joined || p[j].n_out == 0 || !mv_suits(w, mode, x, x_stride, n_rows)) {
            done[j] = true;
            cuda_matmul(be, w, 0, p[j].n_out, x, x_stride, p[j].out, p[j].out_stride, n_rows, num);
            ds4_product_add_row(be, &p[j], n_rows);
            continue;
        }
        /* j and every later product of the same type and row length */
        int take[DS4_PRODUCTS_MAX], nj = 0;
        const float *outs[DS4_PRODUCTS_MAX];
        int64_t n_outs[DS4_PRODUCTS_MAX], out_strides[DS4_PRODUCTS_MAX];
        for (int k = j; k < n; k++) {
            const ds4_weight *v = p[k].w;
            if (done[k] || p[k].n_out == 0 || v->type != w->type || v->row_bytes != w->row_bytes) continue;
            outs[nj] = p[k].out, n_outs[nj] = p[k].n_out, out_strides[nj] = p[k].out_stride;
            take[nj++] = k;
        }
        const bool xq = mv_quantises_x(be, w, mode, x, x_stride, n_rows, outs, n_outs, out_strides, nj);
        const void *act = xq ? NULL : acts_for(be, CUDA_SCRATCH_MATMUL_ACT, mode, x, x_stride, n_in, n_rows, true);
        if (!xq && !act) return;
        cuda_mv_job jobs[DS4_PRODUCTS_MAX];
        for (int i = 0; i < nj; i++) {
            const int k = take[i];
            const ds4_weight *v = p[k].w;
            done[k] = true;
            cuda_mv_job *jb = &jobs[i];
            memset(jb, 0, sizeof *jb);
            jb->type = v->type;
            jb->act_kind = mv_kind(mode);
            jb->w = v->device;
            jb->row_bytes = v->row_bytes;
            jb->n = n_in;
            jb->row0 = 0;
            jb->n_out = p[k].n_out;
            jb->act = act;
            jb->act_stride = act_stride_of(mode, n_in, x_stride);
            jb->out = p[k].out;
            jb->out_stride = p[k].out_stride;
            jb->n_rows = (int)n_rows;
            jb->xf = xq ? x : NULL;
            jb->xf_stride = x_stride;
            /* a float row to add: in the kernel's last step (others after it) */
            const ds4_weight *ad = p[k].add;
            static const bool fuse_add = cuda_env_flag("DS4_CUDA_MV_ADD", true); /* 0: by add_weight_row (A/B) */
            const bool in_kernel = fuse_add && ad && ad->device && cuda_is_float_type(ad->type);
            jb->add = in_kernel ? cuda_weight_row(ad, p[k].add_row) : NULL;
            jb->add_type = in_kernel ? ad->type : 0;
        }
        if (!cuda_mv_run_multi(be, jobs, nj)) return;
        for (int i = 0; i < nj; i++)
            if (!jobs[i].add) ds4_product_add_row(be, &p[take[i]], n_rows);
    }
}

/* A grouped product (checked shapes) that one streaming launch runs with
 * each block quantising its group's slice of x (o_a). */
static bool grouped_xq(ds4_backend *be, const ds4_weight *w, mm_mode mode, int64_t n_groups, int64_t n_out,
                       const float *x, int64_t x_stride, const float *out, int64_t out_stride, int64_t n_rows) {
    const int64_t n_in = w->ne[0];
    const float *outs[1] = { out };
    const int64_t width[1] = { n_groups * n_out }, strides[1] = { out_stride };
    /* (n_in is then a multiple of 256: every group's slice starts 16-byte aligned) */
    return mode == MM_Q8_0 && mv_suits(w, mode, x, x_stride, n_rows) && n_in % DS4_QK8_0 == 0 &&
           cuda_mv_grouped_quantises(be, w->type, n_in, n_out, n_groups, n_rows) &&
           xq_input_ok(x, x_stride, n_groups * n_in, n_rows, outs, width, strides, 1);
}

void cuda_matmul_grouped(ds4_backend *be, const ds4_weight *w, int64_t n_groups, int64_t n_out, const float *x,
                         int64_t x_stride, float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num) {
    if (!w || !w->device) {
        cuda_fail(be, DS4_ERR_INVALID, "matmul_grouped: weight %s is not bound", cuda_wname(w));
        return;
    }
    if (!check_weight(be, "matmul_grouped", w, num)) return;
    const int64_t n_in = w->ne[0];
    if (n_groups < 1 || n_out < 0 || n_rows < 0 || n_groups * n_out > cuda_weight_rows(w) ||
        (n_rows > 1 && (x_stride < n_groups * n_in || out_stride < n_groups * n_out))) {
        cuda_fail(be, DS4_ERR_INVALID,
                  "matmul_grouped: weight %s [%lld x %lld rows]: %lld groups of %lld rows, %lld x rows (stride %lld), "
                  "out stride %lld",
                  cuda_wname(w), (long long)n_in, (long long)cuda_weight_rows(w), (long long)n_groups, (long long)n_out,
                  (long long)n_rows, (long long)x_stride, (long long)out_stride);
        return;
    }
    if (n_out == 0 || n_rows == 0 || cuda_failed(be)) return;
    const mm_mode mode = mode_for(w->type, num);
    const int64_t blk = mode == MM_Q8_K ? DS4_QK_K : mode == MM_Q8_0 ? DS4_QK8_0 : 4;
    const bool mv = mv_suits(w, mode, x, x_stride, n_rows) && n_in % blk == 0;
    if (grouped_xq(be, w, mode, n_groups, n_out, x, x_stride, out, out_stride, n_rows)) {
        /* one launch and no quantiser: each block quantises its group's
         * slice of x (o_a), block for block as quantising the rows would */
        run_mv(be, w, mode, 0, n_out, n_groups, NULL, n_in / DS4_QK8_0, n_in, out, out_stride, n_rows, x, x_stride);
        return;
    }
    if (mv) {
        /* one launch: the groups are whole activation blocks, so quantising
         * each row once gives every group's blocks exactly as quantising the
         * groups one by one would */
        const int64_t len = n_groups * n_in;
        const void *act = acts_for(be, CUDA_SCRATCH_MATMUL_ACT, mode, x, x_stride, len, n_rows, true);
        if (!act) return;
        run_mv(be, w, mode, 0, n_out, n_groups, act, act_stride_of(mode, len, x_stride),
               mode == MM_F32 ? n_in : n_in / blk, out, out_stride, n_rows, NULL, 0);
        return;
    }
    const int64_t len = n_groups * n_in, xq_row_bytes = (len / DS4_QK8_0) * (int64_t)sizeof(act_q8_0);
    if (mode == MM_Q8_0 && gemm_enabled() && n_groups <= CUDA_GEMM_MAX_GROUPS &&
        cuda_gemm_q8_0_fits(n_in, w->row_bytes, xq_row_bytes, n_rows)) {
        /* one launch for every group: each row quantised once, as above */
        const void *act = acts_for(be, CUDA_SCRATCH_MATMUL_ACT, mode, x, x_stride, len, n_rows, false);
        if (act)
            cuda_gemm_q8_0_grouped(be, w->device, w->row_bytes, n_in, n_out, n_groups, act, xq_row_bytes, n_rows,
                                   out, out_stride);
        return;
    }
    for (int64_t g = 0; g < n_groups && !cuda_failed(be); g++)
        cuda_matmul(be, w, g * n_out, n_out, x + g * n_in, x_stride, out + g * n_out, out_stride, n_rows, num);
}

/* The attention output's inverse RoPE inside o_a's quantiser: the grouped
 * XQ launch rotates each 16-float piece of x back (mv_rope_back) before it
 * quantises it, so x is not written and rope_tail's launch is gone; any
 * other shape, or $DS4_CUDA_MV_ROPE=0, makes the two calls. */
void cuda_rope_matmul_grouped(ds4_backend *be, const ds4_weight *w, int64_t n_groups, int64_t n_out, float *x,
                              int64_t n_heads, int64_t head_dim, const int32_t *pos, const ds4_rope *rope,
                              float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num) {
    if (!w || !w->device) {
        cuda_fail(be, DS4_ERR_INVALID, "rope_matmul_grouped: weight %s is not bound", cuda_wname(w));
        return;
    }
    const int64_t n_in = w->ne[0];
    if (n_heads < 1 || head_dim < 1 || n_groups < 1 || n_heads > INT64_MAX / head_dim ||
        n_heads * head_dim / n_groups != n_in || n_heads * head_dim % n_groups != 0) {
        cuda_fail(be, DS4_ERR_INVALID,
                  "rope_matmul_grouped: %lld heads of %lld are not %lld groups of the %lld inputs of weight %s",
                  (long long)n_heads, (long long)head_dim, (long long)n_groups, (long long)n_in, cuda_wname(w));
        return;
    }
    const int64_t width = n_heads * head_dim;
    static const bool fuse = cuda_env_flag("DS4_CUDA_MV_ROPE", true); /* 0: the two calls (A/B) */
    const mm_mode mode = mode_for(w->type, num);
    const bool fused = fuse && !cuda_failed(be) && x && pos && n_rows >= 1 && n_out >= 1 &&
                       n_groups * n_out <= cuda_weight_rows(w) && cuda_mv_rope_fits(rope, head_dim, n_in, n_in) &&
                       (n_rows == 1 || out_stride >= n_groups * n_out) &&
                       grouped_xq(be, w, mode, n_groups, n_out, x, width, out, out_stride, n_rows);
    if (!fused) {
        cuda_rope_tail(be, x, n_rows, n_heads, head_dim, pos, rope, true);
        if (!cuda_failed(be)) cuda_matmul_grouped(be, w, n_groups, n_out, x, width, out, out_stride, n_rows, num);
        return;
    }
    if (!check_weight(be, "rope_matmul_grouped", w, num)) return;
    const int32_t *d_pos =
        (const int32_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_MATMUL_CTRL, pos, (size_t)n_rows * sizeof(int32_t));
    if (!d_pos) return;
    run_mv(be, w, mode, 0, n_out, n_groups, NULL, n_in / DS4_QK8_0, n_in, out, out_stride, n_rows, x, width, rope,
           d_pos, head_dim);
}

/* Expert ids and weights of n slots (tokens x experts per token) checked
 * and copied: an id outside [0, n_expert) is reported and becomes expert 0
 * with weight 0, so its work adds nothing and no kernel reads past the
 * weights. */
__global__ void __launch_bounds__(256) moe_route_kernel(const int32_t *__restrict__ sel,
                                                        const float *__restrict__ weights, int64_t n,
                                                        int64_t n_expert, int32_t *__restrict__ sel_out,
                                                        float *__restrict__ w_out, cuda_dev_error *err, int tag) {
    cuda_grid_wait();
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    const int32_t e = sel[k];
    if (cuda_index_ok(e, n_expert)) {
        sel_out[k] = e;
        w_out[k] = weights[k];
    } else {
        cuda_report_bad_index(err, CUDA_CHECK_MOE_EXPERT, tag, e, n_expert, k);
        sel_out[k] = 0;
        w_out[k] = 0.0f;
    }
}

/* The streaming kernels run the MoE under DS4 numerics when all three
 * weights suit them (float activations: 16-byte aligned x rows, n_ff and dim
 * multiples of 4) and at most CUDA_MV_MAX_PARTS experts are used. */
static bool mv_moe_suits(const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down, mm_mode mg, mm_mode mu,
                         mm_mode md, const float *x, int64_t n_ff, int n_used) {
    if (n_used > CUDA_MV_MAX_PARTS || mg == MM_REF) return false;
    if (!mv_suits(gate, mg, x, gate->ne[0], 1) || !mv_suits(up, mu, x, up->ne[0], 1)) return false;
    if ((mg == MM_F32 || mu == MM_F32) && gate->ne[0] % 4 != 0) return false;
    if (md == MM_REF || !cuda_mv_fits(down->type, mv_kind(md), down->row_bytes, down->ne[0])) return false;
    return md != MM_F32 || n_ff % 4 == 0;
}

/* One token on the general kernels (REFERENCE numerics, or shapes the
 * streaming kernels do not take): gate, up, SwiGLU, down, then the sum over
 * the experts in order. */
static void moe_one_token(ds4_backend *be, const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down,
                          const float *x, const int32_t *d_sel, const float *d_w, int n_used, float limit, float *out,
                          ds4_numerics num) {
    const int64_t dim = gate->ne[0], n_ff = gate->ne[1];
    const mm_mode mg = mode_for(gate->type, num), mu = mode_for(up->type, num), md = mode_for(down->type, num);
    const size_t qg = act_bytes(mg, dim, 1), qu = mu != mg ? act_bytes(mu, dim, 1) : 0;
    const void *xg = x, *xu = x;
    if (qg + qu) {
        uint8_t *q = (uint8_t *)cuda_scratch(be, CUDA_SCRATCH_MOE_X, align256(qg) + qu);
        if (!q) return;
        if (qg) {
            if (!quantize_acts(be, mg, x, dim, dim, 1, q, false)) return;
            xg = q;
        }
        if (mu == mg) xu = xg;
        else if (qu) {
            if (!quantize_acts(be, mu, x, dim, dim, 1, q + align256(qg), false)) return;
            xu = q + align256(qg);
        }
    }
    const int64_t n_mid = (int64_t)n_used * n_ff, n_part = (int64_t)n_used * dim;
    float *g = (float *)cuda_scratch(be, CUDA_SCRATCH_MOE_GATE, (size_t)n_mid * sizeof(float));
    float *u = (float *)cuda_scratch(be, CUDA_SCRATCH_MOE_UP, (size_t)(n_mid > n_part ? n_mid : n_part) * sizeof(float));
    if (!g || !u) return;

    mm_args a;
    memset(&a, 0, sizeof a);
    a.n = dim;
    a.row0 = 0;
    a.sel = d_sel;
    a.rows_per_expert = n_ff;
    a.n_out = n_ff;
    a.out_stride = n_ff;
    a.n_rows = n_used;
    /* gate and up: expert sel[k]'s rows against the one (shared) x row */
    a.w = (const uint8_t *)gate->device;
    a.row_bytes = gate->row_bytes;
    a.act = xg;
    a.act_stride = 0;
    a.out = g;
    if (!launch_product(be, gate->type, mg, a)) return;
    a.w = (const uint8_t *)up->device;
    a.row_bytes = up->row_bytes;
    a.act = xu;
    a.out = u;
    if (!launch_product(be, up->type, mu, a)) return;

    /* mids (routing weight applied), then each mid row quantised on its own */
    if (!cuda_launch(be, "moe_swiglu_kernel", moe_swiglu_kernel, (unsigned)cdiv(n_mid, 256), 256, 0, g, u, d_w, n_ff,
                     n_mid, limit))
        return;
    const void *mids = acts_for(be, CUDA_SCRATCH_MOE_ACT, md, g, n_ff, n_ff, n_used, false);
    if (!mids) return;

    /* down: row k of the partial outputs = expert sel[k]'s down . mid k */
    a.w = (const uint8_t *)down->device;
    a.row_bytes = down->row_bytes;
    a.n = n_ff;
    a.rows_per_expert = dim;
    a.n_out = dim;
    a.act = mids;
    a.act_stride = act_stride_of(md, n_ff, n_ff);
    a.out = u;
    a.out_stride = dim;
    if (!launch_product(be, down->type, md, a)) return;
    (void)cuda_launch(be, "moe_sum_rows_kernel", moe_sum_rows_kernel, dim3((unsigned)cdiv(dim, 256), 1u), 256, 0,
                      (const float *)u, n_used, dim, out, dim);
}

/* The streaming path's mids for down (of `md`): Q8_K in one kernel with the
 * SwiGLU (the backend's moe_xq off: SwiGLU, then the quantiser kernel), else the
 * SwiGLU kernel and the mids quantised as acts_for. NULL with the error
 * recorded when that failed. */
static const void *moe_mids(ds4_backend *be, mm_mode md, float *g, const float *u, const float *d_w, int64_t n_ff,
                            int64_t slots, float limit) {
    if (cuda_impl(be)->moe_xq && md == MM_Q8_K && n_ff % DS4_QK_K == 0) {
        void *q = cuda_scratch(be, CUDA_SCRATCH_MOE_ACT, act_bytes(md, n_ff, slots));
        if (!q) return NULL;
        const int64_t total = slots * (n_ff / DS4_QK_K);
        if (quant_vec_on(be) && slots >= CUDA_WIDE_MIN_ROWS && (uintptr_t)g % 16 == 0 && (uintptr_t)u % 16 == 0) {
            if (!cuda_launch(be, "moe_swiglu_q8_K_warp_kernel", moe_swiglu_q8_K_warp_kernel, (unsigned)cdiv(total, 8),
                             256, 0, (const float *)g, u, d_w, n_ff, total, limit, (ds4_block_q8_K *)q))
                return NULL;
        } else if (!cuda_launch(be, "moe_swiglu_q8_K_kernel", moe_swiglu_q8_K_kernel, (unsigned)total, 256, 0, g, u,
                                d_w, n_ff, limit, (ds4_block_q8_K *)q)) {
            return NULL;
        }
        return q;
    }
    const int64_t n_mid = slots * n_ff;
    if (!cuda_launch(be, "moe_swiglu_kernel", moe_swiglu_kernel, (unsigned)cdiv(n_mid, 256), 256, 0, g, u, d_w, n_ff,
                     n_mid, limit))
        return NULL;
    return acts_for(be, CUDA_SCRATCH_MOE_ACT, md, g, n_ff, n_ff, slots, true);
}

/* The slots (token, k) of the checked expert ids `sel` sorted by expert,
 * tokens in order within one: order[i] is the slot at sorted row i, tok[i]
 * its token, and groups (expert, first, rows, 0) cover each expert's rows
 * max_rows at a time. The number of groups (at most slots). */
static int64_t moe_group_slots(const int32_t *sel, int64_t slots, int n_used, int64_t n_expert, int64_t max_rows,
                               int32_t *order, int32_t *tok, int32_t *groups, int64_t *count) {
    for (int64_t e = 0; e < n_expert; e++) count[e] = 0;
    for (int64_t s = 0; s < slots; s++) count[sel[s]]++;
    int64_t at = 0, n_groups = 0;
    for (int64_t e = 0; e < n_expert; e++) {
        const int64_t c = count[e];
        count[e] = at; /* now where the expert's rows start */
        for (int64_t f = 0; f < c; f += max_rows) {
            int32_t *g = groups + 4 * n_groups++;
            g[0] = (int32_t)e;
            g[1] = (int32_t)(at + f);
            g[2] = (int32_t)(c - f < max_rows ? c - f : max_rows);
            g[3] = 0;
        }
        at += c;
    }
    for (int64_t s = 0; s < slots; s++) {
        const int64_t i = count[sel[s]]++;
        order[i] = (int32_t)s;
        tok[i] = (int32_t)(s / n_used);
    }
    return n_groups;
}

/* moe_group_slots on the device, for recorded steps (nothing waits for the
 * ids): one block of MOE_DEV_THREADS. Thread e counts expert e's slots,
 * the starts are prefix sums, then thread e lists its slots in order, so
 * order, tokens and groups are the host's exactly; the groups past the
 * last (up to `slots`, the grid's bound) get no rows, and their blocks do
 * nothing. The ids are the route kernel's checked ones (in range). */
#define MOE_DEV_THREADS 256
#define MOE_DEV_MAX_SLOTS 4096
#define MOE_DEV_MAX_EXPERTS 1024
#define MOE_DEV_MIN_ROWS 16 /* fewer tokens share few experts: the per-slot launches are as fast */
__global__ void __launch_bounds__(MOE_DEV_THREADS) moe_group_kernel(const int32_t *__restrict__ sel, int slots,
                                                                    int n_used, int n_expert, int max_rows,
                                                                    int4 *__restrict__ groups,
                                                                    int32_t *__restrict__ order,
                                                                    int32_t *__restrict__ tok) {
    cuda_grid_wait();
    __shared__ int32_t s_sel[MOE_DEV_MAX_SLOTS];
    __shared__ int32_t s_at[MOE_DEV_MAX_EXPERTS], s_g0[MOE_DEV_MAX_EXPERTS];
    __shared__ int32_t s_groups;
    for (int i = threadIdx.x; i < slots; i += blockDim.x) s_sel[i] = sel[i];
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        int c = 0;
        for (int i = 0; i < slots; i++) c += s_sel[i] == e;
        s_at[e] = c;
        s_g0[e] = (c + max_rows - 1) / max_rows;
    }
    __syncthreads();
    if (threadIdx.x == 0) { /* exclusive prefix sums of the rows and of the groups */
        int at = 0, g0 = 0;
        for (int e = 0; e < n_expert; e++) {
            const int c = s_at[e], g = s_g0[e];
            s_at[e] = at;
            s_g0[e] = g0;
            at += c;
            g0 += g;
        }
        s_groups = g0;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        const int at = s_at[e];
        int c = 0;
        for (int i = 0; i < slots; i++)
            if (s_sel[i] == e) {
                order[at + c] = i;
                tok[at + c] = i / n_used;
                c++;
            }
        for (int f = 0; f < c; f += max_rows)
            groups[s_g0[e] + f / max_rows] = make_int4(e, at + f, c - f < max_rows ? c - f : max_rows, 0);
    }
    for (int g = s_groups + threadIdx.x; g < slots; g += blockDim.x) groups[g] = make_int4(0, 0, 0, 0);
}

/* The host's grouping (moe_grouped outside steps): the checked ids read
 * back (one wait), sorted, the groups and the slot order uploaded; NULL
 * with the error recorded when that failed. */
static const int32_t *moe_sort_on_host(ds4_backend *be, const int32_t *d_sel, int64_t slots, int n_used,
                                       int64_t n_expert, int64_t max_rows, int64_t *n_groups_out, int *largest_out) {
    /* the checked ids (one wait), sorted on the host */
    int32_t *h = (int32_t *)calloc((size_t)(7 * slots), sizeof(int32_t)); /* ids, 4 per group, order, tokens */
    int64_t *count = (int64_t *)malloc((size_t)n_expert * sizeof(int64_t));
    if (!h || !count) {
        free(h);
        free(count);
        cuda_fail(be, DS4_ERR_NOMEM, "moe: out of host memory for %lld expert slots", (long long)slots);
        return NULL;
    }
    be->ops->download(be, (float *)h, (const float *)d_sel, slots);
    int32_t *groups = h + slots, *order = groups + 4 * slots, *tok = order + slots; /* uploaded from groups on */
    bool ok = !cuda_failed(be);
    for (int64_t s = 0; ok && s < slots; s++) ok = h[s] >= 0 && h[s] < n_expert; /* moe_route_kernel's output */
    const int64_t n_groups = ok ? moe_group_slots(h, slots, n_used, n_expert, max_rows, order, tok, groups, count) : 0;
    int largest = 0;
    for (int64_t i = 0; i < n_groups; i++) largest = groups[4 * i + 2] > largest ? groups[4 * i + 2] : largest;
    /* the groups (int4 each: 16-byte aligned at the upload's start), then the
     * slot order and the tokens (the upload covers every group slot there
     * could be, so the order's offset does not depend on the group count) */
    const int32_t *dev = ok ? (const int32_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_MOE_GROUPS, groups,
                                                                 (size_t)(6 * slots) * sizeof(int32_t))
                            : NULL;
    free(h);
    free(count);
    if (!dev) {
        if (!cuda_failed(be)) cuda_fail(be, DS4_ERR_DEVICE, "moe: the expert ids read back are out of range");
        return NULL;
    }
    *n_groups_out = n_groups;
    *largest_out = largest;
    return dev;
}

/* The grouped products on `dev` = (groups [4 slots], order [slots], tokens
 * [slots]) of n_groups groups: see moe_grouped. */
static bool moe_grouped_run(ds4_backend *be, const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down,
                            mm_mode mg, mm_mode md, const float *x, const float *d_w, int n_used, float limit,
                            float *out, int64_t n_rows, bool mma, int max_rows, const int32_t *dev, int64_t n_groups) {
    cuda_backend *cb = cuda_impl(be);
    const int64_t dim = gate->ne[0], n_ff = gate->ne[1], slots = (int64_t)n_used * n_rows;
    const int64_t nbx = dim / DS4_QK_K, nbm = n_ff / DS4_QK_K;
    /* rows of Q8_K blocks, sorted at a 16-byte pitch (the matvec kernels
     * read them at their own size: whole 16-byte pieces only) */
    const int64_t xrow = (int64_t)act_bytes(MM_Q8_K, dim, 1), mrow = (int64_t)act_bytes(MM_Q8_K, n_ff, 1);
    const int64_t xpitch = (xrow + 15) / 16 * 16, mpitch = (mrow + 15) / 16 * 16;
    const int32_t *d_groups = dev, *d_order = dev + 4 * slots, *d_tok = d_order + slots;
    /* x quantised, its rows gathered into expert order */
    void *xq = cuda_scratch(be, CUDA_SCRATCH_MOE_X, (size_t)(n_rows * xrow));
    uint8_t *sorted = (uint8_t *)cuda_scratch(be, CUDA_SCRATCH_MOE_SORTED,
                                              (size_t)(slots * (xpitch > mpitch ? xpitch : mpitch)));
    const int64_t n_mid = slots * n_ff, n_part = slots * dim;
    float *g = (float *)cuda_scratch(be, CUDA_SCRATCH_MOE_GATE, (size_t)n_mid * sizeof(float));
    float *u = (float *)cuda_scratch(be, CUDA_SCRATCH_MOE_UP, (size_t)(n_mid > n_part ? n_mid : n_part) * sizeof(float));
    if (!xq || !sorted || !g || !u || !quantize_acts(be, mg, x, dim, dim, n_rows, xq, true)) return true;
    if (!cuda_launch(be, "gather_rows_kernel", gather_rows_kernel, (unsigned)slots, 256, 0, (const uint8_t *)xq, xrow,
                     d_tok, sorted, xpitch))
        return true;
    const ds4_weight *gu[2] = { gate, up };
    float *const gu_out[2] = { g, u };
    /* gate and up share the streaming launch (same type and rows): its split over n_ff x slots x 2 outputs */
    if (mma ? !cuda_mv_moe_mma(be, gu, gu_out, 2, sorted, nbx, xpitch, d_groups, d_order, n_groups, max_rows, n_ff)
            : !cuda_mv_moe_grouped(be, gu, gu_out, 2, CUDA_MV_Q8_K, sorted, nbx, d_groups, d_order, n_groups,
                                   max_rows, n_ff, n_ff * slots * 2))
        return true;
    /* the mids per slot (routing weights applied), gathered into expert order */
    const void *mids = moe_mids(be, md, g, u, d_w, n_ff, slots, limit);
    if (!mids || !cuda_launch(be, "gather_rows_kernel", gather_rows_kernel, (unsigned)slots, 256, 0,
                              (const uint8_t *)mids, mrow, d_order, sorted, mpitch))
        return true;
    const ds4_weight *dn[1] = { down };
    float *const dn_out[1] = { u }; /* per-slot partials [slots][dim] */
    if (mma ? !cuda_mv_moe_mma(be, dn, dn_out, 1, sorted, nbm, mpitch, d_groups, d_order, n_groups, max_rows, dim)
            : !cuda_mv_moe_grouped(be, dn, dn_out, 1, CUDA_MV_Q8_K, sorted, nbm, d_groups, d_order, n_groups,
                                   max_rows, dim, 0))
        return true;
    if (mma) cb->moe_mma_calls++;
    (void)cuda_launch(be, "moe_sum_rows_kernel", moe_sum_rows_kernel, dim3((unsigned)cdiv(dim, 256), (unsigned)n_rows),
                      256, 0, (const float *)u, n_used, dim, out, dim);
    return true;
}

/* Several tokens' routed experts grouped by expert (the backend's
 * moe_grouped, Q8_K activations throughout). Outside recorded steps the
 * checked ids come back to the host, which sorts the slots; inside one
 * (with moe_step_rows set: a batched decode of MOE_DEV_MIN_ROWS tokens or
 * more) moe_group_kernel sorts them on the device and the launches cover
 * `slots` groups, the empty ones idle. x rows are gathered into expert
 * order, gate and up run per group (one pass over an expert's rows for up to
 * 32 of its tokens on the tensor cores, 8 on the matvec kernels, or
 * moe_step_rows in a step), the mids are made per slot as on the streaming
 * path, gathered, and down runs per group into per-slot partials summed
 * over each token's experts in order. false (and nothing enqueued) when the
 * shapes do not suit it. */
static bool moe_grouped(ds4_backend *be, const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down,
                        mm_mode mg, mm_mode mu, mm_mode md, const float *x, const int32_t *d_sel, const float *d_w,
                        int n_used, float limit, float *out, int64_t n_rows, bool mv_suits) {
    cuda_backend *cb = cuda_impl(be);
    const int64_t dim = gate->ne[0], n_ff = gate->ne[1], n_expert = gate->ne[2], slots = (int64_t)n_used * n_rows;
    if (!cb->moe_grouped || n_rows < 2 || mg != MM_Q8_K || mu != MM_Q8_K || md != MM_Q8_K ||
        gate->type != up->type || gate->row_bytes != up->row_bytes || dim % DS4_QK_K || n_ff % DS4_QK_K ||
        slots > 65535 || n_expert > (int64_t)1 << 20)
        return false;
    const bool on_device = cb->in_step; /* no wait for the ids inside a recorded step */
    if (on_device && (!cb->moe_step_rows || !mv_suits || n_rows < MOE_DEV_MIN_ROWS || slots > MOE_DEV_MAX_SLOTS ||
                      n_expert > MOE_DEV_MAX_EXPERTS))
        return false;
    /* the tensor cores take up to moe_mma_rows (32 or 64) tokens of an
     * expert at a time (any whole 256-blocks), the matvec kernels 8 (rows
     * of their units) */
    const bool mma = !on_device && cb->moe_mma && cuda_mv_moe_mma_fits(gate->type, gate->row_bytes, dim) &&
                     cuda_mv_moe_mma_fits(down->type, down->row_bytes, n_ff);
    if (!mma && !mv_suits) return false;
    /* the matvec kernels read the sorted Q8_K rows in whole 16-byte pieces */
    if (!mma && (act_bytes(MM_Q8_K, dim, 1) % 16 || act_bytes(MM_Q8_K, n_ff, 1) % 16)) return false;
    const int64_t max_rows = mma ? cb->moe_mma_rows : on_device ? cb->moe_step_rows : CUDA_MV_MAX_ROWS;
    int group_rows = (int)max_rows;
    const int32_t *dev;
    int64_t n_groups;
    if (on_device) {
        int32_t *d = (int32_t *)cuda_scratch(be, CUDA_SCRATCH_MOE_GROUPS, (size_t)(6 * slots) * sizeof(int32_t));
        if (!d || !cuda_launch(be, "moe_group_kernel", moe_group_kernel, 1u, MOE_DEV_THREADS, 0, d_sel, (int)slots,
                               n_used, (int)n_expert, (int)max_rows, (int4 *)d, d + 4 * slots, d + 5 * slots))
            return true;
        dev = d;
        n_groups = slots; /* the bound: the groups past the last have no rows */
    } else {
        int largest = 0;
        dev = moe_sort_on_host(be, d_sel, slots, n_used, n_expert, max_rows, &n_groups, &largest);
        if (!dev) return true;
        if (mma) group_rows = largest; /* the tensor cores' kernel: the one whose tiles hold the largest group */
    }
    return moe_grouped_run(be, gate, up, down, mg, md, x, d_w, n_used, limit, out, n_rows, mma, group_rows, dev,
                           n_groups);
}

void cuda_moe(ds4_backend *be, const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down, const float *x,
              const int32_t *sel, const float *weights, int n_used, float limit, float *out, int64_t n_rows,
              ds4_numerics num) {
    if (!gate || !up || !down || !gate->device || !up->device || !down->device) {
        cuda_fail(be, DS4_ERR_INVALID, "moe: expert weights are not bound");
        return;
    }
    const int64_t dim = gate->ne[0], n_ff = gate->ne[1], n_expert = gate->ne[2];
    if (up->ne[0] != dim || up->ne[1] != n_ff || up->ne[2] != n_expert || down->ne[0] != n_ff ||
        down->ne[1] != dim || down->ne[2] != n_expert || n_used < 0) {
        cuda_fail(be, DS4_ERR_INVALID,
                  "moe: %s [%lld, %lld, %lld], %s [%lld, %lld, %lld] and %s [%lld, %lld, %lld] do not fit together",
                  cuda_wname(gate), (long long)gate->ne[0], (long long)gate->ne[1], (long long)gate->ne[2],
                  cuda_wname(up), (long long)up->ne[0], (long long)up->ne[1], (long long)up->ne[2], cuda_wname(down),
                  (long long)down->ne[0], (long long)down->ne[1], (long long)down->ne[2]);
        return;
    }
    if (n_used > MOE_MAX_USED || n_rows < 0 || n_rows * n_used > 65535) {
        cuda_fail(be, DS4_ERR_INVALID, "moe: %d experts per token for %lld tokens (at most %d per token, 65535 in all) "
                  "for %s", n_used, (long long)n_rows, MOE_MAX_USED, cuda_wname(gate));
        return;
    }
    if (!check_weight(be, "moe", gate, num) || !check_weight(be, "moe", up, num) ||
        !check_weight(be, "moe", down, num))
        return;
    if (cuda_failed(be) || n_rows == 0) return;
    if (n_used == 0) {
        cuda_memset_d(be, out, 0, (size_t)(dim * n_rows) * sizeof(float));
        return;
    }
    if (!sel || !weights) {
        cuda_fail(be, DS4_ERR_INVALID, "moe: NULL %s for %s", !sel ? "expert ids" : "routing weights",
                  cuda_wname(gate));
        return;
    }

    /* sel and weights are device memory (the router's outputs): checked on
     * the device into MATMUL_CTRL [slots int32][slots float], which the
     * product kernels read. One token on the streaming kernels (decode)
     * skips that kernel: they read the caller's ids and weights, the
     * gate/up kernel reports a bad id and every kernel leaves that expert
     * out (its products read 0, down skips the slot: what the checked
     * copy's expert 0 with weight 0 adds), so the chain from the router to
     * the experts is a launch shorter (DS4_CUDA_MOE_IDS=0: the check
     * first, as for the other paths) */
    const int64_t slots = (int64_t)n_used * n_rows;
    const mm_mode mg = mode_for(gate->type, num), mu = mode_for(up->type, num), md = mode_for(down->type, num);
    const bool suits = mv_moe_suits(gate, up, down, mg, mu, md, x, n_ff, n_used);
    const bool direct_ids = n_rows == 1 && suits && cuda_impl(be)->moe_ids;
    const int32_t *d_sel = sel;
    const float *d_w = weights;
    if (!direct_ids) {
        int32_t *cs = (int32_t *)cuda_scratch(be, CUDA_SCRATCH_MATMUL_CTRL, 2 * (size_t)slots * sizeof(int32_t));
        if (!cs) return;
        float *cw = (float *)(cs + slots);
        if (!cuda_launch(be, "moe_route_kernel", moe_route_kernel, (unsigned)cdiv(slots, 256), 256, 0, sel, weights,
                         slots, n_expert, cs, cw, cuda_dev_error_of(be), cuda_check_tag(be, gate->name)))
            return;
        d_sel = cs;
        d_w = cw;
    }
    if (moe_grouped(be, gate, up, down, mg, mu, md, x, d_sel, d_w, n_used, limit, out, n_rows, suits)) return;
    if (!suits) {
        for (int64_t r = 0; r < n_rows && !cuda_failed(be); r++)
            moe_one_token(be, gate, up, down, x + r * dim, d_sel + r * n_used, d_w + r * n_used, n_used, limit,
                          out + r * dim, num);
        return;
    }

    /* The streaming kernels, every token at once: x quantised (gate's kind,
     * and up's when it differs), gate and up in one launch, SwiGLU with the
     * routing weights, the mids quantised, down summed over each token's
     * experts in one launch. */
    /* one token whose gate and up take Q8_K blocks in one launch (with the
     * MoE's fusions on): that kernel quantises x itself */
    const bool xk = cuda_impl(be)->moe_xq && (uintptr_t)x % 16 == 0 &&
                    cuda_mv_moe_quantises(gate, up, mv_kind(mg), mv_kind(mu), n_rows);
    const size_t qg = act_bytes(mg, dim, n_rows), qu = mu != mg ? act_bytes(mu, dim, n_rows) : 0;
    const void *xg = x, *xu = x;
    if (!xk && qg + qu) {
        uint8_t *q = (uint8_t *)cuda_scratch(be, CUDA_SCRATCH_MOE_X, align256(qg) + qu);
        if (!q) return;
        if (qg) {
            if (!quantize_acts(be, mg, x, dim, dim, n_rows, q, true)) return;
            xg = q;
        }
        if (mu == mg) xu = xg;
        else if (qu) {
            if (!quantize_acts(be, mu, x, dim, dim, n_rows, q + align256(qg), true)) return;
            xu = q + align256(qg);
        }
    }
    const int64_t n_mid = slots * n_ff;
    float *g = (float *)cuda_scratch(be, CUDA_SCRATCH_MOE_GATE, (size_t)n_mid * sizeof(float));
    float *u = (float *)cuda_scratch(be, CUDA_SCRATCH_MOE_UP, (size_t)n_mid * sizeof(float));
    if (!g || !u) return;
    /* the chosen experts' down matrices into the L2 beside gate/up (a
     * recorded step's leaf; one token's, which fit) */
    cuda_prefetch_experts(be, down, d_sel, slots);
    if (!cuda_mv_moe_gate_up(be, gate, up, mv_kind(mg), mv_kind(mu), xg, xu, act_stride_of(mg, dim, dim),
                             act_stride_of(mu, dim, dim), d_sel, n_used, n_rows, g, u,
                             direct_ids ? cuda_dev_error_of(be) : NULL, direct_ids ? cuda_check_tag(be, gate->name) : 0,
                             xk ? x : NULL))
        return;
    const void *mids = moe_mids(be, md, g, u, d_w, n_ff, slots, limit);
    if (!mids) return;
    cuda_mv_moe_down(be, down, mv_kind(md), mids, act_stride_of(md, n_ff, n_ff), d_sel, n_used, n_rows, out, dim);
}

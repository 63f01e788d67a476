/*
 * cuda_rows.cuh - per-row device pieces shared by the CUDA .cu files that
 * norm and round rows (cuda_backend.cu's rmsnorm and rounding kernels,
 * cuda_attention.cu's fused head norm + RoPE): one copy of each, so a fused
 * kernel adds and rounds exactly as the kernels it stands for.
 *
 * Floating point as in cuda_backend.cu: __fmul_rn / __fadd_rn / __fdiv_rn,
 * never contracted into an FMA; the rounding functions are bit-identical to
 * src/core/rounding.c.
 */
#ifndef DS4_BACKENDS_CUDA_ROWS_CUH
#define DS4_BACKENDS_CUDA_ROWS_CUH

#include <stdint.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define NORM_THREADS 256
#define NORM_VEC 4 /* float4 loads per thread of a cached row */
#define NORM_CACHED (NORM_THREADS * 4 * NORM_VEC)

/* The RMS norm's scale 1 / sqrt(float(sum of squares / dim) + eps) of a
 * row whose squares the block's NORM_THREADS threads summed in double (each
 * its ss): a fixed shuffle tree, then the warps in order, so the same sum
 * every run. part: NORM_THREADS / 32 doubles of shared memory. Every
 * thread of the block must call it; all get the scale. */
static __device__ __forceinline__ float rms_scale_of(double ss, int64_t dim, float eps, double *part) {
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_down_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        double t = threadIdx.x < NORM_THREADS / 32 ? part[threadIdx.x] : 0.0;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_down_sync(0xffffffffu, t, o);
        if (threadIdx.x == 0) part[0] = t;
    }
    __syncthreads();
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn((float)(part[0] / (double)dim), eps)));
}

/* A row of dim <= NORM_CACHED floats (dim % 4 == 0, 16-byte aligned) read
 * by a block of NORM_THREADS threads into v (thread t holds elements 4 (t +
 * k NORM_THREADS) .. + 3 in v[k], zeros past the end), every load in flight
 * before the sum waits on one. */
static __device__ __forceinline__ void rms_load_row(const float *xr, int64_t dim, float4 (&v)[NORM_VEC]) {
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) {
        const int64_t i = 4 * (threadIdx.x + (int64_t)k * NORM_THREADS);
        v[k] = i < dim ? *(const float4 *)(xr + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}
/* rms_scale_of the row rms_load_row read into v (split from the loads so a
 * kernel can do other work while they are in flight) */
static __device__ __forceinline__ float rms_loaded_scale(const float4 (&v)[NORM_VEC], int64_t dim, float eps,
                                                         double *part) {
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++)
        ss += (double)v[k].x * (double)v[k].x + (double)v[k].y * (double)v[k].y + (double)v[k].z * (double)v[k].z +
              (double)v[k].w * (double)v[k].w;
    return rms_scale_of(ss, dim, eps, part);
}

/* The norm of a row held at rms_load_row's places (v; the weight's values
 * wv from rms_load_weight, has_w false: plain): yr[i] = v[i] * scale *
 * w[i], scale = rms_loaded_scale's. */
static __device__ __forceinline__ void rms_scale_store(const float4 (&v)[NORM_VEC], const float (&wv)[NORM_VEC][4],
                                                       bool has_w, int64_t dim, float eps, double *part, float *yr) {
    const float scale = rms_loaded_scale(v, dim, eps, part);
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) {
        const int64_t i = 4 * (threadIdx.x + (int64_t)k * NORM_THREADS);
        if (i >= dim) continue;
        float4 y = make_float4(__fmul_rn(v[k].x, scale), __fmul_rn(v[k].y, scale), __fmul_rn(v[k].z, scale),
                               __fmul_rn(v[k].w, scale));
        if (has_w) {
            y.x = __fmul_rn(y.x, wv[k][0]), y.y = __fmul_rn(y.y, wv[k][1]);
            y.z = __fmul_rn(y.z, wv[k][2]), y.w = __fmul_rn(y.w, wv[k][3]);
        }
        *(float4 *)(yr + i) = y;
    }
}

/* The norm weight's values at the places rms_load_row reads (w may be
 * NULL: ones), loaded with the row so that their latency is not added
 * after the sum's. */
static __device__ __forceinline__ void rms_load_weight(const float *w, int64_t dim, float (&wv)[NORM_VEC][4]) {
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) {
        const int64_t i = 4 * (threadIdx.x + (int64_t)k * NORM_THREADS);
#pragma unroll
        for (int c = 0; c < 4; c++) wv[k][c] = w && i < dim ? w[i + c] : 1.0f;
    }
}

/* round_small_float of rounding.c: nearest value with `mant_bits` mantissa
 * bits, binades below 2^min_exp share the subnormal quantum, saturating. */
static __device__ __forceinline__ float round_small(float v, int min_exp, int mant_bits, float max_mag) {
    if (v != v) return v;
    const float a = fabsf(v);
    float r;
    if (a >= max_mag) {
        r = max_mag;
    } else {
        int e2;
        (void)frexpf(a, &e2);
        const int binade = e2 - 1 < min_exp ? min_exp : e2 - 1;
        const float quantum = ldexpf(1.0f, binade - mant_bits);
        r = __fmul_rn(rintf(__fdiv_rn(a, quantum)), quantum);
        if (r > max_mag) r = max_mag;
    }
    return copysignf(r, v);
}

/* The block scale 2^ceil(log2f(max(amax, floor) / max_mag)). The CPU's
 * log2f is correctly rounded to float; the float rounding of a double log2
 * gives the same float (so the same ceiling) for every input that matters. */
static __device__ __forceinline__ float block_scale_of(float amax, float amax_floor, float max_mag) {
    if (amax < amax_floor) amax = amax_floor;
    float e = ceilf(__double2float_rn(log2((double)__fdiv_rn(amax, max_mag))));
    if (e > 127.0f) e = 127.0f;
    return ldexpf(1.0f, (int)e);
}

/* One value of an FP8 E4M3 (FP4 E2M1) block with scale `scale`, as
 * round_blocks_kernel rounds it. */
template <int FP4> static __device__ __forceinline__ float round_block_value(float v, float scale, float max_mag) {
    float q = __fdiv_rn(v, scale);
    if (q > max_mag) q = max_mag;
    if (q < -max_mag) q = -max_mag;
    q = FP4 ? round_small(q, 0, 1, 6.0f) : round_small(q, -6, 3, 448.0f);
    return __fmul_rn(q, scale);
}

/* KV rows' FP8 blocks (round_fp8_kv): blocks of 64 values, amax floor 1e-4,
 * E4M3's largest magnitude 448 */
#define KV_FP8_BLOCK 64
#define KV_FP8_FLOOR 1.0e-4f
#define KV_FP8_MAX 448.0f

/* The IEEE half round trip of round_f16 (NaN stays NaN). */
static __device__ __forceinline__ float round_f16_value(float v) {
    return v != v ? v : __half2float(__float2half_rn(v));
}

#endif

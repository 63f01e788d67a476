/*
 * cuda_rope.cuh - the RoPE pieces shared by the kernels that rotate head
 * tails (cuda_attention.cu's rope_tail and fused head norm, cuda_matvec.cu's
 * products that rotate their activations back as they quantise them): one
 * copy of the angle, the table and the rotation, so a fused kernel rotates
 * exactly as rope_tail_kernel does.
 *
 * The angle is the CPU's rope_angle, operation for operation in double with
 * no contraction; the position-free pow(base, -2k / n_rot) is made on the
 * host, as the CPU makes it, while the pairs fit the parameters' table.
 * cos and sin are rounded to float once; the rotation of a pair (x0, x1) is
 * x0 c - x1 s, x0 s + x1 c with __fmul_rn / __fsub_rn / __fadd_rn.
 */
#ifndef DS4_BACKENDS_CUDA_ROPE_CUH
#define DS4_BACKENDS_CUDA_ROPE_CUH

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cuda_runtime.h>

#include "backends/backend.h"

/* RoPE parameters that travel with a launch; N: pairs of the host's
 * frequency table (more pairs than that use the device's pow). */
template <int N> struct cuda_rope_params {
    int n_rot;
    int table; /* freq[k] holds pow(base, -2k / n_rot), made on the host as the CPU makes it */
    double base, factor, yarn_lo, yarn_hi;
    double sin_sign; /* -1: the inverse rotation */
    double freq[N];
};

/* The launch's copy of the RoPE parameters (n_rot checked by the caller). */
template <int N> static inline cuda_rope_params<N> cuda_rope_params_of(const ds4_rope *rope, bool inverse) {
    cuda_rope_params<N> rp;
    memset(&rp, 0, sizeof rp); /* padding too: recorded steps compare argument bytes */
    const int64_t n_rot = rope->n_rot, half = n_rot / 2;
    rp.n_rot = (int)n_rot;
    rp.base = (double)rope->base;
    rp.factor = (double)rope->factor;
    rp.yarn_lo = (double)rope->yarn_lo;
    rp.yarn_hi = (double)rope->yarn_hi;
    rp.sin_sign = inverse ? -1.0 : 1.0;
    rp.table = half <= N;
    for (int64_t k = 0; rp.table && k < half; k++) rp.freq[k] = pow(rp.base, -2.0 * (double)k / (double)n_rot);
    return rp;
}

/* The CPU's rope_angle of pair k at position p. */
template <int N> static __device__ double cuda_rope_angle(const cuda_rope_params<N> &rp, int64_t p, int64_t k) {
    const double f = rp.table ? rp.freq[k] : pow(rp.base, -2.0 * (double)k / (double)rp.n_rot);
    const double theta = (double)p * f;
    if (!(rp.factor > 1.0)) return theta;
    double span = rp.yarn_hi - rp.yarn_lo;
    if (span < 0.001) span = 0.001;
    double y = ((double)k - rp.yarn_lo) / span;
    if (y < 0.0) y = 0.0;
    if (y > 1.0) y = 1.0;
    const double ramp = 1.0 - y;
    return __dadd_rn(__dmul_rn(theta / rp.factor, 1.0 - ramp), __dmul_rn(theta, ramp));
}

/* Entry i of the tables of n_rows rows (i = r * half + k: row r, pair k)
 * into cs: row r's cos of each pair at cs + r * n_rot, then its sin times
 * sin_sign. Callers spread i over their threads and put a barrier after. */
template <int N>
static __device__ __forceinline__ void cuda_rope_entry(const cuda_rope_params<N> &rp, const int32_t *pos, int i,
                                                       float *cs) {
    const int half = rp.n_rot / 2, r = i / half, k = i - r * half;
    const double theta = cuda_rope_angle(rp, pos[r], k);
    double sn, c;
    sincos(theta, &sn, &c);
    cs[r * rp.n_rot + k] = (float)c;
    cs[r * rp.n_rot + half + k] = (float)(rp.sin_sign * sn);
}

/* One row's table at position pos[0] by the block's threads (a barrier after). */
template <int N>
static __device__ __forceinline__ void cuda_rope_table(const cuda_rope_params<N> &rp, const int32_t *pos, float *cs) {
    for (int k = threadIdx.x; k < rp.n_rot / 2; k += blockDim.x) cuda_rope_entry(rp, pos, k, cs);
    __syncthreads();
}

/* The pair (x0, x1) rotated by (c, s). */
static __device__ __forceinline__ void cuda_rope_rotate(float &x0, float &x1, float c, float s) {
    const float a = x0, b = x1;
    x0 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    x1 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

#endif

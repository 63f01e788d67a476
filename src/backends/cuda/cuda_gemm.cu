/*
 * cuda_gemm.cu - batched (prefill) products of Q8_0 weights on the int8
 * tensor cores, under DS4 numerics.
 *
 * DS4 multiplies a Q8_0 weight by DS4's Q8_0 activation blocks: per 32-block
 * the exact int8 dot isum, then the float block term (f16(w.d) * x.d) * isum,
 * summed over the blocks. One Q8_0 block is exactly the K = 32 of the int8
 * MMA m16n8k32 (s8 x s8 -> s32), so the tensor cores produce each block's
 * isum exactly for a 16 x 8 tile of (weight row, token) pairs; the block
 * term is then formed with the CPU's float operations (__fmul_rn, never an
 * FMA) and added to a float accumulator. Every block term is the CPU's bit
 * for bit; only the order of the sum over blocks differs, as in the other
 * DS4 kernels.
 *
 * Tiling: a thread block computes 64 weight rows x 64 tokens with 4 warps
 * (2 x 2, each 32 x 32: two 16-row A fragments by four 8-token B fragments).
 * Stages of 8 blocks (K = 256) of both operands are copied to shared memory
 * with cp.async (16-byte pieces: a weight row stage is 272 bytes, an
 * activation row stage 288), double-buffered so the next stage loads while
 * this one is multiplied. Activation rows are padded to 304 bytes in shared
 * memory so the B-fragment reads of 8 tokens hit 8 different banks.
 */
#include <stdint.h>
#include <string.h>

#include "backends/cuda/cuda_gemm.h"
#include "backends/cuda/cuda_internal.h"

#define G_BM 64      /* weight rows per block */
#define G_BN 64      /* tokens per block */
#define G_KB 8       /* Q8_0 blocks per stage */
#define G_THREADS 128
#define G_WROW (G_KB * 34)      /* 272 bytes of a weight row per stage */
#define G_XROW (G_KB * 36)      /* 288 bytes of an activation row per stage */
#define G_XPAD 304              /* its pitch in shared memory */
#define G_WSTAGE (G_BM * G_WROW)
#define G_XSTAGE (G_BN * G_XPAD)
#define G_STAGE (G_WSTAGE + G_XSTAGE)
#define G_SMEM (2 * G_STAGE)

static_assert(G_WROW % 16 == 0 && G_XROW % 16 == 0 && G_XPAD % 16 == 0, "cp.async pieces");

struct gemm_args {
    const uint8_t *w; /* first weight row (row0 applied) */
    int64_t row_bytes;
    int64_t n_out;
    const uint8_t *x; /* Q8_0 activation rows */
    int64_t x_row_bytes;
    int64_t n_tok;
    int64_t n_stages; /* K / 256 */
    float *out;
    int64_t out_stride;
};

/* Four int8 codes at a 2-byte aligned shared address. */
static __device__ __forceinline__ int lds_s8x4(const uint8_t *p) {
    const uint16_t *h = (const uint16_t *)p;
    return (int)((uint32_t)h[0] | ((uint32_t)h[1] << 16));
}

static __device__ __forceinline__ void load_stage(const gemm_args &a, uint8_t *sw, uint8_t *sx, int64_t n0, int64_t m0,
                                                  int64_t st) {
    const int t = threadIdx.x;
    for (int i = t; i < G_BM * (G_WROW / 16); i += G_THREADS) {
        const int r = i / (G_WROW / 16), c = i % (G_WROW / 16);
        const bool ok = n0 + r < a.n_out;
        const uint8_t *src = a.w + (ok ? (n0 + r) * a.row_bytes + st * G_WROW + 16 * c : 0);
        cp_async16(sw + r * G_WROW + 16 * c, src, ok);
    }
    for (int i = t; i < G_BN * (G_XROW / 16); i += G_THREADS) {
        const int r = i / (G_XROW / 16), c = i % (G_XROW / 16);
        const bool ok = m0 + r < a.n_tok;
        const uint8_t *src = a.x + (ok ? (m0 + r) * a.x_row_bytes + st * G_XROW + 16 * c : 0);
        cp_async16(sx + r * G_XPAD + 16 * c, src, ok);
    }
}

__global__ void __launch_bounds__(G_THREADS) gemm_q8_0_kernel(gemm_args a) {
    cuda_grid_wait();
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32; /* this warp's rows / tokens in the tile */
    const int64_t n0 = (int64_t)blockIdx.x * G_BM, m0 = (int64_t)blockIdx.y * G_BN;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;

    load_stage(a, smem, smem + G_WSTAGE, n0, m0, 0);
    cp_async_commit();
    for (int64_t st = 0; st < a.n_stages; st++) {
        uint8_t *cur = smem + (st & 1) * G_STAGE;
        if (st + 1 < a.n_stages) {
            uint8_t *nxt = smem + ((st + 1) & 1) * G_STAGE;
            load_stage(a, nxt, nxt + G_WSTAGE, n0, m0, st + 1);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const uint8_t *sw = cur, *sx = cur + G_WSTAGE;
#pragma unroll 2
        for (int b = 0; b < G_KB; b++) {
            int af[2][4];
            float wd[2][2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const uint8_t *r0 = sw + (wm + 16 * i + g) * G_WROW + 34 * b, *r1 = r0 + 8 * G_WROW;
                af[i][0] = lds_s8x4(r0 + 2 + 4 * tq);
                af[i][1] = lds_s8x4(r1 + 2 + 4 * tq);
                af[i][2] = lds_s8x4(r0 + 2 + 16 + 4 * tq);
                af[i][3] = lds_s8x4(r1 + 2 + 16 + 4 * tq);
                wd[i][0] = cuda_f16_to_f32(*(const uint16_t *)r0);
                wd[i][1] = cuda_f16_to_f32(*(const uint16_t *)r1);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const uint8_t *xc = sx + (wn + 8 * j + g) * G_XPAD + 36 * b; /* B column: token g */
                const int bf[2] = { *(const int *)(xc + 4 + 4 * tq), *(const int *)(xc + 4 + 16 + 4 * tq) };
                /* the tokens of this thread's accumulators: 2 tq and 2 tq + 1 */
                const float xd0 = *(const float *)(sx + (wn + 8 * j + 2 * tq) * G_XPAD + 36 * b);
                const float xd1 = *(const float *)(sx + (wn + 8 * j + 2 * tq + 1) * G_XPAD + 36 * b);
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    int c[4] = { 0, 0, 0, 0 };
                    cuda_mma_s8(c, af[i], bf[0], bf[1]);
                    acc[i][j][0] = __fadd_rn(acc[i][j][0], __fmul_rn(__fmul_rn(wd[i][0], xd0), __int2float_rn(c[0])));
                    acc[i][j][1] = __fadd_rn(acc[i][j][1], __fmul_rn(__fmul_rn(wd[i][0], xd1), __int2float_rn(c[1])));
                    acc[i][j][2] = __fadd_rn(acc[i][j][2], __fmul_rn(__fmul_rn(wd[i][1], xd0), __int2float_rn(c[2])));
                    acc[i][j][3] = __fadd_rn(acc[i][j][3], __fmul_rn(__fmul_rn(wd[i][1], xd1), __int2float_rn(c[3])));
                }
            }
        }
        __syncthreads(); /* the buffer is refilled two stages later */
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int64_t n = n0 + wm + 16 * i + g + (k >= 2 ? 8 : 0);
                const int64_t m = m0 + wn + 8 * j + 2 * tq + (k & 1);
                if (n < a.n_out && m < a.n_tok) a.out[m * a.out_stride + n] = acc[i][j][k];
            }
        }
    }
}

/* The grid of a GEMM of n_out rows x n_tok tokens in bm x bn tiles (false
 * with the error recorded when it is too large). */
static bool gemm_grid(ds4_backend *be, int64_t n_out, int64_t n_tok, int bm, int bn, dim3 *grid) {
    const int64_t gx = (n_out + bm - 1) / bm, gy = (n_tok + bn - 1) / bn;
    if (gx > INT32_MAX || gy > 65535) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "gemm: %lld rows x %lld tokens is too large a grid", (long long)n_out,
                  (long long)n_tok);
        return false;
    }
    *grid = dim3((unsigned)gx, (unsigned)gy);
    return true;
}

bool cuda_gemm_q8_0_fits(int64_t n_in, int64_t row_bytes, int64_t x_row_bytes, int64_t n_tok) {
    return n_tok >= CUDA_GEMM_MIN_TOKENS && n_in % 256 == 0 && row_bytes % 16 == 0 && x_row_bytes % 16 == 0;
}

bool cuda_gemm_q8_0(ds4_backend *be, const void *w, int64_t row_bytes, int64_t n_in, int64_t n_out, const void *xq,
                    int64_t x_row_bytes, int64_t n_tok, float *out, int64_t out_stride) {
    /* per call: the attribute belongs to the current device, and a process
     * may drive several */
    if (!cuda_allow_dynamic_smem(be, (const void *)gemm_q8_0_kernel, G_SMEM, "matmul (int8 GEMM)", n_in)) return false;
    gemm_args a;
    a.w = (const uint8_t *)w;
    a.row_bytes = row_bytes;
    a.n_out = n_out;
    a.x = (const uint8_t *)xq;
    a.x_row_bytes = x_row_bytes;
    a.n_tok = n_tok;
    a.n_stages = n_in / 256;
    a.out = out;
    a.out_stride = out_stride;
    dim3 grid;
    return gemm_grid(be, n_out, n_tok, G_BM, G_BN, &grid) &&
           cuda_launch(be, "gemm_q8_0_kernel", gemm_q8_0_kernel, grid, G_THREADS, G_SMEM, a);
}

/* ------------------------------------------------------------------------ */
/* Float weights (F32, F16, BF16) times float activations, DS4 numerics       */
/* ------------------------------------------------------------------------ */
/*
 * DS4's float products (MM_F32: float products, float sums) for many
 * tokens: a tiled FFMA GEMM. A thread block computes 64 weight rows x 64
 * tokens, each thread 4 x 4 of them; stages of K = 32 of both operands go
 * to shared memory k-major as floats (half weights widened there once per
 * tile, not once per token), so the inner step is two 16-byte shared loads
 * and 16 FMAs. The sum over k runs in k order per output (a different order
 * from the CPU's, as every parallel DS4 float product).
 */
#define F_BM 64
#define F_BN 64
#define F_BK 32
#define F_THREADS 256
#define F_PAD 4 /* floats of padding per k row of a tile */

struct fgemm_args {
    const uint8_t *w; /* first weight row (row0 applied) */
    int64_t row_bytes, n_out;
    const float *x;
    int64_t x_stride, n_tok, n_in;
    float *out;
    int64_t out_stride;
};

template <uint32_t T> __global__ void __launch_bounds__(F_THREADS) fgemm_kernel(fgemm_args a) {
    __shared__ __align__(16) float sw[F_BK][F_BM + F_PAD];
    __shared__ __align__(16) float sx[F_BK][F_BN + F_PAD];
    cuda_grid_wait();
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int64_t n0 = (int64_t)blockIdx.x * F_BM, m0 = (int64_t)blockIdx.y * F_BN;
    /* loads: thread -> (row or token tid / 4, k chunk 8 (tid % 4)) */
    const int lr = tid >> 2, lk = 8 * (tid & 3);
    const bool w_ok = n0 + lr < a.n_out, x_ok = m0 + lr < a.n_tok;
    const uint8_t *wrow = a.w + (w_ok ? (n0 + lr) * a.row_bytes : 0);
    const float *xrow = a.x + (x_ok ? (m0 + lr) * a.x_stride : 0);
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int64_t k0 = 0; k0 < a.n_in; k0 += F_BK) {
        float wv[8], xv[8];
        if (w_ok) {
            if constexpr (T == DS4_TYPE_F32) {
                const float4 p = *(const float4 *)(wrow + 4 * (k0 + lk));
                const float4 q = *(const float4 *)(wrow + 4 * (k0 + lk) + 16);
                wv[0] = p.x, wv[1] = p.y, wv[2] = p.z, wv[3] = p.w, wv[4] = q.x, wv[5] = q.y, wv[6] = q.z, wv[7] = q.w;
            } else {
                cuda_half8_to_f32<T>(*(const uint4 *)(wrow + 2 * (k0 + lk)), wv);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) wv[i] = 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 8; i++) xv[i] = x_ok ? xrow[k0 + lk + i] : 0.0f;
        __syncthreads(); /* the previous stage is read */
#pragma unroll
        for (int i = 0; i < 8; i++) {
            sw[lk + i][lr] = wv[i];
            sx[lk + i][lr] = xv[i];
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < F_BK; k++) {
            const float4 w4 = *(const float4 *)&sw[k][4 * ty], x4 = *(const float4 *)&sx[k][4 * tx];
            const float wr[4] = { w4.x, w4.y, w4.z, w4.w }, xr[4] = { x4.x, x4.y, x4.z, x4.w };
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(wr[i], xr[j], acc[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int64_t n = n0 + 4 * ty + i;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int64_t m = m0 + 4 * tx + j;
            if (n < a.n_out && m < a.n_tok) a.out[m * a.out_stride + n] = acc[i][j];
        }
    }
}

bool cuda_gemm_float_fits(uint32_t type, int64_t n_in, int64_t row_bytes, int64_t n_tok) {
    return (type == DS4_TYPE_F32 || type == DS4_TYPE_F16 || type == DS4_TYPE_BF16) && n_tok >= CUDA_GEMM_MIN_TOKENS &&
           n_in > 0 && n_in % F_BK == 0 && row_bytes % 16 == 0;
}

bool cuda_gemm_float(ds4_backend *be, uint32_t type, const void *w, int64_t row_bytes, int64_t n_in, int64_t n_out,
                     const float *x, int64_t x_stride, int64_t n_tok, float *out, int64_t out_stride) {
    fgemm_args a;
    a.w = (const uint8_t *)w;
    a.row_bytes = row_bytes;
    a.n_out = n_out;
    a.x = x;
    a.x_stride = x_stride;
    a.n_tok = n_tok;
    a.n_in = n_in;
    a.out = out;
    a.out_stride = out_stride;
    dim3 grid;
    if (!gemm_grid(be, n_out, n_tok, F_BM, F_BN, &grid)) return false;
    switch (type) {
    case DS4_TYPE_F32: return cuda_launch(be, "fgemm_kernel<F32>", fgemm_kernel<DS4_TYPE_F32>, grid, F_THREADS, 0, a);
    case DS4_TYPE_F16: return cuda_launch(be, "fgemm_kernel<F16>", fgemm_kernel<DS4_TYPE_F16>, grid, F_THREADS, 0, a);
    default: return cuda_launch(be, "fgemm_kernel<BF16>", fgemm_kernel<DS4_TYPE_BF16>, grid, F_THREADS, 0, a);
    }
}

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
 * Tiling: a thread block computes BM weight rows x 64 tokens with BM / 16
 * warps (BM / 32 x 2, each 32 x 32: two 16-row A fragments by four 8-token
 * B fragments). Stages of 8 blocks (K = 256) of both operands are copied to
 * shared memory with cp.async (16-byte pieces: a weight row stage is 272
 * bytes, an activation row stage 288), double-buffered so the next stage
 * loads while this one is multiplied. Activation rows are padded to 304
 * bytes in shared memory so the B-fragment reads of 8 tokens hit 8
 * different banks. BM = 64 (4 warps, 73.7 KB: three blocks, 12 warps an
 * SM) or 128 (8 warps, 108.5 KB: two blocks, 16 warps an SM, each
 * activation stage shared by twice the rows; ds4_cuda_backend_set_gemm_bm,
 * DS4_CUDA_GEMM_BM). Each output sums its block terms in the same order
 * either way: the same bits.
 */
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include "backends/cuda/cuda_gemm.h"
#include "backends/cuda/cuda_internal.h"

#define G_BN 64      /* tokens per block */
#define G_KB 8       /* Q8_0 blocks per stage */
#define G_WROW (G_KB * 34)      /* 272 bytes of a weight row per stage */
#define G_XROW (G_KB * 36)      /* 288 bytes of an activation row per stage */
#define G_XPAD 304              /* its pitch in shared memory */
#define G_XSTAGE (G_BN * G_XPAD)
#define GEMM_MAX_SPLITS 16

static_assert(G_WROW % 16 == 0 && G_XROW % 16 == 0 && G_XPAD % 16 == 0, "cp.async pieces");

/* The geometry of a block of BM weight rows. */
template <int BM> struct gemm_geom {
    static_assert(BM == 64 || BM == 128, "64 or 128 weight rows a block");
    static constexpr int THREADS = 2 * BM;                 /* BM / 16 warps */
    static constexpr int MIN_BLOCKS = BM == 64 ? 3 : 2;    /* per SM, as the shared memory allows */
    static constexpr int WSTAGE = BM * G_WROW, STAGE = WSTAGE + G_XSTAGE, SMEM = 2 * STAGE;
    /* a thread's cp.async pieces of a stage (gemm_plan) */
    static constexpr int WPIECES = (BM * (G_WROW / 16) + THREADS - 1) / THREADS;
    static constexpr int XPIECES = (G_BN * (G_XROW / 16) + THREADS - 1) / THREADS;
    static_assert(WPIECES <= 32 && XPIECES <= 32, "a bit per piece");
    static_assert(MIN_BLOCKS * (SMEM + 1024) <= 228 * 1024, "the blocks an SM holds");
};

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
    /* groups (gridDim.z = n_groups x splits): group g's weight rows start
     * g w_group_bytes on, its activation blocks g x_group_bytes into each
     * row, its outputs g n_out into each output row */
    int64_t w_group_bytes, x_group_bytes;
    int splits;
    float *part; /* splits > 1: partial sums [group][split][n_tok][n_out], else NULL */
};

/* A warp tile's accumulators (2 A fragments x 4 B fragments x 4) set to 0. */
static __device__ __forceinline__ void zero_tile(float (&t)[2][4][4]) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) t[i][j][k] = 0.0f;
}

/* Four int8 codes at a 2-byte aligned shared address. */
static __device__ __forceinline__ int lds_s8x4(const uint8_t *p) {
    const uint16_t *h = (const uint16_t *)p;
    return (int)((uint32_t)h[0] | ((uint32_t)h[1] << 16));
}

/* A thread's cp.async pieces of a stage, the same for every stage: piece k
 * of the weights is 16 bytes of row r = i / 17 (i = tid + THREADS k) at
 * column piece c = i % 17, from w_off[k] bytes past the stage's row base, to
 * byte 16 i of the weight stage; of the activations, row r = i / 18, c = i %
 * 18, from x_off[k], to x_dst[k]. Rows past the tile's end read nothing
 * (the ok masks; offset 0) and are zero-filled. Made once, so a stage's
 * copies cost an address add each instead of a division and 64-bit
 * products. */
template <int BM> struct gemm_plan {
    typedef gemm_geom<BM> G;
    uint32_t w_off[G::WPIECES], x_off[G::XPIECES], x_dst[G::XPIECES];
    uint32_t w_in, w_ok, x_in, x_ok; /* bit k: piece k exists / reads */
};

template <int BM>
static __device__ __forceinline__ gemm_plan<BM> gemm_plan_of(const gemm_args &a, int64_t n0, int64_t m0) {
    typedef gemm_geom<BM> G;
    gemm_plan<BM> p;
    p.w_in = p.w_ok = p.x_in = p.x_ok = 0u;
    const int t = threadIdx.x;
#pragma unroll
    for (int k = 0; k < G::WPIECES; k++) {
        const int i = t + k * G::THREADS, r = i / (G_WROW / 16), c = i % (G_WROW / 16);
        const bool in = i < BM * (G_WROW / 16), ok = in && n0 + r < a.n_out;
        p.w_off[k] = ok ? (uint32_t)(r * a.row_bytes + 16 * c) : 0u;
        p.w_in |= (uint32_t)in << k;
        p.w_ok |= (uint32_t)ok << k;
    }
#pragma unroll
    for (int k = 0; k < G::XPIECES; k++) {
        const int i = t + k * G::THREADS, r = i / (G_XROW / 16), c = i % (G_XROW / 16);
        const bool in = i < G_BN * (G_XROW / 16), ok = in && m0 + r < a.n_tok;
        p.x_off[k] = ok ? (uint32_t)(r * a.x_row_bytes + 16 * c) : 0u;
        p.x_dst[k] = (uint32_t)(r * G_XPAD + 16 * c);
        p.x_in |= (uint32_t)in << k;
        p.x_ok |= (uint32_t)ok << k;
    }
    return p;
}

/* Stage st's pieces (wb, xb: the tile's first weight and activation rows). */
template <int BM>
static __device__ __forceinline__ void load_stage(const gemm_plan<BM> &p, const uint8_t *wb, const uint8_t *xb,
                                                  uint8_t *sw, uint8_t *sx, int64_t st) {
    typedef gemm_geom<BM> G;
    const uint8_t *ws = wb + st * G_WROW, *xs = xb + st * G_XROW;
#pragma unroll
    for (int k = 0; k < G::WPIECES; k++)
        if ((p.w_in >> k) & 1u)
            cp_async16(sw + 16 * (threadIdx.x + k * G::THREADS), ws + p.w_off[k], (p.w_ok >> k) & 1u);
#pragma unroll
    for (int k = 0; k < G::XPIECES; k++)
        if ((p.x_in >> k) & 1u) cp_async16(sx + p.x_dst[k], xs + p.x_off[k], (p.x_ok >> k) & 1u);
}

/* BM = 64: three blocks per SM (the 73.7 KB of shared memory allow no
 * more), up to 168 registers, so the split's and group's bases do not
 * spill; BM = 128: two blocks of 8 warps, up to 128 registers */
template <int BM>
__global__ void __launch_bounds__(gemm_geom<BM>::THREADS, gemm_geom<BM>::MIN_BLOCKS) gemm_q8_0_kernel(gemm_args a) {
    typedef gemm_geom<BM> G;
    cuda_grid_wait();
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32; /* this warp's rows / tokens in the tile */
    const int64_t n0 = (int64_t)blockIdx.x * BM, m0 = (int64_t)blockIdx.y * G_BN;
    /* this block's group, and its stages: all of K, or its split's share */
    const int grp = (int)blockIdx.z / a.splits, zs = (int)blockIdx.z % a.splits;
    a.w += grp * a.w_group_bytes;
    a.x += grp * a.x_group_bytes;
    const int64_t st0 = a.n_stages * zs / a.splits, st1 = a.n_stages * (zs + 1) / a.splits;

    float acc[2][4][4];
    zero_tile(acc);

    /* (the tile's first rows: offsets of up to 128 rows fit 32 bits, cuda_gemm_q8_0_fits checks) */
    const gemm_plan<BM> plan = gemm_plan_of<BM>(a, n0, m0);
    const uint8_t *wb = a.w + n0 * a.row_bytes, *xb = a.x + m0 * a.x_row_bytes;
    load_stage<BM>(plan, wb, xb, smem, smem + G::WSTAGE, st0);
    cp_async_commit();
    for (int64_t st = st0; st < st1; st++) {
        uint8_t *cur = smem + ((st - st0) & 1) * G::STAGE;
        if (st + 1 < st1) {
            uint8_t *nxt = smem + ((st - st0 + 1) & 1) * G::STAGE;
            load_stage<BM>(plan, wb, xb, nxt, nxt + G::WSTAGE, st + 1);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const uint8_t *sw = cur, *sx = cur + G::WSTAGE;
#pragma unroll 2 /* (an even and an odd block: the parity known in each body) */
        for (int b = 0; b < G_KB; b++) {
            int af[2][4];
            float wd[2][2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const uint8_t *r0 = sw + (wm + 16 * i + g) * G_WROW + 34 * b, *r1 = r0 + 8 * G_WROW;
                if (b & 1) { /* an odd block's codes start 4-byte aligned (34 b + 2 = 68 k + 36) */
                    af[i][0] = *(const int *)(r0 + 2 + 4 * tq);
                    af[i][1] = *(const int *)(r1 + 2 + 4 * tq);
                    af[i][2] = *(const int *)(r0 + 2 + 16 + 4 * tq);
                    af[i][3] = *(const int *)(r1 + 2 + 16 + 4 * tq);
                } else {
                    af[i][0] = lds_s8x4(r0 + 2 + 4 * tq);
                    af[i][1] = lds_s8x4(r1 + 2 + 4 * tq);
                    af[i][2] = lds_s8x4(r0 + 2 + 16 + 4 * tq);
                    af[i][3] = lds_s8x4(r1 + 2 + 16 + 4 * tq);
                }
                /* (the hardware conversion alone: the scale is only multiplied, and a
                 * product of a NaN is the canonical NaN either way, as in q8_0_block) */
                wd[i][0] = cuda_f16_to_f32_arith(*(const uint16_t *)r0);
                wd[i][1] = cuda_f16_to_f32_arith(*(const uint16_t *)r1);
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

    float *out = a.part ? a.part + (int64_t)blockIdx.z * a.n_tok * a.n_out : a.out + grp * a.n_out;
    const int64_t stride = a.part ? a.n_out : a.out_stride;
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int64_t n = n0 + wm + 16 * i + g + (k >= 2 ? 8 : 0);
                const int64_t m = m0 + wn + 8 * j + 2 * tq + (k & 1);
                if (n < a.n_out && m < a.n_tok) out[m * stride + n] = acc[i][j][k];
            }
        }
    }
}

/* Split K: out[m][g n_out + n] = (group g's partial sums, in split order,
 * from 0) times unscale[m] when given. One thread per output. */
__global__ void __launch_bounds__(256) gemm_reduce_kernel(const float *__restrict__ part, int splits, int64_t n_groups,
                                                          int64_t n_tok, int64_t n_out,
                                                          const float *__restrict__ unscale, float *__restrict__ out,
                                                          int64_t out_stride) {
    cuda_grid_wait();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, per = n_tok * n_out;
    if (i >= n_groups * per) return;
    const int64_t g = i / per, r = i - g * per, m = r / n_out, n = r - m * n_out;
    const float *p = part + g * splits * per + r;
    float s = 0.0f;
    for (int z = 0; z < splits; z++) s = __fadd_rn(s, p[(int64_t)z * per]);
    out[m * out_stride + g * n_out + n] = unscale ? __fmul_rn(s, unscale[m]) : s;
}

/* How many ways to split K for a grid of `tiles` output tiles of n_stages
 * stages each: while the tiles alone leave the device short of about two
 * blocks per multiprocessor (skinny products: a batched decode's 9 to 64
 * rows), each tile's stages are shared out over several blocks, each
 * keeping at least min_stages of them (DS4_CUDA_GEMM_SPLIT=0: never). */
static int gemm_splits(ds4_backend *be, int64_t tiles, int64_t n_stages, int64_t min_stages) {
    static const bool on = cuda_env_flag("DS4_CUDA_GEMM_SPLIT", true);
    const int64_t want = 2 * (int64_t)cuda_sm_count(cuda_impl(be));
    if (!on || tiles >= want) return 1;
    int64_t s = (want + tiles - 1) / tiles;
    const int64_t most = n_stages / min_stages;
    if (s > most) s = most;
    if (s > GEMM_MAX_SPLITS) s = GEMM_MAX_SPLITS;
    return s > 1 ? (int)s : 1;
}

/* The partial-sum buffer of a split launch (NULL with the error recorded). */
static float *gemm_parts(ds4_backend *be, int splits, int64_t n_groups, int64_t n_tok, int64_t n_out) {
    return (float *)cuda_scratch(be, CUDA_SCRATCH_GEMM_PART,
                                 (size_t)splits * (size_t)n_groups * (size_t)n_tok * (size_t)n_out * 4u);
}

/* The reduction of a split launch into out (rows out_stride apart). */
static bool gemm_reduce(ds4_backend *be, const float *part, int splits, int64_t n_groups, int64_t n_tok,
                        int64_t n_out, const float *unscale, float *out, int64_t out_stride) {
    const int64_t n = n_groups * n_tok * n_out;
    return cuda_launch(be, "gemm_reduce_kernel", gemm_reduce_kernel, (unsigned)((n + 255) / 256), 256, 0, part,
                       splits, n_groups, n_tok, n_out, unscale, out, out_stride);
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
    /* (rows of at most 32 MiB: a tile's 128 rows' offsets fit gemm_plan's 32 bits) */
    return n_tok >= CUDA_GEMM_MIN_TOKENS && n_in % 256 == 0 && row_bytes % 16 == 0 && x_row_bytes % 16 == 0 &&
           row_bytes <= ((int64_t)1 << 25) && x_row_bytes <= ((int64_t)1 << 25);
}

bool cuda_gemm_q8_0(ds4_backend *be, const void *w, int64_t row_bytes, int64_t n_in, int64_t n_out, const void *xq,
                    int64_t x_row_bytes, int64_t n_tok, float *out, int64_t out_stride) {
    return cuda_gemm_q8_0_grouped(be, w, row_bytes, n_in, n_out, 1, xq, x_row_bytes, n_tok, out, out_stride);
}

/* The launch of gemm_q8_0_kernel<BM> (and the reduction of a split one). */
template <int BM>
static bool gemm_q8_0_launch(ds4_backend *be, gemm_args a, int64_t n_in, int64_t n_groups) {
    typedef gemm_geom<BM> G;
    /* per call: the attribute belongs to the current device, and a process
     * may drive several */
    if (!cuda_allow_dynamic_smem(be, (const void *)gemm_q8_0_kernel<BM>, G::SMEM, "matmul (int8 GEMM)", n_in))
        return false;
    dim3 grid;
    if (!gemm_grid(be, a.n_out, a.n_tok, BM, G_BN, &grid)) return false;
    a.splits = gemm_splits(be, (int64_t)grid.x * grid.y * n_groups, a.n_stages, 2);
    grid.z = (unsigned)(a.splits * n_groups);
    if (a.splits > 1 && !(a.part = gemm_parts(be, a.splits, n_groups, a.n_tok, a.n_out))) return false;
    return cuda_launch(be, "gemm_q8_0_kernel", gemm_q8_0_kernel<BM>, grid, G::THREADS, G::SMEM, a) &&
           (a.splits == 1 || gemm_reduce(be, a.part, a.splits, n_groups, a.n_tok, a.n_out, NULL, a.out, a.out_stride));
}

bool cuda_gemm_q8_0_grouped(ds4_backend *be, const void *w, int64_t row_bytes, int64_t n_in, int64_t n_out,
                            int64_t n_groups, const void *xq, int64_t x_row_bytes, int64_t n_tok, float *out,
                            int64_t out_stride) {
    if (!cuda_gemm_q8_0_fits(n_in, row_bytes, x_row_bytes, n_tok)) {
        cuda_fail(be, DS4_ERR_INVALID, "gemm: %lld tokens of rows of %lld bytes do not suit the int8 GEMM",
                  (long long)n_tok, (long long)row_bytes);
        return false;
    }
    if (n_groups < 1 || n_groups > CUDA_GEMM_MAX_GROUPS) {
        cuda_fail(be, DS4_ERR_INVALID, "gemm: %lld groups", (long long)n_groups);
        return false;
    }
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
    a.w_group_bytes = n_out * row_bytes;
    a.x_group_bytes = (n_in / DS4_QK8_0) * 36;
    a.part = NULL;
    a.splits = 1;
    /* blocks of 128 rows where the backend's setting asks for them and their
     * tiles alone fill the device (no split of K: a prefill's products; a
     * batched decode's few tiles keep the blocks of 64 and their splits) */
    const int64_t tiles128 = (n_out + 127) / 128 * ((n_tok + G_BN - 1) / G_BN) * n_groups;
    cuda_backend *cb = cuda_impl(be);
    if (cb->gemm_bm == 128 && tiles128 >= 2 * (int64_t)cuda_sm_count(cb)) {
        if (!gemm_q8_0_launch<128>(be, a, n_in, n_groups)) return false;
        cb->gemm_bm128_calls++;
        return true;
    }
    return gemm_q8_0_launch<64>(be, a, n_in, n_groups);
}

/* ------------------------------------------------------------------------ */
/* F16 weights times float activations on the f16 tensor cores              */
/* ------------------------------------------------------------------------ */
/*
 * DS4's F16 products (MM_F32: float activations, float sums) for many
 * tokens. The weights are binary16 already; each activation row is scaled by
 * a power of two s (its largest |x| lands in [2^14, 2^15)) and split into two
 * binary16 parts, hi = f16(x 2^s) and lo = f16(x 2^s - hi): hi + lo carries 22
 * of the 24 bits of x (and the scale keeps the parts out of binary16's
 * overflow and mostly out of its subnormals). The MMA m16n8k16 (f16 x f16 ->
 * f32) forms w hi and w lo exactly and sums them in float; each K = 32 stage
 * is summed from zero by the MMAs and then added (rounded) to the float
 * accumulator, so the tensor cores' truncating sums only ever see a stage's
 * 64 products; the result is multiplied by 2^-s. The error is of the order
 * of the float sums' own (a different order of summation, as in every
 * parallel DS4 float product; test_cuda_matmul bounds it).
 *
 * Tiling: a thread block computes 64 weight rows x 64 tokens with 4 warps
 * (2 x 2, each 32 x 32: two 16-row A fragments by four 8-token B fragments,
 * both parts of x), three K = 32 stages in flight through cp.async; rows are
 * 80 bytes apart in shared memory so ldmatrix's 8-row reads hit 32 banks.
 */
#define H_BM 64
#define H_BN 64
#define H_BK 32
#define H_STAGES 3
#define H_THREADS 128
#define H_PITCH 40 /* halves per row of a stage in shared memory (32 + 8) */
#define H_WSTAGE (H_BM * H_PITCH)
#define H_XSTAGE (2 * H_BN * H_PITCH) /* hi rows, then lo rows */
#define H_STAGE (H_WSTAGE + H_XSTAGE)

struct hgemm_args {
    const uint8_t *w; /* first weight row (row0 applied) */
    int64_t row_bytes, n_out;
    const uint16_t *xs; /* split rows: hi (n_in halves), then lo, 2 n_in halves per token */
    const float *unscale; /* 2^-s per token */
    int64_t n_tok, n_in;
    float *out;
    int64_t out_stride;
    float *part; /* split K (gridDim.z > 1): unscaled partial sums [split][n_tok][n_out], else NULL */
};

/* One block per token row: s, then the two parts. */
__global__ void __launch_bounds__(256) split_f16_kernel(const float *x, int64_t x_stride, int64_t n, uint16_t *xs,
                                                        float *unscale) {
    cuda_grid_wait();
    __shared__ float s_max[8];
    const int64_t r = blockIdx.x;
    const float *xr = x + r * x_stride;
    float m = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, fabsf(xr[i])); /* fmaxf drops NaNs */
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0.0f;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) m = fmaxf(m, s_max[i]);
    const int s = cuda_f16_split_scale(m);
    uint16_t *hi = xs + r * 2 * n, *lo = hi + n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        __half h, l;
        cuda_f16_split(ldexpf(xr[i], s), h, l);
        hi[i] = __half_as_ushort(h);
        lo[i] = __half_as_ushort(l);
    }
    if (threadIdx.x == 0) unscale[r] = ldexpf(1.0f, -s);
}

static __device__ __forceinline__ void hgemm_load(const hgemm_args &a, uint16_t *st, int64_t n0, int64_t m0,
                                                  int64_t k0) {
    const int t = threadIdx.x;
#pragma unroll
    for (int it = 0; it < H_BM * 4 / H_THREADS; it++) { /* 4 pieces of 16 bytes per row */
        const int i = t + it * H_THREADS, r = i >> 2, c = i & 3;
        const bool ok = n0 + r < a.n_out;
        const uint8_t *src = a.w + (ok ? (n0 + r) * a.row_bytes + 2 * k0 + 16 * c : 0);
        cp_async16(st + r * H_PITCH + 8 * c, src, ok);
    }
#pragma unroll
    for (int it = 0; it < 2 * H_BN * 4 / H_THREADS; it++) {
        const int i = t + it * H_THREADS, r = i >> 2, c = i & 3; /* r: token (r & 63), part (r >> 6) */
        const int tok = r & (H_BN - 1), part = r >> 6;
        const bool ok = m0 + tok < a.n_tok;
        const uint16_t *src = a.xs + (ok ? (m0 + tok) * 2 * a.n_in + part * a.n_in + k0 + 8 * c : 0);
        cp_async16(st + H_WSTAGE + r * H_PITCH + 8 * c, src, ok);
    }
}

static_assert(2 * H_BN == 128 && H_BN == 64, "hgemm_load's token / part split");

__global__ void __launch_bounds__(H_THREADS) hgemm_kernel(hgemm_args a) {
    __shared__ __align__(16) uint16_t smem[H_STAGES * H_STAGE];
    cuda_grid_wait();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    const int64_t n0 = (int64_t)blockIdx.x * H_BM, m0 = (int64_t)blockIdx.y * H_BN;
    /* this block's K = 32 stages [s0, s0 + n_stages): all of K, or its split's share */
    const int64_t all = a.n_in / H_BK, s0 = all * blockIdx.z / gridDim.z;
    const int64_t n_stages = all * (blockIdx.z + 1) / gridDim.z - s0;
    /* ldmatrix row addresses of this lane: A rows (lane & 15) at k (lane >> 4) * 8; B tokens
     * ((lane >> 4) << 3) + (lane & 7) at k ((lane >> 3) & 1) * 8 */
    const int a_row = lane & 15, a_k = (lane >> 4) * 8;
    const int b_tok = ((lane >> 4) << 3) + (lane & 7), b_k = ((lane >> 3) & 1) * 8;
    const unsigned base = cuda_smem_addr(smem);

    float acc[2][4][4];
    zero_tile(acc);

#pragma unroll
    for (int s = 0; s < H_STAGES - 1; s++) {
        if (s < n_stages) hgemm_load(a, smem + s * H_STAGE, n0, m0, (s0 + s) * H_BK);
        cp_async_commit();
    }
    for (int64_t st = 0; st < n_stages; st++) {
        cp_async_wait<H_STAGES - 2>();
        __syncthreads(); /* stage st is in; the buffer of st - 1 is free */
        if (st + H_STAGES - 1 < n_stages)
            hgemm_load(a, smem + ((st + H_STAGES - 1) % H_STAGES) * H_STAGE, n0, m0, (s0 + st + H_STAGES - 1) * H_BK);
        cp_async_commit();
        const unsigned sw = base + 2u * (unsigned)((st % H_STAGES) * H_STAGE), sx = sw + 2u * H_WSTAGE;
        float c[2][4][4];
        zero_tile(c);
#pragma unroll
        for (int kk = 0; kk < H_BK; kk += 16) {
            uint32_t af[2][4], bh[2][4], bl[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++)
                cuda_ldsm_x4(af[i], sw + 2u * (unsigned)((wm + 16 * i + a_row) * H_PITCH + kk + a_k));
#pragma unroll
            for (int jj = 0; jj < 2; jj++) { /* two 8-token tiles per ldmatrix */
                const int tok = wn + 16 * jj + b_tok;
                cuda_ldsm_x4(bh[jj], sx + 2u * (unsigned)(tok * H_PITCH + kk + b_k));
                cuda_ldsm_x4(bl[jj], sx + 2u * (unsigned)((H_BN + tok) * H_PITCH + kk + b_k));
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    cuda_mma_f16(c[i][j], af[i], bh[j >> 1][2 * (j & 1)], bh[j >> 1][2 * (j & 1) + 1]);
                    cuda_mma_f16(c[i][j], af[i], bl[j >> 1][2 * (j & 1)], bl[j >> 1][2 * (j & 1) + 1]);
                }
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int k = 0; k < 4; k++) acc[i][j][k] = __fadd_rn(acc[i][j][k], c[i][j][k]);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int j = 0; j < 4; j++) {
#pragma unroll
        for (int k2 = 0; k2 < 2; k2++) {
            const int64_t m = m0 + wn + 8 * j + 2 * tq + k2;
            if (m >= a.n_tok) continue;
            const float us = a.unscale[m];
#pragma unroll
            for (int i = 0; i < 2; i++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int64_t n = n0 + wm + 16 * i + g + 8 * h;
                    if (n >= a.n_out) continue;
                    if (a.part) a.part[((int64_t)blockIdx.z * a.n_tok + m) * a.n_out + n] = acc[i][j][2 * h + k2];
                    else a.out[m * a.out_stride + n] = __fmul_rn(acc[i][j][2 * h + k2], us);
                }
            }
        }
    }
}

bool cuda_gemm_f16_fits(uint32_t type, int64_t n_in, int64_t row_bytes, int64_t n_tok) {
    return type == DS4_TYPE_F16 && n_tok >= CUDA_GEMM_MIN_TOKENS && n_in > 0 && n_in % H_BK == 0 &&
           row_bytes % 16 == 0 && row_bytes >= 2 * n_in;
}

size_t cuda_gemm_f16_scratch(int64_t n_in, int64_t n_tok) {
    return (size_t)n_tok * (size_t)n_in * 4u + (size_t)n_tok * sizeof(float);
}

bool cuda_gemm_f16(ds4_backend *be, const void *w, int64_t row_bytes, int64_t n_in, int64_t n_out, const float *x,
                   int64_t x_stride, int64_t n_tok, float *out, int64_t out_stride, void *scratch) {
    if (n_tok > INT32_MAX) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "gemm: %lld tokens is too many", (long long)n_tok);
        return false;
    }
    hgemm_args a;
    a.w = (const uint8_t *)w;
    a.row_bytes = row_bytes;
    a.n_out = n_out;
    a.xs = (const uint16_t *)scratch;
    a.unscale = (const float *)((const uint8_t *)scratch + (size_t)n_tok * (size_t)n_in * 4u);
    a.n_tok = n_tok;
    a.n_in = n_in;
    a.out = out;
    a.out_stride = out_stride;
    a.part = NULL;
    dim3 grid;
    if (!gemm_grid(be, n_out, n_tok, H_BM, H_BN, &grid)) return false;
    grid.z = (unsigned)gemm_splits(be, (int64_t)grid.x * grid.y, n_in / H_BK, 4);
    if (grid.z > 1 && !(a.part = gemm_parts(be, (int)grid.z, 1, n_tok, n_out))) return false;
    return cuda_launch(be, "split_f16_kernel", split_f16_kernel, (unsigned)n_tok, 256, 0, x, x_stride, n_in,
                       (uint16_t *)scratch, (float *)a.unscale) &&
           cuda_launch(be, "hgemm_kernel", hgemm_kernel, grid, H_THREADS, 0, a) &&
           (grid.z == 1 || gemm_reduce(be, a.part, (int)grid.z, 1, n_tok, n_out, a.unscale, out, out_stride));
}

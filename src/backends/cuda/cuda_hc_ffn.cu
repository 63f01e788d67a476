/*
 * cuda_hc_ffn.cu - hyper-connections (spec 3.2, 3.3, 3.8) and the small
 * feed-forward ops: router and SwiGLU (spec 3.7). The GPU twins of
 * cpu_hc_ffn.c, with the same contracts (backend.h) and validation.
 *
 * Numerics. Where the CPU fixes an order of float operations on a few values
 * (the sigmoid/softmax/Sinkhorn split, the weighted stream sums, HC post, the
 * router weights) the kernels repeat that order with __fadd_rn / __fmul_rn /
 * __fdiv_rn, which nvcc never contracts into an FMA (the build uses
 * --fmad=true): given the same inputs they give the CPU's results up to the
 * last-ulp differences of CUDA's expf / log1pf against the C library's. HC
 * post uses no library function and is bit-identical to the CPU. The long
 * reductions differ only in summation order: the RMS of the flattened state
 * is summed in double as on the CPU; the HC mix dot products (fn . f, 16384
 * terms at real size) are float sums, as on the CPU (DS4's F16-weight
 * numerics), reduced as a tree rather than the CPU's 8 sequential lanes,
 * each thread's eight terms as fused multiply-adds.
 *
 * Layout. hc_pre / hc_head: a partial kernel spreads each row's state over
 * blocks of 1024 values and four mix rows each (squares and mix dots per
 * block), then up to 32 blocks per row combine them, one warp does the
 * small sigmoid/Sinkhorn math (one thread for hc_head and for more than 5
 * streams), and each block writes its slice of the weighted sum of the
 * streams. hc_post and swiglu are elementwise,
 * grid-stride. The router is one block for one token: it needs the whole
 * logit vector for its top-k; it writes the selection and the weights
 * straight into the caller's device buffers (nothing waits for them).
 */
#include <stdint.h>
#include <string.h>

#include <cuda_runtime.h>

#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/cuda_hc_comb.cuh"
#include "backends/cuda/cuda_rows.cuh"

/* ------------------------------------------------------------------------ */
/* Shared pieces                                                             */
/* ------------------------------------------------------------------------ */

#define HC_THREADS 256               /* threads per row block (8 warps) */
#define HC_MAX_STREAMS 16            /* n_hc limit, as the CPU's */
#define HC_MAX_MIX ((2 + HC_MAX_STREAMS) * HC_MAX_STREAMS)
#define EW_THREADS 256               /* elementwise kernels */
#define EW_MAX_BLOCKS 65536          /* grid cap; the kernels stride over the rest */
#define ROUTER_THREADS 256

static_assert(HC_THREADS % 32 == 0 && HC_THREADS <= 1024, "whole warps");

/* Blocks for n elements at EW_THREADS each, capped (the kernels stride). */
static unsigned ew_blocks(int64_t n) {
    const int64_t b = (n + EW_THREADS - 1) / EW_THREADS;
    return (unsigned)(b < EW_MAX_BLOCKS ? b : EW_MAX_BLOCKS);
}

static bool ranges_overlap(const float *a, int64_t na, const float *b, int64_t nb) {
    return a < b + nb && b < a + na;
}

/* Sum of a double over the block (every thread gets the result). `red` has
 * HC_THREADS / 32 entries. Fixed shape, so the result is deterministic. */
static __device__ double block_sum_double(double v, double *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads(); /* red may still be read from a previous call */
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < HC_THREADS / 32; w++) s += red[w];
    return s;
}

/* ------------------------------------------------------------------------ */
/* HC pre and head: norm, mix, split, weighted sum (spec 3.2, 3.8)           */
/* ------------------------------------------------------------------------ */

/* Per-row kernel arguments (device pointers; fn/scale/base are weights). */
struct hc_args {
    const float *X;
    const void *fn;
    uint32_t fn_type;
    int64_t fn_row_bytes;
    const void *scale;
    uint32_t scale_type;
    const void *base;
    uint32_t base_type;
    int n_hc;
    int64_t dim;
    int iters;
    int defer; /* hc_pre: comb gets the logits, the Sinkhorn is left to a cuda_comb_task */
    float eps, norm_eps;
    float *out;  /* x_out [n_rows, dim] */
    float *post; /* hc_pre only: [n_rows, n_hc] */
    float *comb; /* hc_pre only: [n_rows, n_hc * n_hc] */
};

/* The CPU's hc_split for one row, on thread 0: pre[s], post[s] and the
 * Sinkhorn-normalised comb C[r * n + c] (r source, c destination), in the
 * CPU's operation order (see cpu_hc_ffn.c). */
static __device__ void hc_split_one(const hc_args &a, const float *mix, float *pre, float *post, float *C) {
    const int n = a.n_hc;
    const float eps = a.eps;
    const float sc0 = cuda_load_float(a.scale, a.scale_type, 0);
    const float sc1 = cuda_load_float(a.scale, a.scale_type, 1);
    const float sc2 = cuda_load_float(a.scale, a.scale_type, 2);
    for (int s = 0; s < n; s++) {
        const float b0 = cuda_load_float(a.base, a.base_type, s);
        const float b1 = cuda_load_float(a.base, a.base_type, n + s);
        pre[s] = __fadd_rn(cuda_sigmoid(__fadd_rn(__fmul_rn(mix[s], sc0), b0)), eps);
        post[s] = __fmul_rn(2.0f, cuda_sigmoid(__fadd_rn(__fmul_rn(mix[n + s], sc1), b1)));
    }
    for (int r = 0; r < n; r++) {
        float m = -INFINITY;
        for (int c = 0; c < n; c++) {
            const int k = 2 * n + r * n + c;
            C[r * n + c] = __fadd_rn(__fmul_rn(mix[k], sc2), cuda_load_float(a.base, a.base_type, k));
            if (C[r * n + c] > m) m = C[r * n + c];
        }
        float sum = 0.0f;
        for (int c = 0; c < n; c++) {
            C[r * n + c] = cuda_expf(__fsub_rn(C[r * n + c], m));
            sum = __fadd_rn(sum, C[r * n + c]);
        }
        const float inv = __frcp_rn(sum);
        for (int c = 0; c < n; c++) C[r * n + c] = __fadd_rn(__fmul_rn(C[r * n + c], inv), eps);
    }
    for (int iter = 0; iter < a.iters; iter++) {
        if (iter > 0) {
            for (int r = 0; r < n; r++) {
                float sum = 0.0f;
                for (int c = 0; c < n; c++) sum = __fadd_rn(sum, C[r * n + c]);
                const float inv = __frcp_rn(__fadd_rn(sum, eps));
                for (int c = 0; c < n; c++) C[r * n + c] = __fmul_rn(C[r * n + c], inv);
            }
        }
        for (int c = 0; c < n; c++) {
            float sum = 0.0f;
            for (int r = 0; r < n; r++) sum = __fadd_rn(sum, C[r * n + c]);
            const float inv = __frcp_rn(__fadd_rn(sum, eps));
            for (int r = 0; r < n; r++) C[r * n + c] = __fmul_rn(C[r * n + c], inv);
        }
    }
}

/* The split's constants a lane of hc_split_warp uses (scale and base are
 * weights: the finishing kernel loads them before it waits for the kernel
 * before, off the Sinkhorn's critical path). */
struct hc_split_consts {
    float sc0, sc1, sc2; /* scale[0..2] */
    float b0, b1;        /* base[lane], base[n + lane] (lane < n) */
    float bc;            /* base[2n + lane] (lane < n * n) */
};

static __device__ __forceinline__ hc_split_consts hc_split_load(const hc_args &a, int n) {
    const int lane = threadIdx.x & 31;
    hc_split_consts k = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
    if (lane < n * n) {
        k.sc0 = cuda_load_float(a.scale, a.scale_type, 0);
        k.sc1 = cuda_load_float(a.scale, a.scale_type, 1);
        k.sc2 = cuda_load_float(a.scale, a.scale_type, 2);
        k.bc = cuda_load_float(a.base, a.base_type, 2 * n + lane);
    }
    if (lane < n) {
        k.b0 = cuda_load_float(a.base, a.base_type, lane);
        k.b1 = cuda_load_float(a.base, a.base_type, n + lane);
    }
    return k;
}

/* hc_split_one spread over one warp (n * n <= 32): lane L holds C[L] (row
 * L / n, column L % n); every row or column sum gathers its n values by
 * shuffles and adds them in the CPU's order, so each lane computes exactly
 * the CPU's sums and quotients (bit-identical to hc_split_one), while the
 * 20 Sinkhorn rounds no longer run on one thread (hc_comb_rounds). With
 * a.defer C gets the comb logits instead, the rounds' input, and a
 * cuda_comb_task runs them later. All 32 lanes call it. */
template <int NT>
static __device__ __forceinline__ void hc_split_warp(const hc_args &a, const hc_split_consts k, const float *mix,
                                                     float *pre, float *post, float *C) {
    /* NT > 0: the stream count known when compiling (the model's 4); 0: a.n_hc */
    const int n = NT > 0 ? NT : a.n_hc, lane = threadIdx.x & 31;
    const float eps = a.eps;
    const bool mine = lane < n * n;
    if (lane < n) {
        pre[lane] = __fadd_rn(cuda_sigmoid(__fadd_rn(__fmul_rn(mix[lane], k.sc0), k.b0)), eps);
        post[lane] = __fmul_rn(2.0f, cuda_sigmoid(__fadd_rn(__fmul_rn(mix[n + lane], k.sc1), k.b1)));
    }
    float v = 0.0f;
    if (mine) v = __fadd_rn(__fmul_rn(mix[2 * n + lane], k.sc2), k.bc);
    if (!a.defer) v = hc_comb_rounds<NT>(v, n, eps, a.iters); /* (a.defer: the logits, cuda_comb_task's input) */
    if (mine) C[lane] = v;
}

/* Two kernels per call, so that one token's 16384-wide state is spread over
 * many blocks (a single block per row left the GPU idle in decode). */
#define HC_PART_THREADS 128 /* threads per partial block */
#define HC_PER_THREAD 8     /* consecutive state values per partial thread */
#define HC_CHUNK (HC_PART_THREADS * HC_PER_THREAD) /* values of the flattened state per partial block */
#define HC_PART_K 4         /* mix rows per partial block */
#define HC_ALL_MIN_BLOCKS 1024 /* (rows x chunks) from which a partial block takes all the mix rows */
/* partial blocks a row of hc_dim state values takes */
static int64_t hc_chunks(int64_t hc_dim) { return (hc_dim + HC_CHUNK - 1) / HC_CHUNK; }
#define HC_FINISH_SLICES 32 /* finishing blocks per row, at most */
#define HC_FINISH_BATCH 4   /* mix entries per warp whose partial loads are in flight together */

struct hc_part {
    double ss;
    float dot[HC_MAX_MIX];
};

/* The eight values i .. i + 7 of a float-typed row as floats (16-byte
 * loads; the caller checks alignment). */
template <uint32_t T> static __device__ __forceinline__ void hc_load8(const void *row, int64_t i, float (&v)[8]) {
    if constexpr (T == DS4_TYPE_F32) {
        const float4 a = ((const float4 *)row)[i / 4], b = ((const float4 *)row)[i / 4 + 1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
        cuda_half8_to_f32<T, true>(__ldg((const uint4 *)row + i / 8), v); /* (fn is only multiplied) */
    }
}

/* hc_post's element (d, i) of one row: X_out = y'[i] * post[d] + sum_s
 * comb[s * n + d] * X[s][i] with y' = y + y2 (y2 NULL: y), in the CPU's
 * order and roundings (add, then hc_post: bit-identical to the CPU). y, y2,
 * X, post and comb point at the row. */
static __device__ __forceinline__ float hc_post_value(const float *y, const float *y2, const float *X,
                                                      const float *post, const float *comb, int n, int64_t dim,
                                                      int d, int64_t i) {
    const float yv = y2 ? __fadd_rn(y[i], y2[i]) : y[i];
    float acc = __fmul_rn(yv, post[d]);
    for (int s = 0; s < n; s++) acc = __fadd_rn(acc, __fmul_rn(comb[s * n + d], X[s * dim + i]));
    return acc;
}

/* hc_post_pre_norm: the residual step that hc_partial_kernel<.., POST>
 * makes on the fly (its state X_out is then the kernel's a.X, which mix
 * group 0 writes). */
struct hc_post_args {
    const float *y, *y2; /* [n_rows, dim]; y2 NULL: none */
    const float *X;      /* the state before, [n_rows, n_hc * dim] */
    const float *post;   /* [n_rows, n_hc] */
    const float *comb;   /* [n_rows, n_hc * n_hc] */
};

/*
 * hc_partial_kernel, block (row r, chunk c, mix group g): HC_PART_THREADS
 * threads of HC_PER_THREAD consecutive values each (a block covers HC_CHUNK
 * values of X[r]) against mix rows k = HC_PART_K g .. HC_PART_K g + 3:
 *   part[r][c].dot[k] = raw dot fn[k] . X[r] over the chunk (float)
 *   part[r][c].ss     = the chunk's sum of squares (double; group 0 only)
 * A thread's few loads are all in flight at once (16-byte loads when the
 * rows allow, VEC) and there are many short warps: the pass costs about one
 * memory latency. POST: X[r] is not read but made from pa, the residual
 * step before it (hc_post_value; the blocks of group 0 write it to a.X),
 * so hc_post and the partial pass are one kernel.
 * ALL (many rows: a prefill's): the block takes every mix group in turn,
 * so X[r] is read (with POST: made) once instead of once per group; each
 * dot is formed exactly as in a block of its group (the same values).
 */
/* mix rows k0 .. k0 + HC_PART_K - 1 of fn at this thread's values i0 .. (0 past n_mix or the state) */
template <uint32_t T, bool VEC>
static __device__ __forceinline__ void hc_mix_rows(const hc_args &a, int n_mix, int k0, int64_t i0, int64_t hc_dim,
                                                   float (&f)[HC_PART_K][HC_PER_THREAD]) {
    if (VEC) {
#pragma unroll
        for (int k = 0; k < HC_PART_K; k++)
            if (i0 < hc_dim && k0 + k < n_mix)
                hc_load8<T>((const uint8_t *)a.fn + (int64_t)(k0 + k) * a.fn_row_bytes, i0, f[k]);
    } else {
#pragma unroll
        for (int k = 0; k < HC_PART_K; k++)
#pragma unroll
            for (int j = 0; j < HC_PER_THREAD; j++)
                f[k][j] = k0 + k < n_mix && i0 + j < hc_dim
                              ? cuda_load_float((const uint8_t *)a.fn + (int64_t)(k0 + k) * a.fn_row_bytes, T, i0 + j)
                              : 0.0f;
    }
}

/* The eight state values i0 .. i0 + 7 of row `row` (zeros past the state):
 * read from a.X, or with POST made from the residual step pa (and, with
 * write, stored to a.X). */
template <bool VEC, bool POST>
static __device__ __forceinline__ void hc_state8(const hc_args &a, const hc_post_args &pa, int64_t row, int64_t i0,
                                                 bool write, float (&x)[HC_PER_THREAD]) {
    const int64_t hc_dim = (int64_t)a.n_hc * a.dim;
    const bool in = i0 < hc_dim;
    const float *X = a.X + row * hc_dim;
    if (POST) {
        const int n = a.n_hc;
        const int64_t dim = a.dim;
        const float *y = pa.y + row * dim, *y2 = pa.y2 ? pa.y2 + row * dim : NULL;
        const float *Xp = pa.X + row * hc_dim, *post = pa.post + row * n, *comb = pa.comb + row * n * n;
        int d = (int)(i0 / dim);
        int64_t i = i0 - (int64_t)d * dim;
        if (VEC) { /* the eight values lie in stream d: 16-byte loads, the same operations */
            float yv[HC_PER_THREAD], t[HC_PER_THREAD];
            if (in) {
                hc_load8<DS4_TYPE_F32>(y, i, yv);
                if (y2) {
                    hc_load8<DS4_TYPE_F32>(y2, i, t);
#pragma unroll
                    for (int j = 0; j < HC_PER_THREAD; j++) yv[j] = __fadd_rn(yv[j], t[j]);
                }
                const float pd = post[d];
#pragma unroll
                for (int j = 0; j < HC_PER_THREAD; j++) x[j] = __fmul_rn(yv[j], pd);
                for (int st = 0; st < n; st++) {
                    hc_load8<DS4_TYPE_F32>(Xp + st * dim, i, t);
                    const float c = comb[st * n + d];
#pragma unroll
                    for (int j = 0; j < HC_PER_THREAD; j++) x[j] = __fadd_rn(x[j], __fmul_rn(c, t[j]));
                }
            } else {
#pragma unroll
                for (int j = 0; j < HC_PER_THREAD; j++) x[j] = 0.0f;
            }
        } else {
#pragma unroll
            for (int j = 0; j < HC_PER_THREAD; j++) {
                x[j] = i0 + j < hc_dim ? hc_post_value(y, y2, Xp, post, comb, n, dim, d, i) : 0.0f;
                if (++i == dim) i = 0, d++;
            }
        }
        if (write) {
            float *Xo = (float *)X;
            if (VEC && in) {
                *(float4 *)(Xo + i0) = make_float4(x[0], x[1], x[2], x[3]);
                *(float4 *)(Xo + i0 + 4) = make_float4(x[4], x[5], x[6], x[7]);
            } else {
#pragma unroll
                for (int j = 0; j < HC_PER_THREAD; j++)
                    if (i0 + j < hc_dim) Xo[i0 + j] = x[j];
            }
        }
    } else if (VEC) {
        if (in) hc_load8<DS4_TYPE_F32>(X, i0, x);
    } else {
#pragma unroll
        for (int j = 0; j < HC_PER_THREAD; j++) x[j] = i0 + j < hc_dim ? X[i0 + j] : 0.0f;
    }
    if (!POST && VEC && !in) {
#pragma unroll
        for (int j = 0; j < HC_PER_THREAD; j++) x[j] = 0.0f;
    }
}

template <uint32_t T, bool VEC, bool POST, bool ALL>
static __global__ void __launch_bounds__(HC_PART_THREADS)
    hc_partial_kernel(hc_args a, int n_mix, hc_part *part, hc_post_args pa) {
    constexpr int NK = ALL ? HC_MAX_MIX : HC_PART_K; /* dots a block keeps */
    __shared__ double red_d[HC_PART_THREADS / 32];
    __shared__ float red_f[HC_PART_THREADS / 32][NK];
    const int64_t hc_dim = (int64_t)a.n_hc * a.dim;
    const int64_t row = blockIdx.x, chunk = blockIdx.y, n_chunks = gridDim.y;
    const int k0 = ALL ? 0 : (int)blockIdx.z * HC_PART_K;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t i0 = chunk * HC_CHUNK + (int64_t)threadIdx.x * HC_PER_THREAD;
    const bool in = i0 < hc_dim;
    float x[HC_PER_THREAD], f[HC_PART_K][HC_PER_THREAD];
    /* the mix weights first: constant during a step, so their loads are in
     * flight before the wait for the kernel before (which wrote X) */
    hc_mix_rows<T, VEC>(a, n_mix, k0, i0, hc_dim, f);
    cuda_grid_wait();
    hc_state8<VEC, POST>(a, pa, row, i0, blockIdx.z == 0, x);
    for (int g0 = k0; g0 < (ALL ? n_mix : k0 + 1); g0 += HC_PART_K) {
        if (ALL && g0 > k0) hc_mix_rows<T, VEC>(a, n_mix, g0, i0, hc_dim, f);
        float d[HC_PART_K];
#pragma unroll
        for (int k = 0; k < HC_PART_K; k++) {
            d[k] = 0.0f;
            if (!VEC || (in && g0 + k < n_mix))
#pragma unroll
                for (int j = 0; j < HC_PER_THREAD; j++) d[k] = fmaf(f[k][j], x[j], d[k]);
        }
        const float sum = cuda_warp_split<HC_PART_K>(d, cuda_add_op()); /* mix row g0 + lane / (32 / HC_PART_K)'s */
        const int kk = g0 - k0 + lane / (32 / HC_PART_K);
        if (lane % (32 / HC_PART_K) == 0 && kk < NK) red_f[warp][kk] = sum;
    }
    if (blockIdx.z == 0) {
        double sq = 0.0;
#pragma unroll
        for (int j = 0; j < HC_PER_THREAD; j++) sq += (double)x[j] * (double)x[j];
        for (int o = 16; o > 0; o >>= 1) sq += __shfl_down_sync(0xffffffffu, sq, o);
        if (lane == 0) red_d[warp] = sq;
    }
    __syncthreads();
    hc_part *out = part + row * n_chunks + chunk;
    for (int k = threadIdx.x; k < NK && k0 + k < n_mix; k += HC_PART_THREADS) {
        float t = 0.0f;
        for (int wi = 0; wi < HC_PART_THREADS / 32; wi++) t += red_f[wi][k];
        out->dot[k0 + k] = t;
    }
    if (blockIdx.z == 0 && threadIdx.x == 0) {
        double ss = 0.0;
        for (int wi = 0; wi < HC_PART_THREADS / 32; wi++) ss += red_d[wi];
        out->ss = ss;
    }
}

/*
 * hc_partial_rows_kernel: hc_partial_kernel<T, true, POST, true> for
 * HC_ROWS rows a block (block (chunk, row group)). A prefill's rows each
 * read the whole fn (16384 x 24 F16 values, 786 KB at real size) from the
 * L2 in the one-row kernel, 1.6 GB for 2,048 rows; here each 4-row piece of
 * fn is loaded once for HC_ROWS rows. Every dot and square sum of a
 * (row, chunk) is formed by the same thread mapping, FMA chains, shuffle
 * trees and in-order warp sums as in the one-row kernel: the same bits.
 */
#define HC_ROWS 8

template <uint32_t T, bool POST>
static __global__ void __launch_bounds__(HC_PART_THREADS)
    hc_partial_rows_kernel(hc_args a, int n_mix, int64_t n_rows, hc_part *part, hc_post_args pa) {
    __shared__ double red_d[HC_ROWS][HC_PART_THREADS / 32];
    __shared__ float red_f[HC_ROWS][HC_PART_THREADS / 32][HC_MAX_MIX];
    const int64_t hc_dim = (int64_t)a.n_hc * a.dim;
    /* (chunks fastest: the blocks of one row group's chunks run together, so
     * hc_post's state before, read by the chunks of all four streams at one
     * position, is still in the L2 when the next stream's chunk reads it) */
    const int64_t row0 = (int64_t)blockIdx.y * HC_ROWS, chunk = blockIdx.x, n_chunks = gridDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t i0 = chunk * HC_CHUNK + (int64_t)threadIdx.x * HC_PER_THREAD;
    const bool in = i0 < hc_dim;
    const int rows = n_rows - row0 < HC_ROWS ? (int)(n_rows - row0) : HC_ROWS;
    float x[HC_ROWS][HC_PER_THREAD], f[HC_PART_K][HC_PER_THREAD];
    hc_mix_rows<T, true>(a, n_mix, 0, i0, hc_dim, f);
    cuda_grid_wait();
#pragma unroll
    for (int r = 0; r < HC_ROWS; r++) {
        if (r < rows) {
            hc_state8<true, POST>(a, pa, row0 + r, i0, true, x[r]);
        } else {
#pragma unroll
            for (int j = 0; j < HC_PER_THREAD; j++) x[r][j] = 0.0f;
        }
    }
    for (int g0 = 0; g0 < n_mix; g0 += HC_PART_K) {
        if (g0 > 0) hc_mix_rows<T, true>(a, n_mix, g0, i0, hc_dim, f);
#pragma unroll
        for (int r = 0; r < HC_ROWS; r++) {
            float d[HC_PART_K];
#pragma unroll
            for (int k = 0; k < HC_PART_K; k++) {
                d[k] = 0.0f;
                if (in && g0 + k < n_mix)
#pragma unroll
                    for (int j = 0; j < HC_PER_THREAD; j++) d[k] = fmaf(f[k][j], x[r][j], d[k]);
            }
            const float sum = cuda_warp_split<HC_PART_K>(d, cuda_add_op()); /* mix row g0 + lane / (32 / HC_PART_K)'s */
            const int k = g0 + lane / (32 / HC_PART_K);
            if (lane % (32 / HC_PART_K) == 0 && k < n_mix && k < HC_MAX_MIX) red_f[r][warp][k] = sum;
        }
    }
    {
        double sq[HC_ROWS];
#pragma unroll
        for (int r = 0; r < HC_ROWS; r++) {
            sq[r] = 0.0;
#pragma unroll
            for (int j = 0; j < HC_PER_THREAD; j++) sq[r] += (double)x[r][j] * (double)x[r][j];
        }
        const double ss = cuda_warp_split<HC_ROWS>(sq, cuda_add_op()); /* row lane / (32 / HC_ROWS)'s */
        if (lane % (32 / HC_ROWS) == 0) red_d[lane / (32 / HC_ROWS)][warp] = ss;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rows * n_mix; e += HC_PART_THREADS) {
        const int r = e / n_mix, k = e - r * n_mix;
        float t = 0.0f;
        for (int wi = 0; wi < HC_PART_THREADS / 32; wi++) t += red_f[r][wi][k];
        part[(row0 + r) * n_chunks + chunk].dot[k] = t;
    }
    if (threadIdx.x < rows) {
        double ss = 0.0;
        for (int wi = 0; wi < HC_PART_THREADS / 32; wi++) ss += red_d[threadIdx.x][wi];
        part[(row0 + threadIdx.x) * n_chunks + chunk].ss = ss;
    }
}

/*
 * The finishing kernels' common part, for row `row` of the block (all
 * threads call it): the chunks' partial sums into the mix, then the split.
 *   ss = sum over chunks (double, in a fixed order over the block's threads)
 *   f-scale = 1 / sqrt(ss / n + norm_eps)          (formed as the CPU does)
 *   mix[k] = (sum over chunks of the raw dots, one warp each) * f-scale
 *   HEAD:  w[s] = sigmoid(mix[s] * scale0 + base[s]) + eps
 *   PRE:   pre/post/comb = hc_split(mix); w = pre
 * The CPU scales each element before its dot product; scaling the finished
 * dots instead differs by float rounding only (well inside the tolerance of
 * a 16384-term float sum in another order). On return (after a barrier) w,
 * post_s and C are in shared memory; block y 0 of a PRE row has written
 * the row's post and comb.
 */
template <bool HEAD>
static __device__ __forceinline__ void hc_finish_split(const hc_args &a, int n_mix, int64_t n_chunks, int64_t row,
                                                       const hc_part *part, const hc_split_consts &consts,
                                                       float *mix, float *w, float *post_s, float *C,
                                                       double *red_d) {
    const int n = a.n_hc;
    const int64_t hc_dim = (int64_t)n * a.dim;
    const hc_part *pr = part + row * n_chunks;
    /* the chunks' partial sums, spread over the block (a fixed shape, so the
     * order is the same every run), all loads in flight together: squares
     * in double over all threads; each mix entry over one warp's lanes,
     * HC_FINISH_BATCH entries at once, kept unscaled until the squares are
     * summed */
    double ss_part = 0.0;
    for (int64_t c = threadIdx.x; c < n_chunks; c += HC_THREADS) ss_part += pr[c].ss;
    {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        constexpr int NW = HC_THREADS / 32;
        for (int k0 = warp; k0 < n_mix; k0 += NW * HC_FINISH_BATCH) {
            float s[HC_FINISH_BATCH];
#pragma unroll
            for (int b = 0; b < HC_FINISH_BATCH; b++) {
                const int k = k0 + b * NW;
                s[b] = 0.0f;
                if (k < n_mix)
                    for (int64_t c = lane; c < n_chunks; c += 32) s[b] += pr[c].dot[k];
            }
#pragma unroll
            for (int b = 0; b < HC_FINISH_BATCH; b++)
                for (int o = 16; o > 0; o >>= 1) s[b] += __shfl_xor_sync(0xffffffffu, s[b], o);
            if (lane == 0)
#pragma unroll
                for (int b = 0; b < HC_FINISH_BATCH; b++)
                    if (k0 + b * NW < n_mix) mix[k0 + b * NW] = s[b];
        }
    }
    const double ss = block_sum_double(ss_part, red_d); /* every thread has it; its barriers publish mix */
    const float rms_scale = __frcp_rn(__fsqrt_rn(__fadd_rn((float)(ss / (double)hc_dim), a.norm_eps)));
    for (int k = threadIdx.x; k < n_mix; k += HC_THREADS) mix[k] = __fmul_rn(mix[k], rms_scale);
    __syncthreads();
    if (!HEAD && n * n <= 32) {
        if (threadIdx.x < 32) {
            if (n == 4) hc_split_warp<4>(a, consts, mix, w, post_s, C);
            else hc_split_warp<0>(a, consts, mix, w, post_s, C);
        }
    } else if (threadIdx.x == 0) {
        if (HEAD) {
            const float sc0 = cuda_load_float(a.scale, a.scale_type, 0);
            for (int s = 0; s < n; s++)
                w[s] = __fadd_rn(
                    cuda_sigmoid(__fadd_rn(__fmul_rn(mix[s], sc0), cuda_load_float(a.base, a.base_type, s))), a.eps);
        } else {
            hc_split_one(a, mix, w, post_s, C);
        }
    }
    __syncthreads();
    if (!HEAD && blockIdx.y == 0) {
        if (threadIdx.x < n) a.post[row * n + threadIdx.x] = post_s[threadIdx.x];
        for (int j = threadIdx.x; j < n * n; j += HC_THREADS) a.comb[row * n * n + j] = C[j];
    }
}

/* The weighted sum's element: sum_s X[s][i] * w[s], s in order (as the CPU). */
#define HC_PREFETCH 4 /* streams whose state values a thread loads before the split */
static __device__ __forceinline__ float hc_weighted(const float (&xv)[HC_PREFETCH], const float *w, int n) {
    float acc = 0.0f;
#pragma unroll
    for (int s = 0; s < HC_PREFETCH; s++)
        if (s < n) acc = __fadd_rn(acc, __fmul_rn(xv[s], w[s]));
    return acc;
}

/*
 * hc_finish_kernel, blocks (r, slice): each block of row r redoes the
 * (cheap, identical) split (hc_finish_split) and writes its slice of the
 * weighted sum out[r][i] = sum_s X[r][s][i] * w[s], so the sum is spread
 * over the row's blocks instead of looping in one.
 */
template <bool HEAD>
static __global__ void __launch_bounds__(HC_THREADS)
    hc_finish_kernel(hc_args a, int n_mix, int64_t n_chunks, const hc_part *part) {
    __shared__ float mix[HC_MAX_MIX];
    __shared__ float w[HC_MAX_STREAMS];
    __shared__ float C[HC_MAX_STREAMS * HC_MAX_STREAMS];
    __shared__ float post_s[HC_MAX_STREAMS];
    __shared__ double red_d[HC_THREADS / 32];
    const int n = a.n_hc;
    /* the split's constants (weights) before the wait for the kernel before */
    hc_split_consts consts = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
    if (!HEAD && n * n <= 32 && threadIdx.x < 32) consts = hc_split_load(a, n);
    cuda_grid_wait();
    const int64_t row = blockIdx.x;
    const float *X = a.X + row * (int64_t)n * a.dim;
    /* this block's slice of the output; when it is one element per thread
     * and there are at most HC_PREFETCH streams, that element's n state
     * values are loaded now, in flight while the split is made */
    const int64_t per = (a.dim + gridDim.y - 1) / gridDim.y;
    const int64_t i0 = blockIdx.y * per, i1 = i0 + per < a.dim ? i0 + per : a.dim;
    const bool prefetch = per <= HC_THREADS && n <= HC_PREFETCH;
    float xv[HC_PREFETCH];
    if (prefetch) {
        const int64_t i = i0 + threadIdx.x;
#pragma unroll
        for (int s = 0; s < HC_PREFETCH; s++) xv[s] = s < n && i < i1 ? X[s * a.dim + i] : 0.0f;
    }
    hc_finish_split<HEAD>(a, n_mix, n_chunks, row, part, consts, mix, w, post_s, C, red_d);
    float *out = a.out + row * a.dim;
    if (prefetch) {
        const int64_t i = i0 + threadIdx.x;
        if (i < i1) out[i] = hc_weighted(xv, w, n);
        return;
    }
#pragma unroll 4
    for (int64_t i = i0 + threadIdx.x; i < i1; i += HC_THREADS) {
        float acc = 0.0f;
        for (int s = 0; s < n; s++) acc = __fadd_rn(acc, __fmul_rn(X[s * a.dim + i], w[s]));
        out[i] = acc;
    }
}

/*
 * hc_finish_norm_kernel, one block per row (hc_pre_norm): the split as
 * hc_finish_kernel, the whole weighted sum x[r] held in registers where
 * rmsnorm_kernel<true> holds a row (rms_load_row's places: the row's state
 * values are loaded there before the split), x[r] written to out, then its
 * RMS norm with the norm weight nw (NULL: plain) into a_out, summed and
 * rounded as rmsnorm_kernel<true> does: the pair of ops' results bit for
 * bit. Rows of dim % 4 == 0, dim <= NORM_CACHED, 16-byte aligned, at most
 * HC_PREFETCH streams (hc_norm_fits). a_out may be out.
 */
static_assert(HC_THREADS == NORM_THREADS, "the norm's layout is rmsnorm_kernel's");
static __global__ void __launch_bounds__(HC_THREADS)
    hc_finish_norm_kernel(hc_args a, int n_mix, int64_t n_chunks, const hc_part *part, const float *nw,
                          float norm_eps, float *a_out) {
    __shared__ float mix[HC_MAX_MIX];
    __shared__ float w[HC_MAX_STREAMS];
    __shared__ float C[HC_MAX_STREAMS * HC_MAX_STREAMS];
    __shared__ float post_s[HC_MAX_STREAMS];
    __shared__ double red_d[HC_THREADS / 32];
    const int n = a.n_hc;
    hc_split_consts consts = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
    if (n * n <= 32 && threadIdx.x < 32) consts = hc_split_load(a, n);
    float wv[NORM_VEC][4];
    rms_load_weight(nw, a.dim, wv); /* a weight: before the wait */
    cuda_grid_wait();
    const int64_t row = blockIdx.x, dim = a.dim;
    const float *X = a.X + row * (int64_t)n * dim;
    float4 xs[HC_PREFETCH][NORM_VEC];
#pragma unroll
    for (int s = 0; s < HC_PREFETCH; s++) {
        if (s < n) rms_load_row(X + s * dim, dim, xs[s]);
        else
#pragma unroll
            for (int k = 0; k < NORM_VEC; k++) xs[s][k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    hc_finish_split<false>(a, n_mix, n_chunks, row, part, consts, mix, w, post_s, C, red_d);
    float4 v[NORM_VEC];
    float *out = a.out + row * dim;
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) {
        float e[4][HC_PREFETCH];
#pragma unroll
        for (int s = 0; s < HC_PREFETCH; s++)
            e[0][s] = xs[s][k].x, e[1][s] = xs[s][k].y, e[2][s] = xs[s][k].z, e[3][s] = xs[s][k].w;
        v[k] = make_float4(hc_weighted(e[0], w, n), hc_weighted(e[1], w, n), hc_weighted(e[2], w, n),
                           hc_weighted(e[3], w, n));
        const int64_t i = 4 * (threadIdx.x + (int64_t)k * NORM_THREADS);
        if (i < dim) *(float4 *)(out + i) = v[k];
    }
    rms_scale_store(v, wv, nw != NULL, dim, norm_eps, red_d, a_out + row * dim);
}

typedef void (*hc_partial_fn)(hc_args, int, hc_part *, hc_post_args);

/* ------------------------------------------------------------------------ */
/* The Sinkhorn off hc_pre's chain                                           */
/* ------------------------------------------------------------------------ */

/*
 * pre (the weighted sum's weights) and post need only sigmoids; the 20
 * Sinkhorn rounds that make comb are a serial chain of about 6 us on one
 * warp, and comb is read only by the next hc_post (inside the next hc_pre's
 * partial kernel in decode), a sublayer later. So for decode-sized calls
 * the finishing kernel writes the comb logits (hc_args.defer) and leaves a
 * cuda_comb_task: the next weight product on the main chain of at least
 * hc_defer_bytes (q_b or a compressor's in attention, the routed experts'
 * gate/up in the FFN: 10-25 us kernels) runs the rounds in extra blocks
 * beside its own (cuda_hc_take_comb), so that they cost the chain nothing;
 * whatever reads comb first settles a task no product took with
 * hc_comb_kernel. The rounds are hc_comb_rounds either way: comb is the
 * same bit for bit.
 */
#define HC_DEFER_MAX_ROWS 8 /* rows of a deferred split (one warp each): those of the streaming products */
#define HC_DEFER_BYTES (8ll << 20) /* a product that takes it reads at least this many weight bytes */

/* one warp per row of t */
static __global__ void __launch_bounds__(HC_THREADS) hc_comb_kernel(cuda_comb_task t) {
    cuda_grid_wait();
    hc_comb_row(t, (int64_t)blockIdx.x * (HC_THREADS / 32) + (threadIdx.x >> 5));
}

void cuda_hc_settle(ds4_backend *be) {
    cuda_backend *cb = cuda_impl(be);
    if (cb->comb_branch && !cb->br_side) {
        /* the task ran on a side branch: what reads comb on the main chain joins it first */
        cuda_branch_force_join(cb);
        cb->comb_branch = false;
    }
    if (!cb->comb_pending) return;
    cb->comb_pending = false;
    if (cuda_failed(be)) return;
    const cuda_comb_task t = cb->comb;
    const unsigned blocks = (unsigned)((t.n_rows + HC_THREADS / 32 - 1) / (HC_THREADS / 32));
    if (cuda_launch(be, "hc_comb kernel", hc_comb_kernel, blocks, HC_THREADS, 0, t)) cb->comb_settled++;
    if (cb->br_side) cb->comb_branch = true;
}

void cuda_hc_settle_touching(ds4_backend *be, const float *p, int64_t n) {
    const cuda_backend *cb = cuda_impl(be);
    if (!cb->comb_pending || !p || n <= 0) return;
    const int64_t nc = (int64_t)cb->comb.n_rows * cb->comb.n_hc * cb->comb.n_hc;
    if (p < cb->comb.comb + nc && cb->comb.comb < p + n) cuda_hc_settle(be);
}

bool cuda_hc_take_comb(cuda_backend *cb, double weight_bytes, cuda_comb_task *t) {
    if (!cb->comb_pending || cb->br_side || weight_bytes < (double)cb->hc_defer_bytes) return false;
    *t = cb->comb;
    cb->comb_pending = false;
    cb->comb_taken++;
    return true;
}

/* the bound a product's weight bytes must reach: DS4_CUDA_HC_DEFER_BYTES, else HC_DEFER_BYTES */
static int64_t hc_defer_bytes_default(void) {
    return cuda_env_long("DS4_CUDA_HC_DEFER_BYTES", HC_DEFER_BYTES, 1, 1L << 40);
}

extern "C" void ds4_cuda_backend_set_hc_defer(ds4_backend *be, int on, int64_t min_bytes) {
    cuda_backend *cb = cuda_impl(be);
    cuda_hc_settle(be);
    cb->hc_defer = on != 0;
    cb->hc_defer_bytes = min_bytes > 0 ? min_bytes : hc_defer_bytes_default();
}
extern "C" void ds4_cuda_backend_hc_defer_stats(const ds4_backend *be, uint64_t *taken, uint64_t *settled) {
    const cuda_backend *cb = (const cuda_backend *)be->impl;
    if (taken) *taken = cb->comb_taken;
    if (settled) *settled = cb->comb_settled;
}
void cuda_hc_defer_init(cuda_backend *cb) {
    cb->hc_defer = cuda_env_flag("DS4_CUDA_HC_DEFER", true);
    cb->hc_defer_bytes = hc_defer_bytes_default();
}

template <bool VEC, bool POST, bool ALL> static hc_partial_fn hc_partial_typed(uint32_t type) {
    switch (type) {
    case DS4_TYPE_F32: return hc_partial_kernel<DS4_TYPE_F32, VEC, POST, ALL>;
    case DS4_TYPE_F16: return hc_partial_kernel<DS4_TYPE_F16, VEC, POST, ALL>;
    default: return hc_partial_kernel<DS4_TYPE_BF16, VEC, POST, ALL>;
    }
}
template <bool VEC, bool POST> static hc_partial_fn hc_partial_for(uint32_t type, bool all) {
    return all ? hc_partial_typed<VEC, POST, true>(type) : hc_partial_typed<VEC, POST, false>(type);
}
static hc_partial_fn hc_partial_pick(uint32_t type, bool vec, bool post, bool all) {
    if (post) return vec ? hc_partial_for<true, true>(type, all) : hc_partial_for<false, true>(type, all);
    return vec ? hc_partial_for<true, false>(type, all) : hc_partial_for<false, false>(type, all);
}

/* hc_partial_rows_kernel's instance for fn's type, with or without `post` */
typedef void (*hc_rows_fn)(hc_args, int, int64_t, hc_part *, hc_post_args);
template <bool POST> static hc_rows_fn hc_rows_typed(uint32_t type) {
    switch (type) {
    case DS4_TYPE_F32: return hc_partial_rows_kernel<DS4_TYPE_F32, POST>;
    case DS4_TYPE_F16: return hc_partial_rows_kernel<DS4_TYPE_F16, POST>;
    default: return hc_partial_rows_kernel<DS4_TYPE_BF16, POST>;
    }
}

/* Whether the partial pass of n_rows rows of n_chunks chunks takes every mix
 * group in one block (hc_partial_kernel's ALL), and the finishing pass a
 * whole row in one block: with enough blocks to fill the device without
 * the groups' and slices' (a prefill's rows), unless the backend's setting
 * says always or never. */
static bool hc_all_groups(const cuda_backend *cb, int64_t n_rows, int64_t n_chunks, int n_mix) {
    if (n_mix > HC_MAX_MIX || cb->hc_all == 0) return false;
    return cb->hc_all == 2 || n_rows * n_chunks >= HC_ALL_MIN_BLOCKS;
}

/* The norm that hc_finish_norm_kernel appends (hc_pre_norm): its weight
 * as device floats (NULL: plain), eps and output. */
struct hc_norm {
    const float *w;
    float eps;
    float *out;
};

/* Launch the partial and finishing kernels for n_rows rows (with `norm`:
 * the finishing kernel that norms the weighted sum, hc_norm_fits; with
 * `post`: the partial kernel that makes the state a.X from the residual
 * step before it). The partial kernel takes 16-byte loads when every row of
 * X and fn starts 16-byte aligned and a thread's eight values never
 * straddle the end (with `post`: lie in one stream, and y, y2 and the
 * state before are aligned too). */
template <bool HEAD>
static void hc_launch(ds4_backend *be, const hc_args &a, int n_mix, int64_t n_rows, const char *what,
                      const hc_norm *norm = NULL, const hc_post_args *post = NULL) {
    const int64_t hc_dim = (int64_t)a.n_hc * a.dim;
    const int64_t n_chunks = hc_chunks(hc_dim);
    if (n_chunks > 65535) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "%s: a state of %lld values is too wide", what, (long long)hc_dim);
        return;
    }
    hc_part *part = (hc_part *)cuda_scratch(be, CUDA_SCRATCH_HC, (size_t)(n_rows * n_chunks) * sizeof(hc_part));
    if (!part) return;
    const bool vec = hc_dim % HC_PER_THREAD == 0 && a.fn_row_bytes % 16 == 0 && (uintptr_t)a.fn % 16 == 0 &&
                     (uintptr_t)a.X % 16 == 0 &&
                     (!post || (a.dim % HC_PER_THREAD == 0 && (uintptr_t)post->y % 16 == 0 &&
                                (uintptr_t)post->y2 % 16 == 0 && (uintptr_t)post->X % 16 == 0));
    hc_post_args pa;
    memset(&pa, 0, sizeof pa); /* (recorded steps compare argument bytes) */
    if (post) pa = *post;
    const bool all = hc_all_groups(cuda_impl(be), n_rows, n_chunks, n_mix);
    const hc_partial_fn partial = hc_partial_pick(a.fn_type, vec, post != NULL, all);
    const unsigned groups = all ? 1u : (unsigned)((n_mix + HC_PART_K - 1) / HC_PART_K);
    if (all && vec && cuda_impl(be)->wide_rows && n_rows >= HC_ROWS && (n_rows + HC_ROWS - 1) / HC_ROWS <= 65535) {
        const hc_rows_fn fn = post ? hc_rows_typed<true>(a.fn_type) : hc_rows_typed<false>(a.fn_type);
        if (!cuda_launch(be, what, fn, dim3((unsigned)n_chunks, (unsigned)((n_rows + HC_ROWS - 1) / HC_ROWS)),
                         HC_PART_THREADS, 0, a, n_mix, n_rows, part, pa))
            return;
    } else if (!cuda_launch(be, what, partial, dim3((unsigned)n_rows, (unsigned)n_chunks, groups), HC_PART_THREADS, 0,
                            a, n_mix, part, pa)) {
        return;
    }
    /* one output element per thread of the finishing blocks, at most
     * HC_FINISH_SLICES of them per row; with many rows (all) one block a
     * row, which makes the split once instead of once per slice */
    int64_t slices = (a.dim + HC_THREADS - 1) / HC_THREADS;
    if (slices > HC_FINISH_SLICES) slices = HC_FINISH_SLICES;
    if (all) slices = 1;
    if (norm) {
        (void)cuda_launch(be, what, hc_finish_norm_kernel, (unsigned)n_rows, HC_THREADS, 0, a, n_mix, n_chunks, part,
                          norm->w, norm->eps, norm->out);
        return;
    }
    cuda_backend *cb = cuda_impl(be);
    hc_args af = a;
    /* (not on a side branch: a product or settle on the main chain would not wait for its logits) */
    af.defer = !HEAD && cb->hc_defer && !cb->br_side && a.comb && a.n_hc * a.n_hc <= 32 && n_rows <= HC_DEFER_MAX_ROWS;
    if (cuda_launch(be, what, hc_finish_kernel<HEAD>, dim3((unsigned)n_rows, (unsigned)slices), HC_THREADS, 0, af,
                    n_mix, n_chunks, part) &&
        af.defer) {
        cb->comb.comb = a.comb;
        cb->comb.n_hc = a.n_hc;
        cb->comb.iters = a.iters;
        cb->comb.n_rows = (int)n_rows;
        cb->comb.eps = a.eps;
        cb->comb_pending = true;
    }
}

/* true for a float-typed (F32/F16/BF16) weight bound to this device (false for NULL). */
static bool hc_float_weight(const ds4_weight *w) { return w && w->device && cuda_is_float_type(w->type); }

/*
 * The CPU's hc_check: fn [n_hc*dim, >= n_mix rows], scale [>= n_scale],
 * base [>= n_mix], n_hc in 1..16, dim > 0 (DS4_ERR_INVALID, the CPU's
 * message). Then what only this backend lacks: a weight type other than
 * F32/F16/BF16, or a weight that is not bound here (DS4_ERR_UNSUPPORTED).
 */
static bool hc_check(ds4_backend *be, const char *op, const ds4_hc *hc, const ds4_weight *fn,
                     const ds4_weight *scale, const ds4_weight *base, int64_t n_mix, int64_t n_scale) {
    if (!hc || hc->n_hc < 1 || hc->n_hc > HC_MAX_STREAMS || hc->dim <= 0 || !fn || !scale || !base ||
        fn->ne[0] != hc->n_hc * hc->dim || cuda_weight_rows(fn) < n_mix || scale->ne[0] < n_scale ||
        base->ne[0] < n_mix) {
        cuda_fail(be, DS4_ERR_INVALID, "%s: n_hc %d, dim %lld: weights %s / %s / %s do not fit", op,
                  hc ? hc->n_hc : 0, hc ? (long long)hc->dim : 0LL, cuda_wname(fn), cuda_wname(scale),
                  cuda_wname(base));
        return false;
    }
    if (!hc_float_weight(fn) || !hc_float_weight(scale) || !hc_float_weight(base)) {
        const ds4_weight *bad = !hc_float_weight(fn) ? fn : !hc_float_weight(scale) ? scale : base;
        cuda_fail(be, DS4_ERR_UNSUPPORTED,
                  "%s: weight %s (%s%s) cannot be used by the CUDA backend: it needs F32, F16 or BF16 weights bound "
                  "to the device",
                  op, cuda_wname(bad), ds4_type_name(bad->type), bad->device ? "" : ", not bound");
        return false;
    }
    return true;
}

static hc_args hc_args_make(const ds4_hc *hc, const float *X, const ds4_weight *fn, const ds4_weight *scale,
                            const ds4_weight *base, float *out, float *post, float *comb) {
    hc_args a;
    memset(&a, 0, sizeof a); /* padding too: recorded steps compare argument bytes */
    a.X = X;
    a.fn = fn->device;
    a.fn_type = fn->type;
    a.fn_row_bytes = fn->row_bytes;
    a.scale = scale->device;
    a.scale_type = scale->type;
    a.base = base->device;
    a.base_type = base->type;
    a.n_hc = hc->n_hc;
    a.dim = hc->dim;
    a.iters = hc->iters;
    a.eps = hc->eps;
    a.norm_eps = hc->norm_eps;
    a.out = out;
    a.post = post;
    a.comb = comb;
    return a;
}

/* hc_pre's checks (the CPU's); false with the error recorded. n_rows <= 0
 * passes (nothing to do, as on the CPU). */
static bool hc_pre_check(ds4_backend *be, const char *op, const ds4_hc *hc, const float *X, const ds4_weight *fn,
                         const ds4_weight *scale, const ds4_weight *base, const float *x_out, const float *post,
                         const float *comb, int64_t n_rows) {
    const int64_t n_mix = hc ? (int64_t)(2 + hc->n_hc) * hc->n_hc : 0;
    if (!hc_check(be, op, hc, fn, scale, base, n_mix, 3)) return false;
    if (hc->iters < 1) {
        cuda_fail(be, DS4_ERR_INVALID, "%s: %d Sinkhorn iterations", op, hc->iters);
        return false;
    }
    if (n_rows > 0 && (n_rows > INT32_MAX || !X || !x_out || !post || !comb)) {
        cuda_fail(be, DS4_ERR_INVALID, "%s: %lld rows (a NULL buffer or too many rows)", op, (long long)n_rows);
        return false;
    }
    return true;
}

void cuda_hc_pre(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn, const ds4_weight *scale,
                 const ds4_weight *base, float *x_out, float *post, float *comb, int64_t n_rows) {
    cuda_hc_settle(be); /* a deferred Sinkhorn before any HC op (they read or write comb) */
    if (cuda_failed(be)) return;
    if (!hc_pre_check(be, "hc_pre", hc, X, fn, scale, base, x_out, post, comb, n_rows) || n_rows <= 0) return;
    const hc_args a = hc_args_make(hc, X, fn, scale, base, x_out, post, comb);
    hc_launch<false>(be, a, (2 + hc->n_hc) * hc->n_hc, n_rows, "hc_pre kernels");
}

/* States hc_finish_norm_kernel takes: at most HC_PREFETCH streams, rows of
 * dim % 4 == 0 up to NORM_CACHED, X, x_out and a_out 16-byte aligned. */
/* hc_finish_norm_kernel takes a whole row per block, so it pays where
 * the rows alone fill the GPU: below HC_NORM_MIN_ROWS (decode) the
 * finishing kernel's slices and then the rmsnorm kernel are faster (one
 * row: decode 1.027x against the fused kernel, and 1.010x against slices
 * whose last block norms the row; 128 and more rows: prefill 0.987x). */
#define HC_NORM_MIN_ROWS 64
static bool hc_norm_fits(const ds4_hc *hc, const float *X, const float *x_out, const float *a_out, int64_t n_rows) {
    return n_rows >= HC_NORM_MIN_ROWS && hc->n_hc <= HC_PREFETCH && hc->dim % 4 == 0 && hc->dim <= NORM_CACHED && (uintptr_t)X % 16 == 0 &&
           (uintptr_t)x_out % 16 == 0 && (uintptr_t)a_out % 16 == 0;
}

void cuda_hc_pre_norm(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn,
                      const ds4_weight *scale, const ds4_weight *base, const ds4_weight *norm, float eps,
                      float *x_out, float *post, float *comb, float *a_out, int64_t n_rows) {
    cuda_hc_settle(be); /* a deferred Sinkhorn before any HC op (they read or write comb) */
    if (cuda_failed(be)) return;
    if (!hc_pre_check(be, "hc_pre_norm", hc, X, fn, scale, base, x_out, post, comb, n_rows)) return;
    const float *wv;
    if (!cuda_norm_weight_floats(be, norm, hc->dim, "hc_pre_norm", &wv)) return;
    if (n_rows <= 0) return;
    if (!a_out) {
        cuda_fail(be, DS4_ERR_INVALID, "hc_pre_norm: NULL norm output");
        return;
    }
    if (!cuda_impl(be)->hc_norm || !hc_norm_fits(hc, X, x_out, a_out, n_rows)) {
        cuda_hc_pre(be, hc, X, fn, scale, base, x_out, post, comb, n_rows);
        be->ops->rmsnorm(be, x_out, norm, eps, a_out, n_rows, hc->dim);
        return;
    }
    const hc_args a = hc_args_make(hc, X, fn, scale, base, x_out, post, comb);
    const hc_norm nm = { wv, eps, a_out };
    hc_launch<false>(be, a, (2 + hc->n_hc) * hc->n_hc, n_rows, "hc_pre_norm kernels", &nm);
}

void cuda_hc_head(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn, const ds4_weight *scale,
                  const ds4_weight *base, float *out, int64_t n_rows) {
    cuda_hc_settle(be); /* a deferred Sinkhorn before any HC op (they read or write comb) */
    if (cuda_failed(be)) return;
    const int64_t n = hc ? hc->n_hc : 0;
    if (!hc_check(be, "hc_head", hc, fn, scale, base, n, 1)) return;
    if (n_rows <= 0) return;
    if (n_rows > INT32_MAX || !X || !out) {
        cuda_fail(be, DS4_ERR_INVALID, "hc_head: %lld rows (a NULL buffer or too many rows)", (long long)n_rows);
        return;
    }
    const hc_args a = hc_args_make(hc, X, fn, scale, base, out, NULL, NULL);
    hc_launch<true>(be, a, (int)n, n_rows, "hc_head kernels");
}

/* ------------------------------------------------------------------------ */
/* HC post (spec 3.3)                                                        */
/* ------------------------------------------------------------------------ */

/* Element (r, d, i): hc_post_value (y2 NULL: y alone). */
static __global__ void hc_post_kernel(const float *y, const float *y2, const float *X, const float *post,
                                      const float *comb, float *X_out, int n, int64_t dim, int64_t total) {
    cuda_grid_wait();
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = e % dim, rd = e / dim;
        const int d = (int)(rd % n);
        const int64_t r = rd / n;
        X_out[e] = hc_post_value(y + r * dim, y2 ? y2 + r * dim : NULL, X + r * n * dim, post + r * n,
                                 comb + r * n * n, n, dim, d, i);
    }
}

/* hc_post's checks (the CPU's), for op `op`: false with the error
 * recorded; *total = the state values to write (0: nothing to do). */
static bool hc_post_check(ds4_backend *be, const char *op, const ds4_hc *hc, const float *y, const float *X,
                          const float *post, const float *comb, const float *X_out, int64_t n_rows, int64_t *total) {
    *total = 0;
    if (!hc || hc->n_hc < 1 || hc->n_hc > HC_MAX_STREAMS || hc->dim <= 0 || n_rows < 0 ||
        n_rows > INT64_MAX / ((int64_t)hc->n_hc * hc->dim)) {
        cuda_fail(be, DS4_ERR_INVALID, "%s: n_hc %d, dim %lld, %lld rows", op, hc ? hc->n_hc : 0,
                  hc ? (long long)hc->dim : 0LL, (long long)n_rows);
        return false;
    }
    const int64_t t = n_rows * hc->n_hc * hc->dim;
    if (t == 0) return true;
    if (!y || !X || !post || !comb || !X_out || ranges_overlap(X_out, t, X, t)) {
        cuda_fail(be, DS4_ERR_INVALID, "%s: NULL buffer, or X_out overlaps X (it must not alias it)", op);
        return false;
    }
    *total = t;
    return true;
}

static void hc_post_launch(ds4_backend *be, const ds4_hc *hc, const float *y, const float *y2, const float *X,
                           const float *post, const float *comb, float *X_out, int64_t total) {
    (void)cuda_launch(be, "hc_post kernel", hc_post_kernel, ew_blocks(total), EW_THREADS, 0, y, y2, X, post, comb,
                      X_out, hc->n_hc, hc->dim, total);
}

void cuda_hc_post(ds4_backend *be, const ds4_hc *hc, const float *y, const float *X, const float *post,
                  const float *comb, float *X_out, int64_t n_rows) {
    cuda_hc_settle(be); /* a deferred Sinkhorn before any HC op (they read or write comb) */
    if (cuda_failed(be)) return;
    int64_t total;
    if (!hc_post_check(be, "hc_post", hc, y, X, post, comb, X_out, n_rows, &total) || total == 0) return;
    hc_post_launch(be, hc, y, NULL, X, post, comb, X_out, total);
}

/* hc_post (y + y2) and hc_pre_norm of its state: where the backend's
 * setting and the shapes allow, the residual step is made inside hc_pre's
 * partial kernel (two kernels in all instead of three). With a block per
 * mix group each group makes the step again, which pays in decode (one
 * row: 1.005x to 1.009x) but not once the rows fill the GPU (128 rows:
 * prefill 0.988x), so from HC_POST_PRE_MAX_ROWS rows hc_post's kernel runs
 * first, unless the partial blocks take every mix group (hc_all_groups:
 * the step is then made once). */
#define HC_POST_PRE_MAX_ROWS 64
void cuda_hc_post_pre_norm(ds4_backend *be, const ds4_hc *hc, const float *y, const float *y2, const float *X,
                           const float *post, const float *comb, float *X_out, const ds4_weight *fn,
                           const ds4_weight *scale, const ds4_weight *base, const ds4_weight *norm, float eps,
                           float *x_out, float *post_out, float *comb_out, float *a_out, int64_t n_rows) {
    cuda_hc_settle(be); /* a deferred Sinkhorn before any HC op (they read or write comb) */
    if (cuda_failed(be)) return;
    int64_t total;
    if (!hc_post_check(be, "hc_post_pre_norm", hc, y, X, post, comb, X_out, n_rows, &total)) return;
    if (!hc_pre_check(be, "hc_post_pre_norm", hc, X_out, fn, scale, base, x_out, post_out, comb_out, n_rows)) return;
    const float *wv;
    if (!cuda_norm_weight_floats(be, norm, hc->dim, "hc_post_pre_norm", &wv)) return;
    if (total == 0) return;
    if (!a_out) {
        cuda_fail(be, DS4_ERR_INVALID, "hc_post_pre_norm: NULL norm output");
        return;
    }
    const cuda_backend *cb = cuda_impl(be);
    const int64_t n_chunks = hc_chunks((int64_t)hc->n_hc * hc->dim);
    const int n_mix = (2 + hc->n_hc) * hc->n_hc;
    if (!cb->hc_post_pre || (n_rows >= HC_POST_PRE_MAX_ROWS && !hc_all_groups(cb, n_rows, n_chunks, n_mix))) {
        hc_post_launch(be, hc, y, y2, X, post, comb, X_out, total);
        cuda_hc_pre_norm(be, hc, X_out, fn, scale, base, norm, eps, x_out, post_out, comb_out, a_out, n_rows);
        return;
    }
    const hc_args a = hc_args_make(hc, X_out, fn, scale, base, x_out, post_out, comb_out);
    const hc_post_args pa = { y, y2, X, post, comb };
    if (cb->hc_norm && hc_norm_fits(hc, X_out, x_out, a_out, n_rows)) {
        const hc_norm nm = { wv, eps, a_out };
        hc_launch<false>(be, a, n_mix, n_rows, "hc_post_pre_norm kernels", &nm, &pa);
        return;
    }
    hc_launch<false>(be, a, n_mix, n_rows, "hc_post_pre_norm kernels", NULL, &pa);
    be->ops->rmsnorm(be, x_out, norm, eps, a_out, n_rows, hc->dim);
}

/* ------------------------------------------------------------------------ */
/* Router (spec 3.7)                                                         */
/* ------------------------------------------------------------------------ */

static __device__ float router_softplus(float x) {
    if (x > 20.0f) return x;
    if (x < -20.0f) return cuda_expf(x);
    return cuda_log1pf(cuda_expf(x));
}

/*
 * Rank key of expert e with selection score s: higher key = ranks higher.
 * The score's bits map to an unsigned order (NaN ranks as -inf, -0 as +0,
 * as the CPU's comparisons do), and ties go to the lower index through the
 * low word. Every real key is > 0; 0 marks an expert already taken.
 */
static __device__ unsigned long long router_key(float s, uint32_t e) {
    if (isnan(s)) s = -INFINITY;
    if (s == 0.0f) s = 0.0f;
    uint32_t u = __float_as_uint(s);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (unsigned long long)(0xffffffffu - e);
}

struct router_args {
    const float *logits;
    int64_t n_expert;
    const void *bias; /* NULL: none */
    uint32_t bias_type;
    const int32_t *hash; /* device, n_used ids (validated); NULL: top-k */
    int n_used;
    bool normalise;
    float scale;
    unsigned long long *keys; /* scratch [n_expert] */
    float *prob;    /* scratch [n_expert] */
    int32_t *sel;   /* out [n_used] (device, the caller's) */
    float *weight;  /* out [n_used] (device, the caller's) */
};

/* One block: probabilities, then n_used rounds of a block-wide arg-max over
 * the rank keys (each round takes the best remaining expert, so the
 * selection comes out in rank order, as the CPU's), then thread 0 forms the
 * weights in the CPU's order. */
static __global__ void __launch_bounds__(ROUTER_THREADS) router_kernel(router_args a) {
    cuda_grid_wait();
    __shared__ unsigned long long red[ROUTER_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    /* block r: token row r */
    const int64_t row = blockIdx.x;
    a.logits += row * a.n_expert;
    a.keys += row * a.n_expert;
    a.prob += row * a.n_expert;
    if (a.hash) a.hash += row * a.n_used;
    a.sel += row * a.n_used;
    a.weight += row * a.n_used;

    for (int64_t e = threadIdx.x; e < a.n_expert; e += ROUTER_THREADS) {
        const float p = sqrtf(router_softplus(a.logits[e]));
        a.prob[e] = p;
        if (!a.hash) {
            const float s = a.bias ? __fadd_rn(p, cuda_load_float(a.bias, a.bias_type, e)) : p;
            a.keys[e] = router_key(s, (uint32_t)e);
        }
    }
    __syncthreads();

    if (a.hash) {
        for (int k = threadIdx.x; k < a.n_used; k += ROUTER_THREADS) a.sel[k] = a.hash[k];
    } else {
        for (int k = 0; k < a.n_used; k++) {
            unsigned long long best = 0;
            for (int64_t e = threadIdx.x; e < a.n_expert; e += ROUTER_THREADS) {
                const unsigned long long key = a.keys[e];
                best = key > best ? key : best;
            }
            for (int o = 16; o > 0; o >>= 1) {
                const unsigned long long other = __shfl_down_sync(0xffffffffu, best, o);
                best = other > best ? other : best;
            }
            if (lane == 0) red[warp] = best;
            __syncthreads();
            if (threadIdx.x == 0) {
                unsigned long long b = red[0];
                for (int wi = 1; wi < ROUTER_THREADS / 32; wi++) b = red[wi] > b ? red[wi] : b;
                const int32_t e = (int32_t)(0xffffffffu - (uint32_t)b);
                a.sel[k] = e;
                a.keys[e] = 0; /* taken */
            }
            __syncthreads(); /* the taken mark and red are settled before the next round */
        }
    }
    __syncthreads();

    if (threadIdx.x == 0) {
        /* The weights use the unbiased probabilities. */
        float sum = 0.0f;
        for (int k = 0; k < a.n_used; k++) sum = __fadd_rn(sum, a.prob[a.sel[k]]);
        if (sum < 6.103515625e-5f) sum = 6.103515625e-5f;
        for (int k = 0; k < a.n_used; k++) {
            const float p = a.prob[a.sel[k]];
            a.weight[k] = a.normalise ? __fmul_rn(__fdiv_rn(p, sum), a.scale) : __fmul_rn(p, a.scale);
        }
    }
}

/*
 * router_kernel's selection and weights with everything on chip, for up to
 * ROUTER_THREADS * ROUTER_KPT experts and ROUTER_REG_USED choices (the
 * model's 256 and 6): each thread keeps its experts' rank keys in
 * registers, the probabilities and the choices sit in shared memory, and a
 * round is one barrier (every thread reads the warps' maxima and the owner
 * of the winner marks it taken), instead of the keys' and probabilities'
 * round trips through global memory. The same keys, order and arithmetic:
 * the same results bit for bit.
 */
#define ROUTER_KPT 4       /* experts per thread */
#define ROUTER_REG_USED 64 /* choices per row */
static __global__ void __launch_bounds__(ROUTER_THREADS) router_reg_kernel(router_args a) {
    cuda_grid_wait();
    __shared__ unsigned long long red[2][ROUTER_THREADS / 32]; /* by round parity */
    __shared__ float prob[ROUTER_THREADS * ROUTER_KPT];
    __shared__ int32_t sel[ROUTER_REG_USED];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row = blockIdx.x;
    a.logits += row * a.n_expert;
    if (a.hash) a.hash += row * a.n_used;
    a.sel += row * a.n_used;
    a.weight += row * a.n_used;

    unsigned long long key[ROUTER_KPT];
    float lg[ROUTER_KPT], bv[ROUTER_KPT];
#pragma unroll
    for (int j = 0; j < ROUTER_KPT; j++) { /* all loads in flight together */
        const int64_t e = threadIdx.x + (int64_t)j * ROUTER_THREADS;
        lg[j] = e < a.n_expert ? a.logits[e] : 0.0f;
        bv[j] = e < a.n_expert && a.bias && !a.hash ? cuda_load_float(a.bias, a.bias_type, e) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < ROUTER_KPT; j++) {
        const int64_t e = threadIdx.x + (int64_t)j * ROUTER_THREADS;
        key[j] = 0;
        if (e < a.n_expert) {
            const float p = sqrtf(router_softplus(lg[j]));
            prob[e] = p;
            if (!a.hash) key[j] = router_key(a.bias ? __fadd_rn(p, bv[j]) : p, (uint32_t)e);
        }
    }
    if (a.hash) {
        for (int k = threadIdx.x; k < a.n_used; k += ROUTER_THREADS) sel[k] = a.hash[k];
    } else {
        for (int k = 0; k < a.n_used; k++) {
            unsigned long long best = key[0];
#pragma unroll
            for (int j = 1; j < ROUTER_KPT; j++) best = key[j] > best ? key[j] : best;
            for (int o = 16; o > 0; o >>= 1) {
                const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
                best = other > best ? other : best;
            }
            if (lane == 0) red[k & 1][warp] = best;
            __syncthreads();
            unsigned long long b = red[k & 1][0];
#pragma unroll
            for (int wi = 1; wi < ROUTER_THREADS / 32; wi++) b = red[k & 1][wi] > b ? red[k & 1][wi] : b;
            const uint32_t e = 0xffffffffu - (uint32_t)b;
#pragma unroll
            for (int j = 0; j < ROUTER_KPT; j++)
                if (threadIdx.x + (uint32_t)j * ROUTER_THREADS == e) key[j] = 0; /* taken */
            if (threadIdx.x == 0) sel[k] = (int32_t)e;
        }
    }
    __syncthreads();

    if (threadIdx.x == 0) { /* as router_kernel: the unbiased probabilities */
        float sum = 0.0f;
        for (int k = 0; k < a.n_used; k++) sum = __fadd_rn(sum, prob[sel[k]]);
        if (sum < 6.103515625e-5f) sum = 6.103515625e-5f;
        for (int k = 0; k < a.n_used; k++) {
            const float p = prob[sel[k]];
            a.sel[k] = sel[k];
            a.weight[k] = a.normalise ? __fmul_rn(__fdiv_rn(p, sum), a.scale) : __fmul_rn(p, a.scale);
        }
    }
}

/* Zero results on a failed call (device memset on the stream), so a
 * caller that reads them anyway indexes expert 0 rather than garbage.
 * n_used here counts every row's choices. */
static void router_clear(ds4_backend *be, int32_t *sel_out, float *weight_out, int64_t n_used) {
    if (n_used <= 0) return;
    if (sel_out) (void)cuda_memset_d(be, sel_out, 0, (size_t)n_used * sizeof *sel_out);
    if (weight_out) (void)cuda_memset_d(be, weight_out, 0, (size_t)n_used * sizeof *weight_out);
}

void cuda_router(ds4_backend *be, const float *logits, int64_t n_expert, const ds4_weight *bias,
                 const int32_t *hash_ids, int n_used_row, bool normalise, float scale, int32_t *sel_out,
                 float *weight_out, int64_t n_rows) {
    /* n_used is checked first: the results are cleared on later failures only. */
    if (n_expert <= 0 || n_expert > INT32_MAX || n_used_row < 0 || n_used_row > n_expert ||
        (bias && bias->ne[0] < n_expert) || n_rows < 0 || n_rows > INT32_MAX) {
        cuda_fail(be, DS4_ERR_INVALID, "router: %d of %lld experts (bias %s), %lld rows", n_used_row,
                  (long long)n_expert, cuda_wname(bias), (long long)n_rows);
        return;
    }
    if (n_rows == 0) return;
    const int64_t n_used = (int64_t)n_used_row * n_rows; /* every row's choices */
    if (n_used > 0 && (!logits || !sel_out || !weight_out)) {
        cuda_fail(be, DS4_ERR_INVALID, "router: NULL logits or result arrays");
        return;
    }
    if (cuda_failed(be)) {
        router_clear(be, sel_out, weight_out, n_used);
        return;
    }
    if (bias && !hc_float_weight(bias)) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED,
                  "router: bias %s (%s%s) cannot be used by the CUDA backend: it needs an F32, F16 or BF16 vector "
                  "bound to the device",
                  cuda_wname(bias), ds4_type_name(bias->type), bias->device ? "" : ", not bound");
        router_clear(be, sel_out, weight_out, n_used);
        return;
    }
    if (hash_ids) { /* host memory: checked here, before the upload */
        for (int64_t k = 0; k < n_used; k++) {
            if (hash_ids[k] < 0 || hash_ids[k] >= n_expert) {
                cuda_fail(be, DS4_ERR_INVALID, "router: hash-selected expert %d is outside [0, %lld)", hash_ids[k],
                          (long long)n_expert);
                router_clear(be, sel_out, weight_out, n_used);
                return;
            }
        }
    }
    if (n_used == 0) return; /* nothing to select or weigh */

    /* ROUTER slot: keys [n_rows, n_expert] u64 | prob [n_rows, n_expert] f32
     * (router_kernel's; router_reg_kernel keeps them on chip) */
    const bool on_chip = cuda_impl(be)->router_reg && n_expert <= ROUTER_THREADS * ROUTER_KPT &&
                         n_used_row <= ROUTER_REG_USED;
    const size_t keys_bytes = on_chip ? 0 : (size_t)(n_expert * n_rows) * sizeof(unsigned long long);
    const size_t prob_bytes = on_chip ? 0 : (size_t)(n_expert * n_rows) * sizeof(float);
    uint8_t *scratch = on_chip ? NULL : (uint8_t *)cuda_scratch(be, CUDA_SCRATCH_ROUTER, keys_bytes + prob_bytes);
    const int32_t *d_hash = NULL;
    if ((on_chip || scratch) && hash_ids)
        d_hash = (const int32_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_HC, hash_ids, (size_t)n_used * sizeof(int32_t));
    if ((!on_chip && !scratch) || (hash_ids && !d_hash)) { /* the error is recorded */
        router_clear(be, sel_out, weight_out, n_used);
        return;
    }

    router_args a;
    memset(&a, 0, sizeof a); /* padding too: recorded steps compare argument bytes */
    a.logits = logits;
    a.n_expert = n_expert;
    a.bias = bias ? bias->device : NULL;
    a.bias_type = bias ? bias->type : (uint32_t)DS4_TYPE_F32;
    a.hash = d_hash;
    a.n_used = n_used_row;
    a.normalise = normalise;
    a.scale = scale;
    a.keys = (unsigned long long *)scratch;
    a.prob = scratch ? (float *)(scratch + keys_bytes) : NULL;
    a.sel = sel_out;
    a.weight = weight_out;
    (void)cuda_launch(be, "router kernel", on_chip ? router_reg_kernel : router_kernel, (unsigned)n_rows,
                      ROUTER_THREADS, 0, a);
}

/* ------------------------------------------------------------------------ */
/* SwiGLU (spec 3.7)                                                         */
/* ------------------------------------------------------------------------ */

/* out may equal g or u (elementwise: each element is read before it is written). */
static __global__ void swiglu_kernel(const float *g, const float *u, float limit, float scale, float *out, int64_t n) {
    cuda_grid_wait();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = cuda_swiglu1(g[i], u[i], limit, scale);
}

void cuda_swiglu(ds4_backend *be, const float *g, const float *u, float limit, float scale, float *out, int64_t n) {
    if (cuda_failed(be)) return;
    if (n < 0 || (n > 0 && (!g || !u || !out))) {
        cuda_fail(be, DS4_ERR_INVALID, "swiglu: %lld elements (or a NULL buffer)", (long long)n);
        return;
    }
    if (n == 0) return;
    (void)cuda_launch(be, "swiglu kernel", swiglu_kernel, ew_blocks(n), EW_THREADS, 0, g, u, limit, scale, out, n);
}

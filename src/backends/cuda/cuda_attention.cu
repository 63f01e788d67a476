/*
 * cuda_attention.cu - the attention side of the CUDA backend: tail RoPE,
 * attention with sinks, the compressor's softmax-gated pooling, indexer
 * scores and top-k selection (spec 3.4 - 3.6). The GPU twins of
 * cpu_attention.c, with the same contracts (backend.h) and validation.
 *
 * Numerics.
 *   rope_tail: the angle, its cosine and sine are computed in double exactly
 *     as the CPU writes them (no FMA contraction), then rounded to float; the
 *     rotation is done with __fmul_rn / __fadd_rn / __fsub_rn in the CPU's
 *     order. Results are the CPU's up to a last-ulp difference of a cos/sin
 *     where CUDA's double pow/cos/sin and the C library's differ in the last
 *     double bit across a float rounding boundary.
 *   attention: float throughout like the CPU, but split over the keys
 *     (flash-decoding): each block keeps a running max, a denominator and a
 *     weighted row sum for its share of the rows, rescaling when the max
 *     grows; a second kernel merges the shares with the sink logit. Same
 *     precision class as the CPU's two-pass float softmax, different
 *     summation order.
 *   compressor_pool: the CPU's loop and operation order per output dim
 *     (__fadd_rn / __fmul_rn), so only expf's last ulp differs.
 *   indexer_scores: float dots reduced as a warp tree (the CPU: 8 sequential
 *     lanes), relu, then the CPU's sequential weighted sum over heads, each
 *     head weight times weight_scale rounded once (__fmul_rn) as the CPU does.
 *   top_k: exact. Scores become 64-bit keys (order-preserving float bits,
 *     NaN as -inf, -0 as +0, then the complemented index so ties put the
 *     lowest index first); a device radix sort of the keys, descending, gives
 *     the CPU's order; a kernel turns the first k keys into the device index
 *     array (nothing comes back to the host).
 *
 * Layout.
 *   rope_tail: block (row, group of heads); the block's cos/sin table is
 *     computed once into shared memory, then every (head, pair) is rotated.
 *   attention: grid (head, split); 256 threads; tiles of 32 rows: each warp
 *     dots its rows with the head's query (in shared memory), then every
 *     thread updates its own dims of the accumulator (shared memory). The
 *     selected-row indices are device memory (top_k's output); the warp that
 *     reads one checks it against n_rows_b, and a bad one is reported into
 *     the device error record and left out (score -inf). The model's shape
 *     (heads of 512, MQA) takes attention_mqa_kernel: grid (group of 8
 *     heads, split[, query row]); staged, the queries and each tile's rows
 *     are copied into shared memory first, a warp scores its four rows of
 *     the tile together and a warp per head keeps the softmax.
 *   compressor_pool: one thread per output dim.
 *   indexer_scores: one warp per key (key in registers for dims <= 512),
 *     the queries and head weights in shared memory when they fit.
 */
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include <cuda_runtime.h>
#include <cub/cub.cuh>

#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/cuda_rope.cuh"
#include "backends/cuda/cuda_rows.cuh"

/* ------------------------------------------------------------------------ */
/* Shared pieces                                                             */
/* ------------------------------------------------------------------------ */

#define ATT_THREADS 256         /* attention blocks: 8 warps */
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_TILE 32             /* rows scored per pass of a block */
#define ATT_MIN_ROWS 64         /* fewest rows worth a split of their own */
#define ATT_TARGET_BLOCKS 512   /* heads x splits aimed for (a few waves of the SMs) */
#define ROPE_THREADS 256
#define ROPE_PAIRS_PER_BLOCK 512 /* two per thread: a decoded row's 64 heads in four blocks */
#define POOL_THREADS 256
#define IDX_THREADS 256         /* indexer blocks: 8 warps, one key each at a time */
#define IDX_WARPS (IDX_THREADS / 32)
#define IDX_MAX_BLOCKS 1024     /* each block stages the queries once, then strides over keys */
#define IDX_HEAD_BATCH 8        /* heads a warp's dots and reductions take side by side */
#define TOPK_THREADS 256

static_assert(ATT_THREADS % 32 == 0 && ATT_TILE <= ATT_THREADS, "one weight per thread of the tile");

static unsigned blocks_for(int64_t n, int threads, int64_t cap) {
    int64_t b = (n + threads - 1) / threads;
    if (b > cap) b = cap;
    if (b < 1) b = 1;
    return (unsigned)b;
}

/* Sum over the warp; every lane gets the result. */
static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* ------------------------------------------------------------------------ */
/* RoPE on the tail of each head (spec 3.4.4)                                */
/* ------------------------------------------------------------------------ */

#define ROPE_TABLE 64 /* pairs whose frequencies travel with the launch (n_rot <= 128) */
typedef cuda_rope_params<ROPE_TABLE> rope_params;

static rope_params rope_params_of(const ds4_rope *rope, bool inverse) {
    return cuda_rope_params_of<ROPE_TABLE>(rope, inverse);
}

/* The cos (then sin, times sin_sign) of each pair at position p into cs, by
 * the block's threads (a barrier after). */
static __device__ __forceinline__ void rope_table(const rope_params &rp, const int32_t *p, float *cs) {
    cuda_rope_table(rp, p, cs);
}

/* Block (row r, heads [h0, h0 + heads_per_block)). cs: cos of each pair, then
 * sin (sign applied for the inverse), as floats. */
static __global__ void __launch_bounds__(ROPE_THREADS)
    rope_tail_kernel(float *__restrict__ x, int64_t n_heads, int64_t head_dim, const int32_t *__restrict__ pos,
                     rope_params rp, int64_t heads_per_block) {
    extern __shared__ float rope_cs[];
    const int64_t r = blockIdx.x;
    const int half = rp.n_rot / 2;
    /* positions are control data, uploaded before the step's kernels: the
     * table is made while the kernel before drains */
    rope_table(rp, pos + r, rope_cs);
    cuda_grid_wait();
    const int64_t h0 = (int64_t)blockIdx.y * heads_per_block;
    const int64_t h1 = h0 + heads_per_block < n_heads ? h0 + heads_per_block : n_heads;
    const int count = (int)((h1 - h0) * half); /* the host keeps it below INT32_MAX - ROPE_THREADS */
    for (int e = threadIdx.x; e < count; e += blockDim.x) {
        const int64_t h = h0 + e / half;
        const int k = e % half;
        float *tail = x + (r * n_heads + h) * head_dim + (head_dim - rp.n_rot);
        const float c = rope_cs[k], s = rope_cs[half + k];
        float x0 = tail[2 * k], x1 = tail[2 * k + 1];
        cuda_rope_rotate(x0, x1, c, s);
        tail[2 * k] = x0;
        tail[2 * k + 1] = x1;
    }
}

void cuda_rope_tail(ds4_backend *be, float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t *pos,
                    const ds4_rope *rope, bool inverse) {
    if (!rope) {
        cuda_fail(be, DS4_ERR_INVALID, "rope_tail: no RoPE parameters");
        return;
    }
    const int64_t n_rot = rope->n_rot;
    if (n_rot <= 0 || n_rot % 2 != 0 || n_rot > head_dim) {
        cuda_fail(be, DS4_ERR_INVALID, "rope_tail: %lld rotated dims in heads of %lld", (long long)n_rot,
                  (long long)head_dim);
        return;
    }
    if (n_rows <= 0 || n_heads <= 0) return;
    if (!x || !pos) {
        cuda_fail(be, DS4_ERR_INVALID, "rope_tail: NULL %s for %lld rows", !x ? "buffer" : "positions",
                  (long long)n_rows);
        return;
    }
    if (n_rows > INT32_MAX) {
        cuda_fail(be, DS4_ERR_INVALID, "rope_tail: %lld rows", (long long)n_rows);
        return;
    }
    if (cuda_failed(be)) return;
    const size_t smem = (size_t)n_rot * sizeof(float);
    if (!cuda_allow_dynamic_smem(be, (const void *)rope_tail_kernel, smem, "rope_tail", n_rot)) return;
    const int32_t *d_pos =
        (const int32_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_ATTN_CTRL, pos, (size_t)n_rows * sizeof(int32_t));
    if (!d_pos) return;

    const int64_t half = n_rot / 2;
    int64_t per_block = (ROPE_PAIRS_PER_BLOCK + half - 1) / half;
    const int64_t min_per_block = (n_heads + 65534) / 65535; /* grid y limit */
    if (per_block < min_per_block) per_block = min_per_block;
    if (per_block > n_heads) per_block = n_heads;
    if (per_block * half > INT32_MAX - ROPE_THREADS) { /* the kernel's 32-bit pair index */
        cuda_fail(be, DS4_ERR_INVALID, "rope_tail: %lld heads a row", (long long)n_heads);
        return;
    }
    const int64_t groups = (n_heads + per_block - 1) / per_block;

    const rope_params rp = rope_params_of(rope, inverse);
    const dim3 grid((unsigned)n_rows, (unsigned)groups);
    (void)cuda_launch(be, "rope_tail_kernel", rope_tail_kernel, grid, ROPE_THREADS, smem, x, n_heads, head_dim, d_pos,
                      rp, per_block);
}

/* ------------------------------------------------------------------------ */
/* Head norm + RoPE (+ KV rounding) in one pass                              */
/* ------------------------------------------------------------------------ */

/* Block (row r, head h) of NORM_THREADS threads: the head's values in
 * registers as rmsnorm_kernel<true> holds a row (rms_load_row: the same
 * sum of squares), times the scale and the weight; the tail's pairs
 * rotated as rope_tail_kernel rotates them (a pair never straddles a
 * thread's four values: the tail starts at an even offset); with ROUND, the
 * FP8 blocks of the non-RoPE dims (64 values: 16 threads' float4s, their
 * amax by shuffles within the half-warp) rounded as round_blocks_kernel
 * rounds them, then every value through half precision as round_f16_kernel.
 * Each step's float operations are those of the kernel it stands for. */
/* The row's cos / sin table into the kernel's shared memory (before the
 * kernel's cuda_grid_wait: positions are control data, uploaded before the
 * step's kernels, so the table is made while the kernel before drains). */
static __device__ __forceinline__ void head_norm_rope_table(const rope_params &rp, const int32_t *pos) {
    extern __shared__ float rope_cs[];
    rope_table(rp, pos, rope_cs);
}

/* The four values i .. i + 3 of a head (v, their weights wv) normed by
 * scale, the tail's pairs rotated (cs: the row's cos then sin table), with
 * ROUND the FP8 block of the non-RoPE dims (its 16 float4s held by 16
 * consecutive lanes: amax by half-warp shuffles) and every value through
 * half precision, then stored (i < head_dim). Every lane of the warp calls
 * it (the shuffles). */
template <bool ROUND>
static __device__ __forceinline__ void head_norm_rope4(const float4 v, const float (&wv)[4], bool has_w, float scale,
                                                       int64_t i, int64_t head_dim, int64_t tail, int half,
                                                       const float *cs, float *xr) {
    float y[4] = { __fmul_rn(v.x, scale), __fmul_rn(v.y, scale), __fmul_rn(v.z, scale), __fmul_rn(v.w, scale) };
    if (has_w && i < head_dim)
#pragma unroll
        for (int c = 0; c < 4; c++) y[c] = __fmul_rn(y[c], wv[c]);
#pragma unroll
    for (int c = 0; c < 4; c += 2) { /* the pair (i + c, i + c + 1) of the tail */
        if (i + c >= tail && i + c < head_dim) {
            const int pk = (int)((i + c - tail) / 2);
            cuda_rope_rotate(y[c], y[c + 1], cs[pk], cs[half + pk]);
        }
    }
    if (ROUND) {
        /* values at or past `tail` are not part of any block */
        float amax = 0.0f;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const float a = fabsf(y[c]);
            if (i + c < tail && a > amax) amax = a; /* NaN never compares greater */
        }
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, amax, o);
            if (other > amax) amax = other;
        }
        const float bs = block_scale_of(amax, KV_FP8_FLOOR, KV_FP8_MAX);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            if (i + c < tail) y[c] = round_block_value<0>(y[c], bs, KV_FP8_MAX);
            y[c] = round_f16_value(y[c]);
        }
    }
    if (i < head_dim) *(float4 *)(xr + i) = make_float4(y[0], y[1], y[2], y[3]);
}

template <bool ROUND>
static __device__ __forceinline__ void head_norm_rope_block(float *__restrict__ x, int64_t n_heads, int64_t head_dim,
                                                            const float *__restrict__ w, float eps,
                                                            const rope_params &rp, int64_t head) {
    __shared__ double part[NORM_THREADS / 32];
    extern __shared__ float rope_cs[];
    float *xr = x + head * head_dim;
    float4 v[NORM_VEC];
    float wv[NORM_VEC][4];
    rms_load_row(xr, head_dim, v);
    rms_load_weight(w, head_dim, wv);
    const float scale = rms_loaded_scale(v, head_dim, eps, part);
    const int half = rp.n_rot / 2;
    const int64_t tail = head_dim - rp.n_rot; /* even */
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++)
        head_norm_rope4<ROUND>(v[k], wv[k], w != NULL, scale, 4 * (threadIdx.x + (int64_t)k * NORM_THREADS), head_dim,
                               tail, half, rope_cs, xr);
}
static_assert(KV_FP8_BLOCK == 16 * 4, "an FP8 block is the float4s of 16 threads");

template <bool ROUND>
static __global__ void __launch_bounds__(NORM_THREADS)
    head_norm_rope_kernel(float *__restrict__ x, int64_t n_heads, int64_t head_dim, const float *__restrict__ w,
                          float eps, const int32_t *__restrict__ pos, rope_params rp) {
    head_norm_rope_table(rp, pos + blockIdx.x / n_heads);
    cuda_grid_wait();
    head_norm_rope_block<ROUND>(x, n_heads, head_dim, w, eps, rp, blockIdx.x);
}

/* Two row sets in one launch (head_norm_rope2): blocks below a.blocks take
 * a's heads, the others b's, each as head_norm_rope_kernel would (ROUND_A,
 * ROUND_B: their roundings). */
struct hnr_set {
    float *x;
    const float *w;
    int64_t n_heads;
    int64_t blocks; /* n_rows * n_heads */
};
template <bool ROUND_A, bool ROUND_B>
static __global__ void __launch_bounds__(NORM_THREADS)
    head_norm_rope2_kernel(hnr_set a, hnr_set b, int64_t head_dim, float eps, const int32_t *__restrict__ pos,
                           rope_params rp) {
    const bool in_a = (int64_t)blockIdx.x < a.blocks;
    const int64_t head = in_a ? blockIdx.x : blockIdx.x - a.blocks;
    head_norm_rope_table(rp, pos + head / (in_a ? a.n_heads : b.n_heads));
    cuda_grid_wait();
    if (in_a) head_norm_rope_block<ROUND_A>(a.x, a.n_heads, head_dim, a.w, eps, rp, head);
    else head_norm_rope_block<ROUND_B>(b.x, b.n_heads, head_dim, b.w, eps, rp, head);
}

/*
 * Heads of at most HNR_WARP_DIM values take a warp each (HNR_WARPS heads a
 * block, the two sets' heads one flat list): a prefill's 2,048 rows x 65
 * heads were that many blocks of NORM_THREADS threads, half of them idle
 * for heads of 512, each with its barriers. Lane l holds the float4s that
 * threads l, 32 + l, 64 + l and 96 + l of head_norm_rope_block hold (its
 * "virtual warps" k = 0..3), and every operation is that block's, so the
 * results are the same bits:
 *   the squares: each virtual warp's shuffle tree as rms_scale_of's first
 *     stage; its second stage over 8 warp sums, of which warps 4..7 are
 *     exact zeros here (threads past 128 hold nothing of a head of <= 512),
 *     adds (p0 + p2) + (p1 + p3) (the zeros' additions are exact);
 *   the FP8 blocks: 16 consecutive threads of one virtual warp, the same
 *     half-warp shuffles;
 *   the table: each warp's own (its lanes' pairs), before the wait.
 * (ds4_cuda_backend_set_wide_rows 0: the block per head.)
 */
#define HNR_WARP_DIM 512
#define HNR_WARPS 8
static_assert(HNR_WARP_DIM == 4 * 32 * 4 && NORM_THREADS >= 4 * 32, "four virtual warps of a block's first 128 threads");

template <bool ROUND>
static __device__ __forceinline__ void head_norm_rope_warp(float *__restrict__ x, int64_t head_dim,
                                                           const float *__restrict__ w, float eps, const rope_params &rp,
                                                           int64_t head, const float *cs) {
    const int lane = threadIdx.x & 31;
    float *xr = x + head * head_dim;
    float4 v[4];
    float wv[4][4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int64_t i = 4 * (32 * k + lane);
        v[k] = i < head_dim ? *(const float4 *)(xr + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int c = 0; c < 4; c++) wv[k][c] = w && i < head_dim ? w[i + c] : 1.0f;
    }
    double p[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        p[k] = 0.0;
        p[k] += (double)v[k].x * (double)v[k].x + (double)v[k].y * (double)v[k].y +
                (double)v[k].z * (double)v[k].z + (double)v[k].w * (double)v[k].w;
    }
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int k = 0; k < 4; k++) p[k] += __shfl_down_sync(0xffffffffu, p[k], o);
    const double ss = __shfl_sync(0xffffffffu, (p[0] + p[2]) + (p[1] + p[3]), 0);
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn((float)(ss / (double)head_dim), eps)));
    const int half = rp.n_rot / 2;
    const int64_t tail = head_dim - rp.n_rot; /* even */
#pragma unroll
    for (int k = 0; k < 4; k++)
        head_norm_rope4<ROUND>(v[k], wv[k], w != NULL, scale, 4 * (32 * k + lane), head_dim, tail, half, cs, xr);
}

/* Warp (item): a's heads first, then b's (b.blocks 0: one set). */
template <bool ROUND_A, bool ROUND_B>
static __global__ void __launch_bounds__(32 * HNR_WARPS)
    head_norm_rope_warp_kernel(hnr_set a, hnr_set b, int64_t head_dim, float eps, const int32_t *__restrict__ pos,
                               rope_params rp) {
    extern __shared__ float hnr_cs[]; /* [HNR_WARPS][n_rot] */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t item = (int64_t)blockIdx.x * HNR_WARPS + warp;
    if (item >= a.blocks + b.blocks) return; /* the whole warp (no block barrier follows) */
    const bool in_a = item < a.blocks;
    const int64_t head = in_a ? item : item - a.blocks;
    float *cs = hnr_cs + warp * rp.n_rot;
    const int32_t *p = pos + head / (in_a ? a.n_heads : b.n_heads);
    for (int k = lane; k < rp.n_rot / 2; k += 32) cuda_rope_entry(rp, p, k, cs);
    __syncwarp();
    cuda_grid_wait();
    if (in_a) head_norm_rope_warp<ROUND_A>(a.x, head_dim, a.w, eps, rp, head, cs);
    else head_norm_rope_warp<ROUND_B>(b.x, head_dim, b.w, eps, rp, head, cs);
}

/* (rows >= CUDA_WIDE_MIN_ROWS: a decoded token's 65 heads are faster as
 * 65 blocks, each head's loads and sums spread over more threads) */
static bool hnr_warp_on(ds4_backend *be, int64_t n_rows, int64_t head_dim) {
    return cuda_impl(be)->wide_rows && n_rows >= CUDA_WIDE_MIN_ROWS && head_dim <= HNR_WARP_DIM;
}

/* The warp kernel for sets a and b (b.blocks may be 0). */
static void hnr_warp_launch(ds4_backend *be, const hnr_set &a, const hnr_set &b, bool round_a, bool round_b,
                            int64_t head_dim, float eps, const int32_t *d_pos, const rope_params &rp) {
    typedef void (*fn_t)(hnr_set, hnr_set, int64_t, float, const int32_t *, rope_params);
    const fn_t fn = round_a ? (round_b ? head_norm_rope_warp_kernel<true, true> : head_norm_rope_warp_kernel<true, false>)
                            : (round_b ? head_norm_rope_warp_kernel<false, true> : head_norm_rope_warp_kernel<false, false>);
    const size_t smem = (size_t)HNR_WARPS * rp.n_rot * sizeof(float);
    if (!cuda_allow_dynamic_smem(be, (const void *)fn, smem, "head_norm_rope (warps)", rp.n_rot)) return;
    const int64_t items = a.blocks + b.blocks;
    (void)cuda_launch(be, "head_norm_rope_warp_kernel", fn, (unsigned)((items + HNR_WARPS - 1) / HNR_WARPS),
                      32 * HNR_WARPS, smem, a, b, head_dim, eps, d_pos, rp);
}

bool cuda_head_norm_rope_fits(const float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim) {
    return n_rows * n_heads <= INT32_MAX && head_dim % 4 == 0 && head_dim <= NORM_CACHED && (uintptr_t)x % 16 == 0;
}

void cuda_head_norm_rope_fused(ds4_backend *be, float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim,
                               const float *w, float eps, const int32_t *pos, const ds4_rope *rope, bool round_kv) {
    if (cuda_failed(be) || n_rows <= 0) return;
    const int64_t blocks = n_rows * n_heads;
    if (!cuda_head_norm_rope_fits(x, n_rows, n_heads, head_dim)) {
        cuda_fail(be, DS4_ERR_INVALID, "head_norm_rope: %lld heads of %lld do not suit the fused kernel",
                  (long long)blocks, (long long)head_dim);
        return;
    }
    const size_t smem = (size_t)rope->n_rot * sizeof(float);
    const void *fn = round_kv ? (const void *)head_norm_rope_kernel<true> : (const void *)head_norm_rope_kernel<false>;
    if (!cuda_allow_dynamic_smem(be, fn, smem, "head_norm_rope", rope->n_rot)) return;
    const int32_t *d_pos =
        (const int32_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_ATTN_CTRL, pos, (size_t)n_rows * sizeof(int32_t));
    if (!d_pos) return;
    const rope_params rp = rope_params_of(rope, false);
    if (hnr_warp_on(be, n_rows, head_dim)) {
        hnr_set a, b;
        memset(&a, 0, sizeof a); /* (recorded steps compare argument bytes) */
        memset(&b, 0, sizeof b);
        a.x = x, a.w = w, a.n_heads = n_heads, a.blocks = blocks;
        b.n_heads = 1;
        hnr_warp_launch(be, a, b, round_kv, false, head_dim, eps, d_pos, rp);
        return;
    }
    if (round_kv)
        (void)cuda_launch(be, "head_norm_rope_kernel<round>", head_norm_rope_kernel<true>, (unsigned)blocks,
                          NORM_THREADS, smem, x, n_heads, head_dim, w, eps, d_pos, rp);
    else
        (void)cuda_launch(be, "head_norm_rope_kernel", head_norm_rope_kernel<false>, (unsigned)blocks, NORM_THREADS,
                          smem, x, n_heads, head_dim, w, eps, d_pos, rp);
}

void cuda_head_norm_rope2_fused(ds4_backend *be, float *xa, int64_t heads_a, const float *wa, bool round_a, float *xb,
                                int64_t heads_b, const float *wb, bool round_b, int64_t n_rows, int64_t head_dim,
                                float eps, const int32_t *pos, const ds4_rope *rope) {
    if (cuda_failed(be) || n_rows <= 0) return;
    const int64_t blocks = n_rows * (heads_a + heads_b);
    if (!cuda_head_norm_rope_fits(xa, n_rows, heads_a, head_dim) ||
        !cuda_head_norm_rope_fits(xb, n_rows, heads_b, head_dim) || blocks > INT32_MAX) {
        cuda_fail(be, DS4_ERR_INVALID, "head_norm_rope2: %lld heads of %lld do not suit the fused kernel",
                  (long long)blocks, (long long)head_dim);
        return;
    }
    typedef void (*fn_t)(hnr_set, hnr_set, int64_t, float, const int32_t *, rope_params);
    const fn_t fn = round_a ? (round_b ? head_norm_rope2_kernel<true, true> : head_norm_rope2_kernel<true, false>)
                            : (round_b ? head_norm_rope2_kernel<false, true> : head_norm_rope2_kernel<false, false>);
    const size_t smem = (size_t)rope->n_rot * sizeof(float);
    if (!cuda_allow_dynamic_smem(be, (const void *)fn, smem, "head_norm_rope2", rope->n_rot)) return;
    const int32_t *d_pos =
        (const int32_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_ATTN_CTRL, pos, (size_t)n_rows * sizeof(int32_t));
    if (!d_pos) return;
    const rope_params rp = rope_params_of(rope, false);
    hnr_set a, b;
    memset(&a, 0, sizeof a); /* (recorded steps compare argument bytes) */
    memset(&b, 0, sizeof b);
    a.x = xa, a.w = wa, a.n_heads = heads_a, a.blocks = n_rows * heads_a;
    b.x = xb, b.w = wb, b.n_heads = heads_b, b.blocks = n_rows * heads_b;
    if (hnr_warp_on(be, n_rows, head_dim)) {
        hnr_warp_launch(be, a, b, round_a, round_b, head_dim, eps, d_pos, rp);
        return;
    }
    (void)cuda_launch(be, "head_norm_rope2_kernel", fn, (unsigned)blocks, NORM_THREADS, smem, a, b, head_dim, eps,
                      d_pos, rp);
}

/* ------------------------------------------------------------------------ */
/* Attention with sinks (spec 3.4.7)                                         */
/* ------------------------------------------------------------------------ */

/*
 * Per head h: s_r = q_h . row_r / sqrt(dim); out_h = sum_r exp(s_r - m) row_r
 * / (exp(sink - m) + sum_r exp(s_r - m)), m = max(sink, s_r).
 *
 * attention_partial_kernel, block (h, split): over its rows [split * rps,
 * (split + 1) * rps) it keeps m (running max), den = sum exp(s_r - m) and
 * acc = sum exp(s_r - m) row_r, and writes (m, den, acc[dim]) to part.
 * attention_combine_kernel, block h: M = max(sink, m_split), factors
 * f = exp(m_split - M), out = sum f acc / (exp(sink - M) + sum f den).
 * A share whose scores are all -inf (m = -inf) weighs 0, as a -inf score
 * does on the CPU.
 */

struct att_rows {
    const float *a; /* rows_a [n_a, dim] */
    int64_t n_a;
    const float *b; /* rows_b [n_rows_b, dim] */
    int64_t n_rows_b;
    const int32_t *idx; /* idx_b (device), or NULL */
    int64_t idx_stride; /* attention_rows_sel: query row z's selection at idx + z * idx_stride */
    int64_t dim;
    cuda_dev_error *err; /* where a bad index is reported */
    int tag;             /* the sinks' name, for the message */
};

/* Row r of the key/value sequence; NULL when it is a selected row whose
 * index is outside rows_b (reported where `report`: once per row, by one
 * thread of the blocks of head 0). */
static __device__ __forceinline__ const float *att_row(const att_rows &rows, int64_t r, bool report) {
    if (r < rows.n_a) return rows.a + r * rows.dim;
    r -= rows.n_a;
    if (!rows.idx) return rows.b + r * rows.dim;
    const int32_t i = rows.idx[r];
    if (!cuda_index_ok(i, rows.n_rows_b)) {
        if (report)
            cuda_report_bad_index(rows.err, CUDA_CHECK_ATTENTION_ROW, rows.tag, i, rows.n_rows_b, r);
        return NULL;
    }
    return rows.b + (int64_t)i * rows.dim;
}

static __global__ void __launch_bounds__(ATT_THREADS)
    attention_partial_kernel(const float *__restrict__ q, att_rows rows, int64_t n, int64_t rows_per_split,
                             float kq_scale, float *__restrict__ part) {
    cuda_grid_wait();
    extern __shared__ float att_smem[];
    __shared__ float s_tile[ATT_TILE];
    __shared__ float w_tile[ATT_TILE];
    __shared__ const float *row_tile[ATT_TILE];
    const int64_t dim = rows.dim;
    float *qs = att_smem;    /* q_h [dim] */
    float *acc = qs + dim;   /* [dim]; element i is touched only by thread i % ATT_THREADS */
    const int64_t h = blockIdx.x, split = blockIdx.y, n_splits = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int64_t i = tid; i < dim; i += ATT_THREADS) {
        qs[i] = q[h * dim + i];
        acc[i] = 0.0f;
    }
    __syncthreads();
    const int64_t r0 = split * rows_per_split;
    const int64_t r1 = r0 + rows_per_split < n ? r0 + rows_per_split : n;
    float m = -INFINITY, den = 0.0f; /* the same in every thread */
    for (int64_t t0 = r0; t0 < r1; t0 += ATT_TILE) {
        const int nt = (int)(r1 - t0 < ATT_TILE ? r1 - t0 : ATT_TILE);
        for (int j = warp; j < nt; j += ATT_WARPS) {
            const float *row = att_row(rows, t0 + j, blockIdx.x == 0 && lane == 0); /* the same for the whole warp */
            float d = 0.0f;
            if (row) {
                for (int64_t i = lane; i < dim; i += 32) d = fmaf(qs[i], row[i], d);
                d = warp_sum(d);
            }
            if (lane == 0) {
                /* a bad row weighs 0; it points at the query (in bounds) so
                 * the accumulation below needs no branch */
                s_tile[j] = row ? d * kq_scale : -INFINITY;
                row_tile[j] = row ? row : qs;
            }
        }
        __syncthreads();
        float tile_max = -INFINITY;
        for (int j = 0; j < nt; j++) tile_max = fmaxf(tile_max, s_tile[j]);
        const float m_new = fmaxf(m, tile_max);
        const float rescale = m == -INFINITY ? 0.0f : expf(m - m_new);
        if (tid < nt) w_tile[tid] = s_tile[tid] == -INFINITY ? 0.0f : expf(s_tile[tid] - m_new);
        __syncthreads();
        float wsum = 0.0f;
        for (int j = 0; j < nt; j++) wsum += w_tile[j];
        den = den * rescale + wsum;
        for (int64_t i = tid; i < dim; i += ATT_THREADS) {
            float a = acc[i] * rescale;
            for (int j = 0; j < nt; j++) a = fmaf(w_tile[j], row_tile[j][i], a);
            acc[i] = a;
        }
        m = m_new;
        __syncthreads(); /* the tile arrays are refilled next */
    }
    float *out = part + (h * n_splits + split) * (dim + 2);
    if (tid == 0) {
        out[0] = m;
        out[1] = den;
    }
    for (int64_t i = tid; i < dim; i += ATT_THREADS) out[2 + i] = acc[i];
}

/* The model's shape (dim 512, heads in groups of MQA_HG): every head reads
 * the same key/value rows, so a block takes MQA_HG heads of one split and
 * each row is read once for all of them (the kernel above reads it once per
 * head). Per head the float operations are those of attention_partial_kernel
 * in the same order (the dot over lanes then the warp tree, the running max,
 * the rescaled sums) except a tile's sum of weights, a warp tree here (warp
 * h keeps head h's max and denominator, lane j weighs row j of the tile);
 * every thread keeps its dims of the accumulators of all MQA_HG heads in
 * registers. */
#define MQA_DIM 512
#define MQA_HG 8                       /* heads per block */
#define MQA_DPT (MQA_DIM / ATT_THREADS) /* dims per thread */
#define MQA_MIN_ROWS 32                 /* fewest rows worth a split of their own */
#define MQA_RPW (ATT_TILE / ATT_WARPS)  /* a warp's rows of a tile */
static_assert(MQA_DIM % ATT_THREADS == 0 && MQA_DIM % 32 == 0, "whole dims per thread and lane");
static_assert(MQA_HG == ATT_WARPS && ATT_TILE == 32, "a warp per head's softmax, a lane per row of the tile");
static_assert(MQA_HG == 8 && ATT_TILE % ATT_WARPS == 0, "a row's weights in two float4; whole rows per warp");

/* One query row's view for attention_rows: a_n window rows from a, the
 * first b_n rows of b (with a selection: b_n selected rows of b, each below
 * b_bound); a row's own pointers, so the rows of a batch may be of
 * different states (attention_states). */
struct att_view {
    const float *a, *b;
    int64_t a_n, b_n, b_bound;
    int64_t rps; /* rows per split: the row's own, as a single row's launch splits it (the grid has the most) */
};

/* MQA_STAGED: the block's query rows and each tile of key/value rows are
 * copied into shared memory first (cp.async: the queries' 16 KB and the
 * tile's 64 KB all in flight at once, the tile's row addresses, selected
 * indices included, looked up by one warp beforehand), so a block waits
 * for about two memory latencies instead of one per row and per stride of
 * its accumulation; the float operations and their order are those of the
 * kernel without it (the same partials bit for bit). Queries and row
 * bases of 16-byte aligned starts only (the callers check mqa_aligned). */
#define MQA_SMEM_PLAIN ((size_t)MQA_HG * MQA_DIM * sizeof(float))
#define MQA_SMEM_STAGED ((size_t)(MQA_HG + ATT_TILE) * MQA_DIM * sizeof(float))

template <bool STAGED>
static __global__ void __launch_bounds__(ATT_THREADS, STAGED ? 2 : 1)
    attention_mqa_kernel(const float *__restrict__ q, att_rows rows, int64_t n, int64_t rows_per_split,
                         float kq_scale, float *__restrict__ part, const att_view *__restrict__ views) {
    cuda_grid_wait();
    if (views) { /* query row blockIdx.z of a run, its own view (attention_rows) */
        const att_view v = views[blockIdx.z];
        rows_per_split = v.rps;
        const int64_t n_heads = (int64_t)gridDim.x * MQA_HG;
        rows.a = v.a;
        rows.b = v.b;
        rows.n_a = v.a_n;
        rows.n_rows_b = rows.idx ? v.b_bound : v.b_n;
        if (rows.idx) rows.idx += blockIdx.z * rows.idx_stride;
        n = v.a_n + v.b_n;
        q += blockIdx.z * n_heads * MQA_DIM;
        part += blockIdx.z * n_heads * gridDim.y * (MQA_DIM + 2);
    }
    extern __shared__ float4 mqa_smem[];
    float(*qs)[MQA_DIM] = (float(*)[MQA_DIM])mqa_smem;  /* [MQA_HG][MQA_DIM] */
    float(*tile)[MQA_DIM] = qs + MQA_HG;                 /* STAGED: [ATT_TILE][MQA_DIM] */
    __shared__ float s_tile[MQA_HG][ATT_TILE];
    __shared__ __align__(16) float w_tile[ATT_TILE][MQA_HG]; /* a row's weights of the MQA_HG heads side by side */
    __shared__ float sh_rescale[MQA_HG];
    __shared__ const float *row_tile[ATT_TILE];
    const int64_t g = blockIdx.x, split = blockIdx.y, n_splits = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float *qg = q + g * MQA_HG * MQA_DIM;
    if (STAGED) {
        for (int i = tid; i < MQA_HG * MQA_DIM / 4; i += ATT_THREADS) cp_async16(mqa_smem + i, (const float4 *)qg + i, true);
        cp_async_commit();
    } else {
        for (int i = tid; i < MQA_HG * MQA_DIM; i += ATT_THREADS) qs[i / MQA_DIM][i % MQA_DIM] = qg[i];
    }
    float acc[MQA_HG][MQA_DPT];
#pragma unroll
    for (int h = 0; h < MQA_HG; h++)
#pragma unroll
        for (int d = 0; d < MQA_DPT; d++) acc[h][d] = 0.0f;
    float m = -INFINITY, den = 0.0f; /* head `warp`'s, the same in all its lanes */
    if (!STAGED) __syncthreads();
    const int64_t r0 = split * rows_per_split;
    const int64_t r1 = r0 + rows_per_split < n ? r0 + rows_per_split : n;
    for (int64_t t0 = r0; t0 < r1; t0 += ATT_TILE) {
        const int nt = (int)(r1 - t0 < ATT_TILE ? r1 - t0 : ATT_TILE);
        if (STAGED) {
            /* the tile's rows: addresses by warp 0 (one lane a row), then
             * every row's 2 KB copied by 128 threads; a bad row is zeros */
            if (warp == 0 && lane < nt) row_tile[lane] = att_row(rows, t0 + lane, blockIdx.x == 0);
            __syncthreads();
            for (int p = tid; p < nt * (MQA_DIM / 4); p += ATT_THREADS) {
                const int j = p / (MQA_DIM / 4), c = p % (MQA_DIM / 4);
                const float *row = row_tile[j];
                cp_async16(&tile[j][4 * c], row ? row + 4 * c : qg, row != NULL);
            }
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
            /* the scores: a warp's MQA_RPW rows at once, each query value
             * loaded once for all of them (the dot of each (head, row) in
             * the order of the kernel without staging) */
            float rv[MQA_RPW][MQA_DIM / 32];
            bool ok[MQA_RPW];
#pragma unroll
            for (int jj = 0; jj < MQA_RPW; jj++) {
                const int j = warp + ATT_WARPS * jj;
                ok[jj] = j < nt && row_tile[j] != NULL;
#pragma unroll
                for (int k = 0; k < MQA_DIM / 32; k++) rv[jj][k] = ok[jj] ? tile[j][lane + 32 * k] : 0.0f;
            }
#pragma unroll
            for (int h = 0; h < MQA_HG; h++) {
                float d[MQA_RPW];
#pragma unroll
                for (int jj = 0; jj < MQA_RPW; jj++) d[jj] = 0.0f;
#pragma unroll
                for (int k = 0; k < MQA_DIM / 32; k++) {
                    const float qv = qs[h][lane + 32 * k];
#pragma unroll
                    for (int jj = 0; jj < MQA_RPW; jj++) d[jj] = fmaf(qv, rv[jj][k], d[jj]);
                }
#pragma unroll
                for (int jj = 0; jj < MQA_RPW; jj++) d[jj] = warp_sum(d[jj]);
                if (lane == 0)
#pragma unroll
                    for (int jj = 0; jj < MQA_RPW; jj++)
                        if (warp + ATT_WARPS * jj < nt) s_tile[h][warp + ATT_WARPS * jj] = ok[jj] ? d[jj] * kq_scale : -INFINITY;
            }
        } else {
            for (int j = warp; j < nt; j += ATT_WARPS) {
                const float *row = att_row(rows, t0 + j, blockIdx.x == 0 && lane == 0); /* the same for the whole warp */
                float rv[MQA_DIM / 32];
#pragma unroll
                for (int k = 0; k < MQA_DIM / 32; k++) rv[k] = row ? row[lane + 32 * k] : 0.0f;
#pragma unroll
                for (int h = 0; h < MQA_HG; h++) {
                    float d = 0.0f;
                    if (row) {
#pragma unroll
                        for (int k = 0; k < MQA_DIM / 32; k++) d = fmaf(qs[h][lane + 32 * k], rv[k], d);
                        d = warp_sum(d);
                    }
                    if (lane == 0) s_tile[h][j] = row ? d * kq_scale : -INFINITY;
                }
                if (lane == 0) row_tile[j] = row ? row : qs[0]; /* a bad row weighs 0; it points in bounds */
            }
        }
        __syncthreads();
        {
            /* warp h: head h's running max, the tile's weights, their sum
             * (a warp tree) and the denominator */
            const int h = warp;
            const float sv = lane < nt ? s_tile[h][lane] : -INFINITY;
            float tile_max = sv;
            for (int o = 16; o > 0; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
            const float m_new = fmaxf(m, tile_max);
            const float rescale = m == -INFINITY ? 0.0f : expf(m - m_new);
            const float w = sv == -INFINITY ? 0.0f : expf(sv - m_new);
            if (lane < nt) w_tile[lane][h] = w;
            den = den * rescale + warp_sum(w);
            m = m_new;
            if (lane == 0) sh_rescale[h] = rescale;
        }
        __syncthreads();
        float rs[MQA_HG];
#pragma unroll
        for (int h = 0; h < MQA_HG; h++) rs[h] = sh_rescale[h];
#pragma unroll
        for (int d = 0; d < MQA_DPT; d++)
#pragma unroll
            for (int h = 0; h < MQA_HG; h++) acc[h][d] *= rs[h];
        /* the weighted rows, in row order; a row's MQA_HG weights in two
         * 16-byte loads, every dim of the thread at once */
#pragma unroll 4
        for (int j = 0; j < nt; j++) {
            float r[MQA_DPT];
#pragma unroll
            for (int d = 0; d < MQA_DPT; d++) r[d] = STAGED ? tile[j][tid + d * ATT_THREADS] : row_tile[j][tid + d * ATT_THREADS];
            const float4 w0 = *(const float4 *)&w_tile[j][0], w1 = *(const float4 *)&w_tile[j][4];
            const float wv[MQA_HG] = { w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w };
#pragma unroll
            for (int d = 0; d < MQA_DPT; d++)
#pragma unroll
                for (int h = 0; h < MQA_HG; h++) acc[h][d] = fmaf(wv[h], r[d], acc[h][d]);
        }
        __syncthreads(); /* the tile arrays are refilled next */
    }
    if (STAGED) cp_async_wait<0>(); /* (an empty share never waited for its queries) */
    if (lane == 0) {
        float *out = part + ((g * MQA_HG + warp) * n_splits + split) * (MQA_DIM + 2);
        out[0] = m;
        out[1] = den;
    }
#pragma unroll
    for (int h = 0; h < MQA_HG; h++) {
        float *out = part + ((g * MQA_HG + h) * n_splits + split) * (MQA_DIM + 2);
#pragma unroll
        for (int d = 0; d < MQA_DPT; d++) out[2 + tid + d * ATT_THREADS] = acc[h][d];
    }
}

/* The combine takes the splits ATT_COMB_BATCH at a time, each thread's
 * loads of a batch (both its dims') issued together before the sums. */
#define ATT_COMB_BATCH 8

/* The combine's factor array: n_splits padded to a multiple of 4. */
static __host__ __device__ __forceinline__ int64_t att_padded_splits(int64_t n_splits) {
    return (n_splits + 3) & ~(int64_t)3;
}

static __global__ void __launch_bounds__(ATT_THREADS)
    attention_combine_kernel(const float *__restrict__ part, int64_t n_splits, int64_t dim, const void *sinks,
                             uint32_t sinks_type, float *__restrict__ out) {
    cuda_grid_wait();
    extern __shared__ float att_factor[]; /* [padded n_splits] factors, then [n_splits] denominators */
    __shared__ float sh_inv;
    const int64_t h = blockIdx.x;
    const int64_t stride = dim + 2;
    part += blockIdx.y * (int64_t)gridDim.x * n_splits * stride; /* query row y of attention_rows */
    out += blockIdx.y * (int64_t)gridDim.x * dim;
    const float *ph = part + h * n_splits * stride;
    const int64_t padded = att_padded_splits(n_splits);
    float *att_den = att_factor + padded;
    __shared__ float red_m[32];
    const float sink = cuda_load_float(sinks, sinks_type, h);
    /* M over the splits, spread over the block (a max does not depend on
     * the order); each split's denominator loaded beside its max */
    float M = sink;
    for (int64_t s = threadIdx.x; s < n_splits; s += blockDim.x) {
        M = fmaxf(M, ph[s * stride]);
        att_den[s] = ph[s * stride + 1];
    }
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    if ((threadIdx.x & 31) == 0) red_m[threadIdx.x >> 5] = M;
    __syncthreads();
    M = red_m[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) M = fmaxf(M, red_m[w]);
    /* the array is padded to a multiple of 4 (zeros) */
    for (int64_t s = threadIdx.x; s < padded; s += blockDim.x) {
        const float ms = s < n_splits ? ph[s * stride] : -INFINITY;
        att_factor[s] = ms == -INFINITY ? 0.0f : expf(ms - M);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float den = expf(sink - M);
        for (int64_t s = 0; s < n_splits; s++) den = fmaf(att_den[s], att_factor[s], den);
        sh_inv = 1.0f / den;
    }
    __syncthreads();
    const float inv = sh_inv;
    /* in split order per element; a thread's two elements (dim 512) side by side */
    for (int64_t i = threadIdx.x; i < dim; i += 2 * (int64_t)blockDim.x) {
        const int64_t i2 = i + blockDim.x;
        const bool two = i2 < dim;
        float o = 0.0f, o2 = 0.0f;
        for (int64_t s0 = 0; s0 < n_splits; s0 += ATT_COMB_BATCH) {
            float v[ATT_COMB_BATCH], v2[ATT_COMB_BATCH];
#pragma unroll
            for (int b = 0; b < ATT_COMB_BATCH; b++) {
                const bool in = s0 + b < n_splits;
                v[b] = in ? ph[(s0 + b) * stride + 2 + i] : 0.0f;
                v2[b] = in && two ? ph[(s0 + b) * stride + 2 + i2] : 0.0f;
            }
#pragma unroll
            for (int b = 0; b < ATT_COMB_BATCH; b++)
                if (s0 + b < n_splits) {
                    o = fmaf(v[b], att_factor[s0 + b], o);
                    o2 = fmaf(v2[b], att_factor[s0 + b], o2);
                }
        }
        out[h * dim + i] = o * inv;
        if (two) out[h * dim + i2] = o2 * inv;
    }
}

/* The combine for few splits (<= ATT_COMB_WARP_SPLITS, a prefill's rows):
 * a warp per (row, head), 8 heads a block, every lane forming the factors
 * and the denominator itself, with attention_combine_kernel's operations
 * in its order (the max does not depend on the order; the denominator's
 * and each output's FMA chains run in split order): the same bits. A lane
 * takes EL of its elements (i = lane + 32 k) at a time with every split's
 * loads of them in flight together (NS x EL = 64: for 2 or 3 splits all of
 * a 512-wide head at once), where one element at a time left a lane
 * waiting on a load round trip per element. */
#define ATT_COMB_WARP_SPLITS 16
#define ATT_COMB_WARP_HEADS 8
template <int NS>
static __global__ void __launch_bounds__(32 * ATT_COMB_WARP_HEADS)
    attention_combine_warp_kernel(const float *__restrict__ part, int64_t n_heads, int64_t n_splits, int64_t dim,
                                  const void *sinks, uint32_t sinks_type, float *__restrict__ out) {
    constexpr int EL = 64 / NS;
    const int lane = threadIdx.x & 31;
    const int64_t h = (int64_t)blockIdx.x * ATT_COMB_WARP_HEADS + (threadIdx.x >> 5);
    if (h >= n_heads) return; /* the whole warp */
    const float sink = cuda_load_float(sinks, sinks_type, h);
    cuda_grid_wait();
    const int64_t stride = dim + 2;
    const float *ph = part + (blockIdx.y * n_heads + h) * n_splits * stride;
    out += (blockIdx.y * n_heads + h) * dim;
    float f[NS], dn[NS];
    float M = sink;
#pragma unroll
    for (int s = 0; s < NS; s++) {
        f[s] = s < n_splits ? ph[s * stride] : -INFINITY;
        dn[s] = s < n_splits ? ph[s * stride + 1] : 0.0f;
        M = fmaxf(M, f[s]);
    }
#pragma unroll
    for (int s = 0; s < NS; s++) f[s] = f[s] == -INFINITY ? 0.0f : expf(f[s] - M);
    float den = expf(sink - M);
#pragma unroll
    for (int s = 0; s < NS; s++)
        if (s < n_splits) den = fmaf(dn[s], f[s], den);
    const float inv = 1.0f / den;
    for (int64_t i0 = lane; i0 < dim; i0 += 32 * EL) {
        float v[EL][NS];
#pragma unroll
        for (int k = 0; k < EL; k++)
#pragma unroll
            for (int s = 0; s < NS; s++)
                v[k][s] = s < n_splits && i0 + 32 * k < dim ? ph[s * stride + 2 + i0 + 32 * k] : 0.0f;
#pragma unroll
        for (int k = 0; k < EL; k++) {
            float o = 0.0f;
#pragma unroll
            for (int s = 0; s < NS; s++)
                if (s < n_splits) o = fmaf(v[k][s], f[s], o);
            if (i0 + 32 * k < dim) out[i0 + 32 * k] = o * inv;
        }
    }
}

static size_t att_combine_smem(int64_t n_splits);

/* The combine of n rows' partials (attention_rows): the warp form for few
 * splits (ds4_cuda_backend_set_wide_rows), else a block per (head, row). */
static void att_combine_rows(ds4_backend *be, const float *part, int64_t n, int64_t n_heads, int64_t n_splits,
                             int64_t dim, const void *sinks, uint32_t sinks_type, float *out) {
    if (cuda_impl(be)->wide_rows && n_splits <= ATT_COMB_WARP_SPLITS) {
        typedef void (*fn_t)(const float *, int64_t, int64_t, int64_t, const void *, uint32_t, float *);
        const fn_t fn = n_splits <= 4 ? attention_combine_warp_kernel<4> : attention_combine_warp_kernel<ATT_COMB_WARP_SPLITS>;
        (void)cuda_launch(be, "attention_combine_warp_kernel", fn,
                          dim3((unsigned)((n_heads + ATT_COMB_WARP_HEADS - 1) / ATT_COMB_WARP_HEADS), (unsigned)n),
                          32 * ATT_COMB_WARP_HEADS, 0, part, n_heads, n_splits, dim, sinks, sinks_type, out);
        return;
    }
    (void)cuda_launch(be, "attention_combine_kernel", attention_combine_kernel, dim3((unsigned)n_heads, (unsigned)n),
                      ATT_THREADS, att_combine_smem(n_splits), part, n_splits, dim, sinks, sinks_type, out);
}

/* The combine's shared memory: the padded factors and the denominators. */
static size_t att_combine_smem(int64_t n_splits) {
    return (size_t)(att_padded_splits(n_splits) + n_splits) * sizeof(float);
}

/* As the CPU's cpu_has_dequant: a type with a dequantiser and whole blocks. */
static bool weight_has_dequant(const ds4_weight *w) {
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    return t && t->dequant_row && t->block_elems > 0 && w->ne[0] % t->block_elems == 0;
}

/* The shared-row kernel suits the shape (DS4_CUDA_ATT_MQA=0: never). */
static bool mqa_shape(int64_t n_heads, int64_t dim) {
    static const bool on = cuda_env_flag("DS4_CUDA_ATT_MQA", true);
    return on && dim == MQA_DIM && n_heads > 0 && n_heads % MQA_HG == 0;
}

/* The staged shared-row kernel (DS4_CUDA_ATT_STAGE=0: the one reading rows
 * from global memory) for queries and row bases of 16-byte aligned starts
 * (the rows, of MQA_DIM floats, then are too). */
static bool mqa_staged_on(void) {
    static const bool on = cuda_env_flag("DS4_CUDA_ATT_STAGE", true);
    return on;
}
static bool mqa_aligned(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* One launch of the shared-row kernel, staged or not. */
static bool mqa_launch(ds4_backend *be, bool staged, dim3 grid, const float *q, const att_rows &rows, int64_t n,
                       int64_t rows_per_split, float kq_scale, float *part, const att_view *views) {
    if (!staged)
        return cuda_launch(be, "attention_mqa_kernel", attention_mqa_kernel<false>, grid, ATT_THREADS, MQA_SMEM_PLAIN,
                           q, rows, n, rows_per_split, kq_scale, part, views);
    if (!cuda_allow_dynamic_smem(be, (const void *)attention_mqa_kernel<true>, MQA_SMEM_STAGED, "attention", MQA_DIM))
        return false;
    return cuda_launch(be, "attention_mqa_kernel", attention_mqa_kernel<true>, grid, ATT_THREADS, MQA_SMEM_STAGED, q,
                       rows, n, rows_per_split, kq_scale, part, views);
}

/* The sink logits as the kernels read them: the weight itself when
 * float-typed, else dequantised into `tail` (sinks->ne[0] floats of the
 * caller's scratch). false with the error recorded. */
static bool att_sink_values(ds4_backend *be, const ds4_weight *sinks, float *tail, const void **ptr, uint32_t *type) {
    *ptr = sinks->device;
    *type = sinks->type;
    if (cuda_is_float_type(sinks->type)) return true;
    if (!cuda_dequant_weight_rows(be, sinks->type, sinks->device, tail, 1, sinks->ne[0], "attention: sinks"))
        return false;
    *ptr = tail;
    *type = DS4_TYPE_F32;
    return true;
}

/* Splits of n rows for blocks_per_split blocks each: enough blocks to fill
 * the GPU, at least min_rows rows each, a whole number of tiles each. */
static void att_splits(int64_t n, int64_t blocks_per_split, int64_t min_rows, int64_t *n_splits, int64_t *per_split) {
    *n_splits = 0;
    *per_split = 0;
    if (n <= 0) return;
    const int64_t want = (ATT_TARGET_BLOCKS + blocks_per_split - 1) / blocks_per_split;
    const int64_t by_rows = (n + min_rows - 1) / min_rows;
    int64_t ns = want < by_rows ? want : by_rows;
    if (ns < 1) ns = 1;
    int64_t rps = (n + ns - 1) / ns;
    rps = (rps + ATT_TILE - 1) / ATT_TILE * ATT_TILE;
    *n_splits = (n + rps - 1) / rps;
    *per_split = rps;
}

void cuda_attention(ds4_backend *be, const float *q, int64_t n_heads, int64_t dim, const float *rows_a, int64_t n_a,
                    const float *rows_b, int64_t n_rows_b, const int32_t *idx_b, int64_t n_b,
                    const ds4_weight *sinks, float *out) {
    if (!sinks || !weight_has_dequant(sinks) || sinks->ne[0] < n_heads || n_heads < 0 || dim <= 0 || n_a < 0 ||
        n_b < 0) {
        cuda_fail(be, DS4_ERR_INVALID, "attention: %lld heads of %lld, %lld + %lld rows, sinks %s", (long long)n_heads,
                  (long long)dim, (long long)n_a, (long long)n_b, cuda_wname(sinks));
        return;
    }
    if (n_rows_b < 0 || (!idx_b && n_b > n_rows_b)) {
        cuda_fail(be, DS4_ERR_INVALID, "attention: the first %lld of %lld rows of rows_b (sinks %s)", (long long)n_b,
                  (long long)n_rows_b, cuda_wname(sinks));
        return;
    }
    if (n_heads == 0) return;
    if (!sinks->device) {
        cuda_fail(be, DS4_ERR_INVALID, "attention: sinks %s are not bound to the device", cuda_wname(sinks));
        return;
    }
    if (!cuda_is_float_type(sinks->type) && !ds4_cuda_dequant_supported(sinks->type)) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "attention: sinks %s have type %s, which the CUDA backend cannot read",
                  cuda_wname(sinks), ds4_type_name(sinks->type));
        return;
    }
    if (!q || !out || (n_a > 0 && !rows_a) || (n_b > 0 && !rows_b)) {
        cuda_fail(be, DS4_ERR_INVALID, "attention: NULL %s", !q ? "query" : !out ? "output" : "key/value rows");
        return;
    }
    if (n_heads > INT32_MAX) {
        cuda_fail(be, DS4_ERR_INVALID, "attention: %lld heads", (long long)n_heads);
        return;
    }
    if (cuda_failed(be)) return;

    /* splits: enough blocks to fill the GPU, at least ATT_MIN_ROWS rows each
     * (MQA_MIN_ROWS for the shared-row kernel, whose blocks take MQA_HG
     * heads), a whole number of tiles each */
    const bool mqa = mqa_shape(n_heads, dim);
    const int64_t n = n_a + n_b;
    int64_t n_splits, rows_per_split;
    att_splits(n, mqa ? n_heads / MQA_HG : n_heads, mqa ? MQA_MIN_ROWS : ATT_MIN_ROWS, &n_splits, &rows_per_split);
    const size_t part_floats = (size_t)n_heads * (size_t)n_splits * (size_t)(dim + 2);
    const bool sinks_float = cuda_is_float_type(sinks->type);
    const size_t sink_floats = sinks_float ? 0 : (size_t)sinks->ne[0];
    float *scratch = (float *)cuda_scratch(be, CUDA_SCRATCH_ATTN, (part_floats + sink_floats) * sizeof(float));
    if (!scratch) return;

    const void *sink_ptr;
    uint32_t sink_type;
    if (!att_sink_values(be, sinks, scratch + part_floats, &sink_ptr, &sink_type)) return;

    if (n > 0) {
        const size_t smem = 2 * (size_t)dim * sizeof(float);
        if (!cuda_allow_dynamic_smem(be, (const void *)attention_partial_kernel, smem, "attention", dim)) return;
        att_rows rows;
        memset(&rows, 0, sizeof rows); /* padding too: recorded steps compare argument bytes */
        rows.a = rows_a;
        rows.n_a = n_a;
        rows.b = rows_b;
        rows.n_rows_b = n_rows_b;
        rows.idx = n_b > 0 ? idx_b : NULL;
        rows.dim = dim;
        rows.err = cuda_dev_error_of(be);
        rows.tag = idx_b && n_b > 0 ? cuda_check_tag(be, sinks->name) : -1;
        const float kq_scale = 1.0f / sqrtf((float)dim); /* as the CPU computes it */
        if (mqa) {
            const dim3 grid((unsigned)(n_heads / MQA_HG), (unsigned)n_splits);
            const bool staged = mqa_staged_on() && mqa_aligned(q) && mqa_aligned(rows_a) && mqa_aligned(rows_b);
            if (!mqa_launch(be, staged, grid, q, rows, n, rows_per_split, kq_scale, scratch, (const att_view *)NULL))
                return;
        } else {
            const dim3 grid((unsigned)n_heads, (unsigned)n_splits);
            if (!cuda_launch(be, "attention_partial_kernel", attention_partial_kernel, grid, ATT_THREADS, smem, q,
                             rows, n, rows_per_split, kq_scale, scratch))
                return;
        }
    }
    (void)cuda_launch(be, "attention_combine_kernel", attention_combine_kernel, (unsigned)n_heads, ATT_THREADS,
                      att_combine_smem(n_splits), scratch, n_splits, dim, sink_ptr,
                      sink_type, out);
}

/* ------------------------------------------------------------------------ */
/* Prefill attention on the f16 tensor cores (attention_rows_f16)            */
/* ------------------------------------------------------------------------ */
/*
 * The rows of a prefill run (n > 1) under DS4 numerics, whose key/value rows
 * hold binary16 values (stored F16-rounded), for the model's shape (64 heads
 * of 512, MQA): a block takes one query row z and one split of its rows,
 * all 64 heads at once, so each key/value row is read once per query row
 * (the shared-row kernel reads it once per group of 8 heads) and its
 * products run on the tensor cores (mma m16n8k16, f16 x f16 -> f32):
 *   scores S = Q K^T (64 heads x 32 rows per tile, K = 512): the queries
 *     scaled by a power of two 2^s (their largest |q| in [2^14, 2^15), as
 *     split_f16_kernel scales) and split into two binary16 parts, hi =
 *     f16(q 2^s), lo = f16(q 2^s - hi) (22 of float's 24 bits); the rows
 *     are exact in binary16; each K = 32 stage summed from zero by the MMAs
 *     and added (rounded) to a float sum, then times 2^-s and the scale;
 *   the softmax of each head over the tile in float, as the shared-row
 *     kernel keeps it (running max, rescale, denominator; a warp per head,
 *     a lane per row, expf);
 *   O += P V (64 heads x 512, K = 32 rows of the tile): the weights split
 *     into hi and lo binary16 parts the same way (weights are in [0, 1]),
 *     the rows as above; each (head, 8 dims) tile's products of the tile
 *     summed from zero and added (rounded) to its float accumulator.
 * The partials (m, den, acc) of each (row, head, split) go to the combine
 * kernel as the shared-row kernel's do. Same precision class as the float
 * kernels (float sums in another order; the parts' 22 bits); test_cuda_
 * attention bounds it against the CPU.
 */
#define TC_HEADS 64
#define TC_DIM 512
#define TC_TILE 32                    /* key/value rows a tile */
#define TC_WARPS 8                    /* warps a block, the default form (DS4_CUDA_ATT_TC_WARPS=16: the other) */
#define TC_RPS 512                    /* rows a split takes (16 tiles) */
#define TC_QP (TC_DIM + 8)            /* halves between rows of Q and of the tile (ldmatrix: 8 rows 4 banks apart, all 32 banks) */
#define TC_PP (TC_TILE + 8)           /* halves between rows of P */
#define TC_SP (TC_TILE + 1)           /* floats between rows of S */
static_assert(TC_HEADS == 64 && TC_TILE == 32, "4 head tiles x 2 row halves (x 2 halves of K with 16 warps); a lane a row");

/* NW warps a block: 8 (255 registers) or 16 (at most 128 registers: twice
 * the warps an SM; each scores tile's K in two halves, summed in the
 * softmax, each warp a half as many heads and output dims) */
template <int NW> struct tc_smem {
    static constexpr size_t QH = 0;                                   /* half [64][TC_QP] */
    static constexpr size_t QL = QH + (size_t)TC_HEADS * TC_QP * 2;   /* half [64][TC_QP] */
    static constexpr size_t KV = QL + (size_t)TC_HEADS * TC_QP * 2;   /* half [32][TC_QP] */
    static constexpr size_t S = KV + (size_t)TC_TILE * TC_QP * 2;     /* float [NW / 8][64][TC_SP]: a K half's scores */
    static constexpr size_t PH = S + (size_t)(NW / 8) * TC_HEADS * TC_SP * 4; /* half [64][TC_PP] */
    static constexpr size_t PL = PH + (size_t)TC_HEADS * TC_PP * 2;   /* half [64][TC_PP] */
    static constexpr size_t RES = PL + (size_t)TC_HEADS * TC_PP * 2;  /* float [64]: the tile's rescale per head */
    static constexpr size_t OK = RES + TC_HEADS * 4;                  /* int [32]: row j of the tile weighs */
    static constexpr size_t RED = OK + TC_TILE * 4;                   /* float [NW]: the queries' max |q| per warp */
    static constexpr size_t STG = (RED + NW * 4 + 15) / 16 * 16;      /* float [16][TC_DIM]: half a tile's rows in flight */
    static constexpr size_t BYTES = STG + (size_t)(TC_TILE / 2) * TC_DIM * 4;
    static_assert(NW == 8 || NW == 16, "8 or 16 warps");
    static_assert(BYTES + 2 * TC_TILE * sizeof(void *) <= 227 * 1024, "one block per SM of an H100 / H200");
    static_assert(KV % 16 == 0 && PH % 16 == 0 && PL % 16 == 0, "ldmatrix rows 16-byte aligned");
};

template <int NW>
static __global__ void __launch_bounds__(32 * NW, 1)
    attention_tc_kernel(const float *__restrict__ q, att_rows rows, float kq_scale, float *__restrict__ part,
                        const att_view *__restrict__ views) {
    typedef tc_smem<NW> L;
    constexpr int TC_THREADS = 32 * NW;
    constexpr int HPW = TC_HEADS / NW; /* heads of the softmax a warp */
    constexpr int NB = TC_DIM / NW / 8; /* 8-dim output tiles a warp */
    constexpr int KH = TC_DIM / (NW / 8); /* the scores' K a warp */
    extern __shared__ __align__(16) uint8_t tc_sm[];
    __half *qh = (__half *)(tc_sm + L::QH), *ql = (__half *)(tc_sm + L::QL);
    __half *kv = (__half *)(tc_sm + L::KV);
    float *S = (float *)(tc_sm + L::S), *res = (float *)(tc_sm + L::RES), *red = (float *)(tc_sm + L::RED);
    __half *ph = (__half *)(tc_sm + L::PH), *pl = (__half *)(tc_sm + L::PL);
    int *ok = (int *)(tc_sm + L::OK);
    __shared__ const float *row_tile[2][TC_TILE];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int64_t split = blockIdx.x, n_splits = gridDim.x, z = blockIdx.y;
    cuda_grid_wait();
    const att_view v = views[z];
    rows.a = v.a;
    rows.b = v.b;
    rows.n_a = v.a_n;
    rows.n_rows_b = rows.idx ? v.b_bound : v.b_n;
    if (rows.idx) rows.idx += z * rows.idx_stride;
    const int64_t n = v.a_n + v.b_n;
    const int64_t r0 = split * v.rps, r1 = r0 + v.rps < n ? r0 + v.rps : n;
    const float *qz = q + z * TC_HEADS * TC_DIM;

    /* the queries: their largest |q|, the power of two, the two parts */
    float mx = 0.0f;
#pragma unroll 8 /* (eight 16-byte loads in flight a thread) */
    for (int i = tid; i < TC_HEADS * TC_DIM / 4; i += TC_THREADS) {
        const float4 x = ((const float4 *)qz)[i];
        mx = fmaxf(mx, fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)))); /* (drops NaNs) */
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = 0.0f;
    for (int w = 0; w < NW; w++) mx = fmaxf(mx, red[w]);
    const int sc = cuda_f16_split_scale(mx);
    const float unscale = ldexpf(1.0f, -sc);
#pragma unroll 8 /* (eight 16-byte loads in flight a thread) */
    for (int i = tid; i < TC_HEADS * TC_DIM / 4; i += TC_THREADS) {
        const float4 x = ((const float4 *)qz)[i];
        const int h = i / (TC_DIM / 4), d = 4 * (i % (TC_DIM / 4));
        const float xv[4] = { ldexpf(x.x, sc), ldexpf(x.y, sc), ldexpf(x.z, sc), ldexpf(x.w, sc) };
#pragma unroll
        for (int e = 0; e < 4; e++) cuda_f16_split(xv[e], qh[h * TC_QP + d + e], ql[h * TC_QP + d + e]);
    }

    /* warp w: scores of heads 16 (w & 3) .. + 15 x rows 16 ((w >> 2) & 1)
     * .. + 15 of the tile over K half w >> 3 (of one with 8 warps); the
     * softmax of heads HPW w .. + HPW - 1; the outputs of dims 8 NB w ..
     * + 8 NB - 1 of every head */
    const int mt = warp & 3, nh = (warp >> 2) & 1, kh = NW == 16 ? warp >> 3 : 0; /* (8 warps: K from 0, known here) */
    /* head HPW w + i's running max and denominator, in lanes HG i .. HG (i + 1) - 1 (cuda_warp_split's) */
    constexpr int HG = 32 / HPW;
    float m_l = -INFINITY, den_l = 0.0f;
    float acc[4][NB][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][b][c] = 0.0f;
    const unsigned s_qh = cuda_smem_addr(qh), s_ql = cuda_smem_addr(ql), s_kv = cuda_smem_addr(kv);
    const unsigned s_ph = cuda_smem_addr(ph), s_pl = cuda_smem_addr(pl);
    /* ldmatrix lanes: A rows (lane & 15) at k + (lane >> 4) 8; B (rows of the tile as n) rows
     * ((lane >> 4) << 3) + (lane & 7) at k + ((lane >> 3) & 1) 8; B transposed (V: k = rows of the
     * tile) rows ((lane >> 3) & 1) 8 + (lane & 7) at n + (lane >> 4) 8 */
    const int a_row = lane & 15, a_k = (lane >> 4) * 8;
    const int b_row = ((lane >> 4) << 3) + (lane & 7), b_k = ((lane >> 3) & 1) * 8;
    const int t_row = ((lane >> 3) & 1) * 8 + (lane & 7), t_n = (lane >> 4) * 8;

    /* A tile's rows come through the staging buffer in two halves of 16
     * rows (cp.async, a missing row zero-filled), each converted to binary16
     * into kv; the next tile's first half is in flight while this tile's
     * scores, softmax and outputs run, so a tile waits on one copy round
     * trip instead of four rounds of loads. row_tile[b]: the row pointers of
     * the tile of parity b (warp 0 makes them one tile ahead). */
    float *stg = (float *)(tc_sm + L::STG);
    const float *const zero_src = qz; /* (any valid address: a zero-filled copy reads nothing) */
    auto rows_of = [&](int64_t t, int b) {
        if (warp == 0) row_tile[b][lane] = t + lane < r1 ? att_row(rows, t + lane, true) : NULL;
    };
    auto issue_half = [&](int b, int h) {
#pragma unroll
        for (int it = 0; it < TC_TILE / 2 * (TC_DIM / 4) / TC_THREADS; it++) {
            const int p = tid + it * TC_THREADS, j = p / (TC_DIM / 4), c = 4 * (p % (TC_DIM / 4));
            const float *row = row_tile[b][TC_TILE / 2 * h + j];
            cp_async16(stg + j * TC_DIM + c, row ? row + c : zero_src, row != NULL);
        }
        cp_async_commit();
    };
    auto convert_half = [&](int h) {
#pragma unroll
        for (int it = 0; it < TC_TILE / 2 * (TC_DIM / 4) / TC_THREADS; it++) {
            const int p = tid + it * TC_THREADS, j = p / (TC_DIM / 4), c = 4 * (p % (TC_DIM / 4));
            const float4 x = *(const float4 *)(stg + j * TC_DIM + c);
            __half2 *dst = (__half2 *)(kv + (TC_TILE / 2 * h + j) * TC_QP + c);
            dst[0] = __floats2half2_rn(x.x, x.y);
            dst[1] = __floats2half2_rn(x.z, x.w);
        }
    };
    if (r0 < r1) {
        rows_of(r0, 0);
        __syncthreads();
        issue_half(0, 0);
    }
    int cur = 0;
    for (int64_t t0 = r0; t0 < r1; t0 += TC_TILE, cur ^= 1) {
        const bool next = t0 + TC_TILE < r1;
        cp_async_wait<0>();
        __syncthreads(); /* the first half is in; the previous tile's rows and weights are used up (and the queries are in) */
        if (warp == 0) ok[lane] = row_tile[cur][lane] != NULL;
        /* the tile's rows as binary16 (exact: DS4 numerics stores them so); a missing row is zeros */
        convert_half(0);
        __syncthreads(); /* the staging buffer is free */
        issue_half(cur, 1);
        if (next) rows_of(t0 + TC_TILE, cur ^ 1);
        cp_async_wait<0>();
        __syncthreads(); /* the second half is in; the next tile's row pointers are made */
        convert_half(1);
        __syncthreads(); /* the tile is in kv; the staging buffer is free */
        if (next) issue_half(cur ^ 1, 0);
        /* scores */
        {
            float s[2][4] = { { 0.0f, 0.0f, 0.0f, 0.0f }, { 0.0f, 0.0f, 0.0f, 0.0f } };
            for (int k0 = KH * kh; k0 < KH * kh + KH; k0 += 32) {
                float c[2][4] = { { 0.0f, 0.0f, 0.0f, 0.0f }, { 0.0f, 0.0f, 0.0f, 0.0f } };
#pragma unroll
                for (int kk = 0; kk < 32; kk += 16) {
                    uint32_t ah[4], al[4], b[4];
                    const unsigned qa = 2u * (unsigned)((16 * mt + a_row) * TC_QP + k0 + kk + a_k);
                    cuda_ldsm_x4(ah, s_qh + qa);
                    cuda_ldsm_x4(al, s_ql + qa);
                    cuda_ldsm_x4(b, s_kv + 2u * (unsigned)((16 * nh + b_row) * TC_QP + k0 + kk + b_k));
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        cuda_mma_f16(c[j], ah, b[2 * j], b[2 * j + 1]);
                        cuda_mma_f16(c[j], al, b[2 * j], b[2 * j + 1]);
                    }
                }
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) s[j][e] = __fadd_rn(s[j][e], c[j][e]);
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int h = 16 * mt + g + (e >= 2 ? 8 : 0), r = 16 * nh + 8 * j + 2 * tq + (e & 1);
                    S[(kh * TC_HEADS + h) * TC_SP + r] = s[j][e];
                }
        }
        __syncthreads();
        /* the softmax: warp w's heads, lane j row j */
        /* (the heads' maxima and sums by cuda_warp_split: the same bits as a
         * butterfly per head, in fewer shuffles; each head's max, rescale
         * and denominator made in its lanes, the new maxima shared) */
        {
            float sv[HPW], w[HPW];
#pragma unroll
            for (int i = 0; i < HPW; i++) {
                const int h = HPW * warp + i;
                sv[i] = S[h * TC_SP + lane];
                if (NW == 16) sv[i] += S[(TC_HEADS + h) * TC_SP + lane];
                sv[i] = ok[lane] ? sv[i] * unscale * kq_scale : -INFINITY; /* (a row past the range's end has no pointer) */
            }
            const float m_new = fmaxf(m_l, cuda_warp_split<HPW>(sv, cuda_max_op())); /* head lane / HG's */
            const float rescale = m_l == -INFINITY ? 0.0f : expf(m_l - m_new);
#pragma unroll
            for (int i = 0; i < HPW; i++) {
                const float m_i = __shfl_sync(0xffffffffu, m_new, HG * i);
                w[i] = sv[i] == -INFINITY ? 0.0f : expf(sv[i] - m_i);
                const int h = HPW * warp + i;
                cuda_f16_split(w[i], ph[h * TC_PP + lane], pl[h * TC_PP + lane]);
            }
            den_l = den_l * rescale + cuda_warp_split<HPW>(w, cuda_add_op());
            m_l = m_new;
            if (lane % HG == 0) res[HPW * warp + lane / HG] = rescale;
        }
        __syncthreads();
        /* O = O rescale + P V over the tile's rows */
#pragma unroll
        for (int a = 0; a < 4; a++) {
            const float ra = res[16 * a + g], rb = res[16 * a + g + 8];
#pragma unroll
            for (int b = 0; b < NB; b++) {
                acc[a][b][0] *= ra, acc[a][b][1] *= ra;
                acc[a][b][2] *= rb, acc[a][b][3] *= rb;
            }
        }
#pragma unroll
        for (int a = 0; a < 4; a++) {
            uint32_t ah[2][4], al[2][4];
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                const unsigned pa = 2u * (unsigned)((16 * a + a_row) * TC_PP + 16 * kk + a_k);
                cuda_ldsm_x4(ah[kk], s_ph + pa);
                cuda_ldsm_x4(al[kk], s_pl + pa);
            }
#pragma unroll
            for (int b2 = 0; b2 < NB / 2; b2++) { /* two 8-dim tiles a load */
                uint32_t bv[2][4];
#pragma unroll
                for (int kk = 0; kk < 2; kk++)
                    cuda_ldsm_x4_trans(bv[kk], s_kv + 2u * (unsigned)((16 * kk + t_row) * TC_QP + 8 * NB * warp + 16 * b2 + t_n));
#pragma unroll
                for (int jj = 0; jj < 2; jj++) {
                    float c[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
#pragma unroll
                    for (int kk = 0; kk < 2; kk++) {
                        cuda_mma_f16(c, ah[kk], bv[kk][2 * jj], bv[kk][2 * jj + 1]);
                        cuda_mma_f16(c, al[kk], bv[kk][2 * jj], bv[kk][2 * jj + 1]);
                    }
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[a][2 * b2 + jj][e] = __fadd_rn(acc[a][2 * b2 + jj][e], c[e]);
                }
            }
        }
    }
    /* the partials: (m, den) of warp w's heads, every thread's outputs */
    float *pz = part + z * TC_HEADS * n_splits * (TC_DIM + 2);
    if (lane % HG == 0) {
        float *o = pz + ((int64_t)(HPW * warp + lane / HG) * n_splits + split) * (TC_DIM + 2);
        o[0] = m_l;
        o[1] = den_l;
    }
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = 16 * a + g + (e >= 2 ? 8 : 0), d = 8 * NB * warp + 8 * b + 2 * tq + (e & 1);
                pz[((int64_t)h * n_splits + split) * (TC_DIM + 2) + 2 + d] = acc[a][b][e];
            }
}

/* The rows of a run: for the model's shape (dim 512, heads in groups of
 * 8) and more than one row, one launch of the shared-row kernel over all of
 * them (grid z = query row, each row's view uploaded as control data; every
 * row split as a launch of its own would split it, the grid as the row with
 * the most splits, so a shorter row's later splits are empty)
 * and one combine over all rows. Other shapes, and single rows (the decode
 * step), go through cuda_attention row by row. With idx (attention_rows_sel)
 * a query row reads the k rows of its selection, each below b_rows[r];
 * without, the first b_rows[r] rows (k is 0). */
/* Row r's rows: its window from a_of[r] (else rows_a + a_off[r] rows), its
 * compressed rows from b_of[r] (else rows_b). */
struct att_bases {
    const float *rows_a, *rows_b;
    const int64_t *a_off;
    const float *const *a_of, *const *b_of;
    int64_t dim;
    const float *a(int64_t r) const { return a_of ? a_of[r] : rows_a ? rows_a + a_off[r] * dim : NULL; }
    const float *b(int64_t r) const { return b_of ? b_of[r] : rows_b; }
};

/* attention_tc_kernel of NW warps over grid (n_splits, n) */
template <int NW>
static bool att_tc_launch(ds4_backend *be, int64_t n_splits, int64_t n, const float *q, const att_rows &rows,
                          float kq_scale, float *scratch, const att_view *views) {
    return cuda_allow_dynamic_smem(be, (const void *)attention_tc_kernel<NW>, tc_smem<NW>::BYTES,
                                   "attention (tensor cores)", TC_DIM) &&
           cuda_launch(be, "attention_tc_kernel", attention_tc_kernel<NW>, dim3((unsigned)n_splits, (unsigned)n),
                       32 * NW, tc_smem<NW>::BYTES, q, rows, kq_scale, scratch, views);
}

/* f16_rows: the rows hold binary16 values (attention_rows_f16), so the
 * tensor-core kernel may take a batch of the model's shape (64 heads of
 * 512; the backend's att_tc setting on). */
static void attention_rows_impl(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                                const att_bases &base, const int64_t *a_n, const int64_t *b_rows, const int32_t *idx,
                                int64_t k, const ds4_weight *sinks, float *out, bool f16_rows = false) {
    if (cuda_failed(be)) return;
    const auto b_count = [&](int64_t r) { return idx ? k : b_rows[r]; }; /* the rows row r reads from rows_b */
    bool have = true; /* every row's rows where it reads any */
    for (int64_t r = 0; r < n; r++) have &= (a_n[r] == 0 || base.a(r)) && (b_count(r) == 0 || base.b(r));
    const bool batched = n > 1 && n <= 65535 && mqa_shape(n_heads, dim) && sinks && sinks->device &&
                         weight_has_dequant(sinks) && sinks->ne[0] >= n_heads &&
                         (cuda_is_float_type(sinks->type) || ds4_cuda_dequant_supported(sinks->type)) && have;
    if (!batched) { /* (cuda_attention reports what does not suit) */
        for (int64_t r = 0; r < n && !cuda_failed(be); r++)
            cuda_attention(be, q + r * n_heads * dim, n_heads, dim, base.a(r), a_n[r], base.b(r), b_rows[r],
                           idx ? idx + r * k : NULL, b_count(r), sinks, out + r * n_heads * dim);
        return;
    }
    att_view *hv = (att_view *)malloc((size_t)n * sizeof *hv);
    if (!hv) {
        cuda_fail(be, DS4_ERR_NOMEM, "%s: out of memory for %lld views", base.a_of ? "attention_states" : "attention_rows",
                  (long long)n);
        return;
    }
    /* each row split as its own launch would split it (so its partials, and
     * its result, are the same bit for bit whatever rows share the batch);
     * the grid has the most splits, a row's later ones are empty (exact zeros
     * in the combine) */
    int64_t n_splits = 1;
    bool aligned = mqa_aligned(q); /* queries and every row base at 16-byte aligned starts */
    /* the tensor-core kernel: splits of TC_RPS rows (a row's own count decides them) */
    bool tc = f16_rows && cuda_impl(be)->att_tc && n_heads == TC_HEADS && dim == TC_DIM;
    for (int64_t r = 0; r < n; r++) {
        int64_t ns, rps;
        att_splits(a_n[r] + b_count(r), n_heads / MQA_HG, MQA_MIN_ROWS, &ns, &rps);
        if (ns < 1) rps = ATT_TILE; /* no rows: empty partials */
        if (ns > n_splits) n_splits = ns;
        hv[r] = att_view{ base.a(r), base.b(r), a_n[r], b_count(r), b_rows[r], rps };
        aligned = aligned && mqa_aligned(hv[r].a) && mqa_aligned(hv[r].b);
    }
    const bool staged = mqa_staged_on() && aligned;
    tc = tc && aligned;
    if (tc) {
        n_splits = 1;
        for (int64_t r = 0; r < n; r++) {
            const int64_t ns = (a_n[r] + b_count(r) + TC_RPS - 1) / TC_RPS;
            hv[r].rps = TC_RPS;
            if (ns > n_splits) n_splits = ns;
        }
    }
    const att_view *views = (const att_view *)cuda_upload_ctrl(be, CUDA_SCRATCH_ATTN_ROWS, hv, (size_t)n * sizeof *hv);
    free(hv);
    if (!views) return;
    const int64_t rows_per_split = ATT_TILE; /* (each view has its own) */
    const size_t part_floats = (size_t)n * (size_t)n_heads * (size_t)n_splits * (size_t)(dim + 2);
    const size_t sink_floats = cuda_is_float_type(sinks->type) ? 0 : (size_t)sinks->ne[0];
    float *scratch = (float *)cuda_scratch(be, CUDA_SCRATCH_ATTN, (part_floats + sink_floats) * sizeof(float));
    if (!scratch) return;
    const void *sink_ptr;
    uint32_t sink_type;
    if (!att_sink_values(be, sinks, scratch + part_floats, &sink_ptr, &sink_type)) return;
    att_rows rows;
    memset(&rows, 0, sizeof rows); /* padding too: recorded steps compare argument bytes (a, b: each view's) */
    rows.idx = idx && k > 0 ? idx : NULL;
    rows.idx_stride = k;
    rows.dim = dim;
    rows.err = cuda_dev_error_of(be);
    rows.tag = rows.idx ? cuda_check_tag(be, sinks->name) : -1;
    const float kq_scale = 1.0f / sqrtf((float)dim); /* as the CPU computes it */
    if (tc) {
        if (!(cuda_impl(be)->att_tc_warps == 16 ? att_tc_launch<16>(be, n_splits, n, q, rows, kq_scale, scratch, views)
                                                 : att_tc_launch<TC_WARPS>(be, n_splits, n, q, rows, kq_scale, scratch, views)))
            return;
        cuda_impl(be)->att_tc_calls++;
    } else {
        const dim3 grid((unsigned)(n_heads / MQA_HG), (unsigned)n_splits, (unsigned)n);
        /* (n 0: each view has its row's count; a constant keeps a recorded step's node unchanged) */
        if (!mqa_launch(be, staged, grid, q, rows, (int64_t)0, rows_per_split, kq_scale, scratch, views)) return;
    }
    att_combine_rows(be, scratch, n, n_heads, n_splits, dim, sink_ptr, sink_type, out);
}

/* attention_rows' and attention_rows_sel's arguments checked, their bases */
static bool rows_bases(ds4_backend *be, int64_t n, const float *q, const float *out, const float *rows_a,
                       const int64_t *a_off, const int64_t *a_n, const float *rows_b, const int64_t *b_rows,
                       int64_t dim, att_bases *base) {
    if (cuda_failed(be)) return false;
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (!ds4_attention_rows_valid(n, q, out, a_off, a_n, b_rows, &err)) {
        cuda_fail(be, err.status, "%s", err.message);
        return false;
    }
    *base = att_bases{ rows_a, rows_b, a_off, NULL, NULL, dim };
    return true;
}

void cuda_attention_rows(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                         const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                         const int64_t *b_n, const ds4_weight *sinks, float *out) {
    att_bases base;
    if (rows_bases(be, n, q, out, rows_a, a_off, a_n, rows_b, b_n, dim, &base))
        attention_rows_impl(be, q, n, n_heads, dim, base, a_n, b_n, NULL, 0, sinks, out);
}

void cuda_attention_states(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                           const float *const *rows_a, const int64_t *a_n, const float *const *rows_b,
                           const int64_t *b_n, const ds4_weight *sinks, float *out) {
    if (cuda_failed(be)) return;
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (!ds4_attention_states_valid(n, q, out, rows_a, a_n, rows_b, b_n, &err)) {
        cuda_fail(be, err.status, "%s", err.message);
        return;
    }
    const att_bases base{ NULL, NULL, NULL, rows_a, rows_b, dim };
    attention_rows_impl(be, q, n, n_heads, dim, base, a_n, b_n, NULL, 0, sinks, out);
}

/* attention_rows_sel and attention_rows_f16: the arguments checked (op names the op), then the rows */
static void attention_rows_sel_op(ds4_backend *be, const char *op, const float *q, int64_t n, int64_t n_heads,
                                  int64_t dim, const float *rows_a, const int64_t *a_off, const int64_t *a_n,
                                  const float *rows_b, const int64_t *b_rows, const int32_t *idx, int64_t k,
                                  const ds4_weight *sinks, float *out, bool f16_rows) {
    att_bases base;
    if (!rows_bases(be, n, q, out, rows_a, a_off, a_n, rows_b, b_rows, dim, &base)) return;
    if (k < 0 || (!idx && k > 0 && n > 0)) {
        cuda_fail(be, DS4_ERR_INVALID, "%s: %lld selected rows%s", op, (long long)k, k > 0 ? ", NULL" : "");
        return;
    }
    attention_rows_impl(be, q, n, n_heads, dim, base, a_n, b_rows, idx, idx ? k : 0, sinks, out, f16_rows);
}

void cuda_attention_rows_sel(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                             const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                             const int64_t *b_rows, const int32_t *idx, int64_t k, const ds4_weight *sinks,
                             float *out) {
    attention_rows_sel_op(be, "attention_rows_sel", q, n, n_heads, dim, rows_a, a_off, a_n, rows_b, b_rows, idx, k,
                          sinks, out, false);
}

void cuda_attention_rows_f16(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                             const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                             const int64_t *b_rows, const int32_t *idx, int64_t k, const ds4_weight *sinks,
                             float *out) {
    attention_rows_sel_op(be, "attention_rows_f16", q, n, n_heads, dim, rows_a, a_off, a_n, rows_b, b_rows, idx, k,
                          sinks, out, true);
}

/* ------------------------------------------------------------------------ */
/* Compressor pooling (spec 3.5.4)                                           */
/* ------------------------------------------------------------------------ */

/* One thread per output dim j, the CPU's loop: max over the candidates, then
 * den and sum in candidate order (ratio 4: pairs (row r, lane A), (row 4 + r,
 * lane B)); all -inf gives 0. */
static __global__ void __launch_bounds__(POOL_THREADS)
    compressor_pool_kernel(const float *__restrict__ kv, const float *__restrict__ sc, int ratio, int64_t dim,
                           float *__restrict__ out, const uint64_t *__restrict__ states, int64_t n_states) {
    cuda_grid_wait();
    const bool overlap = ratio == 4;
    const int64_t width = overlap ? 2 * dim : dim;
    if (states) { /* window blockIdx.y: the rows of its own state (compressor_pool_states) */
        kv = (const float *)states[blockIdx.y];
        sc = (const float *)states[n_states + blockIdx.y];
    } else { /* window blockIdx.y: its rows from blockIdx.y * ratio on */
        kv += (int64_t)blockIdx.y * ratio * width;
        sc += (int64_t)blockIdx.y * ratio * width;
    }
    out += (int64_t)blockIdx.y * dim;
    for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < dim; j += (int64_t)gridDim.x * blockDim.x) {
        float m = -INFINITY;
        for (int r = 0; r < ratio; r++) {
            const float s = sc[r * width + j];
            if (s > m) m = s;
            if (overlap) {
                const float sb = sc[(ratio + r) * width + dim + j];
                if (sb > m) m = sb;
            }
        }
        if (m == -INFINITY) {
            out[j] = 0.0f;
            continue;
        }
        float den = 0.0f, sum = 0.0f;
        for (int r = 0; r < ratio; r++) {
            const float wa = expf(__fsub_rn(sc[r * width + j], m));
            if (overlap) {
                const int64_t b = (ratio + r) * width + dim + j;
                const float wb = expf(__fsub_rn(sc[b], m));
                den = __fadd_rn(den, __fadd_rn(wa, wb));
                sum = __fadd_rn(sum, __fmul_rn(wa, kv[r * width + j]));
                sum = __fadd_rn(sum, __fmul_rn(wb, kv[b]));
            } else {
                den = __fadd_rn(den, wa);
                sum = __fadd_rn(sum, __fmul_rn(wa, kv[r * width + j]));
            }
        }
        out[j] = __fdiv_rn(sum, den);
    }
}

void cuda_compressor_pool(ds4_backend *be, const float *state_kv, const float *state_score, int ratio, int64_t dim,
                          int64_t n_windows, float *out) {
    if (ratio < 1 || dim <= 0 || n_windows < 0 || n_windows > 65535) {
        cuda_fail(be, DS4_ERR_INVALID, "compressor_pool: ratio %d, dim %lld, %lld windows", ratio, (long long)dim,
                  (long long)n_windows);
        return;
    }
    if (n_windows == 0) return;
    if (!state_kv || !state_score || !out) {
        cuda_fail(be, DS4_ERR_INVALID, "compressor_pool: NULL %s",
                  !state_kv ? "state" : !state_score ? "scores" : "output");
        return;
    }
    if (cuda_failed(be)) return;
    (void)cuda_launch(be, "compressor_pool_kernel", compressor_pool_kernel,
                      dim3(blocks_for(dim, POOL_THREADS, 65535), (unsigned)n_windows), POOL_THREADS, 0, state_kv,
                      state_score, ratio, dim, out, (const uint64_t *)NULL, (int64_t)0);
}

void cuda_compressor_pool_states(ds4_backend *be, const float *const *state_kv, const float *const *state_score,
                                 int ratio, int64_t dim, int64_t n, float *out) {
    if (cuda_failed(be)) return;
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (ratio < 1 || dim <= 0 || n > 65535 || (n > 0 && !out))
        ds4_error_set(&err, DS4_ERR_INVALID, "compressor_pool_states: ratio %d, dim %lld%s", ratio, (long long)dim,
                      n > 0 && !out ? ", no output" : n > 65535 ? ", too many windows" : "");
    else ds4_pointer_pairs_valid("compressor_pool_states", "window", (const void *const *)state_kv, "state",
                                 (const void *const *)state_score, "scores", n, &err);
    if (err.status) {
        cuda_fail(be, err.status, "%s", err.message);
        return;
    }
    if (n == 0) return;
    const uint64_t *table = cuda_upload_pointer_pairs(be, CUDA_SCRATCH_POOL_STATES, (const void *const *)state_kv,
                                                      (const void *const *)state_score, n, "compressor_pool_states");
    if (!table) return;
    (void)cuda_launch(be, "compressor_pool_kernel", compressor_pool_kernel,
                      dim3(blocks_for(dim, POOL_THREADS, 65535), (unsigned)n), POOL_THREADS, 0, (const float *)NULL,
                      (const float *)NULL, ratio, dim, out, table, n);
}

/* ------------------------------------------------------------------------ */
/* Indexer (spec 3.6)                                                        */
/* ------------------------------------------------------------------------ */

/*
 * score[c] = sum over heads, in order, of relu(q_h . key_c) * w_h, w_h =
 * weights[h] * weight_scale (one float rounding, as the CPU). One warp
 * per key: KPL > 0 keeps the key in registers (lane holds dims lane + 32 j,
 * j < KPL; dim <= 32 * KPL), KPL == 0 reads it from memory (L1) per head.
 * QSHARED stages q [n_heads, dim] and the head weights in shared memory.
 *
 * KEYS = IDX_KEYS (KPL > 0): a warp takes IDX_KEYS keys at once, so each
 * query element read from shared memory serves IDX_KEYS keys, and the
 * IDX_HEAD_BATCH x IDX_KEYS dots of a head batch are reduced together by
 * cuda_warp_split (31 shuffles for 32 dots instead of 160): each lane's
 * partial sums are the one-key form's (the same dims in the same fmaf
 * order) and each dot's tree the same, so every score is the same bits.
 * Dot (b, k) ends in lane IDX_KEYS b + k, which forms its term; lane k
 * (and its copies k + IDX_KEYS j) gathers key k's terms in head order.
 */
#define IDX_KEYS 4
static_assert(IDX_HEAD_BATCH * IDX_KEYS == 32, "a head batch's dots: one a lane");
template <int KPL, bool QSHARED, int KEYS>
static __global__ void __launch_bounds__(IDX_THREADS)
    indexer_scores_kernel(const float *__restrict__ q, const float *__restrict__ weights, float weight_scale,
                          int64_t n_heads, int64_t dim, const float *__restrict__ keys, int64_t n_keys,
                          float *__restrict__ scores, const int64_t *__restrict__ row_keys, int64_t stride,
                          bool q_vec) {
    cuda_grid_wait();
    extern __shared__ float4 idx_smem[];
    if (row_keys) { /* query row blockIdx.y of indexer_scores_rows, its own key count */
        const int64_t y = blockIdx.y;
        n_keys = row_keys[y];
        q += y * n_heads * dim;
        weights += y * n_heads;
        scores += y * stride;
    }
    const float *qv = q, *wv = weights;
    if constexpr (QSHARED) {
        float *qs = (float *)idx_smem, *ws = qs + n_heads * dim;
        if (q_vec) { /* the queries' 16-byte pieces all in flight at once */
            for (int64_t i = threadIdx.x; i < n_heads * dim / 4; i += IDX_THREADS)
                cp_async16(idx_smem + i, (const float4 *)q + i, true);
            cp_async_commit();
        } else {
            for (int64_t i = threadIdx.x; i < n_heads * dim; i += IDX_THREADS) qs[i] = q[i];
        }
        for (int64_t i = threadIdx.x; i < n_heads; i += IDX_THREADS) ws[i] = weights[i];
        if (q_vec) cp_async_wait<0>();
        __syncthreads();
        qv = qs;
        wv = ws;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if constexpr (KEYS > 1) {
        static_assert(KEYS == IDX_KEYS && KPL > 0, "the several-key form: IDX_KEYS keys in registers");
        const int my = lane % KEYS; /* the key whose terms this lane gathers */
        for (int64_t c0 = ((int64_t)blockIdx.x * IDX_WARPS + warp) * KEYS; c0 < n_keys;
             c0 += (int64_t)gridDim.x * IDX_WARPS * KEYS) {
            float kr[KEYS][KPL];
#pragma unroll
            for (int k = 0; k < KEYS; k++) {
                const float *key = keys + (c0 + k) * dim;
#pragma unroll
                for (int j = 0; j < KPL; j++) {
                    const int64_t i = lane + 32 * j;
                    kr[k][j] = c0 + k < n_keys && i < dim ? key[i] : 0.0f;
                }
            }
            float s = 0.0f;
            for (int64_t h0 = 0; h0 < n_heads; h0 += IDX_HEAD_BATCH) {
                float d[IDX_HEAD_BATCH * KEYS];
#pragma unroll
                for (int b = 0; b < IDX_HEAD_BATCH; b++) {
                    const int64_t h = h0 + b < n_heads ? h0 + b : n_heads - 1; /* (a repeat, not added) */
                    const float *qh = qv + h * dim;
#pragma unroll
                    for (int k = 0; k < KEYS; k++) d[KEYS * b + k] = 0.0f;
#pragma unroll
                    for (int j = 0; j < KPL; j++) {
                        const int64_t i = lane + 32 * j;
                        if (i < dim) {
                            const float qi = qh[i];
#pragma unroll
                            for (int k = 0; k < KEYS; k++) d[KEYS * b + k] = fmaf(qi, kr[k][j], d[KEYS * b + k]);
                        }
                    }
                }
                /* lane l: dot (b, k) = (l / KEYS, l % KEYS), and its term */
                const float dot = cuda_warp_split(d, cuda_add_op());
                const int64_t hl = h0 + lane / KEYS;
                const float t = dot < 0.0f ? 0.0f : dot;
                const float term = hl < n_heads ? __fmul_rn(t, __fmul_rn(wv[hl], weight_scale)) : 0.0f;
#pragma unroll
                for (int b = 0; b < IDX_HEAD_BATCH; b++) {
                    const float tb = __shfl_sync(0xffffffffu, term, KEYS * b + my);
                    if (h0 + b < n_heads) s = __fadd_rn(s, tb);
                }
            }
            if (lane < KEYS && c0 + lane < n_keys) scores[c0 + lane] = s;
        }
    } else {
        for (int64_t c = (int64_t)blockIdx.x * IDX_WARPS + warp; c < n_keys; c += (int64_t)gridDim.x * IDX_WARPS) {
            const float *key = keys + c * dim;
            float kr[KPL > 0 ? KPL : 1];
            if constexpr (KPL > 0) {
#pragma unroll
                for (int j = 0; j < KPL; j++) {
                    const int64_t i = lane + 32 * j;
                    kr[j] = i < dim ? key[i] : 0.0f;
                }
            }
            /* IDX_HEAD_BATCH heads' dots and warp trees side by side, then their
             * terms added to s in head order */
            float s = 0.0f;
            for (int64_t h0 = 0; h0 < n_heads; h0 += IDX_HEAD_BATCH) {
                float d[IDX_HEAD_BATCH];
#pragma unroll
                for (int b = 0; b < IDX_HEAD_BATCH; b++) {
                    const int64_t h = h0 + b < n_heads ? h0 + b : n_heads - 1; /* (a repeat, not added) */
                    const float *qh = qv + h * dim;
                    d[b] = 0.0f;
                    if constexpr (KPL > 0) {
#pragma unroll
                        for (int j = 0; j < KPL; j++) {
                            const int64_t i = lane + 32 * j;
                            if (i < dim) d[b] = fmaf(qh[i], kr[j], d[b]);
                        }
                    } else {
                        for (int64_t i = lane; i < dim; i += 32) d[b] = fmaf(qh[i], key[i], d[b]);
                    }
                }
#pragma unroll
                for (int b = 0; b < IDX_HEAD_BATCH; b++) d[b] = warp_sum(d[b]);
#pragma unroll
                for (int b = 0; b < IDX_HEAD_BATCH; b++)
                    if (h0 + b < n_heads) {
                        const float t = d[b] < 0.0f ? 0.0f : d[b];
                        s = __fadd_rn(s, __fmul_rn(t, __fmul_rn(wv[h0 + b], weight_scale)));
                    }
            }
            if (lane == 0) scores[c] = s;
        }
    }
}

/* n_keys: the most keys of a row; with row_keys (device), n_rows rows
 * (grid y), row y with row_keys[y] keys. */
template <int KPL, int KEYS = 1>
static void indexer_launch(ds4_backend *be, bool qshared, const float *q, const float *weights, float weight_scale,
                           int64_t n_heads, int64_t dim, const float *keys, int64_t n_keys, float *scores,
                           const int64_t *row_keys, int64_t n_rows, int64_t stride) {
    const dim3 grid(blocks_for((n_keys + KEYS - 1) / KEYS, IDX_WARPS, IDX_MAX_BLOCKS), (unsigned)n_rows);
    /* the queries staged in 16-byte pieces where every row's start is 16-byte aligned */
    const bool q_vec = ((uintptr_t)q & 15) == 0 && (n_heads * dim) % 4 == 0;
    if (qshared) {
        const size_t smem = (size_t)(n_heads * dim + n_heads) * sizeof(float);
        (void)cuda_launch(be, "indexer_scores_kernel", indexer_scores_kernel<KPL, true, KEYS>, grid, IDX_THREADS, smem,
                          q, weights, weight_scale, n_heads, dim, keys, n_keys, scores, row_keys, stride, q_vec);
    } else {
        (void)cuda_launch(be, "indexer_scores_kernel", indexer_scores_kernel<KPL, false, KEYS>, grid, IDX_THREADS, 0,
                          q, weights, weight_scale, n_heads, dim, keys, n_keys, scores, row_keys, stride, false);
    }
}

static void indexer_dispatch(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                             int64_t n_heads, int64_t dim, const float *keys, int64_t n_keys, float *scores,
                             const int64_t *row_keys, int64_t n_rows, int64_t stride) {
    const bool qshared = (n_heads * dim + n_heads) * (int64_t)sizeof(float) + CUDA_SMEM_STATIC_RESERVE <= CUDA_SMEM_DEFAULT;
    /* a prefill's rows: IDX_KEYS keys a warp (one query row keeps a warp a key, the most warps for its latency) */
    if (dim <= 128 && n_rows > 1 && cuda_impl(be)->idx_keys == IDX_KEYS) {
        indexer_launch<4, IDX_KEYS>(be, qshared, q, weights, weight_scale, n_heads, dim, keys, n_keys, scores,
                                    row_keys, n_rows, stride);
        cuda_impl(be)->idx_keys_calls++;
    } else if (dim <= 128)
        indexer_launch<4>(be, qshared, q, weights, weight_scale, n_heads, dim, keys, n_keys, scores, row_keys, n_rows,
                          stride);
    else if (dim <= 512)
        indexer_launch<16>(be, qshared, q, weights, weight_scale, n_heads, dim, keys, n_keys, scores, row_keys, n_rows,
                           stride);
    else
        indexer_launch<0>(be, qshared, q, weights, weight_scale, n_heads, dim, keys, n_keys, scores, row_keys, n_rows,
                          stride);
}

/*
 * indexer_scores_rows_f16 on the f16 tensor cores: a prefill's selecting
 * rows under DS4 numerics, whose queries and keys hold binary16 values (the
 * indexer QAT's FP4 values times powers of two; the keys F16-rounded as
 * well). A block takes IDXT_ROWS query rows against IDXT_WARPS x 32 keys.
 * A warp holds its 32 keys in registers as mma B fragments (binary16, dims
 * past dim and keys past n_keys zero) and, row by row, multiplies the row's
 * heads (A: binary16 in shared memory, 16 heads an m-tile, ldmatrix) by
 * them (mma m16n8k16, f16 x f16 -> f32). The products of binary16 values
 * are exact, and the MMAs' sums are exact wherever every partial sum of a
 * dot's terms is (all terms multiples of the smallest one's unit, their
 * magnitudes' sum within 2^24 of it: a QAT'd row's four block scales are
 * powers of two a few apart, so in practice always; PTX leaves the MMA's
 * accumulation unspecified, so this rests on sm_90's exact adds of
 * what fits, which test_indexer_rows_f16 checks on the device), where the
 * float kernel's sums are exact too: each dot is then the float kernel's. Then relu times the head
 * weight (rounded once, as the CPU) and the sum over heads in head order:
 * an m-tile's 16 x 32 terms go through shared memory to the lane of their
 * key, which adds them to its score in order. The next row's queries come
 * into registers while a row's products run. Values that are not binary16
 * are rounded to it (as DS4's CUDA prefill casts them).
 */
#define IDXT_THREADS 256
#define IDXT_WARPS (IDXT_THREADS / 32)
#define IDXT_KEYS 32                  /* keys a warp: 4 n-tiles of 8 */
#define IDXT_ROWS 8                   /* query rows a block */
#define IDXT_DIM 128                  /* dims at most: 8 k-steps of 16 */
#define IDXT_HEADS 64                 /* heads at most: 4 m-tiles of 16 */
#define IDXT_QSTRIDE (IDXT_DIM + 8)   /* halves between staged heads (ldmatrix: 8 rows 4 banks apart, all 32 banks) */
#define IDXT_TSTRIDE 20               /* floats between a term tile's keys (stores and 16-byte reads conflict-free) */
#define IDXT_QF4 (IDXT_HEADS * IDXT_DIM / 4 / IDXT_THREADS) /* a query row's 16-byte pieces a thread, at most */

static __device__ __forceinline__ uint32_t idxt_half2(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    uint32_t u;
    memcpy(&u, &h, sizeof u);
    return u;
}

static __global__ void __launch_bounds__(IDXT_THREADS)
    indexer_tc_kernel(const float *__restrict__ q, const float *__restrict__ weights, float weight_scale, int n_heads,
                      int dim, const float *__restrict__ keys, int64_t n_keys, float *__restrict__ scores,
                      const int64_t *__restrict__ row_keys, int64_t n_rows, int64_t stride) {
    __shared__ __align__(16) __half qs[IDXT_HEADS * IDXT_QSTRIDE];
    __shared__ __align__(16) float ts[IDXT_WARPS][IDXT_KEYS * IDXT_TSTRIDE];
    __shared__ float ws[IDXT_HEADS];
    cuda_grid_wait();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int64_t r0 = (int64_t)blockIdx.y * IDXT_ROWS, r1 = r0 + IDXT_ROWS < n_rows ? r0 + IDXT_ROWS : n_rows;
    const int64_t kb = (int64_t)blockIdx.x * IDXT_WARPS * IDXT_KEYS, c0 = kb + warp * IDXT_KEYS;
    /* a block none of whose rows reaches its keys has nothing to do */
    if (!__syncthreads_or(tid < r1 - r0 && row_keys[r0 + tid] > kb)) return;
    for (int i = tid; i < IDXT_HEADS * IDXT_QSTRIDE / 8; i += IDXT_THREADS) ((uint4 *)qs)[i] = make_uint4(0, 0, 0, 0);
    if (tid < IDXT_HEADS) ws[tid] = 0.0f;

    /* the warp's keys: B fragment (k-step s, n-tile j) = key c0 + 8 j + g, dims 16 s + 2 tq (+1) and + 8 */
    const int n_mt = (n_heads + 15) / 16;
    uint32_t kf[IDXT_DIM / 16][4][2];
#pragma unroll
    for (int s = 0; s < IDXT_DIM / 16; s++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int64_t c = c0 + 8 * j + g;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int d = 16 * s + 8 * e + 2 * tq;
                float2 v = make_float2(0.0f, 0.0f);
                if (c < n_keys && d < dim) v = *(const float2 *)(keys + c * dim + d); /* (dim even: d + 1 < dim too) */
                kf[s][j][e] = idxt_half2(v.x, v.y);
            }
        }

    /* a query row's pieces (dim a multiple of 4: a piece in one head) into
     * registers, then as binary16 into qs */
    const int pieces = n_heads * dim / 4;
    float4 qp[IDXT_QF4];
    float wp = 0.0f;
    auto load_row = [&](int64_t r) {
        const float4 *qr = (const float4 *)(q + r * n_heads * dim);
#pragma unroll
        for (int i = 0; i < IDXT_QF4; i++) {
            const int p = tid + i * IDXT_THREADS;
            if (p < pieces) qp[i] = qr[p];
        }
        if (tid < n_heads) wp = weights[r * n_heads + tid];
    };
    auto store_row = [&]() {
#pragma unroll
        for (int i = 0; i < IDXT_QF4; i++) {
            const int p = tid + i * IDXT_THREADS;
            if (p < pieces) {
                const float4 x = qp[i];
                const int h = 4 * p / dim, d = 4 * p - h * dim;
                uint2 v;
                v.x = idxt_half2(x.x, x.y);
                v.y = idxt_half2(x.z, x.w);
                *(uint2 *)(qs + h * IDXT_QSTRIDE + d) = v;
            }
        }
        if (tid < n_heads) ws[tid] = __fmul_rn(wp, weight_scale);
    };
    const unsigned s_q = cuda_smem_addr(qs);
    const int a_row = lane & 15, a_k = (lane >> 4) * 8; /* ldmatrix lanes: A rows and k offsets */
    float *tw = ts[warp];
    load_row(r0);
    for (int64_t r = r0; r < r1; r++) {
        __syncthreads(); /* the previous row's queries and weights are used up */
        store_row();
        __syncthreads();
        if (r + 1 < r1) load_row(r + 1);
        const int64_t nk = row_keys[r];
        if (c0 >= nk) continue; /* (warp-uniform) */
        float sc = 0.0f; /* the score of key c0 + lane */
        for (int mt = 0; mt < n_mt; mt++) {
            float acc[4][4];
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[j][e] = 0.0f;
            /* every k-step, also past dim: the padding is zeros on both sides (an exact 0 added) */
#pragma unroll
            for (int s = 0; s < IDXT_DIM / 16; s++) {
                uint32_t a[4];
                cuda_ldsm_x4(a, s_q + 2u * (unsigned)((16 * mt + a_row) * IDXT_QSTRIDE + 16 * s + a_k));
#pragma unroll
                for (int j = 0; j < 4; j++) cuda_mma_f16(acc[j], a, kf[s][j][0], kf[s][j][1]);
            }
            /* terms: acc[j][e] is head 16 mt + g (+ 8 for e >= 2), key 8 j + 2 tq + (e & 1) */
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int hl = g + (e >= 2 ? 8 : 0), key = 8 * j + 2 * tq + (e & 1);
                    const float d = acc[j][e] < 0.0f ? 0.0f : acc[j][e];
                    tw[key * IDXT_TSTRIDE + hl] = __fmul_rn(d, ws[16 * mt + hl]);
                }
            __syncwarp();
            const int nh = n_heads - 16 * mt < 16 ? n_heads - 16 * mt : 16;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float4 v = *(const float4 *)(tw + lane * IDXT_TSTRIDE + 4 * i);
                if (4 * i < nh) sc = __fadd_rn(sc, v.x);
                if (4 * i + 1 < nh) sc = __fadd_rn(sc, v.y);
                if (4 * i + 2 < nh) sc = __fadd_rn(sc, v.z);
                if (4 * i + 3 < nh) sc = __fadd_rn(sc, v.w);
            }
            __syncwarp();
        }
        if (c0 + lane < nk) scores[r * stride + c0 + lane] = sc;
    }
}

/* Whether indexer_tc_kernel takes these rows: the sizes it holds, a query
 * row's pieces 16-byte aligned, the keys' float pairs 8-byte aligned. */
static bool indexer_tc_fits(const float *q, const float *keys, int64_t n_heads, int64_t dim) {
    return n_heads >= 1 && n_heads <= IDXT_HEADS && dim >= 4 && dim <= IDXT_DIM && dim % 4 == 0 &&
           ((uintptr_t)q & 15) == 0 && ((uintptr_t)keys & 7) == 0;
}

void cuda_indexer_scores(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                         int64_t n_heads, int64_t dim, const float *keys, int64_t n_keys, float *scores) {
    if (n_heads < 0 || dim < 0 || n_keys < 0) {
        cuda_fail(be, DS4_ERR_INVALID, "indexer_scores: %lld heads of %lld, %lld keys", (long long)n_heads,
                  (long long)dim, (long long)n_keys);
        return;
    }
    if (n_keys == 0) return;
    if (!scores || (dim > 0 && !keys) || (n_heads > 0 && (!weights || (dim > 0 && !q)))) {
        cuda_fail(be, DS4_ERR_INVALID, "indexer_scores: NULL %s",
                  !scores ? "scores" : (dim > 0 && !keys) ? "keys" : !weights ? "weights" : "query");
        return;
    }
    if (cuda_failed(be)) return;
    indexer_dispatch(be, q, weights, weight_scale, n_heads, dim, keys, n_keys, scores, NULL, 1, 0);
}

/* indexer_scores_rows' and indexer_scores_rows_f16's arguments checked
 * (op names the op) and each row's key count uploaded: the device counts,
 * the most keys of a row in *most; NULL when refused or nothing to do. */
static const int64_t *indexer_rows_args(ds4_backend *be, const char *op, const float *q, const float *weights,
                                        int64_t n_heads, int64_t dim, const float *keys, const int64_t *n_keys,
                                        int64_t n_rows, const float *scores, int64_t stride, int64_t *most) {
    if (cuda_failed(be)) return NULL;
    if (n_rows < 0 || n_rows > 65535 || n_heads < 0 || dim < 0 || (n_rows > 0 && !n_keys)) {
        cuda_fail(be, DS4_ERR_INVALID, "%s: %lld rows of %lld heads of %lld", op, (long long)n_rows,
                  (long long)n_heads, (long long)dim);
        return NULL;
    }
    *most = 0;
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (!ds4_row_counts_valid(op, "keys", n_keys, n_rows, stride, most, &err)) {
        cuda_fail(be, err.status, "%s", err.message);
        return NULL;
    }
    if (*most == 0) return NULL;
    if (!scores || (dim > 0 && !keys) || (n_heads > 0 && (!weights || (dim > 0 && !q)))) {
        cuda_fail(be, DS4_ERR_INVALID, "%s: NULL %s", op,
                  !scores ? "scores" : (dim > 0 && !keys) ? "keys" : !weights ? "weights" : "query");
        return NULL;
    }
    return (const int64_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_IDX_ROWS, n_keys, (size_t)n_rows * sizeof(int64_t));
}

/* All rows in one launch (grid y = row, each row's key count uploaded as
 * control data; blocks for the longest row, the others' extra warps idle). */
void cuda_indexer_scores_rows(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                              int64_t n_heads, int64_t dim, const float *keys, const int64_t *n_keys, int64_t n_rows,
                              float *scores, int64_t stride) {
    int64_t most = 0;
    const int64_t *d_keys = indexer_rows_args(be, "indexer_scores_rows", q, weights, n_heads, dim, keys, n_keys,
                                              n_rows, scores, stride, &most);
    if (!d_keys) return;
    indexer_dispatch(be, q, weights, weight_scale, n_heads, dim, keys, most, scores, d_keys, n_rows, stride);
}

/* The same for binary16 queries and keys: on the tensor cores where the
 * kernel holds the sizes (indexer_tc_kernel: blocks of IDXT_ROWS rows x
 * IDXT_WARPS x 32 keys), else (or with DS4_CUDA_IDX_TC=0) the float kernels. */
void cuda_indexer_scores_rows_f16(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                                  int64_t n_heads, int64_t dim, const float *keys, const int64_t *n_keys,
                                  int64_t n_rows, float *scores, int64_t stride) {
    int64_t most = 0;
    const int64_t *d_keys = indexer_rows_args(be, "indexer_scores_rows_f16", q, weights, n_heads, dim, keys, n_keys,
                                              n_rows, scores, stride, &most);
    if (!d_keys) return;
    cuda_backend *cb = cuda_impl(be);
    if (!cb->idx_tc || !indexer_tc_fits(q, keys, n_heads, dim)) {
        indexer_dispatch(be, q, weights, weight_scale, n_heads, dim, keys, most, scores, d_keys, n_rows, stride);
        return;
    }
    const dim3 grid(blocks_for(most, IDXT_WARPS * IDXT_KEYS, INT32_MAX), (unsigned)((n_rows + IDXT_ROWS - 1) / IDXT_ROWS));
    if (cuda_launch(be, "indexer_tc_kernel", indexer_tc_kernel, grid, IDXT_THREADS, 0, q, weights, weight_scale,
                    (int)n_heads, (int)dim, keys, most, scores, d_keys, n_rows, stride))
        cb->idx_tc_calls++;
}

/* ------------------------------------------------------------------------ */
/* Top-k                                                                     */
/* ------------------------------------------------------------------------ */

/*
 * key_i = ordered(score_i) << shift | (n - 1 - i), shift = bits of n - 1.
 * ordered() maps float bits to an unsigned integer that increases with the
 * value (negative: all bits flipped; positive: the sign bit set), after NaN ->
 * -inf and -0 -> +0, so a descending order of the keys is the CPU's rank
 * order (higher score first, then the lower index) and every key is
 * distinct (and non-zero: ordered() of -inf is 0x007fffff).
 */
/* The bits of n - 1: the index part of a key (host and device). */
static __host__ __device__ __forceinline__ int topk_shift(int64_t n) {
    int shift = 0;
    while (shift < 32 && ((uint64_t)(n - 1) >> shift) != 0) shift++;
    return shift;
}

static __device__ __forceinline__ unsigned long long topk_key(const float *scores, int64_t i, int64_t n, int shift) {
    uint32_t u = __float_as_uint(scores[i]);
    if ((u & 0x7fffffffu) > 0x7f800000u) u = 0xff800000u; /* NaN ranks as -inf */
    if ((u & 0x7fffffffu) == 0u) u = 0u;                  /* -0 ties with +0 */
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << shift) | (unsigned long long)(n - 1 - i);
}

static __global__ void __launch_bounds__(TOPK_THREADS)
    topk_keys_kernel(const float *__restrict__ scores, int64_t n, int shift, unsigned long long *__restrict__ keys) {
    cuda_grid_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        keys[i] = topk_key(scores, i, n, shift);
}

/* idx[i] = the index in sorted key i for i < size, -1 for size <= i < k
 * (sorted may be NULL when size is 0). */
static __global__ void __launch_bounds__(TOPK_THREADS)
    topk_idx_kernel(const unsigned long long *__restrict__ sorted, int64_t n, int64_t size, int64_t k,
                    unsigned long long mask, int32_t *__restrict__ idx) {
    cuda_grid_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < k; i += (int64_t)gridDim.x * blockDim.x)
        idx[i] = i < size ? (int32_t)(n - 1 - (int64_t)(sorted[i] & mask)) : -1;
}

/*
 * Top-k in one block, for size = min(k, n) up to TOPK_SELECT_MAX. A row of
 * at most TOPK_SORT_ALL keys (the indexer's at contexts up to 16K) is
 * sorted whole in shared memory. A longer one first has its size-th largest
 * key found by a radix select (8 bits a pass, from the top: each pass counts
 * the keys that match the digits fixed so far, digit by digit, and one warp
 * finds the digit where the count from the top reaches the rank still
 * wanted); the keys at or above it are exactly the top `size` (keys are
 * distinct), gathered into shared memory and sorted. Either way the first
 * `size` keys in descending order: the same list. One launch whatever n
 * is, with nothing on the host that depends on the scores (a recorded step
 * can replay it).
 */
#define TOPK_SELECT_THREADS 1024
#define TOPK_SELECT_MAX 4096
#define TOPK_SORT_ALL 4096

static __host__ __device__ __forceinline__ int topk_pow2(int64_t n) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}

/* sel[0 .. P) (P a power of two) in descending order, by the block's
 * threads: a bitonic network. A stage pairs i with i + j; for j <= 32 the
 * 32 pairs a warp takes lie in one aligned run of 64 keys, its own in the
 * stage after too while that one's j <= 32, so between two such stages a
 * warp barrier does (the block's only where a stage reaches past the run). */
static __device__ __forceinline__ void topk_bitonic_desc(unsigned long long *sel, int P) {
    const int tid = threadIdx.x, nt = blockDim.x, half = P >> 1;
    for (int len = 2; len <= P; len <<= 1) {
        for (int j = len >> 1; j > 0; j >>= 1) {
            for (int q = tid; q < half; q += nt) {
                const int i = ((q & ~(j - 1)) << 1) | (q & (j - 1)), o = i + j;
                const unsigned long long a = sel[i], b = sel[o];
                if ((i & len) == 0 ? a < b : a > b) {
                    sel[i] = b;
                    sel[o] = a;
                }
            }
            /* the next stage's j: j / 2, or the next length's first (len); none after the last */
            const int next = j > 1 ? j >> 1 : len < P ? len : 1 << 30;
            if (j <= 32 && next <= 32) __syncwarp();
            else __syncthreads();
        }
    }
}

static __global__ void __launch_bounds__(TOPK_SELECT_THREADS)
    topk_select_kernel(const float *__restrict__ scores, int64_t n, int shift, int64_t size, int64_t k, int pow2,
                       int32_t *__restrict__ idx, const int64_t *__restrict__ row_n, int64_t stride, int whole_max) {
    cuda_grid_wait();
    if (row_n) { /* row blockIdx.x of top_k_rows: its own count, shift and size (pow2 covers every row's) */
        const int64_t y = blockIdx.x;
        n = row_n[y];
        scores += y * stride;
        idx += y * k;
        shift = topk_shift(n);
        size = k < n ? k : n;
        if (size == 0) {
            for (int64_t i = threadIdx.x; i < k; i += blockDim.x) idx[i] = -1;
            return;
        }
    }
    extern __shared__ unsigned long long sel[]; /* pow2 >= size keys (>= n when the row is sorted whole) */
    __shared__ unsigned int hist[256];
    __shared__ unsigned long long prefix, pmask;
    __shared__ long long rank; /* rank still wanted among the keys matching prefix */
    __shared__ unsigned int count;
    const int tid = threadIdx.x, nt = blockDim.x;
    const int whole = n <= whole_max && topk_pow2(n) <= pow2 ? topk_pow2(n) : 0;
    if (whole) {
        for (int i = tid; i < whole; i += nt) sel[i] = i < n ? topk_key(scores, i, n, shift) : 0ull;
        __syncthreads();
        topk_bitonic_desc(sel, whole);
    } else {
        if (tid == 0) {
            prefix = 0;
            pmask = 0;
            rank = size;
            count = 0;
        }
        __syncthreads();
        const int bits = 32 + shift;
        for (int d = ((bits - 1) / 8) * 8; d >= 0; d -= 8) {
            for (int i = tid; i < 256; i += nt) hist[i] = 0;
            __syncthreads();
            const unsigned long long pf = prefix, pm = pmask;
            for (int64_t i = tid; i < n; i += nt) {
                const unsigned long long key = topk_key(scores, i, n, shift);
                if ((key & pm) == pf) atomicAdd(&hist[(key >> d) & 255u], 1u);
            }
            __syncthreads();
            if (tid < 32) {
                /* lane l: digits 255 - 8l .. 248 - 8l; the lane whose share
                 * of the count from the top holds the rank fixes the digit */
                const long long r0 = rank;
                unsigned int c[8], own = 0;
#pragma unroll
                for (int q = 0; q < 8; q++) own += c[q] = hist[255 - 8 * tid - q];
                unsigned int incl = own;
                for (int o = 1; o < 32; o <<= 1) {
                    const unsigned int t = __shfl_up_sync(0xffffffffu, incl, o);
                    if (tid >= o) incl += t;
                }
                const long long above = (long long)(incl - own);
                __syncwarp(); /* every lane has read rank before one lane writes it */
                if (above < r0 && r0 <= (long long)incl) {
                    long long r = r0 - above;
                    int b = 248 - 8 * tid;
                    for (int q = 0; q < 8; q++) {
                        if ((long long)c[q] >= r) {
                            b = 255 - 8 * tid - q;
                            break;
                        }
                        r -= c[q];
                    }
                    rank = r;
                    prefix = pf | ((unsigned long long)b << d);
                    pmask = pm | (255ull << d);
                }
            }
            __syncthreads();
        }
        const unsigned long long threshold = prefix;
        for (int64_t i = tid; i < n; i += nt) {
            const unsigned long long key = topk_key(scores, i, n, shift);
            if (key >= threshold) {
                const unsigned int at = atomicAdd(&count, 1u);
                if (at < (unsigned)pow2) sel[at] = key;
            }
        }
        __syncthreads();
        for (int i = (int)size + tid; i < pow2; i += nt) sel[i] = 0; /* below every key */
        __syncthreads();
        topk_bitonic_desc(sel, pow2);
    }
    const unsigned long long mask = shift ? (1ull << shift) - 1ull : 0ull;
    for (int64_t i = tid; i < k; i += nt) idx[i] = i < size ? (int32_t)(n - 1 - (int64_t)(sel[i] & mask)) : -1;
}

/*
 * Top-k by rank, for rows of at most TOPK_RANK_MAX keys (a decoded token's
 * indexer selection: 512 of about n / 4 compressed rows): every block of a
 * row (grid x) loads the row's n keys into shared memory, and each thread
 * counts, for the key it owns, the keys above it. Keys are distinct, so
 * that count is the key's place in the descending order, and a key whose
 * place is below size writes its index there: the sorted list without a
 * sort, each slot written once, the blocks independent. Block 0 of the
 * row writes the -1 of places size .. k. Rows: grid y (row_n, stride, as
 * topk_select_kernel; NULL row_n: one row of n).
 */
#define TOPK_RANK_THREADS 64
#define TOPK_RANK_MAX 4096

static __global__ void __launch_bounds__(TOPK_RANK_THREADS)
    topk_rank_kernel(const float *__restrict__ scores, int64_t n, int64_t k, int32_t *__restrict__ idx,
                     const int64_t *__restrict__ row_n, int64_t stride) {
    cuda_grid_wait();
    if (row_n) {
        const int64_t y = blockIdx.y;
        n = row_n[y];
        scores += y * stride;
        idx += y * k;
    }
    const int shift = topk_shift(n);
    const int64_t size = k < n ? k : n;
    if (blockIdx.x == 0)
        for (int64_t i = size + threadIdx.x; i < k; i += blockDim.x) idx[i] = -1;
    const int64_t mine = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if ((int64_t)blockIdx.x * blockDim.x >= n) return; /* (a shorter row of the launch) */
    extern __shared__ unsigned long long keys[]; /* the row's n keys, then a 0 to even them */
    const int nn = (int)n, even = (nn + 1) & ~1;
    for (int i = threadIdx.x; i < even; i += blockDim.x) keys[i] = i < nn ? topk_key(scores, i, n, shift) : 0ull;
    __syncthreads();
    if (mine >= n) return;
    const unsigned long long key = keys[mine];
    int above = 0;
    const ulonglong2 *pairs = (const ulonglong2 *)keys;
#pragma unroll 4
    for (int i = 0; i < even / 2; i++) { /* every lane reads the same pair: a broadcast */
        const ulonglong2 two = pairs[i];
        above += (two.x > key) + (two.y > key);
    }
    if (above < size) idx[above] = (int32_t)(n - 1 - (int64_t)(key & ((1ull << shift) - 1ull)));
}

/* DS4_CUDA_TOPK_RANK=0: rows of up to TOPK_RANK_MAX keys through
 * topk_select_kernel instead (A/B; tests compare the paths). */
static bool topk_rank_on(void) {
    static const bool on = cuda_env_flag("DS4_CUDA_TOPK_RANK", true);
    return on;
}
/* The most keys of a top_k_rows call (a prefill's selecting rows) that the
 * rank kernel takes (its work grows as the square of a row's keys, the
 * select kernel's about linearly): 1,024 (a 16K prefill 1.068x faster than
 * with TOPK_RANK_MAX, H100); DS4_CUDA_TOPK_RANK_ROWS=N for an A/B. */
#define TOPK_RANK_ROWS 1024
static int64_t topk_rank_rows_max(void) {
    static const int64_t most = cuda_env_long("DS4_CUDA_TOPK_RANK_ROWS", TOPK_RANK_ROWS, 0, TOPK_RANK_MAX);
    return most;
}

/*
 * k = 1 (the greedy token of a logits row): the largest key, idx[0] its
 * index (the first maximum, NaN as -inf, as the keys rank), idx[1..k) = -1
 * (n = 1 < k). Two launches: TOPK_MAX_BLOCKS blocks each find the largest
 * key of their stride of the row, then one block the largest of those (a
 * maximum of distinct keys: the same whatever the split).
 */
#define TOPK_MAX_THREADS 256
#define TOPK_MAX_BLOCKS 128

static __device__ __forceinline__ unsigned long long block_max_u64(unsigned long long v, unsigned long long *red) {
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long u = __shfl_xor_sync(0xffffffffu, v, o);
        v = u > v ? u : v;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) v = red[w] > v ? red[w] : v;
    return v;
}

static __global__ void __launch_bounds__(TOPK_MAX_THREADS)
    topk_max_kernel(const float *__restrict__ scores, int64_t n, int shift, unsigned long long *__restrict__ part) {
    cuda_grid_wait();
    __shared__ unsigned long long red[TOPK_MAX_THREADS / 32];
    unsigned long long best = 0; /* below every key */
    for (int64_t i = blockIdx.x * (int64_t)TOPK_MAX_THREADS + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * TOPK_MAX_THREADS) {
        const unsigned long long key = topk_key(scores, i, n, shift);
        best = key > best ? key : best;
    }
    best = block_max_u64(best, red);
    if (threadIdx.x == 0) part[blockIdx.x] = best;
}

static __global__ void __launch_bounds__(TOPK_MAX_THREADS)
    topk_max_final_kernel(const unsigned long long *__restrict__ part, int n_part, int64_t n, int shift, int64_t k,
                          int32_t *__restrict__ idx) {
    cuda_grid_wait();
    __shared__ unsigned long long red[TOPK_MAX_THREADS / 32];
    unsigned long long best = 0;
    for (int b = threadIdx.x; b < n_part; b += TOPK_MAX_THREADS) best = part[b] > best ? part[b] : best;
    best = block_max_u64(best, red);
    if (threadIdx.x == 0) idx[0] = (int32_t)(n - 1 - (int64_t)(best & ((1ull << shift) - 1ull)));
    for (int64_t i = 1 + threadIdx.x; i < k; i += TOPK_MAX_THREADS) idx[i] = -1;
}

/* The longest row topk_select_kernel sorts whole: TOPK_SORT_ALL, or with
 * DS4_CUDA_TOPK_WHOLE=0 none (every row through the radix select; A/B). */
static int topk_whole_max(void) {
    static const bool whole = cuda_env_flag("DS4_CUDA_TOPK_WHOLE", true);
    return whole ? TOPK_SORT_ALL : 0;
}

/* DS4_CUDA_TOPK_SORT=1: every top-k through the device-wide sort (tests
 * compare the two paths). */
static bool topk_sort_forced(void) {
    static const bool forced = cuda_env_flag("DS4_CUDA_TOPK_SORT", false);
    return forced;
}

void cuda_top_k(ds4_backend *be, const float *scores, int64_t n, int64_t k, int32_t *idx) {
    if (n < 0 || k < 0 || n > INT32_MAX) {
        cuda_fail(be, DS4_ERR_INVALID, "top_k: %lld of %lld", (long long)k, (long long)n);
        return;
    }
    if (k == 0) return;
    if (!idx || (n > 0 && !scores)) {
        cuda_fail(be, DS4_ERR_INVALID, "top_k: NULL %s", !idx ? "index output" : "scores");
        return;
    }
    if (cuda_failed(be)) return;
    const int64_t size = k < n ? k : n;
    if (size == 0) { /* nothing to sort: k entries of -1 */
        (void)cuda_launch(be, "topk_idx_kernel", topk_idx_kernel, blocks_for(k, TOPK_THREADS, 65535), TOPK_THREADS, 0,
                          (const unsigned long long *)NULL, n, (int64_t)0, k, 0ull, idx);
        return;
    }
    const int shift = topk_shift(n);
    if (size == 1 && !topk_sort_forced()) {
        const unsigned nb = blocks_for(n, TOPK_MAX_THREADS * 4, TOPK_MAX_BLOCKS);
        unsigned long long *part = (unsigned long long *)cuda_scratch(
            be, CUDA_SCRATCH_TOPK_B, (size_t)TOPK_MAX_BLOCKS * sizeof(unsigned long long));
        if (!part ||
            !cuda_launch(be, "topk_max_kernel", topk_max_kernel, nb, TOPK_MAX_THREADS, 0, scores, n, shift, part))
            return;
        (void)cuda_launch(be, "topk_max_final_kernel", topk_max_final_kernel, 1, TOPK_MAX_THREADS, 0,
                          (const unsigned long long *)part, (int)nb, n, shift, k, idx);
        return;
    }
    if (n <= TOPK_RANK_MAX && topk_rank_on() && !topk_sort_forced()) {
        const unsigned nb = (unsigned)((n + TOPK_RANK_THREADS - 1) / TOPK_RANK_THREADS);
        (void)cuda_launch(be, "topk_rank_kernel", topk_rank_kernel, nb, TOPK_RANK_THREADS,
                          (size_t)((n + 1) & ~1) * sizeof(unsigned long long), scores, n, k, idx,
                          (const int64_t *)NULL, (int64_t)0);
        return;
    }
    if (size <= TOPK_SELECT_MAX && !topk_sort_forced()) {
        const int wmax = topk_whole_max();
        const int pow2 = topk_pow2(n <= wmax ? n : size); /* (a row sorted whole, or the selected keys) */
        (void)cuda_launch(be, "topk_select_kernel", topk_select_kernel, 1, TOPK_SELECT_THREADS,
                          (size_t)pow2 * sizeof(unsigned long long), scores, n, shift, size, k, pow2, idx,
                          (const int64_t *)NULL, (int64_t)0, wmax);
        return;
    }
    /* larger k: a device-wide radix sort of all n keys (CUB launches on its
     * own, so a recorded step is submitted first) */
    cuda_step_break(be, "top_k: the device-wide sort");
    cudaStream_t stream = cuda_stream(be);
    const unsigned long long mask = (1ull << shift) - 1ull;
    unsigned long long *keys =
        (unsigned long long *)cuda_scratch(be, CUDA_SCRATCH_TOPK_A, (size_t)n * sizeof(unsigned long long));
    unsigned long long *sorted =
        (unsigned long long *)cuda_scratch(be, CUDA_SCRATCH_TOPK_B, (size_t)n * sizeof(unsigned long long));
    if (!keys || !sorted) return;
    size_t temp_bytes = 0;
    if (!CUDA_OK(be, cub::DeviceRadixSort::SortKeysDescending(NULL, temp_bytes, keys, sorted, (int)n, 0, 32 + shift,
                                                              stream)))
        return;
    void *temp = cuda_scratch(be, CUDA_SCRATCH_TOPK_D, temp_bytes);
    if (!temp) return;
    if (!cuda_launch(be, "topk_keys_kernel", topk_keys_kernel, blocks_for(n, TOPK_THREADS, 65535), TOPK_THREADS, 0,
                     scores, n, shift, keys))
        return;
    cuda_impl(be)->counters.launches++; /* the sort (several kernels, counted as one) */
    if (!CUDA_OK(be, cub::DeviceRadixSort::SortKeysDescending(temp, temp_bytes, keys, sorted, (int)n, 0, 32 + shift,
                                                              stream)))
        return;
    (void)cuda_launch(be, "topk_idx_kernel", topk_idx_kernel, blocks_for(k, TOPK_THREADS, 65535), TOPK_THREADS, 0,
                      (const unsigned long long *)sorted, n, size, k, mask, idx);
}

/* Every row in one launch of the one-block select (block = row) when
 * 1 < k <= TOPK_SELECT_MAX (the indexer's top-k); otherwise row by row. */
void cuda_top_k_rows(ds4_backend *be, const float *scores, int64_t stride, const int64_t *n, int64_t n_rows, int64_t k,
                     int32_t *idx) {
    if (cuda_failed(be)) return;
    if (n_rows < 0 || k < 0 || (n_rows > 0 && !n)) {
        cuda_fail(be, DS4_ERR_INVALID, "top_k_rows: %lld rows, k %lld", (long long)n_rows, (long long)k);
        return;
    }
    int64_t most = 0;
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (!ds4_row_counts_valid("top_k_rows", "scores", n, n_rows, stride, &most, &err)) {
        cuda_fail(be, err.status, "%s", err.message);
        return;
    }
    if (most > INT32_MAX) { /* (as top_k refuses it) */
        cuda_fail(be, DS4_ERR_INVALID, "top_k_rows: a row of %lld scores", (long long)most);
        return;
    }
    if (k == 0 || n_rows == 0) return;
    if (k == 1 || k > TOPK_SELECT_MAX || n_rows > INT32_MAX || topk_sort_forced()) {
        for (int64_t r = 0; r < n_rows && !cuda_failed(be); r++)
            cuda_top_k(be, scores + r * stride, n[r], k, idx + r * k);
        return;
    }
    if (!idx || (most > 0 && !scores)) {
        cuda_fail(be, DS4_ERR_INVALID, "top_k_rows: NULL %s", !idx ? "index output" : "scores");
        return;
    }
    const int64_t size = k < most ? k : most;
    if (most <= topk_rank_rows_max() && most > 0 && n_rows <= 65535 && topk_rank_on()) {
        const int64_t *d_n =
            (const int64_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_IDX_ROWS, n, (size_t)n_rows * sizeof(int64_t));
        if (!d_n) return;
        const dim3 grid((unsigned)((most + TOPK_RANK_THREADS - 1) / TOPK_RANK_THREADS), (unsigned)n_rows);
        (void)cuda_launch(be, "topk_rank_kernel", topk_rank_kernel, grid, TOPK_RANK_THREADS,
                          (size_t)((most + 1) & ~1) * sizeof(unsigned long long), scores, most, k, idx, d_n,
                          stride);
        return;
    }
    /* room for each row's selection and for the longest row sorted whole */
    const int wmax = topk_whole_max();
    int64_t whole = 0;
    for (int64_t r = 0; r < n_rows; r++)
        if (n[r] <= wmax && n[r] > whole) whole = n[r];
    const int pow2 = topk_pow2(whole > size ? whole : size);
    const int64_t *d_n =
        (const int64_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_IDX_ROWS, n, (size_t)n_rows * sizeof(int64_t));
    if (!d_n) return;
    (void)cuda_launch(be, "topk_select_kernel", topk_select_kernel, (unsigned)n_rows, TOPK_SELECT_THREADS,
                      (size_t)pow2 * sizeof(unsigned long long), scores, most, 0, size, k, pow2, idx, d_n, stride,
                      wmax);
}

/*
 * cuda_matvec.cu - decode-shaped weight products (1 to 8 activation rows)
 * under DS4 numerics, built to stream the weights at memory bandwidth.
 *
 * Why a separate family: in decode every weight byte is read once per token
 * and the products are bandwidth-bound. The general kernels of
 * cuda_matmul.cu read each quantised block with byte-sized loads straight
 * into the lanes that decode it; here each warp instead streams its weight
 * rows through a ring of MV_NST stages in shared memory with 16-byte
 * cp.async copies (32 lanes x 16 B = 512 contiguous bytes per instruction;
 * two stages of 2,176 bytes in flight while the third is decoded), then
 * decodes from shared memory, where the odd block sizes (34, 66, 84 bytes)
 * cost nothing.
 *
 * Arithmetic is that of cuda_matmul.cu's DS4 kinds, block for block:
 *   float weights (F32/F16/BF16): float products and float sums (per-lane
 *     fmaf chains, then a fixed butterfly and the parts in order);
 *   Q8_0 weights: DS4's Q8_0 activation blocks (codes and scales of a row
 *     apart, see cuda_matvec.h); per 32-block the exact int8 dot (one lane
 *     per block), then the CPU's block term (f16(w.d) * x.d) * isum;
 *   Q2_K, Q4_K, IQ2_XXS, Q8_K weights: Q8_K activations; four 256-blocks per
 *     warp step, 32 elements per lane; per block the exact integer sums over
 *     its eight lanes (sum_j sc_j isub_j, sum_j m_j bsum_j, the latter from
 *     the activation's bsums) and the CPU's float block term.
 * So each block term is the CPU's bit for bit and only the order of the
 * float sum over blocks differs (the same freedom the general kernels take).
 *
 * Layout: a weight row is cut into P parts (P warps per output; for small
 * outputs P > 1 splits the row so enough warps are in flight), a part into
 * stages of whole "units" (the fewest blocks whose bytes are a multiple of
 * 16, so every stage starts 16-byte aligned). When a warp holds whole rows
 * (P = 1, or the expert-summing MoE down product, whose parts are the
 * experts) it streams rpw consecutive rows back to back, so short rows keep
 * stages in flight; a thread block holds 8 / P warps' rows (rpb * rpw
 * outputs). Partial sums meet in shared memory in part order, so results
 * are deterministic.
 *
 * IQ2_XXS decodes through a table in shared memory: per grid entry a word
 * of eight 4-bit codes (0..2). Bit 2 of nibble j set where weight j is
 * negative (two multiplies spread the 7 sign bits and their parity there)
 * then selects, per weight, one of the bytes 8, 25, 43, -8, -25, -43 of two
 * constant words: two byte permutes give the eight signed codes. (A 4-byte
 * entry costs a warp's random lookups about three wavefronts, bank
 * conflicts included, against about six for 8-byte magnitudes; a second
 * table for the sign nibbles saved instructions but measured no faster,
 * the L1 then bound the kernel.)
 */
#include <stdint.h>
#include <string.h>

#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/cuda_hc_comb.cuh"
#include "backends/cuda/cuda_matvec.h"
#include "backends/cuda/cuda_quant.cuh"
#include "backends/cuda/cuda_rope.cuh"

#define MV_STAGE 2176 /* bytes of one stage (64 Q8_0 blocks: two full warp steps) */
#define MV_NST 3       /* stages per warp: one decoded while the others are in flight */
#define MV_COPIES ((MV_STAGE / 16 + 31) / 32) /* 16-byte copies per lane for a stage */
#define MV_WARPS 8
/* split rows until this many warps are in flight (4096 -> 1024 measured:
 * decode at 2K 1.012x, CI 1.004 .. 1.020; it halves the splits of q_a + kv,
 * the router and the compressors, whose grids then fit about one wave) */
#define MV_TARGET_WARPS 1024
#define MV_MAX_RPW 8         /* rows per warp (short rows: a warp streams several) */
/* give warps more rows only while at least this many remain (8192 -> 2048
 * measured: decode 1.035x; q_b, o_a, o_b 13.6 / 17.7 / 16.4 -> 12.2 / 14.3
 * / 14.8 us at one row, 37.2 / 44.9 / 45.5 -> 37.3 / 36.1 / 37.7 at 8) */
#define MV_MIN_WARPS 2048
#define MV_MIN_WARPS_MOE 1024 /* the same for the routed experts' products (measured: 52.2 -> 49.3 us at one row) */
static_assert(MV_WARPS * MV_MAX_RPW * CUDA_MV_MAX_ROWS * sizeof(float) <= CUDA_SMEM_STATIC_RESERVE,
              "the per-row sums (static shared memory) fit the reserve cuda_allow_dynamic_smem assumes");
#define FULL_MASK 0xffffffffu

/* DS4's Q8_0 activation block (as in cuda_matmul.cu). */
struct mv_q8_0 {
    float d;
    int8_t q[32];
};
static_assert(sizeof(mv_q8_0) == 36, "q8_0 activation block size");

/* ------------------------------------------------------------------------ */
/* Per-type geometry                                                         */
/* ------------------------------------------------------------------------ */

/* BLOCK_BYTES / BLOCK_ELEMS of a decode block (for float types: a chunk of
 * 8 elements), UNIT = blocks per 16-byte-aligned unit, STAGE_UNITS = units
 * per stage. */
template <uint32_t T> struct mvt;
#define MVT(T, BB, BE, NU)                                                      \
    template <> struct mvt<T> {                                                 \
        static constexpr int BLOCK_BYTES = BB, BLOCK_ELEMS = BE, UNIT = NU;     \
        static constexpr int UNIT_BYTES = BB * NU;                              \
        static constexpr int STAGE_UNITS = MV_STAGE / UNIT_BYTES;               \
        static_assert(UNIT_BYTES % 16 == 0 && STAGE_UNITS >= 1, "unit layout"); \
    };
MVT(DS4_TYPE_F32, 32, 8, 1)
MVT(DS4_TYPE_F16, 16, 8, 1)
MVT(DS4_TYPE_BF16, 16, 8, 1)
MVT(DS4_TYPE_Q8_0, 34, 32, 8)
MVT(DS4_TYPE_Q2_K, 84, 256, 4)
MVT(DS4_TYPE_Q4_K, 144, 256, 1)
MVT(DS4_TYPE_IQ2_XXS, 66, 256, 8)
MVT(DS4_TYPE_Q8_K, 292, 256, 4)
#undef MVT

static int unit_bytes_of(uint32_t type) {
    switch (type) {
    case DS4_TYPE_F32: return mvt<DS4_TYPE_F32>::UNIT_BYTES;
    case DS4_TYPE_F16: return mvt<DS4_TYPE_F16>::UNIT_BYTES;
    case DS4_TYPE_BF16: return mvt<DS4_TYPE_BF16>::UNIT_BYTES;
    case DS4_TYPE_Q8_0: return mvt<DS4_TYPE_Q8_0>::UNIT_BYTES;
    case DS4_TYPE_Q2_K: return mvt<DS4_TYPE_Q2_K>::UNIT_BYTES;
    case DS4_TYPE_Q4_K: return mvt<DS4_TYPE_Q4_K>::UNIT_BYTES;
    case DS4_TYPE_IQ2_XXS: return mvt<DS4_TYPE_IQ2_XXS>::UNIT_BYTES;
    case DS4_TYPE_Q8_K: return mvt<DS4_TYPE_Q8_K>::UNIT_BYTES;
    default: return 0;
    }
}

/* blocks per unit of the packable types (mv_pack), else 0 */
static int unit_blocks_of(uint32_t type) {
    switch (type) {
    case DS4_TYPE_Q8_0: return mvt<DS4_TYPE_Q8_0>::UNIT;
    case DS4_TYPE_Q2_K: return mvt<DS4_TYPE_Q2_K>::UNIT;
    case DS4_TYPE_IQ2_XXS: return mvt<DS4_TYPE_IQ2_XXS>::UNIT;
    default: return 0;
    }
}

static constexpr __host__ __device__ bool mv_float(uint32_t t) {
    return t == DS4_TYPE_F32 || t == DS4_TYPE_F16 || t == DS4_TYPE_BF16;
}

static cuda_mv_act act_kind_for(uint32_t type) {
    if (cuda_is_float_type(type)) return CUDA_MV_FLOAT;
    return type == DS4_TYPE_Q8_0 ? CUDA_MV_Q8_0 : CUDA_MV_Q8_K;
}

bool cuda_mv_fits(uint32_t type, cuda_mv_act act_kind, int64_t row_bytes, int64_t n) {
    const int ub = unit_bytes_of(type);
    if (!ub || act_kind != act_kind_for(type) || n <= 0 || row_bytes <= 0) return false;
    return row_bytes % ub == 0;
}

/* ------------------------------------------------------------------------ */
/* IQ2_XXS tables                                                            */
/* ------------------------------------------------------------------------ */

/* The signed codes by selector nibble: 0, 1, 2 the magnitudes 8, 25, 43
 * (bytes 0..2 of the first word), 4, 5, 6 their negations (of the second). */
#define IQ2_POS 0x002b1908u
#define IQ2_NEG 0x00d5e7f8u

struct iq2_tables {
    uint32_t nib[256]; /* grid entry -> its 8 codes (0..2), weight j in bits 4j .. 4j + 3 */
    uint32_t pos[4];   /* IQ2_POS, then padding (see iq2_ref) */
};

static constexpr iq2_tables make_iq2_tables() {
    iq2_tables t{};
    for (int g = 0; g < 256; g++) {
        const uint32_t packed = ds4_iq2xxs_host::ds4_iq2xxs_grid_packed[g];
        for (int j = 0; j < 8; j++) t.nib[g] |= ((packed >> (2 * j)) & 3u) << (4 * j);
    }
    t.pos[0] = IQ2_POS;
    return t;
}

/* the bytes of (lo, hi) that the four selector nibbles of sel's low half
 * pick (PTX prmt; __byte_perm would first mask each nibble to its 3 low
 * bits, which the selectors never exceed) */
static __device__ __forceinline__ uint32_t prmt_bytes(uint32_t lo, uint32_t hi, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sel));
    return r;
}
/* The tables in shared memory, with IQ2_POS as read from them: a value
 * the compiler keeps in a register (a constant, one of a byte permute's
 * two data words, would be moved into a register before every use). */
struct iq2_ref {
    const iq2_tables *t;
    uint32_t pos;
};
/* bit 4j + 2 set where weight j is negative: bit j of the 7 low bits of
 * s7 for j < 7, their parity (bit 0 of popc, the count of the 7) for
 * j = 7. The even bits, and the odd ones, go to their places in one
 * multiply each: copies 6 apart, where two copies' bits meet only on even
 * places that are not targets and the carry rises into an odd place that
 * no copy uses (iq2_sign_nibbles_hold checks all 128 patterns). */
static constexpr __host__ __device__ uint32_t iq2_sign_nibbles(uint32_t s7, uint32_t popc) {
    const uint32_t e = (s7 & 0x55u) * 0x00104104u; /* bit 2k -> 8k + 2 */
    const uint32_t o = (s7 & 0x2au) * 0x00820820u; /* bit 2k + 1 -> 8k + 6 */
    return (e & 0x04040404u) | ((o | popc << 30) & 0x40404040u);
}
static constexpr bool iq2_sign_nibbles_hold() {
    for (uint32_t s7 = 0; s7 < 128; s7++) {
        uint32_t count = 0, want = 0;
        for (int j = 0; j < 7; j++) count += (s7 >> j) & 1u;
        const uint32_t signs = s7 | (count & 1u) << 7;
        for (int j = 0; j < 8; j++) want |= ((signs >> j) & 1u) << (4 * j + 2);
        /* (the garbage above bit 6 that a shifted aux1 brings must not matter) */
        if (iq2_sign_nibbles(s7 | 0xffffff80u, count) != want) return false;
    }
    return true;
}
static_assert(iq2_sign_nibbles_hold(), "the sign nibbles of every 7-bit pattern");
/* the eight signed codes of grid entry g under the sign pattern s7 (its 7
 * low bits), weights 0..3 in w0 */
static __device__ __forceinline__ void iq2_entry(const iq2_ref &tab, uint32_t g, uint32_t s7, int &w0, int &w1) {
    const uint32_t sel = tab.t->nib[g] | iq2_sign_nibbles(s7, (uint32_t)__popc(s7 & 0x7fu));
    w0 = (int)prmt_bytes(tab.pos, IQ2_NEG, sel);
    w1 = (int)prmt_bytes(tab.pos, IQ2_NEG, sel >> 16);
}

static __device__ const iq2_tables g_iq2_tables = make_iq2_tables();
static_assert(sizeof(iq2_tables) % 16 == 0, "tables copied in 16-byte pieces");

/* ------------------------------------------------------------------------ */
/* Kernel arguments                                                          */
/* ------------------------------------------------------------------------ */

struct mv_args {
    /* blockIdx.z picks the matrix (MoE gate/up share a launch; so do the
     * products of one input, cuda_mv_run_multi), with its own outputs */
    const uint8_t *w[CUDA_MV_MAX_MATS];
    const void *act[CUDA_MV_MAX_MATS];
    float *out[CUDA_MV_MAX_MATS];
    int64_t n_out_z[CUDA_MV_MAX_MATS];      /* outputs of matrix z (<= n_out) */
    int64_t out_stride_z[CUDA_MV_MAX_MATS]; /* its output rows apart */
    int64_t row_bytes;
    int64_t units;       /* staging units per row */
    int64_t row0;
    int64_t n_out;
    int64_t act_stride;  /* per activation row (floats or blocks) */
    int64_t act_blocks;  /* Q8_0: blocks of one activation row (where its scales start, split layout) */
    int64_t out_stride;  /* per activation row */
    const int32_t *sel;  /* device expert ids (NULL: plain rows) */
    cuda_dev_error *err; /* gate/up: where a bad id of sel is reported (NULL: the caller checked them) */
    int err_tag;
    int64_t rows_per_expert, n_expert;
    int64_t out_sel_stride; /* gate/up: output rows of slot blockIdx.y */
    int slots_per_token;    /* gate/up: slot s reads activation row s / slots_per_token */
    int64_t act_token_stride; /* gate/up: activation rows (floats or blocks) */
    int64_t out_token_stride; /* down: output rows of token blockIdx.y */
    int64_t group_rows;       /* grouped products: outputs per group (0: not grouped) */
    int64_t act_group_stride; /* activation offset of the next group (floats or blocks) */
    int n_rows;
    int parts;           /* warps per output */
    int rpb;             /* warps' row sets per thread block (rows per block: rpb * rpw) */
    int rpw;             /* consecutive outputs per warp (1 when a row is split over parts) */
    int experts_as_parts; /* down: part p = expert sel[p], activation row p, summed */
    int act_aligned;      /* Q8_K: every activation row starts 16-byte aligned (codes in 16-byte loads) */
    /* the kernels that quantise their own activations (Q8_0, XQ): the n_rows
     * float rows, xf_stride floats apart, of act_blocks blocks each (act is
     * then unused) */
    const float *xf;
    int64_t xf_stride;
    /* ... of a grouped product: floats of xf from one group's slice to the
     * next; a block's outputs lie in one group, whose slice it quantises
     * (act_blocks blocks a row; act_group_stride is then 0) */
    int64_t xf_group_stride;
    int prefetch; /* plain products: first stages issued before cuda_grid_wait ($DS4_CUDA_MV_PREFETCH=0: after) */
    /* expert-grouped products (cuda_mv_moe_grouped): block y is group g,
     * groups[g] = (expert, first sorted row, rows <= ROWS, 0); its
     * activation rows are rows first .. of act (act_stride apart), and
     * output row r goes to slot order[first + r] (out_sel_stride apart) */
    const int4 *groups;
    const int32_t *order;
    /* an hc_pre's deferred Sinkhorn (cuda_hc_take_comb): the last
     * comb_blocks blocks of x (y 0, z 0) run its rows, a warp each, beside
     * the product (those of other y or z do nothing) */
    cuda_comb_task comb;
    int comb_blocks;
    /* one-row float-weight products (XS): the block copies the x row of
     * xs_floats floats into shared memory after the rings and reads it
     * there (0: from global memory) */
    int64_t xs_floats;
    /* plain products: a float row added to each output row of matrix z
     * (NULL: none), as add_weight_row adds it */
    const void *add[CUDA_MV_MAX_MATS];
    uint32_t add_type[CUDA_MV_MAX_MATS];
    /* XQ: each x row's heads of rope_head_dim floats have their tails
     * rotated back (rope_tail's inverse) as they are quantised, row r at
     * position rope_pos[r] (NULL: none; cuda_mv_job.rope) */
    const int32_t *rope_pos;
    int rope_head_dim;
    cuda_rope_params<CUDA_MV_ROPE_PAIRS> rope;
};
static_assert(sizeof(mv_args) <= 1024, "mv_args fits a launch's argument bytes (cuda_args)");

static __device__ __forceinline__ int ld_s32(const uint8_t *p) { return *(const int *)p; }

/*
 * Q8_K block ib of a row (256 floats at x, 16-byte aligned) on one warp,
 * into the split layout of a row of nb blocks at row (codes, then the
 * scales, then the bsums): lane l holds elements 8l .. 8l + 7. The
 * arithmetic of cuda_matmul.cu's q8_K_block (256 threads, one element
 * each): m = the first element of largest |x| (a NaN counts as -1, so it
 * never wins; the order "larger |x|, then lower index" has one winner
 * whatever the reduction's shape), m == 0 an all-zero block, iscale =
 * -127 / m, q = round-half-even(iscale * x) clamped to [-128, 127], bsums
 * of 16, d = 1 / iscale: the same bytes.
 */
static __device__ __forceinline__ void mv_q8_K_warp(const float *x, uint8_t *row, int nb, int ib) {
    const int lane = threadIdx.x & 31;
    const float4 lo = ((const float4 *)x)[2 * lane], hi = ((const float4 *)x)[2 * lane + 1];
    const float v[8] = { lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w };
    float ba = -2.0f, bv = 0.0f;
    int bi = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float t = fabsf(v[j]);
        if (!(t == t)) t = -1.0f;
        if (t > ba) ba = t, bi = 8 * lane + j, bv = v[j];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float oa = __shfl_xor_sync(FULL_MASK, ba, off), ov = __shfl_xor_sync(FULL_MASK, bv, off);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, off);
        if (oa > ba || (oa == ba && oi < bi)) ba = oa, bi = oi, bv = ov;
    }
    const float m = ba > 0.0f ? bv : 0.0f;
    int8_t *qs = (int8_t *)row + ib * DS4_QK_K;
    float *dp = (float *)(row + nb * DS4_QK_K) + ib;
    int16_t *bsums = (int16_t *)(row + nb * (DS4_QK_K + 4)) + ib * (DS4_QK_K / 16);
    uint32_t w0 = 0, w1 = 0;
    int s = 0;
    float d = 0.0f;
    if (m != 0.0f) {
        const float iscale = __fdiv_rn(-127.0f, m);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int q = __float2int_rn(__fmul_rn(iscale, v[j]));
            q = q > 127 ? 127 : q < -128 ? -128 : q;
            s += q;
            if (j < 4) w0 |= ((uint32_t)q & 0xffu) << (8 * j);
            else w1 |= ((uint32_t)q & 0xffu) << (8 * (j - 4));
        }
        d = __fdiv_rn(1.0f, iscale);
    }
    *(uint2 *)(qs + 8 * lane) = make_uint2(w0, w1);
    s += __shfl_xor_sync(FULL_MASK, s, 1); /* elements 16k .. 16k + 15: lanes 2k, 2k + 1 */
    if ((lane & 1) == 0) bsums[lane >> 1] = (int16_t)s;
    if (lane == 0) *dp = d;
}

/* ------------------------------------------------------------------------ */
/* Stage decoders: add one stage's contribution to acc[ROWS]                  */
/* ------------------------------------------------------------------------ */

/* Float weights: lane per 8-element chunk. x rows are 16-byte aligned. */
template <uint32_t T, int ROWS>
static __device__ __forceinline__ void stage_float(const uint8_t *sw, int n_blocks, int64_t gb0, const float *x,
                                                   int64_t x_stride, int n_rows, float (&acc)[ROWS]) {
    const int lane = threadIdx.x & 31;
    for (int c = lane; c < n_blocks; c += 32) {
        float wv[8];
        if constexpr (T == DS4_TYPE_F32) {
            const float4 a = *(const float4 *)(sw + 32 * c), b = *(const float4 *)(sw + 32 * c + 16);
            wv[0] = a.x, wv[1] = a.y, wv[2] = a.z, wv[3] = a.w, wv[4] = b.x, wv[5] = b.y, wv[6] = b.z, wv[7] = b.w;
        } else {
            cuda_half8_to_f32<T>(*(const uint4 *)(sw + 16 * c), wv);
        }
        const int64_t e0 = (gb0 + c) * 8;
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (ROWS == 1 || r < n_rows) {
                const float4 xa = *(const float4 *)(x + r * x_stride + e0);
                const float4 xb = *(const float4 *)(x + r * x_stride + e0 + 4);
                float s = acc[r];
                s = fmaf(wv[0], xa.x, s);
                s = fmaf(wv[1], xa.y, s);
                s = fmaf(wv[2], xa.z, s);
                s = fmaf(wv[3], xa.w, s);
                s = fmaf(wv[4], xb.x, s);
                s = fmaf(wv[5], xb.y, s);
                s = fmaf(wv[6], xb.z, s);
                s = fmaf(wv[7], xb.w, s);
                acc[r] = s;
            }
        }
    }
}

/* Q8_0 weights, Q8_0 activations in the split layout (cuda_matvec.h: per
 * row of `x_stride` blocks the codes, then the scales): one lane per block,
 * so a warp step covers 32 blocks (1088 bytes) with no shuffles. The 32
 * codes of a 34-byte block start 2 bytes in, at an address that is 4-byte
 * aligned for odd blocks and 2 mod 4 for even ones: nine aligned words and
 * funnel shifts give the eight code words either way (the ninth word of an
 * even block is still inside the stage: the next block follows it). A lane's
 * blocks are lane + 32 i, so its parity, and with it the shift, is the
 * lane's. b0 is the stage's first block within the activation row, x_blocks
 * the row's blocks (its scales follow its codes), x_stride blocks between
 * rows. The block scale's conversion need not keep a NaN's payload
 * (cuda_f16_to_f32_arith). */
template <int ROWS>
static __device__ __forceinline__ void q8_0_block(const uint8_t *blk, int odd, const int8_t *xq, const float *xd,
                                                  int64_t row_bytes, int n_rows, float (&acc)[ROWS]) {
    /* pointer arithmetic, not an integer mask, so that the loads stay
     * shared-memory loads (the stage is 16-byte aligned) */
    const uint32_t *p = (const uint32_t *)(blk + 2 * odd);
    const int sh = odd ? 0 : 16;
    int w[8];
    uint32_t lo = p[0];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const uint32_t hi = (k < 7 || !odd) ? p[k + 1] : 0u;
        w[k] = (int)__funnelshift_r(lo, hi, sh);
        lo = hi;
    }
    const float wd = cuda_f16_to_f32_arith(*(const uint16_t *)blk);
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (ROWS == 1 || r < n_rows) {
            /* row r's codes and scale: row_bytes on from row 0's (one base
             * pointer for all rows, so that eight rows cost no registers) */
            const int4 *q = (const int4 *)(xq + r * row_bytes);
            const int4 qa = q[0], qb = q[1];
            int isum = __dp4a(w[0], qa.x, 0);
            isum = __dp4a(w[1], qa.y, isum);
            isum = __dp4a(w[2], qa.z, isum);
            isum = __dp4a(w[3], qa.w, isum);
            isum = __dp4a(w[4], qb.x, isum);
            isum = __dp4a(w[5], qb.y, isum);
            isum = __dp4a(w[6], qb.z, isum);
            isum = __dp4a(w[7], qb.w, isum);
            const float xs = *(const float *)((const uint8_t *)xd + r * row_bytes);
            acc[r] = __fadd_rn(acc[r], __fmul_rn(__fmul_rn(wd, xs), __int2float_rn(isum)));
        }
    }
}

template <int ROWS>
static __device__ __forceinline__ void stage_q8_0(const uint8_t *sw, int n_blocks, int64_t b0, const uint8_t *x,
                                                  int64_t x_stride, int64_t x_blocks, int n_rows, float (&acc)[ROWS]) {
    static_assert(MV_STAGE / 34 <= 64, "a lane decodes at most two blocks of a stage");
    const int lane = threadIdx.x & 31;
    const int64_t row_bytes = x_stride * (int64_t)sizeof(mv_q8_0);
    const int odd = lane & 1;
    const int8_t *xq = (const int8_t *)x + (b0 + lane) * 32;
    const float *xd = (const float *)(x + x_blocks * 32) + b0 + lane;
    if constexpr (ROWS == 1) { /* the lane's one or two blocks, unrolled */
        if (lane >= n_blocks) return;
        q8_0_block<ROWS>(sw + 34 * lane, odd, xq, xd, row_bytes, n_rows, acc);
        if (lane + 32 < n_blocks) q8_0_block<ROWS>(sw + 34 * (lane + 32), odd, xq + 32 * 32, xd + 32, row_bytes, n_rows, acc);
    } else {
        /* not unrolled: the second block's loads would be hoisted beside the
         * first's (up to eight rows of codes: 80 registers, three blocks per
         * SM instead of four) */
#pragma unroll 1
        for (int b = lane; b < n_blocks; b += 32, xq += 32 * 32, xd += 32)
            q8_0_block<ROWS>(sw + 34 * b, odd, xq, xd, row_bytes, n_rows, acc);
    }
}

/* Two Q8_0 rows of 32 blocks in one stage (q_b's rows of 1,024; mv_pack):
 * lane l decodes block l of both against activation block l, as the
 * unpacked kernel decodes each row's block l in lane l, so each lane's two
 * sums are the unpacked kernel's. The rows' butterflies share their first
 * step (lanes below 16 keep row 0's pairwise sum, the others row 1's: the
 * same two values the unpacked butterfly adds, in either order) and run
 * the rest in each half, where every partner holds what it holds in the
 * unpacked butterfly: row 0's sum lands in lane 0, row 1's in lane 16, bit
 * for bit the unpacked kernel's. */
static __device__ __forceinline__ void stage_q8_0_packed(const uint8_t *sw, int rows, const uint8_t *x,
                                                         int64_t x_blocks, float *row_sums) {
    const int lane = threadIdx.x & 31, odd = lane & 1;
    const int8_t *xq = (const int8_t *)x + lane * 32;
    const float *xd = (const float *)(x + x_blocks * 32) + lane;
    float v0[1] = { 0.0f }, v1[1] = { 0.0f };
    q8_0_block<1>(sw + 34 * lane, odd, xq, xd, 0, 1, v0);
    if (rows > 1) q8_0_block<1>(sw + 34 * (lane + 32), odd, xq, xd, 0, 1, v1);
    const bool h = lane & 16;
    float v = __fadd_rn(h ? v1[0] : v0[0], __shfl_xor_sync(FULL_MASK, h ? v0[0] : v1[0], 16));
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, off));
    if ((lane & 15) == 0 && (lane >> 4) < rows) row_sums[lane >> 4] = v;
}

/* Q8_K-activation types: lane `sub` (0..7) of a block's eight lanes holds
 * its elements 32 sub .. 32 sub + 31 as eight words of int8 codes, with the
 * multipliers (scale, min) of their two 16-element halves. (Lanes taking
 * 16 sub .. and 128 + 16 sub .. instead, so that a block's activation
 * codes are read in whole 32-byte sectors, measured no faster: the
 * kernels are bound by their instructions, not by the L1.) */
template <uint32_t T> struct mvq;

template <> struct mvq<DS4_TYPE_Q2_K> {
    static constexpr bool HAS_MIN = true, ONE_MUL = false; /* ONE_MUL: codes give mul[0] == mul[1] */
    /* elements 32 i + l = 128 h + 32 s + l: bits 2s of qs[32 h + l]; sub-blocks 2i, 2i + 1 */
    static __device__ __forceinline__ void codes(const uint8_t *blk, int sub, const iq2_ref &, int (&w)[8],
                                                 int (&mul)[2], int (&mmul)[2]) {
        const int h = sub >> 2, s = sub & 3;
        const uint8_t *qs = blk + 16 + 32 * h; /* 4-byte aligned */
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = (ld_s32(qs + 4 * k) >> (2 * s)) & 0x03030303;
        const int sa = blk[2 * sub], sb = blk[2 * sub + 1];
        mul[0] = sa & 15, mul[1] = sb & 15;
        mmul[0] = sa >> 4, mmul[1] = sb >> 4;
    }
    /* the block's float scales (d, dmin), and its term from them */
    static __device__ __forceinline__ void scales(const uint8_t *blk, float &d, float &dmin) {
        d = cuda_f16_to_f32_arith(*(const uint16_t *)(blk + 80));
        dmin = cuda_f16_to_f32_arith(*(const uint16_t *)(blk + 82));
    }
    static __device__ __forceinline__ float term_of(float d, float dm, float yd, int isum, int summs) {
        const float dall = __fmul_rn(yd, d), dmin = __fmul_rn(yd, dm);
        return __fsub_rn(__fmul_rn(dall, __int2float_rn(isum)), __fmul_rn(dmin, __int2float_rn(summs)));
    }
    static __device__ __forceinline__ float term(const uint8_t *blk, float yd, int isum, int summs) {
        float d, dm;
        scales(blk, d, dm);
        return term_of(d, dm, yd, isum, summs);
    }
};

template <> struct mvq<DS4_TYPE_Q4_K> {
    static constexpr bool HAS_MIN = true, ONE_MUL = true;
    /* sub-block j = sub: nibble 4 (j % 2) of qs[32 (j / 2) + l] */
    static __device__ __forceinline__ void codes(const uint8_t *blk, int sub, const iq2_ref &, int (&w)[8],
                                                 int (&mul)[2], int (&mmul)[2]) {
        const uint4 *qs = (const uint4 *)(blk + 16 + 32 * (sub >> 1)); /* 16-byte aligned (144-byte blocks) */
        const uint4 a = qs[0], b = qs[1];
        const uint32_t v[8] = { a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w };
        const int shift = 4 * (sub & 1);
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = (int)((v[k] >> shift) & 0x0f0f0f0fu);
        int sc, m;
        unpack_scale_min_k4(blk + 4, sub, &sc, &m);
        mul[0] = mul[1] = sc;
        mmul[0] = mmul[1] = m;
    }
    static __device__ __forceinline__ void scales(const uint8_t *blk, float &d, float &dmin) {
        d = cuda_f16_to_f32_arith(*(const uint16_t *)blk);
        dmin = cuda_f16_to_f32_arith(*(const uint16_t *)(blk + 2));
    }
    static __device__ __forceinline__ float term_of(float dd, float dm, float yd, int isum, int summs) {
        const float d = __fmul_rn(dd, yd), dmin = __fmul_rn(dm, yd);
        return __fsub_rn(__fmul_rn(d, __int2float_rn(isum)), __fmul_rn(dmin, __int2float_rn(summs)));
    }
    static __device__ __forceinline__ float term(const uint8_t *blk, float yd, int isum, int summs) {
        float d, dm;
        scales(blk, d, dm);
        return term_of(d, dm, yd, isum, summs);
    }
};

template <> struct mvq<DS4_TYPE_IQ2_XXS> {
    static constexpr bool HAS_MIN = false, ONE_MUL = true;
    /* sub-block ib = sub: four grid entries (aux0's bytes), their 7-bit sign
     * patterns and the 4-bit scale (aux1); each entry's eight signed codes
     * from the code table, the sign nibbles and two byte permutes (iq2_entry) */
    static __device__ __forceinline__ void codes(const uint8_t *blk, int sub, const iq2_ref &tab, int (&w)[8],
                                                 int (&mul)[2], int (&mmul)[2]) {
        const uint16_t *qs = (const uint16_t *)(blk + 2) + 4 * sub; /* 2-byte aligned */
        const uint32_t aux0 = (uint32_t)qs[0] | ((uint32_t)qs[1] << 16);
        const uint32_t aux1 = (uint32_t)qs[2] | ((uint32_t)qs[3] << 16);
#pragma unroll
        for (int l = 0; l < 4; l++) iq2_entry(tab, (aux0 >> (8 * l)) & 255u, aux1 >> (7 * l), w[2 * l], w[2 * l + 1]);
        mul[0] = mul[1] = 2 * (int)(aux1 >> 28) + 1;
        mmul[0] = mmul[1] = 0;
    }
    static __device__ __forceinline__ void scales(const uint8_t *blk, float &d, float &dmin) {
        d = cuda_f16_to_f32_arith(*(const uint16_t *)blk);
        dmin = 0.0f;
    }
    static __device__ __forceinline__ float term_of(float d, float, float yd, int isum, int) {
        return __fmul_rn(__fmul_rn(d, yd), __int2float_rn(isum));
    }
    static __device__ __forceinline__ float term(const uint8_t *blk, float yd, int isum, int summs) {
        float d, dm;
        scales(blk, d, dm);
        return term_of(d, dm, yd, isum, summs);
    }
};

template <> struct mvq<DS4_TYPE_Q8_K> {
    static constexpr bool HAS_MIN = false, ONE_MUL = true;
    static __device__ __forceinline__ void codes(const uint8_t *blk, int sub, const iq2_ref &, int (&w)[8],
                                                 int (&mul)[2], int (&mmul)[2]) {
        const uint8_t *qs = blk + 4 + 32 * sub; /* 4-byte aligned */
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = ld_s32(qs + 4 * k);
        mul[0] = mul[1] = 1;
        mmul[0] = mmul[1] = 0;
    }
    static __device__ __forceinline__ float term(const uint8_t *blk, float yd, int isum, int) {
        return __fmul_rn(__int2float_rn(isum), __fmul_rn(*(const float *)blk, yd));
    }
};

/* One activation row (the decode and per-slot expert products), for the
 * types whose stage holds several warp steps (IQ2_XXS 8, Q2_K 6, Q4_K 4):
 * stage_q8k_one unrolls the stage's steps, so the activation and block
 * addresses are immediates off one base, and reduces the blocks' integer
 * sums once per stage instead of once per step. Step i leaves each lane's
 * partial sums in registers; a transposing butterfly over a block's eight
 * lanes (7 shuffles for all eight steps, against 3 per step) then leaves
 * the full sums of step i in lane sub = i, which adds that block's term.
 * The integers and the float term of every block are those of stage_q8k,
 * whose multi-row products add each term in that same lane, so a row's
 * result does not depend on the kernel's row count. */
template <uint32_t T> struct mv_one_row {
    static constexpr int STEPS = (mvt<T>::STAGE_UNITS * mvt<T>::UNIT + 3) / 4; /* warp steps in a full stage */
    static constexpr bool ON = T == DS4_TYPE_IQ2_XXS || T == DS4_TYPE_Q2_K || T == DS4_TYPE_Q4_K;
    static_assert(!ON || (STEPS >= 2 && STEPS <= 8), "a stage's steps fit the eight lanes of a block");
};

/* A lane's 32 activation codes at q8 (two 16-byte loads when ALIGNED, else
 * eight 4-byte ones) against its eight code words w: the exact integer dots
 * of the first and of the last 16 (the two halves' multipliers differ for
 * Q2_K), or with ONE (one multiplier for both) the dot of all 32 in lo. */
template <bool ALIGNED, bool ONE>
static __device__ __forceinline__ void dot_codes32(const uint8_t *q8, const int (&w)[8], int &lo, int &hi) {
    int xq[8];
    if constexpr (ALIGNED) {
        const int4 qa = ((const int4 *)q8)[0], qb = ((const int4 *)q8)[1];
        xq[0] = qa.x, xq[1] = qa.y, xq[2] = qa.z, xq[3] = qa.w;
        xq[4] = qb.x, xq[5] = qb.y, xq[6] = qb.z, xq[7] = qb.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) xq[k] = ld_s32(q8 + 4 * k);
    }
    lo = 0, hi = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) lo = __dp4a(w[k], xq[k], lo);
#pragma unroll
    for (int k = 4; k < 8; k++) {
        if constexpr (ONE) lo = __dp4a(w[k], xq[k], lo);
        else hi = __dp4a(w[k], xq[k], hi);
    }
}

/* a lane's integer sum of its 32 elements: its codes w against the
 * activation codes at q8, each half times its multiplier */
template <typename K, bool ALIGNED>
static __device__ __forceinline__ int lane_isum(const uint8_t *q8, const int (&w)[8], const int (&mul)[2]) {
    int lo, hi;
    dot_codes32<ALIGNED, K::ONE_MUL>(q8, w, lo, hi);
    if constexpr (K::ONE_MUL) return mul[0] * lo;
    else return mul[0] * lo + mul[1] * hi;
}

/* the lane's two halves' mins against bsums 2 sub and 2 sub + 1 (one
 * aligned word) of the activation block whose bsums are at bs */
static __device__ __forceinline__ int lane_summs(const uint8_t *bs, int sub, const int (&mmul)[2]) {
    const uint32_t v = *(const uint32_t *)(bs + 4 * sub);
    return mmul[0] * (int)(int16_t)(v & 0xffffu) + mmul[1] * (int)(int16_t)(v >> 16);
}

/* Four 256-blocks per warp step, eight lanes each (lane = 8 block + sub).
 * A block's integer sums (sum_j sc_j isub_j, sum_j m_j bsum_j) are exact
 * whichever lanes add them; one of its lanes adds the CPU's block term.
 * Activations in the split layout (cuda_matvec.h): row r at x + r
 * row_bytes holds x_blocks blocks' codes, then their d, then their bsums;
 * b0 is the stage's first block within the row. With ALIGNED (every row
 * 16-byte aligned) a lane's 32 codes are two 16-byte loads, a warp's four
 * blocks one contiguous kilobyte. */
template <uint32_t T, int ROWS, bool ALIGNED>
static __device__ __forceinline__ void stage_q8k(const uint8_t *sw, int n_blocks, int64_t b0, const uint8_t *x,
                                                 int64_t row_bytes, int64_t x_blocks, int n_rows,
                                                 const iq2_ref &tab, float (&acc)[ROWS]) {
    typedef mvq<T> K;
    const int lane = threadIdx.x & 31, sub = lane & 7;
    for (int s0 = 0; s0 < n_blocks; s0 += 4) {
        const int b = s0 + (lane >> 3);
        const bool mine = b < n_blocks;
        const int bb = mine ? b : s0; /* lanes past the end decode a real block and add nothing */
        /* the lane that adds the block's term: for the types of the one-row
         * decoder, the lane holding step s0 / 4 of the stage there, so that
         * every lane sums the same terms in the same order and the rows of
         * a multi-row product equal the one-row products bit for bit */
        const int term_lane = mv_one_row<T>::ON ? s0 / 4 : 0;
        const uint8_t *blk = sw + mvt<T>::BLOCK_BYTES * bb;
        int w[8], mul[2], mmul[2];
        K::codes(blk, sub, tab, w, mul, mmul);
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (ROWS == 1 || r < n_rows) {
                const uint8_t *xr = x + r * row_bytes;
                const int64_t xb = b0 + bb;
                const int li = lane_isum<K, ALIGNED>(xr + xb * DS4_QK_K + 32 * sub, w, mul);
                int isum = mine ? li : 0;
                int summs = 0;
                if (K::HAS_MIN) {
                    const int s = lane_summs(xr + x_blocks * (DS4_QK_K + 4) + xb * 32, sub, mmul);
                    summs = mine ? s : 0;
                }
#pragma unroll
                for (int off = 4; off > 0; off >>= 1) {
                    isum += __shfl_xor_sync(FULL_MASK, isum, off);
                    if (K::HAS_MIN) summs += __shfl_xor_sync(FULL_MASK, summs, off);
                }
                if (mine && sub == term_lane) {
                    const float yd = ((const float *)(xr + x_blocks * DS4_QK_K))[xb];
                    acc[r] = __fadd_rn(acc[r], K::term(blk, yd, isum, summs));
                }
            }
        }
    }
}

/* the sum over a block's eight lanes of v[sub'] for sub' = this lane's sub:
 * v[i] of lane l is step i's part from lane l */
static __device__ __forceinline__ int lanes8_transpose_sum(const int (&v)[8], int sub) {
    const bool h4 = sub & 4, h2 = sub & 2, h1 = sub & 1;
    int a4[4], a2[2];
#pragma unroll
    for (int k = 0; k < 4; k++) a4[k] = (h4 ? v[k + 4] : v[k]) + __shfl_xor_sync(FULL_MASK, h4 ? v[k] : v[k + 4], 4);
#pragma unroll
    for (int k = 0; k < 2; k++) a2[k] = (h2 ? a4[k + 2] : a4[k]) + __shfl_xor_sync(FULL_MASK, h2 ? a4[k] : a4[k + 2], 2);
    return (h1 ? a2[1] : a2[0]) + __shfl_xor_sync(FULL_MASK, h1 ? a2[0] : a2[1], 1);
}

template <uint32_t T, bool ALIGNED>
static __device__ __forceinline__ void stage_q8k_one(const uint8_t *sw, int n_blocks, int64_t b0, const uint8_t *x,
                                                     int64_t x_blocks, const iq2_ref &tab, float &acc) {
    typedef mvq<T> K;
    constexpr int BB = mvt<T>::BLOCK_BYTES, NS = mv_one_row<T>::STEPS;
    /* stages of IQ2_XXS and Q2_K are whole steps (units of 8 and 4 blocks);
     * only Q4_K's (units of one block) can end inside a step */
    constexpr bool WHOLE = mvt<T>::UNIT % 4 == 0;
    const int lane = threadIdx.x & 31, sub = lane & 7, g = lane >> 3;
    const uint8_t *q8 = x + (b0 + g) * DS4_QK_K + 32 * sub;            /* step 0's codes for this lane */
    const uint8_t *bs = x + x_blocks * (DS4_QK_K + 4) + (b0 + g) * 32; /* its bsums */
    int isum[8], summs[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        isum[i] = summs[i] = 0;
        if (i < NS && 4 * i < n_blocks) { /* n_blocks is the warp's: no divergence */
            const bool mine = WHOLE || 4 * i + g < n_blocks;
            const int d = WHOLE ? 4 * i : mine ? 4 * i : 4 * i - g; /* blocks past the end decode step i's first */
            const uint8_t *blk = sw + BB * (d + g);
            int w[8], mul[2], mmul[2];
            K::codes(blk, sub, tab, w, mul, mmul);
            const int li = lane_isum<K, ALIGNED>(q8 + (int64_t)d * DS4_QK_K, w, mul);
            isum[i] = mine ? li : 0;
            if (K::HAS_MIN) {
                const int sm = lane_summs(bs + (int64_t)d * 32, sub, mmul);
                summs[i] = mine ? sm : 0;
            }
        }
    }
    const int is = lanes8_transpose_sum(isum, sub);
    const int sm = K::HAS_MIN ? lanes8_transpose_sum(summs, sub) : 0;
    const int b = 4 * sub + g; /* the block whose sums this lane now holds */
    if (sub < NS && b < n_blocks) {
        const float yd = ((const float *)(x + x_blocks * DS4_QK_K))[b0 + b];
        acc = __fadd_rn(acc, K::term(sw + BB * b, yd, is, sm));
    }
}

/* Rows packed into one stage. A one-row product over short rows (the routed
 * experts of the full-size q2 model: IQ2_XXS gate/up rows of 16 blocks,
 * Q2_K down rows of 8; q_b's Q8_0 rows of 32, stage_q8_0_packed) would
 * give each row a stage of its own, a third to a half full, and pay the
 * stage's fixed work (the transposing sums, the row's butterfly, the ring
 * step) per row. A warp's rows are consecutive
 * rows of one matrix and contiguous in memory, so a stage of PR =
 * stage blocks / BPR rows of BPR blocks (BPR a multiple of 4, BPR / 4 a
 * power of two) is one copy, decoded as stage_q8k_one decodes a stage: step
 * i's four blocks are row i / (BPR / 4)'s and meet activation blocks
 * 4 (i mod BPR / 4) + g. After the transposing sums lane (sub, g) holds
 * stage block 4 sub + g, of row sub / (BPR / 4), as the unpacked kernel
 * holds that row's block in lane (sub mod BPR / 4, g): the same integers
 * and float term. The unpacked row butterfly (offsets 16 .. 1) adds zeros
 * (exactly) at the offsets 4, 2, 1 that are not below BPR / 4 and at the
 * others meets the same partner terms that it meets here, lanes of one row:
 * each row's sum is the unpacked kernel's bit for bit, and in lane
 * sub = (BPR / 4) r of the first group. */
template <uint32_t T, int BPR> struct mv_pack {
    static constexpr int Q = BPR / 4; /* steps per row */
    static constexpr int PR = mvt<T>::STAGE_UNITS * mvt<T>::UNIT / BPR;
    static_assert(mv_one_row<T>::ON && BPR % mvt<T>::UNIT == 0 && BPR % 4 == 0 && (Q & (Q - 1)) == 0 && Q <= 4 &&
                      PR >= 2,
                  "whole rows of whole units, at least two per stage");
};

/* the rows per stage a packed kernel assumes are its decoder's */
template <uint32_t T, int PACK, int PR> static constexpr __host__ __device__ bool mv_pack_fits() {
    if constexpr (PACK == 0) return true;
    else if constexpr (T == DS4_TYPE_Q8_0) return PACK == 32 && PR == 2;
    else return PR == mv_pack<T, PACK>::PR;
}

template <uint32_t T, int BPR, bool ALIGNED>
static __device__ __forceinline__ void stage_q8k_packed(const uint8_t *sw, int rows, const uint8_t *x,
                                                        int64_t x_blocks, const iq2_ref &tab, float *row_sums) {
    typedef mvq<T> K;
    constexpr int BB = mvt<T>::BLOCK_BYTES, NS = mv_one_row<T>::STEPS, Q = mv_pack<T, BPR>::Q;
    const int n_blocks = rows * BPR;
    const int lane = threadIdx.x & 31, sub = lane & 7, g = lane >> 3;
    const uint8_t *q8 = x + g * DS4_QK_K + 32 * sub;            /* activation block g's codes for this lane */
    const uint8_t *bs = x + x_blocks * (DS4_QK_K + 4) + g * 32; /* its bsums */
    int isum[8], summs[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        isum[i] = summs[i] = 0;
        if (i < NS && 4 * i < n_blocks) { /* whole steps: rows are whole units of 4 or 8 blocks */
            const int ab = 4 * (i % Q);     /* the step's first activation block */
            int w[8], mul[2], mmul[2];
            K::codes(sw + BB * (4 * i + g), sub, tab, w, mul, mmul);
            isum[i] = lane_isum<K, ALIGNED>(q8 + ab * DS4_QK_K, w, mul);
            if (K::HAS_MIN) summs[i] = lane_summs(bs + ab * 32, sub, mmul);
        }
    }
    const int is = lanes8_transpose_sum(isum, sub);
    const int sm = K::HAS_MIN ? lanes8_transpose_sum(summs, sub) : 0;
    const int b = 4 * sub + g; /* the stage block whose sums this lane now holds */
    float v = 0.0f;
    if (sub < NS && b < n_blocks) {
        const float yd = ((const float *)(x + x_blocks * DS4_QK_K))[4 * (sub % Q) + g];
        v = __fadd_rn(0.0f, K::term(sw + BB * b, yd, is, sm)); /* the unpacked kernel's 0 + term */
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        if (off >= 8 || off < Q) v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, off));
    if (g == 0 && sub % Q == 0 && sub / Q < rows) row_sums[sub / Q] = v;
}

template <uint32_t T> static __device__ __forceinline__ float mv_finish(float s) {
    if constexpr (T == DS4_TYPE_IQ2_XXS) return __fmul_rn(0.125f, s);
    else return s;
}

/* The 16 floats v of x row r from element e (a multiple of 16 of a slice
 * of whole heads) with every pair of a head's last n_rot dims rotated back
 * by row r's table, as rope_tail_kernel rotates them (pairs start at even
 * offsets, so none straddles the 16). */
static __device__ __forceinline__ void mv_rope_back(const mv_args &a, int r, int e, const float *cs, float4 (&v)[4]) {
    const int hd = a.rope_head_dim, n_rot = a.rope.n_rot, half = n_rot / 2, tail = hd - n_rot;
    const int eh = e % hd; /* the first value's place in its head */
    if (eh + 16 <= tail) return;
    const float *c = cs + r * n_rot;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int p0 = eh + 4 * i, p1 = p0 + 2;
        if (p0 >= tail) {
            const int k = (p0 - tail) >> 1;
            cuda_rope_rotate(v[i].x, v[i].y, c[k], c[half + k]);
        }
        if (p1 >= tail) {
            const int k = (p1 - tail) >> 1;
            cuda_rope_rotate(v[i].z, v[i].w, c[k], c[half + k]);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* The kernel                                                                */
/* ------------------------------------------------------------------------ */

/* XQ (Q8_0 weights only): the thread block first quantises the float
 * activations a.xf into shared memory, in the split layout, with the
 * quantiser kernel's arithmetic (cuda_q8_0_quant_lane), and reads them from
 * there: the product needs no quantiser launch before it.
 *
 * Plain products (no expert ids) issue their first weight stages before
 * cuda_grid_wait: weights are never written by kernels, so their first
 * bytes arrive while the kernel before drains (this kernel's blocks are
 * scheduled onto the SMs its last wave frees). Expert products wait first,
 * since their rows come from the router's ids.
 *
 * The one-row kernels of the unrolled stage decoder (mv_one_row) are held
 * to 64 registers: four blocks per SM, as their shared memory allows; so
 * are the XQ kernels of up to four rows (the RoPE tables' double sincos
 * would take them from 60 to 72 registers, three blocks per SM). */
template <uint32_t T, int ROWS, bool XQ, int PACK = 0>
__global__ void __launch_bounds__(256, (ROWS == 1 && mv_one_row<T>::ON) || (XQ && ROWS <= 4) ? 4 : 1) mv_kernel(mv_args a) {
    static_assert(!XQ || T == DS4_TYPE_Q8_0, "only the Q8_0 kernels quantise their activations");
    static_assert(!PACK || ROWS == 1, "packed stages: one activation row");
    /* PACK: rows of PACK blocks, PR of them per stage (mv_pack, or Q8_0's
     * two rows of 32; the host launches these only for whole rows of that
     * length, no groups) */
    typedef mvt<T> G;
    constexpr int PR = PACK ? G::STAGE_UNITS * G::UNIT / (PACK ? PACK : 1) : 1; /* mv_pack<T, PACK>::PR */
    static_assert(mv_pack_fits<T, PACK, PR>(), "stage_q8_0_packed takes two rows of 32 blocks; the others mv_pack's");
    if (a.comb_blocks && (int)blockIdx.x >= (int)gridDim.x - a.comb_blocks) {
        if (blockIdx.y == 0 && blockIdx.z == 0) {
            cuda_grid_wait(); /* the logits come from the kernels before */
            const int64_t b = (int64_t)blockIdx.x - ((int64_t)gridDim.x - a.comb_blocks);
            hc_comb_row(a.comb, b * (blockDim.x >> 5) + (threadIdx.x >> 5));
        }
        return;
    }
    extern __shared__ uint4 smem[];
    __shared__ float red[MV_WARPS * MV_MAX_RPW][ROWS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_warps = blockDim.x >> 5;
    /* IQ2_XXS: the table's copy (constant data) is the first cp.async group,
     * issued before any wait; the block waits for it (and a barrier) only
     * once its first weight stages are in flight too */
    iq2_ref tab{ NULL, 0u };
    if constexpr (T == DS4_TYPE_IQ2_XXS) {
        uint4 *dst = smem + n_warps * MV_NST * (MV_STAGE / 16);
        const uint4 *src = (const uint4 *)&g_iq2_tables;
        for (int i = threadIdx.x; i < (int)(sizeof(iq2_tables) / 16); i += blockDim.x) cp_async16(dst + i, src + i, true);
        cp_async_commit();
        tab.t = (const iq2_tables *)dst;
    }
    const bool early = a.sel == NULL && a.groups == NULL && a.prefetch; /* the same for the whole grid */
    if (!early) cuda_grid_wait();
    const int part = warp % a.parts, lr = warp / a.parts, rpw = a.rpw;
    const int64_t o_first = ((int64_t)blockIdx.x * a.rpb + lr) * rpw; /* this warp's first output */
    const int z = blockIdx.z;

    /* this warp's weight rows (wrow0 + j for j < n_valid), unit range and
     * activation rows */
    bool active = true;
    int64_t wrow0 = a.row0 + o_first, u0 = 0, u1 = a.units;
    int grp_first = 0, grp_rows = 0; /* expert-grouped products: the group's first sorted row, its rows */
    const uint8_t *act = (const uint8_t *)a.act[z];
    int64_t act_unit; /* bytes of one activation element (float) or block */
    if constexpr (mv_float(T)) act_unit = 4;
    else if constexpr (T == DS4_TYPE_Q8_0) act_unit = (int64_t)sizeof(mv_q8_0);
    else act_unit = (int64_t)sizeof(ds4_block_q8_K);
    if (a.experts_as_parts) {
        const int64_t slot = (int64_t)blockIdx.y * a.parts + part;
        const int32_t e = a.sel[slot];
        active = e >= 0 && e < a.n_expert;
        wrow0 = (int64_t)e * a.rows_per_expert + o_first;
        act += slot * a.act_stride * act_unit;
    } else {
        if (a.sel) {
            const int64_t slot = blockIdx.y;
            const int32_t e = a.sel[slot];
            active = e >= 0 && e < a.n_expert;
            if (!active && a.err && blockIdx.x == 0 && z == 0 && threadIdx.x == 0)
                cuda_report_bad_index(a.err, CUDA_CHECK_MOE_EXPERT, a.err_tag, e, a.n_expert, slot);
            wrow0 = (int64_t)e * a.rows_per_expert + o_first;
            act += (slot / a.slots_per_token) * a.act_token_stride * act_unit;
        } else if (a.groups) {
            const int4 g = a.groups[blockIdx.y];
            active = g.z > 0 && g.z <= ROWS && g.x >= 0 && g.x < a.n_expert;
            wrow0 = (int64_t)g.x * a.rows_per_expert + o_first;
            act += (int64_t)g.y * a.act_stride * act_unit;
            grp_first = g.y;
            grp_rows = active ? g.z : 0;
        }
        u0 = a.units * part / a.parts;
        u1 = a.units * (part + 1) / a.parts;
    }
    const int n_rows = a.experts_as_parts ? 1 : a.groups ? grp_rows : a.n_rows;
    const int64_t left = a.n_out_z[z] - o_first;
    const int n_valid = !active || left <= 0 || u1 <= u0 ? 0 : left < rpw ? (int)left : rpw;

    /* The warp streams its rows' stages (stage k of row j is stage
     * j * spr + k) through a ring of MV_NST buffers with cp.async: stage s
     * is decoded while stages s + 1 .. s + MV_NST - 1 are in flight. Every
     * issue commits a group (an empty one past the end), so the group count
     * stays uniform and wait<MV_NST - 2> always means "stage s is in". */
    uint8_t *ring = (uint8_t *)(smem + warp * MV_NST * (MV_STAGE / 16));
    /* 32-bit counters, advanced step by step (no division in the loop): a
     * part has at most a few thousand units, a warp at most MV_MAX_RPW rows */
    const int n_units = (int)(u1 - u0);
    const int spr = (n_units + G::STAGE_UNITS - 1) / G::STAGE_UNITS; /* stages per row */
    const int total = PACK ? (n_valid + PR - 1) / PR : n_valid * spr;
    const uint8_t *wbase = a.w[z] + wrow0 * a.row_bytes + u0 * G::UNIT_BYTES;
    /* the next stage to issue: its index, the units left in its row, this
     * lane's source in the row and its shared-memory address in the stage's
     * buffer; a stage is at most MV_COPIES 16-byte copies a lane, unrolled
     * and predicated */
    int is_s = 0, is_left = n_units;
    const unsigned ring_lane = cuda_smem_addr(ring) + 16u * (unsigned)lane;
    unsigned is_dst = ring_lane;
    const uint8_t *is_row = wbase + 16 * lane, *is_src = is_row;
    auto issue = [&]() {
        if (is_s < total) {
            int cnt;
            if constexpr (PACK) { /* the next PR rows, or those left */
                const int rows = n_valid - PR * is_s;
                cnt = (rows < PR ? rows : PR) * (PACK / G::UNIT);
            } else {
                cnt = is_left < G::STAGE_UNITS ? is_left : G::STAGE_UNITS;
            }
            const int n16 = cnt * (G::UNIT_BYTES / 16) - lane; /* this lane copies 16-byte pieces c < n16 / 32 */
#pragma unroll
            for (int c = 0; c < MV_COPIES; c++)
                if (32 * c < n16) cp_async16_to(is_dst + 512u * (unsigned)c, is_src + 512 * c);
            if constexpr (PACK) {
                is_src += PR * a.row_bytes;
            } else {
                is_left -= cnt;
                if (is_left == 0) { /* the next row */
                    is_left = n_units;
                    is_row += a.row_bytes;
                    is_src = is_row;
                } else {
                    is_src += G::STAGE_UNITS * G::UNIT_BYTES;
                }
            }
            is_dst = is_dst == ring_lane + (MV_NST - 1) * MV_STAGE ? ring_lane : is_dst + MV_STAGE;
        }
        is_s++;
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < MV_NST - 1; s++) issue();
    if constexpr (T == DS4_TYPE_IQ2_XXS) {
        cp_async_wait<MV_NST - 1>(); /* the table's group: older than the MV_NST - 1 stages just issued */
        __syncthreads();
        tab.pos = tab.t->pos[0];
    }
    /* XQ with a RoPE: each row's cos / sin table after the split x rows
     * (positions are control data, uploaded before the step's kernels:
     * made while the kernel before drains) */
    float *rope_cs = NULL;
    if constexpr (XQ) {
        if (a.rope_pos) {
            rope_cs = (float *)((uint8_t *)(smem + n_warps * MV_NST * (MV_STAGE / 16)) +
                                (size_t)a.n_rows * a.act_blocks * sizeof(mv_q8_0));
            for (int i = threadIdx.x; i < a.n_rows * (a.rope.n_rot / 2); i += blockDim.x)
                cuda_rope_entry(a.rope, a.rope_pos, i, rope_cs);
            /* (the barrier after the quantiser's first loads publishes them) */
        }
    }
    if (early) cuda_grid_wait();
    if constexpr (mv_float(T) && ROWS == 1) {
        if (a.xs_floats) { /* XS: x once into shared memory, 16 bytes a thread at a time */
            float4 *xs = (float4 *)(smem + n_warps * MV_NST * (MV_STAGE / 16));
            const float4 *src = (const float4 *)act;
            for (int64_t i = threadIdx.x; i < a.xs_floats / 4; i += blockDim.x) xs[i] = src[i];
            __syncthreads();
            act = (const uint8_t *)xs;
        }
    }
    if constexpr (XQ) {
        /* row r of the split layout at xs + r * act_blocks * 36: its codes,
         * then its scales (act_blocks is a multiple of 4, so rows stay
         * 16-byte aligned). Each thread takes half a block, 16 floats in four
         * 16-byte loads issued together (the rows fit one or two passes of the block's
         * threads); the two halves of a block are neighbouring lanes. */
        uint8_t *xs = (uint8_t *)(smem + n_warps * MV_NST * (MV_STAGE / 16));
        const int nb = (int)a.act_blocks, row_elems = nb * 32, total = n_rows * row_elems;
        const float *xf = a.xf;
        if (a.group_rows) xf += ((int64_t)blockIdx.x * a.rpb * a.rpw / a.group_rows) * a.xf_group_stride;
        bool first_pass = true;
        for (int e0 = 16 * threadIdx.x; e0 - 16 * (int)threadIdx.x < total; e0 += 16 * blockDim.x) {
            const bool on = e0 < total; /* every lane runs each pass: the halves meet in a shuffle */
            const int r = on ? e0 / row_elems : 0, e = on ? e0 - r * row_elems : 0;
            float4 v[4];
            const float4 *src = (const float4 *)(xf + r * a.xf_stride + e);
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] = on ? src[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (rope_cs) {
                if (first_pass) { /* the tables' entries, made by every thread above */
                    __syncthreads();
                    first_pass = false;
                }
                if (on) mv_rope_back(a, r, e, rope_cs, v);
            }
            uint4 codes;
            const float d = cuda_q8_0_quant_half(v, &codes);
            if (on) {
                uint8_t *row = xs + (int64_t)r * nb * (int64_t)sizeof(mv_q8_0);
                *(uint4 *)(row + e) = codes;
                if ((e & 31) == 0) ((float *)(row + row_elems))[e >> 5] = d;
            }
        }
        __syncthreads();
        act = xs;
    }
    if constexpr (!mv_float(T) && T != DS4_TYPE_Q8_0) {
        if (a.xf) {
            /* XK (one token's gate/up): x quantised to Q8_K blocks, a warp
             * each, in shared memory after the rings (and the IQ2_XXS
             * tables), while the first stages are in flight */
            uint8_t *xs = (uint8_t *)(smem + n_warps * MV_NST * (MV_STAGE / 16)) +
                          (T == DS4_TYPE_IQ2_XXS ? sizeof(iq2_tables) : 0);
            const int nb = (int)a.act_blocks;
            for (int ib = warp; ib < nb; ib += n_warps) mv_q8_K_warp(a.xf + (int64_t)ib * DS4_QK_K, xs, nb, ib);
            __syncthreads();
            act = xs;
        }
    }

    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    int j = 0, k = 0, slot = 0; /* row, stage within the row and buffer of stage s */
    /* the activation of row j: act_j (float rows), or the split quantised
     * row `act` from block blk_j (the group's first) */
    const uint8_t *act_j = act;
    int64_t blk_j = 0;
    if (a.group_rows && n_valid) {
        blk_j = (o_first / a.group_rows) * a.act_group_stride;
        act_j = act + blk_j * act_unit;
    }
    for (int s = 0; s < total; s++) {
        cp_async_wait<MV_NST - 2>();
        __syncwarp();
        issue();
        const uint8_t *sw = ring + slot * MV_STAGE;
        if (++slot == MV_NST) slot = 0;
        if constexpr (PACK) { /* rows j .. j + here - 1, their sums straight to red */
            const int here = n_valid - j < PR ? n_valid - j : PR;
            float *sums = &red[warp * rpw + j][0];
            if constexpr (T == DS4_TYPE_Q8_0) stage_q8_0_packed(sw, here, act, a.act_blocks, sums);
            else if (a.act_aligned) stage_q8k_packed<T, PACK, true>(sw, here, act, a.act_blocks, tab, sums);
            else stage_q8k_packed<T, PACK, false>(sw, here, act, a.act_blocks, tab, sums);
            j += here;
            continue;
        }
        const int first = k * G::STAGE_UNITS;
        const int cnt = n_units - first < G::STAGE_UNITS ? n_units - first : G::STAGE_UNITS;
        const int n_blocks = cnt * G::UNIT;
        const int64_t gb0 = (u0 + first) * G::UNIT; /* first block of the stage within the row */
        if constexpr (mv_float(T))
            stage_float<T, ROWS>(sw, n_blocks, gb0, (const float *)act_j, a.act_stride, n_rows, acc);
        else if constexpr (T == DS4_TYPE_Q8_0)
            stage_q8_0<ROWS>(sw, n_blocks, blk_j + gb0, act, a.act_stride, a.act_blocks, n_rows, acc);
        else if constexpr (ROWS == 1 && mv_one_row<T>::ON) {
            if (a.act_aligned)
                stage_q8k_one<T, true>(sw, n_blocks, blk_j + gb0, act, a.act_blocks, tab, acc[0]);
            else
                stage_q8k_one<T, false>(sw, n_blocks, blk_j + gb0, act, a.act_blocks, tab, acc[0]);
        } else if (a.act_aligned) /* one kernel, the stage decoder specialised both ways */
            stage_q8k<T, ROWS, true>(sw, n_blocks, blk_j + gb0, act, a.act_stride * act_unit, a.act_blocks, n_rows,
                                     tab, acc);
        else
            stage_q8k<T, ROWS, false>(sw, n_blocks, blk_j + gb0, act, a.act_stride * act_unit, a.act_blocks, n_rows,
                                      tab, acc);
        if (++k == spr) { /* row j done: its lane sum, then the next row */
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                float v = acc[r];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, off));
                if (lane == 0) red[warp * rpw + j][r] = v;
                acc[r] = 0.0f;
            }
            k = 0;
            j++;
            if (a.group_rows && j < n_valid) {
                blk_j = ((o_first + j) / a.group_rows) * a.act_group_stride;
                act_j = act + blk_j * act_unit;
            }
        }
    }
    cp_async_wait<0>();
    if (lane == 0)
        for (int jj = n_valid; jj < rpw; jj++)
#pragma unroll
            for (int r = 0; r < ROWS; r++) red[warp * rpw + jj][r] = 0.0f; /* skipped expert: products read 0 */
    __syncthreads();

    /* outputs of the block: q = lr * rpw + j, summed over the parts in order */
    const int per_block = a.rpb * rpw;
    for (int t = threadIdx.x; t < per_block * ROWS; t += blockDim.x) {
        const int q = t / ROWS, r = t % ROWS;
        const int qlr = q / rpw, qj = q % rpw;
        const int64_t oo = (int64_t)blockIdx.x * per_block + q;
        if (oo < a.n_out_z[z] && r < n_rows) {
            float s = 0.0f;
            if (a.experts_as_parts) {
                for (int p = 0; p < a.parts; p++) s = __fadd_rn(s, mv_finish<T>(red[(qlr * a.parts + p) * rpw + qj][r]));
            } else {
                for (int p = 0; p < a.parts; p++) s = __fadd_rn(s, red[(qlr * a.parts + p) * rpw + qj][r]);
                s = mv_finish<T>(s);
            }
            float *out;
            if (a.experts_as_parts) out = a.out[z] + (int64_t)blockIdx.y * a.out_token_stride + r * a.out_stride_z[z];
            else if (a.groups) out = a.out[z] + (int64_t)a.order[grp_first + r] * a.out_sel_stride;
            else out = a.out[z] + (a.sel ? (int64_t)blockIdx.y * a.out_sel_stride : 0) + r * a.out_stride_z[z];
            if (a.add[z]) s = __fadd_rn(s, cuda_load_float(a.add[z], a.add_type[z], oo));
            out[oo] = s;
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Host side                                                                 */
/* ------------------------------------------------------------------------ */

typedef void (*mv_fn)(mv_args);

template <int ROWS> static mv_fn mv_kernel_rows(uint32_t type, bool xq) {
    switch (type) {
    case DS4_TYPE_F32: return mv_kernel<DS4_TYPE_F32, ROWS, false>;
    case DS4_TYPE_F16: return mv_kernel<DS4_TYPE_F16, ROWS, false>;
    case DS4_TYPE_BF16: return mv_kernel<DS4_TYPE_BF16, ROWS, false>;
    case DS4_TYPE_Q8_0: return xq ? mv_kernel<DS4_TYPE_Q8_0, ROWS, true> : mv_kernel<DS4_TYPE_Q8_0, ROWS, false>;
    case DS4_TYPE_Q2_K: return mv_kernel<DS4_TYPE_Q2_K, ROWS, false>;
    case DS4_TYPE_Q4_K: return mv_kernel<DS4_TYPE_Q4_K, ROWS, false>;
    case DS4_TYPE_IQ2_XXS: return mv_kernel<DS4_TYPE_IQ2_XXS, ROWS, false>;
    case DS4_TYPE_Q8_K: return mv_kernel<DS4_TYPE_Q8_K, ROWS, false>;
    default: return NULL;
    }
}

/* The kernel for a weight type, activation row count and XQ (quantising its
 * own activations: Q8_0 only); NULL: none. */
static mv_fn mv_kernel_for(uint32_t type, int rows, bool xq) {
    if (xq && type != DS4_TYPE_Q8_0) return NULL;
    if (rows <= 1) return mv_kernel_rows<1>(type, xq);
    if (rows <= 2) return mv_kernel_rows<2>(type, xq);
    if (rows <= 4) return mv_kernel_rows<4>(type, xq);
    return mv_kernel_rows<8>(type, xq);
}

/* The packed one-row kernels (mv_pack, stage_q8_0_packed): rows of bpr
 * blocks, xq the kernels quantising their own x. */
struct mv_packed {
    uint32_t type;
    int bpr;
    bool xq;
    mv_fn fn;
};
static const mv_packed mv_packed_kernels[] = {
    { DS4_TYPE_Q2_K, 4, false, mv_kernel<DS4_TYPE_Q2_K, 1, false, 4> },
    { DS4_TYPE_Q2_K, 8, false, mv_kernel<DS4_TYPE_Q2_K, 1, false, 8> },
    { DS4_TYPE_IQ2_XXS, 8, false, mv_kernel<DS4_TYPE_IQ2_XXS, 1, false, 8> },
    { DS4_TYPE_IQ2_XXS, 16, false, mv_kernel<DS4_TYPE_IQ2_XXS, 1, false, 16> },
    { DS4_TYPE_Q8_0, 32, false, mv_kernel<DS4_TYPE_Q8_0, 1, false, 32> },
    { DS4_TYPE_Q8_0, 32, true, mv_kernel<DS4_TYPE_Q8_0, 1, true, 32> },
};
/* the packed kernel for rows of bpr blocks; NULL: none */
static mv_fn mv_packed_kernel(uint32_t type, int bpr, bool xq) {
    for (size_t i = 0; i < sizeof mv_packed_kernels / sizeof mv_packed_kernels[0]; i++)
        if (mv_packed_kernels[i].type == type && mv_packed_kernels[i].bpr == bpr && mv_packed_kernels[i].xq == xq)
            return mv_packed_kernels[i].fn;
    return NULL;
}

static const uint32_t mv_types[] = { DS4_TYPE_F32,  DS4_TYPE_F16,     DS4_TYPE_BF16, DS4_TYPE_Q8_0,
                                     DS4_TYPE_Q2_K, DS4_TYPE_Q4_K,    DS4_TYPE_IQ2_XXS, DS4_TYPE_Q8_K };
/* Bytes of activations an XQ kernel quantises into shared memory: one row
 * of 4096 (q_a, kv, the shared experts' gate and up, the head), four of 1024
 * (q_b). More would leave fewer than four blocks per SM (4 x 58 KB of the
 * 228 KB): those products keep the quantiser kernel. */
#define MV_XQ_MAX 4608
#define MV_XQ_MAX_BLOCKS 1056 /* ... and grids of at most two blocks per SM (132 x 4 fit at once) */
/* One row of up to 8192 (o_b) may take twice that when its grid fits one
 * wave at three blocks per SM (the 9 KB leave room for three, not four) */
#define MV_XQ_MAX_ONE 9216
#define MV_XQ_ONE_BLOCKS 396
/* One token's Q8_K activations an XK gate/up quantises (4096: 16 blocks),
 * after the IQ2_XXS tables: within MV_XQ_MAX_ONE of shared memory too */
#define MV_XK_MAX 4672
/* One float x row an XS kernel copies into shared memory (4,096 floats: the
 * compressors, indexer and router products of the 4,096-wide input) */
#define MV_XS_MAX 16384
static_assert(MV_XK_MAX + sizeof(iq2_tables) <= MV_XQ_MAX_ONE, "MV_SMEM_MAX holds an XK kernel's memory");
static_assert(MV_XQ_MAX_ONE + CUDA_MV_MAX_ROWS * 2 * CUDA_MV_ROPE_PAIRS * sizeof(float) <= MV_XS_MAX,
              "MV_SMEM_MAX holds an XQ kernel's rows and RoPE tables");
/* the dynamic shared memory of every matvec kernel: the rings, then the
 * IQ2_XXS tables or the quantised activations */
#define MV_SMEM_EXTRA_ (sizeof(iq2_tables) > MV_XQ_MAX_ONE ? sizeof(iq2_tables) : MV_XQ_MAX_ONE)
#define MV_SMEM_MAX ((size_t)MV_WARPS * MV_NST * MV_STAGE + (MV_SMEM_EXTRA_ > MV_XS_MAX ? MV_SMEM_EXTRA_ : MV_XS_MAX))

/* Once per backend: every matvec kernel may use MV_SMEM_MAX bytes of
 * dynamic shared memory (more than the default without opting in). */
static bool mv_allow_smem(ds4_backend *be) {
    cuda_backend *cb = cuda_impl(be);
    if (cb->mv_smem) return true;
    static const int rows[] = { 1, 2, 4, 8 };
    for (size_t t = 0; t < sizeof mv_types / sizeof mv_types[0]; t++)
        for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++)
            for (int xq = 0; xq <= (mv_types[t] == DS4_TYPE_Q8_0 ? 1 : 0); xq++)
                if (!cuda_allow_dynamic_smem(be, (const void *)mv_kernel_for(mv_types[t], rows[r], xq != 0),
                                             MV_SMEM_MAX, "matvec", 0))
                    return false;
    for (size_t i = 0; i < sizeof mv_packed_kernels / sizeof mv_packed_kernels[0]; i++)
        if (!cuda_allow_dynamic_smem(be, (const void *)mv_packed_kernels[i].fn, MV_SMEM_MAX, "matvec", 0))
            return false;
    cb->mv_smem = true;
    return true;
}

/* Launch with blocks of parts * rpb warps over n_out outputs (gridDim.y
 * expert slots, gridDim.z matrices). */
static bool mv_launch(ds4_backend *be, uint32_t type, mv_args a, int n_slots, int n_mats) {
    /* rows packed into stages (mv_pack, stage_q8_0_packed): one-row
     * products of whole short rows, warps of several rows, no groups.
     * (Rows per warp cut to a multiple of the rows per stage, Q2_K down
     * warps of 6 rows instead of 8 in stages of 3, 3 and 2, measured
     * slower: experts q2 42.6 / 206.7 / 742.7 us at 1 / 8 / 32 rows against
     * 41.1 / 203.6 / 723.8.) */
    const bool xk = a.xf != NULL && act_kind_for(type) == CUDA_MV_Q8_K; /* one token's gate/up: Q8_K in the kernel */
    const bool xq = a.xf != NULL && !xk;
    const int bpr = a.units == 1 || a.units == 2 || a.units == 4 ? (int)a.units * unit_blocks_of(type) : 0;
    const mv_fn packed_fn = cuda_impl(be)->mv_pack && (a.experts_as_parts || (a.n_rows == 1 && a.parts == 1)) &&
                                    !a.groups && !a.group_rows && a.rpw >= 2
                                ? mv_packed_kernel(type, bpr, xq)
                                : NULL;
    const int warps = a.parts * a.rpb;
    const int threads = 32 * warps;
    const size_t xq_bytes = xq ? (size_t)a.n_rows * (size_t)a.act_blocks * sizeof(mv_q8_0) : 0;
    const size_t xk_bytes = xk ? (size_t)a.act_blocks * sizeof(ds4_block_q8_K) : 0;
    /* XS: one float x row of a plain one-row product, whole 16-byte pieces
     * of every matrix's x, from shared memory */
    const int64_t row_floats = a.units * 8; /* (float types: 8 elements a 16-byte unit) */
    bool xs = cuda_impl(be)->mv_xs && cuda_is_float_type(type) && !packed_fn && a.n_rows == 1 && !a.sel &&
              !a.groups && !a.group_rows && !a.experts_as_parts && !a.xf && row_floats * 4 <= MV_XS_MAX;
    for (int z = 0; xs && z < n_mats; z++) xs = (uintptr_t)a.act[z] % 16 == 0;
    a.xs_floats = xs ? row_floats : 0;
    const size_t rope_bytes = a.rope_pos ? (size_t)a.n_rows * (size_t)a.rope.n_rot * sizeof(float) : 0;
    const size_t shm = (size_t)warps * MV_NST * MV_STAGE + (type == DS4_TYPE_IQ2_XXS ? sizeof(iq2_tables) : 0) +
                       xq_bytes + xk_bytes + (xs ? (size_t)row_floats * 4 : 0) + rope_bytes;
    const int64_t per_block = (int64_t)a.rpb * a.rpw;
    int64_t nb = (a.n_out + per_block - 1) / per_block;
    if (nb > INT32_MAX - 1 || n_slots > 65535) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "matvec: %lld outputs x %d slots is too large a grid", (long long)a.n_out,
                  n_slots);
        return false;
    }
    /* the kernel's 16-byte loads of x and its split layout in shared memory */
    if (xq && (xq_bytes > (a.n_rows == 1 ? MV_XQ_MAX_ONE : MV_XQ_MAX) || a.act_blocks % 4 != 0 || a.act_stride != a.act_blocks || a.sel ||
               (a.group_rows && (a.group_rows % per_block != 0 || a.act_group_stride != 0 || a.xf_group_stride % 4 != 0)) ||
               type != DS4_TYPE_Q8_0 || (uintptr_t)a.xf % 16 != 0 ||
               (a.n_rows > 1 && a.xf_stride % 4 != 0))) {
        cuda_fail(be, DS4_ERR_INVALID, "matvec: %d rows of %lld blocks cannot be quantised in the kernel", a.n_rows,
                  (long long)a.act_blocks);
        return false;
    }
    if (a.rope_pos && (!xq || !a.rope.table || a.rope.n_rot <= 0 || a.rope.n_rot % 2 != 0 || a.rope_head_dim <= 0 ||
                       a.rope.n_rot > a.rope_head_dim || (a.act_blocks * DS4_QK8_0) % a.rope_head_dim != 0 ||
                       a.xf_group_stride % a.rope_head_dim != 0)) {
        cuda_fail(be, DS4_ERR_INVALID, "matvec: x rows of %lld blocks cannot rotate %d dims of heads of %d back",
                  (long long)a.act_blocks, a.rope.n_rot, a.rope_head_dim);
        return false;
    }
    if (xk && (xk_bytes > MV_XK_MAX || a.n_rows != 1 || !a.sel || n_slots > a.slots_per_token ||
               a.act_token_stride != a.act_blocks || (uintptr_t)a.xf % 16 != 0)) {
        cuda_fail(be, DS4_ERR_INVALID, "matvec: %d x %d slots of %lld blocks cannot be quantised in the kernel",
                  a.n_rows, n_slots, (long long)a.act_blocks);
        return false;
    }
    const mv_fn fn = packed_fn ? packed_fn : mv_kernel_for(type, a.experts_as_parts ? 1 : a.n_rows, xq);
    if (act_kind_for(type) == CUDA_MV_Q8_K) {
        /* a row's codes start at its base (groups are whole 256-byte blocks
         * in): the bases, rows or expert slots (act_stride) and tokens
         * (act_token_stride) of 292-byte blocks apart, must be 16-byte aligned */
        const int64_t bb = (int64_t)sizeof(ds4_block_q8_K);
        bool bases = true;
        for (int z = 0; z < n_mats; z++) bases = bases && (uintptr_t)a.act[z] % 16 == 0;
        a.act_aligned = xk || (bases && (a.act_stride * bb) % 16 == 0 && (a.act_token_stride * bb) % 16 == 0);
    }
    if (!fn) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "matvec: no kernel for type %s", ds4_type_name(type));
        return false;
    }
    if (!mv_allow_smem(be)) return false;
    for (int z = 0; z < n_mats; z++) { /* one output count for all matrices unless the caller set them */
        if (!a.n_out_z[z]) a.n_out_z[z] = a.n_out;
        if (!a.out_stride_z[z]) a.out_stride_z[z] = a.out_stride;
    }
    static const bool prefetch = cuda_env_flag("DS4_CUDA_MV_PREFETCH", true);
    a.prefetch = prefetch ? 1 : 0;
    /* a deferred HC Sinkhorn rides along with a long enough product (its
     * weight bytes, counting every slot and matrix) */
    double outs = 0.0;
    for (int z = 0; z < n_mats; z++) outs += (double)a.n_out_z[z];
    const double wbytes = (double)a.row_bytes * outs * n_slots * (a.experts_as_parts ? a.parts : 1);
    if (cuda_hc_take_comb(cuda_impl(be), wbytes, &a.comb)) {
        a.comb_blocks = (a.comb.n_rows + warps - 1) / warps;
        nb += a.comb_blocks;
    }
    const dim3 grid((unsigned)nb, (unsigned)n_slots, (unsigned)n_mats);
    if (!cuda_launch(be, "matvec kernel", fn, grid, threads, shm, a)) return false;
    if (packed_fn) cuda_impl(be)->mv_packed_launches++;
    return true;
}

/* Rows per warp when a warp holds whole rows (no K split): double while at
 * least MV_MIN_WARPS warps would remain of n_warps, so short rows stream
 * back to back (DS4_CUDA_MV_RPW=0: one row per warp; DS4_CUDA_MV_MIN_WARPS
 * sets the bound, for tuning, and DS4_CUDA_MV_MIN_WARPS_MOE that of the
 * routed experts' products alone, MV_MIN_WARPS_MOE by default). */
static int rows_per_warp(bool whole_rows, int64_t n_warps, bool moe = false) {
    static const bool multi = cuda_env_flag("DS4_CUDA_MV_RPW", true);
    static const long dense = cuda_env_long("DS4_CUDA_MV_MIN_WARPS", MV_MIN_WARPS, 1, 1L << 20);
    static const long experts = cuda_env_long("DS4_CUDA_MV_MIN_WARPS_MOE", MV_MIN_WARPS_MOE, 1, 1L << 20);
    const long min_warps = moe ? experts : dense;
    int r = 1;
    if (!whole_rows || !multi) return 1;
    while (r < MV_MAX_RPW && n_warps / (2 * r) >= min_warps) r *= 2;
    return r;
}

/* Parts per output for n_outputs warps' worth of rows of `units` units of
 * a weight type (DS4_CUDA_MV_TARGET_WARPS sets the warps aimed at, for
 * tuning; DS4_CUDA_MV_TARGET_WARPS_FLOAT that of the F32/F16/BF16 rows
 * alone, twice the other by default: the F16 products (router,
 * compressors, indexer) gain from the finer split where the Q8_0 ones
 * slowed, decode 1.016x with 2048 against 1024). */
static int split_for(int64_t n_outputs, int64_t units, uint32_t type) {
    static const long target = cuda_env_long("DS4_CUDA_MV_TARGET_WARPS", MV_TARGET_WARPS, 1, 1L << 20);
    static const long target_float = cuda_env_long("DS4_CUDA_MV_TARGET_WARPS_FLOAT", 2 * target, 1, 1L << 20);
    const long t = mv_float(type) ? target_float : target;
    int p = 1;
    while (p < MV_WARPS && n_outputs * p < t && 2 * p <= units) p *= 2;
    return p;
}

/* The split, warp rows and rows per warp of a plain (or grouped, or
 * several-matrix, or with moe the routed experts') launch over n_out_total
 * outputs of `units` units. */
static void plain_geometry(mv_args *a, uint32_t type, int64_t n_out_total, bool moe = false) {
    a->parts = split_for(n_out_total, a->units, type);
    a->rpb = MV_WARPS / a->parts;
    a->rpw = rows_per_warp(a->parts == 1, n_out_total, moe);
}

/* Outputs per thread block of a plain (or grouped) Q8_0 launch over total
 * outputs of rows of n (plain_geometry's split and rows per warp). */
static int64_t q8_0_outputs_per_block(int64_t n, int64_t total) {
    mv_args a;
    memset(&a, 0, sizeof a);
    a.units = n / (8 * DS4_QK8_0);
    plain_geometry(&a, DS4_TYPE_Q8_0, total);
    return (int64_t)a.rpb * a.rpw;
}

bool cuda_mv_quantises(ds4_backend *be, uint32_t type, int64_t n, int64_t n_rows, const int64_t *n_outs, int n_mats) {
    if (!cuda_impl(be)->mv_xq || type != DS4_TYPE_Q8_0 || n <= 0 || n % (8 * DS4_QK8_0) != 0 || n_rows < 1) return false;
    static const bool wide = cuda_env_flag("DS4_CUDA_MV_XQ_WIDE", true); /* (=0: MV_XQ_MAX for one row too) */
    const int64_t xq_bytes = (n / DS4_QK8_0) * n_rows * (int64_t)sizeof(mv_q8_0);
    if (xq_bytes > (n_rows == 1 && wide ? MV_XQ_MAX_ONE : MV_XQ_MAX)) return false;
    /* every thread block quantises all of x again: only while the grid is
     * about one wave (the head's 2,020 blocks would each redo it) */
    int64_t total = 0, most = 0;
    for (int z = 0; z < n_mats; z++) total += n_outs[z], most = n_outs[z] > most ? n_outs[z] : most;
    const int64_t per_block = q8_0_outputs_per_block(n, total);
    const int64_t blocks = (most + per_block - 1) / per_block * n_mats;
    return blocks <= (xq_bytes > MV_XQ_MAX ? MV_XQ_ONE_BLOCKS : MV_XQ_MAX_BLOCKS);
}

bool cuda_mv_grouped_quantises(ds4_backend *be, uint32_t type, int64_t n, int64_t n_out, int64_t n_groups,
                               int64_t n_rows) {
    const int64_t total = n_out * n_groups;
    if (n_groups < 2 || !cuda_mv_quantises(be, type, n, n_rows, &total, 1)) return false;
    return n_out % q8_0_outputs_per_block(n, total) == 0; /* no block straddles two groups */
}

bool cuda_mv_rope_fits(const ds4_rope *rope, int64_t head_dim, int64_t n, int64_t group_stride) {
    return rope && rope->n_rot > 0 && rope->n_rot % 2 == 0 && rope->n_rot / 2 <= CUDA_MV_ROPE_PAIRS &&
           head_dim >= rope->n_rot && head_dim <= INT32_MAX && n % head_dim == 0 && group_stride % head_dim == 0;
}

bool cuda_mv_run(ds4_backend *be, const cuda_mv_job *j) { return cuda_mv_run_grouped(be, j, 1, 0); }

bool cuda_mv_run_grouped(ds4_backend *be, const cuda_mv_job *j, int64_t n_groups, int64_t act_group_stride) {
    if (j->n_rows < 1 || j->n_rows > CUDA_MV_MAX_ROWS || n_groups < 1 ||
        !cuda_mv_fits(j->type, j->act_kind, j->row_bytes, j->n)) {
        cuda_fail(be, DS4_ERR_INVALID, "matvec: %d rows of type %s in %lld groups do not suit the kernels", j->n_rows,
                  ds4_type_name(j->type), (long long)n_groups);
        return false;
    }
    mv_args a;
    memset(&a, 0, sizeof a);
    a.w[0] = a.w[1] = (const uint8_t *)j->w;
    a.act[0] = a.act[1] = j->act;
    a.out[0] = a.out[1] = j->out;
    a.row_bytes = j->row_bytes;
    a.units = j->row_bytes / unit_bytes_of(j->type);
    a.row0 = j->row0;
    a.n_out = j->n_out * n_groups; /* outputs of all groups, in order */
    a.act_stride = j->act_stride;
    a.act_blocks = j->act_stride; /* rows of the job's activations are act_stride blocks */
    a.out_stride = j->out_stride;
    a.n_rows = j->n_rows;
    a.xf = j->xf;
    a.xf_stride = j->xf_stride;
    if (j->rope) {
        a.rope_pos = j->rope_pos;
        a.rope_head_dim = (int)j->rope_head_dim;
        a.rope = cuda_rope_params_of<CUDA_MV_ROPE_PAIRS>(j->rope, true);
    }
    if (n_groups > 1) {
        a.group_rows = j->n_out;
        if (j->xf) a.xf_group_stride = act_group_stride; /* (floats: the kernel quantises each group's slice) */
        else a.act_group_stride = act_group_stride;
    }
    plain_geometry(&a, j->type, a.n_out);
    return mv_launch(be, j->type, a, 1, 1);
}

bool cuda_mv_run_multi(ds4_backend *be, const cuda_mv_job *j, int n) {
    bool ok = n >= 1 && n <= CUDA_MV_MAX_MATS && j[0].n_rows >= 1 && j[0].n_rows <= CUDA_MV_MAX_ROWS &&
              cuda_mv_fits(j[0].type, j[0].act_kind, j[0].row_bytes, j[0].n);
    for (int z = 1; ok && z < n; z++)
        ok = j[z].type == j[0].type && j[z].act_kind == j[0].act_kind && j[z].row_bytes == j[0].row_bytes &&
             j[z].n == j[0].n && j[z].row0 == j[0].row0 && j[z].n_rows == j[0].n_rows && j[z].xf == j[0].xf &&
             j[z].xf_stride == j[0].xf_stride;
    for (int z = 0; ok && z < n; z++) ok = j[z].n_out >= 1;
    if (!ok) {
        cuda_fail(be, DS4_ERR_INVALID, "matvec: %d products of one input that do not suit one launch", n);
        return false;
    }
    mv_args a;
    memset(&a, 0, sizeof a);
    int64_t total = 0;
    for (int z = 0; z < n; z++) {
        a.w[z] = (const uint8_t *)j[z].w;
        a.act[z] = j[z].act;
        a.out[z] = j[z].out;
        a.n_out_z[z] = j[z].n_out;
        a.out_stride_z[z] = j[z].out_stride;
        a.n_out = j[z].n_out > a.n_out ? j[z].n_out : a.n_out;
        a.add[z] = j[z].add;
        a.add_type[z] = j[z].add_type;
        total += j[z].n_out;
    }
    a.row_bytes = j[0].row_bytes;
    a.units = j[0].row_bytes / unit_bytes_of(j[0].type);
    a.row0 = j[0].row0;
    a.act_stride = j[0].act_stride;
    a.act_blocks = j[0].act_stride;
    a.n_rows = j[0].n_rows;
    a.xf = j[0].xf;
    a.xf_stride = j[0].xf_stride;
    plain_geometry(&a, j[0].type, total); /* the split and rows per warp of all the outputs together */
    return mv_launch(be, j[0].type, a, 1, n);
}

bool cuda_mv_moe_gate_up(ds4_backend *be, const ds4_weight *gate, const ds4_weight *up, cuda_mv_act kind_g,
                         cuda_mv_act kind_u, const void *act_gate, const void *act_up, int64_t act_gate_stride,
                         int64_t act_up_stride, const int32_t *sel, int n_used, int64_t n_tokens, float *g, float *u,
                         cuda_dev_error *err, int err_tag, const float *xf) {
    const int64_t slots = (int64_t)n_used * n_tokens;
    if (n_used < 1 || slots > 65535) {
        cuda_fail(be, DS4_ERR_INVALID, "matvec: %lld expert slots of %s (at most 65535)", (long long)slots,
                  cuda_wname(gate));
        return false;
    }
    const int64_t act_strides[2] = { act_gate_stride, act_up_stride };
    const int64_t dim = gate->ne[0], n_ff = gate->ne[1];
    const bool shared = gate->type == up->type && gate->row_bytes == up->row_bytes;
    const ds4_weight *ws[2] = { gate, up };
    const void *acts[2] = { act_gate, act_up };
    float *outs[2] = { g, u };
    const cuda_mv_act kinds[2] = { kind_g, kind_u };
    for (int m = 0; m < 2; m += shared ? 2 : 1) {
        mv_args a;
        memset(&a, 0, sizeof a);
        for (int z = 0; z < 2; z++) {
            const int src = shared ? z : m;
            a.w[z] = (const uint8_t *)ws[src]->device;
            a.act[z] = acts[src];
            a.out[z] = outs[src];
        }
        const ds4_weight *w = ws[m];
        if (!cuda_mv_fits(w->type, kinds[m], w->row_bytes, dim)) {
            cuda_fail(be, DS4_ERR_INVALID, "matvec: weight %s does not suit the kernels", cuda_wname(w));
            return false;
        }
        a.row_bytes = w->row_bytes;
        a.units = w->row_bytes / unit_bytes_of(w->type);
        a.n_out = n_ff;
        a.act_stride = 0;
        a.out_stride = 0;
        a.sel = sel;
        a.err = m == 0 ? err : NULL; /* (one report: the first launch's) */
        a.err_tag = err_tag;
        a.rows_per_expert = n_ff;
        a.n_expert = w->ne[2];
        a.out_sel_stride = n_ff;
        a.slots_per_token = n_used;
        a.act_token_stride = act_strides[m]; /* gate and up share it when they share a launch */
        a.act_blocks = act_strides[m];
        a.n_rows = 1;
        a.xf = xf;
        plain_geometry(&a, w->type, n_ff * slots * (shared ? 2 : 1), true);
        if (!mv_launch(be, w->type, a, (int)slots, shared ? 2 : 1)) return false;
    }
    return true;
}

bool cuda_mv_moe_quantises(const ds4_weight *gate, const ds4_weight *up, cuda_mv_act kind_g, cuda_mv_act kind_u,
                           int64_t n_tokens) {
    static const bool on = cuda_env_flag("DS4_CUDA_MOE_XK", true); /* (=0: the quantiser kernel, for A/B) */
    const int64_t dim = gate->ne[0];
    return on && n_tokens == 1 && kind_g == CUDA_MV_Q8_K && kind_u == CUDA_MV_Q8_K && gate->type == up->type &&
           gate->row_bytes == up->row_bytes && dim % DS4_QK_K == 0 &&
           (dim / DS4_QK_K) * (int64_t)sizeof(ds4_block_q8_K) <= MV_XK_MAX;
}

bool cuda_mv_moe_grouped(ds4_backend *be, const ds4_weight *const *ws, float *const *outs, int n_mats, cuda_mv_act kind,
                         const void *act, int64_t act_stride, const int32_t *groups, const int32_t *order,
                         int64_t n_groups, int max_rows, int64_t out_stride, int64_t split_outputs) {
    const ds4_weight *w = ws[0];
    bool ok = n_mats >= 1 && n_mats <= 2 && n_groups >= 1 && n_groups <= 65535 &&
              cuda_mv_rows_built(max_rows) &&
              cuda_mv_fits(w->type, kind, w->row_bytes, w->ne[0]);
    for (int z = 1; ok && z < n_mats; z++)
        ok = ws[z]->type == w->type && ws[z]->row_bytes == w->row_bytes && ws[z]->ne[1] == w->ne[1] &&
             ws[z]->ne[2] == w->ne[2];
    if (!ok) {
        cuda_fail(be, DS4_ERR_INVALID, "matvec: %lld expert groups of %s do not suit the kernels", (long long)n_groups,
                  cuda_wname(w));
        return false;
    }
    mv_args a;
    memset(&a, 0, sizeof a);
    for (int z = 0; z < n_mats; z++) {
        a.w[z] = (const uint8_t *)ws[z]->device;
        a.act[z] = act;
        a.out[z] = outs[z];
    }
    a.row_bytes = w->row_bytes;
    a.units = w->row_bytes / unit_bytes_of(w->type);
    a.n_out = w->ne[1];
    a.rows_per_expert = w->ne[1];
    a.n_expert = w->ne[2];
    a.act_stride = act_stride;
    a.act_blocks = act_stride;
    a.out_sel_stride = out_stride;
    a.n_rows = max_rows; /* the kernel for that many rows; each group has its own count */
    a.groups = (const int4 *)groups;
    a.order = order;
    /* the split of the streaming path this stands for (its rows' sums in the
     * same order), or whole rows */
    a.parts = split_outputs > 0 ? split_for(split_outputs, a.units, w->type) : 1;
    a.rpb = MV_WARPS / a.parts;
    a.rpw = rows_per_warp(a.parts == 1, a.n_out * n_groups * n_mats, true);
    return mv_launch(be, w->type, a, (int)n_groups, n_mats);
}

bool cuda_mv_moe_down(ds4_backend *be, const ds4_weight *down, cuda_mv_act kind, const void *mids, int64_t act_stride,
                      const int32_t *sel, int n_used, int64_t n_tokens, float *out, int64_t out_stride) {
    const int64_t n_ff = down->ne[0], dim = down->ne[1];
    if (n_used < 1 || n_used > CUDA_MV_MAX_PARTS || n_tokens < 1 || n_tokens > 65535 ||
        !cuda_mv_fits(down->type, kind, down->row_bytes, n_ff)) {
        cuda_fail(be, DS4_ERR_INVALID, "matvec: %d experts of %s do not suit the kernels", n_used, cuda_wname(down));
        return false;
    }
    mv_args a;
    memset(&a, 0, sizeof a);
    a.w[0] = a.w[1] = (const uint8_t *)down->device;
    a.act[0] = a.act[1] = mids;
    a.out[0] = a.out[1] = out;
    a.row_bytes = down->row_bytes;
    a.units = down->row_bytes / unit_bytes_of(down->type);
    a.n_out = dim;
    a.act_stride = act_stride;
    a.act_blocks = act_stride;
    a.out_stride = 0;
    a.sel = sel;
    a.rows_per_expert = dim;
    a.n_expert = down->ne[2];
    a.n_rows = 1;
    a.parts = n_used;
    a.rpb = MV_WARPS / n_used > 0 ? MV_WARPS / n_used : 1;
    a.rpw = rows_per_warp(true, dim * n_used * n_tokens, true); /* the parts are experts: each warp holds whole rows */
    a.experts_as_parts = 1;
    a.out_token_stride = out_stride;
    return mv_launch(be, down->type, a, (int)n_tokens, 1);
}

/* ------------------------------------------------------------------------ */
/* Expert-grouped products on the int8 tensor cores                          */
/* ------------------------------------------------------------------------ */
/*
 * The grouped MoE's gate/up and down for IQ2_XXS, Q2_K and Q4_K weights
 * times Q8_K activations (the sorted rows of one expert). A block's integer
 * sums are exact whatever adds them, so the int8 MMA m16n8k32 (s8 x s8 ->
 * s32) makes them: one k32 step is one 32-element sub-block (the decoders'
 * `codes`, each weight decoded once per block for all of its tokens).
 * IQ2_XXS and Q4_K scale a sub-block's sum by its scale (an integer
 * multiply per accumulator); Q2_K's 16-element scales (<= 15, codes <= 3)
 * are folded into the codes (<= 45, still int8), so its sums accumulate in
 * the MMA itself; the mins' sum (sum_j m_j bsum_j = sum_k m(k) q8_k) is a
 * second MMA whose A fragments are the replicated mins. Each 256-block's
 * float term is then formed as the one-row kernels form it and added to
 * the row's sum block after block in order: the CPU's ds4_dot_q8_K_* sums,
 * bit for bit.
 *
 * Tiling: a thread block is 64 weight rows x the group's tokens, up to
 * 8 NT of them in NT 8-token MMA tiles (the empty ones skipped): NT = 4
 * (4 warps, one per 16 rows) for groups of up to 32 tokens, NT = 8 (8
 * warps: warps w and w + 4 share rows, each taking 4 of the tiles) for up
 * to 64, so an expert's weights are decoded once for up to 64 of its
 * tokens, the decode spread over twice the threads. Per 256-block stage
 * the weights are decoded into shared memory (rows 272 bytes apart: the
 * fragment reads of 8 rows x 4 threads hit 32 banks) and the tokens' codes
 * copied beside them. The stages are pipelined: while stage st is decoded
 * (from its raw blocks in shared memory) and multiplied, stage st + 1's raw
 * blocks are in flight to registers and its activation codes to the other
 * of two buffers (cp.async).
 */
#define MOE_MMA_BM 64
#define MOE_MMA_PITCH 272
static_assert(CUDA_MOE_MMA_ROWS == 64, "at most eight 8-token tiles per block");
/* threads of a block of NT token tiles: a warp per 16 rows per 4 tiles */
template <int NT> struct moe_tiles {
    static_assert(NT == 4 || NT == 8, "four or eight token tiles");
    static constexpr int TOKENS = 8 * NT, THREADS = 32 * (MOE_MMA_BM / 16) * (NT / 4);
    static constexpr int PER_ROW = THREADS / MOE_MMA_BM; /* threads fetching one row's raw block */
};

struct moe_mma_args {
    const uint8_t *w[2]; /* the matrices (gate and up share a launch) */
    float *out[2];
    int64_t row_bytes, rows_per_expert, n_expert;
    const uint8_t *act; /* sorted Q8_K rows, split layout, act_blocks blocks each, act_pitch bytes apart */
    int64_t act_blocks, act_pitch;
    const int4 *groups; /* (expert, first sorted row, rows <= 32, 0) */
    const int32_t *order;
    int64_t out_stride;
};

/* A stage's raw weight blocks go to shared memory by cp.async in pieces of
 * CH bytes (16 where the block size allows, else 4): a block of BB bytes
 * starts `shift` = (its address & (CH - 1)) bytes into its first piece
 * (IQ2_XXS's 66-byte blocks: 0 or 2; Q2_K's 84 and Q4_K's 144: 0) and sits
 * so in its row of shared memory. W16 (rows of a multiple of 16 bytes from
 * a 16-byte aligned base: the real model's experts): the 16-byte pieces of
 * the aligned window around the block (IQ2_XXS: 5 of them, its shift 0 ..
 * 14; Q2_K: 6, shift 0 .. 12), which never leave the block's row, instead
 * of 17 or 22 pieces of 4 bytes: fewer copies and address sums a stage. */
template <uint32_t T, bool W16 = false> struct moe_raw {
    static constexpr int BB = mvt<T>::BLOCK_BYTES;
    static constexpr int CH = BB % 16 == 0 || W16 ? 16 : 4;
    static constexpr int GCD16 = BB % 16 == 0 ? 16 : BB % 8 == 0 ? 8 : BB % 4 == 0 ? 4 : BB % 2 == 0 ? 2 : 1;
    static constexpr int PIECES = BB % 16 == 0 ? BB / 16
                                  : W16        ? (BB + (16 - GCD16) + 15) / 16 /* the largest shift is 16 - gcd */
                                               : (BB + 2 + CH - 1) / CH;     /* pieces a row's block may span */
    static constexpr int PITCH = (CH * PIECES + 15) / 16 * 16; /* bytes per row in shared memory */
    static_assert(W16 || BB % 16 == 0 || BB % 2 == 0, "4-byte pieces: blocks 2-byte aligned");
};

/* The cp.asyncs of stage st's raw blocks (rows n0..; rows past n_rows read
 * nothing and are zero-filled), PER threads a row; no copy reads past the
 * block. */
template <uint32_t T, int PER, bool W16>
static __device__ __forceinline__ void moe_raw_fetch(uint8_t *s_raw, const uint8_t *wexp, int64_t row_bytes,
                                                     int64_t n_rows, int64_t n0, int64_t st) {
    typedef moe_raw<T, W16> R;
    const int r = threadIdx.x / PER, part = threadIdx.x % PER;
    const bool ok = n0 + r < n_rows;
    const uint8_t *blk = wexp + (ok ? (n0 + r) * row_bytes + st * R::BB : 0);
    const int shift = (int)((uintptr_t)blk & (R::CH - 1));
    const uint8_t *src = blk - shift;
    uint8_t *dst = s_raw + r * R::PITCH;
#pragma unroll
    for (int j = part; j < R::PIECES; j += PER) {
        const int left = shift + R::BB - R::CH * j; /* the block's bytes from this piece on */
        const int n = !ok ? 0 : left >= R::CH ? R::CH : left;
        if constexpr (R::CH == 16) {
            /* (W16: a piece that starts inside the block lies inside its row; later ones read nothing) */
            cp_async16(dst + 16 * j, src + 16 * j, ok && left > 0);
        } else {
            const unsigned d = cuda_smem_addr(dst + 4 * j);
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src + 4 * j), "r"(n)
                         : "memory");
        }
    }
}

/* Where the block of row n at stage st starts in its row of shared memory. */
template <uint32_t T, bool W16>
static __device__ __forceinline__ int moe_raw_shift(const uint8_t *wexp, int64_t row_bytes, int64_t n, int64_t st) {
    typedef moe_raw<T, W16> R;
    if constexpr (W16) return (int)((st * R::BB) & 15); /* (the row starts 16-byte aligned) */
    return (int)((uintptr_t)(wexp + n * row_bytes + st * R::BB) & (R::CH - 1));
}

/* Shared memory of moe_mma_kernel<T, NT, W16> (dynamic: past 48 KB), in order. */
template <uint32_t T, int NT, bool W16> struct moe_smem {
    static constexpr bool FOLD = T == DS4_TYPE_Q2_K, HAS_MIN = mvq<T>::HAS_MIN;
    static constexpr int HALVES = T == DS4_TYPE_Q2_K ? 2 : 1; /* distinct mins per sub-block */
    static constexpr size_t W = 0;                                                  /* decoded codes */
    static constexpr size_t X = W + MOE_MMA_BM * MOE_MMA_PITCH;                     /* 2 stages of activation codes */
    static constexpr size_t RAW = X + 2 * moe_tiles<NT>::TOKENS * MOE_MMA_PITCH;   /* 2 stages of raw blocks */
    /* (rows of the scale tables padded by a word: the fragment reads of rows g = 0..7 hit 8 banks) */
    static constexpr int MUL_PITCH = 9, MIN_PITCH = 8 * HALVES + 1;
    static constexpr size_t MUL = RAW + 2 * MOE_MMA_BM * moe_raw<T, W16>::PITCH;           /* int [64][9] */
    static constexpr size_t MIN = MUL + (FOLD ? 0 : (MOE_MMA_BM * MUL_PITCH * 4 + 15) / 16 * 16); /* u32 [64][..] */
    static constexpr size_t D = MIN + (HAS_MIN ? (MOE_MMA_BM * MIN_PITCH * 4 + 15) / 16 * 16 : 0); /* d[64], dm[64] */
    static constexpr size_t XD = D + 2 * MOE_MMA_BM * 4;                            /* float [2][8 NT] */
    static constexpr size_t TAB = XD + 2 * moe_tiles<NT>::TOKENS * 4;               /* IQ2_XXS tables */
    static constexpr size_t BYTES = TAB + (T == DS4_TYPE_IQ2_XXS ? sizeof(iq2_tables) : 0);
};

/* This thread's pieces of a stage's activation codes (moe_x_fetch): piece
 * it is 16 bytes of token t = i / 16 (i = tid + it THREADS), its source
 * row's start for stage 0 (src; st * 256 bytes on for stage st), its place
 * in s_x (dst) and whether it copies (t < 8 n_tiles) and reads (t < rows):
 * made once, so a stage's copies take no address arithmetic. */
template <int NT> struct moe_x_pieces {
    static constexpr int IT = moe_tiles<NT>::TOKENS * 16 / moe_tiles<NT>::THREADS;
    const uint8_t *src[IT];
    int dst[IT];
    bool use[IT], ok[IT];
    const float *xd; /* tid < 8 NT: its token's scales (NULL past the group's rows) */
};
template <int NT>
static __device__ __forceinline__ moe_x_pieces<NT> moe_x_plan(const uint8_t *x0, int64_t xrow, int rows, int n_tiles,
                                                              int64_t act_blocks) {
    typedef moe_tiles<NT> N;
    moe_x_pieces<NT> p;
    const int tid = threadIdx.x;
#pragma unroll
    for (int it = 0; it < p.IT; it++) {
        const int i = tid + it * N::THREADS, t = i >> 4, c = i & 15;
        p.use[it] = t < 8 * n_tiles;
        p.ok[it] = t < rows;
        p.src[it] = x0 + (t < rows ? t * xrow + 16 * c : 0);
        p.dst[it] = t * MOE_MMA_PITCH + 16 * c;
    }
    p.xd = tid < N::TOKENS && tid < rows ? (const float *)(x0 + tid * xrow + act_blocks * DS4_QK_K) : NULL;
    return p;
}

/* Stage st's activation codes of the group's first 8 n_tiles rows into s_x
 * (cp.async; rows past the group's zero-filled), and this thread's scale
 * (tid < 8 NT) for s_xd. */
template <int NT>
static __device__ __forceinline__ void moe_x_fetch(uint8_t *s_x, const moe_x_pieces<NT> &p, int64_t st, float *xd) {
    typedef moe_tiles<NT> N;
#pragma unroll
    for (int it = 0; it < p.IT; it++)
        if (p.use[it]) cp_async16(s_x + p.dst[it], p.src[it] + (p.ok[it] ? st * DS4_QK_K : 0), p.ok[it]);
    cp_async_commit();
    if (threadIdx.x < N::TOKENS) *xd = p.xd ? p.xd[st] : 0.0f;
}

/* MB: the blocks an SM the registers must allow (launch bounds): 1 (the
 * kernel of eight tiles then takes 95 registers: two blocks, 16 warps an
 * SM) or 3 (80 registers and a few bytes of spill: 24 warps an SM, as the
 * shared memory of eight tiles, about 67 KB, allows;
 * ds4_cuda_backend_set_moe_mma_blocks) */
template <uint32_t T, int NT, bool W16, int MB>
__global__ void __launch_bounds__(moe_tiles<NT>::THREADS, MB) moe_mma_kernel(moe_mma_args a) {
    typedef mvq<T> K;
    typedef moe_raw<T, W16> R;
    typedef moe_smem<T, NT, W16> L;
    typedef moe_tiles<NT> N;
    constexpr bool FOLD = L::FOLD; /* scales folded into the codes */
    constexpr int HALVES = L::HALVES;
    extern __shared__ __align__(16) uint8_t moe_sm[];
    uint8_t *s_w = moe_sm + L::W;
    uint8_t(*s_x)[N::TOKENS * MOE_MMA_PITCH] = (uint8_t(*)[N::TOKENS * MOE_MMA_PITCH])(moe_sm + L::X);
    uint8_t(*s_raw)[MOE_MMA_BM * R::PITCH] = (uint8_t(*)[MOE_MMA_BM * R::PITCH])(moe_sm + L::RAW);
    int *s_mul = (int *)(moe_sm + L::MUL);             /* [row * MUL_PITCH + sub] */
    uint32_t *s_min = (uint32_t *)(moe_sm + L::MIN); /* [row * MIN_PITCH + sub * HALVES + half]: mins, in each byte */
    float *s_d = (float *)(moe_sm + L::D), *s_dm = s_d + MOE_MMA_BM;
    float(*s_xd)[N::TOKENS] = (float(*)[N::TOKENS])(moe_sm + L::XD);
    iq2_tables *s_tab = (iq2_tables *)(moe_sm + L::TAB); /* IQ2_XXS only */
    const iq2_ref tab{ s_tab, IQ2_POS };
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    if constexpr (T == DS4_TYPE_IQ2_XXS) /* constant data: before the wait */
        for (int i = tid; i < (int)(sizeof(iq2_tables) / 16); i += N::THREADS)
            ((uint4 *)s_tab)[i] = ((const uint4 *)&g_iq2_tables)[i];
    cuda_grid_wait();
    const int z = blockIdx.z;
    const int4 grp = a.groups[blockIdx.y];
    const int rows = grp.z;
    if (grp.x < 0 || grp.x >= a.n_expert || rows < 1 || rows > N::TOKENS) return; /* the whole block */
    const int64_t n0 = (int64_t)blockIdx.x * MOE_MMA_BM;
    /* (not a.w[z]: a parameter array indexed at run time is copied to local memory) */
    const uint8_t *wexp = (z ? a.w[1] : a.w[0]) + (int64_t)grp.x * a.rows_per_expert * a.row_bytes;
    float *out = z ? a.out[1] : a.out[0];
    const int64_t xrow = a.act_pitch;
    const uint8_t *x0 = a.act + (int64_t)grp.y * xrow;
    const int n_tiles = (rows + 7) >> 3;

    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int k = 0; k < 4; k++) acc[j][k] = 0.0f;

    /* the pipeline: stage st + 1's raw weights (registers) and activations
     * (cp.async) are in flight while stage st is decoded and multiplied */
    float xd_next = 0.0f;
    const moe_x_pieces<NT> xp = moe_x_plan<NT>(x0, xrow, rows, n_tiles, a.act_blocks);
    moe_raw_fetch<T, N::PER_ROW, W16>(s_raw[0], wexp, a.row_bytes, a.rows_per_expert, n0, 0);
    moe_x_fetch<NT>(s_x[0], xp, 0, &xd_next); /* (commits both) */
    if (tid < N::TOKENS) s_xd[0][tid] = xd_next;
    cp_async_wait<0>();

    const int ra = 16 * (warp & 3) + g, rb = ra + 8; /* this thread's two weight rows in the tile */
    const int j0 = NT == 8 ? 4 * (warp >> 2) : 0;     /* its first token tile */
    /* this lane's ldmatrix rows: of A, row 16 (warp & 3) + (lane & 7) + 8 ((lane >> 3) & 1) at
     * K 16 (lane >> 4); of B, token 8 (j0 + (lane >> 4)) + (lane & 7) at K 16 ((lane >> 3) & 1) */
    const unsigned a_lane = (unsigned)((16 * (warp & 3) + (lane & 7) + 8 * ((lane >> 3) & 1)) * MOE_MMA_PITCH +
                                       16 * (lane >> 4));
    const unsigned b_lane = (unsigned)((8 * (j0 + (lane >> 4)) + (lane & 7)) * MOE_MMA_PITCH + 16 * ((lane >> 3) & 1));
    for (int64_t st = 0; st < a.act_blocks; st++) {
        __syncthreads(); /* stage st's raw blocks and activations are in; the previous MMAs are done */
        const bool more = st + 1 < a.act_blocks;
        if (more) {
            moe_raw_fetch<T, N::PER_ROW, W16>(s_raw[(st + 1) & 1], wexp, a.row_bytes, a.rows_per_expert, n0, st + 1);
            moe_x_fetch<NT>(s_x[(st + 1) & 1], xp, st + 1, &xd_next);
        }
#pragma unroll 2
        for (int it = 0; it < MOE_MMA_BM * 8 / N::THREADS; it++) {
            const int i = tid + it * N::THREADS, r = i >> 3, sub = i & 7;
            int w[8] = { 0, 0, 0, 0, 0, 0, 0, 0 }, mul[2] = { 0, 0 }, mmul[2] = { 0, 0 };
            float d = 0.0f, dm = 0.0f;
            if (n0 + r < a.rows_per_expert) {
                const uint8_t *blk = s_raw[st & 1] + r * R::PITCH + moe_raw_shift<T, W16>(wexp, a.row_bytes, n0 + r, st);
                K::codes(blk, sub, tab, w, mul, mmul);
                if (sub == 0) K::scales(blk, d, dm);
            }
            if constexpr (FOLD) {
#pragma unroll
                for (int k = 0; k < 8; k++) w[k] = (int)((uint32_t)w[k] * (uint32_t)mul[k >> 2]); /* bytes <= 45 */
            } else {
                s_mul[r * L::MUL_PITCH + sub] = mul[0];
            }
            if constexpr (K::HAS_MIN) {
                s_min[r * L::MIN_PITCH + sub * HALVES] = (uint32_t)mmul[0] * 0x01010101u;
                s_min[r * L::MIN_PITCH + sub * HALVES + HALVES - 1] = (uint32_t)mmul[1] * 0x01010101u; /* (Q4_K: the same min) */
            }
            if (sub == 0) s_d[r] = d, s_dm[r] = dm;
            /* the half first that keeps a quarter warp's 8 stores (subs 0..7 of a row) on 32 banks */
            uint4 *dst = (uint4 *)(s_w + r * MOE_MMA_PITCH + 32 * sub);
            const uint4 lo = make_uint4((uint32_t)w[0], (uint32_t)w[1], (uint32_t)w[2], (uint32_t)w[3]);
            const uint4 hi = make_uint4((uint32_t)w[4], (uint32_t)w[5], (uint32_t)w[6], (uint32_t)w[7]);
            const bool swap = (sub >> 2) & 1;
            dst[swap] = swap ? hi : lo;
            dst[!swap] = swap ? lo : hi;
        }
        __syncthreads(); /* the decoded stage is in */
        const uint8_t *sx = s_x[st & 1];
        const float *sxd = s_xd[st & 1];

        int isum[4][4], summs[4][4];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) isum[j][k] = 0, summs[j][k] = 0;
        /* the fragments by ldmatrix (eight 16-byte rows a matrix, rows 272 bytes
         * apart: 32 banks): A's four (rows 0-7 / 8-15 of the warp's 16, K 0-15 /
         * 16-31) in one, B's two of two token tiles in one, instead of a load
         * each */
        const unsigned sa = a_lane + cuda_smem_addr(s_w), sb = b_lane + cuda_smem_addr(sx);
#pragma unroll
        for (int sub = 0; sub < 8; sub++) {
            int af[4];
            cuda_ldsm_x4(reinterpret_cast<uint32_t(&)[4]>(af), sa + 32 * sub);
            int am[4] = { 0, 0, 0, 0 };
            if constexpr (K::HAS_MIN) {
                const uint32_t *ma = s_min + ra * L::MIN_PITCH + sub * HALVES, *mb = s_min + rb * L::MIN_PITCH + sub * HALVES;
                am[0] = (int)ma[0], am[1] = (int)mb[0], am[2] = (int)ma[HALVES - 1], am[3] = (int)mb[HALVES - 1];
            }
            int l0 = 1, l1 = 1;
            if constexpr (!FOLD) l0 = s_mul[ra * L::MUL_PITCH + sub], l1 = s_mul[rb * L::MUL_PITCH + sub];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if (j0 + j < n_tiles) { /* the same for the whole warp */
                    uint32_t bq[2];
                    cuda_ldsm_x2(bq, sb + 8 * j * MOE_MMA_PITCH + 32 * sub);
                    const int b0 = (int)bq[0], b1 = (int)bq[1];
                    if constexpr (FOLD) {
                        cuda_mma_s8(isum[j], af, b0, b1);
                    } else {
                        int c[4] = { 0, 0, 0, 0 };
                        cuda_mma_s8(c, af, b0, b1);
                        isum[j][0] += c[0] * l0, isum[j][1] += c[1] * l0;
                        isum[j][2] += c[2] * l1, isum[j][3] += c[3] * l1;
                    }
                    if constexpr (K::HAS_MIN) cuda_mma_s8(summs[j], am, b0, b1);
                }
            }
        }
        /* the 256-block's terms, added in block order */
        const float d0 = s_d[ra], d1 = s_d[rb], m0 = s_dm[ra], m1 = s_dm[rb];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (j0 + j < n_tiles) {
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const float yd = sxd[8 * (j0 + j) + 2 * tq + (k & 1)];
                    acc[j][k] = __fadd_rn(acc[j][k], K::term_of(k < 2 ? d0 : d1, k < 2 ? m0 : m1, yd, isum[j][k],
                                                                summs[j][k]));
                }
            }
        }
        if (more) { /* the next stage's copies land here, behind this stage's work */
            if (tid < N::TOKENS) s_xd[(st + 1) & 1][tid] = xd_next;
            cp_async_wait<0>();
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if (j0 + j < n_tiles) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int t = 8 * (j0 + j) + 2 * tq + (k & 1);
                const int64_t n = n0 + (k < 2 ? ra : rb);
                if (t < rows && n < a.rows_per_expert)
                    out[(int64_t)a.order[grp.y + t] * a.out_stride + n] = mv_finish<T>(acc[j][k]);
            }
        }
    }
}

template <uint32_t T, int NT, bool W16, int MB = 1>
static bool moe_mma_launch_nt(ds4_backend *be, const char *name, dim3 grid, const moe_mma_args &a) {
    /* per call: the attribute belongs to the current device */
    const size_t smem = moe_smem<T, NT, W16>::BYTES;
    return cuda_allow_dynamic_smem(be, (const void *)moe_mma_kernel<T, NT, W16, MB>, smem, "moe (tensor cores)",
                                   a.act_blocks) &&
           cuda_launch(be, name, moe_mma_kernel<T, NT, W16, MB>, grid, moe_tiles<NT>::THREADS, smem, a);
}

/* the kernel of eight token tiles, held to the registers of MB blocks an SM */
template <uint32_t T, bool W16>
static bool moe_mma_launch_8(ds4_backend *be, const char *name, dim3 grid, const moe_mma_args &a) {
    if (cuda_impl(be)->moe_mma_blocks == 3) return moe_mma_launch_nt<T, 8, W16, 3>(be, name, grid, a);
    return moe_mma_launch_nt<T, 8, W16, 1>(be, name, grid, a);
}

/* the kernel of four token tiles while every group fits it, else of eight;
 * with 16-byte pieces of the raw blocks where every row starts 16-byte
 * aligned (moe_raw's W16; DS4_CUDA_MOE_W16=0: never) */
template <uint32_t T>
static bool moe_mma_launch(ds4_backend *be, const char *name, dim3 grid, const moe_mma_args &a, int max_rows) {
    static const bool w16_on = cuda_env_flag("DS4_CUDA_MOE_W16", true);
    constexpr bool SPLIT = mvt<T>::BLOCK_BYTES % 16 != 0; /* (blocks of 16-byte multiples always take whole pieces) */
    const bool w16 = SPLIT && w16_on && a.row_bytes % 16 == 0 && (uintptr_t)a.w[0] % 16 == 0 &&
                     (uintptr_t)a.w[1] % 16 == 0;
    if (max_rows <= moe_tiles<4>::TOKENS)
        return w16 ? moe_mma_launch_nt<T, 4, SPLIT>(be, name, grid, a) : moe_mma_launch_nt<T, 4, false>(be, name, grid, a);
    return w16 ? moe_mma_launch_8<T, SPLIT>(be, name, grid, a) : moe_mma_launch_8<T, false>(be, name, grid, a);
}

bool cuda_mv_moe_mma_fits(uint32_t type, int64_t row_bytes, int64_t n_in) {
    if (type != DS4_TYPE_IQ2_XXS && type != DS4_TYPE_Q2_K && type != DS4_TYPE_Q4_K) return false;
    const int64_t bb = type == DS4_TYPE_IQ2_XXS ? 66 : type == DS4_TYPE_Q2_K ? 84 : 144;
    return n_in > 0 && n_in % DS4_QK_K == 0 && row_bytes == n_in / DS4_QK_K * bb;
}

bool cuda_mv_moe_mma(ds4_backend *be, const ds4_weight *const *ws, float *const *outs, int n_mats, const void *act,
                     int64_t act_blocks, int64_t act_pitch, const int32_t *groups, const int32_t *order, int64_t n_groups,
                     int max_rows, int64_t out_stride) {
    const ds4_weight *w = ws[0];
    bool ok = n_mats >= 1 && n_mats <= 2 && n_groups >= 1 && n_groups <= 65535 && max_rows >= 1 &&
              max_rows <= CUDA_MOE_MMA_ROWS && act_blocks * DS4_QK_K == w->ne[0] &&
              act_pitch % 16 == 0 && act_pitch >= act_blocks * (int64_t)sizeof(ds4_block_q8_K) &&
              cuda_mv_moe_mma_fits(w->type, w->row_bytes, w->ne[0]) && w->ne[1] >= 1 && w->ne[1] <= INT32_MAX;
    for (int z = 1; ok && z < n_mats; z++)
        ok = ws[z]->type == w->type && ws[z]->row_bytes == w->row_bytes && ws[z]->ne[1] == w->ne[1] &&
             ws[z]->ne[2] == w->ne[2];
    if (!ok) {
        cuda_fail(be, DS4_ERR_INVALID, "moe: %lld expert groups of up to %d rows of %s do not suit the tensor-core products",
                  (long long)n_groups, max_rows, cuda_wname(w));
        return false;
    }
    moe_mma_args a;
    memset(&a, 0, sizeof a);
    for (int z = 0; z < n_mats; z++) {
        a.w[z] = (const uint8_t *)ws[z]->device;
        a.out[z] = outs[z];
    }
    a.row_bytes = w->row_bytes;
    a.rows_per_expert = w->ne[1];
    a.n_expert = w->ne[2];
    a.act = (const uint8_t *)act;
    a.act_blocks = act_blocks;
    a.act_pitch = act_pitch;
    a.groups = (const int4 *)groups;
    a.order = order;
    a.out_stride = out_stride;
    const dim3 grid((unsigned)((w->ne[1] + MOE_MMA_BM - 1) / MOE_MMA_BM), (unsigned)n_groups, (unsigned)n_mats);
    switch (w->type) {
    case DS4_TYPE_IQ2_XXS: return moe_mma_launch<DS4_TYPE_IQ2_XXS>(be, "moe_mma_kernel<IQ2_XXS>", grid, a, max_rows);
    case DS4_TYPE_Q2_K: return moe_mma_launch<DS4_TYPE_Q2_K>(be, "moe_mma_kernel<Q2_K>", grid, a, max_rows);
    default: return moe_mma_launch<DS4_TYPE_Q4_K>(be, "moe_mma_kernel<Q4_K>", grid, a, max_rows);
    }
}

/*
 * cuda_matvec.h - decode-shaped products (one to eight activation rows):
 * weights streamed through shared memory in wide, coalesced loads. Used by
 * cuda_matmul.cu for the matmul and moe ops under DS4 numerics; the
 * REFERENCE numerics and the batched (prefill) shapes keep their kernels.
 */
#ifndef DS4_BACKENDS_CUDA_MATVEC_H
#define DS4_BACKENDS_CUDA_MATVEC_H

#include <stdbool.h>
#include <stdint.h>

#include "backends/backend.h"

/* How the activations are given: float rows, DS4's Q8_0 activations or Q8_K
 * blocks. Q8_0 rows are in the split layout: a row of nb blocks (nb = the
 * row stride in blocks) holds the nb x 32 int8 codes, then the nb float
 * scales (36 nb bytes, as many as nb interleaved blocks); Q8_K rows
 * likewise: the nb x 256 codes, the nb float d, then the nb x 16 int16
 * bsums (292 nb bytes). Group offsets and strides still count blocks. */
typedef enum cuda_mv_act { CUDA_MV_FLOAT, CUDA_MV_Q8_0, CUDA_MV_Q8_K } cuda_mv_act;

#define CUDA_MV_MAX_ROWS 8  /* activation rows per launch */
#define CUDA_MV_MAX_PARTS 8 /* warps per output (K split, or experts summed) */
#define CUDA_MV_MAX_MATS 8  /* matrices of one launch (products of one input) */

/* One product: out[r][o] (+ r * out_stride) = W[row(o)] . act[r] for
 * o < n_out, r < n_rows. Weight rows are row_bytes apart from w. */
typedef struct cuda_mv_job {
    uint32_t type;        /* weight type */
    cuda_mv_act act_kind; /* must suit the type (see cuda_mv_fits) */
    const void *w;
    int64_t row_bytes;
    int64_t n; /* elements per weight row */
    int64_t row0;
    int64_t n_out;
    const void *act;
    int64_t act_stride; /* floats (CUDA_MV_FLOAT) or blocks between activation rows */
    float *out;
    int64_t out_stride;
    int n_rows;
    /* non-NULL (Q8_0 weights, cuda_mv_quantises true): the kernel quantises
     * these n_rows float rows, xf_stride floats apart, itself; act is
     * unused and act_stride is n / 32 */
    const float *xf;
    int64_t xf_stride;
    /* non-NULL (cuda_mv_run_multi): a float row (add_type F32, F16 or BF16)
     * of n_out values added to every output row, as add_weight_row adds it */
    const void *add;
    uint32_t add_type;
    /* non-NULL (with xf; cuda_mv_rope_fits): each xf row is rows of heads of
     * rope_head_dim floats whose last rope->n_rot dims the kernel rotates
     * back (rope_tail's inverse, row r at position rope_pos[r], device
     * memory) before it quantises them, bit for bit as quantising the rows
     * that rope_tail rotated; xf itself is not written */
    const ds4_rope *rope;
    const int32_t *rope_pos;
    int64_t rope_head_dim;
} cuda_mv_job;

/* Pairs of a RoPE that a product can rotate back in its quantiser (the
 * host's frequency table travels with the launch). */
#define CUDA_MV_ROPE_PAIRS 32

/* true when a product that quantises rows of n floats (a grouped one: from
 * slices group_stride floats apart; 0 for one slice) can rotate back the
 * tails of heads of head_dim floats under rope: whole heads in each slice,
 * an even n_rot <= head_dim of at most 2 * CUDA_MV_ROPE_PAIRS dims. */
bool cuda_mv_rope_fits(const ds4_rope *rope, int64_t head_dim, int64_t n, int64_t group_stride);

/* true when the matvec kernels can run this weight type / row shape with
 * these activations (rows 16-byte aligned, whole staging units). */
bool cuda_mv_fits(uint32_t type, cuda_mv_act act_kind, int64_t row_bytes, int64_t n);

/* true when Q8_0 products of n_rows rows of n elements (n_mats matrices of
 * one launch, n_outs[z] outputs each) can quantise their activations in the
 * kernel (cuda_mv_job.xf): they fit its shared memory, the grid is small
 * enough that each block redoing it is cheap, and the backend's mv_xq is on
 * (ds4_cuda_backend_set_fusions). The float rows must be 16-byte aligned,
 * and more than one row a multiple of 4 floats apart (the caller checks;
 * the launch refuses them otherwise). */
bool cuda_mv_quantises(ds4_backend *be, uint32_t type, int64_t n, int64_t n_rows, const int64_t *n_outs, int n_mats);
/* The same for a grouped product (cuda_mv_run_grouped) of n_groups >= 2
 * groups of n_out outputs over slices of n: each thread block's outputs lie
 * in one group, whose slice it quantises (the job's xf with act_stride n /
 * 32, the group stride in floats). */
bool cuda_mv_grouped_quantises(ds4_backend *be, uint32_t type, int64_t n, int64_t n_out, int64_t n_groups,
                               int64_t n_rows);

/* Enqueue a product (cuda_mv_fits must hold, 1 <= n_rows <= 8). false with
 * the error recorded when the launch failed. */
bool cuda_mv_run(ds4_backend *be, const cuda_mv_job *job);

/* n products of one activation (the jobs share type, activation kind and
 * layout, row length, row0 and row count; n_out and out differ) in one
 * launch, 1 <= n <= CUDA_MV_MAX_MATS. */
bool cuda_mv_run_multi(ds4_backend *be, const cuda_mv_job *jobs, int n);

/* The routed experts of n_tokens tokens, on the device choices `sel`
 * ([n_tokens, n_used] ids, validated by the caller's kernels) and the
 * activation rows of the tokens (act_gate, act_up: quantised or float as
 * the kinds say, act_*_stride blocks or floats apart):
 *   gate/up: g[t][k][j] = gate[sel[t][k]][j] . x[t], u likewise
 *            (one launch for both when they share a type)
 *   down:    out[t][o] = sum over k = 0, 1, ... (from 0.0f) of
 *            down[sel[t][k]][o] . mid[t][k] (one launch; mid rows
 *            act_stride apart, out rows out_stride apart)
 * Experts whose id is outside [0, n_expert) are skipped (their products
 * read as 0); the caller reports them, or with err (not NULL) the gate/up
 * kernel does (cuda_report_bad_index, tag err_tag, at the slot's index). */
bool cuda_mv_moe_gate_up(ds4_backend *be, const ds4_weight *gate, const ds4_weight *up, cuda_mv_act kind_g,
                         cuda_mv_act kind_u, const void *act_gate, const void *act_up, int64_t act_gate_stride,
                         int64_t act_up_stride, const int32_t *sel, int n_used, int64_t n_tokens, float *g, float *u,
                         cuda_dev_error *err, int err_tag, const float *xf);
/* true when one token's gate/up (cuda_mv_moe_gate_up, one launch for both:
 * the same type, Q8_K activations) can quantise x itself: its xf then
 * holds the token's dim floats (16-byte aligned), act_* are unused and the
 * strides are dim / 256 blocks. The Q8_K blocks are those of the quantiser
 * kernel, bit for bit. */
bool cuda_mv_moe_quantises(const ds4_weight *gate, const ds4_weight *up, cuda_mv_act kind_g, cuda_mv_act kind_u,
                           int64_t n_tokens);
bool cuda_mv_moe_down(ds4_backend *be, const ds4_weight *down, cuda_mv_act kind, const void *mids, int64_t act_stride,
                      const int32_t *sel, int n_used, int64_t n_tokens, float *out, int64_t out_stride);

/* The row counts the matvec kernels are built for (1, 2, 4, 8): the group
 * sizes cuda_mv_moe_grouped takes. */
static inline bool cuda_mv_rows_built(int64_t rows) { return rows == 1 || rows == 2 || rows == 4 || rows == 8; }

/* The routed experts' products grouped by expert (prefill: the tokens of
 * one expert share its weight reads): groups[4 g .. 4 g + 2] = (expert,
 * first, rows) with rows <= max_rows (cuda_mv_rows_built: the kernel of that
 * many rows runs; a group of more rows, or of none, is left out), and for
 * each of the n_mats matrices (gate and up share a launch; same type and
 * shape) and r < rows:
 *   outs[z][order[first + r]][o] = ws[z][expert][o] . act[first + r]
 * (act rows act_stride blocks apart, in the sorted order; output rows
 * out_stride floats apart). groups and order are device memory; an expert
 * id outside the weight is left out (its rows are not written). Rows are
 * split over warps as a one-row launch over split_outputs outputs would
 * split them (cuda_mv_moe_gate_up's), or kept whole when it is 0 (as
 * cuda_mv_moe_down's experts), so each row's sum is the same either way. */
bool cuda_mv_moe_grouped(ds4_backend *be, const ds4_weight *const *ws, float *const *outs, int n_mats, cuda_mv_act kind,
                         const void *act, int64_t act_stride, const int32_t *groups, const int32_t *order,
                         int64_t n_groups, int max_rows, int64_t out_stride, int64_t split_outputs);

/* The same products on the int8 tensor cores (IQ2_XXS, Q2_K and Q4_K
 * weights, Q8_K activations in the split layout, act_blocks = n_in / 256
 * per row, rows act_pitch bytes apart: a multiple of 16), with groups of
 * up to max_rows <= CUDA_MOE_MMA_ROWS rows (a group of more is left out;
 * groups of up to 32 rows run on the kernel of four token tiles, larger
 * ones on that of eight): each output is the CPU's ds4_dot_q8_K_* of its
 * row, bit for bit, whatever the kernel. cuda_mv_moe_mma_fits says whether
 * a weight of n_in-element rows (row_bytes each) can take them. */
#define CUDA_MOE_MMA_ROWS 64
bool cuda_mv_moe_mma_fits(uint32_t type, int64_t row_bytes, int64_t n_in);
bool cuda_mv_moe_mma(ds4_backend *be, const ds4_weight *const *ws, float *const *outs, int n_mats, const void *act,
                     int64_t act_blocks, int64_t act_pitch, const int32_t *groups, const int32_t *order, int64_t n_groups,
                     int max_rows, int64_t out_stride);

/* A grouped product (the matmul_grouped op) of up to CUDA_MV_MAX_ROWS rows:
 * out[r][g * n_out + o] = W[g * n_out + o] . act[r][group g], where group g
 * of an activation row starts act_group_stride blocks (or floats) after
 * group g - 1. */
bool cuda_mv_run_grouped(ds4_backend *be, const cuda_mv_job *job, int64_t n_groups, int64_t act_group_stride);

#endif

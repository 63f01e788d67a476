/*
 * cuda_backend.h - the CUDA backend's C interface.
 *
 * Plain C11 declarations, callable from host C code; the implementations live
 * in the src/backends/cuda .cu files (built only by `make cuda`, -DDS4_WITH_CUDA=1).
 * Every function reports failure as a ds4_status and fills a ds4_error (may
 * be NULL) naming the failed CUDA call with its file and line: nothing here
 * exits, aborts or prints on a runtime failure.
 *
 * Devices: functions that take no device index work on the calling host
 * thread's current CUDA device (device 0 unless cudaSetDevice was called).
 */
#ifndef DS4_BACKENDS_CUDA_BACKEND_H
#define DS4_BACKENDS_CUDA_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "backends/backend.h"
#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- devices (cuda_device.cu) ---- */

/* Number of usable CUDA devices; 0 when there is no GPU, no driver, or the
 * driver cannot be used (never crashes, never prints). */
int ds4_cuda_device_count(void);

/* As ds4_cuda_device_count, but says why there is no device: *count is set
 * (0 on failure) and, when the CUDA runtime cannot see any device, returns
 * DS4_ERR_UNSUPPORTED with the runtime's reason in err. */
ds4_status ds4_cuda_probe(int *count, ds4_error *err);

/* One line about a device: name, compute capability, memory in GiB, SM count,
 * driver and runtime versions, e.g.
 *   "device 0: NVIDIA H200, compute 9.0, 139.8 GiB, 132 SMs, driver 13.0, runtime 13.0"
 * DS4_ERR_INVALID for a bad index, NULL buf or a buffer too small for the
 * line (buf then holds the truncated line). */
ds4_status ds4_cuda_device_describe(int device, char *buf, size_t cap, ds4_error *err);

/* ---- device memory (cuda_device.cu): thin checked wrappers, so C code
 * (tests, the loader) needs no CUDA headers. ---- */

/* *out = a device allocation of `bytes` (NULL for 0 bytes). */
ds4_status ds4_cuda_malloc(void **out, size_t bytes, ds4_error *err);
void ds4_cuda_free(void *d_ptr); /* NULL is a no-op; errors are ignored */
ds4_status ds4_cuda_memcpy_h2d(void *d_dst, const void *h_src, size_t bytes, ds4_error *err);
ds4_status ds4_cuda_memcpy_d2h(void *h_dst, const void *d_src, size_t bytes, ds4_error *err);
ds4_status ds4_cuda_memset(void *d_dst, int byte, size_t bytes, ds4_error *err);
/* Wait for all work on the current device; reports asynchronous kernel
 * failures (e.g. an illegal address) that launches could not. */
ds4_status ds4_cuda_synchronize(ds4_error *err);

/* ---- dequantisation (cuda_dequant.cu) ---- */

/* 1 if ds4_cuda_dequant_rows supports `type`: F32, F16, BF16, Q8_0, Q2_K,
 * Q4_K, Q5_K, Q6_K, IQ2_XXS, Q8_K. */
int ds4_cuda_dequant_supported(uint32_t type);

/*
 * Dequantise n_rows rows of row_elems elements each, laid end to end at the
 * device pointer d_src (row r at byte r * ds4_type_row_bytes(type, row_elems)),
 * into n_rows * row_elems float32 at the device pointer d_dst.
 *
 * The result is bit-identical to the CPU traits->dequant_row of src/core for
 * every input whose results are not NaN (a NaN result is a NaN, but its
 * payload and sign may differ: the GPU produces a canonical NaN).
 *
 * `stream` is a cudaStream_t (NULL: the default stream). The call is
 * asynchronous: it enqueues one kernel and returns; a fault during execution
 * surfaces at the next synchronising call (ds4_cuda_synchronize).
 *
 * Errors: DS4_ERR_UNSUPPORTED for a type without a kernel (the message names
 * the type); DS4_ERR_INVALID for row_elems not a multiple of the type's block,
 * negative counts, a size overflow, a NULL pointer, a pointer that is not
 * device memory, or a pointer misaligned for the type's block fields (2 bytes;
 * 4 for F32 and Q8_K). n_rows == 0 or row_elems == 0 does nothing.
 */
ds4_status ds4_cuda_dequant_rows(uint32_t type, const void *d_src, float *d_dst, int64_t n_rows, int64_t row_elems,
                                 void *stream, ds4_error *err);

/* Host-memory convenience: allocate device buffers, copy h_src in, run
 * ds4_cuda_dequant_rows on the default stream, copy the floats back to h_dst,
 * free. Synchronous; same errors. */
ds4_status ds4_cuda_dequant_host(uint32_t type, const void *h_src, float *h_dst, int64_t n_rows, int64_t row_elems,
                                 ds4_error *err);

/* ---- the backend (cuda_backend.cu) ---- */

/* The CUDA op table on device `device` (its own stream, device scratch and
 * error state). DS4_ERR_UNSUPPORTED when the device cannot be used. Destroy
 * with ds4_backend_destroy. */
ds4_status ds4_cuda_backend_create(int device, ds4_backend **out, ds4_error *err);
void ds4_cuda_backend_free(ds4_backend *be); /* ds4_backend_destroy's part */
/* Device bytes held by the weights bound so far. */
size_t ds4_cuda_backend_weight_bytes(const ds4_backend *be);
/* Peak device memory in use since the backend was created (all allocations
 * of the process on this device, as cudaMemGetInfo sees them), in bytes. */
size_t ds4_cuda_backend_peak_bytes(const ds4_backend *be);
/* The backend's counters (ds4_backend_counters_get). */
void ds4_cuda_backend_counters(const ds4_backend *be, ds4_backend_counters *out);
/* Recorded steps on or off for this backend (on by default; DS4_CUDA_GRAPH=0
 * in the environment makes off the default): with them on, the ops between
 * step_begin and step_end run as one CUDA graph, replayed from step to step
 * with only the changed parameters set anew. The results are the same
 * either way, bit for bit. Takes effect at the next step_begin. */
void ds4_cuda_backend_set_graphs(ds4_backend *be, int on);
/* Recorded steps submitted in segments at the model's marks (on by default;
 * DS4_CUDA_SEGMENTS=0 makes off the default) or as one graph per step. The
 * results are the same either way, bit for bit. Takes effect at the next
 * mark. */
void ds4_cuda_backend_set_segments(ds4_backend *be, int on);
/* Side branches of recorded steps (backend.h's branch_begin / branch_end /
 * branch_join) on or off (on by default; DS4_CUDA_BRANCH=0 makes off the
 * default). On: a branch's kernels form a chain of their own in the step's
 * graph, beside the main chain until the join (or until the main chain
 * takes a scratch slot the branch took). Off: one chain in call order. The
 * results are the same either way, bit for bit. Takes effect at the next
 * branch. */
void ds4_cuda_backend_set_branches(ds4_backend *be, int on);
/* One token's MoE on the streaming kernels reads the caller's expert ids and
 * weights itself, its gate/up kernel reporting a bad id (on by default;
 * DS4_CUDA_MOE_IDS=0 makes off the default), or checks and copies them in
 * a kernel first (as every other MoE path does). The results and the error
 * reported are the same either way. Takes effect at the next op. */
void ds4_cuda_backend_set_moe_ids(ds4_backend *be, int on);
/* hc_pre's Sinkhorn rounds off its chain (on by default; DS4_CUDA_HC_DEFER=0
 * makes off the default): for up to 8 rows the finishing kernel leaves
 * the comb logits and the next weight product of at least min_bytes of
 * weights on the main chain runs the rounds in blocks of its own (0: the
 * default, 8 MiB; DS4_CUDA_HC_DEFER_BYTES sets it), or a kernel of their
 * own runs them before anything reads comb. The results are the same
 * either way, bit for bit. Takes effect at the next hc_pre. */
void ds4_cuda_backend_set_hc_defer(ds4_backend *be, int on, int64_t min_bytes);
/* Deferred Sinkhorn tasks run by weight products, and by their own kernel,
 * since the backend was created. */
void ds4_cuda_backend_hc_defer_stats(const ds4_backend *be, uint64_t *taken, uint64_t *settled);
/* Weights into the L2 cache ahead of their products, in recorded steps
 * (backend.h's prefetch, and the routed experts' down matrices of one
 * decoded token once the router has chosen them): mode 1, the bulk copy
 * engine's L2 prefetch; 2, loads by a grid of threads; 0 off, the default
 * (measured slower on the H200; DS4_CUDA_PREFETCH=N sets the default). A call asks for at most
 * max_bytes (0: the default, three quarters of the device's L2;
 * DS4_CUDA_PREFETCH_MIB sets it). The results are the same either way,
 * bit for bit. Takes effect at the next op. */
void ds4_cuda_backend_set_prefetch(ds4_backend *be, int mode, int64_t max_bytes);
/* Which prefetches run (both by default; DS4_CUDA_PREFETCH_OPS=0 and
 * DS4_CUDA_PREFETCH_EXPERTS=0 make off the defaults): the op's calls, and
 * the routed experts' down matrices. */
void ds4_cuda_backend_set_prefetch_parts(ds4_backend *be, int ops, int experts);
/* Prefetch launches recorded, and the bytes they asked for, since the
 * backend was created. */
void ds4_cuda_backend_prefetch_stats(const ds4_backend *be, uint64_t *launches, uint64_t *bytes);
/* Branches recorded, and joins forced by a scratch slot that both sides
 * took, since the backend was created. */
void ds4_cuda_backend_branch_stats(const ds4_backend *be, uint64_t *branches, uint64_t *auto_joins);
/* Branches recorded beside a pending one (begun after the first's end,
 * before any join was asked for: both fork from the main chain, the
 * second's last op also waits for the first, so one join takes both) since
 * the backend was created. */
void ds4_cuda_backend_branch_beside(const ds4_backend *be, uint64_t *beside);
/* The fused activation quantisation on or off (both on by default;
 * DS4_CUDA_MV_XQ=0 and DS4_CUDA_MOE_XQ=0 make off the defaults): mv_xq, the
 * Q8_0 decode products (plain, several of one input, grouped) that quantise
 * their own activations; moe_xq, the MoE's SwiGLU and the Q8_K blocks of its
 * mids in one kernel, and one token's gate/up quantising x to Q8_K blocks
 * itself (DS4_CUDA_MOE_XK=0: not that part). The results are the same
 * either way, bit for bit. Takes effect at the next op. */
void ds4_cuda_backend_set_fusions(ds4_backend *be, int mv_xq, int moe_xq);
/* Short rows packed into the matvec kernels' stages (on by default;
 * DS4_CUDA_MV_PACK=0 makes off the default): one-activation-row products
 * whose rows are 4 or 8 Q2_K blocks, 8 or 16 IQ2_XXS blocks (the routed
 * experts of the full-size q2 model) or 32 Q8_0 blocks (q_b) copy and
 * decode two to six rows per stage instead of one. The results are the same either way, bit for bit.
 * Takes effect at the next op. */
void ds4_cuda_backend_set_mv_pack(ds4_backend *be, int on);
/* One-activation-row products of F32/F16/BF16 weights with rows of at most
 * 4,096 elements read x from a copy in shared memory that each thread
 * block makes once, instead of from global memory inside the inner loop
 * (off by default: not yet measured; DS4_CUDA_MV_XS=1 makes on the
 * default). The results are the same either way, bit for bit. Takes
 * effect at the next op. */
void ds4_cuda_backend_set_mv_xs(ds4_backend *be, int on);
/* Matvec launches that packed rows so, since the backend was created. */
int64_t ds4_cuda_backend_mv_packed_launches(const ds4_backend *be);
/* head_norm_rope as one fused kernel (the default; DS4_CUDA_NORM_ROPE=0
 * makes off the default), or as the rmsnorm, rope_tail and rounding
 * kernels one after the other. The results are the same either way, bit
 * for bit. Takes effect at the next op. */
void ds4_cuda_backend_set_norm_rope(ds4_backend *be, int on);
/* hc_pre_norm's RMS norm inside hc_pre's finishing kernel (the default;
 * DS4_CUDA_HC_NORM=0 makes off the default), or hc_pre's kernels and then
 * the rmsnorm kernel. The results are the same either way, bit for bit.
 * Takes effect at the next op. */
void ds4_cuda_backend_set_hc_norm(ds4_backend *be, int on);
/* hc_post_pre_norm's residual step made inside hc_pre's partial kernel
 * (the default; DS4_CUDA_HC_POST_PRE=0
 * makes off the default), or hc_post's kernel and then hc_pre_norm's. The
 * results are the same either way, bit for bit. Takes effect at the next
 * op. */
void ds4_cuda_backend_set_hc_post_pre(ds4_backend *be, int on);
/* hc_pre's partial pass (hc_pre, hc_pre_norm, hc_post_pre_norm) with each
 * block taking every mix row of its chunk, so a row's state is read (or
 * made from the residual step) once instead of once per group of four mix
 * rows, and hc_pre's finishing pass with one block a row, which makes the
 * row's split once instead of once per slice of the output: mode 0 never,
 * 2 always, anything else (the default) when rows x 1,024-value chunks
 * reach 1,024 (a prefill chunk's rows);
 * DS4_CUDA_HC_ALL=0/2 sets the default. The results are the same either
 * way, bit for bit. Takes effect at the next op. */
void ds4_cuda_backend_set_hc_all(ds4_backend *be, int mode);
/* The row kernels' warp and several-row forms (on by default;
 * DS4_CUDA_WIDE_ROWS=0 makes off the default): head_norm_rope(2) with a
 * warp per head of up to 512 values, hc_pre's partial pass with 8 rows a
 * block where it takes every mix row, the Q8_0 / Q8_K activation
 * quantisers (and the MoE's SwiGLU + Q8_K) with a lane pair / warp per
 * block, the attention combine with a warp per (row, head) for few
 * splits; off: a block per head, row, block. The results are the same
 * either way, bit for bit. Takes effect at the next op. */
void ds4_cuda_backend_set_wide_rows(ds4_backend *be, int on);
/* The int8 GEMM's weight rows per block where its tiles fill the device
 * (a prefill's products): 128 (the default; two blocks of 8 warps an SM;
 * anything but 64 sets it) or 64 (three blocks of 4 warps);
 * DS4_CUDA_GEMM_BM=64 makes 64 the default. The same bits either way; a
 * 2,048-token prefill 1.017x faster with 128 on an H100. Takes effect at
 * the next op. */
void ds4_cuda_backend_set_gemm_bm(ds4_backend *be, int rows);
/* The int8 GEMM's weight rows per block now in effect: 128 or 64. */
int ds4_cuda_backend_gemm_bm(const ds4_backend *be);
/* The router's selection with its keys in registers and its probabilities
 * in shared memory (for up to 1,024 experts and 64 choices a row; off by
 * default, DS4_CUDA_ROUTER_REG=1 makes on the default), or through global
 * scratch. The results are the same either way, bit for bit. Takes effect
 * at the next op. */
void ds4_cuda_backend_set_router_reg(ds4_backend *be, int on);
/* The routed experts of several tokens grouped by expert, outside recorded
 * steps (on by default; DS4_CUDA_MOE_GROUPED=0 makes off the default): the
 * op reads the checked expert ids back (one wait), sorts the (token,
 * expert) slots by expert and runs each expert's tokens, up to eight at a
 * time, as rows of one pass over its weights, instead of one pass per
 * slot. With the tensor-core products off (ds4_cuda_backend_set_moe_mma)
 * the same results bit for bit as the streaming path (test_moe_grouped); a
 * 512-token prefill of the full-size q2 model 1.14x faster on the H200. */
void ds4_cuda_backend_set_moe_grouped(ds4_backend *be, int on);
/* The grouped MoE's products on the int8 tensor cores (on by default;
 * DS4_CUDA_MOE_MMA=0 makes off the default) where gate/up and down are
 * IQ2_XXS, Q2_K or Q4_K: up to 64 tokens of an expert per pass, each
 * product the CPU's Q8_K dot bit for bit (its block terms in its order).
 * Off, the grouped path uses the multi-row matvec kernels. */
void ds4_cuda_backend_set_moe_mma(ds4_backend *be, int on);
/* The most tokens of an expert one pass of the tensor-core MoE takes: 32
 * (an expert of more tokens is split into passes of 32, each decoding its
 * weights again) or 64 (the default; anything but 32 sets it;
 * DS4_CUDA_MOE_MMA_ROWS=32 makes 32 the default). The results are the same
 * either way, bit for bit. Takes effect at the next op. */
void ds4_cuda_backend_set_moe_mma_rows(ds4_backend *be, int max_rows);
/* The MoE's tensor-core kernel of eight token tiles held to the registers
 * of 3 blocks an SM (the default; anything but 1 sets it: 80 registers,
 * three blocks, 24 warps an SM, at a few bytes of spill) or 1 (95
 * registers, two blocks by the registers); DS4_CUDA_MOE_MMA_BLOCKS=1 makes
 * 1 the default. The same bits either way; a 2,048-token prefill 1.015x
 * faster with 3 on an H100. Takes effect at the next op. */
void ds4_cuda_backend_set_moe_mma_blocks(ds4_backend *be, int blocks);
/* That register budget now in effect: 3 or 1. */
int ds4_cuda_backend_moe_mma_blocks(const ds4_backend *be);
/* The grouping inside recorded steps too, in groups of up to max_rows
 * tokens (1, 2, 4 or 8; anything else: off, the default;
 * DS4_CUDA_MOE_STEP_GROUP=N sets the default; needs moe_grouped): a batched
 * decode's MoE of 16 tokens or more sorts its slots by expert on the device
 * (no wait) and runs the matvec kernels of max_rows rows per group (with 1,
 * the per-slot passes in expert order), bit for bit the per-slot results.
 * Measured on the H200 with groups of 8 it is slower than the per-slot
 * launches (32 streams of the full-size q2 model: 1.57 ms per layer's
 * experts vs 1.11: the eight-row kernel costs about twice a one-row pass for
 * the one or two tokens most experts get), so it stays off until a group
 * size is measured faster. */
void ds4_cuda_backend_set_moe_step_group(ds4_backend *be, int max_rows);
/* F16-weight products (DS4 numerics) of CUDA_GEMM_MIN_TOKENS or more tokens
 * on the f16 tensor cores, activations split into two binary16 parts (on by
 * default; DS4_CUDA_FGEMM=0 makes off the default): the same products to
 * within float rounding, summed in another order. Off, the matmul kernels'
 * tiles of 8 tokens. */
void ds4_cuda_backend_set_fgemm(ds4_backend *be, int on);
/* attention_rows_f16's batches of the model's shape (64 heads of 512) on
 * the f16 tensor cores (attention_tc_kernel: all heads of a query row in a
 * block, the queries and weights split into two binary16 parts, the rows
 * read at binary16; on by default, DS4_CUDA_ATT_TC=0 makes off the
 * default), or the shared-row float kernel. Takes effect at the next op. */
void ds4_cuda_backend_set_att_tc(ds4_backend *be, int on);
/* That kernel's warps a block: 8 (the default; DS4_CUDA_ATT_TC_WARPS=16
 * makes 16 the default) or 16 (twice the warps an SM, each scores tile's K
 * in two halves summed before the softmax: the same precision, other
 * bits). Any other count means 8. Takes effect at the next op. */
void ds4_cuda_backend_set_att_tc_warps(ds4_backend *be, int warps);
/* That kernel's warps a block now in effect: 8 or 16. */
int ds4_cuda_backend_att_tc_warps(const ds4_backend *be);
/* Keys a warp of indexer_scores_rows over several query rows (a prefill's
 * selecting rows): 4 (the default; DS4_CUDA_IDX_KEYS=1 makes 1 the
 * default: one query element read from shared memory for four keys, the
 * four keys' dots of eight heads reduced together) or 1; any other count
 * means 4. The same bits either way. Takes effect at the next op. */
void ds4_cuda_backend_set_idx_keys(ds4_backend *be, int keys);
int ds4_cuda_backend_idx_keys(const ds4_backend *be);
/* How many indexer launches have taken 4 keys a warp. */
int64_t ds4_cuda_backend_idx_keys_calls(const ds4_backend *be);
/* indexer_scores_rows_f16 (a prefill's selecting rows under DS4 numerics)
 * on the f16 tensor cores (indexer_tc_kernel; on by default,
 * DS4_CUDA_IDX_TC=0 makes off the default), or the float kernels of
 * indexer_scores_rows. The same bits wherever every partial sum of a dot
 * is exact in float (the QAT'd rows: in practice always). Takes effect at
 * the next op. */
void ds4_cuda_backend_set_idx_tc(ds4_backend *be, int on);
int ds4_cuda_backend_idx_tc(const ds4_backend *be);
/* How many indexer launches have run on the tensor cores. */
int64_t ds4_cuda_backend_idx_tc_calls(const ds4_backend *be);
/* How many attention launches have run on the tensor cores. */
int64_t ds4_cuda_backend_att_tc_calls(const ds4_backend *be);
/* How many products have run as the float GEMM. */
int64_t ds4_cuda_backend_fgemm_calls(const ds4_backend *be);
/* How many int8 GEMM launches have taken blocks of 128 weight rows. */
int64_t ds4_cuda_backend_gemm_bm128_calls(const ds4_backend *be);
/* How many MoE calls have run their products on the tensor cores. */
int64_t ds4_cuda_backend_moe_mma_calls(const ds4_backend *be);
/* Why the most recent cut of a recorded step happened (the step's ops from
 * there on ran unrecorded: a host wait, an allocation, a library call), or
 * "none" when no step was ever cut short. */
const char *ds4_cuda_backend_last_break(const ds4_backend *be);
/* The graph node whose parameter update CUDA refused last (the cached graph
 * of that step shape was then built anew; counted in graph_refusals), or
 * "none": a kernel's name, "copy", "memset" or the step arena's copy. */
const char *ds4_cuda_backend_last_refusal(const ds4_backend *be);
/* Kernel timing (DS4_CUDA_PROFILE=1 at creation): see ds4_backend_kernel_times. */
int ds4_cuda_backend_kernel_times(ds4_backend *be, ds4_kernel_time *out, int cap);
void ds4_cuda_backend_kernel_times_reset(ds4_backend *be);
/* cudaProfilerStart (on) / cudaProfilerStop after the stream drains. */
void ds4_cuda_backend_profiler_range(ds4_backend *be, bool on);

#ifdef __cplusplus
}
#endif

/* ---- for the backend's own .cu files only ---- */
#if defined(__CUDACC__)
#include <cuda_runtime.h>

/* Turn a failed CUDA call into a ds4_error ("<call> failed at <file>:<line>:
 * <cuda error name>: <description>") and return its ds4_status; DS4_OK when
 * `e` is cudaSuccess. Status: cudaErrorMemoryAllocation -> DS4_ERR_NOMEM;
 * bad values/pointers/devices -> DS4_ERR_INVALID; no device, driver too old,
 * no kernel image for this GPU -> DS4_ERR_UNSUPPORTED; anything else
 * (a device fault, a launch failure) -> DS4_ERR_DEVICE. */
extern "C" ds4_status ds4_cuda_error(cudaError_t e, const char *call, const char *file, int line, ds4_error *err);

/* Evaluate a CUDA call; on failure fill `err` and return its status from the
 * enclosing function (which must return ds4_status). */
#define DS4_CUDA_CHECK(call, err)                                                         \
    do {                                                                                  \
        cudaError_t ds4_cuda_e_ = (call);                                                 \
        if (ds4_cuda_e_ != cudaSuccess)                                                   \
            return ds4_cuda_error(ds4_cuda_e_, #call, __FILE__, __LINE__, (err));         \
    } while (0)

/* As DS4_CUDA_CHECK, but store the status in `st` and jump to `label` (for
 * functions that must free resources on the way out). */
#define DS4_CUDA_TRY(st, call, err, label)                                                \
    do {                                                                                  \
        cudaError_t ds4_cuda_e_ = (call);                                                 \
        if (ds4_cuda_e_ != cudaSuccess) {                                                 \
            (st) = ds4_cuda_error(ds4_cuda_e_, #call, __FILE__, __LINE__, (err));         \
            goto label;                                                                   \
        }                                                                                 \
    } while (0)
#endif

#endif /* DS4_BACKENDS_CUDA_BACKEND_H */

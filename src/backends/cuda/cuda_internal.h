/*
 * cuda_internal.h - what the CUDA backend's .cu files share (C++ only).
 *
 * Files: cuda_backend.cu (the op table, constructor, memory, weights,
 * elementwise ops, norms, rounding, embedding), cuda_matmul.cu (activation
 * quantisation, matmul, MoE), cuda_attention.cu (RoPE, attention,
 * compressor pooling, indexer scores, top-k), cuda_hc_ffn.cu
 * (hyper-connections, router, SwiGLU), cuda_dequant.cu (dequantisation),
 * cuda_device.cu (devices, error mapping).
 *
 * Execution model: every op enqueues its kernels on the backend's one stream
 * (`cuda_stream(be)`) and returns without waiting; only download (its result
 * is host memory) and take_error wait for the stream. Buffers handed to ops
 * are device pointers from the alloc op (or offsets into them), including
 * the int32 arrays that ops pass to each other (router -> moe expert ids,
 * top_k -> attention rows). Host control arrays (tokens, positions,
 * hash-routed expert ids) are copied to the device by the op when a kernel
 * needs them (cuda_upload_ctrl: pinned staging + cudaMemcpyAsync, never a
 * pageable-memory synchronous copy in the middle of a stream).
 *
 * Errors: an op that cannot run records the first error with cuda_fail (a
 * bad argument, an unsupported weight type) or CUDA_OK / cuda_launch (a
 * failed CUDA call or launch) and returns; take_error hands it to the model.
 * Once an error is recorded, later ops may skip their work (cuda_failed).
 * Indices that live in device memory are checked by the kernels that read
 * them: a bad one is reported into the device error record
 * (cuda_report_bad_index), its work is skipped, and take_error turns the
 * record into the error message. Nothing prints, aborts or exits.
 */
#ifndef DS4_BACKENDS_CUDA_INTERNAL_H
#define DS4_BACKENDS_CUDA_INTERNAL_H

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backends/backend.h"
#include "backends/cuda/cuda_backend.h"
#include "core/error.h"
#include "core/quant.h"

/* Grow-only device scratch buffers, one per purpose; an op may use only the
 * slots named for its file. Contents do not survive to the next op. */
typedef enum cuda_scratch_slot {
    CUDA_SCRATCH_COPY = 0,     /* cuda_backend.cu: overlapping copies */
    CUDA_SCRATCH_CTRL,         /* cuda_backend.cu: small control arrays (tokens, positions) */
    CUDA_SCRATCH_COPY_ROWS,    /* cuda_backend.cu: copy_rows' pointer table */
    CUDA_SCRATCH_ROW_IDX,      /* cuda_backend.cu: add_weight_rows_at's table rows */
    CUDA_SCRATCH_POOL_STATES,  /* cuda_attention.cu: compressor_pool_states' pointer table */
    CUDA_SCRATCH_MATMUL_ACT,   /* cuda_matmul.cu: quantised activations */
    CUDA_SCRATCH_MATMUL_CTRL,  /* cuda_matmul.cu: expert ids / weights */
    CUDA_SCRATCH_MOE_GATE,     /* cuda_matmul.cu */
    CUDA_SCRATCH_MOE_UP,       /* cuda_matmul.cu */
    CUDA_SCRATCH_MOE_ACT,      /* cuda_matmul.cu */
    CUDA_SCRATCH_MOE_X,        /* cuda_matmul.cu: the MoE's quantised input (not MATMUL_ACT: the shared
                                * expert's products beside it in a step take that one) */
    CUDA_SCRATCH_MOE_SORTED,   /* cuda_matmul.cu: activations in expert order */
    CUDA_SCRATCH_MOE_GROUPS,   /* cuda_matmul.cu: expert groups and slot order */
    CUDA_SCRATCH_GEMM_PART,    /* cuda_gemm.cu: split-K partial sums */
    CUDA_SCRATCH_ATTN,         /* cuda_attention.cu */
    CUDA_SCRATCH_ATTN_CTRL,    /* cuda_attention.cu: positions */
    CUDA_SCRATCH_ATTN_ROWS,    /* cuda_attention.cu: attention_rows' per-row views */
    CUDA_SCRATCH_IDX_ROWS,     /* cuda_attention.cu: indexer_scores_rows' / top_k_rows' per-row counts */
    CUDA_SCRATCH_TOPK_A,       /* cuda_attention.cu */
    CUDA_SCRATCH_TOPK_B,       /* cuda_attention.cu */
    CUDA_SCRATCH_TOPK_D,       /* cuda_attention.cu */
    CUDA_SCRATCH_HC,           /* cuda_hc_ffn.cu */
    CUDA_SCRATCH_ROUTER,       /* cuda_hc_ffn.cu */
    CUDA_SCRATCH_SLOTS
} cuda_scratch_slot;
static_assert(CUDA_SCRATCH_SLOTS <= 64, "a recorded branch keeps the slots it took in one 64-bit mask");

/* Bad indices found by kernels (device memory, one per backend). The first
 * kernel thread to claim it (atomicCAS on `claim`, 0 -> 1) fills in the rest;
 * take_error reads it after the stream has drained and clears it. */
typedef struct cuda_dev_error {
    unsigned long long claim; /* 0: nothing reported */
    long long value;          /* the bad index */
    long long limit;          /* valid indices are [0, limit) */
    long long pos;            /* where it was read (entry of the index array) */
    int code;                 /* cuda_check_code */
    int tag;                  /* cuda_check_tag: the name to report, or -1 */
} cuda_dev_error;

/* What a kernel was checking when it found a bad index. */
typedef enum cuda_check_code {
    CUDA_CHECK_MOE_EXPERT = 1,    /* moe: an expert id; tag = the gate weight */
    CUDA_CHECK_ATTENTION_ROW = 2, /* attention: a row of rows_b; tag = the sinks */
} cuda_check_code;

#define CUDA_CHECK_NAMES 256 /* distinct weight names a backend keeps for these messages */
#define CUDA_CHECK_NAME_MAX 96

/* executable graphs kept: one per segment of each step shape (which
 * compressors emit a row), see cuda_launch.cu */
/* Rows from which the row kernels take their warp and several-row forms
 * (wide_rows): below it (a decoded token's few rows) the block forms,
 * whose more threads a row are faster for so little work. */
#define CUDA_WIDE_MIN_ROWS 8
#define CUDA_GRAPH_CACHE 48

/* One recorded launch of a step (cuda_launch.cu): a kernel with its
 * argument bytes (in the step's byte pool), or a device copy or memset. */
typedef enum cuda_node_kind { CUDA_NODE_KERNEL = 1, CUDA_NODE_COPY, CUDA_NODE_MEMSET } cuda_node_kind;
#define CUDA_NODE_MAX_ARGS 24
typedef struct cuda_node {
    int kind;                                 /* cuda_node_kind */
    const void *func;                         /* kernel */
    const char *what;                         /* its name for messages (a string literal) */
    dim3 grid, block;
    unsigned smem;
    int n_args;
    uint32_t data;                            /* offset of the argument bytes in the pool */
    uint32_t arg_off[CUDA_NODE_MAX_ARGS];     /* each argument's offset from `data` */
    uint32_t data_len;
    void *dst;                                /* copy / memset */
    const void *src;                          /* copy */
    size_t bytes;
    int value;                                /* memset byte */
    cudaMemcpyKind dir;
    /* the entries it waits for: `pred` (-1: the segment's arena copy), the
     * one before it on its chain, and `join` (-1: none), the last entry of
     * a side branch (cuda_branch_*) it also waits for; `side`: on a branch */
    int pred, join;
    bool side;
} cuda_node;

/* A step's launches in order, with their argument bytes. */
typedef struct cuda_node_log {
    cuda_node *nodes;
    int n, cap;
    uint8_t *pool;
    size_t pool_used, pool_cap;
    uint64_t key; /* hash of the kinds and kernels, in order: the step's shape */
} cuda_node_log;

/* An executable graph of one step shape, with the parameters it holds now. */
typedef struct cuda_graph_rec {
    cuda_node_log log;        /* what the graph runs now */
    cudaGraph_t graph;
    cudaGraphNode_t *gnodes;  /* graph node of each log entry */
    cudaGraphNode_t arena_node; /* the segment's control upload */
    size_t arena_off, arena_bytes; /* the arena bytes it copies */
    cudaGraphExec_t exec;
    uint64_t last_use;
} cuda_graph_rec;

/* The Sinkhorn half of an hc_pre split left for later (cuda_hc_ffn.cu):
 * comb holds the rows' comb logits (scaled mix plus base), which the task
 * turns into the normalised comb in place, one warp per row. */
typedef struct cuda_comb_task {
    float *comb; /* [n_rows, n_hc * n_hc] */
    int n_hc, iters, n_rows;
    float eps;
} cuda_comb_task;

typedef struct cuda_backend {
    int device;
    int sm_count; /* the device's multiprocessors (0: not asked yet; cuda_sm_count) */
    cudaStream_t stream;
    ds4_error error; /* first error since the last take_error; DS4_OK if none */
    void *scratch[CUDA_SCRATCH_SLOTS];
    size_t scratch_cap[CUDA_SCRATCH_SLOTS];
    void *ctrl_host[CUDA_SCRATCH_SLOTS]; /* pinned sources of cuda_upload_ctrl, per slot */
    size_t ctrl_cap[CUDA_SCRATCH_SLOTS];
    cudaEvent_t ctrl_done[CUDA_SCRATCH_SLOTS]; /* the last copy out of ctrl_host[slot] */
    uint8_t *ring_host;   /* pinned control ring (cuda_upload_ctrl), CUDA_CTRL_RING bytes */
    uint8_t *ring_dev;    /* its device twin */
    size_t ring_off;      /* next free byte of the current lap */
    cudaEvent_t ring_lap; /* recorded when a lap ends */
    /* step recording (step_begin / step_end, cuda_launch.cu): launches go
     * into `log` instead of the stream; step_end replays them as a cached
     * executable graph of the same shape (the parameters that changed are
     * set node by node) or as a new one. Control uploads of a recorded step
     * go to the step arena (pinned, with a device twin), copied to the
     * device by the graph's first node, so their addresses repeat from step
     * to step. */
    bool graphs_on; /* steps are recorded (ds4_cuda_backend_set_graphs) */
    bool pdl;       /* kernels launched as programmatic dependents (DS4_CUDA_PDL=0: off) */
    bool mv_smem;   /* the matvec kernels may use their shared memory (cuda_matvec.cu) */
    bool mv_xq;     /* Q8_0 decode products may quantise their own x (DS4_CUDA_MV_XQ=0: off) */
    bool mv_pack;   /* one-row products of short rows pack several rows per stage (DS4_CUDA_MV_PACK=0: off) */
    bool mv_xs;     /* one-row float-weight products read x from shared memory (off by default; DS4_CUDA_MV_XS=1: on) */
    int64_t mv_packed_launches; /* matvec launches that packed them (ds4_cuda_backend_mv_packed_launches) */
    bool moe_xq;    /* the MoE's SwiGLU and mid quantisation in one kernel (DS4_CUDA_MOE_XQ=0: off) */
    bool norm_rope; /* head_norm_rope as one fused kernel (on by default; DS4_CUDA_NORM_ROPE=0: the separate ops' kernels) */
    bool norm_rope2; /* head_norm_rope2's two row sets in one kernel (on by default; DS4_CUDA_NORM_ROPE2=0: a kernel each) */
    bool hc_norm;   /* hc_pre_norm's norm in hc_pre's finishing kernel (on by default; DS4_CUDA_HC_NORM=0: the two ops' kernels) */
    /* hc_pre's Sinkhorn off its chain: the finishing kernel leaves the comb
     * logits, and the next long enough weight product on the main chain
     * runs the rounds in blocks of its own (cuda_hc_take_comb), or a kernel
     * of their own runs them before anything reads comb (cuda_hc_settle) */
    bool hc_defer;         /* on by default; DS4_CUDA_HC_DEFER=0: the split in the finishing kernel */
    int64_t hc_defer_bytes; /* the weight bytes of a product that takes them (DS4_CUDA_HC_DEFER_BYTES) */
    bool comb_pending;     /* a task waits for a product or a settle */
    bool comb_branch;      /* its kernel ran on a side branch not yet joined */
    cuda_comb_task comb;
    uint64_t comb_taken, comb_settled; /* tasks run by products, by a kernel of their own */
    int hc_all;       /* hc_pre's partial blocks take every mix row: 0 never, 1 for many rows (the default), 2 always (DS4_CUDA_HC_ALL) */
    bool hc_post_pre; /* hc_post_pre_norm's residual step in hc_pre's partial kernel (on by default; DS4_CUDA_HC_POST_PRE=0: hc_post's kernel first) */
    int gemm_bm;      /* weight rows per block of the int8 GEMM where its tiles fill the device: 128 (default) or 64 (DS4_CUDA_GEMM_BM, ds4_cuda_backend_set_gemm_bm) */
    bool wide_rows;   /* the row kernels' warp and several-row forms (for at least CUDA_WIDE_MIN_ROWS rows): head_norm_rope's warp a head, hc_pre's partial pass of
                       * HC_ROWS rows a block, the quantisers' warp / lane-pair kernels, the attention combine's warp
                       * a head (on by default; DS4_CUDA_WIDE_ROWS=0: the block forms; the same bits either way) */
    bool router_reg;  /* the router's keys and probabilities on chip (router_reg_kernel; off by default, DS4_CUDA_ROUTER_REG=1 turns it on: measured slower in decode) */
    bool moe_grouped; /* several tokens' routed experts grouped by expert (DS4_CUDA_MOE_GROUPED=0: off) */
    bool moe_mma;     /* ... their products on the int8 tensor cores where the types allow (DS4_CUDA_MOE_MMA=0: off) */
    int moe_mma_rows; /* ... up to this many tokens of an expert per pass: 32 or 64 (the default; DS4_CUDA_MOE_MMA_ROWS=32) */
    int moe_mma_blocks; /* ... the kernel of eight token tiles held to the registers of 3 (the default) or 1 block an SM (DS4_CUDA_MOE_MMA_BLOCKS=1) */
    int moe_step_rows; /* ... and inside recorded steps, sorted on the device, groups of up to this many rows
                        * (1, 2, 4 or 8; 0: off, the default; DS4_CUDA_MOE_STEP_GROUP=N) */
    int64_t moe_mma_calls; /* MoE calls that ran there (ds4_cuda_backend_moe_mma_calls) */
    bool moe_ids;     /* one token's streaming MoE reads the router's ids itself (DS4_CUDA_MOE_IDS=0: the check kernel first) */
    bool fgemm;       /* F16-weight products of many tokens on the tensor cores (DS4_CUDA_FGEMM=0: off) */
    bool att_tc;      /* attention_rows_f16's batches on the f16 tensor cores (DS4_CUDA_ATT_TC=0: off) */
    int att_tc_warps; /* their kernel's warps a block: 8, or 16 (DS4_CUDA_ATT_TC_WARPS=16) */
    int64_t att_tc_calls; /* launches that ran there (ds4_cuda_backend_att_tc_calls) */
    int idx_keys;     /* keys a warp of a prefill's indexer scores: 4, or 1 (DS4_CUDA_IDX_KEYS=1) */
    int64_t idx_keys_calls; /* indexer launches of 4 keys a warp (ds4_cuda_backend_idx_keys_calls) */
    bool idx_tc;      /* indexer_scores_rows_f16 on the f16 tensor cores (DS4_CUDA_IDX_TC=0: the float kernels) */
    int64_t idx_tc_calls; /* launches that ran there (ds4_cuda_backend_idx_tc_calls) */
    int64_t fgemm_calls; /* products that ran there (ds4_cuda_backend_fgemm_calls) */
    int64_t gemm_bm128_calls; /* int8 GEMM launches of 128-row blocks (ds4_cuda_backend_gemm_bm128_calls) */
    bool in_step;   /* between step_begin and step_end */
    bool recording; /* launches go into the log */
    bool segments;  /* a step may be submitted in segments at its marks (DS4_CUDA_SEGMENTS=0: one graph) */
    int seg;        /* segments of this step submitted so far */
    int seg_marks;  /* step_mark calls in this step so far */
    size_t seg_arena0; /* arena offset where the current segment's control data starts */
    bool seg_timed;    /* graph_t0 was recorded before this step's first segment */
    const char *last_break; /* why the last recorded step was broken off (cuda_step_break) */
    const char *last_refusal; /* the node whose update CUDA refused last (a graph rebuilt for it) */
    cuda_node_log log;
    /* side branches of a recorded step (cuda_branch_begin / _end / _join):
     * entries recorded between begin and end form a chain of their own
     * from the main chain's entry at the begin; the main chain goes on from
     * there, and its first entry after a join also waits for the branch.
     * A main entry that takes a scratch slot the branch took joins first. */
    bool branches;    /* side branches are recorded (on by default; DS4_CUDA_BRANCH=0: one chain) */
    bool br_side;     /* recording a side branch */
    int last_main;    /* the log's last entry on the main chain (-1: none yet) */
    int br_fork;      /* the main chain's last entry when the branch began */
    int br_last;      /* the branch's last entry (-1: none yet) */
    int br_pending;   /* a branch's last entry that the main chain has not joined (-1: none) */
    bool br_join_next; /* the next main entry joins br_pending */
    uint64_t br_slots; /* scratch slots the pending branch took (bit per slot) */
    /* a branch begun while another is pending runs beside it (both fork
     * from the main chain): the first's last entry and slots wait here
     * until the second ends, whose last entry then also waits for the first
     * (one join takes both); an entry of the second that takes a slot the
     * first took waits for the first right there */
    int br_prev;          /* the first branch's last entry (-1: none) */
    uint64_t br_prev_slots;
    bool br_wait_prev;    /* the second's next entry waits for br_prev */
    uint64_t br_count, br_auto_joins; /* branches recorded; joins forced by a scratch slot */
    uint64_t br_beside;               /* branches recorded beside a pending one */
    bool rec_leaf;    /* the entry being recorded is a leaf off the chain (cuda_launch_leaf) */
    /* weights into the L2 ahead of their products (cuda_prefetch.cu) */
    int pf_mode;            /* 0 off (default), 1 the copy engine's L2 prefetch, 2 loads (DS4_CUDA_PREFETCH) */
    int64_t pf_max_bytes;   /* bytes one call asks for at most (DS4_CUDA_PREFETCH_MIB; default 3/4 of the L2) */
    bool pf_ops, pf_experts; /* the op's calls, the experts' down matrices (DS4_CUDA_PREFETCH_OPS / _EXPERTS=0: not) */
    unsigned *pf_sink;      /* device word the loads' kernel may write (never read) */
    uint64_t pf_nodes, pf_bytes; /* prefetch launches recorded, and the bytes they ask for */
    cuda_graph_rec graphs[CUDA_GRAPH_CACHE];
    uint64_t graph_clock;
    uint8_t *arena_host, *arena_dev;
    size_t arena_used;
    cudaEvent_t arena_done; /* the last copy out of arena_host */
    cudaEvent_t graph_t0, graph_t1; /* around the last step's graph launches (timing) */
    bool graph_timed;               /* graph_t0/t1 hold a launch not yet counted */
    uint64_t step_t0;               /* host clock at step_begin */
    struct cuda_profiler *prof;     /* kernel timing (DS4_CUDA_PROFILE=1), else NULL */
    cudaStream_t upload;                       /* weight uploads */
    void *wstage[2];                           /* pinned weight staging buffers */
    cudaEvent_t wstage_done[2];
    size_t weight_bytes; /* device memory held by bound weights */
    size_t peak_bytes;   /* highest device memory in use seen (cudaMemGetInfo) */
    ds4_backend_counters counters; /* launches, copies, syncs (cuda_count_*) */
    cuda_dev_error *dev_error;      /* device: bad indices found by kernels */
    cuda_dev_error *dev_error_host; /* pinned: where take_error reads it */
    void *dl_host;                  /* pinned staging of download */
    size_t dl_cap;
    char check_names[CUDA_CHECK_NAMES][CUDA_CHECK_NAME_MAX]; /* cuda_check_tag's names */
    int n_check_names;
} cuda_backend;

static inline cuda_backend *cuda_impl(ds4_backend *be) { return (cuda_backend *)be->impl; }
static inline cudaStream_t cuda_stream(ds4_backend *be) { return cuda_impl(be)->stream; }

/* An on/off setting from the environment: "0" off, "1" on, anything else
 * (or unset) `dflt`. */
static inline bool cuda_env_flag(const char *name, bool dflt) {
    const char *e = getenv(name);
    if (e && e[0] == '0' && !e[1]) return false;
    if (e && e[0] == '1' && !e[1]) return true;
    return dflt;
}
/* The device's multiprocessor count (asked once; 1 when it cannot be). */
static inline int cuda_sm_count(cuda_backend *cb) {
    if (!cb->sm_count) {
        int n = 0;
        if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, cb->device) != cudaSuccess || n < 1) {
            (void)cudaGetLastError();
            n = 1;
        }
        cb->sm_count = n;
    }
    return cb->sm_count;
}
/* A whole number from the environment within [lo, hi] (a tuning setting);
 * unset or anything else: `dflt`. */
static inline long cuda_env_long(const char *name, long dflt, long lo, long hi) {
    const char *e = getenv(name);
    if (!e || !*e) return dflt;
    char *end = NULL;
    const long v = strtol(e, &end, 10);
    return end && !*end && v >= lo && v <= hi ? v : dflt;
}
/* The host's monotonic clock in nanoseconds. */
uint64_t cuda_now_ns(void);

/* Record an error (only the first since the last take_error is kept). */
void cuda_fail(ds4_backend *be, ds4_status status, const char *fmt, ...) DS4_PRINTF(3, 4);
/* true when an error is pending (ops may then return at once). */
bool cuda_failed(ds4_backend *be);
/* Record a failed CUDA call; true when e == cudaSuccess. */
bool cuda_ok(ds4_backend *be, cudaError_t e, const char *call, const char *file, int line);
#define CUDA_OK(be, call) cuda_ok((be), (call), #call, __FILE__, __LINE__)
/* Count a host <-> device copy of `bytes` (h2d true: to the device). */
static inline void cuda_count_copy(ds4_backend *be, bool h2d, size_t bytes) {
    ds4_backend_counters *c = &cuda_impl(be)->counters;
    c->copies++;
    if (h2d) c->h2d_bytes += bytes;
    else c->d2h_bytes += bytes;
}

/* A device scratch buffer of at least `bytes` for `slot` (grown as needed;
 * growing waits for the stream first). NULL, with the error recorded, when
 * it cannot be allocated. */
void *cuda_scratch(ds4_backend *be, cuda_scratch_slot slot, size_t bytes);
/* Copy `bytes` of host control data to the device slot on the stream (via
 * pinned staging, so the host array may be reused when this returns). NULL
 * with the error recorded on failure. */
void *cuda_upload_ctrl(ds4_backend *be, cuda_scratch_slot slot, const void *host, size_t bytes);
/* Wait for the stream; records and returns false on a device fault. Inside
 * a recorded step, what was recorded so far is submitted first and the
 * recording goes on after the wait. */
bool cuda_sync(ds4_backend *be);
/* Inside a recorded step: launch what was recorded so far onto the stream
 * and go on without recording until the step ends (a host wait, an
 * allocation or a library call that launches on its own must see the
 * stream in program order). Does nothing outside a recorded step. */
void cuda_step_break(ds4_backend *be, const char *why);

/* ---- launches (cuda_launch.cu) --------------------------------------------
 * Every kernel, device copy and memset of an op goes through these, so a
 * recorded step can keep it instead of launching it. */
typedef struct cuda_args {
    int n;
    size_t used;
    bool overflow;
    uint32_t off[CUDA_NODE_MAX_ARGS];
    alignas(16) uint8_t data[1024];
} cuda_args;

template <typename T> static inline void cuda_args_put(cuda_args &a, const T &v) {
    size_t at = (a.used + alignof(T) - 1) & ~(size_t)(alignof(T) - 1);
    if (a.n >= CUDA_NODE_MAX_ARGS || at + sizeof(T) > sizeof a.data) {
        a.overflow = true;
        return;
    }
    memset(a.data + a.used, 0, at - a.used);
    memcpy(a.data + at, &v, sizeof(T));
    a.off[a.n++] = (uint32_t)at;
    a.used = at + sizeof(T);
}

/* Launch (or record) kernel `k` with `args` converted to its parameter
 * types; false (error recorded, naming `what`) when it failed. */
bool cuda_launch_args(ds4_backend *be, const char *what, const void *func, dim3 grid, dim3 block, size_t smem,
                      const cuda_args *a);
template <typename... P, typename... A>
static inline bool cuda_launch(ds4_backend *be, const char *what, void (*k)(P...), dim3 grid, dim3 block,
                               size_t smem, A... args) {
    static_assert(sizeof...(P) == sizeof...(A), "kernel argument count");
    cuda_args a;
    a.n = 0;
    a.used = 0;
    a.overflow = false;
    (cuda_args_put<P>(a, static_cast<P>(args)), ...);
    return cuda_launch_args(be, what, (const void *)k, grid, block, smem, &a);
}
/* The same, as a leaf of a recorded step: the kernel waits for the entry
 * recorded last on the chain being recorded, and nothing waits for it (the
 * chain goes on from that entry). Outside a recorded step it launches
 * nothing and returns false (for kernels whose work is a hint). */
template <typename... P, typename... A>
static inline bool cuda_launch_leaf(ds4_backend *be, const char *what, void (*k)(P...), dim3 grid, dim3 block,
                                    size_t smem, A... args) {
    cuda_backend *cb = (cuda_backend *)be->impl;
    if (!cb->recording) return false;
    cb->rec_leaf = true;
    const bool ok = cuda_launch(be, what, k, grid, block, smem, args...);
    cb->rec_leaf = false;
    return ok;
}
/* Device-to-device copy of `bytes` (no overlap) and byte fill, on the stream
 * or into the recorded step. */
bool cuda_copy_d2d(ds4_backend *be, void *dst, const void *src, size_t bytes);
bool cuda_memset_d(ds4_backend *be, void *dst, int value, size_t bytes);
/* step_begin / step_end, and the recording state's teardown. */
void cuda_step_begin(ds4_backend *be);
void cuda_step_end(ds4_backend *be);
void cuda_step_mark(ds4_backend *be);
/* Side branches (backend.h's branch_begin / branch_end / branch_join);
 * outside a recorded step they do nothing. */
void cuda_branch_begin(ds4_backend *be);
void cuda_branch_end(ds4_backend *be);
void cuda_branch_join(ds4_backend *be);
/* A scratch slot taken by the op being recorded (cuda_scratch): taken
 * inside a branch, it is the branch's until the join; taken on the main
 * chain while the branch holds it, the next main entry joins the branch. */
void cuda_branch_slot(cuda_backend *cb, int slot);
/* On the main chain of a recorded step with a branch not yet joined: the
 * next main entry joins it (counted in br_auto_joins); else nothing. */
void cuda_branch_force_join(cuda_backend *cb);
/* hc_pre's deferred Sinkhorn (see cuda_backend's hc_defer): settle runs a
 * pending task now, in a kernel of its own (every op that reads comb, a
 * download and step_end call it); take hands it to a product of
 * weight_bytes on the main chain (true: *t is the product's to run). */
void cuda_hc_settle(ds4_backend *be);
/* ... the same, only where [p, p + n) overlaps the pending task's comb (a
 * copy or fill reading or writing it) */
void cuda_hc_settle_touching(ds4_backend *be, const float *p, int64_t n);
bool cuda_hc_take_comb(cuda_backend *cb, double weight_bytes, cuda_comb_task *t);
void cuda_hc_defer_init(cuda_backend *cb); /* the settings from the environment */
ds4_status cuda_launch_init(cuda_backend *cb, ds4_error *err);
/* The prefetch op (backend.h), its settings from the environment and the
 * device's L2 size, and the routed experts' down matrices of the token
 * being decoded once sel (device, slots ids) is known. */
void cuda_prefetch(ds4_backend *be, const ds4_weight *const *w, int n);
ds4_status cuda_prefetch_init(cuda_backend *cb, ds4_error *err);
void cuda_prefetch_free(cuda_backend *cb);
void cuda_prefetch_experts(ds4_backend *be, const ds4_weight *w, const int32_t *sel, int64_t slots);
/* Kernel timing: fold the finished launches into the per-kernel totals
 * (waits for the last one). */
void cuda_profile_collect(ds4_backend *be);
/* Count the device time of the last graph launch once it has finished. */
void cuda_graph_timing_collect(cuda_backend *cb);
void cuda_launch_free(cuda_backend *cb);
/* In a recorded step: `bytes` of control data copied into the step arena;
 * the device address it will have, or NULL when it does not fit (the
 * caller then uploads it another way). */
void *cuda_arena_put(ds4_backend *be, const void *host, size_t bytes);

/* A small number standing for `name` (a weight's name) in the device error
 * record, so take_error can name it; the same name gives the same tag. -1
 * when the table is full (the message then says the name was not kept). */
int cuda_check_tag(ds4_backend *be, const char *name);
/* The device error record kernels report bad indices into. */
static inline cuda_dev_error *cuda_dev_error_of(ds4_backend *be) { return ((cuda_backend *)be->impl)->dev_error; }

#define CUDA_SMEM_DEFAULT (48 * 1024)   /* dynamic shared memory usable without opting in */
#define CUDA_SMEM_STATIC_RESERVE 2048    /* static shared memory of the kernels, at most (matvec: 2 KiB) */
/* The table a[0..n), b[0..n) of backend pointers (host arrays) uploaded as
 * control data (a recorded step's arena, else the ring): NULL with the error
 * recorded when it could not be. For kernels that take one pointer pair per
 * block. */
const uint64_t *cuda_upload_pointer_pairs(ds4_backend *be, cuda_scratch_slot slot, const void *const *a,
                                          const void *const *b, int64_t n, const char *op);
/* Allow `kernel` `bytes` of dynamic shared memory on this backend's device:
 * free below 48 KiB, else opt in up to the device's limit. false (error
 * recorded, naming op and width) when too large. */
bool cuda_allow_dynamic_smem(ds4_backend *be, const void *kernel, size_t bytes, const char *op, int64_t dim);

/* A weight's name for messages (NULL-safe). */
static inline const char *cuda_wname(const ds4_weight *w) { return w && w->name ? w->name : "(unnamed)"; }
/* Device bytes of weight row `row`. */
static inline const void *cuda_weight_row(const ds4_weight *w, int64_t row) {
    return (const uint8_t *)w->device + row * w->row_bytes;
}
static inline int64_t cuda_weight_rows(const ds4_weight *w) { return w->ne[1] * w->ne[2] * w->ne[3]; }
/* true for F32, F16 and BF16 (read element-wise with cuda_load_float). */
static inline bool cuda_is_float_type(uint32_t t) {
    return t == DS4_TYPE_F32 || t == DS4_TYPE_F16 || t == DS4_TYPE_BF16;
}

/* ---- device helpers ------------------------------------------------------ */

/* The first statement of every kernel: wait until the kernel this one was
 * launched after has finished and its writes are visible, then allow the
 * next kernel to launch. Kernels are launched as programmatic dependents of
 * the one before them (cuda_launch.cu). The trigger takes effect once every
 * block of this grid has run it (or exited), that is when the last wave of
 * blocks is resident, so the next kernel's blocks are scheduled onto the SMs
 * that this grid's last wave frees and wait there, in their own
 * cuda_grid_wait, for this grid to finish: launch latency overlaps the tail
 * instead of following it. Correctness does not depend on the trigger's
 * position, since the wait is for completion and memory visibility of the
 * whole predecessor (which itself waited for its own predecessor). Without
 * a predecessor (or launched plainly) both return at once. */
static __device__ __forceinline__ void cuda_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

/* Asynchronous 16-byte copy global -> shared (sm_80+ cp.async, bypassing L1
 * and the registers); valid false fills zeros and reads nothing. Copies are
 * grouped by cp_async_commit; cp_async_wait<N> waits until at most N of the
 * calling thread's groups are pending (then a barrier makes them visible to
 * the other threads). */
static __device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
/* The same for a 16-byte copy that is always made, to a shared-memory
 * address already converted (cuda_smem_addr): no source-size operand. */
static __device__ __forceinline__ unsigned cuda_smem_addr(const void *smem) {
    return (unsigned)__cvta_generic_to_shared(smem);
}
static __device__ __forceinline__ void cp_async16_to(unsigned smem_addr, const void *gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem) : "memory");
}
static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* The parts of DS4's Q8_0 activation quantiser (below). */
static __device__ __forceinline__ int8_t cuda_q8_0_code(float v, float id) {
    const int c = __float2int_rn(__fmul_rn(v, id));
    return (int8_t)(c > 127 ? 127 : c < -128 ? -128 : c);
}
static __device__ __forceinline__ float cuda_q8_0_scale(float amax) { return __fdiv_rn(amax, 127.0f); }
static __device__ __forceinline__ float cuda_q8_0_inverse(float d) { return d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f; }

/* DS4's Q8_0 activation quantiser for one 32-block held by a warp, lane i
 * holding element i: d = amax / 127 (float, NaN counted as 0), id = 1/d (0
 * when d == 0), the code round-half-even(v * id) clamped to int8. Returns d
 * (the same in every lane) and stores lane i's code in *q. Bit-identical to
 * the CPU's quantiser; the quantiser kernel and the matvec kernels that
 * quantise their own activations share it. */
static __device__ __forceinline__ float cuda_q8_0_quant_lane(float v, int8_t *q) {
    float amax = fabsf(v);
    if (!(amax == amax)) amax = 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float d = cuda_q8_0_scale(amax);
    *q = cuda_q8_0_code(v, cuda_q8_0_inverse(d));
    return d;
}

/* The same block held as two halves of 16 by neighbouring lanes (2k, 2k + 1;
 * every lane of the warp calls it): max(|v|) is the same whichever lanes
 * take it (fmaxf drops NaNs, as the lane version's NaN -> 0 does), so d and
 * the codes are the lane version's. */
static __device__ __forceinline__ float cuda_q8_0_quant_half(const float4 (&v)[4], uint4 *codes) {
    const float f[16] = { v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w,
                          v[2].x, v[2].y, v[2].z, v[2].w, v[3].x, v[3].y, v[3].z, v[3].w };
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) amax = fmaxf(amax, fabsf(f[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    const float d = cuda_q8_0_scale(amax), id = cuda_q8_0_inverse(d);
    uint32_t w[4] = { 0u, 0u, 0u, 0u };
#pragma unroll
    for (int i = 0; i < 16; i++) w[i / 4] |= (uint32_t)(uint8_t)cuda_q8_0_code(f[i], id) << (8 * (i % 4));
    *codes = make_uint4(w[0], w[1], w[2], w[3]);
    return d;
}

/* Index `value` read at entry `pos` is outside [0, limit): record it unless
 * an earlier report holds the record (the first one wins). The caller skips
 * the work the index stood for. */
static __device__ __forceinline__ void cuda_report_bad_index(cuda_dev_error *e, int code, int tag, long long value,
                                                             long long limit, long long pos) {
    if (atomicCAS(&e->claim, 0ull, 1ull) != 0ull) return;
    e->value = value;
    e->limit = limit;
    e->pos = pos;
    e->code = code;
    e->tag = tag;
}

/* One compare for [0, limit): a negative int32 becomes a huge unsigned value. */
static __device__ __forceinline__ bool cuda_index_ok(int32_t v, long long limit) {
    return (unsigned long long)(long long)v < (unsigned long long)limit;
}

/* Exact binary16 / bfloat16 -> float (the CPU's converters' values, bit for
 * bit: finite values and infinities through the hardware conversion, which
 * is exact; NaNs built by hand so their payload is kept). */
static __device__ __forceinline__ float cuda_f16_to_f32(uint16_t h) {
    if ((h & 0x7c00u) != 0x7c00u || !(h & 0x3ffu)) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    return __uint_as_float(((uint32_t)(h & 0x8000u) << 16) | 0x7f800000u | ((uint32_t)(h & 0x3ffu) << 13));
}

/* c += a . b on the int8 tensor cores (mma m16n8k32, s8 x s8 -> s32, A
 * row-major, B column-major): the fragments of one warp, exact integer sums. */
static __device__ __forceinline__ void cuda_mma_s8(int (&c)[4], const int (&a)[4], int b0, int b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* c += a . b on the f16 tensor cores (mma m16n8k16, f16 x f16 -> f32, A
 * row-major, B column-major): the fragments of one warp. */
static __device__ __forceinline__ void cuda_mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* Four 8x8 matrices of 16-bit values from shared memory (ldmatrix .x4:
 * lanes 8 i .. 8 i + 7 give the row addresses of matrix i), as MMA
 * fragments; _trans: each matrix transposed. */
static __device__ __forceinline__ void cuda_ldsm_x4(uint32_t (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
static __device__ __forceinline__ void cuda_ldsm_x2(uint32_t (&r)[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
static __device__ __forceinline__ void cuda_ldsm_x4_trans(uint32_t (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/*
 * Warp reductions of N values at once (N a power of two <= 32), each
 * value's result the same bits as its shuffle tree over the 32 lanes
 * (for (o = 16; o; o >>= 1) v = op(v, shfl_down(v, o)) in lane 0, or the
 * xor butterfly in every lane): every node of those trees combines the
 * results of the same two lane sets (the lanes equal to l in the bits
 * below o, split by bit o), and here too, only with the two operands in
 * either order, and op is commutative (a float or double add, fmaxf). At
 * each step a lane keeps half of its values and sends the other half to
 * its partner (lane ^ o), so N values cost N - 1 + log2(32 / N) shuffles
 * instead of 5 N. Value k's result ends in lanes (32 / N) k ..
 * (32 / N) (k + 1) - 1 and is returned there. (A CPU emulation of the
 * exchanges against the trees agreed on 768,000 sums, float and double.)
 */
struct cuda_add_op {
    template <typename F> __device__ __forceinline__ F operator()(F a, F b) const { return a + b; }
};
struct cuda_max_op {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
template <int N, typename F, typename Op>
static __device__ __forceinline__ F cuda_warp_split(const F (&v)[N], Op op, int o = 16) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "a power of two of values, at most 32");
    if constexpr (N == 1) {
        F f = v[0];
        for (; o > 0; o >>= 1) f = op(f, __shfl_xor_sync(0xffffffffu, f, o));
        return f;
    } else {
        const bool hi = threadIdx.x & o; /* this lane keeps the upper half, its partner (lane ^ o) the lower */
        F e[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; i++)
            e[i] = op(hi ? v[N / 2 + i] : v[i], __shfl_xor_sync(0xffffffffu, hi ? v[i] : v[N / 2 + i], o));
        return cuda_warp_split<N / 2>(e, op, o >> 1);
    }
}

/* The power of two s that puts a largest |x| of m (>= 0; NaNs dropped)
 * in [2^14, 2^15) (s within float's normal range; 0 for m 0 or not
 * finite), so x 2^s splits into two binary16 parts (cuda_f16_split) clear
 * of binary16's overflow and mostly of its subnormals. */
static __device__ __forceinline__ int cuda_f16_split_scale(float m) {
    int s = 0;
    if (m > 0.0f && m <= 3.4e38f) {
        int e;
        frexpf(m, &e); /* m = f 2^e, f in [0.5, 1) */
        s = 15 - e;
        s = s > 120 ? 120 : s < -120 ? -120 : s;
    }
    return s;
}
/* v as two binary16 parts, hi = f16(v) and lo = f16(v - hi) (v - hi is
 * exact; hi + lo carries 22 of v's 24 bits); a v that is not finite stays
 * in hi, lo 0. */
static __device__ __forceinline__ void cuda_f16_split(float v, __half &hi, __half &lo) {
    hi = __float2half_rn(v);
    const float rest = v - __half2float(hi);
    lo = __float2half_rn(rest == rest ? rest : 0.0f);
}

/* binary16 -> float by the hardware conversion alone: exact for finite
 * values and infinities, a NaN becomes the canonical NaN. For scales that
 * are only multiplied (a product of a NaN is the canonical NaN anyway). */
static __device__ __forceinline__ float cuda_f16_to_f32_arith(uint16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
static __device__ __forceinline__ float cuda_bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
/* Eight F16 (T = DS4_TYPE_F16) or BF16 values of one 16-byte word, as floats,
 * in order; ARITH: F16 values that are only multiplied, whose NaNs need not
 * keep their payload (cuda_f16_to_f32_arith: the product of a NaN is the
 * canonical NaN either way), without the payload path's instructions. */
template <uint32_t T, bool ARITH = false>
static __device__ __forceinline__ void cuda_half8_to_f32(uint4 h, float (&v)[8]) {
    const uint32_t hw[4] = { h.x, h.y, h.z, h.w };
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if constexpr (T == DS4_TYPE_F16 && ARITH) {
            v[2 * j] = cuda_f16_to_f32_arith((uint16_t)(hw[j] & 0xffffu));
            v[2 * j + 1] = cuda_f16_to_f32_arith((uint16_t)(hw[j] >> 16));
        } else if constexpr (T == DS4_TYPE_F16) {
            v[2 * j] = cuda_f16_to_f32((uint16_t)(hw[j] & 0xffffu));
            v[2 * j + 1] = cuda_f16_to_f32((uint16_t)(hw[j] >> 16));
        } else {
            v[2 * j] = __uint_as_float(hw[j] << 16);
            v[2 * j + 1] = __uint_as_float(hw[j] & 0xffff0000u);
        }
    }
}

/* Element i of a float-typed (F32/F16/BF16) weight or vector at device p. */
static __device__ __forceinline__ float cuda_load_float(const void *p, uint32_t type, int64_t i) {
    if (type == DS4_TYPE_F32) return ((const float *)p)[i];
    if (type == DS4_TYPE_F16) return cuda_f16_to_f32(((const uint16_t *)p)[i]);
    return cuda_bf16_to_f32(((const uint16_t *)p)[i]);
}

/* expf / log1pf as the C library computes them: the correctly rounded float
 * of a double evaluation, which is what glibc's (sub-0.502-ulp) float
 * functions return for all but a vanishing fraction of inputs. CUDA's own
 * expf is up to 2 ulp off, which under DS4 numerics can move a value across
 * a Q8 rounding boundary and change a quantised activation. */
static __device__ __forceinline__ float cuda_expf(float x) { return __double2float_rn(exp((double)x)); }
static __device__ __forceinline__ float cuda_log1pf(float x) { return __double2float_rn(log1p((double)x)); }

/* Two-branch sigmoid as the CPU computes it (expf of a non-positive argument). */
static __device__ __forceinline__ float cuda_sigmoid(float x) {
    if (x >= 0.0f) return __fdiv_rn(1.0f, __fadd_rn(1.0f, cuda_expf(-x)));
    const float e = cuda_expf(x);
    return __fdiv_rn(e, __fadd_rn(1.0f, e));
}
static __device__ __forceinline__ float cuda_silu(float x) { return __fmul_rn(x, cuda_sigmoid(x)); }
static __device__ __forceinline__ float cuda_swiglu1(float g, float u, float limit, float scale) {
    if (limit > 0.0f) {
        if (g > limit) g = limit;
        if (u > limit) u = limit;
        if (u < -limit) u = -limit;
    }
    return __fmul_rn(__fmul_rn(cuda_silu(g), u), scale);
}

/* cuda_dequant.cu: n_rows rows of row_elems elements of a bound weight
 * (device memory) dequantised to floats at d_dst, on the stream or into the
 * recorded step; false (error recorded, naming `what`) on failure. */
bool cuda_dequant_weight_rows(ds4_backend *be, uint32_t type, const void *d_src, float *d_dst, int64_t n_rows,
                              int64_t row_elems, const char *what);

/* ---- the ops (same contracts as backend.h) -------------------------------- */

/* cuda_matmul.cu */
void cuda_matmul(ds4_backend *be, const ds4_weight *w, int64_t row0, int64_t n_out, const float *x,
                 int64_t x_stride, float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num);
void cuda_moe(ds4_backend *be, const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down, const float *x,
              const int32_t *sel, const float *weights, int n_used, float limit, float *out, int64_t n_rows,
              ds4_numerics num);
void cuda_matmul_multi(ds4_backend *be, const ds4_product *p, int n, const float *x, int64_t x_stride, int64_t n_rows,
                       ds4_numerics num);
void cuda_matmul_grouped(ds4_backend *be, const ds4_weight *w, int64_t n_groups, int64_t n_out, const float *x,
                         int64_t x_stride, float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num);
/* true when cuda_matmul can multiply this weight type under `num`. */
bool cuda_matmul_supported(uint32_t type, ds4_numerics num);

/* cuda_attention.cu */
void cuda_rope_matmul_grouped(ds4_backend *be, const ds4_weight *w, int64_t n_groups, int64_t n_out, float *x,
                              int64_t n_heads, int64_t head_dim, const int32_t *pos, const ds4_rope *rope,
                              float *out, int64_t out_stride, int64_t n_rows, ds4_numerics num);
void cuda_rope_tail(ds4_backend *be, float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t *pos,
                    const ds4_rope *rope, bool inverse);
/* Heads the fused head_norm_rope kernel takes: at most INT32_MAX of them,
 * head_dim % 4 == 0 and <= NORM_CACHED, x 16-byte aligned. */
bool cuda_head_norm_rope_fits(const float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim);
/* head_norm_rope as one kernel (checked arguments: ds4_head_norm_rope_valid
 * and cuda_head_norm_rope_fits; the norm weight as device floats or NULL),
 * bit for bit the kernels of rmsnorm, rope_tail, round_fp8_kv and round_f16
 * one after the other. */
void cuda_head_norm_rope_fused(ds4_backend *be, float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim,
                               const float *w, float eps, const int32_t *pos, const ds4_rope *rope, bool round_kv);
/* head_norm_rope of two row sets (rows a, then b, of the same rows and
 * positions) as one kernel: each as cuda_head_norm_rope_fused would (both
 * checked as there; wa, wb device floats or NULL). */
void cuda_head_norm_rope2_fused(ds4_backend *be, float *xa, int64_t heads_a, const float *wa, bool round_a, float *xb,
                                int64_t heads_b, const float *wb, bool round_b, int64_t n_rows, int64_t head_dim,
                                float eps, const int32_t *pos, const ds4_rope *rope);
void cuda_attention_rows(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                         const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                         const int64_t *b_n, const ds4_weight *sinks, float *out);
void cuda_attention_states(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                           const float *const *rows_a, const int64_t *a_n, const float *const *rows_b, const int64_t *b_n,
                           const ds4_weight *sinks, float *out);
void cuda_attention_rows_sel(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                             const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                             const int64_t *b_rows, const int32_t *idx, int64_t k, const ds4_weight *sinks,
                             float *out);
void cuda_attention_rows_f16(ds4_backend *be, const float *q, int64_t n, int64_t n_heads, int64_t dim,
                             const float *rows_a, const int64_t *a_off, const int64_t *a_n, const float *rows_b,
                             const int64_t *b_rows, const int32_t *idx, int64_t k, const ds4_weight *sinks,
                             float *out);
void cuda_attention(ds4_backend *be, const float *q, int64_t n_heads, int64_t dim, const float *rows_a, int64_t n_a,
                    const float *rows_b, int64_t n_rows_b, const int32_t *idx_b, int64_t n_b,
                    const ds4_weight *sinks, float *out);
void cuda_compressor_pool(ds4_backend *be, const float *state_kv, const float *state_score, int ratio, int64_t dim,
                          int64_t n_windows, float *out);
void cuda_compressor_pool_states(ds4_backend *be, const float *const *state_kv, const float *const *state_score,
                               int ratio, int64_t dim, int64_t n, float *out);
void cuda_indexer_scores(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                         int64_t n_heads, int64_t dim, const float *keys, int64_t n_keys, float *scores);
void cuda_top_k(ds4_backend *be, const float *scores, int64_t n, int64_t k, int32_t *idx);
void cuda_indexer_scores_rows(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                              int64_t n_heads, int64_t dim, const float *keys, const int64_t *n_keys, int64_t n_rows,
                              float *scores, int64_t stride);
void cuda_indexer_scores_rows_f16(ds4_backend *be, const float *q, const float *weights, float weight_scale,
                                  int64_t n_heads, int64_t dim, const float *keys, const int64_t *n_keys,
                                  int64_t n_rows, float *scores, int64_t stride);
void cuda_top_k_rows(ds4_backend *be, const float *scores, int64_t stride, const int64_t *n, int64_t n_rows, int64_t k,
                     int32_t *idx);

/* A norm weight of `dim` as device floats for op `op` (F32: the weight
 * itself, else dequantised into the copy scratch); *wv NULL without a
 * weight. false (error recorded) when it does not fit. (cuda_backend.cu) */
bool cuda_norm_weight_floats(ds4_backend *be, const ds4_weight *w, int64_t dim, const char *op, const float **wv);

/* cuda_hc_ffn.cu */
void cuda_hc_pre(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn, const ds4_weight *scale,
                 const ds4_weight *base, float *x_out, float *post, float *comb, int64_t n_rows);
void cuda_hc_pre_norm(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn,
                      const ds4_weight *scale, const ds4_weight *base, const ds4_weight *norm, float eps,
                      float *x_out, float *post, float *comb, float *a_out, int64_t n_rows);
void cuda_hc_post_pre_norm(ds4_backend *be, const ds4_hc *hc, const float *y, const float *y2, const float *X,
                           const float *post, const float *comb, float *X_out, const ds4_weight *fn,
                           const ds4_weight *scale, const ds4_weight *base, const ds4_weight *norm, float eps,
                           float *x_out, float *post_out, float *comb_out, float *a_out, int64_t n_rows);
void cuda_hc_post(ds4_backend *be, const ds4_hc *hc, const float *y, const float *X, const float *post,
                  const float *comb, float *X_out, int64_t n_rows);
void cuda_hc_head(ds4_backend *be, const ds4_hc *hc, const float *X, const ds4_weight *fn, const ds4_weight *scale,
                  const ds4_weight *base, float *out, int64_t n_rows);
void cuda_router(ds4_backend *be, const float *logits, int64_t n_expert, const ds4_weight *bias,
                 const int32_t *hash_ids, int n_used, bool normalise, float scale, int32_t *sel_out,
                 float *weight_out, int64_t n_rows);
void cuda_swiglu(ds4_backend *be, const float *g, const float *u, float limit, float scale, float *out, int64_t n);

#endif

/*
 * cuda_prefetch.cu - weights brought into the L2 cache ahead of the products
 * that read them: the prefetch op (backend.h), and the routed experts' down
 * matrices of a decoded token once the router has chosen them.
 *
 * Why: between two weight products of a decoded token the chain is bound
 * by latency (the HC mixes, norms, RoPE, attention over a few thousand
 * rows: tens of microseconds a layer with the memory system nearly idle),
 * and every product then pays the memory latency and a ramp before it
 * streams at full rate; the small ones (q_a + kv, the compressors, the
 * shared expert) never reach it. In a recorded step the op becomes a leaf
 * of the step's graph (cuda_launch_leaf): a kernel that waits for the
 * entry recorded before it and that nothing waits for, so it runs beside
 * the ops in between and asks the L2 for the weights; the products find
 * them there. Outside a recorded step the op does nothing (a launch on the
 * stream would run after the ops it should run beside). The routed
 * experts' down matrices come in beside the experts' gate/up product, which
 * decodes IQ2_XXS at about a quarter of the memory bandwidth.
 *
 * Measured on the H200 (docs/bench/notes.md, "Weights into the L2 ahead of
 * their products"): slower, so off by default. Decode at 2K against the
 * copy engine's prefetch of every site: off 1.031x, the same leaves asking
 * for 1 MiB each 1.009x (the leaves themselves, about 170 graph nodes a
 * token, cost most of it), the experts' only 1.012x, the op's only
 * 1.002x, loads instead of the copy engine 0.926x. Kept as a setting for
 * other devices and later kernels.
 *
 * Two ways (DS4_CUDA_PREFETCH): 1, the bulk copy engine's L2 prefetch
 * (cp.async.bulk.prefetch.L2, sm_90), one instruction per piece of up to
 * 32 KiB, a warp a block; 2, loads of every 16 bytes by the threads of a
 * grid of one block per multiprocessor (the data pass through the SMs and
 * are dropped); 0, off (the default). A call asks for at most
 * DS4_CUDA_PREFETCH_MIB MiB (default three quarters of the device's L2:
 * more would evict its own first lines before the products read them),
 * the weights in the order given; only whole 16-byte pieces inside each
 * weight are asked for.
 */
#include <stdint.h>
#include <string.h>

#include "backends/cuda/cuda_internal.h"

#define PF_MAX 8                   /* weights one launch takes */
#define PF_PIECE (32u * 1024u)     /* bytes of one bulk prefetch */
#define PF_BULK_BLOCKS 32          /* warps of the bulk prefetch (a warp a block) */
#define PF_EXPERT_BLOCKS 4         /* ... of one routed expert's matrix */
#define PF_LOAD_THREADS 256
#define PF_LOAD_DEPTH 8            /* 16-byte loads a thread has in flight */

typedef struct pf_args {
    const uint8_t *p[PF_MAX]; /* 16-byte aligned */
    uint64_t bytes[PF_MAX];   /* multiples of 16 */
    int n;
    int mode;                 /* 1 bulk, 2 loads */
    /* experts (sel non-NULL): block row y takes slot y's matrix, at
     * p[0] + e * bytes[0] for e = sel[y] (skipped outside [0, n_expert)) */
    const int32_t *sel;
    int n_expert;
    unsigned *sink;
} pf_args;

static __device__ __forceinline__ void pf_bulk(const uint8_t *p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

static __device__ __forceinline__ unsigned pf_load(const uint8_t *p) {
    uint4 v;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v.x ^ v.y ^ v.z ^ v.w;
}

/* Range [p, p + bytes) by thread t of nt. */
static __device__ void pf_range(const uint8_t *p, uint64_t bytes, int mode, uint64_t t, uint64_t nt, unsigned &acc) {
    if (mode == 1) {
        for (uint64_t off = t * PF_PIECE; off < bytes; off += nt * PF_PIECE) {
            const uint64_t left = bytes - off;
            pf_bulk(p + off, (uint32_t)(left < PF_PIECE ? left : PF_PIECE));
        }
        return;
    }
    const uint64_t units = bytes / 16;
    for (uint64_t u = t; u < units; u += PF_LOAD_DEPTH * nt) {
        unsigned v[PF_LOAD_DEPTH];
#pragma unroll
        for (int k = 0; k < PF_LOAD_DEPTH; k++) {
            const uint64_t uk = u + (uint64_t)k * nt;
            v[k] = uk < units ? pf_load(p + 16 * uk) : 0u;
        }
#pragma unroll
        for (int k = 0; k < PF_LOAD_DEPTH; k++) acc ^= v[k];
    }
}

__global__ void prefetch_kernel(pf_args a) {
    unsigned acc = 0;
    const uint64_t nt = (uint64_t)gridDim.x * blockDim.x, t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (a.sel) {
        cuda_grid_wait(); /* sel comes from the kernel before */
        const int32_t e = a.sel[blockIdx.y];
        if (e >= 0 && e < a.n_expert) pf_range(a.p[0] + (uint64_t)e * a.bytes[0], a.bytes[0], a.mode, t, nt, acc);
    } else {
        for (int i = 0; i < a.n; i++) pf_range(a.p[i], a.bytes[i], a.mode, t, nt, acc);
    }
    /* the loads' values must be used: a word nobody reads, written about
     * never (a bit pattern the xor of the data rarely takes) */
    if (a.mode == 2 && acc == 0x5eedf00du) *a.sink = acc;
}

static dim3 pf_grid(cuda_backend *cb, int mode, unsigned rows) {
    if (mode == 1) return dim3(rows > 1 ? PF_EXPERT_BLOCKS : PF_BULK_BLOCKS, rows);
    const unsigned sms = (unsigned)cuda_sm_count(cb);
    return dim3(rows > 1 ? (sms + rows - 1) / rows : sms, rows);
}

/* [p, p + bytes) narrowed to whole 16-byte pieces inside it; false when none. */
static bool pf_inner(const void *p, uint64_t bytes, const uint8_t **q, uint64_t *qb) {
    const uintptr_t a = ((uintptr_t)p + 15) & ~(uintptr_t)15, end = ((uintptr_t)p + bytes) & ~(uintptr_t)15;
    if (end <= a) return false;
    *q = (const uint8_t *)a;
    *qb = (uint64_t)(end - a);
    return true;
}

static uint64_t weight_total_bytes(const ds4_weight *w) { return (uint64_t)w->row_bytes * (uint64_t)cuda_weight_rows(w); }

void cuda_prefetch(ds4_backend *be, const ds4_weight *const *w, int n) {
    cuda_backend *cb = cuda_impl(be);
    if (n < 0 || (n > 0 && !w)) {
        cuda_fail(be, DS4_ERR_INVALID, "prefetch: %d weights%s", n, n > 0 ? " from a NULL list" : "");
        return;
    }
    for (int i = 0; i < n; i++) {
        if (!w[i] || !w[i]->device) {
            cuda_fail(be, DS4_ERR_INVALID, "prefetch: weight %d (%s) is %s", i, w[i] ? cuda_wname(w[i]) : "NULL",
                      w[i] ? "not bound" : "NULL");
            return;
        }
    }
    if (!cb->recording || cb->pf_mode == 0 || !cb->pf_ops || cuda_failed(be)) return;
    /* whole 16-byte pieces: every weight's part is one, and i advances
     * each round, so the loops end */
    uint64_t budget = cb->pf_max_bytes > 0 ? (uint64_t)cb->pf_max_bytes & ~(uint64_t)15 : 0;
    int i = 0;
    while (i < n && budget > 0) { /* PF_MAX weights a launch */
        pf_args a;
        memset(&a, 0, sizeof a);
        a.mode = cb->pf_mode;
        a.sink = cb->pf_sink;
        uint64_t asked = 0;
        for (; i < n && a.n < PF_MAX && budget > 0; i++) {
            const uint8_t *q;
            uint64_t qb;
            if (!pf_inner(w[i]->device, weight_total_bytes(w[i]), &q, &qb)) continue;
            if (qb > budget) qb = budget;
            a.p[a.n] = q;
            a.bytes[a.n++] = qb;
            budget -= qb;
            asked += qb;
        }
        if (a.n == 0) break;
        if (!cuda_launch_leaf(be, "prefetch_kernel", prefetch_kernel, pf_grid(cb, a.mode, 1),
                              a.mode == 1 ? 32 : PF_LOAD_THREADS, 0, a))
            return;
        cb->pf_nodes++;
        cb->pf_bytes += asked;
    }
}

void cuda_prefetch_experts(ds4_backend *be, const ds4_weight *w, const int32_t *sel, int64_t slots) {
    cuda_backend *cb = cuda_impl(be);
    if (!cb->recording || cb->pf_mode == 0 || !cb->pf_experts || cuda_failed(be) || !sel || slots < 1 ||
        slots > 65535)
        return;
    const int64_t n_expert = w->ne[2];
    if (n_expert < 1 || n_expert > INT32_MAX) return;
    const uint64_t expert = weight_total_bytes(w) / (uint64_t)n_expert;
    /* each expert's matrix must start 16-byte aligned and end on a piece */
    if ((uintptr_t)w->device % 16 || expert % 16 || expert == 0 || expert * (uint64_t)slots > (uint64_t)cb->pf_max_bytes)
        return;
    pf_args a;
    memset(&a, 0, sizeof a);
    a.mode = cb->pf_mode;
    a.sink = cb->pf_sink;
    a.p[0] = (const uint8_t *)w->device;
    a.bytes[0] = expert;
    a.n = 1;
    a.sel = sel;
    a.n_expert = (int)n_expert;
    if (!cuda_launch_leaf(be, "prefetch_kernel", prefetch_kernel, pf_grid(cb, a.mode, (unsigned)slots),
                          a.mode == 1 ? 32 : PF_LOAD_THREADS, 0, a))
        return;
    cb->pf_nodes++;
    cb->pf_bytes += expert * (uint64_t)slots;
}

static int64_t pf_default_bytes(cuda_backend *cb) {
    int l2 = 0;
    if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, cb->device) != cudaSuccess || l2 <= 0) {
        (void)cudaGetLastError();
        l2 = 0;
    }
    const long mib = cuda_env_long("DS4_CUDA_PREFETCH_MIB", 0, 1, 1 << 20);
    return mib > 0 ? (int64_t)mib << 20 : (int64_t)l2 / 4 * 3;
}

ds4_status cuda_prefetch_init(cuda_backend *cb, ds4_error *err) {
    cb->pf_mode = (int)cuda_env_long("DS4_CUDA_PREFETCH", 0, 0, 2);
    cb->pf_max_bytes = pf_default_bytes(cb);
    cb->pf_ops = cuda_env_flag("DS4_CUDA_PREFETCH_OPS", true);
    cb->pf_experts = cuda_env_flag("DS4_CUDA_PREFETCH_EXPERTS", true);
    DS4_CUDA_CHECK(cudaMalloc((void **)&cb->pf_sink, 256), err);
    return DS4_OK;
}

void cuda_prefetch_free(cuda_backend *cb) {
    if (cb->pf_sink) cudaFree(cb->pf_sink);
    cb->pf_sink = NULL;
}

extern "C" void ds4_cuda_backend_set_prefetch(ds4_backend *be, int mode, int64_t max_bytes) {
    cuda_backend *cb = cuda_impl(be);
    cb->pf_mode = mode == 1 || mode == 2 ? mode : 0;
    cb->pf_max_bytes = max_bytes > 0 ? max_bytes : pf_default_bytes(cb);
}

extern "C" void ds4_cuda_backend_set_prefetch_parts(ds4_backend *be, int ops, int experts) {
    cuda_backend *cb = cuda_impl(be);
    cb->pf_ops = ops != 0;
    cb->pf_experts = experts != 0;
}

extern "C" void ds4_cuda_backend_prefetch_stats(const ds4_backend *be, uint64_t *launches, uint64_t *bytes) {
    const cuda_backend *cb = (const cuda_backend *)be->impl;
    if (launches) *launches = cb->pf_nodes;
    if (bytes) *bytes = cb->pf_bytes;
}

/*
 * persist_probe.cu - measures the two premises of docs/persistent-decode.md
 * on the GPU it runs on, with no model: what a grid-wide barrier costs at
 * full residency, and how close to the copy bandwidth a chain of weight
 * reads of decode-like sizes gets when it is
 *
 *   launch     one kernel per phase, captured in a CUDA graph (plain launches);
 *   pdl        the same kernels as programmatic launches (each waits with
 *              griddepcontrol.wait, as the engine's kernels do);
 *   pdl-pf     pdl, each block first asking the L2 for its slice (bulk
 *              prefetch) before it waits: the engine's products' early stages;
 *   pdl-side   pdl, with one small kernel running beside the whole chain (a
 *              second branch of the graph) that keeps the L2 asked for up to
 *              --ahead-mib past the phases done (each phase kernel's blocks
 *              count themselves done; the side kernel waits on that count):
 *              the prefetch without a persistent kernel or a node a product;
 *   persist    one cooperative kernel, phases separated by a counter barrier;
 *   persist-cg the same with cooperative_groups' grid.sync();
 *   persist-pf persist, each block asking the L2 for its slice of the next
 *              phase before the barrier (while the stragglers finish and
 *              while a latency phase runs).
 *
 * A phase reads S bytes (each block its contiguous slice, 16-byte loads
 * issued in groups of UNROLL a thread) out of a pool far larger than the L2, so every phase
 * reads from memory. A latency phase of L ns (one thread spinning, the
 * rest of the GPU idle: a norm, a router) may sit between weight phases.
 *
 * Checked in every run, timed or not: the words each variant read (their
 * count, and their XOR against a plain grid-stride reduction's), that
 * across each barrier every block sees the stamps other blocks wrote
 * before it, and that the pdl variants' graphs kept their programmatic
 * edges; a table cell whose checks failed is marked !. Exit status 1 when a check fails, 77 without a
 * CUDA device.
 *
 *     nvcc -O3 -arch=sm_90 -o persist_probe scripts/persist_probe.cu
 *     ./persist_probe [--pool-mib 1024] [--sizes-kib 1024,4096,16384,35840]
 *                     [--lat-ns 0,4000] [--bps 2] [--reps 5] [--barriers 20000] [--ahead-mib 24]
 *
 * Prints Markdown: the barrier table (us a barrier at 1, 2 and 4 blocks an
 * SM) and the phase table (us a phase, GB/s, and the fraction of one
 * whole-pool read's rate, for each size, latency and variant).
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace cg = cooperative_groups;

#define THREADS 256
#define UNROLL 8

#define CK(x)                                                                                                 \
    do {                                                                                                      \
        cudaError_t e_ = (x);                                                                                 \
        if (e_ != cudaSuccess) {                                                                              \
            fprintf(stderr, "persist_probe: %s failed at line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                                                          \
        }                                                                                                     \
    } while (0)

enum variant { V_LAUNCH, V_PDL, V_PDL_PF, V_PDL_SIDE, V_PERSIST, V_PERSIST_CG, V_PERSIST_PF, V_COUNT };
static const char *const variant_name[V_COUNT] = { "launch",  "pdl",        "pdl-pf",    "pdl-side",
                                                   "persist", "persist-cg", "persist-pf" };
static bool is_graph(int v) { return v == V_LAUNCH || v == V_PDL || v == V_PDL_PF || v == V_PDL_SIDE; }

struct probe_args {
    const uint4 *pool;  /* phases back to back, 16-byte words */
    size_t phase_words; /* words of one phase */
    int phases;
    int first;          /* the launch variants: this kernel's phase */
    long long lat_ns;   /* a latency phase after each weight phase (0: none) */
    int prefetch;       /* 1: each block's slice into the L2 first (see the variants) */
    unsigned *counter;  /* the counter barrier; pdl-side: the phase kernels' blocks done (zeroed before a run) */
    size_t ahead_words; /* pdl-side: how far past the phases done the L2 is asked for */
    int *stamp;         /* [2][blocks]: the phase a block last finished, by the phase's parity */
    unsigned *errors;   /* stamps seen out of step */
    unsigned *xor_out;  /* XOR of every word read */
    unsigned long long *words; /* words read */
    long long lat_cycles; /* lat_ns in SM clock cycles */
};

static __device__ __forceinline__ size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* Block b's slice [lo, hi) of a phase of n words. */
static __device__ __forceinline__ void slice_of(size_t n, size_t &lo, size_t &hi) {
    const size_t per = (n + gridDim.x - 1) / gridDim.x;
    lo = min_sz(n, per * blockIdx.x);
    hi = min_sz(n, lo + per);
}

static __device__ __forceinline__ void l2_prefetch(const uint4 *p, size_t lo, size_t hi) {
    /* one thread a block; pieces of at most 64 KiB (whole 16-byte words) */
    if (threadIdx.x != 0) return;
    for (size_t w = lo; w < hi; w += 4096) {
        const unsigned bytes = (unsigned)(min_sz(hi - w, 4096) * 16);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + w), "r"(bytes) : "memory");
    }
}

static __device__ __forceinline__ unsigned read_slice(const uint4 *__restrict__ p, size_t lo, size_t hi,
                                                     unsigned long long *words) {
    if (threadIdx.x == 0 && hi > lo) atomicAdd(words, (unsigned long long)(hi - lo));
    unsigned x = 0;
    size_t i = lo + threadIdx.x;
    for (; i + (UNROLL - 1) * THREADS < hi; i += UNROLL * THREADS) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) v[u] = __ldg(p + i + u * THREADS);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < hi; i += THREADS) {
        const uint4 v = __ldg(p + i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    return x;
}

/* (SM clock cycles: the global timer may tick only every microsecond) */
static __device__ __forceinline__ void spin_cycles(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

/* All blocks of the grid meet: the k-th barrier of a launch (from 0) waits
 * for the counter to reach (k + 1) blocks. Writes before it are seen by
 * every block after it (release by the fence and the atomic, acquire by
 * the load). */
static __device__ __forceinline__ void counter_barrier(unsigned *counter, unsigned k) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned target = (k + 1) * gridDim.x;
        __threadfence();
        atomicAdd(counter, 1u);
        unsigned v;
        do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
        while (v < target);
    }
    __syncthreads();
}

/* Phase p's stamps (one row a parity: a block already past the barrier
 * writes the next phase's into the other row, and can come back to this
 * one only through a barrier this block has not reached yet). */
static __device__ __forceinline__ int *stamps_of(const probe_args &a, int p) {
    return a.stamp + (size_t)(p & 1) * gridDim.x;
}
static __device__ __forceinline__ void stamp(const probe_args &a, int p) {
    if (threadIdx.x == 0) stamps_of(a, p)[blockIdx.x] = p;
}
/* After a barrier past phase p: two other blocks must have stamped p. */
static __device__ __forceinline__ void check_stamps(const probe_args &a, int p) {
    if (threadIdx.x != 0) return;
    const int nb = (int)gridDim.x;
    const int *s = stamps_of(a, p);
    if (s[(blockIdx.x + 1) % nb] != p || s[(blockIdx.x + nb / 2) % nb] != p) atomicAdd(a.errors, 1u);
}

static __device__ __forceinline__ void finish_xor(const probe_args &a, unsigned x) {
    for (int o = 16; o; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
    if ((threadIdx.x & 31) == 0) atomicXor(a.xor_out, x);
}

/* persist / persist-pf (cg false) and persist-cg (cg true) */
template <bool CG> __global__ void __launch_bounds__(THREADS) persist_kernel(probe_args a) {
    unsigned x = 0, k = 0;
    size_t lo, hi;
    slice_of(a.phase_words, lo, hi);
    for (int p = 0; p < a.phases; p++) {
        const uint4 *ph = a.pool + (size_t)p * a.phase_words;
        x ^= read_slice(ph, lo, hi, a.words);
        stamp(a, p);
        /* the next phase's slice asked for while the grid waits on its last blocks */
        if (a.prefetch && p + 1 < a.phases) l2_prefetch(ph + a.phase_words, lo, hi);
        if (a.lat_ns > 0) {
            if (CG) cg::this_grid().sync(); else counter_barrier(a.counter, k++);
            check_stamps(a, p);
            if (blockIdx.x == 0 && threadIdx.x == 0) spin_cycles(a.lat_cycles);
        }
        if (CG) cg::this_grid().sync(); else counter_barrier(a.counter, k++);
        check_stamps(a, p);
    }
    finish_xor(a, x);
}

/* launch / pdl / pdl-pf: phase a.first (and its latency phase, spin_kernel) */
__global__ void __launch_bounds__(THREADS) phase_kernel(probe_args a) {
    size_t lo, hi;
    slice_of(a.phase_words, lo, hi);
    const uint4 *ph = a.pool + (size_t)a.first * a.phase_words;
    if (a.prefetch) l2_prefetch(ph, lo, hi);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    if (a.first > 0) check_stamps(a, a.first - 1); /* the kernel before finished in every block */
    const unsigned x = read_slice(ph, lo, hi, a.words);
    stamp(a, a.first);
    finish_xor(a, x);
    if (a.ahead_words) { /* pdl-side: this block's slice read */
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(a.counter, 1u);
    }
}

/* pdl-side: beside the chain, the pool asked for in pieces of 32 KiB (a
 * thread a piece, 128 threads) while the pieces stay within ahead_words of
 * the words the phase kernels have read (their blocks' count). It only
 * waits on the chain, never the other way round. */
#define SIDE_THREADS 128
#define SIDE_PIECE 2048 /* words */
__global__ void __launch_bounds__(SIDE_THREADS) side_kernel(probe_args a, int blocks) {
    const size_t total = a.phase_words * a.phases;
    __shared__ size_t s_limit;
    size_t next = 0; /* the first word not yet asked for */
    while (next < total) {
        if (threadIdx.x == 0) {
            unsigned done;
            asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(done) : "l"(a.counter) : "memory");
            /* (blocks of a later phase count only once the earlier phase is done: they wait for it) */
            const size_t limit = (size_t)done * a.phase_words / (size_t)blocks + a.ahead_words;
            s_limit = limit < total ? limit : total;
        }
        __syncthreads();
        const size_t limit = s_limit;
        __syncthreads();
        if (limit <= next) {
            __nanosleep(500);
            continue;
        }
        for (size_t w = next + (size_t)threadIdx.x * SIDE_PIECE; w < limit; w += (size_t)SIDE_THREADS * SIDE_PIECE) {
            const unsigned bytes = (unsigned)(min_sz(limit - w, SIDE_PIECE) * 16);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a.pool + w), "r"(bytes) : "memory");
        }
        next = limit;
    }
}

__global__ void spin_kernel(long long cycles) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    spin_cycles(cycles);
}

/* the reference: a plain grid-stride XOR of n words */
__global__ void xor_kernel(const uint4 *p, size_t n, unsigned *out) {
    unsigned x = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    for (int o = 16; o; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
    if ((threadIdx.x & 31) == 0) atomicXor(out, x);
}

__global__ void fill_kernel(uint4 *p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed ^ (unsigned)(i >> 32) * 40503u;
        uint4 v;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; v.x = h;
        h *= 3266489917u; h ^= h >> 16; v.y = h;
        h *= 668265263u; h ^= h >> 15; v.z = h;
        h *= 374761393u; h ^= h >> 13; v.w = h;
        p[i] = v;
    }
}

/* barrier-only: n counter barriers (cg false) or grid.sync()s */
template <bool CG> __global__ void __launch_bounds__(THREADS) barrier_kernel(unsigned *counter, int n) {
    for (int k = 0; k < n; k++) {
        if (CG) cg::this_grid().sync(); else counter_barrier(counter, (unsigned)k);
    }
}

struct probe {
    int sms, bps;
    unsigned *counter, *errors, *xor_out;
    int *stamp;
    cudaStream_t st, side;
    cudaEvent_t fork, join;
    long long hold_cycles, cycles_per_us;
    unsigned long long *words;
};

static void launch_coop(const void *fn, int blocks, probe_args *a, cudaStream_t st) {
    void *params[] = { a };
    CK(cudaLaunchCooperativeKernel(fn, dim3(blocks), dim3(THREADS), params, 0, st));
}

static void launch_pdl(const void *fn, int blocks, int threads, void **params, bool pdl, cudaStream_t st) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelExC(&cfg, fn, params));
}

/* One run of variant v over `phases` phases (enqueued on pr.st; the launch
 * variants as a graph, made once by the caller through graph_of). */
static void enqueue(const probe &pr, variant v, probe_args a, int blocks) {
    a.prefetch = v == V_PDL_PF || v == V_PERSIST_PF;
    if (v != V_PDL_SIDE) a.ahead_words = 0;
    if (v == V_PERSIST || v == V_PERSIST_PF) launch_coop((const void *)persist_kernel<false>, blocks, &a, pr.st);
    else if (v == V_PERSIST_CG) launch_coop((const void *)persist_kernel<true>, blocks, &a, pr.st);
    else {
        const bool pdl = v != V_LAUNCH;
        if (v == V_PDL_SIDE) { /* the side branch forks off the stream (inside the graph's capture) */
            CK(cudaEventRecord(pr.fork, pr.st));
            CK(cudaStreamWaitEvent(pr.side, pr.fork, 0));
            void *params[] = { &a, (void *)&blocks };
            launch_pdl((const void *)side_kernel, 1, SIDE_THREADS, params, false, pr.side);
            CK(cudaEventRecord(pr.join, pr.side));
        }
        for (int p = 0; p < a.phases; p++) {
            probe_args b = a;
            b.first = p;
            void *params[] = { &b };
            launch_pdl((const void *)phase_kernel, blocks, THREADS, params, pdl && p > 0, pr.st);
            if (a.lat_ns > 0) {
                long long cycles = a.lat_cycles;
                void *sp[] = { &cycles };
                launch_pdl((const void *)spin_kernel, 1, 32, sp, pdl, pr.st);
            }
        }
        if (v == V_PDL_SIDE) CK(cudaStreamWaitEvent(pr.st, pr.join, 0));
    }
}

/* The variant's graph; *programmatic: its programmatic edges (the pdl
 * variants want phases - 1 of them: a capture that made them plain edges
 * would time pdl as launch). */
static cudaGraphExec_t graph_of(const probe &pr, variant v, const probe_args &a, int blocks, size_t *programmatic) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(pr.st, cudaStreamCaptureModeGlobal));
    enqueue(pr, v, a, blocks);
    CK(cudaStreamEndCapture(pr.st, &g));
    size_t n = 0;
    CK(cudaGraphGetEdges(g, NULL, NULL, NULL, &n));
    std::vector<cudaGraphNode_t> from(n), to(n);
    std::vector<cudaGraphEdgeData> data(n);
    if (n) CK(cudaGraphGetEdges(g, from.data(), to.data(), data.data(), &n));
    *programmatic = 0;
    for (size_t i = 0; i < n; i++) *programmatic += data[i].type == cudaGraphDependencyTypeProgrammatic;
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphDestroy(g));
    return ge;
}

/* about 2 ms of one thread's spinning ahead of a timed run, so the host's
 * submission (a graph of thousands of nodes, a cooperative launch) is
 * done before the first event's time is taken */
__global__ void hold_kernel(long long cycles) { spin_cycles(cycles); }

static void reset(const probe &pr, int blocks) {
    CK(cudaMemsetAsync(pr.counter, 0, sizeof(unsigned), pr.st));
    CK(cudaMemsetAsync(pr.stamp, 0xff, (size_t)2 * blocks * sizeof(int), pr.st));
}

/* median ms of `reps` timed runs (one untimed first); *ok false when a
 * run's checks failed (the words read, their XOR, the barriers' stamps) or
 * a pdl variant's graph lost its programmatic edges */
static double time_variant(const probe &pr, variant v, const probe_args &a, int blocks, int reps, bool *ok,
                           unsigned want_xor) {
    const bool graph = is_graph(v);
    size_t programmatic = 0;
    cudaGraphExec_t ge = graph ? graph_of(pr, v, a, blocks, &programmatic) : NULL;
    const size_t want_programmatic = v == V_PDL || v == V_PDL_PF || v == V_PDL_SIDE
                                         ? (size_t)(a.phases - 1) * (a.lat_ns > 0 ? 2 : 1) + (a.lat_ns > 0 ? 1 : 0)
                                         : 0;
    if (graph && programmatic != want_programmatic) {
        fprintf(stderr, "persist_probe: %s: %zu programmatic edges in the graph, want %zu\n", variant_name[v],
                programmatic, want_programmatic);
        *ok = false;
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<double> ms;
    for (int r = 0; r <= reps; r++) {
        reset(pr, blocks);
        CK(cudaMemsetAsync(pr.errors, 0, sizeof(unsigned), pr.st));
        CK(cudaMemsetAsync(pr.xor_out, 0, sizeof(unsigned), pr.st));
        CK(cudaMemsetAsync(a.words, 0, sizeof(unsigned long long), pr.st));
        hold_kernel<<<1, 32, 0, pr.st>>>(pr.hold_cycles);
        CK(cudaEventRecord(e0, pr.st));
        if (graph) CK(cudaGraphLaunch(ge, pr.st));
        else enqueue(pr, v, a, blocks);
        CK(cudaEventRecord(e1, pr.st));
        CK(cudaStreamSynchronize(pr.st));
        unsigned errors, x;
        unsigned long long words;
        CK(cudaMemcpy(&errors, pr.errors, sizeof errors, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(&x, pr.xor_out, sizeof x, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(&words, a.words, sizeof words, cudaMemcpyDeviceToHost));
        const unsigned long long want_words = (unsigned long long)a.phase_words * a.phases;
        if (errors || x != want_xor || words != want_words) {
            fprintf(stderr, "persist_probe: %s: %u barrier errors, XOR %08x (want %08x), %llu words read (want %llu)\n",
                    variant_name[v], errors, x, want_xor, words, want_words);
            *ok = false;
        }
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        if (r) ms.push_back(t);
    }
    if (ge) CK(cudaGraphExecDestroy(ge));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

static std::vector<long long> parse_list(const char *s, const char *what) {
    std::vector<long long> v;
    const char *p = s;
    while (*p) {
        char *end;
        const long long x = strtoll(p, &end, 10);
        if (end == p || x < 0 || (*end && *end != ',') || (*end == ',' && !end[1])) { /* (a trailing comma too) */
            fprintf(stderr, "persist_probe: bad %s list '%s'\n", what, s);
            exit(2);
        }
        v.push_back(x);
        p = *end ? end + 1 : end;
    }
    if (v.empty()) {
        fprintf(stderr, "persist_probe: empty %s list\n", what);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv) {
    long long pool_mib = 1024;
    int bps = 2, reps = 5, barriers = 20000;
    long long ahead_mib = 24;
    std::vector<long long> sizes = { 1024, 4096, 16384, 35840 }, lats = { 0, 4000 };
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "persist_probe: %s needs a value (see the file's head)\n", o);
            return 2;
        }
        if (!strcmp(o, "--pool-mib")) pool_mib = atoll(v);
        else if (!strcmp(o, "--sizes-kib")) sizes = parse_list(v, "--sizes-kib");
        else if (!strcmp(o, "--lat-ns")) lats = parse_list(v, "--lat-ns");
        else if (!strcmp(o, "--bps")) bps = atoi(v);
        else if (!strcmp(o, "--reps")) reps = atoi(v);
        else if (!strcmp(o, "--barriers")) barriers = atoi(v);
        else if (!strcmp(o, "--ahead-mib")) ahead_mib = atoll(v);
        else {
            fprintf(stderr, "persist_probe: unknown option %s\n", o);
            return 2;
        }
        i++;
    }
    if (pool_mib < 64 || bps < 1 || bps > 8 || reps < 1 || barriers < 1 || ahead_mib < 1) {
        fprintf(stderr, "persist_probe: --pool-mib >= 64, --bps 1..8, --reps, --barriers and --ahead-mib >= 1\n");
        return 2;
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "persist_probe: no CUDA device\n");
        return 77;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    probe pr;
    pr.sms = prop.multiProcessorCount;
    pr.bps = bps;
    CK(cudaStreamCreateWithFlags(&pr.st, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&pr.side, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&pr.fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&pr.join, cudaEventDisableTiming));
    int khz = 0;
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    pr.cycles_per_us = khz / 1000 > 0 ? khz / 1000 : 1000;
    pr.hold_cycles = 2000 * pr.cycles_per_us;
    CK(cudaMalloc(&pr.counter, sizeof(unsigned)));
    CK(cudaMalloc(&pr.errors, sizeof(unsigned)));
    CK(cudaMalloc(&pr.xor_out, sizeof(unsigned)));
    CK(cudaMalloc(&pr.words, sizeof(unsigned long long)));
    CK(cudaMalloc(&pr.stamp, (size_t)2 * 8 * pr.sms * sizeof(int)));
    if ((long long)pool_mib < 8 * (long long)(prop.l2CacheSize >> 20)) {
        fprintf(stderr, "persist_probe: --pool-mib %lld: at least 8 times the L2 (%d MiB), so no phase is read from it\n",
                pool_mib, prop.l2CacheSize >> 20);
        return 2;
    }
    const size_t pool_words = (size_t)pool_mib * 65536;
    uint4 *pool;
    CK(cudaMalloc(&pool, pool_words * 16));
    fill_kernel<<<4 * pr.sms, 256, 0, pr.st>>>(pool, pool_words, 0x5eedu);
    CK(cudaGetLastError());
    printf("# persist_probe on %s: %d SMs, L2 %d MiB, SM clock %lld MHz, %d threads a block\n\n", prop.name, pr.sms,
           prop.l2CacheSize >> 20, pr.cycles_per_us, THREADS);

    /* the blocks of the phase kernels: bps an SM, which every variant's kernel must allow */
    int fit = 8;
    for (const void *fn : { (const void *)persist_kernel<true>, (const void *)persist_kernel<false>,
                            (const void *)phase_kernel }) {
        int f = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&f, fn, THREADS, 0));
        fit = std::min(fit, f);
    }
    if (fit < bps) {
        fprintf(stderr, "persist_probe: %d blocks an SM do not fit (%d)\n", bps, fit);
        return 1;
    }
    const int blocks = bps * pr.sms;

    bool ok = true;
    /* the pool read whole: by the plain grid-stride kernel (8 blocks an SM,
     * a load in flight a thread), and as one phase of the phase kernel (the
     * probe's blocks, its loads); the better rate is the one the phases are
     * compared with */
    probe_args whole = {};
    whole.pool = pool;
    whole.phase_words = pool_words;
    whole.phases = 1;
    whole.counter = pr.counter;
    whole.stamp = pr.stamp;
    whole.errors = pr.errors;
    whole.xor_out = pr.xor_out;
    whole.words = pr.words;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<double> plain;
    unsigned pool_xor = 0;
    for (int r = 0; r <= reps; r++) {
        CK(cudaMemsetAsync(pr.xor_out, 0, sizeof(unsigned), pr.st));
        hold_kernel<<<1, 32, 0, pr.st>>>(pr.hold_cycles);
        CK(cudaEventRecord(e0, pr.st));
        xor_kernel<<<pr.sms * 8, 256, 0, pr.st>>>(pool, pool_words, pr.xor_out);
        CK(cudaEventRecord(e1, pr.st));
        CK(cudaMemcpyAsync(&pool_xor, pr.xor_out, sizeof pool_xor, cudaMemcpyDeviceToHost, pr.st));
        CK(cudaStreamSynchronize(pr.st));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        if (r) plain.push_back(t);
    }
    std::sort(plain.begin(), plain.end());
    const double gbs_plain = (double)pool_words * 16 / (plain[plain.size() / 2] * 1e-3) / 1e9;
    const double gbs_phase =
        (double)pool_words * 16 / (time_variant(pr, V_LAUNCH, whole, blocks, reps, &ok, pool_xor) * 1e-3) / 1e9;
    const double peak = std::max(gbs_plain, gbs_phase);
    printf("whole-pool read (%lld MiB): %.0f GB/s by a plain grid-stride kernel, %.0f GB/s as one phase of %d "
           "blocks\n\n", pool_mib, gbs_plain, gbs_phase, blocks);

    /* barriers alone */
    printf("| blocks an SM | blocks | counter barrier us | grid.sync us |\n|---:|---:|---:|---:|\n");
    for (int b : { 1, 2, 4 }) {
        int fit = 0, fit_cg = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, barrier_kernel<false>, THREADS, 0));
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit_cg, barrier_kernel<true>, THREADS, 0));
        if (b > fit || b > fit_cg) continue;
        const int blocks = b * pr.sms;
        double us[2];
        for (int c = 0; c < 2; c++) {
            std::vector<double> ms;
            for (int r = 0; r <= reps; r++) {
                CK(cudaMemsetAsync(pr.counter, 0, sizeof(unsigned), pr.st));
                unsigned *ctr = pr.counter;
                int n = barriers;
                void *params[] = { &ctr, &n };
                hold_kernel<<<1, 32, 0, pr.st>>>(pr.hold_cycles);
                CK(cudaEventRecord(e0, pr.st));
                CK(cudaLaunchCooperativeKernel(c ? (const void *)barrier_kernel<true> : (const void *)barrier_kernel<false>,
                                               dim3(blocks), dim3(THREADS), params, 0, pr.st));
                CK(cudaEventRecord(e1, pr.st));
                CK(cudaStreamSynchronize(pr.st));
                float t;
                CK(cudaEventElapsedTime(&t, e0, e1));
                if (r) ms.push_back(t);
            }
            std::sort(ms.begin(), ms.end());
            us[c] = ms[ms.size() / 2] * 1e3 / barriers;
        }
        printf("| %d | %d | %.2f | %.2f |\n", b, blocks, us[0], us[1]);
    }
    printf("\n");

    /* the phases */
    printf("phases: %d blocks (%d an SM) of %d threads, loads of 16 bytes in groups of %d a thread; "
           "us a weight phase (its latency phase included), GB/s of weights, fraction of the whole-pool rate "
           "(! a failed check, see stderr)\n\n",
           blocks, bps, THREADS, UNROLL);
    printf("| phase KiB | latency ns | phases |");
    for (int v = 0; v < V_COUNT; v++) printf(" %s |", variant_name[v]);
    printf("\n|---:|---:|---:|");
    for (int v = 0; v < V_COUNT; v++) printf("---:|");
    printf("\n");
    for (long long kib : sizes) {
        if (kib < 64 || kib * 1024 > (long long)pool_words * 16 / 2) {
            fprintf(stderr, "persist_probe: phase of %lld KiB skipped (64 KiB .. half the pool)\n", kib);
            continue;
        }
        probe_args a = {};
        a.pool = pool;
        a.phase_words = (size_t)kib * 64;
        a.phases = (int)(pool_words / a.phase_words);
        a.counter = pr.counter;
        a.stamp = pr.stamp;
        a.errors = pr.errors;
        a.xor_out = pr.xor_out;
        a.words = pr.words;
        a.ahead_words = (size_t)ahead_mib * 65536;
        /* the reference XOR of the phases' words */
        CK(cudaMemsetAsync(pr.xor_out, 0, sizeof(unsigned), pr.st));
        xor_kernel<<<pr.sms * 8, 256, 0, pr.st>>>(pool, a.phase_words * a.phases, pr.xor_out);
        unsigned want;
        CK(cudaMemcpyAsync(&want, pr.xor_out, sizeof want, cudaMemcpyDeviceToHost, pr.st));
        CK(cudaStreamSynchronize(pr.st));
        for (long long lat : lats) {
            a.lat_ns = lat;
            a.lat_cycles = lat * pr.cycles_per_us / 1000;
            printf("| %lld | %lld | %d |", kib, lat, a.phases);
            for (int v = 0; v < V_COUNT; v++) {
                bool good = true;
                const double ms = time_variant(pr, (variant)v, a, blocks, reps, &good, want);
                const double us = ms * 1e3 / a.phases, gbs = (double)a.phase_words * 16 * a.phases / (ms * 1e-3) / 1e9;
                printf(" %.2f us, %.0f GB/s (%.2f)%s |", us, gbs, gbs / peak, good ? "" : " !");
                ok = ok && good;
            }
            printf("\n");
            fflush(stdout);
        }
    }
    printf("\nchecks: %s\n", ok ? "every variant read every word once; every barrier and programmatic edge held"
                                 : "FAILED (see stderr)");
    return ok ? 0 : 1;
}

/*
 * cuda_launch.cu - every launch of the CUDA backend, and recorded steps.
 *
 * Ops launch kernels, device copies and memsets through cuda_launch /
 * cuda_copy_d2d / cuda_memset_d. Outside a recorded step these go straight
 * onto the backend's stream. Between step_begin and step_end (a decoded
 * token) they are appended to the step's log instead, with their argument
 * bytes, and step_end runs the log as one CUDA graph (or in segments, below):
 *
 *   - the log's shape (the sequence of kinds and kernels) names a cached
 *     executable graph; when one exists, only the nodes whose parameters
 *     differ from what the graph holds are set anew (a position, a row
 *     count, a grid that grew) and the graph is launched;
 *   - otherwise a graph is built from the log (a chain: each node after the
 *     previous one, exactly the stream's order), instantiated and cached;
 *     the least recently used one makes room.
 *
 * Host control data of a recorded step (token ids, positions, hash-routed
 * experts) goes into the step arena, a pinned buffer with a device twin; the
 * graph's first node copies the part in use to the device. The same shape
 * puts the same data at the same offsets, so the kernels' pointers into it
 * repeat from step to step and do not need updating.
 *
 * Segments: the model marks points of a step (step_mark, after each layer)
 * where it may be submitted in parts. At marks 1, 3, 7, 15, 31, ... what was
 * recorded since the last cut is launched as a graph of its own, and
 * recording goes on into the next segment, so the device starts on the
 * first layer while the host records the rest (recording a layer takes
 * far less time than running it). Each segment is a graph of its own shape
 * (its index is part of the shape) with its own piece of the arena; the
 * segments run in stream order, as the unsegmented step would.
 * DS4_CUDA_SEGMENTS=0 submits every step as one graph.
 *
 * Anything that must see the stream in program order in the middle of a
 * step (a host wait, an allocation, a library call that launches on its
 * own) calls cuda_step_break first: what was recorded so far is launched
 * directly and the rest of the step runs unrecorded. A step therefore always
 * computes exactly what launching every op directly computes; recording
 * only changes how the host submits it.
 *
 * Recording is on by default; DS4_CUDA_GRAPH=0 turns it off (every launch
 * then goes to the stream as it is made).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_profiler_api.h>

#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/cuda_matvec.h"

#define CUDA_ARENA_BYTES ((size_t)1 << 20) /* a 256-row batched step uploads about 250 KB */


/* ------------------------------------------------------------------------ */
/* The log                                                                   */
/* ------------------------------------------------------------------------ */

static void log_free(cuda_node_log *l) {
    free(l->nodes);
    free(l->pool);
    memset(l, 0, sizeof *l);
}

static void key_mix(cuda_node_log *l, uint64_t v) {
    for (int i = 0; i < 8; i++) l->key = (l->key ^ ((v >> (8 * i)) & 0xff)) * 0x100000001b3ULL;
}

/* An empty log; seg > 0 (a later segment of a step) is part of its shape. */
static void log_clear(cuda_node_log *l, int seg = 0) {
    l->n = 0;
    l->pool_used = 0;
    l->key = 0xcbf29ce484222325ULL;
    if (seg > 0) key_mix(l, 0x5e6d000000000000ULL + (uint64_t)seg);
}

/* The backend's log emptied for a new segment (seg > 0) or step: nothing
 * on its chain yet and no branch pending (one recorded before runs with
 * its segment, which finishes before the next one starts). A branch being
 * recorded goes on from the new segment's start. */
static void step_log_clear(cuda_backend *cb, int seg = 0) {
    log_clear(&cb->log, seg);
    cb->last_main = -1;
    cb->br_fork = -1;
    cb->br_last = -1;
    cb->br_pending = -1;
    cb->br_join_next = false;
    cb->br_slots = 0;
    cb->br_prev = -1;
    cb->br_prev_slots = 0;
    cb->br_wait_prev = false;
}

/* Entry `e`, just pushed, linked to what it waits for: on a branch, the
 * branch's entry before it (its first: the main chain's entry at the
 * begin, and a branch still pending before it); on the main chain, the
 * chain's last entry and, after a join, the pending branch's last. The
 * links are part of the step's shape. */
static void link_entry(cuda_backend *cb, cuda_node *e) {
    const int i = cb->log.n - 1;
    e->join = -1;
    e->side = cb->br_side;
    if (cb->rec_leaf) { /* off the chain: after its last entry, and nothing after it */
        e->side = true;
        e->pred = !cb->br_side ? cb->last_main : cb->br_last >= 0 ? cb->br_last : cb->br_fork;
    } else if (cb->br_side) {
        e->pred = cb->br_last >= 0 ? cb->br_last : cb->br_fork;
        if (cb->br_last < 0 && cb->br_pending >= 0) { /* a second branch after a join was asked for */
            /* (a join the main chain asked for stays asked: it then waits
             * for this branch, which waits for the first) */
            e->join = cb->br_pending;
            cb->br_pending = -1;
        } else if (cb->br_wait_prev && cb->br_prev >= 0) { /* a slot of the branch beside it */
            e->join = cb->br_prev;
            cb->br_prev = -1;
        }
        cb->br_wait_prev = false;
        cb->br_last = i;
    } else {
        e->pred = cb->last_main;
        if (cb->br_pending >= 0 && cb->br_join_next) {
            e->join = cb->br_pending;
            cb->br_pending = -1;
            cb->br_join_next = false;
            cb->br_slots = 0;
        }
        cb->last_main = i;
    }
    key_mix(&cb->log, ((uint64_t)e->side << 63) | ((uint64_t)(uint32_t)(e->pred + 2) << 32) | (uint32_t)(e->join + 2));
}

void cuda_branch_begin(ds4_backend *be) {
    cuda_backend *cb = cuda_impl(be);
    if (!cb->recording || !cb->branches || cb->br_side) return;
    cb->br_side = true;
    cb->br_fork = cb->last_main;
    cb->br_last = -1;
    cb->br_count++;
    if (cb->br_pending >= 0 && !cb->br_join_next && cb->br_prev < 0) {
        /* a branch pending and no join asked for: this one runs beside it */
        cb->br_prev = cb->br_pending;
        cb->br_prev_slots = cb->br_slots;
        cb->br_pending = -1;
        cb->br_slots = 0;
        cb->br_wait_prev = false;
        cb->br_beside++;
    }
}

void cuda_branch_end(ds4_backend *be) {
    cuda_backend *cb = cuda_impl(be);
    if (!cb->br_side) return;
    cb->br_side = false;
    if (cb->recording && cb->br_last >= 0) cb->br_pending = cb->br_last;
    if (cb->recording && cb->br_prev >= 0) {
        /* the branch beside the first: its last entry also waits for the
         * first's (free: an entry that waited for it cleared br_prev), so
         * one join takes both; no entry: the first stays pending alone */
        if (cb->br_last >= 0) {
            cuda_node *e = &cb->log.nodes[cb->br_last];
            e->join = cb->br_prev;
            key_mix(&cb->log, 0xb5e1de0000000000ULL | (uint32_t)(cb->br_prev + 2));
        } else {
            cb->br_pending = cb->br_prev;
        }
        cb->br_prev = -1;
    }
    /* (also when an entry of this branch already waited for the first:
     * the pending branch holds the first's slots as well as its own) */
    cb->br_slots |= cb->br_prev_slots;
    cb->br_prev_slots = 0;
    cb->br_wait_prev = false;
    cb->br_last = -1;
}

void cuda_branch_join(ds4_backend *be) {
    cuda_backend *cb = cuda_impl(be);
    if (cb->recording && cb->br_pending >= 0) cb->br_join_next = true;
}

void cuda_branch_force_join(cuda_backend *cb) {
    if (!cb->recording || cb->br_side || cb->br_pending < 0 || cb->br_join_next) return;
    cb->br_join_next = true;
    cb->br_auto_joins++;
}

void cuda_branch_slot(cuda_backend *cb, int slot) {
    if (!cb->recording) return;
    const uint64_t bit = (uint64_t)1 << slot;
    if (cb->br_side) {
        cb->br_slots |= bit;
        if (cb->br_prev >= 0 && (cb->br_prev_slots & bit)) cb->br_wait_prev = true;
    } else if (cb->br_slots & bit) {
        cuda_branch_force_join(cb);
    }
}

/* A new entry (zeroed), or NULL when memory ran out (error recorded). */
static cuda_node *log_push(ds4_backend *be, cuda_node_log *l, int kind, const void *func, size_t data_len) {
    if (l->n == l->cap) {
        const int cap = l->cap ? 2 * l->cap : 4096;
        cuda_node *n = (cuda_node *)realloc(l->nodes, (size_t)cap * sizeof *n);
        if (!n) {
            cuda_fail(be, DS4_ERR_NOMEM, "cuda: out of host memory recording a step (%d launches)", l->n);
            return NULL;
        }
        l->nodes = n;
        l->cap = cap;
    }
    const size_t at = (l->pool_used + 15) & ~(size_t)15;
    if (at + data_len > l->pool_cap) {
        size_t cap = l->pool_cap ? l->pool_cap : ((size_t)1 << 20);
        while (cap < at + data_len) cap *= 2;
        uint8_t *p = (uint8_t *)realloc(l->pool, cap);
        if (!p) {
            cuda_fail(be, DS4_ERR_NOMEM, "cuda: out of host memory recording a step (%zu argument bytes)", cap);
            return NULL;
        }
        l->pool = p;
        l->pool_cap = cap;
    }
    cuda_node *e = &l->nodes[l->n++];
    *e = cuda_node{};
    e->kind = kind;
    e->func = func;
    e->data = (uint32_t)at;
    e->data_len = (uint32_t)data_len;
    l->pool_used = at + data_len;
    key_mix(l, (uint64_t)kind);
    key_mix(l, (uint64_t)(uintptr_t)func);
    return e;
}

/* Copy a log (entries and argument bytes) into `to`, which is grown as
 * needed; false when memory ran out. */
static bool log_copy(cuda_node_log *to, const cuda_node_log *from) {
    if (to->cap < from->n) {
        cuda_node *n = (cuda_node *)realloc(to->nodes, (size_t)from->n * sizeof *n);
        if (!n) return false;
        to->nodes = n;
        to->cap = from->n;
    }
    if (to->pool_cap < from->pool_used) {
        uint8_t *p = (uint8_t *)realloc(to->pool, from->pool_used);
        if (!p) return false;
        to->pool = p;
        to->pool_cap = from->pool_used;
    }
    memcpy(to->nodes, from->nodes, (size_t)from->n * sizeof *from->nodes);
    memcpy(to->pool, from->pool, from->pool_used);
    to->n = from->n;
    to->pool_used = from->pool_used;
    to->key = from->key;
    return true;
}

/* The kernel parameter pointers of entry e (into the log's pool). */
static void entry_params(const cuda_node_log *l, const cuda_node *e, void **params) {
    for (int i = 0; i < e->n_args; i++) params[i] = l->pool + e->data + e->arg_off[i];
}

/* ------------------------------------------------------------------------ */
/* Kernel timing (DS4_CUDA_PROFILE=1)                                        */
/* ------------------------------------------------------------------------ */

/* Every direct launch is bracketed by two events; the pairs are folded into
 * per-kernel totals at the next wait for the stream (or when the pool of
 * pairs is full). Keys are the kernel (copies and memsets: NULL) and the
 * name the op gave it. */
#define PROF_PAIRS 4096
#define PROF_KEYS 512

typedef struct cuda_profiler {
    cudaEvent_t ev[2 * PROF_PAIRS];
    const void *func[PROF_PAIRS];
    const char *what[PROF_PAIRS];
    int n;
    ds4_kernel_time keys[PROF_KEYS];
    const void *key_func[PROF_KEYS];
    int n_keys;
} cuda_profiler;

static void profile_add(cuda_profiler *p, const void *func, const char *what, double ms) {
    int k = 0;
    while (k < p->n_keys && !(p->key_func[k] == func && strcmp(p->keys[k].what, what) == 0)) k++;
    if (k == p->n_keys) {
        if (p->n_keys == PROF_KEYS) k = PROF_KEYS - 1; /* the table is full: the last entry takes the rest */
        else {
            const char *name = func ? NULL : what;
            if (func && (cudaFuncGetName(&name, func) != cudaSuccess || !name)) {
                (void)cudaGetLastError();
                name = "(kernel)";
            }
            p->key_func[k] = func;
            p->keys[k] = ds4_kernel_time{ name, what, 0, 0.0 };
            p->n_keys++;
        }
    }
    p->keys[k].count++;
    p->keys[k].ms += ms;
}

void cuda_profile_collect(ds4_backend *be) {
    cuda_profiler *p = cuda_impl(be)->prof;
    if (!p || p->n == 0) return;
    (void)CUDA_OK(be, cudaEventSynchronize(p->ev[2 * p->n - 1]));
    for (int i = 0; i < p->n; i++) {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, p->ev[2 * i], p->ev[2 * i + 1]) != cudaSuccess) {
            (void)cudaGetLastError();
            ms = 0.0f;
        }
        profile_add(p, p->func[i], p->what[i], (double)ms);
    }
    p->n = 0;
}

/* Before a direct launch: the event pair it goes between (NULL when not
 * timing); after it, the second event is recorded by profile_end. */
static int profile_begin(ds4_backend *be, const void *func, const char *what) {
    cuda_profiler *p = cuda_impl(be)->prof;
    if (!p) return -1;
    if (p->n == PROF_PAIRS) cuda_profile_collect(be);
    const int i = p->n;
    if (cudaEventRecord(p->ev[2 * i], cuda_stream(be)) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    p->func[i] = func;
    p->what[i] = what;
    return i;
}

static void profile_end(ds4_backend *be, int i) {
    cuda_profiler *p = cuda_impl(be)->prof;
    if (i < 0) return;
    if (cudaEventRecord(p->ev[2 * i + 1], cuda_stream(be)) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    p->n = i + 1;
}

static int cmp_time(const void *a, const void *b) {
    const double x = ((const ds4_kernel_time *)a)->ms, y = ((const ds4_kernel_time *)b)->ms;
    return x < y ? 1 : x > y ? -1 : 0;
}

extern "C" int ds4_cuda_backend_kernel_times(ds4_backend *be, ds4_kernel_time *out, int cap) {
    cuda_profiler *p = cuda_impl(be)->prof;
    if (!p) return 0;
    cuda_profile_collect(be);
    ds4_kernel_time *sorted = (ds4_kernel_time *)malloc((size_t)(p->n_keys ? p->n_keys : 1) * sizeof *sorted);
    if (!sorted) return 0;
    memcpy(sorted, p->keys, (size_t)p->n_keys * sizeof *sorted);
    qsort(sorted, (size_t)p->n_keys, sizeof *sorted, cmp_time);
    for (int i = 0; i < p->n_keys && i < cap; i++) out[i] = sorted[i];
    free(sorted);
    return p->n_keys;
}

extern "C" void ds4_cuda_backend_kernel_times_reset(ds4_backend *be) {
    cuda_profiler *p = cuda_impl(be)->prof;
    if (!p) return;
    cuda_profile_collect(be);
    p->n_keys = 0;
}

extern "C" void ds4_cuda_backend_profiler_range(ds4_backend *be, bool on) {
    if (!cuda_sync(be)) return;
    const cudaError_t e = on ? cudaProfilerStart() : cudaProfilerStop();
    if (e != cudaSuccess) (void)cudaGetLastError(); /* no profiler attached is not an error of the run */
}

/* ------------------------------------------------------------------------ */
/* Direct launches                                                           */
/* ------------------------------------------------------------------------ */

static bool direct_kernel(ds4_backend *be, const char *what, const void *func, dim3 grid, dim3 block, size_t smem,
                          void **params) {
    cuda_backend *cb = cuda_impl(be);
    const int timed = profile_begin(be, func, what);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = cb->stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cb->pdl && timed < 0 ? 1 : 0; /* timed launches: events sit between kernels anyway */
    const cudaError_t e = cudaLaunchKernelExC(&cfg, func, params);
    profile_end(be, timed);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return cuda_ok(be, e, what, __FILE__, __LINE__);
}

static bool direct_entry(ds4_backend *be, const cuda_node_log *l, const cuda_node *e) {
    cudaStream_t s = cuda_stream(be);
    if (e->kind == CUDA_NODE_KERNEL) {
        void *params[CUDA_NODE_MAX_ARGS];
        entry_params(l, e, params);
        return direct_kernel(be, e->what ? e->what : "recorded kernel", e->func, e->grid, e->block, e->smem, params);
    }
    if (e->kind == CUDA_NODE_COPY) return CUDA_OK(be, cudaMemcpyAsync(e->dst, e->src, e->bytes, e->dir, s));
    return CUDA_OK(be, cudaMemsetAsync(e->dst, e->value, e->bytes, s));
}

/* The current segment's arena bytes onto the stream (before the entries
 * that read them), then its recorded entries in order. */
static void submit_direct(ds4_backend *be) {
    cuda_backend *cb = cuda_impl(be);
    if (cb->arena_used > cb->seg_arena0) {
        const size_t a0 = cb->seg_arena0;
        if (CUDA_OK(be, cudaMemcpyAsync(cb->arena_dev + a0, cb->arena_host + a0, cb->arena_used - a0,
                                        cudaMemcpyHostToDevice, cb->stream)))
            (void)CUDA_OK(be, cudaEventRecord(cb->arena_done, cb->stream));
    }
    /* in log order: a branch's entries were recorded before the main
     * chain's that may run beside them, so this order is one the graph
     * could run in */
    for (int i = 0; i < cb->log.n && !cuda_failed(be); i++) (void)direct_entry(be, &cb->log, &cb->log.nodes[i]);
    step_log_clear(cb);
}

bool cuda_launch_args(ds4_backend *be, const char *what, const void *func, dim3 grid, dim3 block, size_t smem,
                      const cuda_args *a) {
    cuda_backend *cb = cuda_impl(be);
    cb->counters.launches++;
    if (a->overflow) {
        cuda_fail(be, DS4_ERR_INVALID, "cuda: %s has more than %d arguments or %zu argument bytes", what,
                  CUDA_NODE_MAX_ARGS, sizeof a->data);
        return false;
    }
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) {
        cuda_fail(be, DS4_ERR_INVALID, "cuda: %s launched with an empty grid", what);
        return false;
    }
    if (cb->recording) {
        cuda_node *e = log_push(be, &cb->log, CUDA_NODE_KERNEL, func, a->used);
        if (!e) return false;
        e->what = what;
        e->grid = grid;
        e->block = block;
        e->smem = (unsigned)smem;
        e->n_args = a->n;
        memcpy(e->arg_off, a->off, (size_t)a->n * sizeof a->off[0]);
        memcpy(cb->log.pool + e->data, a->data, a->used);
        link_entry(cb, e);
        return true;
    }
    void *params[CUDA_NODE_MAX_ARGS];
    for (int i = 0; i < a->n; i++) params[i] = (void *)(a->data + a->off[i]);
    return direct_kernel(be, what, func, grid, block, smem, params);
}

bool cuda_copy_d2d(ds4_backend *be, void *dst, const void *src, size_t bytes) {
    cuda_backend *cb = cuda_impl(be);
    if (bytes == 0) return true;
    cb->counters.launches++;
    if (cb->recording) {
        cuda_node *e = log_push(be, &cb->log, CUDA_NODE_COPY, NULL, 0);
        if (!e) return false;
        e->dst = dst;
        e->src = src;
        e->bytes = bytes;
        e->dir = cudaMemcpyDeviceToDevice;
        link_entry(cb, e);
        return true;
    }
    const int timed = profile_begin(be, NULL, "copy");
    const bool ok = CUDA_OK(be, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cb->stream));
    profile_end(be, timed);
    return ok;
}

bool cuda_memset_d(ds4_backend *be, void *dst, int value, size_t bytes) {
    cuda_backend *cb = cuda_impl(be);
    if (bytes == 0) return true;
    cb->counters.launches++;
    if (cb->recording) {
        cuda_node *e = log_push(be, &cb->log, CUDA_NODE_MEMSET, NULL, 0);
        if (!e) return false;
        e->dst = dst;
        e->value = value & 0xff;
        e->bytes = bytes;
        link_entry(cb, e);
        return true;
    }
    const int timed = profile_begin(be, NULL, "memset");
    const bool ok = CUDA_OK(be, cudaMemsetAsync(dst, value, bytes, cb->stream));
    profile_end(be, timed);
    return ok;
}

void *cuda_arena_put(ds4_backend *be, const void *host, size_t bytes) {
    cuda_backend *cb = cuda_impl(be);
    if (!cb->recording || !cb->arena_host) return NULL;
    const size_t at = (cb->arena_used + 15) & ~(size_t)15;
    if (at + bytes > CUDA_ARENA_BYTES) return NULL;
    memcpy(cb->arena_host + at, host, bytes);
    cb->arena_used = at + bytes;
    cuda_count_copy(be, true, bytes);
    return cb->arena_dev + at;
}

/* ------------------------------------------------------------------------ */
/* Steps                                                                     */
/* ------------------------------------------------------------------------ */

void cuda_step_break(ds4_backend *be, const char *why) {
    cuda_backend *cb = cuda_impl(be);
    if (!cb->recording) return;
    cb->recording = false;
    /* the graph time of a step cut short ends with its last segment */
    if (cb->seg_timed) cb->graph_timed = cudaEventRecord(cb->graph_t1, cb->stream) == cudaSuccess;
    cb->seg_timed = false;
    cb->last_break = why;
    cb->counters.step_breaks++;
    submit_direct(be);
}

void cuda_step_begin(ds4_backend *be) {
    cuda_backend *cb = cuda_impl(be);
    if (cb->in_step || !cb->graphs_on || cb->prof || cuda_failed(be) || !cb->arena_host) return;
    /* the arena is refilled: the last copy out of it must have run (the
     * previous token's logits came back since, so this rarely waits) */
    if (cudaEventQuery(cb->arena_done) != cudaSuccess) {
        (void)cudaGetLastError();
        cb->counters.syncs++;
        if (!CUDA_OK(be, cudaEventSynchronize(cb->arena_done))) return;
    }
    cuda_graph_timing_collect(cb);
    cb->in_step = true;
    cb->recording = true;
    cb->arena_used = 0;
    cb->seg = 0;
    cb->seg_marks = 0;
    cb->seg_arena0 = 0;
    cb->seg_timed = false;
    cb->step_t0 = cuda_now_ns();
    cb->br_side = false;
    step_log_clear(cb);
}

void cuda_graph_timing_collect(cuda_backend *cb) {
    if (!cb->graph_timed || cudaEventQuery(cb->graph_t1) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, cb->graph_t0, cb->graph_t1) == cudaSuccess && ms > 0.0f)
        cb->counters.graph_gpu_ns += (uint64_t)((double)ms * 1e6);
    else
        (void)cudaGetLastError();
    cb->graph_timed = false;
}

static void graph_rec_free(cuda_graph_rec *g) {
    if (g->exec) cudaGraphExecDestroy(g->exec);
    if (g->graph) cudaGraphDestroy(g->graph);
    free(g->gnodes);
    log_free(&g->log);
    memset(g, 0, sizeof *g);
}

static cudaKernelNodeParams kernel_params(const cuda_node_log *l, const cuda_node *e, void **params) {
    entry_params(l, e, params);
    cudaKernelNodeParams p = {};
    p.func = (void *)e->func;
    p.gridDim = e->grid;
    p.blockDim = e->block;
    p.sharedMemBytes = e->smem;
    p.kernelParams = params;
    p.extra = NULL;
    return p;
}

static cudaMemsetParams memset_params(const cuda_node *e) {
    cudaMemsetParams p = {};
    p.dst = e->dst;
    p.value = (unsigned)e->value;
    p.elementSize = 1;
    p.width = e->bytes;
    p.height = 1;
    return p;
}

/* Build and instantiate a graph of the log into g (freed first). */
static bool graph_build(ds4_backend *be, cuda_graph_rec *g, const cuda_node_log *l, size_t arena_off,
                        size_t arena_bytes) {
    cuda_backend *cb = cuda_impl(be);
    graph_rec_free(g);
    g->gnodes = (cudaGraphNode_t *)malloc((size_t)(l->n > 0 ? l->n : 1) * sizeof *g->gnodes);
    if (!g->gnodes || !log_copy(&g->log, l)) {
        graph_rec_free(g);
        cuda_fail(be, DS4_ERR_NOMEM, "cuda: out of host memory for a step graph of %d launches", l->n);
        return false;
    }
    if (!CUDA_OK(be, cudaGraphCreate(&g->graph, 0))) {
        graph_rec_free(g);
        return false;
    }
    /* the arena copy first (the segment's piece, at least 16 bytes, so the
     * node always exists: bytes past the piece are rewritten by the later
     * segment that uses them before anything reads them),
     * then the entries as a chain in log order: a kernel after a kernel is
     * its programmatic dependent (its launch overlaps the end of the one
     * before, which it waits for in cuda_grid_wait), anything else a plain
     * dependent */
    g->arena_off = arena_off;
    g->arena_bytes = arena_bytes;
    bool ok = CUDA_OK(be, cudaGraphAddMemcpyNode1D(&g->arena_node, g->graph, NULL, 0, cb->arena_dev + arena_off,
                                                   cb->arena_host + arena_off, arena_bytes, cudaMemcpyHostToDevice));
    for (int i = 0; ok && i < l->n; i++) {
        const cuda_node *e = &g->log.nodes[i];
        if (e->kind == CUDA_NODE_KERNEL) {
            void *params[CUDA_NODE_MAX_ARGS];
            const cudaKernelNodeParams p = kernel_params(&g->log, e, params);
            ok = CUDA_OK(be, cudaGraphAddKernelNode(&g->gnodes[i], g->graph, NULL, 0, &p));
        } else if (e->kind == CUDA_NODE_COPY) {
            ok = CUDA_OK(be, cudaGraphAddMemcpyNode1D(&g->gnodes[i], g->graph, NULL, 0, e->dst, e->src, e->bytes,
                                                      e->dir));
        } else {
            const cudaMemsetParams p = memset_params(e);
            ok = CUDA_OK(be, cudaGraphAddMemsetNode(&g->gnodes[i], g->graph, NULL, 0, &p));
        }
    }
    if (ok && l->n > 0) {
        /* each entry's edge from its predecessor, and a join's from the
         * branch it waits for. A kernel after a kernel is its programmatic
         * dependent, one per predecessor: a branch's first entry takes the
         * plain edge where the main chain's next entry already takes the
         * programmatic one (the chain is the longer path) */
        cudaGraphNode_t *from = (cudaGraphNode_t *)malloc((size_t)(2 * l->n) * sizeof *from);
        cudaGraphNode_t *to = (cudaGraphNode_t *)malloc((size_t)(2 * l->n) * sizeof *to);
        cudaGraphEdgeData *edges = (cudaGraphEdgeData *)calloc((size_t)(2 * l->n), sizeof *edges);
        bool *prog_taken = (bool *)calloc((size_t)l->n, sizeof *prog_taken);
        bool *prog = (bool *)calloc((size_t)l->n, sizeof *prog);
        ok = from && to && edges && prog_taken && prog;
        if (!ok) cuda_fail(be, DS4_ERR_NOMEM, "cuda: out of host memory for a step graph of %d launches", l->n);
        for (int pass = 0; ok && pass < 2; pass++) { /* the main chain's entries first */
            for (int i = 0; i < l->n; i++) {
                const cuda_node *e = &g->log.nodes[i];
                if (e->side != (pass == 1)) continue;
                prog[i] = cb->pdl && e->pred >= 0 && !prog_taken[e->pred] && e->kind == CUDA_NODE_KERNEL &&
                          g->log.nodes[e->pred].kind == CUDA_NODE_KERNEL;
                if (prog[i]) prog_taken[e->pred] = true;
            }
        }
        size_t n_edges = 0;
        for (int i = 0; ok && i < l->n; i++) {
            const cuda_node *e = &g->log.nodes[i];
            from[n_edges] = e->pred >= 0 ? g->gnodes[e->pred] : g->arena_node;
            to[n_edges] = g->gnodes[i];
            edges[n_edges].type = prog[i] ? cudaGraphDependencyTypeProgrammatic : cudaGraphDependencyTypeDefault;
            edges[n_edges].from_port = prog[i] ? cudaGraphKernelNodePortProgrammatic : cudaGraphKernelNodePortDefault;
            n_edges++;
            if (e->join >= 0 && e->join != e->pred) {
                from[n_edges] = g->gnodes[e->join];
                to[n_edges] = g->gnodes[i];
                edges[n_edges].type = cudaGraphDependencyTypeDefault;
                edges[n_edges].from_port = cudaGraphKernelNodePortDefault;
                n_edges++;
            }
        }
        if (ok) ok = CUDA_OK(be, cudaGraphAddDependencies(g->graph, from, to, edges, n_edges));
        free(from);
        free(to);
        free(edges);
        free(prog_taken);
        free(prog);
    }
    if (ok) ok = CUDA_OK(be, cudaGraphInstantiate(&g->exec, g->graph, 0));
    if (!ok) {
        graph_rec_free(g);
        return false;
    }
    cb->counters.graph_builds++;
    return true;
}

/* The cached graph of the log's shape, or NULL. */
static cuda_graph_rec *graph_find(cuda_backend *cb, const cuda_node_log *l) {
    for (int i = 0; i < CUDA_GRAPH_CACHE; i++) {
        cuda_graph_rec *g = &cb->graphs[i];
        if (!g->exec || g->log.key != l->key || g->log.n != l->n) continue;
        bool same = true;
        for (int k = 0; same && k < l->n; k++) {
            const cuda_node *a = &g->log.nodes[k], *b = &l->nodes[k];
            same = a->kind == b->kind && a->func == b->func && a->data_len == b->data_len && a->pred == b->pred &&
                   a->join == b->join && a->side == b->side;
        }
        if (same) return g;
    }
    return NULL;
}

static bool dim3_eq(dim3 a, dim3 b) { return a.x == b.x && a.y == b.y && a.z == b.z; }

/* Set the parameters of every node of g that differ from the log's, so g
 * runs exactly the log. false when CUDA refused one (nothing is recorded:
 * the caller builds the graph anew instead). */
static bool graph_update(ds4_backend *be, cuda_graph_rec *g, const cuda_node_log *l, size_t arena_off,
                         size_t arena_bytes) {
    cuda_backend *cb = cuda_impl(be);
    if (arena_off != g->arena_off || arena_bytes != g->arena_bytes) {
        if (cudaGraphExecMemcpyNodeSetParams1D(g->exec, g->arena_node, cb->arena_dev + arena_off,
                                               cb->arena_host + arena_off, arena_bytes,
                                               cudaMemcpyHostToDevice) != cudaSuccess) {
            cb->last_refusal = "the step arena's copy";
            return false;
        }
        g->arena_off = arena_off;
        g->arena_bytes = arena_bytes;
        cb->counters.node_updates++;
    }
    for (int i = 0; i < l->n; i++) {
        const cuda_node *e = &l->nodes[i];
        cuda_node *have = &g->log.nodes[i];
        cudaError_t rc = cudaSuccess;
        bool changed = false;
        if (e->kind == CUDA_NODE_KERNEL) {
            const uint8_t *args = l->pool + e->data;
            uint8_t *held = g->log.pool + have->data;
            changed = !dim3_eq(e->grid, have->grid) || !dim3_eq(e->block, have->block) || e->smem != have->smem ||
                      memcmp(args, held, e->data_len) != 0;
            if (changed) {
                void *params[CUDA_NODE_MAX_ARGS];
                const cudaKernelNodeParams p = kernel_params(l, e, params);
                rc = cudaGraphExecKernelNodeSetParams(g->exec, g->gnodes[i], &p);
                memcpy(held, args, e->data_len);
            }
        } else if (e->kind == CUDA_NODE_COPY) {
            changed = e->dst != have->dst || e->src != have->src || e->bytes != have->bytes;
            if (changed)
                rc = cudaGraphExecMemcpyNodeSetParams1D(g->exec, g->gnodes[i], e->dst, e->src, e->bytes, e->dir);
        } else {
            changed = e->dst != have->dst || e->value != have->value || e->bytes != have->bytes;
            if (changed) {
                const cudaMemsetParams p = memset_params(e);
                rc = cudaGraphExecMemsetNodeSetParams(g->exec, g->gnodes[i], &p);
            }
        }
        if (rc != cudaSuccess) {
            cb->last_refusal = e->kind == CUDA_NODE_KERNEL ? e->what : e->kind == CUDA_NODE_COPY ? "copy" : "memset";
            return false;
        }
        if (changed) {
            const uint32_t data = have->data;
            *have = *e;
            have->data = data; /* g's own pool offset (the same layout) */
            cb->counters.node_updates++;
        }
    }
    return true;
}

static void segment_submit(ds4_backend *be);

void cuda_step_end(ds4_backend *be) {
    cuda_backend *cb = cuda_impl(be);
    if (!cb->in_step) return;
    cuda_hc_settle(be); /* a step leaves no Sinkhorn for the next */
    cb->in_step = false;
    if (cb->recording) { /* else broken off: the rest ran directly */
        cb->recording = false;
        if (cb->log.n > 0 || cb->seg == 0 || cb->arena_used > cb->seg_arena0) segment_submit(be);
    }
    if (cb->seg > 0) cb->counters.graphs++;
    if (cb->seg_timed) cb->graph_timed = cudaEventRecord(cb->graph_t1, cb->stream) == cudaSuccess;
    cb->seg_timed = false;
    cb->counters.step_host_ns += cuda_now_ns() - cb->step_t0;
}

void cuda_step_mark(ds4_backend *be) {
    cuda_backend *cb = cuda_impl(be);
    if (!cb->recording || !cb->segments) return;
    cb->seg_marks++;
    if ((cb->seg_marks & (cb->seg_marks + 1)) == 0 && cb->log.n > 0) segment_submit(be); /* marks 2^k - 1 */
}

/* Launch what was recorded since the last cut as a graph (the cached one of
 * its shape, updated, or a new one) and start the next segment. */
static void segment_submit(ds4_backend *be) {
    cuda_backend *cb = cuda_impl(be);
    if (cuda_failed(be)) { /* the evaluation failed: its error is reported, nothing runs */
        step_log_clear(cb, cb->seg);
        return;
    }
    /* this segment's piece of the arena, at least 16 bytes (within the arena) */
    size_t arena_off = cb->seg_arena0, arena_bytes = cb->arena_used > arena_off ? cb->arena_used - arena_off : 0;
    if (arena_bytes < 16) arena_bytes = 16;
    if (arena_off + arena_bytes > CUDA_ARENA_BYTES) arena_off = CUDA_ARENA_BYTES - arena_bytes;
    cuda_graph_rec *g = graph_find(cb, &cb->log);
    bool ok = true;
    if (g && !graph_update(be, g, &cb->log, arena_off, arena_bytes)) {
        /* an update CUDA refused: this shape is built anew, once a launch of
         * the old graph that may still run has finished */
        (void)cudaGetLastError();
        cb->counters.graph_refusals++;
        cb->counters.syncs++;
        ok = CUDA_OK(be, cudaStreamSynchronize(cb->stream)) && graph_build(be, g, &cb->log, arena_off, arena_bytes);
    } else if (!g) {
        /* a free slot, else the least recently used graph makes room (a
         * launch of it may still run: wait for the stream first) */
        g = &cb->graphs[0];
        for (int i = 0; i < CUDA_GRAPH_CACHE; i++) {
            if (!cb->graphs[i].exec) {
                g = &cb->graphs[i];
                break;
            }
            if (cb->graphs[i].last_use < g->last_use) g = &cb->graphs[i];
        }
        if (g->exec) {
            cb->counters.syncs++;
            ok = CUDA_OK(be, cudaStreamSynchronize(cb->stream));
        } else {
            ok = true;
        }
        ok = ok && graph_build(be, g, &cb->log, arena_off, arena_bytes);
    }
    if (ok && g->exec) {
        g->last_use = ++cb->graph_clock;
        const bool timed = cb->seg == 0 && !cb->graph_timed && cudaEventRecord(cb->graph_t0, cb->stream) == cudaSuccess;
        ok = CUDA_OK(be, cudaGraphLaunch(g->exec, cb->stream));
        if (ok) {
            cb->seg++;
            cb->counters.graph_launches++;
            (void)CUDA_OK(be, cudaEventRecord(cb->arena_done, cb->stream));
            if (timed) cb->seg_timed = true; /* graph_t1 is recorded at step_end */
        }
    }
    cb->seg_arena0 = cb->arena_used;
    step_log_clear(cb, cb->seg);
}

extern "C" void ds4_cuda_backend_set_graphs(ds4_backend *be, int on) { cuda_impl(be)->graphs_on = on != 0; }
extern "C" void ds4_cuda_backend_set_segments(ds4_backend *be, int on) { cuda_impl(be)->segments = on != 0; }
extern "C" void ds4_cuda_backend_set_branches(ds4_backend *be, int on) { cuda_impl(be)->branches = on != 0; }
extern "C" void ds4_cuda_backend_branch_beside(const ds4_backend *be, uint64_t *beside) {
    if (beside) *beside = ((const cuda_backend *)be->impl)->br_beside;
}
extern "C" void ds4_cuda_backend_branch_stats(const ds4_backend *be, uint64_t *branches, uint64_t *auto_joins) {
    const cuda_backend *cb = (const cuda_backend *)be->impl;
    if (branches) *branches = cb->br_count;
    if (auto_joins) *auto_joins = cb->br_auto_joins;
}
extern "C" void ds4_cuda_backend_set_moe_grouped(ds4_backend *be, int on) { cuda_impl(be)->moe_grouped = on != 0; }
extern "C" void ds4_cuda_backend_set_moe_mma(ds4_backend *be, int on) { cuda_impl(be)->moe_mma = on != 0; }
/* 32 for 32, anything else the default, 64 */
static int moe_mma_rows_of(long r) { return r == 32 ? 32 : CUDA_MOE_MMA_ROWS; }
extern "C" void ds4_cuda_backend_set_moe_mma_blocks(ds4_backend *be, int blocks) {
    cuda_impl(be)->moe_mma_blocks = blocks == 1 ? 1 : 3;
}
extern "C" int ds4_cuda_backend_moe_mma_blocks(const ds4_backend *be) {
    return ((const cuda_backend *)be->impl)->moe_mma_blocks;
}
extern "C" void ds4_cuda_backend_set_moe_mma_rows(ds4_backend *be, int max_rows) {
    cuda_impl(be)->moe_mma_rows = moe_mma_rows_of(max_rows);
}
extern "C" void ds4_cuda_backend_set_moe_ids(ds4_backend *be, int on) { cuda_impl(be)->moe_ids = on != 0; }
/* A group size the grouped matvec kernels have, else 0 (off). */
static int step_group_rows(long r) { return cuda_mv_rows_built(r) ? (int)r : 0; }
extern "C" void ds4_cuda_backend_set_moe_step_group(ds4_backend *be, int max_rows) {
    cuda_impl(be)->moe_step_rows = step_group_rows(max_rows);
}
extern "C" void ds4_cuda_backend_set_fgemm(ds4_backend *be, int on) { cuda_impl(be)->fgemm = on != 0; }
extern "C" void ds4_cuda_backend_set_att_tc(ds4_backend *be, int on) { cuda_impl(be)->att_tc = on != 0; }
extern "C" void ds4_cuda_backend_set_att_tc_warps(ds4_backend *be, int warps) {
    cuda_impl(be)->att_tc_warps = warps == 16 ? 16 : 8;
}
extern "C" int ds4_cuda_backend_att_tc_warps(const ds4_backend *be) {
    return ((const cuda_backend *)be->impl)->att_tc_warps;
}
extern "C" void ds4_cuda_backend_set_idx_keys(ds4_backend *be, int keys) { cuda_impl(be)->idx_keys = keys == 1 ? 1 : 4; }
extern "C" int ds4_cuda_backend_idx_keys(const ds4_backend *be) { return ((const cuda_backend *)be->impl)->idx_keys; }
extern "C" int64_t ds4_cuda_backend_idx_keys_calls(const ds4_backend *be) {
    return ((const cuda_backend *)be->impl)->idx_keys_calls;
}
extern "C" void ds4_cuda_backend_set_idx_tc(ds4_backend *be, int on) { cuda_impl(be)->idx_tc = on != 0; }
extern "C" int ds4_cuda_backend_idx_tc(const ds4_backend *be) { return ((const cuda_backend *)be->impl)->idx_tc; }
extern "C" int64_t ds4_cuda_backend_idx_tc_calls(const ds4_backend *be) {
    return ((const cuda_backend *)be->impl)->idx_tc_calls;
}
extern "C" int64_t ds4_cuda_backend_att_tc_calls(const ds4_backend *be) {
    return ((const cuda_backend *)be->impl)->att_tc_calls;
}
extern "C" int64_t ds4_cuda_backend_fgemm_calls(const ds4_backend *be) {
    return ((const cuda_backend *)be->impl)->fgemm_calls;
}
extern "C" int64_t ds4_cuda_backend_gemm_bm128_calls(const ds4_backend *be) {
    return ((const cuda_backend *)be->impl)->gemm_bm128_calls;
}
extern "C" int64_t ds4_cuda_backend_moe_mma_calls(const ds4_backend *be) {
    return ((const cuda_backend *)be->impl)->moe_mma_calls;
}
extern "C" void ds4_cuda_backend_set_fusions(ds4_backend *be, int mv_xq, int moe_xq) {
    cuda_impl(be)->mv_xq = mv_xq != 0;
    cuda_impl(be)->moe_xq = moe_xq != 0;
}

extern "C" void ds4_cuda_backend_set_mv_pack(ds4_backend *be, int on) { cuda_impl(be)->mv_pack = on != 0; }
extern "C" void ds4_cuda_backend_set_mv_xs(ds4_backend *be, int on) { cuda_impl(be)->mv_xs = on != 0; }
extern "C" int64_t ds4_cuda_backend_mv_packed_launches(const ds4_backend *be) {
    return ((const cuda_backend *)be->impl)->mv_packed_launches;
}

extern "C" void ds4_cuda_backend_set_norm_rope(ds4_backend *be, int on) { cuda_impl(be)->norm_rope = on != 0; }
extern "C" void ds4_cuda_backend_set_hc_norm(ds4_backend *be, int on) { cuda_impl(be)->hc_norm = on != 0; }
extern "C" void ds4_cuda_backend_set_hc_post_pre(ds4_backend *be, int on) { cuda_impl(be)->hc_post_pre = on != 0; }
extern "C" void ds4_cuda_backend_set_hc_all(ds4_backend *be, int mode) {
    cuda_impl(be)->hc_all = mode == 0 || mode == 2 ? mode : 1;
}
extern "C" void ds4_cuda_backend_set_wide_rows(ds4_backend *be, int on) { cuda_impl(be)->wide_rows = on != 0; }
extern "C" void ds4_cuda_backend_set_gemm_bm(ds4_backend *be, int rows) { cuda_impl(be)->gemm_bm = rows == 64 ? 64 : 128; }
extern "C" int ds4_cuda_backend_gemm_bm(const ds4_backend *be) { return ((const cuda_backend *)be->impl)->gemm_bm; }
extern "C" void ds4_cuda_backend_set_router_reg(ds4_backend *be, int on) { cuda_impl(be)->router_reg = on != 0; }

extern "C" const char *ds4_cuda_backend_last_refusal(const ds4_backend *be) {
    const char *w = ((const cuda_backend *)be->impl)->last_refusal;
    return w ? w : "none";
}

extern "C" const char *ds4_cuda_backend_last_break(const ds4_backend *be) {
    const char *w = ((const cuda_backend *)be->impl)->last_break;
    return w ? w : "none";
}

ds4_status cuda_launch_init(cuda_backend *cb, ds4_error *err) {
    cb->graphs_on = cuda_env_flag("DS4_CUDA_GRAPH", true);
    cb->pdl = cuda_env_flag("DS4_CUDA_PDL", true);
    cb->segments = cuda_env_flag("DS4_CUDA_SEGMENTS", true);
    cb->mv_xq = cuda_env_flag("DS4_CUDA_MV_XQ", true);
    cb->mv_pack = cuda_env_flag("DS4_CUDA_MV_PACK", true);
    cb->mv_xs = cuda_env_flag("DS4_CUDA_MV_XS", false);
    cb->moe_xq = cuda_env_flag("DS4_CUDA_MOE_XQ", true);
    cb->norm_rope = cuda_env_flag("DS4_CUDA_NORM_ROPE", true);
    cb->norm_rope2 = cuda_env_flag("DS4_CUDA_NORM_ROPE2", true);
    cb->hc_norm = cuda_env_flag("DS4_CUDA_HC_NORM", true);
    cb->hc_post_pre = cuda_env_flag("DS4_CUDA_HC_POST_PRE", true);
    cb->hc_all = (int)cuda_env_long("DS4_CUDA_HC_ALL", 1, 0, 2);
    cb->router_reg = cuda_env_flag("DS4_CUDA_ROUTER_REG", false);
    cb->wide_rows = cuda_env_flag("DS4_CUDA_WIDE_ROWS", true);
    cb->gemm_bm = cuda_env_long("DS4_CUDA_GEMM_BM", 128, 64, 128) == 64 ? 64 : 128;
    cb->moe_grouped = cuda_env_flag("DS4_CUDA_MOE_GROUPED", true);
    cb->moe_mma = cuda_env_flag("DS4_CUDA_MOE_MMA", true);
    cb->moe_mma_rows = moe_mma_rows_of(cuda_env_long("DS4_CUDA_MOE_MMA_ROWS", CUDA_MOE_MMA_ROWS, 32, CUDA_MOE_MMA_ROWS));
    cb->moe_mma_blocks = cuda_env_long("DS4_CUDA_MOE_MMA_BLOCKS", 3, 1, 3) == 1 ? 1 : 3;
    cb->moe_step_rows = step_group_rows(cuda_env_long("DS4_CUDA_MOE_STEP_GROUP", 0, 0, 8));
    cb->fgemm = cuda_env_flag("DS4_CUDA_FGEMM", true);
    cb->att_tc = cuda_env_flag("DS4_CUDA_ATT_TC", true);
    cb->att_tc_warps = cuda_env_long("DS4_CUDA_ATT_TC_WARPS", 8, 8, 16) == 16 ? 16 : 8;
    cb->idx_keys = cuda_env_long("DS4_CUDA_IDX_KEYS", 4, 1, 4) == 1 ? 1 : 4;
    cb->idx_tc = cuda_env_flag("DS4_CUDA_IDX_TC", true);
    cb->branches = cuda_env_flag("DS4_CUDA_BRANCH", true);
    cb->moe_ids = cuda_env_flag("DS4_CUDA_MOE_IDS", true);
    cuda_hc_defer_init(cb);
    step_log_clear(cb);
    DS4_CUDA_CHECK(cudaEventCreateWithFlags(&cb->arena_done, cudaEventDisableTiming), err);
    DS4_CUDA_CHECK(cudaEventCreate(&cb->graph_t0), err);
    DS4_CUDA_CHECK(cudaEventCreate(&cb->graph_t1), err);
    DS4_CUDA_CHECK(cudaMallocHost((void **)&cb->arena_host, CUDA_ARENA_BYTES), err);
    memset(cb->arena_host, 0, CUDA_ARENA_BYTES);
    DS4_CUDA_CHECK(cudaMalloc((void **)&cb->arena_dev, CUDA_ARENA_BYTES), err);
    if (cuda_env_flag("DS4_CUDA_PROFILE", false)) {
        cb->prof = (cuda_profiler *)calloc(1, sizeof *cb->prof);
        if (!cb->prof) return ds4_error_set(err, DS4_ERR_NOMEM, "cuda backend: out of memory for kernel timing");
        for (int i = 0; i < 2 * PROF_PAIRS; i++) DS4_CUDA_CHECK(cudaEventCreate(&cb->prof->ev[i]), err);
    }
    return DS4_OK;
}

void cuda_launch_free(cuda_backend *cb) {
    if (cb->prof) {
        for (int i = 0; i < 2 * PROF_PAIRS; i++)
            if (cb->prof->ev[i]) cudaEventDestroy(cb->prof->ev[i]);
        free(cb->prof);
        cb->prof = NULL;
    }
    for (int i = 0; i < CUDA_GRAPH_CACHE; i++) graph_rec_free(&cb->graphs[i]);
    log_free(&cb->log);
    if (cb->arena_host) cudaFreeHost(cb->arena_host);
    if (cb->arena_dev) cudaFree(cb->arena_dev);
    if (cb->arena_done) cudaEventDestroy(cb->arena_done);
    if (cb->graph_t0) cudaEventDestroy(cb->graph_t0);
    if (cb->graph_t1) cudaEventDestroy(cb->graph_t1);
    cb->arena_host = cb->arena_dev = NULL;
    cb->arena_done = NULL;
}

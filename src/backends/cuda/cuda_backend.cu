/*
 * cuda_backend.cu - the CUDA backend: its op table and constructor, device
 * memory, weights, errors, and the elementwise ops, norms, rounding steps and
 * embedding. The matrix products, attention and HC/FFN ops live in
 * cuda_matmul.cu, cuda_attention.cu and cuda_hc_ffn.cu (cuda_internal.h).
 *
 * Memory: activation buffers come from the device's stream-ordered pool
 * (cudaMallocAsync on the backend's stream, with the pool's release
 * threshold raised so freed blocks are reused instead of returned to the
 * driver). Weights are uploaded once at bind time into their own
 * allocations, through two pinned staging buffers so the copy from the file
 * mapping overlaps the DMA. Rounding ops are bit-identical to src/core's
 * reference functions (the same float operations in the same order, no
 * contractions); rmsnorm sums squares in double like the CPU, in a different
 * order, so it agrees to the last bit or two.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_fp16.h>

#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/cuda_rows.cuh"

/* ------------------------------------------------------------------------ */
/* Errors                                                                    */
/* ------------------------------------------------------------------------ */

void cuda_fail(ds4_backend *be, ds4_status status, const char *fmt, ...) {
    cuda_backend *cb = cuda_impl(be);
    if (cb->error.status != DS4_OK) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cb->error.message, sizeof cb->error.message, fmt, ap);
    va_end(ap);
    cb->error.status = status;
}

bool cuda_failed(ds4_backend *be) { return cuda_impl(be)->error.status != DS4_OK; }

bool cuda_ok(ds4_backend *be, cudaError_t e, const char *call, const char *file, int line) {
    if (e == cudaSuccess) return true;
    cuda_backend *cb = cuda_impl(be);
    ds4_error tmp;
    ds4_error_clear(&tmp);
    ds4_status st = ds4_cuda_error(e, call, file, line, &tmp);
    if (cb->error.status == DS4_OK) cb->error = tmp, cb->error.status = st;
    return false;
}

uint64_t cuda_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

bool cuda_sync(ds4_backend *be) {
    ds4_backend_counters *c = &cuda_impl(be)->counters;
    cuda_step_break(be, "a wait for the stream");
    c->syncs++;
    const uint64_t t0 = cuda_now_ns();
    const bool ok = CUDA_OK(be, cudaStreamSynchronize(cuda_stream(be)));
    c->wait_ns += cuda_now_ns() - t0;
    if (ok) cuda_profile_collect(be);
    return ok;
}

int cuda_check_tag(ds4_backend *be, const char *name) {
    cuda_backend *cb = cuda_impl(be);
    if (!name) name = "(unnamed)";
    for (int i = 0; i < cb->n_check_names; i++)
        if (!strncmp(cb->check_names[i], name, CUDA_CHECK_NAME_MAX - 1)) return i;
    if (cb->n_check_names == CUDA_CHECK_NAMES) return -1;
    snprintf(cb->check_names[cb->n_check_names], CUDA_CHECK_NAME_MAX, "%s", name);
    return cb->n_check_names++;
}

/* The message of a bad index that a kernel reported (the host-side checks
 * of the CPU backend give the same ones). */
static void record_device_error(ds4_backend *be, const cuda_dev_error *e) {
    cuda_backend *cb = cuda_impl(be);
    const char *name = e->tag >= 0 && e->tag < cb->n_check_names ? cb->check_names[e->tag] : "(name not kept)";
    switch (e->code) {
    case CUDA_CHECK_MOE_EXPERT:
        cuda_fail(be, DS4_ERR_INVALID, "moe: selected expert %lld is outside [0, %lld) of %s", e->value, e->limit,
                  name);
        break;
    case CUDA_CHECK_ATTENTION_ROW:
        cuda_fail(be, DS4_ERR_INVALID, "attention: selected row %lld has index %lld, outside [0, %lld) of rows_b "
                  "(sinks %s)", e->pos, e->value, e->limit, name);
        break;
    default:
        cuda_fail(be, DS4_ERR_INVALID, "cuda: a kernel reported bad index %lld (check %d, limit %lld, %s)", e->value,
                  e->code, e->limit, name);
        break;
    }
}

static ds4_status cuda_take_error(ds4_backend *be, ds4_error *err) {
    cuda_backend *cb = cuda_impl(be);
    /* The device error record comes back with the same wait: one small copy
     * per call (take_error runs once per evaluation). */
    cudaStream_t s = cuda_stream(be);
    cuda_hc_settle(be); /* an evaluation ends with no Sinkhorn left (dropped after an error) */
    cuda_step_break(be, "take_error");
    const bool copied = cudaMemcpyAsync(cb->dev_error_host, cb->dev_error, sizeof *cb->dev_error,
                                        cudaMemcpyDeviceToHost, s) == cudaSuccess;
    if (copied) cuda_count_copy(be, false, sizeof *cb->dev_error);
    else (void)cudaGetLastError();
    /* asynchronous faults surface here at the latest */
    const bool drained = cuda_sync(be);
    if (copied && drained && cb->dev_error_host->claim != 0) {
        /* an error recorded on the host by an earlier op, if any, stays the
         * one reported; the device record is cleared either way */
        record_device_error(be, cb->dev_error_host);
        memset(cb->dev_error_host, 0, sizeof *cb->dev_error_host);
        (void)cuda_memset_d(be, cb->dev_error, 0, sizeof *cb->dev_error);
    }
    ds4_status status = cb->error.status;
    if (status != DS4_OK && err) *err = cb->error;
    ds4_error_clear(&cb->error);
    return status;
}

/* ------------------------------------------------------------------------ */
/* Scratch and staging                                                       */
/* ------------------------------------------------------------------------ */

static void note_peak(cuda_backend *cb) {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && total_b - free_b > cb->peak_bytes)
        cb->peak_bytes = total_b - free_b;
    else
        (void)cudaGetLastError();
}

void *cuda_scratch(ds4_backend *be, cuda_scratch_slot slot, size_t bytes) {
    cuda_backend *cb = cuda_impl(be);
    if (slot < 0 || slot >= CUDA_SCRATCH_SLOTS) {
        cuda_fail(be, DS4_ERR_INVALID, "cuda scratch: bad slot %d", (int)slot);
        return NULL;
    }
    if (bytes == 0) bytes = 1;
    cuda_branch_slot(cb, (int)slot);
    if (cb->scratch_cap[slot] >= bytes) return cb->scratch[slot];
    size_t cap = cb->scratch_cap[slot] ? cb->scratch_cap[slot] : 4096;
    while (cap < bytes) cap = cap > SIZE_MAX / 2 ? bytes : cap * 2;
    /* no allocation inside a recorded step; the old buffer may still be in use */
    if (!cuda_sync(be)) return NULL;
    cudaFree(cb->scratch[slot]);
    cb->scratch[slot] = NULL;
    cb->scratch_cap[slot] = 0;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, cap);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        cuda_fail(be, DS4_ERR_NOMEM, "cuda: out of device memory for %zu bytes of scratch", cap);
        return NULL;
    }
    cb->scratch[slot] = p;
    cb->scratch_cap[slot] = cap;
    note_peak(cb);
    return p;
}

bool cuda_allow_dynamic_smem(ds4_backend *be, const void *kernel, size_t bytes, const char *op, int64_t dim) {
    if (bytes + CUDA_SMEM_STATIC_RESERVE <= CUDA_SMEM_DEFAULT) return true;
    int optin = 0;
    if (!CUDA_OK(be, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, cuda_impl(be)->device)))
        return false;
    if (bytes + CUDA_SMEM_STATIC_RESERVE > (size_t)optin) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "%s: width %lld needs %zu bytes of shared memory (the device has %d)", op,
                  (long long)dim, bytes, optin);
        return false;
    }
    return CUDA_OK(be, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

/* Bytes of the control ring: a decode step uploads about 2 KB (token id,
 * positions for every RoPE), so a lap lasts hundreds of tokens. */
#define CUDA_CTRL_RING ((size_t)1 << 20)

void *cuda_upload_ctrl(ds4_backend *be, cuda_scratch_slot slot, const void *host, size_t bytes) {
    cuda_backend *cb = cuda_impl(be);
    const size_t need = (bytes + 15) & ~(size_t)15;
    if (bytes > 0 && cb->recording) {
        void *d = cuda_arena_put(be, host, bytes); /* a recorded step: its arena */
        if (d) return d;
        cuda_step_break(be, "the step arena is full");
    }
    if (bytes > 0 && need <= CUDA_CTRL_RING / 4 && cb->ring_host) {
        /* The control ring: each upload takes the next piece of a pinned
         * ring and of its device twin, so nothing waits for the device
         * until the ring wraps; then the copies of the lap that ends must
         * have left the pinned memory before it is refilled (one wait per
         * lap). The device piece is only read by kernels enqueued before
         * the next lap's copy into it, so stream order protects it. */
        if (cb->ring_off + need > CUDA_CTRL_RING) {
            if (!CUDA_OK(be, cudaEventRecord(cb->ring_lap, cb->stream))) return NULL;
            cb->counters.syncs++;
            const uint64_t t0 = cuda_now_ns();
            const bool ok = CUDA_OK(be, cudaEventSynchronize(cb->ring_lap));
            cb->counters.wait_ns += cuda_now_ns() - t0;
            if (!ok) return NULL;
            cb->ring_off = 0;
        }
        const size_t off = cb->ring_off;
        cb->ring_off += need;
        memcpy(cb->ring_host + off, host, bytes);
        cuda_count_copy(be, true, bytes);
        if (!CUDA_OK(be, cudaMemcpyAsync(cb->ring_dev + off, cb->ring_host + off, bytes, cudaMemcpyHostToDevice,
                                         cb->stream)))
            return NULL;
        return cb->ring_dev + off;
    }
    void *d = cuda_scratch(be, slot, bytes);
    if (!d) return NULL;
    if (bytes == 0) return d;
    cuda_step_break(be, "a control upload too large for the ring"); /* events and waits below */
    /* The ring of pinned control buffers: the copy must not read a host
     * buffer that a later call overwrites before the stream reaches it, so
     * each slot has its own pinned buffer, and we wait for the previous copy
     * out of it (an event) before refilling it. */
    if (cb->ctrl_cap[slot] < bytes) {
        if (!cuda_sync(be)) return NULL;
        cudaFreeHost(cb->ctrl_host[slot]);
        cb->ctrl_host[slot] = NULL;
        cb->ctrl_cap[slot] = 0;
        size_t cap = bytes < 4096 ? 4096 : bytes;
        if (!CUDA_OK(be, cudaMallocHost(&cb->ctrl_host[slot], cap))) return NULL;
        cb->ctrl_cap[slot] = cap;
    } else {
        /* a host wait for the device like any other: counted, whether or
         * not the copy had finished already */
        cb->counters.syncs++;
        if (!CUDA_OK(be, cudaEventSynchronize(cb->ctrl_done[slot]))) return NULL;
    }
    memcpy(cb->ctrl_host[slot], host, bytes);
    cuda_count_copy(be, true, bytes);
    if (!CUDA_OK(be, cudaMemcpyAsync(d, cb->ctrl_host[slot], bytes, cudaMemcpyHostToDevice, cb->stream))) return NULL;
    if (!CUDA_OK(be, cudaEventRecord(cb->ctrl_done[slot], cb->stream))) return NULL;
    return d;
}

/* ------------------------------------------------------------------------ */
/* Launch geometry                                                           */
/* ------------------------------------------------------------------------ */

static unsigned grid_for(int64_t n, int threads) {
    int64_t blocks = (n + threads - 1) / threads;
    if (blocks > 65535LL * 32) blocks = 65535LL * 32; /* kernels loop (grid-stride) */
    return (unsigned)(blocks > 0 ? blocks : 1);
}

/* ------------------------------------------------------------------------ */
/* Memory                                                                    */
/* ------------------------------------------------------------------------ */

static float *cuda_alloc(ds4_backend *be, int64_t n_floats) {
    cuda_backend *cb = cuda_impl(be);
    if (n_floats < 0 || (uint64_t)n_floats > SIZE_MAX / sizeof(float) - 64) return NULL;
    size_t bytes = (size_t)(n_floats > 0 ? n_floats : 1) * sizeof(float);
    void *p = NULL;
    cuda_step_break(be, "alloc");
    if (cudaMallocAsync(&p, bytes, cb->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    if (cudaMemsetAsync(p, 0, bytes, cb->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        cudaFreeAsync(p, cb->stream);
        return NULL;
    }
    note_peak(cb);
    return (float *)p;
}

static void cuda_free_buf(ds4_backend *be, float *buf) {
    if (!buf) return;
    cuda_step_break(be, "free"); /* recorded launches may still use it */
    (void)CUDA_OK(be, cudaFreeAsync(buf, cuda_stream(be)));
}

static void cuda_upload(ds4_backend *be, float *dst, const float *host_src, int64_t n) {
    if (n <= 0 || cuda_failed(be)) return;
    /* pageable source: the call returns once the data is staged, so the
     * caller may reuse host_src at once */
    cuda_step_break(be, "upload"); /* pageable memory is staged now, not when a graph runs */
    cuda_count_copy(be, true, (size_t)n * sizeof(float));
    (void)CUDA_OK(be, cudaMemcpyAsync(dst, host_src, (size_t)n * sizeof(float), cudaMemcpyHostToDevice,
                                      cuda_stream(be)));
}

#define DOWNLOAD_STAGE_MAX ((size_t)16 << 20) /* larger downloads go straight to pageable memory */

static void cuda_download(ds4_backend *be, float *host_dst, const float *src, int64_t n) {
    if (n <= 0) return;
    if (cuda_failed(be)) {
        memset(host_dst, 0, (size_t)n * sizeof(float));
        return;
    }
    cuda_backend *cb = cuda_impl(be);
    cuda_hc_settle(be); /* what is read back may be a comb */
    cuda_step_break(be, "download");
    const size_t bytes = (size_t)n * sizeof(float);
    cuda_count_copy(be, false, bytes);
    /* through a pinned buffer: the copy then runs asynchronously and the
     * host's wait is the timed sync (a copy into pageable memory would
     * block inside cudaMemcpyAsync, out of sight of the counters) */
    if (cb->dl_cap < bytes && bytes <= DOWNLOAD_STAGE_MAX) {
        if (cb->dl_host) cudaFreeHost(cb->dl_host);
        cb->dl_host = NULL;
        cb->dl_cap = 0;
        if (cudaMallocHost(&cb->dl_host, bytes) == cudaSuccess) cb->dl_cap = bytes;
        else (void)cudaGetLastError(); /* no pinned memory: straight into host_dst */
    }
    void *to = cb->dl_cap >= bytes ? cb->dl_host : (void *)host_dst;
    if (!CUDA_OK(be, cudaMemcpyAsync(to, src, bytes, cudaMemcpyDeviceToHost, cb->stream)) || !cuda_sync(be)) {
        memset(host_dst, 0, bytes); /* as after any failed op: nothing half-copied */
        return;
    }
    if (to != (void *)host_dst) memcpy(host_dst, to, bytes);
}

__global__ void copy_kernel(float *__restrict__ dst, const float *__restrict__ src, int64_t n) {
    cuda_grid_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

#define COPY_KERNEL_MAX ((int64_t)1 << 20) /* floats: smaller copies run as a kernel (no copy-engine round trip) */

/* dst = src for n floats that do not overlap. */
static bool copy_floats(ds4_backend *be, float *dst, const float *src, int64_t n) {
    if (n > COPY_KERNEL_MAX) return cuda_copy_d2d(be, dst, src, (size_t)n * sizeof(float));
    return cuda_launch(be, "copy_kernel", copy_kernel, grid_for(n, 256) < 1024 ? grid_for(n, 256) : 1024, 256, 0, dst,
                       src, n);
}

static void cuda_copy(ds4_backend *be, float *dst, const float *src, int64_t n) {
    if (n <= 0 || dst == src || cuda_failed(be)) return;
    cuda_hc_settle_touching(be, src, n); /* a deferred Sinkhorn's comb read or written */
    cuda_hc_settle_touching(be, dst, n);
    const size_t bytes = (size_t)n * sizeof(float);
    const bool overlap = dst < src + n && src < dst + n;
    if (!overlap) {
        (void)copy_floats(be, dst, src, n);
        return;
    }
    /* memmove semantics: through scratch */
    float *tmp = (float *)cuda_scratch(be, CUDA_SCRATCH_COPY, bytes);
    if (!tmp) return;
    if (copy_floats(be, tmp, src, n)) (void)copy_floats(be, dst, tmp, n);
}

/* dst row q = src row q / copies: one thread per output element. */
__global__ void repeat_rows_kernel(float *__restrict__ dst, const float *__restrict__ src, int64_t dim, int64_t copies,
                                   int64_t n) {
    cuda_grid_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = src[(i / dim / copies) * dim + i % dim];
}

static void cuda_repeat_rows(ds4_backend *be, float *dst, const float *src, int64_t n_rows, int64_t dim,
                             int64_t copies) {
    if (cuda_failed(be)) return;
    if (n_rows < 0 || dim < 0 || copies < 0) {
        cuda_fail(be, DS4_ERR_INVALID, "repeat_rows: %lld rows of %lld, %lld copies", (long long)n_rows,
                  (long long)dim, (long long)copies);
        return;
    }
    const int64_t n = n_rows * dim * copies;
    if (n == 0) return;
    const unsigned blocks = grid_for(n, 256) < 4096 ? grid_for(n, 256) : 4096;
    (void)cuda_launch(be, "repeat_rows_kernel", repeat_rows_kernel, blocks, 256, 0, dst, src, dim, copies, n);
}

/* Copy i = blockIdx.x of n: width floats from ptrs[n + i] to ptrs[i]. */
__global__ void copy_rows_kernel(const uint64_t *__restrict__ ptrs, int64_t n, int64_t width) {
    cuda_grid_wait();
    float *dst = (float *)ptrs[blockIdx.x];
    const float *src = (const float *)ptrs[n + blockIdx.x];
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

const uint64_t *cuda_upload_pointer_pairs(ds4_backend *be, cuda_scratch_slot slot, const void *const *a,
                                          const void *const *b, int64_t n, const char *op) {
    uint64_t *host = (uint64_t *)malloc((size_t)(2 * n) * sizeof *host);
    if (!host) {
        cuda_fail(be, DS4_ERR_NOMEM, "%s: out of host memory for %lld pointers", op, (long long)(2 * n));
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        host[i] = (uint64_t)(uintptr_t)a[i];
        host[n + i] = (uint64_t)(uintptr_t)b[i];
    }
    const uint64_t *table = (const uint64_t *)cuda_upload_ctrl(be, slot, host, (size_t)(2 * n) * sizeof *host);
    free(host);
    return table;
}

static void cuda_copy_rows(ds4_backend *be, float *const *dst, const float *const *src, int64_t width, int64_t n) {
    if (cuda_failed(be)) return;
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (width < 0 || n > INT32_MAX) ds4_error_set(&err, DS4_ERR_INVALID, "copy_rows: %lld copies of %lld", (long long)n, (long long)width);
    else ds4_pointer_pairs_valid("copy_rows", "copy", (const void *const *)dst, "destination",
                                 (const void *const *)src, "source", n, &err);
    if (err.status) {
        cuda_fail(be, err.status, "%s", err.message);
        return;
    }
    if (n == 0 || width == 0) return;
    for (int64_t i = 0; i < n; i++) {
        cuda_hc_settle_touching(be, src[i], width);
        cuda_hc_settle_touching(be, dst[i], width);
    }
    const uint64_t *table = cuda_upload_pointer_pairs(be, CUDA_SCRATCH_COPY_ROWS, (const void *const *)dst,
                                                      (const void *const *)src, n, "copy_rows");
    if (!table) return;
    (void)cuda_launch(be, "copy_rows_kernel", copy_rows_kernel, (unsigned)n, 256, 0, table, n, width);
}

__global__ void fill_kernel(float *dst, float v, int64_t n) {
    cuda_grid_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = v;
}

static void cuda_fill(ds4_backend *be, float *dst, float value, int64_t n) {
    if (n <= 0 || cuda_failed(be)) return;
    cuda_hc_settle_touching(be, dst, n);
    (void)cuda_launch(be, "fill_kernel", fill_kernel, grid_for(n, 256), 256, 0, dst, value, n);
}

/* ------------------------------------------------------------------------ */
/* Weights                                                                   */
/* ------------------------------------------------------------------------ */

static bool is_integer_type(uint32_t type) {
    return type == DS4_TYPE_I8 || type == DS4_TYPE_I16 || type == DS4_TYPE_I32 || type == DS4_TYPE_I64;
}

#define STAGE_BYTES ((size_t)64 << 20)

/* Host bytes (pageable, e.g. a file mapping) to device memory through the
 * two pinned staging buffers: filling one overlaps the DMA out of the other. */
static ds4_status upload_bytes(cuda_backend *cb, void *dst, const void *src, size_t bytes, ds4_error *err) {
    for (int i = 0; i < 2; i++) {
        if (!cb->wstage[i]) {
            DS4_CUDA_CHECK(cudaMallocHost(&cb->wstage[i], STAGE_BYTES), err);
        }
    }
    size_t off = 0;
    int k = 0;
    while (off < bytes) {
        const size_t len = bytes - off < STAGE_BYTES ? bytes - off : STAGE_BYTES;
        DS4_CUDA_CHECK(cudaEventSynchronize(cb->wstage_done[k]), err); /* the previous DMA out of it */
        memcpy(cb->wstage[k], (const uint8_t *)src + off, len);
        DS4_CUDA_CHECK(cudaMemcpyAsync((uint8_t *)dst + off, cb->wstage[k], len, cudaMemcpyHostToDevice, cb->upload),
                       err);
        DS4_CUDA_CHECK(cudaEventRecord(cb->wstage_done[k], cb->upload), err);
        off += len;
        k ^= 1;
    }
    DS4_CUDA_CHECK(cudaStreamSynchronize(cb->upload), err);
    return DS4_OK;
}

/* What binding any weight checks: a type this backend computes with (or an
 * integer table, kept on the host), whole rows, a size that fits; *bytes is
 * its device size (0 for integer tables). */
static ds4_status weight_fits(const ds4_weight *w, size_t *bytes, ds4_error *err) {
    const char *name = cuda_wname(w);
    *bytes = 0;
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    if (!t || (!t->dequant_row && !is_integer_type(w->type)))
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "cuda backend: weight %s has type %s, which it cannot compute "
                             "with", name, ds4_type_name(w->type));
    /* Integer tables (token -> expert) are read on the host by the model. */
    if (is_integer_type(w->type)) return DS4_OK;
    if (!ds4_cuda_dequant_supported(w->type))
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "cuda backend: no kernels for weight %s of type %s", name,
                             ds4_type_name(w->type));
    const int64_t expect = ds4_type_row_bytes(w->type, w->ne[0]);
    if (expect <= 0 || w->row_bytes != expect)
        return ds4_error_set(err, DS4_ERR_INVALID, "cuda backend: weight %s (%s, %lld per row) has row_bytes %lld, "
                             "not %lld", name, t->name, (long long)w->ne[0], (long long)w->row_bytes,
                             (long long)expect);
    const int64_t rows = cuda_weight_rows(w);
    if (rows < 0 || (rows > 0 && w->row_bytes > INT64_MAX / rows))
        return ds4_error_set(err, DS4_ERR_INVALID, "cuda backend: weight %s is too large", name);
    *bytes = (size_t)(w->row_bytes * rows);
    return DS4_OK;
}

/* Device memory for a weight of `bytes`, or DS4_ERR_NOMEM saying how much is held and free. */
static ds4_status weight_alloc(cuda_backend *cb, const char *name, size_t bytes, void **d, ds4_error *err) {
    *d = NULL;
    cudaError_t e = cudaMalloc(d, bytes ? bytes : 1);
    if (e == cudaSuccess) return DS4_OK;
    (void)cudaGetLastError();
    *d = NULL;
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    (void)cudaGetLastError();
    return ds4_error_set(err, DS4_ERR_NOMEM, "cuda backend: out of device memory for weight %s (%.1f MiB; %.1f "
                         "GiB already bound, %.1f GiB free)", name, (double)bytes / 1048576.0,
                         (double)cb->weight_bytes / 1073741824.0, (double)free_b / 1073741824.0);
}

static ds4_status cuda_bind_weight(ds4_backend *be, ds4_weight *w, ds4_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const char *name = cuda_wname(w);
    w->device = NULL;
    size_t bytes;
    ds4_status st = weight_fits(w, &bytes, err);
    if (st || is_integer_type(w->type)) return st;
    if (!w->host) return ds4_error_set(err, DS4_ERR_INVALID, "cuda backend: weight %s has no data", name);
    void *d;
    if ((st = weight_alloc(cb, name, bytes, &d, err))) return st;
    st = upload_bytes(cb, d, w->host, bytes, err);
    if (st) {
        cudaFree(d);
        return ds4_error_prefix(err, "cuda backend: uploading weight %s", name);
    }
    w->device = d;
    cb->weight_bytes += bytes;
    note_peak(cb);
    return DS4_OK;
}

/* Blocks [0, n_blocks) of a synthetic weight, one per thread. */
static __global__ void synth_fill_kernel(ds4_fill f, int64_t n_blocks, uint8_t *dst) {
    cuda_grid_wait();
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < n_blocks; b += step)
        ds4_fill_block(&f, b, dst + b * f.block_bytes);
}

/* Synthetic weights are made where they are kept: blocks on the device by
 * synth_fill_kernel (nothing crosses the bus), integer tables on the host. */
static ds4_status cuda_bind_synthetic(ds4_backend *be, ds4_weight *w, const ds4_fill *fill, ds4_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const char *name = cuda_wname(w);
    w->device = NULL;
    size_t bytes;
    ds4_status st = weight_fits(w, &bytes, err);
    if (st) return st;
    const ds4_type_traits *t = ds4_type_traits_get(w->type);
    if (!fill || fill->type != w->type || !ds4_fill_type_ok(w->type) || fill->block_bytes != t->block_bytes)
        return ds4_error_set(err, DS4_ERR_INVALID, "cuda backend: synthetic weight %s (%s) does not match its fill",
                             name, ds4_type_name(w->type));
    if (is_integer_type(w->type)) {
        void *buf = ds4_fill_host_bytes(w, fill, "cuda backend", err);
        if (!buf) return err->status;
        w->host = buf;
        w->owned = buf;
        return DS4_OK;
    }
    void *d;
    if ((st = weight_alloc(cb, name, bytes, &d, err))) return st;
    const int64_t n_blocks = (int64_t)(bytes / (size_t)t->block_bytes);
    const int64_t grid = n_blocks / 256 + 1 < 16384 ? n_blocks / 256 + 1 : 16384;
    if (!cuda_launch(be, "synth_fill_kernel", synth_fill_kernel, (unsigned)grid, 256, 0, *fill, n_blocks,
                     (uint8_t *)d) ||
        !CUDA_OK(be, cudaStreamSynchronize(cb->stream)) || cuda_failed(be)) {
        cudaFree(d);
        if (!cuda_take_error(be, err)) ds4_error_set(err, DS4_ERR_DEVICE, "the synthetic fill kernel failed");
        return ds4_error_prefix(err, "cuda backend: making synthetic weight %s", name);
    }
    w->device = d;
    cb->weight_bytes += bytes;
    note_peak(cb);
    return DS4_OK;
}

static void cuda_release_weight(ds4_backend *be, ds4_weight *w) {
    if (w->owned) {
        if (w->host == w->owned) w->host = NULL;
        free(w->owned);
        w->owned = NULL;
    }
    if (!w->device) return;
    cuda_backend *cb = cuda_impl(be);
    (void)cuda_sync(be);
    const size_t bytes = (size_t)(w->row_bytes * cuda_weight_rows(w));
    cudaFree(w->device);
    cb->weight_bytes -= bytes < cb->weight_bytes ? bytes : cb->weight_bytes;
    w->device = NULL;
}

/* A weight row dequantised into CUDA_SCRATCH_COPY (floats), or NULL (error recorded). */
static float *weight_row_floats(ds4_backend *be, const ds4_weight *w, int64_t row, int64_t n_rows, const char *op) {
    if (!w->device) {
        cuda_fail(be, DS4_ERR_INVALID, "%s: weight %s is not bound", op, cuda_wname(w));
        return NULL;
    }
    float *tmp = (float *)cuda_scratch(be, CUDA_SCRATCH_COPY, (size_t)(n_rows * w->ne[0]) * sizeof(float));
    if (!tmp) return NULL;
    char what[160];
    snprintf(what, sizeof what, "%s: %s", op, cuda_wname(w));
    if (!cuda_dequant_weight_rows(be, w->type, cuda_weight_row(w, row), tmp, n_rows, w->ne[0], what)) return NULL;
    return tmp;
}

/* ------------------------------------------------------------------------ */
/* Embedding, norms, elementwise                                             */
/* ------------------------------------------------------------------------ */

__global__ void embed_float_kernel(const void *table, uint32_t type, const int32_t *tokens, int n, int64_t dim,
                                   float *out) {
    cuda_grid_wait();
    const int r = blockIdx.y;
    const int64_t base = (int64_t)tokens[r] * dim;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < dim; i += (int64_t)gridDim.x * blockDim.x)
        out[(int64_t)r * dim + i] = cuda_load_float(table, type, base + i);
}

static void cuda_embed(ds4_backend *be, const ds4_weight *table, const int32_t *tokens, int n, float *out) {
    if (n <= 0 || cuda_failed(be)) return;
    const int64_t dim = table->ne[0], vocab = cuda_weight_rows(table);
    if (!table->device || !ds4_cuda_dequant_supported(table->type)) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "embed: table %s has type %s", cuda_wname(table),
                  ds4_type_name(table->type));
        return;
    }
    for (int r = 0; r < n; r++) {
        if (tokens[r] < 0 || tokens[r] >= vocab) {
            cuda_fail(be, DS4_ERR_INVALID, "embed: token id %d is outside the vocabulary of %s (%lld rows)",
                      tokens[r], cuda_wname(table), (long long)vocab);
            return;
        }
    }
    if (cuda_is_float_type(table->type)) {
        const int32_t *d_tok = (const int32_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_CTRL, tokens, (size_t)n * 4);
        if (!d_tok) return;
        dim3 grid(grid_for(dim, 256) < 64 ? grid_for(dim, 256) : 64, (unsigned)n);
        (void)cuda_launch(be, "embed_float_kernel", embed_float_kernel, grid, 256, 0, table->device, table->type,
                          d_tok, n, dim, out);
        return;
    }
    for (int r = 0; r < n; r++) /* quantised tables: one dequant per row */
        if (!cuda_dequant_weight_rows(be, table->type, cuda_weight_row(table, tokens[r]), out + (int64_t)r * dim, 1,
                                      dim, "embed"))
            return;
}

/* One block per row: sum of squares in double (block reduction), then
 * y = x * scale * w in float, scale = 1 / sqrtf(float(ss / dim) + eps).
 * Rows of at most NORM_CACHED floats that start 16-byte aligned (CACHED)
 * are read once, with every load in flight before the sum waits on one,
 * and kept in registers for the scaling (rms_load_row, cuda_rows.cuh; the
 * norm weight's values are loaded with them, rms_load_weight);
 * other rows are read twice. The two paths add the squares in different
 * orders (either differs from the CPU's only in that). */

template <bool CACHED>
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_kernel(const float *x, const float *w, float eps, float *out, int64_t dim) {
    cuda_grid_wait();
    __shared__ double part[NORM_THREADS / 32];
    const int64_t r = blockIdx.x;
    const float *xr = x + r * dim;
    float *yr = out + r * dim;
    float4 v[NORM_VEC];
    if (CACHED) { /* x is in registers: out may be x */
        rms_load_row(xr, dim, v);
        float wv[NORM_VEC][4];
        rms_load_weight(w, dim, wv); /* in flight with the row */
        rms_scale_store(v, wv, w != NULL, dim, eps, part, yr);
        return;
    }
    double ss = 0.0;
    for (int64_t i = threadIdx.x; i < dim; i += NORM_THREADS) ss += (double)xr[i] * (double)xr[i];
    const float scale = rms_scale_of(ss, dim, eps, part);
    __syncthreads(); /* every thread has read part[0] before any row is written (out may be x) */
    for (int64_t i = threadIdx.x; i < dim; i += NORM_THREADS) {
        const float t = __fmul_rn(xr[i], scale);
        yr[i] = w ? __fmul_rn(t, w[i]) : t;
    }
}

bool cuda_norm_weight_floats(ds4_backend *be, const ds4_weight *w, int64_t dim, const char *op, const float **wv) {
    *wv = NULL;
    if (!w) return true;
    if (!w->device || !ds4_cuda_dequant_supported(w->type) || w->ne[0] != dim) {
        cuda_fail(be, DS4_ERR_INVALID, "%s: weight %s (%s, %lld wide) does not fit rows of %lld", op, cuda_wname(w),
                  ds4_type_name(w->type), (long long)w->ne[0], (long long)dim);
        return false;
    }
    if (w->type == DS4_TYPE_F32) *wv = (const float *)w->device;
    else *wv = weight_row_floats(be, w, 0, 1, op);
    return *wv != NULL;
}

static void cuda_rmsnorm(ds4_backend *be, const float *x, const ds4_weight *w, float eps, float *out, int64_t n_rows,
                         int64_t dim) {
    if (dim <= 0 || n_rows <= 0 || cuda_failed(be)) return;
    const float *wv;
    if (!cuda_norm_weight_floats(be, w, dim, "rmsnorm", &wv)) return;
    if (n_rows > 0x7fffffffLL) {
        cuda_fail(be, DS4_ERR_INVALID, "rmsnorm: %lld rows", (long long)n_rows);
        return;
    }
    const bool cached = dim % 4 == 0 && dim <= NORM_CACHED && (uintptr_t)x % 16 == 0 && (uintptr_t)out % 16 == 0;
    (void)cuda_launch(be, "rmsnorm_kernel", cached ? rmsnorm_kernel<true> : rmsnorm_kernel<false>, (unsigned)n_rows,
                      NORM_THREADS, 0, x, wv, eps, out, dim);
}

static void cuda_round_f16(ds4_backend *be, float *x, int64_t n);
static void cuda_round_fp8_kv(ds4_backend *be, float *x, int64_t n_rows, int64_t dim, int64_t n_rope);

/* One fused kernel where the backend's setting asks for it and the heads
 * suit it (cuda_head_norm_rope_fused), else the ops it stands for. */
static void cuda_head_norm_rope(ds4_backend *be, float *x, int64_t n_rows, int64_t n_heads, int64_t head_dim,
                                const ds4_weight *w, float eps, const int32_t *pos, const ds4_rope *rope,
                                bool round_kv) {
    if (cuda_failed(be)) return;
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (!ds4_head_norm_rope_valid(x, n_rows, n_heads, head_dim, w, pos, rope, &err)) {
        cuda_fail(be, err.status, "%s", err.message);
        return;
    }
    if (n_rows == 0) return;
    if (cuda_impl(be)->norm_rope && cuda_head_norm_rope_fits(x, n_rows, n_heads, head_dim)) {
        const float *wv;
        if (!cuda_norm_weight_floats(be, w, head_dim, "head_norm_rope", &wv)) return;
        cuda_head_norm_rope_fused(be, x, n_rows, n_heads, head_dim, wv, eps, pos, rope, round_kv);
        return;
    }
    cuda_rmsnorm(be, x, w, eps, x, n_rows * n_heads, head_dim);
    cuda_rope_tail(be, x, n_rows, n_heads, head_dim, pos, rope, false);
    if (round_kv) {
        cuda_round_fp8_kv(be, x, n_rows * n_heads, head_dim, rope->n_rot);
        cuda_round_f16(be, x, n_rows * n_heads * head_dim);
    }
}

/* head_norm_rope of a, then of b: one kernel where both suit the fused one
 * (and the settings allow it: DS4_CUDA_NORM_ROPE, DS4_CUDA_NORM_ROPE2), else
 * the two ops. */
static void cuda_head_norm_rope2(ds4_backend *be, const ds4_head_rows *a, const ds4_head_rows *b, int64_t n_rows,
                                 int64_t head_dim, float eps, const int32_t *pos, const ds4_rope *rope) {
    if (cuda_failed(be)) return;
    if (!a || !b) {
        cuda_fail(be, DS4_ERR_INVALID, "head_norm_rope2: a NULL row set");
        return;
    }
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (!ds4_head_norm_rope_valid(a->x, n_rows, a->n_heads, head_dim, a->w, pos, rope, &err) ||
        !ds4_head_norm_rope_valid(b->x, n_rows, b->n_heads, head_dim, b->w, pos, rope, &err)) {
        cuda_fail(be, err.status, "%s", err.message);
        return;
    }
    if (n_rows == 0) return;
    const int64_t na = n_rows * a->n_heads * head_dim, nb = n_rows * b->n_heads * head_dim;
    if (a->x < b->x + nb && b->x < a->x + na) {
        cuda_fail(be, DS4_ERR_INVALID, "head_norm_rope2: the two row sets overlap");
        return;
    }
    /* (a weight other than F32 is converted into one scratch slot: two such
     * weights cannot both be held for one kernel) */
    const bool both_converted = a->w && b->w && a->w->type != DS4_TYPE_F32 && b->w->type != DS4_TYPE_F32;
    if (cuda_impl(be)->norm_rope && cuda_impl(be)->norm_rope2 && !both_converted &&
        cuda_head_norm_rope_fits(a->x, n_rows, a->n_heads, head_dim) &&
        cuda_head_norm_rope_fits(b->x, n_rows, b->n_heads, head_dim) &&
        n_rows * (a->n_heads + b->n_heads) <= INT32_MAX) {
        const float *wa, *wb;
        if (!cuda_norm_weight_floats(be, a->w, head_dim, "head_norm_rope2", &wa)) return;
        if (!cuda_norm_weight_floats(be, b->w, head_dim, "head_norm_rope2", &wb)) return;
        cuda_head_norm_rope2_fused(be, a->x, a->n_heads, wa, a->round_kv, b->x, b->n_heads, wb, b->round_kv, n_rows,
                                   head_dim, eps, pos, rope);
        return;
    }
    cuda_head_norm_rope(be, a->x, n_rows, a->n_heads, head_dim, a->w, eps, pos, rope, a->round_kv);
    cuda_head_norm_rope(be, b->x, n_rows, b->n_heads, head_dim, b->w, eps, pos, rope, b->round_kv);
}

__global__ void add_kernel(const float *a, const float *b, float *out, int64_t n) {
    cuda_grid_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __fadd_rn(a[i], b[i]);
}

static void cuda_add(ds4_backend *be, const float *a, const float *b, float *out, int64_t n) {
    if (n <= 0 || cuda_failed(be)) return;
    (void)cuda_launch(be, "add_kernel", add_kernel, grid_for(n, 256), 256, 0, a, b, out, n);
}

/* x[i] += row[i % dim], the row F32, F16 or BF16 (converted exactly, as
 * the dequantiser would). */
__global__ void add_row_kernel(float *x, const void *row, uint32_t type, int64_t dim, int64_t n) {
    cuda_grid_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = __fadd_rn(x[i], cuda_load_float(row, type, i % dim));
}

static void cuda_add_weight_row(ds4_backend *be, float *x, const ds4_weight *w, int64_t row, int64_t n_rows) {
    if (cuda_failed(be)) return;
    const int64_t dim = w->ne[0];
    if (!w->device || !ds4_cuda_dequant_supported(w->type) || row < 0 || row >= cuda_weight_rows(w)) {
        cuda_fail(be, DS4_ERR_INVALID, "add_weight_row: row %lld of %s (%s, %lld rows)", (long long)row,
                  cuda_wname(w), ds4_type_name(w->type), (long long)cuda_weight_rows(w));
        return;
    }
    if (n_rows <= 0) return;
    /* float rows are read in place (one kernel); others are dequantised first */
    const bool in_place = cuda_is_float_type(w->type);
    const void *v = in_place ? (const void *)cuda_weight_row(w, row)
                             : (const void *)weight_row_floats(be, w, row, 1, "add_weight_row");
    if (!v) return;
    (void)cuda_launch(be, "add_row_kernel", add_row_kernel, grid_for(n_rows * dim, 256), 256, 0, x, v,
                      in_place ? w->type : (uint32_t)DS4_TYPE_F32, dim, n_rows * dim);
}

/* x[r][i] += W row (first + r) mod R [i]: one thread per element. */
__global__ void add_rows_mod_kernel(float *x, const void *w, uint32_t type, int64_t dim, int64_t R, int64_t first,
                                    int64_t n) {
    cuda_grid_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / dim;
        x[i] = __fadd_rn(x[i], cuda_load_float(w, type, ((first + r) % R) * dim + i % dim));
    }
}

static void cuda_add_weight_rows_mod(ds4_backend *be, float *x, const ds4_weight *w, int64_t first, int64_t n_rows) {
    if (cuda_failed(be)) return;
    const int64_t dim = w->ne[0], R = cuda_weight_rows(w);
    if (!w->device || !ds4_cuda_dequant_supported(w->type) || R < 1 || first < 0 || first >= R) {
        cuda_fail(be, DS4_ERR_INVALID, "add_weight_rows_mod: from row %lld of %s (%s, %lld rows)", (long long)first,
                  cuda_wname(w), ds4_type_name(w->type), (long long)R);
        return;
    }
    if (n_rows <= 0) return;
    /* float tables are read in place; others are dequantised first (every row) */
    const bool in_place = cuda_is_float_type(w->type);
    const void *v = in_place ? (const void *)cuda_weight_row(w, 0)
                             : (const void *)weight_row_floats(be, w, 0, R, "add_weight_rows_mod");
    if (!v) return;
    (void)cuda_launch(be, "add_rows_mod_kernel", add_rows_mod_kernel, grid_for(n_rows * dim, 256), 256, 0, x, v,
                      in_place ? w->type : (uint32_t)DS4_TYPE_F32, dim, R, first, n_rows * dim);
}

/* x[r][i] += W row idx[r] [i]: one thread per element. */
__global__ void add_rows_idx_kernel(float *x, const void *w, uint32_t type, int64_t dim, const int32_t *idx, int64_t n) {
    cuda_grid_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = __fadd_rn(x[i], cuda_load_float(w, type, (int64_t)idx[i / dim] * dim + i % dim));
}

static void cuda_add_weight_rows_at(ds4_backend *be, float *x, const ds4_weight *w, const int64_t *rows,
                                    int64_t n_rows) {
    if (cuda_failed(be)) return;
    const int64_t dim = w->ne[0], R = cuda_weight_rows(w);
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (!w->device || !ds4_cuda_dequant_supported(w->type) || n_rows > INT32_MAX) {
        cuda_fail(be, DS4_ERR_INVALID, "add_weight_rows_at: %lld rows of %s (%s%s)", (long long)n_rows, cuda_wname(w),
                  ds4_type_name(w->type), w->device ? "" : ", not bound");
        return;
    }
    if (!ds4_table_rows_valid("add_weight_rows_at", cuda_wname(w), rows, n_rows, R, &err)) {
        cuda_fail(be, err.status, "%s", err.message);
        return;
    }
    if (n_rows == 0 || dim == 0) return;
    int32_t *h = (int32_t *)malloc((size_t)n_rows * sizeof *h);
    if (!h) {
        cuda_fail(be, DS4_ERR_NOMEM, "add_weight_rows_at: out of host memory");
        return;
    }
    for (int64_t r = 0; r < n_rows; r++) h[r] = (int32_t)rows[r];
    const int32_t *idx = (const int32_t *)cuda_upload_ctrl(be, CUDA_SCRATCH_ROW_IDX, h, (size_t)n_rows * sizeof *h);
    free(h);
    if (!idx) return;
    /* float tables are read in place; others are dequantised first (every row) */
    const bool in_place = cuda_is_float_type(w->type);
    const void *v = in_place ? (const void *)cuda_weight_row(w, 0)
                             : (const void *)weight_row_floats(be, w, 0, R, "add_weight_rows_at");
    if (!v) return;
    (void)cuda_launch(be, "add_rows_idx_kernel", add_rows_idx_kernel, grid_for(n_rows * dim, 256), 256, 0, x, v,
                      in_place ? w->type : (uint32_t)DS4_TYPE_F32, dim, idx, n_rows * dim);
}

/* ------------------------------------------------------------------------ */
/* Rounding (bit-identical to src/core/rounding.c)                           */
/* ------------------------------------------------------------------------ */

__global__ void round_f16_kernel(float *x, int64_t n) {
    cuda_grid_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        x[i] = round_f16_value(x[i]);
    }
}

static void cuda_round_f16(ds4_backend *be, float *x, int64_t n) {
    if (n <= 0 || cuda_failed(be)) return;
    (void)cuda_launch(be, "round_f16_kernel", round_f16_kernel, grid_for(n, 256), 256, 0, x, n);
}

/* One warp per block of up to 64 (FP8) or 32 (FP4) values. */
template <int BLOCK, int FP4>
__global__ void round_blocks_kernel(float *x, int64_t n_rows, int64_t dim, int64_t n_round, int64_t blocks_per_row,
                                    float amax_floor, float max_mag) {
    cuda_grid_wait();
    const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= n_rows * blocks_per_row) return; /* whole warps exit together */
    const int64_t r = warp / blocks_per_row, b = warp % blocks_per_row;
    float *p = x + r * dim + b * BLOCK;
    const int64_t len = n_round - b * BLOCK < BLOCK ? n_round - b * BLOCK : BLOCK;
    constexpr int PER = BLOCK / 32;
    float v[PER];
    float amax = 0.0f;
    for (int j = 0; j < PER; j++) {
        const int64_t i = lane + 32 * j;
        v[j] = i < len ? p[i] : 0.0f;
        const float a = fabsf(v[j]);
        if (i < len && a > amax) amax = a; /* NaN never compares greater */
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, amax, o);
        if (other > amax) amax = other;
    }
    const float scale = block_scale_of(amax, amax_floor, max_mag);
    for (int j = 0; j < PER; j++) {
        const int64_t i = lane + 32 * j;
        if (i < len) p[i] = round_block_value<FP4>(v[j], scale, max_mag);
    }
}

static void cuda_round_fp8_kv(ds4_backend *be, float *x, int64_t n_rows, int64_t dim, int64_t n_rope) {
    if (cuda_failed(be)) return;
    if (n_rope < 0 || n_rope > dim) {
        cuda_fail(be, DS4_ERR_INVALID, "round_fp8_kv: %lld RoPE dims in rows of %lld", (long long)n_rope,
                  (long long)dim);
        return;
    }
    const int64_t n_round = dim - n_rope, bpr = (n_round + KV_FP8_BLOCK - 1) / KV_FP8_BLOCK;
    if (n_rows <= 0 || bpr == 0) return;
    const int64_t threads = n_rows * bpr * 32;
    (void)cuda_launch(be, "round_blocks_kernel<fp8>", round_blocks_kernel<KV_FP8_BLOCK, 0>, grid_for(threads, 256), 256,
                      0, x, n_rows, dim, n_round, bpr, KV_FP8_FLOOR, KV_FP8_MAX);
}

/* In-place Walsh-Hadamard of each row (one block per row, in shared memory),
 * butterflies in rounding.c's order, then times norm. */
__global__ void hadamard_kernel(float *x, int64_t dim, float norm) {
    cuda_grid_wait();
    extern __shared__ float sh[];
    float *row = x + (int64_t)blockIdx.x * dim;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sh[i] = row[i];
    __syncthreads();
    for (int64_t stride = 1; stride < dim; stride <<= 1) {
        for (int64_t k = threadIdx.x; k < dim / 2; k += blockDim.x) {
            const int64_t base = (k / stride) * 2 * stride, i = k % stride;
            const float a = sh[base + i], b = sh[base + stride + i];
            sh[base + i] = __fadd_rn(a, b);
            sh[base + stride + i] = __fsub_rn(a, b);
        }
        __syncthreads();
    }
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) row[i] = __fmul_rn(sh[i], norm);
}

static void cuda_indexer_qat(ds4_backend *be, float *x, int64_t n_rows, int64_t dim) {
    if (cuda_failed(be)) return;
    if (dim < 1 || (dim & (dim - 1)) != 0) {
        cuda_fail(be, DS4_ERR_INVALID, "indexer_qat: row width %lld is not a power of two", (long long)dim);
        return;
    }
    if (n_rows <= 0) return;
    if (dim > 8192 || n_rows > 0x7fffffffLL) {
        cuda_fail(be, DS4_ERR_UNSUPPORTED, "indexer_qat: rows of %lld (at most 8192 on the GPU)", (long long)dim);
        return;
    }
    const float norm = (float)(1.0 / sqrt((double)dim));
    if (!cuda_launch(be, "hadamard_kernel", hadamard_kernel, (unsigned)n_rows, 256, (size_t)dim * sizeof(float), x,
                     dim, norm))
        return;
    const int64_t bpr = (dim + 31) / 32;
    (void)cuda_launch(be, "round_blocks_kernel<fp4>", round_blocks_kernel<32, 1>, grid_for(n_rows * bpr * 32, 256),
                      256, 0, x, n_rows, dim, dim, bpr, 7.052966104933725e-38f, 6.0f);
}

/* ------------------------------------------------------------------------ */
/* The table and the constructor                                             */
/* ------------------------------------------------------------------------ */

static const ds4_backend_ops CUDA_OPS = {
    .name = "cuda",
    .numerics = 1u << DS4_NUMERICS_DS4 | 1u << DS4_NUMERICS_REFERENCE, /* not yet DS4_F16's products */
    .alloc = cuda_alloc,
    .free = cuda_free_buf,
    .upload = cuda_upload,
    .download = cuda_download,
    .copy = cuda_copy,
    .fill = cuda_fill,
    .repeat_rows = cuda_repeat_rows,
    .copy_rows = cuda_copy_rows,
    .bind_weight = cuda_bind_weight,
    .bind_synthetic = cuda_bind_synthetic,
    .release_weight = cuda_release_weight,
    .embed = cuda_embed,
    .rmsnorm = cuda_rmsnorm,
    .add = cuda_add,
    .add_weight_row = cuda_add_weight_row,
    .add_weight_rows_mod = cuda_add_weight_rows_mod,
    .add_weight_rows_at = cuda_add_weight_rows_at,
    .round_f16 = cuda_round_f16,
    .round_fp8_kv = cuda_round_fp8_kv,
    .indexer_qat = cuda_indexer_qat,
    .matmul = cuda_matmul,
    .matmul_multi = cuda_matmul_multi,
    .matmul_grouped = cuda_matmul_grouped,
    .rope_matmul_grouped = cuda_rope_matmul_grouped,
    .rope_tail = cuda_rope_tail,
    .head_norm_rope = cuda_head_norm_rope,
    .head_norm_rope2 = cuda_head_norm_rope2,
    .hc_pre = cuda_hc_pre,
    .hc_pre_norm = cuda_hc_pre_norm,
    .hc_post = cuda_hc_post,
    .hc_post_pre_norm = cuda_hc_post_pre_norm,
    .hc_head = cuda_hc_head,
    .attention = cuda_attention,
    .attention_rows = cuda_attention_rows,
    .attention_states = cuda_attention_states,
    .attention_rows_sel = cuda_attention_rows_sel,
    .attention_rows_f16 = cuda_attention_rows_f16,
    .compressor_pool = cuda_compressor_pool,
    .compressor_pool_states = cuda_compressor_pool_states,
    .indexer_scores = cuda_indexer_scores,
    .top_k = cuda_top_k,
    .indexer_scores_rows = cuda_indexer_scores_rows,
    .top_k_rows = cuda_top_k_rows,
    .indexer_scores_rows_f16 = cuda_indexer_scores_rows_f16,
    .router = cuda_router,
    .swiglu = cuda_swiglu,
    .moe = cuda_moe,
    .step_begin = cuda_step_begin,
    .step_end = cuda_step_end,
    .step_mark = cuda_step_mark,
    .branch_begin = cuda_branch_begin,
    .branch_end = cuda_branch_end,
    .branch_join = cuda_branch_join,
    .prefetch = cuda_prefetch,
    .take_error = cuda_take_error,
};

extern "C" ds4_status ds4_cuda_backend_create(int device, ds4_backend **out, ds4_error *err) {
    *out = NULL;
    int n = 0;
    ds4_status st = ds4_cuda_probe(&n, err);
    if (st) return ds4_error_prefix(err, "cuda backend");
    if (device < 0 || device >= n)
        return ds4_error_set(err, DS4_ERR_INVALID, "cuda backend: no device %d (%d present)", device, n);
    DS4_CUDA_CHECK(cudaSetDevice(device), err);
    cudaDeviceProp prop;
    DS4_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), err);
    if (prop.major < 9)
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "cuda backend: %s has compute capability %d.%d; this build "
                             "needs 9.0 or newer", prop.name, prop.major, prop.minor);
    ds4_backend *be = (ds4_backend *)calloc(1, sizeof *be);
    cuda_backend *cb = (cuda_backend *)calloc(1, sizeof *cb);
    if (!be || !cb) {
        free(be);
        free(cb);
        return ds4_error_set(err, DS4_ERR_NOMEM, "cuda backend: out of memory");
    }
    cb->device = device;
    be->ops = &CUDA_OPS;
    be->impl = cb;
    st = DS4_OK;
    DS4_CUDA_TRY(st, cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking), err, fail);
    DS4_CUDA_TRY(st, cudaStreamCreateWithFlags(&cb->upload, cudaStreamNonBlocking), err, fail);
    for (int i = 0; i < 2; i++)
        DS4_CUDA_TRY(st, cudaEventCreateWithFlags(&cb->wstage_done[i], cudaEventDisableTiming), err, fail);
    for (int i = 0; i < CUDA_SCRATCH_SLOTS; i++)
        DS4_CUDA_TRY(st, cudaEventCreateWithFlags(&cb->ctrl_done[i], cudaEventDisableTiming), err, fail);
    DS4_CUDA_TRY(st, cudaEventCreateWithFlags(&cb->ring_lap, cudaEventDisableTiming), err, fail);
    DS4_CUDA_TRY(st, cudaMallocHost((void **)&cb->ring_host, CUDA_CTRL_RING), err, fail);
    DS4_CUDA_TRY(st, cudaMalloc((void **)&cb->ring_dev, CUDA_CTRL_RING), err, fail);
    DS4_CUDA_TRY(st, cudaMalloc((void **)&cb->dev_error, sizeof *cb->dev_error), err, fail);
    DS4_CUDA_TRY(st, cudaMemsetAsync(cb->dev_error, 0, sizeof *cb->dev_error, cb->stream), err, fail);
    DS4_CUDA_TRY(st, cudaMallocHost((void **)&cb->dev_error_host, sizeof *cb->dev_error_host), err, fail);
    if ((st = cuda_launch_init(cb, err)) != DS4_OK) goto fail;
    if ((st = cuda_prefetch_init(cb, err)) != DS4_OK) goto fail;
    memset(cb->dev_error_host, 0, sizeof *cb->dev_error_host);
    {
        /* keep freed pool blocks for reuse instead of returning them at every sync */
        cudaMemPool_t pool;
        DS4_CUDA_TRY(st, cudaDeviceGetDefaultMemPool(&pool, device), err, fail);
        uint64_t threshold = UINT64_MAX;
        DS4_CUDA_TRY(st, cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold), err, fail);
    }
    note_peak(cb);
    *out = be;
    return DS4_OK;
fail:
    ds4_cuda_backend_free(be);
    return st;
}

extern "C" void ds4_cuda_backend_free(ds4_backend *be) {
    if (!be) return;
    cuda_backend *cb = cuda_impl(be);
    if (cb->stream) cudaStreamSynchronize(cb->stream);
    cuda_launch_free(cb);
    cuda_prefetch_free(cb);
    for (int i = 0; i < CUDA_SCRATCH_SLOTS; i++) {
        cudaFree(cb->scratch[i]);
        cudaFreeHost(cb->ctrl_host[i]);
        if (cb->ctrl_done[i]) cudaEventDestroy(cb->ctrl_done[i]);
    }
    for (int i = 0; i < 2; i++) {
        cudaFreeHost(cb->wstage[i]);
        if (cb->wstage_done[i]) cudaEventDestroy(cb->wstage_done[i]);
    }
    cudaFreeHost(cb->ring_host);
    cudaFree(cb->ring_dev);
    if (cb->ring_lap) cudaEventDestroy(cb->ring_lap);
    cudaFree(cb->dev_error);
    cudaFreeHost(cb->dev_error_host);
    if (cb->dl_host) cudaFreeHost(cb->dl_host);
    if (cb->upload) cudaStreamDestroy(cb->upload);
    if (cb->stream) cudaStreamDestroy(cb->stream);
    (void)cudaGetLastError();
    free(cb);
    free(be);
}

extern "C" size_t ds4_cuda_backend_weight_bytes(const ds4_backend *be) {
    return ((const cuda_backend *)be->impl)->weight_bytes;
}

extern "C" size_t ds4_cuda_backend_peak_bytes(const ds4_backend *be) {
    cuda_backend *cb = (cuda_backend *)be->impl;
    note_peak(cb);
    return cb->peak_bytes;
}

extern "C" void ds4_cuda_backend_counters(const ds4_backend *be, ds4_backend_counters *out) {
    cuda_backend *cb = (cuda_backend *)be->impl;
    note_peak(cb);
    cuda_graph_timing_collect(cb);
    *out = cb->counters;
    out->weight_bytes = cb->weight_bytes;
    out->peak_bytes = cb->peak_bytes;
}

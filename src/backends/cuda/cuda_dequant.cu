/*
 * cuda_dequant.cu - reference dequantisation kernels (blocks -> float32).
 *
 * These are the GPU twins of the CPU dequant_row functions in src/core and
 * are bit-identical to them: every formula keeps the CPU's float32 operation
 * order, and the arithmetic goes through __fmul_rn / __fadd_rn / __fsub_rn,
 * which nvcc never contracts into an FMA (the build uses --fmad=true, so a
 * plain a*b - c could become one fused, differently rounded operation).
 * Conversions from small integers to float are exact; f16 -> f32 is done on
 * the bits, exactly as ds4_f16_to_f32 does it (NaN payloads included); sign
 * flips are done on the sign bit. Denormals are kept (no -ftz in the build),
 * as on the CPU. Only a NaN *result of arithmetic* may differ from the CPU in
 * payload/sign (the GPU returns its canonical NaN).
 *
 * One thread per output element, grid-stride: element i of the flat output
 * reads block i / block_elems, so writes are fully coalesced and the block
 * reads are shared by neighbouring threads through L1. Simple and correct
 * first: the fused matvec kernels are tested against this one.
 */
#include <stdint.h>
#include <string.h>

#include <cuda_runtime.h>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_internal.h"
#include "ds4.h"
#include "core/error.h"
#include "core/quant.h"

#include "backends/cuda/cuda_quant.cuh"

template <uint32_t T>
__global__ void __launch_bounds__(256) dequant_kernel(const void *__restrict__ src, float *__restrict__ dst, int64_t n) {
    cuda_grid_wait();
    typedef deq<T> D;
    const typename D::block *blocks = (const typename D::block *)src;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = D::elem(&blocks[i / D::ELEMS], (int)(i % D::ELEMS));
}

/* ------------------------------------------------------------------------ */
/* Host side                                                                 */
/* ------------------------------------------------------------------------ */

extern "C" int ds4_cuda_dequant_supported(uint32_t type) {
    switch (type) {
    case DS4_TYPE_F32:
    case DS4_TYPE_F16:
    case DS4_TYPE_BF16:
    case DS4_TYPE_Q8_0:
    case DS4_TYPE_Q2_K:
    case DS4_TYPE_Q4_K:
    case DS4_TYPE_Q5_K:
    case DS4_TYPE_Q6_K:
    case DS4_TYPE_IQ2_XXS:
    case DS4_TYPE_Q8_K: return 1;
    default: return 0;
    }
}

/* Alignment the kernel's loads need from the start of the data. */
static size_t src_alignment(uint32_t type) { return type == DS4_TYPE_F32 || type == DS4_TYPE_Q8_K ? 4 : 2; }

/* Type, counts and sizes: the checks that need no device. On success
 * *n_elems = n_rows * row_elems and *src_bytes the bytes of all rows. */
static ds4_status check_args(const char *fn, uint32_t type, int64_t n_rows, int64_t row_elems, int64_t *n_elems,
                             int64_t *src_bytes, ds4_error *err) {
    const ds4_type_traits *tr = ds4_type_traits_get(type);
    if (!tr) return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "%s: unknown type id %u", fn, type);
    if (!ds4_cuda_dequant_supported(type))
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "%s: no CUDA dequantisation kernel for type %s (id %u)", fn,
                             tr->name, type);
    if (n_rows < 0 || row_elems < 0)
        return ds4_error_set(err, DS4_ERR_INVALID, "%s: negative size (%lld rows of %lld elements)", fn,
                             (long long)n_rows, (long long)row_elems);
    if (row_elems % tr->block_elems != 0)
        return ds4_error_set(err, DS4_ERR_INVALID, "%s: row of %lld elements is not a multiple of the %s block (%d)",
                             fn, (long long)row_elems, tr->name, tr->block_elems);
    const int64_t row_bytes = ds4_type_row_bytes(type, row_elems);
    if (row_bytes < 0 || (n_rows > 0 && (row_elems > INT64_MAX / n_rows || row_bytes > INT64_MAX / n_rows)))
        return ds4_error_set(err, DS4_ERR_INVALID, "%s: %lld rows of %lld %s elements overflow", fn,
                             (long long)n_rows, (long long)row_elems, tr->name);
    *n_elems = n_rows * row_elems;
    *src_bytes = n_rows * row_bytes;
    return DS4_OK;
}

/* A pointer the kernel on the current device can dereference: device memory
 * of this device, managed memory, or registered (mapped) host memory. */
static ds4_status check_device_ptr(const char *fn, const char *what, const void *p, int device, ds4_error *err) {
    cudaPointerAttributes attr;
    memset(&attr, 0, sizeof attr);
    DS4_CUDA_CHECK(cudaPointerGetAttributes(&attr, p), err);
    if (attr.type == cudaMemoryTypeUnregistered)
        return ds4_error_set(err, DS4_ERR_INVALID, "%s: %s %p is not device memory", fn, what, p);
    if (attr.type == cudaMemoryTypeDevice && attr.device != device)
        return ds4_error_set(err, DS4_ERR_INVALID, "%s: %s %p is memory of device %d, not of the current device %d", fn,
                             what, p, attr.device, device);
    return DS4_OK;
}

template <uint32_t T> static ds4_status launch(const void *src, float *dst, int64_t n, cudaStream_t stream, ds4_error *err) {
    const int threads = 256;
    const int64_t want = (n + threads - 1) / threads;
    const unsigned blocks = (unsigned)(want < (1 << 16) ? want : (1 << 16)); /* grid-stride beyond */
    (void)cudaGetLastError(); /* report only this launch's error */
    dequant_kernel<T><<<blocks, threads, 0, stream>>>(src, dst, n);
    DS4_CUDA_CHECK(cudaGetLastError(), err);
    return DS4_OK;
}

extern "C" ds4_status ds4_cuda_dequant_rows(uint32_t type, const void *d_src, float *d_dst, int64_t n_rows,
                                            int64_t row_elems, void *stream, ds4_error *err) {
    static const char fn[] = "ds4_cuda_dequant_rows";
    int64_t n = 0, src_bytes = 0;
    ds4_status st = check_args(fn, type, n_rows, row_elems, &n, &src_bytes, err);
    if (st != DS4_OK) return st;
    if (n == 0) return DS4_OK;
    if (!d_src || !d_dst) return ds4_error_set(err, DS4_ERR_INVALID, "%s: NULL pointer", fn);
    if ((uintptr_t)d_src % src_alignment(type) != 0 || (uintptr_t)d_dst % sizeof(float) != 0)
        return ds4_error_set(err, DS4_ERR_INVALID, "%s: misaligned pointer (src %p needs %zu bytes, dst %p needs 4)",
                             fn, d_src, src_alignment(type), (void *)d_dst);
    int device = 0;
    DS4_CUDA_CHECK(cudaGetDevice(&device), err);
    if ((st = check_device_ptr(fn, "source", d_src, device, err)) != DS4_OK) return st;
    if ((st = check_device_ptr(fn, "destination", d_dst, device, err)) != DS4_OK) return st;

    cudaStream_t s = (cudaStream_t)stream;
    switch (type) {
    case DS4_TYPE_F32: return launch<DS4_TYPE_F32>(d_src, d_dst, n, s, err);
    case DS4_TYPE_F16: return launch<DS4_TYPE_F16>(d_src, d_dst, n, s, err);
    case DS4_TYPE_BF16: return launch<DS4_TYPE_BF16>(d_src, d_dst, n, s, err);
    case DS4_TYPE_Q8_0: return launch<DS4_TYPE_Q8_0>(d_src, d_dst, n, s, err);
    case DS4_TYPE_Q2_K: return launch<DS4_TYPE_Q2_K>(d_src, d_dst, n, s, err);
    case DS4_TYPE_Q4_K: return launch<DS4_TYPE_Q4_K>(d_src, d_dst, n, s, err);
    case DS4_TYPE_Q5_K: return launch<DS4_TYPE_Q5_K>(d_src, d_dst, n, s, err);
    case DS4_TYPE_Q6_K: return launch<DS4_TYPE_Q6_K>(d_src, d_dst, n, s, err);
    case DS4_TYPE_IQ2_XXS: return launch<DS4_TYPE_IQ2_XXS>(d_src, d_dst, n, s, err);
    case DS4_TYPE_Q8_K: return launch<DS4_TYPE_Q8_K>(d_src, d_dst, n, s, err);
    default: break;
    }
    return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "%s: no CUDA dequantisation kernel for type %s (id %u)", fn,
                         ds4_type_name(type), type);
}

/* The backend's own dequantisation of weight rows (device memory it
 * bound, so no pointer checks): through cuda_launch, so a recorded step
 * keeps it. false (error recorded) on failure. */
template <uint32_t T> static bool launch_be(ds4_backend *be, const void *src, float *dst, int64_t n) {
    const int64_t want = (n + 255) / 256;
    const unsigned blocks = (unsigned)(want < (1 << 16) ? want : (1 << 16));
    return cuda_launch(be, "dequant_kernel", dequant_kernel<T>, blocks, 256, 0, src, dst, n);
}

bool cuda_dequant_weight_rows(ds4_backend *be, uint32_t type, const void *d_src, float *d_dst, int64_t n_rows,
                              int64_t row_elems, const char *what) {
    int64_t n = 0, src_bytes = 0;
    ds4_error err;
    ds4_error_clear(&err);
    if (check_args("dequantise", type, n_rows, row_elems, &n, &src_bytes, &err) != DS4_OK) {
        cuda_fail(be, err.status, "%s: %s", what, err.message);
        return false;
    }
    if (n == 0) return true;
    switch (type) {
    case DS4_TYPE_F32: return launch_be<DS4_TYPE_F32>(be, d_src, d_dst, n);
    case DS4_TYPE_F16: return launch_be<DS4_TYPE_F16>(be, d_src, d_dst, n);
    case DS4_TYPE_BF16: return launch_be<DS4_TYPE_BF16>(be, d_src, d_dst, n);
    case DS4_TYPE_Q8_0: return launch_be<DS4_TYPE_Q8_0>(be, d_src, d_dst, n);
    case DS4_TYPE_Q2_K: return launch_be<DS4_TYPE_Q2_K>(be, d_src, d_dst, n);
    case DS4_TYPE_Q4_K: return launch_be<DS4_TYPE_Q4_K>(be, d_src, d_dst, n);
    case DS4_TYPE_Q5_K: return launch_be<DS4_TYPE_Q5_K>(be, d_src, d_dst, n);
    case DS4_TYPE_Q6_K: return launch_be<DS4_TYPE_Q6_K>(be, d_src, d_dst, n);
    case DS4_TYPE_IQ2_XXS: return launch_be<DS4_TYPE_IQ2_XXS>(be, d_src, d_dst, n);
    case DS4_TYPE_Q8_K: return launch_be<DS4_TYPE_Q8_K>(be, d_src, d_dst, n);
    default: break;
    }
    cuda_fail(be, DS4_ERR_UNSUPPORTED, "%s: no CUDA dequantisation kernel for type %s", what, ds4_type_name(type));
    return false;
}

extern "C" ds4_status ds4_cuda_dequant_host(uint32_t type, const void *h_src, float *h_dst, int64_t n_rows,
                                            int64_t row_elems, ds4_error *err) {
    static const char fn[] = "ds4_cuda_dequant_host";
    int64_t n = 0, src_bytes = 0;
    ds4_status st = check_args(fn, type, n_rows, row_elems, &n, &src_bytes, err);
    if (st != DS4_OK) return st;
    if (n == 0) return DS4_OK;
    if (!h_src || !h_dst) return ds4_error_set(err, DS4_ERR_INVALID, "%s: NULL pointer", fn);
    if ((uint64_t)n > SIZE_MAX / sizeof(float) || (uint64_t)src_bytes > SIZE_MAX)
        return ds4_error_set(err, DS4_ERR_INVALID, "%s: %lld elements do not fit in memory", fn, (long long)n);
    const size_t dst_bytes = (size_t)n * sizeof(float);

    void *d_src = NULL;
    float *d_dst = NULL;
    DS4_CUDA_TRY(st, cudaMalloc(&d_src, (size_t)src_bytes), err, out);
    DS4_CUDA_TRY(st, cudaMalloc((void **)&d_dst, dst_bytes), err, out);
    DS4_CUDA_TRY(st, cudaMemcpy(d_src, h_src, (size_t)src_bytes, cudaMemcpyHostToDevice), err, out);
    /* Poison the output (0xffffffff, a NaN no dequantiser produces), so an
     * element the kernel failed to write cannot pass as a result. */
    DS4_CUDA_TRY(st, cudaMemset(d_dst, 0xff, dst_bytes), err, out);
    st = ds4_cuda_dequant_rows(type, d_src, d_dst, n_rows, row_elems, NULL, err);
    if (st != DS4_OK) goto out;
    DS4_CUDA_TRY(st, cudaDeviceSynchronize(), err, out); /* kernel faults surface here */
    DS4_CUDA_TRY(st, cudaMemcpy(h_dst, d_dst, dst_bytes, cudaMemcpyDeviceToHost), err, out);
out:
    if (d_dst && cudaFree(d_dst) != cudaSuccess) (void)cudaGetLastError();
    if (d_src && cudaFree(d_src) != cudaSuccess) (void)cudaGetLastError();
    return st;
}

/*
 * cuda_device.cu - device discovery and description, CUDA error checking,
 * and checked device-memory wrappers for C callers.
 *
 * Errors are values: a failed CUDA call becomes a ds4_error naming the call,
 * file and line (ds4_cuda_error / DS4_CUDA_CHECK); nothing here prints or
 * exits. A machine without a GPU or driver simply has 0 devices.
 */
#include <stdio.h>
#include <string.h>

#include <cuda_runtime.h>

#include "backends/cuda/cuda_backend.h"
#include "ds4.h"
#include "core/error.h"

static ds4_status status_of(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return DS4_OK;
    case cudaErrorMemoryAllocation: return DS4_ERR_NOMEM;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidPitchValue:
    case cudaErrorInvalidSymbol:
    case cudaErrorInvalidResourceHandle: return DS4_ERR_INVALID;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorNotSupported:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable: return DS4_ERR_UNSUPPORTED;
    default: return DS4_ERR_DEVICE;
    }
}

extern "C" ds4_status ds4_cuda_error(cudaError_t e, const char *call, const char *file, int line, ds4_error *err) {
    if (e == cudaSuccess) return DS4_OK;
    /* A failed runtime call is also recorded as the thread's "last error";
     * clear it so a later launch check does not report it again. (Sticky
     * errors, which corrupt the context, cannot be cleared and keep failing.) */
    (void)cudaGetLastError();
    const char *name = cudaGetErrorName(e), *desc = cudaGetErrorString(e);
    return ds4_error_set(err, status_of(e), "%s failed at %s:%d: %s: %s", call, file, line, name ? name : "?",
                         desc ? desc : "?");
}

extern "C" ds4_status ds4_cuda_probe(int *count, ds4_error *err) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) n = 0;
    if (count) *count = n;
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: leave no stale "last error" */
        const char *name = cudaGetErrorName(e), *desc = cudaGetErrorString(e);
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "no CUDA device: cudaGetDeviceCount: %s: %s", name ? name : "?",
                             desc ? desc : "?");
    }
    if (n <= 0) return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "no CUDA device: the runtime reports 0 devices");
    return DS4_OK;
}

extern "C" int ds4_cuda_device_count(void) {
    int n = 0;
    if (ds4_cuda_probe(&n, NULL) != DS4_OK) return 0;
    return n;
}

/* CUDA versions are 1000*major + 10*minor. */
static void split_version(int v, int *major, int *minor) {
    *major = v / 1000;
    *minor = (v % 1000) / 10;
}

extern "C" ds4_status ds4_cuda_device_describe(int device, char *buf, size_t cap, ds4_error *err) {
    if (!buf || cap == 0) return ds4_error_set(err, DS4_ERR_INVALID, "ds4_cuda_device_describe: NULL or empty buffer");
    buf[0] = '\0';
    int count = 0;
    ds4_status st = ds4_cuda_probe(&count, err);
    if (st != DS4_OK) return st;
    if (device < 0 || device >= count)
        return ds4_error_set(err, DS4_ERR_INVALID, "ds4_cuda_device_describe: device %d out of range (%d devices)",
                             device, count);
    cudaDeviceProp prop;
    memset(&prop, 0, sizeof prop);
    DS4_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), err);
    int driver = 0, runtime = 0;
    DS4_CUDA_CHECK(cudaDriverGetVersion(&driver), err);
    DS4_CUDA_CHECK(cudaRuntimeGetVersion(&runtime), err);
    int dmaj, dmin, rmaj, rmin;
    split_version(driver, &dmaj, &dmin);
    split_version(runtime, &rmaj, &rmin);
    char name[sizeof prop.name + 1];
    memcpy(name, prop.name, sizeof prop.name);
    name[sizeof prop.name] = '\0';
    const double gib = (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0);
    int n = snprintf(buf, cap, "device %d: %s, compute %d.%d, %.1f GiB, %d SMs, driver %d.%d, runtime %d.%d", device,
                     name, prop.major, prop.minor, gib, prop.multiProcessorCount, dmaj, dmin, rmaj, rmin);
    if (n < 0 || (size_t)n >= cap)
        return ds4_error_set(err, DS4_ERR_INVALID, "ds4_cuda_device_describe: buffer of %zu bytes too small (need %d)",
                             cap, n + 1);
    return DS4_OK;
}

/* ------------------------------------------------------------------------ */
/* Device memory                                                             */
/* ------------------------------------------------------------------------ */

extern "C" ds4_status ds4_cuda_malloc(void **out, size_t bytes, ds4_error *err) {
    if (!out) return ds4_error_set(err, DS4_ERR_INVALID, "ds4_cuda_malloc: NULL out");
    *out = NULL;
    if (bytes == 0) return DS4_OK;
    void *p = NULL;
    DS4_CUDA_CHECK(cudaMalloc(&p, bytes), err);
    *out = p;
    return DS4_OK;
}

extern "C" void ds4_cuda_free(void *d_ptr) {
    if (d_ptr && cudaFree(d_ptr) != cudaSuccess) (void)cudaGetLastError();
}

extern "C" ds4_status ds4_cuda_memcpy_h2d(void *d_dst, const void *h_src, size_t bytes, ds4_error *err) {
    if (bytes == 0) return DS4_OK;
    if (!d_dst || !h_src) return ds4_error_set(err, DS4_ERR_INVALID, "ds4_cuda_memcpy_h2d: NULL pointer");
    DS4_CUDA_CHECK(cudaMemcpy(d_dst, h_src, bytes, cudaMemcpyHostToDevice), err);
    return DS4_OK;
}

extern "C" ds4_status ds4_cuda_memcpy_d2h(void *h_dst, const void *d_src, size_t bytes, ds4_error *err) {
    if (bytes == 0) return DS4_OK;
    if (!h_dst || !d_src) return ds4_error_set(err, DS4_ERR_INVALID, "ds4_cuda_memcpy_d2h: NULL pointer");
    DS4_CUDA_CHECK(cudaMemcpy(h_dst, d_src, bytes, cudaMemcpyDeviceToHost), err);
    return DS4_OK;
}

extern "C" ds4_status ds4_cuda_memset(void *d_dst, int byte, size_t bytes, ds4_error *err) {
    if (bytes == 0) return DS4_OK;
    if (!d_dst) return ds4_error_set(err, DS4_ERR_INVALID, "ds4_cuda_memset: NULL pointer");
    DS4_CUDA_CHECK(cudaMemset(d_dst, byte, bytes), err);
    return DS4_OK;
}

extern "C" ds4_status ds4_cuda_synchronize(ds4_error *err) {
    DS4_CUDA_CHECK(cudaDeviceSynchronize(), err);
    return DS4_OK;
}

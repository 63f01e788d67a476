/*
 * backend.c - choosing a backend by name. There is no fallback: a backend
 * that is unknown or not usable in this build is an error naming it.
 *
 * Names: "cpu"; "cuda" (device 0) or "cuda:N" (device N) when built with
 * `make cuda`.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "backends/backend.h"
#include "backends/cpu/cpu_internal.h"
#include "core/error.h"
#ifdef DS4_WITH_CUDA
#include "backends/cuda/cuda_backend.h"
#endif

ds4_status ds4_backend_create(const char *name, int n_threads, ds4_backend **out, ds4_error *err) {
    *out = NULL;
    if (!name || strcmp(name, "cpu") == 0) return ds4_cpu_backend_create(n_threads, out, err);
    if (strncmp(name, "cuda", 4) == 0 && (name[4] == '\0' || name[4] == ':')) {
        long device = 0;
        if (name[4] == ':') {
            char *end = NULL;
            errno = 0;
            device = strtol(name + 5, &end, 10);
            if (errno || end == name + 5 || *end || device < 0 || device > 1024)
                return ds4_error_set(err, DS4_ERR_INVALID, "bad backend \"%s\" (cuda or cuda:N)", name);
        }
#ifdef DS4_WITH_CUDA
        return ds4_cuda_backend_create((int)device, out, err);
#else
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "this build has no CUDA backend (make cuda)");
#endif
    }
    return ds4_error_set(err, DS4_ERR_INVALID, "unknown backend \"%s\" (known: cpu, cuda)", name);
}

void ds4_backend_destroy(ds4_backend *be) {
    if (!be) return;
    if (strcmp(be->ops->name, "cpu") == 0) ds4_cpu_backend_free(be);
#ifdef DS4_WITH_CUDA
    else if (strcmp(be->ops->name, "cuda") == 0) ds4_cuda_backend_free(be);
#endif
}

int ds4_backend_kernel_times(ds4_backend *be, ds4_kernel_time *out, int cap) {
    if (!be) return 0;
#ifdef DS4_WITH_CUDA
    if (strcmp(be->ops->name, "cuda") == 0) return ds4_cuda_backend_kernel_times(be, out, cap);
#endif
    (void)out;
    (void)cap;
    return 0;
}

void ds4_backend_kernel_times_reset(ds4_backend *be) {
    if (!be) return;
#ifdef DS4_WITH_CUDA
    if (strcmp(be->ops->name, "cuda") == 0) ds4_cuda_backend_kernel_times_reset(be);
#endif
}

void ds4_backend_counters_get(ds4_backend *be, ds4_backend_counters *out) {
    memset(out, 0, sizeof *out);
    if (!be) return;
#ifdef DS4_WITH_CUDA
    if (strcmp(be->ops->name, "cuda") == 0) ds4_cuda_backend_counters(be, out);
#endif
}

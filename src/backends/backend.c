/*
 * backend.c - choosing a backend by name. There is no fallback: a backend
 * that is unknown or not usable in this build is an error naming it.
 */
#include <string.h>

#include "backends/backend.h"
#include "backends/cpu/cpu_internal.h"
#include "core/error.h"

ds4_status ds4_backend_create(const char *name, int n_threads, ds4_backend **out, ds4_error *err) {
    *out = NULL;
    if (!name || strcmp(name, "cpu") == 0) return ds4_cpu_backend_create(n_threads, out, err);
    if (strcmp(name, "cuda") == 0) {
#ifdef DS4_WITH_CUDA
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "the CUDA backend does not implement the model ops yet");
#else
        return ds4_error_set(err, DS4_ERR_UNSUPPORTED, "this build has no CUDA backend (make cuda)");
#endif
    }
    return ds4_error_set(err, DS4_ERR_INVALID, "unknown backend \"%s\" (known: cpu, cuda)", name);
}

void ds4_backend_destroy(ds4_backend *be) {
    if (!be) return;
    if (strcmp(be->ops->name, "cpu") == 0) ds4_cpu_backend_free(be);
}

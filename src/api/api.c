/*
 * api.c - the public entry points of include/ds4.h that sit directly on core:
 * version and build flavour, and validated model files.
 */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/gguf.h"
#include "ds4.h"

#define DS4_STR2(x) #x
#define DS4_STR(x) DS4_STR2(x)
#define DS4_VERSION_STRING DS4_STR(DS4_VERSION_MAJOR) "." DS4_STR(DS4_VERSION_MINOR) "." DS4_STR(DS4_VERSION_PATCH)

const char *ds4_version(void) {
#ifdef DS4_WITH_CUDA
    return DS4_VERSION_STRING " (cpu+cuda)";
#else
    return DS4_VERSION_STRING " (cpu)";
#endif
}

int ds4_backend_compiled(const char *name) {
    if (!name) return 0;
    if (strcmp(name, "cpu") == 0) return 1;
#ifdef DS4_WITH_CUDA
    if (strcmp(name, "cuda") == 0) return 1;
#endif
    return 0;
}

struct ds4_file {
    gguf_file *gguf;
    char architecture[128];
};

ds4_status ds4_file_open(const char *path, ds4_file **out, ds4_error *err) {
    if (!path || !out) return ds4_error_set(err, DS4_ERR_INVALID, "ds4_file_open: NULL argument");
    *out = NULL;
    ds4_file *f = calloc(1, sizeof *f);
    if (!f) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    ds4_status st = gguf_open(path, &f->gguf, err);
    if (st) {
        free(f);
        return st;
    }
    gguf_str arch;
    if (gguf_get_str(f->gguf, "general.architecture", &arch, NULL) == DS4_OK) {
        size_t n = arch.len < sizeof f->architecture - 1 ? (size_t)arch.len : sizeof f->architecture - 1;
        memcpy(f->architecture, arch.ptr, n);
        f->architecture[n] = '\0';
    }
    *out = f;
    return DS4_OK;
}

void ds4_file_close(ds4_file *f) {
    if (!f) return;
    gguf_close(f->gguf);
    free(f);
}

uint32_t ds4_file_version(const ds4_file *f) { return f->gguf->version; }
uint64_t ds4_file_n_tensors(const ds4_file *f) { return f->gguf->n_tensors; }
uint64_t ds4_file_n_metadata(const ds4_file *f) { return f->gguf->n_kv; }
const char *ds4_file_architecture(const ds4_file *f) { return f->architecture; }

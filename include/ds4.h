/*
 * ds4.h - the public API of libds4.
 *
 * This is the only header that tools, the server and language bindings use.
 * Everything here is plain C11 with fixed-width types, so it binds from any
 * language with a C FFI. Functions report failure through a return status and
 * fill a caller-provided ds4_error with a one-line, human-readable message.
 */
#ifndef DS4_H
#define DS4_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DS4_VERSION_MAJOR 0
#define DS4_VERSION_MINOR 1
#define DS4_VERSION_PATCH 0

typedef enum ds4_status {
    DS4_OK = 0,
    DS4_ERR_IO = 1,          /* open/read/write/mmap failed */
    DS4_ERR_FORMAT = 2,      /* malformed file or data */
    DS4_ERR_NOMEM = 3,       /* allocation failed */
    DS4_ERR_INVALID = 4,     /* bad argument from the caller */
    DS4_ERR_UNSUPPORTED = 5, /* valid but not implemented here */
    DS4_ERR_NOT_FOUND = 6,   /* named key/tensor/file absent */
    DS4_ERR_DEVICE = 7,      /* the accelerator failed (driver, launch, kernel fault) */
} ds4_status;

#define DS4_ERROR_MSG_MAX 512

typedef struct ds4_error {
    ds4_status status;
    char message[DS4_ERROR_MSG_MAX];
} ds4_error;

/* "0.1.0" plus build flavour, e.g. "0.1.0 (cpu)" or "0.1.0 (cpu+cuda)". */
const char *ds4_version(void);

/* Name of a status code, e.g. "format error". */
const char *ds4_status_name(ds4_status status);

/* Backends compiled into this library: 1 if `name` ("cpu", "cuda") is built in. */
int ds4_backend_compiled(const char *name);

/*
 * Model files (GGUF). A ds4_file is a memory-mapped, fully validated GGUF:
 * every count, offset and size was checked against the file when it opened.
 */
typedef struct ds4_file ds4_file;

ds4_status ds4_file_open(const char *path, ds4_file **out, ds4_error *err);
void ds4_file_close(ds4_file *file);
uint32_t ds4_file_version(const ds4_file *file);
uint64_t ds4_file_n_tensors(const ds4_file *file);
uint64_t ds4_file_n_metadata(const ds4_file *file);
/* Architecture from general.architecture, or "" when absent. */
const char *ds4_file_architecture(const ds4_file *file);

#ifdef __cplusplus
}
#endif

#endif /* DS4_H */

/* error.c - ds4_error helpers and status names. */
#include "core/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

ds4_status ds4_error_set(ds4_error *err, ds4_status status, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
        err->status = status;
    }
    return status;
}

ds4_status ds4_error_prefix(ds4_error *err, const char *fmt, ...) {
    if (!err) return DS4_ERR_INVALID;
    char prefix[DS4_ERROR_MSG_MAX];
    char old[DS4_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, err->message, sizeof old);
    old[sizeof old - 1] = '\0';
    /* prefix + ": " + old, truncated to the message size. */
    size_t cap = sizeof err->message, n = strlen(prefix);
    if (n > cap - 1) n = cap - 1;
    memcpy(err->message, prefix, n);
    size_t room = cap - 1 - n;
    size_t sep = room < 2 ? room : 2;
    memcpy(err->message + n, ": ", sep);
    n += sep;
    size_t m = strlen(old);
    if (m > cap - 1 - n) m = cap - 1 - n;
    memcpy(err->message + n, old, m);
    err->message[n + m] = '\0';
    return err->status;
}

void ds4_error_clear(ds4_error *err) {
    if (err) {
        err->status = DS4_OK;
        err->message[0] = '\0';
    }
}

const char *ds4_status_name(ds4_status status) {
    switch (status) {
    case DS4_OK: return "ok";
    case DS4_ERR_IO: return "i/o error";
    case DS4_ERR_FORMAT: return "format error";
    case DS4_ERR_NOMEM: return "out of memory";
    case DS4_ERR_INVALID: return "invalid argument";
    case DS4_ERR_UNSUPPORTED: return "unsupported";
    case DS4_ERR_NOT_FOUND: return "not found";
    case DS4_ERR_DEVICE: return "device error";
    }
    return "unknown status";
}

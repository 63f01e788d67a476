/*
 * error.h - errors as values.
 *
 * Library code never exits on bad input: it returns a ds4_status and fills a
 * ds4_error whose message names the file, tensor, field or byte offset at fault.
 */
#ifndef DS4_CORE_ERROR_H
#define DS4_CORE_ERROR_H

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define DS4_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define DS4_PRINTF(a, b)
#endif

/* Fill `err` (may be NULL) and return `status`, so callers can write
 * `return ds4_error_set(err, DS4_ERR_FORMAT, "...", ...);`. */
ds4_status ds4_error_set(ds4_error *err, ds4_status status, const char *fmt, ...) DS4_PRINTF(3, 4);

/* Prefix the existing message with more context: "ctx: old message". */
ds4_status ds4_error_prefix(ds4_error *err, const char *fmt, ...) DS4_PRINTF(2, 3);

void ds4_error_clear(ds4_error *err);

#ifdef __cplusplus
}
#endif

#endif

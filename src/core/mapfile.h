/* mapfile.h - read-only memory mapping of a whole regular file, and reading
 * a small one whole. */
#ifndef DS4_CORE_MAPFILE_H
#define DS4_CORE_MAPFILE_H

#include <stdint.h>

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Map `path` read-only. A file shorter than `min_size` bytes is refused with
 * DS4_ERR_FORMAT ("<path>: file is N bytes, smaller than <what>"); every
 * other failure names the path and the system error. */
ds4_status ds4_map_file(const char *path, uint64_t min_size, const char *what, const uint8_t **map, uint64_t *size,
                        ds4_error *err);
void ds4_unmap_file(const uint8_t *map, uint64_t size);

/* Read a whole regular file of at most `cap` bytes into *out (malloc'd,
 * NUL-terminated; *size its length). A larger file is DS4_ERR_FORMAT; every
 * failure names the path. */
ds4_status ds4_read_small_file(const char *path, uint64_t cap, char **out, uint64_t *size, ds4_error *err);

#ifdef __cplusplus
}
#endif

#endif

/* mapfile.h - read-only memory mapping of a whole regular file. */
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

#ifdef __cplusplus
}
#endif

#endif

/* mapfile.c - read-only memory mapping of a whole regular file, and reading
 * a small one whole. */
#include "core/mapfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"

ds4_status ds4_map_file(const char *path, uint64_t min_size, const char *what, const uint8_t **map, uint64_t *size,
                        ds4_error *err) {
    *map = NULL;
    *size = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ds4_error_set(err, DS4_ERR_IO, "%s: %s", path, strerror(errno));
    struct stat sb;
    ds4_status st = DS4_OK;
    if (fstat(fd, &sb) != 0) st = ds4_error_set(err, DS4_ERR_IO, "%s: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode)) st = ds4_error_set(err, DS4_ERR_IO, "%s: not a regular file", path);
    else if ((uint64_t)sb.st_size < min_size || sb.st_size == 0)
        st = ds4_error_set(err, DS4_ERR_FORMAT, "%s: file is %lld bytes, smaller than %s", path,
                           (long long)sb.st_size, what);
    if (st) {
        close(fd);
        return st;
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED) return ds4_error_set(err, DS4_ERR_IO, "%s: mmap: %s", path, strerror(e));
    *map = m;
    *size = (uint64_t)sb.st_size;
    return DS4_OK;
}

void ds4_unmap_file(const uint8_t *map, uint64_t size) {
    if (map) munmap((void *)map, (size_t)size);
}

ds4_status ds4_read_small_file(const char *path, uint64_t cap, char **out, uint64_t *size, ds4_error *err) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return ds4_error_set(err, DS4_ERR_IO, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(fp);
        return ds4_error_set(err, DS4_ERR_IO, "%s: not a regular file", path);
    }
    if ((uint64_t)sb.st_size > cap) {
        fclose(fp);
        return ds4_error_set(err, DS4_ERR_FORMAT, "%s: %lld bytes, more than the %llu-byte limit", path,
                             (long long)sb.st_size, (unsigned long long)cap);
    }
    char *buf = malloc((size_t)sb.st_size + 1);
    if (!buf) {
        fclose(fp);
        return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory reading %s", path);
    }
    size_t n = fread(buf, 1, (size_t)sb.st_size, fp);
    fclose(fp);
    if (n != (size_t)sb.st_size) {
        free(buf);
        return ds4_error_set(err, DS4_ERR_IO, "%s: short read", path);
    }
    buf[n] = '\0';
    *out = buf;
    *size = n;
    return DS4_OK;
}

/*
 * dump.c - `ds4server dump FILE TENSOR --out PATH`.
 *
 * Writes the tensor dequantised to float32, little-endian, row-major in GGUF
 * order (ne[0] fastest): exactly n_elements * 4 bytes. Integer tensors (I8,
 * I16, I32, I64) and F64 are converted to float (integers exact below 2^24). The output appears
 * under its name only when complete (temp file + rename).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/gguf.h"
#include "core/quant.h"
#include "tools/tools.h"

/* Convert one row of plain integer or f64 data; false if `type` is not one. */
static bool convert_plain_row(uint32_t type, const uint8_t *src, float *dst, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        switch (type) {
        case DS4_TYPE_I8: dst[i] = (float)(int8_t)src[i]; break;
        case DS4_TYPE_I16: { int16_t v; memcpy(&v, src + 2 * i, 2); dst[i] = (float)v; break; }
        case DS4_TYPE_I32: { int32_t v; memcpy(&v, src + 4 * i, 4); dst[i] = (float)v; break; }
        case DS4_TYPE_I64: { int64_t v; memcpy(&v, src + 8 * i, 8); dst[i] = (float)v; break; }
        case DS4_TYPE_F64: { double v; memcpy(&v, src + 8 * i, 8); dst[i] = (float)v; break; }
        default: return false;
        }
    }
    return true;
}

int tool_dump(int argc, char **argv) {
    const char *path = NULL, *name = NULL, *out_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") || !strcmp(argv[i], "-o")) {
            if (++i >= argc) return tool_fail("dump", "--out needs a path");
            out_path = argv[i];
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: ds4server dump FILE TENSOR --out PATH\n"
                   "writes TENSOR dequantised to float32 little-endian, ne[0] fastest\n");
            return 0;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return tool_fail("dump", "unknown option '%s'", argv[i]);
        } else if (!path) path = argv[i];
        else if (!name) name = argv[i];
        else return tool_fail("dump", "unexpected argument '%s'", argv[i]);
    }
    if (!path || !name || !out_path) return tool_fail("dump", "usage: ds4server dump FILE TENSOR --out PATH");

    gguf_file *f;
    ds4_error err = { 0 };
    if (gguf_open(path, &f, &err)) return tool_fail("dump", "%s", err.message);
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t) {
        gguf_close(f);
        return tool_fail("dump", "%s: no tensor named '%s'", path, name);
    }
    const ds4_type_traits *tr = ds4_type_traits_get(t->type);
    bool plain = t->type == DS4_TYPE_I8 || t->type == DS4_TYPE_I16 || t->type == DS4_TYPE_I32 ||
                 t->type == DS4_TYPE_I64 || t->type == DS4_TYPE_F64;
    if (!plain && !tr->dequant_row) {
        gguf_close(f);
        return tool_fail("dump", "tensor '%s' has type %s, which this build cannot dequantise", name, tr->name);
    }
    uint64_t row = t->ne[0];
    uint64_t rows = row ? t->n_elements / row : 0;
    uint64_t row_bytes = (uint64_t)ds4_type_row_bytes(t->type, (int64_t)row);
    size_t tmp_len = strlen(out_path) + 5;
    char *tmp = malloc(tmp_len);
    float *buf = malloc((row ? row : 1) * sizeof *buf);
    FILE *out = NULL;
    int rc = 0;
    if (!tmp || !buf) {
        rc = tool_fail("dump", "out of memory for a row of %llu elements", (unsigned long long)row);
        goto done;
    }
    snprintf(tmp, tmp_len, "%s.tmp", out_path);
    if (!(out = fopen(tmp, "wb"))) {
        rc = tool_fail("dump", "%s: %s", tmp, strerror(errno));
        goto done;
    }
    for (uint64_t r = 0; r < rows; r++) {
        const uint8_t *src = t->data + r * row_bytes;
        if (plain) convert_plain_row(t->type, src, buf, row);
        else tr->dequant_row(src, buf, (int64_t)row);
        if (fwrite(buf, sizeof *buf, row, out) != row) {
            rc = tool_fail("dump", "%s: write failed: %s", tmp, strerror(errno));
            goto done;
        }
    }
    if (fflush(out) != 0 || fsync(fileno(out)) != 0) rc = tool_fail("dump", "%s: %s", tmp, strerror(errno));
    if (fclose(out) != 0 && !rc) rc = tool_fail("dump", "%s: %s", tmp, strerror(errno));
    out = NULL;
    if (!rc && rename(tmp, out_path) != 0) rc = tool_fail("dump", "%s: %s", out_path, strerror(errno));
done:
    if (out) fclose(out);
    if (rc && tmp) unlink(tmp);
    free(tmp);
    free(buf);
    gguf_close(f);
    return rc;
}

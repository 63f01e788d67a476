/*
 * gguf_quantize - test tool: quantise every F32 tensor of IN to TYPE with our
 * reference quantisers and write OUT (metadata copied verbatim). Tests compare
 * the bytes with gguf-py's quantisers.
 *
 *   gguf_quantize IN OUT TYPE
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/gguf.h"
#include "core/quant.h"

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: gguf_quantize IN OUT TYPE\n");
        return 2;
    }
    int type = ds4_type_from_name(argv[3]);
    const ds4_type_traits *tr = type >= 0 ? ds4_type_traits_get((uint32_t)type) : NULL;
    if (!tr || !tr->quantize_row) {
        fprintf(stderr, "gguf_quantize: cannot quantise to '%s'\n", argv[3]);
        return 1;
    }
    gguf_file *f;
    gguf_writer *w;
    ds4_error err = { 0 };
    if (gguf_open(argv[1], &f, &err) || gguf_writer_open(argv[2], f->alignment, &w, &err)) {
        fprintf(stderr, "gguf_quantize: %s\n", err.message);
        return 1;
    }
    for (uint64_t i = 0; i < f->n_kv; i++) {
        char key[65536];
        memcpy(key, f->kv[i].key.ptr, f->kv[i].key.len);
        key[f->kv[i].key.len] = '\0';
        gguf_writer_add_value(w, key, &f->kv[i].value);
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        char name[65536];
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = '\0';
        bool q = t->type == DS4_TYPE_F32 && ds4_type_row_bytes((uint32_t)type, (int64_t)t->ne[0]) >= 0;
        gguf_writer_add_tensor(w, name, q ? (uint32_t)type : t->type, t->n_dims, t->ne);
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        int64_t rb = ds4_type_row_bytes((uint32_t)type, (int64_t)t->ne[0]);
        if (t->type != DS4_TYPE_F32 || rb < 0) {
            gguf_writer_write(w, t->data, t->n_bytes);
            continue;
        }
        uint8_t *row = malloc((size_t)rb + 1);
        float *src = malloc(t->ne[0] * sizeof *src + 1);
        for (uint64_t r = 0; r < t->n_elements / t->ne[0]; r++) {
            memcpy(src, t->data + r * t->ne[0] * 4, t->ne[0] * 4);
            tr->quantize_row(src, row, (int64_t)t->ne[0]);
            gguf_writer_write(w, row, (uint64_t)rb);
        }
        free(row);
        free(src);
    }
    gguf_close(f);
    if (gguf_writer_finish(w, &err)) {
        fprintf(stderr, "gguf_quantize: %s\n", err.message);
        return 1;
    }
    return 0;
}

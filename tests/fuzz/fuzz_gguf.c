/*
 * fuzz_gguf.c - libFuzzer target for the GGUF reader.
 *
 * Parses arbitrary bytes; when they parse, walks everything a tool would touch
 * (every metadata value, every array element, every tensor's bytes and a
 * dequantised first row), so a validation gap shows up as an ASan report.
 */
#include <stdlib.h>
#include <string.h>

#include "core/gguf.h"
#include "core/quant.h"

static volatile uint64_t sink;

static void walk_value(const gguf_value *v) {
    double d;
    if (v->type == GGUF_TYPE_STRING) {
        for (uint64_t i = 0; i < v->str.len; i++) sink += (uint8_t)v->str.ptr[i];
    } else if (v->type == GGUF_TYPE_ARRAY) {
        gguf_array_iter it;
        gguf_value e;
        uint64_t n = 0;
        gguf_array_iter_init(&it, v);
        while (gguf_array_iter_next(&it, &e)) {
            walk_value(&e);
            n++;
        }
        if (n != v->count) abort(); /* iteration must visit exactly count elements */
    } else if (gguf_value_as_double(v, &d)) {
        sink += (uint64_t)(d == d);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    gguf_file *f = NULL;
    ds4_error err;
    if (gguf_open_memory(data, size, &f, &err) != DS4_OK) {
        if (err.message[0] == '\0') abort(); /* every failure explains itself */
        return 0;
    }
    for (uint64_t i = 0; i < f->n_kv; i++) walk_value(&f->kv[i].value);
    float row[4096];
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (t->n_bytes) sink += t->data[0] + t->data[t->n_bytes - 1];
        const ds4_type_traits *tr = ds4_type_traits_get(t->type);
        if (tr && tr->dequant_row && t->ne[0] <= 4096 && t->n_bytes) tr->dequant_row(t->data, row, (int64_t)t->ne[0]);
        char name[128];
        uint64_t n = t->name.len < sizeof name - 1 ? t->name.len : sizeof name - 1;
        memcpy(name, t->name.ptr, n);
        name[n] = '\0';
        if (n == t->name.len && !memchr(name, 0, n) && gguf_find_tensor(f, name) == NULL) abort();
    }
    gguf_close(f);
    return 0;
}

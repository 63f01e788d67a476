/*
 * fuzz_safetensors.c - libFuzzer target for the safetensors reader.
 *
 * Parses arbitrary bytes; when they parse, reads every tensor's bytes through
 * the conversion helpers, so a validation gap shows up as an ASan report.
 * (The GGUF seed corpus is shared; the fuzzer finds the 8-byte length + JSON
 * shape quickly from the dictionary of its own comparisons.)
 */
#include <stdlib.h>
#include <string.h>

#include "core/safetensors.h"

static volatile uint64_t sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    safetensors_file *f = NULL;
    ds4_error err;
    if (safetensors_open_memory(data, size, &f, &err) != DS4_OK) {
        if (err.message[0] == '\0') abort(); /* every failure explains itself */
        return 0;
    }
    float fv[16];
    int64_t iv[16];
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const safetensors_tensor *t = &f->tensors[i];
        if (t->data < (const uint8_t *)data || t->data + t->n_bytes > (const uint8_t *)data + size) abort();
        if (safetensors_find(f, t->name) != t) abort();
        for (uint64_t b = 0; b < t->n_bytes; b++) sink += t->data[b];
        for (uint64_t e = 0; e < t->n_elements; e += 16) {
            uint64_t n = t->n_elements - e < 16 ? t->n_elements - e : 16;
            if (safetensors_dtype_is_float(t->dtype)) {
                if (safetensors_read_f32(t, e, n, fv, &err) != DS4_OK) abort();
                sink += (uint64_t)(fv[0] == fv[0]);
            } else if (safetensors_dtype_is_int(t->dtype)) {
                if (safetensors_read_i64(t, e, n, iv, &err) != DS4_OK) abort();
                sink += (uint64_t)iv[0];
            }
        }
    }
    safetensors_close(f);
    return 0;
}

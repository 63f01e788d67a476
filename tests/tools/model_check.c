/*
 * model_check - test tool: open a model file, validate its metadata and bind
 * every tensor on the CPU backend (no inference). Prints one summary line, or
 * the loader's error and exit status 1.
 */
#include <stdio.h>

#include "backends/backend.h"
#include "core/error.h"
#include "core/gguf.h"
#include "models/deepseek4/ds4_model.h"

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: model_check FILE\n");
        return 2;
    }
    ds4_error err = { 0 };
    gguf_file *f = NULL;
    ds4_backend *be = NULL;
    ds4_model *m = NULL;
    int rc = 0;
    if (gguf_open(argv[1], &f, &err) || ds4_backend_create("cpu", 1, &be, &err) || ds4_model_load(f, be, &m, &err)) {
        fprintf(stderr, "model_check: %s\n", err.message);
        rc = 1;
    } else {
        const ds4_config *c = ds4_model_config(m);
        int hash = 0, r4 = 0, r128 = 0;
        for (int l = 0; l < c->n_layer; l++) {
            hash += c->hash_layer[l];
            r4 += c->compress_ratio[l] == 4;
            r128 += c->compress_ratio[l] == 128;
        }
        printf("ok: %d layers (%d ratio-4, %d ratio-128, %d hash-routed), hidden %lld, vocab %lld, %llu tensors\n",
               c->n_layer, r4, r128, hash, (long long)c->n_embd, (long long)c->n_vocab,
               (unsigned long long)f->n_tensors);
    }
    ds4_model_free(m);
    ds4_backend_destroy(be);
    gguf_close(f);
    return rc;
}

/*
 * test_state.h - a model state's whole payload as bytes, for tests that
 * compare two states byte for byte (the CPU and CUDA session tests).
 */
#ifndef DS4_TEST_STATE_H
#define DS4_TEST_STATE_H

#include <stdint.h>
#include <stdlib.h>

#include "models/deepseek4/ds4_model.h"

/* The payload of st holding tokens t[0..n) (its caches come to the host,
 * with zero logits of `vocab` entries), malloc'd; NULL when it could not be
 * made. *size gets its length. */
static inline uint8_t *test_state_bytes(const ds4_state *st, const int32_t *t, int64_t n, int64_t vocab,
                                        int64_t *size) {
    ds4_error err = { 0 };
    float *logits = calloc((size_t)vocab, sizeof *logits);
    *size = ds4_state_payload_size(st, n);
    uint8_t *b = *size > 0 ? malloc((size_t)*size) : NULL;
    if (!b || !logits || ds4_state_save_payload(st, t, n, logits, b, *size, &err) != DS4_OK) {
        free(b);
        b = NULL;
    }
    free(logits);
    return b;
}

#endif

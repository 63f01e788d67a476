/* ds4_synth.h - write a DeepSeek V4 Flash GGUF with seeded random weights. */
#ifndef DS4_MODELS_DEEPSEEK4_SYNTH_H
#define DS4_MODELS_DEEPSEEK4_SYNTH_H

#include <stdbool.h>
#include <stdint.h>

#include "models/deepseek4/ds4_config.h"

/* Write `path` (atomically) with the layout of the preset `scale` in the
 * quantisation scheme `quant`, weights drawn from `seed`. `tokenizer`
 * (a Hugging Face tokenizer.json, may be NULL) supplies the vocabulary;
 * `zero` writes no weight data (a sparse file of zeros). */
ds4_status ds4_synth_write(const char *path, ds4_scale scale, ds4_quant_scheme quant, uint64_t seed,
                           const char *tokenizer, bool zero, ds4_error *err);

#endif

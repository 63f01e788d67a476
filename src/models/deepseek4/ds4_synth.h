/* ds4_synth.h - write a DeepSeek V4 Flash GGUF with seeded random weights. */
#ifndef DS4_MODELS_DEEPSEEK4_SYNTH_H
#define DS4_MODELS_DEEPSEEK4_SYNTH_H

#include <stdbool.h>
#include <stdint.h>

#include "core/synth_fill.h"
#include "models/deepseek4/ds4_config.h"

/* Write `path` (atomically) with the layout of the preset `scale` in the
 * quantisation scheme `quant`, weights drawn from `seed`. `tokenizer`
 * (a Hugging Face tokenizer.json, may be NULL) supplies the vocabulary;
 * `zero` writes no weight data (a sparse file of zeros). */
ds4_status ds4_synth_write(const char *path, ds4_scale scale, ds4_quant_scheme quant, uint64_t seed,
                           const char *tokenizer, bool zero, ds4_error *err);
/* The same with only the first n_layers layers of the preset (0: all of
 * them; more than it has: DS4_ERR_INVALID): a model of the real shapes
 * that fits a smaller device, for measuring per-layer speed. */
ds4_status ds4_synth_write_layers(const char *path, ds4_scale scale, ds4_quant_scheme quant, uint64_t seed,
                                  const char *tokenizer, bool zero, int n_layers, ds4_error *err);

/* How a backend fills tensor t (stored as `type`, entry `index` of the
 * layout) of a synthetic model drawn from `seed` (see core/synth_fill.h):
 * values sized by the tensor's role, as the file writer above sizes them.
 * DS4_ERR_UNSUPPORTED for a type the generator cannot make. */
ds4_status ds4_synth_fill_for(const ds4_tensor_spec *t, uint32_t type, const ds4_config *cfg, uint64_t seed,
                              int64_t index, ds4_fill *f, ds4_error *err);

#endif

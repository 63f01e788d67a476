/*
 * hf_vocab.h - the vocabulary of a Hugging Face tokenizer.json (byte-level BPE).
 *
 * Reads what a GGUF file carries for the tokenizer: the token strings by id
 * (model.vocab plus added_tokens), their GGUF token types, the merges in rank
 * order, and the BOS/EOS ids of the DeepSeek V4 prompt format. Ids missing
 * from both tables are filled with "<|unused_N|>" placeholders so the table
 * is dense.
 */
#ifndef DS4_TEXT_HF_VOCAB_H
#define DS4_TEXT_HF_VOCAB_H

#include <stdint.h>

#include "ds4.h"

/* GGUF token types (llama.cpp's convention). */
enum { HF_TOKEN_NORMAL = 1, HF_TOKEN_UNKNOWN = 2, HF_TOKEN_CONTROL = 3, HF_TOKEN_USER_DEFINED = 4, HF_TOKEN_UNUSED = 5 };

typedef struct hf_vocab {
    int64_t n_tokens;
    char **tokens;
    int32_t *types;
    int64_t n_merges;
    char **merges; /* "left right" */
    int32_t bos, eos; /* -1 when absent */
} hf_vocab;

ds4_status hf_vocab_load(const char *path, hf_vocab *out, ds4_error *err);
void hf_vocab_free(hf_vocab *v);

#endif

/*
 * tokenizer.h - the DeepSeek V4 byte-level BPE tokenizer, read from GGUF metadata.
 *
 * Text -> ids is two steps. A pre-tokenizer cuts the text into pieces; each
 * piece is byte-mapped (GPT-2 byte -> code point table) and BPE-merged on its
 * own. Two pre-tokenizers are built in:
 *
 *   DS4_PRETOK_OFFICIAL  the pre-tokenizer of DeepSeek's tokenizer.json: three
 *                        regex splits (behaviour "Isolated"), run with PCRE2 in
 *                        UTF + UCP mode. Agrees id for id with Hugging Face
 *                        `tokenizers` (tests/python/test_tokenizer_oracle.py).
 *   DS4_PRETOK_DS4       antirez/ds4's hand-written ASCII-centred scanner
 *                        (docs: deepseek-v4-flash.md 5.2), rule for rule, for
 *                        bit-parity with ds4 prompts.
 *
 * Input bytes that are not valid UTF-8 never fail and are never dropped:
 *   - official: every maximal invalid subpart (the unit that Python's and
 *     Rust's lossy UTF-8 decoders turn into one U+FFFD) is split as if it were
 *     U+FFFD (a \p{So} symbol), but its piece keeps the original bytes, which
 *     the byte-level BPE encodes like any other bytes. So the pieces are those
 *     Hugging Face makes of the lossy-decoded text, and decoding the ids gives
 *     back the input bytes exactly.
 *   - ds4: bytes are scanned exactly as ds4 scans them (every byte >= 0x80 is
 *     "letter-like"; a lead byte claims its sequence length without checking
 *     the continuation bytes).
 * A NUL byte is an ordinary byte here (ds4 works on C strings and stops at it).
 *
 * Decoding one token follows ds4 [ds4_token_text]: a token string containing
 * U+FF5C is emitted verbatim; otherwise each code point is mapped back to its
 * byte and unmapped code points are dropped. The streaming decoder (ds4_detok)
 * turns the byte stream into valid UTF-8, holding back an incomplete
 * character until the next token completes it; invalid sequences come out as
 * U+FFFD, one per maximal invalid subpart (the same text as Rust's
 * String::from_utf8_lossy of the whole byte stream, i.e. Hugging Face decode).
 *
 * A loaded tokenizer is immutable: every function taking a const tokenizer is
 * safe to call from several threads at once.
 */
#ifndef DS4_TEXT_TOKENIZER_H
#define DS4_TEXT_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/gguf.h"
#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ds4_tokenizer ds4_tokenizer;

typedef enum ds4_pretok {
    DS4_PRETOK_OFFICIAL = 0, /* tokenizer.json regexes (default) */
    DS4_PRETOK_DS4 = 1,      /* ds4's ASCII-centred scanner */
} ds4_pretok;

/* The seven special strings of the prompt format, looked up by string. */
typedef enum ds4_special {
    DS4_SPECIAL_BOS = 0,       /* <｜begin▁of▁sentence｜> */
    DS4_SPECIAL_EOS,           /* <｜end▁of▁sentence｜> */
    DS4_SPECIAL_USER,          /* <｜User｜> */
    DS4_SPECIAL_ASSISTANT,     /* <｜Assistant｜> */
    DS4_SPECIAL_THINK,         /* <think> */
    DS4_SPECIAL_THINK_END,     /* </think> */
    DS4_SPECIAL_DSML,          /* ｜DSML｜ */
    DS4_SPECIAL_COUNT,
} ds4_special;

/* The UTF-8 string of a special token. */
const char *ds4_special_text(ds4_special s);

/* Load from GGUF metadata: tokenizer.ggml.tokens (id = index), .merges (rank =
 * index, "left right"), optional .token_type (same length as tokens) and
 * optional .model (must be "gpt2" when present). A missing special string is
 * an error naming it. The tokenizer copies what it needs: `f` may be closed. */
ds4_status ds4_tokenizer_load(const gguf_file *f, ds4_tokenizer **out, ds4_error *err);

/* Build from tables (what load does after reading the GGUF arrays; used by
 * tests and the fuzzer). Strings are (pointer, length); types may be NULL. */
typedef struct ds4_strref {
    const char *ptr;
    size_t len;
} ds4_strref;
ds4_status ds4_tokenizer_build(const ds4_strref *tokens, int64_t n_tokens, const int32_t *types,
                               const ds4_strref *merges, int64_t n_merges, ds4_tokenizer **out, ds4_error *err);

void ds4_tokenizer_free(ds4_tokenizer *t);

int32_t ds4_tokenizer_n_vocab(const ds4_tokenizer *t);
int32_t ds4_tokenizer_special(const ds4_tokenizer *t, ds4_special s);
/* Raw vocabulary string (byte-mapped form) and GGUF token type; NULL / 0 when
 * id is out of range. */
const char *ds4_tokenizer_token_str(const ds4_tokenizer *t, int32_t id, size_t *len);
int32_t ds4_tokenizer_token_type(const ds4_tokenizer *t, int32_t id);

/* Tokenize `len` bytes of `text` (need not be NUL-terminated, may hold any
 * bytes). specials = false: plain text. specials = true: "rendered chat" mode
 * - every occurrence of the seven special strings becomes its id and the text
 * between occurrences is tokenized on its own (no escaping). Never adds BOS.
 * On success *ids is malloc'd (free it; NULL when *n == 0). */
ds4_status ds4_tokenize(const ds4_tokenizer *t, const char *text, size_t len, ds4_pretok mode, bool specials,
                        int32_t **ids, int64_t *n, ds4_error *err);

/* Pre-tokenizer only: calls fn once per piece, in order (the pieces tile the
 * text). A non-OK status from fn stops the scan and is returned. */
typedef ds4_status (*ds4_piece_fn)(void *ctx, const char *piece, size_t len, ds4_error *err);
ds4_status ds4_pretokenize(const ds4_tokenizer *t, const char *text, size_t len, ds4_pretok mode, ds4_piece_fn fn,
                           void *ctx, ds4_error *err);

/* The decoded bytes of one token. Writes min(length, cap) bytes to buf and
 * returns the full length (0 for an id outside the vocabulary). */
size_t ds4_token_bytes(const ds4_tokenizer *t, int32_t id, char *buf, size_t cap);
/* The longest ds4_token_bytes of any token. */
size_t ds4_tokenizer_max_token_bytes(const ds4_tokenizer *t);

/* Incremental decoder: feed ids, get valid UTF-8 out. */
typedef struct ds4_detok {
    const ds4_tokenizer *tok;
    unsigned char held[4]; /* an incomplete UTF-8 sequence waiting for more bytes */
    int n_held;
} ds4_detok;

void ds4_detok_init(ds4_detok *d, const ds4_tokenizer *t);
/* Bytes that one push or flush may write at most. */
size_t ds4_detok_bound(const ds4_tokenizer *t);
/* Decode one id; writes the now-complete UTF-8 to out (room for
 * ds4_detok_bound bytes) and returns how many bytes were written. */
size_t ds4_detok_push(ds4_detok *d, int32_t id, char *out);
/* End of stream: a held incomplete sequence comes out as U+FFFD. */
size_t ds4_detok_flush(ds4_detok *d, char *out);

/* The regexes of the official pre-tokenizer, in order (NULL-terminated list;
 * they are facts of the model and equal tokenizer.json's Split patterns). */
extern const char *const ds4_pretok_official_patterns[];

#ifdef __cplusplus
}
#endif

#endif

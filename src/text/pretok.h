/*
 * pretok.h - the two pre-tokenizers and the UTF-8 scanner they share with the
 * decoder (internal to src/text; the public entry is ds4_pretokenize).
 */
#ifndef DS4_TEXT_PRETOK_H
#define DS4_TEXT_PRETOK_H

#include <stddef.h>

#include "text/tokenizer.h"

/* What starts at s[0] (n >= 1 bytes), per Unicode's Table 3-7:
 *   UTF8_CHAR   a valid character of *adv bytes;
 *   UTF8_BAD    a maximal invalid subpart of *adv bytes (>= 1): the unit that
 *               lossy decoders (Python "replace", Rust from_utf8_lossy) turn
 *               into one U+FFFD;
 *   UTF8_SHORT  a valid but incomplete sequence that runs into the end of the
 *               buffer (*adv == n). */
enum { UTF8_CHAR = 0, UTF8_BAD = 1, UTF8_SHORT = 2 };
int text_utf8_next(const unsigned char *s, size_t n, size_t *adv);

/* Compiled official pre-tokenizer (PCRE2). Immutable after creation. */
typedef struct pretok_regex pretok_regex;
ds4_status pretok_regex_new(pretok_regex **out, ds4_error *err);
void pretok_regex_free(pretok_regex *r);

ds4_status pretok_official(const pretok_regex *r, const char *text, size_t len, ds4_piece_fn fn, void *ctx,
                           ds4_error *err);
ds4_status pretok_ds4(const char *text, size_t len, ds4_piece_fn fn, void *ctx, ds4_error *err);

#endif

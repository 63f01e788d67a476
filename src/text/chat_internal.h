/*
 * chat_internal.h - helpers shared by chat.c (rendering) and dsml.c (parsing):
 * a growable byte buffer and the small JSON scanner both directions need.
 * Not part of the library's interface.
 */
#ifndef DS4_TEXT_CHAT_INTERNAL_H
#define DS4_TEXT_CHAT_INTERNAL_H

#include <stddef.h>

#include "text/chat.h"

/* Growable buffer; an allocation failure sets `oom` and later writes are
 * dropped, so callers check once at the end. ptr is NUL-terminated when
 * non-NULL. */
typedef struct chat_buf {
    char *ptr;
    size_t len, cap;
    int oom;
} chat_buf;

void chat_buf_put(chat_buf *b, const char *s, size_t n);
void chat_buf_puts(chat_buf *b, const char *s);
void chat_buf_putc(chat_buf *b, char c);
/* Empty the buffer, keeping its memory (and any oom flag). */
void chat_buf_reset(chat_buf *b);
void chat_buf_free(chat_buf *b);
/* Hand the bytes over (an empty string when nothing was written); NULL after
 * an allocation failure, in which case the buffer is freed. */
char *chat_buf_take(chat_buf *b, size_t *len);

char *chat_strndup(const char *s, size_t n);

/* isspace() in the C locale: space, \t, \n, \v, \f, \r (what ds4 skips). */
static inline int chat_is_space(char c) {
    return c == ' ' || (c >= '\t' && c <= '\r');
}

/* Nesting limit of the JSON scanner (ds4's JSON_MAX_NESTING). */
#define CHAT_JSON_MAX_DEPTH 256

/* Scan one JSON value starting at *pos (leading whitespace skipped) and
 * advance *pos past it. Grammar: RFC 8259, with whitespace = chat_is_space;
 * `lenient_strings` also accepts raw control bytes inside strings (ds4 does).
 * Returns 1 when valid. */
int chat_json_scan(const char *s, size_t n, size_t *pos, int lenient_strings);

/* Decode the JSON string at *pos (must be '"') into out (appended) and advance.
 * \u escapes become UTF-8 (a surrogate pair one code point; a lone surrogate
 * is encoded as its 3-byte form, as ds4 does); \u0000 is rejected. Raw
 * control bytes are accepted. Returns 1 when valid. */
int chat_json_decode_string(const char *s, size_t n, size_t *pos, chat_buf *out);

/* If s[0..n) is exactly one strict JSON value surrounded by optional
 * whitespace, append it with the whitespace outside strings removed and
 * return 1; otherwise append nothing and return 0. Blank input returns 0. */
int chat_json_minify(const char *s, size_t n, chat_buf *out);

/* Append s[0..n) as a quoted JSON string the way ds4 does
 * [ds4_server.c:json_escape]: \" \\ \n \r \t, other bytes < 0x20 as \u00XX,
 * everything else (DEL, non-ASCII) raw. */
void chat_json_escape(chat_buf *b, const char *s, size_t n);

#endif

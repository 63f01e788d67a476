/* tools.h - the subcommands of the ds4server binary and their shared helpers. */
#ifndef DS4_TOOLS_H
#define DS4_TOOLS_H

#include <stdint.h>
#include <stdio.h>

#include "ds4.h"

int tool_inspect(int argc, char **argv);
int tool_dump(int argc, char **argv);
int tool_synth(int argc, char **argv);
int tool_logits(int argc, char **argv);
int tool_run(int argc, char **argv);
int tool_chat(int argc, char **argv);
int tool_convert(int argc, char **argv);
int tool_tokenize(int argc, char **argv);
int tool_parity(int argc, char **argv);
int tool_bench(int argc, char **argv);

/* Print "ds4server <cmd>: message" to stderr and return exit status 1. */
int tool_fail(const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Write bytes as a JSON string body (no quotes), escaping as RFC 8259 asks;
 * bytes that are not valid UTF-8 come out as \u00XX of the byte. */
void tool_json_escape(FILE *out, const char *s, uint64_t n);
/* Write bytes for a human: printable ASCII and valid UTF-8 as is, others \xNN. */
void tool_text_escape(FILE *out, const char *s, uint64_t n, uint64_t max_bytes);

/* Seconds on the monotonic clock (for measuring intervals). */
double tool_now(void);

/* Parse "1,2,3" (non-negative int32 ids) into a malloc'd array; NULL when
 * empty or malformed. */
int32_t *tool_parse_tokens(const char *s, int64_t *n_out);

#endif

/* util.c - small output helpers shared by the ds4server subcommands. */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <time.h>

#include "tools/tools.h"

int tool_fail(const char *cmd, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "ds4server %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 1;
}

/* Length of the valid UTF-8 sequence at s (1..4), or 0 if invalid. */
static int utf8_len(const unsigned char *s, uint64_t n) {
    unsigned char c = s[0];
    int len;
    uint32_t cp;
    if (c < 0x80) return 1;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return 0;
    if ((uint64_t)len > n) return 0;
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

void tool_json_escape(FILE *out, const char *str, uint64_t n) {
    const unsigned char *s = (const unsigned char *)str;
    for (uint64_t i = 0; i < n;) {
        unsigned char c = s[i];
        int len = utf8_len(s + i, n - i);
        if (len == 0) { fprintf(out, "\\u%04x", c); i++; continue; }
        if (len > 1) { fwrite(s + i, 1, (size_t)len, out); i += (uint64_t)len; continue; }
        switch (c) {
        case '"': fputs("\\\"", out); break;
        case '\\': fputs("\\\\", out); break;
        case '\n': fputs("\\n", out); break;
        case '\r': fputs("\\r", out); break;
        case '\t': fputs("\\t", out); break;
        default:
            if (c < 0x20 || c == 0x7f) fprintf(out, "\\u%04x", c);
            else fputc(c, out);
        }
        i++;
    }
}

void tool_text_escape(FILE *out, const char *str, uint64_t n, uint64_t max_bytes) {
    const unsigned char *s = (const unsigned char *)str;
    uint64_t i = 0;
    while (i < n && i < max_bytes) {
        int len = utf8_len(s + i, n - i);
        if (len > 1) { fwrite(s + i, 1, (size_t)len, out); i += (uint64_t)len; continue; }
        unsigned char c = s[i];
        if (len == 1 && c >= 0x20 && c < 0x7f && c != '\\') fputc(c, out);
        else if (c == '\n') fputs("\\n", out);
        else fprintf(out, "\\x%02x", c);
        i++;
    }
    if (i < n) fputs("...", out);
}

/* Parse "1,2,3" into a malloc'd array. */
int32_t *tool_parse_tokens(const char *s, int64_t *n_out) {
    int64_t cap = 16, n = 0;
    int32_t *v = malloc((size_t)cap * sizeof *v);
    const char *p = s;
    while (v && *p) {
        char *end;
        errno = 0;
        long long x = strtoll(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX) {
            free(v);
            return NULL;
        }
        if (n == cap) {
            int32_t *nv = realloc(v, (size_t)(cap *= 2) * sizeof *v);
            if (!nv) { free(v); return NULL; }
            v = nv;
        }
        v[n++] = (int32_t)x;
        p = end;
        if (*p == ',') p++;
        else if (*p) { free(v); return NULL; }
    }
    if (v && n == 0) { free(v); return NULL; }
    *n_out = n;
    return v;
}

double tool_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

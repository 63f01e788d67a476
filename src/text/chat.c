/*
 * chat.c - DeepSeek V4 chat prompt rendering (DS4 semantics).
 *
 * Owns the fixed prompt texts (Think Max prefix, tool prompt), the prompt
 * renderers of spec section 5.4 (server text, /v1/completions text, the
 * token-level helpers as segment lists), the canonical DSML rendering of tool
 * calls of 5.5, and the byte buffer / JSON scanner that dsml.c shares.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "text/chat.h"
#include "text/chat_internal.h"

/* ================================================================ buffers */

static int chat_buf_reserve(chat_buf *b, size_t extra) {
    if (b->oom) return 0;
    if (extra > SIZE_MAX - b->len - 1) {
        b->oom = 1;
        return 0;
    }
    size_t need = b->len + extra + 1;
    if (need <= b->cap) return 1;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    char *p = realloc(b->ptr, cap);
    if (!p) {
        b->oom = 1;
        return 0;
    }
    b->ptr = p;
    b->cap = cap;
    return 1;
}

void chat_buf_put(chat_buf *b, const char *s, size_t n) {
    if (!chat_buf_reserve(b, n)) return;
    if (n) memcpy(b->ptr + b->len, s, n);
    b->len += n;
    b->ptr[b->len] = '\0';
}

void chat_buf_puts(chat_buf *b, const char *s) {
    if (s) chat_buf_put(b, s, strlen(s));
}

void chat_buf_putc(chat_buf *b, char c) {
    chat_buf_put(b, &c, 1);
}

void chat_buf_reset(chat_buf *b) {
    b->len = 0;
    if (b->ptr) b->ptr[0] = '\0';
}

void chat_buf_free(chat_buf *b) {
    free(b->ptr);
    memset(b, 0, sizeof(*b));
}

char *chat_buf_take(chat_buf *b, size_t *len) {
    if (!b->oom && !b->ptr) chat_buf_reserve(b, 0);
    if (b->oom) {
        chat_buf_free(b);
        if (len) *len = 0;
        return NULL;
    }
    if (!b->ptr) return NULL;
    b->ptr[b->len] = '\0';
    char *p = b->ptr;
    if (len) *len = b->len;
    memset(b, 0, sizeof(*b));
    return p;
}

char *chat_strndup(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (!p) return NULL;
    if (n) memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

/* ================================================================ JSON scanner */

static void json_skip_ws(const char *s, size_t n, size_t *pos) {
    while (*pos < n && chat_is_space(s[*pos])) (*pos)++;
}

static int json_hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Reads the 4 hex digits of a \uXXXX escape whose backslash is at s[i]. */
static int json_read_u16(const char *s, size_t n, size_t i, uint32_t *out) {
    if (n - i < 6 || s[i] != '\\' || s[i + 1] != 'u') return 0;
    uint32_t v = 0;
    for (size_t k = 0; k < 4; k++) {
        int h = json_hex_digit(s[i + 2 + k]);
        if (h < 0) return 0;
        v = (v << 4) | (uint32_t)h;
    }
    *out = v;
    return 1;
}

static int json_scan_string(const char *s, size_t n, size_t *pos, int lenient) {
    size_t i = *pos;
    if (i >= n || s[i] != '"') return 0;
    i++;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"') {
            *pos = i + 1;
            return 1;
        }
        if (c == '\\') {
            if (i + 1 >= n) return 0;
            char e = s[i + 1];
            if (e == 'u') {
                uint32_t v;
                if (!json_read_u16(s, n, i, &v)) return 0;
                i += 6;
            } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' ||
                       e == 'r' || e == 't') {
                i += 2;
            } else {
                return 0;
            }
            continue;
        }
        if (c == 0 || (c < 0x20 && !lenient)) return 0;
        i++;
    }
    return 0;
}

static int json_is_digit(char c) {
    return c >= '0' && c <= '9';
}

static int json_scan_number(const char *s, size_t n, size_t *pos) {
    size_t i = *pos;
    if (i < n && s[i] == '-') i++;
    if (i >= n || !json_is_digit(s[i])) return 0;
    if (s[i] == '0') {
        i++;
    } else {
        while (i < n && json_is_digit(s[i])) i++;
    }
    if (i < n && s[i] == '.') {
        i++;
        if (i >= n || !json_is_digit(s[i])) return 0;
        while (i < n && json_is_digit(s[i])) i++;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= n || !json_is_digit(s[i])) return 0;
        while (i < n && json_is_digit(s[i])) i++;
    }
    *pos = i;
    return 1;
}

static int json_scan_literal(const char *s, size_t n, size_t *pos, const char *lit) {
    size_t k = strlen(lit);
    if (n - *pos < k || memcmp(s + *pos, lit, k) != 0) return 0;
    *pos += k;
    return 1;
}

static int json_scan_value(const char *s, size_t n, size_t *pos, int depth, int lenient) {
    json_skip_ws(s, n, pos);
    if (*pos >= n) return 0;
    char c = s[*pos];
    if (c == '"') return json_scan_string(s, n, pos, lenient);
    if (c == 't') return json_scan_literal(s, n, pos, "true");
    if (c == 'f') return json_scan_literal(s, n, pos, "false");
    if (c == 'n') return json_scan_literal(s, n, pos, "null");
    if (c == '-' || json_is_digit(c)) return json_scan_number(s, n, pos);
    if (c != '{' && c != '[') return 0;
    if (depth >= CHAT_JSON_MAX_DEPTH) return 0;
    char close = c == '{' ? '}' : ']';
    (*pos)++;
    json_skip_ws(s, n, pos);
    if (*pos < n && s[*pos] == close) {
        (*pos)++;
        return 1;
    }
    for (;;) {
        if (c == '{') {
            json_skip_ws(s, n, pos);
            if (!json_scan_string(s, n, pos, lenient)) return 0;
            json_skip_ws(s, n, pos);
            if (*pos >= n || s[*pos] != ':') return 0;
            (*pos)++;
        }
        if (!json_scan_value(s, n, pos, depth + 1, lenient)) return 0;
        json_skip_ws(s, n, pos);
        if (*pos >= n) return 0;
        if (s[*pos] == close) {
            (*pos)++;
            return 1;
        }
        if (s[*pos] != ',') return 0;
        (*pos)++;
    }
}

int chat_json_scan(const char *s, size_t n, size_t *pos, int lenient_strings) {
    return json_scan_value(s, n, pos, 0, lenient_strings);
}

static void utf8_put(chat_buf *b, uint32_t cp) {
    char u[4];
    size_t k;
    if (cp < 0x80) {
        u[0] = (char)cp;
        k = 1;
    } else if (cp < 0x800) {
        u[0] = (char)(0xc0 | (cp >> 6));
        u[1] = (char)(0x80 | (cp & 0x3f));
        k = 2;
    } else if (cp < 0x10000) {
        u[0] = (char)(0xe0 | (cp >> 12));
        u[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        u[2] = (char)(0x80 | (cp & 0x3f));
        k = 3;
    } else {
        u[0] = (char)(0xf0 | (cp >> 18));
        u[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
        u[3] = (char)(0x80 | (cp & 0x3f));
        k = 4;
    }
    chat_buf_put(b, u, k);
}

int chat_json_decode_string(const char *s, size_t n, size_t *pos, chat_buf *out) {
    size_t i = *pos;
    if (i >= n || s[i] != '"') return 0;
    i++;
    while (i < n) {
        char c = s[i];
        if (c == '"') {
            *pos = i + 1;
            return 1;
        }
        if (c == '\0') return 0;
        if (c != '\\') {
            size_t run = i;
            while (run < n && s[run] != '"' && s[run] != '\\' && s[run] != '\0') run++;
            chat_buf_put(out, s + i, run - i);
            i = run;
            continue;
        }
        if (i + 1 >= n) return 0;
        char e = s[i + 1];
        const char *simple = NULL;
        switch (e) {
        case '"': simple = "\""; break;
        case '\\': simple = "\\"; break;
        case '/': simple = "/"; break;
        case 'b': simple = "\b"; break;
        case 'f': simple = "\f"; break;
        case 'n': simple = "\n"; break;
        case 'r': simple = "\r"; break;
        case 't': simple = "\t"; break;
        default: break;
        }
        if (simple) {
            chat_buf_put(out, simple, 1);
            i += 2;
            continue;
        }
        if (e != 'u') return 0;
        uint32_t cp, lo;
        if (!json_read_u16(s, n, i, &cp) || cp == 0) return 0;
        i += 6;
        if (cp >= 0xd800 && cp <= 0xdbff && json_read_u16(s, n, i, &lo) && lo >= 0xdc00 &&
            lo <= 0xdfff) {
            cp = 0x10000u + ((cp - 0xd800u) << 10) + (lo - 0xdc00u);
            i += 6;
        }
        utf8_put(out, cp);
    }
    return 0;
}

/* Copy a scanned value, dropping whitespace outside strings. */
static void json_minify_range(const char *s, size_t n, chat_buf *out) {
    int in_string = 0, escaped = 0;
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int keep = 1;
        if (in_string) {
            if (escaped) escaped = 0;
            else if (c == '\\') escaped = 1;
            else if (c == '"') in_string = 0;
        } else if (c == '"') {
            in_string = 1;
        } else if (chat_is_space(c)) {
            keep = 0;
        }
        if (!keep) {
            chat_buf_put(out, s + run, i - run);
            run = i + 1;
        }
    }
    chat_buf_put(out, s + run, n - run);
}

int chat_json_minify(const char *s, size_t n, chat_buf *out) {
    size_t pos = 0;
    json_skip_ws(s, n, &pos);
    if (pos >= n) return 0;
    size_t start = pos;
    if (!json_scan_value(s, n, &pos, 0, 0)) return 0;
    size_t end = pos;
    json_skip_ws(s, n, &pos);
    if (pos != n) return 0;
    json_minify_range(s + start, end - start, out);
    return 1;
}

void chat_json_escape(chat_buf *b, const char *s, size_t n) {
    static const char hex[] = "0123456789abcdef";
    chat_buf_putc(b, '"');
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        chat_buf_put(b, s + run, i - run);
        run = i + 1;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            chat_buf_put(b, e, 2);
        } else if (c == '\n') {
            chat_buf_puts(b, "\\n");
        } else if (c == '\r') {
            chat_buf_puts(b, "\\r");
        } else if (c == '\t') {
            chat_buf_puts(b, "\\t");
        } else {
            char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            chat_buf_put(b, e, 6);
        }
    }
    chat_buf_put(b, s + run, n - run);
    chat_buf_putc(b, '"');
}

/* ================================================================ fixed texts */

/*
 * Data of the DS4 prompt format, reproduced byte for byte because prefix-cache
 * compatibility with ds4 depends on them (tests/c/test_chat.c checks the
 * hashes). Origin: github.com/antirez/ds4 at 8d57664.
 */

/* Think Max prefix X: ds4.c DS4_REASONING_EFFORT_MAX_PREFIX. 476 bytes,
 * SHA-256 f7a24f3b3050d4a83781e9b755b316aae2ec1d9dc87562541d90bcb04d7350f7. */
static const char THINK_MAX_PREFIX[] =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n";

/* Tool prompt head P: the first string of ds4_server.c append_tools_prompt_text.
 * 1183 bytes, SHA-256
 * de87922067300def6cde0b9a5c722c3248d708fb089b088b95c64f082d3a64ea. */
static const char TOOLS_PROMPT_HEAD[] =
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. You can invoke tools "
    "by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE"
    "</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as raw text and set `string=\"true\"`. Preserve "
    "characters such as `>`, `&`, and `&&` exactly; never replace normal string characters "
    "with XML or HTML entity escapes. Only if a string value itself contains the exact closing "
    "parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the "
    "value. For all other types (numbers, booleans, arrays, objects), pass the value in JSON "
    "format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n";

/* Tool prompt tail C: the last string of ds4_server.c append_tools_prompt_text.
 * 146 bytes, SHA-256
 * fe26e2683a842d7f5378ebb38e2997e053770d962e3faae89e1d5bf8b8156498. */
static const char TOOLS_PROMPT_TAIL[] =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls. Use the exact parameter names from the schemas.";

/* The /v1/completions system text [ds4_server.c:parse_completion_request]. */
static const char COMPLETION_SYSTEM[] = "You are a helpful assistant";

static const char *const SPECIAL_TEXT[DS4_CHAT_SPECIAL_COUNT] = {
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<think>",                "</think>",             "｜DSML｜",
};

#define S_BOS SPECIAL_TEXT[DS4_CHAT_SPECIAL_BOS]
#define S_EOS SPECIAL_TEXT[DS4_CHAT_SPECIAL_EOS]
#define S_USER SPECIAL_TEXT[DS4_CHAT_SPECIAL_USER]
#define S_ASSISTANT SPECIAL_TEXT[DS4_CHAT_SPECIAL_ASSISTANT]
#define S_THINK_START SPECIAL_TEXT[DS4_CHAT_SPECIAL_THINK_START]
#define S_THINK_END SPECIAL_TEXT[DS4_CHAT_SPECIAL_THINK_END]

#define DSML_PARAM_CLOSE "</｜DSML｜parameter>"

const char *ds4_chat_special_text(ds4_chat_special special) {
    if ((unsigned)special >= DS4_CHAT_SPECIAL_COUNT) return "";
    return SPECIAL_TEXT[special];
}

const char *ds4_chat_think_max_prefix(void) {
    return THINK_MAX_PREFIX;
}

const char *ds4_chat_tools_prompt_head(void) {
    return TOOLS_PROMPT_HEAD;
}

const char *ds4_chat_tools_prompt_tail(void) {
    return TOOLS_PROMPT_TAIL;
}

/* ================================================================ modes, roles */

ds4_chat_think ds4_chat_think_for_context(ds4_chat_think mode, uint64_t ctx_size) {
    if (mode == DS4_CHAT_THINK_MAX && ctx_size < DS4_CHAT_THINK_MAX_MIN_CONTEXT) {
        return DS4_CHAT_THINK_HIGH;
    }
    return mode;
}

const char *ds4_chat_think_name(ds4_chat_think mode) {
    switch (mode) {
    case DS4_CHAT_THINK_NONE: return "none";
    case DS4_CHAT_THINK_HIGH: return "high";
    case DS4_CHAT_THINK_MAX: return "max";
    }
    return "unknown";
}

static int think_valid(ds4_chat_think mode) {
    return mode == DS4_CHAT_THINK_NONE || mode == DS4_CHAT_THINK_HIGH || mode == DS4_CHAT_THINK_MAX;
}

ds4_chat_role ds4_chat_role_from_name(const char *name) {
    if (!name || !strcmp(name, "user")) return DS4_CHAT_ROLE_USER;
    if (!strcmp(name, "system") || !strcmp(name, "developer")) return DS4_CHAT_ROLE_SYSTEM;
    if (!strcmp(name, "assistant")) return DS4_CHAT_ROLE_ASSISTANT;
    if (!strcmp(name, "tool") || !strcmp(name, "function")) return DS4_CHAT_ROLE_TOOL;
    return DS4_CHAT_ROLE_OTHER;
}

/* ================================================================ output helpers */

static ds4_status take_output(chat_buf *b, char **out, size_t *out_len, ds4_error *err) {
    size_t len = 0;
    char *p = chat_buf_take(b, &len);
    if (!p) {
        *out = NULL;
        if (out_len) *out_len = 0;
        return ds4_error_set(err, DS4_ERR_NOMEM, "chat: out of memory while rendering");
    }
    *out = p;
    if (out_len) *out_len = len;
    return DS4_OK;
}

/* Append s, writing the '<' of every occurrence of `tag` as `lt` (the one
 * escape ds4 applies inside tool results and DSML values). */
static void put_escaping_tag(chat_buf *b, const char *s, const char *tag, const char *lt) {
    if (!s) return;
    size_t tag_len = strlen(tag);
    const char *run = s;
    for (const char *p = s; *p; p++) {
        if (*p == '<' && !strncmp(p, tag, tag_len)) {
            chat_buf_put(b, run, (size_t)(p - run));
            chat_buf_puts(b, lt);
            run = p + 1;
        }
    }
    chat_buf_puts(b, run);
}

/* NAME and KEY attributes: & < > " as entities [ds4_server.c:append_dsml_attr_escaped]. */
static void put_attr_escaped(chat_buf *b, const char *s, size_t n) {
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        const char *e = NULL;
        switch (s[i]) {
        case '&': e = "&amp;"; break;
        case '<': e = "&lt;"; break;
        case '>': e = "&gt;"; break;
        case '"': e = "&quot;"; break;
        default: continue;
        }
        chat_buf_put(b, s + run, i - run);
        chat_buf_puts(b, e);
        run = i + 1;
    }
    chat_buf_put(b, s + run, n - run);
}

/* ================================================================ tool schemas */

static void put_schema_line(chat_buf *b, const ds4_chat_tool *tool) {
    if (tool->schema_json) {
        chat_buf_puts(b, tool->schema_json);
        return;
    }
    if (!tool->name && !tool->description && !tool->parameters) return;
    const char *name = tool->name ? tool->name : "";
    const char *desc = tool->description ? tool->description : "";
    chat_buf_puts(b, "{\"name\":");
    chat_json_escape(b, name, strlen(name));
    chat_buf_puts(b, ",\"description\":");
    chat_json_escape(b, desc, strlen(desc));
    chat_buf_puts(b, ",\"parameters\":");
    chat_buf_puts(b, tool->parameters ? tool->parameters : "{\"type\":\"object\",\"properties\":{}}");
    chat_buf_putc(b, '}');
}

ds4_status ds4_chat_tool_schema_line(const ds4_chat_tool *tool, char **out, ds4_error *err) {
    if (!tool || !out) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL tool or output");
    chat_buf b = {0};
    put_schema_line(&b, tool);
    return take_output(&b, out, NULL, err);
}

ds4_status ds4_chat_tool_schema_from_openai(const char *tool_json, char **out, ds4_error *err) {
    if (!tool_json || !out) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL tool JSON or output");
    *out = NULL;
    size_t n = strlen(tool_json), pos = 0;
    json_skip_ws(tool_json, n, &pos);
    size_t start = pos;
    if (!json_scan_value(tool_json, n, &pos, 0, 1)) {
        return ds4_error_set(err, DS4_ERR_FORMAT, "chat: tool definition is not valid JSON");
    }
    size_t end = pos;
    const char *line = tool_json + start;
    size_t line_len = end - start;
    if (tool_json[start] == '{') {
        /* Look for a top-level "function" member; the scan above validated the object. */
        size_t p = start + 1;
        chat_buf key = {0};
        for (;;) {
            json_skip_ws(tool_json, end, &p);
            if (p >= end || tool_json[p] != '"') break;
            chat_buf_reset(&key);
            if (!chat_json_decode_string(tool_json, end, &p, &key)) break;
            json_skip_ws(tool_json, end, &p);
            p++; /* ':' */
            json_skip_ws(tool_json, end, &p);
            size_t vstart = p;
            json_scan_value(tool_json, end, &p, 0, 1);
            if (!key.oom && key.ptr && !strcmp(key.ptr, "function")) {
                line = tool_json + vstart;
                line_len = p - vstart;
                break;
            }
            json_skip_ws(tool_json, end, &p);
            if (p < end && tool_json[p] == ',') p++;
        }
        int oom = key.oom;
        chat_buf_free(&key);
        if (oom) return ds4_error_set(err, DS4_ERR_NOMEM, "chat: out of memory");
    }
    *out = chat_strndup(line, line_len);
    if (!*out) return ds4_error_set(err, DS4_ERR_NOMEM, "chat: out of memory");
    return DS4_OK;
}

/* Schema lines joined by "\n", empty lines skipped [ds4_server.c:append_raw_json_line]. */
static void put_schema_lines(chat_buf *b, const ds4_chat_tool *tools, size_t n_tools) {
    size_t before = b->len;
    for (size_t i = 0; i < n_tools; i++) {
        size_t mark = b->len;
        if (b->len > before) chat_buf_putc(b, '\n');
        size_t line_start = b->len;
        put_schema_line(b, &tools[i]);
        if (b->len == line_start) b->len = mark; /* empty line: drop its separator too */
        if (b->ptr) b->ptr[b->len] = '\0';
    }
}

/* P + lines + C, or nothing when there are no non-empty lines. */
static void put_tools_prompt(chat_buf *b, const ds4_chat_tool *tools, size_t n_tools) {
    chat_buf lines = {0};
    put_schema_lines(&lines, tools, n_tools);
    if (lines.oom) b->oom = 1;
    if (lines.len) {
        chat_buf_puts(b, TOOLS_PROMPT_HEAD);
        chat_buf_put(b, lines.ptr, lines.len);
        chat_buf_puts(b, TOOLS_PROMPT_TAIL);
    }
    chat_buf_free(&lines);
}

ds4_status ds4_chat_render_tools_prompt(const ds4_chat_tool *tools, size_t n_tools, char **out,
                                        size_t *out_len, ds4_error *err) {
    if (!out || (n_tools && !tools)) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL tools or output");
    chat_buf b = {0};
    put_tools_prompt(&b, tools, n_tools);
    return take_output(&b, out, out_len, err);
}

/* ================================================================ DSML tool calls */

static void put_dsml_parameter(chat_buf *b, const char *key, size_t key_len, int is_string,
                               const char *value) {
    chat_buf_puts(b, "<｜DSML｜parameter name=\"");
    put_attr_escaped(b, key, key_len);
    chat_buf_puts(b, is_string ? "\" string=\"true\">" : "\" string=\"false\">");
    put_escaping_tag(b, value, DSML_PARAM_CLOSE, is_string ? "&lt;" : "\\u003c");
    chat_buf_puts(b, DSML_PARAM_CLOSE "\n");
}

/*
 * One parameter line per member of the arguments object, in the client's key
 * order, duplicates kept [ds4_server.c:append_dsml_arguments_from_json]. The
 * object is read like ds4's json_args_parse: members may be separated by ','
 * or nothing and text after the closing '}' is ignored; member values are
 * strict JSON here (ds4 reads numbers with strtod). Returns 0, leaving b
 * untouched, when the arguments are not such an object.
 */
static int put_dsml_arguments(chat_buf *b, const char *json) {
    if (!json) return 0;
    size_t n = strlen(json), p = 0;
    chat_buf lines = {0}, key = {0}, val = {0};
    int ok = 0;
    json_skip_ws(json, n, &p);
    if (p >= n || json[p] != '{') goto done;
    p++;
    json_skip_ws(json, n, &p);
    while (p < n && json[p] != '}') {
        chat_buf_reset(&key);
        chat_buf_reset(&val);
        if (!chat_json_decode_string(json, n, &p, &key)) goto done;
        json_skip_ws(json, n, &p);
        if (p >= n || json[p] != ':') goto done;
        p++;
        json_skip_ws(json, n, &p);
        int is_string = p < n && json[p] == '"';
        if (is_string) {
            if (!chat_json_decode_string(json, n, &p, &val)) goto done;
        } else {
            size_t start = p;
            if (!json_scan_value(json, n, &p, 0, 1)) goto done;
            json_minify_range(json + start, p - start, &val);
        }
        put_dsml_parameter(&lines, key.ptr ? key.ptr : "", key.len, is_string, val.ptr ? val.ptr : "");
        json_skip_ws(json, n, &p);
        if (p < n && json[p] == ',') p++;
        json_skip_ws(json, n, &p);
    }
    if (p >= n) goto done;
    if (lines.oom || key.oom || val.oom) {
        b->oom = 1;
    } else {
        chat_buf_put(b, lines.ptr, lines.len);
    }
    ok = 1;
done:
    chat_buf_free(&lines);
    chat_buf_free(&key);
    chat_buf_free(&val);
    return ok;
}

/* The shared raw block when every call carries the same non-empty raw_dsml. */
static const char *shared_raw_dsml(const ds4_chat_tool_call *calls, size_t n_calls) {
    if (n_calls == 0 || !calls[0].raw_dsml || !calls[0].raw_dsml[0]) return NULL;
    for (size_t i = 1; i < n_calls; i++) {
        if (!calls[i].raw_dsml || strcmp(calls[i].raw_dsml, calls[0].raw_dsml) != 0) return NULL;
    }
    return calls[0].raw_dsml;
}

static void put_tool_calls(chat_buf *b, const ds4_chat_tool_call *calls, size_t n_calls) {
    if (n_calls == 0) return;
    const char *raw = shared_raw_dsml(calls, n_calls);
    if (raw) {
        chat_buf_puts(b, raw);
        return;
    }
    chat_buf_puts(b, "\n\n<｜DSML｜tool_calls>\n");
    for (size_t i = 0; i < n_calls; i++) {
        const char *name = calls[i].name ? calls[i].name : "";
        chat_buf_puts(b, "<｜DSML｜invoke name=\"");
        put_attr_escaped(b, name, strlen(name));
        chat_buf_puts(b, "\">\n");
        if (!put_dsml_arguments(b, calls[i].arguments)) {
            put_dsml_parameter(b, "arguments", 9, 1, calls[i].arguments ? calls[i].arguments : "");
        }
        chat_buf_puts(b, "</｜DSML｜invoke>\n");
    }
    chat_buf_puts(b, "</｜DSML｜tool_calls>");
}

ds4_status ds4_chat_render_tool_calls(const ds4_chat_tool_call *calls, size_t n_calls, char **out,
                                      size_t *out_len, ds4_error *err) {
    if (!out || (n_calls && !calls)) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL calls or output");
    chat_buf b = {0};
    put_tool_calls(&b, calls, n_calls);
    return take_output(&b, out, out_len, err);
}

/* ================================================================ conversation */

static int role_is_user_like(ds4_chat_role role) {
    return role == DS4_CHAT_ROLE_USER || role == DS4_CHAT_ROLE_TOOL;
}

/* Tools active in the request, an assistant message with calls, or any tool
 * result: every earlier assistant turn then keeps its reasoning
 * [ds4_server.c:chat_history_uses_tool_context]. */
static int uses_tool_context(const ds4_chat_conversation *conv, int tools_active) {
    if (tools_active) return 1;
    for (size_t i = 0; i < conv->n_messages; i++) {
        const ds4_chat_message *m = &conv->messages[i];
        if (m->role == DS4_CHAT_ROLE_ASSISTANT && m->n_calls > 0) return 1;
        if (m->role == DS4_CHAT_ROLE_TOOL) return 1;
    }
    return 0;
}

ds4_status ds4_chat_render(const ds4_chat_conversation *conv, char **out, size_t *out_len,
                           ds4_error *err) {
    if (!conv || !out) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL conversation or output");
    *out = NULL;
    if (out_len) *out_len = 0;
    if ((conv->n_messages && !conv->messages) || (conv->n_tools && !conv->tools)) {
        return ds4_error_set(err, DS4_ERR_INVALID, "chat: message or tool count without an array");
    }
    if (!think_valid(conv->think)) {
        return ds4_error_set(err, DS4_ERR_INVALID, "chat: unknown thinking mode %d", (int)conv->think);
    }
    for (size_t i = 0; i < conv->n_messages; i++) {
        if (conv->messages[i].n_calls && !conv->messages[i].calls) {
            return ds4_error_set(err, DS4_ERR_INVALID, "chat: message %zu has n_calls without calls", i);
        }
    }
    const ds4_chat_think think = ds4_chat_think_for_context(conv->think, conv->ctx_size);
    const int thinking = think != DS4_CHAT_THINK_NONE;

    /* System block: tool prompt first, then every system message. */
    chat_buf system = {0};
    if (!conv->tool_choice_none) put_tools_prompt(&system, conv->tools, conv->n_tools);
    const int tools_active = system.len > 0;
    for (size_t i = 0; i < conv->n_messages; i++) {
        const ds4_chat_message *m = &conv->messages[i];
        if (m->role != DS4_CHAT_ROLE_SYSTEM) continue;
        if (system.len) chat_buf_puts(&system, "\n\n");
        chat_buf_puts(&system, m->content);
    }

    const int tool_context = uses_tool_context(conv, tools_active);
    size_t after_last_user = 0; /* index one past the last user/tool message */
    for (size_t i = 0; i < conv->n_messages; i++) {
        if (role_is_user_like(conv->messages[i].role)) after_last_user = i + 1;
    }

    chat_buf b = {0};
    chat_buf_puts(&b, S_BOS);
    if (think == DS4_CHAT_THINK_MAX) chat_buf_puts(&b, THINK_MAX_PREFIX);
    if (system.len) chat_buf_put(&b, system.ptr, system.len);
    if (system.oom) b.oom = 1;
    chat_buf_free(&system);

    int pending_assistant = 0; /* last rendered message was a user or tool message */
    int pending_tool = 0;      /* last rendered message was a tool result */
    for (size_t i = 0; i < conv->n_messages; i++) {
        const ds4_chat_message *m = &conv->messages[i];
        switch (m->role) {
        case DS4_CHAT_ROLE_USER:
            chat_buf_puts(&b, S_USER);
            chat_buf_puts(&b, m->content);
            pending_assistant = 1;
            pending_tool = 0;
            break;
        case DS4_CHAT_ROLE_TOOL:
            if (!pending_tool) chat_buf_puts(&b, S_USER);
            chat_buf_puts(&b, "<tool_result>");
            put_escaping_tag(&b, m->content, "</tool_result>", "&lt;");
            chat_buf_puts(&b, "</tool_result>");
            pending_assistant = 1;
            pending_tool = 1;
            break;
        case DS4_CHAT_ROLE_ASSISTANT:
            if (pending_assistant) {
                chat_buf_puts(&b, S_ASSISTANT);
                if (thinking && (tool_context || i >= after_last_user)) {
                    chat_buf_puts(&b, S_THINK_START);
                    chat_buf_puts(&b, m->reasoning);
                }
                chat_buf_puts(&b, S_THINK_END);
            }
            chat_buf_puts(&b, m->content);
            put_tool_calls(&b, m->calls, m->n_calls);
            chat_buf_puts(&b, S_EOS);
            pending_assistant = 0;
            pending_tool = 0;
            break;
        case DS4_CHAT_ROLE_SYSTEM:
        case DS4_CHAT_ROLE_OTHER:
        default:
            break;
        }
    }
    if (pending_assistant) {
        chat_buf_puts(&b, S_ASSISTANT);
        chat_buf_puts(&b, thinking ? S_THINK_START : S_THINK_END);
    }
    return take_output(&b, out, out_len, err);
}

ds4_status ds4_chat_render_completion(const char *prompt, ds4_chat_think think, uint64_t ctx_size,
                                      char **out, size_t *out_len, ds4_error *err) {
    if (!out) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL output");
    *out = NULL;
    if (!think_valid(think)) return ds4_error_set(err, DS4_ERR_INVALID, "chat: unknown thinking mode %d", (int)think);
    think = ds4_chat_think_for_context(think, ctx_size);
    chat_buf b = {0};
    chat_buf_puts(&b, S_BOS);
    if (think == DS4_CHAT_THINK_MAX) chat_buf_puts(&b, THINK_MAX_PREFIX);
    chat_buf_puts(&b, COMPLETION_SYSTEM);
    chat_buf_puts(&b, S_USER);
    chat_buf_puts(&b, prompt);
    chat_buf_puts(&b, S_ASSISTANT);
    chat_buf_puts(&b, think != DS4_CHAT_THINK_NONE ? S_THINK_START : S_THINK_END);
    return take_output(&b, out, out_len, err);
}

/* ================================================================ segments */

void ds4_chat_segments_free(ds4_chat_segments *segs) {
    if (!segs) return;
    for (size_t i = 0; i < segs->n; i++) free(segs->v[i].text);
    free(segs->v);
    memset(segs, 0, sizeof(*segs));
}

static ds4_status segments_grow(ds4_chat_segments *segs, ds4_error *err) {
    if (segs->n < segs->cap) return DS4_OK;
    size_t cap = segs->cap ? segs->cap * 2 : 16;
    ds4_chat_segment *v = realloc(segs->v, cap * sizeof(*v));
    if (!v) return ds4_error_set(err, DS4_ERR_NOMEM, "chat: out of memory for segments");
    segs->v = v;
    segs->cap = cap;
    return DS4_OK;
}

ds4_status ds4_chat_segments_push_special(ds4_chat_segments *segs, ds4_chat_special special,
                                          ds4_error *err) {
    if (!segs || (unsigned)special >= DS4_CHAT_SPECIAL_COUNT) {
        return ds4_error_set(err, DS4_ERR_INVALID, "chat: bad segment list or special marker");
    }
    ds4_status st = segments_grow(segs, err);
    if (st != DS4_OK) return st;
    segs->v[segs->n++] = (ds4_chat_segment){.is_special = 1, .special = special};
    return DS4_OK;
}

ds4_status ds4_chat_segments_push_text(ds4_chat_segments *segs, const char *text, size_t len,
                                       ds4_error *err) {
    if (!segs || (len && !text)) return ds4_error_set(err, DS4_ERR_INVALID, "chat: bad segment list or text");
    if (len == 0) return DS4_OK;
    ds4_status st = segments_grow(segs, err);
    if (st != DS4_OK) return st;
    char *copy = chat_strndup(text, len);
    if (!copy) return ds4_error_set(err, DS4_ERR_NOMEM, "chat: out of memory for segments");
    segs->v[segs->n++] = (ds4_chat_segment){.is_special = 0, .text = copy, .len = len};
    return DS4_OK;
}

static ds4_status push_str(ds4_chat_segments *segs, const char *s, ds4_error *err) {
    return ds4_chat_segments_push_text(segs, s ? s : "", s ? strlen(s) : 0, err);
}

ds4_status ds4_chat_encode_prompt(ds4_chat_segments *segs, const char *system, const char *prompt,
                                  ds4_chat_think think, uint64_t ctx_size, ds4_error *err) {
    if (!segs) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL segment list");
    if (!think_valid(think)) return ds4_error_set(err, DS4_ERR_INVALID, "chat: unknown thinking mode %d", (int)think);
    think = ds4_chat_think_for_context(think, ctx_size);
    ds4_status st = ds4_chat_segments_push_special(segs, DS4_CHAT_SPECIAL_BOS, err);
    if (st == DS4_OK && think == DS4_CHAT_THINK_MAX) st = push_str(segs, THINK_MAX_PREFIX, err);
    if (st == DS4_OK) st = push_str(segs, system, err);
    if (st == DS4_OK) st = ds4_chat_segments_push_special(segs, DS4_CHAT_SPECIAL_USER, err);
    if (st == DS4_OK) st = push_str(segs, prompt, err);
    if (st == DS4_OK) st = ds4_chat_append_assistant_prefix(segs, think, err);
    return st;
}

ds4_status ds4_chat_append_message_segments(ds4_chat_segments *segs, const char *role,
                                            const char *content, ds4_error *err) {
    if (!segs) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL segment list");
    if (!role) role = "user";
    if (!content) content = "";
    ds4_status st = DS4_OK;
    if (!strcmp(role, "system") || !strcmp(role, "developer")) {
        return push_str(segs, content, err);
    }
    if (!strcmp(role, "assistant")) {
        st = ds4_chat_segments_push_special(segs, DS4_CHAT_SPECIAL_ASSISTANT, err);
        if (st == DS4_OK && strncmp(content, S_THINK_START, strlen(S_THINK_START)) != 0 &&
            strncmp(content, S_THINK_END, strlen(S_THINK_END)) != 0) {
            st = ds4_chat_segments_push_special(segs, DS4_CHAT_SPECIAL_THINK_END, err);
        }
        if (st == DS4_OK) st = push_str(segs, content, err);
        return st;
    }
    st = ds4_chat_segments_push_special(segs, DS4_CHAT_SPECIAL_USER, err);
    if (st == DS4_OK && (!strcmp(role, "tool") || !strcmp(role, "function"))) {
        st = push_str(segs, "Tool: ", err);
    }
    if (st == DS4_OK) st = push_str(segs, content, err);
    return st;
}

ds4_status ds4_chat_append_assistant_prefix(ds4_chat_segments *segs, ds4_chat_think think,
                                            ds4_error *err) {
    ds4_status st = ds4_chat_segments_push_special(segs, DS4_CHAT_SPECIAL_ASSISTANT, err);
    if (st != DS4_OK) return st;
    return ds4_chat_segments_push_special(
        segs, think != DS4_CHAT_THINK_NONE ? DS4_CHAT_SPECIAL_THINK_START : DS4_CHAT_SPECIAL_THINK_END, err);
}

ds4_status ds4_chat_split_rendered(const char *text, ds4_chat_segments *segs, ds4_error *err) {
    if (!segs) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL segment list");
    if (!text) text = "";
    size_t lens[DS4_CHAT_SPECIAL_COUNT];
    for (int k = 0; k < DS4_CHAT_SPECIAL_COUNT; k++) lens[k] = strlen(SPECIAL_TEXT[k]);
    const char *span = text;
    const char *p = text;
    ds4_status st = DS4_OK;
    while (*p && st == DS4_OK) {
        int hit = -1;
        /* Every special string starts with '<' or the first byte of U+FF5C. */
        if (*p == '<' || *p == '\xef') {
            for (int k = 0; k < DS4_CHAT_SPECIAL_COUNT; k++) {
                if (!strncmp(p, SPECIAL_TEXT[k], lens[k])) {
                    hit = k;
                    break;
                }
            }
        }
        if (hit < 0) {
            p++;
            continue;
        }
        st = ds4_chat_segments_push_text(segs, span, (size_t)(p - span), err);
        if (st == DS4_OK) st = ds4_chat_segments_push_special(segs, (ds4_chat_special)hit, err);
        p += lens[hit];
        span = p;
    }
    if (st == DS4_OK) st = ds4_chat_segments_push_text(segs, span, (size_t)(p - span), err);
    return st;
}

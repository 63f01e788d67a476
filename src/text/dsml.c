/*
 * dsml.c - reading generated replies: reasoning, content and DSML tool calls.
 *
 * One resumable state machine parses a DSML block (it can stop at any byte
 * and continue when more text arrives); the one-shot parser runs it over the
 * finished text, the stream runs it as text is generated. Semantics and the
 * deliberate differences from ds4 are documented in chat.h at
 * ds4_chat_parse_reply.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "text/chat.h"
#include "text/chat_internal.h"

#define THINK_START "<think>"
#define THINK_END "</think>"

/* The three tag spellings ds4 accepts, in the order it tries them
 * [ds4_server.c:parse_generated_message_ex]: DSML, DSML with the first bar
 * missing, plain XML. */
typedef struct dsml_tags {
    const char *calls_open_nn; /* "\n\n" + calls_open */
    const char *calls_open, *calls_close;
    const char *invoke_open, *invoke_close;
    const char *param_open, *param_close;
} dsml_tags;

#define DSML_N_STYLES 3

static const dsml_tags DSML_STYLES[DSML_N_STYLES] = {
    {"\n\n<｜DSML｜tool_calls>", "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", "<｜DSML｜invoke",
     "</｜DSML｜invoke>", "<｜DSML｜parameter", "</｜DSML｜parameter>"},
    {"\n\n<DSML｜tool_calls>", "<DSML｜tool_calls>", "</DSML｜tool_calls>", "<DSML｜invoke",
     "</DSML｜invoke>", "<DSML｜parameter", "</DSML｜parameter>"},
    {"\n\n<tool_calls>", "<tool_calls>", "</tool_calls>", "<invoke", "</invoke>", "<parameter",
     "</parameter>"},
};

/* ================================================================ small helpers */

/* 1: s[pos..] starts with lit; -1: s[pos..n) is a proper prefix of lit (more
 * text could still make it match); 0: no. */
static int match_at(const char *s, size_t n, size_t pos, const char *lit) {
    size_t k = strlen(lit);
    size_t avail = n - pos;
    if (avail >= k) return memcmp(s + pos, lit, k) == 0 ? 1 : 0;
    return memcmp(s + pos, lit, avail) == 0 ? -1 : 0;
}

static size_t skip_space(const char *s, size_t n, size_t pos) {
    while (pos < n && chat_is_space(s[pos])) pos++;
    return pos;
}

/* Start of the trailing whitespace run of s[from..end). */
static size_t trim_space_back(const char *s, size_t from, size_t end) {
    while (end > from && chat_is_space(s[end - 1])) end--;
    return end;
}

static int all_space(const char *s, size_t from, size_t n) {
    return skip_space(s, n, from) == n;
}

/* First occurrence of needle[0..k) in s[0..n) (memmem is not in C11/POSIX). */
static const char *mem_find(const char *s, size_t n, const char *needle, size_t k) {
    if (k == 0) return s;
    const char *end = s + n;
    while ((size_t)(end - s) >= k) {
        const char *p = memchr(s, needle[0], (size_t)(end - s) - k + 1);
        if (!p) return NULL;
        if (!memcmp(p, needle, k)) return p;
        s = p + 1;
    }
    return NULL;
}

static const char *find_bytes(const char *s, size_t n, size_t from, const char *lit) {
    if (!s || from > n) return NULL;
    return mem_find(s + from, n - from, lit, strlen(lit));
}

static const char *find_last_bytes(const char *s, size_t n, const char *lit) {
    const char *last = NULL, *p;
    size_t from = 0;
    while ((p = find_bytes(s, n, from, lit)) != NULL) {
        last = p;
        from = (size_t)(p - s) + 1;
    }
    return last;
}

/* Undo the entities of DSML text: &amp; &lt; &gt; &quot; &apos;; any other
 * '&' is kept [ds4_server.c:dsml_unescape_text]. */
static void dsml_unescape(chat_buf *out, const char *s, size_t n) {
    static const struct {
        const char *entity;
        char c;
    } entities[] = {{"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '&') continue;
        for (size_t e = 0; e < sizeof(entities) / sizeof(entities[0]); e++) {
            size_t k = strlen(entities[e].entity);
            if (n - i >= k && !memcmp(s + i, entities[e].entity, k)) {
                chat_buf_put(out, s + run, i - run);
                chat_buf_putc(out, entities[e].c);
                i += k - 1;
                run = i + 1;
                break;
            }
        }
    }
    chat_buf_put(out, s + run, n - run);
}

static size_t utf8_safe_limit(const char *s, size_t from, size_t limit);

/* A printable excerpt of s[pos..] (at most 24 bytes, whole UTF-8 characters,
 * control bytes as spaces) for error messages. */
static void excerpt(const char *s, size_t n, size_t pos, char *out, size_t cap) {
    size_t end = n - pos > 24 ? pos + 24 : n;
    if (end - pos + 1 > cap) end = pos + cap - 1;
    end = utf8_safe_limit(s, pos, end);
    size_t k = 0;
    for (size_t i = pos; i < end; i++) {
        unsigned char c = (unsigned char)s[i];
        out[k++] = c < 0x20 ? ' ' : (char)c;
    }
    out[k] = '\0';
}

/* ================================================================ block parser */

enum { STEP_MORE = 0, STEP_DONE = 1, STEP_ERROR = 2 };

typedef enum blk_state {
    BLK_OPEN,         /* at the opening tool_calls tag */
    BLK_ITEM,         /* between invokes: an invoke or the closing tag */
    BLK_INVOKE_TAG,   /* inside "<invoke ...>" */
    BLK_INVOKE_ITEM,  /* between parameters: a parameter or the invoke's closing tag */
    BLK_PARAM_TAG,    /* inside "<parameter ...>" */
    BLK_PARAM_PEEK,   /* no string attribute: is the body nested parameters? */
    BLK_PARAM_BODY,   /* value up to the closing parameter tag */
    BLK_NESTED_ITEM,  /* inside a nested-parameter object: a leaf or its end */
    BLK_NESTED_TAG,   /* inside a leaf's "<parameter ...>" */
    BLK_NESTED_BODY,  /* a leaf's value */
    BLK_NESTED_CLOSE, /* optional closing tag of the outer parameter */
    BLK_DONE,
    BLK_FAILED,
} blk_state;

typedef struct dsml_call {
    char *name;
    char *arguments;
} dsml_call;

typedef void (*blk_sink_fn)(void *ctx, const ds4_chat_event *event);

typedef struct dsml_block {
    const dsml_tags *tags;
    blk_state state;
    size_t pos;         /* cursor: everything before it is parsed */
    size_t scan;        /* where an unfinished search resumes */
    size_t value_start; /* first byte of the current parameter value */
    size_t end;         /* one past the closing tag, when DONE */
    char *call_name;
    chat_buf args; /* the current call's arguments JSON, as far as known */
    size_t n_args;
    char *param_name;
    int param_type; /* -1: no string attribute, 0: "false", 1: "true" */
    chat_buf nested;
    size_t n_nested;
    char *leaf_name;
    int leaf_type;
    dsml_call *calls;
    size_t n_calls, cap_calls;
    int oom;
    char error[DS4_ERROR_MSG_MAX - 32];
    blk_sink_fn sink;
    void *sink_ctx;
} dsml_block;

static void blk_init(dsml_block *b, const dsml_tags *tags, size_t tag_pos, blk_sink_fn sink, void *ctx) {
    memset(b, 0, sizeof(*b));
    b->tags = tags;
    b->state = BLK_OPEN;
    b->pos = tag_pos;
    b->sink = sink;
    b->sink_ctx = ctx;
}

static void blk_free(dsml_block *b) {
    free(b->call_name);
    free(b->param_name);
    free(b->leaf_name);
    chat_buf_free(&b->args);
    chat_buf_free(&b->nested);
    for (size_t i = 0; i < b->n_calls; i++) {
        free(b->calls[i].name);
        free(b->calls[i].arguments);
    }
    free(b->calls);
    memset(b, 0, sizeof(*b));
}

static void blk_emit(dsml_block *b, ds4_chat_event_kind kind, const char *name, const char *text, size_t len) {
    if (!b->sink) return;
    ds4_chat_event ev = {.kind = kind, .call_index = b->n_calls, .name = name, .text = text, .len = len};
    b->sink(b->sink_ctx, &ev);
}

DS4_PRINTF(2, 3)
static int blk_fail(dsml_block *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->error, sizeof(b->error), fmt, ap);
    va_end(ap);
    b->state = BLK_FAILED;
    return STEP_ERROR;
}

static int blk_nomem(dsml_block *b) {
    b->oom = 1;
    return blk_fail(b, "out of memory");
}

/* "tool call N" or "tool call N (\"NAME\")" for messages. */
static const char *blk_where(const dsml_block *b, char *out, size_t cap) {
    if (b->call_name) snprintf(out, cap, "tool call %zu (\"%.64s\")", b->n_calls + 1, b->call_name);
    else snprintf(out, cap, "tool call %zu", b->n_calls + 1);
    return out;
}

/*
 * Attribute `attr` of the tag s[t0..t1]: the value of its `attr="..."`
 * (up to the next '"'), entity-unescaped [ds4_server.c:dsml_attr]. The
 * tag's attributes are read in order (after the tag name, each a name, '='
 * and a quoted value, separated by white space), so text inside another
 * attribute's value never counts: a parameter named `xstring=` is not a
 * `string=` attribute. Returns 1 with *out set, 0 when absent, unterminated
 * or not in that form, -1 on allocation failure.
 */
static int is_tag_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static int tag_attr(const char *s, size_t t0, size_t t1, const char *attr, char **out) {
    const size_t alen = strlen(attr);
    size_t i = t0;
    while (i < t1 && !is_tag_space(s[i])) i++; /* the tag name */
    for (;;) {
        while (i < t1 && is_tag_space(s[i])) i++;
        const size_t n0 = i;
        while (i < t1 && s[i] != '=' && !is_tag_space(s[i])) i++;
        if (i + 1 >= t1 || s[i] != '=' || s[i + 1] != '"' || i == n0) return 0;
        const size_t n1 = i, v0 = i + 2;
        const char *q = memchr(s + v0, '"', t1 - v0);
        if (!q) return 0;
        if (n1 - n0 == alen && !memcmp(s + n0, attr, alen)) {
            chat_buf v = {0};
            dsml_unescape(&v, s + v0, (size_t)(q - (s + v0)));
            chat_buf_putc(&v, '\0');
            *out = chat_buf_take(&v, NULL);
            return *out ? 1 : -1;
        }
        i = (size_t)(q - s) + 1;
    }
}

/* Parse a parameter tag whose '<' is at b->pos: name and string type. */
static int blk_param_tag(dsml_block *b, const char *s, size_t n, int final, int leaf, char **name_out,
                         int *type_out) {
    char where[128];
    const char *gt = memchr(s + b->scan, '>', n - b->scan);
    if (!gt) {
        b->scan = n;
        if (!final) return STEP_MORE;
        return blk_fail(b, "%s: unterminated %s tag", blk_where(b, where, sizeof(where)),
                        b->tags->param_open);
    }
    size_t t1 = (size_t)(gt - s);
    char *name = NULL, *type = NULL;
    int r = tag_attr(s, b->pos, t1, "name", &name);
    if (r < 0) return blk_nomem(b);
    if (r == 0) {
        return blk_fail(b, "%s: %s%s tag has no name=\"...\" attribute", blk_where(b, where, sizeof(where)),
                        leaf ? "nested " : "", b->tags->param_open);
    }
    r = tag_attr(s, b->pos, t1, "string", &type);
    if (r < 0) {
        free(name);
        return blk_nomem(b);
    }
    int t = -1;
    if (r == 1) {
        if (!strcmp(type, "true")) {
            t = 1;
        } else if (!strcmp(type, "false")) {
            t = 0;
        } else {
            blk_fail(b, "%s, parameter \"%.64s\": string=\"%.32s\" (must be \"true\" or \"false\")",
                     blk_where(b, where, sizeof(where)), name, type);
            free(name);
            free(type);
            return STEP_ERROR;
        }
        free(type);
    }
    *name_out = name;
    *type_out = t;
    b->value_start = t1 + 1;
    b->pos = t1 + 1;
    b->scan = t1 + 1;
    return STEP_DONE;
}

/* Find the closing parameter tag of the value that starts at b->value_start;
 * *end is where the tag starts. */
static int blk_value_end(dsml_block *b, const char *s, size_t n, int final, const char *pname, size_t *end) {
    const char *close = b->tags->param_close;
    size_t k = strlen(close);
    const char *e = find_bytes(s, n, b->scan, close);
    if (!e) {
        size_t resume = n >= k ? n - k + 1 : 0;
        b->scan = resume > b->value_start ? resume : b->value_start;
        if (!final) return STEP_MORE;
        char where[128];
        return blk_fail(b, "%s, parameter \"%.64s\": the text ends before %s", blk_where(b, where, sizeof(where)),
                        pname, close);
    }
    *end = (size_t)(e - s);
    return STEP_DONE;
}

/* Append "KEY":VALUE for the raw value s[v0..v1) of the given string type. */
static int blk_put_member(dsml_block *b, chat_buf *out, const char *key, int type, const char *s, size_t v0,
                          size_t v1) {
    chat_json_escape(out, key, strlen(key));
    chat_buf_putc(out, ':');
    if (type != 0) {
        chat_buf raw = {0};
        dsml_unescape(&raw, s + v0, v1 - v0);
        chat_json_escape(out, raw.ptr ? raw.ptr : "", raw.len);
        int oom = raw.oom;
        chat_buf_free(&raw);
        if (oom) return blk_nomem(b);
        return STEP_DONE;
    }
    if (all_space(s, v0, v1)) {
        chat_buf_puts(out, "null");
        return STEP_DONE;
    }
    if (!chat_json_minify(s + v0, v1 - v0, out)) {
        char where[128], ex[32];
        excerpt(s, v1, v0, ex, sizeof(ex));
        return blk_fail(b, "%s, parameter \"%.64s\": string=\"false\" value is not valid JSON: \"%s\"",
                        blk_where(b, where, sizeof(where)), key, ex);
    }
    return STEP_DONE;
}

/* Add one top-level argument (member text already built in `member`). */
static int blk_add_arg(dsml_block *b, chat_buf *member) {
    size_t before = b->args.len;
    chat_buf_putc(&b->args, b->n_args ? ',' : '{');
    chat_buf_put(&b->args, member->ptr ? member->ptr : "", member->len);
    int oom = member->oom || b->args.oom;
    chat_buf_free(member);
    if (oom) return blk_nomem(b);
    b->n_args++;
    blk_emit(b, DS4_CHAT_EVENT_TOOL_ARGS, NULL, b->args.ptr + before, b->args.len - before);
    return STEP_DONE;
}

static int blk_finish_call(dsml_block *b) {
    size_t before = b->args.len;
    if (!b->n_args) chat_buf_putc(&b->args, '{');
    chat_buf_putc(&b->args, '}');
    if (b->args.oom) return blk_nomem(b);
    blk_emit(b, DS4_CHAT_EVENT_TOOL_ARGS, NULL, b->args.ptr + before, b->args.len - before);
    if (b->n_calls == b->cap_calls) {
        size_t cap = b->cap_calls ? b->cap_calls * 2 : 4;
        dsml_call *v = realloc(b->calls, cap * sizeof(*v));
        if (!v) return blk_nomem(b);
        b->calls = v;
        b->cap_calls = cap;
    }
    char *args = chat_buf_take(&b->args, NULL);
    if (!args) return blk_nomem(b);
    blk_emit(b, DS4_CHAT_EVENT_TOOL_END, NULL, NULL, 0);
    b->calls[b->n_calls].name = b->call_name;
    b->calls[b->n_calls].arguments = args;
    b->n_calls++;
    b->call_name = NULL;
    b->n_args = 0;
    return STEP_DONE;
}

/* Advance over s[0..n). `final`: no more text will come. */
static int blk_step(dsml_block *b, const char *s, size_t n, int final) {
    const dsml_tags *t = b->tags;
    char where[128], ex[32];
    for (;;) {
        switch (b->state) {
        case BLK_OPEN: {
            int m = match_at(s, n, b->pos, t->calls_open);
            if (m < 0 && !final) return STEP_MORE;
            if (m != 1) return blk_fail(b, "expected %s", t->calls_open);
            b->pos += strlen(t->calls_open);
            b->state = BLK_ITEM;
            break;
        }
        case BLK_ITEM: {
            b->pos = skip_space(s, n, b->pos);
            int mc = b->pos < n ? match_at(s, n, b->pos, t->calls_close) : -1;
            int mi = b->pos < n ? match_at(s, n, b->pos, t->invoke_open) : -1;
            if (mc == 1) {
                b->end = b->pos + strlen(t->calls_close);
                b->state = BLK_DONE;
                return STEP_DONE;
            }
            if (mi == 1) {
                b->state = BLK_INVOKE_TAG;
                b->scan = b->pos;
                break;
            }
            if (mc < 0 || mi < 0) {
                if (!final) return STEP_MORE;
                return blk_fail(b, "unterminated %s block: the text ends before %s", t->calls_open, t->calls_close);
            }
            excerpt(s, n, b->pos, ex, sizeof(ex));
            return blk_fail(b, "%s: expected %s or %s, found \"%s\"", blk_where(b, where, sizeof(where)),
                            t->invoke_open, t->calls_close, ex);
        }
        case BLK_INVOKE_TAG: {
            const char *gt = memchr(s + b->scan, '>', n - b->scan);
            if (!gt) {
                b->scan = n;
                if (!final) return STEP_MORE;
                return blk_fail(b, "%s: unterminated %s tag", blk_where(b, where, sizeof(where)), t->invoke_open);
            }
            size_t t1 = (size_t)(gt - s);
            char *name = NULL;
            int r = tag_attr(s, b->pos, t1, "name", &name);
            if (r < 0) return blk_nomem(b);
            if (r == 0) {
                return blk_fail(b, "%s: %s tag has no name=\"...\" attribute", blk_where(b, where, sizeof(where)),
                                t->invoke_open);
            }
            b->call_name = name;
            chat_buf_reset(&b->args);
            b->n_args = 0;
            blk_emit(b, DS4_CHAT_EVENT_TOOL_START, name, NULL, 0);
            b->pos = t1 + 1;
            b->state = BLK_INVOKE_ITEM;
            break;
        }
        case BLK_INVOKE_ITEM: {
            b->pos = skip_space(s, n, b->pos);
            int mc = b->pos < n ? match_at(s, n, b->pos, t->invoke_close) : -1;
            int mp = b->pos < n ? match_at(s, n, b->pos, t->param_open) : -1;
            if (mc == 1) {
                if (blk_finish_call(b) != STEP_DONE) return STEP_ERROR;
                b->pos += strlen(t->invoke_close);
                b->state = BLK_ITEM;
                break;
            }
            if (mp == 1) {
                b->state = BLK_PARAM_TAG;
                b->scan = b->pos;
                break;
            }
            if (mc < 0 || mp < 0) {
                if (!final) return STEP_MORE;
                return blk_fail(b, "%s: the text ends before %s", blk_where(b, where, sizeof(where)), t->invoke_close);
            }
            excerpt(s, n, b->pos, ex, sizeof(ex));
            return blk_fail(b, "%s: expected %s or %s, found \"%s\"", blk_where(b, where, sizeof(where)),
                            t->param_open, t->invoke_close, ex);
        }
        case BLK_PARAM_TAG: {
            free(b->param_name);
            b->param_name = NULL;
            int r = blk_param_tag(b, s, n, final, 0, &b->param_name, &b->param_type);
            if (r != STEP_DONE) return r;
            b->state = b->param_type < 0 ? BLK_PARAM_PEEK : BLK_PARAM_BODY;
            break;
        }
        case BLK_PARAM_PEEK: {
            size_t q = skip_space(s, n, b->value_start);
            int m = q < n ? match_at(s, n, q, t->param_open) : -1;
            if (m < 0 && !final) return STEP_MORE;
            if (m == 1) {
                b->pos = q;
                chat_buf_reset(&b->nested);
                b->n_nested = 0;
                b->state = BLK_NESTED_ITEM;
            } else {
                b->scan = b->value_start;
                b->state = BLK_PARAM_BODY;
            }
            break;
        }
        case BLK_PARAM_BODY: {
            size_t e = 0;
            int r = blk_value_end(b, s, n, final, b->param_name, &e);
            if (r != STEP_DONE) return r;
            chat_buf member = {0};
            if (blk_put_member(b, &member, b->param_name, b->param_type, s, b->value_start, e) != STEP_DONE) {
                chat_buf_free(&member);
                return STEP_ERROR;
            }
            if (blk_add_arg(b, &member) != STEP_DONE) return STEP_ERROR;
            b->pos = e + strlen(t->param_close);
            b->state = BLK_INVOKE_ITEM;
            break;
        }
        case BLK_NESTED_ITEM: {
            size_t q = skip_space(s, n, b->pos);
            int m = q < n ? match_at(s, n, q, t->param_open) : -1;
            if (m < 0 && !final) return STEP_MORE;
            if (m == 1) {
                b->pos = q;
                b->scan = q;
                b->state = BLK_NESTED_TAG;
                break;
            }
            /* End of the leaves: the outer parameter is the object of them. */
            chat_buf member = {0};
            chat_json_escape(&member, b->param_name, strlen(b->param_name));
            chat_buf_puts(&member, ":{");
            chat_buf_put(&member, b->nested.ptr ? b->nested.ptr : "", b->nested.len);
            chat_buf_putc(&member, '}');
            if (b->nested.oom) member.oom = 1;
            if (blk_add_arg(b, &member) != STEP_DONE) return STEP_ERROR;
            b->pos = q;
            b->state = BLK_NESTED_CLOSE;
            break;
        }
        case BLK_NESTED_TAG: {
            free(b->leaf_name);
            b->leaf_name = NULL;
            int r = blk_param_tag(b, s, n, final, 1, &b->leaf_name, &b->leaf_type);
            if (r != STEP_DONE) return r;
            b->state = BLK_NESTED_BODY;
            break;
        }
        case BLK_NESTED_BODY: {
            size_t e = 0;
            int r = blk_value_end(b, s, n, final, b->leaf_name, &e);
            if (r != STEP_DONE) return r;
            if (b->n_nested) chat_buf_putc(&b->nested, ',');
            if (blk_put_member(b, &b->nested, b->leaf_name, b->leaf_type, s, b->value_start, e) != STEP_DONE) {
                return STEP_ERROR;
            }
            if (b->nested.oom) return blk_nomem(b);
            b->n_nested++;
            b->pos = e + strlen(t->param_close);
            b->state = BLK_NESTED_ITEM;
            break;
        }
        case BLK_NESTED_CLOSE: {
            size_t q = skip_space(s, n, b->pos);
            int m = q < n ? match_at(s, n, q, t->param_close) : -1;
            if (m < 0 && !final) return STEP_MORE;
            b->pos = m == 1 ? q + strlen(t->param_close) : q;
            b->state = BLK_INVOKE_ITEM;
            break;
        }
        case BLK_DONE:
            return STEP_DONE;
        case BLK_FAILED:
        default:
            return STEP_ERROR;
        }
    }
}

/* ================================================================ replies */

void ds4_chat_reply_free(ds4_chat_reply *reply) {
    if (!reply) return;
    free(reply->reasoning);
    free(reply->content);
    for (size_t i = 0; i < reply->n_calls; i++) {
        free((char *)reply->calls[i].name);
        free((char *)reply->calls[i].arguments);
        free((char *)reply->calls[i].raw_dsml);
    }
    free(reply->calls);
    memset(reply, 0, sizeof(*reply));
}

/* The first block start at or after `from`, in ds4's order of preference. */
static int find_block(const char *s, size_t n, size_t from, size_t *raw_start, size_t *tag_pos, int *style) {
    for (int k = 0; k < DSML_N_STYLES; k++) {
        const char *p = find_bytes(s, n, from, DSML_STYLES[k].calls_open_nn);
        size_t skip = 2;
        if (!p) {
            p = find_bytes(s, n, from, DSML_STYLES[k].calls_open);
            skip = 0;
        }
        if (p) {
            *raw_start = (size_t)(p - s);
            *tag_pos = *raw_start + skip;
            *style = k;
            return 1;
        }
    }
    return 0;
}

/* Run a block from tag_pos over the whole text. */
static int parse_block_final(dsml_block *b, const char *s, size_t n, size_t tag_pos, int style) {
    blk_init(b, &DSML_STYLES[style], tag_pos, NULL, NULL);
    return blk_step(b, s, n, 1);
}

static char *dup_stripped_think(const char *s, size_t n, size_t *len) {
    size_t k = strlen(THINK_START);
    if (n >= k && !memcmp(s, THINK_START, k)) {
        s += k;
        n -= k;
    }
    *len = n;
    return chat_strndup(s, n);
}

/* Split s[0..n) at its first </think> [ds4_server.c:split_reasoning_content]. */
static int split_reasoning(ds4_chat_reply *r, const char *s, size_t n) {
    size_t k = strlen(THINK_START);
    size_t body = n >= k && !memcmp(s, THINK_START, k) ? k : 0;
    const char *end = find_bytes(s, n, body, THINK_END);
    if (end) {
        size_t e = (size_t)(end - s);
        r->reasoning = chat_strndup(s + body, e - body);
        r->reasoning_len = e - body;
        size_t c = e + strlen(THINK_END);
        r->content = chat_strndup(s + c, n - c);
        r->content_len = n - c;
        return r->reasoning && r->content;
    }
    r->content = chat_strndup(s, n);
    r->content_len = n;
    return r->content != NULL;
}

/* Move the block's calls into the reply, each with the raw block bytes. */
static int take_calls(ds4_chat_reply *r, dsml_block *b, const char *s, size_t raw_start) {
    r->block_start = raw_start;
    r->block_end = b->end;
    if (!b->n_calls) return 1;
    r->calls = calloc(b->n_calls, sizeof(*r->calls));
    if (!r->calls) return 0;
    for (size_t i = 0; i < b->n_calls; i++) {
        char *raw = chat_strndup(s + raw_start, b->end - raw_start);
        if (!raw) return 0;
        r->calls[i].name = b->calls[i].name;
        r->calls[i].arguments = b->calls[i].arguments;
        r->calls[i].raw_dsml = raw;
        b->calls[i].name = b->calls[i].arguments = NULL;
        r->n_calls = i + 1;
    }
    return 1;
}

ds4_status ds4_chat_parse_reply(const char *text, size_t len, int in_thinking, ds4_chat_reply *out,
                                ds4_error *err) {
    if (!out) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL reply");
    memset(out, 0, sizeof(*out));
    if (!text && len) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL reply text");
    if (!text) text = "";

    size_t raw_start = 0, tag_pos = 0;
    int style = 0, ok = 1;
    dsml_block b;
    memset(&b, 0, sizeof(b));

    size_t region = 0;
    if (in_thinking) {
        const char *last = find_last_bytes(text, len, THINK_END);
        if (last) {
            region = (size_t)(last - text) + strlen(THINK_END);
        } else {
            /* Never left the reasoning block, unless the reply ends with a
             * tool call the model made without writing </think> first. */
            out->thinking_unclosed = 1;
            if (find_block(text, len, 0, &raw_start, &tag_pos, &style)) {
                int r = parse_block_final(&b, text, len, tag_pos, style);
                if (r == STEP_DONE && all_space(text, b.end, len)) {
                    size_t cut = trim_space_back(text, 0, raw_start);
                    out->reasoning = dup_stripped_think(text, cut, &out->reasoning_len);
                    out->content = chat_strndup("", 0);
                    out->recovered = 1;
                    ok = out->reasoning && out->content && take_calls(out, &b, text, raw_start);
                    blk_free(&b);
                    goto finish;
                }
                if (b.oom) ok = 0;
                blk_free(&b);
                if (!ok) goto finish;
            }
            out->reasoning = dup_stripped_think(text, len, &out->reasoning_len);
            out->content = chat_strndup("", 0);
            ok = out->reasoning && out->content;
            goto finish;
        }
    }

    if (!find_block(text, len, region, &raw_start, &tag_pos, &style)) {
        ok = split_reasoning(out, text, len);
        goto finish;
    }
    int r = parse_block_final(&b, text, len, tag_pos, style);
    if (r == STEP_DONE) {
        ok = split_reasoning(out, text, trim_space_back(text, 0, raw_start)) && take_calls(out, &b, text, raw_start);
        blk_free(&b);
        goto finish;
    }
    if (b.oom) {
        blk_free(&b);
        ok = 0;
        goto finish;
    }
    /* Malformed block: report it, and fill the reply as plain text. */
    ok = split_reasoning(out, text, len);
    if (ok) {
        ds4_error_set(err, DS4_ERR_FORMAT, "DSML tool call: %s", b.error);
        blk_free(&b);
        return DS4_ERR_FORMAT;
    }
    blk_free(&b);

finish:
    if (!ok) {
        ds4_chat_reply_free(out);
        return ds4_error_set(err, DS4_ERR_NOMEM, "chat: out of memory while parsing a reply");
    }
    return DS4_OK;
}

/* ================================================================ streaming */

typedef enum stream_mode {
    ST_START,     /* thinking: a leading "<think>" may still arrive */
    ST_REASONING, /* inside the reasoning block */
    ST_CONTENT,   /* after </think> (or from the start without thinking) */
    ST_BLOCK,     /* inside a DSML block */
    ST_SPEC_DONE, /* a block closed inside unclosed reasoning: calls held until it is the last thing */
    ST_AFTER,     /* after a closed block: the rest is ignored */
    ST_FAILED,    /* a malformed block in the content: the rest is ignored */
} stream_mode;

typedef struct queued_event {
    ds4_chat_event_kind kind;
    size_t call_index;
    char *name;
    char *text;
    size_t len;
} queued_event;

struct ds4_chat_stream {
    int in_thinking;
    chat_buf text;
    stream_mode mode;
    size_t emit;      /* first byte of the current section not yet reported */
    size_t scan;      /* marker search resumes here */
    int speculative;  /* the block started inside reasoning */
    size_t block_tag; /* where the block's opening tag starts */
    dsml_block blk;
    queued_event *queue;
    size_t n_queue, cap_queue;
    int closed;
    int oom;
    ds4_chat_event_fn fn;
    void *user;
};

/* Longest marker the text scanner looks for, in bytes. */
#define STREAM_MARKER_MAX 32

static void stream_emit(ds4_chat_stream *st, const ds4_chat_event *ev) {
    if (st->fn) st->fn(st->user, ev);
}

static void stream_clear_queue(ds4_chat_stream *st) {
    for (size_t i = 0; i < st->n_queue; i++) {
        free(st->queue[i].name);
        free(st->queue[i].text);
    }
    st->n_queue = 0;
}

/* Block events: direct in the content, queued inside reasoning. */
static void stream_block_sink(void *ctx, const ds4_chat_event *ev) {
    ds4_chat_stream *st = ctx;
    if (!st->speculative) {
        stream_emit(st, ev);
        return;
    }
    if (st->n_queue == st->cap_queue) {
        size_t cap = st->cap_queue ? st->cap_queue * 2 : 16;
        queued_event *q = realloc(st->queue, cap * sizeof(*q));
        if (!q) {
            st->oom = 1;
            return;
        }
        st->queue = q;
        st->cap_queue = cap;
    }
    queued_event *q = &st->queue[st->n_queue];
    memset(q, 0, sizeof(*q));
    q->kind = ev->kind;
    q->call_index = ev->call_index;
    q->len = ev->len;
    if (ev->name && !(q->name = chat_strndup(ev->name, strlen(ev->name)))) st->oom = 1;
    if (ev->text && !(q->text = chat_strndup(ev->text, ev->len))) st->oom = 1;
    st->n_queue++;
}

static void stream_flush_queue(ds4_chat_stream *st) {
    for (size_t i = 0; i < st->n_queue; i++) {
        const queued_event *q = &st->queue[i];
        ds4_chat_event ev = {.kind = q->kind, .call_index = q->call_index, .name = q->name, .text = q->text,
                             .len = q->len};
        stream_emit(st, &ev);
    }
    stream_clear_queue(st);
}

static void stream_delta(ds4_chat_stream *st, size_t from, size_t to) {
    if (to <= from) return;
    ds4_chat_event ev = {.kind = st->mode == ST_REASONING ? DS4_CHAT_EVENT_REASONING : DS4_CHAT_EVENT_CONTENT,
                         .text = st->text.ptr + from,
                         .len = to - from};
    stream_emit(st, &ev);
}

/* Bytes at the end of s[from..n) that could start a marker. */
static size_t marker_prefix_hold(const char *s, size_t from, size_t n, int reasoning) {
    size_t hold = 0;
    for (int k = -1; k < DSML_N_STYLES; k++) {
        if (k < 0 && !reasoning) continue;
        const char *m = k < 0 ? THINK_END : DSML_STYLES[k].calls_open;
        size_t ml = strlen(m);
        size_t max = ml - 1 < n - from ? ml - 1 : n - from;
        for (size_t L = max; L > hold; L--) {
            if (!memcmp(s + n - L, m, L)) {
                hold = L;
                break;
            }
        }
    }
    return hold;
}

/* Move `limit` back so s[..limit) does not end inside a UTF-8 sequence. */
static size_t utf8_safe_limit(const char *s, size_t from, size_t limit) {
    size_t i = limit;
    size_t back = 0;
    while (i > from && back < 4) {
        unsigned char c = (unsigned char)s[i - 1];
        if ((c & 0xc0) != 0x80) {
            size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
            if (limit - (i - 1) < need) return i - 1;
            return limit;
        }
        i--;
        back++;
    }
    return limit;
}

/* The earliest marker at or after st->scan: </think> (reasoning only) or a
 * block opening tag of any style. Returns its position or n. */
static size_t stream_find_marker(ds4_chat_stream *st, int *which) {
    const char *s = st->text.ptr ? st->text.ptr : "";
    size_t n = st->text.len, best = n;
    *which = -2;
    if (st->mode == ST_REASONING) {
        const char *p = find_bytes(s, n, st->scan, THINK_END);
        if (p) {
            best = (size_t)(p - s);
            *which = -1;
        }
    }
    for (int k = 0; k < DSML_N_STYLES; k++) {
        const char *p = find_bytes(s, best, st->scan, DSML_STYLES[k].calls_open);
        if (p && (size_t)(p - s) < best) {
            best = (size_t)(p - s);
            *which = k;
        }
    }
    return best;
}

static void stream_advance(ds4_chat_stream *st, int final) {
    for (;;) {
        const char *s = st->text.ptr ? st->text.ptr : "";
        size_t n = st->text.len;
        switch (st->mode) {
        case ST_START: {
            int m = match_at(s, n, 0, THINK_START);
            if (m < 0 && !final) return;
            st->emit = st->scan = m == 1 ? strlen(THINK_START) : 0;
            st->mode = ST_REASONING;
            break;
        }
        case ST_REASONING:
        case ST_CONTENT: {
            int which;
            size_t at = stream_find_marker(st, &which);
            if (which == -1) {
                stream_delta(st, st->emit, at);
                st->emit = st->scan = at + strlen(THINK_END);
                st->mode = ST_CONTENT;
                break;
            }
            if (which >= 0) {
                size_t cut = trim_space_back(s, st->emit, at);
                stream_delta(st, st->emit, cut);
                st->emit = cut;
                st->speculative = st->mode == ST_REASONING;
                st->block_tag = at;
                blk_init(&st->blk, &DSML_STYLES[which], at, stream_block_sink, st);
                st->mode = ST_BLOCK;
                break;
            }
            size_t limit = n;
            if (!final) {
                limit = n - marker_prefix_hold(s, st->emit, n, st->mode == ST_REASONING);
                limit = trim_space_back(s, st->emit, limit);
                limit = utf8_safe_limit(s, st->emit, limit);
            }
            stream_delta(st, st->emit, limit);
            st->emit = limit;
            if (n >= STREAM_MARKER_MAX && n - STREAM_MARKER_MAX > st->scan) st->scan = n - STREAM_MARKER_MAX;
            return;
        }
        case ST_BLOCK: {
            int r = blk_step(&st->blk, s, n, final);
            if (st->blk.oom) st->oom = 1;
            if (r == STEP_MORE) return;
            if (r == STEP_DONE) {
                st->closed = 1;
                st->mode = st->speculative ? ST_SPEC_DONE : ST_AFTER;
                break;
            }
            if (st->speculative) {
                /* Not a real call: it was reasoning text after all. */
                stream_clear_queue(st);
                blk_free(&st->blk);
                st->mode = ST_REASONING;
                st->scan = st->block_tag + 1;
                break;
            }
            ds4_chat_event ev = {.kind = DS4_CHAT_EVENT_ERROR, .call_index = st->blk.n_calls,
                                 .text = st->blk.error, .len = strlen(st->blk.error)};
            stream_emit(st, &ev);
            st->mode = ST_FAILED;
            return;
        }
        case ST_SPEC_DONE:
            if (!all_space(s, st->blk.end, n)) {
                /* More text after the block: it was DSML quoted in the reasoning. */
                stream_clear_queue(st);
                blk_free(&st->blk);
                st->closed = 0;
                st->mode = ST_REASONING;
                st->scan = st->block_tag + 1;
                break;
            }
            if (!final) return;
            stream_flush_queue(st);
            st->mode = ST_AFTER;
            return;
        case ST_AFTER:
        case ST_FAILED:
        default:
            return;
        }
    }
}

ds4_status ds4_chat_stream_new(int in_thinking, ds4_chat_stream **out, ds4_error *err) {
    if (!out) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL stream output");
    ds4_chat_stream *st = calloc(1, sizeof(*st));
    if (!st) return ds4_error_set(err, DS4_ERR_NOMEM, "chat: out of memory for a stream");
    st->in_thinking = in_thinking;
    st->mode = in_thinking ? ST_START : ST_CONTENT;
    *out = st;
    return DS4_OK;
}

void ds4_chat_stream_free(ds4_chat_stream *st) {
    if (!st) return;
    stream_clear_queue(st);
    free(st->queue);
    blk_free(&st->blk);
    chat_buf_free(&st->text);
    free(st);
}

ds4_status ds4_chat_stream_feed(ds4_chat_stream *st, const char *text, size_t len, ds4_chat_event_fn fn,
                                void *user, ds4_error *err) {
    if (!st || (len && !text)) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL stream or text");
    if (st->oom) return ds4_error_set(err, DS4_ERR_NOMEM, "chat: stream is out of memory");
    chat_buf_put(&st->text, text, len);
    if (st->text.oom) {
        st->oom = 1;
        return ds4_error_set(err, DS4_ERR_NOMEM, "chat: out of memory for streamed text");
    }
    st->fn = fn;
    st->user = user;
    stream_advance(st, 0);
    st->fn = NULL;
    st->user = NULL;
    if (st->oom) return ds4_error_set(err, DS4_ERR_NOMEM, "chat: out of memory while streaming");
    return DS4_OK;
}

int ds4_chat_stream_block_closed(const ds4_chat_stream *st) {
    return st && st->closed;
}

int ds4_chat_stream_in_block(const ds4_chat_stream *st) {
    return st && st->mode == ST_BLOCK;
}

ds4_status ds4_chat_stream_finish(ds4_chat_stream *st, ds4_chat_event_fn fn, void *user, ds4_chat_reply *out,
                                  ds4_error *err) {
    if (!st || !out) return ds4_error_set(err, DS4_ERR_INVALID, "chat: NULL stream or reply");
    memset(out, 0, sizeof(*out));
    if (st->oom) return ds4_error_set(err, DS4_ERR_NOMEM, "chat: stream is out of memory");
    st->fn = fn;
    st->user = user;
    stream_advance(st, 1);
    st->fn = NULL;
    st->user = NULL;
    if (st->oom) return ds4_error_set(err, DS4_ERR_NOMEM, "chat: out of memory while streaming");
    return ds4_chat_parse_reply(st->text.ptr ? st->text.ptr : "", st->text.len, st->in_thinking, out, err);
}

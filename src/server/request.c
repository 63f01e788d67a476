/*
 * request.c - request bodies of the four APIs -> conversation + parameters.
 *
 * The message sources follow spec 5.4 ("Message sources per API"); the
 * thinking controls and the aliases follow spec 6.2. Every field is checked
 * for its JSON type; the first error wins and names the field.
 */
#include "server/request.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int srv_fail(srv_error *e, int status, const char *type, const char *param, const char *fmt, ...) {
    e->status = status;
    e->type = type;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

#define BAD(e, param, ...) srv_fail(e, 400, "invalid_request_error", param, __VA_ARGS__)

const char *srv_api_name(srv_api api) {
    switch (api) {
    case SRV_API_CHAT: return "chat.completions";
    case SRV_API_COMPLETIONS: return "completions";
    case SRV_API_RESPONSES: return "responses";
    case SRV_API_MESSAGES: return "messages";
    }
    return "?";
}

int srv_utf8_valid(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t k;
        unsigned min, cp;
        if (c >= 0xc2 && c <= 0xdf) { k = 1; cp = c & 0x1f; min = 0x80; }
        else if (c >= 0xe0 && c <= 0xef) { k = 2; cp = c & 0x0f; min = 0x800; }
        else if (c >= 0xf0 && c <= 0xf4) { k = 3; cp = c & 0x07; min = 0x10000; }
        else return 0;
        if (n - i <= k) return 0;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
        i += k + 1;
    }
    return 1;
}

/* ------------------------------------------------------------ ownership */

static void *keep(srv_request *r, void *p) {
    if (!p) return NULL;
    if (r->n_owned == r->cap_owned) {
        size_t cap = r->cap_owned ? 2 * r->cap_owned : 16;
        void **v = realloc(r->owned, cap * sizeof *v);
        if (!v) {
            free(p);
            return NULL;
        }
        r->owned = v;
        r->cap_owned = cap;
    }
    r->owned[r->n_owned++] = p;
    return p;
}

static char *keep_str(srv_request *r, const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (!p) return NULL;
    memcpy(p, s, n);
    p[n] = '\0';
    return keep(r, p);
}

void srv_request_free(srv_request *r) {
    if (!r) return;
    for (size_t i = 0; i < r->n_owned; i++) free(r->owned[i]);
    free(r->owned);
    for (size_t i = 0; i < r->n_messages; i++) free((void *)r->messages[i].calls);
    free(r->messages);
    free(r->tools);
    cJSON_Delete(r->root);
    memset(r, 0, sizeof *r);
}

#define OOM(e) srv_fail(e, 500, "api_error", NULL, "out of memory")

/* A growable string whose final bytes are kept by the request. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (b->n + n + 1 > cap) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

/* Hand the buffer to the request; "" when nothing was written. */
static const char *sb_keep(srv_request *r, sbuf *b) {
    if (b->oom) {
        free(b->p);
        return NULL;
    }
    if (!b->p) return keep_str(r, "", 0);
    return keep(r, b->p);
}

/* ------------------------------------------------------------ fields */

static const cJSON *field(const cJSON *obj, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    return cJSON_IsNull(v) ? NULL : v;
}

static int get_string(const cJSON *obj, const char *name, const char **out, srv_error *e) {
    const cJSON *v = field(obj, name);
    if (!v) return 0;
    if (!cJSON_IsString(v)) return BAD(e, name, "'%s' must be a string", name);
    *out = v->valuestring;
    return 0;
}

static int get_number(const cJSON *obj, const char *name, double lo, double hi, int *has, double *out,
                      srv_error *e) {
    const cJSON *v = field(obj, name);
    if (!v) return 0;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) return BAD(e, name, "'%s' must be a number", name);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return BAD(e, name, "'%s' must be between %g and %g (got %g)", name, lo, hi, v->valuedouble);
    *has = 1;
    *out = v->valuedouble;
    return 0;
}

static int get_bool(const cJSON *obj, const char *name, int *out, srv_error *e) {
    const cJSON *v = field(obj, name);
    if (!v) return 0;
    if (!cJSON_IsBool(v)) return BAD(e, name, "'%s' must be a boolean", name);
    *out = cJSON_IsTrue(v);
    return 0;
}

/* Text of a content value: a string, null, or an array whose strings and
 * objects' "text" fields are concatenated (spec 5.4, OpenAI content). */
static int content_text(srv_request *r, const cJSON *v, const char *param, const char **out, srv_error *e) {
    if (!v || cJSON_IsNull(v)) {
        *out = "";
        return 0;
    }
    if (cJSON_IsString(v)) {
        *out = v->valuestring;
        return 0;
    }
    if (!cJSON_IsArray(v)) return BAD(e, param, "'%s' must be a string, an array of parts or null", param);
    sbuf b = { 0 };
    const cJSON *it;
    cJSON_ArrayForEach(it, v) {
        if (cJSON_IsString(it)) {
            sb_puts(&b, it->valuestring);
            continue;
        }
        if (!cJSON_IsObject(it)) {
            free(b.p);
            return BAD(e, param, "each part of '%s' must be a string or an object", param);
        }
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(it, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(it, "text");
        if (cJSON_IsString(type) && (strstr(type->valuestring, "image") || strstr(type->valuestring, "audio") ||
                                     !strcmp(type->valuestring, "input_file") || !strcmp(type->valuestring, "file"))) {
            free(b.p);
            return BAD(e, param, "content parts of type '%s' are not supported (text only)", type->valuestring);
        }
        if (text && !cJSON_IsString(text)) {
            free(b.p);
            return BAD(e, param, "the 'text' of a part of '%s' must be a string", param);
        }
        if (text) sb_puts(&b, text->valuestring);
    }
    if (!(*out = sb_keep(r, &b))) return OOM(e);
    return 0;
}

/* Arguments of a tool call as JSON text: a string is taken as the JSON text,
 * any other value is serialised compactly. */
static const char *arguments_text(srv_request *r, const cJSON *v) {
    if (!v || cJSON_IsNull(v)) return "{}";
    if (cJSON_IsString(v)) return v->valuestring;
    return keep(r, cJSON_PrintUnformatted(v));
}

/* ------------------------------------------------------------ messages */

static int push_message(srv_request *r, const ds4_chat_message *m, size_t *cap, srv_error *e) {
    if (r->n_messages == *cap) {
        size_t c = *cap ? 2 * *cap : 8;
        ds4_chat_message *v = realloc(r->messages, c * sizeof *v);
        if (!v) return OOM(e);
        r->messages = v;
        *cap = c;
    }
    r->messages[r->n_messages++] = *m;
    return 0;
}

/* Append a call to message m (whose calls array is owned by the request). */
static int push_call(ds4_chat_message *m, const ds4_chat_tool_call *c, srv_error *e) {
    ds4_chat_tool_call *v = realloc((void *)m->calls, (m->n_calls + 1) * sizeof *v);
    if (!v) return OOM(e);
    v[m->n_calls] = *c;
    m->calls = v;
    m->n_calls++;
    return 0;
}

static int parse_chat_messages(srv_request *r, const cJSON *msgs, srv_error *e) {
    if (!cJSON_IsArray(msgs)) return BAD(e, "messages", "'messages' must be an array");
    if (cJSON_GetArraySize(msgs) == 0) return BAD(e, "messages", "'messages' must not be empty");
    size_t cap = 0;
    const cJSON *it;
    int idx = 0;
    cJSON_ArrayForEach(it, msgs) {
        char param[64];
        snprintf(param, sizeof param, "messages[%d]", idx++);
        if (!cJSON_IsObject(it)) return BAD(e, param, "'%s' must be an object", param);
        const char *role = NULL, *reasoning = NULL;
        if (get_string(it, "role", &role, e)) return -1;
        ds4_chat_message m = { 0 };
        m.role = ds4_chat_role_from_name(role);
        if (content_text(r, cJSON_GetObjectItemCaseSensitive(it, "content"), "content", &m.content, e)) return -1;
        if (get_string(it, "reasoning_content", &reasoning, e)) return -1;
        if (!reasoning && get_string(it, "reasoning", &reasoning, e)) return -1;
        m.reasoning = reasoning;
        if (get_string(it, "tool_call_id", &m.tool_call_id, e) || get_string(it, "name", &m.name, e)) return -1;
        const cJSON *calls = field(it, "tool_calls");
        if (calls && !cJSON_IsArray(calls)) return BAD(e, "tool_calls", "'tool_calls' must be an array");
        if (push_message(r, &m, &cap, e)) return -1;
        const cJSON *c;
        cJSON_ArrayForEach(c, calls) {
            if (!cJSON_IsObject(c)) return BAD(e, "tool_calls", "each tool call must be an object");
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
            if (!cJSON_IsObject(fn)) return BAD(e, "tool_calls", "a tool call needs a 'function' object");
            ds4_chat_tool_call call = { 0 };
            if (get_string(c, "id", &call.id, e) || get_string(fn, "name", &call.name, e)) return -1;
            const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
            if (!call.name || !args) continue; /* dropped, as ds4 does */
            if (!(call.arguments = arguments_text(r, args))) return OOM(e);
            if (push_call(&r->messages[r->n_messages - 1], &call, e)) return -1;
        }
    }
    return 0;
}

/* "</tool_result>" inside a result becomes "&lt;/tool_result>" (spec 5.4). */
static void append_tool_result(sbuf *b, const char *text) {
    static const char END[] = "</tool_result>";
    sb_puts(b, "<tool_result>");
    for (const char *p = text;;) {
        const char *hit = strstr(p, END);
        if (!hit) {
            sb_puts(b, p);
            break;
        }
        sb_put(b, p, (size_t)(hit - p));
        sb_puts(b, "&lt;");
        sb_put(b, hit + 1, sizeof END - 2);
        p = hit + sizeof END - 1;
    }
    sb_puts(b, END);
}

/* Anthropic "system": a string or text blocks joined with "\n" (none added
 * after a part that ends in one; parts starting "x-anthropic-" dropped). */
static int parse_anthropic_system(srv_request *r, const cJSON *sys, size_t *cap, srv_error *e) {
    if (!sys) return 0;
    ds4_chat_message m = { 0 };
    m.role = DS4_CHAT_ROLE_SYSTEM;
    if (cJSON_IsString(sys)) {
        m.content = sys->valuestring;
        return push_message(r, &m, cap, e);
    }
    if (!cJSON_IsArray(sys)) return BAD(e, "system", "'system' must be a string or an array of text blocks");
    sbuf b = { 0 };
    const cJSON *it;
    cJSON_ArrayForEach(it, sys) {
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(it, "text");
        if (!cJSON_IsString(text)) {
            free(b.p);
            return BAD(e, "system", "each 'system' block must have a string 'text'");
        }
        if (!strncmp(text->valuestring, "x-anthropic-", 12)) continue;
        if (b.n && b.p[b.n - 1] != '\n') sb_puts(&b, "\n");
        sb_puts(&b, text->valuestring);
    }
    if (!(m.content = sb_keep(r, &b))) return OOM(e);
    return push_message(r, &m, cap, e);
}

static int parse_anthropic_messages(srv_request *r, const cJSON *msgs, size_t *cap, srv_error *e) {
    if (!cJSON_IsArray(msgs)) return BAD(e, "messages", "'messages' must be an array");
    if (cJSON_GetArraySize(msgs) == 0) return BAD(e, "messages", "'messages' must not be empty");
    const cJSON *it;
    cJSON_ArrayForEach(it, msgs) {
        if (!cJSON_IsObject(it)) return BAD(e, "messages", "each message must be an object");
        const char *role = NULL;
        if (get_string(it, "role", &role, e)) return -1;
        if (!role || (strcmp(role, "user") && strcmp(role, "assistant")))
            return BAD(e, "role", "a message's 'role' must be \"user\" or \"assistant\"");
        ds4_chat_message m = { 0 };
        m.role = ds4_chat_role_from_name(role);
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        if (cJSON_IsString(content)) {
            m.content = content->valuestring;
            if (push_message(r, &m, cap, e)) return -1;
            continue;
        }
        if (!cJSON_IsArray(content)) return BAD(e, "content", "'content' must be a string or an array of blocks");
        if (push_message(r, &m, cap, e)) return -1;
        ds4_chat_message *dst = &r->messages[r->n_messages - 1];
        sbuf text = { 0 }, reasoning = { 0 };
        int has_reasoning = 0, rc = 0;
        const cJSON *blk;
        cJSON_ArrayForEach(blk, content) {
            const cJSON *type = cJSON_GetObjectItemCaseSensitive(blk, "type");
            if (!cJSON_IsObject(blk) || !cJSON_IsString(type)) {
                rc = BAD(e, "content", "each content block must be an object with a string 'type'");
                break;
            }
            const char *t = type->valuestring;
            const cJSON *v;
            if (!strcmp(t, "text")) {
                if (!cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(blk, "text"))) {
                    rc = BAD(e, "content", "a text block needs a string 'text'");
                    break;
                }
                sb_puts(&text, v->valuestring);
            } else if (!strcmp(t, "thinking")) {
                if (!cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(blk, "thinking"))) {
                    rc = BAD(e, "content", "a thinking block needs a string 'thinking'");
                    break;
                }
                sb_puts(&reasoning, v->valuestring);
                has_reasoning = 1;
            } else if (!strcmp(t, "redacted_thinking")) {
                continue;
            } else if (!strcmp(t, "tool_use")) {
                ds4_chat_tool_call call = { 0 };
                const cJSON *id = cJSON_GetObjectItemCaseSensitive(blk, "id");
                const cJSON *name = cJSON_GetObjectItemCaseSensitive(blk, "name");
                if (!cJSON_IsString(name) || (id && !cJSON_IsString(id))) {
                    rc = BAD(e, "content", "a tool_use block needs a string 'name' and 'id'");
                    break;
                }
                call.id = id ? id->valuestring : NULL;
                call.name = name->valuestring;
                if (!(call.arguments = arguments_text(r, cJSON_GetObjectItemCaseSensitive(blk, "input")))) {
                    rc = OOM(e);
                    break;
                }
                if ((rc = push_call(dst, &call, e))) break;
            } else if (!strcmp(t, "tool_result")) {
                const char *res = NULL;
                if ((rc = content_text(r, cJSON_GetObjectItemCaseSensitive(blk, "content"), "content", &res, e)))
                    break;
                append_tool_result(&text, res);
            } else {
                rc = BAD(e, "content", "content blocks of type '%s' are not supported", t);
                break;
            }
        }
        if (rc) {
            free(text.p);
            free(reasoning.p);
            return -1;
        }
        if (!(dst->content = sb_keep(r, &text))) {
            free(reasoning.p);
            return OOM(e);
        }
        if (has_reasoning) {
            if (!(dst->reasoning = sb_keep(r, &reasoning))) return OOM(e);
        } else {
            free(reasoning.p);
        }
    }
    return 0;
}

/* Responses "input": a string or a list of items (spec 5.4). */
static int parse_responses_input(srv_request *r, const cJSON *input, size_t *cap, srv_error *e) {
    if (cJSON_IsString(input)) {
        ds4_chat_message m = { .role = DS4_CHAT_ROLE_USER, .content = input->valuestring };
        return push_message(r, &m, cap, e);
    }
    if (!cJSON_IsArray(input)) return BAD(e, "input", "'input' must be a string or an array of items");
    if (cJSON_GetArraySize(input) == 0) return BAD(e, "input", "'input' must not be empty");
    const char *held_reasoning = NULL;
    int last_is_assistant = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, input) {
        if (!cJSON_IsObject(it)) return BAD(e, "input", "each input item must be an object");
        const char *type = NULL, *role = NULL;
        if (get_string(it, "type", &type, e) || get_string(it, "role", &role, e)) return -1;
        if (!type) type = "message";
        if (!strcmp(type, "reasoning")) {
            sbuf b = { 0 };
            const cJSON *parts = cJSON_GetObjectItemCaseSensitive(it, "content");
            if (!cJSON_IsArray(parts)) parts = cJSON_GetObjectItemCaseSensitive(it, "summary");
            const cJSON *p;
            cJSON_ArrayForEach(p, parts) {
                const cJSON *t = cJSON_GetObjectItemCaseSensitive(p, "text");
                if (cJSON_IsString(t)) sb_puts(&b, t->valuestring);
            }
            if (!(held_reasoning = sb_keep(r, &b))) return OOM(e);
            continue;
        }
        if (!strcmp(type, "function_call")) {
            ds4_chat_tool_call call = { 0 };
            if (get_string(it, "call_id", &call.id, e) || get_string(it, "name", &call.name, e)) return -1;
            if (!call.name) return BAD(e, "input", "a function_call item needs a 'name'");
            if (!(call.arguments = arguments_text(r, cJSON_GetObjectItemCaseSensitive(it, "arguments"))))
                return OOM(e);
            if (!last_is_assistant || held_reasoning) {
                ds4_chat_message m = { .role = DS4_CHAT_ROLE_ASSISTANT, .content = "", .reasoning = held_reasoning };
                held_reasoning = NULL;
                if (push_message(r, &m, cap, e)) return -1;
            }
            if (push_call(&r->messages[r->n_messages - 1], &call, e)) return -1;
            last_is_assistant = 1;
            continue;
        }
        ds4_chat_message m = { 0 };
        if (!strcmp(type, "function_call_output")) {
            m.role = DS4_CHAT_ROLE_TOOL;
            if (get_string(it, "call_id", &m.tool_call_id, e)) return -1;
            if (content_text(r, cJSON_GetObjectItemCaseSensitive(it, "output"), "output", &m.content, e)) return -1;
        } else if (!strcmp(type, "message")) {
            m.role = ds4_chat_role_from_name(role);
            if (content_text(r, cJSON_GetObjectItemCaseSensitive(it, "content"), "content", &m.content, e))
                return -1;
        } else {
            return BAD(e, "input", "input items of type '%s' are not supported", type);
        }
        if (m.role == DS4_CHAT_ROLE_ASSISTANT) {
            m.reasoning = held_reasoning;
            held_reasoning = NULL;
        } else if (held_reasoning && m.role != DS4_CHAT_ROLE_SYSTEM) {
            ds4_chat_message a = { .role = DS4_CHAT_ROLE_ASSISTANT, .content = "", .reasoning = held_reasoning };
            held_reasoning = NULL;
            if (push_message(r, &a, cap, e)) return -1;
        }
        if (push_message(r, &m, cap, e)) return -1;
        last_is_assistant = m.role == DS4_CHAT_ROLE_ASSISTANT;
    }
    return 0;
}

/* ------------------------------------------------------------ tools */

static int parse_tools(srv_request *r, const cJSON *root, srv_error *e) {
    const cJSON *tools = field(root, "tools");
    const cJSON *choice = field(root, "tool_choice");
    if (choice) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(choice, "type");
        if (cJSON_IsString(choice)) r->tool_choice_none = !strcmp(choice->valuestring, "none");
        else if (cJSON_IsObject(choice))
            r->tool_choice_none = cJSON_IsString(type) && !strcmp(type->valuestring, "none");
        else return BAD(e, "tool_choice", "'tool_choice' must be a string or an object");
    }
    if (!tools) return 0;
    if (!cJSON_IsArray(tools)) return BAD(e, "tools", "'tools' must be an array");
    int n = cJSON_GetArraySize(tools);
    if (n == 0) return 0;
    r->tools = calloc((size_t)n, sizeof *r->tools);
    if (!r->tools) return OOM(e);
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        if (!cJSON_IsObject(t)) return BAD(e, "tools", "each tool must be an object");
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(t, "type");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(cJSON_IsObject(fn) ? fn : t, "name");
        /* Built-in tools of other services (web search, computer use, ...) have no schema here. */
        if (cJSON_IsString(type) && strcmp(type->valuestring, "function") && strcmp(type->valuestring, "custom") &&
            !fn && r->api != SRV_API_MESSAGES)
            continue;
        if (!cJSON_IsString(name) || !name->valuestring[0])
            return BAD(e, "tools", "each tool needs a non-empty string 'name'");
        ds4_chat_tool *dst = &r->tools[r->n_tools++];
        /* The schema line: the "function" value when there is one, else the whole tool object. */
        if (!(dst->schema_json = keep(r, cJSON_PrintUnformatted(cJSON_IsObject(fn) ? fn : t)))) return OOM(e);
    }
    return 0;
}

/* ------------------------------------------------------------ thinking */

static int parse_effort(const cJSON *v, const char *param, ds4_chat_think *out, int *given, srv_error *e) {
    if (!v) return 0;
    if (!cJSON_IsString(v)) return BAD(e, param, "'%s' must be a string", param);
    const char *s = v->valuestring;
    if (!strcmp(s, "max")) *out = DS4_CHAT_THINK_MAX;
    else if (!strcmp(s, "xhigh") || !strcmp(s, "high") || !strcmp(s, "medium") || !strcmp(s, "low") ||
             !strcmp(s, "minimal"))
        *out = DS4_CHAT_THINK_HIGH;
    else if (!strcmp(s, "none")) *out = DS4_CHAT_THINK_NONE;
    else return BAD(e, param, "'%s' must be one of none, minimal, low, medium, high, xhigh, max", param);
    *given = 1;
    return 0;
}

static int parse_thinking(srv_request *r, const cJSON *root, const srv_limits *lim, srv_error *e) {
    int given = 0;
    ds4_chat_think think = lim->default_think;
    const cJSON *v;
    if (r->api == SRV_API_RESPONSES) {
        const cJSON *reasoning = field(root, "reasoning");
        if (reasoning && !cJSON_IsObject(reasoning)) return BAD(e, "reasoning", "'reasoning' must be an object");
        if (parse_effort(field(reasoning, "effort"), "reasoning.effort", &think, &given, e)) return -1;
    } else {
        if (parse_effort(field(root, "reasoning_effort"), "reasoning_effort", &think, &given, e)) return -1;
        const cJSON *oc = field(root, "output_config");
        if (oc && r->api == SRV_API_MESSAGES && parse_effort(field(oc, "effort"), "output_config.effort", &think,
                                                             &given, e))
            return -1;
        if ((v = field(root, "thinking"))) {
            const cJSON *type = cJSON_GetObjectItemCaseSensitive(v, "type");
            if (cJSON_IsBool(v)) think = cJSON_IsTrue(v) ? DS4_CHAT_THINK_HIGH : DS4_CHAT_THINK_NONE;
            else if (cJSON_IsObject(v) && cJSON_IsString(type))
                think = !strcmp(type->valuestring, "disabled") ? DS4_CHAT_THINK_NONE
                        : (think == DS4_CHAT_THINK_NONE ? DS4_CHAT_THINK_HIGH : think);
            else return BAD(e, "thinking", "'thinking' must be a boolean or an object with a string 'type'");
            given = 1;
        }
        if (r->api != SRV_API_MESSAGES && (v = field(root, "think"))) {
            if (!cJSON_IsBool(v)) return BAD(e, "think", "'think' must be a boolean");
            think = cJSON_IsTrue(v) ? DS4_CHAT_THINK_HIGH : DS4_CHAT_THINK_NONE;
            given = 1;
        }
    }
    if (!given && r->model && !strcmp(r->model, "deepseek-chat")) think = DS4_CHAT_THINK_NONE;
    if (!given && r->model && !strcmp(r->model, "deepseek-reasoner")) think = DS4_CHAT_THINK_HIGH;
    r->think = think;
    return 0;
}

/* ------------------------------------------------------------ parameters */

static int parse_stop(srv_request *r, const cJSON *root, const char *name, srv_error *e) {
    const cJSON *v = field(root, name);
    if (!v) return 0;
    if (cJSON_IsString(v)) {
        if (v->valuestring[0]) r->stop[r->n_stop++] = v->valuestring;
        return 0;
    }
    if (!cJSON_IsArray(v)) return BAD(e, name, "'%s' must be a string or an array of strings", name);
    const cJSON *it;
    cJSON_ArrayForEach(it, v) {
        if (!cJSON_IsString(it)) return BAD(e, name, "'%s' must be a string or an array of strings", name);
        if (r->n_stop == SRV_MAX_STOP) return BAD(e, name, "at most %d stop sequences are supported", SRV_MAX_STOP);
        if (it->valuestring[0]) r->stop[r->n_stop++] = it->valuestring;
    }
    return 0;
}

static int parse_max_tokens(srv_request *r, const cJSON *root, const char *name, const srv_limits *lim,
                            srv_error *e) {
    const cJSON *v = field(root, name);
    if (!v) return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        return BAD(e, name, "'%s' must be an integer", name);
    if (v->valuedouble < 1) return BAD(e, name, "'%s' must be at least 1", name);
    if (v->valuedouble >= (double)lim->ctx)
        return BAD(e, name, "'%s' (%.0f) must be below the context size of %lld tokens", name, v->valuedouble,
                   (long long)lim->ctx);
    r->max_tokens = (int64_t)v->valuedouble;
    return 0;
}

static int parse_sampling(srv_request *r, const cJSON *root, srv_error *e) {
    double d = 0;
    if (get_number(root, "temperature", 0, 2, &r->has_temperature, &d, e)) return -1;
    r->temperature = (float)d;
    if (get_number(root, "top_p", 0, 1, &r->has_top_p, &d, e)) return -1;
    r->top_p = (float)d;
    if (get_number(root, "min_p", 0, 1, &r->has_min_p, &d, e)) return -1;
    r->min_p = (float)d;
    if (get_number(root, "top_k", -1, 1 << 20, &r->has_top_k, &d, e)) return -1;
    if (r->has_top_k && d != floor(d)) return BAD(e, "top_k", "'top_k' must be an integer");
    r->top_k = (int)d;
    const cJSON *seed = field(root, "seed");
    if (seed) {
        if (!cJSON_IsNumber(seed) || !isfinite(seed->valuedouble) || seed->valuedouble != floor(seed->valuedouble))
            return BAD(e, "seed", "'seed' must be an integer");
        if (seed->valuedouble > 0 && seed->valuedouble < 1.8e19) r->seed = (uint64_t)seed->valuedouble;
    }
    return 0;
}

static int check_model(srv_request *r, const srv_limits *lim, srv_error *e) {
    if (!r->model || lim->any_model) return 0;
    if (!strcmp(r->model, lim->model_name) || !strcmp(r->model, "deepseek-v4-flash") ||
        !strcmp(r->model, "deepseek-chat") || !strcmp(r->model, "deepseek-reasoner"))
        return 0;
    return srv_fail(e, 404, r->api == SRV_API_MESSAGES ? "not_found_error" : "invalid_request_error", "model",
                    "the model '%s' does not exist; this server serves '%s'", r->model, lim->model_name);
}

int srv_request_parse(srv_api api, const char *body, size_t len, const srv_limits *lim, srv_request *r,
                      srv_error *e) {
    memset(r, 0, sizeof *r);
    memset(e, 0, sizeof *e);
    r->api = api;
    if (len == 0) return BAD(e, NULL, "the request body is empty (a JSON object is expected)");
    if (!srv_utf8_valid(body, len)) return BAD(e, NULL, "the request body is not valid UTF-8");
    if (memchr(body, '\0', len)) return BAD(e, NULL, "the request body contains a NUL byte");
    const char *end = NULL;
    r->root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!r->root) {
        size_t at = end && end >= body && end <= body + len ? (size_t)(end - body) : 0;
        return BAD(e, NULL, "the request body is not valid JSON (error near byte %zu)", at);
    }
    const cJSON *root = r->root;
    int rc = -1;
    if (!cJSON_IsObject(root)) {
        BAD(e, NULL, "the request body must be a JSON object");
        goto out;
    }
    if (get_string(root, "model", &r->model, e) || check_model(r, lim, e)) goto out;
    if (get_bool(root, "stream", &r->stream, e)) goto out;
    const cJSON *so = field(root, "stream_options");
    if (so && !cJSON_IsObject(so)) {
        BAD(e, "stream_options", "'stream_options' must be an object");
        goto out;
    }
    if (so && get_bool(so, "include_usage", &r->include_usage, e)) goto out;
    if (parse_sampling(r, root, e) || parse_thinking(r, root, lim, e) || parse_tools(r, root, e)) goto out;
    const cJSON *n = field(root, "n");
    if (n && (!cJSON_IsNumber(n) || n->valuedouble != 1)) {
        BAD(e, "n", "only one choice per request is supported ('n' must be 1)");
        goto out;
    }
    size_t cap = 0;
    switch (api) {
    case SRV_API_CHAT:
        if (parse_max_tokens(r, root, "max_tokens", lim, e) ||
            parse_max_tokens(r, root, "max_completion_tokens", lim, e) || parse_stop(r, root, "stop", e) ||
            parse_chat_messages(r, field(root, "messages"), e))
            goto out;
        break;
    case SRV_API_COMPLETIONS: {
        const cJSON *p = field(root, "prompt");
        if (cJSON_IsArray(p)) p = cJSON_GetArrayItem(p, 0); /* only the first prompt, as ds4 */
        if (!cJSON_IsString(p)) {
            BAD(e, "prompt", "'prompt' must be a string (or an array whose first item is one)");
            goto out;
        }
        r->prompt = p->valuestring;
        if (parse_max_tokens(r, root, "max_tokens", lim, e) || parse_stop(r, root, "stop", e)) goto out;
        break;
    }
    case SRV_API_RESPONSES: {
        const cJSON *prev = field(root, "previous_response_id");
        if (prev || field(root, "conversation")) {
            BAD(e, prev ? "previous_response_id" : "conversation",
                "stored conversations are not supported: send the whole history in 'input'");
            goto out;
        }
        const char *instructions = NULL;
        if (get_string(root, "instructions", &instructions, e)) goto out;
        if (instructions) {
            ds4_chat_message m = { .role = DS4_CHAT_ROLE_SYSTEM, .content = instructions };
            if (push_message(r, &m, &cap, e)) goto out;
        }
        if (!field(root, "input")) {
            BAD(e, "input", "'input' is required");
            goto out;
        }
        if (parse_max_tokens(r, root, "max_output_tokens", lim, e) ||
            parse_responses_input(r, field(root, "input"), &cap, e))
            goto out;
        break;
    }
    case SRV_API_MESSAGES:
        if (parse_max_tokens(r, root, "max_tokens", lim, e) || parse_stop(r, root, "stop_sequences", e) ||
            parse_anthropic_system(r, field(root, "system"), &cap, e) ||
            parse_anthropic_messages(r, field(root, "messages"), &cap, e))
            goto out;
        break;
    }
    if (api != SRV_API_COMPLETIONS) {
        size_t turns = 0;
        for (size_t i = 0; i < r->n_messages; i++)
            turns += r->messages[i].role != DS4_CHAT_ROLE_SYSTEM && r->messages[i].role != DS4_CHAT_ROLE_OTHER;
        if (!turns) {
            BAD(e, api == SRV_API_RESPONSES ? "input" : "messages",
                "the request has no user, assistant or tool message to answer");
            goto out;
        }
    }
    rc = 0;
out:
    if (rc) {
        srv_error saved = *e;
        srv_request_free(r);
        *e = saved;
    }
    return rc;
}

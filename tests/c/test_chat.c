/*
 * test_chat.c - chat prompt rendering and DSML tool-call parsing (src/text/chat.h).
 *
 * Golden strings follow spec sections 5.4/5.5 (docs/deepseek-v4-flash.md) and
 * ds4_server.c at 8d57664; the fixed prompt texts are checked by SHA-256.
 */
#include <stdarg.h>
#include <stdlib.h>

#include "test.h"
#include "text/chat.h"

#define B "<｜begin▁of▁sentence｜>"
#define E "<｜end▁of▁sentence｜>"
#define U "<｜User｜>"
#define A "<｜Assistant｜>"
#define TS "<think>"
#define TE "</think>"
#define BLOCK_OPEN "\n\n<｜DSML｜tool_calls>\n"
#define BLOCK_CLOSE "</｜DSML｜tool_calls>"

/* ================================================================ SHA-256 */

typedef struct sha256 {
    uint32_t h[8];
    uint8_t buf[64];
    size_t fill;
    uint64_t bits;
} sha256;

static const uint32_t SHA_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static uint32_t rotr(uint32_t x, int r) { return (x >> r) | (x << (32 - r)); }

static void sha256_block(sha256 *s, const uint8_t *p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++) {
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    }
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3], e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + SHA_K[i] + w[i];
        uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    s->h[0] += a, s->h[1] += b, s->h[2] += c, s->h[3] += d, s->h[4] += e, s->h[5] += f, s->h[6] += g, s->h[7] += h;
}

static void sha256_hex(const char *data, size_t n, char out[65]) {
    sha256 s = {{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19},
                {0}, 0, 0};
    const uint8_t *p = (const uint8_t *)data;
    s.bits = (uint64_t)n * 8;
    for (size_t i = 0; i < n; i++) {
        s.buf[s.fill++] = p[i];
        if (s.fill == 64) sha256_block(&s, s.buf), s.fill = 0;
    }
    s.buf[s.fill++] = 0x80;
    if (s.fill > 56) {
        while (s.fill < 64) s.buf[s.fill++] = 0;
        sha256_block(&s, s.buf);
        s.fill = 0;
    }
    while (s.fill < 56) s.buf[s.fill++] = 0;
    for (int i = 7; i >= 0; i--) s.buf[s.fill++] = (uint8_t)(s.bits >> (8 * i));
    sha256_block(&s, s.buf);
    for (int i = 0; i < 8; i++) snprintf(out + 8 * i, 9, "%08x", s.h[i]);
}

/* ================================================================ helpers */

/* Concatenate NULL-terminated string arguments (malloc'd). */
static char *cat(const char *first, ...) {
    size_t n = 0;
    va_list ap;
    va_start(ap, first);
    for (const char *s = first; s; s = va_arg(ap, const char *)) n += strlen(s);
    va_end(ap);
    char *out = malloc(n + 1), *p = out;
    va_start(ap, first);
    for (const char *s = first; s; s = va_arg(ap, const char *)) {
        size_t k = strlen(s);
        memcpy(p, s, k);
        p += k;
    }
    va_end(ap);
    *p = '\0';
    return out;
}

static char *render(const ds4_chat_conversation *conv) {
    char *out = NULL;
    size_t len = 0;
    ds4_error err = {0};
    ds4_status st = ds4_chat_render(conv, &out, &len, &err);
    CHECK_MSG(st == DS4_OK, "%s", err.message);
    if (out) CHECK_EQ_INT(len, strlen(out));
    return out;
}

/* Render, compare with `want`, free both. */
static void check_render(const ds4_chat_conversation *conv, char *want) {
    char *got = render(conv);
    CHECK_STR(got, want);
    free(got);
    free(want);
}

static ds4_chat_message msg(ds4_chat_role role, const char *content) {
    ds4_chat_message m = {.role = role, .content = content};
    return m;
}

static ds4_chat_conversation conv_of(const ds4_chat_message *m, size_t n, ds4_chat_think think) {
    ds4_chat_conversation c = {.messages = m, .n_messages = n, .think = think, .ctx_size = 32768};
    return c;
}

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

/* ================================================================ fixed texts */

static void test_fixed_text_hashes(void) {
    char hex[65];
    const char *x = ds4_chat_think_max_prefix();
    CHECK_EQ_INT(strlen(x), 476);
    sha256_hex(x, strlen(x), hex);
    CHECK_STR(hex, "f7a24f3b3050d4a83781e9b755b316aae2ec1d9dc87562541d90bcb04d7350f7");
    CHECK(!strncmp(x, "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n", 64));

    const char *p = ds4_chat_tools_prompt_head();
    CHECK_EQ_INT(strlen(p), 1183);
    sha256_hex(p, strlen(p), hex);
    CHECK_STR(hex, "de87922067300def6cde0b9a5c722c3248d708fb089b088b95c64f082d3a64ea");

    const char *c = ds4_chat_tools_prompt_tail();
    CHECK_EQ_INT(strlen(c), 146);
    sha256_hex(c, strlen(c), hex);
    CHECK_STR(hex, "fe26e2683a842d7f5378ebb38e2997e053770d962e3faae89e1d5bf8b8156498");

    /* The hash routine itself, on the FIPS 180-2 "abc" vector. */
    sha256_hex("abc", 3, hex);
    CHECK_STR(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

static void test_special_strings(void) {
    CHECK_STR(ds4_chat_special_text(DS4_CHAT_SPECIAL_BOS), B);
    CHECK_STR(ds4_chat_special_text(DS4_CHAT_SPECIAL_EOS), E);
    CHECK_STR(ds4_chat_special_text(DS4_CHAT_SPECIAL_USER), U);
    CHECK_STR(ds4_chat_special_text(DS4_CHAT_SPECIAL_ASSISTANT), A);
    CHECK_STR(ds4_chat_special_text(DS4_CHAT_SPECIAL_THINK_START), TS);
    CHECK_STR(ds4_chat_special_text(DS4_CHAT_SPECIAL_THINK_END), TE);
    CHECK_STR(ds4_chat_special_text(DS4_CHAT_SPECIAL_DSML), "｜DSML｜");
    CHECK_STR(ds4_chat_special_text(DS4_CHAT_SPECIAL_COUNT), "");
}

static void test_think_for_context(void) {
    CHECK_EQ_INT(ds4_chat_think_for_context(DS4_CHAT_THINK_MAX, 393216), DS4_CHAT_THINK_MAX);
    CHECK_EQ_INT(ds4_chat_think_for_context(DS4_CHAT_THINK_MAX, 393215), DS4_CHAT_THINK_HIGH);
    CHECK_EQ_INT(ds4_chat_think_for_context(DS4_CHAT_THINK_MAX, 0), DS4_CHAT_THINK_HIGH);
    CHECK_EQ_INT(ds4_chat_think_for_context(DS4_CHAT_THINK_HIGH, 0), DS4_CHAT_THINK_HIGH);
    CHECK_EQ_INT(ds4_chat_think_for_context(DS4_CHAT_THINK_NONE, 1u << 20), DS4_CHAT_THINK_NONE);
    CHECK_STR(ds4_chat_think_name(DS4_CHAT_THINK_MAX), "max");
    CHECK_EQ_INT(ds4_chat_role_from_name("developer"), DS4_CHAT_ROLE_SYSTEM);
    CHECK_EQ_INT(ds4_chat_role_from_name("function"), DS4_CHAT_ROLE_TOOL);
    CHECK_EQ_INT(ds4_chat_role_from_name(NULL), DS4_CHAT_ROLE_USER);
    CHECK_EQ_INT(ds4_chat_role_from_name("critic"), DS4_CHAT_ROLE_OTHER);
}

/* ================================================================ rendering */

static void test_render_basic_modes(void) {
    ds4_chat_message m1[] = {msg(DS4_CHAT_ROLE_USER, "Hello")};
    ds4_chat_conversation c = conv_of(m1, 1, DS4_CHAT_THINK_HIGH);
    check_render(&c, cat(B U "Hello" A TS, NULL));

    ds4_chat_message m2[] = {msg(DS4_CHAT_ROLE_SYSTEM, "You are terse."), msg(DS4_CHAT_ROLE_USER, "Hello")};
    c = conv_of(m2, 2, DS4_CHAT_THINK_NONE);
    check_render(&c, cat(B "You are terse." U "Hello" A TE, NULL));

    /* MAX with a big enough context: X right after BOS, before the system text. */
    c = conv_of(m2, 2, DS4_CHAT_THINK_MAX);
    c.ctx_size = 393216;
    check_render(&c, cat(B, ds4_chat_think_max_prefix(), "You are terse." U "Hello" A TS, NULL));

    /* MAX below 393216 tokens renders exactly as HIGH. */
    c.ctx_size = 393215;
    check_render(&c, cat(B "You are terse." U "Hello" A TS, NULL));
    c.ctx_size = 0;
    check_render(&c, cat(B "You are terse." U "Hello" A TS, NULL));

    /* Deterministic: the same conversation gives the same bytes. */
    c = conv_of(m2, 2, DS4_CHAT_THINK_HIGH);
    char *a = render(&c), *b = render(&c);
    CHECK_STR(a, b);
    free(a);
    free(b);

    c.think = (ds4_chat_think)7;
    char *bad = NULL;
    ds4_error err = {0};
    CHECK_EQ_INT(ds4_chat_render(&c, &bad, NULL, &err), DS4_ERR_INVALID);
    CHECK(bad == NULL && strstr(err.message, "thinking mode") != NULL);
}

static void test_render_multi_turn_reasoning(void) {
    ds4_chat_message m[] = {
        msg(DS4_CHAT_ROLE_USER, "first"),
        {.role = DS4_CHAT_ROLE_ASSISTANT, .content = "a1", .reasoning = "r1"},
        msg(DS4_CHAT_ROLE_USER, "second"),
    };
    ds4_chat_conversation c = conv_of(m, 3, DS4_CHAT_THINK_HIGH);
    check_render(&c, cat(B U "first" A TE "a1" E U "second" A TS, NULL));
    c.think = DS4_CHAT_THINK_NONE;
    check_render(&c, cat(B U "first" A TE "a1" E U "second" A TE, NULL));

    /* The turn after the last user message keeps its reasoning; no prefix follows. */
    ds4_chat_message m2[] = {
        msg(DS4_CHAT_ROLE_USER, "q"),
        {.role = DS4_CHAT_ROLE_ASSISTANT, .content = "a", .reasoning = "r"},
    };
    c = conv_of(m2, 2, DS4_CHAT_THINK_HIGH);
    check_render(&c, cat(B U "q" A TS "r" TE "a" E, NULL));
    c.think = DS4_CHAT_THINK_NONE;
    check_render(&c, cat(B U "q" A TE "a" E, NULL));

    /* Missing reasoning renders as an empty think block. */
    ds4_chat_message m3[] = {msg(DS4_CHAT_ROLE_USER, "q"), msg(DS4_CHAT_ROLE_ASSISTANT, "a")};
    c = conv_of(m3, 2, DS4_CHAT_THINK_HIGH);
    check_render(&c, cat(B U "q" A TS TE "a" E, NULL));

    /* An assistant message opening the conversation or following another one
     * gets no Assistant marker and no think marker. */
    ds4_chat_message m4[] = {
        {.role = DS4_CHAT_ROLE_ASSISTANT, .content = "hi", .reasoning = "x"},
        msg(DS4_CHAT_ROLE_USER, "q"),
        {.role = DS4_CHAT_ROLE_ASSISTANT, .content = "a", .reasoning = "r"},
        {.role = DS4_CHAT_ROLE_ASSISTANT, .content = "b", .reasoning = "s"},
    };
    c = conv_of(m4, 4, DS4_CHAT_THINK_HIGH);
    check_render(&c, cat(B "hi" E U "q" A TS "r" TE "a" E "b" E, NULL));
}

static void test_render_system_and_roles(void) {
    /* Every system/developer message joins the system block, wherever it is;
     * the separator is added even before an empty message. Unknown roles are
     * dropped without affecting the markers around them. */
    ds4_chat_message m[] = {
        msg(DS4_CHAT_ROLE_SYSTEM, "S1"),
        msg(DS4_CHAT_ROLE_USER, "u1"),
        msg(DS4_CHAT_ROLE_OTHER, "ignored"),
        msg(DS4_CHAT_ROLE_SYSTEM, ""),
        msg(DS4_CHAT_ROLE_SYSTEM, "S3"),
        msg(DS4_CHAT_ROLE_USER, "u2"),
    };
    ds4_chat_conversation c = conv_of(m, N_OF(m), DS4_CHAT_THINK_HIGH);
    check_render(&c, cat(B "S1\n\n\n\nS3" U "u1" U "u2" A TS, NULL));

    /* Only system messages: BOS + system, nothing to answer. */
    c = conv_of(m, 1, DS4_CHAT_THINK_HIGH);
    check_render(&c, cat(B "S1", NULL));
    c = conv_of(NULL, 0, DS4_CHAT_THINK_NONE);
    check_render(&c, cat(B, NULL));
}

static void test_render_tool_results(void) {
    ds4_chat_tool_call call = {.id = "call_1", .name = "bash", .arguments = "{\"command\":\"pwd\"}"};
    ds4_chat_message m[] = {
        msg(DS4_CHAT_ROLE_USER, "first"),
        {.role = DS4_CHAT_ROLE_ASSISTANT, .content = "", .reasoning = "tool reasoning", .calls = &call, .n_calls = 1},
        {.role = DS4_CHAT_ROLE_TOOL, .content = "/tmp", .tool_call_id = "call_1"},
        {.role = DS4_CHAT_ROLE_TOOL, .content = "a</tool_result>b</tool_resul", .tool_call_id = "call_2"},
        msg(DS4_CHAT_ROLE_USER, "next"),
        {.role = DS4_CHAT_ROLE_TOOL, .content = "late"},
    };
    const char *block = BLOCK_OPEN "<｜DSML｜invoke name=\"bash\">\n"
                        "<｜DSML｜parameter name=\"command\" string=\"true\">pwd</｜DSML｜parameter>\n"
                        "</｜DSML｜invoke>\n" BLOCK_CLOSE;
    /* No tools given, but the history has calls: tool context keeps reasoning.
     * Consecutive results share one User marker; a result after a user message
     * opens a new one; only the exact closing tag is escaped. */
    ds4_chat_conversation c = conv_of(m, N_OF(m), DS4_CHAT_THINK_HIGH);
    check_render(&c, cat(B U "first" A TS "tool reasoning" TE, block,
                         E U "<tool_result>/tmp</tool_result><tool_result>a&lt;/tool_result>b</tool_resul</tool_result>"
                         U "next" U "<tool_result>late</tool_result>" A TS,
                         NULL));
}

static void test_render_tools_prompt(void) {
    const char *s1 = "{\"name\": \"get_weather\", \"parameters\": {}}";
    ds4_chat_tool tools[] = {{.schema_json = s1}};
    ds4_chat_message m[] = {msg(DS4_CHAT_ROLE_SYSTEM, "Sys"), msg(DS4_CHAT_ROLE_USER, "q")};
    ds4_chat_conversation c = conv_of(m, 2, DS4_CHAT_THINK_HIGH);
    c.tools = tools;
    c.n_tools = 1;
    const char *P = ds4_chat_tools_prompt_head(), *C = ds4_chat_tools_prompt_tail();
    check_render(&c, cat(B, P, s1, C, "\n\nSys" U "q" A TS, NULL));

    /* Without a system message the closing sentence is followed by User. */
    c = conv_of(m + 1, 1, DS4_CHAT_THINK_HIGH);
    c.tools = tools;
    c.n_tools = 1;
    check_render(&c, cat(B, P, s1, C, U "q" A TS, NULL));

    /* MAX: X comes before the tool prompt. */
    c.think = DS4_CHAT_THINK_MAX;
    c.ctx_size = 1u << 20;
    check_render(&c, cat(B, ds4_chat_think_max_prefix(), P, s1, C, U "q" A TS, NULL));

    /* tool_choice "none": no tool prompt, and (no calls/results) no tool context. */
    ds4_chat_message m2[] = {
        msg(DS4_CHAT_ROLE_USER, "q1"),
        {.role = DS4_CHAT_ROLE_ASSISTANT, .content = "a", .reasoning = "r"},
        msg(DS4_CHAT_ROLE_USER, "q2"),
    };
    c = conv_of(m2, 3, DS4_CHAT_THINK_HIGH);
    c.tools = tools;
    c.n_tools = 1;
    c.tool_choice_none = 1;
    check_render(&c, cat(B U "q1" A TE "a" E U "q2" A TS, NULL));
    /* With tools active the same history keeps the old reasoning. */
    c.tool_choice_none = 0;
    check_render(&c, cat(B, P, s1, C, U "q1" A TS "r" TE "a" E U "q2" A TS, NULL));

    /* Several tools: lines joined by one "\n"; empty lines skipped;
     * synthesised lines for field-only tools. */
    ds4_chat_tool many[] = {
        {.schema_json = "{\"name\":\"a\"}"},
        {.schema_json = ""},
        {.name = "b\"q", .description = NULL, .parameters = NULL},
        {.name = "c", .description = "d", .parameters = "{\"type\":\"object\"}"},
    };
    char *tp = NULL;
    ds4_error err = {0};
    CHECK_EQ_INT(ds4_chat_render_tools_prompt(many, N_OF(many), &tp, NULL, &err), DS4_OK);
    char *want = cat(P,
                     "{\"name\":\"a\"}\n"
                     "{\"name\":\"b\\\"q\",\"description\":\"\",\"parameters\":{\"type\":\"object\",\"properties\":{}}}\n"
                     "{\"name\":\"c\",\"description\":\"d\",\"parameters\":{\"type\":\"object\"}}",
                     C, NULL);
    CHECK_STR(tp, want);
    free(tp);
    free(want);
    /* Tools whose lines are all empty render no prompt at all. */
    CHECK_EQ_INT(ds4_chat_render_tools_prompt(many + 1, 1, &tp, NULL, &err), DS4_OK);
    CHECK_STR(tp, "");
    free(tp);
}

static void test_tool_schema_from_openai(void) {
    char *line = NULL;
    ds4_error err = {0};
    const char *tool = "  {\"type\": \"function\", \"function\": {\"name\" : \"f\",\n \"parameters\": {} } }  ";
    CHECK_EQ_INT(ds4_chat_tool_schema_from_openai(tool, &line, &err), DS4_OK);
    CHECK_STR(line, "{\"name\" : \"f\",\n \"parameters\": {} }");
    free(line);
    const char *anthropic = " {\"name\": \"g\", \"input_schema\": {\"type\":\"object\"}}\n";
    CHECK_EQ_INT(ds4_chat_tool_schema_from_openai(anthropic, &line, &err), DS4_OK);
    CHECK_STR(line, "{\"name\": \"g\", \"input_schema\": {\"type\":\"object\"}}");
    free(line);
    line = NULL;
    CHECK_EQ_INT(ds4_chat_tool_schema_from_openai("{\"function\": ", &line, &err), DS4_ERR_FORMAT);
    CHECK(line == NULL);
}

/* The worked example of spec 5.4: HIGH, tools active, after one call and its result. */
static void test_render_spec_tool_example(void) {
    const char *s1 = "{\"name\":\"get_weather\"}";
    ds4_chat_tool tools[] = {{.schema_json = s1}};
    ds4_chat_tool_call call = {.id = "call_x", .name = "get_weather", .arguments = "{\"city\": \"Rome\", \"days\": 3}"};
    ds4_chat_message m[] = {
        msg(DS4_CHAT_ROLE_USER, "q"),
        {.role = DS4_CHAT_ROLE_ASSISTANT, .content = "Checking.", .reasoning = "r", .calls = &call, .n_calls = 1},
        {.role = DS4_CHAT_ROLE_TOOL, .content = "{\"temp\":21}", .tool_call_id = "call_x", .name = "get_weather"},
    };
    ds4_chat_conversation c = conv_of(m, 3, DS4_CHAT_THINK_HIGH);
    c.tools = tools;
    c.n_tools = 1;
    const char *tail =
        "Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Rome</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>{\"temp\":21}"
        "</tool_result><｜Assistant｜>";
    check_render(&c, cat(B, ds4_chat_tools_prompt_head(), s1, ds4_chat_tools_prompt_tail(),
                         U "q" A TS "r" TE, tail, TS, NULL));
    c.think = DS4_CHAT_THINK_NONE;
    check_render(&c, cat(B, ds4_chat_tools_prompt_head(), s1, ds4_chat_tools_prompt_tail(), U "q" A TE, tail, TE,
                         NULL));
}

static char *render_calls(const ds4_chat_tool_call *calls, size_t n) {
    char *out = NULL;
    ds4_error err = {0};
    CHECK_EQ_INT(ds4_chat_render_tool_calls(calls, n, &out, NULL, &err), DS4_OK);
    return out;
}

/* Parameter names that hold attribute-like text (`string=`, `name="`) render
 * and parse back as the same call: the parser reads a tag's attributes in
 * order, never a match inside another attribute's value (a fuzzer found
 * `{"tool_callstring=":1}` failing to round-trip). A tag whose attributes
 * are not name="value" pairs is refused. */
static void test_dsml_attribute_like_names(void) {
    static const char *const ARGS[] = {
        "{\"tool_callstring=\":1}",
        "{\"xstring=\":\"v\",\"a name=\":2,\"b\":\"string=\\\"true\\\"\"}",
        "{\"string\":\"s\",\"name\":3}",
    };
    static const char *const WANT[] = {
        "{\"tool_callstring=\":1}",
        "{\"xstring=\":\"v\",\"a name=\":2,\"b\":\"string=\\\"true\\\"\"}",
        "{\"string\":\"s\",\"name\":3}",
    };
    for (size_t i = 0; i < N_OF(ARGS); i++) {
        ds4_chat_tool_call call = {.name = "f string=", .arguments = (char *)ARGS[i]};
        char *block = render_calls(&call, 1);
        ds4_chat_reply r;
        ds4_error err = {0};
        CHECK_MSG(ds4_chat_parse_reply(block, strlen(block), 0, &r, &err) == DS4_OK, "%s: %s", ARGS[i], err.message);
        CHECK_EQ_INT(r.n_calls, 1);
        if (r.n_calls == 1) {
            CHECK_STR(r.calls[0].name, "f string=");
            CHECK_STR(r.calls[0].arguments, WANT[i]);
        }
        ds4_chat_reply_free(&r);
        free(block);
    }
    const char *bad = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
                      "<｜DSML｜parameter name=\"a\" string>1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    ds4_chat_reply r;
    ds4_error err = {0};
    ds4_status st = ds4_chat_parse_reply(bad, strlen(bad), 0, &r, &err);
    CHECK_MSG(st == DS4_OK || st == DS4_ERR_FORMAT, "status %d", st);
    ds4_chat_reply_free(&r);
}

static void test_render_dsml_canonical(void) {
    ds4_chat_tool_call calls[] = {
        {.name = "run", .arguments = " {\"b\": \"x > y && z & w\", \"a\": [1, 2,\n {\"k\": \"v v\"}], \"n\": null,"
                                     " \"t\": true, \"f\": -1.5e3, \"b\": \"dup\"} "},
        {.name = "a&b<c>\"d", .arguments = "{\"k&\\\"\": \"</｜DSML｜parameter> tail\", "
                                            "\"o\": {\"s\": \"</｜DSML｜parameter>\"}}"},
        {.name = "empty", .arguments = "{}"},
        {.name = "raw", .arguments = "not json </｜DSML｜parameter>"},
        {.name = "nul", .arguments = NULL},
        {.name = NULL, .arguments = "{\"u\":\"\\u00e9\\ud83d\\ude00\\n\"}"},
    };
    char *got = render_calls(calls, N_OF(calls));
    const char *want =
        BLOCK_OPEN
        "<｜DSML｜invoke name=\"run\">\n"
        "<｜DSML｜parameter name=\"b\" string=\"true\">x > y && z & w</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"a\" string=\"false\">[1,2,{\"k\":\"v v\"}]</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"n\" string=\"false\">null</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"t\" string=\"false\">true</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"f\" string=\"false\">-1.5e3</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"b\" string=\"true\">dup</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"a&amp;b&lt;c&gt;&quot;d\">\n"
        "<｜DSML｜parameter name=\"k&amp;&quot;\" string=\"true\">&lt;/｜DSML｜parameter> tail</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"o\" string=\"false\">{\"s\":\"\\u003c/｜DSML｜parameter>\"}</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"empty\">\n"
        "</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"raw\">\n"
        "<｜DSML｜parameter name=\"arguments\" string=\"true\">not json &lt;/｜DSML｜parameter></｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"nul\">\n"
        "<｜DSML｜parameter name=\"arguments\" string=\"true\"></｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"\">\n"
        "<｜DSML｜parameter name=\"u\" string=\"true\">é😀\n</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n" BLOCK_CLOSE;
    CHECK_STR(got, want);
    free(got);

    /* ds4's lenient object reading: members without commas, a trailing comma,
     * text after the object. */
    ds4_chat_tool_call lenient = {.name = "f", .arguments = "{\"a\":1 \"b\":2,} trailing"};
    got = render_calls(&lenient, 1);
    CHECK_STR(got, BLOCK_OPEN "<｜DSML｜invoke name=\"f\">\n"
                              "<｜DSML｜parameter name=\"a\" string=\"false\">1</｜DSML｜parameter>\n"
                              "<｜DSML｜parameter name=\"b\" string=\"false\">2</｜DSML｜parameter>\n"
                              "</｜DSML｜invoke>\n" BLOCK_CLOSE);
    free(got);

    got = render_calls(NULL, 0);
    CHECK_STR(got, "");
    free(got);
}

static void test_render_exact_replay(void) {
    const char *raw = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a\">\n"
                      "<｜DSML｜parameter name=\"x\" string=\"true\">1 &amp; 2</｜DSML｜parameter>\n"
                      "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"b\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    ds4_chat_tool_call calls[] = {
        {.id = "call_1", .name = "a", .arguments = "{\"x\":\"1 & 2\"}", .raw_dsml = raw},
        {.id = "call_2", .name = "b", .arguments = "{}", .raw_dsml = raw},
    };
    char *got = render_calls(calls, 2);
    CHECK_STR(got, raw);
    free(got);

    /* One call without the remembered block: canonical rendering. */
    calls[1].raw_dsml = NULL;
    got = render_calls(calls, 2);
    CHECK(got && strstr(got, "1 & 2</｜DSML｜parameter>") != NULL);
    free(got);
    /* Different blocks: canonical too. */
    calls[1].raw_dsml = "\n\n<｜DSML｜tool_calls>other</｜DSML｜tool_calls>";
    got = render_calls(calls, 2);
    CHECK(got && strstr(got, "other") == NULL);
    free(got);

    /* In a conversation the replayed block sits between content and EOS. */
    calls[1].raw_dsml = raw;
    ds4_chat_message m[] = {
        msg(DS4_CHAT_ROLE_USER, "q"),
        {.role = DS4_CHAT_ROLE_ASSISTANT, .content = "c", .reasoning = "r", .calls = calls, .n_calls = 2},
    };
    ds4_chat_conversation c = conv_of(m, 2, DS4_CHAT_THINK_HIGH);
    check_render(&c, cat(B U "q" A TS "r" TE "c", raw, E, NULL));
}

static void test_render_completion(void) {
    char *out = NULL;
    ds4_error err = {0};
    CHECK_EQ_INT(ds4_chat_render_completion("Hi " U "x", DS4_CHAT_THINK_HIGH, 32768, &out, NULL, &err), DS4_OK);
    CHECK_STR(out, B "You are a helpful assistant" U "Hi " U "x" A TS);
    free(out);
    CHECK_EQ_INT(ds4_chat_render_completion("p", DS4_CHAT_THINK_NONE, 32768, &out, NULL, &err), DS4_OK);
    CHECK_STR(out, B "You are a helpful assistant" U "p" A TE);
    free(out);
    CHECK_EQ_INT(ds4_chat_render_completion("p", DS4_CHAT_THINK_MAX, 400000, &out, NULL, &err), DS4_OK);
    char *want = cat(B, ds4_chat_think_max_prefix(), "You are a helpful assistant" U "p" A TS, NULL);
    CHECK_STR(out, want);
    free(want);
    free(out);
}

/* ================================================================ segments */

/* Segments as a readable string: specials as [name], text verbatim in |...|. */
static char *segs_str(const ds4_chat_segments *s) {
    static const char *names[] = {"BOS", "EOS", "U", "A", "T+", "T-", "DSML"};
    size_t cap = 64;
    for (size_t i = 0; i < s->n; i++) cap += s->v[i].is_special ? 8 : s->v[i].len + 2;
    char *out = malloc(cap), *p = out;
    for (size_t i = 0; i < s->n; i++) {
        if (s->v[i].is_special) {
            p += sprintf(p, "[%s]", names[s->v[i].special]);
        } else {
            CHECK_EQ_INT(s->v[i].len, strlen(s->v[i].text));
            CHECK(s->v[i].len > 0);
            p += sprintf(p, "|%s|", s->v[i].text);
        }
    }
    *p = '\0';
    return out;
}

static void check_segs(ds4_chat_segments *s, const char *want) {
    char *got = segs_str(s);
    CHECK_STR(got, want);
    free(got);
    ds4_chat_segments_free(s);
}

static void test_segments_encode_prompt(void) {
    ds4_chat_segments s = {0};
    ds4_error err = {0};
    CHECK_EQ_INT(ds4_chat_encode_prompt(&s, "You are a helpful assistant", "Hello", DS4_CHAT_THINK_HIGH, 32768, &err),
                 DS4_OK);
    check_segs(&s, "[BOS]|You are a helpful assistant|[U]|Hello|[A][T+]");

    /* Empty system, NONE (the official-logprob setup); special strings in the
     * prompt stay text. */
    CHECK_EQ_INT(ds4_chat_encode_prompt(&s, "", "a " U " b", DS4_CHAT_THINK_NONE, 32768, &err), DS4_OK);
    check_segs(&s, "[BOS][U]|a " U " b|[A][T-]");

    CHECK_EQ_INT(ds4_chat_encode_prompt(&s, NULL, "", DS4_CHAT_THINK_MAX, 393216, &err), DS4_OK);
    CHECK_EQ_INT(s.n, 5);
    if (s.n == 5) {
        CHECK(!s.v[1].is_special && !strcmp(s.v[1].text, ds4_chat_think_max_prefix()));
        CHECK(s.v[4].is_special && s.v[4].special == DS4_CHAT_SPECIAL_THINK_START);
    }
    ds4_chat_segments_free(&s);
    /* MAX below the context threshold: no prefix. */
    CHECK_EQ_INT(ds4_chat_encode_prompt(&s, "sys", "p", DS4_CHAT_THINK_MAX, 1000, &err), DS4_OK);
    check_segs(&s, "[BOS]|sys|[U]|p|[A][T+]");
}

static void test_segments_library_messages(void) {
    ds4_chat_segments s = {0};
    ds4_error err = {0};
    CHECK_EQ_INT(ds4_chat_segments_push_special(&s, DS4_CHAT_SPECIAL_BOS, &err), DS4_OK);
    CHECK_EQ_INT(ds4_chat_append_message_segments(&s, "developer", "sys", &err), DS4_OK);
    CHECK_EQ_INT(ds4_chat_append_message_segments(&s, "user", "hi", &err), DS4_OK);
    CHECK_EQ_INT(ds4_chat_append_message_segments(&s, "assistant", "plain", &err), DS4_OK);
    CHECK_EQ_INT(ds4_chat_append_message_segments(&s, "assistant", TS "r" TE "a", &err), DS4_OK);
    CHECK_EQ_INT(ds4_chat_append_message_segments(&s, "assistant", TE "x", &err), DS4_OK);
    CHECK_EQ_INT(ds4_chat_append_message_segments(&s, "tool", "out", &err), DS4_OK);
    CHECK_EQ_INT(ds4_chat_append_message_segments(&s, "function", "", &err), DS4_OK);
    CHECK_EQ_INT(ds4_chat_append_message_segments(&s, NULL, "anon", &err), DS4_OK);
    CHECK_EQ_INT(ds4_chat_append_assistant_prefix(&s, DS4_CHAT_THINK_NONE, &err), DS4_OK);
    check_segs(&s, "[BOS]|sys|[U]|hi|[A][T-]|plain|[A]|" TS "r" TE "a|[A]|" TE "x|[U]|Tool: ||out|[U]|Tool: |[U]|anon|"
                   "[A][T-]");
    CHECK_EQ_INT(ds4_chat_segments_push_special(&s, DS4_CHAT_SPECIAL_COUNT, &err), DS4_ERR_INVALID);
    ds4_chat_segments_free(&s);
}

static void test_segments_split_rendered(void) {
    ds4_chat_segments s = {0};
    ds4_error err = {0};
    const char *text = B "sys" U "q" A TS "r" TE "c\n\n<｜DSML｜tool_calls>\n</｜DSML｜parameter>" E "<｜latest_reminder｜>";
    CHECK_EQ_INT(ds4_chat_split_rendered(text, &s, &err), DS4_OK);
    check_segs(&s, "[BOS]|sys|[U]|q|[A][T+]|r|[T-]|c\n\n<|[DSML]|tool_calls>\n</|[DSML]|parameter>|[EOS]|<｜latest_"
                   "reminder｜>|");
    CHECK_EQ_INT(ds4_chat_split_rendered("", &s, &err), DS4_OK);
    CHECK_EQ_INT(s.n, 0);
    ds4_chat_segments_free(&s);

    /* A rendered conversation splits into exactly the markers it was built from. */
    ds4_chat_message m[] = {msg(DS4_CHAT_ROLE_USER, "Hello")};
    ds4_chat_conversation c = conv_of(m, 1, DS4_CHAT_THINK_NONE);
    char *r = render(&c);
    CHECK_EQ_INT(ds4_chat_split_rendered(r, &s, &err), DS4_OK);
    check_segs(&s, "[BOS][U]|Hello|[A][T-]");
    free(r);
}

/* ================================================================ parsing */

static ds4_status parse(const char *text, int thinking, ds4_chat_reply *r, ds4_error *err) {
    memset(err, 0, sizeof(*err));
    return ds4_chat_parse_reply(text, strlen(text), thinking, r, err);
}

static void test_parse_plain(void) {
    ds4_chat_reply r;
    ds4_error err;
    CHECK_EQ_INT(parse("The answer is 4.\n", 0, &r, &err), DS4_OK);
    CHECK(r.reasoning == NULL);
    CHECK_STR(r.content, "The answer is 4.\n");
    CHECK_EQ_INT(r.n_calls, 0);
    ds4_chat_reply_free(&r);

    CHECK_EQ_INT(parse("Let me think.\n" TE "\n\nFour.", 1, &r, &err), DS4_OK);
    CHECK_STR(r.reasoning, "Let me think.\n");
    CHECK_STR(r.content, "\n\nFour.");
    CHECK(!r.thinking_unclosed);
    ds4_chat_reply_free(&r);

    /* A leading <think> is stripped from the reasoning; the first </think>
     * splits, later ones stay in the content. */
    CHECK_EQ_INT(parse(TS "a" TE "b" TE "c", 1, &r, &err), DS4_OK);
    CHECK_STR(r.reasoning, "a");
    CHECK_STR(r.content, "b" TE "c");
    ds4_chat_reply_free(&r);

    /* Non-thinking mode still splits at a </think> the model wrote. */
    CHECK_EQ_INT(parse("x" TE "y", 0, &r, &err), DS4_OK);
    CHECK_STR(r.reasoning, "x");
    CHECK_STR(r.content, "y");
    ds4_chat_reply_free(&r);

    /* Empty text. */
    CHECK_EQ_INT(ds4_chat_parse_reply(NULL, 0, 0, &r, &err), DS4_OK);
    CHECK_STR(r.content, "");
    ds4_chat_reply_free(&r);

    /* NUL bytes are ordinary bytes. */
    CHECK_EQ_INT(ds4_chat_parse_reply("a\0b" TE "c", 4 + strlen(TE), 1, &r, &err), DS4_OK);
    CHECK_EQ_INT(r.reasoning_len, 3);
    CHECK(r.reasoning && !memcmp(r.reasoning, "a\0b", 3));
    CHECK_STR(r.content, "c");
    ds4_chat_reply_free(&r);
}

static const char *CALL_TEXT =
    "r1" TE "Let me check.\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Rome &amp; &lt;b&gt; &quot;x&quot; &apos; &unknown; &&</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\"> 3 </｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"opts\" string=\"false\">{\"a\": [1, \"b c\"],\n \"t\": true}</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"empty\" string=\"false\"></｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"untyped\">line1\nline2\t\"q\"\\</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"noargs\">\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>ignored trailing text";

static const char *CALL_ARGS0 =
    "{\"city\":\"Rome & <b> \\\"x\\\" ' &unknown; &&\",\"days\":3,\"opts\":{\"a\":[1,\"b c\"],\"t\":true},"
    "\"empty\":null,\"untyped\":\"line1\\nline2\\t\\\"q\\\"\\\\\"}";

static void test_parse_tool_calls(void) {
    ds4_chat_reply r;
    ds4_error err;
    CHECK_EQ_INT(parse(CALL_TEXT, 1, &r, &err), DS4_OK);
    CHECK_STR(r.reasoning, "r1");
    CHECK_STR(r.content, "Let me check.");
    CHECK_EQ_INT(r.n_calls, 2);
    if (r.n_calls == 2) {
        CHECK_STR(r.calls[0].name, "get_weather");
        CHECK_STR(r.calls[0].arguments, CALL_ARGS0);
        CHECK_STR(r.calls[1].name, "noargs");
        CHECK_STR(r.calls[1].arguments, "{}");
        CHECK(r.calls[0].id == NULL);
        const char *start = strstr(CALL_TEXT, "\n\n<｜DSML｜tool_calls>");
        const char *end = strstr(CALL_TEXT, "ignored");
        size_t raw_len = (size_t)(end - start);
        CHECK_EQ_INT(r.block_start, start - CALL_TEXT);
        CHECK_EQ_INT(r.block_end, end - CALL_TEXT);
        CHECK(strlen(r.calls[0].raw_dsml) == raw_len && !memcmp(r.calls[0].raw_dsml, start, raw_len));
        CHECK_STR(r.calls[1].raw_dsml, r.calls[0].raw_dsml);
    }
    ds4_chat_reply_free(&r);

    /* Nested leaf parameters under a parameter without a string attribute. */
    const char *nested = "<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\">"
                         "<｜DSML｜parameter name=\"obj\">\n  <｜DSML｜parameter name=\"a\" string=\"true\">x</｜DSML｜parameter>"
                         "<｜DSML｜parameter name=\"b\" string=\"false\">[1, 2]</｜DSML｜parameter>\n"
                         "</｜DSML｜parameter>"
                         "<｜DSML｜parameter name=\"obj2\"><｜DSML｜parameter name=\"c\">y</｜DSML｜parameter>"
                         "<｜DSML｜parameter name=\"z\" string=\"true\">1</｜DSML｜parameter>"
                         "</｜DSML｜invoke></｜DSML｜tool_calls>";
    CHECK_EQ_INT(parse(nested, 0, &r, &err), DS4_OK);
    CHECK_EQ_INT(r.n_calls, 1);
    if (r.n_calls == 1) CHECK_STR(r.calls[0].arguments, "{\"obj\":{\"a\":\"x\",\"b\":[1,2]},\"obj2\":{\"c\":\"y\",\"z\":\"1\"}}");
    CHECK_STR(r.content, "");
    ds4_chat_reply_free(&r);

    /* Lenient spellings: first bar missing; plain XML. */
    const char *shortform = "ok\n\n<DSML｜tool_calls>\n<DSML｜invoke name=\"f\">\n"
                            "<DSML｜parameter name=\"a\" string=\"false\">1</DSML｜parameter>\n</DSML｜invoke>\n"
                            "</DSML｜tool_calls>";
    CHECK_EQ_INT(parse(shortform, 0, &r, &err), DS4_OK);
    CHECK_STR(r.content, "ok");
    CHECK_EQ_INT(r.n_calls, 1);
    if (r.n_calls == 1) CHECK_STR(r.calls[0].arguments, "{\"a\":1}");
    ds4_chat_reply_free(&r);
    const char *plain = "<tool_calls><invoke name=\"g\"><parameter name=\"p\">v</parameter></invoke></tool_calls>";
    CHECK_EQ_INT(parse(plain, 0, &r, &err), DS4_OK);
    CHECK_EQ_INT(r.n_calls, 1);
    if (r.n_calls == 1) CHECK_STR(r.calls[0].arguments, "{\"p\":\"v\"}");
    ds4_chat_reply_free(&r);

    /* A "\n\n"-preceded block is preferred over an earlier bare one (ds4's search order). */
    const char *two = "a<｜DSML｜tool_calls>junk\n\n<｜DSML｜tool_calls><｜DSML｜invoke name=\"h\"></｜DSML｜invoke>"
                      "</｜DSML｜tool_calls>";
    CHECK_EQ_INT(parse(two, 0, &r, &err), DS4_OK);
    CHECK_EQ_INT(r.n_calls, 1);
    CHECK_STR(r.content, "a<｜DSML｜tool_calls>junk");
    ds4_chat_reply_free(&r);

    /* An empty block: no calls, the block is removed from the content. */
    CHECK_EQ_INT(parse("hi\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>", 0, &r, &err), DS4_OK);
    CHECK_EQ_INT(r.n_calls, 0);
    CHECK_STR(r.content, "hi");
    ds4_chat_reply_free(&r);
}

static void test_parse_thinking_gates_calls(void) {
    ds4_chat_reply r;
    ds4_error err;
    /* DSML inside closed reasoning is not a call. */
    const char *quoted = "I could call <｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"></｜DSML｜invoke></｜DSML｜tool_calls>"
                         " but no." TE "Answer.";
    CHECK_EQ_INT(parse(quoted, 1, &r, &err), DS4_OK);
    CHECK_EQ_INT(r.n_calls, 0);
    CHECK_STR(r.content, "Answer.");
    CHECK(r.reasoning && strstr(r.reasoning, "<｜DSML｜tool_calls>") != NULL);
    ds4_chat_reply_free(&r);

    /* Calls are searched after the LAST </think>. */
    const char *after = "a" TE "b" TE "c\n\n<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"></｜DSML｜invoke>"
                        "</｜DSML｜tool_calls>";
    CHECK_EQ_INT(parse(after, 1, &r, &err), DS4_OK);
    CHECK_EQ_INT(r.n_calls, 1);
    CHECK_STR(r.reasoning, "a");
    CHECK_STR(r.content, "b" TE "c");
    ds4_chat_reply_free(&r);
}

static void test_parse_unclosed_thinking(void) {
    ds4_chat_reply r;
    ds4_error err;
    /* No </think>, no block: everything is reasoning. */
    CHECK_EQ_INT(parse(TS "still thinking", 1, &r, &err), DS4_OK);
    CHECK_STR(r.reasoning, "still thinking");
    CHECK_STR(r.content, "");
    CHECK(r.thinking_unclosed && !r.recovered);
    ds4_chat_reply_free(&r);

    /* Issue #318: a call emitted without closing the reasoning is recovered
     * when the block is the last thing generated. */
    const char *rec = "I need the weather.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"w\">\n"
                      "<｜DSML｜parameter name=\"c\" string=\"true\">Rome</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                      "</｜DSML｜tool_calls>\n ";
    CHECK_EQ_INT(parse(rec, 1, &r, &err), DS4_OK);
    CHECK(r.thinking_unclosed && r.recovered);
    CHECK_STR(r.reasoning, "I need the weather.");
    CHECK_STR(r.content, "");
    CHECK_EQ_INT(r.n_calls, 1);
    if (r.n_calls == 1) {
        CHECK_STR(r.calls[0].name, "w");
        CHECK_STR(r.calls[0].arguments, "{\"c\":\"Rome\"}");
    }
    ds4_chat_reply_free(&r);

    /* The same block followed by more reasoning: quoted, not executed. */
    char *quoted = cat(rec, "Hmm, maybe not.", NULL);
    CHECK_EQ_INT(parse(quoted, 1, &r, &err), DS4_OK);
    CHECK(r.thinking_unclosed && !r.recovered);
    CHECK_EQ_INT(r.n_calls, 0);
    CHECK_STR(r.reasoning, quoted);
    CHECK_STR(r.content, "");
    ds4_chat_reply_free(&r);
    free(quoted);

    /* Malformed or unterminated DSML inside unclosed reasoning is reasoning
     * text, not an error. */
    const char *bad = "x <｜DSML｜tool_calls> is the syntax";
    CHECK_EQ_INT(parse(bad, 1, &r, &err), DS4_OK);
    CHECK_STR(r.reasoning, bad);
    CHECK_EQ_INT(r.n_calls, 0);
    ds4_chat_reply_free(&r);
    const char *cut = "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"w\">\n<｜DSML｜parameter name=\"c\" string=\"true\">Ro";
    CHECK_EQ_INT(parse(cut, 1, &r, &err), DS4_OK);
    CHECK_STR(r.reasoning, cut);
    ds4_chat_reply_free(&r);
}

/* Malformed block in the content: DS4_ERR_FORMAT naming the fault, reply
 * filled as plain text. */
static void check_malformed(const char *block, const char *want_in_message) {
    char *text = cat("Answer." TE "Calling.", block, NULL);
    ds4_chat_reply r;
    ds4_error err;
    ds4_status st = parse(text, 1, &r, &err);
    CHECK_MSG(st == DS4_ERR_FORMAT, "status %d for %s", (int)st, block);
    CHECK_MSG(strstr(err.message, want_in_message) != NULL, "message \"%s\" lacks \"%s\"", err.message,
              want_in_message);
    CHECK(!strncmp(err.message, "DSML tool call: ", 16));
    CHECK_EQ_INT(r.n_calls, 0);
    CHECK_STR(r.reasoning, "Answer.");
    CHECK(r.content && !strncmp(r.content, "Calling.", 8) && strlen(r.content) == strlen(text) - 7 - strlen(TE));
    ds4_chat_reply_free(&r);
    free(text);
}

static void test_parse_malformed(void) {
    const char *O = "\n\n<｜DSML｜tool_calls>\n";
    const char *I = "<｜DSML｜invoke name=\"f\">\n";
    char *t;
    check_malformed((t = cat(O, I, "<｜DSML｜parameter name=\"a\" string=\"true\">x", NULL)),
                    "tool call 1 (\"f\"), parameter \"a\": the text ends before </｜DSML｜parameter>");
    free(t);
    check_malformed((t = cat(O, I, "</｜DSML｜invoke>\n", NULL)),
                    "unterminated <｜DSML｜tool_calls> block: the text ends before </｜DSML｜tool_calls>");
    free(t);
    check_malformed((t = cat(O, I, NULL)), "tool call 1 (\"f\"): the text ends before </｜DSML｜invoke>");
    free(t);
    check_malformed((t = cat(O, "<｜DSML｜invoke>\n</｜DSML｜invoke>\n" BLOCK_CLOSE, NULL)),
                    "tool call 1: <｜DSML｜invoke tag has no name=\"...\" attribute");
    free(t);
    check_malformed((t = cat(O, "<｜DSML｜invoke name=\"f", NULL)), "tool call 1: unterminated <｜DSML｜invoke tag");
    free(t);
    check_malformed((t = cat(O, I, "<｜DSML｜parameter string=\"true\">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n" BLOCK_CLOSE,
                             NULL)),
                    "tool call 1 (\"f\"): <｜DSML｜parameter tag has no name=\"...\" attribute");
    free(t);
    check_malformed((t = cat(O, I, "<｜DSML｜parameter name=\"a\" string=\"yes\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                             BLOCK_CLOSE, NULL)),
                    "tool call 1 (\"f\"), parameter \"a\": string=\"yes\" (must be \"true\" or \"false\")");
    free(t);
    check_malformed((t = cat(O, I, "<｜DSML｜parameter name=\"a\" string=\"false\">{oops</｜DSML｜parameter>\n"
                             "</｜DSML｜invoke>\n" BLOCK_CLOSE, NULL)),
                    "tool call 1 (\"f\"), parameter \"a\": string=\"false\" value is not valid JSON: \"{oops\"");
    free(t);
    check_malformed((t = cat(O, I, "<｜DSML｜parameter name=\"a\" string=\"false\">3 4</｜DSML｜parameter>\n"
                             "</｜DSML｜invoke>\n" BLOCK_CLOSE, NULL)),
                    "not valid JSON");
    free(t);
    check_malformed((t = cat(O, "hello\n" BLOCK_CLOSE, NULL)),
                    "tool call 1: expected <｜DSML｜invoke or </｜DSML｜tool_calls>, found \"hello </");
    free(t);
    check_malformed((t = cat(O, I, "text</｜DSML｜invoke>" BLOCK_CLOSE, NULL)),
                    "tool call 1 (\"f\"): expected <｜DSML｜parameter or </｜DSML｜invoke>, found \"text");
    free(t);
    /* Second call at fault: the message counts calls. */
    check_malformed((t = cat(O, I, "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"b\" "
                             "string=\"false\">[1,</｜DSML｜parameter></｜DSML｜invoke>" BLOCK_CLOSE, NULL)),
                    "tool call 2 (\"g\"), parameter \"b\"");
    free(t);
    /* Nested leaf without a name. */
    check_malformed((t = cat(O, I, "<｜DSML｜parameter name=\"o\"><｜DSML｜parameter>x</｜DSML｜parameter>"
                             "</｜DSML｜parameter></｜DSML｜invoke>" BLOCK_CLOSE, NULL)),
                    "nested <｜DSML｜parameter tag has no name");
    free(t);
}

/* ================================================================ round trips */

static void test_dsml_round_trip(void) {
    ds4_chat_tool_call calls[] = {
        {.name = "write_file", .arguments = "{\"path\":\"/tmp/a b.txt\",\"content\":\"if (a > b && c) { x = \\\"&lt;\\\"; }\\n"
                                            "</｜DSML｜parameter> inside\\n\\u0001\",\"mode\":420,\"flags\":[true,false,null],"
                                            "\"meta\":{\"k\":[1,{\"z\":\"</｜DSML｜parameter>\"}]}}"},
        {.name = "we\"ird&<name>", .arguments = "{\"dup\":1,\"dup\":\"1\",\"k\\\"&\":-0.5E-2}"},
        {.name = "none", .arguments = "{}"},
    };
    /* The arguments as the parser returns them: compact, and the one value that
     * the canonical renderer cannot carry through unchanged ("&lt;" in a string
     * is read back as "<") excluded by choosing it only inside non-string JSON. */
    const char *want_args[] = {
        ("{\"path\":\"/tmp/a b.txt\",\"content\":\"if (a > b && c) { x = \\\"<\\\"; }\\n</｜DSML｜parameter> inside\\n"
         "\\u0001\",\"mode\":420,\"flags\":[true,false,null],\"meta\":{\"k\":[1,{\"z\":\"\\u003c/｜DSML｜parameter>\"}]}}"),
        "{\"dup\":1,\"dup\":\"1\",\"k\\\"&\":-0.5E-2}",
        "{}",
    };
    char *block = render_calls(calls, N_OF(calls));
    char *text = cat("Sure.", block, NULL);
    ds4_chat_reply r;
    ds4_error err;
    CHECK_EQ_INT(parse(text, 0, &r, &err), DS4_OK);
    CHECK_STR(r.content, "Sure.");
    CHECK_EQ_INT(r.n_calls, N_OF(calls));
    for (size_t i = 0; i < r.n_calls && i < N_OF(calls); i++) {
        CHECK_STR(r.calls[i].name, calls[i].name);
        CHECK_STR(r.calls[i].arguments, want_args[i]);
        CHECK_STR(r.calls[i].raw_dsml, block);
    }
    /* Parsed calls re-render to the same canonical bytes (the "&lt;" case
     * aside: it now reads "<", which renders raw). */
    if (r.n_calls == N_OF(calls)) {
        ds4_chat_tool_call again[N_OF(calls)];
        for (size_t i = 0; i < N_OF(calls); i++) again[i] = (ds4_chat_tool_call){r.calls[i].id, r.calls[i].name, r.calls[i].arguments, NULL};
        char *block2 = render_calls(again, N_OF(calls));
        ds4_chat_reply r2;
        char *text2 = cat("Sure.", block2, NULL);
        CHECK_EQ_INT(parse(text2, 0, &r2, &err), DS4_OK);
        for (size_t i = 0; i < r2.n_calls && i < N_OF(calls); i++) CHECK_STR(r2.calls[i].arguments, want_args[i]);
        /* Stable after one normalisation: parse(block2) renders back to block2. */
        ds4_chat_tool_call third[N_OF(calls)];
        for (size_t i = 0; i < r2.n_calls && i < N_OF(calls); i++) third[i] = (ds4_chat_tool_call){NULL, r2.calls[i].name, r2.calls[i].arguments, NULL};
        char *block3 = r2.n_calls == N_OF(calls) ? render_calls(third, N_OF(calls)) : NULL;
        CHECK_STR(block3, block2);
        /* Replay with the raw block gives the sampled bytes exactly. */
        for (size_t i = 0; i < N_OF(calls); i++) again[i].raw_dsml = r.calls[i].raw_dsml;
        char *replayed = render_calls(again, N_OF(calls));
        CHECK_STR(replayed, block);
        free(replayed);
        free(block3);
        free(text2);
        ds4_chat_reply_free(&r2);
        free(block2);
    }
    ds4_chat_reply_free(&r);
    free(text);
    free(block);

    /* Without "&lt;" in string values the canonical text round-trips exactly. */
    ds4_chat_tool_call simple[] = {{.name = "f", .arguments = "{\"a\":\"x > y && z\",\"b\":[1,2],\"c\":{\"d\":null}}"}};
    block = render_calls(simple, 1);
    CHECK_EQ_INT(parse(block, 0, &r, &err), DS4_OK);
    CHECK_EQ_INT(r.n_calls, 1);
    if (r.n_calls == 1) {
        CHECK_STR(r.calls[0].arguments, simple[0].arguments);
        ds4_chat_tool_call back = {.name = r.calls[0].name, .arguments = r.calls[0].arguments};
        char *block2 = render_calls(&back, 1);
        CHECK_STR(block2, block);
        free(block2);
    }
    ds4_chat_reply_free(&r);
    free(block);
}

/* A full conversation turn: render the prompt, "generate" a reply, parse it,
 * put it back as history, render again: the new prompt extends the old one
 * plus the reply's bytes (what makes the live KV prefix reusable). */
static void test_conversation_round_trip(void) {
    ds4_chat_tool tools[] = {{.schema_json = "{\"name\":\"w\"}"}};
    ds4_chat_message m[3] = {msg(DS4_CHAT_ROLE_USER, "weather?")};
    ds4_chat_conversation c = conv_of(m, 1, DS4_CHAT_THINK_HIGH);
    c.tools = tools;
    c.n_tools = 1;
    char *prompt = render(&c);
    const char *reply = "Need data." TE "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"w\">\n"
                        "<｜DSML｜parameter name=\"city\" string=\"true\">Rome</｜DSML｜parameter>\n"
                        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    ds4_chat_reply r;
    ds4_error err;
    CHECK_EQ_INT(parse(reply, 1, &r, &err), DS4_OK);
    CHECK_EQ_INT(r.n_calls, 1);
    m[1] = (ds4_chat_message){.role = DS4_CHAT_ROLE_ASSISTANT, .content = r.content, .reasoning = r.reasoning,
                              .calls = r.calls, .n_calls = r.n_calls};
    m[2] = (ds4_chat_message){.role = DS4_CHAT_ROLE_TOOL, .content = "sunny"};
    c.n_messages = 3;
    char *next = render(&c);
    char *want = cat(prompt, reply, E U "<tool_result>sunny</tool_result>" A TS, NULL);
    CHECK_STR(next, want);
    free(want);
    free(next);
    free(prompt);
    ds4_chat_reply_free(&r);
}

/* ================================================================ streaming */

#define MAX_CALLS 8

typedef struct collected {
    char reasoning[4096], content[4096], error[512];
    char names[MAX_CALLS][128], args[MAX_CALLS][1024];
    int starts, ends, errors, events;
    int order_ok;
} collected;

static void append(char *dst, size_t cap, const char *s, size_t n) {
    size_t k = strlen(dst);
    if (k + n >= cap) n = cap - 1 - k;
    memcpy(dst + k, s, n);
    dst[k + n] = '\0';
}

static void collect(void *user, const ds4_chat_event *ev) {
    collected *c = user;
    c->events++;
    size_t i = ev->call_index;
    switch (ev->kind) {
    case DS4_CHAT_EVENT_REASONING:
        CHECK(ev->len > 0);
        append(c->reasoning, sizeof(c->reasoning), ev->text, ev->len);
        if (c->content[0] || c->starts) c->order_ok = 0;
        break;
    case DS4_CHAT_EVENT_CONTENT:
        CHECK(ev->len > 0);
        append(c->content, sizeof(c->content), ev->text, ev->len);
        if (c->starts) c->order_ok = 0;
        break;
    case DS4_CHAT_EVENT_TOOL_START:
        CHECK_EQ_INT(i, (size_t)c->starts);
        if (i < MAX_CALLS) append(c->names[i], sizeof(c->names[i]), ev->name, strlen(ev->name));
        c->starts++;
        break;
    case DS4_CHAT_EVENT_TOOL_ARGS:
        CHECK_EQ_INT(i, (size_t)c->starts - 1);
        if (i < MAX_CALLS) append(c->args[i], sizeof(c->args[i]), ev->text, ev->len);
        break;
    case DS4_CHAT_EVENT_TOOL_END:
        CHECK_EQ_INT(i, (size_t)c->ends);
        c->ends++;
        break;
    case DS4_CHAT_EVENT_ERROR:
        append(c->error, sizeof(c->error), ev->text, ev->len);
        c->errors++;
        break;
    }
}

/* Stream `text` in chunks (size 0 = random 1..9) and return the finish status. */
static ds4_status stream_text(const char *text, int thinking, size_t chunk, collected *col, ds4_chat_reply *r,
                              int *closed_before_finish) {
    memset(col, 0, sizeof(*col));
    col->order_ok = 1;
    ds4_chat_stream *st = NULL;
    ds4_error err = {0};
    CHECK_EQ_INT(ds4_chat_stream_new(thinking, &st, &err), DS4_OK);
    size_t n = strlen(text);
    for (size_t i = 0; i < n;) {
        size_t k = chunk ? chunk : 1 + (size_t)(test_rand_u64() % 9);
        if (k > n - i) k = n - i;
        CHECK_EQ_INT(ds4_chat_stream_feed(st, text + i, k, collect, col, &err), DS4_OK);
        i += k;
    }
    if (closed_before_finish) *closed_before_finish = ds4_chat_stream_block_closed(st);
    ds4_status s = ds4_chat_stream_finish(st, collect, col, r, &err);
    ds4_chat_stream_free(st);
    return s;
}

/* Streamed deltas and call events agree with the one-shot parse. */
static void check_stream_matches(const char *text, int thinking) {
    static const size_t chunks[] = {1, 2, 3, 5, 7, 64, 0, 0};
    ds4_chat_reply want;
    ds4_error err;
    ds4_status want_st = parse(text, thinking, &want, &err);
    for (size_t c = 0; c < N_OF(chunks); c++) {
        collected col;
        ds4_chat_reply got;
        ds4_status st = stream_text(text, thinking, chunks[c], &col, &got, NULL);
        CHECK_EQ_INT(st, want_st);
        CHECK_MSG(!strcmp(col.reasoning, want.reasoning ? want.reasoning : ""), "chunk %zu: reasoning \"%s\" vs \"%s\"",
                  chunks[c], col.reasoning, want.reasoning ? want.reasoning : "");
        if (want_st == DS4_OK) {
            CHECK_MSG(!strcmp(col.content, want.content), "chunk %zu: content \"%s\" vs \"%s\"", chunks[c], col.content,
                      want.content);
            CHECK_EQ_INT(col.starts, want.n_calls);
            CHECK_EQ_INT(col.ends, want.n_calls);
            CHECK_EQ_INT(col.errors, 0);
            for (size_t i = 0; i < want.n_calls && i < MAX_CALLS; i++) {
                CHECK_STR(col.names[i], want.calls[i].name);
                CHECK_STR(col.args[i], want.calls[i].arguments);
            }
        } else {
            CHECK_EQ_INT(col.errors, 1);
        }
        CHECK(col.order_ok);
        ds4_chat_reply_free(&got);
    }
    ds4_chat_reply_free(&want);
}

static void test_stream_matches_batch(void) {
    check_stream_matches("Hello world, <b>bold</b> & <tool_call x> héllo 中文 😀.\n\n", 0);
    check_stream_matches("Let me think.\n" TE "\n\nFour.\n", 1);
    check_stream_matches(TS "abc" TE "def", 1);
    check_stream_matches(CALL_TEXT, 1);
    check_stream_matches("answer\n\n<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"o\">"
                         "<｜DSML｜parameter name=\"a\">1</｜DSML｜parameter></｜DSML｜parameter></｜DSML｜invoke>"
                         "</｜DSML｜tool_calls>\ntrailing",
                         0);
    check_stream_matches("I could write <｜DSML｜tool_calls> here." TE "Answer <DSML｜tool", 1);
    check_stream_matches("Quoted: <｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"></｜DSML｜invoke></｜DSML｜tool_calls>"
                         " then more." TE "Done.",
                         1);
    check_stream_matches("just thinking... ", 1);
    check_stream_matches("need data\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"w\">\n"
                         "<｜DSML｜parameter name=\"c\" string=\"true\">Rome</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                         "</｜DSML｜tool_calls>",
                         1);
    check_stream_matches("plain <tool_calls><invoke name=\"g\"><parameter name=\"p\">v</parameter></invoke></tool_calls>", 0);
    /* Malformed in the content: an ERROR event, FORMAT from finish. */
    check_stream_matches("x" TE "y\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" "
                         "string=\"false\">{bad</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>",
                         1);
}

static void test_stream_events(void) {
    collected col;
    ds4_chat_reply r;
    int closed = 0;
    /* Content block: calls stream live, one argument fragment per parameter. */
    const char *text = "r" TE "c\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
                       "<｜DSML｜parameter name=\"a\" string=\"false\">1</｜DSML｜parameter>\n"
                       "<｜DSML｜parameter name=\"b\" string=\"true\">x</｜DSML｜parameter>\n"
                       "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    CHECK_EQ_INT(stream_text(text, 1, 1, &col, &r, &closed), DS4_OK);
    CHECK(closed);
    CHECK_STR(col.args[0], "{\"a\":1,\"b\":\"x\"}");
    CHECK_EQ_INT(col.events, 7); /* reasoning "r", content "c", start, 3 argument fragments, end */
    ds4_chat_reply_free(&r);

    /* Unclosed reasoning: the calls arrive only at finish. */
    const char *rec = "think\n\n<｜DSML｜tool_calls><｜DSML｜invoke name=\"w\"></｜DSML｜invoke></｜DSML｜tool_calls>";
    ds4_chat_stream *st = NULL;
    ds4_error err = {0};
    memset(&col, 0, sizeof(col));
    col.order_ok = 1;
    CHECK_EQ_INT(ds4_chat_stream_new(1, &st, &err), DS4_OK);
    CHECK_EQ_INT(ds4_chat_stream_feed(st, rec, strlen(rec), collect, &col, &err), DS4_OK);
    CHECK(ds4_chat_stream_block_closed(st));
    CHECK_EQ_INT(col.starts, 0);
    CHECK_STR(col.reasoning, "think");
    CHECK_EQ_INT(ds4_chat_stream_finish(st, collect, &col, &r, &err), DS4_OK);
    CHECK_EQ_INT(col.starts, 1);
    CHECK_EQ_INT(col.ends, 1);
    CHECK(r.recovered);
    ds4_chat_stream_free(st);
    ds4_chat_reply_free(&r);

    /* in_block while inside, and an unterminated block at finish. */
    CHECK_EQ_INT(ds4_chat_stream_new(0, &st, &err), DS4_OK);
    memset(&col, 0, sizeof(col));
    const char *open = "a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">";
    CHECK_EQ_INT(ds4_chat_stream_feed(st, open, strlen(open), collect, &col, &err), DS4_OK);
    CHECK(ds4_chat_stream_in_block(st));
    CHECK_EQ_INT(col.starts, 1);
    CHECK_STR(col.content, "a");
    CHECK_EQ_INT(ds4_chat_stream_finish(st, collect, &col, &r, &err), DS4_ERR_FORMAT);
    CHECK_EQ_INT(col.errors, 1);
    CHECK(strstr(col.error, "the text ends before") != NULL);
    ds4_chat_stream_free(st);
    ds4_chat_reply_free(&r);

    /* Deltas never split a UTF-8 sequence. */
    CHECK_EQ_INT(ds4_chat_stream_new(0, &st, &err), DS4_OK);
    memset(&col, 0, sizeof(col));
    const char *u = "é";
    CHECK_EQ_INT(ds4_chat_stream_feed(st, u, 1, collect, &col, &err), DS4_OK);
    CHECK_EQ_INT(col.events, 0);
    CHECK_EQ_INT(ds4_chat_stream_feed(st, u + 1, 1, collect, &col, &err), DS4_OK);
    CHECK_STR(col.content, "é");
    CHECK_EQ_INT(ds4_chat_stream_finish(st, collect, &col, &r, &err), DS4_OK);
    ds4_chat_stream_free(st);
    ds4_chat_reply_free(&r);
}

/* ================================================================ robustness */

/* Random cuts, byte flips and splices of valid DSML never crash, always give
 * either OK or FORMAT with a message, and the stream agrees on the status. */
static void test_parse_random_mutations(void) {
    const char *seeds[] = {CALL_TEXT,
                           "x\n\n<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"o\">"
                           "<｜DSML｜parameter name=\"a\" string=\"false\">[1]</｜DSML｜parameter></｜DSML｜parameter>"
                           "</｜DSML｜invoke></｜DSML｜tool_calls>",
                           "<tool_calls><invoke name=\"g\"><parameter name=\"p\">v</parameter></invoke></tool_calls>"};
    const char *pieces[] = {"<", ">", "\"", "&", " string=\"false\"", "</｜DSML｜parameter>", "<｜DSML｜parameter",
                            TE, "\n\n", "\xef\xbd", "{", "name=\""};
    char buf[2048];
    for (int iter = 0; iter < 3000; iter++) {
        const char *seed = seeds[test_rand_u64() % N_OF(seeds)];
        size_t n = strlen(seed);
        memcpy(buf, seed, n);
        int ops = 1 + (int)(test_rand_u64() % 4);
        for (int o = 0; o < ops && n > 0; o++) {
            size_t at = (size_t)(test_rand_u64() % n);
            switch (test_rand_u64() % 3) {
            case 0: n = at; break;
            case 1: buf[at] = (char)(test_rand_u64() & 0xff); break;
            default: {
                const char *p = pieces[test_rand_u64() % N_OF(pieces)];
                size_t k = strlen(p);
                if (n + k < sizeof(buf)) {
                    memmove(buf + at + k, buf + at, n - at);
                    memcpy(buf + at, p, k);
                    n += k;
                }
            }
            }
        }
        for (int thinking = 0; thinking < 2; thinking++) {
            ds4_chat_reply r;
            ds4_error err = {0};
            ds4_status st = ds4_chat_parse_reply(buf, n, thinking, &r, &err);
            CHECK(st == DS4_OK || st == DS4_ERR_FORMAT);
            if (st == DS4_ERR_FORMAT) CHECK(err.message[0] != '\0');
            CHECK(r.content != NULL);
            for (size_t i = 0; i < r.n_calls; i++) CHECK(r.calls[i].name && r.calls[i].arguments);
            ds4_chat_reply_free(&r);

            ds4_chat_stream *s = NULL;
            CHECK_EQ_INT(ds4_chat_stream_new(thinking, &s, &err), DS4_OK);
            collected col;
            memset(&col, 0, sizeof(col));
            for (size_t i = 0; i < n;) {
                size_t k = 1 + (size_t)(test_rand_u64() % 16);
                if (k > n - i) k = n - i;
                ds4_chat_stream_feed(s, buf + i, k, collect, &col, &err);
                i += k;
            }
            ds4_status st2 = ds4_chat_stream_finish(s, collect, &col, &r, &err);
            CHECK_EQ_INT(st2, st);
            ds4_chat_stream_free(s);
            ds4_chat_reply_free(&r);
        }
    }
}

static void test_invalid_arguments(void) {
    ds4_error err = {0};
    char *out = NULL;
    CHECK_EQ_INT(ds4_chat_render(NULL, &out, NULL, &err), DS4_ERR_INVALID);
    ds4_chat_conversation c = {.n_messages = 2};
    CHECK_EQ_INT(ds4_chat_render(&c, &out, NULL, &err), DS4_ERR_INVALID);
    ds4_chat_message m = {.role = DS4_CHAT_ROLE_ASSISTANT, .n_calls = 1};
    c = conv_of(&m, 1, DS4_CHAT_THINK_HIGH);
    CHECK_EQ_INT(ds4_chat_render(&c, &out, NULL, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_chat_parse_reply(NULL, 3, 0, NULL, &err), DS4_ERR_INVALID);
    ds4_chat_reply r;
    CHECK_EQ_INT(ds4_chat_parse_reply(NULL, 3, 0, &r, &err), DS4_ERR_INVALID);
    ds4_chat_reply_free(&r);
    ds4_chat_reply_free(NULL);
    ds4_chat_stream_free(NULL);
    ds4_chat_segments_free(NULL);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_fixed_text_hashes),
    TEST_ENTRY(test_special_strings),
    TEST_ENTRY(test_think_for_context),
    TEST_ENTRY(test_render_basic_modes),
    TEST_ENTRY(test_render_multi_turn_reasoning),
    TEST_ENTRY(test_render_system_and_roles),
    TEST_ENTRY(test_render_tool_results),
    TEST_ENTRY(test_render_tools_prompt),
    TEST_ENTRY(test_tool_schema_from_openai),
    TEST_ENTRY(test_render_spec_tool_example),
    TEST_ENTRY(test_render_dsml_canonical),
    TEST_ENTRY(test_dsml_attribute_like_names),
    TEST_ENTRY(test_render_exact_replay),
    TEST_ENTRY(test_render_completion),
    TEST_ENTRY(test_segments_encode_prompt),
    TEST_ENTRY(test_segments_library_messages),
    TEST_ENTRY(test_segments_split_rendered),
    TEST_ENTRY(test_parse_plain),
    TEST_ENTRY(test_parse_tool_calls),
    TEST_ENTRY(test_parse_thinking_gates_calls),
    TEST_ENTRY(test_parse_unclosed_thinking),
    TEST_ENTRY(test_parse_malformed),
    TEST_ENTRY(test_dsml_round_trip),
    TEST_ENTRY(test_conversation_round_trip),
    TEST_ENTRY(test_stream_matches_batch),
    TEST_ENTRY(test_stream_events),
    TEST_ENTRY(test_parse_random_mutations),
    TEST_ENTRY(test_invalid_arguments),
    {0},
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

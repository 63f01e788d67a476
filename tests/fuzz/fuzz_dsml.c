/*
 * fuzz_dsml.c - libFuzzer target for the reply parser and the DSML renderer.
 *
 * The first input byte picks what the rest is:
 *   mode 0: a generated reply, parsed in one call and streamed in chunks;
 *   mode 1: bytes spliced into a valid DSML block (value, name or type slot),
 *           so the fuzzer reaches deep parser states without a seed corpus;
 *   mode 2: tool-call arguments JSON, rendered as DSML and parsed back.
 * Bit 7 of the first byte selects thinking mode. Invariants that must hold on
 * every input abort() when broken, so ASan/UBSan and logic faults both show.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "text/chat.h"
#include "text/chat_internal.h"

static void sink(void *user, const ds4_chat_event *ev) {
    size_t *n = user;
    *n += ev->len;
    if (ev->kind == DS4_CHAT_EVENT_TOOL_START && !ev->name) abort();
    if ((ev->kind == DS4_CHAT_EVENT_REASONING || ev->kind == DS4_CHAT_EVENT_CONTENT) && ev->len == 0) abort();
}

static int valid_json_object(const char *s) {
    chat_buf b = {0};
    int ok = s && s[0] == '{' && chat_json_minify(s, strlen(s), &b);
    if (ok && (b.len != strlen(s) || memcmp(b.ptr, s, b.len) != 0)) ok = 0; /* must already be compact */
    chat_buf_free(&b);
    return ok;
}

static ds4_status check_reply(const char *text, size_t len, int thinking, ds4_chat_reply *r) {
    ds4_error err = {0};
    ds4_status st = ds4_chat_parse_reply(text, len, thinking, r, &err);
    if (st != DS4_OK && st != DS4_ERR_FORMAT) abort();
    if (st == DS4_ERR_FORMAT && !err.message[0]) abort();
    if (!r->content) abort();
    if (r->block_start > r->block_end || r->block_end > len) abort();
    for (size_t i = 0; i < r->n_calls; i++) {
        if (!r->calls[i].name || !r->calls[i].raw_dsml) abort();
        if (!valid_json_object(r->calls[i].arguments)) abort();
    }
    return st;
}

static void run_stream(const char *text, size_t len, int thinking, size_t chunk, ds4_status want) {
    ds4_chat_stream *st = NULL;
    ds4_error err = {0};
    if (ds4_chat_stream_new(thinking, &st, &err) != DS4_OK) abort();
    size_t total = 0;
    for (size_t i = 0; i < len; i += chunk) {
        size_t k = len - i < chunk ? len - i : chunk;
        if (ds4_chat_stream_feed(st, text + i, k, sink, &total, &err) != DS4_OK) abort();
    }
    ds4_chat_reply r;
    if (ds4_chat_stream_finish(st, sink, &total, &r, &err) != want) abort();
    ds4_chat_reply_free(&r);
    ds4_chat_stream_free(st);
}

static const char *const TEMPLATES[] = {
    "ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"false\">%"
    "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    "<｜DSML｜tool_calls><｜DSML｜invoke name=\"%\"><｜DSML｜parameter name=\"a\" string=\"true\">x"
    "</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>",
    "r</think>\n\n<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"o\">%"
    "</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>",
    "think\n\n<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"a\" string=\"%\">1"
    "</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>%",
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const int thinking = data[0] >> 7;
    const int mode = data[0] % 3;
    const char *body = (const char *)data + 1;
    const size_t body_len = size - 1;

    if (mode == 0 || mode == 1) {
        char *text = NULL;
        size_t len = 0;
        if (mode == 0) {
            text = chat_strndup(body, body_len);
            len = body_len;
        } else {
            const char *t = TEMPLATES[(data[0] >> 2) % (sizeof(TEMPLATES) / sizeof(TEMPLATES[0]))];
            chat_buf b = {0};
            for (const char *p = t; *p; p++) {
                if (*p == '%') chat_buf_put(&b, body, body_len);
                else chat_buf_putc(&b, *p);
            }
            len = b.len;
            text = chat_buf_take(&b, NULL);
        }
        if (!text) return 0;
        ds4_chat_reply r;
        ds4_status st = check_reply(text, len, thinking, &r);
        ds4_chat_reply_free(&r);
        run_stream(text, len, thinking, 1 + (size_t)(data[0] >> 3 & 7), st);
        run_stream(text, len, thinking, len ? len : 1, st);
        free(text);
        return 0;
    }

    /* mode 2: render arguments, parse them back. */
    char *args = chat_strndup(body, body_len);
    if (!args) return 0;
    ds4_chat_tool_call call = {.name = "fn<&\"x\">", .arguments = args};
    char *block = NULL;
    ds4_error err = {0};
    if (ds4_chat_render_tool_calls(&call, 1, &block, NULL, &err) != DS4_OK) abort();
    ds4_chat_reply r;
    ds4_status st = check_reply(block, strlen(block), 0, &r);
    /* The canonical block always parses back to the one call, unless the
     * arguments were accepted leniently (raw control bytes in nested strings)
     * and now fail the strict JSON check of a string="false" value. */
    if (st == DS4_OK) {
        if (r.n_calls != 1 || strcmp(r.calls[0].name, call.name) != 0) abort();
    } else {
        chat_buf b = {0};
        if (chat_json_minify(args, strlen(args), &b) && args[strspn(args, " \t\n\r\v\f")] == '{') {
            chat_buf_free(&b);
            abort(); /* a strictly valid object must round-trip */
        }
        chat_buf_free(&b);
    }
    ds4_chat_reply_free(&r);
    free(block);
    free(args);
    return 0;
}

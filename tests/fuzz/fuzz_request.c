/*
 * fuzz_request.c - libFuzzer target for the server's request parser.
 *
 * The first input byte picks the API (low two bits), whether the parsed
 * conversation is also rendered to a prompt (bit 2), the default thinking
 * mode (bits 3-4) and whether any model name is accepted (bit 5); the rest
 * is the HTTP body. The parser is compiled in from src/server/request.c (the fuzz build
 * links only core and text). Invariants abort() when broken: a refused body
 * gets a 4xx/5xx status and a message, an accepted one a complete
 * conversation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/request.c"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    srv_api api = (srv_api)(data[0] & 3);
    int render = (data[0] >> 2) & 1;
    const srv_limits lim = { "deepseek-v4-flash", 4096, (ds4_chat_think)((data[0] >> 3) % 3), (data[0] >> 5) & 1 };
    srv_request r;
    srv_error e;
    if (srv_request_parse(api, (const char *)data + 1, size - 1, &lim, &r, &e) != 0) {
        if (e.status < 400 || e.status > 599 || !e.message[0] || !e.type) abort();
        if (r.root || r.messages || r.tools || r.owned) abort(); /* freed on failure */
        return 0;
    }
    if (api == SRV_API_COMPLETIONS ? !r.prompt : r.n_messages == 0) abort();
    if (r.n_stop > SRV_MAX_STOP || r.max_tokens < 0 || r.max_tokens >= lim.ctx) abort();
    for (size_t i = 0; i < r.n_messages; i++) {
        const ds4_chat_message *m = &r.messages[i];
        if (!m->content) abort();
        for (size_t k = 0; k < m->n_calls; k++)
            if (!m->calls[k].name || !m->calls[k].arguments) abort();
    }
    for (size_t i = 0; i < r.n_tools; i++)
        if (!r.tools[i].schema_json) abort();
    if (render) {
        char *text = NULL;
        size_t len = 0;
        ds4_error err = { 0 };
        ds4_status st;
        if (api == SRV_API_COMPLETIONS) {
            st = ds4_chat_render_completion(r.prompt, r.think, 4096, &text, &len, &err);
        } else {
            ds4_chat_conversation conv = { r.messages, r.n_messages, r.tools, r.n_tools, r.tool_choice_none, r.think,
                                           4096 };
            st = ds4_chat_render(&conv, &text, &len, &err);
        }
        if (st == DS4_OK && (!text || strlen(text) != len)) abort();
        free(text);
    }
    srv_request_free(&r);
    return 0;
}

/*
 * request.h - the body of an API request, parsed and validated.
 *
 * One parser per API turns the client's JSON into the conversation of
 * text/chat.h plus the generation parameters. It checks every field it reads
 * (type, range, UTF-8) and reports the first problem as an HTTP status and a
 * message naming the field, so the HTTP layer can answer with a clear 4xx in
 * the API's own error format. It needs no model: the fuzzer runs it alone
 * (tests/fuzz/fuzz_request.c).
 */
#ifndef DS4_SERVER_REQUEST_H
#define DS4_SERVER_REQUEST_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "text/chat.h"

typedef enum srv_api {
    SRV_API_CHAT = 0,    /* POST /v1/chat/completions (OpenAI) */
    SRV_API_COMPLETIONS, /* POST /v1/completions (OpenAI legacy) */
    SRV_API_RESPONSES,   /* POST /v1/responses (OpenAI Responses) */
    SRV_API_MESSAGES,    /* POST /v1/messages (Anthropic) */
} srv_api;

/* An error for the client: HTTP status, the API's error type and a message. */
typedef struct srv_error {
    int status;
    const char *type; /* "invalid_request_error", "not_found_error", ... (static) */
    char param[64];   /* the field at fault, "" when none */
    char message[400];
} srv_error;

/* Fill an error; returns -1 so parsers can `return srv_fail(...)`. */
int srv_fail(srv_error *e, int status, const char *type, const char *param, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

/* What the parser needs to know about the server. */
typedef struct srv_limits {
    const char *model_name; /* the id /v1/models lists */
    int64_t ctx;            /* context size in tokens: max_tokens above it is refused */
    ds4_chat_think default_think;
    int any_model; /* accept any model name (clients that insist on their own) */
} srv_limits;

#define SRV_MAX_STOP 16

typedef struct srv_request {
    srv_api api;
    cJSON *root;    /* the parsed body; strings below may point into it */
    void **owned;   /* everything else the parser allocated */
    size_t n_owned, cap_owned;

    const char *model;
    ds4_chat_message *messages;
    size_t n_messages;
    ds4_chat_tool *tools;
    size_t n_tools;
    int tool_choice_none;
    const char *prompt; /* /v1/completions */

    ds4_chat_think think;
    /* Sampling: a field is used only when its has_ flag is set (the worker
     * fills in DS4's defaults otherwise). */
    int has_temperature, has_top_p, has_top_k, has_min_p;
    float temperature, top_p, min_p;
    int top_k;
    uint64_t seed; /* 0: none given */
    int64_t max_tokens; /* 0: not given */
    const char *stop[SRV_MAX_STOP];
    size_t n_stop;
    int stream, include_usage;
} srv_request;

/* Parse and validate `len` bytes of body for `api`. On failure returns -1
 * with *e filled (the request is left empty); on success 0. */
int srv_request_parse(srv_api api, const char *body, size_t len, const srv_limits *lim, srv_request *out,
                      srv_error *e);
void srv_request_free(srv_request *r);

/* 1 when s[0..n) is valid UTF-8 (no overlong forms, no surrogates). */
int srv_utf8_valid(const char *s, size_t n);

/* "chat.completions", "completions", "responses", "messages". */
const char *srv_api_name(srv_api api);

#endif

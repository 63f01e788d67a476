/*
 * format.c - what each API answers: whole bodies, SSE events, errors.
 *
 *   chat.completions  chat.completion / chat.completion.chunk; reasoning in
 *                     `reasoning_content`, calls in `tool_calls` (the header
 *                     first, then argument fragments as they are decoded);
 *   completions       text_completion;
 *   responses         a response with reasoning / message / function_call
 *                     output items and the typed SSE events of the API;
 *   messages          an Anthropic message: thinking, text and tool_use
 *                     content blocks; message_start ... message_stop events.
 * Streams end with usage: OpenAI's last chunk carries it (plus the
 * choices-less usage chunk when stream_options.include_usage is set).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

enum { BLOCK_NONE = 0, BLOCK_REASONING, BLOCK_TEXT, BLOCK_TOOL };

const char *srv_call_id_prefix(srv_api api) { return api == SRV_API_MESSAGES ? "toolu_" : "call_"; }

static cJSON *str_n(const char *s, size_t n) {
    char *tmp = malloc(n + 1);
    if (!tmp) return cJSON_CreateString("");
    memcpy(tmp, s, n);
    tmp[n] = '\0';
    cJSON *v = cJSON_CreateString(tmp);
    free(tmp);
    return v;
}

static void put_json(chat_buf *b, cJSON *obj) {
    char *text = cJSON_PrintUnformatted(obj);
    if (text) chat_buf_puts(b, text);
    else b->oom = 1;
    free(text);
    cJSON_Delete(obj);
}

/* One SSE event: "event: NAME\n" (when named) + "data: JSON\n\n". Takes obj. */
static void sse(srv_job *job, const char *event, cJSON *obj) {
    chat_buf b = { 0 };
    if (event) {
        chat_buf_puts(&b, "event: ");
        chat_buf_puts(&b, event);
        chat_buf_putc(&b, '\n');
    }
    chat_buf_puts(&b, "data: ");
    put_json(&b, obj);
    chat_buf_puts(&b, "\n\n");
    if (b.ptr && !b.oom) srv_job_write(job, b.ptr, b.len);
    chat_buf_free(&b);
}

static const char *model_of(const srv_job *job) { return job->req.model ? job->req.model : "deepseek-v4-flash"; }

/* ------------------------------------------------------------ errors */

static const char *openai_code(int status) {
    switch (status) {
    case 401: return "invalid_api_key";
    case 404: return "model_not_found";
    case 413: return "request_too_large";
    case 503: return "server_overloaded";
    default: return NULL;
    }
}

void srv_format_error(chat_buf *b, srv_api api, const srv_error *e) {
    cJSON *root = cJSON_CreateObject();
    cJSON *err = cJSON_CreateObject();
    const char *type = e->type ? e->type : "invalid_request_error";
    if (api == SRV_API_MESSAGES) {
        cJSON_AddStringToObject(root, "type", "error");
        cJSON_AddStringToObject(err, "type", type);
        cJSON_AddStringToObject(err, "message", e->message);
    } else {
        cJSON_AddStringToObject(err, "message", e->message);
        cJSON_AddStringToObject(err, "type", !strcmp(type, "not_found_error") ? "invalid_request_error"
                                             : !strcmp(type, "overloaded_error") ? "server_error" : type);
        if (e->param[0]) cJSON_AddStringToObject(err, "param", e->param);
        else cJSON_AddNullToObject(err, "param");
        const char *code = openai_code(e->status);
        if (code) cJSON_AddStringToObject(err, "code", code);
        else cJSON_AddNullToObject(err, "code");
    }
    cJSON_AddItemToObject(root, "error", err);
    put_json(b, root);
}

/* ------------------------------------------------------------ usage */

static cJSON *usage_openai(const srv_usage *u) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)u->prompt_tokens);
    cJSON_AddNumberToObject(o, "completion_tokens", (double)u->completion_tokens);
    cJSON_AddNumberToObject(o, "total_tokens", (double)(u->prompt_tokens + u->completion_tokens));
    cJSON *d = cJSON_AddObjectToObject(o, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", (double)u->cached_tokens);
    return o;
}

static cJSON *usage_responses(const srv_usage *u) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "input_tokens", (double)u->prompt_tokens);
    cJSON *d = cJSON_AddObjectToObject(o, "input_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", (double)u->cached_tokens);
    cJSON_AddNumberToObject(o, "output_tokens", (double)u->completion_tokens);
    d = cJSON_AddObjectToObject(o, "output_tokens_details");
    cJSON_AddNumberToObject(d, "reasoning_tokens", 0);
    cJSON_AddNumberToObject(o, "total_tokens", (double)(u->prompt_tokens + u->completion_tokens));
    return o;
}

static cJSON *usage_anthropic(const srv_usage *u, bool input_too) {
    cJSON *o = cJSON_CreateObject();
    if (input_too) {
        cJSON_AddNumberToObject(o, "input_tokens", (double)(u->prompt_tokens - u->cached_tokens));
        cJSON_AddNumberToObject(o, "cache_creation_input_tokens", 0);
        cJSON_AddNumberToObject(o, "cache_read_input_tokens", (double)u->cached_tokens);
    }
    cJSON_AddNumberToObject(o, "output_tokens", (double)u->completion_tokens);
    return o;
}

static const char *finish_openai(srv_finish f) {
    switch (f) {
    case SRV_FINISH_LENGTH: return "length";
    case SRV_FINISH_TOOLS: return "tool_calls";
    default: return "stop";
    }
}

static const char *finish_anthropic(srv_finish f) {
    switch (f) {
    case SRV_FINISH_LENGTH: return "max_tokens";
    case SRV_FINISH_TOOLS: return "tool_use";
    case SRV_FINISH_STOP_SEQ: return "stop_sequence";
    default: return "end_turn";
    }
}

/* ------------------------------------------------------------ OpenAI chunks */

static cJSON *chunk_base(const srv_job *job) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", job->id);
    cJSON_AddStringToObject(o, "object",
                            job->req.api == SRV_API_COMPLETIONS ? "text_completion" : "chat.completion.chunk");
    cJSON_AddNumberToObject(o, "created", (double)job->created);
    cJSON_AddStringToObject(o, "model", model_of(job));
    return o;
}

/* A chunk with one choice; returns the delta object to fill (chat) or the
 * choice itself (completions). */
static cJSON *chunk_choice(const srv_job *job, cJSON **chunk, const char *finish) {
    *chunk = chunk_base(job);
    cJSON *choices = cJSON_AddArrayToObject(*chunk, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", 0);
    if (job->req.api == SRV_API_COMPLETIONS) {
        cJSON_AddNullToObject(c, "logprobs");
        if (finish) cJSON_AddStringToObject(c, "finish_reason", finish);
        else cJSON_AddNullToObject(c, "finish_reason");
        return c;
    }
    cJSON *delta = cJSON_AddObjectToObject(c, "delta");
    cJSON_AddNullToObject(c, "logprobs");
    if (finish) cJSON_AddStringToObject(c, "finish_reason", finish);
    else cJSON_AddNullToObject(c, "finish_reason");
    return delta;
}

/* ------------------------------------------------------------ Anthropic / Responses blocks */

static void resp_event(srv_job *job, const char *type, cJSON *o) {
    cJSON_AddStringToObject(o, "type", type);
    cJSON_AddNumberToObject(o, "sequence_number", job->seq++);
    sse(job, type, o);
}

static cJSON *resp_message_item(const srv_job *job, const char *text, size_t len, const char *status) {
    cJSON *item = cJSON_CreateObject();
    cJSON_AddStringToObject(item, "id", job->msg_item_id);
    cJSON_AddStringToObject(item, "type", "message");
    cJSON_AddStringToObject(item, "role", "assistant");
    cJSON_AddStringToObject(item, "status", status);
    cJSON *content = cJSON_AddArrayToObject(item, "content");
    if (text) {
        cJSON *part = cJSON_CreateObject();
        cJSON_AddStringToObject(part, "type", "output_text");
        cJSON_AddItemToObject(part, "text", str_n(text, len));
        cJSON_AddArrayToObject(part, "annotations");
        cJSON_AddItemToArray(content, part);
    }
    return item;
}

static cJSON *resp_reasoning_item(const srv_job *job, const char *text, size_t len) {
    cJSON *item = cJSON_CreateObject();
    cJSON_AddStringToObject(item, "id", job->reasoning_item_id);
    cJSON_AddStringToObject(item, "type", "reasoning");
    cJSON_AddArrayToObject(item, "summary");
    cJSON *content = cJSON_AddArrayToObject(item, "content");
    if (text) {
        cJSON *part = cJSON_CreateObject();
        cJSON_AddStringToObject(part, "type", "reasoning_text");
        cJSON_AddItemToObject(part, "text", str_n(text, len));
        cJSON_AddItemToArray(content, part);
    }
    return item;
}

static cJSON *resp_call_item(const srv_job *job, size_t i, const char *name, const char *args, size_t args_len,
                             const char *status) {
    cJSON *item = cJSON_CreateObject();
    cJSON_AddStringToObject(item, "id", job->call_item_ids[i]);
    cJSON_AddStringToObject(item, "type", "function_call");
    cJSON_AddStringToObject(item, "status", status);
    cJSON_AddStringToObject(item, "call_id", job->call_ids[i]);
    cJSON_AddStringToObject(item, "name", name);
    cJSON_AddItemToObject(item, "arguments", str_n(args ? args : "", args ? args_len : 0));
    return item;
}

/* The fields naming the open block's content part in a Responses event:
 * its item, its output index and content index 0. */
static cJSON *content_ref(const srv_job *job, const char *item_id) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "item_id", item_id);
    cJSON_AddNumberToObject(o, "output_index", job->block_index);
    cJSON_AddNumberToObject(o, "content_index", 0);
    return o;
}

static void close_block(srv_job *job) {
    if (job->block == BLOCK_NONE) return;
    if (job->req.api == SRV_API_MESSAGES) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "content_block_stop");
        cJSON_AddNumberToObject(o, "index", job->block_index);
        sse(job, "content_block_stop", o);
    } else if (job->req.api == SRV_API_RESPONSES) {
        cJSON *o;
        if (job->block == BLOCK_TEXT) {
            const chat_buf *t = &job->content_acc;
            o = content_ref(job, job->msg_item_id);
            cJSON_AddItemToObject(o, "text", str_n(t->ptr ? t->ptr : "", t->len));
            resp_event(job, "response.output_text.done", o);
            o = content_ref(job, job->msg_item_id);
            cJSON *part = cJSON_AddObjectToObject(o, "part");
            cJSON_AddStringToObject(part, "type", "output_text");
            cJSON_AddItemToObject(part, "text", str_n(t->ptr ? t->ptr : "", t->len));
            cJSON_AddArrayToObject(part, "annotations");
            resp_event(job, "response.content_part.done", o);
            o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "output_index", job->block_index);
            cJSON_AddItemToObject(o, "item", resp_message_item(job, t->ptr ? t->ptr : "", t->len, "completed"));
            resp_event(job, "response.output_item.done", o);
        } else if (job->block == BLOCK_REASONING) {
            const chat_buf *t = &job->reasoning_acc;
            o = content_ref(job, job->reasoning_item_id);
            cJSON_AddItemToObject(o, "text", str_n(t->ptr ? t->ptr : "", t->len));
            resp_event(job, "response.reasoning_text.done", o);
            o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "output_index", job->block_index);
            cJSON_AddItemToObject(o, "item", resp_reasoning_item(job, t->ptr ? t->ptr : "", t->len));
            resp_event(job, "response.output_item.done", o);
        }
        /* a function_call item is closed by srv_format_tool_end */
    }
    job->block = BLOCK_NONE;
}

/* Make `kind` the open block (a new one when it differs from the open one). */
static void open_block(srv_job *job, int kind) {
    if (job->block == kind && kind != BLOCK_TOOL) return;
    close_block(job);
    job->block = kind;
    job->block_index++;
    if (job->req.api == SRV_API_MESSAGES) {
        if (kind == BLOCK_TOOL) return; /* srv_format_tool_start writes its own start */
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "content_block_start");
        cJSON_AddNumberToObject(o, "index", job->block_index);
        cJSON *blk = cJSON_AddObjectToObject(o, "content_block");
        if (kind == BLOCK_REASONING) {
            cJSON_AddStringToObject(blk, "type", "thinking");
            cJSON_AddStringToObject(blk, "thinking", "");
            cJSON_AddStringToObject(blk, "signature", "");
        } else {
            cJSON_AddStringToObject(blk, "type", "text");
            cJSON_AddStringToObject(blk, "text", "");
        }
        sse(job, "content_block_start", o);
    } else if (job->req.api == SRV_API_RESPONSES && kind != BLOCK_TOOL) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "output_index", job->block_index);
        if (kind == BLOCK_REASONING) {
            if (!job->reasoning_item_id[0]) srv_random_id(job->reasoning_item_id, sizeof job->reasoning_item_id, "rs_");
            cJSON_AddItemToObject(o, "item", resp_reasoning_item(job, NULL, 0));
            resp_event(job, "response.output_item.added", o);
        } else {
            if (!job->msg_item_id[0]) srv_random_id(job->msg_item_id, sizeof job->msg_item_id, "msg_");
            cJSON_AddItemToObject(o, "item", resp_message_item(job, NULL, 0, "in_progress"));
            resp_event(job, "response.output_item.added", o);
            o = content_ref(job, job->msg_item_id);
            cJSON *part = cJSON_AddObjectToObject(o, "part");
            cJSON_AddStringToObject(part, "type", "output_text");
            cJSON_AddStringToObject(part, "text", "");
            cJSON_AddArrayToObject(part, "annotations");
            resp_event(job, "response.content_part.added", o);
        }
    }
}

/* ------------------------------------------------------------ whole responses */

static cJSON *responses_object(srv_job *job, const srv_result *res, const char *status) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", job->id);
    cJSON_AddStringToObject(o, "object", "response");
    cJSON_AddNumberToObject(o, "created_at", (double)job->created);
    cJSON_AddStringToObject(o, "status", status);
    cJSON_AddStringToObject(o, "model", model_of(job));
    cJSON *output = cJSON_AddArrayToObject(o, "output");
    if (res) {
        const ds4_chat_reply *r = res->reply;
        if (!strcmp(status, "incomplete")) {
            cJSON *d = cJSON_AddObjectToObject(o, "incomplete_details");
            cJSON_AddStringToObject(d, "reason", "max_output_tokens");
        } else {
            cJSON_AddNullToObject(o, "incomplete_details");
        }
        if (r->reasoning) {
            if (!job->reasoning_item_id[0]) srv_random_id(job->reasoning_item_id, sizeof job->reasoning_item_id, "rs_");
            cJSON_AddItemToArray(output, resp_reasoning_item(job, r->reasoning, r->reasoning_len));
        }
        if (r->content_len || !r->n_calls) {
            if (!job->msg_item_id[0]) srv_random_id(job->msg_item_id, sizeof job->msg_item_id, "msg_");
            cJSON_AddItemToArray(output, resp_message_item(job, r->content, r->content_len, "completed"));
        }
        for (size_t i = 0; i < r->n_calls; i++) {
            if (!job->call_item_ids[i][0]) srv_random_id(job->call_item_ids[i], sizeof job->call_item_ids[i], "fc_");
            const char *a = r->calls[i].arguments ? r->calls[i].arguments : "{}";
            cJSON_AddItemToArray(output, resp_call_item(job, i, r->calls[i].name ? r->calls[i].name : "", a,
                                                        strlen(a), "completed"));
        }
        cJSON_AddItemToObject(o, "usage", usage_responses(&res->usage));
    } else {
        cJSON_AddNullToObject(o, "usage");
    }
    cJSON_AddBoolToObject(o, "parallel_tool_calls", 1);
    cJSON_AddStringToObject(o, "tool_choice", job->req.tool_choice_none ? "none" : "auto");
    cJSON_AddArrayToObject(o, "tools");
    return o;
}

static cJSON *chat_object(srv_job *job, const srv_result *res) {
    const ds4_chat_reply *r = res->reply;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", job->id);
    cJSON_AddStringToObject(o, "object", "chat.completion");
    cJSON_AddNumberToObject(o, "created", (double)job->created);
    cJSON_AddStringToObject(o, "model", model_of(job));
    cJSON *choice = cJSON_CreateObject();
    cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "choices"), choice);
    cJSON_AddNumberToObject(choice, "index", 0);
    cJSON *msg = cJSON_AddObjectToObject(choice, "message");
    cJSON_AddStringToObject(msg, "role", "assistant");
    if (r->content_len || !r->n_calls) cJSON_AddItemToObject(msg, "content", str_n(r->content, r->content_len));
    else cJSON_AddNullToObject(msg, "content");
    if (r->reasoning) cJSON_AddItemToObject(msg, "reasoning_content", str_n(r->reasoning, r->reasoning_len));
    if (r->n_calls) {
        cJSON *calls = cJSON_AddArrayToObject(msg, "tool_calls");
        for (size_t i = 0; i < r->n_calls; i++) {
            cJSON *c = cJSON_CreateObject();
            cJSON_AddStringToObject(c, "id", res->call_ids[i]);
            cJSON_AddStringToObject(c, "type", "function");
            cJSON *fn = cJSON_AddObjectToObject(c, "function");
            cJSON_AddStringToObject(fn, "name", r->calls[i].name ? r->calls[i].name : "");
            cJSON_AddStringToObject(fn, "arguments", r->calls[i].arguments ? r->calls[i].arguments : "{}");
            cJSON_AddItemToArray(calls, c);
        }
    }
    cJSON_AddNullToObject(choice, "logprobs");
    cJSON_AddStringToObject(choice, "finish_reason", finish_openai(res->finish));
    cJSON_AddItemToObject(o, "usage", usage_openai(&res->usage));
    return o;
}

static cJSON *completion_object(srv_job *job, const srv_result *res) {
    cJSON *o = chunk_base(job);
    cJSON *choice = cJSON_CreateObject();
    cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "choices"), choice);
    cJSON_AddNumberToObject(choice, "index", 0);
    cJSON_AddItemToObject(choice, "text", str_n(res->text, res->text_len));
    cJSON_AddNullToObject(choice, "logprobs");
    cJSON_AddStringToObject(choice, "finish_reason", finish_openai(res->finish));
    cJSON_AddItemToObject(o, "usage", usage_openai(&res->usage));
    return o;
}

static cJSON *message_object(srv_job *job, const srv_result *res, bool empty) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", job->id);
    cJSON_AddStringToObject(o, "type", "message");
    cJSON_AddStringToObject(o, "role", "assistant");
    cJSON_AddStringToObject(o, "model", model_of(job));
    cJSON *content = cJSON_AddArrayToObject(o, "content");
    if (empty) {
        cJSON_AddNullToObject(o, "stop_reason");
        cJSON_AddNullToObject(o, "stop_sequence");
        cJSON_AddItemToObject(o, "usage", usage_anthropic(&res->usage, true));
        return o;
    }
    const ds4_chat_reply *r = res->reply;
    if (r->reasoning) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "type", "thinking");
        cJSON_AddItemToObject(b, "thinking", str_n(r->reasoning, r->reasoning_len));
        cJSON_AddStringToObject(b, "signature", "");
        cJSON_AddItemToArray(content, b);
    }
    if (r->content_len || !r->n_calls) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "type", "text");
        cJSON_AddItemToObject(b, "text", str_n(r->content, r->content_len));
        cJSON_AddItemToArray(content, b);
    }
    for (size_t i = 0; i < r->n_calls; i++) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "type", "tool_use");
        cJSON_AddStringToObject(b, "id", res->call_ids[i]);
        cJSON_AddStringToObject(b, "name", r->calls[i].name ? r->calls[i].name : "");
        cJSON *input = cJSON_Parse(r->calls[i].arguments ? r->calls[i].arguments : "{}");
        if (!cJSON_IsObject(input)) {
            cJSON_Delete(input);
            input = cJSON_CreateObject();
        }
        cJSON_AddItemToObject(b, "input", input);
        cJSON_AddItemToArray(content, b);
    }
    cJSON_AddStringToObject(o, "stop_reason", finish_anthropic(res->finish));
    if (res->stop_sequence) cJSON_AddStringToObject(o, "stop_sequence", res->stop_sequence);
    else cJSON_AddNullToObject(o, "stop_sequence");
    cJSON_AddItemToObject(o, "usage", usage_anthropic(&res->usage, true));
    return o;
}

/* ------------------------------------------------------------ streaming */

void srv_format_stream_begin(srv_job *job) {
    job->block = BLOCK_NONE;
    job->block_index = -1;
    cJSON *chunk;
    switch (job->req.api) {
    case SRV_API_CHAT: {
        cJSON *delta = chunk_choice(job, &chunk, NULL);
        cJSON_AddStringToObject(delta, "role", "assistant");
        cJSON_AddStringToObject(delta, "content", "");
        sse(job, NULL, chunk);
        break;
    }
    case SRV_API_COMPLETIONS: break;
    case SRV_API_MESSAGES: {
        srv_result empty = { 0 };
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "message_start");
        cJSON_AddItemToObject(o, "message", message_object(job, &empty, true));
        sse(job, "message_start", o);
        break;
    }
    case SRV_API_RESPONSES: {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddItemToObject(o, "response", responses_object(job, NULL, "in_progress"));
        resp_event(job, "response.created", o);
        o = cJSON_CreateObject();
        cJSON_AddItemToObject(o, "response", responses_object(job, NULL, "in_progress"));
        resp_event(job, "response.in_progress", o);
        break;
    }
    }
}

static void text_delta(srv_job *job, int kind, const char *text, size_t len) {
    cJSON *chunk, *o;
    switch (job->req.api) {
    case SRV_API_CHAT: {
        cJSON *delta = chunk_choice(job, &chunk, NULL);
        cJSON_AddItemToObject(delta, kind == BLOCK_REASONING ? "reasoning_content" : "content", str_n(text, len));
        sse(job, NULL, chunk);
        break;
    }
    case SRV_API_COMPLETIONS: {
        cJSON *choice = chunk_choice(job, &chunk, NULL);
        cJSON_AddItemToObject(choice, "text", str_n(text, len));
        sse(job, NULL, chunk);
        break;
    }
    case SRV_API_MESSAGES: {
        open_block(job, kind);
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "content_block_delta");
        cJSON_AddNumberToObject(o, "index", job->block_index);
        cJSON *d = cJSON_AddObjectToObject(o, "delta");
        cJSON_AddStringToObject(d, "type", kind == BLOCK_REASONING ? "thinking_delta" : "text_delta");
        cJSON_AddItemToObject(d, kind == BLOCK_REASONING ? "thinking" : "text", str_n(text, len));
        sse(job, "content_block_delta", o);
        break;
    }
    case SRV_API_RESPONSES: {
        open_block(job, kind);
        chat_buf_put(kind == BLOCK_REASONING ? &job->reasoning_acc : &job->content_acc, text, len);
        o = content_ref(job, kind == BLOCK_REASONING ? job->reasoning_item_id : job->msg_item_id);
        cJSON_AddItemToObject(o, "delta", str_n(text, len));
        resp_event(job, kind == BLOCK_REASONING ? "response.reasoning_text.delta" : "response.output_text.delta", o);
        break;
    }
    }
}

void srv_format_reasoning(srv_job *job, const char *text, size_t len) { text_delta(job, BLOCK_REASONING, text, len); }
void srv_format_content(srv_job *job, const char *text, size_t len) { text_delta(job, BLOCK_TEXT, text, len); }

void srv_format_tool_start(srv_job *job, size_t i, const char *name) {
    snprintf(job->call_names[i], sizeof job->call_names[i], "%s", name);
    cJSON *chunk, *o;
    switch (job->req.api) {
    case SRV_API_CHAT: {
        cJSON *delta = chunk_choice(job, &chunk, NULL);
        cJSON *c = cJSON_CreateObject();
        cJSON_AddItemToArray(cJSON_AddArrayToObject(delta, "tool_calls"), c);
        cJSON_AddNumberToObject(c, "index", (double)i);
        cJSON_AddStringToObject(c, "id", job->call_ids[i]);
        cJSON_AddStringToObject(c, "type", "function");
        cJSON *fn = cJSON_AddObjectToObject(c, "function");
        cJSON_AddStringToObject(fn, "name", name);
        cJSON_AddStringToObject(fn, "arguments", "");
        sse(job, NULL, chunk);
        break;
    }
    case SRV_API_MESSAGES: {
        open_block(job, BLOCK_TOOL);
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "content_block_start");
        cJSON_AddNumberToObject(o, "index", job->block_index);
        cJSON *blk = cJSON_AddObjectToObject(o, "content_block");
        cJSON_AddStringToObject(blk, "type", "tool_use");
        cJSON_AddStringToObject(blk, "id", job->call_ids[i]);
        cJSON_AddStringToObject(blk, "name", name);
        cJSON_AddObjectToObject(blk, "input");
        sse(job, "content_block_start", o);
        break;
    }
    case SRV_API_RESPONSES: {
        open_block(job, BLOCK_TOOL);
        srv_random_id(job->call_item_ids[i], sizeof job->call_item_ids[i], "fc_");
        o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "output_index", job->block_index);
        cJSON_AddItemToObject(o, "item", resp_call_item(job, i, name, "", 0, "in_progress"));
        resp_event(job, "response.output_item.added", o);
        break;
    }
    case SRV_API_COMPLETIONS: break;
    }
}

void srv_format_tool_args(srv_job *job, size_t i, const char *text, size_t len) {
    cJSON *chunk, *o;
    switch (job->req.api) {
    case SRV_API_CHAT: {
        cJSON *delta = chunk_choice(job, &chunk, NULL);
        cJSON *c = cJSON_CreateObject();
        cJSON_AddItemToArray(cJSON_AddArrayToObject(delta, "tool_calls"), c);
        cJSON_AddNumberToObject(c, "index", (double)i);
        cJSON *fn = cJSON_AddObjectToObject(c, "function");
        cJSON_AddItemToObject(fn, "arguments", str_n(text, len));
        sse(job, NULL, chunk);
        break;
    }
    case SRV_API_MESSAGES:
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "content_block_delta");
        cJSON_AddNumberToObject(o, "index", job->block_index);
        cJSON *d = cJSON_AddObjectToObject(o, "delta");
        cJSON_AddStringToObject(d, "type", "input_json_delta");
        cJSON_AddItemToObject(d, "partial_json", str_n(text, len));
        sse(job, "content_block_delta", o);
        break;
    case SRV_API_RESPONSES:
        chat_buf_put(&job->args_acc[i], text, len);
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "item_id", job->call_item_ids[i]);
        cJSON_AddNumberToObject(o, "output_index", job->block_index);
        cJSON_AddItemToObject(o, "delta", str_n(text, len));
        resp_event(job, "response.function_call_arguments.delta", o);
        break;
    case SRV_API_COMPLETIONS: break;
    }
}

void srv_format_tool_end(srv_job *job, size_t i) {
    if (job->req.api == SRV_API_MESSAGES) {
        close_block(job);
    } else if (job->req.api == SRV_API_RESPONSES) {
        const chat_buf *a = &job->args_acc[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "item_id", job->call_item_ids[i]);
        cJSON_AddNumberToObject(o, "output_index", job->block_index);
        cJSON_AddItemToObject(o, "arguments", str_n(a->ptr ? a->ptr : "", a->len));
        resp_event(job, "response.function_call_arguments.done", o);
        o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "output_index", job->block_index);
        cJSON_AddItemToObject(o, "item", resp_call_item(job, i, job->call_names[i], a->ptr, a->len, "completed"));
        resp_event(job, "response.output_item.done", o);
        job->block = BLOCK_NONE;
    }
}

void srv_format_finish(srv_job *job, const srv_result *res) {
    const srv_request *r = &job->req;
    if (!r->stream) {
        cJSON *o = r->api == SRV_API_CHAT          ? chat_object(job, res)
                   : r->api == SRV_API_COMPLETIONS ? completion_object(job, res)
                   : r->api == SRV_API_MESSAGES    ? message_object(job, res, false)
                                                   : responses_object(job, res,
                                                                      res->finish == SRV_FINISH_LENGTH ? "incomplete"
                                                                                                       : "completed");
        chat_buf b = { 0 };
        put_json(&b, o);
        if (b.ptr && !b.oom) srv_job_write(job, b.ptr, b.len);
        chat_buf_free(&b);
        return;
    }
    cJSON *chunk, *o;
    switch (r->api) {
    case SRV_API_CHAT:
    case SRV_API_COMPLETIONS:
        chunk_choice(job, &chunk, finish_openai(res->finish));
        if (r->api == SRV_API_COMPLETIONS) cJSON_AddStringToObject(cJSON_GetArrayItem(
                                               cJSON_GetObjectItem(chunk, "choices"), 0), "text", "");
        cJSON_AddItemToObject(chunk, "usage", usage_openai(&res->usage));
        sse(job, NULL, chunk);
        if (r->include_usage) {
            chunk = chunk_base(job);
            cJSON_AddArrayToObject(chunk, "choices");
            cJSON_AddItemToObject(chunk, "usage", usage_openai(&res->usage));
            sse(job, NULL, chunk);
        }
        srv_job_write(job, "data: [DONE]\n\n", 14);
        break;
    case SRV_API_MESSAGES:
        close_block(job);
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "message_delta");
        cJSON *d = cJSON_AddObjectToObject(o, "delta");
        cJSON_AddStringToObject(d, "stop_reason", finish_anthropic(res->finish));
        if (res->stop_sequence) cJSON_AddStringToObject(d, "stop_sequence", res->stop_sequence);
        else cJSON_AddNullToObject(d, "stop_sequence");
        cJSON_AddItemToObject(o, "usage", usage_anthropic(&res->usage, true));
        sse(job, "message_delta", o);
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "message_stop");
        sse(job, "message_stop", o);
        break;
    case SRV_API_RESPONSES: {
        close_block(job);
        const char *status = res->finish == SRV_FINISH_LENGTH ? "incomplete" : "completed";
        o = cJSON_CreateObject();
        cJSON_AddItemToObject(o, "response", responses_object(job, res, status));
        resp_event(job, strcmp(status, "completed") ? "response.incomplete" : "response.completed", o);
        break;
    }
    }
}

/*
 * test_server.c - the server's request parser and its generation-to-response
 * path, without a model: request bodies of the four APIs -> conversation and
 * errors; generated text (reasoning, DSML tool calls, stop sequences) ->
 * each API's body and SSE events, with call ids that replay the exact DSML.
 */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"
#include "test.h"

static const srv_limits LIMITS = { "deepseek-v4-flash", 4096, DS4_CHAT_THINK_HIGH, 0 };

static int parse(srv_api api, const char *body, srv_request *r, srv_error *e) {
    return srv_request_parse(api, body, strlen(body), &LIMITS, r, e);
}

static void expect_error(srv_api api, const char *body, int status, const char *param) {
    srv_request r;
    srv_error e;
    int rc = parse(api, body, &r, &e);
    CHECK_MSG(rc == -1 && e.status == status, "%s -> %d (%s)", body, e.status, e.message);
    if (param) CHECK_MSG(!strcmp(e.param, param), "%s -> param '%s'", body, e.param);
    CHECK(e.message[0] != '\0');
}

static void test_request_errors(void) {
    expect_error(SRV_API_CHAT, "{", 400, NULL);
    expect_error(SRV_API_CHAT, "[]", 400, NULL);
    expect_error(SRV_API_CHAT, "", 400, NULL);
    expect_error(SRV_API_CHAT, "{\"messages\":\"hi\"}", 400, "messages");
    expect_error(SRV_API_CHAT, "{\"messages\":[]}", 400, "messages");
    expect_error(SRV_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":1}]}", 400, "content");
    expect_error(SRV_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":\"hot\"}", 400,
                 "temperature");
    expect_error(SRV_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":4096}", 400,
                 "max_tokens");
    expect_error(SRV_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":1.5}", 400,
                 "max_tokens");
    expect_error(SRV_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":1}", 400, "stream");
    expect_error(SRV_API_CHAT, "{\"model\":\"gpt-9\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", 404,
                 "model");
    expect_error(SRV_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}", 400, NULL);
    expect_error(SRV_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"reasoning_effort\":\"huge\"}",
                 400, "reasoning_effort");
    expect_error(SRV_API_MESSAGES, "{\"max_tokens\":5,\"messages\":[{\"role\":\"system\",\"content\":\"x\"}]}", 400,
                 "role");
    expect_error(SRV_API_MESSAGES, "{\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":"
                 "\"image\"}]}]}", 400, "content");
    expect_error(SRV_API_COMPLETIONS, "{\"prompt\":5}", 400, "prompt");
    expect_error(SRV_API_RESPONSES, "{\"input\":\"x\",\"previous_response_id\":\"resp_1\"}", 400,
                 "previous_response_id");
    expect_error(SRV_API_RESPONSES, "{}", 400, "input");
    expect_error(SRV_API_CHAT, "{\"messages\":[{\"role\":\"system\",\"content\":\"x\"}]}", 400, "messages");
    expect_error(SRV_API_RESPONSES, "{\"input\":[{\"type\":\"reasoning\",\"summary\":[]}]}", 400, "input");
    expect_error(SRV_API_CHAT, "{\"n\":2,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", 400, "n");
    CHECK(srv_utf8_valid("h\xc3\xa9", 3));
    CHECK(!srv_utf8_valid("\xc0\xaf", 2));       /* overlong */
    CHECK(!srv_utf8_valid("\xed\xa0\x80", 3));   /* surrogate */
    CHECK(!srv_utf8_valid("\xe2\x82", 2));       /* truncated */
}

static void test_request_sources(void) {
    srv_request r;
    srv_error e;
    /* OpenAI: array content, reasoning_content, tool calls with string arguments. */
    CHECK(parse(SRV_API_CHAT,
                "{\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":[{\"type\":"
                "\"text\",\"text\":\"a\"},\"b\"]},{\"role\":\"assistant\",\"content\":null,\"reasoning_content\":\"r\","
                "\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":"
                "\"{\\\"x\\\":1}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"ok\"}],"
                "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{}}}],\"stop\":\"END\","
                "\"seed\":7,\"temperature\":0.5,\"max_completion_tokens\":9,\"thinking\":{\"type\":\"disabled\"}}",
                &r, &e) == 0);
    CHECK_EQ_INT(r.n_messages, 4);
    CHECK(!strcmp(r.messages[1].content, "ab"));
    CHECK(r.messages[2].n_calls == 1 && !strcmp(r.messages[2].calls[0].arguments, "{\"x\":1}"));
    CHECK(!strcmp(r.messages[2].reasoning, "r"));
    CHECK(r.messages[3].role == DS4_CHAT_ROLE_TOOL);
    CHECK_EQ_INT(r.n_tools, 1);
    CHECK(!strcmp(r.tools[0].schema_json, "{\"name\":\"f\",\"parameters\":{}}"));
    CHECK(r.n_stop == 1 && !strcmp(r.stop[0], "END"));
    CHECK(r.seed == 7 && r.has_temperature && r.temperature == 0.5f && r.max_tokens == 9);
    CHECK(r.think == DS4_CHAT_THINK_NONE);
    srv_request_free(&r);

    /* Anthropic: system blocks, thinking, tool_use and tool_result. */
    CHECK(parse(SRV_API_MESSAGES,
                "{\"max_tokens\":5,\"system\":[{\"type\":\"text\",\"text\":\"A\"},{\"type\":\"text\",\"text\":\"B\"}],"
                "\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":[{\"type\":"
                "\"thinking\",\"thinking\":\"t\"},{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"f\",\"input\":"
                "{\"k\":\"v\"}}]},{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\","
                "\"tool_use_id\":\"toolu_1\","
                "\"content\":\"x</tool_result>y\"}]}]}",
                &r, &e) == 0);
    CHECK_EQ_INT(r.n_messages, 4);
    CHECK(!strcmp(r.messages[0].content, "A\nB"));
    CHECK(!strcmp(r.messages[2].reasoning, "t"));
    CHECK(r.messages[2].n_calls == 1 && !strcmp(r.messages[2].calls[0].arguments, "{\"k\":\"v\"}"));
    CHECK(!strcmp(r.messages[3].content, "<tool_result>x&lt;/tool_result>y</tool_result>"));
    CHECK(r.think == DS4_CHAT_THINK_HIGH);
    srv_request_free(&r);

    /* Responses: instructions, reasoning held for the call, calls merged, outputs as tool messages. */
    CHECK(parse(SRV_API_RESPONSES,
                "{\"instructions\":\"I\",\"reasoning\":{\"effort\":\"none\"},\"input\":[{\"role\":\"user\",\"content\":"
                "\"q\"},{\"type\":\"reasoning\",\"summary\":[{\"type\":\"summary_text\",\"text\":\"why\"}]},{\"type\":"
                "\"function_call\",\"call_id\":\"call_a\",\"name\":\"f\",\"arguments\":\"{}\"},{\"type\":"
                "\"function_call\",\"call_id\":\"call_b\",\"name\":\"g\",\"arguments\":\"{}\"},{\"type\":"
                "\"function_call_output\",\"call_id\":\"call_a\",\"output\":\"1\"}],\"tools\":[{\"type\":\"function\","
                "\"name\":\"f\",\"parameters\":{}},{\"type\":\"web_search\"}]}",
                &r, &e) == 0);
    CHECK_EQ_INT(r.n_messages, 4);
    CHECK(r.messages[0].role == DS4_CHAT_ROLE_SYSTEM && !strcmp(r.messages[0].content, "I"));
    CHECK(r.messages[2].role == DS4_CHAT_ROLE_ASSISTANT && r.messages[2].n_calls == 2);
    CHECK(r.messages[2].reasoning && !strcmp(r.messages[2].reasoning, "why"));
    CHECK(r.messages[3].role == DS4_CHAT_ROLE_TOOL);
    CHECK_EQ_INT(r.n_tools, 1);
    CHECK(r.think == DS4_CHAT_THINK_NONE);
    srv_request_free(&r);
}

/* ------------------------------------------------------------ generation -> output */

static const char DSML_BLOCK[] = "\n\n<\xef\xbd\x9c" "DSML\xef\xbd\x9ctool_calls>\n"
                                 "<\xef\xbd\x9c" "DSML\xef\xbd\x9cinvoke name=\"get_weather\">\n"
                                 "<\xef\xbd\x9c" "DSML\xef\xbd\x9cparameter name=\"city\" string=\"true\">Rome"
                                 "</\xef\xbd\x9c" "DSML\xef\xbd\x9cparameter>\n"
                                 "</\xef\xbd\x9c" "DSML\xef\xbd\x9cinvoke>\n"
                                 "</\xef\xbd\x9c" "DSML\xef\xbd\x9ctool_calls>";

typedef struct run_out {
    char *body; /* job output */
    srv_finish finish;
    char call_id[48];
    char remembered[512];
} run_out;

/* Feed `text` in 3-byte pieces as if generated for the request `body`. */
static run_out run_text(srv_api api, const char *body, bool thinking, const char *text) {
    run_out o = { 0 };
    srv_job *job = srv_job_new();
    srv_error e;
    if (srv_request_parse(api, body, strlen(body), &LIMITS, &job->req, &e)) {
        fprintf(stderr, "  parse failed: %s\n", e.message);
        test_current_failures++;
        srv_job_free(job);
        return o;
    }
    snprintf(job->id, sizeof job->id, "id-1");
    srv_gen g;
    ds4_error err = { 0 };
    CHECK(srv_gen_init(&g, NULL, job, thinking, &err) == 0);
    if (job->req.stream) srv_format_stream_begin(job);
    for (size_t i = 0, n = strlen(text); i < n; i += 3) srv_gen_push(&g, text + i, n - i < 3 ? n - i : 3);
    srv_tool_memory mem = { 0 };
    srv_usage usage = { 10, 4, 20, 0, 0 };
    srv_gen_complete(&g, &mem, &usage);
    o.finish = g.finish;
    if (job->n_calls) {
        snprintf(o.call_id, sizeof o.call_id, "%s", job->call_ids[0]);
        const char *raw = srv_tool_memory_get(&mem, job->call_ids[0]);
        if (raw) snprintf(o.remembered, sizeof o.remembered, "%s", raw);
    }
    o.body = job->out.ptr ? strdup(job->out.ptr) : strdup("");
    srv_gen_free(&g);
    srv_tool_memory_free(&mem);
    srv_job_free(job);
    return o;
}

#define TOOLS "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{}}}]"

static void test_tool_calls_non_streaming(void) {
    char text[1024];
    snprintf(text, sizeof text, "Let me check.%s", DSML_BLOCK);
    run_out o = run_text(SRV_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"w\"}]," TOOLS "}", false, text);
    cJSON *root = cJSON_Parse(o.body);
    cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
    cJSON *msg = cJSON_GetObjectItem(choice, "message");
    cJSON *call = cJSON_GetArrayItem(cJSON_GetObjectItem(msg, "tool_calls"), 0);
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(choice, "finish_reason")), "tool_calls"));
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(msg, "content")), "Let me check."));
    const char *id = cJSON_GetStringValue(cJSON_GetObjectItem(call, "id"));
    CHECK(id && !strncmp(id, "call_", 5) && strlen(id) == 37 && !strcmp(id, o.call_id));
    cJSON *fn = cJSON_GetObjectItem(call, "function");
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(fn, "name")), "get_weather"));
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(fn, "arguments")), "{\"city\":\"Rome\"}"));
    CHECK_MSG(!strcmp(o.remembered, DSML_BLOCK), "remembered '%s'", o.remembered);
    cJSON_Delete(root);
    free(o.body);

    o = run_text(SRV_API_MESSAGES, "{\"max_tokens\":9,\"messages\":[{\"role\":\"user\",\"content\":\"w\"}]," TOOLS "}",
                 false, text);
    root = cJSON_Parse(o.body);
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(root, "stop_reason")), "tool_use"));
    cJSON *blk = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "content"), 1);
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(blk, "type")), "tool_use"));
    CHECK(!strncmp(cJSON_GetStringValue(cJSON_GetObjectItem(blk, "id")), "toolu_", 6));
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(blk, "input"), "city")), "Rome"));
    cJSON_Delete(root);
    free(o.body);

    o = run_text(SRV_API_RESPONSES, "{\"input\":\"w\",\"tools\":[{\"type\":\"function\",\"name\":\"get_weather\"}]}",
                 false, text);
    root = cJSON_Parse(o.body);
    cJSON *item = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "output"), 1);
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(item, "type")), "function_call"));
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(item, "arguments")), "{\"city\":\"Rome\"}"));
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(item, "call_id")), o.call_id));
    cJSON_Delete(root);
    free(o.body);
}

/* The concatenation of the string at `path` (arrays: their first item) over
 * every SSE data line that contains `marker`. */
static void collect(const char *sse, const char *marker, const char *const *path, int depth, chat_buf *out) {
    for (const char *line = sse; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        if (len > 6 && !strncmp(line, "data: ", 6)) {
            char *data = strndup(line + 6, len - 6);
            cJSON *root = strstr(data, marker) ? cJSON_Parse(data) : NULL;
            const cJSON *o = root;
            for (int i = 0; o && i < depth; i++) {
                if (cJSON_IsArray(o)) o = cJSON_GetArrayItem(o, 0);
                o = o ? cJSON_GetObjectItem(o, path[i]) : NULL;
                if (cJSON_IsArray(o)) o = cJSON_GetArrayItem(o, 0);
            }
            if (cJSON_IsString(o)) chat_buf_puts(out, o->valuestring);
            cJSON_Delete(root);
            free(data);
        }
        line = end ? end + 1 : NULL;
    }
}

static void test_tool_calls_streaming(void) {
    char text[1024];
    snprintf(text, sizeof text, "<think>hmm</think>Sure.%s", DSML_BLOCK);
    run_out o = run_text(SRV_API_CHAT,
                         "{\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"w\"}]," TOOLS "}", true,
                         text + 7);
    CHECK(strstr(o.body, "\"reasoning_content\":\"h") != NULL);
    CHECK(strstr(o.body, "\"name\":\"get_weather\"") != NULL);
    CHECK(strstr(o.body, "\"finish_reason\":\"tool_calls\"") != NULL);
    CHECK(strstr(o.body, "data: [DONE]\n\n") != NULL);
    chat_buf args = { 0 }, content = { 0 };
    static const char *const ARGS[] = { "choices", "delta", "tool_calls", "function", "arguments" };
    static const char *const CONTENT[] = { "choices", "delta", "content" };
    collect(o.body, "\"arguments\"", ARGS, 5, &args);
    collect(o.body, "\"content\"", CONTENT, 3, &content);
    CHECK_MSG(args.ptr && !strcmp(args.ptr, "{\"city\":\"Rome\"}"), "streamed arguments '%s'", args.ptr);
    CHECK_MSG(content.ptr && !strcmp(content.ptr, "Sure."), "streamed content '%s'", content.ptr);
    CHECK(o.call_id[0] && strstr(o.body, o.call_id));
    chat_buf_free(&args);
    chat_buf_free(&content);
    free(o.body);

    o = run_text(SRV_API_MESSAGES,
                 "{\"stream\":true,\"max_tokens\":9,\"messages\":[{\"role\":\"user\",\"content\":\"w\"}]," TOOLS "}",
                 true, text + 7);
    const char *order[] = { "event: message_start", "\"type\":\"thinking\"", "thinking_delta", "content_block_stop",
                            "\"type\":\"text\"", "text_delta", "\"type\":\"tool_use\"", "input_json_delta",
                            "\"stop_reason\":\"tool_use\"", "event: message_stop" };
    const char *at = o.body;
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        const char *hit = strstr(at, order[i]);
        CHECK_MSG(hit != NULL, "missing or out of order: %s", order[i]);
        if (hit) at = hit;
    }
    free(o.body);

    o = run_text(SRV_API_RESPONSES,
                 "{\"stream\":true,\"input\":\"w\",\"tools\":[{\"type\":\"function\",\"name\":\"get_weather\"}]}",
                 true, text + 7);
    const char *rorder[] = { "response.created", "response.reasoning_text.delta", "response.output_text.delta",
                             "response.function_call_arguments.delta", "response.function_call_arguments.done",
                             "response.completed" };
    at = o.body;
    for (size_t i = 0; i < sizeof rorder / sizeof rorder[0]; i++) {
        const char *hit = strstr(at, rorder[i]);
        CHECK_MSG(hit != NULL, "missing or out of order: %s", rorder[i]);
        if (hit) at = hit;
    }
    free(o.body);
}

static void test_stop_sequences(void) {
    run_out o = run_text(SRV_API_CHAT, "{\"stop\":[\"STOP\"],\"messages\":[{\"role\":\"user\",\"content\":\"w\"}]}",
                         false, "abcSTOPdef");
    CHECK(o.finish == SRV_FINISH_STOP_SEQ);
    CHECK_MSG(strstr(o.body, "\"content\":\"abc\"") != NULL, "%s", o.body);
    free(o.body);
    /* held back across pushes, then released when it does not complete */
    o = run_text(SRV_API_CHAT,
                 "{\"stream\":true,\"stop\":\"xyz\",\"messages\":[{\"role\":\"user\",\"content\":\"w\"}]}",
                 false, "abxyabxy");
    CHECK(o.finish == SRV_FINISH_STOP);
    chat_buf content = { 0 };
    static const char *const CONTENT[] = { "choices", "delta", "content" };
    collect(o.body, "\"content\"", CONTENT, 3, &content);
    CHECK_MSG(content.ptr && !strcmp(content.ptr, "abxyabxy"), "'%s'", content.ptr);
    chat_buf_free(&content);
    free(o.body);
    /* Anthropic reports the sequence */
    o = run_text(SRV_API_MESSAGES, "{\"max_tokens\":9,\"stop_sequences\":[\"##\"],\"messages\":[{\"role\":\"user\","
                 "\"content\":\"w\"}]}", false, "one##two");
    CHECK(strstr(o.body, "\"stop_reason\":\"stop_sequence\"") && strstr(o.body, "\"stop_sequence\":\"##\""));
    free(o.body);
}

static void test_dsml_structure_is_greedy(void) {
    srv_job *job = srv_job_new();
    srv_error e;
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"w\"}]," TOOLS "}";
    CHECK(srv_request_parse(SRV_API_CHAT, body, strlen(body), &LIMITS, &job->req, &e) == 0);
    srv_gen g;
    ds4_error err = { 0 };
    CHECK(srv_gen_init(&g, NULL, job, false, &err) == 0);
    const char *steps[][2] = {
        { "Let me look string=\"true\">", "0" }, /* plain content */
        { "\n\n<\xef\xbd\x9c" "DSML\xef\xbd\x9ctool_calls>\n"
          "<\xef\xbd\x9c" "DSML\xef\xbd\x9cinvoke name=\"f\">\n", "1" },
        { "<\xef\xbd\x9c" "DSML\xef\xbd\x9cparameter name=\"city\" string=\"true\">Ro", "0" }, /* free text */
        { "me</\xef\xbd\x9c" "DSML\xef\xbd\x9cparameter>\n", "1" },
        { "<\xef\xbd\x9c" "DSML\xef\xbd\x9cparameter name=\"n\" string=\"false\">3", "1" }, /* JSON value */
    };
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        srv_gen_push(&g, steps[i][0], strlen(steps[i][0]));
        CHECK_MSG(srv_gen_dsml_structural(&g) == (steps[i][1][0] == '1'), "step %zu", i);
    }
    srv_gen_free(&g);
    srv_job_free(job);
}

static void test_error_bodies(void) {
    srv_error e;
    srv_fail(&e, 401, "authentication_error", NULL, "bad key");
    chat_buf b = { 0 };
    srv_format_error(&b, SRV_API_MESSAGES, &e);
    CHECK(!strcmp(b.ptr, "{\"type\":\"error\",\"error\":{\"type\":\"authentication_error\",\"message\":\"bad key\"}}"));
    chat_buf_reset(&b);
    srv_fail(&e, 400, "invalid_request_error", "messages", "no");
    srv_format_error(&b, SRV_API_CHAT, &e);
    CHECK(!strcmp(b.ptr, "{\"error\":{\"message\":\"no\",\"type\":\"invalid_request_error\",\"param\":\"messages\","
                         "\"code\":null}}"));
    chat_buf_free(&b);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_request_errors),
    TEST_ENTRY(test_request_sources),
    TEST_ENTRY(test_tool_calls_non_streaming),
    TEST_ENTRY(test_tool_calls_streaming),
    TEST_ENTRY(test_stop_sequences),
    TEST_ENTRY(test_dsml_structure_is_greedy),
    TEST_ENTRY(test_error_bodies),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

/*
 * chat.h - DeepSeek V4 chat prompts and DSML tool calls (DS4 semantics).
 *
 * Two directions:
 *
 *  - Rendering: a conversation (messages, tool definitions, thinking mode)
 *    becomes the exact prompt TEXT ds4-server builds
 *    [ds4_server.c:render_chat_prompt_text]; tokenizing that text in
 *    "rendered chat" mode (the seven special strings become special tokens,
 *    the text between them is BPE'd on its own) gives DS4's token sequence.
 *    The token-level helpers of ds4.c (encode_chat_prompt,
 *    ds4_chat_append_message) are expressed as SEGMENT lists instead: special
 *    markers plus plain text pieces that the caller tokenizes one by one with
 *    the plain tokenizer, so special strings inside them are NOT recognised.
 *
 *  - Parsing: a generated reply becomes reasoning + content + structured tool
 *    calls (name, arguments as compact JSON object text) read back from DSML,
 *    either in one call on the finished text or incrementally (a stream that
 *    reports reasoning/content deltas and tool-call start/arguments/end events
 *    as the text is generated).
 *
 * Spec: docs/deepseek-v4-flash.md sections 5.4 and 5.5. The places where this
 * code deliberately differs from ds4 (clearer errors for malformed DSML, the
 * recovery of a tool call emitted inside unclosed reasoning) are documented
 * at ds4_chat_parse_reply.
 *
 * All strings are UTF-8 and NUL-terminated unless a length is given. Every
 * function that allocates returns DS4_ERR_NOMEM on allocation failure and
 * leaves its outputs empty.
 */
#ifndef DS4_TEXT_CHAT_H
#define DS4_TEXT_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ special strings */

/* The seven special strings, in the order the rendered-chat tokenizer tests
 * them [ds4.c:special_token_at]. The bars are U+FF5C, the spaces in BOS/EOS
 * U+2581. */
typedef enum ds4_chat_special {
    DS4_CHAT_SPECIAL_BOS = 0,     /* <｜begin▁of▁sentence｜> */
    DS4_CHAT_SPECIAL_EOS,         /* <｜end▁of▁sentence｜> */
    DS4_CHAT_SPECIAL_USER,        /* <｜User｜> */
    DS4_CHAT_SPECIAL_ASSISTANT,   /* <｜Assistant｜> */
    DS4_CHAT_SPECIAL_THINK_START, /* <think> */
    DS4_CHAT_SPECIAL_THINK_END,   /* </think> */
    DS4_CHAT_SPECIAL_DSML,        /* ｜DSML｜ */
    DS4_CHAT_SPECIAL_COUNT
} ds4_chat_special;

/* The literal string of a special marker ("" for an out-of-range value). */
const char *ds4_chat_special_text(ds4_chat_special special);

/* ------------------------------------------------------------ thinking modes */

typedef enum ds4_chat_think {
    DS4_CHAT_THINK_NONE = 0, /* assistant turn opened with </think> */
    DS4_CHAT_THINK_HIGH = 1, /* opened with <think> */
    DS4_CHAT_THINK_MAX = 2,  /* HIGH plus the Think Max prefix right after BOS */
} ds4_chat_think;

/* Below this context size MAX falls back to HIGH [ds4.c:DS4_THINK_MAX_MIN_CONTEXT]. */
#define DS4_CHAT_THINK_MAX_MIN_CONTEXT 393216u

/* The mode actually used for a session of ctx_size tokens: MAX becomes HIGH
 * when ctx_size < 393216 (a ctx_size of 0 counts as 0) [ds4.c:ds4_think_mode_for_context]. */
ds4_chat_think ds4_chat_think_for_context(ds4_chat_think mode, uint64_t ctx_size);

/* "none" / "high" / "max". */
const char *ds4_chat_think_name(ds4_chat_think mode);

/* The Think Max prefix X (476 bytes; see chat.c for its origin and SHA-256). */
const char *ds4_chat_think_max_prefix(void);

/* The tool prompt around the schema lines: P (1183 bytes) before them and C
 * (146 bytes) after them (see chat.c for origin and SHA-256). */
const char *ds4_chat_tools_prompt_head(void);
const char *ds4_chat_tools_prompt_tail(void);

/* ------------------------------------------------------------ conversation */

typedef enum ds4_chat_role {
    DS4_CHAT_ROLE_SYSTEM = 0, /* "system" and "developer" */
    DS4_CHAT_ROLE_USER,       /* "user" */
    DS4_CHAT_ROLE_ASSISTANT,  /* "assistant" */
    DS4_CHAT_ROLE_TOOL,       /* "tool" and "function": a tool result */
    DS4_CHAT_ROLE_OTHER,      /* anything else: silently dropped when rendering */
} ds4_chat_role;

/* Map an API role name to a role (NULL counts as "user", as ds4 does for a
 * message without role); unknown names give DS4_CHAT_ROLE_OTHER. */
ds4_chat_role ds4_chat_role_from_name(const char *name);

/* One tool call of an assistant message. All pointers are borrowed. */
typedef struct ds4_chat_tool_call {
    const char *id;        /* API call id; not rendered (may be NULL) */
    const char *name;      /* tool name (NULL renders as "") */
    const char *arguments; /* arguments as JSON text, normally an object */
    /* Exact DSML bytes the model generated for the block this call came from
     * (including its leading "\n\n" if it had one), or NULL. When every call
     * of a message carries the same non-empty raw_dsml, that block is rendered
     * verbatim instead of the canonical form (ds4's exact tool replay). */
    const char *raw_dsml;
} ds4_chat_tool_call;

/* One message. All pointers are borrowed; NULL strings render as "". */
typedef struct ds4_chat_message {
    ds4_chat_role role;
    const char *content;
    const char *reasoning;           /* assistant only */
    const ds4_chat_tool_call *calls; /* assistant only */
    size_t n_calls;
    const char *tool_call_id;        /* tool only; not rendered */
    const char *name;                /* tool only (the tool's name); not rendered */
} ds4_chat_message;

/* One tool definition. The prompt shows one JSON line per tool: schema_json
 * verbatim when it is set (ds4 copies the client's `function` value byte for
 * byte, whitespace kept), else the line synthesised from the fields as
 * {"name":NAME,"description":DESC,"parameters":PARAMETERS} (DESC "" and
 * PARAMETERS {"type":"object","properties":{}} when NULL), which is the form
 * ds4 synthesises for tools it rewrites. A tool whose line is empty is skipped. */
typedef struct ds4_chat_tool {
    const char *schema_json;
    const char *name;
    const char *description;
    const char *parameters; /* JSON schema text */
} ds4_chat_tool;

typedef struct ds4_chat_conversation {
    const ds4_chat_message *messages;
    size_t n_messages;
    const ds4_chat_tool *tools;
    size_t n_tools;
    int tool_choice_none; /* tool_choice "none": tools are not rendered */
    ds4_chat_think think; /* requested mode; the context rule is applied */
    uint64_t ctx_size;    /* session context in tokens, for the MAX rule */
} ds4_chat_conversation;

/* Render the conversation to the server prompt text (section 5.4, "Server
 * rendering"): BOS, [X], system block (tool prompt first when tools are
 * active, then every system message joined by "\n\n"), the messages, and the
 * assistant generation prefix when the last rendered message is a user or
 * tool message. *out is malloc'd and NUL-terminated; *out_len may be NULL. */
ds4_status ds4_chat_render(const ds4_chat_conversation *conv, char **out, size_t *out_len,
                           ds4_error *err);

/* /v1/completions prompt text: BOS [X] "You are a helpful assistant" User
 * PROMPT Assistant <think>|</think> [ds4_server.c:parse_completion_request]. */
ds4_status ds4_chat_render_completion(const char *prompt, ds4_chat_think think, uint64_t ctx_size,
                                      char **out, size_t *out_len, ds4_error *err);

/* The tool prompt P + schema lines + C for the given tools, or "" when no tool
 * has a non-empty line [ds4_server.c:append_tools_prompt_text]. */
ds4_status ds4_chat_render_tools_prompt(const ds4_chat_tool *tools, size_t n_tools, char **out,
                                        size_t *out_len, ds4_error *err);

/* One tool's schema line (see ds4_chat_tool). */
ds4_status ds4_chat_tool_schema_line(const ds4_chat_tool *tool, char **out, ds4_error *err);

/* The schema line of an OpenAI tool object as a client sent it: the raw bytes
 * of its top-level "function" value, else the whole object (surrounding
 * whitespace removed) [ds4_server.c:openai_function_schema_from_tool]. Fails
 * with DS4_ERR_FORMAT when tool_json is not a JSON object. */
ds4_status ds4_chat_tool_schema_from_openai(const char *tool_json, char **out, ds4_error *err);

/* The DSML block of an assistant message's calls, exactly as the renderer
 * writes it after the content: the shared raw_dsml when all calls carry the
 * same one, else the canonical block "\n\n<｜DSML｜tool_calls>\n...
 * </｜DSML｜tool_calls>" [ds4_server.c:append_dsml_tool_calls_text]; "" for
 * no calls. */
ds4_status ds4_chat_render_tool_calls(const ds4_chat_tool_call *calls, size_t n_calls, char **out,
                                      size_t *out_len, ds4_error *err);

/* ------------------------------------------------------------ segments */

/* A piece of a token sequence: a special marker, or plain text that the caller
 * tokenizes on its own with the plain text tokenizer (no special strings
 * recognised, no BPE merge across pieces). */
typedef struct ds4_chat_segment {
    int is_special;
    ds4_chat_special special; /* when is_special */
    char *text;               /* when !is_special: owned, NUL-terminated, len > 0 */
    size_t len;
} ds4_chat_segment;

typedef struct ds4_chat_segments {
    ds4_chat_segment *v;
    size_t n, cap;
} ds4_chat_segments;

void ds4_chat_segments_free(ds4_chat_segments *segs);
ds4_status ds4_chat_segments_push_special(ds4_chat_segments *segs, ds4_chat_special special,
                                          ds4_error *err);
/* Appends nothing when len == 0 (empty text has no tokens). */
ds4_status ds4_chat_segments_push_text(ds4_chat_segments *segs, const char *text, size_t len,
                                       ds4_error *err);

/* One-shot prompt [ds4.c:encode_chat_prompt], appended to segs: BOS, [X when
 * the effective mode is MAX], [system when non-empty], User, prompt,
 * Assistant, <think> (HIGH/MAX) or </think> (NONE). The context rule is
 * applied to `think` with ctx_size. */
ds4_status ds4_chat_encode_prompt(ds4_chat_segments *segs, const char *system, const char *prompt,
                                  ds4_chat_think think, uint64_t ctx_size, ds4_error *err);

/* The library message helper [ds4.c:ds4_chat_append_message], appended to
 * segs: "system"/"developer" -> the text alone; "assistant" -> Assistant, then
 * </think> unless content starts with the bytes "<think>" or "</think>", then
 * the text; any other role (NULL = "user") -> User, then "Tool: " for
 * "tool"/"function", then the text. No EOS. */
ds4_status ds4_chat_append_message_segments(ds4_chat_segments *segs, const char *role,
                                            const char *content, ds4_error *err);

/* Assistant + (<think> for HIGH/MAX, </think> for NONE)
 * [ds4.c:ds4_chat_append_assistant_prefix]. `think` is used as given. */
ds4_status ds4_chat_append_assistant_prefix(ds4_chat_segments *segs, ds4_chat_think think,
                                            ds4_error *err);

/* Split rendered text the way the rendered-chat tokenizer does
 * [ds4.c:tokenize_rendered_chat_vocab]: every occurrence of a special string
 * (tested in ds4_chat_special order at each byte) becomes a special segment,
 * each stretch between them a text segment. Appends to segs. */
ds4_status ds4_chat_split_rendered(const char *text, ds4_chat_segments *segs, ds4_error *err);

/* ------------------------------------------------------------ parsing replies */

/* A generated reply, split. Calls have id == NULL and raw_dsml set to the
 * exact block they came from, so the calls can be put back into an assistant
 * message for byte-exact replay. All strings are owned by the reply. */
typedef struct ds4_chat_reply {
    char *reasoning; /* NULL when the reply has no reasoning part */
    size_t reasoning_len;
    char *content;   /* never NULL in a filled reply */
    size_t content_len;
    ds4_chat_tool_call *calls;
    size_t n_calls;
    /* Offsets of the DSML block in the text (from its leading "\n\n" if any to
     * the end of the closing tag) when calls were parsed; 0/0 otherwise. Text
     * after block_end is ignored. */
    size_t block_start, block_end;
    int thinking_unclosed; /* thinking mode and the reply has no </think> */
    int recovered;         /* the calls came from unclosed reasoning (see below) */
} ds4_chat_reply;

void ds4_chat_reply_free(ds4_chat_reply *reply);

/*
 * Parse a generated reply. `in_thinking` says the prompt ended with <think>
 * (HIGH/MAX), i.e. generation starts inside the reasoning block. The text is
 * len bytes; NUL bytes are ordinary bytes (hence the _len fields).
 *
 * Rules (ds4_server.c:parse_generated_message_ex unless marked):
 *  - Thinking mode with a </think>: only the text after the LAST </think> is
 *    searched for a DSML block.
 *  - Non-thinking mode: the whole text is searched.
 *  - The block starts at the first "\n\n<｜DSML｜tool_calls>", else the first
 *    "<｜DSML｜tool_calls>"; then the same two forms with the first bar missing
 *    ("<DSML｜tool_calls>", with "<DSML｜invoke" etc.); then plain
 *    "<tool_calls>"/"<invoke"/"<parameter". Text after the closing tag is
 *    ignored.
 *  - The text before the block (trailing whitespace removed), or the whole
 *    text when there is no block, is split at its FIRST </think>: reasoning =
 *    the part before it (one leading "<think>" stripped), content = the rest.
 *    Without </think> there is no reasoning and all of it is content.
 *  - Thinking mode WITHOUT any </think> (ds4 issue #318; ds4 at 8d57664
 *    returns such text as content and never parses calls in it):
 *      * if the first DSML block of the text parses, is closed, and nothing
 *        but whitespace follows its closing tag, the model left reasoning
 *        without writing </think>: its calls are returned, reasoning = the
 *        text before the block (trailing whitespace removed, a leading
 *        "<think>" stripped), content = "", recovered = 1;
 *      * otherwise (no block, a block followed by more text - DSML quoted or
 *        drafted in the reasoning -, a malformed or unterminated block) the
 *        whole text is reasoning (leading "<think>" stripped) and content is
 *        "": the model never left its reasoning block. thinking_unclosed = 1
 *        in both cases; a server that prefers ds4's old behaviour can move
 *        the reasoning to content.
 *  - Parameters: a missing string attribute means "true"; string values are
 *    entity-unescaped (&amp; &lt; &gt; &quot; &apos;; any other '&' kept);
 *    string="false" values must be one JSON value (whitespace outside strings
 *    is removed, an empty value is null); a parameter without a string
 *    attribute whose body starts with parameter tags is an object of those
 *    leaf parameters. Arguments are compact JSON: {"k":v,...} in document
 *    order, duplicates kept; strings escape " \ and control bytes, non-ASCII
 *    is kept raw.
 *
 * Errors: a block that is malformed returns DS4_ERR_FORMAT with a message
 * naming the call, the parameter and what is wrong (ds4 instead returns the
 * text as plain content, or "{}" arguments for invalid JSON). Beyond ds4, a
 * string attribute other than "true"/"false" and a string="false" value that
 * is not valid JSON are errors. On DS4_ERR_FORMAT *out is still filled as if
 * there were no block (reasoning/content split of the whole text, no calls),
 * so a server can return the text as an ordinary message. An unterminated
 * block (the text ends inside it) is DS4_ERR_FORMAT too.
 */
ds4_status ds4_chat_parse_reply(const char *text, size_t len, int in_thinking,
                                ds4_chat_reply *out, ds4_error *err);

/* ------------------------------------------------------------ streaming */

typedef enum ds4_chat_event_kind {
    DS4_CHAT_EVENT_REASONING = 0, /* text: reasoning delta */
    DS4_CHAT_EVENT_CONTENT,       /* text: content delta */
    DS4_CHAT_EVENT_TOOL_START,    /* call_index, name: a call's header is complete */
    DS4_CHAT_EVENT_TOOL_ARGS,     /* call_index, text: next fragment of its arguments JSON */
    DS4_CHAT_EVENT_TOOL_END,      /* call_index: its arguments are complete */
    DS4_CHAT_EVENT_ERROR,         /* text: why the block is malformed; no more call events */
} ds4_chat_event_kind;

typedef struct ds4_chat_event {
    ds4_chat_event_kind kind;
    size_t call_index;
    const char *name; /* TOOL_START */
    const char *text; /* REASONING, CONTENT, TOOL_ARGS, ERROR; valid during the callback */
    size_t len;
} ds4_chat_event;

typedef void (*ds4_chat_event_fn)(void *user, const ds4_chat_event *event);

/*
 * Incremental parser: feed the generated text in chunks of any size, get
 * events. The concatenated REASONING deltas, CONTENT deltas and, per call,
 * TOOL_ARGS fragments equal what ds4_chat_parse_reply returns for the whole
 * text in the normal cases; ds4_chat_stream_finish returns that authoritative
 * parse. Deltas never end inside a UTF-8 sequence, a possible marker prefix
 * or whitespace that may precede a DSML block (those bytes are held back
 * until decided). A DSML block inside unclosed reasoning (the #318 recovery)
 * reports its calls only at finish, when it is known to be the last thing
 * generated; ds4_chat_stream_block_closed tells the caller that a block is
 * closed so it can stop generating there (as ds4 does when tools are active).
 * Text after a closed block is ignored.
 */
typedef struct ds4_chat_stream ds4_chat_stream;

ds4_status ds4_chat_stream_new(int in_thinking, ds4_chat_stream **out, ds4_error *err);
void ds4_chat_stream_free(ds4_chat_stream *stream);
ds4_status ds4_chat_stream_feed(ds4_chat_stream *stream, const char *text, size_t len,
                                ds4_chat_event_fn fn, void *user, ds4_error *err);
/* 1 when a DSML block has been closed (content or unclosed reasoning). */
int ds4_chat_stream_block_closed(const ds4_chat_stream *stream);
/* 1 while the parser is inside a DSML block (started, not closed or failed). */
int ds4_chat_stream_in_block(const ds4_chat_stream *stream);
/* Flush held-back text and deliver the remaining events, then parse the whole
 * text with ds4_chat_parse_reply into *out (same return contract). */
ds4_status ds4_chat_stream_finish(ds4_chat_stream *stream, ds4_chat_event_fn fn, void *user,
                                  ds4_chat_reply *out, ds4_error *err);

#ifdef __cplusplus
}
#endif

#endif /* DS4_TEXT_CHAT_H */

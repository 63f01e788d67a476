/*
 * chat.c - `ds4server chat`: an interactive multi-turn chat.
 *
 * Every turn renders the whole conversation in the DS4 chat format and hands
 * the tokens to the session, which reuses the prefix it already holds, so
 * only the new turn is prefilled. Line editing and history come from libedit
 * when stdin is a terminal; piped input is read line by line. Ctrl-C stops
 * the current generation and returns to the prompt.
 *
 * Commands: /help /think /nothink /thinkmax /ctx /clear /save FILE /load FILE /quit
 * (/save writes the session checkpoint FILE and the conversation FILE.json.)
 */
#include <cjson/cJSON.h>
#include <editline/readline.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/cli.h"
#include "tools/tools.h"

typedef struct turn {
    ds4_chat_role role;
    char *content, *reasoning;
} turn;

typedef struct conversation {
    turn *v;
    size_t n, cap;
} conversation;

static void conv_clear(conversation *c) {
    for (size_t i = 0; i < c->n; i++) {
        free(c->v[i].content);
        free(c->v[i].reasoning);
    }
    c->n = 0;
}

static bool conv_add(conversation *c, ds4_chat_role role, const char *content, const char *reasoning) {
    if (c->n == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 16;
        turn *v = realloc(c->v, cap * sizeof *v);
        if (!v) return false;
        c->v = v;
        c->cap = cap;
    }
    turn *t = &c->v[c->n];
    t->role = role;
    t->content = strdup(content ? content : "");
    t->reasoning = reasoning ? strdup(reasoning) : NULL;
    if (!t->content || (reasoning && !t->reasoning)) {
        free(t->content);
        free(t->reasoning);
        return false;
    }
    c->n++;
    return true;
}

static const char *ROLE_NAMES[] = { "system", "user", "assistant", "tool", "other" };

static int conv_save(const conversation *c, const char *path) {
    cJSON *arr = cJSON_CreateArray();
    for (size_t i = 0; arr && i < c->n; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "role", ROLE_NAMES[c->v[i].role]);
        cJSON_AddStringToObject(o, "content", c->v[i].content);
        if (c->v[i].reasoning) cJSON_AddStringToObject(o, "reasoning", c->v[i].reasoning);
        cJSON_AddItemToArray(arr, o);
    }
    char *text = arr ? cJSON_Print(arr) : NULL;
    cJSON_Delete(arr);
    if (!text) return -1;
    size_t n = strlen(path) + 5;
    char *tmp = malloc(n);
    int rc = -1;
    if (tmp) {
        snprintf(tmp, n, "%s.tmp", path);
        FILE *fp = fopen(tmp, "wb");
        if (fp && fputs(text, fp) >= 0 && fclose(fp) == 0 && rename(tmp, path) == 0) rc = 0;
        else {
            if (fp) fclose(fp);
            unlink(tmp);
        }
    }
    free(tmp);
    free(text);
    return rc;
}

static int conv_load(conversation *c, const char *path) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return -1;
    char *buf = NULL;
    long n = -1;
    if (fseek(fp, 0, SEEK_END) == 0) n = ftell(fp);
    if (n >= 0 && n < (64L << 20) && fseek(fp, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1)) &&
        fread(buf, 1, (size_t)n, fp) == (size_t)n)
        buf[n] = '\0';
    else {
        free(buf);
        buf = NULL;
    }
    fclose(fp);
    cJSON *arr = buf ? cJSON_Parse(buf) : NULL;
    free(buf);
    if (!cJSON_IsArray(arr)) {
        cJSON_Delete(arr);
        return -1;
    }
    conv_clear(c);
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        const cJSON *reasoning = cJSON_GetObjectItemCaseSensitive(it, "reasoning");
        if (!cJSON_IsString(role) || !cJSON_IsString(content)) continue;
        conv_add(c, ds4_chat_role_from_name(role->valuestring), content->valuestring,
                 cJSON_IsString(reasoning) ? reasoning->valuestring : NULL);
    }
    cJSON_Delete(arr);
    return 0;
}

/* One line from the user, without its newline; NULL at end of input. */
static char *read_line(bool tty, const char *prompt) {
    if (tty) {
        char *line = readline(prompt);
        if (line && *line) add_history(line);
        return line;
    }
    size_t cap = 0;
    char *line = NULL;
    errno = 0;
    ssize_t n = getline(&line, &cap, stdin);
    if (n < 0) {
        free(line);
        return NULL;
    }
    if (n > 0 && line[n - 1] == '\n') line[n - 1] = '\0';
    return line;
}

static void help(void) {
    printf("commands: /help  /think  /nothink  /thinkmax  /ctx  /clear  /save FILE  /load FILE  /quit\n");
}

/* One assistant turn for the conversation so far. */
static int respond(cli_model *m, cli_opts *o, conversation *c) {
    ds4_chat_message *msgs = calloc(c->n ? c->n : 1, sizeof *msgs);
    if (!msgs) return tool_fail("chat", "out of memory");
    for (size_t i = 0; i < c->n; i++)
        msgs[i] = (ds4_chat_message){ c->v[i].role, c->v[i].content, c->v[i].reasoning, NULL, 0, NULL, NULL };
    ds4_chat_conversation conv = { msgs, c->n, NULL, 0, 0, o->think, (uint64_t)o->ctx };
    char *text = NULL;
    size_t len = 0;
    ds4_error err = { 0 };
    int rc = 0;
    if (ds4_chat_render(&conv, &text, &len, &err)) {
        free(msgs);
        return tool_fail("chat", "%s", err.message);
    }
    free(msgs);
    int32_t *ids = NULL;
    int64_t n = 0;
    if (ds4_tokenize(m->tok, text, len, o->pretok, true, &ids, &n, &err)) {
        free(text);
        return tool_fail("chat", "%s", err.message);
    }
    free(text);
    char *reply = NULL;
    cli_stats st;
    cli_interrupted = 0;
    rc = cli_generate("chat", m, o, ids, n, &reply, &st);
    free(ids);
    if (rc) return rc;
    putchar('\n');
    cli_print_stats(m, &st);
    int in_thinking = ds4_chat_think_for_context(o->think, (uint64_t)o->ctx) != DS4_CHAT_THINK_NONE;
    ds4_chat_reply parsed;
    memset(&parsed, 0, sizeof parsed);
    ds4_chat_parse_reply(reply ? reply : "", reply ? strlen(reply) : 0, in_thinking, &parsed, &err);
    if (!conv_add(c, DS4_CHAT_ROLE_ASSISTANT, parsed.content ? parsed.content : "", parsed.reasoning))
        rc = tool_fail("chat", "out of memory");
    ds4_chat_reply_free(&parsed);
    free(reply);
    cli_interrupted = 0;
    return rc;
}

int tool_chat(int argc, char **argv) {
    cli_opts o;
    int parsed = cli_parse_args("chat", "chat -m FILE [options]", &o, argc, argv);
    if (parsed) return parsed < 0 ? 1 : 0;
    cli_model m;
    if (cli_open("chat", &o, &m)) return 1;
    cli_install_sigint();
    bool tty = isatty(STDIN_FILENO);
    conversation c = { 0 };
    if (o.system) conv_add(&c, DS4_CHAT_ROLE_SYSTEM, o.system, NULL);
    if (tty) fprintf(stderr, "ds4server chat: %s. /help for commands, Ctrl-D to quit.\n", o.model);
    int rc = 0;
    for (;;) {
        cli_interrupted = 0;
        char *line = read_line(tty, "> ");
        if (!line) {
            if (cli_interrupted && !feof(stdin)) { /* Ctrl-C at the prompt: a fresh line */
                clearerr(stdin);
                putchar('\n');
                continue;
            }
            break;
        }
        ds4_error err = { 0 };
        if (!strcmp(line, "/quit") || !strcmp(line, "/exit")) {
            free(line);
            break;
        } else if (!strcmp(line, "/help")) {
            help();
        } else if (!strcmp(line, "/think")) {
            o.think = DS4_CHAT_THINK_HIGH;
            printf("thinking: high\n");
        } else if (!strcmp(line, "/nothink")) {
            o.think = DS4_CHAT_THINK_NONE;
            printf("thinking: none\n");
        } else if (!strcmp(line, "/thinkmax")) {
            o.think = DS4_CHAT_THINK_MAX;
            printf("thinking: %s\n", ds4_chat_think_name(ds4_chat_think_for_context(o.think, (uint64_t)o.ctx)));
        } else if (!strcmp(line, "/ctx")) {
            int64_t used;
            ds4_session_tokens(m.session, &used);
            printf("context: %lld of %lld tokens used\n", (long long)used, (long long)o.ctx);
        } else if (!strcmp(line, "/clear")) {
            conv_clear(&c);
            if (o.system) conv_add(&c, DS4_CHAT_ROLE_SYSTEM, o.system, NULL);
            printf("conversation cleared\n");
        } else if (!strncmp(line, "/save ", 6) && line[6]) {
            char json[4096];
            snprintf(json, sizeof json, "%s.json", line + 6);
            if (ds4_session_save(m.session, line + 6, &err)) printf("error: %s\n", err.message);
            else if (conv_save(&c, json)) printf("error: could not write %s\n", json);
            else printf("saved %s and %s\n", line + 6, json);
        } else if (!strncmp(line, "/load ", 6) && line[6]) {
            char json[4096];
            snprintf(json, sizeof json, "%s.json", line + 6);
            if (ds4_session_load(m.session, line + 6, &err)) printf("error: %s\n", err.message);
            else if (conv_load(&c, json)) printf("error: could not read the conversation %s\n", json);
            else {
                int64_t used;
                ds4_session_tokens(m.session, &used);
                printf("loaded %s: %zu messages, %lld tokens\n", line + 6, c.n, (long long)used);
            }
        } else if (line[0] == '/') {
            printf("unknown command %s (/help lists them)\n", line);
        } else if (line[0]) {
            if (!conv_add(&c, DS4_CHAT_ROLE_USER, line, NULL)) {
                free(line);
                rc = tool_fail("chat", "out of memory");
                break;
            }
            if (respond(&m, &o, &c)) {
                /* keep going: the turn failed (e.g. the context is full); drop it */
                free(c.v[c.n - 1].content);
                free(c.v[c.n - 1].reasoning);
                c.n--;
            }
        }
        fflush(stdout);
        free(line);
    }
    conv_clear(&c);
    free(c.v);
    cli_close(&m);
    return rc;
}

/*
 * main.c - the ds4server binary: one program, many subcommands.
 */
#include <stdio.h>
#include <string.h>

#include "tools/tools.h"

int tool_serve(int argc, char **argv);

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} command;

static const command COMMANDS[] = {
    { "inspect", tool_inspect, "print a GGUF file's metadata and tensor table (--json for machines)" },
    { "dump", tool_dump, "write one tensor dequantised to float32 little-endian" },
    { "synth", tool_synth, "write a model file with the real layout and seeded random weights" },
    { "logits", tool_logits, "write float32 logits for every position of a token sequence" },
    { "convert", tool_convert, "convert a Hugging Face DeepseekV4 checkpoint (safetensors) to GGUF" },
    { "tokenize", tool_tokenize, "text to token ids and back (--decode); both pre-tokenizers" },
    { "run", tool_run, "answer one prompt, streaming the reply (with load, prefill and decode speed)" },
    { "chat", tool_chat, "interactive multi-turn chat (/help inside for commands)" },
    { "serve", tool_serve, "OpenAI- and Anthropic-compatible HTTP server with a chat page at /" },
    { "parity", tool_parity, "compare two backends op by op, layer by layer and end to end" },
    { "bench", tool_bench, "measure load, prefill, time to first token, decode and the roofline (A/B mode)" },
    { NULL, NULL, NULL },
};

static void usage(FILE *out) {
    fprintf(out, "usage: ds4server <command> [options]\n\ncommands:\n");
    for (const command *c = COMMANDS; c->name; c++) fprintf(out, "  %-10s %s\n", c->name, c->summary);
    fprintf(out, "  %-10s %s\n  %-10s %s\n\n'ds4server <command> --help' for a command's options.\n", "version",
            "print the version and the backends built in", "help", "this text");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) {
        printf("ds4server %s\nbackends: cpu%s\n", ds4_version(), ds4_backend_compiled("cuda") ? " cuda" : "");
        return 0;
    }
    for (const command *c = COMMANDS; c->name; c++)
        if (!strcmp(cmd, c->name)) return c->run(argc - 1, argv + 1);
    fprintf(stderr, "ds4server: unknown command '%s' (try 'ds4server help')\n", cmd);
    return 2;
}

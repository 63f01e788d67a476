/*
 * cli.h - what `ds4server run` and `ds4server chat` share: options, opening
 * the model, prefill with a progress bar, the generation loop with sampling,
 * streaming detokenisation, Ctrl-C and the timing figures.
 */
#ifndef DS4_TOOLS_CLI_H
#define DS4_TOOLS_CLI_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "ds4.h"
#include "session/sampling.h"
#include "text/chat.h"
#include "text/tokenizer.h"

typedef struct cli_opts {
    const char *model, *backend, *prompt, *system;
    int64_t ctx, n_predict;
    int threads;
    ds4_numerics_mode numerics;
    ds4_pretok pretok;
    ds4_chat_think think;
    ds4_sampler_params sampling;
} cli_opts;

/* Parse the options common to run and chat; argv[i] is consumed (with its
 * value) when recognised. Returns 1 when argv[i] was an option it knows,
 * 0 when not, -1 on a bad value (message printed). */
void cli_opts_defaults(cli_opts *o);
int cli_parse_common(const char *cmd, cli_opts *o, int argc, char **argv, int *i);
const char *cli_common_usage(void);

/* Defaults, then every argument of argv[1..] through cli_parse_common; --help
 * prints "usage: ds4server <synopsis>" and the options. Returns 0 to go on,
 * 1 when --help was printed, -1 after printing an error. */
int cli_parse_args(const char *cmd, const char *synopsis, cli_opts *o, int argc, char **argv);

typedef struct cli_model {
    ds4_engine *engine;
    ds4_session *session;
    ds4_tokenizer *tok;
    ds4_sample_scratch scratch;
    ds4_rng rng;
    double load_seconds;
} cli_model;

int cli_open(const char *cmd, const cli_opts *o, cli_model *m);
void cli_close(cli_model *m);

/* Set by SIGINT; generation stops at the next token when it is set. */
extern volatile sig_atomic_t cli_interrupted;
void cli_install_sigint(void);

typedef struct cli_stats {
    int64_t prompt_tokens, prefilled, generated;
    double prefill_seconds, decode_seconds;
    bool interrupted, hit_eos, hit_context;
} cli_stats;

/* Tokenize segments (special markers as their ids, text pieces with the
 * plain tokenizer) into a malloc'd id array. */
int cli_tokenize_segments(const char *cmd, const cli_model *m, const ds4_chat_segments *segs, ds4_pretok pretok,
                          int32_t **ids, int64_t *n);

/* Prefill `prompt` (prefix reuse through the session) and generate up to
 * n_predict tokens (capped at the context), streaming text to stdout. The
 * generated text is returned in *reply (malloc'd, may be NULL). Returns 0, or
 * 1 after printing an error. */
int cli_generate(const char *cmd, cli_model *m, const cli_opts *o, const int32_t *prompt, int64_t n_prompt,
                 char **reply, cli_stats *st);

void cli_print_stats(const cli_model *m, const cli_stats *st);

#endif

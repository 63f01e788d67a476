/*
 * run.c - `ds4server run`: one prompt, one streamed answer.
 *
 *   ds4server run -m FILE -p TEXT [-n N] [--think|--nothink|--think-max] [--system TEXT]
 *                 [--temp T --top-p P --top-k K --min-p M --seed S] [--backend cpu|cuda] [--ctx N]
 *
 * The prompt is built the way DS4's CLI builds a one-shot prompt (spec 5.4,
 * encode_chat_prompt): BOS, [Think Max prefix], [system], User, prompt,
 * Assistant, <think> or </think>, each text part tokenized on its own. The
 * answer streams to stdout; load time, prefill and decode speed go to stderr.
 * Ctrl-C stops the generation (exit status 130).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/cli.h"
#include "tools/tools.h"

int tool_run(int argc, char **argv) {
    cli_opts o;
    int parsed = cli_parse_args("run", "run -m FILE -p TEXT [options]", &o, argc, argv);
    if (parsed) return parsed < 0 ? 1 : 0;
    if (!o.prompt) return tool_fail("run", "no prompt given (-p TEXT)");
    cli_model m;
    if (cli_open("run", &o, &m)) return 1;
    ds4_chat_segments segs = { 0 };
    ds4_error err = { 0 };
    int32_t *ids = NULL;
    int64_t n = 0;
    int rc = 0;
    if (ds4_chat_encode_prompt(&segs, o.system ? o.system : "", o.prompt, o.think, (uint64_t)o.ctx, &err)) {
        rc = tool_fail("run", "%s", err.message);
    } else if (!(rc = cli_tokenize_segments("run", &m, &segs, o.pretok, &ids, &n))) {
        cli_install_sigint();
        cli_stats st;
        rc = cli_generate("run", &m, &o, ids, n, NULL, &st);
        if (!rc) {
            putchar('\n');
            cli_print_stats(&m, &st);
            if (st.interrupted) rc = 130;
        }
    }
    free(ids);
    ds4_chat_segments_free(&segs);
    cli_close(&m);
    return rc;
}

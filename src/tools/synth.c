/*
 * synth.c - `ds4server synth`: argument parsing for ds4_synth_write
 * (src/models/deepseek4/ds4_synth.c), which writes the file.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "models/deepseek4/ds4_synth.h"
#include "tools/tools.h"

static int usage(void) {
    fprintf(stderr, "usage: ds4server synth --arch deepseek4 --scale tiny|small|full --quant f32|q8_0|q2|q4 "
                    "--seed N --out FILE [--tokenizer tokenizer.json] [--zero] [--layers N]\n"
                    "  --layers N  only the first N layers of the scale's layout (the real shapes in a smaller file)\n");
    return 1;
}

int tool_synth(int argc, char **argv) {
    const char *arch = "deepseek4", *scale_s = "tiny", *quant_s = "q2", *out = NULL, *tokenizer = NULL;
    uint64_t seed = 1;
    bool zero = false;
    long layers = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return usage() - 1;
        if (!strcmp(a, "--zero")) { zero = true; continue; }
        if (!v) return tool_fail("synth", "%s needs a value", a);
        if (!strcmp(a, "--arch")) arch = v;
        else if (!strcmp(a, "--scale")) scale_s = v;
        else if (!strcmp(a, "--quant")) quant_s = v;
        else if (!strcmp(a, "--out") || !strcmp(a, "-o")) out = v;
        else if (!strcmp(a, "--tokenizer")) tokenizer = v;
        else if (!strcmp(a, "--layers")) {
            char *end;
            errno = 0;
            layers = strtol(v, &end, 10);
            if (errno || *end || !*v || layers < 1 || layers > 1000)
                return tool_fail("synth", "--layers '%s' is not a positive layer count", v);
        }
        else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            seed = strtoull(v, &end, 0);
            if (errno || *end || !*v) return tool_fail("synth", "--seed '%s' is not a number", v);
        } else return tool_fail("synth", "unknown option '%s'", a);
        i++;
    }
    if (!out) return tool_fail("synth", "--out FILE is required");
    if (strcmp(arch, "deepseek4")) return tool_fail("synth", "unknown --arch '%s' (supported: deepseek4)", arch);
    ds4_scale scale;
    if (!strcmp(scale_s, "tiny")) scale = DS4_SCALE_TINY;
    else if (!strcmp(scale_s, "small")) scale = DS4_SCALE_SMALL;
    else if (!strcmp(scale_s, "full")) scale = DS4_SCALE_FULL;
    else return tool_fail("synth", "unknown --scale '%s' (tiny, small or full)", scale_s);
    int quant = ds4_quant_scheme_parse(quant_s);
    if (quant < 0) return tool_fail("synth", "unknown --quant '%s' (f32, q8_0, q2 or q4)", quant_s);


    ds4_error err = { 0 };
    if (ds4_synth_write_layers(out, scale, (ds4_quant_scheme)quant, seed, tokenizer, zero, (int)layers, &err))
        return tool_fail("synth", "%s", err.message);
    return 0;
}

/*
 * round_tool - test tool for DS4's scalar rounding primitives.
 *
 *   round_tool MODE IN OUT    read little-endian float32 values from IN, write
 *                             each one rounded to OUT (float32), where MODE is
 *                               fp8   ds4_round_fp8_e4m3
 *                               fp4   ds4_round_fp4_e2m1
 *                               f16   ds4_round_f16
 * tests/python/test_rounding_oracle.py compares the results with ml_dtypes'
 * float8_e4m3fn / float4_e2m1fn casts and numpy's float16.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/rounding.h"

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: round_tool fp8|fp4|f16 IN OUT\n");
        return 2;
    }
    float (*fn)(float) = strcmp(argv[1], "fp8") == 0   ? ds4_round_fp8_e4m3
                         : strcmp(argv[1], "fp4") == 0 ? ds4_round_fp4_e2m1
                         : strcmp(argv[1], "f16") == 0 ? ds4_round_f16
                                                       : NULL;
    if (!fn) {
        fprintf(stderr, "round_tool: unknown mode %s (fp8, fp4 or f16)\n", argv[1]);
        return 2;
    }
    FILE *in = fopen(argv[2], "rb");
    FILE *out = fopen(argv[3], "wb");
    if (!in || !out) {
        fprintf(stderr, "round_tool: cannot open %s\n", !in ? argv[2] : argv[3]);
        return 1;
    }
    float buf[4096];
    size_t n;
    while ((n = fread(buf, sizeof buf[0], sizeof buf / sizeof buf[0], in)) > 0) {
        for (size_t i = 0; i < n; i++) buf[i] = fn(buf[i]);
        if (fwrite(buf, sizeof buf[0], n, out) != n) {
            fprintf(stderr, "round_tool: cannot write %s\n", argv[3]);
            return 1;
        }
    }
    int bad = ferror(in) || fclose(out) != 0;
    fclose(in);
    if (bad) {
        fprintf(stderr, "round_tool: i/o error\n");
        return 1;
    }
    return 0;
}

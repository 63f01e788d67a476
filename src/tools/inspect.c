/*
 * inspect.c - `ds4server inspect FILE [--json]`: metadata and tensor table.
 *
 * Text output is for people (arrays summarised to their first elements, a
 * tensor table, totals per type); --json writes the same facts, arrays in
 * full, as one JSON object for programs.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/gguf.h"
#include "core/quant.h"
#include "tools/tools.h"

#define ARRAY_HEAD 8 /* array elements shown */

static void print_number(FILE *out, const gguf_value *v, bool json) {
    double d;
    int64_t i;
    if (v->type == GGUF_TYPE_BOOL) {
        fputs(v->data[0] ? "true" : "false", out);
    } else if (v->type == GGUF_TYPE_FLOAT32 || v->type == GGUF_TYPE_FLOAT64) {
        gguf_value_as_double(v, &d);
        if (!isfinite(d)) fprintf(out, json ? "\"%g\"" : "%g", d);
        else fprintf(out, v->type == GGUF_TYPE_FLOAT32 ? "%.9g" : "%.17g", d);
    } else if (v->type == GGUF_TYPE_UINT64) {
        uint64_t u;
        memcpy(&u, v->data, 8);
        fprintf(out, "%" PRIu64, u);
    } else if (gguf_value_as_i64(v, &i)) {
        fprintf(out, "%" PRId64, i);
    }
}

/* Text: arrays summarised to their first ARRAY_HEAD elements. JSON: in full. */
static void print_value(FILE *out, const gguf_value *v, bool json) {
    if (v->type == GGUF_TYPE_STRING) {
        fputc('"', out);
        if (json) tool_json_escape(out, v->str.ptr, v->str.len);
        else tool_text_escape(out, v->str.ptr, v->str.len, 120);
        fputc('"', out);
    } else if (v->type == GGUF_TYPE_ARRAY) {
        gguf_array_iter it;
        gguf_value e;
        uint64_t shown = 0;
        fputc('[', out);
        gguf_array_iter_init(&it, v);
        while ((json || shown < ARRAY_HEAD) && gguf_array_iter_next(&it, &e)) {
            if (shown++) fputs(", ", out);
            print_value(out, &e, json);
        }
        fprintf(out, "%s]", v->count > shown ? ", ..." : "");
    } else {
        print_number(out, v, json);
    }
}

static void shape_string(const gguf_tensor *t, char *buf, size_t cap) {
    size_t o = 0;
    for (uint32_t d = 0; d < t->n_dims && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%" PRIu64, d ? ", " : "[", t->ne[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

typedef struct type_total {
    uint64_t count, bytes, elements;
} type_total;

static void inspect_text(FILE *out, const gguf_file *f) {
    printf("file: %s\n", f->path);
    printf("gguf version %u, %" PRIu64 " bytes, alignment %u, data section at byte %" PRIu64 "\n", f->version,
           f->size, f->alignment, f->data_offset);
    printf("\nmetadata (%" PRIu64 " keys):\n", f->n_kv);
    for (uint64_t i = 0; i < f->n_kv; i++) {
        const gguf_kv *kv = &f->kv[i];
        char type[48];
        if (kv->value.type == GGUF_TYPE_ARRAY)
            snprintf(type, sizeof type, "%s[%" PRIu64 "]", gguf_value_type_name(kv->value.elem_type), kv->value.count);
        else
            snprintf(type, sizeof type, "%s", gguf_value_type_name(kv->value.type));
        fputs("  ", out);
        tool_text_escape(out, kv->key.ptr, kv->key.len, 200);
        fprintf(out, "%*s %-14s ", kv->key.len < 48 ? (int)(48 - kv->key.len) : 0, "", type);
        print_value(out, &kv->value, false);
        fputc('\n', out);
    }
    printf("\ntensors (%" PRIu64 "):\n", f->n_tensors);
    printf("  %-44s %-8s %-24s %16s %16s\n", "name", "type", "shape", "bytes", "offset");
    type_total totals[DS4_TYPE_COUNT] = { { 0, 0, 0 } };
    uint64_t all_bytes = 0, all_elems = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        char shape[128];
        shape_string(t, shape, sizeof shape);
        fputs("  ", out);
        tool_text_escape(out, t->name.ptr, t->name.len, 120);
        fprintf(out, "%*s %-8s %-24s %16" PRIu64 " %16" PRIu64 "\n", t->name.len < 44 ? (int)(44 - t->name.len) : 0,
                "", ds4_type_name(t->type), shape, t->n_bytes, t->file_offset);
        totals[t->type].count++;
        totals[t->type].bytes += t->n_bytes;
        totals[t->type].elements += t->n_elements;
        all_bytes += t->n_bytes;
        all_elems += t->n_elements;
    }
    printf("\ntotals by type:\n");
    for (int ty = 0; ty < DS4_TYPE_COUNT; ty++) {
        if (!totals[ty].count) continue;
        printf("  %-8s %6" PRIu64 " tensors %16" PRIu64 " bytes %16" PRIu64 " elements  %.3f GiB\n",
               ds4_type_name((uint32_t)ty), totals[ty].count, totals[ty].bytes, totals[ty].elements,
               (double)totals[ty].bytes / 1073741824.0);
    }
    printf("  %-8s %6" PRIu64 " tensors %16" PRIu64 " bytes %16" PRIu64 " elements  %.3f GiB\n", "all", f->n_tensors,
           all_bytes, all_elems, (double)all_bytes / 1073741824.0);
}

static void inspect_json(FILE *out, const gguf_file *f) {
    fputs("{\"path\": \"", out);
    tool_json_escape(out, f->path, strlen(f->path));
    fprintf(out, "\", \"version\": %u, \"file_size\": %" PRIu64 ", \"alignment\": %u, \"data_offset\": %" PRIu64 ",\n",
            f->version, f->size, f->alignment, f->data_offset);
    fputs(" \"metadata\": {", out);
    for (uint64_t i = 0; i < f->n_kv; i++) {
        const gguf_kv *kv = &f->kv[i];
        fputs(i ? ",\n  \"" : "\n  \"", out);
        tool_json_escape(out, kv->key.ptr, kv->key.len);
        fprintf(out, "\": {\"type\": \"%s\", ", gguf_value_type_name(kv->value.type));
        if (kv->value.type == GGUF_TYPE_ARRAY)
            fprintf(out, "\"elem_type\": \"%s\", \"count\": %" PRIu64 ", ", gguf_value_type_name(kv->value.elem_type),
                    kv->value.count);
        fputs("\"value\": ", out);
        print_value(out, &kv->value, true);
        fputc('}', out);
    }
    fputs("},\n \"tensors\": [", out);
    type_total totals[DS4_TYPE_COUNT] = { { 0, 0, 0 } };
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        fputs(i ? ",\n  {\"name\": \"" : "\n  {\"name\": \"", out);
        tool_json_escape(out, t->name.ptr, t->name.len);
        fprintf(out, "\", \"type\": \"%s\", \"type_id\": %u, \"shape\": [", ds4_type_name(t->type), t->type);
        for (uint32_t d = 0; d < t->n_dims; d++) fprintf(out, "%s%" PRIu64, d ? ", " : "", t->ne[d]);
        fprintf(out, "], \"elements\": %" PRIu64 ", \"bytes\": %" PRIu64 ", \"offset\": %" PRIu64 "}", t->n_elements,
                t->n_bytes, t->file_offset);
        totals[t->type].count++;
        totals[t->type].bytes += t->n_bytes;
        totals[t->type].elements += t->n_elements;
    }
    fputs("],\n \"totals\": {", out);
    int first = 1;
    for (int ty = 0; ty < DS4_TYPE_COUNT; ty++) {
        if (!totals[ty].count) continue;
        fprintf(out, "%s\"%s\": {\"tensors\": %" PRIu64 ", \"bytes\": %" PRIu64 ", \"elements\": %" PRIu64 "}",
                first ? "" : ", ", ds4_type_name((uint32_t)ty), totals[ty].count, totals[ty].bytes, totals[ty].elements);
        first = 0;
    }
    fputs("}}\n", out);
}

int tool_inspect(int argc, char **argv) {
    const char *path = NULL;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: ds4server inspect FILE [--json]\n");
            return 0;
        } else if (argv[i][0] == '-' && argv[i][1]) return tool_fail("inspect", "unknown option '%s'", argv[i]);
        else if (path) return tool_fail("inspect", "more than one file given");
        else path = argv[i];
    }
    if (!path) return tool_fail("inspect", "no file given (usage: ds4server inspect FILE [--json])");
    gguf_file *f;
    ds4_error err = { 0 };
    if (gguf_open(path, &f, &err)) return tool_fail("inspect", "%s", err.message);
    if (json) inspect_json(stdout, f);
    else inspect_text(stdout, f);
    gguf_close(f);
    if (fflush(stdout) != 0 || ferror(stdout)) return tool_fail("inspect", "writing to stdout failed");
    return 0;
}

/*
 * gguf_copy - test tool for the GGUF writer.
 *
 *   gguf_copy IN OUT [EDIT...]
 *                          re-encode IN through our reader and writer
 *                          (metadata verbatim, tensors streamed in 1000-byte pieces),
 *                          optionally damaged by edits, for model-loading tests:
 *                            --drop NAME            leave out tensor or key NAME
 *                            --shape NAME D0[,D1..] declare tensor NAME with another shape
 *                            --type NAME TYPEID     declare tensor NAME with another type
 *                            --u32 KEY VALUE        set (or add) a u32 metadata key
 *                          (tensor bytes are copied, zero-padded or truncated to fit)
 *   gguf_copy --sample OUT write a fixed sample that uses every writer call;
 *                          tests/python/test_gguf_oracle.py checks it with gguf-py
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/gguf.h"
#include "core/quant.h"

typedef struct edits {
    const char *drop, *shape_name, *type_name, *u32_key;
    uint64_t shape[4];
    uint32_t shape_dims, type, u32_value;
} edits;

static int copy(const char *in, const char *out, const edits *ed) {
    gguf_file *f;
    gguf_writer *w;
    ds4_error err = { 0 };
    bool u32_done = false;
    if (gguf_open(in, &f, &err)) { fprintf(stderr, "gguf_copy: %s\n", err.message); return 1; }
    if (gguf_writer_open(out, f->alignment, &w, &err)) { fprintf(stderr, "gguf_copy: %s\n", err.message); gguf_close(f); return 1; }
    for (uint64_t i = 0; i < f->n_kv; i++) {
        char key[65536];
        const gguf_kv *kv = &f->kv[i];
        memcpy(key, kv->key.ptr, kv->key.len);
        key[kv->key.len] = '\0';
        if (ed->drop && !strcmp(key, ed->drop)) continue;
        if (ed->u32_key && !strcmp(key, ed->u32_key)) {
            gguf_writer_add_u32(w, key, ed->u32_value);
            u32_done = true;
            continue;
        }
        gguf_writer_add_value(w, key, &kv->value);
    }
    if (ed->u32_key && !u32_done) gguf_writer_add_u32(w, ed->u32_key, ed->u32_value);
    uint64_t *sizes = calloc(f->n_tensors + 1, sizeof *sizes);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        char name[65536];
        const gguf_tensor *t = &f->tensors[i];
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = '\0';
        uint32_t type = t->type, n_dims = t->n_dims;
        const uint64_t *ne = t->ne;
        if (ed->drop && !strcmp(name, ed->drop)) { sizes[i] = UINT64_MAX; continue; }
        if (ed->shape_name && !strcmp(name, ed->shape_name)) { ne = ed->shape; n_dims = ed->shape_dims; }
        if (ed->type_name && !strcmp(name, ed->type_name)) type = ed->type;
        uint64_t n = 1;
        for (uint32_t d = 0; d < n_dims; d++) n *= ne[d];
        const ds4_type_traits *tr = ds4_type_traits_get(type);
        sizes[i] = tr ? n / (uint64_t)tr->block_elems * (uint64_t)tr->block_bytes : 0;
        gguf_writer_add_tensor(w, name, type, n_dims, ne);
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (sizes[i] == UINT64_MAX) continue;
        uint64_t have = t->n_bytes < sizes[i] ? t->n_bytes : sizes[i];
        for (uint64_t o = 0; o < have; o += 1000)
            gguf_writer_write(w, t->data + o, have - o < 1000 ? have - o : 1000);
        gguf_writer_write_zeros(w, sizes[i] - have);
    }
    free(sizes);
    gguf_close(f);
    if (gguf_writer_finish(w, &err)) { fprintf(stderr, "gguf_copy: %s\n", err.message); return 1; }
    return 0;
}

static int sample(const char *out) {
    gguf_writer *w;
    ds4_error err = { 0 };
    if (gguf_writer_open(out, 64, &w, &err)) { fprintf(stderr, "gguf_copy: %s\n", err.message); return 1; }
    gguf_writer_add_str(w, "general.architecture", "sample");
    gguf_writer_add_u8(w, "s.u8", 200);
    gguf_writer_add_i8(w, "s.i8", -100);
    gguf_writer_add_u16(w, "s.u16", 60000);
    gguf_writer_add_i16(w, "s.i16", -30000);
    gguf_writer_add_u32(w, "s.u32", 4000000000u);
    gguf_writer_add_i32(w, "s.i32", -2000000000);
    gguf_writer_add_u64(w, "s.u64", 18000000000000000000ull);
    gguf_writer_add_i64(w, "s.i64", -9000000000000000000ll);
    gguf_writer_add_f32(w, "s.f32", 0.1f);
    gguf_writer_add_f64(w, "s.f64", 0.1);
    gguf_writer_add_bool(w, "s.bool", true);
    gguf_writer_add_str(w, "s.str", "h\xc3\xa9llo \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x98\x80");
    const int32_t ints[5] = { 1, -2, 3, -4, 5 };
    gguf_writer_add_array(w, "s.arr_i32", GGUF_TYPE_INT32, ints, 5);
    const float floats[3] = { 1.5f, -2.25f, 1e-20f };
    gguf_writer_add_array(w, "s.arr_f32", GGUF_TYPE_FLOAT32, floats, 3);
    const char *const strs[3] = { "a", "", "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>" };
    gguf_writer_add_str_array(w, "s.arr_str", strs, 3);
    gguf_writer_add_array(w, "s.arr_empty", GGUF_TYPE_UINT8, NULL, 0);
    /* Tensors: an f32 matrix, an f16 vector, a Q8_0 row and an I32 table. */
    const uint64_t ne_m[2] = { 3, 2 }, ne_v[1] = { 5 }, ne_q[1] = { 64 }, ne_i[2] = { 2, 3 };
    gguf_writer_add_tensor(w, "m.f32", DS4_TYPE_F32, 2, ne_m);
    gguf_writer_add_tensor(w, "v.f16", DS4_TYPE_F16, 1, ne_v);
    gguf_writer_add_tensor(w, "q.q8_0", DS4_TYPE_Q8_0, 1, ne_q);
    gguf_writer_add_tensor(w, "t.i32", DS4_TYPE_I32, 2, ne_i);
    const float m[6] = { 0, 1, 2, 3, 4, 5 };
    gguf_writer_write(w, m, sizeof m);
    uint16_t v[5];
    for (int i = 0; i < 5; i++) v[i] = ds4_f32_to_f16(0.5f * (float)i - 1.0f);
    gguf_writer_write(w, v, sizeof v);
    float qsrc[64];
    for (int i = 0; i < 64; i++) qsrc[i] = (float)(i - 32) / 8.0f;
    ds4_block_q8_0 q[2];
    ds4_type_traits_get(DS4_TYPE_Q8_0)->quantize_row(qsrc, q, 64);
    gguf_writer_write(w, q, sizeof q);
    const int32_t ti[6] = { 10, 11, 20, 21, 30, 31 };
    gguf_writer_write(w, ti, 3 * sizeof(int32_t)); /* in two pieces */
    gguf_writer_write(w, ti + 3, 3 * sizeof(int32_t));
    if (gguf_writer_finish(w, &err)) { fprintf(stderr, "gguf_copy: %s\n", err.message); return 1; }
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--sample")) return sample(argv[2]);
    edits ed = { 0 };
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--drop") && i + 1 < argc) ed.drop = argv[++i];
        else if (!strcmp(argv[i], "--type") && i + 2 < argc) { ed.type_name = argv[++i]; ed.type = (uint32_t)atoi(argv[++i]); }
        else if (!strcmp(argv[i], "--u32") && i + 2 < argc) { ed.u32_key = argv[++i]; ed.u32_value = (uint32_t)strtoul(argv[++i], NULL, 0); }
        else if (!strcmp(argv[i], "--shape") && i + 2 < argc) {
            ed.shape_name = argv[++i];
            char *p = argv[++i];
            while (*p && ed.shape_dims < 4) {
                ed.shape[ed.shape_dims++] = strtoull(p, &p, 10);
                if (*p == ',') p++;
            }
        } else { argc = 0; break; }
    }
    if (argc >= 3) return copy(argv[1], argv[2], &ed);
    fprintf(stderr, "usage: gguf_copy IN OUT [--drop NAME] [--shape NAME D0,D1] [--type NAME ID] [--u32 KEY V] | gguf_copy --sample OUT\n");
    return 2;
}

/* test_gguf.c - GGUF reader/writer: round trip, typed getters, and damage. */
#include <stdlib.h>
#include <unistd.h>

#include "core/error.h"
#include "core/gguf.h"
#include "core/quant.h"
#include "test.h"

static char tmp_path[256];

static const char *tmpfile_path(const char *tag) {
    snprintf(tmp_path, sizeof tmp_path, "/tmp/ds4_test_gguf_%d_%s.gguf", (int)getpid(), tag);
    return tmp_path;
}

/* A small file: a few metadata types, nested arrays and three tensors. */
static int write_small(const char *path, uint32_t alignment) {
    gguf_writer *w;
    ds4_error err = { 0 };
    if (gguf_writer_open(path, alignment, &w, &err)) return 1;
    gguf_writer_add_str(w, "general.architecture", "test");
    gguf_writer_add_u32(w, "t.u32", 7);
    gguf_writer_add_u64(w, "t.u64", 1ull << 40);
    gguf_writer_add_f32(w, "t.f32", 2.5f);
    gguf_writer_add_bool(w, "t.bool", true);
    const char *const toks[3] = { "x", "yy", "zzz" };
    gguf_writer_add_str_array(w, "t.tokens", toks, 3);
    const uint32_t u[4] = { 1, 2, 3, 4 };
    gguf_writer_add_array(w, "t.u32s", GGUF_TYPE_UINT32, u, 4);
    const uint64_t ne_a[2] = { 4, 3 }, ne_b[1] = { 32 }, ne_c[1] = { 256 };
    gguf_writer_add_tensor(w, "a", DS4_TYPE_F32, 2, ne_a);
    gguf_writer_add_tensor(w, "b", DS4_TYPE_Q8_0, 1, ne_b);
    gguf_writer_add_tensor(w, "c", DS4_TYPE_Q4_K, 1, ne_c);
    float a[12];
    for (int i = 0; i < 12; i++) a[i] = (float)i * 0.25f;
    gguf_writer_write(w, a, sizeof a);
    uint8_t b[34], c[144];
    for (int i = 0; i < 34; i++) b[i] = (uint8_t)(i * 7);
    b[0] = 0x00; b[1] = 0x3c; /* d = 1.0 */
    for (int i = 0; i < 144; i++) c[i] = (uint8_t)(i * 13 + 1);
    c[0] = 0x00; c[1] = 0x38; c[2] = 0x00; c[3] = 0x34; /* d = 0.5, dmin = 0.25 */
    gguf_writer_write(w, b, 17);
    gguf_writer_write(w, b + 17, 17);
    gguf_writer_write(w, c, sizeof c);
    return gguf_writer_finish(w, &err) != DS4_OK;
}

static uint8_t *read_all(const char *path, size_t *size) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)n);
    if (buf && fread(buf, 1, (size_t)n, fp) != (size_t)n) { free(buf); buf = NULL; }
    fclose(fp);
    *size = (size_t)n;
    return buf;
}

static void test_roundtrip(void) {
    const char *path = tmpfile_path("rt");
    CHECK(write_small(path, 32) == 0);
    gguf_file *f = NULL;
    ds4_error err = { 0 };
    CHECK_MSG(gguf_open(path, &f, &err) == DS4_OK, "%s", err.message);
    if (!f) return;
    CHECK_EQ_INT(f->version, 3);
    CHECK_EQ_INT(f->n_kv, 7);
    CHECK_EQ_INT(f->n_tensors, 3);
    CHECK_EQ_INT(f->data_offset % 32, 0);
    uint32_t u32 = 0;
    uint64_t u64 = 0;
    float f32 = 0;
    bool b = false;
    gguf_str s;
    CHECK(gguf_get_u32(f, "t.u32", &u32, &err) == DS4_OK && u32 == 7);
    CHECK(gguf_get_u64(f, "t.u64", &u64, &err) == DS4_OK && u64 == 1ull << 40);
    CHECK(gguf_get_u64(f, "t.u32", &u64, &err) == DS4_OK && u64 == 7); /* u32 widens */
    CHECK(gguf_get_f32(f, "t.f32", &f32, &err) == DS4_OK && f32 == 2.5f);
    CHECK(gguf_get_bool(f, "t.bool", &b, &err) == DS4_OK && b);
    CHECK(gguf_get_str(f, "general.architecture", &s, &err) == DS4_OK && gguf_str_eq(s, "test"));
    /* Wrong type and missing key name the key and the types. */
    CHECK(gguf_get_u32(f, "t.u64", &u32, &err) == DS4_ERR_FORMAT);
    CHECK(strstr(err.message, "t.u64") && strstr(err.message, "u32") && strstr(err.message, "u64"));
    CHECK(gguf_get_u32(f, "nope", &u32, &err) == DS4_ERR_NOT_FOUND);
    CHECK(strstr(err.message, "nope") != NULL);
    /* Arrays iterate in order. */
    const gguf_kv *kv = gguf_find_kv(f, "t.tokens");
    CHECK(kv && kv->value.type == GGUF_TYPE_ARRAY && kv->value.elem_type == GGUF_TYPE_STRING && kv->value.count == 3);
    if (kv) {
        gguf_array_iter it;
        gguf_value e;
        const char *want[3] = { "x", "yy", "zzz" };
        int n = 0;
        gguf_array_iter_init(&it, &kv->value);
        while (gguf_array_iter_next(&it, &e)) {
            CHECK(n < 3 && e.type == GGUF_TYPE_STRING && gguf_str_eq(e.str, want[n]));
            n++;
        }
        CHECK_EQ_INT(n, 3);
    }
    kv = gguf_find_kv(f, "t.u32s");
    if (kv) {
        gguf_array_iter it;
        gguf_value e;
        int64_t sum = 0, x;
        gguf_array_iter_init(&it, &kv->value);
        while (gguf_array_iter_next(&it, &e)) if (gguf_value_as_i64(&e, &x)) sum += x;
        CHECK_EQ_INT(sum, 10);
    }
    /* Tensors: shape, type, bytes, alignment and content. */
    const gguf_tensor *ta = gguf_find_tensor(f, "a"), *tb = gguf_find_tensor(f, "b"), *tc = gguf_find_tensor(f, "c");
    CHECK(ta && tb && tc && !gguf_find_tensor(f, "d"));
    if (ta && tb && tc) {
        CHECK(ta->n_dims == 2 && ta->ne[0] == 4 && ta->ne[1] == 3 && ta->n_bytes == 48);
        CHECK(tb->type == DS4_TYPE_Q8_0 && tb->n_bytes == 34);
        CHECK(tc->type == DS4_TYPE_Q4_K && tc->n_bytes == 144);
        CHECK(ta->file_offset % 32 == 0 && tb->file_offset % 32 == 0 && tc->file_offset % 32 == 0);
        float a5;
        memcpy(&a5, ta->data + 20, 4);
        CHECK(a5 == 1.25f);
        CHECK(tb->data[20] == (uint8_t)(20 * 7));
        CHECK(tc->data[100] == (uint8_t)(100 * 13 + 1));
    }
    gguf_close(f);
    unlink(path);
}

static void test_alignment_key(void) {
    const char *path = tmpfile_path("al");
    CHECK(write_small(path, 256) == 0);
    gguf_file *f = NULL;
    ds4_error err = { 0 };
    CHECK_MSG(gguf_open(path, &f, &err) == DS4_OK, "%s", err.message);
    if (f) {
        CHECK_EQ_INT(f->alignment, 256);
        CHECK_EQ_INT(f->data_offset % 256, 0);
        for (uint64_t i = 0; i < f->n_tensors; i++) CHECK(f->tensors[i].file_offset % 256 == 0);
        gguf_close(f);
    }
    unlink(path);
}

/* Every truncation that cuts into the header or a tensor fails cleanly. */
static void test_truncation(void) {
    const char *path = tmpfile_path("tr");
    CHECK(write_small(path, 32) == 0);
    size_t size;
    uint8_t *buf = read_all(path, &size);
    CHECK(buf != NULL);
    if (!buf) return;
    gguf_file *f = NULL;
    ds4_error err = { 0 };
    CHECK(gguf_open_memory(buf, size, &f, &err) == DS4_OK);
    uint64_t end = 0;
    for (uint64_t i = 0; f && i < f->n_tensors; i++)
        if (f->tensors[i].file_offset + f->tensors[i].n_bytes > end) end = f->tensors[i].file_offset + f->tensors[i].n_bytes;
    gguf_close(f);
    int failures = 0;
    for (size_t n = 0; n < end; n++) {
        uint8_t *copy = malloc(n ? n : 1); /* exact-size copy so ASan sees overreads */
        memcpy(copy, buf, n);
        f = NULL;
        err.message[0] = '\0';
        ds4_status st = gguf_open_memory(copy, n, &f, &err);
        if (st == DS4_OK || err.message[0] == '\0') failures++;
        gguf_close(f);
        free(copy);
    }
    CHECK_EQ_INT(failures, 0);
    free(buf);
    unlink(path);
}

/* Random byte damage: open either succeeds or fails with a message; and when
 * it succeeds, every tensor lies inside the image. */
static void test_mutation(void) {
    const char *path = tmpfile_path("mu");
    CHECK(write_small(path, 32) == 0);
    size_t size;
    uint8_t *buf = read_all(path, &size);
    if (!buf) { CHECK(0); return; }
    int bad = 0, rejected = 0;
    for (int iter = 0; iter < 20000; iter++) {
        uint8_t *copy = malloc(size);
        memcpy(copy, buf, size);
        int flips = 1 + (int)(test_rand_u64() % 4);
        for (int k = 0; k < flips; k++) {
            size_t at = (size_t)(test_rand_u64() % (size < 400 ? size : 400)); /* mostly header bytes */
            uint64_t r = test_rand_u64();
            copy[at] = (r & 0x100) ? (uint8_t)r : (uint8_t)(copy[at] ^ (1u << (r % 8)));
        }
        gguf_file *f = NULL;
        ds4_error err = { 0 };
        if (gguf_open_memory(copy, size, &f, &err) == DS4_OK) {
            for (uint64_t i = 0; i < f->n_tensors; i++) {
                const gguf_tensor *t = &f->tensors[i];
                if (t->n_bytes && (t->data < copy || t->data + t->n_bytes > copy + size)) bad++;
            }
            gguf_close(f);
        } else {
            rejected++;
            if (err.message[0] == '\0') bad++;
        }
        free(copy);
    }
    CHECK_EQ_INT(bad, 0);
    CHECK(rejected > 1000); /* the damage mostly lands in structure */
    free(buf);
    unlink(path);
}

static void test_writer_misuse(void) {
    gguf_writer *w;
    ds4_error err = { 0 };
    const char *path = tmpfile_path("wm");
    const uint64_t ne[1] = { 33 };
    /* Row not a multiple of the block. */
    CHECK(gguf_writer_open(path, 32, &w, &err) == DS4_OK);
    CHECK(gguf_writer_add_tensor(w, "x", DS4_TYPE_Q8_0, 1, ne) == DS4_ERR_INVALID);
    CHECK(gguf_writer_finish(w, &err) == DS4_ERR_INVALID);
    CHECK(strstr(err.message, "'x'") != NULL);
    CHECK(access(path, F_OK) != 0); /* nothing left under the final name */
    /* Duplicate key, duplicate tensor. */
    CHECK(gguf_writer_open(path, 32, &w, &err) == DS4_OK);
    gguf_writer_add_u32(w, "k", 1);
    CHECK(gguf_writer_add_u32(w, "k", 2) == DS4_ERR_INVALID);
    gguf_writer_abort(w);
    CHECK(gguf_writer_open(path, 32, &w, &err) == DS4_OK);
    const uint64_t ne2[1] = { 4 };
    gguf_writer_add_tensor(w, "t", DS4_TYPE_F32, 1, ne2);
    CHECK(gguf_writer_add_tensor(w, "t", DS4_TYPE_F32, 1, ne2) == DS4_ERR_INVALID);
    gguf_writer_abort(w);
    /* Too few and too many bytes. */
    CHECK(gguf_writer_open(path, 32, &w, &err) == DS4_OK);
    gguf_writer_add_tensor(w, "t", DS4_TYPE_F32, 1, ne2);
    float v[5] = { 0 };
    gguf_writer_write(w, v, 8);
    CHECK(gguf_writer_finish(w, &err) == DS4_ERR_INVALID);
    CHECK(strstr(err.message, "8 of its 16 bytes") != NULL);
    CHECK(gguf_writer_open(path, 32, &w, &err) == DS4_OK);
    gguf_writer_add_tensor(w, "t", DS4_TYPE_F32, 1, ne2);
    CHECK(gguf_writer_write(w, v, 20) == DS4_ERR_INVALID);
    gguf_writer_abort(w);
    CHECK(access(path, F_OK) != 0);
    /* Unwritable directory: a clear I/O error naming the path. */
    CHECK(gguf_writer_open("/nonexistent-dir/x.gguf", 32, &w, &err) == DS4_ERR_IO);
    CHECK(strstr(err.message, "/nonexistent-dir/x.gguf") != NULL);
    CHECK(gguf_writer_open(path, 24, &w, &err) == DS4_ERR_INVALID);
}

static void test_disk_full(void) {
    if (access("/dev/full", W_OK) != 0) TEST_SKIP("/dev/full not available");
    /* The temp name is "<path>.tmp", so write through a symlink to /dev/full. */
    char link[256];
    snprintf(link, sizeof link, "/tmp/ds4_test_full_%d.gguf", (int)getpid());
    char tmp[300];
    snprintf(tmp, sizeof tmp, "%s.tmp", link);
    unlink(tmp);
    if (symlink("/dev/full", tmp) != 0) TEST_SKIP("cannot create symlink");
    gguf_writer *w;
    ds4_error err = { 0 };
    CHECK(gguf_writer_open(link, 32, &w, &err) == DS4_OK);
    const uint64_t ne[1] = { 1 << 16 };
    gguf_writer_add_tensor(w, "t", DS4_TYPE_F32, 1, ne);
    static float v[1 << 16];
    gguf_writer_write(w, v, sizeof v);
    CHECK(gguf_writer_finish(w, &err) == DS4_ERR_IO);
    CHECK(strstr(err.message, "No space") != NULL);
    CHECK(access(link, F_OK) != 0);
    unlink(tmp);
}

static void test_file_errors(void) {
    gguf_file *f;
    ds4_error err = { 0 };
    CHECK(gguf_open("/nonexistent/file.gguf", &f, &err) == DS4_ERR_IO);
    CHECK(strstr(err.message, "/nonexistent/file.gguf") != NULL);
    CHECK(gguf_open("/tmp", &f, &err) == DS4_ERR_IO);
    const uint8_t small[10] = { 'G', 'G', 'U', 'F' };
    CHECK(gguf_open_memory(small, sizeof small, &f, &err) == DS4_ERR_FORMAT);
    uint8_t hdr[24] = { 'G', 'G', 'U', 'X', 3 };
    CHECK(gguf_open_memory(hdr, sizeof hdr, &f, &err) == DS4_ERR_FORMAT);
    CHECK(strstr(err.message, "magic") != NULL);
    hdr[3] = 'F';
    CHECK(gguf_open_memory(hdr, sizeof hdr, &f, &err) == DS4_OK); /* empty v3 file is valid */
    gguf_close(f);
    hdr[4] = 1;
    CHECK(gguf_open_memory(hdr, sizeof hdr, &f, &err) == DS4_ERR_FORMAT);
    CHECK(strstr(err.message, "version 1") != NULL);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_roundtrip),
    TEST_ENTRY(test_alignment_key),
    TEST_ENTRY(test_truncation),
    TEST_ENTRY(test_mutation),
    TEST_ENTRY(test_writer_misuse),
    TEST_ENTRY(test_disk_full),
    TEST_ENTRY(test_file_errors),
    { 0, 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

/* test_safetensors.c - safetensors reader: valid files, checkpoints, and a corpus of damage. */
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"
#include "core/quant.h"
#include "core/safetensors.h"
#include "test.h"

/* A file image: u64 header length, the header text, then `data`. */
static uint8_t *image(const char *header, const void *data, size_t data_len, size_t *size) {
    size_t h = strlen(header);
    uint8_t *buf = malloc(8 + h + data_len + 1);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(buf + 8, header, h);
    if (data_len) memcpy(buf + 8 + h, data, data_len);
    *size = 8 + h + data_len;
    return buf;
}

/* Open an image; returns the status and leaves the message in err. */
static ds4_status open_image(const char *header, const void *data, size_t data_len, ds4_error *err) {
    size_t size;
    uint8_t *buf = image(header, data, data_len, &size);
    safetensors_file *f = NULL;
    ds4_status st = safetensors_open_memory(buf, size, &f, err);
    safetensors_close(f);
    free(buf);
    return st;
}

#define EXPECT_REFUSED(header, data, len, needle)                                                              \
    do {                                                                                                       \
        ds4_error e_ = { 0 };                                                                                  \
        ds4_status s_ = open_image(header, data, len, &e_);                                                    \
        CHECK_MSG(s_ != DS4_OK, "accepted: %s", header);                                                       \
        CHECK_MSG(strstr(e_.message, needle) != NULL, "message '%s' lacks '%s'", e_.message, needle);          \
    } while (0)

static const char *VALID_HEADER =
    "{\"__metadata__\":{\"format\":\"pt\"},"
    "\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
    "\"h\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[24,32]},"
    "\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[32,36]},"
    "\"ids\":{\"dtype\":\"I64\",\"shape\":[2,1],\"data_offsets\":[36,52]},"
    "\"d\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[52,60]},"
    "\"s\":{\"dtype\":\"I32\",\"shape\":[],\"data_offsets\":[60,64]},"
    "\"empty\":{\"dtype\":\"U8\",\"shape\":[0,5],\"data_offsets\":[64,64]},"
    "\"flag\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[64,65]}}   ";

static void valid_data(uint8_t data[65]) {
    float w[6] = { 1, -2, 3.5f, 0.25f, -1e-3f, 7 };
    memcpy(data, w, 24);
    uint16_t h[4] = { ds4_f32_to_f16(1.5f), ds4_f32_to_f16(-2.0f), ds4_f32_to_f16(0.0f), ds4_f32_to_f16(65504.0f) };
    memcpy(data + 24, h, 8);
    uint16_t b[2] = { ds4_f32_to_bf16(3.0f), ds4_f32_to_bf16(-0.5f) };
    memcpy(data + 32, b, 4);
    int64_t ids[2] = { 7, -3 };
    memcpy(data + 36, ids, 16);
    double d = 0.1;
    memcpy(data + 52, &d, 8);
    int32_t s = 42;
    memcpy(data + 60, &s, 4);
    data[64] = 1;
}

static void test_valid(void) {
    uint8_t data[65];
    valid_data(data);
    size_t size;
    uint8_t *buf = image(VALID_HEADER, data, sizeof data, &size);
    safetensors_file *f = NULL;
    ds4_error err = { 0 };
    CHECK_MSG(safetensors_open_memory(buf, size, &f, &err) == DS4_OK, "%s", err.message);
    if (!f) {
        free(buf);
        return;
    }
    CHECK_EQ_INT(f->n_tensors, 8);
    const safetensors_tensor *w = safetensors_find(f, "w");
    CHECK(w && w->dtype == ST_F32 && w->n_dims == 2 && w->shape[0] == 2 && w->shape[1] == 3 && w->n_elements == 6);
    float out[6] = { 0 };
    CHECK(w && safetensors_read_f32(w, 0, 6, out, &err) == DS4_OK && out[2] == 3.5f && out[5] == 7);
    CHECK(w && safetensors_read_f32(w, 4, 2, out, &err) == DS4_OK && out[0] == -1e-3f);
    CHECK(w && safetensors_read_f32(w, 5, 2, out, &err) == DS4_ERR_INVALID);
    const safetensors_tensor *h = safetensors_find(f, "h");
    CHECK(h && safetensors_read_f32(h, 0, 4, out, &err) == DS4_OK && out[0] == 1.5f && out[1] == -2 && out[3] == 65504);
    const safetensors_tensor *b = safetensors_find(f, "b");
    CHECK(b && safetensors_read_f32(b, 0, 2, out, &err) == DS4_OK && out[0] == 3 && out[1] == -0.5f);
    const safetensors_tensor *d = safetensors_find(f, "d");
    CHECK(d && safetensors_read_f32(d, 0, 1, out, &err) == DS4_OK && out[0] == 0.1f);
    const safetensors_tensor *ids = safetensors_find(f, "ids");
    int64_t iv[2] = { 0 };
    CHECK(ids && safetensors_read_i64(ids, 0, 2, iv, &err) == DS4_OK && iv[0] == 7 && iv[1] == -3);
    CHECK(ids && safetensors_read_f32(ids, 0, 2, out, &err) == DS4_ERR_UNSUPPORTED);
    CHECK(w && safetensors_read_i64(w, 0, 1, iv, &err) == DS4_ERR_UNSUPPORTED);
    const safetensors_tensor *s = safetensors_find(f, "s");
    CHECK(s && s->n_dims == 0 && s->n_elements == 1 && safetensors_read_i64(s, 0, 1, iv, &err) == DS4_OK && iv[0] == 42);
    const safetensors_tensor *e = safetensors_find(f, "empty");
    CHECK(e && e->n_elements == 0 && e->n_bytes == 0);
    const safetensors_tensor *fl = safetensors_find(f, "flag");
    CHECK(fl && safetensors_read_i64(fl, 0, 1, iv, &err) == DS4_OK && iv[0] == 1);
    CHECK(safetensors_find(f, "nope") == NULL);
    CHECK(safetensors_find(f, "__metadata__") == NULL);
    CHECK_STR(safetensors_dtype_name(ST_BF16), "BF16");
    safetensors_close(f);
    free(buf);
}

static void test_malformed_header(void) {
    ds4_error err = { 0 };
    safetensors_file *f = NULL;
    uint8_t tiny[5] = { 1, 2, 3, 4, 5 };
    CHECK(safetensors_open_memory(tiny, sizeof tiny, &f, &err) != DS4_OK);
    CHECK_MSG(strstr(err.message, "smaller than the 8-byte") != NULL, "%s", err.message);

    uint8_t huge[16] = { 0, 0, 0, 0, 0, 0, 0, 0x40, '{', '}' }; /* 2^62 */
    CHECK(safetensors_open_memory(huge, sizeof huge, &f, &err) != DS4_OK);
    CHECK_MSG(strstr(err.message, "exceeds") != NULL, "%s", err.message);

    uint8_t past[16] = { 100, 0, 0, 0, 0, 0, 0, 0, '{', '}' };
    CHECK(safetensors_open_memory(past, sizeof past, &f, &err) != DS4_OK);
    CHECK_MSG(strstr(err.message, "runs past the end") != NULL, "%s", err.message);

    uint8_t one[9] = { 1, 0, 0, 0, 0, 0, 0, 0, '{' };
    CHECK(safetensors_open_memory(one, sizeof one, &f, &err) != DS4_OK);
    CHECK_MSG(strstr(err.message, "cannot hold") != NULL, "%s", err.message);

    EXPECT_REFUSED("[1,2,3]", NULL, 0, "does not start with '{'");
    EXPECT_REFUSED("{\"a\":{\"dtype\":", NULL, 0, "invalid JSON");
    EXPECT_REFUSED("{\"a\":1,}", NULL, 0, "invalid JSON");
    EXPECT_REFUSED("{}  x", NULL, 0, "unexpected data after the JSON");
    EXPECT_REFUSED("{} {}", NULL, 0, "unexpected data after the JSON");
    EXPECT_REFUSED("{\"a\\u0000b\":{}}", NULL, 0, "\\u0000");
    {
        size_t size; /* a NUL inside the name; the header length still counts it */
        uint8_t *buf = image("{\"a\":{}}", NULL, 0, &size);
        buf[8 + 3] = 0;
        CHECK(safetensors_open_memory(buf, size, &f, &err) != DS4_OK);
        CHECK_MSG(strstr(err.message, "NUL byte") != NULL, "%s", err.message);
        free(buf);
    }
    /* A dense array: many more JSON values than any real header holds. */
    {
        size_t n = 20000;
        char *hdr = malloc(2 * n + 16);
        size_t o = (size_t)sprintf(hdr, "{\"x\":[");
        for (size_t i = 0; i < n; i++) hdr[o++] = '0', hdr[o++] = ',';
        o--;
        o += (size_t)sprintf(hdr + o, "]}");
        EXPECT_REFUSED(hdr, NULL, 0, "JSON values");
        free(hdr);
    }
    /* Deep nesting is refused by the parser's nesting limit, not by a crash. */
    {
        size_t n = 5000;
        char *hdr = malloc(2 * n + 16);
        size_t o = (size_t)sprintf(hdr, "{\"x\":");
        for (size_t i = 0; i < n; i++) hdr[o++] = '[';
        for (size_t i = 0; i < n; i++) hdr[o++] = ']';
        sprintf(hdr + o, "}");
        ds4_error e = { 0 };
        CHECK(open_image(hdr, NULL, 0, &e) != DS4_OK);
        free(hdr);
    }
}

static void test_malformed_entries(void) {
    uint8_t data[64] = { 0 };
    EXPECT_REFUSED("{\"a\":5}", NULL, 0, "entry is not a JSON object");
    EXPECT_REFUSED("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", data, 4, "\"dtype\" is missing");
    EXPECT_REFUSED("{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", data, 4, "not a string");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F17\",\"shape\":[1],\"data_offsets\":[0,4]}}", data, 4, "unknown dtype 'F17'");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", data, 4, "\"shape\" is missing");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", data, 4, "not an array");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", data, 4,
                   "shape[0] is not a non-negative integer");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", data, 4,
                   "shape[0] is not a non-negative integer");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,\"2\"],\"data_offsets\":[0,4]}}", data, 4,
                   "shape[1] is not");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", data, 4,
                   "9 dimensions");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", data, 4,
                   "overflows");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F64\",\"shape\":[4294967296,1073741824],\"data_offsets\":[0,4]}}", data, 4,
                   "byte size overflows");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", data, 4, "\"data_offsets\" is missing");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", data, 8,
                   "not an array of two integers");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,-4]}}", data, 4,
                   "not non-negative integers");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", data, 4, "end before they begin");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", data, 4, "run past the end");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,1e300]}}", data, 4,
                   "not non-negative integers");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}", data, 20, "needs 24 bytes");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,8]}}", data, 8, "needs 6 bytes");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                   "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", data, 12, "overlap");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                   "\"z\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,4]}}", data, 8, "overlap");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", data, 8, "belong to no tensor");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", data, 12,
                   "at the end of the file belong to no tensor");
    EXPECT_REFUSED("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                   "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", data, 8, "duplicate tensor name 'a'");
    EXPECT_REFUSED("{\"\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", data, 4, "name length 0");
    EXPECT_REFUSED("{\"__metadata__\":[1],\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", data, 4,
                   "\"__metadata__\" is not a JSON object");
    EXPECT_REFUSED("{\"__metadata__\":{\"k\":1},\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", data, 4,
                   "'k' is not a string");
    /* Known but unconvertible dtypes open fine and are refused by the readers. */
    ds4_error err = { 0 };
    CHECK(open_image("{\"q\":{\"dtype\":\"F8_E4M3\",\"shape\":[4],\"data_offsets\":[0,4]}}", data, 4, &err) == DS4_OK);
    /* An empty header object with no data is a valid (empty) file. */
    CHECK(open_image("{}", NULL, 0, &err) == DS4_OK);
}

/* Every truncation and a few thousand random byte changes of a valid file:
 * refused or accepted, never a crash (ASan/UBSan builds check the rest). */
static void test_damage_corpus(void) {
    uint8_t data[65];
    valid_data(data);
    size_t size;
    uint8_t *good = image(VALID_HEADER, data, sizeof data, &size);
    int refused = 0;
    for (size_t n = 0; n < size; n++) {
        uint8_t *cut = malloc(n ? n : 1);
        memcpy(cut, good, n);
        safetensors_file *f = NULL;
        ds4_error err = { 0 };
        ds4_status st = safetensors_open_memory(cut, n, &f, &err);
        refused += st != DS4_OK;
        CHECK_MSG(st != DS4_OK, "truncation to %zu bytes accepted", n);
        CHECK(st == DS4_OK || err.message[0] != '\0');
        safetensors_close(f);
        free(cut);
    }
    CHECK_EQ_INT(refused, (long long)size);
    uint8_t *mut = malloc(size);
    for (int it = 0; it < 4000; it++) {
        memcpy(mut, good, size);
        int flips = 1 + (int)(test_rand_u64() % 4);
        for (int k = 0; k < flips; k++) {
            size_t at = (size_t)(test_rand_u64() % size);
            if (test_rand_u64() % 2) at = (size_t)(test_rand_u64() % 16); /* favour the header length */
            mut[at] = (uint8_t)test_rand_u64();
        }
        safetensors_file *f = NULL;
        ds4_error err = { 0 };
        if (safetensors_open_memory(mut, size, &f, &err) == DS4_OK) {
            for (uint64_t i = 0; i < f->n_tensors; i++) { /* every accepted tensor lies inside the image */
                const safetensors_tensor *t = &f->tensors[i];
                CHECK(t->file_offset >= f->data_offset && t->file_offset + t->n_bytes <= size);
            }
        } else {
            CHECK(err.message[0] != '\0');
        }
        safetensors_close(f);
    }
    free(mut);
    free(good);
}

/* ---------------------------------------------------------------- checkpoints */

static char dir[256];

static void write_file(const char *name, const void *bytes, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp) return;
    fwrite(bytes, 1, n, fp);
    fclose(fp);
}

static void write_st(const char *name, const char *header, const void *data, size_t len) {
    size_t size;
    uint8_t *buf = image(header, data, len, &size);
    write_file(name, buf, size);
    free(buf);
}

static void clean_dir(void) {
    const char *names[] = { "model.safetensors", "model.safetensors.index.json", "a.safetensors", "b.safetensors" };
    char path[512];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        unlink(path);
    }
}

static ds4_status open_ckpt(safetensors_checkpoint **c, ds4_error *err) {
    return safetensors_checkpoint_open(dir, c, err);
}

static void test_checkpoints(void) {
    snprintf(dir, sizeof dir, "/tmp/ds4_test_st_%d", (int)getpid());
    mkdir(dir, 0700);
    clean_dir();
    float v[4] = { 1, 2, 3, 4 };
    safetensors_checkpoint *c = NULL;
    ds4_error err = { 0 };

    CHECK(open_ckpt(&c, &err) == DS4_ERR_NOT_FOUND);
    CHECK_MSG(strstr(err.message, "neither") != NULL, "%s", err.message);

    write_st("model.safetensors", "{\"x\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", v, 16);
    CHECK_MSG(open_ckpt(&c, &err) == DS4_OK, "%s", err.message);
    if (c) {
        CHECK_EQ_INT(c->n_files, 1);
        CHECK_EQ_INT(c->n_tensors, 1);
        CHECK(safetensors_checkpoint_find(c, "x") != NULL);
        CHECK(safetensors_checkpoint_index(c, "x") == 0);
        CHECK(safetensors_checkpoint_index(c, "y") == UINT64_MAX);
        safetensors_checkpoint_close(c);
        c = NULL;
    }
    clean_dir();

    write_st("a.safetensors", "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", v, 16);
    write_st("b.safetensors", "{\"z\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", v, 4);
    const char *index = "{\"metadata\":{\"total_size\":20},\"weight_map\":{\"x\":\"a.safetensors\","
                        "\"y\":\"a.safetensors\",\"z\":\"b.safetensors\"}}";
    write_file("model.safetensors.index.json", index, strlen(index));
    CHECK_MSG(open_ckpt(&c, &err) == DS4_OK, "%s", err.message);
    if (c) {
        CHECK_EQ_INT(c->n_files, 2);
        CHECK_EQ_INT(c->n_tensors, 3);
        const safetensors_tensor *z = safetensors_checkpoint_find(c, "z");
        float out[1] = { 0 };
        CHECK(z && safetensors_read_f32(z, 0, 1, out, &err) == DS4_OK && out[0] == 1);
        CHECK(z && strstr(z->file_path, "b.safetensors") != NULL);
        safetensors_checkpoint_close(c);
        c = NULL;
    }

    struct { const char *index, *needle; } bad[] = {
        { "{\"weight_map\":{\"x\":\"a.safetensors\",\"z\":\"a.safetensors\"}}", "does not contain it" },
        { "{\"weight_map\":{\"x\":\"../a.safetensors\"}}", "not a plain file name" },
        { "{\"weight_map\":{\"x\":\"sub/a.safetensors\"}}", "not a plain file name" },
        { "{\"weight_map\":{\"x\":7}}", "not a plain file name" },
        { "{\"weight_map\":{\"x\":\"missing.safetensors\"}}", "missing.safetensors" },
        { "{\"weight_map\":[]}", "\"weight_map\" is not a JSON object" },
        { "{\"metadata\":{}}", "\"weight_map\" is missing" },
        { "{\"weight_map\":{\"x\":", "invalid JSON" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_file("model.safetensors.index.json", bad[i].index, strlen(bad[i].index));
        ds4_error e = { 0 };
        CHECK_MSG(open_ckpt(&c, &e) != DS4_OK, "accepted index %s", bad[i].index);
        CHECK_MSG(strstr(e.message, bad[i].needle) != NULL, "index %zu: '%s' lacks '%s'", i, e.message,
                  bad[i].needle);
        safetensors_checkpoint_close(c);
        c = NULL;
    }
    /* The same tensor name in two shards. */
    write_st("b.safetensors", "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", v, 4);
    index = "{\"weight_map\":{\"x\":\"a.safetensors\",\"y\":\"b.safetensors\"}}";
    write_file("model.safetensors.index.json", index, strlen(index));
    CHECK(open_ckpt(&c, &err) != DS4_OK);
    CHECK_MSG(strstr(err.message, "is in both") != NULL, "%s", err.message);
    /* A damaged shard is reported with its path. */
    write_st("b.safetensors", "{\"z\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", v, 4);
    index = "{\"weight_map\":{\"x\":\"a.safetensors\",\"z\":\"b.safetensors\"}}";
    write_file("model.safetensors.index.json", index, strlen(index));
    CHECK(open_ckpt(&c, &err) != DS4_OK);
    CHECK_MSG(strstr(err.message, "b.safetensors") != NULL && strstr(err.message, "needs 8 bytes") != NULL, "%s",
              err.message);
    clean_dir();
    rmdir(dir);
}

static void test_open_file(void) {
    ds4_error err = { 0 };
    safetensors_file *f = NULL;
    CHECK(safetensors_open("/nonexistent/x.safetensors", &f, &err) == DS4_ERR_IO);
    CHECK(safetensors_open("/tmp", &f, &err) == DS4_ERR_IO);
    char path[256];
    snprintf(path, sizeof path, "/tmp/ds4_test_st_%d.safetensors", (int)getpid());
    uint8_t data[65];
    valid_data(data);
    size_t size;
    uint8_t *buf = image(VALID_HEADER, data, sizeof data, &size);
    FILE *fp = fopen(path, "wb");
    fwrite(buf, 1, size, fp);
    fclose(fp);
    CHECK_MSG(safetensors_open(path, &f, &err) == DS4_OK, "%s", err.message);
    if (f) {
        const safetensors_tensor *w = safetensors_find(f, "w");
        CHECK(w && w->file_offset == 8 + strlen(VALID_HEADER) && !strcmp(w->file_path, path));
        safetensors_close(f);
    }
    fp = fopen(path, "wb");
    fwrite(buf, 1, size - 1, fp);
    fclose(fp);
    CHECK(safetensors_open(path, &f, &err) != DS4_OK);
    CHECK_MSG(strstr(err.message, path) != NULL, "error does not name the file: %s", err.message);
    unlink(path);
    free(buf);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_valid),
    TEST_ENTRY(test_malformed_header),
    TEST_ENTRY(test_malformed_entries),
    TEST_ENTRY(test_damage_corpus),
    TEST_ENTRY(test_checkpoints),
    TEST_ENTRY(test_open_file),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

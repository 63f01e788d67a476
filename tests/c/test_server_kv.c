/*
 * test_server_kv.c - the server's disk KV store on a tiny synthetic model:
 * store and find by text prefix, the tool-id map carried across a restart,
 * a corrupt checkpoint ignored and deleted, LRU eviction within the size
 * bound, and a full disk turning caching off without leaving files behind.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/deepseek4/ds4_synth.h"
#include "server/server_internal.h"
#include "test.h"

static char model_path[256], dir[256];
static ds4_engine *engine;

static bool setup(void) {
    if (engine) return true;
    ds4_error err = { 0 };
    snprintf(model_path, sizeof model_path, "/tmp/ds4_test_server_kv_%d.gguf", (int)getpid());
    if (ds4_synth_write(model_path, DS4_SCALE_TINY, DS4_QUANT_Q2, 5, NULL, false, &err)) {
        fprintf(stderr, "synth: %s\n", err.message);
        return false;
    }
    ds4_engine_params p = { .model_path = model_path, .backend = "cpu", .n_threads = 2 };
    if (ds4_engine_open(&p, &engine, &err)) {
        fprintf(stderr, "engine: %s\n", err.message);
        return false;
    }
    return true;
}

static ds4_session *session_with(int first, int n) {
    ds4_session *s = NULL;
    ds4_error err = { 0 };
    int32_t toks[32];
    for (int i = 0; i < n; i++) toks[i] = first + i;
    if (ds4_session_create(engine, 64, &s, &err) || ds4_session_sync(s, toks, n, NULL, &err)) {
        fprintf(stderr, "session: %s\n", err.message);
        ds4_session_free(s);
        return NULL;
    }
    return s;
}

static void fresh_dir(const char *tag) {
    snprintf(dir, sizeof dir, "/tmp/ds4_test_server_kv_%d_%s", (int)getpid(), tag);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

static int count_files(const char *suffix) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *de;
    while (d && (de = readdir(d))) {
        size_t l = strlen(de->d_name), k = strlen(suffix);
        if (l > k && !strcmp(de->d_name + l - k, suffix)) n++;
    }
    if (d) closedir(d);
    return n;
}

static void remove_dir(void) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

static void test_store_find_and_tool_ids(void) {
    if (!setup()) TEST_SKIP("no model");
    if (!engine) return;
    fresh_dir("roundtrip");
    ds4_session *s = session_with(100, 10);
    if (!s) return;
    srv_tool_memory mem = { 0 };
    srv_tool_memory_put(&mem, "call_abc", "<DSML block>");
    srv_tool_memory_put(&mem, "call_zzz", "<not in the text>");
    srv_metrics m;
    srv_metrics_init(&m);
    srv_kvstore *kv = srv_kv_open(dir, 64 << 20, &m, &mem);
    const char *text = "prefix <DSML block> suffix";
    srv_kv_save(kv, s, text, strlen(text));
    CHECK_EQ_INT(m.disk_saves, 1);
    CHECK_EQ_INT(m.disk_files, 1);
    srv_kv_close(kv);
    srv_tool_memory_free(&mem);

    /* "Restart": a new store over the directory, an empty tool memory. */
    srv_tool_memory mem2 = { 0 };
    kv = srv_kv_open(dir, 64 << 20, &m, &mem2);
    CHECK(srv_tool_memory_get(&mem2, "call_abc") && !strcmp(srv_tool_memory_get(&mem2, "call_abc"), "<DSML block>"));
    CHECK(srv_tool_memory_get(&mem2, "call_zzz") == NULL);
    int64_t n = 0;
    const char *longer = "prefix <DSML block> suffix and the next turn";
    int idx = srv_kv_find(kv, longer, strlen(longer), &n);
    CHECK(idx == 0 && n == 10);
    CHECK(srv_kv_find(kv, "prefix <DSML", 12, &n) == -1);                /* shorter than the key */
    CHECK(srv_kv_find(kv, "Prefix <DSML block> suffix!", 27, &n) == -1); /* differs */
    ds4_session *t = session_with(200, 3);
    CHECK(srv_kv_load(kv, idx, t) == 0);
    int64_t nt = 0;
    const int32_t *toks = ds4_session_tokens(t, &nt);
    CHECK(nt == 10 && toks[0] == 100 && toks[9] == 109);
    srv_kv_close(kv);
    srv_tool_memory_free(&mem2);
    srv_metrics_destroy(&m);
    ds4_session_free(t);
    ds4_session_free(s);
    remove_dir();
}

static void test_corrupt_checkpoint_is_deleted(void) {
    if (!setup()) TEST_SKIP("no model");
    if (!engine) return;
    fresh_dir("corrupt");
    ds4_session *s = session_with(300, 8);
    if (!s) return;
    srv_kvstore *kv = srv_kv_open(dir, 64 << 20, NULL, NULL);
    srv_kv_save(kv, s, "abc", 3);
    srv_kv_close(kv);
    /* flip one payload byte of the checkpoint */
    DIR *d = opendir(dir);
    struct dirent *de;
    char path[600] = "";
    while (d && (de = readdir(d)))
        if (strstr(de->d_name, ".ckpt")) snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    if (d) closedir(d);
    FILE *fp = fopen(path, "r+b");
    CHECK(fp != NULL);
    if (!fp) return;
    fseek(fp, 0, SEEK_END);
    long size = ftell(fp);
    fseek(fp, size / 2, SEEK_SET);
    int c = fgetc(fp);
    fseek(fp, size / 2, SEEK_SET);
    fputc(c ^ 0xff, fp);
    fclose(fp);
    kv = srv_kv_open(dir, 64 << 20, NULL, NULL);
    int64_t n = 0;
    int idx = srv_kv_find(kv, "abcdef", 6, &n);
    CHECK(idx == 0);
    ds4_session *t = session_with(400, 4);
    CHECK(srv_kv_load(kv, idx, t) == -1);
    int64_t nt = 0;
    const int32_t *toks = ds4_session_tokens(t, &nt);
    CHECK(nt == 4 && toks[0] == 400); /* the session is as it was */
    CHECK(srv_kv_find(kv, "abcdef", 6, &n) == -1);
    CHECK_EQ_INT(count_files(".ckpt"), 0);
    CHECK_EQ_INT(count_files(".idx"), 0);
    srv_kv_close(kv);
    ds4_session_free(t);
    ds4_session_free(s);
    remove_dir();
}

/* A fresh store directory `tag` holding s stored under `first`, reopened
 * with room for two such entries (*one: the bytes of one). */
static srv_kvstore *store_with_room_for_two(const char *tag, ds4_session *s, const char *first, srv_metrics *m,
                                            int64_t *one) {
    fresh_dir(tag);
    srv_kvstore *kv = srv_kv_open(dir, 1 << 30, m, NULL);
    srv_kv_save(kv, s, first, strlen(first));
    *one = m->disk_bytes;
    srv_kv_close(kv);
    CHECK(*one > 0);
    return srv_kv_open(dir, *one * 5 / 2, m, NULL);
}

static void test_eviction_within_the_bound(void) {
    if (!setup()) TEST_SKIP("no model");
    if (!engine) return;
    ds4_session *s = session_with(500, 6);
    if (!s) return;
    srv_metrics m;
    srv_metrics_init(&m);
    int64_t one, n;
    srv_kvstore *kv = store_with_room_for_two("evict", s, "first", &m, &one);
    srv_kv_save(kv, s, "second", 6);
    srv_kv_save(kv, s, "third", 5); /* over the bound: "first", the least recently used, goes */
    CHECK_EQ_INT(m.disk_files, 2);
    CHECK(m.disk_bytes <= one * 5 / 2);
    CHECK(srv_kv_find(kv, "first!", 6, &n) == -1);
    CHECK(srv_kv_find(kv, "second!", 7, &n) >= 0 && srv_kv_find(kv, "third!", 6, &n) >= 0);
    CHECK_EQ_INT(count_files(".ckpt"), 2);
    srv_kv_close(kv);
    srv_metrics_destroy(&m);
    ds4_session_free(s);
    remove_dir();
}

/* A checkpoint bigger than the whole store is not stored, and leaves no
 * file behind. */
static void test_too_big_checkpoint_is_not_stored(void) {
    if (!setup()) TEST_SKIP("no model");
    if (!engine) return;
    ds4_session *s = session_with(500, 6);
    if (!s) return;
    srv_metrics m;
    srv_metrics_init(&m);
    int64_t one, n;
    srv_kv_close(store_with_room_for_two("big", s, "first", &m, &one));
    srv_metrics_destroy(&m);
    remove_dir();
    fresh_dir("big");
    srv_metrics_init(&m);
    srv_kvstore *kv = srv_kv_open(dir, one - 1, &m, NULL);
    srv_kv_save(kv, s, "second", 6);
    CHECK_EQ_INT(m.disk_files, 0);
    CHECK_EQ_INT((int)m.disk_bytes, 0);
    CHECK_EQ_INT((int)m.disk_saves, 0);
    CHECK_EQ_INT((int)m.disk_failures, 0); /* not a failure: writing stays on */
    CHECK(srv_kv_find(kv, "second!", 7, &n) == -1);
    CHECK_EQ_INT(count_files(".ckpt") + count_files(".idx") + count_files(".tmp"), 0);
    srv_kv_close(kv);
    srv_metrics_destroy(&m);
    ds4_session_free(s);
    remove_dir();
}

/* Uses within one second keep their order: with room for two entries,
 * "a" stored, "b" stored, "a" loaded (used), then "c" stored: "b" goes. */
static void test_eviction_order_within_a_second(void) {
    if (!setup()) TEST_SKIP("no model");
    if (!engine) return;
    ds4_session *s = session_with(500, 6);
    if (!s) return;
    srv_metrics m;
    srv_metrics_init(&m);
    int64_t one, n;
    srv_kvstore *kv = store_with_room_for_two("lru", s, "a", &m, &one);
    srv_kv_save(kv, s, "b", 1);
    const int ia = srv_kv_find(kv, "a!", 2, &n);
    CHECK(ia >= 0);
    if (ia >= 0) CHECK_EQ_INT(srv_kv_load(kv, ia, s), 0);
    srv_kv_save(kv, s, "c", 1);
    CHECK_EQ_INT(m.disk_files, 2);
    CHECK(m.disk_bytes <= one * 5 / 2);
    CHECK(srv_kv_find(kv, "a!", 2, &n) >= 0);
    CHECK(srv_kv_find(kv, "b!", 2, &n) == -1);
    CHECK(srv_kv_find(kv, "c!", 2, &n) >= 0);
    srv_kv_close(kv);
    srv_metrics_destroy(&m);
    ds4_session_free(s);
    remove_dir();
}

static void test_full_disk_turns_caching_off(void) {
    if (!setup()) TEST_SKIP("no model");
    if (!engine) return;
    fresh_dir("full");
    ds4_session *s = session_with(600, 5);
    if (!s) return;
    srv_metrics m;
    srv_metrics_init(&m);
    srv_kvstore *kv = srv_kv_open(dir, 64 << 20, &m, NULL);
    /* The checkpoint of text "x" is written through NAME.ckpt.tmp: make that /dev/full. */
    uint64_t h = 0xcbf29ce484222325ull;
    h = (h ^ (unsigned char)'x') * 0x100000001b3ull;
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s/%016llx.ckpt.tmp", dir, (unsigned long long)h);
    if (symlink("/dev/full", tmp) != 0) {
        srv_kv_close(kv);
        ds4_session_free(s);
        TEST_SKIP("cannot create the symlink");
        return;
    }
    srv_kv_save(kv, s, "x", 1);
    CHECK_EQ_INT(m.disk_failures, 1);
    CHECK_EQ_INT(m.disk_saves, 0);
    unlink(tmp);
    srv_kv_save(kv, s, "y", 1); /* writing is off now */
    CHECK_EQ_INT(m.disk_saves, 0);
    CHECK_EQ_INT(count_files(".ckpt"), 0);
    CHECK_EQ_INT(count_files(".idx"), 0);
    srv_kv_close(kv);
    srv_metrics_destroy(&m);
    ds4_session_free(s);
    remove_dir();
}

static void test_teardown(void) {
    ds4_engine_close(engine);
    engine = NULL;
    if (model_path[0]) unlink(model_path);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_store_find_and_tool_ids),
    TEST_ENTRY(test_corrupt_checkpoint_is_deleted),
    TEST_ENTRY(test_eviction_within_the_bound),
    TEST_ENTRY(test_eviction_order_within_a_second),
    TEST_ENTRY(test_too_big_checkpoint_is_not_stored),
    TEST_ENTRY(test_full_disk_turns_caching_off),
    TEST_ENTRY(test_teardown),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

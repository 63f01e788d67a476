/*
 * kvstore.c - the disk KV store (`--kv-dir DIR --kv-max-mb N`).
 *
 * Each entry is two files named by the FNV-1a 64 hash of the text its tokens
 * decode to (the rendered conversation prefix):
 *   NAME.ckpt  the session checkpoint (ds4_session_save: versioned, model
 *              fingerprint, CRC-32, written to a temporary file and renamed);
 *   NAME.idx   "DS4KVIX\n", u32 version 1, u32 tool ids, u64 tokens, u64
 *              text bytes, u64 text hash, u64 checkpoint bytes, u32 CRC-32 of
 *              everything else in the file (little-endian), then the tool-id
 *              map: per id u32 id bytes, u32 DSML bytes, the id, the exact
 *              DSML block generated under it (only blocks that occur in the
 *              entry's text), so replayed tool calls render byte-exactly after
 *              a restart too. Written after the checkpoint, through a
 *              temporary file and a rename, so an index always describes a
 *              complete checkpoint.
 * A request finds the entry whose text is the longest byte prefix of its
 * rendered prompt; a checkpoint that fails to load (corrupt, truncated, other
 * model) is deleted and the request prefills as if there were none. Before a
 * new entry is counted, the least recently used ones are deleted until it
 * fits, so the store never counts more than its size.
 * Any write failure (full disk, unwritable directory) is logged once and
 * turns writing off; requests never fail because of the store.
 */
#define _GNU_SOURCE /* memmem */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "server/server_internal.h"

#define IDX_MAGIC "DS4KVIX\n"
#define IDX_VERSION 1u
#define IDX_SIZE 52 /* the fixed part */
#define IDX_MAX (64 << 20)
#define TOOL_IDS_SAVED 1024 /* most recent ids considered per entry */

typedef struct kv_entry {
    char name[17];
    int64_t n_tokens;
    uint64_t text_len, text_hash;
    int64_t bytes; /* both files */
    time_t last_used; /* seconds: the index's mtime across restarts */
    uint64_t use_seq; /* the order of uses in this process (0: not used since the store was opened) */
} kv_entry;

struct srv_kvstore {
    char *dir;
    int64_t max_bytes;
    bool writable;
    kv_entry *v;
    size_t n, cap;
    int64_t total;
    uint64_t uses; /* last use_seq given */
    srv_metrics *metrics;
    srv_tool_memory *tools;
};

static uint64_t fnv1a(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static void put_le(unsigned char *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void path_of(const srv_kvstore *kv, const char *name, const char *ext, char *out, size_t cap) {
    snprintf(out, cap, "%s/%s%s", kv->dir, name, ext);
}

static void publish(srv_kvstore *kv) {
    if (!kv->metrics) return;
    pthread_mutex_lock(&kv->metrics->mu);
    kv->metrics->disk_bytes = kv->total;
    kv->metrics->disk_files = (int64_t)kv->n;
    pthread_mutex_unlock(&kv->metrics->mu);
}

static void count_failure(srv_kvstore *kv) {
    if (!kv->metrics) return;
    pthread_mutex_lock(&kv->metrics->mu);
    kv->metrics->disk_failures++;
    pthread_mutex_unlock(&kv->metrics->mu);
}

static void remove_files(const srv_kvstore *kv, const char *name) {
    char path[4096];
    path_of(kv, name, ".idx", path, sizeof path);
    unlink(path);
    path_of(kv, name, ".ckpt", path, sizeof path);
    unlink(path);
}

static void drop(srv_kvstore *kv, size_t i) {
    remove_files(kv, kv->v[i].name);
    kv->total -= kv->v[i].bytes;
    kv->v[i] = kv->v[--kv->n];
    publish(kv);
}

static int push(srv_kvstore *kv, const kv_entry *e) {
    if (kv->n == kv->cap) {
        size_t cap = kv->cap ? 2 * kv->cap : 16;
        kv_entry *v = realloc(kv->v, cap * sizeof *v);
        if (!v) return -1;
        kv->v = v;
        kv->cap = cap;
    }
    kv->v[kv->n++] = *e;
    kv->total += e->bytes;
    publish(kv);
    return 0;
}

static bool is_hex_name(const char *s, size_t n) {
    if (n != 16) return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return false;
    return true;
}

static uint32_t idx_crc(const unsigned char *p, size_t n) {
    uLong c = crc32(0L, p, 48);
    if (n > IDX_SIZE) c = crc32(c, p + IDX_SIZE, (uInt)(n - IDX_SIZE));
    return (uint32_t)c;
}

/* Read NAME.idx and check it against NAME.ckpt; 0 when the pair is sound.
 * The tool ids it carries go into kv->tools. */
static int read_entry(const srv_kvstore *kv, const char *name, kv_entry *e) {
    char path[4096];
    struct stat is, cs;
    path_of(kv, name, ".idx", path, sizeof path);
    FILE *fp = fopen(path, "rb");
    if (!fp) return -1;
    unsigned char *h = NULL;
    size_t n = 0;
    if (fstat(fileno(fp), &is) == 0 && is.st_size >= IDX_SIZE && is.st_size <= IDX_MAX &&
        (h = malloc((size_t)is.st_size)))
        n = fread(h, 1, (size_t)is.st_size, fp);
    fclose(fp);
    int ok = h && n == (size_t)is.st_size && !memcmp(h, IDX_MAGIC, 8) && get_le(h + 8, 4) == IDX_VERSION &&
             get_le(h + 48, 4) == idx_crc(h, n);
    path_of(kv, name, ".ckpt", path, sizeof path);
    if (!ok || stat(path, &cs) != 0 || (uint64_t)cs.st_size != get_le(h + 40, 8)) {
        free(h);
        return -1;
    }
    memset(e, 0, sizeof *e);
    memcpy(e->name, name, 16);
    e->n_tokens = (int64_t)get_le(h + 16, 8);
    e->text_len = get_le(h + 24, 8);
    e->text_hash = get_le(h + 32, 8);
    e->bytes = (int64_t)cs.st_size + (int64_t)n;
    e->last_used = is.st_mtime;
    size_t at = IDX_SIZE, count = (size_t)get_le(h + 12, 4);
    for (size_t i = 0; i < count && kv->tools && at + 8 <= n; i++) {
        size_t il = (size_t)get_le(h + at, 4), dl = (size_t)get_le(h + at + 4, 4);
        if (il == 0 || il > 256 || dl == 0 || dl > n - at - 8 - il) break;
        char *id = strndup((const char *)h + at + 8, il), *dsml = strndup((const char *)h + at + 8 + il, dl);
        if (id && dsml && !srv_tool_memory_get(kv->tools, id)) srv_tool_memory_put(kv->tools, id, dsml);
        free(id);
        free(dsml);
        at += 8 + il + dl;
    }
    free(h);
    return e->n_tokens > 0 ? 0 : -1;
}

srv_kvstore *srv_kv_open(const char *dir, int64_t max_bytes, srv_metrics *metrics, srv_tool_memory *tools) {
    srv_kvstore *kv = calloc(1, sizeof *kv);
    if (!kv) return NULL;
    kv->tools = tools;
    kv->dir = strdup(dir);
    kv->max_bytes = max_bytes;
    kv->metrics = metrics;
    if (!kv->dir) {
        free(kv);
        return NULL;
    }
    struct stat st;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        srv_log("warning: disk KV store %s: cannot create the directory (%s); continuing without it", dir,
                strerror(errno));
        return kv;
    }
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        srv_log("warning: disk KV store %s: not a directory; continuing without it", dir);
        return kv;
    }
    kv->writable = access(dir, W_OK | X_OK) == 0;
    if (!kv->writable) srv_log("warning: disk KV store %s: the directory is not writable; reading only", dir);
    DIR *d = opendir(dir);
    if (!d) return kv;
    struct dirent *de;
    int bad = 0;
    while ((de = readdir(d))) {
        const char *nm = de->d_name;
        size_t len = strlen(nm);
        const char *dot = strchr(nm, '.');
        if (!dot || nm[0] == '.') continue;
        size_t base = (size_t)(dot - nm);
        if (!is_hex_name(nm, base)) continue;
        char name[17];
        memcpy(name, nm, 16);
        name[16] = '\0';
        char path[4096];
        if (strstr(nm, ".tmp")) { /* left over from an interrupted write */
            snprintf(path, sizeof path, "%s/%s", dir, nm);
            if (kv->writable) unlink(path);
            continue;
        }
        if (strcmp(dot, ".idx") != 0) {
            /* a checkpoint without its index is an interrupted store */
            if (!strcmp(dot, ".ckpt") && kv->writable) {
                path_of(kv, name, ".idx", path, sizeof path);
                if (access(path, F_OK) != 0) {
                    path_of(kv, name, ".ckpt", path, sizeof path);
                    unlink(path);
                }
            }
            continue;
        }
        (void)len;
        kv_entry e;
        if (read_entry(kv, name, &e) != 0) {
            bad++;
            if (kv->writable) remove_files(kv, name);
            continue;
        }
        if (push(kv, &e) != 0) break;
    }
    closedir(d);
    srv_log("disk KV store %s: %zu checkpoints, %.1f MiB (limit %.0f MiB)%s", dir, kv->n,
            (double)kv->total / 1048576.0, (double)max_bytes / 1048576.0,
            bad ? ", damaged entries removed" : "");
    return kv;
}

void srv_kv_close(srv_kvstore *kv) {
    if (!kv) return;
    free(kv->v);
    free(kv->dir);
    free(kv);
}

int srv_kv_find(srv_kvstore *kv, const char *text, size_t len, int64_t *n_tokens) {
    int best = -1;
    for (size_t i = 0; i < kv->n; i++) {
        const kv_entry *e = &kv->v[i];
        if (e->text_len > len || (best >= 0 && e->n_tokens <= kv->v[best].n_tokens)) continue;
        if (fnv1a(text, (size_t)e->text_len) == e->text_hash) best = (int)i;
    }
    if (best >= 0) *n_tokens = kv->v[best].n_tokens;
    return best;
}

/* Entry e is used now (its place in the eviction order). */
static void touch(srv_kvstore *kv, kv_entry *e) {
    e->last_used = time(NULL);
    e->use_seq = ++kv->uses;
}

int srv_kv_load(srv_kvstore *kv, int idx, ds4_session *session) {
    if (idx < 0 || (size_t)idx >= kv->n) return -1;
    kv_entry *e = &kv->v[idx];
    char path[4096];
    path_of(kv, e->name, ".ckpt", path, sizeof path);
    ds4_error err = { 0 };
    if (ds4_session_load(session, path, &err) != DS4_OK) {
        srv_log("warning: disk KV store: ignoring and deleting a checkpoint that does not load: %s", err.message);
        count_failure(kv);
        drop(kv, (size_t)idx);
        return -1;
    }
    touch(kv, e);
    path_of(kv, e->name, ".idx", path, sizeof path);
    utimensat(AT_FDCWD, path, NULL, 0); /* the index's mtime is the last use */
    return 0;
}

static void disable(srv_kvstore *kv, const char *what, const char *why) {
    srv_log("warning: disk KV store %s: %s failed (%s); caching to disk is off from now on", kv->dir, what, why);
    kv->writable = false;
    count_failure(kv);
}

/* true when a was last used before b: entries not used since the store
 * was opened come first, by their index's mtime; then the uses of this
 * process in order (seconds alone would tie within one second). */
static bool used_before(const kv_entry *a, const kv_entry *b) {
    if ((a->use_seq == 0) != (b->use_seq == 0)) return a->use_seq == 0;
    return a->use_seq ? a->use_seq < b->use_seq : a->last_used < b->last_used;
}

/* Drop the least recently used entries until `incoming` more bytes fit
 * within the limit. */
static void evict(srv_kvstore *kv, int64_t incoming) {
    while (kv->n > 0 && kv->total + incoming > kv->max_bytes) {
        size_t victim = 0;
        for (size_t i = 1; i < kv->n; i++)
            if (used_before(&kv->v[i], &kv->v[victim])) victim = i;
        drop(kv, victim);
    }
}

void srv_kv_save(srv_kvstore *kv, ds4_session *session, const char *text, size_t text_len) {
    if (!kv->writable || !text_len) return;
    uint64_t hash = fnv1a(text, text_len);
    char name[17];
    snprintf(name, sizeof name, "%016llx", (unsigned long long)hash);
    for (size_t i = 0; i < kv->n; i++)
        if (!strcmp(kv->v[i].name, name)) {
            touch(kv, &kv->v[i]);
            return; /* the same conversation prefix is stored already */
        }
    char ckpt[4096], idx[4096], tmp[4200];
    path_of(kv, name, ".ckpt", ckpt, sizeof ckpt);
    path_of(kv, name, ".idx", idx, sizeof idx);
    snprintf(tmp, sizeof tmp, "%s.tmp", idx);
    ds4_error err = { 0 };
    if (ds4_session_save(session, ckpt, &err) != DS4_OK) {
        disable(kv, "writing a checkpoint", err.message);
        return;
    }
    struct stat cs;
    if (stat(ckpt, &cs) != 0) {
        disable(kv, "reading back a checkpoint", strerror(errno));
        unlink(ckpt);
        return;
    }
    int64_t n_tokens = 0;
    ds4_session_tokens(session, &n_tokens);
    chat_buf h = { 0 };
    unsigned char fixed[IDX_SIZE] = { 0 };
    chat_buf_put(&h, (const char *)fixed, sizeof fixed);
    uint32_t n_ids = 0;
    const srv_tool_memory *t = kv->tools;
    for (size_t k = 0; t && t->ids && k < t->n && k < TOOL_IDS_SAVED; k++) {
        size_t slot = (t->head + t->cap - 1 - k) % t->cap;
        const char *id = t->ids[slot], *dsml = t->dsml[slot];
        size_t il = id ? strlen(id) : 0, dl = dsml ? strlen(dsml) : 0;
        if (!il || il > 256 || !dl || !memmem(text, text_len, dsml, dl)) continue;
        unsigned char lens[8];
        put_le(lens, il, 4);
        put_le(lens + 4, dl, 4);
        chat_buf_put(&h, (const char *)lens, 8);
        chat_buf_put(&h, id, il);
        chat_buf_put(&h, dsml, dl);
        n_ids++;
    }
    if (h.oom) {
        chat_buf_free(&h);
        unlink(ckpt);
        return;
    }
    unsigned char *p = (unsigned char *)h.ptr;
    memcpy(p, IDX_MAGIC, 8);
    put_le(p + 8, IDX_VERSION, 4);
    put_le(p + 12, n_ids, 4);
    put_le(p + 16, (uint64_t)n_tokens, 8);
    put_le(p + 24, text_len, 8);
    put_le(p + 32, hash, 8);
    put_le(p + 40, (uint64_t)cs.st_size, 8);
    put_le(p + 48, idx_crc(p, h.len), 4);
    const size_t idx_bytes = h.len;
    if ((int64_t)cs.st_size + (int64_t)idx_bytes > kv->max_bytes) {
        srv_log("disk KV store: a %.1f MiB checkpoint and its index do not fit in the %.0f MiB limit; not stored",
                (double)cs.st_size / 1048576.0, (double)kv->max_bytes / 1048576.0);
        chat_buf_free(&h);
        unlink(ckpt);
        return;
    }
    /* Room first, so that the store's account never passes the limit: on
     * disk, the checkpoint just written is the only file that can have been
     * beyond it, and only until here. */
    evict(kv, (int64_t)cs.st_size + (int64_t)idx_bytes);
    FILE *fp = fopen(tmp, "wb");
    const char *failed = NULL;
    if (!fp) failed = "open";
    else if (fwrite(h.ptr, 1, h.len, fp) != h.len || fflush(fp) != 0) failed = "write";
    else if (fsync(fileno(fp)) != 0) failed = "fsync";
    int e = errno;
    if (fp && fclose(fp) != 0 && !failed) {
        failed = "close";
        e = errno;
    }
    if (!failed && rename(tmp, idx) != 0) {
        failed = "rename";
        e = errno;
    }
    chat_buf_free(&h);
    if (failed) {
        unlink(tmp);
        unlink(ckpt);
        disable(kv, "writing an index", strerror(e));
        return;
    }
    kv_entry entry = { .n_tokens = n_tokens, .text_len = text_len, .text_hash = hash,
                       .bytes = (int64_t)cs.st_size + (int64_t)idx_bytes };
    memcpy(entry.name, name, sizeof name);
    touch(kv, &entry);
    if (push(kv, &entry) != 0) {
        remove_files(kv, name);
        return;
    }
    if (kv->metrics) {
        pthread_mutex_lock(&kv->metrics->mu);
        kv->metrics->disk_saves++;
        pthread_mutex_unlock(&kv->metrics->mu);
    }
}

/* hf_vocab.c - read the vocabulary and merges of a Hugging Face tokenizer.json. */
#include "text/hf_vocab.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"

#define MAX_TOKENIZER_BYTES (512u << 20)
#define MAX_VOCAB (1 << 24)

static char *read_file(const char *path, size_t *len, ds4_error *err) {
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        ds4_error_set(err, DS4_ERR_IO, "%s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    long n = -1;
    if (fseek(fp, 0, SEEK_END) == 0) n = ftell(fp);
    if (n < 0 || (unsigned long)n > MAX_TOKENIZER_BYTES || fseek(fp, 0, SEEK_SET) != 0) {
        ds4_error_set(err, DS4_ERR_FORMAT, "%s: not a readable file of at most %u MiB", path, MAX_TOKENIZER_BYTES >> 20);
    } else if (!(buf = malloc((size_t)n + 1))) {
        ds4_error_set(err, DS4_ERR_NOMEM, "out of memory reading %s", path);
    } else if (fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        ds4_error_set(err, DS4_ERR_IO, "%s: read failed", path);
        free(buf);
        buf = NULL;
    } else {
        buf[n] = '\0';
        *len = (size_t)n;
    }
    fclose(fp);
    return buf;
}

void hf_vocab_free(hf_vocab *v) {
    for (int64_t i = 0; v->tokens && i < v->n_tokens; i++) free(v->tokens[i]);
    for (int64_t i = 0; v->merges && i < v->n_merges; i++) free(v->merges[i]);
    free(v->tokens);
    free(v->types);
    free(v->merges);
    memset(v, 0, sizeof *v);
}

static ds4_status set_token(hf_vocab *v, int64_t id, const char *s, int32_t type, const char *path, ds4_error *err) {
    if (id < 0 || id >= v->n_tokens) return ds4_error_set(err, DS4_ERR_FORMAT, "%s: token id %lld out of range", path,
                                                          (long long)id);
    char *copy = strdup(s);
    if (!copy) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    free(v->tokens[id]);
    v->tokens[id] = copy;
    v->types[id] = type;
    return DS4_OK;
}

static ds4_status load(const cJSON *root, const char *path, hf_vocab *v, ds4_error *err) {
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "BPE"))
        return ds4_error_set(err, DS4_ERR_FORMAT, "%s: model.type must be \"BPE\"", path);
    if (!cJSON_IsObject(vocab) || !cJSON_IsArray(merges))
        return ds4_error_set(err, DS4_ERR_FORMAT, "%s: model.vocab (object) and model.merges (array) are required", path);
    int64_t max_id = -1;
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab) {
        if (!cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble >= MAX_VOCAB || it->valuedouble != (int)it->valuedouble)
            return ds4_error_set(err, DS4_ERR_FORMAT, "%s: vocab entry '%.40s' has a bad id", path, it->string);
        if (it->valueint > max_id) max_id = it->valueint;
    }
    cJSON_ArrayForEach(it, added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "id");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= MAX_VOCAB || !cJSON_IsString(content))
            return ds4_error_set(err, DS4_ERR_FORMAT, "%s: an added_tokens entry lacks a valid id or content", path);
        if (id->valueint > max_id) max_id = id->valueint;
    }
    if (max_id < 0) return ds4_error_set(err, DS4_ERR_FORMAT, "%s: empty vocabulary", path);
    v->n_tokens = max_id + 1;
    v->tokens = calloc((size_t)v->n_tokens, sizeof *v->tokens);
    v->types = calloc((size_t)v->n_tokens, sizeof *v->types);
    if (!v->tokens || !v->types) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    ds4_status st = DS4_OK;
    cJSON_ArrayForEach(it, vocab) {
        if ((st = set_token(v, it->valueint, it->string, HF_TOKEN_NORMAL, path, err))) return st;
    }
    v->bos = v->eos = -1;
    cJSON_ArrayForEach(it, added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "id");
        const char *content = cJSON_GetObjectItemCaseSensitive(it, "content")->valuestring;
        bool special = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(it, "special"));
        if ((st = set_token(v, id->valueint, content, special ? HF_TOKEN_CONTROL : HF_TOKEN_USER_DEFINED, path, err)))
            return st;
        if (!strcmp(content, "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>")) v->bos = id->valueint;
        if (!strcmp(content, "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>")) v->eos = id->valueint;
    }
    for (int64_t i = 0; i < v->n_tokens; i++) {
        if (v->tokens[i]) continue;
        char buf[48];
        snprintf(buf, sizeof buf, "<|unused_%lld|>", (long long)i);
        if ((st = set_token(v, i, buf, HF_TOKEN_UNUSED, path, err))) return st;
    }
    v->n_merges = cJSON_GetArraySize(merges);
    v->merges = calloc((size_t)(v->n_merges ? v->n_merges : 1), sizeof *v->merges);
    if (!v->merges) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
    int64_t k = 0;
    cJSON_ArrayForEach(it, merges) {
        /* "left right", or the newer ["left", "right"] pair form */
        char *m = NULL;
        if (cJSON_IsString(it)) {
            m = strdup(it->valuestring);
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 && cJSON_IsString(cJSON_GetArrayItem(it, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
            const char *a = cJSON_GetArrayItem(it, 0)->valuestring, *b = cJSON_GetArrayItem(it, 1)->valuestring;
            size_t n = strlen(a) + strlen(b) + 2;
            if ((m = malloc(n))) snprintf(m, n, "%s %s", a, b);
        } else {
            return ds4_error_set(err, DS4_ERR_FORMAT, "%s: merge %lld is neither \"a b\" nor [\"a\", \"b\"]", path,
                                 (long long)k);
        }
        if (!m) return ds4_error_set(err, DS4_ERR_NOMEM, "out of memory");
        v->merges[k++] = m;
    }
    return DS4_OK;
}

ds4_status hf_vocab_load(const char *path, hf_vocab *out, ds4_error *err) {
    memset(out, 0, sizeof *out);
    size_t len;
    char *text = read_file(path, &len, err);
    if (!text) return err ? err->status : DS4_ERR_IO;
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!root) return ds4_error_set(err, DS4_ERR_FORMAT, "%s: not valid JSON", path);
    ds4_status st = load(root, path, out, err);
    cJSON_Delete(root);
    if (st) hf_vocab_free(out);
    return st;
}

/*
 * sampling.c - DS4's token sampler (spec 6.1); see sampling.h.
 *
 * Parity notes against ds4.c (sample_argmax, sample_rng_next, sample_rng_f32,
 * sample_full_vocab, sample_top_p_min_p):
 *   - every float expression that decides which token is kept or drawn is the
 *     same expression, evaluated in the same order (sums in id order on the
 *     default and sorted paths, in rank order on the top-k path);
 *   - the default path stores the kept weights instead of recomputing expf in
 *     a second pass (same values, same subtraction order);
 *   - the sorted path drops, before sorting, the candidates the min-p test
 *     rejects, and stops its walk where ds4.c's walk would meet the first of
 *     them in rank order; it then sorts only a rank prefix that holds more
 *     than top_p of the mass, sorting everything if the walk runs past it. The
 *     result is always that of sorting everything (the full-vocabulary sort
 *     costs ~20 ms a token at 129k tokens; the prefix is usually small);
 *   - the sort is a merge sort on (logit desc, id asc) in the scratch, where
 *     ds4.c uses qsort with an unspecified order among equal logits (equal
 *     logits have equal weights, so only which of them is kept at a cut and
 *     the draw order among them can differ from a given ds4.c build);
 *   - a NaN top_p is treated as 1 (spec: "outside (0,1]"); ds4.c would take the
 *     sorted path with no top-p stop.
 */
#include "session/sampling.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/error.h"

ds4_sampler_params ds4_sampler_defaults(void) {
    ds4_sampler_params p;
    p.temperature = 1.0f;
    p.top_p = 1.0f;
    p.min_p = 0.05f;
    p.top_k = 0;
    p.seed = 0;
    return p;
}

/* ------------------------------------------------------------------ RNG */

void ds4_rng_seed(ds4_rng *rng, uint64_t seed) { rng->state = seed; }

uint64_t ds4_rng_next(ds4_rng *rng) {
    uint64_t x = rng->state;
    if (x == 0) x = 0x9e3779b97f4a7c15ULL;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng->state = x;
    return x * 0x2545f4914f6cdd1dULL;
}

float ds4_rng_f32(ds4_rng *rng) {
    const uint64_t x = ds4_rng_next(rng);
    return (float)((x >> 40) & 0xffffffu) / 16777216.0f;
}

uint64_t ds4_sampler_auto_seed(void) {
    return (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)clock();
}

uint64_t ds4_sampler_resolve_seed(uint64_t seed) { return seed ? seed : ds4_sampler_auto_seed(); }

/* -------------------------------------------------------------- scratch */

ds4_status ds4_sample_scratch_init(ds4_sample_scratch *s, int64_t n_vocab, ds4_error *err) {
    if (!s) return ds4_error_set(err, DS4_ERR_INVALID, "sampler scratch: NULL");
    ds4_sample_scratch_free(s);
    if (n_vocab < 1 || n_vocab > INT32_MAX)
        return ds4_error_set(err, DS4_ERR_INVALID, "sampler scratch: n_vocab %lld out of range",
                             (long long)n_vocab);
    s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    s->tmp = malloc((size_t)n_vocab * sizeof *s->tmp);
    if (!s->cand || !s->tmp) {
        ds4_sample_scratch_free(s);
        return ds4_error_set(err, DS4_ERR_NOMEM, "sampler scratch: cannot allocate %lld candidates",
                             (long long)n_vocab);
    }
    s->capacity = n_vocab;
    return DS4_OK;
}

void ds4_sample_scratch_free(ds4_sample_scratch *s) {
    if (!s) return;
    free(s->cand);
    free(s->tmp);
    s->cand = NULL;
    s->tmp = NULL;
    s->capacity = 0;
}

/* ------------------------------------------------------------- internals */

/* What a call decides before any random number: either a fixed token (draw =
 * 0), or a kept list to draw from with r = u * kept_sum (draw = 1), with
 * `token` the fallback when rounding leaves r > 0. */
typedef struct filter_result {
    int draw;
    int32_t token;
    const ds4_sample_cand *kept;
    int64_t n_kept;
    float kept_sum;
} filter_result;

/* sample_argmax: first index of the maximum, starting from -inf with a strict
 * `>` (NaN and -inf never win, +inf does; nothing above -inf gives 0). */
int32_t ds4_sample_argmax(const float *logits, int64_t n) {
    int32_t best = 0;
    float best_v = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        if (logits[i] > best_v) {
            best_v = logits[i];
            best = (int32_t)i;
        }
    }
    return best;
}

/* Rank order: logit descending, then id ascending. */
static int ranks_before(const ds4_sample_cand *a, const ds4_sample_cand *b) {
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

/* Sort a[0..n) into rank order using tmp[0..n); returns whichever of the two
 * buffers holds the result. Bottom-up merge sort over insertion-sorted runs. */
static ds4_sample_cand *sort_rank(ds4_sample_cand *a, ds4_sample_cand *tmp, int64_t n) {
    const int64_t run = 16;
    for (int64_t lo = 0; lo < n; lo += run) {
        const int64_t hi = lo + run < n ? lo + run : n;
        for (int64_t i = lo + 1; i < hi; i++) {
            const ds4_sample_cand c = a[i];
            int64_t j = i;
            while (j > lo && ranks_before(&c, &a[j - 1])) {
                a[j] = a[j - 1];
                j--;
            }
            a[j] = c;
        }
    }
    ds4_sample_cand *src = a, *dst = tmp;
    for (int64_t width = run; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            const int64_t mid = lo + width < n ? lo + width : n;
            const int64_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) dst[k++] = ranks_before(&src[j], &src[i]) ? src[j++] : src[i++];
            while (i < mid) dst[k++] = src[i++];
            while (j < hi) dst[k++] = src[j++];
        }
        ds4_sample_cand *t = src;
        src = dst;
        dst = t;
    }
    return src;
}

/* The min-p / top-p walk over kept[0..n) in rank order (ds4.c's loop); `stop`,
 * if non-NULL, is a candidate the walk must not pass (see sorted path).
 * Returns 1 if the walk stopped before the end of the list, 0 if it ran out. */
static int walk(filter_result *fr, const ds4_sample_cand *c, int64_t n, float sum, float min_p,
                 float top_p, const ds4_sample_cand *stop) {
    const float min_prob = (c[0].weight / sum) * min_p;
    float filtered_sum = 0.0f;
    int64_t filtered = 0;
    int stopped = 0;
    for (int64_t i = 0; i < n; i++) {
        const float p = c[i].weight / sum;
        if (i > 0 && p < min_prob) {
            stopped = 1;
            break;
        }
        if (i > 0 && stop && ranks_before(stop, &c[i])) {
            stopped = 1;
            break;
        }
        filtered_sum += c[i].weight;
        filtered++;
        if (filtered_sum / sum >= top_p) {
            stopped = i + 1 < n;
            break;
        }
    }
    fr->draw = 1;
    fr->kept = c;
    fr->n_kept = filtered;
    fr->kept_sum = filtered_sum;
    fr->token = c[filtered - 1].id;
    return stopped;
}

static void fixed_token(filter_result *fr, int32_t token) {
    fr->draw = 0;
    fr->token = token;
    fr->kept = NULL;
    fr->n_kept = 0;
    fr->kept_sum = 0.0f;
}

/* Bucket of a candidate by d = (max - logit) / T: floor(d * NB / 64) for d
 * below 64 (weights above e^-64), else NB. Non-decreasing as the logit falls. */
static int bucket_of(const ds4_sample_cand *c, float max_logit, float t, int nb) {
    const float d = (max_logit - c->logit) / t;
    if (!(d < 64.0f)) return nb;
    return (int)(d * ((float)nb / 64.0f));
}

static void filter_top_k(filter_result *fr, const float *logits, int64_t n_vocab, float t, int top_k,
                         float top_p, float min_p, ds4_sample_cand *c) {
    if (top_k > DS4_SAMPLER_TOP_K_MAX) top_k = DS4_SAMPLER_TOP_K_MAX;
    if ((int64_t)top_k > n_vocab) top_k = (int)n_vocab;
    /* Insertion into a list sorted by logit descending; a logit equal to the
     * last one of a full list is not inserted, and an insertion goes after the
     * equal logits already there: on ties the lower id ranks first. */
    int n = 0;
    for (int64_t i = 0; i < n_vocab; i++) {
        const float v = logits[i];
        if (!isfinite(v)) continue;
        if (n == top_k && v <= c[n - 1].logit) continue;
        int j = n < top_k ? n++ : n - 1;
        while (j > 0 && c[j - 1].logit < v) {
            c[j] = c[j - 1];
            j--;
        }
        c[j].id = (int32_t)i;
        c[j].logit = v;
    }
    if (n == 0) {
        fixed_token(fr, ds4_sample_argmax(logits, n_vocab));
        return;
    }
    const float max_logit = c[0].logit;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        c[i].weight = expf((c[i].logit - max_logit) / t);
        sum += c[i].weight;
    }
    if (sum <= 0.0f || !isfinite(sum)) {
        fixed_token(fr, c[0].id);
        return;
    }
    walk(fr, c, n, sum, min_p, top_p, NULL);
}

static void filter_full_vocab(filter_result *fr, const float *logits, int64_t n_vocab, float t,
                              float top_p, float min_p, ds4_sample_scratch *s) {
    float max_logit = -INFINITY;
    int32_t best = 0;
    int64_t finite = 0;
    for (int64_t i = 0; i < n_vocab; i++) {
        const float v = logits[i];
        if (!isfinite(v)) continue;
        finite++;
        if (v > max_logit) {
            max_logit = v;
            best = (int32_t)i;
        }
    }
    if (finite == 0) {
        fixed_token(fr, ds4_sample_argmax(logits, n_vocab));
        return;
    }
    ds4_sample_cand *c = s->cand;

    if (top_p >= 1.0f) {
        /* Default path: weights relative to the best token (weight 1), kept in
         * id order, no sort. */
        float sum = 0.0f;
        int64_t n = 0;
        for (int64_t i = 0; i < n_vocab; i++) {
            const float v = logits[i];
            if (!isfinite(v)) continue;
            const float w = expf((v - max_logit) / t);
            if (w < min_p) continue;
            sum += w;
            c[n].id = (int32_t)i;
            c[n].logit = v;
            c[n].weight = w;
            n++;
        }
        if (sum <= 0.0f || !isfinite(sum)) {
            fixed_token(fr, best);
            return;
        }
        fr->draw = 1;
        fr->kept = c;
        fr->n_kept = n;
        fr->kept_sum = sum;
        fr->token = best;
        return;
    }

    /* Sorted path. The sum runs over every finite candidate in id order. */
    float sum = 0.0f, best_w = 0.0f;
    int64_t n = 0;
    for (int64_t i = 0; i < n_vocab; i++) {
        const float v = logits[i];
        if (!isfinite(v)) continue;
        const float w = expf((v - max_logit) / t);
        if ((int32_t)i == best) best_w = w;
        c[n].id = (int32_t)i;
        c[n].logit = v;
        c[n].weight = w;
        n++;
        sum += w;
    }
    if (sum <= 0.0f || !isfinite(sum)) {
        fixed_token(fr, best);
        return;
    }
    /* Rank 0 is `best` (the first maximum). Candidates failing ds4.c's min-p
     * test `w / sum < min_prob` are dropped before the sort; the best-ranked of
     * them is where ds4.c's walk would break, so our walk stops there too. */
    const float min_prob = (best_w / sum) * min_p;
    int64_t m = 0;
    int have_stop = 0;
    ds4_sample_cand stop = { 0, 0.0f, 0.0f };
    for (int64_t i = 0; i < n; i++) {
        const ds4_sample_cand ci = c[i];
        if (ci.id != best && ci.weight / sum < min_prob) {
            if (!have_stop || ci.logit > stop.logit) { /* id order: ties keep the lower id */
                stop = ci;
                have_stop = 1;
            }
            continue;
        }
        c[m++] = ci;
    }
    const ds4_sample_cand *stop_at = have_stop ? &stop : NULL;

    /* Sort only a rank prefix when it is enough. Candidates are bucketed by
     * d = (max - logit) / T, monotone in the logit, so "bucket <= b" is a rank
     * prefix (ties share a bucket); the prefix is the smallest one whose mass
     * (in double) exceeds top_p * sum by a margin. The walk over the sorted
     * prefix is the walk over the full order as long as it stops inside the
     * prefix; if it runs out instead, everything is sorted after all. */
    enum { NB = 1024 };
    double mass[NB + 1];
    memset(mass, 0, sizeof mass);
    for (int64_t i = 0; i < m; i++) mass[bucket_of(&c[i], max_logit, t, NB)] += c[i].weight;
    const double target = (double)top_p * (double)sum * (1.0 + 1e-3);
    double cum = 0.0;
    int cut = NB;
    for (int b = 0; b < NB; b++) {
        cum += mass[b];
        if (cum > target) {
            cut = b;
            break;
        }
    }
    if (cut < NB) {
        int64_t front = 0;
        for (int64_t i = 0; i < m; i++) {
            if (bucket_of(&c[i], max_logit, t, NB) <= cut) {
                const ds4_sample_cand x = c[i];
                c[i] = c[front];
                c[front++] = x;
            }
        }
        /* c[0..front) stays a permutation of the prefix whichever buffer the
         * sort ends in (each merge pass copies all of it), so the full sort
         * below still sees every candidate. */
        if (front < m && walk(fr, sort_rank(c, s->tmp, front), front, sum, min_p, top_p, stop_at)) return;
    }
    walk(fr, sort_rank(c, s->tmp, m), m, sum, min_p, top_p, stop_at);
}

/* Validate, clamp and filter: 0 on success, -1 on invalid arguments. */
static int filter(filter_result *fr, const float *logits, int64_t n_vocab, const ds4_sampler_params *p,
                  ds4_sample_scratch *s) {
    if (!logits || !p || n_vocab < 1 || n_vocab > INT32_MAX) return -1;
    const float t = p->temperature;
    if (t <= 0.0f) {
        fixed_token(fr, ds4_sample_argmax(logits, n_vocab));
        return 0;
    }
    if (!s || !s->cand || !s->tmp || s->capacity < n_vocab) return -1;
    float top_p = p->top_p;
    if (!(top_p > 0.0f && top_p <= 1.0f)) top_p = 1.0f;
    float min_p = p->min_p;
    if (!(min_p > 0.0f)) min_p = 0.0f;
    if (p->top_k > 0)
        filter_top_k(fr, logits, n_vocab, t, p->top_k, top_p, min_p, s->cand);
    else
        filter_full_vocab(fr, logits, n_vocab, t, top_p, min_p, s);
    return 0;
}

int32_t ds4_sample(const float *logits, int64_t n_vocab, const ds4_sampler_params *p, ds4_rng *rng,
                   ds4_sample_scratch *scratch) {
    if (p && !(p->temperature <= 0.0f) && !rng) return -1;
    filter_result fr;
    if (filter(&fr, logits, n_vocab, p, scratch) != 0) return -1;
    if (!fr.draw) return fr.token;
    float r = ds4_rng_f32(rng) * fr.kept_sum;
    for (int64_t i = 0; i < fr.n_kept; i++) {
        r -= fr.kept[i].weight;
        if (r <= 0.0f) return fr.kept[i].id;
    }
    return fr.token;
}

int64_t ds4_sample_filtered(const float *logits, int64_t n_vocab, const ds4_sampler_params *p,
                            ds4_sample_scratch *scratch, int32_t *ids, float *probs, int64_t cap,
                            int *draws) {
    filter_result fr;
    if (draws) *draws = 0;
    if (cap < 0 || (cap > 0 && (!ids || !probs))) return -1;
    if (filter(&fr, logits, n_vocab, p, scratch) != 0) return -1;
    if (draws) *draws = fr.draw;
    if (!fr.draw) {
        if (cap > 0) {
            ids[0] = fr.token;
            probs[0] = 1.0f;
        }
        return 1;
    }
    for (int64_t i = 0; i < fr.n_kept && i < cap; i++) {
        ids[i] = fr.kept[i].id;
        probs[i] = fr.kept[i].weight / fr.kept_sum;
    }
    return fr.n_kept;
}

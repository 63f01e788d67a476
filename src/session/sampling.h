/*
 * sampling.h - DS4's token sampler (spec 6.1), bit for bit.
 *
 * One call of ds4_sample picks one token from a row of logits. The paths, in
 * the order they are tried (all arithmetic float32, sums in the order stated):
 *
 *   temperature <= 0   greedy: the first index of the maximum logit (NaN never
 *                      wins, +inf does; no logit above -inf gives id 0). No
 *                      random number is drawn.
 *   top_k > 0          top-k: the top_k largest finite logits, on equal logits
 *                      the lower id ranks first; weights exp((l - l_max) / T)
 *                      summed in rank order; then the min-p / top-p walk and
 *                      the draw below.
 *   top_p == 1         the default path (top_k <= 0): one pass over the finite
 *                      logits in id order, weight w = exp((l - l_max) / T),
 *                      tokens with w < min_p skipped, r = u * sum, subtract in
 *                      id order, the first id with r <= 0 (fallback: the argmax
 *                      of the finite logits). No sort.
 *   top_p < 1          sorted path (top_k <= 0): all finite candidates ranked
 *                      by logit descending, equal logits by ascending id (ds4.c
 *                      leaves that order to qsort; ours is fixed and matches
 *                      the top-k path). sum of all weights in id order, then
 *                      the walk and draw.
 *
 *   walk: in rank order keep candidate i while i == 0 or
 *         w_i / sum >= (w_0 / sum) * min_p, and stop right after the candidate
 *         whose running kept_sum makes kept_sum / sum >= top_p;
 *   draw: r = u * kept_sum, subtract the kept w_i in rank order, the first
 *         token with r <= 0 (the last kept token if rounding leaves r > 0).
 *
 * Parameter clamping: top_p outside (0, 1] (NaN included) becomes 1; min_p < 0
 * (or NaN) becomes 0; top_k > 1024 becomes 1024, top_k > n_vocab becomes
 * n_vocab, top_k <= 0 means no cap. If no logit is finite the greedy argmax is
 * returned; if the weight sum is 0 or not finite (NaN temperature, every token
 * under min_p on the default path) the best finite token is returned. Neither
 * case draws: a random number is drawn exactly once per sampled token, and only
 * when a draw actually picks among the kept tokens.
 *
 * The RNG is xorshift64* with DS4's constants; u is the top 24 bits of the
 * output's high 32 (bits 40..63) over 2^24. One ds4_rng lives for a whole
 * request or turn.
 */
#ifndef DS4_SESSION_SAMPLING_H
#define DS4_SESSION_SAMPLING_H

#include <stdint.h>

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DS4_SAMPLER_TOP_K_MAX 1024

typedef struct ds4_sampler_params {
    float temperature; /* <= 0: greedy */
    float top_p;       /* (0, 1]; 1 disables */
    float min_p;       /* relative to the best token's probability; 0 disables */
    int top_k;         /* <= 0: no cap */
    uint64_t seed;     /* 0: none given (see ds4_sampler_resolve_seed) */
} ds4_sampler_params;

/* DS4's defaults: temperature 1, top_p 1, min_p 0.05, top_k 0, seed 0. */
ds4_sampler_params ds4_sampler_defaults(void);

/* ------------------------------------------------------------------ RNG */

typedef struct ds4_rng {
    uint64_t state;
} ds4_rng;

/* state = seed (0 is allowed: ds4_rng_next replaces a zero state by
 * 0x9e3779b97f4a7c15 before stepping, as ds4.c does). */
void ds4_rng_seed(ds4_rng *rng, uint64_t seed);

/* xorshift64*: x ^= x >> 12; x ^= x << 25; x ^= x >> 27; state = x;
 * return x * 0x2545f4914f6cdd1d (mod 2^64). */
uint64_t ds4_rng_next(ds4_rng *rng);

/* ((ds4_rng_next() >> 40) & 0xffffff) / 2^24: a float in [0, 1), one step. */
float ds4_rng_f32(ds4_rng *rng);

/* The CLI's seed when none is given: time(NULL) ^ (getpid() << 32) ^ clock(). */
uint64_t ds4_sampler_auto_seed(void);

/* `seed` if non-zero, else ds4_sampler_auto_seed() (the CLI's --seed rule). */
uint64_t ds4_sampler_resolve_seed(uint64_t seed);

/* -------------------------------------------------------------- scratch */

/* One candidate: token id, raw logit and unnormalised weight exp((l-max)/T). */
typedef struct ds4_sample_cand {
    int32_t id;
    float logit;
    float weight;
} ds4_sample_cand;

/*
 * Working memory of the sampler, allocated once per session (two arrays of
 * `capacity` candidates, 24 bytes per vocabulary entry: about 3 MiB for DS4's
 * 129280 tokens) so that sampling a token never allocates. Zero-initialise
 * it (or call ds4_sample_scratch_free on it) before the first init; init on an
 * initialised scratch frees the old buffers first. Not thread-safe: one scratch
 * per concurrent sampler.
 */
typedef struct ds4_sample_scratch {
    int64_t capacity;      /* largest n_vocab the buffers hold */
    ds4_sample_cand *cand; /* capacity entries: candidates / kept list */
    ds4_sample_cand *tmp;  /* capacity entries: merge-sort buffer */
} ds4_sample_scratch;

/* Allocate for vocabularies of up to n_vocab tokens (1 <= n_vocab <= INT32_MAX).
 * DS4_ERR_INVALID or DS4_ERR_NOMEM on failure, leaving the scratch empty. */
ds4_status ds4_sample_scratch_init(ds4_sample_scratch *s, int64_t n_vocab, ds4_error *err);

/* Free the buffers and zero the struct; NULL and repeated calls are fine. */
void ds4_sample_scratch_free(ds4_sample_scratch *s);

/* ------------------------------------------------------------- sampling */

/* Greedy choice, as DS4 makes it: the first index of the largest logit (NaN
 * and -inf never win; when nothing is above -inf, 0). */
int32_t ds4_sample_argmax(const float *logits, int64_t n);

/*
 * Sample one token id in [0, n_vocab) from logits[0 .. n_vocab). Draws from
 * `rng` at most once (see above). `rng` and `scratch` may be NULL only when
 * p->temperature <= 0. Returns -1 for invalid arguments: NULL logits or p,
 * n_vocab outside [1, INT32_MAX], a NULL rng or scratch where one is needed,
 * or scratch->capacity < n_vocab.
 */
int32_t ds4_sample(const float *logits, int64_t n_vocab, const ds4_sampler_params *p, ds4_rng *rng,
                   ds4_sample_scratch *scratch);

/*
 * The distribution ds4_sample draws from: the kept tokens in the order the
 * draw walks them (id order on the default path, rank order otherwise), each
 * with its normalised probability w_i / kept_sum (float32). When the sampler
 * would not draw (greedy, no finite logit, zero or non-finite sum) it is the
 * single returned token with probability 1. Writes min(count, cap) entries to
 * ids / probs (either may be NULL when cap is 0) and returns count, or -1 on
 * the invalid arguments of ds4_sample (a NULL scratch is invalid whenever the
 * sampler would need it). *draws (if non-NULL) is set to 1 when ds4_sample
 * would consume one random number, else 0. Uses no RNG.
 */
int64_t ds4_sample_filtered(const float *logits, int64_t n_vocab, const ds4_sampler_params *p,
                            ds4_sample_scratch *scratch, int32_t *ids, float *probs, int64_t cap,
                            int *draws);

#ifdef __cplusplus
}
#endif

#endif

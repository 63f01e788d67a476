/*
 * test_sampling.c - the token sampler (src/session/sampling.c, spec 6.1).
 *
 * RNG golden values worked out independently (Python big integers, and one
 * step by hand), the greedy and non-finite rules, each path's filtering on
 * small hand-made distributions (boundaries where top_p is reached exactly and
 * min_p is met with equality), a randomised cross-check against a literal
 * reference of the spec (full qsort, two-pass default path, its own RNG),
 * seeded reproducibility with exactly one draw per sampled token, and
 * chi-square tests of the empirical frequencies.
 */
#include <stdlib.h>

#include "session/sampling.h"
#include "test.h"

#define NELEM(a) ((int64_t)(sizeof(a) / sizeof((a)[0])))

static ds4_sampler_params params(float t, int top_k, float top_p, float min_p) {
    ds4_sampler_params p = ds4_sampler_defaults();
    p.temperature = t;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    return p;
}

static ds4_sample_scratch make_scratch(int64_t n) {
    ds4_sample_scratch s = { 0, NULL, NULL };
    ds4_error err;
    CHECK(ds4_sample_scratch_init(&s, n, &err) == DS4_OK);
    return s;
}

/* ------------------------------------------------------------------------ */
/* RNG                                                                       */
/* ------------------------------------------------------------------------ */

static void test_rng_golden(void) {
    /* Seed 1 by hand: x = 1; x ^= x >> 12 -> 1; x ^= x << 25 -> 0x2000001;
     * x ^= x >> 27 -> unchanged. Output = 0x2000001 * M = M + (M << 25). */
    const uint64_t M = 0x2545f4914f6cdd1dULL;
    ds4_rng r;
    ds4_rng_seed(&r, 1);
    CHECK(r.state == 1);
    CHECK(ds4_rng_next(&r) == M + (M << 25));
    CHECK(r.state == 0x2000001ULL);

    /* First four (state, output) pairs, from a Python big-integer transcript
     * of the recurrence. Seed 0 takes the 0x9e3779b97f4a7c15 replacement. */
    static const struct {
        uint64_t seed;
        uint64_t state[4], out[4];
        uint32_t u24[4];
    } G[] = {
        { 1,
          { 0x0000000002000001ULL, 0x0004004000802801ULL, 0x000d004003202803ULL, 0x200340a005480e81ULL },
          { 0x47e4ce4b896cdd1dULL, 0xabcfa6a8e079651dULL, 0xb9d10d8feb731f57ULL, 0x4db418a0bb1b019dULL },
          { 4711630, 11259814, 12177677, 5092376 } },
        { 0,
          { 0x03f721dffe39b342ULL, 0x5830920757d41153ULL, 0x44da53dec8eb16d8ULL, 0xb334115d4185b10dULL },
          { 0x0d83b3e29a21487aULL, 0x54c44c79f1fe9d67ULL, 0xa845f342007a0e78ULL, 0x7d6e0b878a794779ULL },
          { 885683, 5555276, 11027955, 8220171 } },
        { 42,
          { 0x0000000054000020ULL, 0x00a80a8001041022ULL, 0x01fa08005045006eULL, 0x405a97a0a712f12bULL },
          { 0x56ce4ab7719ba3a0ULL, 0xc841eb53ebbb2ddaULL, 0xca466be0c9980276ULL, 0xf1acc7334a7b70dfULL },
          { 5688906, 13124075, 13256299, 15838407 } },
        { 0xdeadbeefcafebabeULL,
          { 0xb6e8500853081684ULL, 0xac4424d4d109be2eULL, 0x817669dbd88997cbULL, 0xfbf4169c9fb6cf2eULL },
          { 0x7d2957bf9f0a80f4ULL, 0x25fca66b84b04136ULL, 0x6fb20db4fe4470ffULL, 0x52f1c1bb81f82e36ULL },
          { 8202583, 2489510, 7320077, 5435841 } },
    };
    for (int g = 0; g < NELEM(G); g++) {
        ds4_rng a, b;
        ds4_rng_seed(&a, G[g].seed);
        ds4_rng_seed(&b, G[g].seed);
        for (int k = 0; k < 4; k++) {
            const uint64_t o = ds4_rng_next(&a);
            CHECK_MSG(o == G[g].out[k], "seed %d step %d", g, k);
            CHECK_MSG(a.state == G[g].state[k], "seed %d step %d", g, k);
            const float u = ds4_rng_f32(&b); /* one step per float */
            CHECK(b.state == a.state);
            CHECK(u == (float)G[g].u24[k] / 16777216.0f);
            CHECK(u >= 0.0f && u < 1.0f);
        }
    }
    /* A zero state behaves as 0x9e3779b97f4a7c15. */
    ds4_rng z, c;
    ds4_rng_seed(&z, 0);
    ds4_rng_seed(&c, 0x9e3779b97f4a7c15ULL);
    for (int k = 0; k < 8; k++) CHECK(ds4_rng_next(&z) == ds4_rng_next(&c));

    CHECK(ds4_sampler_resolve_seed(77) == 77);
    (void)ds4_sampler_auto_seed(); /* time/pid/clock based: only callable */
}

static void test_defaults(void) {
    const ds4_sampler_params p = ds4_sampler_defaults();
    CHECK(p.temperature == 1.0f);
    CHECK(p.top_p == 1.0f);
    CHECK(p.min_p == 0.05f);
    CHECK(p.top_k == 0);
    CHECK(p.seed == 0);
}

/* ------------------------------------------------------------------------ */
/* Greedy and non-finite logits                                              */
/* ------------------------------------------------------------------------ */

static void test_greedy(void) {
    ds4_rng r;
    ds4_rng_seed(&r, 1234);
    const ds4_sampler_params g0 = params(0.0f, 0, 1.0f, 0.05f), gneg = params(-2.0f, 5, 0.5f, 0.5f);
    const float a[] = { 1.0f, 3.0f, -2.0f, 3.0f, 2.9f };
    CHECK_EQ_INT(ds4_sample(a, NELEM(a), &g0, &r, NULL), 1); /* first of the tied maxima */
    CHECK_EQ_INT(ds4_sample(a, NELEM(a), &gneg, NULL, NULL), 1);
    const float b[] = { NAN, 2.0f, INFINITY, INFINITY, NAN };
    CHECK_EQ_INT(ds4_sample(b, NELEM(b), &g0, &r, NULL), 2); /* +inf wins, NaN never */
    const float c[] = { -INFINITY, NAN, -INFINITY };
    CHECK_EQ_INT(ds4_sample(c, NELEM(c), &g0, &r, NULL), 0); /* nothing above -inf */
    const float d[] = { NAN, -INFINITY, -5.0f };
    CHECK_EQ_INT(ds4_sample(d, NELEM(d), &g0, &r, NULL), 2);
    CHECK(r.state == 1234); /* greedy never draws */

    int32_t id;
    float pr;
    int draws = 7;
    ds4_sample_scratch s = make_scratch(8);
    CHECK_EQ_INT(ds4_sample_filtered(a, NELEM(a), &g0, NULL, &id, &pr, 1, &draws), 1);
    CHECK(id == 1 && pr == 1.0f && draws == 0);
    ds4_sample_scratch_free(&s);
}

static void test_nonfinite(void) {
    ds4_sample_scratch s = make_scratch(16);
    ds4_rng r;
    /* No finite logit: the greedy argmax, for every path, without a draw. */
    const float none[] = { NAN, -INFINITY, INFINITY, INFINITY };
    const float none2[] = { NAN, -INFINITY };
    const ds4_sampler_params paths[] = { params(1.0f, 0, 1.0f, 0.05f), params(1.0f, 3, 1.0f, 0.05f),
                                         params(1.0f, 0, 0.9f, 0.05f) };
    for (int k = 0; k < NELEM(paths); k++) {
        ds4_rng_seed(&r, 99);
        CHECK_EQ_INT(ds4_sample(none, NELEM(none), &paths[k], &r, &s), 2);
        CHECK_EQ_INT(ds4_sample(none2, NELEM(none2), &paths[k], &r, &s), 0);
        CHECK(r.state == 99);
    }
    /* Non-finite logits are never sampled; +inf does not take over. */
    const float mix[] = { NAN, 0.0f, INFINITY, -INFINITY, 0.0f, NAN, -1.0f };
    for (int k = 0; k < NELEM(paths); k++) {
        ds4_sampler_params p = paths[k];
        p.min_p = 0.0f;
        ds4_rng_seed(&r, 5 + (uint64_t)k);
        for (int i = 0; i < 2000; i++) {
            const int32_t t = ds4_sample(mix, NELEM(mix), &p, &r, &s);
            CHECK(t == 1 || t == 4 || t == 6);
        }
    }
    /* NaN temperature: sum is NaN -> best finite token, no draw. */
    const ds4_sampler_params pn = params(NAN, 0, 1.0f, 0.0f), pnk = params(NAN, 4, 1.0f, 0.0f);
    ds4_rng_seed(&r, 3);
    CHECK_EQ_INT(ds4_sample(mix, NELEM(mix), &pn, &r, &s), 1);
    CHECK_EQ_INT(ds4_sample(mix, NELEM(mix), &pnk, &r, &s), 1);
    CHECK(r.state == 3);
    /* +inf temperature: every finite token has weight 1. */
    const ds4_sampler_params pi = params(INFINITY, 0, 1.0f, 0.05f);
    int32_t ids[8];
    float pr[8];
    CHECK_EQ_INT(ds4_sample_filtered(mix, NELEM(mix), &pi, &s, ids, pr, 8, NULL), 3);
    CHECK(pr[0] == 1.0f / 3.0f && pr[2] == 1.0f / 3.0f);
    ds4_sample_scratch_free(&s);
}

static void test_invalid_args(void) {
    ds4_sample_scratch s = { 0, NULL, NULL }, small = { 0, NULL, NULL };
    ds4_error err;
    CHECK(ds4_sample_scratch_init(&s, 0, &err) == DS4_ERR_INVALID);
    CHECK(ds4_sample_scratch_init(&s, (int64_t)INT32_MAX + 1, &err) == DS4_ERR_INVALID);
    CHECK(s.cand == NULL && s.capacity == 0);
    CHECK(ds4_sample_scratch_init(&small, 2, &err) == DS4_OK);
    CHECK(ds4_sample_scratch_init(&small, 3, &err) == DS4_OK); /* re-init frees first */
    CHECK(small.capacity == 3);
    const float l[] = { 0.0f, 1.0f, 2.0f, 3.0f };
    const ds4_sampler_params p = ds4_sampler_defaults();
    ds4_rng r;
    ds4_rng_seed(&r, 1);
    CHECK_EQ_INT(ds4_sample(NULL, 4, &p, &r, &small), -1);
    CHECK_EQ_INT(ds4_sample(l, 4, NULL, &r, &small), -1);
    CHECK_EQ_INT(ds4_sample(l, 0, &p, &r, &small), -1);
    CHECK_EQ_INT(ds4_sample(l, 4, &p, NULL, &small), -1);
    CHECK_EQ_INT(ds4_sample(l, 4, &p, &r, NULL), -1);
    CHECK_EQ_INT(ds4_sample(l, 4, &p, &r, &small), -1); /* capacity 3 < 4 */
    const int32_t t = ds4_sample(l, 3, &p, &r, &small);
    CHECK(t >= 0 && t < 3);
    int32_t id;
    float pr;
    CHECK_EQ_INT(ds4_sample_filtered(l, 4, &p, &small, &id, &pr, 1, NULL), -1);
    CHECK_EQ_INT(ds4_sample_filtered(l, 3, &p, &small, NULL, NULL, 1, NULL), -1);
    CHECK_EQ_INT(ds4_sample_filtered(l, 3, &p, &small, NULL, NULL, 0, NULL), 3); /* count only */
    ds4_sample_scratch_free(&small);
    ds4_sample_scratch_free(&small);
    ds4_sample_scratch_free(NULL);
}

/* ------------------------------------------------------------------------ */
/* Filtering on hand-made distributions                                      */
/* ------------------------------------------------------------------------ */

/* Filtered list of (ids, probs) must equal exp_ids (in order) with the
 * probabilities w_i / sum(w) computed here in double from the logits. */
static void check_kept(const float *l, int64_t n, const ds4_sampler_params *p, ds4_sample_scratch *s,
                       const int32_t *exp_ids, int n_exp, int line) {
    int32_t ids[64];
    float pr[64];
    int draws = 0;
    const int64_t got = ds4_sample_filtered(l, n, p, s, ids, pr, 64, &draws);
    CHECK_MSG(got == n_exp, "line %d: %lld kept, expected %d", line, (long long)got, n_exp);
    if (got != n_exp) return;
    double lmax = -INFINITY, wsum = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(l[i]) && l[i] > lmax) lmax = l[i];
    for (int i = 0; i < n_exp; i++) wsum += exp((l[exp_ids[i]] - lmax) / p->temperature);
    for (int i = 0; i < n_exp; i++) {
        CHECK_MSG(ids[i] == exp_ids[i], "line %d: kept[%d] = %d, expected %d", line, i, ids[i], exp_ids[i]);
        const double want = exp((l[exp_ids[i]] - lmax) / p->temperature) / wsum;
        CHECK_MSG(fabs(pr[i] - want) <= 1e-6, "line %d: p[%d] = %.9g, expected %.9g", line, i, pr[i], want);
    }
    CHECK_MSG(draws == 1, "line %d: a sampled token must draw", line);
}

#define KEPT(l, p, s, ...)                                                                        \
    do {                                                                                          \
        const int32_t e_[] = { __VA_ARGS__ };                                                     \
        check_kept((l), NELEM(l), (p), (s), e_, (int)NELEM(e_), __LINE__);                        \
    } while (0)

static void test_filter_default_path(void) {
    ds4_sample_scratch s = make_scratch(16);
    /* weights 1, 1, e^-1, e^-3 = 0.0498 (< 0.05), -, -, 1 */
    const float l[] = { 0.0f, 0.0f, -1.0f, -3.0f, -INFINITY, NAN, 0.0f };
    ds4_sampler_params p = params(1.0f, 0, 1.0f, 0.05f);
    KEPT(l, &p, &s, 0, 1, 2, 6); /* id order */
    p.min_p = 0.0f;
    KEPT(l, &p, &s, 0, 1, 2, 3, 6);
    /* min_p equal to a weight keeps it (skip only on w < min_p). */
    p.min_p = expf((-3.0f - 0.0f) / 1.0f);
    KEPT(l, &p, &s, 0, 1, 2, 3, 6);
    p.min_p = nextafterf(p.min_p, 1.0f);
    KEPT(l, &p, &s, 0, 1, 2, 6);
    /* Temperature divides inside the exponent: at T = 4 the weights are 1,
     * e^-0.25 = .78 and e^-0.75 = .47, all above min_p 0.4. */
    p = params(4.0f, 0, 1.0f, 0.4f);
    KEPT(l, &p, &s, 0, 1, 2, 3, 6);
    p = params(0.5f, 0, 1.0f, 0.05f); /* e^-2 = 0.135 kept, e^-6 dropped */
    KEPT(l, &p, &s, 0, 1, 2, 6);
    /* min_p = 1: only weight-1 tokens; min_p > 1: nothing, so the best token
     * is returned without drawing. */
    p = params(1.0f, 0, 1.0f, 1.0f);
    KEPT(l, &p, &s, 0, 1, 6);
    p.min_p = 1.5f;
    int32_t id;
    float pr;
    int draws = 1;
    CHECK_EQ_INT(ds4_sample_filtered(l, NELEM(l), &p, &s, &id, &pr, 1, &draws), 1);
    CHECK(id == 0 && pr == 1.0f && draws == 0);
    ds4_rng r;
    ds4_rng_seed(&r, 11);
    CHECK_EQ_INT(ds4_sample(l, NELEM(l), &p, &r, &s), 0);
    CHECK(r.state == 11);
    ds4_sample_scratch_free(&s);
}

static void test_filter_top_k(void) {
    ds4_sample_scratch s = make_scratch(2048);
    const float l[] = { 1.0f, 3.0f, 3.0f, 2.0f, 3.0f, 0.0f, NAN, INFINITY, -INFINITY };
    ds4_sampler_params p = params(1.0f, 1, 1.0f, 0.0f);
    KEPT(l, &p, &s, 1); /* one kept: still one draw */
    p.top_k = 2;
    KEPT(l, &p, &s, 1, 2); /* equal logits: lower id first */
    p.top_k = 3;
    KEPT(l, &p, &s, 1, 2, 4);
    p.top_k = 4;
    KEPT(l, &p, &s, 1, 2, 4, 3);
    p.top_k = 100; /* > n_vocab: every finite logit, rank order */
    KEPT(l, &p, &s, 1, 2, 4, 3, 0, 5);
    /* The sum runs over the kept set only: top_k 2 of (0, -1, -2, -3). */
    const float m[] = { -2.0f, 0.0f, -3.0f, -1.0f };
    p.top_k = 2;
    KEPT(m, &p, &s, 1, 3);
    /* min_p relative to the top token: e^-1 = .37, e^-2 = .135, e^-3 = .0498. */
    p = params(1.0f, 4, 1.0f, 0.1f);
    KEPT(m, &p, &s, 1, 3, 0);
    p.min_p = 0.05f;
    KEPT(m, &p, &s, 1, 3, 0);
    p.min_p = 0.04f;
    KEPT(m, &p, &s, 1, 3, 0, 2);
    /* Equal weights: p_i / sum == (p_0 / sum) * 1 exactly, so min_p = 1 keeps
     * all of them and the next float above 1 keeps only the first. */
    const float eq[] = { 0.5f, 0.5f, 0.5f, 0.5f };
    p = params(1.0f, 4, 1.0f, 1.0f);
    KEPT(eq, &p, &s, 0, 1, 2, 3);
    p.min_p = nextafterf(1.0f, 2.0f);
    KEPT(eq, &p, &s, 0);
    /* top_p reached exactly: 2/4 = 0.5 stops after the second token. */
    p = params(1.0f, 4, 0.5f, 0.0f);
    KEPT(eq, &p, &s, 0, 1);
    p.top_p = nextafterf(0.5f, 1.0f);
    KEPT(eq, &p, &s, 0, 1, 2);
    /* top_k above 1024 is capped at 1024 (2000 equal logits: ids 0..1023). */
    float *big = malloc(2000 * sizeof *big);
    int32_t *ids = malloc(2000 * sizeof *ids);
    float *pr = malloc(2000 * sizeof *pr);
    for (int i = 0; i < 2000; i++) big[i] = 1.0f;
    p = params(1.0f, 5000, 1.0f, 0.0f);
    CHECK_EQ_INT(ds4_sample_filtered(big, 2000, &p, &s, ids, pr, 2000, NULL), 1024);
    CHECK(ids[0] == 0 && ids[1023] == 1023);
    p.top_k = 1024;
    CHECK_EQ_INT(ds4_sample_filtered(big, 2000, &p, &s, ids, pr, 2000, NULL), 1024);
    /* Increasing logits: every token is inserted and the list keeps the top. */
    for (int i = 0; i < 2000; i++) big[i] = (float)i * 0.01f;
    p = params(1.0f, 3, 1.0f, 0.0f);
    CHECK_EQ_INT(ds4_sample_filtered(big, 2000, &p, &s, ids, pr, 2000, NULL), 3);
    CHECK(ids[0] == 1999 && ids[1] == 1998 && ids[2] == 1997);
    free(big);
    free(ids);
    free(pr);
    ds4_sample_scratch_free(&s);
}

static void test_filter_top_p(void) {
    ds4_sample_scratch s = make_scratch(16);
    /* Sorted path: rank by logit descending, ties by id. */
    const float l[] = { -2.0f, 0.0f, -1.0f, 0.0f, -3.0f, NAN };
    ds4_sampler_params p = params(1.0f, 0, 0.999f, 0.0f);
    KEPT(l, &p, &s, 1, 3, 2, 0, 4);
    p.min_p = 0.1f; /* e^-2 = .135 stays, e^-3 = .0498 stops the walk */
    KEPT(l, &p, &s, 1, 3, 2, 0);
    p.min_p = 0.2f;
    KEPT(l, &p, &s, 1, 3, 2);
    /* top_p reached exactly: mass computed as the sampler does (sum over all
     * finite in id order; kept sum in rank order). */
    float w[5], sum = 0.0f;
    for (int i = 0; i < 5; i++) {
        w[i] = expf((l[i] - 0.0f) / 1.0f);
        sum += w[i];
    }
    const float two = w[1] + w[3], three = two + w[2];
    p = params(1.0f, 0, two / sum, 0.0f);
    CHECK(p.top_p < 1.0f);
    KEPT(l, &p, &s, 1, 3);
    p.top_p = nextafterf(two / sum, 1.0f);
    KEPT(l, &p, &s, 1, 3, 2);
    p.top_p = three / sum;
    KEPT(l, &p, &s, 1, 3, 2);
    p.top_p = 0.01f; /* the first token alone already reaches it */
    KEPT(l, &p, &s, 1);
    /* Equal weights: 2/4 reaches 0.5 exactly; min_p = 1 is met with equality. */
    const float eq[] = { 0.5f, 0.5f, 0.5f, 0.5f };
    p = params(1.0f, 0, 0.5f, 0.0f);
    KEPT(eq, &p, &s, 0, 1);
    p.top_p = nextafterf(0.5f, 1.0f);
    KEPT(eq, &p, &s, 0, 1, 2);
    p = params(1.0f, 0, 0.9f, 1.0f);
    KEPT(eq, &p, &s, 0, 1, 2, 3);
    p.min_p = nextafterf(1.0f, 2.0f); /* only rank 0, which the walk always keeps */
    KEPT(eq, &p, &s, 0);
    p.min_p = 1.5f;
    KEPT(eq, &p, &s, 0);
    /* The walk stops at the first low-weight candidate even when the rank-0
     * token itself is below min_p: the min-p test is relative to it. */
    const float m[] = { -5.0f, 0.0f, -0.1f, 0.0f };
    p = params(1.0f, 0, 0.95f, 1.0f);
    KEPT(m, &p, &s, 1, 3);
    ds4_sample_scratch_free(&s);
}

static void test_clamping(void) {
    ds4_sample_scratch s = make_scratch(16);
    const float l[] = { -2.0f, 0.0f, -1.0f, 0.0f, -3.0f, -8.0f };
    /* top_p outside (0, 1] -> 1: the default path, id order. */
    const float bad_top_p[] = { 0.0f, -0.5f, 1.5f, INFINITY, NAN };
    for (int k = 0; k < NELEM(bad_top_p); k++) {
        ds4_sampler_params p = params(1.0f, 0, bad_top_p[k], 0.05f);
        KEPT(l, &p, &s, 0, 1, 2, 3); /* e^-3 = 0.0498 < 0.05 */
    }
    /* Negative or NaN min_p -> 0 on every path (e^-8 is kept). */
    const float bad_min_p[] = { -1.0f, NAN, -INFINITY };
    for (int k = 0; k < NELEM(bad_min_p); k++) {
        ds4_sampler_params p = params(1.0f, 0, 1.0f, bad_min_p[k]);
        KEPT(l, &p, &s, 0, 1, 2, 3, 4, 5);
        p.top_k = 6;
        KEPT(l, &p, &s, 1, 3, 2, 0, 4, 5);
        p.top_k = 0;
        p.top_p = 0.99999f;
        KEPT(l, &p, &s, 1, 3, 2, 0, 4, 5);
    }
    /* top_k <= 0 means no cap. */
    ds4_sampler_params p = params(1.0f, -7, 1.0f, 0.0f);
    KEPT(l, &p, &s, 0, 1, 2, 3, 4, 5);
    ds4_sample_scratch_free(&s);
}

/* ------------------------------------------------------------------------ */
/* Reference: the spec, literally (full sort, two passes, own RNG)           */
/* ------------------------------------------------------------------------ */

typedef struct {
    int32_t id;
    float logit, w;
} ref_cand;

static int ref_cmp(const void *a, const void *b) {
    const ref_cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static float ref_u(uint64_t *st) {
    uint64_t x = *st ? *st : 0x9e3779b97f4a7c15ULL;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *st = x;
    return (float)(((x * 0x2545f4914f6cdd1dULL) >> 40) & 0xffffff) / 16777216.0f;
}

static int32_t ref_argmax(const float *l, int n) {
    int32_t b = 0;
    float bv = -INFINITY;
    for (int i = 0; i < n; i++)
        if (l[i] > bv) bv = l[i], b = i;
    return b;
}

/* Returns the token; fills the kept list (ids, normalised probs) and *drew. */
static int32_t ref_sample(const float *l, int n, ds4_sampler_params p, uint64_t *st, ref_cand *c,
                          int32_t *kid, float *kp, int *nk, int *drew) {
    *drew = 0;
    *nk = 0;
    if (p.temperature <= 0.0f) return ref_argmax(l, n);
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) p.top_p = 1.0f;
    if (!(p.min_p >= 0.0f)) p.min_p = 0.0f;
    const float T = p.temperature;
    int m = 0;
    for (int i = 0; i < n; i++)
        if (isfinite(l[i])) c[m].id = i, c[m].logit = l[i], m++;
    if (m == 0) return ref_argmax(l, n);
    float sum = 0.0f;
    if (p.top_k <= 0 && p.top_p == 1.0f) {
        float mx = -INFINITY;
        int32_t best = 0;
        for (int i = 0; i < m; i++)
            if (c[i].logit > mx) mx = c[i].logit, best = c[i].id;
        for (int i = 0; i < m; i++) {
            const float w = expf((c[i].logit - mx) / T);
            if (!(w < p.min_p)) sum += w;
        }
        if (!(sum > 0.0f) || !isfinite(sum)) return best;
        for (int i = 0; i < m; i++) {
            const float w = expf((c[i].logit - mx) / T);
            if (!(w < p.min_p)) kid[*nk] = c[i].id, kp[*nk] = w / sum, (*nk)++;
        }
        *drew = 1;
        float r = ref_u(st) * sum;
        for (int i = 0; i < m; i++) {
            const float w = expf((c[i].logit - mx) / T);
            if (w < p.min_p) continue;
            r -= w;
            if (r <= 0.0f) return c[i].id;
        }
        return best;
    }
    if (p.top_k > 0) {
        int k = p.top_k > 1024 ? 1024 : p.top_k;
        qsort(c, (size_t)m, sizeof *c, ref_cmp);
        if (m > k) m = k;
        for (int i = 0; i < m; i++) c[i].w = expf((c[i].logit - c[0].logit) / T), sum += c[i].w;
    } else {
        float mx = -INFINITY;
        for (int i = 0; i < m; i++)
            if (c[i].logit > mx) mx = c[i].logit;
        for (int i = 0; i < m; i++) c[i].w = expf((c[i].logit - mx) / T), sum += c[i].w; /* id order */
        qsort(c, (size_t)m, sizeof *c, ref_cmp);
    }
    if (!(sum > 0.0f) || !isfinite(sum)) return c[0].id;
    const float min_prob = (c[0].w / sum) * p.min_p;
    float ks = 0.0f;
    int kept = 0;
    for (int i = 0; i < m; i++) {
        if (i > 0 && c[i].w / sum < min_prob) break;
        ks += c[i].w;
        kept++;
        if (ks / sum >= p.top_p) break;
    }
    for (int i = 0; i < kept; i++) kid[i] = c[i].id, kp[i] = c[i].w / ks;
    *nk = kept;
    *drew = 1;
    float r = ref_u(st) * ks;
    for (int i = 0; i < kept; i++) {
        r -= c[i].w;
        if (r <= 0.0f) return c[i].id;
    }
    return c[kept - 1].id;
}

static float pick_f(const float *v, int n) { return v[test_rand_u64() % (uint64_t)n]; }

static void random_logits(float *l, int n) {
    const int mode = (int)(test_rand_u64() % 8);
    for (int i = 0; i < n; i++) {
        const double u = test_rand_uniform();
        if (mode == 0) { /* nothing finite, mostly */
            l[i] = u < 0.5 ? -INFINITY : (u < 0.9 ? NAN : INFINITY);
            continue;
        }
        if (u < 0.04) l[i] = -INFINITY;
        else if (u < 0.06) l[i] = NAN;
        else if (u < 0.065) l[i] = INFINITY;
        else if (mode <= 3) l[i] = (float)((int)(test_rand_uniform() * 24) - 12) * 0.25f; /* ties */
        else l[i] = (float)(test_rand_normal() * (mode == 7 ? 30.0 : 3.0));
    }
}

static void test_reference_crosscheck(void) {
    enum { NMAX = 4000 };
    float *l = malloc(NMAX * sizeof *l);
    ref_cand *c = malloc(NMAX * sizeof *c);
    int32_t *kid = malloc(NMAX * sizeof *kid), *gid = malloc(NMAX * sizeof *gid);
    float *kp = malloc(NMAX * sizeof *kp), *gp = malloc(NMAX * sizeof *gp);
    ds4_sample_scratch s = make_scratch(NMAX);
    static const float temps[] = { 0.0f, -1.0f, 0.05f, 0.3f, 1.0f, 1.0f, 2.5f, NAN, INFINITY };
    static const float top_ps[] = { 1.0f, 1.0f, 1.0f, 0.95f, 0.9f, 0.5f, 0.2f, 0.0f, 1.5f, NAN };
    static const float min_ps[] = { 0.0f, 0.05f, 0.05f, 0.2f, 1.0f, 1.5f, -1.0f, NAN, 0.001f };
    static const int top_ks[] = { 0, 0, 0, -3, 1, 2, 5, 40, 1024, 3000 };
    int mismatches = 0, draws_seen = 0;
    for (int trial = 0; trial < 6000 && mismatches < 10; trial++) {
        const int n = trial % 200 == 0 ? NMAX : 1 + (int)(test_rand_u64() % 300);
        random_logits(l, n);
        ds4_sampler_params p = params(pick_f(temps, NELEM(temps)), top_ks[test_rand_u64() % NELEM(top_ks)],
                                      pick_f(top_ps, NELEM(top_ps)), pick_f(min_ps, NELEM(min_ps)));
        const uint64_t seed = test_rand_u64();
        ds4_rng r;
        ds4_rng_seed(&r, seed);
        uint64_t st = seed;
        for (int step = 0; step < 4; step++) {
            int nk, drew, gdraw;
            const int32_t want = ref_sample(l, n, p, &st, c, kid, kp, &nk, &drew);
            const int64_t gn = ds4_sample_filtered(l, n, &p, &s, gid, gp, NMAX, &gdraw);
            const int32_t got = ds4_sample(l, n, &p, &r, &s);
            int bad = got != want || r.state != st || gdraw != drew;
            if (drew) {
                bad |= gn != nk;
                for (int i = 0; !bad && i < nk; i++) bad |= gid[i] != kid[i] || gp[i] != kp[i];
                draws_seen++;
            } else {
                bad |= gn != 1 || gid[0] != want || gp[0] != 1.0f;
            }
            if (bad) {
                mismatches++;
                CHECK_MSG(0, "trial %d step %d n %d T %g k %d top_p %g min_p %g: got %d want %d, kept %lld/%d",
                          trial, step, n, p.temperature, p.top_k, p.top_p, p.min_p, got, want, (long long)gn, nk);
            }
        }
    }
    CHECK(draws_seen > 5000);
    ds4_sample_scratch_free(&s);
    free(l);
    free(c);
    free(kid);
    free(gid);
    free(kp);
    free(gp);
}

/*
 * The sorted path sorts only a rank prefix holding > top_p of the mass (in
 * double) and falls back to a full sort when the float walk runs past it.
 * Force that: token A (weight 1, last id), B = 400000 tokens of weight 5e-8 and
 * C = 125000 of 4e-8 (lower ids, so the id-order float sum sees them: 1.025).
 * The prefix A+B holds 1.02 > 0.99 * 1.025 * 1.001, but in rank order every
 * B and C weight is absorbed by 1 (< half an ulp), the ratio stays 1/1.025 and
 * the walk never stops: all 525001 tokens are kept.
 */
static void test_sorted_prefix_fallback(void) {
    enum { NB_ = 400000, NC_ = 125000, N = NB_ + NC_ + 1 };
    float *l = malloc(N * sizeof *l), *kp = malloc(N * sizeof *kp), *gp = malloc(N * sizeof *gp);
    int32_t *kid = malloc(N * sizeof *kid), *gid = malloc(N * sizeof *gid);
    ref_cand *c = malloc(N * sizeof *c);
    for (int i = 0; i < N; i++) l[i] = i < NB_ ? logf(5e-8f) : (i < N - 1 ? logf(4e-8f) : 0.0f);
    ds4_sample_scratch s = make_scratch(N);
    const ds4_sampler_params p = params(1.0f, 0, 0.99f, 0.0f);
    const uint64_t seed = test_rand_u64();
    uint64_t st = seed;
    ds4_rng r;
    ds4_rng_seed(&r, seed);
    int nk, drew, gdraw;
    const int32_t want = ref_sample(l, N, p, &st, c, kid, kp, &nk, &drew);
    const int64_t gn = ds4_sample_filtered(l, N, &p, &s, gid, gp, N, &gdraw);
    CHECK_EQ_INT(nk, N);
    CHECK_EQ_INT(gn, N);
    CHECK(drew && gdraw);
    CHECK(gn == nk && memcmp(gid, kid, (size_t)N * sizeof *gid) == 0 && memcmp(gp, kp, (size_t)N * sizeof *gp) == 0);
    CHECK_EQ_INT(ds4_sample(l, N, &p, &r, &s), want);
    CHECK(r.state == st);
    ds4_sample_scratch_free(&s);
    free(l);
    free(kp);
    free(gp);
    free(kid);
    free(gid);
    free(c);
}

/* ------------------------------------------------------------------------ */
/* Reproducibility and draw count                                            */
/* ------------------------------------------------------------------------ */

static void test_seeded_reproducible(void) {
    enum { N = 500, STEPS = 64 };
    float l[N];
    for (int i = 0; i < N; i++) l[i] = (float)(test_rand_normal() * 0.5);
    ds4_sample_scratch s = make_scratch(N);
    const ds4_sampler_params paths[] = { ds4_sampler_defaults(), params(0.8f, 40, 0.9f, 0.05f),
                                         params(1.2f, 0, 0.9f, 0.0f) };
    for (int k = 0; k < NELEM(paths); k++) {
        int32_t a[STEPS], b[STEPS];
        ds4_rng r1, r2, shadow;
        ds4_rng_seed(&r1, 0x1234567ULL);
        ds4_rng_seed(&r2, 0x1234567ULL);
        ds4_rng_seed(&shadow, 0x1234567ULL);
        const ds4_sampler_params greedy = params(0.0f, 0, 1.0f, 0.05f);
        int distinct = 0;
        for (int t = 0; t < STEPS; t++) {
            a[t] = ds4_sample(l, N, &paths[k], &r1, &s);
            (void)ds4_rng_next(&shadow); /* exactly one draw per sampled token */
            CHECK(r1.state == shadow.state);
            CHECK(ds4_sample(l, N, &greedy, &r1, &s) == ds4_sample(l, N, &greedy, NULL, NULL));
            CHECK(r1.state == shadow.state); /* and none per greedy token */
        }
        for (int t = 0; t < STEPS; t++) b[t] = ds4_sample(l, N, &paths[k], &r2, &s);
        CHECK(memcmp(a, b, sizeof a) == 0);
        for (int t = 1; t < STEPS; t++) distinct += a[t] != a[0];
        CHECK(distinct > 0); /* really sampling */
        /* The k-th token depends only on the state after k draws. */
        ds4_rng r3 = { 0 };
        ds4_rng_seed(&r3, 0x1234567ULL);
        for (int t = 0; t < 10; t++) (void)ds4_rng_f32(&r3);
        CHECK_EQ_INT(ds4_sample(l, N, &paths[k], &r3, &s), a[10]);
    }
    ds4_sample_scratch_free(&s);
}

/* ------------------------------------------------------------------------ */
/* Statistics                                                                */
/* ------------------------------------------------------------------------ */

/* Survival function of the chi-square distribution with integer df:
 * Q(df/2, x/2), in closed form (even df: Poisson sum; odd: erfc + sum). */
static double chi2_sf(double x, int df) {
    const double h = x / 2.0;
    if (x <= 0.0) return 1.0;
    double s, t;
    if (df % 2 == 0) {
        t = exp(-h);
        s = t;
        for (int j = 1; j < df / 2; j++) {
            t *= h / j;
            s += t;
        }
    } else {
        s = erfc(sqrt(h));
        t = exp(-h) * sqrt(h) * 2.0 / sqrt(3.14159265358979323846); /* h^(1/2) e^-h / G(3/2) */
        for (int j = 0; j < (df - 1) / 2; j++) {
            s += t;
            t *= h / (j + 1.5);
        }
    }
    return s;
}

static void test_chi2_sf(void) {
    CHECK_NEAR(chi2_sf(3.841458820694124, 1), 0.05, 1e-9);
    CHECK_NEAR(chi2_sf(5.991464547107979, 2), 0.05, 1e-9);
    CHECK_NEAR(chi2_sf(14.067140449340169, 7), 0.05, 1e-9);
    CHECK_NEAR(chi2_sf(24.321886347856854, 7), 0.001, 1e-10);
    CHECK_NEAR(chi2_sf(16.26623619623813, 3), 0.001, 1e-10);
}

/*
 * Fixed distribution at T = 0.8; weights exp((l - 2) / 0.8):
 *   id:      0    1     2     3     4     5      6      7       8     9    10     11
 *   logit:   2    1.5   1.5   1     0.3   -0.5   -1     -4      -inf  NaN  0.9    -8
 *   weight:  1    .535  .535  .287  .119  .0439  .0235  5.5e-4  -     -    .253   3.7e-6
 *
 * Test: 200000 draws; X^2 = sum (O - E)^2 / E over the kept tokens, df =
 * kept - 1; pass while the chi-square p-value Q(df/2, X^2/2) > 1e-7. Under a
 * correct sampler X^2 is asymptotically chi-square(df), so a false failure has
 * probability 1e-7; the smallest expected count here is > 7000, where the
 * multinomial tail is close to the chi-square tail, and the factor-10 margin
 * below the required 1e-6 covers that approximation. The sampler's own bias
 * (u on a 2^-24 grid, float32 sums) moves each probability by < 1e-6, which
 * adds < 200000 * sum(1e-12 / p) < 1e-4 to X^2: negligible. The RNG seed comes
 * from the harness (DS4_TEST_SEED replays it). Tokens outside the kept set
 * must never appear.
 */
static void chi2_case(const ds4_sampler_params *p, const int32_t *kept, int n_kept, int line) {
    static const float L[] = { 2.0f, 1.5f, 1.5f, 1.0f, 0.3f, -0.5f, -1.0f, -4.0f, -INFINITY, NAN, 0.9f, -8.0f };
    enum { V = 12, DRAWS = 200000 };
    ds4_sample_scratch s = make_scratch(V);
    long cnt[V] = { 0 };
    ds4_rng r;
    ds4_rng_seed(&r, test_rand_u64());
    for (int i = 0; i < DRAWS; i++) {
        const int32_t t = ds4_sample(L, V, p, &r, &s);
        if (t >= 0 && t < V) cnt[t]++;
    }
    double wsum = 0.0, x2 = 0.0, emin = 1e30;
    int in[V] = { 0 };
    for (int i = 0; i < n_kept; i++) wsum += exp((L[kept[i]] - 2.0) / p->temperature), in[kept[i]] = 1;
    long total = 0;
    for (int i = 0; i < n_kept; i++) {
        const double e = DRAWS * exp((L[kept[i]] - 2.0) / p->temperature) / wsum;
        if (e < emin) emin = e;
        x2 += (cnt[kept[i]] - e) * (cnt[kept[i]] - e) / e;
        total += cnt[kept[i]];
    }
    const double pv = chi2_sf(x2, n_kept - 1);
    CHECK_MSG(pv > 1e-7, "line %d: chi-square %.2f, df %d, p-value %.3g", line, x2, n_kept - 1, pv);
    CHECK_MSG(emin > 5000.0, "line %d: smallest expected count %.0f", line, emin);
    CHECK_MSG(total == DRAWS, "line %d: %ld draws outside the kept set", line, DRAWS - total);
    for (int i = 0; i < V; i++)
        if (!in[i]) CHECK_MSG(cnt[i] == 0, "line %d: filtered-out token %d drawn %ld times", line, i, cnt[i]);
    ds4_sample_scratch_free(&s);
}

#define CHI2(p, ...)                                                     \
    do {                                                                 \
        const int32_t k_[] = { __VA_ARGS__ };                            \
        chi2_case((p), k_, (int)NELEM(k_), __LINE__);                    \
    } while (0)

static void test_chi2_frequencies(void) {
    /* Default path, min_p 0.05: drops .0439 and below. */
    ds4_sampler_params p = params(0.8f, 0, 1.0f, 0.05f);
    CHI2(&p, 0, 1, 2, 3, 4, 10);
    /* Top-k: the 6 best are 0 1 2 3 10 4; min_p 0.15 stops at 4 (.119). */
    p = params(0.8f, 6, 1.0f, 0.15f);
    CHI2(&p, 0, 1, 2, 3, 10);
    /* Sorted path: cumulative mass .358 .549 .741 .843 .933 .975 >= 0.97. */
    p = params(0.8f, 0, 0.97f, 0.0f);
    CHI2(&p, 0, 1, 2, 3, 10, 4);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_rng_golden),
    TEST_ENTRY(test_defaults),
    TEST_ENTRY(test_greedy),
    TEST_ENTRY(test_nonfinite),
    TEST_ENTRY(test_invalid_args),
    TEST_ENTRY(test_filter_default_path),
    TEST_ENTRY(test_filter_top_k),
    TEST_ENTRY(test_filter_top_p),
    TEST_ENTRY(test_clamping),
    TEST_ENTRY(test_reference_crosscheck),
    TEST_ENTRY(test_sorted_prefix_fallback),
    TEST_ENTRY(test_seeded_reproducible),
    TEST_ENTRY(test_chi2_sf),
    TEST_ENTRY(test_chi2_frequencies),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

/* test.c - runner for the C unit-test harness (see test.h). */
#include "test.h"

#include <stdlib.h>
#include <time.h>

int test_current_failures;
int test_current_skipped;
char test_skip_reason[256];

static uint64_t rng_state;
static uint64_t rng_seed;

uint64_t test_seed(void) { return rng_seed; }

uint64_t test_rand_u64(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1DULL;
}

double test_rand_uniform(void) { return (double)(test_rand_u64() >> 11) * (1.0 / 9007199254740992.0); }

double test_rand_normal(void) {
    double u1 = test_rand_uniform(), u2 = test_rand_uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

int test_main(int argc, char **argv, const test_case *tests) {
    const char *filter = argc > 1 ? argv[1] : NULL;
    const char *env = getenv("DS4_TEST_SEED");
    rng_seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL);
    if (rng_seed == 0) rng_seed = 1;
    fprintf(stderr, "%s: seed %llu (set DS4_TEST_SEED to replay)\n", argv[0], (unsigned long long)rng_seed);
    int passed = 0, failed = 0, skipped = 0;
    for (const test_case *t = tests; t->name; t++) {
        if (filter && !strstr(t->name, filter)) continue;
        rng_state = rng_seed ^ 0x9E3779B97F4A7C15ULL;
        for (const char *c = t->name; *c; c++) rng_state = (rng_state ^ (uint8_t)*c) * 0x100000001B3ULL;
        if (rng_state == 0) rng_state = 1;
        test_current_failures = 0;
        test_current_skipped = 0;
        t->fn();
        if (test_current_failures) {
            fprintf(stderr, "FAIL %s (%d checks)\n", t->name, test_current_failures);
            failed++;
        } else if (test_current_skipped) {
            fprintf(stderr, "SKIP %s: %s\n", t->name, test_skip_reason);
            skipped++;
        } else {
            fprintf(stderr, "ok   %s\n", t->name);
            passed++;
        }
    }
    printf("%s: %d passed, %d failed, %d skipped\n", argv[0], passed, failed, skipped);
    return failed ? 1 : 0;
}

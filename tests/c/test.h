/*
 * test.h - the C unit-test harness.
 *
 * A test is a function `static void name(void)` listed in a table; CHECK*
 * macros record failures (with file:line and the values) and carry on, so one
 * run reports every broken assertion. The runner prints one line per failing
 * check and ends with "N passed, N failed, N skipped"; exit status is 1 on any
 * failure. A test calls TEST_SKIP("why") when this machine cannot run it.
 *
 *   static void test_thing(void) { CHECK(1 + 1 == 2); }
 *   static const test_case TESTS[] = { TEST_ENTRY(test_thing), {0} };
 *   int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }
 */
#ifndef DS4_TEST_H
#define DS4_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef struct test_case {
    const char *name;
    void (*fn)(void);
} test_case;

#define TEST_ENTRY(fn) { #fn, fn }

extern int test_current_failures;
extern int test_current_skipped;
extern char test_skip_reason[256];

#define CHECK(cond)                                                              \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "  FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);    \
            test_current_failures++;                                             \
        }                                                                        \
    } while (0)

#define CHECK_MSG(cond, ...)                                                     \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "  FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                        \
            fputc('\n', stderr);                                                 \
            test_current_failures++;                                             \
        }                                                                        \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                       \
    do {                                                                         \
        long long va_ = (long long)(a), vb_ = (long long)(b);                    \
        if (va_ != vb_) {                                                        \
            fprintf(stderr, "  FAIL %s:%d: %s == %s (%lld != %lld)\n", __FILE__, \
                    __LINE__, #a, #b, va_, vb_);                                 \
            test_current_failures++;                                             \
        }                                                                        \
    } while (0)

#define CHECK_STR(a, b)                                                          \
    do {                                                                         \
        const char *sa_ = (a), *sb_ = (b);                                       \
        if (!sa_ || !sb_ || strcmp(sa_, sb_) != 0) {                             \
            fprintf(stderr, "  FAIL %s:%d: %s == %s (\"%s\" != \"%s\")\n",       \
                    __FILE__, __LINE__, #a, #b, sa_ ? sa_ : "(null)",            \
                    sb_ ? sb_ : "(null)");                                       \
            test_current_failures++;                                             \
        }                                                                        \
    } while (0)

/* |a - b| <= tol; NaN never passes. */
#define CHECK_NEAR(a, b, tol)                                                    \
    do {                                                                         \
        double va_ = (double)(a), vb_ = (double)(b), t_ = (double)(tol);         \
        if (!(fabs(va_ - vb_) <= t_)) {                                          \
            fprintf(stderr, "  FAIL %s:%d: %s ~ %s (%.9g vs %.9g, tol %.3g)\n",  \
                    __FILE__, __LINE__, #a, #b, va_, vb_, t_);                   \
            test_current_failures++;                                             \
        }                                                                        \
    } while (0)

#define TEST_SKIP(...)                                                           \
    do {                                                                         \
        snprintf(test_skip_reason, sizeof test_skip_reason, __VA_ARGS__);        \
        test_current_skipped = 1;                                                \
        return;                                                                  \
    } while (0)

int test_main(int argc, char **argv, const test_case *tests);

/* Deterministic per-test random numbers (xorshift64*); seeded from
 * DS4_TEST_SEED or the clock, and the seed is printed so a failure can be
 * replayed. */
uint64_t test_rand_u64(void);
double test_rand_uniform(void); /* [0, 1) */
double test_rand_normal(void);
uint64_t test_seed(void);

#endif

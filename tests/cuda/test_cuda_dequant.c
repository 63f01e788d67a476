/* test_cuda_dequant.c - the CUDA dequantisation kernels against the CPU
 * reference (traits->dequant_row), bit for bit, plus the error paths.
 *
 * Without a usable CUDA device every test reports itself as skipped. */
#include <stddef.h>
#include <stdlib.h>

#include "backends/cuda/cuda_backend.h"
#include "core/error.h"
#include "core/quant.h"
#include "test.h"

/* ------------------------------------------------------------------------ */
/* Device presence                                                           */
/* ------------------------------------------------------------------------ */

static int gpu_state = -1; /* -1 unknown, 0 none, 1 present */
static char gpu_reason[200]; /* fits TEST_SKIP's 256-byte reason */

static int gpu_present(void) {
    if (gpu_state < 0) {
        ds4_error err = { 0 };
        int n = 0;
        gpu_state = ds4_cuda_probe(&n, &err) == DS4_OK && n > 0;
        size_t len = gpu_state ? 0 : strlen(err.message);
        if (len > sizeof gpu_reason - 1) len = sizeof gpu_reason - 1;
        memcpy(gpu_reason, err.message, len);
        gpu_reason[len] = '\0';
    }
    return gpu_state;
}

#define REQUIRE_GPU()                                                             \
    do {                                                                          \
        if (!gpu_present()) TEST_SKIP("%s", gpu_reason);         \
    } while (0)

/* ------------------------------------------------------------------------ */
/* Random data                                                               */
/* ------------------------------------------------------------------------ */

static void fill_random(uint8_t *p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t r = test_rand_u64();
        memcpy(p + i, &r, 8);
    }
    if (i < n) {
        uint64_t r = test_rand_u64();
        memcpy(p + i, &r, n - i);
    }
}

/* Any finite f16 (normals and subnormals, both signs). */
static uint16_t rand_finite_f16(void) {
    uint16_t h = (uint16_t)test_rand_u64();
    if ((h & 0x7c00u) == 0x7c00u) h &= (uint16_t)~0x4000u; /* exponent 31 (inf/NaN) -> 15 */
    return h;
}

/* Any finite f32 / bf16 (exponent 255 avoided). */
static uint32_t rand_finite_f32_bits(void) {
    uint32_t u = (uint32_t)test_rand_u64();
    if ((u & 0x7f800000u) == 0x7f800000u) u &= ~0x40000000u;
    return u;
}

/* A sane Q8_K scale: +-[2^-30, 2^30), random mantissa. */
static float rand_sane_f32(void) {
    uint64_t r = test_rand_u64();
    uint32_t exp = 97u + (uint32_t)(r % 60u);
    uint32_t u = ((uint32_t)(r >> 8) & 0x807fffffu) | (exp << 23);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void put_u16(uint8_t *p, uint16_t v) { memcpy(p, &v, sizeof v); }

/* Overwrite every float field of the data (n_blocks blocks of `type`) with a
 * finite value: the block scales, or the elements of a plain type. */
static void make_finite(uint32_t type, uint8_t *data, int64_t n_blocks) {
    for (int64_t i = 0; i < n_blocks; i++) {
        switch (type) {
        case DS4_TYPE_F32: {
            uint32_t u = rand_finite_f32_bits();
            memcpy(data + 4 * i, &u, 4);
            break;
        }
        case DS4_TYPE_F16: put_u16(data + 2 * i, rand_finite_f16()); break;
        case DS4_TYPE_BF16: put_u16(data + 2 * i, (uint16_t)(rand_finite_f32_bits() >> 16)); break;
        case DS4_TYPE_Q8_0: put_u16(data + i * 34 + offsetof(ds4_block_q8_0, d), rand_finite_f16()); break;
        case DS4_TYPE_Q2_K:
            put_u16(data + i * 84 + offsetof(ds4_block_q2_K, d), rand_finite_f16());
            put_u16(data + i * 84 + offsetof(ds4_block_q2_K, dmin), rand_finite_f16());
            break;
        case DS4_TYPE_Q4_K:
            put_u16(data + i * 144 + offsetof(ds4_block_q4_K, d), rand_finite_f16());
            put_u16(data + i * 144 + offsetof(ds4_block_q4_K, dmin), rand_finite_f16());
            break;
        case DS4_TYPE_Q5_K:
            put_u16(data + i * 176 + offsetof(ds4_block_q5_K, d), rand_finite_f16());
            put_u16(data + i * 176 + offsetof(ds4_block_q5_K, dmin), rand_finite_f16());
            break;
        case DS4_TYPE_Q6_K: put_u16(data + i * 210 + offsetof(ds4_block_q6_K, d), rand_finite_f16()); break;
        case DS4_TYPE_IQ2_XXS: put_u16(data + i * 66 + offsetof(ds4_block_iq2_xxs, d), rand_finite_f16()); break;
        case DS4_TYPE_Q8_K: {
            float d = rand_sane_f32();
            memcpy(data + i * 292 + offsetof(ds4_block_q8_K, d), &d, sizeof d);
            break;
        }
        default: break;
        }
    }
}

static int is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

/* ------------------------------------------------------------------------ */
/* One comparison run                                                        */
/* ------------------------------------------------------------------------ */

#define GUARD 64             /* poisoned floats either side of the output */
#define POISON 0xffffffffu   /* cudaMemset(0xff): a NaN no dequantiser makes */

/* Dequantise n_rows random rows of `type` on the GPU and the CPU and compare
 * every element bitwise. finite: float fields made finite, exact equality
 * everywhere; otherwise fully random bits, equal up to NaN payload/sign for
 * the block types (arithmetic NaNs differ), exact for F32/F16/BF16 (pure bit
 * conversions). Returns the number of blocks compared (-1 on setup failure). */
static int64_t compare_once(uint32_t type, int64_t n_rows, int64_t row_elems, int finite) {
    const ds4_type_traits *tr = ds4_type_traits_get(type);
    CHECK(tr && tr->dequant_row);
    if (!tr || !tr->dequant_row) return -1;
    const int64_t row_bytes = ds4_type_row_bytes(type, row_elems);
    CHECK(row_bytes > 0);
    if (row_bytes <= 0) return -1;
    const int64_t n = n_rows * row_elems, n_blocks = n / tr->block_elems;
    const size_t src_bytes = (size_t)(n_rows * row_bytes), out_count = (size_t)n + 2 * GUARD;

    uint8_t *src = malloc(src_bytes);
    float *ref = malloc((size_t)n * sizeof(float));
    uint32_t *got = malloc(out_count * sizeof(uint32_t));
    void *d_src = NULL, *d_out = NULL;
    int64_t result = -1;
    ds4_error err = { 0 };
    CHECK(src && ref && got);
    if (!src || !ref || !got) goto done;

    fill_random(src, src_bytes);
    if (finite) make_finite(type, src, n_blocks);
    for (int64_t r = 0; r < n_rows; r++) tr->dequant_row(src + r * row_bytes, ref + r * row_elems, row_elems);

    ds4_status st = ds4_cuda_malloc(&d_src, src_bytes, &err);
    if (st == DS4_OK) st = ds4_cuda_malloc(&d_out, out_count * sizeof(float), &err);
    if (st == DS4_OK) st = ds4_cuda_memcpy_h2d(d_src, src, src_bytes, &err);
    if (st == DS4_OK) st = ds4_cuda_memset(d_out, 0xff, out_count * sizeof(float), &err);
    if (st == DS4_OK) st = ds4_cuda_dequant_rows(type, d_src, (float *)d_out + GUARD, n_rows, row_elems, NULL, &err);
    if (st == DS4_OK) st = ds4_cuda_synchronize(&err);
    if (st == DS4_OK) st = ds4_cuda_memcpy_d2h(got, d_out, out_count * sizeof(float), &err);
    CHECK_MSG(st == DS4_OK, "%s: %s", tr->name, err.message);
    if (st != DS4_OK) goto done;

    int guard_bad = 0;
    for (size_t i = 0; i < GUARD; i++) guard_bad += (got[i] != POISON) + (got[GUARD + (size_t)n + i] != POISON);
    CHECK_MSG(guard_bad == 0, "%s: %d guard floats outside the output were written", tr->name, guard_bad);

    int64_t mismatches = 0;
    const int exact = finite || tr->block_elems == 1;
    for (int64_t i = 0; i < n; i++) {
        uint32_t want;
        memcpy(&want, &ref[i], sizeof want);
        const uint32_t have = got[GUARD + i];
        if (have == want || (!exact && is_nan_bits(have) && is_nan_bits(want))) continue;
        if (mismatches < 8)
            fprintf(stderr, "  %s %s: row %lld elem %lld (block %lld): cpu 0x%08x gpu 0x%08x%s\n", tr->name,
                    finite ? "finite" : "random", (long long)(i / row_elems), (long long)(i % row_elems),
                    (long long)(i / tr->block_elems), want, have, have == POISON ? " (never written)" : "");
        mismatches++;
    }
    CHECK_MSG(mismatches == 0, "%s (%s): %lld of %lld elements differ", tr->name, finite ? "finite" : "random bits",
              (long long)mismatches, (long long)n);
    result = n_blocks;

done:
    ds4_cuda_free(d_src);
    ds4_cuda_free(d_out);
    free(src);
    free(ref);
    free(got);
    return result;
}

/* Several runs of random shapes for a type, both passes; prints the count. */
static void check_type(uint32_t type) {
    REQUIRE_GPU();
    const ds4_type_traits *tr = ds4_type_traits_get(type);
    int64_t blocks[2] = { 0, 0 }, rows[2] = { 0, 0 };
    for (int finite = 1; finite >= 0; finite--) {
        for (int run = 0; run < 4; run++) {
            const int64_t n_rows = 1 + (int64_t)(test_rand_u64() % 7);
            const int64_t row_elems = tr->block_elems == 1 ? 1 + (int64_t)(test_rand_u64() % 3000)
                                                           : tr->block_elems * (1 + (int64_t)(test_rand_u64() % 24));
            const int64_t b = compare_once(type, n_rows, row_elems, finite);
            if (b < 0) return;
            blocks[finite] += b;
            rows[finite] += n_rows;
        }
    }
    fprintf(stderr, "  %-7s %lld blocks in %lld rows compared (finite scales), %lld blocks in %lld rows (random bits)\n",
            tr->name, (long long)blocks[1], (long long)rows[1], (long long)blocks[0], (long long)rows[0]);
}

static void test_dequant_f32(void) { check_type(DS4_TYPE_F32); }
static void test_dequant_f16(void) { check_type(DS4_TYPE_F16); }
static void test_dequant_bf16(void) { check_type(DS4_TYPE_BF16); }
static void test_dequant_q8_0(void) { check_type(DS4_TYPE_Q8_0); }
static void test_dequant_q2_K(void) { check_type(DS4_TYPE_Q2_K); }
static void test_dequant_q4_K(void) { check_type(DS4_TYPE_Q4_K); }
static void test_dequant_q5_K(void) { check_type(DS4_TYPE_Q5_K); }
static void test_dequant_q6_K(void) { check_type(DS4_TYPE_Q6_K); }
static void test_dequant_iq2_xxs(void) { check_type(DS4_TYPE_IQ2_XXS); }
static void test_dequant_q8_K(void) { check_type(DS4_TYPE_Q8_K); }

/* More elements than the kernel's capped grid has threads (65536 * 256), so
 * the grid-stride loop runs more than once per thread. */
static void test_dequant_large(void) {
    REQUIRE_GPU();
    const int64_t b = compare_once(DS4_TYPE_Q4_K, 17, 1 << 20, 1);
    if (b >= 0) fprintf(stderr, "  Q4_K    %lld blocks in 17 rows compared (grid-stride)\n", (long long)b);
}

static const uint32_t SUPPORTED[] = { DS4_TYPE_F32,  DS4_TYPE_F16,  DS4_TYPE_BF16, DS4_TYPE_Q8_0,    DS4_TYPE_Q2_K,
                                      DS4_TYPE_Q4_K, DS4_TYPE_Q5_K, DS4_TYPE_Q6_K, DS4_TYPE_IQ2_XXS, DS4_TYPE_Q8_K };
#define N_SUPPORTED (sizeof SUPPORTED / sizeof SUPPORTED[0])

/* The host-memory convenience against the CPU, every type. */
static void test_dequant_host(void) {
    REQUIRE_GPU();
    for (size_t t = 0; t < N_SUPPORTED; t++) {
        const ds4_type_traits *tr = ds4_type_traits_get(SUPPORTED[t]);
        const int64_t n_rows = 3, row_elems = tr->block_elems == 1 ? 300 : 2 * tr->block_elems;
        const int64_t row_bytes = ds4_type_row_bytes(SUPPORTED[t], row_elems), n = n_rows * row_elems;
        uint8_t *src = malloc((size_t)(n_rows * row_bytes));
        float *ref = malloc((size_t)n * sizeof(float)), *got = malloc((size_t)n * sizeof(float));
        CHECK(src && ref && got);
        if (src && ref && got) {
            fill_random(src, (size_t)(n_rows * row_bytes));
            make_finite(SUPPORTED[t], src, n / tr->block_elems);
            for (int64_t r = 0; r < n_rows; r++) tr->dequant_row(src + r * row_bytes, ref + r * row_elems, row_elems);
            ds4_error err = { 0 };
            ds4_status st = ds4_cuda_dequant_host(SUPPORTED[t], src, got, n_rows, row_elems, &err);
            CHECK_MSG(st == DS4_OK, "%s: %s", tr->name, err.message);
            if (st == DS4_OK) CHECK_MSG(memcmp(ref, got, (size_t)n * sizeof(float)) == 0, "%s: differs", tr->name);
        }
        free(src);
        free(ref);
        free(got);
    }
}

/* ------------------------------------------------------------------------ */
/* Devices and error paths                                                   */
/* ------------------------------------------------------------------------ */

static void test_device_describe(void) {
    REQUIRE_GPU();
    const int n = ds4_cuda_device_count();
    CHECK(n > 0);
    for (int d = 0; d < n; d++) {
        char buf[512];
        ds4_error err = { 0 };
        ds4_status st = ds4_cuda_device_describe(d, buf, sizeof buf, &err);
        CHECK_MSG(st == DS4_OK, "%s", err.message);
        if (st == DS4_OK) {
            CHECK(strlen(buf) > 0);
            fprintf(stderr, "  %s\n", buf);
        }
    }
    char buf[512], tiny[8];
    ds4_error err = { 0 };
    CHECK_EQ_INT(ds4_cuda_device_describe(n, buf, sizeof buf, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_cuda_device_describe(-1, buf, sizeof buf, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_cuda_device_describe(0, NULL, 0, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_cuda_device_describe(0, tiny, sizeof tiny, &err), DS4_ERR_INVALID);
    CHECK(strlen(tiny) == sizeof tiny - 1); /* truncated, terminated */
}

static void test_dequant_errors(void) {
    REQUIRE_GPU();
    ds4_error err = { 0 };
    void *d_src = NULL, *d_dst = NULL;
    const size_t bytes = 4096;
    ds4_status st = ds4_cuda_malloc(&d_src, bytes, &err);
    if (st == DS4_OK) st = ds4_cuda_malloc(&d_dst, bytes * 8, &err);
    if (st == DS4_OK) st = ds4_cuda_memset(d_src, 0, bytes, &err);
    if (st == DS4_OK) st = ds4_cuda_memset(d_dst, 0xff, bytes * 8, &err);
    CHECK_MSG(st == DS4_OK, "%s", err.message);
    if (st != DS4_OK) goto done;
    float *dst = d_dst;

    /* unsupported types: known without a kernel, and unknown ids */
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_Q4_0, d_src, dst, 1, 32, NULL, &err), DS4_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(err.message, "Q4_0") != NULL, "%s", err.message);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_Q3_K, d_src, dst, 1, 256, NULL, &err), DS4_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(err.message, "Q3_K") != NULL, "%s", err.message);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(4, d_src, dst, 1, 32, NULL, &err), DS4_ERR_UNSUPPORTED);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(1000, d_src, dst, 1, 32, NULL, &err), DS4_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(err.message, "1000") != NULL, "%s", err.message);
    CHECK_EQ_INT(ds4_cuda_dequant_host(DS4_TYPE_IQ2_XS, d_src, dst, 1, 256, &err), DS4_ERR_UNSUPPORTED);

    /* row lengths that are not whole blocks, and bad counts */
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_Q4_K, d_src, dst, 1, 100, NULL, &err), DS4_ERR_INVALID);
    CHECK_MSG(strstr(err.message, "multiple") != NULL, "%s", err.message);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_Q8_0, d_src, dst, 2, 33, NULL, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_IQ2_XXS, d_src, dst, 1, 255, NULL, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_cuda_dequant_host(DS4_TYPE_Q6_K, d_src, dst, 1, 300, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_F32, d_src, dst, -1, 4, NULL, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_F32, d_src, dst, 1, -4, NULL, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_Q8_0, d_src, dst, INT64_MAX / 2, 64, NULL, &err), DS4_ERR_INVALID);

    /* pointers: NULL, host memory, misaligned */
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_F32, NULL, dst, 1, 4, NULL, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_F32, d_src, NULL, 1, 4, NULL, &err), DS4_ERR_INVALID);
    {
        float host[64];
        memset(host, 0, sizeof host);
        CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_F32, host, dst, 1, 4, NULL, &err), DS4_ERR_INVALID);
        CHECK_MSG(strstr(err.message, "not device memory") != NULL, "%s", err.message);
        CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_F32, d_src, host, 1, 4, NULL, &err), DS4_ERR_INVALID);
    }
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_F16, (uint8_t *)d_src + 1, dst, 1, 4, NULL, &err), DS4_ERR_INVALID);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_F16, d_src, (float *)((uint8_t *)dst + 2), 1, 4, NULL, &err),
                 DS4_ERR_INVALID);

    /* nothing to do is fine (and writes nothing); NULL err is fine */
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_Q4_K, d_src, dst, 0, 256, NULL, &err), DS4_OK);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_Q4_K, d_src, dst, 5, 0, NULL, &err), DS4_OK);
    CHECK_EQ_INT(ds4_cuda_dequant_host(DS4_TYPE_Q4_K, NULL, NULL, 0, 256, &err), DS4_OK);
    CHECK_EQ_INT(ds4_cuda_dequant_rows(DS4_TYPE_Q4_K, d_src, dst, 1, 100, NULL, NULL), DS4_ERR_INVALID);

    /* after all that, the device still works: 4 all-zero Q8_0 rows -> +0.0 */
    {
        uint32_t out[2 * 128];
        st = ds4_cuda_synchronize(&err);
        CHECK_MSG(st == DS4_OK, "%s", err.message);
        st = ds4_cuda_memcpy_d2h(out, dst, sizeof out, &err);
        CHECK_MSG(st == DS4_OK, "%s", err.message);
        int untouched = 1;
        for (size_t i = 0; i < sizeof out / sizeof out[0]; i++) untouched &= out[i] == POISON;
        CHECK_MSG(untouched, "a failed or empty call wrote to the output");
        st = ds4_cuda_dequant_rows(DS4_TYPE_Q8_0, d_src, dst, 4, 64, NULL, &err);
        CHECK_MSG(st == DS4_OK, "%s", err.message);
        if (st == DS4_OK) st = ds4_cuda_synchronize(&err);
        if (st == DS4_OK) st = ds4_cuda_memcpy_d2h(out, dst, sizeof out, &err);
        CHECK_MSG(st == DS4_OK, "%s", err.message);
        int zeros = 0;
        for (size_t i = 0; i < sizeof out / sizeof out[0]; i++) zeros += out[i] == 0u;
        CHECK_EQ_INT(zeros, 256);
    }
done:
    ds4_cuda_free(d_src);
    ds4_cuda_free(d_dst);
}

static void test_probe(void) {
    REQUIRE_GPU();
    int n = -1;
    ds4_error err = { 0 };
    CHECK_EQ_INT(ds4_cuda_probe(&n, &err), DS4_OK);
    CHECK_EQ_INT(n, ds4_cuda_device_count());
    for (size_t t = 0; t < N_SUPPORTED; t++) CHECK(ds4_cuda_dequant_supported(SUPPORTED[t]));
    CHECK(!ds4_cuda_dequant_supported(DS4_TYPE_Q4_0));
    CHECK(!ds4_cuda_dequant_supported(12345));
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_probe),
    TEST_ENTRY(test_device_describe),
    TEST_ENTRY(test_dequant_f32),
    TEST_ENTRY(test_dequant_f16),
    TEST_ENTRY(test_dequant_bf16),
    TEST_ENTRY(test_dequant_q8_0),
    TEST_ENTRY(test_dequant_q2_K),
    TEST_ENTRY(test_dequant_q4_K),
    TEST_ENTRY(test_dequant_q5_K),
    TEST_ENTRY(test_dequant_q6_K),
    TEST_ENTRY(test_dequant_iq2_xxs),
    TEST_ENTRY(test_dequant_q8_K),
    TEST_ENTRY(test_dequant_large),
    TEST_ENTRY(test_dequant_host),
    TEST_ENTRY(test_dequant_errors),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

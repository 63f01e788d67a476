/* test_cuda_ops.c - the CUDA backend's memory, elementwise, norm, rounding
 * and embedding ops against the CPU backend, element by element.
 *
 * The rounding ops (round_f16, round_fp8_kv, indexer_qat) and the pure
 * copies must be bit-identical; rmsnorm sums squares in double in another
 * order, so it may differ in the last bit of the float scale (rtol 4 ulp).
 * Without a usable CUDA device every test reports itself as skipped. */
#include <stdlib.h>

#include "cuda_op_test.h"

#define OPEN_OR_SKIP(p)                                                           \
    do {                                                                          \
        if (!op_pair_open(p)) TEST_SKIP("%s", op_pair_skip_reason);               \
    } while (0)

static const double ULP4 = 4.8e-7; /* 4 float ulps, relative */

static void test_memory(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const int64_t n = 100003;
    float *h = op_rand(n, 3.0);
    op_buf b = op_buf_from(&p, h, n);
    op_compare("upload/download", &p, b, n, 0, 0);
    /* overlapping copies both ways (memmove semantics) */
    p.cpu->ops->copy(p.cpu, b.c + 7, b.c, n - 7);
    p.gpu->ops->copy(p.gpu, b.g + 7, b.g, n - 7);
    p.cpu->ops->copy(p.cpu, b.c, b.c + 1000, n - 1000);
    p.gpu->ops->copy(p.gpu, b.g, b.g + 1000, n - 1000);
    op_compare("overlapping copy", &p, b, n, 0, 0);
    p.cpu->ops->fill(p.cpu, b.c + 10, -2.5f, 333);
    p.gpu->ops->fill(p.gpu, b.g + 10, -2.5f, 333);
    op_compare("fill", &p, b, n, 0, 0);
    /* alloc zero-fills */
    op_buf z = { p.cpu->ops->alloc(p.cpu, 4097), p.gpu->ops->alloc(p.gpu, 4097) };
    op_compare("alloc zero-fill", &p, z, 4097, 0, 0);
    op_expect_ok(&p);
    op_buf_free(&p, &z);
    op_buf_free(&p, &b);
    free(h);
    op_pair_close(&p);
}

static void test_add_and_rows(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const int64_t dim = 384, rows = 9;
    float *ha = op_rand(dim * rows, 1.0), *hb = op_rand(dim * rows, 1.0), *hw = op_rand(dim * 5, 1.0);
    op_buf a = op_buf_from(&p, ha, dim * rows), b = op_buf_from(&p, hb, dim * rows);
    op_buf out = op_buf_poisoned(&p, dim * rows);
    p.cpu->ops->add(p.cpu, a.c, b.c, out.c, dim * rows);
    p.gpu->ops->add(p.gpu, a.g, b.g, out.g, dim * rows);
    op_compare("add", &p, out, dim * rows, 0, 0);
    /* repeat_rows: the rows into 4 streams (as the embedding into the HC state), and one row */
    op_buf rep = op_buf_poisoned(&p, 4 * dim * rows);
    p.cpu->ops->repeat_rows(p.cpu, rep.c, a.c, rows, dim, 4);
    p.gpu->ops->repeat_rows(p.gpu, rep.g, a.g, rows, dim, 4);
    op_compare("repeat_rows", &p, rep, 4 * dim * rows, 0, 0);
    p.cpu->ops->repeat_rows(p.cpu, rep.c, b.c, 1, dim, 3);
    p.gpu->ops->repeat_rows(p.gpu, rep.g, b.g, 1, dim, 3);
    op_compare("repeat_rows of one row", &p, rep, 4 * dim * rows, 0, 0);
    op_expect_ok(&p);
    p.gpu->ops->repeat_rows(p.gpu, rep.g, a.g, rows, dim, -2);
    op_expect_error(&p, DS4_ERR_INVALID);
    /* copy_rows: every row of a to a scattered place (reversed, odd offsets), the rest kept (-3) */
    if (rows <= 9) {
        float *hfill = malloc((size_t)(4 * dim * rows) * sizeof *hfill);
        for (int64_t i = 0; i < 4 * dim * rows; i++) hfill[i] = -3.0f;
        op_buf sc = op_buf_from(&p, hfill, 4 * dim * rows);
        free(hfill);
        float *dc[9], *dg[9];
        const float *sc_c[9], *sc_g[9];
        for (int64_t r = 0; r < rows; r++) {
            const int64_t at = (rows - 1 - r) * 3 * dim + 7 * r;
            dc[r] = sc.c + at, dg[r] = sc.g + at;
            sc_c[r] = a.c + r * dim, sc_g[r] = a.g + r * dim;
        }
        p.cpu->ops->copy_rows(p.cpu, dc, sc_c, dim, rows);
        p.gpu->ops->copy_rows(p.gpu, dg, sc_g, dim, rows);
        op_compare("copy_rows", &p, sc, 4 * dim * rows, 0, 0);
        op_expect_ok(&p);
        dg[2] = NULL;
        p.gpu->ops->copy_rows(p.gpu, dg, sc_g, dim, rows);
        op_expect_error(&p, DS4_ERR_INVALID);
        op_buf_free(&p, &sc);
    }
    op_buf_free(&p, &rep);
    const uint32_t types[] = { DS4_TYPE_F32, DS4_TYPE_F16, DS4_TYPE_BF16 };
    for (size_t t = 0; t < 3; t++) {
        op_weight *w = op_weight_floats(&p, "ape", types[t], dim, 5, 1, hw);
        p.cpu->ops->add_weight_row(p.cpu, a.c, &w->c, 3, rows);
        p.gpu->ops->add_weight_row(p.gpu, a.g, &w->g, 3, rows);
        op_compare("add_weight_row", &p, a, dim * rows, 0, 0);
        op_expect_ok(&p);
        p.gpu->ops->add_weight_row(p.gpu, a.g, &w->g, 5, rows); /* out of range */
        op_expect_error(&p, DS4_ERR_INVALID);
        /* a run of positions: table rows (first + r) mod 5, around the table more than once */
        for (int64_t first = 0; first < 5; first += 2) {
            p.cpu->ops->add_weight_rows_mod(p.cpu, a.c, &w->c, first, rows);
            p.gpu->ops->add_weight_rows_mod(p.gpu, a.g, &w->g, first, rows);
            op_compare("add_weight_rows_mod", &p, a, dim * rows, 0, 0);
            op_expect_ok(&p);
        }
        p.gpu->ops->add_weight_rows_mod(p.gpu, a.g, &w->g, 5, rows); /* a start outside the table */
        op_expect_error(&p, DS4_ERR_INVALID);
        p.gpu->ops->add_weight_rows_mod(p.gpu, a.g, &w->g, -1, rows);
        op_expect_error(&p, DS4_ERR_INVALID);
        /* rows at positions of their own: table rows in any order, repeated */
        int64_t at[9];
        for (int64_t r = 0; r < rows && r < 9; r++) at[r] = (r * 3 + 4) % 5;
        p.cpu->ops->add_weight_rows_at(p.cpu, a.c, &w->c, at, rows < 9 ? rows : 9);
        p.gpu->ops->add_weight_rows_at(p.gpu, a.g, &w->g, at, rows < 9 ? rows : 9);
        op_compare("add_weight_rows_at", &p, a, dim * rows, 0, 0);
        op_expect_ok(&p);
        at[2] = 5; /* outside the table: refused, nothing changed */
        p.gpu->ops->add_weight_rows_at(p.gpu, a.g, &w->g, at, rows < 9 ? rows : 9);
        op_expect_error(&p, DS4_ERR_INVALID);
        op_compare("add_weight_rows_at refused", &p, a, dim * rows, 0, 0);
        op_weight_free(&p, w);
    }
    op_buf_free(&p, &a);
    op_buf_free(&p, &b);
    op_buf_free(&p, &out);
    free(ha);
    free(hb);
    free(hw);
    op_pair_close(&p);
}

static void test_embed(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const int64_t dim = 256, vocab = 300;
    float *tab = op_rand(dim * vocab, 0.5);
    const uint32_t types[] = { DS4_TYPE_F32, DS4_TYPE_F16, DS4_TYPE_BF16, DS4_TYPE_Q8_0 };
    int32_t tokens[7] = { 0, 299, 5, 5, 123, 42, 1 };
    for (size_t t = 0; t < 4; t++) {
        op_weight *w = op_weight_floats(&p, "token_embd.weight", types[t], dim, vocab, 1, tab);
        op_buf out = op_buf_poisoned(&p, dim * 7);
        p.cpu->ops->embed(p.cpu, &w->c, tokens, 7, out.c);
        p.gpu->ops->embed(p.gpu, &w->g, tokens, 7, out.g);
        op_compare("embed", &p, out, dim * 7, 0, 0);
        op_expect_ok(&p);
        int32_t bad[2] = { 1, 300 };
        p.gpu->ops->embed(p.gpu, &w->g, bad, 2, out.g);
        op_expect_error(&p, DS4_ERR_INVALID);
        op_buf_free(&p, &out);
        op_weight_free(&p, w);
    }
    free(tab);
    op_pair_close(&p);
}

static void test_rmsnorm(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    /* rows kept in registers (dim % 4 == 0, at most 4096: 64 .. 4096, 1000 with idle
     * threads) and rows read twice (33: not float4-aligned, 16384: too long) */
    const int64_t dims[] = { 64, 512, 1000, 4096, 33, 16384 };
    for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++) {
        const int64_t dim = dims[d], rows = 5;
        float *hx = op_rand(dim * rows, 2.0), *hw = op_rand(dim, 1.0);
        op_buf x = op_buf_from(&p, hx, dim * rows), out = op_buf_poisoned(&p, dim * rows);
        p.cpu->ops->rmsnorm(p.cpu, x.c, NULL, 1e-6f, out.c, rows, dim);
        p.gpu->ops->rmsnorm(p.gpu, x.g, NULL, 1e-6f, out.g, rows, dim);
        op_compare("rmsnorm plain", &p, out, dim * rows, 0, ULP4);
        const uint32_t types[] = { DS4_TYPE_F32, DS4_TYPE_F16 };
        for (size_t t = 0; t < 2; t++) {
            op_weight *w = op_weight_floats(&p, "norm", types[t], dim, 1, 1, hw);
            p.cpu->ops->rmsnorm(p.cpu, x.c, &w->c, 1e-6f, out.c, rows, dim);
            p.gpu->ops->rmsnorm(p.gpu, x.g, &w->g, 1e-6f, out.g, rows, dim);
            op_compare("rmsnorm weighted", &p, out, dim * rows, 0, ULP4);
            /* in place */
            op_buf y = op_buf_from(&p, hx, dim * rows);
            p.cpu->ops->rmsnorm(p.cpu, y.c, &w->c, 1e-6f, y.c, rows, dim);
            p.gpu->ops->rmsnorm(p.gpu, y.g, &w->g, 1e-6f, y.g, rows, dim);
            op_compare("rmsnorm in place", &p, y, dim * rows, 0, ULP4);
            op_buf_free(&p, &y);
            op_expect_ok(&p);
            p.gpu->ops->rmsnorm(p.gpu, x.g, &w->g, 1e-6f, out.g, rows, dim + 32); /* width mismatch */
            op_expect_error(&p, DS4_ERR_INVALID);
            op_weight_free(&p, w);
        }
        op_buf_free(&p, &x);
        op_buf_free(&p, &out);
        free(hx);
        free(hw);
    }
    op_pair_close(&p);
}

/* Values that exercise the rounding edges: ties, subnormals, saturation. */
static float *edge_values(int64_t n) {
    float *h = malloc((size_t)n * sizeof *h);
    for (int64_t i = 0; i < n; i++) {
        const uint64_t r = test_rand_u64();
        switch (r % 6) {
        case 0: h[i] = (float)(test_rand_normal() * 1e-3); break;
        case 1: h[i] = (float)(test_rand_normal() * 1e3); break;
        case 2: h[i] = (float)((int)(r >> 8) % 64 - 32) * 0.0625f; break; /* exact ties */
        case 3: h[i] = (float)(test_rand_normal() * 1e5); break;
        case 4: h[i] = (float)(test_rand_normal() * 1e-8); break;
        default: h[i] = (float)test_rand_normal();
        }
    }
    return h;
}

static void test_rounding(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const int64_t rows = 33, dim = 512;
    float *h = edge_values(rows * dim);
    op_buf x = op_buf_from(&p, h, rows * dim);
    p.cpu->ops->round_f16(p.cpu, x.c, rows * dim);
    p.gpu->ops->round_f16(p.gpu, x.g, rows * dim);
    op_compare("round_f16", &p, x, rows * dim, 0, 0);
    op_buf_free(&p, &x);

    const int64_t ropes[] = { 64, 0, 100, 512 };
    for (size_t k = 0; k < 4; k++) {
        x = op_buf_from(&p, h, rows * dim);
        p.cpu->ops->round_fp8_kv(p.cpu, x.c, rows, dim, ropes[k]);
        p.gpu->ops->round_fp8_kv(p.gpu, x.g, rows, dim, ropes[k]);
        op_compare("round_fp8_kv", &p, x, rows * dim, 0, 0);
        op_buf_free(&p, &x);
    }
    const int64_t widths[] = { 128, 512, 32, 4096 };
    for (size_t k = 0; k < 4; k++) {
        const int64_t w = widths[k], r = rows * dim / w;
        x = op_buf_from(&p, h, r * w);
        p.cpu->ops->indexer_qat(p.cpu, x.c, r, w);
        p.gpu->ops->indexer_qat(p.gpu, x.g, r, w);
        op_compare("indexer_qat", &p, x, r * w, 0, 0);
        op_buf_free(&p, &x);
    }
    op_expect_ok(&p);
    x = op_buf_from(&p, h, 96);
    p.gpu->ops->indexer_qat(p.gpu, x.g, 1, 96);
    op_expect_error(&p, DS4_ERR_INVALID);
    p.gpu->ops->round_fp8_kv(p.gpu, x.g, 1, 64, 65);
    op_expect_error(&p, DS4_ERR_INVALID);
    op_buf_free(&p, &x);
    free(h);
    op_pair_close(&p);
}

static void test_weight_bind_errors(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    uint8_t bytes[64] = { 0 };
    ds4_weight w = { "bad", DS4_TYPE_F32, { 16, 1, 1, 1 }, 60, bytes, NULL, NULL }; /* row_bytes wrong */
    ds4_error err = { 0 };
    CHECK(p.gpu->ops->bind_weight(p.gpu, &w, &err) == DS4_ERR_INVALID);
    CHECK(strstr(err.message, "bad") != NULL);
    w.row_bytes = 64;
    w.host = NULL;
    CHECK(p.gpu->ops->bind_weight(p.gpu, &w, &err) == DS4_ERR_INVALID);
    w.host = bytes;
    CHECK(p.gpu->ops->bind_weight(p.gpu, &w, &err) == DS4_OK);
    CHECK(w.device != NULL);
    CHECK(ds4_cuda_backend_weight_bytes(p.gpu) == 64);
    p.gpu->ops->release_weight(p.gpu, &w);
    CHECK(w.device == NULL);
    CHECK(ds4_cuda_backend_weight_bytes(p.gpu) == 0);
    CHECK(ds4_cuda_backend_peak_bytes(p.gpu) > 0);
    /* a large weight goes through the staging buffers in several pieces */
    const int64_t n = (int64_t)40 << 20; /* 160 MiB of F32 */
    float *big = malloc((size_t)n * sizeof *big);
    for (int64_t i = 0; i < n; i++) big[i] = (float)(i % 1000003);
    ds4_weight wb = { "big", DS4_TYPE_F32, { 1 << 20, 40, 1, 1 }, 4 << 20, big, NULL, NULL };
    CHECK(p.gpu->ops->bind_weight(p.gpu, &wb, &err) == DS4_OK);
    float *back = malloc((size_t)n * sizeof *back);
    p.gpu->ops->download(p.gpu, back, wb.device, n);
    CHECK(memcmp(back, big, (size_t)n * sizeof *big) == 0);
    op_expect_ok(&p);
    p.gpu->ops->release_weight(p.gpu, &wb);
    free(big);
    free(back);
    op_pair_close(&p);
}

/* Synthetic weights: the device makes exactly the bytes the CPU makes from
 * the same fill (every type of the generator, sizes that are not a whole
 * number of kernel blocks), the weight counts as bound device memory, and
 * an integer table is made on the host. A fill of another type is refused. */
static void test_bind_synthetic(void) {
    op_pair p;
    OPEN_OR_SKIP(&p);
    const uint32_t types[] = { DS4_TYPE_F32, DS4_TYPE_F16, DS4_TYPE_Q8_0, DS4_TYPE_Q2_K, DS4_TYPE_Q4_K,
                               DS4_TYPE_IQ2_XXS };
    ds4_error err = { 0 };
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        const ds4_type_traits *t = ds4_type_traits_get(types[k]);
        const int64_t n = 512, rows = 333; /* 333 rows: the last kernel block is partial */
        ds4_fill f;
        memset(&f, 0, sizeof f);
        f.stream = 0x1234567ull + k;
        f.type = types[k];
        f.block_bytes = t->block_bytes;
        f.block_elems = t->block_elems;
        f.center = 0.25f;
        f.half = 0.5f;
        f.f16_exp = 14;
        f.d16[0] = 0x2000;
        f.d16[1] = 0x1c00;
        ds4_weight wc = { "synthetic", types[k], { n, rows, 1, 1 }, ds4_type_row_bytes(types[k], n), NULL, NULL, NULL };
        ds4_weight wg = wc;
        CHECK(p.cpu->ops->bind_synthetic(p.cpu, &wc, &f, &err) == DS4_OK);
        CHECK_MSG(p.gpu->ops->bind_synthetic(p.gpu, &wg, &f, &err) == DS4_OK, "%s: %s", t->name, err.message);
        if (!wc.host || !wg.device) continue;
        const size_t bytes = (size_t)(wc.row_bytes * rows);
        CHECK(ds4_cuda_backend_weight_bytes(p.gpu) == bytes);
        uint8_t *back = malloc(bytes + 16);
        p.gpu->ops->download(p.gpu, (float *)back, wg.device, (int64_t)(bytes / 4));
        op_expect_ok(&p);
        CHECK_MSG(memcmp(back, wc.host, bytes) == 0, "%s: device bytes differ from the host's", t->name);
        free(back);
        p.cpu->ops->release_weight(p.cpu, &wc);
        p.gpu->ops->release_weight(p.gpu, &wg);
        CHECK(ds4_cuda_backend_weight_bytes(p.gpu) == 0);
    }
    ds4_fill ids;
    memset(&ids, 0, sizeof ids);
    ids.stream = 99;
    ids.type = DS4_TYPE_I32;
    ids.block_bytes = 4;
    ids.block_elems = 1;
    ids.id_mod = 16;
    ids.id_per_row = 6;
    ds4_weight wi = { "ids", DS4_TYPE_I32, { 6, 100, 1, 1 }, 24, NULL, NULL, NULL };
    CHECK(p.gpu->ops->bind_synthetic(p.gpu, &wi, &ids, &err) == DS4_OK);
    CHECK(wi.host != NULL && wi.owned == wi.host && wi.device == NULL);
    p.gpu->ops->release_weight(p.gpu, &wi);
    CHECK(wi.host == NULL && wi.owned == NULL);
    ds4_fill bad = ids;
    bad.type = DS4_TYPE_Q8_0;
    ds4_weight wq = { "mismatch", DS4_TYPE_F32, { 64, 2, 1, 1 }, 256, NULL, NULL, NULL };
    CHECK(p.gpu->ops->bind_synthetic(p.gpu, &wq, &bad, &err) == DS4_ERR_INVALID);
    CHECK(strstr(err.message, "mismatch") != NULL && wq.device == NULL);
    op_pair_close(&p);
}

static void test_backend_names(void) {
    ds4_backend *be = NULL;
    ds4_error err = { 0 };
    CHECK(ds4_backend_create("cuda:x", 0, &be, &err) == DS4_ERR_INVALID);
    CHECK(be == NULL);
    CHECK(ds4_backend_create("cuda:999", 0, &be, &err) != DS4_OK);
    CHECK(be == NULL);
    CHECK(ds4_backend_create("cudax", 0, &be, &err) == DS4_ERR_INVALID);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_memory),   TEST_ENTRY(test_add_and_rows), TEST_ENTRY(test_embed),
    TEST_ENTRY(test_rmsnorm),  TEST_ENTRY(test_rounding),     TEST_ENTRY(test_weight_bind_errors),
    TEST_ENTRY(test_bind_synthetic), TEST_ENTRY(test_backend_names), { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

/*
 * test_quant.c - the quant block formats (src/core/quant*.c).
 *
 * Bit-exactness of dequantisation against gguf-py is checked by the Python
 * oracle; here we check the type table, the scalar conversions exhaustively
 * against slow independent references, hand-built blocks whose values are
 * worked out from the format description, the dot products against float64
 * references with derived error bounds, and the reference quantisers' error.
 */
#include <stddef.h>
#include <stdlib.h>

#include "core/quant.h"
#include "test.h"

#define U24 (1.0 / 16777216.0) /* 2^-24: unit roundoff of float32 */

static uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ------------------------------------------------------------------------ */
/* Type table                                                                */
/* ------------------------------------------------------------------------ */

static const struct {
    uint32_t id;
    const char *name;
    int elems, bytes;
} EXPECTED[] = {
    { 0, "F32", 1, 4 },        { 1, "F16", 1, 2 },          { 2, "Q4_0", 32, 18 },
    { 3, "Q4_1", 32, 20 },     { 6, "Q5_0", 32, 22 },       { 7, "Q5_1", 32, 24 },
    { 8, "Q8_0", 32, 34 },     { 9, "Q8_1", 32, 36 },       { 10, "Q2_K", 256, 84 },
    { 11, "Q3_K", 256, 110 },  { 12, "Q4_K", 256, 144 },    { 13, "Q5_K", 256, 176 },
    { 14, "Q6_K", 256, 210 },  { 15, "Q8_K", 256, 292 },    { 16, "IQ2_XXS", 256, 66 },
    { 17, "IQ2_XS", 256, 74 }, { 18, "IQ3_XXS", 256, 98 },  { 19, "IQ1_S", 256, 50 },
    { 20, "IQ4_NL", 32, 18 },  { 21, "IQ3_S", 256, 110 },   { 22, "IQ2_S", 256, 82 },
    { 23, "IQ4_XS", 256, 136 }, { 24, "I8", 1, 1 },         { 25, "I16", 1, 2 },
    { 26, "I32", 1, 4 },       { 27, "I64", 1, 8 },         { 28, "F64", 1, 8 },
    { 29, "IQ1_M", 256, 56 },  { 30, "BF16", 1, 2 },        { 34, "TQ1_0", 256, 54 },
    { 35, "TQ2_0", 256, 66 },  { 39, "MXFP4", 32, 17 },
};
#define N_EXPECTED ((int)(sizeof EXPECTED / sizeof EXPECTED[0]))

/* The types with all four row functions. */
static const uint32_t IMPL[] = {
    DS4_TYPE_F32,  DS4_TYPE_F16,  DS4_TYPE_BF16, DS4_TYPE_Q8_0,    DS4_TYPE_Q2_K,
    DS4_TYPE_Q4_K, DS4_TYPE_Q5_K, DS4_TYPE_Q6_K, DS4_TYPE_IQ2_XXS, DS4_TYPE_Q8_K,
};
#define N_IMPL ((int)(sizeof IMPL / sizeof IMPL[0]))

static void test_traits_table(void) {
    for (int i = 0; i < N_EXPECTED; i++) {
        const ds4_type_traits *t = ds4_type_traits_get(EXPECTED[i].id);
        CHECK_MSG(t != NULL, "type %u", EXPECTED[i].id);
        if (!t) continue;
        CHECK_STR(t->name, EXPECTED[i].name);
        CHECK_EQ_INT(t->block_elems, EXPECTED[i].elems);
        CHECK_EQ_INT(t->block_bytes, EXPECTED[i].bytes);
        CHECK_STR(ds4_type_name(EXPECTED[i].id), EXPECTED[i].name);
        CHECK_EQ_INT(ds4_type_from_name(EXPECTED[i].name), EXPECTED[i].id);
    }
    /* Every id below DS4_TYPE_COUNT not in the list is unknown, and beyond. */
    int known = 0;
    for (uint32_t id = 0; id < 64; id++) {
        if (ds4_type_traits_get(id)) known++;
    }
    CHECK_EQ_INT(known, N_EXPECTED);
    const uint32_t unknown[] = { 4, 5, 31, 32, 33, 36, 37, 38, 40, 41, 1000, 0xffffffffu };
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        CHECK(ds4_type_traits_get(unknown[i]) == NULL);
        CHECK_STR(ds4_type_name(unknown[i]), "unknown");
        CHECK_EQ_INT(ds4_type_row_bytes(unknown[i], 256), -1);
    }
    for (int i = 0; i < N_IMPL; i++) {
        const ds4_type_traits *t = ds4_type_traits_get(IMPL[i]);
        CHECK_MSG(t && t->dequant_row && t->quantize_row && t->dot_f32 && t->dot_q8_K, "%s",
                  ds4_type_name(IMPL[i]));
    }
    CHECK(ds4_type_traits_get(DS4_TYPE_Q4_0)->dequant_row == NULL);

    CHECK_EQ_INT(ds4_type_from_name("q8_0"), DS4_TYPE_Q8_0);
    CHECK_EQ_INT(ds4_type_from_name("iq2_XXs"), DS4_TYPE_IQ2_XXS);
    CHECK_EQ_INT(ds4_type_from_name("bf16"), DS4_TYPE_BF16);
    CHECK_EQ_INT(ds4_type_from_name("Q8"), -1);
    CHECK_EQ_INT(ds4_type_from_name("Q8_0 "), -1);
    CHECK_EQ_INT(ds4_type_from_name(""), -1);
    CHECK_EQ_INT(ds4_type_from_name("unknown"), -1);
    CHECK_EQ_INT(ds4_type_from_name(NULL), -1);
}

static void test_block_sizes(void) {
    CHECK_EQ_INT(sizeof(ds4_block_q8_0), ds4_type_traits_get(DS4_TYPE_Q8_0)->block_bytes);
    CHECK_EQ_INT(sizeof(ds4_block_q2_K), ds4_type_traits_get(DS4_TYPE_Q2_K)->block_bytes);
    CHECK_EQ_INT(sizeof(ds4_block_q4_K), ds4_type_traits_get(DS4_TYPE_Q4_K)->block_bytes);
    CHECK_EQ_INT(sizeof(ds4_block_q5_K), ds4_type_traits_get(DS4_TYPE_Q5_K)->block_bytes);
    CHECK_EQ_INT(sizeof(ds4_block_q6_K), ds4_type_traits_get(DS4_TYPE_Q6_K)->block_bytes);
    CHECK_EQ_INT(sizeof(ds4_block_iq2_xxs), ds4_type_traits_get(DS4_TYPE_IQ2_XXS)->block_bytes);
    CHECK_EQ_INT(sizeof(ds4_block_q8_K), ds4_type_traits_get(DS4_TYPE_Q8_K)->block_bytes);
    CHECK_EQ_INT(ds4_type_traits_get(DS4_TYPE_Q8_0)->block_elems, DS4_QK8_0);
    CHECK_EQ_INT(ds4_type_traits_get(DS4_TYPE_Q4_K)->block_elems, DS4_QK_K);
}

static void test_row_bytes(void) {
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_Q4_K, 0), 0);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_Q4_K, 256), 144);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_Q4_K, 4096), 16 * 144);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_Q4_K, 100), -1);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_Q4_K, -256), -1);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_Q8_0, 64), 68);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_Q8_0, 48), -1);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_F32, 7), 28);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_F32, -1), -1);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_I8, INT64_MAX), INT64_MAX);
    /* overflow: blocks * block_bytes must fit in int64 */
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_F32, INT64_MAX / 4), (INT64_MAX / 4) * 4);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_F32, INT64_MAX / 4 + 1), -1);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_Q8_K, INT64_MAX - INT64_MAX % 256), -1);
    CHECK_EQ_INT(ds4_type_row_bytes(DS4_TYPE_Q8_0, INT64_MAX / 32 * 32), -1);
}

/* ------------------------------------------------------------------------ */
/* Scalar conversions                                                        */
/* ------------------------------------------------------------------------ */

/* Slow reference: the value of a binary16 from its fields, by ldexp. */
static double ref_f16_value(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp((double)m, -24) : ldexp((double)(1024 + m), e - 25);
    return (h & 0x8000) ? -v : v;
}

static void test_f16_to_f32_exhaustive(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = ds4_f16_to_f32((uint16_t)h);
        const uint32_t u = f2u(f);
        const int exp = (h >> 10) & 31, mant = h & 1023;
        const int neg = (h & 0x8000) != 0;
        int ok = ((u >> 31) != 0) == neg;
        if (exp == 31 && mant == 0) {
            ok = ok && isinf(f);
        } else if (exp == 31) { /* NaN keeps its payload at the top */
            ok = ok && isnan(f) && (u & 0x7fffffu) == ((uint32_t)mant << 13);
        } else {
            ok = ok && (double)f == ref_f16_value((uint16_t)h); /* also -0 via the sign check */
        }
        if (!ok && bad++ < 5) CHECK_MSG(ok, "h=0x%04x -> 0x%08x", h, u);
    }
    CHECK_EQ_INT(bad, 0);
}

static void test_bf16_to_f32_exhaustive(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = ds4_bf16_to_f32((uint16_t)h);
        const int exp = (h >> 7) & 255, mant = h & 127;
        const int neg = (h & 0x8000) != 0;
        int ok = ((f2u(f) >> 31) != 0) == neg;
        if (exp == 255 && mant == 0) {
            ok = ok && isinf(f);
        } else if (exp == 255) {
            ok = ok && isnan(f) && (f2u(f) & 0x7fffffu) == ((uint32_t)mant << 16);
        } else {
            double v = exp == 0 ? ldexp((double)mant, -133) : ldexp((double)(128 + mant), exp - 134);
            ok = ok && (double)f == (neg ? -v : v);
        }
        if (!ok && bad++ < 5) CHECK_MSG(ok, "bf16=0x%04x -> 0x%08x", h, f2u(f));
    }
    CHECK_EQ_INT(bad, 0);
}

/*
 * f32 -> f16: every f16 value round-trips; for every pair of neighbours (both
 * signs, incl. the step from the largest finite to the overflow threshold)
 * the exact midpoint goes to the even one and the floats just either side of
 * it go to the nearer one; then random floats are checked to land on a
 * nearest f16 (by double distances to the neighbours).
 */
static void test_f32_to_f16_rounding(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        if (((h >> 10) & 31) == 31 && (h & 1023)) continue; /* NaN: below */
        if (ds4_f32_to_f16(ds4_f16_to_f32((uint16_t)h)) != h && bad++ < 5) CHECK_MSG(0, "h=0x%04x", h);
    }
    for (uint32_t mag = 0; mag < 0x7c00; mag++) {
        for (uint32_t sign = 0; sign <= 0x8000; sign += 0x8000) {
            const uint16_t lo = (uint16_t)(sign | mag), hi = (uint16_t)(sign | (mag + 1));
            /* the value above 65504 is the overflow threshold 65520: "rounds to" inf */
            const double vlo = ref_f16_value(lo);
            const double vhi = mag + 1 == 0x7c00 ? (sign ? -65536.0 : 65536.0) : ref_f16_value(hi);
            const float mid = (float)((vlo + vhi) / 2); /* exact: 12 significant bits */
            const uint16_t even = (mag & 1) ? hi : lo;
            if (ds4_f32_to_f16(mid) != even && bad++ < 5) CHECK_MSG(0, "tie after 0x%04x", lo);
            const float below = nextafterf(mid, (float)vlo), above = nextafterf(mid, (float)vhi);
            if (ds4_f32_to_f16(below) != lo && bad++ < 5) CHECK_MSG(0, "below tie 0x%04x", lo);
            if (ds4_f32_to_f16(above) != hi && bad++ < 5) CHECK_MSG(0, "above tie 0x%04x", lo);
        }
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(ds4_f32_to_f16(65504.0f), 0x7bff);
    CHECK_EQ_INT(ds4_f32_to_f16(65519.996f), 0x7bff);
    CHECK_EQ_INT(ds4_f32_to_f16(65520.0f), 0x7c00);
    CHECK_EQ_INT(ds4_f32_to_f16(1e30f), 0x7c00);
    CHECK_EQ_INT(ds4_f32_to_f16(-1e30f), 0xfc00);
    CHECK_EQ_INT(ds4_f32_to_f16(INFINITY), 0x7c00);
    CHECK_EQ_INT(ds4_f32_to_f16(-INFINITY), 0xfc00);
    CHECK_EQ_INT(ds4_f32_to_f16(0x1p-24f), 0x0001);
    CHECK_EQ_INT(ds4_f32_to_f16(0x1p-25f), 0x0000);         /* tie -> even (0) */
    CHECK_EQ_INT(ds4_f32_to_f16(0x1.000002p-25f), 0x0001); /* just above the tie */
    CHECK_EQ_INT(ds4_f32_to_f16(0x1.8p-24f), 0x0002);       /* tie 1.5 -> 2 */
    CHECK_EQ_INT(ds4_f32_to_f16(-0.0f), 0x8000);
    CHECK_EQ_INT(ds4_f32_to_f16(1e-30f), 0x0000);
    /* NaN: sign and top payload bits kept; payload never collapses to inf */
    CHECK_EQ_INT(ds4_f32_to_f16(u2f(0x7fc00000u)), 0x7e00);
    CHECK_EQ_INT(ds4_f32_to_f16(u2f(0xffc00000u)), 0xfe00);
    CHECK_EQ_INT(ds4_f32_to_f16(u2f(0x7f800001u)), 0x7c01);
    CHECK_EQ_INT(ds4_f32_to_f16(u2f(0x7f812345u)), 0x7c09);

    int rbad = 0;
    for (int i = 0; i < 200000; i++) {
        /* random finite floats spread over the f16 range and beyond */
        float f = u2f((uint32_t)test_rand_u64());
        if (!isfinite(f)) continue;
        const uint16_t h = ds4_f32_to_f16(f);
        const double v = f;
        if (fabs(v) >= 65520.0) {
            if ((h & 0x7fff) != 0x7c00 && rbad++ < 5) CHECK_MSG(0, "overflow %g", v);
            continue;
        }
        const double e0 = fabs(ref_f16_value(h) - v);
        const uint16_t mag = h & 0x7fff;
        /* the neighbours of h in magnitude (same sign) must not be nearer */
        int ok = (h & 0x8000) == (f2u(f) >> 16 & 0x8000);
        if (mag < 0x7bff) ok = ok && e0 <= fabs(ref_f16_value((uint16_t)(h + 1)) - v);
        if (mag > 0) ok = ok && e0 <= fabs(ref_f16_value((uint16_t)(h - 1)) - v);
        if (!ok && rbad++ < 5) CHECK_MSG(ok, "f=%a -> 0x%04x", f, h);
    }
    CHECK_EQ_INT(rbad, 0);
}

/* f32 -> bf16: round trip, ties to even over every bf16 neighbour pair, and
 * NaN quieting ((top half) | 0x40, as ggml / gguf-py). */
static void test_f32_to_bf16_rounding(void) {
    int bad = 0;
    for (uint32_t b = 0; b < 65536; b++) {
        const uint32_t u = b << 16;
        const int is_nan = (u & 0x7fffffffu) > 0x7f800000u;
        const uint16_t r = ds4_f32_to_bf16(u2f(u));
        const uint16_t want = is_nan ? (uint16_t)(b | 0x40) : (uint16_t)b;
        if (r != want && bad++ < 5) CHECK_MSG(0, "bf16 0x%04x -> 0x%04x", b, r);
        if (is_nan || (b & 0x7fff) >= 0x7f80) continue;
        /* between b and b+1 (same sign, b+1 may be inf): low halves 0x7fff /
         * 0x8000 (the tie) / 0x8001 */
        const uint16_t even = (b & 1) ? (uint16_t)(b + 1) : (uint16_t)b;
        if (ds4_f32_to_bf16(u2f(u | 0x7fffu)) != b && bad++ < 5) CHECK_MSG(0, "below 0x%04x", b);
        if (ds4_f32_to_bf16(u2f(u | 0x8000u)) != even && bad++ < 5) CHECK_MSG(0, "tie 0x%04x", b);
        if (ds4_f32_to_bf16(u2f(u | 0x8001u)) != b + 1 && bad++ < 5) CHECK_MSG(0, "above 0x%04x", b);
    }
    CHECK_EQ_INT(bad, 0);
    /* a NaN whose payload is only in the low half must stay a NaN */
    CHECK_EQ_INT(ds4_f32_to_bf16(u2f(0x7f800001u)), 0x7fc0);
    CHECK_EQ_INT(ds4_f32_to_bf16(u2f(0xff800001u)), 0xffc0);
    CHECK_EQ_INT(ds4_f32_to_bf16(u2f(0x7f7fffffu)), 0x7f80); /* FLT_MAX rounds to inf */
    CHECK_EQ_INT(ds4_f32_to_bf16(1.0f), 0x3f80);
    /* slow reference on random inputs: nearest by double distance */
    int rbad = 0;
    for (int i = 0; i < 200000; i++) {
        const float f = u2f((uint32_t)test_rand_u64());
        if (!isfinite(f) || fabsf(f) >= 0x1.fep127f) continue;
        const uint16_t r = ds4_f32_to_bf16(f);
        const double v = f, e0 = fabs((double)ds4_bf16_to_f32(r) - v);
        const double eup = fabs((double)ds4_bf16_to_f32((uint16_t)(r + 1)) - v);
        int ok = (r & 0x7fff) == 0x7f7f || e0 <= eup;
        if ((r & 0x7fff) > 0) ok = ok && e0 <= fabs((double)ds4_bf16_to_f32((uint16_t)(r - 1)) - v);
        if (!ok && rbad++ < 5) CHECK_MSG(ok, "f=%a -> 0x%04x", f, r);
    }
    CHECK_EQ_INT(rbad, 0);
}

/* ------------------------------------------------------------------------ */
/* IQ2_XXS tables                                                            */
/* ------------------------------------------------------------------------ */

static void test_iq2xxs_tables(void) {
    /* the first entries of the published sign table (ksigns_iq2xs) */
    const uint8_t first[8] = { 0x00, 0x81, 0x82, 0x03, 0x84, 0x05, 0x06, 0x87 };
    for (int i = 0; i < 8; i++) CHECK_EQ_INT(ds4_iq2xxs_sign_pattern(i), first[i]);
    CHECK_EQ_INT(ds4_iq2xxs_sign_pattern(127), 0xff);
    for (int i = 0; i < 128; i++) {
        const uint8_t s = ds4_iq2xxs_sign_pattern(i);
        int pop = 0;
        for (int j = 0; j < 8; j++) pop += (s >> j) & 1;
        CHECK((s & 127) == i && pop % 2 == 0);
    }
    /* grid: magnitudes from {8, 25, 43}, entry 0 is all 8s, all distinct */
    int bad = 0;
    for (int g = 0; g < 256; g++) {
        for (int j = 0; j < 8; j++) {
            const int v = ds4_iq2xxs_grid_value(g, j);
            if (v != 8 && v != 25 && v != 43) bad++;
        }
        for (int h = 0; h < g; h++) {
            int same = 1;
            for (int j = 0; j < 8; j++) same &= ds4_iq2xxs_grid_value(g, j) == ds4_iq2xxs_grid_value(h, j);
            bad += same;
        }
    }
    CHECK_EQ_INT(bad, 0);
    for (int j = 0; j < 8; j++) CHECK_EQ_INT(ds4_iq2xxs_grid_value(0, j), 8);
    /* entry 1 = 0x0002 packed: element 0 is code 2 (43), the rest 8 */
    CHECK_EQ_INT(ds4_iq2xxs_grid_value(1, 0), 43);
    CHECK_EQ_INT(ds4_iq2xxs_grid_value(1, 1), 8);
    CHECK_EQ_INT(ds4_iq2xxs_grid_value(256, 0), 0);
    CHECK_EQ_INT(ds4_iq2xxs_grid_value(0, 8), 0);
}

/* ------------------------------------------------------------------------ */
/* Hand-built blocks: values worked out from the layout descriptions         */
/* ------------------------------------------------------------------------ */

static void test_layout_probes(void) {
    float y[256];
    { /* Q8_0: y = q * d */
        ds4_block_q8_0 b;
        memset(&b, 0, sizeof b);
        b.d = 0x3800; /* 0.5 */
        b.qs[3] = -7;
        b.qs[31] = 127;
        ds4_type_traits_get(DS4_TYPE_Q8_0)->dequant_row(&b, y, 32);
        CHECK(y[3] == -3.5f && y[31] == 63.5f && y[0] == 0.0f);
    }
    { /* Q2_K: element 80 = sub-block 5, half 0, shift 2*2, byte 16 */
        ds4_block_q2_K b;
        memset(&b, 0, sizeof b);
        b.d = 0x3c00;    /* 1 */
        b.dmin = 0x3800; /* 0.5 */
        b.scales[5] = 3 | (2 << 4);
        b.qs[16] = 2 << 4;
        b.qs[32 + 1] = 3 << 6; /* element 128 + 96 + 1 = 225, sub-block 14 */
        b.scales[14] = 1;
        ds4_dequant_row_q2_K(&b, y, 256);
        CHECK(y[80] == 5.0f);  /* 1*3*2 - 0.5*2 */
        CHECK(y[81] == -1.0f); /* q = 0 */
        CHECK(y[225] == 3.0f);
        CHECK(y[0] == 0.0f);
    }
    { /* Q4_K: sub-block 5 (high half) scale 37 = 0b100101, min 18 = 0b010010 */
        ds4_block_q4_K b;
        memset(&b, 0, sizeof b);
        b.d = 0x3c00;
        b.dmin = 0x3c00;
        b.scales[9] = (37 & 15) | ((18 & 15) << 4); /* j+4 = 9 */
        b.scales[1] = (37 >> 4) << 6;               /* j-4 = 1: high bits of sc */
        b.scales[5] = (18 >> 4) << 6;               /* j = 5: high bits of m */
        b.qs[32 * 2 + 7] = 9 << 4;                  /* element 160 + 7, nibble 1 */
        ds4_dequant_row_q4_K(&b, y, 256);
        CHECK(y[167] == 37.0f * 9.0f - 18.0f);
        CHECK(y[166] == -18.0f);
        CHECK(y[0] == 0.0f); /* sub-block 0: scale 0, min 0 */
    }
    { /* Q5_K: element 200 = sub-block 6, l = 8; the 5th bit in qh[8] bit 6 */
        ds4_block_q5_K b;
        memset(&b, 0, sizeof b);
        b.d = 0x4000; /* 2 */
        b.dmin = 0x3c00;
        b.scales[10] = 3;          /* sc[6] = 3, m[6] = 0 */
        b.qs[32 * 3 + 8] = 5;      /* low nibble (sub-block 6 is even) */
        b.qh[8] = 1 << 6;
        ds4_dequant_row_q5_K(&b, y, 256);
        CHECK(y[200] == 2.0f * 3.0f * 21.0f);
    }
    { /* Q6_K: element 200 = half 1, i = 72: ql[64 + 8] high nibble, qh[32 + 8] bits 4..5 */
        ds4_block_q6_K b;
        memset(&b, 0, sizeof b);
        b.d = 0x3800; /* 0.5 */
        for (int j = 0; j < 16; j++) b.scales[j] = (int8_t)(j == 12 ? -3 : 1);
        b.ql[72] = 0xa0;        /* low 4 bits of element 200 = 10 */
        b.qh[40] = 2 << 4;      /* high 2 bits = 2: q = 42, value 10 */
        ds4_dequant_row_q6_K(&b, y, 256);
        CHECK(y[200] == (0.5f * -3.0f) * 10.0f);
        CHECK(y[0] == 0.5f * -32.0f);
    }
    { /* IQ2_XXS: group 2, subgroup 1 (elements 72..79) uses grid entry 1, sign index 1 */
        ds4_block_iq2_xxs b;
        memset(&b, 0, sizeof b);
        b.d = 0x3c00; /* 1 */
        uint8_t *qs = (uint8_t *)b.qs;
        qs[16 + 1] = 1;                        /* aux0 byte 1 */
        const uint32_t aux1 = (1u << 7) | (3u << 28); /* signs of subgroup 1 = 0x81, s = 3 */
        memcpy(qs + 20, &aux1, 4);
        ds4_dequant_row_iq2_xxs(&b, y, 256);
        const float db = 1.0f * 3.5f * 0.25f;
        CHECK(y[72] == -(db * 43.0f)); /* bit 0 of 0x81 */
        CHECK(y[73] == db * 8.0f);
        CHECK(y[79] == -(db * 8.0f)); /* bit 7 of 0x81 */
        CHECK(y[64] == db * 8.0f);     /* subgroup 0 of group 2: entry 0, signs 0 */
        CHECK(y[0] == 0.125f * 8.0f);  /* group 0: s = 0, db = 1/8 */
    }
}

/* ------------------------------------------------------------------------ */
/* Random rows and error bounds                                              */
/* ------------------------------------------------------------------------ */

/* Offsets of the f16 scale fields of a block: d first, then dmin if any. */
static int f16_fields(uint32_t type, size_t off[2]) {
    switch (type) {
    case DS4_TYPE_Q8_0: off[0] = offsetof(ds4_block_q8_0, d); return 1;
    case DS4_TYPE_Q2_K: off[0] = offsetof(ds4_block_q2_K, d); off[1] = offsetof(ds4_block_q2_K, dmin); return 2;
    case DS4_TYPE_Q4_K: off[0] = offsetof(ds4_block_q4_K, d); off[1] = offsetof(ds4_block_q4_K, dmin); return 2;
    case DS4_TYPE_Q5_K: off[0] = offsetof(ds4_block_q5_K, d); off[1] = offsetof(ds4_block_q5_K, dmin); return 2;
    case DS4_TYPE_Q6_K: off[0] = offsetof(ds4_block_q6_K, d); return 1;
    case DS4_TYPE_IQ2_XXS: off[0] = offsetof(ds4_block_iq2_xxs, d); return 1;
    default: return 0;
    }
}

static float rand_normal_f(void) { return (float)test_rand_normal(); }

/* A random row of n elements: plain types from N(0,1) values, Q8_K by
 * quantising N(0,1), block types from random bytes with their f16 scales
 * replaced by finite values of magnitude in [1e-3, 1] and random sign. */
static void *make_row(uint32_t type, int64_t n) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    const int64_t bytes = ds4_type_row_bytes(type, n);
    uint8_t *row = malloc((size_t)bytes);
    if (type == DS4_TYPE_F32 || type == DS4_TYPE_F16 || type == DS4_TYPE_BF16 || type == DS4_TYPE_Q8_K) {
        float *x = malloc((size_t)n * sizeof(float));
        for (int64_t i = 0; i < n; i++) x[i] = rand_normal_f();
        t->quantize_row(x, row, n);
        free(x);
        return row;
    }
    for (int64_t i = 0; i < bytes; i++) row[i] = (uint8_t)test_rand_u64();
    size_t off[2];
    const int nf = f16_fields(type, off);
    for (int64_t b = 0; b < n / t->block_elems; b++) {
        for (int k = 0; k < nf; k++) {
            float v = (float)(1e-3 + (1.0 - 1e-3) * test_rand_uniform());
            if (test_rand_u64() & 1) v = -v;
            const uint16_t h = ds4_f32_to_f16(v);
            memcpy(row + b * t->block_bytes + off[k], &h, 2);
        }
    }
    return row;
}

/*
 * mag[i] >= the magnitudes of the terms the dequantised value is made of:
 * for the affine formats y = A - B with A = (d*sc)*q and B = dmin*m, so mag =
 * |A| + |B| (obtained by dequantising copies with dmin resp. d zeroed);
 * otherwise |y|. Float rounding errors in y are relative to these terms.
 */
static void magnitudes(uint32_t type, const void *row, int64_t n, float *mag) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    size_t off[2];
    const int nf = f16_fields(type, off);
    t->dequant_row(row, mag, n);
    for (int64_t i = 0; i < n; i++) mag[i] = fabsf(mag[i]);
    if (nf < 2) return;
    const size_t bytes = (size_t)ds4_type_row_bytes(type, n);
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    float *ya = malloc((size_t)n * sizeof(float)), *yb = malloc((size_t)n * sizeof(float));
    memcpy(a, row, bytes);
    memcpy(b, row, bytes);
    const uint16_t zero = 0;
    for (int64_t k = 0; k < n / t->block_elems; k++) {
        memcpy(a + k * t->block_bytes + off[1], &zero, 2); /* dmin = 0: y = A */
        memcpy(b + k * t->block_bytes + off[0], &zero, 2); /* d = 0:    y = -B */
    }
    t->dequant_row(a, ya, n);
    t->dequant_row(b, yb, n);
    for (int64_t i = 0; i < n; i++) mag[i] = fabsf(ya[i]) + fabsf(yb[i]);
    free(a);
    free(b);
    free(ya);
    free(yb);
}

/*
 * dot_f32 against float64 sum of dequant(row)[i] * x[i].
 * The weights the dot uses are exactly the dequantised floats, so the only
 * error is float32 rounding of the n products and of the additions; the
 * summation is at most two-level (within a block, then across blocks), of
 * depth <= n + 1, so |error| <= (n + 2) * 2^-24 * sum |w_i x_i| (the
 * standard gamma_n bound; n * 2^-24 << 1 here).
 */
static void check_dot_f32(uint32_t type, int64_t n) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    void *row = make_row(type, n);
    float *w = malloc((size_t)n * sizeof(float)), *x = malloc((size_t)n * sizeof(float));
    t->dequant_row(row, w, n);
    for (int64_t i = 0; i < n; i++) x[i] = rand_normal_f();
    double ref = 0, sabs = 0;
    for (int64_t i = 0; i < n; i++) {
        ref += (double)w[i] * x[i];
        sabs += fabs((double)w[i] * x[i]);
    }
    const double got = t->dot_f32(row, x, n);
    CHECK_MSG(fabs(got - ref) <= (double)(n + 2) * U24 * sabs, "%s n=%lld: %.9g vs %.9g (sum|wx| %.3g)",
              t->name, (long long)n, got, ref, sabs);
    CHECK(sabs > 0);
    free(row);
    free(w);
    free(x);
}

/*
 * dot_q8_K against float64 sum of dequant(row)[i] * dequant(q8_K)[i].
 * The implementation sums integer products exactly; float rounding enters
 * only in the few scaled partial sums. With S = sum mag_i * |x_i| (mag as
 * above, x the dequantised activations):
 *  - reference: each float32 dequantised weight is within 3u of its exact
 *    value relative to mag_i (two products, one subtraction), each
 *    activation d*q within u: <= 4u S.
 *  - implementation: per partial sum the scale product d_w * d_x, the int to
 *    float conversion, the scaling, and the min term and subtraction: <= 5u,
 *    plus u per addition across the nb partial sums; the plain types (F32,
 *    F16, BF16) first sum 256 float products per block: + 256u.
 * So |error| <= (inner + nb + 10) * 2^-24 * S, u = 2^-24.
 */
static void check_dot_q8_K(uint32_t type, int64_t n) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    void *row = make_row(type, n);
    float *w = malloc((size_t)n * sizeof(float)), *mag = malloc((size_t)n * sizeof(float));
    float *xa = malloc((size_t)n * sizeof(float)), *xq = malloc((size_t)n * sizeof(float));
    ds4_block_q8_K *q8 = malloc((size_t)(n / DS4_QK_K) * sizeof(ds4_block_q8_K));
    t->dequant_row(row, w, n);
    magnitudes(type, row, n, mag);
    for (int64_t i = 0; i < n; i++) xa[i] = rand_normal_f();
    ds4_quantize_row_q8_K(xa, q8, n);
    ds4_type_traits_get(DS4_TYPE_Q8_K)->dequant_row(q8, xq, n);
    double ref = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        ref += (double)w[i] * xq[i];
        s += (double)mag[i] * fabs((double)xq[i]);
    }
    const int plain = type == DS4_TYPE_F32 || type == DS4_TYPE_F16 || type == DS4_TYPE_BF16;
    const int64_t nb = n / (type == DS4_TYPE_Q8_0 ? DS4_QK8_0 : DS4_QK_K);
    const double tol = (double)((plain ? DS4_QK_K : 0) + nb + 10) * U24 * s;
    const double got = t->dot_q8_K(row, q8, n);
    CHECK_MSG(fabs(got - ref) <= tol, "%s n=%lld: %.9g vs %.9g (tol %.3g)", t->name, (long long)n, got,
              ref, tol);
    CHECK(s > 0);
    free(row);
    free(w);
    free(mag);
    free(xa);
    free(xq);
    free(q8);
}

static void test_dot_f32(void) {
    for (int i = 0; i < N_IMPL; i++) {
        for (int rep = 0; rep < 20; rep++) {
            check_dot_f32(IMPL[i], DS4_QK_K);
            check_dot_f32(IMPL[i], 8 * DS4_QK_K);
        }
    }
}

static void test_dot_q8_K(void) {
    for (int i = 0; i < N_IMPL; i++) {
        for (int rep = 0; rep < 20; rep++) {
            check_dot_q8_K(IMPL[i], DS4_QK_K);
            check_dot_q8_K(IMPL[i], 8 * DS4_QK_K);
        }
    }
}

/*
 * Row functions on n = 4 units of work (a unit is one block, or 256 elements
 * where blocks are smaller, so that the Q8_K activations split with it) agree
 * with four one-unit calls: the same bytes from quantize_row, the same floats
 * from dequant_row, and dots equal to the sum of the per-unit dots. Both the
 * whole-row dot and each partial are within the bounds derived above of the
 * exact value, so they differ by at most twice the larger bound,
 * 2 * (256 + n + 10) * 2^-24 * sum mag_i |x_i|.
 */
static void test_multi_block_rows(void) {
    for (int i = 0; i < N_IMPL; i++) {
        const ds4_type_traits *t = ds4_type_traits_get(IMPL[i]);
        const int64_t be = t->block_elems < DS4_QK_K ? DS4_QK_K : t->block_elems;
        const int64_t n = 4 * be, unit_bytes = ds4_type_row_bytes(IMPL[i], be);
        float *x = malloc((size_t)n * sizeof(float)), *y = malloc((size_t)n * sizeof(float));
        float *y1 = malloc((size_t)n * sizeof(float)), *xa = malloc((size_t)n * sizeof(float));
        float *xq = malloc((size_t)n * sizeof(float)), *mag = malloc((size_t)n * sizeof(float));
        uint8_t *q = malloc((size_t)ds4_type_row_bytes(IMPL[i], n));
        uint8_t *q1 = malloc((size_t)ds4_type_row_bytes(IMPL[i], n));
        ds4_block_q8_K *a8 = malloc((size_t)(n / DS4_QK_K) * sizeof(ds4_block_q8_K));
        for (int64_t k = 0; k < n; k++) x[k] = rand_normal_f() * (float)(1 + k / be); /* units differ */
        for (int64_t k = 0; k < n; k++) xa[k] = rand_normal_f();
        ds4_quantize_row_q8_K(xa, a8, n);
        ds4_type_traits_get(DS4_TYPE_Q8_K)->dequant_row(a8, xq, n);
        t->quantize_row(x, q, n);
        for (int b = 0; b < 4; b++) t->quantize_row(x + b * be, q1 + b * unit_bytes, be);
        CHECK_MSG(memcmp(q, q1, (size_t)(4 * unit_bytes)) == 0, "%s quantize_row", t->name);
        t->dequant_row(q, y, n);
        for (int b = 0; b < 4; b++) t->dequant_row(q + b * unit_bytes, y1 + b * be, be);
        CHECK_MSG(memcmp(y, y1, (size_t)n * sizeof(float)) == 0, "%s dequant_row", t->name);
        magnitudes(IMPL[i], q, n, mag);
        double parts = 0, parts8 = 0, s1 = 0, s8 = 0;
        for (int64_t k = 0; k < n; k++) {
            s1 += (double)mag[k] * fabs((double)xa[k]);
            s8 += (double)mag[k] * fabs((double)xq[k]);
        }
        for (int b = 0; b < 4; b++) {
            parts += t->dot_f32(q + b * unit_bytes, xa + b * be, be);
            parts8 += t->dot_q8_K(q + b * unit_bytes, a8 + b * (be / DS4_QK_K), be);
        }
        const double whole = t->dot_f32(q, xa, n), whole8 = t->dot_q8_K(q, a8, n);
        const double k_tol = 2.0 * (double)(DS4_QK_K + n + 10) * U24;
        CHECK_MSG(fabs(whole - parts) <= k_tol * s1, "%s dot_f32 %.9g vs %.9g", t->name, whole, parts);
        CHECK_MSG(fabs(whole8 - parts8) <= k_tol * s8, "%s dot_q8_K %.9g vs %.9g", t->name, whole8, parts8);
        CHECK(s1 > 0 && s8 > 0);
        free(x);
        free(y);
        free(y1);
        free(xa);
        free(xq);
        free(mag);
        free(q);
        free(q1);
        free(a8);
    }
}

/* ------------------------------------------------------------------------ */
/* Quantisers                                                                */
/* ------------------------------------------------------------------------ */

static double quant_rel_rms(uint32_t type, const float *x, int64_t n) {
    const ds4_type_traits *t = ds4_type_traits_get(type);
    void *q = malloc((size_t)ds4_type_row_bytes(type, n));
    float *y = malloc((size_t)n * sizeof(float));
    t->quantize_row(x, q, n);
    t->dequant_row(q, y, n);
    double e = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        e += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        s += (double)x[i] * x[i];
    }
    free(q);
    free(y);
    return sqrt(e / s);
}

/*
 * Relative RMS error of quantise -> dequantise on N(0,1) data (64 blocks of
 * 256). Measured (this implementation): F16 2.1e-4, BF16 1.7e-3, Q8_0 0.0053,
 * Q8_K 0.0069, Q6_K 0.0174, Q5_K 0.0348, Q4_K 0.0702, Q2_K 0.263,
 * IQ2_XXS 0.327. The bounds leave ~10% margin (the estimate's spread over
 * seeds is ~1%); the same bounds must hold for data scaled by 1e-3 and 50.
 */
static void test_quantize_error(void) {
    static const struct {
        uint32_t type;
        double bound;
    } B[] = {
        { DS4_TYPE_F32, 0.0 },      { DS4_TYPE_F16, 2.5e-4 },  { DS4_TYPE_BF16, 1.9e-3 },
        { DS4_TYPE_Q8_0, 0.006 },   { DS4_TYPE_Q8_K, 0.0078 }, { DS4_TYPE_Q6_K, 0.019 },
        { DS4_TYPE_Q5_K, 0.038 },   { DS4_TYPE_Q4_K, 0.077 },  { DS4_TYPE_Q2_K, 0.29 },
        { DS4_TYPE_IQ2_XXS, 0.36 },
    };
    const int64_t n = 64 * DS4_QK_K;
    float *x = malloc((size_t)n * sizeof(float)), *xs = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = rand_normal_f();
    for (size_t k = 0; k < sizeof B / sizeof B[0]; k++) {
        const double r = quant_rel_rms(B[k].type, x, n);
        fprintf(stderr, "    %-8s rel rms %.5f (bound %.4g)\n", ds4_type_name(B[k].type), r, B[k].bound);
        CHECK_MSG(r <= B[k].bound, "%s rel rms %.5f > %.4g", ds4_type_name(B[k].type), r, B[k].bound);
        const float scales[2] = { 1e-3f, 50.0f };
        for (int si = 0; si < 2; si++) {
            for (int64_t i = 0; i < n; i++) xs[i] = x[i] * scales[si];
            const double rs = quant_rel_rms(B[k].type, xs, n);
            CHECK_MSG(rs <= B[k].bound, "%s scaled by %g: rel rms %.5f > %.4g", ds4_type_name(B[k].type),
                      scales[si], rs, B[k].bound);
        }
    }
    /* F16 / BF16 element-wise: relative error <= half an ulp (2^-11, 2^-8) */
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const double v = x[i];
        if (fabs(v) < 1e-4) continue; /* f16 subnormal range has absolute, not relative, error */
        const double e16 = fabs(ds4_f16_to_f32(ds4_f32_to_f16(x[i])) - v) / fabs(v);
        const double eb = fabs(ds4_bf16_to_f32(ds4_f32_to_bf16(x[i])) - v) / fabs(v);
        bad += e16 > 0x1p-11 || eb > 0x1p-8;
    }
    CHECK_EQ_INT(bad, 0);
    /* an all-zero input quantises to something that dequantises to zeros */
    for (int i = 0; i < N_IMPL; i++) {
        memset(x, 0, DS4_QK_K * sizeof(float));
        const ds4_type_traits *t = ds4_type_traits_get(IMPL[i]);
        void *q = malloc((size_t)ds4_type_row_bytes(IMPL[i], DS4_QK_K));
        t->quantize_row(x, q, DS4_QK_K);
        t->dequant_row(q, xs, DS4_QK_K);
        int nz = 0;
        for (int j = 0; j < DS4_QK_K; j++) nz += xs[j] != 0.0f;
        CHECK_MSG(nz == 0, "%s zeros -> %d nonzero", t->name, nz);
        free(q);
    }
    free(x);
    free(xs);
}

/* Q8_0 quantiser on a hand example: d = amax/127 stored as f16, q rounded
 * half away from zero with the unrounded 1/d. */
static void test_q8_0_quantize_example(void) {
    float x[32];
    for (int i = 0; i < 32; i++) x[i] = 0.0f;
    x[0] = 127.0f; /* d = 1, id = 1 */
    x[1] = 2.5f;   /* half away from zero: 3 */
    x[2] = -2.5f;  /* -3 */
    x[3] = 0.49f;
    x[4] = -126.5f; /* -127 */
    ds4_block_q8_0 b;
    ds4_type_traits_get(DS4_TYPE_Q8_0)->quantize_row(x, &b, 32);
    CHECK_EQ_INT(b.d, 0x3c00);
    CHECK_EQ_INT(b.qs[0], 127);
    CHECK_EQ_INT(b.qs[1], 3);
    CHECK_EQ_INT(b.qs[2], -3);
    CHECK_EQ_INT(b.qs[3], 0);
    CHECK_EQ_INT(b.qs[4], -127);
}

static void test_q8_K_quantize_edges(void) {
    float x[2 * DS4_QK_K];
    ds4_block_q8_K q[2];
    /* all zeros (block 0) next to a normal block (block 1) */
    for (int i = 0; i < DS4_QK_K; i++) x[i] = 0.0f;
    for (int i = 0; i < DS4_QK_K; i++) x[DS4_QK_K + i] = (float)(i % 7) - 3.0f;
    memset(q, 0x55, sizeof q);
    ds4_quantize_row_q8_K(x, q, 2 * DS4_QK_K);
    CHECK(q[0].d == 0.0f);
    int nz = 0;
    for (int i = 0; i < DS4_QK_K; i++) nz += q[0].qs[i] != 0;
    for (int k = 0; k < 16; k++) nz += q[0].bsums[k] != 0;
    CHECK_EQ_INT(nz, 0);
    /* block 1: max |x| = 3, first occurrence is x[0] = -3 -> iscale = 127/3 */
    CHECK_EQ_INT(q[1].qs[0], -127);
    CHECK_EQ_INT(q[1].qs[6], 127);
    CHECK(q[1].d == 1.0f / (-127.0f / -3.0f));

    /* ties in |x| with opposite signs: the first occurrence sets the sign */
    for (int i = 0; i < DS4_QK_K; i++) x[i] = 0.25f;
    x[5] = 3.0f;
    x[9] = -3.0f;
    ds4_quantize_row_q8_K(x, q, DS4_QK_K);
    CHECK_EQ_INT(q[0].qs[5], -127);
    CHECK_EQ_INT(q[0].qs[9], 127);
    CHECK(q[0].d < 0.0f && q[0].d == 1.0f / (-127.0f / 3.0f));
    x[5] = -3.0f;
    x[9] = 3.0f;
    ds4_quantize_row_q8_K(x, q, DS4_QK_K);
    CHECK_EQ_INT(q[0].qs[5], -127);
    CHECK_EQ_INT(q[0].qs[9], 127);
    CHECK(q[0].d > 0.0f);

    /* half-way values round to even: with m = -127, iscale = 1 exactly */
    const float halves[] = { 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f, -125.5f, 3.5f };
    const int want[] = { 0, 2, 2, 0, -2, -2, 126, -126, 4 };
    for (int i = 0; i < DS4_QK_K; i++) x[i] = 0.0f;
    x[0] = -127.0f;
    for (int i = 0; i < 9; i++) x[10 + i] = halves[i];
    ds4_quantize_row_q8_K(x, q, DS4_QK_K);
    CHECK(q[0].d == 1.0f);
    CHECK_EQ_INT(q[0].qs[0], -127);
    for (int i = 0; i < 9; i++) CHECK_MSG(q[0].qs[10 + i] == want[i], "%g -> %d", halves[i], q[0].qs[10 + i]);
    /* bsums are the sums of each 16 codes */
    for (int i = 0; i < DS4_QK_K; i++) x[i] = rand_normal_f();
    ds4_quantize_row_q8_K(x, q, DS4_QK_K);
    for (int k = 0; k < 16; k++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += q[0].qs[16 * k + j];
        CHECK_EQ_INT(q[0].bsums[k], s);
    }
    /* dequant is d * q */
    float y[DS4_QK_K];
    ds4_type_traits_get(DS4_TYPE_Q8_K)->dequant_row(q, y, DS4_QK_K);
    for (int i = 0; i < DS4_QK_K; i += 37) CHECK(y[i] == q[0].d * (float)q[0].qs[i]);
}

/* The IQ2_XXS encoder emits sign patterns with an even number of negatives
 * (structural) and, on data whose subgroups already have that property and
 * whose magnitudes are grid values, matches signs exactly. */
static void test_iq2xxs_encoder_signs(void) {
    float x[DS4_QK_K], y[DS4_QK_K];
    ds4_block_iq2_xxs b;
    for (int i = 0; i < DS4_QK_K; i++) {
        const int g = (int)(test_rand_u64() % 256);
        x[i] = (float)ds4_iq2xxs_grid_value(g, i % 8);
    }
    for (int sg = 0; sg < 32; sg++) { /* even number of negatives per 8 */
        const uint8_t s = ds4_iq2xxs_sign_pattern((int)(test_rand_u64() & 127));
        for (int j = 0; j < 8; j++)
            if ((s >> j) & 1) x[8 * sg + j] = -x[8 * sg + j];
    }
    ds4_quantize_row_iq2_xxs(x, &b, DS4_QK_K);
    ds4_dequant_row_iq2_xxs(&b, y, DS4_QK_K);
    int sign_bad = 0;
    for (int i = 0; i < DS4_QK_K; i++) sign_bad += (x[i] < 0) != (y[i] < 0);
    CHECK_EQ_INT(sign_bad, 0);
}

static const test_case TESTS[] = {
    TEST_ENTRY(test_traits_table),
    TEST_ENTRY(test_block_sizes),
    TEST_ENTRY(test_row_bytes),
    TEST_ENTRY(test_f16_to_f32_exhaustive),
    TEST_ENTRY(test_bf16_to_f32_exhaustive),
    TEST_ENTRY(test_f32_to_f16_rounding),
    TEST_ENTRY(test_f32_to_bf16_rounding),
    TEST_ENTRY(test_iq2xxs_tables),
    TEST_ENTRY(test_layout_probes),
    TEST_ENTRY(test_dot_f32),
    TEST_ENTRY(test_dot_q8_K),
    TEST_ENTRY(test_multi_block_rows),
    TEST_ENTRY(test_quantize_error),
    TEST_ENTRY(test_q8_0_quantize_example),
    TEST_ENTRY(test_q8_K_quantize_edges),
    TEST_ENTRY(test_iq2xxs_encoder_signs),
    { 0 },
};

int main(int argc, char **argv) { return test_main(argc, argv, TESTS); }

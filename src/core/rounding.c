/*
 * rounding.c - DS4's scalar rounding primitives (see rounding.h, spec 3.0).
 *
 * Checked against antirez/ds4's ds4.c (dsv4_e4m3fn_dequant_cpu,
 * dsv4_fp8_kv_quantize_row_inplace_cpu, dsv4_e2m1fn_dequant_cpu,
 * dsv4_hadamard128_inplace_cpu, dsv4_fp4_act_quantize_row_inplace_cpu):
 *   - the block scale is computed in float exactly as there:
 *     ldexpf(1, (int)ceilf(log2f(amax / max))), amax the float max of |x|;
 *     a value just above a power of two can make log2f round down to an
 *     integer, so x / scale may exceed the format's maximum by an ulp: the
 *     clamp to +-max before rounding is what keeps that case in range;
 *   - ds4 searches the value table for the nearest code (ties to the even
 *     code); here the same nearest-even result is obtained by rounding |v| to
 *     the format's quantum at |v|'s binade with rintf (the code's mantissa is
 *     the rounded integer's low bits, so its parity is the code's parity);
 *   - the Hadamard scale is the float of 1/sqrt(n) (0.08838834764831845f for
 *     n = 128, ds4's constant), applied after the butterflies.
 * Deliberate differences, both outside what a model produces: NaN stays NaN
 * (ds4 maps it to +448 / +6 through fminf) and -0 stays -0 (ds4 gives +0).
 * A block containing +-inf (undefined in ds4: (int)ceilf(inf)) gets scale
 * 2^127, so its infinities stay infinite and its finite values round to 0.
 */
#include "core/rounding.h"

#include <math.h>

#include "core/quant.h"

float ds4_round_f16(float v) { return ds4_f16_to_f32(ds4_f32_to_f16(v)); }

/*
 * Round |v| to the nearest value of a small binary float format with
 * `mant_bits` mantissa bits whose smallest normal binade is 2^min_exp (below
 * it, subnormals share that binade's quantum), saturating at max_mag.
 * In the binade [2^e, 2^(e+1)) the representable magnitudes are the multiples
 * of 2^(e - mant_bits), so rint(|v| / quantum) * quantum is the nearest one,
 * ties to even; a result of 2^(e+1) is the next binade's first value.
 */
static float round_small_float(float v, int min_exp, int mant_bits, float max_mag) {
    if (isnan(v)) return v;
    float a = fabsf(v);
    float r;
    if (a >= max_mag) {
        r = max_mag;
    } else {
        int e2;
        (void)frexpf(a, &e2); /* a = f * 2^e2, f in [0.5, 1): floor(log2 a) = e2 - 1 */
        int binade = e2 - 1 < min_exp ? min_exp : e2 - 1;
        float quantum = ldexpf(1.0f, binade - mant_bits);
        r = rintf(a / quantum) * quantum; /* both steps exact: quantum is a power of two */
        if (r > max_mag) r = max_mag;
    }
    return copysignf(r, v);
}

/* E4M3FN: 3 mantissa bits, exponent bias 7, smallest normal 2^-6, largest 448. */
float ds4_round_fp8_e4m3(float v) { return round_small_float(v, -6, 3, 448.0f); }

/* E2M1: 1 mantissa bit, exponent bias 1, smallest normal 1, largest 6. */
float ds4_round_fp4_e2m1(float v) { return round_small_float(v, 0, 1, 6.0f); }

/* The power-of-two scale of one block: 2^ceil(log2(max(amax, amax_floor) / max_mag)). */
static float block_scale(const float *x, int64_t n, float amax_floor, float max_mag) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > amax) amax = a; /* NaN never compares greater: ignored, as in ds4 */
    }
    if (amax < amax_floor) amax = amax_floor;
    float e = ceilf(log2f(amax / max_mag));
    if (e > 127.0f) e = 127.0f; /* amax = inf */
    return ldexpf(1.0f, (int)e);
}

/* Scale a block into the format's range, round, scale back. */
static void round_block(float *x, int64_t n, float amax_floor, float max_mag, float (*round_fn)(float)) {
    const float scale = block_scale(x, n, amax_floor, max_mag);
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] / scale;
        if (v > max_mag) v = max_mag;
        if (v < -max_mag) v = -max_mag;
        x[i] = round_fn(v) * scale;
    }
}

void ds4_fp8_kv_round_row(float *x, int64_t dim, int64_t n_rope) {
    const int64_t n_nope = dim - n_rope;
    for (int64_t off = 0; off < n_nope; off += 64) {
        const int64_t len = n_nope - off < 64 ? n_nope - off : 64;
        round_block(x + off, len, 1.0e-4f, 448.0f, ds4_round_fp8_e4m3);
    }
}

void ds4_hadamard_row(float *x, int64_t n) {
    if (n < 1 || (n & (n - 1)) != 0) return;
    for (int64_t stride = 1; stride < n; stride <<= 1) {
        for (int64_t base = 0; base < n; base += 2 * stride) {
            for (int64_t i = 0; i < stride; i++) {
                const float a = x[base + i];
                const float b = x[base + stride + i];
                x[base + i] = a + b;
                x[base + stride + i] = a - b;
            }
        }
    }
    const float norm = (float)(1.0 / sqrt((double)n));
    for (int64_t i = 0; i < n; i++) x[i] *= norm;
}

void ds4_indexer_qat_row(float *x, int64_t n) {
    ds4_hadamard_row(x, n);
    for (int64_t off = 0; off < n; off += 32) {
        const int64_t len = n - off < 32 ? n - off : 32;
        /* 7.052966104933725e-38 / 6 is FLT_MIN: the scale never goes subnormal. */
        round_block(x + off, len, 7.052966104933725e-38f, 6.0f, ds4_round_fp4_e2m1);
    }
}

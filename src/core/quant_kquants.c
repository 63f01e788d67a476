/*
 * quant_kquants.c - Q2_K, Q4_K, Q5_K, Q6_K (CPU reference).
 *
 * All four use super-blocks of 256 elements with an f16 super-scale d (and
 * dmin for the affine ones) and small integer per-sub-block scales:
 *
 *   Q2_K  16 sub-blocks of 16: y = (d*sc)*q - (dmin*m),  q in 0..3,
 *         sc, m 4-bit (scales[j] = sc | m << 4)
 *   Q4_K   8 sub-blocks of 32: y = (d*sc)*q - (dmin*m),  q in 0..15,
 *         sc, m 6-bit packed into 12 bytes (see unpack_scale_min_k4)
 *   Q5_K  as Q4_K with q in 0..31 (the 5th bit in qh)
 *   Q6_K  16 sub-blocks of 16: y = (d*sc)*(q - 32),      q in 0..63,
 *         sc an int8
 *
 * Dequantisation follows gguf-py's numpy order of float32 operations exactly
 * (a product for the sub-block scale, times q, minus the min product), which
 * makes it bit-exact with gguf.quants.dequantize.
 *
 * The dot_q8_K functions compute what ggml's vec_dot_*_q8_K compute: per
 * sub-block an integer sum of q_w * q_x, times the integer sub-block scale,
 * summed over the super-block in integers; then in float
 *     (f16(d) * x.d) * isum - (f16(dmin) * x.d) * sum_j m_j * bsum_j
 * where bsum_j is the sum of the activation codes under sub-block j (from the
 * Q8_K bsums, 16 elements each).
 */
#include "core/quant.h"

#include <math.h>
#include <string.h>

#define QK DS4_QK_K

static inline float f16(uint16_t h) { return ds4_f16_to_f32(h); }

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Round to nearest (ties to even, the default rounding mode); NaN -> 0. */
static inline int round_int(float v) {
    if (!(v == v)) return 0;
    if (v > 1e9f) return 1000000000;
    if (v < -1e9f) return -1000000000;
    return (int)lrintf(v);
}

static float dot_block(const float *w, const float *x, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += w[i] * x[i];
    return s;
}

/* ------------------------------------------------------------------------ */
/* Scale quantisation helpers for the encoders                               */
/* ------------------------------------------------------------------------ */

/*
 * Fit x[i] ~= a*q[i] - b with integer q[i] in [0, nmax], a >= 0 and b >= 0
 * (the format subtracts an unsigned min, so the represented range always
 * contains 0; a sub-block that is all positive gets b = 0).
 *
 * Tries the plain min/max mapping and a few slightly stretched/shrunk inverse
 * scales; for each, the codes are rounded and (a, b) refitted by least squares
 * for those codes; the candidate with the smallest squared error wins.
 */
static void fit_affine(const float *x, int n, int nmax, float *out_a, float *out_b) {
    float mn = x[0], mx = x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
    }
    if (mn > 0.0f) mn = 0.0f;
    if (!(mx > mn)) { /* constant (incl. all zero) sub-block */
        *out_a = 0.0f;
        *out_b = -mn;
        return;
    }
    float best_a = (mx - mn) / (float)nmax, best_b = -mn, best_err = INFINITY;
    {
        const float inv = 1.0f / best_a;
        float err = 0.0f;
        for (int i = 0; i < n; i++) {
            int q = clampi(round_int((x[i] - mn) * inv), 0, nmax);
            float e = best_a * (float)q - best_b - x[i];
            err += e * e;
        }
        best_err = err;
    }
    for (int k = -6; k <= 6; k++) {
        const float iscale = ((float)nmax + 0.1f * (float)k) / (mx - mn);
        int q[QK];
        double s1 = 0, s2 = 0, sx = 0, sqx = 0;
        for (int i = 0; i < n; i++) {
            q[i] = clampi(round_int((x[i] - mn) * iscale), 0, nmax);
            s1 += q[i];
            s2 += (double)q[i] * q[i];
            sx += x[i];
            sqx += (double)q[i] * x[i];
        }
        /* least squares for y = a*q + c: [s2 s1; s1 n] [a c]' = [sqx sx]' */
        double det = s2 * n - s1 * s1;
        if (det <= 0) continue;
        double a = (sqx * n - s1 * sx) / det;
        double c = (s2 * sx - s1 * sqx) / det;
        if (c > 0) { /* the format needs c = -b <= 0 */
            c = 0;
            a = sqx / s2;
        }
        if (!(a > 0)) continue;
        float err = 0.0f;
        for (int i = 0; i < n; i++) {
            float e = (float)a * (float)q[i] + (float)c - x[i];
            err += e * e;
        }
        if (err < best_err) {
            best_err = err;
            best_a = (float)a;
            best_b = (float)-c;
        }
    }
    *out_a = best_a;
    *out_b = best_b;
}

/*
 * Fit x[i] ~= a*q[i] with integer q[i] in [-nneg, nneg - 1] (Q6_K: -32..31).
 * The largest-|x| element is mapped to -nneg (the longer side of the range),
 * which makes a carry the sign of -max; stretched variants of that mapping
 * are tried with a least-squares refit, keeping the smallest error.
 */
static float fit_symmetric(const float *x, int n, int nneg) {
    float amax = 0.0f, m = 0.0f;
    for (int i = 0; i < n; i++) {
        float v = fabsf(x[i]);
        if (v > amax) {
            amax = v;
            m = x[i];
        }
    }
    if (amax == 0.0f) return 0.0f;
    float best_a = m / (float)-nneg, best_err = INFINITY;
    for (int k = -6; k <= 6; k++) {
        const float iscale = -((float)nneg + 0.1f * (float)k) / m;
        int q[QK];
        double sqq = 0, sqx = 0;
        for (int i = 0; i < n; i++) {
            q[i] = clampi(round_int(x[i] * iscale), -nneg, nneg - 1);
            sqq += (double)q[i] * q[i];
            sqx += (double)q[i] * x[i];
        }
        if (sqq <= 0) continue;
        float a = (float)(sqx / sqq);
        float err = 0.0f;
        for (int i = 0; i < n; i++) {
            float e = a * (float)q[i] - x[i];
            err += e * e;
        }
        if (err < best_err) {
            best_err = err;
            best_a = a;
        }
    }
    return best_a;
}

/* Code for x given the stored sub-block scale dl and min ml: the q in
 * [0, nmax] whose dequantised value dl*q - ml is nearest to x. */
static inline int affine_code(float x, float dl, float ml, int nmax) {
    if (!(dl > 0.0f)) return 0;
    return clampi(round_int((x + ml) / dl), 0, nmax);
}

/* ------------------------------------------------------------------------ */
/* Q4_K / Q5_K scale packing                                                 */
/* ------------------------------------------------------------------------ */

/*
 * 8 six-bit scales sc[j] and mins m[j] in 12 bytes s[0..11]:
 *   j < 4:  sc[j] = s[j] & 63,  m[j] = s[j+4] & 63
 *   j >= 4: sc[j] = (s[j+4] & 15) | (s[j-4] >> 6) << 4
 *           m[j]  = (s[j+4] >> 4) | (s[j]   >> 6) << 4
 * i.e. the low sub-blocks use bits 0..5 of bytes 0..7, the high sub-blocks
 * keep their low nibbles in bytes 8..11 and their top two bits in bits 6..7
 * of bytes 0..7.
 */
static inline void unpack_scale_min_k4(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void pack_scales_min_k4(uint8_t s[12], const int sc[8], const int m[8]) {
    memset(s, 0, 12);
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(sc[j] & 63);
        s[j + 4] = (uint8_t)(m[j] & 63);
    }
    for (int j = 4; j < 8; j++) {
        s[j + 4] = (uint8_t)((sc[j] & 15) | ((m[j] & 15) << 4));
        s[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
        s[j] |= (uint8_t)((m[j] >> 4) << 6);
    }
}

/*
 * Shared by the Q2_K/Q4_K/Q5_K encoders: fit each sub-block, then quantise
 * the sub-block scales a_j and mins b_j against super-scales d = max a / smax
 * and dmin = max b / smax (smax = 15 or 63), stored as f16; the integer
 * scales are derived from the f16-rounded super-scales actually stored, and
 * the element codes later from the integer scales actually stored.
 */
static void affine_superblock(const float *x, int nsub, int sublen, int nmax, int smax,
                              uint16_t *d_out, uint16_t *dmin_out, int *sc, int *m) {
    float a[16], b[16], amax = 0.0f, bmax = 0.0f;
    for (int j = 0; j < nsub; j++) {
        fit_affine(x + j * sublen, sublen, nmax, &a[j], &b[j]);
        if (a[j] > amax) amax = a[j];
        if (b[j] > bmax) bmax = b[j];
    }
    *d_out = ds4_f32_to_f16(amax / (float)smax);
    *dmin_out = ds4_f32_to_f16(bmax / (float)smax);
    const float d = f16(*d_out), dmin = f16(*dmin_out);
    for (int j = 0; j < nsub; j++) {
        const int sc0 = d > 0.0f ? clampi(round_int(a[j] / d), 0, smax) : 0;
        const int m0 = dmin > 0.0f ? clampi(round_int(b[j] / dmin), 0, smax) : 0;
        /* Rounding a and b separately is not the best integer pair: try the
         * neighbours, each with its codes re-derived, and keep the best. */
        const float *xs = x + j * sublen;
        float best_err = INFINITY;
        sc[j] = sc0;
        m[j] = m0;
        for (int ts = sc0 - 1; ts <= sc0 + 1; ts++) {
            for (int tm = m0 - 1; tm <= m0 + 1; tm++) {
                if (ts < 0 || ts > smax || tm < 0 || tm > smax) continue;
                const float dl = d * (float)ts, ml = dmin * (float)tm;
                float err = 0.0f;
                for (int i = 0; i < sublen; i++) {
                    const float e = dl * (float)affine_code(xs[i], dl, ml, nmax) - ml - xs[i];
                    err += e * e;
                }
                if (err < best_err) {
                    best_err = err;
                    sc[j] = ts;
                    m[j] = tm;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Q2_K                                                                      */
/* ------------------------------------------------------------------------ */
/*
 * Element e (0..255): half h = e/128, shift s = (e%128)/32, l = e%32;
 * q = (qs[32h + l] >> 2s) & 3; sub-block e/16 with scale byte scales[e/16].
 */

static void dequant_block_q2_K(const ds4_block_q2_K *b, float *y) {
    const float d = f16(b->d), dmin = f16(b->dmin);
    for (int h = 0; h < 2; h++) {
        for (int s = 0; s < 4; s++) {
            for (int half16 = 0; half16 < 2; half16++) {
                const int j = 8 * h + 2 * s + half16; /* sub-block */
                const float dl = d * (float)(b->scales[j] & 15);
                const float ml = dmin * (float)(b->scales[j] >> 4);
                for (int l = 16 * half16; l < 16 * half16 + 16; l++) {
                    const int q = (b->qs[32 * h + l] >> (2 * s)) & 3;
                    y[128 * h + 32 * s + l] = dl * (float)q - ml;
                }
            }
        }
    }
}

void ds4_dequant_row_q2_K(const void *src, float *dst, int64_t n) {
    const ds4_block_q2_K *b = src;
    for (int64_t i = 0; i < n / QK; i++) dequant_block_q2_K(&b[i], dst + i * QK);
}

void ds4_quantize_row_q2_K(const float *src, void *dst, int64_t n) {
    ds4_block_q2_K *out = dst;
    for (int64_t i = 0; i < n / QK; i++) {
        const float *x = src + i * QK;
        ds4_block_q2_K *b = &out[i];
        int sc[16], m[16];
        affine_superblock(x, 16, 16, 3, 15, &b->d, &b->dmin, sc, m);
        const float d = f16(b->d), dmin = f16(b->dmin);
        memset(b->qs, 0, sizeof b->qs);
        for (int j = 0; j < 16; j++) {
            b->scales[j] = (uint8_t)(sc[j] | (m[j] << 4));
            const float dl = d * (float)sc[j], ml = dmin * (float)m[j];
            for (int k = 0; k < 16; k++) {
                const int e = 16 * j + k;
                const int q = affine_code(x[e], dl, ml, 3);
                const int h = e / 128, s = (e % 128) / 32, l = e % 32;
                b->qs[32 * h + l] |= (uint8_t)(q << (2 * s));
            }
        }
    }
}

float ds4_dot_f32_q2_K(const void *row, const float *x, int64_t n) {
    const ds4_block_q2_K *b = row;
    float buf[QK], sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        dequant_block_q2_K(&b[i], buf);
        sum += dot_block(buf, x + i * QK, QK);
    }
    return sum;
}

float ds4_dot_q8_K_q2_K(const void *row, const ds4_block_q8_K *x, int64_t n) {
    const ds4_block_q2_K *b = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        const ds4_block_q8_K *y = &x[i];
        int32_t isum = 0, summs = 0;
        for (int h = 0; h < 2; h++) {
            for (int s = 0; s < 4; s++) {
                for (int half16 = 0; half16 < 2; half16++) {
                    const int j = 8 * h + 2 * s + half16;
                    const int8_t *q8 = y->qs + 128 * h + 32 * s;
                    int32_t isub = 0;
                    for (int l = 16 * half16; l < 16 * half16 + 16; l++)
                        isub += ((b[i].qs[32 * h + l] >> (2 * s)) & 3) * q8[l];
                    isum += (b[i].scales[j] & 15) * isub;
                    summs += (b[i].scales[j] >> 4) * y->bsums[j];
                }
            }
        }
        const float dall = y->d * f16(b[i].d), dmin = y->d * f16(b[i].dmin);
        sum += dall * (float)isum - dmin * (float)summs;
    }
    return sum;
}

/* ------------------------------------------------------------------------ */
/* Q4_K                                                                      */
/* ------------------------------------------------------------------------ */
/*
 * Element e: chunk c = e/64, nibble k = (e%64)/32, l = e%32;
 * q = (qs[32c + l] >> 4k) & 15; sub-block j = e/32 = 2c + k.
 */

static void dequant_block_q4_K(const ds4_block_q4_K *b, float *y) {
    const float d = f16(b->d), dmin = f16(b->dmin);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        unpack_scale_min_k4(b->scales, j, &sc, &m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *qs = b->qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++) y[32 * j + l] = dl * (float)((qs[l] >> shift) & 15) - ml;
    }
}

void ds4_dequant_row_q4_K(const void *src, float *dst, int64_t n) {
    const ds4_block_q4_K *b = src;
    for (int64_t i = 0; i < n / QK; i++) dequant_block_q4_K(&b[i], dst + i * QK);
}

void ds4_quantize_row_q4_K(const float *src, void *dst, int64_t n) {
    ds4_block_q4_K *out = dst;
    for (int64_t i = 0; i < n / QK; i++) {
        const float *x = src + i * QK;
        ds4_block_q4_K *b = &out[i];
        int sc[8], m[8];
        affine_superblock(x, 8, 32, 15, 63, &b->d, &b->dmin, sc, m);
        pack_scales_min_k4(b->scales, sc, m);
        const float d = f16(b->d), dmin = f16(b->dmin);
        memset(b->qs, 0, sizeof b->qs);
        for (int j = 0; j < 8; j++) {
            const float dl = d * (float)sc[j], ml = dmin * (float)m[j];
            for (int l = 0; l < 32; l++) {
                const int q = affine_code(x[32 * j + l], dl, ml, 15);
                b->qs[32 * (j / 2) + l] |= (uint8_t)(q << (4 * (j % 2)));
            }
        }
    }
}

float ds4_dot_f32_q4_K(const void *row, const float *x, int64_t n) {
    const ds4_block_q4_K *b = row;
    float buf[QK], sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        dequant_block_q4_K(&b[i], buf);
        sum += dot_block(buf, x + i * QK, QK);
    }
    return sum;
}

float ds4_dot_q8_K_q4_K(const void *row, const ds4_block_q8_K *x, int64_t n) {
    const ds4_block_q4_K *b = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        const ds4_block_q8_K *y = &x[i];
        int32_t isum = 0, summs = 0;
        for (int j = 0; j < 8; j++) {
            int sc, m;
            unpack_scale_min_k4(b[i].scales, j, &sc, &m);
            const uint8_t *qs = b[i].qs + 32 * (j / 2);
            const int8_t *q8 = y->qs + 32 * j;
            const int shift = 4 * (j % 2);
            int32_t isub = 0;
            for (int l = 0; l < 32; l++) isub += ((qs[l] >> shift) & 15) * q8[l];
            isum += sc * isub;
            summs += m * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
        }
        const float d = f16(b[i].d) * y->d, dmin = f16(b[i].dmin) * y->d;
        sum += d * (float)isum - dmin * (float)summs;
    }
    return sum;
}

/* ------------------------------------------------------------------------ */
/* Q5_K                                                                      */
/* ------------------------------------------------------------------------ */
/*
 * As Q4_K for the low 4 bits; the 5th bit of element e (sub-block j = e/32,
 * l = e%32) is bit j of qh[l].
 */

static void dequant_block_q5_K(const ds4_block_q5_K *b, float *y) {
    const float d = f16(b->d), dmin = f16(b->dmin);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        unpack_scale_min_k4(b->scales, j, &sc, &m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *qs = b->qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++) {
            const int q = ((qs[l] >> shift) & 15) | (((b->qh[l] >> j) & 1) << 4);
            y[32 * j + l] = dl * (float)q - ml;
        }
    }
}

void ds4_dequant_row_q5_K(const void *src, float *dst, int64_t n) {
    const ds4_block_q5_K *b = src;
    for (int64_t i = 0; i < n / QK; i++) dequant_block_q5_K(&b[i], dst + i * QK);
}

void ds4_quantize_row_q5_K(const float *src, void *dst, int64_t n) {
    ds4_block_q5_K *out = dst;
    for (int64_t i = 0; i < n / QK; i++) {
        const float *x = src + i * QK;
        ds4_block_q5_K *b = &out[i];
        int sc[8], m[8];
        affine_superblock(x, 8, 32, 31, 63, &b->d, &b->dmin, sc, m);
        pack_scales_min_k4(b->scales, sc, m);
        const float d = f16(b->d), dmin = f16(b->dmin);
        memset(b->qs, 0, sizeof b->qs);
        memset(b->qh, 0, sizeof b->qh);
        for (int j = 0; j < 8; j++) {
            const float dl = d * (float)sc[j], ml = dmin * (float)m[j];
            for (int l = 0; l < 32; l++) {
                const int q = affine_code(x[32 * j + l], dl, ml, 31);
                b->qs[32 * (j / 2) + l] |= (uint8_t)((q & 15) << (4 * (j % 2)));
                b->qh[l] |= (uint8_t)((q >> 4) << j);
            }
        }
    }
}

float ds4_dot_f32_q5_K(const void *row, const float *x, int64_t n) {
    const ds4_block_q5_K *b = row;
    float buf[QK], sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        dequant_block_q5_K(&b[i], buf);
        sum += dot_block(buf, x + i * QK, QK);
    }
    return sum;
}

float ds4_dot_q8_K_q5_K(const void *row, const ds4_block_q8_K *x, int64_t n) {
    const ds4_block_q5_K *b = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        const ds4_block_q8_K *y = &x[i];
        int32_t isum = 0, summs = 0;
        for (int j = 0; j < 8; j++) {
            int sc, m;
            unpack_scale_min_k4(b[i].scales, j, &sc, &m);
            const uint8_t *qs = b[i].qs + 32 * (j / 2);
            const int8_t *q8 = y->qs + 32 * j;
            const int shift = 4 * (j % 2);
            int32_t isub = 0;
            for (int l = 0; l < 32; l++) {
                const int q = ((qs[l] >> shift) & 15) | (((b[i].qh[l] >> j) & 1) << 4);
                isub += q * q8[l];
            }
            isum += sc * isub;
            summs += m * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
        }
        const float d = f16(b[i].d) * y->d, dmin = f16(b[i].dmin) * y->d;
        sum += d * (float)isum - dmin * (float)summs;
    }
    return sum;
}

/* ------------------------------------------------------------------------ */
/* Q6_K                                                                      */
/* ------------------------------------------------------------------------ */
/*
 * Element e: half h = e/128, i = e%128;
 *   low 4 bits  = (ql[64h + i%64] >> 4*(i/64)) & 15
 *   high 2 bits = (qh[32h + i%32] >> 2*(i/32)) & 3
 * q = low | high << 4 in 0..63, value q - 32; sub-block e/16, int8 scale.
 */

static inline int q6_code(const ds4_block_q6_K *b, int e) {
    const int h = e / 128, i = e % 128;
    const int lo = (b->ql[64 * h + i % 64] >> (4 * (i / 64))) & 15;
    const int hi = (b->qh[32 * h + i % 32] >> (2 * (i / 32))) & 3;
    return lo | (hi << 4);
}

static void dequant_block_q6_K(const ds4_block_q6_K *b, float *y) {
    const float d = f16(b->d);
    for (int j = 0; j < 16; j++) {
        const float dl = d * (float)b->scales[j];
        for (int k = 0; k < 16; k++) {
            const int e = 16 * j + k;
            y[e] = dl * (float)(q6_code(b, e) - 32);
        }
    }
}

void ds4_dequant_row_q6_K(const void *src, float *dst, int64_t n) {
    const ds4_block_q6_K *b = src;
    for (int64_t i = 0; i < n / QK; i++) dequant_block_q6_K(&b[i], dst + i * QK);
}

void ds4_quantize_row_q6_K(const float *src, void *dst, int64_t n) {
    ds4_block_q6_K *out = dst;
    for (int64_t i = 0; i < n / QK; i++) {
        const float *x = src + i * QK;
        ds4_block_q6_K *b = &out[i];
        float a[16], amax = 0.0f;
        for (int j = 0; j < 16; j++) {
            a[j] = fit_symmetric(x + 16 * j, 16, 32);
            if (fabsf(a[j]) > amax) amax = fabsf(a[j]);
        }
        b->d = ds4_f32_to_f16(amax / 127.0f);
        const float d = f16(b->d);
        memset(b->ql, 0, sizeof b->ql);
        memset(b->qh, 0, sizeof b->qh);
        for (int j = 0; j < 16; j++) {
            const int sc0 = d > 0.0f ? clampi(round_int(a[j] / d), -127, 127) : 0;
            int sc = sc0;
            float best_err = INFINITY;
            for (int ts = sc0 - 1; ts <= sc0 + 1; ts++) { /* best nearby integer scale */
                if (ts < -127 || ts > 127) continue;
                const float tl = d * (float)ts;
                float err = 0.0f;
                for (int k = 0; k < 16; k++) {
                    const float xv = x[16 * j + k];
                    const int v = tl != 0.0f ? clampi(round_int(xv / tl), -32, 31) : 0;
                    const float e = tl * (float)v - xv;
                    err += e * e;
                }
                if (err < best_err) {
                    best_err = err;
                    sc = ts;
                }
            }
            b->scales[j] = (int8_t)sc;
            const float dl = d * (float)sc;
            for (int k = 0; k < 16; k++) {
                const int e = 16 * j + k;
                const int v = dl != 0.0f ? clampi(round_int(x[e] / dl), -32, 31) : 0;
                const int q = v + 32;
                const int h = e / 128, ii = e % 128;
                b->ql[64 * h + ii % 64] |= (uint8_t)((q & 15) << (4 * (ii / 64)));
                b->qh[32 * h + ii % 32] |= (uint8_t)((q >> 4) << (2 * (ii / 32)));
            }
        }
    }
}

float ds4_dot_f32_q6_K(const void *row, const float *x, int64_t n) {
    const ds4_block_q6_K *b = row;
    float buf[QK], sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        dequant_block_q6_K(&b[i], buf);
        sum += dot_block(buf, x + i * QK, QK);
    }
    return sum;
}

float ds4_dot_q8_K_q6_K(const void *row, const ds4_block_q8_K *x, int64_t n) {
    const ds4_block_q6_K *b = row;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        const ds4_block_q8_K *y = &x[i];
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            int32_t isub = 0;
            for (int k = 0; k < 16; k++) {
                const int e = 16 * j + k;
                isub += (q6_code(&b[i], e) - 32) * y->qs[e];
            }
            isum += b[i].scales[j] * isub;
        }
        sum += (f16(b[i].d) * y->d) * (float)isum;
    }
    return sum;
}

/*
 * ggml_quant.c: ggml block geometry, reference dequantization to f32, and
 * the fp16 / bf16 scalar conversions declared in gguf.h.
 *
 * Owns nothing: pure functions over caller buffers.
 *
 * Block layouts (little-endian, packed, ggml numbering; QK = elements/block):
 *   F32   1 elem,   4 B   F16 / BF16  1 elem, 2 B
 *   Q4_0  32 elem, 18 B   fp16 d; u8 qs[16]: elem j = low nibble of qs[j],
 *                         elem j+16 = high nibble; x = (q - 8) * d
 *   Q4_1  32 elem, 20 B   fp16 d, fp16 m; qs[16] as Q4_0; x = q * d + m
 *   Q8_0  32 elem, 34 B   fp16 d; i8 qs[32]; x = q * d
 *   Q4_K 256 elem, 144 B  fp16 d, fp16 dmin; u8 scales[12] holding 8 6-bit
 *                         scales and 8 6-bit mins; u8 qs[128]. Eight
 *                         sub-blocks of 32; each 64-element chunk c uses
 *                         qs[32c..32c+31]: low nibbles = sub-block 2c, high
 *                         nibbles = sub-block 2c+1; x = d*sc*q - dmin*m
 *   Q6_K 256 elem, 210 B  u8 ql[128] (low 4 bits), u8 qh[64] (high 2 bits),
 *                         i8 scales[16], fp16 d; sixteen sub-blocks of 16;
 *                         x = d * scale * (q - 32)
 * The math follows ggml's reference dequantize_row_* (ggml-quants.c) and is
 * written so that each output is computed with the same float operations in
 * the same order as that reference and as the `gguf` Python package
 * (gguf.quants), which the tests compare against bit for bit. Do not reorder
 * them; FMA contraction is switched off below for the same reason.
 *
 * Threading: reentrant.
 */
#include "engine/loader/gguf.h"

#include <string.h>

/* Keep a*b+c as two roundings even when built with FMA available
 * (-march=native): the bit-exact tests against gguf.quants depend on it. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* ---------------------------------------------------------------- scalars */

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

float specd_fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in f32 */
        float v = (float)man * 0x1p-24f;
        return bits_f32(f32_bits(v) | sign);
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (man << 13)); /* inf / nan */
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* Round to nearest, ties to even; overflow to inf; NaN stays NaN (quiet). */
uint16_t specd_f32_to_fp16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (a >= 0x38800000u) {                                   /* >= 2^-14: normal half */
        uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
        return (uint16_t)(sign | ((r - (112u << 23)) >> 13));
    }
    uint32_t e = a >> 23;
    if (e < 102) return sign; /* below 2^-25: rounds to zero */
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14..24 */
    uint32_t r = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

float specd_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t specd_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* ---------------------------------------------------------------- geometry */

int ggml_type_block(ggml_type t, uint32_t *block_elems, uint32_t *block_bytes) {
    uint32_t e, b;
    switch (t) {
    case GGML_TYPE_F32: e = 1; b = 4; break;
    case GGML_TYPE_F16: e = 1; b = 2; break;
    case GGML_TYPE_BF16: e = 1; b = 2; break;
    case GGML_TYPE_Q4_0: e = 32; b = 18; break;
    case GGML_TYPE_Q4_1: e = 32; b = 20; break;
    case GGML_TYPE_Q8_0: e = 32; b = 34; break;
    case GGML_TYPE_Q4_K: e = 256; b = 144; break;
    case GGML_TYPE_Q6_K: e = 256; b = 210; break;
    default: return -1;
    }
    if (block_elems) *block_elems = e;
    if (block_bytes) *block_bytes = b;
    return 0;
}

const char *ggml_type_name(ggml_type t) {
    switch (t) {
    case GGML_TYPE_F32: return "F32";
    case GGML_TYPE_F16: return "F16";
    case GGML_TYPE_BF16: return "BF16";
    case GGML_TYPE_Q4_0: return "Q4_0";
    case GGML_TYPE_Q4_1: return "Q4_1";
    case GGML_TYPE_Q8_0: return "Q8_0";
    case GGML_TYPE_Q4_K: return "Q4_K";
    case GGML_TYPE_Q6_K: return "Q6_K";
    }
    return "unknown";
}

/* ---------------------------------------------------------------- blocks */

static float rd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return specd_fp16_to_f32(h);
}

static void deq_q4_0(const uint8_t *b, float *y) {
    const float d = rd_f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)(qs[j] & 0x0f) - 8);
        y[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
    }
}

static void deq_q4_1(const uint8_t *b, float *y) {
    const float d = rd_f16(b), m = rd_f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(qs[j] & 0x0f) + m;
        y[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

static void deq_q8_0(const uint8_t *b, float *y) {
    const float d = rd_f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

/* Q4_K 6-bit scale/min number J (0..7) from the 12 packed bytes: entries
 * 0..3 sit in the low 6 bits of bytes 0..3 (scale) and 4..7 (min); entries
 * 4..7 take their low 4 bits from bytes 8..11 and their top 2 bits from the
 * top 2 bits of bytes 0..3 (scale) / 4..7 (min). */
static void q4k_scale_min(int j, const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
        *mn = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

static void deq_q4_k(const uint8_t *b, float *y) {
    const float d = rd_f16(b), dmin = rd_f16(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int c = 0; c < 4; c++) {
        uint8_t sc, mn;
        q4k_scale_min(2 * c, scales, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        q4k_scale_min(2 * c + 1, scales, &sc, &mn);
        const float d2 = d * (float)sc, m2 = dmin * (float)mn;
        for (int l = 0; l < 32; l++) y[l] = d1 * (float)(q[l] & 0x0f) - m1;
        for (int l = 0; l < 32; l++) y[32 + l] = d2 * (float)(q[l] >> 4) - m2;
        y += 64;
        q += 32;
    }
}

static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = rd_f16(b + 208);
    for (int half = 0; half < 2; half++) { /* two 128-element halves */
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = (d * (float)sc[is + 0]) * (float)q1;
            y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
            y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
            y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

int ggml_dequantize(ggml_type t, const void *src, float *dst, uint64_t n) {
    uint32_t be, bb;
    if (ggml_type_block(t, &be, &bb) || n % be != 0) return -1;
    const uint8_t *s = src;
    uint64_t nb = n / be;
    switch (t) {
    case GGML_TYPE_F32:
        memcpy(dst, s, (size_t)n * 4);
        return 0;
    case GGML_TYPE_F16:
        for (uint64_t i = 0; i < n; i++) dst[i] = rd_f16(s + 2 * i);
        return 0;
    case GGML_TYPE_BF16:
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = specd_bf16_to_f32(h);
        }
        return 0;
    case GGML_TYPE_Q4_0: for (uint64_t i = 0; i < nb; i++) deq_q4_0(s + i * bb, dst + i * be); return 0;
    case GGML_TYPE_Q4_1: for (uint64_t i = 0; i < nb; i++) deq_q4_1(s + i * bb, dst + i * be); return 0;
    case GGML_TYPE_Q8_0: for (uint64_t i = 0; i < nb; i++) deq_q8_0(s + i * bb, dst + i * be); return 0;
    case GGML_TYPE_Q4_K: for (uint64_t i = 0; i < nb; i++) deq_q4_k(s + i * bb, dst + i * be); return 0;
    case GGML_TYPE_Q6_K: for (uint64_t i = 0; i < nb; i++) deq_q6_k(s + i * bb, dst + i * be); return 0;
    }
    return -1;
}

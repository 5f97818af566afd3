/*
 * kn_moe_pack.c: host-side repacking of compressed-tensors int4 group-32
 * experts into the KN_I4IL layout the MoE kernels read (kernels/kn_moe.h
 * states both layouts), its inverse, and the host dequantisation of the
 * repacked form (the reference the device's dequantisation is tested
 * against, bit for bit).
 *
 * Invariants: repacking permutes the 8 nibbles inside each 32-bit word and
 * nothing else (rows, words and scales keep their places), so it is a
 * bijection on words and kn_i4_unpack(kn_i4_repack(w)) == w for every word;
 * the dequantised value of element c of a row is bf16(q x scale), q = u - 8,
 * rounded to nearest even as compressed-tensors does (docs/kimi-k2.5.md,
 * "int4 experts").
 * Plain C, no CUDA: built into specd_kn_pack whether or not CUDA is found
 * (tests/kimi_c kimi_c_int4_repack runs on every CI machine).
 * Threading: pure functions over caller buffers.
 */
#include <string.h>

#include "kernels/kn_moe.h"

const int KN_I4IL_ORDER[8] = {0, 2, 4, 6, 1, 3, 5, 7};

/* new word: slot j (bits 4j..) = element ORDER[j] of the old word (bits 4 ORDER[j]..) */
static uint32_t word_repack(uint32_t w) {
    uint32_t o = 0;
    for (int j = 0; j < 8; j++) o |= ((w >> (4 * KN_I4IL_ORDER[j])) & 0xfu) << (4 * j);
    return o;
}

static uint32_t word_unpack(uint32_t w) {
    uint32_t o = 0;
    for (int j = 0; j < 8; j++) o |= ((w >> (4 * j)) & 0xfu) << (4 * KN_I4IL_ORDER[j]);
    return o;
}

static int shape_ok(const void *in, int64_t rows, int64_t cols, const void *out) {
    return in && out && rows >= 1 && cols >= 32 && cols % 32 == 0;
}

int kn_i4_repack(const uint32_t *in, int64_t rows, int64_t cols, uint32_t *out) {
    if (!shape_ok(in, rows, cols, out)) return -1;
    const int64_t n = rows * (cols / 8);
    for (int64_t i = 0; i < n; i++) out[i] = word_repack(in[i]);
    return 0;
}

int kn_i4_unpack(const uint32_t *in, int64_t rows, int64_t cols, uint32_t *out) {
    if (!shape_ok(in, rows, cols, out)) return -1;
    const int64_t n = rows * (cols / 8);
    for (int64_t i = 0; i < n; i++) out[i] = word_unpack(in[i]);
    return 0;
}

/* bf16 bits of the f32 x rounded to nearest even (inf / NaN: truncated). */
static uint16_t f32_to_bf16_rne(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    if ((b & 0x7f800000u) != 0x7f800000u) b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

void kn_i4il_dequant_row(const uint32_t *il, const uint16_t *scales, int64_t cols, int64_t row, uint16_t *out) {
    const uint32_t *w = il + row * (cols / 8);
    const uint16_t *sc = scales + row * (cols / 32);
    for (int64_t c = 0; c < cols; c++) {
        const uint32_t word = w[c / 8];
        const int e = (int)(c % 8), slot = (e & 1) ? 4 + e / 2 : e / 2; /* inverse of KN_I4IL_ORDER */
        const int q = (int)((word >> (4 * slot)) & 0xfu) - 8;
        const uint32_t sb = (uint32_t)sc[c / 32] << 16;
        float s;
        memcpy(&s, &sb, 4);
        out[c] = f32_to_bf16_rne(s * (float)q); /* exact in f32 (<= 12 significant bits): one rounding */
    }
}

size_t kn_moe_w13_words(int32_t E, int32_t H, int32_t I) { return (size_t)E * 2 * (size_t)I * (size_t)(H / 8); }
size_t kn_moe_s13_count(int32_t E, int32_t H, int32_t I) { return (size_t)E * 2 * (size_t)I * (size_t)(H / 32); }
size_t kn_moe_w2_words(int32_t E, int32_t H, int32_t I) { return (size_t)E * (size_t)H * (size_t)(I / 8); }
size_t kn_moe_s2_count(int32_t E, int32_t H, int32_t I) { return (size_t)E * (size_t)H * (size_t)(I / 32); }

int kn_moe_pack_expert(int32_t E, int32_t H, int32_t I, int32_t e, const uint32_t *gate_w, const uint16_t *gate_s,
                       const uint32_t *up_w, const uint16_t *up_s, const uint32_t *down_w, const uint16_t *down_s,
                       uint32_t *w13, uint16_t *s13, uint32_t *w2, uint16_t *s2) {
    if (E < 1 || e < 0 || e >= E || H < 32 || H % 32 || I < 32 || I % 32 || !gate_s || !up_s || !down_s || !w13 ||
        !s13 || !w2 || !s2)
        return -1;
    const size_t gw = (size_t)I * (size_t)(H / 8), gs = (size_t)I * (size_t)(H / 32);
    const size_t dw = (size_t)H * (size_t)(I / 8), ds = (size_t)H * (size_t)(I / 32);
    uint32_t *o13 = w13 + (size_t)e * 2 * gw, *o2 = w2 + (size_t)e * dw;
    if (kn_i4_repack(gate_w, I, H, o13) || kn_i4_repack(up_w, I, H, o13 + gw) || kn_i4_repack(down_w, H, I, o2))
        return -1;
    memcpy(s13 + (size_t)e * 2 * gs, gate_s, gs * 2);
    memcpy(s13 + (size_t)e * 2 * gs + gs, up_s, gs * 2);
    memcpy(s2 + (size_t)e * ds, down_s, ds * 2);
    return 0;
}

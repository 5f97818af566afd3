/*
 * test_int4_repack.c (kimi_c_int4_repack): the repacking of compressed-tensors
 * int4 group-32 experts into the MoE kernels' KN_I4IL layout (kernels/kn_moe.h,
 * kernels/kn_moe_pack.c), on the CPU:
 *   - on the 9 rows of tests/fixtures/kimi/int4_dequant.json (compressed-tensors'
 *     own PackedQuantizationCompressor.decompress, bf16): the repacked form
 *     dequantised by the host (kn_i4il_dequant_row) AND by an emulation of the
 *     device's bf16x2 instruction sequence (mask | 0x4300 magic, - 136, x scale,
 *     each bf16x2 fma rounded once) equals the fixture bit for bit, and at least
 *     one value of the fixture needs the bf16 rounding (so the rounding is tested);
 *     unpacking gives the fixture's words back;
 *   - on seeded random matrices holding every nibble at every word position, with
 *     scales from subnormal to large: round trip word for word, and the repacked
 *     dequantisation == the CPU backend's BK_W_I4G32 dequantisation
 *     (bk_weight_row_f32, proven equal to compressed-tensors by kimi_c_int4);
 *   - kn_moe_pack_expert puts gate / up / down and their scales at the documented
 *     places of a layer and touches nothing else; bad shapes are refused.
 * Needs no checkpoint and no GPU.
 */
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/backend/backend.h"
#include "kernels/kn_moe.h"
#include "tests/kimi_c/kimi_c_util.h"

static json_t *g_fx;

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd32(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}

/* x rotated left by 4n bits (n = 0..7) */
static uint32_t rotl4(uint32_t x, int n) { return n ? x << (4 * n) | x >> (32 - 4 * n) : x; }

static float bf16_f32(uint32_t h) {
    uint32_t b = h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static uint32_t f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* One bf16 RNE rounding of an exact f32 value (emulates a bf16x2 fma lane). */
static uint32_t bf16_rn(float x) {
    uint32_t b = f32_bits(x);
    b += 0x7fffu + ((b >> 16) & 1u);
    return b >> 16;
}

/* The device's dequantisation of one KN_I4IL word (kernels/kn_moe.cu dequant_word), emulated:
 * t = ((w >> 4p) & 0x000F000F) | 0x43004300 is the bf16 pair (128 + u_lo, 128 + u_hi);
 * q = fma(t, 1, -136), v = fma(q, s, -0): both exact products, one rounding each. */
static void emulate_device_word(uint32_t w, uint16_t scale, uint16_t out[8]) {
    for (int p = 0; p < 4; p++) {
        const uint32_t t = ((w >> (4 * p)) & 0x000F000Fu) | 0x43004300u;
        for (int h = 0; h < 2; h++) {
            const float tv = bf16_f32((t >> (16 * h)) & 0xffffu);
            const uint32_t q = bf16_rn(tv * 1.0f + (-136.0f));
            out[2 * p + h] = (uint16_t)bf16_rn(bf16_f32(q) * bf16_f32(scale) + (-0.0f));
        }
    }
}

static void test_fixture_rows(void **st) {
    (void)st;
    const json_t *rows = json_object_get(g_fx, "rows");
    size_t n_vals = 0, n_rounded = 0;
    assert_true(json_array_size(rows) >= 9);
    for (size_t k = 0; k < json_array_size(rows); k++) {
        const json_t *r = json_array_get(rows, k);
        const json_t *pk = json_object_get(r, "packed_u32"), *sc = json_object_get(r, "scale_bf16_bits");
        const json_t *dq = json_object_get(r, "dequant_bf16_bits"), *qv = json_object_get(r, "q");
        const int cols = (int)json_integer_value(json_array_get(json_object_get(r, "shape"), 1));
        assert_true(cols % 32 == 0 && cols <= 512);
        uint32_t words[64], il[64], back[64];
        uint16_t scales[16], out[512], dev[8];
        for (int j = 0; j < cols / 8; j++) words[j] = (uint32_t)json_integer_value(json_array_get(pk, (size_t)j));
        for (int j = 0; j < cols / 32; j++) scales[j] = (uint16_t)json_integer_value(json_array_get(sc, (size_t)j));
        assert_int_equal(kn_i4_repack(words, 1, cols, il), 0);
        kn_i4il_dequant_row(il, scales, cols, 0, out);
        for (int c = 0; c < cols; c++) {
            const uint32_t want = (uint32_t)json_integer_value(json_array_get(dq, (size_t)c));
            assert_int_equal(out[c], want);
            if (c % 8 == 0) emulate_device_word(il[c / 8], scales[c / 32], dev);
            assert_int_equal(dev[c % 8], want);
            /* q itself sits where the layout says */
            const int e = c % 8, slot = (e & 1) ? 4 + e / 2 : e / 2;
            assert_int_equal((int)((il[c / 8] >> (4 * slot)) & 0xf) - 8, (int)json_integer_value(json_array_get(qv, (size_t)c)));
            /* would keeping q*scale in f32 have differed? */
            const float exact = bf16_f32(scales[c / 32]) * (float)json_integer_value(json_array_get(qv, (size_t)c));
            n_rounded += f32_bits(exact) != want << 16;
            n_vals++;
        }
        assert_int_equal(kn_i4_unpack(il, 1, cols, back), 0);
        assert_memory_equal(back, words, sizeof(uint32_t) * (size_t)(cols / 8));
    }
    printf("kimi_c_int4_repack: %zu fixture values: repacked (host and emulated device bf16x2 path) == "
           "compressed-tensors, %zu need the bf16 rounding\n", n_vals, n_rounded);
    assert_true(n_rounded > 0);
}

/* a bf16 scale: mostly Kimi-like (max|w| / 7.5 ~ 1e-3..1e-1), some subnormal, tiny, large, negative */
static uint16_t rnd_scale(int i) {
    switch (i % 8) {
    case 0: return (uint16_t)(rnd32() & 0x007f) | 1;          /* subnormal */
    case 1: return (uint16_t)(0x0080 + (rnd32() & 0x3ff));    /* tiny normal */
    case 2: return (uint16_t)(0x4000 + (rnd32() & 0x0fff));   /* 2 .. 2^9 */
    case 3: return (uint16_t)(0x8000 | (0x3c00 + (rnd32() & 0x3ff))); /* negative */
    default: return (uint16_t)(0x3a00 + (rnd32() & 0x3ff));  /* 5e-4 .. 2e-2 */
    }
}

static void test_random_matrices(void **st) {
    (void)st;
    const int shapes[][2] = {{1, 32}, {3, 64}, {64, 128}, {17, 256}, {8, 7168}, {256, 256}};
    size_t n_vals = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int rows = shapes[si][0], cols = shapes[si][1];
        const size_t nw = (size_t)rows * (size_t)cols / 8, ns = (size_t)rows * (size_t)cols / 32;
        uint32_t *w = malloc(nw * 4), *il = malloc(nw * 4), *back = malloc(nw * 4);
        uint16_t *s = malloc(ns * 2), *out = malloc((size_t)cols * 2);
        float *ref = malloc((size_t)cols * 4);
        assert_non_null(w && il && back && s && out && ref);
        for (size_t i = 0; i < nw; i++) {
            w[i] = rnd32();
            /* every nibble value at every position of some word */
            if (i < 16) w[i] = 0x11111111u * (uint32_t)i;
            else if (i < 32) w[i] = rotl4(i < 24 ? 0x76543210u : 0xfedcba98u, (int)(i % 8));
        }
        for (size_t i = 0; i < ns; i++) s[i] = rnd_scale((int)i);
        assert_int_equal(kn_i4_repack(w, rows, cols, il), 0);
        assert_int_equal(kn_i4_unpack(il, rows, cols, back), 0);
        assert_memory_equal(back, w, nw * 4);
        /* in place, word by word */
        memcpy(back, w, nw * 4);
        assert_int_equal(kn_i4_repack(back, rows, cols, back), 0);
        assert_memory_equal(back, il, nw * 4);
        bk_weight bw = {.type = BK_W_I4G32, .rows = rows, .cols = cols, .data = w, .row_bytes = (size_t)cols / 2,
                        .scales = s};
        for (int r = 0; r < rows; r++) {
            bk_weight_row_f32(&bw, r, ref);
            kn_i4il_dequant_row(il, s, cols, r, out);
            for (int c = 0; c < cols; c++) {
                if (f32_bits(ref[c]) != (uint32_t)out[c] << 16)
                    fail_msg("shape [%d x %d] row %d col %d: repacked %04x, CPU backend %08x", rows, cols, r, c,
                             out[c], f32_bits(ref[c]));
                if (c % 8 == 0) {
                    uint16_t dev[8];
                    emulate_device_word(il[(size_t)r * (size_t)cols / 8 + (size_t)c / 8],
                                        s[(size_t)r * (size_t)cols / 32 + (size_t)c / 32], dev);
                    for (int e = 0; e < 8; e++) assert_int_equal((uint32_t)dev[e] << 16, f32_bits(ref[c + e]));
                }
            }
            n_vals += (size_t)cols;
        }
        free(w); free(il); free(back); free(s); free(out); free(ref);
    }
    printf("kimi_c_int4_repack: %zu random values (every nibble at every position, subnormal..large scales): "
           "round trip exact, dequant == CPU backend\n", n_vals);
}

static void test_pack_expert(void **st) {
    (void)st;
    const int32_t E = 3, H = 64, I = 32, e = 1;
    const size_t n13 = kn_moe_w13_words(E, H, I), ns13 = kn_moe_s13_count(E, H, I);
    const size_t n2 = kn_moe_w2_words(E, H, I), ns2 = kn_moe_s2_count(E, H, I);
    assert_int_equal(n13, (size_t)E * 2 * I * H / 8);
    assert_int_equal(n2, (size_t)E * H * I / 8);
    uint32_t *w13 = malloc(n13 * 4), *w2 = malloc(n2 * 4);
    uint16_t *s13 = malloc(ns13 * 2), *s2 = malloc(ns2 * 2);
    uint32_t gw[32 * 8], uw[32 * 8], dw[64 * 4], back[32 * 8];
    uint16_t gs[32 * 2], us[32 * 2], ds[64 * 1];
    for (size_t i = 0; i < 32 * 8; i++) { gw[i] = rnd32(); uw[i] = rnd32(); }
    for (size_t i = 0; i < 64 * 4; i++) dw[i] = rnd32();
    for (size_t i = 0; i < 64; i++) { gs[i] = (uint16_t)rnd32(); us[i] = (uint16_t)rnd32(); ds[i] = (uint16_t)rnd32(); }
    memset(w13, 0xab, n13 * 4); memset(w2, 0xab, n2 * 4); memset(s13, 0xab, ns13 * 2); memset(s2, 0xab, ns2 * 2);
    assert_int_equal(kn_moe_pack_expert(E, H, I, e, gw, gs, uw, us, dw, ds, w13, s13, w2, s2), 0);
    const size_t gwn = (size_t)I * H / 8, gsn = (size_t)I * H / 32, dwn = (size_t)H * I / 8, dsn = (size_t)H * I / 32;
    /* gate rows then up rows of expert e; down; scales copied unchanged */
    assert_int_equal(kn_i4_unpack(w13 + e * 2 * gwn, I, H, back), 0);
    assert_memory_equal(back, gw, gwn * 4);
    assert_int_equal(kn_i4_unpack(w13 + e * 2 * gwn + gwn, I, H, back), 0);
    assert_memory_equal(back, uw, gwn * 4);
    assert_int_equal(kn_i4_unpack(w2 + e * dwn, H, I, back), 0);
    assert_memory_equal(back, dw, dwn * 4);
    assert_memory_equal(s13 + e * 2 * gsn, gs, gsn * 2);
    assert_memory_equal(s13 + e * 2 * gsn + gsn, us, gsn * 2);
    assert_memory_equal(s2 + e * dsn, ds, dsn * 2);
    /* the other experts untouched */
    for (size_t i = 0; i < n13; i++) if (i / (2 * gwn) != (size_t)e) assert_int_equal(w13[i], 0xababababu);
    for (size_t i = 0; i < n2; i++) if (i / dwn != (size_t)e) assert_int_equal(w2[i], 0xababababu);
    for (size_t i = 0; i < ns13; i++) if (i / (2 * gsn) != (size_t)e) assert_int_equal(s13[i], 0xabab);
    for (size_t i = 0; i < ns2; i++) if (i / dsn != (size_t)e) assert_int_equal(s2[i], 0xabab);
    /* refusals: group 32 must divide both dims; expert index in range */
    assert_int_equal(kn_moe_pack_expert(E, 48, I, e, gw, gs, uw, us, dw, ds, w13, s13, w2, s2), -1);
    assert_int_equal(kn_moe_pack_expert(E, H, 16, e, gw, gs, uw, us, dw, ds, w13, s13, w2, s2), -1);
    assert_int_equal(kn_moe_pack_expert(E, H, I, 3, gw, gs, uw, us, dw, ds, w13, s13, w2, s2), -1);
    assert_int_equal(kn_i4_repack(gw, 1, 40, back), -1);
    assert_int_equal(kn_i4_repack(gw, 0, 32, back), -1);
    assert_int_equal(kn_i4_unpack(NULL, 1, 32, back), -1);
    free(w13); free(w2); free(s13); free(s2);
}

int main(void) {
    g_fx = kc_fixture("int4_dequant.json");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture_rows),
        cmocka_unit_test(test_random_matrices),
        cmocka_unit_test(test_pack_expert),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    json_decref(g_fx);
    return rc;
}

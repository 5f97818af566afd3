/*
 * kn_emu_selftest.cpp (ctest kn_emu_selftest, label unit): the emulation's
 * own semantics, each against an independent reference, so that a pass of
 * the kernel tests under tools/kn_emu means what README.md says.
 *  - fma.rn.bf16x2 (kn_emu_bf16x2_fma_rn) vs exact integer arithmetic (the
 *    sum in a 128-bit integer at the smaller exponent, rounded to 8 bits by
 *    hand), 2 M random triples with exponent gaps the integer can hold plus
 *    planted ties, subnormals, cancellation and overflow;
 *  - f32 -> bf16 RNE (ties both ways, NaN -> 0x7fff, overflow to inf);
 *  - f16 -> f32 (__half2float) on all 65,536 inputs vs ldexp;
 *  - shuffles (xor / up / down / idx, width 32 and 16) vs their formulas, on
 *    a block of 64 threads in two warps, with int, float and double values;
 *  - dynamic shared memory refilled with 0xA5 before each block;
 *  - launch limits: cudaGetLastError returns cudaErrorInvalidConfiguration
 *    once, then cudaSuccess;
 *  - the aborts (in a child process each): a shuffle reading an exited lane,
 *    lanes at different warp operations, a misaligned 16-byte load, a block
 *    warp whose lanes split between __syncthreads and a warp operation.
 * Exits 0 when every check holds, 1 otherwise (lists the failures).
 */
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime.h>
#include <cuda_fp16.h>

static int g_fail, g_checks;
#define CHECK(cond, ...)                                \
    do {                                                \
        g_checks++;                                     \
        if (!(cond)) {                                  \
            g_fail++;                                   \
            printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                        \
            printf("\n");                               \
        }                                               \
    } while (0)

static uint64_t g_rng = 0x853c49e6748fea9bull;
static uint64_t rnd() { /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* ---------------------------------------------------------------- bf16 fma reference
 * A finite bf16 as (-1)^s m 2^e with an integer m < 256 (subnormals: e = -133). */
struct fin { int s; int64_t m; int e; };
static fin bf16_decode(uint16_t h) {
    const int s = h >> 15, ex = (h >> 7) & 0xff, mt = h & 0x7f;
    if (ex == 0) return fin{s, mt, -133};
    return fin{s, 128 + mt, ex - 134};
}
/* Rounds the exact value (-1)^neg v 2^e (v > 0, an integer) to bf16, round to nearest even. */
static uint16_t bf16_round(int neg, unsigned __int128 v, int e) {
    const uint16_t sg = (uint16_t)(neg << 15);
    int nb = 0;
    for (unsigned __int128 t = v; t; t >>= 1) nb++;
    /* value = v 2^e; normal bf16: 8 significant bits, exponent of the lsb >= -133 */
    int lsb = e + nb - 8; /* exponent of the last kept bit for 8 significant bits */
    if (lsb < -133) lsb = -133;
    const int sh = lsb - e; /* bits to drop (may be <= 0: exact) */
    unsigned __int128 q = v;
    if (sh > 0) {
        const unsigned __int128 rem = v & (((unsigned __int128)1 << sh) - 1), half = (unsigned __int128)1 << (sh - 1);
        q = v >> sh;
        if (rem > half || (rem == half && (q & 1))) q++;
    } else {
        q = v << -sh;
    }
    if (q == 0) return sg;
    /* q 2^lsb with q <= 256: renormalise */
    int le = lsb;
    if (q == 256) q = 128, le++;
    if (q < 128) return (uint16_t)(sg | (uint16_t)q); /* subnormal (le == -133) */
    const int ex = le + 134;
    if (ex >= 255) return (uint16_t)(sg | 0x7f80u);
    return (uint16_t)(sg | (uint16_t)(ex << 7) | (uint16_t)(q - 128));
}
/* bf16(a b + c) exactly, for finite a, b, c whose aligned sum fits 120 bits; ok = 0 when it does not. */
static uint16_t ref_fma(uint16_t a, uint16_t b, uint16_t c, int *ok) {
    const fin A = bf16_decode(a), B = bf16_decode(b), C = bf16_decode(c);
    const int sp = A.s ^ B.s;
    const int64_t mp = A.m * B.m;
    const int ep = A.e + B.e;
    if (mp == 0 && C.m == 0) { *ok = 1; return (uint16_t)((sp & C.s) << 15); } /* +-0 rules of RNE */
    const int e0 = mp == 0 ? C.e : C.m == 0 ? ep : (ep < C.e ? ep : C.e);
    const int gp = ep - e0, gc = C.e - e0;
    if ((mp && gp > 100) || (C.m && gc > 100)) { *ok = 0; return 0; }
    *ok = 1;
    __int128 vp = mp ? (__int128)mp << gp : 0, vc = C.m ? (__int128)C.m << gc : 0;
    const __int128 v = (sp ? -vp : vp) + (C.s ? -vc : vc);
    if (v == 0) return 0; /* exact cancellation: +0 in round to nearest */
    return bf16_round(v < 0, (unsigned __int128)(v < 0 ? -v : v), e0);
}
static uint16_t rand_bf16(int emin, int emax) { /* finite, biased exponent in [emin, emax], random sign */
    const int ex = emin + (int)(rnd() % (uint64_t)(emax - emin + 1));
    return (uint16_t)(((rnd() & 1) << 15) | ((unsigned)ex << 7) | (rnd() & 0x7f));
}

static void test_bf16_fma() {
    long n = 0, skipped = 0, bad = 0;
    for (long i = 0; i < 2000000; i++) {
        uint16_t a, b, c;
        switch (i % 4) {
        case 0: a = rand_bf16(100, 154), b = rand_bf16(100, 154), c = rand_bf16(90, 170); break;  /* near 1 */
        case 1: a = rand_bf16(0, 40), b = rand_bf16(60, 100), c = rand_bf16(0, 20); break;       /* subnormal */
        case 2: a = rand_bf16(1, 254), b = rand_bf16(1, 254), c = rand_bf16(1, 254); break;      /* anywhere */
        default: { /* cancellation: c ~ -(a b) */
            a = rand_bf16(110, 140), b = rand_bf16(110, 140);
            const float p = __uint_as_float((uint32_t)a << 16) * __uint_as_float((uint32_t)b << 16);
            c = (uint16_t)((kn_emu_f32_to_bf16_rn(-p) + (rnd() % 5) - 2) & 0xffff);
            if (((c >> 7) & 0xff) == 0xff) c = 0;
        }
        }
        int ok;
        const uint16_t want = ref_fma(a, b, c, &ok);
        if (!ok) { skipped++; continue; }
        const uint16_t got = kn_emu_bf16_fma_rn(a, b, c);
        n++;
        if (got != want && bad++ < 5) printf("FAIL bf16 fma %04x * %04x + %04x: %04x, exact %04x\n", a, b, c, got, want);
    }
    CHECK(bad == 0, "bf16 fma: %ld of %ld differ from the exact rounding", bad, n);
    /* planted: ties (1 + 2^-8 exact sums), overflow, NaN */
    struct { uint16_t a, b, c, want; } pl[] = {
        {0x3f80, 0x3f80, 0x3b80, 0x3f80}, /* 1 + 2^-8: tie, even -> 1 */
        {0x3f81, 0x3f80, 0x3b80, 0x3f82}, /* 1+2^-7 + 2^-8: tie, odd -> up */
        {0x3f80, 0x3f80, 0x3b81, 0x3f81}, /* just above the tie -> up */
        {0x7f7f, 0x4000, 0x0000, 0x7f80}, /* 2 x max -> inf */
        {0x7f80, 0x0000, 0x3f80, 0x7fff}, /* inf x 0 -> NaN, canonical */
        {0x3f80, 0xbf80, 0x3f80, 0x0000}, /* 1 x -1 + 1 = +0 */
        {0x8000, 0x3f80, 0x8000, 0x8000}, /* -0 x 1 + -0 = -0 */
    };
    for (auto &p : pl) {
        const uint16_t got = kn_emu_bf16_fma_rn(p.a, p.b, p.c);
        CHECK(got == p.want, "bf16 fma %04x * %04x + %04x: %04x, want %04x", p.a, p.b, p.c, got, p.want);
    }
    CHECK(kn_emu_bf16x2_fma_rn(0x3f803f81u, 0x3f803f80u, 0x3b803b80u) == 0x3f803f82u, "bf16x2: halves swapped");
    printf("bf16 fma: %ld random triples == exact integer rounding (%ld outside the reference's range), planted "
           "ties / overflow / NaN / signed zeros\n", n, skipped);
}

static void test_conversions() {
    struct { uint32_t f; uint16_t want; } cv[] = {
        {0x3f808000u, 0x3f80}, {0x3f818000u, 0x3f82}, {0x3f808001u, 0x3f81}, {0x7f7fffffu, 0x7f80},
        {0xff7f8000u, 0xff80}, {0x00008000u, 0x0000}, {0x00018000u, 0x0002}, {0x7fc00000u, 0x7fff},
        {0xffc00001u, 0x7fff}, {0x7f800001u, 0x7fff}, {0x80000000u, 0x8000}, {0xff800000u, 0xff80},
    };
    for (auto &c : cv) {
        const uint16_t got = kn_emu_f32_to_bf16_rn(__uint_as_float(c.f));
        CHECK(got == c.want, "f32 %08x -> bf16 %04x, want %04x", c.f, got, c.want);
    }
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
        const double mag = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
        const float want = (float)((h & 0x8000) ? -mag : mag), got = __half2float(__ushort_as_half((unsigned short)h));
        if (isnan(want) ? !isnan(got) : memcmp(&want, &got, 4) != 0) bad++;
    }
    CHECK(bad == 0, "__half2float: %d of 65536 inputs differ from ldexp", bad);
    printf("conversions: f32 -> bf16 RNE (ties, NaN -> 0x7fff, overflow), all 65536 f16 -> f32\n");
}

/* ---------------------------------------------------------------- threads */
static int *g_out;
static void k_shuffles() {
    const int t = (int)threadIdx.x;
    int *o = g_out + t * 8;
    o[0] = __shfl_xor_sync(0xffffffffu, t * 3, 5);
    o[1] = __shfl_up_sync(0xffffffffu, t, 3);
    o[2] = __shfl_down_sync(0xffffffffu, t, 4);
    o[3] = __shfl_sync(0xffffffffu, t, 7);
    o[4] = __shfl_xor_sync(0xffffffffu, t, 16, 16); /* source in a later segment: own value */
    o[5] = __shfl_up_sync(0xffffffffu, t, 2, 16);
    o[6] = (int)__shfl_xor_sync(0xffffffffu, (float)t + 0.5f, 1);
    o[7] = (int)(__shfl_down_sync(0xffffffffu, (double)t * 1e10, 1, 16) / 1e10);
}
static void test_shuffles() {
    int out[64 * 8];
    g_out = out;
    kn_emu_launch(k_shuffles, dim3(1), dim3(64), 0);
    int bad = 0;
    for (int t = 0; t < 64; t++) {
        const int lane = t & 31, w = t & ~31;
        const int want[8] = {(w + (lane ^ 5)) * 3,
                             lane >= 3 ? t - 3 : t,
                             lane + 4 < 32 ? t + 4 : t,
                             w + 7,
                             lane < 16 ? t : t - 16, /* lane ^ 16: a later 16-lane segment gives the own value */
                             (lane % 16) >= 2 ? t - 2 : t,
                             t ^ 1,
                             (lane % 16) + 1 < 16 ? t + 1 : t};
        for (int k = 0; k < 8; k++)
            if (out[t * 8 + k] != want[k] && bad++ < 5)
                printf("FAIL shuffle %d thread %d: %d, want %d\n", k, t, out[t * 8 + k], want[k]);
    }
    CHECK(bad == 0, "shuffles: %d wrong values", bad);
    printf("shuffles: xor / up / down / idx, widths 32 and 16, int / float / double, 2 warps\n");
}

static int g_seen[4];
static void k_dyn() {
    unsigned char *s = static_cast<unsigned char *>(kn_emu_dyn_smem());
    if (threadIdx.x == 0) {
        g_seen[blockIdx.x] = s[0] == 0xA5 && s[99] == 0xA5;
        s[0] = s[99] = 0; /* the next block must see garbage again */
    }
}
static void k_nop() {}
static void test_launches() {
    kn_emu_launch(k_dyn, dim3(4), dim3(32), 100);
    CHECK(g_seen[0] && g_seen[1] && g_seen[2] && g_seen[3], "dynamic shared memory not refilled per block");
    CHECK(cudaGetLastError() == cudaSuccess, "a good launch set an error");
    kn_emu_launch(k_nop, dim3(1), dim3(1025), 0);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "1025 threads: no cudaErrorInvalidConfiguration");
    CHECK(cudaGetLastError() == cudaSuccess, "the launch error was not cleared by reading it");
    kn_emu_launch(k_nop, dim3(1, 65536), dim3(32), 0);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "grid.y 65536 accepted");
    kn_emu_launch(k_nop, dim3(1), dim3(32), 49153);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "49153 bytes of dynamic shared memory accepted");
    printf("launches: dynamic shared memory garbage per block, launch limits through cudaGetLastError\n");
}

/* ---------------------------------------------------------------- aborts */
static void k_exited_lane() {
    if (threadIdx.x == 3) return;
    (void)__shfl_xor_sync(0xffffffffu, 1, 1); /* lane 2 reads lane 3, which exited */
}
static void k_mixed_warp_ops() {
    if (threadIdx.x < 16) __syncwarp();
    else (void)__shfl_xor_sync(0xffffffffu, 1, 1);
}
static void k_misaligned() {
    alignas(16) static float buf[8];
    (void)__ldg(reinterpret_cast<const float4 *>(buf + 1));
}
static void k_block_vs_warp() { /* half a warp at each: neither barrier can complete */
    if (threadIdx.x < 16) __syncthreads();
    else __syncwarp();
}
static int dies(void (*k)(), unsigned threads) {
    fflush(stdout);
    const pid_t p = fork();
    if (p == 0) {
        if (!freopen("/dev/null", "w", stderr)) _exit(2);
        kn_emu_launch(k, dim3(1), dim3(threads), 0);
        _exit(0);
    }
    int st = 0;
    waitpid(p, &st, 0);
    return WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT;
}
static void test_aborts() {
    CHECK(dies(k_exited_lane, 32), "a shuffle from an exited lane did not abort");
    CHECK(dies(k_mixed_warp_ops, 32), "__syncwarp and a shuffle met in one warp without an abort");
    CHECK(dies(k_misaligned, 1), "a misaligned float4 __ldg did not abort");
    CHECK(dies(k_block_vs_warp, 32), "__syncthreads vs __syncwarp in one warp did not abort");
    printf("aborts: shuffle from an exited lane, mixed warp operations, misaligned float4 load, block/warp deadlock\n");
}

int main() {
    test_bf16_fma();
    test_conversions();
    test_shuffles();
    test_launches();
    test_aborts();
    printf("%s: %d checks, %d failed\n", g_fail ? "FAIL" : "ok", g_checks, g_fail);
    return g_fail ? 1 : 0;
}

/*
 * cuda_fp16.h of the kn_emu CPU emulation (tools/kn_emu/README.md): the f16
 * type and the conversions specd's kernels use, exact. Not the toolkit's.
 */
#ifndef KN_EMU_CUDA_FP16_H
#define KN_EMU_CUDA_FP16_H

#include <cstdint>
#include <cstring>

struct __half {
    unsigned short x; /* the IEEE binary16 bits */
};
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
/* binary16 -> f32, exact (subnormals, infinities, NaN payloads kept) */
inline float __half2float(__half h) {
    const uint32_t s = (uint32_t)(h.x & 0x8000u) << 16, e = (h.x >> 10) & 0x1fu, m = h.x & 0x3ffu;
    uint32_t u;
    if (e == 0x1f) {
        u = s | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        u = s | ((e + 112) << 23) | (m << 13);
    } else if (m == 0) {
        u = s;
    } else { /* subnormal: m x 2^-24, normalised */
        int sh = 0;
        uint32_t mm = m;
        while (!(mm & 0x400u)) mm <<= 1, sh++;
        u = s | ((uint32_t)(113 - sh) << 23) | ((mm & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif

/*
 * cuda_bf16.h of the kn_emu CPU emulation (tools/kn_emu/README.md): the bf16
 * type and its conversions, with CUDA's semantics (round to nearest even, a
 * NaN -> the canonical 0x7fff, like cuda_bf16.hpp). Not the toolkit's.
 */
#ifndef KN_EMU_CUDA_BF16_H
#define KN_EMU_CUDA_BF16_H

#include <cuda_runtime.h>

struct __nv_bfloat16 {
    unsigned short x; /* the top 16 bits of an f32 */
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{kn_emu_f32_to_bf16_rn(f)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((uint32_t)h.x << 16); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
/* __hfma: bf16(a * b + c) rounded once, as fma.rn.bf16 */
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
    return __nv_bfloat16{kn_emu_bf16_fma_rn(a.x, b.x, c.x)};
}

#endif

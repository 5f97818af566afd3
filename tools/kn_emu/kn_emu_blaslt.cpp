/*
 * kn_emu_blaslt.cpp: kernels/kn_linear.h's cuBLASLt entry points under the
 * kn_emu CPU emulation, where cuBLASLt does not exist (kn_blaslt.cu is not
 * built: the toolkit's cublasLt.h clashes with the fake cuda_runtime.h).
 * kn_blaslt_create keeps the real refusal of a deterministic backend and
 * otherwise answers as the real one does on a machine without the library
 * (cudaErrorSharedObjectInitFailed, "cuBLASLt not available"), so a test
 * takes its no-cuBLASLt path; the rest refuse with cudaErrorNotSupported.
 */
#include <cstdarg>
#include <cstdio>

#include <cuda_runtime.h>

#include "kernels/kn_linear.h"

static void set_why(char *why, size_t n, const char *s) {
    if (why && n) snprintf(why, n, "%s", s);
}

extern "C" int kn_blaslt_create(int deterministic, kn_blaslt **out, char *why, size_t why_len) {
    if (!out) return (int)cudaErrorInvalidValue;
    *out = nullptr;
    if (deterministic) { /* kn_blaslt.cu's refusal, before any loading */
        set_why(why, why_len, "cuBLASLt is not batch invariant relative to kn_matmul: only a backend created with "
                              "deterministic == false may use it");
        return (int)cudaErrorNotSupported;
    }
    set_why(why, why_len, "cuBLASLt not available (kn_emu CPU emulation)");
    return (int)cudaErrorSharedObjectInitFailed;
}
extern "C" void kn_blaslt_destroy(kn_blaslt *) {}
extern "C" void kn_blaslt_plan_destroy(kn_blaslt_plan *) {}
extern "C" int kn_blaslt_plan_create(kn_blaslt *, int64_t, int64_t, int32_t, size_t, kn_blaslt_plan **out, char *why,
                                     size_t why_len) {
    if (out) *out = nullptr;
    set_why(why, why_len, "cuBLASLt not available (kn_emu CPU emulation)");
    return (int)cudaErrorNotSupported;
}
extern "C" int kn_blaslt_matmul(kn_blaslt_plan *, const kn_weight *, const float *, uint16_t *, float *, void *,
                                void *) {
    return (int)cudaErrorNotSupported;
}
extern "C" const char *kn_blaslt_last_error(const kn_blaslt *) { return "cuBLASLt not available (kn_emu CPU emulation)"; }

/*
 * kn.h: conventions of specd's CUDA kernels, and the runtime probe.
 *
 * kernels/ holds the CUDA kernels (`kn_*.cu`); each family has a C header
 * `kn_<family>.h` that a C compiler can read (no CUDA types: a stream is a
 * `void *` holding a cudaStream_t, NULL = the legacy default stream). The
 * engine's CUDA backend glue (engine/backend/cuda_*.c) is the only caller
 * outside tests (DESIGN.md: dependencies point down).
 *
 * Every launcher
 *  - takes device pointers, explicit shapes and a stream; it never allocates,
 *    never synchronises and is safe to capture in a CUDA graph;
 *  - returns 0 or a cudaError_t value (cudaGetLastError after the launch, and
 *    cudaErrorInvalidValue for shapes it refuses): callers wrap it in
 *    KN_CHECK / their own check that logs file:line and kn_strerror();
 *  - computes each output element with a reduction order that depends only on
 *    that element's inputs and the shapes of the weights (never on the number
 *    of tokens in the batch, the token's index, or timing): BATCH INVARIANCE
 *    (engine/backend/backend.h). The CPU backend is the reference, op by op.
 *
 * Activations are f32 on the device (row-major [T, dim]); weights keep their
 * file formats (bk_wtype: f32, bf16, f16, GGUF Q8_0 / Q4_0 / Q4_1 blocks as
 * stored, dequantized in registers). KV cache layout = the CPU backend's
 * (bk_kv_layer): f32 [n_blocks, block_size, n_kv_heads, head_dim] per plane.
 */
#ifndef SPECD_KERNELS_KN_H
#define SPECD_KERNELS_KN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Why the GPU cannot be used, or "" when it can: cudaDriverGetVersion,
 * cudaGetDeviceCount, then a trivial kernel launch on device `dev` (catches
 * a build without code for this architecture: cudaErrorNoKernelImageForDevice
 * 209, cudaErrorUnsupportedPtxVersion 222). Returns 0 when usable, else the
 * cudaError_t value (35 insufficient driver / no driver, 100 no device, 803 /
 * 804 driver mismatch, ...) with the reason in `why` (always NUL-terminated).
 * Safe on a machine without a driver (cudart is linked statically). */
int kn_probe(int dev, char *why, size_t why_len);

/* cudaGetErrorName + cudaGetErrorString of a code returned by a launcher. */
const char *kn_strerror(int code);

#ifdef __cplusplus
}
#endif

/* Checks a kn_* / cuda* return value inside a function returning int:
 * logs "file:line: call: error" to stderr and returns -1. */
#define KN_CHECK(call)                                                                          \
    do {                                                                                        \
        int kn_rc_ = (int)(call);                                                               \
        if (kn_rc_ != 0) {                                                                      \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, kn_strerror(kn_rc_)); \
            return -1;                                                                          \
        }                                                                                       \
    } while (0)

#endif

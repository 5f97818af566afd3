/*
 * cuda_runtime.h of the kn_emu CPU emulation (tools/kn_emu/README.md): just
 * what specd's kernels and kernel tests use. Device memory is host memory.
 * Not the CUDA toolkit's header; never on a real build's include path.
 */
#ifndef KN_EMU_CUDA_RUNTIME_H
#define KN_EMU_CUDA_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInsufficientDriver = 35,
} cudaError_t;
typedef struct CUstream_st *cudaStream_t;
enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

#ifdef __cplusplus
extern "C" {
#endif
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind);
cudaError_t cudaMemset(void *dst, int value, size_t n);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaGetLastError(void);
#ifdef __cplusplus
}
#include "kn_emu_device.hpp"
#endif

#endif

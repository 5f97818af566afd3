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
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorSharedObjectSymbolNotFound = 302,
    cudaErrorSharedObjectInitFailed = 303,
    cudaErrorNotReady = 600,
    cudaErrorNotSupported = 801,
    cudaErrorUnknown = 999,
} cudaError_t;
typedef struct CUstream_st *cudaStream_t;
/* CUDA IPC, pinned mapped memory, streams, graphs: what the cuda_ipc communicator and its test use
 * (tools/kn_emu/run_comm.sh). A device allocation is a memfd mapping, so another process can open it;
 * launches run at once on the calling thread (streams are always idle); a graph records launches. */
typedef struct cudaIpcMemHandle_st { char reserved[64]; } cudaIpcMemHandle_t;
typedef struct kn_emu_graph *cudaGraph_t;
typedef struct kn_emu_graph *cudaGraphExec_t;
#define cudaIpcMemLazyEnablePeerAccess 1
#define cudaHostAllocMapped 2
#define cudaStreamDefault 0
#define cudaStreamNonBlocking 1
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1 };
enum cudaDeviceAttr { cudaDevAttrComputeMode = 20 };
enum cudaComputeMode { cudaComputeModeDefault = 0, cudaComputeModeProhibited = 2, cudaComputeModeExclusiveProcess = 3 };
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
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int dev);
cudaError_t cudaDeviceGetPCIBusId(char *bus, int len, int dev);
cudaError_t cudaDeviceGetByPCIBusId(int *dev, const char *bus);
cudaError_t cudaDeviceCanAccessPeer(int *can, int dev, int peer);
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags);
cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p);
cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags);
cudaError_t cudaIpcCloseMemHandle(void *p);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e);
cudaError_t cudaGraphDestroy(cudaGraph_t g);
#ifdef __cplusplus
}
#include "kn_emu_device.hpp"
#endif

#endif

/*
 * cuda_fake/cuda_runtime_api.h: a FAKE CUDA runtime for test_cuda_glue.c, so
 * that engine/backend/cuda_backend.c (the glue) runs on a machine without a
 * GPU. Only what the glue calls. "Device memory" is host memory handed out by
 * the fake cudaMalloc, which records every allocation so that the fake
 * launchers (cuda_fake.c) can check that each device pointer they get lies in
 * one (a host pointer reaching a device op fails the test), and copies check
 * their device side the same way. Streams and events are synchronous,
 * except that a test may set fake_async_copies (cuda_fake.c): then a
 * host -> device copy FROM PINNED memory (the fake cudaMallocHost) is only
 * queued, and lands at the next point that orders it (an event recorded
 * after it synchronized or waited on, a stream sync, a launch, a device ->
 * host copy, a memset), so a glue that rewrites a pinned buffer before its
 * copy is done uploads the wrong bytes, as it would on a GPU.
 * Never on the include path of a real build; every name is macro-renamed
 * (fake_*) so the test links next to the real cudart and kernels.
 */
#ifndef SPECD_TESTS_CUDA_FAKE_RUNTIME_API_H
#define SPECD_TESTS_CUDA_FAKE_RUNTIME_API_H

#include <stddef.h>

#define cudaMalloc fake_cudaMalloc
#define cudaFree fake_cudaFree
#define cudaMallocHost fake_cudaMallocHost
#define cudaFreeHost fake_cudaFreeHost
#define cudaMemcpyAsync fake_cudaMemcpyAsync
#define cudaMemsetAsync fake_cudaMemsetAsync
#define cudaStreamSynchronize fake_cudaStreamSynchronize
#define cudaStreamCreateWithFlags fake_cudaStreamCreateWithFlags
#define cudaStreamDestroy fake_cudaStreamDestroy
#define cudaEventCreateWithFlags fake_cudaEventCreateWithFlags
#define cudaEventDestroy fake_cudaEventDestroy
#define cudaEventRecord fake_cudaEventRecord
#define cudaEventSynchronize fake_cudaEventSynchronize
#define cudaStreamWaitEvent fake_cudaStreamWaitEvent
#define cudaSetDevice fake_cudaSetDevice
#define cudaGetDeviceCount fake_cudaGetDeviceCount
#define cudaMemGetInfo fake_cudaMemGetInfo
#define cudaGetDeviceProperties fake_cudaGetDeviceProperties
#define cudaStreamBeginCapture fake_cudaStreamBeginCapture
#define cudaStreamEndCapture fake_cudaStreamEndCapture
#define cudaGraphInstantiate fake_cudaGraphInstantiate
#define cudaGraphLaunch fake_cudaGraphLaunch
#define cudaGraphExecDestroy fake_cudaGraphExecDestroy
#define cudaGraphDestroy fake_cudaGraphDestroy

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorStreamCaptureUnsupported = 900,
} cudaError_t;
/* Graphs: a capture records the kn_* launches (their arguments by value) instead of running them; a launch
 * replays the list in order on the memory's contents at that time, as a GPU replays a graph's kernels. */
typedef struct fake_graph *cudaGraph_t;
typedef struct fake_graph *cudaGraphExec_t;
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1 };
typedef struct fake_stream *cudaStream_t;
typedef struct fake_event *cudaEvent_t;
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };
#define cudaStreamNonBlocking 1
#define cudaEventDisableTiming 2
struct cudaDeviceProp { char name[256]; };

cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaMemsetAsync(void *dst, int v, size_t n, cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev);
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x);
cudaError_t cudaGraphDestroy(cudaGraph_t g);

/* the kernels' C API, renamed the same way (cuda_fake.c implements them) */
#define kn_probe fake_kn_probe
#define kn_strerror fake_kn_strerror
#define kn_matmul fake_kn_matmul
#define kn_embed fake_kn_embed
#define kn_rmsnorm fake_kn_rmsnorm
#define kn_add_rmsnorm fake_kn_add_rmsnorm
#define kn_rope fake_kn_rope
#define kn_silu_mul fake_kn_silu_mul
#define kn_add fake_kn_add
#define kn_add_bias fake_kn_add_bias
#define kn_copy_rows fake_kn_copy_rows
#define kn_kv_write fake_kn_kv_write
#define kn_attention fake_kn_attention
#define kn_attn_scratch_bytes fake_kn_attn_scratch_bytes
#define kn_argmax fake_kn_argmax
#define kn_sample fake_kn_sample
#define kn_spec_verify fake_kn_spec_verify
#define kn_sample_scratch_bytes fake_kn_sample_scratch_bytes
#define kn_sample_draw fake_kn_sample_draw
#define kn_sample_draw_scratch_bytes fake_kn_sample_draw_scratch_bytes
#define kn_philox_uniforms fake_kn_philox_uniforms
#define kn_mla_latent_write fake_kn_mla_latent_write
#define kn_mla_attention fake_kn_mla_attention
#define kn_mla_attention_mma fake_kn_mla_attention_mma
#define kn_mla_scratch_bytes fake_kn_mla_scratch_bytes
#define kn_moe_route fake_kn_moe_route
#define kn_moe_experts fake_kn_moe_experts
#define kn_moe_workspace_bytes fake_kn_moe_workspace_bytes
#define kn_moe_dequant fake_kn_moe_dequant
/* and the backend's own entry points, so both copies can live in one binary */
#define bk_cuda_create fake_bk_cuda_create
#define bk_cuda_destroy fake_bk_cuda_destroy
#define bk_cuda_describe fake_bk_cuda_describe
#define bk_cuda_arena_used fake_bk_cuda_arena_used
#define bk_cuda_probe fake_bk_cuda_probe
#define bk_cuda_mem_info fake_bk_cuda_mem_info
#define bk_cuda_fixed_bytes fake_bk_cuda_fixed_bytes

/* test hooks */
int fake_is_device(const void *p, size_t bytes); /* [p, p + bytes) inside one fake cudaMalloc */
extern int fake_violations;                      /* host pointers seen where device ones belong */
extern int fake_kn_add_rmsnorm_calls, fake_kn_calls;
/* transfers: host -> device and device -> host copies (cudaMemcpyAsync), and
 * the host waits on the device (cudaStreamSynchronize: one per download) */
extern long fake_h2d, fake_d2h, fake_syncs;
/* device -> host / host -> device bytes copied (cudaMemcpyAsync), and the sampling launches */
extern size_t fake_d2h_bytes, fake_h2d_bytes;
extern int fake_d2h_calls, fake_kn_sample_calls, fake_kn_spec_verify_calls, fake_kn_sample_draw_calls;
extern long fake_kn_spec_verify_q_rows;
/* graphs: launches issued by the host outside a replay (a replayed launch does not count here, a captured one
 * neither), graph launches, launches recorded by captures, graphs alive */
extern long fake_host_launches, fake_graph_launches, fake_captured_launches;
extern int fake_graphs_alive;

#endif

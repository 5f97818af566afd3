/*
 * kn_runtime.cu: the GPU probe and error strings of kn.h. No state.
 */
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

#include "kernels/kn.h"

namespace {
__global__ void kn_probe_kernel(int *out) { *out = 1234; }

int kn_fail(cudaError_t e, const char *what, char *why, size_t n) {
    if (why && n) snprintf(why, n, "%s: %s (%s, %d)", what, cudaGetErrorString(e), cudaGetErrorName(e), (int)e);
    return (int)e;
}
}  // namespace

extern "C" int kn_probe(int dev, char *why, size_t why_len) {
    if (why && why_len) why[0] = '\0';
    int drv = 0, n = 0;
    cudaError_t e = cudaDriverGetVersion(&drv);
    if (e != cudaSuccess) return kn_fail(e, "cudaDriverGetVersion", why, why_len);
    if (drv == 0) {
        if (why && why_len) snprintf(why, why_len, "no NVIDIA driver is installed (cudaDriverGetVersion = 0)");
        return (int)cudaErrorInsufficientDriver;
    }
    e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) return kn_fail(e, "cudaGetDeviceCount", why, why_len);
    if (dev < 0 || dev >= n) {
        if (why && why_len) snprintf(why, why_len, "device %d requested, %d visible", dev, n);
        return (int)cudaErrorInvalidDevice;
    }
    e = cudaSetDevice(dev);
    if (e != cudaSuccess) return kn_fail(e, "cudaSetDevice", why, why_len);
    int *d = nullptr, h = 0;
    e = cudaMalloc(&d, sizeof(int));
    if (e != cudaSuccess) return kn_fail(e, "cudaMalloc", why, why_len);
    kn_probe_kernel<<<1, 1>>>(d);
    e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(d);
    if (e != cudaSuccess) return kn_fail(e, "probe kernel (is there code for this GPU's architecture?)", why, why_len);
    if (h != 1234) {
        if (why && why_len) snprintf(why, why_len, "probe kernel wrote %d, expected 1234", h);
        return (int)cudaErrorUnknown;
    }
    return 0;
}

extern "C" const char *kn_strerror(int code) {
    static thread_local char buf[160];
    cudaError_t e = (cudaError_t)code;
    snprintf(buf, sizeof buf, "%s (%s, %d)", cudaGetErrorString(e), cudaGetErrorName(e), code);
    return buf;
}

/*
 * kn_emu_runtime.cpp: the fiber scheduler of kn_emu and the cudart / kn.h
 * functions the tests call (kn_emu_device.hpp has the model). x86-64 only:
 * a six-register context switch, no signals, no syscalls per switch.
 */
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <functional>
#include <mutex>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#include <cuda_runtime.h>

extern "C" int kn_probe(int dev, char *why, size_t why_len);
extern "C" const char *kn_strerror(int code);

dim3 threadIdx, blockIdx, blockDim, gridDim;
float kn_emu_shfl_f[1024];
int kn_emu_sync_or;

uint64_t kn_emu_globaltimer() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
void kn_emu_spin_pause() { sched_yield(); }

/* A graph: the launches recorded while its stream was capturing. */
struct kn_emu_graph {
    struct Launch { dim3 grid, block; std::function<void()> body; };
    std::vector<Launch> launches;
};
static kn_emu_graph *g_capture; /* non-NULL while a stream captures */

extern "C" void kn_emu_switch(void **save_sp, void *load_sp);
asm(R"(
.text
.globl kn_emu_switch
.type kn_emu_switch,@function
kn_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size kn_emu_switch, .-kn_emu_switch
)");

namespace {
enum State { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
struct Fiber {
    void *sp;
    State st;
    char *stack;
};
constexpr size_t kStack = 256 * 1024;
std::vector<Fiber> g_f;
void *g_sched_sp;
int g_cur;
const std::function<void()> *g_body;

void fiber_entry() {
    (*g_body)();
    g_f[g_cur].st = DONE;
    kn_emu_switch(&g_f[g_cur].sp, g_sched_sp);
    abort();
}

void yield(State s) {
    g_f[g_cur].st = s;
    kn_emu_switch(&g_f[g_cur].sp, g_sched_sp);
}
}  // namespace

void kn_emu_syncthreads() { yield(WAIT_BLOCK); }
void kn_emu_syncwarp() { yield(WAIT_WARP); }

void kn_emu_run(dim3 grid, dim3 block, const std::function<void()> &body) {
    if (g_capture) {
        g_capture->launches.push_back(kn_emu_graph::Launch{grid, block, body});
        return;
    }
    const int nt = (int)(block.x * block.y * block.z);
    if (nt > 1024 || block.y != 1 || block.z != 1) {
        fprintf(stderr, "kn_emu: block %ux%ux%u unsupported\n", block.x, block.y, block.z);
        abort();
    }
    while ((int)g_f.size() < nt) g_f.push_back(Fiber{nullptr, DONE, (char *)malloc(kStack)});
    g_body = &body;
    blockDim = block;
    gridDim = grid;
    /* CUDA promises no order between blocks: run them last to first unless
     * KN_EMU_ORDER=forward, so a result that needs an order shows up */
    const char *ord = getenv("KN_EMU_ORDER");
    const bool fwd = ord && strcmp(ord, "forward") == 0;
    const unsigned nb = grid.x * grid.y * grid.z;
    for (unsigned k = 0; k < nb; k++) {
        const unsigned lin = fwd ? k : nb - 1 - k;
        const unsigned bx = lin % grid.x, by = lin / grid.x % grid.y, bz = lin / (grid.x * grid.y);
        blockIdx = dim3(bx, by, bz);
        for (int t = 0; t < nt; t++) {
            void **sp = (void **)(((uintptr_t)(g_f[t].stack + kStack)) & ~(uintptr_t)15);
            *--sp = nullptr;                /* fake return address: entry sees rsp % 16 == 8 */
            *--sp = (void *)fiber_entry;    /* ret target */
            for (int r = 0; r < 6; r++) *--sp = nullptr; /* rbp rbx r12-r15 */
            g_f[t].sp = sp;
            g_f[t].st = RUN;
        }
        for (;;) {
            bool ran = false;
            for (int t = 0; t < nt; t++) {
                if (g_f[t].st != RUN) continue;
                g_cur = t;
                threadIdx = dim3((unsigned)t);
                kn_emu_switch(&g_sched_sp, g_f[t].sp);
                ran = true;
            }
            int live = 0, at_block = 0;
            for (int t = 0; t < nt; t++) live += g_f[t].st != DONE, at_block += g_f[t].st == WAIT_BLOCK;
            if (live == 0) break;
            bool released = false;
            if (at_block == live) {
                for (int t = 0; t < nt; t++)
                    if (g_f[t].st == WAIT_BLOCK) g_f[t].st = RUN;
                released = true;
            }
            for (int w = 0; w * 32 < nt; w++) {
                int wl = 0, ww = 0;
                for (int t = w * 32; t < w * 32 + 32 && t < nt; t++)
                    wl += g_f[t].st != DONE, ww += g_f[t].st == WAIT_WARP;
                if (ww > 0 && ww == wl) {
                    for (int t = w * 32; t < w * 32 + 32 && t < nt; t++)
                        if (g_f[t].st == WAIT_WARP) g_f[t].st = RUN;
                    released = true;
                }
            }
            if (!ran && !released) {
                fprintf(stderr, "kn_emu: deadlock / divergent barrier in block (%u,%u): %d live, %d at "
                                "__syncthreads\n", bx, by, live, at_block);
                abort();
            }
        }
    }
}

extern "C" {
/* Device memory: one memfd mapping per allocation (so cudaIpcOpenMemHandle can map it in another process). */
static std::mutex g_mu;
struct Alloc { void *p; size_t n; int fd; bool imported; };
static std::vector<Alloc> g_allocs;

cudaError_t cudaMalloc(void **p, size_t n) {
    *p = nullptr;
    if (n == 0) n = 1;
    int fd = memfd_create("kn_emu", 0);
    if (fd < 0 || ftruncate(fd, (off_t)n) != 0) {
        if (fd >= 0) close(fd);
        return cudaErrorMemoryAllocation;
    }
    void *m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return cudaErrorMemoryAllocation;
    }
    memset(m, 0xA5, n); /* garbage, like fresh device memory */
    std::lock_guard<std::mutex> l(g_mu);
    g_allocs.push_back(Alloc{m, n, fd, false});
    *p = m;
    return cudaSuccess;
}
static cudaError_t unmap(void *p, bool imported) {
    std::lock_guard<std::mutex> l(g_mu);
    for (size_t i = 0; i < g_allocs.size(); i++)
        if (g_allocs[i].p == p && g_allocs[i].imported == imported) {
            munmap(p, g_allocs[i].n);
            if (g_allocs[i].fd >= 0) close(g_allocs[i].fd);
            g_allocs.erase(g_allocs.begin() + (long)i);
            return cudaSuccess;
        }
    return cudaErrorInvalidValue;
}
cudaError_t cudaFree(void *p) { return p ? unmap(p, false) : cudaSuccess; }

struct IpcHandle { int pid, fd; size_t n; };
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p) {
    std::lock_guard<std::mutex> l(g_mu);
    for (const Alloc &a : g_allocs)
        if (a.p == p && !a.imported) {
            IpcHandle ih{(int)getpid(), a.fd, a.n};
            memset(h, 0, sizeof *h);
            memcpy(h->reserved, &ih, sizeof ih);
            return cudaSuccess;
        }
    return cudaErrorInvalidValue;
}
cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned) {
    IpcHandle ih;
    memcpy(&ih, h.reserved, sizeof ih);
    if (ih.pid == (int)getpid()) return cudaErrorInvalidValue; /* CUDA refuses a process its own handle too */
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", ih.pid, ih.fd);
    int fd = open(path, O_RDWR);
    if (fd < 0) return cudaErrorInvalidValue;
    void *m = mmap(nullptr, ih.n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return cudaErrorMemoryAllocation;
    std::lock_guard<std::mutex> l(g_mu);
    g_allocs.push_back(Alloc{m, ih.n, -1, true});
    *p = m;
    return cudaSuccess;
}
cudaError_t cudaIpcCloseMemHandle(void *p) { return unmap(p, true); }

cudaError_t cudaHostAlloc(void **p, size_t n, unsigned) {
    *p = calloc(1, n ? n : 1);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned) { *d = h; return cudaSuccess; }
cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaSetDevice(int dev) { return dev == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr, int) { *v = 0; return cudaSuccess; }
cudaError_t cudaDeviceGetPCIBusId(char *bus, int len, int dev) {
    snprintf(bus, (size_t)len, "0000:00:%02x.0", dev);
    return cudaSuccess;
}
cudaError_t cudaDeviceGetByPCIBusId(int *dev, const char *bus) {
    unsigned d = 0;
    if (sscanf(bus, "0000:00:%x.0", &d) != 1 || d != 0) return cudaErrorInvalidDevice;
    *dev = 0;
    return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int *can, int, int) { *can = 1; return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { *s = (cudaStream_t)malloc(1); return cudaSuccess; }
cudaError_t cudaStreamDestroy(cudaStream_t s) { free(s); return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamBeginCapture(cudaStream_t, enum cudaStreamCaptureMode) {
    if (g_capture) return cudaErrorInvalidValue;
    g_capture = new kn_emu_graph();
    return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t *g) {
    *g = g_capture;
    g_capture = nullptr;
    return *g ? cudaSuccess : cudaErrorInvalidValue;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long) {
    *e = new kn_emu_graph(*g);
    return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t) {
    for (const kn_emu_graph::Launch &l : e->launches) kn_emu_run(l.grid, l.block, l.body);
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) { delete e; return cudaSuccess; }
cudaError_t cudaGraphDestroy(cudaGraph_t g) { delete g; return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t e) { return kn_strerror((int)e); }
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind) {
    memmove(d, s, n);
    return cudaSuccess;
}
cudaError_t cudaMemset(void *d, int v, size_t n) { memset(d, v, n); return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
int kn_probe(int, char *why, size_t n) { if (why && n) why[0] = 0; return 0; }
const char *kn_strerror(int code) {
    static char b[64];
    snprintf(b, sizeof b, "kn_emu error %d", code);
    return b;
}
}

/*
 * kn_emu_runtime.cpp: the fiber scheduler of kn_emu and the cudart / kn.h
 * functions the tests call (kn_emu_device.hpp has the model). x86-64 only:
 * a six-register context switch, no signals, no syscalls per switch.
 */
#include <cerrno>
#include <cstdarg>
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
unsigned char kn_emu_shfl_buf[2][1024][16];
uint64_t kn_emu_shfl_seq[1024];
int kn_emu_sync_or;

uint64_t kn_emu_globaltimer() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
void kn_emu_spin_pause() { sched_yield(); }

/* A graph: the launches recorded while its stream was capturing. */
struct kn_emu_graph {
    struct Launch { dim3 grid, block; size_t smem; std::function<void()> body; };
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
    int kind; /* WAIT_WARP: the warp operation (KN_EMU_WARP_*) */
    char *stack;
};
constexpr size_t kStack = 256 * 1024;
std::vector<Fiber> g_f;
void *g_sched_sp;
int g_cur;
const std::function<void()> *g_body;
struct Warp {
    int live, wait, kind; /* live lanes, lanes at a warp operation, its kind */
};
Warp g_w[32];
/* dynamic shared memory of the running launch */
unsigned char *g_dyn;
size_t g_dyn_cap, g_dyn_n;
/* the first launch error since the last cudaGetLastError (sticky like CUDA's launch errors until read) */
cudaError_t g_last_error = cudaSuccess;

void fiber_entry() {
    (*g_body)();
    g_f[g_cur].st = DONE;
    kn_emu_switch(&g_f[g_cur].sp, g_sched_sp);
    abort();
}

void yield(State s, int kind) {
    g_f[g_cur].st = s;
    g_f[g_cur].kind = kind;
    kn_emu_switch(&g_f[g_cur].sp, g_sched_sp);
}

void launch_error(cudaError_t e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kn_emu: launch refused (CUDA would return error %d): ", (int)e);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    if (g_last_error == cudaSuccess) g_last_error = e;
}
}  // namespace

void kn_emu_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kn_emu: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

void kn_emu_syncthreads() { yield(WAIT_BLOCK, 0); }
void kn_emu_syncwarp(int kind) { yield(WAIT_WARP, kind); }
void *kn_emu_dyn_smem() { return g_dyn; }

/* tests/backend/cuda_fake.c, when linked in (tools/kn_emu/run_tp.sh): while the FAKE device's stream captures,
 * records run(arg) as a node of its graph, in order with its own kernels, and returns 1; 0 when it is not
 * capturing; -1 out of memory. So the emulated collective kernels (kn_allreduce.cu) between the fake's ops are
 * captured and replayed like a GPU graph's kernel nodes. Weak: absent in kn_emu's other binaries. */
extern "C" int fake_capture_foreign(int (*run)(void *), void *arg) __attribute__((weak));
void kn_emu_run(dim3 grid, dim3 block, size_t dyn_smem, const std::function<void()> &body);
static int run_foreign(void *arg) {
    const kn_emu_graph::Launch *l = (const kn_emu_graph::Launch *)arg;
    kn_emu_run(l->grid, l->block, l->smem, l->body);
    const cudaError_t e = cudaGetLastError();
    return (int)e;
}

void kn_emu_run(dim3 grid, dim3 block, size_t dyn_smem, const std::function<void()> &body) {
    /* CUDA's launch limits (sm_90): refused launches set the error cudaGetLastError returns */
    const unsigned long long ntl = (unsigned long long)block.x * block.y * block.z;
    if (ntl == 0 || ntl > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 ||
        grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
        launch_error((cudaError_t)9 /* cudaErrorInvalidConfiguration */, "grid %ux%ux%u, block %ux%ux%u", grid.x,
                     grid.y, grid.z, block.x, block.y, block.z);
        return;
    }
    if (dyn_smem > 48 * 1024) { /* more needs cudaFuncSetAttribute(MaxDynamicSharedMemorySize), not emulated */
        launch_error((cudaError_t)9, "dynamic shared memory %zu bytes > 48 KiB", dyn_smem);
        return;
    }
    if (g_capture) {
        g_capture->launches.push_back(kn_emu_graph::Launch{grid, block, dyn_smem, body});
        return;
    }
    if (fake_capture_foreign) { /* linked with tests/backend/cuda_fake.c: its open capture records this launch */
        kn_emu_graph::Launch *l = new kn_emu_graph::Launch{grid, block, dyn_smem, body};
        const int r = fake_capture_foreign(run_foreign, l);
        if (r == 1) return; /* the node owns l for the process's life (test binaries: a few launches per graph) */
        delete l;
        if (r < 0) {
            launch_error((cudaError_t)2 /* cudaErrorMemoryAllocation */, "recording a launch in the fake's capture");
            return;
        }
    }
    const int nt = (int)ntl;
    if (block.y != 1 || block.z != 1) kn_emu_fail("block %ux%ux%u: only 1-D blocks are emulated", block.x, block.y,
                                                  block.z);
    while ((int)g_f.size() < nt) g_f.push_back(Fiber{nullptr, DONE, 0, (char *)malloc(kStack)});
    if (dyn_smem > g_dyn_cap) {
        free(g_dyn);
        g_dyn = (unsigned char *)aligned_alloc(16, (dyn_smem + 15) & ~(size_t)15);
        g_dyn_cap = dyn_smem;
    }
    g_dyn_n = dyn_smem;
    g_body = &body;
    blockDim = block;
    gridDim = grid;
    /* CUDA promises no order between blocks: run them last to first unless
     * KN_EMU_ORDER=forward, so a result that needs an order shows up */
    const char *ord = getenv("KN_EMU_ORDER");
    const bool fwd = ord && strcmp(ord, "forward") == 0;
    const unsigned long long nb = (unsigned long long)grid.x * grid.y * grid.z;
    for (unsigned long long k = 0; k < nb; k++) {
        const unsigned long long lin = fwd ? k : nb - 1 - k;
        const unsigned bx = (unsigned)(lin % grid.x), by = (unsigned)(lin / grid.x % grid.y),
                       bz = (unsigned)(lin / ((unsigned long long)grid.x * grid.y));
        blockIdx = dim3(bx, by, bz);
        if (g_dyn_n) memset(g_dyn, 0xA5, g_dyn_n); /* shared memory starts as garbage in every block */
        for (int t = 0; t < nt; t++) {
            void **sp = (void **)(((uintptr_t)(g_f[t].stack + kStack)) & ~(uintptr_t)15);
            *--sp = nullptr;                /* fake return address: entry sees rsp % 16 == 8 */
            *--sp = (void *)fiber_entry;    /* ret target */
            for (int r = 0; r < 6; r++) *--sp = nullptr; /* rbp rbx r12-r15 */
            g_f[t].sp = sp;
            g_f[t].st = RUN;
            kn_emu_shfl_seq[t] = 0;
        }
        /* counters, updated as fibers come back: live threads, threads at __syncthreads, per warp its
         * live lanes and the lanes at a warp operation (and which kind) */
        int live = nt, at_block = 0;
        for (int w = 0; w * 32 < nt; w++) g_w[w] = Warp{nt - w * 32 < 32 ? nt - w * 32 : 32, 0, 0};
        while (live > 0) {
            bool ran = false;
            for (int t = 0; t < nt; t++) {
                if (g_f[t].st != RUN) continue;
                g_cur = t;
                threadIdx = dim3((unsigned)t);
                kn_emu_switch(&g_sched_sp, g_f[t].sp);
                ran = true;
                Warp &w = g_w[t >> 5];
                if (g_f[t].st == DONE) {
                    live--, w.live--;
                } else if (g_f[t].st == WAIT_BLOCK) {
                    at_block++;
                } else if (g_f[t].st == WAIT_WARP) {
                    if (w.wait == 0) w.kind = g_f[t].kind;
                    else if (w.kind != g_f[t].kind)
                        kn_emu_fail("divergent warp operations in block (%u,%u,%u), warp %d: kinds %d and %d (1 "
                                    "__syncwarp, 2 shuffle, 3 mma)", bx, by, bz, t >> 5, w.kind, g_f[t].kind);
                    w.wait++;
                }
                if (w.wait > 0 && w.wait == w.live) { /* every live lane of the warp is there */
                    const int w0 = t & ~31, w1 = w0 + 32 < nt ? w0 + 32 : nt;
                    for (int u = w0; u < w1; u++)
                        if (g_f[u].st == WAIT_WARP) g_f[u].st = RUN;
                    w.wait = 0;
                }
                if (at_block > 0 && at_block == live) { /* every live thread of the block is there */
                    for (int u = 0; u < nt; u++)
                        if (g_f[u].st == WAIT_BLOCK) g_f[u].st = RUN;
                    at_block = 0;
                }
            }
            if (!ran && live > 0) {
                fprintf(stderr, "kn_emu: deadlock / divergent barrier in block (%u,%u,%u): %d live, %d at "
                                "__syncthreads, the others at warp operations\n", bx, by, bz, live, at_block);
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
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
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
    for (const kn_emu_graph::Launch &l : e->launches) kn_emu_run(l.grid, l.block, l.smem, l.body);
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
cudaError_t cudaGetLastError(void) {
    const cudaError_t e = g_last_error;
    g_last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return g_last_error; }
int kn_probe(int, char *why, size_t n) { if (why && n) why[0] = 0; return 0; }
const char *kn_strerror(int code) {
    static char b[64];
    snprintf(b, sizeof b, "kn_emu error %d", code);
    return b;
}
}

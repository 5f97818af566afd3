/*
 * kn_emu_runtime.cpp: the fiber scheduler of kn_emu and the cudart / kn.h
 * functions the tests call (kn_emu_device.hpp has the model). x86-64 only:
 * a six-register context switch, no signals, no syscalls per switch.
 */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include <cuda_runtime.h>

extern "C" int kn_probe(int dev, char *why, size_t why_len);
extern "C" const char *kn_strerror(int code);

dim3 threadIdx, blockIdx, blockDim, gridDim;
float kn_emu_shfl_f[1024];

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
cudaError_t cudaMalloc(void **p, size_t n) {
    *p = malloc(n ? n : 1);
    if (*p) memset(*p, 0xA5, n); /* garbage, like fresh device memory */
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
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

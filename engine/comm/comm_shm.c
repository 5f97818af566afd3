/*
 * comm_shm.c: the `comm` of comm.h for ranks that are processes on one host,
 * sharing one memory segment (an anonymous memfd created by rank 0 and
 * inherited by the workers: nothing to unlink, nothing left behind when a rank
 * is SIGKILLed).
 *
 * Segment layout (offsets fixed at create, recorded in the header):
 *   shm_hdr                      magic, sizes, abort state, attach count,
 *                                step ring head, one shm_rank per rank
 *   slots [2][world + 1][slot_bytes]
 *                                per round parity p: rank r's input staging
 *                                slot [p][r], and [p][world] = the two-shot
 *                                all-reduce result
 *   step ring [step_depth][64 + step_max_bytes]
 *                                entry header (kind, bytes) then the message
 *
 * Rounds and barriers. Every collective is a sequence of rounds (one per
 * slot-size chunk). Round k uses the buffers of parity p = k & 1: each rank
 * writes its input into slot [p][rank] and its descriptor (op, size, root),
 * then arrives at barrier A; one-shot ops read what they need after A; the
 * two-shot all-reduce reduces its 1/N slice into [p][world], arrives at
 * barrier B, and copies the result out. Why two parities suffice: a rank
 * writes parity-p buffers in round k + 2 only after passing barrier A of round
 * k + 1, which every rank reaches only after it has finished reading round
 * k's buffers. So there is no barrier at the end of a round.
 *
 * The barrier: rank r publishes "I reached barrier s" by storing s in its own
 * arrive word, then waits until every other rank's arrive word is >= s
 * (wrapping compare). Arrive words only grow, so nothing is ever reset.
 *
 * Memory ordering (C11 atomics on lock-free 32-bit words: address-free, so
 * valid across processes that map the same pages):
 *  - data -> arrive: a rank's plain stores into its slot and descriptor happen
 *    before its seq_cst store of arrive (a release); a peer's acquire load
 *    that sees the new arrive value then sees that data. The same pairing
 *    publishes the two-shot result slices (barrier B) and step ring entries
 *    (step_head store / load) and consumption (step_tail).
 *  - sleeping: a waiter spins for spin_us, then increments the word's waiter
 *    count (seq_cst), re-reads the word (seq_cst) and futex-waits on the value
 *    it saw, for at most COMM_SLEEP_SLICE_MS. A publisher stores the word
 *    (seq_cst) then reads the waiter count (seq_cst) and calls FUTEX_WAKE only
 *    if it is non-zero. Both sides being seq_cst (Dekker), either the waiter
 *    sees the new value or the publisher sees the waiter; FUTEX_WAIT itself
 *    re-checks the value in the kernel, so no wake-up is lost.
 *  - abort: the first aborter wins a CAS on abort_state, writes the reason,
 *    then publishes abort_ready (release) and wakes every futex word of the
 *    segment. Waiters check abort_state between spins and after every sleep;
 *    one that was about to sleep when the wake went out sleeps at most one
 *    slice (COMM_SLEEP_SLICE_MS) more.
 *
 * Determinism: see comm.h. Both all-reduce algorithms compute, per element,
 * s = x0; s += x1; ...; s += x_{N-1} in f32 from the same staged inputs.
 *
 * Threading: one thread per rank per comm; comm_abort from anywhere.
 */
#define _GNU_SOURCE
#include "engine/comm/comm.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SHM_MAGIC 0x314d4d4f43445053ULL /* "SPDCOMM1" */
#define SHM_ALIGN 64u
#define STEP_ENTRY_HDR 64u

/* ============================== segment layout ============================== */

enum { OP_BARRIER = 1, OP_ALL_REDUCE = 2, OP_ALL_GATHER = 3, OP_BROADCAST = 4 };

typedef struct shm_desc {     /* what a rank is doing in a round */
    uint32_t op;              /* OP_* */
    uint32_t root;            /* broadcast root, else 0 */
    uint64_t bytes;           /* this round's payload per rank (broadcast: root's only) */
    uint64_t total;           /* whole call's size (broadcast: set by root) */
} shm_desc;

typedef struct shm_rank {
    _Atomic uint32_t arrive;            /* last barrier sequence this rank reached */
    _Atomic uint32_t arrive_waiters;    /* ranks sleeping on arrive */
    _Atomic uint32_t step_tail;         /* step messages this rank consumed (workers) */
    _Atomic uint32_t step_tail_waiters; /* rank 0 sleeping on step_tail (ring full) */
    _Atomic int32_t pid;                /* 0 until attached */
    uint32_t pad_;
    shm_desc desc[2];                   /* per round parity */
} __attribute__((aligned(SHM_ALIGN))) shm_rank;

typedef struct shm_step_entry {
    uint32_t kind;  /* comm_step_kind */
    uint32_t pad_;
    uint64_t bytes; /* message length that follows the 64-byte entry header */
} shm_step_entry;

typedef struct shm_hdr {
    uint64_t magic;
    uint32_t world, step_depth;
    uint64_t slot_bytes, step_max_bytes, step_stride, off_slots, off_step, total_bytes;
    /* Rank 0's config, adopted by every worker: all ranks must pick the same
     * all-reduce algorithm (two-shot has one more barrier). */
    int32_t timeout_ms, spin_us;
    uint64_t oneshot_max_bytes;
    _Atomic uint32_t attached;          /* ranks attached (rank 0 counts itself) */
    _Atomic uint32_t attached_waiters;
    _Atomic uint32_t abort_state;       /* 0 ok, 1 aborted */
    _Atomic uint32_t abort_ready;       /* 1 once abort_rank/abort_reason are written */
    int32_t abort_rank;
    char abort_reason[COMM_REASON_MAX];
    _Atomic uint32_t step_head __attribute__((aligned(SHM_ALIGN))); /* messages posted */
    _Atomic uint32_t step_head_waiters;
    shm_rank rank[COMM_MAX_WORLD];
} shm_hdr;

struct comm {
    shm_hdr *h;
    size_t map_bytes;
    int rank, world;
    pid_t parent_pid;       /* workers: rank 0's pid, checked while sleeping */
    int timeout_ms;
    int64_t spin_ns;
    size_t oneshot_max;
    uint32_t seq;           /* barriers passed by this rank */
    uint32_t round;         /* rounds done by this rank */
    uint32_t step_local;    /* rank 0: head; worker: tail */
};

/* ================================ utilities ================================= */

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Shared (not FUTEX_PRIVATE): the words live in memory mapped by several processes. */
static void futex_wait(_Atomic uint32_t *w, uint32_t val, int64_t ns) {
    struct timespec ts = {.tv_sec = ns / 1000000000LL, .tv_nsec = ns % 1000000000LL};
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *w) { syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

/* Publishes a new value of a word others may sleep on. */
static void word_publish(_Atomic uint32_t *w, _Atomic uint32_t *waiters, uint32_t v) {
    atomic_store_explicit(w, v, memory_order_seq_cst);
    if (atomic_load_explicit(waiters, memory_order_seq_cst) != 0) futex_wake(w);
}

static bool reached(uint32_t v, uint32_t target) { return (int32_t)(v - target) >= 0; }

static uint8_t *slot_ptr(const comm *c, uint32_t parity, int idx) {
    return (uint8_t *)c->h + c->h->off_slots + ((size_t)parity * (size_t)(c->world + 1) + (size_t)idx) * c->h->slot_bytes;
}

static uint8_t *step_entry(const comm *c, uint32_t seq) {
    return (uint8_t *)c->h + c->h->off_step + (size_t)(seq % c->h->step_depth) * c->h->step_stride;
}

/* ================================== abort =================================== */

static void comm_wake_all(comm *c) {
    shm_hdr *h = c->h;
    for (int r = 0; r < c->world; r++) {
        futex_wake(&h->rank[r].arrive);
        futex_wake(&h->rank[r].step_tail);
    }
    futex_wake(&h->step_head);
    futex_wake(&h->attached);
}

void comm_abort_as(comm *c, int rank, const char *reason) {
    if (!c) return;
    shm_hdr *h = c->h;
    uint32_t expect = 0;
    if (atomic_compare_exchange_strong(&h->abort_state, &expect, 1)) {
        h->abort_rank = rank;
        snprintf(h->abort_reason, sizeof h->abort_reason, "%s", reason ? reason : "aborted");
        atomic_store_explicit(&h->abort_ready, 1, memory_order_release);
    }
    comm_wake_all(c);
}

void comm_abort(comm *c, const char *reason) {
    if (c) comm_abort_as(c, c->rank, reason);
}

int comm_aborted(comm *c, char *why, size_t why_len) {
    shm_hdr *h = c->h;
    if (atomic_load_explicit(&h->abort_state, memory_order_acquire) == 0) return 0;
    if (why && why_len) {
        /* The winner writes the reason right after its CAS: wait for it, bounded. */
        int64_t until = now_ns() + 100000000LL;
        while (!atomic_load_explicit(&h->abort_ready, memory_order_acquire) && now_ns() < until) cpu_relax();
        char prefix[32];
        snprintf(prefix, sizeof prefix, "rank %d ", h->abort_rank);
        if (!atomic_load_explicit(&h->abort_ready, memory_order_acquire))
            snprintf(why, why_len, "aborted (reason not yet written)");
        else if (strncmp(h->abort_reason, prefix, strlen(prefix)) == 0) /* already names the rank */
            snprintf(why, why_len, "%s", h->abort_reason);
        else
            snprintf(why, why_len, "rank %d: %s", h->abort_rank, h->abort_reason);
    }
    return 1;
}

/* ================================== waiting ================================= */

enum { WAIT_OK = 0, WAIT_ABORTED, WAIT_TIMEOUT, WAIT_PARENT_DEAD };

/* Waits until *w >= target (wrapping). deadline_ns 0: none. */
static int comm_wait_ge(comm *c, _Atomic uint32_t *w, _Atomic uint32_t *waiters, uint32_t target,
                        int64_t deadline_ns) {
    shm_hdr *h = c->h;
    if (reached(atomic_load_explicit(w, memory_order_acquire), target)) return WAIT_OK;
    int64_t t0 = now_ns();
    if (c->spin_ns > 0) {
        for (unsigned it = 0;; it++) {
            if (reached(atomic_load_explicit(w, memory_order_acquire), target)) return WAIT_OK;
            if (atomic_load_explicit(&h->abort_state, memory_order_relaxed)) return WAIT_ABORTED;
            cpu_relax();
            if ((it & 63) == 63 && now_ns() - t0 >= c->spin_ns) break;
        }
    }
    for (;;) {
        uint32_t v = atomic_load_explicit(w, memory_order_acquire);
        if (reached(v, target)) return WAIT_OK;
        if (atomic_load_explicit(&h->abort_state, memory_order_acquire)) return WAIT_ABORTED;
        int64_t now = now_ns();
        if (deadline_ns && now >= deadline_ns) return WAIT_TIMEOUT;
        if (c->parent_pid && getppid() != c->parent_pid) return WAIT_PARENT_DEAD;
        int64_t slice = (int64_t)COMM_SLEEP_SLICE_MS * 1000000LL;
        if (deadline_ns && deadline_ns - now < slice) slice = deadline_ns - now;
        atomic_fetch_add_explicit(waiters, 1, memory_order_seq_cst);
        v = atomic_load_explicit(w, memory_order_seq_cst);
        if (!reached(v, target)) futex_wait(w, v, slice);
        atomic_fetch_sub_explicit(waiters, 1, memory_order_seq_cst);
    }
}

static int64_t deadline_from(int timeout_ms) {
    return timeout_ms > 0 ? now_ns() + (int64_t)timeout_ms * 1000000LL : 0;
}

/* Turns a failed wait into this rank's error (and the group's abort). */
static int comm_wait_fail(comm *c, int why, const char *op, int peer, int timeout_ms, specd_err *err) {
    char reason[COMM_REASON_MAX + 32];
    switch (why) {
    case WAIT_TIMEOUT:
        snprintf(reason, sizeof reason, "%s timed out after %d ms waiting for rank %d", op, timeout_ms, peer);
        comm_abort(c, reason);
        return specd_err_set(err, "comm rank %d: %s: timed out after %d ms waiting for rank %d", c->rank, op,
                             timeout_ms, peer);
    case WAIT_PARENT_DEAD:
        snprintf(reason, sizeof reason, "rank 0 (pid %d) exited", (int)c->parent_pid);
        comm_abort_as(c, 0, reason);
        return specd_err_set(err, "comm rank %d: %s: rank 0 (pid %d) exited", c->rank, op, (int)c->parent_pid);
    default:
        comm_aborted(c, reason, sizeof reason);
        return specd_err_set(err, "comm rank %d: %s: aborted: %s", c->rank, op, reason);
    }
}

static int comm_check_abort(comm *c, const char *op, specd_err *err) {
    if (!atomic_load_explicit(&c->h->abort_state, memory_order_acquire)) return 0;
    return comm_wait_fail(c, WAIT_ABORTED, op, -1, 0, err);
}

/* One barrier: publish arrival, wait for every other rank. */
static int comm_barrier_round(comm *c, const char *op, int64_t deadline, specd_err *err) {
    shm_hdr *h = c->h;
    uint32_t s = ++c->seq;
    word_publish(&h->rank[c->rank].arrive, &h->rank[c->rank].arrive_waiters, s);
    for (int j = 0; j < c->world; j++) {
        if (j == c->rank) continue;
        int why = comm_wait_ge(c, &h->rank[j].arrive, &h->rank[j].arrive_waiters, s, deadline);
        if (why != WAIT_OK) return comm_wait_fail(c, why, op, j, c->timeout_ms, err);
    }
    return 0;
}

static const char *op_name(uint32_t op) {
    switch (op) {
    case OP_BARRIER: return "barrier";
    case OP_ALL_REDUCE: return "all_reduce";
    case OP_ALL_GATHER: return "all_gather";
    case OP_BROADCAST: return "broadcast";
    default: return "?";
    }
}

/* After barrier A: every rank must be in the same op with the same sizes. */
static int comm_check_descs(comm *c, uint32_t parity, const char *op, specd_err *err) {
    const shm_desc *me = &c->h->rank[c->rank].desc[parity];
    for (int j = 0; j < c->world; j++) {
        const shm_desc *d = &c->h->rank[j].desc[parity];
        bool same = d->op == me->op && d->root == me->root;
        if (me->op != OP_BROADCAST) same = same && d->bytes == me->bytes && d->total == me->total;
        if (!same) {
            char reason[COMM_REASON_MAX];
            snprintf(reason, sizeof reason,
                     "collective mismatch: rank %d called %s(%llu bytes, root %u), rank %d called %s(%llu bytes, root %u)",
                     c->rank, op_name(me->op), (unsigned long long)me->total, me->root, j, op_name(d->op),
                     (unsigned long long)d->total, d->root);
            comm_abort(c, reason);
            return specd_err_set(err, "comm rank %d: %s: %s", c->rank, op, reason);
        }
    }
    return 0;
}

/* Starts a round: writes the descriptor; returns its parity. */
static uint32_t comm_round_begin(comm *c, uint32_t op, uint32_t root, uint64_t bytes, uint64_t total) {
    uint32_t p = c->round++ & 1u;
    shm_desc *d = &c->h->rank[c->rank].desc[p];
    d->op = op;
    d->root = root;
    d->bytes = bytes;
    d->total = total;
    return p;
}

/* ================================ lifecycle ================================= */

comm_config comm_config_default(void) {
    comm_config cfg = {0};
    cfg.slot_bytes = 1u << 20;
    cfg.step_max_bytes = 1u << 20;
    cfg.step_depth = 4;
    cfg.timeout_ms = 60000;
    cfg.spin_us = -1;
    cfg.oneshot_max_bytes = 0;
    return cfg;
}

/* Default one-shot/two-shot switch (measured with comm_bench, docs/engine.md):
 * one-shot while the bytes one rank reads, world x message, stay within
 * 128 KiB (L2-resident); beyond that two-shot, which reads each byte once in
 * total across the ranks, wins by 2-8x at world 4 and 8. */
#define ONESHOT_READ_BUDGET_BYTES (128u * 1024u)

static void comm_apply_local(comm *c, const comm_config *cfg) {
    c->timeout_ms = cfg && cfg->timeout_ms > 0 ? cfg->timeout_ms : 60000;
    int spin_us = cfg ? cfg->spin_us : -1;
    if (spin_us < 0) {
        /* Spinning only pays when every rank has a core; on an oversubscribed
         * box a spinning rank steals the core the awaited rank needs. */
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        spin_us = c->world <= ncpu ? 50 : 2;
    }
    c->spin_ns = (int64_t)spin_us * 1000;
    c->oneshot_max = cfg && cfg->oneshot_max_bytes ? cfg->oneshot_max_bytes
                                                   : ONESHOT_READ_BUDGET_BYTES / (size_t)c->world;
}

int comm_shm_create(int world, const comm_config *cfg_in, int *fd_out, comm **out, specd_err *err) {
    *out = NULL;
    *fd_out = -1;
    if (world < 1 || world > COMM_MAX_WORLD)
        return specd_err_set(err, "comm: world size %d out of range [1, %d]", world, COMM_MAX_WORLD);
    comm_config cfg = comm_config_default();
    if (cfg_in) {
        if (cfg_in->slot_bytes) cfg.slot_bytes = cfg_in->slot_bytes;
        if (cfg_in->step_max_bytes) cfg.step_max_bytes = cfg_in->step_max_bytes;
        if (cfg_in->step_depth) cfg.step_depth = cfg_in->step_depth;
        cfg.timeout_ms = cfg_in->timeout_ms;
        cfg.spin_us = cfg_in->spin_us;
        cfg.oneshot_max_bytes = cfg_in->oneshot_max_bytes;
    }
    if (cfg.slot_bytes > ((size_t)1 << 30) || cfg.step_max_bytes > ((size_t)1 << 30) || cfg.step_depth > 1024)
        return specd_err_set(err, "comm: slot %zu B / step message %zu B / step depth %u too large", cfg.slot_bytes,
                             cfg.step_max_bytes, cfg.step_depth);
    size_t slot = align_up(cfg.slot_bytes, SHM_ALIGN);
    size_t stride = STEP_ENTRY_HDR + align_up(cfg.step_max_bytes, SHM_ALIGN);
    size_t off_slots = align_up(sizeof(shm_hdr), 4096);
    size_t off_step = off_slots + 2 * (size_t)(world + 1) * slot;
    size_t total = align_up(off_step + (size_t)cfg.step_depth * stride, 4096);

    comm *c = calloc(1, sizeof *c);
    if (!c) return specd_err_set(err, "comm: out of memory");
    int fd = memfd_create("specd-comm", 0); /* no MFD_CLOEXEC: the workers inherit it */
    if (fd < 0) {
        free(c);
        return specd_err_set(err, "comm: memfd_create: %s", strerror(errno));
    }
    if (ftruncate(fd, (off_t)total) != 0) {
        specd_err_set(err, "comm: sizing the %zu-byte segment: %s", total, strerror(errno));
        goto fail;
    }
    void *m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        specd_err_set(err, "comm: mmap of %zu bytes: %s", total, strerror(errno));
        goto fail;
    }
    c->h = m;
    c->map_bytes = total;
    c->rank = 0;
    c->world = world;
    comm_apply_local(c, &cfg);
    shm_hdr *h = c->h; /* fresh memfd pages are zero: atomics start at 0 */
    h->world = (uint32_t)world;
    h->step_depth = cfg.step_depth;
    h->slot_bytes = slot;
    h->step_max_bytes = cfg.step_max_bytes;
    h->step_stride = stride;
    h->off_slots = off_slots;
    h->off_step = off_step;
    h->total_bytes = total;
    h->timeout_ms = cfg.timeout_ms;
    h->spin_us = cfg.spin_us;
    h->oneshot_max_bytes = c->oneshot_max;
    atomic_store(&h->rank[0].pid, (int32_t)getpid());
    atomic_store(&h->attached, 1);
    atomic_store_explicit((_Atomic uint64_t *)&h->magic, SHM_MAGIC, memory_order_release);
    *fd_out = fd;
    *out = c;
    return 0;
fail:
    close(fd);
    free(c);
    return -1;
}

int comm_shm_attach(int fd, int rank, int world, pid_t parent_pid, comm **out, specd_err *err) {
    *out = NULL;
    comm *c = NULL;
    void *m = MAP_FAILED;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        specd_err_set(err, "comm rank %d: segment fd %d: %s", rank, fd, strerror(errno));
        goto fail;
    }
    if ((size_t)st.st_size < sizeof(shm_hdr)) {
        specd_err_set(err, "comm rank %d: segment fd %d has %lld bytes, not a comm segment", rank, fd,
                      (long long)st.st_size);
        goto fail;
    }
    m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        specd_err_set(err, "comm rank %d: mmap: %s", rank, strerror(errno));
        goto fail;
    }
    shm_hdr *h = m;
    if (h->magic != SHM_MAGIC || h->total_bytes != (uint64_t)st.st_size) {
        specd_err_set(err, "comm rank %d: fd %d is not a comm segment (bad magic or size)", rank, fd);
        goto fail;
    }
    if ((int)h->world != world || rank < 1 || rank >= world) {
        specd_err_set(err, "comm rank %d: segment is for world %u, asked rank %d of world %d", rank, h->world, rank,
                      world);
        goto fail;
    }
    int32_t none = 0;
    if (!atomic_compare_exchange_strong(&h->rank[rank].pid, &none, (int32_t)getpid())) {
        specd_err_set(err, "comm rank %d: already attached by pid %d", rank, (int)none);
        goto fail;
    }
    c = calloc(1, sizeof *c);
    if (!c) {
        specd_err_set(err, "comm rank %d: out of memory", rank);
        goto fail;
    }
    c->h = h;
    c->map_bytes = (size_t)st.st_size;
    c->rank = rank;
    c->world = world;
    c->parent_pid = parent_pid;
    comm_config cfg = comm_config_default();
    cfg.timeout_ms = h->timeout_ms;
    cfg.spin_us = h->spin_us;
    cfg.oneshot_max_bytes = h->oneshot_max_bytes;
    comm_apply_local(c, &cfg);
    close(fd);
    atomic_fetch_add_explicit(&h->attached, 1, memory_order_seq_cst);
    futex_wake(&h->attached);
    *out = c;
    return 0;
fail:
    if (m != MAP_FAILED) munmap(m, (size_t)st.st_size);
    close(fd);
    return -1;
}

int comm_wait_attached(comm *c, int timeout_ms, specd_err *err) {
    shm_hdr *h = c->h;
    int why = comm_wait_ge(c, &h->attached, &h->attached_waiters, (uint32_t)c->world, deadline_from(timeout_ms));
    if (why == WAIT_OK) return 0;
    int missing = -1;
    for (int r = 0; r < c->world && missing < 0; r++)
        if (atomic_load(&h->rank[r].pid) == 0) missing = r;
    if (why == WAIT_TIMEOUT)
        comm_abort(c, "start-up: not every rank attached in time");
    return why == WAIT_TIMEOUT
               ? specd_err_set(err, "comm rank 0: start-up: timed out after %d ms waiting for rank %d to attach",
                               timeout_ms, missing)
               : comm_wait_fail(c, why, "start-up", missing, timeout_ms, err);
}

void comm_destroy(comm *c) {
    if (!c) return;
    if (c->h) munmap(c->h, c->map_bytes);
    free(c);
}

int comm_rank(const comm *c) { return c->rank; }
int comm_world(const comm *c) { return c->world; }
void comm_set_timeout_ms(comm *c, int ms) { c->timeout_ms = ms; }
pid_t comm_rank_pid(const comm *c, int rank) {
    return rank >= 0 && rank < c->world ? (pid_t)atomic_load(&c->h->rank[rank].pid) : 0;
}
size_t comm_step_max_bytes(const comm *c) { return c->h->step_max_bytes; }

/* ================================ collectives =============================== */

int comm_barrier(comm *c, specd_err *err) {
    if (comm_check_abort(c, "barrier", err)) return -1;
    int64_t deadline = deadline_from(c->timeout_ms);
    uint32_t p = comm_round_begin(c, OP_BARRIER, 0, 0, 0);
    if (comm_barrier_round(c, "barrier", deadline, err)) return -1;
    return comm_check_descs(c, p, "barrier", err);
}

/* dst[i] = ((src_0[i] + src_1[i]) + ...) for i in [0, n): rank order fixed. */
static void reduce_ordered(float *restrict dst, const float *const *src, int nsrc, size_t n) {
    enum { BLK = 2048 }; /* 8 KB of dst stays in L1 across the nsrc passes */
    for (size_t b = 0; b < n; b += BLK) {
        size_t m = n - b < BLK ? n - b : BLK;
        float *restrict d = dst + b;
        const float *restrict s0 = src[0] + b;
        for (size_t i = 0; i < m; i++) d[i] = s0[i];
        for (int j = 1; j < nsrc; j++) {
            const float *restrict sj = src[j] + b;
            for (size_t i = 0; i < m; i++) d[i] += sj[i];
        }
    }
}

int comm_all_reduce_sum_f32(comm *c, float *buf, size_t n, specd_err *err) {
    char op[64];
    snprintf(op, sizeof op, "all_reduce(%zu f32)", n);
    if (comm_check_abort(c, op, err)) return -1;
    int64_t deadline = deadline_from(c->timeout_ms);
    size_t per_round = c->h->slot_bytes / sizeof(float);
    size_t done = 0;
    const float *src[COMM_MAX_WORLD];
    do {
        size_t m = n - done < per_round ? n - done : per_round;
        uint32_t p = comm_round_begin(c, OP_ALL_REDUCE, 0, m * sizeof(float), n * sizeof(float));
        memcpy(slot_ptr(c, p, c->rank), buf + done, m * sizeof(float));
        if (comm_barrier_round(c, op, deadline, err)) return -1;
        if (comm_check_descs(c, p, op, err)) return -1;
        for (int j = 0; j < c->world; j++) src[j] = (const float *)slot_ptr(c, p, j);
        if (m * sizeof(float) <= c->oneshot_max || c->world == 1) {
            reduce_ordered(buf + done, src, c->world, m); /* one-shot: every rank reduces all of it */
        } else {
            /* Two-shot: rank r reduces its slice into the shared result, then all copy it. Slices are
             * multiples of 16 floats (a cache line) so no two ranks write one line. */
            size_t per = align_up((m + (size_t)c->world - 1) / (size_t)c->world, 16);
            size_t lo = per * (size_t)c->rank < m ? per * (size_t)c->rank : m;
            size_t hi = lo + per < m ? lo + per : m;
            float *res = (float *)slot_ptr(c, p, c->world);
            const float *sl[COMM_MAX_WORLD];
            for (int j = 0; j < c->world; j++) sl[j] = src[j] + lo;
            if (hi > lo) reduce_ordered(res + lo, sl, c->world, hi - lo);
            if (comm_barrier_round(c, op, deadline, err)) return -1;
            memcpy(buf + done, res, m * sizeof(float));
        }
        done += m;
    } while (done < n);
    return 0;
}

int comm_all_gather(comm *c, const void *chunk, size_t chunk_bytes, void *out, specd_err *err) {
    char op[64];
    snprintf(op, sizeof op, "all_gather(%zu B per rank)", chunk_bytes);
    if (comm_check_abort(c, op, err)) return -1;
    int64_t deadline = deadline_from(c->timeout_ms);
    size_t slot = c->h->slot_bytes, done = 0;
    uint8_t *o = out;
    const uint8_t *in = chunk;
    do {
        size_t m = chunk_bytes - done < slot ? chunk_bytes - done : slot;
        uint32_t p = comm_round_begin(c, OP_ALL_GATHER, 0, m, chunk_bytes);
        memcpy(slot_ptr(c, p, c->rank), in + done, m);
        if (comm_barrier_round(c, op, deadline, err)) return -1;
        if (comm_check_descs(c, p, op, err)) return -1;
        for (int j = 0; j < c->world; j++) {
            uint8_t *dst = o + (size_t)j * chunk_bytes + done;
            const uint8_t *s = slot_ptr(c, p, j);
            if (j == c->rank && dst == in + done) continue; /* gathered in place */
            memcpy(dst, s, m);
        }
        done += m;
    } while (done < chunk_bytes);
    return 0;
}

int comm_broadcast(comm *c, int root, void *buf, size_t *nbytes, size_t cap, specd_err *err) {
    char op[64];
    snprintf(op, sizeof op, "broadcast(root %d)", root);
    if (root < 0 || root >= c->world) {
        char reason[96];
        snprintf(reason, sizeof reason, "broadcast from root %d outside world %d", root, c->world);
        comm_abort(c, reason);
        return specd_err_set(err, "comm rank %d: %s", c->rank, reason);
    }
    if (comm_check_abort(c, op, err)) return -1;
    int64_t deadline = deadline_from(c->timeout_ms);
    size_t slot = c->h->slot_bytes, done = 0, total = c->rank == root ? *nbytes : 0;
    uint8_t *b = buf;
    do {
        size_t m = c->rank == root ? (total - done < slot ? total - done : slot) : 0;
        uint32_t p = comm_round_begin(c, OP_BROADCAST, (uint32_t)root, m, total);
        if (c->rank == root) memcpy(slot_ptr(c, p, root), b + done, m);
        if (comm_barrier_round(c, op, deadline, err)) return -1;
        if (comm_check_descs(c, p, op, err)) return -1;
        if (c->rank != root) {
            const shm_desc *rd = &c->h->rank[root].desc[p];
            if (done == 0) {
                total = rd->total;
                if (total > cap) {
                    char reason[COMM_REASON_MAX];
                    snprintf(reason, sizeof reason, "broadcast of %zu bytes exceeds rank %d's buffer of %zu bytes",
                             total, c->rank, cap);
                    comm_abort(c, reason);
                    return specd_err_set(err, "comm rank %d: %s: %s", c->rank, op, reason);
                }
                *nbytes = total;
            }
            m = rd->bytes;
            memcpy(b + done, slot_ptr(c, p, root), m);
        }
        done += m;
    } while (done < total);
    return 0;
}

/* ================================ step channel ============================== */

int comm_step_send(comm *c, comm_step_kind kind, const void *msg, size_t n, specd_err *err) {
    shm_hdr *h = c->h;
    if (c->rank != 0) return specd_err_set(err, "comm rank %d: step_send: only rank 0 posts steps", c->rank);
    if (n > h->step_max_bytes)
        return specd_err_set(err, "comm rank 0: step_send: message of %zu bytes exceeds the step maximum of %llu",
                             n, (unsigned long long)h->step_max_bytes);
    if (comm_check_abort(c, "step_send", err)) return -1;
    uint32_t head = c->step_local;
    if (head >= h->step_depth) { /* ring slot head % depth must have been consumed by every worker */
        int64_t deadline = deadline_from(c->timeout_ms);
        uint32_t need = head + 1 - h->step_depth;
        for (int w = 1; w < c->world; w++) {
            int why = comm_wait_ge(c, &h->rank[w].step_tail, &h->rank[w].step_tail_waiters, need, deadline);
            if (why != WAIT_OK) return comm_wait_fail(c, why, "step_send (ring full)", w, c->timeout_ms, err);
        }
    }
    uint8_t *e = step_entry(c, head);
    shm_step_entry *eh = (shm_step_entry *)e;
    eh->kind = (uint32_t)kind;
    eh->bytes = n;
    if (n) memcpy(e + STEP_ENTRY_HDR, msg, n);
    c->step_local = head + 1;
    word_publish(&h->step_head, &h->step_head_waiters, head + 1);
    return 0;
}

int comm_step_recv(comm *c, void *buf, size_t cap, size_t *n, comm_step_kind *kind, int timeout_ms,
                   specd_err *err) {
    shm_hdr *h = c->h;
    if (c->rank == 0) return specd_err_set(err, "comm rank 0: step_recv: rank 0 posts steps, it does not receive");
    uint32_t tail = c->step_local;
    int why = comm_wait_ge(c, &h->step_head, &h->step_head_waiters, tail + 1, deadline_from(timeout_ms));
    if (why != WAIT_OK) return comm_wait_fail(c, why, "step_recv", 0, timeout_ms, err);
    const uint8_t *e = step_entry(c, tail);
    const shm_step_entry *eh = (const shm_step_entry *)e;
    if (eh->bytes > cap) {
        char reason[COMM_REASON_MAX];
        snprintf(reason, sizeof reason, "step message of %llu bytes exceeds rank %d's buffer of %zu bytes",
                 (unsigned long long)eh->bytes, c->rank, cap);
        comm_abort(c, reason);
        return specd_err_set(err, "comm rank %d: step_recv: %s", c->rank, reason);
    }
    *n = eh->bytes;
    *kind = (comm_step_kind)eh->kind;
    if (eh->bytes) memcpy(buf, e + STEP_ENTRY_HDR, eh->bytes);
    c->step_local = tail + 1;
    word_publish(&h->rank[c->rank].step_tail, &h->rank[c->rank].step_tail_waiters, tail + 1);
    return 0;
}

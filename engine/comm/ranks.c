/*
 * ranks.c: spawning, watching and draining the worker processes (ranks.h).
 *
 * Owns: the worker pids and pidfds, their exit statuses, the monitor thread,
 * and rank 0's comm (created here, destroyed here).
 *
 * Invariants:
 *  - every spawned worker is reaped exactly once, by the monitor thread
 *    (waitid on its pidfd), never by anyone else: no zombies, no double wait;
 *  - signals go through pidfd_send_signal, so a reaped pid that the kernel
 *    reused is never hit;
 *  - an exit the monitor did not expect (any exit before the drain, or a
 *    non-zero/killed exit during it) aborts the group with the rank, pid and
 *    how it ended.
 *
 * Threading: the public calls from one thread of rank 0; the monitor thread
 * shares `mu`/`cv` with them (statuses, reaped flags).
 */
#define _GNU_SOURCE
#include "engine/comm/ranks.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/pidfd.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/util/log.h"

extern char **environ;

struct ranks {
    int world;
    comm *c;
    pid_t pid[COMM_MAX_WORLD];     /* [world], pid[0] = rank 0 itself */
    int pidfd[COMM_MAX_WORLD];     /* -1 once reaped or never spawned */
    int wstatus[COMM_MAX_WORLD];   /* valid when reaped */
    bool reaped[COMM_MAX_WORLD];
    bool spawned[COMM_MAX_WORLD];
    atomic_bool draining;          /* exits with status 0 are expected from now on */
    atomic_bool destroying;        /* ranks_destroy kills what is left: no exit is news */
    int evfd;                      /* wakes the monitor to stop */
    pthread_t mon;
    bool mon_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;             /* signalled on every reap */
};

/* ================================= monitor ================================== */

static void describe_exit(int wstatus, char *out, size_t len) {
    if (WIFSIGNALED(wstatus))
        snprintf(out, len, "signal %d%s", WTERMSIG(wstatus), WCOREDUMP(wstatus) ? ", core dumped" : "");
    else
        snprintf(out, len, "status %d", WEXITSTATUS(wstatus));
}

static void ranks_reap(ranks *rk, int r) {
    siginfo_t si;
    memset(&si, 0, sizeof si);
    if (waitid(P_PIDFD, (id_t)rk->pidfd[r], &si, WEXITED) != 0) {
        if (errno == EINTR) return;
        LOG_WARN("comm: waitid on rank %d (pid %d): %s", r, (int)rk->pid[r], strerror(errno));
        si.si_code = CLD_KILLED; /* cannot tell: report as lost */
        si.si_status = 0;
    }
    int ws = si.si_code == CLD_EXITED ? (si.si_status & 0xff) << 8
                                      : (si.si_status & 0x7f) | (si.si_code == CLD_DUMPED ? 0x80 : 0);
    pthread_mutex_lock(&rk->mu);
    close(rk->pidfd[r]);
    rk->pidfd[r] = -1;
    rk->wstatus[r] = ws;
    rk->reaped[r] = true;
    pthread_cond_broadcast(&rk->cv);
    pthread_mutex_unlock(&rk->mu);
    bool clean = WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
    /* A clean exit is expected during the drain, and after the group failed (workers give up). */
    bool expected = (clean && (atomic_load(&rk->draining) || comm_aborted(rk->c, NULL, 0))) ||
                    atomic_load(&rk->destroying);
    if (!expected) {
        char how[64], reason[COMM_REASON_MAX];
        describe_exit(ws, how, sizeof how);
        snprintf(reason, sizeof reason, "rank %d (pid %d) exited (%s)%s", r, (int)rk->pid[r], how,
                 atomic_load(&rk->draining) ? "" : " outside shutdown");
        comm_abort_as(rk->c, r, reason);
        LOG_ERROR("comm: %s", reason);
    }
}

static void *ranks_monitor(void *arg) {
    ranks *rk = arg;
    for (;;) {
        struct pollfd pf[COMM_MAX_WORLD + 1];
        int who[COMM_MAX_WORLD + 1], n = 0;
        pf[n] = (struct pollfd){.fd = rk->evfd, .events = POLLIN};
        who[n++] = -1;
        pthread_mutex_lock(&rk->mu);
        for (int r = 1; r < rk->world; r++)
            if (rk->pidfd[r] >= 0) {
                pf[n] = (struct pollfd){.fd = rk->pidfd[r], .events = POLLIN};
                who[n++] = r;
            }
        pthread_mutex_unlock(&rk->mu);
        if (poll(pf, (nfds_t)n, -1) < 0) {
            if (errno == EINTR) continue;
            LOG_ERROR("comm: monitor poll: %s", strerror(errno));
            return NULL;
        }
        if (pf[0].revents) return NULL;
        for (int i = 1; i < n; i++)
            if (pf[i].revents) ranks_reap(rk, who[i]);
    }
}

static void ranks_monitor_stop(ranks *rk) {
    if (!rk->mon_started) return;
    uint64_t one = 1;
    if (write(rk->evfd, &one, sizeof one) != (ssize_t)sizeof one) LOG_WARN("comm: waking the monitor failed");
    pthread_join(rk->mon, NULL);
    rk->mon_started = false;
}

/* Waits until every spawned worker is reaped or the deadline (monotonic ns) passes. */
static bool ranks_wait_reaped(ranks *rk, int64_t deadline_ns) {
    pthread_mutex_lock(&rk->mu);
    for (;;) {
        bool all = true;
        for (int r = 1; r < rk->world; r++)
            if (rk->spawned[r] && !rk->reaped[r]) all = false;
        if (all || !rk->mon_started) {
            pthread_mutex_unlock(&rk->mu);
            return all;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t now = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
        if (now >= deadline_ns) {
            pthread_mutex_unlock(&rk->mu);
            return false;
        }
        struct timespec until = {.tv_sec = deadline_ns / 1000000000LL, .tv_nsec = deadline_ns % 1000000000LL};
        pthread_cond_timedwait(&rk->cv, &rk->mu, &until);
    }
}

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void ranks_kill_all(ranks *rk) {
    pthread_mutex_lock(&rk->mu);
    for (int r = 1; r < rk->world; r++)
        if (rk->pidfd[r] >= 0) pidfd_send_signal(rk->pidfd[r], SIGKILL, NULL, 0);
    pthread_mutex_unlock(&rk->mu);
}

/* ================================= lifecycle ================================ */

int ranks_launch(const ranks_config *cfg, ranks **out, specd_err *err) {
    *out = NULL;
    int world = cfg->world;
    if (world < 1 || world > COMM_MAX_WORLD)
        return specd_err_set(err, "ranks: world size %d out of range [1, %d]", world, COMM_MAX_WORLD);
    if (world > 1 && (!cfg->worker_argv || !cfg->worker_argv[0]))
        return specd_err_set(err, "ranks: world %d needs a worker argv", world);
    ranks *rk = calloc(1, sizeof *rk);
    if (!rk) return specd_err_set(err, "ranks: out of memory");
    rk->world = world;
    rk->evfd = -1;
    for (int r = 0; r < COMM_MAX_WORLD; r++) rk->pidfd[r] = -1;
    pthread_mutex_init(&rk->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&rk->cv, &ca);
    pthread_condattr_destroy(&ca);
    rk->pid[0] = getpid();

    char **argv = NULL;
    int fd = -1;
    if (comm_shm_create(world, &cfg->comm, &fd, &rk->c, err)) goto fail;
    rk->evfd = eventfd(0, EFD_CLOEXEC);
    if (rk->evfd < 0) {
        specd_err_set(err, "ranks: eventfd: %s", strerror(errno));
        goto fail;
    }

    size_t nuser = 0;
    while (world > 1 && cfg->worker_argv[nuser]) nuser++;
    argv = calloc(nuser + 5, sizeof *argv);
    char a_rank[48], a_world[48], a_fd[48], a_parent[48];
    if (!argv) {
        specd_err_set(err, "ranks: out of memory");
        goto fail;
    }
    for (size_t i = 0; i < nuser; i++) argv[i] = (char *)cfg->worker_argv[i];
    snprintf(a_world, sizeof a_world, "--specd-comm-world=%d", world);
    snprintf(a_fd, sizeof a_fd, "--specd-comm-fd=%d", fd);
    snprintf(a_parent, sizeof a_parent, "--specd-comm-parent=%d", (int)getpid());
    argv[nuser + 0] = a_rank;
    argv[nuser + 1] = a_world;
    argv[nuser + 2] = a_fd;
    argv[nuser + 3] = a_parent;

    /* Workers start with an empty signal mask and default SIGTERM/SIGINT/SIGHUP/SIGPIPE handling,
     * whatever rank 0's threads did to theirs. */
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, defs;
    sigemptyset(&none);
    sigemptyset(&defs);
    sigaddset(&defs, SIGTERM);
    sigaddset(&defs, SIGINT);
    sigaddset(&defs, SIGHUP);
    sigaddset(&defs, SIGPIPE);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &defs);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    for (int r = 1; r < world; r++) {
        snprintf(a_rank, sizeof a_rank, "--specd-comm-rank=%d", r);
        pid_t pid;
        int rc = posix_spawn(&pid, "/proc/self/exe", NULL, &attr, argv, environ);
        if (rc != 0) {
            specd_err_set(err, "ranks: spawning rank %d (/proc/self/exe): %s", r, strerror(rc));
            posix_spawnattr_destroy(&attr);
            goto fail;
        }
        rk->pid[r] = pid;
        rk->spawned[r] = true;
        rk->pidfd[r] = pidfd_open(pid, 0);
        if (rk->pidfd[r] < 0) {
            /* Without a pidfd nobody can watch it: kill and reap it here. */
            int e = errno;
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            rk->spawned[r] = false;
            specd_err_set(err, "ranks: pidfd_open for rank %d: %s", r, strerror(e));
            posix_spawnattr_destroy(&attr);
            goto fail;
        }
        fcntl(rk->pidfd[r], F_SETFD, FD_CLOEXEC);
    }
    posix_spawnattr_destroy(&attr);
    close(fd); /* the workers hold their inherited copies; our mapping stays */
    fd = -1;
    free(argv);
    argv = NULL;

    if (world > 1) {
        int rc = pthread_create(&rk->mon, NULL, ranks_monitor, rk);
        if (rc != 0) {
            specd_err_set(err, "ranks: monitor thread: %s", strerror(rc));
            goto fail;
        }
        rk->mon_started = true;
    }
    int attach_ms = cfg->attach_timeout_ms > 0 ? cfg->attach_timeout_ms : 30000;
    if (comm_wait_attached(rk->c, attach_ms, err)) goto fail;
    *out = rk;
    return 0;
fail:
    if (fd >= 0) close(fd);
    free(argv);
    if (!rk->mon_started) { /* nobody else will reap them */
        for (int r = 1; r < world; r++)
            if (rk->pidfd[r] >= 0) {
                pidfd_send_signal(rk->pidfd[r], SIGKILL, NULL, 0);
                waitpid(rk->pid[r], NULL, 0);
                close(rk->pidfd[r]);
                rk->pidfd[r] = -1;
                rk->spawned[r] = false;
            }
    }
    ranks_destroy(rk);
    return -1;
}

comm *ranks_comm(ranks *rk) { return rk->c; }
pid_t ranks_pid(const ranks *rk, int rank) { return rank >= 0 && rank < rk->world ? rk->pid[rank] : 0; }

bool ranks_exit_status(ranks *rk, int rank, int *wstatus) {
    if (rank < 1 || rank >= rk->world) return false;
    pthread_mutex_lock(&rk->mu);
    bool done = rk->reaped[rank];
    if (done && wstatus) *wstatus = rk->wstatus[rank];
    pthread_mutex_unlock(&rk->mu);
    return done;
}

int ranks_shutdown(ranks *rk, int timeout_ms, specd_err *err) {
    if (timeout_ms <= 0) timeout_ms = 10000;
    int64_t deadline = mono_ns() + (int64_t)timeout_ms * 1000000LL;
    atomic_store(&rk->draining, true);
    specd_err send_err = {{0}};
    bool sent = false;
    if (rk->world > 1 && !comm_aborted(rk->c, NULL, 0)) {
        comm_set_timeout_ms(rk->c, timeout_ms);
        sent = comm_step_send(rk->c, COMM_STEP_SHUTDOWN, NULL, 0, &send_err) == 0;
    }
    bool all = ranks_wait_reaped(rk, deadline);
    if (!all) {
        ranks_kill_all(rk);
        ranks_wait_reaped(rk, mono_ns() + 5000000000LL);
    }
    for (int r = 1; r < rk->world; r++) {
        if (!rk->spawned[r]) continue;
        int ws;
        if (!ranks_exit_status(rk, r, &ws))
            return specd_err_set(err, "ranks: rank %d (pid %d) could not be reaped", r, (int)rk->pid[r]);
        if (!(WIFEXITED(ws) && WEXITSTATUS(ws) == 0)) {
            char how[64];
            describe_exit(ws, how, sizeof how);
            return specd_err_set(err, "ranks: rank %d (pid %d) exited (%s)%s", r, (int)rk->pid[r], how,
                                 !all ? " (killed: not drained in time)" : "");
        }
    }
    if (rk->world > 1 && !sent) {
        char why[COMM_REASON_MAX + 16] = "";
        comm_aborted(rk->c, why, sizeof why);
        return specd_err_set(err, "ranks: group was aborted before shutdown (%s)%s%s", why,
                             send_err.msg[0] ? "; " : "", send_err.msg);
    }
    return 0;
}

void ranks_destroy(ranks *rk) {
    if (!rk) return;
    atomic_store(&rk->destroying, true);
    if (rk->mon_started) {
        ranks_kill_all(rk);
        ranks_wait_reaped(rk, mono_ns() + 5000000000LL);
        ranks_monitor_stop(rk);
    }
    for (int r = 1; r < rk->world; r++)
        if (rk->pidfd[r] >= 0) { /* the monitor could not reap it in time: do it here */
            pidfd_send_signal(rk->pidfd[r], SIGKILL, NULL, 0);
            waitpid(rk->pid[r], NULL, 0);
            close(rk->pidfd[r]);
        }
    if (rk->evfd >= 0) close(rk->evfd);
    comm_destroy(rk->c);
    pthread_cond_destroy(&rk->cv);
    pthread_mutex_destroy(&rk->mu);
    free(rk);
}

/* ================================ worker side =============================== */

static int parse_int_arg(const char *s, const char *prefix, long *v) {
    size_t n = strlen(prefix);
    if (strncmp(s, prefix, n) != 0) return 0;
    char *end;
    errno = 0;
    long x = strtol(s + n, &end, 10);
    if (errno || end == s + n || *end || x < 0 || x > INT_MAX) return -1;
    *v = x;
    return 1;
}

int ranks_worker_detect(int argc, char *const *argv, ranks_worker *out, specd_err *err) {
    static const char *const names[4] = {"--specd-comm-rank=", "--specd-comm-world=", "--specd-comm-fd=",
                                         "--specd-comm-parent="};
    long v[4] = {0, 0, 0, 0};
    bool seen[4] = {false, false, false, false};
    for (int i = 1; i < argc; i++)
        for (int k = 0; k < 4; k++) {
            int rc = parse_int_arg(argv[i], names[k], &v[k]);
            if (rc < 0) return specd_err_set(err, "ranks: malformed worker argument '%s'", argv[i]);
            if (rc > 0) seen[k] = true;
        }
    int nseen = seen[0] + seen[1] + seen[2] + seen[3];
    if (nseen == 0) return 0;
    for (int k = 0; k < 4; k++)
        if (!seen[k]) return specd_err_set(err, "ranks: worker arguments without %s...", names[k]);
    if (v[1] < 2 || v[1] > COMM_MAX_WORLD || v[0] < 1 || v[0] >= v[1])
        return specd_err_set(err, "ranks: worker rank %ld of world %ld is out of range", v[0], v[1]);
    out->rank = (int)v[0];
    out->world = (int)v[1];
    out->fd = (int)v[2];
    out->parent = (pid_t)v[3];
    return 1;
}

void ranks_worker_strip_args(int *argc, char **argv) {
    int out = 0;
    for (int i = 0; i < *argc; i++)
        if (i == 0 || strncmp(argv[i], "--specd-comm-", 13) != 0) argv[out++] = argv[i];
    for (int i = out; i < *argc; i++) argv[i] = NULL;
    *argc = out;
}

int ranks_worker_attach(const ranks_worker *w, comm **out, specd_err *err) {
    *out = NULL;
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) {
        close(w->fd);
        return specd_err_set(err, "rank %d: prctl(PR_SET_PDEATHSIG): %s", w->rank, strerror(errno));
    }
    if (getppid() != w->parent) { /* rank 0 died before the prctl above took effect */
        close(w->fd);
        return specd_err_set(err, "rank %d: rank 0 (pid %d) already exited", w->rank, (int)w->parent);
    }
    /* Rank 0 drains the workers; a terminal's Ctrl-C or systemd's SIGTERM to the whole group must
     * not kill a worker under rank 0's feet (rank 0 dying still kills it: PDEATHSIG). */
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    return comm_shm_attach(w->fd, w->rank, w->world, w->parent, out, err);
}

int ranks_worker_loop(comm *c, ranks_step_fn on_step, void *ctx, specd_err *err) {
    size_t cap = comm_step_max_bytes(c), n = 0;
    void *buf = malloc(cap ? cap : 1);
    if (!buf) return specd_err_set(err, "rank %d: out of memory for a %zu-byte step buffer", comm_rank(c), cap);
    int rc = 0;
    for (;;) {
        comm_step_kind kind;
        if (comm_step_recv(c, buf, cap, &n, &kind, 0, err)) {
            rc = -1;
            break;
        }
        if (kind == COMM_STEP_SHUTDOWN) break;
        if (on_step(ctx, buf, n, err)) {
            char reason[COMM_REASON_MAX];
            snprintf(reason, sizeof reason, "rank %d step failed: %.200s", comm_rank(c), err ? err->msg : "?");
            comm_abort(c, reason);
            rc = -1;
            break;
        }
    }
    free(buf);
    return rc;
}

/*
 * ranks.h: the processes of a tensor-parallel group on one host.
 *
 * Rank 0 (the process that runs HTTP and the scheduler) calls ranks_launch:
 * it creates the shared segment (comm_shm_create), starts world - 1 workers
 * with posix_spawn of /proc/self/exe (the same binary: the path CI tests is the
 * path shipped), the environment preserved, argv = the caller's worker_argv
 * followed by
 *     --specd-comm-rank=R --specd-comm-world=N --specd-comm-fd=F --specd-comm-parent=PID
 * and waits until every worker has attached. A worker's main calls
 * ranks_worker_detect on its argv and, if it is a worker, ranks_worker_attach.
 *
 * Liveness (the reason this module exists):
 *  - rank 0 holds a pidfd per worker and a monitor thread polls them: when a
 *    worker exits or is killed, the monitor reaps it and aborts the group with
 *    "rank R (pid P) exited (signal 9)" / "(status S)", so every pending and
 *    future collective on every rank fails within milliseconds (bound stated
 *    and tested: < 1 s, measured ~1 ms; docs/engine.md);
 *  - a worker sets PR_SET_PDEATHSIG(SIGKILL) and checks its parent is still
 *    rank 0 (the race before prctl), and its waits re-check getppid() each
 *    sleep slice: a worker whose rank 0 dies exits;
 *  - a hung (e.g. SIGSTOPped) peer is caught by the collective timeout
 *    (comm.h), which aborts the group.
 *  - shutdown (SIGTERM drain): ranks_shutdown posts COMM_STEP_SHUTDOWN on the
 *    step channel; workers return from their loop and exit 0; rank 0 reaps
 *    them, SIGKILLs whoever has not exited by the deadline, and reports any
 *    worker that exited non-zero. No zombies, nothing left in /dev/shm (the
 *    segment is a memfd).
 *
 * Rules for the process that calls ranks_launch:
 *  - PR_SET_PDEATHSIG fires when the THREAD that spawned the worker exits,
 *    not the process: call ranks_launch from the main thread (or one that
 *    lives as long as the group);
 *  - the segment's memfd is inheritable while ranks_launch runs: launch
 *    before other threads start spawning processes (they would inherit it);
 *  - leave SIGCHLD's disposition alone (SIG_IGN makes the kernel reap the
 *    workers itself, and their exit statuses are lost).
 *
 * Use (the shape `specd serve --tensor-parallel-size N` takes):
 *
 *   int main(int argc, char **argv) {
 *       ranks_worker w;
 *       int wk = ranks_worker_detect(argc, argv, &w, &err);   // before any flag parsing
 *       if (wk < 0) { log; return 2; }
 *       ranks_worker_strip_args(&argc, argv);                 // the usual parser never sees them
 *       ... parse flags, as rank 0 did ...
 *       if (wk == 1) {                                        // a worker: load the shard of w.rank
 *           comm *c; if (ranks_worker_attach(&w, &c, &err)) return 2;
 *           int rc = ranks_worker_loop(c, run_step, &model, &err);   // until the drain
 *           comm_destroy(c); return rc ? 1 : 0;
 *       }
 *       ranks_config rc = {.world = tp, .worker_argv = (const char *const *)original_argv,
 *                          .comm = comm_config_default()};
 *       ranks *rk; if (ranks_launch(&rc, &rk, &err)) ...      // main thread, before HTTP threads
 *       ... each step: comm_step_send(ranks_comm(rk), COMM_STEP_DATA, blob, n, &err), own shard ...
 *       ... SIGTERM: ranks_shutdown(rk, 10000, &err); ranks_destroy(rk);
 *   }
 *
 * Threading: ranks_* from one thread of rank 0; the monitor thread is
 * internal. ranks_comm's comm follows comm.h's rule.
 */
#ifndef SPECD_COMM_RANKS_H
#define SPECD_COMM_RANKS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "engine/comm/comm.h"
#include "engine/util/err.h"

typedef struct ranks ranks;

typedef struct ranks_config {
    int world;                      /* N >= 1; 1 starts no worker */
    const char *const *worker_argv; /* NULL-terminated, argv[0] first (the exe is /proc/self/exe) */
    comm_config comm;               /* start from comm_config_default() */
    int attach_timeout_ms;          /* workers must attach within this. <= 0: 30000 */
} ranks_config;

/* Rank 0: creates the group. On failure nothing is left running. */
int ranks_launch(const ranks_config *cfg, ranks **out, specd_err *err);

comm *ranks_comm(ranks *rk);
pid_t ranks_pid(const ranks *rk, int rank);

/* Drain: posts COMM_STEP_SHUTDOWN (unless the group is aborted), waits up to
 * timeout_ms for every worker to exit, SIGKILLs and reaps the rest. Returns 0
 * if every worker exited with status 0 after the drain, else -1 naming the
 * first that did not (killed, non-zero status, exited early). */
int ranks_shutdown(ranks *rk, int timeout_ms, specd_err *err);

/* After a worker was reaped: its wait status (as waitpid's) and true; false if
 * it is still running (or rank out of range / rank 0). */
bool ranks_exit_status(ranks *rk, int rank, int *wstatus);

/* Kills (SIGKILL) and reaps any worker still running, stops the monitor,
 * unmaps. NULL ok. */
void ranks_destroy(ranks *rk);

/* ---- worker side ---- */

typedef struct ranks_worker {
    int rank, world, fd;
    pid_t parent;
} ranks_worker;

/* 1 if argv carries the --specd-comm-* arguments (filled in *out), 0 if not
 * (this process is rank 0 or single-process), -1 if they are malformed. */
int ranks_worker_detect(int argc, char *const *argv, ranks_worker *out, specd_err *err);

/* Removes the --specd-comm-* arguments from argv (in place, keeping the
 * order and the terminating NULL) so the caller's flag parser never sees
 * them; call after ranks_worker_detect. */
void ranks_worker_strip_args(int *argc, char **argv);

/* Worker: arms PR_SET_PDEATHSIG, checks rank 0 is still its parent, attaches. */
int ranks_worker_attach(const ranks_worker *w, comm **out, specd_err *err);

/* The worker's step loop: waits for each step message (forever, failing
 * promptly on abort or rank 0's death) and calls on_step with it (msg valid
 * for the call only) until COMM_STEP_SHUTDOWN. Returns 0 after the shutdown
 * message (the worker then exits 0), -1 on a comm failure or when on_step
 * fails (its message is then also the group's abort reason, so rank 0 learns
 * why). The buffer is comm_step_max_bytes. */
typedef int (*ranks_step_fn)(void *ctx, const void *msg, size_t n, specd_err *err);
int ranks_worker_loop(comm *c, ranks_step_fn on_step, void *ctx, specd_err *err);

#endif

/*
 * serve.c: `specd serve MODEL [flags]`: the process lifecycle around the HTTP
 * server and the engine.
 *
 *   parse flags (defaults < SPECD_* env < argv) -> --check-config exits here
 *   -> HTTP up in LOADING (/health 503) -> load model, tokenizer, engine
 *   -> warm-up request -> SERVING, sd_notify READY=1
 *   -> SIGHUP: re-read --api-key-file (connections untouched)
 *   -> SIGTERM/SIGINT: DRAINING (/health and new requests 503, STOPPING=1),
 *      in-flight requests run up to --shutdown-timeout, then are aborted;
 *      HTTP stopped after every response ended; exit 0.
 *
 * Signals are blocked in every thread and taken synchronously by one signal
 * thread (sigwait), so no work happens in an async signal handler; it sets
 * flags and wakes main through a condition variable.
 *
 * systemd (when built with libsystemd): STATUS= lines for each phase,
 * READY=1 after the warm-up, STOPPING=1 at drain, WATCHDOG=1 from a timer
 * thread every WatchdogSec/2 but only while the engine loop has completed an
 * iteration within max(WatchdogSec/2, 3 s) (the idle loop ticks once a
 * second), so a hung engine stops the pings and systemd restarts the service.
 *
 * Threading: main thread owns the lifecycle; the signal and watchdog threads
 * only read atomics and call thread-safe functions (auth_reload, sd_notify,
 * engine_loop_age_s).
 */
#include "server/serve.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/util/log.h"
#include "server/auth.h"
#include "server/bundle.h"
#include "server/http.h"
#include "server/metrics.h"

#ifdef SPECD_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#define NOTIFY(...) sd_notifyf(0, __VA_ARGS__)
#else
#define NOTIFY(...) ((void)0)
#endif

typedef struct serve_ctx {
    sigset_t sigs;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic bool stop;       /* SIGTERM/SIGINT received */
    _Atomic bool quit_signal_thread;
    auth *auth;
    engine *_Atomic eng;     /* for the watchdog */
    _Atomic bool watchdog_stop;
    uint64_t watchdog_usec;
} serve_ctx;

static void *signal_thread(void *arg) {
    serve_ctx *c = arg;
    for (;;) {
        int sig = 0;
        if (sigwait(&c->sigs, &sig)) continue;
        if (atomic_load(&c->quit_signal_thread)) break;
        if (sig == SIGHUP) {
            specd_err err = {{0}};
            if (auth_reload(c->auth, &err)) LOG_WARN("SIGHUP: api key not reloaded: %s", err.msg);
            else LOG_INFO("SIGHUP: api key file reloaded");
            continue;
        }
        if (sig == SIGTERM || sig == SIGINT) {
            LOG_INFO("%s: draining", sig == SIGTERM ? "SIGTERM" : "SIGINT");
            pthread_mutex_lock(&c->mu);
            atomic_store(&c->stop, true);
            pthread_cond_broadcast(&c->cv);
            pthread_mutex_unlock(&c->mu);
        }
    }
    return NULL;
}

static void *watchdog_thread(void *arg) {
    serve_ctx *c = arg;
    double limit_s = (double)c->watchdog_usec / 1e6;
    while (!atomic_load(&c->watchdog_stop)) {
        struct timespec ts = {.tv_sec = (time_t)(c->watchdog_usec / 2000000),
                              .tv_nsec = (long)((c->watchdog_usec / 2) % 1000000) * 1000};
        nanosleep(&ts, NULL);
        engine *e = atomic_load(&c->eng);
        double age = e ? engine_loop_age_s(e) : 0.0; /* loading: the load itself is covered by TimeoutStartSec */
        /* the idle loop ticks every second: never demand less than 3 s */
        if (age < (limit_s / 2 > 3.0 ? limit_s / 2 : 3.0)) NOTIFY("WATCHDOG=1");
        else LOG_WARN("watchdog: engine loop silent for %.1f s; not pinging systemd", age);
    }
    return NULL;
}

static void usage(FILE *f, specd_config *c) {
    cfg_table t;
    specd_config_table(c, &t);
    fprintf(f, "usage: specd serve MODEL [options]\n"
               "  Serve MODEL (a GGUF file or a Hugging Face directory) over an OpenAI-compatible HTTP API.\n"
               "  Every option can also be set through the environment variable shown.\n");
    cfg_print_help(f, &t, 1);
}

/* Runs one short greedy request through the engine, so that READY means a
 * request can really be served. */
static int warm_up(engine *e, specd_err *err) {
    const tokenizer *tok = engine_tokenizer(e);
    int32_t *ids = NULL;
    size_t n = 0;
    if (tok_encode(tok, "Hello", 5, false, &ids, &n, err)) return -1;
    engine_request r = {0};
    sampling_params_init(&r.sp);
    r.sp.temperature = 0;
    r.sp.max_tokens = 2;
    r.prompt = ids;
    r.n_prompt = n;
    r.request_id = "warmup";
    engine_status st;
    engine_stream *s = engine_submit(e, &r, NULL, NULL, &st, err);
    free(ids);
    if (!s) return -1;
    int rc = 0;
    for (;;) {
        engine_output *o = NULL;
        if (engine_stream_wait(s, &o, 600.0) != 1) {
            rc = specd_err_set(err, "warm-up request timed out");
            break;
        }
        finish_reason f = o->finish;
        if (f == FINISH_ERROR) rc = specd_err_set(err, "warm-up request failed: %s", o->error);
        engine_output_free(o);
        if (f != FINISH_NONE) break;
    }
    engine_stream_release(s);
    return rc;
}

int specd_serve_main(int argc, char **argv) {
    specd_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg_table t;
    specd_config_table(&cfg, &t);
    specd_err err = {{0}};
    const char *pos[2];
    size_t n_pos = 0;
    bool help = false;
    int exit_code = 1;
    serve_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    pthread_mutex_init(&ctx.mu, NULL);
    pthread_condattr_t ca; /* timed waits on the monotonic clock: a wall-clock jump must not delay them */
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&ctx.cv, &ca);
    pthread_condattr_destroy(&ca);
    metrics *met = NULL;
    http_server *srv = NULL;
    char *config_json = NULL;
    specd_bundle b;
    memset(&b, 0, sizeof b);
    pthread_t sig_th, wd_th;
    bool sig_started = false, wd_started = false;

    if (cfg_defaults(&t, 1, &err) || cfg_apply_env(&t, 1, NULL, &err) ||
        cfg_parse_args(&t, 1, argc, argv, pos, 2, &n_pos, &help, &err)) {
        fprintf(stderr, "specd serve: %s\n", err.msg);
        goto out;
    }
    if (help) {
        usage(stdout, &cfg);
        exit_code = 0;
        goto out;
    }
    if (n_pos != 1) {
        fprintf(stderr, "specd serve: expected exactly one MODEL argument (see --help)\n");
        goto out;
    }
    if (cfg.log_level) {
        log_level lv = !strcmp(cfg.log_level, "debug") ? LOG_LVL_DEBUG
                     : !strcmp(cfg.log_level, "warn")  ? LOG_LVL_WARN
                     : !strcmp(cfg.log_level, "error") ? LOG_LVL_ERROR
                                                       : LOG_LVL_INFO;
        log_set_level(lv);
    }
    const char *model_path = pos[0];
    if (cfg.check_config) {
        if (specd_check_config(model_path, &cfg, &err)) {
            fprintf(stderr, "specd serve --check-config: %s\n", err.msg);
            goto out;
        }
        printf("specd serve --check-config: ok (%s)\n", model_path);
        exit_code = 0;
        goto out;
    }
    {
        specd_spec spec;
        if (specd_config_resolve(&cfg, &spec, &err)) {
            fprintf(stderr, "specd serve: %s\n", err.msg);
            goto out;
        }
        specd_spec_free(&spec);
    }
    if (auth_create(cfg.api_key, cfg.api_key_file, &ctx.auth, &err)) {
        fprintf(stderr, "specd serve: %s\n", err.msg);
        goto out;
    }
    /* all threads created from here on inherit the blocked set */
    sigemptyset(&ctx.sigs);
    sigaddset(&ctx.sigs, SIGTERM);
    sigaddset(&ctx.sigs, SIGINT);
    sigaddset(&ctx.sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &ctx.sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (pthread_create(&sig_th, NULL, signal_thread, &ctx)) {
        fprintf(stderr, "specd serve: cannot start the signal thread\n");
        goto out;
    }
    sig_started = true;

    met = metrics_create();
    config_json = cfg_to_json(&t, 1);
    if (!met || !config_json) {
        fprintf(stderr, "specd serve: out of memory\n");
        goto out;
    }
    http_opts ho = {.cfg = &cfg, .auth = ctx.auth, .metrics = met, .config_json = config_json};
    if (http_start(&ho, &srv, &err)) {
        fprintf(stderr, "specd serve: %s\n", err.msg);
        goto out;
    }
    LOG_INFO("listening on http://%s:%u (loading %s)", cfg.host, http_port(srv), model_path);
    NOTIFY("STATUS=loading %s", model_path);
#ifdef SPECD_HAVE_SYSTEMD
    if (sd_watchdog_enabled(0, &ctx.watchdog_usec) > 0 && ctx.watchdog_usec > 0) {
        if (pthread_create(&wd_th, NULL, watchdog_thread, &ctx) == 0) wd_started = true;
    }
#else
    (void)watchdog_thread;
#endif

    /* tensor-parallel workers run this same command line (bundle.h) */
    const char **worker_argv = calloc((size_t)argc + 3, sizeof *worker_argv);
    if (!worker_argv) goto out;
    worker_argv[0] = "specd";
    worker_argv[1] = "serve";
    for (int i = 0; i < argc; i++) worker_argv[i + 2] = argv[i];
    int load_rc = specd_bundle_load(model_path, &cfg, worker_argv, &b, &err);
    free(worker_argv);
    if (load_rc || engine_start(b.eng, &err)) {
        LOG_ERROR("specd serve: %s", err.msg); /* the log is stderr: printed once */
        goto out;
    }
    atomic_store(&ctx.eng, b.eng);
    NOTIFY("STATUS=warming up");
    if (warm_up(b.eng, &err)) {
        LOG_ERROR("specd serve: warm-up: %s", err.msg);
        goto out;
    }
    if (atomic_load(&ctx.stop)) { /* SIGTERM while loading: never report READY */
        LOG_INFO("stopping before serving (signal received while loading)");
        NOTIFY("STOPPING=1");
        exit_code = 0;
        goto out;
    }
    char name[256];
    specd_model_name(model_path, &cfg, name, sizeof name);
    {
        int64_t wb[METRICS_MAX_RANKS], kb[METRICS_MAX_RANKS], rd[METRICS_MAX_RANKS], fb[METRICS_MAX_RANKS];
        double ls[METRICS_MAX_RANKS];
        for (int r = 0; r < b.n_ranks && r < METRICS_MAX_RANKS; r++) {
            const int64_t *w = &b.rank_mem[SPECD_RANK_WORDS * r];
            wb[r] = w[0], kb[r] = w[1], rd[r] = w[4], fb[r] = w[5], ls[r] = (double)w[6] * 1e-6;
        }
        metrics_set_ranks(met, b.n_ranks, wb, kb);
        metrics_set_rank_load(met, b.n_ranks, ls, rd, fb);
    }
    http_attach_engine(srv, b.eng, name, model_path, b.max_model_len);
    LOG_INFO("serving model '%s' on http://%s:%u", name, cfg.host, http_port(srv));
    NOTIFY("READY=1\nSTATUS=serving %s on %s:%u", name, cfg.host, http_port(srv));

    /* serve until SIGTERM/SIGINT, or until the tensor-parallel group fails (a
     * worker died, hung or failed a step: the requests of the failed step got
     * their error already; the others are aborted and the process exits 1 so
     * systemd restarts it) */
    char tp_why[COMM_REASON_MAX] = "";
    pthread_mutex_lock(&ctx.mu);
    while (!atomic_load(&ctx.stop) && !tp_why[0]) {
        struct timespec dl;
        clock_gettime(CLOCK_MONOTONIC, &dl);
        dl.tv_nsec += 100 * 1000 * 1000;
        if (dl.tv_nsec >= 1000000000L) dl.tv_sec++, dl.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&ctx.cv, &ctx.mu, &dl);
        specd_bundle_tp_failed(&b, tp_why, sizeof tp_why);
    }
    pthread_mutex_unlock(&ctx.mu);
    if (tp_why[0]) {
        LOG_ERROR("tensor parallel group failed: %s; aborting requests and exiting", tp_why);
        NOTIFY("STOPPING=1\nSTATUS=tensor parallel group failed: %s", tp_why);
        char why[COMM_REASON_MAX + 64];
        snprintf(why, sizeof why, "tensor parallel group failed: %s", tp_why);
        http_set_draining_why(srv, why);
        engine_drain(b.eng);
        engine_wait_idle(b.eng, 0.0);
        for (int i = 0; i < 500 && http_active_requests(srv) > 0; i++) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        exit_code = 1;
        goto out;
    }

    /* drain */
    http_set_draining(srv);
    NOTIFY("STOPPING=1\nSTATUS=draining (up to %.0f s)", cfg.shutdown_timeout);
    engine_drain(b.eng);
    if (engine_wait_idle(b.eng, cfg.shutdown_timeout) != 0)
        LOG_WARN("shutdown timeout (%.1f s) reached: remaining requests aborted", cfg.shutdown_timeout);
    /* let the last frames reach the clients (they may be slow readers, or the
     * machine loaded): up to 20 s, inside the 30 s TimeoutStopSec margin of deploy/ */
    for (int i = 0; i < 2000 && http_active_requests(srv) > 0; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    exit_code = 0;
    if (specd_bundle_tp_failed(&b, tp_why, sizeof tp_why)) { /* a rank failed while draining */
        LOG_ERROR("tensor parallel group failed while draining: %s", tp_why);
        exit_code = 1;
    }
out:
    if (srv) {
        http_stop(srv, 2.0);
        srv = NULL;
    }
    if (wd_started) {
        atomic_store(&ctx.watchdog_stop, true);
        pthread_join(wd_th, NULL);
    }
    atomic_store(&ctx.eng, NULL);
    if (b.rk) {
        specd_err serr = {{0}};
        if (specd_bundle_tp_shutdown(&b, &serr) < 0) {
            LOG_ERROR("tensor parallel shutdown: %s", serr.msg);
            exit_code = 1;
        }
    }
    specd_bundle_free(&b);
    if (sig_started) {
        atomic_store(&ctx.quit_signal_thread, true);
        pthread_kill(sig_th, SIGHUP);
        pthread_join(sig_th, NULL);
    }
    if (exit_code == 0 && !help && !cfg.check_config) LOG_INFO("specd serve: stopped");
    metrics_destroy(met);
    free(config_json);
    auth_destroy(ctx.auth);
    specd_config_free(&cfg);
    pthread_cond_destroy(&ctx.cv);
    pthread_mutex_destroy(&ctx.mu);
    return exit_code;
}

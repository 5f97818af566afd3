/*
 * report.c: metric computation, the terminal table, the result JSON and the
 * machine description (see report.h for the definitions).
 */
#include "bench/report.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

/* ---- computation ---------------------------------------------------------------- */

void bench_metrics_free(bench_metrics *m) {
    if (!m) return;
    for (size_t i = 0; i < m->n_fail; i++) free(m->fail[i].reason);
    free(m->fail);
    m->fail = NULL;
    m->n_fail = 0;
}

static int add_fail(bench_metrics *m, const char *reason) {
    for (size_t i = 0; i < m->n_fail; i++)
        if (strcmp(m->fail[i].reason, reason) == 0) {
            m->fail[i].count++;
            return 0;
        }
    bench_fail_reason *nf = realloc(m->fail, (m->n_fail + 1) * sizeof *nf);
    if (!nf) return -1;
    m->fail = nf;
    if (!(nf[m->n_fail].reason = strdup(reason))) return -1;
    nf[m->n_fail++].count = 1;
    return 0;
}

int bench_metrics_compute(const bench_run *run, const bench_spec_counters *srv_diff, const double *qs,
                          size_t n_q, bench_metrics *m) {
    memset(m, 0, sizeof *m);
    size_t n = run->n, n_itl = 0;
    for (size_t i = 0; i < n; i++)
        if (run->rec[i].success) n_itl += run->rec[i].n_itl;
    double *ttft = malloc((n + 1) * sizeof *ttft), *tpot = malloc((n + 1) * sizeof *tpot),
           *e2el = malloc((n + 1) * sizeof *e2el), *itl = malloc((n_itl + 1) * sizeof *itl);
    size_t k_ttft = 0, k_tpot = 0, k_e2el = 0, k_itl = 0;
    int rc = -1;
    if (!ttft || !tpot || !e2el || !itl) goto done;
    m->n_requests = n;
    m->duration_s = run->duration_s;
    m->peak_concurrency = run->peak_concurrency;
    for (size_t i = 0; i < n; i++) {
        const bench_record *r = &run->rec[i];
        if (!r->success) {
            m->failed++;
            if (add_fail(m, r->error ? r->error : "unknown")) goto done;
            continue;
        }
        m->completed++;
        m->retokenized += r->retokenized != 0;
        m->total_input += r->prompt_tokens > 0 ? r->prompt_tokens : 0;
        m->total_output += r->output_tokens > 0 ? r->output_tokens : 0;
        e2el[k_e2el++] = r->latency_s * 1e3;
        if (r->ttft_s >= 0) {
            ttft[k_ttft++] = r->ttft_s * 1e3;
            if (r->output_tokens > 1)
                tpot[k_tpot++] = (r->latency_s - r->ttft_s) / (double)(r->output_tokens - 1) * 1e3;
        }
        for (size_t j = 0; j < r->n_itl; j++) itl[k_itl++] = r->itl_s[j] * 1e3;
    }
    if (m->duration_s > 0) {
        m->request_throughput = (double)m->completed / m->duration_s;
        m->output_throughput = (double)m->total_output / m->duration_s;
        m->total_token_throughput = (double)(m->total_input + m->total_output) / m->duration_s;
    }
    if (bench_summary_compute(&m->ttft_ms, ttft, k_ttft, qs, n_q) ||
        bench_summary_compute(&m->tpot_ms, tpot, k_tpot, qs, n_q) ||
        bench_summary_compute(&m->itl_ms, itl, k_itl, qs, n_q) ||
        bench_summary_compute(&m->e2el_ms, e2el, k_e2el, qs, n_q))
        goto done;
    if (srv_diff) {
        m->have_metrics = 1;
        m->srv = *srv_diff;
    }
    rc = 0;
done:
    free(ttft);
    free(tpot);
    free(e2el);
    free(itl);
    if (rc) bench_metrics_free(m);
    return rc;
}

/* ---- terminal table --------------------------------------------------------------- */

int bench_metric_selected(const char *sel, const char *name) {
    size_t nl = strlen(name);
    for (const char *p = sel; p && *p;) {
        const char *c = strchr(p, ',');
        size_t l = c ? (size_t)(c - p) : strlen(p);
        if (l == nl && strncmp(p, name, nl) == 0) return 1;
        p = c ? c + 1 : NULL;
    }
    return 0;
}

static void banner(FILE *f, const char *title, char fill) {
    int w = 50, tl = (int)strlen(title), left = (w - tl) / 2, right = w - tl - left;
    for (int i = 0; i < left; i++) fputc(fill, f);
    fputs(title, f);
    for (int i = 0; i < right; i++) fputc(fill, f);
    fputc('\n', f);
}

static void row_d(FILE *f, const char *label, double v) { fprintf(f, "%-40s %-10.2f\n", label, v); }
static void row_i(FILE *f, const char *label, long v) { fprintf(f, "%-40s %-10ld\n", label, v); }

static void latency_block(FILE *f, const char *title, const char *abbr, const bench_summary *s) {
    char label[64];
    banner(f, title, '-');
    snprintf(label, sizeof label, "Mean %s (ms):", abbr);
    row_d(f, label, s->mean);
    snprintf(label, sizeof label, "Median %s (ms):", abbr);
    row_d(f, label, s->median);
    for (size_t i = 0; i < s->n_pct; i++) {
        char w[16];
        bench_pct_word(s->pct_q[i], w, sizeof w);
        snprintf(label, sizeof label, "P%s %s (ms):", w, abbr);
        row_d(f, label, s->pct_v[i]);
    }
}

void bench_metrics_print(FILE *f, const bench_metrics *m, const char *sel, size_t max_concurrency) {
    banner(f, " Serving Benchmark Result ", '=');
    row_i(f, "Successful requests:", (long)m->completed);
    row_i(f, "Failed requests:", (long)m->failed);
    if (max_concurrency) row_i(f, "Maximum request concurrency:", (long)max_concurrency);
    row_d(f, "Benchmark duration (s):", m->duration_s);
    row_i(f, "Total input tokens:", m->total_input);
    row_i(f, "Total generated tokens:", m->total_output);
    row_d(f, "Request throughput (req/s):", m->request_throughput);
    row_d(f, "Output token throughput (tok/s):", m->output_throughput);
    row_i(f, "Peak concurrent requests:", (long)m->peak_concurrency);
    row_d(f, "Total Token throughput (tok/s):", m->total_token_throughput);
    if (bench_metric_selected(sel, "ttft")) latency_block(f, "Time to First Token", "TTFT", &m->ttft_ms);
    if (bench_metric_selected(sel, "tpot"))
        latency_block(f, "Time per Output Token (excl. 1st token)", "TPOT", &m->tpot_ms);
    if (bench_metric_selected(sel, "itl")) latency_block(f, "Inter-token Latency", "ITL", &m->itl_ms);
    if (bench_metric_selected(sel, "e2el")) latency_block(f, "End-to-end Latency", "E2EL", &m->e2el_ms);
    if (m->have_metrics && m->srv.has_spec) {
        banner(f, "Speculative Decoding", '-');
        row_d(f, "Acceptance rate (%):", 100.0 * bench_spec_acceptance_rate(&m->srv));
        row_d(f, "Acceptance length:", bench_spec_acceptance_length(&m->srv));
        row_i(f, "Drafts:", (long)m->srv.drafts);
        row_i(f, "Draft tokens:", (long)m->srv.draft_tokens);
        row_i(f, "Accepted tokens:", (long)m->srv.accepted);
        fprintf(f, "Per-position acceptance rate (%%):\n");
        for (size_t i = 0; i < m->srv.n_pos; i++) {
            char label[64];
            snprintf(label, sizeof label, "  Position %zu:", i);
            row_d(f, label, 100.0 * bench_spec_pos_rate(&m->srv, i));
        }
    }
    if (m->have_metrics && m->srv.has_tokens) {
        banner(f, "Server /metrics", '-');
        row_i(f, "Server generation tokens (difference):", (long)m->srv.generation_tokens);
        row_i(f, "Server prompt tokens (difference):", (long)m->srv.prompt_tokens);
    }
    if (m->retokenized)
        fprintf(f, "Note: %zu requests streamed no usage; their tokens were counted by re-tokenizing\n"
                   "      the texts through the server's tokenize endpoint (approximate).\n", m->retokenized);
    if (m->n_fail) {
        banner(f, "Failures", '-');
        for (size_t i = 0; i < m->n_fail; i++) fprintf(f, "%6zu x %s\n", m->fail[i].count, m->fail[i].reason);
    }
    banner(f, "", '=');
}

/* ---- JSON ------------------------------------------------------------------------------ */

static json_t *num(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static void summary_json(json_t *o, const char *name, const bench_summary *s) {
    char key[64];
    snprintf(key, sizeof key, "mean_%s_ms", name);
    json_object_set_new(o, key, num(s->mean));
    snprintf(key, sizeof key, "median_%s_ms", name);
    json_object_set_new(o, key, num(s->median));
    snprintf(key, sizeof key, "std_%s_ms", name);
    json_object_set_new(o, key, num(s->std));
    for (size_t i = 0; i < s->n_pct; i++) {
        char w[16];
        bench_pct_word(s->pct_q[i], w, sizeof w);
        snprintf(key, sizeof key, "p%s_%s_ms", w, name);
        json_object_set_new(o, key, num(s->pct_v[i]));
    }
}

int bench_metrics_to_json(const bench_metrics *m, const bench_run *run, json_t *o) {
    json_object_set_new(o, "completed", json_integer((json_int_t)m->completed));
    json_object_set_new(o, "failed", json_integer((json_int_t)m->failed));
    json_object_set_new(o, "duration", num(m->duration_s));
    json_object_set_new(o, "total_input_tokens", json_integer(m->total_input));
    json_object_set_new(o, "total_output_tokens", json_integer(m->total_output));
    json_object_set_new(o, "request_throughput", num(m->request_throughput));
    json_object_set_new(o, "output_throughput", num(m->output_throughput));
    json_object_set_new(o, "total_token_throughput", num(m->total_token_throughput));
    json_object_set_new(o, "retokenized_requests", json_integer((json_int_t)m->retokenized));
    json_object_set_new(o, "max_concurrent_requests", json_integer((json_int_t)m->peak_concurrency));
    summary_json(o, "ttft", &m->ttft_ms);
    summary_json(o, "tpot", &m->tpot_ms);
    summary_json(o, "itl", &m->itl_ms);
    summary_json(o, "e2el", &m->e2el_ms);
    json_t *fr = json_object();
    for (size_t i = 0; i < m->n_fail; i++)
        json_object_set_new(fr, m->fail[i].reason, json_integer((json_int_t)m->fail[i].count));
    json_object_set_new(o, "failure_reasons", fr);
    if (m->have_metrics && m->srv.has_tokens) {
        json_object_set_new(o, "server_generation_tokens", num(m->srv.generation_tokens));
        json_object_set_new(o, "server_prompt_tokens", num(m->srv.prompt_tokens));
    }
    if (m->have_metrics && m->srv.has_spec) {
        json_object_set_new(o, "spec_decode_acceptance_rate", num(bench_spec_acceptance_rate(&m->srv)));
        json_object_set_new(o, "spec_decode_acceptance_length", num(bench_spec_acceptance_length(&m->srv)));
        json_object_set_new(o, "spec_decode_num_drafts", num(m->srv.drafts));
        json_object_set_new(o, "spec_decode_num_draft_tokens", num(m->srv.draft_tokens));
        json_object_set_new(o, "spec_decode_num_accepted_tokens", num(m->srv.accepted));
        json_t *pp = json_array();
        for (size_t i = 0; i < m->srv.n_pos; i++) json_array_append_new(pp, num(bench_spec_pos_rate(&m->srv, i)));
        json_object_set_new(o, "spec_decode_acceptance_per_position", pp);
    }
    if (!run) return 0;
    json_t *in = json_array(), *outl = json_array(), *tt = json_array(), *it = json_array(),
           *e2 = json_array(), *st = json_array(), *er = json_array(), *tx = json_array();
    int keep_text = 0;
    for (size_t i = 0; i < run->n; i++) {
        const bench_record *r = &run->rec[i];
        json_array_append_new(in, json_integer(r->prompt_tokens));
        json_array_append_new(outl, json_integer(r->output_tokens));
        json_array_append_new(tt, r->ttft_s >= 0 ? json_real(r->ttft_s) : json_null());
        json_t *li = json_array();
        for (size_t j = 0; j < r->n_itl; j++) json_array_append_new(li, json_real(r->itl_s[j]));
        json_array_append_new(it, li);
        json_array_append_new(e2, json_real(r->latency_s));
        json_array_append_new(st, json_real(r->send_s));
        json_array_append_new(er, json_string(r->error ? r->error : ""));
        json_array_append_new(tx, json_string(r->text ? r->text : ""));
        keep_text |= r->text != NULL;
    }
    json_object_set_new(o, "input_lens", in);
    json_object_set_new(o, "output_lens", outl);
    json_object_set_new(o, "ttfts", tt);
    json_object_set_new(o, "itls", it);
    json_object_set_new(o, "e2els", e2);
    json_object_set_new(o, "send_times", st);
    json_object_set_new(o, "errors", er);
    if (keep_text) json_object_set_new(o, "generated_texts", tx);
    else json_decref(tx);
    return 0;
}

/* ---- provenance ------------------------------------------------------------------------- */

static void read_first_match(const char *path, const char *key, char *out, size_t cap) {
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[1024];
    size_t kl = strlen(key);
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, kl) != 0) continue;
        char *c = strchr(line, ':');
        if (!c) continue;
        c++;
        while (*c == ' ' || *c == '\t') c++;
        size_t l = strcspn(c, "\n");
        snprintf(out, cap, "%.*s", (int)l, c);
        break;
    }
    fclose(f);
}

void bench_machine_json(json_t *o) {
    struct utsname u;
    if (uname(&u) == 0) {
        char buf[1024];
        snprintf(buf, sizeof buf, "%s %s %s %s", u.sysname, u.nodename, u.release, u.machine);
        json_object_set_new(o, "uname", json_string(buf));
    }
    json_object_set_new(o, "nproc", json_integer(sysconf(_SC_NPROCESSORS_ONLN)));
    char cpu[512], mem[128];
    read_first_match("/proc/cpuinfo", "model name", cpu, sizeof cpu);
    json_object_set_new(o, "cpu_model", json_string(cpu));
    read_first_match("/proc/meminfo", "MemTotal", mem, sizeof mem);
    json_object_set_new(o, "mem_total", json_string(mem));
}

void bench_git_commit(char *buf, size_t cap) {
    buf[0] = '\0';
    const char *env = getenv("SPECD_GIT_COMMIT");
    if (env && *env) {
        snprintf(buf, cap, "%s", env);
        return;
    }
    FILE *p = popen("git rev-parse HEAD 2>/dev/null", "r");
    if (!p) return;
    if (fgets(buf, (int)cap, p)) buf[strcspn(buf, "\n")] = '\0';
    else buf[0] = '\0';
    pclose(p);
}

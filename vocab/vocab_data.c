/*
 * vocab_data.c: JSONL chat data sets (see vocab_data.h for the shapes).
 *
 * JSON stays inside this file: records leave as chat_message arrays of
 * copied strings. Lines are read with getline (no length limit); each is
 * parsed on its own, so one bad line never hides the next.
 * Threading: one thread builds a dataset.
 */
#include "vocab/vocab_data.h"

#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void vocab_record_free(vocab_record *r) {
    if (!r) return;
    for (size_t i = 0; i < r->n_msgs; i++) {
        free((char *)r->msgs[i].role);
        free((char *)r->msgs[i].content);
    }
    free(r->msgs);
    for (size_t i = 0; i < r->n_turns; i++) free(r->turns[i]);
    free(r->turns);
    free(r->system);
    memset(r, 0, sizeof *r);
}

void vocab_dataset_free(vocab_dataset *ds) {
    if (!ds) return;
    for (size_t i = 0; i < ds->n_rec; i++) vocab_record_free(&ds->rec[i]);
    free(ds->rec);
    for (size_t i = 0; i < ds->n_categories; i++) free(ds->categories[i]);
    free(ds->categories);
    for (size_t i = 0; i < ds->n_problems; i++) free(ds->problems[i]);
    free(ds->problems);
    memset(ds, 0, sizeof *ds);
}

static int add_msg(vocab_record *r, const char *role, const char *content) {
    chat_message *m = realloc(r->msgs, sizeof *m * (r->n_msgs + 1));
    if (!m) return -1;
    r->msgs = m;
    char *a = strdup(role), *b = strdup(content);
    if (!a || !b) {
        free(a);
        free(b);
        return -1;
    }
    r->msgs[r->n_msgs++] = (chat_message){.role = a, .content = b};
    if (!strcmp(role, "assistant")) r->n_assistant++;
    if (!strcmp(role, "user")) {
        char **t = realloc(r->turns, sizeof *t * (r->n_turns + 1));
        if (!t || !(t[r->n_turns] = strdup(content))) {
            if (t) r->turns = t;
            return -1;
        }
        r->turns = t;
        r->n_turns++;
    }
    if (!strcmp(role, "system") && r->n_msgs == 1 && !(r->system = strdup(content))) return -1;
    return 0;
}

static int32_t category_index(vocab_dataset *ds, const char *name) {
    for (size_t i = 0; i < ds->n_categories; i++)
        if (!strcmp(ds->categories[i], name)) return (int32_t)i;
    char **c = realloc(ds->categories, sizeof *c * (ds->n_categories + 1));
    if (!c) return -1;
    ds->categories = c;
    if (!(c[ds->n_categories] = strdup(name))) return -1;
    return (int32_t)ds->n_categories++;
}

static const char *sharegpt_role(const char *from) {
    if (!strcmp(from, "human") || !strcmp(from, "user")) return "user";
    if (!strcmp(from, "gpt") || !strcmp(from, "assistant") || !strcmp(from, "chatgpt")) return "assistant";
    if (!strcmp(from, "system")) return "system";
    return NULL;
}

#define BAD(...)                                                                                                       \
    do {                                                                                                               \
        specd_err_set(err, __VA_ARGS__);                                                                               \
        goto bad;                                                                                                      \
    } while (0)

int vocab_data_parse_line(vocab_dataset *ds, const char *line, size_t len, vocab_record *r, specd_err *err) {
    memset(r, 0, sizeof *r);
    r->category = -1;
    r->question_id = -1;
    size_t k = 0;
    while (k < len && (line[k] == ' ' || line[k] == '\t' || line[k] == '\r' || line[k] == '\n')) k++;
    if (k == len) return 1;
    json_error_t je;
    json_t *o = json_loadb(line, len, 0, &je);
    if (!o) {
        specd_err_set(err, "invalid JSON (column %d: %s)", je.column, je.text);
        return -1;
    }
    if (!json_is_object(o)) BAD("not a JSON object");
    json_t *v;
    if ((v = json_object_get(o, "messages")) || (v = json_object_get(o, "conversations"))) {
        bool sharegpt = json_object_get(o, "messages") == NULL;
        if (!json_is_array(v) || json_array_size(v) == 0) BAD("\"%s\" is not a non-empty array", sharegpt ? "conversations" : "messages");
        size_t i;
        json_t *m;
        json_array_foreach(v, i, m) {
            json_t *role = json_object_get(m, sharegpt ? "from" : "role");
            json_t *content = json_object_get(m, sharegpt ? "value" : "content");
            if (!json_is_string(role)) BAD("message %zu has no string \"%s\"", i, sharegpt ? "from" : "role");
            if (!json_is_string(content)) BAD("message %zu: \"%s\" is not a string", i, sharegpt ? "value" : "content");
            const char *rs = json_string_value(role);
            if (sharegpt && !(rs = sharegpt_role(rs))) BAD("message %zu: unknown speaker \"%s\"", i, json_string_value(role));
            if (strlen(json_string_value(content)) != json_string_length(content))
                BAD("message %zu: content contains a NUL character", i);
            if (add_msg(r, rs, json_string_value(content)) < 0) BAD("out of memory");
        }
    } else if ((v = json_object_get(o, "prompt")) || (v = json_object_get(o, "question"))) {
        json_t *ans = json_object_get(o, "prompt") ? json_object_get(o, "response") : json_object_get(o, "answer");
        if (!ans && json_object_get(o, "prompt")) ans = json_object_get(o, "completion");
        if (!json_is_string(v)) BAD("the prompt/question is not a string");
        if (ans && !json_is_string(ans)) BAD("the response/answer is not a string");
        if (strlen(json_string_value(v)) != json_string_length(v) ||
            (ans && strlen(json_string_value(ans)) != json_string_length(ans)))
            BAD("text contains a NUL character");
        if (add_msg(r, "user", json_string_value(v)) < 0 || (ans && add_msg(r, "assistant", json_string_value(ans)) < 0))
            BAD("out of memory");
    } else if ((v = json_object_get(o, "turns"))) {
        if (!json_is_array(v) || json_array_size(v) == 0) BAD("\"turns\" is not a non-empty array");
        size_t i;
        json_t *t;
        json_array_foreach(v, i, t) {
            if (!json_is_string(t)) BAD("turn %zu is not a string", i);
            if (add_msg(r, "user", json_string_value(t)) < 0) BAD("out of memory");
        }
    } else {
        BAD("no \"messages\", \"conversations\", \"prompt\", \"question\" or \"turns\" field");
    }
    if (r->n_turns == 0) BAD("the conversation has no user message");
    json_t *c = json_object_get(o, "category");
    if (json_is_string(c) && (r->category = category_index(ds, json_string_value(c))) < 0) BAD("out of memory");
    json_t *q = json_object_get(o, "question_id");
    if (json_is_integer(q)) r->question_id = (int64_t)json_integer_value(q);
    json_decref(o);
    return 0;
bad:
    json_decref(o);
    vocab_record_free(r);
    return -1;
}

static void problem(vocab_dataset *ds, const char *fmt, ...) {
    ds->n_malformed++;
    if (ds->n_problems >= VOCAB_DATA_MAX_PROBLEMS) return;
    char buf[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    char **p = realloc(ds->problems, sizeof *p * (ds->n_problems + 1));
    if (!p) return;
    ds->problems = p;
    if ((p[ds->n_problems] = strdup(buf))) ds->n_problems++;
}

int vocab_data_load(vocab_dataset *ds, const char *path, int64_t max_records, specd_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return specd_err_set(err, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    int64_t lineno = 0;
    int rc = 0;
    while ((max_records <= 0 || (int64_t)ds->n_rec < max_records) && (n = getline(&line, &cap, f)) >= 0) {
        lineno++;
        vocab_record r;
        specd_err e = {0};
        int pr = vocab_data_parse_line(ds, line, (size_t)n, &r, &e);
        if (pr == 1) continue;
        ds->n_lines++;
        if (pr < 0) {
            problem(ds, "%s:%lld: %s", path, (long long)lineno, e.msg);
            continue;
        }
        r.line = lineno;
        vocab_record *nr = realloc(ds->rec, sizeof *nr * (ds->n_rec + 1));
        if (!nr) {
            vocab_record_free(&r);
            rc = specd_err_set(err, "%s: out of memory", path);
            break;
        }
        ds->rec = nr;
        ds->rec[ds->n_rec++] = r;
    }
    if (!rc && ferror(f)) rc = specd_err_set(err, "%s: read error", path);
    free(line);
    fclose(f);
    return rc;
}

/* The response strings of one responses-file line; returns the json array or
 * string holding them (borrowed from O). */
static json_t *response_turns(json_t *o) {
    json_t *ch = json_object_get(o, "choices");
    if (json_is_array(ch) && json_array_size(ch) > 0) return json_object_get(json_array_get(ch, 0), "turns");
    json_t *t = json_object_get(o, "turns");
    if (t) return t;
    t = json_object_get(o, "responses");
    if (t) return t;
    return json_object_get(o, "response");
}

int vocab_data_add_responses(vocab_dataset *ds, const char *path, specd_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return specd_err_set(err, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    int64_t lineno = 0;
    while ((n = getline(&line, &cap, f)) >= 0) {
        lineno++;
        size_t k = 0;
        while (k < (size_t)n && (line[k] == ' ' || line[k] == '\n' || line[k] == '\r' || line[k] == '\t')) k++;
        if (k == (size_t)n) continue;
        json_error_t je;
        json_t *o = json_loadb(line, (size_t)n, 0, &je);
        json_t *q = o ? json_object_get(o, "question_id") : NULL;
        json_t *t = o ? response_turns(o) : NULL;
        if (!json_is_integer(q) || !(json_is_array(t) || json_is_string(t))) {
            problem(ds, "%s:%lld: not a response record (needs integer question_id and choices[0].turns, turns or "
                        "response)", path, (long long)lineno);
            json_decref(o);
            continue;
        }
        vocab_record *r = NULL;
        for (size_t i = 0; i < ds->n_rec && !r; i++)
            if (ds->rec[i].question_id == json_integer_value(q) && ds->rec[i].n_assistant == 0) r = &ds->rec[i];
        if (!r) {
            ds->n_responses_unmatched++;
            json_decref(o);
            continue;
        }
        /* rebuild: user turn i followed by response i */
        vocab_record nr = {.category = r->category, .question_id = r->question_id, .file = r->file, .line = r->line};
        size_t n_resp = json_is_string(t) ? 1 : json_array_size(t);
        bool ok = !r->system || add_msg(&nr, "system", r->system) == 0;
        for (size_t i = 0; ok && i < r->n_turns; i++) {
            ok = add_msg(&nr, "user", r->turns[i]) == 0;
            if (!ok || i >= n_resp) continue;
            json_t *s = json_is_string(t) ? t : json_array_get(t, i);
            if (json_is_string(s)) ok = add_msg(&nr, "assistant", json_string_value(s)) == 0;
        }
        json_decref(o);
        if (!ok) {
            vocab_record_free(&nr);
            free(line);
            fclose(f);
            return specd_err_set(err, "%s: out of memory", path);
        }
        vocab_record_free(r);
        *r = nr;
        ds->n_responses_matched++;
    }
    free(line);
    fclose(f);
    return 0;
}

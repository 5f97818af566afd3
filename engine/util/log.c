/* log.c: see log.h. */
#include "engine/util/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static log_level g_level = LOG_LVL_INFO;
static int g_journal = -1; /* -1: decide from JOURNAL_STREAM on first use */

void log_set_level(log_level lvl) { g_level = lvl; }
void log_set_journal(int on) { g_journal = on; }

static void log_init_once(void) {
    if (g_journal < 0) g_journal = getenv("JOURNAL_STREAM") != NULL;
    static int level_read;
    if (!level_read) {
        level_read = 1;
        const char *l = getenv("SPECD_LOG_LEVEL");
        if (l) {
            if (!strcmp(l, "debug")) g_level = LOG_LVL_DEBUG;
            else if (!strcmp(l, "warn")) g_level = LOG_LVL_WARN;
            else if (!strcmp(l, "error")) g_level = LOG_LVL_ERROR;
        }
    }
}

void log_msg(log_level lvl, const char *fmt, ...) {
    log_init_once();
    if (lvl > g_level) return;
    char line[2048];
    int n = 0;
    if (g_journal) {
        n = snprintf(line, sizeof line, "<%d>", (int)lvl);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        struct tm tm;
        gmtime_r(&ts.tv_sec, &tm);
        const char *tag = lvl == LOG_LVL_ERROR ? "ERROR" : lvl == LOG_LVL_WARN ? "WARN" : lvl == LOG_LVL_INFO ? "INFO" : "DEBUG";
        n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s ", tm.tm_year + 1900, tm.tm_mon + 1,
                     tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000, tag);
    }
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line) vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line);
}

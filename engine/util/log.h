/*
 * log.h: leveled logging to stderr with syslog priority prefixes ("<6>")
 * that journald turns into structured priorities, plus a level filter
 * (SPECD_LOG_LEVEL=debug|info|warn|error). Thread-safe: one fprintf per line.
 */
#ifndef SPECD_UTIL_LOG_H
#define SPECD_UTIL_LOG_H

typedef enum { LOG_LVL_DEBUG = 7, LOG_LVL_INFO = 6, LOG_LVL_WARN = 4, LOG_LVL_ERROR = 3 } log_level;

void log_set_level(log_level lvl);
/* Enables "<N>" priority prefixes (set when stderr is the journal). */
void log_set_journal(int on);
void log_msg(log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define LOG_DEBUG(...) log_msg(LOG_LVL_DEBUG, __VA_ARGS__)
#define LOG_INFO(...)  log_msg(LOG_LVL_INFO, __VA_ARGS__)
#define LOG_WARN(...)  log_msg(LOG_LVL_WARN, __VA_ARGS__)
#define LOG_ERROR(...) log_msg(LOG_LVL_ERROR, __VA_ARGS__)

#endif

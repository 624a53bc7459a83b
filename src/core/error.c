/* Error codes and messages: the X-macro table of symkv.h, -errno passthrough, and the
 * thread-local last-error text with the file:line of the failure. */
#define _GNU_SOURCE
#include "core/core.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local char last_error[1024];
static _Thread_local char errno_buf[128];

const char *skv_strerror(int err) {
  switch (err) {
  case SKV_OK:
    return "success";
#define SKV__ERR_MSG(name, value, msg) \
  case SKV_##name:                     \
    return msg;
    SKV_ERRNO_MAP(SKV__ERR_MSG)
#undef SKV__ERR_MSG
  default:
    break;
  }
  if (err < 0 && err > -4096) {
    const char *d = strerrordesc_np(-err);
    if (d) return d;
  }
  snprintf(errno_buf, sizeof errno_buf, "unknown error %d", err);
  return errno_buf;
}

const char *skv_err_name(int err) {
  switch (err) {
  case SKV_OK:
    return "SKV_OK";
#define SKV__ERR_NAME(name, value, msg) \
  case SKV_##name:                      \
    return "SKV_" #name;
    SKV_ERRNO_MAP(SKV__ERR_NAME)
#undef SKV__ERR_NAME
  default:
    break;
  }
  if (err < 0 && err > -4096) {
    const char *n = strerrorname_np(-err);
    if (n) return n;
  }
  snprintf(errno_buf, sizeof errno_buf, "SKV_UNKNOWN(%d)", err);
  return errno_buf;
}

const char *skv_last_error(void) {
  return last_error;
}

void skv_clear_error(void) {
  last_error[0] = '\0';
}

void skv__error_restore(const char *saved) {
  if (saved != last_error) snprintf(last_error, sizeof last_error, "%s", saved);
}

int skv__set_error(int err, unsigned subsys, const char *file, int line, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  const char *base = strrchr(file, '/');
  base = base ? base + 1 : file;
  snprintf(last_error, sizeof last_error, "%s (%s, %s:%d)", msg, skv_err_name(err), base, line);
  /* INFO, not WARN: the caller gets the code and this text (skv_last_error); printing it as
   * well by default would report every failure twice, and one the caller handles once. */
  SKV_LOG(SKV_LOG_INFO, subsys, "%s", last_error);
  return err;
}

void skv__error_trace(int err, const char *file, int line, const char *expr) {
  const char *base = strrchr(file, '/');
  base = base ? base + 1 : file;
  SKV_LOG(SKV_LOG_INFO, SKV_SUBSYS_ALL, "%s:%d <- %s: %s", base, line, expr, skv_err_name(err));
}

int skv__debug_level = 0;

void skv__assert_fail(const char *expr, const char *file, int line) {
  skv__log(SKV_LOG_WARN, SKV_SUBSYS_ALL, file, line, "internal invariant failed: %s", expr);
  abort();
}

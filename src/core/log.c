/* Logging: levels and subsystems from SKV_DEBUG / SKV_DEBUG_SUBSYS, lines prefixed
 * "host:pid:rank", a replaceable sink (default stderr, or SKV_DEBUG_FILE). */
#define _GNU_SOURCE
#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

int skv__log_level = -1;
unsigned skv__log_subsys = SKV_SUBSYS_ALL;
int skv__log_rank = -1;

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static skv_log_cb log_sink;
static void *log_sink_arg;
static int log_fd = 2;
static pthread_once_t log_once = PTHREAD_ONCE_INIT;

static const char *level_names[] = {"NONE", "WARN", "INFO", "TRACE"};

static int parse_level(const char *s) {
  for (int i = 0; i < 4; i++)
    if (strcasecmp(s, level_names[i]) == 0) return i;
  if (strcasecmp(s, "VERSION") == 0 || strcasecmp(s, "ERROR") == 0) return SKV_LOG_WARN;
  return -1;
}

static const char *subsys_name(unsigned subsys) {
#define SKV__SUBSYS_NAME(name, bit) \
  if (subsys == (bit)) return #name;
  SKV_SUBSYS_MAP(SKV__SUBSYS_NAME)
#undef SKV__SUBSYS_NAME
  return "ALL";
}

static unsigned parse_subsys(const char *s) {
  unsigned mask = 0;
  bool any_positive = false;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", s);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    bool neg = tok[0] == '^';
    if (neg) tok++;
    unsigned bit = 0;
    if (strcasecmp(tok, "ALL") == 0) bit = SKV_SUBSYS_ALL;
#define SKV__SUBSYS_PARSE(name, b) else if (strcasecmp(tok, #name) == 0) bit = (b);
    SKV_SUBSYS_MAP(SKV__SUBSYS_PARSE)
#undef SKV__SUBSYS_PARSE
    else {
      char line[320];
      snprintf(line, sizeof line, "symkv: SKV_DEBUG_SUBSYS: unknown subsystem '%s' ignored\n", tok);
      (void)!write(2, line, strlen(line));
      continue;
    }
    if (neg) {
      if (!any_positive) mask = SKV_SUBSYS_ALL;
      any_positive = true;
      mask &= ~bit;
    } else {
      any_positive = true;
      mask |= bit;
    }
  }
  return any_positive ? mask : SKV_SUBSYS_ALL;
}

static void log_init_once(void) {
  int level = SKV_LOG_WARN;
  const char *lv = skv__env(SKV_ENV_DEBUG);
  if (lv) {
    int l = parse_level(lv);
    if (l < 0) {
      char line[256];
      snprintf(line, sizeof line,
               "symkv: SKV_DEBUG=%s is not NONE, WARN, INFO or TRACE; using WARN\n", lv);
      (void)!write(2, line, strlen(line));
    } else {
      level = l;
    }
  }
  const char *ss = skv__env(SKV_ENV_DEBUG_SUBSYS);
  skv__log_subsys = ss ? parse_subsys(ss) : SKV_SUBSYS_ALL;
  const char *file = skv__env(SKV_ENV_DEBUG_FILE);
  if (file) {
    char path[4096];
    size_t o = 0;
    for (const char *c = file; *c && o + 64 < sizeof path; c++) {
      if (c[0] == '%' && c[1] == 'h') {
        o += (size_t)snprintf(path + o, sizeof path - o, "%s", skv__hostname());
        c++;
      } else if (c[0] == '%' && c[1] == 'p') {
        o += (size_t)snprintf(path + o, sizeof path - o, "%d", (int)getpid());
        c++;
      } else {
        path[o++] = *c;
      }
    }
    path[o] = '\0';
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) log_fd = fd;
  }
  long long dl = 0;
  if (skv__env_int(SKV_ENV_DEBUG_LEVEL, 0, 2, 0, &dl) == 0)
    __atomic_store_n(&skv__debug_level, (int)dl, __ATOMIC_RELAXED);
  __atomic_store_n(&skv__log_level, level, __ATOMIC_RELEASE);
}

void skv__log_init(void) {
  pthread_once(&log_once, log_init_once);
}

void skv__vlog(int level, unsigned subsys, const char *file, int line, const char *fmt,
               va_list ap) {
  char buf[2048];
  int n;
  if (skv__log_rank >= 0)
    n = snprintf(buf, sizeof buf, "%s:%d:%d [%s %s] ", skv__hostname(), (int)getpid(),
                 skv__log_rank, level_names[level & 3], subsys_name(subsys));
  else
    n = snprintf(buf, sizeof buf, "%s:%d:- [%s %s] ", skv__hostname(), (int)getpid(),
                 level_names[level & 3], subsys_name(subsys));
  if (n < 0) n = 0;
  if ((size_t)n < sizeof buf) n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
  if ((size_t)n >= sizeof buf - 1) n = (int)sizeof buf - 2;
  if (level >= SKV_LOG_TRACE && file) {
    const char *base = strrchr(file, '/');
    n += snprintf(buf + n, sizeof buf - (size_t)n, " (%s:%d)", base ? base + 1 : file, line);
    if ((size_t)n >= sizeof buf - 1) n = (int)sizeof buf - 2;
  }
  pthread_mutex_lock(&log_mu);
  skv_log_cb sink = log_sink;
  void *arg = log_sink_arg;
  if (sink) {
    buf[n] = '\0';
    sink(arg, level, subsys, buf);
  } else {
    buf[n++] = '\n';
    (void)!write(log_fd, buf, (size_t)n);
  }
  pthread_mutex_unlock(&log_mu);
}

void skv__log(int level, unsigned subsys, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  skv__vlog(level, subsys, file, line, fmt, ap);
  va_end(ap);
}

int skv_log_set_sink(skv_log_cb cb, void *arg) {
  pthread_mutex_lock(&log_mu);
  log_sink = cb;
  log_sink_arg = arg;
  pthread_mutex_unlock(&log_mu);
  return 0;
}

int skv_log_set_level(int level, unsigned int subsys_mask) {
  if (level < SKV_LOG_NONE || level > SKV_LOG_TRACE)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "log level %d is not SKV_LOG_NONE..SKV_LOG_TRACE",
                    level);
  skv__log_init();
  skv__log_subsys = subsys_mask ? subsys_mask : SKV_SUBSYS_ALL;
  __atomic_store_n(&skv__log_level, level, __ATOMIC_RELEASE);
  return 0;
}

void skv_log_write(int level, unsigned int subsys, const char *msg) {
  if (level < SKV_LOG_WARN || level > SKV_LOG_TRACE || !msg) return;
  if (skv__log_on(level, subsys ? subsys : SKV_SUBSYS_ALL))
    skv__log(level, subsys ? subsys : SKV_SUBSYS_ALL, NULL, 0, "%s", msg);
}

/* Environment parameters: every SKV_* variable is read once, on first use, from a table
 * (core.h's SKV_ENV_MAP); skv_init logs the ones that are set and warns about unknown names. */
#define _GNU_SOURCE
#include "core/core.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern char **environ;

static const char *env_names[SKV_ENV_COUNT] = {
#define SKV__ENV_NAME(name, def, range, doc) "SKV_" #name,
    SKV_ENV_MAP(SKV__ENV_NAME)
#undef SKV__ENV_NAME
};

static char *env_values[SKV_ENV_COUNT];
static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t env_mu = PTHREAD_MUTEX_INITIALIZER;
static int env_reported;

static void env_load(void) {
  for (int i = 0; i < SKV_ENV_COUNT; i++) {
    const char *v = getenv(env_names[i]);
    free(env_values[i]);
    env_values[i] = (v && *v) ? strdup(v) : NULL;
  }
}

const char *skv__env(skv__env_id_t id) {
  pthread_once(&env_once, env_load);
  if ((unsigned)id >= SKV_ENV_COUNT) return NULL;
  return env_values[id];
}

const char *skv__env_name(skv__env_id_t id) {
  return (unsigned)id < SKV_ENV_COUNT ? env_names[id] : "SKV_?";
}

int skv__env_int(skv__env_id_t id, long long lo, long long hi, long long def, long long *out) {
  const char *v = skv__env(id);
  if (!v) {
    *out = def;
    return 0;
  }
  if (!skv__parse_int(v, lo, hi, false, out))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "%s=%s is not an integer in [%lld, %lld]",
                    env_names[id], v, lo, hi);
  return 0;
}

void skv__env_report(void) {
  pthread_mutex_lock(&env_mu);
  int first = !env_reported;
  env_reported = 1;
  pthread_mutex_unlock(&env_mu);
  if (!first) return;
  for (int i = 0; i < SKV_ENV_COUNT; i++) {
    const char *v = skv__env((skv__env_id_t)i);
    if (!v) continue;
    if (i == SKV_ENV_TOKEN || i == SKV_ENV_HASH_SECRET)
      SKV_INFO(SKV_SUBSYS_INIT, "%s set (%zu characters, not shown)", env_names[i], strlen(v));
    else
      SKV_INFO(SKV_SUBSYS_INIT, "%s=%s", env_names[i], v);
  }
  for (char **e = environ; e && *e; e++) {
    if (strncmp(*e, "SKV_", 4) != 0) continue;
    const char *eq = strchr(*e, '=');
    size_t len = eq ? (size_t)(eq - *e) : strlen(*e);
    static const char *const tools[] = {SKV_ENV_TOOL_NAMES};
    int known = 0;
    for (int i = 0; i < SKV_ENV_COUNT && !known; i++)
      known = strlen(env_names[i]) == len && strncmp(env_names[i], *e, len) == 0;
    for (size_t i = 0; i < SKV_ARRAY_LEN(tools) && !known; i++)
      known = strlen(tools[i]) == len && strncmp(tools[i], *e, len) == 0;
    if (!known)
      SKV_WARN(SKV_SUBSYS_INIT,
               "unknown environment variable %.*s ignored (misspelt? see docs/reference.md)",
               (int)len, *e);
  }
}

/* skv__env_switch's answers: 0 not decided yet, 1 off, 2 on (atomic) */
static int env_switches[SKV_ENV_COUNT];

bool skv__env_switch(skv__env_id_t id, bool def, unsigned subsys) {
  if ((unsigned)id >= SKV_ENV_COUNT) return def;
  int v = __atomic_load_n(&env_switches[id], __ATOMIC_RELAXED);
  if (v == 0) {
    const char *s = skv__env(id);
    long long x = def;
    if (s && !skv__parse_int(s, 0, 1, false, &x)) {
      SKV_WARN(subsys, "%s must be 0 or 1; using %d", env_names[id], def ? 1 : 0);
      x = def;
    }
    v = x ? 2 : 1;
    /* the first to decide warns; racing readers decide alike */
    __atomic_store_n(&env_switches[id], v, __ATOMIC_RELAXED);
  }
  return v == 2;
}

void skv__env_reload(void) {
  pthread_once(&env_once, env_load);
  pthread_mutex_lock(&env_mu);
  env_load();
  for (int i = 0; i < SKV_ENV_COUNT; i++) __atomic_store_n(&env_switches[i], 0, __ATOMIC_RELAXED);
  env_reported = 0;
  pthread_mutex_unlock(&env_mu);
}

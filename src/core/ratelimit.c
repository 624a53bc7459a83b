/* Rate limits of log lines that hostile peers or hot paths can repeat at will: a fixed window
 * per call site, and a count of what was suppressed (core.h, SKV_LOG_RL). */
#include "core/core.h"

#include <inttypes.h>
#include <pthread.h>

/* One lock for every site: a limited line is rare by construction, or it is suppressed. */
static pthread_mutex_t rl_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t rl_total;

bool skv__ratelimit_take(skv__ratelimit_t *rl, uint64_t *suppressed) {
  uint64_t now = skv__now_ms();
  bool ok;
  *suppressed = 0;
  pthread_mutex_lock(&rl_mu);
  if (rl->window_ms == 0 || now - rl->window_ms >= SKV_LOG_RL_WINDOW_MS) {
    rl->window_ms = now ? now : 1;
    rl->lines = 0;
  }
  ok = rl->lines < SKV_LOG_RL_BURST;
  if (ok) {
    rl->lines++;
    *suppressed = rl->suppressed;
    rl->suppressed = 0;
  } else {
    rl->suppressed++;
    rl_total++;
  }
  pthread_mutex_unlock(&rl_mu);
  return ok;
}

uint64_t skv__ratelimit_suppressed_total(void) {
  pthread_mutex_lock(&rl_mu);
  uint64_t n = rl_total;
  pthread_mutex_unlock(&rl_mu);
  return n;
}

void skv__log_suppressed(int level, unsigned subsys, uint64_t n) {
  skv__log(level, subsys, NULL, 0,
           "(%" PRIu64 " more lines like the next one were suppressed: at most %d per %d s)", n,
           SKV_LOG_RL_BURST, SKV_LOG_RL_WINDOW_MS / 1000);
}

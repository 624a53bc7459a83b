/* The KV data path's phase counters (kv_prof.h): their names and reset. symkv-bench fetch reads
 * them to print where an end-to-end call's time goes. */
#include "kv/kv_prof.h"

#include <string.h>

static const char *const names[SKV__KP_N] = {
    [SKV__KP_CALL] = "call",       [SKV__KP_CHECK] = "check",       [SKV__KP_BEGIN] = "begin",
    [SKV__KP_PIN] = "pin",         [SKV__KP_LOOKUP] = "claim",      [SKV__KP_ALLOC] = "alloc",
    [SKV__KP_SLOT] = "slot_wait",  [SKV__KP_STAGE] = "stage_args",  [SKV__KP_LAUNCH] = "launch",
    [SKV__KP_HANDOFF] = "handoff", [SKV__KP_COPY] = "host_copy",    [SKV__KP_RELEASE] = "release",
    [SKV__KP_FINISH] = "finish",   [SKV__KP_COMPLETE] = "complete", [SKV__KP_SYNC] = "sync_wait",
    [SKV__KP_HELPER] = "helper",   [SKV__KP_JOIN] = "join_wait",
};

const char *skv__kp_name(int phase) {
  return phase >= 0 && phase < SKV__KP_N && names[phase] ? names[phase] : "?";
}

void skv__kp_reset(skv__kv_prof_t *p, bool on) {
  __atomic_store_n(&p->on, false, __ATOMIC_SEQ_CST);
  for (int i = 0; i < SKV__KP_N; i++) {
    __atomic_store_n(&p->ns[i], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&p->n[i], 0, __ATOMIC_RELAXED);
  }
  __atomic_store_n(&p->on, on, __ATOMIC_SEQ_CST);
}

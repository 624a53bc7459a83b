/* The copy kernels' process-wide variant, next to the backend that launches them: which kernel,
 * how many loads in flight, the grid shape and where the arguments travel; read once from
 * SKV_FETCH_*, set by tests and benches. */
#include "kv/kv_cuda.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

static pthread_once_t var_once = PTHREAD_ONCE_INIT;
static skv__kv_variant_t var = {SKV_KV_KERNEL_AUTO, 4, 4, 256, SKV_KV_ARGS_AUTO, 0};
static pthread_mutex_t var_mu = PTHREAD_MUTEX_INITIALIZER;

static void var_load(void) {
  long long v;
  if (skv__env_int(SKV_ENV_FETCH_UNROLL, 4, 8, 4, &v) == 0 && (v == 4 || v == 8))
    var.unroll = (int)v;
  else
    SKV_WARN(SKV_SUBSYS_KV, "SKV_FETCH_UNROLL must be 4 or 8; using %d", var.unroll);
  if (skv__env_int(SKV_ENV_FETCH_CTAS, 1, 32, 4, &v) == 0)
    var.ctas_per_sm = (int)v;
  else
    SKV_WARN(SKV_SUBSYS_KV, "SKV_FETCH_CTAS must be in 1..32; using %d", var.ctas_per_sm);
  if (skv__env_int(SKV_ENV_FETCH_THREADS, 128, 512, 256, &v) == 0 &&
      (v == 128 || v == 256 || v == 512))
    var.threads = (int)v;
  else
    SKV_WARN(SKV_SUBSYS_KV, "SKV_FETCH_THREADS must be 128, 256 or 512; using %d", var.threads);
  const char *k = skv__env(SKV_ENV_FETCH_KERNEL);
  static const char *const kinds[] = {"vec", "bulk", "ce", "auto"};
  for (int i = 0; k && i < 4; i++)
    if (strcmp(k, kinds[i]) == 0) var.kernel = i, k = NULL;
  if (k)
    SKV_WARN(SKV_SUBSYS_KV, "SKV_FETCH_KERNEL=%s is not auto, vec, bulk or ce; using %s", k,
             kinds[var.kernel]);
}

int skv__kv_variant_set(const skv__kv_variant_t *v) {
  pthread_once(&var_once, var_load);
  SKV_ARG_CHECK(v, SKV_SUBSYS_KV, "kernel variant: NULL");
  SKV_ARG_CHECK(v->kernel >= SKV_KV_KERNEL_VEC && v->kernel <= SKV_KV_KERNEL_AUTO, SKV_SUBSYS_KV,
                "kernel variant: kernel %d is not vec (0), bulk (1), ce (2) or auto (3)",
                v->kernel);
  SKV_ARG_CHECK(v->unroll == 4 || v->unroll == 8, SKV_SUBSYS_KV,
                "kernel variant: unroll %d is not 4 or 8", v->unroll);
  SKV_ARG_CHECK(v->ctas_per_sm >= 1 && v->ctas_per_sm <= 32, SKV_SUBSYS_KV,
                "kernel variant: %d CTAs per SM is not in 1..32", v->ctas_per_sm);
  SKV_ARG_CHECK(v->threads == 128 || v->threads == 256 || v->threads == 512, SKV_SUBSYS_KV,
                "kernel variant: %d threads per CTA is not 128, 256 or 512", v->threads);
  SKV_ARG_CHECK(v->args >= SKV_KV_ARGS_AUTO && v->args <= SKV_KV_ARGS_DEVICE, SKV_SUBSYS_KV,
                "kernel variant: argument mode %d is not auto (0), mapped (1) or device (2)",
                v->args);
  pthread_mutex_lock(&var_mu);
  var = *v;
  pthread_mutex_unlock(&var_mu);
  return 0;
}

void skv__kv_variant_get(skv__kv_variant_t *v) {
  pthread_once(&var_once, var_load);
  pthread_mutex_lock(&var_mu);
  *v = var;
  pthread_mutex_unlock(&var_mu);
}

const char *skv__kv_variant_name(const skv__kv_variant_t *v, char *buf, size_t cap) {
  skv__kv_variant_t cur;
  if (!v) {
    skv__kv_variant_get(&cur);
    v = &cur;
  }
  static const char *const args[] = {"auto", "mapped", "device"};
  if (v->kernel == SKV_KV_KERNEL_CE)
    snprintf(buf, cap, "ce+vec_u%d_c%d_t%d_%s", v->unroll, v->ctas_per_sm, v->threads,
             args[v->args]);
  else if (v->kernel == SKV_KV_KERNEL_BULK)
    snprintf(buf, cap, "bulk_c%d_%s", v->ctas_per_sm, args[v->args]);
  else /* vec, or auto (vec's shape for small batches) */
    snprintf(buf, cap, "%s_u%d_c%d_t%d_%s%s", v->kernel == SKV_KV_KERNEL_AUTO ? "auto" : "vec",
             v->unroll, v->ctas_per_sm, v->threads, args[v->args], v->l2_256 ? "_p256" : "");
  return buf;
}

skv__kv_copy_cfg_t skv__kv_variant_cfg(int sms) {
  skv__kv_variant_t v;
  skv__kv_variant_get(&v);
  skv__kv_copy_cfg_t c = {v.kernel, v.unroll, v.ctas_per_sm, v.threads, v.args, v.l2_256, sms};
  return c;
}

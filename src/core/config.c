/* Configuration: the skv_config_t field table, string setters, validation field by field
 * (errors name the field), and resolution against the SKV_* environment and defaults. */
#define _GNU_SOURCE
#include "core/core.h"

#include <ctype.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

enum { F_I32, F_U32, F_STR };

typedef struct field {
  const char *name;
  size_t offset;
  int type;
  long long lo, hi; /* allowed range besides the "unset" value -1 (ints) */
  skv__env_id_t env;
} field_t;

#define FIELD(n, t, lo, hi, env) \
  { #n, offsetof(skv_config_t, n), t, lo, hi, env }
static const field_t fields[] = {
    FIELD(rank, F_I32, 0, 65535, SKV_ENV_RANK),
    FIELD(world_size, F_I32, 1, 65536, SKV_ENV_WORLD_SIZE),
    FIELD(local_rank, F_I32, 0, 1023, SKV_ENV_LOCAL_RANK),
    FIELD(local_size, F_I32, 1, 1024, SKV_ENV_LOCAL_SIZE),
    FIELD(timeout_ms, F_I32, 1, 86400000, SKV_ENV_TIMEOUT_MS),
    FIELD(device, F_I32, 0, 1023, SKV_ENV_DEVICE),
    FIELD(flags, F_U32, 0, 0, SKV_ENV_COUNT),
    FIELD(bootstrap, F_STR, 0, 0, SKV_ENV_BOOTSTRAP),
    FIELD(token, F_STR, 8, 128, SKV_ENV_TOKEN),
    FIELD(bind_addr, F_STR, 1, 255, SKV_ENV_BIND_ADDR),
};
#undef FIELD

#define DEFAULT_TIMEOUT_MS 60000

int skv_config_init(skv_config_t *cfg) {
  if (!cfg) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "skv_config_init: cfg is NULL");
  skv_config_t init = SKV_CONFIG_INIT;
  *cfg = init;
  return 0;
}

static bool present(const skv_config_t *cfg, const field_t *f) {
  size_t sz = f->type == F_STR ? sizeof(char *) : sizeof(int32_t);
  return f->offset + sz <= cfg->size;
}

static int check_header(const skv_config_t *cfg) {
  if (!cfg) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "config is NULL");
  if (cfg->size < offsetof(skv_config_t, version) + sizeof(uint32_t))
    return SKV_FAIL(SKV_EVERSION, SKV_SUBSYS_INIT,
                    "config.size=%zu is too small: initialise the struct with SKV_CONFIG_INIT",
                    cfg->size);
  if (cfg->version == 0 || cfg->version > SKV_CONFIG_VERSION)
    return SKV_FAIL(
        SKV_EVERSION, SKV_SUBSYS_INIT,
        "config.version=%u is not supported (this library knows 1..%d): initialise with "
        "SKV_CONFIG_INIT from a matching symkv.h",
        cfg->version, SKV_CONFIG_VERSION);
  if (cfg->size > sizeof(skv_config_t)) {
    const unsigned char *p = (const unsigned char *)cfg;
    for (size_t i = sizeof(skv_config_t); i < cfg->size; i++)
      if (p[i])
        return SKV_FAIL(
            SKV_EINVAL, SKV_SUBSYS_INIT,
            "config has unknown fields set (byte %zu of %zu; this library's struct ends at "
            "%zu): was it built against a newer symkv.h?",
            i, cfg->size, sizeof(skv_config_t));
  }
  return 0;
}

int skv__parse_bootstrap(const char *addr, const char *what, char *host, size_t hcap, int *port) {
  const char *p = addr;
  if (strncmp(p, "tcp://", 6) == 0) p += 6;
  const char *colon;
  const char *hs = p, *he;
  if (*p == '[') {
    he = strchr(p, ']');
    if (!he || he[1] != ':')
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "%s=\"%s\": expected tcp://[IPV6]:PORT", what,
                      addr);
    hs = p + 1;
    colon = he + 1;
  } else {
    colon = strrchr(p, ':');
    if (!colon)
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "%s=\"%s\": expected tcp://HOST:PORT", what,
                      addr);
    he = colon;
  }
  size_t hl = (size_t)(he - hs);
  if (hl == 0 || hl >= hcap)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "%s=\"%s\": host is empty or too long", what,
                    addr);
  long long pv;
  if (!skv__parse_int(colon + 1, 1, 65535, false, &pv))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "%s=\"%s\": port is not in 1..65535", what, addr);
  memcpy(host, hs, hl);
  host[hl] = '\0';
  *port = (int)pv;
  return 0;
}

static int check_token(const char *tok, const char *what) {
  size_t n = strlen(tok);
  if (n < 8 || n > 128)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "%s has %zu characters; it needs 8 to 128", what,
                    n);
  for (size_t i = 0; i < n; i++)
    if (!isgraph((unsigned char)tok[i]))
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT,
                      "%s contains a space or control character at position %zu", what, i);
  return 0;
}

static int check_field(const field_t *f, const void *slot, const char *what) {
  switch (f->type) {
  case F_I32: {
    int32_t v;
    memcpy(&v, slot, sizeof v);
    if (v != -1 && (v < f->lo || v > f->hi))
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT,
                      "%s=%d is out of range: use -1 (from the environment) or %lld..%lld", what, v,
                      f->lo, f->hi);
    return 0;
  }
  case F_U32: {
    uint32_t v;
    memcpy(&v, slot, sizeof v);
    if (v < f->lo || v > f->hi)
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "%s=%u is invalid: it must be %lld", what, v,
                      f->lo);
    return 0;
  }
  default: {
    const char *s;
    memcpy(&s, slot, sizeof s);
    if (!s) return 0;
    if (strcmp(f->name, "bootstrap") == 0) {
      char host[256];
      int port;
      return skv__parse_bootstrap(s, what, host, sizeof host, &port);
    }
    if (strcmp(f->name, "token") == 0) return check_token(s, what);
    size_t n = strlen(s);
    if ((long long)n < f->lo || (long long)n > f->hi)
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "%s has %zu characters; it needs %lld to %lld",
                      what, n, f->lo, f->hi);
    return 0;
  }
  }
}

int skv_config_validate(const skv_config_t *cfg) {
  SKV_CHECK(check_header(cfg));
  for (size_t i = 0; i < SKV_ARRAY_LEN(fields); i++) {
    if (!present(cfg, &fields[i])) continue;
    char what[64];
    snprintf(what, sizeof what, "config.%s", fields[i].name);
    SKV_CHECK(check_field(&fields[i], (const char *)cfg + fields[i].offset, what));
  }
  if (cfg->rank >= 0 && cfg->world_size > 0 && cfg->rank >= cfg->world_size)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "config.rank=%d is not below config.world_size=%d",
                    cfg->rank, cfg->world_size);
  if (cfg->local_rank >= 0 && cfg->local_size > 0 && cfg->local_rank >= cfg->local_size)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT,
                    "config.local_rank=%d is not below config.local_size=%d", cfg->local_rank,
                    cfg->local_size);
  if (cfg->local_size > 0 && cfg->world_size > 0 && cfg->local_size > cfg->world_size)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT,
                    "config.local_size=%d exceeds config.world_size=%d", cfg->local_size,
                    cfg->world_size);
  return 0;
}

int skv_config_set(skv_config_t *cfg, const char *name, const char *value) {
  SKV_CHECK(check_header(cfg));
  if (!name) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "skv_config_set: name is NULL");
  const field_t *f = NULL;
  for (size_t i = 0; i < SKV_ARRAY_LEN(fields) && !f; i++)
    if (strcmp(fields[i].name, name) == 0) f = &fields[i];
  if (!f) {
    char known[256] = "";
    for (size_t i = 0; i < SKV_ARRAY_LEN(fields); i++)
      snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", i ? ", " : "",
               fields[i].name);
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "unknown config field \"%s\" (known: %s)", name,
                    known);
  }
  if (!present(cfg, f))
    return SKV_FAIL(SKV_EVERSION, SKV_SUBSYS_INIT, "config field \"%s\" is beyond config.size=%zu",
                    name, cfg->size);
  char what[64];
  snprintf(what, sizeof what, "config.%s", f->name);
  void *slot = (char *)cfg + f->offset;
  if (f->type == F_STR) {
    SKV_CHECK(check_field(f, &value, what));
    memcpy(slot, &value, sizeof value);
    return 0;
  }
  long long v;
  if (!value || !skv__parse_int(value, INT32_MIN, UINT32_MAX, false, &v))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "%s=\"%s\" is not an integer", what,
                    value ? value : "(null)");
  if (v < (f->type == F_I32 ? -1 : 0) || v > (f->type == F_I32 ? INT32_MAX : (long long)UINT32_MAX))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT,
                    "%s=%s is out of range: use -1 (from the environment) or %lld..%lld", what,
                    value, f->lo, f->hi);
  if (f->type == F_I32) {
    int32_t x = (int32_t)v;
    SKV_CHECK(check_field(f, &x, what));
    memcpy(slot, &x, sizeof x);
  } else {
    uint32_t x = (uint32_t)v;
    SKV_CHECK(check_field(f, &x, what));
    memcpy(slot, &x, sizeof x);
  }
  return 0;
}

/* Integer field: the config's value, else the environment's, else `def` (-1: required). */
static int resolve_int(const skv_config_t *cfg, const char *name, long long def, int *out) {
  const field_t *f = NULL;
  for (size_t i = 0; i < SKV_ARRAY_LEN(fields) && !f; i++)
    if (strcmp(fields[i].name, name) == 0) f = &fields[i];
  int32_t v = -1;
  if (cfg && present(cfg, f)) memcpy(&v, (const char *)cfg + f->offset, sizeof v);
  if (v != -1) {
    *out = v;
    return 0;
  }
  long long e;
  SKV_CHECK(skv__env_int(f->env, f->lo, f->hi, def, &e));
  *out = (int)e;
  return 0;
}

static const char *resolve_str(const skv_config_t *cfg, const char *name, skv__env_id_t env) {
  const field_t *f = NULL;
  for (size_t i = 0; i < SKV_ARRAY_LEN(fields) && !f; i++)
    if (strcmp(fields[i].name, name) == 0) f = &fields[i];
  const char *s = NULL;
  if (cfg && present(cfg, f)) memcpy(&s, (const char *)cfg + f->offset, sizeof s);
  return s ? s : skv__env(env);
}

int skv__config_resolve(const skv_config_t *cfg, skv__cfg_resolved_t *out) {
  if (cfg) SKV_CHECK(skv_config_validate(cfg));
  memset(out, 0, sizeof *out);
  SKV_CHECK(resolve_int(cfg, "world_size", -1, &out->world_size));
  if (out->world_size < 1)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT,
                    "world size unknown: set config.world_size or SKV_WORLD_SIZE (or start with "
                    "symkv-run -n N)");
  SKV_CHECK(resolve_int(cfg, "rank", -1, &out->rank));
  if (out->rank < 0)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT,
                    "rank unknown: set config.rank or SKV_RANK (or start with symkv-run -n N)");
  if (out->rank >= out->world_size)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "rank %d is not below world size %d", out->rank,
                    out->world_size);
  /* -1 (neither config nor environment): skv_init takes the PEs it finds on this node. */
  SKV_CHECK(resolve_int(cfg, "local_size", -1, &out->local_size));
  SKV_CHECK(resolve_int(cfg, "local_rank", -1, &out->local_rank));
  int local_cap = out->local_size > 0 ? out->local_size : out->world_size;
  if (out->local_size > out->world_size || out->local_rank >= local_cap)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT,
                    "local rank %d / local size %d do not fit world size %d", out->local_rank,
                    out->local_size, out->world_size);
  SKV_CHECK(resolve_int(cfg, "timeout_ms", DEFAULT_TIMEOUT_MS, &out->timeout_ms));
  SKV_CHECK(resolve_int(cfg, "device", -1, &out->device));

  const char *boot = resolve_str(cfg, "bootstrap", SKV_ENV_BOOTSTRAP);
  if (!boot)
    return SKV_FAIL(
        SKV_EINVAL, SKV_SUBSYS_INIT,
        "bootstrap address unknown: set config.bootstrap or SKV_BOOTSTRAP=tcp://HOST:PORT "
        "(or start with symkv-run -n N)");
  SKV_CHECK(skv__parse_bootstrap(boot, cfg && cfg->bootstrap ? "config.bootstrap" : "SKV_BOOTSTRAP",
                                 out->host, sizeof out->host, &out->port));
  const char *tok = resolve_str(cfg, "token", SKV_ENV_TOKEN);
  if (!tok)
    return SKV_FAIL(
        SKV_EINVAL, SKV_SUBSYS_INIT,
        "bootstrap token unknown: set config.token or SKV_TOKEN to the same secret on every PE "
        "(symkv-run does this)");
  SKV_CHECK(check_token(tok, cfg && cfg->token ? "config.token" : "SKV_TOKEN"));
  snprintf(out->token, sizeof out->token, "%s", tok);
  const char *bind = resolve_str(cfg, "bind_addr", SKV_ENV_BIND_ADDR);
  snprintf(out->bind_addr, sizeof out->bind_addr, "%s", bind ? bind : out->host);
  return 0;
}

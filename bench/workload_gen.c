/* symkv-bench workloads: model presets and prefill FLOPs, the Mooncake trace reader (jansson),
 * the longdoc and multiround generators, and a private LRU of keys (per_pe, exact hits). */
#define _GNU_SOURCE
#include "workload.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- models --------------------------------------------------------------------------- */

/* KV geometry from the models' configs; attention FLOPs per prompt token and context token are
 * layers x 2 x (q_heads x qk_head_dim + q_heads x v_head_dim): QK^T and AV. */
static const wl_model_t models[] = {
    {"tiny", SKV_KV_SPLIT, 1, 1, 4, 2, 1, 8.03e9, 32.0 * 2 * (32 * 128 + 32 * 128),
     "16 B of KV per token (1 layer x 1 KV head x 4 x bf16, K and V) for fast runs; prefill costed "
     "as llama-3-8b"},
    {"llama-3-8b", SKV_KV_SPLIT, 32, 8, 128, 2, 1, 8.03e9, 32.0 * 2 * (32 * 128 + 32 * 128),
     "32 layers, 32 query / 8 KV heads of 128, d_model 4096, 8.03B parameters"},
    {"llama-3-70b", SKV_KV_SPLIT, 80, 8, 128, 2, 4, 70.6e9, 80.0 * 2 * (64 * 128 + 64 * 128),
     "80 layers, 64 query / 8 KV heads of 128, d_model 8192, 70.6B parameters; KV heads split over "
     "--tp"},
    {"qwen2.5-32b", SKV_KV_SPLIT, 64, 8, 128, 2, 1, 32.5e9, 64.0 * 2 * (40 * 128 + 40 * 128),
     "64 layers, 40 query / 8 KV heads of 128, d_model 5120, 32.5B parameters"},
    {"deepseek-v3", SKV_KV_MLA, 61, 1, 576, 2, 8, 37e9, 61.0 * 2 * (128 * 192 + 128 * 128),
     "MLA: 61 layers of one 576-wide latent (512 + 64 rope) per token, replicated over --tp; 128 "
     "query heads (qk 192, v 128); 37B active parameters"},
};

const wl_model_t *wl_model_find(const char *name) {
  for (size_t i = 0; i < SKV_ARRAY_LEN(models); i++)
    if (strcmp(models[i].name, name) == 0) return &models[i];
  return NULL;
}

const char *wl_model_names(void) {
  return "tiny, llama-3-8b, llama-3-70b, qwen2.5-32b, deepseek-v3";
}

double wl_prefill_flops(const wl_model_t *m, uint64_t cached, uint64_t total) {
  if (cached >= total) return 0;
  double h = (double)cached, t = (double)total;
  /* token at position p (1-based) attends to p context tokens: sum over p in (h, t] */
  double ctx = (t * (t + 1) - h * (h + 1)) / 2;
  return 2 * m->params * (t - h) + m->attn_flops * ctx;
}

/* ---- the LRU of keys --------------------------------------------------------------------- */

/* How it works: entries live in arrays (key, prev, next); a linear-probing table of entry
 * indices finds them (key.lo is already a hash); deletion shifts the following run back so
 * that no tombstones are needed. The list runs from the most recently used (head) to the
 * least (tail). Capacity 0 grows without bound. */
#define NIL UINT32_MAX

struct wl_lru {
  uint64_t capacity; /* 0: unbounded */
  uint64_t n, cap;   /* entries used / allocated */
  skv_key_t *key;
  uint32_t *prev, *next;
  uint32_t head, tail;
  uint32_t *map; /* entry index or NIL */
  uint64_t mask;
};

static uint64_t pow2_at_least(uint64_t x) {
  uint64_t p = 16;
  while (p < x) p <<= 1;
  return p;
}

static void *xrealloc(void *p, size_t n) {
  void *q = realloc(p, n ? n : 1);
  if (!q) {
    fprintf(stderr, "symkv-bench: out of memory (%zu bytes)\n", n);
    exit(1);
  }
  return q;
}

static uint64_t slot_of(const wl_lru_t *c, skv_key_t k) {
  uint64_t i = k.lo & c->mask;
  while (c->map[i] != NIL) {
    skv_key_t e = c->key[c->map[i]];
    if (e.hi == k.hi && e.lo == k.lo) return i;
    i = (i + 1) & c->mask;
  }
  return i;
}

static void map_resize(wl_lru_t *c, uint64_t slots) {
  free(c->map);
  c->map = xrealloc(NULL, slots * sizeof *c->map);
  memset(c->map, 0xff, slots * sizeof *c->map);
  c->mask = slots - 1;
  for (uint32_t e = c->head; e != NIL; e = c->next[e]) c->map[slot_of(c, c->key[e])] = e;
}

wl_lru_t *wl_lru_create(uint64_t capacity) {
  wl_lru_t *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->capacity = capacity;
  c->cap = capacity ? capacity : 1024;
  c->key = xrealloc(NULL, c->cap * sizeof *c->key);
  c->prev = xrealloc(NULL, c->cap * sizeof *c->prev);
  c->next = xrealloc(NULL, c->cap * sizeof *c->next);
  c->head = c->tail = NIL;
  map_resize(c, pow2_at_least(2 * c->cap));
  return c;
}

void wl_lru_destroy(wl_lru_t *c) {
  if (!c) return;
  free(c->key);
  free(c->prev);
  free(c->next);
  free(c->map);
  free(c);
}

uint64_t wl_lru_size(const wl_lru_t *c) {
  return c->n;
}

bool wl_lru_contains(const wl_lru_t *c, skv_key_t k) {
  return c->map[slot_of(c, k)] != NIL;
}

static void list_unlink(wl_lru_t *c, uint32_t e) {
  if (c->prev[e] != NIL)
    c->next[c->prev[e]] = c->next[e];
  else
    c->head = c->next[e];
  if (c->next[e] != NIL)
    c->prev[c->next[e]] = c->prev[e];
  else
    c->tail = c->prev[e];
}

static void list_push_front(wl_lru_t *c, uint32_t e) {
  c->prev[e] = NIL;
  c->next[e] = c->head;
  if (c->head != NIL) c->prev[c->head] = e;
  c->head = e;
  if (c->tail == NIL) c->tail = e;
}

static void map_delete(wl_lru_t *c, uint64_t i) {
  c->map[i] = NIL;
  for (uint64_t j = (i + 1) & c->mask; c->map[j] != NIL; j = (j + 1) & c->mask) {
    uint64_t home = c->key[c->map[j]].lo & c->mask;
    /* the entry at j may move to the hole at i unless its home lies in (i, j] */
    if (((j - home) & c->mask) >= ((j - i) & c->mask)) {
      c->map[i] = c->map[j];
      c->map[j] = NIL;
      i = j;
    }
  }
}

uint64_t wl_lru_lookup(wl_lru_t *c, const skv_key_t *keys, uint64_t n) {
  uint64_t h = 0;
  for (; h < n; h++) {
    uint32_t e = c->map[slot_of(c, keys[h])];
    if (e == NIL) break;
    list_unlink(c, e);
    list_push_front(c, e);
  }
  return h;
}

uint64_t wl_lru_publish(wl_lru_t *c, const skv_key_t *keys, uint64_t n) {
  uint64_t inserted = 0;
  for (uint64_t i = 0; i < n; i++) {
    uint64_t s = slot_of(c, keys[i]);
    if (c->map[s] != NIL) continue; /* cached already: left alone, as skv_kv_publish does */
    uint32_t e;
    if (c->capacity && c->n == c->capacity) {
      e = c->tail; /* evict the least recently used */
      list_unlink(c, e);
      map_delete(c, slot_of(c, c->key[e]));
      s = slot_of(c, keys[i]); /* the deletion may have shifted the run */
    } else {
      if (c->n == c->cap) {
        c->cap *= 2;
        c->key = xrealloc(c->key, c->cap * sizeof *c->key);
        c->prev = xrealloc(c->prev, c->cap * sizeof *c->prev);
        c->next = xrealloc(c->next, c->cap * sizeof *c->next);
      }
      e = (uint32_t)c->n++;
      if (2 * c->n > c->mask + 1) {
        c->key[e] = keys[i];
        list_push_front(c, e);
        map_resize(c, 2 * (c->mask + 1));
        inserted++;
        continue;
      }
    }
    c->key[e] = keys[i];
    list_push_front(c, e);
    c->map[s] = e;
    inserted++;
  }
  return inserted;
}

/* ---- workloads ---------------------------------------------------------------------------- */

void wl_workload_free(wl_workload_t *w) {
  free(w->req);
  free(w->keys);
  free(w->ids);
  memset(w, 0, sizeof *w);
}

void wl_workload_finish(wl_workload_t *w) {
  wl_lru_t *all = wl_lru_create(0);
  w->max_pages = 0;
  for (size_t i = 0; i < w->nreq; i++) {
    wl_lru_publish(all, w->keys + w->req[i].key0, w->req[i].npages);
    if (w->req[i].npages > w->max_pages) w->max_pages = w->req[i].npages;
  }
  w->distinct = wl_lru_size(all);
  wl_lru_destroy(all);
}

void wl_exact_prefix_hits(const wl_workload_t *w, int npes, wl_exact_t *out) {
  memset(out, 0, sizeof *out);
  wl_lru_t *shared = wl_lru_create(0);
  wl_lru_t **mine = calloc((size_t)npes, sizeof *mine);
  for (int p = 0; p < npes; p++) mine[p] = wl_lru_create(0);
  for (size_t i = 0; i < w->nreq; i++) {
    const wl_request_t *r = &w->req[i];
    const skv_key_t *k = w->keys + r->key0;
    wl_lru_t *own = mine[i % (size_t)npes];
    uint64_t hs = wl_lru_lookup(shared, k, r->npages), hp = wl_lru_lookup(own, k, r->npages);
    out->pages += r->npages;
    out->tokens += r->tokens;
    out->hit_pages[0] += hs;
    out->hit_pages[1] += hp;
    out->hit_tokens[0] += wl_hit_tokens(w, r, hs);
    out->hit_tokens[1] += wl_hit_tokens(w, r, hp);
    wl_lru_publish(shared, k, r->npages);
    wl_lru_publish(own, k, r->npages);
  }
  for (int p = 0; p < npes; p++) wl_lru_destroy(mine[p]);
  free(mine);
  wl_lru_destroy(shared);
}

uint64_t wl_max_pages_per_pe(const wl_workload_t *w, int npes) {
  uint64_t best = 0;
  for (int p = 0; p < npes; p++) {
    wl_lru_t *s = wl_lru_create(0);
    for (size_t i = (size_t)p; i < w->nreq; i += (size_t)npes)
      wl_lru_publish(s, w->keys + w->req[i].key0, w->req[i].npages);
    if (wl_lru_size(s) > best) best = wl_lru_size(s);
    wl_lru_destroy(s);
  }
  return best;
}

static void add_request(wl_workload_t *w, size_t *cap, double arrival_ms, uint64_t tokens,
                        uint64_t key0, uint32_t npages) {
  if (w->nreq == *cap) {
    *cap = *cap ? 2 * *cap : 1024;
    w->req = xrealloc(w->req, *cap * sizeof *w->req);
  }
  w->req[w->nreq++] = (wl_request_t){arrival_ms, tokens, key0, npages, 0};
}

/* ---- the Mooncake trace ---------------------------------------------------------------- */

static int trace_fail(char *err, size_t cap, const char *fmt, ...) SKV_PRINTF(3, 4);
static int trace_fail(char *err, size_t cap, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, cap, fmt, ap);
  va_end(ap);
  return SKV_EINVAL;
}

int wl_trace_read(const char *path, uint32_t page_tokens, uint64_t max_requests, wl_workload_t *w,
                  char *err, size_t errcap) {
  memset(w, 0, sizeof *w);
  snprintf(w->kind, sizeof w->kind, "trace");
  w->page_tokens = page_tokens;
  FILE *f = fopen(path, "r");
  if (!f) return trace_fail(err, errcap, "cannot open the trace %s: %s", path, strerror(errno));
  char *line = NULL;
  size_t linecap = 0, reqcap = 0, idcap = 0, lineno = 0;
  ssize_t len;
  int rc = 0;
  while ((len = getline(&line, &linecap, f)) >= 0) {
    lineno++;
    if (max_requests && w->nreq >= max_requests) break;
    bool blank = true;
    for (ssize_t i = 0; i < len && blank; i++)
      if (line[i] != ' ' && line[i] != '\t' && line[i] != '\n' && line[i] != '\r') blank = false;
    if (blank) continue;
    json_error_t je;
    json_t *o = json_loadb(line, (size_t)len, 0, &je);
    if (!o) {
      rc = trace_fail(err, errcap, "%s:%zu: malformed JSON at column %d: %s", path, lineno,
                      je.column, je.text);
      break;
    }
    json_t *ts = json_object_get(o, "timestamp"), *il = json_object_get(o, "input_length"),
           *ids = json_object_get(o, "hash_ids");
    if (!json_is_object(o)) {
      rc = trace_fail(err, errcap,
                      "%s:%zu: a line must be a JSON object {\"timestamp\", \"input_length\", "
                      "\"hash_ids\"}",
                      path, lineno);
    } else if (!json_is_number(ts) || json_number_value(ts) < 0) {
      rc = trace_fail(err, errcap, "%s:%zu: \"timestamp\" is %s (want milliseconds, a number >= 0)",
                      path, lineno, ts ? "not a non-negative number" : "missing");
    } else if (!json_is_integer(il) || json_integer_value(il) < 1) {
      rc = trace_fail(err, errcap,
                      "%s:%zu: \"input_length\" is %s (want the prompt's tokens, an integer >= 1)",
                      path, lineno, il ? "not a positive integer" : "missing");
    } else if (!json_is_array(ids) || json_array_size(ids) == 0) {
      rc = trace_fail(err, errcap,
                      "%s:%zu: \"hash_ids\" is %s (want a non-empty array of block ids)", path,
                      lineno, ids ? "not a non-empty array" : "missing");
    } else {
      size_t n = json_array_size(ids);
      uint64_t tokens = (uint64_t)json_integer_value(il);
      uint64_t need = (tokens + page_tokens - 1) / page_tokens;
      if (n > need)
        rc = trace_fail(err, errcap,
                        "%s:%zu: %zu hash_ids but input_length %" PRIu64 " fills only %" PRIu64
                        " blocks of %u tokens",
                        path, lineno, n, tokens, need, page_tokens);
      if (n > UINT32_MAX) rc = trace_fail(err, errcap, "%s:%zu: too many hash_ids", path, lineno);
      if (rc == 0 && w->nkeys + n > idcap) {
        while (w->nkeys + n > idcap) idcap = idcap ? 2 * idcap : 65536;
        w->ids = xrealloc(w->ids, idcap * sizeof *w->ids);
      }
      for (size_t i = 0; i < n && rc == 0; i++) {
        json_t *v = json_array_get(ids, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0)
          rc = trace_fail(err, errcap, "%s:%zu: hash_ids[%zu] is not a non-negative integer", path,
                          lineno, i);
        else
          w->ids[w->nkeys + i] = (uint64_t)json_integer_value(v);
      }
      if (rc == 0) {
        add_request(w, &reqcap, json_number_value(ts), tokens, w->nkeys, (uint32_t)n);
        w->nkeys += n;
      }
    }
    json_decref(o);
    if (rc) break;
  }
  if (rc == 0 && ferror(f))
    rc = trace_fail(err, errcap, "%s: read error: %s", path, strerror(errno));
  free(line);
  fclose(f);
  if (rc == 0 && w->nreq == 0)
    rc = trace_fail(err, errcap,
                    "%s: no requests: the trace is empty (want one JSON object a line)", path);
  if (rc) {
    wl_workload_free(w);
    return rc;
  }
  snprintf(w->about, sizeof w->about, "%zu requests, %" PRIu64 " pages of %u tokens from %s",
           w->nreq, w->nkeys, page_tokens, path);
  return 0;
}

int wl_trace_keys(wl_workload_t *w, const skv_namespace_t *ns) {
  w->keys = xrealloc(w->keys, w->nkeys * sizeof *w->keys);
  for (size_t i = 0; i < w->nreq; i++) {
    skv_key_t parent = {0, 0};
    for (uint32_t j = 0; j < w->req[i].npages; j++) {
      uint64_t k = w->req[i].key0 + j;
      uint64_t buf[3] = {parent.hi, parent.lo, w->ids[k]};
      SKV_CHECK(skv_namespace_hash_bytes(ns, buf, sizeof buf, &w->keys[k]));
      parent = w->keys[k];
    }
  }
  wl_workload_finish(w);
  return 0;
}

/* ---- synthetic workloads --------------------------------------------------------------- */

static void fill_tokens(uint32_t *t, uint64_t n, uint64_t seed) {
  uint64_t s = seed;
  for (uint64_t i = 0; i < n; i++) t[i] = (uint32_t)bench_rand(&s);
}

/* Hash `tokens` into keys appended to w->keys; returns the request's key0 and page count. */
static int append_keys(wl_workload_t *w, uint64_t *kcap, const skv_namespace_t *ns,
                       const uint32_t *tokens, uint64_t ntokens, uint64_t *key0, uint32_t *npages) {
  uint64_t n = ntokens / w->page_tokens;
  if (w->nkeys + n > *kcap) {
    while (w->nkeys + n > *kcap) *kcap = *kcap ? 2 * *kcap : 4096;
    w->keys = xrealloc(w->keys, *kcap * sizeof *w->keys);
  }
  size_t got;
  SKV_CHECK(skv_namespace_hash_tokens(ns, tokens, ntokens, NULL, w->keys + w->nkeys, n, &got));
  *key0 = w->nkeys;
  *npages = (uint32_t)got;
  w->nkeys += got;
  return 0;
}

int wl_longdoc_make(const wl_longdoc_opts_t *o, const skv_namespace_t *ns, uint32_t page_tokens,
                    wl_workload_t *w) {
  memset(w, 0, sizeof *w);
  snprintf(w->kind, sizeof w->kind, "longdoc");
  w->page_tokens = page_tokens;
  uint64_t ntok = o->doc_tokens + o->question_tokens, kcap = 0;
  size_t rcap = 0;
  uint32_t *t = xrealloc(NULL, ntok * sizeof *t);
  uint64_t order_rng = o->seed ^ 0x6c6f6e67646f63ull;
  uint64_t nq = (uint64_t)o->docs * o->repeats;
  static const char *order_names[] = {"random", "tile", "interleave"};
  for (uint64_t q = 0; q < nq; q++) {
    uint64_t d = o->order == WL_ORDER_TILE         ? q / o->repeats
                 : o->order == WL_ORDER_INTERLEAVE ? q % o->docs
                                                   : bench_rand(&order_rng) % o->docs;
    fill_tokens(t, o->doc_tokens, o->seed * 1000003 + d);
    fill_tokens(t + o->doc_tokens, o->question_tokens,
                (o->seed ^ 0x7175657374696f6eull) * 1000003 + q);
    uint64_t key0;
    uint32_t np;
    int rc = append_keys(w, &kcap, ns, t, ntok, &key0, &np);
    if (rc) {
      free(t);
      return rc;
    }
    add_request(w, &rcap, (double)q * 1000.0 / o->rate, ntok, key0, np);
  }
  free(t);
  wl_workload_finish(w);
  snprintf(w->about, sizeof w->about,
           "%u documents of %" PRIu64 " tokens queried %u times each in %s order (+%" PRIu64
           " question tokens): %zu requests",
           o->docs, o->doc_tokens, o->repeats, order_names[o->order], o->question_tokens, w->nreq);
  return 0;
}

int wl_multiround_make(const wl_multiround_opts_t *o, const skv_namespace_t *ns,
                       uint32_t page_tokens, wl_workload_t *w) {
  memset(w, 0, sizeof *w);
  snprintf(w->kind, sizeof w->kind, "multiround");
  w->page_tokens = page_tokens;
  uint64_t per_round = o->message_tokens + o->answer_tokens;
  uint64_t maxtok = o->system_tokens + (uint64_t)o->rounds * per_round, kcap = 0;
  size_t rcap = 0;
  /* every user's history: the shared system prompt, then message r and answer r per round */
  uint32_t **hist = calloc(o->users, sizeof *hist);
  uint64_t *len = calloc(o->users, sizeof *len);
  for (uint32_t u = 0; u < o->users; u++) {
    hist[u] = xrealloc(NULL, (maxtok ? maxtok : 1) * sizeof **hist);
    fill_tokens(hist[u], o->system_tokens, o->seed * 1000003);
    len[u] = o->system_tokens;
  }
  int rc = 0;
  uint64_t idx = 0;
  for (uint32_t r = 0; r < o->rounds && rc == 0; r++)
    for (uint32_t u = 0; u < o->users && rc == 0; u++, idx++) {
      uint64_t salt = ((uint64_t)u << 32 | r) * 2 + 1;
      fill_tokens(hist[u] + len[u], o->message_tokens, (o->seed ^ 0x6d7367ull) * 1000003 + salt);
      len[u] += o->message_tokens;
      uint64_t key0;
      uint32_t np;
      rc = append_keys(w, &kcap, ns, hist[u], len[u], &key0, &np);
      if (rc == 0) add_request(w, &rcap, (double)idx * 1000.0 / o->rate, len[u], key0, np);
      fill_tokens(hist[u] + len[u], o->answer_tokens, (o->seed ^ 0x616e73ull) * 1000003 + salt);
      len[u] += o->answer_tokens;
    }
  for (uint32_t u = 0; u < o->users; u++) free(hist[u]);
  free(hist);
  free(len);
  if (rc) return rc;
  wl_workload_finish(w);
  snprintf(w->about, sizeof w->about,
           "%u users x %u rounds: %" PRIu64 " system tokens shared, then %" PRIu64
           " message + %" PRIu64 " answer tokens a round: %zu requests",
           o->users, o->rounds, o->system_tokens, o->message_tokens, o->answer_tokens, w->nreq);
  return 0;
}

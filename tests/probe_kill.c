/* Probe: kill -9 of a PE at a random point while the others publish, look up and fetch, with
 * every fetched byte verified; trial after trial, each bounded in time. */
#define _GNU_SOURCE
#include "skv_test.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

/* How it works
 *
 * A trial forks NPES PEs through the real bootstrap. Each makes a KV cache on the host backend
 * (PAGES pages of 8 KiB per PE, fewer than the key space, so pages are evicted and reused all
 * the time) and, until RUN_MS after its start, loops: publish a random batch of keys whose pages
 * hold a pattern derived from the key alone, look up random chains with pins, fetch the hits
 * into its engine blocks (poisoned first) releasing the pins, and compare every byte with the
 * pattern; unpinned lookups and fetches too (a stale reference is fine, a wrong byte is not).
 * The parent SIGKILLs one PE, any rank (rank 0 serves the store: the others then lose it, the
 * data path goes on in shared memory), at a random time from the start of the trial, which
 * may fall in skv_init, skv_kv_create, a publish, an eviction, a fetch or the teardown. The
 * survivors finish their loop, tear down (failing, since a PE died, but bounded by their
 * timeout) and write their counts into shared memory. A survivor that has not exited within
 * TRIAL_MS is a hang; a byte that differs from its pattern is a wrong byte. */

#define NPES     3
#define PAGES    48
#define KEYSPACE 256
#define RUN_MS   1200
#define TRIAL_MS 30000

typedef struct report {
  uint64_t started; /* 1 once the cache was made */
  uint64_t pages_verified, bytes_verified, wrong_bytes, stale, published, errors;
  char first_error[256];
} report_t;

static report_t *reports; /* shared with the PEs: [NPES] */

static skv_geometry_t geometry(void) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.kv_kind = SKV_KV_SPLIT;
  g.num_layers = 2;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.elem_bytes = 2;
  g.page_tokens = 16; /* 8 KiB pages */
  return g;
}

static uint64_t pattern(uint64_t id, uint64_t word) {
  return (id + 1) * 0x9e3779b97f4a7c15ull ^ (word * 0xbf58476d1ce4e5b9ull);
}

static void note_error(report_t *r, const char *what, int rc) {
  r->errors++;
  if (!r->first_error[0])
    snprintf(r->first_error, sizeof r->first_error, "%s: %s: %s", what, skv_err_name(rc),
             skv_last_error());
}

static int pe_main(int rank, int npes, void *arg) {
  report_t *r = &reports[rank];
  uint64_t s = *(uint64_t *)arg ^ (0x1234567ull * (uint64_t)(rank + 1));
  uint64_t t0 = skv__now_ms();
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  skv_ctx_t *ctx = NULL;
  skv_kv_t *kv = NULL;
  skv_namespace_t *ns = NULL;
  skv_layout_t *lay = NULL;
  skv_geometry_t g = geometry();
  uint64_t pb = 0;
  skv_geometry_get_page_bytes(&g, &pb);
  const uint64_t nblocks = 64; /* CONTIGUOUS, one block per page: block b at eng + b * pb */
  uint64_t lb = 0;
  if (skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_CONTIGUOUS, 16, nblocks, &lb) != 0 ||
      lb != nblocks * pb)
    return 2;
  uint8_t *eng = aligned_alloc(64, lb);
  if (!eng) return 2;
  int rc = skv_test_init(&ctx, 5000);
  if (rc == 0) {
    skv_kv_opts_t o = SKV_KV_OPTS_INIT;
    o.pages_per_pe = PAGES;
    rc = skv_kv_create(ctx, &g, &o, &kv);
  }
  if (rc == 0) rc = skv_namespace_create("probe-kill", &g, NULL, 0, "k", 1, &ns);
  if (rc == 0) {
    void *layers[1] = {eng};
    rc = skv_layout_create_preset(&g, SKV_LAYOUT_CONTIGUOUS, 16, nblocks, layers, -1, &lay);
  }
  if (rc != 0) { /* a peer died before the cache existed: fine, as long as nothing hangs */
    note_error(r, "start", rc);
    goto out;
  }
  r->started = 1;
  while (skv__now_ms() - t0 < RUN_MS) {
    /* publish a batch of random keys */
    uint64_t ids[8], blocks[8];
    skv_key_t keys[8];
    size_t n = 1 + skv_test_rand(&s) % 8, ins = 0;
    for (size_t i = 0; i < n; i++) {
      ids[i] = skv_test_rand(&s) % KEYSPACE;
      blocks[i] = i;
      skv_namespace_hash_bytes(ns, &ids[i], sizeof ids[i], &keys[i]);
      uint64_t *w = (uint64_t *)(eng + i * pb);
      for (uint64_t k = 0; k < pb / 8; k++) w[k] = pattern(ids[i], k);
    }
    rc = skv_kv_publish(kv, ns, keys, n, lay, blocks, NULL, &ins);
    if (rc != 0 && rc != SKV_ENOSPC) note_error(r, "publish", rc);
    r->published += ins;
    /* look up and fetch, pinned or not, and verify every byte */
    bool pin = skv_test_rand(&s) & 1;
    for (size_t i = 0; i < n; i++) {
      ids[i] = skv_test_rand(&s) % KEYSPACE;
      skv_namespace_hash_bytes(ns, &ids[i], sizeof ids[i], &keys[i]);
    }
    skv_page_ref_t refs[8];
    size_t nhit = 0;
    /* one key at a time (random keys are no chain): a hit may be followed by a miss */
    size_t m = 0;
    uint64_t hit_ids[8];
    for (size_t i = 0; i < n; i++) {
      size_t h = 0;
      rc = skv_kv_lookup(kv, ns, &keys[i], 1, pin ? SKV_LOOKUP_PIN : 0, &refs[m], &h);
      if (rc != 0) note_error(r, "lookup", rc);
      if (h == 1) hit_ids[m++] = ids[i];
    }
    nhit = m;
    if (nhit == 0) continue;
    memset(eng, 0xA5, nhit * pb);
    for (size_t i = 0; i < nhit; i++) blocks[i] = i;
    rc = skv_kv_fetch(kv, refs, nhit, lay, blocks, pin ? SKV_FETCH_UNPIN : 0, NULL);
    if (rc == SKV_ESTALE && !pin) {
      r->stale++;
      continue;
    }
    if (rc != 0) {
      note_error(r, "fetch", rc);
      if (pin) (void)skv_kv_unpin(kv, refs, nhit);
      continue;
    }
    for (size_t i = 0; i < nhit; i++) {
      const uint64_t *w = (const uint64_t *)(eng + i * pb);
      for (uint64_t k = 0; k < pb / 8; k++)
        if (w[k] != pattern(hit_ids[i], k)) r->wrong_bytes += 8;
      r->pages_verified++;
      r->bytes_verified += pb;
    }
  }
out:
  /* A peer died: these fail (bounded by the timeout) and must not hang. */
  skv_layout_destroy(lay);
  skv_namespace_destroy(ns);
  if (kv) skv_kv_destroy(kv);
  if (ctx) skv_finalize(ctx);
  free(eng);
  return 0;
}

int main(int argc, char **argv) {
  int trials = 20;
  uint64_t seed = skv_test_seed();
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--trials") == 0) trials = atoi(argv[i + 1]);
    if (strcmp(argv[i], "--seed") == 0) seed = strtoull(argv[i + 1], NULL, 0);
  }
  printf("probe_kill: seed %#llx (rerun with --seed), %d trials of %d PEs\n",
         (unsigned long long)seed, trials, NPES);
  fflush(stdout);
  reports =
      mmap(NULL, NPES * sizeof *reports, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (reports == MAP_FAILED) return 2;
  uint64_t s = seed;
  uint64_t hangs = 0, wrong = 0, pages = 0, bytes = 0, stale = 0, published = 0, started = 0,
           errors = 0;
  char first_error[320] = "";
  int failed = 0, victims[NPES] = {0};
  uint64_t t_all = skv__now_ms(), slowest = 0;
  for (int t = 0; t < trials; t++) {
    memset(reports, 0, NPES * sizeof *reports);
    uint64_t pe_seed = skv_test_rand(&s);
    int victim = (int)(skv_test_rand(&s) % NPES);
    uint64_t when = 20 + skv_test_rand(&s) % (RUN_MS + 200); /* init .. teardown */
    skv_test_job_t job;
    if (skv_test_spawn(&job, NPES, pe_main, &pe_seed) != 0) {
      fprintf(stderr, "probe_kill: trial %d: cannot fork\n", t);
      return 2;
    }
    uint64_t t0 = skv__now_ms();
    usleep((useconds_t)(when * 1000));
    kill(job.pids[victim], SIGKILL);
    victims[victim]++;
    skv_test_wait(&job, TRIAL_MS);
    uint64_t dt = skv__now_ms() - t0;
    slowest = SKV_MAX(slowest, dt);
    int trial_bad = 0;
    for (int r = 0; r < NPES; r++) {
      if (r == victim) continue;
      const report_t *rp = &reports[r];
      if (job.status[r] == -1) {
        hangs++;
        trial_bad = 1;
        fprintf(stderr, "probe_kill: trial %d: rank %d hung (killed after %d ms)\n", t, r,
                TRIAL_MS);
      } else if (job.status[r] != 0) {
        trial_bad = 1;
        fprintf(stderr, "probe_kill: trial %d: rank %d exited with %s\n", t, r,
                skv_test_statuses(&job));
      }
      if (rp->wrong_bytes) {
        trial_bad = 1;
        fprintf(stderr, "probe_kill: trial %d: rank %d fetched %llu wrong bytes\n", t, r,
                (unsigned long long)rp->wrong_bytes);
      }
      wrong += rp->wrong_bytes;
      pages += rp->pages_verified;
      bytes += rp->bytes_verified;
      stale += rp->stale;
      published += rp->published;
      started += rp->started;
      errors += rp->errors;
      if (rp->errors && !first_error[0])
        snprintf(first_error, sizeof first_error, "trial %d, rank %d: %s", t, r, rp->first_error);
    }
    printf("probe_kill: trial %2d: rank %d killed at %4llu ms; survivors done in %5llu ms, "
           "%llu+%llu pages verified%s\n",
           t, victim, (unsigned long long)when, (unsigned long long)dt,
           (unsigned long long)reports[(victim + 1) % NPES].pages_verified,
           (unsigned long long)reports[(victim + 2) % NPES].pages_verified,
           trial_bad ? "  FAILED" : "");
    fflush(stdout);
    failed += trial_bad;
  }
  printf("probe_kill: %d trials (rank 0/1/2 killed %d/%d/%d times) in %.1f s, slowest trial %llu "
         "ms: %llu hangs, %llu wrong bytes in %llu pages (%.1f MiB) verified; %llu stale "
         "references, %llu pages published, %llu survivors had made their cache; %s\n",
         trials, victims[0], victims[1], victims[2], (double)(skv__now_ms() - t_all) / 1000.0,
         (unsigned long long)slowest, (unsigned long long)hangs, (unsigned long long)wrong,
         (unsigned long long)pages, (double)bytes / 1048576.0, (unsigned long long)stale,
         (unsigned long long)published, (unsigned long long)started,
         failed ? "FAILED" : "0 hangs, 0 wrong bytes");
  if (errors) /* a peer died during start-up, or an ENOSPC: reported, not failures */
    printf("probe_kill: %llu calls failed cleanly; the first: %s\n", (unsigned long long)errors,
           first_error);
  return failed ? 1 : 0;
}

/* Tests of symkv-bench's workloads (trace, longdoc, multiround): the real binaries run under
 * symkv-run; hit counts are checked against values computed here independently. */
#define _GNU_SOURCE
#include "skv_test.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- running the binaries ------------------------------------------------------------------ */

static char tmpdir[64];

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path);
}

static void cleanup(void) {
  if (tmpdir[0]) nftw(tmpdir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

TestSuite(workload, .timeout = 180, .fini = cleanup);

static void make_tmpdir(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/skv-wl-test-XXXXXX");
  cr_assert(mkdtemp(tmpdir), "mkdtemp: %s", strerror(errno));
}

static const char *bin(const char *name) {
  static char path[4][PATH_MAX];
  static int slot;
  const char *dir = getenv("SKV_TEST_BIN_DIR");
  cr_assert(dir && *dir, "SKV_TEST_BIN_DIR is not set: run this test through ctest");
  char *p = path[slot++ % 4];
  snprintf(p, PATH_MAX, "%s/%s", dir, name);
  if (access(p, X_OK) != 0) cr_skip_test("%s is not there (build symkv-run and symkv-bench)", p);
  return p;
}

static char *slurp(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return strdup("");
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *s = malloc((size_t)n + 1);
  size_t got = fread(s, 1, (size_t)n, f);
  s[got] = '\0';
  fclose(f);
  return s;
}

typedef struct result {
  int status; /* exit status, 128 + signal, -1 on timeout */
  char *out, *err;
} result_t;

/* Run argv (NULL-terminated) with stdout / stderr into files; kill it after timeout_s. */
static result_t run(const char *const *argv, int timeout_s) {
  char out[PATH_MAX], err[PATH_MAX];
  snprintf(out, sizeof out, "%s/stdout", tmpdir);
  snprintf(err, sizeof err, "%s/stderr", tmpdir);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) { /* no cr_* call here: the child must not talk to Criterion's runner */
    int fo = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644),
        fe = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int fi = open("/dev/null", O_RDONLY);
    if (fo < 0 || fe < 0 || fi < 0) _exit(126);
    dup2(fi, 0);
    dup2(fo, 1);
    dup2(fe, 2);
    setpgid(0, 0);
    const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGCHLD};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) signal(sigs[i], SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  if (pid < 0) cr_assert_fail("fork: %s", strerror(errno));
  result_t r = {-1, NULL, NULL};
  int st = 0;
  for (int ms = 0; ms < timeout_s * 1000; ms += 10) {
    pid_t w = waitpid(pid, &st, WNOHANG);
    if (w == pid) {
      r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      break;
    }
    usleep(10000);
  }
  if (r.status == -1) {
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
  }
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

static void result_free(result_t *r) {
  free(r->out);
  free(r->err);
}

static char *write_file(const char *name, const char *text) {
  static char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s", tmpdir, name);
  FILE *f = fopen(path, "w");
  cr_assert(f, "cannot write %s", path);
  fputs(text, f);
  fclose(f);
  return path;
}

/* An integer config entry of the JSON symkv-bench wrote ("key": 123). */
static long long json_int(const char *json, const char *key) {
  char pat[128];
  snprintf(pat, sizeof pat, "\"%s\": ", key);
  const char *p = strstr(json, pat);
  cr_assert(p, "\"%s\" is missing from the JSON:\n%s", key, json);
  return strtoll(p + strlen(pat), NULL, 10);
}

/* The value of the row named `name`. */
static double json_row(const char *json, const char *name) {
  char pat[160];
  snprintf(pat, sizeof pat, "\"name\": \"%s\"", name);
  const char *p = strstr(json, pat);
  cr_assert(p, "row %s is missing from the JSON:\n%s", name, json);
  p = strstr(p, "\"value\": ");
  cr_assert(p, "row %s has no value", name);
  return strtod(p + 9, NULL);
}

/* Run a workload command on `npes` PEs with --json-out; returns the JSON text. */
static char *run_json(int npes, const char *const *args, int timeout_s) {
  char json[PATH_MAX], n[16];
  snprintf(json, sizeof json, "%s/out.json", tmpdir);
  snprintf(n, sizeof n, "%d", npes);
  const char *argv[64];
  int a = 0;
  argv[a++] = bin("symkv-run");
  argv[a++] = "-n";
  argv[a++] = n;
  argv[a++] = "--quiet";
  argv[a++] = "--";
  argv[a++] = bin("bench/symkv-bench");
  for (int i = 0; args[i]; i++) argv[a++] = args[i];
  argv[a++] = "--json-out";
  argv[a++] = json;
  argv[a++] = "--quiet";
  argv[a] = NULL;
  unlink(json);
  result_t r = run(argv, timeout_s);
  cr_assert_eq(r.status, 0, "symkv-bench %s failed (status %d):\n%s\n%s", args[0], r.status, r.out,
               r.err);
  result_free(&r);
  char *text = slurp(json);
  cr_assert(text[0] == '{', "no JSON in %s", json);
  return text;
}

/* ---- an independent computation of exact prefix hits ------------------------------------- */

/* A set of 64-bit ids (open addressing, id + 1 stored so that 0 means empty). */
typedef struct idset {
  uint64_t *v;
  uint64_t mask, n;
} idset_t;

static void set_init(idset_t *s) {
  s->mask = (1u << 10) - 1;
  s->n = 0;
  s->v = calloc(s->mask + 1, sizeof *s->v);
}
static bool set_has(const idset_t *s, uint64_t id) {
  for (uint64_t i = (id * 0x9e3779b97f4a7c15ull) >> 20 & s->mask;; i = (i + 1) & s->mask) {
    if (s->v[i] == 0) return false;
    if (s->v[i] == id + 1) return true;
  }
}
static void set_add(idset_t *s, uint64_t id);
static void set_grow(idset_t *s) {
  idset_t t = {calloc(2 * (s->mask + 1), sizeof *s->v), 2 * (s->mask + 1) - 1, 0};
  for (uint64_t i = 0; i <= s->mask; i++)
    if (s->v[i]) set_add(&t, s->v[i] - 1);
  free(s->v);
  *s = t;
}
static void set_add(idset_t *s, uint64_t id) {
  if (set_has(s, id)) return;
  if (2 * (s->n + 1) > s->mask + 1) set_grow(s);
  uint64_t i = (id * 0x9e3779b97f4a7c15ull) >> 20 & s->mask;
  while (s->v[i]) i = (i + 1) & s->mask;
  s->v[i] = id + 1;
  s->n++;
}

typedef struct exact {
  long long pages, tokens, shared, per_pe, shared_tokens, per_pe_tokens;
} exact_t;

/* Reads "input_length" and "hash_ids" of each line of a Mooncake trace with plain string
 * scanning (not the bench's jansson reader) and counts, for request i on PE i mod npes, the
 * leading pages whose id appeared in any earlier request (shared) or in an earlier request of
 * the same PE (per_pe). A page covers min(512, tokens left) tokens. */
static exact_t exact_hits(const char *path, int npes) {
  exact_t e = {0, 0, 0, 0, 0, 0};
  FILE *f = fopen(path, "r");
  cr_assert(f, "cannot open %s", path);
  idset_t all, *mine = calloc((size_t)npes, sizeof *mine);
  set_init(&all);
  for (int p = 0; p < npes; p++) set_init(&mine[p]);
  char *line = NULL;
  size_t cap = 0;
  uint64_t *ids = malloc(100000 * sizeof *ids);
  long long req = 0;
  while (getline(&line, &cap, f) > 0) {
    const char *il = strstr(line, "\"input_length\":"), *h = strstr(line, "\"hash_ids\":");
    if (!il || !h) continue;
    long long tokens = strtoll(il + 15, NULL, 10);
    const char *p = strchr(h, '[') + 1;
    int n = 0;
    while (*p && *p != ']') {
      char *end;
      ids[n++] = strtoull(p, &end, 10);
      p = end;
      while (*p == ',' || *p == ' ') p++;
    }
    idset_t *own = &mine[req % npes];
    int hs = 0, hp = 0;
    while (hs < n && set_has(&all, ids[hs])) hs++;
    while (hp < n && set_has(own, ids[hp])) hp++;
    e.pages += n;
    e.tokens += tokens;
    e.shared += hs;
    e.per_pe += hp;
    e.shared_tokens += hs * 512 < tokens ? hs * 512 : tokens;
    e.per_pe_tokens += hp * 512 < tokens ? hp * 512 : tokens;
    for (int i = 0; i < n; i++) {
      set_add(&all, ids[i]);
      set_add(own, ids[i]);
    }
    req++;
  }
  free(line);
  free(ids);
  fclose(f);
  for (int p = 0; p < npes; p++) free(mine[p].v);
  free(mine);
  free(all.v);
  return e;
}

static void check_exact(const char *json, exact_t e) {
  cr_expect_eq(json_int(json, "pages"), e.pages);
  cr_expect_eq(json_int(json, "tokens"), e.tokens);
  cr_expect_eq(json_int(json, "block_hits_shared"), e.shared, "shared block hits %lld, exact %lld",
               json_int(json, "block_hits_shared"), e.shared);
  cr_expect_eq(json_int(json, "block_hits_per_pe"), e.per_pe, "per_pe block hits %lld, exact %lld",
               json_int(json, "block_hits_per_pe"), e.per_pe);
  cr_expect_eq(json_int(json, "token_hits_shared"), e.shared_tokens);
  cr_expect_eq(json_int(json, "token_hits_per_pe"), e.per_pe_tokens);
  cr_expect_eq(json_int(json, "block_hits_none"), 0);
  cr_expect(fabs(json_row(json, "block_hit_rate/shared") - (double)e.shared / (double)e.pages) <
            1e-5);
  cr_expect(fabs(json_row(json, "block_hit_rate/per_pe") - (double)e.per_pe / (double)e.pages) <
            1e-5);
  cr_expect(fabs(json_row(json, "token_hit_rate/shared") -
                 (double)e.shared_tokens / (double)e.tokens) < 1e-5);
}

/* Six requests on two PEs (request i on PE i % 2), worked out by hand:
 *   r0 PE0 [1 2 3]    1536 tokens  shared 0          per_pe 0
 *   r1 PE1 [1 2 4]    1500         shared 2 (r0)     per_pe 0
 *   r2 PE0 [1 2 4 5]  2048         shared 3 (r0 r1)  per_pe 2 (r0)
 *   r3 PE1 [6]         100         shared 0          per_pe 0
 *   r4 PE0 [1 7]      1000         shared 1          per_pe 1
 *   r5 PE1 [1 2 3 8]  2000         shared 3          per_pe 2 (r1)
 * pages 17, shared 9, per_pe 5; tokens 8184, shared 4608, per_pe 2560. */
static const char handmade[] =
    "{\"timestamp\": 0, \"input_length\": 1536, \"output_length\": 5, \"hash_ids\": [1, 2, 3]}\n"
    "{\"timestamp\": 10, \"input_length\": 1500, \"output_length\": 5, \"hash_ids\": [1, 2, 4]}\n"
    "\n"
    "{\"timestamp\": 20, \"input_length\": 2048, \"output_length\": 5, \"hash_ids\": [1, 2, 4, "
    "5]}\n"
    "{\"timestamp\": 30, \"input_length\": 100, \"hash_ids\": [6]}\n"
    "{\"timestamp\": 40.5, \"input_length\": 1000, \"output_length\": 1, \"hash_ids\": [1, 7]}\n"
    "{\"timestamp\": 50, \"input_length\": 2000, \"output_length\": 9, \"hash_ids\": [1, 2, 3, "
    "8]}\n";

Test(workload, handmade_trace_exact_hits_on_2_pes) {
  make_tmpdir();
  char *path = strdup(write_file("hand.jsonl", handmade));
  exact_t e = exact_hits(path, 2);
  exact_t hand = {17, 8184, 9, 5, 4608, 2560};
  cr_assert(memcmp(&e, &hand, sizeof e) == 0,
            "the independent routine disagrees with the hand count");
  const char *args[] = {"trace", path, "--model", "tiny", NULL};
  char *json = run_json(2, args, 60);
  check_exact(json, hand);
  cr_expect(strstr(json, "\"exact_block_hits_shared\": 9"),
            "the bench's own exact check is missing");
  free(json);
  /* the same trace on 3 PEs */
  e = exact_hits(path, 3);
  json = run_json(3, args, 60);
  check_exact(json, e);
  free(json);
  free(path);
}

/* --realtime: requests are in flight at the same time. With --prefill-tflops 50 a 1536-token
 * prefill takes 0.25 s (0.125 s at --speed 2); r0 r1 r2 arrive together, r3 r4 0.5 s later,
 * r5 1 s later (at speed 2):
 *   r0 PE0 [1 2 3]      0/0 both modes
 *   r1 PE1 [1 2 3]      realtime 0/0 (r0 still prefilling)        ordered shared 3, per_pe 0
 *   r2 PE0 [1 2 3]      realtime 0/0 (r0 in flight on its own PE) ordered 3/3
 *   r3 PE1 [1 2 3 4]    3/3 (r1 published)
 *   r4 PE0 [1 2 5]      2/2
 *   r5 PE1 [1 2 3 4 6]  4/4 (r3 published page 4)
 * realtime: shared 9, per_pe 9; ordered: shared 15, per_pe 12 (of 21 pages). */
static const char concurrent[] =
    "{\"timestamp\": 0, \"input_length\": 1536, \"hash_ids\": [1, 2, 3]}\n"
    "{\"timestamp\": 0, \"input_length\": 1536, \"hash_ids\": [1, 2, 3]}\n"
    "{\"timestamp\": 0, \"input_length\": 1536, \"hash_ids\": [1, 2, 3]}\n"
    "{\"timestamp\": 1000, \"input_length\": 2048, \"hash_ids\": [1, 2, 3, 4]}\n"
    "{\"timestamp\": 1000, \"input_length\": 1536, \"hash_ids\": [1, 2, 5]}\n"
    "{\"timestamp\": 2000, \"input_length\": 2560, \"hash_ids\": [1, 2, 3, 4, 6]}\n";

Test(workload, realtime_requests_in_flight_concurrently) {
  make_tmpdir();
  char *path = strdup(write_file("concurrent.jsonl", concurrent));
  const char *ordered[] = {"trace", path, "--prefill-tflops", "50", NULL};
  char *json = run_json(2, ordered, 60);
  exact_t e = exact_hits(path, 2);
  exact_t hand = {21, 10752, 15, 12, 15 * 512, 12 * 512};
  cr_assert(memcmp(&e, &hand, sizeof e) == 0,
            "the independent routine disagrees with the hand count");
  check_exact(json, hand);
  free(json);
  const char *rt[] = {"trace", path, "--realtime", "--speed", "2", "--prefill-tflops", "50", NULL};
  json = run_json(2, rt, 60);
  cr_expect(strstr(json, "\"mode\": \"realtime\""));
  cr_expect_eq(json_int(json, "block_hits_shared"), 9,
               "requests in flight together must miss each other's pages");
  cr_expect_eq(json_int(json, "block_hits_per_pe"), 9);
  cr_expect_eq(json_int(json, "exact_block_hits_shared"), 15);
  /* the timestamps span 2 s: at --speed 2 the run takes at least 1 s */
  char *w = strstr(json, "\"wall_s\": ");
  cr_assert(w, "no wall_s");
  double wall = strtod(w + 10, NULL);
  cr_expect(wall >= 1.0 && wall < 30, "wall %.2f s for a 1 s schedule", wall);
  free(json);
  free(path);
}

/* The Mooncake trace: $SKV_TRACE, else bench/data/ or ../shared/data/ beside the source tree
 * (__FILE__ is relative to the build folder the test runs in). */
static const char *mooncake_trace(void) {
  static char path[PATH_MAX];
  const char *env = getenv("SKV_TRACE");
  if (env && *env) {
    snprintf(path, sizeof path, "%s", env);
    cr_assert(access(path, R_OK) == 0, "SKV_TRACE=%s cannot be read", path);
    return path;
  }
  const char *src = __FILE__, *slash = strrchr(src, '/');
  static const char *const where[] = {"../bench/data", "../../shared/data"};
  for (size_t i = 0; i < sizeof where / sizeof where[0]; i++) {
    snprintf(path, sizeof path, "%.*s/%s/mooncake_synthetic_trace.jsonl",
             slash ? (int)(slash - src) : 1, slash ? src : ".", where[i]);
    if (access(path, R_OK) == 0) return path;
  }
  cr_skip_test("the Mooncake trace is not at %s (set SKV_TRACE=FILE)", path);
  return NULL;
}

Test(workload, mooncake_trace_exact_hits_on_4_pes) {
  make_tmpdir();
  const char *path = mooncake_trace();
  exact_t e = exact_hits(path, 4);
  /* the targets */
  cr_assert(fabs((double)e.shared / (double)e.pages - 0.6396) < 5e-5);
  cr_assert(fabs((double)e.per_pe / (double)e.pages - 0.3646) < 5e-5);
  const char *args[] = {"trace", path, NULL};
  char *json = run_json(4, args, 150);
  check_exact(json, e);
  free(json);
}

Test(workload, quarter_capacity_shared_keeps_1_5x_per_pe) {
  make_tmpdir();
  const char *path = mooncake_trace();
  const char *args[] = {"trace", path, "--capacity-fraction", "0.25", NULL};
  char *json = run_json(4, args, 150);
  long long distinct = json_int(json, "distinct_pages"),
            cap = json_int(json, "capacity_pages_per_pe");
  cr_expect_eq(cap, (distinct + 15) / 16, "capacity %lld pages per PE for %lld distinct pages", cap,
               distinct);
  double sh = json_row(json, "block_hit_rate/shared"), pp = json_row(json, "block_hit_rate/per_pe");
  cr_expect(sh >= 1.5 * pp, "shared %.4f, per_pe %.4f", sh, pp);
  cr_expect(json_int(json, "evicted") > 0, "a quarter of the pages must evict");
  cr_expect(sh < 0.6396 && pp < 0.3646, "capacity limits must lower the hit rates");
  free(json);
  /* the other reading: each PE holds a quarter of the distinct pages (the node all of them) */
  char per_pe_cap[32];
  snprintf(per_pe_cap, sizeof per_pe_cap, "%lld", (distinct + 3) / 4);
  const char *args2[] = {"trace", path, "--capacity-pages", per_pe_cap, NULL};
  json = run_json(4, args2, 150);
  cr_expect_eq(json_int(json, "capacity_pages_per_pe"), (distinct + 3) / 4);
  sh = json_row(json, "block_hit_rate/shared");
  pp = json_row(json, "block_hit_rate/per_pe");
  cr_expect(sh >= 1.5 * pp, "shared %.4f, per_pe %.4f", sh, pp);
  cr_expect(pp < 0.3646, "a quarter of the pages per PE must lower per_pe's hit rate");
  free(json);
}

Test(workload, longdoc_exact_hits) {
  make_tmpdir();
  /* 3 documents of 4 pages, each queried 3 times in a row (tile) on 2 PEs: requests d0 d0 d0 d1
   * d1 d1 d2 d2 d2 on PEs 0 1 0 1 0 1 0 1 0. shared: all but each first query hit 4 pages = 24
   * of 36; per_pe: only each third query finds the first one's pages on its PE = 12. */
  const char *tile[] = {"longdoc", "--docs",  "3",    "--doc-tokens",      "2048", "--repeats",
                        "3",       "--order", "tile", "--question-tokens", "0",    NULL};
  char *json = run_json(2, tile, 60);
  cr_expect_eq(json_int(json, "pages"), 36);
  cr_expect_eq(json_int(json, "block_hits_shared"), 24);
  cr_expect_eq(json_int(json, "block_hits_per_pe"), 12);
  free(json);
  /* interleave d0 d1 d2 d0 d1 d2 on PEs 0 1 0 1 0 1: per_pe never meets a document twice */
  const char *inter[] = {"longdoc",   "--docs", "3",       "--doc-tokens", "2048",
                         "--repeats", "2",      "--order", "interleave",   "--question-tokens",
                         "0",         NULL};
  json = run_json(2, inter, 60);
  cr_expect_eq(json_int(json, "block_hits_shared"), 12);
  cr_expect_eq(json_int(json, "block_hits_per_pe"), 0);
  free(json);
}

Test(workload, multiround_exact_hits) {
  make_tmpdir();
  /* 3 users x 3 rounds on 2 PEs, everything one page (512 tokens) or two (system prompt).
   * Round r of user u (request 3r + u, PE (3r + u) % 2) is S S m0 a0 .. m_r: 3 + 2r pages,
   * 45 in all. Pages are published from prompts only, so a_{r-1} is first cached by round r.
   * shared: round 0 finds S S except the very first request (0 + 2 + 2), round r >= 1 finds
   * S S m0 a0 .. m_{r-1} (3 x 3, 3 x 5): 28. per_pe (worked out request by request): PE 0 gets
   * 0 + 2 + 2 + 3 + 3 and PE 1 0 + 2 + 2 + 3: 17. */
  const char *args[] = {"multiround", "--users",         "3",    "--rounds",
                        "3",          "--system-tokens", "1024", "--message-tokens",
                        "512",        "--answer-tokens", "512",  NULL};
  char *json = run_json(2, args, 60);
  cr_expect_eq(json_int(json, "pages"), 45);
  cr_expect_eq(json_int(json, "block_hits_shared"), 28);
  cr_expect_eq(json_int(json, "block_hits_per_pe"), 17);
  cr_expect_eq(json_int(json, "token_hits_shared"), 28 * 512);
  free(json);
}

/* ---- errors --------------------------------------------------------------------------------- */

static result_t run_alone(const char *const *args) {
  const char *argv[32];
  int a = 0;
  argv[a++] = bin("bench/symkv-bench");
  for (int i = 0; args[i]; i++) argv[a++] = args[i];
  argv[a] = NULL;
  return run(argv, 60);
}

static void expect_error(const char *name, const char *text, const char *want1, const char *want2) {
  char *path = strdup(write_file(name, text));
  const char *args[] = {"trace", path, NULL};
  result_t r = run_alone(args);
  cr_expect_neq(r.status, 0, "%s was accepted", name);
  char where[PATH_MAX + 16];
  snprintf(where, sizeof where, "%s%s", path, want1);
  cr_expect(strstr(r.err, where), "stderr does not name %s:\n%s", where, r.err);
  if (want2) cr_expect(strstr(r.err, want2), "stderr does not say '%s':\n%s", want2, r.err);
  result_free(&r);
  free(path);
}

Test(workload, malformed_traces_name_file_and_line) {
  make_tmpdir();
  expect_error("broken.jsonl",
               "{\"timestamp\": 0, \"input_length\": 10, \"hash_ids\": [1]}\n"
               "{\"timestamp\": 1, \"input_length\": 10, \"hash_ids\": [2]}\n"
               "{\"timestamp\": 2, \"input_length\": 10, \"hash_ids\": [3, \n",
               ":3:", "malformed JSON");
  expect_error("missing.jsonl",
               "{\"timestamp\": 0, \"input_length\": 10, \"hash_ids\": [1]}\n"
               "{\"timestamp\": 1, \"input_length\": 10}\n",
               ":2:", "\"hash_ids\" is missing");
  expect_error("notint.jsonl",
               "{\"timestamp\": 0, \"input_length\": 700, \"hash_ids\": [1, \"x\"]}\n",
               ":1:", "hash_ids[1]");
  expect_error("toomany.jsonl", "{\"timestamp\": 0, \"input_length\": 10, \"hash_ids\": [1, 2]}\n",
               ":1:", "2 hash_ids but input_length 10");
  expect_error("notobject.jsonl", "[1, 2, 3]\n", ":1:", "JSON object");
  expect_error("empty.jsonl", "", ": no requests", "empty");
  expect_error("blank.jsonl", "\n  \n", ": no requests", "empty");
}

Test(workload, bad_options_are_refused) {
  make_tmpdir();
  char *path = strdup(write_file("hand.jsonl", handmade));
  const char *a1[] = {"trace", path, "--capacity", "10", NULL};
  result_t r = run_alone(a1);
  cr_expect_eq(r.status, 2);
  cr_expect(strstr(r.err, "unknown option '--capacity'"), "%s", r.err);
  result_free(&r);
  const char *a2[] = {"trace", path, "--model", "gpt-9", NULL};
  r = run_alone(a2);
  cr_expect_eq(r.status, 2);
  cr_expect(strstr(r.err, "unknown --model gpt-9"), "%s", r.err);
  result_free(&r);
  const char *a3[] = {"trace", "/nonexistent/trace.jsonl", NULL};
  r = run_alone(a3);
  cr_expect_neq(r.status, 0);
  cr_expect(strstr(r.err, "cannot open the trace /nonexistent/trace.jsonl"), "%s", r.err);
  result_free(&r);
  free(path);
}

Test(workload, plot_without_matplotlib_fails_early_and_says_so) {
  make_tmpdir();
  /* a matplotlib that cannot be imported, first on python3's path */
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s/matplotlib", tmpdir);
  cr_assert(mkdir(dir, 0700) == 0);
  write_file("matplotlib/__init__.py", "raise ImportError('hidden by test_workload')\n");
  cr_assert(setenv("PYTHONPATH", tmpdir, 1) == 0);
  char *path = strdup(write_file("hand.jsonl", handmade));
  char png[PATH_MAX];
  snprintf(png, sizeof png, "%s/hits.png", tmpdir);
  const char *args[] = {"trace", path, "--plot", png, NULL};
  result_t r = run_alone(args);
  cr_expect_neq(r.status, 0, "--plot without matplotlib was accepted");
  cr_expect(strstr(r.err, "--plot needs python3 with matplotlib"), "%s", r.err);
  cr_expect(!strstr(r.out, "policy"), "the run went ahead before the check:\n%s", r.out);
  cr_expect(access(png, F_OK) != 0);
  result_free(&r);
  free(path);
}

Test(workload, plot_draws_a_png) {
  make_tmpdir();
  if (system("python3 -c 'import matplotlib' >/dev/null 2>&1") != 0)
    cr_skip_test("python3 with matplotlib is not installed (tests/deps.sh installs it)");
  char *path = strdup(write_file("hand.jsonl", handmade));
  char png[PATH_MAX], csv[PATH_MAX];
  snprintf(png, sizeof png, "%s/hits.png", tmpdir);
  snprintf(csv, sizeof csv, "%s/hits.csv", tmpdir);
  const char *args[] = {"trace", path, "--plot", png, NULL};
  char *json = run_json(2, args, 120);
  free(json);
  char *p = slurp(png);
  cr_expect(memcmp(p, "\x89PNG", 4) == 0, "%s is not a PNG", png);
  free(p);
  char *c = slurp(csv);
  cr_expect(strncmp(c, "request,pe,", 11) == 0, "%s has no header", csv);
  int lines = 0;
  for (char *q = c; *q; q++) lines += *q == '\n';
  cr_expect_eq(lines, 7, "header and 6 requests expected, got %d lines", lines);
  free(c);
  free(path);
}

/* micro's JSON records the node's shmem_enabled (the selected value of the sysfs file), which
 * decides whether the host heap of its fetch rows is on huge pages. */
Test(workload, micro_json_records_the_nodes_huge_page_setting) {
  make_tmpdir();
  char want[160] = "\"shmem_enabled\": \"unknown\"";
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
  if (f) {
    char line[128] = "";
    const char *l = fgets(line, sizeof line, f) ? strchr(line, '[') : NULL;
    const char *e = l ? strchr(l, ']') : NULL;
    if (e) snprintf(want, sizeof want, "\"shmem_enabled\": \"%.*s\"", (int)(e - l - 1), l + 1);
    fclose(f);
  }
  const char *args[] = {"micro", "--seconds", "0.05", "--reps", "1", "--batch-bytes", "1M", NULL};
  char *json = run_json(2, args, 120);
  cr_expect(strstr(json, want), "no %s in:\n%s", want, json);
  free(json);
}

/* ---- the command line, progress, tables (issue 24) ----------------------------------------- */

static int count(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += strlen(needle)) n++;
  return n;
}

/* Run argv under symkv-run on `npes` PEs (rank 0's lines plain), with a timeout. */
static result_t run_pes(int npes, const char *const *args, int timeout_s) {
  char n[16];
  snprintf(n, sizeof n, "%d", npes);
  const char *argv[64];
  int a = 0;
  argv[a++] = bin("symkv-run");
  argv[a++] = "-n";
  argv[a++] = n;
  argv[a++] = "--prefix";
  argv[a++] = "others";
  argv[a++] = "--quiet";
  argv[a++] = "--";
  argv[a++] = bin("bench/symkv-bench");
  for (int i = 0; args[i]; i++) argv[a++] = args[i];
  argv[a] = NULL;
  return run(argv, timeout_s);
}

Test(workload, every_command_has_help) {
  make_tmpdir();
  static const char *const cmds[] = {"heap",    "micro",      "fetch",     "trace",
                                     "longdoc", "multiround", "allreduce", NULL};
  for (int i = 0; cmds[i]; i++) {
    for (int form = 0; form < 2; form++) {
      const char *args[] = {cmds[i], form ? "-h" : "--help", NULL};
      result_t r = run_alone(args);
      char want[64];
      snprintf(want, sizeof want, "usage: symkv-bench %s", cmds[i]);
      cr_expect_eq(r.status, 0, "%s %s exited %d:\n%s", cmds[i], args[1], r.status, r.err);
      cr_expect(strstr(r.out, want) && strstr(r.out, "--json-out FILE"), "%s --help:\n%s", cmds[i],
                r.out);
      result_free(&r);
    }
  }
  const char *top[] = {"--help", NULL};
  result_t r = run_alone(top);
  cr_expect_eq(r.status, 0);
  for (int i = 0; cmds[i]; i++) cr_expect(strstr(r.out, cmds[i]), "%s not listed", cmds[i]);
  result_free(&r);
}

/* Unknown options and bad values fail with a clear message and exit 2, on every command, before
 * anything runs (the old parsers ignored --bogus, --byts 1M and took --help for a run). */
Test(workload, bad_options_exit_2_with_a_message) {
  make_tmpdir();
  char *path = strdup(write_file("hand.jsonl", handmade));
  static const struct {
    const char *args[6];
    const char *want;
  } cases[] = {
      {{"heap", "--bogus"}, "unknown option '--bogus'"},
      {{"heap", "--byts", "1M"}, "unknown option '--byts'"},
      {{"heap", "--byt", "1M"}, "did you mean --bytes?"},
      {{"heap", "--bytes", "1X"}, "--bytes 1X: want an integer"},
      {{"heap", "--bytes"}, "--bytes needs a value"},
      {{"heap", "--reps", "0"}, "--reps 0: want an integer in 1..64"},
      {{"heap", "--quiet=1"}, "--quiet takes no value"},
      {{"heap", "stray"}, "unexpected argument 'stray'"},
      {{"micro", "--seconds", "soon"}, "--seconds soon: want a number"},
      {{"fetch", "--layout", "diagonal"}, "--layout diagonal: want one of nhd,hnd,flashinfer"},
      {{"fetch", "--page-sizes", "64K,x"}, "'x' is not an integer"},
      {{"allreduce", "--dtype", "int8"}, "want one of bf16,fp16,fp32"},
      {{"longdoc", "--order", "sideways"}, "want one of random,tile,interleave"},
      {{"multiround", "--users", "-3"}, "--users -3: want an integer"},
      {{"trace", "PATH", "--speed", "0"}, "--speed 0: want a number"},
      {{"trace", "PATH", "--ordered", "--realtime"}, "exclude each other"},
      {{"trace"}, "give the trace file"},
      {{"nosuch"}, "unknown command 'nosuch'"},
  };
  for (size_t i = 0; i < SKV_ARRAY_LEN(cases); i++) {
    const char *args[8];
    int n = 0;
    for (int k = 0; k < 6 && cases[i].args[k]; k++)
      args[n++] = strcmp(cases[i].args[k], "PATH") == 0 ? path : cases[i].args[k];
    args[n] = NULL;
    result_t r = run_alone(args);
    cr_expect_eq(r.status, 2, "case %zu (%s %s) exited %d:\n%s", i, args[0], args[1] ? args[1] : "",
                 r.status, r.err);
    cr_expect(strstr(r.err, cases[i].want), "case %zu: no '%s' in:\n%s", i, cases[i].want, r.err);
    cr_expect(!strstr(r.out, "name"), "case %zu ran:\n%s", i, r.out);
    result_free(&r);
  }
  /* under symkv-run every rank exits 2, the message comes once (rank 0's) */
  const char *bad[] = {"heap", "--bogus", NULL};
  result_t r = run_pes(3, bad, 30);
  cr_expect_eq(r.status, 2, "%s", r.err);
  cr_expect_eq(count(r.err, "unknown option '--bogus'"), 1, "%s", r.err);
  result_free(&r);
  free(path);
}

/* With stderr not a terminal (a file here), rank 0 prints a progress line every
 * --progress-every seconds; with --quiet, none. */
Test(workload, progress_lines_when_not_on_a_terminal) {
  make_tmpdir();
  char *path = strdup(write_file("concurrent.jsonl", concurrent));
  const char *args[] = {
      "trace", path, "--realtime", "--speed", "1", "--prefill-tflops", "50", "--progress-every",
      "0.3",   NULL};
  result_t r = run_pes(2, args, 60);
  cr_assert_eq(r.status, 0, "%s", r.err);
  int lines = count(r.err, "symkv-bench trace: trace ");
  cr_expect(lines >= 2, "%d progress lines in a 2 s run:\n%s", lines, r.err);
  cr_expect(strstr(r.err, " requests (") && strstr(r.err, "block hits: shared"), "%s", r.err);
  cr_expect(!strstr(r.err, "\r"), "a bar (\\r) went into a file:\n%s", r.err);
  cr_expect(!strstr(r.err, "[1] symkv-bench trace: trace"), "rank 1 printed progress:\n%s", r.err);
  result_free(&r);
  const char *quiet[] = {"trace",      path,
                         "--realtime", "--speed",
                         "1",          "--prefill-tflops",
                         "50",         "--progress-every",
                         "0.3",        "--quiet",
                         NULL};
  r = run_pes(2, quiet, 60);
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_expect_eq(count(r.err, "symkv-bench trace: trace "), 0, "%s", r.err);
  result_free(&r);
  free(path);
}

/* Whether a line of `text` has the words of `words`, blanks apart however wide. */
static bool has_row(const char *text, const char *words) {
  for (const char *l = text; *l;) {
    const char *e = strchr(l, '\n');
    size_t len = e ? (size_t)(e - l) : strlen(l);
    char a[512], b[512];
    size_t na = 0, nb = 0;
    for (size_t i = 0; i < len && na + 1 < sizeof a; i++)
      if (l[i] != ' ' || (na && a[na - 1] != ' ')) a[na++] = l[i];
    while (na && a[na - 1] == ' ') na--;
    for (const char *w = words; *w && nb + 1 < sizeof b; w++) b[nb++] = *w;
    if (na == nb && memcmp(a, b, na) == 0) return true;
    l = e ? e + 1 : l + len;
  }
  return false;
}

/* One table format: unique headings, a `better` column, lines that fit 80 columns, rank 0's
 * lines without "[0] " under symkv-run --prefix others. */
Test(workload, tables_fit_80_columns_and_say_which_way_is_better) {
  make_tmpdir();
  char *path = strdup(write_file("hand.jsonl", handmade));
  const char *args[] = {"trace", path, NULL};
  result_t r = run_pes(2, args, 60);
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_expect(!strstr(r.out, "[0] "), "rank 0's lines are prefixed:\n%s", r.out);
  cr_expect(has_row(r.out, "measure better none per_pe shared"), "%s", r.out);
  cr_expect(has_row(r.out, "name value unit better baseline ratio vs"), "%s", r.out);
  cr_expect(has_row(r.out, "block_hit_rate/shared 0.5294 frac higher 0.2941 1.800 b"), "%s", r.out);
  cr_expect(has_row(r.out, "b per_pe (each PE's own cache)"), "%s", r.out);
  int longest = 0;
  for (char *l = r.out; *l;) {
    char *e = strchr(l, '\n');
    int len = e ? (int)(e - l) : (int)strlen(l);
    longest = len > longest ? len : longest;
    l = e ? e + 1 : l + len;
  }
  cr_expect(longest <= 80, "a line of %d characters:\n%s", longest, r.out);
  result_free(&r);
  free(path);
}

/* --plot that cannot draw: the reason once, from rank 0, not from every PE. */
Test(workload, plot_error_is_printed_once) {
  make_tmpdir();
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s/matplotlib", tmpdir);
  cr_assert(mkdir(dir, 0700) == 0);
  write_file("matplotlib/__init__.py", "raise ImportError('hidden by test_workload')\n");
  cr_assert(setenv("PYTHONPATH", tmpdir, 1) == 0);
  char *path = strdup(write_file("hand.jsonl", handmade));
  char png[PATH_MAX];
  snprintf(png, sizeof png, "%s/hits.png", tmpdir);
  const char *args[] = {"trace", path, "--plot", png, NULL};
  result_t r = run_pes(3, args, 60);
  cr_expect_neq(r.status, 0);
  cr_expect_eq(count(r.err, "--plot needs python3 with matplotlib"), 1, "%s", r.err);
  cr_expect_eq(count(r.err, "failed"), 1, "%s", r.err); /* symkv-bench trace failed, once */
  result_free(&r);
  free(path);
}

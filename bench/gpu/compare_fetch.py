#!/usr/bin/env python3
"""Compare `symkv-bench fetch --quick` of two builds on one GPU host, alternating A and B runs,
and print each row's value per run, its spread within a build, and B / A.

    bench/gpu/compare_fetch.py OLD_BUILD NEW_BUILD [--runs 2] [--out DIR]

A row of B is worse than A beyond the noise when B / A (higher-better rows; A / B for
lower-better ones) is below 1 - max(spread of A, spread of B), the spread being each build's
largest relative difference between its own runs."""
import argparse
import json
import os
import subprocess
import sys


def run(build, out, tag, timeout):
    path = os.path.join(out, "fetch_%s.json" % tag)
    cmd = [os.path.join(build, "symkv-run"), "-n", "2", "--timeout", str(timeout - 10), "--",
           os.path.join(build, "bench", "symkv-bench"), "fetch", "--quick", "--json-out", path]
    with open(os.path.join(out, "fetch_%s.log" % tag), "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if rc != 0 or not os.path.exists(path):
        print("%s: rc=%d (see fetch_%s.log)" % (tag, rc, tag))
        return None
    with open(path) as f:
        return {r["name"]: r for r in json.load(f)["rows"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/skv-out"))
    ap.add_argument("--timeout", type=int, default=200)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = {"A": [], "B": []}
    for i in range(args.runs):
        for k, build in (("A", args.a), ("B", args.b)):
            r = run(build, args.out, "%s%d" % (k, i), args.timeout)
            if r:
                res[k].append(r)
    if not res["A"] or not res["B"]:
        sys.exit("compare_fetch: a build produced no rows")
    names = [n for n in res["A"][0] if all(n in r for r in res["A"] + res["B"])]
    worse = 0
    print("%-44s %-6s %-22s %-22s %7s %7s" % ("row", "unit", "A runs", "B runs", "B/A",
                                               "noise"))
    out = []
    for n in names:
        unit = res["A"][0][n].get("unit", "")
        higher = res["A"][0][n].get("better", "higher") == "higher"
        va = [r[n]["value"] for r in res["A"]]
        vb = [r[n]["value"] for r in res["B"]]
        if min(va + vb) <= 0:
            continue
        spread = max((max(v) - min(v)) / min(v) for v in (va, vb))
        ma, mb = sorted(va)[len(va) // 2], sorted(vb)[len(vb) // 2]
        ratio = mb / ma if higher else ma / mb  # > 1: B better
        flag = ratio < 1 - spread
        worse += flag
        out.append({"row": n, "unit": unit, "a": va, "b": vb, "b_over_a": ratio,
                    "noise": spread, "worse_beyond_noise": flag})
        print("%-44s %-6s %-22s %-22s %7.3f %7.3f%s" % (
            n[:44], unit, ",".join("%.4g" % v for v in va), ",".join("%.4g" % v for v in vb),
            ratio, spread, "  WORSE" if flag else ""))
    with open(os.path.join(args.out, "compare_fetch.json"), "w") as f:
        json.dump({"a": args.a, "b": args.b, "runs": args.runs, "rows": out}, f, indent=1)
    print("compare_fetch: %d rows, %d worse than A beyond the noise" % (len(out), worse))


if __name__ == "__main__":
    main()

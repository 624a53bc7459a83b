#!/usr/bin/env python3
"""Draws what symkv-bench trace/longdoc/multiround --plot FILE.png wrote to FILE.csv: the block
hit rate (cumulative, and over a sliding window) and the modelled TTFT (sliding median) of each
policy over the run. Needs matplotlib (python3 -m pip install matplotlib)."""
import argparse
import csv
import statistics
import sys

POLICIES = [("none", "#8c8c8c"), ("per_pe", "#e6842a"), ("shared", "#1f6fb4")]


def sliding(values, window, fn):
    out = []
    half = window // 2
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append(fn(values[lo:hi]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--csv", help="per-request data written by symkv-bench --plot")
    ap.add_argument("--out", help="PNG to write")
    ap.add_argument("--check", action="store_true", help="only check that matplotlib can be imported")
    ap.add_argument("--title", default="symkv-bench workload")
    ap.add_argument("--window", type=int, default=0, help="sliding window in requests (0: about 1/40 of the run)")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        sys.exit(f"plot_workload.py: matplotlib is missing ({e}): python3 -m pip install matplotlib "
                 "(or apt-get install python3-matplotlib)")
    if a.check:
        return
    if not a.csv or not a.out:
        ap.error("--csv and --out are required")

    with open(a.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"plot_workload.py: {a.csv} has no requests")
    rows.sort(key=lambda r: int(r["request"]))
    x = [int(r["request"]) for r in rows]
    pages = [int(r["pages"]) for r in rows]
    window = a.window or max(5, len(rows) // 40)

    fig, (ax_hit, ax_ttft) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    for pol, color in POLICIES:
        hits = [int(r["hits_" + pol]) for r in rows]
        cum_h = cum_p = 0
        cum = []
        for h, p in zip(hits, pages):
            cum_h += h
            cum_p += p
            cum.append(cum_h / cum_p if cum_p else 0.0)
        win = sliding(list(zip(hits, pages)), window,
                      lambda s: sum(h for h, _ in s) / max(1, sum(p for _, p in s)))
        ax_hit.plot(x, cum, color=color, lw=2, label=f"{pol} (cumulative, final {cum[-1]:.4f})")
        ax_hit.plot(x, win, color=color, lw=0.8, alpha=0.45)
        ttft = [float(r["ttft_ms_" + pol]) for r in rows]
        med = sliding(ttft, window, statistics.median)
        p50 = statistics.median(ttft)
        ax_ttft.plot(x, med, color=color, lw=1.6, label=f"{pol} (p50 {p50:.1f} ms)")
    ax_hit.set_ylabel("block hit rate")
    ax_hit.set_ylim(0, 1)
    ax_hit.grid(alpha=0.3)
    ax_hit.legend(loc="lower right", fontsize=9)
    ax_hit.set_title(a.title + f"\n(thin lines: hit rate over a sliding window of {window} requests)", fontsize=10)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("modelled TTFT (ms), sliding median")
    ax_ttft.set_xlabel("request")
    ax_ttft.grid(alpha=0.3, which="both")
    ax_ttft.legend(loc="upper right", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()

"""tests/run.sh's summary: each Criterion suite's counts (from the JSON report each one writes,
tests/CMakeLists.txt), and every skip with its reason, GPU suites or not; then the Python line.
Usage: python3 tests/summarize.py BUILD_DIR SANITIZERS PYTEST_SUMMARY"""
import collections
import glob
import json
import os
import re
import sys


def main():
    build, san, py = sys.argv[1], sys.argv[2], sys.argv[3]
    ctest = open(os.path.join(build, "ctest.log"), errors="replace").read()
    # " 1/14 Test  #1: test_bootstrap ...........   Passed   24.24 sec"
    runs = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(
        r"Test +#\d+: (\S+) \.+\** *([A-Za-z* ]+?) +([\d.]+) sec", ctest)}
    print("== Criterion suites (%s%s) ==" % (build, ", sanitizers " + san if san else ""))
    print("%-16s %6s %6s %7s %8s  %s" % ("suite", "passed", "failed", "skipped", "time", "note"))
    skips = collections.Counter()
    bad = False
    for name in sorted(runs):
        status, secs = runs[name]
        path = os.path.join(build, "criterion", name + ".json")
        if not name.startswith("test_"):  # a script (install_consumer): ctest's verdict
            ok = status.strip() == "Passed"
            bad = bad or not ok
            print("%-16s %6s %6s %7s %6s s  %s" % (name, 1 if ok else 0, 0 if ok else 1, 0, secs,
                                                   "a script" + ("" if ok else "; " + status)))
            continue
        if not os.path.exists(path):
            print("%-16s %6s %6s %7s %6s s  %s: no report (crashed or timed out?)"
                  % (name, "-", "-", "-", secs, status))
            bad = True
            continue
        r = json.load(open(path))
        n = {k: r.get(k, 0) for k in ("passed", "failed", "errored", "skipped")}
        failed = n["failed"] + n["errored"]
        note = ""
        if n["passed"] + failed == 0:
            note = "ran 0 tests" + (" (all %d skipped)" % n["skipped"] if n["skipped"] else "")
        if status.strip() != "Passed":
            note = (note + "; " if note else "") + "ctest: " + status.strip()
            bad = True
        print("%-16s %6d %6d %7d %6s s  %s" % (name, n["passed"], failed, n["skipped"], secs, note))
        for s in r.get("test_suites", []):
            for t in s.get("tests", []):
                if t.get("status") == "SKIPPED":
                    why = " ".join(t.get("messages") or ["(no reason given)"])
                    skips["%s: %s" % (name, why)] += 1
    if skips:
        print("== Skipped tests (count, suite: reason) ==")
        for k, c in sorted(skips.items()):
            print("%4d %s" % (c, k))
    if py:
        print("== Python tests: %s ==" % py)
    elif san:
        print("== Python tests: not run under sanitizers (the plain run runs them) ==")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where a run stalled, from an Nsight Systems SQLite export: the GPU's idle gaps, its longest
kernels, and the host's longest CUDA API calls, each with its time from the first kernel.

    nsys profile -o run --trace=cuda --force-overwrite=true <command>
    nsys export --type=sqlite --output=run.sqlite run.nsys-rep
    python3 bench/tools/nsys_stalls.py run.sqlite [--gap_ms 1] [--top 12]

A decode step that the host or a first-time kernel load held up shows as a GPU gap with a long
API call at the same time (cudaLaunchKernel while a module loads, a synchronize); a step that was
itself slow shows as long kernels with no gap.
"""
import argparse
import sqlite3


def names(db):
    return {i: s for i, s in db.execute("SELECT id, value FROM StringIds")}


def table_exists(db, name):
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?",
                      (name,)).fetchone() is not None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sqlite")
    ap.add_argument("--gap_ms", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    db = sqlite3.connect(a.sqlite)
    s = names(db)
    kernels = db.execute(
        "SELECT start, end, shortName FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY start").fetchall()
    if not kernels:
        print("no kernels in the trace")
        return
    t0 = kernels[0][0]
    ms = lambda t: (t - t0) / 1e6

    # GPU idle: from the latest end so far to the next kernel's start.
    gaps, last_end, last_name = [], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start - last_end > a.gap_ms * 1e6:
            gaps.append((start - last_end, last_end, s.get(last_name, "?"), s.get(name, "?")))
        if end > last_end:
            last_end, last_name = end, name
    print(f"{len(kernels)} kernels over {ms(last_end):.1f} ms; "
          f"{len(gaps)} GPU gaps over {a.gap_ms} ms")
    for d, at, before, after in sorted(gaps, reverse=True)[:a.top]:
        print(f"  gap {d / 1e6:8.2f} ms at {ms(at):9.2f} ms: after {before[:60]}, "
              f"before {after[:60]}")

    print("longest kernels:")
    for start, end, name in sorted(kernels, key=lambda k: k[0] - k[1])[:a.top]:
        print(f"  {(end - start) / 1e6:8.2f} ms at {ms(start):9.2f} ms: {s.get(name, '?')[:80]}")

    if table_exists(db, "CUPTI_ACTIVITY_KIND_RUNTIME"):
        calls = db.execute("SELECT start, end, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME "
                           "ORDER BY start - end LIMIT ?", (4 * a.top,)).fetchall()
        print("longest CUDA API calls:")
        for start, end, name in calls[:4 * a.top]:
            print(f"  {(end - start) / 1e6:8.2f} ms at {ms(start):9.2f} ms: {s.get(name, '?')[:80]}")


if __name__ == "__main__":
    main()

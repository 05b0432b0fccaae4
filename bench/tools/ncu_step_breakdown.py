#!/usr/bin/env python3
"""Per-kernel GPU time of a decode step, from an Nsight Compute CSV.

Run tailserve-bench for one shape and batch under ncu with graph nodes profiled one by one, then
summarise: kernels are grouped by name, each group's total is divided by the number of profiled
decode steps (the count of the step's last kernel, postprocess). The sum is kernel time alone,
launch gaps excluded, so (graph step time - sum) is what the graph's node-to-node overhead costs.

  ncu --graph-profiling node --clock-control none --cache-control none \\
      --metrics gpu__time_duration.sum --csv --page raw \\
      tailserve-bench --shapes 1b --batches 1 --new_tokens 16 > ncu.csv
  python3 bench/tools/ncu_step_breakdown.py ncu.csv [--skip_steps N]

--skip_steps N leaves out every kernel up to and including the N-th PostprocessKernel (the
prefill's sampling pass ends with one too, so N = 2 drops the prefill and the first decode step),
so the table is decode steps alone.
"""
import collections
import csv
import re
import sys


def main():
    args = sys.argv[1:]
    skip = 0
    if "--skip_steps" in args:
        i = args.index("--skip_steps")
        skip = int(args[i + 1])
        del args[i:i + 2]
    rows = list(csv.reader(open(args[0], errors="replace")))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r and "gpu__time_duration.sum" in r)
    cols = rows[head]
    name_i, t_i = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
    unit = rows[head + 1][t_i] if len(rows) > head + 1 else ""
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1e-3)
    total = collections.defaultdict(float)
    count = collections.Counter()
    seen = 0  # PostprocessKernels so far
    for r in rows[head + 2:]:
        if len(r) <= max(name_i, t_i):
            continue
        try:
            us = float(r[t_i].replace(",", "")) * scale
        except ValueError:
            continue
        # "void ts::kernels::(anonymous namespace)::GemvKernel(...)" -> "GemvKernel"
        m = re.search(r"(\w+)\s*(?:<[^()]*>)?\s*\(", r[name_i].replace("(anonymous namespace)", ""))
        name = m.group(1) if m else r[name_i][:40]
        if seen < skip:
            seen += name == "PostprocessKernel"
            continue
        total[name] += us
        count[name] += 1
    steps = max(1, count.get("PostprocessKernel", 1))
    print(f"{steps} decode steps profiled (PostprocessKernel count); us per step:")
    s = 0.0
    for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"  {us / steps:9.1f}  x{count[name] / steps:6.1f}  {name}")
        s += us / steps
    print(f"  {s:9.1f}  total kernel time per step (includes prefill kernels / steps)")


if __name__ == "__main__":
    main()

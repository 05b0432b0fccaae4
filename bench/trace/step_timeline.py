#!/usr/bin/env python3
"""One decode step's timeline from libts_kernel_trace.so's CSV (bench/trace/README.md).

Steps are cut at each --marker kernel (PrepareDecodeKernel starts every decode step); the last
--steps steps with the most common kernel count are averaged. Per op (a kernel name and its grid),
summed over its launches in one step:
  dur   its own time, first CTA's start to last CTA's end (under PDL it starts early and waits);
  path  its increment of the step's critical path: its end minus the latest end before it. The
        increments add up to the step's span, so this column is where the step's time goes;
  gap   its start minus the previous kernel's end, per launch (negative: it overlapped, PDL).

With --layers L, an op launched k L times a step (k > 1) is split by its place in the layer:
the i-th launch is op #(i mod k), so two projections of one grid (8B's qkv and gate_up at m <= 8)
stay apart.

With --with NAME only the steps holding a NAME kernel count (PrefillAttentionKernel: the device
loop's mixed steps, which decode the streams and prefill prompt rows in the same GEMMs).

  step_timeline.py trace.csv [--steps 20] [--marker PrepareDecodeKernel] [--layers 0] [--with NAME]"""
import argparse
import collections
import csv
import re
import statistics


def short_name(name):
    """The kernel's identifier: the first name part ending in Kernel or kernel, from a mangled
    (_Z...: length-prefixed parts) or a demangled name; other names (cuBLASLt's) stay whole."""
    if name.startswith('_Z'):
        parts, i = [], 2
        while i < len(name):
            m = re.match(r'(\d+)', name[i:])
            if not m:
                i += 1
                continue
            n = int(m.group(1))
            start = i + len(m.group(1))
            parts.append(name[start:start + n])
            i = start + n
    else:
        parts = re.findall(r'[A-Za-z_][A-Za-z0-9_]*', name)
    for p in parts:
        if p.endswith(('Kernel', 'kernel')):
            return p
    return name[:48]


def read_trace(path):
    """[(start_ns, end_ns, name, grid)] sorted by start."""
    out = []
    with open(path) as f:
        for r in csv.DictReader(f):
            grid = f"{r['grid_x']}x{r['grid_y']}x{r['grid_z']}"
            if r['cluster_y'] not in ('0', '1'):
                grid += f" c{r['cluster_y']}"
            out.append((int(r['start_ns']), int(r['end_ns']), short_name(r['name']), grid))
    return sorted(out, key=lambda k: k[0])


def summarize(kernels, steps=20, marker='PrepareDecodeKernel', layers=0, having=None):
    """(number of steps, kernels per step, median span us, [(name, grid, n, dur, path, gap)])."""
    cuts = [i for i, k in enumerate(kernels) if k[2] == marker] + [len(kernels)]
    cut = [kernels[cuts[i]:cuts[i + 1]] for i in range(len(cuts) - 1)]
    if having:
        cut = [s for s in cut if any(k[2] == having for k in s)]
    if not cut:
        return 0, 0, 0.0, []
    common = collections.Counter(len(s) for s in cut).most_common(1)[0][0]
    cut = [s for s in cut if len(s) == common][-steps:]
    span = statistics.median(max(k[1] for k in s) - s[0][0] for s in cut) / 1e3
    if layers > 0:  # every kept step has the same kernels, so the first one's counts do
        counts = collections.Counter((k[2], k[3]) for k in cut[0])
        per_layer = {key: c // layers for key, c in counts.items() if c % layers == 0 and c > layers}
        relabelled = []
        for s in cut:
            seen = collections.Counter()
            out = []
            for start, end, name, grid in s:
                k = per_layer.get((name, grid), 0)
                if k:
                    out.append((start, end, f'{name}#{seen[(name, grid)] % k}', grid))
                    seen[(name, grid)] += 1
                else:
                    out.append((start, end, name, grid))
            relabelled.append(out)
        cut = relabelled
    per_op = collections.OrderedDict()
    for s in cut:
        latest = prev_end = s[0][0]
        seen = collections.OrderedDict()
        for start, end, name, grid in s:
            e = seen.setdefault((name, grid), [0, 0.0, 0.0, 0.0])
            e[0] += 1
            e[1] += (end - start) / 1e3
            e[2] += max(0, end - latest) / 1e3
            e[3] += (start - prev_end) / 1e3
            latest = max(latest, end)
            prev_end = end
        for key, e in seen.items():
            per_op.setdefault(key, []).append(e)
    rows = []
    for (name, grid), es in per_op.items():
        n = es[0][0]
        rows.append((name, grid, n, statistics.mean(e[1] for e in es),
                     statistics.mean(e[2] for e in es), statistics.mean(e[3] for e in es) / n))
    return len(cut), common, span, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('csv')
    ap.add_argument('--steps', type=int, default=20)
    ap.add_argument('--marker', default='PrepareDecodeKernel')
    ap.add_argument('--layers', type=int, default=0,
                    help='split an op launched k > 1 times a layer by its place in the layer')
    ap.add_argument('--with', dest='having', default=None,
                    help='keep only the steps that hold a kernel of this name')
    a = ap.parse_args()
    n, per_step, span, rows = summarize(read_trace(a.csv), a.steps, a.marker, a.layers, a.having)
    if n == 0:
        print(f'no {a.marker} step' + (f' with {a.having}' if a.having else '') + f' in {a.csv}')
        return 1
    print(f'{n} steps of {per_step} kernels; span (first start to last end), median: {span:.1f} us')
    print(f"{'kernel':40s} {'grid':16s} {'n':>4s} {'dur us':>9s} {'path us':>9s} {'gap us':>8s}")
    for name, grid, count, dur, path, gap in rows:
        print(f'{name[:40]:40s} {grid:16s} {count:4d} {dur:9.1f} {path:9.1f} {gap:8.2f}')
    print(f"{'sum of path':61s} {sum(r[4] for r in rows):9.1f}")
    return 0


if __name__ == '__main__':
    raise SystemExit(main())

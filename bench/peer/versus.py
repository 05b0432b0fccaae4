#!/usr/bin/env python3
"""tailserve against the compiled-PyTorch peer, one markdown table from the two tools' JSON lines.

Reads `tailserve-bench --out` files (one record per shape, batch, mode and host load, and a
`copy_gbps` record per run) and `bench/peer/peer_decode.py --out` files (one record per shape and
batch), which may hold several runs each (both tools append, so an A/B loop shares a file). For
each shape and batch it prints our median step time per mode, its share of the copy roof, the
peer's step time, and the peer's time over our best mode's. Where a file holds a key more than
once the median over its runs is used, and the count is shown. Only idle-host records (load 0) of
single-stage runs count. A row is printed for every (shape, batch) that either side measured;
a side that did not measure it shows `-`.

    python3 bench/peer/versus.py --ours ours.jsonl --peer peer.jsonl [--modes host,loop]
"""
import argparse
import json
import statistics
import sys


def read_lines(paths):
    out = []
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    sys.exit(f"{path}:{n}: not JSON ({e})")
    return out


def ours_by_key(records):
    """(shape, batch, mode) -> [(step_ms, fraction_of_copy)] over runs."""
    out = {}
    for r in records:
        if 'step_ms_median' not in r:
            continue  # a run's copy_gbps record
        if r.get('host_load_per_core', 0) != 0 or r.get('stages', 1) != 1:
            continue
        key = (r['shape'], int(r['batch']), r['mode'])
        out.setdefault(key, []).append((r['step_ms_median'], r['fraction_of_copy']))
    return out


def peer_by_key(records):
    """(shape, batch) -> [ms_per_step] over runs."""
    out = {}
    for r in records:
        out.setdefault((r['shape'], int(r['batch'])), []).append(r['ms_per_step'])
    return out


def table(ours, peer, modes):
    keys = sorted({(s, b) for (s, b, _) in ours} | set(peer))
    head = ['shape', 'batch'] + [f'{m} ms' for m in modes] + [f'{m} of copy' for m in modes]
    head += ['peer ms', 'peer / our best']
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for shape, batch in keys:
        times, cells, fracs = [], [shape.upper(), str(batch)], []
        for m in modes:
            runs = ours.get((shape, batch, m), [])
            if not runs:
                times.append(None)
                cells.append('-')
                fracs.append('-')
                continue
            t = statistics.median(r[0] for r in runs)
            times.append(t)
            cells.append(f'{t:.3f}' + (f' ({len(runs)} runs)' if len(runs) > 1 else ''))
            fracs.append(f'{100 * statistics.median(r[1] for r in runs):.1f}%')
        cells += fracs
        p_runs = peer.get((shape, batch))
        p = statistics.median(p_runs) if p_runs else None
        cells.append('-' if p is None else f'{p:.3f}' + (f' ({len(p_runs)} runs)'
                                                          if len(p_runs) > 1 else ''))
        best = min((t for t in times if t is not None), default=None)
        cells.append('-' if p is None or best is None else f'{p / best:.2f}x')
        lines.append('| ' + ' | '.join(cells) + ' |')
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--ours', action='append', required=True, help='tailserve-bench --out file (repeatable)')
    ap.add_argument('--peer', action='append', required=True, help='peer_decode.py --out file (repeatable)')
    ap.add_argument('--modes', default='host,loop', help='our modes, comma-separated, in order')
    a = ap.parse_args(argv)
    ours_records = read_lines(a.ours)
    copies = [r['copy_gbps'] for r in ours_records if set(r) == {'copy_gbps'}]
    peers = read_lines(a.peer)
    gpus = sorted({r.get('gpu', '?') for r in peers})
    if copies:
        print(f"copy bandwidth {', '.join(f'{c:.0f}' for c in copies)} GB/s (ours); "
              f"peer on {', '.join(gpus)}")
    modes = [m for m in a.modes.split(',') if m]
    for line in table(ours_by_key(ours_records), peer_by_key(peers), modes):
        print(line)


if __name__ == '__main__':
    main()

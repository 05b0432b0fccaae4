#!/usr/bin/env python3
"""Where the slowest inter-token intervals of a tailserve-load run come from.

Reads a run's results.jsonl (tailserve-load --out_dir) and takes each successful request's token
messages (message_ms, message_tokens). An interval is the time between two of a stream's
messages; its ITL is that time over the tokens the later message carries, as tailserve-load
counts ITL samples. For the intervals at or above an ITL percentile (--tail, default p99) it says:
  held      the stream's next message came within --short ms: the token reached the client late
            and just ahead of the next one, so the interval is the server holding a token back
            (for example its engine thread busy elsewhere), not a slow step;
  shared    of the other streams decoding at the interval's midpoint, the fraction whose own
            interval over that moment is in the tail too: near 1 for a stall every stream sees (a
            long step, a pause of the GPU or the host), near 0 for one stream's own delay;
  arrivals  requests that arrived during the interval: prompts the server was taking in then
            (in the device loop, mixed steps that prefill them beside the decode rows).
It prints the slowest intervals, then the tail's means against the rest's. A token held back
until the next one was made arrives in the same message (tailserve-load splits that interval
evenly, so it never reaches the tail): the first line counts those messages.

    python3 bench/serving/itl_tail.py serve-out/serve-loop-16/results.jsonl [--top 10] [--tail 0.99]
"""
import argparse
import bisect
import json
import sys

from ttft_tail import percentile


def load(path):
    """The successful requests with at least two token messages, as dicts of ms values."""
    streams = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            times, tokens = r.get("message_ms") or [], r.get("message_tokens") or []
            if r.get("status") != "OK" or len(times) < 2 or len(times) != len(tokens):
                continue
            streams.append({"index": r["index"], "arrival": r["intended_ms"], "times": times,
                            "tokens": tokens})
    return streams


def intervals(streams):
    """Every interval: (stream, k, start, end, itl, tokens, next_gap or None)."""
    out = []
    for s, st in enumerate(streams):
        t, n = st["times"], st["tokens"]
        for k in range(1, len(t)):
            if n[k] <= 0:
                continue
            nxt = t[k + 1] - t[k] if k + 1 < len(t) else None
            out.append((s, k, t[k - 1], t[k], (t[k] - t[k - 1]) / n[k], n[k], nxt))
    return out


def percentile_weighted(pairs, q):
    """The q-quantile of (value, weight) pairs, each value counted weight times: an interval counts
    once per token it carries, as tailserve-load's ITL samples do."""
    return percentile([v for v, w in pairs for _ in range(w)], q)


def arrived_during(arrivals, start, end):
    """How many of the sorted `arrivals` fall strictly inside (start, end)."""
    return bisect.bisect_left(arrivals, end) - bisect.bisect_right(arrivals, start)


def classify(streams, ivs, cut, short_ms):
    """For each interval with itl >= cut: (interval, held, shared fraction or None, arrivals)."""
    arrivals = sorted(st["arrival"] for st in streams)
    out = []
    for iv in ivs:
        s, _, start, end, itl, _, nxt = iv
        if itl < cut:
            continue
        held = nxt is not None and nxt < short_ms
        mid = (start + end) / 2
        others = in_tail = 0
        for o, st in enumerate(streams):
            t = st["times"]
            if o == s or not t[0] < mid < t[-1]:
                continue
            others += 1
            k = bisect.bisect_right(t, mid)  # t[k - 1] <= mid < t[k]
            n = st["tokens"][k]
            if n > 0 and (t[k] - t[k - 1]) / n >= cut:
                in_tail += 1
        shared = in_tail / others if others else None
        out.append((iv, held, shared, arrived_during(arrivals, start, end)))
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="results.jsonl of a tailserve-load run")
    ap.add_argument("--top", type=int, default=10, help="slowest intervals to list")
    ap.add_argument("--tail", type=float, default=0.99, help="ITL percentile that starts the tail")
    ap.add_argument("--short", type=float, default=1.0,
                    help="ms: a next message this soon marks the token as held back")
    args = ap.parse_args(argv)
    streams = load(args.results)
    ivs = intervals(streams)
    if not ivs:
        print(f"{args.results}: no successful request with two token messages", file=sys.stderr)
        return 1
    samples = [(iv[4], iv[5]) for iv in ivs]
    p50 = percentile_weighted(samples, 0.5)
    cut = percentile_weighted(samples, args.tail)
    tail = classify(streams, ivs, cut, args.short)
    print(f"{len(streams)} streams, {sum(w for _, w in samples)} ITL samples: p50 {p50:.2f} ms, "
          f"p{args.tail * 100:g} {cut:.2f} ms; {len(tail)} intervals at or above it")
    coalesced = sum(1 for iv in ivs if iv[5] > 1)
    print(f"messages after the first carrying more than one token: {coalesced} of {len(ivs)} "
          f"({100.0 * coalesced / len(ivs):.2f}%)")
    print(f"the {min(args.top, len(tail))} slowest (ms):")
    print(f"{'index':>6} {'token':>6} {'at_s':>8} {'itl':>7} {'tokens':>6} {'next':>7} {'held':>5} "
          f"{'shared':>7} {'arrivals':>8}")
    for (s, k, _, end, itl, n, nxt), held, shared, arr in sorted(tail, key=lambda c: -c[0][4])[
            :args.top]:
        nxt_s = f"{nxt:7.2f}" if nxt is not None else f"{'-':>7}"
        sh = f"{shared:7.2f}" if shared is not None else f"{'-':>7}"
        print(f"{streams[s]['index']:6d} {k:6d} {end / 1000:8.3f} {itl:7.2f} {n:6d} {nxt_s} "
              f"{'yes' if held else 'no':>5} {sh} {arr:8d}")
    # The rest, for contrast: how often any interval is held back or has a prompt arriving in it.
    tail_ids = {id(c[0]) for c in tail}
    rest = [iv for iv in ivs if id(iv) not in tail_ids]
    arrivals = sorted(st["arrival"] for st in streams)

    def mean(values):
        values = list(values)
        return sum(values) / len(values) if values else float("nan")

    def with_arrival(group):
        return mean(1.0 if arrived_during(arrivals, iv[2], iv[3]) else 0.0 for iv in group)

    print(f"\nthe tail ({len(tail)} intervals) against the other {len(rest)}:")
    itl_tail, itl_rest = mean(c[0][4] for c in tail), mean(iv[4] for iv in rest)
    print(f"  mean itl          {itl_tail:8.2f} {itl_rest:8.2f} ms")
    held_rest = mean(1.0 if iv[6] is not None and iv[6] < args.short else 0.0 for iv in rest)
    print(f"  held back         {mean(1.0 if c[1] else 0.0 for c in tail):8.2f} {held_rest:8.2f}")
    print(f"  shared (mean)     {mean(c[2] for c in tail if c[2] is not None):8.2f}")
    arrived_tail, arrived_rest = with_arrival([c[0] for c in tail]), with_arrival(rest)
    print(f"  a prompt arrived  {arrived_tail:8.2f} {arrived_rest:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

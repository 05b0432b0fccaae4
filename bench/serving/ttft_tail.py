#!/usr/bin/env python3
"""Where the slowest first tokens of a tailserve-load run waited.

Reads a run's results.jsonl (tailserve-load --out_dir) and splits each successful request's TTFT
into the server's own Timing (docs/serving.md, API edges):
  queue    waiting in the engine for a slot, KV blocks and room in the batch (--max_batch)
  wait     then behind the prompts ahead of it (the device loop's prefill queue)
  prefill  its own chunks or mixed steps, to the engine reading its first token
  other    the rest of the client's TTFT: validation and tokenization, gRPC, the network, the
           client's own send lag
and adds what the server held when the request arrived, from the other requests' times:
  ahead    prompt tokens of earlier arrivals still waiting for their first token
  decoding requests between their first token and their end (the batch it joined)

Prints the slowest requests and, for the requests at or above a TTFT percentile against the rest,
the mean of each part: whether a TTFT tail is the slot limit (queue), the prefill backlog (wait,
with ahead), its own prefill, or outside the engine (other).

    python3 bench/serving/ttft_tail.py serve-out/serve-loop-48/results.jsonl [--top 10] [--tail 0.95]
"""
import argparse
import heapq
import json
import sys


def load(path):
    """The successful requests that carry the server's Timing, as dicts of ms values."""
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            t = r.get("server_timing")
            if r.get("status") != "OK" or t is None or r.get("ttft_ms") is None:
                continue
            wait = t.get("prefill_wait_ms", 0.0)  # absent from results written before the field
            server = t["preprocess_ms"] + t["queue_ms"] + wait + t["prefill_ms"]
            rows.append({
                "index": r["index"],
                "arrival": r["intended_ms"],
                "first": r["intended_ms"] + r["ttft_ms"],
                "end": r["end_ms"],
                "input": r["input_tokens"],
                "ttft": r["ttft_ms"],
                "queue": t["queue_ms"],
                "wait": wait,
                "prefill": t["prefill_ms"],
                "other": r["ttft_ms"] - t["queue_ms"] - wait - t["prefill_ms"],
                "server": server,
            })
    return rows


def add_load(rows):
    """Sets each row's `ahead` and `decoding` at its arrival. Times are the client's: a request
    counts as waiting until its first token reached the client, a few ms after the server had it.
    One sweep over the arrivals (a run may hold many thousands of requests)."""
    order = sorted(rows, key=lambda r: r["arrival"])
    waiting, decoding = [], []  # heaps of (first, n, input) and (end, n)
    waiting_tokens = 0
    k = 0
    while k < len(order):
        t = order[k]["arrival"]
        group_end = k
        while group_end < len(order) and order[group_end]["arrival"] == t:
            o = order[group_end]
            heapq.heappush(waiting, (o["first"], group_end, o["input"]))
            waiting_tokens += o["input"]
            group_end += 1
        while waiting and waiting[0][0] <= t:
            first, n, tokens = heapq.heappop(waiting)
            waiting_tokens -= tokens
            heapq.heappush(decoding, (order[n]["end"], n))
        while decoding and decoding[0][0] <= t:
            heapq.heappop(decoding)
        for o in order[k:group_end]:
            o["ahead"] = waiting_tokens - (o["input"] if o["first"] > t else 0)
            o["decoding"] = len(decoding)
        k = group_end
    return rows


def percentile(values, q):
    """Linear interpolation between closest ranks, as tailserve-load's summary (numpy's default)."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


PARTS = ("ttft", "queue", "wait", "prefill", "other", "ahead", "decoding")


def split_tail(rows, q):
    """(threshold, mean of each part over the rows with TTFT >= threshold, the same for the rest)."""
    cut = percentile([r["ttft"] for r in rows], q)
    tail = [r for r in rows if r["ttft"] >= cut]
    rest = [r for r in rows if r["ttft"] < cut]

    def means(group):
        return {k: sum(r[k] for r in group) / len(group) if group else float("nan") for k in PARTS}

    return cut, len(tail), means(tail), len(rest), means(rest)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="results.jsonl of a tailserve-load run")
    ap.add_argument("--top", type=int, default=10, help="slowest requests to list")
    ap.add_argument("--tail", type=float, default=0.95, help="TTFT percentile that starts the tail")
    args = ap.parse_args(argv)
    rows = add_load(load(args.results))
    if not rows:
        print(f"{args.results}: no successful request with the server's Timing", file=sys.stderr)
        return 1
    print(f"{len(rows)} requests; the {min(args.top, len(rows))} slowest first tokens (ms):")
    print(f"{'index':>6} {'arrival_s':>9} {'input':>6} {'ttft':>8} {'queue':>8} {'wait':>8} "
          f"{'prefill':>8} {'other':>7} {'ahead':>6} {'decoding':>8}")
    for r in sorted(rows, key=lambda r: -r["ttft"])[:args.top]:
        print(f"{r['index']:6d} {r['arrival'] / 1000:9.3f} {r['input']:6d} {r['ttft']:8.1f} "
              f"{r['queue']:8.1f} {r['wait']:8.1f} {r['prefill']:8.1f} {r['other']:7.1f} "
              f"{r['ahead']:6d} {r['decoding']:8d}")
    cut, n_tail, tail, n_rest, rest = split_tail(rows, args.tail)
    print(f"\nmeans, TTFT >= p{args.tail * 100:g} ({cut:.1f} ms, {n_tail} requests) against the "
          f"other {n_rest}:")
    for k in PARTS:
        unit = "" if k in ("ahead", "decoding") else " ms"
        print(f"  {k:9} {tail[k]:9.1f} {rest[k]:9.1f}{unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

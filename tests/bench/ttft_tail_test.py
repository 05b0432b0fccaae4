#!/usr/bin/env python3
"""bench/serving/ttft_tail.py on a made-up results.jsonl whose answer is known."""
import contextlib
import io
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'bench', 'serving'))
import ttft_tail  # noqa: E402
from results_file import ResultsFileTest  # noqa: E402


def record(index, arrival, ttft, end, tokens, queue, prefill, wait=0.0, status='OK',
           timing=True):
    r = {'index': index, 'status': status, 'intended_ms': arrival, 'ttft_ms': ttft,
         'end_ms': end, 'input_tokens': tokens, 'server_timing': None}
    if timing:
        r['server_timing'] = {'preprocess_ms': 0.5, 'queue_ms': queue, 'prefill_wait_ms': wait,
                              'prefill_ms': prefill, 'decode_ms': end - arrival - ttft}
    return r


# a decodes from 10 to 500; b arrives at 20 behind nothing waiting, c at 25 behind b's prompt
# (b's first token comes at 80); d at 30 behind b's and c's prompts; e failed; f has no Timing.
RECORDS = [
    record(0, 0, 10, 500, 100, 1, 8),
    record(1, 20, 60, 600, 300, 2, 50),
    record(2, 25, 95, 700, 200, 40, 50),
    record(3, 30, 150, 800, 400, 60, 50, wait=30),
    record(4, 35, 5, 40, 50, 0, 0, status='UNAVAILABLE'),
    record(5, 36, 7, 900, 50, 0, 0, timing=False),
]


class TtftTailTest(ResultsFileTest):
    RECORDS = RECORDS

    def test_only_successful_requests_with_timing_count(self):
        rows = ttft_tail.load(self.path)
        self.assertEqual([r['index'] for r in rows], [0, 1, 2, 3])
        d = rows[3]
        self.assertAlmostEqual(d['wait'], 30)
        self.assertAlmostEqual(d['other'], 150 - 60 - 30 - 50)  # preprocess is part of it
        self.assertAlmostEqual(d['server'], 0.5 + 60 + 30 + 50)
        self.assertEqual(rows[0]['wait'], 0)

    def test_what_each_request_found_on_arrival(self):
        rows = {r['index']: r for r in ttft_tail.add_load(ttft_tail.load(self.path))}
        # First tokens (client): a 10, b 80, c 120, d 180.
        self.assertEqual(rows[0]['ahead'], 0)
        self.assertEqual(rows[1]['ahead'], 0)
        self.assertEqual(rows[2]['ahead'], 300)        # b
        self.assertEqual(rows[3]['ahead'], 300 + 200)  # b and c
        self.assertEqual(rows[0]['decoding'], 0)
        self.assertEqual([rows[i]['decoding'] for i in (1, 2, 3)], [1, 1, 1])  # a

    def test_tail_against_the_rest(self):
        rows = ttft_tail.add_load(ttft_tail.load(self.path))
        cut, n_tail, tail, n_rest, rest = ttft_tail.split_tail(rows, 0.5)
        self.assertAlmostEqual(cut, (60 + 95) / 2)  # the median of 10, 60, 95, 150
        self.assertEqual((n_tail, n_rest), (2, 2))
        self.assertAlmostEqual(tail['queue'], 50)
        self.assertAlmostEqual(rest['queue'], 1.5)
        self.assertAlmostEqual(tail['ahead'], 400)
        self.assertAlmostEqual(rest['prefill'], 29)
        self.assertAlmostEqual(tail['prefill'], 50)
        self.assertAlmostEqual(tail['wait'], 15)

    def test_main_lists_the_slowest_first(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(ttft_tail.main([self.path, '--top', '2', '--tail', '0.5']), 0)
        lines = out.getvalue().splitlines()
        self.assertTrue(lines[0].startswith('4 requests'))
        self.assertEqual(lines[2].split()[0], '3')  # d, then c
        self.assertEqual(lines[3].split()[0], '2')
        self.assertIn('TTFT >= p50 (77.5 ms, 2 requests) against the other 2', out.getvalue())


if __name__ == '__main__':
    unittest.main()

#!/usr/bin/env python3
"""bench/serving/itl_tail.py on a made-up results.jsonl whose answer is known."""
import contextlib
import io
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'bench', 'serving'))
import itl_tail  # noqa: E402
from results_file import ResultsFileTest, write_results  # noqa: E402


def record(index, arrival, times, tokens=None, status='OK'):
    return {'index': index, 'status': status, 'intended_ms': arrival, 'message_ms': times,
            'message_tokens': tokens if tokens is not None else [1] * len(times)}


def steady(start, stop, step=10.0):
    return [start + step * i for i in range(int((stop - start) / step) + 1)]


# Three streams a token every 10 ms from 0 to 200. All three see one 25 ms stall (95 -> 120),
# while request 3 arrives at 100. Stream 0 also has a token held back: the message due at 160
# comes at 169.5, half a ms before the next one. Stream 4 failed, stream 5 has one message.
def shifted(times):
    return [t if t < 100 else t + 15 for t in times]


A = shifted(steady(0, 200))
A[A.index(175.0)] = 184.5  # due at 175 after the shift; the next comes at 185
RECORDS = [
    record(0, 0, A),
    record(1, 0, shifted(steady(0, 200))),
    record(2, 0, shifted(steady(0, 200))),
    record(3, 100, [118.0, 128.0, 138.0]),
    record(4, 0, steady(0, 50), status='UNAVAILABLE'),
    record(5, 0, [5.0]),
]


class ItlTailTest(ResultsFileTest):
    RECORDS = RECORDS

    def test_only_successful_streams_with_two_messages_count(self):
        self.assertEqual([s['index'] for s in itl_tail.load(self.path)], [0, 1, 2, 3])

    def test_weighted_percentile_counts_each_token(self):
        # A message of 3 tokens is 3 samples of its share, as tailserve-load counts them.
        self.assertAlmostEqual(itl_tail.percentile_weighted([(1.0, 3), (5.0, 1)], 0.5), 1.0)
        self.assertAlmostEqual(itl_tail.percentile_weighted([(1.0, 1), (5.0, 1)], 0.5), 3.0)
        self.assertAlmostEqual(itl_tail.percentile_weighted([(2.0, 2), (4.0, 2)], 1.0), 4.0)

    def test_the_stall_is_shared_and_the_held_token_is_not(self):
        streams = itl_tail.load(self.path)
        ivs = itl_tail.intervals(streams)
        tail = itl_tail.classify(streams, ivs, cut=15.0, short_ms=1.0)
        by_where = {(streams[iv[0]]['index'], iv[2]): (held, shared, arr)
                    for iv, held, shared, arr in tail}
        # The stall: 90 -> 115 in streams 0-2 (25 ms), each with the two others in the tail at
        # its midpoint (request 3 has not started yet), and request 3 arriving inside it.
        for s in (0, 1, 2):
            self.assertEqual(by_where[(s, 90.0)], (False, 1.0, 1))
        # The held token: 165 -> 184.5 in stream 0, its next message 0.5 ms later; streams 1 and
        # 2 were on time then, and no prompt arrived.
        self.assertEqual(by_where[(0, 165.0)], (True, 0.0, 0))
        self.assertEqual(len(tail), 4)

    def test_main_prints_the_slowest_and_the_summary(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(itl_tail.main([self.path, '--tail', '0.9', '--top', '3']), 0)
        text = out.getvalue()
        self.assertIn('4 streams', text)
        self.assertIn('more than one token: 0 of 62', text)
        self.assertIn('the 3 slowest', text)
        self.assertIn('held back', text)
        self.assertIn('a prompt arrived', text)

    def test_a_message_of_two_tokens_is_counted_as_coalesced(self):
        path = write_results([record(7, 0, [0.0, 10.0, 30.0, 40.0], [1, 1, 2, 1])])
        try:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                self.assertEqual(itl_tail.main([path]), 0)
            self.assertIn('more than one token: 1 of 3 (33.33%)', out.getvalue())
        finally:
            os.unlink(path)

    def test_no_stream_is_an_error(self):
        path = write_results([RECORDS[4]])
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                self.assertEqual(itl_tail.main([path]), 1)
        finally:
            os.unlink(path)


if __name__ == '__main__':
    unittest.main()

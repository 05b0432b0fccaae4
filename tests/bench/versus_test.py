#!/usr/bin/env python3
"""bench/peer/versus.py on made-up tailserve-bench and peer_decode.py lines whose table is known."""
import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'bench', 'peer'))
import versus  # noqa: E402


def ours(shape, batch, mode, ms, frac, **extra):
    r = {'shape': shape, 'batch': batch, 'mode': mode, 'step_ms_median': ms,
         'fraction_of_copy': frac, 'host_load_per_core': 0, 'stages': 1}
    r.update(extra)
    return r


OURS_A = [
    {'copy_gbps': 3000.0},
    ours('8b', 16, 'host', 6.0, 0.80),
    ours('8b', 16, 'loop', 5.0, 0.90),
    ours('8b', 16, 'loop', 99.0, 0.05, host_load_per_core=2),  # a loaded host: left out
    ours('8b', 16, 'pipe', 1.0, 0.99, stages=2),                # a pipeline run: left out
    ours('1b', 64, 'host', 1.5, 0.60),                          # no peer record
]
OURS_B = [
    {'copy_gbps': 3010.0},
    ours('8b', 16, 'loop', 7.0, 0.70),  # second run of (8b, 16, loop): median of 5 and 7
    ours('8b', 16, 'loop', 6.0, 0.60),  # third: median of 5, 6, 7 is 6
]
PEER = [
    {'shape': '8b', 'batch': 16, 'ms_per_step': 6.6, 'gpu': 'G'},
    {'shape': '8b', 'batch': 128, 'ms_per_step': 9.0, 'gpu': 'G'},  # no record of ours
]


class VersusTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.paths = {}
        for name, recs in (('a', OURS_A), ('b', OURS_B), ('peer', PEER)):
            path = os.path.join(self.dir.name, name + '.jsonl')
            with open(path, 'w') as f:
                for r in recs:
                    f.write(json.dumps(r) + '\n')
                f.write('\n')  # a blank line is skipped
            self.paths[name] = path

    def tearDown(self):
        self.dir.cleanup()

    def run_tool(self, *extra):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            versus.main(['--ours', self.paths['a'], '--ours', self.paths['b'],
                         '--peer', self.paths['peer'], *extra])
        return out.getvalue().splitlines()

    def test_table(self):
        lines = self.run_tool()
        self.assertEqual(lines[0], 'copy bandwidth 3000, 3010 GB/s (ours); peer on G')
        self.assertEqual(lines[1], '| shape | batch | host ms | loop ms | host of copy | '
                                   'loop of copy | peer ms | peer / our best |')
        rows = lines[3:]
        self.assertEqual(rows, [
            '| 1B | 64 | 1.500 | - | 60.0% | - | - | - |',
            # the loop's median over three runs (6.0) against host 6.0: best 6.0, 6.6 / 6.0
            '| 8B | 16 | 6.000 | 6.000 (3 runs) | 80.0% | 70.0% | 6.600 | 1.10x |',
            '| 8B | 128 | - | - | - | - | 9.000 | - |',
        ])

    def test_modes_pick_the_columns(self):
        rows = self.run_tool('--modes', 'host')[3:]
        self.assertEqual(rows[1], '| 8B | 16 | 6.000 | 80.0% | 6.600 | 1.10x |')

    def test_bad_line_names_the_file(self):
        with open(self.paths['peer'], 'a') as f:
            f.write('{not json\n')
        with self.assertRaises(SystemExit) as e:
            self.run_tool()
        self.assertIn('peer.jsonl:', str(e.exception.code))


if __name__ == '__main__':
    unittest.main()

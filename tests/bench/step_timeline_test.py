#!/usr/bin/env python3
"""bench/trace/step_timeline.py on a hand-made trace whose answer is known."""
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'bench', 'trace'))
import step_timeline  # noqa: E402

HEADER = 'start_ns,end_ns,graph_id,node_id,grid_x,grid_y,grid_z,cluster_y,name\n'


def step(t0, attention_end):
    """One step as CSV lines, in us from t0: prepare 0-2, a GEMV 1-10 (under PDL it starts before
    prepare ends), attention 8 to attention_end, then a cuBLASLt GEMM 1 us later, 3 us long."""
    us = lambda x: int((t0 + x) * 1000)  # noqa: E731
    return [
        f'{us(0)},{us(2)},1,1,1,1,1,0,_ZN2ts7kernels19PrepareDecodeKernelEv',
        f'{us(1)},{us(10)},1,2,48,5,1,5,_ZN2ts7kernels12GemvTcKernelENS_10GemvParamsE',
        f'{us(8)},{us(attention_end)},1,3,2,8,16,0,_ZN2ts7kernels21DecodeAttentionKernelILi128EEEv',
        f'{us(attention_end + 1)},{us(attention_end + 4)},1,4,2,66,1,0,nvjet_sm90_tss_256x16_64x6',
    ]


class StepTimelineTest(unittest.TestCase):
    def summarize(self, lines, **kw):
        with tempfile.NamedTemporaryFile('w', suffix='.csv', delete=False) as f:
            f.write(HEADER + '\n'.join(lines) + '\n')
        try:
            return step_timeline.summarize(step_timeline.read_trace(f.name), **kw)
        finally:
            os.unlink(f.name)

    def test_path_increments_add_up_to_the_span(self):
        # Two steps 100 us apart, attention ending at 15 and then 17 us; a warm-up step of
        # another length first, which the summary leaves out.
        lines = step(0, 15)[:2]
        lines += step(100, 15) + step(200, 17)
        n, per_step, span, rows = self.summarize(lines)
        self.assertEqual((n, per_step), (2, 4))
        by_name = {r[0]: r for r in rows}
        self.assertEqual(set(by_name), {'PrepareDecodeKernel', 'GemvTcKernel', 'DecodeAttentionKernel',
                                        'nvjet_sm90_tss_256x16_64x6'})
        self.assertEqual(by_name['GemvTcKernel'][1], '48x5x1 c5')
        # GEMV: 9 us long, ends 8 us after prepare (path), starts 1 us before it ends (gap -1).
        self.assertAlmostEqual(by_name['GemvTcKernel'][3], 9.0)
        self.assertAlmostEqual(by_name['GemvTcKernel'][4], 8.0)
        self.assertAlmostEqual(by_name['GemvTcKernel'][5], -1.0)
        # Attention: ends at 15 and 17 us, 5 and 7 past the GEMV: 6 on average.
        self.assertAlmostEqual(by_name['DecodeAttentionKernel'][4], 6.0)
        self.assertAlmostEqual(by_name['DecodeAttentionKernel'][5], -2.0)
        # The head GEMM: 4 us of path (1 us gap, 3 us of kernel) in both steps.
        self.assertAlmostEqual(by_name['nvjet_sm90_tss_256x16_64x6'][4], 4.0)
        # Spans 19 and 21 us: the increments' sum is their mean, the median of two.
        self.assertAlmostEqual(sum(r[4] for r in rows), 20.0)
        self.assertAlmostEqual(span, 20.0)

    def test_layers_split_one_grid_by_its_place_in_the_layer(self):
        # Two layers a step, each a 264-CTA GEMV of 3 us then one of 7 us (same name and grid),
        # and a 256-CTA GEMV launched once a layer, which stays whole.
        def two_layer_step(t0):
            us = lambda x: int((t0 + x) * 1000)  # noqa: E731
            gemv = '_ZN2ts7kernels10GemvKernelENS_10GemvParamsE'
            lines = [f'{us(0)},{us(1)},1,1,1,1,1,0,_ZN2ts7kernels19PrepareDecodeKernelEv']
            t = 1
            for _ in range(2):
                for grid, length in (('264', 3), ('264', 7), ('256', 2)):
                    lines.append(f'{us(t)},{us(t + length)},1,2,{grid},1,1,0,{gemv}')
                    t += length
            return lines
        n, _, span, rows = self.summarize(two_layer_step(0) + two_layer_step(100), layers=2)
        self.assertEqual(n, 2)
        by_op = {(r[0], r[1]): r for r in rows}
        self.assertEqual(set(by_op), {('PrepareDecodeKernel', '1x1x1'), ('GemvKernel#0', '264x1x1'),
                                      ('GemvKernel#1', '264x1x1'), ('GemvKernel', '256x1x1')})
        self.assertEqual(by_op[('GemvKernel#0', '264x1x1')][2], 2)
        self.assertAlmostEqual(by_op[('GemvKernel#0', '264x1x1')][4], 6.0)
        self.assertAlmostEqual(by_op[('GemvKernel#1', '264x1x1')][4], 14.0)
        self.assertAlmostEqual(by_op[('GemvKernel', '256x1x1')][4], 4.0)
        self.assertAlmostEqual(span, 25.0)
        # Without --layers the two 264-CTA ops are one.
        _, _, _, rows = self.summarize(two_layer_step(0) + two_layer_step(100))
        self.assertAlmostEqual({(r[0], r[1]): r for r in rows}[('GemvKernel', '264x1x1')][4], 20.0)

    def test_with_keeps_only_the_steps_that_hold_the_kernel(self):
        # Three plain decode steps (4 kernels, the most common count) and two mixed ones that add
        # a 30 us prefill attention after the head GEMM: --with picks the two mixed steps.
        def mixed(t0):
            us = lambda x: int((t0 + x) * 1000)  # noqa: E731
            return step(t0, 15) + [
                f'{us(20)},{us(50)},1,5,4,32,1,0,_ZN2ts7kernels22PrefillAttentionKernelILi128EEEv']
        lines = step(0, 15) + mixed(100) + step(200, 15) + mixed(300) + step(400, 15)
        n, per_step, span, rows = self.summarize(lines, having='PrefillAttentionKernel')
        self.assertEqual((n, per_step), (2, 5))
        self.assertAlmostEqual(span, 50.0)
        self.assertIn('PrefillAttentionKernel', {r[0] for r in rows})
        n, per_step, span, _ = self.summarize(lines)
        self.assertEqual((n, per_step), (3, 4))
        self.assertAlmostEqual(span, 19.0)
        n, _, _, rows = self.summarize(step(0, 15), having='PrefillAttentionKernel')
        self.assertEqual((n, rows), (0, []))

    def test_no_marker_means_no_steps(self):
        n, _, _, rows = self.summarize(step(0, 15)[1:])
        self.assertEqual(n, 0)
        self.assertEqual(rows, [])


if __name__ == '__main__':
    unittest.main()

"""Tests of bench/small_class_model.py: the heap's placement and what classes change."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import small_class_model as m  # noqa: E402


class HeapTest(unittest.TestCase):
    def test_best_fit_reuses_the_smallest_hole_and_joins_neighbours(self):
        heap = m.Heap(chunk=4096)
        a, b, c, d = (heap.allocate(n) for n in (1024, 512, 1024, 1536))
        self.assertEqual((a, b, c, d), (0, 1024, 1536, 2560))
        self.assertEqual(heap.top, 4096)
        heap.free(a, 1024)
        heap.free(c, 1024)
        self.assertEqual(heap.allocate(1024), 0, "ties go to the lowest address")
        heap.free(0, 1024)
        heap.free(b, 512)  # joins both neighbours: 2560 free bytes at 0
        self.assertEqual(heap.allocate(2560), 0)
        self.assertEqual(heap.top, 4096, "no growth while a joined hole fits")
        self.assertEqual(heap.allocate(4096), 4096, "grown by a whole chunk at the top")
        self.assertEqual(heap.top, 8192)

    def test_a_growth_extends_a_free_block_at_the_top(self):
        heap = m.Heap(chunk=4096)
        heap.allocate(1024)
        self.assertEqual(heap.allocate(4096), 1024, "the free 3 KiB at the top, then 1 chunk")
        self.assertEqual(heap.top, 8192)


class ClassesTest(unittest.TestCase):
    def test_classes_keep_holes_left_by_other_sizes_out_of_the_way(self):
        # Small and large blocks interleaved; the large ones freed and replaced by larger
        # ones: in one heap the holes between small blocks fit none of them.
        events, n = [], 64
        for i in range(n):
            events += [("a", 2 * i, 512), ("a", 2 * i + 1, 1536)]
        events += [("f", 2 * i + 1, 0) for i in range(n)]
        events += [("a", 1000 + i, 2048) for i in range(n * 3 // 4)]
        one = m.ratio(events, 1, lo=512, hi=4096, chunk=4096)
        two = m.ratio(events, 2, lo=512, hi=4096, chunk=4096)
        self.assertGreater(one, 1.7)
        self.assertLess(two, 1.05)
        self.assertLessEqual(m.ratio(events, 2, lo=512, hi=4096, chunk=4096, move=True), two)

    def test_blocks_past_hi_are_not_counted(self):
        events = [("a", 0, 8192), ("a", 1, 1024), ("f", 0, 0)]
        self.assertEqual(m.ratio(events, 1, lo=512, hi=4096, chunk=1024), 1.0)

    def test_class_of_splits_the_log_range_evenly(self):
        self.assertEqual(m.class_of(64 << 10, 16, 64 << 10, 256 << 10), 0)
        self.assertEqual(m.class_of(128 << 10, 2, 64 << 10, 256 << 10), 1)
        self.assertEqual(m.class_of(256 << 10, 16, 64 << 10, 256 << 10), 15)
        self.assertEqual(m.class_of(1 << 30, 4, 64 << 10, 256 << 10), 3)


if __name__ == "__main__":
    unittest.main()

"""Tests of bench/page_alias_model.py: hand-made traces whose figures follow from the rules,
the bound every trace must meet, and determinism.

    bazel test //bench:page_alias_model_test
    python3 -m pytest bench/page_alias_model_test.py      (from a checkout)
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import page_alias_model as model  # noqa: E402
import traces  # noqa: E402

P = 4 * model.MIB


def test_a_free_page_start_serves_a_block_end_only_when_aliased():
    # A and B share page 0, C fills page 1; A's free leaves page 0's first half free. D (one
    # and a half pages) cannot go there at one address (it needs 4 pages: 0 to 3); aliased, it
    # is a new page and then that free half: 3 pages for 3 pages of live bytes.
    events = [("a", 0, P // 2), ("a", 1, P // 2), ("a", 2, P), ("f", 0, 0),
              ("a", 3, P + P // 2)]
    assert model.one_address(events, P) == pytest.approx(4 / 3)
    assert model.aliased(events, P) == pytest.approx(1.0)


def test_a_free_page_end_and_a_free_start_make_one_block():
    # Six half pages fill pages 0 to 2; freeing the second and the fifth leaves the end of
    # page 0 and the start of page 2 free, half a page each, not side by side. A block of a
    # page goes past the end at one address (a fourth page); aliased, it is page 0's free end
    # then page 2's free start at a new address: no new page.
    half = P // 2
    events = [("a", i, half) for i in range(6)] + [("f", 1, 0), ("f", 4, 0), ("a", 6, P)]
    assert model.one_address(events, P) == pytest.approx(4 / 3)
    assert model.aliased(events, P) == pytest.approx(1.0)


def test_reuse_first_fills_a_free_end_on_a_tie():
    # A holds half of page 0. D (1.75 pages) needs two new pages either way: by default it
    # takes them whole and leaves page 0's free half; with reuse_first it starts in that half
    # and leaves three quarters of its last page free, where E (0.75 pages) then fits; by
    # default E, too large for either free end, takes a fourth page.
    events = [("a", 0, P // 2), ("a", 1, P + 3 * P // 4), ("a", 2, 3 * P // 4)]
    assert model.aliased(events, P) == pytest.approx(4 / 3)
    assert model.aliased(events, P, reuse_first=True) == pytest.approx(1.0)


def test_page_aware_placement_ends_a_block_in_a_held_page():
    # A (half a page), B (a page) and C (half a page) fill pages 0 and 1; freeing A and B
    # leaves C alone in page 1 and the gap [0, 1.5) pages. D (half a page) at the gap's start
    # needs page 0 again; page-aware it ends at the gap's end, in C's page. E (1.5 pages) then
    # fits no gap and goes after C, on pages 2 and 3: 4 pages held at one address, 3
    # page-aware, for 2.5 pages of live bytes.
    half = P // 2
    events = [("a", 0, half), ("a", 1, P), ("a", 2, half), ("f", 0, 0), ("f", 1, 0),
              ("a", 3, half), ("a", 4, P + half)]
    assert model.one_address(events, P) == pytest.approx(4 / 2.5)
    assert model.page_aware(events, P) == pytest.approx(3 / 2.5)


@pytest.mark.parametrize("name", sorted(traces.WORKLOADS))
def test_every_trace_needs_at_least_its_live_bytes(name):
    events = traces.events(name, seed=0, scale=0.02)
    for fn in (model.one_address, model.page_aware, model.aliased):
        assert fn(events, P) >= 1.0


def test_the_same_trace_gives_the_same_figures():
    events = traces.events("off_page_sizes", seed=1, scale=0.05)
    assert model.aliased(events, P) == model.aliased(list(events), P)
    assert model.one_address(events, P) == model.one_address(list(events), P)


def test_off_page_sizes_strands_less_when_aliased():
    # The shape the pool strands most in (docs/DESIGN.md §2b): blocks just past a page
    # boundary. Aliased pages take the free ends and starts that one address leaves.
    events = traces.events("off_page_sizes", seed=0, scale=0.1)
    one, alias = model.one_address(events, P), model.aliased(events, P)
    assert one > 1.03
    assert alias < 1.02


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    # Keep pytest's cache out of the (read-only) runfiles tree.
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-rs", __file__] + sys.argv[1:]))

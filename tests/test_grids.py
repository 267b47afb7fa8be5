"""The fast suite's selection (tests/conftest.py) and the thinned grids (tests/grids.py): by
default the tests marked slow are deselected, `--full` or any `-m` keeps them; a thinned
grid marks every case but the fast ones slow and keeps the full grid's cases and ids."""

import itertools

import pytest

from conftest import split_slow
from grids import pairs, parametrize, thin


class Item:
    """A collected test as split_slow reads it: its closest `slow` mark, or None."""

    def __init__(self, name, slow):
        self.name, self.slow = name, slow

    def get_closest_marker(self, name):
        return pytest.mark.slow.mark if name == "slow" and self.slow else None


ITEMS = [Item("a", False), Item("b", True), Item("c", False)]


def test_the_default_run_deselects_the_slow_tests():
    kept, slow = split_slow(ITEMS, full=False, markexpr="")
    assert [item.name for item in kept] == ["a", "c"] and [item.name for item in slow] == ["b"]


@pytest.mark.parametrize("full, markexpr", [(True, ""), (False, "slow"), (False, "cuda")])
def test_full_or_a_mark_expression_keeps_every_test(full, markexpr):
    kept, slow = split_slow(ITEMS, full=full, markexpr=markexpr)
    assert kept == ITEMS and slow == []


def _slow(case):
    return any(mark.name == "slow" for mark in getattr(case, "marks", ()))


def test_thin_marks_every_case_but_the_fast_ones_slow_and_keeps_their_values():
    cases = thin("a, b", [(1, 2), (3, 4), pytest.param(5, 6, id="five")], fast=[1])
    assert [_slow(case) for case in cases] == [True, False, True]
    assert cases[0].values == (1, 2) and cases[1] == (3, 4)
    assert cases[2].values == (5, 6) and cases[2].id == "five"


def test_thin_of_one_name_keeps_a_tuple_value_whole():
    cases = thin("shape", [(37, 16), (41, 24)], fast=lambda shape: shape[0] == 41)
    assert cases[0].values == ((37, 16),) and _slow(cases[0]) and cases[1] == (41, 24)


def test_thin_refuses_indices_outside_the_grid_and_a_grid_with_no_fast_case():
    with pytest.raises(IndexError, match=r"fast indices \[2\] outside the 2 cases"):
        thin("a", [1, 2], fast=[2])
    with pytest.raises(ValueError, match="no case of 'a' kept in the fast suite"):
        thin("a", [1, 2], fast=lambda a: False)


def test_pairs_meet_every_two_values_of_any_two_options_in_fewer_cases():
    cases = list(itertools.product([True, False], [0.0, 0.3], [None, 0.8, "per-head"],
                                   ["masked", "paper"]))
    kept = [cases[i] for i in pairs(cases)]
    assert len(kept) < len(cases) and pairs(cases) == pairs(cases)
    for i, j in itertools.combinations(range(4), 2):
        assert {(c[i], c[j]) for c in kept} == {(c[i], c[j]) for c in cases}


@parametrize("n", [1, 2, 3], fast=[0])
def test_a_thinned_grid_collects_every_case(n, request):
    """The slow cases are collected with their ids (deselected, not dropped, by default)."""
    assert request.node.name == f"test_a_thinned_grid_collects_every_case[{n}]"
    assert (request.node.get_closest_marker("slow") is None) == (n == 1)

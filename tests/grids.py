"""Parametrized grids thinned for the fast suite (tests/conftest.py): a few representative
cases run by default, the rest carry the `slow` mark and run with `-m slow` or `--full`.

    from grids import parametrize

    @parametrize("T, D", [(37, 16), (100, 32), (1, 16)], fast=[0])
    def test_x(T, D): ...

is `pytest.mark.parametrize` with every case but the first marked slow: the ids are those
of the full grid, so the fast and the slow runs together collect every case. For a product
of options, `fast=pairs(CASES)` keeps a subset in which every two values of any two
options meet in some case."""

import itertools

import pytest

_ParameterSet = type(pytest.param())


def parametrize(argnames, cases, *, fast=(0,), **kwargs):
    """pytest.mark.parametrize(argnames, cases, **kwargs) with the cases not kept fast marked
    slow. `fast`: the indices of the cases that stay in the fast suite, or a predicate on a
    case's values (a tuple, or the value itself for one argument name). A pytest.param case
    keeps its id and marks."""
    return pytest.mark.parametrize(argnames, thin(argnames, cases, fast), **kwargs)


def thin(argnames, cases, fast=(0,)):
    """The parametrize list `cases` for `argnames`, in order, each case not kept fast marked
    slow (see parametrize)."""
    names = argnames.split(",") if isinstance(argnames, str) else list(argnames)
    single = len([name for name in names if name.strip()]) == 1
    cases = list(cases)
    if callable(fast):
        keep = {i for i, case in enumerate(cases) if fast(_values(case, single))}
    else:
        fast = list(fast)
        outside = [i for i in fast if not -len(cases) <= i < len(cases)]
        if outside:
            raise IndexError(f"fast indices {outside} outside the {len(cases)} cases")
        keep = {i % len(cases) for i in fast}
    if not keep:
        raise ValueError(f"no case of {argnames!r} kept in the fast suite")
    return [case if i in keep else _slow(case, single) for i, case in enumerate(cases)]


def pairs(cases):
    """Indices of a subset of `cases` (tuples of option values, as itertools.product makes
    them) in which every pair of values that two options take together in some case also
    meets in a kept case: chosen greedily, the case covering most pairs not yet covered first
    (the lowest index among equals), so the choice is the same on every run."""
    cases = [_values(case, False) for case in cases]

    def pairs_of(case):
        keys = [(i, repr(value)) for i, value in enumerate(case)]
        return set(itertools.combinations(keys, 2))

    covers = [pairs_of(case) for case in cases]
    uncovered = set().union(*covers)
    kept = []
    while uncovered:
        best = max(range(len(cases)), key=lambda i: (len(covers[i] & uncovered), -i))
        kept.append(best)
        uncovered -= covers[best]
    return sorted(kept)


def _values(case, single):
    if isinstance(case, _ParameterSet):
        return case.values[0] if single else case.values
    return case


def _slow(case, single):
    if isinstance(case, _ParameterSet):
        return pytest.param(*case.values, marks=(*case.marks, pytest.mark.slow), id=case.id)
    return pytest.param(*((case,) if single else case), marks=pytest.mark.slow)

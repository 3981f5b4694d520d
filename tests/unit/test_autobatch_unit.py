"""The micro-batch search in-process (the command-line tests: tests/cli/test_autobatch.py)."""
import pytest
from looplib.run.autobatch import candidates, find_micro_batch


def test_candidates_are_multiples_of_8_then_the_other_divisors():
    assert candidates(64) == ([8, 16, 32, 64], [4, 2, 1])
    assert candidates(24) == ([8, 24], [6, 4, 3, 2, 1])
    assert candidates(12) == ([], [12, 6, 4, 3, 2, 1])


@pytest.mark.parametrize("limit,best,tried", [
    (20, 16, [(8, True), (16, True), (32, False)]),
    (64, 64, [(8, True), (16, True), (32, True), (64, True)]),
    (5, 4, [(8, False), (4, True)]),
    (0, None, [(8, False), (4, False), (2, False), (1, False)]),
])
def test_search(limit, best, tried):
    assert find_micro_batch(lambda size: size <= limit, 64) == (best, tried)

"""n-gram drafts: the continuation of the latest earlier occurrence of the longest matching suffix."""

from __future__ import annotations

import pytest

from miles.rollout.spec.ngram import NgramIndex


def test_the_longest_suffix_match_wins_and_the_latest_occurrence() -> None:
    index = NgramIndex(n_max=3, n_min=1)
    index.extend([1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3])
    # suffix [1, 2, 3] occurred at 0 (followed by 9); [2, 3] most recently at 4 (followed by 4), but the
    # 3-gram match is preferred.
    assert index.propose(2) == [9, 2]
    index.extend([7])
    assert index.propose(3) == []  # 7 never occurred before
    index.extend([1])
    assert index.propose(2) == [2, 3]  # [7, 1] unseen, [1] latest at 8 -> followed by 2, 3


def test_the_draft_is_cut_at_k_and_at_the_end_of_what_is_known() -> None:
    index = NgramIndex(n_max=2, n_min=1)
    index.extend([5, 6, 5])
    assert index.propose(4) == [6, 5]
    assert index.propose(1) == [6]
    assert index.propose(0) == []


def test_n_gram_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="n_min"):
        NgramIndex(n_max=1, n_min=2)

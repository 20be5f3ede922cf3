"""Radix prefix cache: match with split, insert returning the cached length, locks, LRU eviction, pages."""

from __future__ import annotations

import torch

from miles.rollout.kv.radix_cache import RadixCache


class FreeLog:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def __call__(self, slots: torch.Tensor) -> None:
        self.freed.extend(slots.tolist())


def make(page_size: int = 1) -> tuple[RadixCache, FreeLog]:
    log = FreeLog()
    return RadixCache(page_size, "cpu", log), log


def slots(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int32)


def test_insert_returns_cached_prefix_and_match_splits_nodes() -> None:
    tree, _ = make()
    assert tree.insert([1, 2, 3, 4, 5], slots(100, 5)) == 0
    assert tree.total_size == 5
    # A second key sharing [1, 2, 3]: three tokens were already there; only [6, 7] are added.
    assert tree.insert([1, 2, 3, 6, 7], slots(200, 5)) == 3
    assert tree.total_size == 7
    match = tree.match_prefix([1, 2, 3, 6, 9])
    assert match.slots.tolist() == [100, 101, 102, 203]
    assert match.node.key == [6]  # the [6, 7] leaf was split at the end of the match
    assert match.node.parent is not None and match.node.parent.key == [1, 2, 3]
    assert tree.match_prefix([1, 2, 3, 4, 5, 8]).slots.tolist() == [100, 101, 102, 103, 104]
    assert tree.match_prefix([9, 1]).length == 0
    assert tree.match_prefix([1, 2]).slots.tolist() == [100, 101]
    assert tree.total_size == 7  # splitting moves tokens between nodes, it never adds any


def test_locked_nodes_survive_eviction_and_unlock_makes_them_evictable() -> None:
    tree, log = make()
    tree.insert([1, 2, 3], slots(10, 3))
    tree.insert([4, 5], slots(20, 2))
    node = tree.match_prefix([1, 2, 3]).node
    tree.inc_lock_ref(node)
    assert (tree.protected_size, tree.evictable_size) == (3, 2)
    assert tree.evict(100) == 2  # only the unlocked branch can go
    assert sorted(log.freed) == [20, 21]
    assert tree.match_prefix([1, 2, 3]).length == 3
    tree.dec_lock_ref(node)
    assert (tree.protected_size, tree.evictable_size) == (0, 3)
    assert tree.evict(1) == 3
    assert tree.total_size == 0 and sorted(log.freed) == [10, 11, 12, 20, 21]


def test_lock_on_a_split_child_protects_the_whole_path() -> None:
    tree, _ = make()
    tree.insert([1, 2, 3, 4], slots(0, 4))
    deep = tree.match_prefix([1, 2, 3, 4]).node
    tree.inc_lock_ref(deep)
    tree.insert([1, 2, 9], slots(50, 3))  # splits the locked node; both halves stay locked
    assert tree.protected_size == 4 and tree.evictable_size == 1
    assert tree.evict(10) == 1
    tree.dec_lock_ref(deep)
    assert tree.evictable_size == 4


def test_eviction_is_least_recently_used_leaf_first() -> None:
    tree, log = make()
    tree.insert([1, 1], slots(10, 2))
    tree.insert([2, 2], slots(20, 2))
    tree.insert([3, 3], slots(30, 2))
    tree.match_prefix([1, 1])  # touch: [2, 2] is now the oldest, then [3, 3]
    assert tree.evict(1) == 2
    assert log.freed == [20, 21]
    assert tree.evict(1) == 2
    assert log.freed[2:] == [30, 31]
    assert tree.match_prefix([1, 1]).length == 2


def test_parent_becomes_evictable_after_its_children() -> None:
    tree, log = make()
    tree.insert([1, 2, 3], slots(0, 3))
    tree.insert([1, 2, 4], slots(10, 3))  # [1,2] parent with leaves [3] and [4]
    assert tree.evict(3) == 4  # two leaves (1 each), then the parent (2) that they left childless
    assert sorted(log.freed) == [0, 1, 2, 12]
    assert tree.total_size == 0


def test_page_aligned_keys() -> None:
    tree, log = make(page_size=4)
    # Only whole pages are stored: 10 tokens -> 8.
    assert tree.insert(list(range(10)), slots(100, 10)) == 0
    assert tree.total_size == 8
    # Matches are page-aligned: a mismatch inside the second page keeps only the first page.
    match = tree.match_prefix([0, 1, 2, 3, 4, 5, 9, 9, 9])
    assert match.slots.tolist() == [100, 101, 102, 103]
    # A key diverging inside the first page shares nothing.
    assert tree.insert([0, 1, 7, 7, 8, 8, 8, 8], slots(200, 8)) == 0
    assert tree.total_size == 16
    tree.evict(100)
    assert tree.total_size == 0 and len(log.freed) == 16


def test_reset_frees_everything() -> None:
    tree, log = make()
    tree.insert([5, 6, 7], slots(0, 3))
    tree.insert([5, 8], slots(3, 2))
    tree.reset()
    assert tree.total_size == 0 and sorted(log.freed) == [0, 1, 2, 4]
    assert tree.match_prefix([5, 6]).length == 0


def _shape(tree: RadixCache) -> list[tuple[list[int], list[int], int, int]]:
    """Every node's key, slots, lock count and last access, in a fixed order."""
    out, stack = [], [tree.root]
    while stack:
        node = stack.pop()
        out.append((node.key, node.value.tolist(), node.lock_ref, node.last_access))
        stack.extend(node.children[k] for k in sorted(node.children, key=str))
    return out


def test_insert_and_touch_equals_insert_then_match() -> None:
    # What a finished request gives back: its tokens inserted, the path touched as a match right after would
    # (same nodes, locks, LRU order and clock), for page sizes 1 and 2, new leaves, splits and full duplicates.
    for page_size in (1, 2):
        keys = [
            [1, 2, 3, 4, 5, 6],
            [1, 2, 3, 7, 8, 9],
            [1, 2, 3, 7, 8, 9],
            [1, 2],
            [5, 5, 5, 5],
            [1, 2, 3, 4, 9],
        ]
        trees = [make(page_size), make(page_size)]
        for i, key in enumerate(keys):
            value = slots(100 * i, len(key))
            a, b = trees[0][0], trees[1][0]
            expected = a.insert(key, value)
            a.match_prefix(key)
            assert b.insert_and_touch(key, value) == expected
            assert _shape(a) == _shape(b)
            assert (a.evictable_size, a.protected_size) == (b.evictable_size, b.protected_size)
        assert trees[0][0].evict(100) == trees[1][0].evict(100)
        assert trees[0][1].freed == trees[1][1].freed

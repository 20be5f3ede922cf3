"""Radix prefix cache over KV slots, with SGLang's semantics.

A tree whose edges are runs of token ids and whose nodes hold the KV slots of those tokens. Requests match
their prompt against it (`match_prefix`, splitting a node when the match ends inside it), pin the matched
path while they run (`inc_lock_ref` / `dec_lock_ref`), and give their computed tokens back (`insert`, which
returns how much was already cached so the caller frees its duplicate slots). When the pool runs short,
`evict` frees least-recently-used unlocked leaves. With page_size > 1 keys are compared and stored in whole
pages, so every node holds whole pages.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class TreeNode:
    key: list[int]
    value: torch.Tensor
    """KV slots of `key`'s tokens."""
    parent: TreeNode | None = None
    children: dict[Any, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


@dataclass
class MatchResult:
    slots: torch.Tensor
    """KV slots of the matched prefix."""
    node: TreeNode
    """Deepest node of the match (lock it while the slots are in use)."""

    @property
    def length(self) -> int:
        return int(self.slots.numel())


class RadixCache:
    def __init__(
        self, page_size: int, device: torch.device | str, free_slots: Callable[[torch.Tensor], None]
    ) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self._free_slots = free_slots
        self._clock = itertools.count(1)
        self.reset(free=False)

    def reset(self, free: bool = True) -> None:
        """Drop every node (freeing their slots when `free`); used on weight updates."""
        if free and hasattr(self, "root"):
            for node in self._nodes():
                if node is not self.root:
                    self._free_slots(node.value)
        self.root = TreeNode(key=[], value=torch.empty(0, dtype=torch.int32, device=self.device))
        self.root.lock_ref = 1  # never evicted
        self.evictable_size = 0
        self.protected_size = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # keys ----------------------------------------------------------------------------------------
    def _child_key(self, key: list[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        if a[:n] == b[:n]:
            return self._aligned(n)
        i = 0
        while a[i] == b[i]:
            i += 1
        return self._aligned(i)

    # queries -------------------------------------------------------------------------------------
    def _walk(self, key: list[int], now: int) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow `key` down the tree (splitting a partly matched node, touching each visited one):
        (deepest matched node, matched length, the matched nodes' slot values in order)."""
        node, pos, values = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                break
            child.last_access = now
            n = self._match_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, pos = child, pos + n
        return node, pos, values

    def match_prefix(self, key: list[int]) -> MatchResult:
        key = key[: self._aligned(len(key))]
        node, _, values = self._walk(key, next(self._clock))
        slots = torch.cat(values) if values else self.root.value
        return MatchResult(slots=slots, node=node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Add `key` -> `value`; returns the length of the prefix that was already cached.

        The caller owns `value[:returned]` as duplicates of cached slots and must free them.
        """
        return self._insert(key, value)[0]

    def _insert(self, key: list[int], value: torch.Tensor) -> tuple[int, TreeNode]:
        """`insert`, also returning the deepest node of `key`'s path."""
        key = key[: self._aligned(len(key))]
        now = next(self._clock)
        node, pos, _ = self._walk(key, now)
        if pos < len(key):
            leaf = TreeNode(key=list(key[pos:]), value=value[pos : len(key)], parent=node, last_access=now)
            node.children[self._child_key(leaf.key)] = leaf
            self.evictable_size += len(leaf.key)
            node = leaf
        return pos, node

    def insert_and_touch(self, key: list[int], value: torch.Tensor) -> int:
        """`insert`, then the key's path touched once more, as a `match_prefix(key)` right after it would:
        the same tree and LRU order without that second walk and its slot concatenation (a finished request
        gives its tokens back and needs none of the tree's slots)."""
        pos, node = self._insert(key, value)
        now = next(self._clock)
        while node is not self.root:
            node.last_access = now
            node = node.parent  # type: ignore[assignment]
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        parent = child.parent
        assert parent is not None
        head = TreeNode(
            key=child.key[:n],
            value=child.value[:n],
            parent=parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        child.key, child.value, child.parent = child.key[n:], child.value[n:], head
        head.children[self._child_key(child.key)] = child
        parent.children[self._child_key(head.key)] = head
        return head

    # locks ---------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unbalanced radix lock"
            node = node.parent  # type: ignore[assignment]

    # eviction ------------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, least recently used first (or all there are)."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self._free_slots(leaf.value)
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

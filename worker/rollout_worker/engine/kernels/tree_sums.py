"""Fixed-tree sums: the deterministic kernels' one order for every reduction whose order could change.

:func:`tree_sum` adds along a dimension in one fixed pairwise tree, the same for any number of trailing
exact zeros (so a row's masked key chunks, or chunks past a shard's, change nothing). A row-parallel
product's chunks are added in that tree whatever the TP size: each shard adds the whole subtrees it holds
(:func:`tree_nodes`, :func:`node_sums`), and the gathered subtrees are added up the same tree
(:func:`tree_root`). On CUDA, whose reduction kernels lay out their threads by the row count, the sums over
a row (RMSNorm's mean, the softmax's denominator) are such trees of elementwise adds too (:func:`sum_last`,
:func:`mean_last`); on CPU torch's own sums over a row are already the same for every row.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch


def tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in a fixed pairwise tree (``((p0 + p1) + (p2 + p3)) + ...``, odd levels padded with
    zeros), the same for any number of trailing exact zeros."""
    while parts.shape[0] > 1:
        if parts.shape[0] % 2:
            parts = torch.cat((parts, torch.zeros_like(parts[:1])))
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension: torch's on CPU (vectorised the same way for every row), a fixed
    pairwise tree of elementwise adds on CUDA (whose reduction kernels lay out threads by the row count)."""
    return tree_sum(x.movedim(-1, 0)) if x.is_cuda else x.sum(-1)


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """The mean over the last dimension, kept (RMSNorm's), each row's the same whatever the batch."""
    return (sum_last(x) / x.shape[-1])[..., None] if x.is_cuda else x.mean(-1, keepdim=True)


Node = tuple[int, int]  # (level, index) in tree_sum's tree: level l's node j adds chunks [j * 2**l, ...)


@functools.cache
def tree_nodes(lo: int, hi: int, n: int) -> tuple[Node, ...]:
    """Chunks [lo, hi) of a tree over ``n`` chunks as the fewest whole subtrees of :func:`tree_sum`'s
    tree, left to right: at each chunk the highest node that starts there and ends by ``hi`` (or, for the
    last shard, holds the tree's right edge: chunk ``n - 1`` and the zeros padding it)."""
    top = max(n - 1, 0).bit_length()  # the root's level
    out: list[Node] = []
    c = lo
    while c < hi:
        level = 0  # up while the parent starts at c too and ends by hi (or at the tree's right edge)
        while level < top and c % (2 << level) == 0 and min(c + (2 << level), n) <= hi:
            level += 1
        out.append((level, c >> level))
        c = min(c + (1 << level), n)
    return tuple(out)


def node_sums(parts: torch.Tensor, lo: int, n: int, nodes: Iterable[Node]) -> torch.Tensor:
    """[len(nodes), ...]: each node's sum of ``parts`` (chunks lo, lo + 1, ... of a tree over ``n``),
    bitwise as :func:`tree_sum` over every chunk computes it: a whole node's chunks in its own tree, then the
    zeros the tree adds to a node at its right edge on the levels above the node's own chunks."""
    sums = []
    for level, j in nodes:
        a = j << level
        b = min(a + (1 << level), n)
        value = tree_sum(parts[a - lo : b - lo])
        for _ in range(level - max(b - a - 1, 0).bit_length()):  # the levels tree_sum(slice) stopped below
            value = value + torch.zeros_like(value)
        sums.append(value)
    return torch.stack(sums)


def tree_root(known: dict[Node, torch.Tensor], n: int) -> torch.Tensor:
    """:func:`tree_sum` of ``n`` chunks from the sums of subtrees that partition them (``known``),
    bitwise: every node above them is its two children's sum, a child past chunk ``n - 1`` a zero."""

    def value(level: int, j: int) -> torch.Tensor:
        got = known.get((level, j))
        if got is not None:
            return got
        if level == 0:
            raise KeyError(f"chunk {j} is in no subtree")
        left = value(level - 1, 2 * j)
        if (2 * j + 1) << (level - 1) >= n:
            return left + torch.zeros_like(left)
        return left + value(level - 1, 2 * j + 1)

    return value(max(n - 1, 0).bit_length(), 0)

"""The verify leader's copy of the token tree the draft last sent, so it never has to wait.

The draft sends its best `m` nodes (m > bs) in best-first order, parents before children. The
verify group checks the first `bs` of them. After the step, the verify leader re-roots its copy
on the accepted tokens: if the target's bonus token was drafted, the nodes under it are the
next tree to verify right away, without the round trip to the draft (which keeps expanding and
sends a fresher tree; the newest one that reaches the current root wins). Trees that arrive
late are re-rooted along the tokens committed since they were sent.

Arrays are tiny (m <= a few dozen nodes); plain numpy is fast enough.
"""
from __future__ import annotations

import numpy as np


def subtree_under(tokens: np.ndarray, parents: np.ndarray, walk: list[int] | np.ndarray):
    """Follow `walk` (tokens, each a child of the previous node, starting below the root) and
    return the subtree under the last node as (idx int64[n'], parents int32[n']): the indices of
    its nodes in `tokens` in the same best-first order (the new root first) and their parents
    as indices into idx; None when the walk leaves the tree.

    tokens int64[n], parents int32[n] (-1 for the root at index 0, parents before children)."""
    cur = 0
    for t in walk:
        hit = np.flatnonzero((parents == cur) & (tokens == int(t)))
        if len(hit) == 0:
            return None
        cur = int(hit[0])
    n = len(tokens)
    keep = np.zeros(n, dtype=bool)
    keep[cur] = True
    for i in range(cur + 1, n):           # parents precede children: one forward pass
        if parents[i] >= 0 and keep[parents[i]]:
            keep[i] = True
    idx = np.flatnonzero(keep)
    remap = np.full(n, -1, dtype=np.int64)
    remap[idx] = np.arange(len(idx))
    new_parents = np.where(parents[idx] >= 0, remap[np.maximum(parents[idx], 0)], -1).astype(np.int32)
    new_parents[0] = -1
    return idx, new_parents


def reroot_scored(tree, walk: list[int] | np.ndarray):
    """tree = (tokens int64[n], parents int32[n], scores float64[n]: path log-probabilities from
    the root) -> the same three of the subtree under `walk` (subtree_under), the scores rebased
    on the new root (0 there); None when the walk leaves the tree (or tree is None)."""
    if tree is None:
        return None
    tokens, parents, scores = tree
    sub = subtree_under(tokens, parents, walk)
    if sub is None:
        return None
    idx, new_parents = sub
    return tokens[idx].astype(np.int64), new_parents, scores[idx] - scores[idx[0]]


def draft_mass(scores: np.ndarray) -> float:
    """The draft's expected count of accepted draft tokens in a tree whose nodes have path
    log-probabilities `scores` float64[n] (0 at the root, index 0): the sum of the non-root
    nodes' path probabilities, i.e. what a target that agreed with the draft's distribution
    would accept on average."""
    return float(np.exp(scores[1:]).sum())


def tree_depth(parents: np.ndarray) -> int:
    """Edges from the root to the deepest node; parents int32[n] (-1 at the root, parents before
    children)."""
    depth = np.zeros(len(parents), dtype=np.int64)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return int(depth.max()) if len(parents) else 0

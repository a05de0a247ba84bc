"""Positions and attention mask of a token tree placed after a prefix, for model-level tests."""
from __future__ import annotations

import torch


def tree_mask(parents: list[int], P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree nodes 0..n-1 (parents[i] < i, -1 for the root) in KV slots [P, P + n) after a P-token
    prefix -> (positions [n] int64: P + depth, mask [n, P + n] bool: the prefix and each node's
    ancestors and itself)."""
    n = len(parents)
    mask = torch.zeros(n, P + n, dtype=torch.bool)
    mask[:, :P] = True
    depth = []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        j = i
        while j >= 0:
            mask[i, P + j] = True
            j = parents[j]
    return torch.tensor([P + d for d in depth]), mask

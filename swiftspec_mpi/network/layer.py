"""`Layer`: the weights and KV buffers of one decoder layer of a Transformer, by name."""
from __future__ import annotations

from typing import NamedTuple

import torch


class Layer(NamedTuple):
    """One decoder layer of this rank's shard (T = tensor-parallel degree, H = hidden size,
    q = local query heads x head_dim, kv = local KV heads x head_dim, I = intermediate_size / T).
    The four matrices are stored in the model's `weight_layout`: "out_in" [out, in] as below,
    "in_out" transposed, "packed" a cpu_linear.PackedWeight of the same [out, in]; with
    quant "int4" (GPU) a gpu.w4a16.W4A16Weight of the same [out, in]."""
    ln1: torch.Tensor               # [H] input RMSNorm weight
    wqkv: torch.Tensor              # [q + 2 kv, H]: this rank's q heads, then its K, then its V rows
    bqkv: torch.Tensor | None       # [q + 2 kv] QKV bias (Qwen2), else None
    wo: torch.Tensor                # [H, q] O projection (row-parallel: summed over the group)
    bo: torch.Tensor | None         # [H] O bias on rank 0 of the group when the model has one
    ln2: torch.Tensor               # [H] post-attention RMSNorm weight
    wgu: torch.Tensor               # [2 I, H] gate rows [0, I), then up rows [I, 2 I)
    wd: torch.Tensor                # [H, I] down projection (row-parallel)
    k_cache: torch.Tensor           # [max_slots, local KV heads, head_dim] view of Transformer.k_cache
    v_cache: torch.Tensor           # [max_slots, local KV heads, head_dim] view of Transformer.v_cache

    def weights(self) -> tuple:
        """The eight weight tensors (ln1 .. wd; a bias may be None), not the KV buffers."""
        return self[:8]

"""A decoder layer's four projections as packed 4-bit weights on the GPU (`--quant int4`).

`load_projections(source, prefix, shard, head_dim, device)` reads this rank's shard of q/k/v,
o, gate/up and down from a source that yields `PackedInt4` slices (`get_packed(name, dim, start,
stop)`: rows along dim 0, whole groups of inputs along dim 1) and returns them fused the way
`Transformer` keeps its bf16 weights, repacked for cuda/w4a16.cu (swiftspec_mpi.gpu.w4a16):

    wqkv [q_rows + 2 kv_rows, H]   this rank's q heads, then its k heads, then its v heads
    wo   [H, q_rows]               the input columns of its q heads (row-parallel)
    wgu  [2 inter_l, H]            its gate rows, then its up rows
    wd   [H, inter_l]              its intermediate columns (row-parallel)
"""
from __future__ import annotations

from swiftspec_mpi.core.errors import CheckpointError


def load_projections(source, prefix: str, shard, head_dim: int, device) -> tuple:
    """-> (wqkv, wo, wgu, wd) as swiftspec_mpi.gpu.w4a16.W4A16Weight on `device` (shapes above)."""
    from swiftspec_mpi.gpu import w4a16

    def get(name, dim=None, start=0, stop=None):
        w = source.get_packed(prefix + name, dim, start, stop)
        try:
            return w4a16.from_packed(w, device)
        except ValueError as e:
            raise CheckpointError(f"tensor {prefix + name!r}: {e}") from None

    qkv = [get("self_attn.q_proj.weight", 0, *shard.q_rows)]
    for proj in ("k_proj", "v_proj"):
        qkv += [get(f"self_attn.{proj}.weight", 0, a, b) for a, b in shard.kv_runs(head_dim)]
    wo = get("self_attn.o_proj.weight", 1, *shard.q_rows)
    wgu = w4a16.cat_rows([get("mlp.gate_proj.weight", 0, *shard.ff), get("mlp.up_proj.weight", 0, *shard.ff)])
    wd = get("mlp.down_proj.weight", 1, *shard.ff)
    return w4a16.cat_rows(qkv), wo, wgu, wd

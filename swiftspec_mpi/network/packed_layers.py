"""A decoder layer's four projections as packed 4-bit weights on the GPU (`--quant int4`), and
the LM head packed at load (`--head-bits 4`, `quantize_head`).

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


HEAD_GROUP = 128        # --head-bits 4: inputs per group of the packed LM head


def quantize_head(head, device, rows_per_step: int = 8192):
    """A bf16 LM head [V, H] (V a multiple of 16, H of 128) -> the W4A16Weight of its
    round-to-nearest 4-bit quantization (asymmetric, min/max per group of HEAD_GROUP inputs, fp16
    scales, as AutoAWQ without calibration rounds), about `rows_per_step` rows at a time on `device`
    (the float32 temporaries stay small). Its error is a 4-bit weight's, not a bf16 one's
    (tests/test_w4a16_gpu.py measures it): greedy tokens change where the top logits are close."""
    import torch

    from swiftspec_mpi.gpu import w4a16
    from swiftspec_mpi.packed.int4 import quantize_rtn
    from swiftspec_mpi.packed.int4 import PackedInt4, pack_codes
    v, h = head.shape
    if not w4a16.supported(v, h, HEAD_GROUP):
        raise CheckpointError(f"--head-bits 4: the LM head slice [{v}, {h}] does not fit the 4-bit "
                              f"kernels (rows a multiple of {w4a16.TILE}, inputs of {w4a16.CHUNK}); "
                              "use --head-bits 16")
    step = max(w4a16.TILE, rows_per_step // w4a16.TILE * w4a16.TILE)    # whole tiles per part
    parts = []
    for r in range(0, v, step):
        w = head[r:r + step].to(device=device, dtype=torch.float32)
        codes, zeros, scales = quantize_rtn(w, HEAD_GROUP)
        scale = scales.float()
        parts.append(w4a16.from_packed(PackedInt4(pack_codes(codes), scale, -zeros.float() * scale,
                                                  HEAD_GROUP), device))
    return w4a16.cat_rows(parts)

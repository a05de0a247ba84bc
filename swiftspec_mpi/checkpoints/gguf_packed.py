"""A GGUF file's matrices read in their packed 4-/8-bit kinds, a few MiB at a time (the packed
side of gguf_loader.GGUFSource).

    packed_group(ggml type name) -> int | None    inputs per scale of the packed kind the type
                                                  becomes (gguf_quant.to_packed), None: dense
    file_group(src) -> int | None                 the largest such group over the layers'
                                                  matrices of a GGUFSource, None when all dense
    read_chunks(src, name, dim=None, start=0, stop=None)
        yields (row offset, rows) covering the slice of matrix `name` in row order: PackedInt4 /
        PackedInt8 [n, K'] rows (exact, gguf_quant), or float32 [n, K'] rows for dense types
        (F32/F16/BF16, Q2_K/Q3_K/Q5_K, dequantized); n a multiple of 16 except at the end.
"""
from __future__ import annotations

import numpy as np

from swiftspec_mpi.core.errors import CheckpointError

_CHUNK_FLOATS = 4 << 20          # weights decoded per chunk (about 16 MiB of float32)
# (the types' packed groups: gguf_quant.to_packed; named here so that this table needs no torch)
_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q6_K")
_MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def packed_group(qtype: str) -> int | None:
    """Inputs per scale/offset of the packed kind holding GGUF type `qtype` (the 4-bit types and
    Q5_0/Q5_1/Q8_0: 32, Q6_K: 16), None for a type kept dense."""
    if qtype in _INT4_TYPES:
        return 32
    if qtype in _INT8_TYPES:
        return 16 if qtype == "Q6_K" else 32
    return None


def file_group(src) -> int | None:
    """The largest packed group over the layer matrices of GGUFSource `src`; None when none of
    them has a packed kind (a dense F16/BF16/F32 file)."""
    groups = [packed_group(src.ggml_type(n)) for n in src.names()
              if n.endswith(".weight") and any(f".{m}." in n for m in _MATRICES)]
    groups = [g for g in groups if g is not None]
    return max(groups) if groups else None


def read_chunks(src, name: str, dim: int | None = None, start: int = 0,
                stop: int | None = None):
    """Yield (row offset, rows) for the slice of 2-D tensor `name` of GGUFSource `src` (see the
    module doc). A column slice (dim 1, a row-parallel shard) must fall on the packed kind's
    group boundaries (CheckpointError naming the fix)."""
    import torch

    from swiftspec_mpi.checkpoints import gguf_quant
    info = src._info(name)
    shape, rows, cols = src._plan(name, dim, start, stop)
    if len(info.shape) != 2:
        raise CheckpointError(f"{src.path}: tensor {name!r} is not a matrix")
    qtype = info.qtype.name
    g = packed_group(qtype) or 1
    if dim == 1 and (start % g or shape[1] % g):
        raise CheckpointError(f"{src.path}: tensor {name!r}: columns [{start}:{stop}) split "
                              f"{qtype} groups of {g}; use a tensor-parallel degree that keeps "
                              "whole groups per rank")
    step = max(16, _CHUNK_FLOATS // info.shape[1] // 16 * 16)
    contiguous = name not in src._permuted
    for c0 in range(0, len(rows), step):
        part = rows[c0:c0 + step]
        if contiguous:
            raw = src._read(info.offset + int(part[0]) * info.row_bytes,
                            len(part) * info.row_bytes).reshape(len(part), info.row_bytes)
        else:
            raw = np.stack([src._read(info.offset + int(r) * info.row_bytes, info.row_bytes)
                            for r in part])
        w = gguf_quant.to_packed(raw, qtype, info.shape[1])
        if w is None:
            deq = src._dequantize(raw, info.qtype)
            w = torch.from_numpy(np.ascontiguousarray(deq[:, cols], np.float32))
        elif dim == 1:
            w = gguf_quant.take_columns(w, start, stop)
        yield c0, w
        del raw, w

"""GGUF quantized blocks -> the packed weight kinds, exactly (no float rounding on the way).

    to_packed(raw uint8 [R, row_bytes], qtype name, K) -> PackedInt4 | PackedInt8 | None

4-bit types become `int4.PackedInt4` (group 32), the other block types `int8.PackedInt8`
(Q6_K: group 16, else 32); None for types neither holds exactly (F32/F16/BF16 and the 2-, 3-
and 5-bit K-quants), which the caller keeps dense in float32. Per block (ggml's layouts, as
gguf.quants reads them):

    Q4_0  [d f16][qs 16 B]                 q = nibbles, k < 16 low, k >= 16 high
          scale = d, offset = -8 d
    Q4_1  [d f16][m f16][qs 16 B]          scale = d, offset = m
    Q4_K  [d f16][dmin f16][scales 12 B][qs 128 B]   8 sub-blocks of 32: 6-bit sc and m
          scale = d * sc, offset = -(dmin * m); 64 weights per 32 bytes, low nibbles first
    Q8_0  [d f16][qs 32 x int8]            -> int8, scale = d
    Q5_0  [d f16][qh 4 B][qs 16 B]         -> int8 q - 16, scale = d
    Q5_1  [d f16][m f16][qh 4 B][qs 16 B]  -> int8 q, scale = d, offset = m
    Q6_K  [ql 128 B][qh 64 B][scales 16 x int8][d f16]   16 sub-blocks of 16
          -> int8 q - 32, scale = d * sc

The scale and offset are the very float32 products gguf.quants.dequantize forms, so
int4.dequantize / int8.dequantize of the result equal the reference bit for bit (tests
compare every type on blocks from gguf's own writer, or built by the layout where gguf cannot
quantize the type).
"""
from __future__ import annotations

import numpy as np
import torch

from swiftspec_mpi.packed.int4 import PackedInt4, SuperScales, pack_codes
from swiftspec_mpi.packed.int8 import PackedInt8

# (block weights, block bytes, packed kind) of the types held exactly
INT4_TYPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}
INT8_TYPES = {"Q8_0": (32, 34), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q6_K": (256, 210)}


def _f16(b: np.ndarray) -> np.ndarray:
    """uint8 [nb, 2] -> float32 [nb, 1] (fp16 widened exactly)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """uint8 [nb, c, width/2] -> uint8 [nb, c * width]: each run of `width` codes is the low
    nibbles of its width/2 bytes, then their high nibbles (ggml's order)."""
    lo, hi = qs & np.uint8(0x0F), qs >> np.uint8(4)
    return np.concatenate((lo, hi), axis=-1).reshape(qs.shape[0], -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5 qh uint8 [nb, 4] -> uint8 [nb, 32]: bit i of the little-endian uint32 as the 5th bit."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return ((bits & np.uint32(1)).astype(np.uint8)) << np.uint8(4)


def _q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes -> (sc, m) uint8 [nb, 8] (6 bits each)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc, mn


def _decode(blocks: np.ndarray, qtype: str):
    """uint8 [nb, block bytes] -> (codes [nb, block weights], scale [nb, g], offset [nb, g] or
    None[, (d [nb, 1], sc int8 [nb, g], dmin [nb, 1] or None, m int8 [nb, g] or None)]) with g
    groups per block; codes uint8 0..15 (int4 kinds) or int8; the last item (K-quants only)
    holds the two levels the scale and offset are products of."""
    nb = blocks.shape[0]
    if qtype == "Q4_0":
        d = _f16(blocks[:, 0:2])
        return _nibbles(blocks[:, 2:18], 32), d, np.float32(-8) * d
    if qtype == "Q4_1":
        return (_nibbles(blocks[:, 4:20], 32), _f16(blocks[:, 0:2]),
                _f16(blocks[:, 2:4]))
    if qtype == "Q4_K":
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _q4k_scale_min(blocks[:, 4:16])
        codes = _nibbles(blocks[:, 16:144].reshape(nb, 4, 32), 64)
        return (codes, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)),
                (d, sc.view(np.int8), dmin, mn.view(np.int8)))
    if qtype == "Q8_0":
        return blocks[:, 2:34].view(np.int8), _f16(blocks[:, 0:2]), None
    if qtype in ("Q5_0", "Q5_1"):
        o = 0 if qtype == "Q5_0" else 2
        d = _f16(blocks[:, 0:2])
        q = _nibbles(blocks[:, 6 + o:22 + o], 32) | _high_bits(blocks[:, 2 + o:6 + o])
        if qtype == "Q5_0":
            return q.astype(np.int8) - np.int8(16), d, None
        return q.astype(np.int8), d, _f16(blocks[:, 2:4])
    if qtype == "Q6_K":
        ql = blocks[:, 0:128].reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & np.uint8(0x0F)).reshape(nb, 8, 32)
        qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & np.uint8(0x03)).reshape(nb, 8, 32)
        q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
        sc8 = blocks[:, 192:208].view(np.int8)
        d = _f16(blocks[:, 208:210])
        return q.reshape(nb, 256), d * sc8.astype(np.float32), None, (d, sc8, None, None)
    raise ValueError(f"no packed form for ggml type {qtype}")


def to_packed(raw: np.ndarray, qtype: str, k: int) -> PackedInt4 | PackedInt8 | None:
    """GGUF rows (uint8 [R, row_bytes], whole blocks per row, K weights each) -> the packed kind
    holding them exactly, or None for a type kept dense (see the module docstring)."""
    if qtype in INT4_TYPES:
        bw, bb = INT4_TYPES[qtype]
    elif qtype in INT8_TYPES:
        bw, bb = INT8_TYPES[qtype]
    else:
        return None
    r = raw.shape[0]
    if k % bw or raw.shape[1] != k // bw * bb:
        raise ValueError(f"{qtype} rows of {raw.shape[1]} bytes do not hold {k} weights")
    codes, scale, offset, *levels = _decode(np.ascontiguousarray(raw).reshape(-1, bb), qtype)
    g = bw // scale.shape[1]

    def rows(a, width):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a).reshape(r, width))
    scale, offset = rows(scale, k // g), rows(offset, k // g)
    sup = None
    if levels:                   # K-quants: one super-block a block
        d, sc, dmin, m = levels[0]
        sup = SuperScales(rows(d, k // bw), rows(sc, k // g), rows(dmin, k // bw), rows(m, k // g))
    codes = torch.from_numpy(np.ascontiguousarray(codes).reshape(r, k))
    if qtype in INT4_TYPES:
        return PackedInt4(pack_codes(codes), scale, offset, g, sup)
    return PackedInt8(codes.view(torch.int8), scale, offset, g, sup)


def take_columns(w: PackedInt4 | PackedInt8, start: int, stop: int):
    """Columns [start, stop) of a packed weight; both must be multiples of its group."""
    g = w.group
    if start % g or stop % g:
        raise ValueError(f"columns [{start}, {stop}) split groups of {g}")
    sl = slice(start // g, stop // g)
    off = None if w.offset is None else w.offset[:, sl].contiguous()
    sup = None if w.sup is None else w.sup.cols(start, stop, g)
    if isinstance(w, PackedInt4):
        return PackedInt4(w.qweight[:, start // 2:stop // 2].contiguous(),
                          w.scale[:, sl].contiguous(), off, g, sup)
    return PackedInt8(w.qweight[:, start:stop].contiguous(), w.scale[:, sl].contiguous(), off, g,
                      sup)

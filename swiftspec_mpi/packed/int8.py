"""The packed 8-bit weight kind: GGUF's other block types (Q8_0, Q5_0, Q5_1, Q6_K) held exactly.

A `PackedInt8` holds one linear layer's W (nn.Linear's [out, in] = [N, K]) as signed 8-bit codes
with a scale (and, for asymmetric formats, an offset) per group of `group` consecutive inputs:

    qweight  int8    [N, K]
    scale    float32 [N, K // group]
    offset   float32 [N, K // group] or None (symmetric: offset 0)
    group    16 or 32; divides K

    W[n, k] = float32(q[n, k]) * scale[n, k // group] (+ offset[n, k // group])

    GGUF Q8_0   q = qs                 scale = d                  (per 32)
    GGUF Q5_0   q = code - 16          scale = d                  (per 32)
    GGUF Q5_1   q = code               scale = d   offset = m     (per 32)
    GGUF Q6_K   q = code - 32          scale = d * sc             (per 16 of a 256 super-block)

(d, m fp16, sc an int8: every product is exact in float32, and the reference dequantization of
each format computes the very same products, so `dequantize` equals it bit for bit.) It is the
8-bit companion of `int4.PackedInt4`: 9-10 bits a weight instead of 16 (bf16) or 32 (float32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from swiftspec_mpi.packed.int4 import SuperScales

GROUP_SIZES = (16, 32)


@dataclass
class PackedInt8:
    """One layer's packed 8-bit weight; shapes in the module docstring."""
    qweight: torch.Tensor            # int8 [N, K]
    scale: torch.Tensor              # float32 [N, K // group]
    offset: torch.Tensor | None      # float32 [N, K // group] or None
    group: int
    sup: SuperScales | None = None   # Q6_K's two levels (scale = d sc; codes in [-32, 31])

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1]

    def nbytes(self) -> int:
        parts = (self.qweight, self.scale) + (() if self.offset is None else (self.offset,))
        return sum(t.numel() * t.element_size() for t in parts)

    def check(self) -> None:
        """Raise ValueError when the parts do not fit together (shape, dtype, group)."""
        n, k = self.shape
        if self.group not in GROUP_SIZES or k % self.group:
            raise ValueError(f"8-bit group size {self.group} must be one of {GROUP_SIZES} and "
                             f"divide the input dimension {k}")
        if self.qweight.dtype != torch.int8:
            raise ValueError(f"8-bit qweight is {self.qweight.dtype}, expected int8")
        want = (n, k // self.group)
        for name in ("scale", "offset"):
            t = getattr(self, name)
            if t is not None and (tuple(t.shape) != want or t.dtype != torch.float32):
                raise ValueError(f"8-bit {name} is {tuple(t.shape)} {t.dtype}, expected {want} "
                                 "float32")


def dequantize(w: PackedInt8) -> torch.Tensor:
    """The reference dequantization: float32 [N, K], W = q * scale (+ offset) per group."""
    n, k = w.shape
    q = w.qweight.to(torch.float32).reshape(n, k // w.group, w.group)
    out = q * w.scale.unsqueeze(-1)
    if w.offset is not None:
        out = out + w.offset.unsqueeze(-1)
    return out.reshape(n, k)

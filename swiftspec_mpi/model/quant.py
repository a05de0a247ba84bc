"""The packed 4-bit weight kind: one layout that holds GGUF Q4_0/Q4_1/Q4_K, AWQ and GPTQ exactly.

A `PackedInt4` holds one linear layer's W (nn.Linear's [out, in] = [N, K]) as 4-bit codes with a
scale and an offset per group of `group` consecutive inputs:

    qweight  uint8   [N, K // 2]        code q[n, k] = nibble (k % 2) of byte qweight[n, k // 2]
                                        (low nibble = even k)
    scale    float32 [N, K // group]
    offset   float32 [N, K // group]
    group    32, 64 or 128; divides K

    W[n, k] = float32(q[n, k]) * scale[n, k // group] + offset[n, k // group]

Each source format maps onto it with products that are exact in float32, so `dequantize` gives
the very values of the format's own reference dequantization:

    GGUF Q4_0   scale = d            offset = -8 d                 (per 32)
    GGUF Q4_1   scale = d            offset = m                    (per 32)
    GGUF Q4_K   scale = d * sc       offset = -(dmin * m)          (per 32 of a 256 super-block)
    AWQ, GPTQ   scale = s            offset = -(z * s)             (per group; z the zero point)

(d, dmin, s are fp16 and sc, m are 6-bit integers: each product has at most 17 significant bits,
and q * scale at most 21, so no product rounds and W needs one rounding at most, the one the
reference makes too.) Kernels repack this layout for their own memory order; it is the form
loaders produce and tests compare against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZES = (32, 64, 128)


@dataclass
class PackedInt4:
    """One layer's packed 4-bit weight; shapes in the module docstring."""
    qweight: torch.Tensor     # uint8 [N, K // 2]
    scale: torch.Tensor       # float32 [N, K // group]
    offset: torch.Tensor      # float32 [N, K // group]
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the dense weight this stands for."""
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.offset))

    def check(self) -> None:
        """Raise ValueError when the parts do not fit together (shape, dtype, group)."""
        n, k = self.shape
        if self.group not in GROUP_SIZES or k % self.group:
            raise ValueError(f"4-bit group size {self.group} must be one of {GROUP_SIZES} and "
                             f"divide the input dimension {k}")
        want = (n, k // self.group)
        for name in ("scale", "offset"):
            t = getattr(self, name)
            if tuple(t.shape) != want or t.dtype != torch.float32:
                raise ValueError(f"4-bit {name} is {tuple(t.shape)} {t.dtype}, expected {want} float32")
        if self.qweight.dtype != torch.uint8:
            raise ValueError(f"4-bit qweight is {self.qweight.dtype}, expected uint8")


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 codes [N, K] (0..15), low nibble first."""
    lo = qweight & 0x0F
    hi = qweight >> 4
    return torch.stack((lo, hi), dim=-1).reshape(qweight.shape[0], -1)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15, K even) -> uint8 [N, K // 2], the inverse of `unpack_codes`."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return c[..., 0] | (c[..., 1] << 4)


def dequantize(w: PackedInt4) -> torch.Tensor:
    """The reference dequantization: float32 [N, K], W = q * scale + offset per group."""
    n, k = w.shape
    q = unpack_codes(w.qweight).to(torch.float32).reshape(n, k // w.group, w.group)
    out = q * w.scale.unsqueeze(-1) + w.offset.unsqueeze(-1)
    return out.reshape(n, k)

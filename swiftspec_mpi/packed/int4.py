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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GROUP_SIZES = (32, 64, 128)
SUPER_BLOCK = 256            # inputs per K-quant super-block


@dataclass
class SuperScales:
    """A K-quant's scales in its own two levels (GGUF Q4_K, Q6_K), kept beside the float32 ones
    so a kernel can hold them in fewer bytes (csrc/gemm_q.h's K4 / K6 records):

        d    float32 [N, K // 256]   sc int8 [N, K // group]     scale  = d[n, s] * sc[n, g]
        dmin float32 [N, K // 256]   m  int8 [N, K // group]     offset = -(dmin[n, s] * m[n, g])
                                                                  (Q4_K; None for Q6_K)
    with s = g // (256 // group) the group's super-block: the very float32 products held in
    `scale` / `offset`, which stay the reference."""
    d: torch.Tensor
    sc: torch.Tensor
    dmin: torch.Tensor | None = None
    m: torch.Tensor | None = None

    def rows(self, start: int, stop: int) -> "SuperScales":
        return SuperScales(*(None if t is None else t[start:stop] for t in
                             (self.d, self.sc, self.dmin, self.m)))

    def cols(self, start: int, stop: int, group: int) -> "SuperScales | None":
        """Inputs [start, stop), or None when they cut a super-block."""
        if start % SUPER_BLOCK or stop % SUPER_BLOCK:
            return None
        sb, g = slice(start // SUPER_BLOCK, stop // SUPER_BLOCK), slice(start // group, stop // group)
        return SuperScales(self.d[:, sb].contiguous(), self.sc[:, g].contiguous(),
                           None if self.dmin is None else self.dmin[:, sb].contiguous(),
                           None if self.m is None else self.m[:, g].contiguous())

    @staticmethod
    def cat(parts: list["SuperScales | None"]) -> "SuperScales | None":
        import torch
        if any(p is None for p in parts):
            return None
        return SuperScales(*(None if getattr(parts[0], f) is None else
                             torch.cat([getattr(p, f) for p in parts])
                             for f in ("d", "sc", "dmin", "m")))


@dataclass
class PackedInt4:
    """One layer's packed 4-bit weight; shapes in the module docstring."""
    qweight: torch.Tensor     # uint8 [N, K // 2]
    scale: torch.Tensor       # float32 [N, K // group]
    offset: torch.Tensor      # float32 [N, K // group]
    group: int
    sup: SuperScales | None = None   # Q4_K's two levels (scale = d sc, offset = -(dmin m))

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the dense weight this stands for."""
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.offset))

    def check(self) -> None:
        """Raise ValueError when the parts do not fit together (shape, dtype, group)."""
        import torch
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
    import torch
    lo = qweight & 0x0F
    hi = qweight >> 4
    return torch.stack((lo, hi), dim=-1).reshape(qweight.shape[0], -1)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15, K even) -> uint8 [N, K // 2], the inverse of `unpack_codes`."""
    import torch
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return c[..., 0] | (c[..., 1] << 4)


def quantize_rtn(w: torch.Tensor, group: int, sym: bool = False):
    """Round-to-nearest 4-bit quantization of a float weight [N, K] in groups of `group` inputs,
    as AutoAWQ (asymmetric, min/max) and GPTQ without calibration (sym: zero 8) compute it.
    -> (codes uint8 [N, K], zeros uint8 [N, K / group], scales float16 [N, K / group]);
    W ~ (codes - zeros) * scales."""
    import torch
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    if sym:
        scales = (wg.abs().amax(-1) * 2 / 15).clamp(min=1e-5).half()
        zeros = torch.full_like(scales, 8, dtype=torch.float32)
    else:
        hi, lo = wg.amax(-1), wg.amin(-1)
        scales = ((hi - lo) / 15).clamp(min=1e-5).half()
        zeros = (-torch.round(lo / scales.float())).clamp(0, 15)
    codes = (torch.round(wg / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, 15)
    return codes.reshape(n, k).to(torch.uint8), zeros.to(torch.uint8), scales


def dequantize(w: PackedInt4) -> torch.Tensor:
    """The reference dequantization: float32 [N, K], W = q * scale + offset per group."""
    import torch
    n, k = w.shape
    q = unpack_codes(w.qweight).to(torch.float32).reshape(n, k // w.group, w.group)
    out = q * w.scale.unsqueeze(-1) + w.offset.unsqueeze(-1)
    return out.reshape(n, k)


# ------------------------------------------------------------------------------ sharding
def take_rows(w: PackedInt4, start: int, stop: int) -> PackedInt4:
    """Outputs [start, stop) of w (a column-parallel shard: any rows), as views."""
    return PackedInt4(w.qweight[start:stop], w.scale[start:stop], w.offset[start:stop], w.group,
                      None if w.sup is None else w.sup.rows(start, stop))


def take_cols(w: PackedInt4, start: int, stop: int) -> PackedInt4:
    """Inputs [start, stop) of w (a row-parallel shard), as views; ValueError unless both ends
    fall on group boundaries (a group's scale and offset cannot be split)."""
    g = w.group
    if start % g or stop % g or not 0 <= start <= stop <= w.shape[1]:
        raise ValueError(f"inputs [{start}:{stop}) of a 4-bit weight with {w.shape[1]} inputs "
                         f"do not fall on its group boundaries (groups of {g})")
    return PackedInt4(w.qweight[:, start // 2:stop // 2], w.scale[:, start // g:stop // g],
                      w.offset[:, start // g:stop // g], g,
                      None if w.sup is None else w.sup.cols(start, stop, g))


def cat_rows(parts: list[PackedInt4]) -> PackedInt4:
    """Stack weights of the same inputs and group along the outputs (fused QKV, gate|up)."""
    import torch
    if len({(p.shape[1], p.group) for p in parts}) != 1:
        raise ValueError("cat_rows: parts differ in input size or group")
    return PackedInt4(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.offset for p in parts]), parts[0].group,
                      SuperScales.cat([p.sup for p in parts]))


def row_parallel_splits(cfg, tp: int) -> dict[str, list[int]]:
    """The input offsets where a tensor-parallel group of `tp` ranks cuts the row-parallel
    layers of ModelConfig `cfg` (as network.shard.TPShard shards them: o_proj by query heads,
    down_proj in chunks of ceil(intermediate / tp)): {"o_proj": [...], "down_proj": [...]}."""
    per_rank_q = cfg.num_heads // tp * cfg.head_dim
    chunk = -(-cfg.intermediate_size // tp)
    return {"o_proj": [r * per_rank_q for r in range(1, tp)],
            "down_proj": [r * chunk for r in range(1, tp) if r * chunk < cfg.intermediate_size]}


def check_tp_groups(cfg, group: int, tp: int, what: str) -> None:
    """UserError when a tensor-parallel group of `tp` ranks would cut a 4-bit group of `what`
    (e.g. "the target") in two; the message names the degrees that keep groups whole."""
    from swiftspec_mpi.core.errors import UserError

    def cut(t):
        return next(((layer, at) for layer, cuts in row_parallel_splits(cfg, t).items()
                     for at in cuts if at % group), None)
    bad = cut(tp)
    if bad is None:
        return
    ok = [t for t in range(2, 17) if cfg.num_heads % t == 0 and cut(t) is None]
    fix = (f"use a group of {' or '.join(map(str, ok))} ranks" if ok else
           "no tensor-parallel degree keeps them whole: give it one rank")
    raise UserError(f"{what}'s 4-bit weights come in groups of {group} inputs, and a "
                    f"tensor-parallel group of {tp} ranks would cut its {bad[0]} at input "
                    f"{bad[1]}, inside a group; {fix}, or run it with --quant none "
                    "(dequantized weights)")

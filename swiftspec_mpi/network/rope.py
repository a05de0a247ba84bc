"""RoPE inverse frequencies of a ModelConfig (default, linear, llama3 and yarn scaling), as
transformers computes them."""
from __future__ import annotations

import math

import torch

from swiftspec_mpi.network.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the cos/sin scale, as transformers computes
    them for rope types default, linear, llama3 and yarn."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling or {}
    rtype = cfg.rope_type
    scale = 1.0
    if rtype == "linear":
        inv = inv / float(rs["factor"])
    elif rtype == "llama3":
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, inv_l)
    elif rtype == "yarn":
        factor = rs.get("factor")
        omax = float(rs.get("original_max_position_embeddings", cfg.max_position_embeddings))
        if factor is None:
            factor = cfg.max_position_embeddings / omax
        factor = float(factor)
        att = rs.get("attention_factor")
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")

        def get_mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
        if att is None:
            att = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                   if mscale and mscale_all else get_mscale(factor))
        scale = float(att)
        beta_fast = rs.get("beta_fast") or 32
        beta_slow = rs.get("beta_slow") or 1

        def corr_dim(rot):
            return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(base))
        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if rs.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extra = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, scale

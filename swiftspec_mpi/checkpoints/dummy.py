"""Random weights at real model shapes (`--load-format dummy`, like vLLM's): for timing the
step of models whose real weights cannot reach the machine. Tokens/s measured with dummy
weights is step time only: acceptance of random models means nothing.

`--target` / `--draft` then name a shape below (or a checkpoint whose config.json gives the
shape: load.shape_config). The weights are generated directly on the model's device, shard by
shard, through the same `Transformer.load_weights` path as real checkpoints (load.dummy_model).
"""
from __future__ import annotations

import hashlib

from swiftspec_mpi.core.errors import UserError
from swiftspec_mpi.network.config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama(vocab, hidden, inter, layers, heads, kv, rope_theta=500000.0, tie=False, scaling=None):
    return ModelConfig(arch="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads,
                       rms_norm_eps=1e-5, rope_theta=rope_theta, rope_scaling=scaling,
                       tie_word_embeddings=tie, attention_bias=False, max_position_embeddings=131072,
                       bos_token_id=None, eos_token_ids=(0,))


def _qwen(vocab, hidden, inter, layers, heads, kv, tie):
    return ModelConfig(arch="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                       tie_word_embeddings=tie, attention_bias=True, max_position_embeddings=32768,
                       bos_token_id=None, eos_token_ids=(0,))


SHAPES = {
    "llama-3-8b": _llama(128256, 4096, 14336, 32, 32, 8),
    "llama-3-70b": _llama(128256, 8192, 28672, 80, 64, 8),
    "llama-3.2-1b": _llama(128256, 2048, 8192, 16, 32, 8, tie=True, scaling={**_LLAMA3_ROPE, "factor": 32.0}),
    "llama-3.2-3b": _llama(128256, 3072, 8192, 28, 24, 8, tie=True, scaling={**_LLAMA3_ROPE, "factor": 32.0}),
    "smollm2-135m": _llama(49152, 576, 1536, 30, 9, 3, rope_theta=100000.0, tie=True),
    "qwen2.5-0.5b": _qwen(151936, 896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": _qwen(151936, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-7b": _qwen(152064, 3584, 18944, 28, 28, 4, False),
}


class RandomSource:
    """TensorSource of random weights: N(0, 0.02) matrices, ones for norms, small biases.
    Deterministic per (seed, name, slice), generated on `device` in `dtype`."""

    def __init__(self, cfg: ModelConfig, device="cpu", dtype=None, seed: int = 0):
        import torch
        self.config = cfg
        self.shapes = cfg.hf_shapes()
        self.device = torch.device(device)
        self.dtype = dtype or torch.float32
        self.seed = seed

    def names(self) -> list[str]:
        return list(self.shapes)

    def get(self, name: str, dim=None, start: int = 0, stop=None):
        import torch
        shape = list(self.shapes[name])
        if dim is not None:
            shape[dim] = (shape[dim] if stop is None else stop) - start
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        digest = hashlib.sha256(f"{self.seed}:{name}:{dim}:{start}".encode()).digest()
        gen = torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        std = 0.01 if name.endswith(".bias") else 0.02
        return torch.randn(shape, generator=gen, dtype=self.dtype, device=self.device).mul_(std)

    def close(self) -> None:
        pass


class RandomPackedSource(RandomSource):
    """RandomSource whose layer projections also come packed 4-bit (`get_packed`), AWQ-like:
    group 128, codes uniform in 0..15, a zero point of 7 or 8 (offset = -z * scale) and fp16
    scales around 0.0043, so that W has the dense source's spread (std ~0.02). Deterministic per
    (seed, name, slice); only the requested slice is generated, on `device`."""

    GROUP = 128

    def get_packed(self, name: str, dim=None, start: int = 0, stop=None):
        import torch

        from swiftspec_mpi.packed.int4 import PackedInt4
        shape = list(self.shapes[name])
        if dim is not None:
            shape[dim] = (shape[dim] if stop is None else stop) - start
        n, k = shape
        g = self.GROUP
        if k % g or (dim == 1 and start % g):
            raise UserError(f"--quant int4: {name} slice [{start}:{stop}) of dim {dim} does not fall on "
                            f"groups of {g} inputs; use a tensor-parallel degree that keeps whole groups")
        digest = hashlib.sha256(f"{self.seed}:int4:{name}:{dim}:{start}".encode()).digest()
        gen = torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8, device=self.device)
        scale = (0.0043 * (0.75 + 0.5 * torch.rand(n, k // g, generator=gen, device=self.device)))
        scale = scale.half().float()
        z = torch.randint(7, 9, (n, k // g), generator=gen, device=self.device).float()
        return PackedInt4(q, scale, -z * scale, g)

    def is_packed(self, name: str) -> bool:
        """True for the layers' projections (`model.layers.N.*_proj.weight`)."""
        return name.startswith("model.layers.") and name.endswith("_proj.weight")

    def packed_chunks(self, name: str, dim=None, start: int = 0, stop=None):
        """The slice as one (0, rows) chunk: PackedInt4 rows of a projection, float32 rows of
        any other matrix (the CPU's packed layers, cpu_quant, load it)."""
        yield 0, (self.get_packed(name, dim, start, stop) if self.is_packed(name)
                  else self.get(name, dim, start, stop).float())

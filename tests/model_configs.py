"""Small ModelConfigs for the model tests: one place that spells every field, each test naming
only what it changes."""
from __future__ import annotations

from swiftspec_mpi.network.config import ModelConfig


def small_config(arch: str = "qwen2", **fields) -> ModelConfig:
    """A 3-layer model of hidden size 64 (4 heads of 16, 2 KV heads), vocabulary 101, biases as
    the architecture has them (qwen2: q/k/v biases, llama: none); `fields` override any field."""
    d = dict(arch=arch, vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=3,
             num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
             rope_scaling=None, tie_word_embeddings=False, attention_bias=arch == "qwen2",
             max_position_embeddings=512, bos_token_id=None, eos_token_ids=(0,))
    d.update(fields)
    return ModelConfig(**d)

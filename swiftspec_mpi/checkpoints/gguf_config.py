"""GGUF metadata -> ModelConfig: the `<arch>.*` keys and the tensor table of a parsed header
(gguf_loader.read_header), and the end-of-generation token ids llama.cpp stops on.

    config_from_header(header) -> ModelConfig
    eos_ids(meta) -> tuple[int, ...]      EOS first, then the other end-of-generation tokens
"""
from __future__ import annotations

import numpy as np

from swiftspec_mpi.core.errors import CheckpointError

FIX = "re-download it (`swiftspec models prepare`) or re-convert the model"

# llama.cpp's end-of-generation token texts (llama-vocab.cpp): also stop on these
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
              "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
              "<end_of_utterance>")
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


def eos_ids(meta: dict) -> tuple[int, ...]:
    """EOS first, then the other end-of-generation tokens llama.cpp stops on."""
    ids: list[int] = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
              "tokenizer.ggml.eom_token_id"):
        v = meta.get(k)
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    for i, (text, ttype) in enumerate(zip(tokens, types)):
        if ttype == TOKEN_CONTROL and text in _EOG_TEXTS and i not in ids:
            ids.append(i)
    return tuple(ids)


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    def get(k, default=None):
        return meta.get(f"{arch}.{k}", default)

    rtype = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if rtype is None and get("rope.scale_linear") is not None:     # older files
        rtype, factor = "linear", get("rope.scale_linear")
    if rtype in (None, "none") or (rtype == "linear" and (factor is None or factor == 1.0)):
        return None
    if rtype not in ("linear", "yarn"):
        raise CheckpointError(f"GGUF rope scaling type {rtype!r} is not supported (linear, yarn "
                              "are); use the model's Hugging Face folder instead")
    rs = {"rope_type": rtype, "factor": float(factor)}
    if rtype == "yarn":
        orig = get("rope.scaling.original_context_length")
        if orig is not None:
            rs["original_max_position_embeddings"] = int(orig)
        for gk, hk in (("rope.scaling.attn_factor", "attention_factor"),
                       ("rope.scaling.yarn_beta_fast", "beta_fast"),
                       ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if get(gk) is not None:
                rs[hk] = float(get(gk))
    return rs


def _f32(v) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06), as it was written in the original config.json."""
    return float(str(np.float32(v)))


def config_from_header(h):
    """ModelConfig from a parsed header `h` (gguf_loader.Header): its GGUF metadata (`<arch>.*`
    keys) and its tensor table."""
    from swiftspec_mpi.network.config import ModelConfig, normalize_arch

    meta = h.meta
    arch = meta.get("general.architecture")
    if arch is None:
        raise CheckpointError(f"{h.path}: GGUF has no general.architecture; {FIX}")
    normalize_arch(str(arch))                       # refuses unsupported archs by name

    def need(k):
        v = meta.get(f"{arch}.{k}")
        if v is None:
            raise CheckpointError(f"{h.path}: GGUF metadata lacks {arch}.{k}; {FIX}")
        return v

    emb = h.tensors.get("token_embd.weight")
    if emb is None:
        raise CheckpointError(f"{h.path}: GGUF has no token_embd.weight tensor; {FIX}")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    if "rope_freqs.weight" in h.tensors:
        raise CheckpointError(f"{h.path}: Llama-3.1-style rope_freqs tensors are not supported "
                              "from GGUF; use the model's Hugging Face folder instead")
    return ModelConfig(
        arch=str(arch), vocab_size=int(emb.shape[0]), hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_layers=int(need("block_count")),
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch),
        tie_word_embeddings="output.weight" not in h.tensors,
        attention_bias="blk.0.attn_q.bias" in h.tensors,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids(meta))

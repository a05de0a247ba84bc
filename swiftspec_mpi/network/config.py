"""`ModelConfig`: the architecture hyper-parameters of one decoder, read from a checkpoint's own
config (HF config.json, or GGUF metadata converted to the same dict by gguf_loader).

Supported: Llama (Llama 2/3/3.1/3.2, SmolLM, ...: GQA, RoPE incl. `llama3`/`linear`/`yarn`
scaling, RMSNorm, SwiGLU, tied or untied head, optional attention bias) and Qwen2/Qwen2.5
(QKV bias, tied or untied head). Anything else raises CheckpointError naming the architecture.

No torch import here: rank 0 validates a run's models with this module alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from swiftspec_mpi.core.errors import CheckpointError

# HF `model_type` / `architectures[0]` -> our arch name
_ARCH_ALIASES = {
    "llama": "llama",
    "LlamaForCausalLM": "llama",
    "qwen2": "qwen2",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ARCHS = ("llama", "qwen2")
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_HF_ARCH_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def normalize_arch(name: str) -> str:
    """'llama' | 'qwen2' for any accepted spelling; CheckpointError otherwise."""
    if name in _ARCH_ALIASES:
        return _ARCH_ALIASES[name]
    raise CheckpointError(
        f"unsupported model architecture {name!r}; supported: "
        + ", ".join(f"{a} ({_HF_ARCH_CLASS[a]})" for a in SUPPORTED_ARCHS))


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    `rope_scaling` is the HF dict (keys `rope_type`, `factor`, `low_freq_factor`,
    `high_freq_factor`, `original_max_position_embeddings`, ...) or None for plain RoPE.
    `attention_bias`: Q/K/V projections have a bias (always True for qwen2; for llama it is the HF
    flag, which also puts a bias on the output projection).
    """
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "arch", normalize_arch(self.arch))
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; the checkpoint config is inconsistent")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim={self.head_dim} must be even for RoPE")
        rs = self.rope_scaling
        if rs is not None:
            rtype = rs.get("rope_type", rs.get("type", "default"))
            if rtype not in _SUPPORTED_ROPE_TYPES:
                raise CheckpointError(
                    f"unsupported rope scaling type {rtype!r}; supported: "
                    + ", ".join(_SUPPORTED_ROPE_TYPES))

    def __hash__(self):  # rope_scaling is a dict: hash its items
        rs = tuple(sorted((k, repr(v)) for k, v in (self.rope_scaling or {}).items()))
        return hash(tuple(getattr(self, f.name) if f.name != "rope_scaling" else rs
                          for f in dataclasses.fields(self)))

    # --- derived -----------------------------------------------------------------------------
    @property
    def rope_type(self) -> str:
        rs = self.rope_scaling
        if not rs:
            return "default"
        return rs.get("rope_type", rs.get("type", "default"))

    @property
    def o_bias(self) -> bool:
        """The output projection has a bias (HF Llama with attention_bias=True)."""
        return self.arch == "llama" and self.attention_bias

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> full shape, for every tensor a checkpoint of this config holds."""
        H, hd, I, V = self.hidden_size, self.head_dim, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, H)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                           p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                           p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                           p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                           p + "mlp.down_proj.weight": (H, I)})
            if self.attention_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (H,)
        return shapes

    def param_count(self) -> int:
        """Number of weights (embedding and head counted separately unless tied)."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    # --- conversion --------------------------------------------------------------------------
    @staticmethod
    def from_hf_dict(d: dict) -> "ModelConfig":
        """Build from a HF config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or
        5.x `rope_parameters`). Unsupported architectures, MLP biases, or missing keys raise
        CheckpointError."""
        name = d.get("model_type")
        if name not in _ARCH_ALIASES:
            archs = d.get("architectures") or []
            name = next((a for a in archs if a in _ARCH_ALIASES), None) or name or (
                archs[0] if archs else "<none: config has neither model_type nor architectures>")
        arch = normalize_arch(name)
        if d.get("mlp_bias"):
            raise CheckpointError("config.json sets mlp_bias=true, which is not supported "
                                  "(Llama/Qwen2 checkpoints have no MLP bias)")
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise CheckpointError(f"config.json sets hidden_act={hidden_act!r}; only 'silu' "
                                  "(SwiGLU) is supported")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            vocab = int(d["vocab_size"])
            inter = int(d["intermediate_size"])
            layers = int(d["num_hidden_layers"])
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks the key {exc.args[0]!r}; "
                                  "re-export the checkpoint with its config") from None
        kv = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)

        # RoPE: 5.x keeps everything in rope_parameters; 4.x has rope_theta + rope_scaling.
        rp = d.get("rope_parameters")
        rs = d.get("rope_scaling")
        if isinstance(rp, dict) and rp:
            theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
            scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        else:
            theta = float(d.get("rope_theta", 10000.0))
            scaling = dict(rs) if isinstance(rs, dict) else None
        if scaling is not None:
            if "type" in scaling and "rope_type" not in scaling:
                scaling["rope_type"] = scaling.pop("type")
            scaling.pop("type", None)
            if scaling.get("rope_type", "default") == "default":
                scaling = None
        eos = d.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, (list, tuple)):
            eos_ids = tuple(int(e) for e in eos)
        else:
            eos_ids = (int(eos),)
        bos = d.get("bos_token_id")
        if arch == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(d.get("attention_bias", False))
        return ModelConfig(
            arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids)

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers (4.x and 5.x) and `from_hf_dict` both load."""
        d = {
            "architectures": [_HF_ARCH_CLASS[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                             else (self.eos_token_ids[0] if self.eos_token_ids else None)),
            "torch_dtype": "float32",
            "use_cache": True,
        }
        if self.arch == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        else:
            d["use_sliding_window"] = False
            d["sliding_window"] = None
            d["max_window_layers"] = self.num_layers
        return d

    def with_layers(self, n: int) -> "ModelConfig":
        """The same model truncated to its first `n` layers (self-speculation drafts)."""
        if not 1 <= n <= self.num_layers:
            raise ValueError(f"with_layers({n}): the model has {self.num_layers} layers")
        return dataclasses.replace(self, num_layers=int(n))

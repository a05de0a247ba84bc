"""Our Transformer's logits equal HF transformers' (the reference) on random tiny checkpoints of
both families, saved by transformers itself (safetensors) and loaded by our loader: prefill,
chunked prefill and step-by-step decode, within 1e-4 max-abs (CPU, float32)."""
from __future__ import annotations

import json

import pytest
import torch

import transformers

from conftest import skip_or_fail
from swiftspec_mpi.checkpoints.hf_loader import SafetensorsSource
from swiftspec_mpi.network.config import ModelConfig
from swiftspec_mpi.network.transformer import Transformer, chain_mask

TOL = 1e-4
VOCAB = 97

CASES = {
    "llama-gqa-untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha-tied-bias": ("llama", dict(num_attention_heads=4, num_key_value_heads=4,
                                          tie_word_embeddings=True, attention_bias=True)),
    "llama-llama3-rope": ("llama", dict(num_attention_heads=4, num_key_value_heads=1,
                                        rope_theta=500000.0,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 16})),
    "qwen2-gqa-untied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2-tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=True)),
    "qwen2-yarn": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=128,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 32})),
}


def build_hf(arch: str, folder, seed: int = 0, **kw):
    """A random HF model (all weights ~N(0, 0.15^2), norms ~1) saved with save_pretrained."""
    torch.manual_seed(seed)
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                max_position_embeddings=256, rms_norm_eps=1e-6)
    base.update(kw)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**base))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def load_ours(folder, max_slots=192, weight_layout=None) -> Transformer:
    src = SafetensorsSource(str(folder))
    m = Transformer(src.config, max_slots=max_slots, weight_layout=weight_layout)
    m.load_weights(src)
    src.close()
    return m


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    arch, kw = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_hf(arch, folder, **kw)
    return hf, load_ours(folder), folder


def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens[None]).logits[0].float()


def test_prefill_matches(pair):
    hf, ours, _ = pair
    toks = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf, toks)
    out = ours.forward(toks, torch.arange(24), 0, chain_mask(0, 24))
    assert out.dtype == torch.float32 and out.shape == (24, VOCAB)
    assert (out - ref).abs().max().item() < TOL
    assert ref.abs().max().item() > 0.5   # the comparison is not vacuous


def test_long_prefill_matches(pair):
    """Long enough (N * group > 256) for the non-folded SDPA path (enable_gqa, bool mask)."""
    hf, ours, _ = pair
    toks = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(5))
    ref = hf_logits(hf, toks)
    out = ours.forward(toks, torch.arange(150), 0, chain_mask(0, 150))
    assert (out - ref).abs().max().item() < TOL
    step = ours.forward(toks[:1], torch.tensor([150]), 150, chain_mask(150, 1))
    ref = hf_logits(hf, torch.cat([toks, toks[:1]]))[-1]
    assert (step[0] - ref).abs().max().item() < TOL


def test_step_decode_and_chunked_prefill_match(pair):
    hf, ours, _ = pair
    toks = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf, toks)
    # prefill 20 in two chunks (13 then 7), only the last row's logits
    ours.forward(toks[:13], torch.arange(13), 0, chain_mask(0, 13))
    last = ours.forward(toks[13:20], torch.arange(13, 20), 13, chain_mask(13, 7),
                        logits_rows=torch.tensor([6]))
    assert last.shape == (1, VOCAB)
    assert (last[0] - ref[19]).abs().max().item() < TOL
    for i in range(20, 30):  # step-by-step decode
        step = ours.forward(toks[i:i + 1], torch.tensor([i]), i, chain_mask(i, 1))
        assert (step[0] - ref[i]).abs().max().item() < TOL, f"decode step at position {i}"


@pytest.mark.parametrize("layout, in_axis, seed", [("out_in", 1, 6), ("in_out", 0, 7)])
def test_weight_layout_matches(pair, layout, in_axis, seed):
    """Both weight layouts compute the same logits on CPU, over a whole prompt and as prefill plus
    one decode step: "out_in" ([out, in], the GPU's nn.Linear layout) and "in_out" ([in, out],
    x @ W, the fallback without AVX2)."""
    hf, _, folder = pair
    ours = load_ours(folder, weight_layout=layout)
    assert ours.weight_layout == layout and ours.layers[0].wqkv.shape[in_axis] == 64
    toks = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(seed))
    ref = hf_logits(hf, toks)
    out = ours.forward(toks, torch.arange(12), 0, chain_mask(0, 12))
    assert (out - ref).abs().max().item() < TOL
    ours.forward(toks[:11], torch.arange(11), 0, chain_mask(0, 11))
    step = ours.forward(toks[11:], torch.tensor([11]), 11, chain_mask(11, 1))
    assert (step[0] - ref[11]).abs().max().item() < TOL


def test_sharded_safetensors_index(tmp_path):
    """A model saved in several shards (model.safetensors.index.json) loads the same."""
    hf = build_hf("qwen2", tmp_path, seed=3, num_attention_heads=4, num_key_value_heads=2)
    hf.save_pretrained(str(tmp_path / "sharded"), safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ours = load_ours(tmp_path / "sharded")
    toks = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(4))
    out = ours.forward(toks, torch.arange(9), 0, chain_mask(0, 9))
    assert (out - hf_logits(hf, toks)).abs().max().item() < TOL


def test_config_formats_round_trip(tmp_path):
    """from_hf_dict reads transformers 5.x (rope_parameters) and 4.x (rope_theta/rope_scaling)
    configs; to_hf_dict writes one transformers loads with the same rope scaling."""
    arch, kw = CASES["llama-llama3-rope"]
    build_hf(arch, tmp_path, **kw)
    with open(tmp_path / "config.json") as f:
        d5 = json.load(f)
    cfg = ModelConfig.from_hf_dict(d5)
    assert cfg.rope_type == "llama3" and cfg.rope_theta == 500000.0
    d4 = dict(d5)
    d4.pop("rope_parameters", None)
    d4["rope_theta"] = 500000.0
    d4["rope_scaling"] = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    assert ModelConfig.from_hf_dict(d4) == cfg
    out = tmp_path / "rt"
    out.mkdir()
    with open(out / "config.json", "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    back = transformers.AutoConfig.from_pretrained(str(out))
    assert back.model_type == "llama"
    rp = getattr(back, "rope_parameters", None) or getattr(back, "rope_scaling", None)
    assert rp["rope_type"] == "llama3" and float(rp["factor"]) == 8.0
    assert ModelConfig.from_hf_dict(back.to_dict()) == cfg
    assert cfg.with_layers(1).num_layers == 1 and cfg.with_layers(1).hidden_size == cfg.hidden_size


def test_packed_bf16_weights_match_rounded_reference(pair):
    """--dtype bfloat16 on CPU: weights stored bf16 in the packed panels, all math in float32.
    Equals HF in float32 on the same weights rounded to bf16 (norms and biases stay float32)."""
    from swiftspec_mpi.packed import cpu_linear
    if not cpu_linear.has_avx2():
        skip_or_fail("this CPU lacks AVX2 + FMA, the packed CPU kernel's instructions")
    hf, _, folder = pair
    ref_model = type(hf)(hf.config)
    ref_model.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            if "norm" not in name and not name.endswith(".bias"):
                p.copy_(p.bfloat16().float())
    ref_model.eval()
    src = SafetensorsSource(str(folder))
    ours = Transformer(src.config, max_slots=64, dtype=torch.bfloat16)
    ours.load_weights(src)
    src.close()
    assert ours.weight_layout == "packed" and ours.dtype == torch.float32
    assert ours.layers[0].wqkv.data.dtype == torch.bfloat16
    toks = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(8))
    ref = hf_logits(ref_model, toks)
    out = ours.forward(toks, torch.arange(20), 0, chain_mask(0, 20))
    assert (out - ref).abs().max().item() < TOL
    # and the rounding is real: the unrounded float32 model differs by far more than TOL
    assert (hf_logits(hf, toks) - ref).abs().max().item() > 10 * TOL

"""GGUF loading (swiftspec_mpi.checkpoints.gguf_loader).

Tiny GGUF files written here with gguf.GGUFWriter (quantized with gguf.quants) check the name
mapping, dequantization, slicing, the llama Q/K un-permutation (against llama.cpp's own permute
written out independently), tied-head detection, our header parser against gguf.GGUFReader, the
tokenizer, and truncated/garbage files. The real SmolLM2-135M GGUF (from the registry cache)
checks logits and tokenizer against transformers' own GGUF loader.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import gguf

from conftest import max_rel_diff, need_registry_model
from swiftspec_mpi.core.errors import CheckpointError, UserError
Q = gguf.GGMLQuantizationType

# ------------------------------------------------------------------------------ tiny GGUF writer

TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, layers=2)
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["h e", "l l", "he ll", "Ġ w", "o r"]
_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
         "{% endfor %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte alphabet, byte 0 first (the table the GGUF tokenizer builder spells with)."""
    from swiftspec_mpi.checkpoints.gguf_tokenizer import bytes_to_unicode
    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def tiny_tokens() -> tuple[list[str], list[int]]:
    tokens = _byte_alphabet() + ["he", "ll", "hell", "Ġw", "or"] + _SPECIAL + ["<think>"]
    types = [1] * (len(tokens) - 4) + [3, 3, 3, 4]
    return tokens, types


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> llama.cpp layout)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path, arch: str = "llama", tied: bool = True, seed: int = 0,
                    qtypes: dict | None = None, raw_zero: dict | None = None) -> dict:
    """Write a tiny `arch` GGUF at `path`; return {hf_name: (source fp32, expected fp32)} where
    `expected` is what a loader must return: the quantize->dequantize round trip of the tensor
    as stored, with llama.cpp's Q/K permutation undone (via transformers' reshape formula).
    `raw_zero` {gguf name: ggml type}: store those tensors as zero blocks of that type."""
    c = TINY
    qtypes = {"embd": Q.Q8_0, "attn": Q.F16, "ffn": Q.Q4_1, "output": Q.Q8_0, **(qtypes or {})}
    rng = np.random.default_rng(seed)
    tokens, types = tiny_tokens()
    vocab = len(tokens)
    H, hd, nh, nkv, F_ = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"], c["ffn"]

    def rand(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(c["layers"])
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F_)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(_MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(_CHAT)

    out = {}

    def put(gname, hfname, x, qtype, perm_heads=None):
        stored = x if perm_heads is None else llama_cpp_permute(x, nh, perm_heads)
        if gname in (raw_zero or {}):              # a type gguf cannot quantize: zero blocks
            qtype = raw_zero[gname]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            w.add_tensor(gname, np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8),
                         raw_dtype=qtype)
            return
        if qtype == Q.F32:
            w.add_tensor(gname, stored.astype(np.float32))
            back = stored.astype(np.float32)
        elif qtype == Q.F16:
            w.add_tensor(gname, stored.astype(np.float16))
            back = stored.astype(np.float16).astype(np.float32)
        else:
            data = gguf.quants.quantize(stored, qtype)
            w.add_tensor(gname, data, raw_dtype=qtype)
            back = gguf.quants.dequantize(data, qtype).astype(np.float32)
        if perm_heads is not None:   # transformers' LlamaTensorProcessor._reverse_permute_weights
            n = perm_heads
            back = back.reshape(n, back.shape[0] // n // 2, 2, *back.shape[1:]) \
                .swapaxes(2, 1).reshape(x.shape)
        out[hfname] = (x, back)

    put("token_embd.weight", "model.embed_tokens.weight", rand(vocab, H), qtypes["embd"])
    for i in range(c["layers"]):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        put(g + "attn_norm.weight", p + "input_layernorm.weight", 1 + rand(H, scale=0.1), Q.F32)
        put(g + "ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + rand(H, scale=0.1),
            Q.F32)
        llama = arch == "llama"
        put(g + "attn_q.weight", p + "self_attn.q_proj.weight", rand(nh * hd, H), qtypes["attn"],
            nh if llama else None)
        put(g + "attn_k.weight", p + "self_attn.k_proj.weight", rand(nkv * hd, H), qtypes["attn"],
            nkv if llama else None)
        put(g + "attn_v.weight", p + "self_attn.v_proj.weight", rand(nkv * hd, H), qtypes["attn"])
        put(g + "attn_output.weight", p + "self_attn.o_proj.weight", rand(H, nh * hd),
            qtypes["attn"])
        if arch == "qwen2":
            put(g + "attn_q.bias", p + "self_attn.q_proj.bias", rand(nh * hd), Q.F32)
            put(g + "attn_k.bias", p + "self_attn.k_proj.bias", rand(nkv * hd), Q.F32)
            put(g + "attn_v.bias", p + "self_attn.v_proj.bias", rand(nkv * hd), Q.F32)
        put(g + "ffn_gate.weight", p + "mlp.gate_proj.weight", rand(F_, H), qtypes["ffn"])
        put(g + "ffn_up.weight", p + "mlp.up_proj.weight", rand(F_, H), qtypes["ffn"])
        put(g + "ffn_down.weight", p + "mlp.down_proj.weight", rand(H, F_), qtypes["ffn"])
    put("output_norm.weight", "model.norm.weight", 1 + rand(H, scale=0.1), Q.F32)
    if not tied:
        put("output.weight", "lm_head.weight", rand(vocab, H), qtypes["output"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path, "llama", tied=True)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    return path, write_tiny_gguf(path, "qwen2", tied=False, seed=1,
                                 qtypes={"attn": Q.Q8_0, "ffn": Q.Q5_0, "embd": Q.F16})


# ------------------------------------------------------------------------------ tiny: tensors

@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen"])
def test_tiny_roundtrip_names_values_permutation(which, request):
    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource

    path, ref = request.getfixturevalue(which)
    with GGUFSource(path) as src:
        assert sorted(src.names()) == sorted(ref)
        for name, (orig, expected) in ref.items():
            got = src.get(name)
            assert got.dtype == torch.float32 and tuple(got.shape) == orig.shape, name
            assert torch.equal(got, torch.from_numpy(expected)), name
            # and close to the unquantized source (a missed un-permute would be O(1) off)
            assert float(np.abs(got.numpy() - orig).max()) < 0.1, name


def test_tiny_llama_permutation_really_undone(tiny_llama):
    """Q/K come back in HF row order: F16 storage is near-lossless, so compare to the source."""
    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource

    path, ref = tiny_llama
    with GGUFSource(path) as src:
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.1.self_attn.{proj}.weight"
            orig = torch.from_numpy(ref[name][0])
            got = src.get(name)
            assert (got - orig).abs().max() < 1e-3
            assert (got - orig).abs().max() < (orig - orig.roll(1, 0)).abs().max() / 10


def test_tiny_config(tiny_llama, tiny_qwen):
    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource

    tokens, _ = tiny_tokens()
    with GGUFSource(tiny_llama[0]) as src:
        cfg = src.config
        assert (cfg.arch, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
            ("llama", 64, 4, 2, 16)
        assert (cfg.num_layers, cfg.intermediate_size, cfg.vocab_size) == (2, 96, len(tokens))
        assert cfg.tie_word_embeddings and not cfg.attention_bias
        assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
        assert cfg.max_position_embeddings == 512
        # EOS first, then the other end-of-generation control tokens llama.cpp stops on
        assert cfg.eos_token_ids == (tokens.index("<|im_end|>"), tokens.index("<|endoftext|>"))
        assert cfg.bos_token_id == tokens.index("<|im_start|>")
        assert "lm_head.weight" not in src.names()
    with GGUFSource(tiny_qwen[0]) as src:
        assert src.config.arch == "qwen2" and not src.config.tie_word_embeddings
        assert src.config.attention_bias and "lm_head.weight" in src.names()


@pytest.mark.parametrize("name,dim,start,stop", [
    ("model.layers.0.self_attn.q_proj.weight", 0, 16, 48),     # permuted, head-aligned (TP)
    ("model.layers.0.self_attn.q_proj.weight", 0, 5, 37),      # permuted, unaligned
    ("model.layers.0.self_attn.k_proj.weight", 0, 16, 32),
    ("model.layers.0.self_attn.o_proj.weight", 1, 16, 48),     # row-parallel: input columns
    ("model.layers.1.mlp.down_proj.weight", 1, 0, 48),
    ("model.layers.1.mlp.gate_proj.weight", 0, 48, 96),
    ("model.embed_tokens.weight", 0, 100, 262),
    ("model.norm.weight", 0, 3, 9),
])
def test_tiny_slices_equal_full_tensor_slices(tiny_llama, name, dim, start, stop):
    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource

    with GGUFSource(tiny_llama[0]) as src:
        full = src.get(name)
        part = src.get(name, dim, start, stop)
        assert torch.equal(part, full.narrow(dim, start, stop - start))
        with pytest.raises(CheckpointError):
            src.get(name, dim, 0, full.shape[dim] + 1)


def test_tiny_dtype_hint(tiny_llama):
    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource

    name = "model.layers.0.mlp.up_proj.weight"
    with GGUFSource(tiny_llama[0]) as f32, GGUFSource(tiny_llama[0], dtype=torch.bfloat16) as bf:
        got = bf.get(name, 0, 0, 32)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, f32.get(name, 0, 0, 32).to(torch.bfloat16))


def test_tiny_get_into(tiny_llama):
    """Dequantizing straight into a destination: any dtype, strided views (the model's
    transposed [in, out] stores), permuted row slices; a wrong shape is refused."""
    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource

    q = "model.layers.1.self_attn.q_proj.weight"
    with GGUFSource(tiny_llama[0]) as src:
        full = src.get(q)
        store = torch.zeros(64, 64)                      # [in, out]; .t() is [out, in]
        src.get_into(store.t(), q)
        assert torch.equal(store.t(), full)
        part = torch.empty(16, 64, dtype=torch.bfloat16)
        src.get_into(part, q, 0, 16, 32)
        assert torch.equal(part, full[16:32].to(torch.bfloat16))
        norm = torch.empty(6)
        src.get_into(norm, "model.norm.weight", 0, 3, 9)
        assert torch.equal(norm, src.get("model.norm.weight")[3:9])
        with pytest.raises(CheckpointError, match="destination"):
            src.get_into(torch.empty(64, 63), q)


def test_header_parser_matches_gguf_reader(tiny_qwen):
    from swiftspec_mpi.checkpoints.gguf_loader import read_header

    h = read_header(tiny_qwen[0])
    reader = gguf.GGUFReader(tiny_qwen[0])
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta == h.meta
    assert len(reader.tensors) == len(h.tensors)
    for t in reader.tensors:
        info = h.tensors[t.name]
        assert (info.qtype, info.offset, info.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert info.shape == tuple(reversed(t.shape.tolist()))


# A packed model's logits against transformers' float32 ones, relative to the largest: the packed
# CPU path's accuracy bound is 1e-3. The int16 activation parts (AVX-512 VNNI) leave
# float32-level differences; the AVX2 byte path's two int8 parts about 1.6e-5 of a group's largest
# input per input, measured 4.4e-4 on SmolLM2-135M, 2.0e-4 on Qwen2.5-Coder 1.5B. The dequantized
# path (`quant="none"`) is checked in absolute terms, as tightly as float32 allows.
PACKED_LOGITS_RTOL = 1e-3


@pytest.mark.parametrize("quant", ["auto", "none"])
def test_tiny_model_logits_match_transformers_gguf(tiny_llama, quant):
    """The whole path (loader + Transformer) against transformers' GGUF loader, which has its
    own dequantization and its own Q/K un-permutation: packed (the default for a GGUF file on the
    CPU) and dequantized to float32."""
    import transformers
    import accelerate  # noqa: F401  (transformers loads GGUF files through it)
    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask

    path = tiny_llama[0]
    model, _ = load_model(path, max_slots=32, quant=quant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([5, 77, 256, 3, 200, 100, 42, 259, 7])
    ours = model(ids, torch.arange(len(ids)), 0, chain_mask(0, len(ids)))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    if quant == "none":
        assert (ours - ref).abs().max().item() <= 1e-4
    else:
        assert max_rel_diff(ours, ref) <= PACKED_LOGITS_RTOL
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_unsupported_tensor_type_refused_by_name(tmp_path):
    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource

    path = tmp_path / "iq.gguf"
    write_tiny_gguf(path, "llama", raw_zero={"blk.0.ffn_up.weight": Q.IQ4_NL})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight.*IQ4_NL"):
        GGUFSource(path)


# ------------------------------------------------------------------------------ tiny: tokenizer

def test_tiny_tokenizer(tiny_llama):
    from swiftspec_mpi.checkpoints.gguf_tokenizer import tokenizer_from_gguf

    tokens, _ = tiny_tokens()
    tok = tokenizer_from_gguf(tiny_llama[0])
    assert tok.vocab_size == len(tokens)
    ids = tok.encode("hello world<|im_end|>")
    assert ids[:2] == [tokens.index("hell"), tokens.index("o")]
    assert ids[-1] == tokens.index("<|im_end|>")          # control token matched whole
    assert tok.encode("<think>") == [tokens.index("<think>")]  # user-defined matched whole
    for text in ["hello world", "naïve 東京 😀\n\t  x = 12345", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids[0] == tokens.index("<|im_end|>")
    assert tok.chat_template == _CHAT and not tok.add_bos
    assert tok.apply_chat_template("hi").startswith("<|im_start|>user\nhi<|im_end|>")


def test_unknown_pre_tokenizer_refused(tmp_path):
    from swiftspec_mpi.checkpoints.gguf_tokenizer import build_tokenizer

    tokens, types = tiny_tokens()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "made-up",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": _MERGES}
    with pytest.raises(CheckpointError, match="made-up"):
        build_tokenizer(meta, "x.gguf")
    with pytest.raises(CheckpointError, match="'llama'"):
        build_tokenizer({**meta, "tokenizer.ggml.model": "llama"}, "x.gguf")


# ------------------------------------------------------------------------------ bad files

def test_truncated_and_garbage_files_raise_checkpoint_error(tiny_llama, tmp_path):
    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource

    data = tiny_llama[0].read_bytes()
    header_end = data.find(b"output_norm.weight") + 200    # inside the tensor table / data
    cases = {
        "empty.gguf": b"",
        "garbage.gguf": np.random.default_rng(0).bytes(4096),
        "magic-only.gguf": data[:64],
        "cut-header.gguf": data[:header_end // 2],
        "cut-data.gguf": data[:len(data) - 100],
        "half.gguf": data[:len(data) // 2],
    }
    for fname, blob in cases.items():
        p = tmp_path / fname
        p.write_bytes(blob)
        with pytest.raises(CheckpointError) as err:
            GGUFSource(p)
        msg = str(err.value)
        assert fname in msg and "\n" not in msg, (fname, msg)
    with pytest.raises(CheckpointError, match="missing"):
        GGUFSource(tmp_path / "nope.gguf")


# ------------------------------------------------------------------------------ real SmolLM2

def _registry_gguf(name: str):
    from swiftspec_mpi.checkpoints import registry
    need_registry_model(name)
    return registry.ensure_gguf(name)


@pytest.fixture(scope="module")
def smollm2_gguf():
    return _registry_gguf("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_hf_model(smollm2_gguf):
    import transformers
    import accelerate  # noqa: F401  (transformers loads GGUF files through it)
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("quant", ["auto", "none"])
def test_smollm2_logits_match_transformers(smollm2_gguf, smollm2_hf_model, quant):
    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask

    model, tok = load_model(smollm2_gguf, max_slots=128, quant=quant)
    assert model.cfg.tie_word_embeddings and model.cfg.arch == "llama"
    ids = tok.encode(tok.apply_chat_template("Write a haiku about the sea."))
    n = len(ids)
    ours = model(torch.tensor(ids), torch.arange(n), 0, chain_mask(0, n))
    with torch.no_grad():
        ref = smollm2_hf_model(torch.tensor([ids])).logits[0].float()
    if quant == "none":
        assert (ours - ref).abs().max().item() <= 1e-3
    else:
        assert max_rel_diff(ours, ref) <= PACKED_LOGITS_RTOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


TOKENIZER_STRINGS = [
    "Hello world!",
    "def f(x):\n\treturn x**2  # square\n\n\n",
    "  leading and trailing   ",
    "naïve café — 東京 😀 Ünïcödé",
    "<|im_start|>user\nhi<|im_end|>\n",
    "x = [1, 22, 333, 4444, 12345678] 3.14159",
    "I'm you're they'll WE'VE",
    "\r\n\r\n  \t tabs\u00a0nbsp",
    "for i in range(10):\n    print(f'{i:>4}')",
]


def test_smollm2_tokenizer_matches_transformers(smollm2_gguf):
    import transformers
    from swiftspec_mpi.checkpoints.gguf_tokenizer import tokenizer_from_gguf

    ours = tokenizer_from_gguf(smollm2_gguf)
    hf = transformers.AutoTokenizer.from_pretrained(os.fspath(smollm2_gguf.parent),
                                                    gguf_file=smollm2_gguf.name)
    assert ours.vocab_size == len(hf)
    for s in TOKENIZER_STRINGS:
        ids = ours.encode(s)
        assert ids == hf.encode(s, add_special_tokens=False), s
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids) == s
    assert ours.eos_token_ids[0] == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.slow
def test_qwen_tokenizer_matches_transformers():
    """Qwen2.5 (qwen2 pre-tokenizer). Ours adds the upstream NFC normalizer, which transformers'
    GGUF tokenizer lacks: they agree on NFC text (all of these), differ on decomposed text."""
    import transformers
    from swiftspec_mpi.checkpoints.gguf_tokenizer import tokenizer_from_gguf

    path = _registry_gguf("qwen2.5-coder-0.5b")
    ours = tokenizer_from_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(os.fspath(path.parent), gguf_file=path.name)
    for s in TOKENIZER_STRINGS:
        ids = ours.encode(s)
        assert ids == hf.encode(s, add_special_tokens=False), s
        assert ours.decode(ids, skip_special_tokens=False) == s
    assert ours.eos_token_ids == (151645, 151643)

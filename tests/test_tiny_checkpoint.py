"""`swiftspec tiny-checkpoint`, the loaders' error messages and the tokenizer.

The tiny pair is real HF folders (transformers loads them and agrees with us), its draft agrees
with the target's greedy token most of the time, the target's greedy text is not degenerate;
corrupt, truncated or missing files and unsupported architectures raise CheckpointError naming
the file or the architecture."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from swiftspec_mpi.checkpoints import load as checkpoint
from swiftspec_mpi.checkpoints.tokenizer import StreamDecoder, TextTokenizer
from swiftspec_mpi.cli import main as cli
from swiftspec_mpi.core.errors import CheckpointError, UserError
from swiftspec_mpi.network.transformer import chain_mask


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    P = len(prompt)
    lg = model.forward(torch.tensor(prompt), torch.arange(P), 0, chain_mask(0, P),
                       logits_rows=torch.tensor([P - 1]))
    out = []
    for i in range(n):
        t = int(lg[0].argmax())
        out.append(t)
        p = P + i
        lg = model.forward(torch.tensor([t]), torch.tensor([p]), p, chain_mask(p, 1))
    return out


# ------------------------------------------------------------------------------ the pair
def test_cli_writes_both_archs(tmp_path):
    assert cli.main(["tiny-checkpoint", str(tmp_path / "q")]) == 0
    assert cli.main(["tiny-checkpoint", "--arch", "llama", "--seed", "3", "--layers", "3",
                     "--draft-layers", "1", str(tmp_path / "l")]) == 0
    for sub in ("target", "draft"):
        files = set(os.listdir(tmp_path / "q" / sub))
        assert {"config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"} <= files
    cfg = checkpoint.read_model_config(tmp_path / "l" / "target")
    assert cfg.arch == "llama" and cfg.num_layers == 3
    assert checkpoint.read_model_config(tmp_path / "l" / "draft").num_layers == 1
    # refuses to overwrite without --force (a UserError: one line, exit code 2)
    assert cli.main(["tiny-checkpoint", str(tmp_path / "q")]) == 2
    assert cli.main(["tiny-checkpoint", "--force", str(tmp_path / "q")]) == 0


def test_package_tokenizer_is_small():
    import swiftspec_mpi
    data = os.path.join(os.path.dirname(swiftspec_mpi.__file__), "data", "tiny_tokenizer.json")
    assert os.path.getsize(data) < 500_000


def test_transformers_loads_it_and_agrees(tiny_pair, tmp_path):
    import transformers
    cli.main(["tiny-checkpoint", "--arch", "llama", str(tmp_path / "l")])
    for folder in (tiny_pair[0], tiny_pair[1], str(tmp_path / "l" / "target")):
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        hf.eval()
        ours, tok = checkpoint.load_model(folder, max_slots=64)
        ids = tok.encode(tok.apply_chat_template("What is the capital of France?"))
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        out = ours.forward(torch.tensor(ids), torch.arange(len(ids)), 0, chain_mask(0, len(ids)))
        assert (out - ref).abs().max().item() < 1e-4, folder


def test_draft_agrees_with_target_and_text_is_not_degenerate(tiny_pair):
    target, tok = checkpoint.load_model(tiny_pair[0], max_slots=256)
    draft, dtok = checkpoint.load_model(tiny_pair[1], max_slots=256)
    assert tok.fingerprint() == dtok.fingerprint()
    g = torch.Generator().manual_seed(0)
    agree = total = 0
    for _ in range(8):   # random prompts
        p = torch.randint(3, tok.vocab_size, (24,), generator=g)
        a = target.forward(p, torch.arange(24), 0, chain_mask(0, 24)).argmax(-1)
        b = draft.forward(p, torch.arange(24), 0, chain_mask(0, 24)).argmax(-1)
        agree += int((a == b).sum())
        total += 24
    assert agree / total >= 0.5, f"draft agrees with target on {agree}/{total} tokens"
    prompt = tok.encode(tok.apply_chat_template("Write a short poem about the sea."))
    cont = _greedy(target, prompt, 48)
    assert len(set(cont)) >= 12, f"degenerate greedy continuation {cont}"
    # along the target's own greedy path (what speculation sees)
    full = torch.tensor(prompt + cont)
    L = full.numel()
    a = target.forward(full, torch.arange(L), 0, chain_mask(0, L)).argmax(-1)[len(prompt) - 1:-1]
    b = draft.forward(full, torch.arange(L), 0, chain_mask(0, L)).argmax(-1)[len(prompt) - 1:-1]
    assert (a == b).float().mean().item() >= 0.5


def test_truncated_target_equals_draft(tiny_pair):
    """load_model(num_layers=k) (self-speculation) of the target is exactly the draft."""
    cut, _ = checkpoint.load_model(tiny_pair[0], max_slots=32, num_layers=2)
    draft, _ = checkpoint.load_model(tiny_pair[1], max_slots=32)
    p = torch.arange(3, 23)
    a = cut.forward(p, torch.arange(20), 0, chain_mask(0, 20))
    b = draft.forward(p, torch.arange(20), 0, chain_mask(0, 20))
    assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match="layers"):
        checkpoint.load_model(tiny_pair[0], num_layers=9)


# ------------------------------------------------------------------------------ tokenizer
def test_tokenizer_round_trip_template_and_eos(tiny_pair):
    tok = checkpoint.load_tokenizer(tiny_pair[0])
    assert isinstance(tok, TextTokenizer)
    text = "Über 東京 — naïve café 😀 code: def f(x): return x**2\n"
    assert tok.decode(tok.encode(text)) == text
    im_end = tok.tok.token_to_id("<|im_end|>")
    assert im_end in tok.eos_token_ids
    prompt = tok.apply_chat_template("Hello there")
    assert prompt.endswith("<|im_start|>assistant\n") and "Hello there" in prompt
    ids = tok.encode(prompt)
    assert ids[0] == tok.tok.token_to_id("<|im_start|>")   # special tokens parsed, no BOS
    assert tok.decode(ids, skip_special_tokens=False) == prompt


def test_stream_decoder_matches_full_decode(tiny_pair):
    tok = checkpoint.load_tokenizer(tiny_pair[0])
    text = "Streaming: 東京 😀 and café, then <b>tags</b> and ünïcödé.\nDone."
    ids = tok.encode(text)
    sd = StreamDecoder(tok)
    pieces = [sd.push([i]) for i in ids]
    assert "".join(pieces) + sd.flush() == text
    assert all("\ufffd" not in p for p in pieces)   # partial UTF-8 is held back
    # the emoji alone is several byte tokens: nothing printed until it is complete
    emoji = tok.encode("😀")
    assert len(emoji) > 1
    sd = StreamDecoder(tok)
    assert [sd.push([i]) for i in emoji] == [""] * (len(emoji) - 1) + ["😀"]
    sd = StreamDecoder(tok)   # several ids per push
    assert sd.push(ids[:5]) + sd.push(ids[5:]) + sd.flush() == text


def test_fingerprint_tells_tokenizers_apart(tiny_pair, tmp_path):
    a = checkpoint.load_tokenizer(tiny_pair[0])
    other = tmp_path / "other"
    shutil.copytree(tiny_pair[0], other)
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(str(other / "tokenizer.json"))
    t.add_special_tokens(["<|extra|>"])
    t.save(str(other / "tokenizer.json"))
    b = checkpoint.load_tokenizer(other)
    assert a.fingerprint() != b.fingerprint() and len(a.fingerprint()) == 64


# ------------------------------------------------------------------------------ errors
@pytest.fixture
def broken(tiny_pair, tmp_path):
    """A writable copy of the tiny target."""
    dst = tmp_path / "broken"
    shutil.copytree(tiny_pair[0], dst)
    return dst


def _expect(path, *words):
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_model(path, max_slots=16)
    msg = str(info.value)
    for w in words:
        assert w in msg, msg
    return msg


def test_truncated_safetensors(broken):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    _expect(broken, str(f), "truncated or corrupt")


def test_corrupt_safetensors_header(broken):
    f = broken / "model.safetensors"
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    _expect(broken, str(f), "truncated or corrupt")
    f.write_bytes(os.urandom(64))
    _expect(broken, str(f))


def test_missing_files(broken):
    os.remove(broken / "model.safetensors")
    _expect(broken, str(broken), "model.safetensors")
    (broken / "pytorch_model.bin").write_bytes(b"pickle")
    _expect(broken, "never loaded")


def test_missing_config_and_tokenizer(broken, tmp_path):
    os.remove(broken / "tokenizer.json")
    _expect(broken, "tokenizer.json")
    os.remove(broken / "config.json")
    with pytest.raises(CheckpointError, match="config.json"):
        checkpoint.read_model_config(broken)
    with pytest.raises(CheckpointError, match="no such file"):
        checkpoint.load_model(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="missing"):
        checkpoint.load_model(tmp_path / "nowhere.gguf")


def test_unsupported_architecture(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "gemma3"
    cfg["architectures"] = ["Gemma3ForCausalLM"]
    (broken / "config.json").write_text(json.dumps(cfg))
    msg = _expect(broken, "gemma3", "llama", "qwen2")
    assert "unsupported" in msg
    with pytest.raises(CheckpointError, match="gemma3"):
        checkpoint.read_model_config(broken)
    assert isinstance(CheckpointError("x"), UserError)


def test_missing_tensor_and_wrong_shape(broken):
    from safetensors.torch import load_file, save_file
    f = broken / "model.safetensors"
    tensors = load_file(str(f))
    good = dict(tensors)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    _expect(broken, "model.layers.1.mlp.up_proj.weight", "missing")
    tensors = dict(good)
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, str(f), metadata={"format": "pt"})
    _expect(broken, "model.layers.0.self_attn.o_proj.weight", "shape")


def test_sharded_index_missing_shard(broken):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect(broken, "model-00001-of-00002.safetensors", "missing")

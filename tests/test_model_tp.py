"""Tensor parallelism under mpiexec: TP=2 and TP=4 give the TP=1 logits within 1e-5 (CPU float32)
for prefill, a tree verify, KV compaction and decode (tests/mpi_scripts/tp_logits.py runs the
same `scenario` on every rank). Covers KV heads split and replicated (2 KV heads at TP=4),
uneven query->KV maps, a vocabulary and MLP width that TP does not divide, a tied head, the
Llama output-projection bias, the bf16 all-reduce path, and the loading peak RSS of a shard."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from engine_helpers import MPIEXEC
from model_configs import small_config
from swiftspec_mpi.checkpoints.hf_loader import SafetensorsSource
from swiftspec_mpi.checkpoints.tiny import random_weights, write_hf_folder
from swiftspec_mpi.network.config import ModelConfig
from swiftspec_mpi.network.transformer import Transformer

pytestmark = pytest.mark.mpi

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mpi_scripts", "tp_logits.py")
TOL = 1e-5


def _scenario():
    spec = importlib.util.spec_from_file_location("tp_logits", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.scenario


def _cfg(arch, **kw) -> ModelConfig:
    """small_config with a vocabulary (97) and an MLP width (90) that TP = 4 does not divide."""
    return small_config(arch, **{"vocab_size": 97, "intermediate_size": 90, "num_layers": 2, **kw})


MODELS = {
    # 2 KV heads: split at TP=2, replicated at TP=4; vocab 97 and MLP 90 not divisible by 4
    "qwen_kv2": _cfg("qwen2"),
    # 8 heads / 2 KV, tied head (vocab padding on a tied head), Llama o_proj bias on rank 0
    "llama_tied_h8kv2": _cfg("llama", num_heads=8, num_kv_heads=2, head_dim=8,
                             tie_word_embeddings=True, attention_bias=True),
    # 12 heads / 3 KV: rank query heads that straddle KV groups (per-query-head KV copies)
    "llama_h12kv3": _cfg("llama", hidden_size=96, num_heads=12, num_kv_heads=3, head_dim=8,
                         intermediate_size=128),
}
BIG = _cfg("qwen2", vocab_size=4096, hidden_size=512, num_heads=8, num_kv_heads=2,
           head_dim=64, intermediate_size=1408, num_layers=6)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp_models")
    out = {}
    for i, (name, cfg) in enumerate(MODELS.items()):
        w = random_weights(cfg, seed=100 + i, late_scale=1.0)
        key = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        w[key] = w[key] * (0.3 if not cfg.tie_word_embeddings else 0.1)   # logits of O(1)
        out[name] = write_hf_folder(str(base / name), cfg, w)
    out["big"] = write_hf_folder(str(base / "big"), BIG, random_weights(BIG, seed=7))
    return out


def _reference(folder, dtype=torch.float32):
    src = SafetensorsSource(folder)
    m = Transformer(src.config, max_slots=64, dtype=dtype)
    m.load_weights(src)
    return _scenario()(m)


def _mpirun(n, models, tmp_path):
    spec = tmp_path / f"spec{n}.json"
    out = tmp_path / f"out{n}"
    out.mkdir()
    spec.write_text(json.dumps({"models": models}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([*MPIEXEC, "-n", str(n), sys.executable, SCRIPT, str(spec), str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"mpiexec -n {n} failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    reports = json.loads((out / "report.json").read_text())
    assert len(reports) == n
    return out, reports


def _compare(out, name, ref, tol):
    got = torch.load(out / f"{name}.pt")
    assert len(got) == len(ref)
    worst = max((a - b).abs().max().item() for a, b in zip(got, ref))
    assert worst < tol, f"{name}: TP logits differ from TP=1 by {worst}"
    return worst


@pytest.mark.parametrize("n", [2, 4])
def test_tp_equals_single(n, folders, tmp_path):
    models = [{"name": k, "folder": folders[k]} for k in MODELS]
    if n == 2:
        models.append({"name": "qwen_kv2_bf16", "folder": folders["qwen_kv2"],
                       "dtype": "bfloat16"})
        models.append({"name": "big", "folder": folders["big"], "rss": True, "max_slots": 32})
    out, reports = _mpirun(n, models, tmp_path)
    for r in reports:
        assert all(r["comm"].values()), r["comm"]
        for name, m in r["models"].items():
            assert m["ranks_identical"], f"{name}: ranks returned different logits"
    for name in MODELS:
        _compare(out, name, _reference(folders[name]), TOL)
    if n == 4:   # 2 KV heads at TP=4: each rank keeps one replicated KV head
        assert all(r["models"]["qwen_kv2"]["n_kv_local"] == 1 for r in reports)
    if n == 2:
        ref = _reference(folders["qwen_kv2"], torch.bfloat16)
        scale = max(x.abs().max().item() for x in ref)
        _compare(out, "qwen_kv2_bf16", ref, 0.05 * scale)
        _compare(out, "big", _reference(folders["big"]), 1e-3)
        for r in reports:   # streaming shard loads: peak RSS growth <= 1.5x the rank's weights
            rss = r["models"]["big"]["rss"]
            grown = (rss["peak_kb"] - rss["before_kb"]) * 1024 - rss["kv_bytes"]
            assert grown <= 1.5 * rss["weight_bytes"], rss


def test_tp_degree_must_divide_heads():
    from swiftspec_mpi.core.errors import UserError

    class FakeComm:
        rank, size, seconds = 0, 3, 0.0
    with pytest.raises(UserError, match="does not divide"):
        Transformer(MODELS["qwen_kv2"], comm=FakeComm(), max_slots=8)

"""The engine on a real model: SmolLM2-135M (GGUF from its registry package) with a
layer-truncated draft of itself (self-speculation). Greedy async == ar, token for token.

The opt-in test (`pytest -m slow`) runs the real Qwen2.5-Coder 0.5B -> 1.5B pair. Each skips only
where its model is neither in the model cache nor downloadable (no network to its package index);
a download, conversion or load that fails is a failure."""
from __future__ import annotations

import pytest

from conftest import need_registry_model
from engine_helpers import read_outputs, read_requests, run_swiftspec, write_prompts

pytestmark = pytest.mark.mpi


def _prepared(name):
    from swiftspec_mpi.checkpoints import registry
    need_registry_model(name)
    return str(registry.resolve_model(name))


def test_smollm2_self_speculation_equals_ar(tmp_path):
    target = _prepared("smollm2-135m")
    prompts = write_prompts(tmp_path / "p.jsonl", ["def fibonacci(n):", "The three laws of robotics are"])
    outs = {}
    for mode, n in [("ar", 1), ("async", 2)]:
        out = tmp_path / f"{mode}.h5"
        run_swiftspec(n, ["--target", target, "--draft-layers", "12", "--mode", mode, "--prompts",
                          prompts, "--max-new-tokens", "64", "--out", str(out), "--quiet"], timeout=400)
        outs[mode] = read_outputs(out)
    assert outs["async"] == outs["ar"]
    steps = [r["steps"] for r in read_requests(tmp_path / "async.h5")]
    assert max(int(s["accepted"].max()) for s in steps) > 1   # real speculation happened


@pytest.mark.slow
def test_qwen_pair_async_equals_ar(tmp_path):
    target, draft = _prepared("qwen2.5-coder-1.5b"), _prepared("qwen2.5-coder-0.5b")
    prompts = write_prompts(tmp_path / "p.jsonl", ["Write a Python function that merges two sorted lists."])
    outs = {}
    for mode, n in [("ar", 2), ("async", 2)]:
        out = tmp_path / f"{mode}.h5"
        run_swiftspec(n, ["--target", target, "--draft", draft, "--mode", mode, "--chat", "--prompts",
                          prompts, "--max-new-tokens", "64", "--out", str(out), "--quiet"], timeout=1200)
        outs[mode] = read_outputs(out)
    assert outs["async"] == outs["ar"]

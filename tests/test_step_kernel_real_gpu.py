"""The persistent step kernel on a real checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF: llama, 30
layers, d=576, 9 / 3 heads of 64, inter 1536, tied vocabulary 49152) through `swiftspec run`.

The file: $SWIFTSPEC_SMOLLM2_GGUF, else the model cache's copy (`swiftspec models prepare
smollm2-135m --gguf-only`); neither: skip (a failure under SWIFTSPEC_TEST_STRICT=1).

On the GPU this file runs dequantized to bf16, never packed 4-bit: the GPU keeps 4-bit weights
packed only for AWQ/GPTQ checkpoints (checkpoints.load.gpu_packed refuses --quant int4 on a GGUF),
and SmolLM2's K = 576 is no multiple of the 4-bit kernels' 128-k chunks anyway (w4a16.supported,
step_kernel.shape_reason). test_smollm2_gpu_runs_bf16 checks those decisions on any machine.

The GPU tests (`-m gpu`): greedy `ar` with the chain of kernels (the default step kernel), 3
prompts x 48 tokens, --ignore-eos, is the reference of `ar`, `sync` (one rank) and `async` (two
ranks on the one GPU) with --step-kernel persistent (sync / async: a 12-layer draft of the model
itself). The trace and
`swiftspec analyze` must say which step kernel ran. Both kernels round activations to bf16 at the
same places but sum in different orders, so where the two best logits are within bf16 error either
may win. The rule (tests/test_gpu_engine.py's), against the float32 model on the CPU teacher-forced
on each output: every token is the greedy choice within BF16_TIE of the position's largest |logit|,
and each output equals chain ar's up to a position where the reference's top-2 margin is under
BF16_TIE (a near-tie), or entirely.
"""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from conftest import need_registry_model, skip_or_fail
from engine_helpers import read_outputs, read_requests, read_root, run_swiftspec, write_prompts

ENV = "SWIFTSPEC_SMOLLM2_GGUF"
PROMPTS = ["def fibonacci(n):", "The three laws of robotics are", "Write a haiku about GPUs."]
NEW_TOKENS = 48
# a bf16 near-tie, relative to the position's largest |logit|: about twice the largest bf16 error of
# a logit (0.0098) and 16x the largest gap between a bf16 greedy token and the float32 best (0.0012)
# measured on this model (eager bf16 torch on the CPU against float32, these prompts x 48 tokens)
BF16_TIE = 0.02


@pytest.fixture(scope="module")
def smollm2():
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (module doc)."""
    from swiftspec_mpi.checkpoints import registry
    path = os.environ.get(ENV)
    if path:
        if not os.path.isfile(path):
            skip_or_fail(f"{ENV}={path} is not a file; point it at SmolLM2-135M-Instruct.Q4_1.gguf")
        return path
    need_registry_model("smollm2-135m")           # in the model cache, or the index reachable
    return str(registry.ensure_gguf("smollm2-135m"))


def test_smollm2_gpu_runs_bf16(smollm2):
    """What `swiftspec run --device cuda` does with this file: --quant auto dequantizes it (to
    --dtype bfloat16), --quant int4 is refused naming the fix; every projection is a shape the
    step kernel computes whole as bf16, while as 4-bit the 576-input ones would be refused."""
    from swiftspec_mpi.checkpoints import load
    from swiftspec_mpi.core.errors import UserError
    from swiftspec_mpi.gpu import step_kernel as sk
    from swiftspec_mpi.gpu import w4a16
    assert load.gpu_packed(smollm2, "auto") is False
    with pytest.raises(UserError, match="--quant int4.*GGUF"):
        load.gpu_packed(smollm2, "int4")
    c = load.read_model_config(smollm2)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    ops = [(qkv, c.hidden_size), (c.hidden_size, c.num_heads * c.head_dim),
           (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size),
           (c.vocab_size, c.hidden_size)]
    assert all(sk.shape_reason("bf16", rows, k) is None for rows, k in ops)
    assert [sk.shape_reason("4-bit", rows, k, 32) is None for rows, k in ops] == [False, False, False, True, False]
    assert not w4a16.supported(qkv, c.hidden_size, 32)


@pytest.fixture(scope="module")
def reference(smollm2):
    """gaps(prompt_ids, output_ids) -> [(gap, margin)] per output token: the float32 model on the
    CPU teacher-forced on prompt + output (engine_helpers.greedy_gaps, the model loaded once)."""
    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask
    model, _ = load_model(smollm2, max_slots=512, dtype=torch.float32, device="cpu", quant="none")

    def gaps(prompt_ids, output_ids):
        n = len(prompt_ids) + len(output_ids)
        with torch.no_grad():
            logits = model(torch.tensor(prompt_ids + output_ids), torch.arange(n), 0, chain_mask(0, n))
        logits = logits[len(prompt_ids) - 1:n - 1].double()
        scale = logits.abs().max(-1).values
        top2 = logits.topk(2, dim=-1).values
        chosen = logits.gather(1, torch.tensor(output_ids)[:, None])[:, 0]
        return list(zip(((top2[:, 0] - chosen) / scale).tolist(), ((top2[:, 0] - top2[:, 1]) / scale).tolist()))
    return gaps


def _run(path, folder, name, mode, ranks, kernel, extra=()):
    """One `swiftspec run` on the GPU, bf16, of PROMPTS -> (outputs, prompt ids). Checks that the
    file ran dequantized, every step shape was captured in the warm-up, and the trace and analyze
    record `kernel` as the step kernel of every model (rank 0's)."""
    prompts = write_prompts(folder / "p.jsonl", PROMPTS)
    out = folder / f"{name}.h5"
    args = ["--target", path, "--mode", mode, "--device", "cuda", "--dtype", "bfloat16", "--step-kernel", kernel,
            "--prompts", prompts, "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--out", str(out), "--quiet",
            *extra]
    t0 = time.perf_counter()
    proc = run_swiftspec(ranks, args, timeout=300)
    print(f"{name}: swiftspec run took {time.perf_counter() - t0:.1f} s")
    assert "running the chain of kernels" not in proc.stderr, proc.stderr[-2000:]
    root = read_root(out)
    assert root["config"]["quant"] == "none", root["config"]            # dequantized, not packed
    assert root["ranks"]["late_graph_captures"].tolist() == [0] * ranks, (name, root["ranks"])
    from swiftspec_mpi.trace.analyze import render_table, summarize
    from swiftspec_mpi.trace.read import read_traces
    ran = json.loads(root["env_json"])["graphs"]["step_kernel"]
    roles = {"target"} if mode == "ar" else {"target", "draft"}
    assert "target" in ran and set(ran) <= roles and set(ran.values()) == {kernel}, (name, ran)
    text = render_table([summarize(t) for t in read_traces([str(out)])])      # `swiftspec analyze`'s table
    line = ", ".join(f"{role} {how}" for role, how in ran.items())
    assert f"step kernel: {line}" in text, text
    return read_outputs(out), [r["prompt_ids"] for r in read_requests(out)]


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _need_step_kernel():
    from swiftspec_mpi.gpu import launch
    if not launch.available():
        pytest.skip("CuPy + nvcc + an sm_90 GPU are needed for the step kernel")


@pytest.fixture(scope="module")
def chain_ar(smollm2, reference, tmp_path_factory):
    """(outputs, prompt ids, gaps per request) of greedy ar with the chain of kernels."""
    _need_step_kernel()
    outs, ids = _run(smollm2, tmp_path_factory.mktemp("chain"), "chain-ar", "ar", 1, "chain")
    gaps = [reference(p, o) for p, o in zip(ids, outs)]
    for r, g in enumerate(gaps):
        print(f"chain ar request {r}: largest gap to the float32 greedy {max(x for x, _ in g):.4f}")
        assert len(outs[r]) == NEW_TOKENS and max(x for x, _ in g) <= BF16_TIE, (r, len(outs[r]), g)
    return outs, ids, gaps


def _check_against_chain(name, outs, ids, chain_ar, reference):
    """The module doc's rule for `outs` of a run with `ids` against chain ar."""
    ref, ref_ids, ref_gaps = chain_ar
    assert ids == ref_ids
    for r, prompt in enumerate(ids):
        got = outs[r]
        assert len(got) == NEW_TOKENS, (name, r, len(got))
        gaps = ref_gaps[r] if got == ref[r] else reference(prompt, got)
        print(f"{name} request {r}: largest gap to the float32 greedy {max(g for g, _ in gaps):.4f}")
        far = [(i, round(g, 4)) for i, (g, _) in enumerate(gaps) if g > BF16_TIE]
        assert not far, f"{name} request {r}: tokens not a greedy choice within {BF16_TIE}: {far}"
        i = first_difference(got, ref[r])
        if i is not None:
            print(f"{name} request {r}: parts from chain ar at token {i} (top-2 margin {ref_gaps[r][i][1]:.4f})")
            assert ref_gaps[r][i][1] < BF16_TIE, f"{name} request {r}: differs from chain ar at {i}, not a near-tie"


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode,ranks", [("ar", 1), ("sync", 1), ("async", 2)])
def test_smollm2_persistent_equals_chain_ar(mode, ranks, smollm2, reference, chain_ar, tmp_path):
    """--step-kernel persistent in `mode` (sync / async: a 12-layer draft of the model itself)
    against the chain's greedy ar, by the module doc's rule."""
    extra = () if mode == "ar" else ("--draft-layers", "12")
    outs, ids = _run(smollm2, tmp_path, f"persistent-{mode}", mode, ranks, "persistent", extra)
    _check_against_chain(f"persistent {mode}", outs, ids, chain_ar, reference)

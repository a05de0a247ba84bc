"""The persistent step kernel (cuda/step_kernel.cu, gpu/step_kernel.py) on the GPU (`-m gpu`).

Logits of one step against the chain's (`forward_graphable` with the fused kernels) and against a
float32 reference of the same weights written here (the model's bf16 / dequantized 4-bit weights
in float32, the committed KV in float32, plain torch ops), for N in {1, 2, 5, 8, 16, 32}, trees of
several shapes, contexts 1..4096, bf16 and 4-bit (groups 32, 64, 128) weights, Llama and Qwen2
(biases) shapes with few layers, and SmolLM2-135M's (bf16 inputs of 576: two 256-k pages and a
partial one of 64; 9 query heads on 3 KV heads). Every output buffer and the KV slots the step writes are poisoned
(NaN) first, and so are the KV slots past the context: the result must be finite, so everything
read was written. The rule: the kernel's max relative error to the float32 reference is at most
1.5x the chain's plus 0.004 (both round activations to bf16 at the same places). The new K/V rows
equal the chain's to bf16 rounding. The watchdog: a wait that can never be met becomes a
StepKernelError naming the instruction, the device is not hung and the next step is correct.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from tree_masks import tree_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _available():
    from swiftspec_mpi.gpu import launch
    if not launch.available():
        pytest.skip("CuPy + nvcc + an sm_90 GPU are needed")


def _model(spec: str, layers: int, quant: str = "none", group: int = 128, slots: int = 4224):
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.checkpoints import dummy
    from swiftspec_mpi.checkpoints.load import dummy_model
    old = dummy.RandomPackedSource.GROUP
    dummy.RandomPackedSource.GROUP = group
    try:
        model, _ = dummy_model(spec, SingleComm(), slots, torch.bfloat16, "cuda", num_layers=layers,
                               quant=quant)
    finally:
        dummy.RandomPackedSource.GROUP = old
    return model


def _dense(w) -> torch.Tensor:
    from swiftspec_mpi.gpu import w4a16
    return w4a16.dequantize(w).float() if isinstance(w, w4a16.W4A16Weight) else w.float()


def reference(model, tokens, positions, slots, mask, L) -> torch.Tensor:
    """float32 logits [N, V] of one step: the model's weights and committed KV in float32; the new
    tokens' K/V are computed here (not read from the cache)."""
    cfg, sh = model.cfg, model.shard
    hd, nh, nkv = cfg.head_dim, sh.nh_l, sh.nkv_l
    N, eps = tokens.shape[0], cfg.rms_norm_eps
    cos = model.rope_cos.float()[positions].unsqueeze(1)
    sin = model.rope_sin.float()[positions].unsqueeze(1)
    x = model.embed.float()[tokens]
    new = torch.zeros(L, dtype=torch.bool, device=x.device)
    new[slots] = True
    for lay in model.layers:
        h = F.rms_norm(x, (cfg.hidden_size,), lay.ln1.float(), eps)
        qkv = h @ _dense(lay.wqkv).T
        if lay.bqkv is not None:
            qkv = qkv + lay.bqkv.float()
        qk = qkv[:, :(nh + nkv) * hd].view(N, nh + nkv, hd)
        qk = qk * cos + torch.roll(qk, hd // 2, -1) * sin
        q, k_new = qk[:, :nh], qk[:, nh:]
        v_new = qkv[:, (nh + nkv) * hd:].view(N, nkv, hd)
        k = lay.k_cache[:L].float().clone()
        v = lay.v_cache[:L].float().clone()
        k[~new] = torch.nan_to_num(k[~new])
        v[~new] = torch.nan_to_num(v[~new])
        k[slots], v[slots] = k_new, v_new
        g = nh // nkv
        kk = k.repeat_interleave(g, 1).transpose(0, 1)                  # [nh, L, hd]
        vv = v.repeat_interleave(g, 1).transpose(0, 1)
        s = torch.einsum("nhd,hld->hnl", q, kk) / math.sqrt(hd)
        s = s.masked_fill(~mask[:, :L].unsqueeze(0), -math.inf)
        o = torch.einsum("hnl,hld->nhd", torch.softmax(s, -1), vv).reshape(N, nh * hd)
        a = o @ _dense(lay.wo).T
        if lay.bo is not None:
            a = a + lay.bo.float()
        x = x + a
        h = F.rms_norm(x, (cfg.hidden_size,), lay.ln2.float(), eps)
        gu = h @ _dense(lay.wgu).T
        I = gu.shape[1] // 2
        x = x + (F.silu(gu[:, :I]) * gu[:, I:]) @ _dense(lay.wd).T
    x = F.rms_norm(x, (cfg.hidden_size,), model.norm.float(), eps)
    return x @ _dense(model.head).T


def _parents(kind: str, n: int) -> list[int]:
    if kind == "chain":
        return [i - 1 for i in range(n)]
    if kind == "binary":
        return [-1] + [(i - 1) // 2 for i in range(1, n)]
    if kind == "star":
        return [-1] + [0] * (n - 1)
    gen = torch.Generator().manual_seed(n)
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def _step_inputs(model, n: int, start: int, kind: str, seed: int):
    """Random committed KV in slots [0, start), NaN in every slot from `start` on; the step's
    inputs in the GraphedModel layout (mask [n, max_slots] uint8, n_valid int32 [1])."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for buf in (model.k_cache, model.v_cache):
        buf[:, :start] = torch.randn(buf[:, :start].shape, generator=gen, device="cuda").to(buf.dtype)
        buf[:, start:] = math.nan
    pos, m = tree_mask(_parents(kind, n), start)
    S = model.max_slots
    mask = torch.zeros(n, S, dtype=torch.bool, device="cuda")
    mask[:, :start + n] = m.cuda()
    tokens = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen, device="cuda")
    slots = torch.arange(start, start + n, device="cuda")
    n_valid = torch.tensor([start + n], dtype=torch.int32, device="cuda")
    return tokens, pos.cuda(), slots, mask, n_valid


def _poison(sk, n):
    st = sk.state(n)
    for t in (st.x, st.qkv, st.o, st.h, st.logits, st.attn_part):
        t.fill_(math.nan)


def _rel(a, ref):
    return ((a.float() - ref).abs().max() / ref.abs().max()).item()


def _check_step(model, n, start, kind, seed=0, warps=8):
    from swiftspec_mpi.gpu.step_kernel import StepKernel
    sk = model.__dict__.get(f"_sk_test{warps}")
    if sk is None:
        sk = model.__dict__[f"_sk_test{warps}"] = StepKernel(model, warps=warps)
    tokens, pos, slots, mask, n_valid = _step_inputs(model, n, start, kind, seed)
    L = start + n
    ref = reference(model, tokens, pos, slots, mask, L)
    chain = model.forward_graphable(tokens, pos, slots, mask, n_valid).float().clone()
    k_chain = model.k_cache[:, start:L].clone()
    v_chain = model.v_cache[:, start:L].clone()
    model.k_cache[:, start:] = math.nan
    model.v_cache[:, start:] = math.nan
    _poison(sk, n)
    got = sk.forward(tokens, pos, slots, mask, n_valid).clone()
    sk.check()
    assert torch.isfinite(got).all(), (n, start, kind)
    e_chain, e_got = _rel(chain, ref), _rel(got, ref)
    assert e_got <= 1.5 * e_chain + 0.004, (n, start, kind, e_got, e_chain)
    for new, old in ((model.k_cache[:, start:L], k_chain), (model.v_cache[:, start:L], v_chain)):
        assert torch.isfinite(new).all()
        assert _rel(new, old.float()) < 0.02
    assert torch.isnan(model.k_cache[:, L:L + 4]).all()                   # nothing past the step written
    return e_got, e_chain


CASES = [(1, 1, "chain"), (2, 40, "chain"), (5, 333, "binary"), (8, 1024, "binary"), (16, 777, "star"),
         (32, 200, "random"), (8, 4088, "random"), (32, 4064, "binary")]
# STEP_KERNEL_CASES=quick (benchmarks/gpu_step_kernel_quick.sh): N 1, 8, 32 at contexts near 1024
# and 4096, the three m-block variants of the kernel
if os.environ.get("STEP_KERNEL_CASES") == "quick":
    CASES = [(1, 1023, "chain"), (8, 1024, "binary"), (32, 4064, "binary")]


@pytest.mark.parametrize("spec,layers,quant,group", [
    ("llama-3.2-1b", 2, "none", 128), ("llama-3.2-1b", 2, "int4", 128), ("llama-3-8b", 2, "none", 128),
    ("llama-3-8b", 2, "int4", 32), ("qwen2.5-0.5b", 3, "none", 128), ("qwen2.5-0.5b", 3, "int4", 64),
    ("smollm2-135m", 3, "none", 128)])
def test_step_logits_match_chain_and_float32(spec, layers, quant, group):
    _available()
    model = _model(spec, layers, quant, group)
    if spec.startswith("qwen"):
        assert model.layers[0].bqkv is not None                           # biases exercised
    errs = [(_check_step(model, n, start, kind)) for n, start, kind in CASES]
    print(spec, quant, group, [(round(a, 4), round(b, 4)) for a, b in errs])


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_step_logits_16_warps(quant):
    """The kernel built for 16 compute warps a block (k-split, norm and attention splits wider)."""
    _available()
    model = _model("llama-3.2-1b", 2, quant, 128)
    errs = [(_check_step(model, n, start, kind, warps=16)) for n, start, kind in CASES]
    print("16 warps", quant, [(round(a, 4), round(b, 4)) for a, b in errs])


def test_step_in_graph_and_reads():
    """GraphedModel with the step kernel: forward_argmax / topk inside the graph equal the reads of
    the eager step's logits, step after step (counters reset by the kernel itself)."""
    _available()
    from swiftspec_mpi.gpu import step_kernel
    from swiftspec_mpi.gpu.graphs import GraphedModel, logits_argmax
    model = _model("llama-3.2-1b", 2, "int4")
    model.step_kernel = step_kernel.StepKernel(model)
    g = GraphedModel(model)
    for i, (n, start) in enumerate([(1, 10), (8, 11), (1, 19), (8, 20)]):
        pos, m = tree_mask(_parents("binary", n), start)
        toks = torch.randint(0, 1000, (n,))
        ids = g.forward_argmax(toks, pos, start, m)
        logits = g.forward(toks, pos, start, m).clone()
        assert (ids == logits_argmax(logits)).all(), i
        tk, lp = g.forward_topk_logprobs(toks, pos, start, m, 8)
        assert (tk[:, 0] == ids).all()
    model.step_kernel.check()


def test_watchdog_names_the_instruction():
    _available()
    from swiftspec_mpi.gpu.step_kernel import StepKernel, StepKernelError
    from swiftspec_mpi.gpu import step_schedule as ss
    model = _model("llama-3.2-1b", 2)
    sk = StepKernel(model, timeout_s=0.2)
    tokens, pos, slots, mask, n_valid = _step_inputs(model, 2, 50, "chain", 1)
    sk.forward(tokens, pos, slots, mask, n_valid)
    sk.check()
    instr = sk.state(2).schedule.instr
    i = next(i for i, w in enumerate(instr) if w[0] == ss.ATTN and w[1] == 1)
    sk.break_wait(2, i)
    sk.forward(tokens, pos, slots, mask, n_valid)
    with pytest.raises(StepKernelError, match=rf"instruction {i} \(N=2 layer 1 attention"):
        sk.check()
    sk.repair(2)
    _check_step(model, 2, 50, "chain")


def test_timeline_records_every_instruction_without_changing_the_step():
    """record_timeline: every instruction's (wait from, run from, done at) in order, each stage
    running after the one it waits for; the logits with the timeline on equal those without."""
    _available()
    import numpy as np
    from swiftspec_mpi.gpu import step_timeline
    from swiftspec_mpi.gpu.step_kernel import StepKernel
    model = _model("llama-3.2-1b", 2, "int4")
    sk = StepKernel(model)
    tokens, pos, slots, mask, n_valid = _step_inputs(model, 8, 300, "binary", 2)
    plain = sk.forward(tokens, pos, slots, mask, n_valid).clone()
    t = sk.record_timeline(8)
    timed = sk.forward(tokens, pos, slots, mask, n_valid).clone()
    sk.check()
    assert torch.equal(plain, timed)
    tl = t.cpu().numpy()
    assert (tl[:, :3] > 0).all() and (tl[:, 0] <= tl[:, 1]).all() and (tl[:, 1] <= tl[:, 2]).all()
    sched = sk.state(8).schedule
    inner = sched.instr[:, 0] != 0                          # every GEMV and ATTN: its marks in order
    for a, b in ((1, 3), (3, 4), (4, 5), (5, 2)):
        assert (tl[inner, a] <= tl[inner, b]).all()
    gemv = sched.instr[:, 0] == 1                            # the loader's first page before its last
    assert (tl[gemv, 6] > 0).all() and (tl[gemv, 6] <= tl[gemv, 7]).all()
    summ = step_timeline.summarize(sched, tl)
    assert list(summ["stages"])[:3] == ["embed", "norm + qkv", "attention"] and summ["total_us"] > 0
    ph = step_timeline.phases(sched, tl)
    assert ph["attention"]["softmax"] > 0 and ph["norm + gate|up"]["mma"] > 0
    sk.record_timeline(8, on=False)
    sk.forward(tokens, pos, slots, mask, n_valid)
    sk.check()
    assert np.array_equal(t.cpu().numpy(), tl)            # off: the old buffer is not written again


BF16_TIE = 0.03      # as tests/test_gpu_engine.py: a bf16 near-tie relative to the largest |logit|


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    import subprocess
    import sys
    d = tmp_path_factory.mktemp("tiny64")
    subprocess.run([sys.executable, "-m", "swiftspec_mpi", "tiny-checkpoint", str(d), "--hidden", "256",
                    "--heads", "4", "--kv-heads", "2", "--intermediate", "512"], check=True, timeout=300)
    return str(d / "target")


@pytest.mark.mpi
def test_engine_ar_persistent_equals_chain(tiny64, tmp_path):
    """Greedy ar, bf16: --step-kernel persistent gives the chain's tokens, up to a position where
    the float32 reference's top-2 margin is a bf16 near-tie (the rule of tests/test_gpu_engine.py),
    every token the greedy choice within BF16_TIE; the trace records which step ran."""
    import json
    from engine_helpers import greedy_gaps, read_outputs, read_requests, read_root, run_swiftspec, write_prompts
    _available()
    prompts = write_prompts(tmp_path / "p.jsonl", ["Write a Python function to add two numbers.",
                                                  "Explain photosynthesis briefly."])
    outs = {}
    for how in ("persistent", "chain"):
        out = tmp_path / f"{how}.h5"
        run_swiftspec(1, ["--target", tiny64, "--mode", "ar", "--device", "cuda", "--dtype", "bfloat16",
                          "--step-kernel", how, "--prompts", prompts, "--max-new-tokens", "64", "--out", str(out),
                          "--quiet"], timeout=600)
        outs[how] = read_outputs(out)
        graphs = json.loads(read_root(out)["env_json"])["graphs"]
        assert graphs["step_kernel"] == {"target": how}, graphs
    for r, ids in enumerate(r["prompt_ids"] for r in read_requests(tmp_path / "chain.h5")):
        gaps = greedy_gaps(tiny64, ids, outs["persistent"][r])
        assert all(g <= BF16_TIE for g, _ in gaps), gaps
        a, b = outs["persistent"][r], outs["chain"][r]
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is not None:
            assert gaps[i][1] < BF16_TIE, f"request {r}: persistent parts from the chain at {i}, not a near-tie"

"""W4A16 kernels (cuda/w4a16.cu via swiftspec_mpi.gpu.w4a16) and the 4-bit GPU step.

CPU: the device layout's repacking is a bijection that puts each code where the kernels read it.
GPU (marked gpu): the GEMV against a float64 product of the dequantized weights for every M in
1..32, groups 32 and 128 (64 once), Llama-3-8B and -70B projection shapes, fresh random inputs,
poisoned outputs; the dequantization exact; PDL launches in a CUDA graph; the fused all-reduce at
TP = 1; a 4-bit model's graphed step against its eager forward; the 4-bit LM head (--head-bits 4).
"""
from __future__ import annotations

import math

import pytest
import torch

from allreduce_checks import assert_fused_equals_plain, single_rank_allreduce
from swiftspec_mpi.gpu import kernels, w4a16
from swiftspec_mpi.packed.int4 import PackedInt4, dequantize, unpack_codes

needs_gpu = pytest.mark.skipif(not kernels.available(), reason="needs CuPy, nvcc and an sm_90 GPU")
TOL = 1e-2      # bf16 activations and bf16-rounded weights, output in bf16 (METHOD: 1e-3 .. 1e-2)
# (N, K) of the projections: Llama-3-8B o_proj, down_proj, gate|up; Llama-3-70B o_proj, down_proj
SHAPES_8B = ((4096, 4096), (4096, 14336), (28672, 4096))
SHAPES_70B = ((8192, 8192), (8192, 28672))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def random_packed(n: int, k: int, group: int, gen: torch.Generator, device="cpu") -> PackedInt4:
    """Random codes, positive scales and offsets of either sign (GGUF-like: not just -z * s)."""
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8, device=device)
    scale = (torch.rand(n, k // group, generator=gen, device=device) * 0.01 + 0.001) / math.sqrt(k)
    offset = scale * (torch.rand(n, k // group, generator=gen, device=device) * 20 - 15)
    return PackedInt4(q, scale.float(), offset.float(), group)


# ------------------------------------------------------------------------------------- CPU
def test_repack_roundtrip_and_word_layout():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 256, (48, 384 // 2), dtype=torch.uint8, generator=gen)
    d = w4a16.repack_codes(q)
    assert torch.equal(w4a16.unpack_device(d), q)
    codes = unpack_codes(q)
    flat = d.flatten()
    for n in (0, 17, 47):                     # every word of a few rows, read as the kernel does
        t, r = divmod(n, 16)
        for c in range(3):
            for lane_q in range(4):
                for p in range(4):
                    o = 16 * t * (384 // 2) + 1024 * c + 64 * r + 16 * lane_q + 4 * p
                    word = int.from_bytes(bytes(flat[o:o + 4].tolist()), "little")
                    for i in range(8):
                        k = 128 * c + 32 * p + 8 * lane_q + w4a16.PERM[i]
                        assert (word >> (4 * i)) & 15 == codes[n, k]


def test_scales_tile_major_roundtrip():
    """so: (tile t, chunk c) holds the 16 rows' 128 / g words in one piece, row by row."""
    gen = torch.Generator().manual_seed(2)
    for group in (32, 64, 128):
        so = torch.randint(-2**31, 2**31 - 1, (32, 512 // group), dtype=torch.int32, generator=gen)
        dev = w4a16.to_tiles(so, 128 // group)
        assert torch.equal(w4a16.from_tiles(dev, 128 // group), so)
        sw, flat = 128 // group, dev.flatten()
        for n, gi in ((0, 0), (5, 3), (31, 512 // group - 1)):
            t, r = divmod(n, 16)
            c, j = divmod(gi, sw)
            assert flat[16 * t * (512 // group) + 16 * sw * c + sw * r + j] == so[n, gi]


def test_pack_scales_halves():
    s = torch.tensor([[0.5, 0.015625]])
    o = torch.tensor([[-3.0, 0.25]])
    so = w4a16.pack_scales(s, o)
    assert so.dtype == torch.int32 and so.shape == (1, 2)
    pair = so.view(torch.bfloat16).view(1, 2, 2).float()
    assert torch.equal(pair[..., 0], s) and torch.equal(pair[..., 1], o)


def test_supported_shapes():
    assert w4a16.supported(4096, 14336, 128) and w4a16.supported(16, 128, 32)
    assert not w4a16.supported(4096, 4160, 32)      # K not a multiple of 128
    assert not w4a16.supported(4104, 4096, 128)     # N not a multiple of 16
    assert not w4a16.supported(4096, 4096, 16)


# ------------------------------------------------------------------------------------- GPU
def _check_gemm(n, k, group, ms, gen):
    wp = random_packed(n, k, group, gen, "cuda")
    w = w4a16.from_packed(wp, "cuda")
    wd = dequantize(wp).double()                         # the exact weights, float64
    errs = []
    for m in ms:
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        w4a16.gemm(x, w, out=out)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(out).all()), f"unwritten outputs: N={n} K={k} g={group} M={m}"
        e = rel_err(out, x.double() @ wd.T)
        errs.append(e)
        assert e < TOL, f"N={n} K={k} g={group} M={m}: rel err {e:.2e}"
    return max(errs)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("nk", SHAPES_8B + SHAPES_70B, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemm_matches_float64_every_m(nk, group):
    gen = torch.Generator(device="cuda").manual_seed(hash((nk, group)) & 0xFFFF)
    _check_gemm(*nk, group, range(1, 33), gen)


@pytest.mark.gpu
@needs_gpu
def test_gemm_group64_and_small_shapes():
    gen = torch.Generator(device="cuda").manual_seed(5)
    _check_gemm(4096, 4096, 64, (1, 8, 13, 32), gen)
    _check_gemm(16, 128, 32, (1, 32), gen)             # one tile, one chunk
    _check_gemm(48, 1152, 128, (3, 24), gen)           # warps without a chunk


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", w4a16.VARIANTS)
def test_gemm_variants_same_function(config):
    gen = torch.Generator(device="cuda").manual_seed(7)
    wp = random_packed(8192, 8192, 128, gen, "cuda")
    w = w4a16.from_packed(wp, "cuda")
    ref_w = dequantize(wp).double()
    for m in (1, 8, 17, 32):
        x = torch.randn(m, 8192, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.full((m, 8192), float("nan"), dtype=torch.bfloat16, device="cuda")
        w4a16.gemm(x, w, out=out, config=config)
        assert rel_err(out, x.double() @ ref_w.T) < TOL


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequantize_is_the_rounded_exact_weight(group):
    """dequantize = bf16(q * s + o) with s, o the bf16 values the kernels hold, rounded once."""
    gen = torch.Generator(device="cuda").manual_seed(group)
    wp = random_packed(1024, 2048, group, gen, "cuda")
    w = w4a16.from_packed(wp, "cuda")
    back = w4a16.to_packed(w)
    assert torch.equal(back.qweight, wp.qweight)
    exact = (unpack_codes(back.qweight).double().view(1024, -1, group) * back.scale.double().unsqueeze(-1)
             + back.offset.double().unsqueeze(-1)).view(1024, 2048)
    out = torch.full((1024, 2048), float("nan"), dtype=torch.bfloat16, device="cuda")
    w4a16.dequantize(w, out=out)
    assert torch.equal(out, exact.to(torch.bfloat16))
    # the GEMV multiplies the same weights: against cuBLAS on them, a summation-order difference
    x = torch.randn(8, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    assert rel_err(w4a16.gemm(x, w), x.double() @ exact.T) < 4e-3


@pytest.mark.gpu
@needs_gpu
def test_gemm_pdl_in_graph_equals_plain():
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = w4a16.from_packed(random_packed(4096, 14336, 128, gen, "cuda"), "cuda")
    for m in (1, 8, 32):
        x = torch.randn(m, 14336, generator=gen, device="cuda").to(torch.bfloat16)
        plain = w4a16.gemm(x, w)
        x2 = torch.empty_like(x)
        out = torch.empty_like(plain)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.add(x, 0.0, out=x2)
            w4a16.gemm(x2, w, out=out, pdl=True)
        x2.zero_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("group", [32, 128])
def test_gemm_swiglu_equals_silu_mul_after_gemm(group):
    """The gate|up GEMV with the SwiGLU in its epilogue = fused_ops.silu_mul(gemm(x, w)) bit for
    bit (Llama-3-8B, Llama-3.2-1B and a one-block gate|up; every M class; poisoned outputs), in a
    graph with PDL too; shapes it does not take are refused."""
    from swiftspec_mpi.gpu import fused_ops
    gen = torch.Generator(device="cuda").manual_seed(11 + group)
    for n, k in ((28672, 4096), (16384, 2048), (32, 256)):
        w = w4a16.from_packed(random_packed(n, k, group, gen, "cuda"), "cuda")
        for m in (1, 3, 8, 9, 16, 17, 32):
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            assert w4a16.swiglu_ok(x, w)
            ref = fused_ops.silu_mul(w4a16.gemm(x, w))
            out = torch.full((m, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
            w4a16.gemm_swiglu(x, w, out=out)
            torch.cuda.synchronize()
            assert torch.equal(out, ref), f"N={n} K={k} g={group} M={m}"
    x = torch.randn(8, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    w = w4a16.from_packed(random_packed(28672, 4096, group, gen, "cuda"), "cuda")
    x2, out = torch.empty_like(x), torch.empty(8, 14336, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.add(x, 0.0, out=x2)
        w4a16.gemm_swiglu(x2, w, out=out, pdl=True)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_ops.silu_mul(w4a16.gemm(x, w)))
    odd = w4a16.from_packed(random_packed(48, 256, group, gen, "cuda"), "cuda")     # I = 24
    assert not w4a16.swiglu_ok(x[:, :256], odd)
    with pytest.raises(ValueError):
        w4a16.gemm_swiglu(x[:, :256].contiguous(), odd)


@pytest.mark.gpu
@needs_gpu
def test_linear_dispatch_prompt_rows():
    """More rows than the GEMV takes: dequantize + cuBLAS, the same function."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    wp = random_packed(2048, 4096, 128, gen, "cuda")
    w = w4a16.from_packed(wp, "cuda")
    x = torch.randn(100, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    assert rel_err(w4a16.linear(x, w), x.double() @ dequantize(wp).double().T) < TOL
    with pytest.raises(ValueError):
        w4a16.gemm(x, w)


@pytest.mark.gpu
@needs_gpu
def test_gemm_allreduce_single_rank_equals_gemm():
    """The fused W4A16 GEMM + all-reduce on a 1-rank NCCL communicator equals w4a16.gemm bit for
    bit (the all-reduce of one partial is the identity), eager and inside a graph."""
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    with single_rank_allreduce(8192, 2 * n_sms) as ar:
        gen = torch.Generator(device="cuda").manual_seed(9)
        for m, n, k, g in ((1, 4096, 4096, 128), (8, 4096, 14336, 128), (16, 8192, 8192, 32), (5, 8192, 1024, 128)):
            w = w4a16.from_packed(random_packed(n, k, g, gen, "cuda"), "cuda")
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            assert_fused_equals_plain(lambda: w4a16.gemm_allreduce(x, w, ar, out=out), out,
                                      w4a16.gemm(x, w), f"M={m} N={n} K={k} g={g}")


@pytest.mark.gpu
@needs_gpu
def test_int4_model_graphed_step_matches_eager():
    """A 4-bit Llama-3.2-1B shape (4 layers): the CUDA-graph step (fused ops, W4A16 GEMVs with
    PDL) against the eager forward (torch ops, the GEMV / dequantize + cuBLAS), a prompt first."""
    from swiftspec_mpi.checkpoints.load import dummy_model
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.gpu.graphs import GraphedModel, graphs_supported
    from swiftspec_mpi.network.transformer import chain_mask
    model, _ = dummy_model("llama-3.2-1b", SingleComm(), 512, torch.bfloat16, "cuda", num_layers=4, quant="int4")
    assert isinstance(model.layers[0].wqkv, w4a16.W4A16Weight) and graphs_supported(model)
    dense_bytes = 4 * 2 * (3072 * 2048 + 2048 * 2048 + 2 * 8192 * 2048 + 2048 * 8192)
    assert model.weight_bytes() < 2 * 128256 * 2048 + dense_bytes * 0.3
    gm = GraphedModel(model)
    ids = torch.randint(0, 4000, (40,))
    model.forward(ids.cuda(), torch.arange(40, device="cuda"), 0, chain_mask(0, 40).cuda())   # prompt > 32 rows
    for n in (1, 8, 24):
        toks = torch.randint(0, 4000, (n,))
        pos = torch.arange(40, 40 + n)
        mask = chain_mask(40, n)
        eager = model.forward(toks, pos, 40, mask).float()
        graphed = gm.forward(toks, pos, 40, mask).float()
        assert torch.isfinite(graphed).all()
        assert rel_err(graphed, eager) < 3e-2, n


@pytest.mark.gpu
@needs_gpu
def test_quantized_head_is_rtn_4bit_and_near_the_bf16_head():
    """--head-bits 4 (packed_layers.quantize_head): the kernels' weights are the round-to-nearest
    4-bit head (codes - zeros) * fp16 scales to bf16 rounding of scale and offset; its logits
    through the GEMV stay within 4-bit error of the bf16 head's (random N(0, 0.02) rows)."""
    from swiftspec_mpi.network.packed_layers import HEAD_GROUP, quantize_head
    from swiftspec_mpi.packed.int4 import quantize_rtn
    gen = torch.Generator(device="cuda").manual_seed(7)
    head = (torch.randn(4096 + 16, 1024, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    w = quantize_head(head, "cuda", rows_per_step=1000)          # chunks that do not divide the rows
    assert isinstance(w, w4a16.W4A16Weight) and w.shape == tuple(head.shape) and w.group == HEAD_GROUP
    codes, zeros, scales = quantize_rtn(head.float(), HEAD_GROUP)
    g = HEAD_GROUP
    rtn = ((codes.float().view(-1, 1024 // g, g) - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1))
    kern = dequantize(w4a16.to_packed(w)).cuda().float()
    assert rel_err(kern, rtn.view(head.shape)) < 1e-2
    weight_err = rel_err(kern, head.float())
    assert 0.01 < weight_err < 0.15, weight_err                # a 4-bit weight's error, not bf16's
    x = torch.randn(8, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    logits = w4a16.gemm(x, w).double()
    ref = x.double() @ head.double().t()
    print(f"4-bit head: weight rel. error {weight_err:.4f}, logits rel. error {rel_err(logits, ref):.4f}")
    assert rel_err(logits, ref) < 0.15
    assert rel_err(logits, x.double() @ kern.double().t()) < TOL


def test_quant_flag_checks(monkeypatch, tmp_path):
    """--quant: unknown values refused up front; int4 on the GPU needs bf16 and weights it can run
    packed there (random ones, or an AWQ/GPTQ folder: checkpoints.load.gpu_packed), not a GGUF file or a
    dense checkpoint; on the CPU int4 runs packed weights of any dtype (cpu_quant)."""
    from swiftspec_mpi.checkpoints import load, tiny
    from swiftspec_mpi.cli import validate as job
    from swiftspec_mpi.core.config import RunConfig, validate_basic
    from swiftspec_mpi.core.errors import UserError
    with pytest.raises(UserError, match="--quant"):
        validate_basic(RunConfig(quant="int8"), 1)
    monkeypatch.setattr(job, "_gpu_visible", lambda: True)
    ok = dict(quant="int4", dtype="bfloat16", load_format="dummy", device="cuda")
    job.check_quant(RunConfig(**ok))
    job.check_quant(RunConfig(quant="none"))
    with pytest.raises(UserError, match="bfloat16"):
        job.check_quant(RunConfig(**{**ok, "dtype": "float32"}))
    job.check_quant(RunConfig(**{**ok, "device": "cpu", "dtype": "float32"}))
    monkeypatch.setattr(job, "_gpu_visible", lambda: False)
    job.check_quant(RunConfig(**{**ok, "device": "auto", "load_format": "auto"}))
    # which checkpoints run packed on the GPU (config.json / GGUF header only)
    awq, _ = tiny.write_tiny_pair(str(tmp_path / "awq"), hidden=128, intermediate=256, quantize="awq",
                                  group=128)
    dense, _ = tiny.write_tiny_pair(str(tmp_path / "dense"))
    assert load.gpu_packed(awq, "auto") and load.gpu_packed(awq, "int4")
    assert not load.gpu_packed(awq, "none") and not load.gpu_packed(dense, "auto")
    assert load.gpu_packed("llama-3-8b", "int4", "dummy") and not load.gpu_packed("llama-3-8b", "auto", "dummy")
    small, _ = tiny.write_tiny_pair(str(tmp_path / "small"), intermediate=192, quantize="gptq")  # hidden 64
    assert not load.gpu_packed(small, "auto")
    with pytest.raises(UserError, match="not multiples of 128.*--quant none"):
        load.gpu_packed(small, "int4")
    with pytest.raises(UserError, match="dense weights"):
        load.gpu_packed(dense, "int4")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(UserError, match="GGUF file.*--device cpu"):
        load.gpu_packed(str(gguf), "int4")
    assert not load.gpu_packed(str(gguf), "auto")
    # --head-bits 4: the GPU's 4-bit models only
    with pytest.raises(UserError, match="--head-bits must be 16 or 4"):
        validate_basic(RunConfig(head_bits=8), 1)
    monkeypatch.setattr(job, "_gpu_visible", lambda: True)
    job.check_head_bits(RunConfig(**ok, head_bits=4))
    job.check_head_bits(RunConfig(**{**ok, "quant": "auto"}, head_bits=4))   # AWQ/GPTQ folders resolve to int4
    for bad in ({"device": "cpu", "dtype": "float32"}, {"quant": "none"}):
        with pytest.raises(UserError, match="--head-bits 4 packs the LM head.*drop --head-bits"):
            job.check_head_bits(RunConfig(**{**ok, **bad}, head_bits=4))


@pytest.mark.gpu
@pytest.mark.mpi
@needs_gpu
@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_real_4bit_checkpoint_runs_packed_on_the_gpu(tmp_path, layout):
    """An AWQ / GPTQ folder (the tiny pair, groups of 128) on the GPU: --quant auto keeps its
    projections packed (W4A16, recorded in the trace's config), target and draft; its logits equal
    the CPU's packed model to bf16 accuracy; greedy sync and async equal ar; the GPU's greedy
    tokens equal the CPU's, or first differ where the CPU's top-2 logits are within bf16 error."""
    import h5py
    import json

    from engine_helpers import read_outputs, run_swiftspec
    from swiftspec_mpi.checkpoints import tiny
    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask
    target, draft = tiny.write_tiny_pair(str(tmp_path / layout), hidden=256, heads=4, kv_heads=2,
                                         intermediate=512, quantize=layout, group=128)
    gpu, tok = load_model(target, max_slots=256, dtype=torch.bfloat16, device="cuda", quant="auto")
    cpu, _ = load_model(target, max_slots=256, device="cpu", quant="auto")
    assert gpu.quant4 and isinstance(gpu.layers[0].wqkv, w4a16.W4A16Weight) and cpu.quant_cpu
    prompt = "def fibonacci(n):"
    ids = tok.encode(prompt)

    def logits(model, seq, device):
        n = len(seq)
        return model(torch.tensor(seq, device=device), torch.arange(n, device=device), 0,
                     chain_mask(0, n).to(device))[-1].float().cpu()

    assert rel_err(logits(gpu, ids, "cuda"), logits(cpu, ids, "cpu")) < 3e-2
    outs = {}
    for name, n, extra in (("ar", 1, ["--mode", "ar"]), ("sync", 1, ["--mode", "sync"]),
                           ("async", 2, ["--mode", "async"]),
                           ("cpu", 1, ["--mode", "ar", "--device", "cpu"])):
        out = tmp_path / f"{name}.h5"
        device = [] if name == "cpu" else ["--device", "cuda", "--dtype", "bfloat16"]
        run_swiftspec(n, ["--target", target, "--draft", draft, *extra, *device, "--prompt", prompt,
                          "--max-new-tokens", "32", "--ignore-eos", "--out", str(out), "--quiet"],
                      timeout=400)
        with h5py.File(out, "r") as f:
            assert json.loads(f.attrs["config_json"])["quant"] == "int4", name
        outs[name] = read_outputs(out)[0]
    assert outs["ar"] == outs["sync"] == outs["async"], outs
    head4 = {}
    for name, n, mode in (("ar-head4", 1, "ar"), ("async-head4", 2, "async")):   # --head-bits 4
        out = tmp_path / f"{name}.h5"
        run_swiftspec(n, ["--target", target, "--draft", draft, "--mode", mode, "--head-bits", "4",
                          "--device", "cuda", "--dtype", "bfloat16", "--prompt", prompt,
                          "--max-new-tokens", "32", "--ignore-eos", "--out", str(out), "--quiet"], timeout=400)
        with h5py.File(out, "r") as f:
            assert json.loads(f.attrs["config_json"])["head_bits"] == 4, name
        head4[name] = read_outputs(out)[0]
    assert head4["ar-head4"] == head4["async-head4"], head4
    same = next((i for i, (a, b) in enumerate(zip(outs["ar"], head4["ar-head4"])) if a != b), None)
    print(f"{layout}: greedy tokens with the 4-bit head first differ from the bf16 head's at", same)
    first = next((i for i, (a, b) in enumerate(zip(outs["ar"], outs["cpu"])) if a != b), None)
    print(f"{layout}: GPU and CPU greedy tokens first differ at", first)
    if first is not None:    # bf16 activations: the CPU's choice there must be a near tie
        top2 = logits(cpu, ids + outs["cpu"][:first], "cpu").topk(2).values
        margin = (top2[0] - top2[1]).item()
        print(f"{layout}: the CPU's top-2 logits there", top2.tolist())
        assert margin < 3e-2 * top2[0].abs().item(), (first, margin, outs)

"""Fused elementwise kernels (swiftspec_mpi.gpu.fused_ops, cuda/fused_ops.cu) against the torch ops they
replace in `Transformer._layers`, and `Transformer.forward_graphable` (fused path, eager and in a
CUDA graph) against `Transformer.forward` on small random models.

GPU tests (`-m gpu`): they need CuPy, nvcc and an sm_90 GPU and skip cleanly elsewhere. Every
check draws fresh random inputs and poisons the outputs with NaN first, then requires them fully
written (and, for the KV cache, every slot not named untouched).
"""
from __future__ import annotations

import os

import pytest

import torch

from swiftspec_mpi.gpu import fused_ops, kernels  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not kernels.available(), reason="needs CuPy, nvcc and an sm_90 GPU")]

BF = torch.bfloat16


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Every element within 2 bf16 ulps of the torch result (the torch ops may round an
    intermediate that a fused kernel keeps in fp32, or contract a multiply-add differently)."""
    assert not torch.isnan(out).any(), f"{what}: NaN left in the output (not fully written)"
    o, r = out.double(), ref.double()
    _, e = torch.frexp(r)                       # |r| in [2^(e-1), 2^e): one bf16 ulp = 2^(e-8)
    bad = (o - r).abs() > torch.ldexp(torch.full_like(r, 2.0), e - 8) + 1e-30
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off by more than 2 "
                           f"bf16 ulps; max abs diff {(o - r).abs().max().item():.3g}")


@pytest.fixture
def gen():
    seed = int.from_bytes(os.urandom(6), "little")
    print(f"seed {seed}")                     # shown with a failure's captured output
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(BF)


# -------------------------------------------------------------------------- add + RMSNorm
@pytest.mark.parametrize("N", [1, 8, 64])
@pytest.mark.parametrize("H", [4096, 896, 2048, 100])          # 100: the scalar (V = 1) variant
@pytest.mark.parametrize("with_add", [True, False])
def test_add_rmsnorm(gen, N, H, with_add):
    eps = 1e-5
    # x as a row slice of a wider buffer (row stride != H), as a residual stream may be
    xbuf = randn(N, H + 8, gen=gen)
    x = xbuf[:, :H]
    a = randn(N, H, gen=gen) if with_add else None
    w = randn(H, gen=gen, scale=0.5)
    w += 1.0
    x_ref, out_ref = fused_ops.add_rmsnorm_reference(x, a, w, eps)
    tail = xbuf[:, H:].clone()
    out = torch.full((N, H), float("nan"), dtype=BF, device="cuda")
    got = fused_ops.add_rmsnorm(x, a, w, eps, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    # the residual add is the same single bf16 rounding as x.add_(a): bit-exact
    assert torch.equal(x, x_ref), "x += a differs from torch's x.add_(a)"
    assert torch.equal(xbuf[:, H:], tail), "wrote outside x's columns"
    assert_bf16_close(out, out_ref, f"add_rmsnorm N={N} H={H}")
    # and against the float64 math
    xd = x_ref.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    assert ((out.double() - exact).norm() / exact.norm()).item() < 4e-3


def test_add_rmsnorm_allocates_and_rejects_bad_shapes(gen):
    x = randn(3, 256, gen=gen)
    w = randn(256, gen=gen)
    out = fused_ops.add_rmsnorm(x, None, w, 1e-6)
    assert out.shape == (3, 256) and out.dtype == BF
    with pytest.raises(ValueError):
        fused_ops.add_rmsnorm(x, randn(3, 128, gen=gen), w, 1e-6)
    with pytest.raises(ValueError):
        fused_ops.add_rmsnorm(x.float(), None, w, 1e-6)


# -------------------------------------------------------------------------- RoPE + KV write
def _rope_case(gen, N, nh, nkv, D, S=512, P=1024, strided_slots=False):
    qkv = randn(N, (nh + 2 * nkv) * D, gen=gen)
    cos = randn(P, D, gen=gen)
    sin = randn(P, D, gen=gen)
    positions = torch.randint(0, P, (N,), generator=gen, device="cuda")
    slots = torch.randperm(S, generator=gen, device="cuda")[:N].contiguous()
    # one layer of a [layers, S, nkv, D] cache, NaN-poisoned
    kbuf = torch.full((2, S, nkv, D), float("nan"), dtype=BF, device="cuda")
    vbuf = torch.full((2, S, nkv, D), float("nan"), dtype=BF, device="cuda")
    return qkv, cos, sin, positions, slots, kbuf, vbuf


@pytest.mark.parametrize("N", [1, 8, 64])
@pytest.mark.parametrize("nh,nkv,D", [(32, 8, 128), (14, 2, 64), (4, 4, 64), (8, 1, 128), (6, 2, 20)])
def test_rope_kv_write(gen, N, nh, nkv, D):
    qkv, cos, sin, positions, slots, kbuf, vbuf = _rope_case(gen, N, nh, nkv, D)
    kc, vc = kbuf[1], vbuf[1]
    qkv0 = qkv.clone()
    qk = qkv0[:, :(nh + nkv) * D].view(N, nh + nkv, D)
    rot = fused_ops.rope_reference(qk, positions, cos, sin)
    fused_ops.rope_kv_write(qkv, positions, slots, cos, sin, kc, vc, nh)
    torch.cuda.synchronize()
    q_got = qkv[:, :nh * D].view(N, nh, D)
    assert_bf16_close(q_got, rot[:, :nh], f"q rope N={N} D={D}")
    assert torch.equal(qkv[:, nh * D:], qkv0[:, nh * D:]), "k/v columns of qkv were modified"
    assert_bf16_close(kc[slots], rot[:, nh:], f"k rope N={N} D={D}")
    assert torch.equal(vc[slots], qkv0[:, (nh + nkv) * D:].view(N, nkv, D)), "v not copied exactly"
    untouched = torch.ones(kc.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.isnan(kc[untouched]).all() and torch.isnan(vc[untouched]).all(), "wrote other slots"
    assert torch.isnan(kbuf[0]).all() and torch.isnan(vbuf[0]).all(), "wrote another layer"


def test_rope_kv_write_matches_model_tables_and_skips_bad_slots(gen):
    """The model's own rope tables (llama3 scaling, bf16) and positions near the end of them;
    a slot outside the cache is not written (no out-of-bounds write)."""
    from swiftspec_mpi.checkpoints.dummy import SHAPES
    from swiftspec_mpi.network.transformer import Transformer
    cfg = SHAPES["llama-3.2-1b"].with_layers(1)
    m = Transformer(cfg, max_slots=256, dtype=BF, device="cuda")
    nh, nkv, D, N = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 8
    qkv = randn(N, (nh + 2 * nkv) * D, gen=gen)
    positions = torch.tensor([0, 1, 5, 100, 255, 300, m.rope_len - 2, m.rope_len - 1], device="cuda")
    slots = torch.tensor([3, 0, 255, 17, -1, 256, 9, 10], device="cuda")
    kc, vc = m.k_cache[0], m.v_cache[0]
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    qkv0 = qkv.clone()
    rot = fused_ops.rope_reference(qkv0[:, :(nh + nkv) * D].view(N, nh + nkv, D), positions,
                                   m.rope_cos, m.rope_sin)
    fused_ops.rope_kv_write(qkv, positions, slots, m.rope_cos, m.rope_sin, kc, vc, nh)
    torch.cuda.synchronize()
    assert_bf16_close(qkv[:, :nh * D].view(N, nh, D), rot[:, :nh], "q rope (model tables)")
    ok = (slots >= 0) & (slots < 256)
    assert_bf16_close(kc[slots[ok]], rot[ok, nh:], "k rope (model tables)")
    assert torch.equal(vc[slots[ok]], qkv0[ok, (nh + nkv) * D:].view(-1, nkv, D))
    written = torch.zeros(256, dtype=torch.bool, device="cuda")
    written[slots[ok]] = True
    assert torch.isnan(kc[~written]).all() and torch.isnan(vc[~written]).all()


# -------------------------------------------------------------------------- SiLU * up
@pytest.mark.parametrize("N", [1, 8, 64])
@pytest.mark.parametrize("I", [14336, 8192, 4864, 4779, 7])      # 4779 = ceil(14336 / 3): a TP shard
def test_silu_mul(gen, N, I):
    gubuf = randn(N, 2 * I + 16, gen=gen, scale=2.0)
    gu = gubuf[:, :2 * I]
    ref = fused_ops.silu_mul_reference(gu)
    out = torch.full((N, I), float("nan"), dtype=BF, device="cuda")
    got = fused_ops.silu_mul(gu, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert_bf16_close(out, ref, f"silu_mul N={N} I={I}")


# -------------------------------------------------------------------------- CUDA graph
@pytest.mark.parametrize("pdl", [False, True])
def test_fused_ops_replay_in_cuda_graph(gen, pdl):
    """All three kernels captured once and replayed with new inputs written into the static
    buffers (positions and slots read on the device): each replay matches the torch ops. With
    `pdl` every launch is a programmatic dependent launch (griddepcontrol in the kernels), and
    silu_mul then reads what a PDL-launched GEMM wrote just before it."""
    N, nh, nkv, D, H, I = 8, 8, 2, 128, 1024, 2816
    qkv, cos, sin, positions, slots, kbuf, vbuf = _rope_case(gen, N, nh, nkv, D)
    kc, vc = kbuf[0], vbuf[0]
    x, a, w = randn(N, H, gen=gen), randn(N, H, gen=gen), randn(N, H, gen=gen)[0].contiguous()
    gu = randn(N, 2 * I, gen=gen)
    h = torch.empty(N, H, dtype=BF, device="cuda")
    m = torch.empty(N, I, dtype=BF, device="cuda")

    wg = randn(2 * I, H, gen=gen)          # gu2 = h @ wg^T, then silu_mul of it: a PDL chain
    gu2 = torch.empty(N, 2 * I, dtype=BF, device="cuda")
    m2 = torch.empty(N, I, dtype=BF, device="cuda")
    m3 = torch.empty(N, I, dtype=BF, device="cuda")

    def step():
        fused_ops.add_rmsnorm(x, a, w, 1e-5, out=h, pdl=pdl)
        fused_ops.rope_kv_write(qkv, positions, slots, cos, sin, kc, vc, nh, pdl=pdl)
        fused_ops.silu_mul(gu, out=m, pdl=pdl)
        kernels.gemm_rowparallel(h, wg, out=gu2, pdl=pdl)
        fused_ops.silu_mul(gu2, out=m2, pdl=pdl)
        kernels.gemm_swiglu(h, wg, out=m3, pdl=pdl)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                  # compile + load outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        for t in (x, a, qkv, gu):
            t.copy_(randn(*t.shape, gen=gen))
        positions.copy_(torch.randint(0, cos.shape[0], (N,), generator=gen, device="cuda"))
        slots.copy_(torch.randperm(kc.shape[0], generator=gen, device="cuda")[:N])
        h.fill_(float("nan"))
        m.fill_(float("nan"))
        x0, qkv0 = x.clone(), qkv.clone()
        x_ref, h_ref = fused_ops.add_rmsnorm_reference(x0, a, w, 1e-5)
        rot = fused_ops.rope_reference(qkv0[:, :(nh + nkv) * D].view(N, nh + nkv, D), positions, cos, sin)
        m_ref = fused_ops.silu_mul_reference(gu)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, x_ref)
        assert_bf16_close(h, h_ref, "graph: add_rmsnorm")
        assert_bf16_close(qkv[:, :nh * D].view(N, nh, D), rot[:, :nh], "graph: q rope")
        assert_bf16_close(kc[slots], rot[:, nh:], "graph: k rope")
        assert torch.equal(vc[slots], qkv0[:, (nh + nkv) * D:].view(N, nkv, D))
        assert_bf16_close(m, m_ref, "graph: silu_mul")
        gu2_ref = kernels.gemm_rowparallel(h, wg)              # same kernel, plain launch, after
        assert torch.equal(gu2, gu2_ref), "graph: GEMM after add_rmsnorm"
        assert torch.equal(m2, fused_ops.silu_mul(gu2_ref)), "graph: silu_mul after the GEMM"
        assert torch.equal(m3, m2), "graph: gemm_swiglu vs GEMM + silu_mul"


# the fused GEMVs' kinds: default, register-pipelined, every shared-memory-streamed variant
GEMV_CONFIGS = [None, "regs"]


@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=str)
@pytest.mark.parametrize("M", [1, 5, 8, 16])
@pytest.mark.parametrize("I,K", [(2816, 1024), (2824, 520), (256, 5128)])
def test_gemm_swiglu_equals_gemm_then_silu_mul(gen, M, I, K, config):
    """kernels.gemm_swiglu (gate|up GEMM with the SwiGLU in its epilogue) gives the bits of
    silu_mul(gemm_rowparallel(x, w)), for M up to 16, I not a multiple of 16, K not of 64 and a
    long K with a partial last chunk; its output is written in full (NaN-poisoned before); bad
    shapes and configs are refused."""
    x = randn(M, K, gen=gen)
    w = randn(2 * I, K, gen=gen)
    out = torch.full((M, I), float("nan"), dtype=BF, device="cuda")
    kernels.gemm_swiglu(x, w, out=out, config=config)
    ref = fused_ops.silu_mul(kernels.gemm_rowparallel(x, w))
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    exact = torch.nn.functional.silu(x.double() @ w[:I].double().t()) * (x.double() @ w[I:].double().t())
    rel = ((out.double() - exact).norm() / exact.norm()).item()
    assert rel < 2e-2, rel
    with pytest.raises(ValueError):
        kernels.gemm_swiglu(x, randn(2 * I - 8, K, gen=gen))          # I not a multiple of 8
    with pytest.raises(ValueError):
        kernels.gemm_swiglu(randn(17, K, gen=gen), w)                 # too many rows
    with pytest.raises(ValueError):
        kernels.gemm_swiglu(x, w, config=("smem", 8, 2))              # no such kernel (removed)


@pytest.mark.parametrize("config", GEMV_CONFIGS + ["regs-w4"], ids=str)
@pytest.mark.parametrize("M", [1, 8, 13])
@pytest.mark.parametrize("nh,nkv,D,K", [(32, 8, 128, 1024), (8, 2, 64, 520), (4, 4, 64, 256), (4, 2, 128, 3080)])
def test_gemm_qkv_rope_equals_gemm_then_rope_kv_write(gen, M, nh, nkv, D, K, config):
    """kernels.gemm_qkv_rope gives the bits of gemm_rowparallel + rope_kv_write: the rotated q in
    qkv, the rotated k and the v in the cache slots; slots outside the cache are skipped,
    positions clamped to the tables, no other slot or layer written (NaN-poisoned caches)."""
    cols = (nh + 2 * nkv) * D
    x, w = randn(M, K, gen=gen), randn(cols, K, gen=gen, scale=0.05)
    _, cos, sin, _, _, kbuf, vbuf = _rope_case(gen, M, nh, nkv, D, S=64, P=128)
    positions = torch.randint(-3, 140, (M,), generator=gen, device="cuda")      # some out of range
    slots = torch.randperm(64, generator=gen, device="cuda")[:M].contiguous()
    slots[0] = 64 if M > 1 else slots[0]                                         # outside the cache
    if M > 2:
        slots[2] = -1
    kref, vref = kbuf.clone(), vbuf.clone()
    qkv_ref = kernels.gemm_rowparallel(x, w)
    fused_ops.rope_kv_write(qkv_ref, positions, slots, cos, sin, kref[1], vref[1], nh)
    qkv = torch.full((M, cols), float("nan"), dtype=BF, device="cuda")
    kernels.gemm_qkv_rope(x, w, qkv, positions, slots, cos, sin, kbuf[1], vbuf[1], nh, config=config)
    torch.cuda.synchronize()
    assert torch.equal(qkv[:, :nh * D], qkv_ref[:, :nh * D]), "rotated q"
    assert torch.isnan(qkv[:, nh * D:]).all(), "k/v columns of qkv are not written"
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))       # noqa: E731
    assert same(kbuf, kref), "k cache (rotated k in the valid slots, NaN elsewhere)"
    assert same(vbuf, vref), "v cache"
    with pytest.raises(ValueError):
        kernels.gemm_qkv_rope(x, w[:-8], qkv, positions, slots, cos, sin, kbuf[1], vbuf[1], nh)


# -------------------------------------------------------------------------- whole model
class _ShardComm:
    """Rank `rank` of a TP group of `size` whose collectives are local stand-ins (identity
    all-reduce, the local chunk repeated for the gather): both forward paths call the same
    collectives, so this checks the fused path on a shard's shapes against the torch path."""

    def __init__(self, rank, size):
        self.rank, self.size, self.seconds = rank, size, 0.0

    def all_reduce_(self, t):
        return t

    def all_gather_lastdim(self, t):
        return torch.cat([t] * self.size, dim=-1)


def _tree(prefix, parents):
    n = len(parents)
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    depth = [0] * n
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, prefix + j] = True
            j = parents[j]
        if parents[i] >= 0:
            depth[i] = depth[parents[i]] + 1
    return mask, prefix + torch.tensor(depth)


def test_gemm_modes():
    """Two projection modes, "pdl" (the default) and "cublas"; anything else is refused."""
    from swiftspec_mpi.core import switches
    was = fused_ops.gemm_mode()
    assert was == switches.choice("SWIFTSPEC_FUSED_GEMM") and fused_ops.GEMM_MODES == ("pdl", "cublas")
    try:
        for mode in fused_ops.GEMM_MODES:
            fused_ops.set_gemm_mode(mode)
            assert fused_ops.gemm_mode() == mode
    finally:
        fused_ops.set_gemm_mode(was)
    for bad in ("auto", "fast"):
        with pytest.raises(ValueError):
            fused_ops.set_gemm_mode(bad)


@pytest.mark.parametrize("shape,comm,rowpar", [
    ("llama-3.2-1b", None, "cublas"), ("qwen2.5-0.5b", None, "cublas"), ("llama-3-8b", None, "cublas"),
    ("qwen2.5-0.5b", (1, 2), "cublas"), ("llama-3.2-1b", (3, 4), "cublas"),
    ("llama-3.2-1b", None, "pdl"), ("llama-3-8b", None, "pdl"), ("qwen2.5-0.5b", None, "pdl"),
    ("llama-3.2-1b", (3, 4), "pdl")])
def test_forward_graphable_fused_matches_forward(shape, comm, rowpar, monkeypatch):
    """forward (torch SDPA, torch elementwise ops) vs forward_graphable with the fused kernels,
    eager and through a CUDA graph (GraphedModel), and vs forward_graphable with them switched
    off, on 2-layer random models (head_dim 64 and 128, GQA, Qwen2 QKV bias, tied and untied
    heads, TP shards): logits and the KV written agree to bf16 accuracy. rowpar "cublas": the
    every projection on cuBLAS; "pdl" (the default): kernels.gemm_rowparallel for every projection
    it takes, every kernel launched with PDL."""
    monkeypatch.setattr(fused_ops, "_gemm_mode", rowpar)
    from swiftspec_mpi.checkpoints.dummy import SHAPES, RandomSource
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.gpu.graphs import GraphedModel
    from swiftspec_mpi.network.transformer import Transformer, chain_mask
    cfg = SHAPES[shape].with_layers(2)
    c = SingleComm() if comm is None else _ShardComm(*comm)
    S = 1536
    models = []
    for _ in range(3):
        m = Transformer(cfg, c, max_slots=S, dtype=BF, device="cuda")
        m.load_weights(RandomSource(cfg, "cuda", BF, seed=7))
        models.append(m)
    ref, fast, plain = models
    g = torch.Generator().manual_seed(1)
    prefix = 700
    pre = torch.randint(0, 5000, (prefix,), generator=g)
    for m in models:
        m.forward(pre, torch.arange(prefix), 0, chain_mask(0, prefix))
    graphed = GraphedModel(fast)
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]
    mask, pos = _tree(prefix, parents)
    n = len(parents)
    toks = torch.randint(0, 5000, (n,), generator=g)
    a = ref.forward(toks, pos, prefix, mask).float()
    assert fused_ops.enabled()
    b = graphed.forward(toks, pos, prefix, mask).float().clone()
    # eager fused forward_graphable on the same inputs (rewrites the same slots with the same KV)
    dev = "cuda"
    full = torch.zeros(n, S, dtype=torch.bool, device=dev)
    full[:, :prefix + n] = mask.to(dev)
    nv = torch.tensor([prefix + n], dtype=torch.int32, device=dev)
    slots = torch.arange(prefix, prefix + n, device=dev)
    e = fast.forward_graphable(toks.to(dev), pos.to(dev), slots, full, nv).float()
    fused_ops.set_enabled(False)
    try:
        p = plain.forward_graphable(toks.to(dev), pos.to(dev), slots, full, nv).float()
    finally:
        fused_ops.set_enabled(True)
    scale = a.abs().max().item()
    for name, got in (("graphed fused", b), ("eager fused", e), ("unfused graphable", p)):
        assert not torch.isnan(got).any(), name
        err = (got - a).abs().max().item() / scale
        assert err < 3e-2, f"{shape} {comm}: {name} vs forward: relative max error {err}"
    assert (b - e).abs().max().item() / scale < 1e-2, "graph replay differs from the eager fused call"
    # the KV of the new tokens written by the fused path equals the torch path's to bf16 accuracy
    for layer in range(cfg.num_layers):
        for buf in ("k_cache", "v_cache"):
            r = getattr(ref, buf)[layer, prefix:prefix + n].double()
            f = getattr(fast, buf)[layer, prefix:prefix + n].double()
            rel = ((f - r).norm() / r.norm()).item()
            assert rel < 2e-2, f"{buf}[{layer}] of the new tokens: rel err {rel}"
    if rowpar in ("all", "pdl"):
        choice = fast._fused_ws[n][("gemm", "auto" if rowpar == "all" else "pdl")]
        assert choice["o"] and choice["gu"] and choice["down"], choice
        if rowpar == "pdl" and not shape.startswith("qwen"):
            assert choice["qkv"] and choice["head"], choice
    # argmax agrees where the top-2 margin is clear
    top2 = a.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
    assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


class _AsFloat32:
    """A TensorSource giving another source's tensors as float32 (the same bf16 values)."""

    def __init__(self, src):
        self.src, self.config = src, src.config

    def names(self):
        return self.src.names()

    def get(self, name, dim=None, start=0, stop=None):
        return self.src.get(name, dim, start, stop).float()

    def close(self):
        pass


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "llama-3-8b"])
def test_pdl_mode_is_as_accurate_as_cublas(shape, monkeypatch):
    """The "pdl" GEMM mode (every projection on kernels.gemm_rowparallel, PDL launches) sums in
    another order than cuBLAS, so its logits differ from the default path's; both must be
    equally close to a float32 model with the same (bf16-valued) weights: 4-layer random model,
    700-token prefix, an 8-node tree, error of each bf16 path vs float32 within 1.25x of the
    other's (plus 1e-3 of the logit scale)."""
    from swiftspec_mpi.checkpoints.dummy import SHAPES, RandomSource
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.network.transformer import Transformer, chain_mask
    cfg = SHAPES[shape].with_layers(4)
    S, prefix, dev = 1024, 700, "cuda"
    src = RandomSource(cfg, dev, BF, seed=11)
    models = {}
    for name, dtype, source in (("ref", torch.float32, _AsFloat32(src)), ("cublas", BF, src), ("pdl", BF, src)):
        m = Transformer(cfg, SingleComm(), max_slots=S, dtype=dtype, device=dev)
        m.load_weights(source)
        models[name] = m
    g = torch.Generator().manual_seed(3)
    pre = torch.randint(0, 5000, (prefix,), generator=g)
    for m in models.values():
        m.forward(pre, torch.arange(prefix), 0, chain_mask(0, prefix))
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]
    mask, pos = _tree(prefix, parents)
    n = len(parents)
    toks = torch.randint(0, 5000, (n,), generator=g)
    ref = models["ref"].forward(toks, pos, prefix, mask).double()
    full = torch.zeros(n, S, dtype=torch.bool, device=dev)
    full[:, :prefix + n] = mask.to(dev)
    nv = torch.tensor([prefix + n], dtype=torch.int32, device=dev)
    slots = torch.arange(prefix, prefix + n, device=dev)
    got = {}
    for mode in ("cublas", "pdl"):
        monkeypatch.setattr(fused_ops, "_gemm_mode", mode)
        got[mode] = models[mode].forward_graphable(toks.to(dev), pos.to(dev), slots, full, nv).double()
    assert models["pdl"]._fused_ws[n][("gemm", "pdl")]["down"]
    scale = ref.abs().max().item()
    err = {k: (v - ref).abs().max().item() / scale for k, v in got.items()}
    assert err["pdl"] <= 1.25 * err["cublas"] + 1e-3, err
    assert err["cublas"] <= 1.25 * err["pdl"] + 1e-3, err


class _SelfMpi:
    """A one-rank MPI communicator (what NcclGroupComm needs of it), without MPI."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]


def test_model_with_fused_allreduce_equals_plain(monkeypatch):
    """The model's fused GEMM + all-reduce wiring on one GPU: a 1-rank NcclGroupComm with the
    device all-reduce enabled (o_proj and down_proj each one kernels.gemm_allreduce launch) gives
    the bits of the same model on SingleComm (GEMV, no all-reduce), eagerly and replayed from a
    CUDA graph, for 1 and 8 tokens. (The all-reduce of one partial is the identity; the sums
    over ranks are tested by tests/test_kernels_gpu.py::test_gemm_allreduce_multi_gpu.)"""
    from swiftspec_mpi.checkpoints.dummy import SHAPES, RandomSource
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.gpu import nccl_shim
    from swiftspec_mpi.gpu.graphs import GraphedModel
    from swiftspec_mpi.gpu.nccl_comm import NcclGroupComm
    from swiftspec_mpi.network.transformer import Transformer, chain_mask
    if nccl_shim.nccl_include_dir() is None:
        pytest.skip("no NCCL >= 2.28 headers")
    monkeypatch.setattr(fused_ops, "_gemm_mode", "pdl")
    cfg = SHAPES["llama-3.2-1b"].with_layers(2)
    group = NcclGroupComm(_SelfMpi())
    if not group.enable_fused_allreduce(cfg.hidden_size):
        pytest.skip(f"this NCCL gives no device communicator on 1 rank: {group.fused_allreduce_error}")
    calls = []
    real = kernels.gemm_allreduce
    monkeypatch.setattr(kernels, "gemm_allreduce", lambda *a, **k: calls.append(1) or real(*a, **k))
    prefix = 300
    models = {}
    for name, comm in (("plain", SingleComm()), ("fused", group)):
        m = Transformer(cfg, comm, max_slots=512, dtype=BF, device="cuda")
        m.load_weights(RandomSource(cfg, "cuda", BF, seed=13))
        g = torch.Generator().manual_seed(2)
        m.forward(torch.randint(0, 5000, (prefix,), generator=g), torch.arange(prefix), 0, chain_mask(0, prefix))
        models[name] = m
    try:
        for n in (1, 8):
            toks = torch.randint(0, 5000, (n,), generator=torch.Generator().manual_seed(n))
            pos = torch.arange(prefix, prefix + n)
            mask = chain_mask(prefix, n)
            dev = "cuda"
            full = torch.zeros(n, 512, dtype=torch.bool, device=dev)
            full[:, :prefix + n] = mask.to(dev)
            nv = torch.tensor([prefix + n], dtype=torch.int32, device=dev)
            slots = torch.arange(prefix, prefix + n, device=dev)
            out = {}
            for name, m in models.items():
                before = len(calls)
                eager = m.forward_graphable(toks.to(dev), pos.to(dev), slots, full, nv).float()
                if name == "fused":
                    assert len(calls) - before == 2 * cfg.num_layers, "o_proj and down_proj fused per layer"
                graphed = GraphedModel(m)
                out[name] = [eager] + [graphed.forward(toks, pos, prefix, mask).float().clone() for _ in range(3)]
            ref = out["plain"][0]
            assert torch.isfinite(ref).all()
            for name, results in out.items():
                for i, r in enumerate(results):
                    assert torch.equal(r, ref), f"n={n} {name}: {'eager' if i == 0 else f'replay {i}'}"
    finally:
        group.fused_allreduce.close()


# -------------------------------------------------------------------------- logits top-k


@pytest.mark.parametrize("V", [128256, 151936, 32000, 1003, 300001])
@pytest.mark.parametrize("N", [1, 8, 33])
def test_logits_topk_matches_torch(gen, N, V):
    """fused_ops.logits_topk (one pass over fp32 logits) = torch.topk(log_softmax(x), k) and, with
    logprobs=False, torch.topk(x, k) / torch.argmax: the indices of torch.topk of the logits
    (random logits, no ties), log-probs within 2e-5 of torch's log_softmax, raw values exact;
    contiguous rows and rows with an odd stride (the scalar path); 1 to 19 parts of 8192+ columns
    per row (300001: 19 parts of 16384)."""
    wide = torch.randn(N, V + 3, generator=gen, device="cuda") * 4
    for x in (wide[:, :V].contiguous(), wide[:, 3:]):
        ref_lp = torch.log_softmax(x, dim=-1)
        for k in (1, 5, 8, 16, 32):
            ids, vals = fused_ops.logits_topk(x, k)
            top = torch.topk(x, k, dim=-1)          # the order of the logits themselves (no rounding ties)
            assert torch.equal(ids, top.indices), (k, x.stride())
            err = (vals - torch.gather(ref_lp, 1, ids)).abs().max().item()
            assert err < 2e-5, (k, err)
            assert torch.allclose(vals, torch.topk(ref_lp, k, dim=-1).values, atol=2e-5)
            ids2, raw = fused_ops.logits_topk(x, k, logprobs=False)
            assert torch.equal(ids2, ids) and torch.equal(raw, torch.gather(x, 1, ids))
        assert torch.equal(fused_ops.logits_topk(x, 1, logprobs=False)[0].view(-1), torch.argmax(x, dim=-1))


@pytest.mark.parametrize("V", [1, 3, 7, 33])
def test_logits_topk_few_columns(gen, V):
    """A row shorter than one block's pass (most threads see no column, k can be the whole row):
    every k up to min(V, TOPK_MAX) gives torch.topk's indices and log-probs."""
    x = torch.randn(5, V, generator=gen, device="cuda")
    ref_lp = torch.log_softmax(x, dim=-1)
    for k in sorted({1, min(V, 2), min(V, 8), min(V, fused_ops.TOPK_MAX)}):
        ids, vals = fused_ops.logits_topk(x, k)
        assert torch.equal(ids, torch.topk(x, k, dim=-1).indices), (V, k)
        assert (vals - torch.gather(ref_lp, 1, ids)).abs().max().item() < 2e-5, (V, k)


def test_logits_topk_ties_infinities_graph_and_bad_input(gen):
    """Ties go to the lower index (torch.argmax's first maximum); -inf logits count for the top-k
    but not the log-sum-exp; a captured launch reads new logits on replay; bad input is refused."""
    V = 5000
    x = torch.zeros(3, V, device="cuda")
    x[1, 4000] = x[1, 17] = x[1, 2500] = 2.0
    x[2, :] = float("-inf")
    x[2, 42] = 1.0
    x[2, 4999] = 0.5
    ids, vals = fused_ops.logits_topk(x, 8)
    assert ids[0].tolist() == list(range(8))
    assert ids[1, :3].tolist() == [17, 2500, 4000] and ids[1, 3:].tolist() == list(range(5))
    assert ids[2, :2].tolist() == [42, 4999] and ids[2, 2:].tolist() == list(range(6))
    ref = torch.log_softmax(x, dim=-1)
    assert torch.allclose(vals[:, :2], torch.gather(ref, 1, ids[:, :2]), atol=2e-5)
    assert torch.isneginf(vals[2, 2:]).all()
    assert torch.equal(fused_ops.logits_topk(x, 1, logprobs=False)[0].view(-1), torch.argmax(x, dim=-1))
    # a CUDA graph
    buf = torch.randn(8, 128256, generator=gen, device="cuda")
    fused_ops.logits_topk(buf, 8)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gids, gvals = fused_ops.logits_topk(buf, 8)
    buf.copy_(torch.randn(8, 128256, generator=gen, device="cuda"))
    gids.fill_(-1)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(gids, torch.topk(buf, 8, dim=-1).indices)
    for bad in ((x, 0), (x, fused_ops.TOPK_MAX + 1), (x.to(BF), 4), (x.cpu(), 4), (x[:, :4], 5)):
        assert not fused_ops.topk_ok(*bad)
        with pytest.raises(ValueError):
            fused_ops.logits_topk(*bad)

"""Fused CUDA kernels (swiftspec_mpi.gpu.kernels, cuda/*.cu) against float64 references.

GPU tests (`-m gpu`) need CuPy, nvcc and an sm_90 GPU and skip cleanly otherwise. Every check
draws fresh random inputs, poisons the output with NaN first and requires it fully written.
The CPU tests compile every cuda/*.cu with tools/compile_cuda.sh (skipped without nvcc; CI, which
installs it, fails instead: SWIFTSPEC_TEST_STRICT=1) and read
NCCL's struct layouts with the shim's nvcc probe.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from allreduce_checks import assert_fused_equals_plain, single_rank_allreduce
from conftest import skip_or_fail
from swiftspec_mpi.gpu import kernels, launch, nccl_shim, tree_attention

ROOT = Path(__file__).resolve().parent.parent
needs_gpu = pytest.mark.skipif(not kernels.available(), reason="needs CuPy, nvcc and an sm_90 GPU")
BF16_TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------- CPU
_compiled_include: list[str] = []


@pytest.fixture(scope="module")
def compiled_include() -> str:
    """Runs tools/compile_cuda.sh once; returns the NCCL include dir it used."""
    if shutil.which("nvcc") is None:
        skip_or_fail("nvcc (the CUDA compiler) is not on PATH")
    if not _compiled_include:
        r = subprocess.run(["bash", str(ROOT / "tools" / "compile_cuda.sh")], capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, f"compile_cuda.sh failed:\n{r.stdout}\n{r.stderr}"
        m = re.search(r"^NCCL include: (.+)$", r.stdout, re.M)
        assert m, r.stdout
        assert "FAIL" not in r.stdout
        assert r.stdout.count("ok   ") >= 3, r.stdout      # tree_attention, gemm_allreduce (+nccl)
        _compiled_include.append(m.group(1))
    return _compiled_include[0]


def test_cuda_sources_compile(compiled_include):
    assert (Path(compiled_include) / "nccl_device.h").is_file()


def test_loader_pastes_the_local_headers():
    """The source RawModule compiles has each `#include "x.cuh"` replaced by cuda/x.cuh (CuPy's
    cache key is the source text, so it covers the headers too)."""
    for name in ("gemm_allreduce", "tree_attention", "w4a16"):
        code = launch.cuda_source(name)
        assert not re.search(r'^#include "', code, re.M) and code.count("void mma_bf16(") == 1, name


def test_nccl_layout_probe(compiled_include):
    layout = nccl_shim.probe_layout(compiled_include)
    assert layout["version"] == nccl_shim.header_version(compiled_include) >= 22800
    assert 0 < layout["lsa_barrier_count_offset"] < layout["req_size"]
    assert len(bytes.fromhex(layout["req_bytes"])) == layout["req_size"]
    assert layout["devcomm_size"] >= 64


def test_tree_attention_default_configs_are_listed():
    """Every default config is one the GPU tests run explicitly (tree_attention_configs), and the
    defaults of the benchmarked shapes are the ones docs/benchmarks.md gives (2026-12-01, version 4 at N <= 8 for 1k-4k)."""
    listed = set(kernels.tree_attention_configs())
    for rows in (1, 4, 12, 16, 17, 24, 32, 33, 48, 64, 128, 129, 192, 256):
        for max_len in (40, 1024, 1536, 1537, 2048, 2049, 2304, 2305, 4096, 8192, 8193, 16384, 65536):
            for head_dim in (64, 128):
                cfg = kernels.tree_attention_config(rows, max_len, head_dim)
                assert cfg in listed, (rows, max_len, head_dim, cfg)
            assert kernels.tree_attention_cluster_config(rows, max_len) in listed
    # (rows, max_len, head_dim): the defaults measured inside the step (eighth GPU session) up to 1.5k
    # slots (2.25k at head_dim 64), the earlier sweeps' beyond
    expect = {(32, 1024, 128): (2, 4, 2, 8, 32, 1), (32, 4096, 128): (4, 4, 2, 8, 32, 1),
              (32, 16384, 128): (8, 2, 2, 4, 1), (4, 4096, 128): (4, 4, 1, 4, 32, 1),
              (256, 4096, 128): (8, 2, 4, 4, 1), (256, 16384, 128): (8, 2, 4, 4, 1),
              (4, 1024, 128): (2, 4, 1, 4, 32, 1), (8, 1152, 128): (2, 4, 1, 4, 32, 1),
              (4, 2048, 128): (4, 4, 1, 4, 32, 1), (4, 512, 128): (2, 4, 1, 4, 32, 1),
              (32, 768, 128): (2, 4, 2, 8, 32, 1), (32, 2048, 128): (4, 4, 2, 8, 32, 1),
              (16, 8192, 128): (4, 4, 1, 4, 32, 1), (32, 1152, 64): (2, 4, 1, 4, 32, 1),
              (32, 2176, 64): (2, 4, 2, 8, 32, 1), (4, 2176, 64): (2, 4, 1, 4, 32, 1),
              (4, 4096, 64): (4, 4, 1, 4, 32, 1), (64, 1024, 128): (8, 4, 4)}
    for (rows, max_len, head_dim), cfg in expect.items():
        assert kernels.tree_attention_config(rows, max_len, head_dim) == cfg, (rows, max_len, head_dim)


# ------------------------------------------------------------------------------- helpers
def tree_parents(n: int, gen: torch.Generator) -> list[int]:
    """Random tree on n nodes in topological order: parent[0] = -1, parent[i] < i."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def make_mask(kind: str, N: int, L: int, Lpad: int, gen: torch.Generator) -> torch.Tensor:
    """[N, Lpad] bool with the real pattern in [:, :L] and junk (True) beyond it.

    tree:   committed prefix [0, L-N) visible, the N tree tokens in the last N slots, each seeing
            its ancestors and itself (the verify call).
    draft:  prefix [0, P) visible, then older tree nodes [P, L-N) of which each new leaf sees a
            random ancestor chain, then the N new leaves (each sees itself only).
    chain:  plain causal over the last N slots.
    random: Bernoulli(0.5) with the diagonal of the last N slots set.
    holes:  like random, but token 0 sees nothing (its output must be zeros) and token N-1
            everything.
    """
    m = torch.ones(N, Lpad, dtype=torch.bool)
    m[:, :L] = False
    base = L - N
    if kind in ("tree", "chain"):
        m[:, :base] = True
        par = tree_parents(N, gen) if kind == "tree" else [-1] + list(range(N - 1))
        for i in range(N):
            j = i
            while j >= 0:
                m[i, base + j] = True
                j = par[j]
    elif kind == "draft":
        P = max(0, base - 3 * N)
        m[:, :P] = True
        older = base - P
        for i in range(N):
            if older:
                sel = torch.rand(older, generator=gen) < 0.3
                m[i, P:base] = sel
            m[i, base + i] = True
    elif kind in ("random", "holes"):
        m[:, :L] = torch.rand(N, L, generator=gen) < 0.5
        for i in range(N):
            m[i, base + i] = True
        if kind == "holes":
            m[0, :L] = False
            m[N - 1, :L] = True
    else:
        raise ValueError(kind)
    return m


ATTN_CASES = [
    # (L, N, H, Hkv, D, mask kind)
    (1024, 8, 32, 8, 128, "tree"),     # Llama-3-8B heads, the goal shapes
    (4096, 8, 32, 8, 128, "tree"),
    (16384, 8, 32, 8, 128, "tree"),
    (1000, 1, 32, 8, 128, "chain"),    # plain decode, L not a multiple of 64
    (3001, 64, 32, 8, 128, "tree"),    # biggest tree: 256 rows per KV head, 4 row groups
    (2311, 16, 32, 8, 64, "draft"),    # Llama-3.2-1B heads (D = 64)
    (1500, 12, 12, 2, 128, "draft"),   # Qwen2-1.5B heads (G = 6: rows straddle m16 tiles)
    (777, 5, 28, 4, 128, "random"),    # Qwen2.5-7B heads (G = 7)
    (40, 8, 32, 8, 128, "tree"),       # shorter than one tile per cluster block: empty splits
    (900, 64, 16, 16, 64, "holes"),    # G = 1: 64 tokens per row group, a row that sees nothing
    (1200, 3, 32, 8, 128, "holes"),    # 12 rows, one of them invisible everywhere
]


def attn_inputs(L, N, H, Hkv, D, kind, seed, q_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    S = L + 37                                    # slots past L hold NaN: must be ignored
    k = torch.randn(S, Hkv, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(S, Hkv, D, generator=gen).to(torch.bfloat16)
    k[L:] = float("nan")
    v[L:] = float("nan")
    # q as a slice of a fused [N, (H + 2 Hkv) * D] projection (token stride > H * D)
    qkv = torch.randn(N, H + 2 * Hkv, D, generator=gen).mul_(q_scale).to(torch.bfloat16)
    mask = make_mask(kind, N, L, L + 24, gen)
    return (qkv.to(dev)[:, :H], k.to(dev), v.to(dev), mask.to(dev))


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "L%d-N%d-H%d-KV%d-D%d-%s" % c)
def test_tree_attention_matches_float64(case):
    L, N, H, Hkv, D, kind = case
    # the default config, then every listed config of the three kernel versions
    # (tree_attention_configs), soft and peaked softmax
    configs = [None] + kernels.tree_attention_configs()
    for i, config in enumerate(configs):
        q_scale = 4.0 if i % 2 else 1.0
        q, k, v, mask = attn_inputs(L, N, H, Hkv, D, kind, i * 1000 + L, q_scale)
        out = torch.full((N, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.tree_attention(q, k, v, mask, L, out=out, config=config)
        torch.cuda.synchronize()
        ref = kernels.tree_attention_reference(q, k, v, mask, L)
        assert torch.isfinite(out).all(), f"config {config}: output not fully written (NaN left)"
        err = rel_err(out, ref)
        assert err <= BF16_TOL, f"{case} config {config}: rel err {err:.3e}"
        if kind == "holes":                                   # token 0 sees no slot: zeros
            assert not out[0].any(), f"config {config}: invisible token's output not zero"


# version 3 (5 values): last-block combine (ticket counter reset by the kernel) and the PDL
# combine kernel, 1 to 4 tiles per split; version 4 (6 values): 1 to 4 tiles per split, 4 to 16
# warps, 32- and 64-slot pieces, with and without the combine's early trigger
GRAPH_CONFIGS = [None, kernels.AttnConfigV1(16, 2, 1), kernels.AttnConfigV2(16, 2, 2, 4),
                 kernels.AttnConfigV2(8, 4, 2, 4), kernels.AttnConfigV2(16, 2, 1, 4),
                 kernels.AttnConfigV3(2, 2, 2, 4, 0), kernels.AttnConfigV3(1, 2, 2, 4, 1),
                 kernels.AttnConfigV3(4, 2, 2, 4, 1), kernels.AttnConfigV4(4, 4, 2, 8, 32, 1),
                 kernels.AttnConfigV4(2, 4, 2, 8, 32, 0), kernels.AttnConfigV4(1, 4, 1, 4, 32, 1),
                 kernels.AttnConfigV4(3, 4, 1, 4, 32, 1)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", GRAPH_CONFIGS, ids=lambda c: "default" if c is None else "/".join(map(str, c)))
def test_tree_attention_cuda_graph_new_length(config):
    """n_valid read on the device: one captured graph serves growing contexts (version 2: ring
    refills at L = 2999, empty splits at L = 65). Version 4 is captured with pdl=True (the main
    kernel and its combine both launched with PDL, the early trigger where the config asks)."""
    N, H, Hkv, D, Lmax = 8, 32, 8, 128, 3000
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(Lmax, Hkv, D, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(Lmax, Hkv, D, generator=gen).to(torch.bfloat16).cuda()
    q = torch.empty(N, H, D, dtype=torch.bfloat16, device="cuda")
    mask = torch.zeros(N, Lmax, dtype=torch.bool, device="cuda")
    n_valid = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(N, H, D, dtype=torch.bfloat16, device="cuda")

    def fill(L, seed):
        g = torch.Generator().manual_seed(seed)
        q.copy_(torch.randn(N, H, D, generator=g).to(torch.bfloat16))
        mask.copy_(make_mask("tree", N, L, Lmax, g)[:, :Lmax])
        n_valid.fill_(L)

    pdl = config is not None and len(config) == 6
    fill(500, 1)
    kernels.tree_attention(q, k, v, mask, n_valid, out=out, config=config)    # warm-up: compile + load
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.tree_attention(q, k, v, mask, n_valid, out=out, config=config, pdl=pdl)
    for L, seed in ((700, 2), (2999, 3), (65, 4)):
        fill(L, seed)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = kernels.tree_attention_reference(q, k, v, mask, L)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) <= BF16_TOL, f"replay at L={L}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", GRAPH_CONFIGS, ids=lambda c: "default" if c is None else "/".join(map(str, c)))
def test_tree_attention_pdl_graph_equals_plain(config):
    """A CUDA graph of back-to-back pdl=True calls (each waits for the previous one before
    reading; the layers chain through q = previous out) gives the plain launches' bits, replay
    after replay (versions 1 and 2 keep no state between calls; version 3 shares one workspace
    between the layers, and its last-block combine resets its ticket counters itself)."""
    N, H, Hkv, D, L, layers = 8, 32, 8, 128, 1500, 6
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(layers, L, Hkv, D, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(layers, L, Hkv, D, generator=gen).to(torch.bfloat16).cuda()
    q0 = torch.randn(N, H, D, generator=gen).to(torch.bfloat16).cuda()
    mask = make_mask("tree", N, L, L, gen).cuda()

    def chain(outs, pdl):
        x = q0
        for i in range(layers):
            kernels.tree_attention(x, k[i], v[i], mask, L, out=outs[i], config=config, pdl=pdl)
            x = outs[i]

    ref = torch.full((layers, N, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    chain(ref, False)
    torch.cuda.synchronize()
    assert torch.isfinite(ref).all()
    x = q0
    for i in range(layers):                      # the chain itself is right, not just repeatable
        e = rel_err(ref[i], kernels.tree_attention_reference(x, k[i], v[i], mask, L))
        assert e <= BF16_TOL, f"layer {i}: rel err {e:.3e}"
        x = ref[i]
    outs = torch.full_like(ref, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(outs, True)                        # eager PDL launches
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(outs, ref), "eager pdl=True differs from pdl=False"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(outs, True)
    for r in range(40):
        outs.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs, ref), f"graph replay {r}: pdl=True differs from pdl=False"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", [kernels.AttnConfigV3(1, 2, 2, 4, 0), kernels.AttnConfigV3(1, 2, 2, 4, 1),
                                    kernels.AttnConfigV4(1, 4, 2, 8, 32, 1)],
                         ids=lambda c: "/".join(map(str, c)))
def test_tree_attention_v3_graph_survives_workspace_growth(config):
    """Versions 3 and 4: a graph captured on the per-device workspace keeps working after a larger
    call replaced that workspace (the outgrown one stays alive), and the larger call is right too."""
    dev = torch.cuda.current_device()
    old = tree_attention._WORKSPACES.pop(dev, None)          # start from a fresh, small workspace
    if old is not None:
        tree_attention._RETIRED.append(old)
    q, k, v, mask = attn_inputs(300, 8, 32, 8, 128, "tree", 21)
    out = torch.full((8, 32, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.tree_attention(q, k, v, mask, 300, out=out, config=config)
    torch.cuda.synchronize()
    small_ws = tree_attention._WORKSPACES[dev]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.tree_attention(q, k, v, mask, 300, out=out, config=config)
    q2, k2, v2, mask2 = attn_inputs(4000, 8, 32, 8, 128, "tree", 22)
    out2 = torch.full((8, 32, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.tree_attention(q2, k2, v2, mask2, 4000, out=out2, config=config)   # grows the workspace
    assert tree_attention._WORKSPACES[dev][0].numel() > small_ws[0].numel()
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(23)).to(torch.bfloat16))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, kernels.tree_attention_reference(q, k, v, mask, 300)) <= BF16_TOL
    assert rel_err(out2, kernels.tree_attention_reference(q2, k2, v2, mask2, 4000)) <= BF16_TOL


GEMM_SHAPES = [(4096, 4096), (4096, 14336), (64, 200), (2048, 8192)]


def test_gemv_default_choice(monkeypatch):
    """The default GEMV configs (no GPU needed: 132 SMs as on an H200): the register-pipelined
    kernel, T = 1 where N / 16 blocks would fill under 3/4 of 2 x 132 slots; the 4-warp QKV
    kernel only where it saves a wave (the Llama-3-8B QKV's 384 blocks)."""
    monkeypatch.setattr(kernels, "sm_count", lambda: 132)
    for N, T in ((6144, 2), (4096, 2), (14336 * 2, 2), (2048, 1), (3072, 1), (128256, 2)):
        assert kernels.gemm_rowparallel_config(1, N, 4096) == (T, 4, 256, 1)
    assert kernels.qkv_w4_pays(384) and not kernels.qkv_w4_pays(192) and not kernels.qkv_w4_pays(1792)


def _gemm_u(config) -> int:
    """The summation order (U) of a gemm_rowparallel config."""
    return config[1]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("NK", GEMM_SHAPES, ids=lambda s: "N%d-K%d" % s)
def test_gemm_rowparallel_matches_float64(M, NK):
    N, K = NK
    gen = torch.Generator().manual_seed(M * 7919 + N + K)
    xbuf = torch.randn(M, K + 8, generator=gen).to(torch.bfloat16).cuda()
    x = xbuf[:, :K]                                            # row stride K + 8
    w = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(torch.bfloat16).cuda()
    ref = x.double() @ w.double().T
    by_u = {}
    for config in [None] + list(kernels.GEMM_VARIANTS):    # default, then every variant
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.gemm_rowparallel(x, w, out=out, config=config)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"config {config}: output not fully written"
        err = rel_err(out, ref)
        assert err <= BF16_TOL, f"M={M} N={N} K={K} config {config}: rel err {err:.3e}"
        u = _gemm_u(config or kernels.gemm_rowparallel_config(M, N, K))
        if u in by_u:      # the summation order depends on U only: same U, same bits
            assert torch.equal(out, by_u[u]), f"config {config}: bits differ from another U={u} variant"
        by_u[u] = out
    # programmatic dependent launch (default config): same bits, also right after the kernel
    # that writes x, and inside a CUDA graph
    plain = by_u[_gemm_u(kernels.gemm_rowparallel_config(M, N, K))]
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    x2 = torch.zeros_like(xbuf)
    torch.add(xbuf, 0.0, out=x2)                       # a kernel writes x just before the GEMM
    kernels.gemm_rowparallel(x2[:, :K], w, out=out, pdl=True)
    torch.cuda.synchronize()
    assert torch.equal(out, plain), "PDL launch changed the result"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.add(xbuf, 0.0, out=x2)
        kernels.gemm_rowparallel(x2[:, :K], w, out=out, pdl=True)
    x2.zero_()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain), "PDL launch in a graph changed the result"


@pytest.mark.gpu
@needs_gpu
def test_gemm_allreduce_single_rank_equals_plain_gemm():
    """TP = 1 run of the fused kernel on a 1-rank NCCL communicator: the all-reduce of one
    partial is the identity, so the bits must equal gemm_rowparallel's; also inside a graph."""
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    with single_rank_allreduce(14336, 2 * n_sms) as ar:
        assert kernels.devcomm_sizeof() == ar.layout["devcomm_size"]
        gen = torch.Generator().manual_seed(11)
        for M, N, K in ((1, 4096, 4096), (8, 4096, 14336), (16, 4096, 4096), (5, 14336, 1024)):
            x = torch.randn(M, K, generator=gen).to(torch.bfloat16).cuda()
            w = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(torch.bfloat16).cuda()
            out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
            assert_fused_equals_plain(lambda: kernels.gemm_allreduce(x, w, ar, out=out), out,
                                      kernels.gemm_rowparallel(x, w), f"M={M} N={N} K={K}")


def _allreduce_worker(rank, world, uid, q):
    try:
        torch.cuda.set_device(rank)
        nccl = nccl_shim.get_nccl()
        comm = nccl.comm_init_rank(world, uid, rank)
        n_sms = torch.cuda.get_device_properties(rank).multi_processor_count
        ar = nccl_shim.DeviceAllReduce(comm, max_n=4096, n_ctas=2 * n_sms)
        errs = []
        for M, N, Kl in ((1, 4096, 4096 // world), (8, 4096, 14336 // world), (16, 1024, 512)):
            xs, ws = [], []
            for r in range(world):
                g = torch.Generator().manual_seed(1000 * M + r)
                xs.append(torch.randn(M, Kl, generator=g).to(torch.bfloat16))
                ws.append((torch.randn(N, Kl, generator=g) / math.sqrt(Kl * world)).to(torch.bfloat16))
            ref = sum(xs[r].double() @ ws[r].double().T for r in range(world))
            x, w = xs[rank].cuda(), ws[rank].cuda()
            for _ in range(3):
                out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
                kernels.gemm_allreduce(x, w, ar, out=out)
                torch.cuda.synchronize()
                ok = bool(torch.isfinite(out).all())
                errs.append(rel_err(out.cpu(), ref) if ok else float("inf"))
        digest = float(out.double().sum())            # same bits on every rank
        ar.close()
        nccl.comm_destroy(comm)
        q.put((rank, max(errs), digest, None))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, float("inf"), 0.0, repr(e)))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_gemm_allreduce_multi_gpu():
    world = min(torch.cuda.device_count(), 4)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    uid = nccl_shim.get_nccl().get_unique_id()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, world, uid, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for rank, err, _, exc in results:
        assert exc is None, f"rank {rank}: {exc}"
        assert err <= BF16_TOL, f"rank {rank}: rel err {err:.3e}"
    assert len({d for _, _, d, _ in results}) == 1, "ranks disagree"


def _instantiated_tree_attention_kernels() -> set[str]:
    """The kernel names cuda/tree_attention.cu instantiates, its macros expanded by hand."""
    src = (Path(__file__).resolve().parent.parent / "cuda" / "tree_attention.cu").read_text()
    names = {f"tree_attention_d{d}_mt{mt}_cs{cs}_st{st}" for d, cs, st in
             re.findall(r"^TREE_ATTN_MT\((\d+), (\d+), (\d+)\)", src, re.M) for mt in (1, 2, 4)}
    names |= {f"tree_attention2_d{d}_mt{mt}_cs{cs}_st{st}_w4" for d, cs, st in
              re.findall(r"^TREE_ATTN2_W4\((\d+), (\d+), (\d+)\)", src, re.M) for mt in (1, 2, 4)}
    names |= {f"tree_attention3_d{d}_mt{mt}_st{st}_w4" for d, st in
              re.findall(r"^TREE_ATTN3_MT\((\d+), (\d+), \d+\)", src, re.M) for mt in (1, 2, 4)}
    v4 = re.search(r"#define TREE_ATTN4_D\(D\)((?:.*\\\n)*.*)", src).group(1)
    names |= {f"tree_attention4_d{d}_mt{mt}_w{nw}_pw{pw}_st{st}"
              for d in re.findall(r"^TREE_ATTN4_D\((\d+)\)", src, re.M)
              for mt, nw, pw, st in re.findall(r"TREE_ATTN4_KERNEL\(D, (\d+), (\d+), (\d+), (\d+), \d+\)", v4)}
    return names


def test_tree_attention_configs_match_the_cuda_source():
    """Every listed config (so every default) names a kernel cuda/tree_attention.cu instantiates
    at both head dims, and every instantiated kernel is reached by a listed config."""
    instantiated = _instantiated_tree_attention_kernels()
    wanted = {c.kernel(d)[0] for c in kernels.tree_attention_configs() for d in (64, 128)}
    assert wanted == instantiated, (wanted - instantiated, instantiated - wanted)
    for config in kernels.tree_attention_configs():
        config.check()
        assert config.smem_bytes(128) <= 227 * 1024, config

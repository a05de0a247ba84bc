"""Correctness and speed of the fused kernels on one GPU, against the torch baselines.

    python benchmarks/bench_kernels_gpu.py [--out DIR] [--quick] [--baseline DIR]

Tree attention (Llama-3-8B heads: 32 q / 8 KV heads, D 128) vs torch SDPA with an explicit
boolean mask (what model.py runs without the kernels); row-parallel GEMM (o_proj 4096x4096,
down_proj 4096x14336) vs cuBLAS through F.linear; the fused GEMM + all-reduce on a 1-rank NCCL
communicator (TP = 1) when NCCL gives one. Every timing is a CUDA graph holding one call per
"layer", each layer on its own buffers (>= 256 MB in all, so the 60 MB L2 cannot serve repeats),
replayed many times and timed with CUDA events; the figure is the median replay time divided by
the calls per replay. Each kernel's first layer is checked against a float64 reference first.
Every instantiated variant (kernels.tree_attention_configs(): the four tree-attention kernel
versions, kernels.GEMM_VARIANTS; both also with programmatic dependent launch, back-to-back
calls) is timed; with --baseline DIR, the previous
GEMM kernel (cuda/gemm_allreduce.cu of git 2e8b252, copied to DIR) is timed in the same run.
Prints Markdown tables; with --out also writes them (bench_kernels.md) and raw numbers (.json).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from swiftspec_mpi.gpu import kernels, nccl_shim  # noqa: E402

BF16 = torch.bfloat16
ROTATE_BYTES = 256 << 20
MIN_LAYERS = 4               # attention layers per graph at least (--rotate-mb: 1)


def graph_time_us(calls, replays: int) -> float:
    """Median time of one call, from a CUDA graph holding all `calls` once each."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    del g
    return statistics.median(times) / len(calls)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the ceiling the "% of copy BW" figures use)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1000.0)
    del a, b
    return 2 * n / statistics.median(ts)


class Baseline:
    """The previous row-parallel GEMM (cuda/gemm_allreduce.cu of git 2e8b252: gemm_rowparallel_m8
    / _m16, one block of 8 warps per 8 W rows, 4 loads in flight per lane), for a ratio measured
    in the same run."""

    def __init__(self, folder: Path):
        cupy = kernels.import_cupy()
        major, minor = torch.cuda.get_device_capability()
        opts = ("-std=c++17", f"-arch=sm_{major}{minor}", "-O3")
        self.mod = cupy.RawModule(code=(folder / "gemm_allreduce.cu").read_text(), backend="nvcc", options=opts)
        self.mod.compile()
        self.funcs = {}

    def gemm(self, x, w, out):
        import ctypes
        M, K = x.shape
        N = w.shape[0]
        name = "gemm_rowparallel_m8" if M <= 8 else "gemm_rowparallel_m16"
        if name not in self.funcs:
            self.funcs[name] = self.mod.get_function(name).kernel.ptr
        args = [kernels.ptr(x), ctypes.c_int64(x.stride(0)), kernels.ptr(w), kernels.ptr(out),
                ctypes.c_int64(out.stride(0)), ctypes.c_int32(M), ctypes.c_int32(N), ctypes.c_int32(K)]
        kernels.launch(self.funcs[name], (N // 8, 1, 1), 256, 0, torch.cuda.current_stream().cuda_stream, args)


def cfg_name(cfg) -> str:
    return "/".join(str(c) for c in cfg)


def tree_mask(N: int, L: int, gen: torch.Generator) -> torch.Tensor:
    """Verify-call mask: prefix [0, L-N) visible, random tree over the last N slots."""
    m = torch.zeros(N, L, dtype=torch.bool)
    base = L - N
    m[:, :base] = True
    par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, N)]
    for i in range(N):
        j = i
        while j >= 0:
            m[i, base + j] = True
            j = par[j]
    return m


def bench_attention(L: int, N: int, H: int, Hkv: int, D: int, replays: int, versions=None) -> dict:
    """Every listed config of `versions` (None: all; AttnConfigV1..V4) plus the default, plain and PDL."""
    kv_layer = L * Hkv * D * 2 * 2
    n_layers = max(MIN_LAYERS, min(64, math.ceil(ROTATE_BYTES / kv_layer)))
    gen = torch.Generator().manual_seed(L * 131 + N)
    gg = torch.Generator(device="cuda").manual_seed(L * 131 + N)
    kc = torch.randn(n_layers, L, Hkv, D, generator=gg, device="cuda").to(BF16)
    vc = torch.randn(n_layers, L, Hkv, D, generator=gg, device="cuda").to(BF16)
    q = torch.randn(n_layers, N, H, D, generator=gg, device="cuda").to(BF16)
    mask = tree_mask(N, L, gen).cuda()
    out = torch.full((n_layers, N, H, D), float("nan"), dtype=BF16, device="cuda")
    ref = kernels.tree_attention_reference(q[0], kc[0], vc[0], mask, L)
    R = N * H // Hkv
    default = kernels.tree_attention_config(R, L)
    configs = kernels.tree_attention_configs(R)          # version 1 (3 values), 2 (4), 3 (5), 4 (6)
    if versions is not None:
        configs = [c for c in configs if int(type(c).__name__[-1]) in versions]
    if default not in configs:
        configs.append(default)
    sweep, pdl_sweep, part_us, err, finite, pdl_equal = {}, {}, {}, 0.0, True, True
    op = torch.full_like(out, float("nan"))
    for cfg in list(configs):
        out.fill_(float("nan"))
        try:
            kernels.tree_attention(q[0], kc[0], vc[0], mask, L, out=out[0], config=cfg)
        except Exception as e:  # noqa: BLE001  (e.g. a cluster that cannot be scheduled)
            print(f"attn L={L} N={N} config {cfg_name(cfg)}: launch failed: {e}", flush=True)
            configs.remove(cfg)
            continue
        torch.cuda.synchronize()
        e = ((out[0].double() - ref).norm() / ref.norm()).item()
        fin = bool(torch.isfinite(out[0]).all())
        if e > 1e-2 or not fin:
            print(f"attn L={L} N={N} config {cfg_name(cfg)}: WRONG (rel err {e:.2e}, finite {fin})", flush=True)
        err, finite = max(err, e), finite and fin
        calls = [lambda i=i: kernels.tree_attention(q[i], kc[i], vc[i], mask, L, out=out[i], config=cfg)
                 for i in range(n_layers)]
        sweep[cfg_name(cfg)] = graph_time_us(calls, replays)
        # Programmatic dependent launch, back-to-back calls (as the model chains its kernels).
        op.fill_(float("nan"))
        pcalls = [lambda i=i: kernels.tree_attention(q[i], kc[i], vc[i], mask, L, out=op[i], config=cfg, pdl=True)
                  for i in range(n_layers)]
        pdl_sweep[cfg_name(cfg)] = graph_time_us(pcalls, replays)
        pdl_equal = pdl_equal and bool(torch.equal(op, out))
    best = min(sweep, key=sweep.get)
    best_pdl = min(pdl_sweep, key=pdl_sweep.get)
    def best_of(d, slashes):   # version 1: 2 slashes in the name, version 2: 3, version 3: 4, version 4: 5
        v = {k: t for k, t in d.items() if k.count("/") == slashes}
        return (min(v, key=v.get), min(v.values())) if v else ("n/a", math.nan)

    (best_v1, v1_us), (best_v2, v2_us), (best_v3, v3_us), (best_v4, v4_us) = (best_of(sweep, n) for n in (2, 3, 4, 5))
    (best_v1p, v1p_us), (best_v2p, v2p_us), (best_v3p, v3p_us), (best_v4p, v4p_us) = (
        best_of(pdl_sweep, n) for n in (2, 3, 4, 5))
    t_ours = sweep[best]
    t_default = sweep[cfg_name(default)]
    del op

    # SDPA as model.py calls it: q [1, H, N, D], K/V strided views [1, Hkv, L, D] of the cache.
    q4 = [q[i].transpose(0, 1).unsqueeze(0) for i in range(n_layers)]
    k4 = [kc[i].transpose(0, 1).unsqueeze(0) for i in range(n_layers)]
    v4 = [vc[i].transpose(0, 1).unsqueeze(0) for i in range(n_layers)]
    sd = [lambda i=i: F.scaled_dot_product_attention(q4[i], k4[i], v4[i], attn_mask=mask, enable_gqa=True)
          for i in range(n_layers)]
    sdpa_out = sd[0]()[0].transpose(0, 1)
    sdpa_err = ((sdpa_out.double() - ref).norm() / ref.norm()).item()
    t_sdpa = graph_time_us(sd, max(10, replays // 4))
    del kc, vc, q, out
    torch.cuda.empty_cache()
    return dict(L=L, N=N, H=H, Hkv=Hkv, D=D, layers=n_layers, kv_bytes=kv_layer, err=err, finite=finite,
                sdpa_err=sdpa_err, us=t_ours, best=best, default_us=t_default,
                default=cfg_name(default), default_pdl_us=pdl_sweep[cfg_name(default)], pdl_equal=pdl_equal,
                best_pdl=best_pdl, best_pdl_us=pdl_sweep[best_pdl],
                best_v1=best_v1, best_v1_us=v1_us, best_v2=best_v2, best_v2_us=v2_us, best_v3=best_v3, best_v3_us=v3_us,
                best_v1_pdl=best_v1p, best_v1_pdl_us=v1p_us, best_v2_pdl=best_v2p, best_v2_pdl_us=v2p_us,
                best_v3_pdl=best_v3p, best_v3_pdl_us=v3p_us, best_v4=best_v4, best_v4_us=v4_us,
                best_v4_pdl=best_v4p, best_v4_pdl_us=v4p_us,
                sdpa_us=t_sdpa, sweep=sweep, pdl_sweep=pdl_sweep, part_us=part_us)


def launch_floor_us(replays: int) -> tuple[float, float]:
    """Per-node time of a CUDA graph of 64 empty kernels (tree_attention_empty, 128 blocks of 128
    threads, like a tree-attention grid), plain launches and PDL launches: the launch floor that
    every tree-attention call pays in a graph."""
    import ctypes
    dev = torch.cuda.current_device()
    f = kernels.function("tree_attention", "", "tree_attention_empty", dev)
    res = []
    for launch in (kernels.launch, kernels.launch_pdl):
        calls = [lambda launch=launch: launch(f, (16, 8, 1), 128, 0, torch.cuda.current_stream().cuda_stream,
                                               [ctypes.c_int32(0)]) for _ in range(64)]
        res.append(graph_time_us(calls, replays))
    return res[0], res[1]


def bench_gemm(M: int, N: int, K: int, replays: int, ar=None, baseline=None) -> dict:
    wbytes = N * K * 2
    n_w = max(2, math.ceil(ROTATE_BYTES / wbytes))
    gg = torch.Generator(device="cuda").manual_seed(M * 7 + N + K)
    w = torch.empty(n_w, N, K, dtype=BF16, device="cuda")
    for i in range(n_w):
        w[i] = torch.randn(N, K, generator=gg, device="cuda") / math.sqrt(K)
    x = torch.randn(M, K, generator=gg, device="cuda").to(BF16)
    out = torch.full((n_w, M, N), float("nan"), dtype=BF16, device="cuda")
    ref = x.double() @ w[0].double().T
    default = kernels.gemm_rowparallel_config(M, N, K)
    sweep, err, finite = {}, 0.0, True
    for cfg in kernels.GEMM_VARIANTS:
        out.fill_(float("nan"))
        kernels.gemm_rowparallel(x, w[0], out=out[0], config=cfg)
        torch.cuda.synchronize()
        err = max(err, ((out[0].double() - ref).norm() / ref.norm()).item())
        finite = finite and bool(torch.isfinite(out[0]).all())
        sweep[cfg_name(cfg)] = graph_time_us(
            [lambda i=i: kernels.gemm_rowparallel(x, w[i], out=out[i], config=cfg) for i in range(n_w)], replays)
    best = min(sweep, key=sweep.get)
    kernels.gemm_rowparallel(x, w[0], out=out[0])          # default config: the fused kernel's bits
    torch.cuda.synchronize()
    ob = torch.empty((n_w, M, N), dtype=BF16, device="cuda")
    t_cublas = graph_time_us([lambda i=i: torch.matmul(x, w[i].T, out=ob[i]) for i in range(n_w)], replays)
    r = dict(M=M, N=N, K=K, w_bytes=wbytes, err=err, finite=finite, us=sweep[cfg_name(default)],
             default=cfg_name(default), best=best, best_us=sweep[best], sweep=sweep, cublas_us=t_cublas)
    # Programmatic dependent launch: each call's W streaming overlaps the previous call's tail.
    op = torch.full((n_w, M, N), float("nan"), dtype=BF16, device="cuda")
    kernels.gemm_rowparallel(x, w[0], out=op[0], pdl=True)
    torch.cuda.synchronize()
    r["pdl_equal"] = bool(torch.equal(op[0], out[0]))
    r["pdl_sweep"] = {cfg_name(cfg): graph_time_us(
        [lambda i=i: kernels.gemm_rowparallel(x, w[i], out=op[i], config=cfg, pdl=True) for i in range(n_w)], replays)
        for cfg in kernels.GEMM_VARIANTS}
    r["pdl_us"] = r["pdl_sweep"][cfg_name(default)]
    del op
    if baseline is not None:
        t_base = graph_time_us([lambda i=i: baseline.gemm(x, w[i], ob[i]) for i in range(n_w)], replays)
        r["baseline_us"] = t_base
    if ar is not None:
        of = torch.full((n_w, M, N), float("nan"), dtype=BF16, device="cuda")
        kernels.gemm_allreduce(x, w[0], ar, out=of[0])
        torch.cuda.synchronize()
        r["fused_equal"] = bool(torch.equal(of[0], out[0]))
        r["fused_us"] = graph_time_us([lambda i=i: kernels.gemm_allreduce(x, w[i], ar, out=of[i])
                                       for i in range(n_w)], replays)
    del w, out, ob
    torch.cuda.empty_cache()
    return r


def sanitize_run() -> int:
    """One small call of each kernel, synchronized, for `compute-sanitizer python ... --sanitize`."""
    gen = torch.Generator().manual_seed(0)
    for L, N, H, Hkv, D in ((300, 8, 32, 8, 128), (130, 3, 12, 2, 64)):
        kc = torch.randn(L + 5, Hkv, D, generator=gen).to(BF16).cuda()
        vc = torch.randn(L + 5, Hkv, D, generator=gen).to(BF16).cuda()
        q = torch.randn(N, H, D, generator=gen).to(BF16).cuda()
        mask = tree_mask(N, L, gen).cuda()
        out = kernels.tree_attention(q, kc, vc, mask, L)
        torch.cuda.synchronize()
        ref = kernels.tree_attention_reference(q, kc, vc, mask, L)
        print(f"sanitize attn L={L} N={N} D={D}: err {((out.double() - ref).norm() / ref.norm()).item():.2e}")
    for M, N, K in ((3, 64, 200), (16, 256, 1024)):
        x = torch.randn(M, K, generator=gen).to(BF16).cuda()
        w = torch.randn(N, K, generator=gen).to(BF16).cuda()
        y = kernels.gemm_rowparallel(x, w)
        torch.cuda.synchronize()
        ref = x.double() @ w.double().T
        print(f"sanitize gemm M={M} N={N} K={K}: err {((y.double() - ref).norm() / ref.norm()).item():.2e}")
    return 0


PROFILE_CONFIGS = (kernels.AttnConfigV1(16, 2, 1), kernels.AttnConfigV2(16, 2, 2, 4), kernels.AttnConfigV4(4, 4, 2, 8, 32, 0))


def profile_run(what: str) -> int:
    """attention: L=4096, N=8, configs PROFILE_CONFIGS, each launched twice (warm-up, profiled);
    gemm: o_proj 4096x4096 at M=8, launched twice. For `ncu --launch-skip K --launch-count K`."""
    gg = torch.Generator(device="cuda").manual_seed(5)
    if what == "attention":
        L, N = 4096, 8
        kc = torch.randn(L, 8, 128, generator=gg, device="cuda").to(BF16)
        vc = torch.randn(L, 8, 128, generator=gg, device="cuda").to(BF16)
        q = torch.randn(N, 32, 128, generator=gg, device="cuda").to(BF16)
        mask = tree_mask(N, L, torch.Generator().manual_seed(5)).cuda()
        for _ in range(2):
            for cfg in PROFILE_CONFIGS:
                kernels.tree_attention(q, kc, vc, mask, L, config=cfg)
    else:
        x = torch.randn(8, 4096, generator=gg, device="cuda").to(BF16)
        w = torch.randn(4096, 4096, generator=gg, device="cuda").to(BF16)
        for _ in range(2):
            kernels.gemm_rowparallel(x, w)
    torch.cuda.synchronize()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for bench_kernels.md / .json")
    ap.add_argument("--quick", action="store_true", help="fewer replays")
    ap.add_argument("--sanitize", action="store_true",
                    help="only run each kernel once on small inputs (for compute-sanitizer)")
    ap.add_argument("--profile", choices=("attention", "gemm"), default=None,
                    help="warm up, then run a few launches (for ncu --launch-skip)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="folder with the previous gemm_allreduce.cu to time as well")
    ap.add_argument("--only", choices=("attention", "gemm"), default=None, help="run one half only")
    ap.add_argument("--rows", default=None,
                    help="attention shapes to run, e.g. 4096x8,1024x8 (L x N; default: the six of the table)")
    ap.add_argument("--versions", default=None,
                    help="tree-attention kernel versions to sweep, e.g. 2,3,4 (the default config always runs)")
    ap.add_argument("--rotate-mb", type=int, default=None,
                    help="attention: rotate the calls over this many MB of K/V (default 256, at least 4 "
                         "layers; given: at least 1 layer, e.g. 32 keeps 4k's K/V in the 60 MB L2)")
    args = ap.parse_args()
    if args.rotate_mb is not None:
        global ROTATE_BYTES, MIN_LAYERS
        ROTATE_BYTES, MIN_LAYERS = args.rotate_mb << 20, 1
    if args.sanitize:
        return sanitize_run()
    if args.profile:
        return profile_run(args.profile)
    if not kernels.available():
        print("kernels unavailable: needs CuPy, nvcc and an sm_90 GPU", file=sys.stderr)
        return 2
    replays = 20 if args.quick else 100
    props = torch.cuda.get_device_properties(0)
    cupy = kernels.import_cupy()

    info = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                cupy=cupy.__version__, cuda=torch.version.cuda, host=platform.node(),
                date=time.strftime("%Y-%m-%d"))
    try:
        info["nccl"] = nccl_shim.get_nccl().version()
    except Exception as e:  # noqa: BLE001
        info["nccl"] = f"unavailable: {e}"
    t0 = time.time()
    baseline = None
    if args.baseline is not None:
        try:
            baseline = Baseline(args.baseline)
        except Exception as e:  # noqa: BLE001
            print(f"baseline unavailable: {e}", flush=True)
    bw = copy_bandwidth()
    info["copy_bw_TBps"] = bw / 1e12
    print(f"# {info}", flush=True)

    attn = []
    if args.only != "gemm":
        info["launch_floor_us"], info["launch_floor_pdl_us"] = launch_floor_us(replays)
        print(f"launch floor (graph of empty kernels, per node): {info['launch_floor_us']:.2f} us, "
              f"PDL {info['launch_floor_pdl_us']:.2f} us", flush=True)
    shapes = ((1024, 8), (4096, 8), (16384, 8), (4096, 1), (4096, 64), (16384, 64))
    if args.rows:
        shapes = tuple(tuple(int(x) for x in item.split("x")) for item in args.rows.split(","))
    versions = None if not args.versions else {int(v) for v in args.versions.split(",")}
    for L, N in (() if args.only == "gemm" else shapes):
        r = bench_attention(L, N, 32, 8, 128, replays, versions)
        attn.append(r)
        print(f"attn L={L} N={N} (plain / PDL): " + ", ".join(f"{k} {v:.2f}/{r['pdl_sweep'][k]:.2f}"
                                                              for k, v in r["sweep"].items())
              + f" us (SDPA {r['sdpa_us']:.1f}), err {r['err']:.2e}"
              + ("" if r["pdl_equal"] else " (PDL bits differ!)"), flush=True)
        if r["part_us"]:
            print(f"attn L={L} N={N} version 4 kernels alone (plain graphs): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["part_us"].items()) + " us", flush=True)

    ar = None
    nccl = comm = None
    if args.only != "attention":
        try:
            nccl = nccl_shim.get_nccl()
            comm = nccl.comm_init_rank(1, nccl.get_unique_id(), 0)
            ar = nccl_shim.DeviceAllReduce(comm, max_n=4096, n_ctas=2 * props.multi_processor_count)
            info["fused_tp1"] = "ok"
        except Exception as e:  # noqa: BLE001
            info["fused_tp1"] = f"unavailable: {e}"
            print(f"fused TP=1 path unavailable: {e}", flush=True)
    gemm = []
    for N, K, name in (() if args.only == "attention" else ((4096, 4096, "o_proj"), (4096, 14336, "down_proj"))):
        for M in (1, 8, 16):
            r = bench_gemm(M, N, K, replays, ar, baseline)
            r["name"] = name
            gemm.append(r)
            print(f"gemm {name} M={M}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["sweep"].items())
                  + f" us (default {r['default']}; cuBLAS {r['cublas_us']:.2f}"
                  + (f"; previous kernel {r['baseline_us']:.2f}" if "baseline_us" in r else "")
                  + (f"; fused TP1 {r['fused_us']:.2f}" if "fused_us" in r else "")
                  + f"; PDL chain {r['pdl_us']:.2f}{'' if r['pdl_equal'] else ' (bits differ!)'}), err {r['err']:.2e}",
                  flush=True)
    if ar is not None:
        ar.close()
        nccl.comm_destroy(comm)
    info["bench_seconds"] = round(time.time() - t0, 1)

    def prev(r):
        return f"{r['baseline_us']:.2f}" if r.get("baseline_us") else "n/a"

    lines = [f"GPU: {info['gpu']} ({info['sms']} SMs), torch {info['torch']}, CuPy {info['cupy']}, "
             f"CUDA {info['cuda']}, NCCL {info['nccl']}; measured copy bandwidth "
             f"{info['copy_bw_TBps']:.2f} TB/s (read + write). {info['date']}.", "",
             "Tree attention, one layer, Llama-3-8B heads (32 q / 8 KV heads, D 128), bf16, random "
             "tree mask over the last N slots; CUDA graph, median per call:", "",
             "| context L | tokens N | default config (µs) | default, PDL back-to-back (µs) "
             "| best version 1: µs | best version 2: µs | best version 3: µs | best version 4: µs "
             "| best version 1, PDL | best version 2, PDL | best version 3, PDL | best version 4, PDL "
             "| torch SDPA + bool mask (µs) | speed-up (default) | KV bytes floor (µs) | max rel. err vs float64 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in attn:
        floor = r["kv_bytes"] / bw * 1e6
        lines.append(f"| {r['L']} | {r['N']} | {r['default_us']:.2f} ({r['default']}) | {r['default_pdl_us']:.2f} "
                     f"| {r['best_v1']}: {r['best_v1_us']:.2f} | {r['best_v2']}: {r['best_v2_us']:.2f} "
                     f"| {r['best_v3']}: {r['best_v3_us']:.2f} | {r['best_v4']}: {r['best_v4_us']:.2f} "
                     f"| {r['best_v1_pdl']}: {r['best_v1_pdl_us']:.2f} | {r['best_v2_pdl']}: {r['best_v2_pdl_us']:.2f} "
                     f"| {r['best_v3_pdl']}: {r['best_v3_pdl_us']:.2f} | {r['best_v4_pdl']}: {r['best_v4_pdl_us']:.2f} "
                     f"| {r['sdpa_us']:.1f} | {r['sdpa_us'] / r['default_us']:.1f}x | {floor:.2f} "
                     f"| {r['err']:.1e}{'' if r['finite'] else ' (NaN!)'}{'' if r['pdl_equal'] else ' (PDL bits differ!)'} |")
    if "launch_floor_us" in info:
        lines += ["", f"Launch floor: a CUDA graph of empty kernels (16 x 8 blocks) takes "
                  f"{info['launch_floor_us']:.2f} µs per node, {info['launch_floor_pdl_us']:.2f} µs with PDL."]
    lines += ["", "All tree-attention configs timed (µs, plain / PDL back-to-back), "
              "cluster/stages/row tiles (version 1), cluster/stages/row tiles/warps (version 2), "
              "tiles per split/stages/row tiles/warps/combine (version 3) or "
              "tiles per split/stages/row tiles/warps/piece/prefetch (version 4):", ""]
    for r in attn:
        lines.append(f"- L={r['L']} N={r['N']}: " + ", ".join(f"{k} {v:.2f} / {r['pdl_sweep'][k]:.2f}"
                                                              for k, v in r["sweep"].items()))
    lines += ["", "Row-parallel GEMM Y = X W^T (bf16, fp32 accumulate), weights rotated through "
              ">= 256 MB so each call streams them from HBM; % = weight bytes / time / copy bandwidth; "
              "configs are tiles per block/vectors per lane/L2 prefetch/double buffering:", "",
              "| layer | M | N x K | fused kernel, default config (µs) | % of copy BW | best config: µs (%) "
              "| default config with PDL, back-to-back calls: µs (%) "
              "| previous kernel (µs) | cuBLAS F.linear (µs) | fused + all-reduce, 1-rank NCCL (µs) | rel. err |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in gemm:
        pct = r["w_bytes"] / (r["us"] * 1e-6) / bw * 100
        bpct = r["w_bytes"] / (r["best_us"] * 1e-6) / bw * 100
        fused = f"{r['fused_us']:.2f}{'' if r.get('fused_equal') else ' (bits differ!)'}" if "fused_us" in r else "n/a"
        ppct = r["w_bytes"] / (r["pdl_us"] * 1e-6) / bw * 100
        lines.append(f"| {r['name']} | {r['M']} | {r['N']}x{r['K']} | {r['us']:.2f} ({r['default']}) | {pct:.0f} % "
                     f"| {r['best']}: {r['best_us']:.2f} ({bpct:.0f} %) "
                     f"| {r['pdl_us']:.2f} ({ppct:.0f} %){'' if r['pdl_equal'] else ' (bits differ!)'} | {prev(r)} | "
                     f"{r['cublas_us']:.2f} | {fused} | {r['err']:.1e}{'' if r['finite'] else ' (NaN!)'} |")
    lines += ["", "All GEMM configs timed (µs), plain launch / with PDL (back-to-back calls):", ""]
    for r in gemm:
        lines.append(f"- {r['name']} M={r['M']}: " + ", ".join(f"{k} {v:.2f} / {r['pdl_sweep'][k]:.2f}"
                                                              for k, v in r["sweep"].items()))
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_kernels.md").write_text(table + "\n")
        (args.out / "bench_kernels.json").write_text(json.dumps(dict(info=info, attention=attn, gemm=gemm), indent=1))
    bad = [r for r in attn + gemm if not r["finite"] or r["err"] > 1e-2 or r.get("fused_equal") is False
           or r.get("pdl_equal") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

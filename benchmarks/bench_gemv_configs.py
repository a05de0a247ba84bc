"""Which compiled GEMV variant (tiles per block T, vectors per chunk U, L2 prefetch hint PF,
register double buffering PIPE) is fastest for each decode projection *inside a PDL chain*, as in
a step? The first sweep (bench_kernels_gpu.py) timed the Llama-3-8B shapes one launch at a time;
the default rule (kernels.gemm_regs_config) comes from it.

    python benchmarks/bench_gemv_configs.py [--m 1,8] [--shapes 8b_o,1b_down,...]

Times a PDL chain of 32 launches of kernels.gemm_rowparallel with 32 distinct weights (streamed
from HBM, as in a step), CUDA graph, median of 50 replays, µs per launch, for every variant in
kernels.GEMM_VARIANTS; prints a Markdown table (best bold, the default marked *) and the % of the
copy bandwidth the best reaches. Variants with the same U give the same bits (U = 4 is also the
fused all-reduce kernel's and the QKV / SwiGLU kernels' order).
"""
from __future__ import annotations

import argparse

import torch

from bench_kernels_gpu import copy_bandwidth, graph_time_us   # same folder

SHAPES = {   # name: (N, K) of the [N, K] weight
    "8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gu": (28672, 4096), "8b_down": (4096, 14336),
    "1b_qkv": (3072, 2048), "1b_o": (2048, 2048), "1b_gu": (16384, 2048), "1b_down": (2048, 8192),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--chain", type=int, default=32)
    a = ap.parse_args()
    from swiftspec_mpi.gpu import kernels
    variants = kernels.GEMM_VARIANTS
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e12:.2f} TB/s; "
          f"µs per launch in a PDL chain of {a.chain} distinct weights; * = default")
    head = " | ".join("T%d U%d P%d S%d" % v for v in variants)
    print(f"| GEMV | M | {head} | best % of copy BW |")
    print("|---|---:|" + "---:|" * len(variants) + "---:|")
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        ws = [(torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16) for _ in range(a.chain)]
        for M in (int(m) for m in a.m.split(",")):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            ref = kernels.gemm_rowparallel(x, ws[0], config=variants[0]).clone()
            default = kernels.gemm_rowparallel_config(M, N, K)
            us = {}
            for v in variants:
                got = kernels.gemm_rowparallel(x, ws[0], config=v)
                assert (got.float() - ref.float()).abs().max().item() <= 1e-2 * ref.float().abs().max().item(), v
                us[v] = graph_time_us([lambda w=w, v=v: kernels.gemm_rowparallel(x, w, out=out, config=v, pdl=True)
                                       for w in ws], 50)
            best = min(us, key=us.get)
            cells = []
            for v in variants:
                c = f"{us[v]:.2f}" + ("*" if v == default else "")
                cells.append(f"**{c}**" if v == best else c)
            pct = 100 * N * K * 2 / (us[best] * 1e-6) / copy_bw
            print(f"| {name} {N}x{K} | {M} | " + " | ".join(cells) + f" | {pct:.0f} % |", flush=True)
        ws = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Is a one-wave GEMV of the decode step limited by the DRAM or by its own latency? Times a PDL
chain of 32 launches of kernels.gemm_rowparallel (CUDA graph, median of replays) with 32
distinct weights (streamed from HBM, as in a step) and with one weight read 32 times (hot in
the L2 when it fits), for Llama-3-8B's o_proj and QKV and Llama-3.2-1B's o_proj and down_proj.
If the hot chain is not much faster, moving weights into the L2 ahead of time (prefetch) cannot
speed the kernel up much either.

    python benchmarks/bench_gemv_hot_cold.py
"""
from __future__ import annotations

import torch

from bench_kernels_gpu import copy_bandwidth, graph_time_us   # same folder (the kernel benchmark)

SHAPES = [("8B o_proj", 4096, 4096), ("8B qkv", 6144, 4096), ("1B o_proj", 2048, 2048),
          ("1B down", 2048, 8192), ("8B down", 4096, 14336)]


def main():
    from swiftspec_mpi.gpu import kernels
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; us per launch in a PDL chain of 32")
    print("| GEMV | N x K | MB | M | cold (32 weights) us | % of copy BW | hot (1 weight) us | hot / cold |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, N, K in SHAPES:
        ws = [(torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16) for _ in range(32)]
        for M in (1, 8):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            cold = graph_time_us([lambda w=w: kernels.gemm_rowparallel(x, w, out=out, pdl=True) for w in ws], 50)
            hot = graph_time_us([lambda: kernels.gemm_rowparallel(x, ws[0], out=out, pdl=True)] * 32, 50)
            mb = N * K * 2 / 2**20
            pct = 100 * N * K * 2 / (cold * 1e-6) / copy_bw
            print(f"| {name} | {N} x {K} | {mb:.0f} | {M} | {cold:.2f} | {pct:.0f} % | {hot:.2f} | {hot / cold:.2f} |",
                  flush=True)
        ws = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

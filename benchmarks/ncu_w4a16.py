"""Plain launches of the W4A16 GEMV that a step runs, for Nsight Compute's hardware counters.

    ncu --clock-control none --kernel-name regex:w4a16_gemm --launch-skip 8 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy --section LaunchStats python3 benchmarks/ncu_w4a16.py llama-3-8b:qkv

Each argument SHAPE:PROJ (shapes and projections of bench_w4a16.SHAPES_GEMV, group 128) builds
enough random weight copies to leave the 60 MB L2 (so the profiled launch streams from HBM, as in
a step), then launches `w4a16.gemm` over them in turn (--config's variant, no PDL)
for --m rows: 8 warm-up launches, then --launches more (what --launch-skip / --launch-count pick).
Without ncu it prints the mean µs a launch (CUDA events) and the share of the copy bandwidth.
"""
from __future__ import annotations

import argparse

import torch

from bench_kernels_gpu import copy_bandwidth               # same folder
from bench_w4a16 import L2_BYTES, SHAPES_GEMV


def main():
    from swiftspec_mpi.gpu import w4a16
    from swiftspec_mpi.packed.int4 import PackedInt4
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="+", help="SHAPE:PROJ, e.g. llama-3-8b:qkv")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--launches", type=int, default=8)
    ap.add_argument("--config", default="rule", help="T/U/E of the variant (one of w4a16.VARIANTS), or "
                                                    "'rule': w4a16.default_config's")
    args = ap.parse_args()
    if args.config != "rule":
        w4a16.set_default(tuple(int(v) for v in args.config.split("/")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(1 << 30)
    for target in args.targets:
        shape, proj = target.split(":")
        n, k = next((n, k) for name, n, k in SHAPES_GEMV[shape] if name == proj)
        copies = []
        while len(copies) * (n * k // 2) < 4 * L2_BYTES and len(copies) < 64:
            q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
            sc = torch.rand(n, k // 128, device="cuda", generator=gen) * 0.004 + 0.002
            copies.append(w4a16.from_packed(PackedInt4(q, sc, -8 * sc, 128), "cuda"))
        x = torch.randn(args.m, k, device="cuda", generator=gen).to(torch.bfloat16)
        out = torch.empty(args.m, n, dtype=torch.bfloat16, device="cuda")
        for i in range(8):
            w4a16.gemm(x, copies[i % len(copies)], out=out)
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for i in range(args.launches):
            w4a16.gemm(x, copies[(8 + i) % len(copies)], out=out)
        t1.record()
        torch.cuda.synchronize()
        us = 1e3 * t0.elapsed_time(t1) / args.launches
        nbytes = copies[0].nbytes()
        print(f"{target} M={args.m} config={w4a16.default_config(args.m, n, k)} {nbytes / 2**20:.1f} MiB: "
              f"{us:.1f} us a launch (with launch gaps), {100 * nbytes / (us * 1e-6) / bw:.0f} % of copy "
              f"{bw / 1e12:.2f} TB/s", flush=True)
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

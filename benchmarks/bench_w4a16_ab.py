"""A/B of the W4A16 GEMV: another version of cuda/w4a16.cu (the baseline, its default (1, 2, 1)
kernel: w4a16_gemm_mb*_g*_t1_u2_e1 with the same arguments) against this tree's variants, over the
same weights in one run, PDL launches in CUDA graphs over copies that leave the L2 (as
bench_w4a16.py gemv), torch's int4 kernel beside (group 128). '=' marks a variant whose output
equals the baseline's bit for bit. Run from the repository root on the GPU:

    git show e83e2f7:cuda/w4a16.cu > cuda/w4a16base.cu     # the baseline, loaded as source "w4a16base"
    python3 benchmarks/bench_w4a16_ab.py 1,8 1/2/1,1/1/1    # M list, variants T/U/E (or 'all')
    BASE_LAYOUT=rows python3 benchmarks/bench_w4a16_ab.py ...  # a baseline of the row-major layout
                                                            # (before the tile-major one, 2026-12-03)
    BASE_CFG=1/1/1 python3 benchmarks/bench_w4a16_ab.py ...    # the baseline's variant (default 1/2/1)

Writes $OUT/ab.json (or /tmp/ab.json).
"""
import ctypes
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels_gpu import copy_bandwidth, graph_time_us
from swiftspec_mpi.gpu import w4a16
from swiftspec_mpi.gpu.launch import function, launch, launch_pdl, ptr
from swiftspec_mpi.packed.int4 import PackedInt4  # noqa: E402

L2 = 60 << 20
shapes = [("8b", "qkv", 6144, 4096), ("8b", "o", 4096, 4096), ("8b", "gate_up", 28672, 4096), ("8b", "down", 4096, 14336),
          ("70b", "qkv", 10240, 8192), ("70b", "o", 8192, 8192), ("70b", "gate_up", 57344, 8192), ("70b", "down", 8192, 28672)]
ms = [int(v) for v in sys.argv[1].split(",")]
cfgs = list(w4a16.VARIANTS) if sys.argv[2] == "all" else [tuple(int(v) for v in c.split("/")) for c in sys.argv[2].split(",")]
groups_down = (128, 32)


BASE_ROWS = os.environ.get("BASE_LAYOUT", "tiles") == "rows"
BASE_CFG = tuple(int(v) for v in os.environ.get("BASE_CFG", "1/2/1").split("/"))   # the baseline's variant


def base_weight(w):
    """w as the baseline kernel reads it: the same arrays, or row-major (BASE_LAYOUT=rows)."""
    if not BASE_ROWS:
        return w
    return w4a16.W4A16Weight(w4a16.from_tiles(w.qweight, w4a16.CHUNK // 2),
                             w4a16.from_tiles(w.so, w4a16.CHUNK // w.group), w.group)


def base_gemm(x, w, out, pdl=True):
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    t, u, e = BASE_CFG
    f = function("w4a16base", "", f"w4a16_gemm_mb{w4a16._mb(m)}_g{w.group}_t{t}_u{u}_e{e}", 0)
    args = [ptr(x), ctypes.c_int64(x.stride(0)), ptr(w.qweight), ptr(w.so), ptr(out),
            ctypes.c_int64(out.stride(0)), ctypes.c_int32(m), ctypes.c_int32(n), ctypes.c_int32(k)]
    (launch_pdl if pdl else launch)(f, (-(-(n // 16) // t), 1, 1), 256, 0, torch.cuda.current_stream().cuda_stream, args)
    return out


def new_gemm(src, x, w, out, cfg):
    w4a16._SOURCE = src
    try:
        return w4a16.gemm(x, w, out=out, config=cfg, pdl=True)
    finally:
        w4a16._SOURCE = "w4a16"


bw = copy_bandwidth(2 << 30)
print(f"copy {bw/1e12:.2f} TB/s", flush=True)
gen = torch.Generator(device="cuda").manual_seed(0)
res = []
for sh, name, n, k in shapes:
    for group in (groups_down if name == "down" else (128,)):
        copies = []
        while not copies or (len(copies) * copies[0].nbytes() < 4 * L2 and len(copies) < 64):
            q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
            sc = torch.rand(n, k // group, device="cuda", generator=gen) * 0.004 + 0.002
            copies.append(w4a16.from_packed(PackedInt4(q, sc, -8 * sc, group), "cuda"))
        base_copies = [base_weight(w) for w in copies]
        nb = copies[0].nbytes()
        pct = lambda t: 100 * nb / (t * 1e-6) / bw
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ref = base_gemm(x, base_copies[0], torch.empty_like(out)).clone()
            tb = graph_time_us([lambda w=w: base_gemm(x, w, out) for w in base_copies])
            cells = []
            for cfg in cfgs:
                y = new_gemm("w4a16", x, copies[0], torch.empty_like(out), cfg)
                same = torch.equal(y, ref)
                rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                if rel > 2e-2:
                    print(f"!! {cfg} rel diff {rel:.3g} vs base", flush=True)
                t = graph_time_us([lambda w=w, cfg=cfg: new_gemm("w4a16", x, w, out, cfg) for w in copies])
                cells.append((cfg, t, same))
            tt = float("nan")
            if group == 128:
                from bench_w4a16 import torch_int4_weight
                try:
                    if m == ms[0]:
                        tw = [torch_int4_weight(n, k, group, gen) for _ in range(len(copies))]
                    tt = graph_time_us([lambda wp=wp, sz=sz: torch.ops.aten._weight_int4pack_mm(x, wp, group, sz) for wp, sz in tw])
                except Exception as e:
                    print("torch int4:", repr(e))
            best = min(cells, key=lambda c: c[1])
            print(f"{sh} {name} {n}x{k} g{group} M={m} {nb/2**20:.1f}MB | base {tb:.1f} ({pct(tb):.0f}%) | " +
                  " ".join(f"{'/'.join(map(str, c[0]))}:{c[1]:.1f}({pct(c[1]):.0f}%){'=' if c[2] else ''}" for c in cells) +
                  f" | best {best[0]} {best[1]:.1f} ({pct(best[1]):.0f}%) x{tb/best[1]:.2f} | torch {tt:.1f}", flush=True)
            res.append(dict(shape=sh, proj=name, n=n, k=k, group=group, m=m, base=tb, torch=tt, nbytes=nb,
                            new={"/".join(map(str, c[0])): c[1] for c in cells}))
        del copies, base_copies
        tw = None
        torch.cuda.empty_cache()
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/ab.json", "w"), indent=1)

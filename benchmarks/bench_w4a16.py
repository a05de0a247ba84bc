"""4-bit weights on one GPU: the W4A16 GEMV (cuda/w4a16.cu) against torch's int4 kernel
(`_weight_int4pack_mm`, tinygemm, the one gpt-fast's int4 path runs) at the same shapes, and the
4-bit decode step of whole models (CUDA graphs, W4A16 GEMVs with PDL). Random weights, group 128
unless a row says otherwise. Prints Markdown tables; --json writes the numbers.

    python benchmarks/bench_w4a16.py gemv [--json f]     # projections of Llama-3-8B and -70B
    python benchmarks/bench_w4a16.py step [--shapes llama-3-8b,...] [--context 1024] [--json f]

gemv: "copy TB/s" = a 2 GiB device-to-device copy (bytes read + written), the ceiling. Each
kernel is timed in a CUDA graph of back-to-back launches over enough weight copies to leave the
60 MB L2 (the weights stream from HBM as in a step): ours plain (the fastest of VARIANTS) and with
PDL (w4a16.default_config's variant, what the model runs);
"% copy" = (codes + scales + offsets bytes the kernel reads) / time over the copy bandwidth.
torch's kernel reads [K/g, N, 2] bf16 scales-and-zeros: its bytes are counted the same way.
The peer's "stack" rows time every projection of a layer x layers, the GEMM part of its step.

step: per shape, LM head (--heads: bf16 as loaded, int4 as `--head-bits 4` packs it) and GEMV
variant (--configs), int4 (group 128) model with a `context`-slot prefix: one token (the graph
with the argmax read: wall time with the sync, as the engine's verify step), an 8-node tree
verify (argmax read), the w = 8 leaf expansion with the top-8 read (drafts); weights GB, bytes a
step streams, its floor at the copy bandwidth, peak memory. --peer SHAPES then times the
gpt-fast-style int4 step (bench_gptfast_int4.py) at those shapes in the same process.

    python benchmarks/bench_w4a16.py step --configs rule --peer llama-3.2-1b,llama-3-8b,llama-3-70b
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench_kernels_gpu import copy_bandwidth, graph_time_us   # same folder (the kernel benchmark)

SHAPES_GEMV = {      # (name, N, K) per projection: fused QKV, O, fused gate|up, down
    "llama-3-8b": (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)),
    "llama-3-70b": (("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 57344, 8192), ("down", 8192, 28672)),
}
LAYERS = {"llama-3-8b": 32, "llama-3-70b": 80}
L2_BYTES = 60 << 20


def torch_int4_weight(n: int, k: int, group: int, gen):
    """(packed weight, scales_and_zeros) for torch's _weight_int4pack_mm, random codes."""
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    wp = torch.ops.aten._convert_weight_to_int4pack(q, 8)
    sz = torch.empty(k // group, n, 2, dtype=torch.bfloat16, device="cuda")
    sz[..., 0] = 0.0043
    sz[..., 1] = 0.0
    return wp, sz


def bench_gemv(args) -> dict:
    from swiftspec_mpi.gpu import w4a16
    from swiftspec_mpi.packed.int4 import PackedInt4
    bw = copy_bandwidth(2 << 30) / 1e12
    print(f"copy bandwidth {bw:.2f} TB/s\n")
    res = {"copy_tbs": bw, "rows": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    hdr = ("| shape | proj | N x K | g | M | MB read | ours us (best T,U,E) | % copy | ours PDL us (default) | % copy | "
           "torch int4 us | % copy |")
    print(hdr)
    print("|" + "---|" * 12)
    for shape, projs in SHAPES_GEMV.items():
        for name, n, k in projs:
            for group in ((128, 32) if name in ("o", "down") else (128,)):
                one = None
                copies = []
                while not copies or (len(copies) * one < 4 * L2_BYTES and len(copies) < 64):
                    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
                    sc = torch.rand(n, k // group, device="cuda", generator=gen) * 0.004 + 0.002
                    w = w4a16.from_packed(PackedInt4(q, sc, -8 * sc, group), "cuda")
                    one = w.nbytes()
                    copies.append(w)
                    del q, sc
                tw = None
                if group == 128:
                    tw = [torch_int4_weight(n, k, group, gen) for _ in range(len(copies))]
                    tbytes = tw[0][0].numel() * tw[0][0].element_size() + tw[0][1].numel() * 2
                for m in args.m:
                    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                    best = None
                    for cfg in w4a16.VARIANTS:
                        t = graph_time_us([lambda w=w, cfg=cfg: w4a16.gemm(x, w, out=out, config=cfg) for w in copies])
                        if best is None or t < best[0]:
                            best = (t, cfg)
                    cfg = w4a16.default_config(m, n, k)
                    tp = graph_time_us([lambda w=w: w4a16.gemm(x, w, out=out, pdl=True) for w in copies])
                    row = {"shape": shape, "proj": name, "N": n, "K": k, "group": group, "M": m,
                           "bytes": one, "us": best[0], "config": best[1], "us_pdl": tp, "config_pdl": cfg,
                           "pct": 100 * one / (best[0] * 1e-6) / (bw * 1e12),
                           "pct_pdl": 100 * one / (tp * 1e-6) / (bw * 1e12)}
                    tcell = "— | —"
                    if tw is not None:
                        try:
                            tt = graph_time_us([lambda wp=wp, sz=sz: torch.ops.aten._weight_int4pack_mm(x, wp, group, sz)
                                                for wp, sz in tw])
                            row["torch_us"] = tt
                            row["torch_pct"] = 100 * tbytes / (tt * 1e-6) / (bw * 1e12)
                            tcell = f"{tt:.1f} | {row['torch_pct']:.0f}"
                        except Exception as e:  # noqa: BLE001 - reported in the table
                            tcell = f"error: {type(e).__name__} | —"
                    res["rows"].append(row)
                    print(f"| {shape} | {name} | {n}x{k} | {group} | {m} | {one / 2**20:.1f} | {best[0]:.1f} {best[1]} | "
                          f"{row['pct']:.0f} | {tp:.1f} {cfg} | {row['pct_pdl']:.0f} | {tcell} |", flush=True)
                del copies, tw
                torch.cuda.empty_cache()
    if not args.stack:
        return res
    # the peer's projection stack of one step (all layers' 4 projections), M = 1 and 8
    print("\n| shape | M | torch int4 projections of a step, ms | ours (PDL), ms |")
    print("|---|---|---|---|")
    for shape, projs in SHAPES_GEMV.items():
        layers = LAYERS[shape]
        tws, ows = [], []
        for _ in range(layers):
            for name, n, k in projs:
                tws.append((torch_int4_weight(n, k, 128, gen), k))
        for m in (1, 8):
            xs = {k: torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) for _, _, k in projs}
            try:
                tt = graph_time_us([lambda wp=wp, sz=sz, k=k: torch.ops.aten._weight_int4pack_mm(xs[k], wp, 128, sz)
                                    for (wp, sz), k in tws], replays=10) * len(tws) / 1e3
            except Exception as e:  # noqa: BLE001
                tt = float("nan")
                print(f"torch int4 stack failed: {e!r}")
            res.setdefault("stack", []).append({"shape": shape, "M": m, "torch_ms": tt})
            print(f"| {shape} | {m} | {tt:.2f} | (step table) |", flush=True)
        del tws, ows
        torch.cuda.empty_cache()
    return res



def bench_step(args) -> dict:
    from bench_gpu_step import cuda_time, tree_mask      # the same folder: the bf16 step's timers
    from swiftspec_mpi.checkpoints.load import dummy_model
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.gpu import w4a16
    from swiftspec_mpi.gpu.graphs import GraphedModel
    from swiftspec_mpi.network.transformer import chain_mask
    bw = copy_bandwidth(2 << 30) / 1e12
    print(f"copy bandwidth {bw:.2f} TB/s\n")
    ctx = args.context
    res = {"copy_tbs": bw, "rows": []}
    print("| shape (int4 g128) | LM head | GEMV (T,U,E) | weights GB | step GB | floor ms | 1 token ms | 8-node verify ms | "
          "ratio | w=8 expand + top-8 ms | peak mem GB | load s |")
    print("|" + "---|" * 12)
    for shape in args.shapes.split(","):
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model, _ = dummy_model(shape, SingleComm(), ctx + 128, torch.bfloat16, "cuda", quant="int4")
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        pre = torch.randint(0, 4000, (ctx,), device="cuda")
        model.forward(pre, torch.arange(ctx, device="cuda"), 0, chain_mask(0, ctx).cuda())
        for cfg, head in [(c, h) for h in args.heads for c in args.configs]:
            if head == "int4" and not isinstance(model.head, w4a16.W4A16Weight):
                model.quantize_head()           # --head-bits 4 (from here on, for this shape)
            w4a16.set_default(cfg)              # the graphs below capture this GEMV variant (None: the rule)
            gm = GraphedModel(model)
            r = {"shape": shape, "config": cfg or "rule", "head": head, "weights_gb": model.weight_bytes() / 1e9,
                 "step_gb": model.step_read_bytes() / 1e9}
            r["floor_ms"] = r["step_gb"] * 1e9 / (bw * 1e12) * 1e3
            for n in (1, 8):
                toks = torch.randint(0, 4000, (n,))
                pos = torch.arange(ctx, ctx + n)
                mask = tree_mask(ctx, n)
                r[f"argmax_{n}"] = cuda_time(lambda: gm.forward_argmax(toks, pos, ctx, mask), iters=60)
                if n == 8:
                    r["topk_8"] = cuda_time(lambda: gm.forward_topk_logprobs(toks, pos, ctx, mask, 8), iters=60)
            r["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            r["load_s"] = load_s
            res["rows"].append(r)
            print(f"| {shape} | {head} | {cfg or 'rule'} | {r['weights_gb']:.2f} | {r['step_gb']:.2f} | {r['floor_ms']:.2f} | "
                  f"{r['argmax_1']:.3f} | {r['argmax_8']:.3f} | {r['argmax_8'] / r['argmax_1']:.2f} | {r['topk_8']:.3f} | "
                  f"{r['peak_gb']:.1f} | {load_s:.1f} |", flush=True)
            del gm
        w4a16.set_default(None)
        del model
        torch.cuda.empty_cache()
    if args.peer:
        import bench_gptfast_int4 as peer    # same folder: gpt-fast-style int4 step, same process
        print("\nThe peer in the same run (gpt-fast-style, torch.compile, tinygemm int4, LM head int4):\n")
        peer.header()
        res["peer"] = peer.run(args.peer.split(","), ctx)
    return res

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("gemv", "step"))
    ap.add_argument("--m", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 16, 32])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.2-3b,llama-3-8b,llama-3-70b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--configs", type=lambda s: [None if c == "rule" else tuple(int(v) for v in c.split("/"))
                                                 for c in s.split(",")],
                    default=[None, (1, 2, 0)], help="GEMV variants T/U/E to time the step with ('rule': "
                                                    "w4a16.default_config's choice per shape)")
    ap.add_argument("--heads", type=lambda s: s.split(","), default=["bf16", "int4"],
                    help="step: LM heads to time the step with, in this order (bf16: as loaded; int4: "
                         "Transformer.quantize_head, as --head-bits 4)")
    ap.add_argument("--peer", default="", help="step: shapes to time the gpt-fast-style int4 step at "
                                              "afterwards, in the same process (bench_gptfast_int4.py)")
    ap.add_argument("--no-stack", dest="stack", action="store_false",
                    help="gemv: leave out torch's projection stack of a whole step")
    ap.add_argument("--json")
    args = ap.parse_args()
    res = bench_gemv(args) if args.what == "gemv" else bench_step(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

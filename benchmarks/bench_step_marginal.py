"""What each kernel kind costs inside the decode step's PDL chain: the step captured as a CUDA
graph with that kind's launches left out (its outputs then hold stale values: the timing is right,
the numbers are not), timed alternately with the whole step. Unlike bench_step_breakdown.py, which
times each kind alone, this measures what the chain would gain without it, overlaps included.

    python benchmarks/bench_step_marginal.py [--shapes llama-3-8b,llama-3.2-1b] [--quant int4]

Kinds: the RMSNorms (add_rmsnorm: two a layer and the final one), RoPE + KV write, tree
attention, the three together, and every projection (the W4A16 GEMVs with --quant int4, including
the LM head packed 4-bit, or the bf16 GEMMs). Random weights, a 1024-token prefix, wall ms a step
with the argmax read (median of alternated blocks).
"""
from __future__ import annotations

import argparse
import contextlib

import torch

from bench_gpu_step import cuda_time_alternating, tree_mask   # same folder


@contextlib.contextmanager
def left_out(names):
    """Replace each (module, function) by one that launches nothing and returns its `out`."""
    saved = [(mod, name, getattr(mod, name)) for mod, name in names]

    def skip(*args, **kw):
        out = kw.get("out")
        if out is None and len(args) >= 2 and hasattr(args[1], "shape"):      # a projection
            out = torch.empty(args[0].shape[0], args[1].shape[0], dtype=torch.bfloat16, device="cuda")
        return out
    for mod, name in names:
        setattr(mod, name, skip)
    try:
        yield
    finally:
        for mod, name, f in saved:
            setattr(mod, name, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-3-8b,llama-3.2-1b")
    ap.add_argument("--quant", default="int4", choices=("int4", "none"))
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args()
    from swiftspec_mpi.checkpoints.load import dummy_model
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.gpu import fused_ops, kernels, w4a16
    from swiftspec_mpi.gpu.graphs import GraphedModel
    from swiftspec_mpi.network.transformer import chain_mask

    projections = ([(w4a16, "gemm"), (w4a16, "gemm_swiglu")] if a.quant == "int4" else
                   [(kernels, "gemm_rowparallel"), (kernels, "gemm_qkv_rope"), (kernels, "gemm_swiglu")])
    kinds = {
        "whole step": [],
        "- RMSNorms": [(fused_ops, "add_rmsnorm")],
        "- RoPE + KV write": [(fused_ops, "rope_kv_write")],
        "- attention": [(kernels, "tree_attention")],
        "- the three": [(fused_ops, "add_rmsnorm"), (fused_ops, "rope_kv_write"), (kernels, "tree_attention")],
        "- projections": projections,
    }
    ctx = a.context
    print("| shape | tokens | step without | ms | vs whole step |")
    print("|---|---:|---|---:|---:|")
    for shape in a.shapes.split(","):
        model, _ = dummy_model(shape, SingleComm(), ctx + 128, torch.bfloat16, "cuda", quant=a.quant)
        if a.quant == "int4":
            model.quantize_head()
        pre = torch.randint(0, 4000, (ctx,), device="cuda")
        model.forward(pre, torch.arange(ctx, device="cuda"), 0, chain_mask(0, ctx).cuda())
        fns, graphs = {}, []
        for n in (1, 8):
            toks, pos, mask = torch.randint(0, 4000, (n,)), torch.arange(ctx, ctx + n), tree_mask(ctx, n)
            for kind, names in kinds.items():
                gm = GraphedModel(model)
                graphs.append(gm)
                with left_out(names):                   # captured without the kind's launches
                    gm.forward_argmax(toks, pos, ctx, mask)
                torch.cuda.synchronize()
                fns[(n, kind)] = lambda gm=gm, t=toks, p=pos, m=mask: gm.forward_argmax(t, p, ctx, m)
        res = cuda_time_alternating(fns, iters=120, blocks=6)
        for n in (1, 8):
            whole = res[(n, "whole step")]
            for kind in kinds:
                t = res[(n, kind)]
                print(f"| {shape} | {n} | {kind} | {t:.3f} | {t - whole:+.3f} |", flush=True)
        del graphs, fns, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

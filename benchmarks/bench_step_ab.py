"""The persistent step kernel against another version of its source, in one process: both compiled
(cuda/step_kernel.cu and cuda/<--base>.cu, e.g. a commit's copy), bound to the same model and
timed as bench_step_kernel.py times it (graph replays with the argmax readout, the inputs' copy and
the sync), the chain in the same run; then the largest |new - base| of the logits (0 where a change
keeps the arithmetic) and new against the chain. Random weights at real shapes, batch 1.

    git show REV:cuda/step_kernel.cu > cuda/step_kernel_base.cu
    python benchmarks/bench_step_ab.py [--rows 1b-int4,8b-int4] [--base step_kernel_base] [--context 1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_step import cuda_time_alternating, tree_mask  # noqa: E402
from bench_step_kernel import prefilled_model  # noqa: E402

BASE_DEFINE = "-DSTEP_AB_BASE=1"       # marks the base's compile (its own CuPy cache key too)


def use_base_source(base: str) -> None:
    """StepKernels whose variant carries BASE_DEFINE compile cuda/<base>.cu instead."""
    import swiftspec_mpi.gpu.step_kernel as skm
    function = skm.function

    def patched(src, variant, *a, **k):
        return function(base if BASE_DEFINE in variant else src, variant, *a, **k)
    skm.function = patched


def bench_row(name: str, context: int) -> None:
    from swiftspec_mpi.gpu.graphs import GraphedModel
    from swiftspec_mpi.gpu.step_kernel import StepKernel
    model = prefilled_model(name, context)
    sks = {"new": StepKernel(model), "base": StepKernel(model)}
    sks["base"].variant += " " + BASE_DEFINE
    graphs = {k: GraphedModel(model) for k in ("chain", "new", "base")}
    fns, diffs = {}, []
    for n in (1, 8):
        toks, pos, mask = torch.randint(0, 4000, (n,)), torch.arange(context, context + n), tree_mask(context, n)
        outs = {}
        for k, g in graphs.items():
            model.step_kernel = sks.get(k)                   # the graph captures the path
            outs[k] = g.forward(toks, pos, context, mask).float().clone()
            fns[f"{k} {n}"] = (lambda g=g, toks=toks, pos=pos, mask=mask: g.forward_argmax(toks, pos, context, mask))
            fns[f"{k} {n}"]()
        diffs.append(f"N = {n}: max |new - base| {(outs['new'] - outs['base']).abs().max().item():.2e}, "
                     f"new vs chain {((outs['new'] - outs['chain']).abs().max() / outs['chain'].abs().max()).item():.3f}")
    for sk in sks.values():
        sk.check()
    t = cuda_time_alternating(fns, iters=120, blocks=6)
    for sk in sks.values():
        sk.check()
    print(f"| {name} | " + " | ".join(f"{t[f'{k} {n}']:.3f}" for n in (1, 8) for k in ("chain", "base", "new"))
          + f" | {'; '.join(diffs)} |", flush=True)
    del graphs, sks, model
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1b-int4,8b-int4")
    ap.add_argument("--base", default="step_kernel_base", help="cuda/<BASE>.cu: the version to compare with")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    use_base_source(args.base)
    print(f"{torch.cuda.get_device_name()}, context {args.context}; wall ms a step (graph replay, argmax read)\n")
    print("| row | chain 1 tok | base 1 tok | new 1 tok | chain 8-node | base 8-node | new 8-node | logits |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name in args.rows.split(","):
        bench_row(name, args.context)


if __name__ == "__main__":
    main()

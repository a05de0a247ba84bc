"""The persistent step kernel against other versions of its source, in one process: all compiled
(cuda/step_kernel.cu and each cuda/<--base>.cu, e.g. a commit's copy), bound to the same model and
timed as bench_step_kernel.py times it (graph replays with the argmax readout, the inputs' copy and
the sync, alternating blocks), the chain in the same run; then the largest |new - base| of the
logits for each base (0 where a change keeps the arithmetic) and new against the chain. Random
weights at real shapes, batch 1.

    git show REV:cuda/step_kernel.cu > cuda/step_kernel_base.cu
    python benchmarks/bench_step_ab.py [--rows 1b-int4,8b-int4] [--base step_kernel_base[,other]] [--context 1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_step import cuda_time_alternating  # noqa: E402
from bench_step_kernel import graphed_paths, prefilled_model  # noqa: E402

BASE_DEFINE = "-DSTEP_AB_BASE="        # + the base's index: marks its compile (its own CuPy cache key too)


def use_base_sources(bases: list[str]) -> None:
    """StepKernels whose variant carries BASE_DEFINE + i compile cuda/<bases[i]>.cu instead."""
    import swiftspec_mpi.gpu.step_kernel as skm
    function = skm.function

    def patched(src, variant, *a, **k):
        for i, base in enumerate(bases):
            if f"{BASE_DEFINE}{i}" in variant.split():
                src = base
        return function(src, variant, *a, **k)
    skm.function = patched


def paths_of(bases: list[str]) -> list[str]:
    """The timed paths, in the table's column order: the chain, each base, the new kernel."""
    return ["chain", *bases, "new"]


def bench_row(name: str, context: int, bases: list[str]) -> None:
    from swiftspec_mpi.gpu.step_kernel import StepKernel
    model = prefilled_model(name, context)
    sks = {"new": StepKernel(model)}
    for i, base in enumerate(bases):
        sks[base] = StepKernel(model)
        sks[base].variant += f" {BASE_DEFINE}{i}"
    fns, out, _ = graphed_paths(model, context, {"chain": None, **sks})
    diffs = []
    for n in (1, 8):
        new = out[f"new {n}"]
        diffs.append(f"N = {n}: " + ", ".join(f"max |new - {b}| {(new - out[f'{b} {n}']).abs().max().item():.2e}"
                                              for b in bases)
                     + f", new vs chain {((new - out[f'chain {n}']).abs().max() / out[f'chain {n}'].abs().max()).item():.3f}")
    for sk in sks.values():
        sk.check()
    t = cuda_time_alternating(fns, iters=120, blocks=6)
    for sk in sks.values():
        sk.check()
    print(f"| {name} | " + " | ".join(f"{t[f'{k}_argmax_{n}']:.3f}" for n in (1, 8) for k in paths_of(bases))
          + f" | {'; '.join(diffs)} |", flush=True)
    del fns, sks, model
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1b-int4,8b-int4")
    ap.add_argument("--base", default="step_kernel_base",
                    help="cuda/<BASE>.cu, comma-separated: the versions to compare with")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    bases = args.base.split(",")
    use_base_sources(bases)
    paths = paths_of(bases)
    print(f"{torch.cuda.get_device_name()}, context {args.context}; wall ms a step (graph replay, argmax read)\n")
    print("| row | " + " | ".join(f"{k} {n}" for n in ("1 tok", "8-node") for k in paths) + " | logits |")
    print("|---|" + "---:|" * (2 * len(paths)) + "---|")
    for name in args.rows.split(","):
        bench_row(name, args.context, bases)


if __name__ == "__main__":
    main()

"""Compile-time variants of the persistent step kernel side by side in one process: each variant is
the kernel compiled with its own defines (launch.module's variant, e.g. "-DSTEP_HEAD_DIM=0" for
both head dims' attention), all bound to the same model and inputs. Per variant and N: wall ms a
step with the sync (eager launches, timed in alternating blocks), the same with every counter wait
removed from the instruction table ("no waits": what streaming and on-chip work alone cost, the
outputs garbage), and at the first N the mean µs of each phase an instruction with no waits
(gpu/step_timeline.phases). Logits of each variant against the first: max relative difference.
Random weights at real shapes (bench_step_kernel.ROWS), batch 1, a `--context`-token prefix.

    python benchmarks/bench_step_variants.py [--rows 1b-int4,1b-bf16] [--n 1,8] [--context 1024]
        [--variants "model=,both=-DSTEP_HEAD_DIM=0"]

A variant is NAME=DEFINES; empty DEFINES = the build the engine uses (gpu/step_kernel.compile_variant).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_step import cuda_time_alternating  # noqa: E402
from bench_step_kernel import kernel_inputs, prefilled_model  # noqa: E402


def variant_kernel(model, defines: str):
    """A StepKernel whose launches compile and run with `defines` ("" = the engine's build)."""
    from swiftspec_mpi.gpu.step_kernel import StepKernel
    sk = StepKernel(model)
    if defines:
        sk.variant = defines
    return sk


def bench_row(name: str, ns: list[int], context: int, variants: list[tuple[str, str]]) -> None:
    from swiftspec_mpi.gpu import step_timeline
    model = prefilled_model(name, context)
    kernels = {v: variant_kernel(model, d) for v, d in variants}
    for n in ns:
        toks, pos, mask, nv = kernel_inputs(model, context, n)
        steps = {v: (lambda sk=sk: sk.forward(toks, pos, pos, mask, nv)) for v, sk in kernels.items()}
        outs = {v: f().float().clone() for v, f in steps.items()}   # the buffers are reused
        for sk in kernels.values():
            sk.check()
        ref = next(iter(outs.values()))
        t = cuda_time_alternating(steps)
        for sk in kernels.values():
            sk.state(n).instr[:, 4] = -1                 # every wait gone
        t_free = cuda_time_alternating(steps)
        for v, sk in kernels.items():
            line = (f"{name} N = {n} {v}: {t[v]:.3f} ms, no waits {t_free[v]:.3f} ms, logits rel diff "
                    f"{((outs[v] - ref).abs().max() / ref.abs().max()).item():.1e}")
            if n == ns[0]:
                st = sk.state(n)
                tl = sk.record_timeline(n)
                steps[v]()
                torch.cuda.synchronize()
                ph = step_timeline.phases(st.schedule, tl.cpu().numpy())
                sk.record_timeline(n, on=False)
                line += "\n  " + "; ".join(f"{stage}: " + " / ".join(
                    f"{d[c]:.1f}" for c in step_timeline.PHASES["attention" if stage == "attention" else "gemv"])
                    for stage, d in ph.items())
            sk.repair(n)
            sk.check()
            print(line, flush=True)
    del kernels, model
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1b-int4,1b-bf16")
    ap.add_argument("--n", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variants", default="model=,both=-DSTEP_HEAD_DIM=0")
    args = ap.parse_args()
    from swiftspec_mpi.gpu import step_timeline
    variants = [tuple(v.split("=", 1)) for v in args.variants.split(",")]
    print(f"{torch.cuda.get_device_name()}, context {args.context}; phases a GEMV instruction (µs, no waits): "
          f"{' / '.join(step_timeline.PHASES['gemv'])}; attention: {' / '.join(step_timeline.PHASES['attention'])}")
    for name in args.rows.split(","):
        bench_row(name, [int(x) for x in args.n.split(",")], args.context, variants)


if __name__ == "__main__":
    main()

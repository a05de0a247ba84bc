"""Where the persistent step kernel's time goes (gpu/step_timeline.py): per stage of the schedule,
the span, the signal-to-start gap before it, how much of the grid it keeps busy and the weight
GB/s during it; beside it, the same step with every counter wait removed from the instruction
table ("no waits": each block runs its list back to back, so the outputs are garbage but the time
is what streaming and compute alone cost; eager launches, with the sync). Random weights at real shapes, batch 1.

    python benchmarks/bench_step_timeline.py [--rows 1b-bf16,1b-int4,8b-int4] [--n 1,8] [--warps 8,16]
        [--context 1024] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_step import copy_bandwidth, cuda_time  # noqa: E402
from bench_step_kernel import kernel_inputs, prefilled_model  # noqa: E402


def op_bytes(model) -> list[int]:
    """Weight bytes per op of the step kernel's op table (4 a layer, then the head)."""
    def nb(w):
        return w.nbytes() if hasattr(w, "nbytes") and callable(w.nbytes) else w.numel() * w.element_size()
    out = []
    for lay in model.layers:
        out += [nb(lay.wqkv), nb(lay.wo), nb(lay.wgu), nb(lay.wd)]
    return out + [nb(model.head)]


def median_phases(sk, st, n, step, runs: int = 5) -> dict:
    """The phases (step_timeline.phases) of the launch with the median total of `runs`."""
    from swiftspec_mpi.gpu import step_timeline
    out = []
    for _ in range(runs):
        t = sk.record_timeline(n)
        step()
        torch.cuda.synchronize()
        tl = t.cpu().numpy()
        out.append((int(tl[:, 2].max() - tl[:, 0].min()), step_timeline.phases(st.schedule, tl)))
    sk.record_timeline(n, on=False)
    out.sort(key=lambda r: r[0])
    return out[len(out) // 2][1]


def bench_row(name: str, ns: list[int], context: int, bw: float, warps: list[int]) -> dict:
    from swiftspec_mpi.gpu import step_timeline
    from swiftspec_mpi.gpu.step_kernel import StepKernel
    model = prefilled_model(name, context)
    kernels = {w: StepKernel(model, warps=w) for w in warps}
    ob = op_bytes(model)
    floor_ms = model.step_read_bytes() / (bw * 1e12) * 1e3
    r = {"row": name, "floor_ms": floor_ms, "n": {}}
    for n in ns:
        toks, pos, mask, nv = kernel_inputs(model, context, n)
        slots = pos.clone()

        ref = None
        for w, sk in kernels.items():
            def pers(sk=sk):
                return sk.forward(toks, pos, slots, mask, nv)

            out = pers().clone()
            sk.check()
            ref = out if ref is None else ref
            diff = ((out - ref).abs().max() / ref.abs().max()).item()
            t_pers = cuda_time(pers, iters=40)
            st = sk.state(n)
            st.instr[:, 4] = -1                  # every wait gone
            t_free = cuda_time(pers, iters=40)
            free_phases = median_phases(sk, st, n, pers)
            sk.repair(n)
            sk.check()
            runs = []
            for _ in range(7):
                t = sk.record_timeline(n)
                pers()
                torch.cuda.synchronize()
                tl = t.cpu().numpy()
                runs.append((step_timeline.summarize(st.schedule, tl, ob), step_timeline.phases(st.schedule, tl)))
            sk.record_timeline(n, on=False)
            sk.check()
            runs.sort(key=lambda s: s[0]["total_us"])
            summ, ph = runs[len(runs) // 2]
            r["n"][f"{n}/{w}"] = {"warps": w, "persistent_ms": t_pers, "no_waits_ms": t_free, "timeline": summ,
                                  "rel_diff_to_first": diff}
            print(f"\n### {name}, N = {n}, {w} compute warps: persistent {t_pers:.3f} ms, with no waits "
                  f"{t_free:.3f} ms, floor {floor_ms:.3f} ms, blocks {sk.blocks}, logits rel diff to "
                  f"{next(iter(kernels))} warps {diff:.2e}\n")
            print(step_timeline.format_table(summ))
            print("\nInside the instructions (µs, mean per instruction):")
            print(step_timeline.format_phases(ph))
            print("\nThe same with no waits:")
            print(step_timeline.format_phases(free_phases), flush=True)
            r["n"][f"{n}/{w}"].update(phases=ph, phases_no_waits=free_phases)
    del kernels, model
    torch.cuda.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1b-bf16,1b-int4,8b-int4")
    ap.add_argument("--n", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--warps", default="8", help="compute warps a block, each timed (8, 16)")
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw:.2f} TB/s, context {args.context}")
    res = {"copy_tbs": bw, "rows": [bench_row(name, [int(x) for x in args.n.split(",")], args.context, bw,
                                              [int(w) for w in args.warps.split(",")])
                                    for name in args.rows.split(",")]}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))


if __name__ == "__main__":
    main()

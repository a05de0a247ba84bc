"""The persistent step kernel (one launch a step, gpu/step_kernel.py) against the chain (the PDL
chain of fused kernels in one CUDA graph, the default before it) and the gpt-fast int4 peer, in
the same process: random weights at real shapes, batch 1, a `--context`-token prefix.

Per row, wall ms per step with the sync and the readout the engine uses (GraphedModel: the
inputs' copy, the step, the read reduced inside the graph, its copy to the host, one sync):
one token and an 8-node verify tree read as argmax, and (draft rows) the w = 8 leaf expansion
read as top-8 log-probabilities. Both paths' graphs are captured on the same model and timed in
alternating blocks. "floor" = the bytes a step streams (Transformer.step_read_bytes) over the
device's copy bandwidth. "max rel diff" = max |persistent - chain| / max |chain| of the logits.
The step kernel's watchdog is checked after every timed block (a stuck schedule raises
StepKernelError instead of hanging).

    python benchmarks/bench_step_kernel.py [--rows 1b-bf16,8b-bf16,1b-int4,8b-int4,70b-int4]
        [--context 1024] [--peer llama-3.2-1b,llama-3-8b,llama-3-70b] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_step import copy_bandwidth, cuda_time_alternating, tree_mask  # noqa: E402

ROWS = {   # name: (shape, quant, LM head 4-bit, draft row: time the w = 8 expansion + top-8)
    "1b-bf16": ("llama-3.2-1b", "none", False, True),
    "8b-bf16": ("llama-3-8b", "none", False, False),
    "1b-int4": ("llama-3.2-1b", "int4", True, True),
    "8b-int4": ("llama-3-8b", "int4", True, False),
    "70b-int4": ("llama-3-70b", "int4", True, False),
}
TOPK = 8


def prefilled_model(name: str, context: int):
    """The ROWS[name] model with random weights on the GPU (its head packed to 4 bits where the row
    says so), with slots for `context` + 128 tokens and a `context`-token prefix in its KV cache."""
    from swiftspec_mpi.checkpoints.load import dummy_model
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.network.transformer import chain_mask
    shape, quant, head4, _ = ROWS[name]
    model, _ = dummy_model(shape, SingleComm(), context + 128, torch.bfloat16, "cuda", quant=quant)
    if head4:
        model.quantize_head()
    pre = torch.randint(0, 4000, (context,), device="cuda")
    model.forward(pre, torch.arange(context, device="cuda"), 0, chain_mask(0, context).cuda())
    torch.cuda.synchronize()
    return model


def kernel_inputs(model, context: int, n: int):
    """StepKernel.forward's inputs for an n-node tree after the prefix, on the GPU: tokens [n],
    positions [n] (also the write slots), mask bool [n, max_slots], n_valid int32 [1]."""
    toks = torch.randint(0, 4000, (n,), device="cuda")
    pos = torch.arange(context, context + n, device="cuda")
    mask = torch.zeros(n, model.max_slots, dtype=torch.bool, device="cuda")
    mask[:, :context + n] = tree_mask(context, n).cuda()
    nv = torch.tensor([context + n], dtype=torch.int32, device="cuda")
    return toks, pos, mask, nv


def graphed_paths(model, context: int, kernels: dict, topk: bool = False) -> tuple[dict, dict, int]:
    """One GraphedModel per path of `kernels` (name -> StepKernel, or None for the chain), each
    captured with its path on `model`, for one token and an 8-node tree after the prefix. Returns
    (fns, logits, late captures): fns["<name>_argmax_<n>"] (and, with topk, "<name>_topk_8": the w = 8 expansion's
    top-8 log-probabilities) replay the step with its readout, each run once; logits["<name> <n>"]
    are the eager graph's fp32 logits [n, vocab]."""
    from swiftspec_mpi.gpu.graphs import GraphedModel
    graphs = {k: GraphedModel(model) for k in kernels}
    fns, logits = {}, {}
    for n in (1, 8):
        toks, pos, mask = torch.randint(0, 4000, (n,)), torch.arange(context, context + n), tree_mask(context, n)
        for k, g in graphs.items():
            model.step_kernel = kernels[k]                         # the graph captures the path
            logits[f"{k} {n}"] = g.forward(toks, pos, context, mask).float().clone()
            fns[f"{k}_argmax_{n}"] = (lambda g=g, toks=toks, pos=pos, mask=mask:
                                      g.forward_argmax(toks, pos, context, mask))
            fns[f"{k}_argmax_{n}"]()
            if topk and n == 8:
                fns[f"{k}_topk_{n}"] = (lambda g=g, toks=toks, pos=pos, mask=mask:
                                        g.forward_topk_logprobs(toks, pos, context, mask, TOPK))
                fns[f"{k}_topk_{n}"]()
    model.step_kernel = None
    return fns, logits, sum(g.late_captures for g in graphs.values())


def bench_row(name: str, context: int, bw: float) -> dict:
    from swiftspec_mpi.gpu.step_kernel import StepKernel
    shape, quant, head4, draft = ROWS[name]
    t0 = time.perf_counter()
    model = prefilled_model(name, context)
    r = {"row": name, "shape": shape, "quant": quant, "head": "int4" if head4 else "bf16",
         "step_gb": model.step_read_bytes() / 1e9, "load_s": time.perf_counter() - t0}
    r["floor_ms"] = r["step_gb"] * 1e9 / (bw * 1e12) * 1e3
    sk = StepKernel(model)
    fns, logits, r["late_captures"] = graphed_paths(model, context, {"chain": None, "persistent": sk}, topk=draft)
    sk.check()
    for n in (1, 8):
        ref, got = logits[f"chain {n}"], logits[f"persistent {n}"]
        r[f"rel_diff_{n}"] = ((got - ref).abs().max() / ref.abs().max()).item()
        r[f"same_argmax_{n}"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    r.update(cuda_time_alternating(fns, iters=120, blocks=6))
    sk.check()
    del fns, sk, model
    torch.cuda.empty_cache()
    return r


def print_row(r: dict) -> None:
    c1, p1 = r["chain_argmax_1"], r["persistent_argmax_1"]
    c8, p8 = r["chain_argmax_8"], r["persistent_argmax_8"]
    top = (f"{r['chain_topk_8']:.3f} | {r['persistent_topk_8']:.3f}" if "chain_topk_8" in r else "- | -")
    print(f"| {r['shape']} {r['quant']} (head {r['head']}) | {r['step_gb']:.2f} | {r['floor_ms']:.3f} | "
          f"{c1:.3f} | {p1:.3f} | {c1 / p1:.2f}x | {r['floor_ms'] / p1 * 100:.0f} % | {c8:.3f} | {p8:.3f} | "
          f"{p8 / p1:.2f} | {top} | {max(r['rel_diff_1'], r['rel_diff_8']):.4f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--peer", default="", help="shapes of the gpt-fast int4 peer timed after (same process)")
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw:.2f} TB/s, context {args.context}\n")
    print("| row | step GB | floor ms | chain 1 tok ms | persistent 1 tok ms | speed-up | % of floor | "
          "chain 8-node verify ms | persistent 8-node ms | verify / 1 tok | chain w=8 + top-8 ms | "
          "persistent w=8 + top-8 ms | max rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    res = {"copy_tbs": bw, "context": args.context, "rows": []}
    for name in args.rows.split(","):
        r = bench_row(name, args.context, bw)
        res["rows"].append(r)
        print_row(r)
    if args.peer:
        import bench_gptfast_int4 as peer
        print("\nThe gpt-fast int4 peer in the same run:\n")
        peer.header()
        res["peer"] = peer.run(args.peer.split(","), args.context)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""What the engine reads of a step's logits, fused (fused_ops.logits_topk: one pass) vs torch
(log_softmax + topk, or argmax), on one GPU. Prints two Markdown tables:

  1. the read alone: CUDA graph of the read of fp32 logits [N, V] (V = 128256, Llama-3's vocab),
     median µs per call;
  2. the whole step with its read inside the graph (GraphedModel.forward_topk_logprobs / _argmax
     of a random model at a real shape, context 1k), captured once with each read and timed in
     alternating blocks in the same process (wall ms per step incl. the sync); same result: the
     same argmax tokens, or top-8 log-probs within 1e-4 (ids may order exact ties differently).

    python benchmarks/bench_logits_topk.py [--shapes llama-3.2-1b,llama-3-8b]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from bench_gpu_step import cuda_time_alternating       # same folder
from bench_kernels_gpu import graph_time_us


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args()
    from swiftspec_mpi.checkpoints.load import dummy_model
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.gpu import graphs as cuda_graphs, fused_ops
    from swiftspec_mpi.gpu.graphs import GraphedModel
    from swiftspec_mpi.network.transformer import chain_mask

    V = 128256
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| read of fp32 logits [N, 128256] | N | torch (µs) | fused_ops.logits_topk (µs) | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for n in (1, 8):
        x = torch.randn(n, V, device="cuda") * 4
        for name, k, torch_fn in (("top-8 log-probs", 8, lambda: torch.topk(torch.log_softmax(x, -1), 8, -1)),
                                  ("argmax", 1, lambda: torch.argmax(x, -1))):
            t_torch = graph_time_us([torch_fn], 200)
            t_fused = graph_time_us([lambda: fused_ops.logits_topk(x, k, logprobs=k > 1)], 200)
            print(f"| {name} | {n} | {t_torch:.2f} | {t_fused:.2f} | {t_torch / t_fused:.1f}x |", flush=True)

    print("\n| step with the read in the graph | N | torch read (ms) | fused read (ms) | saved (ms) | same result |")
    print("|---|---:|---:|---:|---:|---|")
    L = a.context
    for shape in a.shapes.split(","):
        model, _ = dummy_model(shape, SingleComm(), L + 128, torch.bfloat16, "cuda")
        model.forward(torch.randint(0, 1000, (L,), device="cuda"), torch.arange(L, device="cuda"), 0,
                      chain_mask(0, L).to("cuda"))
        g = {True: GraphedModel(model), False: GraphedModel(model)}
        for n in (1, 8):
            toks, pos, mask = torch.randint(0, 1000, (n,)), torch.arange(L, L + n), chain_mask(L, n)
            for what in ("topk", "argmax"):
                outs = {}
                for fused in (True, False):            # capture each graph with its read
                    cuda_graphs.FUSED_READS = fused
                    try:
                        outs[fused] = (g[fused].forward_topk_logprobs(toks, pos, L, mask, 8) if what == "topk"
                                       else g[fused].forward_argmax(toks, pos, L, mask))
                    finally:
                        cuda_graphs.FUSED_READS = True
                # top-k: ids may differ in order where logits tie exactly (random bf16 weights make
                # many), so compare the log-probs; argmax: both take the first maximum
                same = (bool(np.allclose(outs[True][1], outs[False][1], atol=1e-4)) if what == "topk"
                        else bool((outs[True] == outs[False]).all()))
                if what == "topk":
                    fns = {f: (lambda f=f: g[f].forward_topk_logprobs(toks, pos, L, mask, 8)) for f in (True, False)}
                else:
                    fns = {f: (lambda f=f: g[f].forward_argmax(toks, pos, L, mask)) for f in (True, False)}
                r = cuda_time_alternating({"fused": fns[True], "torch": fns[False]}, iters=100, blocks=10)
                label = "top-8 log-probs" if what == "topk" else "argmax"
                print(f"| {shape}, {label} | {n} | {r['torch']:.3f} | {r['fused']:.3f} | {r['torch'] - r['fused']:.3f} | "
                      f"{same} |", flush=True)
        g = model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

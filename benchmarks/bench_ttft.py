"""Time to first token on the GPU: the prompt's forward, and the warm-up that keeps graph
captures out of requests.

    python benchmarks/bench_ttft.py [--shape llama-3-8b] [--lengths 15,64,256,1024,4096] [--bs 16]

One random model at the named shape (bf16), one process. Prints Markdown tables:
  1. warm-up: seconds to capture the graphs a greedy verify loop replays (argmax read-back,
     N = 1 .. bs), as `job.warm_graphs` does before the first request;
  2. per prompt length, wall ms of the prompt's forward (prompt[:-1] into slots 0.., the last
     row's logits; a device sync at the end), median of --reps:
     - "eager, causal": what prefill runs now (`forward_eager(..., causal=True)`: SDPA's causal
       kernel, no mask);
     - "eager, chain mask": the previous path for prompts over 64 tokens (explicit bool mask);
     - "graph at first use": the previous path for prompts up to 64 tokens, a CUDA graph of
       that length captured in the request (a fresh GraphedModel per length, first call timed).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def wall_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--lengths", default="15,64,256,1024,4096")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    from swiftspec_mpi.comm import SingleComm
    from swiftspec_mpi.cuda_graphs import GraphedModel
    from swiftspec_mpi.dummy import dummy_model
    from swiftspec_mpi.model import chain_mask
    lengths = [int(v) for v in a.lengths.split(",")]
    S = max(lengths) + 64
    model, _ = dummy_model(a.shape, SingleComm(), S, torch.bfloat16, "cuda")
    print(f"{a.shape}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")

    graphed = GraphedModel(model)
    t0 = time.perf_counter()
    per = []
    for n in range(1, a.bs + 1):
        t = time.perf_counter()
        graphed.forward_argmax(torch.zeros(n, dtype=torch.long), torch.arange(n), 0, chain_mask(0, n))
        torch.cuda.synchronize()
        per.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    print(f"\n| warm-up: graphs captured | seconds | per graph, ms (min / median / max) |\n|---:|---:|---|")
    print(f"| {a.bs} (argmax, N = 1..{a.bs}) | {total:.2f} | {min(per) * 1e3:.1f} / "
          f"{statistics.median(per) * 1e3:.1f} / {max(per) * 1e3:.1f} |")

    for n in (16, 128):          # as job.warm_graphs: the eager kernels loaded before timing
        graphed.forward_eager(torch.zeros(n, dtype=torch.long), torch.arange(n), 0, None,
                              logits_rows=torch.tensor([n - 1]), causal=True)
    print("\n| prompt tokens | eager, causal (now) | eager, chain mask | graph at first use (before, <= 64) |")
    print("|---:|---:|---:|---:|")
    for L in lengths:
        n = L - 1
        toks = torch.randint(0, 1000, (n,))
        pos = torch.arange(n)
        last = torch.tensor([n - 1])
        causal = wall_ms(lambda: graphed.forward_eager(toks, pos, 0, None, logits_rows=last, causal=True), a.reps)
        mask = chain_mask(0, n)
        chain = wall_ms(lambda: model.forward(toks, pos, 0, mask, logits_rows=last), a.reps)
        lazy = "-"
        if n <= 64:
            fresh = GraphedModel(model)
            lazy = f"{wall_ms(lambda: fresh.forward(toks, pos, 0, mask, logits_rows=last), 1):.1f}"
            del fresh
        print(f"| {L} | {causal:.2f} | {chain:.2f} | {lazy} |", flush=True)


if __name__ == "__main__":
    main()

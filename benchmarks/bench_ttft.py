"""Time to first token on the GPU: the prompt's forward, and the warm-up that keeps graph
captures and first-call costs out of requests.

    python benchmarks/bench_ttft.py [--shape llama-3-8b] [--lengths 15,64,256,1024,4096] [--bs 16]

One random model at the named shape (bf16), one process. Prints Markdown tables:
  1. warm-up, as `cli.loading.warm_graphs` does before the first request: the graphs a greedy verify
     loop replays (argmax read-back, N = 1 .. bs), then per prompt bucket
     (`decoding.prompt_buckets`) a prompt graph (up to cuda_graphs.PROMPT_GRAPH_MAX tokens) or
     one eager forward;
  2. per prompt length, wall ms of the prompt's forward (prompt[:-1] into slots 0.., a device
     sync at the end), the first call (what a request with a new length pays) and the median of
     --reps later calls:
     - "now": `decoding._prefill`, the engine's path: padded to the prompt's bucket, the prompt
       graph of that bucket replayed (eager above PROMPT_GRAPH_MAX);
     - "unpadded eager": the eager causal forward at the exact length (the length's first call
       pays extra);
     - "chain mask": the eager forward with an explicit bool mask (the previous path for prompts
       over 64 tokens), median;
     - "graph at first use": the previous path for prompts up to 64 tokens, a CUDA graph of that
       length captured in the request (a fresh GraphedModel per length, first call).
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
    from swiftspec_mpi.checkpoints.load import dummy_model
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.engine.decoding import _prefill, prompt_bucket, prompt_buckets
    from swiftspec_mpi.gpu.graphs import PROMPT_GRAPH_MAX, GraphedModel
    from swiftspec_mpi.network.transformer import chain_mask
    lengths = [int(v) for v in a.lengths.split(",")]
    S = max(lengths) + 64
    model, _ = dummy_model(a.shape, SingleComm(), S, torch.bfloat16, "cuda")
    print(f"{a.shape}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}, {S} KV slots")

    graphed = GraphedModel(model)
    t0 = time.perf_counter()
    per = []
    for n in range(1, a.bs + 1):
        t = time.perf_counter()
        graphed.forward_argmax(torch.zeros(n, dtype=torch.long), torch.arange(n), 0, chain_mask(0, n))
        torch.cuda.synchronize()
        per.append(time.perf_counter() - t)
    t_graphs = time.perf_counter() - t0
    t0 = time.perf_counter()
    buckets = prompt_buckets(S)
    for n in buckets:                       # as cli.loading.warm_graphs
        if n <= PROMPT_GRAPH_MAX:
            graphed.capture_prompt(n)
        else:
            graphed.forward_prompt([0] * n, n - 1)
    torch.cuda.synchronize()
    t_buckets = time.perf_counter() - t0
    print("\n| warm-up | count | seconds | ms each (min / median / max) |\n|---|---:|---:|---|")
    print(f"| graphs (argmax, N = 1..{a.bs}) | {a.bs} | {t_graphs:.2f} | {min(per) * 1e3:.1f} / "
          f"{statistics.median(per) * 1e3:.1f} / {max(per) * 1e3:.1f} |")
    print(f"| prompt buckets (graphs up to {PROMPT_GRAPH_MAX}, eager above; up to {buckets[-1]}) | "
          f"{len(buckets)} | {t_buckets:.2f} | |")

    print("\n| prompt tokens | bucket | now: first call | now: median | unpadded eager: first call | unpadded eager: median "
          "| chain mask: median | graph at first use (before, <= 64) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for L in lengths:
        n = L - 1
        ids = torch.randint(0, 1000, (L,), generator=gen).tolist()
        toks, pos, last = torch.tensor(ids[:-1]), torch.arange(n), torch.tensor([n - 1])
        now_first = wall_ms(lambda: _prefill(graphed, ids), 1)
        now = wall_ms(lambda: _prefill(graphed, ids), a.reps)
        first = wall_ms(lambda: model.forward(toks, pos, 0, None, logits_rows=last, causal=True), 1)
        causal = wall_ms(lambda: model.forward(toks, pos, 0, None, logits_rows=last, causal=True), a.reps)
        mask = chain_mask(0, n)
        chain = wall_ms(lambda: model.forward(toks, pos, 0, mask, logits_rows=last), a.reps)
        lazy = "-"
        if n <= 64:
            fresh = GraphedModel(model)
            lazy = f"{wall_ms(lambda: fresh.forward(toks, pos, 0, mask, logits_rows=last), 1):.1f}"
            del fresh
        print(f"| {L} | {prompt_bucket(n, S)} | {now_first:.2f} | {now:.2f} | {first:.2f} | {causal:.2f} | "
              f"{chain:.2f} | {lazy} |", flush=True)


if __name__ == "__main__":
    main()

"""Forward time of one model vs the number of new tokens N (the verify tree / draft leaves), at a
fixed context, on this machine: how much a bigger tree costs decides the tree shape to use.

    python benchmarks/bench_step_sizes.py --model qwen2.5-coder-1.5b --dtype float32 --threads 1
"""
from __future__ import annotations

import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="registry name or HF folder")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    from swiftspec_mpi.checkpoints import registry
    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask
    torch.set_num_threads(a.threads)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    model, _ = load_model(registry.resolve_model(a.model), max_slots=a.context + 64, dtype=dt)
    pre = torch.randint(0, 1000, (a.context,))
    model.forward(pre, torch.arange(a.context), 0, chain_mask(0, a.context))
    base = None
    print(f"| {a.model} {a.dtype} {a.threads} thread(s) | N | ms | x N=1 |")
    print("|---|---:|---:|---:|")
    for n in (int(x) for x in a.sizes.split(",")):
        toks = torch.randint(0, 1000, (n,))
        pos = torch.arange(a.context, a.context + n)
        mask = chain_mask(a.context, n)
        times = []
        for _ in range(a.reps):
            t = time.perf_counter()
            model.forward(toks, pos, a.context, mask)
            times.append(time.perf_counter() - t)
        ms = 1e3 * sorted(times)[len(times) // 2]
        base = base or ms
        print(f"| | {n} | {ms:.1f} | {ms / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""The host's share of one decode step on the GPU: what a CUDA-graph step costs beyond the graph.

    python benchmarks/bench_host_overhead.py [--shape llama-3.2-1b] [--context 1024] [--n 1,8]

For each N, on one random model at the named shape, timed in alternating blocks in the same
process (median wall ms per call, each call ending in a host sync; prints a Markdown table):
  replay + sync        the captured step alone (inputs already on the device);
  fill (numpy) ...     GraphedModel.forward as it is: the inputs written into the pinned
                       buffers through numpy views (tokens, positions, slots and the context
                       length in one int64 buffer), two host-to-device copies, the replay; then
                       the argmax launched and read (what greedy decoding did per step);
  fill (torch ops) ... the same through the previous implementation's torch ops (three copy_
                       and an arange into the pinned buffers, a scalar store, three
                       host-to-device copies), kept here as the baseline;
  forward_argmax       the argmax inside the graph (GraphedModel.forward_argmax: what greedy
                       verification does now).
"""
from __future__ import annotations

import argparse
import time

import torch


def timed_alternating(fns: dict, iters: int = 120, blocks: int = 12, warmup: int = 5) -> dict:
    times = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    per = max(1, iters // blocks)
    for _ in range(blocks):
        for k, fn in fns.items():
            for _ in range(per):
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[k].append(time.perf_counter() - t)
    return {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}


def torch_ops_fill(st, tokens, positions, start: int, mask) -> None:
    """The previous GraphedModel.forward's input path, on the same static buffers."""
    n, S = st.n, start + st.n
    st.ints_host[:n].copy_(tokens)
    st.ints_host[n:2 * n].copy_(positions)
    torch.arange(start, S, out=st.ints_host[2 * n:3 * n])
    st.mask_host[:, :S].copy_(mask)
    st.ints_host[3 * n] = S
    st.ints[:3 * n].copy_(st.ints_host[:3 * n], non_blocking=True)
    st.mask[:, :S].copy_(st.mask_host[:, :S], non_blocking=True)
    st.ints[3 * n:].copy_(st.ints_host[3 * n:], non_blocking=True)
    st.graph.replay()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--n", default="1,8")
    a = ap.parse_args()
    from swiftspec_mpi.comm import SingleComm
    from swiftspec_mpi.cuda_graphs import GraphedModel
    from swiftspec_mpi.dummy import dummy_model
    from swiftspec_mpi.model import chain_mask
    L = a.context
    model, _ = dummy_model(a.shape, SingleComm(), L + 128, torch.bfloat16, "cuda")
    model.forward(torch.randint(0, 1000, (L,), device="cuda"), torch.arange(L, device="cuda"), 0,
                  chain_mask(0, L).to("cuda"))
    g = GraphedModel(model)
    print(f"{a.shape}, context {L}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| N | replay + sync | fill (numpy) + replay + argmax read | fill (torch ops) + replay + argmax read "
          "| forward_argmax | host share (numpy fill path) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (int(v) for v in a.n.split(",")):
        toks = torch.randint(0, 1000, (n,))
        pos = torch.arange(L, L + n)
        mask = chain_mask(L, n)
        g.forward(toks, pos, L, mask)
        g.forward_argmax(toks, pos, L, mask)
        st = g.static[(n, None)]
        fns = {
            "replay": st.graph.replay,
            "numpy": lambda: g.forward(toks, pos, L, mask).argmax(-1).cpu(),
            "torch": lambda: (torch_ops_fill(st, toks, pos, L, mask), st.logits.argmax(-1).cpu()),
            "argmax": lambda: g.forward_argmax(toks, pos, L, mask),
        }
        r = timed_alternating(fns)
        print(f"| {n} | {r['replay']:.3f} | {r['numpy']:.3f} | {r['torch']:.3f} | {r['argmax']:.3f} | "
              f"{r['numpy'] - r['replay']:.3f} |", flush=True)


if __name__ == "__main__":
    main()

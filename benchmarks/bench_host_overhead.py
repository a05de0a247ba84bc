"""The host's share of one decode step on the GPU: what a CUDA-graph step costs beyond the graph.

    python benchmarks/bench_host_overhead.py [--shape llama-3.2-1b] [--context 1024] [--n 1,8]

For each N, on one random model at the named shape, timed in alternating blocks in the same
process (median wall ms per call, each call ending in a host sync; prints a Markdown table):
  replay + sync         the captured step alone (the default graph: its input copy included);
  host copies, logits   GraphedModel with the inputs copied from the host before the launch
                        (IN_GRAPH_COPY_MAX = 0: the previous design), forward, then the argmax
                        launched and read (what greedy decoding did per step);
  host copies, argmax   the same graphs with the argmax inside the graph, read by a host-issued
                        copy after the launch;
  in-graph copies       the default: GraphedModel.forward_argmax with the input copy as the
                        graph's first node and the read-back as its last (one launch, one sync).
"""
from __future__ import annotations

import argparse

import torch

from bench_gpu_step import cuda_time_alternating   # same folder


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--n", default="1,8")
    a = ap.parse_args()
    from swiftspec_mpi.checkpoints.load import dummy_model
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.gpu.graphs import GraphedModel
    from swiftspec_mpi.network.transformer import chain_mask
    L = a.context
    model, _ = dummy_model(a.shape, SingleComm(), L + 128, torch.bfloat16, "cuda")
    model.forward(torch.randint(0, 1000, (L,), device="cuda"), torch.arange(L, device="cuda"), 0,
                  chain_mask(0, L).to("cuda"))
    from swiftspec_mpi.gpu import graphs as cuda_graphs
    g_in = GraphedModel(model)                      # the default: copies inside the graph
    g_out = GraphedModel(model)                     # inputs copied from the host (captured below)
    print(f"{a.shape}, context {L}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| N | replay + sync | host copies, logits + argmax read | host copies, argmax in graph "
          "| in-graph copies (forward_argmax) | host share (in-graph copies) |")
    print("|---:|---:|---:|---:|---:|---:|")
    parts = []
    for n in (int(v) for v in a.n.split(",")):
        toks = torch.randint(0, 1000, (n,))
        pos = torch.arange(L, L + n)
        mask = chain_mask(L, n)
        ids = g_in.forward_argmax(toks, pos, L, mask)
        limit = cuda_graphs.IN_GRAPH_COPY_MAX
        cuda_graphs.IN_GRAPH_COPY_MAX = 0
        try:
            g_out.forward(toks, pos, L, mask)
            ids_out = g_out.forward_argmax(toks, pos, L, mask)
        finally:
            cuda_graphs.IN_GRAPH_COPY_MAX = limit
        assert (ids == ids_out).all(), "the two copy paths disagree"
        st = g_in.static[(n, ("argmax",))]
        fns = {
            "replay": st.graph.replay,
            "host_logits": lambda: g_out.forward(toks, pos, L, mask).argmax(-1).cpu(),
            "host_argmax": lambda: g_out.forward_argmax(toks, pos, L, mask),
            "in_graph": lambda: g_in.forward_argmax(toks, pos, L, mask),
        }
        r = cuda_time_alternating(fns, iters=120, blocks=12)
        print(f"| {n} | {r['replay']:.3f} | {r['host_logits']:.3f} | {r['host_argmax']:.3f} | {r['in_graph']:.3f} | "
              f"{r['in_graph'] - r['replay']:.3f} |", flush=True)
        parts.append((n, where_the_host_time_goes(g_in, st, toks, pos, L, mask)))
    print("\nWhere a forward_argmax step's wall time goes (median µs of 300 steps, host clock; device = the "
          "graph between two timing events; launch + wake-up = GPU-start latency + sync wake-up):")
    print("| N | whole forward_argmax | fill (pack inputs) | graph.replay() + event record (CPU) | "
          "wait in sync | read result | device (events) | launch + wake-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, p in parts:
        print(f"| {n} | {p['whole']:.1f} | {p['fill']:.1f} | {p['launch']:.1f} | {p['wait']:.1f} | {p['read']:.1f} | "
              f"{p['device']:.1f} | {p['fill'] + p['launch'] + p['wait'] + p['read'] - p['device']:.1f} |")


def where_the_host_time_goes(g, st, toks, pos, L, mask, steps: int = 300) -> dict:
    """Median µs of each host-side part of GraphedModel.forward_argmax (the same calls, timed one
    by one), of the whole call, and of the graph on the device clock."""
    import statistics
    import time
    t = {k: [] for k in ("fill", "launch", "wait", "read", "whole", "device")}
    for _ in range(steps):
        t0 = time.perf_counter()
        st.fill(toks, pos, L, mask)
        t1 = time.perf_counter()
        st.run(L)
        t2 = time.perf_counter()
        st.done.synchronize()
        t3 = time.perf_counter()
        st.out_host[0].numpy().copy()
        t4 = time.perf_counter()
        for k, a, b in (("fill", t0, t1), ("launch", t1, t2), ("wait", t2, t3), ("read", t3, t4)):
            t[k].append((b - a) * 1e6)
    for _ in range(steps):
        t0 = time.perf_counter()
        g.forward_argmax(toks, pos, L, mask)
        t["whole"].append((time.perf_counter() - t0) * 1e6)
    for _ in range(steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        st.graph.replay()
        e1.record()
        e1.synchronize()
        t["device"].append(e0.elapsed_time(e1) * 1e3)
    return {k: statistics.median(v) for k, v in t.items()}

if __name__ == "__main__":
    main()

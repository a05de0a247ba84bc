"""Microbenchmarks of the token-tree scheduler (swiftspec_mpi._tree), one Python call per op.

Builds a 257-node draft tree the way the engine does (expansions of w=8 leaves with k=8 children
each, committed prefix P=1024), then times each operation with time.perf_counter_ns over many
repetitions and prints the median (and 90th percentile) microseconds per call. Mutating ops run
on a fresh copy of the tree each repetition (the copy is not timed).

    .venv/bin/python benchmarks/bench_scheduler.py [--reps 3000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from swiftspec_mpi._tree import TokenTree, subtree_masks, verify_greedy, verify_sample

W, K, BS, ROOT_POS, TARGET_SIZE = 8, 8, 64, 1024, 257


def topk(rng: np.random.Generator, n: int, vocab: int = 32000):
    """Plausible draft top-k: distinct token ids, sorted log-probabilities (float32)."""
    ids = np.stack([rng.choice(vocab, size=K, replace=False) for _ in range(n)]).astype(np.int64)
    probs = np.sort(rng.dirichlet(np.full(K, 0.3), size=n), axis=1)[:, ::-1] * 0.9
    return ids, np.log(np.maximum(probs, 1e-12)).astype(np.float32)


def build_tree(rng: np.random.Generator) -> TokenTree:
    """select/assign/expand until the tree has TARGET_SIZE nodes (1 + 8 + 3 * 64 + 56)."""
    tree = TokenTree(capacity=1024, max_depth=32)
    tree.reset(1, ROOT_POS)
    while tree.size < TARGET_SIZE:
        room = (TARGET_SIZE - tree.size) // K
        leaves = tree.select_leaves(min(W, room), K)
        tree.assign_slots(leaves, tree.root_pos + tree.num_expanded)
        tree.expand(leaves, *topk(rng, len(leaves)))
    assert tree.size == TARGET_SIZE
    return tree


def time_op(fn, reps: int, setup=None) -> tuple[float, float]:
    """(median, p90) microseconds of fn(state) where state = setup() is built untimed."""
    samples = np.empty(reps)
    for r in range(reps):
        state = setup() if setup is not None else None
        start = time.perf_counter_ns()
        fn(state)
        samples[r] = time.perf_counter_ns() - start
    return float(np.median(samples)) / 1e3, float(np.percentile(samples, 90)) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3000)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    base = build_tree(rng)
    leaves = base.select_leaves(W, K)
    ids, lps = topk(rng, len(leaves))
    first_slot = base.root_pos + base.num_expanded
    assigned = base.copy()
    assigned.assign_slots(leaves, first_slot)
    nodes, parents = base.copy().best_subtree(BS)
    tokens = base.tokens_of(nodes)

    # a verify result the target could send: 3 accepted draft tokens along forwarded nodes, and
    # a bonus equal to a forwarded child, so a subtree (and its KV) survives
    path, node = [], 0
    for _ in range(4):
        kids = [c for c in range(base.size) if base.parent[c] == node and base.expanded[c]]
        if not kids:
            break
        node = kids[0]
        path.append(int(base.token[node]))
    accepted = np.array(path, dtype=np.int64)
    survivors = base.copy()
    survivors.reroot(accepted)

    argmax = np.zeros(len(nodes), np.int64)        # follows the first child of every node
    for i in range(len(nodes) - 1, 0, -1):
        argmax[parents[i]] = tokens[i]
    uniforms = rng.random(len(nodes) + 1)
    vocab_small, vocab_large = 1024, 32000
    probs_small = rng.dirichlet(np.full(vocab_small, 0.1), size=len(nodes)).astype(np.float32)
    probs_large = rng.dirichlet(np.full(vocab_large, 0.1), size=len(nodes)).astype(np.float32)
    sample_path_len = len(verify_sample(tokens, parents, probs_large, uniforms)[0])

    reps = args.reps
    rows = [
        ("reset", time_op(lambda t: t.reset(5, ROOT_POS), reps, base.copy), ""),
        (f"select_leaves(w={W})", time_op(lambda _: base.select_leaves(W, K), reps), ""),
        (f"assign_slots({W} leaves)",
         time_op(lambda t: t.assign_slots(leaves, first_slot), reps, base.copy), ""),
        (f"masks({W} leaves, ncols={first_slot + W})",
         time_op(lambda _: assigned.masks(leaves, first_slot + W), reps), ""),
        (f"expand({W} leaves x k={K})",
         time_op(lambda t: t.expand(leaves, ids, lps), reps, assigned.copy), ""),
        (f"best_subtree(bs={BS})", time_op(lambda t: t.best_subtree(BS), reps, base.copy), ""),
        (f"tokens_of({BS} nodes)", time_op(lambda _: base.tokens_of(nodes), reps), ""),
        (f"reroot({len(accepted) - 1} accepted + bonus)",
         time_op(lambda t: t.reroot(accepted), reps, base.copy),
         f"{survivors.size} nodes survive"),
        (f"subtree_masks(n={BS}, root_pos={ROOT_POS})",
         time_op(lambda _: subtree_masks(parents, ROOT_POS), reps), ""),
        (f"verify_greedy(n={BS})",
         time_op(lambda _: verify_greedy(tokens, parents, argmax), reps), ""),
        (f"verify_sample(n={BS}, V={vocab_small})",
         time_op(lambda _: verify_sample(tokens % vocab_small, parents, probs_small, uniforms),
                 reps), "tokens mod V"),
        (f"verify_sample(n={BS}, V={vocab_large})",
         time_op(lambda _: verify_sample(tokens, parents, probs_large, uniforms), reps),
         f"O(V) per visited node; path length {sample_path_len}"),
        ("(untimed helper) copy", time_op(lambda _: base.copy(), reps), "benchmark setup only"),
    ]
    print(f"# tree: {base.size} nodes, {base.num_expanded} expanded, w={W}, k={K}; "
          f"{reps} reps; {platform.processor() or platform.machine()}, "
          f"numpy {np.__version__}")
    print(f"| operation | median µs | p90 µs | note |")
    print(f"|---|---:|---:|---|")
    for name, (median, p90), note in rows:
        print(f"| {name} | {median:.2f} | {p90:.2f} | {note} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({name: {"median_us": m, "p90_us": p} for name, (m, p), _ in rows}, fh,
                      indent=1)


if __name__ == "__main__":
    main()

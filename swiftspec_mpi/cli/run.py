"""Generate text with speculative decoding on MPI ranks. Every rank of the job runs this:

    mpiexec -n 2 swiftspec run --mode async --draft-ranks 1 --prompt "def fib(n):"
    srun --mpi=pmi2 -n 4 swiftspec run --prompts prompts.jsonl --out run.h5   (MPICH; pmix for Open MPI)
    mpiexec -n 2 swiftspec run --interactive --chat     (a session: prompts typed on rank 0's stdin)

Modes: async (SwiftSpec: draft and verify groups in parallel), sync (serial tree speculation on
one group), ar (plain autoregressive decoding of the target). Rank 0 validates everything before
heavy work and all ranks exit together with its one-line verdict. Output: one HDF5 trace
(docs/trace-format.md), rewritten atomically after every request, so a failed or cancelled job
keeps what it generated; a --serve or --interactive job starts a new file every --trace-rotate
requests or minutes, so its memory and write time stay flat.
"""
from __future__ import annotations

import argparse
import os
import sys

from swiftspec_mpi.core.config import DEFAULT_ASYNC_POLICY, MODES, TREE_SIZES

def add_arguments(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS  # flags not given stay absent (None) so the TOML file can supply them
    m = p.add_argument_group("models")
    m.add_argument("--target", help="target model: HF folder, .gguf file or registry name "
                                    "(default: the embedded Qwen2.5-Coder-1.5B)")
    m.add_argument("--draft", help="draft model: HF folder, .gguf file or registry name (default: the "
                                   "embedded Qwen2.5-Coder-0.5B; with --draft-layers and no --draft: "
                                   "the target's first layers)")
    m.add_argument("--draft-layers", type=int, help="truncate the draft to its first N layers")
    m.add_argument("--load-format", choices=("auto", "dummy"),
                   help="dummy: random weights at the checkpoints' shapes (measures step time only)")
    m.add_argument("--accept-from", metavar="TRACE.h5|MODEL.json",
                   help="with --load-format dummy: the target's choice at each tree node is drawn from "
                        "this acceptance model (a trace of a real pair, or `swiftspec analyze --acceptance-out`), "
                        "seeded by --seed, so trees are accepted as deeply as the real pair's; sync / async "
                        "(an error with ar or real weights); the text is then meaningless")
    m.add_argument("--quant", choices=("auto", "int4", "none"),
                   help="auto (default): a quantized checkpoint runs packed 4-bit, a dense one dense; "
                        "int4: packed 4-bit weights (with --load-format dummy: random ones, group 128); "
                        "none: dequantize a quantized checkpoint to --dtype")
    m.add_argument("--head-bits", type=int, choices=(16, 4),
                   help="16 (default): the LM head as loaded; 4: packed 4-bit at load (round-to-nearest, "
                        "group 128; GPU with --quant int4): a quarter of its bytes a step, 4-bit logits")
    m.add_argument("--step-kernel", choices=("chain", "persistent"),
                   help="GPU decode step: chain (default) = the chain of fused kernels in a CUDA graph; "
                        "persistent = one launch of the persistent step kernel (TP = 1, bf16 / 4-bit "
                        "weights; where it cannot run, the chain, and one line says why). The persistent "
                        "step is still slower than the chain (docs/benchmarks.md)")
    m.add_argument("--dtype", help="float32 (default) | bfloat16 | float16")
    g = p.add_argument_group("parallel layout")
    g.add_argument("--mode", help=f"{' | '.join(MODES)} (default async)")
    g.add_argument("--draft-ranks", type=draft_ranks_arg,
                   help="ranks in the draft group (async; default 1, world/4 from 8 ranks); the rest verify. "
                        "auto: at start the ranks time the models at every group size and the split, verify "
                        "size and width with the most expected tok/s are taken (swiftspec plan's model; the "
                        "acceptance of --accept-from, else the startup profile's prior), which costs a load of "
                        "the models per group size")
    g.add_argument("--async-policy", help="async: which tree the verify group checks next. "
                                          "rate: the tree the draft re-rooted on the latest result "
                                          "(sent once --floor-depth levels deep) or the rest of the "
                                          "one at hand, whichever the expected tokens per second "
                                          "favour; fresh: always wait for the re-rooted tree (the "
                                          "paper's). Default: " + DEFAULT_ASYNC_POLICY)
    g.add_argument("--floor-depth", type=int, help="async, rate: the levels under the root "
                                                   "a tree must reach to be worth waiting for (capped "
                                                   "at --verify-size - 1; default 2)")
    g.add_argument("--threads", type=int, help="torch threads per rank (default: the node's cores / "
                                               "ranks on the node; ranks are pinned to disjoint cores)")
    g.add_argument("--device", help="auto | cpu | cuda (GPU local_rank %% ngpus)")
    q = p.add_argument_group("prompts and stopping")
    q.add_argument("--prompt", help="one prompt text")
    q.add_argument("--prompts", help="JSONL file: {\"prompt\": TEXT} or Spec-Bench {\"turns\": [...], "
                                     "\"category\": ...} per line; decoded one after another")
    q.add_argument("--interactive", action="store_true", default=None,
                   help="read prompts from standard input (rank 0), one request each, until end of "
                        "input or /exit; with --chat they form one conversation (/help lists the commands)")
    q.add_argument("--serve", metavar="[HOST:]PORT",
                   help="serve OpenAI-style /v1/completions and /v1/chat/completions over HTTP on rank 0 "
                        "(host 127.0.0.1 unless given; one request at a time, the others queue)")
    q.add_argument("--serve-max-body", type=int, metavar="BYTES",
                   help="--serve: largest request body accepted, larger ones get 413 (default 4194304)")
    q.add_argument("--serve-read-timeout", type=float, metavar="SECONDS",
                   help="--serve: one deadline for a whole request, from the connection's opening (or "
                        "the previous answer on it) to the last byte of its body: a request still "
                        "arriving then gets 408, a connection that sent nothing is closed (default 30)")
    q.add_argument("--serve-max-queue", type=int, metavar="N",
                   help="--serve: requests that may wait behind the one decoding; beyond: 429 with "
                        "Retry-After (default 64)")
    q.add_argument("--serve-max-idle", type=int, metavar="N",
                   help="--serve: connections held open with no request queued or decoding (idle "
                        "keep-alive or still sending); a new one beyond closes the oldest (default 32)")
    q.add_argument("--chat", action="store_true", default=None,
                   help="wrap prompts in the target's chat template")
    q.add_argument("--max-new-tokens", type=int, help="tokens to generate per prompt (default 128)")
    q.add_argument("--stop", action="append", help="stop string (repeatable)")
    q.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append",
                   help="extra token id that ends generation like EOS (repeatable)")
    q.add_argument("--ignore-eos", action="store_true", default=None,
                   help="do not stop at EOS (benchmarks)")
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, help="0 = greedy (default)")
    s.add_argument("--seed", type=int, help="sampling seed (default 0)")
    s.add_argument("--sampling-rule", help="coupled (default: reproducible, equals ar's sample) | "
                                           "residual (EAGLE-style multi-branch rule)")
    t = p.add_argument_group("token tree")
    t.add_argument("--tree-width", type=int, help="w: leaves expanded per draft forward (default: the "
                                                  "verify size)")
    t.add_argument("--tree-topk", type=int, help="children added per expanded leaf (default 8)")
    t.add_argument("--verify-size", type=int, help="bs: tree nodes verified per target pass, at most 64 "
                                                   "(default: a startup profile of the target picks "
                                                   f"{', '.join(map(str, TREE_SIZES[:-1]))} or {TREE_SIZES[-1]}, "
                                                   "the most expected tokens per second of target time; "
                                                   "the trace's env_json keeps the choice)")
    t.add_argument("--expansions", type=int, help="d: draft expansions per verify step in sync mode "
                                                  "(default: floor(t_target / t_draft) from a startup "
                                                  "profile); in async mode the draft's pace: d expansions "
                                                  "after each result, then it waits (default: no pause, "
                                                  "or the profile's d when a draft rank shares a verify "
                                                  "rank's GPU)")
    t.add_argument("--max-depth", type=int, help="deepest tree level (default 16)")
    t.add_argument("--tree-capacity", type=int, help="tree nodes (default 1024)")
    t.add_argument("--max-context", type=int, help="KV slots per model (default: longest prompt + "
                                                   "new tokens + tree margin; --interactive: 4096)")
    o = p.add_argument_group("output and robustness")
    o.add_argument("--out", help="HDF5 trace path (default runs/swiftspec-<SLURM_JOB_ID|time>.h5)")
    o.add_argument("--overwrite", action="store_true", default=None, help="replace an existing --out")
    o.add_argument("--trace-rotate", metavar="N|Tm|N,Tm",
                   help="--serve / --interactive: start a new trace file after N requests or T minutes "
                        "(Th: hours), whichever first: --out, then STEM.1.h5, STEM.2.h5, ... each "
                        "with every rank's events and the ranks table; 0: one file for the whole job "
                        "(its memory and write time grow with it). Default 500")
    o.add_argument("--peer-timeout", type=float, help="seconds to wait for a peer rank before failing "
                                                      "(default 30)")
    o.add_argument("--quiet", action="store_true", default=None, help="do not stream text to stdout")
    p.add_argument("--config", help="TOML file with any of these options (flags win)")
    del S


def draft_ranks_arg(text: str):
    """--draft-ranks: a number, or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is neither a number of ranks nor auto") from None


FLAG_FIELDS = ("target", "draft", "draft_layers", "load_format", "accept_from", "quant", "head_bits", "step_kernel", "dtype", "mode",
               "draft_ranks", "async_policy", "floor_depth", "threads", "device", "prompt", "prompts", "interactive", "serve", "serve_max_body",
               "serve_read_timeout", "serve_max_queue", "serve_max_idle", "trace_rotate", "chat", "max_new_tokens", "stop",
               "stop_token_ids", "ignore_eos", "temperature", "seed", "sampling_rule", "tree_width", "tree_topk",
               "verify_size", "expansions", "max_depth", "tree_capacity", "max_context", "out",
               "overwrite", "peer_timeout", "quiet")


def main(args) -> int:
    from swiftspec_mpi.cli.job import run_job
    return run_job({name: getattr(args, name, None) for name in FLAG_FIELDS}, args.config)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(os.EX_USAGE)

"""Choose the configuration of a job from profiled step times and an acceptance model (the
SwiftSpec paper's configuration step). Every rank of the job runs this:

    mpiexec -n 4 swiftspec plan --target T --draft D --accept-from model.json
    mpiexec -n 2 swiftspec plan --load-format dummy --target llama-3-70b --draft llama-3.2-1b \\
        --quant int4 --accept-from model.json --gpus 8      (also predict 1..8 GPUs of this kind)

For each group size g the job's first g ranks load the target and the draft at tensor-parallel
size g and time their forwards as the decode loops run them (verify trees of n nodes, draft
expansions of w leaves); the leaders' message round trip is timed too. Then every configuration
of the job's ranks (sync on one group, or async with D draft and R - D verify ranks; verify size
n, width w = n, expansions d) gets its expected tokens a step from the acceptance model (a
simulation of the engine's own tree, engine/throughput.py) and its step time from the profile;
the table is printed best first, and the best is the plan, with the `swiftspec run` flags that
run it. The model: docs/internals.md, "Choosing the split".
"""
from __future__ import annotations

import dataclasses
import json
import sys

from swiftspec_mpi.core import config as C
from swiftspec_mpi.core.errors import UserError

DEFAULT_ALLREDUCE_US = 10.0   # --gpus prediction: one small all-reduce between GPUs of a node (NVLink)


def add_arguments(p) -> None:
    m = p.add_argument_group("models (as swiftspec run)")
    m.add_argument("--target")
    m.add_argument("--draft")
    m.add_argument("--draft-layers", type=int)
    m.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    m.add_argument("--quant", choices=C.QUANTS, default="auto")
    m.add_argument("--head-bits", type=int, choices=(16, 4), default=16)
    m.add_argument("--dtype", default="float32", choices=C.DTYPES)
    m.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    m.add_argument("--threads", type=int, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--accept-from", required=True, metavar="TRACE.h5|MODEL.json",
                   help="the acceptance model (a trace of the real pair, or analyze --acceptance-out)")
    p.add_argument("--verify-size", type=int, help="consider only this verify size n (default: "
                                                   f"{', '.join(map(str, C.TREE_SIZES))})")
    p.add_argument("--tree-topk", type=int, default=8, help="children per expanded leaf (default 8)")
    p.add_argument("--max-depth", type=int, default=16, help="deepest tree level (default 16)")
    p.add_argument("--max-expansions", type=int, default=8,
                   help="the most draft expansions a step weighed for sync (and async on one device)")
    p.add_argument("--context", type=int, default=128,
                   help="KV position the profile times the steps at: a job's prompt and half its new "
                        "tokens (default 128)")
    p.add_argument("--max-context", type=int, default=4096,
                   help="KV slots per model (default 4096); every tree must fit in it")
    p.add_argument("--gpus", type=int, metavar="N", help="also predict for 1, 2, 4 ... N devices like rank 0's "
                                                         "(step times scaled from one device: docs/internals.md)")
    p.add_argument("--allreduce-us", type=float, default=DEFAULT_ALLREDUCE_US,
                   help=f"--gpus: one all-reduce between devices, microseconds (default {DEFAULT_ALLREDUCE_US:g})")
    p.add_argument("--steps", type=int, default=300, help="simulated steps per configuration (default 300)")
    p.add_argument("--json", action="store_true", help="print the plan and its table as JSON")


def check_inputs(args, world: int):
    """Rank 0: -> (RunConfig for loading, target and draft ModelConfig, acceptance model, sizes);
    UserError for what cannot be planned."""
    from swiftspec_mpi.cli.validate import check_head_bits, resolve_models, resolve_quant
    from swiftspec_mpi.trace import acceptance
    if world < 2 and not args.gpus:
        raise UserError("plan splits ranks between a draft and a verify group: launch it on 2 or more "
                        "ranks (mpiexec -n 2 swiftspec plan ...), or give --gpus N to predict N devices "
                        "from this one's step times")
    if args.gpus is not None and args.gpus < 2:
        raise UserError(f"--gpus {args.gpus}: give 2 or more devices to predict for")
    cfg = C.RunConfig(target=args.target, draft=args.draft, draft_layers=args.draft_layers,
                      load_format=args.load_format, quant=args.quant, head_bits=args.head_bits,
                      dtype=args.dtype, device=args.device, mode="sync", tree_topk=args.tree_topk,
                      max_depth=args.max_depth, max_context=args.max_context, quiet=True,
                      verify_size=args.verify_size)
    sizes = [args.verify_size] if args.verify_size else list(C.TREE_SIZES)
    room = args.max_context - 1 - args.max_expansions * max(sizes)   # the draft's KV after the root
    if max(sizes) > 64:
        raise UserError(f"--verify-size {max(sizes)} is above 64, the most the fused tree attention takes")
    if room < max(sizes):
        raise UserError(f"a tree of {max(sizes)} nodes grown by {args.max_expansions} expansions does not fit "
                        f"the KV room of --max-context {args.max_context} slots; raise --max-context to at "
                        f"least {1 + (args.max_expansions + 1) * max(sizes)} or lower --verify-size")
    if not 0 <= args.context <= args.max_context // 2:
        raise UserError(f"--context {args.context}: give 0 to {args.max_context // 2} (half of --max-context: "
                        "the loops' timed steps run past it)")
    if args.steps < 50:
        raise UserError(f"--steps {args.steps} is too few to average acceptance; give 50 or more")
    model, _sha = acceptance.load(args.accept_from)
    tcfg, _tok, dcfg = resolve_models(cfg)
    if dcfg is None:
        raise UserError("plan needs a draft: give --draft (or --draft-layers)")
    resolve_quant(cfg)
    check_head_bits(cfg)
    return cfg, tcfg, dcfg, model, sizes


def main(args) -> int:
    from mpi4py import MPI

    from swiftspec_mpi.core.errors import EXIT_USER_ERROR, one_line
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    verdict = None
    if rank == 0:
        try:
            verdict = ("ok", check_inputs(args, world.Get_size()))
        except UserError as exc:
            verdict = ("error", str(exc))
    status, payload = world.bcast(verdict, root=0)
    if status != "ok":
        if rank == 0:
            print(f"swiftspec plan: error: {one_line(payload)}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    cfg, tcfg, dcfg, model, sizes = payload
    from swiftspec_mpi.cli.plan_profile import profile_groups
    prof = profile_groups(world, cfg, sizes, args.threads, (tcfg.num_heads, dcfg.num_heads), model, args.context)
    if rank != 0:
        return 0
    result = choose(prof, model, sizes, (tcfg.num_heads, dcfg.num_heads), args, world.Get_size(),
                    tcfg.num_layers, dcfg.num_layers)
    result["accept_from"] = args.accept_from
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print("\n".join(render(result, args)))
    return 0


def choose(prof: dict, model: dict, sizes: list[int], heads: tuple[int, int], args, world: int,
           target_layers: int, draft_layers: int) -> dict:
    """The plan for this job (and with --gpus, for 1..N devices) from the profile
    (plan_profile.profile_groups) -> a JSON-ready dict: the chosen row, the table, the inputs."""
    from swiftspec_mpi.engine import throughput as T
    t_target = {int(g): {int(n): t for n, t in v.items()} for g, v in prof["t_target_s"].items()}
    t_draft = {int(g): {int(n): t for n, t in v.items()} for g, v in prof["t_draft_s"].items()}
    groups = sorted(t_target)
    # ar on the group size where the target's one-token step is fastest
    sync_top = min((g for g in groups if g <= prof["sync_ranks"]), key=lambda g: t_target[g][1], default=1)
    sync_g = prof["sync_ranks"]
    cands = [c for c in T.candidates(world, sizes, heads, args.max_expansions, prof["shared"])
             if c.mode == "async" and c.draft_ranks in t_draft and c.verify_ranks in t_target]
    for g in groups:            # sync on the first g ranks that drive distinct devices
        if g <= sync_g and g in t_draft:
            cands += [c for c in T.candidates(g, sizes, heads, args.max_expansions, False) if c.mode == "sync"]
    if not cands:
        raise UserError(f"no split of {world} ranks divides the models' heads ({heads[0]} target, "
                        f"{heads[1]} draft); use a rank count that does")
    sims: dict = {}
    host = {int(n): h for n, h in (prof.get("host_s") or {}).items()}
    host_ar = prof.get("host_ar_s", 0.0)
    host_async = {int(D): {int(n): h for n, h in v.items()} for D, v in (prof.get("host_async_s") or {}).items()}
    table = T.evaluate(cands, model, t_target, t_draft, prof["t_x_s"], args.tree_topk, args.max_depth,
                       args.steps, sims, host, host_async)
    out = {"world": world, "devices": prof["devices"], "shared_device": prof["shared"],
           "t_target_s": prof["t_target_s"], "t_draft_s": prof["t_draft_s"], "t_x_s": prof["t_x_s"],
           "host_s": host, "host_async_s": host_async,
           "ar_tok_s": 1.0 / (t_target[sync_top][1] + host_ar), "ar_ranks": sync_top, "host_ar_s": host_ar,
           "model_mean_accepted": model.get("mean_accepted"),
           "table": [row(c, t_target, t_draft) for c in table], "chosen": row(table[0], t_target, t_draft)}
    if args.gpus:
        one_t, one_d = t_target[1], t_draft[1]
        ar_s = args.allreduce_us * 1e-6
        pred = {}
        for n_dev in sorted({1 << i for i in range(8) if 1 << i <= args.gpus} | {args.gpus}):
            tt = {g: T.scaled_times(one_t, g, target_layers, ar_s) for g in range(1, n_dev + 1)}
            td = {g: T.scaled_times(one_d, g, draft_layers, ar_s) for g in range(1, n_dev + 1)}
            cs = T.candidates(n_dev, sizes, heads, args.max_expansions, n_dev == 1)
            if n_dev == 1:       # one device: the two groups share it (MPS)
                cs = [c for c in T.candidates(2, sizes, heads, args.max_expansions, True) if c.mode == "async"]
                tt[1], td[1] = one_t, one_d
                cs += [c for c in T.candidates(1, sizes, heads, args.max_expansions, False)]
            if not cs:
                continue
            best = T.evaluate(cs, model, tt, td, prof["t_x_s"], args.tree_topk, args.max_depth, args.steps, sims,
                              host, host_async if n_dev == 1 and prof["shared"] else None)
            ar = 1.0 / (tt[n_dev][1] + host_ar) if 1 in tt[n_dev] else None
            pred[n_dev] = {"chosen": row(best[0], tt, td), "ar_tok_s": ar,
                           "best_sync": next((row(c, tt, td) for c in best if c.mode == "sync"), None),
                           "best_async": next((row(c, tt, td) for c in best if c.mode == "async"), None)}
        out["predicted"] = pred
        out["allreduce_us"] = args.allreduce_us
    return out


def row(c, t_target, t_draft) -> dict:
    g_draft = c.draft_ranks or c.verify_ranks
    return {"mode": c.mode, "draft_ranks": c.draft_ranks, "verify_ranks": c.verify_ranks,
            "shared_device": c.shared, "verify_size": c.n, "tree_width": c.w, "expansions": c.d,
            "t_target_ms": round(1e3 * t_target[c.verify_ranks][c.n], 4),
            "t_draft_ms": round(1e3 * t_draft[g_draft][c.w], 4), "host_ms": round(1e3 * c.host_total, 4),
            "step_ms": round(1e3 * c.step_s, 4),
            "tokens_per_step": round(c.tokens, 3), "stall": round(c.stall, 3),
            "token_scale": round(c.token_scale, 3), "tok_s": round(c.tok_s, 2)}


def run_flags(r: dict, world: int) -> str:
    if r["mode"] == "sync":
        return (f"mpiexec -n {r['verify_ranks']} swiftspec run --mode sync --verify-size {r['verify_size']} "
                f"--tree-width {r['tree_width']} --expansions {r['expansions']}")
    pace = f" --expansions {r['expansions']}" if r["shared_device"] else ""
    return (f"mpiexec -n {world} swiftspec run --mode async --draft-ranks {r['draft_ranks']} "
            f"--verify-size {r['verify_size']} --tree-width {r['tree_width']}{pace}")


def render(result: dict, args, top: int = 16) -> list[str]:
    dev = ", ".join(sorted(set(result["devices"])))
    lines = [f"plan: {result['world']} ranks on {dev}"
             + (" (draft and verify share a device)" if result["shared_device"] else "")
             + f"; acceptance from {args.accept_from} (mean {result['model_mean_accepted']} tokens a step "
               f"in its trace); leaders' round trip {1e3 * result['t_x_s']:.3f} ms"]
    if result.get("ar_tok_s"):
        lines.append(f"ar (the target alone on {result['ar_ranks']} rank(s)) would run {result['ar_tok_s']:.1f} tok/s")
    head = ("mode", "draft", "verify", "n", "w", "d", "t_tgt ms", "t_dft ms", "host ms", "step ms", "tok/step", "tok/s")
    rows = [head]
    for r in result["table"][:top]:
        rows.append((r["mode"] + ("*" if r["shared_device"] else ""), str(r["draft_ranks"]), str(r["verify_ranks"]),
                     str(r["verify_size"]), str(r["tree_width"]), str(r["expansions"]), f"{r['t_target_ms']:.3f}",
                     f"{r['t_draft_ms']:.3f}", f"{r['host_ms']:.3f}", f"{r['step_ms']:.3f}",
                     f"{r['tokens_per_step']:.2f}", f"{r['tok_s']:.1f}"))
    widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
    for i, x in enumerate(rows):
        lines.append("  ".join(v.rjust(widths[j]) for j, v in enumerate(x)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if len(result["table"]) > top:
        lines.append(f"({len(result['table']) - top} more configurations; --json lists all)")
    if result["shared_device"]:
        lines.append("async*: both groups on one device; its step counts the draft's expansions in full "
                     "(no overlap: a lower bound)")
    c = result["chosen"]
    split = (f"sync on {c['verify_ranks']} of the {result['world']} ranks" if c["mode"] == "sync" else
             f"async with {c['draft_ranks']} draft / {c['verify_ranks']} verify ranks")
    lines.append(f"chosen: {split}, n = {c['verify_size']}, w = {c['tree_width']}, d = {c['expansions']}: "
                 f"{c['tokens_per_step']:.2f} tokens a step in {c['step_ms']:.3f} ms = {c['tok_s']:.1f} tok/s expected")
    lines.append(f"run it: {run_flags(c, result['world'])}")
    for n_dev, p in (result.get("predicted") or {}).items():
        b = p["chosen"]
        ar = f"ar {p['ar_tok_s']:.1f}, " if p.get("ar_tok_s") else ""
        lines.append(f"predicted for {n_dev} device(s) like rank 0's: {ar}best {b['mode']} "
                     f"(draft {b['draft_ranks']} / verify {b['verify_ranks']}, n = {b['verify_size']}, d = "
                     f"{b['expansions']}) {b['tok_s']:.1f} tok/s at {b['tokens_per_step']:.2f} tokens a step")
    return lines


def auto_split(world, cfg) -> None:
    """`run --draft-ranks auto`, every rank before the job: time the models at every group size
    (plan_profile), weigh the async splits by the acceptance replayed (--accept-from) or, without
    one, the startup profile's prior (a chain accepting C.ACCEPT_PRIOR a token), and set
    cfg.draft_ranks, and cfg.verify_size / tree_width / (on a shared device) expansions where the
    flags left them open. Rank 0 decides and prints its choice; every rank takes it."""
    from types import SimpleNamespace

    from swiftspec_mpi.cli.plan_profile import profile_groups
    from swiftspec_mpi.trace import acceptance
    heads = None
    if world.Get_rank() == 0:
        from swiftspec_mpi.cli.validate import resolve_models
        tcfg, _tok, dcfg = resolve_models(cfg)
        heads = (tcfg.num_heads, dcfg.num_heads, tcfg.num_layers, dcfg.num_layers)
    heads = world.bcast(heads, root=0)
    sizes = [cfg.verify_size] if cfg.verify_size else list(C.TREE_SIZES)
    model = cfg.accept_model or acceptance.chain_model(C.expected_tokens(8), 8)
    # the profile's own models: room for its timed loops past a context of 128 (the job's KV may be
    # sized to its prompts alone)
    prof = profile_groups(world, dataclasses.replace(cfg, max_context=max(cfg.max_context or 0, 2048)), sizes,
                          cfg.threads, heads[:2], model, 128)
    choice = None
    if world.Get_rank() == 0:
        args = SimpleNamespace(max_expansions=8, tree_topk=cfg.tree_topk, max_depth=cfg.max_depth,
                               steps=200, gpus=None)
        result = choose(prof, model, sizes, heads[:2], args, world.Get_size(), heads[2], heads[3])
        choice = next((r for r in result["table"] if r["mode"] == "async"), None)
        if choice is not None:
            print(f"swiftspec run: --draft-ranks auto: {choice['draft_ranks']} draft / {choice['verify_ranks']} "
                  f"verify ranks, verify size {choice['verify_size']}, width {choice['tree_width']} (expected "
                  f"{choice['tok_s']:.1f} tok/s; swiftspec plan prints the table)", file=sys.stderr, flush=True)
    choice = world.bcast(choice, root=0)
    if choice is None:
        return                                   # no async split divides the heads: the default stays
    cfg.draft_ranks = choice["draft_ranks"]
    cfg.verify_size = cfg.verify_size or choice["verify_size"]
    cfg.tree_width = cfg.tree_width or choice["tree_width"]
    if choice["shared_device"] and cfg.expansions is None:
        cfg.expansions = choice["expansions"]

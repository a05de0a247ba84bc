"""One group holds every model: `ar` (target alone, one token per step) and `sync` (serial tree
speculation: d draft expansions, then one target pass over the best subtree — the SpecExec-style
baseline that SwiftSpec's parallel groups beat)."""
from __future__ import annotations

import numpy as np

from swiftspec_mpi.engine.decoding import Acceptor, DraftSide, OutputTracker, TargetSide
from swiftspec_mpi.engine.context import EngineContext, comm_seconds, decide, make_topk_share
from swiftspec_mpi.engine.sent_tree import tree_depth
from swiftspec_mpi.trace.record import KIND, SOURCE, step_row

HAND = 4    # sync: the verdicts look at the draft's best HAND * bs nodes (the verified bs first)


def run_request_single(ctx: EngineContext, prompt_ids: list[int], request: int, result,
                       tracker: OutputTracker | None, acceptor: Acceptor) -> None:
    """Decode one request on this group. `result`/`tracker` are used on the leader only."""
    cfg, rec, clock = ctx.cfg, ctx.recorder, ctx.clock
    leader = ctx.topo.is_leader
    bs = 1 if cfg.mode == "ar" else cfg.verify_size
    target = TargetSide(ctx.target)
    draft = None
    if cfg.mode == "sync":
        draft = DraftSide(ctx.draft, cfg.tree_width, cfg.tree_topk, cfg.tree_capacity, cfg.max_depth,
                          replay=ctx.replay)
    decision = np.zeros(3 + 2 * bs, dtype=np.int64)     # [a, done, n, path[bs], accepted[bs]]
    share = make_topk_share(ctx, np.zeros((cfg.tree_width, cfg.tree_topk), dtype=np.int64),
                            np.zeros((cfg.tree_width, cfg.tree_topk), dtype=np.float32))

    t0 = clock.now()
    c0 = comm_seconds(ctx.target)
    target.prefill(prompt_ids)
    if draft is not None:
        draft.prefill(prompt_ids)
    rec.record(KIND["prefill"], request, 0, t0, clock.now(), len(prompt_ids), 0,
               comm_seconds(ctx.target) - c0)
    root = int(prompt_ids[-1])
    step = 0
    while True:
        ctx.check_stop_together()
        t_step = clock.now()
        if draft is None:
            tokens, parents = np.array([root], dtype=np.int64), np.array([-1], dtype=np.int32)
            expanded, hand = 0, None
        else:
            expanded = 0
            for e in range(ctx.expansions):
                leaves = draft.select()
                if len(leaves) == 0:
                    break
                te, ce = clock.now(), comm_seconds(ctx.draft)
                draft.expand(leaves, share)
                rec.record(KIND["expand"], request, step, te, clock.now(), len(leaves), 0,
                           comm_seconds(ctx.draft) - ce)
                expanded += 1
            # the tree at hand (best-first: the verified tree is its first bs nodes), so that the
            # verdicts see the draft's children past the verified ones
            hand_tokens, hand_parents, hand_scores = draft.best_subtree(HAND * bs)
            tokens, parents, hand = hand_tokens[:bs], hand_parents[:bs], (hand_parents, hand_scores)
        tv, cv = clock.now(), comm_seconds(ctx.target)
        logits = target.forward_tree(tokens, parents, greedy=acceptor.argmax_only)
        done, taken, path, accepted = decide(ctx, tokens, parents, logits, acceptor, tracker, result,
                                             decision, bs, hand)
        a = len(path)
        t_end = clock.now()
        rec.record(KIND["verify" if draft is not None else "decode"], request, step, tv, t_end,
                   len(tokens), a, comm_seconds(ctx.target) - cv)
        if leader:
            if draft is None:
                result.steps.append(step_row(step, len(tokens), taken, t_step, t_end))
            else:   # serial: every tree is fresh, nothing to wait for
                result.steps.append(step_row(step, len(tokens), taken, t_step, t_end, SOURCE["fresh"],
                                             tree_depth(parents), int(draft.tree.size), expanded, 0.0))
            if ctx.on_progress is not None:
                ctx.on_progress()
        if done:
            return
        target.commit(path)
        if draft is not None:
            tr = clock.now()
            kept = draft.reroot(accepted, share)
            rec.record(KIND["reroot"], request, step, tr, clock.now(), 0, kept)
        root = int(accepted[-1])
        step += 1

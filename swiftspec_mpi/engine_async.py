"""SwiftSpec's asynchronous loops (Algorithm 1 on MPI): the draft group keeps growing the token
tree while the verify group checks the best subtree it was sent; the two leaders meet once per
verify step over the inter-communicator.

    draft leader                              verify leader
    ------------                              -------------
    expand w best leaves (repeat)  <- poll -  forward(subtree) on committed KV
    on RESULT: re-root, move KV               accept path (+ bonus), commit KV, stream text
    when verify is idle: SEND best subtree -> wait for the next subtree (deadline)

Group members (tensor parallel ranks) mirror their leader: every decision is broadcast in a
preallocated buffer, so the tree and KV of every rank of a group stay identical.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from swiftspec_mpi.decoding import Acceptor, DraftSide, OutputTracker, TargetSide
from swiftspec_mpi.engine_context import EngineContext, comm_seconds, make_topk_share
from swiftspec_mpi.errors import PeerError
from swiftspec_mpi.protocol import TAG_RESULT, TAG_TREE, LeaderChannel, wait_for
from swiftspec_mpi.trace import KIND

ACT_EXPAND, ACT_SEND, ACT_RESULT = 1, 2, 3


def verify_loop(ctx: EngineContext, prompt_ids: list[int], request: int, result,
                tracker: OutputTracker | None, acceptor: Acceptor) -> None:
    cfg, rec, clock, topo = ctx.cfg, ctx.recorder, ctx.clock, ctx.topo
    leader = topo.is_leader
    chan = ctx.scratch.setdefault("chan", LeaderChannel(cfg.verify_size))
    bs = cfg.verify_size
    target = TargetSide(ctx.target)
    decision = np.zeros(3 + bs, dtype=np.int64)   # [a, done, taken, path[bs]]

    t0, c0 = clock.now(), comm_seconds(ctx.target)
    target.prefill(prompt_ids)
    rec.record(KIND["prefill"], request, 0, t0, clock.now(), len(prompt_ids), 0,
               comm_seconds(ctx.target) - c0)
    tree_req = topo.inter.Irecv(chan.tree, source=0, tag=TAG_TREE) if leader else None
    step = 0
    while True:
        tw = clock.now()
        if leader:
            wait_for(tree_req, cfg.peer_timeout,
                     f"token tree from rank {topo.verify_size} (draft leader)", ctx.stop_flag, ctx.watch)
        else:
            ctx.check_stop()
        ctx.bcast(chan.tree)
        req_id, seq, root_pos, tokens, parents = chan.unpack_tree()
        if req_id != request or root_pos != target.P:
            raise PeerError(f"draft/verify out of step: tree for request {req_id} at position "
                            f"{root_pos}, verify is at request {request} position {target.P}")
        tv = clock.now()
        rec.record(KIND["wait"], request, step, tw, tv)
        cv = comm_seconds(ctx.target)
        logits = target.forward_tree(tokens, parents)
        if leader:
            path, accepted = acceptor.accept(tokens, parents, logits, len(result.output_ids))
            taken, done = tracker.add(accepted)
            if result.t_first is None:
                result.t_first = clock.now()
            a = len(path)
            decision[:3] = (a, int(done), taken)
            decision[3:3 + a] = path
        ctx.bcast(decision)
        a, done = int(decision[0]), bool(decision[1])
        if not done:
            target.commit(decision[3:3 + a])
        t_end = clock.now()
        rec.record(KIND["verify"], request, step, tv, t_end, len(tokens), a,
                   comm_seconds(ctx.target) - cv)
        if leader:
            result.steps.append((step, len(tokens), int(decision[2]), tw, t_end))
            if not done:   # post the receive for the next tree before the draft can send it
                tree_req = topo.inter.Irecv(chan.tree, source=0, tag=TAG_TREE)
            ts = clock.now()
            topo.inter.Send(chan.pack_result(request, seq, accepted, done), dest=0, tag=TAG_RESULT)
            rec.record(KIND["send"], request, step, ts, clock.now(), a)
            if ctx.on_progress is not None:
                ctx.on_progress()
        if done:
            return
        step += 1


def draft_loop(ctx: EngineContext, prompt_ids: list[int], request: int) -> None:
    cfg, rec, clock, topo = ctx.cfg, ctx.recorder, ctx.clock, ctx.topo
    leader = topo.is_leader
    bs, w, k = cfg.verify_size, cfg.tree_width, cfg.tree_topk
    chan = ctx.scratch.setdefault("chan", LeaderChannel(bs))
    control = ctx.scratch.setdefault("control", np.zeros(3 + bs, dtype=np.int64))  # [act, a, done, accepted]
    share = make_topk_share(ctx, np.zeros((w, k), dtype=np.int64), np.zeros((w, k), dtype=np.float32))
    draft = DraftSide(ctx.draft, w, k, cfg.tree_capacity, cfg.max_depth)

    t0, c0 = clock.now(), comm_seconds(ctx.draft)
    draft.prefill(prompt_ids)
    rec.record(KIND["prefill"], request, 0, t0, clock.now(), len(prompt_ids), 0,
               comm_seconds(ctx.draft) - c0)
    pending = False            # a subtree is out for verification
    result_req = None
    seq = 0
    n_expand = 0
    while True:
        # 1. the leader decides what the whole group does next
        if leader:
            ctx.check_stop()
            leaves = None
            if pending and result_req.Test():
                action = ACT_RESULT
            elif not pending and draft.root_expanded():
                action = ACT_SEND
            else:
                leaves = draft.select()
                if len(leaves):
                    action = ACT_EXPAND
                elif pending:   # tree (or KV) full: nothing to do but wait for the verdict
                    tw = clock.now()
                    wait_for(result_req, cfg.peer_timeout, "verify result from rank 0 (verify leader)",
                             ctx.stop_flag, ctx.watch)
                    rec.record(KIND["wait"], request, n_expand, tw, clock.now())
                    action = ACT_RESULT
                else:
                    raise RuntimeError("draft tree cannot grow and nothing is being verified: "
                                       "raise --tree-capacity or --max-context")
            control[0] = action
            if action == ACT_RESULT:
                r_req, r_seq, accepted, done = chan.unpack_result()
                if r_req != request or r_seq != seq - 1:
                    raise PeerError(f"verify result for request {r_req} step {r_seq}, draft expected "
                                    f"request {request} step {seq - 1}")
                control[1], control[2] = len(accepted), int(done)
                control[3:3 + len(accepted)] = accepted
        ctx.bcast(control)
        action = int(control[0])
        # 2. every rank of the group applies it
        if action == ACT_RESULT:
            pending = False
            if control[2]:
                return
            tr = clock.now()
            kept = draft.reroot(control[3:3 + int(control[1])].copy(), share)
            rec.record(KIND["reroot"], request, seq, tr, clock.now(), 0, kept)
        elif action == ACT_SEND:
            ts = clock.now()
            tokens, parents = draft.best_subtree(bs)
            if leader:
                result_req = topo.inter.Irecv(chan.result, source=0, tag=TAG_RESULT)
                topo.inter.Send(chan.pack_tree(request, seq, draft.tree.root_pos, tokens, parents),
                                dest=0, tag=TAG_TREE)
            rec.record(KIND["send"], request, seq, ts, clock.now(), len(tokens))
            pending = True
            seq += 1
        else:
            if not leader:
                leaves = draft.select()
            te, ce = clock.now(), comm_seconds(ctx.draft)
            draft.expand(leaves, share)
            rec.record(KIND["expand"], request, n_expand, te, clock.now(), len(leaves), 0,
                       comm_seconds(ctx.draft) - ce)
            n_expand += 1


def exchange_profile(ctx: EngineContext, my_step_s: float) -> float:
    """Leaders swap their measured step times; returns the other group's (broadcast in group)."""
    buf = np.array([my_step_s], dtype=np.float64)
    other = np.zeros(1, dtype=np.float64)
    if ctx.topo.is_leader:
        ctx.topo.inter.Sendrecv(buf, dest=0, sendtag=5, recvbuf=other, source=0, recvtag=5)
    ctx.bcast(other)
    return float(other[0])


__all__ = ["verify_loop", "draft_loop", "exchange_profile", "MPI"]

"""SwiftSpec's asynchronous loops (Algorithm 1 on MPI): the draft group keeps growing the token
tree while the verify group checks the best subtree it was sent; the two leaders meet once per
verify step over the inter-communicator. How the verify group picks its next tree and how the
draft paces itself is the async policy (--async-policy):

    draft leader                              verify leader
    ------------                              -------------
    expand w best leaves      (repeat;        forward(best bs nodes) on committed KV
      paced: d times a step, then wait)       accept path (+ bonus), commit KV, stream text
      between layers: RESULT in?       <--    SEND result
        and no leaf survives its re-root:
        ABANDON the expansion (tree and
        KV as before it; abandon.py)
    on RESULT: re-root, move KV
    then SEND best 4*bs nodes          -->    next tree:
      (rate: once its best bs nodes are         fresh: wait for the tree the draft re-rooted
      F levels deep, or after F expansions             on this result (the paper's policy)
      since the result; F = --floor-depth)      rate:  that tree, or the one at hand (the
                                                       newest that reaches the current root,
                                                       else the remnant of the last one under
                                                       the bonus token) when the expected
                                                       tokens per second favour it
                                                       (rate_rule.py)

`fresh` is the paper's: the verify group waits for the draft's re-root round trip, so every
tree it checks holds all the draft made up to the result. `rate` (the default) weighs that wait:
the tree at hand's expected accepted tokens (from the draft's path probabilities, sent with every
tree) over a verify step, against the re-rooted tree's over a verify step plus the wait for it
(engine/rate_rule.py). Its draft holds the re-rooted tree back until it is F levels deep: the bonus
token often lands at the draft's frontier (or outside its tree), and the re-rooted tree is then a
single level deep, so at most one draft token can be accepted; one more expansion (a fraction of a
verify step) lifts it to two (--floor-depth F: to F, 2 by default). Until the rule has its
observations, `rate` goes on with the tree at hand only when that is F levels deep.

A result that arrives while the draft is in an expansion is taken at the next layer boundary
(engine/abandon.py) when the re-root on it would drop every leaf being expanded: that forward is
wasted work, and finishing it delays the re-rooted tree by up to one expansion (the wait both
policies pay). An expansion with a surviving leaf is finished first, as before.

The draft expands without pause, unless it is paced (EngineContext.draft_pace = d > 0: d
expansions after each result, then it waits for the next): with --expansions D, or when a draft
rank shares a GPU with a verify rank (d from the startup profile), so that it takes less of the
shared device from the verify group (one GPU under MPS).

Group members (tensor parallel ranks) mirror their leader: every decision is broadcast in a
preallocated buffer, so the tree and KV of every rank of a group stay identical (the decision
to abandon an expansion too, every abandon.TP_CHECK_EVERY layers).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from swiftspec_mpi.engine.abandon import LayerCheck, ResultWatch
from swiftspec_mpi.engine.decoding import Acceptor, DraftSide, OutputTracker, TargetSide
from swiftspec_mpi.engine.context import EngineContext, comm_seconds, decide, make_topk_share
from swiftspec_mpi.core.errors import PeerError
from swiftspec_mpi.engine.protocol import (MSG_STOP, NO_META, TAG_RESULT, TAG_TREE, Interrupted, LeaderChannel,
                                           TreeMeta, send_within, wait_for)
from swiftspec_mpi.engine.rate_rule import ExpectedRate
from swiftspec_mpi.engine.sent_tree import draft_mass, reroot_scored, tree_depth
from swiftspec_mpi.trace.record import KIND, SOURCE, step_row

ACT_EXPAND, ACT_SEND, ACT_RESULT, ACT_STOP = 1, 2, 3, 4


def waits_fresh(cfg) -> bool:
    """`fresh`: the verify group always waits for the tree the draft re-rooted on its latest
    result; `rate` weighs that wait (rate_rule.py)."""
    return cfg.async_policy == "fresh"


def depth_floor(cfg) -> int:
    """The depth a re-rooted tree must reach before the draft sends it (0: at once), and the
    least depth of a tree at hand the verify group goes on with before the `rate` rule has its
    observations: cfg.floor_depth, at most bs - 1, under `rate`; 0 under `fresh`."""
    return 0 if waits_fresh(cfg) else min(cfg.floor_depth, cfg.verify_size - 1)


def send_size(cfg) -> int:
    """Nodes per tree message: 4 x bs, so the verify leader can continue under the bonus token
    for a step or two without waiting for the draft's next tree."""
    return min(cfg.tree_capacity, 4 * cfg.verify_size)


class TreeInbox:
    """The verify leader's side of the tree messages: the tree to verify next under the policy
    (see the module docstring and sent_tree.py), with where it came from for the trace."""

    def __init__(self, ctx: EngineContext, chan: LeaderChannel, request: int):
        self.ctx, self.chan, self.request = ctx, chan, request
        self.wait_fresh = waits_fresh(ctx.cfg)
        self.min_depth = depth_floor(ctx.cfg)
        self.rate = None if self.wait_fresh else ctx.scratch.setdefault("expected_rate", ExpectedRate())
        self.req = ctx.topo.inter.Irecv(chan.tree, source=0, tag=TAG_TREE)
        self.local = None          # (tokens, parents, scores) rooted at the current root, best-first
        self.meta = NO_META        # the TreeMeta of the message self.local came from
        self.source = SOURCE["remnant"]
        self.results_sent = 0      # verify results sent so far in this request
        self.mass = 0.0            # draft mass of the tree next_tree gave (rate_rule.py)
        self.fresh_sent: dict[int, float] = {}   # results k -> job time the draft sent its first
        self.result_sent_at: dict[int, float] = {}   # results k -> job time the k-th was sent
        self.acked = False         # tree built on k results; the draft's end-of-request ack arrived

    def _note(self, meta: TreeMeta, n_tokens: int, scores: np.ndarray | None = None) -> None:
        if n_tokens and meta.results not in self.fresh_sent:
            self.fresh_sent[meta.results] = meta.sent_s
            sent = self.result_sent_at.get(meta.results)
            if self.rate is not None and sent is not None and scores is not None:
                self.rate.observe_fresh(meta.sent_s - sent, draft_mass(scores[:self.ctx.cfg.verify_size]))

    def _take(self, committed: list[int]) -> None:
        """Consume the arrived message; keep it if it re-roots onto the current root."""
        req_id, _seq, root_pos, tokens, parents = self.chan.unpack_tree()
        meta, scores = self.chan.tree_meta(), self.chan.tree_scores()
        self.req = self.ctx.topo.inter.Irecv(self.chan.tree, source=0, tag=TAG_TREE)
        if req_id != self.request:
            raise PeerError(f"tree for request {req_id} while verifying request {self.request}")
        if len(tokens) == 0:
            self.acked = True
            return
        self._note(meta, len(tokens), scores)
        P = len(committed) - 1
        if root_pos > P or committed[root_pos] != tokens[0]:
            raise PeerError(f"draft tree rooted at position {root_pos} (token {tokens[0]}) does not "
                            f"match the committed sequence (length {len(committed)})")
        fresh = reroot_scored((tokens, parents, scores), committed[root_pos + 1:])
        if fresh is not None and len(fresh[0]) > 1:
            self.local, self.meta = fresh, meta
            self.source = SOURCE["fresh"] if meta.results >= self.results_sent else SOURCE["rerooted"]

    def _ready(self, bs: int) -> bool:
        if self.local is None or len(self.local[0]) < 2:
            return False
        if self.source == SOURCE["fresh"]:
            return True
        if self.wait_fresh:
            return False
        if self.rate is not None and self.rate.ready():
            since = self.ctx.clock.now() - self.result_sent_at.get(self.results_sent, self.ctx.clock.now())
            return not self.rate.prefers_wait(draft_mass(self.local[2][:bs]), since)
        return tree_depth(self.local[1][:bs]) >= self.min_depth

    def next_tree(self, committed: list[int], bs: int, wait_what: str):
        """-> (tokens int64[n <= bs], parents int32[n], nodes at hand) to verify now; blocks
        while the policy's tree is not at hand (`fresh`: the one built on the latest result;
        `rate`: that one unless the rule prefers the tree at hand, or, before the rule has its
        observations, the tree at hand is depth_floor deep)."""
        while self.req.Test():
            self._take(committed)
        while not self._ready(bs):
            wait_for(self.req, self.ctx.cfg.peer_timeout, wait_what, self.ctx.stop_flag, self.ctx.watch)
            self._take(committed)
        self.mass = draft_mass(self.local[2][:bs])
        return self.local[0][:bs], self.local[1][:bs], len(self.local[0])

    def observe_step(self, verify_s: float, accepted_draft: int) -> None:
        """The `rate` rule's running figures: the step just verified (the tree next_tree gave)."""
        if self.rate is not None:
            self.rate.observe_verify(verify_s, self.mass, accepted_draft)

    def drafted(self) -> int:
        """Draft expansions the tree at hand holds from the verify group's previous step."""
        return self.meta.drafted_since(self.results_sent)

    def advance(self, accepted: np.ndarray, sent_s: float) -> None:
        """The step committed `accepted` (draft tokens + bonus), its result sent at job time
        `sent_s`: keep what lies under them."""
        self.local = reroot_scored(self.local, accepted)
        self.source = SOURCE["remnant"]
        self.results_sent += 1
        self.result_sent_at[self.results_sent] = sent_s

    def drain_until_ack(self, committed: list[int]) -> None:
        """End of request: receive every tree still in flight, up to the draft's acknowledgement,
        so nothing of this request is left unmatched."""
        while not self.acked:
            topo = self.ctx.topo
            wait_for(self.req, self.ctx.cfg.peer_timeout, "end-of-request acknowledgement from "
                     f"{topo.describe_rank(topo.verify_size, leader=True)}", self.ctx.stop_flag,
                     self.ctx.watch)
            req_id, _seq, _root, tokens, _parents = self.chan.unpack_tree()
            if len(tokens) == 0 and req_id == self.request:
                self.acked = True
            else:
                if req_id == self.request:
                    self._note(self.chan.tree_meta(), len(tokens), self.chan.tree_scores())
                self.req = self.ctx.topo.inter.Irecv(self.chan.tree, source=0, tag=TAG_TREE)

    def fill_fresh_waits(self, steps: list[tuple]) -> None:
        """Set each step row's fresh_wait_s: from the step's start until the draft sent the tree
        built on the results before it (NaN when none was sent)."""
        for i, row in enumerate(steps):
            sent = self.fresh_sent.get(row[0])
            if sent is not None:
                steps[i] = row[:-1] + (max(0.0, sent - row[3]),)


def verify_loop(ctx: EngineContext, prompt_ids: list[int], request: int, result,
                tracker: OutputTracker | None, acceptor: Acceptor) -> None:
    """The verify group's loop of one `async` request: prefill the target with `prompt_ids`
    (token ids, int), then until the request ends: take the draft's latest tree (tokens int64[n],
    parents int32[n], n <= bs = cfg.verify_size), verify it in one target forward (logits
    [n, vocab] float32, or the greedy argmax int64[n]), accept a path with `acceptor` and send
    the result (accepted node indices and the bonus token) to the draft leader. The group's
    leader records `result` (RequestResult) and feeds `tracker`; other ranks pass None."""
    cfg, rec, clock, topo = ctx.cfg, ctx.recorder, ctx.clock, ctx.topo
    leader = topo.is_leader
    bs = cfg.verify_size
    chan = ctx.scratch.setdefault("chan", LeaderChannel(bs, send_size(cfg)))
    target = TargetSide(ctx.target)
    decision = np.zeros(3 + 2 * bs, dtype=np.int64)   # see context.decide
    # the tree the group verifies, broadcast by the leader: not chan.tree, which is the leader's
    # receive buffer for the draft's next tree (a message arriving during the broadcast would
    # land in the buffer being broadcast)
    step_tree = ctx.scratch.setdefault("step_tree", np.zeros_like(chan.tree))

    t0, c0 = clock.now(), comm_seconds(ctx.target)
    target.prefill(prompt_ids)
    rec.record(KIND["prefill"], request, 0, t0, clock.now(), len(prompt_ids), 0,
               comm_seconds(ctx.target) - c0)
    inbox = TreeInbox(ctx, chan, request) if leader else None
    committed = list(prompt_ids) if leader else None
    draft_leader = topo.describe_rank(topo.verify_size, leader=True)
    wait_what = f"token tree from {draft_leader}"
    step = 0
    while True:
        tw = clock.now()
        if leader:   # a stop signal: the leader tells the group, which leaves together
            try:
                tokens, parents, nodes = inbox.next_tree(committed, bs, wait_what)
                source, drafted = inbox.source, inbox.drafted()
                ctx.check_stop()
                chan.pack_tree(request, step, target.P, tokens, parents, out=step_tree)
            except Interrupted:
                step_tree[0] = MSG_STOP
        ctx.bcast(step_tree)
        if step_tree[0] == MSG_STOP:
            raise Interrupted()
        _req, _seq, root_pos, tokens, parents = chan.unpack_tree(step_tree)
        if root_pos != target.P:
            raise PeerError(f"verify group out of step: tree at position {root_pos}, "
                            f"target KV at {target.P}")
        tv = clock.now()
        rec.record(KIND["wait"], request, step, tw, tv)
        cv = comm_seconds(ctx.target)
        logits = target.forward_tree(tokens, parents, greedy=acceptor.argmax_only)
        done, taken, path, accepted = decide(ctx, tokens, parents, logits, acceptor, tracker, result,
                                             decision, bs, inbox.local[1:] if leader else None)
        a = len(path)
        if not done:
            target.commit(path)
        t_end = clock.now()
        rec.record(KIND["verify"], request, step, tv, t_end, len(tokens), a,
                   comm_seconds(ctx.target) - cv)
        if leader:
            inbox.observe_step(t_end - tv, a - 1)
            result.steps.append(step_row(step, len(tokens), taken, tw, t_end, source,
                                         tree_depth(parents), nodes, drafted))
            ts = clock.now()
            send_within(topo.inter, chan.pack_result(request, step, accepted, done), 0, TAG_RESULT,
                        cfg.peer_timeout, f"delivery of a verify result to {draft_leader}", ctx.watch)
            rec.record(KIND["send"], request, step, ts, clock.now(), a)
            if done:
                try:
                    inbox.drain_until_ack(committed)
                except Interrupted:   # the group stops together at the next request's check
                    pass
                inbox.fill_fresh_waits(result.steps)
            else:
                committed.extend(int(t) for t in accepted)
                inbox.advance(accepted, ts)
            if ctx.on_progress is not None:
                ctx.on_progress()
        if done:
            return
        step += 1


def draft_loop(ctx: EngineContext, prompt_ids: list[int], request: int) -> None:
    """Expand the best leaves (paced, ctx.draft_pace = d > 0: d times after each result, then wait
    for the next; else without pause); after every verify result re-root and send the best
    `send_size` nodes (at once, or under `rate` once depth_floor deep; one tree per batch of
    results); at the end of the request send the acknowledgement (an
    empty tree). A result that arrives during an expansion is seen between its layers, and the
    expansion is abandoned when the re-root would drop all its leaves (abandon.LayerCheck)."""
    cfg, rec, clock, topo = ctx.cfg, ctx.recorder, ctx.clock, ctx.topo
    leader = topo.is_leader
    bs, w, k, m = cfg.verify_size, cfg.tree_width, cfg.tree_topk, send_size(cfg)
    chan = ctx.scratch.setdefault("chan", LeaderChannel(bs, m))
    control = ctx.scratch.setdefault("control", np.zeros(3 + bs, dtype=np.int64))  # [act, a, done, accepted]
    share = make_topk_share(ctx, np.zeros((w, k), dtype=np.int64), np.zeros((w, k), dtype=np.float32))
    draft = DraftSide(ctx.draft, w, k, cfg.tree_capacity, cfg.max_depth, replay=ctx.replay)
    verify_leader = topo.describe_rank(0, leader=True)

    t0, c0 = clock.now(), comm_seconds(ctx.draft)
    draft.prefill(prompt_ids)
    rec.record(KIND["prefill"], request, 0, t0, clock.now(), len(prompt_ids), 0,
               comm_seconds(ctx.draft) - c0)
    owe_tree = True            # the verify group has not seen the current root yet
    result_in = ResultWatch(topo.inter.Irecv(chan.result, source=0, tag=TAG_RESULT), chan.unpack_result) \
        if leader else None
    group_size = topo.group.Get_size()
    seq = 0
    n_expand = 0
    d = int(ctx.draft_pace)
    paced = d > 0
    results, exp_at_result, exp_at_previous = 0, 0, 0   # see protocol.TreeMeta

    floor = depth_floor(cfg)
    to_send = None             # the leader: the subtree deep_enough() found ready to send

    def deep_enough():
        """-> the best m nodes (tokens, parents, scores) to send now, or None: with a depth floor
        (`rate`) only once the best bs of them (their prefix) reach `floor` levels or `floor`
        expansions were made since the result (a bound on the verify group's wait)."""
        sub = draft.best_subtree(m)
        if floor == 0 or n_expand - exp_at_result >= floor or tree_depth(sub[1][:bs]) >= floor:
            return sub
        return None

    def send_tree(tokens, parents, scores):
        meta = TreeMeta(results, n_expand, exp_at_result, exp_at_previous, clock.now())
        send_within(topo.inter, chan.pack_tree(request, seq, draft.tree.root_pos, tokens, parents, meta=meta,
                                               scores=scores),
                    0, TAG_TREE, cfg.peer_timeout, f"delivery of a tree to {verify_leader}", ctx.watch)

    while True:
        # 1. the leader decides what the whole group does next (a stop signal included: the
        #    group then leaves together, none of it blocked in a collective)
        if leader:
            leaves, to_send = None, None
            if ctx.stop_flag:
                action = ACT_STOP
            elif result_in.arrived():   # (perhaps already during the last expansion: abandon.py)
                action = ACT_RESULT
            elif owe_tree and draft.root_expanded() and (to_send := deep_enough()) is not None:
                action = ACT_SEND
            else:
                paced_out = paced and n_expand - exp_at_result >= d and not owe_tree
                leaves = draft.select() if not paced_out else np.zeros(0, dtype=np.int32)
                if len(leaves):
                    action = ACT_EXPAND
                elif owe_tree and draft.root_expanded():   # a depth floor, and the tree cannot grow
                    action = ACT_SEND
                else:   # paced out, or tree (or KV) full: wait for the next verdict
                    tw = clock.now()
                    try:
                        wait_for(result_in.req, cfg.peer_timeout, f"verify result from {verify_leader}",
                                 ctx.stop_flag, ctx.watch)
                        action = ACT_RESULT
                    except Interrupted:
                        action = ACT_STOP
                    rec.record(KIND["wait"], request, n_expand, tw, clock.now())
            control[0] = action
            if action == ACT_RESULT:
                r_req, _r_step, accepted, done = chan.unpack_result()
                if r_req != request:
                    raise PeerError(f"verify result for request {r_req}, draft is on request {request}")
                control[1], control[2] = len(accepted), int(done)
                control[3:3 + len(accepted)] = accepted
                if done:   # acknowledge: no tree of this request will follow
                    send_within(topo.inter, chan.pack_tree(request, seq, 0, np.zeros(0, np.int64),
                                                           np.zeros(0, np.int32)), 0, TAG_TREE,
                                cfg.peer_timeout, f"delivery of a tree to {verify_leader}", ctx.watch)
                else:
                    result_in.rearm(topo.inter.Irecv(chan.result, source=0, tag=TAG_RESULT))
        ctx.bcast(control)
        action = int(control[0])
        # 2. every rank of the group applies it
        if action == ACT_STOP:
            raise Interrupted()
        if action == ACT_RESULT:
            if control[2]:
                return
            tr = clock.now()
            kept = draft.reroot(control[3:3 + int(control[1])].copy(), share)
            rec.record(KIND["reroot"], request, seq, tr, clock.now(), 0, kept)
            owe_tree = True
            results, exp_at_previous, exp_at_result = results + 1, exp_at_result, n_expand
        elif action == ACT_SEND:
            ts = clock.now()
            tokens, parents, scores = to_send if to_send is not None else draft.best_subtree(m)
            if leader:
                send_tree(tokens, parents, scores)
            rec.record(KIND["send"], request, seq, ts, clock.now(), len(tokens))
            owe_tree = False
            seq += 1
        else:
            if not leader:
                leaves = draft.select()
            te, ce = clock.now(), comm_seconds(ctx.draft)
            check = LayerCheck(draft, leaves, request, result_in, group_size, ctx.bcast)
            if not draft.expand(leaves, share, between_layers=check):   # a result came: re-root
                rec.record(KIND["abandon"], request, n_expand, te, clock.now(), len(leaves),
                           check.layers_done, comm_seconds(ctx.draft) - ce)
                continue
            rec.record(KIND["expand"], request, n_expand, te, clock.now(), len(leaves), 0,
                       comm_seconds(ctx.draft) - ce)
            n_expand += 1


def exchange_profile(ctx: EngineContext, mine: dict[int, float], sizes) -> dict[int, float]:
    """Leaders swap their groups' step-time tables {n: seconds} (both sides know `sizes`, the
    keys of the other's table, from the config); the result is broadcast in each group."""
    keys = sorted(mine)
    buf = np.array([mine[k] for k in keys] + [0.0] * (32 - len(keys)), dtype=np.float64)
    other = np.zeros(32, dtype=np.float64)
    if ctx.topo.is_leader:
        ctx.topo.inter.Sendrecv(buf, dest=0, sendtag=5, recvbuf=other, source=0, recvtag=5)
    ctx.bcast(other)
    theirs = sorted(set(sizes))
    return {k: float(other[i]) for i, k in enumerate(theirs)}


__all__ = ["verify_loop", "draft_loop", "exchange_profile", "MPI"]

"""What a decoding loop needs from the job, in one place: topology, models, trace, signals."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from swiftspec_mpi.core.config import RunConfig
from swiftspec_mpi.engine.protocol import AbortWatch, Interrupted, StopFlag
from swiftspec_mpi.core.topology import Topology
from swiftspec_mpi.trace.record import Clock, EventRecorder, verdict_rows


@dataclass
class EngineContext:
    """What a decode loop needs from its job: the run's config, this rank's topology, the clock
    and event recorder, the stop flag and abort watch, the models of this rank's group (target,
    draft; None where the group has none) and the target's tokenizer; `scratch` keeps buffers
    between requests, `expansions` is d (draft forwards per verify in `sync`), `draft_pace` the
    async draft's expansions a step before it waits for the next result (0: no pause), `replay`
    the acceptance model replayed under `run --accept-from` (engine/replay.py)."""
    cfg: RunConfig
    topo: Topology
    clock: Clock
    recorder: EventRecorder
    stop_flag: StopFlag
    watch: AbortWatch
    target: object = None         # Transformer (verify group / single group)
    draft: object = None          # Transformer (draft group / single group in sync)
    tokenizer: object = None      # the target's TextTokenizer (verify leader streams with it)
    expansions: int = 1           # d: draft expansions per verify step (sync)
    draft_pace: int = 0           # async: expansions a step, then wait for the result (0: no pause)
    on_progress: object = None    # callable() the verify leader calls after each step (checkpoints)
    replay: object = None         # replay.Replay when acceptance is replayed (run --accept-from)
    scratch: dict = field(default_factory=dict)

    def check_stop(self) -> None:
        """Raise Interrupted once a SIGTERM / SIGINT arrived on this rank."""
        if self.stop_flag:
            raise Interrupted()

    def check_stop_together(self) -> None:
        """check_stop at a point that every rank of the group reaches in step (the top of a
        request, of a step of `ar` / `sync`): the ranks agree first (the max of their flags), so
        that all of them leave there. One rank leaving alone, its signal a moment before the
        others', would leave them blocked in the group's next collective, rank 0 among them
        before it could write the file."""
        if self.topo.group.Get_size() == 1:
            self.check_stop()
            return
        from mpi4py import MPI
        flag = self.scratch.setdefault("stop_vote", np.zeros(1, dtype=np.int32))
        flag[0] = 1 if self.stop_flag else 0
        self.topo.group.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
        if flag[0]:
            raise Interrupted()

    def bcast(self, buf: np.ndarray) -> np.ndarray:
        """Broadcast a preallocated numpy buffer from the group leader (no-op for 1 rank)."""
        if self.topo.group.Get_size() > 1:
            self.topo.group.Bcast(buf, root=0)
        return buf


def make_topk_share(ctx: "EngineContext", ids_buf: np.ndarray, lps_buf: np.ndarray):
    """-> share(ids, lps) for DraftSide.expand: the group adopts its leader's top-k (None for
    a one-rank group, where there is nothing to share)."""
    if ctx.topo.group.Get_size() == 1:
        return None
    leader = ctx.topo.is_leader

    def share(ids: np.ndarray, lps: np.ndarray):
        n = len(ids)
        if leader:
            ids_buf[:n], lps_buf[:n] = ids, lps
        ctx.topo.group.Bcast(ids_buf, root=0)
        ctx.topo.group.Bcast(lps_buf, root=0)
        return ids_buf[:n].copy(), lps_buf[:n].copy()

    return share


def comm_seconds(model) -> float:
    """Seconds `model`'s tensor-parallel communicator spent in collectives so far (0 without one)."""
    comm = getattr(model, "comm", None)
    return float(getattr(comm, "seconds", 0.0)) if comm is not None else 0.0


def decide(ctx: EngineContext, tokens, parents, logits, acceptor, tracker, result,
           decision: np.ndarray, bs: int, hand=None):
    """The verify leader picks the accepted path of a verified tree and commits its tokens to the
    output; every rank of the group gets the verdict through `decision` (int64 [3 + 2*bs]:
    a, done, tokens taken, path[bs], accepted[bs]). -> (done, taken, path, accepted).
    The leader also records what the target chose at each node (result.verdicts); `hand` =
    (parents int32[m], scores float64[m]) of the tree at hand whose first n nodes were verified
    (scores: the draft's path log-probabilities), for the verdicts' lp fields and a replay."""
    if ctx.topo.is_leader:
        path, accepted = acceptor.accept(tokens, parents, logits, len(result.output_ids), hand)
        logprobs = None
        if acceptor.top_logprobs is not None:
            from swiftspec_mpi.engine.decoding import committed_logprobs   # (torch: not at job import)
            logprobs = committed_logprobs(logits, path, accepted, acceptor.top_logprobs)
        taken, done = tracker.add(accepted, logprobs)
        if result.t_first is None:
            result.t_first = ctx.clock.now()
        a = len(path)
        if len(tokens) > 1:      # a tree (not `ar`'s lone root): what the target chose at each node
            result.verdicts.extend(verdict_rows(len(result.steps), parents, path, accepted, tokens, hand))
        decision[:3] = (a, int(done), taken)
        decision[3:3 + a] = path
        decision[3 + bs:3 + bs + a] = accepted
    ctx.bcast(decision)
    a = int(decision[0])
    return bool(decision[1]), int(decision[2]), decision[3:3 + a].copy(), decision[3 + bs:3 + bs + a].copy()

"""Messages between ranks and waiting with a deadline.

Leader to leader (inter-communicator, async mode), fixed-size int64 buffers allocated once:
  TREE   draft -> verify : [TREE, request, seq, n, root_pos, results, expansions, exp_at_result,
                            exp_at_previous, sent_us, tokens[m], parents[m], scores[m]]  (n <= m)
  RESULT verify -> draft : [RESULT, request, seq, a, done, accepted[bs]]
A tree's `results` counts the verify results the draft had applied when it sent it (0 before the
first); `expansions` is the draft's expansion count of the request at sending, `exp_at_result`
and `exp_at_previous` that count when it applied its latest and the one before (TreeMeta);
`sent_us` is the job clock at sending, in microseconds; `scores` are the nodes' path
log-probabilities under the draft (float64 bits, 0 at the root).
Leader to its group (intra-communicator Bcast, when the group has > 1 rank): the same buffers,
so group members mirror every decision of their leader and their state stays identical.

Every blocking wait polls: a peer that dies or hangs is reported after `timeout` seconds by rank
and role, an abort notice from any rank (TAG_ABORT to world rank 0) is picked up, and SIGTERM
(the `stop_flag`) ends the wait at once.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from swiftspec_mpi.core.errors import PeerError

MSG_TREE, MSG_RESULT, MSG_STOP = 1, 2, 3   # MSG_STOP: a group leader's "we stop here" to its group
TAG_TREE, TAG_RESULT, TAG_ABORT = 11, 12, 99
TAG_TRACE, TAG_TRACE_ASK = 97, 98     # a rank's trace part to world rank 0; rank 0 asking for it
HEADER = 5          # result message header
TREE_HEADER = 10    # tree message header (TreeMeta after the first five)


class TreeMeta(NamedTuple):
    """Where a tree message stands in the draft's work (see the message layout above)."""
    results: int            # verify results the draft had applied when it sent the tree
    expansions: int         # draft expansions of the request at sending
    exp_at_result: int      # ... when it applied its latest result
    exp_at_previous: int    # ... when it applied the result before that
    sent_s: float           # job clock at sending

    def drafted_since(self, results_sent: int) -> int:
        """The draft expansions this tree holds that the draft made after it applied result
        `results_sent - 2`, i.e. while the verify group ran the step before the one that starts
        now (`results_sent` results were sent so far): all of them for a tree built on the
        latest result, those since that result for a tree sent before it, none for older ones."""
        if self.results >= results_sent:
            return self.expansions - self.exp_at_previous
        if self.results == results_sent - 1:
            return self.expansions - self.exp_at_result
        return 0


NO_META = TreeMeta(0, 0, 0, 0, 0.0)


class Interrupted(Exception):
    """SIGTERM/SIGINT arrived: finish up, write what was generated, exit non-zero."""


class StopFlag:
    """Set by the signal handler; checked at step boundaries and inside waits."""

    def __init__(self):
        self.signum = 0

    def set(self, signum, _frame=None):
        self.signum = signum

    def __bool__(self):
        return self.signum != 0


class RemoteFailure(PeerError):
    """Another rank failed and told world rank 0 (abort notice); `str()` names it by rank and role."""

    def __init__(self, rank: int, role: str, message: str):
        super().__init__(f"rank {rank} ({role}) failed: {message}")
        self.rank, self.role, self.message = rank, role, message


class AbortWatch:
    """World rank 0 listens for abort notices from other ranks while it waits."""

    def __init__(self, world: MPI.Intracomm):
        self.world = world
        self.status = MPI.Status()
        self.trace_part = None        # another rank: a callable -> its trace part (send_trace_part)
        self.sent = None              # the send of that part, once rank 0 asked (kept alive)

    def check(self) -> None:
        if self.world.Get_rank() != 0:
            # rank 0 failed and asks for this rank's events before it ends the job (collect_trace_parts)
            if self.sent is None and self.trace_part is not None and \
                    self.world.Iprobe(source=0, tag=TAG_TRACE_ASK):
                self.world.recv(source=0, tag=TAG_TRACE_ASK)
                self.sent = send_trace_part(self.world, self.trace_part())
            return
        if self.world.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_ABORT, status=self.status):
            src = self.status.Get_source()
            msg = self.world.recv(source=src, tag=TAG_ABORT)
            role, sep, rest = str(msg).partition(": ")   # the notice is "ROLE: MESSAGE"
            if not sep:
                role, rest = "?", str(msg)
            raise RemoteFailure(src, role, rest)


def mpi_detail(exc: BaseException) -> str:
    """The last line of an MPI error stack (what failed at the bottom), for one-line messages."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def wait_for(req: MPI.Request, timeout: float, what: str, stop_flag: StopFlag,
             watch: AbortWatch | None = None, collective: bool = False) -> None:
    """Complete `req` or raise: PeerError after `timeout` s, Interrupted on SIGTERM.

    Spins briefly (sub-millisecond latency for the per-step exchange), then sleeps 50 us per poll
    so a waiting rank does not steal a core from a busy one. `collective`: `req` is a
    nonblocking collective (Ibarrier...), which MPI cannot cancel: it is left pending (the
    caller is about to end the job)."""
    start = time.perf_counter()
    spins = 0
    while not _test(req, what):
        spins += 1
        if spins > 2000:
            time.sleep(5e-5)
        if spins % 256 == 0:
            if stop_flag:
                if not collective:
                    req.Cancel()
                    req.Wait()
                raise Interrupted()
            if watch is not None:
                watch.check()
            if time.perf_counter() - start > timeout:
                if not collective:
                    req.Cancel()
                raise PeerError(f"no {what} within {timeout:g} s (--peer-timeout): that rank died, "
                                "hangs or cannot be reached over the network (if it is only slow, raise --peer-timeout)")


def _test(req: MPI.Request, what: str) -> bool:
    """req.Test(), with a failed connection (the peer's process died: a reset) as a PeerError."""
    try:
        return req.Test()
    except MPI.Exception as exc:
        raise PeerError(f"no {what}: the connection failed, so that rank died or its node cannot "
                        f"be reached (MPI: {mpi_detail(exc)})") from None


def send_within(comm, buf: np.ndarray, dest: int, tag: int, timeout: float, what: str,
                watch: AbortWatch | None = None) -> None:
    """comm.Send(buf, dest, tag) that gives up after `timeout` s: a blocking send to a peer whose
    node went silent (a network partition: no reset, the TCP window never reopens) can wait
    forever inside MPI. A signal does not cut it short (it completes at once in every other case)."""
    try:
        req = comm.Isend(buf, dest=dest, tag=tag)
    except MPI.Exception as exc:
        raise PeerError(f"no {what}: the connection failed, so that rank died or its node cannot "
                        f"be reached (MPI: {mpi_detail(exc)})") from None
    wait_for(req, timeout, what, StopFlag(), watch, collective=True)


class LeaderChannel:
    """Fixed message buffers of one leader. A tree message holds up to `send_size` nodes in
    best-first order (parents before children); n = 0 marks the draft's end-of-request
    acknowledgement, after which no more trees of that request are in flight."""

    def __init__(self, verify_size: int, send_size: int | None = None):
        self.bs = verify_size
        self.m = max(verify_size, send_size or verify_size)
        self.tree = np.zeros(TREE_HEADER + 3 * self.m, dtype=np.int64)
        self.result = np.zeros(HEADER + verify_size, dtype=np.int64)

    # -- packing -------------------------------------------------------------------------------
    def pack_tree(self, request: int, seq: int, root_pos: int, tokens: np.ndarray,
                  parents: np.ndarray, out: np.ndarray | None = None,
                  meta: TreeMeta = NO_META, scores: np.ndarray | None = None) -> np.ndarray:
        """Into `out` (shaped like self.tree) or self.tree; `scores` float64[n] (None: zeros)."""
        n = len(tokens)
        b = self.tree if out is None else out
        b[:TREE_HEADER] = (MSG_TREE, request, seq, n, root_pos, meta.results, meta.expansions,
                           meta.exp_at_result, meta.exp_at_previous, round(meta.sent_s * 1e6))
        b[TREE_HEADER:TREE_HEADER + n] = tokens
        b[TREE_HEADER + self.m:TREE_HEADER + self.m + n] = parents
        sc = b[TREE_HEADER + 2 * self.m:TREE_HEADER + 2 * self.m + n].view(np.float64)
        sc[:] = 0.0 if scores is None else scores
        return b

    def unpack_tree(self, buf: np.ndarray | None = None) -> tuple[int, int, int, np.ndarray, np.ndarray]:
        """-> (request, seq, root_pos, tokens int64[n], parents int32[n]) from `buf` or self.tree."""
        b = self.tree if buf is None else buf
        if b[0] != MSG_TREE:
            raise PeerError(f"protocol error: expected a tree message, got kind {b[0]}")
        n = int(b[3])
        return int(b[1]), int(b[2]), int(b[4]), b[TREE_HEADER:TREE_HEADER + n].copy(), \
            b[TREE_HEADER + self.m:TREE_HEADER + self.m + n].astype(np.int32)

    def tree_scores(self, buf: np.ndarray | None = None) -> np.ndarray:
        """-> the path log-probabilities float64[n] of the tree message in `buf` or self.tree."""
        b = self.tree if buf is None else buf
        n = int(b[3])
        return b[TREE_HEADER + 2 * self.m:TREE_HEADER + 2 * self.m + n].view(np.float64).copy()

    def tree_meta(self, buf: np.ndarray | None = None) -> TreeMeta:
        """The TreeMeta of the tree message in `buf` or self.tree."""
        b = self.tree if buf is None else buf
        return TreeMeta(int(b[5]), int(b[6]), int(b[7]), int(b[8]), float(b[9]) * 1e-6)

    def pack_result(self, request: int, seq: int, accepted: np.ndarray, done: bool) -> np.ndarray:
        a = len(accepted)
        b = self.result
        b[:HEADER] = (MSG_RESULT, request, seq, a, int(done))
        b[HEADER:HEADER + a] = accepted
        return b

    def unpack_result(self) -> tuple[int, int, np.ndarray, bool]:
        b = self.result
        if b[0] != MSG_RESULT:
            raise PeerError(f"protocol error: expected a result message, got kind {b[0]}")
        a = int(b[3])
        return int(b[1]), int(b[2]), b[HEADER:HEADER + a].copy(), bool(b[4])


def notify_rank0_and_abort(world: MPI.Intracomm, message: str, code: int, grace_s: float = 5.0,
                           fallback_line: str | None = None) -> None:
    """A failing rank other than 0 tells rank 0 (which prints the error once, writes the partial
    output and aborts the job), waits a little for that, then aborts the job itself. When rank 0
    did not end the job within the grace period (it is stuck in a collective, or dead), this rank
    prints `fallback_line` itself, so the error is never lost."""
    import sys
    try:
        req = world.isend(message, dest=0, tag=TAG_ABORT)
        deadline = time.perf_counter() + grace_s
        while time.perf_counter() < deadline:
            if req.Test():
                pass
            time.sleep(0.01)
        if fallback_line:
            print(fallback_line, file=sys.stderr, flush=True)
    finally:
        world.Abort(code)


_UNWAITED: list = []     # sends of the last moments of a job, kept alive until the process ends


def send_trace_part(world: MPI.Intracomm, part) -> MPI.Request:
    """A rank other than 0 at the end of the job: its trace part (events, rank row) to world rank
    0, which collects them with a deadline (collect_trace_parts). Nonblocking: keep the request
    until the job ends (a rank 0 that is gone never completes it)."""
    return world.isend(part, dest=0, tag=TAG_TRACE)


def collect_trace_parts(world: MPI.Intracomm, own, deadline: float, ask: bool = False) -> tuple[list, list[int]]:
    """World rank 0: every rank's trace part (its own `own`), until time.monotonic() passes
    `deadline`. `ask`: first ask every rank for it (rank 0 failed: the others learn it in their
    waits through AbortWatch.check). -> (the parts received, rank order; the ranks that sent none)."""
    size = world.Get_size()
    asks = [world.isend(None, dest=r, tag=TAG_TRACE_ASK) for r in range(1, size)] if ask else []
    got = {0: own}
    status = MPI.Status()
    try:
        while len(got) < size and time.monotonic() < deadline:
            if world.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_TRACE, status=status):
                src = status.Get_source()
                got[src] = world.recv(source=src, tag=TAG_TRACE)
            else:
                time.sleep(0.002)
    except MPI.Exception:       # a connection that failed: what came stays, the rest is missing
        pass
    _UNWAITED.extend(asks)      # never waited on (a rank that does not answer may be dead): kept
    return [got[r] for r in sorted(got)], [r for r in range(size) if r not in got]

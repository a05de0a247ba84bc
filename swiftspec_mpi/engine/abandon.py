"""The draft's check for a verify result between the layers of an expansion (`async`).

A draft expansion is one forward of the draft model through all its layers (~118 ms for the
0.5B on a CPU core). A verify result that arrives during it used to wait for its end; when
none of the leaves being expanded survives the re-root on that result (the bonus token lies
outside their branches), the expansion's nodes and KV are dropped by the re-root anyway, and the
wait only delays the tree the verify group is (or soon will be) waiting for. So the draft leader
polls the result's receive between layers; when the result is in and `should_abandon` says so,
the forward stops at that layer boundary, `DraftSide.expand` leaves the tree and the KV as they
were before it (decoding.py), and the loop goes straight to the re-root. An expansion with a
surviving leaf is finished: its nodes would be kept, and a restart would redo its layers.

Tensor-parallel draft groups: every rank must stop at the same layer (the all-reduces pair up),
and only the leader holds the receive. The leader decides at every `TP_CHECK_EVERY`-th layer
boundary (and after the last layer) and broadcasts its decision in the group (one int64, the
group's MPI communicator); a one-rank group checks every boundary and broadcasts nothing.
A graphed draft (GPU, CUDA graph) replays its forward whole: no check there.
"""
from __future__ import annotations

import numpy as np

TP_CHECK_EVERY = 4   # layers between the decisions of a multi-rank draft group (one bcast each)


def should_abandon(draft, leaves: np.ndarray, accepted: np.ndarray, done: bool) -> bool:
    """The leader's rule, once a result (`accepted` int64[k]: draft tokens + bonus; `done`: the
    request ended) arrived during the expansion of `leaves` (int32[n]) of `draft` (DraftSide):
    abandon when the request ended or no leaf survives the re-root. (Tests replace it with
    one that always abandons, to exercise the abandoned path on every result.)"""
    return done or not draft.expansion_survives(leaves, accepted)


class ResultWatch:
    """The draft leader's view of the verify result's receive (`req`, an MPI request on the
    inter-communicator; `unpack()` -> (request, step, accepted int64[k], done) reads the
    arrived message). `arrived()` tests it once more until it completed; the loop calls
    `rearm(req)` after taking the result."""

    def __init__(self, req, unpack):
        self.req, self.unpack = req, unpack
        self.done = False

    def arrived(self) -> bool:
        if not self.done and self.req.Test():
            self.done = True
        return self.done

    def rearm(self, req) -> None:
        self.req, self.done = req, False


class LayerCheck:
    """Transformer.forward's `between_layers` for one expansion of `leaves` (int32[n]).

    Called as check(done, total) on every rank of the draft group after each layer; returns
    True to stop. The leader (watch = its ResultWatch) decides once the result arrived: with
    `should_abandon` when the message belongs to `request`, at once when it does not (the loop
    then reports the protocol error); the decision is then fixed for the rest of the forward.
    Members (watch None) learn it through `bcast` (EngineContext.bcast: the group leader's
    buffer to every rank; a no-op for one rank). `layers_done` is the layer it stopped after
    (0: it ran to the end)."""

    def __init__(self, draft, leaves: np.ndarray, request: int, watch: ResultWatch | None,
                 group_size: int, bcast):
        self.draft, self.leaves, self.request, self.watch = draft, leaves, request, watch
        self.every = 1 if group_size == 1 else TP_CHECK_EVERY
        self.bcast = bcast if group_size > 1 else None
        self.flag = np.zeros(1, dtype=np.int64)
        self.decision: bool | None = None     # the leader's, once the result arrived
        self.layers_done = 0

    def _decide(self) -> bool:
        if self.decision is None and self.watch.arrived():
            req, _step, accepted, done = self.watch.unpack()
            self.decision = req != self.request or should_abandon(self.draft, self.leaves, accepted, done)
        return bool(self.decision)

    def __call__(self, done: int, total: int) -> bool:
        if done % self.every and done != total:
            return False
        if self.bcast is None:
            stop = self._decide()
        else:
            if self.watch is not None:
                self.flag[0] = int(self._decide())
            self.bcast(self.flag)
            stop = bool(self.flag[0])
        if stop:
            self.layers_done = done
        return stop

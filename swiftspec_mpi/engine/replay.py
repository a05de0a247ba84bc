"""Acceptance replayed from a model (`run --load-format dummy --accept-from FILE`): every kernel
and message runs on the real shapes, but at each node of a verified tree the target's choice is
drawn from the acceptance model (trace/acceptance.py) instead of read from its random logits, so
trees are accepted as deeply as the real pair's were.

Two halves:
- the target (`ReplayAcceptor`, on the verify leader, in place of decoding.Acceptor): walking
  down from the root, at a node of depth d with c children (best-first, so in the draft's
  probability order) it draws r from the model's row d: rank 1..K with p[d][r-1], none with
  p_none[d]. r <= c accepts that child and goes on; otherwise the step ends there and the bonus
  token is the target's argmax at the node (the next token not among the children's when the
  random argmax happens to be one of them). Draws come from (seed, request), so a `sync` run is
  reproducible; in `async` the trees depend on timing, the draws on the seed.
- the draft (`calibrate`, in DraftSide.expand): random weights have near-uniform top-k, so the
  tree a draft grows from them has no shape. The log-probabilities of a leaf's top-k children
  become those of a node of the real draft at that depth, drawn from the model's
  `draft_lp_samples`, so the replayed draft grows trees of the real draft's shapes; a model without them (one built from a
  reported mean accepted length) gives log p[d][r]: a draft calibrated to acceptance, which
  grows the tree with the most expected accepted tokens under the model.
The tokens themselves stay the random model's: the text means nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from swiftspec_mpi.gpu.graphs import logits_argmax

FLOOR_LOGPROB = -30.0      # log-probability of a rank the model never accepts (keeps scores finite)


class Replay(NamedTuple):
    """What a replaying job's ranks hold (EngineContext.replay): `table` float64[D, K + 1]
    (acceptance.probs), `draft_lp` per depth float64[S, topk] or None (acceptance.draft_logprobs),
    `rng` the draft's draws of them (seeded alike on every rank of a group, so their trees agree)."""
    table: np.ndarray
    draft_lp: list | None
    rng: np.random.Generator

    @classmethod
    def of(cls, model: dict, topk: int, seed: int) -> "Replay":
        from swiftspec_mpi.trace.acceptance import draft_logprobs, probs
        return cls(probs(model), draft_logprobs(model, topk), np.random.default_rng([seed, 3]))


class ReplayAcceptor:
    """decoding.Acceptor's interface (greedy: the verify forward returns the target's argmax);
    `table` float64[D, K + 1] from acceptance.probs."""

    temperature = 0.0
    rule = "replay"

    def __init__(self, table: np.ndarray, seed: int):
        self.table = np.asarray(table, dtype=np.float64)
        self.cdf = np.cumsum(self.table, axis=1)
        self.cdf[:, -1] = 1.0
        self.seed = seed
        self.top_logprobs = None
        self.rng = np.random.default_rng([seed, 0, 2])

    greedy = True
    argmax_only = True

    def start_request(self, request_index: int, max_new_tokens: int, verify_size: int) -> None:
        self.rng = np.random.default_rng([self.seed, request_index, 2])

    def draw(self, depth: int) -> int:
        """A rank 1..K from row `depth` (the last row past it), or 0 for none."""
        row = self.cdf[min(depth, len(self.cdf) - 1)]
        r = int(np.searchsorted(row, self.rng.random(), side="right"))
        return r + 1 if r < len(row) - 1 else 0

    def accept(self, tokens: np.ndarray, parents: np.ndarray, logits, out_len: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """-> (path int32[a] from the root, accepted int64[a]: draft tokens + the bonus), as
        decoding.Acceptor.accept; `logits` the target's argmax int64[n] (or logits [n, vocab])."""
        choice = logits if isinstance(logits, np.ndarray) else logits_argmax(logits)
        parents = np.asarray(parents)
        path, accepted = [0], []
        node, depth = 0, 0
        while True:
            kids = np.flatnonzero(parents == node)          # best-first: the draft's rank order
            r = self.draw(depth) if len(kids) else 0
            if 1 <= r <= len(kids):
                node = int(kids[r - 1])
                path.append(node)
                accepted.append(int(tokens[node]))
                depth += 1
                continue
            taken = {int(t) for t in tokens[kids]}
            bonus = int(choice[node])
            if bonus in taken:                               # a rejection: not one of the children
                bonus = next(t for t in range(len(taken) + 1) if t not in taken)
            accepted.append(bonus)
            return np.asarray(path, dtype=np.int32), np.asarray(accepted, dtype=np.int64)


def calibrate(replay: Replay, depths: np.ndarray, k: int) -> np.ndarray:
    """float32[n, k]: the log-probabilities the replayed draft gives the top-k children of leaves
    at `depths` int[n]: each leaf draws one of the real draft's nodes at its depth (draft_lp) when
    the model has them, else log p[d][r] (a draft calibrated to acceptance; FLOOR_LOGPROB where
    the model gives 0)."""
    table = replay.table
    if replay.draft_lp is not None:
        out = np.empty((len(depths), k), dtype=np.float32)
        for i, dep in enumerate(np.asarray(depths).tolist()):
            rows = replay.draft_lp[min(int(dep), len(replay.draft_lp) - 1)]
            out[i] = rows[replay.rng.integers(len(rows)), :k]
        return out
    d = np.minimum(np.asarray(depths, dtype=np.int64), len(table) - 1)
    K = table.shape[1] - 1
    p = np.zeros((len(d), k))
    m = min(k, K)
    p[:, :m] = table[d, :m]
    with np.errstate(divide="ignore"):
        lp = np.where(p > 0, np.log(np.maximum(p, 1e-300)), FLOOR_LOGPROB)
    # equal probabilities would tie: keep the draft's rank order strictly
    lp = lp - 1e-6 * np.arange(k)[None, :]
    return lp.astype(np.float32)

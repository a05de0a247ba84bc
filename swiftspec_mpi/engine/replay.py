"""Acceptance replayed from a model (`run --load-format dummy --accept-from FILE`): every kernel
and message runs on the real shapes, but at each node of a verified tree the target's choice is
drawn from the acceptance model (trace/acceptance.py) instead of read from its random logits, so
trees are accepted as deeply as the real pair's were.

Two halves:
- the target (`ReplayAcceptor`, on the verify leader, in place of decoding.Acceptor): walking
  down from the root, at a node of depth d with c children (best-first, so in the draft's
  probability order) it draws r from the model's row of depth d and of the draft's confidence
  there (the bucket of its first child's log-probability): rank 1..K with p[d][r-1], none with
  p_none[d]. r <= c accepts that child and goes on; otherwise the step ends there and the bonus
  token is the draft's rank-r child (which the draft may have grown without sending it; its
  token is known, `child_tokens`), or for none a token that is not among the draft's top-k.
  Draws come from (seed, request), so a `sync` run is reproducible; in `async` the trees depend
  on timing, the draws on the seed.
- the draft (`calibrate` and `child_tokens`, in DraftSide.expand): random weights have
  near-uniform top-k, so the tree a draft grows from them has no shape. The log-probabilities of
  a leaf's top-k children become those of a node of the real draft (any depth) whose own
  log-probability fell in the leaf's bucket, drawn from the model's samples, so the replayed
  draft grows trees of the real draft's shapes; a model without samples (one built from a
  reported mean accepted length) gives log p[d][r]: a draft calibrated to acceptance, which
  grows the tree with the most expected accepted tokens under the model.
The tokens are not the random model's either (child_tokens: a function of the parent's token
and the rank): the text means nothing, and every request runs to --max-new-tokens.
"""
from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import numpy as np

from swiftspec_mpi.trace.acceptance import confidence_bucket, conf_edges, draft_logprobs, probs

FLOOR_LOGPROB = -30.0      # log-probability of a rank the model never accepts (keeps scores finite)


class Replay(NamedTuple):
    """What a replaying job's ranks hold (EngineContext.replay): `table` float64[D, B + 1, K + 1]
    (acceptance.probs by confidence bucket, [:, B] the depth's own row), `draft_lp` the real
    draft's log-probabilities to draw from or None (acceptance.draft_logprobs' B + 1 tables
    stacked: (rows float32[S, topk], first row int64[B + 1], rows int64[B + 1]) of bucket b, B
    for an unknown confidence), `rng` the draft's draws of them (seeded alike on every rank of a
    group, so that their trees agree), `vocab` the modulus of child_tokens (the smaller
    vocabulary of the pair), `edges` float64[B - 1] the model's confidence bucket edges
    (acceptance.conf_edges)."""
    table: np.ndarray
    draft_lp: tuple | None
    rng: np.random.Generator
    vocab: int
    edges: np.ndarray

    @classmethod
    def of(cls, model: dict, topk: int, seed: int, vocab: int) -> "Replay":
        tables = draft_logprobs(model, topk)
        lp = None
        if tables is not None:
            sizes = np.array([len(t) for t in tables], dtype=np.int64)
            lp = (np.concatenate(tables).astype(np.float32), np.cumsum(sizes) - sizes, sizes)
        return cls(probs(model, by_confidence=True), lp, np.random.default_rng([seed, 3]), vocab,
                   np.asarray(conf_edges(model), dtype=np.float64))

    def acceptor(self, seed: int, topk: int) -> "ReplayAcceptor":
        """The target's side of this replay: a ReplayAcceptor over its table and bucket edges."""
        return ReplayAcceptor(self.table, seed, topk, self.vocab, self.edges)


def draft_children(replay: Replay, tree, leaves: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64[n, k], lps float32[n, k]): the replayed draft's top-k children of `leaves`
    int32[n] of `tree` (scheduler TokenTree): child_tokens, and calibrate's log-probabilities
    drawn by the leaves' own (edge) log-probabilities, the root's unknown. A few numpy calls an
    expansion (15 us; still a fifth of the tiny CPU draft's forward once the forward has cooled
    the caches, which shifts `async`'s timing a little but not its tokens a step)."""
    own = np.asarray(tree.logprob)[leaves]
    own[leaves == 0] = np.nan
    lps = calibrate(replay, np.asarray(tree.depth)[leaves], k, own)
    return child_tokens(np.asarray(tree.token)[leaves], k, replay.vocab), lps


def child_tokens(parents: np.ndarray, k: int, vocab: int) -> np.ndarray:
    """int64[n, k]: the replayed draft's top-k children of nodes holding tokens `parents` int[n],
    rank r (1-based) at column r - 1: (parent * k + r - 1) mod vocab, distinct among siblings
    (vocab > k). A function of the parent's token alone, so that the verify leader knows the
    token of a child it was not sent (the bonus token when the model picks a rank the verified
    tree did not hold), as the real target's bonus is often a child the draft grew but did not send."""
    p = np.asarray(parents, dtype=np.int64).reshape(-1, 1)
    return (p * k + np.arange(k, dtype=np.int64)[None, :]) % vocab


def _bucket(lp: float, edges: list[float]) -> int:
    """acceptance.confidence_bucket of one log-probability (-1 for NaN), without numpy."""
    if not math.isfinite(lp):
        return -1
    return sum(lp >= e for e in edges)


class ReplayAcceptor:
    """decoding.Acceptor's interface (greedy: the verify forward returns the target's argmax);
    `table` float64[D, B + 1, K + 1] from acceptance.probs(by_confidence=True), `edges` its
    B - 1 confidence bucket edges (Replay.edges)."""

    temperature = 0.0
    rule = "replay"

    def __init__(self, table: np.ndarray, seed: int, topk: int, vocab: int, edges: np.ndarray):
        self.table = np.asarray(table, dtype=np.float64)
        self.edges = [float(e) for e in edges]
        self.topk, self.vocab = topk, vocab
        self.cdf = np.cumsum(self.table, axis=2)
        self.cdf[:, :, -1] = 1.0
        self.cdf_rows = self.cdf.tolist()     # [depth][bucket] lists: bisect, no numpy call a draw
        self.seed = seed
        self.top_logprobs = None
        self.rng = np.random.default_rng([seed, 0, 2])

    greedy = True
    argmax_only = True

    def start_request(self, request_index: int, max_new_tokens: int, verify_size: int) -> None:
        self.rng = np.random.default_rng([self.seed, request_index, 2])

    def draw(self, depth: int, bucket: int = -1) -> int:
        """A rank 1..K from row `depth` (the last row past it) of confidence `bucket` (-1:
        unknown, the depth's own row), or 0 for none."""
        row = self.cdf_rows[min(depth, len(self.cdf_rows) - 1)][bucket]
        r = bisect.bisect_right(row, self.rng.random())
        return r + 1 if r < len(row) - 1 else 0

    def accept(self, tokens: np.ndarray, parents: np.ndarray, logits, out_len: int, hand=None
               ) -> tuple[np.ndarray, np.ndarray]:
        """-> (path int32[a] from the root, accepted int64[a]: draft tokens + the bonus), as
        decoding.Acceptor.accept (`logits`, the target's, are not read). `hand` = (parents
        int32[m], scores float64[m]) of the tree at hand whose first n nodes are the verified
        tree (scores: the draft's path log-probabilities) gives the draft's confidence at each
        node, the log-probability of its first child there, as the verdicts the model was
        estimated from record it (trace.record.verdict_rows): the row of its bucket is drawn from.
        So a leaf of the verified tree that the draft expanded has its confidence too: the target
        takes a sure draft's first child there as often as the model says, the bonus the draft
        grew on (an unknown bucket, the depth's average row, took it less often after a sure leaf
        and re-rooted the draft on shallower trees)."""
        children = [[] for _ in range(len(parents))]   # best-first: the draft's rank order
        for i, p in enumerate(np.asarray(parents).tolist()[1:], start=1):
            children[p].append(i)
        conf = [float("nan")] * len(parents)           # the draft's lp of each node's first child
        if hand is not None:
            score = np.asarray(hand[1], dtype=np.float64).tolist()
            for i, p in enumerate(np.asarray(hand[0]).tolist()[1:], start=1):
                if p < len(conf) and math.isnan(conf[p]):
                    conf[p] = score[i] - score[p]
        path, accepted = [0], []
        node, depth = 0, 0
        while True:
            kids = children[node]
            bucket = _bucket(conf[node], self.edges)
            r = self.draw(depth, bucket)
            if 1 <= r <= len(kids):
                node = int(kids[r - 1])
                path.append(node)
                accepted.append(int(tokens[node]))
                depth += 1
                continue
            # the bonus: the draft's rank-r child (one the verified tree did not hold), or for
            # none of them the token after the draft's top-k (child_tokens' next value)
            parent_tok = int(tokens[node])
            accepted.append(int((parent_tok * self.topk + (r - 1 if r else self.topk)) % self.vocab))
            return np.asarray(path, dtype=np.int32), np.asarray(accepted, dtype=np.int64)


def calibrate(replay: Replay, depths: np.ndarray, k: int, own: np.ndarray | None = None) -> np.ndarray:
    """float32[n, k]: the log-probabilities the replayed draft gives the top-k children of leaves
    at `depths` int[n] whose own log-probabilities (their parents' for them; NaN: unknown, the
    root) are `own` float[n]: each leaf draws one of the real draft's nodes whose own
    log-probability fell in the same confidence bucket (draft_lp, pooled over depths), so that a
    sure path goes on sure as the real draft's do; a model without them gives log p[d][r] (a
    draft calibrated to acceptance; FLOOR_LOGPROB where the model gives 0). One vectorized draw
    (the replay's own host time stays small beside a real draft's forward)."""
    n = len(depths)
    if replay.draft_lp is not None:
        rows, first, size = replay.draft_lp
        b = np.full(n, -1) if own is None else confidence_bucket(own, replay.edges)
        b[b < 0] = len(first) - 1                 # unknown: the last row
        pick = first[b] + (replay.rng.random(n) * size[b]).astype(np.int64)
        return rows[pick, :k]
    table = replay.table[:, -1]
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

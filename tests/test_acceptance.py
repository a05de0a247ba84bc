"""The acceptance model (trace/acceptance.py), its replay (engine/replay.py) and the throughput
model behind `swiftspec plan` (engine/throughput.py), without MPI: synthetic verdicts with a
known answer, the replay's draws and bonus tokens, the simulation's exact cases."""
from __future__ import annotations

import json

import numpy as np
import pytest

from swiftspec_mpi.core.errors import UserError
from swiftspec_mpi.engine import throughput as T
from swiftspec_mpi.engine.replay import ReplayAcceptor, child_tokens
from swiftspec_mpi.trace import acceptance as A
from swiftspec_mpi.trace.record import verdict_rows


def synthetic_verdicts(p: list[float], n: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n decision nodes at depth 0 whose target rank is drawn from p (ranks 1..K, rest none),
    each shown with 1..K children at random (censored beyond them)."""
    K = len(p)
    rank = rng.choice(K + 1, size=n, p=list(p) + [1 - sum(p)])
    rank = np.where(rank == K, 0, rank + 1)
    children = rng.integers(1, K + 1, size=n)
    seen = np.where((rank >= 1) & (rank <= children), rank, 0)
    return np.zeros(n, np.int64), children.astype(np.int64), seen.astype(np.int64)


def test_censored_ranks_are_estimated_not_counted_as_none():
    """Nodes show only some children: the hazard estimate recovers the true rank shares; the
    raw share of "none of the children" would not."""
    rng = np.random.default_rng(0)
    truth = [0.6, 0.2, 0.1]
    depth, children, seen = synthetic_verdicts(truth, 20000, rng)
    row = A.estimate(depth, children, seen, topk=3)[0]
    assert np.allclose(row["p"], truth, atol=0.015)
    assert abs(row["p_none"] - 0.1) < 0.015
    assert (seen == 0).mean() > 0.2       # what counting would have called "none"


def test_verdict_rows_rank_by_sibling_order():
    """Siblings in best-first order: the target's token's place among them is its draft rank;
    a bonus that is none of them is rank 0; the draft's log-probabilities are the score steps of
    the tree at hand, past the verified nodes (its first n)."""
    tokens = np.array([5, 10, 11, 12, 20], dtype=np.int64)
    hand_parents = np.array([-1, 0, 0, 0, 2, 2], dtype=np.int32)      # the verified tree: 5 first
    hand_scores = np.array([0.0, -0.5, -1.0, -2.0, -1.5, -3.0])
    rows = verdict_rows(3, hand_parents[:5], np.array([0, 2]), np.array([11, 99]), tokens,
                        (hand_parents, hand_scores))
    assert [r[:4] for r in rows] == [(3, 0, 3, 2), (3, 1, 1, 0)]
    assert rows[0][4:] == pytest.approx((-0.5, -1.0, -2.0))
    assert rows[1][4:6] == pytest.approx((-0.5, -2.0)) and np.isnan(rows[1][6])


def test_model_file_round_trip_and_bad_files(tmp_path):
    model = A.chain_model(3.0, 8)
    path = tmp_path / "m.json"
    A.write_model(model, str(path))
    back, sha = A.load(str(path))
    assert back["depths"] == model["depths"] and len(sha) == 64
    assert A.model_mean_tokens(back, 8) == pytest.approx(3.0, abs=1e-3)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "swiftspec-acceptance", "depths": [{"p": [0.9, 0.3]}]}))
    with pytest.raises(UserError, match="summing to at most 1"):
        A.load(str(tmp_path / "bad.json"))
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(UserError, match="neither an HDF5 trace nor JSON"):
        A.load(str(tmp_path / "x.json"))
    with pytest.raises(UserError, match="no such file"):
        A.load(str(tmp_path / "missing.json"))


def test_replay_draws_follow_the_model_and_the_bonus_is_the_drawn_child():
    """Depth-0 draws match the model's shares; a drawn rank the tree does not hold gives that
    child's token (child_tokens) as the bonus, none gives a token outside the draft's top-k."""
    model = A.chain_model(2.0, 4)
    model["depths"][0]["p"] = [0.5, 0.3, 0.1] + [0.0] * 5
    table = A.probs(model, by_confidence=True)
    acc = ReplayAcceptor(table, seed=1, topk=8, vocab=1000, edges=A.conf_edges(model))
    acc.start_request(0, 0, 2)
    tokens = np.array([7], dtype=np.int64)               # a bare root: every draw ends the step
    parents = np.array([-1], dtype=np.int32)
    kids = child_tokens(np.array([7]), 8, 1000)[0]
    bonus = [int(acc.accept(tokens, parents, None, 0)[1][0]) for _ in range(4000)]
    share = [np.mean([b == kids[r] for b in bonus]) for r in range(3)]
    assert np.allclose(share, [0.5, 0.3, 0.1], atol=0.03)
    assert np.mean([b not in kids for b in bonus]) == pytest.approx(0.1, abs=0.03)
    assert len(set(child_tokens(np.array([999]), 8, 1000)[0].tolist())) == 8


def test_a_thin_confidence_bucket_takes_its_nodes_of_every_depth():
    """At each of depths 0 and 1, 30 unsure nodes (p = 0.1, rank 2) and 12 sure ones (p = 0.9,
    rank 1): 12 is too few for a row of its own at a depth, so the sure bucket's row is that of
    its 24 nodes over both depths (first child always), not the depth's mix; the file names its
    edges, and a model without them reads as the legacy ones."""
    depth = np.repeat([0, 1], 42)
    sure = np.tile(np.r_[np.zeros(30, bool), np.ones(12, bool)], 2)
    lp = np.full((84, 4), np.nan)
    lp[:, 0] = np.where(sure, np.log(0.9), np.log(0.1))
    rows = A.estimate(depth, np.full(84, 3), np.where(sure, 1, 2), 3, lp)
    model = {"depths": rows, "conf_edges": list(A.CONF_EDGES)}
    table = A.probs(model, by_confidence=True)
    b_sure = int(A.confidence_bucket(np.log(0.9)))
    assert b_sure == len(A.CONF_EDGES) and table.shape[1] == len(A.CONF_EDGES) + 2
    for d in (0, 1):
        assert table[d, b_sure, 0] == pytest.approx(1.0) and table[d, -1, 0] == pytest.approx(12 / 42)
    assert A.conf_edges({"depths": rows}) == A.LEGACY_EDGES


def test_replay_reads_the_confidence_of_a_verified_leaf_in_the_tree_at_hand():
    """A model whose target takes the first child only where the draft is sure (p > 0.8): at a
    bare verified root the draw reads the draft's confidence from the tree at hand (a child of
    p = 0.9 there: the bonus is that child); without the tree at hand it is unknown (none)."""
    B = len(A.CONF_EDGES) + 1
    table = np.zeros((1, B + 1, 9))
    table[:, :, -1] = 1.0
    table[0, B - 1] = [1.0] + [0.0] * 8
    acc = ReplayAcceptor(table, seed=0, topk=8, vocab=1000, edges=np.asarray(A.CONF_EDGES))
    acc.start_request(0, 0, 2)
    tokens, parents = np.array([7], dtype=np.int64), np.array([-1], dtype=np.int32)
    kids = child_tokens(np.array([7]), 8, 1000)[0]
    hand = (np.array([-1, 0], dtype=np.int32), np.array([0.0, np.log(0.9)]))
    assert int(acc.accept(tokens, parents, None, 0, hand)[1][0]) == kids[0]
    assert int(acc.accept(tokens, parents, None, 0)[1][0]) not in kids


def test_simulation_exact_cases():
    """A target that always takes the draft's first choice: a sync chain of d expansions commits
    d + 1 tokens the first step, then d + 2 (the bonus is a leaf the draft had not expanded: the
    re-root's hole fill expands the new root, one forward more a step); one that never agrees
    commits 1."""
    sure = A.chain_model(2.0, 4)
    for row in sure["depths"]:
        row["p"] = [1.0] + [0.0] * 7
    tokens, extra = T.simulate(sure, "sync", 8, 1, 3, steps=60)
    assert tokens == pytest.approx((4 + 5 * 59) / 60) and extra == pytest.approx(59 / 60)
    never = A.chain_model(2.0, 4)
    for row in never["depths"]:
        row["p"] = [0.0] * 8
    assert T.simulate(never, "sync", 8, 8, 2, steps=60)[0] == pytest.approx(1.0)
    assert T.simulate(never, "async", 8, 8, 2, steps=60)[0] == pytest.approx(1.0)


def test_throughput_rules_and_candidates():
    """Step times by the documented rules; candidates leave out group sizes that do not divide
    the heads; evaluate ranks by tok/s."""
    c = T.Candidate("sync", 0, 2, 8, 8, 3)
    assert T.step_seconds(c, 0.010, 0.001, 0.0) == pytest.approx(0.013)
    a = T.Candidate("async", 1, 1, 8, 8, 0)
    assert T.async_expansions(0.010, 0.003, 0.0005) == 3
    a.stall = 0.5
    assert T.step_seconds(a, 0.010, 0.002, 0.0005) == pytest.approx(0.0115)
    cands = T.candidates(3, [4], (4, 3), 2, False)   # sync on 3 and a draft group of 2 do not divide
    assert {(x.mode, x.draft_ranks, x.verify_ranks) for x in cands} == {("async", 1, 2)}
    assert T.scaled_times({8: 0.02}, 4, 80, 1e-5)[8] == pytest.approx(0.005 + 160e-5)
    c.host_s, c.host_x = 0.002, 0.0005                  # host a step, an expansion
    assert T.step_seconds(c, 0.010, 0.001, 0.0) == pytest.approx(0.013 + 0.002 + 3 * 0.0005)
    a.host_s, a.host_x = 0.001, 0.0002
    assert T.step_seconds(a, 0.010, 0.002, 0.0005) == pytest.approx(0.0105 + 0.001 + 0.5 * 0.0022)
    a.host_measured = True                              # the async loop's own wall: stalls in it
    assert T.step_seconds(a, 0.010, 0.002, 0.0005) == pytest.approx(0.0115)
    assert T.async_expansions(0.010, 0.003, 0.0005, 0.0025, 0.001) == 3

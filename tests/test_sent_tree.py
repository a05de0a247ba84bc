"""The verify leader's re-rooting of a sent tree (tokens, parents, path log-probabilities) agrees
with the scheduler's own reroot; the draft mass the `rate` policy weighs."""
import numpy as np
from hypothesis import given, settings, strategies as st

from swiftspec_mpi import _tree
from swiftspec_mpi.engine.sent_tree import draft_mass, reroot_scored


def _grow(seed: int, rounds: int):
    rng = np.random.default_rng(seed)
    tree = _tree.TokenTree(512, 12)
    tree.reset(7, 10)
    slot = 10
    for _ in range(rounds):
        leaves = tree.select_leaves(3)
        if len(leaves) == 0:
            break
        tree.assign_slots(leaves, slot)
        slot += len(leaves)
        ids = rng.choice(50, size=(len(leaves), 3), replace=False if len(leaves) * 3 <= 50 else True)
        ids = np.stack([rng.choice(50, 3, replace=False) for _ in leaves]).astype(np.int64)
        lps = np.log(rng.dirichlet(np.ones(3), size=len(leaves))).astype(np.float32)
        tree.expand(leaves, ids, lps)
    return tree, rng


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 6), st.integers(4, 40))
def test_reroot_sent_tree_matches_scheduler(seed, rounds, m):
    tree, rng = _grow(seed, rounds)
    nodes, parents = tree.best_subtree(m)
    tokens, scores = tree.tokens_of(nodes), np.asarray(tree.score)[nodes]
    # walk a random path of the sent tree, then a bonus that is a child or absent
    path, cur = [], 0
    while True:
        kids = np.flatnonzero(parents == cur)
        if len(kids) == 0 or rng.random() < 0.3:
            break
        cur = int(rng.choice(kids))
        path.append(int(tokens[cur]))
    kids = np.flatnonzero(parents == cur)
    bonus = int(tokens[rng.choice(kids)]) if len(kids) and rng.random() < 0.6 else 999
    got = reroot_scored((tokens, parents, scores), path + [bonus])
    if bonus == 999:
        assert got is None
        return
    assert got is not None
    new_tokens, new_parents, new_scores = got
    assert new_tokens[0] == bonus and new_parents[0] == -1 and new_scores[0] == 0.0
    assert all(0 <= p < i for i, p in enumerate(new_parents[1:], 1))

    def paths(toks, pars):
        out = []
        for i in range(len(toks)):
            seq, j = [], i
            while j > 0:
                seq.append(int(toks[j]))
                j = int(pars[j])
            out.append(tuple(reversed(seq)))
        return out
    prefix = tuple(path + [bonus])
    expected = [q[len(prefix):] for q in paths(tokens, parents) if q[:len(prefix)] == prefix]
    assert paths(new_tokens, new_parents) == expected      # same nodes, same best-first order
    # and they are exactly the sent nodes among the scheduler's survivors of the same reroot
    tree.reroot(np.array(path + [bonus], dtype=np.int64))
    survivors = dict(zip(paths(tree.token, tree.parent), np.asarray(tree.score).tolist()))
    assert set(expected) <= set(survivors)
    # with the scheduler's path log-probabilities from the new root (rebased sums: float rounding)
    for q, sc in zip(expected, new_scores.tolist()):
        assert abs(survivors[q] - sc) <= 1e-9 * max(1.0, abs(sc))


def test_walk_leaving_the_tree_is_none():
    tokens = np.array([5, 6, 7, 8], dtype=np.int64)
    parents = np.array([-1, 0, 0, 1], dtype=np.int32)
    scores = np.log([1.0, 0.5, 0.25, 0.4])
    assert reroot_scored((tokens, parents, scores), [9]) is None
    t, p, sc = reroot_scored((tokens, parents, scores), [6])
    assert t.tolist() == [6, 8] and p.tolist() == [-1, 0] and np.allclose(np.exp(sc), [1.0, 0.8])
    t, p, sc = reroot_scored((tokens, parents, scores), [])
    assert t.tolist() == [5, 6, 7, 8] and p.tolist() == [-1, 0, 0, 1] and np.array_equal(sc, scores)
    assert abs(draft_mass(scores) - (0.5 + 0.25 + 0.4)) < 1e-12

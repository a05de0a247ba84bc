"""The Cython token-tree scheduler (swiftspec_mpi._tree) against the pure-Python reference
(tests/tree_reference.py), plus invariants and error handling."""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swiftspec_mpi import _tree
from swiftspec_mpi._tree import TokenTree, subtree_masks, verify_greedy, verify_sample

sys.path.insert(0, os.path.dirname(__file__))
from tree_reference import (ALIVE, ACCEPTED, SENT, RefTree, ref_subtree_masks,  # noqa: E402
                            ref_verify_greedy, ref_verify_sample)

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------------------------------------
# helpers


def assert_same_tree(cy: TokenTree, ref: RefTree) -> None:
    assert cy.size == ref.size
    assert cy.root_pos == ref.root_pos
    assert cy.num_expanded == ref.num_expanded
    assert cy.prefix_kv_missing == ref.prefix_kv_missing
    cols = ref.arrays()
    for name in ("token", "parent", "depth", "kv_slot", "state", "expanded"):
        assert getattr(cy, name).tolist() == cols[name], name
    # scores are summed in the same order in float64 on both sides: exact equality
    assert cy.logprob.tolist() == cols["logprob"]
    assert cy.score.tolist() == cols["score"]


def check_invariants(tree: TokenTree) -> None:
    parent, depth, score, logprob = tree.parent, tree.depth, tree.score, tree.logprob
    kv, expanded, state = tree.kv_slot, tree.expanded, tree.state
    assert parent[0] == -1 and depth[0] == 0 and score[0] == 0.0 and state[0] == ACCEPTED
    for i in range(1, tree.size):
        assert 0 <= parent[i] < i, "parents precede children"
        assert depth[i] == depth[parent[i]] + 1
        assert depth[i] <= tree.max_depth
        assert score[i] == score[parent[i]] + logprob[i]
        assert score[i] <= score[parent[i]], "scores non-increasing along paths"
        assert state[i] in (ALIVE, SENT)
    assert np.array_equal(expanded, kv >= 0)
    slots = np.sort(kv[expanded])
    # the engine's contract: expanded slots are exactly [root_pos, root_pos + num_expanded)
    assert slots.tolist() == list(range(tree.root_pos, tree.root_pos + tree.num_expanded))


def children_of(tree: TokenTree, node: int) -> list[int]:
    return [int(i) for i in np.nonzero(tree.parent == node)[0]]


def random_logprobs(rng: np.random.Generator, shape) -> np.ndarray:
    """Log-probabilities <= 0, often tied (quantized), sometimes -inf."""
    coarse = -rng.integers(0, 3, size=shape) * 0.5
    fine = np.log(rng.uniform(1e-3, 1.0, size=shape))
    lp = np.where(rng.random(shape) < 0.5, coarse, fine)
    lp = np.where(rng.random(shape) < 0.03, -np.inf, lp)
    return lp.astype(np.float32 if rng.random() < 0.5 else np.float64)


def expand_step(cy, ref, rng, w, k, vocab, extra_cols):
    leaves = cy.select_leaves(w, k)
    assert leaves.dtype == np.int32
    assert leaves.tolist() == ref.select_leaves(w, k)
    if len(leaves) == 0:
        return
    kv_used = cy.root_pos + cy.num_expanded
    cy.assign_slots(leaves, kv_used)
    ref.assign_slots(leaves.tolist(), kv_used)
    ncols = kv_used + len(leaves) + extra_cols
    positions, mask = cy.masks(leaves, ncols)
    ref_positions, ref_mask = ref.masks(leaves.tolist(), ncols)
    assert positions.dtype == np.int64 and mask.dtype == np.bool_
    assert mask.shape == (len(leaves), ncols)
    assert positions.tolist() == ref_positions
    assert mask.tolist() == ref_mask
    ids = np.stack([rng.choice(vocab, size=k, replace=False) for _ in leaves]).astype(np.int64)
    lps = random_logprobs(rng, (len(leaves), k))
    new = cy.expand(leaves, ids, lps)
    assert new.dtype == np.int32
    assert new.tolist() == ref.expand(leaves.tolist(), ids.tolist(), lps.tolist())


def subtree_and_greedy_step(cy, ref, rng, bs, vocab):
    """best_subtree, then what the verify group does with it; returns greedy accepted tokens."""
    nodes, parents_local = cy.best_subtree(bs)
    ref_nodes, ref_parents = ref.best_subtree(bs)
    assert nodes.tolist() == ref_nodes and parents_local.tolist() == ref_parents
    assert nodes[0] == 0 and parents_local[0] == -1 and len(nodes) == min(bs, cy.size)
    assert len(set(nodes.tolist())) == len(nodes)
    # connected: each node's parent is chosen before it
    for i in range(1, len(nodes)):
        assert 0 <= parents_local[i] < i
        assert nodes[parents_local[i]] == cy.parent[nodes[i]]
    # log-probs <= 0: best-first order == sort by (score desc, depth asc, id asc), and it is the
    # top of that order over the whole tree
    key = [(-cy.score[i], cy.depth[i], i) for i in range(cy.size)]
    assert nodes.tolist() == [i for _, _, i in sorted(key)][:len(nodes)]
    assert all(cy.state[n] == SENT for n in nodes[1:])

    tokens = cy.tokens_of(nodes)
    assert tokens.tolist() == ref.tokens_of(ref_nodes)
    root_pos = int(rng.integers(0, 6))
    positions, mask = subtree_masks(parents_local, root_pos)
    assert (positions.tolist(), mask.tolist()) == ref_subtree_masks(ref_parents, root_pos)

    # target argmax: often one of the node's children, so that paths get long
    argmax = rng.integers(0, vocab, size=len(nodes)).astype(np.int64)
    for i in range(len(nodes)):
        kids = [j for j in range(len(nodes)) if parents_local[j] == i]
        if kids and rng.random() < 0.7:
            argmax[i] = tokens[kids[int(rng.integers(len(kids)))]]
    path, accepted = verify_greedy(tokens, parents_local, argmax)
    ref_path, ref_accepted = ref_verify_greedy(tokens.tolist(), ref_parents, argmax.tolist())
    assert path.dtype == np.int32 and accepted.dtype == np.int64
    assert path.tolist() == ref_path and accepted.tolist() == ref_accepted
    assert len(path) == len(accepted) and path[0] == 0
    return accepted


def random_accepted_path(tree: TokenTree, rng, vocab) -> np.ndarray:
    """Draft tokens along a random root path (mostly through forwarded nodes, as the target
    accepts the likely ones), then a bonus that is usually a child's token, else random."""
    forwarded_nodes = [i for i in range(1, tree.size) if tree.expanded[i]]
    if forwarded_nodes and rng.random() < 0.5:
        # the bonus is a forwarded node: its whole subtree survives
        node, chain = forwarded_nodes[int(rng.integers(len(forwarded_nodes)))], []
        while node > 0:
            chain.append(int(tree.token[node]))
            node = int(tree.parent[node])
        return np.array(chain[::-1], dtype=np.int64)
    node, tokens = 0, []

    def pick(kids):
        forwarded = [c for c in kids if tree.expanded[c]]
        pool = forwarded if forwarded and rng.random() < 0.9 else kids
        return pool[int(rng.integers(len(pool)))]

    while True:
        kids = children_of(tree, node)
        if not kids or rng.random() < 0.15:
            break
        node = pick(kids)
        tokens.append(int(tree.token[node]))
    kids = children_of(tree, node)
    if kids and rng.random() < 0.75:
        bonus = int(tree.token[pick(kids)])
    else:
        bonus = int(rng.integers(0, vocab + 3))
    return np.array(tokens + [bonus], dtype=np.int64)


def reroot_step(cy, ref, accepted):
    old = {name: getattr(cy, name).copy() for name in ("token", "parent", "kv_slot", "expanded")}
    old_root_pos, old_size = cy.root_pos, cy.size
    # the expected survivors, computed here from the old arrays
    path = [0]
    for t in accepted[:-1]:
        path.append(next(c for c in range(old_size)
                         if old["parent"][c] == path[-1] and old["token"][c] == t))
    new_root = next((c for c in range(old_size)
                     if old["parent"][c] == path[-1] and old["token"][c] == accepted[-1]), None)
    survivors = []
    if new_root is not None:
        inside = {new_root}
        for i in range(new_root, old_size):
            if i == new_root or old["parent"][i] in inside:
                inside.add(i)
                survivors.append(i)

    src, dst, new_root_pos, needs_forward = cy.reroot(accepted)
    ref_src, ref_dst, ref_pos, ref_needs = ref.reroot(accepted.tolist())
    assert src.dtype == np.int64 and dst.dtype == np.int64
    assert (src.tolist(), dst.tolist(), new_root_pos, needs_forward) == \
        (ref_src, ref_dst, ref_pos, ref_needs)
    assert new_root_pos == old_root_pos + len(accepted)
    assert isinstance(needs_forward, bool) and needs_forward == (not cy.expanded[0])

    # exactly the descendants of the new root survive, in their old order
    if new_root is None:
        assert cy.size == 1 and cy.token[0] == accepted[-1] and not cy.expanded[0]
    else:
        assert cy.token.tolist() == old["token"][survivors].tolist()
        assert cy.expanded.tolist() == old["expanded"][survivors].tolist()

    # the plan: src/dst distinct, no identity moves, dst inside the contiguous kept range
    m = cy.num_expanded
    assert len(set(src.tolist())) == len(src) and len(set(dst.tolist())) == len(dst)
    assert not np.any(src == dst)
    assert set(src.tolist()) <= set(old["kv_slot"][old["expanded"]].tolist())
    assert all(old_root_pos <= d < new_root_pos + m for d in dst.tolist())

    # apply it to a fake KV (slot -> identity of the node whose KV it holds)
    fake = np.full(max(old_root_pos + old_size + len(accepted) + 2, new_root_pos + m + 1), -1)
    fake[:old_root_pos] = -2                                     # committed prefix
    for i in range(old_size):
        if old["expanded"][i]:
            fake[old["kv_slot"][i]] = 1000 + i
    moved = fake.copy()
    moved[dst] = fake[src]                                       # gather all, then scatter
    assert np.all(moved[:old_root_pos] == -2)
    for offset, node in enumerate(path):
        if old["expanded"][node]:
            assert moved[old_root_pos + offset] == 1000 + node
        else:
            assert offset == len(path) - 1 and cy.prefix_kv_missing
    for new_id, old_id in enumerate(survivors):
        if old["expanded"][old_id]:
            assert moved[cy.kv_slot[new_id]] == 1000 + old_id
    # the kept range is covered exactly (the hole of a never-forwarded last committed node aside)
    kept = [old_root_pos + o for o, node in enumerate(path) if old["expanded"][node]]
    kept += cy.kv_slot[cy.expanded].tolist()
    expected = set(range(old_root_pos, new_root_pos + m))
    if cy.prefix_kv_missing:
        expected.discard(new_root_pos - 1)
    assert sorted(kept) == sorted(expected)


# ------------------------------------------------------------------------------------------------
# property tests against the reference


@SETTINGS
@given(data=st.data())
def test_random_draft_cycles_match_reference(data):
    capacity = data.draw(st.integers(12, 200), label="capacity")
    max_depth = data.draw(st.integers(2, 7), label="max_depth")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 11))
    k = int(rng.integers(1, min(3, vocab) + 1))
    cy, ref = TokenTree(capacity, max_depth), RefTree(capacity, max_depth)
    root_token, root_pos = int(rng.integers(vocab)), int(rng.integers(0, 50))
    cy.reset(root_token, root_pos)
    ref.reset(root_token, root_pos)
    assert_same_tree(cy, ref)
    # the per-round choices come from the seeded generator: hypothesis would pull them towards
    # their smallest values (few expansions, tiny trees), which tests little
    for _ in range(int(rng.integers(1, 9))):
        # like the draft loop: a few expansions, then a verification and/or a re-root
        for _ in range(int(rng.integers(0, 7))):
            expand_step(cy, ref, rng, int(rng.integers(0, 9)), k, vocab,
                        extra_cols=int(rng.integers(0, 3)))
            assert_same_tree(cy, ref)
        action = ("verify", "verify+reroot", "reroot")[int(rng.integers(3))]
        if action.startswith("verify"):
            accepted = subtree_and_greedy_step(cy, ref, rng, int(rng.integers(1, 25)), vocab)
            if action == "verify+reroot":
                reroot_step(cy, ref, accepted)
        else:
            reroot_step(cy, ref, random_accepted_path(cy, rng, vocab))
        assert_same_tree(cy, ref)
        check_invariants(cy)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_verify_sample_matches_reference(data):
    n = data.draw(st.integers(1, 12), label="n")
    vocab = data.draw(st.integers(1, 7), label="vocab")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    tokens = rng.integers(0, vocab, size=n).astype(np.int64)   # sibling repeats allowed here
    probs = rng.dirichlet(np.full(vocab, 0.5), size=n)
    probs[rng.random(probs.shape) < 0.3] = 0.0                   # zero-probability tokens
    probs[np.arange(n), rng.integers(0, vocab, size=n)] += 0.1   # keep every row's mass > 0
    probs = (probs / probs.sum(1, keepdims=True))
    probs = probs.astype(np.float32 if data.draw(st.booleans()) else np.float64)
    uniforms = rng.random(n + 1)
    parents_local = np.array(parents, dtype=np.int32)
    before = probs.copy()
    path, accepted = verify_sample(tokens, parents_local, probs, uniforms)
    assert np.array_equal(probs, before), "target_probs must not be modified"
    ref_path, ref_accepted = ref_verify_sample(tokens.tolist(), parents, probs, uniforms)
    assert path.tolist() == ref_path and accepted.tolist() == ref_accepted
    assert path.dtype == np.int32 and accepted.dtype == np.int64
    # committed tokens always have positive target probability along the path
    for node, token in zip(path, accepted):
        assert probs[node, token] > 0


# ------------------------------------------------------------------------------------------------
# worked example with hand-computed values


def build_example() -> TokenTree:
    """root(7)@P=10 -> children a(1, lp -0.1), b(2, -0.5), c(3, -2.0); a -> d(4, -0.2), e(5, -3)."""
    tree = TokenTree(capacity=16, max_depth=4)
    tree.reset(7, 10)
    leaves = tree.select_leaves(4)
    assert leaves.tolist() == [0]
    tree.assign_slots(leaves, 10)
    tree.expand(leaves, np.array([[1, 2, 3]]), np.array([[-0.1, -0.5, -2.0]]))
    leaves = tree.select_leaves(1)
    assert leaves.tolist() == [1]
    tree.assign_slots(leaves, 11)
    tree.expand(leaves, np.array([[4, 5]]), np.array([[-0.2, -3.0]]))
    return tree


def test_worked_example():
    tree = build_example()
    assert tree.size == 6 and tree.num_expanded == 2
    assert tree.token.tolist() == [7, 1, 2, 3, 4, 5]
    assert tree.parent.tolist() == [-1, 0, 0, 0, 1, 1]
    assert tree.depth.tolist() == [0, 1, 1, 1, 2, 2]
    assert tree.kv_slot.tolist() == [10, 11, -1, -1, -1, -1]
    assert np.allclose(tree.score, [0, -0.1, -0.5, -2.0, -0.3, -3.1])
    # best unexpanded: d (-0.3), b (-0.5), c (-2.0), e (-3.1)
    assert tree.select_leaves(3).tolist() == [4, 2, 3]
    positions, mask = tree.masks(np.array([4, 2], dtype=np.int32), 14)
    assert positions.tolist() == [12, 11]
    assert mask[0].tolist() == [True] * 10 + [True, True, False, False]
    assert mask[1].tolist() == [True] * 10 + [True, False, False, False]
    nodes, parents = tree.best_subtree(4)
    assert nodes.tolist() == [0, 1, 4, 2] and parents.tolist() == [-1, 0, 1, 0]
    assert tree.state.tolist() == [ACCEPTED, SENT, SENT, ALIVE, SENT, ALIVE]
    assert tree.tokens_of(nodes).tolist() == [7, 1, 4, 2]

    # the target accepts token 1, its bonus is 4 (= node d, unexpanded): tree becomes d alone
    src, dst, pos, needs = tree.copy().reroot(np.array([1, 4]))
    assert (src.tolist(), dst.tolist(), pos, needs) == ([], [], 12, True)
    # the target accepts nothing, its bonus is 1 (= node a): a's subtree survives
    t2 = tree.copy()
    src, dst, pos, needs = t2.reroot(np.array([1]))
    assert pos == 11 and needs is False
    assert t2.token.tolist() == [1, 4, 5] and t2.parent.tolist() == [-1, 0, 0]
    assert t2.kv_slot.tolist() == [11, -1, -1] and src.tolist() == [] and dst.tolist() == []
    assert np.allclose(t2.score, [0, -0.2, -3.0]) and t2.root_pos == 11
    assert t2.state.tolist() == [ACCEPTED, ALIVE, ALIVE]


def test_reroot_moves_kv_into_place():
    """Slots assigned out of path order get compacted: committed first, survivors after."""
    tree = TokenTree(capacity=32, max_depth=8)
    tree.reset(9, 5)
    tree.assign_slots([0], 5)
    tree.expand([0], [[1, 2]], [[-0.5, -0.6]])
    tree.assign_slots([2, 1], 6)           # node 2 (token 2) -> slot 6, node 1 (token 1) -> 7
    tree.expand([2, 1], [[3, 4], [5, 6]], [[-0.1, -0.2], [-0.3, -0.4]])
    # nodes: 0 root, 1 tok1, 2 tok2, 3 tok3 (under 2), 4 tok4, 5 tok5 (under 1), 6 tok6
    tree.assign_slots([5], 8)
    tree.expand([5], [[7]], [[-0.1]])      # node 7 tok7 under 5
    src, dst, pos, needs = tree.reroot(np.array([1, 5]))   # accept tok1, bonus tok5 = node 5
    # committed: root (slot 5 -> 5, stays), node 1 (slot 7 -> 6); survivor node 5 (8 -> 7)
    assert (src.tolist(), dst.tolist(), pos, needs) == ([7, 8], [6, 7], 7, False)
    assert tree.token.tolist() == [5, 7] and tree.kv_slot.tolist() == [7, -1]
    assert tree.num_expanded == 1 and not tree.prefix_kv_missing


def test_reroot_unforwarded_last_node_leaves_a_hole():
    tree = build_example()
    # accept b (node 2, never forwarded); bonus anything
    src, dst, pos, needs = tree.reroot(np.array([2, 9]))
    assert pos == 12 and needs is True and tree.prefix_kv_missing
    assert tree.size == 1 and tree.token.tolist() == [9]
    # nothing committed needed a move (root 10, and b has no KV)
    assert src.tolist() == [] and dst.tolist() == []
    tree.reset(3, 4)
    assert not tree.prefix_kv_missing


def test_select_ties_depth_and_max_depth():
    tree = TokenTree(capacity=64, max_depth=2)
    tree.reset(0, 0)
    tree.assign_slots([0], 0)
    tree.expand([0], [[1, 2, 3]], [[0.0, -1.0, 0.0]])
    tree.assign_slots([3], 1)
    tree.expand([3], [[4, 5]], np.array([[0.0, 0.0]], dtype=np.float32))
    # unexpanded: 1 (score 0, depth 1), 2 (-1), 4 (0, depth 2 = max_depth), 5 (0, depth 2)
    assert tree.select_leaves(10).tolist() == [1, 2]
    # best_subtree ties: lower depth, then lower id
    nodes, _ = tree.best_subtree(6)
    assert nodes.tolist() == [0, 1, 3, 4, 5, 2]


def test_ties_and_renumbering_when_ids_are_not_breadth_first():
    """Ids follow creation order, which is not depth order: ties must go to the shallower node,
    and re-rooting keeps the old relative order (not a breadth-first one)."""
    tree = TokenTree(capacity=32, max_depth=8)
    tree.reset(0, 0)
    zero = np.zeros((1, 1))
    tree.assign_slots([0], 0)
    tree.expand([0], [[10]], zero)                       # 1: x
    tree.assign_slots([1], 1)
    tree.expand([1], [[11, 12]], np.zeros((1, 2)))       # 2: x1, 3: x2
    tree.assign_slots([2], 2)
    tree.expand([2], [[13]], zero)                       # 4: x11 (depth 3)
    tree.assign_slots([4], 3)
    tree.expand([4], [[14]], zero)                       # 5: x111 (depth 4)
    tree.assign_slots([3], 4)
    tree.expand([3], [[15]], zero)                       # 6: x21 (depth 3)
    assert tree.depth.tolist() == [0, 1, 2, 2, 3, 4, 3]
    # every score is 0: unexpanded 5 (depth 4) and 6 (depth 3) -> 6 first despite its larger id
    assert tree.select_leaves(2).tolist() == [6, 5]
    nodes, parents = tree.best_subtree(7)
    assert nodes.tolist() == [0, 1, 2, 3, 4, 6, 5]
    assert parents.tolist() == [-1, 0, 1, 1, 2, 3, 4]
    src, dst, pos, needs = tree.reroot(np.array([10]))   # bonus = x: everything under it stays
    assert pos == 1 and needs is False
    assert tree.token.tolist() == [10, 11, 12, 13, 14, 15]          # old order kept
    assert tree.parent.tolist() == [-1, 0, 0, 1, 3, 2]
    assert tree.kv_slot.tolist() == [1, 2, 3, 4, -1, -1]            # new order, contiguous
    assert (src.tolist(), dst.tolist()) == ([4, 3], [3, 4])


def test_mask_column_root_pos_is_the_roots_slot_only():
    """Column root_pos is not part of the committed prefix: visible only through a slot."""
    tree = TokenTree(capacity=8, max_depth=4)
    tree.reset(5, 4)
    tree.assign_slots([0], 6)
    tree.expand([0], [[1, 2]], [[-1.0, -2.0]])
    tree.assign_slots([2], 4)
    positions, mask = tree.masks([2, 1], 8)
    assert positions.tolist() == [5, 5]
    assert mask.astype(int).tolist() == [[1, 1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 0, 1, 0]]


def test_capacity_overflow():
    tree = TokenTree(capacity=10, max_depth=8)
    tree.reset(0, 0)
    tree.assign_slots(tree.select_leaves(4), 0)
    tree.expand([0], [[1, 2, 3, 4]], [[-1, -2, -3, -4]])          # size 5
    # 2 leaves x 4 children would need 13 > 10: nothing selected
    assert tree.select_leaves(2).tolist() == []
    assert tree.select_leaves(1).tolist() == [1]                    # 5 + 4 <= 10
    assert tree.select_leaves(2, k=2).tolist() == [1, 2]           # 5 + 4 <= 10
    tree.assign_slots([1, 2], 1)
    before = tree.copy()
    with pytest.raises(ValueError, match="capacity 10 exceeded"):
        tree.expand([1, 2], [[5, 6, 7], [5, 6, 7]], np.zeros((2, 3)))
    assert tree.size == before.size and tree.token.tolist() == before.token.tolist()


def test_bad_accepted_path_raises_and_keeps_tree():
    tree = build_example()
    snapshot = tree.copy()
    with pytest.raises(ValueError, match="not a child of node 0"):
        tree.reroot(np.array([4, 1]))                  # 4 is a grandchild, not a child
    with pytest.raises(ValueError, match="not a child of node 1"):
        tree.reroot(np.array([1, 2, 9]))               # 2 is not under 1
    with pytest.raises(ValueError, match="at least the bonus"):
        tree.reroot(np.array([], dtype=np.int64))
    for name in ("token", "parent", "kv_slot", "score", "state"):
        assert getattr(tree, name).tolist() == getattr(snapshot, name).tolist()
    assert tree.root_pos == snapshot.root_pos


def test_misuse_raises_value_error():
    tree = build_example()
    with pytest.raises(ValueError, match="already expanded"):
        tree.assign_slots([1], 20)
    with pytest.raises(ValueError, match="committed prefix"):
        tree.assign_slots([2], 3)
    with pytest.raises(ValueError, match="appears twice"):
        tree.assign_slots([2, 2], 12)
    with pytest.raises(ValueError, match="out of range"):
        tree.assign_slots([99], 12)
    with pytest.raises(ValueError, match="call assign_slots first"):
        tree.expand([2], [[1]], [[-1.0]])
    with pytest.raises(ValueError, match="already has children"):
        tree.expand([1], [[1]], [[-1.0]])
    with pytest.raises(ValueError, match="shape"):
        tree.expand([0], [[1, 2]], [[-1.0]])
    tree.assign_slots([2], 12)
    with pytest.raises(ValueError, match="NaN"):
        tree.expand([2], [[1, 2]], [[-1.0, math.nan]])
    assert tree.size == 6                                          # unchanged by the failures
    with pytest.raises(ValueError, match="ncols"):
        tree.masks([2], 12)                                        # its own slot is 12
    with pytest.raises(ValueError, match="root_pos"):
        tree.masks([2], 5)
    with pytest.raises(ValueError):
        tree.best_subtree(0)
    with pytest.raises(ValueError):
        TokenTree(0, 4)
    full = TokenTree(capacity=3, max_depth=1)
    full.reset(0, 0)
    full.assign_slots([0], 0)
    full.expand([0], [[1, 2]], [[-1.0, -2.0]])
    full.assign_slots([1], 1)
    with pytest.raises(ValueError, match="max_depth"):
        full.expand([1], [[3]], [[-1.0]])


def test_verification_input_errors():
    with pytest.raises(ValueError, match="topological"):
        subtree_masks(np.array([-1, 2, 0], dtype=np.int32), 4)
    with pytest.raises(ValueError, match="must be -1"):
        verify_greedy(np.array([1, 2]), np.array([0, 0], dtype=np.int32), np.array([2, 3]))
    with pytest.raises(ValueError, match="at least the root"):
        subtree_masks(np.array([], dtype=np.int32), 4)
    probs = np.full((2, 4), 0.25, dtype=np.float32)
    parents = np.array([-1, 0], dtype=np.int32)
    with pytest.raises(ValueError, match="uniforms"):
        verify_sample(np.array([0, 1]), parents, probs, np.zeros(2))
    with pytest.raises(ValueError, match="vocabulary"):
        verify_sample(np.array([0, 4]), parents, probs, np.zeros(3))
    with pytest.raises(ValueError, match="no positive mass"):
        verify_sample(np.array([0, 1]), parents, np.zeros((2, 4), np.float32), np.zeros(3))


def test_verify_greedy_examples():
    tokens = np.array([7, 1, 2, 4, 5, 6], dtype=np.int64)
    parents = np.array([-1, 0, 0, 1, 1, 3], dtype=np.int32)
    path, acc = verify_greedy(tokens, parents, np.array([2, 0, 8, 0, 0, 0]))
    assert path.tolist() == [0, 2] and acc.tolist() == [2, 8]
    path, acc = verify_greedy(tokens, parents, np.array([1, 4, 0, 6, 0, 9]))
    assert path.tolist() == [0, 1, 3, 5] and acc.tolist() == [1, 4, 6, 9]
    path, acc = verify_greedy(tokens, parents, np.array([3, 0, 0, 0, 0, 0]))
    assert path.tolist() == [0] and acc.tolist() == [3]


def test_subtree_masks_example():
    positions, mask = subtree_masks(np.array([-1, 0, 0, 1], dtype=np.int32), 2)
    assert positions.tolist() == [2, 3, 3, 4]
    assert mask.astype(int).tolist() == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 1],
    ]


def test_views_are_read_only_and_copy_is_independent():
    tree = build_example()
    with pytest.raises(ValueError):
        tree.token[0] = 5
    other = tree.copy()
    other.reroot(np.array([1]))
    assert tree.size == 6 and other.size == 3
    assert _tree.STATE_ALIVE == ALIVE and _tree.STATE_SENT == SENT
    assert _tree.STATE_ACCEPTED == ACCEPTED


def test_torch_inputs_are_accepted():
    import torch
    tree = build_example()
    leaves = tree.select_leaves(2)
    tree.assign_slots(torch.from_numpy(leaves), 12)
    tree.expand(torch.from_numpy(leaves), torch.tensor([[1, 2], [3, 4]]),
                torch.tensor([[-1.0, -2.0], [-1.5, -2.5]], dtype=torch.float32))
    assert tree.size == 10

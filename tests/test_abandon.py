"""An abandoned draft expansion (engine/abandon.py): Transformer.forward stops at a layer
boundary when `between_layers` says so, DraftSide.expand then leaves the tree and the KV it uses
exactly as before, and every later step is bit-identical to a run that never started it; an
expansion whose leaves all fall off the re-root leaves the same state abandoned as finished
(`expansion_survives` is exact); LayerCheck's cadence and group decision; and greedy `async`
under every policy, with every result abandoning the expansion in flight, still equals `ar`
(1+1 and 2+2 ranks)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_helpers import MPIEXEC, env_for_tests, read_outputs, read_root, write_prompts
from model_configs import small_config
from swiftspec_mpi.checkpoints.hf_loader import SafetensorsSource
from swiftspec_mpi.checkpoints.tiny import random_weights, write_hf_folder
from swiftspec_mpi.core.config import ASYNC_POLICIES
from swiftspec_mpi.engine import abandon
from swiftspec_mpi.engine.decoding import DraftSide
from swiftspec_mpi.network.transformer import Transformer
from swiftspec_mpi.packed import cpu_linear

VOCAB = 97
NODE_ARRAYS = ("token", "parent", "depth", "logprob", "score", "kv_slot", "state", "expanded")
LAYOUTS = ["in_out"] + (["packed"] if cpu_linear.has_avx2() else [])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = small_config("qwen2", vocab_size=VOCAB, num_layers=4)
    w = random_weights(cfg, seed=5, late_scale=1.0)
    return write_hf_folder(str(tmp_path_factory.mktemp("abandon")), cfg, w)


def draft_side(folder: str, layout: str) -> DraftSide:
    src = SafetensorsSource(folder)
    m = Transformer(src.config, max_slots=160, weight_layout=layout)
    m.load_weights(src)
    d = DraftSide(m, width=3, topk=3, capacity=200, max_depth=8)
    d.prefill([5, 17, 33, 2, 61, 8, 40])
    return d


def state(d: DraftSide) -> dict:
    """Everything later steps read: the tree, kv_used and the KV of the used slots."""
    t = d.tree
    out = {name: np.array(getattr(t, name)) for name in NODE_ARRAYS}
    out.update(size=t.size, root_pos=t.root_pos, num_expanded=t.num_expanded,
               prefix_kv_missing=t.prefix_kv_missing, kv_used=d.kv_used,
               k=d.model.k_cache[:, :d.kv_used].clone(), v=d.model.v_cache[:, :d.kv_used].clone())
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert np.array_equal(a[key], b[key]), key


def stop_after(j: int):
    return lambda done, total: done == j


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_stops_at_the_layer_boundary(folder, layout):
    d = draft_side(folder, layout)
    m = d.model
    seen = []
    tokens, positions = torch.tensor([3, 4]), torch.tensor([7, 8])
    mask = torch.ones(2, 9, dtype=torch.bool).tril_(diagonal=7)
    record = lambda done, total: seen.append((done, total))  # noqa: E731  (None: go on)
    assert m.forward(tokens, positions, 7, mask, between_layers=record) is not None
    assert seen == [(i, 4) for i in range(1, 5)]
    assert m.forward(tokens, positions, 7, mask, between_layers=stop_after(2)) is None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("j", [1, 3, 4])     # 4: after the last layer, before the head
def test_abandoned_expansion_leaves_the_state_as_before(folder, layout, j):
    """A run with an expansion abandoned after layer j, and one without it, stay bit-identical
    through more expansions and re-roots (the abandoned forward's K/V in free slots is never
    read)."""
    ref, d = draft_side(folder, layout), draft_side(folder, layout)
    for step in range(6):
        for side in (ref, d):
            side.expand(side.select())
        leaves = d.select()
        before = state(d)
        assert d.expand(leaves, between_layers=stop_after(j)) is False
        assert_same(state(d), before)
        assert_same(state(d), state(ref))
        if step % 2:      # re-root on the best child of the root, then a token off the tree
            best = int(np.argmax(np.where(np.array(d.tree.parent) == 0, np.array(d.tree.score), -np.inf)))
            acc = np.array([int(d.tree.token[best]), 1 + (step % 50)], dtype=np.int64)
            assert ref.reroot(acc) == d.reroot(acc)
            assert_same(state(d), state(ref))
    assert d.expand(d.select(), between_layers=lambda done, total: False) is True
    ref.expand(ref.select())
    assert_same(state(d), state(ref))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dropped_expansion_leaves_the_same_state_abandoned_as_finished(folder, layout):
    """When expansion_survives says no leaf survives the re-root, finishing the expansion and
    abandoning it give the same state after the re-root; when it says one does, they differ."""
    gen = np.random.default_rng(3)
    checked = {True: 0, False: 0}
    for trial in range(24):
        fin, ab = draft_side(folder, layout), draft_side(folder, layout)
        for _ in range(2 + trial % 3):
            fin.expand(fin.select())
            ab.expand(ab.select())
        leaves = fin.select()
        # an accepted path: walk down from the root along random children, then a bonus token
        # that is a random child of the last node, or off the tree
        t = fin.tree
        par, tok = np.array(t.parent), np.array(t.token)
        node, acc = 0, []
        for _ in range(int(gen.integers(0, 4))):
            kids = np.flatnonzero(par == node)
            if len(kids) == 0:
                break
            node = int(gen.choice(kids))
            acc.append(int(tok[node]))
        kids = np.flatnonzero(par == node)
        bonus = int(tok[gen.choice(kids)]) if len(kids) and gen.random() < 0.7 else VOCAB - 1
        acc = np.array(acc + [bonus], dtype=np.int64)
        survives = fin.expansion_survives(leaves, acc)
        fin.expand(leaves)
        assert ab.expand(leaves, between_layers=stop_after(2)) is False
        fin.reroot(acc.copy())
        ab.reroot(acc.copy())
        if not survives:
            assert_same(state(ab), state(fin))
        else:   # a surviving leaf: its children (or the KV of the committed leaf) are kept
            a, b = state(ab), state(fin)
            assert a["size"] != b["size"] or a["kv_used"] != b["kv_used"] or \
                a["prefix_kv_missing"] != b["prefix_kv_missing"] or not torch.equal(a["k"], b["k"])
        checked[survives] += 1
    assert checked[True] and checked[False]


class FakeWatch:
    def __init__(self, arrive_at: int, counter: list, accepted=(1,), done=False, request=0):
        self.arrive_at, self.counter = arrive_at, counter
        self.msg = (request, 0, np.array(accepted, dtype=np.int64), done)

    def arrived(self) -> bool:
        self.counter[0] += 1
        return self.counter[0] >= self.arrive_at

    def unpack(self):
        return self.msg


def test_layer_check_cadence_and_group_decision(monkeypatch):
    """One rank: a decision at every layer boundary, fixed once the result arrived. A group:
    decisions every TP_CHECK_EVERY layers and after the last, each one broadcast."""
    monkeypatch.setattr(abandon, "should_abandon", lambda draft, leaves, acc, done: True)
    calls = [0]
    check = abandon.LayerCheck(None, np.zeros(1, np.int32), 0, FakeWatch(3, calls), 1, None)
    assert [check(i, 24) for i in (1, 2, 3)] == [False, False, True] and check.layers_done == 3
    sent = []
    calls = [0]
    check = abandon.LayerCheck(None, np.zeros(1, np.int32), 0, FakeWatch(2, calls), 2,
                               lambda buf: sent.append(int(buf[0])))
    every = abandon.TP_CHECK_EVERY
    stops = [check(i, 2 * every + 1) for i in range(1, 2 * every + 2)]
    assert stops.index(True) == 2 * every - 1 and sent == [0, 1, 1]
    # a member: no watch, it takes what the broadcast brings
    member = abandon.LayerCheck(None, np.zeros(1, np.int32), 0, None, 2, lambda buf: buf.fill(1))
    assert member(1, 24) is False and member(every, 24) is True
    # a surviving leaf keeps the expansion; a message of another request stops it at once
    monkeypatch.setattr(abandon, "should_abandon", lambda draft, leaves, acc, done: False)
    keep = abandon.LayerCheck(None, np.zeros(1, np.int32), 0, FakeWatch(1, [0]), 1, None)
    assert not any(keep(i, 4) for i in range(1, 5))
    other = abandon.LayerCheck(None, np.zeros(1, np.int32), 0, FakeWatch(1, [0], request=7), 1, None)
    assert other(1, 4) is True


FORCED = Path(__file__).resolve().parent / "mpi_scripts" / "forced_abandon.py"


@pytest.fixture(scope="module")
def engine_case(tmp_path_factory):
    d = tmp_path_factory.mktemp("forced")
    subprocess.run([sys.executable, "-m", "swiftspec_mpi", "tiny-checkpoint", str(d)], check=True,
                   capture_output=True, timeout=120)
    prompts = write_prompts(d / "p.jsonl", ["Write a Python function that reverses a linked list.",
                                            "What is the capital of France? Answer in one sentence."])
    args = ["--target", str(d / "target"), "--draft", str(d / "draft"), "--prompts", prompts,
            "--max-new-tokens", "48", "--quiet", "--threads", "1"]
    out = d / "ar.h5"
    subprocess.run([*MPIEXEC, "-n", "1", sys.executable, "-m", "swiftspec_mpi", "run", "--mode", "ar",
                    "--out", str(out), *args], check=True, capture_output=True, timeout=240,
                   env=env_for_tests())
    return d, args, read_outputs(out)


@pytest.mark.mpi
@pytest.mark.parametrize("policy,n", [(p, 2) for p in ASYNC_POLICIES] + [("rate", 4)])
def test_greedy_async_with_every_result_abandoning_equals_ar(engine_case, policy, n):
    d, args, ar = engine_case
    out = d / f"{policy}-{n}.h5"
    proc = subprocess.run([*MPIEXEC, "-n", str(n), sys.executable, str(FORCED), "--mode", "async",
                           "--draft-ranks", str(n // 2), "--async-policy", policy, "--out", str(out),
                           *args], capture_output=True, text=True, timeout=300, env=env_for_tests())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert read_outputs(out) == ar
    root = read_root(out)
    kinds = json.loads(root["event_kinds"])
    ev = root["events"]
    abandoned = ev[ev["kind"] == kinds.index("abandon")]
    assert root["complete"] and len(abandoned) > 0
    if n > 2:   # every rank of the draft group stopped after the same layer of the same expansions
        assert set(abandoned["rank"].tolist()) == set(range(n // 2, n))
        per_rank = [abandoned[abandoned["rank"] == r][["request", "step", "accepted"]].tolist()
                    for r in range(n // 2, n)]
        assert all(p == per_rank[0] for p in per_rank)

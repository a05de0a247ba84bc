"""KV compaction (the scheduler's plan applied by Transformer.compact_kv): after a tree step,
moving the accepted path's (and a surviving subtree's) KV slots and decoding on gives the same
logits as decoding without the dead branches ever existing (CPU float32, 1e-5)."""
from __future__ import annotations

import pytest
import torch

from swiftspec_mpi.checkpoints.hf_loader import SafetensorsSource
from swiftspec_mpi.checkpoints.tiny import random_weights, write_hf_folder
from swiftspec_mpi.network.transformer import Transformer, chain_mask
from model_configs import small_config
from tree_masks import tree_mask

TOL = 1e-5
V = 89


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = small_config("llama", vocab_size=V, hidden_size=48, intermediate_size=80, num_layers=2,
                       num_heads=6, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=256)
    w = random_weights(cfg, seed=5, late_scale=1.0)
    w["lm_head.weight"] *= 0.3
    return write_hf_folder(str(tmp_path_factory.mktemp("compact")), cfg, w)


def new_model(folder, max_slots=64) -> Transformer:
    src = SafetensorsSource(folder)
    m = Transformer(src.config, max_slots=max_slots)
    m.load_weights(src)
    return m


def test_compact_then_decode_equals_clean_decode(folder):
    g = torch.Generator().manual_seed(3)
    P = 10
    prefix = torch.randint(0, V, (P,), generator=g)
    parents = [-1, 0, 0, 1, 2, 2, 4, 3, 6]      # nodes 0 -> 2 -> 4 -> 6 is the accepted path
    tokens = torch.randint(0, V, (len(parents),), generator=g)
    accepted = [0, 2, 4, 6]
    follow = torch.randint(0, V, (5,), generator=g)

    m = new_model(folder)
    m.forward(prefix, torch.arange(P), 0, chain_mask(0, P))
    pos, mask = tree_mask(parents, P)
    m.forward(tokens, pos, P, mask)
    src = torch.tensor([P + i for i in accepted])
    dst = torch.arange(P, P + len(accepted))
    m.compact_kv(src, dst)
    got = []
    p = P + len(accepted)
    for t in follow:
        got.append(m.forward(t.view(1), torch.tensor([p]), p, chain_mask(p, 1))[0])
        p += 1

    ref_model = new_model(folder)
    clean = torch.cat([prefix, tokens[accepted]])
    ref_model.forward(clean, torch.arange(clean.numel()), 0, chain_mask(0, clean.numel()))
    p = clean.numel()
    for i, t in enumerate(follow):
        ref = ref_model.forward(t.view(1), torch.tensor([p]), p, chain_mask(p, 1))[0]
        assert (got[i] - ref).abs().max().item() < TOL, f"decode step {i} after compaction"
        p += 1


def test_surviving_subtree_keeps_working(folder):
    """Draft side: keep the accepted path AND the subtree below it, packed after the prefix;
    expanding a surviving leaf afterwards equals running its path as a chain."""
    g = torch.Generator().manual_seed(4)
    P = 7
    prefix = torch.randint(0, V, (P,), generator=g)
    parents = [-1, 0, 0, 1, 2, 2, 3, 4, 5]
    tokens = torch.randint(0, V, (len(parents),), generator=g)
    m = new_model(folder)
    m.forward(prefix, torch.arange(P), 0, chain_mask(0, P))
    pos, mask = tree_mask(parents, P)
    m.forward(tokens, pos, P, mask)
    # root 0 and node 2 accepted; the subtree under 2 (nodes 4, 5, 7, 8) survives
    keep = [0, 2, 4, 5, 7, 8]
    m.compact_kv(torch.tensor([P + i for i in keep]), torch.arange(P, P + len(keep)))
    new_parents = [-1, 0, 1, 1, 2, 3]            # in packed order
    # expand node 7 (packed 4) with one new token at the first free slot
    t = torch.randint(0, V, (1,), generator=g)
    S = P + len(keep)
    mask2 = torch.zeros(1, S + 1, dtype=torch.bool)
    mask2[0, :P] = True
    for j in (0, 1, 2, 4):                        # packed ancestors of node 7: 0, 2, 4, 7
        mask2[0, P + j] = True
    mask2[0, S] = True
    out = m.forward(t, torch.tensor([P + 4]), S, mask2)[0]
    assert new_parents[4] == 2
    ref_model = new_model(folder)
    chain = torch.cat([prefix, tokens[[0, 2, 4, 7]], t])
    ref = ref_model.forward(chain, torch.arange(chain.numel()), 0, chain_mask(0, chain.numel()))[-1]
    assert (out - ref).abs().max().item() < TOL


def test_compact_is_overlap_safe(folder):
    m = new_model(folder, max_slots=16)
    L = m.cfg.num_layers
    m.k_cache.copy_(torch.arange(16, dtype=torch.float32).view(1, 16, 1, 1).expand_as(m.k_cache))
    m.v_cache.copy_(m.k_cache * 10)
    src = torch.tensor([5, 6, 7, 9])
    dst = torch.tensor([4, 5, 6, 7])              # shifting left over its own sources
    m.compact_kv(src, dst)
    slots = m.k_cache[:, :, 0, 0]
    assert slots.shape == (L, 16)
    assert slots[0, 4:8].tolist() == [5.0, 6.0, 7.0, 9.0]
    assert slots[0, :4].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert m.v_cache[1, 4:8, 0, 0].tolist() == [50.0, 60.0, 70.0, 90.0]
    m.compact_kv(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))

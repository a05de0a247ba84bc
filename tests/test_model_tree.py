"""Tree attention: one forward over a token tree on top of a committed prefix gives, for every
node, the logits of running its root-to-node path as a plain chain (1e-5, CPU float32). Covers
the verify shape (square tree mask at start = P) and the draft-expansion shape (new leaves
written after earlier tree nodes, non-square mask), and logits_rows."""
from __future__ import annotations

import pytest
import torch

from swiftspec_mpi.checkpoints.hf_loader import SafetensorsSource
from swiftspec_mpi.checkpoints.tiny import random_weights, write_hf_folder
from swiftspec_mpi.network.transformer import Transformer, chain_mask
from model_configs import small_config

TOL = 1e-5
VOCAB = 101


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tmp_path_factory):
    cfg = small_config(request.param, vocab_size=VOCAB)
    w = random_weights(cfg, seed=11, late_scale=1.0)
    # logits of O(1) (max ~4): 1e-5 absolute is then ~1e-6 relative, float32 summation-order
    # noise between a 12-row tree matmul and 1-row chain steps stays well below it
    w["lm_head.weight"] *= 0.3
    folder = write_hf_folder(str(tmp_path_factory.mktemp("tree_" + request.param)), cfg, w)
    src = SafetensorsSource(folder)
    m = Transformer(src.config, max_slots=96)
    m.load_weights(src)
    return m


def random_tree(n: int, gen: torch.Generator) -> list[int]:
    """parents[i] < i (parents[0] = -1): a random tree in topological order."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def tree_tensors(parents: list[int], P: int, first: int = 0, last: int | None = None):
    """positions [M] and mask [M, P+last] for nodes first..last-1 of the tree (all earlier nodes'
    KV already in slots P..P+first-1)."""
    n = len(parents)
    last = n if last is None else last
    depth, anc = [], []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        a = set() if p < 0 else set(anc[p])
        a.add(i)
        anc.append(a)
    M = last - first
    mask = torch.zeros(M, P + last, dtype=torch.bool)
    mask[:, :P] = True
    for r, i in enumerate(range(first, last)):
        for j in anc[i]:
            mask[r, P + j] = True
    positions = torch.tensor([P + depth[i] for i in range(first, last)])
    return positions, mask


def path_to(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def chain_logits(m: Transformer, prefix: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the last token of prefix+path run as a chain (prefix KV rewritten too)."""
    P = prefix.numel()
    m.forward(prefix, torch.arange(P), 0, chain_mask(0, P))
    k = path_tokens.numel()
    return m.forward(path_tokens, torch.arange(P, P + k), P, chain_mask(P, k))[-1]


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_nodes_equal_their_paths(model, seed):
    gen = torch.Generator().manual_seed(seed)
    P, n = 17, 12
    prefix = torch.randint(0, VOCAB, (P,), generator=gen)
    tokens = torch.randint(0, VOCAB, (n,), generator=gen)
    parents = random_tree(n, gen)
    model.forward(prefix, torch.arange(P), 0, chain_mask(0, P))
    positions, mask = tree_tensors(parents, P)
    tree = model.forward(tokens, positions, P, mask)
    rows = torch.tensor([n - 1, 0, 5])
    sub = model.forward(tokens, positions, P, mask, logits_rows=rows)
    assert (sub - tree[rows]).abs().max().item() < TOL
    for i in range(n):
        ref = chain_logits(model, prefix, tokens[path_to(parents, i)])
        assert (tree[i] - ref).abs().max().item() < TOL, f"node {i} (path {path_to(parents, i)})"


def test_incremental_expansion_equals_paths(model):
    """Draft shape: the tree is grown in three calls, each writing new nodes after the earlier
    ones (start = P + nodes so far) with a non-square mask."""
    gen = torch.Generator().manual_seed(7)
    P, n = 9, 14
    prefix = torch.randint(0, VOCAB, (P,), generator=gen)
    tokens = torch.randint(0, VOCAB, (n,), generator=gen)
    parents = random_tree(n, gen)
    model.forward(prefix, torch.arange(P), 0, chain_mask(0, P))
    out = []
    for a, b in ((0, 3), (3, 4), (4, 14)):
        positions, mask = tree_tensors(parents, P, a, b)
        assert mask.shape == (b - a, P + b)
        out.append(model.forward(tokens[a:b], positions, P + a, mask))
    tree = torch.cat(out)
    for i in range(n):
        ref = chain_logits(model, prefix, tokens[path_to(parents, i)])
        assert (tree[i] - ref).abs().max().item() < TOL, f"node {i}"


def test_chain_mask_shape():
    m = chain_mask(3, 2)
    assert m.dtype == torch.bool and m.tolist() == [[True] * 4 + [False], [True] * 5]


@pytest.mark.parametrize("n", [1, 2, 37])
def test_causal_prompt_equals_chain_mask(model, n):
    """forward(causal=True) of a prompt at slot 0 (SDPA's causal kernel, no mask: what prefill
    runs) gives the logits and the KV of the same forward with chain_mask; a later chain with
    causal=True still needs and uses its mask (start > 0)."""
    g = torch.Generator().manual_seed(n)
    toks = torch.randint(0, VOCAB, (n,), generator=g)
    ref = model.forward(toks, torch.arange(n), 0, chain_mask(0, n)).clone()
    kv_ref = [(kc[:n].clone(), vc[:n].clone()) for *_, kc, vc in model.layers]
    got = model.forward(toks, torch.arange(n), 0, None, causal=True)
    assert torch.allclose(got, ref, atol=TOL, rtol=0)
    for (kr, vr), (*_, kc, vc) in zip(kv_ref, model.layers):
        assert torch.allclose(kc[:n], kr, atol=TOL, rtol=0) and torch.allclose(vc[:n], vr, atol=TOL, rtol=0)
    more = torch.randint(0, VOCAB, (3,), generator=g)
    a = model.forward(more, torch.arange(n, n + 3), n, chain_mask(n, 3)).clone()
    b = model.forward(more, torch.arange(n, n + 3), n, chain_mask(n, 3), causal=True)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="mask is required"):
        model.forward(more, torch.arange(n, n + 3), n, None, causal=True)


def test_prompt_buckets():
    from swiftspec_mpi.engine.decoding import prompt_bucket, prompt_buckets
    assert [prompt_bucket(n, 4096) for n in (1, 16, 17, 256, 257, 1024, 1025, 4000)] == \
        [16, 16, 32, 256, 320, 1024, 1280, 4096]
    assert prompt_bucket(90, 95) == 90                      # the bucket (96) would not fit
    b = prompt_buckets(4160)
    assert len(b) == 40 and b[:3] == [16, 32, 48] and b[-1] == 4096 and b == sorted(set(b))
    assert all(prompt_bucket(n, 4160) in b for n in range(1, 4097))
    assert prompt_buckets(300)[-1] == 256 and prompt_buckets(10) == []


def test_padded_prompt_leaves_the_real_rows_alone(model):
    """What _prefill does on a GPU: the prompt padded at its end (token 0) to its bucket. The
    real rows' KV and the next step's logits equal those of the unpadded prompt (the padded
    rows come later, so causal attention hides them; their KV slots are rewritten by the next
    forward before anything attends to them)."""
    n, m = 21, 32
    g = torch.Generator().manual_seed(9)
    toks = torch.randint(1, VOCAB, (n,), generator=g)
    nxt = torch.randint(1, VOCAB, (2,), generator=g)
    model.forward(toks, torch.arange(n), 0, None, causal=True)
    kv_ref = [(kc[:n].clone(), vc[:n].clone()) for *_, kc, vc in model.layers]
    ref = model.forward(nxt, torch.arange(n, n + 2), n, chain_mask(n, 2)).clone()
    padded = torch.cat([toks, torch.zeros(m - n, dtype=torch.long)])
    model.forward(padded, torch.arange(m), 0, None, logits_rows=torch.tensor([n - 1]), causal=True)
    for (kr, vr), (*_, kc, vc) in zip(kv_ref, model.layers):
        assert torch.allclose(kc[:n], kr, atol=TOL, rtol=0) and torch.allclose(vc[:n], vr, atol=TOL, rtol=0)
    got = model.forward(nxt, torch.arange(n, n + 2), n, chain_mask(n, 2))
    assert torch.allclose(got, ref, atol=TOL, rtol=0)

"""Transformer.step_read_bytes: the weight bytes one decode step streams (the bandwidth floor the
GPU benchmarks divide by): all layer weights, the final norm and the LM head, but an untied
embedding table only through the rows it looks up."""
from __future__ import annotations

import dataclasses

import pytest

import torch

from swiftspec_mpi.checkpoints.dummy import SHAPES, RandomSource  # noqa: E402
from swiftspec_mpi.core.comm import SingleComm  # noqa: E402
from swiftspec_mpi.network.transformer import Transformer  # noqa: E402


@pytest.mark.parametrize("tied", [False, True])
def test_step_read_bytes_leaves_out_an_untied_embedding(tied):
    cfg = dataclasses.replace(SHAPES["llama-3.2-1b"].with_layers(2), vocab_size=1000, hidden_size=256,
                              intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                              tie_word_embeddings=tied)
    model = Transformer(cfg, SingleComm(), max_slots=64, dtype=torch.bfloat16, device="cpu")
    model.load_weights(RandomSource(cfg, "cpu", torch.bfloat16, seed=0))
    emb = cfg.vocab_size * cfg.hidden_size * 2
    # untied: the embedding table is left out; tied: it is read in full as the LM head
    assert model.weight_bytes() - model.step_read_bytes() == (0 if tied else emb)
    # every layer's weights are in it: the step bytes grow by one layer's worth per layer
    one = Transformer(dataclasses.replace(cfg, num_layers=1), SingleComm(), max_slots=64,
                      dtype=torch.bfloat16, device="cpu")
    one.load_weights(RandomSource(dataclasses.replace(cfg, num_layers=1), "cpu", torch.bfloat16, seed=0))
    per_layer = model.step_read_bytes() - one.step_read_bytes()
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    assert per_layer >= 2 * (2 * H + (cfg.num_heads + 2 * cfg.num_kv_heads) * D * H
                             + H * cfg.num_heads * D + 3 * H * I)
    assert one.step_read_bytes() >= emb + per_layer                # the head and one layer

"""Shared pytest fixtures.

`tiny_pair` (session scope): a tiny random target/draft pair written once per test session by
`swiftspec_mpi.model.tiny.write_tiny_pair` (the `swiftspec tiny-checkpoint` code) into a temporary
folder. Returns `(target_dir, draft_dir)` as strings: Hugging Face folders (qwen2 arch, hidden
64, 4 layers target / 2 layers draft, 4 heads / 2 KV heads, 2048-token byte-level BPE tokenizer
with a ChatML template, float32 safetensors). Treat them as read-only: copy a folder before
corrupting it.
"""
from __future__ import annotations

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, _ROOT)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir) of a tiny random qwen2 pair (seed 0); see the module doc."""
    from swiftspec_mpi.model.tiny import write_tiny_pair
    out = tmp_path_factory.mktemp("tiny_pair")
    target, draft = write_tiny_pair(str(out), seed=0, arch="qwen2")
    return str(target), str(draft)

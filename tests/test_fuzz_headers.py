"""Fuzz the checkpoint header parsers: random byte overwrites and truncations of small valid
safetensors and GGUF files (the tiny draft model) must either load or raise CheckpointError
(a UserError: one line naming the file and the fix) — never another exception type, a crash,
a hang or a giant allocation.

Mutations aim at the headers (the safetensors JSON header with its 8-byte length; the GGUF
metadata and tensor table), where parsing happens; a few land anywhere. Time-bounded for CI:
hypothesis runs a fixed number of examples per parser, no deadline per example.
"""
from __future__ import annotations

import itertools
import os
import shutil

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from reliability_helpers import gguf_data_start, safetensors_header_end, write_tiny_gguf
from swiftspec_mpi import checkpoint, gguf_loader
from swiftspec_mpi.errors import CheckpointError

FUZZ = settings(max_examples=int(os.environ.get("SWIFTSPEC_FUZZ_EXAMPLES", "60")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                print_blob=True)
_counter = itertools.count()


@pytest.fixture(scope="module")
def originals(tiny_pair, tmp_path_factory):
    """(HF folder, its safetensors bytes, header end), (GGUF bytes, header end), scratch dir."""
    draft = tiny_pair[1]
    d = tmp_path_factory.mktemp("fuzz")
    with open(os.path.join(draft, "model.safetensors"), "rb") as f:
        st_bytes = f.read()
    gguf_path = write_tiny_gguf(draft, str(d / "draft.gguf"))
    with open(gguf_path, "rb") as f:
        gguf_bytes = f.read()
    return _Originals({"hf": draft, "st": st_bytes, "st_header": safetensors_header_end(
        os.path.join(draft, "model.safetensors")), "gguf": gguf_bytes,
        "gguf_header": gguf_data_start(gguf_path), "dir": d})


class _Originals(dict):
    def __repr__(self):          # keep hypothesis' failure report readable
        return "<originals>"


def mutate(data: bytes, header_end: int, draw) -> bytes:
    """Overwrite 1-8 bytes (mostly in the header, sometimes anywhere), maybe also truncate."""
    buf = bytearray(data)
    n = draw(st.integers(1, 8))
    for _ in range(n):
        anywhere = draw(st.booleans()) and draw(st.booleans())     # ~1 in 4
        pos = draw(st.integers(0, (len(buf) if anywhere else header_end) - 1))
        buf[pos] = draw(st.integers(0, 255))
    if draw(st.integers(0, 4)) == 0:
        buf = buf[:draw(st.integers(0, len(buf)))]
    return bytes(buf)


def only_checkpoint_errors(fn, *args, **kw):
    """Run fn; success or CheckpointError pass, anything else fails the example."""
    try:
        result = fn(*args, **kw)
    except CheckpointError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg, f"CheckpointError must be one line: {msg!r}"
        event(f"{fn.__name__}: CheckpointError")
        return None
    event(f"{fn.__name__}: ok")
    return result


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors(originals, data):
    from swiftspec_mpi.job import check_weight_files
    blob = mutate(originals["st"], originals["st_header"], data.draw)
    folder = originals["dir"] / f"st{next(_counter)}"
    os.makedirs(folder)
    for name in os.listdir(originals["hf"]):
        if name != "model.safetensors":
            shutil.copyfile(os.path.join(originals["hf"], name), folder / name)
    (folder / "model.safetensors").write_bytes(blob)
    try:
        only_checkpoint_errors(check_weight_files, str(folder))     # rank 0's header check
        only_checkpoint_errors(checkpoint.read_model_config, folder)
        only_checkpoint_errors(checkpoint.load_model, folder, max_slots=32)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf(originals, data):
    blob = mutate(originals["gguf"], originals["gguf_header"], data.draw)
    path = originals["dir"] / f"g{next(_counter)}.gguf"       # a new name: no header-cache hit
    path.write_bytes(blob)
    try:
        only_checkpoint_errors(checkpoint.read_model_config, path)
        src = only_checkpoint_errors(gguf_loader.GGUFSource, path)
        if src is not None:
            src.close()
        only_checkpoint_errors(checkpoint.load_tokenizer, path)
        only_checkpoint_errors(checkpoint.load_model, path, max_slots=32)
    finally:
        path.unlink(missing_ok=True)


def test_unmutated_files_load(originals):
    """The fuzzers' starting points are valid (else every example would just be refused)."""
    path = originals["dir"] / "valid.gguf"
    path.write_bytes(originals["gguf"])
    model, tok = checkpoint.load_model(path, max_slots=32)
    assert model.cfg.num_layers == 2 and tok.vocab_size == 2048
    model, tok = checkpoint.load_model(originals["hf"], max_slots=32)
    assert model.cfg.num_layers == 2
    assert originals["st_header"] < len(originals["st"])
    assert originals["gguf_header"] < len(originals["gguf"])

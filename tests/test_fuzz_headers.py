"""Fuzz the checkpoint header parsers with damaged copies of small valid files (the tiny draft
as safetensors and as GGUF): whatever the damage, every parser either succeeds or raises
CheckpointError (a UserError: one line naming the file and the fix) — never another exception
type, a crash, a hang or a giant allocation.

Four fuzzers:
- safetensors bytes: 1-8 random byte overwrites (mostly in the 8-byte length + JSON header),
  sometimes a truncation;
- safetensors structure: a well-formed header whose content lies (dtype, shape, offsets changed,
  tensors deleted, renamed or aliased), with a correct length prefix;
- GGUF bytes: as for safetensors, in the metadata + tensor table;
- GGUF fields: one or two metadata values or tensor-table entries (dims, type, data offset)
  rewritten with edge values (0, 1, 2**31, all ones, NaN, ...).

Each example goes through what `swiftspec run` does with a checkpoint: rank 0 validates
(read_model_config, load_tokenizer, validate.check_weight_files: headers + shapes against the
config), then a rank loads it (load_model), for GGUF only once validation passed: a GGUF whose
metadata disagrees with its tensors must be refused by validation, never reach an allocation
of what the metadata claims. The property checked on top: what validation accepts, loading
accepts too (no failure left for after every rank loaded).

Time-bounded for CI: a fixed number of examples per fuzzer, derandomized (the same examples on
every run: a failure is reproducible, not flaky). SWIFTSPEC_FUZZ_EXAMPLES=N and
SWIFTSPEC_FUZZ_RANDOM=1 run more / fresh examples locally.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import struct

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from reliability_helpers import gguf_data_start, gguf_spans, safetensors_header_end, write_tiny_gguf
from swiftspec_mpi.checkpoints import gguf_loader, load as checkpoint
from swiftspec_mpi.cli.validate import check_weight_files
from swiftspec_mpi.core.errors import CheckpointError

FUZZ = settings(max_examples=int(os.environ.get("SWIFTSPEC_FUZZ_EXAMPLES", "100")), deadline=None,
                derandomize=not os.environ.get("SWIFTSPEC_FUZZ_RANDOM"), database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                print_blob=True)
_counter = itertools.count()


class _Originals(dict):
    def __repr__(self):          # keep hypothesis' failure report readable
        return "<originals>"


@pytest.fixture(scope="module")
def originals(tiny_pair, tmp_path_factory):
    draft = tiny_pair[1]
    d = tmp_path_factory.mktemp("fuzz")
    st_path = os.path.join(draft, "model.safetensors")
    with open(st_path, "rb") as f:
        st_bytes = f.read()
    gguf_path = write_tiny_gguf(draft, str(d / "draft.gguf"))
    with open(gguf_path, "rb") as f:
        gguf_bytes = f.read()
    header_end = safetensors_header_end(st_path)
    return _Originals(hf=draft, st=st_bytes, st_header_end=header_end,
                      st_header=json.loads(st_bytes[8:header_end]), gguf=gguf_bytes,
                      gguf_header_end=gguf_data_start(gguf_path), gguf_spans=gguf_spans(gguf_path),
                      dir=d)


# ------------------------------------------------------------------------------------ checks

def attempt(fn, *args, **kw) -> bool:
    """fn(...) succeeds (True) or raises a one-line CheckpointError (False); anything else
    fails the example."""
    try:
        fn(*args, **kw)
    except CheckpointError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg, f"CheckpointError must be one line: {msg!r}"
        event(f"{fn.__name__}: CheckpointError")
        return False
    event(f"{fn.__name__}: ok")
    return True


def validate(path) -> bool:
    """Rank 0's checks of one checkpoint, as validate.prepare_config makes them."""
    try:
        cfg = checkpoint.read_model_config(path)
    except CheckpointError as exc:
        assert "\n" not in str(exc)
        event("read_model_config: CheckpointError")
        return False
    ok = attempt(checkpoint.load_tokenizer, path)
    return attempt(check_weight_files, str(path), cfg) and ok


def gguf_source(path) -> None:
    gguf_loader.GGUFSource(path).close()


def check_gguf(path) -> None:
    attempt(gguf_source, path)
    if validate(path):
        assert attempt(checkpoint.load_model, path, max_slots=32), \
            "validation accepted a GGUF file that loading refuses"


def check_hf(folder) -> None:
    validated = validate(folder)
    loaded = attempt(checkpoint.load_model, folder, max_slots=32)
    assert loaded or not validated, "validation accepted weights that loading refuses"


def hf_copy(originals, blob: bytes):
    folder = originals["dir"] / f"st{next(_counter)}"
    os.makedirs(folder)
    for name in os.listdir(originals["hf"]):
        if name != "model.safetensors":
            shutil.copyfile(os.path.join(originals["hf"], name), folder / name)
    (folder / "model.safetensors").write_bytes(blob)
    return folder


# ------------------------------------------------------------------------------------ mutations

def mutate_bytes(data: bytes, header_end: int, draw) -> bytes:
    """Overwrite 1-8 bytes (mostly in the header, sometimes anywhere), maybe also truncate."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 8))):
        anywhere = draw(st.integers(0, 3)) == 0
        pos = draw(st.integers(0, (len(buf) if anywhere else header_end) - 1))
        buf[pos] = draw(st.integers(0, 255))
    if draw(st.integers(0, 4)) == 0:
        buf = buf[:draw(st.integers(0, len(buf)))]
    return bytes(buf)


_DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3", "XYZ"]
_EDGE = [0, 1, 2, 3, 31, 64, 176, 2048, 1 << 20, 1 << 31, (1 << 63) - 1, -1]


def mutate_safetensors_header(originals, draw) -> bytes:
    header = json.loads(json.dumps(originals["st_header"]))
    names = sorted(k for k in header if k != "__metadata__")
    body = originals["st"][originals["st_header_end"]:]
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(names))
        if name not in header:
            continue
        op = draw(st.sampled_from(["dtype", "shape", "rank", "offsets", "delete", "rename", "alias"]))
        info = header[name]
        if op == "dtype":
            info["dtype"] = draw(st.sampled_from(_DTYPES))
        elif op == "shape" and info["shape"]:
            info["shape"][draw(st.integers(0, len(info["shape"]) - 1))] = draw(st.sampled_from(_EDGE))
        elif op == "rank":
            info["shape"] = info["shape"] + [1] if draw(st.booleans()) else info["shape"][:-1]
        elif op == "offsets":
            info["data_offsets"][draw(st.integers(0, 1))] = draw(
                st.sampled_from([0, 4, len(body) - 4, len(body), len(body) + 4, -1]))
        elif op == "delete":
            del header[name]
        elif op == "rename":
            header[name + draw(st.sampled_from(["x", ".weight", "_"]))] = header.pop(name)
        elif op == "alias":                     # two tensors claim the same bytes
            other = header.get(draw(st.sampled_from(names)))
            if other is not None:
                info["data_offsets"] = list(other["data_offsets"])
        event(f"safetensors header op: {op}")
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + body


def mutate_gguf_fields(originals, draw) -> bytes:
    buf = bytearray(originals["gguf"])
    spans = originals["gguf_spans"]
    meta = [s for s in spans if not s[0].endswith((".n_dims", ".dims", ".type", ".offset"))]
    for _ in range(draw(st.integers(1, 2))):       # half metadata values, half tensor table
        label, offset, n, kind = draw(st.sampled_from(meta if draw(st.booleans()) else spans))
        how = draw(st.integers(0, 2))
        if kind == "int" and how < 2:
            top = (1 << (8 * n)) - 1
            value = draw(st.sampled_from([0, 1, 2, 3, 7, 64, 4096, 1 << 31, top >> 1, top]))
            if how == 1:
                value = draw(st.integers(0, top))
            buf[offset:offset + n] = value.to_bytes(n, "little")
        elif kind == "float" and how < 2:
            buf[offset:offset + n] = struct.pack("<f", draw(st.sampled_from(
                [0.0, -1.0, float("nan"), float("inf"), 1e30, 1e-30])))
        else:
            buf[offset:offset + n] = draw(st.binary(min_size=n, max_size=n))
        tensor_part = label.startswith(("blk.", "output", "token_embd"))
        event(f"gguf field: {label.rsplit('.', 1)[-1] if tensor_part else label}")
    return bytes(buf)


# ------------------------------------------------------------------------------------ fuzzers

def check_hf_blob(originals, blob: bytes) -> None:
    """check_hf on a copy of the HF folder whose model.safetensors is `blob`."""
    folder = hf_copy(originals, blob)
    try:
        check_hf(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_bytes(originals, data):
    check_hf_blob(originals, mutate_bytes(originals["st"], originals["st_header_end"], data.draw))


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header_structure(originals, data):
    check_hf_blob(originals, mutate_safetensors_header(originals, data.draw))


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_bytes(originals, data):
    blob = mutate_bytes(originals["gguf"], originals["gguf_header_end"], data.draw)
    path = originals["dir"] / f"g{next(_counter)}.gguf"       # a new name: no header-cache hit
    path.write_bytes(blob)
    try:
        check_gguf(path)
    finally:
        path.unlink(missing_ok=True)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_fields(originals, data):
    path = originals["dir"] / f"f{next(_counter)}.gguf"
    path.write_bytes(mutate_gguf_fields(originals, data.draw))
    try:
        check_gguf(path)
    finally:
        path.unlink(missing_ok=True)


def test_unmutated_files_validate_and_load(originals):
    """The fuzzers' starting points are valid (else every example would only be refused)."""
    path = originals["dir"] / "valid.gguf"
    path.write_bytes(originals["gguf"])
    for p in (path, originals["hf"]):
        cfg = checkpoint.read_model_config(p)
        check_weight_files(str(p), cfg)
        model, tok = checkpoint.load_model(p, max_slots=32)
        assert model.cfg.num_layers == 2 and tok.vocab_size == 2048
    assert originals["st_header_end"] < len(originals["st"])
    assert originals["gguf_header_end"] < len(originals["gguf"])
    assert len(originals["gguf_spans"]) > 40

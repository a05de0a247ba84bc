"""The environment switches (`SWIFTSPEC_*`): one table, parsed and validated here only.

Every `SWIFTSPEC_*` variable the package reads is a row of SWITCHES: its kind, its default and
what it does (the README lists the same table). Code reads a value with `flag(name)` (booleans),
`choice(name)` or `path(name)`; rank 0 calls `check_all()` before any rank reads one, so a typo
(`SWIFTSPEC_NO_GRAPHS=yes please`) is refused with the fix instead of silently giving the default.

Booleans accept 1/0, true/false, yes/no, on/off (any case); `=0` means off.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from swiftspec_mpi.core.errors import UserError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    """One environment variable: `kind` "bool", "choice" (one of `choices`) or "path"."""
    kind: str
    default: object
    meaning: str
    choices: tuple = ()


SWITCHES = {
    "SWIFTSPEC_FUSED_OPS": Switch(
        "bool", True, "GPU: the fused elementwise kernels and GEMVs in the graphed decode forward "
        "(0: the torch ops of the plain forward, for comparisons)"),
    "SWIFTSPEC_FUSED_GEMM": Switch(
        "choice", "pdl", "GPU projections: pdl = the GEMV kernels, every kernel launched with "
        "programmatic dependent launch; cublas = cuBLAS for every projection (the torch ops' bits)",
        ("pdl", "cublas")),
    "SWIFTSPEC_FUSED_ALLREDUCE": Switch(
        "bool", False, "GPU tensor parallelism: fuse each row-parallel GEMV with its all-reduce "
        "(NCCL device API, one NVLink domain) instead of NCCL's all-reduce after it"),
    "SWIFTSPEC_NO_GRAPHS": Switch(
        "bool", False, "GPU: run the decode forwards eagerly instead of replaying CUDA graphs"),
    "SWIFTSPEC_NO_PIN": Switch(
        "bool", False, "do not pin each rank's threads to its own cores (several jobs on one node)"),
    "SWIFTSPEC_KERNELS_LINEINFO": Switch(
        "bool", False, "compile the CUDA kernels with -lineinfo (source lines in Nsight Compute)"),
    "SWIFTSPEC_CACHE": Switch(
        "path", None, "folder of the model registry's downloads and conversions (default: "
        "<checkout>/.cache/models in a source checkout, else ~/.cache/swiftspec)"),
}


def _raw(name: str) -> str | None:
    if name not in SWITCHES:
        raise KeyError(f"{name} is not in the switch table (core/switches.py)")
    return os.environ.get(name)


def _parse(name: str, raw: str):
    """The value of switch `name` given as `raw`; UserError naming the fix if it is not one."""
    sw = SWITCHES[name]
    v = raw.strip().lower()
    if sw.kind == "bool":
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise UserError(f"{name}={raw!r} is not a switch; use 1 or 0, or unset it for the default "
                        f"({int(sw.default)}: {sw.meaning})")
    if sw.kind == "choice":
        if v in sw.choices:
            return v
        raise UserError(f"{name}={raw!r} is not one of {', '.join(sw.choices)}; use one of them, "
                        f"or unset it for the default ({sw.default})")
    return os.path.expanduser(raw) if raw else None


def _value(name: str):
    """Switch `name`'s value: its default when unset or not a value it takes (check_all refuses
    those on rank 0 before any rank reads one)."""
    raw = _raw(name)
    if raw is None:
        return SWITCHES[name].default
    try:
        return _parse(name, raw)
    except UserError:
        return SWITCHES[name].default


def flag(name: str) -> bool:
    """A boolean switch."""
    return bool(_value(name))


def choice(name: str) -> str:
    """A choice switch: one of its choices."""
    return _value(name)


def path(name: str) -> str | None:
    """A path switch: the expanded path, or None when unset or empty."""
    raw = _raw(name)
    return _parse(name, raw) if raw else None


def check_all() -> None:
    """Rank 0, before any heavy work: UserError for the first switch set to a value it does not
    take."""
    for name in SWITCHES:
        raw = os.environ.get(name)
        if raw is not None:
            _parse(name, raw)


def markdown_table() -> str:
    """The README's table of the switches (| variable | default | what it does |)."""
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for name, sw in SWITCHES.items():
        default = {True: "1", False: "0", None: "unset"}.get(sw.default, sw.default) \
            if not isinstance(sw.default, str) else sw.default
        rows.append(f"| `{name}` | {default} | {sw.meaning} |")
    return "\n".join(rows)

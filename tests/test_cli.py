"""The command line a user meets first: help texts, the console script, python -m, TOML config
precedence, and one-line errors for bad values (no traceback)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from swiftspec_mpi.cli.main import SUBCOMMANDS

BIN = Path(sys.executable).parent


def run(*args, timeout=120):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def test_console_script_lists_every_subcommand():
    proc = run(str(BIN / "swiftspec"), "--help")
    assert proc.returncode == 0
    for name in ("run", "analyze", "bench", "tiny-checkpoint", "models"):
        assert name in proc.stdout


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_has_help(name):
    proc = run(sys.executable, "-m", "swiftspec_mpi", name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: swiftspec" in proc.stdout and len(proc.stdout.splitlines()) > 5


def test_run_help_explains_every_option():
    proc = run(sys.executable, "-m", "swiftspec_mpi", "run", "--help")
    for flag in ("--target", "--draft", "--mode", "--draft-ranks", "--async-policy", "--prompt", "--prompts",
                 "--max-new-tokens", "--temperature", "--seed", "--dtype", "--out", "--chat", "--config"):
        assert flag in proc.stdout


def test_toml_config_and_flag_precedence(tmp_path):
    from swiftspec_mpi.core.config import load_toml, merge
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('mode = "sync"\nmax-new-tokens = 32\ntemperature = 0.5\nstop = ["###"]\n')
    values = load_toml(str(cfg_file))
    cfg = merge(values, {"max_new_tokens": 7, "mode": None})
    assert cfg.mode == "sync" and cfg.max_new_tokens == 7 and cfg.temperature == 0.5
    assert cfg.stop == ["###"]


def test_toml_unknown_key_is_one_clear_error(tmp_path):
    cfg_file = tmp_path / "bad.toml"
    cfg_file.write_text("max_new_tokenz = 3\n")
    proc = run(sys.executable, "-m", "swiftspec_mpi", "run", "--config", str(cfg_file))
    assert proc.returncode == 2
    assert "unknown key 'max_new_tokenz'" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,needle", [
    (["--mode", "fast"], "unknown mode 'fast'"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--mode", "async"], "needs at least 2 MPI ranks"),
    (["--mode", "ar", "--draft-ranks", "1"], "--draft-ranks applies to --mode async only"),
    (["--mode", "sync", "--async-policy", "fresh"], "--async-policy applies to --mode async only"),
])
def test_bad_values_fail_with_one_line(args, needle):
    proc = run(sys.executable, "-m", "swiftspec_mpi", "run", *args)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_async_policy_is_validated():
    """The default is filled in for async; an unknown name is refused with the choices."""
    from swiftspec_mpi.core.config import ASYNC_POLICIES, DEFAULT_ASYNC_POLICY, RunConfig, validate_basic
    from swiftspec_mpi.core.errors import UserError
    assert validate_basic(RunConfig(mode="async", prompt="x"), 2).async_policy == DEFAULT_ASYNC_POLICY
    for policy in ASYNC_POLICIES:
        assert validate_basic(RunConfig(mode="async", prompt="x", async_policy=policy), 2).async_policy == policy
    with pytest.raises(UserError, match="unknown async policy 'eager'; use --async-policy stream, remnant, fresh"):
        validate_basic(RunConfig(mode="async", prompt="x", async_policy="eager"), 2)


@pytest.mark.parametrize("var,value,needle", [
    ("SWIFTSPEC_FUSED_GEMM", "fast", "SWIFTSPEC_FUSED_GEMM='fast' is not one of pdl, cublas"),
    ("SWIFTSPEC_NO_GRAPHS", "maybe", "SWIFTSPEC_NO_GRAPHS='maybe' is not a switch"),
    ("SWIFTSPEC_FUSED_OPS", "maybe", "SWIFTSPEC_FUSED_OPS='maybe' is not a switch"),
    ("SWIFTSPEC_FUSED_ALLREDUCE", "2", "SWIFTSPEC_FUSED_ALLREDUCE='2' is not a switch"),
])
def test_bad_environment_switch_fails_with_one_line(var, value, needle):
    """The GPU switches are environment variables; a typo must not silently pick the default."""
    import os
    env = dict(os.environ, **{var: value})
    proc = subprocess.run([sys.executable, "-m", "swiftspec_mpi", "run", "--load-format", "dummy",
                           "--target", "tiny", "--mode", "ar", "--max-new-tokens", "1"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_python_m_and_console_script_agree():
    a = run(sys.executable, "-m", "swiftspec_mpi", "--version")
    b = run(str(BIN / "swiftspec"), "--version")
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout and "swiftspec-mpi" in a.stdout


def test_dummy_load_format_takes_shape_names(tmp_path):
    """`--load-format dummy --target SHAPE --draft SHAPE` (the GPU benchmarks): rank
    0's validation accepts shape names (no weight files to check) and keeps them as given."""
    from swiftspec_mpi.cli import job
    flags = dict(load_format="dummy", target="qwen2.5-1.5b", draft="qwen2.5-0.5b", mode="async",
                 prompt="hi", max_new_tokens=4, out=str(tmp_path / "o.h5"), device="cpu")
    cfg = job.prepare_config(flags, None, world_size=2)
    assert (cfg.target, cfg.draft, cfg.load_format) == ("qwen2.5-1.5b", "qwen2.5-0.5b", "dummy")


def test_default_kv_slots_hold_the_padded_prompt(tmp_path):
    """The default --max-context holds the longest prompt plus the new tokens and the tree, and
    at least that prompt padded to its bucket (what a GPU prompt forward writes)."""
    from swiftspec_mpi.cli import job
    from swiftspec_mpi.engine.decoding import prompt_bucket
    for words, new in ((3, 4), (300, 400), (515, 4)):     # 515 words: ~1030 tokens, bucket 1280
        flags = dict(load_format="dummy", target="qwen2.5-1.5b", draft="qwen2.5-0.5b", mode="async",
                     prompt=" ".join(["word"] * words), max_new_tokens=new, out=str(tmp_path / "o.h5"),
                     device="cpu")
        cfg = job.prepare_config(flags, None, world_size=2)
        n = len(cfg.requests[0].ids)
        assert cfg.max_context >= n + new + 16 and cfg.max_context >= prompt_bucket(n - 1, 1 << 30), \
            (words, new, n, cfg.max_context)

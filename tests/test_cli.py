"""The command line a user meets first: help texts, the console script, python -m, TOML config
precedence, and one-line errors for bad values (no traceback)."""
from __future__ import annotations

import os
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
    text = " ".join(proc.stdout.split())
    assert "(default 8)" not in text.split("--tree-width")[1].split("--expansions")[0]
    from swiftspec_mpi.core.config import TREE_SIZES
    sizes = f"{', '.join(map(str, TREE_SIZES[:-1]))} or {TREE_SIZES[-1]}"
    assert f"startup profile of the target picks {sizes}," in text


def test_toml_config_and_flag_precedence(tmp_path):
    from swiftspec_mpi.core.config import load_toml, merge
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('mode = "sync"\nmax-new-tokens = 32\ntemperature = 0.5\nstop = ["###"]\n')
    values = load_toml(str(cfg_file))
    cfg = merge(values, {"max_new_tokens": 7, "mode": None})
    assert cfg.mode == "sync" and cfg.max_new_tokens == 7 and cfg.temperature == 0.5
    assert cfg.stop == ["###"]


def test_toml_keys_are_the_flag_names(tmp_path):
    """Every `swiftspec run` flag, spelt as on the command line without the dashes (or with
    underscores), is a TOML key for the field the flag sets: `stop-token-id = [5]` works."""
    import argparse

    from swiftspec_mpi.cli import run as run_cmd
    from swiftspec_mpi.core.config import load_toml, merge
    parser = argparse.ArgumentParser()
    run_cmd.add_arguments(parser)
    flags = {opt[2:]: a.dest for a in parser._actions for opt in a.option_strings
             if opt.startswith("--") and a.dest not in ("help", "config")}
    assert flags["stop-token-id"] == "stop_token_ids" and len(flags) == len(run_cmd.FLAG_FIELDS)
    sample = {"str": '"x"', "int": "3", "float": "0.5", "bool": "true", "list[str]": '["###"]',
              "list[int]": "[5, 7]"}
    from swiftspec_mpi.core.config import RunConfig
    for flag, dest in flags.items():
        kind = RunConfig.__dataclass_fields__[dest].type.replace(" | None", "")
        for key in (flag, flag.replace("-", "_")):
            (tmp_path / "k.toml").write_text(f"{key} = {sample[kind]}\n")
            assert list(load_toml(str(tmp_path / "k.toml"))) == [dest], key
    (tmp_path / "run.toml").write_text('stop-token-id = [5]\nstop = "###"\nmax-new-tokens = 9\n')
    cfg = merge(load_toml(str(tmp_path / "run.toml")), {})
    assert cfg.stop_token_ids == [5] and cfg.stop == ["###"] and cfg.max_new_tokens == 9
    (tmp_path / "one.toml").write_text("stop_token_id = 5\n")            # one value of a repeatable flag
    assert load_toml(str(tmp_path / "one.toml")) == {"stop_token_ids": [5]}


@pytest.mark.parametrize("line,needle", [
    ("stop-token-id = [\"5\"]", "'stop-token-id' must be an integer or a list of them"),
    ("temperature = \"hot\"", "'temperature' must be a number"),
    ("max-new-tokens = true", "'max-new-tokens' must be an integer"),
    ("chat = 1", "'chat' must be true or false"),
    ("stop_token_ids = [5]", "unknown key 'stop_token_ids'; the keys are the flag names"),
])
def test_toml_bad_value_is_one_clear_error(tmp_path, line, needle):
    cfg_file = tmp_path / "bad.toml"
    cfg_file.write_text(line + "\n")
    proc = run(sys.executable, "-m", "swiftspec_mpi", "run", "--config", str(cfg_file))
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


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
    (["--mode", "sync", "--floor-depth", "3"], "--floor-depth applies to --mode async only"),
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
    with pytest.raises(UserError, match="unknown async policy 'floor'; use --async-policy rate, fresh"):
        validate_basic(RunConfig(mode="async", prompt="x", async_policy="floor"), 2)
    assert validate_basic(RunConfig(mode="async", prompt="x", async_policy="rate"), 2).floor_depth == 2
    assert validate_basic(RunConfig(mode="async", prompt="x", async_policy="rate", floor_depth=3), 2).floor_depth == 3
    assert validate_basic(RunConfig(mode="async", prompt="x", async_policy="fresh"), 2).floor_depth is None
    with pytest.raises(UserError, match="--floor-depth applies to --async-policy rate; drop it for fresh"):
        validate_basic(RunConfig(mode="async", prompt="x", async_policy="fresh", floor_depth=3), 2)
    with pytest.raises(UserError, match="--floor-depth must be an integer >= 1, got 0"):
        validate_basic(RunConfig(mode="async", prompt="x", async_policy="rate", floor_depth=0), 2)


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


def test_slurm_world_check_refuses_only_singletons_of_a_multi_task_step(monkeypatch):
    """README / docs/slurm.md: a world of size 1 in a step of several Slurm tasks (a PMI mismatch)
    is refused with the fix; equal sizes, mpiexec's larger world under one proxy task, the batch
    script itself and runs outside Slurm pass."""
    from swiftspec_mpi.core.config import check_slurm_world
    from swiftspec_mpi.core.errors import UserError
    for name in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    check_slurm_world(1)                                          # not under Slurm
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    check_slurm_world(1)                                          # the batch script: not a step
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    with pytest.raises(UserError, match="MPI world size is 1 but Slurm started 2 tasks.*--mpi=pmi2"):
        check_slurm_world(1)
    check_slurm_world(2)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    check_slurm_world(4)                                          # mpiexec: one proxy task


def test_a_cpu_gemm_that_does_not_import_fails_loudly(tmp_path):
    """The compiled CPU GEMM (_cpu_gemm) is part of every install: when it cannot be imported the
    model code raises ImportError, never a quiet fallback to another weight layout."""
    hook = tmp_path / "sitecustomize.py"
    hook.write_text(
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'swiftspec_mpi.packed._cpu_gemm':\n"
        "            raise ImportError('planted: _cpu_gemm does not load')\n"
        "sys.meta_path.insert(0, Block())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", "import swiftspec_mpi.network.transformer"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and "planted: _cpu_gemm does not load" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-c", "import swiftspec_mpi.network.transformer"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

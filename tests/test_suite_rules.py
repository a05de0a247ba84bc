"""The suite's own rules, so that a green run hides nothing: a skip names a condition of the
machine and is decided by checking it (conftest.py), never by catching a broad exception from our
code or by importorskip of a module the install always has; skip_or_fail turns the skips CI must
never take into failures under SWIFTSPEC_TEST_STRICT=1."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import conftest

TESTS = Path(__file__).resolve().parent
BROAD = {"Exception", "BaseException", "UserError", "CheckpointError"}   # our errors, or any


def _skip_calls(node: ast.AST):
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("skip", "importorskip", "skip_or_fail"):
                yield sub, name


def _handler_names(h: ast.ExceptHandler) -> set[str]:
    if h.type is None:
        return {"BaseException"}
    types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
    return {t.attr if isinstance(t, ast.Attribute) else getattr(t, "id", "?") for t in types}


def test_no_skip_catches_a_broad_exception_or_imports_a_module_we_ship():
    bad = []
    for path in sorted(TESTS.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and _handler_names(node) & BROAD:
                bad += [f"{path.name}:{c.lineno}: {n} inside except {sorted(_handler_names(node))}"
                        for c, n in _skip_calls(node)]
        for call, name in _skip_calls(tree):
            if name == "importorskip":
                bad.append(f"{path.name}:{call.lineno}: importorskip (the requirements pin every "
                           "test dependency; import it)")
    assert not bad, "\n".join(bad)


def test_skip_or_fail_skips_or_fails_by_the_strict_switch(monkeypatch):
    monkeypatch.delenv(conftest.STRICT_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no widget"):
        conftest.skip_or_fail("no widget")
    monkeypatch.setenv(conftest.STRICT_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="SWIFTSPEC_TEST_STRICT=1 and no widget"):
        conftest.skip_or_fail("no widget")
    monkeypatch.setenv(conftest.STRICT_ENV, "yes")
    with pytest.raises(pytest.UsageError, match="use 1"):
        conftest.skip_or_fail("no widget")


def test_ci_runs_strict_and_stops_without_slurm():
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert "export SWIFTSPEC_TEST_STRICT=1" in ci and "make test" in ci
    assert "|| echo" not in ci                      # no failing step is waved through

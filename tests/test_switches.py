"""The environment switch table (core/switches.py): booleans parse as booleans (=0 is off), bad
values are refused with the fix, and no module of the package reads a SWIFTSPEC_* variable
outside the table."""
import re
from pathlib import Path

import pytest

from swiftspec_mpi.core import switches
from swiftspec_mpi.core.errors import UserError

PACKAGE = Path(__file__).resolve().parent.parent / "swiftspec_mpi"


@pytest.mark.parametrize("value,want", [("1", True), ("0", False), ("off", False), ("Yes", True),
                                        (" true ", True), ("FALSE", False)])
def test_booleans(monkeypatch, value, want):
    monkeypatch.setenv("SWIFTSPEC_NO_GRAPHS", value)
    monkeypatch.setenv("SWIFTSPEC_NO_PIN", value)
    assert switches.flag("SWIFTSPEC_NO_GRAPHS") is want
    assert switches.flag("SWIFTSPEC_NO_PIN") is want
    switches.check_all()


def test_defaults_and_refusals(monkeypatch):
    for name in switches.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert switches.flag("SWIFTSPEC_FUSED_OPS") is True
    assert switches.flag("SWIFTSPEC_NO_GRAPHS") is False
    assert switches.choice("SWIFTSPEC_FUSED_GEMM") == "pdl"
    assert switches.path("SWIFTSPEC_CACHE") is None
    monkeypatch.setenv("SWIFTSPEC_FUSED_GEMM", "auto")       # the experiment mode is gone
    with pytest.raises(UserError, match="SWIFTSPEC_FUSED_GEMM='auto' is not one of pdl, cublas"):
        switches.check_all()
    monkeypatch.setenv("SWIFTSPEC_FUSED_GEMM", "CUBLAS")
    assert switches.choice("SWIFTSPEC_FUSED_GEMM") == "cublas"
    monkeypatch.setenv("SWIFTSPEC_NO_PIN", "2")
    with pytest.raises(UserError, match="SWIFTSPEC_NO_PIN='2' is not a switch"):
        switches.check_all()
    with pytest.raises(KeyError):
        switches.flag("SWIFTSPEC_TYPO")


def test_no_switch_read_outside_the_table():
    reads = re.compile(r"environ(?:\.get)?\(?\[?\s*[\"']SWIFTSPEC_|getenv\(\s*[\"']SWIFTSPEC_")
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name != "switches.py" and reads.search(p.read_text())]
    assert offenders == []


def test_readme_lists_every_switch():
    readme = (PACKAGE.parent / "README.md").read_text()
    missing = [name for name in switches.SWITCHES if f"`{name}`" not in readme]
    assert missing == []

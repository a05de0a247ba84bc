"""Run under mpiexec by tests/test_abandon.py: `swiftspec run ARGS` with the draft abandoning the
expansion in flight whenever a verify result arrives during it (engine/abandon.should_abandon
always True), so the abandoned path, re-roots on holes included, runs on every such result.

    mpiexec -n N python tests/mpi_scripts/forced_abandon.py --mode async ... (swiftspec run's flags)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from swiftspec_mpi.engine import abandon  # noqa: E402

abandon.should_abandon = lambda draft, leaves, accepted, done: True

from swiftspec_mpi.cli.main import main  # noqa: E402

sys.argv = [sys.argv[0], "run", *sys.argv[1:]]
sys.exit(main())

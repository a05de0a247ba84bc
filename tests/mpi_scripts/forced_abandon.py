"""Run under mpiexec by tests/test_abandon.py: `swiftspec run ARGS` with the draft abandoning the
expansion in flight whenever a verify result arrives during it (engine/abandon.should_abandon
always True), so the abandoned path, re-roots on holes included, runs on every such result. Each
between-layer check first sleeps LAYER_SLEEP_S, so that an expansion lasts longer than a verify
step and results do arrive during expansions (without it, on a fast box the draft can finish each
expansion before the result comes, and nothing is abandoned).

    mpiexec -n N python tests/mpi_scripts/forced_abandon.py --mode async ... (swiftspec run's flags)
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from swiftspec_mpi.engine import abandon  # noqa: E402

LAYER_SLEEP_S = 0.004
abandon.should_abandon = lambda draft, leaves, accepted, done: True
_check = abandon.LayerCheck.__call__


def _slow_check(self, done: int, total: int) -> bool:
    time.sleep(LAYER_SLEEP_S)
    return _check(self, done, total)


abandon.LayerCheck.__call__ = _slow_check

from swiftspec_mpi.cli.main import main  # noqa: E402

sys.argv = [sys.argv[0], "run", *sys.argv[1:]]
sys.exit(main())

"""Make ``terra`` and the shared test helpers importable when Terra is not pip-installed."""

import os
import sys
from pathlib import Path

# The suite checks numbers, not speed: tiny models are fast eagerly, and the cost budget
# (terra.budget) would end co-execution in tests that need it. Budget tests set it themselves.
os.environ.setdefault("TERRA_BUDGET", "inf")
# Tests that inject a fault into, or change the path of, a given step need that step to be
# co-executed: with the graph instantiated in the background, co-execution starts one
# iteration later (terra.background). The background mode (the default) has its own tests.
os.environ.setdefault("TERRA_BACKGROUND", "0")
# The TraceGraph's invariants are checked after every merge and every generation pass.
os.environ.setdefault("TERRA_CHECK", "1")

_TESTS = Path(__file__).resolve().parent
for _path in (str(_TESTS.parent), str(_TESTS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

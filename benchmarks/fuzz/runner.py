"""Run one program eagerly and under Terra, each in its own process, and judge the pair.

Separate processes because a Terra bug may abort the interpreter (a TensorFlow CHECK failure)
or hang it, and because tf_keras programs need ``TF_USE_LEGACY_KERAS`` before TensorFlow is
imported. The eager run goes first: if eager itself fails the program is invalid (a generator
bug), and Terra is not run at all.
"""

import dataclasses
import tempfile
from pathlib import Path

from . import standalone
from .program import Program, render

DEFAULT_TIMEOUT = 120.0  # seconds per process; a run takes a few seconds, most of it imports


@dataclasses.dataclass
class Result:
    program: Program
    verdict: dict

    @property
    def kind(self) -> str:
        return self.verdict["kind"]

    @property
    def failed(self) -> bool:
        return self.kind in ("mismatch", "crash", "hang")

    def signature(self) -> tuple:
        """What "fails the same way" means for the minimizer: the kind, and for a crash the
        exception type."""
        detail = self.verdict["detail"]
        return (self.kind, detail.split(":")[0] if self.kind == "crash" else "")


def run(program: Program, timeout: float = DEFAULT_TIMEOUT) -> Result:
    with tempfile.TemporaryDirectory(prefix="terra-fuzz-") as scratch:
        path = Path(scratch) / f"fuzz_{program.seed}.py"
        path.write_text(render(program))
        legacy = program.base.legacy
        eager = standalone.run_child(path, "eager", legacy, timeout)
        if eager["status"] != "ok" or eager["error"]:
            return Result(program, standalone.judge(eager, eager))
        terra = standalone.run_child(path, "terra", legacy, timeout)
        verdict = standalone.judge(eager, terra)
    # explain() names the scratch file; the failure is written as <seed>.py
    verdict["reason"] = verdict["reason"].replace(f"{scratch}/fuzz_", "")
    return Result(program, verdict)

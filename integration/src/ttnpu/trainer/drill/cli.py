"""``ttnpu-drill <scenario>|all [--out DIR] [--quick]``: run fault drills on real ``ttnpu-train``
processes and write their report (``report.md``, ``report.json``, PNG plots) into one folder.

Exit status: 0 when every check of every scenario held, 1 when one failed, 2 for a bad command
line; a scenario that cannot finish (a process died, a deadline passed) is reported as failed
and the others still run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ttnpu.trainer.cli import OneLineParser, UsageError
from ttnpu.trainer.validation import writable_folder

if TYPE_CHECKING:
    from .result import ScenarioResult
    from .scenarios import Drill

__all__ = ["SCENARIO_NAMES", "main"]

SCENARIO_NAMES = (
    "ft-accuracy",
    "ft-throughput",
    "replica-exit",
    "replica-rejoin",
    "kill-storm",
    "replica-restart",
    "lighthouse-loss",
    "sdc",
    "loss-spike",
)
"""The keys of :data:`.scenarios.SCENARIOS`, in their order: the command line is parsed (and
``--help`` answered) before the scenarios and torch are imported."""


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="ttnpu-drill",
        description="Run fault drills on real ttnpu-train processes; write report.md, "
        "report.json and PNG plots into --out. Exit 0: every check held, 1: one failed.",
    )
    parser.add_argument("scenario", choices=[*SCENARIO_NAMES, "all"], help="what to run")
    parser.add_argument(
        "--out", type=Path, help="report folder (default: runs/drills/<timestamp>)", default=None
    )
    parser.add_argument("--quick", action="store_true", help="shortened runs (for tests)")
    parser.add_argument(
        "--seed", type=int, default=3, help="the kill storm's random choices (3: replicas 0, 1, 0)"
    )
    return parser


def run_scenarios(names: Sequence[str], drill: Drill) -> list[ScenarioResult]:
    """Run ``names`` in order; a scenario that raises becomes a failed result with the error."""
    from .result import ScenarioResult
    from .scenarios import SCENARIOS

    results = []
    for name in names:
        began = time.monotonic()
        print(f"ttnpu-drill: {name} ...", flush=True)
        try:
            result = SCENARIOS[name](drill)
        except Exception as error:  # a drill that breaks is a failed drill, not a lost report
            result = ScenarioResult(
                name=name,
                summary=f"The scenario did not finish: {type(error).__name__}: {error}",
                figures={},
                checks={"the scenario finished": False},
                notes=[traceback.format_exc(limit=3)],
            )
        result.seconds = time.monotonic() - began
        verdict = "pass" if result.passed else "FAIL"
        print(f"ttnpu-drill: {name}: {verdict} ({result.seconds:.0f}s)", flush=True)
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except UsageError as err:
        print(f"ttnpu-drill: error: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("RUST_LOG", "warn")  # the drill's own Lighthouses: no per-quorum lines
    out = args.out or Path("runs", "drills") / time.strftime("%Y%m%d-%H%M%S")
    if not writable_folder(out):
        print(f"ttnpu-drill: error: --out {out}: expected a folder this user can create and "
              "write", file=sys.stderr)  # fmt: skip
        return 2
    from .report import write_report
    from .scenarios import Drill, Sizes

    names = list(SCENARIO_NAMES) if args.scenario == "all" else [args.scenario]
    drill = Drill(out=out, sizes=Sizes.quick() if args.quick else Sizes(), seed=args.seed)
    results = run_scenarios(names, drill)
    command = shlex.join(["ttnpu-drill", *(sys.argv[1:] if argv is None else argv)])
    report = write_report(results, out, command)
    print(f"ttnpu-drill: report in {report}", flush=True)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""``steps.jsonl`` in the run folder: one JSON object per committed step and per event.

TensorBoard holds the curves; this file is what tests, drills and people grep: every committed
step (loss, learning rate, routing phase, attempts, replicas) and every event (start, veto, heal,
rollback, persistent SDC), flushed as it happens so a killed process keeps its record.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["StepLog", "read_step_log"]


class StepLog:
    """Appends records to ``path``; ``enabled=False`` (ranks other than 0) writes nothing."""

    def __init__(self, path: Path, *, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, **record: Any) -> None:
        if not self.enabled:
            return
        line = json.dumps({"time": round(time.time(), 3), **record}, sort_keys=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def read_step_log(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a ``steps.jsonl`` (a line cut short by a kill is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records

"""``steps.jsonl`` in the run folder: one JSON object per committed step and per event.

TensorBoard holds the curves; this file is what tests, drills and people grep: every committed
step (loss, learning rate, routing phase, attempts, replicas) and every event (start, veto, heal,
rollback, persistent SDC), flushed as it happens so a killed process keeps its record. When a
resume or a rollback goes back to an earlier step, the records of the steps after it are marked
``"superseded": true``: the unmarked records hold each committed step once.
"""

from __future__ import annotations

import json
import os
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

    def supersede_after(self, step: int) -> int:
        """Mark every committed-step record after ``step`` superseded (the run went back to
        ``step`` and trains those steps again); the file is rewritten atomically. Returns how many
        records were marked."""
        if not self.enabled or not self.path.is_file():
            return 0
        lines = self.path.read_text(encoding="utf-8").splitlines()
        marked = 0
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a kill stays as it is
                continue
            if "event" in record or record.get("superseded") or record.get("step", 0) <= step:
                continue
            lines[i] = json.dumps({**record, "superseded": True}, sort_keys=True)
            marked += 1
        if marked:
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            os.replace(partial, self.path)
        return marked


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

import json
import logging
from pathlib import Path

import pytest

from ttnpu.sdc import (
    EventLog,
    LogAction,
    RaiseAction,
    Reporter,
    SDCError,
    VetoFlag,
    default_reporter,
)


def test_reporter_stamps_and_runs_actions_in_order(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "sdc" / "events.jsonl")
    flag = VetoFlag()
    seen: list[str] = []
    reporter = Reporter([log, flag, lambda e: seen.append(e.where)], rank=3)
    reporter.step = 41
    reporter.report("matmul", "mm:forward#1", magnitude=7.5, confirmed=True, detail={"op": "mm"})
    reporter.step = 42
    reporter.report("gradient", "w", magnitude=2.0, confirmed=False)
    rows = log.read()
    assert [(r["kind"], r["rank"], r["step"]) for r in rows] == [
        ("matmul", 3, 41),
        ("gradient", 3, 42),
    ]
    assert rows[0]["detail"] == {"op": "mm"} and rows[0]["confirmed"] is True
    assert (
        json.loads((tmp_path / "sdc" / "events.jsonl").read_text().splitlines()[1])["where"] == "w"
    )
    assert seen == ["mm:forward#1", "w"]
    assert flag.vetoed and len(flag.take()) == 2 and not flag.vetoed


def test_default_actions_log_then_raise(caplog: pytest.LogCaptureFixture) -> None:
    assert isinstance(default_reporter().actions[0], LogAction)
    with caplog.at_level(logging.INFO, logger="ttnpu.sdc"), pytest.raises(SDCError) as info:
        Reporter().report("collective", "all_reduce#2", magnitude=3.0, confirmed=True)
    assert info.value.event.where == "all_reduce#2"
    assert "all_reduce#2" in caplog.text


def test_raise_only_confirmed() -> None:
    reporter = Reporter([RaiseAction(confirmed_only=True)])
    reporter.report("gradient", "w", magnitude=5.0, confirmed=False)
    with pytest.raises(SDCError, match="gradient_strikes"):
        reporter.report("gradient_strikes", "g", magnitude=1.0, confirmed=True)

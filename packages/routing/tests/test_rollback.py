"""plan_rollback: newest complete checkpoint strictly before the onset, or a clear error."""

from __future__ import annotations

import pytest

from ttnpu.routing import REQUIRED_PARTS, CheckpointInfo, NoRollbackTargetError, plan_rollback

FULL = REQUIRED_PARTS


def ckpt(step: int, parts: frozenset[str] = FULL) -> CheckpointInfo:
    return CheckpointInfo(step, parts, location=f"step-{step}")


def test_newest_complete_before_onset() -> None:
    plan = plan_rollback([ckpt(100), ckpt(300), ckpt(200)], onset=250)
    assert plan.target.step == 200
    assert [c.step for c, _ in plan.skipped] == [300]


def test_checkpoint_at_the_onset_is_not_used() -> None:
    assert plan_rollback([ckpt(100), ckpt(200)], onset=200).target.step == 100


def test_incomplete_checkpoints_are_skipped_with_the_missing_parts() -> None:
    no_rng = ckpt(200, FULL - {"rng"})
    model_only = ckpt(150, frozenset({"model"}))
    plan = plan_rollback([ckpt(100), model_only, no_rng], onset=250)
    assert plan.target.step == 100
    reasons = dict((c.step, why) for c, why in plan.skipped)
    assert reasons[200] == "incomplete, missing ['rng']"
    assert "optimizer" in reasons[150] and "dataloader" in reasons[150]


def test_required_parts_can_be_narrowed() -> None:
    plan = plan_rollback([ckpt(200, FULL - {"rng"})], onset=250, required=FULL - {"rng"})
    assert plan.target.step == 200


def test_no_usable_checkpoint_is_a_clear_error() -> None:
    with pytest.raises(NoRollbackTargetError) as error:
        plan_rollback([ckpt(300), ckpt(200, frozenset({"model"}))], onset=250)
    message = str(error.value)
    assert "strictly before step 250" in message
    assert "step 300 (step-300): step 300 is not before the onset 250" in message
    assert "step 200 (step-200): incomplete" in message
    with pytest.raises(NoRollbackTargetError, match="there are no checkpoints"):
        plan_rollback([], onset=10)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="onset must be >= 1"):
        plan_rollback([ckpt(0)], onset=0)
    with pytest.raises(ValueError, match=r"CheckpointInfo.step must be >= 0"):
        ckpt(-1)

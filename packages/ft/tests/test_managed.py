from __future__ import annotations

from typing import Any

import torch

from ttnpu.ft.managed import ManagedAllreduce


class FakeManager:
    def __init__(self, participating: bool = True) -> None:
        self.participating = participating
        self.errors: list[Exception] = []
        self.quorum_waits = 0

    def errored(self) -> Exception | None:
        return self.errors[0] if self.errors else None

    def report_error(self, error: Exception) -> None:
        self.errors.append(error)

    def wait_quorum(self) -> None:
        self.quorum_waits += 1

    def is_participating(self) -> bool:
        return self.participating


class Work:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def wait(self) -> bool:
        if self.error is not None:
            raise self.error
        return True


class FakeGroup:
    """Records what was sent; ``start_error`` / ``wait_error`` fail the next call."""

    def __init__(self) -> None:
        self.sent: list[list[float]] = []
        self.start_error: Exception | None = None
        self.wait_error: Exception | None = None

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> Work:
        assert options.reduceOp == torch.distributed.ReduceOp.SUM
        if self.start_error is not None:
            raise self.start_error
        self.sent.append(tensors[0].tolist())
        return Work(self.wait_error)


def managed(participating: bool = True) -> tuple[ManagedAllreduce, FakeManager, FakeGroup]:
    manager, group = FakeManager(participating), FakeGroup()
    return ManagedAllreduce(manager, group), manager, group  # type: ignore[arg-type]


def test_sends_after_the_quorum_and_waits() -> None:
    collectives, manager, group = managed()
    assert collectives.wait(collectives.start(torch.tensor([1.0, 2.0])))
    assert group.sent == [[1.0, 2.0]] and manager.quorum_waits == 1 and not manager.errors


def test_a_healing_replica_sends_zeros_but_the_kept_head() -> None:
    collectives, _, group = managed(participating=False)
    collectives.start(torch.tensor([1.0, 2.0, 3.0]))
    collectives.start(torch.tensor([1.0, 2.0, 3.0]), healing_keeps=2)
    assert group.sent == [[0.0, 0.0, 0.0], [1.0, 2.0, 0.0]]


def test_failures_are_reported_not_raised_and_the_first_one_is_kept() -> None:
    collectives, manager, group = managed()
    group.wait_error = RuntimeError("Connection reset by peer")
    work = collectives.start(torch.ones(2))
    assert not collectives.wait(work)
    assert [str(e) for e in manager.errors] == ["Connection reset by peer"]
    assert collectives.start(torch.ones(2)) is None, "nothing is sent once the Manager errored"
    assert not collectives.wait(work) and len(manager.errors) == 1 and len(group.sent) == 1


def test_a_collective_that_fails_to_start_is_reported() -> None:
    collectives, manager, group = managed()
    group.start_error = RuntimeError("process group aborted")
    assert collectives.start(torch.ones(2)) is None
    assert [str(e) for e in manager.errors] == ["process group aborted"] and group.sent == []

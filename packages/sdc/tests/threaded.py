"""Two gloo ranks as two threads of this process: real collectives without a second process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def run_ranks(world: int, fn: Callable[[dist.ProcessGroup, int], T]) -> list[T]:
    """Run ``fn(group, rank)`` on ``world`` threads sharing one store; re-raise the first error."""
    store = dist.HashStore()
    results: list[T | None] = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
            results[rank] = fn(group, rank)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]

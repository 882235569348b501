"""Bucketed gradient averaging during the backward: two replica groups as threads on gloo."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from ttnpu.ft import EmbeddedLighthouse, Replica, ReplicaConfig

WIDTH, DEPTH = 32, 4  # a weight of 32x32 fp32 is 4 KiB: with a 4 KiB cap it travels alone


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 1))


def batch(replica_id: int, micro: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * replica_id + micro))


def make_replica(replica_id: int, address: str, check: Judged | None = None) -> Replica:
    model = mlp()
    config = ReplicaConfig(
        replica_id=replica_id,
        lighthouse=address,
        device="cpu",
        collective_timeout=timedelta(seconds=20),  # a loaded 2-core CI host
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=30),
        bucket_cap_mb=4 / 1024,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Replica(config, model, optimizer, reduction_check=check)


def in_parallel(fns: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(fns)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn) for fn in fns]]


class Recorder:
    """Wraps a replica's process group all-reduce (the Manager's and the vote's): what was
    reduced, and whether the first layer's weight (the last gradient of the backward) was still
    missing at that moment."""

    def __init__(self, replica: Replica) -> None:
        self.calls: list[tuple[int, bool]] = []
        pg, first = replica.pg, replica.model[0].weight
        allreduce = pg.allreduce

        def recording(tensors: list[torch.Tensor], *args: Any) -> Any:
            self.calls.append((tensors[0].numel(), first.grad is None))
            return allreduce(tensors, *args)

        pg.allreduce = recording  # type: ignore[method-assign]


def local_grads(start: nn.Module, replica_id: int, micros: int) -> list[torch.Tensor]:
    model = copy.deepcopy(start)
    for m in range(micros):
        model(batch(replica_id, m)).sum().backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


@pytest.fixture
def pair() -> Iterator[list[Replica]]:
    with EmbeddedLighthouse(min_replicas=2, join_timeout_ms=10_000) as lh:
        replicas = in_parallel([lambda i=i: make_replica(i, lh.address) for i in range(2)])
        yield replicas
        for r in replicas:
            r.close()


def test_buckets_start_during_the_backward_and_accumulation_reduces_once(
    pair: list[Replica],
) -> None:
    recorders = [Recorder(r) for r in pair]
    seen: list[list[torch.Tensor]] = [[], []]

    def train(r: Replica, micros: int) -> bool:
        i = r.config.replica_id

        def fn() -> None:
            for m in range(micros):
                with r.no_sync() if m < micros - 1 else nullcontext():
                    r.model(batch(i, m)).sum().backward()
            seen[i][:] = [p.grad.clone() for p in r.model.parameters()]

        return r.run_step(fn).committed

    assert in_parallel([lambda r=r: train(r, 1) for r in pair]) == [True, True]  # init sync
    for recorder in recorders:
        recorder.calls.clear()
    assert in_parallel([lambda r=r: train(r, 1) for r in pair]) == [True, True]
    for recorder in recorders:
        assert recorder.calls[0][1], "the first bucket started before the backward ended"
        recorder.calls.clear()
    start = copy.deepcopy(pair[0].model)
    assert in_parallel([lambda r=r: train(r, 3) for r in pair]) == [True, True]
    expected = [
        (a + b) / 2 for a, b in zip(local_grads(start, 0, 3), local_grads(start, 1, 3), strict=True)
    ]
    for grads in seen:  # averaged when the backward returned, inside fn
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    params = len(expected)
    for recorder in recorders:
        sizes = [n for n, _ in recorder.calls]
        weights = sizes.count(WIDTH * WIDTH)
        assert weights == DEPTH, "each weight reduced once, in place, after 3 backwards"
        # then the flags, led by the vote (veto, stop, a second vote wanted): no vote of its own
        assert sizes[-1] == 3 + params + 1 and sizes.count(sizes[-1]) == 1


def test_a_second_backward_outside_no_sync_is_refused(pair: list[Replica]) -> None:
    def twice(r: Replica) -> None:
        for m in range(2):
            r.model(batch(r.config.replica_id, m)).sum().backward()

    errors = in_parallel(
        [lambda r=r: _error_of(lambda: r.run_step(lambda: twice(r))) for r in pair]
    )
    assert all("replica.no_sync()" in e for e in errors)


def _error_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except RuntimeError as error:
        return str(error)
    return ""


def test_a_one_member_world_reduces_and_copies_nothing() -> None:
    with EmbeddedLighthouse(min_replicas=1) as lh:
        replica = make_replica(0, lh.address)
        try:
            recorder = Recorder(replica)
            produced: dict[str, int] = {}
            for name, p in replica.model.named_parameters():
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name: produced.__setitem__(name, p.grad.data_ptr())
                )
            for step in range(2):
                assert replica.run_step(lambda s=step: step_of(replica, s)).committed
                after = {n: p.grad.data_ptr() for n, p in replica.model.named_parameters()}
                assert after == produced, "every gradient is the tensor autograd produced"
            assert recorder.calls == [], "alone, not even the vote goes out"
        finally:
            replica.close()


class PeerDied(BaseException):
    """Ends the peer's thread the way SIGKILL ends a process: nothing catches it."""


def test_a_peer_killed_mid_bucketed_all_reduce_is_discarded_ten_times() -> None:
    """The peer dies after its first bucket started: the survivor's step fails in a later
    bucket, is discarded without any check judging it, and leaves weights and optimizer as if
    the step never happened; a new peer heals and the next kill comes."""
    with EmbeddedLighthouse(min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=500) as lh:
        survivor = make_replica(0, lh.address, Judged())
        try:
            for kill in range(10):
                result, error, before, after, judged = kill_a_peer(survivor, lh.address)
                assert not result.committed, f"kill {kill}: the step in flight was committed"
                assert error is not None and "Connection" in str(error.original_exception)
                assert judged == 0, f"kill {kill}: a failed all-reduce was judged"
                assert_same(before, after)
                assert all(p.grad is None for p in survivor.model.parameters())
        finally:
            survivor.close()


def test_the_quorum_overlaps_the_forward_once_committed_and_a_heal_costs_every_replica_a_step() -> (
    None
):
    """A replica that committed its last step computes the next quorum while its forward runs
    (torchft's asynchronous quorum); one that may have to heal (its first step, or after a step
    it did not commit) waits for it and heals before its forward. The step whose quorum held the
    joiner is discarded by both (the one at the highest step trained it without knowing); the
    next ones are joint."""
    with EmbeddedLighthouse(min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=500) as lh:
        first = make_replica(0, lh.address)
        modes: dict[int, list[bool]] = {0: [], 1: []}

        def step(r: Replica, micro: int) -> Any:
            def fn() -> None:
                modes[r.config.replica_id].append(r.manager._use_async_quorum)
                step_of(r, micro)

            return r.run_step(fn)

        try:
            solo = [step(first, i) for i in range(3)]
            assert all(s.committed for s in solo) and modes[0] == [False, True, True]
            peer = make_replica(1, lh.address)
            try:
                start = threading.Barrier(2)

                def until_two_joint(r: Replica) -> list[Any]:
                    start.wait()
                    done: list[Any] = []
                    while sum(s.committed and s.participants == 2 for s in done) < 2:
                        assert len(done) < 20, "the replicas never trained together"
                        done.append(step(r, 3))
                    return done

                results = in_parallel(
                    [lambda: until_two_joint(first), lambda: until_two_joint(peer)]
                )
                for r, (steps, previous) in zip(
                    (first, peer), [(results[0], solo), (results[1], [])], strict=True
                ):
                    i = next(n for n, s in enumerate(steps) if not s.committed)
                    assert [(s.committed, s.healing, s.vetoed) for s in steps[i:]] == [
                        (False, True, False), (True, False, False), (True, False, False)
                    ]  # fmt: skip
                    assert all(s.participants == 1 for s in steps[:i])  # alone until then
                    # asynchronous exactly after a committed step
                    history = [*previous, *steps]
                    mine = modes[r.config.replica_id]
                    assert mine == [False] + [s.committed for s in history[:-1]]
                assert (first.heals, peer.heals) == (0, 1)
                assert_same(snapshot(first), snapshot(peer))
            finally:
                peer.close()
        finally:
            first.close()


def commit_healing(replica: Replica, fn: Callable[[], Any]) -> None:
    """Run ``fn`` as a step until it commits: a step whose quorum held a replica behind the
    others (a heal) is discarded by every replica, once."""
    first = replica.run_step(fn)
    if not first.committed:
        assert first.healing, "only a heal may discard this step"
        assert replica.run_step(fn).committed


def kill_a_peer(survivor: Replica, address: str) -> tuple[Any, ...]:
    """A new peer heals from the survivor and dies in the middle of the next step."""
    check = survivor.reduction_check
    assert isinstance(check, Judged)
    peer = make_replica(1, address, Judged())
    start = threading.Barrier(2)

    def peer_steps() -> None:
        start.wait()
        commit_healing(peer, lambda: step_of(peer, 0))
        die_after_first_bucket(peer)
        peer.run_step(lambda: step_of(peer, 1))

    def survivor_steps() -> tuple[Any, ...]:
        start.wait()
        commit_healing(survivor, lambda: step_of(survivor, 0))
        before, judged = snapshot(survivor), check.judged
        result = survivor.run_step(lambda: step_of(survivor, 1))
        error = survivor.manager.errored()
        return result, error, before, snapshot(survivor), check.judged - judged

    with ThreadPoolExecutor(2) as pool:
        dying, outcome = pool.submit(peer_steps), pool.submit(survivor_steps)
        with pytest.raises(PeerDied):
            dying.result(timeout=60)
        peer.close()
        return outcome.result(timeout=60)


class Judged:
    """A sum check (like ttnpu-sdc's checksums, coarser) counting the buckets it judged."""

    def __init__(self) -> None:
        self.judged = 0

    def before(self, local: torch.Tensor) -> torch.Tensor:
        return local.sum().reshape(1)

    def after(self, result: torch.Tensor, checksums: torch.Tensor, world: int) -> bool:
        self.judged += 1
        return bool(torch.isclose(result.sum(), checksums[0], rtol=1e-4, atol=1e-4))


def step_of(r: Replica, micro: int) -> None:
    r.model(batch(r.config.replica_id, micro)).sum().backward()


def die_after_first_bucket(peer: Replica) -> None:
    allreduce = peer.pg.allreduce

    def dying(tensors: list[torch.Tensor], *args: Any) -> Any:
        allreduce(tensors, *args).wait()  # its bucket went out; the next ones never will
        peer.pg.shutdown()  # its gloo context goes, and its connections close
        raise PeerDied

    peer.pg.allreduce = dying  # type: ignore[method-assign]


def snapshot(r: Replica) -> list[torch.Tensor]:
    state = [p.detach().clone() for p in r.model.parameters()]
    for values in r.optimizer.state.values():
        state += [v.clone() for v in values.values() if isinstance(v, torch.Tensor)]
    return state


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

"""Split-brain detection: the fingerprint, the decision, and replicas that meet after training apart
(real Lighthouses; replica groups as threads, each with its own store, as in test_replica)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from ttnpu.ft import (
    EmbeddedLighthouse,
    Replica,
    ReplicaConfig,
    SplitBrainCheck,
    SplitBrainError,
    StepResult,
    weights_fingerprint,
)
from ttnpu.ft.fingerprint import minority


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int8])
def test_the_fingerprint_is_exact_and_sees_one_flipped_bit_and_two_swapped_values(
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, 3, generator=gen) * 50).to(dtype) for n in (5, 7000)]
    fingerprint = weights_fingerprint(weights)
    assert fingerprint.dtype == torch.int64 and fingerprint.shape == (4,)
    assert torch.equal(fingerprint, weights_fingerprint([w.clone() for w in weights]))
    assert not torch.equal(fingerprint, weights_fingerprint(weights[::-1]))  # order matters

    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        weights[1].element_size()
    ]
    for bit in (0, 8 * weights[1].element_size() - 1):  # lowest mantissa bit, sign bit
        flipped = weights[1].clone()
        flipped.view(bits).view(-1)[1234] ^= 1 << bit
        assert not torch.equal(fingerprint, weights_fingerprint([weights[0], flipped]))

    for i, j in ((10, 5000), (10, 20), (1, 2)):  # rows apart, one row, one int32 word (bf16)
        swapped = weights[1].clone().view(-1)
        swapped[[i, j]] = swapped[[j, i]]
        assert not torch.equal(swapped, weights[1].view(-1))
        assert not torch.equal(fingerprint, weights_fingerprint([weights[0], swapped]))


def test_the_largest_class_goes_on_and_a_tie_goes_to_the_lowest_replica_id() -> None:
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    assert minority({0: a, 1: b, 2: b}) == ([1, 2], [0])
    assert minority({3: a, 1: b}) == ([1], [3])
    assert minority({0: a, 1: a}) == ([0, 1], [])


class FakeManager:
    """What SplitBrainCheck needs of torchft's Manager; the all-reduce writes the rows given."""

    def __init__(self, rows: dict[int, tuple[int, ...]], errored: bool = False) -> None:
        self.rows, self._errored = rows, errored
        self._quorum_id = 7

    def current_step(self) -> int:
        return 5

    def num_participants(self) -> int:
        return 3

    def participating_rank(self) -> int:
        return 1

    def errored(self) -> object:
        return "peer lost" if self._errored else None

    def allreduce(self, table: torch.Tensor, reduce_op: object) -> Any:
        for rank, (replica_id, fp) in enumerate(self.rows.items()):
            table[rank] = torch.tensor([replica_id + 1, *fp])
        return self

    def wait(self) -> None:
        pass


def test_a_mismatch_seen_by_one_rank_of_a_group_stops_every_rank_of_that_group(
    store: TCPStore,
) -> None:
    """Group 1 has two ranks: rank 0's shard agrees with groups 0 and 2, rank 1's does not."""
    shards = [{i: (1, 1, 1, 1) for i in range(3)}, {0: (2,) * 4, 1: (9,) * 4, 2: (2,) * 4}]
    outcomes: list[BaseException | None] = [None, None]

    def rank(r: int) -> None:
        client = TCPStore("localhost", store.port, is_master=False, wait_for_workers=False)
        check = SplitBrainCheck(
            FakeManager(shards[r]),  # type: ignore[arg-type]
            [torch.zeros(3)],
            1,
            torch.device("cpu"),
            group_rank=r,
            group_world_size=2,
            store=client,
        )
        try:
            check.run(healed=False, guard=lambda label, fn: fn())
        except SplitBrainError as error:
            outcomes[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(o, SplitBrainError) for o in outcomes)
    assert str(outcomes[0]) == str(outcomes[1])
    assert "split brain at step 5" in str(outcomes[0]) and "shard of group rank 1" in str(
        outcomes[0]
    )
    assert "replica group(s) [1] differ from those of [0, 2]" in str(outcomes[0])

    # an exchange that failed (a peer lost) is not judged; a quorum already compared is not due
    check = SplitBrainCheck(
        FakeManager(shards[1], errored=True),  # type: ignore[arg-type]
        [torch.zeros(3)],
        1,
        torch.device("cpu"),
    )
    check.run(healed=False, guard=lambda label, fn: fn())
    check.run(healed=False, guard=lambda label, fn: fn())
    assert check.checks == 1
    with pytest.raises(ValueError, match="needs the group's store"):
        SplitBrainCheck(check._manager, [], 0, torch.device("cpu"), group_world_size=2)


def in_parallel(fns: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(fns)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn) for fn in fns]]


def make_replica(replica_id: int, address: str, **kw: Any) -> Replica:
    """A small MLP on CPU (the same initial weights everywhere); 5 s bound a lost peer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    timeout = timedelta(seconds=5)
    config = ReplicaConfig(replica_id, address, device="cpu", collective_timeout=timeout, **kw)
    return Replica(config, model, torch.optim.SGD(model.parameters(), lr=0.1))


def train(replica: Replica, steps: int, seed: int) -> list[StepResult | SplitBrainError]:
    """Run steps on the replica's own data; a split-brain error ends it (and closes the replica,
    as a trainer exiting would)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[StepResult | SplitBrainError] = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        try:
            out.append(replica.run_step(lambda x=x: replica.model(x).pow(2).mean().backward()))
        except SplitBrainError as error:
            replica.close()
            return [*out, error]
    return out


def test_groups_partitioned_behind_their_own_lighthouses_are_caught_when_they_meet() -> None:
    """min_replica_size 1: each group trains alone for 3 steps behind its own Lighthouse (they
    cannot see each other), then both join one Lighthouse at step 3. Two groups tie: the one
    with the higher replica id stops, the other goes on alone."""
    apart = [EmbeddedLighthouse(min_replicas=1) for _ in range(2)]
    try:
        replicas = in_parallel([lambda i=i: make_replica(i, apart[i].address) for i in range(2)])
        try:
            runs = in_parallel([lambda i=i: train(replicas[i], 3, seed=i) for i in range(2)])
        finally:
            for r in replicas:
                r.close()
    finally:
        for lh in apart:
            lh.close()
    for run in runs:
        assert [(s.committed, s.participants) for s in run] == [(True, 1)] * 3  # type: ignore[union-attr]

    with EmbeddedLighthouse(
        min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=1000
    ) as together:
        met = in_parallel([lambda i=i: make_replica(i, together.address) for i in range(2)])
        try:
            for old, new in zip(replicas, met, strict=True):
                new.model.load_state_dict(old.model.state_dict())
                new.optimizer.load_state_dict(old.optimizer.state_dict())
                new.set_step(3)
            runs = in_parallel([lambda i=i: train(met[i], 3, seed=10 + i) for i in range(2)])
        finally:
            for r in met:
                r.close()
    error = runs[1][0]
    assert isinstance(error, SplitBrainError) and len(runs[1]) == 1
    assert str(error).startswith(
        "split brain at step 3: the weights of replica group(s) [1] differ from those of [0]"
    )
    assert "replica group 1 is in the minority (or lost the tie" in str(error)
    survivor = runs[0]
    assert not any(isinstance(s, SplitBrainError) for s in survivor)
    assert not survivor[0].committed  # type: ignore[union-attr]  # its peer left mid-step
    assert [(s.committed, s.participants) for s in survivor[1:]] == [(True, 1)] * 2  # type: ignore[union-attr]


def test_replicas_training_together_never_alarm_and_a_corrupted_one_is_outvoted() -> None:
    """Three replicas compare weights at every step (fingerprint_every=1): no false alarm while
    they train together; a bit flipped in replica 0's weights (which would win a tie) stops
    replica 0 only, because the two others agree."""
    with EmbeddedLighthouse(
        min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=1000
    ) as lh:
        replicas = in_parallel(
            [lambda i=i: make_replica(i, lh.address, fingerprint_every=1) for i in range(3)]
        )
        try:
            runs = in_parallel([lambda i=i: train(replicas[i], 4, seed=i) for i in range(3)])
            for r, run in zip(replicas, runs, strict=True):
                assert [(s.committed, s.participants) for s in run] == [(True, 3)] * 4  # type: ignore[union-attr]
                assert r.split_brain.checks == 4
            with torch.no_grad():
                replicas[0].model[0].weight.view(torch.int32)[0, 0] ^= 1
            runs = in_parallel([lambda i=i: train(replicas[i], 2, seed=i) for i in range(3)])
        finally:
            for r in replicas:
                r.close()
    assert isinstance(runs[0][0], SplitBrainError)
    assert "replica group(s) [0] differ from those of [1, 2]" in str(runs[0][0])
    for run in runs[1:]:  # the step replica 0 left is discarded; the next commits without it
        assert [(s.committed, s.participants) for s in run][1:] == [(True, 2)]  # type: ignore[union-attr]


def test_a_shard_corrupted_on_one_rank_stops_every_rank_of_its_group() -> None:
    """Two groups of two ranks (rank r of each holds shard r); a bit flipped in group 1's shard 1
    only: ranks 1 find group 1 in the minority (a tie, lost by the higher id), ranks 0 see equal
    shards, and both ranks of group 1 stop while group 0 goes on."""
    with EmbeddedLighthouse(
        min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=1000
    ) as lh:
        stores = [
            TCPStore("localhost", 0, is_master=True, wait_for_workers=False) for _ in range(2)
        ]

        def rank(group: int, r: int) -> Replica:
            replica = make_replica(
                group,
                lh.address,
                fingerprint_every=2,
                group_rank=r,
                group_world_size=2,
                store_addr="localhost",
                store_port=stores[group].port,
            )
            with torch.no_grad():  # shard r differs from shard 1 - r, equal across groups
                replica.model[0].weight.add_(r)
            return replica

        ranks = in_parallel([lambda g=g, r=r: rank(g, r) for g in range(2) for r in range(2)])
        try:
            runs = in_parallel([lambda x=x: train(x, 2, seed=0) for x in ranks])
            assert all(len(run) == 2 and not isinstance(run[-1], SplitBrainError) for run in runs)
            with torch.no_grad():
                ranks[3].model[0].weight.view(torch.int32)[0, 0] ^= 1 << 30
            runs = in_parallel([lambda x=x: train(x, 2, seed=0) for x in ranks])
        finally:
            for x in ranks:
                x.close()
    for run in runs[2:]:
        assert isinstance(run[0], SplitBrainError)
        assert str(run[0]).startswith(
            "split brain at step 2: the weights (shard of group rank 1) of replica group(s) [1]"
        )
    for run in runs[:2]:
        assert [(s.committed, s.participants) for s in run][1:] == [(True, 1)]  # type: ignore[union-attr]

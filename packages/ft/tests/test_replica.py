"""Replica on CPU/gloo with a real Lighthouse; replica groups as threads (each with its store)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from ttnpu.ft import (
    CpuAdapter,
    EmbeddedLighthouse,
    LighthouseProcess,
    LighthouseUnreachable,
    RecoveryLimitExceeded,
    ReductionCheck,
    Replica,
    ReplicaConfig,
    StepResult,
    select_adapter,
)


@pytest.fixture
def lighthouse() -> Iterator[EmbeddedLighthouse]:
    with EmbeddedLighthouse(
        min_replicas=2, join_timeout_ms=10_000, heartbeat_timeout_ms=1000
    ) as lh:
        yield lh


def make_replica(
    replica_id: int,
    address: str,
    make_model: Any,
    reduction_check: ReductionCheck | None = None,
    adapter: CpuAdapter | None = None,
    **kw: Any,
) -> Replica:
    model = make_model(0)
    timeouts = {  # a loaded 2-core CI host: gloo's store connection in the first quorum took >5 s
        "collective_timeout": timedelta(seconds=20),
        "timeout": timedelta(seconds=10),
        "quorum_timeout": timedelta(seconds=10),
    }
    config = ReplicaConfig(replica_id=replica_id, lighthouse=address, device="cpu", **timeouts | kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Replica(config, model, opt, reduction_check=reduction_check, adapter=adapter)


class SumCheck:
    """A stand-in for ttnpu-sdc's checksums: the buffer's sum travels on its own; replica 1's
    received buffer is corrupted at the call given."""

    def __init__(self, corrupt_call: int | None) -> None:
        self.corrupt_call, self.calls, self.worlds = corrupt_call, 0, []

    def before(self, local: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return local.sum().reshape(1)

    def after(self, result: torch.Tensor, checksums: torch.Tensor, world: int) -> bool:
        self.worlds.append(world)
        if self.calls == self.corrupt_call:
            result[0] += 1000.0
        return bool(torch.isclose(result.sum(), checksums[0], rtol=1e-4, atol=1e-3))


def test_a_corrupted_gradient_all_reduce_vetoes_the_step_on_every_replica(
    lighthouse: EmbeddedLighthouse, make_model: Any
) -> None:
    checks = [SumCheck(None), SumCheck(2)]
    replicas = in_parallel(
        [lambda i=i: make_replica(i, lighthouse.address, make_model, checks[i]) for i in range(2)]
    )
    try:

        def train(r: Replica) -> list[StepResult]:
            gen = torch.Generator().manual_seed(r.config.replica_id)
            return [
                r.run_step(lambda: r.model(torch.randn(4, 8, generator=gen)).sum().backward())
                for _ in range(3)
            ]

        out = in_parallel([lambda r=r: train(r) for r in replicas])
        for results in out:  # replica 1 saw its second all-reduce corrupted: nobody commits it
            assert [(s.committed, s.vetoed) for s in results] == [
                (True, False), (False, True), (True, False),
            ]  # fmt: skip
        assert checks[0].worlds == checks[1].worlds == [2, 2, 2]
        for a, b in zip(
            replicas[0].model.parameters(), replicas[1].model.parameters(), strict=True
        ):
            assert torch.equal(a, b)
    finally:
        for r in replicas:
            r.close()


class TimedSynchronize(CpuAdapter):
    """A CPU adapter that records which watchdog timers are armed at each stream
    synchronisation (on NCCL/HCCL the host waits for a collective's data there)."""

    def __init__(self) -> None:
        self.armed: list[str] = []
        self.seen: list[tuple[str, ...]] = []

    def watch(self, replica: Replica) -> None:
        watchdog = replica.recovery.watchdog
        arm, disarm = watchdog.arm, watchdog.disarm

        def arming(label: str, timeout_s: float | None = None) -> Any:
            self.armed.append(label)
            return arm(label, timeout_s)

        def disarming(token: Any) -> None:
            self.armed.remove(token.label)
            disarm(token)

        watchdog.arm, watchdog.disarm = arming, disarming  # type: ignore[method-assign]

    def synchronize_stream(self) -> None:
        self.seen.append(tuple(self.armed))


def test_the_gradient_all_reduce_is_waited_for_on_the_device_under_the_watchdog(
    lighthouse: EmbeddedLighthouse, make_model: Any
) -> None:
    adapters = [TimedSynchronize(), TimedSynchronize()]
    replicas = in_parallel(
        [
            lambda i=i: make_replica(i, lighthouse.address, make_model, adapter=adapters[i])
            for i in range(2)
        ]
    )
    try:
        for r, adapter in zip(replicas, adapters, strict=True):
            adapter.watch(r)

        def train(r: Replica) -> list[bool]:
            gen = torch.Generator().manual_seed(r.config.replica_id)

            def step() -> None:
                r.model(torch.randn(4, 8, generator=gen)).sum().backward()

            return [r.run_step(step).committed for _ in range(2)]

        assert in_parallel([lambda r=r: train(r) for r in replicas]) == [[True, True]] * 2
        for adapter in adapters:  # one per step, under the timer
            assert adapter.seen == [("allreduce_gradients",)] * 2
    finally:
        for r in replicas:
            r.close()


def in_parallel(fns: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(fns)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn) for fn in fns]]


def test_a_stop_requested_by_one_replica_is_agreed_by_every_replica_in_the_vote(
    lighthouse: EmbeddedLighthouse, make_model: Any
) -> None:
    """Replica 0 asks to stop before step 2: both learn it in step 2's vote and it stays asked;
    replica 1 vetoes step 3, and the vote carries both decisions."""
    replicas = in_parallel(
        [lambda i=i: make_replica(i, lighthouse.address, make_model) for i in range(2)]
    )
    try:

        def train(r: Replica) -> list[tuple[bool, bool, bool]]:
            gen = torch.Generator().manual_seed(r.config.replica_id)
            results = []
            for step in range(1, 4):
                if step == 2 and r.config.replica_id == 0:
                    r.veto.request_stop()
                if step == 3 and r.config.replica_id == 1:
                    r.veto.raise_flag("a detector fired")
                res = r.run_step(lambda: r.model(torch.randn(4, 8, generator=gen)).sum().backward())
                results.append((res.committed, res.vetoed, res.stop))
            return results

        for results in in_parallel([lambda r=r: train(r) for r in replicas]):
            assert results == [(True, False, False), (True, False, True), (False, True, True)]
    finally:
        for r in replicas:
            r.close()


def test_a_flag_raised_after_the_exchange_without_a_second_vote_discards_that_replica_alone(
    lighthouse: EmbeddedLighthouse, make_model: Any
) -> None:
    """No second vote is held (no late_flags, no output averaged, no reduction check): replica 1's
    flag after its backward reaches nobody else. Replica 0 commits, replica 1 discards, heals from
    replica 0 in the next quorum, and both then hold the same weights; with ``late_flags=True``
    the same flag vetoes the step on both."""
    replicas = in_parallel(
        [lambda i=i: make_replica(i, lighthouse.address, make_model) for i in range(2)]
    )
    try:
        heals: list[list[int]] = [[], []]

        def train(r: Replica) -> list[tuple[bool, bool]]:
            gen = torch.Generator().manual_seed(r.config.replica_id)
            results = []
            for step in range(1, 5):

                def fn(step: int = step) -> None:
                    r.model(torch.randn(4, 8, generator=gen)).sum().backward()
                    if step in (2, 4) and r.config.replica_id == 1:
                        r.veto.raise_flag("a check of the averaged gradients fired")

                res = r.run_step(fn, late_flags=step == 4)
                results.append((res.committed, res.vetoed))
                heals[r.config.replica_id].append(r.heals)
            return results

        first, second = in_parallel([lambda r=r: train(r) for r in replicas])
        assert first == [(True, False), (True, False), (False, False), (False, True)]
        # step 3 is discarded by both: replica 1 healed in its quorum (StepResult.healing)
        assert second == [(True, False), (False, True), (False, False), (False, True)]
        assert heals[0][-1] == heals[0][0] and heals[1][2] == heals[1][1] + 1, heals
        weights = [list(r.model.parameters()) for r in replicas]
        assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
    finally:
        for r in replicas:
            r.close()


def test_a_lighthouse_restarted_on_its_address_is_rejoined_and_one_kept_down_is_named(
    make_model: Any,
) -> None:
    """SIGKILL the Lighthouse, restart it 2 s later: the next steps commit on both replicas, none
    lost. SIGKILL it for good: each replica's next step raises ``LighthouseUnreachable`` after
    the quorum timeout (torchft retried meanwhile)."""

    def killed(lh: LighthouseProcess) -> None:
        os.kill(lh.pid or 0, signal.SIGKILL)
        while lh.poll() is None:
            time.sleep(0.02)

    def steps(r: Replica, n: int) -> list[tuple[bool, int, int]]:
        gen = torch.Generator().manual_seed(r.config.replica_id)
        results = [
            r.run_step(lambda: r.model(torch.randn(4, 8, generator=gen)).sum().backward())
            for _ in range(n)
        ]
        return [(res.committed, res.step, res.participants) for res in results]

    with LighthouseProcess(min_replicas=2, join_timeout_ms=10_000) as lh:
        quorum_timeout = timedelta(seconds=15)
        replicas = in_parallel(
            [lambda i=i: make_replica(i, lh.address, make_model, quorum_timeout=quorum_timeout)
             for i in range(2)]
        )  # fmt: skip
        try:
            assert (
                in_parallel([lambda r=r: steps(r, 2) for r in replicas])
                == [[(True, 1, 2), (True, 2, 2)]] * 2
            )
            killed(lh)
            with ThreadPoolExecutor(2) as pool:
                results = [pool.submit(steps, r, 2) for r in replicas]
                time.sleep(2.0)
                lh.restart()  # here: a Lighthouse dies with the thread that started it
                assert [f.result(timeout=60) for f in results] == [[(True, 3, 2), (True, 4, 2)]] * 2
            killed(lh)

            def lost(r: Replica) -> BaseException | None:
                try:
                    steps(r, 1)
                except BaseException as err:
                    return err
                return None

            start = time.monotonic()
            for err in in_parallel([lambda r=r: lost(r) for r in replicas]):
                assert isinstance(err, LighthouseUnreachable), err
                assert str(err).startswith("no Lighthouse answered for 15 s (quorum_timeout): ")
            assert time.monotonic() - start < 15 + 5
        finally:
            for r in replicas:
                r.close()


def test_a_quorum_number_reused_by_a_restarted_lighthouse_is_caught_before_the_step(
    make_model: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Both replicas train under quorum 1. The Lighthouse restarts and numbers from 1 again:
    replica 0, asking alone, gets quorum 1 with one member, but torchft keeps the two-member
    group it built for the old quorum 1. The step is discarded before it starts (no collective
    waits for replica 1, nothing is committed on the stale group), and the next quorum, under a
    new number, rebuilds the group: replica 0 commits alone."""

    def step(r: Replica) -> tuple[bool, bool, int]:
        res = r.run_step(lambda: r.model(torch.randn(4, 8)).sum().backward())
        return res.committed, res.recovered, res.participants

    with LighthouseProcess(min_replicas=1, join_timeout_ms=300) as lh:
        replicas = in_parallel(
            [lambda i=i: make_replica(i, lh.address, make_model) for i in range(2)]
        )
        try:
            assert in_parallel([lambda r=r: step(r) for r in replicas]) == [(True, False, 2)] * 2
            os.kill(lh.pid or 0, signal.SIGKILL)
            while lh.poll() is None:
                time.sleep(0.02)
            lh.restart()
            with caplog.at_level(logging.INFO):
                assert step(replicas[0]) == (False, True, 0)
            assert "recovered in process from StaleProcessGroup" in caplog.text
            assert "timed out" not in caplog.text  # no collective waited for replica 1
            assert step(replicas[0]) == (True, False, 1)
            assert replicas[0].manager.current_step() == 2
        finally:
            for r in replicas:
                r.close()


@pytest.mark.parametrize("steps_multiple", [0.0, 6.0], ids=["fixed", "adaptive"])
def test_an_adaptive_collective_timeout_lets_a_late_peer_commit(
    lighthouse: EmbeddedLighthouse, make_model: Any, steps_multiple: float
) -> None:
    """Steps of 0.5 s, then one where replica 1 comes 2.5 s late. A fixed 1.5 s timeout discards
    that step (gloo cuts the wait); one that follows 6 median step times (3 s) commits it,
    which needs the live gloo backend's timeout moved, not only the watchdog's."""
    replicas = in_parallel(
        [lambda i=i: make_replica(i, lighthouse.address, make_model,
                                  collective_timeout=timedelta(seconds=1.5),
                                  collective_timeout_steps=steps_multiple)
         for i in range(2)]
    )  # fmt: skip
    try:

        def train(r: Replica) -> list[bool]:
            gen = torch.Generator().manual_seed(r.config.replica_id)
            late = r.config.replica_id == 1

            def step(delay: float) -> bool:
                def fn() -> None:  # late before the backward: the gradient exchange waits
                    time.sleep(delay)
                    r.model(torch.randn(4, 8, generator=gen)).sum().backward()

                return r.run_step(fn).committed

            steady = [step(0.5) for _ in range(4)]
            return [*steady, step(3.0 if late else 0.5)]

        results = in_parallel([lambda r=r: train(r) for r in replicas])
        adapted = [r.collective_timeout.total_seconds() for r in replicas]
    finally:
        for r in replicas:
            r.close()
    if steps_multiple:
        assert all(2.5 < t < 4.5 for t in adapted), adapted
        assert results == [[True] * 5] * 2
    else:
        assert adapted == [1.5, 1.5]
        assert results[0][:4] == [True] * 4 and results[0][4] is False


def test_two_replicas_veto_sum_moe_counters_and_average_the_loss(
    lighthouse: EmbeddedLighthouse, make_model: Any
) -> None:
    replicas = in_parallel(
        [lambda i=i: make_replica(i, lighthouse.address, make_model) for i in range(2)]
    )
    sizes: list[list[int]] = [[], []]
    dtypes: set[torch.dtype] = set()
    for r, seen in zip(replicas, sizes, strict=True):
        allreduce = r.pg.allreduce  # the Manager's all-reduces and the vote's

        def recording(
            tensors: list[torch.Tensor], *args: Any, seen: list[int] = seen, f: Any = allreduce
        ) -> Any:
            seen.append(tensors[0].numel())
            dtypes.add(tensors[0].dtype)
            return f(tensors, *args)

        r.pg.allreduce = recording  # type: ignore[method-assign]
    try:

        def train(r: Replica, seed: int, veto_at: int) -> list[Any]:
            gen = torch.Generator().manual_seed(seed)
            results: list[Any] = []
            clipped: list[int] = []
            for step in range(3):
                local: list[torch.Tensor] = []

                def fn(step: int = step, local: list[torch.Tensor] = local) -> torch.Tensor:
                    loss = r.model(torch.randn(4, 8, generator=gen)).sum()
                    loss.backward()
                    if step == veto_at:
                        r.veto.raise_flag("nan in loss")
                    local.extend(m.tokens_per_expert.clone() for m in (r.model[1], r.model[2]))
                    return loss.detach() + seed  # replicas differ by their seed

                res = r.run_step(
                    fn, average_output=True, before_update=lambda s=step: clipped.append(s)
                )
                summed = [m.tokens_per_expert.clone() for m in (r.model[1], r.model[2])]
                results.append((res, local, summed, list(clipped)))
            return results

        out = in_parallel(
            [lambda: train(replicas[0], 1, veto_at=1), lambda: train(replicas[1], 2, veto_at=-1)]
        )
        for results in out:
            steps = [res for res, *_ in results]
            assert [s.committed for s in steps] == [True, False, True]
            assert [s.vetoed for s in steps] == [False, True, False]
            assert all(s.participants == 2 for s in steps)
            assert results[-1][3] == [0, 2]  # before_update ran on committed steps only
            for res, local, summed, _ in results:
                if res.committed:  # every counter became the sum of both replicas' counters
                    assert all(torch.equal(s, 2 * c) for c, s in zip(local, summed, strict=True))
                else:  # a discarded step leaves no counts behind
                    assert not any(s.any() for s in summed)
        # the averaged output is the same on both replicas: the mean of the two local values
        for a, b in zip(out[0], out[1], strict=True):
            assert torch.equal(a[0].output, b[0].output)
        # each step's gradient flags carry the first vote (veto, stop, second vote wanted, the
        # counters); then one all-reduce: the late flags and the loss (veto, stop, loss)
        counts = sum(
            m.tokens_per_expert.numel() for m in (replicas[0].model[1], replicas[0].model[2])
        )
        flags = 3 + counts + 1 + len(list(replicas[0].model.parameters()))
        for seen in sizes:
            assert [seen[i + 1] for i, n in enumerate(seen) if n == flags] == [3] * 3
            assert seen[-1] == 3
        assert torch.float64 not in dtypes, "HCCL reduces no float64 on Atlas A2/A3"
        for a, b in zip(
            replicas[0].model.parameters(), replicas[1].model.parameters(), strict=True
        ):
            assert torch.equal(a, b)
        assert replicas[0].manager.current_step() == replicas[1].manager.current_step() == 2
        replicas[0].set_step(7)
        assert replicas[0].manager.current_step() == 7
        with pytest.raises(ValueError, match="step must be >= 0"):
            replicas[0].set_step(-1)
    finally:
        for r in replicas:
            r.close()


def test_recoverable_failures_discard_the_step_until_the_limit(make_model: Any) -> None:
    with EmbeddedLighthouse(min_replicas=1) as lh:
        replica = make_replica(0, lh.address, make_model, max_consecutive_recoveries=2)
        try:
            weights = [p.detach().clone() for p in replica.model.parameters()]

            def fails() -> None:
                replica.model(torch.randn(2, 8)).sum().backward()
                raise RuntimeError("HCCL: FORCE STOP")

            for _ in range(2):
                result = replica.run_step(fails)
                assert result.recovered and not result.committed and result.step == 0
                assert all(p.grad is None for p in replica.model.parameters())
                assert not replica.model[1].tokens_per_expert.any()
            assert all(
                torch.equal(w, p) for w, p in zip(weights, replica.model.parameters(), strict=True)
            )
            with pytest.raises(RecoveryLimitExceeded):
                replica.run_step(fails)
            with pytest.raises(ValueError, match="a bug"):
                replica.run_step(lambda: (_ for _ in ()).throw(ValueError("a bug")))
        finally:
            replica.close()
            replica.close()  # idempotent
        with pytest.raises(RuntimeError, match="after close"):
            replica.run_step(lambda: None)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"replica_id": -1}, "replica_id must be >= 0"),
        ({"min_replica_size": 0}, "min_replica_size must be >= 1"),
        (
            {"group_rank": 2, "group_world_size": 2},
            r"group_rank must be in \[0, group_world_size\)",
        ),
        ({"collective_timeout": timedelta(0)}, "collective_timeout must be > 0 s"),
        ({"step_timeout": timedelta(0)}, "step_timeout must be > 0 s or None"),
        ({"group_world_size": 2}, "needs store_addr/store_port"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be > 0"),
        ({"collective_timeout_steps": 2}, r"collective_timeout_steps must be 0 \(off\) or >= 3"),
    ],
)
def test_config_errors_name_the_field(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaConfig(**{"replica_id": 0, **kw})


def test_adapter_selection() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_adapter().kind == expected  # never current_accelerator() alone
    assert isinstance(select_adapter("cpu"), CpuAdapter)
    with pytest.raises(ValueError, match="device must be one of"):
        select_adapter("tpu")


def test_lighthouse_lifecycle() -> None:
    lh = EmbeddedLighthouse(min_replicas=1)
    assert lh.address.startswith("http://") and lh.running
    lh.close()
    lh.close()
    assert not lh.running
    with pytest.raises(ValueError, match="heartbeat_timeout_ms must be >= 1"):
        EmbeddedLighthouse(heartbeat_timeout_ms=0)


@contextlib.contextmanager
def sleepy_replica(sleep_s: float) -> Iterator[tuple[Replica, Callable[[], None]]]:
    """One replica group with a 1 s collective timeout and no step timer, and a step that sleeps
    ``sleep_s`` after its backward."""
    with EmbeddedLighthouse(min_replicas=1) as lh:
        model = torch.nn.Linear(4, 1)
        config = ReplicaConfig(
            replica_id=0,
            lighthouse=lh.address,
            device="cpu",
            collective_timeout=timedelta(seconds=1),
        )
        with Replica(config, model, torch.optim.SGD(model.parameters(), lr=0.1)) as replica:

            def step() -> None:
                model(torch.randn(2, 4)).sum().backward()
                time.sleep(sleep_s)

            yield replica, step


def test_without_a_step_timeout_a_step_longer_than_the_collective_timeout_commits() -> None:
    with sleepy_replica(2.0) as (replica, slow_step):  # twice the collective timeout
        result = replica.run_step(slow_step)
        assert result.committed and not result.recovered and result.step == 1
        assert replica.recovery.total_recoveries == 0


def test_a_collective_timeout_under_three_step_times_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    warnings: list[list[str]] = []
    with sleepy_replica(0.4) as (replica, step):  # 3 x 0.4 s > the 1 s timeout
        for _ in range(4):
            caplog.clear()
            with caplog.at_level("WARNING", logger="ttnpu.ft.replica"):
                assert replica.run_step(step).committed
            warnings.append([r.getMessage() for r in caplog.records])
    assert warnings[:2] == [[], []]  # not judged on fewer than 3 steps
    [message] = warnings[2]
    assert message.startswith("collective_timeout 1.0 s is under 3x the median step time (0.4")
    assert warnings[3] == []  # once


class CountingClient:
    """torchft's ManagerClient with its ``should_commit`` RPCs counted."""

    def __init__(self, client: Any) -> None:
        self.client, self.should_commit_calls = client, 0

    def should_commit(self, *args: Any, **kwargs: Any) -> bool:
        self.should_commit_calls += 1
        return bool(self.client.should_commit(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_a_group_of_one_rank_decides_its_commit_without_the_manager_server_rpc() -> None:
    with sleepy_replica(0.0) as (replica, step):
        client = CountingClient(replica._quorums._client)
        replica._quorums._client = client
        assert replica.run_step(step).committed

        def vetoed_step() -> None:
            step()
            replica.veto.raise_flag("a detector fired")

        result = replica.run_step(vetoed_step)
        assert result.vetoed and not result.committed and result.step == 1
        assert replica.run_step(step).committed
        assert client.should_commit_calls == 0
        # a group of several ranks asks the ManagerServer, which ANDs its ranks' decisions
        replica._quorums._group_world_size = 2
        assert replica.run_step(step).committed and client.should_commit_calls == 1


def test_a_replica_gives_the_others_its_host_name_for_its_store_not_localhost() -> None:
    """Replicas on other hosts rendezvous through this store when this replica leads a quorum."""
    with sleepy_replica(0.0) as (replica, _):
        host, port = replica.store_address.rsplit(":", 1)
        assert host == socket.gethostname() != "localhost"
        peer = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        peer.set("from-a-peer", "reached")
        assert replica._store is not None and replica._store.get("from-a-peer") == b"reached"


def test_a_replica_given_a_host_advertises_it_for_its_store_manager_and_heals() -> None:
    """A loopback address other than 127.0.0.1 stands for another host's network here."""
    with EmbeddedLighthouse(min_replicas=1) as lh:
        model = torch.nn.Linear(4, 1)
        config = ReplicaConfig(replica_id=0, lighthouse=lh.address, device="cpu", host="127.0.0.3")
        with Replica(config, model, torch.optim.SGD(model.parameters(), lr=0.1)) as replica:
            assert replica.store_address.startswith("127.0.0.3:")
            assert replica.manager._checkpoint_transport.metadata().startswith("127.0.0.3:")
            result = replica.run_step(lambda: model(torch.randn(2, 4)).sum().backward())
            assert result.committed


def test_parameters_no_replica_has_a_gradient_for_stay_untouched_by_adamw() -> None:
    with EmbeddedLighthouse(min_replicas=1) as lh:
        torch.manual_seed(0)
        model = torch.nn.ModuleDict(
            {"used": torch.nn.Linear(4, 1), "unused": torch.nn.Linear(4, 1)}
        )
        unused = [p.detach().clone() for p in model["unused"].parameters()]
        used = [p.detach().clone() for p in model["used"].parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        config = ReplicaConfig(replica_id=0, lighthouse=lh.address, device="cpu")
        with Replica(config, model, opt) as replica:
            for _ in range(2):
                step = lambda: model["used"](torch.randn(2, 4)).sum().backward()  # noqa: E731
                assert replica.run_step(step).committed
                assert all(p.grad is None for p in model["unused"].parameters())
                assert all(p.grad is not None for p in model["used"].parameters())
        for before, after in zip(unused, model["unused"].parameters(), strict=True):
            assert torch.equal(before, after) and after not in opt.state
        assert not any(
            torch.equal(b, a) for b, a in zip(used, model["used"].parameters(), strict=True)
        )


def test_a_peer_lost_during_the_veto_vote_is_recovered(
    make_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with EmbeddedLighthouse(min_replicas=1) as lh:
        replica = make_replica(0, lh.address, make_model)
        try:

            def peer_lost(payload: torch.Tensor | None = None) -> bool:
                raise RuntimeError("Connection closed by peer")

            monkeypatch.setattr(replica.veto, "vote", peer_lost)
            result = replica.run_step(
                lambda: replica.model(torch.randn(2, 8)).sum().backward(), late_flags=True
            )
            assert result.recovered and not result.committed and result.step == 0
            assert all(p.grad is None for p in replica.model.parameters())
        finally:
            replica.close()

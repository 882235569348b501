"""The HCCL process group and the NPU recovery sequence against a recording fake of torch_npu."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from ttnpu.ft import (
    CollectiveTimeout,
    NpuAdapter,
    NpuRuntime,
    ProcessGroupHCCL,
    RecoveryLimitExceeded,
    StepRecovery,
)

DEVICE = "privateuseone"  # what "npu" is called before torch_npu renames the backend


def runtime(fake: Any) -> NpuRuntime:
    return NpuRuntime(fake, device_type=DEVICE)


def configure(pg: ProcessGroupHCCL, store: TCPStore, quorum_id: int) -> None:
    pg.configure(
        f"localhost:{store.port}/torchft/{quorum_id}/0", "replica_0", 0, 1, quorum_id, 0, 1, [0]
    )


def test_each_quorum_builds_a_fresh_native_group_with_a_longer_native_watchdog(
    fake_npu: Any, store: TCPStore
) -> None:
    pg = ProcessGroupHCCL(
        timedelta(seconds=10), recovery_timeout=timedelta(seconds=20), runtime=runtime(fake_npu)
    )
    configure(pg, store, quorum_id=1)
    configure(pg, store, quorum_id=2)
    assert fake_npu.rec.calls == [
        ("ProcessGroupHCCL", 0, 1, timedelta(seconds=60), "torchft_quorum_1_rank_0"),
        ("_set_sequence_number_for_group", "hccl1"),
        # reconfiguring releases the previous group first
        ("abort", "hccl1"),
        ("shutdown", "hccl1"),
        ("clear_workmeta_list", "hccl1"),
        ("ProcessGroupHCCL", 0, 1, timedelta(seconds=60), "torchft_quorum_2_rank_0"),
        ("_set_sequence_number_for_group", "hccl2"),
    ]
    assert pg.watchdog_timeout > pg._timeout + pg.recovery_timeout
    assert pg.parent._get_backend(torch.device(DEVICE)) is pg.backend
    assert pg.getBackendName() == "torchft-hccl" and pg.errored() is None


def test_a_reused_store_address_is_refused(fake_npu: Any, store: TCPStore) -> None:
    pg = ProcessGroupHCCL(runtime=runtime(fake_npu))
    configure(pg, store, quorum_id=1)
    with pytest.raises(ValueError, match="already used"):
        configure(pg, store, quorum_id=1)


def test_abort_releases_the_group_once_and_marks_it_errored(fake_npu: Any, store: TCPStore) -> None:
    pg = ProcessGroupHCCL(runtime=runtime(fake_npu))
    configure(pg, store, quorum_id=1)
    fake_npu.rec.calls.clear()
    pg.abort()
    pg.abort()
    assert fake_npu.rec.calls == [
        ("abort", "hccl1"),
        ("shutdown", "hccl1"),
        ("clear_workmeta_list", "hccl1"),
    ]
    assert isinstance(pg.errored(), RuntimeError) and pg.backend is None


def setup_recovery(fake_npu: Any, store: TCPStore, model: torch.nn.Module, **kw: Any) -> Any:
    adapter = NpuAdapter(runtime(fake_npu))
    pg = adapter.process_group(timedelta(seconds=10), timedelta(seconds=10))
    assert isinstance(pg, ProcessGroupHCCL)
    configure(pg, store, quorum_id=1)
    other = adapter.process_group(timedelta(seconds=10), timedelta(seconds=10))  # e.g. a 2nd group
    assert isinstance(other, ProcessGroupHCCL)
    configure(other, store, quorum_id=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recovery = StepRecovery(
        adapter, pg, model, (opt,), collective_timeout=timedelta(seconds=0.05), **kw
    )
    fake_npu.rec.calls.clear()
    return recovery, opt


def test_npu_recovery_sequence_after_a_collective_timeout(
    fake_npu: Any, store: TCPStore, model: torch.nn.Module, poll: Any
) -> None:
    recovery, _ = setup_recovery(fake_npu, store, model)
    model(torch.randn(2, 8)).sum().backward()
    recovery.begin_step()
    with pytest.raises(CollectiveTimeout, match="allreduce timed out"):
        # a collective that hangs until the 50 ms watchdog has stopped the device
        recovery.guard("allreduce", lambda: poll(lambda: recovery.stopped))
    cleanup = recovery.recover(CollectiveTimeout("allreduce"))
    assert fake_npu.rec.calls == [
        ("stop_device", 3),  # timer thread: queued work fails with FORCE STOP
        ("abort_hccl_comm", "hccl1", "reinit"),
        ("abort", "hccl1"),
        ("shutdown", "hccl1"),
        ("clear_workmeta_list", "hccl1"),
        # training thread, after cleaning the site, in MindSpeed's order (facts C.3): resume the
        # groups that were not aborted (reinit_process_group(rebuild_link=False)), then
        # restart_device, which clears FORCE STOP and restarts the watchdogs
        ("resume_hccl_comm", "hccl2", 3),
        ("restart_device", 3, True, True),
        ("empty_cache",),
    ]
    assert cleanup.grads_cleared == len(list(model.parameters()))
    assert cleanup.step_state_owners_reset == 1 and cleanup.counters_zeroed == 1
    assert all(p.grad is None for p in model.parameters())
    assert model[1].aux_loss_sum == 0.0
    assert not model[1].tokens_per_expert.any() and not model[2].tokens_per_expert.any()


def test_a_collective_that_hangs_on_the_device_is_stopped_by_the_watchdog(
    fake_npu: Any, store: TCPStore, model: torch.nn.Module, monkeypatch: Any
) -> None:
    # HCCL's work.wait() returns once the stream waits: the hang shows in the stream's
    # synchronisation, which blocks until the watchdog's stop_device fails the queued work.
    recovery, _ = setup_recovery(fake_npu, store, model)
    stopped = threading.Event()
    stop = fake_npu.npu.stop_device
    monkeypatch.setattr(fake_npu.npu, "stop_device", lambda i: (stopped.set(), stop(i))[1])
    monkeypatch.setattr(fake_npu.npu._Stream, "synchronize", lambda: stopped.wait(60))
    waited = []
    recovery.begin_step()
    with pytest.raises(CollectiveTimeout, match="allreduce_gradients timed out"):
        recovery.wait_collectives("allreduce_gradients", lambda: waited.append(True))
    assert waited == [True] and stopped.is_set()
    assert fake_npu.rec.names()[:2] == ["stop_device", "abort_hccl_comm"]


def test_recovery_without_a_timeout_stops_and_aborts_itself(
    fake_npu: Any, store: TCPStore, model: torch.nn.Module
) -> None:
    recovery, _ = setup_recovery(fake_npu, store, model)
    recovery.begin_step()
    error = RuntimeError("FORCE STOP")
    assert recovery.is_recoverable(error) and not recovery.is_recoverable(ValueError("bug"))
    recovery.recover(error)
    assert fake_npu.rec.names()[:2] == ["stop_device", "abort_hccl_comm"]
    assert fake_npu.rec.names()[-3:] == ["resume_hccl_comm", "restart_device", "empty_cache"]


def test_a_timeout_cannot_interrupt_the_optimizer_update(
    fake_npu: Any, store: TCPStore, model: torch.nn.Module, monkeypatch: Any, poll: Any
) -> None:
    recovery, opt = setup_recovery(fake_npu, store, model)
    model(torch.randn(2, 8)).sum().backward()
    recovery.begin_step()
    before = model[0].weight.detach().clone()

    expiring = threading.Event()
    expire = recovery.watchdog._expire
    monkeypatch.setattr(recovery.watchdog, "_expire", lambda t: (expiring.set(), expire(t)))

    def slow_update() -> None:
        # Armed inside the update, which holds the lock until the 50 ms timer has expired and
        # its thread blocks on the lock: the timeout surely happens while the update runs.
        recovery.watchdog.arm("late allreduce")
        assert expiring.wait(60)
        opt.step()

    recovery.apply_update(slow_update)
    poll(lambda: recovery.watchdog.stale_expiries == 1)
    assert not torch.equal(before, model[0].weight)
    assert fake_npu.rec.names() == ["synchronize"]  # no stop_device, no abort
    assert recovery.watchdog.stale_expiries == 1 and not recovery.stopped


def test_too_many_consecutive_recoveries_are_fatal_and_an_update_resets_the_count(
    fake_npu: Any, store: TCPStore, model: torch.nn.Module
) -> None:
    recovery, _ = setup_recovery(fake_npu, store, model, max_consecutive_recoveries=2)
    for _ in range(2):
        recovery.recover(RuntimeError("FORCE STOP"))
    recovery.apply_update(lambda: None)
    for _ in range(2):
        recovery.recover(RuntimeError("FORCE STOP"))
    with pytest.raises(RecoveryLimitExceeded, match="3 consecutive step recoveries"):
        recovery.recover(RuntimeError("FORCE STOP"))


def test_stop_device_failure_is_reported(fake_npu: Any) -> None:
    fake_npu.npu.stop_status = 7
    with pytest.raises(RuntimeError, match=r"stop_device\(3\) returned 7"):
        runtime(fake_npu).stop_device(3)


def test_missing_torch_npu_gives_a_clear_error() -> None:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match=r"ttnpu-ft\[npu\]"):
            NpuRuntime()
    else:
        pytest.skip("torch_npu is installed")


@pytest.mark.npu
def test_hccl_group_for_real(store: TCPStore) -> None:
    torch_npu = pytest.importorskip("torch_npu")
    if not torch.npu.is_available():  # type: ignore[attr-defined]
        pytest.skip("no Ascend device")
    pg = ProcessGroupHCCL(runtime=NpuRuntime(torch_npu))
    configure(pg, store, quorum_id=1)
    t = torch.ones(4, device="npu")
    pg.allreduce([t], torch.distributed.AllreduceOptions()).wait()
    assert t.cpu().tolist() == [1.0] * 4
    pg.abort()
    assert pg.errored() is not None

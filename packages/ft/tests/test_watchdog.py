from __future__ import annotations

import threading
from typing import Any

import pytest

from ttnpu.ft import CollectiveWatchdog, WatchdogToken


def test_live_timer_fires_once_with_its_token() -> None:
    fired: list[WatchdogToken] = []
    done = threading.Event()
    dog = CollectiveWatchdog(0.05, lambda t: (fired.append(t), done.set()))
    token = dog.arm("allreduce")
    assert done.wait(2)
    assert fired == [token] and dog.fired == [token]


def test_disarmed_timer_never_fires() -> None:
    fired: list[WatchdogToken] = []
    done = threading.Event()
    dog = CollectiveWatchdog(0.05, lambda t: (fired.append(t), done.set()))
    disarmed = dog.arm("allreduce")
    dog.disarm(disarmed)
    later = dog.arm("vote", timeout_s=0.2)  # due after the disarmed one: the thread passed it
    assert done.wait(60)
    assert fired == [later] and dog.stale_expiries == 0


def test_one_thread_serves_timers_in_deadline_order_and_close_stops_it() -> None:
    """An earlier deadline armed after a later one wakes the thread; ``close`` ends it."""
    fired: list[str] = []
    two = threading.Event()
    dog = CollectiveWatchdog(30.0, lambda t: (fired.append(t.label), len(fired) == 2 and two.set()))
    dog.arm("late", timeout_s=0.3)
    dog.arm("early", timeout_s=0.05)
    dog.arm("never")  # 30 s: still armed when the watchdog closes
    assert two.wait(60)
    assert fired == ["early", "late"]
    thread = dog._thread
    dog.close()
    assert thread is not None and not thread.is_alive() and fired == ["early", "late"]
    with pytest.raises(RuntimeError, match="after close"):
        dog.arm("again")


def test_timer_of_an_old_generation_cannot_stop_the_new_step() -> None:
    """A late expiry (its thread delayed past the next step's start) is ignored, not acted on."""
    fired: list[WatchdogToken] = []
    dog = CollectiveWatchdog(10.0, fired.append)
    old = dog.arm("step 1 allreduce")
    dog.new_generation()
    new = dog.arm("step 2 allreduce", timeout_s=10.0)
    dog._expire(old)  # what the old timer thread would do if it ran late
    assert fired == [] and dog.stale_expiries == 1
    dog._expire(new)
    assert fired == [new]


def test_expiry_waits_for_the_lock_held_by_an_update(
    monkeypatch: pytest.MonkeyPatch, poll: Any
) -> None:
    """The optimizer update holds the lock; it retires the step's timers before releasing it."""
    fired: list[WatchdogToken] = []
    dog = CollectiveWatchdog(0.05, fired.append)
    expiring = threading.Event()
    expire = dog._expire
    monkeypatch.setattr(dog, "_expire", lambda t: (expiring.set(), expire(t)))
    with dog.lock:
        dog.arm("allreduce")
        assert expiring.wait(60)  # the timer thread expired and now blocks on the lock
        dog.new_generation()
    poll(lambda: dog.stale_expiries == 1)
    assert fired == []


def test_bad_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        CollectiveWatchdog(0, lambda t: None)

import pytest

from ttnpu.sdc import ChecksumSwitch


def test_on_for_expires_and_does_not_shorten_an_unbounded_on() -> None:
    now = [0.0]
    switch = ChecksumSwitch(on=False, clock=lambda: now[0])
    switch.on_for(10)
    now[0] = 9.9
    assert switch.is_on()
    now[0] = 10.0
    assert not switch.is_on()
    switch.on()
    switch.on_for(1)
    now[0] = 100.0
    assert switch.is_on()
    switch.off()
    assert not switch.should_check()


def test_sampling_counts_only_while_on() -> None:
    switch = ChecksumSwitch(sample_every=3)
    assert [switch.should_check() for _ in range(6)] == [False, False, True] * 2
    with pytest.raises(ValueError, match="sample_every"):
        ChecksumSwitch(sample_every=0)

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


def test_sampled_steps_are_a_fraction_shared_by_every_switch_with_the_seed() -> None:
    switch = ChecksumSwitch(on=False, sample_steps=0.1, seed=7)
    sampled = [s for s in range(1, 2001) if switch.begin_step(s)]
    assert 150 < len(sampled) < 250  # ~10% of steps
    twin = ChecksumSwitch(on=False, sample_steps=0.1, seed=7)  # another rank, same seed
    assert [s for s in range(1, 2001) if twin.step_sampled(s)] == sampled
    assert switch.begin_step(sampled[0]) and switch.should_check()  # on for the whole step
    assert not switch.begin_step(next(s for s in range(1, 99) if s not in sampled))
    switch.begin_step(sampled[0])
    switch.off()
    assert not switch.is_on()
    assert not any(ChecksumSwitch(on=False).begin_step(s) for s in range(100))
    with pytest.raises(ValueError, match="sample_steps"):
        ChecksumSwitch(sample_steps=1.5)

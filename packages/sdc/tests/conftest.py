"""Shared fixtures: a fresh process-wide reporter and switch for every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ttnpu.sdc import Reporter, VetoFlag, checksum_switch, set_default_reporter


@pytest.fixture(autouse=True)
def _seed_and_switch() -> Iterator[None]:
    torch.manual_seed(0)
    checksum_switch.on()
    checksum_switch.sample_every = 1
    yield
    checksum_switch.on()
    checksum_switch.sample_every = 1


@pytest.fixture
def veto() -> Iterator[VetoFlag]:
    """The default reporter records events in a VetoFlag (instead of logging and raising)."""
    flag = VetoFlag()
    previous = set_default_reporter(Reporter([flag]))
    yield flag
    set_default_reporter(previous)

"""PeekableIterator: read ahead in order, report and restore the position of the next item."""

from __future__ import annotations

import pytest
import torch

from ttnpu.routing import PeekableIterator
from ttnpu.routing.testing import MarkovCorpus


def corpus(length: int | None = None) -> MarkovCorpus:
    return MarkovCorpus(batch=2, seq=5, length=length)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_hands_out_in_order_while_reading_ahead() -> None:
    reference = [corpus().batch_at(i) for i in range(6)]
    data = PeekableIterator(corpus())
    assert same(data.peek(3), reference[:3])
    assert same([next(data)], reference[:1])
    assert same(data.peek(4), reference[1:5])
    assert same([next(data) for _ in range(5)], reference[1:6])
    assert data.consumed == 6


def test_position_is_the_next_item_to_hand_out_not_to_read() -> None:
    data = PeekableIterator(corpus())
    next(data)
    next(data)
    data.peek(5)
    assert data.read_ahead == 5
    state = data.state_dict()
    assert state == {"consumed": 2, "source": {"index": 2}}
    resumed = PeekableIterator(corpus())
    resumed.load_state_dict(state)
    assert same([next(resumed) for _ in range(4)], [next(data) for _ in range(4)])


def test_load_rewinds_and_drops_what_was_read_ahead() -> None:
    data = PeekableIterator(corpus())
    state = data.state_dict()
    first = [next(data) for _ in range(3)]
    data.peek(4)
    data.load_state_dict(state)
    assert data.read_ahead == 0 and data.consumed == 0
    assert same([next(data) for _ in range(3)], first)


def test_end_of_data() -> None:
    data = PeekableIterator(corpus(length=3))
    assert len(data.peek(10)) == 3
    assert len(list(data)) == 3
    with pytest.raises(StopIteration):
        next(data)


def test_bad_input() -> None:
    with pytest.raises(TypeError, match="state_dict"):
        PeekableIterator([1, 2, 3])  # type: ignore[arg-type]
    data = PeekableIterator(corpus())
    with pytest.raises(ValueError, match="n must be >= 0"):
        data.peek(-1)
    with pytest.raises(ValueError, match="malformed"):
        data.load_state_dict({"source": {}})

"""A data iterator that can read ahead without losing its place.

Anticipatory routing needs the batches of future steps now; a checkpoint must still record the
position of the next batch to *train* on, not the next batch read. The source is any stateful
iterable (torchtitan's dataloader, torchdata's ``StatefulDataLoader``): ``state_dict()`` says where
it is and ``load_state_dict()`` followed by ``iter()`` resumes there.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class StatefulIterable(Protocol[T_co]):
    """An iterable that can report and restore its position."""

    def __iter__(self) -> Iterator[T_co]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class PeekableIterator(Generic[T]):
    """Hands out the source's items in order; ``peek(n)`` reads ahead without consuming.

    ``state_dict()`` is the source's position *before* the first item not yet handed out, so a
    checkpoint taken while items are read ahead resumes at the right one.
    """

    def __init__(self, source: StatefulIterable[T]) -> None:
        if not isinstance(source, StatefulIterable):
            raise TypeError(
                f"PeekableIterator: the source must be iterable and have state_dict() and "
                f"load_state_dict(), got {type(source).__name__}"
            )
        self.source = source
        self.consumed = 0
        self._iterator: Iterator[T] | None = None
        self._ahead: deque[tuple[dict[str, Any], T]] = deque()
        self._exhausted = False

    def __iter__(self) -> PeekableIterator[T]:
        return self

    def __next__(self) -> T:
        if not self._ahead and not self._read_one():
            raise StopIteration
        _, item = self._ahead.popleft()
        self.consumed += 1
        return item

    def peek(self, n: int) -> list[T]:
        """The next ``n`` items (fewer if the source ends first), still to be handed out."""
        if n < 0:
            raise ValueError(f"PeekableIterator.peek: n must be >= 0, got {n}")
        while len(self._ahead) < n and self._read_one():
            pass
        return [item for _, item in list(self._ahead)[:n]]

    @property
    def read_ahead(self) -> int:
        """How many items have been read from the source but not handed out."""
        return len(self._ahead)

    def _read_one(self) -> bool:
        if self._exhausted:
            return False
        state = copy.deepcopy(self.source.state_dict())
        if self._iterator is None:
            self._iterator = iter(self.source)
        try:
            item = next(self._iterator)
        except StopIteration:
            self._exhausted = True
            return False
        self._ahead.append((state, item))
        return True

    def state_dict(self) -> dict[str, Any]:
        """The position of the next item to hand out (not of the next item to read)."""
        source = self._ahead[0][0] if self._ahead else self.source.state_dict()
        return {"consumed": self.consumed, "source": copy.deepcopy(source)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at a saved position; items read ahead are dropped and will be read again."""
        try:
            consumed = int(state_dict["consumed"])
            source = state_dict["source"]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"PeekableIterator.load_state_dict: malformed state ({error!r})"
            ) from None
        self.source.load_state_dict(copy.deepcopy(source))
        self.consumed = consumed
        self._iterator = None
        self._ahead.clear()
        self._exhausted = False

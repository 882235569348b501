"""An embedded torchft Lighthouse for single-host runs (tests, drills, one-machine training).

Multi-host jobs run ``torchft_lighthouse`` as its own service; on one host it is simpler to own the
server in-process and to be sure it stops with the job.
"""

from __future__ import annotations

from types import TracebackType

from torchft.coordination import LighthouseServer


class EmbeddedLighthouse:
    """A torchft ``LighthouseServer`` owned by this process; ``close()`` (or ``with``) stops it.

    The defaults suit a single host: a dead replica is noticed after ``heartbeat_timeout_ms`` and a
    replica that stops requesting (hung) costs the others at most ``join_timeout_ms`` per quorum.
    """

    def __init__(
        self,
        min_replicas: int = 1,
        *,
        bind: str = "[::]:0",
        join_timeout_ms: int = 5000,
        heartbeat_timeout_ms: int = 5000,
        quorum_tick_ms: int = 100,
    ) -> None:
        for name, value in (
            ("min_replicas", min_replicas),
            ("join_timeout_ms", join_timeout_ms),
            ("heartbeat_timeout_ms", heartbeat_timeout_ms),
            ("quorum_tick_ms", quorum_tick_ms),
        ):
            if value < 1:
                raise ValueError(f"EmbeddedLighthouse: {name} must be >= 1, got {value}")
        self._server: LighthouseServer | None = LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        self._address = self._server.address()

    @property
    def address(self) -> str:
        """``http://host:port``: pass it as ``lighthouse_addr`` or ``TORCHFT_LIGHTHOUSE``."""
        return self._address

    @property
    def running(self) -> bool:
        return self._server is not None

    def close(self) -> None:
        """Stop the server; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()

    def __enter__(self) -> EmbeddedLighthouse:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

"""An embedded torchft Lighthouse for single-host runs (tests, drills, one-machine training).

Multi-host jobs run ``torchft_lighthouse`` as its own service; on one host it is simpler to own the
server in-process and to be sure it stops with the job.
"""

from __future__ import annotations

import os
import socket
from types import TracebackType
from urllib.parse import urlsplit

from torchft.coordination import LighthouseServer

__all__ = ["EmbeddedLighthouse", "LighthouseUnreachable", "check_lighthouse"]


class LighthouseUnreachable(ConnectionError):
    """No Lighthouse address was given, or nothing answers at it."""


def check_lighthouse(address: str | None = None, timeout: float = 5.0) -> str:
    """The Lighthouse address (``address`` or ``TORCHFT_LIGHTHOUSE``), checked to accept a TCP
    connection within ``timeout`` seconds: torchft would otherwise retry until its quorum timeout
    and fail deep inside the Manager."""
    address = address or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise LighthouseUnreachable(
            "no Lighthouse address: pass one or set TORCHFT_LIGHTHOUSE (http://host:port)"
        )
    parts = urlsplit(address if "://" in address else f"http://{address}")
    if parts.hostname is None or parts.port is None:
        raise LighthouseUnreachable(f"Lighthouse address {address!r} is not http://host:port")
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout):
            pass
    except OSError as err:
        raise LighthouseUnreachable(
            f"cannot reach the Lighthouse at {address} within {timeout:g} s ({err})"
        ) from err
    return address


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

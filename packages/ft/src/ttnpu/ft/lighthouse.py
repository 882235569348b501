"""The torchft Lighthouse for single-host runs: embedded, or as a child process that can be
restarted at the same address.

Multi-host jobs run ``torchft_lighthouse`` as their own service. On one host, ``EmbeddedLighthouse``
owns the server in-process (tests, drills) and stops with its owner; ``LighthouseProcess`` runs
torchft's ``torchft_lighthouse`` as a child on a fixed loopback address, so that a supervisor can
restart it where the replicas look for it (a ``Replica`` rides through the gap: see
``ReplicaConfig.quorum_timeout``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

from torchft.coordination import LighthouseServer

__all__ = [
    "EmbeddedLighthouse",
    "LighthouseProcess",
    "LighthouseStartError",
    "LighthouseUnreachable",
    "check_lighthouse",
]


class LighthouseUnreachable(ConnectionError):
    """No Lighthouse address was given, or nothing answers at it."""


class LighthouseStartError(RuntimeError):
    """``torchft_lighthouse`` could not be started (missing, port taken, exited at start)."""


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


def _check_at_least_one(owner: str, **settings: int) -> None:
    for name, value in settings.items():
        if value < 1:
            raise ValueError(f"{owner}: {name} must be >= 1, got {value}")


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
        _check_at_least_one(
            "EmbeddedLighthouse",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
        )
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


class LighthouseProcess:
    """torchft's ``torchft_lighthouse`` as a child process on ``host:port`` (a free port when 0).

    ``start()`` returns once it accepts connections; ``restart()`` starts it anew on the same
    address after it died. It runs in its own process group (a terminal's Ctrl-C is the owner's
    to forward) and, on Linux, is killed when its owner dies (``PR_SET_PDEATHSIG``; it cannot
    watch for that itself): strictly, when the thread that started it ends, so start and restart
    it from a thread that outlives it. Its output goes to ``log`` (appended), by default nowhere.
    """

    def __init__(
        self,
        min_replicas: int = 1,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        join_timeout_ms: int = 30_000,
        heartbeat_timeout_ms: int = 5000,
        quorum_tick_ms: int = 100,
        log: Path | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        _check_at_least_one(
            "LighthouseProcess",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
        )
        if port == 0:
            with socket.socket() as sock:  # the port stays this Lighthouse's across restarts
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.host, self.port = host, port
        self.log = log
        self.start_timeout = start_timeout
        self._args = [
            "--bind", f"{host}:{port}",
            "--min_replicas", str(min_replicas),
            "--join_timeout_ms", str(join_timeout_ms),
            "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
            "--quorum_tick_ms", str(quorum_tick_ms),
        ]  # fmt: skip
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``http://host:port``: the same across restarts."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> LighthouseProcess:
        """Start it and wait until it accepts connections (``LighthouseStartError`` when its port
        is taken, or naming its exit status when it exits first)."""
        if self._process is not None and self._process.poll() is None:
            raise RuntimeError(f"LighthouseProcess.start: already running (pid {self.pid})")
        with socket.socket() as probe:  # else another listener would pass the readiness check
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as tokio binds
            try:
                probe.bind((self.host, self.port))
            except OSError as err:
                raise LighthouseStartError(
                    f"torchft_lighthouse: {self.host}:{self.port} is taken ({err})"
                ) from None
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        with contextlib.ExitStack() as files:
            out = files.enter_context(self.log.open("ab")) if self.log else subprocess.DEVNULL
            self._process = subprocess.Popen(
                [_lighthouse_program(), *self._args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                process_group=0,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + self.start_timeout
        while True:
            if (status := self._process.poll()) is not None:
                where = f"; see {self.log}" if self.log else ""
                raise LighthouseStartError(
                    f"torchft_lighthouse at {self.address} exited with status {status} at "
                    f"start{where}"
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.host, self.port), timeout=1.0),
            ):
                return self
            if time.monotonic() > deadline:
                self.close()
                raise LighthouseStartError(
                    f"torchft_lighthouse at {self.address} did not accept connections within "
                    f"{self.start_timeout:g} s"
                )
            time.sleep(0.05)

    def poll(self) -> int | None:
        """Its exit status once it exited (``-9``: SIGKILL), else None (running or not started)."""
        return None if self._process is None else self._process.poll()

    def restart(self) -> LighthouseProcess:
        """After it died: start it anew on the same address."""
        if self.poll() is None and self._process is not None:
            raise RuntimeError(f"LighthouseProcess.restart: still running (pid {self.pid})")
        return self.start()

    def close(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; idempotent."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> LighthouseProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _lighthouse_program() -> str:
    """torchft's ``torchft_lighthouse`` console script: beside this interpreter (a virtual
    environment's bin), else on PATH."""
    program = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    program = program or shutil.which("torchft_lighthouse")
    if program is None:
        raise LighthouseStartError("torchft_lighthouse not found (it is installed with torchft)")
    return program


if sys.platform == "linux":
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    _PR_SET_PDEATHSIG = 1

    def _die_with_parent() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

else:

    def _die_with_parent() -> None:
        pass

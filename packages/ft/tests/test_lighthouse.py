from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ttnpu.ft import (
    EmbeddedLighthouse,
    LighthouseProcess,
    LighthouseStartError,
    LighthouseUnreachable,
    check_lighthouse,
)


def test_a_running_lighthouse_passes_the_check() -> None:
    with EmbeddedLighthouse() as lighthouse:
        assert check_lighthouse(lighthouse.address) == lighthouse.address


def test_the_address_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with EmbeddedLighthouse() as lighthouse:
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse.address)
        assert check_lighthouse() == lighthouse.address


def test_a_missing_or_dead_lighthouse_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(LighthouseUnreachable, match="set TORCHFT_LIGHTHOUSE"):
        check_lighthouse()
    with pytest.raises(LighthouseUnreachable, match="is not http://host:port"):
        check_lighthouse("http://nohost")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(LighthouseUnreachable, match=f"cannot reach the Lighthouse at .*:{port}"):
        check_lighthouse(f"http://127.0.0.1:{port}", timeout=1.0)


def test_embedded_lighthouse_validates_and_closes_idempotently() -> None:
    with pytest.raises(ValueError, match="min_replicas must be >= 1"):
        EmbeddedLighthouse(min_replicas=0)
    lighthouse = EmbeddedLighthouse()
    assert lighthouse.running
    lighthouse.close()
    lighthouse.close()
    assert not lighthouse.running


def test_a_lighthouse_process_restarts_on_its_address_and_closes_idempotently(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="join_timeout_ms must be >= 1"):
        LighthouseProcess(join_timeout_ms=0)
    lighthouse = LighthouseProcess(log=tmp_path / "lighthouse.log").start()
    try:
        address, first = lighthouse.address, lighthouse.pid
        assert address.startswith("http://127.0.0.1:") and check_lighthouse(address) == address
        with pytest.raises(RuntimeError, match="still running"):
            lighthouse.restart()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while lighthouse.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lighthouse.poll() == -signal.SIGKILL
        with pytest.raises(LighthouseUnreachable):
            check_lighthouse(address, timeout=1.0)
        lighthouse.restart()
        assert lighthouse.pid != first and lighthouse.address == address
        assert check_lighthouse(address) == address
    finally:
        lighthouse.close()
        lighthouse.close()
    assert lighthouse.poll() is None and lighthouse.pid is None


def test_a_lighthouse_process_that_cannot_start_says_why(tmp_path: Path) -> None:
    with (
        LighthouseProcess() as running,
        pytest.raises(LighthouseStartError, match=f"127.0.0.1:{running.port} is taken"),
    ):
        LighthouseProcess(port=running.port).start()
    with pytest.raises(LighthouseStartError, match=r"exited with status 1 at start; see .*bad.log"):
        LighthouseProcess(host="127.0.0.1", log=tmp_path / "bad.log", join_timeout_ms=2**64).start()


def test_a_lighthouse_process_dies_with_its_owner(tmp_path: Path) -> None:
    """Its owner SIGKILLed (no chance to close it): the kernel kills it too (Linux)."""
    if sys.platform != "linux":
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    owner = subprocess.Popen(
        [sys.executable, "-c", (
            "import time; from ttnpu.ft import LighthouseProcess; "
            "print(LighthouseProcess().start().pid, flush=True); time.sleep(60)"
        )],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert owner.stdout is not None
    pid = int(owner.stdout.readline())
    os.kill(pid, 0)  # running
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Running (a zombie reaped by init counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"

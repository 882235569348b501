from __future__ import annotations

import socket

import pytest

from ttnpu.ft import EmbeddedLighthouse, LighthouseUnreachable, check_lighthouse


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

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from ttnpu.ft import SocketTransport

T = timedelta(seconds=10)


def test_request_waits_for_the_snapshot_then_keeps_structure_values_and_dtypes() -> None:
    """A joiner may ask before the source serves that step (as with torchft's HTTPTransport)."""
    src, dst = SocketTransport(T), SocketTransport(T)
    state = {
        "user": {
            "default": {
                "model": {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16)},
                "optimizer": {
                    "state": {0: {"step": torch.tensor(3.0)}},
                    "param_groups": [{"lr": 0.1, "params": [0]}],
                },
                "empty": torch.empty(0, 5),
            }
        },
        "torchft": {"step": 7, "batches_committed": 14},
    }
    sender = threading.Timer(1.0, src.send_checkpoint, args=([1], 7, state, T))
    try:
        sender.start()  # the request below reaches the source before the snapshot is served
        out = dst.recv_checkpoint(0, src.metadata(), 7, T)
        flat_a, spec_a = torch.utils._pytree.tree_flatten(state)
        flat_b, spec_b = torch.utils._pytree.tree_flatten(out)
        assert spec_a == spec_b
        for a, b in zip(flat_a, flat_b, strict=True):
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b)
            else:
                assert a == b
    finally:
        sender.join()
        src.shutdown()
        dst.shutdown()


def test_wrong_step_or_nothing_served_is_a_clear_error() -> None:
    # The source holds a request for its transport timeout, then answers what it serves.
    src, dst = SocketTransport(timedelta(seconds=0.5)), SocketTransport(T)
    try:
        with pytest.raises(RuntimeError, match=r"no checkpoint for step 3 \(it serves nothing\)"):
            dst.recv_checkpoint(0, src.metadata(), 3, T)
        src.send_checkpoint([1], 5, {"x": torch.ones(2)}, T)
        with pytest.raises(RuntimeError, match=r"no checkpoint for step 3 \(it serves 5\)"):
            dst.recv_checkpoint(0, src.metadata(), 3, T)
        src.disallow_checkpoint()
        with pytest.raises(RuntimeError, match="serves nothing"):
            dst.recv_checkpoint(0, src.metadata(), 5, T)
    finally:
        src.shutdown()
        dst.shutdown()


def test_shutdown_answers_a_waiting_request() -> None:
    src, dst = SocketTransport(T), SocketTransport(T)
    closer = threading.Timer(0.5, src.shutdown)
    try:
        closer.start()
        with pytest.raises(RuntimeError, match="serves nothing"):
            dst.recv_checkpoint(0, src.metadata(), 3, T)
    finally:
        closer.join()
        dst.shutdown()

"""A raw-socket checkpoint transport for healing: tensor bytes go from memory to the socket.

torchft's default HTTPTransport streams a ``torch.save`` pickle through an HTTP server; on loopback
that is bounded by serialization copies (~0.5 GB/s measured on 2 busy cores). Here the sender writes
a small skeleton (the state tree with tensors replaced by placeholders, loaded back with
``weights_only=True``, so no arbitrary pickle crosses the wire) and then each tensor's bytes; the
receiver reads them with ``recv_into`` into preallocated tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import socket
import struct
import threading
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torchft.checkpointing.transport import CheckpointTransport

__all__ = ["SocketTransport"]

T = TypeVar("T")
_LEN = struct.Struct("!q")
_TENSOR = "__ttnpu_tensor__"
_CHUNK = 64 * 2**20


def _flatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors.append(tree.detach().to("cpu").contiguous())
        return {_TENSOR: len(tensors) - 1, "dtype": str(tree.dtype), "shape": list(tree.shape)}
    if isinstance(tree, dict):
        return {k: _flatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_flatten(v, tensors) for v in tree)
    return tree


def _unflatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if _TENSOR in tree:
            return tensors[tree[_TENSOR]]
        return {k: _unflatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_unflatten(v, tensors) for v in tree)
    return tree


def _placeholders(tree: Any, out: list[dict[str, Any]]) -> None:
    if isinstance(tree, dict):
        if _TENSOR in tree:
            out.append(tree)
            return
        for v in tree.values():
            _placeholders(v, out)
    elif isinstance(tree, list | tuple):
        for v in tree:
            _placeholders(v, out)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (no numpy: it is not a dependency)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view, min(len(view), _CHUNK))
        if n == 0:
            raise ConnectionError("checkpoint sender closed the connection early")
        view = view[n:]


class SocketTransport(CheckpointTransport[T]):
    """Serve this replica's snapshot to healing peers over TCP; fetch a peer's when healing."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60), host: str | None = None) -> None:
        self._timeout = timeout.total_seconds()
        self._host = host or socket.gethostname()
        self._server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        self._port = self._server.getsockname()[1]
        self._lock = threading.Condition()
        self._served: tuple[int, bytes, list[torch.Tensor]] | None = None
        self._active = 0
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="ttnpu_ft_transport", daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        return f"{self._host}:{self._port}"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        tensors: list[torch.Tensor] = []
        skeleton = io.BytesIO()
        torch.save(_flatten(state_dict, tensors), skeleton)
        with self._lock:
            self._served = (step, skeleton.getvalue(), tensors)
            self._lock.notify_all()  # requests waiting for this step

    def disallow_checkpoint(self) -> None:
        """Stop serving; waits for transfers in flight so their tensors stay valid to the end."""
        with self._lock:
            self._served = None
            self._lock.wait_for(lambda: self._active == 0, timeout=self._timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        host, _, port = metadata.rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout.total_seconds()) as s:
            s.sendall(_LEN.pack(step))
            header = bytearray(_LEN.size)
            _recv_exact(s, memoryview(header))
            (length,) = _LEN.unpack(header)
            if length < 0:
                raise RuntimeError(
                    f"checkpoint source {metadata} has no checkpoint for step {step} "
                    f"(it serves {-length - 2 if length < -1 else 'nothing'})"
                )
            raw = bytearray(length)
            _recv_exact(s, memoryview(raw))
            skeleton = torch.load(io.BytesIO(bytes(raw)), weights_only=True)
            slots: list[dict[str, Any]] = []
            _placeholders(skeleton, slots)
            tensors: list[torch.Tensor] = [torch.empty(0)] * len(slots)
            for slot in slots:
                dtype = getattr(torch, slot["dtype"].removeprefix("torch."))
                tensor = torch.empty(slot["shape"], dtype=dtype)
                _recv_exact(s, _bytes_of(tensor))
                tensors[slot[_TENSOR]] = tensor
        result: T = _unflatten(skeleton, tensors)
        return result

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self._timeout)
            request = bytearray(_LEN.size)
            _recv_exact(conn, memoryview(request))
            (step,) = _LEN.unpack(request)
            with self._lock:
                # Like torchft's HTTPTransport: a joiner may ask before this replica's snapshot of
                # that step is served; hold the request until it is (or the transport closes).
                self._lock.wait_for(
                    lambda: self._closed or (self._served is not None and self._served[0] == step),
                    timeout=self._timeout,
                )
                served = self._served
                if served is None or served[0] != step:
                    have = -1 if served is None else -(served[0] + 2)
                    conn.sendall(_LEN.pack(have))
                    return
                self._active += 1
            try:
                _, skeleton, tensors = served
                conn.sendall(_LEN.pack(len(skeleton)) + skeleton)
                for tensor in tensors:
                    conn.sendall(_bytes_of(tensor))
            finally:
                with self._lock:
                    self._active -= 1
                    self._lock.notify_all()

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()  # requests waiting for a checkpoint get "nothing served"
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        self._server.close()
        if wait:
            self._thread.join(timeout=self._timeout)

"""State carry-over for a rejoining replica: a CPU snapshot on the healthy side, a checked restore.

torchft moves whatever ``state_dict`` returns and hands it to the receiver's ``load_state_dict``;
it checks nothing. A restore here validates every leaf (structure, shape, dtype, DTensor placement)
of every part *before* it writes anything, so a bad payload leaves the replica exactly as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["ReplicaState", "RestoreError", "Stateful", "snapshot_tree"]

# A DTensor leaf travels as its local shard plus what is needed to check it on arrival.
_DTENSOR = "__ttnpu_dtensor__"


class RestoreError(ValueError):
    """A snapshot does not fit the live state; nothing was changed."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict``/``load_state_dict`` (data loaders, LR schedulers, counters)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def snapshot_tree(tree: Any) -> Any:
    """Copy a state tree to CPU: tensors detached and copied, DTensors as local shard + layout."""
    if isinstance(tree, DTensor):
        return {
            _DTENSOR: True,
            "local": _cpu_copy(tree.to_local()),
            "placements": [str(p) for p in tree.placements],
            "shape": list(tree.shape),
        }
    if isinstance(tree, torch.Tensor):
        return _cpu_copy(tree)
    if isinstance(tree, Mapping):
        return {key: snapshot_tree(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(snapshot_tree(value) for value in tree)
    return copy.deepcopy(tree)


def _is_dtensor_leaf(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get(_DTENSOR) is True


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    if _is_dtensor_leaf(value):
        return f"dtensor{tuple(value['shape'])} {value['local'].dtype} {value['placements']}"
    return type(value).__name__


def _check_tensor(live: torch.Tensor, snap: Any, path: str, errors: list[str]) -> None:
    if isinstance(live, DTensor):
        if not _is_dtensor_leaf(snap):
            errors.append(f"{path}: expected a DTensor shard, got {_describe(snap)}")
            return
        placements = [str(p) for p in live.placements]
        if snap["placements"] != placements:
            errors.append(f"{path}: placement {snap['placements']} != live {placements}")
        if list(snap["shape"]) != list(live.shape):
            errors.append(
                f"{path}: global shape {tuple(snap['shape'])} != live {tuple(live.shape)}"
            )
        _check_tensor(live.to_local(), snap["local"], f"{path} (local shard)", errors)
        return
    if not isinstance(snap, torch.Tensor) or _is_dtensor_leaf(snap):
        errors.append(f"{path}: expected {_describe(live)}, got {_describe(snap)}")
        return
    if snap.shape != live.shape:
        errors.append(f"{path}: shape {tuple(snap.shape)} != live {tuple(live.shape)}")
    if snap.dtype != live.dtype:
        errors.append(f"{path}: dtype {snap.dtype} != live {live.dtype}")


def _check(live: Any, snap: Any, path: str, errors: list[str], *, grows: bool = False) -> None:
    """Append to ``errors`` where ``snap`` does not fit ``live``. With ``grows`` (the extras: a
    trainer's own state), a sequence of plain values may differ in length (a history that grew
    on the live replica); a sequence that holds tensors must match in any case."""
    if isinstance(live, torch.Tensor):
        _check_tensor(live, snap, path, errors)
    elif isinstance(live, Mapping):
        if not isinstance(snap, Mapping) or _is_dtensor_leaf(snap):
            errors.append(f"{path}: expected a mapping, got {_describe(snap)}")
            return
        missing, extra = set(live) - set(snap), set(snap) - set(live)
        if missing or extra:
            errors.append(
                f"{path}: keys differ (missing {sorted(map(str, missing))}, "
                f"unexpected {sorted(map(str, extra))})"
            )
        for key in live.keys() & snap.keys():
            _check(live[key], snap[key], f"{path}.{key}", errors, grows=grows)
    elif isinstance(live, list | tuple):
        if not isinstance(snap, list | tuple):
            errors.append(f"{path}: expected a sequence of {len(live)}, got {_describe(snap)}")
            return
        if len(snap) != len(live):
            if not grows or _holds_tensors(live) or _holds_tensors(snap):
                errors.append(f"{path}: expected a sequence of {len(live)}, got {_describe(snap)}")
            return
        for i, (a, b) in enumerate(zip(live, snap, strict=True)):
            _check(a, b, f"{path}[{i}]", errors, grows=grows)
    elif live is not None and snap is not None:
        numbers = (int, float)
        same = type(live) is type(snap) or (
            isinstance(live, numbers)
            and isinstance(snap, numbers)
            and not isinstance(live, bool)
            and not isinstance(snap, bool)
        )
        if not same:
            errors.append(f"{path}: expected {type(live).__name__}, got {type(snap).__name__}")


def _holds_tensors(tree: Any) -> bool:
    if isinstance(tree, torch.Tensor) or _is_dtensor_leaf(tree):
        return True
    if isinstance(tree, Mapping):
        return any(_holds_tensors(value) for value in tree.values())
    if isinstance(tree, list | tuple):
        return any(_holds_tensors(value) for value in tree)
    return False


def _copy_into(live: Any, snap: Any) -> None:
    if isinstance(live, DTensor):
        live.to_local().copy_(snap["local"])
    elif isinstance(live, torch.Tensor):
        live.copy_(snap)
    elif isinstance(live, Mapping):
        for key, value in live.items():
            _copy_into(value, snap[key])
    elif isinstance(live, list | tuple):
        for a, b in zip(live, snap, strict=True):
            _copy_into(a, b)


def _like(local: torch.Tensor, live: DTensor) -> DTensor:
    """``local`` as this rank's shard of a DTensor laid out like ``live``. The global shape and
    stride are given, not inferred: inference assumes even shards, and a dimension that does not
    divide over the mesh (3 rows on 2 ranks) would get a wrong global shape (2 or 0 rows), which
    the next optimizer step refuses."""
    return DTensor.from_local(
        local, live.device_mesh, live.placements, run_check=False,
        shape=live.shape, stride=live.stride(),
    )  # fmt: skip


def _rehydrate_optimizer_state(snap: Any, param: torch.Tensor) -> Any:
    """Turn DTensor leaves of one parameter's optimizer state back into DTensors like the param."""
    if _is_dtensor_leaf(snap):
        assert isinstance(param, DTensor), "validated: DTensor state belongs to a DTensor param"
        local = snap["local"].to(param.to_local().device)
        return _like(local, param)
    if isinstance(snap, Mapping):
        return {key: _rehydrate_optimizer_state(value, param) for key, value in snap.items()}
    return snap


def _is_indexed(optimizer_state: Mapping[str, Any]) -> bool:
    """torch.optim's layout (state keyed by parameter index), as opposed to a state dict keyed
    by parameter name (torchtitan's ``OptimizersContainer``, ``get_optimizer_state_dict``)."""
    return set(optimizer_state) == {"state", "param_groups"}


def _rehydrate_like(live: Any, snap: Any) -> Any:
    """``snap`` (validated against ``live``) with tensors on the live devices and DTensor leaves
    turned back into DTensors laid out like the live ones."""
    if isinstance(live, DTensor):
        local = snap["local"].to(live.to_local().device)
        return _like(local, live)
    if isinstance(live, torch.Tensor):
        return snap.to(live.device)
    if isinstance(live, Mapping):
        return {key: _rehydrate_like(live[key], snap[key]) for key in live}
    if isinstance(live, list | tuple):
        return type(live)(_rehydrate_like(a, b) for a, b in zip(live, snap, strict=True))
    return snap


class ReplicaState:
    """What a replica carries over: model, optimizer, optional LR scheduler, named stateful extras.

    ``snapshot()`` is torchft's ``state_dict`` function and ``restore()`` its ``load_state_dict``.
    The model is written in place (``copy_`` into the live tensors: device, storage and placement
    stay); the optimizer, scheduler and extras load through their own ``load_state_dict``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Stateful | None = None,
        extras: Mapping[str, Stateful] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.extras = dict(extras or {})
        reserved = {"model", "optimizer", "lr_scheduler"} & self.extras.keys()
        if reserved:
            raise ValueError(f"ReplicaState: extras may not be named {sorted(reserved)}")
        self._held: dict[str, Any] | None = None

    def _parts(self) -> dict[str, Stateful]:
        parts: dict[str, Stateful] = dict(self.extras)
        if self.lr_scheduler is not None:
            parts["lr_scheduler"] = self.lr_scheduler
        return parts

    def hold_parts(self, hold: bool) -> None:
        """With ``hold``, copy the LR scheduler and the extras now (a step's start) and serve that
        copy instead of their live state until the next call: a snapshot taken while the step runs
        (torchft's asynchronous quorum serves a heal during the forward) must not catch a
        trainer's counters halfway through it. The model and optimizer do not change before the
        commit and are copied when served."""
        self._held = (
            {name: snapshot_tree(part.state_dict()) for name, part in self._parts().items()}
            if hold
            else None
        )

    def snapshot(self) -> dict[str, Any]:
        """A CPU copy of everything, safe to serve while training continues."""
        snap: dict[str, Any] = {
            "model": snapshot_tree(self.model.state_dict()),
            "optimizer": snapshot_tree(self.optimizer.state_dict()),
        }
        if self._held is not None:
            return {**snap, **self._held}
        for name, part in self._parts().items():
            snap[name] = snapshot_tree(part.state_dict())
        return snap

    def _params_by_id(self) -> dict[int, torch.Tensor]:
        ids = self.optimizer.state_dict()["param_groups"]
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        flat_ids = [i for group in ids for i in group["params"]]
        return dict(zip(flat_ids, params, strict=True))

    def _check_optimizer(self, snap: Any, errors: list[str]) -> None:
        live = self.optimizer.state_dict()
        if not _is_indexed(live):  # keyed by parameter name: every leaf is checked as it is
            _check(live, snap, "optimizer", errors)
            return
        if not isinstance(snap, Mapping) or set(snap) != {"state", "param_groups"}:
            errors.append(
                f"optimizer: expected keys ['param_groups', 'state'], got {_describe(snap)}"
            )
            return
        live_groups = [group["params"] for group in live["param_groups"]]
        snap_groups = [group.get("params") for group in snap["param_groups"]]
        if snap_groups != live_groups:
            errors.append(f"optimizer.param_groups: params {snap_groups} != live {live_groups}")
            return
        for i, (lg, sg) in enumerate(zip(live["param_groups"], snap["param_groups"], strict=True)):
            _check(lg, sg, f"optimizer.param_groups[{i}]", errors)
        params = self._params_by_id()
        for pid, state in snap["state"].items():
            path = f"optimizer.state[{pid}]"
            if pid not in params:
                errors.append(f"{path}: no such parameter")
            elif pid in live["state"]:
                _check(live["state"][pid], state, path, errors)
            elif isinstance(state, Mapping):
                # The live optimizer has not stepped yet: elementwise state must match the param.
                param = params[pid]
                for key, value in state.items():
                    is_tensor = isinstance(value, torch.Tensor) or _is_dtensor_leaf(value)
                    if is_tensor and not (isinstance(value, torch.Tensor) and value.dim() == 0):
                        _check_tensor(param, value, f"{path}.{key}", errors)

    def check(self, snap: Any) -> None:
        """Raise ``RestoreError`` listing every mismatch between ``snap`` and the live state."""
        errors: list[str] = []
        if not isinstance(snap, Mapping):
            raise RestoreError(f"replica snapshot: expected a mapping, got {_describe(snap)}")
        expected = {"model", "optimizer", *self._parts()}
        if set(snap) != expected:
            errors.append(f"snapshot parts {sorted(snap)} != expected {sorted(expected)}")
        else:
            _check(self.model.state_dict(), snap["model"], "model", errors)
            self._check_optimizer(snap["optimizer"], errors)
            for name, part in self._parts().items():
                _check(part.state_dict(), snap[name], name, errors, grows=True)
        if errors:
            shown = "\n  ".join(errors[:20])
            more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
            raise RestoreError(f"replica snapshot does not fit the live state:\n  {shown}{more}")

    def restore(self, snap: Any) -> None:
        """Validate all of ``snap``, then write it into the live state (no change on error)."""
        self.check(snap)
        self._held = None  # the live state is the one to serve from now on
        with torch.no_grad():
            _copy_into(self.model.state_dict(), snap["model"])
        live = self.optimizer.state_dict()
        if not _is_indexed(live):
            self.optimizer.load_state_dict(_rehydrate_like(live, snap["optimizer"]))
            for name, part in self._parts().items():
                part.load_state_dict(snap[name])
            return
        params = self._params_by_id()
        optimizer_snap = {
            "param_groups": snap["optimizer"]["param_groups"],
            "state": {
                pid: _rehydrate_optimizer_state(state, params[pid])
                for pid, state in snap["optimizer"]["state"].items()
            },
        }
        self.optimizer.load_state_dict(optimizer_snap)
        for name, part in self._parts().items():
            part.load_state_dict(snap[name])

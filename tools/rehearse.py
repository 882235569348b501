"""Rehearse one training step of a ttnpu-trainer recipe at full size on one CPU, allocating nothing.

    uv run python tools/rehearse.py --config dsv4_flash --world-size 128 --cp 128 \\
        --seq-len 1048576 --ac full --rank 127

One rank of a ``--world-size`` job: torch's fake process-group backend stands in for the other
ranks (torchtitan's ``--comm.mode fake_backend``), and every tensor is a ``FakeTensor`` (shapes,
dtypes and devices, no storage). The recipe's model is built on the meta device and put through
the real ``parallelize`` of ``ttnpu.dsv4.titan`` (context parallelism, expert parallelism, AC,
FSDP2 over the data x context ranks; compile off), materialised with ``to_empty`` and
``init_weights``, and runs one full step (forward with the model's own loss, backward, the
recipe's AdamW step) at the real sequence length, under a dispatch mode that follows every
storage an op creates until it is freed, and logs every collective.

Routing is the one thing a fake tensor cannot say: which expert a token picks. Under expert
parallelism the rehearsal assumes balanced routing (every rank sends ``tokens x top_k / ep`` rows
to every rank); without it the routed rows are ``tokens x top_k`` whatever the routing.

Prints one JSON line: the rank's parameters, gradients and optimizer state (its shards:
``params_gib``, ``grads_gib``, ``optimizer_gib``), ``activations_gib`` (what the forward leaves
for the backward, FSDP's gathered parameters excluded: the quantity ``tools/cp_memory_model.py``
predicts, printed beside it as ``predicted_activations_gib`` where it models the settings),
``peak_gib`` (live tensor bytes at their highest over the step), where it happens
(``peak_phase``; ``peak_by_phase_gib``: the highest by the end of the forward, the backward and
the optimizer step) and every collective (op, group size, calls, and the bytes torch's
``CollectiveOp`` counts for it: input and output of an all-to-all, the gathered or reduced
tensor otherwise). A plan that cannot run (a degree that does not divide, a sequence too short
for the CP halos) is refused with the one-line error a real run gives, exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

GIB = 2**30
AC_MODES = ("none", "full", "selective")  # selective: torchtitan's per-op SelectiveAC


class StepLedger(TorchDispatchMode):
    """What one rank's step allocates and sends, op by op: the live bytes of every storage an op
    creates (freed when the storage is), their peak, and every collective: (op, group size) ->
    [calls, bytes as torch's ``CollectiveOp`` counts them]. Storages alive at the start
    (parameters, buffers) count as the baseline. FSDP frees and re-fills its unsharded
    parameters by resizing their storages, which no op reports: the sizes are read again at
    every collective (FSDP gathers and reduces every layer's parameters with one)."""

    def __init__(self, baseline: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.storages: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        for tensor in baseline:
            self._track(tensor)
        self.calls: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])

    def _track(self, tensor: torch.Tensor) -> None:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        key = storage._cdata
        if key in self.storages:
            return
        nbytes = storage.nbytes()
        self.storages[key] = (weakref.ref(storage, lambda _: self._free(key)), nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        _, nbytes = self.storages.pop(key)
        self.live -= nbytes

    def _resync(self) -> None:
        for key, (ref, nbytes) in list(self.storages.items()):
            storage = ref()
            if storage is not None and storage.nbytes() != nbytes:
                self.storages[key] = (ref, storage.nbytes())
                self.live += storage.nbytes() - nbytes
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        for out in pytree.tree_leaves(result):
            if isinstance(out, torch.Tensor):
                self._track(out)
        if func in collective_ops and func not in sync_ops:
            self._resync()
            group = CollectiveOp.get_process_group(func, args)
            entry = self.calls[(str(func.overloadpacket), group.size())]
            entry[0] += 1
            entry[1] += CollectiveOp.get_comm_tensor_size(func, result, args, kwargs)
        return result

    def collectives(self) -> list[dict[str, Any]]:
        return [
            {"op": op, "group_size": size, "calls": calls, "gib": round(nbytes / GIB, 4)}
            for (op, size), (calls, nbytes) in sorted(self.calls.items())
        ]


def _balanced_dispatch(moe: Any) -> None:
    """Make a MoE's ``ExpertParallelDispatch`` assume balanced routing: its count exchange (data
    the fake tensors do not hold) answers every rank sending ``rows / ep`` of its ``rows`` (token,
    expert) pairs to every rank, spread evenly over each rank's local experts."""
    dispatch = moe.dispatch
    size = dispatch.size

    def balanced(rows: int, counts: torch.Tensor, local_experts: int) -> Any:
        per_rank = [rows // size + (r < rows % size) for r in range(size)]
        table = [[(n + e) // local_experts for e in range(local_experts)] for n in per_rank]
        with unset_fake_temporarily():
            received = torch.tensor(table)
        return received, per_rank, [sum(row) for row in table]

    def call(x: torch.Tensor, indices: torch.Tensor, *rest: Any) -> torch.Tensor:
        dispatch.exchange_counts = functools.partial(balanced, indices.numel())
        return type(dispatch).__call__(dispatch, x, indices, *rest)

    moe.dispatch = call


def _local_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages of ``tensors`` (DTensors: this rank's shard)."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


class _SavedForBackward(torch.autograd.graph.saved_tensors_hooks):
    """What the forward leaves for the backward: the distinct storages of the tensors autograd
    saves that the graph still holds when the forward ends, parameters and buffers excluded
    (the measure ``tools/cp_memory_model.py --check`` compares its prediction with)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.excluded = {
            (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()._cdata
            for t in (*model.parameters(), *model.buffers())
        }
        self.model = model
        self.packed: list[weakref.ref[_Held]] = []
        super().__init__(self._pack, lambda held: held.tensor)

    def _pack(self, tensor: torch.Tensor) -> _Held:
        held = _Held(tensor)
        self.packed.append(weakref.ref(held))
        return held

    def nbytes(self) -> int:
        held = [ref() for ref in self.packed]
        tensors = [h.tensor for h in held if h is not None]
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        # FSDP's unsharded parameters are parameters (the root's stay gathered until its
        # backward), not activations.
        excluded = self.excluded | {t.untyped_storage()._cdata for t in _unsharded(self.model)}
        kept = [t for t in local if t.untyped_storage()._cdata not in excluded]
        return _local_bytes(kept)


def _unsharded(model: torch.nn.Module) -> list[torch.Tensor]:
    """FSDP2's unsharded parameters (allocated or not) of every FSDP module in ``model``."""
    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group is not None else ():
                if hasattr(param, "_unsharded_param"):
                    out.append(param._unsharded_param)
    return out


class _Held:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def rehearse(args: argparse.Namespace) -> dict[str, Any]:
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from ttnpu.dsv4.moe import MoE
    from ttnpu.dsv4.parallel import ExpertParallelDispatch
    from ttnpu.trainer.config_registry import CONFIGS
    from ttnpu.trainer.platform import activate, detect

    if args.config not in CONFIGS:
        raise ValueError(f"unknown --config {args.config!r}; expected one of {sorted(CONFIGS)}")
    world, cp = args.world_size, args.cp
    for name, value in (("--world-size", world), ("--cp", cp), ("--seq-len", args.seq_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if args.batch < 1 or (args.ep is not None and args.ep < 1):
        raise ValueError(f"--batch and --ep must be >= 1, got {args.batch} and {args.ep}")
    if world % cp:
        raise ValueError(f"--cp {cp} must divide --world-size {world}")
    if not 0 <= args.rank < world:
        raise ValueError(f"--rank must be in [0, {world}), got {args.rank}")
    ep = world if args.ep is None else args.ep
    config = CONFIGS[args.config]()
    config.parallelism.data_parallel_shard_degree = world // cp
    config.parallelism.context_parallel_degree = cp
    config.parallelism.expert_parallel_degree = ep
    config.training.seq_len = args.seq_len
    config.training.local_batch_size = args.batch
    config.compile.enable = False
    config.activation_checkpoint = {
        "none": None,
        "full": FullAC.Config(),
        "selective": SelectiveAC.Config(),
    }[args.ac]
    if args.param_dtype is not None:
        config.training.mixed_precision_param = args.param_dtype
    if config.training.mixed_precision_param == "float32":
        raise ValueError(
            f"{args.config} keeps float32 parameters, and torch's fake kernel of the grouped "
            f"expert matmul takes bfloat16 only; pass --param-dtype bfloat16"
        )
    model_config = config.model_spec.model
    if args.layers is not None:
        full = model_config.dsv4()
        if not 1 <= args.layers <= full.n_layers:
            raise ValueError(f"--layers must be in [1, {full.n_layers}], got {args.layers}")
        model_config.overrides = {
            **model_config.overrides,
            "n_layers": args.layers,
            "compress_ratios": full.compress_ratios[: args.layers],
            "n_hash_layers": min(full.n_hash_layers, args.layers),
        }
    model_config.update_from_config(config=config)  # the real run's checks (seq_len, CP halos)
    dsv4 = model_config.dsv4()

    activate(detect("cpu"))
    dist.init_process_group("fake", rank=args.rank, world_size=world)
    try:
        parallel_dims = ParallelDims.from_config(config.parallelism, world)
        parallel_dims.build_mesh()
        started = time.perf_counter()
        with FakeTensorMode(allow_non_fake_inputs=True):
            with torch.device("meta"):
                model = model_config.build()
            model = config.model_spec.parallelize_fn(
                model,
                parallel_dims=parallel_dims,
                training=config.training,
                parallelism=config.parallelism,
                compile_config=config.compile,
                ac_config=config.activation_checkpoint,
            )
            model.to_empty(device="cpu")
            with torch.no_grad():
                model.init_weights()
            for moe in model.modules():
                if isinstance(moe, MoE) and isinstance(moe.dispatch, ExpertParallelDispatch):
                    _balanced_dispatch(moe)
            optimizer = config.optimizer.build(model_parts=[model])
            tokens = torch.randint(0, dsv4.vocab_size, (args.batch, args.seq_len))
            labels = torch.randint(0, dsv4.vocab_size, (args.batch, args.seq_len))
            inner = model.model
            ledger = StepLedger([*model.parameters(), *model.buffers(), tokens, labels])
            peaks = {}
            with ledger:
                saved = _SavedForBackward(model)
                with saved:
                    loss = inner.loss(tokens, labels)
                activations = saved.nbytes()
                peaks["forward"] = round(ledger.peak / GIB, 4)
                loss.backward()
                del loss
                grads = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
                peaks["backward"] = round(ledger.peak / GIB, 4)
                optimizer.step()
                optimizer.zero_grad()
                peaks["optimizer"] = round(ledger.peak / GIB, 4)
            states = _local_bytes(
                t
                for opt in optimizer.optimizers
                for state in opt.state.values()
                for t in state.values()
                if isinstance(t, torch.Tensor)
            )
            params = _local_bytes([*model.parameters(), *model.buffers()])
        elapsed = time.perf_counter() - started
    finally:
        dist.destroy_process_group()
    result: dict[str, Any] = {
        "config": args.config,
        "world_size": world,
        "cp": cp,
        "ep": ep,
        "dp_shard": world // cp,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "ac": args.ac,
        "rank": args.rank,
        "params_gib": round(params / GIB, 4),
        "grads_gib": round(grads / GIB, 4),
        "optimizer_gib": round(states / GIB, 4),
        "activations_gib": round(activations / GIB, 4),
        "peak_gib": peaks["optimizer"],
        "peak_phase": next(phase for phase, value in peaks.items() if value == peaks["optimizer"]),
        "peak_by_phase_gib": peaks,
        "predicted_activations_gib": None,
        "collectives": ledger.collectives(),
        "rehearsal_s": round(elapsed, 1),
    }
    if args.ac in ("none", "full"):
        import cp_memory_model  # beside this script (its folder is on sys.path)

        prediction = cp_memory_model.predict(
            dsv4, args.seq_len, cp, args.batch, 2, rank=args.rank % cp, ac=args.ac, ep=ep
        )
        result["predicted_activations_gib"] = round(prediction.saved_bytes / GIB, 4)
    return result


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/rehearse.py", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--config", default="dsv4_flash", help="ttnpu-train recipe")
    parser.add_argument("--world-size", type=int, default=128)
    parser.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    parser.add_argument(
        "--ep", type=int, default=None, help="expert-parallel degree (default: the world size)"
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--ac", choices=AC_MODES, default="full")
    parser.add_argument("--rank", type=int, default=0, help="the rank rehearsed")
    parser.add_argument(
        "--layers", type=int, default=None, help="only the first N layers (default: all)"
    )
    parser.add_argument(
        "--param-dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="FSDP's parameter dtype (default: the recipe's)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        result = rehearse(args)
    except ValueError as err:
        print(f"rehearse: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

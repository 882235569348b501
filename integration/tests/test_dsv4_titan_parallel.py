"""DeepSeek-V4 sharded on torchtitan's build path equals one process.

Each case builds the ModelSpec exactly as torchtitan's Trainer does: ``set_determinism``, the
model on the meta device, ``parallelize_fn`` with a real ``ParallelDims`` on 2 gloo ranks,
``to_empty``, ``init_weights``, the optimizer container plus the spec's post-optimizer hook, the
forward and backward in the Trainer's SPMD context, and torchtitan's ``clip_grad_norm_``. The
2-rank run must start from the very same weights as a 1-process build of the same spec (bit for
bit), and give the same losses, gradients, clipped norms, expert biases and weights after a few
AdamW steps (fp32 tolerance); with bf16 mixed precision, a first loss near it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

STEPS, BATCH, SEQ, SEED, MAX_NORM = 3, 4, 24, 1234, 0.5
# dp_shard = 2 in each: (ep degree, torchtitan spmd_backend). The backends name the dense shard
# mesh differently ("dp_shard" / "fsdp"); parallelize must find it under either.
CASES = {"fsdp2-ep2": (2, "spmd_types"), "fsdp2-ep1-partial-dtensor": (1, "partial_dtensor")}
OVERRIDES: dict[str, Any] = dict(n_layers=3, compress_ratios=(0, 4, 8))
# A routed expert, a learned gate, FSDP-sharded dense weights of a CSA block, the embedding.
WATCHED = (
    "model.layers.1.ffn.experts.w2",
    "model.layers.2.ffn.experts.w1",
    "model.layers.1.ffn.gate.weight",
    "model.layers.1.attn.indexer.compressor.wkv.weight",
    "model.layers.2.hc_ffn_fn",
    "model.embed.weight",
)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    return tokens, torch.roll(tokens, -1, 1)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _run(
    parallel_dims: Any, rank: int, world: int, param_dtype: str = "float32", steps: int = STEPS
) -> dict[str, Any]:
    """Build, initialise and train through torchtitan's path; the full-size record of it."""
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config.configs import DebugConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    from ttnpu.dsv4.titan import model_spec

    dist_utils.set_determinism(
        parallel_dims, torch.device("cpu"), DebugConfig(seed=SEED), distinct_seed_mesh_dims=["pp"]
    )
    spec = model_spec("micro", **OVERRIDES)
    with torch.device("meta"):
        model = spec.model.build()
    training = TrainingConfig(mixed_precision_param=param_dtype)
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=training)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    # eps 1e-6: Adam scales each gradient element to about lr, so near-zero gradients (whose
    # last bits depend on the reduction order) must not turn into lr-sized differences.
    optimizers = default_adamw(lr=1e-2, eps=1e-6).build(model_parts=[model])
    assert spec.post_optimizer_build_fn is not None
    spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)

    record: dict[str, Any] = {"init": {n: _full(p) for n, p in model.named_parameters()}}
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    tokens, labels = (t[shard] for t in _batch())
    # The Trainer's forward/backward context and input annotations (spmd_types backend).
    context = contextlib.nullcontext
    if world > 1:
        context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    if world > 1 and parallel_dims.spmd_backend == "spmd_types":
        tokens, labels, _ = annotate_input_spmd_types(parallel_dims, tokens, labels, {})
    losses, norms = [], []
    for step in range(steps):
        with context():
            # torchtitan's normalisation: each rank's loss over the global token count (here
            # equal shares), gradients summed over the ranks by FSDP and the EP all-to-all
            loss = model(tokens, labels) / world
            loss.backward()
        if step == 0:
            named = dict(model.named_parameters())
            record["grads"] = {n: _full(named[n].grad) for n in WATCHED}
        norm = dist_utils.clip_grad_norm_(
            list(model.parameters()), MAX_NORM, foreach=True, ep_enabled=parallel_dims.ep_enabled
        )
        optimizers.step()
        optimizers.zero_grad()
        loss = loss.detach()
        if world > 1:
            torch.distributed.all_reduce(loss)
        losses.append(loss)
        norms.append(_full(norm))
    record.update(
        losses=torch.stack(losses),
        norms=torch.stack(norms),
        final={n: _full(p) for n, p in model.named_parameters()},
        biases={n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")},
    )
    return record


def _worker(rank: int, world: int, port: int, out: Path) -> None:
    """Every case in one pair of processes (importing the stack is most of a case's cost)."""
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims

    from ttnpu.trainer.platform import activate

    torch.set_num_threads(1)
    activate("cpu")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    records = {}
    for case, (ep, backend) in CASES.items():
        dims = ParallelDims(
            dp_replicate=1,
            dp_shard=world,
            cp=1,
            tp=1,
            pp=1,
            ep=ep,
            world_size=world,
            spmd_backend=backend,
        )
        records[case] = _run(dims, rank, world)
        if ep > 1:  # the training config's bf16 mixed precision, through parallelize_fn
            records[case]["bf16"] = _run(dims, rank, world, "bfloat16", steps=1)
    torch.save(records, out)
    dist.barrier()  # leave together, without the teardown (see test_dsv4_fsdp_ep.py)
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    from torchtitan.distributed import ParallelDims

    torch.set_num_threads(1)
    return _run(ParallelDims(1, 1, 1, 1, 1, 1, world_size=1), 0, 1)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Per rank, the record of every case, from one run of 2 worker processes."""
    folder, port, world = tmp_path_factory.mktemp("titan_parallel"), _free_port(), 2
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                str(rank),
                str(world),
                str(port),
                str(folder / f"{rank}.pt"),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(world)
    ]
    try:
        assert [p.wait(timeout=400) for p in procs] == [0, 0]
    finally:
        for p in procs:  # a rank left waiting on a failed peer
            p.kill()
    return [torch.load(folder / f"{rank}.pt") for rank in range(world)]


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_build_matches_one_process(
    case: str, reference: dict[str, Any], sharded: list[dict[str, Any]]
) -> None:
    ranks = [records[case] for records in sharded]
    for name, value in reference["init"].items():  # the unsharded init, exactly, on every rank
        for rank in ranks:
            assert torch.equal(rank["init"][name], value), name
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        for name in WATCHED:
            torch.testing.assert_close(
                rank["grads"][name], reference["grads"][name], rtol=1e-4, atol=1e-7
            )
        torch.testing.assert_close(rank["norms"], reference["norms"], rtol=1e-5, atol=0)
        for name, bias in reference["biases"].items():
            assert torch.equal(rank["biases"][name], bias), name
        for name, value in reference["final"].items():
            torch.testing.assert_close(
                rank["final"][name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
    if CASES[case][0] > 1:
        for rank in ranks:
            bf16 = rank["bf16"]
            torch.testing.assert_close(bf16["losses"], reference["losses"][:1], rtol=2e-2, atol=0)
            for name, grad in bf16["grads"].items():
                assert grad.dtype == torch.float32 and torch.isfinite(grad).all(), name
    assert (reference["norms"] > MAX_NORM).all()  # clipping was active, so its norm mattered
    assert reference["losses"][-1] < reference["losses"][0]
    assert any(bias.abs().sum() > 0 for bias in reference["biases"].values())


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))

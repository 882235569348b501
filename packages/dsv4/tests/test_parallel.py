"""Expert parallelism and FSDP2 on one gloo rank: the meta-device path (shard, to_empty,
init_weights) gives the unsharded init and forward, bf16 mixed precision runs, and bad use is
refused. Several ranks are
tested in integration/tests (test_dsv4_fsdp_ep.py, test_dsv4_titan_parallel.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config
from ttnpu.dsv4.parallel import apply_expert_parallel, apply_fsdp


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _sharded_on_meta(config: DeepSeekV4Config, mesh: DeviceMesh) -> DeepSeekV4:
    with torch.device("meta"):
        model = DeepSeekV4(config)
    apply_expert_parallel(model, mesh)
    apply_fsdp(model, mesh)
    model.to_empty(device="cpu")
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def test_meta_sharded_model_inits_and_runs_like_an_eager_one(
    tiny: DeepSeekV4Config, mesh: DeviceMesh
) -> None:
    model = _sharded_on_meta(tiny, mesh)
    torch.manual_seed(5)
    model.init_weights()
    eager = DeepSeekV4(tiny)
    torch.manual_seed(5)
    eager.init_weights()
    params = dict(model.named_parameters())
    assert isinstance(params["layers.1.ffn.experts.w1"], DTensor)  # EP: a DTensor on the mesh
    assert isinstance(params["layers.1.attn_norm.weight"], DTensor)  # FSDP
    for name, expected in eager.named_parameters():
        assert torch.equal(_full(params[name]).detach(), expected.detach()), name
    tokens = torch.randint(0, tiny.vocab_size, (2, 16))
    labels = torch.roll(tokens, -1, 1)
    torch.testing.assert_close(model.loss(tokens, labels), eager.loss(tokens, labels))


def test_a_failed_init_leaves_every_shard_as_it_was(
    tiny: DeepSeekV4Config, mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _sharded_on_meta(tiny, mesh)
    model.init_weights()
    before = {name: (p, _full(p).detach().clone()) for name, p in model.named_parameters()}

    def broken(std: float, hc_scale: float) -> None:
        raise RuntimeError("init failed")

    monkeypatch.setattr(model.layers[2], "reset_parameters", broken)
    with pytest.raises(RuntimeError, match="init failed"):
        model.init_weights()
    after = dict(model.named_parameters())
    for name, (param, value) in before.items():
        assert after[name] is param, name  # the sharded parameter itself is back in place
        if name.startswith("layers.2."):
            assert torch.equal(_full(param).detach(), value), name


def test_expert_parallel_refuses_a_model_it_already_sharded(
    tiny: DeepSeekV4Config, mesh: DeviceMesh
) -> None:
    model = DeepSeekV4(tiny)
    apply_expert_parallel(model, mesh)
    with pytest.raises(ValueError, match="already applied"):
        apply_expert_parallel(model, mesh)


def test_expert_parallel_needs_a_one_dimensional_mesh(
    tiny: DeepSeekV4Config, mesh: DeviceMesh
) -> None:
    square = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match="1-D mesh"):
        apply_expert_parallel(DeepSeekV4(tiny), square)


def test_bf16_mixed_precision_stays_near_the_fp32_loss_with_fp32_gradients(
    tiny: DeepSeekV4Config, mesh: DeviceMesh
) -> None:
    with torch.device("meta"):
        model = DeepSeekV4(tiny)
    apply_expert_parallel(model, mesh)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    apply_fsdp(model, mesh, policy)
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    model.init_weights()
    eager = DeepSeekV4(tiny)
    torch.manual_seed(5)
    eager.init_weights()
    tokens = torch.randint(0, tiny.vocab_size, (2, 16))
    labels = torch.roll(tokens, -1, 1)
    loss = model.loss(tokens, labels)  # the compressors' fp32 projections meet bf16 weights
    loss.backward()
    assert model.layers[1].ffn.experts.param_dtype == torch.bfloat16  # EP experts, outside FSDP
    torch.testing.assert_close(loss, eager.loss(tokens, labels), rtol=2e-2, atol=0)
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32, name
        assert param.grad is not None and param.grad.dtype == torch.float32, name
        assert torch.isfinite(_full(param.grad)).all(), name


def test_context_parallelism_is_applied_once_and_before_expert_parallelism(
    tiny: DeepSeekV4Config, mesh: DeviceMesh
) -> None:
    from ttnpu.dsv4.parallel import apply_context_parallel

    model = DeepSeekV4(tiny)
    apply_context_parallel(model, mesh)
    with pytest.raises(ValueError, match="already applied"):
        apply_context_parallel(model, mesh)
    sharded = DeepSeekV4(tiny)
    apply_expert_parallel(sharded, mesh)
    with pytest.raises(ValueError, match="before expert parallelism"):
        apply_context_parallel(sharded, mesh)
